/* Socket semantics that unmodified programs rely on, checked the same way against the
 * kernel's TCP (run without the preload library) and against iWARP streams (run with it,
 * SOFTWARP_SOCKETS=all), so every expectation here is the kernel's own behaviour.
 *
 *   posix_semantics tcp        plain kernel TCP (no preload library)
 *   posix_semantics iwarp      preloaded, SOFTWARP_SOCKETS=all
 *   posix_semantics fallback   preloaded, SOFTWARP_SOCKETS=all SOFTWARP_SOCKETS_FALLBACK=tcp
 *
 * One process: an acceptor thread and a thread per connection answer a one-byte command
 * (below), the main thread runs the checks. A plain TCP server made with raw system calls
 * (so the preload library never sees its socket) plays a peer that does not speak MPA.
 * Prints "ok NAME" or "FAIL NAME: why" per check and "done F failures"; exits 1 on a
 * failure. Every wait is bounded. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "softwarp_sockets.h"

static int port, plain_port;
static int iwarp, fallback;
static int failures;
static atomic_int release_quiet;
static pthread_t main_thread;
static volatile sig_atomic_t signals, pipes;
static char why[256];

#define FAILED(...) (snprintf(why, sizeof why, __VA_ARGS__), why)

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void msleep(int ms) { usleep(ms * 1000); }

static struct sockaddr_in loopback(int p) {
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(p) };
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
}

static int write_all(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= w;
    }
    return 0;
}

/* Reads exactly n bytes within 5 s (the socket may be non-blocking). */
static int read_exact(int fd, char *buf, size_t n) {
    size_t got = 0;
    double end = now_ms() + 5000;
    while (got < n && now_ms() < end) {
        struct pollfd p = { fd, POLLIN, 0 };
        poll(&p, 1, 100);
        ssize_t r = read(fd, buf + got, n - got);
        if (r == 0) return -1;
        if (r > 0) got += r;
        else if (errno != EAGAIN && errno != EINTR) return -1;
    }
    return got == n ? 0 : -1;
}

/* ---- the server ----------------------------------------------------------------------- */

static void *serve(void *arg) {
    int c = (int)(long)arg;
    char cmd, buf[65536];
    if (read(c, &cmd, 1) != 1) { close(c); return NULL; }
    switch (cmd) {
    case 'E': /* echo until the EOF */
        for (;;) {
            ssize_t n = read(c, buf, sizeof buf);
            if (n <= 0 || write_all(c, buf, n)) break;
        }
        break;
    case 'S': /* "hello world", then wait for the EOF */
        write_all(c, "hello world", 11);
        while (read(c, buf, sizeof buf) > 0) {}
        break;
    case 'W': /* three pieces of 1000 bytes, 50 ms apart */
        memset(buf, 'w', 1000);
        for (int i = 0; i < 3; i++) { msleep(50); write_all(c, buf, 1000); }
        while (read(c, buf, sizeof buf) > 0) {}
        break;
    case 'D': /* "late" after 500 ms */
        msleep(500);
        write_all(c, "late", 4);
        while (read(c, buf, sizeof buf) > 0) {}
        break;
    case 'C': /* close at once */
        break;
    case 'H': /* half close, then wait for the EOF */
        shutdown(c, SHUT_WR);
        while (read(c, buf, sizeof buf) > 0) {}
        break;
    case 'N': /* never read, until told (at most 20 s) */
        for (int i = 0; i < 2000 && !atomic_load(&release_quiet); i++) msleep(10);
        break;
    case 'Q': /* read until the EOF, send nothing */
        while (read(c, buf, sizeof buf) > 0) {}
        break;
    }
    close(c);
    return NULL;
}

static void *acceptor(void *arg) {
    int l = (int)(long)arg;
    for (;;) {
        int c = accept(l, NULL, NULL);
        if (c < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            perror("accept");
            return NULL;
        }
        pthread_t t;
        pthread_create(&t, NULL, serve, (void *)(long)c);
        pthread_detach(t);
    }
}

