/* Destroying objects that other objects still use (run by tests/debian_tools.rs, under
 * valgrind's memcheck when it is installed): every pair rdma-core's kernel refuses answers
 * EBUSY (as the return value of the ibv_* call and in errno; ibv_destroy_comp_channel
 * returns it without touching errno, as rdma-core does) and leaves the object as it was,
 * still working: the refused PD registers memory and re-registers the MR that kept it
 * alive, the refused CQs take the flushed completions of the QPs that kept them, the refused
 * SRQ takes receives, ibv_query_qp still names the CQs. Then the objects go in a wrong order
 * (each refusal again EBUSY) and the right one (each 0). The pairs: PD with an MR, a QP or an
 * SRQ; CQ as a QP's send CQ, receive CQ or both; SRQ with a QP; completion channel with a CQ;
 * a PD and CQs given to rdma_create_qp; and rdma_destroy_id of an id with a QP, which
 * rdma-core allows (the QP stays the application's, usable, and is destroyed with
 * ibv_destroy_qp). Memory windows and address handles, which the kernel also counts on a
 * PD, cannot be made on Softwarp (EOPNOTSUPP). */
#include <arpa/inet.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "check.h"

/* `call` is refused with EBUSY returned and in errno. */
#define BUSY(call)                                                       \
	do {                                                             \
		errno = 0;                                               \
		int rc_ = (call);                                        \
		CHECK(rc_ == EBUSY && errno == EBUSY);                   \
	} while (0)

static struct ibv_qp *make_qp(struct ibv_pd *pd, struct ibv_cq *scq, struct ibv_cq *rcq,
			      struct ibv_srq *srq)
{
	struct ibv_qp_init_attr ia = {
		.send_cq = scq, .recv_cq = rcq, .srq = srq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	CHECK(qp);
	return qp;
}

/* Posts `n` receives to `qp`, moves it to ERROR and polls their `n` flushed completions
 * from `cq`, the QP's receive CQ. */
static void flush_receives(struct ibv_qp *qp, struct ibv_cq *cq, struct ibv_mr *mr, int n)
{
	struct ibv_sge sge = { .addr = (uintptr_t)mr->addr, .length = 8, .lkey = mr->lkey };
	for (int i = 0; i < n; i++) {
		struct ibv_recv_wr rw = { .wr_id = 100 + i, .sg_list = &sge, .num_sge = 1 }, *rb;
		CHECK(ibv_post_recv(qp, &rw, &rb) == 0);
	}
	struct ibv_qp_attr qa = { .qp_state = IBV_QPS_ERR };
	CHECK(ibv_modify_qp(qp, &qa, IBV_QP_STATE) == 0);
	struct ibv_wc wc[8];
	CHECK(ibv_poll_cq(cq, 8, wc) == n);
	for (int i = 0; i < n; i++)
		CHECK(wc[i].wr_id == (uint64_t)(100 + i) && wc[i].status == IBV_WC_WR_FLUSH_ERR &&
		      wc[i].qp_num == qp->qp_num);
}

static void verbs_pairs(struct ibv_context *ctx)
{
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd);
	char *buf = calloc(1, 4096), *buf2 = calloc(1, 4096);
	CHECK(buf && buf2);

