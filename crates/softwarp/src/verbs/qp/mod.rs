//! Queue pairs (after `ibv_qp`, reliable connected): the verbs handle, and the runtime
//! around the engine's [`Qp`].
//!
//! The engine decides everything about the bytes, including how they are staged, coalesced
//! and gated; the runtime hands it the socket, holds the locks, registers with epoll,
//! closes and lingers, and runs the write watchdog and the receive take-over. By job:
//!
//! - this file: [`QueuePair`] (the verbs handle: create, post, modify, connect) and the
//!   state it shares with the progress thread ([`QpShared`]: the QP lock, draining
//!   completions and events, RAS views);
//! - `conn`: the connection's life: establishing on a negotiated socket, graceful close
//!   (FIN, linger), abortive close, telling the connection manager;
//! - `pump`: the passes that move bytes through [`Qp::recv_from`] and [`Qp::send_to`] (the
//!   progress thread's `service`, a busy-polling thread's `busy_pass`, the posting thread's
//!   transmit) and the timer look (the engine's clock);
//! - `poller`: epoll registration of busy-polled QPs, the write watchdog and the receive
//!   take-over (the progress thread serves a busy-polled QP whose polls stopped).
//!
//! # Walk of a posted Send
//!
//! 1. [`QueuePair::post_send_list`] locks the QP, checks the WR against the QP's capacities
//!    and calls the engine's `Qp::post_send` under the STag table's read lock (SGEs
//!    validated, the WR queued in the SQ).
//! 2. `QpShared::tx_pass` (pump) on the posting thread takes the thread's batch buffer,
//!    checks the socket (closed, failed, the first-FPDU hold-off) and calls
//!    `Qp::send_to(SockIo, batch, budget)`.
//! 3. In the engine (`softwarp_engine::qp` pump): bytes a full socket left in the spill go
//!    first; a small Send is copied whole into the batch by `tx_copy_fpdus` (header from the
//!    codec's template, payload through the region's word views, CRC over the copy) and its
//!    WR marked done; `SockIo::write_from` writes the batch with one `sendmsg`
//!    (`sys::write_pieces`). A large message is gathered instead: `poll_tx_gather` offers
//!    header, region ranges (`Region::ptr_range`) and trailer, written by `sendmsg`, then
//!    `tx_commit`.
//! 4. A full socket (`SendEnd::Full`) arms the write watchdog of a busy-polled QP (poller);
//!    otherwise the progress thread finishes on write readiness (`service`). Until a pass
//!    writes again (`Conn::tx_full`), later posts and busy polls do not ask the full socket:
//!    they queue for the progress thread, or first ask `poll(POLLOUT)` when busy-polled.
//! 5. `QpShared::drain` moves the completion to the send CQ when the WR is signalled.
//!
//! # Walk of received bytes
//!
//! 1. The progress thread (`progress.rs`, edge-triggered epoll) calls `QpShared::service`
//!    on readiness; a thread polling a busy-poll CQ calls `QpShared::busy_pass`.
//! 2. `rx_pass` (pump) calls `Qp::recv_from(SockIo, stage, budget, until, RxLocks)`.
//! 3. In the engine: at an FPDU boundary `SockIo::read_to` does one `readv` into the staging
//!    buffer (`sys::read_buf_staged`); the whole FPDUs there go in one step each
//!    (`rx_whole_fpdu`, with `rx_small_send` for a whole Send): the header is validated
//!    (RxLocks takes the SRQ, then the STag table's write lock, let go before the next
//!    read), the payload copied to its destination through `Region::write_at`, the CRC
//!    checked, the completion queued. A partial FPDU goes by `rx_target`: the next read
//!    goes straight into the header buffer or the destination range
//!    (`sys::read_region_staged`, the region's pointer from `Region::ptr_range`), then
//!    `rx_commit`.
//! 4. `rx_pass` turns how it ended (`RecvEnd`) into what the connection does: the end of the
//!    stream or a failed read closes the receive side and tells the connection manager;
//!    `Blocked` drains completions and tries once more.
//! 5. `QpShared::drain` moves completions to the receive CQ and events to the device.
//!
//! Locks: each QP has its own mutex; the STag table is locked only inside `post_send`
//! (validation) and by the receive steps that complete a header or an FPDU (placement
//! decisions, invalidation; the SRQ, if any, first), never across a system call. The order
//! of all of them is the table in the crate docs ("Locks").

mod conn;
pub(crate) mod options;
mod poller;
mod pump;
pub(crate) mod view;

pub use conn::wait_for_held_closes;
use conn::Conn;
pub(crate) use conn::{ConnObserver, LinkDown};
use options::ConnectionInfo;
use pump::TxEnd;
use view::{QpCountersView, QpView};

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mio::{Registry, Token};
use softwarp_engine::event::AsyncEvent;
use softwarp_engine::fault::Cause;
use softwarp_engine::qp::{Qp, QpConfig, QpState};
use softwarp_engine::stats::QpStats;
use softwarp_engine::wr::{PayloadRef, RecvWr, RecvWrRef, SendWr, SendWrRef};
use softwarp_ras::deadline::Deadline;
use softwarp_ras::errlog::CriticalKind;
use softwarp_ras::markers::MarkerWord;

use crate::availability::inflight::{Entry, Inflight};
use crate::availability::markers;
use crate::availability::recovery::{ContainedQp, DeviceFault};
use crate::error::{Error, Result};
use crate::instrument::{QpRas, Tracked};
use crate::runtime::progress::{Pass, ServedQp, TimerLook};
use crate::sync::lock;
use crate::verbs::cq::{CompletionQueue, CqShared};
use crate::verbs::device::{CountGuard, DeviceShared};
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::srq::{SharedReceiveQueue, SrqShared};

