// Issue 18 (BENCHMARKS.md, "Measured and not used": gathering MSS-sized FPDUs): 4 GiB over
// loopback TCP in `sendmsg` calls of 256 KiB, both threads busy-polling (MSG_DONTWAIT), in
// the shapes a sender of 1460-byte FPDUs could use:
//   mode 2: one 256 KiB buffer, nothing copied in user space (raw TCP's case);
//   mode 0: a 24-byte frame and 1,436 payload bytes copied into the buffer per FPDU, then
//           one buffer sent (what Softwarp's copy run does);
//   mode 1: the same FPDUs gathered, two iovecs each (frame, payload), 358 per call.
//   cc -O2 -pthread scripts/mss-gather.c -o /tmp/mss-gather && /tmp/mss-gather 0
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <time.h>
static int port = 47311;
static long total = 4L << 30;
static void *reader(void *arg) {
  int fd = *(int *)arg; char *b = malloc(1 << 20); long got = 0;
  while (got < total) { ssize_t n = recv(fd, b, 1 << 20, MSG_DONTWAIT); if (n == 0) break; if (n < 0) continue; got += n; }
  return NULL;
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
int main(int argc, char **argv) {
  int mode = atoi(argv[1]); // 0: one 256 KiB buffer copied from a source (memcpy+send); 1: gather 2 iovecs per FPDU; 2: one buffer, no memcpy
  int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port + mode), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  bind(l, (void *)&a, sizeof a); listen(l, 1);
  int c = socket(AF_INET, SOCK_STREAM, 0); connect(c, (void *)&a, sizeof a);
  int s = accept(l, NULL, NULL); pthread_t th; pthread_create(&th, NULL, reader, &s);
  size_t batch = 256 << 10; char *src = aligned_alloc(4096, 1 << 20); memset(src, 1, 1 << 20);
  char *buf = aligned_alloc(4096, batch); char hdr[4096]; memset(hdr, 2, sizeof hdr);
  struct iovec iov[1024]; int pay = 1436, fr = 24; long sent = 0; double t0 = now(); long off = 0;
  while (sent < total) {
    struct msghdr m = {0}; size_t len = 0; int n = 0;
    if (mode == 1) {
      while (len + pay + fr <= batch && n < 1020) {
        iov[n].iov_base = hdr + (n % 100) * 24; iov[n].iov_len = fr; n++;
        iov[n].iov_base = src + off; iov[n].iov_len = pay; n++;
        off = (off + pay) % ((1 << 20) - 4096); len += pay + fr;
      }
    } else {
      size_t k = 0;
      while (k + pay + fr <= batch) { if (mode == 0) { memcpy(buf + k, hdr, fr); memcpy(buf + k + fr, src + off, pay); } off = (off + pay) % ((1 << 20) - 4096); k += pay + fr; }
      iov[0].iov_base = buf; iov[0].iov_len = k; n = 1; len = k;
    }
    m.msg_iov = iov; m.msg_iovlen = n;
    size_t done = 0;
    while (done < len) { ssize_t r = sendmsg(c, &m, MSG_DONTWAIT); if (r < 0) continue; if (r == 0) return 1; done += r;
      // advance iovecs
      size_t rr = r; while (rr && m.msg_iovlen) { if (rr >= m.msg_iov[0].iov_len) { rr -= m.msg_iov[0].iov_len; m.msg_iov++; m.msg_iovlen--; } else { m.msg_iov[0].iov_base = (char *)m.msg_iov[0].iov_base + rr; m.msg_iov[0].iov_len -= rr; rr = 0; } } }
    sent += len;
  }
  double t = now() - t0; shutdown(c, SHUT_WR); pthread_join(th, NULL);
  printf("mode %d: %.2f GB/s\n", mode, sent / t / 1e9);
  return 0;
}