/* A plain TCP server the preload library never sees (raw system calls): answers an MPA
 * Request with an HTTP error and closes, echoes anything else (one connection at a time). */
static void *plain_server(void *arg) {
    int l = (int)(long)arg;
    for (;;) {
        int c = syscall(SYS_accept4, l, NULL, NULL, 0);
        if (c < 0) continue;
        char b[4096];
        long n = syscall(SYS_read, c, b, sizeof b);
        if (n >= 10 && memcmp(b, "MPA ID Req", 10) == 0) {
            syscall(SYS_write, c, "HTTP/1.0 400 Bad Request\r\n\r\n", 28);
        } else {
            while (n > 0) {
                syscall(SYS_write, c, b, n);
                n = syscall(SYS_read, c, b, sizeof b);
            }
        }
        syscall(SYS_close, c);
    }
    return NULL;
}

/* ---- helpers of the checks ------------------------------------------------------------- */

/* A blocking connection to the server that sent command `cmd`. */
static int dial(char cmd) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = loopback(port);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a)) { perror("connect"); exit(2); }
    if (write(fd, &cmd, 1) != 1) { perror("write"); exit(2); }
    return fd;
}

static void nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

static int iwarp_active(int fd) {
    int active = 0;
    socklen_t l = sizeof active;
    if (getsockopt(fd, SOL_SOFTWARP, SOFTWARP_IWARP_ACTIVE, &active, &l)) return 0;
    return active;
}

static int so_error(int fd) {
    int err = -1;
    socklen_t l = sizeof err;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &l)) return -errno;
    return err;
}

/* A non-blocking connect to `p`: EINPROGRESS (0 is allowed of the kernel), with
 * `ask_again` a second connect (EALREADY while under way, 0 when it finds the connection
 * made), then POLLOUT within
 * 10 s. Returns the socket or -1 with `why` set. */
static int connect_nonblocking(int p, short *revents, int ask_again) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    struct sockaddr_in a = loopback(p);
    int r = connect(fd, (struct sockaddr *)&a, sizeof a);
    if (r == 0 && (iwarp || fallback)) {
        FAILED("connect returned 0 before the MPA exchange");
        return -1;
    }
    if (r < 0 && errno != EINPROGRESS && errno != ECONNREFUSED) {
        FAILED("connect: %s", strerror(errno));
        return -1;
    }
    if (ask_again && r < 0 && errno == EINPROGRESS) {
        int again = connect(fd, (struct sockaddr *)&a, sizeof a);
        if (again != 0 && errno != EALREADY && errno != EISCONN && errno != ECONNREFUSED) {
            FAILED("a second connect: %d %s", again, strerror(errno));
            return -1;
        }
    }
    struct pollfd pf = { fd, POLLOUT, 0 };
    int n = poll(&pf, 1, 10000);
    if (n != 1 || !(pf.revents & (POLLOUT | POLLERR))) {
        FAILED("poll: %d revents %#x", n, pf.revents);
        return -1;
    }
    *revents = pf.revents;
    return fd;
}

static void on_signal(int s) { (void)s; signals++; }
static void on_pipe(int s) { (void)s; pipes++; }

static void catch_signal(int sig, void (*h)(int), int flags) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = h;
    sa.sa_flags = flags;
    sigemptyset(&sa.sa_mask);
    sigaction(sig, &sa, NULL);
}

static void *kick(void *arg) {
    msleep((int)(long)arg);
    pthread_kill(main_thread, SIGUSR1);
    return NULL;
}

/* ---- the checks -------------------------------------------------------------------------- */

static const char *nonblocking_connect(void) {
    short rev;
    int fd = connect_nonblocking(port, &rev, 1);
    if (fd < 0) return why;
    if (so_error(fd) != 0) return FAILED("SO_ERROR %d", so_error(fd));
    if (iwarp && !iwarp_active(fd)) return "not an iWARP stream";
    char buf[8];
    if (write_all(fd, "Eping", 5) || read_exact(fd, buf, 4) || memcmp(buf, "ping", 4))
        return "no echo";
    close(fd);
    return NULL;
}

