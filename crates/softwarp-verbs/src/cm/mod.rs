//! librdmacm over `softwarp::cm`: event channels, ids, address and route resolution,
//! listen/connect/accept/reject with private data and IRD/ORD, disconnect, QP creation on
//! an id, `rdma_getaddrinfo`, and the synchronous mode of ids without a channel.

pub mod addrinfo;
pub mod channel;
pub mod ib_only;
pub mod id;
pub mod live;

use std::ffi::c_int;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use crate::errno;
use crate::ffi::ibv_context;
use crate::verbs::context;

/// The device context of every id (rdma-core opens each device once per process for the
/// CM and keeps it; so does this library). PDs, CQs and QPs made on `id->verbs` live on it.
pub fn cm_context() -> Result<*mut ibv_context, c_int> {
    struct Ctx(usize);
    static CTX: OnceLock<Ctx> = OnceLock::new();
    if let Some(c) = CTX.get() {
        return Ok(c.0 as *mut ibv_context);
    }
    let made = context::open_context().map_err(|e| errno::fail("rdma_cm device", &e))?;
    let c = CTX.get_or_init(|| {
        // SAFETY: `made` came from `open_context`. `ibv_close_device` leaves it open.
        if let Some(m) = unsafe { context::Context::from_ibv(made) } {
            m.library_owned.store(true, Ordering::Release);
        }
        Ctx(made as usize)
    });
    if c.0 != made as usize {
        // Another thread won the race: ours is not needed.
        // SAFETY: `made` came from `open_context` and nothing else has seen it.
        unsafe { context::discard(made) };
    }
    Ok(c.0 as *mut ibv_context)
}

/// The close order of this process (`softwarp::cm::CloseOrder`), with the exit handler that
/// lets the closes held for their peers finish before the process goes: a program that
/// exits right after `rdma_disconnect` or `ibv_destroy_qp` (perftest's server) would
/// otherwise send its FIN at exit, before the peer closed. Registered once, at the first
/// close, only when the order holds closes at all; it waits at most the order's longest
/// bound, and not at all when no close is held.
pub fn close_order() -> softwarp::cm::CloseOrder {
    static AT_EXIT: std::sync::Once = std::sync::Once::new();
    let order = softwarp::cm::CloseOrder::from_env();
    if !order.longest().is_zero() {
        AT_EXIT.call_once(|| {
            // SAFETY: registers a plain `extern "C" fn()`; the library stays loaded until
            // exit (rdma-core's libraries are never unloaded by their programs).
            if unsafe { libc::atexit(finish_held_closes) } != 0 {
                tracing::warn!(target: "softwarp::verbs", "atexit failed: closes held at exit are cut short");
            }
        });
    }
    order
}

extern "C" fn finish_held_closes() {
    let order = softwarp::cm::CloseOrder::from_env();
    softwarp::cm::config::wait_for_held_closes(order.longest());
}

/// The device's PD, `id->pd` of every id that holds the device, and how many ids do
/// (rdma-core's `cma_dev->pd` and `refcnt`).
struct DevicePd {
    pd: usize,
    ids: usize,
}

static DEVICE_PD: std::sync::Mutex<DevicePd> = std::sync::Mutex::new(DevicePd { pd: 0, ids: 0 });

/// The PD rdma-core gives an id with its device (`ucma_get_device`: one per device, made
/// when the first id gets the device), counted for one more id; it belongs to the CM's
/// context ([`cm_context`]).
pub fn device_pd() -> Result<*mut crate::ffi::ibv_pd, c_int> {
    let ctx = cm_context()?;
    let mut d = softwarp::sync::lock(&DEVICE_PD);
    if d.pd == 0 {
        // SAFETY: the CM's context, open for the process.
        let pd = unsafe { crate::verbs::mr::swv_ibv_alloc_pd(ctx) };
        if pd.is_null() {
            return Err(std::io::Error::last_os_error()
                .raw_os_error()
                .filter(|&e| e != 0)
                .unwrap_or(libc::ENOMEM));
        }
        d.pd = pd as usize;
    }
    d.ids += 1;
    Ok(d.pd as *mut crate::ffi::ibv_pd)
}

/// An id gave up its device (`ucma_put_device`): the last one deallocates the device's PD,
/// as rdma-core does. When something of the application still uses it (an MR, a QP), the
/// dealloc is refused and the PD stays the device's, for the next id (rdma-core forgets it
/// then, and the PD leaks).
pub fn put_device_pd() {
    let mut d = softwarp::sync::lock(&DEVICE_PD);
    d.ids = d.ids.saturating_sub(1);
    if d.ids == 0 && d.pd != 0 {
        // SAFETY: the device's PD, made by `device_pd` and not deallocated since.
        if unsafe { crate::verbs::mr::swv_ibv_dealloc_pd(d.pd as *mut crate::ffi::ibv_pd) } == 0 {
            d.pd = 0;
        }
    }
}

/// Sets `errno` and returns -1, the librdmacm convention.
pub fn err(e: c_int) -> c_int {
    errno::set(e);
    -1
}

/// The socket address at `sa`, if it is IPv4 or IPv6.
///
/// # Safety
/// `sa` must be NULL or point to a socket address of its family's size.
pub unsafe fn from_sockaddr(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: the family field is at the start of every sockaddr.
    match c_int::from(unsafe { (*sa).sa_family }) {
        libc::AF_INET => {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let s = unsafe { &*sa.cast::<libc::sockaddr_in>() };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr)),
                u16::from_be(s.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: an AF_INET6 address is a sockaddr_in6.
            let s = unsafe { &*sa.cast::<libc::sockaddr_in6>() };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(s.sin6_addr.s6_addr),
                u16::from_be(s.sin6_port),
                s.sin6_flowinfo,
                s.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// `addr` as a `sockaddr_storage` and its length.
pub fn to_storage(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            let s = unsafe { &mut *std::ptr::addr_of_mut!(st).cast::<libc::sockaddr_in>() };
            s.sin_family = libc::AF_INET as libc::sa_family_t;
            s.sin_port = a.port().to_be();
            s.sin_addr.s_addr = u32::from(*a.ip()).to_be();
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            let s = unsafe { &mut *std::ptr::addr_of_mut!(st).cast::<libc::sockaddr_in6>() };
            s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            s.sin6_port = a.port().to_be();
            s.sin6_addr.s6_addr = a.ip().octets();
            s.sin6_flowinfo = a.flowinfo();
            s.sin6_scope_id = a.scope_id();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (st, len as libc::socklen_t)
}

/// The local address the host's routing picks to reach `dst` (a UDP socket "connected" to
/// it; nothing is sent).
pub fn source_for(dst: SocketAddr) -> std::io::Result<IpAddr> {
    let any: SocketAddr = match dst {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let s = std::net::UdpSocket::bind(any)?;
    let port = if dst.port() == 0 { 9 } else { dst.port() };
    s.connect(SocketAddr::new(dst.ip(), port))?;
    Ok(s.local_addr()?.ip())
}
