//! The connection of a QP: establishing it on a negotiated socket, graceful close (FIN
//! after the last byte, then the peer's FIN or the linger deadline), abortive close, and
//! what the connection manager hears ([`ConnObserver`]). No bytes are moved here (see
//! `pump`).

use std::net::{Shutdown, SocketAddr};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::{Registry, Token};
use softwarp_engine::mpa::{Negotiated, QpLimits, Role};
use softwarp_engine::qp::{QpState, StreamConfig, Timers};
use softwarp_ras::deadline::Deadline;

use super::pump::{TxEnd, PASS_BUDGET};
use super::{state_name, QpInner, QpShared};
use crate::error::{Error, Result};
use crate::runtime::sys;
use crate::verbs::qp::options::{ConnectOptions, ConnectionInfo};

/// How long a closing connection waits for the peer's FIN after sending its own.
const LINGER: Duration = Duration::from_secs(2);

/// The socket of an established QP.
#[derive(Debug)]
pub(crate) struct Conn {
    pub(super) stream: mio::net::TcpStream,
    pub(super) token: Option<Token>,
    /// Registered for read readiness (false while a busy-poll CQ's thread reads).
    pub(super) read_interest: bool,
    /// Registered with the poller at all (a busy-polled QP is not, until its socket fills
    /// up with bytes pending and the application stops polling, or it closes: no epoll
    /// wait-queue entry on its data path).
    pub(super) registered: bool,
    /// Write watchdog of a busy-polled QP whose socket filled up with bytes pending: the
    /// application's pass count and the time of the progress thread's last look. Armed, the
    /// progress thread looks every few milliseconds; while the application keeps polling
    /// (which writes as the socket drains) it leaves the socket alone, and once it stops,
    /// the progress thread registers for write readiness and sends the rest itself.
    pub(super) watch: Option<(u64, Instant)>,
    /// The application's pass count when the progress thread took the writing of this
    /// busy-polled QP over from the watchdog (registered for write readiness with bytes
    /// pending): once the count moves, the polls are back and get the writing back
    /// ([`QpShared::tx_hand_back`]) instead of only queueing behind the progress thread
    /// for the rest of the transfer.
    pub(super) tx_takeover: Option<u64>,
    /// The application's activity (passes, receive posts and completions taken from its
    /// CQs, summed) at the progress thread's last receive look of a busy-polled QP read by
    /// the polls, and whether its socket was readable then (see [`QpShared::rx_look`];
    /// `None` before the first look and after a hand-back).
    pub(super) rx_look: Option<(u64, bool)>,
    /// Set while the progress thread reads a busy-polled QP whose polls stopped (receive
    /// take-over, [`QpShared::rx_look`]), until the polls are back
    /// ([`QpShared::rx_hand_back`]).
    /// Boxed: rare, and a connection that never needs it holds a pointer (issue 39).
    pub(super) rx_takeover: Option<Box<RxTakeover>>,
    /// End of stream or error seen on the read side.
    pub(super) read_closed: bool,
    /// A write failed (reset, broken pipe): nothing more can be sent.
    pub(super) write_failed: bool,
    /// Our FIN was sent.
    pub(super) shut_wr: bool,
    /// The last transmit pass ended on a full socket with bytes pending (`EAGAIN`). Until a
    /// pass writes again, a post or busy poll does not ask the full socket again (an
    /// `EAGAIN` `sendmsg` takes the socket lock, after building the gather list): when the
    /// progress thread watches the socket for write readiness, a post only queues its work
    /// (see [`Conn::wants_write`]); otherwise a lockless `poll` says when the socket has
    /// room again.
    pub(super) tx_full: bool,
    pub(super) linger_until: Option<Instant>,
    /// This side's close is held for the peer's ([`QpShared::hold_close`]): counted among
    /// the process's held closes until our FIN is sent or the connection goes.
    pub(super) held: Option<HeldClose>,
}

/// The closes held for the peer's in this process ([`QpShared::hold_close`]), and the
/// condition [`wait_for_held_closes`] waits on.
static HELD: (std::sync::Mutex<usize>, std::sync::Condvar) =
    (std::sync::Mutex::new(0), std::sync::Condvar::new());

/// One held close, counted in [`HELD`] while it lives.
#[derive(Debug)]
pub(crate) struct HeldClose(());

impl HeldClose {
    fn new() -> Self {
        *crate::sync::lock(&HELD.0) += 1;
        Self(())
    }
}

