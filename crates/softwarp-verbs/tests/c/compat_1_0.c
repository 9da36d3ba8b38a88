/* A program of libibverbs 1.0's ABI (run by tests/debian_tools.rs): it binds to the
 * IBVERBS_1.0 versions (ibv_open_device@IBVERBS_1.0, ...), whose objects have 1.0's layout
 * (struct ibv_context_1_0 and the others, below, as libibverbs 1.0 defined them and
 * rdma-core's compat-1_0.c keeps them), and calls the data path through the 1.0 context's
 * ops: device list, context, queries, PD, MR, CQ with a completion channel, QP, SRQ, posts
 * through ops (a bad work request named by its 1.0 element), completions and a CQ event in
 * 1.0 terms, address handles and multicast refused as on the current ABI.
 * Prints "ok: N checks". */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>

#include "check.h"

struct ibv_device_1_0 {
	void *obsolete_sysfs_dev;
	void *obsolete_sysfs_ibdev;
	struct ibv_device *real_device;
	void *ops[2];
};

struct ibv_cq_1_0;
struct ibv_qp_1_0;
struct ibv_srq_1_0;

struct ibv_recv_wr_1_0 {
	struct ibv_recv_wr_1_0 *next;
	uint64_t wr_id;
	struct ibv_sge *sg_list;
	int num_sge;
};

struct ibv_send_wr_1_0 {
	struct ibv_send_wr_1_0 *next;
	uint64_t wr_id;
	struct ibv_sge *sg_list;
	int num_sge;
	enum ibv_wr_opcode opcode;
	int send_flags;
	uint32_t imm_data;
	union {
		struct {
			uint64_t remote_addr;
			uint32_t rkey;
		} rdma;
		struct {
			uint64_t remote_addr;
			uint64_t compare_add;
			uint64_t swap;
			uint32_t rkey;
		} atomic;
	} wr;
};

struct ibv_context_ops_1_0 {
	void *before_poll[7];
	int (*poll_cq)(struct ibv_cq_1_0 *cq, int num_entries, struct ibv_wc *wc);
	int (*req_notify_cq)(struct ibv_cq_1_0 *cq, int solicited_only);
	void *before_srq_recv[7];
	int (*post_srq_recv)(struct ibv_srq_1_0 *srq, struct ibv_recv_wr_1_0 *wr,
			     struct ibv_recv_wr_1_0 **bad);
	void *before_send[4];
	int (*post_send)(struct ibv_qp_1_0 *qp, struct ibv_send_wr_1_0 *wr,
			 struct ibv_send_wr_1_0 **bad);
	int (*post_recv)(struct ibv_qp_1_0 *qp, struct ibv_recv_wr_1_0 *wr,
			 struct ibv_recv_wr_1_0 **bad);
	void *after_recv[4];
};

struct ibv_context_1_0 {
	struct ibv_device_1_0 *device;
	struct ibv_context_ops_1_0 ops;
	int cmd_fd;
	int async_fd;
	int num_comp_vectors;
	struct ibv_context *real_context;
};

struct ibv_pd_1_0 {
	struct ibv_context_1_0 *context;
	uint32_t handle;
	struct ibv_pd *real_pd;
};

struct ibv_mr_1_0 {
	struct ibv_context_1_0 *context;
	struct ibv_pd_1_0 *pd;
	uint32_t handle;
	uint32_t lkey;
	uint32_t rkey;
	struct ibv_mr *real_mr;
};

struct ibv_srq_1_0 {
	struct ibv_context_1_0 *context;
	void *srq_context;
	struct ibv_pd_1_0 *pd;
	uint32_t handle;
	pthread_mutex_t mutex;
	pthread_cond_t cond;
	uint32_t events_completed;
	struct ibv_srq *real_srq;
};

struct ibv_qp_init_attr_1_0 {
	void *qp_context;
	struct ibv_cq_1_0 *send_cq;
	struct ibv_cq_1_0 *recv_cq;
	struct ibv_srq_1_0 *srq;
	struct ibv_qp_cap cap;
	enum ibv_qp_type qp_type;
	int sq_sig_all;
};