static const char *nonblocking_connect_refused(void) {
    /* A port nobody listens on: a bound socket that never listens. */
    int hold = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = loopback(0);
    socklen_t l = sizeof a;
    if (bind(hold, (struct sockaddr *)&a, sizeof a) || getsockname(hold, (struct sockaddr *)&a, &l))
        return "bind";
    short rev;
    int fd = connect_nonblocking(ntohs(a.sin_port), &rev, 0);
    if (fd < 0) return why;
    if (!(rev & POLLERR)) return FAILED("revents %#x without POLLERR", rev);
    int e = so_error(fd);
    if (e != ECONNREFUSED) return FAILED("SO_ERROR %d (%s)", e, strerror(e));
    if (so_error(fd) != 0) return "SO_ERROR not cleared by reading it";
    close(fd);
    close(hold);
    return NULL;
}

static const char *peer_without_mpa(void) {
    short rev;
    int fd = connect_nonblocking(plain_port, &rev, 0);
    if (fd < 0) return why;
    int e = so_error(fd);
    if (fallback) {
        /* A new plain TCP connection replaced the refused one. */
        if (e != 0) return FAILED("SO_ERROR %d (%s) despite the fallback", e, strerror(e));
        if (iwarp_active(fd)) return "still iWARP";
        char buf[8];
        if (write_all(fd, "plain", 5) || read_exact(fd, buf, 5) || memcmp(buf, "plain", 5))
            return "no echo over the fallback connection";
    } else if (e != ECONNREFUSED) {
        return FAILED("SO_ERROR %d (%s), not ECONNREFUSED", e, strerror(e));
    }
    close(fd);
    return NULL;
}

static const char *receive_timeout(void) {
    int fd = dial('Q');
    struct timeval tv = { 0, 200000 }, back;
    socklen_t l = sizeof back;
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv)) return "setsockopt";
    if (getsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &back, &l) || back.tv_sec != 0 || back.tv_usec != 200000)
        return FAILED("SO_RCVTIMEO reads back %ld.%06ld", (long)back.tv_sec, (long)back.tv_usec);
    char buf[16];
    double t0 = now_ms();
    ssize_t r = recv(fd, buf, sizeof buf, 0);
    double took = now_ms() - t0;
    if (r != -1 || (errno != EAGAIN && errno != EWOULDBLOCK))
        return FAILED("recv %zd %s", r, strerror(errno));
    if (took < 150 || took > 3000) return FAILED("recv timed out after %.0f ms", took);
    close(fd);
    return NULL;
}

static const char *send_timeout(void) {
    atomic_store(&release_quiet, 0);
    int fd = dial('N');
    struct timeval tv = { 0, 200000 };
    if (setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv)) return "setsockopt";
    static char chunk[65536];
    ssize_t r = 0;
    double took = 0;
    long total = 0;
    for (int i = 0; i < 20000; i++) {
        double t0 = now_ms();
        r = write(fd, chunk, sizeof chunk);
        took = now_ms() - t0;
        if (r < 0) break;
        total += r;
    }
    atomic_store(&release_quiet, 1);
    if (r != -1 || (errno != EAGAIN && errno != EWOULDBLOCK))
        return FAILED("write %zd %s after %ld bytes", r, strerror(errno), total);
    if (took < 150 || took > 3000) return FAILED("write timed out after %.0f ms", took);
    close(fd);
    return NULL;
}