impl Drop for HeldClose {
    fn drop(&mut self) {
        let mut n = crate::sync::lock(&HELD.0);
        *n = n.saturating_sub(1);
        HELD.1.notify_all();
    }
}

/// Waits, at most `limit`, until no connection of this process holds its close for its
/// peer's any more (each one's FIN sent, or its connection gone). True when none is left.
/// A program that exits right after `rdma_disconnect` (perftest's server) would otherwise
/// send its FIN at exit, before the peer closed: the C library calls this from an `atexit`
/// handler it registers at its first held close.
pub fn wait_for_held_closes(limit: Duration) -> bool {
    let deadline = Deadline::after(limit);
    let mut n = crate::sync::lock(&HELD.0);
    while *n > 0 {
        let Some(left) = deadline.remaining().filter(|d| !d.is_zero()) else {
            return false;
        };
        n = HELD
            .1
            .wait_timeout(n, left)
            .map(|(g, _)| g)
            .unwrap_or_else(|e| e.into_inner().0);
    }
    true
}

impl Conn {
    /// Whether a transmit pass now could write: not while the last one ended on a full
    /// socket that has not drained since (the progress thread, registered for write
    /// readiness, then writes when it does; for a busy-polled socket a `poll` without wait
    /// tells). Saves the gather list and the failing `sendmsg` per post and per busy poll
    /// of a sender that waits for the socket to drain.
    #[inline]
    pub(super) fn wants_write(&self) -> bool {
        !self.tx_full
            || (!self.registered && crate::runtime::sys::writable_now(self.stream.as_fd()))
    }

    /// Who writes the socket when it drains (the `tx_by` detail of `softwarp resources`):
    /// `progress` (registered with the progress thread's epoll for write readiness), `polls`
    /// (a busy-polled QP: the application's polls write), `polls+watchdog` (busy-polled with
    /// bytes pending behind a full socket: the progress thread takes over if the polls stop).
    pub(super) fn tx_by(&self) -> &'static str {
        match (self.registered, self.watch.is_some()) {
            (true, _) => "progress",
            (false, false) => "polls",
            (false, true) => "polls+watchdog",
        }
    }
}

/// The progress thread's receive take-over of a busy-polled QP: the application's pass
/// and receive post counts at its last service pass, and how many service passes in a row
/// found nothing to read while the application made passes (its polls read first).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RxTakeover {
    pub(super) seen: u64,
    pub(super) recv_posts: u64,
    pub(super) idle: u8,
}

