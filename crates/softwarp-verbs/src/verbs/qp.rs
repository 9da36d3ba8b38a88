//! Queue pairs (create, modify with iWARP's state rules, query, destroy), shared receive
//! queues, and the `ibv_context_ops` fast path `post_send`/`post_recv`/`post_srq_recv`.
//!
//! iWARP QPs reach RTS only through the connection manager (`rdma_connect`/`rdma_accept`):
//! a QP that is not connected is Softwarp's Idle state, which `ibv_modify_qp` may walk
//! through RESET, INIT and RTR (remembered, as the kernel's iWARP drivers do); ERROR and back
//! to RESET work in any state; RTS without a connection, SQD and SQE are refused.

use std::cell::UnsafeCell;
use std::ffi::c_int;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU32, AtomicU8, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use softwarp::{
    Payload, PayloadRef, QpCap, QpInitAttr, QpState, QueuePair, RecvWr, RecvWrRef, SendOp, SendWr,
    SendWrRef, SgList, Sge, SharedReceiveQueue, SrqInitAttr, Stag, MAX_INLINE, MAX_SGE,
};

use crate::errno;
use crate::ffi::*;
use crate::host::forward;
use crate::verbs::context::{self, Context};
use crate::verbs::cq::Cq;
use crate::verbs::mr::Pd;
use crate::verbs::qp_ex::{self, WrBuilder};
use crate::verbs::users::Users;

/// `struct ibv_qp_ex` (whose first member is the `ibv_qp` applications see) followed by
/// Softwarp's QP.
#[repr(C)]
pub struct Qp {
    /// The application's `struct ibv_qp_ex` (in an `UnsafeCell`, which keeps its layout):
    /// this library stores `state` into it while holding `&Qp` ([`Qp::sync_state`]), and the
    /// application may set `qp_context`; the cell is what makes such stores defined (see
    /// `Id`'s C struct for what went wrong without one). Read with [`Qp::base`].
    ex: UnsafeCell<ibv_qp_ex>,
    pub qp: QueuePair,
    /// The state `ibv_modify_qp` set while the QP is not connected (RESET, INIT or RTR).
    pub idle_state: AtomicU32,
    pub cap: ibv_qp_cap,
    pub sq_sig_all: bool,
    /// Work requests built with the `ibv_wr_*` API, posted by `ibv_wr_complete`.
    pub builder: Mutex<WrBuilder>,
    /// The rdma_cm id whose `id->qp` it is (`rdma_create_qp`), 0 for none: its destroy by
    /// `ibv_destroy_qp` clears that field, so later rdma_cm calls on the id see no QP
    /// (`EINVAL`) instead of reading the freed one.
    pub cm_id: AtomicUsize,
    /// The `min_rnr_timer` and `rnr_retry` `ibv_modify_qp` set ([`RNR_UNSET`]: never),
    /// from which the QP's RNR wait is made ([`rnr_wait_of`]).
    pub rnr_timer: AtomicU8,
    pub rnr_retry: AtomicU8,
}

/// [`Qp::rnr_timer`] and [`Qp::rnr_retry`] before `ibv_modify_qp` set them.
pub const RNR_UNSET: u8 = u8::MAX;

/// InfiniBand's RNR NAK timer field (`min_rnr_timer`, 5 bits) in microseconds, by code
/// (IBTA spec table 45; code 0 is the longest, 655.36 ms).
const RNR_TIMER_US: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840,
    5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
    245_760, 327_680, 491_520,
];

/// The RNR wait (`QueuePair::set_rnr_wait`) for the `min_rnr_timer` (`timer`) and
/// `rnr_retry` (`retry`) an application gave `ibv_modify_qp`, `None` for one it never
/// set; `default` is the process's (`SOFTWARP_RNR_WAIT_MS`). On InfiniBand a Send that
/// finds no receive is NAKed and retried `rnr_retry` times, each after the responder's
/// `min_rnr_timer`; 7 retries for ever. iWARP has no NAK: the receiver itself holds the
/// Send, so this QP's own two values stand for the whole exchange (programs set both
/// ends alike):
///
/// - `rnr_retry` 0: no wait, the Send fails at once (as InfiniBand reports the RNR error
///   at the first NAK);
/// - `rnr_retry` 1 to 6: `rnr_retry` times the `min_rnr_timer` delay (code 0, 655.36 ms,
///   when it was never set, as on InfiniBand): at most 3.93 s;
/// - `rnr_retry` 7 ("infinite") or never set: the process's default, which is bounded
///   (10 s unless `SOFTWARP_RNR_WAIT_MS` says otherwise): never for ever.
///
/// `min_rnr_timer` alone changes nothing: it only scales finite retries.
pub fn rnr_wait_of(
    timer: Option<u8>,
    retry: Option<u8>,
    default: Option<Duration>,
) -> Option<Duration> {
    match retry {
        Some(0) => None,
        Some(r @ 1..=6) => {
            let code = usize::from(timer.unwrap_or(0) & 0x1f);
            let us = RNR_TIMER_US.get(code).copied().unwrap_or(655_360);
            Some(Duration::from_micros(u64::from(us) * u64::from(r)))
        }
        _ => default,
    }
}

impl Qp {
    /// Sets the QP's `min_rnr_timer` and `rnr_retry` (each when given: `ibv_modify_qp`'s,
    /// and `rdma_connect`'s and `rdma_accept`'s `rnr_retry_count`) and its RNR wait from
    /// what it has of them ([`rnr_wait_of`]).
    pub fn set_rnr(&self, timer: Option<u8>, retry: Option<u8>) -> softwarp::Result<()> {
        if let Some(t) = timer {
            self.rnr_timer.store(t & 0x1f, Ordering::Relaxed);
        }
        if let Some(r) = retry {
            self.rnr_retry.store(r.min(7), Ordering::Relaxed);
        }
        let set = |v: &AtomicU8| Some(v.load(Ordering::Relaxed)).filter(|&v| v != RNR_UNSET);
        let wait = rnr_wait_of(
            set(&self.rnr_timer),
            set(&self.rnr_retry),
            crate::env::options().rnr_wait,
        );
        self.qp.set_rnr_wait(wait)
    }

