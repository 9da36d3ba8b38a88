/* rdma_conn_param's rnr_retry_count (run by tests/debian_tools.rs with SOFTWARP_RNR_WAIT_MS=0,
 * so that a QP left alone does not wait): in one process over 127.0.0.1,
 * - rdma_accept's count is the accepting QP's RNR wait, as ibv_modify_qp's rnr_retry would
 *   set it: 6 retries of min_rnr_timer code 0 (655.36 ms, never set) hold the client's
 *   Send until the server posts its receive 300 ms later, and it arrives whole;
 * - rdma_connect's count likewise for the connecting QP (the server's Send to it);
 * - a count of 0 (a zeroed rdma_conn_param) leaves the QP as it was: here no wait, so the
 *   Send that finds no receive ends the connection and the late receive is flushed.
 * Prints "ok: N checks". */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <rdma/rdma_cma.h>

#include "check.h"

static struct sockaddr_in v4(const char *ip, uint16_t port)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
	inet_pton(AF_INET, ip, &a.sin_addr);
	return a;
}

/* The next event on `ch` (within 5 s), which must be of type `want`; acknowledged. */
static struct rdma_cm_id *expect(struct rdma_event_channel *ch, enum rdma_cm_event_type want)
{
	struct rdma_cm_event *ev;
	struct pollfd p = { .fd = ch->fd, .events = POLLIN };
	CHECK(poll(&p, 1, 5000) == 1);
	CHECK(rdma_get_cm_event(ch, &ev) == 0);
	if (ev->event != want)
		fprintf(stderr, "event %s, expected %s\n", rdma_event_str(ev->event),
			rdma_event_str(want));
	CHECK(ev->event == want);
	struct rdma_cm_id *id = ev->id;
	CHECK(rdma_ack_cm_event(ev) == 0);
	return id;
}

static long long now_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* The next completion on `cq`, polled for at most 5 s. */
static struct ibv_wc next_wc(struct ibv_cq *cq)
{
	struct ibv_wc wc;
	long long end = now_ms() + 5000;
	int n;
	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0 && now_ms() < end)
		usleep(1000);
	CHECK(n == 1);
	return wc;
}

