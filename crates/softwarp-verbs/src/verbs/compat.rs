//! libibverbs 1.0's ABI (`IBVERBS_1.0`, before 2006's 1.1), as rdma-core keeps it in
//! `libibverbs/compat-1_0.c`: a program linked against libibverbs 1.0 binds to these
//! non-default versions (`ibv_open_device@IBVERBS_1.0`, ...), whose structures have another
//! layout (`ibv_context_1_0`, `ibv_qp_1_0`, ...). Each call wraps or unwraps those
//! structures around this library's own objects and answers as the current call does, the
//! way rdma-core's compatibility layer answers over its providers:
//!
//! - every 1.0 object is a small structure of its own that points to the real one
//!   (`real_*`); the real CQ's, SRQ's and QP's context pointer is set to the 1.0 wrapper, so
//!   that asynchronous and completion events can be given back in 1.0 terms;
//! - a 1.0 context carries the five data-path operations 1.0 programs call through
//!   `context->ops` (`poll_cq`, `req_notify_cq`, `post_send`, `post_recv`, `post_srq_recv`);
//!   the others are NULL, as in rdma-core. The 1.0 work requests (another field order) are
//!   converted into current ones, and `*bad_wr` names the caller's own element;
//! - the device list is rdma-core's: one 1.0 device per real device, the real list kept in
//!   front of the array.
//!
//! Where rdma-core's layer reads through a NULL pointer (`ibv_query_qp` of a QP without an
//! SRQ, the NULL objects of a failed call) this one answers NULL or `EINVAL` instead.
//! Address handles and UD QPs, which would need the 1.0 AH translated in `post_send`, do not
//! exist here (`ibv_create_ah` fails as in the current ABI).
//!
//! The entry points are bound to `NAME@IBVERBS_1.0` in `src/exports.rs` (`compat_exports!`).

use std::ffi::{c_char, c_int, c_uint, c_void};

use crate::ffi::*;
use crate::verbs::context::{
    swv_ibv_ack_async_event, swv_ibv_attach_mcast, swv_ibv_close_device, swv_ibv_create_ah,
    swv_ibv_destroy_ah, swv_ibv_detach_mcast, swv_ibv_free_device_list, swv_ibv_get_async_event,
    swv_ibv_get_device_guid, swv_ibv_get_device_list, swv_ibv_get_device_name, swv_ibv_open_device,
    swv_ibv_query_device, swv_ibv_query_gid, swv_ibv_query_pkey, swv_ibv_query_port,
};
use crate::verbs::cq::{
    swv_ibv_ack_cq_events, swv_ibv_create_cq, swv_ibv_destroy_cq, swv_ibv_get_cq_event,
    swv_ibv_resize_cq,
};
use crate::verbs::mr::{swv_ibv_alloc_pd, swv_ibv_dealloc_pd, swv_ibv_dereg_mr, swv_ibv_reg_mr};
use crate::verbs::qp::{
    swv_ibv_create_qp, swv_ibv_create_srq, swv_ibv_destroy_qp, swv_ibv_destroy_srq,
    swv_ibv_modify_qp, swv_ibv_modify_srq, swv_ibv_query_qp, swv_ibv_query_srq,
};

/// `struct ibv_device_1_0`.
#[repr(C)]
pub struct Device10 {
    obsolete_sysfs_dev: *mut c_void,
    obsolete_sysfs_ibdev: *mut c_void,
    real_device: *mut ibv_device,
    /// `struct _ibv_device_ops`: two function pointers nobody calls.
    ops: [usize; 2],
}

type PollCq10 = unsafe extern "C" fn(*mut Cq10, c_int, *mut ibv_wc) -> c_int;
type ReqNotify10 = unsafe extern "C" fn(*mut Cq10, c_int) -> c_int;
type PostSrqRecv10 = unsafe extern "C" fn(*mut Srq10, *mut RecvWr10, *mut *mut RecvWr10) -> c_int;
type PostSend10 = unsafe extern "C" fn(*mut Qp10, *mut SendWr10, *mut *mut SendWr10) -> c_int;
type PostRecv10 = unsafe extern "C" fn(*mut Qp10, *mut RecvWr10, *mut *mut RecvWr10) -> c_int;

/// `struct ibv_context_ops_1_0`: 27 function pointers, of which rdma-core fills the five
/// data-path ones.
#[repr(C)]
pub struct ContextOps10 {
    /// `query_device` to `create_cq`.
    before_poll: [usize; 7],
    poll_cq: Option<PollCq10>,
    req_notify_cq: Option<ReqNotify10>,
    /// `cq_event` to `destroy_srq`.
    before_srq_recv: [usize; 7],
    post_srq_recv: Option<PostSrqRecv10>,
    /// `create_qp` to `destroy_qp`.
    before_send: [usize; 4],
    post_send: Option<PostSend10>,
    post_recv: Option<PostRecv10>,
    /// `create_ah` to `detach_mcast`.
    after_recv: [usize; 4],
}

/// `struct ibv_context_1_0`.
#[repr(C)]
pub struct Context10 {
    device: *mut Device10,
    ops: ContextOps10,
    cmd_fd: c_int,
    async_fd: c_int,
    num_comp_vectors: c_int,
    real_context: *mut ibv_context,
}