static const char *signal_interrupts(void) {
    catch_signal(SIGUSR1, on_signal, 0);
    int fd = dial('Q');
    signals = 0;
    pthread_t t;
    pthread_create(&t, NULL, kick, (void *)200L);
    char buf[16];
    ssize_t r = recv(fd, buf, sizeof buf, 0);
    int e = errno;
    pthread_join(t, NULL);
    if (r != -1 || e != EINTR) return FAILED("recv %zd %s, not EINTR", r, strerror(e));
    if (signals != 1) return FAILED("%d signals", (int)signals);
    close(fd);
    return NULL;
}

static const char *signal_restarts(void) {
    catch_signal(SIGUSR1, on_signal, SA_RESTART);
    int fd = dial('D');
    signals = 0;
    pthread_t t;
    pthread_create(&t, NULL, kick, (void *)200L);
    char buf[16];
    double t0 = now_ms();
    ssize_t r = recv(fd, buf, sizeof buf, 0);
    int e = errno;
    pthread_join(t, NULL);
    if (r != 4 || memcmp(buf, "late", 4)) return FAILED("recv %zd %s", r, strerror(e));
    if (signals != 1) return FAILED("%d signals", (int)signals);
    if (now_ms() - t0 < 400) return "returned before the data came";
    close(fd);
    return NULL;
}

