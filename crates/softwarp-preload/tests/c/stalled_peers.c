/* An event loop that never blocks, run preloaded (SOFTWARP_SOCKETS=all) against peers that
 * stall their MPA exchange: every call it makes is non-blocking or has a zero timeout, and
 * each is timed, so a call that waits for a peer shows (over kernel TCP none of them can).
 *
 *   stalled_peers serve poll|epoll SECONDS GOOD STALLED
 *       Listens on 127.0.0.1 (any port; prints "port N"), accepts with SOCK_NONBLOCK and
 *       echoes what each connection sends, with poll(..., 0) and a recv on every
 *       connection each round (poll), or a level-triggered epoll_wait(..., 0) and recv on
 *       what it reports (epoll), a round every millisecond, until GOOD connections were
 *       echoed and STALLED connections failed (or SECONDS passed).
 *   stalled_peers connect PORT poll|epoll SECONDS
 *       A non-blocking connect to 127.0.0.1:PORT, then poll(..., 0) (or epoll_wait(..., 0))
 *       every millisecond until the socket is reported ready (or SECONDS passed), then
 *       SO_ERROR.
 *
 * Prints one "result ..." line: the number of timed calls, the longest in ms, how many took
 * 100 ms or more, and what happened. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONNS 64

static long calls, slow;
static double longest;

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* Times one call: `expr` evaluated between two clock reads. */
#define TIMED(expr)                                                                        \
    ({                                                                                     \
        double t0_ = now_ms();                                                             \
        __typeof__(expr) r_ = (expr);                                                      \
        int e_ = errno;                                                                    \
        double dt_ = now_ms() - t0_;                                                       \
        calls++;                                                                           \
        if (dt_ > longest) longest = dt_;                                                  \
        if (dt_ >= 100) slow++;                                                            \
        errno = e_;                                                                        \
        r_;                                                                                \
    })

struct conn {
    int fd;
    double accepted;
    int served;
};

static struct conn conns[MAX_CONNS];
static int nconns;
/* Connections echoed; of the others: reset, ended (EOF), failed otherwise; readiness
 * reported without anything to read; echoed connections closed by their clients. */
static long served, resets, eofs, others, spurious, good_closed;
static double first_reset = -1, last_reset = -1;

static void drop_conn(int i) {
    close(conns[i].fd);
    conns[i] = conns[--nconns];
}

/* Reads what connection i has and echoes it. Returns 1 when the connection was closed (and
 * removed: the caller must not advance its index). */
static int service(int i, int reported) {
    char buf[4096];
    ssize_t n = TIMED(recv(conns[i].fd, buf, sizeof buf, 0));
    if (n > 0) {
        ssize_t w = TIMED(send(conns[i].fd, buf, n, MSG_NOSIGNAL));
        if (w != n) { others++; drop_conn(i); return 1; }
        if (!conns[i].served) { conns[i].served = 1; served++; }
        return 0;
    }
    if (n == 0) {
        if (conns[i].served) good_closed++;
        else eofs++;
        drop_conn(i);
        return 1;
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (reported) spurious++;
        return 0;
    }
    if (errno == ECONNRESET) {
        double after = now_ms() - conns[i].accepted;
        if (first_reset < 0 || after < first_reset) first_reset = after;
        if (after > last_reset) last_reset = after;
        resets++;
    } else {
        fprintf(stderr, "recv: %s\n", strerror(errno));
        others++;
    }
    drop_conn(i);
    return 1;
}

static void accept_all(int l, int ep) {
    for (;;) {
        int c = TIMED(accept4(l, NULL, NULL, SOCK_NONBLOCK));
        if (c < 0) return;
        if (nconns == MAX_CONNS) { close(c); others++; continue; }
        conns[nconns] = (struct conn){ c, now_ms(), 0 };
        nconns++;
        if (ep >= 0) {
            struct epoll_event ev = { .events = EPOLLIN, .data.fd = c };
            if (epoll_ctl(ep, EPOLL_CTL_ADD, c, &ev)) { perror("epoll_ctl"); exit(2); }
        }
    }
}

static int find(int fd) {
    for (int i = 0; i < nconns; i++)
        if (conns[i].fd == fd) return i;
    return -1;
}

