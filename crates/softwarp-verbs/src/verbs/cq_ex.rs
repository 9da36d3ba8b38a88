//! Extended CQs: `ibv_create_cq_ex` (`verbs_context.create_cq_ex`, behind the inline function
//! of `verbs.h`) and the `ibv_cq_ex` poll functions (`ibv_start_poll`, `ibv_next_poll`,
//! `ibv_end_poll`, `ibv_wc_read_*`). The CQ is the same object as `ibv_create_cq`'s
//! ([`Cq`]); `ibv_start_poll`/`ibv_next_poll` take one completion and keep it, converted as
//! `ibv_poll_cq` would return it, for the `read_*` functions.
//!
//! Fields an iWARP completion has are readable (`IBV_WC_EX_WITH_BYTE_LEN`, `_IMM`,
//! `_QP_NUM`, and the InfiniBand addressing fields `_SRC_QP`, `_SLID`, `_SL`,
//! `_DLID_PATH_BITS`, which read 0 as in `ibv_poll_cq`'s `ibv_wc`); timestamps, CVLAN, flow
//! tags, tag matching and parent domains fail with `EOPNOTSUPP`.

use std::ffi::{c_int, c_uint};

use softwarp::EMPTY_COMPLETION;

use crate::errno;
use crate::ffi::*;
use crate::verbs::cq::{self, to_ibv_wc, Cq};
use softwarp::sync::lock;

/// The `wc_flags` of `ibv_cq_init_attr_ex` this CQ can answer.
const SUPPORTED_WC: u64 = (IBV_WC_EX_WITH_BYTE_LEN
    | IBV_WC_EX_WITH_IMM
    | IBV_WC_EX_WITH_QP_NUM
    | IBV_WC_EX_WITH_SRC_QP
    | IBV_WC_EX_WITH_SLID
    | IBV_WC_EX_WITH_SL
    | IBV_WC_EX_WITH_DLID_PATH_BITS) as u64;

/// `verbs_context.create_cq_ex`.
pub unsafe extern "C" fn create_cq_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    const CALL: &str = "ibv_create_cq_ex";
    let fail = |e: c_int| {
        errno::set(e);
        std::ptr::null_mut()
    };
    // SAFETY: the caller's attributes.
    let Some(a) = (unsafe { attr.as_ref() }) else {
        return fail(libc::EINVAL);
    };
    if a.wc_flags & !SUPPORTED_WC != 0 {
        return fail(errno::unsupported(
            CALL,
            "completion timestamps, CVLAN, flow tags and tag matching",
        ));
    }
    if a.comp_mask & IBV_CQ_INIT_ATTR_MASK_PD != 0 {
        return fail(errno::unsupported(CALL, "parent domains"));
    }
    if a.comp_mask & !(IBV_CQ_INIT_ATTR_MASK_FLAGS | IBV_CQ_INIT_ATTR_MASK_PD) != 0 {
        return fail(libc::EINVAL);
    }
    if a.comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS != 0 {
        if a.flags & !(IBV_CREATE_CQ_ATTR_SINGLE_THREADED | IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN) != 0
        {
            return fail(libc::EINVAL);
        }
        if a.flags & IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN != 0 {
            return fail(errno::unsupported(
                CALL,
                "IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN (an overrun CQ reports the error)",
            ));
        }
    }
    let (Ok(cqe), Ok(vector)) = (c_int::try_from(a.cqe), c_int::try_from(a.comp_vector)) else {
        return fail(libc::EINVAL);
    };
    // SAFETY: the context and channel are the application's, from this library.
    let q = match unsafe { cq::create(CALL, ctx, cqe, a.cq_context, a.channel, vector) } {
        Ok(q) => q,
        Err(e) => return fail(e),
    };
    // SAFETY: just made, not yet seen by the application.
    let ex = unsafe { &mut (*q).ibv };
    ex.start_poll = Some(start_poll);
    ex.next_poll = Some(next_poll);
    ex.end_poll = Some(end_poll);
    ex.read_opcode = Some(read_opcode);
    ex.read_vendor_err = Some(read_vendor_err);
    ex.read_byte_len = Some(read_byte_len);
    ex.read_imm_data = Some(read_imm_data);
    ex.read_qp_num = Some(read_qp_num);
    ex.read_src_qp = Some(read_src_qp);
    ex.read_wc_flags = Some(read_wc_flags);
    ex.read_slid = Some(read_slid);
    ex.read_sl = Some(read_sl);
    ex.read_dlid_path_bits = Some(read_dlid_path_bits);
    ex
}

