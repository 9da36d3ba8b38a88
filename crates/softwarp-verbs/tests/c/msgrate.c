/* The C twin of crates/softwarp/examples/msgrate.rs, over Softwarp's libibverbs/librdmacm:
 * message rate of small Sends between two QPs on loopback, driven by one thread, so that
 * callgrind's instructions per message of the two programs differ by what the C layer
 * costs (BENCHMARKS.md). Same shape: the sender posts lists of --list Sends (one chained
 * ibv_post_send; every 16th signalled), the receiver polls its CQ until the whole list
 * arrived and posts the receives back as one chained list, then the sender's signalled
 * completions are taken. Run it with SOFTWARP_BUSY_POLL=1 (`softwarp exec --busy-poll`):
 * its CQs have no completion channel, so the polling thread moves every byte, as the
 * example's busy-polled CQs do.
 *
 *   cc -O2 -o msgrate msgrate.c -libverbs -lrdmacm
 *   softwarp exec --busy-poll -- ./msgrate [MESSAGES] [--size B] [--list N]
 *   valgrind --tool=callgrind ... (with LD_LIBRARY_PATH as softwarp exec sets it)
 */
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#define SIGNAL_EVERY 16

static void die(const char *what)
{
	perror(what);
	exit(1);
}

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

/* The next CM event, which must be `want`; acknowledged. Its id (a new one for a request). */
static struct rdma_cm_id *expect(struct rdma_event_channel *ch, enum rdma_cm_event_type want)
{
	struct rdma_cm_event *ev;
	if (rdma_get_cm_event(ch, &ev))
		die("rdma_get_cm_event");
	if (ev->event != want || ev->status) {
		fprintf(stderr, "expected %s, got %s (status %d)\n", rdma_event_str(want),
			rdma_event_str(ev->event), ev->status);
		exit(1);
	}
	struct rdma_cm_id *id = ev->id;
	rdma_ack_cm_event(ev);
	return id;
}

/* Polls `cq` until `want` completions arrived (bounded: 30 s). */
static void take(struct ibv_cq *cq, struct ibv_wc *wc, int want)
{
	int got = 0;
	unsigned long spins = 0;
	double deadline = now() + 30;
	while (got < want) {
		int n = ibv_poll_cq(cq, 128, wc);
		if (n < 0)
			die("ibv_poll_cq");
		for (int i = 0; i < n; i++)
			if (wc[i].status != IBV_WC_SUCCESS) {
				fprintf(stderr, "completion %s\n", ibv_wc_status_str(wc[i].status));
				exit(1);
			}
		got += n;
		if (++spins % 1024 == 0 && now() > deadline) {
			fprintf(stderr, "no completion within 30 s\n");
			exit(1);
		}
	}
}

static long arg(int argc, char **argv, const char *name, long def)
{
	for (int i = 1; i + 1 < argc; i++)
		if (!strcmp(argv[i], name))
			return atol(argv[i + 1]);
	return def;
}

