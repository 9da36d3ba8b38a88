//! Protection domains and memory registration on application memory
//! (`ProtectionDomain::reg_mr_raw`).

use std::ffi::{c_int, c_void};
use std::time::Duration;

use softwarp::{AccessFlags, MemoryRegion, ProtectionDomain};

use crate::errno;
use crate::ffi::*;
use crate::verbs::context::Context;

/// `struct ibv_pd` followed by Softwarp's PD.
#[repr(C)]
pub struct Pd {
    pub ibv: ibv_pd,
    pub pd: ProtectionDomain,
}

impl Pd {
    /// # Safety
    /// `pd` must be NULL or a PD from `ibv_alloc_pd` that is still allocated.
    pub unsafe fn from_ibv<'a>(pd: *mut ibv_pd) -> Option<&'a Pd> {
        // SAFETY: `ibv` is the first member of the `repr(C)` `Pd`.
        unsafe { pd.cast::<Pd>().as_ref() }
    }
}

/// `struct ibv_mr` followed by Softwarp's registration.
#[repr(C)]
pub struct Mr {
    pub ibv: ibv_mr,
    pub mr: Option<MemoryRegion>,
}

/// How long `ibv_dereg_mr` waits for in-flight work to let go of the memory before it
/// returns `EBUSY` (the application frees the memory after a successful return).
const DEREG_WAIT: Duration = Duration::from_secs(5);

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    // SAFETY: contexts come from `ibv_open_device`.
    let Some(c) = (unsafe { Context::from_ibv(ctx) }) else {
        errno::set(libc::EINVAL);
        return std::ptr::null_mut();
    };
    match c.dev.alloc_pd() {
        Ok(pd) => {
            let handle = pd.id().0;
            Box::into_raw(Box::new(Pd {
                ibv: ibv_pd {
                    context: ctx,
                    handle,
                },
                pd,
            }))
            .cast()
        }
        Err(e) => {
            errno::set(errno::fail("ibv_alloc_pd", &e));
            std::ptr::null_mut()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    if pd.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: PDs are allocated with Box in `ibv_alloc_pd`; the application gives it up.
    drop(unsafe { Box::from_raw(pd.cast::<Pd>()) });
    0
}

/// libibverbs access flags → Softwarp's, or `None` for flags Softwarp cannot honour.
pub fn access_flags(access: c_int) -> Option<AccessFlags> {
    let a = access as u32;
    let known = IBV_ACCESS_LOCAL_WRITE
        | IBV_ACCESS_REMOTE_WRITE
        | IBV_ACCESS_REMOTE_READ
        | IBV_ACCESS_REMOTE_ATOMIC
        | IBV_ACCESS_MW_BIND
        | IBV_ACCESS_RELAXED_ORDERING;
    if a & !known != 0 {
        return None;
    }
    let mut f = AccessFlags::NONE;
    if a & IBV_ACCESS_LOCAL_WRITE != 0 {
        f |= AccessFlags::LOCAL_WRITE;
    }
    if a & IBV_ACCESS_REMOTE_WRITE != 0 {
        f |= AccessFlags::REMOTE_WRITE;
    }
    if a & IBV_ACCESS_REMOTE_READ != 0 {
        f |= AccessFlags::REMOTE_READ;
    }
    if a & IBV_ACCESS_REMOTE_ATOMIC != 0 {
        f |= AccessFlags::REMOTE_ATOMIC;
    }
    // Remote invalidation is allowed for remotely accessible registrations, as on siw.
    if a & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ) != 0 {
        f |= AccessFlags::REMOTE_INVALIDATE;
    }
    Some(f)
}

fn reg(
    call: &'static str,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: PDs come from `ibv_alloc_pd`.
    let Some(p) = (unsafe { Pd::from_ibv(pd) }) else {
        errno::set(libc::EINVAL);
        return std::ptr::null_mut();
    };
    if addr.is_null() || len == 0 {
        errno::set(errno::invalid(call, "NULL address or zero length"));
        return std::ptr::null_mut();
    }
    if iova != addr as u64 {
        errno::set(errno::unsupported(call, "an iova other than the address"));
        return std::ptr::null_mut();
    }
    let Some(flags) = access_flags(access) else {
        errno::set(errno::unsupported(
            call,
            "access flags (on-demand paging, zero-based, ...)",
        ));
        return std::ptr::null_mut();
    };
    if access as u32 & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC) != 0
        && access as u32 & IBV_ACCESS_LOCAL_WRITE == 0
    {
        errno::set(errno::invalid(
            call,
            "remote write/atomic access without local write",
        ));
        return std::ptr::null_mut();
    }
    // SAFETY: the application registers `len` bytes at `addr` that it owns and keeps until
    // `ibv_dereg_mr` returns, which waits until nothing references them (the verbs
    // contract, and `reg_mr_raw`'s).
    match unsafe { p.pd.reg_mr_raw(addr.cast(), len, flags) } {
        Ok(mr) => {
            let stag = mr.stag().0;
            Box::into_raw(Box::new(Mr {
                ibv: ibv_mr {
                    context: p.ibv.context,
                    pd,
                    addr,
                    length: len,
                    handle: stag,
                    lkey: stag,
                    rkey: stag,
                },
                mr: Some(mr),
            }))
            .cast()
        }
        Err(e) => {
            errno::set(errno::fail(call, &e));
            std::ptr::null_mut()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut ibv_mr {
    reg("ibv_reg_mr", pd, addr, len, addr as u64, access)
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    reg("ibv_reg_mr_iova", pd, addr, len, iova, access)
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: u32,
) -> *mut ibv_mr {
    reg("ibv_reg_mr_iova2", pd, addr, len, iova, access as c_int)
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_rereg_mr(
    _mr: *mut ibv_mr,
    _flags: c_int,
    _pd: *mut ibv_pd,
    _addr: *mut c_void,
    _len: usize,
    _access: c_int,
) -> c_int {
    errno::unsupported(
        "ibv_rereg_mr",
        "re-registration (deregister and register again)",
    )
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    if mr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: MRs come from `ibv_reg_mr` (Box); until this returns 0 it stays allocated.
    let m = unsafe { &mut *mr.cast::<Mr>() };
    if let Some(region) = m.mr.take() {
        let release = region.deregister();
        if let Err(e) = release.wait(DEREG_WAIT) {
            tracing::error!(target: "softwarp::verbs", error = %e, "ibv_dereg_mr: memory still in use");
            return libc::EBUSY;
        }
    }
    // SAFETY: as above; the application gives the MR up.
    drop(unsafe { Box::from_raw(mr.cast::<Mr>()) });
    0
}