/// Capacities of a QP (after `ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCap {
    /// Most outstanding send work requests.
    pub max_send_wr: usize,
    /// Most outstanding receive work requests (with an SRQ: how many SRQ work requests the
    /// QP may hold at once).
    pub max_recv_wr: usize,
    /// Most SGEs per send work request.
    pub max_send_sge: usize,
    /// Most SGEs per receive work request.
    pub max_recv_sge: usize,
    /// Most bytes of inline data per send work request.
    pub max_inline_data: usize,
}

impl Default for QpCap {
    fn default() -> Self {
        Self {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: softwarp_engine::wr::MAX_SGE,
            max_recv_sge: softwarp_engine::wr::MAX_SGE,
            max_inline_data: softwarp_engine::wr::MAX_INLINE,
        }
    }
}

/// Creation parameters of a QP (after `ibv_qp_init_attr`).
#[derive(Debug, Clone, Copy)]
pub struct QpInitAttr<'a> {
    /// CQ for send work requests.
    pub send_cq: &'a CompletionQueue,
    /// CQ for receive work requests.
    pub recv_cq: &'a CompletionQueue,
    /// Receive from this SRQ instead of an own receive queue.
    pub srq: Option<&'a SharedReceiveQueue>,
    /// Queue capacities.
    pub cap: QpCap,
    /// Every send work request is signalled (completes into the CQ even on success).
    pub sq_sig_all: bool,
    /// ORD: RDMA Reads this QP may have outstanding (offered in MPA v2 negotiation).
    pub max_rd_atomic: usize,
    /// IRD: RDMA Read Requests this QP accepts outstanding (offered in MPA v2 negotiation).
    pub max_dest_rd_atomic: usize,
}

impl<'a> QpInitAttr<'a> {
    /// Default capacities, IRD = ORD = 16, no SRQ, per-WR signalling.
    pub fn new(send_cq: &'a CompletionQueue, recv_cq: &'a CompletionQueue) -> Self {
        Self {
            send_cq,
            recv_cq,
            srq: None,
            cap: QpCap::default(),
            sq_sig_all: false,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
        }
    }
}

#[derive(Debug)]
pub(crate) struct QpInner {
    qp: Qp,
    conn: Option<Conn>,
    connecting: bool,
    info: Option<ConnectionInfo>,
    destroyed: bool,
    observer: Option<Arc<dyn ConnObserver>>,
    /// Busy poll handed the closing of the connection to the progress thread.
    close_kicked: bool,
    /// Passes the application's threads made over this QP so far (busy polls and posts,
    /// which both write): the write watchdog tells from it whether the application is
    /// still at work.
    app_passes: u64,
    /// Times the write watchdog was armed, and times the progress thread took over from
    /// it (statistics: the `watchdog` detail of `softwarp resources`).
    watch_armed: u64,
    watch_takeovers: u64,
    /// Times the progress thread handed a transmission it took over from the watchdog back
    /// to the application's polls because they came back with bytes still pending
    /// (statistics: `handed_back` in the `watchdog` detail).
    watch_handbacks: u64,
    /// Times the progress thread took the reading of this busy-polled QP over because its
    /// polls had stopped, and times it handed it back (statistics: the `rx_takeover`
    /// detail of `softwarp resources`).
    rx_takeovers: u64,
    rx_handbacks: u64,
    /// Receive posts the application made so far: a QP whose polls stopped and whose
    /// reading the progress thread took over is handed back once they go on (the
    /// application takes receive completions and reposts).
    recv_posts: u64,
    /// Posts that only queued their work behind a full socket (statistics: the
    /// `tx_deferred` detail of `softwarp resources`).
    tx_deferred: u64,
    /// The QP's own RNR wait ([`QueuePair::set_rnr_wait`]), before the connection's
    /// ([`ConnectOptions::rnr_wait`](crate::ConnectOptions::rnr_wait)).
    rnr_wait: Option<Option<Duration>>,
}

/// State shared between a [`QueuePair`] handle and the progress thread. `repr(C)`: the
/// structure markers begin and end it.
#[derive(Debug)]
#[repr(C)]
pub(crate) struct QpShared {
    begin: markers::Begin,
    qp_num: u32,
    pub(crate) device: Arc<DeviceShared>,
    send_cq: Arc<CqShared>,
    recv_cq: Arc<CqShared>,
    srq: Option<Arc<SrqShared>>,
    sq_sig_all: bool,
    cap: QpCap,
    inner: Mutex<QpInner>,
    count: Mutex<CountGuard>,
    /// The QP's number, reserved while it lives.
    _number: crate::verbs::device::IdLease,
    /// Resource registration, state-change tracing, critical events, TCP_INFO.
    ras: QpRas,
    /// Why the QP failed (`QueuePair::error_reason`).
    failure: crate::availability::recovery::ErrorBlock,
    end: markers::End,
}

impl Drop for QpShared {
    fn drop(&mut self) {
        // Its entries in the device's and CQs' lists (one per CQ role, as inserted).
        self.device.qps.died();
        self.send_cq.qps.died();
        self.recv_cq.qps.died();
        lock(&self.count).release(&self.device.counts.qp);
    }
}

