/* rdma_cm calls in the orders programs make them after an event, above all after REJECTED
 * (run by tests/debian_tools.rs under valgrind's memcheck; argv[1] is a port on 127.0.0.1 where
 * nothing listens). Every call answers with the errno rdma-core's kernel gives for the id's
 * state, never a crash:
 *   - after REJECTED (nothing listening, and a listener that rejects with private data):
 *     rdma_connect, rdma_resolve_addr, rdma_resolve_route, rdma_bind_addr, rdma_listen,
 *     rdma_accept, rdma_reject are EINVAL (the id stays in the kernel's CONNECT state until
 *     destroyed); rdma_disconnect is 0, twice; the event acked twice is EINVAL the second time;
 *     no other event comes;
 *   - a connect repeated while connecting, and after ESTABLISHED, EINVAL; a disconnect
 *     repeated, 0; accept repeated, EINVAL;
 *   - Debian perftest's retry: ids and channel destroyed (the id with its QP still on it),
 *     then the destroyed id resolved, destroyed again, its channel read and destroyed again,
 *     its event acked again: EINVAL each (the void calls return), then new ids and channels
 *     made and connected again, 20 rounds;
 *   - an id destroyed with its ADDR_RESOLVED event still queued: the event never comes;
 *     one migrated to another channel: the event comes there;
 *   - rdma_destroy_event_channel with an id still on it: the id still answers and is
 *     destroyed normally, the channel answers EINVAL;
 *   - a synchronous id (rdma_create_ep) refused: rdma_connect -1 ECONNREFUSED, then EINVAL. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>

#include "check.h"

/* `call` fails with -1 and `e` in errno. */
#define FAILS(call, e)                                                   \
	do {                                                             \
		errno = 0;                                               \
		int rc_ = (call);                                        \
		CHECK(rc_ == -1 && errno == (e));                        \
	} while (0)

static struct sockaddr_in loopback(int port)
{
	struct sockaddr_in sin = { .sin_family = AF_INET, .sin_port = htons(port) };
	sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	return sin;
}

static struct rdma_cm_event *expect(struct rdma_event_channel *ch, enum rdma_cm_event_type t,
				    struct rdma_cm_id *id)
{
	struct rdma_cm_event *ev = NULL;
	CHECK(rdma_get_cm_event(ch, &ev) == 0 && ev);
	if (ev->event != t)
		fprintf(stderr, "got %s, wanted %s\n", rdma_event_str(ev->event), rdma_event_str(t));
	CHECK(ev->event == t && (!id || ev->id == id));
	return ev;
}

static void nothing_waits(struct rdma_event_channel *ch)
{
	int fl = fcntl(ch->fd, F_GETFL);
	CHECK(fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK) == 0);
	struct rdma_cm_event *ev;
	FAILS(rdma_get_cm_event(ch, &ev), EAGAIN);
	CHECK(fcntl(ch->fd, F_SETFL, fl) == 0);
}

static struct ibv_qp_init_attr qp_attr(void)
{
	struct ibv_qp_init_attr a = {
		.qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	return a;
}

/* A new id on `ch`, resolved to 127.0.0.1:`port`, with a QP, connecting. */
static struct rdma_cm_id *connecting(struct rdma_event_channel *ch, int port)
{
	struct rdma_cm_id *id;
	CHECK(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) == 0);
	struct sockaddr_in dst = loopback(port);
	FAILS(rdma_connect(id, NULL), EINVAL); /* no route yet (and no QP) */
	CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000) == 0);
	CHECK(rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, id)) == 0);
	FAILS(rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000), EINVAL);
	CHECK(rdma_resolve_route(id, 2000) == 0);
	CHECK(rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED, id)) == 0);
	FAILS(rdma_resolve_route(id, 2000), EINVAL);
	struct ibv_qp_init_attr a = qp_attr();
	CHECK(rdma_create_qp(id, NULL, &a) == 0);
	CHECK(rdma_connect(id, NULL) == 0);
	FAILS(rdma_connect(id, NULL), EINVAL); /* already connecting */
	return id;
}

/* Every call on an id that got REJECTED (`ev`, not yet acked). */
static void after_rejected(struct rdma_event_channel *ch, struct rdma_cm_id *id,
			   struct rdma_cm_event *ev)
{
	CHECK(ev->status != 0);
	CHECK(rdma_ack_cm_event(ev) == 0);
	FAILS(rdma_ack_cm_event(ev), EINVAL);
	struct sockaddr_in any = loopback(0);
	FAILS(rdma_connect(id, NULL), EINVAL);
	FAILS(rdma_resolve_addr(id, NULL, (struct sockaddr *)&any, 2000), EINVAL);
	FAILS(rdma_resolve_route(id, 2000), EINVAL);
	FAILS(rdma_bind_addr(id, (struct sockaddr *)&any), EINVAL);
	FAILS(rdma_listen(id, 1), EINVAL);
	struct rdma_conn_param p = { 0 };
	FAILS(rdma_accept(id, &p), EINVAL);
	FAILS(rdma_reject(id, NULL, 0), EINVAL);
	CHECK(rdma_disconnect(id) == 0);
	CHECK(rdma_disconnect(id) == 0);
	nothing_waits(ch);
}

