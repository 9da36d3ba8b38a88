//! `LD_PRELOAD` library: unmodified socket programs over Softwarp's iWARP streams
//! ([`softwarp_sockets`]).
//!
//! ```sh
//! LD_PRELOAD=libsoftwarp_preload.so SOFTWARP_SOCKETS=all socat ...
//! ```
//!
//! Pass-through is the default: a socket goes iWARP only when the program sets
//! `setsockopt(fd, SOL_SOFTWARP, SO_IWARP_MODE, &one, sizeof one)` before `connect` or
//! `listen` (`crates/softwarp-sockets/include/softwarp_sockets.h`), or when `SOFTWARP_SOCKETS=all` says every TCP
//! socket should (within `SOFTWARP_SOCKETS_PORTS` / `SOFTWARP_SOCKETS_DENY_PORTS`, see
//! [`config`]). Both ends must be iWARP: a connection whose peer does not answer the MPA
//! exchange fails (`ECONNREFUSED` on connect, unless `SOFTWARP_SOCKETS_FALLBACK=tcp`
//! connects again over plain TCP; `ECONNRESET` at the first use of an accepted one, unless
//! the fallback, seeing no MPA Request, leaves it plain TCP).
//!
//! With `SOFTWARP_SOCKETS_PROTOCOL=rsocket` a switched socket speaks rdma-core's rsocket
//! protocol instead, through `softwarp-verbs`' `rsocket` module (the one copy of that
//! protocol): the program's descriptor becomes a duplicate of the rsocket's number, every
//! entry point calls the rsocket's (see "rsocket's protocol" in the source), and `poll`,
//! `select` and `epoll` answer from `rpoll`'s per-socket readiness and sleep on each
//! rsocket's wake-up descriptor. It reaches programs under rdma-core's `librspreload.so`.
//!
//! # How an iWARP socket's descriptor becomes readable
//!
//! After the MPA exchange the QP owns the TCP socket (a duplicate of the program's
//! descriptor), and the program's descriptor number is made (with `dup3`) a duplicate of the
//! connection's **completion channel**, an eventfd that the stack signals when an armed CQ
//! gets a completion. So the number the program holds stays valid, `close` and `dup` work on
//! it, and the kernel wakes `poll`/`select`/`epoll_wait` when a message or a send
//! completion arrives, with no thread or socketpair of ours. The eventfd says "something
//! happened", not "a read will not block" (bytes may still wait in the receive ring after a
//! partial read; a send completion is not data), so `poll`, `select` and `epoll_wait` are
//! intercepted too: for an iWARP descriptor they ask the stream (a
//! [`softwarp_sockets::StreamWaiter`]'s `arm_readiness`: data, EOF or error to read; credits
//! and a free slot to write) and wait on the eventfd only when nothing is ready, beside the
//! waiter's kick descriptor (another thread's call on the stream may consume the eventfd's
//! wake-up: it then kicks the waiting threads), in slices of at most 50 ms. A socketpair fed
//! by the library was the alternative; it needs a thread to feed it and a copy of every byte.
//!
//! # Socket semantics, as the kernel's TCP
//!
//! - A non-blocking `connect` returns `EINPROGRESS`; the MPA exchange (a
//!   [`softwarp_sockets::Handshake`]) advances as its bytes arrive, whenever the program
//!   looks at the socket (`poll`, `select`, `epoll_wait`, `getsockopt(SO_ERROR)`, I/O), and
//!   none of these waits for it; once it is done the socket is writable and `SO_ERROR` is 0,
//!   or the error (`ECONNREFUSED` when nobody listens, the peer does not answer MPA, or the
//!   exchange stalled for the connect timeout, 5 s). A second `connect` meanwhile:
//!   `EALREADY`. An accepted connection's exchange starts at the program's first look and
//!   advances the same way: not ready (`EAGAIN`) until it is done, a reset (`ECONNRESET`)
//!   if it fails. A blocking call on such a socket waits for the exchange, at most its
//!   deadline and `SO_RCVTIMEO`/`SO_SNDTIMEO`. While it runs, the program's epoll sets watch
//!   the socket edge-triggered (each arrival wakes `epoll_wait` once, which advances the
//!   exchange) and every wait looks again at least every 50 ms (deadlines, an exchange
//!   another thread ended): see `finish` and `epoll_ctl` in the source.
//! - `SO_RCVTIMEO` / `SO_SNDTIMEO`: a blocking read or write that waited that long fails
//!   with `EAGAIN` (or returns the bytes it moved).
//! - A signal interrupting a blocking read or write: `EINTR`, or the call restarts when
//!   every caught signal's handler has `SA_RESTART` (see `restart_after_signal` in the source).
//!   `poll`, `select` and `epoll_wait` always return `EINTR`, as the kernel's.
//! - `MSG_PEEK` (with `MSG_DONTWAIT`, `MSG_WAITALL`), `MSG_WAITALL`.
//! - `MSG_MORE` and `TCP_CORK` hold small writes in the stream (`IwarpStream::set_cork`,
//!   `write_more_with`); `TCP_CORK` and `TCP_NODELAY` are the stream's, never set on the
//!   connection's TCP socket.
//! - A write after the peer closed or after `shutdown(SHUT_WR)`: `EPIPE` and `SIGPIPE`
//!   (none with `MSG_NOSIGNAL`); after a reset `ECONNRESET`.
//! - `epoll`: level-triggered, `EPOLLET` (an event is reported once per change: data, the
//!   EOF, room to write, an error), `EPOLLONESHOT`; `EPOLLRDHUP`/`POLLRDHUP` after the
//!   peer's EOF, `POLLHUP` once both directions are closed, `POLLERR` after a failure.
//!
//! # Limits
//!
//! `sendfile` to a stream reads the file into a buffer (at most 1 MiB a call) and writes it;
//! `sendmmsg`/`recvmmsg` are `sendmsg`/`recvmsg` per message (the `recvmmsg` timeout as the
//! kernel applies it: looked at after each message). Not intercepted: `splice` (`vmsplice`,
//! `tee`). After `fork`, the child's copies of the parent's iWARP streams fail with `EIO`
//! and one line on stderr (closing them is fine; the parent's keep working); connections
//! accepted but not used yet, and new sockets, work in the child.
//!
//! # Pass-through
//!
//! A data call on a descriptor that is not ours (`dispatch`, inlined into each interposer)
//! loads the descriptor's byte in the table's 64 Ki-entry bitmap and libc's function
//! pointer cached at its first use, and jumps to it; `poll`, `select` (and their `p`
//! forms) jump to libc while no descriptor is ours, `epoll_wait` while no registration
//! exists. `scripts/preload-passthrough-instr.sh` counts what each call adds (9-17
//! instructions).
//!
//! `unsafe` is confined to this file: every block is a call through libc's ABI.
#![allow(unsafe_code)]
// The exported functions are libc's, with libc's contracts (see their man pages).
#![allow(clippy::missing_safety_doc)]
#![deny(clippy::arithmetic_side_effects)]

pub mod config;
mod table;

use std::ffi::{c_int, c_void};
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use libc::{
    epoll_event, fd_set, iovec, msghdr, nfds_t, pollfd, size_t, sockaddr, socklen_t, ssize_t,
    timespec, timeval,
};
use softwarp_sockets::{
    Handshake, IwarpOptions, IwarpStream, Readiness, Side, StreamWaiter, SOL_SOFTWARP,
    SO_IWARP_ACTIVE, SO_IWARP_MODE,
};

use config::{Mode, Protocol};
use softwarp_verbs::rsocket as rsock;
use table::{Entry, RsocketEntry, StreamEntry};

/// Longest wait on an iWARP descriptor's eventfd before looking at the stream again.
const SLICE: Duration = Duration::from_millis(50);

// ---- the real functions -----------------------------------------------------------------

/// `real!(real_read, c"read", fn(...) -> ...)`: `real_read()` is libc's `read` (resolved at
/// the first call), `real_read::cached()` the same once resolved (`None` before), for the
/// pass-through's fast path.
macro_rules! real {
    ($name:ident, $sym:literal, fn($($arg:ty),* $(,)?) -> $ret:ty) => {
        mod $name {
            use super::*;

            pub static P: AtomicUsize = AtomicUsize::new(0);

            // Only the calls with a pass-through fast path use it.
            #[allow(dead_code)]
            #[inline(always)]
            pub fn cached() -> Option<unsafe extern "C" fn($($arg),*) -> $ret> {
                let p = P.load(Ordering::Relaxed);
                // SAFETY: a non-zero `p` is the address of the next definition of this libc
                // function ([`resolve`]), whose C prototype is the one spelled here.
                (p != 0).then(|| unsafe {
                    std::mem::transmute::<usize, unsafe extern "C" fn($($arg),*) -> $ret>(p)
                })
            }
        }

        #[inline]
        fn $name() -> unsafe extern "C" fn($($arg),*) -> $ret {
            let mut p = $name::P.load(Ordering::Relaxed);
            if p == 0 {
                p = resolve(&$name::P, $sym);
            }
            // SAFETY: `p` is the address of the next definition of this libc function, whose
            // C prototype is the one spelled here.
            unsafe { std::mem::transmute::<usize, unsafe extern "C" fn($($arg),*) -> $ret>(p) }
        }
    };
}

/// The address of the next definition of `sym` (libc's), kept in `slot`: the first call of
/// each `real_*` function.
#[cold]
#[inline(never)]
fn resolve(slot: &AtomicUsize, sym: &std::ffi::CStr) -> usize {
    // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated symbol name; it only reads the
    // loader's tables.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, sym.as_ptr()) } as usize;
    if p == 0 {
        eprintln!("softwarp preload: libc has no {sym:?}");
        std::process::abort();
    }
    slot.store(p, Ordering::Relaxed);
    p
}

real!(real_socket, c"socket", fn(c_int, c_int, c_int) -> c_int);
real!(
    real_connect,
    c"connect",
    fn(c_int, *const sockaddr, socklen_t) -> c_int
);
real!(real_listen, c"listen", fn(c_int, c_int) -> c_int);
real!(
    real_accept4,
    c"accept4",
    fn(c_int, *mut sockaddr, *mut socklen_t, c_int) -> c_int
);
real!(
    real_read,
    c"read",
    fn(c_int, *mut c_void, size_t) -> ssize_t
);
real!(
    real_write,
    c"write",
    fn(c_int, *const c_void, size_t) -> ssize_t
);
real!(
    real_readv,
    c"readv",
    fn(c_int, *const iovec, c_int) -> ssize_t
);
real!(
    real_writev,
    c"writev",
    fn(c_int, *const iovec, c_int) -> ssize_t
);
real!(
    real_recv,
    c"recv",
    fn(c_int, *mut c_void, size_t, c_int) -> ssize_t
);
real!(
    real_send,
    c"send",
    fn(c_int, *const c_void, size_t, c_int) -> ssize_t
);
real!(
    real_recvfrom,
    c"recvfrom",
    fn(c_int, *mut c_void, size_t, c_int, *mut sockaddr, *mut socklen_t) -> ssize_t
);
real!(
    real_sendto,
    c"sendto",
    fn(c_int, *const c_void, size_t, c_int, *const sockaddr, socklen_t) -> ssize_t
);
real!(
    real_recvmsg,
    c"recvmsg",
    fn(c_int, *mut msghdr, c_int) -> ssize_t
);
real!(
    real_sendmsg,
    c"sendmsg",
    fn(c_int, *const msghdr, c_int) -> ssize_t
);
real!(
    real_sendfile,
    c"sendfile",
    fn(c_int, c_int, *mut libc::off_t, size_t) -> ssize_t
);
real!(
    real_sendfile64,
    c"sendfile64",
    fn(c_int, c_int, *mut libc::off64_t, size_t) -> ssize_t
);
real!(
    real_sendmmsg,
    c"sendmmsg",
    fn(c_int, *mut libc::mmsghdr, libc::c_uint, c_int) -> c_int
);
real!(
    real_recvmmsg,
    c"recvmmsg",
    fn(c_int, *mut libc::mmsghdr, libc::c_uint, c_int, *mut timespec) -> c_int
);
real!(real_close, c"close", fn(c_int) -> c_int);
real!(real_shutdown, c"shutdown", fn(c_int, c_int) -> c_int);
real!(
    real_setsockopt,
    c"setsockopt",
    fn(c_int, c_int, c_int, *const c_void, socklen_t) -> c_int
);
real!(
    real_getsockopt,
    c"getsockopt",
    fn(c_int, c_int, c_int, *mut c_void, *mut socklen_t) -> c_int
);
real!(
    real_getsockname,
    c"getsockname",
    fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int
);
real!(
    real_getpeername,
    c"getpeername",
    fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int
);
real!(real_fcntl, c"fcntl", fn(c_int, c_int, usize) -> c_int);
real!(
    real_ioctl,
    c"ioctl",
    fn(c_int, libc::c_ulong, usize) -> c_int
);
real!(real_poll, c"poll", fn(*mut pollfd, nfds_t, c_int) -> c_int);
real!(
    real_ppoll,
    c"ppoll",
    fn(*mut pollfd, nfds_t, *const timespec, *const libc::sigset_t) -> c_int
);
real!(
    real_select,
    c"select",
    fn(c_int, *mut fd_set, *mut fd_set, *mut fd_set, *mut timeval) -> c_int
);
real!(
    real_pselect,
    c"pselect",
    fn(
        c_int,
        *mut fd_set,
        *mut fd_set,
        *mut fd_set,
        *const timespec,
        *const libc::sigset_t,
    ) -> c_int
);
real!(real_dup, c"dup", fn(c_int) -> c_int);
real!(real_dup2, c"dup2", fn(c_int, c_int) -> c_int);
real!(real_dup3, c"dup3", fn(c_int, c_int, c_int) -> c_int);
real!(real_fork, c"fork", fn() -> libc::pid_t);
real!(
    real_epoll_ctl,
    c"epoll_ctl",
    fn(c_int, c_int, c_int, *mut epoll_event) -> c_int
);
real!(
    real_epoll_wait,
    c"epoll_wait",
    fn(c_int, *mut epoll_event, c_int, c_int) -> c_int
);
real!(
    real_epoll_pwait,
    c"epoll_pwait",
    fn(c_int, *mut epoll_event, c_int, c_int, *const libc::sigset_t) -> c_int
);

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot, valid for the thread's life.
    unsafe { *libc::__errno_location() = e };
}

fn errno() -> c_int {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// An `io::Error` of the stream as the errno a socket call would give.
fn errno_of(e: &io::Error) -> c_int {
    if let Some(n) = e.raw_os_error() {
        return n;
    }
    match e.kind() {
        io::ErrorKind::WouldBlock => libc::EAGAIN,
        io::ErrorKind::BrokenPipe => libc::EPIPE,
        io::ErrorKind::ConnectionReset => libc::ECONNRESET,
        io::ErrorKind::ConnectionRefused => libc::ECONNREFUSED,
        io::ErrorKind::ConnectionAborted => libc::ECONNABORTED,
        io::ErrorKind::TimedOut => libc::ETIMEDOUT,
        io::ErrorKind::InvalidInput => libc::EINVAL,
        io::ErrorKind::Unsupported => libc::EOPNOTSUPP,
        io::ErrorKind::Interrupted => libc::EINTR,
        _ => libc::EIO,
    }
}

fn fail<T: From<i8>>(e: c_int) -> T {
    set_errno(e);
    T::from(-1)
}

/// True for a stream this process inherited through `fork` (unusable: the parent's
/// progress thread did not come along).
fn inherited(s: &StreamEntry) -> bool {
    table::FORKED.load(Ordering::Relaxed) && s.pid != std::process::id()
}

// ---- socket creation and options ----------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int {
    // SAFETY: libc's socket with the caller's arguments.
    let fd = unsafe { real_socket()(domain, ty, protocol) };
    let tcp = (domain == libc::AF_INET || domain == libc::AF_INET6)
        && (ty & 0xf) == libc::SOCK_STREAM
        && (protocol == 0 || protocol == libc::IPPROTO_TCP);
    if fd >= 0 && tcp && config::get().mode == Mode::All && !in_stack() {
        table::insert(fd, Entry::Pending);
    }
    fd
}

