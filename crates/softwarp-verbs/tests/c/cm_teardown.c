/* The order of a two-thread program's rdma_cm teardown (run by tests/debian_tools.rs), as
 * rping has it: a CM thread handles DISCONNECTED, acknowledges it and comes back to
 * rdma_get_cm_event while the main thread destroys the id and then the channel.
 * - rdma_destroy_id returns only once the id's events were acknowledged (rdma-core's rule),
 *   so the main thread cannot free the channel while the CM thread still handles one;
 * - a thread that enters rdma_get_cm_event on a channel another thread just destroyed
 *   fails with EINVAL only after a pause that lets an ending process end first (at once, it
 *   made rping exit with an error). */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <netinet/in.h>
#include <rdma/rdma_cma.h>

#include "check.h"

static struct rdma_event_channel *ch;
static struct rdma_cm_event *held;
static volatile int acked;

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

/* Holds the id's event 300 ms before acknowledging it. */
static void *late_ack(void *arg)
{
	(void)arg;
	usleep(300 * 1000);
	acked = 1;
	CHECK(rdma_ack_cm_event(held) == 0);
	return NULL;
}

static int late_errno;
static double late_took;

/* Comes back for the next event after the main thread destroyed the channel. */
static void *late_get(void *arg)
{
	(void)arg;
	struct rdma_cm_event *ev;
	double t = now();
	errno = 0;
	int rc = rdma_get_cm_event(ch, &ev);
	late_took = now() - t;
	late_errno = rc == -1 ? errno : 0;
	return NULL;
}

int main(void)
{
	ch = rdma_create_event_channel();
	CHECK(ch);
	struct rdma_cm_id *id;
	CHECK(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) == 0);
	struct sockaddr_in dst = { .sin_family = AF_INET, .sin_port = htons(9),
				   .sin_addr.s_addr = htonl(0x7f000001) };
	CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000) == 0);
	CHECK(rdma_get_cm_event(ch, &held) == 0 && held->id == id);

	/* The destroy waits for the other thread's acknowledgement. */
	pthread_t t;
	CHECK(pthread_create(&t, NULL, late_ack, NULL) == 0);
	double t0 = now();
	CHECK(rdma_destroy_id(id) == 0);
	CHECK(acked && now() - t0 >= 0.25);
	CHECK(pthread_join(t, NULL) == 0);

	rdma_destroy_event_channel(ch);
	/* Another thread comes back to the destroyed channel: EINVAL after the pause. */
	CHECK(pthread_create(&t, NULL, late_get, NULL) == 0);
	CHECK(pthread_join(t, NULL) == 0);
	CHECK(late_errno == EINVAL && late_took >= 0.5);
	printf("ok: %d checks\n", checks);
	return 0;
}