/// `struct ibv_pd_1_0`.
#[repr(C)]
pub struct Pd10 {
    context: *mut Context10,
    handle: u32,
    real_pd: *mut ibv_pd,
}

/// `struct ibv_mr_1_0`.
#[repr(C)]
pub struct Mr10 {
    context: *mut Context10,
    pd: *mut Pd10,
    handle: u32,
    lkey: u32,
    rkey: u32,
    real_mr: *mut ibv_mr,
}

/// `struct ibv_srq_1_0`.
#[repr(C)]
pub struct Srq10 {
    context: *mut Context10,
    srq_context: *mut c_void,
    pd: *mut Pd10,
    handle: u32,
    mutex: libc::pthread_mutex_t,
    cond: libc::pthread_cond_t,
    events_completed: u32,
    real_srq: *mut ibv_srq,
}

/// `struct ibv_qp_init_attr_1_0`.
#[repr(C)]
pub struct QpInitAttr10 {
    qp_context: *mut c_void,
    send_cq: *mut Cq10,
    recv_cq: *mut Cq10,
    srq: *mut Srq10,
    cap: ibv_qp_cap,
    qp_type: ibv_qp_type,
    sq_sig_all: c_int,
}

/// The `wr` union of `struct ibv_send_wr_1_0` (its largest member, `atomic`; `rdma` is its
/// prefix, and `ud` would name a 1.0 address handle).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SendWrUnion10 {
    remote_addr: u64,
    compare_add: u64,
    swap: u64,
    rkey: u32,
}

/// `struct ibv_send_wr_1_0` (`next` before `wr_id`, unlike today's).
#[repr(C)]
pub struct SendWr10 {
    next: *mut SendWr10,
    wr_id: u64,
    sg_list: *mut ibv_sge,
    num_sge: c_int,
    opcode: ibv_wr_opcode,
    send_flags: c_int,
    imm_data: u32,
    wr: SendWrUnion10,
}

/// `struct ibv_recv_wr_1_0`.
#[repr(C)]
pub struct RecvWr10 {
    next: *mut RecvWr10,
    wr_id: u64,
    sg_list: *mut ibv_sge,
    num_sge: c_int,
}

/// `struct ibv_qp_1_0`.
#[repr(C)]
pub struct Qp10 {
    context: *mut Context10,
    qp_context: *mut c_void,
    pd: *mut Pd10,
    send_cq: *mut Cq10,
    recv_cq: *mut Cq10,
    srq: *mut Srq10,
    handle: u32,
    qp_num: u32,
    state: ibv_qp_state,
    qp_type: ibv_qp_type,
    mutex: libc::pthread_mutex_t,
    cond: libc::pthread_cond_t,
    events_completed: u32,
    real_qp: *mut ibv_qp,
}

/// `struct ibv_cq_1_0`.
#[repr(C)]
pub struct Cq10 {
    context: *mut Context10,
    cq_context: *mut c_void,
    handle: u32,
    cqe: c_int,
    mutex: libc::pthread_mutex_t,
    cond: libc::pthread_cond_t,
    comp_events_completed: u32,
    async_events_completed: u32,
    real_cq: *mut ibv_cq,
}

/// `struct ibv_ah_1_0`.
#[repr(C)]
pub struct Ah10 {
    context: *mut Context10,
    pd: *mut Pd10,
    handle: u32,
    real_ah: *mut ibv_ah,
}

// The 1.0 layouts on LP64 (rdma-core's compat-1_0.c compiled for x86-64 and AArch64).
const _: () = {
    assert!(std::mem::size_of::<Device10>() == 40);
    assert!(std::mem::size_of::<ContextOps10>() == 27 * 8);
    assert!(std::mem::offset_of!(ContextOps10, poll_cq) == 7 * 8);
    assert!(std::mem::offset_of!(ContextOps10, post_srq_recv) == 16 * 8);
    assert!(std::mem::offset_of!(ContextOps10, post_send) == 21 * 8);
    assert!(std::mem::offset_of!(Context10, cmd_fd) == 8 + 27 * 8);
    assert!(std::mem::offset_of!(Context10, real_context) == 8 + 27 * 8 + 16);
    assert!(std::mem::offset_of!(Pd10, real_pd) == 16);
    assert!(std::mem::offset_of!(Mr10, real_mr) == 32);
    assert!(std::mem::offset_of!(SendWr10, wr) == 40);
    assert!(std::mem::size_of::<SendWr10>() == 72);
    assert!(
        std::mem::size_of::<SendWrUnion10>() == std::mem::size_of::<ibv_send_wr__bindgen_ty_2>()
    );
    assert!(std::mem::offset_of!(QpInitAttr10, cap) == 32);
    assert!(std::mem::offset_of!(Qp10, handle) == 48);
};