    /// # Safety
    /// `qp` must be NULL or a live QP of this library.
    pub unsafe fn from_ibv<'a>(qp: *mut ibv_qp) -> Option<&'a Qp> {
        // SAFETY: `ex.qp_base` is the first member of the `repr(C)` `Qp`.
        unsafe { qp.cast::<Qp>().as_ref() }
    }

    /// A value read out of the application's `struct ibv_qp` by `f` (a field, copied).
    pub fn base<T>(&self, f: impl FnOnce(&ibv_qp) -> T) -> T {
        // SAFETY: the QP is live (`&self`); the reference lasts for `f` only, which copies a
        // field out, and nothing stores to the struct meanwhile: this library stores `state`
        // from its own calls (not from `f`), the application its fields between calls.
        f(unsafe { &(*self.ex.get()).qp_base })
    }

    /// The state as libibverbs names it.
    pub fn ibv_state(&self) -> ibv_qp_state {
        match self.qp.state() {
            QpState::Idle => self.idle_state.load(Ordering::Relaxed),
            QpState::Rts => IBV_QPS_RTS,
            QpState::Closing => IBV_QPS_SQD,
            QpState::Terminate => IBV_QPS_SQE,
            _ => IBV_QPS_ERR,
        }
    }

    pub fn sync_state(&self) -> ibv_qp_state {
        let s = self.ibv_state();
        // SAFETY: the QP's C struct (a place expression: no reference is made).
        let base = unsafe { std::ptr::addr_of_mut!((*self.ex.get()).qp_base.state) };
        // SAFETY: the `state` field is the application's to read; we store it as
        // rdma-core does after every state change (a plain int store).
        unsafe { base.write(s) };
        s
    }
}

/// `struct ibv_srq` followed by Softwarp's SRQ.
#[repr(C)]
pub struct Srq {
    pub ibv: ibv_srq,
    pub srq: SharedReceiveQueue,
    pub max_wr: u32,
    pub max_sge: u32,
    pub limit: AtomicU32,
    /// The QPs that receive from it (`ibv_destroy_srq` answers `EBUSY` while any lives).
    pub users: Users,
}

impl Srq {
    /// # Safety
    /// `srq` must be NULL or a live SRQ of this library.
    pub unsafe fn from_ibv<'a>(srq: *mut ibv_srq) -> Option<&'a Srq> {
        // SAFETY: `ibv` is the first member of the `repr(C)` `Srq`.
        unsafe { srq.cast::<Srq>().as_ref() }
    }
}

/// Runs `f` on the use count of each object a QP uses (its PD, send CQ, receive CQ and SRQ,
/// as its C struct names them; a CQ that is both is counted twice): each counts the QP from
/// the QP's creation until its destroy.
///
/// # Safety
/// Each pointer must be NULL or a live object of this library (a QP's objects are: their
/// counts keep them).
unsafe fn for_each_use(
    (pd, send_cq, recv_cq, srq): (*mut ibv_pd, *mut ibv_cq, *mut ibv_cq, *mut ibv_srq),
    f: impl Fn(&Users),
) {
    // SAFETY: the caller's live objects.
    unsafe {
        if let Some(p) = Pd::from_ibv(pd) {
            f(&p.users);
        }
        for cq in [send_cq, recv_cq] {
            if let Some(c) = Cq::from_ibv(cq) {
                f(&c.users);
            }
        }
        if let Some(s) = Srq::from_ibv(srq) {
            f(&s.users);
        }
    }
}

/// Creates a QP from the extended attributes (`verbs_context.create_qp_ex`, also behind
/// `ibv_create_qp`).
pub unsafe extern "C" fn create_qp_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    // SAFETY: contexts come from `ibv_open_device`; `attr` is the caller's.
    let (Some(_c), Some(a)) = (unsafe { Context::from_ibv(ctx) }, unsafe { attr.as_mut() }) else {
        errno::set(libc::EINVAL);
        return std::ptr::null_mut();
    };
    match create(ctx, a) {
        Ok(qp) => qp,
        Err(e) => {
            errno::set(e);
            std::ptr::null_mut()
        }
    }
}