int main(int argc, char **argv)
{
	long messages = argc > 1 && argv[1][0] != '-' ? atol(argv[1]) : 20000;
	int size = (int)arg(argc, argv, "--size", 64);
	int list = (int)arg(argc, argv, "--list", 64);
	if (list < 1)
		list = 1;
	int depth = list * 2;

	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_cm_id *lid, *cid;
	if (!ch || rdma_create_id(ch, &lid, NULL, RDMA_PS_TCP) ||
	    rdma_create_id(ch, &cid, NULL, RDMA_PS_TCP))
		die("rdma_create_id");
	struct sockaddr_in sin = { .sin_family = AF_INET };
	sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (rdma_bind_addr(lid, (struct sockaddr *)&sin) || rdma_listen(lid, 1))
		die("rdma_listen");
	sin.sin_port = rdma_get_src_port(lid);
	if (rdma_resolve_addr(cid, NULL, (struct sockaddr *)&sin, 2000))
		die("rdma_resolve_addr");
	expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED);
	if (rdma_resolve_route(cid, 2000))
		die("rdma_resolve_route");
	expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED);

	struct ibv_context *ctx = cid->verbs;
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *scq = ibv_create_cq(ctx, depth * 2, NULL, NULL, 0);
	struct ibv_cq *rcq = ibv_create_cq(ctx, depth * 2, NULL, NULL, 0);
	char *src = calloc(1, size > 0 ? size : 1), *dst = calloc(1, size > 0 ? size : 1);
	if (!pd || !scq || !rcq || !src || !dst)
		die("setup");
	struct ibv_mr *smr = ibv_reg_mr(pd, src, size > 0 ? size : 1, 0);
	struct ibv_mr *dmr = ibv_reg_mr(pd, dst, size > 0 ? size : 1, IBV_ACCESS_LOCAL_WRITE);
	if (!smr || !dmr)
		die("ibv_reg_mr");
	struct ibv_qp_init_attr qa = {
		.send_cq = scq, .recv_cq = scq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = depth, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	if (rdma_create_qp(cid, pd, &qa))
		die("rdma_create_qp (sender)");
	struct rdma_conn_param param = { .initiator_depth = 1, .responder_resources = 1 };
	if (rdma_connect(cid, &param))
		die("rdma_connect");
	struct rdma_cm_id *rid = expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST);
	struct ibv_qp_init_attr ra = {
		.send_cq = rcq, .recv_cq = rcq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 1, .max_recv_wr = depth, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	if (rdma_create_qp(rid, pd, &ra))
		die("rdma_create_qp (receiver)");

	struct ibv_sge rsge = { .addr = (uintptr_t)dst, .length = size, .lkey = dmr->lkey };
	struct ibv_recv_wr *recvs = calloc(list, sizeof *recvs), *rbad;
	struct ibv_send_wr *wrs = calloc(list, sizeof *wrs), *sbad;
	struct ibv_sge ssge = { .addr = (uintptr_t)src, .length = size, .lkey = smr->lkey };
	struct ibv_wc wc[128];
	if (!recvs || !wrs)
		die("calloc");
	for (int i = 0; i < list; i++) {
		recvs[i].sg_list = &rsge;
		recvs[i].num_sge = 1;
		recvs[i].next = i + 1 < list ? &recvs[i + 1] : NULL;
	}
	if (ibv_post_recv(rid->qp, recvs, &rbad))
		die("ibv_post_recv");
	if (rdma_accept(rid, &param))
		die("rdma_accept");
	expect(ch, RDMA_CM_EVENT_ESTABLISHED);
	expect(ch, RDMA_CM_EVENT_ESTABLISHED);

	double t0 = now();
	long sent = 0;
	while (sent < messages) {
		int n = messages - sent < list ? (int)(messages - sent) : list;
		int signaled = 0;
		for (int i = 0; i < n; i++) {
			long id = sent + i;
			int signal = (id + 1) % SIGNAL_EVERY == 0 || id + 1 == messages;
			signaled += signal;
			memset(&wrs[i], 0, sizeof wrs[i]);
			wrs[i].wr_id = id;
			wrs[i].sg_list = &ssge;
			wrs[i].num_sge = 1;
			wrs[i].opcode = IBV_WR_SEND;
			wrs[i].send_flags = signal ? IBV_SEND_SIGNALED : 0;
			wrs[i].next = i + 1 < n ? &wrs[i + 1] : NULL;
		}
		if (ibv_post_send(cid->qp, wrs, &sbad))
			die("ibv_post_send");
		take(rcq, wc, n);
		recvs[n - 1].next = NULL;
		if (ibv_post_recv(rid->qp, recvs, &rbad))
			die("ibv_post_recv");
		recvs[n - 1].next = n < list ? &recvs[n] : NULL;
		take(scq, wc, signaled);
		sent += n;
	}
	double secs = now() - t0;
	printf("msgrate: %ld messages of %d B in lists of %d: %.3f s, %.3f Mmsg/s\n", messages,
	       size, list, secs, messages / secs / 1e6);

	rdma_disconnect(cid);
	rdma_destroy_qp(cid);
	rdma_destroy_qp(rid);
	ibv_dereg_mr(smr);
	ibv_dereg_mr(dmr);
	ibv_destroy_cq(scq);
	ibv_destroy_cq(rcq);
	ibv_dealloc_pd(pd);
	rdma_destroy_id(rid);
	rdma_destroy_id(cid);
	rdma_destroy_id(lid);
	rdma_destroy_event_channel(ch);
	return 0;
}
