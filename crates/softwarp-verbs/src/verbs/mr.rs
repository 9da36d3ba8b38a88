//! Protection domains and memory registration on application memory
//! (`ProtectionDomain::reg_mr_raw_iova`), with an iova other than the address
//! (`ibv_reg_mr_iova`), and re-registration (`ibv_rereg_mr`: a new registration, then the
//! old one deregistered, so a failure leaves the MR as it was; its keys change).

use std::ffi::{c_int, c_void};
use std::time::Duration;

use softwarp::{AccessFlags, MemoryRegion, ProtectionDomain};

use crate::errno;
use crate::ffi::*;
use crate::host::forward;
use crate::verbs::context::Context;
use crate::verbs::users::Users;

/// `struct ibv_pd` followed by Softwarp's PD.
#[repr(C)]
pub struct Pd {
    pub ibv: ibv_pd,
    pub pd: ProtectionDomain,
    /// Its MRs, QPs and SRQs (`ibv_dealloc_pd` answers `EBUSY` while any lives).
    pub users: Users,
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
    /// The access flags it was registered with (`ibv_rereg_mr` keeps them unless told).
    pub access: c_int,
}

/// How long `ibv_dereg_mr` waits for in-flight work to let go of the memory before it
/// returns `EBUSY` (the application frees the memory after a successful return).
const DEREG_WAIT: Duration = Duration::from_secs(5);

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    forward!(create Pd, ctx ctx, ibv_alloc_pd(ctx), |o| u64::from((*o).handle));
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
                users: Users::new(),
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
    forward!(destroy pd, ibv_dealloc_pd);
    // SAFETY: PDs come from `ibv_alloc_pd`.
    let Some(p) = (unsafe { Pd::from_ibv(pd) }) else {
        return libc::EINVAL;
    };
    if p.users.busy() {
        // The kernel's answer (`ib_destroy_usecnt`): its MRs, QPs and SRQs point to it.
        return errno::busy("ibv_dealloc_pd", "MRs, QPs or SRQs of the PD");
    }
    // SAFETY: PDs are allocated with Box in `ibv_alloc_pd`; the application gives it up,
    // and no object of this library points to it any more.
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

/// Checks a registration's arguments as rdma-core and the kernel do, and registers.
fn register(
    call: &'static str,
    p: &Pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> Result<MemoryRegion, c_int> {
    if addr.is_null() || len == 0 {
        return Err(errno::invalid(call, "NULL address or zero length"));
    }
    let Some(flags) = access_flags(access) else {
        return Err(errno::unsupported(
            call,
            "access flags (on-demand paging, zero-based, ...)",
        ));
    };
    if access as u32 & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC) != 0
        && access as u32 & IBV_ACCESS_LOCAL_WRITE == 0
    {
        return Err(errno::invalid(
            call,
            "remote write/atomic access without local write",
        ));
    }
    // SAFETY: the application registers `len` bytes at `addr` that it owns and keeps until
    // `ibv_dereg_mr` returns, which waits until nothing references them (the verbs
    // contract, and `reg_mr_raw_iova`'s).
    unsafe { p.pd.reg_mr_raw_iova(addr.cast(), len, iova, flags) }
        .map_err(|e| errno::fail(call, &e))
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
    match register(call, p, addr, len, iova, access) {
        Ok(mr) => {
            let stag = mr.stag().0;
            let mr = Box::into_raw(Box::new(Mr {
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
                access,
            }))
            .cast::<ibv_mr>();
            p.users.add();
            mr
        }
        Err(e) => {
            errno::set(e);
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
    forward!(create Mr, obj pd, ibv_reg_mr(pd, addr, len, access), |o| u64::from((*o).lkey));
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
    forward!(create Mr, obj pd, ibv_reg_mr_iova(pd, addr, len, iova, access), |o| u64::from((*o).lkey));
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
    forward!(create Mr, obj pd, ibv_reg_mr_iova2(pd, addr, len, iova, access), |o| u64::from((*o).lkey));
    reg("ibv_reg_mr_iova2", pd, addr, len, iova, access as c_int)
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_rereg_mr(
    mr: *mut ibv_mr,
    flags: c_int,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> c_int {
    forward!(obj mr, ibv_rereg_mr(mr, flags, pd, addr, len, access));
    const CALL: &str = "ibv_rereg_mr";
    // rdma-core's own checks (libibverbs/verbs.c), before the provider is asked.
    let input = |e: c_int| {
        errno::set(e);
        IBV_REREG_MR_ERR_INPUT
    };
    let f = flags as u32;
    if mr.is_null() || f & !IBV_REREG_MR_FLAGS_SUPPORTED != 0 {
        return input(libc::EINVAL);
    }
    let translation = f & IBV_REREG_MR_CHANGE_TRANSLATION != 0;
    if translation && (len == 0 || addr.is_null()) {
        return input(libc::EINVAL);
    }
    if access != 0 && f & IBV_REREG_MR_CHANGE_ACCESS == 0 {
        return input(libc::EINVAL);
    }
    // SAFETY: MRs come from `ibv_reg_mr` (Box) and stay allocated until `ibv_dereg_mr`.
    let m = unsafe { &mut *mr.cast::<Mr>() };
    let new_pd = if f & IBV_REREG_MR_CHANGE_PD != 0 {
        pd
    } else {
        m.ibv.pd
    };
    let (new_addr, new_len) = if translation {
        (addr, len)
    } else {
        (m.ibv.addr, m.ibv.length)
    };
    let new_access = if f & IBV_REREG_MR_CHANGE_ACCESS != 0 {
        access
    } else {
        m.access
    };
    let cmd = |e: c_int| {
        errno::set(e);
        IBV_REREG_MR_ERR_CMD
    };
    // SAFETY: PDs come from `ibv_alloc_pd`.
    let Some(p) = (unsafe { Pd::from_ibv(new_pd) }) else {
        return cmd(libc::EINVAL);
    };
    let Some(old) = m.mr.take() else {
        return cmd(libc::EINVAL);
    };
    // The iova of a re-registration is its address, as rdma-core passes it.
    let new = match register(CALL, p, new_addr, new_len, new_addr as u64, new_access) {
        Ok(new) => new,
        Err(e) => {
            m.mr = Some(old);
            return cmd(e);
        }
    };
    let release = old.deregister();
    if let Err(e) = release.wait(DEREG_WAIT) {
        tracing::error!(target: "softwarp::verbs", error = %e, "ibv_rereg_mr: the old memory is still in use");
    }
    let stag = new.stag().0;
    if new_pd != m.ibv.pd {
        p.users.add();
        // SAFETY: the MR's PD, alive while the MR uses it (its count says so).
        if let Some(old_pd) = unsafe { Pd::from_ibv(m.ibv.pd) } {
            old_pd.users.remove();
        }
    }
    m.ibv.pd = new_pd;
    m.ibv.addr = new_addr;
    m.ibv.length = new_len;
    m.ibv.handle = stag;
    m.ibv.lkey = stag;
    m.ibv.rkey = stag;
    m.access = new_access;
    m.mr = Some(new);
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    forward!(destroy mr, ibv_dereg_mr);
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
    let pd = m.ibv.pd;
    // SAFETY: as above; the application gives the MR up.
    drop(unsafe { Box::from_raw(mr.cast::<Mr>()) });
    // SAFETY: the MR's PD, alive while the MR used it (its count said so).
    if let Some(p) = unsafe { Pd::from_ibv(pd) } {
        p.users.remove();
    }
    0
}
