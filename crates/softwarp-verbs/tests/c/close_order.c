/* The end of a connection, perftest's way: the server receives the client's last message,
 * answers it, and closes at once; the client is slow to finish (Linux siw under emulation
 * completes its last Send only after the server's answer arrived). The server's FIN must
 * wait for the client to close first (SOFTWARP_CLOSE_WAIT_MS, 2 s by default), or the
 * client's last Send fails (siw: "Bad wc status 2"; here: flushed, its QP in error). The
 * wait is the library's, in the background: rdma_disconnect and ibv_destroy_qp return at
 * once, as rdma-core's do.
 *
 * One process forks: the parent is the server, the child the client; synchronous librdmacm
 * calls on 127.0.0.1:PORT. Two connections, one per way the server closes:
 *
 *   client: Send "last"; server: receives it, Sends "bye", and as soon as "bye" completed
 *   closes: rdma_disconnect (round 1) or rdma_destroy_qp, i.e. ibv_destroy_qp (round 2),
 *   which return at once (under IMMEDIATE_MS)
 *   client: receives "bye", waits 300 ms, Sends "late", which must complete successfully,
 *   then disconnects; in round 1 the server's receive of "late" completed successfully.
 *
 * Round 3 is the mirror case (siw's ib_send_lat server under emulation was still in the call
 * that posted its last Send when our client, having received it, closed): the client
 * receives "bye" and closes at once (rdma_disconnect returns at once); the server Sends
 * "late" 100 ms after "bye". The client's FIN waits for the server's close
 * (SOFTWARP_INITIATOR_CLOSE_WAIT_MS, set to 400 here unless the environment sets it), so the
 * server's late Send completes successfully and the client receives it. With the wait at 0,
 * the Send fails.
 *
 * Prints one line per round and side, and "ok: N server checks" at the end. Every wait is
 * bounded (alarm).
 *
 *   cc -o close_order close_order.c -lrdmacm -libverbs && ./close_order 7472
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>

#include "forked.h"

#define SLOW_CLIENT_MS 300
#define SLOW_SERVER_MS 100
/* rdma_disconnect and ibv_destroy_qp return within this (rdma-core's return at once). */
#define IMMEDIATE_MS 60

static long now_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1000L + t.tv_nsec / 1000000L;
}

/* The server's part before the end: accept with two receives posted into msgs[0] and
 * msgs[1] (one for "last", one for "late": perftest reposts after each message), receive the
 * client's "last" into msgs[0], Send "bye". */
static struct rdma_cm_id *server_exchange(struct rdma_cm_id *listen_id, char (*msgs)[64],
					  struct ibv_mr **mr)
{
	struct rdma_cm_id *id;
	struct ibv_wc wc;
	CHECK(rdma_get_request(listen_id, &id) == 0, "rdma_get_request");
	*mr = rdma_reg_msgs(id, msgs, 2 * 64);
	CHECK(*mr, "rdma_reg_msgs");
	memset(msgs, 0, 2 * 64);
	CHECK(rdma_post_recv(id, (void *)0, msgs[0], 64, *mr) == 0, "post_recv");
	CHECK(rdma_post_recv(id, (void *)1, msgs[1], 64, *mr) == 0, "post_recv");
	CHECK(rdma_accept(id, NULL) == 0, "rdma_accept");
	CHECK(rdma_get_recv_comp(id, &wc) > 0 && wc.status == IBV_WC_SUCCESS, "last");
	CHECK(wc.byte_len == 4 && memcmp(msgs[0], "last", 4) == 0, "payload %.4s", msgs[0]);
	CHECK(rdma_post_send(id, NULL, "bye", 3, NULL, IBV_SEND_INLINE | IBV_SEND_SIGNALED) == 0,
	      "send bye");
	CHECK(rdma_get_send_comp(id, &wc) > 0 && wc.status == IBV_WC_SUCCESS, "bye sent");
	return id;
}

static void server_round(struct rdma_cm_id *listen_id, int round)
{
	static char msgs[2][64];
	struct ibv_mr *mr;
	struct ibv_wc wc;
	struct rdma_cm_id *id = server_exchange(listen_id, msgs, &mr);

	long start = now_ms();
	const char *how;
	if (round == 1) {
		how = "rdma_disconnect";
		CHECK(rdma_disconnect(id) == 0, "rdma_disconnect");
	} else {
		how = "ibv_destroy_qp";
		rdma_destroy_qp(id);
	}
	long waited = now_ms() - start;
	CHECK(waited < IMMEDIATE_MS, "%s returned after %ld ms: it waited in the caller", how,
	      waited);
	if (round == 1) {
		CHECK(rdma_get_recv_comp(id, &wc) > 0, "late");
		CHECK(wc.status == IBV_WC_SUCCESS, "late: %s", ibv_wc_status_str(wc.status));
		CHECK(wc.byte_len == 4 && memcmp(msgs[1], "late", 4) == 0, "payload %.4s", msgs[1]);
		printf("server: round 1: %s returned at once; the client's late Send arrived\n",
		       how);
	} else {
		printf("server: round 2: %s returned at once\n", how);
	}
	rdma_dereg_mr(mr);
	rdma_destroy_ep(id);
}

