/* A C program that opts in to iWARP mode through include/softwarp_sockets.h.
 *   iwarp_sum server PORT      accept one connection, read to EOF, answer the byte sum
 *   iwarp_sum client PORT LEN  send LEN pattern bytes, shut down writing, check the sum
 * Prints "mode=iwarp" or "mode=tcp" (no preload: setsockopt fails with ENOPROTOOPT). */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "softwarp_sockets.h"

static int opt_in(int fd) {
    int one = 1;
    if (setsockopt(fd, SOL_SOFTWARP, SOFTWARP_IWARP_MODE, &one, sizeof one) == 0) return 1;
    if (errno != ENOPROTOOPT) { perror("setsockopt"); exit(2); }
    return 0;
}

static void report(int fd) {
    int active = 0;
    socklen_t len = sizeof active;
    if (getsockopt(fd, SOL_SOFTWARP, SOFTWARP_IWARP_ACTIVE, &active, &len) != 0) active = 0;
    printf("mode=%s\n", active ? "iwarp" : "tcp");
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[2])) };
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    opt_in(fd);
    unsigned char buf[65536];
    if (strcmp(argv[1], "server") == 0) {
        int on = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
        if (bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 4)) { perror("listen"); return 1; }
        int c = accept(fd, NULL, NULL);
        if (c < 0) { perror("accept"); return 1; }
        report(c);
        uint64_t sum = 0, n = 0;
        for (;;) {
            ssize_t r = read(c, buf, sizeof buf);
            if (r < 0) { perror("read"); return 1; }
            if (r == 0) break;
            for (ssize_t i = 0; i < r; i++) sum += buf[i];
            n += r;
        }
        uint64_t out[2] = { n, sum };
        if (write(c, out, sizeof out) != sizeof out) { perror("write"); return 1; }
        close(c);
        close(fd);
        return 0;
    }
    long len = argc > 3 ? atol(argv[3]) : 1000000;
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) { perror("connect"); return 1; }
    report(fd);
    uint64_t sum = 0;
    for (long off = 0; off < len;) {
        long chunk = len - off < (long)sizeof buf ? len - off : (long)sizeof buf;
        for (long i = 0; i < chunk; i++) { buf[i] = (unsigned char)((off + i) * 7 + 3); sum += buf[i]; }
        ssize_t w = send(fd, buf, chunk, 0);
        if (w <= 0) { perror("send"); return 1; }
        off += w;
        if (w < chunk) { fprintf(stderr, "short send\n"); return 1; }
    }
    shutdown(fd, SHUT_WR);
    uint64_t in[2];
    size_t got = 0;
    while (got < sizeof in) {
        ssize_t r = recv(fd, (char *)in + got, sizeof in - got, 0);
        if (r <= 0) { perror("recv"); return 1; }
        got += r;
    }
    if (in[0] != (uint64_t)len || in[1] != sum) {
        fprintf(stderr, "mismatch: %lu bytes sum %lu, expected %ld sum %lu\n",
                (unsigned long)in[0], (unsigned long)in[1], len, (unsigned long)sum);
        return 1;
    }
    char extra;
    if (recv(fd, &extra, 1, 0) != 0) { fprintf(stderr, "no EOF\n"); return 1; }
    printf("ok %ld bytes\n", len);
    close(fd);
    return 0;
}
