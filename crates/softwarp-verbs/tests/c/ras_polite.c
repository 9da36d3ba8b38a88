/* Run by softwarp-cli's tests/exec.rs under `softwarp exec` (with and without --ras): opens
 * the device, makes a PD, a CQ and an rdma_cm listener (the calls that could start
 * Softwarp's RAS services), then prints "ready ctl=N" where N is the number of this process's
 * threads named softwarp-ctl* (read from /proc/self/task/TID/comm), and waits for a line on
 * stdin while the test looks at the runtime directory. Exits 0 after tearing everything
 * down. */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "check.h"

static int ctl_threads(void)
{
	DIR *d = opendir("/proc/self/task");
	CHECK(d);
	int n = 0;
	struct dirent *e;
	while ((e = readdir(d)) != NULL) {
		if (e->d_name[0] == '.')
			continue;
		char path[300], comm[64] = { 0 };
		snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
		FILE *f = fopen(path, "r");
		if (!f)
			continue; /* the thread ended meanwhile */
		if (fgets(comm, sizeof comm, f) && strncmp(comm, "softwarp-ctl", 12) == 0)
			n++;
		fclose(f);
	}
	closedir(d);
	return n;
}

int main(void)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n == 1);
	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd);
	struct ibv_cq *cq = ibv_create_cq(ctx, 4, NULL, NULL, 0);
	CHECK(cq);

	struct rdma_event_channel *ch = rdma_create_event_channel();
	CHECK(ch);
	struct rdma_cm_id *id;
	CHECK(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) == 0);
	struct sockaddr_in sin = { .sin_family = AF_INET };
	sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	CHECK(rdma_bind_addr(id, (struct sockaddr *)&sin) == 0);
	CHECK(rdma_listen(id, 1) == 0);

	/* A thread takes its name when it first runs (Rust's std names it from inside), which
	 * on a loaded machine can be a while after the call that started it: with the services
	 * asked for, wait (at most 5 s) for the name to show; without, give a late starter the
	 * same chance to show up wrongly (300 ms). */
	const char *ras = getenv("SOFTWARP_RAS");
	int asked = ras && strcmp(ras, "on") == 0;
	int ctl = ctl_threads();
	for (int i = 0; i < (asked ? 500 : 30) && (asked ? ctl == 0 : 1); i++) {
		usleep(10 * 1000);
		ctl = ctl_threads();
	}
	printf("ready ctl=%d\n", ctl);
	fflush(stdout);
	char line[16];
	if (!fgets(line, sizeof line, stdin))
		line[0] = 0;

	CHECK(rdma_destroy_id(id) == 0);
	rdma_destroy_event_channel(ch);
	CHECK(ibv_destroy_cq(cq) == 0);
	CHECK(ibv_dealloc_pd(pd) == 0);
	CHECK(ibv_close_device(ctx) == 0);
	ibv_free_device_list(list);
	return 0;
}
