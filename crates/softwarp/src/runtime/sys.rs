//! Thin wrappers over the system calls the runtime needs and the standard library does not
//! offer: through `rustix` and `socket2` where they have the call, and raw `libc` only for
//! `readv`/`recv`/`sendmsg`/`send`, made through `syscall(2)` to skip glibc's cancellation
//! wrappers (the only `unsafe` code of this module; the crate's others are the tokio
//! registration in `aio` and `reg_mr_raw`).
//!
//! - [`read_region_staged`] / [`read_buf_staged`] (`readv`, or `recv` when one buffer is
//!   left) and [`write_pieces`] (`sendmsg`, or `send` for one piece): iovecs built from the raw
//!   pointers of the engine's receive target and transmit gather list (ranges of registered
//!   regions, or buffers inside the QP), so no Rust reference to memory the network shares
//!   is ever created: the kernel copies straight between the socket and that memory.
//!   `rustix` and `socket2` take `IoSlice`/`IoSliceMut`, which are Rust references: they
//!   cannot be used here (see the memory model in `softwarp_engine::memory`).
//! - An [`EventFd`] (Linux `eventfd(2)`) for completion channels: a pollable counter.
//! - [`poll_readable`]: wait with a timeout until a file descriptor is readable.
//! - [`tcp_maxseg`]: the TCP maximum segment size of a connected socket (`TCP_MAXSEG`).
//! - [`set_linger_zero`] (abortive close) and [`set_listen_backlog`] for the connection
//!   manager.
//!
//! Every `unsafe` block states why it is sound in a `// SAFETY:` comment.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::Duration;

use arrayvec::ArrayVec;
use softwarp_engine::memory::Region;
use softwarp_engine::qp::ReadDest;
use softwarp_engine::qp::TxPiece;

/// Most iovecs one `writev` takes here: the engine's largest gather list.
const MAX_IOV: usize = softwarp_engine::qp::GATHER_PIECES;

/// `readv(2)` into `first` (a buffer inside the engine) and then `stage`: the bytes
/// beyond `first.len()` land in `stage`. Returns the bytes read (0 at end of stream).
pub(crate) fn read_buf_staged(
    fd: BorrowedFd<'_>,
    first: &mut [u8],
    stage: &mut [u8],
) -> io::Result<usize> {
    let iov = [
        libc::iovec {
            iov_base: first.as_mut_ptr().cast(),
            iov_len: first.len(),
        },
        libc::iovec {
            iov_base: stage.as_mut_ptr().cast(),
            iov_len: stage.len(),
        },
    ];
    readv(fd, &iov)
}

/// `readv(2)` of at most `len` bytes straight into `region` at `offset` (bounds-checked
/// as in [`read_region`]) and then into `stage`.
pub(crate) fn read_region_staged(
    fd: BorrowedFd<'_>,
    region: &Region,
    offset: usize,
    len: usize,
    stage: &mut [u8],
) -> io::Result<usize> {
    let ptr = region
        .ptr_range(offset, len)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let iov = [
        libc::iovec {
            iov_base: ptr.cast(),
            iov_len: len,
        },
        libc::iovec {
            iov_base: stage.as_mut_ptr().cast(),
            iov_len: stage.len(),
        },
    ];
    readv(fd, &iov)
}

/// `readv(2)` of three buffers: `head` (inside the engine), `dest` (a buffer, or at most
/// `len` bytes straight into a region at an offset, bounds-checked as in [`read_region`]),
/// then `tail`: the engine's early read of a Send's payload.
pub(crate) fn read_around(
    fd: BorrowedFd<'_>,
    head: &mut [u8],
    dest: ReadDest<'_>,
    tail: &mut [u8],
) -> io::Result<usize> {
    let (ptr, len): (*mut u8, usize) = match dest {
        ReadDest::Buffer(b) => (b.as_mut_ptr(), b.len()),
        ReadDest::Region {
            region,
            offset,
            len,
        } => (
            region
                .ptr_range(offset, len)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?,
            len,
        ),
    };
    let iov = [
        libc::iovec {
            iov_base: head.as_mut_ptr().cast(),
            iov_len: head.len(),
        },
        libc::iovec {
            iov_base: ptr.cast(),
            iov_len: len,
        },
        libc::iovec {
            iov_base: tail.as_mut_ptr().cast(),
            iov_len: tail.len(),
        },
    ];
    readv(fd, &iov)
}

