//! rsocket, librdmacm's sockets over RDMA, with rdma-core v44's wire protocol on iWARP
//! ([`wire`], [`stream`]) and its C API (`rsocket`, `rbind`, ..., `rpoll`, `rselect`).
//!
//! An rsocket's number is a file descriptor of its own (an eventfd the socket owns), as
//! rdma-core's is (its CM channel's): it never collides with the application's
//! descriptors, and `rpoll` tells rsockets from ordinary descriptors by it.
//!
//! Each entry point keeps rdma-core's conventions: -1 with `errno`, `EBADF` for a number
//! that is not an rsocket, and `rclose` returning `EBADF` itself (not -1) for one.

pub mod closing;
pub mod dgram;
pub mod iomap;
pub mod keepalive;
pub mod poll;
pub mod stream;
pub mod wire;

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, OnceLock};

use stream::{state, Rsocket, Sizes, QP_MAX_SIZE, SNDLOWAT};

use crate::cm::{err, from_sockaddr, to_storage};

/// `SOL_RDMA` of rsocket.h.
pub const SOL_RDMA: c_int = 0x10000;
/// rsocket.h's `SOL_RDMA` options.
pub const RDMA_SQSIZE: c_int = 0;
pub const RDMA_RQSIZE: c_int = 1;
pub const RDMA_INLINE: c_int = 2;
pub const RDMA_IOMAPSIZE: c_int = 3;
pub const RDMA_ROUTE: c_int = 4;

/// How long `rclose` waits for the connection's graceful close (FIN out, the peer's in).
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// Debian's `librspreload.so` (rdma-core 44) looks up the C library's calls it wraps on
/// the first `socket`, `read`, `write`, `poll`, `close`, `fcntl`, `getsockname` or `dup2`,
/// but not on the others (`recv`, `send`, `bind`, `connect`, `accept`, `setsockopt`, ...):
/// a program whose first socket call is one of those jumps to NULL (socat reading a file
/// calls `recv` first), over rdma-core's own librdmacm as over this one. Loaded under it
/// (librspreload needs librdmacm), the library makes it look them up at load with a `poll`
/// of no descriptors, which any interposer passes on and the kernel answers at once.
#[used]
#[link_section = ".init_array"]
static INIT_INTERPOSER: extern "C" fn() = init_interposer;

extern "C" fn init_interposer() {
    // SAFETY: no descriptors (a null array is valid with a count of 0), no waiting.
    unsafe { libc::poll(std::ptr::null_mut(), 0, 0) };
}

struct Entry {
    sock: Arc<Rsocket>,
    /// The socket's number, closed with the entry; a datagram socket's is its UDP socket,
    /// which the socket owns.
    _fd: Option<OwnedFd>,
}

fn table() -> std::sync::MutexGuard<'static, HashMap<c_int, Entry>> {
    static T: OnceLock<Mutex<HashMap<c_int, Entry>>> = OnceLock::new();
    T.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The rsocket numbered `fd`, if it is one.
pub fn lookup(fd: c_int) -> Option<Arc<Rsocket>> {
    table().get(&fd).map(|e| Arc::clone(&e.sock))
}

/// Gives `sock` a number.
fn insert(sock: Rsocket) -> Result<c_int, c_int> {
    // SAFETY: plain system call; the descriptor is owned from here on.
    let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EMFILE));
    }
    // SAFETY: `raw` is a new descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let n = fd.as_raw_fd();
    table().insert(
        n,
        Entry {
            sock: Arc::new(sock),
            _fd: Some(fd),
        },
    );
    Ok(n)
}

/// Gives a datagram socket its UDP socket's number.
fn insert_dgram(sock: Rsocket) -> c_int {
    let n = sock.udp.as_ref().map_or(-1, AsRawFd::as_raw_fd);
    table().insert(
        n,
        Entry {
            sock: Arc::new(sock),
            _fd: None,
        },
    );
    n
}

fn ret_unit(r: Result<(), c_int>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => err(e),
    }
}

