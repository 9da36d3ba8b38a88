/* The rest of rdma-core 44's ABI through the C ABI (run by tests/debian_tools.rs):
 *
 * - "pure" (argument `pure`): the calls that touch no device, libibverbs' kernel-ABI
 *   marshalling (ibv_copy_*_kern, declared here: Debian ships no marshall.h) and the
 *   provider macro helper __ioctl_final_num_attrs. The test runs this mode over Softwarp
 *   and over Debian's own libibverbs and requires the same output from both, so the
 *   structure layouts are checked against rdma-core itself.
 * - default: the calls of features a software iWARP device has not, answered as rdma-core
 *   answers for a provider without them: object import (ibv_import_*), dma-buf MRs, ECE on
 *   QPs and ids, multicast joins (ENOSYS on iWARP), and the provider's sysfs reader. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <netinet/in.h>
#include <infiniband/verbs.h>
#include <infiniband/sa.h>
#include <rdma/ib_user_verbs.h>
#include <rdma/ib_user_sa.h>
#include <rdma/rdma_user_ioctl_cmds.h>
#include <rdma/rdma_cma.h>

#include "check.h"

/* infiniband/marshall.h (not installed by Debian's libibverbs-dev). */
void ibv_copy_qp_attr_from_kern(struct ibv_qp_attr *dst, struct ib_uverbs_qp_attr *src);
void ibv_copy_ah_attr_from_kern(struct ibv_ah_attr *dst, struct ib_uverbs_ah_attr *src);
void ibv_copy_path_rec_from_kern(struct ibv_sa_path_rec *dst, struct ib_user_path_rec *src);
void ibv_copy_path_rec_to_kern(struct ib_user_path_rec *dst, struct ibv_sa_path_rec *src);

/* The layout of rdma-core's private struct ibv_command_buffer (libibverbs/cmd_ioctl.h). */
struct command_buffer {
	struct command_buffer *next;
	struct ib_uverbs_attr *next_attr;
	struct ib_uverbs_attr *last_attr;
	uint8_t uhw_in_idx, uhw_out_idx, uhw_in_headroom_dwords, uhw_out_headroom_dwords;
	uint8_t flags;
	struct ib_uverbs_ioctl_hdr hdr;
	struct ib_uverbs_attr attrs[8];
};
unsigned int __ioctl_final_num_attrs(unsigned int num_attrs, struct command_buffer *link);