/// `ibv_get_device_list@IBVERBS_1.0`: a 1.0 device for each device, the real list kept in
/// front of the array (freed by [`swv_ibv_free_device_list_1_0`]).
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_get_device_list_1_0(num: *mut c_int) -> *mut *mut Device10 {
    let mut n: c_int = 0;
    // SAFETY: our own call, with a valid count pointer.
    let real = unsafe { swv_ibv_get_device_list(&mut n) };
    if real.is_null() {
        return std::ptr::null_mut();
    }
    let n = usize::try_from(n).unwrap_or(0);
    let mut l: Vec<*mut Device10> = Vec::with_capacity(n + 2);
    l.push(real.cast());
    for i in 0..n {
        // SAFETY: `real` holds `n` devices.
        let real_device = unsafe { *real.add(i) };
        // The 1.0 entries serve softwarp0 only: a host device's 1.0 calls would need the
        // host's 1.0 objects (crate::host).
        if !crate::verbs::context::is_own_device(real_device) {
            continue;
        }
        l.push(Box::into_raw(Box::new(Device10 {
            obsolete_sysfs_dev: std::ptr::null_mut(),
            obsolete_sysfs_ibdev: std::ptr::null_mut(),
            real_device,
            ops: [0; 2],
        })));
    }
    let n = l.len() - 1;
    l.push(std::ptr::null_mut());
    // SAFETY: NULL or the caller's count.
    if let Some(num) = unsafe { num.as_mut() } {
        *num = c_int::try_from(n).unwrap_or(c_int::MAX);
    }
    let list = Box::into_raw(l.into_boxed_slice()).cast::<*mut Device10>();
    // SAFETY: the array holds n + 2 entries; the application sees it from the second.
    unsafe { list.add(1) }
}

/// `ibv_free_device_list@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_free_device_list_1_0(list: *mut *mut Device10) {
    if list.is_null() {
        return;
    }
    let mut n = 0;
    // SAFETY: a list of `swv_ibv_get_device_list_1_0`: NULL-terminated, the real list in
    // front of it.
    unsafe {
        while !(*list.add(n)).is_null() {
            drop(Box::from_raw(*list.add(n)));
            n += 1;
        }
        let base = list.sub(1);
        swv_ibv_free_device_list((*base).cast());
        drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
            base,
            n + 2,
        )));
    }
}

/// `ibv_get_device_name@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_get_device_name_1_0(dev: *mut Device10) -> *const c_char {
    // SAFETY: NULL or a 1.0 device of ours.
    match unsafe { dev.as_ref() } {
        // SAFETY: its real device.
        Some(d) => unsafe { swv_ibv_get_device_name(d.real_device) },
        None => std::ptr::null(),
    }
}

/// `ibv_get_device_guid@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_get_device_guid_1_0(dev: *mut Device10) -> u64 {
    // SAFETY: NULL or a 1.0 device of ours.
    match unsafe { dev.as_ref() } {
        // SAFETY: its real device.
        Some(d) => unsafe { swv_ibv_get_device_guid(d.real_device) },
        None => 0,
    }
}

/// The real context of a 1.0 one (NULL for NULL).
///
/// # Safety
/// `ctx` is NULL or a 1.0 context of ours.
unsafe fn real_ctx(ctx: *mut Context10) -> *mut ibv_context {
    // SAFETY: the caller's promise.
    unsafe { ctx.as_ref() }.map_or(std::ptr::null_mut(), |c| c.real_context)
}

unsafe extern "C" fn poll_cq_1_0(cq: *mut Cq10, n: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: a 1.0 CQ of ours (the application's call through its context's ops).
    let Some(c) = (unsafe { cq.as_ref() }) else {
        return -1;
    };
    // SAFETY: the real CQ's context and its operation, as rdma-core calls it.
    unsafe {
        let ctx = (*c.real_cq).context;
        match (*ctx).ops.poll_cq {
            Some(f) => f(c.real_cq, n, wc),
            None => -1,
        }
    }
}

unsafe extern "C" fn req_notify_cq_1_0(cq: *mut Cq10, solicited_only: c_int) -> c_int {
    // SAFETY: as in `poll_cq_1_0`.
    let Some(c) = (unsafe { cq.as_ref() }) else {
        return libc::EINVAL;
    };
    // SAFETY: as in `poll_cq_1_0`.
    unsafe {
        let ctx = (*c.real_cq).context;
        match (*ctx).ops.req_notify_cq {
            Some(f) => f(c.real_cq, solicited_only),
            None => libc::EOPNOTSUPP,
        }
    }
}

/// The current receive list of a 1.0 one, in `out` (one entry per element, linked).
///
/// # Safety
/// `wr` is NULL or a 1.0 list whose elements stay valid while `out` is used.
unsafe fn recv_list(wr: *mut RecvWr10, out: &mut Vec<ibv_recv_wr>) {
    let mut w = wr;
    // SAFETY: the caller's list, NULL-terminated.
    while let Some(e) = unsafe { w.as_ref() } {
        out.push(ibv_recv_wr {
            wr_id: e.wr_id,
            next: std::ptr::null_mut(),
            sg_list: e.sg_list,
            num_sge: e.num_sge,
        });
        w = e.next;
    }
    let base = out.as_mut_ptr();
    for i in 1..out.len() {
        // SAFETY: both indices are in the vector, which does not move from here on.
        unsafe { (*base.add(i - 1)).next = base.add(i) };
    }
}

