/* RDMAP operations over a live connection, seen through the C ABI: RFC 7306 immediate data,
 * Send with Invalidate, and the asynchronous event of a QP that fails. One process forks:
 * the parent is the server, the child the client; both use librdmacm's synchronous calls
 * (rdma_create_ep, rdma_get_request/rdma_accept, rdma_connect) on 127.0.0.1:PORT.
 *
 *   1. server -> client: Send {iova, rkey} of a remotely writable 64-byte MR registered
 *      with ibv_reg_mr_iova at an iova other than its address (the client's source MR is
 *      one too: its SGEs name the iova)
 *   2. client: RDMA Write with Immediate (imm 0x11223344) of "written-with-imm" to it;
 *      server: IBV_WC_RECV_RDMA_WITH_IMM, IBV_WC_WITH_IMM, imm_data in network order, the
 *      bytes in the MR
 *   3. client: Send with Immediate (imm 0x55667788), which RFC 7306 carries as a Send and an
 *      Immediate Data message; server: IBV_WC_RECV of the 5 bytes, then IBV_WC_RECV +
 *      IBV_WC_WITH_IMM with imm_data in network order
 *   4. client: Send with Invalidate of the rkey; server: IBV_WC_RECV + IBV_WC_WITH_INV,
 *      invalidated_rkey = rkey; then the server Sends "ack"
 *   5. client: RDMA Write to the invalidated rkey: the server's QP refuses it (its async
 *      event is read with ibv_get_async_event after poll() on async_fd) with a Terminate;
 *      the client's Write completed locally (iWARP has no acknowledgement), the Terminate
 *      fails its QP with an async event too
 *
 * Prints one line per check ("server: ..." / "client: ...") and "ok: N checks" at the end
 * (the parent, after the child exited 0). Every wait is bounded (alarm, poll timeouts).
 *
 *   cc -o live_ops live_ops.c -libverbs -lrdmacm && ./live_ops 7471
 */
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>

#include "forked.h"


struct info {
	uint64_t addr;
	uint32_t rkey;
	uint32_t pad;
};

static const char WRITTEN[] = "written-with-imm";

/* The next async event of `ctx` within `ms`, acknowledged; the QP it names in *qp. */
static enum ibv_event_type async_event(struct ibv_context *ctx, int ms, struct ibv_qp **qp)
{
	struct pollfd p = { .fd = ctx->async_fd, .events = POLLIN };
	int n = poll(&p, 1, ms);
	CHECK(n == 1, "no async event within %d ms", ms);
	struct ibv_async_event ev;
	CHECK(ibv_get_async_event(ctx, &ev) == 0, "ibv_get_async_event");
	*qp = ev.element.qp;
	enum ibv_event_type t = ev.event_type;
	ibv_ack_async_event(&ev);
	return t;
}

#define SERVER_IOVA 0x7000000000ull
#define CLIENT_IOVA 0x5000000000ull

static void post_send(struct rdma_cm_id *id, enum ibv_wr_opcode op, uint64_t iova, uint32_t len,
		      uint32_t lkey, uint64_t raddr, uint32_t rkey, uint32_t imm_or_inv)
{
	struct ibv_sge sge = { .addr = iova, .length = len, .lkey = lkey };
	struct ibv_send_wr wr, *bad;
	memset(&wr, 0, sizeof wr);
	wr.wr_id = op;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = op;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	if (op == IBV_WR_SEND_WITH_INV)
		wr.invalidate_rkey = imm_or_inv;
	else
		wr.imm_data = htonl(imm_or_inv);
	CHECK(ibv_post_send(id->qp, &wr, &bad) == 0, "ibv_post_send opcode %d", op);
}