impl QpShared {
    #[inline]
    fn lock(&self) -> MutexGuard<'_, QpInner> {
        lock(&self.inner)
    }

    /// Moves events to the device and completions to the CQs. Events first: an
    /// application that sees a work request flushed finds the event that failed the QP
    /// (a Terminate's cause, say) already there, even when both came from one pass.
    fn drain(&self, inner: &mut QpInner) {
        while let Some(ev) = inner.qp.poll_event() {
            if let Some(cause) = crate::availability::recovery::event_cause(&ev) {
                self.failure
                    .set(crate::availability::recovery::QpErrorReason::Cause(cause));
            }
            let fd = inner.conn.as_ref().map(|c| c.stream.as_fd());
            self.device
                .hooks
                .qp_event(&self.ras, &ev, &inner.qp, inner.info.as_ref(), fd);
            let link_closed = matches!(
                ev,
                AsyncEvent::QpFatal {
                    cause: Cause::LlpClosed,
                    ..
                }
            );
            if link_closed && inner.observer.is_some() {
                // The connection manager reports it as a Disconnected event instead.
                continue;
            }
            self.device.events.push(ev);
        }
        // Most drains find nothing: ask before the (not inlined) polls. Send completions
        // first, as `Qp::poll_completion` orders them; each CQ locked once for its run.
        if inner.qp.has_completion() {
            let qp = &mut inner.qp;
            self.send_cq.push_all(|| qp.poll_send_completion());
            self.recv_cq.push_all(|| qp.poll_recv_completion());
        }
        if let Some(srq) = &self.srq {
            srq.forward_event();
        }
        self.ras.state_seen(inner.qp.state());
    }

    /// Has the progress thread pass over the QP, which holds a Send that a receive just
    /// posted may take (the RNR wait), when it is connected.
    #[cold]
    #[inline(never)]
    fn resume_held(self: &Arc<Self>) {
        if self.lock().conn.is_some() {
            self.device.progress.kick(Arc::clone(self));
        }
    }

    /// Takes the QP's failure snapshot (`kind`, `reason`) unless one was taken for its
    /// connection already; returns its id. Takes the QP lock: call with no lock held.
    pub(crate) fn take_snapshot(
        &self,
        kind: softwarp_ras::errlog::CriticalKind,
        reason: String,
    ) -> Option<u64> {
        let g = self.lock();
        let fd = g.conn.as_ref().map(|c| c.stream.as_fd());
        self.device
            .hooks
            .qp_snapshot(&self.ras, kind, reason, &g.qp, g.info.as_ref(), fd)
    }

    /// The QP's state, engine counters and queue lengths, copied under its lock: what the
    /// device's sums over its QPs need (no TCP_INFO sample, no attribute strings).
    pub(crate) fn counters_view(&self) -> QpCountersView {
        let g = self.lock();
        QpCountersView {
            state: g.qp.state(),
            stats: *g.qp.stats(),
            sq: g.qp.sq_len(),
            rq: g.qp.rq_len(),
            reads: g.qp.outstanding_reads(),
        }
    }

    /// What RAS reports about the QP (resources, statistics); samples TCP_INFO when due.
    pub(crate) fn ras_view(&self) -> QpView {
        let g = self.lock();
        let fd = g.conn.as_ref().map(|c| c.stream.as_fd());
        let view = QpView::take(&self.ras, &g.qp, g.info.as_ref(), fd);
        let view = match &g.conn {
            Some(c) => view
                .with_attr("tx_by", c.tx_by())
                .with_attr("rx_by", c.rx_by()),
            None => view,
        };
        let view = if g.rx_takeovers > 0 {
            let t = format!(
                "took_over={},handed_back={}",
                g.rx_takeovers, g.rx_handbacks
            );
            view.with_attr("rx_takeover", &t)
        } else {
            view
        };
        let view = if g.tx_deferred > 0 {
            view.with_attr("tx_deferred", &g.tx_deferred.to_string())
        } else {
            view
        };
        if g.watch_armed == 0 {
            return view;
        }
        let watchdog = format!(
            "armed={},took_over={},handed_back={}",
            g.watch_armed, g.watch_takeovers, g.watch_handbacks
        );
        view.with_attr("watchdog", &watchdog)
    }

    pub(crate) fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// Whether the QP's begin and end words are intact (two loads).
    #[inline]
    fn markers_intact(&self) -> bool {
        markers::intact(markers::Kind::Qp, &self.begin, &self.end)
    }

    /// The QP's markers and the guard words of its rings, as found (takes the QP lock).
    pub(crate) fn marker_words(&self) -> Vec<MarkerWord> {
        let mut words = markers::words(markers::Kind::Qp, &self.begin, &self.end);
        words.extend(markers::ring_words(&self.lock().qp.ring_guards()));
        words
    }

    /// Checks every marker of the QP; a damaged one fails the device. Takes the QP lock:
    /// call with no lock held.
    pub(crate) fn check_markers(&self, check: &'static str) -> Result<()> {
        let words = self.marker_words();
        if words.iter().all(MarkerWord::is_intact) {
            return Ok(());
        }
        Err(self.markers_damaged(check))
    }

    /// Reports damaged markers (fails the device). Call with no lock held.
    #[cold]
    #[inline(never)]
    fn markers_damaged(&self, check: &'static str) -> Error {
        let words = self.marker_words();
        markers::damaged(
            &*self.device,
            markers::Kind::Qp.name(),
            u64::from(self.qp_num),
            &words,
            check,
        )
    }

    /// Enters entry point `entry` (in-flight tracking) after checking the QP's markers
    /// (the device's are checked by the device's own entry points and at close). Inlined:
    /// the fast path is the gate and two compares; failures go to a cold function.
    #[inline(always)]
    fn enter(&self, entry: Entry) -> Result<Inflight<'_>> {
        match self.device.inflight.enter(entry) {
            Ok(inside) if self.markers_intact() => Ok(inside),
            other => Err(self.enter_failed(other, entry)),
        }
    }

    /// Why [`QpShared::enter`] failed (the gate refused, or a marker is damaged: then the
    /// thread leaves first).
    #[cold]
    #[inline(never)]
    fn enter_failed(
        &self,
        entered: std::result::Result<Inflight<'_>, crate::availability::inflight::Refused>,
        entry: Entry,
    ) -> Error {
        match entered {
            Err(r) => crate::availability::inflight::refused(r),
            Ok(inside) => {
                drop(inside);
                self.markers_damaged(entry.name())
            }
        }
    }
}