/* Round 3: the client closes as soon as it has the server's "bye"; the server is late. */
static void server_round_late(struct rdma_cm_id *listen_id)
{
	static char msgs[2][64];
	struct ibv_mr *mr;
	struct ibv_wc wc;
	struct rdma_cm_id *id = server_exchange(listen_id, msgs, &mr);
	usleep(SLOW_SERVER_MS * 1000);
	int rc = rdma_post_send(id, NULL, "late", 4, NULL, IBV_SEND_INLINE | IBV_SEND_SIGNALED);
	CHECK(rc == 0, "post of the late Send refused: the client closed at once");
	CHECK(rdma_get_send_comp(id, &wc) > 0, "late sent");
	CHECK(wc.status == IBV_WC_SUCCESS, "late Send: %s (the client closed at once)",
	      ibv_wc_status_str(wc.status));
	printf("server: round 3: the Send %d ms after the client's last receive completed\n",
	       SLOW_SERVER_MS);
	rdma_disconnect(id);
	rdma_dereg_mr(mr);
	rdma_destroy_ep(id);
}

/* The client's part before the end: connect with `nrecv` receives posted into msgs[0] and
 * msgs[1], Send "last", receive the server's "bye" into msgs[0]. */
static struct rdma_cm_id *client_exchange(const char *port, char (*msgs)[64], int nrecv,
					  struct ibv_mr **mr)
{
	struct rdma_addrinfo *res = addrinfo(port, 0);
	struct ibv_qp_init_attr attr;
	init_attr(&attr, 4);
	struct rdma_cm_id *id;
	struct ibv_wc wc;
	CHECK(rdma_create_ep(&id, res, NULL, &attr) == 0, "rdma_create_ep");
	rdma_freeaddrinfo(res);
	*mr = rdma_reg_msgs(id, msgs, 2 * 64);
	CHECK(*mr, "rdma_reg_msgs");
	memset(msgs, 0, 2 * 64);
	for (int i = 0; i < nrecv; i++)
		CHECK(rdma_post_recv(id, (void *)(intptr_t)i, msgs[i], 64, *mr) == 0, "post_recv");
	CHECK(rdma_connect(id, NULL) == 0, "rdma_connect");
	CHECK(rdma_post_send(id, NULL, "last", 4, NULL, IBV_SEND_INLINE | IBV_SEND_SIGNALED) == 0,
	      "send last");
	CHECK(rdma_get_send_comp(id, &wc) > 0 && wc.status == IBV_WC_SUCCESS, "last sent");
	CHECK(rdma_get_recv_comp(id, &wc) > 0 && wc.status == IBV_WC_SUCCESS, "bye");
	CHECK(wc.byte_len == 3 && memcmp(msgs[0], "bye", 3) == 0, "payload %.3s", msgs[0]);
	return id;
}

static void client_round_late(const char *port)
{
	static char msgs[2][64];
	struct ibv_mr *mr;
	struct ibv_wc wc;
	struct rdma_cm_id *id = client_exchange(port, msgs, 2, &mr);
	long start = now_ms();
	CHECK(rdma_disconnect(id) == 0, "rdma_disconnect");
	long waited = now_ms() - start;
	CHECK(waited < IMMEDIATE_MS, "rdma_disconnect returned after %ld ms: it waited in the caller",
	      waited);
	CHECK(rdma_get_recv_comp(id, &wc) > 0, "late");
	CHECK(wc.status == IBV_WC_SUCCESS, "late: %s", ibv_wc_status_str(wc.status));
	CHECK(wc.byte_len == 4 && memcmp(msgs[1], "late", 4) == 0, "payload %.4s", msgs[1]);
	printf("client: round 3: rdma_disconnect returned at once; the server's late Send arrived\n");
	rdma_dereg_mr(mr);
	rdma_destroy_ep(id);
}

static void client_round(const char *port, int round)
{
	static char msgs[2][64];
	struct ibv_mr *mr;
	struct ibv_wc wc;
	struct rdma_cm_id *id = client_exchange(port, msgs, 1, &mr);
	usleep(SLOW_CLIENT_MS * 1000);
	int rc = rdma_post_send(id, NULL, "late", 4, NULL, IBV_SEND_INLINE | IBV_SEND_SIGNALED);
	CHECK(rc == 0, "post of the late Send refused: the server closed first");
	CHECK(rdma_get_send_comp(id, &wc) > 0, "late sent");
	CHECK(wc.status == IBV_WC_SUCCESS, "late Send: %s (the server closed first)",
	      ibv_wc_status_str(wc.status));
	printf("client: round %d: the Send %d ms after the server's last message completed\n",
	       round, SLOW_CLIENT_MS);
	rdma_disconnect(id);
	rdma_dereg_mr(mr);
	rdma_destroy_ep(id);
}

static int client(const char *port)
{
	client_round(port, 1);
	client_round(port, 2);
	client_round_late(port);
	return 0;
}

static int server(const char *port)
{
	struct rdma_addrinfo *res = addrinfo(port, 1);
	struct ibv_qp_init_attr attr;
	init_attr(&attr, 4);
	struct rdma_cm_id *listen_id;
	CHECK(rdma_create_ep(&listen_id, res, NULL, &attr) == 0, "rdma_create_ep");
	rdma_freeaddrinfo(res);
	CHECK(rdma_listen(listen_id, 2) == 0, "rdma_listen");
	forked_ready();
	server_round(listen_id, 1);
	server_round(listen_id, 2);
	server_round_late(listen_id);
	rdma_destroy_ep(listen_id);
	return 0;
}

int main(int argc, char **argv)
{
	/* Before the library reads it (it does so once per process, at the first close). */
	setenv("SOFTWARP_INITIATOR_CLOSE_WAIT_MS", "400", 0);
	return forked_main(argc, argv, client, server);
}