fn create(ctx: *mut ibv_context, a: &mut ibv_qp_init_attr_ex) -> Result<*mut ibv_qp, c_int> {
    const CALL: &str = "ibv_create_qp";
    if a.qp_type != IBV_QPT_RC {
        return Err(errno::unsupported(
            CALL,
            "QP types other than RC (iWARP is reliable connected)",
        ));
    }
    // CREATE_FLAGS with no flag set asks for nothing (rdma-core's tests pass it so).
    let known = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    let asked = if a.create_flags == 0 {
        a.comp_mask & !IBV_QP_INIT_ATTR_CREATE_FLAGS
    } else {
        a.comp_mask
    };
    if asked & !known != 0 {
        return Err(errno::unsupported(
            CALL,
            "comp_mask bits other than PD and SEND_OPS_FLAGS, or creation flags",
        ));
    }
    if a.comp_mask & IBV_QP_INIT_ATTR_PD == 0 || a.pd.is_null() {
        return Err(errno::invalid(CALL, "no protection domain"));
    }
    // SAFETY: PDs, CQs and SRQs come from this library.
    let (pd, scq, rcq) = unsafe {
        (
            Pd::from_ibv(a.pd),
            Cq::from_ibv(a.send_cq),
            Cq::from_ibv(a.recv_cq),
        )
    };
    let (Some(pd), Some(scq), Some(rcq)) = (pd, scq, rcq) else {
        return Err(errno::invalid(CALL, "missing CQ"));
    };
    // SAFETY: as above.
    let srq = unsafe { Srq::from_ibv(a.srq) };
    let mut init = QpInitAttr::new(&scq.cq, &rcq.cq);
    init.srq = srq.map(|s| &s.srq);
    let cap = a.cap;
    let want = |v: u32, default: usize| if v == 0 { default } else { v as usize };
    let d = QpCap::default();
    init.cap = QpCap {
        max_send_wr: want(cap.max_send_wr, 1),
        max_recv_wr: want(cap.max_recv_wr, 1),
        max_send_sge: want(cap.max_send_sge, 1),
        max_recv_sge: want(cap.max_recv_sge, 1),
        max_inline_data: d.max_inline_data,
    };
    if cap.max_inline_data as usize > MAX_INLINE
        || cap.max_send_sge as usize > MAX_SGE
        || cap.max_recv_sge as usize > MAX_SGE
    {
        return Err(errno::invalid(CALL, "capacity beyond the device's limits"));
    }
    init.sq_sig_all = a.sq_sig_all != 0;
    let qp = pd.pd.create_qp(&init).map_err(|e| errno::fail(CALL, &e))?;
    let granted = ibv_qp_cap {
        max_send_wr: u32::try_from(init.cap.max_send_wr).unwrap_or(u32::MAX),
        max_recv_wr: if srq.is_some() {
            0
        } else {
            u32::try_from(init.cap.max_recv_wr).unwrap_or(u32::MAX)
        },
        max_send_sge: MAX_SGE as u32,
        max_recv_sge: MAX_SGE as u32,
        max_inline_data: MAX_INLINE as u32,
    };
    a.cap = granted;
    // SAFETY: plain C data; all-zero is valid (zeroed mutex and condition variable are the
    // static initialisers on glibc).
    let mut ex: ibv_qp_ex = unsafe { std::mem::zeroed() };
    let b = &mut ex.qp_base;
    b.context = ctx;
    b.qp_context = a.qp_context;
    b.pd = a.pd;
    b.send_cq = a.send_cq;
    b.recv_cq = a.recv_cq;
    b.srq = a.srq;
    b.handle = qp.qp_num();
    b.qp_num = qp.qp_num();
    b.state = IBV_QPS_RESET;
    b.qp_type = IBV_QPT_RC;
    qp_ex::fill_ops(&mut ex);
    let qpn = qp.qp_num();
    let ptr = Box::into_raw(Box::new(Qp {
        ex: UnsafeCell::new(ex),
        qp,
        // An iWARP QP starts in INIT (siw's IDLE): rdma-core's `ibv_query_qp` on an RNIC
        // reports it so, while the struct says RESET until the first query, as there.
        idle_state: AtomicU32::new(IBV_QPS_INIT),
        cap: granted,
        sq_sig_all: init.sq_sig_all,
        builder: Mutex::new(WrBuilder::default()),
        cm_id: AtomicUsize::new(0),
        rnr_timer: AtomicU8::new(RNR_UNSET),
        rnr_retry: AtomicU8::new(RNR_UNSET),
    }));
    // SAFETY: the objects the QP was just made with, checked above.
    unsafe { for_each_use((a.pd, a.send_cq, a.recv_cq, a.srq), Users::add) };
    // SAFETY: contexts come from `ibv_open_device`.
    if let Some(c) = unsafe { Context::from_ibv(ctx) } {
        c.objects().qps.insert(qpn, ptr as usize);
    }
    Ok(ptr.cast())
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_create_qp(
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> *mut ibv_qp {
    forward!(create Qp, obj pd, ibv_create_qp(pd, attr), |o| u64::from((*o).qp_num));
    // SAFETY: the caller's PD and attributes.
    let (Some(p), Some(a)) = (unsafe { Pd::from_ibv(pd) }, unsafe { attr.as_mut() }) else {
        errno::set(libc::EINVAL);
        return std::ptr::null_mut();
    };
    // SAFETY: plain C data; all-zero is valid.
    let mut ex: ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
    ex.qp_context = a.qp_context;
    ex.send_cq = a.send_cq;
    ex.recv_cq = a.recv_cq;
    ex.srq = a.srq;
    ex.cap = a.cap;
    ex.qp_type = a.qp_type;
    ex.sq_sig_all = a.sq_sig_all;
    ex.comp_mask = IBV_QP_INIT_ATTR_PD;
    ex.pd = pd;
    match create(p.ibv.context, &mut ex) {
        Ok(qp) => {
            a.cap = ex.cap;
            qp
        }
        Err(e) => {
            errno::set(e);
            std::ptr::null_mut()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
) -> c_int {
    forward!(obj qp, ibv_modify_qp(qp, attr, mask));
    const CALL: &str = "ibv_modify_qp";
    // SAFETY: the caller's QP and attributes.
    let (Some(q), Some(a)) = (unsafe { Qp::from_ibv(qp) }, unsafe { attr.as_ref() }) else {
        return libc::EINVAL;
    };
    let mask = mask as u32;
    if mask & (IBV_QP_MIN_RNR_TIMER | IBV_QP_RNR_RETRY) != 0 {
        let timer = (mask & IBV_QP_MIN_RNR_TIMER != 0).then_some(a.min_rnr_timer);
        let retry = (mask & IBV_QP_RNR_RETRY != 0).then_some(a.rnr_retry);
        if let Err(e) = q.set_rnr(timer, retry) {
            return errno::fail(CALL, &e);
        }
    }
    if mask & IBV_QP_STATE == 0 {
        return 0;
    }
    let now = q.qp.state();
    let rc = match a.qp_state {
        IBV_QPS_RESET => match now {
            QpState::Idle => {
                q.idle_state.store(IBV_QPS_RESET, Ordering::Relaxed);
                0
            }
            QpState::Error => match q.qp.reset() {
                Ok(()) => {
                    q.idle_state.store(IBV_QPS_RESET, Ordering::Relaxed);
                    0
                }
                Err(e) => errno::fail(CALL, &e),
            },
            _ => errno::invalid(CALL, "RESET from a connected state (move to ERROR first)"),
        },
        s @ (IBV_QPS_INIT | IBV_QPS_RTR) => match now {
            QpState::Idle => {
                let cur = q.idle_state.load(Ordering::Relaxed);
                let ok = (s == IBV_QPS_INIT && (cur == IBV_QPS_RESET || cur == IBV_QPS_INIT))
                    || (s == IBV_QPS_RTR && (cur == IBV_QPS_INIT || cur == IBV_QPS_RTR));
                if ok {
                    q.idle_state.store(s, Ordering::Relaxed);
                    0
                } else {
                    errno::invalid(CALL, "state transition not allowed")
                }
            }
            _ => errno::invalid(CALL, "INIT/RTR on a connected QP"),
        },
        IBV_QPS_RTS => match now {
            QpState::Rts => 0,
            _ => errno::invalid(
                CALL,
                "an iWARP QP reaches RTS only through rdma_connect/rdma_accept",
            ),
        },
        IBV_QPS_ERR => match q.qp.modify_to_error() {
            Ok(()) => 0,
            Err(e) => errno::fail(CALL, &e),
        },
        IBV_QPS_SQD | IBV_QPS_SQE => errno::unsupported(CALL, "SQD/SQE transitions"),
        _ => errno::invalid(CALL, "unknown QP state"),
    };
    q.sync_state();
    rc
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    forward!(obj qp, ibv_query_qp(qp, attr, _mask, init));
    // SAFETY: the caller's QP.
    let Some(q) = (unsafe { Qp::from_ibv(qp) }) else {
        return libc::EINVAL;
    };
    if attr.is_null() || init.is_null() {
        return libc::EINVAL;
    }
    let state = q.sync_state();
    let conn = q.qp.connection();
    // SAFETY: plain C data; the caller's structures are writable.
    unsafe {
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = state;
        a.cur_qp_state = state;
        a.path_mtu = IBV_MTU_1024;
        a.qp_access_flags =
            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
        a.cap = q.cap;
        a.max_rd_atomic = conn.as_ref().map_or(16, |c| c.ord.min(255) as u8);
        a.max_dest_rd_atomic = conn.as_ref().map_or(16, |c| c.ird.min(255) as u8);
        a.port_num = 1;
        a.sq_draining = 0;
        // As set (InfiniBand's defaults otherwise: timer code 0, 7 retries).
        a.min_rnr_timer = Some(q.rnr_timer.load(Ordering::Relaxed))
            .filter(|&v| v != RNR_UNSET)
            .unwrap_or(0);
        a.rnr_retry = Some(q.rnr_retry.load(Ordering::Relaxed))
            .filter(|&v| v != RNR_UNSET)
            .unwrap_or(7);
        attr.write(a);
        let mut i: ibv_qp_init_attr = std::mem::zeroed();
        (i.qp_context, i.send_cq, i.recv_cq, i.srq) =
            q.base(|b| (b.qp_context, b.send_cq, b.recv_cq, b.srq));
        i.cap = q.cap;
        i.qp_type = IBV_QPT_RC;
        i.sq_sig_all = c_int::from(q.sq_sig_all);
        init.write(i);
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_query_qp_data_in_order(
    _qp: *mut ibv_qp,
    _op: c_int,
    _flags: u32,
) -> c_int {
    forward!(obj _qp, ibv_query_qp_data_in_order(_qp, _op, _flags));
    // Placement over TCP happens in order for each connection.
    1
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    forward!(destroy qp, ibv_destroy_qp);
    // SAFETY: the caller's QP.
    let Some(q) = (unsafe { Qp::from_ibv(qp) }) else {
        return libc::EINVAL;
    };
    // A connected QP's FIN waits for the peer's, within a bound by role, on the progress
    // thread, after the QP is gone (`softwarp::cm::CloseOrder`): the destroy returns at once.
    crate::cm::close_order().hold(&q.qp);
    let qpn = q.qp.qp_num();
    let ctx = q.base(|b| b.context);
    let uses = q.base(|b| (b.pd, b.send_cq, b.recv_cq, b.srq));
    // SAFETY: NULL or the id that named this QP (looked up before it is written).
    unsafe { crate::cm::id::forget_qp(q.cm_id.load(Ordering::Acquire) as *mut rdma_cm_id, qp) };
    // SAFETY: QPs are allocated with Box in `create`; the application gives it up.
    drop(unsafe { Box::from_raw(qp.cast::<Qp>()) });
    // Its completions not polled yet (the flushed ones the destroy just queued too) leave
    // its CQs, as rdma-core's providers clean them out (mlx5, mlx4, irdma): the application
    // counts what it posted and did not see complete as gone with the QP (libfabric's verbs
    // provider reports those as flushed itself, and frees the endpoint the completions
    // name).
    let (_, send_cq, recv_cq, _) = uses;
    for cq in [send_cq, recv_cq] {
        // SAFETY: the QP's CQs, alive until `for_each_use` below releases them.
        if let Some(c) = unsafe { Cq::from_ibv(cq) } {
            c.cq.discard_qp(qpn);
        }
    }
    // Its PD, CQs and SRQ may go once the QP is gone.
    // SAFETY: the QP's objects, alive until now (their counts kept them).
    unsafe { for_each_use(uses, Users::remove) };
    // SAFETY: contexts outlive their QPs.
    unsafe {
        context::forget(ctx, |o| {
            o.qps.remove(&qpn);
        })
    };
    0
}

// Softwarp's `Sge` is `ibv_sge` (`repr(C)`: u64 address, u32 length, u32 key), so that a C
// scatter/gather list is used in place (`sges`). Checked at compile time here and by the
// test `sge_is_ibv_sge`.
const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<Sge>() == size_of::<ibv_sge>());
    assert!(align_of::<Sge>() == align_of::<ibv_sge>());
    assert!(offset_of!(Sge, addr) == offset_of!(ibv_sge, addr));
    assert!(offset_of!(Sge, length) == offset_of!(ibv_sge, length));
    assert!(offset_of!(Sge, lkey) == offset_of!(ibv_sge, lkey));
    assert!(size_of::<Stag>() == size_of::<u32>());
};

/// A C scatter/gather list as Softwarp's, in place (no copy), or `EINVAL` when it has more
/// than [`MAX_SGE`] elements or a negative count.
///
/// # Safety
/// `sg` must point to `n` readable `ibv_sge`s when `n > 0`, which stay valid and unchanged
/// for `'a`.
#[inline]
pub unsafe fn sges<'a>(sg: *const ibv_sge, n: c_int) -> Result<&'a [Sge], c_int> {
    let n = usize::try_from(n).map_err(|_| libc::EINVAL)?;
    if n > MAX_SGE {
        return Err(libc::EINVAL);
    }
    if n == 0 {
        return Ok(&[]);
    }
    // SAFETY: `Sge` has `ibv_sge`'s size, alignment and field layout (asserted above; the
    // lkey is a `repr(transparent)` u32) and the caller's array has `n` entries, readable for
    // `'a`.
    Ok(unsafe { std::slice::from_raw_parts(sg.cast::<Sge>(), n) })
}

/// A scatter/gather list from C, copied, or `EINVAL` when it is too long.
///
/// # Safety
/// `sg` must point to `n` readable `ibv_sge`s when `n > 0`.
#[inline]
pub unsafe fn sgl(sg: *const ibv_sge, n: c_int) -> Result<SgList, c_int> {
    // SAFETY: forwarded from this function's contract (the slice is copied at once).
    SgList::from_slice(unsafe { sges(sg, n) }?).ok_or(libc::EINVAL)
}

/// Copies the bytes an inline send names (plain addresses, no lkeys) into `buf`.
///
/// # Safety
/// Each element must name readable memory of the application.
pub unsafe fn gather_inline(
    sg: *const ibv_sge,
    n: c_int,
    buf: &mut [u8; MAX_INLINE],
) -> Result<&[u8], c_int> {
    let n = usize::try_from(n).map_err(|_| libc::EINVAL)?;
    let mut len = 0usize;
    for i in 0..n {
        // SAFETY: the caller's array has `n` entries.
        let s = unsafe { &*sg.add(i) };
        let l = s.length as usize;
        let end = len
            .checked_add(l)
            .filter(|&e| e <= MAX_INLINE)
            .ok_or(libc::EINVAL)?;
        if l > 0 {
            // SAFETY: the application's inline data is readable for `length` bytes.
            let src = unsafe { std::slice::from_raw_parts(s.addr as usize as *const u8, l) };
            buf[len..end].copy_from_slice(src);
        }
        len = end;
    }
    Ok(&buf[..len])
}

/// The operation of a C send work request. Each union member is read only for the
/// opcodes that use it, and a plain Send is tested first (the common case: no table jump).
#[inline]
fn send_op(w: &ibv_send_wr) -> Result<SendOp, c_int> {
    let solicited = w.send_flags & IBV_SEND_SOLICITED != 0;
    if w.opcode == IBV_WR_SEND {
        return Ok(SendOp::Send {
            solicited,
            invalidate: None,
        });
    }
    // SAFETY: union members as the opcode selects them (plain integers, whatever the
    // application stored).
    let imm = || u32::from_be(unsafe { w.__bindgen_anon_1.imm_data });
    // SAFETY: as above.
    let inv = || unsafe { w.__bindgen_anon_1.invalidate_rkey };
    // SAFETY: as above.
    let rdma = || unsafe { w.wr.rdma };
    // SAFETY: as above.
    let atomic = || unsafe { w.wr.atomic };
    Ok(match w.opcode {
        IBV_WR_SEND_WITH_INV => SendOp::Send {
            solicited,
            invalidate: Some(Stag(inv())),
        },
        IBV_WR_SEND_WITH_IMM => SendOp::SendWithImm {
            solicited,
            imm: imm(),
        },
        IBV_WR_RDMA_WRITE => SendOp::Write {
            remote_addr: rdma().remote_addr,
            rkey: Stag(rdma().rkey),
        },
        IBV_WR_RDMA_WRITE_WITH_IMM => SendOp::WriteWithImm {
            remote_addr: rdma().remote_addr,
            rkey: Stag(rdma().rkey),
            imm: imm(),
        },
        IBV_WR_RDMA_READ => SendOp::Read {
            remote_addr: rdma().remote_addr,
            rkey: Stag(rdma().rkey),
        },
        IBV_WR_ATOMIC_CMP_AND_SWP => SendOp::CmpSwap {
            remote_addr: atomic().remote_addr,
            rkey: Stag(atomic().rkey),
            compare: atomic().compare_add,
            swap: atomic().swap,
        },
        IBV_WR_ATOMIC_FETCH_AND_ADD => SendOp::FetchAdd {
            remote_addr: atomic().remote_addr,
            rkey: Stag(atomic().rkey),
            add: atomic().compare_add,
        },
        _ => {
            return Err(errno::unsupported(
                "ibv_post_send",
                "opcode (local invalidate, bind MW, TSO)",
            ))
        }
    })
}

/// A C send work request as Softwarp's, its inline data (if any) gathered into `inline`.
///
/// # Safety
/// `w.sg_list` must point to `w.num_sge` SGEs.
unsafe fn send_wr<'b>(
    w: &ibv_send_wr,
    inline: &'b mut [u8; MAX_INLINE],
) -> Result<SendWr<'b>, c_int> {
    let op = send_op(w)?;
    let flags = w.send_flags;
    let payload = if flags & IBV_SEND_INLINE != 0 && !op.awaits_response() {
        // SAFETY: forwarded from this function's contract.
        Payload::Inline(unsafe { gather_inline(w.sg_list, w.num_sge, inline) }?)
    } else {
        // SAFETY: as above.
        Payload::Sgl(unsafe { sgl(w.sg_list, w.num_sge) }?)
    };
    Ok(SendWr {
        wr_id: w.wr_id,
        op,
        payload,
        signaled: flags & IBV_SEND_SIGNALED != 0,
        fence: flags & IBV_SEND_FENCE != 0,
    })
}

/// Why the conversion of a C list of send work requests stopped before its end.
#[derive(Debug, Clone, Copy)]
enum Stop {
    /// The work request cannot be posted: this errno.
    Bad(c_int),
    /// Inline data in several SGEs: gathered into a buffer and posted on its own.
    Gather,
}

/// The send work requests of a C list as Softwarp's, converted one at a time while the QP
/// takes them (`QueuePair::post_send_refs`: no intermediate array, the SGL used in place).
/// Ends at the end of the list, or at a work request it does not convert (`stop` says why;
/// `cur` points to it). Inline data in one SGE is borrowed from the application for the
/// post (the QP copies it).
struct CSendList<'a> {
    cur: *mut ibv_send_wr,
    stop: Option<Stop>,
    _inline: PhantomData<&'a [u8]>,
}

impl<'a> CSendList<'a> {
    /// # Safety
    /// `wr` is NULL or the application's list of work requests, each with its `sg_list` of
    /// `num_sge` SGEs and, for inline data, readable bytes, valid while the list is used.
    unsafe fn new(wr: *mut ibv_send_wr) -> Self {
        Self {
            cur: wr,
            stop: None,
            _inline: PhantomData,
        }
    }

    /// The work request at `cur` as Softwarp's, built in place (no `Result` to unwrap);
    /// `None` with `stop` set when it cannot be converted.
    ///
    /// # Safety
    /// As [`CSendList::new`], for `w`.
    #[inline]
    unsafe fn convert(&mut self, w: &ibv_send_wr) -> Option<SendWrRef<'a>> {
        let op = match send_op(w) {
            Ok(op) => op,
            Err(e) => return self.stopped(Stop::Bad(e)),
        };
        let flags = w.send_flags;
        let payload = if flags & IBV_SEND_INLINE != 0 && !op.awaits_response() {
            match w.num_sge {
                0 => PayloadRef::Inline(&[]),
                1 => {
                    // SAFETY: the work request has one SGE.
                    let s = unsafe { &*w.sg_list };
                    let len = s.length as usize;
                    if len > MAX_INLINE {
                        return self.stopped(Stop::Bad(libc::EINVAL));
                    }
                    if len == 0 {
                        PayloadRef::Inline(&[])
                    } else {
                        // SAFETY: the application's inline data is readable for `length`
                        // bytes during the post, which copies it.
                        PayloadRef::Inline(unsafe {
                            std::slice::from_raw_parts(s.addr as usize as *const u8, len)
                        })
                    }
                }
                n if n > 1 => return self.stopped(Stop::Gather),
                _ => return self.stopped(Stop::Bad(libc::EINVAL)),
            }
        } else {
            // SAFETY: the work request's SGE array, valid during the post.
            match unsafe { sges(w.sg_list, w.num_sge) } {
                Ok(l) => PayloadRef::Sges(l),
                Err(e) => return self.stopped(Stop::Bad(e)),
            }
        };
        self.cur = w.next;
        Some(SendWrRef {
            wr_id: w.wr_id,
            op,
            payload,
            signaled: flags & IBV_SEND_SIGNALED != 0,
            fence: flags & IBV_SEND_FENCE != 0,
        })
    }

    #[cold]
    fn stopped(&mut self, stop: Stop) -> Option<SendWrRef<'a>> {
        self.stop = Some(stop);
        None
    }
}

