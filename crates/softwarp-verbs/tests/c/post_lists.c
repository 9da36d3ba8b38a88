/* Built against Debian's libibverbs-dev headers and run over Softwarp's libibverbs.so.1 by
 * tests/debian_tools.rs: chained work request lists as rdma-core's providers post them. Two
 * QPs connected with rdma_cm on loopback in one process. A receive list with a bad work
 * request in the middle posts those before it and names it in `bad_wr`; a send list mixing
 * registered SGEs, inline data in one SGE and inline data gathered from three, then an
 * unsupported opcode, sends the first four in order and names the fifth; a batch of the
 * extended API (`ibv_wr_*`) goes in order; completions come one at a time with n = 1 and
 * several at a time, with the right ids, lengths and bytes. */
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "check.h"

#define SLOT 64
#define RECEIVES 7

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static struct rdma_cm_id *expect(struct rdma_event_channel *ch, enum rdma_cm_event_type want)
{
	struct rdma_cm_event *ev;
	CHECK(rdma_get_cm_event(ch, &ev) == 0);
	if (ev->event != want || ev->status) {
		fprintf(stderr, "expected %s, got %s (status %d)\n", rdma_event_str(want),
			rdma_event_str(ev->event), ev->status);
		exit(1);
	}
	struct rdma_cm_id *id = ev->id;
	rdma_ack_cm_event(ev);
	return id;
}

/* Polls `cq` `per_poll` entries at a time until `want` completions arrived (10 s); each
 * poll returns at most what it was asked for. */
static void take(struct ibv_cq *cq, struct ibv_wc *wc, int want, int per_poll)
{
	int got = 0;
	double deadline = now() + 10;
	while (got < want) {
		int room = want - got < per_poll ? want - got : per_poll;
		int n = ibv_poll_cq(cq, room, wc + got);
		if (n < 0 || n > room || now() > deadline) {
			fprintf(stderr, "ibv_poll_cq: %d of %d, %d of %d in time\n", n, room, got, want);
			exit(1);
		}
		got += n;
	}
}

