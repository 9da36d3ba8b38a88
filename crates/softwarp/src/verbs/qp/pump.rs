//! The runtime's passes over a QP: they hand the socket to the engine's byte pump
//! ([`Qp::recv_from`], [`Qp::send_to`]) and turn how it ended into what the connection does.
//! Three kinds of pass, one name each: `service` (the progress thread, on readiness or a
//! timer), `busy_pass` (a thread polling a busy-poll CQ) and `tx_pass` (the posting thread,
//! and the end of the others); plus the progress thread's timer look (the engine's clock).

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use mio::{Interest, Registry};
use softwarp_engine::mr::MrTable;
use softwarp_engine::qp::{
    QpState, ReadDest, ReadUntil, RecvEnd, RxResources, SendEnd, TxPiece, VectoredRead,
    VectoredWrite,
};
use softwarp_engine::srq::Srq;

use super::conn::{link_down, LinkDown};
use super::poller::WatchLook;
use super::{QpInner, QpShared};
use crate::runtime::progress::{Pass, TimerLook};
use crate::runtime::sys;
use crate::sync;
use crate::verbs::device::DeviceShared;
use crate::verbs::srq::SrqShared;

/// Bytes one progress pass reads (or writes) for one QP before letting others run.
pub(super) const PASS_BUDGET: usize = 1 << 20;

/// Size of the staging buffer of threads that busy-poll (the engine's advice: room for an
/// early read of a whole 64 KiB FPDU).
const STAGE_LEN: usize = softwarp_engine::qp::STAGE_LEN;

/// The buffers of a thread that moves a QP's bytes.
struct PassBufs {
    /// The staging buffer of a busy-polling thread (allocated at its first poll).
    stage: Vec<u8>,
    /// The batch buffer of a thread that transmits (the engine grows it to
    /// [`softwarp_engine::qp::BATCH_CAP`] once).
    batch: Vec<u8>,
}

