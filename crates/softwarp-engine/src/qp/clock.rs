//! The QP's clock: the time-based rules of a connection are engine decisions, made from
//! the instants the runtime passes in (the engine never reads a clock and never sleeps).
//!
//! - **Receive stall** ([`Timers::rx_stall`]): a peer that stops inside an FPDU holds the
//!   memory the FPDU is placed into and the receive it fills. While the peer is inside an
//!   FPDU the QP asks to be looked at every [`Timers::look_period`]; a look that finds no
//!   byte received since a look at least the timeout ago terminates the stream
//!   ([`Qp::handle_rx_stall`]). A stall is found between the timeout and the timeout plus one
//!   period after the last byte.
//! - **First-FPDU hold** ([`Timers::first_fpdu_hold`]): the MPA initiator sends no FPDU
//!   (a Terminate excepted) until the hold has passed; work posted meanwhile is queued.
//!   Linux siw as responder installs its FPDU receive path only after sending its Reply,
//!   so an FPDU right behind the Reply can be lost.
//! - **Responder's gate bound** ([`Timers::responder_gate`]): the MPA responder sends no
//!   FPDU before the initiator's first one (RFC 5044, the gate of
//!   `StreamConfig::responder_waits`), at most this long; then it sends. An initiator that
//!   waits for the responder to speak first (perftest's `ib_write_lat` over a peer without
//!   RFC 6581's RTR, such as stock Linux siw) would otherwise wait for ever, and so would we.
//!   The rule protects an initiator that is not yet ready for FPDUs right after the Reply
//!   (a connection handed from the host's stack to an RNIC); the bound is room for that.
//! - **Close hold** ([`Qp::hold_close`]): the runtime closes the transport connection (its
//!   FIN) only once the peer closed its side or the hold's instant passed. Linux siw fails
//!   a Send whose system call is still running when the peer's FIN is processed, although
//!   the peer received it; the end that closes first waits a while for the other to close.
//!   The hold delays the FIN only: the QP's state (Closing, Error after a destroy) and its
//!   work requests are what they would be without it.
//!
//! - **RNR wait** ([`Timers::rnr_wait`]): a Send (or RFC 7306 Immediate Data) whose header
//!   finds no receive posted (RQ or SRQ) is held, header complete, and the QP reads nothing
//!   more from the stream (TCP's flow control then stops the peer, as InfiniBand's RNR
//!   NAK and retry would). A receive posted and the next [`Qp::recv_from`] resume it. The
//!   wait's clock starts at the first [`Qp::handle_timeout`] after the header was held
//!   ([`Qp::poll_timeout`] asks for one at once); once the bound has passed, the held
//!   Send fails as it did without the wait: the Terminate for no receive buffer (DDP,
//!   untagged buffer error), after the FPDU's CRC check, and the flush. Off (`None`),
//!   such a Send fails at once.
//!
//! The runtime's part: [`Qp::set_timers`] once the stream is established (with the time
//! then), and after any input [`Qp::poll_timeout`]: when that instant has come, call
//! [`Qp::handle_timeout`] with the time (earlier calls are harmless) and, when it acted, go
//! through the polling order (`send_to`, completions, events). Tests pass made-up instants.
//! No I/O here.

use std::time::{Duration, Instant};

use super::{Qp, QpState};

/// Shortest interval between two receive stall looks.
pub const STALL_LOOK_MIN: Duration = Duration::from_millis(5);

/// The time-based rules the runtime turns on for a QP ([`Qp::set_timers`]); none by
/// default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Timers {
    /// Terminate the stream when the peer stops inside an FPDU for this long.
    pub rx_stall: Option<Duration>,
    /// Send no FPDU (a Terminate excepted) for this long after [`Qp::set_timers`] (one the
    /// clock cannot represent holds until the QP fails).
    pub first_fpdu_hold: Option<Duration>,
    /// A responder whose gate waits for the initiator's first FPDU (RFC 5044) opens it after
    /// this long without one (`None`: waits for ever).
    pub responder_gate: Option<Duration>,
    /// Hold a Send that finds no receive posted for at most this long before failing the
    /// stream (the RNR wait, see the module docs; one the clock cannot represent waits
    /// until a receive comes). `None`: fail at once.
    pub rnr_wait: Option<Duration>,
}

impl Timers {
    /// How often the receive stall rule looks while the peer is inside an FPDU: a quarter
    /// of the timeout, at least [`STALL_LOOK_MIN`]. A runtime that cannot see when a
    /// receive ended (a busy-polled QP, read by the application's threads) looks this often
    /// whatever [`Qp::poll_timeout`] says.
    pub fn look_period(&self) -> Option<Duration> {
        self.rx_stall.map(|t| (t / 4).max(STALL_LOOK_MIN))
    }
}

/// The clock's state in a QP.
#[derive(Debug, Default)]
pub(super) struct Clock {
    timers: Timers,
    /// The latest instant the runtime passed in.
    now: Option<Instant>,
    /// Stream bytes received at the last look that found new ones, and that look's time.
    stall_mark: Option<(u64, Instant)>,
    /// End of the first-FPDU hold, while it holds.
    hold_until: Option<Instant>,
    /// End of the close hold, while it holds ([`Qp::hold_close`]).
    close_until: Option<Instant>,
    /// When the responder's gate opens without the initiator's first FPDU
    /// ([`Timers::responder_gate`]), while it is closed.
    gate_until: Option<Instant>,
    /// The RNR wait being timed (`RxState::rnr_waits` when it began) and when the clock
    /// first saw it.
    rnr_since: Option<(u64, Instant)>,
}