/// The 1.0 element at the position of `bad` in `real` (the current list made from the 1.0
/// list `wr`), written to `*bad_out`.
///
/// # Safety
/// `wr` is the 1.0 list `real` was made from; `bad_out` NULL or writable.
unsafe fn name_bad<R, W>(
    real: &[R],
    bad: *const R,
    wr: *mut W,
    bad_out: *mut *mut W,
    next: fn(&W) -> *mut W,
) {
    let Some(i) = real.iter().position(|r| std::ptr::eq(r, bad)) else {
        return;
    };
    let mut w = wr;
    for _ in 0..i {
        // SAFETY: the 1.0 list has as many elements as `real`.
        w = next(unsafe { &*w });
    }
    if !bad_out.is_null() {
        // SAFETY: the caller's pointer.
        unsafe { *bad_out = w };
    }
}

unsafe extern "C" fn post_recv_1_0(
    qp: *mut Qp10,
    wr: *mut RecvWr10,
    bad: *mut *mut RecvWr10,
) -> c_int {
    // SAFETY: a 1.0 QP of ours.
    let Some(q) = (unsafe { qp.as_ref() }) else {
        return libc::EINVAL;
    };
    let mut real = Vec::new();
    // SAFETY: the caller's list, alive for the call.
    unsafe { recv_list(wr, &mut real) };
    let mut real_bad: *mut ibv_recv_wr = std::ptr::null_mut();
    let head = real
        .first_mut()
        .map_or(std::ptr::null_mut(), |h| h as *mut ibv_recv_wr);
    // SAFETY: the real QP's context operation, as rdma-core calls it.
    let ret = unsafe {
        match (*(*q.real_qp).context).ops.post_recv {
            Some(f) => f(q.real_qp, head, &mut real_bad),
            None => libc::EOPNOTSUPP,
        }
    };
    if ret != 0 {
        // SAFETY: `wr` is the list `real` was made from.
        unsafe { name_bad(&real, real_bad, wr, bad, |w: &RecvWr10| w.next) };
    }
    ret
}

unsafe extern "C" fn post_srq_recv_1_0(
    srq: *mut Srq10,
    wr: *mut RecvWr10,
    bad: *mut *mut RecvWr10,
) -> c_int {
    // SAFETY: a 1.0 SRQ of ours.
    let Some(s) = (unsafe { srq.as_ref() }) else {
        return libc::EINVAL;
    };
    let mut real = Vec::new();
    // SAFETY: the caller's list, alive for the call.
    unsafe { recv_list(wr, &mut real) };
    let mut real_bad: *mut ibv_recv_wr = std::ptr::null_mut();
    let head = real
        .first_mut()
        .map_or(std::ptr::null_mut(), |h| h as *mut ibv_recv_wr);
    // SAFETY: the real SRQ's context operation, as rdma-core calls it.
    let ret = unsafe {
        match (*(*s.real_srq).context).ops.post_srq_recv {
            Some(f) => f(s.real_srq, head, &mut real_bad),
            None => libc::EOPNOTSUPP,
        }
    };
    if ret != 0 {
        // SAFETY: `wr` is the list `real` was made from.
        unsafe { name_bad(&real, real_bad, wr, bad, |w: &RecvWr10| w.next) };
    }
    ret
}

unsafe extern "C" fn post_send_1_0(
    qp: *mut Qp10,
    wr: *mut SendWr10,
    bad: *mut *mut SendWr10,
) -> c_int {
    // SAFETY: a 1.0 QP of ours.
    let Some(q) = (unsafe { qp.as_ref() }) else {
        return libc::EINVAL;
    };
    let mut real: Vec<ibv_send_wr> = Vec::new();
    let mut w = wr;
    // SAFETY: the caller's list, NULL-terminated.
    while let Some(e) = unsafe { w.as_ref() } {
        // SAFETY: plain C data; all-zero is valid.
        let mut r: ibv_send_wr = unsafe { std::mem::zeroed() };
        r.wr_id = e.wr_id;
        r.sg_list = e.sg_list;
        r.num_sge = e.num_sge;
        r.opcode = e.opcode;
        r.send_flags = e.send_flags as c_uint;
        r.__bindgen_anon_1.imm_data = e.imm_data;
        // The `wr` unions have one layout (rdma: address and key; atomic: address, compare,
        // swap, key), checked at compile time above.
        // SAFETY: same size, plain data.
        r.wr = unsafe { std::mem::transmute::<SendWrUnion10, ibv_send_wr__bindgen_ty_2>(e.wr) };
        real.push(r);
        w = e.next;
    }
    let base = real.as_mut_ptr();
    for i in 1..real.len() {
        // SAFETY: both indices are in the vector, which does not move from here on.
        unsafe { (*base.add(i - 1)).next = base.add(i) };
    }
    let mut real_bad: *mut ibv_send_wr = std::ptr::null_mut();
    let head = real
        .first_mut()
        .map_or(std::ptr::null_mut(), |h| h as *mut ibv_send_wr);
    // SAFETY: the real QP's context operation, as rdma-core calls it.
    let ret = unsafe {
        match (*(*q.real_qp).context).ops.post_send {
            Some(f) => f(q.real_qp, head, &mut real_bad),
            None => libc::EOPNOTSUPP,
        }
    };
    if ret != 0 {
        // SAFETY: `wr` is the list `real` was made from.
        unsafe { name_bad(&real, real_bad, wr, bad, |w: &SendWr10| w.next) };
    }
    ret
}