	/* PD with an MR (the case of the report: a later ibv_rereg_mr used the freed PD). */
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr && mr->pd == pd);
	BUSY(ibv_dealloc_pd(pd));
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
			   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ) == 0 && mr->pd == pd);
	struct ibv_mr *mr2 = ibv_reg_mr(pd, buf2, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr2 && mr2->pd == pd);
	CHECK(ibv_dereg_mr(mr2) == 0);
	BUSY(ibv_dealloc_pd(pd));

	/* A completion channel with a CQ; CQs as send CQ, receive CQ, both; an SRQ. */
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	CHECK(ch);
	struct ibv_cq *scq = ibv_create_cq(ctx, 8, NULL, ch, 0);
	struct ibv_cq *rcq = ibv_create_cq(ctx, 8, NULL, NULL, 0);
	struct ibv_cq *bcq = ibv_create_cq(ctx, 8, NULL, NULL, 0);
	CHECK(scq && rcq && bcq);
	errno = 0;
	CHECK(ibv_destroy_comp_channel(ch) == EBUSY && errno == 0);
	struct ibv_srq_init_attr si = { .attr = { .max_wr = 8, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(pd, &si);
	CHECK(srq);
	struct ibv_qp *qp = make_qp(pd, scq, rcq, NULL);
	struct ibv_qp *qp2 = make_qp(pd, bcq, bcq, NULL);
	struct ibv_qp *sqp = make_qp(pd, bcq, bcq, srq);

	BUSY(ibv_destroy_cq(scq));
	BUSY(ibv_destroy_cq(rcq));
	BUSY(ibv_destroy_cq(bcq));
	BUSY(ibv_destroy_srq(srq));
	BUSY(ibv_dealloc_pd(pd));
	errno = 0;
	CHECK(ibv_destroy_comp_channel(ch) == EBUSY && errno == 0);

	/* All still work. */
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr got;
	CHECK(ibv_query_qp(qp, &qa, IBV_QP_STATE, &got) == 0 && got.send_cq == scq &&
	      got.recv_cq == rcq && scq->channel == ch);
	CHECK(ibv_req_notify_cq(scq, 0) == 0);
	flush_receives(qp, rcq, mr, 3);
	flush_receives(qp2, bcq, mr, 2);
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey };
	struct ibv_recv_wr rw = { .wr_id = 7, .sg_list = &sge, .num_sge = 1 }, *rb;
	CHECK(ibv_post_srq_recv(srq, &rw, &rb) == 0);
	struct ibv_srq_attr sa;
	CHECK(ibv_query_srq(srq, &sa) == 0 && sa.max_wr == 8);
	mr2 = ibv_reg_mr(pd, buf2, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr2 && mr2->pd == pd);

	/* A wrong order: each object still used is refused, then goes once its users are gone. */
	CHECK(ibv_destroy_qp(qp2) == 0);
	BUSY(ibv_destroy_cq(bcq)); /* still sqp's */
	CHECK(ibv_destroy_qp(qp) == 0);
	CHECK(ibv_destroy_cq(rcq) == 0);
	errno = 0;
	CHECK(ibv_destroy_comp_channel(ch) == EBUSY && errno == 0);
	CHECK(ibv_destroy_cq(scq) == 0);
	CHECK(ibv_destroy_comp_channel(ch) == 0);
	BUSY(ibv_destroy_srq(srq));
	BUSY(ibv_dealloc_pd(pd));
	CHECK(ibv_destroy_qp(sqp) == 0);
	CHECK(ibv_destroy_cq(bcq) == 0);
	BUSY(ibv_dealloc_pd(pd)); /* the SRQ and the MRs */
	CHECK(ibv_destroy_srq(srq) == 0);
	BUSY(ibv_dealloc_pd(pd)); /* the MRs */
	CHECK(ibv_dereg_mr(mr2) == 0);
	BUSY(ibv_dealloc_pd(pd));
	CHECK(ibv_dereg_mr(mr) == 0);
	CHECK(ibv_dealloc_pd(pd) == 0);
	free(buf);
	free(buf2);
}

/* Resolves `id` (on its channel) to 127.0.0.1: the id has the device then, and its PD (a
 * loopback bind would leave it without, as the kernel's rdma_cm does). */
static void resolve_loopback(struct rdma_cm_id *id)
{
	struct sockaddr_in dst = { .sin_family = AF_INET, .sin_port = htons(9),
				   .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000) == 0);
	struct rdma_cm_event *ev;
	CHECK(rdma_get_cm_event(id->channel, &ev) == 0);
	CHECK(ev->id == id && ev->event == RDMA_CM_EVENT_ADDR_RESOLVED);
	CHECK(rdma_ack_cm_event(ev) == 0);
}

/* The rdma_cm's objects: the application's PD and CQs given to rdma_create_qp, and the ones
 * it uses when given none: id->pd (the device's PD from the address resolution, then the PD
 * of the id's last QP, as rdma-core sets it) and CQs it makes. */
