/* rsocket's socket semantics, side by side with kernel TCP: the same sequence of calls runs
 * with rsocket's functions (`rsocket_api PORT rs`) or with the kernel's (`... tcp`), and each
 * step prints what it saw, so that the test compares the two transcripts. One process forks:
 * the parent is the server, the child the client, on 127.0.0.1:PORT.
 *
 *   - a call on a socket number that is closed: EBADF (rclose returns EBADF itself, as
 *     rdma-core's does: printed for rs only)
 *   - an unknown domain: refused (rsocket: ENOTSUP)
 *   - a non-blocking connect: EINPROGRESS, then POLLOUT and SO_ERROR 0; connect again: 0
 *     (the kernel's first answer once connected; rdma-core's rs_do_connect's always)
 *   - a listener made non-blocking after listen: accept EAGAIN, poll POLLIN when a client
 *     comes, accept, the next accept EAGAIN
 *   - a non-blocking recv with nothing received: EAGAIN
 *   - poll over the socket and a pipe: only the pipe readable, then only the socket
 *   - select: the socket readable
 *   - getsockname/getpeername: the ports of each end
 *   - writev, then MSG_PEEK, readv and recvmsg; sendmsg; MSG_WAITALL over several sends
 *   - options: TCP_NODELAY, F_GETFL/F_SETFL; SOL_RDMA sizes (rs only)
 *   - riomap on an unconnected rsocket and riounmap of nothing mapped: EINVAL (rs only)
 *   - a datagram rsocket as rdma-core's on an iWARP device (rs only): created and bound, a
 *     receive before the bind EINVAL, after it EAGAIN (non-blocking), writable but never
 *     readable, rsendto and rconnect EOPNOTSUPP (printed ENOTSUP: the same value on Linux;
 *     no UD QP), rsend without a destination EDESTADDRREQ, rlisten EOPNOTSUPP
 *   - shutdown(SHUT_WR) by the client: the server reads the rest then 0 (end of stream),
 *     and can still send to the client, which reads it
 *   - shutdown(SHUT_RDWR), then recv on the same socket: 0
 *   - connect to a port nobody listens on: ECONNREFUSED
 *
 * `rsocket_api PORT died` (rsocket only): the client connects, sends "x", reads the server's
 * "y" and kills itself (SIGKILL: no disconnect message); the server, in a blocking rrecv,
 * gets ECONNRESET once (the connection ended without rsocket's disconnect message), then 0.
 *
 * `rsocket_api PORT exits` (rsocket only): the client reads the server's "g", stops the
 * server (SIGSTOP, its engine too), sends 20000 bytes, shuts the socket down (SHUT_RDWR) and returns from main
 * without rclose, as socat does; a child of the client resumes the server 500 ms later and
 * says whether the client was still there: its exit must wait until the connection closed
 * gracefully (the server's engine has taken the tail and answered the FIN). The server then
 * reads every byte and the end of stream, and the client exited with 0.
 *
 * `rsocket_api PORT keepalive`: the client turns SO_KEEPALIVE on with TCP_KEEPIDLE 1 s (and
 * reads both back; TCP_KEEPIDLE 0 is refused with EINVAL), stays idle 2.5 s, then sends
 * "done", which the server reads (the test captures the keepalives on the wire).
 *
 *   cc -o rsocket_api rsocket_api.c -lrdmacm && ./rsocket_api 7471 rs
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <rdma/rsocket.h>

#include "forked.h"

static int use_rs;

#define S(f, ...) (use_rs ? r##f(__VA_ARGS__) : f(__VA_ARGS__))

static int xfcntl(int s, int cmd, int arg)
{
	return use_rs ? rfcntl(s, cmd, arg) : fcntl(s, cmd, arg);
}

static struct sockaddr_in addr_of(int port)
{
	struct sockaddr_in a;
	memset(&a, 0, sizeof a);
	a.sin_family = AF_INET;
	a.sin_port = htons(port);
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	return a;
}

static int port;

static const char *err_name(int e)
{
	switch (e) {
	case EAGAIN: return "EAGAIN";
	case EBADF: return "EBADF";
	case EINPROGRESS: return "EINPROGRESS";
	case ECONNREFUSED: return "ECONNREFUSED";
	case ENOTSUP: return "ENOTSUP";
	case EAFNOSUPPORT: return "EAFNOSUPPORT";
	case EINVAL: return "EINVAL";
	case EDESTADDRREQ: return "EDESTADDRREQ";
	case ECONNRESET: return "ECONNRESET";
	case EISCONN: return "EISCONN";
	case EALREADY: return "EALREADY";
	default: return "other";
	}
}

/* Reads exactly `len` bytes (blocking socket). */
static void read_all(int s, char *buf, size_t len)
{
	size_t got = 0;
	while (got < len) {
		ssize_t n = S(recv, s, buf + got, len - got, 0);
		CHECK(n > 0, "recv after %zu of %zu", got, len);
		got += n;
	}
}