impl<'a> Iterator for CSendList<'a> {
    type Item = SendWrRef<'a>;

    #[inline]
    fn next(&mut self) -> Option<SendWrRef<'a>> {
        // SAFETY: the application's list (`CSendList::new`).
        let w = unsafe { self.cur.as_ref() }?;
        // SAFETY: as above.
        unsafe { self.convert(w) }
    }
}

/// The `i`th work request of a C list from `start` (which has at least `i + 1`).
///
/// # Safety
/// `start` is a list of the application's with at least `i + 1` work requests.
unsafe fn nth<C>(start: *mut C, i: usize, next: impl Fn(&C) -> *mut C) -> *mut C {
    let mut at = start;
    for _ in 0..i {
        // SAFETY: the list has more than `i` entries.
        at = next(unsafe { &*at });
    }
    at
}

/// `ibv_context_ops.post_send`: the list converted as the QP takes it, all queued before
/// anything is sent (`post_send_refs`: its small messages share system calls, as with the
/// native API); a work request with inline data in several SGEs is gathered and posted on
/// its own, after those before it.
pub unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    const CALL: &str = "ibv_post_send";
    // SAFETY: the caller's QP.
    let Some(q) = (unsafe { Qp::from_ibv(qp) }) else {
        return libc::EINVAL;
    };
    // SAFETY: the caller's list of work requests.
    let mut list = unsafe { CSendList::new(wr) };
    let result = loop {
        if list.cur.is_null() {
            break Ok(());
        }
        let start = list.cur;
        if let Err((i, e)) = q.qp.post_send_refs(&mut list) {
            // SAFETY: the QP took `i + 1` work requests from `start`.
            break Err((unsafe { nth(start, i, |w| w.next) }, errno::fail(CALL, &e)));
        }
        match list.stop.take() {
            None => break Ok(()),
            // Those before it are posted, as rdma-core's providers do.
            Some(Stop::Bad(e)) => break Err((list.cur, e)),
            Some(Stop::Gather) => {
                // SAFETY: the work request the list stopped at.
                let w = unsafe { &*list.cur };
                let mut buf = [0u8; MAX_INLINE];
                // SAFETY: as above.
                let posted = unsafe { send_wr(w, &mut buf) }
                    .and_then(|one| q.qp.post_send(&one).map_err(|e| errno::fail(CALL, &e)));
                if let Err(e) = posted {
                    break Err((list.cur, e));
                }
                list.cur = w.next;
            }
        }
    };
    finish(result, bad)
}

