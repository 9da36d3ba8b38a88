//! The extended QP API of `verbs.h` (`ibv_wr_start`, `ibv_wr_send`, `ibv_wr_rdma_write`, ...,
//! `ibv_wr_set_sge`, `ibv_wr_set_inline_data`, `ibv_wr_complete`/`ibv_wr_abort`): inline
//! functions that call through the function pointers of `struct ibv_qp_ex`, filled here.
//!
//! Work requests are collected between `ibv_wr_start` and `ibv_wr_complete` (inline data
//! copied at once, as the API requires) and posted together; the buffers are kept with the
//! QP and reused, so building costs no allocation once they have grown.

use std::ffi::{c_int, c_void};
use std::ops::Range;

use softwarp::{Payload, SendOp, SendWr, SgList, Sge, Stag, MAX_INLINE};

use crate::errno;
use crate::ffi::*;
use crate::verbs::qp::Qp;

#[derive(Default)]
pub struct WrBuilder {
    wrs: Vec<Pending>,
    inline: Vec<u8>,
    /// The first error of the batch (an unsupported operation, a bad SGL), reported by
    /// `ibv_wr_complete`.
    error: Option<c_int>,
}

struct Pending {
    wr_id: u64,
    flags: u32,
    op: SendOp,
    data: Data,
}

enum Data {
    Sgl(SgList),
    Inline(Range<usize>),
}

/// Fills the `ibv_wr_*` operations of a new QP.
pub fn fill_ops(ex: &mut ibv_qp_ex) {
    ex.comp_mask = 0;
    ex.wr_start = Some(wr_start);
    ex.wr_complete = Some(wr_complete);
    ex.wr_abort = Some(wr_abort);
    ex.wr_send = Some(wr_send);
    ex.wr_send_imm = Some(wr_send_imm);
    ex.wr_send_inv = Some(wr_send_inv);
    ex.wr_rdma_write = Some(wr_rdma_write);
    ex.wr_rdma_write_imm = Some(wr_rdma_write_imm);
    ex.wr_rdma_read = Some(wr_rdma_read);
    ex.wr_atomic_cmp_swp = Some(wr_atomic_cmp_swp);
    ex.wr_atomic_fetch_add = Some(wr_atomic_fetch_add);
    ex.wr_set_sge = Some(wr_set_sge);
    ex.wr_set_sge_list = Some(wr_set_sge_list);
    ex.wr_set_inline_data = Some(wr_set_inline_data);
    ex.wr_set_inline_data_list = Some(wr_set_inline_data_list);
    ex.wr_bind_mw = Some(wr_bind_mw);
    ex.wr_local_inv = Some(wr_local_inv);
    ex.wr_send_tso = Some(wr_send_tso);
    ex.wr_set_ud_addr = Some(wr_set_ud_addr);
    ex.wr_set_xrc_srqn = Some(wr_set_xrc_srqn);
    ex.wr_atomic_write = Some(wr_atomic_write);
}

/// Runs `f` on the QP's builder with the QP's current `wr_id` and `wr_flags`.
///
/// # Safety
/// `qp` must be a live QP of this library.
unsafe fn with(qp: *mut ibv_qp_ex, f: impl FnOnce(&Qp, &mut WrBuilder, u64, u32)) {
    // SAFETY: the caller's QP (`ibv_qp_ex` is the first member of `Qp`).
    let Some(q) = (unsafe { Qp::from_ibv(qp.cast()) }) else {
        return;
    };
    // SAFETY: `wr_id` and `wr_flags` are set by the application before each `ibv_wr_*`
    // call, from the thread that builds the batch.
    let (wr_id, flags) = unsafe { ((*qp).wr_id, (*qp).wr_flags) };
    let mut b = softwarp::sync::lock(&q.builder);
    f(q, &mut b, wr_id, flags);
}

/// Starts a new work request of the batch.
///
/// # Safety
/// As [`with`].
unsafe fn push(qp: *mut ibv_qp_ex, op: SendOp) {
    // SAFETY: forwarded.
    unsafe {
        with(qp, |_, b, wr_id, flags| {
            b.wrs.push(Pending {
                wr_id,
                flags,
                op,
                data: Data::Sgl(SgList::new()),
            })
        })
    }
}

/// Records an error for `ibv_wr_complete` to return.
///
/// # Safety
/// As [`with`].
unsafe fn fail(qp: *mut ibv_qp_ex, rc: c_int) {
    // SAFETY: forwarded.
    unsafe {
        with(qp, |_, b, _, _| {
            b.error.get_or_insert(rc);
        })
    }
}

unsafe extern "C" fn wr_start(qp: *mut ibv_qp_ex) {
    // SAFETY: the application's QP.
    unsafe {
        with(qp, |_, b, _, _| {
            b.wrs.clear();
            b.inline.clear();
            b.error = None;
        })
    }
}