thread_local! {
    /// Set while this thread runs a call of the rsocket module (which makes TCP sockets of
    /// its own through `socket`: a port's reservation, a listener).
    static IN_STACK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// True when `socket` is called by Softwarp's stack, not by the program: on one of the
/// stack's threads (the connection manager's connects), or inside an rsocket call
/// ([`in_rsocket`]). Such a socket is never switched.
fn in_stack() -> bool {
    IN_STACK.with(std::cell::Cell::get) || softwarp_ras::thread::is_softwarp_thread()
}

/// Runs `f`, a call into the rsocket module, with [`in_stack`] true on this thread.
fn in_rsocket<T>(f: impl FnOnce() -> T) -> T {
    let was = IN_STACK.with(|s| s.replace(true));
    let r = f();
    IN_STACK.with(|s| s.set(was));
    r
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    if level == SOL_SOFTWARP {
        if config::get().mode == Mode::Off {
            return fail(libc::ENOPROTOOPT);
        }
        if name != SO_IWARP_MODE {
            return fail(libc::ENOPROTOOPT);
        }
        if val.is_null() || (len as usize) < std::mem::size_of::<c_int>() {
            return fail(libc::EINVAL);
        }
        // SAFETY: the caller passes `len` >= sizeof(int) readable bytes at `val`.
        let on = unsafe { std::ptr::read_unaligned(val.cast::<c_int>()) } != 0;
        match (table::get(fd), on) {
            (None, true) => {
                table::insert(fd, Entry::Pending);
            }
            (Some(Entry::Pending), false) => {
                table::remove(fd);
            }
            (Some(Entry::Pending), true) | (None, false) => {}
            // Too late: connected or listening already.
            (Some(_), _) => return fail(libc::EISCONN),
        }
        return 0;
    }
    if let Some(Entry::Rsocket(r)) = table::get(fd) {
        // SAFETY: the caller's option value of `len` bytes.
        return unsafe { rsock::swv_rsetsockopt(r.rs, level, name, val, len) };
    }
    let target = match table::stream(fd) {
        Some(s) => {
            if level == libc::IPPROTO_TCP && (name == libc::TCP_CORK || name == libc::TCP_NODELAY) {
                // The stream holds or sends its bytes as these say; the connection's own
                // TCP socket keeps TCP_NODELAY and no cork, or its FPDUs (grants among
                // them) would wait for Nagle or up to 200 ms.
                if val.is_null() || (len as usize) < std::mem::size_of::<c_int>() {
                    return fail(libc::EINVAL);
                }
                // SAFETY: the caller passes `len` >= sizeof(int) readable bytes at `val`.
                let on = unsafe { std::ptr::read_unaligned(val.cast::<c_int>()) } != 0;
                let r = if name == libc::TCP_CORK {
                    s.stream.set_cork(on)
                } else {
                    s.stream.set_nodelay(on)
                };
                return match r {
                    Ok(()) => 0,
                    Err(e) => fail(errno_of(&e)),
                };
            }
            if level == libc::SOL_SOCKET && (name == libc::SO_RCVTIMEO || name == libc::SO_SNDTIMEO)
            {
                // The stream applies them (the QP's socket keeps its own settings).
                if val.is_null() || (len as usize) < std::mem::size_of::<timeval>() {
                    return fail(libc::EINVAL);
                }
                // SAFETY: the caller passes `len` >= sizeof(timeval) readable bytes.
                let tv = unsafe { std::ptr::read_unaligned(val.cast::<timeval>()) };
                if tv.tv_usec < 0 || tv.tv_usec >= 1_000_000 {
                    return fail(libc::EDOM);
                }
                let t = timeout_of(&tv);
                let r = if name == libc::SO_RCVTIMEO {
                    s.stream.set_read_timeout(t)
                } else {
                    s.stream.set_write_timeout(t)
                };
                return match r {
                    Ok(()) => 0,
                    Err(e) => fail(errno_of(&e)),
                };
            }
            std::os::fd::AsRawFd::as_raw_fd(&s.tcp)
        }
        None => fd,
    };
    // SAFETY: libc's setsockopt with the caller's arguments (on the TCP socket of a stream).
    unsafe { real_setsockopt()(target, level, name, val, len) }
}

/// Writes an option value of `T` for `getsockopt` into the caller's buffer (truncated to
/// `*len`, as the kernel does). Returns 0 or -1 with errno.
///
/// # Safety
/// `val` and `len` are the caller's, valid or null.
unsafe fn put_option<T: Copy>(v: T, val: *mut c_void, len: *mut socklen_t) -> c_int {
    if val.is_null() || len.is_null() {
        return fail(libc::EFAULT);
    }
    // SAFETY: the caller's `*len` writable bytes at `val`.
    unsafe {
        let n = (*len as usize).min(std::mem::size_of::<T>());
        std::ptr::copy_nonoverlapping((&raw const v).cast::<u8>(), val.cast::<u8>(), n);
        *len = n as socklen_t;
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    if level == SOL_SOFTWARP && name == SO_IWARP_ACTIVE {
        // Active once the deferred MPA exchange ended; a blocking socket waits for it (at
        // most the connect timeout), a non-blocking one answers at once.
        if let Some(Entry::Deferred(d)) = table::get(fd) {
            let block = if d.nonblocking.load(Ordering::Relaxed) {
                Block::No
            } else {
                Block::Until(None)
            };
            finish(fd, block);
        }
    }
    let entry = table::get(fd);
    if level == SOL_SOFTWARP {
        let v: c_int = match name {
            SO_IWARP_MODE => c_int::from(entry.is_some()),
            SO_IWARP_ACTIVE => {
                c_int::from(matches!(entry, Some(Entry::Stream(_) | Entry::Rsocket(_))))
            }
            _ => return fail(libc::ENOPROTOOPT),
        };
        // SAFETY: the caller passes a valid `len` and `*len` writable bytes at `val`.
        unsafe {
            if val.is_null() || len.is_null() || (*len as usize) < std::mem::size_of::<c_int>() {
                return fail(libc::EINVAL);
            }
            std::ptr::write_unaligned(val.cast::<c_int>(), v);
            *len = std::mem::size_of::<c_int>() as socklen_t;
        }
        return 0;
    }
    let sol = level == libc::SOL_SOCKET;
    match entry {
        Some(Entry::Deferred(_) | Entry::Failed(_)) if sol && name == libc::SO_ERROR => {
            let err = match finish(fd, Block::No) {
                Progress::Pending | Progress::Connected => 0,
                Progress::Failed(_) => match table::get(fd) {
                    Some(Entry::Failed(e)) => e.swap(0, Ordering::Relaxed),
                    _ => 0,
                },
            };
            // SAFETY: the caller's buffers.
            unsafe { put_option::<c_int>(err, val, len) }
        }
        Some(Entry::Stream(s))
            if level == libc::IPPROTO_TCP
                && (name == libc::TCP_CORK || name == libc::TCP_NODELAY) =>
        {
            let on = if name == libc::TCP_CORK {
                s.stream.cork()
            } else {
                s.stream.nodelay()
            };
            match on {
                // SAFETY: the caller's buffers.
                Ok(on) => unsafe { put_option::<c_int>(c_int::from(on), val, len) },
                Err(e) => fail(errno_of(&e)),
            }
        }
        Some(Entry::Stream(s))
            if sol && (name == libc::SO_RCVTIMEO || name == libc::SO_SNDTIMEO) =>
        {
            let t = if name == libc::SO_RCVTIMEO {
                s.stream.read_timeout()
            } else {
                s.stream.write_timeout()
            }
            .ok()
            .flatten()
            .unwrap_or_default();
            let tv = timeval {
                tv_sec: libc::time_t::try_from(t.as_secs()).unwrap_or(libc::time_t::MAX),
                tv_usec: libc::suseconds_t::from(t.subsec_micros()),
            };
            // SAFETY: the caller's buffers.
            unsafe { put_option(tv, val, len) }
        }
        // SAFETY: the caller's buffers, as rsocket's `rgetsockopt` takes them.
        Some(Entry::Rsocket(r)) => unsafe { rsock::swv_rgetsockopt(r.rs, level, name, val, len) },
        Some(Entry::Stream(s)) => {
            let tcp = std::os::fd::AsRawFd::as_raw_fd(&s.tcp);
            // SAFETY: libc's getsockopt on the stream's TCP socket with the caller's buffers.
            unsafe { real_getsockopt()(tcp, level, name, val, len) }
        }
        // SAFETY: libc's getsockopt with the caller's arguments.
        _ => unsafe { real_getsockopt()(fd, level, name, val, len) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    if let Some(Entry::Rsocket(r)) = table::get(fd) {
        // SAFETY: the caller's buffers.
        return unsafe { rsock::swv_rgetsockname(r.rs, addr, len) };
    }
    let target = table::stream(fd).map_or(fd, |s| std::os::fd::AsRawFd::as_raw_fd(&s.tcp));
    // SAFETY: libc's getsockname with the caller's buffers.
    unsafe { real_getsockname()(target, addr, len) }
}

#[no_mangle]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    if let Some(Entry::Rsocket(r)) = table::get(fd) {
        // SAFETY: the caller's buffers.
        return unsafe { rsock::swv_rgetpeername(r.rs, addr, len) };
    }
    let target = table::stream(fd).map_or(fd, |s| std::os::fd::AsRawFd::as_raw_fd(&s.tcp));
    // SAFETY: libc's getpeername with the caller's buffers.
    unsafe { real_getpeername()(target, addr, len) }
}

/// The port of a socket address (network order in the structure).
fn port_of(addr: *const sockaddr) -> Option<u16> {
    if addr.is_null() {
        return None;
    }
    // SAFETY: the caller's sockaddr; its family says which structure it is, and both start
    // with the family and the port.
    unsafe {
        match c_int::from((*addr).sa_family) {
            libc::AF_INET => Some(u16::from_be((*addr.cast::<libc::sockaddr_in>()).sin_port)),
            libc::AF_INET6 => Some(u16::from_be((*addr.cast::<libc::sockaddr_in6>()).sin6_port)),
            _ => None,
        }
    }
}

fn local_port(fd: c_int) -> Option<u16> {
    // SAFETY: a zeroed sockaddr_storage is a valid out buffer for getsockname.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    // SAFETY: getsockname into our buffer of `len` bytes.
    let r = unsafe { real_getsockname()(fd, (&raw mut ss).cast(), &mut len) };
    (r == 0).then(|| port_of((&raw const ss).cast())).flatten()
}

/// In `all` mode a pending socket whose port is not allowed goes back to plain TCP.
fn still_iwarp(fd: c_int, port: Option<u16>) -> bool {
    let c = config::get();
    if c.mode == Mode::All && !port.is_some_and(|p| c.port_allowed(p)) {
        table::remove(fd);
        return false;
    }
    true
}

// ---- connecting -------------------------------------------------------------------------

static AT_EXIT: std::sync::Once = std::sync::Once::new();

/// At exit, closes every stream the program left open: bytes still queued in user space
/// go out (bounded by the linger time), then the EOF, as the kernel would do for a TCP
/// socket. Registered when the first iWARP stream is set up. In the child of a `fork`, the
/// parent's streams are only forgotten ([`release`]).
extern "C" fn close_all_at_exit() {
    for e in table::drain_streams() {
        release(Some(e));
    }
}

/// Registers [`close_all_at_exit`] (once, with the first stream or rsocket).
fn close_at_exit() {
    AT_EXIT.call_once(|| {
        // SAFETY: registers a plain `extern "C" fn()` with libc; it stays loaded until exit.
        if unsafe { libc::atexit(close_all_at_exit) } != 0 {
            eprintln!("softwarp preload: atexit failed: streams are not flushed at exit");
        }
    });
}

fn is_nonblocking(fd: c_int) -> bool {
    // SAFETY: F_GETFL on a descriptor of the program.
    let fl = unsafe { real_fcntl()(fd, libc::F_GETFL, 0) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

fn set_blocking(fd: c_int, nonblocking: bool) {
    // SAFETY: F_GETFL/F_SETFL on a descriptor of the program.
    unsafe {
        let fl = real_fcntl()(fd, libc::F_GETFL, 0);
        if fl >= 0 {
            let fl = if nonblocking {
                fl | libc::O_NONBLOCK
            } else {
                fl & !libc::O_NONBLOCK
            };
            real_fcntl()(fd, libc::F_SETFL, fl as usize);
        }
    }
}

/// A socket option of `fd` as raw bytes (at most 32), for copying it to another socket.
fn raw_option(fd: c_int, level: c_int, name: c_int) -> Option<([u8; 32], socklen_t)> {
    let mut buf = [0u8; 32];
    let mut len = buf.len() as socklen_t;
    // SAFETY: getsockopt into our buffer of `len` bytes.
    let r = unsafe { real_getsockopt()(fd, level, name, buf.as_mut_ptr().cast(), &mut len) };
    (r == 0).then_some((buf, len))
}

/// A `timeval` socket option (`SO_RCVTIMEO`, `SO_SNDTIMEO`) as a timeout (`None`: zero,
/// no timeout).
fn timeval_option(fd: c_int, name: c_int) -> Option<Duration> {
    let (buf, len) = raw_option(fd, libc::SOL_SOCKET, name)?;
    if (len as usize) < std::mem::size_of::<timeval>() {
        return None;
    }
    // SAFETY: the kernel wrote a timeval into the buffer's first bytes.
    let tv = unsafe { std::ptr::read_unaligned(buf.as_ptr().cast::<timeval>()) };
    timeout_of(&tv)
}

fn timeout_of(tv: &timeval) -> Option<Duration> {
    let d = Duration::new(
        u64::try_from(tv.tv_sec).unwrap_or(0),
        u32::try_from(tv.tv_usec.clamp(0, 999_999))
            .unwrap_or(0)
            .saturating_mul(1000),
    );
    (!d.is_zero()).then_some(d)
}

/// Starts the MPA exchange as `side` on a duplicate of the program's socket `fd` (which
/// keeps its number; the duplicate becomes the QP's socket).
fn start_handshake(fd: c_int, side: Side) -> io::Result<Handshake> {
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) on the program's socket.
    let qp_fd = unsafe { real_fcntl()(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if qp_fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the descriptor was just created by us and is owned by nothing else.
    let tcp = unsafe { std::net::TcpStream::from_raw_fd(qp_fd) };
    Handshake::start(tcp, side, &IwarpOptions::default())
}

/// Puts `stream`, whose MPA exchange just ended on the program's socket `fd`, behind `fd`:
/// `fd` becomes a duplicate of the stream's completion channel. Returns 0 or -1 with errno.
fn place(fd: c_int, stream: IwarpStream, nonblocking: bool) -> c_int {
    // The program's timeouts, set on the TCP socket before connect/accept; the stream
    // applies them from now on (the QP's socket has its own settings).
    let timeouts = (
        timeval_option(fd, libc::SO_RCVTIMEO),
        timeval_option(fd, libc::SO_SNDTIMEO),
    );
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) on the program's socket: a duplicate for options and
    // addresses.
    let opt_fd = unsafe { real_fcntl()(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if opt_fd < 0 {
        return -1;
    }
    // SAFETY: the descriptor was just created by us and is owned by nothing else.
    let keep = unsafe { OwnedFd::from_raw_fd(opt_fd) };
    let _ = stream.set_read_timeout(timeouts.0);
    let _ = stream.set_write_timeout(timeouts.1);
    stream.set_report_interrupts(true);
    // A cork the program set before the switch moves to the stream (on the connection's
    // socket it would hold the FPDUs up to 200 ms each).
    let mut cork: c_int = 0;
    let mut cork_len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: getsockopt of an int into `cork` on our duplicate of the socket.
    let got = unsafe {
        real_getsockopt()(
            opt_fd,
            libc::IPPROTO_TCP,
            libc::TCP_CORK,
            (&raw mut cork).cast(),
            &raw mut cork_len,
        )
    };
    if got == 0 && cork != 0 {
        let off: c_int = 0;
        // SAFETY: setsockopt of an int on our duplicate of the socket.
        unsafe {
            real_setsockopt()(
                opt_fd,
                libc::IPPROTO_TCP,
                libc::TCP_CORK,
                (&raw const off).cast(),
                std::mem::size_of::<c_int>() as socklen_t,
            )
        };
        let _ = stream.set_cork(true);
    }
    // SAFETY: F_GETFD on the program's descriptor.
    let cloexec = unsafe { real_fcntl()(fd, libc::F_GETFD, 0) } & libc::FD_CLOEXEC != 0;
    let event_fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
    let flags = if cloexec { libc::O_CLOEXEC } else { 0 };
    let regs = epoll_detach(fd);
    // SAFETY: dup3 of the stream's channel over the program's descriptor number; the TCP
    // socket lives on in the two duplicates.
    if unsafe { real_dup3()(event_fd, fd, flags) } < 0 {
        let e = errno();
        epoll_attach(fd, &regs, false);
        return fail(e);
    }
    table::insert(
        fd,
        Entry::Stream(Arc::new(StreamEntry {
            stream,
            tcp: keep,
            nonblocking: nonblocking.into(),
            pid: std::process::id(),
        })),
    );
    epoll_attach(fd, &regs, true);
    close_at_exit();
    0
}

/// Socket options a program may have set before `connect` that the fallback connection
/// copies (`SO_RCVBUF`/`SO_SNDBUF` are not: the kernel reports them doubled).
const COPIED_OPTIONS: [(c_int, c_int); 6] = [
    (libc::SOL_SOCKET, libc::SO_KEEPALIVE),
    (libc::SOL_SOCKET, libc::SO_RCVTIMEO),
    (libc::SOL_SOCKET, libc::SO_SNDTIMEO),
    (libc::SOL_SOCKET, libc::SO_LINGER),
    (libc::SOL_SOCKET, libc::SO_REUSEADDR),
    (libc::IPPROTO_TCP, libc::TCP_NODELAY),
];

/// `SOFTWARP_SOCKETS_FALLBACK=tcp`: replaces the program's socket `fd` (connected to a peer
/// that did not answer MPA) with a new plain TCP connection to the same address, with the
/// same options and flags. A blocking socket waits for the connect (at most the connect
/// timeout); a non-blocking one gets the connection in progress, writable (or with its
/// `SO_ERROR`) once it is made, as after its own `connect`. Returns 0 or -1 with errno.
fn fall_back_to_tcp(
    fd: c_int,
    ss: &libc::sockaddr_storage,
    len: socklen_t,
    nonblocking: bool,
) -> c_int {
    // SAFETY: libc's socket.
    let new = unsafe {
        real_socket()(
            c_int::from(ss.ss_family),
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if new < 0 {
        return -1;
    }
    let close_new = |e: c_int| {
        // SAFETY: closing the socket made above.
        unsafe { real_close()(new) };
        fail::<c_int>(e)
    };
    for (level, name) in COPIED_OPTIONS {
        if let Some((buf, n)) = raw_option(fd, level, name) {
            // SAFETY: setsockopt from our buffer of `n` bytes.
            unsafe { real_setsockopt()(new, level, name, buf.as_ptr().cast(), n) };
        }
    }
    // SAFETY: libc's connect with the address the program connected to.
    if unsafe { real_connect()(new, (ss as *const libc::sockaddr_storage).cast(), len) } < 0 {
        let e = errno();
        if e != libc::EINPROGRESS {
            return close_new(e);
        }
    }
    if !nonblocking {
        let mut p = pollfd {
            fd: new,
            events: libc::POLLOUT,
            revents: 0,
        };
        let ms = ms_of(Some(IwarpOptions::default().connect_timeout));
        // SAFETY: libc's poll over our one pollfd.
        if unsafe { real_poll()(&mut p, 1, ms) } <= 0 {
            return close_new(libc::ETIMEDOUT);
        }
        let err = so_error(new);
        if err != 0 {
            return close_new(err);
        }
    }
    // SAFETY: F_GETFD on the program's descriptor.
    let cloexec = unsafe { real_fcntl()(fd, libc::F_GETFD, 0) } & libc::FD_CLOEXEC != 0;
    let regs = epoll_detach(fd);
    // SAFETY: dup3 of the new connection over the program's descriptor number (closing the
    // failed connection), then closing our own number of it.
    let r = unsafe { real_dup3()(new, fd, if cloexec { libc::O_CLOEXEC } else { 0 }) };
    if r < 0 {
        return close_new(errno());
    }
    // SAFETY: as above.
    unsafe { real_close()(new) };
    set_blocking(fd, nonblocking);
    table::remove(fd);
    epoll_attach(fd, &regs, false);
    0
}

/// The pending error of socket `fd` (`SO_ERROR`, which clears it).
fn so_error(fd: c_int) -> c_int {
    let mut err: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: getsockopt of an int into ours.
    let r = unsafe {
        real_getsockopt()(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&raw mut err).cast(),
            &mut len,
        )
    };
    if r < 0 {
        errno()
    } else {
        err
    }
}

/// Where a non-blocking connect is.
enum Progress {
    /// The TCP handshake or the MPA exchange is still under way.
    Pending,
    /// Connected: iWARP, or plain TCP after a fallback.
    Connected,
    /// Failed with this errno.
    Failed(c_int),
}

/// How long [`finish`] may wait for a deferred socket's MPA exchange.
#[derive(Clone, Copy)]
enum Block {
    /// Not at all: a non-blocking socket, `MSG_DONTWAIT`, `poll`/`epoll_wait` (which wait
    /// for the socket themselves).
    No,
    /// Until the exchange ends (at most its own deadline, the connect timeout) or this
    /// instant (`SO_RCVTIMEO`/`SO_SNDTIMEO`): a blocking call.
    Until(Option<Instant>),
}

/// Advances a deferred socket's MPA exchange ([`table::Deferred`]) with what its socket
/// has (with [`Block::Until`], waiting for the socket). Once it ends the stream is behind
/// `fd`; a failure is kept for `SO_ERROR` and I/O.
fn finish(fd: c_int, block: Block) -> Progress {
    let d = match table::get(fd) {
        Some(Entry::Deferred(d)) => d,
        Some(Entry::Failed(e)) => return Progress::Failed(e.load(Ordering::Relaxed)),
        _ => return Progress::Connected,
    };
    let Block::Until(limit) = block else {
        return finish_step(fd, &d);
    };
    loop {
        match finish_step(fd, &d) {
            Progress::Pending => {}
            done => return done,
        }
        let now = Instant::now();
        if limit.is_some_and(|l| l <= now) {
            return Progress::Pending;
        }
        // The exchange's socket, in slices (its deadline is looked at by the next step;
        // another thread may be the one advancing it).
        let slice = limit.map_or(SLICE, |l| l.saturating_duration_since(now).min(SLICE));
        let mut p = pollfd {
            fd,
            events: if d.wants_write.load(Ordering::Relaxed) {
                libc::POLLOUT
            } else {
                libc::POLLIN
            },
            revents: 0,
        };
        // SAFETY: libc's poll over our one pollfd.
        unsafe { real_poll()(&mut p, 1, ms_of(Some(slice)).max(1)) };
    }
}

/// One step of [`finish`], never waiting: starts the exchange at the first look, then
/// advances it with what the socket has.
fn finish_step(fd: c_int, d: &Arc<table::Deferred>) -> Progress {
    let mut ex = match d.exchange.try_lock() {
        Ok(g) => g,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        // Another thread is advancing it: not ready yet, as far as this call can tell.
        Err(std::sync::TryLockError::WouldBlock) => return Progress::Pending,
    };
    // Another thread may have ended it while this one looked up the entry.
    if !matches!(table::get(fd), Some(Entry::Deferred(x)) if Arc::ptr_eq(&x, d)) {
        drop(ex);
        return match table::get(fd) {
            Some(Entry::Failed(e)) => Progress::Failed(e.load(Ordering::Relaxed)),
            _ => Progress::Connected,
        };
    }
    let nonblocking = d.nonblocking.load(Ordering::Relaxed);
    let failed = |e: c_int| {
        table::insert(fd, Entry::Failed(Arc::new(e.into())));
        Progress::Failed(e)
    };
    match &mut *ex {
        table::Exchange::Over => return Progress::Connected,
        table::Exchange::NotStarted => {
            if d.side == Side::Responder && config::get().fallback_tcp {
                match first_bytes(fd, d.since) {
                    FirstBytes::NotYet => return Progress::Pending,
                    FirstBytes::Mpa => {}
                    FirstBytes::Plain(why) => {
                        eprintln!(
                            "softwarp preload: fd {fd}: {why}; serving it over plain TCP \
                             (SOFTWARP_SOCKETS_FALLBACK=tcp)"
                        );
                        *ex = table::Exchange::Over;
                        let regs = epoll_detach(fd);
                        table::remove(fd);
                        epoll_attach(fd, &regs, false);
                        return Progress::Connected;
                    }
                }
            }
            match start_handshake(fd, d.side) {
                Ok(handshake) => {
                    *ex = table::Exchange::Running {
                        handshake: Box::new(handshake),
                        pid: std::process::id(),
                    }
                }
                Err(e) => {
                    *ex = table::Exchange::Over;
                    return exchange_failed(fd, d, &e, &failed);
                }
            }
        }
        table::Exchange::Running { pid, .. } if *pid != std::process::id() => {
            // The parent's exchange (its QP is the parent's device's): not ours to end.
            if let table::Exchange::Running { handshake, .. } =
                std::mem::replace(&mut *ex, table::Exchange::Over)
            {
                std::mem::forget(handshake);
            }
            eprintln!(
                "softwarp preload: pid {}: fd {fd}: its MPA exchange began before fork() in \
                 the parent; it fails here (set connections up in the child)",
                std::process::id()
            );
            // SAFETY: shutdown of the program's socket.
            unsafe { real_shutdown()(fd, libc::SHUT_RDWR) };
            set_blocking(fd, nonblocking);
            return failed(libc::ECONNRESET);
        }
        table::Exchange::Running { .. } => {}
    }
    let table::Exchange::Running { handshake, .. } = &mut *ex else {
        return Progress::Pending;
    };
    // A TCP connect that failed: its own error (ECONNREFUSED, ETIMEDOUT, ...), as the
    // kernel reports it (SO_ERROR is read, and cleared, here).
    if d.side == Side::Initiator && handshake.wants_write() && ready(fd, libc::POLLOUT) {
        let err = so_error(fd);
        if err != 0 {
            *ex = table::Exchange::Over;
            set_blocking(fd, nonblocking);
            return failed(err);
        }
    }
    match handshake.advance() {
        Ok(None) => {
            d.wants_write
                .store(handshake.wants_write(), Ordering::Relaxed);
            Progress::Pending
        }
        Ok(Some(stream)) => {
            *ex = table::Exchange::Over;
            if place(fd, stream, nonblocking) == 0 {
                Progress::Connected
            } else {
                failed(errno())
            }
        }
        Err(e) => {
            *ex = table::Exchange::Over;
            exchange_failed(fd, d, &e, &failed)
        }
    }
}

/// True once a deferred socket's MPA exchange started (its socket is then non-blocking
/// whatever the program asks: [`table::Deferred::nonblocking`] keeps the program's mode).
fn exchange_started(d: &table::Deferred) -> bool {
    match d.exchange.try_lock() {
        Ok(g) => !matches!(*g, table::Exchange::NotStarted),
        Err(std::sync::TryLockError::Poisoned(p)) => {
            !matches!(*p.into_inner(), table::Exchange::NotStarted)
        }
        Err(std::sync::TryLockError::WouldBlock) => true,
    }
}

/// True when a `poll(2)` with no wait reports `events` on `fd`.
fn ready(fd: c_int, events: i16) -> bool {
    let mut p = pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: libc's poll over our one pollfd, without waiting.
    unsafe { real_poll()(&mut p, 1, 0) > 0 }
}

/// After the MPA exchange on `fd` failed with `e`: an initiator falls back to plain TCP
/// when `SOFTWARP_SOCKETS_FALLBACK=tcp` says so; otherwise the socket is shut down (no
/// plain bytes may follow on a connection that was to be iWARP) and the program sees
/// `ECONNREFUSED` (a connect) or `ECONNRESET` (an accepted connection), as for a peer that
/// reset the TCP connection.
fn exchange_failed(
    fd: c_int,
    d: &table::Deferred,
    e: &io::Error,
    failed: &dyn Fn(c_int) -> Progress,
) -> Progress {
    let nonblocking = d.nonblocking.load(Ordering::Relaxed);
    if d.side == Side::Initiator && config::get().fallback_tcp {
        if let Some((bytes, len)) = d.addr {
            eprintln!(
                "softwarp preload: fd {fd}: the peer did not answer the MPA exchange ({e}); \
                 connecting again over plain TCP (SOFTWARP_SOCKETS_FALLBACK=tcp)"
            );
            // SAFETY: a zeroed sockaddr_storage is valid; the bytes are the program's
            // address (at most its size), copied in.
            let ss = unsafe {
                let mut ss: libc::sockaddr_storage = std::mem::zeroed();
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    (&raw mut ss).cast::<u8>(),
                    bytes
                        .len()
                        .min(std::mem::size_of::<libc::sockaddr_storage>()),
                );
                ss
            };
            return match fall_back_to_tcp(fd, &ss, len, nonblocking) {
                0 => Progress::Connected,
                _ => failed(errno()),
            };
        }
    }
    // SAFETY: shutdown of the program's socket.
    unsafe { real_shutdown()(fd, libc::SHUT_RDWR) };
    set_blocking(fd, nonblocking);
    eprintln!("softwarp preload: fd {fd}: iWARP connection failed: {e}");
    failed(match d.side {
        Side::Initiator => libc::ECONNREFUSED,
        Side::Responder => libc::ECONNRESET,
    })
}

/// What the first bytes of an accepted connection say, with `SOFTWARP_SOCKETS_FALLBACK=tcp`.
enum FirstBytes {
    /// An MPA Request, or the start of one: iWARP.
    Mpa,
    /// Plain TCP, for this reason.
    Plain(&'static str),
    /// Nothing yet.
    NotYet,
}

/// With `SOFTWARP_SOCKETS_FALLBACK=tcp`, the first bytes of an accepted connection decide
/// its kind: an MPA Request (or the start of one) goes iWARP; other bytes, the EOF, an error,
/// or nothing within the connect timeout after `since` (a client that waits for the server
/// to speak first) leave it plain TCP. The bytes stay in the socket (`MSG_PEEK`); nothing
/// waits.
fn first_bytes(fd: c_int, since: Instant) -> FirstBytes {
    let key = softwarp_wire::mpa::frame::KEY_REQUEST;
    let mut buf = [0u8; 16];
    // SAFETY: recv into our buffer of `buf.len()` bytes, peeking, without waiting.
    let n = unsafe {
        real_recv()(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    match usize::try_from(n) {
        Ok(n) if n > 0 && buf.get(..n) == key.get(..n) => FirstBytes::Mpa,
        Ok(n) if n > 0 => FirstBytes::Plain("the peer sent no MPA Request"),
        Ok(_) => FirstBytes::Plain("the peer closed before sending anything"),
        Err(_) if !matches!(errno(), libc::EAGAIN | libc::EINTR) => {
            FirstBytes::Plain("the connection failed before an MPA Request")
        }
        Err(_) if since.elapsed() >= IwarpOptions::default().connect_timeout => {
            FirstBytes::Plain("the peer sent nothing within the connect timeout")
        }
        Err(_) => FirstBytes::NotYet,
    }
}

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    match table::get(fd) {
        // A second connect while a non-blocking one runs: as the kernel answers (0 the
        // first time it finds the connection made, EISCONN after that).
        Some(Entry::Deferred(d)) if d.side == Side::Responder => return fail(libc::EISCONN),
        Some(Entry::Deferred(_)) => {
            return match finish(fd, Block::No) {
                Progress::Pending => fail(libc::EALREADY),
                Progress::Connected => 0,
                Progress::Failed(e) => fail(e),
            }
        }
        Some(Entry::Stream(_)) => return fail(libc::EISCONN),
        Some(Entry::Rsocket(r)) => {
            // SAFETY: the caller's address of `len` bytes.
            let n = in_rsocket(|| unsafe { rsock::swv_rconnect(r.rs, addr, len) });
            // rconnect called again answers as rdma-core's: EINPROGRESS while the attempt
            // runs, where the kernel says EALREADY; 0 once connected, as the kernel's
            // first answer then.
            return if n < 0 && errno() == libc::EINPROGRESS {
                fail(libc::EALREADY)
            } else {
                n
            };
        }
        Some(Entry::Pending) if still_iwarp(fd, port_of(addr)) => {
            if config::get().protocol == Protocol::Rsocket {
                // SAFETY: the caller's address of `len` bytes.
                return in_rsocket(|| unsafe { rsocket_connect(fd, addr, len) });
            }
        }
        _ => {
            // SAFETY: libc's connect with the caller's arguments.
            return unsafe { real_connect()(fd, addr, len) };
        }
    }
    // The address, for a fallback to plain TCP.
    let mut stored = [0u8; 128];
    let n = (len as usize).min(stored.len());
    if !addr.is_null() {
        // SAFETY: the caller's address of `len` bytes; at most `n` of them are copied.
        unsafe { std::ptr::copy_nonoverlapping(addr.cast::<u8>(), stored.as_mut_ptr(), n) };
    }
    let saved = (!addr.is_null()).then_some((stored, n as u32));
    let nonblocking = is_nonblocking(fd);
    // SAFETY: libc's connect with the caller's arguments.
    let r = unsafe { real_connect()(fd, addr, len) };
    if r < 0 {
        let e = errno();
        if !(nonblocking && e == libc::EINPROGRESS) {
            return fail(e);
        }
    }
    // Connected or not, the MPA exchange is still to come: a non-blocking socket becomes
    // writable when it is done (or failed, with SO_ERROR set); a blocking connect runs it
    // now.
    let d = table::Deferred::new(Side::Initiator, nonblocking, saved);
    table::insert(fd, Entry::Deferred(d));
    if nonblocking {
        return fail(libc::EINPROGRESS);
    }
    match finish(fd, Block::Until(None)) {
        Progress::Connected => 0,
        // As the kernel: the error is the connect's, not left for SO_ERROR.
        Progress::Failed(e) => {
            if let Some(Entry::Failed(pending)) = table::get(fd) {
                pending.store(0, Ordering::Relaxed);
            }
            fail(e)
        }
        Progress::Pending => fail(libc::ETIMEDOUT),
    }
}

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    match table::get(fd) {
        Some(Entry::Rsocket(r)) => return in_rsocket(|| rsock::swv_rlisten(r.rs, backlog)),
        Some(Entry::Pending) if still_iwarp(fd, local_port(fd)) => {
            if config::get().protocol == Protocol::Rsocket {
                return in_rsocket(|| rsocket_listen(fd, backlog));
            }
            table::insert(fd, Entry::Listener);
        }
        _ => {}
    }
    // SAFETY: libc's listen.
    unsafe { real_listen()(fd, backlog) }
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: forwarded with the caller's arguments.
    unsafe { accept4(fd, addr, len, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    if let Some(Entry::Rsocket(r)) = table::get(fd) {
        // SAFETY: the caller's address buffer and length.
        return unsafe { rsocket_accept(&r, addr, len, flags) };
    }
    // SAFETY: libc's accept4 with the caller's arguments.
    let k = unsafe { real_accept4()(fd, addr, len, flags) };
    if k < 0 || !matches!(table::get(fd), Some(Entry::Listener)) {
        return k;
    }
    // The MPA exchange starts when the program first looks at the connection.
    let nonblocking = flags & libc::SOCK_NONBLOCK != 0;
    table::insert(
        k,
        Entry::Deferred(table::Deferred::new(Side::Responder, nonblocking, None)),
    );
    k
}

// ---- data ----------------------------------------------------------------------------------

/// After a signal interrupted a blocking call on an iWARP stream: restart it (as the
/// kernel does when the handler was installed with `SA_RESTART`) or fail with `EINTR`.
///
/// Which signal came is not known here (the wait is a `poll` on the eventfd, which the
/// kernel never restarts), so the call is restarted only when every caught asynchronous
/// signal's handler has `SA_RESTART`: a program with one handler without it gets `EINTR`,
/// as it would for that handler's signal.
fn restart_after_signal() -> bool {
    const SYNCHRONOUS: [c_int; 7] = [
        libc::SIGSEGV,
        libc::SIGBUS,
        libc::SIGILL,
        libc::SIGFPE,
        libc::SIGTRAP,
        libc::SIGKILL,
        libc::SIGSTOP,
    ];
    for sig in 1..=libc::SIGRTMAX() {
        if SYNCHRONOUS.contains(&sig) {
            continue;
        }
        // SAFETY: a zeroed sigaction is a valid out buffer.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: sigaction only reads the disposition (no new one is given).
        if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } != 0 {
            continue;
        }
        let caught = old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN;
        if caught && old.sa_flags & libc::SA_RESTART == 0 {
            return false;
        }
    }
    true
}

/// I/O on a stream inherited through `fork`: `EIO`, and once per process a line on stderr
/// that says why.
fn inherited_eio() -> ssize_t {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        eprintln!(
            "softwarp preload: pid {}: an iWARP stream set up before fork() is used in the \
             child: EIO (the stack that moves its bytes stayed in the parent, whose copy keeps \
             working; set connections up in the child, e.g. accept or connect there)",
            std::process::id()
        );
    }
    fail(libc::EIO)
}

/// What an I/O call on a descriptor of ours goes to: a stream of Softwarp's extended
/// sockets, or an rsocket.
#[derive(Clone)]
enum Conn {
    Iwarp(Arc<StreamEntry>),
    Rsocket(Arc<RsocketEntry>),
}

fn stream_read(c: &Conn, buf: &mut [u8], flags: c_int) -> ssize_t {
    let s = match c {
        Conn::Iwarp(s) => s,
        Conn::Rsocket(r) => return rsocket_read(r, buf, flags),
    };
    if inherited(s) {
        return inherited_eio();
    }
    let nb = s.nonblocking.load(Ordering::Relaxed) || flags & libc::MSG_DONTWAIT != 0;
    let waitall = flags & libc::MSG_WAITALL != 0;
    if flags & libc::MSG_PEEK != 0 {
        loop {
            match s.stream.peek_with(buf, waitall, nb) {
                Ok(n) => return n as ssize_t,
                Err(e) if e.kind() == io::ErrorKind::Interrupted && restart_after_signal() => {}
                Err(e) => return fail(errno_of(&e)),
            }
        }
    }
    let mut got = 0usize;
    loop {
        // After the first bytes only MSG_WAITALL waits for more (and stops at a timeout,
        // a signal or an error with what it has, as the kernel does).
        match s
            .stream
            .read_with(&mut buf[got..], nb || (got > 0 && !waitall))
        {
            Ok(0) => return got as ssize_t,
            Ok(n) => {
                got = got.saturating_add(n);
                if !waitall || got >= buf.len() {
                    return got as ssize_t;
                }
            }
            Err(_) if got > 0 => return got as ssize_t,
            Err(e) if e.kind() == io::ErrorKind::Interrupted && restart_after_signal() => {}
            Err(e) => return fail(errno_of(&e)),
        }
    }
}

fn stream_write(c: &Conn, buf: &[u8], flags: c_int) -> ssize_t {
    let s = match c {
        Conn::Iwarp(s) => s,
        Conn::Rsocket(r) => return rsocket_write(r, buf, flags),
    };
    if inherited(s) {
        return inherited_eio();
    }
    let nb = s.nonblocking.load(Ordering::Relaxed) || flags & libc::MSG_DONTWAIT != 0;
    let more = flags & libc::MSG_MORE != 0;
    let mut sent = 0usize;
    // A blocking socket's write takes every byte (as the kernel's does, barring signals,
    // timeouts and errors, which end it with the count so far).
    while sent < buf.len() {
        match s.stream.write_more_with(&buf[sent..], more, nb) {
            Ok(n) => sent = sent.saturating_add(n),
            Err(_) if sent > 0 => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted && restart_after_signal() => {}
            Err(e) => {
                let code = errno_of(&e);
                sigpipe(code, flags);
                return fail(code);
            }
        }
        if nb {
            break;
        }
    }
    sent as ssize_t
}

/// # Safety
/// `buf` must be valid for `len` writable bytes (or `len` 0).
unsafe fn slice_mut<'a>(buf: *mut c_void, len: size_t) -> &'a mut [u8] {
    if len == 0 || buf.is_null() {
        return &mut [];
    }
    // SAFETY: per this function's contract.
    unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) }
}

/// # Safety
/// `buf` must be valid for `len` readable bytes (or `len` 0).
unsafe fn slice_ref<'a>(buf: *const c_void, len: size_t) -> &'a [u8] {
    if len == 0 || buf.is_null() {
        return &[];
    }
    // SAFETY: per this function's contract.
    unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) }
}

/// # Safety
/// `iov` must point to `cnt` valid iovecs.
unsafe fn iovecs<'a>(iov: *const iovec, cnt: c_int) -> &'a [iovec] {
    match usize::try_from(cnt) {
        Ok(n) if n > 0 && !iov.is_null() => {
            // SAFETY: per this function's contract.
            unsafe { std::slice::from_raw_parts(iov, n) }
        }
        _ => &[],
    }
}

fn readv_stream(s: &Conn, iov: &[iovec], flags: c_int) -> ssize_t {
    let total: usize = iov.iter().map(|v| v.iov_len).fold(0, usize::saturating_add);
    let mut tmp = vec![0u8; total.min(1 << 20)];
    let n = stream_read(s, &mut tmp, flags);
    if n <= 0 {
        return n;
    }
    let mut left = &tmp[..n as usize];
    for v in iov {
        if left.is_empty() {
            break;
        }
        let take = v.iov_len.min(left.len());
        // SAFETY: the caller's iovec is valid for iov_len writable bytes.
        unsafe { slice_mut(v.iov_base, take) }.copy_from_slice(&left[..take]);
        left = &left[take..];
    }
    n
}

fn writev_stream(s: &Conn, iov: &[iovec], flags: c_int) -> ssize_t {
    let mut tmp = Vec::new();
    for v in iov {
        // SAFETY: the caller's iovec is valid for iov_len readable bytes.
        tmp.extend_from_slice(unsafe { slice_ref(v.iov_base, v.iov_len) });
    }
    stream_write(s, &tmp, flags)
}

/// Where an I/O call on `fd` goes.
enum Route {
    Stream(Conn),
    /// The real call (not ours, or plain TCP).
    Real,
    /// Fails with this errno (a connect still under way, or its pending error).
    Errno(c_int),
}

/// What an I/O call on a descriptor may do while its MPA exchange is under way.
#[derive(Clone, Copy)]
struct Io {
    /// A write (`SO_SNDTIMEO` bounds its wait), else a read (`SO_RCVTIMEO`).
    write: bool,
    /// `MSG_DONTWAIT`: no wait, whatever `O_NONBLOCK` says.
    dontwait: bool,
}

impl Io {
    fn read(flags: c_int) -> Self {
        Self {
            write: false,
            dontwait: flags & libc::MSG_DONTWAIT != 0,
        }
    }

    fn write(flags: c_int) -> Self {
        Self {
            write: true,
            dontwait: flags & libc::MSG_DONTWAIT != 0,
        }
    }
}

/// Where an I/O call `io` on `fd` goes. A deferred socket's MPA exchange advances first:
/// without waiting on a non-blocking socket (`EAGAIN` while it is under way, as for a
/// connect in progress); on a blocking one the call waits for its end, at most the
/// exchange's deadline and the socket's `SO_RCVTIMEO`/`SO_SNDTIMEO` (then `EAGAIN`).
fn route(fd: c_int, io: Io) -> Route {
    match table::get(fd) {
        None | Some(Entry::Pending | Entry::Listener) => Route::Real,
        Some(Entry::Stream(s)) => Route::Stream(Conn::Iwarp(s)),
        Some(Entry::Rsocket(r)) => Route::Stream(Conn::Rsocket(r)),
        Some(Entry::Deferred(d)) => {
            let block = if io.dontwait || d.nonblocking.load(Ordering::Relaxed) {
                Block::No
            } else {
                let name = if io.write {
                    libc::SO_SNDTIMEO
                } else {
                    libc::SO_RCVTIMEO
                };
                Block::Until(timeval_option(fd, name).and_then(|t| Instant::now().checked_add(t)))
            };
            match finish(fd, block) {
                Progress::Pending => Route::Errno(libc::EAGAIN),
                Progress::Connected => {
                    table::stream(fd).map_or(Route::Real, |s| Route::Stream(Conn::Iwarp(s)))
                }
                Progress::Failed(_) => route(fd, io),
            }
        }
        Some(Entry::Failed(e)) => match e.swap(0, Ordering::Relaxed) {
            0 => Route::Real,
            err => Route::Errno(err),
        },
    }
}

/// A libc function: `real_x::cached` (once resolved) and `real_x` (resolving it).
type Libc<F> = (fn() -> Option<F>, fn() -> F);

/// Runs an I/O call on `fd` with `call` (libc's function, `cached` once resolved, else
/// `resolved()`) or, on a stream, `stream`. Inlined into each interposer, the pass-through
/// is a load of the descriptor's byte in the table's bitmap, a load of the cached function,
/// and a jump to it; anything else (a descriptor that may be ours, a function not resolved
/// yet) goes through [`dispatch_ours`].
#[inline(always)]
fn dispatch<F, R: From<i8>>(
    fd: c_int,
    io: Io,
    (cached, resolved): Libc<F>,
    call: impl FnOnce(F) -> R,
    stream: impl FnOnce(Conn) -> R,
) -> R {
    if table::surely_not_ours(fd) {
        if let Some(f) = cached() {
            return call(f);
        }
    }
    dispatch_ours(fd, io, move || call(resolved()), stream)
}

/// [`dispatch`] of a descriptor that may be ours, by its [`route`]: its stream, the errno
/// of a connect under way or failed, or libc's function (a listener, a socket not connected
/// yet, a fallback to TCP).
#[cold]
#[inline(never)]
fn dispatch_ours<R: From<i8>>(
    fd: c_int,
    io: Io,
    real: impl FnOnce() -> R,
    stream: impl FnOnce(Conn) -> R,
) -> R {
    match route(fd, io) {
        Route::Stream(s) => stream(s),
        Route::Errno(e) => fail(e),
        Route::Real => real(),
    }
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    dispatch(
        fd,
        Io::read(0),
        (real_read::cached, real_read),
        // SAFETY: libc's read with the caller's arguments.
        move |real| unsafe { real(fd, buf, n) },
        // SAFETY: the caller's buffer of `n` bytes.
        move |s| stream_read(&s, unsafe { slice_mut(buf, n) }, 0),
    )
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
) -> ssize_t {
    if n > buflen {
        eprintln!("softwarp preload: buffer overflow detected in read");
        std::process::abort();
    }
    // SAFETY: forwarded with the caller's arguments.
    unsafe { read(fd, buf, n) }
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    dispatch(
        fd,
        Io::write(0),
        (real_write::cached, real_write),
        // SAFETY: libc's write with the caller's arguments.
        move |real| unsafe { real(fd, buf, n) },
        // SAFETY: the caller's buffer of `n` bytes.
        move |s| stream_write(&s, unsafe { slice_ref(buf, n) }, 0),
    )
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    dispatch(
        fd,
        Io::read(0),
        (real_readv::cached, real_readv),
        // SAFETY: libc's readv with the caller's arguments.
        move |real| unsafe { real(fd, iov, cnt) },
        // SAFETY: the caller's iovec array.
        move |s| readv_stream(&s, unsafe { iovecs(iov, cnt) }, 0),
    )
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    dispatch(
        fd,
        Io::write(0),
        (real_writev::cached, real_writev),
        // SAFETY: libc's writev with the caller's arguments.
        move |real| unsafe { real(fd, iov, cnt) },
        // SAFETY: the caller's iovec array.
        move |s| writev_stream(&s, unsafe { iovecs(iov, cnt) }, 0),
    )
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    dispatch(
        fd,
        Io::read(flags),
        (real_recv::cached, real_recv),
        // SAFETY: libc's recv with the caller's arguments.
        move |real| unsafe { real(fd, buf, n, flags) },
        // SAFETY: the caller's buffer of `n` bytes.
        move |s| stream_read(&s, unsafe { slice_mut(buf, n) }, flags),
    )
}

#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
) -> ssize_t {
    if n > buflen {
        eprintln!("softwarp preload: buffer overflow detected in recv");
        std::process::abort();
    }
    // SAFETY: forwarded with the caller's arguments.
    unsafe { recv(fd, buf, n, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    dispatch(
        fd,
        Io::write(flags),
        (real_send::cached, real_send),
        // SAFETY: libc's send with the caller's arguments.
        move |real| unsafe { real(fd, buf, n, flags) },
        // SAFETY: the caller's buffer of `n` bytes.
        move |s| stream_write(&s, unsafe { slice_ref(buf, n) }, flags),
    )
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    dispatch(
        fd,
        Io::read(flags),
        (real_recvfrom::cached, real_recvfrom),
        // SAFETY: libc's recvfrom with the caller's arguments.
        move |real| unsafe { real(fd, buf, n, flags, addr, alen) },
        move |s| {
            if !alen.is_null() {
                // SAFETY: the caller's address length (a connected stream reports none).
                unsafe { *alen = 0 };
            }
            // SAFETY: the caller's buffer of `n` bytes.
            stream_read(&s, unsafe { slice_mut(buf, n) }, flags)
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    if n > buflen {
        eprintln!("softwarp preload: buffer overflow detected in recvfrom");
        std::process::abort();
    }
    // SAFETY: forwarded with the caller's arguments.
    unsafe { recvfrom(fd, buf, n, flags, addr, alen) }
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    alen: socklen_t,
) -> ssize_t {
    dispatch(
        fd,
        Io::write(flags),
        (real_sendto::cached, real_sendto),
        // SAFETY: libc's sendto with the caller's arguments.
        move |real| unsafe { real(fd, buf, n, flags, addr, alen) },
        // SAFETY: the caller's buffer of `n` bytes (the address of a connected stream is
        // ignored, as TCP does).
        move |s| stream_write(&s, unsafe { slice_ref(buf, n) }, flags),
    )
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    dispatch(
        fd,
        Io::read(flags),
        (real_recvmsg::cached, real_recvmsg),
        // SAFETY: libc's recvmsg with the caller's arguments.
        move |real| unsafe { real(fd, msg, flags) },
        move |s| {
            if msg.is_null() {
                return fail(libc::EFAULT);
            }
            // SAFETY: the caller's msghdr and its iovecs.
            unsafe {
                (*msg).msg_namelen = 0;
                (*msg).msg_controllen = 0;
                (*msg).msg_flags = 0;
                let iov = iovecs((*msg).msg_iov, (*msg).msg_iovlen as c_int);
                readv_stream(&s, iov, flags)
            }
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    dispatch(
        fd,
        Io::write(flags),
        (real_sendmsg::cached, real_sendmsg),
        // SAFETY: libc's sendmsg with the caller's arguments.
        move |real| unsafe { real(fd, msg, flags) },
        move |s| {
            if msg.is_null() {
                return fail(libc::EFAULT);
            }
            // SAFETY: the caller's msghdr and its iovecs.
            let iov = unsafe { iovecs((*msg).msg_iov, (*msg).msg_iovlen as c_int) };
            writev_stream(&s, iov, flags)
        },
    )
}

/// `sendfile` to a stream: reads up to 1 MiB of `in_fd` (at `*offset`, or at its file
/// position) and writes it to the stream; returns what the stream took (the file position
/// or `*offset` advance by that much). One copy more than the kernel's sendfile: the bytes
/// go through a buffer into the registered send slots.
///
/// # Safety
/// `offset` is null or the caller's `off_t`.
unsafe fn sendfile_stream(s: &Conn, in_fd: c_int, offset: *mut i64, count: size_t) -> ssize_t {
    let mut buf = vec![0u8; count.min(1 << 20)];
    if buf.is_empty() {
        return 0;
    }
    let n = if offset.is_null() {
        // SAFETY: libc's read into our buffer.
        unsafe { real_read()(in_fd, buf.as_mut_ptr().cast(), buf.len()) }
    } else {
        // SAFETY: libc's pread into our buffer at the caller's offset.
        unsafe { libc::pread64(in_fd, buf.as_mut_ptr().cast(), buf.len(), *offset) }
    };
    let Ok(got) = usize::try_from(n) else {
        return -1;
    };
    if got == 0 {
        return 0;
    }
    let w = stream_write(s, &buf[..got], 0);
    let took = usize::try_from(w).unwrap_or(0);
    let back = i64::try_from(got.saturating_sub(took)).unwrap_or(0);
    if offset.is_null() {
        if back > 0 {
            // Give back what the stream did not take. SAFETY: libc's lseek on the caller's file.
            unsafe { libc::lseek64(in_fd, back.saturating_neg(), libc::SEEK_CUR) };
        }
    } else {
        // SAFETY: the caller's offset.
        unsafe { *offset = (*offset).saturating_add(i64::try_from(took).unwrap_or(0)) };
    }
    w
}

#[no_mangle]
pub unsafe extern "C" fn sendfile(
    out_fd: c_int,
    in_fd: c_int,
    offset: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    dispatch(
        out_fd,
        Io::write(0),
        (real_sendfile::cached, real_sendfile),
        // SAFETY: libc's sendfile with the caller's arguments.
        move |real| unsafe { real(out_fd, in_fd, offset, count) },
        // SAFETY: the caller's offset (off_t is 64 bits here).
        move |s| unsafe { sendfile_stream(&s, in_fd, offset.cast(), count) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(
    out_fd: c_int,
    in_fd: c_int,
    offset: *mut libc::off64_t,
    count: size_t,
) -> ssize_t {
    dispatch(
        out_fd,
        Io::write(0),
        (real_sendfile64::cached, real_sendfile64),
        // SAFETY: libc's sendfile64 with the caller's arguments.
        move |real| unsafe { real(out_fd, in_fd, offset, count) },
        // SAFETY: the caller's offset.
        move |s| unsafe { sendfile_stream(&s, in_fd, offset, count) },
    )
}

/// # Safety
/// `msgs` points to `vlen` valid `mmsghdr`s (or `vlen` is 0).
unsafe fn mmsgs<'a>(msgs: *mut libc::mmsghdr, vlen: libc::c_uint) -> &'a mut [libc::mmsghdr] {
    if msgs.is_null() || vlen == 0 {
        return &mut [];
    }
    // SAFETY: per this function's contract.
    unsafe { std::slice::from_raw_parts_mut(msgs, vlen as usize) }
}

#[no_mangle]
pub unsafe extern "C" fn sendmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    vlen: libc::c_uint,
    flags: c_int,
) -> c_int {
    dispatch(
        fd,
        Io::write(flags),
        (real_sendmmsg::cached, real_sendmmsg),
        // SAFETY: libc's sendmmsg with the caller's arguments.
        move |real| unsafe { real(fd, msgs, vlen, flags) },
        // SAFETY: the caller's array of `vlen` messages.
        move |s| unsafe { sendmmsg_stream(&s, msgs, vlen, flags) },
    )
}

/// `sendmmsg` to a stream: a `writev` per message.
///
/// # Safety
/// `msgs` points to `vlen` valid `mmsghdr`s (or `vlen` is 0).
unsafe fn sendmmsg_stream(
    s: &Conn,
    msgs: *mut libc::mmsghdr,
    vlen: libc::c_uint,
    flags: c_int,
) -> c_int {
    let mut done: c_int = 0;
    // SAFETY: the caller's array of `vlen` messages.
    for m in unsafe { mmsgs(msgs, vlen) } {
        // SAFETY: the caller's iovecs of this message.
        let iov = unsafe { iovecs(m.msg_hdr.msg_iov, m.msg_hdr.msg_iovlen as c_int) };
        let r = writev_stream(s, iov, flags);
        if r < 0 {
            // As the kernel: the count so far, or the error of the first.
            return if done > 0 { done } else { -1 };
        }
        m.msg_len = libc::c_uint::try_from(r).unwrap_or(libc::c_uint::MAX);
        done = done.saturating_add(1);
    }
    done
}

#[no_mangle]
pub unsafe extern "C" fn recvmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    vlen: libc::c_uint,
    flags: c_int,
    timeout: *mut timespec,
) -> c_int {
    dispatch(
        fd,
        Io::read(flags),
        (real_recvmmsg::cached, real_recvmmsg),
        // SAFETY: libc's recvmmsg with the caller's arguments.
        move |real| unsafe { real(fd, msgs, vlen, flags, timeout) },
        // SAFETY: the caller's array of `vlen` messages and timespec.
        move |s| unsafe { recvmmsg_stream(&s, msgs, vlen, flags, timeout) },
    )
}

/// `recvmmsg` from a stream: a `readv` per message.
///
/// # Safety
/// `msgs` points to `vlen` valid `mmsghdr`s (or `vlen` is 0), `timeout` is null or valid.
unsafe fn recvmmsg_stream(
    s: &Conn,
    msgs: *mut libc::mmsghdr,
    vlen: libc::c_uint,
    flags: c_int,
    timeout: *mut timespec,
) -> c_int {
    // As the kernel: the timeout is looked at after each message (a wait for the next one
    // is not cut short), and what is left of it is written back.
    let deadline = if timeout.is_null() {
        None
    } else {
        // SAFETY: the caller's timespec.
        let ts = unsafe { *timeout };
        if ts.tv_sec < 0 || !(0..1_000_000_000).contains(&ts.tv_nsec) {
            return fail(libc::EINVAL);
        }
        let d = Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32);
        Some(Instant::now().checked_add(d))
    };
    let mut done: c_int = 0;
    let mut f = flags & !libc::MSG_WAITFORONE;
    // SAFETY: the caller's array of `vlen` messages.
    for m in unsafe { mmsgs(msgs, vlen) } {
        // SAFETY: the caller's iovecs of this message.
        let iov = unsafe { iovecs(m.msg_hdr.msg_iov, m.msg_hdr.msg_iovlen as c_int) };
        m.msg_hdr.msg_namelen = 0;
        m.msg_hdr.msg_controllen = 0;
        m.msg_hdr.msg_flags = 0;
        let r = readv_stream(s, iov, f);
        if r < 0 {
            return if done > 0 { done } else { -1 };
        }
        m.msg_len = libc::c_uint::try_from(r).unwrap_or(libc::c_uint::MAX);
        done = done.saturating_add(1);
        if r == 0 {
            break;
        }
        if flags & libc::MSG_WAITFORONE != 0 {
            f |= libc::MSG_DONTWAIT;
        }
        if let Some(deadline) = deadline {
            // `None`: a deadline past what `Instant` holds, never reached.
            let left = deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            });
            if deadline.is_some() {
                // SAFETY: the caller's timespec.
                unsafe {
                    (*timeout).tv_sec = libc::time_t::try_from(left.as_secs()).unwrap_or(0);
                    (*timeout).tv_nsec = left.subsec_nanos() as libc::c_long;
                }
            }
            if left.is_zero() {
                break;
            }
        }
    }
    done
}

// ---- rsocket's protocol (`SOFTWARP_SOCKETS_PROTOCOL=rsocket`) -------------------------------

/// An rsocket made in the process before a `fork`, used in the child: unusable there, as
/// an iWARP stream is (its QP and threads stayed in the parent).
fn rsocket_inherited(r: &RsocketEntry) -> bool {
    table::FORKED.load(Ordering::Relaxed) && r.pid != std::process::id()
}

/// `EPIPE` comes with `SIGPIPE` to the calling thread, as from the kernel, unless
/// `MSG_NOSIGNAL`.
fn sigpipe(code: c_int, flags: c_int) {
    if code == libc::EPIPE && flags & libc::MSG_NOSIGNAL == 0 {
        // SAFETY: raise sends a signal to this thread; its disposition is the program's
        // (the default ends the process, as it would over TCP).
        unsafe { libc::raise(libc::SIGPIPE) };
    }
}

/// A read from an rsocket: `rrecv` (which knows `MSG_PEEK`, `MSG_DONTWAIT`, `MSG_WAITALL`).
fn rsocket_read(r: &RsocketEntry, buf: &mut [u8], flags: c_int) -> ssize_t {
    if rsocket_inherited(r) {
        return inherited_eio();
    }
    let flags = flags & (libc::MSG_PEEK | libc::MSG_DONTWAIT | libc::MSG_WAITALL);
    // SAFETY: our slice's buffer and length.
    unsafe { rsock::swv_rrecv(r.rs, buf.as_mut_ptr().cast(), buf.len(), flags) }
}

/// A write to an rsocket: `rsend` (a blocking socket's takes every byte).
fn rsocket_write(r: &RsocketEntry, buf: &[u8], flags: c_int) -> ssize_t {
    if rsocket_inherited(r) {
        return inherited_eio();
    }
    // SAFETY: our slice's buffer and length.
    let n = unsafe {
        rsock::swv_rsend(
            r.rs,
            buf.as_ptr().cast(),
            buf.len(),
            flags & libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        sigpipe(errno(), flags);
    }
    n
}

/// A new rsocket of `family`, non-blocking when the program's socket `fd` is.
fn new_rsocket(fd: c_int, family: c_int) -> Result<Arc<RsocketEntry>, c_int> {
    let rs = rsock::swv_rsocket(family, libc::SOCK_STREAM, 0);
    if rs < 0 {
        return Err(errno());
    }
    let r = Arc::new(RsocketEntry {
        rs,
        pid: std::process::id(),
    });
    if is_nonblocking(fd) {
        rsock::swv_rfcntl(rs, libc::F_SETFL, libc::O_NONBLOCK);
    }
    Ok(r)
}

/// Puts the rsocket `r` behind the program's descriptor `fd`: `fd` becomes a duplicate of
/// the rsocket's number (closing the program's TCP socket, and with it a port it was bound
/// to), and the epoll sets holding `fd` keep it (registered for no event: `epoll_wait`
/// answers for it from the rsocket and sleeps on its wake-up descriptor).
fn adopt_rsocket(fd: c_int, r: Arc<RsocketEntry>) -> Result<(), c_int> {
    // SAFETY: F_GETFD on the program's descriptor.
    let cloexec = unsafe { real_fcntl()(fd, libc::F_GETFD, 0) } & libc::FD_CLOEXEC != 0;
    let regs = epoll_detach(fd);
    // SAFETY: dup3 of the rsocket's number (an eventfd it owns) over the program's
    // descriptor number.
    if unsafe { real_dup3()(r.rs, fd, if cloexec { libc::O_CLOEXEC } else { 0 }) } < 0 {
        let e = errno();
        epoll_attach(fd, &regs, false);
        return Err(e);
    }
    table::insert(fd, Entry::Rsocket(r));
    epoll_attach_rsocket(fd, &regs);
    close_at_exit();
    Ok(())
}

/// The address the program's socket `fd` is bound to, when it is (a port or an address
/// other than the wildcard).
fn bound_address(fd: c_int) -> Option<(libc::sockaddr_storage, socklen_t)> {
    // SAFETY: a zeroed sockaddr_storage is a valid out buffer for getsockname.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    // SAFETY: getsockname into our buffer of `len` bytes.
    if unsafe { real_getsockname()(fd, (&raw mut ss).cast(), &mut len) } != 0 {
        return None;
    }
    let addr = (&raw const ss).cast::<sockaddr>();
    // SAFETY: the kernel wrote an address of the socket's family.
    let wildcard = unsafe {
        match c_int::from(ss.ss_family) {
            libc::AF_INET => (*addr.cast::<libc::sockaddr_in>()).sin_addr.s_addr == 0,
            libc::AF_INET6 => (*addr.cast::<libc::sockaddr_in6>()).sin6_addr.s6_addr == [0; 16],
            _ => return None,
        }
    };
    (port_of(addr).is_some_and(|p| p != 0) || !wildcard).then_some((ss, len))
}

/// The family of the program's socket `fd`.
fn family_of(fd: c_int) -> c_int {
    raw_option(fd, libc::SOL_SOCKET, libc::SO_DOMAIN).map_or(libc::AF_INET, |(b, _)| {
        c_int::from_ne_bytes([b[0], b[1], b[2], b[3]])
    })
}

/// `connect` of a switched socket with the rsocket protocol: an rsocket takes the socket's
/// place (and its address, when the program bound it), then `rconnect` (`EINPROGRESS` on
/// a non-blocking socket; the connection then completes in `poll`, `epoll_wait`, I/O or
/// `getsockopt(SO_ERROR)`, as rsocket's).
///
/// # Safety
/// `addr` is the caller's address of `len` bytes.
unsafe fn rsocket_connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    let bound = bound_address(fd);
    let r = match new_rsocket(fd, family_of(fd)) {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    let rs = r.rs;
    if let Err(e) = adopt_rsocket(fd, r) {
        return fail(e);
    }
    if let Some((ss, slen)) = bound {
        // SAFETY: the address getsockname wrote, of `slen` bytes.
        if unsafe { rsock::swv_rbind(rs, (&raw const ss).cast(), slen) } != 0 {
            return -1;
        }
    }
    // SAFETY: the caller's address of `len` bytes.
    unsafe { rsock::swv_rconnect(rs, addr, len) }
}

/// `listen` of a switched socket with the rsocket protocol: an rsocket takes the socket's
/// place, bound to its address (the options `SO_REUSEADDR` and `IPV6_V6ONLY` copied), and
/// listens.
fn rsocket_listen(fd: c_int, backlog: c_int) -> c_int {
    let bound = bound_address(fd);
    let r = match new_rsocket(fd, family_of(fd)) {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    let rs = r.rs;
    for (level, name) in [
        (libc::SOL_SOCKET, libc::SO_REUSEADDR),
        (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY),
    ] {
        if let Some((b, l)) = raw_option(fd, level, name) {
            // SAFETY: the option value the kernel wrote, `l` bytes.
            unsafe { rsock::swv_rsetsockopt(rs, level, name, b.as_ptr().cast(), l) };
        }
    }
    if let Err(e) = adopt_rsocket(fd, r) {
        return fail(e);
    }
    if let Some((ss, slen)) = bound {
        // SAFETY: the address getsockname wrote, of `slen` bytes.
        if unsafe { rsock::swv_rbind(rs, (&raw const ss).cast(), slen) } != 0 {
            return -1;
        }
    }
    rsock::swv_rlisten(rs, backlog)
}

/// `accept4` on a listening rsocket: `raccept`, and a new descriptor of the program that
/// is a duplicate of the accepted rsocket's number (`SOCK_NONBLOCK`, `SOCK_CLOEXEC` as
/// asked).
///
/// # Safety
/// `addr` and `len` are the caller's (null or valid).
unsafe fn rsocket_accept(
    l: &RsocketEntry,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    if rsocket_inherited(l) {
        return fail(libc::EIO);
    }
    // SAFETY: the caller's buffer and length.
    let n = unsafe { rsock::swv_raccept(l.rs, addr, len) };
    if n < 0 {
        return -1;
    }
    let r = Arc::new(RsocketEntry {
        rs: n,
        pid: std::process::id(),
    });
    let nb = if flags & libc::SOCK_NONBLOCK != 0 {
        libc::O_NONBLOCK
    } else {
        0
    };
    rsock::swv_rfcntl(n, libc::F_SETFL, nb);
    let cmd = if flags & libc::SOCK_CLOEXEC != 0 {
        libc::F_DUPFD_CLOEXEC
    } else {
        libc::F_DUPFD
    };
    // SAFETY: fcntl(F_DUPFD) of the rsocket's number: the program's descriptor.
    let k = unsafe { real_fcntl()(n, cmd, 0) };
    if k < 0 {
        return -1;
    }
    table::insert(k, Entry::Rsocket(r));
    k
}

/// An rsocket's readiness for poll's `events` (`POLLNVAL` once it is gone), arming its
/// wake-up descriptor first, which it returns (-1: none, a socket not connecting,
/// connected or listening).
fn rsocket_readiness(r: &RsocketEntry, events: i16) -> (i16, c_int) {
    if rsocket_inherited(r) {
        return (libc::POLLERR, -1);
    }
    // rpoll's order: arm, then look (a completion between the two still wakes the sleep).
    let wake = rsock::poll::watch(r.rs).unwrap_or(-1);
    let mut want = events;
    if events & libc::POLLRDNORM != 0 {
        want |= libc::POLLIN;
    }
    if events & libc::POLLWRNORM != 0 {
        want |= libc::POLLOUT;
    }
    let mut rev = rsock::poll::events(r.rs, want).unwrap_or(libc::POLLNVAL);
    if rev & libc::POLLIN != 0 {
        rev |= events & libc::POLLRDNORM;
        rev &= !(libc::POLLIN & !events);
    }
    if rev & libc::POLLOUT != 0 {
        rev |= events & libc::POLLWRNORM;
        rev &= !(libc::POLLOUT & !events);
    }
    (rev, wake)
}

// ---- closing, duplicating, flags ---------------------------------------------------------

/// Lets go of an entry: a stream whose last descriptor this was is closed (EOF sent, QP
/// disconnected); in a forked child nothing of the parent's stack is touched.
fn release(e: Option<Entry>) {
    if let Some(Entry::Stream(s)) = e {
        if inherited(&s) {
            std::mem::forget(s);
            return;
        }
        if Arc::strong_count(&s) == 1 && config::get().stats {
            print_stats(&s);
        }
        drop(s);
    }
}

/// `SOFTWARP_SOCKETS_STATS=1`: one line per stream on stderr when it closes, from its QP's
/// counters (what went over iWARP).
fn print_stats(s: &StreamEntry) {
    let Some(st) = s.stream.qp_stats() else {
        return;
    };
    let peer = s
        .stream
        .peer_addr()
        .map_or_else(|_| "?".to_string(), |a| a.to_string());
    eprintln!(
        "softwarp preload: pid {} closed iWARP stream qpn {} peer {peer}: tx {} Sends {} bytes, \
         rx {} Sends {} bytes, {} FPDUs out, {} FPDUs in",
        std::process::id(),
        s.stream.qp_num().unwrap_or(0),
        st.tx.send.messages,
        st.tx.send.bytes,
        st.rx.send.messages,
        st.rx.send.bytes,
        st.tx_fpdus,
        st.rx_fpdus,
    );
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    let e = table::remove(fd);
    if e.is_some() {
        // A stream's eventfd stays open in the stack: its epoll registrations go with the
        // program's descriptor, as a socket's would.
        epoll_detach(fd);
        epoll_reg::with(|r| r.retain(|x| x.fd != fd));
    }
    release(e);
    // SAFETY: libc's close.
    unsafe { real_close()(fd) }
}

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    if let Some(Entry::Rsocket(r)) = table::get(fd) {
        return rsock::swv_rshutdown(r.rs, how);
    }
    let Some(s) = table::stream(fd) else {
        // SAFETY: libc's shutdown.
        return unsafe { real_shutdown()(fd, how) };
    };
    let how = match how {
        libc::SHUT_RD => std::net::Shutdown::Read,
        libc::SHUT_WR => std::net::Shutdown::Write,
        libc::SHUT_RDWR => std::net::Shutdown::Both,
        _ => return fail(libc::EINVAL),
    };
    // A blocking socket's shutdown waits until the EOF has left (the stream's own rule);
    // a non-blocking one returns at once, as the kernel's.
    let _ = s
        .stream
        .set_nonblocking(s.nonblocking.load(Ordering::Relaxed));
    match s.stream.shutdown(how) {
        Ok(()) => 0,
        Err(e) => fail(errno_of(&e)),
    }
}

/// After a successful duplication of `old` as `new`: `new` is what `old` is.
fn duplicated(old: c_int, new: c_int) {
    if new < 0 || new == old {
        return;
    }
    match table::get(old) {
        Some(e) => release(table::insert(new, e)),
        None => release(table::remove(new)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: libc's dup.
    let n = unsafe { real_dup()(fd) };
    duplicated(fd, n);
    n
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    // SAFETY: libc's dup2.
    let n = unsafe { real_dup2()(old, new) };
    duplicated(old, n);
    n
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    // SAFETY: libc's dup3.
    let n = unsafe { real_dup3()(old, new, flags) };
    duplicated(old, n);
    n
}

// fcntl and ioctl are variadic in C. Rust cannot define a variadic function on stable; on
// x86-64 and AArch64 Linux a variadic integer or pointer argument travels in the same
// register as a fixed one, so the third argument is taken as a machine word.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    let Some(e) = table::get(fd) else {
        // SAFETY: libc's fcntl with the caller's arguments.
        return unsafe { real_fcntl()(fd, cmd, arg) };
    };
    match (cmd, &e) {
        // rsocket keeps the program's flags (`O_NONBLOCK`); the eventfd behind the
        // descriptor is not the socket.
        (libc::F_GETFL, Entry::Rsocket(r)) => match rsock::swv_rfcntl(r.rs, cmd, 0) {
            fl if fl < 0 => fl,
            fl => libc::O_RDWR | fl,
        },
        (libc::F_SETFL, Entry::Rsocket(r)) => {
            rsock::swv_rfcntl(r.rs, cmd, arg as c_int & libc::O_NONBLOCK)
        }
        (libc::F_GETFL, Entry::Stream(s)) => {
            let nb = if s.nonblocking.load(Ordering::Relaxed) {
                libc::O_NONBLOCK
            } else {
                0
            };
            libc::O_RDWR | nb
        }
        (libc::F_SETFL, Entry::Stream(s)) => {
            // The eventfd itself stays non-blocking (the stack drains it).
            s.nonblocking
                .store(arg as c_int & libc::O_NONBLOCK != 0, Ordering::Relaxed);
            0
        }
        (libc::F_GETFL, Entry::Deferred(d)) => {
            // SAFETY: libc's fcntl with the caller's arguments.
            let fl = unsafe { real_fcntl()(fd, cmd, arg) };
            if fl < 0 {
                return fl;
            }
            let nb = if d.nonblocking.load(Ordering::Relaxed) {
                libc::O_NONBLOCK
            } else {
                0
            };
            (fl & !libc::O_NONBLOCK) | nb
        }
        (libc::F_SETFL, Entry::Deferred(d)) => {
            d.nonblocking
                .store(arg as c_int & libc::O_NONBLOCK != 0, Ordering::Relaxed);
            let arg = if exchange_started(d) {
                arg | libc::O_NONBLOCK as usize
            } else {
                arg
            };
            // SAFETY: libc's fcntl with the caller's flags (O_NONBLOCK kept while the
            // exchange runs).
            unsafe { real_fcntl()(fd, cmd, arg) }
        }
        (libc::F_DUPFD | libc::F_DUPFD_CLOEXEC, _) => {
            // SAFETY: libc's fcntl with the caller's arguments.
            let n = unsafe { real_fcntl()(fd, cmd, arg) };
            duplicated(fd, n);
            n
        }
        // SAFETY: libc's fcntl with the caller's arguments.
        _ => unsafe { real_fcntl()(fd, cmd, arg) },
    }
}

/// `fcntl64`: what glibc's `fcntl` is under `_FILE_OFFSET_BITS=64` (Debian builds redis
/// that way). On a 64-bit host both are one function taking the same arguments; without
/// this, `F_GETFL`/`F_SETFL` of a switched socket reached the descriptor behind it (an
/// rsocket's eventfd, always non-blocking), and redis, seeing `O_NONBLOCK` already set,
/// left its listening rsocket blocking: its accept loop then slept in `raccept`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    // SAFETY: the caller's arguments, as fcntl's.
    unsafe { fcntl(fd, cmd, arg) }
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: libc::c_ulong, arg: usize) -> c_int {
    if let Some(Entry::Rsocket(r)) = table::get(fd) {
        let p = arg as *const c_int;
        if req != libc::FIONBIO {
            // rsocket answers no ioctl (librspreload passes them to the descriptor, an
            // rsocket's CM channel, which answers none either).
            return fail(libc::ENOTTY);
        }
        if p.is_null() {
            return fail(libc::EFAULT);
        }
        // SAFETY: FIONBIO's argument is the caller's int.
        let on = unsafe { *p } != 0;
        return rsock::swv_rfcntl(r.rs, libc::F_SETFL, if on { libc::O_NONBLOCK } else { 0 });
    }
    if let (Some(Entry::Deferred(d)), libc::FIONBIO) = (table::get(fd), req) {
        let p = arg as *const c_int;
        if p.is_null() {
            return fail(libc::EFAULT);
        }
        // SAFETY: FIONBIO's argument is the caller's int.
        d.nonblocking.store(unsafe { *p } != 0, Ordering::Relaxed);
        if exchange_started(&d) {
            return 0;
        }
    }
    let Some(s) = table::stream(fd) else {
        // SAFETY: libc's ioctl with the caller's arguments.
        return unsafe { real_ioctl()(fd, req, arg) };
    };
    let p = arg as *mut c_int;
    if p.is_null() {
        return fail(libc::EFAULT);
    }
    match req {
        libc::FIONREAD => {
            let n = c_int::try_from(s.stream.bytes_readable()).unwrap_or(c_int::MAX);
            // SAFETY: FIONREAD's argument is the caller's int.
            unsafe { *p = n };
            0
        }
        libc::FIONBIO => {
            // SAFETY: FIONBIO's argument is the caller's int.
            let on = unsafe { *p } != 0;
            s.nonblocking.store(on, Ordering::Relaxed);
            0
        }
        _ => fail(libc::ENOTTY),
    }
}

#[no_mangle]
pub unsafe extern "C" fn fork() -> libc::pid_t {
    // SAFETY: libc's fork.
    let pid = unsafe { real_fork()() };
    if pid == 0 {
        // The parent's streams stay unusable here (`EIO`); connections accepted but not
        // yet set up, and new sockets, get a device of the child's own.
        table::FORKED.store(true, Ordering::Relaxed);
        softwarp_sockets::forget_default_device_after_fork();
    }
    pid
}

// ---- readiness -------------------------------------------------------------------------------

/// Readiness as poll bits for `events` (`POLLHUP` and `POLLERR` are always reported, as
/// by the kernel).
fn revents_of(r: &Readiness, events: i16) -> i16 {
    let mut rev = 0;
    if r.readable {
        rev |= events & (libc::POLLIN | libc::POLLRDNORM);
    }
    if r.writable {
        rev |= events & (libc::POLLOUT | libc::POLLWRNORM);
    }
    if r.peer_closed {
        rev |= events & libc::POLLRDHUP;
    }
    if r.hangup {
        rev |= libc::POLLHUP;
    }
    if r.error {
        rev |= libc::POLLERR;
    }
    rev
}

/// Readiness of a stream, arming it when nothing is ready: for room to send too only when
/// the caller waits for it (`write`: `POLLOUT`/`EPOLLOUT` asked).
fn stream_readiness(s: &StreamEntry, waiter: Option<&StreamWaiter<'_>>, write: bool) -> Readiness {
    if inherited(s) {
        return Readiness {
            error: true,
            ..Readiness::default()
        };
    }
    match waiter {
        Some(w) => w.arm_readiness_for(write),
        None => s.stream.arm_readiness_for(write),
    }
}

/// Counts this thread as waiting on each stream of `kinds` (see
/// [`softwarp_sockets::IwarpStream::waiter`]): before their readiness is looked at, so
/// that another thread's call that takes a completion from then on kicks this wait.
fn waiters(kinds: &[Polled]) -> Vec<Option<StreamWaiter<'_>>> {
    kinds
        .iter()
        .map(|k| match k {
            Polled::Stream(s) if !inherited(s) => s.stream.waiter(),
            _ => None,
        })
        .collect()
}

/// The kicks of `waiters` as poll entries, appended to `set`, each followed by its stream's
/// socket watch unless `quiet` says to leave it out (its last serve brought nothing).
/// Returns, for each entry, its waiter's index and whether it is the socket watch.
fn push_kicks(
    set: &mut Vec<pollfd>,
    waiters: &[Option<StreamWaiter<'_>>],
    quiet: &[bool],
) -> Vec<(usize, bool)> {
    let mut what = Vec::with_capacity(2 * waiters.len());
    for (i, w) in waiters.iter().enumerate() {
        let Some(w) = w else {
            continue;
        };
        let watch = !quiet.get(i).copied().unwrap_or(false);
        for (fd, socket) in [(w.kick_fd(), false), (w.socket_fd(), true)] {
            if socket && !watch {
                continue;
            }
            set.push(pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(&fd),
                events: libc::POLLIN,
                revents: 0,
            });
            what.push((i, socket));
        }
    }
    what
}

/// Takes the kicks that `set[from..]` (made by [`push_kicks`], whose entries `what` names)
/// reports, and moves the bytes of the streams whose socket watch it reports on this thread
/// (`StreamWaiter::serve`). Sets `quiet` for the streams whose serve brought nothing
/// (another thread was moving the bytes, or a socket readable for good at its end), clears
/// it for the rest. True when a serve brought an event: the readiness must be asked again.
fn take_kicks(
    set: &[pollfd],
    from: usize,
    what: &[(usize, bool)],
    waiters: &[Option<StreamWaiter<'_>>],
    quiet: &mut Vec<bool>,
) -> bool {
    quiet.clear();
    quiet.resize(waiters.len(), false);
    let mut served = false;
    for (p, &(i, socket)) in set.iter().skip(from).zip(what) {
        let Some(w) = waiters.get(i).and_then(Option::as_ref) else {
            continue;
        };
        if p.revents & libc::POLLIN == 0 {
            continue;
        }
        if !socket {
            w.take_kick();
        } else if w.serve() {
            served = true;
        } else if let Some(q) = quiet.get_mut(i) {
            *q = true;
        }
    }
    served
}

fn deadline_of(timeout_ms: c_int) -> Option<Instant> {
    u64::try_from(timeout_ms)
        .ok()
        .and_then(|ms| Instant::now().checked_add(Duration::from_millis(ms)))
}

/// What a connect that failed reports: writable, readable (the EOF), hung up, and the
/// error while `SO_ERROR` did not take it.
fn failed_revents(e: &AtomicI32, events: i16) -> i16 {
    let mut rev = libc::POLLHUP | (events & (libc::POLLOUT | libc::POLLIN | libc::POLLRDHUP));
    if e.load(Ordering::Relaxed) != 0 {
        rev |= libc::POLLERR;
    }
    rev
}

/// What kind of descriptor of ours a poll set holds.
#[derive(Clone)]
enum Polled {
    Stream(Arc<StreamEntry>),
    /// An MPA exchange under way, waiting for its socket to be writable (`write`: the TCP
    /// connect, the Request) or readable (the peer's next bytes); never ready itself.
    Deferred {
        write: bool,
    },
    Failed(Arc<AtomicI32>),
    Rsocket(Arc<RsocketEntry>),
    Other,
}

fn polled(fd: c_int) -> Polled {
    match table::get(fd) {
        Some(Entry::Stream(s)) => Polled::Stream(s),
        Some(Entry::Deferred(d)) => Polled::Deferred {
            write: d.wants_write.load(Ordering::Relaxed),
        },
        Some(Entry::Failed(e)) => Polled::Failed(e),
        Some(Entry::Rsocket(r)) => Polled::Rsocket(r),
        _ => Polled::Other,
    }
}

fn special(fd: c_int) -> bool {
    !matches!(polled(fd), Polled::Other)
}

/// poll(2) over a set that holds at least one descriptor of ours (a stream, a connect in
/// progress or a failed one).
fn poll_mixed(fds: &mut [pollfd], deadline: Option<Instant>, forever: bool) -> c_int {
    let mut tmp: Vec<pollfd> = fds.to_vec();
    // Streams whose socket watch the next wait leaves out (see `take_kicks`).
    let mut quiet = Vec::new();
    loop {
        // The MPA exchanges under way advance with what their sockets have, and fail once
        // their deadline passed (a socket that stays silent never wakes the wait below).
        for p in fds.iter() {
            if matches!(table::get(p.fd), Some(Entry::Deferred(_))) {
                finish(p.fd, Block::No);
            }
        }
        let kinds: Vec<Polled> = fds.iter().map(|p| polled(p.fd)).collect();
        let waiting = waiters(&kinds);
        tmp.truncate(fds.len());
        let mut ours_ready = 0;
        for (i, p) in fds.iter_mut().enumerate() {
            tmp[i] = pollfd {
                fd: p.fd,
                events: p.events,
                revents: 0,
            };
            match &kinds[i] {
                Polled::Stream(s) => {
                    let w = waiting.get(i).and_then(Option::as_ref);
                    let write = p.events & (libc::POLLOUT | libc::POLLWRNORM) != 0;
                    p.revents = revents_of(&stream_readiness(s, w, write), p.events);
                    if p.revents != 0 {
                        ours_ready += 1;
                    }
                    tmp[i].events = libc::POLLIN;
                }
                Polled::Deferred { write: true } => tmp[i].events = libc::POLLOUT,
                Polled::Deferred { write: false } => tmp[i].events = libc::POLLIN,
                Polled::Failed(e) => {
                    p.revents = failed_revents(e, p.events);
                    ours_ready += 1;
                }
                // rpoll's per-socket step: the wake-up descriptor armed, then the state.
                Polled::Rsocket(r) => {
                    let (rev, wake) = rsocket_readiness(r, p.events);
                    p.revents = rev;
                    if rev != 0 {
                        ours_ready += 1;
                    }
                    tmp[i] = pollfd {
                        fd: wake,
                        events: libc::POLLIN,
                        revents: 0,
                    };
                }
                Polled::Other => {}
            }
        }
        let wait = if ours_ready > 0 {
            0
        } else {
            let left = deadline.map_or(SLICE, |d| d.saturating_duration_since(Instant::now()));
            if !forever && left.is_zero() {
                0
            } else {
                left.min(SLICE).as_millis() as c_int
            }
        };
        let what = push_kicks(&mut tmp, &waiting, &quiet);
        // SAFETY: libc's poll over our copy of the set.
        let n = unsafe { real_poll()(tmp.as_mut_ptr(), tmp.len() as nfds_t, wait) };
        if n < 0 {
            return -1;
        }
        let mut changed = take_kicks(&tmp, fds.len(), &what, &waiting, &mut quiet);
        let mut others = 0;
        for (i, p) in fds.iter_mut().enumerate() {
            match &kinds[i] {
                Polled::Other => {
                    p.revents = tmp[i].revents;
                    if p.revents != 0 {
                        others += 1;
                    }
                }
                // Bytes (or room) for the MPA exchange: advance it; once it ended, look
                // again.
                Polled::Deferred { .. } if tmp[i].revents != 0 => {
                    changed |= !matches!(finish(p.fd, Block::No), Progress::Pending);
                }
                // Its completion channel (or CM channel) fired: take the event and look
                // again.
                Polled::Rsocket(r) if tmp[i].revents != 0 => {
                    rsock::poll::woken(r.rs);
                    changed |= ours_ready == 0;
                }
                _ => {}
            }
        }
        if changed {
            continue;
        }
        if ours_ready + others > 0 {
            return ours_ready + others;
        }
        if !forever && deadline.is_none_or(|d| Instant::now() >= d) {
            return 0;
        }
    }
}

fn any_stream(fds: &[pollfd]) -> bool {
    fds.iter().any(|p| special(p.fd))
}

/// libc's function, once resolved, when no descriptor is ours: the pass-through of `poll`
/// and `select`, before they look at their descriptors.
#[inline(always)]
fn none_ours<F>(cached: fn() -> Option<F>) -> Option<F> {
    if table::any_ours() {
        return None;
    }
    cached()
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    if let Some(real) = none_ours(real_poll::cached) {
        // SAFETY: libc's poll with the caller's arguments.
        return unsafe { real(fds, n, timeout) };
    }
    // SAFETY: the caller's arguments, as libc's poll takes them.
    unsafe { poll_ours(fds, n, timeout) }
}

/// `poll` when some descriptor is ours.
///
/// # Safety
/// As libc's `poll`.
#[inline(never)]
unsafe fn poll_ours(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    let set: &mut [pollfd] = if fds.is_null() || n == 0 {
        &mut []
    } else {
        // SAFETY: the caller's array of `n` pollfds.
        unsafe { std::slice::from_raw_parts_mut(fds, n as usize) }
    };
    if !table::any_ours() || !any_stream(set) {
        // SAFETY: libc's poll with the caller's arguments.
        return unsafe { real_poll()(fds, n, timeout) };
    }
    poll_mixed(set, deadline_of(timeout), timeout < 0)
}

#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    timeout: c_int,
    fdslen: size_t,
) -> c_int {
    if (n as usize).saturating_mul(std::mem::size_of::<pollfd>()) > fdslen {
        eprintln!("softwarp preload: buffer overflow detected in poll");
        std::process::abort();
    }
    // SAFETY: forwarded with the caller's arguments.
    unsafe { poll(fds, n, timeout) }
}

fn ms_of(ts: Option<Duration>) -> c_int {
    ts.map_or(-1, |d| c_int::try_from(d.as_millis()).unwrap_or(c_int::MAX))
}

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    if let Some(real) = none_ours(real_ppoll::cached) {
        // SAFETY: libc's ppoll with the caller's arguments.
        return unsafe { real(fds, n, ts, mask) };
    }
    // SAFETY: the caller's arguments, as libc's ppoll takes them.
    unsafe { ppoll_ours(fds, n, ts, mask) }
}

/// `ppoll` when some descriptor is ours.
///
/// # Safety
/// As libc's `ppoll`.
#[inline(never)]
unsafe fn ppoll_ours(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    let set: &mut [pollfd] = if fds.is_null() || n == 0 {
        &mut []
    } else {
        // SAFETY: the caller's array of `n` pollfds.
        unsafe { std::slice::from_raw_parts_mut(fds, n as usize) }
    };
    if !table::any_ours() || !any_stream(set) {
        // SAFETY: libc's ppoll with the caller's arguments.
        return unsafe { real_ppoll()(fds, n, ts, mask) };
    }
    // SAFETY: the caller's timespec, if any.
    let t = (!ts.is_null()).then(|| unsafe {
        Duration::new(
            (*ts).tv_sec.max(0) as u64,
            (*ts).tv_nsec.clamp(0, 999_999_999) as u32,
        )
    });
    let ms = ms_of(t);
    poll_mixed(set, deadline_of(ms), ms < 0)
}

/// select(2) and pselect(2) through [`poll_mixed`] when a set holds an iWARP descriptor.
///
/// # Safety
/// The sets are the caller's (null or valid), `nfds` at most `FD_SETSIZE`.
unsafe fn select_mixed(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    x: *mut fd_set,
    timeout: Option<Duration>,
) -> Option<c_int> {
    let n = nfds.clamp(0, libc::FD_SETSIZE as c_int);
    // SAFETY: FD_ISSET on the caller's sets for descriptors below FD_SETSIZE.
    let isset = |set: *mut fd_set, fd: c_int| !set.is_null() && unsafe { libc::FD_ISSET(fd, set) };
    // Pass-through first: no descriptor of ours at all, or none in the sets (one bitmap
    // load per descriptor set): the real call, with nothing allocated.
    if !table::any_ours()
        || !(0..n).any(|fd| (isset(r, fd) || isset(w, fd) || isset(x, fd)) && special(fd))
    {
        return None;
    }
    let mut fds = Vec::new();
    for fd in 0..n {
        let mut ev = 0;
        if isset(r, fd) {
            ev |= libc::POLLIN;
        }
        if isset(w, fd) {
            ev |= libc::POLLOUT;
        }
        if isset(x, fd) {
            ev |= libc::POLLPRI;
        }
        if ev != 0 {
            fds.push(pollfd {
                fd,
                events: ev,
                revents: 0,
            });
        }
    }
    let ms = ms_of(timeout);
    let got = poll_mixed(&mut fds, deadline_of(ms), ms < 0);
    if got < 0 {
        return Some(-1);
    }
    let mut count = 0;
    // SAFETY: FD_ZERO/FD_SET on the caller's sets.
    unsafe {
        for set in [r, w, x] {
            if !set.is_null() {
                libc::FD_ZERO(set);
            }
        }
        for p in &fds {
            let bad = p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0;
            if !r.is_null()
                && p.events & libc::POLLIN != 0
                && (p.revents & libc::POLLIN != 0 || bad)
            {
                libc::FD_SET(p.fd, r);
                count += 1;
            }
            if !w.is_null()
                && p.events & libc::POLLOUT != 0
                && (p.revents & libc::POLLOUT != 0 || bad)
            {
                libc::FD_SET(p.fd, w);
                count += 1;
            }
            if !x.is_null() && p.events & libc::POLLPRI != 0 && p.revents & libc::POLLPRI != 0 {
                libc::FD_SET(p.fd, x);
                count += 1;
            }
        }
    }
    Some(count)
}

#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    x: *mut fd_set,
    tv: *mut timeval,
) -> c_int {
    if let Some(real) = none_ours(real_select::cached) {
        // SAFETY: libc's select with the caller's arguments.
        return unsafe { real(nfds, r, w, x, tv) };
    }
    // SAFETY: the caller's arguments, as libc's select takes them.
    unsafe { select_ours(nfds, r, w, x, tv) }
}

/// `select` when some descriptor is ours.
///
/// # Safety
/// As libc's `select`.
#[inline(never)]
unsafe fn select_ours(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    x: *mut fd_set,
    tv: *mut timeval,
) -> c_int {
    // SAFETY: the caller's timeval, if any.
    let t = (!tv.is_null()).then(|| unsafe {
        Duration::new(
            (*tv).tv_sec.max(0) as u64,
            ((*tv).tv_usec.clamp(0, 999_999) as u32) * 1000,
        )
    });
    // SAFETY: the caller's sets.
    match unsafe { select_mixed(nfds, r, w, x, t) } {
        Some(n) => n,
        // SAFETY: libc's select with the caller's arguments.
        None => unsafe { real_select()(nfds, r, w, x, tv) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    x: *mut fd_set,
    ts: *const timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    if let Some(real) = none_ours(real_pselect::cached) {
        // SAFETY: libc's pselect with the caller's arguments.
        return unsafe { real(nfds, r, w, x, ts, mask) };
    }
    // SAFETY: the caller's arguments, as libc's pselect takes them.
    unsafe { pselect_ours(nfds, r, w, x, ts, mask) }
}

/// `pselect` when some descriptor is ours.
///
/// # Safety
/// As libc's `pselect`.
#[inline(never)]
unsafe fn pselect_ours(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    x: *mut fd_set,
    ts: *const timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: the caller's timespec, if any.
    let t = (!ts.is_null()).then(|| unsafe {
        Duration::new(
            (*ts).tv_sec.max(0) as u64,
            (*ts).tv_nsec.clamp(0, 999_999_999) as u32,
        )
    });
    // SAFETY: the caller's sets.
    match unsafe { select_mixed(nfds, r, w, x, t) } {
        Some(n) => n,
        // SAFETY: libc's pselect with the caller's arguments.
        None => unsafe { real_pselect()(nfds, r, w, x, ts, mask) },
    }
}

// ---- epoll -----------------------------------------------------------------------------------

mod epoll_reg {
    //! The descriptors of ours registered in each epoll set, with the program's events and
    //! data: `epoll_wait` reports them from the streams' readiness.
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    /// One registration.
    #[derive(Debug, Clone, Copy)]
    pub struct Reg {
        pub epfd: i32,
        pub fd: i32,
        /// The program's events (`EPOLLET`, `EPOLLONESHOT` included).
        pub events: u32,
        pub data: u64,
        /// Edge-triggered: the stream's event counts when last reported.
        pub last: Option<(u64, u64)>,
        /// `EPOLLONESHOT` reported: silent until `EPOLL_CTL_MOD`.
        pub disabled: bool,
    }

    static REG: Mutex<Vec<Reg>> = Mutex::new(Vec::new());
    /// How many registrations there are: `epoll_wait` and `epoll_ctl` of a program with
    /// none (pass-through) read this instead of taking the lock.
    static COUNT: AtomicUsize = AtomicUsize::new(0);

    pub fn with<T>(f: impl FnOnce(&mut Vec<Reg>) -> T) -> T {
        let mut g = REG.lock().unwrap_or_else(|p| p.into_inner());
        let r = f(&mut g);
        COUNT.store(g.len(), Ordering::Relaxed);
        r
    }

    /// True when some descriptor of ours is registered in an epoll set.
    pub fn any() -> bool {
        COUNT.load(Ordering::Relaxed) != 0
    }
}

use epoll_reg::Reg;

/// Before `fd` changes what it refers to (`dup3` in [`adopt`]): takes the kernel's
/// registrations of `fd` out of the epoll sets that hold it; returns them.
fn epoll_detach(fd: c_int) -> Vec<Reg> {
    let regs: Vec<Reg> = epoll_reg::with(|r| r.iter().filter(|e| e.fd == fd).copied().collect());
    for r in &regs {
        // SAFETY: libc's epoll_ctl on the program's epoll set.
        unsafe { real_epoll_ctl()(r.epfd, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
    }
    regs
}

/// After `fd` changed: registers it again in the same sets, as a stream (its eventfd, for
/// wake-ups) or, `stream` false, as the plain socket it now is (then the kernel reports
/// it and our record goes).
fn epoll_attach(fd: c_int, regs: &[Reg], stream: bool) {
    for r in regs {
        let mut ev = epoll_event {
            events: if stream {
                libc::EPOLLIN as u32
            } else {
                r.events
            },
            u64: r.data,
        };
        // SAFETY: libc's epoll_ctl on the program's epoll set with our event.
        unsafe { real_epoll_ctl()(r.epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) };
    }
    if !stream {
        epoll_reg::with(|all| all.retain(|e| e.fd != fd));
    }
}

/// After `fd` became an rsocket: registers it again in the sets that held it, for no event
/// (the descriptor is the rsocket's eventfd, which nothing signals): `epoll_wait` answers
/// for it from the rsocket and sleeps on its wake-up descriptor.
fn epoll_attach_rsocket(fd: c_int, regs: &[Reg]) {
    for r in regs {
        let mut ev = epoll_event {
            events: 0,
            u64: r.data,
        };
        // SAFETY: libc's epoll_ctl on the program's epoll set with our event.
        unsafe { real_epoll_ctl()(r.epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) };
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut epoll_event,
) -> c_int {
    let kind = polled(fd);
    if matches!(kind, Polled::Other) {
        if op == libc::EPOLL_CTL_DEL && epoll_reg::any() {
            epoll_reg::with(|r| r.retain(|e| !(e.epfd == epfd && e.fd == fd)));
        }
        // SAFETY: libc's epoll_ctl with the caller's arguments.
        return unsafe { real_epoll_ctl()(epfd, op, fd, ev) };
    }
    let (events, data) = if ev.is_null() {
        (0, 0)
    } else {
        // SAFETY: the caller's epoll_event.
        unsafe { ((*ev).events, (*ev).u64) }
    };
    // The kernel watches for wake-ups only: a stream's eventfd (level-triggered, input),
    // or a deferred socket's bytes and room for its MPA exchange (edge-triggered: once per
    // arrival, so that bytes the exchange has not read yet, or a peer's EOF, do not keep
    // the set readable; `epoll_wait` answers for the socket from the exchange).
    let wake_events = match kind {
        Polled::Stream(_) => libc::EPOLLIN as u32,
        Polled::Deferred { .. } => (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLET) as u32,
        // An rsocket's descriptor is its eventfd, which nothing signals: `epoll_wait`
        // sleeps on the rsocket's wake-up descriptor instead.
        Polled::Rsocket(_) => 0,
        _ => (libc::EPOLLOUT | libc::EPOLLET) as u32,
    };
    let mut wake = epoll_event {
        events: wake_events,
        u64: data,
    };
    // SAFETY: libc's epoll_ctl with our event for the descriptor behind `fd`.
    let r = unsafe { real_epoll_ctl()(epfd, op, fd, &mut wake) };
    if r == 0 {
        epoll_reg::with(|reg| {
            reg.retain(|e| !(e.epfd == epfd && e.fd == fd));
            if op != libc::EPOLL_CTL_DEL {
                reg.push(Reg {
                    epfd,
                    fd,
                    events,
                    data,
                    last: None,
                    disabled: false,
                });
            }
        });
    }
    r
}

const IN_BITS: u32 = (libc::EPOLLIN | libc::EPOLLRDNORM | libc::EPOLLRDHUP) as u32;
const OUT_BITS: u32 = (libc::EPOLLOUT | libc::EPOLLWRNORM) as u32;

/// What one registration reports now (updating its edge-triggered state), or 0; a stream
/// is armed for `waiter` when there is one.
fn reg_events(reg: &mut Reg, waiter: Option<&StreamWaiter<'_>>) -> u32 {
    if reg.disabled {
        return 0;
    }
    let want = (reg.events & (IN_BITS | OUT_BITS)) as i16;
    let (rev, counts) = match polled(reg.fd) {
        Polled::Stream(s) => {
            let r = stream_readiness(&s, waiter, reg.events & OUT_BITS != 0);
            // Only the events of the registered direction count as a new edge (a send
            // completing does not report EPOLLIN again, as in the kernel).
            let rx = if reg.events & IN_BITS != 0 {
                r.rx_events
            } else {
                0
            };
            let tx = if reg.events & OUT_BITS != 0 {
                r.tx_events
            } else {
                0
            };
            (revents_of(&r, want), (rx, tx))
        }
        Polled::Deferred { .. } => {
            return match finish(reg.fd, Block::No) {
                Progress::Pending => 0,
                // Now a stream, a failed connect or (after a fallback) a plain socket.
                Progress::Connected | Progress::Failed(_) => reg_events(reg, None),
            };
        }
        Polled::Failed(e) => (failed_revents(&e, want), (1, 1)),
        Polled::Rsocket(r) => {
            let (rev, _) = rsocket_readiness(&r, want);
            let (rx, tx) = rsock::poll::edges(r.rs).unwrap_or((0, 0));
            let rx = if reg.events & IN_BITS != 0 { rx } else { 0 };
            let tx = if reg.events & OUT_BITS != 0 { tx } else { 0 };
            (rev, (rx, tx))
        }
        Polled::Other => return 0,
    };
    let mut rev = u32::from(rev as u16);
    if reg.events & libc::EPOLLET as u32 != 0 {
        // Reported when something happened since the last report: the current readiness
        // then, as the kernel reports it after a wake-up.
        if reg.last == Some(counts) {
            rev = 0;
        } else if rev != 0 {
            reg.last = Some(counts);
        }
    }
    if rev != 0 && reg.events & libc::EPOLLONESHOT as u32 != 0 {
        reg.disabled = true;
    }
    rev
}

fn epoll_mixed(
    epfd: c_int,
    out: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const libc::sigset_t,
) -> c_int {
    let has_regs = epoll_reg::any() && epoll_reg::with(|r| r.iter().any(|e| e.epfd == epfd));
    let cap = usize::try_from(max).unwrap_or(0);
    if !has_regs || cap == 0 || out.is_null() {
        if mask.is_null() {
            // SAFETY: libc's epoll_wait with the caller's arguments.
            return unsafe { real_epoll_wait()(epfd, out, max, timeout) };
        }
        // SAFETY: libc's epoll_pwait with the caller's arguments.
        return unsafe { real_epoll_pwait()(epfd, out, max, timeout, mask) };
    }
    // SAFETY: the caller's array of `max` events.
    let outs = unsafe { std::slice::from_raw_parts_mut(out, cap) };
    let deadline = deadline_of(timeout);
    let mut buf = vec![epoll_event { events: 0, u64: 0 }; cap];
    // Streams whose socket watch the next wait leaves out (see `take_kicks`).
    let mut quiet = Vec::new();
    loop {
        let mut regs: Vec<Reg> =
            epoll_reg::with(|r| r.iter().filter(|e| e.epfd == epfd).copied().collect());
        let kinds: Vec<Polled> = regs.iter().map(|r| polled(r.fd)).collect();
        let waiting = waiters(&kinds);
        // The rsockets' wake-up descriptors, armed before their state is looked at.
        let rwake: Vec<(c_int, c_int)> = kinds
            .iter()
            .filter_map(|k| match k {
                Polled::Rsocket(r) if !rsocket_inherited(r) => {
                    rsock::poll::watch(r.rs).map(|w| (r.rs, w))
                }
                _ => None,
            })
            .filter(|&(_, w)| w >= 0)
            .collect();
        let mut n = 0usize;
        for (i, reg) in regs.iter_mut().enumerate() {
            if n >= cap {
                break;
            }
            let rev = reg_events(reg, waiting.get(i).and_then(Option::as_ref));
            if rev != 0 {
                outs[n] = epoll_event {
                    events: rev,
                    u64: reg.data,
                };
                n += 1;
            }
        }
        // Keep the edge-triggered and one-shot state (the program may have changed the
        // set meanwhile: only registrations still there are updated).
        epoll_reg::with(|all| {
            for r in &regs {
                if let Some(e) = all
                    .iter_mut()
                    .find(|e| e.epfd == r.epfd && e.fd == r.fd && e.events == r.events)
                {
                    e.last = r.last;
                    e.disabled = r.disabled;
                }
            }
        });
        let wait = if n > 0 {
            0
        } else {
            let left = deadline.map_or(SLICE, |d| d.saturating_duration_since(Instant::now()));
            if timeout >= 0 && left.is_zero() {
                0
            } else {
                left.min(SLICE).as_millis() as c_int
            }
        };
        let room = cap.saturating_sub(n);
        if room > 0 {
            // The kicks cannot join the program's epoll set: wait on the set itself (an
            // epoll descriptor is readable while it has events) beside them, then collect.
            let wait = if wait != 0 && (waiting.iter().any(Option::is_some) || !rwake.is_empty()) {
                let mut set = vec![pollfd {
                    fd: epfd,
                    events: libc::POLLIN,
                    revents: 0,
                }];
                let what = push_kicks(&mut set, &waiting, &quiet);
                let rfrom = set.len();
                set.extend(rwake.iter().map(|&(_, w)| pollfd {
                    fd: w,
                    events: libc::POLLIN,
                    revents: 0,
                }));
                let ts = (wait >= 0).then(|| timespec {
                    tv_sec: libc::time_t::from(wait / 1000),
                    tv_nsec: libc::c_long::from(wait % 1000) * 1_000_000,
                });
                let tsp = ts
                    .as_ref()
                    .map_or(std::ptr::null(), |t| t as *const timespec);
                // SAFETY: libc's ppoll over our set, with the caller's signal mask.
                let r = unsafe { real_ppoll()(set.as_mut_ptr(), set.len() as nfds_t, tsp, mask) };
                if r < 0 && n == 0 {
                    return -1;
                }
                let mut woke = false;
                for (p, &(rs, _)) in set.iter().skip(rfrom).zip(&rwake) {
                    if p.revents != 0 {
                        rsock::poll::woken(rs);
                        woke = true;
                    }
                }
                if take_kicks(&set, 1, &what, &waiting, &mut quiet) || woke {
                    // A stream's bytes were moved here, or an rsocket's channel fired: ask
                    // them again.
                    continue;
                }
                0
            } else {
                wait
            };
            // SAFETY: libc's epoll_pwait into our buffer of `room` events.
            let got =
                unsafe { real_epoll_pwait()(epfd, buf.as_mut_ptr(), room as c_int, wait, mask) };
            if got < 0 && n == 0 {
                return -1;
            }
            for e in buf.iter().take(usize::try_from(got).unwrap_or(0)) {
                // Wake-ups of our descriptors were answered above from the streams.
                let data = e.u64;
                if regs.iter().any(|r| r.data == data) {
                    continue;
                }
                outs[n] = *e;
                n += 1;
            }
        }
        if n > 0 {
            return n as c_int;
        }
        if timeout >= 0 && deadline.is_none_or(|d| Instant::now() >= d) {
            return 0;
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    out: *mut epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    if !epoll_reg::any() {
        if let Some(real) = real_epoll_wait::cached() {
            // SAFETY: libc's epoll_wait with the caller's arguments.
            return unsafe { real(epfd, out, max, timeout) };
        }
    }
    epoll_mixed(epfd, out, max, timeout, std::ptr::null())
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    out: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const libc::sigset_t,
) -> c_int {
    if !epoll_reg::any() {
        if let Some(real) = real_epoll_pwait::cached() {
            // SAFETY: libc's epoll_pwait with the caller's arguments.
            return unsafe { real(epfd, out, max, timeout, mask) };
        }
    }
    epoll_mixed(epfd, out, max, timeout, mask)
}
