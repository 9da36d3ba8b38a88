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
//! exchange fails (`ECONNREFUSED` on connect, `ECONNABORTED` on accept).
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
//! intercepted too: for an iWARP descriptor they ask the stream
//! ([`softwarp_sockets::IwarpStream::arm_readiness`]: data, EOF or error to read; credits
//! and a free slot to write) and wait on the eventfd only when nothing is ready, in slices of
//! at most 50 ms (another thread may have consumed the wake-up). A socketpair fed by the
//! library was the alternative; it needs a thread to feed it and a copy of every byte.
//!
//! # Limits
//!
//! Not intercepted: `sendfile`, `splice`, `recvmmsg`/`sendmmsg`, `MSG_PEEK` (refused with
//! `EOPNOTSUPP`), `SIGPIPE` (a write after the peer closed returns `EPIPE` without a
//! signal), `SO_RCVTIMEO`/`SO_SNDTIMEO` (accepted, not applied). A non-blocking `connect`
//! completes before it returns (it returns 0, never `EINPROGRESS`). After `fork`, the
//! child's copies of iWARP sockets fail with `EIO` (closing them is fine); the parent's keep
//! working. `unsafe` is confined to this file: every block is a call through libc's ABI.
#![allow(unsafe_code)]
// The exported functions are libc's, with libc's contracts (see their man pages).
#![allow(clippy::missing_safety_doc)]
#![deny(clippy::arithmetic_side_effects)]

pub mod config;
mod table;

use std::ffi::{c_int, c_void};
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use libc::{
    epoll_event, fd_set, iovec, msghdr, nfds_t, pollfd, size_t, sockaddr, socklen_t, ssize_t,
    timespec, timeval,
};
use softwarp_sockets::{
    IwarpOptions, IwarpStream, Side, SOL_SOFTWARP, SO_IWARP_ACTIVE, SO_IWARP_MODE,
};

use config::Mode;
use table::{Entry, StreamEntry};

/// Longest wait on an iWARP descriptor's eventfd before looking at the stream again.
const SLICE: Duration = Duration::from_millis(50);

// ---- the real functions -----------------------------------------------------------------

macro_rules! real {
    ($name:ident, $sym:literal, fn($($arg:ty),* $(,)?) -> $ret:ty) => {
        fn $name() -> unsafe extern "C" fn($($arg),*) -> $ret {
            static P: AtomicUsize = AtomicUsize::new(0);
            let mut p = P.load(Ordering::Relaxed);
            if p == 0 {
                // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated symbol name; it only reads
                // the loader's tables.
                p = unsafe { libc::dlsym(libc::RTLD_NEXT, $sym.as_ptr()) } as usize;
                if p == 0 {
                    eprintln!("softwarp preload: libc has no {:?}", $sym);
                    std::process::abort();
                }
                P.store(p, Ordering::Relaxed);
            }
            // SAFETY: `p` is the address of the next definition of this libc function, whose
            // C prototype is the one spelled here.
            unsafe { std::mem::transmute::<usize, unsafe extern "C" fn($($arg),*) -> $ret>(p) }
        }
    };
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
        _ => libc::EIO,
    }
}

fn fail<T: From<i8>>(e: c_int) -> T {
    set_errno(e);
    T::from(-1)
}

fn forked() -> bool {
    table::FORKED.load(Ordering::Relaxed)
}