fn ret_len(r: Result<usize, c_int>) -> isize {
    match r {
        Ok(n) => n as isize,
        Err(e) => {
            crate::errno::set(e);
            -1
        }
    }
}

#[no_mangle]
pub extern "C" fn swv_rsocket(domain: c_int, ty: c_int, protocol: c_int) -> c_int {
    if (domain != libc::AF_INET && domain != libc::AF_INET6)
        || (ty != libc::SOCK_STREAM && ty != libc::SOCK_DGRAM)
        || (ty == libc::SOCK_STREAM && protocol != 0 && protocol != libc::IPPROTO_TCP)
        || (ty == libc::SOCK_DGRAM && protocol != 0 && protocol != libc::IPPROTO_UDP)
    {
        // rdma-core's answer to every other domain, type or protocol.
        return err(libc::ENOTSUP);
    }
    if ty == libc::SOCK_DGRAM {
        return match dgram::create(domain) {
            Ok(rs) => insert_dgram(rs),
            Err(e) => err(e),
        };
    }
    match insert(Rsocket::new(domain, Sizes::default())) {
        Ok(n) => n,
        Err(e) => err(e),
    }
}

/// Copies `addr` into the caller's `(addr, len)` as rdma-core's `rs_copy_addr` does.
///
/// # Safety
/// `dst` must be writable for `*len` bytes and `len` valid.
unsafe fn copy_addr(
    dst: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
    addr: Option<std::net::SocketAddr>,
) {
    if dst.is_null() || len.is_null() {
        return;
    }
    let (st, n) = match addr {
        Some(a) => to_storage(a),
        // An unconnected socket's zeroed address, of an IPv6 address's length.
        // SAFETY: all-zero is a valid sockaddr_storage.
        None => (
            unsafe { std::mem::zeroed() },
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
        ),
    };
    // SAFETY: the caller's length and buffer.
    unsafe {
        let size = (*len).min(n) as usize;
        std::ptr::copy_nonoverlapping(std::ptr::addr_of!(st).cast::<u8>(), dst.cast::<u8>(), size);
        *len = n;
    }
}