static void cm_pairs(void)
{
	struct rdma_event_channel *ech = rdma_create_event_channel();
	CHECK(ech);
	struct rdma_cm_id *id;
	CHECK(rdma_create_id(ech, &id, NULL, RDMA_PS_TCP) == 0);
	resolve_loopback(id);
	CHECK(id->verbs);
	struct ibv_pd *devpd = id->pd;
	CHECK(devpd && devpd->context == id->verbs);
	struct ibv_pd *pd = ibv_alloc_pd(id->verbs);
	struct ibv_cq *cq = ibv_create_cq(id->verbs, 8, NULL, NULL, 0);
	CHECK(pd && cq);
	struct ibv_qp_init_attr ia = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	CHECK(rdma_create_qp(id, pd, &ia) == 0 && id->qp && id->pd == pd);
	BUSY(ibv_dealloc_pd(pd));
	BUSY(ibv_destroy_cq(cq));
	rdma_destroy_qp(id);
	CHECK(id->qp == NULL);
	CHECK(ibv_destroy_cq(cq) == 0);

	/* Without PD or CQs: rdma_create_qp makes the CQs and uses id->pd (now the PD of the
	 * id's last QP); they are in use until rdma_destroy_qp, which keeps id->pd. */
	struct ibv_qp_init_attr ia2 = {
		.qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	CHECK(rdma_create_qp(id, NULL, &ia2) == 0 && id->qp && id->send_cq && id->recv_cq);
	CHECK(id->qp->pd == pd && id->pd == pd);
	BUSY(ibv_destroy_cq(id->send_cq));
	BUSY(ibv_destroy_cq(id->recv_cq));
	BUSY(ibv_dealloc_pd(id->pd));
	errno = 0;
	CHECK(ibv_destroy_comp_channel(id->send_cq_channel) == EBUSY && errno == 0);
	rdma_destroy_qp(id);
	CHECK(id->qp == NULL && id->send_cq == NULL && id->pd == pd);

	/* An SRQ rdma_create_srq made in id->pd: the PD is in use until the last of the QP and
	 * the SRQ goes, whichever order. */
	struct ibv_qp_init_attr ia3 = {
		.qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	CHECK(rdma_create_qp(id, NULL, &ia3) == 0 && id->pd);
	struct ibv_srq_init_attr sia = { .attr = { .max_wr = 4, .max_sge = 1 } };
	CHECK(rdma_create_srq(id, NULL, &sia) == 0 && id->srq && id->srq->pd == id->pd);
	struct ibv_pd *own = id->pd;
	BUSY(ibv_dealloc_pd(own));
	rdma_destroy_qp(id);
	CHECK(id->qp == NULL && id->pd == own);
	BUSY(ibv_dealloc_pd(own));
	rdma_destroy_srq(id);
	CHECK(id->srq == NULL && id->pd == own);

	/* rdma_destroy_id of an id with a QP: allowed (rdma-core does not look); the QP stays
	 * the application's, and its PD and CQ stay in use until it goes. */
	struct rdma_cm_id *id2;
	CHECK(rdma_create_id(ech, &id2, NULL, RDMA_PS_TCP) == 0);
	resolve_loopback(id2);
	cq = ibv_create_cq(id2->verbs, 8, NULL, NULL, 0);
	CHECK(cq);
	ia.send_cq = cq;
	ia.recv_cq = cq;
	CHECK(rdma_create_qp(id2, pd, &ia) == 0);
	struct ibv_qp *qp = id2->qp;
	CHECK(rdma_destroy_id(id2) == 0);
	BUSY(ibv_dealloc_pd(pd));
	BUSY(ibv_destroy_cq(cq));
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr got;
	CHECK(ibv_query_qp(qp, &qa, IBV_QP_STATE, &got) == 0 && got.send_cq == cq);
	char *buf = calloc(1, 64);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 64, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr);
	flush_receives(qp, cq, mr, 1);
	CHECK(ibv_destroy_qp(qp) == 0);
	CHECK(ibv_destroy_cq(cq) == 0);
	CHECK(ibv_dereg_mr(mr) == 0);
	CHECK(ibv_dealloc_pd(pd) == 0);
	free(buf);

	/* ibv_destroy_qp of an id's QP: the id names no QP any more (rdma-core leaves id->qp to
	 * the freed QP), and rdma_destroy_qp then releases only the PD and CQs it made. */
	struct rdma_cm_id *id3;
	CHECK(rdma_create_id(ech, &id3, NULL, RDMA_PS_TCP) == 0);
	resolve_loopback(id3);
	CHECK(id3->pd == devpd);
	struct ibv_qp_init_attr ia4 = {
		.qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	CHECK(rdma_create_qp(id3, NULL, &ia4) == 0 && id3->qp);
	BUSY(ibv_destroy_cq(id3->send_cq));
	CHECK(ibv_destroy_qp(id3->qp) == 0);
	CHECK(id3->qp == NULL && id3->send_cq && id3->pd);
	rdma_destroy_qp(id3);
	CHECK(id3->send_cq == NULL && id3->recv_cq == NULL && id3->pd == devpd);
	CHECK(rdma_destroy_id(id3) == 0);

	CHECK(rdma_destroy_id(id) == 0);
	rdma_destroy_event_channel(ech);
}

int main(void)
{
	struct ibv_device **list = ibv_get_device_list(NULL);
	CHECK(list && list[0]);
	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx);
	verbs_pairs(ctx);
	cm_pairs();
	CHECK(ibv_close_device(ctx) == 0);
	ibv_free_device_list(list);
	printf("ok: %d checks\n", checks);
	return 0;
}