/// The return code of a post, `*bad` set to the failed work request as rdma-core does.
fn finish<C>(result: Result<(), (*mut C, c_int)>, bad: *mut *mut C) -> c_int {
    match result {
        Ok(()) => 0,
        Err((at, e)) => {
            if !bad.is_null() {
                // SAFETY: `bad` is the caller's, writable.
                unsafe { *bad = at };
            }
            e
        }
    }
}

/// The receive work requests of a C list as Softwarp's, converted one at a time as the
/// QP or SRQ takes them, each SGL used in place. Ends at the end of the list or at a work
/// request whose SGL is refused (`stop`: the errno; `cur` points to it).
struct CRecvList<'a> {
    cur: *mut ibv_recv_wr,
    stop: Option<c_int>,
    _sges: PhantomData<&'a [Sge]>,
}

impl CRecvList<'_> {
    /// # Safety
    /// `wr` is NULL or the application's list of work requests, each with its `sg_list` of
    /// `num_sge` SGEs, valid while the list is used.
    unsafe fn new(wr: *mut ibv_recv_wr) -> Self {
        Self {
            cur: wr,
            stop: None,
            _sges: PhantomData,
        }
    }
}

impl<'a> Iterator for CRecvList<'a> {
    type Item = RecvWrRef<'a>;