int main(void)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_cm_id *lid, *cid;
	CHECK(ch && rdma_create_id(ch, &lid, NULL, RDMA_PS_TCP) == 0 &&
	      rdma_create_id(ch, &cid, NULL, RDMA_PS_TCP) == 0);
	struct sockaddr_in sin = { .sin_family = AF_INET };
	sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	CHECK(rdma_bind_addr(lid, (struct sockaddr *)&sin) == 0 && rdma_listen(lid, 1) == 0);
	sin.sin_port = rdma_get_src_port(lid);
	CHECK(rdma_resolve_addr(cid, NULL, (struct sockaddr *)&sin, 2000) == 0);
	expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED);
	CHECK(rdma_resolve_route(cid, 2000) == 0);
	expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED);

	struct ibv_context *ctx = cid->verbs;
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *scq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	struct ibv_cq *rcq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	char *src = calloc(1, 4096), *dst = calloc(1, 4096);
	CHECK(pd && scq && rcq && src && dst);
	struct ibv_mr *smr = ibv_reg_mr(pd, src, 4096, 0);
	struct ibv_mr *dmr = ibv_reg_mr(pd, dst, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(smr && dmr);
	struct ibv_qp_init_attr qa = {
		.send_cq = scq, .recv_cq = scq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 1, .max_send_sge = 4, .max_recv_sge = 1,
			 .max_inline_data = 64 },
	};
	CHECK(rdma_create_qp(cid, pd, &qa) == 0);
	struct rdma_conn_param param = { .initiator_depth = 1, .responder_resources = 1 };
	CHECK(rdma_connect(cid, &param) == 0);
	struct rdma_cm_id *rid = expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST);
	struct ibv_qp_init_attr ra = {
		.send_cq = rcq, .recv_cq = rcq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 1, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	CHECK(rdma_create_qp(rid, pd, &ra) == 0);

	/* Receives: a list whose third has more SGEs than a work request may carry. */
	struct ibv_sge rsge[RECEIVES], many[9];
	struct ibv_recv_wr r[RECEIVES], *rbad = NULL;
	memset(many, 0, sizeof many);
	for (int i = 0; i < RECEIVES; i++) {
		rsge[i] = (struct ibv_sge){ .addr = (uintptr_t)(dst + i * SLOT), .length = SLOT,
					    .lkey = dmr->lkey };
		r[i] = (struct ibv_recv_wr){ .wr_id = 100 + i, .sg_list = &rsge[i], .num_sge = 1,
					     .next = i + 1 < RECEIVES ? &r[i + 1] : NULL };
	}
	r[2].sg_list = many;
	r[2].num_sge = 9;
	CHECK(ibv_post_recv(rid->qp, r, &rbad) == EINVAL && rbad == &r[2]);
	r[2].sg_list = &rsge[2];
	r[2].num_sge = 1;
	CHECK(ibv_post_recv(rid->qp, &r[2], &rbad) == 0);
	CHECK(rdma_accept(rid, &param) == 0);
	expect(ch, RDMA_CM_EVENT_ESTABLISHED);
	expect(ch, RDMA_CM_EVENT_ESTABLISHED);

	/* Sends: registered, inline in one SGE, inline from three, registered (signalled),
	 * then an opcode Softwarp does not implement, and one after it. */
	strcpy(src, "alpha");
	strcpy(src + SLOT, "delta");
	char bravo[] = "bravo", c1[] = "ch", c2[] = "ar", c3[] = "lie";
	struct ibv_sge s_alpha = { .addr = (uintptr_t)src, .length = 5, .lkey = smr->lkey };
	struct ibv_sge s_bravo = { .addr = (uintptr_t)bravo, .length = 5 };
	struct ibv_sge s_charlie[3] = { { .addr = (uintptr_t)c1, .length = 2 },
					{ .addr = (uintptr_t)c2, .length = 2 },
					{ .addr = (uintptr_t)c3, .length = 3 } };
	struct ibv_sge s_delta = { .addr = (uintptr_t)(src + SLOT), .length = 5, .lkey = smr->lkey };
	struct ibv_send_wr s[6], *sbad = NULL;
	memset(s, 0, sizeof s);
	for (int i = 0; i < 6; i++) {
		s[i].wr_id = i;
		s[i].opcode = IBV_WR_SEND;
		s[i].next = i + 1 < 6 ? &s[i + 1] : NULL;
	}
	s[0].sg_list = &s_alpha, s[0].num_sge = 1;
	s[1].sg_list = &s_bravo, s[1].num_sge = 1, s[1].send_flags = IBV_SEND_INLINE;
	s[2].sg_list = s_charlie, s[2].num_sge = 3, s[2].send_flags = IBV_SEND_INLINE;
	s[3].sg_list = &s_delta, s[3].num_sge = 1, s[3].send_flags = IBV_SEND_SIGNALED;
	s[4].opcode = IBV_WR_BIND_MW;
	s[5].sg_list = &s_alpha, s[5].num_sge = 1;
	CHECK(ibv_post_send(cid->qp, s, &sbad) == EOPNOTSUPP && sbad == &s[4]);

	/* The extended API: three Sends in one batch. */
	strcpy(src + 2 * SLOT, "echo");
	strcpy(src + 3 * SLOT, "golf");
	struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(cid->qp);
	CHECK(qx);
	ibv_wr_start(qx);
	qx->wr_id = 10, qx->wr_flags = 0;
	ibv_wr_send(qx);
	ibv_wr_set_sge(qx, smr->lkey, (uintptr_t)(src + 2 * SLOT), 4);
	qx->wr_id = 11, qx->wr_flags = IBV_SEND_INLINE;
	ibv_wr_send(qx);
	ibv_wr_set_inline_data(qx, "foxtrot", 7);
	qx->wr_id = 12, qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(qx);
	ibv_wr_set_sge(qx, smr->lkey, (uintptr_t)(src + 3 * SLOT), 4);
	CHECK(ibv_wr_complete(qx) == 0);

	/* Receives one completion per poll, in order, each with its bytes. */
	const char *words[RECEIVES] = { "alpha", "bravo", "charlie", "delta", "echo", "foxtrot",
					"golf" };
	struct ibv_wc wc[RECEIVES];
	take(rcq, wc, RECEIVES, 1);
	for (int i = 0; i < RECEIVES; i++) {
		CHECK(wc[i].status == IBV_WC_SUCCESS && wc[i].opcode == IBV_WC_RECV);
		CHECK(wc[i].wr_id == 100 + (uint64_t)i && wc[i].qp_num == rid->qp->qp_num);
		CHECK(wc[i].byte_len == strlen(words[i]) && wc[i].wc_flags == 0);
		CHECK(memcmp(dst + i * SLOT, words[i], wc[i].byte_len) == 0);
	}
	printf("received in order: alpha bravo charlie delta echo foxtrot golf\n");
	/* The two signalled Sends, in one poll of up to 8. */
	take(scq, wc, 2, 8);
	CHECK(wc[0].wr_id == 3 && wc[0].status == IBV_WC_SUCCESS && wc[0].opcode == IBV_WC_SEND);
	CHECK(wc[1].wr_id == 12 && wc[1].status == IBV_WC_SUCCESS && wc[1].opcode == IBV_WC_SEND);
	CHECK(ibv_poll_cq(scq, 8, wc) == 0);
	printf("send completions: 3 12\n");

	rdma_disconnect(cid);
	rdma_destroy_qp(cid);
	rdma_destroy_qp(rid);
	ibv_dereg_mr(smr);
	ibv_dereg_mr(dmr);
	ibv_destroy_cq(scq);
	ibv_destroy_cq(rcq);
	ibv_dealloc_pd(pd);
	rdma_destroy_id(rid);
	rdma_destroy_id(cid);
	rdma_destroy_id(lid);
	rdma_destroy_event_channel(ch);
	printf("ok: %d checks\n", checks);
	return 0;
}