/// The data-path calls below (`recv`, `readv`, `send`, `sendmsg`) go through `syscall(2)`
/// with their raw numbers: glibc's named wrappers are POSIX cancellation points and, in a
/// process with more than one thread (every Softwarp process: the progress thread), wrap
/// each call in `__pthread_enable_asynccancel`/`__pthread_disable_asynccancel`, about 40
/// user-space instructions per call. Softwarp never cancels threads; the system calls and
/// their results (and `errno` on failure) are the same.
///
/// `readv(2)` of the iovecs, skipping empty ones (an all-empty list reads nothing). A
/// single non-empty iovec is read with `recv(2)` instead: the same bytes, and on this
/// kernel 130 ns less per call (about 325 against 460 ns for an empty poll; `readv` goes
/// through the file layer's checks and imports an iovec array, `recv` takes one user
/// buffer). The descriptor is a connected TCP socket (the QP's stream).
fn readv<const N: usize>(fd: BorrowedFd<'_>, iov: &[libc::iovec; N]) -> io::Result<usize> {
    let mut full = iov.iter().enumerate().filter(|(_, v)| v.iov_len > 0);
    let Some((first, _)) = full.next() else {
        return Ok(0);
    };
    let n = if full.next().is_some() { N - first } else { 1 };
    let r = if n == 1 {
        let one = iov[first];
        // SAFETY: `one` names memory valid for writes of `iov_len` bytes for the whole
        // call (as below); `fd` is a live borrowed descriptor.
        unsafe {
            libc::syscall(
                libc::SYS_recvfrom,
                libc::c_long::from(fd.as_raw_fd()),
                one.iov_base,
                one.iov_len,
                0 as libc::c_long,
                std::ptr::null_mut::<libc::sockaddr>(),
                std::ptr::null_mut::<libc::socklen_t>(),
            ) as isize
        }
    } else {
        // SAFETY: each iovec names memory valid for writes of its length for the whole
        // call: a `&mut [u8]` borrowed by the caller, or a range of a region checked by
        // `Region::ptr_range` and kept alive by the caller's borrow (the kernel writes it
        // through a raw pointer; no Rust reference to region memory exists). `iov` lives
        // across the call and `fd` is a live borrowed descriptor.
        unsafe {
            libc::syscall(
                libc::SYS_readv,
                libc::c_long::from(fd.as_raw_fd()),
                iov[first..].as_ptr(),
                n as libc::c_long,
            ) as isize
        }
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// `writev(2)` of an FPDU's gather list (as `sendmsg(2)` with `MSG_NOSIGNAL`, so a reset
/// peer yields `EPIPE` instead of `SIGPIPE`). Returns the bytes written.
///
/// Safe to call: byte pieces are borrowed slices; region pieces are bounds-checked ranges of
/// regions the `TxPiece` borrows for the call. At most `GATHER_PIECES` (80) pieces are written
/// per call, or `RUN_GATHER_PIECES` (400) when more are given (a gathered run).
pub(crate) fn write_pieces(fd: BorrowedFd<'_>, pieces: &[TxPiece<'_>]) -> io::Result<usize> {
    if pieces.len() > MAX_IOV {
        return write_pieces_long(fd, pieces);
    }
    write_pieces_in::<MAX_IOV>(fd, pieces)
}

/// [`write_pieces`] of a gathered run of MSS-sized FPDUs (up to
/// `softwarp_engine::qp::RUN_GATHER_PIECES` pieces, two per FPDU): out of line, so that its
/// 6 KiB of iovecs are on the stack only for such calls.
#[inline(never)]
fn write_pieces_long(fd: BorrowedFd<'_>, pieces: &[TxPiece<'_>]) -> io::Result<usize> {
    write_pieces_in::<{ softwarp_engine::qp::RUN_GATHER_PIECES }>(fd, pieces)
}