struct ibv_qp_1_0 {
	struct ibv_context_1_0 *context;
	void *qp_context;
	struct ibv_pd_1_0 *pd;
	struct ibv_cq_1_0 *send_cq;
	struct ibv_cq_1_0 *recv_cq;
	struct ibv_srq_1_0 *srq;
	uint32_t handle;
	uint32_t qp_num;
	enum ibv_qp_state state;
	enum ibv_qp_type qp_type;
	pthread_mutex_t mutex;
	pthread_cond_t cond;
	uint32_t events_completed;
	struct ibv_qp *real_qp;
};

struct ibv_cq_1_0 {
	struct ibv_context_1_0 *context;
	void *cq_context;
	uint32_t handle;
	int cqe;
	pthread_mutex_t mutex;
	pthread_cond_t cond;
	uint32_t comp_events_completed;
	uint32_t async_events_completed;
	struct ibv_cq *real_cq;
};

/* The 1.0 entry points, bound to their version. */
#define OLD(ret, name, args)                                                   \
	ret old_##name args;                                                   \
	__asm__(".symver old_" #name ", " #name "@IBVERBS_1.0")

OLD(struct ibv_device_1_0 **, ibv_get_device_list, (int *num));
OLD(void, ibv_free_device_list, (struct ibv_device_1_0 **list));
OLD(const char *, ibv_get_device_name, (struct ibv_device_1_0 *device));
OLD(__be64, ibv_get_device_guid, (struct ibv_device_1_0 *device));
OLD(struct ibv_context_1_0 *, ibv_open_device, (struct ibv_device_1_0 *device));
OLD(int, ibv_close_device, (struct ibv_context_1_0 *context));
OLD(int, ibv_get_async_event, (struct ibv_context_1_0 *context, struct ibv_async_event *event));
OLD(void, ibv_ack_async_event, (struct ibv_async_event *event));
OLD(int, ibv_query_device, (struct ibv_context_1_0 *context, struct ibv_device_attr *attr));
OLD(int, ibv_query_port, (struct ibv_context_1_0 *context, uint8_t port, struct ibv_port_attr *a));
OLD(int, ibv_query_gid, (struct ibv_context_1_0 *context, uint8_t port, int index, union ibv_gid *g));
OLD(int, ibv_query_pkey, (struct ibv_context_1_0 *context, uint8_t port, int index, __be16 *pkey));
OLD(struct ibv_pd_1_0 *, ibv_alloc_pd, (struct ibv_context_1_0 *context));
OLD(int, ibv_dealloc_pd, (struct ibv_pd_1_0 *pd));
OLD(struct ibv_mr_1_0 *, ibv_reg_mr, (struct ibv_pd_1_0 *pd, void *addr, size_t len, int access));
OLD(int, ibv_dereg_mr, (struct ibv_mr_1_0 *mr));
OLD(struct ibv_cq_1_0 *, ibv_create_cq,
    (struct ibv_context_1_0 *context, int cqe, void *cq_context, struct ibv_comp_channel *ch,
     int comp_vector));
OLD(int, ibv_resize_cq, (struct ibv_cq_1_0 *cq, int cqe));
OLD(int, ibv_destroy_cq, (struct ibv_cq_1_0 *cq));
OLD(int, ibv_get_cq_event, (struct ibv_comp_channel *ch, struct ibv_cq_1_0 **cq, void **ctx));
OLD(void, ibv_ack_cq_events, (struct ibv_cq_1_0 *cq, unsigned int nevents));
OLD(struct ibv_srq_1_0 *, ibv_create_srq, (struct ibv_pd_1_0 *pd, struct ibv_srq_init_attr *a));
OLD(int, ibv_modify_srq, (struct ibv_srq_1_0 *srq, struct ibv_srq_attr *a, int mask));
OLD(int, ibv_query_srq, (struct ibv_srq_1_0 *srq, struct ibv_srq_attr *a));
OLD(int, ibv_destroy_srq, (struct ibv_srq_1_0 *srq));
OLD(struct ibv_qp_1_0 *, ibv_create_qp, (struct ibv_pd_1_0 *pd, struct ibv_qp_init_attr_1_0 *a));
OLD(int, ibv_query_qp,
    (struct ibv_qp_1_0 *qp, struct ibv_qp_attr *a, int mask, struct ibv_qp_init_attr_1_0 *init));
OLD(int, ibv_modify_qp, (struct ibv_qp_1_0 *qp, struct ibv_qp_attr *a, int mask));
OLD(int, ibv_destroy_qp, (struct ibv_qp_1_0 *qp));
OLD(void *, ibv_create_ah, (struct ibv_pd_1_0 *pd, struct ibv_ah_attr *a));
OLD(int, ibv_destroy_ah, (void *ah));
OLD(int, ibv_attach_mcast, (struct ibv_qp_1_0 *qp, union ibv_gid *gid, uint16_t lid));
OLD(int, ibv_detach_mcast, (struct ibv_qp_1_0 *qp, union ibv_gid *gid, uint16_t lid));

int main(void)
{
	int n = -1;
	struct ibv_device_1_0 **list = old_ibv_get_device_list(&n);
	CHECK(list && n == 1 && list[0] && list[1] == NULL);
	CHECK(strcmp(old_ibv_get_device_name(list[0]), "softwarp0") == 0);
	CHECK(old_ibv_get_device_guid(list[0]) == ibv_get_device_guid(list[0]->real_device));

	struct ibv_context_1_0 *ctx = old_ibv_open_device(list[0]);
	CHECK(ctx && ctx->device == list[0] && ctx->real_context);
	CHECK(ctx->ops.poll_cq && ctx->ops.req_notify_cq && ctx->ops.post_send &&
	      ctx->ops.post_recv && ctx->ops.post_srq_recv);
	CHECK(ctx->ops.before_poll[0] == NULL && ctx->ops.after_recv[3] == NULL);
	CHECK(ctx->async_fd == ctx->real_context->async_fd);
	struct ibv_device_attr da;
	CHECK(old_ibv_query_device(ctx, &da) == 0 && da.max_qp > 0 && da.phys_port_cnt == 1);
	struct ibv_port_attr pa;
	CHECK(old_ibv_query_port(ctx, 1, &pa) == 0 && pa.state == IBV_PORT_ACTIVE);
	union ibv_gid gid;
	CHECK(old_ibv_query_gid(ctx, 1, 0, &gid) == 0);
	__be16 pkey;
	CHECK(old_ibv_query_pkey(ctx, 1, 0, &pkey) == 0);

	/* No async event waits: a non-blocking read says so. */
	int fl = fcntl(ctx->async_fd, F_GETFL);
	CHECK(fcntl(ctx->async_fd, F_SETFL, fl | O_NONBLOCK) == 0);
	struct ibv_async_event ae;
	errno = 0;
	CHECK(old_ibv_get_async_event(ctx, &ae) == -1 && errno == EAGAIN);

	struct ibv_pd_1_0 *pd = old_ibv_alloc_pd(ctx);
	CHECK(pd && pd->context == ctx && pd->real_pd);
	static char buf[4096];
	struct ibv_mr_1_0 *mr = old_ibv_reg_mr(pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr && mr->pd == pd && mr->context == ctx);
	CHECK(mr->lkey == mr->real_mr->lkey && mr->rkey == mr->real_mr->rkey);

	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx->real_context);
	CHECK(ch);
	void *cq_ctx = (void *)(uintptr_t)0x1234;
	struct ibv_cq_1_0 *cq = old_ibv_create_cq(ctx, 8, cq_ctx, ch, 0);
	CHECK(cq && cq->context == ctx && cq->cq_context == cq_ctx && cq->cqe == 8);
	CHECK(cq->real_cq->cq_context == cq);
	CHECK(old_ibv_resize_cq(cq, 16) == 0 && cq->real_cq->cqe >= 16);

	struct ibv_qp_init_attr_1_0 ia = {
		.qp_context = (void *)(uintptr_t)0x99,
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp_1_0 *qp = old_ibv_create_qp(pd, &ia);
	CHECK(qp && qp->pd == pd && qp->send_cq == cq && qp->recv_cq == cq && qp->srq == NULL);
	CHECK(qp->qp_num == qp->real_qp->qp_num && qp->qp_num != 0 && qp->real_qp->qp_context == qp);
	CHECK(ia.cap.max_send_wr >= 4 && ia.cap.max_recv_wr >= 4);
	struct ibv_qp_attr qa = { .qp_state = IBV_QPS_INIT };
	CHECK(old_ibv_modify_qp(qp, &qa, IBV_QP_STATE) == 0);
	struct ibv_qp_init_attr_1_0 got;
	memset(&got, 0, sizeof got);
	CHECK(old_ibv_query_qp(qp, &qa, IBV_QP_STATE, &got) == 0 && qa.qp_state == IBV_QPS_INIT);
	CHECK(got.send_cq == cq && got.recv_cq == cq && got.srq == NULL && got.qp_type == IBV_QPT_RC);
	CHECK(got.qp_context == (void *)(uintptr_t)0x99);

	/* Two receives through the 1.0 ops, then the QP to error: both flush, with a CQ event
	 * naming the 1.0 CQ and its context. */
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 64, .lkey = mr->lkey };
	struct ibv_recv_wr_1_0 r[2] = {
		{ .next = &r[1], .wr_id = 21, .sg_list = &sge, .num_sge = 1 },
		{ .next = NULL, .wr_id = 22, .sg_list = &sge, .num_sge = 1 },
	};
	struct ibv_recv_wr_1_0 *rbad = NULL;
	CHECK(ctx->ops.post_recv(qp, r, &rbad) == 0 && rbad == NULL);
	CHECK(ctx->ops.req_notify_cq(cq, 0) == 0);
	qa.qp_state = IBV_QPS_ERR;
	CHECK(old_ibv_modify_qp(qp, &qa, IBV_QP_STATE) == 0);
	struct ibv_cq_1_0 *ev_cq = NULL;
	void *ev_ctx = NULL;
	CHECK(old_ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0 && ev_cq == cq && ev_ctx == cq_ctx);
	old_ibv_ack_cq_events(cq, 1);
	struct ibv_wc wc[4];
	CHECK(ctx->ops.poll_cq(cq, 4, wc) == 2);
	CHECK(wc[0].wr_id == 21 && wc[1].wr_id == 22 && wc[0].status == IBV_WC_WR_FLUSH_ERR);

	/* A bad work request is named by its 1.0 element. */
	struct ibv_send_wr_1_0 s[2] = {
		{ .next = &s[1], .wr_id = 31, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND },
		{ .next = NULL, .wr_id = 32, .sg_list = &sge, .num_sge = 1000, .opcode = IBV_WR_SEND },
	};
	struct ibv_send_wr_1_0 *sbad = NULL;
	CHECK(ctx->ops.post_send(qp, s, &sbad) != 0 && sbad == &s[1]);

	/* Address handles and multicast: refused, as on the current ABI. */
	struct ibv_ah_attr aa;
	memset(&aa, 0, sizeof aa);
	CHECK(old_ibv_create_ah(pd, &aa) == NULL);
	CHECK(old_ibv_attach_mcast(qp, &gid, 0) != 0);
	CHECK(old_ibv_detach_mcast(qp, &gid, 0) != 0);

	/* An SRQ and its receives through the 1.0 ops. */
	struct ibv_srq_init_attr sa = { .srq_context = (void *)(uintptr_t)0x55,
					.attr = { .max_wr = 4, .max_sge = 1 } };
	struct ibv_srq_1_0 *srq = old_ibv_create_srq(pd, &sa);
	CHECK(srq && srq->pd == pd && srq->srq_context == (void *)(uintptr_t)0x55);
	CHECK(srq->real_srq->srq_context == srq);
	struct ibv_srq_attr sq;
	CHECK(old_ibv_query_srq(srq, &sq) == 0 && sq.max_wr >= 4);
	sq.srq_limit = 1;
	CHECK(old_ibv_modify_srq(srq, &sq, IBV_SRQ_LIMIT) == 0);
	r[0].next = NULL;
	CHECK(ctx->ops.post_srq_recv(srq, r, &rbad) == 0);
	CHECK(old_ibv_destroy_srq(srq) == 0);

	CHECK(old_ibv_destroy_qp(qp) == 0);
	CHECK(old_ibv_destroy_cq(cq) == 0);
	CHECK(ibv_destroy_comp_channel(ch) == 0);
	CHECK(old_ibv_dereg_mr(mr) == 0);
	CHECK(old_ibv_dealloc_pd(pd) == 0);
	CHECK(old_ibv_close_device(ctx) == 0);
	old_ibv_free_device_list(list);
	(void)old_ibv_ack_async_event;
	(void)old_ibv_destroy_ah;
	printf("ok: %d checks\n", checks);
	return 0;
}