static struct ibv_qp_init_attr qp_attr(void)
{
	struct ibv_qp_init_attr a = {
		.qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	return a;
}

struct pair {
	struct rdma_cm_id *client, *server;
	struct ibv_mr *cmr, *smr;
	char cbuf[64], sbuf[64];
};

/* A connection from a client id on `cch` to the listener `l` (on `sch`), the client
 * connecting and the server accepting with the given rnr_retry_count. */
static void connect_pair(struct pair *p, struct rdma_event_channel *cch,
			 struct rdma_event_channel *sch, uint16_t port, uint8_t connect_count,
			 uint8_t accept_count)
{
	CHECK(rdma_create_id(cch, &p->client, NULL, RDMA_PS_TCP) == 0);
	struct sockaddr_in dst = v4("127.0.0.1", port);
	CHECK(rdma_resolve_addr(p->client, NULL, (struct sockaddr *)&dst, 2000) == 0);
	expect(cch, RDMA_CM_EVENT_ADDR_RESOLVED);
	CHECK(rdma_resolve_route(p->client, 2000) == 0);
	expect(cch, RDMA_CM_EVENT_ROUTE_RESOLVED);
	struct ibv_qp_init_attr qa = qp_attr();
	CHECK(rdma_create_qp(p->client, NULL, &qa) == 0);
	struct rdma_conn_param cp = { .responder_resources = 1, .initiator_depth = 1,
				      .retry_count = 7, .rnr_retry_count = connect_count };
	CHECK(rdma_connect(p->client, &cp) == 0);
	p->server = expect(sch, RDMA_CM_EVENT_CONNECT_REQUEST);
	qa = qp_attr();
	CHECK(rdma_create_qp(p->server, NULL, &qa) == 0);
	struct rdma_conn_param ap = { .responder_resources = 1, .initiator_depth = 1,
				      .rnr_retry_count = accept_count };
	CHECK(rdma_accept(p->server, &ap) == 0);
	expect(sch, RDMA_CM_EVENT_ESTABLISHED);
	expect(cch, RDMA_CM_EVENT_ESTABLISHED);
	p->cmr = ibv_reg_mr(p->client->pd, p->cbuf, sizeof p->cbuf, IBV_ACCESS_LOCAL_WRITE);
	p->smr = ibv_reg_mr(p->server->pd, p->sbuf, sizeof p->sbuf, IBV_ACCESS_LOCAL_WRITE);
	CHECK(p->cmr && p->smr);
}

/* `from` sends 64 bytes to `to`, which posts its receive only 300 ms later; returns the
 * status of the receive's completion (checking the data when it succeeded). */
static enum ibv_wc_status late_receive(struct rdma_cm_id *from, struct ibv_mr *fmr, char *fbuf,
				       struct rdma_cm_id *to, struct ibv_mr *tmr, char *tbuf)
{
	memset(fbuf, 0x5a, 64);
	memset(tbuf, 0, 64);
	struct ibv_sge ss = { .addr = (uintptr_t)fbuf, .length = 64, .lkey = fmr->lkey };
	struct ibv_send_wr sw = { .wr_id = 1, .sg_list = &ss, .num_sge = 1,
				  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED },
			   *sbad;
	CHECK(ibv_post_send(from->qp, &sw, &sbad) == 0);
	usleep(300 * 1000);
	struct ibv_sge rs = { .addr = (uintptr_t)tbuf, .length = 64, .lkey = tmr->lkey };
	struct ibv_recv_wr rw = { .wr_id = 2, .sg_list = &rs, .num_sge = 1 }, *rbad;
	if (ibv_post_recv(to->qp, &rw, &rbad) != 0)
		return IBV_WC_WR_FLUSH_ERR; /* the QP is in the error state already */
	struct ibv_wc wc = next_wc(to->recv_cq);
	CHECK(wc.wr_id == 2);
	if (wc.status == IBV_WC_SUCCESS) {
		CHECK(wc.byte_len == 64 && tbuf[0] == 0x5a && tbuf[63] == 0x5a);
		struct ibv_wc swc = next_wc(from->send_cq);
		CHECK(swc.wr_id == 1 && swc.status == IBV_WC_SUCCESS);
	}
	return wc.status;
}

static void close_pair(struct pair *p)
{
	rdma_disconnect(p->client);
	rdma_destroy_qp(p->client);
	rdma_destroy_qp(p->server);
	CHECK(ibv_dereg_mr(p->cmr) == 0 && ibv_dereg_mr(p->smr) == 0);
	CHECK(rdma_destroy_id(p->client) == 0);
	CHECK(rdma_destroy_id(p->server) == 0);
}

int main(void)
{
	const char *wait = getenv("SOFTWARP_RNR_WAIT_MS");
	CHECK(wait && strcmp(wait, "0") == 0);
	struct rdma_event_channel *sch = rdma_create_event_channel();
	struct rdma_event_channel *cch = rdma_create_event_channel();
	CHECK(sch && cch);
	struct rdma_cm_id *l;
	CHECK(rdma_create_id(sch, &l, NULL, RDMA_PS_TCP) == 0);
	struct sockaddr_in lo = v4("127.0.0.1", 0);
	CHECK(rdma_bind_addr(l, (struct sockaddr *)&lo) == 0 && rdma_listen(l, 4) == 0);
	uint16_t port = ntohs(rdma_get_src_port(l));

	/* Both ends ask for 6 retries: each holds a Send for its late receive. */
	struct pair p;
	connect_pair(&p, cch, sch, port, 6, 6);
	CHECK(late_receive(p.client, p.cmr, p.cbuf, p.server, p.smr, p.sbuf) == IBV_WC_SUCCESS);
	CHECK(late_receive(p.server, p.smr, p.sbuf, p.client, p.cmr, p.cbuf) == IBV_WC_SUCCESS);
	close_pair(&p);

	/* The server's 0 leaves its QP without a wait: the client's Send ends the
	 * connection. */
	struct pair q;
	connect_pair(&q, cch, sch, port, 6, 0);
	CHECK(late_receive(q.client, q.cmr, q.cbuf, q.server, q.smr, q.sbuf) != IBV_WC_SUCCESS);
	close_pair(&q);

	CHECK(rdma_destroy_id(l) == 0);
	rdma_destroy_event_channel(cch);
	rdma_destroy_event_channel(sch);
	printf("ok: %d checks\n", checks);
	return 0;
}
