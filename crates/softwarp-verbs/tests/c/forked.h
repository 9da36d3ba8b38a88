/* What the two-process C tests share (live_ops.c, close_order.c): one check macro that names
 * the side and the line and exits on failure, the address of 127.0.0.1:PORT for rdma_cm, and
 * RC QP attributes. Included by a single source file each (static definitions). */
#ifndef SOFTWARP_TESTS_FORKED_H
#define SOFTWARP_TESTS_FORKED_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <rdma/rdma_cma.h>

static const char *who = "?";
static int checks;

#define CHECK(cond, ...)                                                  \
	do {                                                              \
		if (!(cond)) {                                            \
			fprintf(stderr, "%s: FAILED %s (line %d): ", who, \
				#cond, __LINE__);                         \
			fprintf(stderr, __VA_ARGS__);                     \
			fprintf(stderr, " (errno %d)\n", errno);          \
			exit(1);                                          \
		}                                                         \
		checks++;                                                 \
	} while (0)

static struct rdma_addrinfo *addrinfo(const char *port, int passive)
{
	struct rdma_addrinfo hints, *res;
	memset(&hints, 0, sizeof hints);
	hints.ai_port_space = RDMA_PS_TCP;
	if (passive)
		hints.ai_flags = RAI_PASSIVE;
	int rc = rdma_getaddrinfo("127.0.0.1", port, &hints, &res);
	CHECK(rc == 0, "rdma_getaddrinfo");
	return res;
}

/* An RC QP with `wrs` send and receive work requests of one SGE, every Send signaled. */
static void init_attr(struct ibv_qp_init_attr *a, unsigned wrs)
{
	memset(a, 0, sizeof *a);
	a->cap.max_send_wr = wrs;
	a->cap.max_recv_wr = wrs;
	a->cap.max_send_sge = 1;
	a->cap.max_recv_sge = 1;
	a->qp_type = IBV_QPT_RC;
	a->sq_sig_all = 1;
}

#endif
