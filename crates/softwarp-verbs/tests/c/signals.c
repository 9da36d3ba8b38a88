/* Signals over the C ABI (run by tests/debian_tools.rs): a handled signal ends the blocking
 * waits with -1/EINTR, as rdma-core's read of its channel does for a handler installed
 * without SA_RESTART (qperf ends its waits with SIGALRM this way), and the signal reaches
 * the application's thread, never one of the library's (they block every signal: the
 * handler records the thread it ran on). */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "check.h"

static volatile sig_atomic_t fired;
static pthread_t handled_on;

static void on_alarm(int sig)
{
	(void)sig;
	fired++;
	handled_on = pthread_self();
}

/* Arms SIGALRM for 200 ms from now. */
static void arm(void)
{
	struct itimerval t = { .it_value = { .tv_usec = 200 * 1000 } };
	CHECK(setitimer(ITIMER_REAL, &t, NULL) == 0);
}

/* The library's threads (progress, connection manager) exist before the signals. */
static void check_handled_here(int before)
{
	CHECK(fired == before + 1);
	CHECK(pthread_equal(handled_on, pthread_self()));
}

int main(void)
{
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_alarm;
	sigemptyset(&sa.sa_mask);
	sa.sa_flags = 0; /* no SA_RESTART: the waits end with EINTR */
	CHECK(sigaction(SIGALRM, &sa, NULL) == 0);

	struct ibv_device **list = ibv_get_device_list(NULL);
	CHECK(list && list[0]);
	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx);
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	CHECK(ch);
	struct ibv_cq *cq = ibv_create_cq(ctx, 4, NULL, ch, 0);
	CHECK(cq);
	CHECK(ibv_req_notify_cq(cq, 0) == 0);
	struct rdma_event_channel *cm = rdma_create_event_channel();
	CHECK(cm);
	struct rdma_cm_id *id;
	CHECK(rdma_create_id(cm, &id, NULL, RDMA_PS_TCP) == 0);

	/* ibv_get_cq_event on a CQ nothing completes on. */
	struct ibv_cq *got_cq;
	void *got_ctx;
	arm();
	errno = 0;
	CHECK(ibv_get_cq_event(ch, &got_cq, &got_ctx) == -1 && errno == EINTR);
	check_handled_here(0);

	/* rdma_get_cm_event on a channel with no event coming. */
	struct rdma_cm_event *ev;
	arm();
	errno = 0;
	CHECK(rdma_get_cm_event(cm, &ev) == -1 && errno == EINTR);
	check_handled_here(1);

	/* ibv_get_async_event with no event coming. */
	struct ibv_async_event aev;
	arm();
	errno = 0;
	CHECK(ibv_get_async_event(ctx, &aev) == -1 && errno == EINTR);
	check_handled_here(2);

	CHECK(rdma_destroy_id(id) == 0);
	rdma_destroy_event_channel(cm);
	CHECK(ibv_destroy_cq(cq) == 0);
	CHECK(ibv_destroy_comp_channel(ch) == 0);
	CHECK(ibv_close_device(ctx) == 0);
	ibv_free_device_list(list);
	printf("ok: %d checks\n", checks);
	return 0;
}