unsafe extern "C" fn wr_abort(qp: *mut ibv_qp_ex) {
    // SAFETY: as `wr_start`.
    unsafe { wr_start(qp) }
}

unsafe extern "C" fn wr_complete(qp: *mut ibv_qp_ex) -> c_int {
    let mut rc = 0;
    // SAFETY: the application's QP.
    unsafe {
        with(qp, |q, b, _, _| {
            if let Some(e) = b.error.take() {
                rc = e;
            } else if !b.wrs.is_empty() {
                // One post for the batch: queued whole, then sent (as `ibv_post_send`
                // posts a chained list).
                let inline = &b.inline;
                let wrs = b.wrs.iter().map(|p| SendWr {
                    wr_id: p.wr_id,
                    op: p.op,
                    payload: match &p.data {
                        Data::Sgl(l) => Payload::Sgl(*l),
                        Data::Inline(r) => Payload::Inline(&inline[r.clone()]),
                    },
                    signaled: p.flags & IBV_SEND_SIGNALED != 0,
                    fence: p.flags & IBV_SEND_FENCE != 0,
                });
                if let Err((_, e)) = q.qp.post_send_iter(wrs) {
                    rc = errno::fail("ibv_wr_complete", &e);
                }
            }
            b.wrs.clear();
            b.inline.clear();
        })
    };
    rc
}

fn solicited(flags: u32) -> bool {
    flags & IBV_SEND_SOLICITED != 0
}

unsafe extern "C" fn wr_send(qp: *mut ibv_qp_ex) {
    // SAFETY: the application's QP; `wr_flags` read under the builder.
    let flags = unsafe { (*qp).wr_flags };
    // SAFETY: as above.
    unsafe {
        push(
            qp,
            SendOp::Send {
                solicited: solicited(flags),
                invalidate: None,
            },
        )
    }
}

unsafe extern "C" fn wr_send_imm(qp: *mut ibv_qp_ex, imm: __be32) {
    // SAFETY: the application's QP.
    let flags = unsafe { (*qp).wr_flags };
    // SAFETY: as above.
    unsafe {
        push(
            qp,
            SendOp::SendWithImm {
                solicited: solicited(flags),
                imm: u32::from_be(imm),
            },
        )
    }
}

unsafe extern "C" fn wr_send_inv(qp: *mut ibv_qp_ex, rkey: u32) {
    // SAFETY: the application's QP.
    let flags = unsafe { (*qp).wr_flags };
    // SAFETY: as above.
    unsafe {
        push(
            qp,
            SendOp::Send {
                solicited: solicited(flags),
                invalidate: Some(Stag(rkey)),
            },
        )
    }
}

unsafe extern "C" fn wr_rdma_write(qp: *mut ibv_qp_ex, rkey: u32, remote_addr: u64) {
    // SAFETY: the application's QP.
    unsafe {
        push(
            qp,
            SendOp::Write {
                remote_addr,
                rkey: Stag(rkey),
            },
        )
    }
}

unsafe extern "C" fn wr_rdma_write_imm(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    imm: __be32,
) {
    // SAFETY: the application's QP.
    unsafe {
        push(
            qp,
            SendOp::WriteWithImm {
                remote_addr,
                rkey: Stag(rkey),
                imm: u32::from_be(imm),
            },
        )
    }
}

unsafe extern "C" fn wr_rdma_read(qp: *mut ibv_qp_ex, rkey: u32, remote_addr: u64) {
    // SAFETY: the application's QP.
    unsafe {
        push(
            qp,
            SendOp::Read {
                remote_addr,
                rkey: Stag(rkey),
            },
        )
    }
}

unsafe extern "C" fn wr_atomic_cmp_swp(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    compare: u64,
    swap: u64,
) {
    // SAFETY: the application's QP.
    unsafe {
        push(
            qp,
            SendOp::CmpSwap {
                remote_addr,
                rkey: Stag(rkey),
                compare,
                swap,
            },
        )
    }
}

unsafe extern "C" fn wr_atomic_fetch_add(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    add: u64,
) {
    // SAFETY: the application's QP.
    unsafe {
        push(
            qp,
            SendOp::FetchAdd {
                remote_addr,
                rkey: Stag(rkey),
                add,
            },
        )
    }
}

unsafe extern "C" fn wr_set_sge(qp: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    // SAFETY: the application's QP.
    unsafe {
        with(qp, |_, b, _, _| match b.wrs.last_mut() {
            Some(p) => {
                p.data = Data::Sgl(SgList::single(Sge {
                    addr,
                    length,
                    lkey: Stag(lkey),
                }))
            }
            None => {
                b.error.get_or_insert(libc::EINVAL);
            }
        })
    }
}