static void pure(void)
{
	struct ib_uverbs_qp_attr k;
	memset(&k, 0, sizeof k);
	k.cur_qp_state = IBV_QPS_RTS;
	k.path_mtu = IBV_MTU_1024;
	k.qkey = 0x11111111;
	k.rq_psn = 7;
	k.sq_psn = 9;
	k.dest_qp_num = 0x123456;
	k.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
	k.max_send_wr = 100;
	k.max_recv_wr = 200;
	k.max_send_sge = 3;
	k.max_recv_sge = 4;
	k.max_inline_data = 64;
	k.ah_attr.grh.dgid[15] = 0xaa;
	k.ah_attr.grh.flow_label = 0x12345;
	k.ah_attr.dlid = 0x77;
	k.ah_attr.is_global = 1;
	k.alt_ah_attr.port_num = 2;
	k.pkey_index = 5;
	k.max_rd_atomic = 16;
	k.max_dest_rd_atomic = 8;
	k.timeout = 14;
	k.retry_cnt = 7;
	k.alt_timeout = 3;
	struct ibv_qp_attr a;
	memset(&a, 0xff, sizeof a);
	ibv_copy_qp_attr_from_kern(&a, &k);
	CHECK(a.cur_qp_state == IBV_QPS_RTS && a.path_mtu == IBV_MTU_1024);
	CHECK(a.qkey == 0x11111111 && a.rq_psn == 7 && a.sq_psn == 9 && a.dest_qp_num == 0x123456);
	CHECK(a.qp_access_flags == (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ));
	CHECK(a.cap.max_send_wr == 100 && a.cap.max_recv_wr == 200 && a.cap.max_send_sge == 3 &&
	      a.cap.max_recv_sge == 4 && a.cap.max_inline_data == 64);
	CHECK(a.ah_attr.grh.dgid.raw[15] == 0xaa && a.ah_attr.grh.flow_label == 0x12345);
	CHECK(a.ah_attr.dlid == 0x77 && a.ah_attr.is_global == 1 && a.alt_ah_attr.port_num == 2);
	CHECK(a.pkey_index == 5 && a.max_rd_atomic == 16 && a.max_dest_rd_atomic == 8);
	CHECK(a.timeout == 14 && a.retry_cnt == 7 && a.alt_timeout == 3);
	/* Not copied by rdma-core: the state and the mask stay as they were. */
	CHECK(a.qp_state == (enum ibv_qp_state)0xffffffff);

	struct ibv_ah_attr ah;
	memset(&ah, 0, sizeof ah);
	k.ah_attr.sl = 3;
	k.ah_attr.static_rate = 2;
	ibv_copy_ah_attr_from_kern(&ah, &k.ah_attr);
	CHECK(ah.sl == 3 && ah.static_rate == 2 && ah.dlid == 0x77 && ah.grh.dgid.raw[15] == 0xaa);

	struct ibv_sa_path_rec rec, back;
	memset(&rec, 0, sizeof rec);
	rec.dgid.raw[0] = 0xfe;
	rec.sgid.raw[1] = 0x80;
	rec.dlid = htons(0x1234);
	rec.slid = htons(0x4321);
	rec.flow_label = htonl(0x5678);
	rec.pkey = htons(0xffff);
	rec.mtu = IBV_MTU_4096;
	rec.rate = 16;
	rec.sl = 1;
	rec.reversible = 1;
	rec.numb_path = 1;
	rec.packet_life_time = 18;
	rec.packet_life_time_selector = 2;
	rec.preference = 1;
	struct ib_user_path_rec kr;
	memset(&kr, 0, sizeof kr);
	ibv_copy_path_rec_to_kern(&kr, &rec);
	CHECK(kr.dgid[0] == 0xfe && kr.sgid[1] == 0x80 && kr.dlid == htons(0x1234));
	CHECK(kr.mtu == IBV_MTU_4096 && kr.reversible == 1 && kr.pkey == htons(0xffff));
	CHECK(kr.packet_life_time == 18 && kr.packet_life_time_selector == 2);
	memset(&back, 0, sizeof back);
	ibv_copy_path_rec_from_kern(&back, &kr);
	CHECK(memcmp(&back, &rec, sizeof rec) == 0);

	/* Two linked command buffers with 3 and 5 attributes filled, plus 2 of the caller's. */
	struct command_buffer b1, b2;
	memset(&b1, 0, sizeof b1);
	memset(&b2, 0, sizeof b2);
	b1.next = &b2;
	b1.next_attr = &b1.hdr.attrs[3];
	b2.next_attr = &b2.hdr.attrs[5];
	CHECK(__ioctl_final_num_attrs(2, &b1) == 10);
	CHECK(__ioctl_final_num_attrs(4, NULL) == 4);
}

