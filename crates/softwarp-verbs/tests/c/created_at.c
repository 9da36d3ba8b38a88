/* Objects created through the C ABI, for `softwarp resources`: each kind is made in a
 * function of its own (exported with -rdynamic, so dladdr can name it), then the program
 * prints "ready" and waits until its standard input closes. The test
 * (softwarp-cli/tests/exec.rs) checks that every object's CREATED-AT names the function
 * that created it rather than a line of the library.
 *
 *   cc -O1 -fno-optimize-sibling-calls -rdynamic -o created_at created_at.c -libverbs -lrdmacm
 *
 * No sibling calls: a tail call would return to the function's caller, not to it. At least
 * -O1: verbs.h's static inline functions (ibv_create_qp_ex) are inlined into their callers;
 * at -O0 the program has a local copy of each, which dladdr cannot name.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <netinet/in.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#define NOINLINE __attribute__((noinline))

static void die(const char *what)
{
	perror(what);
	exit(1);
}

NOINLINE struct ibv_context *make_context(void)
{
	struct ibv_device **list = ibv_get_device_list(NULL);
	if (!list || !list[0])
		die("ibv_get_device_list");
	struct ibv_context *ctx = ibv_open_device(list[0]);
	ibv_free_device_list(list);
	return ctx;
}

NOINLINE struct ibv_pd *make_pd(struct ibv_context *ctx)
{
	return ibv_alloc_pd(ctx);
}

NOINLINE struct ibv_mr *make_mr(struct ibv_pd *pd, void *buf, size_t len)
{
	return ibv_reg_mr(pd, buf, len, IBV_ACCESS_LOCAL_WRITE);
}

NOINLINE struct ibv_cq *make_cq(struct ibv_context *ctx)
{
	return ibv_create_cq(ctx, 16, NULL, NULL, 0);
}

NOINLINE struct ibv_qp *make_qp(struct ibv_pd *pd, struct ibv_cq *cq)
{
	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof a);
	a.send_cq = cq;
	a.recv_cq = cq;
	a.qp_type = IBV_QPT_RC;
	a.cap.max_send_wr = 4;
	a.cap.max_recv_wr = 4;
	a.cap.max_send_sge = 1;
	a.cap.max_recv_sge = 1;
	return ibv_create_qp(pd, &a);
}

/* ibv_create_qp_ex is an inline function of verbs.h: it calls verbs_context.create_qp_ex. */
NOINLINE struct ibv_qp *make_qp_ex(struct ibv_context *ctx, struct ibv_pd *pd, struct ibv_cq *cq)
{
	struct ibv_qp_init_attr_ex a;
	memset(&a, 0, sizeof a);
	a.send_cq = cq;
	a.recv_cq = cq;
	a.qp_type = IBV_QPT_RC;
	a.cap.max_send_wr = 4;
	a.cap.max_recv_wr = 4;
	a.cap.max_send_sge = 1;
	a.cap.max_recv_sge = 1;
	a.comp_mask = IBV_QP_INIT_ATTR_PD;
	a.pd = pd;
	return ibv_create_qp_ex(ctx, &a);
}

NOINLINE struct ibv_srq *make_srq(struct ibv_pd *pd)
{
	struct ibv_srq_init_attr a;
	memset(&a, 0, sizeof a);
	a.attr.max_wr = 4;
	a.attr.max_sge = 1;
	return ibv_create_srq(pd, &a);
}

NOINLINE struct rdma_cm_id *make_id(struct rdma_event_channel *ch)
{
	struct rdma_cm_id *id;
	return rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) ? NULL : id;
}

/* An id without a QP whose address is resolved (to the listener's): ADDR_RESOLVED. */
NOINLINE struct rdma_cm_id *make_resolved_id(struct rdma_event_channel *ch,
					     struct sockaddr *dst)
{
	struct rdma_cm_id *id;
	struct rdma_cm_event *ev;
	if (rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) || rdma_resolve_addr(id, NULL, dst, 1000))
		return NULL;
	if (rdma_get_cm_event(ch, &ev) || ev->event != RDMA_CM_EVENT_ADDR_RESOLVED)
		return NULL;
	rdma_ack_cm_event(ev);
	return id;
}

/* A listener made by rdma_listen on an id bound to 127.0.0.1:0 (the bind opens the connection
 * manager's device). */
NOINLINE int make_listener(struct rdma_cm_id *id)
{
	struct sockaddr_in sin;
	memset(&sin, 0, sizeof sin);
	sin.sin_family = AF_INET;
	sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (rdma_bind_addr(id, (struct sockaddr *)&sin))
		return -1;
	return rdma_listen(id, 4);
}

int main(void)
{
	static char buf[4096];
	struct ibv_context *ctx = make_context();
	if (!ctx)
		die("ibv_open_device");
	struct ibv_pd *pd = make_pd(ctx);
	if (!pd)
		die("ibv_alloc_pd");
	struct ibv_mr *mr = make_mr(pd, buf, sizeof buf);
	if (!mr)
		die("ibv_reg_mr");
	struct ibv_cq *cq = make_cq(ctx);
	if (!cq)
		die("ibv_create_cq");
	struct ibv_qp *qp = make_qp(pd, cq);
	if (!qp)
		die("ibv_create_qp");
	struct ibv_qp *qpx = make_qp_ex(ctx, pd, cq);
	if (!qpx)
		die("ibv_create_qp_ex");
	struct ibv_srq *srq = make_srq(pd);
	if (!srq)
		die("ibv_create_srq");
	struct rdma_event_channel *ch = rdma_create_event_channel();
	if (!ch)
		die("rdma_create_event_channel");
	struct rdma_cm_id *id = make_id(ch);
	if (!id)
		die("rdma_create_id");
	if (make_listener(id))
		die("rdma_listen");
	struct rdma_cm_id *rid = make_resolved_id(ch, rdma_get_local_addr(id));
	if (!rid)
		die("rdma_resolve_addr");
	printf("ready qp %u qp_ex %u port %u\n", qp->qp_num, qpx->qp_num,
	       ntohs(rdma_get_src_port(id)));
	fflush(stdout);
	char c;
	while (read(0, &c, 1) > 0)
		;
	rdma_destroy_id(rid);
	rdma_destroy_id(id);
	rdma_destroy_event_channel(ch);
	if (ibv_destroy_srq(srq) || ibv_destroy_qp(qpx) || ibv_destroy_qp(qp) ||
	    ibv_destroy_cq(cq) || ibv_dereg_mr(mr) || ibv_dealloc_pd(pd) ||
	    ibv_close_device(ctx))
		die("destroy");
	printf("done\n");
	return 0;
}
