/* An MPI ping-pong between two ranks with checked data, for Open MPI over Softwarp
 * (debian_tools.rs) and for BENCHMARKS.md: rank 0 sends a message, rank 1 checks every byte
 * and sends back a different pattern, which rank 0 checks; sizes 1 B, 4 B, ..., MAX (x4).
 *
 * With --hold, after the first round trip rank 0 prints "ready" and waits for a line on its
 * standard input (mpirun forwards its own to rank 0) before going on, so that a test can
 * look at the connections while both ranks are alive. Prints one row per size: the size,
 * the iterations, the one-way latency in microseconds (half the mean round trip) and the
 * bandwidth that gives in MB/s, then "ok".
 *
 *   mpicc -O2 -o mpi_pingpong mpi_pingpong.c
 *   mpirun -np 2 ./mpi_pingpong [--hold] [ITERATIONS [MAX]]
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The byte `i` of message `iter` of size `size` from rank `from`. */
static unsigned char pattern(int from, int iter, long size, long i)
{
	return (unsigned char)(i * 7 + iter * 13 + size + from * 101);
}

static void fill(unsigned char *buf, int from, int iter, long size)
{
	for (long i = 0; i < size; i++)
		buf[i] = pattern(from, iter, size, i);
}

static void check(const unsigned char *buf, int from, int iter, long size, int count)
{
	if (count != size) {
		fprintf(stderr, "size %ld iteration %d: received %d bytes\n", size, iter, count);
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	for (long i = 0; i < size; i++) {
		if (buf[i] != pattern(from, iter, size, i)) {
			fprintf(stderr,
				"size %ld iteration %d: byte %ld is %u, not %u (from rank %d)\n",
				size, iter, i, buf[i], pattern(from, iter, size, i), from);
			MPI_Abort(MPI_COMM_WORLD, 3);
		}
	}
}

/* One round trip of `size` bytes, iteration `iter`, both ends checking what they got. */
static void round_trip(int rank, unsigned char *buf, int iter, long size)
{
	MPI_Status st;
	int count;
	if (rank == 0) {
		fill(buf, 0, iter, size);
		MPI_Send(buf, (int)size, MPI_BYTE, 1, iter, MPI_COMM_WORLD);
		memset(buf, 0, size);
		MPI_Recv(buf, (int)size, MPI_BYTE, 1, iter, MPI_COMM_WORLD, &st);
		MPI_Get_count(&st, MPI_BYTE, &count);
		check(buf, 1, iter, size, count);
	} else {
		memset(buf, 0, size);
		MPI_Recv(buf, (int)size, MPI_BYTE, 0, iter, MPI_COMM_WORLD, &st);
		MPI_Get_count(&st, MPI_BYTE, &count);
		check(buf, 0, iter, size, count);
		fill(buf, 1, iter, size);
		MPI_Send(buf, (int)size, MPI_BYTE, 0, iter, MPI_COMM_WORLD);
	}
}

int main(int argc, char **argv)
{
	int rank, ranks, hold = 0, a = 1;
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &ranks);
	if (a < argc && strcmp(argv[a], "--hold") == 0) {
		hold = 1;
		a++;
	}
	int iterations = a < argc ? atoi(argv[a++]) : 100;
	long max = a < argc ? atol(argv[a++]) : 4L << 20;
	if (ranks != 2 || iterations < 1 || max < 1 || max > (1L << 30)) {
		if (rank == 0)
			fprintf(stderr, "usage: mpirun -np 2 mpi_pingpong [--hold] [ITERATIONS [MAX]]\n");
		MPI_Finalize();
		return 1;
	}
	unsigned char *buf = malloc(max);
	if (!buf) {
		perror("malloc");
		MPI_Abort(MPI_COMM_WORLD, 1);
	}
	round_trip(rank, buf, 0, 1);
	if (hold) {
		char go = 0;
		if (rank == 0) {
			printf("ready\n");
			fflush(stdout);
			char line[16];
			if (fgets(line, sizeof line, stdin))
				go = 1;
		}
		MPI_Bcast(&go, 1, MPI_CHAR, 0, MPI_COMM_WORLD);
		if (!go) {
			if (rank == 0)
				fprintf(stderr, "standard input closed before the go line\n");
			MPI_Finalize();
			return 1;
		}
	}
	for (long size = 1; size <= max; size *= 4) {
		/* Fewer round trips for large messages: the time of each size stays bounded. */
		int n = size > 65536 ? (iterations + 9) / 10 : iterations;
		MPI_Barrier(MPI_COMM_WORLD);
		double start = MPI_Wtime();
		for (int i = 1; i <= n; i++)
			round_trip(rank, buf, i, size);
		double took = MPI_Wtime() - start;
		if (rank == 0) {
			double one_way_us = took / n / 2 * 1e6;
			printf("%8ld %6d %10.2f %10.2f\n", size, n, one_way_us, size / one_way_us);
		}
	}
	free(buf);
	MPI_Barrier(MPI_COMM_WORLD);
	if (rank == 0)
		printf("ok\n");
	MPI_Finalize();
	return 0;
}
