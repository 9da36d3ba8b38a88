/* A stand-in for the host's rdma-core libibverbs.so.1, for the tests of Softwarp's device
 * layer (crates/softwarp-verbs/src/host): one device, `fake0`, whose objects are plain
 * allocations and whose operations do nothing but count. Every call appends its name to the
 * file named by FAKE_IBV_LOG, one line each, so that a test proves which calls reached the
 * host library (the non-inline verbs, through the layer) and its provider (the data path:
 * the inline verbs of <infiniband/verbs.h> calling `context->ops` directly).
 *
 * Built by the test with `gcc -shared -Wl,--version-script=fake_ibverbs.map`; the map gives
 * each symbol rdma-core v44's version. FAKE_PRIVATE_ABI (a -D) names the private version
 * node the map file declares, so that a test can build an rdma-core the layer refuses. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <infiniband/verbs.h>

/* verbs.h makes these macros over inline functions; the library defines the real ones. */
#undef ibv_query_port
#undef ibv_reg_mr
#undef ibv_reg_mr_iova

#define EXPORT __attribute__((visibility("default")))

static void note(const char *call)
{
	const char *path = getenv("FAKE_IBV_LOG");
	if (!path)
		return;
	int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
	if (fd < 0)
		return;
	size_t n = strlen(call);
	char line[128];
	if (n > sizeof(line) - 2)
		n = sizeof(line) - 2;
	memcpy(line, call, n);
	line[n] = '\n';
	if (write(fd, line, n + 1) < 0) {
		/* nothing to do: the test sees the call missing */
	}
	close(fd);
}

static struct ibv_device fake_device = {
	.node_type = IBV_NODE_RNIC,
	.transport_type = IBV_TRANSPORT_IWARP,
	.name = "fake0",
	.dev_name = "uverbs-fake0",
	.dev_path = "/sys/class/infiniband_verbs/uverbs-fake0",
	.ibdev_path = "/sys/class/infiniband/fake0",
};

/* ---- the provider's operations: the data path ---- */

static int fake_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
	(void)qp; (void)wr; (void)bad;
	note("post_send");
	return 0;
}

static int fake_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
	(void)qp; (void)wr; (void)bad;
	note("post_recv");
	return 0;
}

static int fake_post_srq_recv(struct ibv_srq *srq, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
	(void)srq; (void)wr; (void)bad;
	note("post_srq_recv");
	return 0;
}

/* One completion per poll, wr_id 0xfa4e: proof that the answer came from here. */
static int fake_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
	(void)cq;
	note("poll_cq");
	if (n < 1)
		return 0;
	memset(wc, 0, sizeof(*wc));
	wc->wr_id = 0xfa4e;
	wc->status = IBV_WC_SUCCESS;
	wc->opcode = IBV_WC_SEND;
	return 1;
}

static int fake_req_notify_cq(struct ibv_cq *cq, int solicited)
{
	(void)cq; (void)solicited;
	note("req_notify_cq");
	return 0;
}

static int fake_query_port(struct ibv_context *ctx, uint8_t port, struct ibv_port_attr *attr,
			   size_t len)
{
	(void)ctx;
	note("query_port");
	if (port != 1)
		return EINVAL;
	memset(attr, 0, len);
	attr->state = IBV_PORT_ACTIVE;
	attr->link_layer = IBV_LINK_LAYER_ETHERNET;
	attr->gid_tbl_len = 1;
	return 0;
}

/* ---- libibverbs' calls ---- */

EXPORT struct ibv_device **ibv_get_device_list(int *num)
{
	note("get_device_list");
	struct ibv_device **list = calloc(2, sizeof(*list));
	if (!list) {
		errno = ENOMEM;
		return NULL;
	}
	list[0] = &fake_device;
	if (num)
		*num = 1;
	return list;
}

EXPORT void ibv_free_device_list(struct ibv_device **list)
{
	note("free_device_list");
	free(list);
}

EXPORT __be64 ibv_get_device_guid(struct ibv_device *dev)
{
	(void)dev;
	note("get_device_guid");
	return htobe64(0xfa4e00000000fa4eULL);
}