static int serve(int use_epoll, double seconds, long good, long stalled) {
    int l = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    struct sockaddr_in a = { .sin_family = AF_INET };
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof a;
    if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 128) ||
        getsockname(l, (struct sockaddr *)&a, &al)) {
        perror("listen");
        return 2;
    }
    printf("port %d\n", ntohs(a.sin_port));
    fflush(stdout);
    int ep = -1;
    if (use_epoll) {
        ep = epoll_create1(EPOLL_CLOEXEC);
        struct epoll_event ev = { .events = EPOLLIN, .data.fd = l };
        if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, l, &ev)) { perror("epoll"); return 2; }
    }
    double end = now_ms() + seconds * 1e3;
    long rounds = 0;
    while (now_ms() < end && !(served >= good && resets + eofs + others >= stalled)) {
        rounds++;
        if (use_epoll) {
            struct epoll_event evs[MAX_CONNS + 1];
            int n = TIMED(epoll_wait(ep, evs, MAX_CONNS + 1, 0));
            for (int k = 0; k < n; k++) {
                if (evs[k].data.fd == l) { accept_all(l, ep); continue; }
                int i = find(evs[k].data.fd);
                if (i >= 0) service(i, 1);
            }
        } else {
            struct pollfd set[MAX_CONNS + 1];
            int fds[MAX_CONNS];
            set[0] = (struct pollfd){ l, POLLIN, 0 };
            int k = nconns;
            for (int i = 0; i < k; i++) {
                set[i + 1] = (struct pollfd){ conns[i].fd, POLLIN, 0 };
                fds[i] = conns[i].fd;
            }
            TIMED(poll(set, k + 1, 0));
            if (set[0].revents & POLLIN) accept_all(l, -1);
            /* A read on every connection, reported or not: a non-blocking read never waits. */
            for (int j = 0; j < k; j++) {
                int i = find(fds[j]);
                if (i >= 0) service(i, (set[j + 1].revents & POLLIN) != 0);
            }
        }
        usleep(1000);
    }
    printf("result calls %ld max_ms %.1f slow %ld rounds %ld served %ld resets %ld eofs %ld "
           "others %ld spurious %ld good_closed %ld first_reset_ms %.0f last_reset_ms %.0f "
           "open %d\n",
           calls, longest, slow, rounds, served, resets, eofs, others, spurious, good_closed,
           first_reset, last_reset, nconns);
    return 0;
}

static int connect_to(int port, int use_epoll, double seconds) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    double t0 = now_ms();
    int r = TIMED(connect(fd, (struct sockaddr *)&a, sizeof a));
    if (r == 0 || errno != EINPROGRESS) {
        printf("result connect %d errno %d\n", r, errno);
        return 1;
    }
    int ep = -1;
    if (use_epoll) {
        ep = epoll_create1(EPOLL_CLOEXEC);
        struct epoll_event ev = { .events = EPOLLIN | EPOLLOUT, .data.fd = fd };
        if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev)) { perror("epoll"); return 2; }
    }
    double end = t0 + seconds * 1e3, ready = -1;
    unsigned revents = 0;
    long rounds = 0;
    while (now_ms() < end) {
        rounds++;
        if (use_epoll) {
            struct epoll_event ev;
            if (TIMED(epoll_wait(ep, &ev, 1, 0)) == 1) { revents = ev.events; }
        } else {
            struct pollfd p = { fd, POLLIN | POLLOUT, 0 };
            if (TIMED(poll(&p, 1, 0)) == 1) revents = p.revents;
        }
        if (revents) { ready = now_ms() - t0; break; }
        /* A second connect meanwhile: EALREADY at once, as the kernel's. */
        if (rounds % 100 == 0) TIMED(connect(fd, (struct sockaddr *)&a, sizeof a));
        usleep(1000);
    }
    int err = -1;
    socklen_t l = sizeof err;
    TIMED(getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &l));
    printf("result calls %ld max_ms %.1f slow %ld rounds %ld ready_ms %.0f revents %#x "
           "so_error %d\n",
           calls, longest, slow, rounds, ready, revents, err);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 6 && !strcmp(argv[1], "serve"))
        return serve(!strcmp(argv[2], "epoll"), atof(argv[3]), atol(argv[4]), atol(argv[5]));
    if (argc == 5 && !strcmp(argv[1], "connect"))
        return connect_to(atoi(argv[2]), !strcmp(argv[3], "epoll"), atof(argv[4]));
    fprintf(stderr, "usage: see the comment at the top of stalled_peers.c\n");
    return 2;
}