static void device_calls(void)
{
	struct ibv_device **list = ibv_get_device_list(NULL);
	CHECK(list && list[0]);
	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd);

	/* ibv_import_device: EINVAL unless a character device, ENODEV for one of no device. */
	int pipefd[2];
	CHECK(pipe(pipefd) == 0);
	errno = 0;
	CHECK(ibv_import_device(pipefd[0]) == NULL && errno == EINVAL);
	close(pipefd[0]);
	close(pipefd[1]);
	int null = open("/dev/null", O_RDWR);
	CHECK(null >= 0);
	errno = 0;
	CHECK(ibv_import_device(null) == NULL && errno == ENODEV);
	close(null);
	errno = 0;
	CHECK(ibv_import_pd(ctx, 1) == NULL && errno == EOPNOTSUPP);
	errno = 0;
	CHECK(ibv_import_mr(pd, 1) == NULL && errno == EOPNOTSUPP);
	errno = 0;
	CHECK(ibv_import_dm(ctx, 1) == NULL && errno == EOPNOTSUPP);

	/* dma-buf memory: refused as by Linux siw, and the PD is still usable. */
	errno = 0;
	CHECK(ibv_reg_dmabuf_mr(pd, 0, 4096, 0, 3, IBV_ACCESS_LOCAL_WRITE) == NULL &&
	      errno == EOPNOTSUPP);
	char *buf = calloc(1, 4096);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr);

	/* ECE on a QP: the provider has none. */
	struct ibv_cq *cq = ibv_create_cq(ctx, 4, NULL, NULL, 0);
	CHECK(cq);
	struct ibv_qp_init_attr qia = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 2, .max_recv_wr = 2, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &qia);
	CHECK(qp);
	struct ibv_ece ece = { .vendor_id = 0x15b3, .options = 1 };
	CHECK(ibv_set_ece(qp, &ece) == EOPNOTSUPP);
	ece.vendor_id = 0;
	errno = 0;
	CHECK(ibv_set_ece(qp, &ece) == EOPNOTSUPP && errno == EOPNOTSUPP);
	CHECK(ibv_query_ece(qp, &ece) == EOPNOTSUPP);
	CHECK(ibv_destroy_qp(qp) == 0 && ibv_destroy_cq(cq) == 0);
	CHECK(ibv_dereg_mr(mr) == 0 && ibv_dealloc_pd(pd) == 0);
	free(buf);
	ibv_close_device(ctx);
	ibv_free_device_list(list);

	/* rdma_cm: ECE checked as rdma-core checks it, multicast refused as on iWARP. */
	struct rdma_event_channel *ch = rdma_create_event_channel();
	CHECK(ch);
	struct rdma_cm_id *id;
	CHECK(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) == 0);
	struct ibv_ece local = { .vendor_id = 0x15b3, .options = 7 };
	CHECK(rdma_set_local_ece(id, &local) == 0);
	local.comp_mask = 1;
	errno = 0;
	CHECK(rdma_set_local_ece(id, &local) == -1 && errno == EINVAL);
	local.comp_mask = 0;
	local.vendor_id = 0;
	errno = 0;
	CHECK(rdma_set_local_ece(id, &local) == -1 && errno == EINVAL);
	struct ibv_ece remote = { .vendor_id = 9, .options = 9, .comp_mask = 9 };
	CHECK(rdma_get_remote_ece(id, &remote) == 0 && remote.vendor_id == 0 &&
	      remote.options == 0 && remote.comp_mask == 0);
	errno = 0;
	CHECK(rdma_get_remote_ece(id, NULL) == -1 && errno == EINVAL);

	struct sockaddr_in group = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(0xe0000101) };
	struct sockaddr bad = { .sa_family = AF_UNIX };
	struct rdma_cm_join_mc_attr_ex mc = {
		.comp_mask = RDMA_CM_JOIN_MC_ATTR_ADDRESS | RDMA_CM_JOIN_MC_ATTR_JOIN_FLAGS,
		.join_flags = RDMA_MC_JOIN_FLAG_FULLMEMBER,
		.addr = (struct sockaddr *)&group,
	};
	errno = 0;
	CHECK(rdma_join_multicast_ex(id, &mc, NULL) == -1 && errno == ENOSYS);
	mc.comp_mask = RDMA_CM_JOIN_MC_ATTR_ADDRESS;
	errno = 0;
	CHECK(rdma_join_multicast_ex(id, &mc, NULL) == -1 && errno == EINVAL);
	mc.comp_mask = RDMA_CM_JOIN_MC_ATTR_RESERVED;
	errno = 0;
	CHECK(rdma_join_multicast_ex(id, &mc, NULL) == -1 && errno == ENOTSUP);
	errno = 0;
	CHECK(rdma_join_multicast(id, (struct sockaddr *)&group, NULL) == -1 && errno == ENOSYS);
	errno = 0;
	CHECK(rdma_join_multicast(id, &bad, NULL) == -1 && errno == EINVAL);
	errno = 0;
	CHECK(rdma_leave_multicast(id, (struct sockaddr *)&group) == -1 && errno == EADDRNOTAVAIL);
	CHECK(rdma_destroy_id(id) == 0);
	rdma_destroy_event_channel(ch);
}

int main(int argc, char **argv)
{
	pure();
	if (argc < 2 || strcmp(argv[1], "pure") != 0)
		device_calls();
	printf("ok: %d checks\n", checks);
	return 0;
}
