//! The C caller of the calls that create objects, for `softwarp resources` (CREATED-AT) and
//! leak reports.
//!
//! The `#[track_caller]` chain of the `softwarp` crate ends in this library, so every object
//! made through the C ABI would be listed at one of our own lines. The trampolines of the
//! creating calls ([`crate::exports`]) therefore pass the C caller's return address as one
//! more argument (`mov rdx, [rsp]` / `mov x2, x30` before the jump, in the first argument
//! register the C signature leaves free) to a `swvc_` wrapper made here, which runs the
//! implementation under [`softwarp_ras::tracker::with_caller`]. The address is resolved only
//! when an object is registered, with `dladdr`: `OBJECT(SYMBOL+0xOFF)` in the format of
//! glibc's `backtrace_symbols`, or `OBJECT(+0xOFF)` with the offset from the object's load
//! address when no exported symbol covers it (a stripped or non-`-rdynamic` executable),
//! which `addr2line -e OBJECT 0xOFF` turns into a source line when the object has debug
//! information.

use std::ffi::{c_int, c_uint, c_void, CStr};

use softwarp_ras::tracker::{with_caller, ForeignCaller};

use crate::ffi::*;

/// `addr` (a return address) as `OBJECT(SYMBOL+0xOFF)` or `OBJECT(+0xOFF)`.
pub fn resolve(addr: usize) -> String {
    // SAFETY: plain C data; all-zero is valid.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // The call instruction is before the return address: look that up, so that a call
    // ending a function is not attributed to the next one.
    let at = addr.wrapping_sub(1);
    // SAFETY: `dladdr` only reads the loader's tables; `info` is writable.
    if unsafe { libc::dladdr(at as *const c_void, &mut info) } == 0 {
        return format!("[{addr:#x}]");
    }
    let text = |p: *const libc::c_char| {
        // SAFETY: `dladdr` fills NUL-terminated strings owned by the loader (or NULL).
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    let object = text(info.dli_fname)
        .filter(|f| !f.is_empty())
        .unwrap_or_else(|| "?".to_string());
    match text(info.dli_sname) {
        Some(symbol) if !info.dli_saddr.is_null() => format!(
            "{object}({symbol}+{:#x})",
            addr.wrapping_sub(info.dli_saddr as usize)
        ),
        _ => format!(
            "{object}(+{:#x})",
            addr.wrapping_sub(info.dli_fbase as usize)
        ),
    }
}

extern "C" {
    /// The trampoline in `verbs_context.create_qp_ex` (exports.rs): `swvc_create_qp_ex`
    /// with the caller's return address.
    pub fn swv_create_qp_ex_op(
        ctx: *mut ibv_context,
        attr: *mut ibv_qp_init_attr_ex,
    ) -> *mut ibv_qp;
    /// The trampoline in `verbs_context.create_cq_ex`: `swvc_create_cq_ex` with the caller.
    pub fn swv_create_cq_ex_op(
        ctx: *mut ibv_context,
        attr: *mut ibv_cq_init_attr_ex,
    ) -> *mut ibv_cq_ex;
}

/// Runs `f` with `addr` as the creator of what it registers.
pub fn record<R>(addr: usize, f: impl FnOnce() -> R) -> R {
    with_caller(ForeignCaller { addr, resolve }, f)
}

/// `swvc_NAME(args..., caller)`: what the trampoline of a creating call jumps to. It runs
/// `swv_NAME(args...)` (also called from inside the library) with the caller recorded.
macro_rules! caller_wrappers {
    ($( $name:ident => $inner:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty; )*) => {
        // Not exported: only the versioned trampolines are (see exports.rs).
        std::arch::global_asm!($( concat!(".hidden ", stringify!($name), "\n"), )*);
        $(
            #[no_mangle]
            pub unsafe extern "C" fn $name($($arg: $ty,)* caller: usize) -> $ret {
                // SAFETY: the application's call, forwarded unchanged.
                record(caller, || unsafe { $inner($($arg),*) })
            }
        )*
    };
}

use crate::cm::id::{
    swv_rdma_bind_addr, swv_rdma_create_id, swv_rdma_get_devices, swv_rdma_resolve_addr,
};
use crate::cm::id::{
    swv_rdma_create_ep, swv_rdma_create_qp, swv_rdma_create_qp_ex, swv_rdma_create_srq,
    swv_rdma_create_srq_ex, swv_rdma_get_request, swv_rdma_listen,
};
use crate::verbs::context::swv_ibv_open_device;
use crate::verbs::cq::swv_ibv_create_cq;
use crate::verbs::cq_ex::create_cq_ex;
use crate::verbs::mr::{
    swv_ibv_alloc_pd, swv_ibv_reg_mr, swv_ibv_reg_mr_iova, swv_ibv_reg_mr_iova2,
};
use crate::verbs::qp::{create_qp_ex, swv_ibv_create_qp, swv_ibv_create_srq};

// The argument counts here and in `exports.rs` (which register carries `caller`) must
// agree: each name's count is the number of its C arguments.
caller_wrappers! {
    swvc_ibv_open_device => swv_ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context;
    swvc_ibv_alloc_pd => swv_ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd;
    swvc_ibv_reg_mr => swv_ibv_reg_mr(
        pd: *mut ibv_pd, addr: *mut c_void, len: usize, access: c_int) -> *mut ibv_mr;
    swvc_ibv_reg_mr_iova => swv_ibv_reg_mr_iova(
        pd: *mut ibv_pd, addr: *mut c_void, len: usize, iova: u64, access: c_int) -> *mut ibv_mr;
    swvc_ibv_reg_mr_iova2 => swv_ibv_reg_mr_iova2(
        pd: *mut ibv_pd, addr: *mut c_void, len: usize, iova: u64, access: c_uint) -> *mut ibv_mr;
    swvc_ibv_create_cq => swv_ibv_create_cq(
        ctx: *mut ibv_context, cqe: c_int, cq_context: *mut c_void,
        channel: *mut ibv_comp_channel, comp_vector: c_int) -> *mut ibv_cq;
    swvc_ibv_create_srq => swv_ibv_create_srq(
        pd: *mut ibv_pd, attr: *mut ibv_srq_init_attr) -> *mut ibv_srq;
    swvc_ibv_create_qp => swv_ibv_create_qp(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp;
    swvc_create_qp_ex => create_qp_ex(ctx: *mut ibv_context, attr: *mut ibv_qp_init_attr_ex) -> *mut ibv_qp;
    swvc_create_cq_ex => create_cq_ex(ctx: *mut ibv_context, attr: *mut ibv_cq_init_attr_ex) -> *mut ibv_cq_ex;
    swvc_rdma_get_devices => swv_rdma_get_devices(num: *mut c_int) -> *mut *mut ibv_context;
    swvc_rdma_create_id => swv_rdma_create_id(
        channel: *mut rdma_event_channel, out: *mut *mut rdma_cm_id, context: *mut c_void,
        ps: rdma_port_space) -> c_int;
    swvc_rdma_bind_addr => swv_rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut sockaddr) -> c_int;
    swvc_rdma_resolve_addr => swv_rdma_resolve_addr(
        id: *mut rdma_cm_id, src: *mut sockaddr, dst: *mut sockaddr, timeout_ms: c_int) -> c_int;
    swvc_rdma_listen => swv_rdma_listen(id: *mut rdma_cm_id, backlog: c_int) -> c_int;
    swvc_rdma_create_qp => swv_rdma_create_qp(
        id: *mut rdma_cm_id, pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> c_int;
    swvc_rdma_create_qp_ex => swv_rdma_create_qp_ex(
        id: *mut rdma_cm_id, attr: *mut ibv_qp_init_attr_ex) -> c_int;
    swvc_rdma_create_ep => swv_rdma_create_ep(
        out: *mut *mut rdma_cm_id, res: *mut rdma_addrinfo, pd: *mut ibv_pd,
        attr: *mut ibv_qp_init_attr) -> c_int;
    swvc_rdma_create_srq => swv_rdma_create_srq(
        id: *mut rdma_cm_id, pd: *mut ibv_pd, attr: *mut ibv_srq_init_attr) -> c_int;
    swvc_rdma_create_srq_ex => swv_rdma_create_srq_ex(
        id: *mut rdma_cm_id, attr: *mut ibv_srq_init_attr_ex) -> c_int;
    swvc_rdma_get_request => swv_rdma_get_request(
        listen: *mut rdma_cm_id, out: *mut *mut rdma_cm_id) -> c_int;
}

// The `swv_` implementations the trampolines no longer jump to directly stay out of the
// dynamic symbol table too (`create_qp_ex` and `create_cq_ex` have Rust names and are not
// exported anyway).
std::arch::global_asm!(
    ".hidden swv_ibv_open_device",
    ".hidden swv_ibv_alloc_pd",
    ".hidden swv_ibv_reg_mr",
    ".hidden swv_ibv_reg_mr_iova",
    ".hidden swv_ibv_reg_mr_iova2",
    ".hidden swv_ibv_create_cq",
    ".hidden swv_ibv_create_srq",
    ".hidden swv_ibv_create_qp",
    ".hidden swv_rdma_get_devices",
    ".hidden swv_rdma_create_id",
    ".hidden swv_rdma_bind_addr",
    ".hidden swv_rdma_resolve_addr",
    ".hidden swv_rdma_listen",
    ".hidden swv_rdma_create_qp",
    ".hidden swv_rdma_create_qp_ex",
    ".hidden swv_rdma_create_ep",
    ".hidden swv_rdma_create_srq",
    ".hidden swv_rdma_create_srq_ex",
    ".hidden swv_rdma_get_request",
);