/// A QP as device containment sees it.
impl ContainedQp for QpShared {
    fn qp_num(&self) -> u32 {
        QpShared::qp_num(self)
    }
    fn fail_device(qp: &Arc<Self>, fault: &DeviceFault) {
        QpShared::fail_device(qp, fault);
    }
    fn take_snapshot(&self, kind: CriticalKind, reason: String) -> Option<u64> {
        QpShared::take_snapshot(self, kind, reason)
    }
}

/// The progress thread's view of a QP (the passes and looks are in `pump` and `poller`).
impl ServedQp for QpShared {
    #[inline]
    fn qp_num(&self) -> u32 {
        QpShared::qp_num(self)
    }
    #[inline]
    fn register(&self, registry: &Registry, token: Token) -> bool {
        QpShared::register(self, registry, token)
    }
    #[inline]
    fn look_period(&self) -> Option<Duration> {
        QpShared::look_period(self)
    }
    #[inline]
    fn busy_polled(&self) -> bool {
        QpShared::busy_polled(self)
    }
    #[inline]
    fn service(&self, registry: &Registry, scratch: &mut [u8]) -> Pass {
        QpShared::service(self, registry, scratch)
    }
    #[inline]
    fn on_timer(&self, now: Instant) -> TimerLook {
        QpShared::on_timer(self, now)
    }
    #[inline]
    fn rx_look(&self, registry: &Registry) -> bool {
        QpShared::rx_look(self, registry)
    }
    #[inline]
    fn set_error(&self) {
        QpShared::set_error(self)
    }
}

/// A reliable-connected queue pair.
///
/// Created Idle by [`ProtectionDomain::create_qp`]; post receives, then connect it
/// ([`QueuePair::connect`]) or accept a connection into it ([`crate::Listener::accept`]).
/// All methods take `&self`: share it between threads with an `Arc`. Dropping it destroys
/// the QP: outstanding work requests complete with a flush status and the connection closes.
#[derive(Debug)]
pub struct QueuePair {
    shared: Arc<QpShared>,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    /// Registered with the device's tracker while the application holds the QP.
    _ras: Tracked,
}

impl QueuePair {
    #[track_caller]
    pub(crate) fn new(pd: &ProtectionDomain, attr: &QpInitAttr<'_>) -> Result<Self> {
        let device = pd.device();
        pd.check_cq(attr.send_cq)?;
        pd.check_cq(attr.recv_cq)?;
        if let Some(srq) = attr.srq {
            if !Arc::ptr_eq(srq.device(), device) {
                return Err(Error::WrongOwner("shared receive queue"));
            }
        }
        let a = &device.attr;
        let checks = [
            ("send queue depth", attr.cap.max_send_wr, a.max_qp_wr),
            ("receive queue depth", attr.cap.max_recv_wr, a.max_qp_wr),
            ("send SGEs", attr.cap.max_send_sge, a.max_sge),
            ("receive SGEs", attr.cap.max_recv_sge, a.max_sge),
            ("inline data", attr.cap.max_inline_data, a.max_inline_data),
            (
                "ORD (max_rd_atomic)",
                attr.max_rd_atomic,
                a.max_qp_init_rd_atom,
            ),
            (
                "IRD (max_dest_rd_atomic)",
                attr.max_dest_rd_atomic,
                a.max_qp_rd_atom,
            ),
        ];
        for (what, requested, limit) in checks {
            if requested > limit {
                return Err(Error::Limit {
                    what,
                    requested,
                    limit,
                });
            }
        }
        if attr.cap.max_send_wr == 0 {
            return Err(Error::InvalidArgument("max_send_wr must be at least 1"));
        }
        if attr.cap.max_recv_wr == 0 {
            return Err(Error::InvalidArgument("max_recv_wr must be at least 1"));
        }
        let count = pd.take_qp_count()?;
        let number = device.next_qp_num()?;
        let qp_num = number.id();
        let cfg = QpConfig {
            qp_num,
            pd: pd.id(),
            sq_depth: attr.cap.max_send_wr,
            rq_depth: attr.cap.max_recv_wr,
            use_srq: attr.srq.is_some(),
            max_ird: attr.max_dest_rd_atomic,
            max_ord: attr.max_rd_atomic,
        };
        let ras = QpRas::new(device.ras.instance_shared(), qp_num, qp_attrs(pd, attr));
        let shared = Arc::new(QpShared {
            begin: markers::Begin::new(markers::Kind::Qp),
            qp_num,
            device: Arc::clone(device),
            send_cq: Arc::clone(&attr.send_cq.shared),
            recv_cq: Arc::clone(&attr.recv_cq.shared),
            srq: attr.srq.map(|s| Arc::clone(&s.shared)),
            sq_sig_all: attr.sq_sig_all,
            cap: attr.cap,
            inner: Mutex::new(QpInner {
                qp: Qp::new(cfg),
                conn: None,
                connecting: false,
                info: None,
                destroyed: false,
                observer: None,
                close_kicked: false,
                app_passes: 0,
                watch_armed: 0,
                watch_takeovers: 0,
                watch_handbacks: 0,
                rx_takeovers: 0,
                rx_handbacks: 0,
                recv_posts: 0,
                tx_deferred: 0,
                rnr_wait: None,
            }),
            count: Mutex::new(count),
            _number: number,
            ras,
            failure: crate::availability::recovery::ErrorBlock::default(),
            end: markers::End::new(markers::Kind::Qp),
        });
        let tracked = track(&shared, qp_bytes(&attr.cap));
        if let Some(srq) = &shared.srq {
            srq.add_qp(&shared);
        }
        device.add_qp(&shared);
        shared.send_cq.add_qp(&shared);
        shared.recv_cq.add_qp(&shared);
        Ok(Self {
            shared,
            send_cq: attr.send_cq.clone(),
            recv_cq: attr.recv_cq.clone(),
            _ras: tracked,
        })
    }