static int server(const char *port)
{
	static char target[64], msgs[4][64], info_buf[sizeof(struct info)];
	struct rdma_addrinfo *res = addrinfo(port, 1);
	struct ibv_qp_init_attr attr;
	init_attr(&attr, 8);
	struct rdma_cm_id *listen_id, *id;
	CHECK(rdma_create_ep(&listen_id, res, NULL, &attr) == 0, "rdma_create_ep");
	rdma_freeaddrinfo(res);
	CHECK(rdma_listen(listen_id, 1) == 0, "rdma_listen");
	forked_ready();
	CHECK(rdma_get_request(listen_id, &id) == 0, "rdma_get_request");
	struct ibv_mr *tmr = ibv_reg_mr_iova(id->pd, target, sizeof target, SERVER_IOVA,
					    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	struct ibv_mr *mmr = rdma_reg_msgs(id, msgs, sizeof msgs);
	struct ibv_mr *imr = rdma_reg_msgs(id, info_buf, sizeof info_buf);
	CHECK(tmr && mmr && imr, "register");
	for (int i = 0; i < 4; i++)
		CHECK(rdma_post_recv(id, (void *)(uintptr_t)i, msgs[i], 64, mmr) == 0, "post_recv");
	CHECK(rdma_accept(id, NULL) == 0, "rdma_accept");

	struct info *in = (struct info *)info_buf;
	in->addr = SERVER_IOVA;
	in->rkey = tmr->rkey;
	CHECK(rdma_post_send(id, NULL, info_buf, sizeof info_buf, imr, IBV_SEND_SIGNALED) == 0,
	      "send info");
	struct ibv_wc wc;
	CHECK(rdma_get_send_comp(id, &wc) > 0 && wc.status == IBV_WC_SUCCESS, "info sent");

	/* 2: Write with Immediate. */
	CHECK(rdma_get_recv_comp(id, &wc) > 0, "recv 1");
	CHECK(wc.status == IBV_WC_SUCCESS, "status %s", ibv_wc_status_str(wc.status));
	CHECK(wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM, "opcode %d", wc.opcode);
	CHECK(wc.wc_flags & IBV_WC_WITH_IMM, "wc_flags %#x", wc.wc_flags);
	CHECK(wc.imm_data == htonl(0x11223344), "imm_data %#x", wc.imm_data);
	CHECK(wc.byte_len == sizeof WRITTEN, "byte_len %u", wc.byte_len);
	CHECK(memcmp(target, WRITTEN, sizeof WRITTEN) == 0, "target holds %.16s", target);
	printf("server: RDMA Write with Immediate: IBV_WC_RECV_RDMA_WITH_IMM, imm_data %#x (network order), %u bytes written\n",
	       ntohl(wc.imm_data), wc.byte_len);

	/* 3: Send with Immediate, RFC 7306's way: the Send, then an Immediate Data message;
	 * each consumes a receive. */
	CHECK(rdma_get_recv_comp(id, &wc) > 0, "recv 2");
	CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV, "status %d opcode %d",
	      wc.status, wc.opcode);
	CHECK((wc.wc_flags & (IBV_WC_WITH_IMM | IBV_WC_WITH_INV)) == 0, "wc_flags %#x", wc.wc_flags);
	CHECK(wc.byte_len == 5 && memcmp(msgs[(int)(uintptr_t)wc.wr_id], "hello", 5) == 0,
	      "payload");
	CHECK(rdma_get_recv_comp(id, &wc) > 0, "recv 3");
	CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV, "status %d opcode %d",
	      wc.status, wc.opcode);
	CHECK((wc.wc_flags & (IBV_WC_WITH_IMM | IBV_WC_WITH_INV)) == IBV_WC_WITH_IMM,
	      "wc_flags %#x", wc.wc_flags);
	CHECK(wc.imm_data == htonl(0x55667788), "imm_data %#x", wc.imm_data);
	printf("server: Send with Immediate: IBV_WC_RECV of 5 bytes, then IBV_WC_RECV with IBV_WC_WITH_IMM, imm_data %#x, %u bytes\n",
	       ntohl(wc.imm_data), wc.byte_len);

	/* 4: Send with Invalidate. */
	CHECK(rdma_get_recv_comp(id, &wc) > 0, "recv 4");
	CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV, "status %d opcode %d",
	      wc.status, wc.opcode);
	CHECK((wc.wc_flags & (IBV_WC_WITH_IMM | IBV_WC_WITH_INV)) == IBV_WC_WITH_INV,
	      "wc_flags %#x", wc.wc_flags);
	CHECK(wc.invalidated_rkey == tmr->rkey, "invalidated_rkey %#x, rkey %#x",
	      wc.invalidated_rkey, tmr->rkey);
	printf("server: Send with Invalidate: IBV_WC_RECV, IBV_WC_WITH_INV, invalidated_rkey is the MR's rkey\n");
	CHECK(rdma_post_send(id, NULL, "ack", 3, NULL, IBV_SEND_INLINE | IBV_SEND_SIGNALED) == 0,
	      "send ack");
	CHECK(rdma_get_send_comp(id, &wc) > 0 && wc.status == IBV_WC_SUCCESS, "ack sent");

	/* 5: the Write to the invalidated MR fails the QP. */
	struct ibv_qp *qp;
	enum ibv_event_type t = async_event(id->verbs, 10000, &qp);
	CHECK(qp == id->qp, "event for another QP");
	CHECK(t == IBV_EVENT_QP_ACCESS_ERR, "event %s", ibv_event_type_str(t));
	printf("server: RDMA Write to the invalidated rkey: async event %s on its QP\n",
	       ibv_event_type_str(t));
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qia;
	CHECK(ibv_query_qp(id->qp, &qa, IBV_QP_STATE, &qia) == 0, "ibv_query_qp");
	CHECK(qa.qp_state == IBV_QPS_ERR, "state %d", qa.qp_state);
	CHECK(memcmp(target, WRITTEN, sizeof WRITTEN) == 0, "target changed after invalidation");
	printf("server: QP in IBV_QPS_ERR, the invalidated MR's bytes unchanged\n");
	rdma_disconnect(id);
	rdma_dereg_mr(tmr);
	rdma_dereg_mr(mmr);
	rdma_dereg_mr(imr);
	rdma_destroy_ep(id);
	rdma_destroy_ep(listen_id);
	return 0;
}

