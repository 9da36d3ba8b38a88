//! Queue pairs (after `ibv_qp`, reliable connected) and the data path that moves their bytes.
//!
//! The engine's [`Qp`] decides everything; this module only moves bytes and wakes threads:
//!
//! - Receive (progress thread): loop [`Qp::rx_target`] → `readv` straight into the target
//!   (a header buffer inside the QP, or the destination region: no staging copy) →
//!   [`Qp::rx_commit`], until the socket has nothing more (`EAGAIN`).
//! - Transmit (the posting thread first, like siw's direct send; then the progress thread on
//!   write readiness): loop [`Qp::poll_tx`] → `writev` of the gather pieces →
//!   [`Qp::tx_commit`], until there is nothing to send or the socket is full.
//! - After either: completions go to their CQs ([`Qp::poll_completion`]) and events to the
//!   device's event stream ([`Qp::poll_event`]).
//!
//! Locks: each QP has its own mutex; the STag table is locked only inside `post_send`
//! (validation) and those `rx_commit`s that complete a header or an FPDU (placement
//! decisions, invalidation), never across a system call; an SRQ's lock is taken inside
//! `rx_commit` of the QPs that share it. The order of all of them is the table in the crate
//! docs ("Locks").

use std::io::Read;
use std::net::{Shutdown, SocketAddr, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mio::{Interest, Registry, Token};
use softwarp_engine::event::AsyncEvent;
use softwarp_engine::fault::Cause;
use softwarp_engine::mr::MrTable;
use softwarp_engine::qp::{
    MrTableAccess, Qp, QpConfig, QpState, RxTarget, StreamConfig, TxPiece, MAX_GATHER_FPDUS,
};
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
/// A payload at least this long is read straight into its destination, with only a
/// header's worth of staging behind it.
const BIG_PAYLOAD: usize = 16 * 1024;
/// Staging behind a large payload: room for the trailer and the next FPDU's header.
const SMALL_STAGE: usize = 64;
/// Size of the staging buffer of threads that busy-poll.
pub(crate) const STAGE_LEN: usize = 64 * 1024;

/// FPDUs up to this long are copied into a batch rather than gathered (a copy this small
/// costs less than a system call of its own).
const COALESCE_MAX: usize = 2048;
/// Largest batch of coalesced FPDUs per `sendmsg`.
const BATCH_CAP: usize = 32 * 1024;
/// About how many bytes of large FPDUs one `sendmsg` gathers (several 64 KiB FPDUs on
/// loopback).
const GATHER_BYTES: usize = 256 * 1024;

/// How many bytes to stage behind the current target.
fn stage_len(staging: bool, small: bool, cap: usize) -> usize {
    match (staging, small) {
        (false, _) => 0,
        (true, true) => SMALL_STAGE.min(cap),
        (true, false) => cap,
    }
}

thread_local! {
    /// The staging buffer of a busy-polling thread (allocated at its first poll).
    static STAGE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The batch buffer of a thread that transmits (grows to `BATCH_CAP` once).
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
    /// RFC 5044 responder without peer-to-peer mode: no FPDU goes out before one arrived.
    gated: bool,
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
    /// Recent payloads were large: stage only a header's worth behind each read.
    rx_big: bool,
    /// Coalesced FPDU bytes, already committed to the engine, that the socket has not
    /// taken yet (empty unless the socket filled up in the middle of a batch).
    tx_spill: Vec<u8>,
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

/// The device's STag table, write-locked on first use (see [`MrTableAccess`]).
struct LazyMrs<'a> {
    device: &'a DeviceShared,
    guard: Option<std::sync::RwLockWriteGuard<'a, MrTable>>,
}

impl MrTableAccess for LazyMrs<'_> {
    fn table(&mut self) -> &mut MrTable {
        let device = self.device;
        self.guard.get_or_insert_with(|| device.mrs_write())
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

    /// Reads from the socket into wherever the engine says, until EAGAIN or the budget is
    /// spent.
    ///
    /// Each `readv` names the engine's current target (a header buffer inside the QP, or
    /// the destination region: zero copy) and, behind it, the staging buffer `stage`, so
    /// that one system call also takes what follows: the trailer and the next headers, or
    /// whole small FPDUs. Staged bytes are then handed to the engine's next targets by
    /// copying (cheap for the few bytes of a header, and for small messages cheaper than a
    /// system call each). How much is staged depends on the traffic: after a large payload
    /// only a header's worth (so large payloads still land without a copy), otherwise the
    /// whole buffer. Staging is off for QPs on an SRQ, whose engine may block with staged
    /// bytes it cannot take yet. `stage` also swallows the bytes that arrive once the QP no
    /// longer receives, so the end of the stream is still seen.
    ///
    /// With `short_ok` (busy polls, which read again at the next poll anyway) a read that
    /// returns less than it asked for ends the pass. The progress thread reads until
    /// EAGAIN: its epoll is edge-triggered, and an end of stream queued behind the data of
    /// a short read would get no edge of its own.
    fn rx_pass(
        &self,
        inner: &mut QpInner,
        stage: &mut [u8],
        budget: &mut usize,
        short_ok: bool,
    ) -> RxEnd {
        let mut empty_targets = 0;
        let staging = self.srq.is_none();
        // Bytes read ahead into `stage[..staged]`, handed out from `fed`.
        let (mut fed, mut staged) = (0usize, 0usize);
        // The last read returned less than asked: the socket is empty for now (no need for
        // a read that would only say EAGAIN).
        let mut short_read = false;
        loop {
            if fed < staged {
                if let Some(end) = self.feed(inner, stage, &mut fed, staged) {
                    return end;
                }
                continue;
            }
            if short_read {
                return RxEnd::Drained;
            }
            let Some(conn) = inner.conn.as_mut() else {
                return RxEnd::Closed;
            };
            if conn.read_closed {
                return RxEnd::Closed;
            }
            if *budget == 0 {
                return RxEnd::More;
            }
            let small_stage = inner.rx_big;
            let fd = conn.stream.as_fd();
            // Each arm reads straight into the engine's target while it is borrowed (plus
            // the staging buffer behind it); `None` for an empty target (never offered by
            // a sound engine).
            let ahead = staging && !small_stage && inner.qp.rx_expects_whole_fpdu();
            let (r, target_len, asked) = if ahead {
                // A new FPDU starts: read it and what follows into the staging buffer only,
                // from where whole FPDUs go to the engine in one step each. (The engine's
                // target would be the header buffer, unused here: not asked for.)
                (
                    Some(sys::read_buf_staged(fd, &mut [], stage)),
                    0,
                    stage.len(),
                )
            } else {
                match inner.qp.rx_target() {
                    RxTarget::Buffer([]) | RxTarget::Region { len: 0, .. } => (None, 0, 0),
                    RxTarget::Buffer(b) => {
                        let len = b.len();
                        let extra = stage_len(staging, small_stage, stage.len());
                        let extra = stage.get_mut(..extra).unwrap_or_default();
                        let asked = len + extra.len();
                        (Some(sys::read_buf_staged(fd, b, extra)), len, asked)
                    }
                    RxTarget::Region {
                        region,
                        offset,
                        len,
                    } => {
                        let big = len >= BIG_PAYLOAD;
                        inner.rx_big |= big;
                        let extra = stage_len(staging, small_stage || big, stage.len());
                        let extra = stage.get_mut(..extra).unwrap_or_default();
                        let asked = len + extra.len();
                        (
                            Some(sys::read_region_staged(fd, region, offset, len, extra)),
                            len,
                            asked,
                        )
                    }
                    RxTarget::Blocked => {
                        self.drain(inner);
                        self.rx_commit(inner, 0);
                        if matches!(inner.qp.rx_target(), RxTarget::Blocked) {
                            return RxEnd::Blocked;
                        }
                        continue;
                    }
                    RxTarget::Closed => {
                        let mut stream = &conn.stream;
                        match stream.read(stage) {
                            Ok(0) => {
                                self.drain(inner);
                                link_down(inner, LinkDown::PeerClosed);
                                return self.rx_closed(inner, "peer closed the connection");
                            }
                            Ok(n) => {
                                *budget = budget.saturating_sub(n);
                                continue;
                            }
                            Err(e) => (Some(Err(e)), 0, 0),
                        }
                    }
                }
            };
            let Some(r) = r else {
                // Let the engine advance, but never spin.
                empty_targets += 1;
                if empty_targets > 2 {
                    tracing::error!(qp = self.qp_num, "engine offers only empty rx targets");
                    return RxEnd::Drained;
                }
                self.rx_commit(inner, 0);
                continue;
            };
            match r {
                Ok(0) => {
                    // Completions of what arrived before the close go out first.
                    self.drain(inner);
                    link_down(inner, LinkDown::PeerClosed);
                    return self.rx_closed(inner, "peer closed the connection");
                }
                Ok(n) => {
                    softwarp_ras::sw_event!(Qp, 8, qpn = self.qp_num, bytes = n, "received");
                    empty_targets = 0;
                    *budget = budget.saturating_sub(n);
                    let direct = n.min(target_len);
                    if direct > 0 {
                        self.rx_commit(inner, direct);
                    }
                    fed = 0;
                    staged = n - direct;
                    short_read = short_ok && n < asked;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return RxEnd::Drained,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                    // The engine offered a range outside its own region: a bug there. Stop
                    // receiving rather than touch memory we cannot vouch for.
                    tracing::error!(qp = self.qp_num, error = %e, "unusable rx target");
                    return self.rx_closed(inner, "unusable rx target");
                }
                Err(e) => {
                    tracing::debug!(qp = self.qp_num, error = %e, "read failed");
                    link_down(inner, LinkDown::ConnectionLost);
                    return self.rx_closed(inner, "connection failed (read)");
                }
            }
        }
    }

    /// Hands staged bytes `stage[*fed..staged]` to the engine: the whole FPDUs at their
    /// start in one step each ([`Qp::rx_whole_fpdu`]), all under one lock of the STag
    /// table; then the next target's worth of the rest (a copy). Returns how the pass ends
    /// when it cannot go on.
    fn feed(
        &self,
        inner: &mut QpInner,
        stage: &[u8],
        fed: &mut usize,
        staged: usize,
    ) -> Option<RxEnd> {
        let mut mrs = LazyMrs {
            device: &self.device,
            guard: None,
        };
        while let Some(n) = inner
            .qp
            .rx_whole_fpdu(stage.get(*fed..staged).unwrap_or_default(), &mut mrs)
        {
            *fed += n;
            // A whole small FPDU came through the staging buffer: keep reading ahead. A
            // large one was copied out of it: read the following payloads straight into
            // their destinations (FPDUs that fit the staging buffer exactly, as 32 KiB ones
            // on a 32 KiB-MSS loopback do in pairs, would otherwise never leave it).
            inner.rx_big = n >= BIG_PAYLOAD;
        }
        drop(mrs);
        if *fed >= staged {
            return None;
        }
        let bytes = stage.get(*fed..staged).unwrap_or_default();
        let n = match inner.qp.rx_target() {
            RxTarget::Buffer(b) => {
                let n = b.len().min(bytes.len());
                if let (Some(d), Some(s)) = (b.get_mut(..n), bytes.get(..n)) {
                    d.copy_from_slice(s);
                }
                n
            }
            RxTarget::Region {
                region,
                offset,
                len,
            } => {
                let n = len.min(bytes.len());
                if region
                    .write_at(offset, bytes.get(..n).unwrap_or_default())
                    .is_err()
                {
                    tracing::error!(qp = self.qp_num, "unusable rx target");
                    return Some(self.rx_closed(inner, "unusable rx target"));
                }
                if n == len && len < BIG_PAYLOAD {
                    // A whole (small) payload came through the staging buffer.
                    inner.rx_big = false;
                }
                inner.qp.rx_note_staged_payload(n);
                n
            }
            RxTarget::Blocked => {
                // Only QPs on an SRQ block, and they do not stage.
                tracing::error!(qp = self.qp_num, "staged bytes with a blocked receiver");
                return Some(self.rx_closed(inner, "receiver blocked with staged bytes"));
            }
            RxTarget::Closed => {
                // The QP no longer receives: the rest is discarded.
                *fed = staged;
                return None;
            }
        };
        if n == 0 {
            self.rx_commit(inner, 0);
            if matches!(
                inner.qp.rx_target(),
                RxTarget::Buffer([]) | RxTarget::Region { len: 0, .. }
            ) {
                tracing::error!(qp = self.qp_num, "engine offers only empty rx targets");
                return Some(self.rx_closed(inner, "engine offers only empty rx targets"));
            }
            return None;
        }
        self.rx_commit(inner, n);
        *fed += n;
        None
    }

    fn rx_commit(&self, inner: &mut QpInner, n: usize) {
        // The STag table's write lock is taken only by the commits that need it.
        let mut mrs = LazyMrs {
            device: &self.device,
            guard: None,
        };
        let mut srq = self.srq.as_ref().map(|s| s.lock());
        if let Err(e) = inner.qp.rx_commit(n, &mut mrs, srq.as_deref_mut()) {
            tracing::error!(qp = self.qp_num, error = %e, "rx_commit refused");
        }
    }

    fn rx_closed(&self, inner: &mut QpInner, why: &'static str) -> RxEnd {
        tracing::debug!(qp = self.qp_num, why, "receive side closed");
        if let Some(conn) = inner.conn.as_mut() {
            conn.read_closed = true;
        }
        inner.qp.handle_llp_closed();
        RxEnd::Closed
    }

    /// Writes what the engine has to send, until it has nothing, the socket is full, or
    /// the budget is spent.
    ///
    /// Small FPDUs (up to `COALESCE_MAX` bytes) are copied into the calling thread's
    /// batch buffer and committed as they are copied, so that one `sendmsg` carries many of
    /// them (several Sends posted as a list, a queue that built up behind a full socket);
    /// bytes of a batch the socket did not take wait in the QP (`QpInner::tx_spill`) and
    /// go first next time. Larger FPDUs are gathered straight from registered memory.
    fn tx_pass(&self, inner: &mut QpInner, budget: &mut usize) -> TxEnd {
        let end = TX_BATCH.with(|b| match b.try_borrow_mut() {
            Ok(mut batch) => self.tx_pass_with(inner, budget, Some(&mut batch)),
            // Re-entered from inside a pass (not possible today): no coalescing.
            Err(_) => self.tx_pass_with(inner, budget, None),
        });
        if end == TxEnd::Full {
            self.arm_watchdog(inner);
        }
        end
    }

    fn tx_pass_with(
        &self,
        inner: &mut QpInner,
        budget: &mut usize,
        mut batch: Option<&mut Vec<u8>>,
    ) -> TxEnd {
        loop {
            let Some(conn) = inner.conn.as_mut() else {
                return TxEnd::Dead;
            };
            if conn.write_failed || conn.shut_wr {
                return TxEnd::Dead;
            }
            if *budget == 0 {
                return TxEnd::More;
            }
            if let Some(t) = conn.hold_until {
                // Linux siw as responder installs its FPDU receive path only after sending
                // its Reply: see `ConnectOptions::first_fpdu_delay`. Once the QP failed,
                // the Terminate is let through.
                if t.expired() || !matches!(inner.qp.state(), QpState::Rts | QpState::Closing) {
                    conn.hold_until = None;
                } else if inner.qp.is_drained() && !inner.qp.wants_tx() {
                    // Nothing in flight and nothing to send (not even an RFC 6581 RTR,
                    // which the peer may be waiting for before it sends first): no retry
                    // needed.
                    return TxEnd::Idle;
                } else {
                    return TxEnd::Held;
                }
            }
            if conn.gated {
                //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
                // (paraphrase) Outside peer-to-peer mode the responder sends no FPDU before
                // it has received and validated the initiator's first FPDU. Once the QP
                // failed, the Terminate is let through.
                if inner.qp.stats().rx_fpdus > 0
                    || !matches!(inner.qp.state(), QpState::Rts | QpState::Closing)
                {
                    conn.gated = false;
                } else if inner.qp.is_drained() {
                    // Nothing waits to go out (a graceful close may proceed to the FIN).
                    return TxEnd::Idle;
                } else {
                    // Held back; the initiator's FPDU makes the progress thread try again.
                    return TxEnd::Full;
                }
            }
            let fd = conn.stream.as_fd();
            // 1. Bytes of an earlier batch that the socket did not take.
            if !inner.tx_spill.is_empty() {
                match sys::write_pieces(fd, &[TxPiece::Bytes(&inner.tx_spill)]) {
                    Ok(n) => {
                        *budget = budget.saturating_sub(n);
                        inner.tx_spill.drain(..n.min(inner.tx_spill.len()));
                        continue;
                    }
                    Err(e) => match self.tx_error(inner, e) {
                        Some(end) => return end,
                        None => continue,
                    },
                }
            }
            // Nothing (more) to send: spare the engine the questions below.
            if !inner.qp.wants_tx() {
                return TxEnd::Idle;
            }
            // 2. Small FPDUs, copied into one batch. Not with markers: then every FPDU
            // starts its own segment, as the marker-aware dissectors (and the FPDU
            // alignment MPA asks senders for) expect.
            let coalesce = !inner.qp.stream_config().sends_markers();
            if let Some(batch) = batch.as_deref_mut().filter(|_| coalesce) {
                if batch.len() < BATCH_CAP {
                    batch.resize(BATCH_CAP, 0);
                }
                // The engine copies (and commits) whole FPDUs of up to COALESCE_MAX bytes.
                let out = batch.get_mut(..BATCH_CAP).unwrap_or_default();
                let used = inner.qp.tx_copy_fpdus(out, COALESCE_MAX);
                let batch = batch.get(..used).unwrap_or_default();
                if !batch.is_empty() {
                    let r = sys::write_pieces(fd, &[TxPiece::Bytes(batch)]);
                    let n = *r.as_ref().unwrap_or(&0);
                    // The batch is committed: what the socket did not take waits here.
                    inner
                        .tx_spill
                        .extend_from_slice(batch.get(n..).unwrap_or_default());
                    *budget = budget.saturating_sub(n);
                    match r {
                        Ok(_) => continue,
                        Err(e) => match self.tx_error(inner, e) {
                            Some(end) => return end,
                            None => continue,
                        },
                    }
                }
            }
            // 3. Large FPDUs, gathered from their pieces (zero copy), several per call.
            let r = match inner.qp.poll_tx_gather(MAX_GATHER_FPDUS, GATHER_BYTES) {
                None => return TxEnd::Idle,
                Some(fpdus) => sys::write_pieces(fd, fpdus.pieces()),
            };
            match r {
                Ok(0) => {
                    // Only an FPDU without bytes writes nothing; never spin on it.
                    tracing::error!(qp = self.qp_num, "engine offered an empty FPDU");
                    return TxEnd::Idle;
                }
                Ok(written) => {
                    softwarp_ras::sw_event!(Qp, 8, qpn = self.qp_num, bytes = written, "sent");
                    *budget = budget.saturating_sub(written);
                    if let Err(e) = inner.qp.tx_commit(written) {
                        tracing::error!(qp = self.qp_num, error = %e, "tx_commit refused");
                        return TxEnd::Dead;
                    }
                }
                Err(e) => {
                    if let Some(end) = self.tx_error(inner, e) {
                        return end;
                    }
                }
            }
        }
    }

    /// What a failed write means for the pass (`None`: try again).
    fn tx_error(&self, inner: &mut QpInner, e: std::io::Error) -> Option<TxEnd> {
        match e.kind() {
            std::io::ErrorKind::WouldBlock => Some(TxEnd::Full),
            std::io::ErrorKind::Interrupted => None,
            _ => {
                tracing::debug!(qp = self.qp_num, error = %e, "connection failed (write)");
                if let Some(conn) = inner.conn.as_mut() {
                    conn.write_failed = true;
                }
                inner.tx_spill.clear();
                link_down(inner, LinkDown::ConnectionLost);
                inner.qp.handle_llp_closed();
                Some(TxEnd::Dead)
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
            // Re-entered from inside a pass (not possible today): read without staging.
            Err(_) => self.rx_pass(inner, &mut [0u8; 512], &mut budget, true),
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
        let idle = inner.tx_spill.is_empty() && !inner.qp.wants_tx();
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
        if inner.qp.state() != QpState::Rts || inner.close_kicked || !inner.tx_spill.is_empty() {
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
        let prepared = prepare_stream(stream, est.opts, &neg);
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
            gated: est.gate && neg.role == Role::Responder && neg.rtr.is_none(),
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
                rx_big: false,
                tx_spill: Vec::new(),
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
    if let Some(t) = opts.tcp_user_timeout {
        sys::set_tcp_user_timeout(stream.as_fd(), t)
            .map_err(|e| Error::io("set TCP_USER_TIMEOUT", e))?;
    }
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