static const char *peek(void) {
    int fd = dial('S');
    char buf[64];
    ssize_t r = -1;
    for (int i = 0; i < 500 && r != 11; i++) {
        r = recv(fd, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
        if (r != 11) msleep(10);
    }
    if (r != 11 || memcmp(buf, "hello world", 11)) return FAILED("MSG_PEEK|MSG_DONTWAIT %zd", r);
    if (recv(fd, buf, 5, MSG_PEEK) != 5 || memcmp(buf, "hello", 5)) return "MSG_PEEK of 5";
    memset(buf, 0, sizeof buf);
    if (recv(fd, buf, sizeof buf, 0) != 11 || memcmp(buf, "hello world", 11))
        return "the bytes after peeking";
    r = recv(fd, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
    if (r != -1 || (errno != EAGAIN && errno != EWOULDBLOCK))
        return FAILED("MSG_PEEK|MSG_DONTWAIT on nothing: %zd %s", r, strerror(errno));
    close(fd);
    return NULL;
}

static const char *waitall(void) {
    int fd = dial('W');
    static char buf[4000];
    double t0 = now_ms();
    ssize_t r = recv(fd, buf, 3000, MSG_WAITALL);
    if (r != 3000) return FAILED("recv %zd %s", r, strerror(errno));
    for (int i = 0; i < 3000; i++)
        if (buf[i] != 'w') return "wrong bytes";
    if (now_ms() - t0 < 100) return "returned before the last piece came";
    close(fd);
    return NULL;
}

static const char *sigpipe(void) {
    catch_signal(SIGPIPE, on_pipe, SA_RESTART);
    pipes = 0;
    int fd = dial('C');
    char buf[16];
    if (recv(fd, buf, sizeof buf, 0) != 0) return "no EOF from the peer";
    ssize_t r = 0;
    for (int i = 0; i < 300 && r >= 0; i++) {
        r = send(fd, "x", 1, MSG_NOSIGNAL);
        if (r >= 0) msleep(10);
    }
    if (r != -1 || errno != EPIPE) return FAILED("send %zd %s, not EPIPE", r, strerror(errno));
    if (pipes != 0) return "SIGPIPE despite MSG_NOSIGNAL";
    r = write(fd, "x", 1);
    if (r != -1 || errno != EPIPE) return FAILED("write %zd %s", r, strerror(errno));
    if (pipes != 1) return FAILED("%d SIGPIPEs after write", (int)pipes);
    close(fd);
    return NULL;
}

static int wait_events(int ep, int ms, unsigned *events) {
    struct epoll_event ev[4];
    int n = epoll_wait(ep, ev, 4, ms);
    *events = n > 0 ? ev[0].events : 0;
    return n;
}

static const char *epoll_edge_and_level(void) {
    int fd = dial('E');
    nonblocking(fd);
    unsigned evs;
    int et = epoll_create1(0), lt = epoll_create1(0), out = epoll_create1(0);
    struct epoll_event e = { .events = EPOLLIN | EPOLLET, .data.u64 = 7 };
    if (epoll_ctl(et, EPOLL_CTL_ADD, fd, &e)) return "epoll_ctl ET";
    e.events = EPOLLIN;
    if (epoll_ctl(lt, EPOLL_CTL_ADD, fd, &e)) return "epoll_ctl LT";
    e.events = EPOLLOUT | EPOLLET;
    if (epoll_ctl(out, EPOLL_CTL_ADD, fd, &e)) return "epoll_ctl ET out";
    if (wait_events(out, 2000, &evs) != 1 || !(evs & EPOLLOUT)) return "no EPOLLOUT";
    if (wait_events(out, 200, &evs) != 0) return FAILED("EPOLLOUT|EPOLLET twice (%#x)", evs);
    if (write_all(fd, "a", 1)) return "write";
    if (wait_events(et, 5000, &evs) != 1 || !(evs & EPOLLIN)) return "no EPOLLIN (ET)";
    if (wait_events(et, 200, &evs) != 0) return FAILED("EPOLLET reported twice (%#x)", evs);
    if (wait_events(lt, 2000, &evs) != 1 || wait_events(lt, 200, &evs) != 1)
        return "level-triggered not reported on every wait";
    if (write_all(fd, "b", 1)) return "write";
    if (wait_events(et, 5000, &evs) != 1) return "EPOLLET missed the new data";
    char buf[8];
    if (read_exact(fd, buf, 2) || memcmp(buf, "ab", 2)) return "echo";
    if (wait_events(et, 200, &evs) != 0 || wait_events(lt, 200, &evs) != 0)
        return "readable after reading everything";
    close(et);
    close(lt);
    close(out);
    close(fd);
    return NULL;
}

static const char *hangup_bits(void) {
    int fd = dial('H');
    nonblocking(fd);
    int ep = epoll_create1(0);
    struct epoll_event e = { .events = EPOLLIN | EPOLLRDHUP, .data.u64 = 1 };
    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &e);
    unsigned evs;
    if (wait_events(ep, 5000, &evs) != 1) return "no event at the peer's EOF";
    if ((evs & (EPOLLIN | EPOLLRDHUP)) != (EPOLLIN | EPOLLRDHUP) || (evs & EPOLLHUP))
        return FAILED("epoll events %#x at the peer's EOF", evs);
    char buf[8];
    if (read(fd, buf, sizeof buf) != 0) return "no EOF";
    struct pollfd p = { fd, POLLIN | POLLRDHUP, 0 };
    if (poll(&p, 1, 1000) != 1 || (p.revents & (POLLIN | POLLRDHUP)) != (POLLIN | POLLRDHUP) ||
        (p.revents & POLLHUP))
        return FAILED("poll revents %#x after the EOF", p.revents);
    shutdown(fd, SHUT_WR);
    p.revents = 0;
    if (poll(&p, 1, 1000) != 1 || !(p.revents & POLLHUP))
        return FAILED("poll revents %#x with both directions closed", p.revents);
    close(ep);
    close(fd);
    return NULL;
}

static const char *sendfile_and_mmsg(void) {
    /* sendfile of a 200000-byte file, echoed back. */
    static char data[200000], back[200000];
    for (size_t i = 0; i < sizeof data; i++) data[i] = (char)(i * 7 + i / 251);
    char path[] = "/tmp/posix_semantics_XXXXXX";
    int file = mkstemp(path);
    if (file < 0 || write_all(file, data, sizeof data)) return "temporary file";
    unlink(path);
    int fd = dial('E');
    off_t off = 0;
    for (int i = 0; i < 1000 && off < (off_t)sizeof data; i++) {
        ssize_t r = sendfile(fd, file, &off, sizeof data - off);
        if (r < 0) return FAILED("sendfile: %s", strerror(errno));
    }
    if (off != (off_t)sizeof data) return FAILED("sendfile moved %ld bytes", (long)off);
    if (read_exact(fd, back, sizeof back) || memcmp(back, data, sizeof data))
        return "the echo of the sendfile bytes";
    /* The file position form (offset NULL). */
    lseek(file, 1000, SEEK_SET);
    ssize_t r = sendfile(fd, file, NULL, 500);
    if (r != 500 || lseek(file, 0, SEEK_CUR) != 1500) return "sendfile without an offset";
    if (read_exact(fd, back, 500) || memcmp(back, data + 1000, 500)) return "its echo";
    close(file);
    /* sendmmsg: three messages, one stream. */
    struct iovec iv[3] = { { "one", 3 }, { "two", 3 }, { "three", 5 } };
    struct mmsghdr m[3];
    memset(m, 0, sizeof m);
    for (int i = 0; i < 3; i++) { m[i].msg_hdr.msg_iov = &iv[i]; m[i].msg_hdr.msg_iovlen = 1; }
    int n = sendmmsg(fd, m, 3, 0);
    if (n != 3 || m[2].msg_len != 5) return FAILED("sendmmsg %d", n);
    /* recvmmsg: the 11 echoed bytes into 4-byte buffers, once all are there. */
    int avail = 0;
    for (int i = 0; i < 500 && avail < 11; i++) {
        if (ioctl(fd, FIONREAD, &avail)) return "FIONREAD";
        if (avail < 11) msleep(10);
    }
    if (avail != 11) return FAILED("FIONREAD %d", avail);
    char b[3][4];
    struct iovec rv[3] = { { b[0], 4 }, { b[1], 4 }, { b[2], 4 } };
    memset(m, 0, sizeof m);
    for (int i = 0; i < 3; i++) { m[i].msg_hdr.msg_iov = &rv[i]; m[i].msg_hdr.msg_iovlen = 1; }
    n = recvmmsg(fd, m, 3, MSG_WAITFORONE, NULL);
    if (n != 3 || m[0].msg_len != 4 || m[1].msg_len != 4 || m[2].msg_len != 3 ||
        memcmp(b[0], "onet", 4) || memcmp(b[1], "woth", 4) || memcmp(b[2], "ree", 3))
        return FAILED("recvmmsg %d", n);
    close(fd);
    return NULL;
}

/* A plain TCP client (raw system calls: the preload library never sees its socket) reaching
 * the server: the kernel's TCP and an iWARP server with the TCP fallback serve it (the echo
 * comes back); an iWARP server without the fallback refuses it (EOF or reset, no echo). */
static const char *plain_client(void) {
    int fd = syscall(SYS_socket, AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = loopback(port);
    struct timeval tv = { 0, 100000 };
    if (fd < 0 || syscall(SYS_setsockopt, fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) ||
        syscall(SYS_connect, fd, &a, sizeof a))
        return FAILED("raw connect: %s", strerror(errno));
    const char msg[] = "Eplain client, no MPA Request here";
    size_t len = sizeof msg - 1;
    if (syscall(SYS_write, fd, msg, len) != (long)len) return "raw write";
    char back[64];
    size_t got = 0;
    double end = now_ms() + 10000;
    while (got < len - 1 && now_ms() < end) {
        long r = syscall(SYS_read, fd, back + got, sizeof back - got);
        if (r > 0) got += r;
        else if (r == 0 || errno != EAGAIN) break;
    }
    syscall(SYS_close, fd);
    if (iwarp) {
        if (got) return FAILED("an iWARP server without the fallback answered %zu bytes", got);
    } else if (got != len - 1 || memcmp(back, msg + 1, len - 1)) {
        return FAILED("echo: %zu of %zu bytes", got, len - 1);
    }
    return NULL;
}

/* A connection set up before fork(): the kernel's TCP socket works in the child; an iWARP
 * stream's copy in the child fails with EIO (its stack stayed in the parent). Either way
 * the parent's keeps working. */
static const char *fork_inherited(void) {
    int fd = dial('E');
    char buf[8];
    if (write_all(fd, "one", 3) || read_exact(fd, buf, 3) || memcmp(buf, "one", 3))
        return "no echo before the fork";
    pid_t child = fork();
    if (child < 0) return "fork";
    if (child == 0) {
        ssize_t w = write(fd, "two", 3);
        int e = errno;
        if (iwarp || fallback) _exit(w == -1 && e == EIO ? 0 : 10 + (w < 0 ? e : 0));
        _exit(w == 3 && read_exact(fd, buf, 3) == 0 && memcmp(buf, "two", 3) == 0 ? 0 : 3);
    }
    int status = -1;
    for (int i = 0; i < 500 && waitpid(child, &status, WNOHANG) == 0; i++) msleep(10);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        return FAILED("the child: status %#x", status);
    }
    if (write_all(fd, "three", 5) || read_exact(fd, buf, 5) || memcmp(buf, "three", 5))
        return "no echo in the parent after the fork";
    close(fd);
    return NULL;
}

/* True when fd becomes readable within ms. */
static int readable_within(int fd, int ms) {
    struct pollfd p = { fd, POLLIN, 0 };
    return poll(&p, 1, ms) == 1;
}

/* MSG_MORE and TCP_CORK hold small writes (the kernel's for at least 200 ms, an iWARP
 * stream's until the program's next call that sends them), and the next write without
 * MSG_MORE, or the uncork, sends them; the options read back as set. Over iWARP the
 * stream holds them: before, MSG_MORE was ignored (each write one message) and TCP_CORK
 * went to the connection's TCP socket, corking its FPDUs. */
static const char *cork_and_more(void) {
    int fd = dial('E');
    char buf[16];
    if (send(fd, "ab", 2, MSG_MORE) != 2) return FAILED("send MSG_MORE: %s", strerror(errno));
    if (readable_within(fd, 50)) return "MSG_MORE bytes left at once";
    if (send(fd, "cd", 2, 0) != 2) return "send";
    if (!readable_within(fd, 5000) || read_exact(fd, buf, 4) || memcmp(buf, "abcd", 4))
        return "the held bytes with the next write";
    int on = 1, v = 0;
    socklen_t len = sizeof v;
    if (setsockopt(fd, IPPROTO_TCP, TCP_CORK, &on, sizeof on)) return "set TCP_CORK";
    if (getsockopt(fd, IPPROTO_TCP, TCP_CORK, &v, &len) || v != 1) return "TCP_CORK reads back";
    if (write_all(fd, "ef", 2) || write_all(fd, "gh", 2)) return "write corked";
    if (readable_within(fd, 50)) return "corked bytes left at once";
    on = 0;
    if (setsockopt(fd, IPPROTO_TCP, TCP_CORK, &on, sizeof on)) return "clear TCP_CORK";
    if (!readable_within(fd, 5000) || read_exact(fd, buf, 4) || memcmp(buf, "efgh", 4))
        return "the corked bytes after the uncork";
    on = 1;
    len = sizeof v;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on) ||
        getsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &v, &len) || v != 1)
        return "TCP_NODELAY reads back";
    close(fd);
    return NULL;
}