/// [`write_pieces`] with room for `N` iovecs (the pieces past them are not written).
#[inline(always)]
fn write_pieces_in<const N: usize>(
    fd: BorrowedFd<'_>,
    pieces: &[TxPiece<'_>],
) -> io::Result<usize> {
    // Only the slots used are written: no 1.3 KiB of iovecs zeroed per call.
    let mut iov = ArrayVec::<libc::iovec, N>::new();
    for piece in pieces.iter().filter(|p| !p.is_empty()) {
        let (ptr, len) = match piece {
            TxPiece::Bytes(b) => (b.as_ptr(), b.len()),
            TxPiece::Region {
                region,
                offset,
                len,
            } => (
                region
                    .ptr_range(*offset, *len)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?
                    .cast_const(),
                *len,
            ),
        };
        let slot = libc::iovec {
            iov_base: ptr.cast_mut().cast(),
            iov_len: len,
        };
        if iov.try_push(slot).is_err() {
            break;
        }
    }
    let n = iov.len();
    if n == 0 {
        return Ok(0);
    }
    if let [one] = iov.as_slice() {
        // One piece (a batch of coalesced FPDUs, most small messages): `send(2)` writes
        // the same bytes without copying a `msghdr` and importing an iovec array, about
        // 170 ns less per call on this kernel.
        // SAFETY: `one` names memory readable for `iov_len` bytes for the whole call (a
        // slice or a bounds-checked region range borrowed by `pieces`, as below); the
        // kernel only reads it. `fd` is a live descriptor borrowed for the call.
        let r = unsafe {
            libc::syscall(
                libc::SYS_sendto,
                libc::c_long::from(fd.as_raw_fd()),
                one.iov_base.cast_const(),
                one.iov_len,
                libc::c_long::from(libc::MSG_NOSIGNAL),
                std::ptr::null::<libc::sockaddr>(),
                0 as libc::c_long,
            ) as isize
        };
        return if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as usize)
        };
    }
    // SAFETY: an all-zero msghdr is a valid "no address, no control data" header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = n as _;
    // SAFETY: `msg` points at `n` iovecs that each name readable memory for the whole call:
    // a slice borrowed by `pieces`, or a bounds-checked range of a region borrowed by
    // `pieces` (valid for reads while borrowed). The kernel only reads them. `fd` is a live
    // descriptor borrowed for the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sendmsg,
            libc::c_long::from(fd.as_raw_fd()),
            &msg as *const libc::msghdr,
            libc::c_long::from(libc::MSG_NOSIGNAL),
        ) as isize
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// `TCP_MAXSEG` of a connected TCP socket: the maximum segment size in force.
pub(crate) fn tcp_maxseg(fd: BorrowedFd<'_>) -> io::Result<usize> {
    let mss = socket2::SockRef::from(&fd).tcp_mss()?;
    usize::try_from(mss).map_err(|_| io::Error::other("TCP_MAXSEG out of range"))
}

