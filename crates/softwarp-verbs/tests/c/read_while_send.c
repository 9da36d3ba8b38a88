/* A reader and a responder that sends while it answers: the client RDMA Reads SIZE bytes of
 * the server's memory and then tells the server "go"; the server, on "go", posts SENDS small
 * Sends while its Read Response is still going out. The client has one CQ for its send and
 * receive completions, so their order is the order its QP finished them, and it counts how
 * many of the server's Sends arrived before its Read completed: a responder that queues
 * its Sends behind the whole Read Response gives 0, one that interleaves them (Softwarp,
 * DESIGN.md "Interleaving on transmit") gives most or all of them. The Read's bytes and every
 * Send's contents are checked. The client speaks first ("hi"), since an MPA responder sends
 * nothing before the initiator's first FPDU (RFC 5044, outside peer-to-peer mode).
 *
 *   read_while_send PORT                            both on 127.0.0.1 (forked), 64 MiB, 8 Sends
 *   read_while_send -s HOST PORT SIZE SENDS [LEN]   the server (responder) alone
 *   read_while_send -c HOST PORT SIZE SENDS [LEN]   the client (reader) alone
 *
 * LEN: the length of each Send (default 32; both sides must agree). With long Sends the
 * Read Response's segments also go out inside them. Each Send starts with "send I of N" and
 * continues with bytes that depend on I.
 *
 * interop/run-siw-interleave.sh runs the server over Softwarp and the client over Linux siw. */
#include <endian.h>
#include <stdint.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_verbs.h>
#include "forked.h"

#define MSG 32
#define WR_READ 1000000
#define WR_GO 1000001
#define WR_DONE 1000002
#define WR_INFO 1000003
#define WR_HI 1000004

struct info {
	uint64_t addr;
	uint32_t rkey;
	uint32_t len;
};

static const char *host = "127.0.0.1";
static size_t size = 64u << 20;
static int sends = 8;
static size_t msg_len = MSG;

/* Fills Send `i` (msg_len bytes). */
static void fill_send(char *m, int i)
{
	memset(m, 0, MSG);
	snprintf(m, MSG, "send %d of %d", i, sends);
	for (size_t k = MSG; k < msg_len; k++)
		m[k] = (char)(i * 29 + k * 7 + (k >> 11));
}

static uint8_t pattern(size_t i)
{
	return (uint8_t)(i * 131 + (i >> 13) + 7);
}

/* forked.h's addrinfo for 127.0.0.1, else the same for `host`. */
static struct rdma_addrinfo *resolve(const char *port, int passive)
{
	if (strcmp(host, "127.0.0.1") == 0)
		return addrinfo(port, passive);
	struct rdma_addrinfo hints, *res;
	memset(&hints, 0, sizeof hints);
	hints.ai_port_space = RDMA_PS_TCP;
	if (passive)
		hints.ai_flags = RAI_PASSIVE;
	CHECK(rdma_getaddrinfo(host, port, &hints, &res) == 0, "rdma_getaddrinfo %s:%s", host,
	      port);
	return res;
}

/* A PD, one CQ for both queues, and an RC QP on `id`. */
static struct ibv_cq *make_qp(struct rdma_cm_id *id, struct ibv_pd **pd)
{
	*pd = ibv_alloc_pd(id->verbs);
	CHECK(*pd, "ibv_alloc_pd");
	struct ibv_cq *cq = ibv_create_cq(id->verbs, 4 * sends + 16, NULL, NULL, 0);
	CHECK(cq, "ibv_create_cq");
	struct ibv_qp_init_attr attr;
	init_attr(&attr, sends + 8);
	attr.send_cq = cq;
	attr.recv_cq = cq;
	CHECK(rdma_create_qp(id, *pd, &attr) == 0, "rdma_create_qp");
	return cq;
}

/* The next completion of `cq` (busy poll, bounded by the alarm); fails on an error status. */
static struct ibv_wc next_wc(struct ibv_cq *cq)
{
	struct ibv_wc wc;
	int n;
	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
		;
	CHECK(n == 1, "ibv_poll_cq %d", n);
	CHECK(wc.status == IBV_WC_SUCCESS, "wr_id %llu: %s", (unsigned long long)wc.wr_id,
	      ibv_wc_status_str(wc.status));
	return wc;
}

static void conn_param(struct rdma_conn_param *p)
{
	memset(p, 0, sizeof *p);
	p->responder_resources = 1;
	p->initiator_depth = 1;
}

