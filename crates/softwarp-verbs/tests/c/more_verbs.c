/* Verbs beyond the basic set, through the C ABI (run by tests/debian_tools.rs): memory
 * windows absent as rdma-core reports it for a device without them (max_mw 0, ibv_alloc_mw
 * fails with EOPNOTSUPP), ibv_reg_mr_iova with an iova other than the address,
 * ibv_rereg_mr (access, translation, PD; rdma-core's input checks), and
 * rdma_create_srq/rdma_destroy_srq with the QP rdma_create_qp makes on the same id,
 * ibv_create_cq_ex and its poll functions (on flushed receives). The
 * data path of an iova registration is checked over a live connection by live_ops.c. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>

#include "check.h"

int main(void)
{
	struct ibv_device **list = ibv_get_device_list(NULL);
	CHECK(list && list[0]);
	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_pd *pd2 = ibv_alloc_pd(ctx);
	CHECK(pd && pd2);

	/* Memory windows: none, as the device attributes say. */
	struct ibv_device_attr da;
	CHECK(ibv_query_device(ctx, &da) == 0 && da.max_mw == 0);
	errno = 0;
	CHECK(ibv_alloc_mw(pd, IBV_MW_TYPE_1) == NULL && errno == EOPNOTSUPP);
	errno = 0;
	CHECK(ibv_alloc_mw(pd, IBV_MW_TYPE_2) == NULL && errno == EOPNOTSUPP);

	/* An iova other than the address: the MR still describes the application's memory. */
	char *buf = calloc(1, 4096), *buf2 = calloc(1, 4096);
	struct ibv_mr *mr = ibv_reg_mr_iova(pd, buf, 4096, 0x40000000,
					    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	CHECK(mr && mr->addr == buf && mr->length == 4096 && mr->pd == pd);
	CHECK(ibv_dereg_mr(mr) == 0);
	errno = 0;
	CHECK(ibv_reg_mr_iova(pd, buf, 4096, UINT64_MAX - 100, IBV_ACCESS_LOCAL_WRITE) == NULL &&
	      errno == EINVAL);

	/* ibv_rereg_mr: rdma-core's input checks first. */
	mr = ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr);
	uint32_t key = mr->rkey;
	errno = 0;
	CHECK(ibv_rereg_mr(mr, 8, NULL, NULL, 0, 0) == IBV_REREG_MR_ERR_INPUT && errno == EINVAL);
	errno = 0;
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, NULL, 0, 0) ==
		      IBV_REREG_MR_ERR_INPUT && errno == EINVAL);
	errno = 0;
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_PD, pd2, NULL, 0, IBV_ACCESS_REMOTE_READ) ==
		      IBV_REREG_MR_ERR_INPUT && errno == EINVAL);
	CHECK(mr->rkey == key && mr->pd == pd);
	/* A registration the device refuses leaves the MR as it was. */
	errno = 0;
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, IBV_ACCESS_ON_DEMAND) ==
		      IBV_REREG_MR_ERR_CMD && errno == EOPNOTSUPP);
	CHECK(mr->rkey == key && mr->addr == buf);
	/* Access, then translation and PD: new keys each time, the fields follow. */
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
			   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ) == 0);
	CHECK(mr->rkey != key && mr->lkey == mr->rkey && mr->addr == buf && mr->length == 4096);
	key = mr->rkey;
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION | IBV_REREG_MR_CHANGE_PD, pd2,
			   buf2 + 64, 2048, 0) == 0);
	CHECK(mr->rkey != key && mr->addr == buf2 + 64 && mr->length == 2048 && mr->pd == pd2);
	/* The PD is in use by the MR now, not the old one. */
	CHECK(ibv_dereg_mr(mr) == 0);

	/* ibv_create_cq_ex: the fields iWARP has; no timestamps. */
	struct ibv_cq_init_attr_ex ca = {
		.cqe = 8,
		.wc_flags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_QP_NUM | IBV_WC_EX_WITH_IMM,
	};
	struct ibv_cq_ex *cqx = ibv_create_cq_ex(ctx, &ca);
	CHECK(cqx && cqx->cqe >= 8);
	struct ibv_poll_cq_attr pa = { .comp_mask = 0 };
	CHECK(ibv_start_poll(cqx, &pa) == ENOENT);
	ca.wc_flags |= IBV_WC_EX_WITH_COMPLETION_TIMESTAMP;
	errno = 0;
	CHECK(ibv_create_cq_ex(ctx, &ca) == NULL && errno == EOPNOTSUPP);
	struct ibv_cq *cq = ibv_cq_ex_to_cq(cqx);
	struct ibv_qp_init_attr ia = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	CHECK(qp);
	struct ibv_mr *rmr = ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(rmr);
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 64, .lkey = rmr->lkey };
	struct ibv_recv_wr r2 = { .wr_id = 12, .sg_list = &sge, .num_sge = 1 };
	struct ibv_recv_wr r1 = { .wr_id = 11, .sg_list = &sge, .num_sge = 1, .next = &r2 }, *rbad;
	CHECK(ibv_post_recv(qp, &r1, &rbad) == 0);
	struct ibv_qp_attr qattr = { .qp_state = IBV_QPS_ERR };
	CHECK(ibv_modify_qp(qp, &qattr, IBV_QP_STATE) == 0);
	CHECK(ibv_start_poll(cqx, &pa) == 0 && cqx->status == IBV_WC_WR_FLUSH_ERR &&
	      cqx->wr_id == 11);
	CHECK(ibv_wc_read_qp_num(cqx) == qp->qp_num && ibv_wc_read_opcode(cqx) == IBV_WC_RECV);
	CHECK(ibv_wc_read_wc_flags(cqx) == 0);
	CHECK(ibv_next_poll(cqx) == 0 && cqx->status == IBV_WC_WR_FLUSH_ERR && cqx->wr_id == 12);
	CHECK(ibv_next_poll(cqx) == ENOENT);
	ibv_end_poll(cqx);
	CHECK(ibv_destroy_qp(qp) == 0);
	CHECK(ibv_dereg_mr(rmr) == 0);
	CHECK(ibv_destroy_cq(cq) == 0);

	/* rdma_create_srq: the id's next QP uses it. */
	struct rdma_cm_id *id;
	CHECK(rdma_create_id(NULL, &id, NULL, RDMA_PS_TCP) == 0);
	struct sockaddr_in sin = { .sin_family = AF_INET, .sin_port = htons(9) };
	sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	/* Resolved (a synchronous id: the call returns resolved), the id has the device; a
	 * loopback bind would leave it without, as the kernel's rdma_cm does. */
	CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *)&sin, 2000) == 0 && id->verbs);
	struct ibv_pd *idpd = ibv_alloc_pd(id->verbs);
	CHECK(idpd);
	struct ibv_srq_init_attr sa = { .attr = { .max_wr = 16, .max_sge = 1 } };
	struct ibv_pd *devpd = id->pd; /* the device's, from the resolution (rdma-core's) */
	CHECK(devpd && devpd != idpd);
	CHECK(rdma_create_srq(id, idpd, &sa) == 0 && id->srq && id->srq->pd == idpd);
	CHECK(id->pd == devpd); /* rdma_create_srq sets id->pd only when it is NULL */
	struct ibv_qp_init_attr qa = {
		.qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	CHECK(rdma_create_qp(id, idpd, &qa) == 0 && id->qp && id->qp->srq == id->srq);
	rdma_destroy_qp(id);
	CHECK(id->qp == NULL && id->srq != NULL);
	rdma_destroy_srq(id);
	CHECK(id->srq == NULL);
	struct ibv_srq_init_attr_ex sx;
	memset(&sx, 0, sizeof sx);
	sx.attr.max_wr = 4;
	sx.attr.max_sge = 1;
	errno = 0;
	CHECK(rdma_create_srq_ex(id, &sx) == -1 && errno == EINVAL); /* no IBV_SRQ_INIT_ATTR_TYPE */
	sx.comp_mask = IBV_SRQ_INIT_ATTR_TYPE;
	sx.srq_type = IBV_SRQT_XRC;
	errno = 0;
	CHECK(rdma_create_srq_ex(id, &sx) == -1 && errno == EOPNOTSUPP);
	sx.srq_type = IBV_SRQT_BASIC;
	/* id->pd is the PD of the id's last QP now (rdma_create_qp sets it, as rdma-core's). */
	CHECK(rdma_create_srq_ex(id, &sx) == 0 && id->srq && id->srq->pd == idpd);
	rdma_destroy_srq(id);
	CHECK(rdma_destroy_id(id) == 0);
	CHECK(ibv_dealloc_pd(idpd) == 0);

	CHECK(ibv_dealloc_pd(pd2) == 0);
	CHECK(ibv_dealloc_pd(pd) == 0);
	CHECK(ibv_close_device(ctx) == 0);
	ibv_free_device_list(list);
	free(buf);
	free(buf2);
	printf("ok: %d checks\n", checks);
	return 0;
}
