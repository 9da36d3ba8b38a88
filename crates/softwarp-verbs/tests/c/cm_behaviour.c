/* rdma_cm behaviours middleware depends on (run by tests/debian_tools.rs), as rdma-core's:
 * - rdma_bind_addr takes the port (port 0 picks one, rdma_get_src_port says which, before
 *   rdma_listen: qperf sends it to its peer then), and rdma_listen keeps it;
 * - RDMA_OPTION_ID_AFONLY: [::] for IPv6 only and 0.0.0.0 listen on one port side by side
 *   (a dual-stack listener, tgt's iSER target);
 * - rdma_migrate_id of an id made without a channel (libfabric's endpoints), before it
 *   listens: its connection requests arrive on the new channel; and back to synchronous;
 * - rdma_getaddrinfo with neither name nor service: the addresses come from the hints. */
#include <errno.h>
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

/* The next event on `ch`, which must be of type `want`; acknowledged. */
static struct rdma_cm_id *expect(struct rdma_event_channel *ch, enum rdma_cm_event_type want)
{
	struct rdma_cm_event *ev;
	CHECK(rdma_get_cm_event(ch, &ev) == 0);
	if (ev->event != want)
		fprintf(stderr, "event %s, expected %s\n", rdma_event_str(ev->event),
			rdma_event_str(want));
	CHECK(ev->event == want);
	struct rdma_cm_id *id = ev->id;
	CHECK(rdma_ack_cm_event(ev) == 0);
	return id;
}