/// `TCP_USER_TIMEOUT`: how long sent data may stay unacknowledged (or unsent behind a zero
/// window) before the kernel drops the connection.
pub(crate) fn set_tcp_user_timeout(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<()> {
    socket2::SockRef::from(&fd).set_tcp_user_timeout(Some(timeout))
}

/// TCP keepalive on: `SO_KEEPALIVE`, and `TCP_KEEPIDLE`, `TCP_KEEPINTVL`, `TCP_KEEPCNT`
/// (whole seconds; the kernel refuses 0).
pub(crate) fn set_tcp_keepalive(
    fd: BorrowedFd<'_>,
    idle: Duration,
    interval: Duration,
    count: u32,
) -> io::Result<()> {
    let k = socket2::TcpKeepalive::new()
        .with_time(idle)
        .with_interval(interval)
        .with_retries(count);
    socket2::SockRef::from(&fd).set_tcp_keepalive(&k)
}

/// Adds `fd` to the epoll set `epfd` for readability (level-triggered), with `data`.
pub(crate) fn epoll_add_readable(
    epfd: BorrowedFd<'_>,
    fd: BorrowedFd<'_>,
    data: u64,
) -> io::Result<()> {
    use rustix::event::epoll;
    Ok(epoll::add(
        epfd,
        fd,
        epoll::EventData::new_u64(data),
        epoll::EventFlags::IN,
    )?)
}

/// Sets `SO_LINGER` to on with a zero timeout: closing the socket then resets the
/// connection (RST) instead of the orderly FIN exchange.
pub(crate) fn set_linger_zero(fd: BorrowedFd<'_>) -> io::Result<()> {
    Ok(rustix::net::sockopt::set_socket_linger(
        fd,
        Some(Duration::ZERO),
    )?)
}

/// `listen(2)` again on a listening socket: on Linux this changes its backlog (the standard
/// library always uses 128).
pub(crate) fn set_listen_backlog(fd: BorrowedFd<'_>, backlog: u32) -> io::Result<()> {
    let backlog = i32::try_from(backlog).unwrap_or(i32::MAX);
    Ok(rustix::net::listen(fd, backlog)?)
}

/// Connections waiting in the accept queue of a listening TCP socket: for a socket in the
/// LISTEN state Linux reports the queue's length in `TCP_INFO`'s `tcpi_unacked` (what `ss
/// -l` shows as Recv-Q).
pub(crate) fn accept_queue_len(fd: BorrowedFd<'_>) -> io::Result<u32> {
    // struct tcp_info: 8 one-byte fields, then u32 rto, ato, snd_mss, rcv_mss, unacked.
    const UNACKED: usize = 24;
    let mut buf = [0u8; 32];
    let n = softwarp_ras::sys::tcp_info_raw(fd, &mut buf)?;
    match buf.get(UNACKED..UNACKED + 4) {
        Some(b) if n >= UNACKED + 4 => Ok(u32::from_ne_bytes([b[0], b[1], b[2], b[3]])),
        _ => Err(io::Error::other("TCP_INFO too short")),
    }
}

/// Bytes of the TCP connection `fd` that the peer has not acknowledged yet, sent or not
/// (`TCP_INFO`'s `tcpi_unacked` segments and `tcpi_notsent_bytes`): nonzero while the
/// peer's receive window holds our last bytes back. An error reads as zero.
pub(crate) fn unacknowledged(fd: BorrowedFd<'_>) -> u64 {
    // struct tcp_info: `tcpi_unacked` (segments) at 24, `tcpi_notsent_bytes` at 144.
    const UNACKED: usize = 24;
    const NOTSENT: usize = 144;
    let mut buf = [0u8; 160];
    let Ok(n) = softwarp_ras::sys::tcp_info_raw(fd, &mut buf) else {
        return 0;
    };
    let word = |at: usize| match buf.get(at..at + 4) {
        Some(b) if n >= at + 4 => u64::from(u32::from_ne_bytes([b[0], b[1], b[2], b[3]])),
        _ => 0,
    };
    word(UNACKED) + word(NOTSENT)
}

/// Waits until `fd` is readable or `timeout` passes (`None`: no limit). Returns true when
/// readable (or in error/hang-up: a read will then not block).
pub(crate) fn poll_readable(fd: BorrowedFd<'_>, timeout: Option<Duration>) -> io::Result<bool> {
    use rustix::event::{PollFd, PollFlags, Timespec};
    // A timeout too long for a timespec waits without a bound.
    let ts = timeout.and_then(|d| Timespec::try_from(d).ok());
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    loop {
        match rustix::event::poll(&mut fds, ts.as_ref()) {
            Ok(n) => return Ok(n > 0),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Waits until one of `fds` is readable or `timeout` passes (`None`: no limit); as
/// [`poll_readable`] for several descriptors (a blocking listener and the connections whose
/// MPA Requests it is reading).
pub(crate) fn poll_any_readable(
    fds: &[BorrowedFd<'_>],
    timeout: Option<Duration>,
) -> io::Result<()> {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let ts = timeout.and_then(|d| Timespec::try_from(d).ok());
    let mut polled: Vec<PollFd<'_>> = fds
        .iter()
        .map(|fd| PollFd::new(fd, PollFlags::IN))
        .collect();
    loop {
        match rustix::event::poll(&mut polled, ts.as_ref()) {
            Ok(_) => return Ok(()),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// True when a `poll(2)` with no wait reports `fd` writable (or in error or hung up: a
/// write then does not block either). TCP answers from `tcp_poll` without the socket lock,
/// and says writable only once the free send space is at least half of what is queued, so
/// a writer gated by it writes in large pieces instead of trickling into a nearly full
/// socket; a failed `poll` says writable (the write then reports the error).
pub(crate) fn writable_now(fd: BorrowedFd<'_>) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(&fd, PollFlags::OUT)];
    !matches!(
        rustix::event::poll(&mut fds, Some(&Timespec::default())),
        Ok(0)
    )
}

/// True when the peer of the TCP connection `fd` has closed its side (its FIN arrived:
/// `POLLRDHUP`, set even while bytes before the FIN are still unread) or reset it
/// (`POLLHUP`, `POLLERR`), asked without waiting.
pub(crate) fn peer_hung_up(fd: BorrowedFd<'_>) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(&fd, PollFlags::RDHUP)];
    matches!(rustix::event::poll(&mut fds, Some(&Timespec::default())), Ok(n) if n > 0)
        && fds[0]
            .revents()
            .intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR)
}

/// A Linux eventfd in non-blocking mode: a counter that is readable while non-zero.
#[derive(Debug)]
pub(crate) struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// Creates a non-blocking, close-on-exec eventfd with counter 0.
    pub(crate) fn new() -> io::Result<Self> {
        use rustix::event::{eventfd, EventfdFlags};
        let fd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        Ok(Self { fd })
    }

    /// Adds 1 to the counter (makes the descriptor readable).
    pub(crate) fn signal(&self) -> io::Result<()> {
        match rustix::io::write(&self.fd, &1u64.to_ne_bytes()) {
            // EAGAIN: the counter is at its maximum, so the fd is readable anyway.
            Ok(_) | Err(rustix::io::Errno::AGAIN) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Resets the counter to 0 (the descriptor stops being readable). Returns the old value.
    pub(crate) fn drain(&self) -> io::Result<u64> {
        let mut v = [0u8; 8];
        match rustix::io::read(&self.fd, &mut v) {
            Ok(8) => Ok(u64::from_ne_bytes(v)),
            Ok(_) => Err(io::Error::other("short read of an eventfd")),
            Err(rustix::io::Errno::AGAIN) => Ok(0),
            Err(e) => Err(e.into()),
        }
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn eventfd_is_readable_after_signal_and_not_after_drain() {
        let e = EventFd::new().unwrap();
        assert!(!poll_readable(e.as_fd(), Some(Duration::ZERO)).unwrap());
        e.signal().unwrap();
        e.signal().unwrap();
        assert!(poll_readable(e.as_fd(), Some(Duration::ZERO)).unwrap());
        assert_eq!(e.drain().unwrap(), 2);
        assert!(!poll_readable(e.as_fd(), Some(Duration::from_millis(1))).unwrap());
        assert_eq!(e.drain().unwrap(), 0);
    }

    #[test]
    fn write_pieces_and_read_region_move_bytes_without_copies() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let src = Region::new_zeroed(1000).unwrap();
        src.fill(0, 1000, 7).unwrap();
        let pieces = [
            TxPiece::Bytes(b"head"),
            TxPiece::Bytes(&[]),
            TxPiece::Region {
                region: &src,
                offset: 0,
                len: 1000,
            },
        ];
        assert_eq!(write_pieces(a.as_fd(), &pieces).unwrap(), 1004);
        let mut head = [0u8; 4];
        b.read_exact(&mut head).unwrap();
        assert_eq!(&head, b"head");
        let dst = Region::new_zeroed(2000).unwrap();
        let mut got = 0;
        while got < 1000 {
            got += read_region_staged(b.as_fd(), &dst, 500 + got, 1000 - got, &mut []).unwrap();
        }
        let mut out = vec![0u8; 2000];
        dst.read_at(0, &mut out).unwrap();
        assert!(out[..500].iter().all(|&x| x == 0));
        assert!(out[500..1500].iter().all(|&x| x == 7));
        assert!(out[1500..].iter().all(|&x| x == 0));
        assert!(
            read_region_staged(b.as_fd(), &dst, 1999, 2, &mut []).is_err(),
            "out of bounds is refused"
        );
        assert!(tcp_maxseg(a.as_fd()).unwrap() > 0);
    }

    #[test]
    fn write_pieces_takes_short_and_long_gather_lists() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        // Lists longer than MAX_IOV are gathered runs: up to RUN_GATHER_PIECES go in one call.
        let run = softwarp_engine::qp::RUN_GATHER_PIECES;
        let words: Vec<[u8; 2]> = (0..run + 50).map(|i| [i as u8, (i >> 8) as u8]).collect();
        let pieces: Vec<TxPiece<'_>> = words.iter().map(|w| TxPiece::Bytes(w)).collect();
        for n in [1, 2, 4, 5, MAX_IOV, 90, run, run + 50] {
            let want = 2 * n.min(run);
            assert_eq!(write_pieces(a.as_fd(), &pieces[..n]).unwrap(), want);
            let mut got = vec![0u8; want];
            b.read_exact(&mut got).unwrap();
            let expect: Vec<u8> = words[..n.min(run)].concat();
            assert_eq!(got, expect, "{n} pieces");
        }
    }

    #[test]
    fn staged_reads_fill_the_target_first_then_the_staging_buffer() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let src = Region::new_zeroed(100).unwrap();
        for i in 0..100u8 {
            src.write_at(usize::from(i), &[i]).unwrap();
        }
        let all = TxPiece::Region {
            region: &src,
            offset: 0,
            len: 100,
        };
        assert_eq!(write_pieces(a.as_fd(), &[all]).unwrap(), 100);
        std::thread::sleep(Duration::from_millis(20));
        let mut first = [0u8; 4];
        let mut stage = [0u8; 10];
        assert_eq!(
            read_buf_staged(b.as_fd(), &mut first, &mut stage).unwrap(),
            14
        );
        assert_eq!(first, [0, 1, 2, 3]);
        assert_eq!(stage, [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]);
        let dst = Region::new_zeroed(50).unwrap();
        let mut stage = [0u8; 64];
        let n = read_region_staged(b.as_fd(), &dst, 10, 40, &mut stage).unwrap();
        assert_eq!(n, 86);
        let mut placed = [0u8; 40];
        dst.read_at(10, &mut placed).unwrap();
        assert!(placed.iter().enumerate().all(|(i, &x)| x == 14 + i as u8));
        assert!(stage[..46]
            .iter()
            .enumerate()
            .all(|(i, &x)| x == 54 + i as u8));
        assert_eq!(read_buf_staged(b.as_fd(), &mut [], &mut []).unwrap(), 0);
    }
}
