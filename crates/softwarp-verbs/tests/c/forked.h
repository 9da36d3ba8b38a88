/* What the two-process C tests share (live_ops.c, close_order.c): one check macro that names
 * the side and the line and exits on failure, the address of 127.0.0.1:PORT for rdma_cm, RC
 * QP attributes, and main's fork of the client beside the server (forked_main). Included by a
 * single source file each (static definitions). */
#ifndef SOFTWARP_TESTS_FORKED_H
#define SOFTWARP_TESTS_FORKED_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <rdma/rdma_cma.h>

static const char *who = "?";
static int checks;

#define CHECK(cond, ...)                                                  \
	do {                                                              \
		if (!(cond)) {                                            \
			fprintf(stderr, "%s: FAILED %s (line %d): ", who, \
				#cond, __LINE__);                         \
			fprintf(stderr, __VA_ARGS__);                     \
			fprintf(stderr, " (errno %d)\n", errno);          \
			exit(1);                                          \
		}                                                         \
		checks++;                                                 \
	} while (0)

static struct rdma_addrinfo *addrinfo(const char *port, int passive)
{
	struct rdma_addrinfo hints, *res;
	memset(&hints, 0, sizeof hints);
	hints.ai_port_space = RDMA_PS_TCP;
	if (passive)
		hints.ai_flags = RAI_PASSIVE;
	int rc = rdma_getaddrinfo("127.0.0.1", port, &hints, &res);
	CHECK(rc == 0, "rdma_getaddrinfo");
	return res;
}

/* An RC QP with `wrs` send and receive work requests of one SGE, every Send signaled. */
static void init_attr(struct ibv_qp_init_attr *a, unsigned wrs)
{
	memset(a, 0, sizeof *a);
	a->cap.max_send_wr = wrs;
	a->cap.max_recv_wr = wrs;
	a->cap.max_send_sge = 1;
	a->cap.max_recv_sge = 1;
	a->qp_type = IBV_QPT_RC;
	a->sq_sig_all = 1;
}

/* The write end of the pipe the forked client waits on (forked_main). */
static int forked_ready_fd = -1;

/* The server listens: the client, waiting in forked_main, may connect. */
static void forked_ready(void)
{
	CHECK(write(forked_ready_fd, "l", 1) == 1, "tell the client");
}

/* main of a two-process test, `PROGRAM PORT`: forks `client`, which starts once `server`
 * (run in this process) calls forked_ready, and exits with the status `client` returns;
 * checks that the client succeeded, prints the server's count of checks and returns what
 * `server` returned. Both sides end within 30 s (alarm). */
static int forked_main(int argc, char **argv, int (*client)(const char *port),
		       int (*server)(const char *port))
{
	if (argc != 2) {
		fprintf(stderr, "usage: %s PORT\n", argv[0]);
		return 2;
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	alarm(30);
	int p[2];
	CHECK(pipe(p) == 0, "pipe");
	pid_t child = fork();
	CHECK(child >= 0, "fork");
	if (child == 0) {
		char c;
		who = "client";
		close(p[1]);
		CHECK(read(p[0], &c, 1) == 1, "the server did not start");
		exit(client(argv[1]));
	}
	close(p[0]);
	who = "server";
	forked_ready_fd = p[1];
	int rc = server(argv[1]);
	int status;
	CHECK(waitpid(child, &status, 0) == child, "waitpid");
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "client status %#x", status);
	printf("ok: %d server checks\n", checks);
	return rc;
}

#endif
