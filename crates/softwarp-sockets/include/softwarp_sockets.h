/*
 * softwarp_sockets.h: socket options of Softwarp's extended sockets.
 *
 * A program run with the preload library (LD_PRELOAD=libsoftwarp_preload.so, or
 * `softwarp exec --sockets -- PROGRAM`) switches a TCP socket into iWARP mode before
 * connect() or listen():
 *
 *     int one = 1;
 *     setsockopt(fd, SOL_SOFTWARP, SOFTWARP_IWARP_MODE, &one, sizeof one);
 *
 * Afterwards the connection's bytes travel as iWARP Sends (RDMAP/DDP/MPA over the same TCP
 * connection); read/write/poll/select/epoll work as on any socket. The peer must be in
 * iWARP mode too. Without the preload library the kernel refuses the level with
 * ENOPROTOOPT and the socket stays plain TCP, so a program can fall back.
 *
 * The numbers are those of the Rust crate softwarp-sockets (SOL_SOFTWARP, SO_IWARP_MODE,
 * SO_IWARP_ACTIVE).
 */
#ifndef SOFTWARP_SOCKETS_H
#define SOFTWARP_SOCKETS_H

/* setsockopt/getsockopt level: "SW" in ASCII (Linux's own levels are below 300). */
#define SOL_SOFTWARP 0x5357

/* int, 0 or 1: iWARP mode for this socket; set before connect() or listen(). */
#define SOFTWARP_IWARP_MODE 1

/* int, read-only: 1 while the connection runs over iWARP, 0 otherwise. */
#define SOFTWARP_IWARP_ACTIVE 2

#endif /* SOFTWARP_SOCKETS_H */
