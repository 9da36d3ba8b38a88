/* ibv_destroy_qp takes the QP's completions that were not polled yet out of its CQ, as
 * rdma-core's providers do (mlx5, mlx4, irdma clean the CQ at the destroy): an application
 * may free what the work requests named once the QP is gone, and libfabric's verbs provider
 * does (it reports what was outstanding as flushed itself, then frees the endpoint; a
 * completion of the destroyed QP polled later named freed memory, and Open MPI crashed in
 * MPI_Finalize). The other QPs' completions in the same CQ stay.
 *
 * One process forks: the parent is the server, the child the client (librdmacm's synchronous
 * calls on 127.0.0.1:PORT). The server gives both of its connections one CQ with a
 * completion channel, armed for solicited completions:
 *
 *   1. client, connection B: Send "keep" (solicited); the server waits for the event
 *   2. server, connection A: Send "go"; client: Sends "m1", then "m2" (solicited), and
 *      disconnects A; the server waits for the event: "keep", the Send of "go", "m1" and
 *      "m2" are in the CQ, none polled
 *   3. server: ibv_destroy_qp of A, then polls: only B's "keep" is there
 *   4. server, B: Send "go"; client: Send "after"; the server polls it: the CQ still works
 *
 * Prints one line per side and "ok: N server checks". Every wait is bounded (alarm, polls).
 *
 *   cc -o destroy_cleans_cq destroy_cleans_cq.c -libverbs -lrdmacm && ./destroy_cleans_cq 7473
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>

#include "forked.h"

#define MSG 64

/* Waits for the armed CQ's event, acknowledges it, arms the CQ again (solicited only). */
static void wait_event(struct ibv_comp_channel *ch, struct ibv_cq *cq, const char *what)
{
	struct ibv_cq *ev_cq;
	void *ctx;
	CHECK(ibv_get_cq_event(ch, &ev_cq, &ctx) == 0, "event of %s", what);
	CHECK(ev_cq == cq, "the event names another CQ");
	ibv_ack_cq_events(cq, 1);
	CHECK(ibv_req_notify_cq(cq, 1) == 0, "arm again");
}

/* Polls `cq` until one completion came (bounded: 10 s). */
static struct ibv_wc poll_one(struct ibv_cq *cq, const char *what)
{
	struct ibv_wc wc;
	for (int i = 0; i < 10000; i++) {
		int n = ibv_poll_cq(cq, 1, &wc);
		if (n < 0)
			CHECK(0, "ibv_poll_cq");
		if (n == 1)
			return wc;
		usleep(1000);
	}
	CHECK(0, "no completion for %s within 10 s", what);
	return wc;
}

/* Accepts the next request with a QP on `pd` whose CQs are `cq`, with `n` receives posted
 * into bufs[first..first+n) (wr_id: the index). */
static struct rdma_cm_id *accept_one(struct rdma_cm_id *listen_id, struct ibv_pd *pd,
				     struct ibv_cq *cq, struct ibv_mr *mr, char (*bufs)[MSG],
				     int first, int n)
{
	struct rdma_cm_id *id;
	struct ibv_qp_init_attr attr;
	CHECK(rdma_get_request(listen_id, &id) == 0, "rdma_get_request");
	CHECK(id->verbs == pd->context, "the request's device is the listener's");
	init_attr(&attr, 8);
	attr.send_cq = cq;
	attr.recv_cq = cq;
	CHECK(rdma_create_qp(id, pd, &attr) == 0, "rdma_create_qp");
	for (int i = first; i < first + n; i++)
		CHECK(rdma_post_recv(id, (void *)(intptr_t)i, bufs[i], MSG, mr) == 0, "post_recv");
	CHECK(rdma_accept(id, NULL) == 0, "rdma_accept");
	return id;
}

