//! Completion queues, completion channels (`ibv_get_cq_event` blocks; the channel's fd is
//! Softwarp's eventfd, readable while events wait, so it works in `poll`/`epoll`), and the
//! `ibv_context_ops` fast path `poll_cq`/`req_notify_cq`.

use softwarp::sync::lock;
use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::os::fd::AsRawFd;
use std::sync::Mutex;

use softwarp::{
    CompletionChannel, CompletionQueue, CqId, WcStatus, WorkCompletion, EMPTY_COMPLETION,
};

use crate::errno;
use crate::ffi::*;
use crate::host::forward;
use crate::verbs::context::{self, Context};
use crate::verbs::users::Users;
use crate::watch::Watch;

/// `struct ibv_comp_channel` followed by Softwarp's channel and its CQs by id (to turn the
/// CQ that fired back into the application's `ibv_cq`). Its `refcnt` counts the CQs, as
/// rdma-core's does, and changes only under the lock of `cqs` (rdma-core: the context's
/// mutex), which `ibv_destroy_comp_channel` holds while it checks it.
#[repr(C)]
pub struct Channel {
    pub ibv: ibv_comp_channel,
    pub ch: CompletionChannel,
    pub cqs: Mutex<HashMap<CqId, usize>>,
    watch: Watch,
}

/// `struct ibv_cq_ex` (whose first members are `struct ibv_cq`, which `ibv_create_cq`
/// returns; `ibv_cq_ex_to_cq` is a cast) followed by Softwarp's CQ and the completion the
/// `ibv_cq_ex` poll functions made current (cq_ex.rs).
#[repr(C)]
pub struct Cq {
    pub ibv: ibv_cq_ex,
    pub cq: CompletionQueue,
    pub current: Mutex<ibv_wc>,
    /// The QPs that complete into it (`ibv_destroy_cq` answers `EBUSY` while any lives).
    pub users: Users,
}

// `struct ibv_cq` is a prefix of `struct ibv_cq_ex` (rdma-core's design).
const _: () = {
    assert!(std::mem::offset_of!(ibv_cq, context) == std::mem::offset_of!(ibv_cq_ex, context));
    assert!(std::mem::offset_of!(ibv_cq, cqe) == std::mem::offset_of!(ibv_cq_ex, cqe));
    assert!(std::mem::offset_of!(ibv_cq, mutex) == std::mem::offset_of!(ibv_cq_ex, mutex));
    assert!(
        std::mem::offset_of!(ibv_cq, async_events_completed)
            == std::mem::offset_of!(ibv_cq_ex, async_events_completed)
    );
    assert!(std::mem::size_of::<ibv_cq>() <= std::mem::offset_of!(ibv_cq_ex, comp_mask));
};