int main(void)
{
	/* Port at bind. */
	struct rdma_event_channel *ch = rdma_create_event_channel();
	CHECK(ch);
	struct rdma_cm_id *l;
	CHECK(rdma_create_id(ch, &l, NULL, RDMA_PS_TCP) == 0);
	struct sockaddr_in any = v4("127.0.0.1", 0);
	CHECK(rdma_bind_addr(l, (struct sockaddr *)&any) == 0);
	uint16_t port = ntohs(rdma_get_src_port(l));
	CHECK(port != 0);
	CHECK(rdma_listen(l, 4) == 0);
	CHECK(ntohs(rdma_get_src_port(l)) == port);
	/* A second id cannot take the port a listener holds. */
	struct rdma_cm_id *dup;
	CHECK(rdma_create_id(ch, &dup, NULL, RDMA_PS_TCP) == 0);
	struct sockaddr_in same = v4("127.0.0.1", port);
	errno = 0;
	CHECK(rdma_bind_addr(dup, (struct sockaddr *)&same) == -1 && errno == EADDRINUSE);
	CHECK(rdma_destroy_id(dup) == 0);
	CHECK(rdma_destroy_id(l) == 0);

	/* AFONLY: [::] for IPv6 only, then 0.0.0.0 on the same port. */
	struct rdma_cm_id *l6, *l4;
	CHECK(rdma_create_id(ch, &l6, NULL, RDMA_PS_TCP) == 0);
	int on = 1;
	CHECK(rdma_set_option(l6, RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY, &on, sizeof on) == 0);
	errno = 0;
	CHECK(rdma_set_option(l6, RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY, &on, 1) == -1 &&
	      errno == EINVAL);
	struct sockaddr_in6 any6 = { .sin6_family = AF_INET6, .sin6_addr = IN6ADDR_ANY_INIT };
	if (rdma_bind_addr(l6, (struct sockaddr *)&any6) == 0) {
		uint16_t p6 = ntohs(rdma_get_src_port(l6));
		CHECK(rdma_create_id(ch, &l4, NULL, RDMA_PS_TCP) == 0);
		struct sockaddr_in any4 = v4("0.0.0.0", p6);
		CHECK(rdma_bind_addr(l4, (struct sockaddr *)&any4) == 0);
		CHECK(rdma_listen(l6, 4) == 0);
		CHECK(rdma_listen(l4, 4) == 0);
		CHECK(rdma_destroy_id(l4) == 0);
	} else {
		/* A host without IPv6 (the test says so). */
		printf("no IPv6\n");
	}
	CHECK(rdma_destroy_id(l6) == 0);

	/* Migrate a synchronous id to a channel before it listens. */
	struct rdma_cm_id *s;
	CHECK(rdma_create_id(NULL, &s, NULL, RDMA_PS_TCP) == 0);
	errno = 0;
	CHECK(rdma_migrate_id(s, NULL) == -1 && errno == EINVAL);
	struct rdma_event_channel *ch2 = rdma_create_event_channel();
	CHECK(ch2);
	CHECK(rdma_migrate_id(s, ch2) == 0 && s->channel == ch2);
	CHECK(rdma_bind_addr(s, (struct sockaddr *)&any) == 0);
	port = ntohs(rdma_get_src_port(s));
	CHECK(rdma_listen(s, 4) == 0);
	struct rdma_cm_id *c;
	CHECK(rdma_create_id(ch, &c, NULL, RDMA_PS_TCP) == 0);
	struct sockaddr_in dst = v4("127.0.0.1", port);
	CHECK(rdma_resolve_addr(c, NULL, (struct sockaddr *)&dst, 2000) == 0);
	expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED);
	CHECK(rdma_resolve_route(c, 2000) == 0);
	expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED);
	struct ibv_qp_init_attr qa = {
		.qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	CHECK(rdma_create_qp(c, NULL, &qa) == 0);
	struct rdma_conn_param cp = { .retry_count = 1 };
	CHECK(rdma_connect(c, &cp) == 0);
	/* The request arrives on the listener's new channel, asynchronously. */
	struct rdma_cm_id *req = expect(ch2, RDMA_CM_EVENT_CONNECT_REQUEST);
	CHECK(req->channel == ch2);
	CHECK(rdma_reject(req, NULL, 0) == 0);
	expect(ch, RDMA_CM_EVENT_REJECTED);
	CHECK(rdma_destroy_id(req) == 0);
	rdma_destroy_qp(c);
	CHECK(rdma_destroy_id(c) == 0);
	CHECK(rdma_destroy_id(s) == 0);

	/* And an id of a channel made synchronous: its calls complete in place. */
	struct rdma_cm_id *a;
	CHECK(rdma_create_id(ch2, &a, NULL, RDMA_PS_TCP) == 0);
	CHECK(rdma_migrate_id(a, NULL) == 0 && a->channel != ch2);
	CHECK(rdma_resolve_addr(a, NULL, (struct sockaddr *)&dst, 2000) == 0);
	CHECK(a->event == NULL || a->event->event == RDMA_CM_EVENT_ADDR_RESOLVED);
	CHECK(rdma_destroy_id(a) == 0);
	rdma_destroy_event_channel(ch2);
	rdma_destroy_event_channel(ch);

	/* rdma_getaddrinfo from the hints alone. */
	struct rdma_addrinfo hints, *res;
	memset(&hints, 0, sizeof hints);
	errno = 0;
	CHECK(rdma_getaddrinfo(NULL, NULL, NULL, &res) == -1 && errno == EINVAL);
	struct sockaddr_in hs = v4("127.0.0.1", 0), hd = v4("127.0.0.1", 4791);
	hints.ai_port_space = RDMA_PS_TCP;
	hints.ai_qp_type = IBV_QPT_RC;
	hints.ai_family = AF_INET;
	hints.ai_src_addr = (struct sockaddr *)&hs;
	hints.ai_src_len = sizeof hs;
	hints.ai_dst_addr = (struct sockaddr *)&hd;
	hints.ai_dst_len = sizeof hd;
	CHECK(rdma_getaddrinfo(NULL, NULL, &hints, &res) == 0);
	CHECK(res->ai_dst_len == sizeof hd && memcmp(res->ai_dst_addr, &hd, sizeof hd) == 0);
	CHECK(res->ai_src_len == sizeof hs && memcmp(res->ai_src_addr, &hs, sizeof hs) == 0);
	CHECK(res->ai_port_space == RDMA_PS_TCP && res->ai_qp_type == IBV_QPT_RC);
	rdma_freeaddrinfo(res);
	/* A name and the hints' source: the source comes with the result. */
	CHECK(rdma_getaddrinfo("127.0.0.1", "4791", &hints, &res) == 0);
	CHECK(res->ai_src_len == sizeof hs && memcmp(res->ai_src_addr, &hs, sizeof hs) == 0);
	rdma_freeaddrinfo(res);

	printf("ok: %d checks\n", checks);
	return 0;
}