static int server(const char *port)
{
	static char bufs[8][MSG];
	struct rdma_addrinfo *res = addrinfo(port, 1);
	struct rdma_cm_id *listen_id;
	CHECK(rdma_create_ep(&listen_id, res, NULL, NULL) == 0, "rdma_create_ep");
	rdma_freeaddrinfo(res);
	CHECK(rdma_listen(listen_id, 2) == 0, "rdma_listen");
	/* A listener on 127.0.0.1 has no device, as with the kernel's rdma_cm: the device its
	 * requests get is the connection manager's, which rdma_get_devices lists. */
	CHECK(listen_id->verbs == NULL, "a loopback listener has no device");
	int ndev = 0;
	struct ibv_context **devs = rdma_get_devices(&ndev);
	CHECK(devs && ndev == 1, "rdma_get_devices");
	struct ibv_context *ctx = devs[0];
	rdma_free_devices(devs);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd, "ibv_alloc_pd");
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	CHECK(ch, "ibv_create_comp_channel");
	struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, ch, 0);
	CHECK(cq, "ibv_create_cq");
	struct ibv_mr *mr = ibv_reg_mr(pd, bufs, sizeof bufs, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr, "ibv_reg_mr");
	CHECK(ibv_req_notify_cq(cq, 1) == 0, "arm");
	forked_ready();

	/* A: receives into bufs[0..4); B: into bufs[4..6). */
	struct rdma_cm_id *a = accept_one(listen_id, pd, cq, mr, bufs, 0, 4);
	struct rdma_cm_id *b = accept_one(listen_id, pd, cq, mr, bufs, 4, 2);
	uint32_t b_qpn = b->qp->qp_num;

	wait_event(ch, cq, "keep");
	CHECK(rdma_post_send(a, NULL, "go", 2, NULL, IBV_SEND_INLINE | IBV_SEND_SIGNALED) == 0,
	      "send go on A");
	wait_event(ch, cq, "m2");

	rdma_destroy_qp(a);
	struct ibv_wc wcs[16];
	int n = ibv_poll_cq(cq, 16, wcs);
	CHECK(n == 1, "%d completions after the destroy of A (first: qp %u wr_id %llu %s), not "
		      "B's one", n, n > 0 ? wcs[0].qp_num : 0,
	      n > 0 ? (unsigned long long)wcs[0].wr_id : 0ULL,
	      n > 0 ? ibv_wc_status_str(wcs[0].status) : "-");
	CHECK(wcs[0].qp_num == b_qpn && wcs[0].status == IBV_WC_SUCCESS &&
		      wcs[0].opcode == IBV_WC_RECV && wcs[0].wr_id == 4 && wcs[0].byte_len == 4 &&
		      memcmp(bufs[4], "keep", 4) == 0,
	      "B's keep: qp %u wr_id %llu status %s", wcs[0].qp_num,
	      (unsigned long long)wcs[0].wr_id, ibv_wc_status_str(wcs[0].status));
	printf("server: after ibv_destroy_qp of A, the CQ holds only B's completion\n");

	CHECK(rdma_post_send(b, NULL, "go", 2, NULL, IBV_SEND_INLINE | IBV_SEND_SIGNALED) == 0,
	      "send go on B");
	struct ibv_wc wc = poll_one(cq, "the Send of go on B");
	CHECK(wc.qp_num == b_qpn && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_SEND,
	      "go on B sent: %s", ibv_wc_status_str(wc.status));
	wc = poll_one(cq, "after");
	CHECK(wc.qp_num == b_qpn && wc.status == IBV_WC_SUCCESS && wc.wr_id == 5 &&
		      wc.byte_len == 5 && memcmp(bufs[5], "after", 5) == 0,
	      "after: %s", ibv_wc_status_str(wc.status));
	printf("server: B's next message arrived in the same CQ\n");

	rdma_disconnect(b);
	rdma_destroy_qp(b);
	rdma_destroy_id(a);
	rdma_destroy_id(b);
	CHECK(ibv_dereg_mr(mr) == 0, "ibv_dereg_mr");
	CHECK(ibv_destroy_cq(cq) == 0, "ibv_destroy_cq");
	CHECK(ibv_destroy_comp_channel(ch) == 0, "ibv_destroy_comp_channel");
	CHECK(ibv_dealloc_pd(pd) == 0, "ibv_dealloc_pd");
	rdma_destroy_ep(listen_id);
	return 0;
}

static struct rdma_cm_id *connect_one(const char *port, char *buf, struct ibv_mr **mr)
{
	struct rdma_addrinfo *res = addrinfo(port, 0);
	struct ibv_qp_init_attr attr;
	init_attr(&attr, 4);
	struct rdma_cm_id *id;
	CHECK(rdma_create_ep(&id, res, NULL, &attr) == 0, "rdma_create_ep");
	rdma_freeaddrinfo(res);
	*mr = rdma_reg_msgs(id, buf, MSG);
	CHECK(*mr, "rdma_reg_msgs");
	CHECK(rdma_post_recv(id, NULL, buf, MSG, *mr) == 0, "post_recv");
	CHECK(rdma_connect(id, NULL) == 0, "rdma_connect");
	return id;
}

static void send_msg(struct rdma_cm_id *id, const char *msg, int flags)
{
	struct ibv_wc wc;
	CHECK(rdma_post_send(id, NULL, (void *)msg, strlen(msg), NULL,
			     IBV_SEND_INLINE | IBV_SEND_SIGNALED | flags) == 0,
	      "send %s", msg);
	CHECK(rdma_get_send_comp(id, &wc) > 0 && wc.status == IBV_WC_SUCCESS, "%s sent", msg);
}

static void receive_go(struct rdma_cm_id *id, const char *buf)
{
	struct ibv_wc wc;
	CHECK(rdma_get_recv_comp(id, &wc) > 0 && wc.status == IBV_WC_SUCCESS, "go");
	CHECK(wc.byte_len == 2 && memcmp(buf, "go", 2) == 0, "payload %.2s", buf);
}

static int client(const char *port)
{
	static char abuf[MSG], bbuf[MSG];
	struct ibv_mr *amr, *bmr;
	struct rdma_cm_id *a = connect_one(port, abuf, &amr);
	struct rdma_cm_id *b = connect_one(port, bbuf, &bmr);
	send_msg(b, "keep", IBV_SEND_SOLICITED);
	receive_go(a, abuf);
	send_msg(a, "m1", 0);
	send_msg(a, "m2", IBV_SEND_SOLICITED);
	rdma_disconnect(a);
	receive_go(b, bbuf);
	send_msg(b, "after", 0);
	printf("client: sent keep, m1, m2 and after\n");
	rdma_disconnect(b);
	rdma_dereg_mr(amr);
	rdma_dereg_mr(bmr);
	rdma_destroy_ep(a);
	rdma_destroy_ep(b);
	return 0;
}

int main(int argc, char **argv)
{
	return forked_main(argc, argv, client, server);
}
