//! Datagram rsockets (`SOCK_DGRAM`) as rdma-core's answer on an iWARP device.
//!
//! rdma-core's datagram rsocket is a UDP socket (its number, its address, its options) plus
//! one UD QP per source address, made when the first destination is resolved (`rsendto`,
//! `rconnect`: `ds_get_dest` → `ds_create_qp`). An iWARP device has no UD QPs (Linux siw
//! refuses them with `EOPNOTSUPP`, as Softwarp's `ibv_create_qp` does), so on iWARP:
//! `rsocket` and `rbind` succeed, every send to a destination fails with `EOPNOTSUPP`, and
//! no datagram ever arrives (a blocking receive waits until the socket is closed, as
//! rdma-core's waits forever; a non-blocking one answers `EWOULDBLOCK`). This module does
//! exactly that, with the UDP socket real so that the calls that reach it (`rbind`,
//! `rgetsockname`, `rsetsockopt`, ...) answer as rdma-core's.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::stream::{state::*, Rsocket, Sizes};

/// A new datagram rsocket of `domain` (rdma-core's `ds_init`).
pub fn create(domain: c_int) -> Result<Rsocket, c_int> {
    // SAFETY: plain system call.
    let raw = unsafe { libc::socket(domain, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(last_errno());
    }
    // SAFETY: a new descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut rs = Rsocket::new(domain, Sizes::default());
    rs.udp = Some(fd);
    Ok(rs)
}

fn last_errno() -> c_int {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn fd(rs: &Rsocket) -> c_int {
    rs.udp.as_ref().map_or(-1, AsRawFd::as_raw_fd)
}

/// `ds_init_ep`: the socket becomes readable and writable (rdma-core sizes its queues
/// here; there is nothing to size without a QP).
fn init_ep(rs: &Rsocket) {
    let mut g = rs.lock();
    if g.state == INIT {
        g.state = READABLE | WRITABLE;
    }
}

/// `rbind`: the UDP socket bound.
///
/// # Safety
/// `addr` must be readable for `len` bytes.
pub unsafe fn bind(rs: &Rsocket, addr: *const libc::sockaddr, len: libc::socklen_t) -> c_int {
    init_ep(rs);
    // SAFETY: the caller's address.
    if unsafe { libc::bind(fd(rs), addr, len) } != 0 {
        return crate::cm::err(last_errno());
    }
    0
}

/// The UD QP every destination needs cannot be made on an iWARP device.
fn no_ud_qp() -> c_int {
    crate::errno::unsupported("rsendto", "datagram rsockets: UD QPs on iWARP")
}

/// `rconnect`: the UDP socket connected, then the destination's QP: `EOPNOTSUPP`.
///
/// # Safety
/// `addr` must be readable for `len` bytes.
pub unsafe fn connect(rs: &Rsocket, addr: *const libc::sockaddr, len: libc::socklen_t) -> c_int {
    init_ep(rs);
    // SAFETY: the caller's address.
    if unsafe { libc::connect(fd(rs), addr, len) } != 0 {
        return crate::cm::err(last_errno());
    }
    crate::cm::err(no_ud_qp())
}

/// `rsendto` to `dest`; `rsend` and the other sends without one (`EDESTADDRREQ` when the
/// socket has no destination, as a UDP socket's).
pub fn send(rs: &Rsocket, has_dest: bool) -> Result<usize, c_int> {
    init_ep(rs);
    if !has_dest {
        let mut st: libc::sockaddr_storage =
            // SAFETY: all-zero is a valid sockaddr_storage.
            unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        // SAFETY: our storage and its length.
        let connected =
            unsafe { libc::getpeername(fd(rs), std::ptr::addr_of_mut!(st).cast(), &mut len) } == 0;
        if !connected {
            return Err(libc::EDESTADDRREQ);
        }
    }
    Err(no_ud_qp())
}

/// `ds_recvfrom`: not readable before `rbind`/`rsendto` (`EINVAL`); otherwise nothing can
/// arrive: `EWOULDBLOCK`, or a wait until the socket is closed.
pub fn recv(rs: &Rsocket, flags: c_int) -> Result<usize, c_int> {
    let mut g = rs.lock();
    loop {
        if g.state & READABLE == 0 {
            return Err(libc::EINVAL);
        }
        if g.fd_flags & libc::O_NONBLOCK != 0 || flags & libc::MSG_DONTWAIT != 0 {
            return Err(libc::EWOULDBLOCK);
        }
        g = rs.changed.wait(g).unwrap_or_else(|e| e.into_inner());
    }
}

/// rpoll's events: writable once initialised (rdma-core: send queue entries free), never
/// readable.
pub fn revents(rs: &Rsocket, events: i16) -> i16 {
    if rs.lock().state & WRITABLE != 0 {
        events & libc::POLLOUT
    } else {
        0
    }
}

/// `ds_shutdown` at `rclose`: no longer readable or writable; a blocked receive returns.
pub fn close(rs: &Rsocket) {
    let mut g = rs.lock();
    g.state &= !(READABLE | WRITABLE);
    rs.changed.notify_all();
}

/// `getsockname`/`getpeername` of the UDP socket.
///
/// # Safety
/// `addr` must be writable for `*len` bytes and `len` valid.
pub unsafe fn name(
    rs: &Rsocket,
    peer: bool,
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
) -> c_int {
    // SAFETY: the caller's buffer and length.
    let r = unsafe {
        if peer {
            libc::getpeername(fd(rs), addr, len)
        } else {
            libc::getsockname(fd(rs), addr, len)
        }
    };
    if r != 0 {
        return crate::cm::err(last_errno());
    }
    0
}

/// `rsetsockopt` of a level other than `SOL_RDMA` first goes to the UDP socket.
///
/// # Safety
/// `val` must be readable for `len` bytes.
pub unsafe fn setsockopt(
    rs: &Rsocket,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: libc::socklen_t,
) -> Result<(), c_int> {
    // SAFETY: the caller's option value.
    if unsafe { libc::setsockopt(fd(rs), level, name, val, len) } != 0 {
        return Err(last_errno());
    }
    Ok(())
}
