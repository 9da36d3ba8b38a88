/* Run by tests/it/host_devices.rs over Softwarp's libibverbs.so.1 with a stand-in host
 * rdma-core (host/fake_ibverbs.c, device `fake0`) as SOFTWARP_HOST_IBVERBS: lists the
 * devices, and on each one opens a context, makes a PD, an MR, a completion channel, a CQ
 * and a QP, checks that each object is on the context it was made on, and runs the data
 * path (the inline verbs of <infiniband/verbs.h>). The stand-in logs every call that
 * reaches it; the test compares that log with what this program did on fake0 and nothing
 * of what it did on softwarp0.
 *
 * `host_devices list` only prints the device names, in the list's order. `host_devices hold`
 * (for `softwarp resources`, softwarp-cli/tests/it/exec.rs) makes the objects on every
 * device, and a second QP it destroys again, then prints "ready" and keeps them until its
 * standard input closes; built with -rdynamic, `make_objects` names their creating call. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#include "check.h"

/* rdma-core's private call (IBVERBS_PRIVATE_34), which ibv_devinfo uses: no header has it. */
int ibv_query_gid_type(struct ibv_context *context, uint8_t port_num, unsigned int index,
		       int *type);

static void on_device(struct ibv_device *dev)
{
	const char *name = ibv_get_device_name(dev);
	struct ibv_context *ctx = ibv_open_device(dev);
	CHECK(ctx && ctx->device == dev);
	struct ibv_device_attr attr;
	CHECK(ibv_query_device(ctx, &attr) == 0);
	struct ibv_port_attr port;
	CHECK(ibv_query_port(ctx, 1, &port) == 0 && port.state == IBV_PORT_ACTIVE);
	unsigned long long guid = be64toh(ibv_get_device_guid(dev));
	int index = ibv_get_device_index(dev);
	printf("%s: fw %s, guid %016llx, index %d\n", name, attr.fw_ver, guid, index);
	int gid_type = -1;
	CHECK(ibv_query_gid_type(ctx, 1, 0, &gid_type) == 0);
	printf("%s: gid type %d\n", name, gid_type);

	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd && pd->context == ctx);
	static char buf[4096];
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr && mr->context == ctx && mr->pd == pd);
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	CHECK(ch && ch->context == ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, ch, 0);
	CHECK(cq && cq->context == ctx && cq->channel == ch);
	struct ibv_qp_init_attr init = {
		.send_cq = cq,
		.recv_cq = cq,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
		.qp_type = IBV_QPT_RC,
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &init);
	CHECK(qp && qp->context == ctx && qp->pd == pd && qp->send_cq == cq);
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	CHECK(ibv_query_qp(qp, &qa, IBV_QP_STATE, &qi) == 0);

	/* The data path: inline functions calling the context's operations. */
	if (strcmp(name, "softwarp0") != 0) {
		struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 64, .lkey = mr->lkey };
		struct ibv_recv_wr rwr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1 }, *rbad;
		CHECK(ibv_post_recv(qp, &rwr, &rbad) == 0);
		struct ibv_send_wr swr = { .wr_id = 2, .sg_list = &sge, .num_sge = 1,
					   .opcode = IBV_WR_SEND }, *sbad;
		CHECK(ibv_post_send(qp, &swr, &sbad) == 0);
	}
	struct ibv_wc wc;
	int n = ibv_poll_cq(cq, 1, &wc);
	CHECK(n >= 0);
	printf("%s: poll %d", name, n);
	if (n == 1)
		printf(" wr_id %llx", (unsigned long long)wc.wr_id);
	printf("\n");
	CHECK(ibv_req_notify_cq(cq, 0) == 0);

	CHECK(ibv_destroy_qp(qp) == 0);
	CHECK(ibv_destroy_cq(cq) == 0);
	CHECK(ibv_destroy_comp_channel(ch) == 0);
	CHECK(ibv_dereg_mr(mr) == 0);
	CHECK(ibv_dealloc_pd(pd) == 0);
	CHECK(ibv_close_device(ctx) == 0);
}

/* Every kind of object on `dev`, kept; a second QP made and destroyed. */
__attribute__((noinline)) void make_objects(struct ibv_device *dev)
{
	static char buf[4096];
	struct ibv_context *ctx = ibv_open_device(dev);
	CHECK(ctx);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd);
	CHECK(ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE));
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	CHECK(cq);
	struct ibv_qp_init_attr init = {
		.send_cq = cq,
		.recv_cq = cq,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
		.qp_type = IBV_QPT_RC,
	};
	CHECK(ibv_create_qp(pd, &init));
	struct ibv_qp *gone = ibv_create_qp(pd, &init);
	CHECK(gone && ibv_destroy_qp(gone) == 0);
}

int main(int argc, char **argv)
{
	int n = -1;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n >= 0 && list[n] == NULL);
	if (argc > 1 && strcmp(argv[1], "hold") == 0) {
		for (int i = 0; i < n; i++)
			make_objects(list[i]);
		printf("ready\n");
		fflush(stdout);
		char c;
		while (read(0, &c, 1) > 0)
			;
		return 0;
	}
	for (int i = 0; i < n; i++)
		printf("device %s\n", ibv_get_device_name(list[i]));
	if (argc > 1 && strcmp(argv[1], "list") == 0) {
		ibv_free_device_list(list);
		return 0;
	}
	for (int i = 0; i < n; i++)
		on_device(list[i]);
	ibv_free_device_list(list);
	printf("ok: %d checks\n", checks);
	return 0;
}
