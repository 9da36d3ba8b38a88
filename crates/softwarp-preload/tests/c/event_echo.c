/* An event-driven echo client and server: non-blocking sockets, a non-blocking connect
 * completed through poll and SO_ERROR, select, and epoll (edge-triggered on the client,
 * level-triggered on the server). Plain POSIX and Linux calls only: it runs over kernel TCP
 * as over the preload library, so its checks are the kernel's behaviour.
 *
 *   event_echo client HOST PORT BYTES   connects, sends BYTES of a pattern while reading the
 *                                       echo, shuts its sending side down, reads to the EOF,
 *                                       checks every byte; prints "ok client N"
 *   event_echo server PORT [late]       accepts one connection (epoll on the listener,
 *                                       accept4 SOCK_NONBLOCK until EAGAIN), echoes it with
 *                                       poll until the EOF; prints "ok server N". With
 *                                       "late" the listener is made non-blocking after
 *                                       listen, as redis does (fcntl F_GETFL, then F_SETFL
 *                                       only if O_NONBLOCK is clear)
 *
 * The test compiles it with -D_FILE_OFFSET_BITS=64, as Debian builds redis: glibc's fcntl
 * is then fcntl64.
 *
 * Exits 0 when every check held, 1 with a line on stderr saying which did not. Every wait is
 * bounded (10 s without progress).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <unistd.h>

#define IDLE_MS 10000

static int fail(const char *what) {
	fprintf(stderr, "event_echo: %s: %s\n", what, strerror(errno));
	exit(1);
}

static unsigned char pattern(size_t i) { return (unsigned char)((i * 2654435761u) >> 13); }

static int client(const char *host, int port, size_t total) {
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
	if (fd < 0) fail("socket");
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
	if (inet_pton(AF_INET, host, &a.sin_addr) != 1) fail("address");
	if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
		/* connected at once: allowed */
	} else if (errno != EINPROGRESS) {
		fail("non-blocking connect (expected EINPROGRESS)");
	}
	struct pollfd p = {.fd = fd, .events = POLLOUT};
	int n = poll(&p, 1, IDLE_MS);
	if (n != 1 || !(p.revents & POLLOUT)) { errno = ETIMEDOUT; fail("poll for the connect"); }
	int err = -1;
	socklen_t len = sizeof err;
	if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) fail("getsockopt SO_ERROR");
	if (err != 0) { errno = err; fail("connect (SO_ERROR)"); }
	/* select says writable too. */
	fd_set w;
	FD_ZERO(&w);
	FD_SET(fd, &w);
	struct timeval tv = {.tv_sec = IDLE_MS / 1000};
	if (select(fd + 1, NULL, &w, NULL, &tv) != 1 || !FD_ISSET(fd, &w)) {
		errno = ETIMEDOUT;
		fail("select for writing");
	}
	/* A read now finds nothing: EAGAIN, not a wait. */
	char c;
	if (recv(fd, &c, 1, 0) != -1 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
		fail("recv before any data (expected EAGAIN)");
	}
	int ep = epoll_create1(EPOLL_CLOEXEC);
	if (ep < 0) fail("epoll_create1");
	struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLET, .data.u64 = 42};
	if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) != 0) fail("epoll_ctl ADD");
	unsigned char buf[65536];
	size_t sent = 0, got = 0;
	int shut = 0, eof = 0;
	while (!eof) {
		struct epoll_event out[4];
		n = epoll_wait(ep, out, 4, IDLE_MS);
		if (n < 0 && errno == EINTR) continue;
		if (n < 0) fail("epoll_wait");
		if (n == 0) {
			fprintf(stderr, "event_echo: client idle for %d ms: sent %zu, got %zu\n", IDLE_MS, sent,
				got);
			return 1;
		}
		for (int i = 0; i < n; i++) {
			if (out[i].data.u64 != 42) { fprintf(stderr, "event_echo: wrong epoll data\n"); return 1; }
		}
		/* Edge-triggered: write and read until EAGAIN. */
		while (sent < total) {
			size_t k = total - sent < sizeof buf ? total - sent : sizeof buf;
			for (size_t j = 0; j < k; j++) buf[j] = pattern(sent + j);
			ssize_t r = send(fd, buf, k, MSG_NOSIGNAL);
			if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
			if (r < 0) {
				fprintf(stderr, "event_echo: client sent %zu, got %zu of %zu\n", sent, got, total);
				fail("send");
			}
			sent += (size_t)r;
		}
		if (sent == total && !shut) {
			if (shutdown(fd, SHUT_WR) != 0) fail("shutdown");
			shut = 1;
		}
		for (;;) {
			ssize_t r = recv(fd, buf, sizeof buf, 0);
			if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
			if (r < 0) {
				fprintf(stderr, "event_echo: client sent %zu, got %zu of %zu%s\n", sent, got, total,
					shut ? " (after its shutdown)" : "");
				fail("recv");
			}
			if (r == 0) { eof = 1; break; }
			for (ssize_t j = 0; j < r; j++) {
				if (buf[j] != pattern(got + (size_t)j)) {
					fprintf(stderr, "event_echo: byte %zu differs\n", got + (size_t)j);
					return 1;
				}
			}
			got += (size_t)r;
		}
	}
	if (got != total) {
		fprintf(stderr, "event_echo: EOF after %zu of %zu bytes\n", got, total);
		return 1;
	}
	close(ep);
	close(fd);
	printf("ok client %zu\n", got);
	return 0;
}