/// The stream rsocket `socket` and the address `addr` of an `rbind` or `rconnect`; or,
/// as `Err`, what the call returns: `dgram_call`'s answer for a datagram socket, -1 with
/// `EBADF` or `EINVAL`.
///
/// # Safety
/// `addr` is the caller's address of `addrlen` bytes.
unsafe fn stream_to(
    socket: c_int,
    addr: *const libc::sockaddr,
    addrlen: libc::socklen_t,
    dgram_call: unsafe fn(&Rsocket, *const libc::sockaddr, libc::socklen_t) -> c_int,
) -> Result<(Arc<Rsocket>, std::net::SocketAddr), c_int> {
    let Some(rs) = lookup(socket) else {
        return Err(err(libc::EBADF));
    };
    if rs.udp.is_some() {
        // SAFETY: the caller's address of `addrlen` bytes.
        return Err(unsafe { dgram_call(&rs, addr, addrlen) });
    }
    // SAFETY: the caller's address of its family's size.
    match unsafe { from_sockaddr(addr) } {
        Some(a) => Ok((rs, a)),
        None => Err(err(libc::EINVAL)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rbind(
    socket: c_int,
    addr: *const libc::sockaddr,
    addrlen: libc::socklen_t,
) -> c_int {
    // SAFETY: the caller's address.
    let (rs, a) = match unsafe { stream_to(socket, addr, addrlen, dgram::bind) } {
        Ok(x) => x,
        Err(r) => return r,
    };
    let mut g = rs.lock();
    if g.state != state::INIT {
        return err(libc::EINVAL);
    }
    // rdma_bind_addr's hold on the port: the address is this host's and the port free,
    // port 0 is chosen now, and IPV6_V6ONLY (rdma-core passes it on as
    // RDMA_OPTION_ID_AFONLY) lets `[::]` and `0.0.0.0` take one port side by side.
    let v6_only = (g.ipv6_opts & (1 << libc::IPV6_V6ONLY) != 0).then_some(true);
    let port = match softwarp::cm::PortReservation::bind(a, v6_only) {
        Ok(p) => p,
        Err(e) => return err(crate::errno::fail("rbind", &e)),
    };
    let local = port.local_addr();
    g.bound = Some(local);
    g.local = Some(local);
    g.reserved = Some(port);
    g.state = state::BOUND;
    0
}

#[no_mangle]
pub extern "C" fn swv_rlisten(socket: c_int, backlog: c_int) -> c_int {
    let Some(rs) = lookup(socket) else {
        return err(libc::EBADF);
    };
    if rs.udp.is_some() {
        // A datagram socket does not listen (the kernel's answer for UDP).
        return err(libc::EOPNOTSUPP);
    }
    ret_unit(rs.listen(backlog))
}

#[no_mangle]
pub unsafe extern "C" fn swv_raccept(
    socket: c_int,
    addr: *mut libc::sockaddr,
    addrlen: *mut libc::socklen_t,
) -> c_int {
    let Some(rs) = lookup(socket) else {
        return err(libc::EBADF);
    };
    let new = match rs.accept() {
        Ok(n) => n,
        Err(e) => return err(e),
    };
    let peer = new.lock().peer;
    let n = match insert(new) {
        Ok(n) => n,
        Err(e) => return err(e),
    };
    // SAFETY: the caller's buffer and length.
    unsafe { copy_addr(addr, addrlen, peer) };
    n
}

#[no_mangle]
pub unsafe extern "C" fn swv_rconnect(
    socket: c_int,
    addr: *const libc::sockaddr,
    addrlen: libc::socklen_t,
) -> c_int {
    // SAFETY: the caller's address.
    match unsafe { stream_to(socket, addr, addrlen, dgram::connect) } {
        Ok((rs, a)) => ret_unit(rs.connect(a)),
        Err(r) => r,
    }
}

#[no_mangle]
pub extern "C" fn swv_rshutdown(socket: c_int, how: c_int) -> c_int {
    let Some(rs) = lookup(socket) else {
        return err(libc::EBADF);
    };
    ret_unit(rs.shutdown(how))
}

#[no_mangle]
pub extern "C" fn swv_rclose(socket: c_int) -> c_int {
    let Some(rs) = lookup(socket) else {
        // rdma-core returns the value itself here.
        return libc::EBADF;
    };
    if rs.udp.is_some() {
        dgram::close(&rs);
    } else if rs.lock().state & state::CONNECTED != 0 {
        let _ = rs.shutdown(libc::SHUT_RDWR);
    }
    // The connection closed gracefully before the QP goes: a process exiting right after
    // rclose would otherwise close the TCP socket with unread bytes (the peer's last
    // credits), and the kernel's reset would drop what the peer has not read yet.
    let ep = rs.lock().s.as_ref().map(|s| Arc::clone(&s.ep));
    if let Some(ep) = ep {
        let _ = ep.qp.disconnect();
        let _ = ep.qp.wait_closed(CLOSE_WAIT);
    }
    if rs.lock().keepalive {
        keepalive::remove(&rs);
    }
    rs.release_iomaps();
    table().remove(&socket);
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_riomap(
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    prot: c_int,
    _flags: c_int,
    offset: libc::off_t,
) -> libc::off_t {
    let Some(rs) = lookup(socket) else {
        return libc::off_t::from(err(libc::EBADF));
    };
    if buf.is_null() || len == 0 {
        return libc::off_t::from(err(libc::EINVAL));
    }
    // SAFETY: rdma-core's contract: the buffer stays valid while it is mapped.
    match unsafe { rs.riomap(buf.cast::<u8>(), len, prot, offset) } {
        Ok(o) => o,
        Err(e) => libc::off_t::from(err(e)),
    }
}

#[no_mangle]
pub extern "C" fn swv_riounmap(socket: c_int, buf: *mut c_void, len: usize) -> c_int {
    let Some(rs) = lookup(socket) else {
        return err(libc::EBADF);
    };
    ret_unit(rs.riounmap(buf as usize, len))
}

/// rdma-core's `riowrite` returns `size_t`: -1 (all ones) with `errno` on failure.
#[no_mangle]
pub unsafe extern "C" fn swv_riowrite(
    socket: c_int,
    buf: *const c_void,
    count: usize,
    offset: libc::off_t,
    flags: c_int,
) -> usize {
    let Some(rs) = lookup(socket) else {
        return ret_len(Err(libc::EBADF)) as usize;
    };
    if buf.is_null() && count > 0 {
        return ret_len(Err(libc::EFAULT)) as usize;
    }
    let data: &[u8] = if count == 0 {
        &[]
    } else {
        // SAFETY: the caller's buffer of `count` bytes.
        unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), count) }
    };
    ret_len(rs.riowrite(data, offset as u64, flags)) as usize
}

/// # Safety
/// `buf` must be writable for `len` bytes (or `len` 0).
unsafe fn recv_into(socket: c_int, buf: *mut c_void, len: usize, flags: c_int) -> isize {
    let Some(rs) = lookup(socket) else {
        return ret_len(Err(libc::EBADF));
    };
    if rs.udp.is_some() {
        return ret_len(dgram::recv(&rs, flags));
    }
    if buf.is_null() && len > 0 {
        return ret_len(Err(libc::EFAULT));
    }
    let out: &mut [u8] = if len == 0 {
        &mut []
    } else {
        // SAFETY: the caller's buffer of `len` bytes.
        unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) }
    };
    keep_errno(|| rs.recv(out, flags))
}