/// `ibv_open_device@IBVERBS_1.0`: a 1.0 context over a context of the device, with the
/// five data-path operations.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_open_device_1_0(dev: *mut Device10) -> *mut Context10 {
    // SAFETY: NULL or a 1.0 device of ours.
    let Some(d) = (unsafe { dev.as_ref() }) else {
        crate::errno::set(libc::EINVAL);
        return std::ptr::null_mut();
    };
    // SAFETY: its real device.
    let real = unsafe { swv_ibv_open_device(d.real_device) };
    if real.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: the context just opened.
    let (cmd_fd, async_fd, num_comp_vectors) =
        unsafe { ((*real).cmd_fd, (*real).async_fd, (*real).num_comp_vectors) };
    Box::into_raw(Box::new(Context10 {
        device: dev,
        ops: ContextOps10 {
            before_poll: [0; 7],
            poll_cq: Some(poll_cq_1_0),
            req_notify_cq: Some(req_notify_cq_1_0),
            before_srq_recv: [0; 7],
            post_srq_recv: Some(post_srq_recv_1_0),
            before_send: [0; 4],
            post_send: Some(post_send_1_0),
            post_recv: Some(post_recv_1_0),
            after_recv: [0; 4],
        },
        cmd_fd,
        async_fd,
        num_comp_vectors,
        real_context: real,
    }))
}

/// `ibv_close_device@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_close_device_1_0(ctx: *mut Context10) -> c_int {
    if ctx.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a 1.0 context of ours.
    let ret = unsafe { swv_ibv_close_device(real_ctx(ctx)) };
    if ret == 0 {
        // SAFETY: made by `swv_ibv_open_device_1_0`; the application gives it up.
        drop(unsafe { Box::from_raw(ctx) });
    }
    ret
}

/// `ibv_get_async_event@IBVERBS_1.0`: the event's CQ, QP or SRQ as the 1.0 object (the
/// real one's context pointer).
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_get_async_event_1_0(
    ctx: *mut Context10,
    event: *mut ibv_async_event,
) -> c_int {
    // SAFETY: a 1.0 context of ours and the caller's event.
    let ret = unsafe { swv_ibv_get_async_event(real_ctx(ctx), event) };
    if ret != 0 {
        return ret;
    }
    // SAFETY: the event just filled; its element is a live object of ours.
    unsafe {
        let e = &mut *event;
        match e.event_type {
            IBV_EVENT_CQ_ERR => e.element.cq = (*e.element.cq).cq_context.cast(),
            IBV_EVENT_QP_FATAL
            | IBV_EVENT_QP_REQ_ERR
            | IBV_EVENT_QP_ACCESS_ERR
            | IBV_EVENT_COMM_EST
            | IBV_EVENT_SQ_DRAINED
            | IBV_EVENT_PATH_MIG
            | IBV_EVENT_PATH_MIG_ERR
            | IBV_EVENT_QP_LAST_WQE_REACHED => {
                e.element.qp = (*e.element.qp).qp_context.cast();
            }
            IBV_EVENT_SRQ_ERR | IBV_EVENT_SRQ_LIMIT_REACHED => {
                e.element.srq = (*e.element.srq).srq_context.cast();
            }
            _ => {}
        }
    }
    0
}

/// `ibv_ack_async_event@IBVERBS_1.0`: the 1.0 element back to the real one.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_ack_async_event_1_0(event: *mut ibv_async_event) {
    // SAFETY: NULL or the caller's event, given by `swv_ibv_get_async_event_1_0`.
    let Some(e) = (unsafe { event.as_ref() }) else {
        return;
    };
    let mut real = *e;
    // SAFETY: the element is the 1.0 object that event named.
    unsafe {
        match e.event_type {
            IBV_EVENT_CQ_ERR => real.element.cq = (*e.element.cq.cast::<Cq10>()).real_cq,
            IBV_EVENT_QP_FATAL
            | IBV_EVENT_QP_REQ_ERR
            | IBV_EVENT_QP_ACCESS_ERR
            | IBV_EVENT_COMM_EST
            | IBV_EVENT_SQ_DRAINED
            | IBV_EVENT_PATH_MIG
            | IBV_EVENT_PATH_MIG_ERR
            | IBV_EVENT_QP_LAST_WQE_REACHED => {
                real.element.qp = (*e.element.qp.cast::<Qp10>()).real_qp;
            }
            IBV_EVENT_SRQ_ERR | IBV_EVENT_SRQ_LIMIT_REACHED => {
                real.element.srq = (*e.element.srq.cast::<Srq10>()).real_srq;
            }
            _ => {}
        }
        swv_ibv_ack_async_event(&mut real);
    }
}

/// `ibv_query_device@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_query_device_1_0(
    ctx: *mut Context10,
    attr: *mut ibv_device_attr,
) -> c_int {
    // SAFETY: forwarded.
    unsafe { swv_ibv_query_device(real_ctx(ctx), attr) }
}

/// `ibv_query_port@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_query_port_1_0(
    ctx: *mut Context10,
    port: u8,
    attr: *mut ibv_port_attr,
) -> c_int {
    // SAFETY: forwarded.
    unsafe { swv_ibv_query_port(real_ctx(ctx), port, attr) }
}