/* A client refused because nothing listens at `port`. */
static void refused_by_nobody(struct rdma_event_channel *ch, int port)
{
	struct rdma_cm_id *id = connecting(ch, port);
	struct rdma_cm_event *ev = expect(ch, RDMA_CM_EVENT_REJECTED, id);
	CHECK(ev->status == -ECONNREFUSED);
	after_rejected(ch, id, ev);
	rdma_destroy_qp(id);
	CHECK(rdma_destroy_id(id) == 0);
}

/* A client refused by a listener's rdma_reject, and the calls on the rejected request. */
static void refused_by_listener(struct rdma_event_channel *ch)
{
	struct rdma_event_channel *sch = rdma_create_event_channel();
	CHECK(sch);
	struct rdma_cm_id *lid;
	CHECK(rdma_create_id(sch, &lid, NULL, RDMA_PS_TCP) == 0);
	struct sockaddr_in any = loopback(0);
	CHECK(rdma_bind_addr(lid, (struct sockaddr *)&any) == 0);
	FAILS(rdma_bind_addr(lid, (struct sockaddr *)&any), EINVAL);
	CHECK(rdma_listen(lid, 4) == 0);
	FAILS(rdma_listen(lid, 4), EINVAL);
	FAILS(rdma_resolve_addr(lid, NULL, (struct sockaddr *)&any, 2000), EINVAL);
	FAILS(rdma_connect(lid, NULL), EINVAL);
	int port = ntohs(rdma_get_src_port(lid));

	struct rdma_cm_id *id = connecting(ch, port);
	struct rdma_cm_event *req = expect(sch, RDMA_CM_EVENT_CONNECT_REQUEST, NULL);
	struct rdma_cm_id *child = req->id;
	CHECK(req->listen_id == lid);
	CHECK(rdma_ack_cm_event(req) == 0);
	FAILS(rdma_connect(child, NULL), EINVAL);
	FAILS(rdma_resolve_addr(child, NULL, (struct sockaddr *)&any, 2000), EINVAL);
	CHECK(rdma_reject(child, "no", 3) == 0);
	FAILS(rdma_reject(child, "no", 3), EINVAL);
	struct rdma_conn_param p = { 0 };
	FAILS(rdma_accept(child, &p), EINVAL);
	CHECK(rdma_disconnect(child) == 0);

	struct rdma_cm_event *ev = expect(ch, RDMA_CM_EVENT_REJECTED, id);
	CHECK(ev->param.conn.private_data_len >= 3 &&
	      memcmp(ev->param.conn.private_data, "no", 3) == 0);
	after_rejected(ch, id, ev);
	rdma_destroy_qp(id);
	CHECK(rdma_destroy_id(id) == 0);

	/* Accepted this time: the calls that make no sense once connected are refused. */
	id = connecting(ch, port);
	req = expect(sch, RDMA_CM_EVENT_CONNECT_REQUEST, NULL);
	struct rdma_cm_id *child2 = req->id;
	CHECK(rdma_ack_cm_event(req) == 0);
	struct ibv_qp_init_attr a = qp_attr();
	CHECK(rdma_create_qp(child2, NULL, &a) == 0);
	CHECK(rdma_accept(child2, &p) == 0);
	FAILS(rdma_accept(child2, &p), EINVAL);
	CHECK(rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ESTABLISHED, id)) == 0);
	CHECK(rdma_ack_cm_event(expect(sch, RDMA_CM_EVENT_ESTABLISHED, child2)) == 0);
	FAILS(rdma_connect(id, NULL), EINVAL);
	FAILS(rdma_resolve_addr(id, NULL, (struct sockaddr *)&any, 2000), EINVAL);
	FAILS(rdma_resolve_route(id, 2000), EINVAL);
	FAILS(rdma_reject(child2, NULL, 0), EINVAL);
	CHECK(rdma_disconnect(id) == 0);
	CHECK(rdma_disconnect(id) == 0);
	CHECK(rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_DISCONNECTED, id)) == 0);
	CHECK(rdma_ack_cm_event(expect(sch, RDMA_CM_EVENT_DISCONNECTED, child2)) == 0);
	CHECK(rdma_disconnect(child2) == 0);
	FAILS(rdma_connect(id, NULL), EINVAL);
	rdma_destroy_qp(id);
	CHECK(rdma_destroy_id(id) == 0);
	rdma_destroy_qp(child2);
	CHECK(rdma_destroy_id(child2) == 0);
	CHECK(rdma_destroy_id(child) == 0);
	CHECK(rdma_destroy_id(lid) == 0);
	rdma_destroy_event_channel(sch);
}

/* Debian perftest 4.5-0.17's retry after REJECTED (rdma_cm_client_connection): it destroys its
 * ids (QP still on them) and channel, then uses them again. */
