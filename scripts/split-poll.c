// One stream, a reader thread that waits in poll() (or epoll_wait with -e) before each read,
// a writer thread and an echo thread (-s: one thread writes and reads, a ping-pong). Prints the
// median, 99th percentile and largest round trip. Built and run by scripts/bench-split.sh.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int N = 2000, GAP = 200, use_epoll = 0, single = 0, lfd, sfd;
static uint64_t now_ns(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000ull + t.tv_nsec; }
static void rd(int fd, void *b, size_t n) { size_t g = 0; while (g < n) { ssize_t r = read(fd, (char *)b + g, n - g); if (r <= 0) { perror("read"); exit(1); } g += r; } }
static void wr(int fd, const void *b, size_t n) { size_t g = 0; while (g < n) { ssize_t r = write(fd, (const char *)b + g, n - g); if (r <= 0) { perror("write"); exit(1); } g += r; } }
static void *echo(void *a) { (void)a; sfd = accept(lfd, 0, 0); int one = 1; setsockopt(sfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); char b[16]; for (int i = 0; i < N; i++) { rd(sfd, b, 16); wr(sfd, b, 16); } return 0; }
static int cfd;
static void *writer(void *a) { (void)a; for (int i = 0; i < N; i++) { uint64_t t = now_ns(); char m[16] = {0}; memcpy(m, &t, 8); wr(cfd, m, 16); usleep(GAP); } return 0; }
static int cmp(const void *a, const void *b) { uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b; return x < y ? -1 : x > y; }
int main(int argc, char **argv) {
    for (int a = 1; a < argc; a++) { if (!strcmp(argv[a], "-e")) use_epoll = 1; if (!strcmp(argv[a], "-s")) { single = 1; N = 20000; } }
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    lfd = socket(AF_INET, SOCK_STREAM, 0); bind(lfd, (void *)&sa, sizeof sa); listen(lfd, 4); getsockname(lfd, (void *)&sa, &sl);
    pthread_t e, w; pthread_create(&e, 0, echo, 0);
    cfd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(cfd, (void *)&sa, sizeof sa)) { perror("connect"); return 1; }
    int one = 1; setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int ep = epoll_create1(0); struct epoll_event ev = {.events = EPOLLIN, .data.u64 = 7}; epoll_ctl(ep, EPOLL_CTL_ADD, cfd, &ev);
    uint64_t *lat = calloc(N, 8);
    if (!single) pthread_create(&w, 0, writer, 0);
    for (int i = 0; i < N; i++) {
        char b[16];
        if (single) { uint64_t t = now_ns(); char m[16] = {0}; memcpy(m, &t, 8); wr(cfd, m, 16); }
        if (use_epoll) { struct epoll_event o; if (epoll_wait(ep, &o, 1, -1) != 1) { perror("epoll_wait"); return 1; } }
        else { struct pollfd p = {.fd = cfd, .events = POLLIN}; if (poll(&p, 1, -1) != 1) { perror("poll"); return 1; } }
        rd(cfd, b, 16);
        uint64_t t; memcpy(&t, b, 8); lat[i] = now_ns() - t;
    }
    if (!single) pthread_join(w, 0);
    pthread_join(e, 0);
    qsort(lat, N, 8, cmp);
    int o1 = 0, o5 = 0, o15 = 0; for (int i = 0; i < N; i++) { o1 += lat[i] > 1000000; o5 += lat[i] > 5000000; o15 += lat[i] > 15000000; }
    printf("%s median=%lu p99=%lu max=%lu us; over 1 ms: %d, 5 ms: %d, 15 ms: %d\n", single ? (use_epoll ? "single-epoll" : "single-poll") : (use_epoll ? "epoll" : "poll"), lat[N / 2] / 1000, lat[N * 99 / 100] / 1000, lat[N - 1] / 1000, o1, o5, o15);
    return 0;
}