EXPORT int ibv_get_device_index(struct ibv_device *dev)
{
	(void)dev;
	note("get_device_index");
	return 7;
}

EXPORT struct ibv_context *ibv_open_device(struct ibv_device *dev)
{
	note("open_device");
	if (dev != &fake_device) {
		errno = ENODEV;
		return NULL;
	}
	struct verbs_context *v = calloc(1, sizeof(*v));
	if (!v)
		return NULL;
	v->sz = sizeof(*v);
	v->query_port = fake_query_port;
	struct ibv_context *c = &v->context;
	c->device = dev;
	c->cmd_fd = -1;
	c->async_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	c->num_comp_vectors = 1;
	c->abi_compat = __VERBS_ABI_IS_EXTENDED;
	c->ops.post_send = fake_post_send;
	c->ops.post_recv = fake_post_recv;
	c->ops.post_srq_recv = fake_post_srq_recv;
	c->ops.poll_cq = fake_poll_cq;
	c->ops.req_notify_cq = fake_req_notify_cq;
	pthread_mutex_init(&c->mutex, NULL);
	return c;
}

EXPORT int ibv_close_device(struct ibv_context *ctx)
{
	note("close_device");
	close(ctx->async_fd);
	free(verbs_get_ctx(ctx));
	return 0;
}

EXPORT int ibv_query_device(struct ibv_context *ctx, struct ibv_device_attr *attr)
{
	(void)ctx;
	note("query_device");
	memset(attr, 0, sizeof(*attr));
	strcpy(attr->fw_ver, "fake-1.0");
	attr->vendor_id = 0xfa4e;
	attr->phys_port_cnt = 1;
	attr->max_qp = 4;
	return 0;
}

EXPORT int ibv_query_port(struct ibv_context *ctx, uint8_t port, struct _compat_ibv_port_attr *attr)
{
	note("query_port_compat");
	return fake_query_port(ctx, port, (struct ibv_port_attr *)attr,
			       offsetof(struct ibv_port_attr, flags));
}

EXPORT int ibv_query_gid(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid)
{
	(void)ctx; (void)port; (void)index;
	note("query_gid");
	memset(gid, 0xfa, sizeof(*gid));
	return 0;
}

EXPORT struct ibv_pd *ibv_alloc_pd(struct ibv_context *ctx)
{
	note("alloc_pd");
	struct ibv_pd *pd = calloc(1, sizeof(*pd));
	if (pd)
		pd->context = ctx;
	return pd;
}

EXPORT int ibv_dealloc_pd(struct ibv_pd *pd)
{
	note("dealloc_pd");
	free(pd);
	return 0;
}

static struct ibv_mr *new_mr(struct ibv_pd *pd, void *addr, size_t len)
{
	struct ibv_mr *mr = calloc(1, sizeof(*mr));
	if (!mr)
		return NULL;
	mr->context = pd->context;
	mr->pd = pd;
	mr->addr = addr;
	mr->length = len;
	mr->lkey = mr->rkey = 0xfa4e;
	return mr;
}

EXPORT struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access)
{
	(void)access;
	note("reg_mr");
	return new_mr(pd, addr, len);
}

EXPORT struct ibv_mr *ibv_reg_mr_iova2(struct ibv_pd *pd, void *addr, size_t len, uint64_t iova,
				       unsigned int access)
{
	(void)iova; (void)access;
	note("reg_mr_iova2");
	return new_mr(pd, addr, len);
}

EXPORT struct ibv_mr *ibv_reg_mr_iova(struct ibv_pd *pd, void *addr, size_t len, uint64_t iova,
				      int access)
{
	(void)iova; (void)access;
	note("reg_mr_iova");
	return new_mr(pd, addr, len);
}

EXPORT int ibv_dereg_mr(struct ibv_mr *mr)
{
	note("dereg_mr");
	free(mr);
	return 0;
}

