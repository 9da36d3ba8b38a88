/* Built against Debian's libibverbs-dev headers and run over Softwarp's libibverbs.so.1 by
 * tests/debian_tools.rs: rdma-core's return conventions for bad arguments and unsupported
 * features, iWARP's QP state rules, SRQ attributes, and the application's control of its
 * descriptors (blocking by default, EAGAIN once O_NONBLOCK is set). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>

#include "check.h"

int main(void)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n == 1 && list[1] == NULL);
	CHECK(strcmp(ibv_get_device_name(list[0]), "softwarp0") == 0);
	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx);

	/* Bad arguments and unsupported features. */
	errno = 0;
	CHECK(ibv_alloc_pd(NULL) == NULL && errno == EINVAL);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd);
	char *buf = calloc(1, 4096);
	errno = 0;
	CHECK(ibv_reg_mr(pd, NULL, 0, IBV_ACCESS_LOCAL_WRITE) == NULL && errno == EINVAL);
	errno = 0;
	CHECK(ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_ON_DEMAND) == NULL && errno == EOPNOTSUPP);
	errno = 0;
	CHECK(ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_REMOTE_WRITE) == NULL && errno == EINVAL);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
	CHECK(mr && mr->addr == buf && mr->length == 4096 && mr->lkey == mr->rkey);
	errno = 0;
	CHECK(ibv_create_cq(ctx, 0, NULL, NULL, 0) == NULL && errno == EINVAL);
	CHECK(ibv_create_cq(ctx, 16, NULL, NULL, 5) == NULL && errno == EINVAL);
	struct ibv_port_attr pa;
	CHECK(ibv_query_port(ctx, 2, &pa) == EINVAL);
	CHECK(ibv_query_port(ctx, 1, &pa) == 0 && pa.state == IBV_PORT_ACTIVE &&
	      pa.link_layer == IBV_LINK_LAYER_ETHERNET);
	union ibv_gid gid;
	CHECK(ibv_query_gid(ctx, 1, 5, &gid) != 0);
	struct ibv_ah_attr ah = {0};
	errno = 0;
	CHECK(ibv_create_ah(pd, &ah) == NULL && errno == EOPNOTSUPP);

	/* Completion channel: blocking until the application says otherwise. */
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	CHECK(ch);
	CHECK((fcntl(ch->fd, F_GETFL) & O_NONBLOCK) == 0);
	CHECK(fcntl(ch->fd, F_SETFL, fcntl(ch->fd, F_GETFL) | O_NONBLOCK) == 0);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, buf, ch, 0);
	CHECK(cq && cq->cqe >= 16 && cq->channel == ch && cq->cq_context == buf);
	CHECK(ibv_resize_cq(cq, 32) == 0 && cq->cqe == 32);
	CHECK(ibv_resize_cq(cq, 0) == EINVAL && cq->cqe == 32);
	CHECK(ibv_req_notify_cq(cq, 0) == 0);
	struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
	CHECK(poll(&pfd, 1, 0) == 0);
	struct ibv_cq *ev_cq;
	void *ev_ctx;
	errno = 0;
	CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == -1 && errno == EAGAIN);
	struct ibv_wc wc;
	CHECK(ibv_poll_cq(cq, 1, &wc) == 0);
	CHECK(ibv_destroy_comp_channel(ch) == EBUSY);

	/* The device's asynchronous events, likewise. */
	CHECK((fcntl(ctx->async_fd, F_GETFL) & O_NONBLOCK) == 0);
	CHECK(fcntl(ctx->async_fd, F_SETFL, O_NONBLOCK) == 0);
	struct ibv_async_event aev;
	errno = 0;
	CHECK(ibv_get_async_event(ctx, &aev) == -1 && errno == EAGAIN);

	/* QPs: RC only; iWARP's state rules. */
	struct ibv_qp_init_attr ia = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_UD,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	errno = 0;
	CHECK(ibv_create_qp(pd, &ia) == NULL && errno == EOPNOTSUPP);
	ia.qp_type = IBV_QPT_RC;
	ia.cap.max_inline_data = 4096;
	errno = 0;
	CHECK(ibv_create_qp(pd, &ia) == NULL && errno == EINVAL);
	ia.cap.max_inline_data = 64;
	/* Receives complete into a CQ of their own, to see ibv_resize_cq keep them. */
	struct ibv_cq *rcq = ibv_create_cq(ctx, 4, NULL, NULL, 0);
	CHECK(rcq);
	ia.recv_cq = rcq;
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	CHECK(qp && qp->state == IBV_QPS_RESET && ia.cap.max_inline_data >= 64);
	struct ibv_qp_attr qa = { .qp_state = IBV_QPS_INIT };
	CHECK(ibv_modify_qp(qp, &qa, IBV_QP_STATE) == 0 && qp->state == IBV_QPS_INIT);
	qa.qp_state = IBV_QPS_RTS;
	CHECK(ibv_modify_qp(qp, &qa, IBV_QP_STATE) == EINVAL && qp->state == IBV_QPS_INIT);
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 7, .sg_list = &sge, .num_sge = 1,
				  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED };
	struct ibv_send_wr *bad = NULL;
	CHECK(ibv_post_send(qp, &wr, &bad) != 0 && bad == &wr);
	wr.opcode = IBV_WR_BIND_MW;
	bad = NULL;
	CHECK(ibv_post_send(qp, &wr, &bad) == EOPNOTSUPP && bad == &wr);
	for (int i = 1; i <= 3; i++) {
		struct ibv_recv_wr rw = { .wr_id = i, .sg_list = &sge, .num_sge = 1 }, *rb;
		CHECK(ibv_post_recv(qp, &rw, &rb) == 0);
	}
	qa.qp_state = IBV_QPS_ERR;
	CHECK(ibv_modify_qp(qp, &qa, IBV_QP_STATE) == 0 && qp->state == IBV_QPS_ERR);
	/* The three flushed receives wait in rcq: a resize below them is refused (EINVAL, as
	 * rdma-core's providers), one to exactly them keeps them in order. */
	int cqe_before = rcq->cqe;
	CHECK(ibv_resize_cq(rcq, 2) == EINVAL && rcq->cqe == cqe_before);
	CHECK(ibv_resize_cq(rcq, 3) == 0 && rcq->cqe == 3);
	struct ibv_wc rwc[4];
	CHECK(ibv_poll_cq(rcq, 4, rwc) == 3 && rwc[0].wr_id == 1 && rwc[1].wr_id == 2 &&
	      rwc[2].wr_id == 3 && rwc[2].status == IBV_WC_WR_FLUSH_ERR);
	qa.qp_state = IBV_QPS_RESET;
	CHECK(ibv_modify_qp(qp, &qa, IBV_QP_STATE) == 0 && qp->state == IBV_QPS_RESET);
	struct ibv_qp_init_attr got;
	CHECK(ibv_query_qp(qp, &qa, IBV_QP_STATE | IBV_QP_CAP, &got) == 0 &&
	      qa.qp_state == IBV_QPS_RESET && got.send_cq == cq && got.qp_type == IBV_QPT_RC);
	CHECK(ibv_destroy_qp(qp) == 0);
	CHECK(ibv_destroy_cq(rcq) == 0);

	/* SRQ attributes. */
	struct ibv_srq_init_attr si = { .attr = { .max_wr = 32, .max_sge = 1, .srq_limit = 0 } };
	struct ibv_srq *srq = ibv_create_srq(pd, &si);
	CHECK(srq);
	struct ibv_srq_attr sa = { .srq_limit = 8 };
	CHECK(ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT) == 0);
	CHECK(ibv_modify_srq(srq, &sa, IBV_SRQ_MAX_WR) == EOPNOTSUPP);
	memset(&sa, 0, sizeof sa);
	CHECK(ibv_query_srq(srq, &sa) == 0 && sa.max_wr == 32 && sa.srq_limit == 8);
	struct ibv_recv_wr rwr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1 }, *rbad;
	CHECK(ibv_post_srq_recv(srq, &rwr, &rbad) == 0);
	CHECK(ibv_destroy_srq(srq) == 0);

	CHECK(ibv_destroy_cq(cq) == 0);
	CHECK(ibv_destroy_comp_channel(ch) == 0);
	CHECK(ibv_dereg_mr(mr) == 0);
	CHECK(ibv_dealloc_pd(pd) == 0);
	CHECK(ibv_close_device(ctx) == 0);
	ibv_free_device_list(list);
	free(buf);
	printf("ok: %d checks\n", checks);
	return 0;
}