static int client(const char *port_str)
{
	(void) port_str;
	char buf[256];

	int s = S(socket, AF_INET, SOCK_STREAM, 0);
	CHECK(s >= 0, "socket");
	int one = 1;
	CHECK(S(setsockopt, s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) == 0, "TCP_NODELAY");
	int v = 0;
	socklen_t vl = sizeof v;
	CHECK(S(getsockopt, s, IPPROTO_TCP, TCP_NODELAY, &v, &vl) == 0 && v == 1, "get TCP_NODELAY %d", v);
	CHECK(xfcntl(s, F_SETFL, O_NONBLOCK) == 0, "F_SETFL");
	CHECK(xfcntl(s, F_GETFL, 0) & O_NONBLOCK, "F_GETFL");

	struct sockaddr_in a = addr_of(port);
	int rc = S(connect, s, (struct sockaddr *) &a, sizeof a);
	printf("client: non-blocking connect: %d %s\n", rc, rc ? err_name(errno) : "");
	struct pollfd pf = { .fd = s, .events = POLLOUT };
	rc = S(poll, &pf, 1, 10000);
	int e = -1;
	socklen_t el = sizeof e;
	CHECK(S(getsockopt, s, SOL_SOCKET, SO_ERROR, &e, &el) == 0, "SO_ERROR");
	printf("client: poll for POLLOUT: %d, POLLOUT %s, SO_ERROR %d\n", rc,
	       (pf.revents & POLLOUT) ? "set" : "clear", e);
	/* hiredis (redis-cli) connects again once poll says writable; librspreload's connect
	 * moves the socket to plain TCP on any rconnect error but EINPROGRESS. */
	rc = S(connect, s, (struct sockaddr *) &a, sizeof a);
	printf("client: connect again once connected: %d %s\n", rc, rc ? err_name(errno) : "");

	ssize_t n = S(recv, s, buf, sizeof buf, 0);
	printf("client: non-blocking recv with nothing received: %zd %s\n", n, err_name(errno));
	CHECK(xfcntl(s, F_SETFL, 0) == 0, "F_SETFL 0");

	struct sockaddr_in me, peer;
	socklen_t ml = sizeof me, pl = sizeof peer;
	CHECK(S(getsockname, s, (struct sockaddr *) &me, &ml) == 0, "getsockname");
	CHECK(S(getpeername, s, (struct sockaddr *) &peer, &pl) == 0, "getpeername");
	printf("client: getpeername: the server's port %s, length %u; getsockname: a port %s\n",
	       ntohs(peer.sin_port) == port ? "yes" : "no", pl, ntohs(me.sin_port) ? "yes" : "no");

	/* The server waits in poll for this. */
	CHECK(S(send, s, "ping", 4, 0) == 4, "send ping");

	struct iovec iov[3] = { { "wri", 3 }, { "te", 2 }, { "v!", 2 } };
	CHECK((use_rs ? rwritev(s, iov, 3) : writev(s, iov, 3)) == 7, "writev");
	struct msghdr m;
	memset(&m, 0, sizeof m);
	struct iovec one_iov = { "sendmsg", 7 };
	m.msg_iov = &one_iov;
	m.msg_iovlen = 1;
	CHECK(S(sendmsg, s, &m, 0) == 7, "sendmsg");
	for (int i = 0; i < 4; i++)
		CHECK(S(send, s, "abcd", 4, 0) == 4, "send part %d", i);

	/* Half-close: the server reads to the end, then answers. */
	CHECK(S(shutdown, s, SHUT_WR) == 0, "shutdown SHUT_WR");
	read_all(s, buf, 6);
	printf("client: after its SHUT_WR it reads the server's %.6s\n", buf);
	n = S(recv, s, buf, sizeof buf, 0);
	printf("client: then end of stream: %zd\n", n);
	CHECK(S(close, s) == 0, "close");

	/* Nobody listens on a port the kernel just gave and took back. */
	int k = socket(AF_INET, SOCK_STREAM, 0);
	a = addr_of(0);
	socklen_t al = sizeof a;
	CHECK(bind(k, (struct sockaddr *) &a, sizeof a) == 0, "bind a kernel socket");
	CHECK(getsockname(k, (struct sockaddr *) &a, &al) == 0, "its port");
	close(k);
	s = S(socket, AF_INET, SOCK_STREAM, 0);
	rc = S(connect, s, (struct sockaddr *) &a, sizeof a);
	printf("client: blocking connect to a closed port: %d %s\n", rc, err_name(errno));
	S(close, s);
	printf("client: %d checks\n", checks);
	return 0;
}