/// Runs a transfer and returns its `ret_len` answer, with `errno` as the caller had it
/// when the transfer succeeds: rdma-core's `rrecv`/`rsend` leave it alone then, and
/// programs look at it after a return of 0 (rstream's blocking receive loop retries a 0
/// while `errno` says `EAGAIN`: a value left by this library's own non-blocking reads of
/// its event descriptors made it spin forever at the end of a connection).
fn keep_errno(f: impl FnOnce() -> Result<usize, c_int>) -> isize {
    // SAFETY: the calling thread's errno slot.
    let saved = unsafe { *libc::__errno_location() };
    let r = f();
    if r.is_ok() {
        crate::errno::set(saved);
    }
    ret_len(r)
}

/// # Safety
/// Each vector must be readable for its length.
unsafe fn send_from(socket: c_int, iov: &[libc::iovec], flags: c_int) -> isize {
    let Some(rs) = lookup(socket) else {
        return ret_len(Err(libc::EBADF));
    };
    if rs.udp.is_some() {
        return ret_len(dgram::send(&rs, false));
    }
    let mut parts: Vec<&[u8]> = Vec::with_capacity(iov.len());
    for v in iov {
        if v.iov_len == 0 {
            continue;
        }
        if v.iov_base.is_null() {
            return ret_len(Err(libc::EFAULT));
        }
        // SAFETY: the caller's vector.
        parts.push(unsafe { std::slice::from_raw_parts(v.iov_base.cast::<u8>(), v.iov_len) });
    }
    keep_errno(|| rs.send(&parts, flags))
}

/// # Safety
/// `iov` must point to `iovcnt` vectors.
unsafe fn iovecs<'a>(iov: *const libc::iovec, iovcnt: c_int) -> Option<&'a [libc::iovec]> {
    if iovcnt < 0 || (iov.is_null() && iovcnt > 0) {
        return None;
    }
    if iovcnt == 0 {
        return Some(&[]);
    }
    // SAFETY: the caller's array.
    Some(unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) })
}

