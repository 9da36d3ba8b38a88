//! Epoll registration of a QP's socket with the progress thread, and the two ways the
//! progress thread takes a busy-polled QP (whose socket stays out of the poller while the
//! application polls) over when the polls stop: the write watchdog (bytes pending behind a
//! full socket) and the receive take-over (bytes waiting to be read), so that a QP in
//! busy-poll mode never stalls because nobody polls its CQ.

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use mio::{Interest, Registry, Token};
use softwarp_engine::qp::QpState;

use super::conn::RxTakeover;
use super::{QpInner, QpShared};
use crate::runtime::sys;
use crate::sync;

/// How often an armed write watchdog looks whether the application still busy-polls.
const WATCH_PERIOD: Duration = Duration::from_millis(5);

/// Service passes in a row that find nothing to read while the application polls, after
/// which the progress thread hands a taken-over QP back to the polls
/// ([`QpShared::rx_hand_back`]).
const HAND_BACK_AFTER: u8 = 4;

/// What a look at the write watchdog found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WatchLook {
    /// Not armed: a normal pass.
    NotArmed,
    /// The application polled since the last look: leave the pass to it.
    AppActive,
    /// Nothing was left to send: the watchdog is off again, no pass.
    Disarmed,
    /// No poll since the last look: the progress thread takes over (now registered for
    /// write readiness).
    TakeOver,
}