    /// Moves this QP's bytes on the calling thread now: one non-blocking pass of receive,
    /// transmit and completions (the pass a busy-polled CQ's poll makes for its QPs).
    /// Returns `Ok(false)` at once when another thread is moving them right now (the
    /// progress thread, or a post's transmit pass): their completions follow as usual.
    ///
    /// For a thread that sleeps on the connection's socket ([`QueuePair::watch_socket`])
    /// rather than only on a completion channel: when the peer's bytes wake it, it moves
    /// them itself instead of waiting for the progress thread to move them and then signal
    /// the channel, one thread wake-up per message instead of two. The progress thread
    /// still watches the socket, so nothing depends on the caller.
    pub fn service(&self) -> Result<bool> {
        let _inside = self.shared.enter(Entry::Service)?;
        Ok(self.shared.busy_pass())
    }

    /// Adds the connection's TCP socket to the caller's epoll set `epfd` (readable,
    /// `EPOLLIN`, level-triggered, with `data`): a thread about to sleep until the peer
    /// sends can sleep on the set (beside its completion channel) and call
    /// [`QueuePair::service`] when it wakes. The socket stays the QP's: the kernel removes
    /// it from every epoll set when the QP closes it, so the set never holds a socket the
    /// QP no longer owns (nor keeps one open). [`Error::NotConnected`] without a connection.
    pub fn watch_socket(&self, epfd: BorrowedFd<'_>, data: u64) -> Result<()> {
        let g = self.shared.lock();
        let Some(conn) = g.conn.as_ref() else {
            return Err(Error::NotConnected);
        };
        crate::runtime::sys::epoll_add_readable(epfd, conn.stream.as_fd(), data)
            .map_err(|e| Error::io("epoll_ctl(EPOLL_CTL_ADD) of the connection's socket", e))
    }

    /// The QP number (reported in completions and events).
    pub fn qp_num(&self) -> u32 {
        self.shared.qp_num
    }

    /// Why the QP is in the Error state: its device's fault, the network that went away
    /// under its connection ("unexpected close"), or the engine's cause (a Terminate sent
    /// or received, the connection closed, the application's modify to Error). `None`
    /// while it has not failed (and after a reset).
    pub fn error_reason(&self) -> Option<crate::availability::recovery::QpErrorReason> {
        self.shared.failure.get()
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.shared.lock().qp.state()
    }

    /// Statistics counters of the QP.
    pub fn stats(&self) -> QpStats {
        *self.shared.lock().qp.stats()
    }

    /// What MPA negotiation settled, once connected.
    pub fn connection(&self) -> Option<ConnectionInfo> {
        self.shared.lock().info.clone()
    }

    /// The send CQ.
    pub fn send_cq(&self) -> &CompletionQueue {
        &self.send_cq
    }

    /// The receive CQ.
    pub fn recv_cq(&self) -> &CompletionQueue {
        &self.recv_cq
    }