/// The CQ behind `cq`.
///
/// # Safety
/// `cq` must be a live CQ of this library.
unsafe fn of<'a>(cq: *mut ibv_cq_ex) -> &'a Cq {
    // SAFETY: `ibv` is the first member of the `repr(C)` `Cq`.
    unsafe { &*cq.cast::<Cq>() }
}

/// Takes the next completion into `current`: 0, `ENOENT` when there is none, or the error.
fn advance(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: the application's CQ, from `ibv_create_cq_ex`.
    let q = unsafe { of(cq) };
    let mut one = [EMPTY_COMPLETION];
    match q.cq.poll(&mut one) {
        Ok(0) => libc::ENOENT,
        Ok(_) => {
            let wc = to_ibv_wc(&one[0]);
            // SAFETY: the public status and wr_id members, written as providers do; the
            // application reads them only between its poll calls.
            unsafe {
                (*cq).status = wc.status;
                (*cq).wr_id = wc.wr_id;
            }
            *lock(&q.current) = wc;
            0
        }
        Err(e) => errno::fail("ibv_start_poll", &e),
    }
}

unsafe extern "C" fn start_poll(cq: *mut ibv_cq_ex, attr: *mut ibv_poll_cq_attr) -> c_int {
    // SAFETY: the caller's attributes (rdma-core requires them).
    if unsafe { attr.as_ref() }.is_some_and(|a| a.comp_mask != 0) {
        return libc::EINVAL;
    }
    advance(cq)
}

unsafe extern "C" fn next_poll(cq: *mut ibv_cq_ex) -> c_int {
    advance(cq)
}

unsafe extern "C" fn end_poll(_cq: *mut ibv_cq_ex) {}

/// The current completion.
fn current(cq: *mut ibv_cq_ex) -> ibv_wc {
    // SAFETY: the application's CQ, from `ibv_create_cq_ex`.
    *lock(&unsafe { of(cq) }.current)
}

unsafe extern "C" fn read_opcode(cq: *mut ibv_cq_ex) -> ibv_wc_opcode {
    current(cq).opcode
}

unsafe extern "C" fn read_vendor_err(cq: *mut ibv_cq_ex) -> u32 {
    current(cq).vendor_err
}

unsafe extern "C" fn read_byte_len(cq: *mut ibv_cq_ex) -> u32 {
    current(cq).byte_len
}

unsafe extern "C" fn read_imm_data(cq: *mut ibv_cq_ex) -> __be32 {
    // SAFETY: both members of the union are a 32-bit integer.
    unsafe { current(cq).__bindgen_anon_1.imm_data }
}

unsafe extern "C" fn read_qp_num(cq: *mut ibv_cq_ex) -> u32 {
    current(cq).qp_num
}

unsafe extern "C" fn read_src_qp(cq: *mut ibv_cq_ex) -> u32 {
    current(cq).src_qp
}

unsafe extern "C" fn read_wc_flags(cq: *mut ibv_cq_ex) -> c_uint {
    current(cq).wc_flags
}

unsafe extern "C" fn read_slid(cq: *mut ibv_cq_ex) -> u32 {
    u32::from(current(cq).slid)
}

unsafe extern "C" fn read_sl(cq: *mut ibv_cq_ex) -> u8 {
    current(cq).sl
}

unsafe extern "C" fn read_dlid_path_bits(cq: *mut ibv_cq_ex) -> u8 {
    current(cq).dlid_path_bits
}