static int server(const char *port)
{
	struct rdma_addrinfo *res = resolve(port, 1);
	struct rdma_cm_id *listen_id, *id;
	CHECK(rdma_create_ep(&listen_id, res, NULL, NULL) == 0, "rdma_create_ep");
	rdma_freeaddrinfo(res);
	CHECK(rdma_listen(listen_id, 1) == 0, "rdma_listen");
	if (forked_ready_fd >= 0)
		forked_ready();
	CHECK(rdma_get_request(listen_id, &id) == 0, "rdma_get_request");
	struct ibv_pd *pd;
	struct ibv_cq *cq = make_qp(id, &pd);

	uint8_t *src = aligned_alloc(4096, size);
	CHECK(src, "allocate %zu bytes", size);
	for (size_t i = 0; i < size; i++)
		src[i] = pattern(i);
	static char ctl[3][MSG], info_buf[sizeof(struct info)];
	char *out = calloc(sends, msg_len);
	CHECK(out, "allocate");
	struct ibv_mr *smr = ibv_reg_mr(pd, src, size, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
	struct ibv_mr *cmr = ibv_reg_mr(pd, ctl, sizeof ctl, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *imr = ibv_reg_mr(pd, info_buf, sizeof info_buf, 0);
	struct ibv_mr *omr = ibv_reg_mr(pd, out, (size_t)sends * msg_len, 0);
	CHECK(smr && cmr && imr && omr, "ibv_reg_mr");
	CHECK(rdma_post_recv(id, (void *)WR_HI, ctl[2], MSG, cmr) == 0, "post_recv hi");
	CHECK(rdma_post_recv(id, (void *)WR_GO, ctl[0], MSG, cmr) == 0, "post_recv go");
	CHECK(rdma_post_recv(id, (void *)WR_DONE, ctl[1], MSG, cmr) == 0, "post_recv done");
	struct rdma_conn_param p;
	conn_param(&p);
	CHECK(rdma_accept(id, &p) == 0, "rdma_accept");
	struct ibv_wc hi = next_wc(cq);
	CHECK(hi.wr_id == WR_HI, "the first message: wr_id %llu", (unsigned long long)hi.wr_id);

	struct info in = { htobe64((uintptr_t)src), htonl(smr->rkey), htonl((uint32_t)size) };
	memcpy(info_buf, &in, sizeof in);
	CHECK(rdma_post_send(id, (void *)WR_INFO, info_buf, sizeof info_buf, imr, 0) == 0,
	      "send info");
	/* The info's completion and the client's "go", which it sends right behind its Read
	 * Request: the Read Response is under way when it arrives. */
	int info_sent = 0, go = 0;
	while (!info_sent || !go) {
		struct ibv_wc wc = next_wc(cq);
		if (wc.wr_id == WR_INFO)
			info_sent = 1;
		else if (wc.wr_id == WR_GO)
			go = 1;
		else
			CHECK(0, "unexpected wr_id %llu", (unsigned long long)wc.wr_id);
	}
	for (int i = 0; i < sends; i++) {
		char *m = out + (size_t)i * msg_len;
		fill_send(m, i);
		CHECK(rdma_post_send(id, (void *)(uintptr_t)i, m, msg_len, omr, 0) == 0, "send %d",
		      i);
	}
	int sent = 0, done = 0;
	while (sent < sends || !done) {
		struct ibv_wc wc = next_wc(cq);
		if (wc.wr_id == WR_DONE)
			done = 1;
		else
			CHECK(wc.wr_id == (uint64_t)sent++, "send completion %llu out of order",
			      (unsigned long long)wc.wr_id);
	}
	printf("server: %d Sends posted during the Read Response completed\n", sends);
	rdma_disconnect(id);
	ibv_dereg_mr(smr);
	ibv_dereg_mr(cmr);
	ibv_dereg_mr(imr);
	ibv_dereg_mr(omr);
	rdma_destroy_qp(id);
	ibv_destroy_cq(cq);
	ibv_dealloc_pd(pd);
	rdma_destroy_id(id);
	rdma_destroy_ep(listen_id);
	free(src);
	free(out);
	return 0;
}

static int client(const char *port)
{
	struct rdma_addrinfo *res = resolve(port, 0);
	struct rdma_cm_id *id;
	CHECK(rdma_create_ep(&id, res, NULL, NULL) == 0, "rdma_create_ep");
	rdma_freeaddrinfo(res);
	struct ibv_pd *pd;
	struct ibv_cq *cq = make_qp(id, &pd);
	uint8_t *sink = aligned_alloc(4096, size);
	CHECK(sink, "allocate %zu bytes", size);
	memset(sink, 0, size);
	char *in = calloc(sends + 1, msg_len);
	char *want = malloc(msg_len);
	static char ctl[3][MSG] = { "go", "done", "hi" };
	CHECK(in && want, "allocate");
	struct ibv_mr *kmr = ibv_reg_mr(pd, sink, size, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *rmr =
		ibv_reg_mr(pd, in, (size_t)(sends + 1) * msg_len, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *cmr = ibv_reg_mr(pd, ctl, sizeof ctl, 0);
	CHECK(kmr && rmr && cmr, "ibv_reg_mr");
	for (int i = 0; i <= sends; i++)
		CHECK(rdma_post_recv(id, (void *)(uintptr_t)i, in + (size_t)i * msg_len, msg_len,
				     rmr) == 0,
		      "post_recv %d", i);
	struct rdma_conn_param p;
	conn_param(&p);
	CHECK(rdma_connect(id, &p) == 0, "rdma_connect");
	CHECK(rdma_post_send(id, (void *)WR_HI, ctl[2], MSG, cmr, IBV_SEND_SIGNALED) == 0, "hi");
	struct ibv_wc wc = next_wc(cq);
	CHECK(wc.wr_id == WR_HI, "wr_id %llu", (unsigned long long)wc.wr_id);
	wc = next_wc(cq);
	CHECK(wc.opcode == IBV_WC_RECV && wc.wr_id == 0 && wc.byte_len == sizeof(struct info),
	      "the info: opcode %d wr_id %llu", wc.opcode, (unsigned long long)wc.wr_id);
	struct info info;
	memcpy(&info, in, sizeof info);
	CHECK(be32toh(info.len) == size, "the server offers %u bytes", be32toh(info.len));
	struct ibv_sge sge = { (uintptr_t)sink, (uint32_t)size, kmr->lkey };
	struct ibv_send_wr wr, *bad;
	memset(&wr, 0, sizeof wr);
	wr.wr_id = WR_READ;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = IBV_WR_RDMA_READ;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.wr.rdma.remote_addr = be64toh(info.addr);
	wr.wr.rdma.rkey = ntohl(info.rkey);
	CHECK(ibv_post_send(id->qp, &wr, &bad) == 0, "post the Read");
	CHECK(rdma_post_send(id, (void *)WR_GO, ctl[0], MSG, cmr, IBV_SEND_SIGNALED) == 0, "go");

	int received = 0, before = -1, go_sent = 0;
	while (received < sends || before < 0 || !go_sent) {
		wc = next_wc(cq);
		if (wc.wr_id == WR_READ) {
			CHECK(wc.opcode == IBV_WC_RDMA_READ && wc.byte_len == size, "the Read");
			before = received;
		} else if (wc.wr_id == WR_GO) {
			go_sent = 1;
		} else {
			CHECK(wc.opcode == IBV_WC_RECV, "opcode %d", wc.opcode);
			fill_send(want, received);
			CHECK(wc.byte_len == msg_len && memcmp(in + wc.wr_id * msg_len, want,
							       msg_len) == 0,
			      "Send %d: %u bytes, starting '%.32s'", received, wc.byte_len,
			      in + wc.wr_id * msg_len);
			received++;
		}
	}
	for (size_t i = 0; i < size; i++)
		CHECK(sink[i] == pattern(i), "byte %zu of the Read is %#x", i, sink[i]);
	CHECK(rdma_post_send(id, (void *)WR_DONE, ctl[1], MSG, cmr, IBV_SEND_SIGNALED) == 0,
	      "done");
	wc = next_wc(cq);
	CHECK(wc.wr_id == WR_DONE, "wr_id %llu", (unsigned long long)wc.wr_id);
	printf("client: Read of %zu bytes verified; %d of %d Sends arrived before it completed\n",
	       size, before, sends);
	rdma_disconnect(id);
	ibv_dereg_mr(kmr);
	ibv_dereg_mr(rmr);
	ibv_dereg_mr(cmr);
	rdma_destroy_qp(id);
	ibv_destroy_cq(cq);
	ibv_dealloc_pd(pd);
	rdma_destroy_ep(id);
	free(sink);
	free(in);
	free(want);
	return 0;
}

int main(int argc, char **argv)
{
	if ((argc == 6 || argc == 7) && (strcmp(argv[1], "-s") == 0 || strcmp(argv[1], "-c") == 0)) {
		setvbuf(stdout, NULL, _IOLBF, 0);
		alarm(120);
		host = argv[2];
		size = strtoull(argv[4], NULL, 0);
		sends = atoi(argv[5]);
		if (argc == 7)
			msg_len = strtoull(argv[6], NULL, 0);
		if (size == 0 || size > (1u << 31) || sends < 1 || sends > 1000 || msg_len < MSG ||
		    msg_len > (64u << 20)) {
			fprintf(stderr, "SIZE 1..2^31, SENDS 1..1000, LEN 32..64 MiB\n");
			return 2;
		}
		who = argv[1][1] == 's' ? "server" : "client";
		return argv[1][1] == 's' ? server(argv[3]) : client(argv[3]);
	}
	return forked_main(argc, argv, client, server);
}
