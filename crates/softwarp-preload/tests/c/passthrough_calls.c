/* The preload library's pass-through cost, counted in instructions: one loopback TCP
 * connection, and N rounds of one kind of call on it, which the library hands to libc (the
 * program sets no option, so no socket is ours). scripts/preload-passthrough-instr.sh runs
 * it under callgrind with and without LD_PRELOAD at two values of N; the difference per
 * round is what the interposers add to each call.
 *
 *   passthrough_calls KIND N
 *     rw      write 1 byte, read it back (2 calls a round)
 *     sr      send, recv (2)
 *     poll    poll of the connection, no wait (1)
 *     select  select of the connection, no wait (1)
 *     epoll   epoll_wait, no wait, the connection registered (1)
 *
 * Exits 1 when a call fails or moves the wrong byte. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <unistd.h>

static void die(const char *what) {
    perror(what);
    exit(1);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: passthrough_calls rw|sr|poll|select|epoll N\n");
        return 2;
    }
    const char *kind = argv[1];
    long n = atol(argv[2]);
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = { .sin_family = AF_INET };
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 1) ||
        getsockname(l, (struct sockaddr *)&a, &len))
        die("listen");
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (c < 0 || connect(c, (struct sockaddr *)&a, sizeof a)) die("connect");
    int s = accept(l, NULL, NULL);
    if (s < 0) die("accept");
    int one = 1;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int ep = epoll_create1(0);
    struct epoll_event ev = { .events = EPOLLIN, .data.fd = s };
    if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev)) die("epoll");
    long bad = 0;
    for (long i = 0; i < n; i++) {
        char out = (char)i, in = 0;
        if (strcmp(kind, "rw") == 0) {
            if (write(c, &out, 1) != 1 || read(s, &in, 1) != 1) die("write/read");
            bad += in != out;
        } else if (strcmp(kind, "sr") == 0) {
            if (send(c, &out, 1, 0) != 1 || recv(s, &in, 1, 0) != 1) die("send/recv");
            bad += in != out;
        } else if (strcmp(kind, "poll") == 0) {
            struct pollfd p = { s, POLLIN, 0 };
            bad += poll(&p, 1, 0) != 0;
        } else if (strcmp(kind, "select") == 0) {
            fd_set r;
            FD_ZERO(&r);
            FD_SET(s, &r);
            struct timeval tv = { 0, 0 };
            bad += select(s + 1, &r, NULL, NULL, &tv) != 0;
        } else if (strcmp(kind, "epoll") == 0) {
            struct epoll_event got;
            bad += epoll_wait(ep, &got, 1, 0) != 0;
        } else {
            fprintf(stderr, "unknown kind %s\n", kind);
            return 2;
        }
    }
    if (bad) {
        fprintf(stderr, "%ld rounds went wrong\n", bad);
        return 1;
    }
    return 0;
}