impl Qp {
    /// Turns on the time-based rules `timers` (see the `clock` module), from `now`. The
    /// first-FPDU hold starts here.
    pub fn set_timers(&mut self, timers: Timers, now: Instant) {
        let hold = timers.first_fpdu_hold.filter(|d| !d.is_zero());
        self.clock = Clock {
            timers,
            now: Some(now),
            stall_mark: None,
            hold_until: hold.and_then(|d| now.checked_add(d)),
            close_until: None,
            gate_until: timers
                .responder_gate
                .filter(|_| self.tx.gate_until_rx)
                .and_then(|d| now.checked_add(d)),
            rnr_since: None,
        };
        self.rx.rnr_hold = timers.rnr_wait.is_some();
        if !self.rx.rnr_hold {
            // A Send held now fails as it would have without the wait.
            self.rnr_give_up();
        }
        // A hold the clock cannot represent holds until the QP fails.
        self.tx.held = hold.is_some();
    }

    /// The rules in force.
    pub fn timers(&self) -> Timers {
        self.clock.timers
    }

    /// When [`Qp::handle_timeout`] must be called next (`None`: no timer runs). An instant
    /// already past means at once.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let hold = self.clock.hold_until;
        let look = match (self.clock.timers.look_period(), self.clock.now) {
            (Some(period), Some(now)) if self.rx_in_fpdu() => match self.clock.stall_mark {
                // The peer is inside an FPDU and the clock has not looked yet.
                None => Some(now),
                Some(_) => now.checked_add(period),
            },
            _ => None,
        };
        let gate = self.clock.gate_until.filter(|_| self.tx.gate_until_rx);
        let rnr = match (self.clock.timers.rnr_wait, self.clock.now) {
            (Some(limit), Some(now)) if self.rx.rnr_waiting() => match self.clock.rnr_since {
                Some((wait, since)) if wait == self.rx.rnr_waits => since.checked_add(limit),
                // A wait the clock has not seen yet: look at once to start it.
                _ => Some(now),
            },
            _ => None,
        };
        [hold, look, self.clock.close_until, gate, rnr]
            .into_iter()
            .flatten()
            .min()
    }

    /// Sets the RNR wait's bound from now on (`None`: a Send that finds no receive posted
    /// fails at once, and one held now fails so). The other timers stay.
    pub fn set_rnr_wait(&mut self, wait: Option<Duration>) {
        self.clock.timers.rnr_wait = wait;
        self.rx.rnr_hold = wait.is_some();
        if wait.is_none() {
            self.rnr_give_up();
        }
    }

    /// Holds the close of the transport connection until `until` (see the `clock` module):
    /// [`Qp::close_held`] is true until then, unless the hold is lifted earlier by
    /// [`Qp::hold_close`] with an earlier instant. A later call keeps the earlier instant
    /// (a hold never grows). The runtime closes at once when the peer closed its side.
    pub fn hold_close(&mut self, until: Instant) {
        self.clock.close_until = Some(self.clock.close_until.map_or(until, |t| t.min(until)));
    }

    /// True while the close hold keeps the runtime from closing the connection (its instant
    /// not yet passed by the latest [`Qp::handle_timeout`]).
    pub fn close_held(&self) -> bool {
        self.clock.close_until.is_some()
    }

    /// Time has come to `now`: ends the first-FPDU hold once it has passed, starts or
    /// ends an RNR wait (ended: the held Send fails, and the next [`Qp::recv_from`] reads
    /// the rest of its FPDU and sends the Terminate), and looks for a receive stall
    /// (terminating the stream when it finds one). True when it acted: the
    /// runtime then goes through the polling order (`send_to`, completions, events).
    pub fn handle_timeout(&mut self, now: Instant) -> bool {
        let clock = &mut self.clock;
        if clock.now.is_none_or(|t| now > t) {
            clock.now = Some(now);
        }
        let mut acted = false;
        if clock.close_until.is_some_and(|t| now >= t) {
            clock.close_until = None;
            acted = true;
        }
        if clock.gate_until.is_some_and(|t| now >= t) {
            clock.gate_until = None;
            if self.tx.gate_until_rx {
                //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
                // (paraphrase) The responder sends no FPDU before the initiator's first; the
                // bound departs from it so that an initiator waiting for the responder does
                // not wait for ever.
                self.tx.gate_until_rx = false;
                acted = true;
            }
        }
        if clock.hold_until.is_some_and(|t| now >= t) {
            clock.hold_until = None;
            self.tx.held = false;
            acted = true;
        }
        if let (Some(limit), true) = (self.clock.timers.rnr_wait, self.rx.rnr_waiting()) {
            let wait = self.rx.rnr_waits;
            match self.clock.rnr_since {
                Some((w, since)) if w == wait => {
                    if now.saturating_duration_since(since) >= limit {
                        self.clock.rnr_since = None;
                        self.rnr_give_up();
                        acted = true;
                    }
                }
                _ => self.clock.rnr_since = Some((wait, now)),
            }
        }
        let Some(limit) = self.clock.timers.rx_stall else {
            return acted;
        };
        if !self.rx_in_fpdu() {
            self.clock.stall_mark = None;
            return acted;
        }
        let bytes = self.stats.rx_stream_bytes;
        match self.clock.stall_mark {
            Some((seen, since)) if seen == bytes => {
                if now.saturating_duration_since(since) >= limit {
                    self.clock.stall_mark = None;
                    self.handle_rx_stall();
                    return true;
                }
            }
            _ => self.clock.stall_mark = Some((bytes, now)),
        }
        acted
    }

    /// True while the first-FPDU hold keeps this side's FPDUs back.
    pub fn is_held(&self) -> bool {
        self.tx.held && matches!(self.state, QpState::Rts | QpState::Closing)
    }
}