    /// Posts a send work request (Send variants, RDMA Write, RDMA Read).
    ///
    /// Local SGEs are validated now; the data is sent at once on this thread as far as the
    /// socket takes it, the rest by the progress thread. A successful post completes later
    /// into the send CQ (always on error; on success when signalled or `sq_sig_all`). In the
    /// Error state the work request is accepted and completes with a flush status.
    pub fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        self.post_send_list(std::slice::from_ref(wr))
            .map_err(|(_, e)| e)
    }

    /// Posts several send work requests in order; stops at the first that fails and returns
    /// its index with the error (those before it are posted).
    ///
    /// The whole list is queued before anything is transmitted, so small messages leave in
    /// as few system calls as the socket allows (their FPDUs share a `sendmsg`).
    pub fn post_send_list(&self, wrs: &[SendWr<'_>]) -> Result<(), (usize, Error)> {
        self.post_sends(wrs.iter())
    }

    /// Posts the send work requests `wrs` yields, in order, as [`QueuePair::post_send_list`]
    /// posts a slice: all of them queued under one lock of the QP, then one transmit pass.
    /// For work requests made one at a time from another form (a C `ibv_send_wr` list, a
    /// ring of prebuilt descriptions), without collecting them into a slice first. Stops at
    /// the first that fails and returns its index with the error (those before it are
    /// posted); an iterator that ends early (say, at an input it cannot convert) posts what
    /// it yielded.
    ///
    /// The iterator runs with the QP locked and the STag table read-locked: it must not call
    /// into Softwarp (on this thread, that would deadlock), only build work requests.
    pub fn post_send_iter<'a>(
        &self,
        wrs: impl IntoIterator<Item = SendWr<'a>>,
    ) -> Result<(), (usize, Error)> {
        self.post_sends(wrs.into_iter())
    }

    /// As [`QueuePair::post_send_iter`], for work requests whose scatter/gather lists are
    /// borrowed ([`SendWrRef`]: a C `ibv_send_wr`'s `sg_list` used in place, no [`SendWr`]
    /// with its inline [`softwarp_engine::wr::SgList`] built in between); each element is
    /// copied once, into the send queue. A list longer than the QP's `max_send_sge` is
    /// refused as in the other posts.
    pub fn post_send_refs<'a>(
        &self,
        wrs: impl IntoIterator<Item = SendWrRef<'a>>,
    ) -> Result<(), (usize, Error)> {
        self.post_sends(wrs.into_iter())
    }

    /// [`QueuePair::post_send_list`], [`QueuePair::post_send_iter`] and
    /// [`QueuePair::post_send_refs`]: by reference, by value or borrowed, the same code.
    #[inline(always)]
    fn post_sends<W: SendItem>(&self, wrs: impl Iterator<Item = W>) -> Result<(), (usize, Error)> {
        let s = &self.shared;
        let _inside = s.enter(Entry::PostSend).map_err(|e| (0, e))?;
        let mut g = s.lock();
        if !g.qp.sq_guards_intact() {
            drop(g);
            return Err((0, s.markers_damaged("QueuePair::post_send")));
        }
        let inner = &mut *g;
        let mut failed = None;
        {
            let mrs = s.device.mrs_read();
            for (i, item) in wrs.enumerate() {
                let mut wr = item.wr();
                let r = match Self::check_send(s, &wr) {
                    // `sq_sig_all` makes an unsignaled WR signaled.
                    Ok(sig_all) => {
                        wr.signaled |= sig_all;
                        inner.qp.post_send_ref(wr, &mrs).map_err(Error::from)
                    }
                    Err(e) => Err(e),
                };
                if let Err(e) = r {
                    failed = Some((i, e));
                    break;
                }
            }
        }
        inner.app_passes = inner.app_passes.wrapping_add(1);
        let mut budget = usize::MAX;
        // Behind a full socket the work only queues (a write now would fail with EAGAIN):
        // the progress thread sends it on write readiness, or the next busy poll once the
        // socket has room.
        let waits_for_space = inner.conn.as_ref().is_some_and(|c| !c.wants_write());
        let tx = if waits_for_space {
            inner.tx_deferred += 1;
            TxEnd::Full
        } else {
            s.tx_pass(inner, &mut budget)
        };
        s.drain(inner);
        let kick = tx == TxEnd::Dead && inner.conn.is_some();
        drop(g);
        if kick {
            s.device.progress.kick(Arc::clone(s));
        }
        failed.map_or(Ok(()), Err)
    }

    /// Checks a send WR against the QP's capacities; true when `sq_sig_all` has to make it
    /// signaled. Inlined into both instances of `post_sends` (as it was into
    /// `post_send_list` when that was its one caller: 30 instructions per work request).
    #[inline(always)]
    fn check_send(s: &QpShared, wr: &SendWrRef<'_>) -> Result<bool> {
        softwarp_ras::sw_event!(Qp, 7, qpn = s.qp_num, wr_id = wr.wr_id, op = ?wr.op, "post_send");
        match wr.payload {
            PayloadRef::Sges(sges) if sges.len() > s.cap.max_send_sge => {
                return Err(Error::InvalidArgument(
                    "send work request has more SGEs than the QP's max_send_sge",
                ));
            }
            PayloadRef::Inline(b) if b.len() > s.cap.max_inline_data => {
                return Err(Error::InvalidArgument(
                    "inline data is longer than the QP's max_inline_data",
                ));
            }
            _ => {}
        }
        Ok(s.sq_sig_all && !wr.signaled)
    }

    /// Posts a receive work request to the QP's receive queue (not for QPs on an SRQ). Its
    /// SGEs are validated when a Send starts using it.
    pub fn post_recv(&self, wr: &RecvWr) -> Result<()> {
        self.post_recv_list(std::slice::from_ref(wr))
            .map_err(|(_, e)| e)
    }

    /// Posts several receive work requests in order under one lock of the QP; stops at the
    /// first that fails and returns its index with the error (those before it are posted).
    pub fn post_recv_list(&self, wrs: &[RecvWr]) -> Result<(), (usize, Error)> {
        self.post_recvs(wrs.iter())
    }

    /// Posts the receive work requests `wrs` yields, in order, as
    /// [`QueuePair::post_recv_list`] posts a slice (one lock of the QP), for work requests
    /// made one at a time from another form (a C `ibv_recv_wr` list). Stops at the first
    /// that fails and returns its index with the error; an iterator that ends early posts
    /// what it yielded.
    ///
    /// The iterator runs with the QP locked: it must not call into Softwarp (on this
    /// thread, that would deadlock), only build work requests.
    pub fn post_recv_iter(
        &self,
        wrs: impl IntoIterator<Item = RecvWr>,
    ) -> Result<(), (usize, Error)> {
        self.post_recvs(wrs.into_iter())
    }

    /// As [`QueuePair::post_recv_iter`], for work requests whose scatter/gather lists are
    /// borrowed ([`RecvWrRef`]: a C `ibv_recv_wr`'s `sg_list` used in place); the elements
    /// are copied once, into the receive queue.
    pub fn post_recv_refs<'a>(
        &self,
        wrs: impl IntoIterator<Item = RecvWrRef<'a>>,
    ) -> Result<(), (usize, Error)> {
        self.post_recvs(wrs.into_iter())
    }

    /// [`QueuePair::post_recv_list`], [`QueuePair::post_recv_iter`] and
    /// [`QueuePair::post_recv_refs`].
    #[inline(always)]
    fn post_recvs<W: RecvItem>(&self, wrs: impl Iterator<Item = W>) -> Result<(), (usize, Error)> {
        let s = &self.shared;
        let _inside = s.enter(Entry::PostRecv).map_err(|e| (0, e))?;
        let mut g = s.lock();
        if !g.qp.rq_guards_intact() {
            drop(g);
            return Err((0, s.markers_damaged("QueuePair::post_recv")));
        }
        let mut failed = None;
        for (i, wr) in wrs.enumerate() {
            softwarp_ras::sw_event!(Qp, 7, qpn = s.qp_num, wr_id = wr.wr_id(), "post_recv");
            let r = if wr.sge_count() > s.cap.max_recv_sge {
                Err(Error::InvalidArgument(
                    "receive work request has more SGEs than the QP's max_recv_sge",
                ))
            } else {
                wr.post_to(&mut g.qp).map_err(Error::from)
            };
            if let Err(e) = r {
                failed = Some((i, e));
                break;
            }
        }
        g.recv_posts = g.recv_posts.wrapping_add(1);
        s.drain(&mut g);
        // A Send held for a receive (the RNR wait) goes on: the progress thread reads the
        // socket again (a busy-polled QP's next poll does it anyway).
        if g.qp.rnr_waiting() {
            drop(g);
            s.resume_held();
        }
        failed.map_or(Ok(()), Err)
    }

    /// Sets how long a Send that finds no receive posted waits for one on this QP (the
    /// RNR wait; `None`: the stream fails at once), instead of the connection's
    /// [`ConnectOptions::rnr_wait`](crate::ConnectOptions::rnr_wait): for a connection to
    /// come, and at once for the one in place (a Send held now that may no longer wait
    /// fails). `ibv_modify_qp`'s `min_rnr_timer` and `rnr_retry` map to it in the C
    /// library.
    pub fn set_rnr_wait(&self, wait: Option<Duration>) -> Result<()> {
        let s = &self.shared;
        let _inside = s.enter(Entry::SetRnrWait)?;
        let mut g = s.lock();
        g.rnr_wait = Some(wait);
        let kick = g.conn.is_some() && {
            let held = g.qp.rnr_waiting();
            g.qp.set_rnr_wait(wait);
            held && !g.qp.rnr_waiting()
        };
        drop(g);
        if kick {
            s.device.progress.kick(Arc::clone(s));
        }
        Ok(())
    }

    /// True while the QP holds a Send that found no receive posted (the RNR wait): it
    /// reads nothing from its connection until a receive is posted or the wait ends, so
    /// its peer's later messages, and its close, are not seen meanwhile.
    pub fn rnr_waiting(&self) -> bool {
        self.shared.lock().qp.rnr_waiting()
    }

    /// The RNR wait of this QP's connection (or of the next one): its own
    /// ([`QueuePair::set_rnr_wait`]), else the connection's options'; `None` before a
    /// connection when the QP has none of its own.
    pub fn rnr_wait(&self) -> Option<Option<Duration>> {
        let g = self.shared.lock();
        if g.conn.is_some() {
            return Some(g.qp.timers().rnr_wait);
        }
        g.rnr_wait
    }

    /// Moves the QP to the Error state: outstanding work requests complete with
    /// `WrFlushErr`; from RTS a Terminate (local catastrophic error) is sent to the peer;
    /// then the connection closes.
    pub fn modify_to_error(&self) -> Result<()> {
        let _inside = self.shared.enter(Entry::ModifyToError)?;
        self.shared.set_error_and_kick();
        Ok(())
    }

    /// The protocol this QP carries above RDMAP (softwarp-sockets' stream, say) found its
    /// peer breaking that protocol (`detail` says how): the QP goes to Error as with
    /// [`QueuePair::modify_to_error`] (from RTS a Terminate tells the peer), with
    /// [`crate::availability::recovery::QpErrorReason::PeerViolation`] as its reason, a snapshot, and a
    /// `peer_violation` line in the error log that names the snapshot. A QP that failed
    /// before keeps its first reason, and then no line is written.
    pub fn fail_peer_violation(&self, detail: &str) -> Result<()> {
        let _inside = self.shared.enter(Entry::ModifyToError)?;
        self.shared.peer_violation(detail);
        Ok(())
    }

    /// Graceful close: no new sends; once outstanding work is done the connection closes,
    /// the receives still posted complete with [`crate::WcStatus::WrFlushErr`] and the QP is in
    /// Error ([`QueuePair::reset`] makes it Idle to connect again), on every connection
    /// path.
    pub fn disconnect(&self) -> Result<()> {
        let _inside = self.shared.enter(Entry::Disconnect)?;
        self.shared.disconnect()
    }

    /// Holds this side's close of the connection (its FIN) until the peer closed its side
    /// or `bound` passed, whatever closes it meanwhile: [`QueuePair::disconnect`], or
    /// dropping the QP (the connection outlives the handle until then). Returns at once; the
    /// device's progress thread ends the hold (the engine's clock), nobody sleeps. A later
    /// hold never lengthens an earlier one. True when a hold was set (the QP is connected
    /// and has not closed yet, and `bound` is above zero). Why:
    /// [`crate::cm::CloseOrder`].
    pub fn hold_close(&self, bound: Duration) -> bool {
        self.shared.hold_close(bound)
    }

    /// Resets a QP in the Error state whose connection is closed back to Idle (queues
    /// emptied without completions), so that it can be connected again.
    pub fn reset(&self) -> Result<()> {
        let _inside = self.shared.enter(Entry::Reset)?;
        self.shared.device.check_usable()?;
        let mut g = self.shared.lock();
        if g.conn.is_some() {
            return Err(Error::AlreadyConnected);
        }
        g.qp.modify(QpState::Idle)?;
        g.info = None;
        g.close_kicked = false;
        self.shared.failure.clear();
        Ok(())
    }

    /// Waits (at most `timeout`) until the connection is closed and the QP is no longer
    /// in RTS, Closing or Terminate.
    ///
    /// [`Error::WouldDeadlock`] on a thread where waiting would deadlock (the progress
    /// thread closes the connection: it cannot wait for itself).
    pub fn wait_closed(&self, timeout: Duration) -> Result<QpState> {
        crate::availability::context::check_wait("QueuePair::wait_closed", Some(timeout))?;
        let deadline = Deadline::after(timeout);
        loop {
            {
                let g = self.shared.lock();
                let st = g.qp.state();
                if g.conn.is_none() && matches!(st, QpState::Error | QpState::Idle) {
                    return Ok(st);
                }
            }
            if deadline.expired() {
                return Err(Error::Timeout(timeout));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    pub(crate) fn shared(&self) -> &Arc<QpShared> {
        &self.shared
    }

    /// Fault injection for RAS tests (not for applications): flips one of the QP's marker
    /// words, `begin`, `end`, or a ring guard (`sq.lo`, `sq.hi`, `rq.lo`, ... `events.hi`).
    /// The next entry point on the QP (or `Device::close`) sees the damage.
    #[doc(hidden)]
    pub fn damage_marker_for_testing(&self, which: &str) -> Result<()> {
        let s = &self.shared;
        match markers::ring_guard_name(which) {
            Some((ring, hi)) => {
                if s.lock().qp.damage_ring_guard(ring, hi) {
                    Ok(())
                } else {
                    Err(Error::InvalidArgument("no such ring"))
                }
            }
            None => markers::damage(&s.begin, &s.end, which),
        }
    }
}

/// Approximate memory of a QP: its shared state and its queues.
fn qp_bytes(cap: &QpCap) -> u64 {
    let wrs = cap.max_send_wr.saturating_add(cap.max_recv_wr);
    (std::mem::size_of::<QpShared>() + wrs.saturating_mul(std::mem::size_of::<SendWr<'_>>())) as u64
}

/// Fixed attributes `softwarp resources` shows for a QP.
fn qp_attrs(pd: &ProtectionDomain, attr: &QpInitAttr<'_>) -> crate::instrument::QpAttrs {
    crate::instrument::QpAttrs {
        pd: pd.id().0,
        send_cq: attr.send_cq.id().0,
        recv_cq: attr.recv_cq.id().0,
        srq: attr.srq.map(|s| s.id().0),
        sq_depth: attr.cap.max_send_wr,
        rq_depth: attr.cap.max_recv_wr,
    }
}

fn state_name(s: QpState) -> &'static str {
    match s {
        QpState::Idle => "Idle",
        QpState::Rts => "RTS",
        QpState::Closing => "Closing",
        QpState::Terminate => "Terminate",
        QpState::Error => "Error",
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        let s = &self.shared;
        // Counted while the device is open; a destroy always runs.
        let _inside = s.device.inflight.enter(Entry::DestroyQp).ok();
        let connected = {
            let mut g = s.lock();
            if let Some(o) = &g.observer {
                o.link_down(LinkDown::Destroyed);
            }
            g.qp.destroy();
            g.destroyed = true;
            s.drain(&mut g);
            g.conn.is_some()
        };
        if connected {
            // The progress thread sends the FIN, waits for the peer's, and lets go of the
            // QP.
            s.device.progress.kick(Arc::clone(s));
        }
        tracing::debug!(qp = s.qp_num, "QP destroyed");
    }
}

/// A send work request as the posts take it: owned, by reference or borrowed, each seen
/// as a [`SendWrRef`] (no copy of an inline SGL).
trait SendItem {
    fn wr(&self) -> SendWrRef<'_>;
}

impl SendItem for SendWr<'_> {
    #[inline(always)]
    fn wr(&self) -> SendWrRef<'_> {
        self.borrowed()
    }
}

impl<T: SendItem> SendItem for &T {
    #[inline(always)]
    fn wr(&self) -> SendWrRef<'_> {
        (**self).wr()
    }
}

