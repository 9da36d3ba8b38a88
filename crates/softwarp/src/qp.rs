//! Queue pairs (after `ibv_qp`, reliable connected) and the data path that moves their bytes.
//!
//! The engine's [`Qp`] decides everything, including how bytes are staged, coalesced and
//! gated; this module only hands it the socket and wakes threads:
//!
//! - Receive (progress thread, or a busy-polling thread): [`Qp::recv_from`] with the socket
//!   as its reader (`readv` into the engine's target and the staging buffer), until EAGAIN.
//! - Transmit (the posting thread first, like siw's direct send; then the progress thread on
//!   write readiness): [`Qp::send_to`] with the socket as its writer (`sendmsg`), until there
//!   is nothing to send or the socket is full.
//! - After either: completions go to their CQs ([`Qp::poll_completion`]) and events to the
//!   device's event stream ([`Qp::poll_event`]).
//!
//! Locks: each QP has its own mutex; the STag table is locked only inside `post_send`
//! (validation) and by the receive steps that complete a header or an FPDU (placement
//! decisions, invalidation; the SRQ, if any, first), never across a system call. The order of all of them is the table in the crate
//! docs ("Locks").

use std::net::{Shutdown, SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mio::{Interest, Registry, Token};
use softwarp_engine::event::AsyncEvent;
use softwarp_engine::fault::Cause;
use softwarp_engine::mr::MrTable;
use softwarp_engine::qp::{
    Qp, QpConfig, QpState, ReadDest, ReadUntil, RecvEnd, RxResources, SendEnd, StreamConfig,
    TxPiece, VectoredRead, VectoredWrite,
};
use softwarp_engine::srq::Srq;
use softwarp_engine::stats::QpStats;
use softwarp_engine::wr::{Payload, RecvWr, SendWr};
use softwarp_ras::deadline::Deadline;

use crate::cm::negotiate::{Local, Negotiated};
use crate::cm::options::{ConnectOptions, ConnectionInfo, Role};
use crate::connect;
use crate::cq::{CompletionQueue, CqShared};
use crate::device::{lock, CountGuard, DeviceShared};
use crate::error::{Error, Result};
use crate::pd::ProtectionDomain;
use crate::srq::{SharedReceiveQueue, SrqShared};
use crate::sys;

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

/// How long a closing connection waits for the peer's FIN after sending its own.
const LINGER: Duration = Duration::from_secs(2);
/// Bytes one progress pass reads (or writes) for one QP before letting others run.
const PASS_BUDGET: usize = 1 << 20;
/// How often an armed write watchdog looks whether the application still busy-polls.
const WATCH_PERIOD: Duration = Duration::from_millis(5);

/// What a look at the write watchdog found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WatchLook {
    /// Not armed: a normal pass.
    NotArmed,
    /// The application polled since the last look: leave the pass to it.
    Polling,
    /// Nothing was left to send: the watchdog is off again, no pass.
    Disarmed,
    /// No poll since the last look: the progress thread takes over (now registered for
    /// write readiness).
    TakeOver,
}
/// Size of the staging buffer of threads that busy-poll.
pub(crate) const STAGE_LEN: usize = 64 * 1024;

thread_local! {
    /// The staging buffer of a busy-polling thread (allocated at its first poll).
    static STAGE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The batch buffer of a thread that transmits (the engine grows it to
    /// [`softwarp_engine::qp::BATCH_CAP`] once).
    static TX_BATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The socket of an established QP.
#[derive(Debug)]
pub(crate) struct Conn {
    stream: mio::net::TcpStream,
    token: Option<Token>,
    /// Registered for read readiness (false while a busy-poll CQ's thread reads).
    read_interest: bool,
    /// Registered with the poller at all (a busy-polled QP is not, until its socket fills
    /// up with bytes pending and the application stops polling, or it closes: no epoll
    /// wait-queue entry on its data path).
    polled: bool,
    /// Write watchdog of a busy-polled QP whose socket filled up with bytes pending: the
    /// application's pass count and the time of the progress thread's last look. Armed, the
    /// progress thread looks every few milliseconds; while the application keeps polling
    /// (which writes as the socket drains) it leaves the socket alone, and once it stops,
    /// the progress thread registers for write readiness and sends the rest itself.
    watch: Option<(u64, Instant)>,
    /// End of stream or error seen on the read side.
    read_closed: bool,
    /// A write failed (reset, broken pipe): nothing more can be sent.
    write_failed: bool,
    /// Our FIN was sent.
    shut_wr: bool,
    linger_until: Option<Instant>,
    /// Initiator: no FPDU goes out before this deadline ([`ConnectOptions::first_fpdu_delay`]
    /// on the connection manager's path; a delay the clock cannot represent holds until
    /// the QP fails). Posted work waits in the QP meanwhile; the progress thread retries on
    /// its timer (nobody sleeps).
    hold_until: Option<Deadline>,
    /// [`ConnectOptions::rx_stall_timeout`] (`None`: no limit).
    rx_stall: Option<Duration>,
    /// The progress thread's last stall look that found the peer in the middle of an FPDU:
    /// the stream bytes received by then, and when.
    stall_mark: Option<(u64, Instant)>,
}

impl Conn {
    /// Who writes the socket when it drains (the `tx_by` detail of `softwarp resources`):
    /// `progress` (registered with the progress thread's epoll for write readiness), `polls`
    /// (a busy-polled QP: the application's polls write), `polls+watchdog` (busy-polled with
    /// bytes pending behind a full socket: the progress thread takes over if the polls stop).
    fn tx_by(&self) -> &'static str {
        match (self.polled, self.watch.is_some()) {
            (true, _) => "progress",
            (false, false) => "polls",
            (false, true) => "polls+watchdog",
        }
    }
}

/// What the connection manager hears from a QP's connection (called with the QP locked:
/// implementations must not take a QP lock).
pub(crate) trait ConnObserver: Send + Sync + std::fmt::Debug {
    /// The connection is going away: first sign of why.
    fn link_down(&self, why: LinkDown);
    /// The socket is closed and the QP let go of it (after [`ConnObserver::link_down`]).
    fn closed(&self);
}

/// Why a connection went away, as the runtime sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LinkDown {
    /// The peer closed its side (end of stream).
    PeerClosed,
    /// A read or write failed (reset, broken pipe, ...).
    ConnectionLost,
    /// The QP had already failed (Terminate sent or received, moved to Error) when the
    /// connection went away.
    QpFailed,
    /// The QP was destroyed.
    Destroyed,
}