    #[inline]
    fn next(&mut self) -> Option<RecvWrRef<'a>> {
        // SAFETY: the application's list (`CRecvList::new`).
        let w = unsafe { self.cur.as_ref() }?;
        // SAFETY: the work request's SGE array, valid while the list is used.
        match unsafe { sges(w.sg_list, w.num_sge) } {
            Ok(sges) => {
                self.cur = w.next;
                Some(RecvWrRef {
                    wr_id: w.wr_id,
                    sges,
                })
            }
            Err(e) => {
                self.stop = Some(e);
                None
            }
        }
    }
}

/// `ibv_context_ops.post_recv`: the list converted as the QP takes it (`post_recv_refs`).
pub unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: the caller's QP.
    let Some(q) = (unsafe { Qp::from_ibv(qp) }) else {
        return libc::EINVAL;
    };
    if wr.is_null() {
        return 0;
    }
    // SAFETY: the caller's list of work requests.
    let mut list = unsafe { CRecvList::new(wr) };
    let result = match q.qp.post_recv_refs(&mut list) {
        // SAFETY: the QP took `i + 1` work requests from `wr`.
        Err((i, e)) => Err((
            unsafe { nth(wr, i, |w| w.next) },
            errno::fail("ibv_post_recv", &e),
        )),
        // Those before it are posted.
        Ok(()) => list.stop.map_or(Ok(()), |e| Err((list.cur, e))),
    };
    finish(result, bad)
}