static int client(const char *port)
{
	static char info_buf[sizeof(struct info)], ack[64], data[64];
	struct rdma_addrinfo *res = addrinfo(port, 0);
	struct ibv_qp_init_attr attr;
	init_attr(&attr, 8);
	struct rdma_cm_id *id;
	CHECK(rdma_create_ep(&id, res, NULL, &attr) == 0, "rdma_create_ep");
	rdma_freeaddrinfo(res);
	struct ibv_mr *imr = rdma_reg_msgs(id, info_buf, sizeof info_buf);
	struct ibv_mr *amr = rdma_reg_msgs(id, ack, sizeof ack);
	struct ibv_mr *dmr = ibv_reg_mr_iova(id->pd, data, sizeof data, CLIENT_IOVA,
					    IBV_ACCESS_LOCAL_WRITE);
	CHECK(imr && amr && dmr, "register");
	CHECK(rdma_post_recv(id, NULL, info_buf, sizeof info_buf, imr) == 0, "post_recv info");
	CHECK(rdma_post_recv(id, NULL, ack, sizeof ack, amr) == 0, "post_recv ack");
	CHECK(rdma_connect(id, NULL) == 0, "rdma_connect");
	struct ibv_wc wc;
	CHECK(rdma_get_recv_comp(id, &wc) > 0 && wc.status == IBV_WC_SUCCESS, "info");
	struct info in;
	memcpy(&in, info_buf, sizeof in);

	memcpy(data, WRITTEN, sizeof WRITTEN);
	post_send(id, IBV_WR_RDMA_WRITE_WITH_IMM, CLIENT_IOVA, sizeof WRITTEN, dmr->lkey, in.addr, in.rkey,
		  0x11223344);
	CHECK(rdma_get_send_comp(id, &wc) > 0 && wc.status == IBV_WC_SUCCESS, "write with imm");
	CHECK(wc.opcode == IBV_WC_RDMA_WRITE, "opcode %d", wc.opcode);
	memcpy(data, "hello", 5);
	post_send(id, IBV_WR_SEND_WITH_IMM, CLIENT_IOVA, 5, dmr->lkey, 0, 0, 0x55667788);
	CHECK(rdma_get_send_comp(id, &wc) > 0 && wc.status == IBV_WC_SUCCESS, "send with imm");
	CHECK(wc.opcode == IBV_WC_SEND, "opcode %d", wc.opcode);
	post_send(id, IBV_WR_SEND_WITH_INV, CLIENT_IOVA, 5, dmr->lkey, 0, 0, in.rkey);
	CHECK(rdma_get_send_comp(id, &wc) > 0 && wc.status == IBV_WC_SUCCESS, "send with inv");
	CHECK(wc.opcode == IBV_WC_SEND, "opcode %d", wc.opcode);
	printf("client: Write with Immediate, Send with Immediate, Send with Invalidate completed\n");
	CHECK(rdma_get_recv_comp(id, &wc) > 0 && wc.status == IBV_WC_SUCCESS, "ack");

	memcpy(data, "too-late", 8);
	post_send(id, IBV_WR_RDMA_WRITE, CLIENT_IOVA, 8, dmr->lkey, in.addr, in.rkey, 0);
	CHECK(rdma_get_send_comp(id, &wc) > 0, "write after invalidation");
	/* iWARP completes a Write once the transport has it (RFC 5040, no acknowledgement):
	 * the peer's refusal comes back as a Terminate, which fails the QP. */
	CHECK(wc.status == IBV_WC_SUCCESS, "status %s", ibv_wc_status_str(wc.status));
	struct ibv_qp *qp;
	enum ibv_event_type t = async_event(id->verbs, 10000, &qp);
	CHECK(qp == id->qp, "event for another QP");
	CHECK(t == IBV_EVENT_QP_ACCESS_ERR, "event %s", ibv_event_type_str(t));
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qia;
	CHECK(ibv_query_qp(id->qp, &qa, IBV_QP_STATE, &qia) == 0, "ibv_query_qp");
	CHECK(qa.qp_state == IBV_QPS_ERR, "state %d", qa.qp_state);
	printf("client: RDMA Write to the invalidated rkey completed locally (%s), then the peer's Terminate: async event %s, QP in IBV_QPS_ERR\n",
	       ibv_wc_status_str(wc.status), ibv_event_type_str(t));
	rdma_disconnect(id);
	rdma_dereg_mr(imr);
	rdma_dereg_mr(amr);
	rdma_dereg_mr(dmr);
	rdma_destroy_ep(id);
	printf("client: %d checks\n", checks);
	return 0;
}

int main(int argc, char **argv)
{
	return forked_main(argc, argv, client, server);
}
