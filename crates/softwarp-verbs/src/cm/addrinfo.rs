//! `rdma_getaddrinfo`/`rdma_freeaddrinfo`: the system's `getaddrinfo` for names and ports,
//! each result as an RC/TCP-port-space `rdma_addrinfo` (source address for `RAI_PASSIVE`,
//! destination otherwise), allocated with `malloc` as rdma-core does. As in rdma-core, a
//! call with neither name nor service takes the result from the hints (libfabric's verbs
//! provider asks so), and a source address in the hints becomes the result's when it has
//! none.

use std::ffi::{c_char, c_int};

use crate::cm::{err, from_sockaddr, to_storage};
use crate::ffi::*;

/// `RAI_PASSIVE` of `rdma_cma.h` (a preprocessor constant, not in the bindings).
pub const RAI_PASSIVE: c_int = 1;
/// `RAI_NUMERICHOST`.
pub const RAI_NUMERICHOST: c_int = 2;
/// `RAI_FAMILY`.
pub const RAI_FAMILY: c_int = 8;

/// A malloc'd copy of the socket address at `sa`.
unsafe fn dup_addr(sa: *const libc::sockaddr) -> Option<(*mut sockaddr, socklen_t)> {
    // SAFETY: forwarded from getaddrinfo's result.
    let a = unsafe { from_sockaddr(sa) }?;
    let (st, len) = to_storage(a);
    // SAFETY: malloc of `len` bytes, checked.
    let p = unsafe { libc::malloc(len as usize) };
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` has `len` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(
            std::ptr::addr_of!(st).cast::<u8>(),
            p.cast::<u8>(),
            len as usize,
        )
    };
    Some((p.cast(), len))
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    if res.is_null() || (node.is_null() && service.is_null() && hints.is_null()) {
        return err(libc::EINVAL);
    }
    // SAFETY: NULL or the application's hints.
    let h = unsafe { hints.as_ref() };
    let flags = h.map_or(0, |h| h.ai_flags);
    if let Some(h) = h {
        if h.ai_qp_type != 0 && h.ai_qp_type != IBV_QPT_RC as c_int {
            return err(libc::EOPNOTSUPP);
        }
        if h.ai_port_space != 0 && h.ai_port_space != RDMA_PS_TCP as c_int {
            return err(libc::EOPNOTSUPP);
        }
    }
    let head = if node.is_null() && service.is_null() {
        // rdma-core: no name and no service, the addresses come from the hints.
        // SAFETY: `h` is the caller's (checked non-NULL above).
        match h.map(|h| unsafe { from_hints(h) }) {
            Some(Ok(ai)) => ai,
            Some(Err(e)) => return err(e),
            None => return err(libc::EINVAL),
        }
    } else {
        // SAFETY: forwarded.
        match unsafe { resolve(node, service, h, flags) } {
            Ok(head) => head,
            Err(rc) => return rc,
        }
    };
    // rdma-core: a source address in the hints is the result's when it has none.
    if let Some(h) = h {
        let mut cur = head;
        // SAFETY: our list, every element calloc'd; the hints' address is the caller's
        // `ai_src_len` bytes.
        while let Some(a) = unsafe { cur.as_mut() } {
            if a.ai_src_len == 0 && h.ai_src_len != 0 {
                // SAFETY: `ai_src_addr` of the caller's hints is a socket address of
                // `ai_src_len` (non-zero) bytes, rdma_getaddrinfo's contract; `dup_addr`
                // reads its family and then only that family's length.
                if let Some((addr, len)) = unsafe { dup_addr(h.ai_src_addr.cast()) } {
                    a.ai_src_addr = addr;
                    a.ai_src_len = len;
                }
            }
            cur = a.ai_next;
        }
    }
    // SAFETY: `res` is writable.
    unsafe { *res = head };
    0
}

/// One result from the hints alone (rdma-core: their flags, family, QP type, port space and
/// destination address).
///
/// # Safety
/// `h`'s addresses must be the caller's, of their stated lengths.
unsafe fn from_hints(h: &rdma_addrinfo) -> Result<*mut rdma_addrinfo, c_int> {
    // SAFETY: calloc of one structure, checked; all-zero is valid.
    let ai =
        unsafe { libc::calloc(1, std::mem::size_of::<rdma_addrinfo>()) }.cast::<rdma_addrinfo>();
    // SAFETY: checked for NULL here; ours.
    let Some(a) = (unsafe { ai.as_mut() }) else {
        return Err(libc::ENOMEM);
    };
    a.ai_flags = h.ai_flags;
    a.ai_family = h.ai_family;
    a.ai_qp_type = h.ai_qp_type;
    a.ai_port_space = h.ai_port_space;
    if h.ai_dst_len != 0 {
        // SAFETY: the caller's address.
        match unsafe { dup_addr(h.ai_dst_addr.cast()) } {
            Some((addr, len)) => {
                a.ai_dst_addr = addr;
                a.ai_dst_len = len;
            }
            None => {
                // SAFETY: our allocation, nothing else in it.
                unsafe { libc::free(ai.cast()) };
                return Err(libc::EINVAL);
            }
        }
    }
    Ok(ai)
}

/// The system's `getaddrinfo` for `node`/`service`, each result as an `rdma_addrinfo`; the
/// call's return code on failure (`errno` set).
///
/// # Safety
/// `node` and `service` are NULL or NUL-terminated strings.
unsafe fn resolve(
    node: *const c_char,
    service: *const c_char,
    h: Option<&rdma_addrinfo>,
    flags: c_int,
) -> Result<*mut rdma_addrinfo, c_int> {
    // SAFETY: plain C data; all-zero is valid.
    let mut gh: libc::addrinfo = unsafe { std::mem::zeroed() };
    gh.ai_socktype = libc::SOCK_STREAM;
    gh.ai_family = h.map_or(libc::AF_UNSPEC, |h| h.ai_family);
    if flags & RAI_PASSIVE != 0 {
        gh.ai_flags |= libc::AI_PASSIVE;
    }
    if flags & RAI_NUMERICHOST != 0 {
        gh.ai_flags |= libc::AI_NUMERICHOST;
    }
    let mut gres: *mut libc::addrinfo = std::ptr::null_mut();
    // SAFETY: NUL-terminated strings (or NULL) of the caller, our hints and out pointer.
    let rc = unsafe { libc::getaddrinfo(node, service, &gh, &mut gres) };
    if rc != 0 {
        // rdma-core returns getaddrinfo's error code and sets errno.
        let e = if rc == libc::EAI_SYSTEM {
            std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO)
        } else {
            libc::ENOENT
        };
        crate::errno::set(e);
        return Err(rc);
    }
    let mut head: *mut rdma_addrinfo = std::ptr::null_mut();
    let mut tail: *mut *mut rdma_addrinfo = &mut head;
    let mut cur = gres;
    while !cur.is_null() {
        // SAFETY: getaddrinfo's list.
        let g = unsafe { &*cur };
        // SAFETY: the entry's address.
        if let Some((addr, len)) = unsafe { dup_addr(g.ai_addr) } {
            // SAFETY: calloc of one structure, checked; all-zero is valid.
            let ai = unsafe { libc::calloc(1, std::mem::size_of::<rdma_addrinfo>()) }
                .cast::<rdma_addrinfo>();
            if ai.is_null() {
                // SAFETY: our allocation.
                unsafe { libc::free(addr.cast()) };
                break;
            }
            // SAFETY: `ai` is ours and zeroed; `tail` points at the last `next` field.
            unsafe {
                let a = &mut *ai;
                a.ai_flags = flags;
                a.ai_family = g.ai_family;
                a.ai_qp_type = IBV_QPT_RC as c_int;
                a.ai_port_space = RDMA_PS_TCP as c_int;
                if flags & RAI_PASSIVE != 0 {
                    a.ai_src_addr = addr;
                    a.ai_src_len = len;
                } else {
                    a.ai_dst_addr = addr;
                    a.ai_dst_len = len;
                }
                *tail = ai;
                tail = &mut a.ai_next;
            }
        }
        cur = g.ai_next;
    }
    // SAFETY: getaddrinfo's list, released once.
    unsafe { libc::freeaddrinfo(gres) };
    if head.is_null() {
        return Err(err(libc::ENOENT));
    }
    Ok(head)
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
    let mut cur = res;
    while !cur.is_null() {
        // SAFETY: a list from `rdma_getaddrinfo`: every pointer malloc'd or NULL.
        unsafe {
            let next = (*cur).ai_next;
            libc::free((*cur).ai_src_addr.cast());
            libc::free((*cur).ai_dst_addr.cast());
            libc::free((*cur).ai_src_canonname.cast());
            libc::free((*cur).ai_dst_canonname.cast());
            libc::free((*cur).ai_route);
            libc::free((*cur).ai_connect);
            libc::free(cur.cast());
            cur = next;
        }
    }
}