EXPORT struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *ctx)
{
	note("create_comp_channel");
	struct ibv_comp_channel *ch = calloc(1, sizeof(*ch));
	if (!ch)
		return NULL;
	ch->context = ctx;
	ch->fd = eventfd(0, EFD_CLOEXEC);
	return ch;
}

EXPORT int ibv_destroy_comp_channel(struct ibv_comp_channel *ch)
{
	note("destroy_comp_channel");
	close(ch->fd);
	free(ch);
	return 0;
}

EXPORT struct ibv_cq *ibv_create_cq(struct ibv_context *ctx, int cqe, void *cq_context,
				    struct ibv_comp_channel *channel, int comp_vector)
{
	(void)comp_vector;
	note("create_cq");
	struct ibv_cq *cq = calloc(1, sizeof(*cq));
	if (!cq)
		return NULL;
	cq->context = ctx;
	cq->channel = channel;
	cq->cq_context = cq_context;
	cq->cqe = cqe;
	pthread_mutex_init(&cq->mutex, NULL);
	pthread_cond_init(&cq->cond, NULL);
	return cq;
}

EXPORT int ibv_destroy_cq(struct ibv_cq *cq)
{
	note("destroy_cq");
	free(cq);
	return 0;
}

EXPORT int ibv_get_cq_event(struct ibv_comp_channel *ch, struct ibv_cq **cq, void **cq_context)
{
	(void)ch; (void)cq; (void)cq_context;
	note("get_cq_event");
	errno = EAGAIN;
	return -1;
}

EXPORT void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int n)
{
	(void)cq; (void)n;
	note("ack_cq_events");
}

EXPORT struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr)
{
	note("create_qp");
	struct ibv_qp *qp = calloc(1, sizeof(*qp));
	if (!qp)
		return NULL;
	qp->context = pd->context;
	qp->pd = pd;
	qp->send_cq = attr->send_cq;
	qp->recv_cq = attr->recv_cq;
	qp->srq = attr->srq;
	qp->qp_context = attr->qp_context;
	qp->qp_num = 0xfa4e;
	qp->qp_type = attr->qp_type;
	qp->state = IBV_QPS_RESET;
	pthread_mutex_init(&qp->mutex, NULL);
	pthread_cond_init(&qp->cond, NULL);
	return qp;
}

EXPORT int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask)
{
	note("modify_qp");
	if (mask & IBV_QP_STATE)
		qp->state = attr->qp_state;
	return 0;
}

EXPORT int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask,
			struct ibv_qp_init_attr *init)
{
	(void)mask;
	note("query_qp");
	memset(attr, 0, sizeof(*attr));
	memset(init, 0, sizeof(*init));
	attr->qp_state = qp->state;
	return 0;
}

EXPORT int ibv_destroy_qp(struct ibv_qp *qp)
{
	note("destroy_qp");
	free(qp);
	return 0;
}

EXPORT int ibv_get_async_event(struct ibv_context *ctx, struct ibv_async_event *event)
{
	(void)ctx; (void)event;
	note("get_async_event");
	errno = EAGAIN;
	return -1;
}

EXPORT void ibv_ack_async_event(struct ibv_async_event *event)
{
	(void)event;
	note("ack_async_event");
}

