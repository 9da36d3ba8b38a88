//! Epoll registration of a QP's socket with the progress thread, and the write watchdog of
//! busy-polled QPs (whose sockets stay out of the poller while the application polls).

use std::time::{Duration, Instant};

use mio::{Interest, Registry, Token};
use softwarp_engine::qp::QpState;

use super::{QpInner, QpShared};

/// How often an armed write watchdog looks whether the application still busy-polls.
const WATCH_PERIOD: Duration = Duration::from_millis(5);

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
        }
    }
}
