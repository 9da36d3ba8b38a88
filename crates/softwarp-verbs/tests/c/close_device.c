/* Built against Debian's libibverbs-dev headers and run over Softwarp's libibverbs.so.1 by
 * tests/debian_tools.rs: ibv_close_device closes the device as Device::close does. A thread
 * polls the CQ while the main thread closes the context with a QP, CQ, PD and MR still
 * alive: the close waits for the calls in flight, the QP goes to Error and its posted
 * receives flush (the polling thread gets them after the close), new posts are refused
 * with EIO, and the application can still destroy what it holds. A context closed with
 * nothing left is freed at once and the device opens again; the rdma_cm's context is
 * librdmacm's and stays open. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "check.h"

#define RECEIVES 3

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

struct poller {
	struct ibv_cq *cq;
	struct ibv_wc wc[RECEIVES];
	int got;
	int polls;
};

/* Polls until every posted receive completed (bounded: 10 s). */
static void *poll_thread(void *arg)
{
	struct poller *p = arg;
	double deadline = now() + 10;
	while (p->got < RECEIVES && now() < deadline) {
		int n = ibv_poll_cq(p->cq, RECEIVES - p->got, &p->wc[p->got]);
		if (n < 0) {
			fprintf(stderr, "ibv_poll_cq failed (errno %d)\n", errno);
			exit(1);
		}
		p->got += n;
		p->polls++;
	}
	return NULL;
}

int main(void)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n == 1);
	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	char *buf = calloc(1, 4096);
	CHECK(pd && cq && buf);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr);
	struct ibv_qp_init_attr qa = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &qa);
	CHECK(qp);
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 64, .lkey = mr->lkey };
	struct ibv_recv_wr r[RECEIVES], *rbad = NULL;
	for (int i = 0; i < RECEIVES; i++) {
		memset(&r[i], 0, sizeof r[i]);
		r[i].wr_id = 100 + i;
		r[i].sg_list = &sge;
		r[i].num_sge = 1;
		r[i].next = i + 1 < RECEIVES ? &r[i + 1] : NULL;
	}
	CHECK(ibv_post_recv(qp, r, &rbad) == 0);

	/* Close while another thread is polling the CQ. */
	struct poller p = { .cq = cq };
	pthread_t t;
	CHECK(pthread_create(&t, NULL, poll_thread, &p) == 0);
	while (__atomic_load_n(&p.polls, __ATOMIC_RELAXED) < 10)
		;
	CHECK(ibv_close_device(ctx) == 0);
	CHECK(pthread_join(t, NULL) == 0);
	CHECK(p.got == RECEIVES);
	for (int i = 0; i < RECEIVES; i++)
		CHECK(p.wc[i].wr_id == 100 + (uint64_t)i && p.wc[i].status == IBV_WC_WR_FLUSH_ERR &&
		      p.wc[i].opcode == IBV_WC_RECV);
	printf("closed with a thread polling: %d flushed receives polled after the close\n", p.got);

	/* New work is refused; what the application holds can still be destroyed. */
	struct ibv_recv_wr again = { .wr_id = 7, .sg_list = &sge, .num_sge = 1 };
	rbad = NULL;
	CHECK(ibv_post_recv(qp, &again, &rbad) == EIO && rbad == &again);
	struct ibv_send_wr s = { .wr_id = 8, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND };
	struct ibv_send_wr *sbad = NULL;
	CHECK(ibv_post_send(qp, &s, &sbad) == EIO && sbad == &s);
	struct ibv_wc wc;
	CHECK(ibv_poll_cq(cq, 1, &wc) == 0);
	CHECK(ibv_destroy_qp(qp) == 0);
	CHECK(ibv_dereg_mr(mr) == 0);
	CHECK(ibv_destroy_cq(cq) == 0);
	CHECK(ibv_dealloc_pd(pd) == 0);
	printf("after the close: posts refused with EIO, objects destroyed\n");

	/* A context with nothing left closes at once; the device opens again. */
	ctx = ibv_open_device(list[0]);
	CHECK(ctx);
	pd = ibv_alloc_pd(ctx);
	CHECK(pd && ibv_dealloc_pd(pd) == 0);
	CHECK(ibv_close_device(ctx) == 0);
	ibv_free_device_list(list);

	/* The rdma_cm's context is librdmacm's: closing it leaves it open. */
	struct ibv_context **cms = rdma_get_devices(&n);
	CHECK(cms && n == 1 && cms[0]);
	CHECK(ibv_close_device(cms[0]) == 0);
	pd = ibv_alloc_pd(cms[0]);
	CHECK(pd && ibv_dealloc_pd(pd) == 0);
	rdma_free_devices(cms);
	printf("the rdma_cm's context stays open\n");
	printf("ok: %d checks\n", checks);
	return 0;
}