static int server(const char *port_str)
{
	(void) port_str;
	char buf[256];

	/* Calls on a closed socket. */
	int c = S(socket, AF_INET, SOCK_STREAM, 0);
	CHECK(c >= 0, "socket");
	CHECK(S(close, c) == 0, "close");
	ssize_t n = S(send, c, "x", 1, 0);
	printf("server: send on a closed socket: %zd %s\n", n, err_name(errno));
	n = S(recv, c, buf, 1, 0);
	printf("server: recv on a closed socket: %zd %s\n", n, err_name(errno));
	int rc = xfcntl(c, F_GETFL, 0);
	printf("server: fcntl on a closed socket: %d %s\n", rc, err_name(errno));
	struct sockaddr_in sa;
	socklen_t sl = sizeof sa;
	rc = S(getsockname, c, (struct sockaddr *) &sa, &sl);
	printf("server: getsockname on a closed socket: %d %s\n", rc, err_name(errno));
	if (use_rs) {
		rc = rclose(c);
		printf("rs: rclose of a closed rsocket returns %s\n", rc == EBADF ? "EBADF" : "?");
		errno = 0;
		rc = rsocket(AF_UNIX, SOCK_STREAM, 0);
		printf("rs: rsocket(AF_UNIX): %d %s\n", rc, err_name(errno));
		int s = rsocket(AF_INET, SOCK_STREAM, 0);
		int sq = 100, il = 128, got = 0;
		socklen_t gl = sizeof got;
		CHECK(rsetsockopt(s, SOL_RDMA, RDMA_SQSIZE, &sq, sizeof sq) == 0, "RDMA_SQSIZE");
		CHECK(rsetsockopt(s, SOL_RDMA, RDMA_INLINE, &il, sizeof il) == 0, "RDMA_INLINE");
		CHECK(rgetsockopt(s, SOL_RDMA, RDMA_SQSIZE, &got, &gl) == 0 && got == 100, "sq %d", got);
		CHECK(rgetsockopt(s, SOL_RDMA, RDMA_INLINE, &got, &gl) == 0 && got == 128, "inline %d", got);
		off_t o = riomap(s, buf, sizeof buf, PROT_WRITE, 0, -1);
		printf("rs: riomap on an unconnected rsocket: %lld %s\n", (long long) o,
		       o == -1 && errno == EINVAL ? "EINVAL" : "?");
		rc = riounmap(s, buf, sizeof buf);
		printf("rs: riounmap of nothing mapped: %d %s\n", rc, rc == -1 && errno == EINVAL ? "EINVAL" : "?");
		rclose(s);

		int d = rsocket(AF_INET, SOCK_DGRAM, 0);
		printf("rs: rsocket(SOCK_DGRAM): %s\n", d >= 0 ? "a socket" : "failed");
		ssize_t dn = rrecv(d, buf, sizeof buf, MSG_DONTWAIT);
		printf("rs: datagram rrecv before rbind: %zd %s\n", dn, err_name(errno));
		struct sockaddr_in da = addr_of(0);
		rc = rbind(d, (struct sockaddr *) &da, sizeof da);
		socklen_t dl = sizeof da;
		CHECK(rgetsockname(d, (struct sockaddr *) &da, &dl) == 0, "datagram rgetsockname");
		printf("rs: datagram rbind: %d, a port %s\n", rc, ntohs(da.sin_port) ? "yes" : "no");
		dn = rrecvfrom(d, buf, sizeof buf, MSG_DONTWAIT, NULL, NULL);
		printf("rs: datagram rrecvfrom, non-blocking: %zd %s\n", dn, err_name(errno));
		struct pollfd dp = { .fd = d, .events = POLLIN | POLLOUT };
		rc = rpoll(&dp, 1, 100);
		printf("rs: datagram rpoll: %d, POLLOUT %s, POLLIN %s\n", rc,
		       dp.revents & POLLOUT ? "set" : "clear", dp.revents & POLLIN ? "set" : "clear");
		dn = rsendto(d, "x", 1, 0, (struct sockaddr *) &da, sizeof da);
		printf("rs: datagram rsendto: %zd %s\n", dn, err_name(errno));
		dn = rsend(d, "x", 1, 0);
		printf("rs: datagram rsend without a destination: %zd %s\n", dn, err_name(errno));
		rc = rconnect(d, (struct sockaddr *) &da, sizeof da);
		printf("rs: datagram rconnect: %d %s\n", rc, err_name(errno));
		rc = rlisten(d, 1);
		printf("rs: datagram rlisten: %d %s\n", rc, err_name(errno));
		CHECK(rclose(d) == 0, "datagram rclose");
	}

	int l = S(socket, AF_INET, SOCK_STREAM, 0);
	CHECK(l >= 0, "socket");
	int one = 1;
	CHECK(S(setsockopt, l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0, "SO_REUSEADDR");
	struct sockaddr_in a = addr_of(port);
	CHECK(S(bind, l, (struct sockaddr *) &a, sizeof a) == 0, "bind");
	CHECK(S(listen, l, 4) == 0, "listen");
	/* A non-blocking listener after listen, accepting until EAGAIN as redis does. */
	CHECK(xfcntl(l, F_SETFL, O_NONBLOCK) == 0, "F_SETFL listener");
	int s = S(accept, l, NULL, NULL);
	printf("server: non-blocking accept with nobody there: %d %s\n", s, err_name(errno));
	forked_ready();
	struct pollfd lp = { .fd = l, .events = POLLIN };
	rc = S(poll, &lp, 1, 10000);
	printf("server: poll on the listener: %d, POLLIN %s\n", rc, lp.revents & POLLIN ? "set" : "clear");
	s = S(accept, l, NULL, NULL);
	CHECK(s >= 0, "accept");
	int s2 = S(accept, l, NULL, NULL);
	printf("server: the next non-blocking accept: %d %s\n", s2, err_name(errno));
	CHECK(xfcntl(s, F_SETFL, 0) == 0, "F_SETFL accepted");

	/* poll over the socket and a pipe. */
	int p[2];
	CHECK(pipe(p) == 0, "pipe");
	CHECK(write(p[1], "p", 1) == 1, "write pipe");
	struct pollfd fds[2] = { { .fd = p[0], .events = POLLIN }, { .fd = s, .events = POLLIN } };
	/* The client's ping may already be here: wait for the pipe alone first. */
	rc = S(poll, fds, 1, 1000);
	printf("server: poll over a written pipe: %d, pipe POLLIN %s\n", rc,
	       (fds[0].revents & POLLIN) ? "set" : "clear");
	CHECK(read(p[0], buf, 1) == 1, "read pipe");
	rc = S(poll, fds, 2, 10000);
	printf("server: poll over the drained pipe and the socket: %d, pipe %s, socket POLLIN %s\n",
	       rc, fds[0].revents ? "set" : "clear", (fds[1].revents & POLLIN) ? "set" : "clear");
	fd_set rd;
	FD_ZERO(&rd);
	FD_SET(s, &rd);
	FD_SET(p[0], &rd);
	struct timeval tv = { 10, 0 };
	int maxfd = (s > p[0] ? s : p[0]) + 1;
	rc = use_rs ? rselect(maxfd, &rd, NULL, NULL, &tv) : select(maxfd, &rd, NULL, NULL, &tv);
	printf("server: select: %d, socket %s, pipe %s\n", rc, FD_ISSET(s, &rd) ? "set" : "clear",
	       FD_ISSET(p[0], &rd) ? "set" : "clear");
	read_all(s, buf, 4);
	printf("server: received %.4s\n", buf);

	/* writev's 7 bytes, then sendmsg's 7: peeked, then read in pieces. */
	read_all(s, buf, 1); /* at least one byte of writev's is here */
	n = S(recv, s, buf + 1, 6, MSG_PEEK);
	CHECK(n > 0, "peek");
	char peek[8];
	memcpy(peek, buf + 1, n);
	read_all(s, buf + 1, 6);
	CHECK(memcmp(peek, buf + 1, n) == 0, "peeked bytes are the ones read");
	printf("server: writev's bytes: %.7s (peek saw the same)\n", buf);
	struct iovec riov[2] = { { buf, 7 }, { buf + 7, 7 } };
	n = 0;
	while (n < 7) {
		riov[0].iov_base = buf + n;
		riov[0].iov_len = 7 - n;
		ssize_t k = use_rs ? rreadv(s, riov, 2) : readv(s, riov, 1);
		CHECK(k > 0, "readv");
		n += k;
	}
	printf("server: readv: %.7s\n", buf);
	n = S(recv, s, buf, 16, MSG_WAITALL);
	printf("server: MSG_WAITALL for 16 bytes over 4 sends: %zd %.16s\n", n, buf);
	n = S(recv, s, buf, sizeof buf, 0);
	printf("server: after the client's SHUT_WR: %zd\n", n);
	CHECK(S(send, s, "answer", 6, 0) == 6, "send after the peer's SHUT_WR");

	/* Our own shutdown, then recv. */
	CHECK(S(shutdown, s, SHUT_RDWR) == 0, "shutdown SHUT_RDWR");
	n = S(recv, s, buf, sizeof buf, 0);
	printf("server: recv after its own SHUT_RDWR: %zd\n", n);
	S(close, s);
	S(close, l);
	close(p[0]);
	close(p[1]);
	return 0;
}

static int ka_client(const char *port_str)
{
	(void) port_str;
	int s = rsocket(AF_INET, SOCK_STREAM, 0);
	CHECK(s >= 0, "rsocket");
	int one = 1, zero = 0, v = 0;
	socklen_t vl = sizeof v;
	CHECK(rsetsockopt(s, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one) == 0, "SO_KEEPALIVE");
	CHECK(rsetsockopt(s, IPPROTO_TCP, TCP_KEEPIDLE, &one, sizeof one) == 0, "TCP_KEEPIDLE");
	CHECK(rsetsockopt(s, IPPROTO_TCP, TCP_KEEPIDLE, &zero, sizeof zero) == -1 && errno == EINVAL,
	      "TCP_KEEPIDLE 0");
	CHECK(rgetsockopt(s, SOL_SOCKET, SO_KEEPALIVE, &v, &vl) == 0 && v == 1, "get SO_KEEPALIVE %d", v);
	CHECK(rgetsockopt(s, IPPROTO_TCP, TCP_KEEPIDLE, &v, &vl) == 0 && v == 1, "get TCP_KEEPIDLE %d", v);
	struct sockaddr_in a = addr_of(port);
	CHECK(rconnect(s, (struct sockaddr *) &a, sizeof a) == 0, "rconnect");
	usleep(2500000);
	CHECK(rsend(s, "done", 4, 0) == 4, "rsend");
	CHECK(rshutdown(s, SHUT_RDWR) == 0, "rshutdown");
	CHECK(rclose(s) == 0, "rclose");
	printf("client: %d checks\n", checks);
	return 0;
}

static int ka_server(const char *port_str)
{
	(void) port_str;
	char buf[8];
	int l = rsocket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in a = addr_of(port);
	CHECK(rbind(l, (struct sockaddr *) &a, sizeof a) == 0, "rbind");
	CHECK(rlisten(l, 1) == 0, "rlisten");
	forked_ready();
	int s = raccept(l, NULL, NULL);
	CHECK(s >= 0, "raccept");
	use_rs = 1;
	read_all(s, buf, 4);
	printf("server: received %.4s after the client's idle time\n", buf);
	rclose(s);
	rclose(l);
	return 0;
}

/* `died`: see the top. Its own fork: the client's end is a SIGKILL, which forked_main would
 * count as a failure. */
static int died(void)
{
	char buf[8];
	setvbuf(stdout, NULL, _IOLBF, 0);
	alarm(30);
	who = "server";
	int l = rsocket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in a = addr_of(port);
	int one = 1;
	CHECK(rsetsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0, "SO_REUSEADDR");
	CHECK(rbind(l, (struct sockaddr *) &a, sizeof a) == 0, "rbind");
	CHECK(rlisten(l, 1) == 0, "rlisten");
	pid_t child = fork();
	CHECK(child >= 0, "fork");
	if (child == 0) {
		who = "client";
		int s = rsocket(AF_INET, SOCK_STREAM, 0);
		CHECK(rconnect(s, (struct sockaddr *) &a, sizeof a) == 0, "rconnect");
		CHECK(rsend(s, "x", 1, 0) == 1, "rsend");
		CHECK(rrecv(s, buf, 1, 0) == 1 && buf[0] == 'y', "rrecv the answer");
		raise(SIGKILL);
		return 1;
	}
	int s = raccept(l, NULL, NULL);
	CHECK(s >= 0, "raccept");
	CHECK(rrecv(s, buf, 1, 0) == 1 && buf[0] == 'x', "rrecv x");
	CHECK(rsend(s, "y", 1, 0) == 1, "rsend y");
	errno = 0;
	ssize_t n = rrecv(s, buf, sizeof buf, 0);
	printf("died: recv after the peer died: %zd %s\n", n, n < 0 ? err_name(errno) : "");
	errno = 0;
	n = rrecv(s, buf, sizeof buf, 0);
	printf("died: then: %zd %s\n", n, n < 0 ? err_name(errno) : "");
	int status;
	CHECK(waitpid(child, &status, 0) == child, "waitpid");
	CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "client status %#x", status);
	rclose(s);
	rclose(l);
	return 0;
}