/* The rest: counted, and refused as a provider without the operation refuses it. */
#define REFUSED_INT(name, ...) \
	EXPORT int name(__VA_ARGS__) { note(#name); return EOPNOTSUPP; }
#define REFUSED_PTR(type, name, ...) \
	EXPORT type name(__VA_ARGS__) { note(#name); errno = EOPNOTSUPP; return NULL; }
#define IGNORED(name, ...) \
	EXPORT void name(__VA_ARGS__) { note(#name); }

REFUSED_INT(ibv_query_pkey, struct ibv_context *c, uint8_t p, int i, __be16 *k)
REFUSED_INT(ibv_get_pkey_index, struct ibv_context *c, uint8_t p, __be16 k)
REFUSED_INT(_ibv_query_gid_ex, struct ibv_context *c, uint32_t p, uint32_t i,
	    struct ibv_gid_entry *e, uint32_t f, size_t s)
EXPORT ssize_t _ibv_query_gid_table(struct ibv_context *c, struct ibv_gid_entry *e, size_t m,
				    uint32_t f, size_t s)
{
	(void)c; (void)e; (void)m; (void)f; (void)s;
	note("_ibv_query_gid_table");
	return -EOPNOTSUPP;
}
REFUSED_INT(ibv_rereg_mr, struct ibv_mr *mr, int f, struct ibv_pd *pd, void *a, size_t l, int x)
REFUSED_INT(ibv_resize_cq, struct ibv_cq *cq, int cqe)
REFUSED_PTR(struct ibv_srq *, ibv_create_srq, struct ibv_pd *pd, struct ibv_srq_init_attr *a)
REFUSED_INT(ibv_modify_srq, struct ibv_srq *s, struct ibv_srq_attr *a, int m)
REFUSED_INT(ibv_query_srq, struct ibv_srq *s, struct ibv_srq_attr *a)
REFUSED_INT(ibv_destroy_srq, struct ibv_srq *s)
REFUSED_PTR(struct ibv_qp_ex *, ibv_qp_to_qp_ex, struct ibv_qp *qp)
REFUSED_INT(ibv_query_qp_data_in_order, struct ibv_qp *qp, enum ibv_wr_opcode op, uint32_t f)
REFUSED_PTR(struct ibv_ah *, ibv_create_ah, struct ibv_pd *pd, struct ibv_ah_attr *a)
REFUSED_INT(ibv_destroy_ah, struct ibv_ah *ah)
REFUSED_PTR(struct ibv_ah *, ibv_create_ah_from_wc, struct ibv_pd *pd, struct ibv_wc *wc,
	    struct ibv_grh *g, uint8_t p)
REFUSED_INT(ibv_init_ah_from_wc, struct ibv_context *c, uint8_t p, struct ibv_wc *wc,
	    struct ibv_grh *g, struct ibv_ah_attr *a)
REFUSED_INT(ibv_attach_mcast, struct ibv_qp *qp, const union ibv_gid *g, uint16_t l)
REFUSED_INT(ibv_detach_mcast, struct ibv_qp *qp, const union ibv_gid *g, uint16_t l)
REFUSED_INT(ibv_resolve_eth_l2_from_gid, struct ibv_context *c, struct ibv_ah_attr *a,
	    uint8_t m[6], uint16_t *v)
REFUSED_PTR(struct ibv_context *, ibv_import_device, int fd)
REFUSED_PTR(struct ibv_pd *, ibv_import_pd, struct ibv_context *c, uint32_t h)
IGNORED(ibv_unimport_pd, struct ibv_pd *pd)
REFUSED_PTR(struct ibv_mr *, ibv_import_mr, struct ibv_pd *pd, uint32_t h)
IGNORED(ibv_unimport_mr, struct ibv_mr *mr)
REFUSED_PTR(struct ibv_dm *, ibv_import_dm, struct ibv_context *c, uint32_t h)
IGNORED(ibv_unimport_dm, struct ibv_dm *dm)
REFUSED_PTR(struct ibv_mr *, ibv_reg_dmabuf_mr, struct ibv_pd *pd, uint64_t o, size_t l,
	    uint64_t i, int fd, int a)
REFUSED_INT(ibv_query_ece, struct ibv_qp *qp, struct ibv_ece *e)
REFUSED_INT(ibv_set_ece, struct ibv_qp *qp, struct ibv_ece *e)

/* rdma-core's private call for a GID's type (ibv_devinfo prints it): RoCE v2 here. */
EXPORT int ibv_query_gid_type(struct ibv_context *ctx, uint8_t port, unsigned int index, int *type)
{
	(void)ctx; (void)port; (void)index;
	note("query_gid_type");
	*type = 1;
	return 0;
}

/* The private interface's marker: what the layer reads to know the rdma-core release. */
EXPORT void verbs_register_driver_fake(void) { note("verbs_register_driver"); }
