/* rdma_cm ids as rdma-core makes them (run by tests/debian_tools.rs), in one process over
 * 127.0.0.1 with three event channels:
 * - id->pd: NULL on a fresh id; once the id has its device (bound to an interface's
 *   address, resolved, a connection request) the device's PD, one for every id (librdmacm's
 *   ucma_get_device); rdma_create_qp without a PD uses it, and an MR registered in one id's
 *   PD serves another id's QP. An id bound to 127.0.0.1 has no device, listening too (the
 *   kernel's rdma_cm counts loopback addresses as wildcards);
 * - rdma_migrate_id of a listening id: its connection requests arrive on the new channel,
 *   one already queued on the old channel included, and the connections they become report
 *   there;
 * - rdma_migrate_id of a connected id: its DISCONNECTED arrives on the new channel, also
 *   after the channel it connected on was destroyed.
 * Prints "ok: N checks". */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

/* The next event on `ch`, which must be of type `want` (and about `id` unless NULL);
 * acknowledged. Returns the id it is about. */
static struct rdma_cm_id *expect(struct rdma_event_channel *ch, enum rdma_cm_event_type want,
				 struct rdma_cm_id *id)
{
	struct rdma_cm_event *ev;
	struct pollfd p = { .fd = ch->fd, .events = POLLIN };
	CHECK(poll(&p, 1, 5000) == 1);
	CHECK(rdma_get_cm_event(ch, &ev) == 0);
	if (ev->event != want)
		fprintf(stderr, "event %s, expected %s\n", rdma_event_str(ev->event),
			rdma_event_str(want));
	CHECK(ev->event == want);
	CHECK(id == NULL || ev->id == id);
	struct rdma_cm_id *got = ev->id;
	CHECK(rdma_ack_cm_event(ev) == 0);
	return got;
}

/* No event for the application on `ch` within 100 ms (read without blocking: the
 * descriptor may wake for an event rdma-core does not report on iWARP, TIMEWAIT_EXIT). */
static void quiet(struct rdma_event_channel *ch)
{
	int flags = fcntl(ch->fd, F_GETFL);
	CHECK(flags >= 0 && fcntl(ch->fd, F_SETFL, flags | O_NONBLOCK) == 0);
	struct pollfd p = { .fd = ch->fd, .events = POLLIN };
	poll(&p, 1, 100);
	struct rdma_cm_event *ev;
	errno = 0;
	int rc = rdma_get_cm_event(ch, &ev);
	if (rc == 0)
		fprintf(stderr, "unexpected %s\n", rdma_event_str(ev->event));
	CHECK(rc == -1 && errno == EAGAIN);
	CHECK(fcntl(ch->fd, F_SETFL, flags) == 0);
}

static struct ibv_qp_init_attr qp_attr(void)
{
	struct ibv_qp_init_attr a = {
		.qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 2, .max_recv_wr = 2, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	return a;
}

/* A client id on `ch` with a QP, connecting to 127.0.0.1:port. */
static struct rdma_cm_id *client(struct rdma_event_channel *ch, uint16_t port,
				 struct ibv_pd *devpd)
{
	struct rdma_cm_id *c;
	CHECK(rdma_create_id(ch, &c, NULL, RDMA_PS_TCP) == 0);
	CHECK(c->pd == NULL);
	struct sockaddr_in dst = v4("127.0.0.1", port);
	CHECK(rdma_resolve_addr(c, NULL, (struct sockaddr *)&dst, 2000) == 0);
	expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, c);
	/* Resolved: the id has the device, and its PD. */
	CHECK(c->verbs && c->pd == devpd);
	CHECK(rdma_resolve_route(c, 2000) == 0);
	expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED, c);
	struct ibv_qp_init_attr qa = qp_attr();
	CHECK(rdma_create_qp(c, NULL, &qa) == 0);
	CHECK(c->qp->pd == devpd && c->pd == devpd);
	struct rdma_conn_param cp = { .retry_count = 1 };
	CHECK(rdma_connect(c, &cp) == 0);
	return c;
}