/// `ibv_context_ops.post_srq_recv`: one work request at a time (the SRQ has no list call).
pub unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: SRQs come from `ibv_create_srq`.
    let Some(s) = (unsafe { Srq::from_ibv(srq) }) else {
        return libc::EINVAL;
    };
    // SAFETY: the caller's list of work requests.
    let mut list = unsafe { CRecvList::new(wr) };
    let result = loop {
        let at = list.cur;
        let Some(w) = list.next() else {
            break list.stop.map_or(Ok(()), |e| Err((list.cur, e)));
        };
        // At most `MAX_SGE` elements (`sges`).
        let Some(sgl) = SgList::from_slice(w.sges) else {
            break Err((at, libc::EINVAL));
        };
        let w = RecvWr {
            wr_id: w.wr_id,
            sgl,
        };
        if let Err(e) = s.srq.post_recv(&w) {
            break Err((at, errno::fail("ibv_post_srq_recv", &e)));
        }
    };
    finish(result, bad)
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_create_srq(
    pd: *mut ibv_pd,
    attr: *mut ibv_srq_init_attr,
) -> *mut ibv_srq {
    forward!(create Srq, obj pd, ibv_create_srq(pd, attr), |o| u64::from((*o).handle));
    // SAFETY: the caller's PD and attributes.
    let (Some(p), Some(a)) = (unsafe { Pd::from_ibv(pd) }, unsafe { attr.as_mut() }) else {
        errno::set(libc::EINVAL);
        return std::ptr::null_mut();
    };
    let init = SrqInitAttr {
        max_wr: a.attr.max_wr as usize,
        max_sge: (a.attr.max_sge as usize).max(1),
        srq_limit: a.attr.srq_limit as usize,
    };
    if init.max_sge > MAX_SGE || init.max_wr == 0 {
        errno::set(errno::invalid(
            "ibv_create_srq",
            "max_wr 0 or max_sge beyond the limit",
        ));
        return std::ptr::null_mut();
    }
    let srq = match p.pd.create_srq(&init) {
        Ok(s) => s,
        Err(e) => {
            errno::set(errno::fail("ibv_create_srq", &e));
            return std::ptr::null_mut();
        }
    };
    let id = srq.id();
    // SAFETY: plain C data; all-zero is valid.
    let mut ibv: ibv_srq = unsafe { std::mem::zeroed() };
    ibv.context = p.ibv.context;
    ibv.srq_context = a.srq_context;
    ibv.pd = pd;
    ibv.handle = id.0;
    a.attr.max_sge = MAX_SGE as u32;
    let ptr = Box::into_raw(Box::new(Srq {
        ibv,
        srq,
        max_wr: a.attr.max_wr,
        max_sge: MAX_SGE as u32,
        limit: AtomicU32::new(a.attr.srq_limit),
        users: Users::new(),
    }));
    p.users.add();
    // SAFETY: contexts outlive their objects.
    if let Some(c) = unsafe { Context::from_ibv(p.ibv.context) } {
        c.objects().srqs.insert(id, ptr as usize);
    }
    ptr.cast()
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_modify_srq(
    srq: *mut ibv_srq,
    attr: *mut ibv_srq_attr,
    mask: c_int,
) -> c_int {
    forward!(obj srq, ibv_modify_srq(srq, attr, mask));
    // SAFETY: the caller's SRQ and attributes.
    let (Some(s), Some(a)) = (unsafe { Srq::from_ibv(srq) }, unsafe { attr.as_ref() }) else {
        return libc::EINVAL;
    };
    let mask = mask as u32;
    if mask & IBV_SRQ_MAX_WR != 0 {
        return errno::unsupported("ibv_modify_srq", "resizing an SRQ");
    }
    if mask & IBV_SRQ_LIMIT != 0 {
        s.srq.arm_limit(a.srq_limit as usize);
        s.limit.store(a.srq_limit, Ordering::Relaxed);
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    forward!(obj srq, ibv_query_srq(srq, attr));
    // SAFETY: the caller's SRQ and attributes.
    let (Some(s), Some(a)) = (unsafe { Srq::from_ibv(srq) }, unsafe { attr.as_mut() }) else {
        return libc::EINVAL;
    };
    a.max_wr = s.max_wr;
    a.max_sge = s.max_sge;
    a.srq_limit = s.limit.load(Ordering::Relaxed);
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_destroy_srq(srq: *mut ibv_srq) -> c_int {
    forward!(destroy srq, ibv_destroy_srq);
    // SAFETY: the caller's SRQ.
    let Some(s) = (unsafe { Srq::from_ibv(srq) }) else {
        return libc::EINVAL;
    };
    if s.users.busy() {
        // The kernel's answer (`ib_destroy_srq_user`): QPs receive from it.
        return errno::busy("ibv_destroy_srq", "QPs that receive from the SRQ");
    }
    let id = s.srq.id();
    let (ctx, pd) = (s.ibv.context, s.ibv.pd);
    // SAFETY: SRQs are allocated with Box; the application gives it up.
    drop(unsafe { Box::from_raw(srq.cast::<Srq>()) });
    // SAFETY: the SRQ's PD, alive while the SRQ used it (its count said so).
    if let Some(p) = unsafe { Pd::from_ibv(pd) } {
        p.users.remove();
    }
    // SAFETY: contexts outlive their objects.
    unsafe {
        context::forget(ctx, |o| {
            o.srqs.remove(&id);
        })
    };
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_qp_to_qp_ex(qp: *mut ibv_qp) -> *mut ibv_qp_ex {
    forward!(obj qp, ibv_qp_to_qp_ex(qp));
    // Every QP of this library is an `ibv_qp_ex` with the `ibv_wr_*` operations filled.
    qp.cast()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn min_rnr_timer_and_rnr_retry_map_to_a_bounded_rnr_wait() {
        let default = Some(Duration::from_secs(10));
        let ms = |n: u64| Some(Duration::from_micros(n));
        // Never set, or 7 ("infinite"): the process's bounded default.
        assert_eq!(rnr_wait_of(None, None, default), default);
        assert_eq!(rnr_wait_of(Some(12), Some(7), default), default);
        assert_eq!(rnr_wait_of(Some(12), None, default), default);
        assert_eq!(rnr_wait_of(None, Some(7), None), None);
        // 0 retries: fail at once.
        assert_eq!(rnr_wait_of(Some(31), Some(0), default), None);
        // Finite: retries times the timer (code 12 = 0.64 ms, code 0 = 655.36 ms).
        assert_eq!(rnr_wait_of(Some(12), Some(3), default), ms(3 * 640));
        assert_eq!(rnr_wait_of(Some(31), Some(1), default), ms(491_520));
        assert_eq!(rnr_wait_of(None, Some(6), default), ms(6 * 655_360));
        assert_eq!(rnr_wait_of(Some(0), Some(6), default), ms(6 * 655_360));
    }
    use std::mem::{align_of, offset_of, size_of};

    /// `sges` reads a C `ibv_sge` array in place as `&[Sge]`: the layouts must agree (the
    /// compile-time assertion above says so; this checks the values read through it).
    #[test]
    fn sge_is_ibv_sge() {
        assert_eq!((size_of::<Sge>(), align_of::<Sge>()), (16, 8));
        assert_eq!(
            (size_of::<Sge>(), align_of::<Sge>()),
            (size_of::<ibv_sge>(), align_of::<ibv_sge>())
        );
        assert_eq!(
            [
                offset_of!(Sge, addr),
                offset_of!(Sge, length),
                offset_of!(Sge, lkey)
            ],
            [
                offset_of!(ibv_sge, addr),
                offset_of!(ibv_sge, length),
                offset_of!(ibv_sge, lkey)
            ]
        );
        let c: Vec<ibv_sge> = (0..MAX_SGE as u32 + 1)
            .map(|i| ibv_sge {
                addr: 0x1122_3344_5566_7788 + u64::from(i),
                length: 0x9900_0000 | i,
                lkey: 0xabcd_ef00 | i,
            })
            .collect();
        let n = MAX_SGE as c_int;
        // SAFETY: `c` has more than `n` entries, alive for the test.
        let got = unsafe { sges(c.as_ptr(), n) }.unwrap();
        assert_eq!(got.len(), MAX_SGE);
        for (s, w) in got.iter().zip(&c) {
            assert_eq!(
                *s,
                Sge {
                    addr: w.addr,
                    length: w.length,
                    lkey: Stag(w.lkey),
                }
            );
        }
        // The same list copied (`sgl`), and the refusals rdma-core's providers make.
        // SAFETY: as above.
        let copied = unsafe { sgl(c.as_ptr(), n) }.unwrap();
        assert_eq!(copied.as_slice(), got);
        // SAFETY: as above.
        assert_eq!(unsafe { sges(c.as_ptr(), n + 1) }, Err(libc::EINVAL));
        // SAFETY: a negative count reads nothing.
        assert_eq!(unsafe { sges(c.as_ptr(), -1) }, Err(libc::EINVAL));
        // SAFETY: a zero count reads nothing, not even a NULL array.
        assert_eq!(unsafe { sges(std::ptr::null(), 0) }, Ok(&[][..]));
    }
}