#[no_mangle]
pub unsafe extern "C" fn swv_rrecv(
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
) -> isize {
    // SAFETY: the caller's buffer.
    unsafe { recv_into(socket, buf, len, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rread(socket: c_int, buf: *mut c_void, count: usize) -> isize {
    // SAFETY: the caller's buffer.
    unsafe { recv_into(socket, buf, count, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rrecvfrom(
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
    src: *mut libc::sockaddr,
    srclen: *mut libc::socklen_t,
) -> isize {
    // SAFETY: the caller's buffer.
    let n = unsafe { recv_into(socket, buf, len, flags) };
    if n > 0 && !src.is_null() {
        // SAFETY: the caller's address buffer.
        unsafe { swv_rgetpeername(socket, src, srclen) };
    }
    n
}

/// rdma-core's `rrecvv`: only the first vector is filled.
#[no_mangle]
pub unsafe extern "C" fn swv_rreadv(
    socket: c_int,
    iov: *const libc::iovec,
    iovcnt: c_int,
) -> isize {
    // SAFETY: the caller's vectors.
    match unsafe { iovecs(iov, iovcnt) } {
        // SAFETY: `first` is the caller's first vector, writable for `iov_len` bytes at
        // `iov_base` (readv(2)'s contract, which rreadv has).
        Some([first, ..]) => unsafe { recv_into(socket, first.iov_base, first.iov_len, 0) },
        // SAFETY: no vector: a 0-byte receive, which `recv_into` never writes to.
        Some([]) => unsafe { recv_into(socket, std::ptr::null_mut(), 0, 0) },
        None => ret_len(Err(libc::EINVAL)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rrecvmsg(
    socket: c_int,
    msg: *mut libc::msghdr,
    flags: c_int,
) -> isize {
    let _ = flags;
    // SAFETY: the caller's message header.
    let Some(m) = (unsafe { msg.as_ref() }) else {
        return ret_len(Err(libc::EFAULT));
    };
    if !m.msg_control.is_null() && m.msg_controllen > 0 {
        return ret_len(Err(libc::ENOTSUP));
    }
    // rdma-core passes `msg->msg_flags` as the flags (not `flags`); so does this.
    // SAFETY: the caller's vectors.
    match unsafe { iovecs(m.msg_iov, m.msg_iovlen as c_int) } {
        // SAFETY: `first` is the first vector of the caller's message, writable for
        // `iov_len` bytes at `iov_base` (recvmsg(2)'s contract, which rrecvmsg has).
        Some([first, ..]) => unsafe {
            recv_into(socket, first.iov_base, first.iov_len, m.msg_flags)
        },
        // SAFETY: no vector: a 0-byte receive, which `recv_into` never writes to.
        Some([]) => unsafe { recv_into(socket, std::ptr::null_mut(), 0, m.msg_flags) },
        None => ret_len(Err(libc::EINVAL)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rsend(
    socket: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
) -> isize {
    let v = libc::iovec {
        iov_base: buf.cast_mut(),
        iov_len: len,
    };
    // SAFETY: the caller's buffer.
    unsafe { send_from(socket, std::slice::from_ref(&v), flags) }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rwrite(socket: c_int, buf: *const c_void, count: usize) -> isize {
    // SAFETY: the caller's buffer.
    unsafe { swv_rsend(socket, buf, count, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rsendto(
    socket: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
    dest: *const libc::sockaddr,
    destlen: libc::socklen_t,
) -> isize {
    let Some(rs) = lookup(socket) else {
        return ret_len(Err(libc::EBADF));
    };
    if rs.udp.is_some() {
        return ret_len(dgram::send(&rs, !dest.is_null()));
    }
    if !dest.is_null() || destlen != 0 {
        return ret_len(Err(libc::EISCONN));
    }
    // SAFETY: the caller's buffer.
    unsafe { swv_rsend(socket, buf, len, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rwritev(
    socket: c_int,
    iov: *const libc::iovec,
    iovcnt: c_int,
) -> isize {
    // SAFETY: the caller's vectors.
    match unsafe { iovecs(iov, iovcnt) } {
        // SAFETY: each of the caller's vectors is readable for its `iov_len` bytes
        // (writev(2)'s contract, which rwritev has).
        Some(v) => unsafe { send_from(socket, v, 0) },
        None => ret_len(Err(libc::EINVAL)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rsendmsg(
    socket: c_int,
    msg: *const libc::msghdr,
    flags: c_int,
) -> isize {
    // SAFETY: the caller's message header.
    let Some(m) = (unsafe { msg.as_ref() }) else {
        return ret_len(Err(libc::EFAULT));
    };
    if !m.msg_control.is_null() && m.msg_controllen > 0 {
        return ret_len(Err(libc::ENOTSUP));
    }
    // SAFETY: the caller's vectors.
    match unsafe { iovecs(m.msg_iov, m.msg_iovlen as c_int) } {
        // SAFETY: each vector of the caller's message is readable for its `iov_len` bytes
        // (sendmsg(2)'s contract, which rsendmsg has).
        Some(v) => unsafe { send_from(socket, v, flags) },
        None => ret_len(Err(libc::EINVAL)),
    }
}

/// `rgetpeername` (`peer`) and `rgetsockname`.
///
/// # Safety
/// `addr` and `addrlen` as for `getsockname(2)`.
unsafe fn name_of(
    socket: c_int,
    peer: bool,
    addr: *mut libc::sockaddr,
    addrlen: *mut libc::socklen_t,
) -> c_int {
    let Some(rs) = lookup(socket) else {
        return err(libc::EBADF);
    };
    if rs.udp.is_some() {
        // SAFETY: the caller's buffer and length.
        return unsafe { dgram::name(&rs, peer, addr, addrlen) };
    }
    let a = {
        let g = rs.lock();
        if peer {
            g.peer
        } else {
            g.local
        }
    };
    // SAFETY: the caller's buffer and length.
    unsafe { copy_addr(addr, addrlen, a) };
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_rgetpeername(
    socket: c_int,
    addr: *mut libc::sockaddr,
    addrlen: *mut libc::socklen_t,
) -> c_int {
    // SAFETY: the caller's buffer and length.
    unsafe { name_of(socket, true, addr, addrlen) }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rgetsockname(
    socket: c_int,
    addr: *mut libc::sockaddr,
    addrlen: *mut libc::socklen_t,
) -> c_int {
    // SAFETY: the caller's buffer and length.
    unsafe { name_of(socket, false, addr, addrlen) }
}

/// rdma-core's `rfcntl(socket, cmd, ...)`: the one variadic argument of `F_SETFL` is an
/// `int`, passed in the register of a third argument on x86-64 and AArch64 Linux.
#[no_mangle]
pub extern "C" fn swv_rfcntl(socket: c_int, cmd: c_int, arg: c_int) -> c_int {
    let Some(rs) = lookup(socket) else {
        return err(libc::EBADF);
    };
    let mut g = rs.lock();
    match cmd {
        libc::F_GETFL => g.fd_flags,
        libc::F_SETFL => {
            g.fd_flags = arg;
            0
        }
        _ => err(libc::ENOTSUP),
    }
}

/// # Safety
/// `optval` must be readable for `optlen` bytes.
unsafe fn opt_int(optval: *const c_void, optlen: libc::socklen_t) -> Result<c_int, c_int> {
    if optval.is_null() || (optlen as usize) < std::mem::size_of::<c_int>() {
        return Err(libc::EINVAL);
    }
    // SAFETY: checked above: an int's worth of the caller's bytes.
    Ok(unsafe { optval.cast::<c_int>().read_unaligned() })
}

#[no_mangle]
pub unsafe extern "C" fn swv_rsetsockopt(
    socket: c_int,
    level: c_int,
    optname: c_int,
    optval: *const c_void,
    optlen: libc::socklen_t,
) -> c_int {
    let Some(rs) = lookup(socket) else {
        return err(libc::EBADF);
    };
    if rs.udp.is_some() && level != SOL_RDMA {
        // SAFETY: the caller's option value.
        if let Err(e) = unsafe { dgram::setsockopt(&rs, level, optname, optval, optlen) } {
            return err(e);
        }
    }
    // SAFETY: the caller's option value.
    let val = || unsafe { opt_int(optval, optlen) };
    let mut g = rs.lock();
    let mut opt_on = false;
    let which: Option<fn(&mut stream::Inner) -> &mut u64>;
    let r: Result<(), c_int> = match level {
        libc::SOL_SOCKET => {
            which = Some(|g| &mut g.so_opts);
            match optname {
                libc::SO_REUSEADDR | libc::SO_OOBINLINE => val().map(|v| opt_on = v != 0),
                libc::SO_KEEPALIVE => val().map(|v| {
                    let on = v != 0;
                    if on && !g.keepalive {
                        if g.keepalive_time == 0 {
                            g.keepalive_time = keepalive::default_time();
                        }
                        keepalive::add(&rs, g.keepalive_time);
                    } else if !on && g.keepalive {
                        keepalive::remove(&rs);
                    }
                    g.keepalive = on;
                    opt_on = on;
                }),
                libc::SO_RCVBUF => val().map(|v| {
                    if g.s.is_none() {
                        g.sizes.rbuf_size = (v as u32) << 1;
                    }
                }),
                libc::SO_SNDBUF => val().map(|v| {
                    if g.s.is_none() {
                        g.sizes.sbuf_size = (v as u32) << 1;
                    }
                    if g.sizes.sbuf_size < SNDLOWAT {
                        g.sizes.sbuf_size = SNDLOWAT << 1;
                    }
                }),
                libc::SO_LINGER => {
                    if optval.is_null() || (optlen as usize) < std::mem::size_of::<libc::linger>() {
                        Err(libc::EINVAL)
                    } else {
                        // SAFETY: checked: a linger's worth of the caller's bytes.
                        let l = unsafe { optval.cast::<libc::linger>().read_unaligned() };
                        // Inverted, as rdma-core keeps it: the default (bit clear) is on.
                        opt_on = l.l_onoff == 0;
                        Ok(())
                    }
                }
                _ => Err(libc::ENOTSUP),
            }
        }
        libc::IPPROTO_TCP => {
            which = Some(|g| &mut g.tcp_opts);
            match optname {
                libc::TCP_NODELAY => val().map(|v| opt_on = v != 0),
                // Not applicable: the connection is reliable (rdma-core's answer).
                libc::TCP_MAXSEG | libc::TCP_KEEPCNT | libc::TCP_KEEPINTVL => Ok(()),
                libc::TCP_KEEPIDLE => match val() {
                    Ok(v) if v > 0 => {
                        g.keepalive_time = v as u32;
                        if g.keepalive {
                            keepalive::add(&rs, g.keepalive_time);
                        }
                        Ok(())
                    }
                    Ok(_) => Err(libc::EINVAL),
                    Err(e) => Err(e),
                },
                _ => Err(libc::ENOTSUP),
            }
        }
        libc::IPPROTO_IPV6 => {
            which = Some(|g| &mut g.ipv6_opts);
            match optname {
                libc::IPV6_V6ONLY => val().map(|v| opt_on = v != 0),
                _ => Err(libc::ENOTSUP),
            }
        }
        SOL_RDMA => {
            which = None;
            if g.state >= state::OPENING {
                Err(libc::EINVAL)
            } else {
                match optname {
                    RDMA_SQSIZE => {
                        val().map(|v| g.sizes.sq_size = (v as u32).min(QP_MAX_SIZE) as u16)
                    }
                    RDMA_RQSIZE => {
                        val().map(|v| g.sizes.rq_size = (v as u32).min(QP_MAX_SIZE) as u16)
                    }
                    RDMA_INLINE => {
                        val().map(|v| g.sizes.sq_inline = (v as u32).min(QP_MAX_SIZE) as u16)
                    }
                    RDMA_IOMAPSIZE => val().map(|v| {
                        g.sizes.target_iomap_size =
                            wire::scale_to_value(wire::value_to_scale(v as u32, 8) & 0xFF, 8) as u16
                    }),
                    RDMA_ROUTE => {
                        if optval.is_null() {
                            Err(libc::EINVAL)
                        } else {
                            // SAFETY: the caller's `optlen` bytes.
                            let b = unsafe {
                                std::slice::from_raw_parts(optval.cast::<u8>(), optlen as usize)
                            };
                            g.route = Some(b.to_vec());
                            Ok(())
                        }
                    }
                    _ => Err(libc::ENOTSUP),
                }
            }
        }
        _ => {
            which = None;
            Err(libc::ENOTSUP)
        }
    };
    match r {
        Ok(()) => {
            if let Some(f) = which {
                if (0..64).contains(&optname) {
                    let bits = f(&mut g);
                    if opt_on {
                        *bits |= 1 << optname;
                    } else {
                        *bits &= !(1 << optname);
                    }
                }
            }
            0
        }
        Err(e) => err(e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rgetsockopt(
    socket: c_int,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: *mut libc::socklen_t,
) -> c_int {
    let Some(rs) = lookup(socket) else {
        return err(libc::EBADF);
    };
    if optval.is_null() || optlen.is_null() {
        return err(libc::EFAULT);
    }
    let mut g = rs.lock();
    let bit = |bits: u64| c_int::from((0..64).contains(&optname) && bits & (1 << optname) != 0);
    let v: Result<c_int, c_int> = match level {
        libc::SOL_SOCKET => match optname {
            libc::SO_REUSEADDR | libc::SO_KEEPALIVE | libc::SO_OOBINLINE => Ok(bit(g.so_opts)),
            libc::SO_RCVBUF => Ok(g.sizes.rbuf_size as c_int),
            libc::SO_SNDBUF => Ok(g.sizes.sbuf_size as c_int),
            libc::SO_LINGER => {
                let l = libc::linger {
                    l_onoff: 1 - bit(g.so_opts),
                    l_linger: 0,
                };
                // SAFETY: the caller's buffer for a linger (its length is the caller's).
                unsafe {
                    optval.cast::<libc::linger>().write_unaligned(l);
                    *optlen = std::mem::size_of::<libc::linger>() as libc::socklen_t;
                }
                return 0;
            }
            libc::SO_ERROR => {
                let e = g.err;
                g.err = 0;
                Ok(e)
            }
            _ => Err(libc::ENOTSUP),
        },
        libc::IPPROTO_TCP => match optname {
            libc::TCP_NODELAY => Ok(bit(g.tcp_opts)),
            libc::TCP_MAXSEG => Ok(2048),
            libc::TCP_KEEPCNT | libc::TCP_KEEPINTVL => Ok(1),
            libc::TCP_KEEPIDLE => Ok(g.keepalive_time as c_int),
            _ => Err(libc::ENOTSUP),
        },
        libc::IPPROTO_IPV6 => match optname {
            libc::IPV6_V6ONLY => Ok(bit(g.ipv6_opts)),
            _ => Err(libc::ENOTSUP),
        },
        SOL_RDMA => match optname {
            RDMA_SQSIZE => Ok(c_int::from(g.sizes.sq_size)),
            RDMA_RQSIZE => Ok(c_int::from(g.sizes.rq_size)),
            RDMA_INLINE => Ok(c_int::from(g.sizes.sq_inline)),
            RDMA_IOMAPSIZE => Ok(c_int::from(g.sizes.target_iomap_size)),
            RDMA_ROUTE => {
                // SAFETY: the caller's length.
                let room = unsafe { *optlen } as usize;
                let route = g.route.clone().unwrap_or_default();
                if room < route.len() {
                    Err(libc::EINVAL)
                } else {
                    // An iWARP route has no path records: what was set, or nothing.
                    // SAFETY: the caller's buffer of `room` bytes.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            route.as_ptr(),
                            optval.cast::<u8>(),
                            route.len(),
                        );
                        *optlen = route.len() as libc::socklen_t;
                    }
                    return 0;
                }
            }
            _ => Err(libc::ENOTSUP),
        },
        _ => Err(libc::ENOTSUP),
    };
    match v {
        Ok(x) => {
            // SAFETY: the caller's buffer for an int.
            unsafe {
                optval.cast::<c_int>().write_unaligned(x);
                *optlen = std::mem::size_of::<c_int>() as libc::socklen_t;
            }
            0
        }
        Err(e) => err(e),
    }
}