static void perftest_retry(int port)
{
	for (int round = 0; round < 20; round++) {
		struct rdma_event_channel *ch = rdma_create_event_channel();
		CHECK(ch);
		struct rdma_cm_id *id = connecting(ch, port);
		struct rdma_cm_event *ev = expect(ch, RDMA_CM_EVENT_REJECTED, id);
		CHECK(rdma_ack_cm_event(ev) == 0);
		struct ibv_qp *qp = id->qp;
		CHECK(rdma_destroy_id(id) == 0); /* the QP stays, as in rdma-core */
		rdma_destroy_event_channel(ch);

		struct sockaddr_in dst = loopback(port);
		FAILS(rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000), EINVAL);
		FAILS(rdma_resolve_route(id, 2000), EINVAL);
		FAILS(rdma_connect(id, NULL), EINVAL);
		FAILS(rdma_disconnect(id), EINVAL);
		FAILS(rdma_destroy_id(id), EINVAL);
		FAILS(rdma_ack_cm_event(ev), EINVAL);
		if (round == 0) {
			/* Held 1 s first, as a reader racing its main thread's teardown. */
			struct rdma_cm_event *none;
			FAILS(rdma_get_cm_event(ch, &none), EINVAL);
		}
		struct rdma_cm_id *other;
		FAILS(rdma_create_id(ch, &other, NULL, RDMA_PS_TCP), EINVAL);
		rdma_destroy_event_channel(ch);
		rdma_destroy_qp(id);
		CHECK(ibv_destroy_qp(qp) == 0);
	}
}

/* An id destroyed before its queued event is read: the event is dropped with it. */
static void destroyed_with_event_queued(int port)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	CHECK(ch);
	struct rdma_cm_id *id;
	CHECK(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) == 0);
	struct sockaddr_in dst = loopback(port);
	CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000) == 0);
	CHECK(rdma_destroy_id(id) == 0);
	nothing_waits(ch);
	rdma_destroy_event_channel(ch);
}

/* rdma_migrate_id moves an id's queued event to its new channel; a destroyed channel is
 * refused. */
static void migrated_with_event_queued(int port)
{
	struct rdma_event_channel *a = rdma_create_event_channel(), *b = rdma_create_event_channel();
	struct rdma_event_channel *gone = rdma_create_event_channel();
	CHECK(a && b && gone);
	rdma_destroy_event_channel(gone);
	struct rdma_cm_id *id;
	CHECK(rdma_create_id(a, &id, NULL, RDMA_PS_TCP) == 0);
	struct sockaddr_in dst = loopback(port);
	CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000) == 0);
	FAILS(rdma_migrate_id(id, gone), EINVAL);
	CHECK(rdma_migrate_id(id, b) == 0 && id->channel == b);
	nothing_waits(a);
	CHECK(rdma_ack_cm_event(expect(b, RDMA_CM_EVENT_ADDR_RESOLVED, id)) == 0);
	rdma_destroy_event_channel(a); /* no id left on it */
	CHECK(rdma_destroy_id(id) == 0);
	rdma_destroy_event_channel(b);
}

/* rdma_destroy_event_channel with an id still on it (rdma-core frees the channel under the
 * id): the id keeps working until it is destroyed; the channel is gone for the application. */
static void channel_destroyed_under_an_id(int port)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	CHECK(ch);
	struct rdma_cm_id *id;
	CHECK(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) == 0);
	rdma_destroy_event_channel(ch);
	struct rdma_cm_event *ev;
	FAILS(rdma_get_cm_event(ch, &ev), EINVAL);
	struct sockaddr_in dst = loopback(port);
	CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000) == 0);
	CHECK(rdma_destroy_id(id) == 0);
	rdma_destroy_event_channel(ch);
}

/* A synchronous id refused: the call answers ECONNREFUSED, then EINVAL. */
static void synchronous_refused(const char *port)
{
	struct rdma_addrinfo hints = { .ai_port_space = RDMA_PS_TCP }, *res;
	CHECK(rdma_getaddrinfo("127.0.0.1", port, &hints, &res) == 0);
	struct ibv_qp_init_attr a = qp_attr();
	struct rdma_cm_id *id;
	CHECK(rdma_create_ep(&id, res, NULL, &a) == 0);
	FAILS(rdma_connect(id, NULL), ECONNREFUSED);
	FAILS(rdma_connect(id, NULL), EINVAL);
	FAILS(rdma_resolve_route(id, 2000), EINVAL);
	CHECK(rdma_disconnect(id) == 0);
	rdma_destroy_ep(id);
	rdma_freeaddrinfo(res);
}

int main(int argc, char **argv)
{
	CHECK(argc == 2);
	int port = atoi(argv[1]);
	struct rdma_event_channel *ch = rdma_create_event_channel();
	CHECK(ch);
	refused_by_nobody(ch, port);
	refused_by_listener(ch);
	perftest_retry(port);
	destroyed_with_event_queued(port);
	migrated_with_event_queued(port);
	channel_destroyed_under_an_id(port);
	synchronous_refused(argv[1]);
	nothing_waits(ch);
	rdma_destroy_event_channel(ch);
	printf("ok: %d checks\n", checks);
	return 0;
}