thread_local! {
    /// One thread-local for both buffers: a busy pass reaches them with one lookup (in a
    /// shared library, such as the C ABI's, each lookup is a `__tls_get_addr` call).
    static BUFS: std::cell::RefCell<PassBufs> = const {
        std::cell::RefCell::new(PassBufs {
            stage: Vec::new(),
            batch: Vec::new(),
        })
    };
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RxEnd {
    /// The socket has nothing more (EAGAIN) or the QP does not read.
    Drained,
    /// Budget exhausted.
    More,
    /// The engine waits for completions to be taken.
    Blocked,
    /// The engine holds a Send for a receive to be posted (the RNR wait): a post, or its
    /// clock, resumes it.
    NoReceive,
    /// End of stream or error.
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TxEnd {
    /// Nothing left to send.
    Idle,
    /// The socket is full; write readiness will resume.
    Full,
    /// Budget exhausted.
    More,
    /// The connection cannot send (closed, failed, not connected).
    Dead,
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

    /// The table under the exclusive lock when this step holds it, else under a shared one
    /// for the call only (busy polls of several threads then do not queue on each other).
    #[inline(always)]
    fn with_mrs<R>(&mut self, f: impl FnOnce(&MrTable) -> R) -> R {
        match self.mrs_guard.as_deref() {
            Some(mrs) => f(mrs),
            None => f(&self.device.mrs_read()),
        }
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

    #[inline(always)]
    fn read_around(
        &mut self,
        head: &mut [u8],
        dest: ReadDest<'_>,
        tail: &mut [u8],
    ) -> std::io::Result<usize> {
        let r = sys::read_around(self.fd, head, dest, tail);
        if let Ok(n) = r {
            softwarp_ras::sw_event!(Qp, 8, qpn = self.qp_num, bytes = n, "received early");
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

impl QpShared {
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
                // A Send waits for a receive: the clock starts the wait now (or, for a
                // busy-polled QP whose polls come here, ends it once it ran out; the
                // held Send then fails and the rest of its FPDU is read on).
                RecvEnd::NoReceive => {
                    if self.rnr_held(inner) {
                        return RxEnd::NoReceive;
                    }
                }
                RecvEnd::Eof => {
                    // Completions of what arrived before the close go out first.
                    self.drain(inner);
                    link_down(inner, LinkDown::PeerClosed);
                    return self.rx_closed(inner, "peer closed the connection");
                }
                RecvEnd::Failed(e) => {
                    tracing::debug!(qp = self.qp_num, error = %e, "read failed");
                    self.connection_failed(inner, &e);
                    return self.rx_closed(inner, "connection failed (read)");
                }
                RecvEnd::Bug(why) => {
                    tracing::error!(qp = self.qp_num, why, "receive stopped");
                    return self.rx_closed(inner, why);
                }
            }
        }
    }

    /// A receive pass found a Send held for a receive (the RNR wait): true while it still
    /// waits. False when the peer closed or reset the connection behind it (the Send will
    /// not be received and the peer's work behind it ends with the connection: it is
    /// dropped, and the stream is read on to its end) or when the wait's clock, started
    /// here, found it ran out (for a busy-polled QP, whose polls come here; the held Send
    /// then fails and the rest of its FPDU is read). Out of line: the receive pass stays as
    /// small as it was for the data path.
    #[cold]
    #[inline(never)]
    fn rnr_held(&self, inner: &mut QpInner) -> bool {
        let gone = inner
            .conn
            .as_ref()
            .is_some_and(|c| sys::peer_hung_up(c.stream.as_fd()));
        if gone {
            tracing::debug!(qp = self.qp_num, "peer closed behind a held Send");
            inner.qp.rnr_abandon();
            return false;
        }
        if !inner.qp.handle_timeout(Instant::now()) {
            return true;
        }
        tracing::warn!(
            qp = self.qp_num,
            wait = ?inner.qp.timers().rnr_wait,
            "no receive was posted for a Send within the RNR wait: stream terminated"
        );
        false
    }

    /// [`QpShared::rx_pass`] with a small buffer of its own, for a thread whose staging
    /// buffer is in use (kept out of line: it never runs today).
    #[cold]
    #[inline(never)]
    fn rx_pass_unstaged(&self, inner: &mut QpInner, budget: &mut usize) -> RxEnd {
        self.rx_pass(inner, &mut [0u8; 512], budget, true)
    }

    /// A read or write of the connection failed with `e`: tells the connection manager,
    /// and when the kernel timed the connection out (`ETIMEDOUT`: keepalive probes, or sent
    /// data, unanswered past their bound) records that the peer stopped answering, as the
    /// QP's error reason and in the error log.
    fn connection_failed(&self, inner: &QpInner, e: &std::io::Error) {
        if e.kind() != std::io::ErrorKind::TimedOut {
            link_down(inner, LinkDown::ConnectionLost);
            return;
        }
        let detail = format!(
            "{e}: the peer stopped answering (TCP keepalive, TCP_USER_TIMEOUT or \
             retransmissions expired)"
        );
        self.device.hooks.peer_unreachable(&self.ras, &detail);
        self.failure
            .set(crate::availability::recovery::QpErrorReason::PeerUnreachable { detail });
        link_down(inner, LinkDown::PeerUnreachable);
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
    pub(super) fn tx_pass(&self, inner: &mut QpInner, budget: &mut usize) -> TxEnd {
        // Re-entered from inside a pass (not possible today): no coalescing. `try_with`: a
        // post from an exit handler runs after the thread's locals are gone (glibc destroys
        // them before `atexit` handlers run); it then sends without coalescing instead of
        // panicking (socat's exit-time `shutdown` through the preload library did).
        BUFS.try_with(|b| {
            let mut bufs = b.try_borrow_mut().ok();
            self.tx_pass_batch(inner, budget, bufs.as_deref_mut().map(|b| &mut b.batch))
        })
        .unwrap_or_else(|_| self.tx_pass_batch(inner, budget, None))
    }

    /// [`QpShared::tx_pass`] with the calling thread's batch buffer, if it has one.
    #[inline(always)]
    fn tx_pass_batch(
        &self,
        inner: &mut QpInner,
        budget: &mut usize,
        batch: Option<&mut Vec<u8>>,
    ) -> TxEnd {
        let end = self.tx_pass_with(inner, budget, batch);
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
        let mut sock = SockIo::new(conn.stream.as_fd(), self.qp_num);
        let end = qp.send_to(&mut sock, batch, budget);
        conn.tx_full = matches!(end, SendEnd::Full);
        match end {
            SendEnd::Idle => TxEnd::Idle,
            SendEnd::Full => TxEnd::Full,
            SendEnd::Budget => TxEnd::More,
            SendEnd::Failed(e) => {
                tracing::debug!(qp = self.qp_num, error = %e, "connection failed (write)");
                conn.write_failed = true;
                self.connection_failed(inner, &e);
                inner.qp.handle_llp_closed();
                TxEnd::Dead
            }
            SendEnd::Bug(why) => {
                tracing::error!(qp = self.qp_num, why, "transmit stopped");
                TxEnd::Dead
            }
        }
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
                WatchLook::AppActive => {
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
                let r = if conn.registered {
                    registry.reregister(&mut conn.stream, token, both)
                } else {
                    registry.register(&mut conn.stream, token, both)
                };
                if r.is_ok() {
                    conn.read_interest = true;
                    conn.registered = true;
                }
            }
        }
        let rx_before = inner.qp.stats().rx_stream_bytes;
        let mut budget = PASS_BUDGET;
        let rx = self.rx_pass(inner, scratch, &mut budget, false);
        let read_any = inner.qp.stats().rx_stream_bytes != rx_before;
        let mut budget = PASS_BUDGET;
        let tx = self.tx_pass(inner, &mut budget);
        self.drain(inner);
        self.ras
            .sample_tcp(inner.conn.as_ref().map(|c| c.stream.as_fd()));
        let (closed, lingering) = self.maybe_close(inner, registry, tx);
        if !closed && tx == TxEnd::Idle {
            self.return_to_busy_polls(inner, registry);
        }
        if !closed {
            self.tx_hand_back(inner, registry);
        }
        if !closed {
            self.rx_hand_back(inner, registry, read_any);
        }
        Pass {
            more: !closed && (rx == RxEnd::More || tx == TxEnd::More),
            retry: !closed && rx == RxEnd::Blocked,
            lingering,
            closed,
            timeout: if closed {
                None
            } else {
                inner.qp.poll_timeout()
            },
        }
    }

    /// Busy poll (on the thread polling a busy-poll CQ, or `QueuePair::service`): one
    /// non-blocking pass of receive, transmit and completions, unless another thread holds
    /// the QP (then false). When the connection needs closing, the progress thread is asked
    /// to do it (it owns the poller registration).
    pub(crate) fn busy_pass(self: &Arc<Self>) -> bool {
        let Some(mut g) = sync::try_lock(&self.inner) else {
            return false;
        };
        let inner = &mut *g;
        if inner.conn.is_none() || inner.close_kicked {
            return true;
        }
        inner.app_passes = inner.app_passes.wrapping_add(1);
        let mut budget = PASS_BUDGET;
        // `try_with`: see `tx_pass` (a pass from an exit handler reads without staging and
        // sends without coalescing).
        let rx = BUFS
            .try_with(|bufs| match bufs.try_borrow_mut() {
                Ok(mut bufs) => {
                    let PassBufs { stage, batch } = &mut *bufs;
                    if stage.len() < STAGE_LEN {
                        stage.resize(STAGE_LEN, 0);
                    }
                    let rx = self.rx_pass(inner, stage, &mut budget, true);
                    self.busy_tx(inner, Some(batch));
                    rx
                }
                // Re-entered from inside a pass (not possible today): a small buffer.
                Err(_) => {
                    let rx = self.rx_pass_unstaged(inner, &mut budget);
                    self.busy_tx(inner, None);
                    rx
                }
            })
            .unwrap_or_else(|_| {
                let rx = self.rx_pass_unstaged(inner, &mut budget);
                self.busy_tx(inner, None);
                rx
            });
        self.drain(inner);
        let finished = rx == RxEnd::Closed || inner.qp.state() != QpState::Rts;
        if finished {
            inner.close_kicked = true;
            drop(g);
            self.device.progress.kick(Arc::clone(self));
        }
        true
    }

    /// The transmit half of a busy pass, with the batch buffer the receive half's lookup
    /// found.
    #[inline(always)]
    fn busy_tx(&self, inner: &mut QpInner, batch: Option<&mut Vec<u8>>) {
        let mut budget = PASS_BUDGET;
        // A socket still full since the last pass: no gather list, no failing `sendmsg`.
        if inner.conn.as_ref().is_some_and(|c| c.wants_write()) {
            let _ = self.tx_pass_batch(inner, &mut budget, batch);
        }
    }

    /// How often the progress thread looks at this busy-polled QP's clock whatever the
    /// engine asks for ([`softwarp_engine::qp::Timers::look_period`]): it cannot see when
    /// the polls' receives end.
    pub(crate) fn look_period(&self) -> Option<Duration> {
        self.lock().qp.timers().look_period()
    }

    /// The progress thread's timer look: the engine's clock is told the time
    /// ([`Qp::handle_timeout`]: the receive stall of [`ConnectOptions::rx_stall_timeout`],
    /// the first-FPDU hold of [`ConnectOptions::first_fpdu_delay`]); when it acted, what it
    /// queued goes out and its completions and events are delivered. Skips a QP another
    /// thread holds: that thread is moving its bytes.
    pub(crate) fn on_timer(&self, now: Instant) -> TimerLook {
        let Some(mut g) = sync::try_lock(&self.inner) else {
            return TimerLook::Busy;
        };
        let inner = &mut *g;
        if inner.conn.is_none() {
            return TimerLook::Next(None);
        }
        let before = inner.qp.state();
        let waited = inner.qp.rnr_waiting();
        if !inner.qp.handle_timeout(now) {
            return TimerLook::Next(inner.qp.poll_timeout());
        }
        if waited && !inner.qp.rnr_waiting() {
            tracing::warn!(
                qp = self.qp_num,
                wait = ?inner.qp.timers().rnr_wait,
                "no receive was posted for a Send within the RNR wait: stream terminated"
            );
            // The pass reads the rest of the held FPDU and sends the Terminate.
            return TimerLook::Acted;
        }
        if inner.qp.state() != before && !matches!(inner.qp.state(), QpState::Rts) {
            tracing::warn!(
                qp = self.qp_num,
                timeout = ?inner.qp.timers().rx_stall,
                "the peer stopped in the middle of an FPDU: stream terminated"
            );
        }
        let mut budget = PASS_BUDGET;
        let _ = self.tx_pass(inner, &mut budget);
        self.drain(inner);
        TimerLook::Acted
    }
}