/// `ibv_query_gid@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_query_gid_1_0(
    ctx: *mut Context10,
    port: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    // SAFETY: forwarded.
    unsafe { swv_ibv_query_gid(real_ctx(ctx), port, index, gid) }
}

/// `ibv_query_pkey@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_query_pkey_1_0(
    ctx: *mut Context10,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    // SAFETY: forwarded.
    unsafe { swv_ibv_query_pkey(real_ctx(ctx), port, index, pkey) }
}

/// `ibv_alloc_pd@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_alloc_pd_1_0(ctx: *mut Context10) -> *mut Pd10 {
    // SAFETY: forwarded.
    let real = unsafe { swv_ibv_alloc_pd(real_ctx(ctx)) };
    if real.is_null() {
        return std::ptr::null_mut();
    }
    Box::into_raw(Box::new(Pd10 {
        context: ctx,
        handle: 0,
        real_pd: real,
    }))
}

/// The real PD of a 1.0 one (NULL for NULL).
///
/// # Safety
/// `pd` is NULL or a 1.0 PD of ours.
unsafe fn real_pd(pd: *mut Pd10) -> *mut ibv_pd {
    // SAFETY: the caller's promise.
    unsafe { pd.as_ref() }.map_or(std::ptr::null_mut(), |p| p.real_pd)
}

/// `ibv_dealloc_pd@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_dealloc_pd_1_0(pd: *mut Pd10) -> c_int {
    if pd.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a 1.0 PD of ours.
    let ret = unsafe { swv_ibv_dealloc_pd(real_pd(pd)) };
    if ret == 0 {
        // SAFETY: made by `swv_ibv_alloc_pd_1_0`; the application gives it up.
        drop(unsafe { Box::from_raw(pd) });
    }
    ret
}

/// `ibv_reg_mr@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_reg_mr_1_0(
    pd: *mut Pd10,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut Mr10 {
    // SAFETY: forwarded.
    let real = unsafe { swv_ibv_reg_mr(real_pd(pd), addr, len, access) };
    if real.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: the MR just made, and the 1.0 PD it was made in.
    let (lkey, rkey, context) = unsafe { ((*real).lkey, (*real).rkey, (*pd).context) };
    Box::into_raw(Box::new(Mr10 {
        context,
        pd,
        handle: 0,
        lkey,
        rkey,
        real_mr: real,
    }))
}

/// `ibv_dereg_mr@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_dereg_mr_1_0(mr: *mut Mr10) -> c_int {
    // SAFETY: NULL or a 1.0 MR of ours.
    let Some(m) = (unsafe { mr.as_ref() }) else {
        return libc::EINVAL;
    };
    // SAFETY: its real MR.
    let ret = unsafe { swv_ibv_dereg_mr(m.real_mr) };
    if ret == 0 {
        // SAFETY: made by `swv_ibv_reg_mr_1_0`; the application gives it up.
        drop(unsafe { Box::from_raw(mr) });
    }
    ret
}

/// `ibv_create_cq@IBVERBS_1.0`: the real CQ's context pointer is the 1.0 CQ.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_create_cq_1_0(
    ctx: *mut Context10,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut Cq10 {
    // SAFETY: forwarded.
    let real = unsafe { swv_ibv_create_cq(real_ctx(ctx), cqe, cq_context, channel, comp_vector) };
    if real.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: plain C data (a mutex and a condition variable nobody uses); all-zero is
    // their static initializer on Linux.
    let mut cq: Box<Cq10> = Box::new(unsafe { std::mem::zeroed() });
    cq.context = ctx;
    cq.cq_context = cq_context;
    cq.cqe = cqe;
    cq.real_cq = real;
    let p = Box::into_raw(cq);
    // SAFETY: the CQ just made, not yet the application's; rdma-core sets the field too.
    unsafe { (*real).cq_context = p.cast() };
    p
}

/// `ibv_resize_cq@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_resize_cq_1_0(cq: *mut Cq10, cqe: c_int) -> c_int {
    // SAFETY: NULL or a 1.0 CQ of ours.
    match unsafe { cq.as_ref() } {
        // SAFETY: its real CQ.
        Some(c) => unsafe { swv_ibv_resize_cq(c.real_cq, cqe) },
        None => libc::EINVAL,
    }
}

/// `ibv_destroy_cq@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_destroy_cq_1_0(cq: *mut Cq10) -> c_int {
    // SAFETY: NULL or a 1.0 CQ of ours.
    let Some(c) = (unsafe { cq.as_ref() }) else {
        return libc::EINVAL;
    };
    // SAFETY: its real CQ.
    let ret = unsafe { swv_ibv_destroy_cq(c.real_cq) };
    if ret == 0 {
        // SAFETY: made by `swv_ibv_create_cq_1_0`; the application gives it up.
        drop(unsafe { Box::from_raw(cq) });
    }
    ret
}

