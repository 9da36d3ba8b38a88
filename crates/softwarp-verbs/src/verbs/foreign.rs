//! Objects that live outside this process's Softwarp device: another process's verbs
//! objects (`ibv_import_device`, `ibv_import_pd`/`_mr`/`_dm` and their `unimport`s, rdma-core
//! 1.10/1.13), another device's memory (`ibv_reg_dmabuf_mr`, 1.12) and the vendor options of
//! InfiniBand's connection manager (`ibv_query_ece`/`ibv_set_ece`, 1.10).
//!
//! rdma-core shares objects between processes through the kernel's uverbs file (the
//! command fd and object handles of another process's context); Softwarp's objects live in
//! the process that made them and have no such file, so no command fd is ever one of its
//! devices and no handle names one of its objects. A dma-buf is device memory a kernel
//! driver exports; Linux siw, like every provider without `reg_dmabuf_mr`, refuses it. ECE
//! is carried by InfiniBand's CM messages; iWARP's MPA exchange has no field for it. Each
//! call therefore answers exactly as rdma-core does for a provider without the operation
//! (its `dummy_ops.c`): NULL with `errno` `EOPNOTSUPP`, or `EOPNOTSUPP` returned, and the
//! `unimport`s do nothing. `ibv_import_device` checks its descriptor first, as rdma-core
//! does (`EINVAL` unless it is a character device, `ENODEV` for one that is not a device of
//! the list: all of them here).

use std::ffi::c_int;

use crate::errno;
use crate::ffi::*;
use crate::host::forward;

/// rdma-core: EINVAL unless `fd` is a character device; ENODEV when no device of the list
/// has it as its command file (no Softwarp device has one).
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_import_device(cmd_fd: c_int) -> *mut ibv_context {
    // A host device's command file: the host library imports it, and the context is its.
    if let Some(h) = crate::host::host() {
        // SAFETY: the host's call; it checks the descriptor itself.
        let ctx = unsafe { (h.calls.ibv_import_device)(cmd_fd) };
        if !ctx.is_null() {
            return h.adopt(ctx);
        }
    }
    // SAFETY: `stat` is plain data, all-zero is valid; `fstat` writes it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: any fd value is safe to pass; a bad one fails with EBADF.
    let is_char =
        unsafe { libc::fstat(cmd_fd, &mut st) } == 0 && st.st_mode & libc::S_IFMT == libc::S_IFCHR;
    let e = if is_char {
        tracing::debug!(target: "softwarp::verbs", cmd_fd, "ibv_import_device: not the command file of a softwarp device");
        libc::ENODEV
    } else {
        errno::invalid("ibv_import_device", "cmd_fd is not a character device")
    };
    errno::set(e);
    std::ptr::null_mut()
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_import_pd(_ctx: *mut ibv_context, _handle: u32) -> *mut ibv_pd {
    forward!(ctx _ctx, ibv_import_pd(_ctx, _handle));
    errno::set(errno::unsupported(
        "ibv_import_pd",
        "objects of another process (no uverbs handles)",
    ));
    std::ptr::null_mut()
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_import_mr(_pd: *mut ibv_pd, _handle: u32) -> *mut ibv_mr {
    forward!(obj _pd, ibv_import_mr(_pd, _handle));
    errno::set(errno::unsupported(
        "ibv_import_mr",
        "objects of another process (no uverbs handles)",
    ));
    std::ptr::null_mut()
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_import_dm(_ctx: *mut ibv_context, _handle: u32) -> *mut ibv_dm {
    forward!(ctx _ctx, ibv_import_dm(_ctx, _handle));
    errno::set(errno::unsupported(
        "ibv_import_dm",
        "device memory (a software device has none)",
    ));
    std::ptr::null_mut()
}

/// Nothing to release on softwarp0: no import there ever succeeds (rdma-core's default does
/// nothing too); a host device's object goes to the host library.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_unimport_pd(pd: *mut ibv_pd) {
    forward!(obj pd, ibv_unimport_pd(pd));
}

/// As [`swv_ibv_unimport_pd`].
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_unimport_mr(mr: *mut ibv_mr) {
    forward!(obj mr, ibv_unimport_mr(mr));
}

/// As [`swv_ibv_unimport_pd`].
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_unimport_dm(dm: *mut ibv_dm) {
    forward!(obj dm, ibv_unimport_dm(dm));
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_reg_dmabuf_mr(
    _pd: *mut ibv_pd,
    _offset: u64,
    _length: usize,
    _iova: u64,
    _fd: c_int,
    _access: c_int,
) -> *mut ibv_mr {
    forward!(create Mr, obj _pd, ibv_reg_dmabuf_mr(_pd, _offset, _length, _iova, _fd, _access), |o| u64::from((*o).lkey));
    errno::set(errno::unsupported(
        "ibv_reg_dmabuf_mr",
        "dma-buf memory (as Linux siw)",
    ));
    std::ptr::null_mut()
}

/// rdma-core sets `errno` only when `vendor_id` is 0, before asking the provider; the
/// provider's answer is `EOPNOTSUPP` either way.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_set_ece(_qp: *mut ibv_qp, ece: *mut ibv_ece) -> c_int {
    forward!(obj _qp, ibv_set_ece(_qp, ece));
    let e = errno::unsupported("ibv_set_ece", "ECE (carried by InfiniBand's CM, not MPA)");
    // SAFETY: the caller's structure (rdma-core reads it unchecked); NULL is not read.
    if unsafe { ece.as_ref() }.is_some_and(|ece| ece.vendor_id == 0) {
        errno::set(e);
    }
    e
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_query_ece(_qp: *mut ibv_qp, _ece: *mut ibv_ece) -> c_int {
    forward!(obj _qp, ibv_query_ece(_qp, _ece));
    errno::unsupported("ibv_query_ece", "ECE (carried by InfiniBand's CM, not MPA)")
}