#define EXITS_LEN 20000

/* Whether every thread of `pid` is stopped (state T in /proc/PID/task/TID/stat): a stop
 * signal takes effect in each thread on its own. */
static int all_stopped(pid_t pid)
{
	char path[64];
	snprintf(path, sizeof path, "/proc/%d/task", (int) pid);
	DIR *d = opendir(path);
	if (!d)
		return 0;
	int all = 1;
	struct dirent *e;
	while ((e = readdir(d)) != NULL) {
		if (e->d_name[0] == '.')
			continue;
		char stat[512], line[256];
		snprintf(stat, sizeof stat, "%s/%s/stat", path, e->d_name);
		FILE *f = fopen(stat, "r");
		if (!f)
			continue;
		char *close_paren = NULL;
		if (fgets(line, sizeof line, f))
			close_paren = strrchr(line, ')');
		fclose(f);
		if (!close_paren || close_paren[1] != ' ' || close_paren[2] != 'T')
			all = 0;
	}
	closedir(d);
	return all;
}

static int exits(void)
{
	static char out[EXITS_LEN], in[EXITS_LEN];
	char b;
	setvbuf(stdout, NULL, _IOLBF, 0);
	alarm(30);
	who = "server";
	for (size_t i = 0; i < EXITS_LEN; i++)
		out[i] = (char) (i * 7 + i / 251);
	int l = rsocket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in a = addr_of(port);
	int one = 1;
	CHECK(rsetsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0, "SO_REUSEADDR");
	CHECK(rbind(l, (struct sockaddr *) &a, sizeof a) == 0, "rbind");
	CHECK(rlisten(l, 1) == 0, "rlisten");
	pid_t server = getpid();
	pid_t child = fork();
	CHECK(child >= 0, "fork");
	if (child == 0) {
		who = "client";
		int s = rsocket(AF_INET, SOCK_STREAM, 0);
		CHECK(rconnect(s, (struct sockaddr *) &a, sizeof a) == 0, "rconnect");
		/* The connection carries data both ways (no first-FPDU hold left) before the
		 * server, waiting in rrecv, is stopped. */
		CHECK(rrecv(s, &b, 1, 0) == 1 && b == 'g', "rrecv g");
		CHECK(kill(server, SIGSTOP) == 0, "stop the server");
		int tries = 0;
		while (!all_stopped(server) && tries++ < 2000)
			usleep(1000);
		CHECK(all_stopped(server), "the server's threads stopped");
		pid_t me = getpid();
		pid_t resumer = fork();
		CHECK(resumer >= 0, "fork");
		if (resumer == 0) {
			/* Not a user of the client's rsocket: only waits, looks, resumes. */
			usleep(500000);
			printf("exits: the client when the server resumed: %s\n",
			       getppid() == me ? "still there" : "gone");
			kill(server, SIGCONT);
			_exit(0);
		}
		size_t sent = 0;
		while (sent < EXITS_LEN) {
			ssize_t n = rsend(s, out + sent, EXITS_LEN - sent, 0);
			CHECK(n > 0, "rsend after %zu", sent);
			sent += n;
		}
		CHECK(rshutdown(s, SHUT_RDWR) == 0, "rshutdown");
		/* No rclose: the exit must not cut the connection short. */
		exit(0);
	}
	int s = raccept(l, NULL, NULL);
	CHECK(s >= 0, "raccept");
	CHECK(rsend(s, "g", 1, 0) == 1, "rsend g");
	read_all(s, in, EXITS_LEN);
	CHECK(memcmp(in, out, EXITS_LEN) == 0, "the bytes received differ from those sent");
	CHECK(rrecv(s, &b, 1, 0) == 0, "end of stream");
	printf("exits: %d bytes, then the end of stream\n", EXITS_LEN);
	int status;
	CHECK(waitpid(child, &status, 0) == child, "waitpid");
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "client status %#x", status);
	rclose(s);
	rclose(l);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: %s PORT rs|tcp|keepalive|died|exits\n", argv[0]);
		return 2;
	}
	use_rs = strcmp(argv[2], "tcp") != 0;
	port = atoi(argv[1]);
	char *fargv[] = { argv[0], argv[1], NULL };
	if (strcmp(argv[2], "keepalive") == 0)
		return forked_main(2, fargv, ka_client, ka_server);
	if (strcmp(argv[2], "died") == 0)
		return died();
	if (strcmp(argv[2], "exits") == 0)
		return exits();
	return forked_main(2, fargv, client, server);
}