/// `ibv_get_cq_event@IBVERBS_1.0`: the 1.0 CQ and its context.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_get_cq_event_1_0(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut Cq10,
    cq_context: *mut *mut c_void,
) -> c_int {
    if cq.is_null() || cq_context.is_null() {
        crate::errno::set(libc::EINVAL);
        return -1;
    }
    let mut real: *mut ibv_cq = std::ptr::null_mut();
    let mut ctx: *mut c_void = std::ptr::null_mut();
    // SAFETY: forwarded, with our own out pointers.
    let ret = unsafe { swv_ibv_get_cq_event(channel, &mut real, &mut ctx) };
    if ret != 0 {
        return ret;
    }
    let c = ctx.cast::<Cq10>();
    // SAFETY: the real CQ's context is its 1.0 CQ; the caller's out pointers.
    unsafe {
        *cq = c;
        *cq_context = (*c).cq_context;
    }
    0
}

/// `ibv_ack_cq_events@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_ack_cq_events_1_0(cq: *mut Cq10, nevents: c_uint) {
    // SAFETY: NULL or a 1.0 CQ of ours.
    if let Some(c) = unsafe { cq.as_ref() } {
        // SAFETY: its real CQ.
        unsafe { swv_ibv_ack_cq_events(c.real_cq, nevents) };
    }
}

/// `ibv_create_srq@IBVERBS_1.0`: the real SRQ's context pointer is the 1.0 SRQ.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_create_srq_1_0(
    pd: *mut Pd10,
    attr: *mut ibv_srq_init_attr,
) -> *mut Srq10 {
    // SAFETY: forwarded.
    let real = unsafe { swv_ibv_create_srq(real_pd(pd), attr) };
    if real.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: as in `swv_ibv_create_cq_1_0`.
    let mut srq: Box<Srq10> = Box::new(unsafe { std::mem::zeroed() });
    // SAFETY: the PD (checked by the create) and the caller's attributes.
    unsafe {
        srq.context = (*pd).context;
        srq.srq_context = (*attr).srq_context;
    }
    srq.pd = pd;
    srq.real_srq = real;
    let p = Box::into_raw(srq);
    // SAFETY: the SRQ just made; rdma-core sets the field too.
    unsafe { (*real).srq_context = p.cast() };
    p
}

/// `ibv_modify_srq@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_modify_srq_1_0(
    srq: *mut Srq10,
    attr: *mut ibv_srq_attr,
    mask: c_int,
) -> c_int {
    // SAFETY: NULL or a 1.0 SRQ of ours.
    match unsafe { srq.as_ref() } {
        // SAFETY: its real SRQ.
        Some(s) => unsafe { swv_ibv_modify_srq(s.real_srq, attr, mask) },
        None => libc::EINVAL,
    }
}

/// `ibv_query_srq@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_query_srq_1_0(srq: *mut Srq10, attr: *mut ibv_srq_attr) -> c_int {
    // SAFETY: NULL or a 1.0 SRQ of ours.
    match unsafe { srq.as_ref() } {
        // SAFETY: its real SRQ.
        Some(s) => unsafe { swv_ibv_query_srq(s.real_srq, attr) },
        None => libc::EINVAL,
    }
}

/// `ibv_destroy_srq@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_destroy_srq_1_0(srq: *mut Srq10) -> c_int {
    // SAFETY: NULL or a 1.0 SRQ of ours.
    let Some(s) = (unsafe { srq.as_ref() }) else {
        return libc::EINVAL;
    };
    // SAFETY: its real SRQ.
    let ret = unsafe { swv_ibv_destroy_srq(s.real_srq) };
    if ret == 0 {
        // SAFETY: made by `swv_ibv_create_srq_1_0`; the application gives it up.
        drop(unsafe { Box::from_raw(srq) });
    }
    ret
}

/// `ibv_create_qp@IBVERBS_1.0`: the real QP's context pointer is the 1.0 QP; the caps the
/// QP got are written back.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_create_qp_1_0(
    pd: *mut Pd10,
    attr: *mut QpInitAttr10,
) -> *mut Qp10 {
    // SAFETY: NULL or the caller's attributes.
    let Some(a) = (unsafe { attr.as_mut() }) else {
        crate::errno::set(libc::EINVAL);
        return std::ptr::null_mut();
    };
    // SAFETY: NULL or 1.0 CQs and SRQ of ours.
    let (scq, rcq, srq) = unsafe {
        (
            a.send_cq
                .as_ref()
                .map_or(std::ptr::null_mut(), |c| c.real_cq),
            a.recv_cq
                .as_ref()
                .map_or(std::ptr::null_mut(), |c| c.real_cq),
            a.srq.as_ref().map_or(std::ptr::null_mut(), |s| s.real_srq),
        )
    };
    let mut real_attr = ibv_qp_init_attr {
        qp_context: a.qp_context,
        send_cq: scq,
        recv_cq: rcq,
        srq,
        cap: a.cap,
        qp_type: a.qp_type,
        sq_sig_all: a.sq_sig_all,
    };
    // SAFETY: forwarded.
    let real = unsafe { swv_ibv_create_qp(real_pd(pd), &mut real_attr) };
    if real.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: as in `swv_ibv_create_cq_1_0`.
    let mut qp: Box<Qp10> = Box::new(unsafe { std::mem::zeroed() });
    // SAFETY: the PD (checked by the create) and the QP just made.
    unsafe {
        qp.context = (*pd).context;
        qp.qp_num = (*real).qp_num;
    }
    qp.qp_context = a.qp_context;
    qp.pd = pd;
    qp.send_cq = a.send_cq;
    qp.recv_cq = a.recv_cq;
    qp.srq = a.srq;
    qp.qp_type = a.qp_type;
    qp.real_qp = real;
    a.cap = real_attr.cap;
    let p = Box::into_raw(qp);
    // SAFETY: the QP just made; rdma-core sets the field too (the application may, too).
    unsafe { (*real).qp_context = p.cast() };
    p
}