/// Everything [`QpShared::finish_connect`] needs besides the negotiation result.
#[derive(Debug)]
pub(crate) struct Establish<'a> {
    pub(crate) opts: &'a ConnectOptions,
    /// Connection manager hook (none for the minimal path).
    pub(crate) observer: Option<Arc<dyn ConnObserver>>,
    /// Hold FPDUs back until the initiator's first FPDU (RFC 5044 responder).
    pub(crate) gate: bool,
    /// Initiator: hold every FPDU back for this long after establishment (zero: none).
    pub(crate) hold: Duration,
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
}

/// What a progress pass left to do.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Pass {
    /// The budget ran out with more to read or write: service again soon.
    pub(crate) more: bool,
    /// Receive is blocked until completions are taken: retry after a short delay.
    pub(crate) retry: bool,
    /// Waiting for the peer's FIN (linger deadline): service again after a delay.
    pub(crate) lingering: bool,
    /// The connection is closed and deregistered: forget the QP.
    pub(crate) closed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RxEnd {
    /// The socket has nothing more (EAGAIN) or the QP does not read.
    Drained,
    /// Budget exhausted.
    More,
    /// The engine waits for completions to be taken.
    Blocked,
    /// End of stream or error.
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TxEnd {
    /// Nothing left to send.
    Idle,
    /// The socket is full; write readiness will resume.
    Full,
    /// Budget exhausted.
    More,
    /// The connection cannot send (closed, failed, not connected).
    Dead,
    /// Work is queued but the first-FPDU hold-off has not expired: retry on a timer.
    Held,
}

/// The SRQ and the device's STag table, locked when a receive commit first needs them and
/// let go before every read (see [`RxResources`]); the SRQ first, as the lock order says.
struct RxLocks<'a> {
    device: &'a DeviceShared,
    srq: Option<&'a SrqShared>,
    srq_guard: Option<MutexGuard<'a, Srq>>,
    mrs_guard: Option<std::sync::RwLockWriteGuard<'a, MrTable>>,
}

impl<'a> RxLocks<'a> {
    #[inline]
    fn new(device: &'a DeviceShared, srq: Option<&'a SrqShared>) -> Self {
        Self {
            device,
            srq,
            srq_guard: None,
            mrs_guard: None,
        }
    }
}

impl RxResources for RxLocks<'_> {
    #[inline(always)]
    fn get(&mut self) -> (&mut MrTable, Option<&mut Srq>) {
        if self.mrs_guard.is_none() {
            if let (Some(srq), None) = (self.srq, self.srq_guard.as_ref()) {
                self.srq_guard = Some(srq.lock());
            }
        }
        let device = self.device;
        let mrs = self.mrs_guard.get_or_insert_with(|| device.mrs_write());
        (mrs, self.srq_guard.as_deref_mut())
    }

    #[inline(always)]
    fn release(&mut self) {
        self.mrs_guard = None;
        self.srq_guard = None;
    }
}

/// The socket as the engine's reader and writer: `readv` into the engine's target and the
/// staging buffer, `sendmsg` of its gather lists ([`sys`]).
struct SockIo<'a> {
    fd: BorrowedFd<'a>,
    qp_num: u32,
}

impl<'a> SockIo<'a> {
    #[inline]
    fn new(fd: BorrowedFd<'a>, qp_num: u32) -> Self {
        Self { fd, qp_num }
    }
}

impl VectoredRead for SockIo<'_> {
    #[inline(always)]
    fn read_to(&mut self, dest: ReadDest<'_>, stage: &mut [u8]) -> std::io::Result<usize> {
        let r = match dest {
            ReadDest::Buffer(b) => sys::read_buf_staged(self.fd, b, stage),
            ReadDest::Region {
                region,
                offset,
                len,
            } => sys::read_region_staged(self.fd, region, offset, len, stage),
        };
        if let Ok(n) = r {
            softwarp_ras::sw_event!(Qp, 8, qpn = self.qp_num, bytes = n, "received");
        }
        r
    }
}

impl VectoredWrite for SockIo<'_> {
    #[inline(always)]
    fn write_from(&mut self, pieces: &[TxPiece<'_>]) -> std::io::Result<usize> {
        let r = sys::write_pieces(self.fd, pieces);
        if let Ok(n) = r {
            softwarp_ras::sw_event!(Qp, 8, qpn = self.qp_num, bytes = n, "sent");
        }
        r
    }
}

/// State shared between a [`QueuePair`] handle and the progress thread.
#[derive(Debug)]
pub(crate) struct QpShared {
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
    _number: crate::device::IdLease,
    /// Resource registration, state-change tracing, critical events, TCP_INFO.
    ras: crate::ras::QpRas,
}

impl Drop for QpShared {
    fn drop(&mut self) {
        lock(&self.count).release(&self.device.counts.qp);
    }
}