impl SendItem for SendWrRef<'_> {
    #[inline(always)]
    fn wr(&self) -> SendWrRef<'_> {
        *self
    }
}

/// A receive work request as the posts take it: owned or by reference ([`RecvWr`], copied
/// into the receive queue whole) or borrowed ([`RecvWrRef`], its elements copied).
trait RecvItem {
    fn wr_id(&self) -> u64;
    fn sge_count(&self) -> usize;
    fn post_to(&self, qp: &mut Qp) -> std::result::Result<(), softwarp_engine::qp::QpError>;
}

impl RecvItem for RecvWr {
    #[inline(always)]
    fn wr_id(&self) -> u64 {
        self.wr_id
    }
    #[inline(always)]
    fn sge_count(&self) -> usize {
        self.sgl.len()
    }
    #[inline(always)]
    fn post_to(&self, qp: &mut Qp) -> std::result::Result<(), softwarp_engine::qp::QpError> {
        qp.post_recv_ref(self)
    }
}

impl<T: RecvItem> RecvItem for &T {
    #[inline(always)]
    fn wr_id(&self) -> u64 {
        (**self).wr_id()
    }
    #[inline(always)]
    fn sge_count(&self) -> usize {
        (**self).sge_count()
    }
    #[inline(always)]
    fn post_to(&self, qp: &mut Qp) -> std::result::Result<(), softwarp_engine::qp::QpError> {
        (**self).post_to(qp)
    }
}

impl RecvItem for RecvWrRef<'_> {
    #[inline(always)]
    fn wr_id(&self) -> u64 {
        self.wr_id
    }
    #[inline(always)]
    fn sge_count(&self) -> usize {
        self.sges.len()
    }
    #[inline(always)]
    fn post_to(&self, qp: &mut Qp) -> std::result::Result<(), softwarp_engine::qp::QpError> {
        qp.post_recv_borrowed(*self)
    }
}

/// Registers the QP (`#[track_caller]`: the application's `create_qp` line); it
/// describes its live state. The registration goes into the `QueuePair` handle.
#[track_caller]
fn track(qp: &Arc<QpShared>, bytes: u64) -> Tracked {
    let tracked = Tracked::new(
        &qp.device.ras.tracker,
        softwarp_ras::tracker::ResourceKind::Qp,
        u64::from(qp.qp_num()),
        bytes,
    );
    tracked.describe_with(
        Arc::downgrade(qp) as std::sync::Weak<dyn softwarp_ras::tracker::DescribeResource>
    );
    tracked
}