int main(void)
{
	struct rdma_event_channel *a = rdma_create_event_channel();
	struct rdma_event_channel *b = rdma_create_event_channel();
	struct rdma_event_channel *c = rdma_create_event_channel();
	CHECK(a && b && c);

	/* A loopback bind: no device, no PD, also once listening. */
	struct rdma_cm_id *l, *other;
	CHECK(rdma_create_id(a, &l, NULL, RDMA_PS_TCP) == 0);
	CHECK(l->pd == NULL && l->verbs == NULL);
	struct sockaddr_in lo = v4("127.0.0.1", 0);
	CHECK(rdma_bind_addr(l, (struct sockaddr *)&lo) == 0);
	CHECK(l->pd == NULL && l->verbs == NULL);
	uint16_t port = ntohs(rdma_get_src_port(l));
	CHECK(port != 0);
	CHECK(rdma_listen(l, 4) == 0);
	CHECK(l->pd == NULL && l->verbs == NULL);
	/* id->pd: the device's PD once an id has the device (resolved, here), the same for
	 * every id. */
	CHECK(rdma_create_id(a, &other, NULL, RDMA_PS_TCP) == 0);
	struct sockaddr_in dst = v4("127.0.0.1", port);
	CHECK(rdma_resolve_addr(other, NULL, (struct sockaddr *)&dst, 2000) == 0);
	expect(a, RDMA_CM_EVENT_ADDR_RESOLVED, other);
	struct ibv_pd *devpd = other->pd;
	CHECK(devpd && other->verbs && devpd->context == other->verbs);

	/* A listening id moves to b: the request arrives there, not on a. */
	CHECK(rdma_migrate_id(l, b) == 0 && l->channel == b);
	struct rdma_cm_id *c1 = client(c, port, devpd);
	struct rdma_cm_id *r1 = expect(b, RDMA_CM_EVENT_CONNECT_REQUEST, NULL);
	quiet(a);
	CHECK(r1->channel == b);
	/* The request's id has the device's PD; an MR of another id's PD serves its QP. */
	CHECK(r1->pd == devpd);
	struct ibv_qp_init_attr qa = qp_attr();
	CHECK(rdma_create_qp(r1, NULL, &qa) == 0 && r1->qp->pd == devpd);
	static char buf[64];
	struct ibv_mr *mr = ibv_reg_mr(other->pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr);
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = sizeof buf, .lkey = mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1 }, *bad;
	CHECK(ibv_post_recv(r1->qp, &wr, &bad) == 0);
	CHECK(rdma_accept(r1, NULL) == 0);
	expect(b, RDMA_CM_EVENT_ESTABLISHED, r1);
	expect(c, RDMA_CM_EVENT_ESTABLISHED, c1);

	/* A request queued on b when the listener moves back to a goes with it. */
	struct rdma_cm_id *c2 = client(c, port, devpd);
	struct pollfd p = { .fd = b->fd, .events = POLLIN };
	CHECK(poll(&p, 1, 5000) == 1);
	CHECK(rdma_migrate_id(l, a) == 0 && l->channel == a);
	struct rdma_cm_id *r2 = expect(a, RDMA_CM_EVENT_CONNECT_REQUEST, NULL);
	quiet(b);
	CHECK(r2->channel == a && r2->pd == devpd);
	CHECK(rdma_reject(r2, NULL, 0) == 0);
	expect(c, RDMA_CM_EVENT_REJECTED, c2);
	CHECK(rdma_destroy_id(r2) == 0);
	rdma_destroy_qp(c2);
	CHECK(rdma_destroy_id(c2) == 0);

	/* A connected id moves from c to a, and c goes: its DISCONNECTED arrives on a. */
	CHECK(rdma_migrate_id(c1, a) == 0 && c1->channel == a);
	rdma_destroy_event_channel(c);
	CHECK(rdma_disconnect(r1) == 0);
	expect(b, RDMA_CM_EVENT_DISCONNECTED, r1);
	expect(a, RDMA_CM_EVENT_DISCONNECTED, c1);
	quiet(b);

	rdma_destroy_qp(c1);
	CHECK(rdma_destroy_id(c1) == 0);
	rdma_destroy_qp(r1);
	CHECK(rdma_destroy_id(r1) == 0);
	CHECK(ibv_dereg_mr(mr) == 0);
	CHECK(rdma_destroy_id(other) == 0);
	CHECK(rdma_destroy_id(l) == 0);
	rdma_destroy_event_channel(b);
	rdma_destroy_event_channel(a);
	printf("ok: %d checks\n", checks);
	return 0;
}