static int server(int port, int late) {
	int l = socket(AF_INET, SOCK_STREAM | (late ? 0 : SOCK_NONBLOCK), 0);
	if (l < 0) fail("socket");
	int one = 1;
	setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (bind(l, (struct sockaddr *)&a, sizeof a) != 0) fail("bind");
	if (listen(l, 8) != 0) fail("listen");
	if (late) {
		int fl = fcntl(l, F_GETFL);
		if (fl < 0) fail("F_GETFL");
		if (!(fl & O_NONBLOCK) && fcntl(l, F_SETFL, fl | O_NONBLOCK) != 0) fail("F_SETFL");
	}
	/* Nobody yet: a non-blocking accept says EAGAIN. */
	if (accept4(l, NULL, NULL, SOCK_NONBLOCK) != -1 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
		fail("accept before a client (expected EAGAIN)");
	}
	int ep = epoll_create1(EPOLL_CLOEXEC);
	if (ep < 0) fail("epoll_create1");
	struct epoll_event ev = {.events = EPOLLIN, .data.u64 = 7};
	if (epoll_ctl(ep, EPOLL_CTL_ADD, l, &ev) != 0) fail("epoll_ctl ADD");
	/* The client may come late (the test starts it once the listener is up): a minute. */
	int n;
	do {
		n = epoll_wait(ep, &ev, 1, 60000);
	} while (n < 0 && errno == EINTR);
	if (n != 1 || ev.data.u64 != 7) { errno = ETIMEDOUT; fail("epoll_wait for a client"); }
	struct sockaddr_in peer;
	socklen_t plen = sizeof peer;
	int fd = accept4(l, (struct sockaddr *)&peer, &plen, SOCK_NONBLOCK);
	if (fd < 0) fail("accept4");
	if (peer.sin_family != AF_INET || peer.sin_addr.s_addr != htonl(INADDR_LOOPBACK)) {
		fprintf(stderr, "event_echo: the accepted peer is not 127.0.0.1\n");
		return 1;
	}
	/* One client: the next accept says EAGAIN (redis accepts until it does). */
	if (accept4(l, NULL, NULL, SOCK_NONBLOCK) != -1 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
		fail("the next accept (expected EAGAIN)");
	}
	unsigned char buf[65536];
	size_t have = 0, off = 0, echoed = 0;
	int eof = 0;
	while (!eof || have > off) {
		struct pollfd p = {.fd = fd, .events = (short)((have > off ? POLLOUT : 0) | (eof ? 0 : POLLIN))};
		n = poll(&p, 1, IDLE_MS);
		if (n < 0 && errno == EINTR) continue;
		if (n <= 0) { errno = ETIMEDOUT; fail("poll on the connection"); }
		if (p.revents & (POLLERR | POLLNVAL)) { fprintf(stderr, "event_echo: revents %#x\n", p.revents); return 1; }
		if (have > off && (p.revents & POLLOUT)) {
			ssize_t r = send(fd, buf + off, have - off, MSG_NOSIGNAL);
			if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK) fail("send");
			if (r > 0) { off += (size_t)r; echoed += (size_t)r; }
			if (off == have) off = have = 0;
		}
		if (!eof && have == 0 && (p.revents & (POLLIN | POLLHUP))) {
			ssize_t r = recv(fd, buf, sizeof buf, 0);
			if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK) fail("recv");
			if (r == 0) eof = 1;
			if (r > 0) have = (size_t)r;
		}
	}
	close(fd);
	close(l);
	close(ep);
	printf("ok server %zu\n", echoed);
	return 0;
}

int main(int argc, char **argv) {
	if (argc == 5 && strcmp(argv[1], "client") == 0)
		return client(argv[2], atoi(argv[3]), strtoul(argv[4], NULL, 10));
	if (argc == 3 && strcmp(argv[1], "server") == 0) return server(atoi(argv[2]), 0);
	if (argc == 4 && strcmp(argv[1], "server") == 0 && strcmp(argv[3], "late") == 0)
		return server(atoi(argv[2]), 1);
	fprintf(stderr, "usage: event_echo client HOST PORT BYTES | server PORT [late]\n");
	return 2;
}