unsafe extern "C" fn wr_set_sge_list(qp: *mut ibv_qp_ex, n: usize, list: *const ibv_sge) {
    let n = c_int::try_from(n).unwrap_or(c_int::MAX);
    // SAFETY: the application's array of `n` SGEs.
    let sgl = unsafe { crate::verbs::qp::sgl(list, n) };
    // SAFETY: the application's QP.
    unsafe {
        with(qp, |_, b, _, _| match (b.wrs.last_mut(), sgl) {
            (Some(p), Ok(l)) => p.data = Data::Sgl(l),
            (_, Err(e)) => {
                b.error.get_or_insert(e);
            }
            (None, _) => {
                b.error.get_or_insert(libc::EINVAL);
            }
        })
    }
}

/// Appends inline bytes to the last work request of the batch.
///
/// # Safety
/// `bufs` are readable (address, length) pairs of the application.
unsafe fn set_inline(qp: *mut ibv_qp_ex, bufs: &[(*const u8, usize)]) {
    // SAFETY: the application's QP.
    unsafe {
        with(qp, |_, b, _, _| {
            let start = b.inline.len();
            let total: usize = bufs.iter().map(|&(_, l)| l).fold(0, usize::saturating_add);
            if total > MAX_INLINE || b.wrs.is_empty() {
                b.error.get_or_insert(libc::EINVAL);
                return;
            }
            for &(p, l) in bufs {
                if l > 0 {
                    // SAFETY: the application's inline buffer of `l` bytes.
                    b.inline.extend_from_slice(std::slice::from_raw_parts(p, l));
                }
            }
            let end = b.inline.len();
            if let Some(p) = b.wrs.last_mut() {
                p.data = Data::Inline(start..end);
            }
        })
    }
}

unsafe extern "C" fn wr_set_inline_data(qp: *mut ibv_qp_ex, addr: *mut c_void, length: usize) {
    // SAFETY: the application's buffer.
    unsafe { set_inline(qp, &[(addr.cast_const().cast(), length)]) }
}

unsafe extern "C" fn wr_set_inline_data_list(
    qp: *mut ibv_qp_ex,
    n: usize,
    list: *const ibv_data_buf,
) {
    if n > softwarp::MAX_SGE || (n > 0 && list.is_null()) {
        // SAFETY: the application's QP.
        unsafe { fail(qp, libc::EINVAL) };
        return;
    }
    let mut bufs = [(std::ptr::null::<u8>(), 0usize); softwarp::MAX_SGE];
    for (i, slot) in bufs.iter_mut().enumerate().take(n) {
        // SAFETY: the application's array of `n` buffers.
        let d = unsafe { &*list.add(i) };
        *slot = (d.addr.cast_const().cast(), d.length);
    }
    // SAFETY: the application's buffers.
    unsafe { set_inline(qp, &bufs[..n]) }
}

unsafe extern "C" fn wr_bind_mw(
    qp: *mut ibv_qp_ex,
    _mw: *mut ibv_mw,
    _rkey: u32,
    _info: *const ibv_mw_bind_info,
) {
    // SAFETY: the application's QP.
    unsafe { fail(qp, errno::unsupported("ibv_wr_bind_mw", "memory windows")) }
}

unsafe extern "C" fn wr_local_inv(qp: *mut ibv_qp_ex, _rkey: u32) {
    // SAFETY: the application's QP.
    unsafe {
        fail(
            qp,
            errno::unsupported("ibv_wr_local_inv", "local invalidate"),
        )
    }
}

unsafe extern "C" fn wr_send_tso(qp: *mut ibv_qp_ex, _hdr: *mut c_void, _hdr_sz: u16, _mss: u16) {
    // SAFETY: the application's QP.
    unsafe {
        fail(
            qp,
            errno::unsupported("ibv_wr_send_tso", "TSO (UD/raw packet QPs)"),
        )
    }
}

unsafe extern "C" fn wr_set_ud_addr(qp: *mut ibv_qp_ex, _ah: *mut ibv_ah, _qpn: u32, _qkey: u32) {
    // SAFETY: the application's QP.
    unsafe {
        fail(
            qp,
            errno::unsupported("ibv_wr_set_ud_addr", "UD addressing"),
        )
    }
}

unsafe extern "C" fn wr_set_xrc_srqn(qp: *mut ibv_qp_ex, _srqn: u32) {
    // SAFETY: the application's QP.
    unsafe { fail(qp, errno::unsupported("ibv_wr_set_xrc_srqn", "XRC")) }
}

unsafe extern "C" fn wr_atomic_write(
    qp: *mut ibv_qp_ex,
    _rkey: u32,
    _addr: u64,
    _wr: *const c_void,
) {
    // SAFETY: the application's QP.
    unsafe {
        fail(
            qp,
            errno::unsupported("ibv_wr_atomic_write", "atomic write"),
        )
    }
}