impl Conn {
    /// Who reads the socket (the `rx_by` detail of `softwarp resources`): `progress` (the
    /// progress thread on read readiness: a QP in event or spin mode, a busy-polled one it
    /// took over, or one closing), `polls` (a busy-polled QP: the application's polls read).
    pub(super) fn rx_by(&self) -> &'static str {
        if self.read_interest {
            "progress"
        } else {
            "polls"
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
    /// The device failed (its QPs were moved to Error).
    DeviceFailed,
    /// The network under the connection went away (local address removed, interface
    /// down or gone).
    NetworkGone,
    /// The kernel timed the connection out: the peer stopped answering.
    PeerUnreachable,
}

/// Tells the connection manager (if it manages the QP) that the connection went away.
pub(super) fn link_down(inner: &QpInner, why: LinkDown) {
    if let Some(o) = &inner.observer {
        let failed = matches!(inner.qp.state(), QpState::Error | QpState::Terminate);
        o.link_down(if failed { LinkDown::QpFailed } else { why });
    }
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
    if let Some(k) = opts.tcp_keepalive {
        let (idle, interval, count) = k.kernel_values().map_err(Error::InvalidArgument)?;
        sys::set_tcp_keepalive(stream.as_fd(), idle, interval, count)
            .map_err(|e| Error::io("set TCP keepalive", e))?;
    }
    let mss = sys::tcp_maxseg(stream.as_fd()).map_err(|e| Error::io("getsockopt TCP_MAXSEG", e))?;
    let local_addr = stream
        .local_addr()
        .map_err(|e| Error::io("getsockname", e))?;
    let peer_addr = stream
        .peer_addr()
        .map_err(|e| Error::io("getpeername", e))?;
    let max_fpdu = opts
        .max_fpdu_len
        .unwrap_or_else(|| default_max_fpdu(mss, local_addr, peer_addr));
    let cfg = neg.stream_config(max_fpdu, &opts.offer());
    let max_fpdu_len = cfg.max_fpdu_len;
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

/// The largest FPDU to send when the application did not choose one
/// ([`ConnectOptions::max_fpdu_len`]): the TCP maximum segment size, so that every FPDU
/// starts a segment and a hardware receiver can place each segment on its own (RFC 5044's
/// FPDU alignment); but MPA's largest FPDU on a connection to this host itself, which the
/// kernel carries over loopback where segments are never cut by a NIC nor placed by one.
/// Any conforming receiver takes FPDUs up to the 16-bit ULPDU length; fewer, larger FPDUs
/// halve the receiver's reads per MiB (BENCHMARKS-history.md, "Larger FPDUs on loopback").
fn default_max_fpdu(mss: usize, local: SocketAddr, peer: SocketAddr) -> usize {
    if peer.ip().is_loopback() || peer.ip() == local.ip() {
        softwarp_wire::mpa::fpdu::MAX_FPDU_LEN
    } else {
        mss
    }
}

impl QpShared {
    /// Closes the connection once the QP is finished with it: FIN after the last byte
    /// (the Terminate, if one is queued), then the peer's FIN or the linger deadline.
    /// Returns (closed, lingering).
    pub(super) fn maybe_close(
        &self,
        inner: &mut QpInner,
        registry: &Registry,
        tx: TxEnd,
    ) -> (bool, bool) {
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
        // The close hold ([`QpShared::hold_close`]): no FIN of ours before the peer's, until
        // the engine's clock lifts it (the progress thread's timer look is armed for it).
        if !conn.shut_wr && !conn.read_closed && inner.qp.close_held() {
            return (false, false);
        }
        let now = Instant::now();
        if !conn.shut_wr && (tx == TxEnd::Idle || conn.write_failed || tx == TxEnd::Dead) {
            let _ = conn.stream.shutdown(Shutdown::Write);
            conn.shut_wr = true;
            conn.held = None;
            conn.linger_until = Deadline::after_from(now, LINGER).instant();
            tracing::debug!(qp = self.qp_num, ?state, "connection: FIN sent");
        }
        if !conn.shut_wr && tx == TxEnd::Full {
            // The peer does not read (a Send of ours waits there for a receive, say): our
            // last bytes, and a FIN behind them, may never reach it. Bounded like the
            // wait for its FIN; past it the connection is reset.
            if conn.linger_until.is_none() {
                conn.linger_until = Deadline::after_from(now, LINGER).instant();
            }
            if conn.linger_until.is_some_and(|t| now >= t) {
                tracing::debug!(qp = self.qp_num, ?state, "the peer does not read: reset");
                if let Err(e) = sys::set_linger_zero(conn.stream.as_fd()) {
                    tracing::debug!(qp = self.qp_num, error = %e, "SO_LINGER 0 failed");
                }
                let _ = registry.deregister(&mut conn.stream);
                inner.conn = None;
                self.connection_gone(inner);
                return (true, false);
            }
            return (false, true);
        }
        let expired = conn.linger_until.is_some_and(|t| now >= t);
        if conn.shut_wr && !conn.read_closed && expired {
            let left = sys::unacknowledged(conn.stream.as_fd());
            if left > 0 {
                // The peer has not taken our last bytes (nor the FIN behind them) for the
                // linger time: it does not read (a Send of ours waits there for a
                // receive, say), and a plain close would leave it waiting for bytes it
                // cannot see the end of. Reset, as `SO_LINGER` does past its time.
                tracing::debug!(qp = self.qp_num, left, "the peer does not read: reset");
                if let Err(e) = sys::set_linger_zero(conn.stream.as_fd()) {
                    tracing::debug!(qp = self.qp_num, error = %e, "SO_LINGER 0 failed");
                }
            }
        }
        if conn.shut_wr && (conn.read_closed || expired) {
            let _ = registry.deregister(&mut conn.stream);
            inner.conn = None;
            tracing::debug!(qp = self.qp_num, ?state, "connection closed");
            self.connection_gone(inner);
            return (true, false);
        }
        (false, conn.shut_wr)
    }

    /// The connection is closed: the receives a graceful close left posted complete with a
    /// flush status and the QP ends in Error (as siw does on close, and as
    /// `rdma_disconnect` promises; [`crate::QueuePair::reset`] makes it Idle to connect
    /// again), on every connection path; then a connection-manager QP's observer hears of
    /// it.
    pub(super) fn connection_gone(&self, inner: &mut QpInner) {
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

    /// Holds this side's close of the connection (its FIN) until the peer closed its side
    /// or `bound` passed, whatever closes it meanwhile (a graceful disconnect, a destroy):
    /// the engine's close hold, which the progress thread's timer lifts; nobody waits. True
    /// when a hold was set (a connected QP and a bound above zero).
    pub(crate) fn hold_close(self: &Arc<Self>, bound: Duration) -> bool {
        if bound.is_zero() {
            return false;
        }
        {
            let mut g = self.lock();
            let inner = &mut *g;
            let Some(conn) = inner.conn.as_mut() else {
                return false;
            };
            if conn.shut_wr || conn.read_closed {
                return false;
            }
            let Some(until) = Instant::now().checked_add(bound) else {
                return false;
            };
            inner.qp.hold_close(until);
            if conn.held.is_none() {
                conn.held = Some(HeldClose::new());
            }
        }
        // Its next pass arms the timer look for the hold's end.
        self.device.progress.kick(Arc::clone(self));
        true
    }

    /// Claims an Idle QP for a connection attempt. A QP of a failed device, or one in Error
    /// with a reason, is refused with that reason before anything touches the network.
    pub(crate) fn begin_connect(&self) -> Result<()> {
        self.device.check_usable()?;
        let mut g = self.lock();
        if g.qp.state() == QpState::Error {
            if let Some(reason) = self.failure.get() {
                return Err(Error::QpFailed {
                    qpn: self.qp_num,
                    reason,
                });
            }
        }
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

    /// Ends a connection attempt that failed before [`QpShared::finish_connect`] (which
    /// ends it itself, established or not).
    pub(crate) fn abandon_connect(&self) {
        self.lock().connecting = false;
    }

    /// The QP's read queue limits under `opts`.
    pub(crate) fn local_params(&self, opts: &ConnectOptions) -> Result<QpLimits> {
        let g = self.lock();
        let cfg = g.qp.config();
        Ok(QpLimits::new(cfg.max_ird, cfg.max_ord, &opts.offer())?)
    }

    /// Second half of connect/accept, the same on every path: establishes the engine QP on
    /// the negotiated stream (the stream parameters from `opts`, the responder's gate on the
    /// first FPDU among them) and hands the socket to the progress thread. An initiator's QP
    /// holds its FPDUs for `hold` (the first-FPDU hold-off still to run: the connection
    /// manager's thread cannot wait it out, a blocking caller already did); `observer` is
    /// the connection manager's hook (none on the blocking path).
    pub(crate) fn finish_connect(
        self: &Arc<Self>,
        stream: std::net::TcpStream,
        neg: Negotiated,
        opts: &ConnectOptions,
        observer: Option<Arc<dyn ConnObserver>>,
        hold: Duration,
    ) -> Result<ConnectionInfo> {
        let s = self;
        let prepared = prepare_stream(stream, opts, &neg);
        let mut g = s.lock();
        g.connecting = false;
        let (stream, info, cfg) = prepared?;
        if g.destroyed {
            return Err(Error::Qp(softwarp_engine::qp::QpError::Destroyed));
        }
        g.qp.establish(cfg)?;
        g.qp.set_tx_alias_lead(opts.tx_alias_lead);
        // The engine's clock: the receive stall, and on the initiator the first-FPDU hold
        // (posted work waits in the QP meanwhile; the progress thread looks when the
        // engine asks, nobody sleeps).
        let timers = Timers {
            rx_stall: (opts.rx_stall_timeout != Duration::MAX).then_some(opts.rx_stall_timeout),
            first_fpdu_hold: (neg.role == Role::Initiator && !hold.is_zero()).then_some(hold),
            responder_gate: (neg.role == Role::Responder
                && opts.responder_wait_limit != Duration::MAX)
                .then_some(opts.responder_wait_limit),
            // The QP's own setting (`QueuePair::set_rnr_wait`) before the connection's.
            rnr_wait: g.rnr_wait.unwrap_or(opts.rnr_wait),
        };
        g.qp.set_timers(timers, Instant::now());
        g.conn = Some(Conn {
            stream,
            token: None,
            read_interest: false,
            registered: false,
            watch: None,
            tx_takeover: None,
            rx_look: None,
            rx_takeover: None,
            read_closed: false,
            write_failed: false,
            shut_wr: false,
            linger_until: None,
            tx_full: false,
            held: None,
        });
        g.info = Some(info.clone());
        g.observer = observer;
        // Anything already queued (an RFC 6581 RTR) goes out now.
        let mut budget = usize::MAX;
        let _ = s.tx_pass(&mut g, &mut budget);
        s.drain(&mut g);
        drop(g);
        s.device.hooks.qp_connected(&s.ras, &info);
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

    /// Containment of a device fault: the QP records the fault as its reason, the
    /// connection manager hears that the device failed, and the QP goes to Error
    /// ([`QpShared::set_error_and_kick`]).
    pub(crate) fn fail_device(
        self: &Arc<Self>,
        fault: &crate::availability::recovery::DeviceFault,
    ) {
        self.failure
            .set(crate::availability::recovery::QpErrorReason::DeviceFault(
                fault.clone(),
            ));
        {
            let g = self.lock();
            if let Some(o) = &g.observer {
                o.link_down(LinkDown::DeviceFailed);
            }
        }
        self.set_error_and_kick();
    }

    /// The peer broke the protocol above RDMAP (see `QueuePair::fail_peer_violation`):
    /// the reason is recorded (unless the QP failed before), the QP goes to Error and is
    /// closed, then its snapshot is taken and the error log gets a line naming it.
    pub(crate) fn peer_violation(self: &Arc<Self>, detail: &str) {
        let reason = crate::availability::recovery::QpErrorReason::PeerViolation {
            detail: detail.to_string(),
        };
        self.failure.set(reason.clone());
        let first = self.failure.get().as_ref() == Some(&reason);
        self.set_error_and_kick();
        if !first {
            return;
        }
        let text = format!(
            "QP {}: the peer broke the protocol above RDMAP: {detail}; the QP is in Error \
             (a Terminate was sent)",
            self.qp_num
        );
        let snapshot = self.take_snapshot(
            softwarp_ras::errlog::CriticalKind::PeerViolation,
            text.clone(),
        );
        self.device.hooks.peer_violation(&self.ras, text, snapshot);
    }

    /// The local address of the QP's connection, while it has one.
    pub(crate) fn local_addr(&self) -> Option<std::net::SocketAddr> {
        let g = self.lock();
        g.conn.as_ref()?;
        g.info.as_ref().map(|i| i.local_addr)
    }

    /// The network under the connection went away (`detail`: its local address was
    /// removed, its interface went down or disappeared): the QP is terminated at once
    /// ("unexpected close": the socket is reset, the QP goes to Error and flushes, the
    /// connection manager hears `NetworkGone`), instead of when TCP gives up minutes later.
    /// A snapshot and an error log line record it. False when the QP had no connection.
    pub(crate) fn network_gone(self: &Arc<Self>, detail: &str) -> bool {
        {
            let mut g = self.lock();
            let inner = &mut *g;
            let Some(conn) = inner.conn.take() else {
                return false;
            };
            self.failure
                .set(crate::availability::recovery::QpErrorReason::NetworkGone {
                    detail: detail.to_string(),
                });
            if let Some(o) = &inner.observer {
                o.link_down(LinkDown::NetworkGone);
            }
            if let Err(e) = sys::set_linger_zero(conn.stream.as_fd()) {
                tracing::debug!(qp = self.qp_num, error = %e, "SO_LINGER 0 failed");
            }
            // Closing the descriptor also removes it from the progress thread's epoll.
            drop(conn);
            if matches!(
                inner.qp.state(),
                QpState::Rts | QpState::Closing | QpState::Terminate
            ) {
                inner.qp.handle_llp_closed();
            }
            if inner.qp.state() != QpState::Error {
                let _ = inner.qp.modify(QpState::Error);
            }
            self.drain(inner);
            self.connection_gone(inner);
        }
        self.device.progress.kick(Arc::clone(self));
        let snapshot = self.take_snapshot(
            softwarp_ras::errlog::CriticalKind::NetworkGone,
            format!("QP {} terminated: {detail}", self.qp_num),
        );
        self.device
            .hooks
            .network_gone(&self.device, self.qp_num, detail, snapshot);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fpdus_follow_the_mss_except_to_this_host_itself() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        let max = softwarp_wire::mpa::fpdu::MAX_FPDU_LEN;
        assert_eq!(
            default_max_fpdu(32768, at("127.0.0.1:1"), at("127.0.0.1:2")),
            max
        );
        assert_eq!(default_max_fpdu(32768, at("[::1]:1"), at("[::1]:2")), max);
        // Another address of this host: the kernel routes it over loopback too.
        assert_eq!(
            default_max_fpdu(1448, at("10.0.0.5:1"), at("10.0.0.5:2")),
            max
        );
        assert_eq!(
            default_max_fpdu(1448, at("10.0.0.5:1"), at("10.0.0.6:2")),
            1448
        );
        assert_eq!(
            default_max_fpdu(8948, at("[fd00::1]:1"), at("[fd00::2]:2")),
            8948
        );
    }
}