// ---- socket creation and options ----------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int {
    // SAFETY: libc's socket with the caller's arguments.
    let fd = unsafe { real_socket()(domain, ty, protocol) };
    let tcp = (domain == libc::AF_INET || domain == libc::AF_INET6)
        && (ty & 0xf) == libc::SOCK_STREAM
        && (protocol == 0 || protocol == libc::IPPROTO_TCP);
    if fd >= 0 && tcp && config::get().mode == Mode::All && !forked() {
        table::insert(fd, Entry::Pending);
    }
    fd
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
        if forked() {
            // The child of a fork has no progress thread: its new sockets stay TCP.
            return fail(libc::EOPNOTSUPP);
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
    let target = match table::stream(fd) {
        Some(s) => std::os::fd::AsRawFd::as_raw_fd(&s.tcp),
        None => fd,
    };
    // SAFETY: libc's setsockopt with the caller's arguments (on the TCP socket of a stream).
    unsafe { real_setsockopt()(target, level, name, val, len) }
}

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    let entry = table::get(fd);
    if level == SOL_SOFTWARP {
        let v: c_int = match name {
            SO_IWARP_MODE => c_int::from(entry.is_some()),
            SO_IWARP_ACTIVE => c_int::from(matches!(entry, Some(Entry::Stream(_)))),
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
    match entry {
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
    let target = table::stream(fd).map_or(fd, |s| std::os::fd::AsRawFd::as_raw_fd(&s.tcp));
    // SAFETY: libc's getsockname with the caller's buffers.
    unsafe { real_getsockname()(target, addr, len) }
}

#[no_mangle]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
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

/// Runs the MPA exchange over the connected TCP socket `fd` and puts the stream behind
/// `fd`. Returns 0 or -1 with errno.
fn adopt(fd: c_int, side: Side, nonblocking: bool) -> c_int {
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) on the program's connected socket.
    let qp_fd = unsafe { real_fcntl()(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if qp_fd < 0 {
        return -1;
    }
    // SAFETY: as above, a second duplicate for options and addresses.
    let opt_fd = unsafe { real_fcntl()(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if opt_fd < 0 {
        let e = errno();
        // SAFETY: closing the duplicate made above.
        unsafe { real_close()(qp_fd) };
        return fail(e);
    }
    // SAFETY: both descriptors were just created by us and are owned by nothing else.
    let (tcp, keep) = unsafe {
        (
            std::net::TcpStream::from_raw_fd(qp_fd),
            OwnedFd::from_raw_fd(opt_fd),
        )
    };
    let stream = match IwarpStream::from_connected(tcp, side, &IwarpOptions::default()) {
        Ok(s) => s,
        Err(e) => {
            drop(keep);
            // The peer is not an iWARP peer: no plain bytes may follow on this connection.
            // SAFETY: shutdown of the program's socket.
            unsafe { real_shutdown()(fd, libc::SHUT_RDWR) };
            let code = match side {
                Side::Initiator => libc::ECONNREFUSED,
                Side::Responder => libc::ECONNABORTED,
            };
            eprintln!("softwarp preload: fd {fd}: iWARP connection failed: {e}");
            return fail(code);
        }
    };
    // SAFETY: F_GETFD on the program's descriptor.
    let cloexec = unsafe { real_fcntl()(fd, libc::F_GETFD, 0) } & libc::FD_CLOEXEC != 0;
    let event_fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
    let flags = if cloexec { libc::O_CLOEXEC } else { 0 };
    // SAFETY: dup3 of the stream's channel over the program's descriptor number; the TCP
    // socket lives on in the two duplicates.
    if unsafe { real_dup3()(event_fd, fd, flags) } < 0 {
        return -1;
    }
    table::insert(
        fd,
        Entry::Stream(Arc::new(StreamEntry {
            stream,
            tcp: keep,
            nonblocking: nonblocking.into(),
        })),
    );
    AT_EXIT.call_once(|| {
        // SAFETY: registers a plain `extern "C" fn()` with libc; it stays loaded until exit.
        if unsafe { libc::atexit(close_all_at_exit) } != 0 {
            eprintln!("softwarp preload: atexit failed: streams are not flushed at exit");
        }
    });
    0
}

static AT_EXIT: std::sync::Once = std::sync::Once::new();

/// At exit, closes every stream the program left open: bytes still queued in user space
/// go out (bounded by the linger time), then the EOF, as the kernel would do for a TCP
/// socket. Registered when the first iWARP stream is set up.
extern "C" fn close_all_at_exit() {
    if forked() {
        return;
    }
    for (_, s) in table::drain_streams() {
        release(Some(Entry::Stream(s)));
    }
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

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    if !matches!(table::get(fd), Some(Entry::Pending)) || !still_iwarp(fd, port_of(addr)) {
        // SAFETY: libc's connect with the caller's arguments.
        return unsafe { real_connect()(fd, addr, len) };
    }
    let nonblocking = is_nonblocking(fd);
    if nonblocking {
        set_blocking(fd, false);
    }
    // SAFETY: libc's connect with the caller's arguments, on a blocking socket.
    let r = unsafe { real_connect()(fd, addr, len) };
    if r < 0 {
        let e = errno();
        if nonblocking {
            set_blocking(fd, true);
        }
        return fail(e);
    }
    table::remove(fd);
    adopt(fd, Side::Initiator, nonblocking)
}

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    if matches!(table::get(fd), Some(Entry::Pending)) && still_iwarp(fd, local_port(fd)) {
        table::insert(fd, Entry::Listener);
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
    // SAFETY: libc's accept4 with the caller's arguments.
    let k = unsafe { real_accept4()(fd, addr, len, flags) };
    if k < 0 || !matches!(table::get(fd), Some(Entry::Listener)) {
        return k;
    }
    if flags & libc::SOCK_NONBLOCK != 0 {
        set_blocking(k, false);
    }
    if adopt(k, Side::Responder, flags & libc::SOCK_NONBLOCK != 0) < 0 {
        let e = errno();
        // SAFETY: closing the connection we accepted and could not set up.
        unsafe { real_close()(k) };
        return fail(e);
    }
    k
}

// ---- data ----------------------------------------------------------------------------------

fn stream_read(s: &StreamEntry, buf: &mut [u8], flags: c_int) -> ssize_t {
    if forked() {
        return fail(libc::EIO);
    }
    if flags & libc::MSG_PEEK != 0 {
        return fail(libc::EOPNOTSUPP);
    }
    let nb = s.nonblocking.load(Ordering::Relaxed) || flags & libc::MSG_DONTWAIT != 0;
    let mut got = 0usize;
    loop {
        match s.stream.read_with(&mut buf[got..], nb || got > 0) {
            Ok(0) => return got as ssize_t,
            Ok(n) => {
                got = got.saturating_add(n);
                if flags & libc::MSG_WAITALL == 0 || got >= buf.len() {
                    return got as ssize_t;
                }
            }
            Err(e) if got > 0 && e.kind() == io::ErrorKind::WouldBlock => {
                if nb {
                    return got as ssize_t;
                }
                // MSG_WAITALL: wait for the rest.
                match s.stream.read_with(&mut buf[got..], false) {
                    Ok(0) => return got as ssize_t,
                    Ok(n) => got = got.saturating_add(n),
                    Err(_) => return got as ssize_t,
                }
                if got >= buf.len() {
                    return got as ssize_t;
                }
            }
            Err(e) if got > 0 => {
                let _ = e;
                return got as ssize_t;
            }
            Err(e) => return fail(errno_of(&e)),
        }
    }
}

fn stream_write(s: &StreamEntry, buf: &[u8], flags: c_int) -> ssize_t {
    if forked() {
        return fail(libc::EIO);
    }
    let nb = s.nonblocking.load(Ordering::Relaxed) || flags & libc::MSG_DONTWAIT != 0;
    let mut sent = 0usize;
    // A blocking socket's write takes every byte (as the kernel's does, barring signals).
    while sent < buf.len() {
        match s.stream.write_with(&buf[sent..], nb) {
            Ok(n) => sent = sent.saturating_add(n),
            Err(e) if sent > 0 && e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if sent > 0 => {
                let _ = e;
                break;
            }
            Err(e) => return fail(errno_of(&e)),
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

fn readv_stream(s: &StreamEntry, iov: &[iovec], flags: c_int) -> ssize_t {
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

fn writev_stream(s: &StreamEntry, iov: &[iovec], flags: c_int) -> ssize_t {
    let mut tmp = Vec::new();
    for v in iov {
        // SAFETY: the caller's iovec is valid for iov_len readable bytes.
        tmp.extend_from_slice(unsafe { slice_ref(v.iov_base, v.iov_len) });
    }
    stream_write(s, &tmp, flags)
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    match table::stream(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        Some(s) => stream_read(&s, unsafe { slice_mut(buf, n) }, 0),
        // SAFETY: libc's read with the caller's arguments.
        None => unsafe { real_read()(fd, buf, n) },
    }
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
    match table::stream(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        Some(s) => stream_write(&s, unsafe { slice_ref(buf, n) }, 0),
        // SAFETY: libc's write with the caller's arguments.
        None => unsafe { real_write()(fd, buf, n) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    match table::stream(fd) {
        // SAFETY: the caller's iovec array.
        Some(s) => readv_stream(&s, unsafe { iovecs(iov, cnt) }, 0),
        // SAFETY: libc's readv with the caller's arguments.
        None => unsafe { real_readv()(fd, iov, cnt) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    match table::stream(fd) {
        // SAFETY: the caller's iovec array.
        Some(s) => writev_stream(&s, unsafe { iovecs(iov, cnt) }, 0),
        // SAFETY: libc's writev with the caller's arguments.
        None => unsafe { real_writev()(fd, iov, cnt) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    match table::stream(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        Some(s) => stream_read(&s, unsafe { slice_mut(buf, n) }, flags),
        // SAFETY: libc's recv with the caller's arguments.
        None => unsafe { real_recv()(fd, buf, n, flags) },
    }
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
    match table::stream(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        Some(s) => stream_write(&s, unsafe { slice_ref(buf, n) }, flags),
        // SAFETY: libc's send with the caller's arguments.
        None => unsafe { real_send()(fd, buf, n, flags) },
    }
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
    match table::stream(fd) {
        Some(s) => {
            if !alen.is_null() {
                // SAFETY: the caller's address length (a connected stream reports none).
                unsafe { *alen = 0 };
            }
            // SAFETY: the caller's buffer of `n` bytes.
            stream_read(&s, unsafe { slice_mut(buf, n) }, flags)
        }
        // SAFETY: libc's recvfrom with the caller's arguments.
        None => unsafe { real_recvfrom()(fd, buf, n, flags, addr, alen) },
    }
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
    match table::stream(fd) {
        // SAFETY: the caller's buffer of `n` bytes (the address of a connected stream is
        // ignored, as TCP does).
        Some(s) => stream_write(&s, unsafe { slice_ref(buf, n) }, flags),
        // SAFETY: libc's sendto with the caller's arguments.
        None => unsafe { real_sendto()(fd, buf, n, flags, addr, alen) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    match table::stream(fd) {
        Some(s) if !msg.is_null() => {
            // SAFETY: the caller's msghdr and its iovecs.
            unsafe {
                (*msg).msg_namelen = 0;
                (*msg).msg_controllen = 0;
                (*msg).msg_flags = 0;
                let iov = iovecs((*msg).msg_iov, (*msg).msg_iovlen as c_int);
                readv_stream(&s, iov, flags)
            }
        }
        Some(_) => fail(libc::EFAULT),
        // SAFETY: libc's recvmsg with the caller's arguments.
        None => unsafe { real_recvmsg()(fd, msg, flags) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    match table::stream(fd) {
        Some(s) if !msg.is_null() => {
            // SAFETY: the caller's msghdr and its iovecs.
            let iov = unsafe { iovecs((*msg).msg_iov, (*msg).msg_iovlen as c_int) };
            writev_stream(&s, iov, flags)
        }
        Some(_) => fail(libc::EFAULT),
        // SAFETY: libc's sendmsg with the caller's arguments.
        None => unsafe { real_sendmsg()(fd, msg, flags) },
    }
}

// ---- closing, duplicating, flags ---------------------------------------------------------

/// Lets go of an entry: a stream whose last descriptor this was is closed (EOF sent, QP
/// disconnected); in a forked child nothing of the parent's stack is touched.
fn release(e: Option<Entry>) {
    if let Some(Entry::Stream(s)) = e {
        if forked() {
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
    release(table::remove(fd));
    // SAFETY: libc's close.
    unsafe { real_close()(fd) }
}

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
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

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: libc::c_ulong, arg: usize) -> c_int {
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
        table::FORKED.store(true, Ordering::Relaxed);
    }
    pid
}

// ---- readiness -------------------------------------------------------------------------------

/// Readiness of our descriptor `fd` as poll bits for `events`, arming it when nothing is.
fn stream_revents(s: &StreamEntry, events: i16) -> i16 {
    if forked() {
        return libc::POLLERR;
    }
    let r = s.stream.arm_readiness();
    let mut rev = 0;
    if r.readable {
        rev |= events & (libc::POLLIN | libc::POLLRDNORM);
    }
    if r.writable {
        rev |= events & (libc::POLLOUT | libc::POLLWRNORM);
    }
    rev
}

fn deadline_of(timeout_ms: c_int) -> Option<Instant> {
    u64::try_from(timeout_ms)
        .ok()
        .and_then(|ms| Instant::now().checked_add(Duration::from_millis(ms)))
}

/// poll(2) over a set that holds at least one iWARP descriptor.
fn poll_mixed(fds: &mut [pollfd], deadline: Option<Instant>, forever: bool) -> c_int {
    let streams: Vec<Option<Arc<StreamEntry>>> = fds.iter().map(|p| table::stream(p.fd)).collect();
    let mut tmp: Vec<pollfd> = fds.to_vec();
    loop {
        let mut ours_ready = 0;
        for (i, p) in fds.iter_mut().enumerate() {
            if let Some(s) = &streams[i] {
                p.revents = stream_revents(s, p.events);
                if p.revents != 0 {
                    ours_ready += 1;
                }
                tmp[i] = pollfd {
                    fd: p.fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
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
        // SAFETY: libc's poll over our copy of the set.
        let n = unsafe { real_poll()(tmp.as_mut_ptr(), tmp.len() as nfds_t, wait) };
        if n < 0 {
            return -1;
        }
        let mut others = 0;
        for (i, p) in fds.iter_mut().enumerate() {
            if streams[i].is_none() {
                p.revents = tmp[i].revents;
                if p.revents != 0 {
                    others += 1;
                }
            }
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
    fds.iter().any(|p| table::stream(p.fd).is_some())
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    let set: &mut [pollfd] = if fds.is_null() || n == 0 {
        &mut []
    } else {
        // SAFETY: the caller's array of `n` pollfds.
        unsafe { std::slice::from_raw_parts_mut(fds, n as usize) }
    };
    if !any_stream(set) {
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
    let set: &mut [pollfd] = if fds.is_null() || n == 0 {
        &mut []
    } else {
        // SAFETY: the caller's array of `n` pollfds.
        unsafe { std::slice::from_raw_parts_mut(fds, n as usize) }
    };
    if !any_stream(set) {
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
    let mut fds = Vec::new();
    let mut mine = false;
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
            mine |= table::stream(fd).is_some();
            fds.push(pollfd {
                fd,
                events: ev,
                revents: 0,
            });
        }
    }
    if !mine {
        return None;
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
    //! The iWARP descriptors registered in each epoll set, with the program's events and
    //! data: `epoll_wait` reports them from the streams' readiness.
    use std::sync::Mutex;

    /// (epoll fd, fd, events, data).
    pub static REG: Mutex<Vec<(i32, i32, u32, u64)>> = Mutex::new(Vec::new());

    pub fn with<T>(f: impl FnOnce(&mut Vec<(i32, i32, u32, u64)>) -> T) -> T {
        f(&mut REG.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut epoll_event,
) -> c_int {
    if table::stream(fd).is_none() {
        if op == libc::EPOLL_CTL_DEL {
            epoll_reg::with(|r| r.retain(|e| !(e.0 == epfd && e.1 == fd)));
        }
        // SAFETY: libc's epoll_ctl with the caller's arguments.
        return unsafe { real_epoll_ctl()(epfd, op, fd, ev) };
    }
    // The kernel watches the eventfd for wake-ups (level-triggered, input only).
    let (events, data) = if ev.is_null() {
        (0, 0)
    } else {
        // SAFETY: the caller's epoll_event.
        unsafe { ((*ev).events, (*ev).u64) }
    };
    let mut wake = epoll_event {
        events: libc::EPOLLIN as u32,
        u64: data,
    };
    // SAFETY: libc's epoll_ctl with our event for the eventfd behind `fd`.
    let r = unsafe { real_epoll_ctl()(epfd, op, fd, &mut wake) };
    if r == 0 {
        epoll_reg::with(|reg| {
            reg.retain(|e| !(e.0 == epfd && e.1 == fd));
            if op != libc::EPOLL_CTL_DEL {
                reg.push((epfd, fd, events, data));
            }
        });
    }
    r
}

fn epoll_mixed(
    epfd: c_int,
    out: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const libc::sigset_t,
) -> c_int {
    let regs: Vec<(i32, i32, u32, u64)> =
        epoll_reg::with(|r| r.iter().filter(|e| e.0 == epfd).copied().collect());
    let cap = usize::try_from(max).unwrap_or(0);
    if regs.is_empty() || cap == 0 || out.is_null() {
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
    loop {
        let mut n = 0usize;
        for &(_, fd, events, data) in &regs {
            if n >= cap {
                break;
            }
            let Some(s) = table::stream(fd) else { continue };
            let want = (events & (libc::EPOLLIN | libc::EPOLLOUT) as u32) as i16;
            let rev = stream_revents(&s, want);
            if rev != 0 {
                outs[n] = epoll_event {
                    events: rev as u32,
                    u64: data,
                };
                n += 1;
            }
        }
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
            // SAFETY: libc's epoll_pwait into our buffer of `room` events.
            let got =
                unsafe { real_epoll_pwait()(epfd, buf.as_mut_ptr(), room as c_int, wait, mask) };
            if got < 0 && n == 0 {
                return -1;
            }
            for e in buf.iter().take(usize::try_from(got).unwrap_or(0)) {
                // Wake-ups of our eventfds were answered above from the streams.
                let data = e.u64;
                if regs.iter().any(|r| r.3 == data) {
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
    epoll_mixed(epfd, out, max, timeout, mask)
}
