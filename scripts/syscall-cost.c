// Kernel cost of the system-call shapes Softwarp's data path can choose, on loopback TCP
// (issue 18, BENCHMARKS.md "Mid-size latency: what is left"). One thread writes and reads
// both ends of a connection; each figure is thread CPU time per call or per message
// (CLOCK_THREAD_CPUTIME_ID), which a busy machine inflates less than wall clock.
//
//   cc -O2 -o /tmp/syscall-cost scripts/syscall-cost.c && /tmp/syscall-cost 200000
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static double cpu(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static int a, b; // a writes, b (non-blocking) reads
static char src[1 << 20], dst[1 << 20], stage[65536], hdr[64], crc[8];

static void connect_pair(void) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in s = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000001)};
    socklen_t sl = sizeof s;
    if (bind(l, (void *)&s, sl) || listen(l, 1) || getsockname(l, (void *)&s, &sl)) exit(1);
    a = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(a, (void *)&s, sl)) exit(1);
    b = accept(l, 0, 0);
    close(l);
    int one = 1;
    setsockopt(a, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(b, F_SETFL, O_NONBLOCK);
}

static void write_all(const char *p, size_t n) {
    while (n > 0) {
        ssize_t r = write(a, p, n);
        if (r <= 0) exit(2);
        p += r;
        n -= (size_t)r;
    }
}

static void drain(size_t n) {
    for (long spins = 0; n > 0 && spins < 100000000; spins++) {
        ssize_t r = recv(b, dst, n < sizeof dst ? n : sizeof dst, 0);
        if (r > 0) n -= (size_t)r;
    }
}

// Reads an n-byte message queued on b: 0 one read; 1 an 80-byte read (a header and 64
// bytes), then the rest; 2 recv into a staging buffer, then memcpy out.
static double read_msg(size_t n, int how) {
    size_t o = 0;
    double t = cpu();
    if (how == 2) {
        while (o < n) {
            ssize_t r = recv(b, stage, sizeof stage, 0);
            if (r > 0) {
                memcpy(dst + o, stage, (size_t)r);
                o += (size_t)r;
            }
        }
        return cpu() - t;
    }
    if (how == 1) {
        for (;;) {
            struct iovec v[2] = {{hdr, 16}, {stage, 64}};
            ssize_t r = readv(b, v, 2);
            if (r > 0) {
                o = (size_t)r;
                break;
            }
        }
    }
    while (o < n) {
        struct iovec v[2] = {{dst + o, n - o}, {stage, 64}};
        ssize_t r = readv(b, v, 2);
        if (r > 0) o += (size_t)r;
    }
    return cpu() - t;
}

int main(int argc, char **argv) {
    int it = argc > 1 ? atoi(argv[1]) : 200000;
    connect_pair();
    // Empty polls (nothing queued: EAGAIN).
    double t0 = cpu();
    for (int i = 0; i < it; i++) {
        struct iovec v[2] = {{hdr, 16}, {stage, 64}};
        readv(b, v, 2);
    }
    double t1 = cpu();
    for (int i = 0; i < it; i++) {
        struct iovec v[2] = {{hdr, 16}, {stage, 64}};
        struct msghdr m = {.msg_iov = v, .msg_iovlen = 2};
        recvmsg(b, &m, 0);
    }
    double t2 = cpu();
    for (int i = 0; i < it; i++) recv(b, stage, 80, 0);
    double t3 = cpu();
    printf("empty poll: readv (2 iovecs) %.0f ns, recvmsg (2) %.0f ns, recv %.0f ns\n",
           (t1 - t0) / it, (t2 - t1) / it, (t3 - t2) / it);
    // One-buffer writes: send against sendmsg of one iovec.
    for (size_t n = 64; n <= 4096; n *= 64) {
        double ts = 0, tm = 0;
        for (int i = 0; i < it / 2; i++) {
            double x = cpu();
            send(a, src, n, MSG_NOSIGNAL);
            ts += cpu() - x;
            drain(n);
            struct iovec v[1] = {{src, n}};
            struct msghdr m = {.msg_iov = v, .msg_iovlen = 1};
            x = cpu();
            sendmsg(a, &m, MSG_NOSIGNAL);
            tm += cpu() - x;
            drain(n);
        }
        printf("%zu B write: send %.0f ns, sendmsg (1 iovec) %.0f ns\n", n, ts / (it / 2),
               tm / (it / 2));
    }
    // An FPDU's three pieces: gathered, or copied into one buffer and sent.
    for (size_t n = 4096; n <= 16384; n *= 4) {
        double tc = 0, tg = 0;
        for (int i = 0; i < it / 4; i++) {
            double x = cpu();
            memcpy(stage, hdr, 18);
            memcpy(stage + 18, src, n);
            memcpy(stage + 18 + n, crc, 4);
            send(a, stage, n + 22, MSG_NOSIGNAL);
            tc += cpu() - x;
            drain(n + 22);
            struct iovec v[3] = {{hdr, 18}, {src, n}, {crc, 4}};
            struct msghdr m = {.msg_iov = v, .msg_iovlen = 3};
            x = cpu();
            sendmsg(a, &m, MSG_NOSIGNAL);
            tg += cpu() - x;
            drain(n + 22);
        }
        printf("%zu B FPDU: copy + send %.0f ns, sendmsg (3 iovecs) %.0f ns\n", n,
               tc / (it / 4), tg / (it / 4));
    }
    // Reading a queued message: one read, a header read first, or staging and a copy.
    static const char *hows[] = {"one read", "80-byte read, then the rest", "recv + memcpy"};
    for (size_t n = 4096; n <= 65536; n *= 16) {
        for (int how = 0; how < 3; how++) {
            double rt = 0;
            for (int i = 0; i < it / 10; i++) {
                write_all(src, n);
                rt += read_msg(n, how);
            }
            printf("%zu B message, %s: %.0f ns\n", n, hows[how], rt / (it / 10));
        }
    }
    return 0;
}