/* recvmmsg's timeout, as the kernel applies it: looked at after each message, with what is
 * left written back. The 'W' server sends three 1000-byte pieces 50 ms apart. */
static const char *recvmmsg_timeout(void) {
    static char b[3][1000];
    struct iovec rv[3] = { { b[0], 1000 }, { b[1], 1000 }, { b[2], 1000 } };
    struct mmsghdr m[3];
    for (int round = 0; round < 2; round++) {
        int fd = dial('W');
        memset(m, 0, sizeof m);
        for (int i = 0; i < 3; i++) { m[i].msg_hdr.msg_iov = &rv[i]; m[i].msg_hdr.msg_iovlen = 1; }
        /* 20 ms: over after the first piece (50 ms); 10 s: all three, time left. */
        struct timespec ts = { round ? 10 : 0, round ? 0 : 20000000 };
        int n = recvmmsg(fd, m, 3, 0, &ts);
        if (round == 0 && (n != 1 || m[0].msg_len != 1000 || ts.tv_sec || ts.tv_nsec))
            return FAILED("20 ms: %d messages (%s), %ld.%09ld s left", n,
                          n < 0 ? strerror(errno) : "", (long)ts.tv_sec, ts.tv_nsec);
        if (round == 1 && (n != 3 || m[2].msg_len != 1000 || ts.tv_sec < 9 || ts.tv_sec > 9))
            return FAILED("10 s: %d messages (%s), %ld.%09ld s left", n,
                          n < 0 ? strerror(errno) : "", (long)ts.tv_sec, ts.tv_nsec);
        close(fd);
    }
    struct timespec bad = { 0, 1000000000 };
    int fd = dial('W');
    if (recvmmsg(fd, m, 3, 0, &bad) != -1 || errno != EINVAL) return "tv_nsec 1e9 not EINVAL";
    close(fd);
    return NULL;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "tcp";
    iwarp = strcmp(mode, "iwarp") == 0;
    fallback = strcmp(mode, "fallback") == 0;
    main_thread = pthread_self();

    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = loopback(0);
    socklen_t len = sizeof a;
    if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 64) ||
        getsockname(l, (struct sockaddr *)&a, &len)) { perror("listen"); return 2; }
    port = ntohs(a.sin_port);
    int pl = syscall(SYS_socket, AF_INET, SOCK_STREAM, 0);
    a = loopback(0);
    len = sizeof a;
    if (bind(pl, (struct sockaddr *)&a, sizeof a) || listen(pl, 8) ||
        getsockname(pl, (struct sockaddr *)&a, &len)) { perror("plain listen"); return 2; }
    plain_port = ntohs(a.sin_port);
    pthread_t t;
    pthread_create(&t, NULL, acceptor, (void *)(long)l);
    pthread_create(&t, NULL, plain_server, (void *)(long)pl);

    struct { const char *name; const char *(*run)(void); int preload_only; } checks[] = {
        { "nonblocking_connect", nonblocking_connect, 0 },
        { "nonblocking_connect_refused", nonblocking_connect_refused, 0 },
        { "peer_without_mpa", peer_without_mpa, 1 },
        { "receive_timeout", receive_timeout, 0 },
        { "send_timeout", send_timeout, 0 },
        { "signal_interrupts", signal_interrupts, 0 },
        { "signal_restarts", signal_restarts, 0 },
        { "peek", peek, 0 },
        { "waitall", waitall, 0 },
        { "sigpipe", sigpipe, 0 },
        { "epoll_edge_and_level", epoll_edge_and_level, 0 },
        { "hangup_bits", hangup_bits, 0 },
        { "sendfile_and_mmsg", sendfile_and_mmsg, 0 },
        { "recvmmsg_timeout", recvmmsg_timeout, 0 },
        { "cork_and_more", cork_and_more, 0 },
        { "plain_client", plain_client, 0 },
        { "fork_inherited", fork_inherited, 0 },
    };
    const char *only = argc > 2 ? argv[2] : NULL;
    for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++) {
        if (checks[i].preload_only && !iwarp && !fallback) continue;
        if (only && strcmp(only, checks[i].name) != 0) continue;
        double t0 = now_ms();
        const char *r = checks[i].run();
        if (r) {
            printf("FAIL %s: %s\n", checks[i].name, r);
            failures++;
        } else {
            printf("ok %s (%.0f ms)\n", checks[i].name, now_ms() - t0);
        }
        fflush(stdout);
    }
    printf("done %d failures\n", failures);
    fflush(stdout);
    _exit(failures ? 1 : 0);
}