impl Cq {
    /// # Safety
    /// `cq` must be NULL or a live CQ of this library.
    pub unsafe fn from_ibv<'a>(cq: *mut ibv_cq) -> Option<&'a Cq> {
        // SAFETY: `ibv` is the first member of the `repr(C)` `Cq`.
        unsafe { cq.cast::<Cq>().as_ref() }
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_create_comp_channel(
    ctx: *mut ibv_context,
) -> *mut ibv_comp_channel {
    forward!(ctx ctx, ibv_create_comp_channel(ctx));
    // SAFETY: contexts come from `ibv_open_device`.
    let Some(c) = (unsafe { Context::from_ibv(ctx) }) else {
        errno::set(libc::EINVAL);
        return std::ptr::null_mut();
    };
    let ch = match c.dev.create_comp_channel() {
        Ok(ch) => ch,
        Err(e) => {
            errno::set(errno::fail("ibv_create_comp_channel", &e));
            return std::ptr::null_mut();
        }
    };
    let watch = match Watch::new(&[ch.as_raw_fd()]) {
        Ok(w) => w,
        Err(e) => {
            errno::set(e);
            return std::ptr::null_mut();
        }
    };
    Box::into_raw(Box::new(Channel {
        ibv: ibv_comp_channel {
            context: ctx,
            fd: watch.fd(),
            refcnt: 0,
        },
        ch,
        cqs: Mutex::new(HashMap::new()),
        watch,
    }))
    .cast()
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    forward!(obj ch, ibv_destroy_comp_channel(ch));
    if ch.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: channels come from `ibv_create_comp_channel` (Box).
    let c = unsafe { &*ch.cast::<Channel>() };
    let cqs = lock(&c.cqs);
    // SAFETY: the channel's C struct; `refcnt` changes only under `cqs`' lock, held here.
    if unsafe { std::ptr::addr_of!((*ch).refcnt).read() } != 0 {
        // rdma-core answers EBUSY without touching errno.
        tracing::debug!(target: "softwarp::verbs", call = "ibv_destroy_comp_channel", "CQs still use the channel");
        return libc::EBUSY;
    }
    drop(cqs);
    // SAFETY: as above; no CQ uses it any more.
    drop(unsafe { Box::from_raw(ch.cast::<Channel>()) });
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    forward!(create Cq, ctx ctx, ibv_create_cq(ctx, cqe, cq_context, channel, comp_vector), |o| u64::from((*o).handle));
    // SAFETY: forwarded.
    match unsafe { create("ibv_create_cq", ctx, cqe, cq_context, channel, comp_vector) } {
        Ok(cq) => cq.cast(),
        Err(e) => {
            errno::set(e);
            std::ptr::null_mut()
        }
    }
}

/// A CQ (`ibv_create_cq`, and `ibv_create_cq_ex` before it fills the poll functions).
///
/// # Safety
/// `ctx` must be NULL or a context of this library, `channel` NULL or one of its channels.
pub unsafe fn create(
    call: &'static str,
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> Result<*mut Cq, c_int> {
    // SAFETY: contexts come from `ibv_open_device`.
    let Some(c) = (unsafe { Context::from_ibv(ctx) }) else {
        return Err(libc::EINVAL);
    };
    let Ok(n) = usize::try_from(cqe) else {
        return Err(libc::EINVAL);
    };
    // More entries than the device's `max_cqe` is EINVAL, as the kernel answers for every
    // provider (rdma-core's tests check it), not the ENOMEM of a failed allocation.
    if n == 0
        || n > c.dev.query().max_cqe
        || comp_vector < 0
        || comp_vector >= c.vctx.context.num_comp_vectors
    {
        return Err(libc::EINVAL);
    }
    // SAFETY: channels come from `ibv_create_comp_channel`.
    let ch = unsafe { channel.cast::<Channel>().as_ref() };
    let cq = c
        .dev
        .create_cq(n, ch.as_ref().map(|ch| &ch.ch))
        .map_err(|e| errno::fail(call, &e))?;
    if ch.is_none() && crate::env::busy_poll() {
        cq.set_busy_poll(true);
    }
    if !crate::env::idle_sleep() {
        cq.set_idle_sleep(false);
    }
    let id = cq.id();
    let capacity = c_int::try_from(cq.capacity()).unwrap_or(c_int::MAX);
    // SAFETY: plain C data; all-zero is valid (a zeroed mutex/condition variable is the
    // static initialiser on glibc, the poll functions are None until cq_ex.rs fills them).
    let mut ibv: ibv_cq_ex = unsafe { std::mem::zeroed() };
    ibv.context = ctx;
    ibv.channel = channel;
    ibv.cq_context = cq_context;
    ibv.handle = id.0;
    ibv.cqe = capacity;
    let ptr = Box::into_raw(Box::new(Cq {
        ibv,
        cq,
        current: Mutex::new(to_ibv_wc(&EMPTY_COMPLETION)),
        users: Users::new(),
    }));
    if let Some(ch) = ch {
        let mut cqs = lock(&ch.cqs);
        cqs.insert(id, ptr as usize);
        // SAFETY: the channel's C struct (`channel`, the application's pointer); `refcnt`
        // changes only under `cqs`' lock, held here.
        unsafe {
            let r = std::ptr::addr_of_mut!((*channel).refcnt);
            r.write(r.read().saturating_add(1));
        }
        drop(cqs);
    }
    c.objects().cqs.insert(id, ptr as usize);
    Ok(ptr)
}

/// `ibv_resize_cq`: the CQ holds `cqe` completions from now on (`cq->cqe` says so), those
/// waiting kept in order; `EINVAL` for fewer than are waiting, as rdma-core's providers.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_resize_cq(cq: *mut ibv_cq, cqe: c_int) -> c_int {
    forward!(obj cq, ibv_resize_cq(cq, cqe));
    // SAFETY: CQs come from `ibv_create_cq`.
    let Some(q) = (unsafe { Cq::from_ibv(cq) }) else {
        return libc::EINVAL;
    };
    let Ok(n) = usize::try_from(cqe) else {
        return libc::EINVAL;
    };
    if let Err(e) = q.cq.resize(n) {
        return errno::fail("ibv_resize_cq", &e);
    }
    let capacity = c_int::try_from(q.cq.capacity()).unwrap_or(c_int::MAX);
    // SAFETY: the application's view of the CQ; rdma-core's providers write `cqe` on resize.
    unsafe { (*cq).cqe = capacity };
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    forward!(destroy cq, ibv_destroy_cq);
    // SAFETY: CQs come from `ibv_create_cq`.
    let Some(q) = (unsafe { Cq::from_ibv(cq) }) else {
        return libc::EINVAL;
    };
    if q.users.busy() {
        // The kernel's answer (`ib_destroy_usecnt`): QPs complete into it.
        return errno::busy("ibv_destroy_cq", "QPs whose send or receive CQ it is");
    }
    let id = q.cq.id();
    let channel = q.ibv.channel;
    // SAFETY: channels come from `ibv_create_comp_channel` and outlive their CQs.
    if let Some(ch) = unsafe { channel.cast::<Channel>().as_ref() } {
        let mut cqs = lock(&ch.cqs);
        cqs.remove(&id);
        // SAFETY: as in `create`: `refcnt` changes under `cqs`' lock.
        unsafe {
            let r = std::ptr::addr_of_mut!((*channel).refcnt);
            r.write(r.read().saturating_sub(1));
        }
        drop(cqs);
    }
    // SAFETY: contexts outlive their CQs.
    unsafe {
        context::forget(q.ibv.context, |o| {
            o.cqs.remove(&id);
        })
    };
    // SAFETY: CQs are allocated with Box; the application gives it up.
    drop(unsafe { Box::from_raw(cq.cast::<Cq>()) });
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_get_cq_event(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    forward!(obj channel, ibv_get_cq_event(channel, cq, cq_context));
    if channel.is_null() || cq.is_null() || cq_context.is_null() {
        errno::set(libc::EINVAL);
        return -1;
    }
    // SAFETY: channels come from `ibv_create_comp_channel`.
    let ch = unsafe { &*channel.cast::<Channel>() };
    loop {
        let Some(fired) = ch.ch.try_get_cq_event() else {
            if ch.watch.nonblocking() {
                errno::set(libc::EAGAIN);
                return -1;
            }
            if let Err(e) = ch.watch.wait() {
                errno::set(e);
                return -1;
            }
            continue;
        };
        // A CQ destroyed after it fired is skipped, as the kernel drops its events.
        if let Some(&ptr) = lock(&ch.cqs).get(&fired.id()) {
            let p = ptr as *mut Cq;
            // SAFETY: the map holds live CQs only; the out pointers are writable.
            unsafe {
                *cq = p.cast();
                *cq_context = (*p).ibv.cq_context;
            }
            return 0;
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_ack_cq_events(cq: *mut ibv_cq, nevents: c_uint) {
    forward!(obj cq, ibv_ack_cq_events(cq, nevents));
    // SAFETY: CQs come from `ibv_create_cq`; the counter is the application's to read under
    // its mutex, which rdma-core takes here too.
    unsafe {
        if cq.is_null() {
            return;
        }
        libc::pthread_mutex_lock(std::ptr::addr_of_mut!((*cq).mutex).cast());
        (*cq).comp_events_completed = (*cq).comp_events_completed.wrapping_add(nevents);
        libc::pthread_cond_signal(std::ptr::addr_of_mut!((*cq).cond).cast());
        libc::pthread_mutex_unlock(std::ptr::addr_of_mut!((*cq).mutex).cast());
    }
}

/// `ibv_context_ops.req_notify_cq`.
pub unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: CQs come from `ibv_create_cq`.
    let Some(q) = (unsafe { Cq::from_ibv(cq) }) else {
        return libc::EINVAL;
    };
    match q.cq.req_notify(solicited_only != 0) {
        Ok(()) => 0,
        Err(e) => errno::fail("ibv_req_notify_cq", &e),
    }
}

/// A work completion as rdma-core fills `struct ibv_wc`: every field written once (no
/// zeroed value overwritten field by field).
#[inline]
pub fn to_ibv_wc(w: &WorkCompletion) -> ibv_wc {
    // The discriminants are rdma-core's values (`WcStatus`, `WcOpcode`; the tests
    // `wc_status_and_opcode_casts_are_rdma_core_values` check each).
    let status = w.status as ibv_wc_status;
    let opcode = w.opcode as ibv_wc_opcode;
    // The union holds the immediate value (big-endian, as on the wire) or the invalidated
    // STag, as `wc_flags` says; zero otherwise.
    let (wc_flags, extra) = match (w.imm, w.invalidated_stag) {
        (Some(imm), _) => (IBV_WC_WITH_IMM, imm.to_be()),
        (None, Some(stag)) => (IBV_WC_WITH_INV, stag.0),
        (None, None) => (0, 0),
    };
    ibv_wc {
        wr_id: w.wr_id,
        status,
        opcode,
        // siw reports its own error cause here; ours is in the trace and the QP snapshot.
        vendor_err: u32::from(w.status != WcStatus::Success),
        byte_len: w.byte_len,
        __bindgen_anon_1: ibv_wc__bindgen_ty_1 {
            invalidated_rkey: extra,
        },
        qp_num: w.qp_num,
        src_qp: 0,
        wc_flags,
        pkey_index: 0,
        slid: 0,
        sl: 0,
        dlid_path_bits: 0,
    }
}

/// `ibv_context_ops.poll_cq`: up to `n` completions into `wc`, each written in place as the
/// CQ hands it over (`poll_with`); the number, or -1 on error.
pub unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: CQs come from `ibv_create_cq`.
    let Some(q) = (unsafe { Cq::from_ibv(cq) }) else {
        return -1;
    };
    let Ok(want) = usize::try_from(n) else {
        return -1;
    };
    if want > 0 && wc.is_null() {
        return -1;
    }
    let mut next = wc;
    let polled = q.cq.poll_with(want, |w| {
        // SAFETY: the caller's array has room for `n` entries and the CQ hands over at
        // most `n` completions.
        unsafe {
            next.write(to_ibv_wc(&w));
            next = next.add(1);
        }
    });
    match polled {
        Ok(got) => c_int::try_from(got).unwrap_or(c_int::MAX),
        Err(e) => {
            errno::fail("ibv_poll_cq", &e);
            -1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use softwarp::{Stag, WcOpcode};

    /// `to_ibv_wc` casts the engine's status and opcode: each discriminant must be the
    /// value rdma-core gives the name.
    #[test]
    fn wc_status_and_opcode_casts_are_rdma_core_values() {
        let statuses = [
            (WcStatus::Success, IBV_WC_SUCCESS),
            (WcStatus::LocLenErr, IBV_WC_LOC_LEN_ERR),
            (WcStatus::LocQpOpErr, IBV_WC_LOC_QP_OP_ERR),
            (WcStatus::LocProtErr, IBV_WC_LOC_PROT_ERR),
            (WcStatus::WrFlushErr, IBV_WC_WR_FLUSH_ERR),
            (WcStatus::RemAccessErr, IBV_WC_REM_ACCESS_ERR),
            (WcStatus::RemInvReqErr, IBV_WC_REM_INV_REQ_ERR),
            (WcStatus::RemOpErr, IBV_WC_REM_OP_ERR),
            (WcStatus::FatalErr, IBV_WC_FATAL_ERR),
            (WcStatus::GeneralErr, IBV_WC_GENERAL_ERR),
        ];
        let opcodes = [
            (WcOpcode::Send, IBV_WC_SEND),
            (WcOpcode::RdmaWrite, IBV_WC_RDMA_WRITE),
            (WcOpcode::RdmaRead, IBV_WC_RDMA_READ),
            (WcOpcode::Recv, IBV_WC_RECV),
            (WcOpcode::FetchAdd, IBV_WC_FETCH_ADD),
            (WcOpcode::CmpSwap, IBV_WC_COMP_SWAP),
            (WcOpcode::RecvRdmaWithImm, IBV_WC_RECV_RDMA_WITH_IMM),
        ];
        // Every variant is listed: a new one fails to compile here until it is added.
        for (s, _) in statuses {
            match s {
                WcStatus::Success
                | WcStatus::LocLenErr
                | WcStatus::LocQpOpErr
                | WcStatus::LocProtErr
                | WcStatus::WrFlushErr
                | WcStatus::RemAccessErr
                | WcStatus::RemInvReqErr
                | WcStatus::RemOpErr
                | WcStatus::FatalErr
                | WcStatus::GeneralErr => {}
            }
        }
        for (o, _) in opcodes {
            match o {
                WcOpcode::Send
                | WcOpcode::RdmaWrite
                | WcOpcode::RdmaRead
                | WcOpcode::Recv
                | WcOpcode::FetchAdd
                | WcOpcode::CmpSwap
                | WcOpcode::RecvRdmaWithImm => {}
            }
        }
        let base = WorkCompletion {
            wr_id: 0x0123_4567_89ab_cdef,
            status: WcStatus::Success,
            opcode: WcOpcode::Send,
            byte_len: 77,
            qp_num: 9,
            invalidated_stag: None,
            solicited: false,
            imm: None,
        };
        for (status, want) in statuses {
            let wc = to_ibv_wc(&WorkCompletion { status, ..base });
            assert_eq!(wc.status, want, "{status:?}");
            assert_eq!(wc.vendor_err, u32::from(status != WcStatus::Success));
        }
        for (opcode, want) in opcodes {
            assert_eq!(to_ibv_wc(&WorkCompletion { opcode, ..base }).opcode, want);
        }
        // The other fields, and the union as `wc_flags` says.
        let wc = to_ibv_wc(&base);
        assert_eq!(
            (wc.wr_id, wc.byte_len, wc.qp_num, wc.wc_flags, wc.src_qp),
            (base.wr_id, 77, 9, 0, 0)
        );
        let imm = to_ibv_wc(&WorkCompletion {
            imm: Some(0x0102_0304),
            ..base
        });
        assert_eq!(imm.wc_flags, IBV_WC_WITH_IMM);
        // SAFETY: both fields of the union (`imm_data`, `invalidated_rkey`) are `u32`s over
        // the same four bytes, which `to_ibv_wc` wrote: reading either reads an initialized
        // integer.
        let imm_data = unsafe { imm.__bindgen_anon_1.imm_data };
        assert_eq!(imm_data, 0x0102_0304u32.to_be());

        let inv = to_ibv_wc(&WorkCompletion {
            invalidated_stag: Some(Stag(0x4242)),
            ..base
        });
        assert_eq!(inv.wc_flags, IBV_WC_WITH_INV);
        // SAFETY: plain integers.
        assert_eq!(unsafe { inv.__bindgen_anon_1.invalidated_rkey }, 0x4242);
    }
}