/// `ibv_query_qp@IBVERBS_1.0`: the CQs and SRQ as their 1.0 objects.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_query_qp_1_0(
    qp: *mut Qp10,
    attr: *mut ibv_qp_attr,
    mask: c_int,
    init: *mut QpInitAttr10,
) -> c_int {
    // SAFETY: NULL or a 1.0 QP of ours, and the caller's attributes.
    let (Some(q), Some(i)) = (unsafe { qp.as_ref() }, unsafe { init.as_mut() }) else {
        return libc::EINVAL;
    };
    // SAFETY: plain C data; all-zero is valid.
    let mut real_init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    // SAFETY: forwarded.
    let ret = unsafe { swv_ibv_query_qp(q.real_qp, attr, mask, &mut real_init) };
    if ret != 0 {
        return ret;
    }
    // SAFETY: the real CQs' and SRQ's context pointers are their 1.0 objects.
    unsafe {
        i.qp_context = q.qp_context;
        i.send_cq = real_init
            .send_cq
            .as_ref()
            .map_or(std::ptr::null_mut(), |c| c.cq_context.cast());
        i.recv_cq = real_init
            .recv_cq
            .as_ref()
            .map_or(std::ptr::null_mut(), |c| c.cq_context.cast());
        i.srq = real_init
            .srq
            .as_ref()
            .map_or(std::ptr::null_mut(), |s| s.srq_context.cast());
    }
    i.qp_type = real_init.qp_type;
    i.cap = real_init.cap;
    i.sq_sig_all = real_init.sq_sig_all;
    0
}

/// `ibv_modify_qp@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_modify_qp_1_0(
    qp: *mut Qp10,
    attr: *mut ibv_qp_attr,
    mask: c_int,
) -> c_int {
    // SAFETY: NULL or a 1.0 QP of ours.
    match unsafe { qp.as_ref() } {
        // SAFETY: its real QP.
        Some(q) => unsafe { swv_ibv_modify_qp(q.real_qp, attr, mask) },
        None => libc::EINVAL,
    }
}

/// `ibv_destroy_qp@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_destroy_qp_1_0(qp: *mut Qp10) -> c_int {
    // SAFETY: NULL or a 1.0 QP of ours.
    let Some(q) = (unsafe { qp.as_ref() }) else {
        return libc::EINVAL;
    };
    // SAFETY: its real QP.
    let ret = unsafe { swv_ibv_destroy_qp(q.real_qp) };
    if ret == 0 {
        // SAFETY: made by `swv_ibv_create_qp_1_0`; the application gives it up.
        drop(unsafe { Box::from_raw(qp) });
    }
    ret
}

/// `ibv_create_ah@IBVERBS_1.0` (address handles do not exist here: NULL, as the current
/// call answers).
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_create_ah_1_0(pd: *mut Pd10, attr: *mut ibv_ah_attr) -> *mut Ah10 {
    // SAFETY: forwarded.
    let real = unsafe { swv_ibv_create_ah(real_pd(pd), attr) };
    if real.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: the PD (checked by the create).
    let context = unsafe { (*pd).context };
    Box::into_raw(Box::new(Ah10 {
        context,
        pd,
        handle: 0,
        real_ah: real,
    }))
}

/// `ibv_destroy_ah@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_destroy_ah_1_0(ah: *mut Ah10) -> c_int {
    // SAFETY: NULL or a 1.0 AH of ours.
    let real = unsafe { ah.as_ref() }.map_or(std::ptr::null_mut(), |a| a.real_ah);
    // SAFETY: forwarded.
    let ret = unsafe { swv_ibv_destroy_ah(real) };
    if ret == 0 && !ah.is_null() {
        // SAFETY: made by `swv_ibv_create_ah_1_0`; the application gives it up.
        drop(unsafe { Box::from_raw(ah) });
    }
    ret
}

/// `ibv_attach_mcast@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_attach_mcast_1_0(
    qp: *mut Qp10,
    gid: *const ibv_gid,
    lid: u16,
) -> c_int {
    // SAFETY: NULL or a 1.0 QP of ours; forwarded.
    unsafe {
        swv_ibv_attach_mcast(
            qp.as_ref().map_or(std::ptr::null_mut(), |q| q.real_qp),
            gid,
            lid,
        )
    }
}

/// `ibv_detach_mcast@IBVERBS_1.0`.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_detach_mcast_1_0(
    qp: *mut Qp10,
    gid: *const ibv_gid,
    lid: u16,
) -> c_int {
    // SAFETY: NULL or a 1.0 QP of ours; forwarded.
    unsafe {
        swv_ibv_detach_mcast(
            qp.as_ref().map_or(std::ptr::null_mut(), |q| q.real_qp),
            gid,
            lid,
        )
    }
}