impl QpShared {
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
                conn.registered = true;
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
    pub(super) fn arm_watchdog(&self, inner: &mut QpInner) {
        let Some(conn) = inner.conn.as_mut() else {
            return;
        };
        if conn.registered || conn.watch.is_some() {
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

    /// The progress thread's look at the write watchdog (see [`Conn::watch`]): `AppActive`
    /// while the application's passes go on (the pass is left to them), `Disarmed` once
    /// nothing is left to send, `TakeOver` after a look at least [`WATCH_PERIOD`] after the
    /// previous one finds no pass in between (the socket is then registered for write
    /// readiness and the progress thread does the pass itself), `NotArmed` otherwise.
    pub(super) fn watchdog(&self, inner: &mut QpInner, registry: &Registry) -> WatchLook {
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
            return WatchLook::AppActive;
        }
        if polls != seen {
            conn.watch = Some((polls, now));
            return WatchLook::AppActive;
        }
        conn.watch = None;
        conn.tx_takeover = Some(polls);
        inner.watch_takeovers += 1;
        if let Some(token) = conn.token.filter(|_| !conn.registered) {
            match registry.register(&mut conn.stream, token, Interest::WRITABLE) {
                Ok(()) => conn.registered = true,
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
    pub(super) fn return_to_busy_polls(&self, inner: &mut QpInner, registry: &Registry) {
        if inner.qp.state() != QpState::Rts || inner.close_kicked || inner.qp.wants_tx() {
            return;
        }
        let Some(conn) = inner.conn.as_mut() else {
            return;
        };
        if conn.registered && !conn.read_interest && registry.deregister(&mut conn.stream).is_ok() {
            conn.registered = false;
            conn.tx_takeover = None;
        }
    }

    /// After a service pass of a busy-polled QP whose writing the progress thread took over
    /// from the watchdog ([`QpShared::watchdog`]) and which still has bytes pending: when
    /// the application made a pass since the take-over (it posts or polls again: it was
    /// only descheduled, or paused) and the socket is full again, its socket leaves the
    /// poller and the polls write again, with the watchdog armed. Without this, a sender
    /// that always has work queued (a bandwidth run) never becomes idle, so
    /// [`QpShared::return_to_busy_polls`] never hands the socket back: every later post
    /// would only queue for the progress thread, a third thread woken at every drain
    /// beside the two that poll.
    pub(super) fn tx_hand_back(&self, inner: &mut QpInner, registry: &Registry) {
        let passes = inner.app_passes;
        let open = inner.qp.state() == QpState::Rts && !inner.close_kicked;
        let Some(conn) = inner.conn.as_mut() else {
            return;
        };
        let Some(seen) = conn.tx_takeover else {
            return;
        };
        if !conn.registered || conn.read_interest {
            // Not the watchdog's registration any more (the receive take-over's, or none).
            conn.tx_takeover = None;
            return;
        }
        // Only behind a full socket, where the re-armed watchdog covers polls that stop
        // again; a pass that ended on its budget leaves the rest to the progress thread.
        if passes == seen || !open || conn.read_closed || conn.write_failed || !conn.tx_full {
            return;
        }
        if let Err(e) = registry.deregister(&mut conn.stream) {
            tracing::error!(qp = self.qp_num, error = %e, "epoll deregistration failed");
            return;
        }
        conn.registered = false;
        conn.tx_takeover = None;
        inner.watch_handbacks += 1;
        tracing::debug!(qp = self.qp_num, "busy polls are back: they write again");
        self.arm_watchdog(inner);
    }

    /// Whether the QP is busy-polled (its receive CQ is): the progress thread then looks at
    /// it every [`RX_LOOK_PERIOD`](crate::runtime::progress::RX_LOOK_PERIOD).
    pub(crate) fn busy_polled(&self) -> bool {
        self.recv_cq
            .busy_poll
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The progress thread's receive look at a busy-polled QP that the application's polls
    /// read: when the application did nothing on it since the previous look (no pass, that
    /// is no post and no poll of an empty CQ; no receive posted; no completion taken from
    /// its CQs) and the socket had bytes to read (or an end of stream) at both looks,
    /// nobody is polling its CQ; the
    /// progress thread takes the QP over (its socket is registered for read and write
    /// readiness) until the polls are back ([`QpShared::rx_hand_back`]). Returns true then
    /// (the QP needs a service pass now). Skips a QP another thread holds: that thread is
    /// moving its bytes.
    pub(crate) fn rx_look(&self, registry: &Registry) -> bool {
        let Some(mut g) = sync::try_lock(&self.inner) else {
            return false;
        };
        let inner = &mut *g;
        if inner.close_kicked || inner.qp.state() != QpState::Rts {
            return false;
        }
        let passes = inner.app_passes;
        // Each count only grows: their sum changes when any does.
        let activity = passes
            .wrapping_add(inner.recv_posts)
            .wrapping_add(self.recv_cq.polled())
            .wrapping_add(self.send_cq.polled());
        let Some(conn) = inner.conn.as_mut() else {
            return false;
        };
        let Some(token) = conn.token else {
            return false;
        };
        if conn.read_interest || conn.read_closed {
            return false;
        }
        // A failed poll says readable: the service pass then meets the error.
        let readable =
            sys::poll_readable(conn.stream.as_fd(), Some(Duration::ZERO)).unwrap_or(true);
        let before = conn.rx_look.replace((activity, readable));
        // Bytes that waited unread from one look to the next, with the application idle:
        // not bytes that came just before its first poll (after a connect, say).
        if before != Some((activity, true)) || !readable {
            return false;
        }
        let both = Interest::READABLE | Interest::WRITABLE;
        let r = if conn.registered {
            registry.reregister(&mut conn.stream, token, both)
        } else {
            registry.register(&mut conn.stream, token, both)
        };
        if let Err(e) = r {
            tracing::error!(qp = self.qp_num, error = %e, "epoll registration failed");
            return false;
        }
        conn.registered = true;
        conn.read_interest = true;
        // Registered for write readiness too: the write watchdog has nothing left to do.
        conn.watch = None;
        conn.tx_takeover = None;
        conn.rx_takeover = Some(Box::new(RxTakeover {
            seen: passes,
            recv_posts: inner.recv_posts,
            idle: 0,
        }));
        inner.rx_takeovers += 1;
        tracing::debug!(
            qp = self.qp_num,
            "busy polls stopped with bytes to read: the progress thread reads"
        );
        true
    }

    /// After a service pass of a QP the progress thread took over ([`QpShared::rx_look`]):
    /// the application's polls are back, and the socket leaves the poller again (the polls
    /// read alone, no progress thread wake-up per message), when since the previous service
    /// pass it posted receives (it takes receive completions and reposts: a Send consumer)
    /// or when [`HAND_BACK_AFTER`] passes in a row found nothing to read (`read_any` false)
    /// while it made passes (its polls read first). Not on its polls or posts alone: a
    /// program that spins on its memory for an RDMA Write (`ib_write_lat`) polls its CQ
    /// for its own sends' completions, and would stall at every message if that handed
    /// the reading back. A QP that is closing, or has bytes to send, stays with the
    /// progress thread for now.
    pub(super) fn rx_hand_back(&self, inner: &mut QpInner, registry: &Registry, read_any: bool) {
        let (passes, recv_posts) = (inner.app_passes, inner.recv_posts);
        let open = inner.qp.state() == QpState::Rts && !inner.close_kicked && !inner.qp.wants_tx();
        let Some(conn) = inner.conn.as_mut() else {
            return;
        };
        let Some(t) = conn.rx_takeover.as_mut() else {
            return;
        };
        let polled = passes != t.seen;
        let reposted = recv_posts != t.recv_posts;
        t.seen = passes;
        t.recv_posts = recv_posts;
        if read_any || !polled {
            t.idle = 0;
        } else {
            t.idle = t.idle.saturating_add(1);
        }
        if !(reposted || t.idle >= HAND_BACK_AFTER) || !open || conn.read_closed {
            return;
        }
        if let Err(e) = registry.deregister(&mut conn.stream) {
            tracing::error!(qp = self.qp_num, error = %e, "epoll deregistration failed");
            return;
        }
        conn.registered = false;
        conn.read_interest = false;
        conn.rx_takeover = None;
        conn.tx_takeover = None;
        conn.rx_look = None;
        inner.rx_handbacks += 1;
        tracing::debug!(qp = self.qp_num, "busy polls are back: they read again");
    }
}