impl QpShared {
    fn lock(&self) -> MutexGuard<'_, QpInner> {
        lock(&self.inner)
    }

    /// Moves completions to the CQs and events to the device.
    fn drain(&self, inner: &mut QpInner) {
        // Most drains find nothing: ask before the (not inlined) polls. Send completions
        // first, as `Qp::poll_completion` orders them; each CQ locked once for its run.
        if inner.qp.has_completion() {
            let qp = &mut inner.qp;
            self.send_cq.push_all(|| qp.poll_send_completion());
            self.recv_cq.push_all(|| qp.poll_recv_completion());
        }
        while let Some(ev) = inner.qp.poll_event() {
            let fd = inner.conn.as_ref().map(|c| c.stream.as_fd());
            self.ras.on_event(&ev, &inner.qp, inner.info.as_ref(), fd);
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
        if let Some(srq) = &self.srq {
            srq.forward_event();
        }
        self.ras.state_seen(inner.qp.state());
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
        self.ras.snapshot(kind, reason, &g.qp, g.info.as_ref(), fd)
    }

    /// What RAS reports about the QP (resources, statistics); samples TCP_INFO when due.
    pub(crate) fn ras_view(&self) -> crate::ras::QpView {
        let g = self.lock();
        let fd = g.conn.as_ref().map(|c| c.stream.as_fd());
        let view = crate::ras::QpView::take(&self.ras, &g.qp, g.info.as_ref(), fd);
        let view = match &g.conn {
            Some(c) => view.with_attr("tx_by", c.tx_by()),
            None => view,
        };
        if g.watch_armed == 0 {
            return view;
        }
        let watchdog = format!("armed={},took_over={}", g.watch_armed, g.watch_takeovers);
        view.with_attr("watchdog", &watchdog)
    }

    /// Reads from the socket through [`Qp::recv_from`] (the engine places, stages and
    /// delivers), until EAGAIN, the budget is spent, or the stream ends; then turns how it
    /// ended into what the connection does.
    ///
    /// With `short_ok` (busy polls, which read again at the next poll anyway) a read that
    /// returns less than it asked for ends the pass. The progress thread reads until
    /// EAGAIN: its epoll is edge-triggered, and an end of stream queued behind the data of
    /// a short read would get no edge of its own.
    #[inline(always)]
    fn rx_pass(
        &self,
        inner: &mut QpInner,
        stage: &mut [u8],
        budget: &mut usize,
        short_ok: bool,
    ) -> RxEnd {
        let until = if short_ok {
            ReadUntil::ShortRead
        } else {
            ReadUntil::WouldBlock
        };
        let mut drained = false;
        loop {
            let QpInner { qp, conn, .. } = inner;
            let Some(conn) = conn.as_ref().filter(|c| !c.read_closed) else {
                return RxEnd::Closed;
            };
            let mut sock = SockIo::new(conn.stream.as_fd(), self.qp_num);
            let mut locks = RxLocks::new(&self.device, self.srq.as_deref());
            let end = qp.recv_from(&mut sock, stage, budget, until, &mut locks);
            drop(locks);
            match end {
                RecvEnd::Drained => return RxEnd::Drained,
                RecvEnd::Budget => return RxEnd::More,
                // The engine holds a header until completions are taken: move them to the
                // CQs and try once more.
                RecvEnd::Blocked if !drained => {
                    self.drain(inner);
                    drained = true;
                }
                RecvEnd::Blocked => return RxEnd::Blocked,
                RecvEnd::Eof => {
                    // Completions of what arrived before the close go out first.
                    self.drain(inner);
                    link_down(inner, LinkDown::PeerClosed);
                    return self.rx_closed(inner, "peer closed the connection");
                }
                RecvEnd::Failed(e) => {
                    tracing::debug!(qp = self.qp_num, error = %e, "read failed");
                    link_down(inner, LinkDown::ConnectionLost);
                    return self.rx_closed(inner, "connection failed (read)");
                }
                RecvEnd::Bug(why) => {
                    tracing::error!(qp = self.qp_num, why, "receive stopped");
                    return self.rx_closed(inner, why);
                }
            }
        }
    }

    /// [`QpShared::rx_pass`] with a small buffer of its own, for a thread whose staging
    /// buffer is in use (kept out of line: it never runs today).
    #[cold]
    #[inline(never)]
    fn rx_pass_unstaged(&self, inner: &mut QpInner, budget: &mut usize) -> RxEnd {
        self.rx_pass(inner, &mut [0u8; 512], budget, true)
    }

    fn rx_closed(&self, inner: &mut QpInner, why: &'static str) -> RxEnd {
        tracing::debug!(qp = self.qp_num, why, "receive side closed");
        if let Some(conn) = inner.conn.as_mut() {
            conn.read_closed = true;
        }
        inner.qp.handle_llp_closed();
        RxEnd::Closed
    }

    /// Writes what the engine has to send through [`Qp::send_to`], until it has nothing,
    /// the socket is full, or the budget is spent. Small FPDUs are coalesced into the
    /// calling thread's batch buffer (one `sendmsg` for many); larger ones are gathered
    /// straight from registered memory.
    fn tx_pass(&self, inner: &mut QpInner, budget: &mut usize) -> TxEnd {
        // Re-entered from inside a pass (not possible today): no coalescing.
        let end = TX_BATCH.with(|b| {
            let mut batch = b.try_borrow_mut().ok();
            self.tx_pass_with(inner, budget, batch.as_deref_mut())
        });
        if end == TxEnd::Full {
            self.arm_watchdog(inner);
        }
        end
    }

    #[inline(always)]
    fn tx_pass_with(
        &self,
        inner: &mut QpInner,
        budget: &mut usize,
        batch: Option<&mut Vec<u8>>,
    ) -> TxEnd {
        let QpInner { qp, conn, .. } = inner;
        let Some(conn) = conn.as_mut() else {
            return TxEnd::Dead;
        };
        if conn.write_failed || conn.shut_wr {
            return TxEnd::Dead;
        }
        if let Some(t) = conn.hold_until {
            // Linux siw as responder installs its FPDU receive path only after sending
            // its Reply: see `ConnectOptions::first_fpdu_delay`. Once the QP failed,
            // the Terminate is let through.
            if t.expired() || !matches!(qp.state(), QpState::Rts | QpState::Closing) {
                conn.hold_until = None;
            } else if qp.is_drained() {
                return TxEnd::Idle;
            } else {
                return TxEnd::Held;
            }
        }
        let mut sock = SockIo::new(conn.stream.as_fd(), self.qp_num);
        match qp.send_to(&mut sock, batch, budget) {
            SendEnd::Idle => TxEnd::Idle,
            SendEnd::Full => TxEnd::Full,
            SendEnd::Budget => TxEnd::More,
            SendEnd::Failed(e) => {
                tracing::debug!(qp = self.qp_num, error = %e, "connection failed (write)");
                conn.write_failed = true;
                link_down(inner, LinkDown::ConnectionLost);
                inner.qp.handle_llp_closed();
                TxEnd::Dead
            }
            SendEnd::Bug(why) => {
                tracing::error!(qp = self.qp_num, why, "transmit stopped");
                TxEnd::Dead
            }
        }
    }

    /// Closes the connection once the QP is finished with it: FIN after the last byte
    /// (the Terminate, if one is queued), then the peer's FIN or the linger deadline.
    /// Returns (closed, lingering).
    fn maybe_close(&self, inner: &mut QpInner, registry: &Registry, tx: TxEnd) -> (bool, bool) {
        let state = inner.qp.state();
        let drained = inner.qp.is_drained();
        let Some(conn) = inner.conn.as_mut() else {
            return (true, false);
        };
        let finished = inner.destroyed
            || matches!(state, QpState::Error | QpState::Idle)
            || (state == QpState::Closing && drained);
        if !finished {
            return (false, false);
        }
        let now = Instant::now();
        if !conn.shut_wr && (tx == TxEnd::Idle || conn.write_failed || tx == TxEnd::Dead) {
            let _ = conn.stream.shutdown(Shutdown::Write);
            conn.shut_wr = true;
            conn.linger_until = Deadline::after_from(now, LINGER).instant();
            tracing::debug!(qp = self.qp_num, ?state, "connection: FIN sent");
        }
        let expired = conn.linger_until.is_some_and(|t| now >= t);
        if conn.shut_wr && (conn.read_closed || expired) {
            let _ = registry.deregister(&mut conn.stream);
            inner.conn = None;
            tracing::debug!(qp = self.qp_num, ?state, "connection closed");
            self.connection_gone(inner);
            return (true, false);
        }
        (false, conn.shut_wr)
    }

    /// One full progress pass (progress thread).
    pub(crate) fn service(&self, registry: &Registry, scratch: &mut [u8]) -> Pass {
        let mut g = self.lock();
        let inner = &mut *g;
        let state = inner.qp.state();
        if inner.conn.is_none() {
            return Pass {
                closed: true,
                ..Pass::default()
            };
        }
        if state == QpState::Rts && !inner.close_kicked {
            match self.watchdog(inner, registry) {
                // The application polls: its passes move the bytes; look again later.
                WatchLook::Polling => {
                    return Pass {
                        retry: true,
                        ..Pass::default()
                    }
                }
                WatchLook::Disarmed => return Pass::default(),
                WatchLook::NotArmed | WatchLook::TakeOver => {}
            }
        }
        let Some(conn) = inner.conn.as_mut() else {
            return Pass {
                closed: true,
                ..Pass::default()
            };
        };
        if !conn.read_interest && (inner.close_kicked || state != QpState::Rts) {
            // A busy-polled QP that is closing: the progress thread takes the reading
            // over, since nobody may poll its CQ any more.
            if let Some(token) = conn.token {
                let both = Interest::READABLE | Interest::WRITABLE;
                let r = if conn.polled {
                    registry.reregister(&mut conn.stream, token, both)
                } else {
                    registry.register(&mut conn.stream, token, both)
                };
                if r.is_ok() {
                    conn.read_interest = true;
                    conn.polled = true;
                }
            }
        }
        let mut budget = PASS_BUDGET;
        let rx = self.rx_pass(inner, scratch, &mut budget, false);
        let mut budget = PASS_BUDGET;
        let tx = self.tx_pass(inner, &mut budget);
        self.drain(inner);
        self.ras
            .sample_tcp(inner.conn.as_ref().map(|c| c.stream.as_fd()));
        let (closed, lingering) = self.maybe_close(inner, registry, tx);
        if !closed && tx == TxEnd::Idle {
            self.return_to_polls(inner, registry);
        }
        Pass {
            more: !closed && (rx == RxEnd::More || tx == TxEnd::More),
            retry: !closed && (rx == RxEnd::Blocked || tx == TxEnd::Held),
            lingering,
            closed,
        }
    }

    /// Busy poll (on the thread polling a busy-poll CQ): one non-blocking pass of
    /// receive, transmit and completions, unless another thread holds the QP. When the
    /// connection needs closing, the progress thread is asked to do it (it owns the
    /// poller registration).
    pub(crate) fn poll_pass(self: &Arc<Self>) {
        let mut g = match self.inner.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        let inner = &mut *g;
        if inner.conn.is_none() || inner.close_kicked {
            return;
        }
        inner.app_passes = inner.app_passes.wrapping_add(1);
        let mut budget = PASS_BUDGET;
        let rx = STAGE.with(|stage| match stage.try_borrow_mut() {
            Ok(mut stage) => {
                if stage.len() < STAGE_LEN {
                    stage.resize(STAGE_LEN, 0);
                }
                self.rx_pass(inner, &mut stage, &mut budget, true)
            }
            // Re-entered from inside a pass (not possible today): a small buffer.
            Err(_) => self.rx_pass_unstaged(inner, &mut budget),
        });
        let mut budget = PASS_BUDGET;
        let _ = self.tx_pass(inner, &mut budget);
        self.drain(inner);
        let finished = rx == RxEnd::Closed || inner.qp.state() != QpState::Rts;
        if finished {
            inner.close_kicked = true;
            drop(g);
            self.device.progress.kick(Arc::clone(self));
        }
    }

    /// Registers the connection with the progress thread's poller. A QP whose receive CQ
    /// is in busy-poll mode is not registered yet: the polling thread reads and writes, and
    /// the socket joins the poller only when it fills up with bytes pending (for write
    /// readiness: completed sends must reach the wire even if nobody polls) or when the QP
    /// closes.
    pub(crate) fn register(&self, registry: &Registry, token: Token) -> bool {
        let busy = self
            .recv_cq
            .busy_poll
            .load(std::sync::atomic::Ordering::Relaxed);
        let mut g = self.lock();
        let Some(conn) = g.conn.as_mut() else {
            return false;
        };
        conn.token = Some(token);
        if busy {
            return true;
        }
        let interest = Interest::READABLE | Interest::WRITABLE;
        match registry.register(&mut conn.stream, token, interest) {
            Ok(()) => {
                conn.read_interest = true;
                conn.polled = true;
                true
            }
            Err(e) => {
                tracing::error!(qp = self.qp_num, error = %e, "epoll registration failed");
                conn.read_closed = true;
                conn.write_failed = true;
                g.qp.handle_llp_closed();
                self.drain(&mut g);
                // Not registered: close here.
                g.conn = None;
                self.connection_gone(&mut g);
                false
            }
        }
    }

    /// A busy-polled QP whose socket is full with bytes pending: the application's polls
    /// write the rest as the socket drains, as long as it polls. Arms the write watchdog
    /// (once): the progress thread looks in a few milliseconds and takes over if the
    /// polls stopped ([`QpShared::watchdog`]). Registering for write readiness at once
    /// instead would wake the progress thread at every drain of a busy socket, a third
    /// thread competing with the polling ones for the cores.
    fn arm_watchdog(&self, inner: &mut QpInner) {
        let Some(conn) = inner.conn.as_mut() else {
            return;
        };
        if conn.polled || conn.watch.is_some() {
            return;
        }
        conn.watch = Some((inner.app_passes, Instant::now()));
        inner.watch_armed += 1;
        // Not registered with the progress thread yet (it has not taken the QP's Register
        // command): it services the QP, and so looks at the watchdog, when it does.
        if let Some(token) = conn.token {
            self.device.progress.watch(token);
        }
    }

    /// The progress thread's look at the write watchdog (see [`Conn::watch`]): `Polling`
    /// while the application's passes go on (the pass is left to them), `Disarmed` once
    /// nothing is left to send, `TakeOver` after a look at least [`WATCH_PERIOD`] after the
    /// previous one finds no pass in between (the socket is then registered for write
    /// readiness and the progress thread does the pass itself), `NotArmed` otherwise.
    fn watchdog(&self, inner: &mut QpInner, registry: &Registry) -> WatchLook {
        let polls = inner.app_passes;
        let idle = !inner.qp.wants_tx();
        let Some(conn) = inner.conn.as_mut() else {
            return WatchLook::TakeOver;
        };
        let Some((seen, at)) = conn.watch else {
            return WatchLook::NotArmed;
        };
        if idle {
            // The polls sent everything: nothing to watch until the socket fills again.
            conn.watch = None;
            return WatchLook::Disarmed;
        }
        let now = Instant::now();
        if now.duration_since(at) < WATCH_PERIOD {
            return WatchLook::Polling;
        }
        if polls != seen {
            conn.watch = Some((polls, now));
            return WatchLook::Polling;
        }
        conn.watch = None;
        inner.watch_takeovers += 1;
        if let Some(token) = conn.token.filter(|_| !conn.polled) {
            match registry.register(&mut conn.stream, token, Interest::WRITABLE) {
                Ok(()) => conn.polled = true,
                Err(e) => {
                    tracing::error!(qp = self.qp_num, error = %e, "epoll registration failed")
                }
            }
        }
        tracing::debug!(
            qp = self.qp_num,
            "busy polls stopped: the progress thread writes"
        );
        WatchLook::TakeOver
    }

    /// A busy-polled QP whose socket the progress thread wrote after the polls had stopped
    /// (see [`QpShared::watchdog`]) and which has nothing left to send: its socket leaves the
    /// poller again, so that when the application polls again, the progress thread does not
    /// wake at every drain; the next full socket arms the watchdog again.
    fn return_to_polls(&self, inner: &mut QpInner, registry: &Registry) {
        if inner.qp.state() != QpState::Rts || inner.close_kicked || inner.qp.wants_tx() {
            return;
        }
        let Some(conn) = inner.conn.as_mut() else {
            return;
        };
        if conn.polled && !conn.read_interest && registry.deregister(&mut conn.stream).is_ok() {
            conn.polled = false;
        }
    }

    /// The receive stall timeout of the connection, if it has one.
    pub(crate) fn rx_stall_timeout(&self) -> Option<Duration> {
        self.lock().conn.as_ref().and_then(|c| c.rx_stall)
    }

    /// The progress thread's receive stall look ([`ConnectOptions::rx_stall_timeout`]): a
    /// peer found in the middle of an FPDU, with no byte received since a look at least the
    /// timeout ago, gets its stream terminated. Returns true then (the QP needs a pass to
    /// close). Skips a QP another thread holds: that thread is moving its bytes.
    pub(crate) fn check_rx_stall(&self, now: Instant) -> bool {
        let mut g = match self.inner.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        let inner = &mut *g;
        let Some(conn) = inner.conn.as_mut() else {
            return false;
        };
        let Some(limit) = conn.rx_stall else {
            return false;
        };
        if !inner.qp.rx_in_fpdu() {
            conn.stall_mark = None;
            return false;
        }
        let bytes = inner.qp.stats().rx_stream_bytes;
        match conn.stall_mark {
            Some((seen, since)) if seen == bytes => {
                if now.saturating_duration_since(since) < limit {
                    return false;
                }
            }
            _ => {
                conn.stall_mark = Some((bytes, now));
                return false;
            }
        }
        tracing::warn!(
            qp = self.qp_num,
            timeout = ?limit,
            "the peer stopped in the middle of an FPDU: stream terminated"
        );
        inner.qp.handle_rx_stall();
        let mut budget = PASS_BUDGET;
        let _ = self.tx_pass(inner, &mut budget);
        self.drain(inner);
        true
    }

    /// Moves the QP to Error (a Terminate is queued when it was in RTS), for device and CQ
    /// errors.
    pub(crate) fn set_error(&self) {
        let mut g = self.lock();
        let _ = g.qp.modify(QpState::Error);
        let mut budget = PASS_BUDGET;
        let _ = self.tx_pass(&mut g, &mut budget);
        self.drain(&mut g);
    }

    /// [`QpShared::set_error`], then has the progress thread close the connection.
    pub(crate) fn set_error_and_kick(self: &Arc<Self>) {
        self.set_error();
        self.device.progress.kick(Arc::clone(self));
    }

    pub(crate) fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The connection is closed: a connection-manager QP also flushes the receives a
    /// graceful close left posted (as siw does on close), then its observer hears of it.
    fn connection_gone(&self, inner: &mut QpInner) {
        if inner.observer.is_none() {
            return;
        }
        // The peer never closed its side (the linger time ran out): the stream is over all
        // the same.
        if matches!(inner.qp.state(), QpState::Closing | QpState::Terminate) {
            inner.qp.handle_llp_closed();
        }
        if inner.qp.state() == QpState::Idle && !inner.destroyed {
            let _ = inner.qp.modify(QpState::Error);
        }
        // With the observer still set, a link-closed fatal event stays out of the device's
        // stream.
        self.drain(inner);
        if let Some(o) = inner.observer.take() {
            o.closed();
        }
    }

    /// Abortive close: the connection is reset at once (`SO_LINGER` 0, no Terminate, no
    /// FIN) and the QP goes to Error, flushing its work requests.
    pub(crate) fn abort_connection(self: &Arc<Self>) -> Result<()> {
        {
            let mut g = self.lock();
            let inner = &mut *g;
            let Some(conn) = inner.conn.take() else {
                return Err(Error::NotConnected);
            };
            if let Err(e) = sys::set_linger_zero(conn.stream.as_fd()) {
                tracing::debug!(qp = self.qp_num, error = %e, "SO_LINGER 0 failed");
            }
            // Closing the descriptor also removes it from the progress thread's epoll.
            drop(conn);
            inner.qp.handle_llp_closed();
            self.drain(inner);
            self.connection_gone(inner);
        }
        // The progress thread forgets the QP on its next pass.
        self.device.progress.kick(Arc::clone(self));
        Ok(())
    }

    /// Graceful close: RTS to Closing (no new sends; outstanding work drains), then the
    /// connection closes. Nothing to do in Closing or Error.
    pub(crate) fn disconnect(self: &Arc<Self>) -> Result<()> {
        {
            let mut g = self.lock();
            match g.qp.state() {
                QpState::Rts => g.qp.modify(QpState::Closing)?,
                QpState::Closing | QpState::Error | QpState::Terminate => {}
                other => {
                    return Err(Error::Qp(softwarp_engine::qp::QpError::InvalidState {
                        op: "disconnect",
                        state: other,
                    }))
                }
            }
        }
        self.device.progress.kick(Arc::clone(self));
        Ok(())
    }

    /// Claims an Idle QP for a connection attempt.
    pub(crate) fn begin_connect(&self) -> Result<()> {
        let mut g = self.lock();
        if g.destroyed {
            return Err(Error::Qp(softwarp_engine::qp::QpError::Destroyed));
        }
        if g.conn.is_some() || g.connecting {
            return Err(Error::AlreadyConnected);
        }
        let st = g.qp.state();
        if st != QpState::Idle {
            return Err(Error::NotIdle(state_name(st)));
        }
        g.connecting = true;
        Ok(())
    }

    /// Ends a connection attempt that failed before [`QpShared::finish_connect`].
    pub(crate) fn abandon_connect(&self) {
        self.lock().connecting = false;
    }

    /// The QP's read queue limits under `opts`.
    pub(crate) fn local_params(&self, opts: &ConnectOptions) -> Result<Local> {
        let g = self.lock();
        let cfg = g.qp.config();
        Local::new(cfg.max_ird, cfg.max_ord, opts)
    }

    /// Second half of connect/accept: establishes the engine QP on the negotiated stream
    /// and hands the socket to the progress thread.
    pub(crate) fn finish_connect(
        self: &Arc<Self>,
        result: Result<(std::net::TcpStream, Negotiated)>,
        est: Establish<'_>,
    ) -> Result<ConnectionInfo> {
        let s = self;
        let (stream, neg) = match result {
            Ok(v) => v,
            Err(e) => {
                s.lock().connecting = false;
                return Err(e);
            }
        };
        let prepared = prepare_stream(stream, est.opts, &neg, est.gate);
        let mut g = s.lock();
        g.connecting = false;
        let (stream, info, cfg) = prepared?;
        if g.destroyed {
            return Err(Error::Qp(softwarp_engine::qp::QpError::Destroyed));
        }
        g.qp.establish(cfg)?;
        g.conn = Some(Conn {
            stream,
            token: None,
            read_interest: false,
            polled: false,
            watch: None,
            read_closed: false,
            write_failed: false,
            shut_wr: false,
            linger_until: None,
            hold_until: (neg.role == Role::Initiator && !est.hold.is_zero())
                .then(|| Deadline::after(est.hold)),
            rx_stall: (est.opts.rx_stall_timeout != Duration::MAX)
                .then_some(est.opts.rx_stall_timeout),
            stall_mark: None,
        });
        g.info = Some(info.clone());
        g.observer = est.observer;
        // Anything already queued (an RFC 6581 RTR) goes out now.
        let mut budget = usize::MAX;
        let _ = s.tx_pass(&mut g, &mut budget);
        s.drain(&mut g);
        drop(g);
        s.ras.connected(&info);
        if let Err(e) = s.device.progress.register(Arc::clone(s)) {
            // Nobody would ever move this QP's bytes: fail the connection now.
            let mut g = s.lock();
            g.observer = None;
            g.qp.handle_llp_closed();
            g.conn = None;
            s.drain(&mut g);
            return Err(e);
        }
        Ok(info)
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
    _ras: crate::ras::Tracked,
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
        let ras = crate::ras::QpRas::new(device, qp_num, qp_attrs(pd, attr));
        let shared = Arc::new(QpShared {
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
            }),
            count: Mutex::new(count),
            _number: number,
            ras,
        });
        let tracked = crate::ras::QpRas::track(&shared, qp_bytes(&attr.cap));
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

    /// The QP number (reported in completions and events).
    pub fn qp_num(&self) -> u32 {
        self.shared.qp_num
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
        let s = &self.shared;
        let mut g = s.lock();
        let inner = &mut *g;
        let mut failed = None;
        {
            let mrs = s.device.mrs_read();
            for (i, wr) in wrs.iter().enumerate() {
                let r = match Self::check_send(s, wr) {
                    // `sq_sig_all` makes an unsignaled WR signaled: only then a copy.
                    Ok(true) => {
                        let mut wr = *wr;
                        wr.signaled = true;
                        inner.qp.post_send(&wr, &mrs).map_err(Error::from)
                    }
                    Ok(false) => inner.qp.post_send(wr, &mrs).map_err(Error::from),
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
        let tx = s.tx_pass(inner, &mut budget);
        s.drain(inner);
        // A held connection (first-FPDU hold-off) is retried by the progress thread.
        let kick = (tx == TxEnd::Dead && inner.conn.is_some()) || tx == TxEnd::Held;
        drop(g);
        if kick {
            s.device.progress.kick(Arc::clone(s));
        }
        failed.map_or(Ok(()), Err)
    }

    /// Checks a send WR against the QP's capacities; true when `sq_sig_all` has to make it
    /// signaled.
    fn check_send(s: &QpShared, wr: &SendWr<'_>) -> Result<bool> {
        softwarp_ras::sw_event!(Qp, 7, qpn = s.qp_num, wr_id = wr.wr_id, op = ?wr.op, "post_send");
        match &wr.payload {
            Payload::Sgl(sgl) if sgl.len() > s.cap.max_send_sge => {
                return Err(Error::InvalidArgument(
                    "send work request has more SGEs than the QP's max_send_sge",
                ));
            }
            Payload::Inline(b) if b.len() > s.cap.max_inline_data => {
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
        let s = &self.shared;
        let mut g = s.lock();
        let mut failed = None;
        for (i, wr) in wrs.iter().enumerate() {
            softwarp_ras::sw_event!(Qp, 7, qpn = s.qp_num, wr_id = wr.wr_id, "post_recv");
            let r = if wr.sgl.len() > s.cap.max_recv_sge {
                Err(Error::InvalidArgument(
                    "receive work request has more SGEs than the QP's max_recv_sge",
                ))
            } else {
                g.qp.post_recv_ref(wr).map_err(Error::from)
            };
            if let Err(e) = r {
                failed = Some((i, e));
                break;
            }
        }
        s.drain(&mut g);
        failed.map_or(Ok(()), Err)
    }

    /// Moves the QP to the Error state: outstanding work requests complete with
    /// `WrFlushErr`; from RTS a Terminate (local catastrophic error) is sent to the peer;
    /// then the connection closes.
    pub fn modify_to_error(&self) -> Result<()> {
        self.shared.set_error_and_kick();
        Ok(())
    }

    /// Graceful close: no new sends; once outstanding work is done the connection closes.
    pub fn disconnect(&self) -> Result<()> {
        self.shared.disconnect()
    }

    /// Resets a QP in the Error state whose connection is closed back to Idle (queues
    /// emptied without completions), so that it can be connected again.
    pub fn reset(&self) -> Result<()> {
        let mut g = self.shared.lock();
        if g.conn.is_some() {
            return Err(Error::AlreadyConnected);
        }
        g.qp.modify(QpState::Idle)?;
        g.info = None;
        g.close_kicked = false;
        Ok(())
    }

    /// Waits (at most `timeout`) until the connection is closed and the QP is no longer
    /// in RTS, Closing or Terminate.
    pub fn wait_closed(&self, timeout: Duration) -> Result<QpState> {
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

    /// Connects to a listening peer (`addr`) and performs the MPA Request/Reply exchange
    /// (RFC 5044 section 7.1, RFC 6581) on this thread, then moves the QP to RTS. The QP
    /// must be Idle; post receives first if the peer may send at once. The connection
    /// manager ([`crate::CmEventChannel::connect`]) does the same asynchronously, with
    /// events.
    pub fn connect<A: ToSocketAddrs>(
        &self,
        addr: A,
        opts: &ConnectOptions,
    ) -> Result<ConnectionInfo> {
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| Error::io("resolve address", e))?
            .collect();
        let local = self.shared.local_params(opts)?;
        self.shared.begin_connect()?;
        let result = connect::initiate(&addrs, opts, &local);
        self.shared.finish_connect(
            result,
            Establish {
                opts,
                observer: None,
                gate: false,
                // `connect::initiate` already waited `first_fpdu_delay` after the Reply.
                hold: Duration::ZERO,
            },
        )
    }

    pub(crate) fn shared(&self) -> &Arc<QpShared> {
        &self.shared
    }
}

/// Tells the connection manager (if it manages the QP) that the connection went away.
fn link_down(inner: &QpInner, why: LinkDown) {
    if let Some(o) = &inner.observer {
        let failed = matches!(inner.qp.state(), QpState::Error | QpState::Terminate);
        o.link_down(if failed { LinkDown::QpFailed } else { why });
    }
}

/// Approximate memory of a QP: its shared state and its queues.
fn qp_bytes(cap: &QpCap) -> u64 {
    let wrs = cap.max_send_wr.saturating_add(cap.max_recv_wr);
    (std::mem::size_of::<QpShared>() + wrs.saturating_mul(std::mem::size_of::<SendWr<'_>>())) as u64
}

/// Fixed attributes `softwarp resources` shows for a QP.
fn qp_attrs(
    pd: &ProtectionDomain,
    attr: &QpInitAttr<'_>,
) -> std::collections::BTreeMap<String, String> {
    crate::ras::attrs([
        ("pd", pd.id().0.to_string()),
        ("send_cq", attr.send_cq.id().0.to_string()),
        ("recv_cq", attr.recv_cq.id().0.to_string()),
        (
            "srq",
            attr.srq
                .map_or_else(|| "-".to_string(), |s| s.id().0.to_string()),
        ),
        ("sq_depth", attr.cap.max_send_wr.to_string()),
        ("rq_depth", attr.cap.max_recv_wr.to_string()),
    ])
}

/// Switches the negotiated socket to non-blocking mode and derives the stream parameters.
fn prepare_stream(
    stream: std::net::TcpStream,
    opts: &ConnectOptions,
    neg: &Negotiated,
    gate: bool,
) -> Result<(mio::net::TcpStream, ConnectionInfo, StreamConfig)> {
    stream
        .set_nodelay(true)
        .map_err(|e| Error::io("set TCP_NODELAY", e))?;
    stream
        .set_read_timeout(None)
        .map_err(|e| Error::io("clear socket timeout", e))?;
    stream
        .set_write_timeout(None)
        .map_err(|e| Error::io("clear socket timeout", e))?;
    stream
        .set_nonblocking(true)
        .map_err(|e| Error::io("set O_NONBLOCK", e))?;
    let mss = sys::tcp_maxseg(stream.as_fd()).map_err(|e| Error::io("getsockopt TCP_MAXSEG", e))?;
    let local_addr = stream
        .local_addr()
        .map_err(|e| Error::io("getsockname", e))?;
    let peer_addr = stream
        .peer_addr()
        .map_err(|e| Error::io("getpeername", e))?;
    let max_fpdu_len = connect::fpdu_len_for(opts.max_fpdu_len.unwrap_or(mss));
    let cfg = StreamConfig {
        crc: neg.crc,
        markers: false,
        //= https://www.rfc-editor.org/rfc/rfc5044#section-4.3
        // (paraphrase) Markers are placed relative to the start of each direction's FPDU
        // stream, the first octet after the MPA Request (initiator to responder) or the
        // MPA Reply (responder to initiator): both streams start at offset 0.
        markers_tx: neg.markers_tx,
        markers_rx: neg.markers_rx,
        tx_stream_offset: 0,
        rx_stream_offset: 0,
        max_fpdu_len,
        max_rx_ulpdu: softwarp_wire::mpa::fpdu::MAX_ULPDU_LEN,
        ird: neg.ird,
        ord: neg.ord,
        terminate_layout: opts.terminate_layout,
        rtr: neg.rtr,
        rfc7306: opts.rfc7306,
        responder_waits: gate && neg.role == Role::Responder,
    };
    let info = ConnectionInfo {
        local_addr,
        peer_addr,
        role: neg.role,
        revision: neg.revision,
        crc: neg.crc,
        markers_tx: neg.markers_tx,
        markers_rx: neg.markers_rx,
        ird: neg.ird,
        ord: neg.ord,
        peer_ird_ord: neg.peer_ird_ord,
        rtr: neg.rtr.map(|r| r.kind),
        mss,
        max_fpdu_len,
        peer_private_data: neg.peer_private_data.clone(),
    };
    Ok((mio::net::TcpStream::from_std(stream), info, cfg))
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
