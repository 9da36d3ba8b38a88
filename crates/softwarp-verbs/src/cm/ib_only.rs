//! The rdma_cm calls of InfiniBand features that iWARP has not: multicast (iWARP is
//! connected only) and ECE, the vendor options InfiniBand's CM carries in its REQ/REP/REJ
//! messages (MPA's exchange has no field for them).
//!
//! Each call checks its arguments as rdma-core's `librdmacm/cma.c` does, in the same order,
//! and then answers as rdma-core does on an iWARP device: joining a group fails with
//! `ENOSYS` (the kernel's answer for a device with neither InfiniBand multicast nor RoCE),
//! leaving one that was never joined with `EADDRNOTAVAIL`; the local ECE is accepted and
//! has no effect, the remote one reads as zeros (no peer ever sends one), and
//! `rdma_reject_ece` is `rdma_reject` (its reason code has no place in an MPA Reply).

use std::ffi::{c_int, c_void};

use crate::cm::err;
use crate::cm::id::{swv_rdma_reject, Id};
use crate::ffi::*;

/// rdma-core's `ucma_addrlen(addr) != 0`: an IPv4 or IPv6 address (AF_IB is not supported
/// without the kernel's AF_IB support, which an iWARP device never has).
///
/// # Safety
/// `addr` must be NULL or point to a socket address.
unsafe fn has_ip_family(addr: *const sockaddr) -> bool {
    // SAFETY: the family is the first field of every socket address.
    unsafe { addr.as_ref() }
        .is_some_and(|a| matches!(c_int::from(a.sa_family), libc::AF_INET | libc::AF_INET6))
}

fn no_multicast(call: &'static str) -> c_int {
    tracing::warn!(target: "softwarp::verbs", call, "not supported by softwarp (iWARP is connected only)");
    err(libc::ENOSYS)
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_join_multicast(
    _id: *mut rdma_cm_id,
    addr: *mut sockaddr,
    _ctx: *mut c_void,
) -> c_int {
    // SAFETY: the caller's address.
    if !unsafe { has_ip_family(addr) } {
        return err(libc::EINVAL);
    }
    no_multicast("rdma_join_multicast")
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_join_multicast_ex(
    _id: *mut rdma_cm_id,
    attr: *mut rdma_cm_join_mc_attr_ex,
    _ctx: *mut c_void,
) -> c_int {
    // SAFETY: the caller's attributes (rdma-core reads them unchecked; NULL is refused).
    let Some(a) = (unsafe { attr.as_ref() }) else {
        return err(libc::EINVAL);
    };
    if a.comp_mask >= RDMA_CM_JOIN_MC_ATTR_RESERVED {
        return err(libc::ENOTSUP);
    }
    if a.comp_mask & RDMA_CM_JOIN_MC_ATTR_ADDRESS == 0
        || a.comp_mask & RDMA_CM_JOIN_MC_ATTR_JOIN_FLAGS == 0
        || a.join_flags >= RDMA_MC_JOIN_FLAG_RESERVED
    {
        return err(libc::EINVAL);
    }
    // SAFETY: the caller's address.
    if !unsafe { has_ip_family(a.addr) } {
        return err(libc::EINVAL);
    }
    no_multicast("rdma_join_multicast_ex")
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_leave_multicast(
    _id: *mut rdma_cm_id,
    addr: *mut sockaddr,
) -> c_int {
    // SAFETY: the caller's address.
    if !unsafe { has_ip_family(addr) } {
        return err(libc::EINVAL);
    }
    // No join ever succeeds, so no group is on the id's list.
    err(libc::EADDRNOTAVAIL)
}

/// rdma-core: EINVAL without an id or an ECE, once the id has a QP, for vendor id 0 or a
/// non-zero `comp_mask`.
#[no_mangle]
pub unsafe extern "C" fn swv_rdma_set_local_ece(id: *mut rdma_cm_id, ece: *mut ibv_ece) -> c_int {
    // SAFETY: the caller's id and structure.
    let (Some(i), Some(e)) = (unsafe { Id::from_c(id) }, unsafe { ece.as_ref() }) else {
        return err(libc::EINVAL);
    };
    if !i.get(|c| c.qp.is_null()) || e.vendor_id == 0 || e.comp_mask != 0 {
        return err(libc::EINVAL);
    }
    tracing::debug!(target: "softwarp::verbs", vendor_id = e.vendor_id, "rdma_set_local_ece: accepted, not carried by MPA");
    0
}

/// rdma-core: EINVAL without an id or an ECE, or once the id has a QP; otherwise the
/// peer's options, which an iWARP peer never sends (all zero).
#[no_mangle]
pub unsafe extern "C" fn swv_rdma_get_remote_ece(id: *mut rdma_cm_id, ece: *mut ibv_ece) -> c_int {
    // SAFETY: the caller's id and structure.
    let (Some(i), Some(e)) = (unsafe { Id::from_c(id) }, unsafe { ece.as_mut() }) else {
        return err(libc::EINVAL);
    };
    if !i.get(|c| c.qp.is_null()) {
        return err(libc::EINVAL);
    }
    *e = ibv_ece {
        vendor_id: 0,
        options: 0,
        comp_mask: 0,
    };
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_reject_ece(
    id: *mut rdma_cm_id,
    data: *const c_void,
    len: u8,
) -> c_int {
    // SAFETY: forwarded unchanged.
    unsafe { swv_rdma_reject(id, data, len) }
}
