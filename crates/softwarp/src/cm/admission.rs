//! Admission control of the connection manager: how many connections a listener holds, and
//! what was shed.
//!
//! A listener holds a connection from `accept` until the application answers its request:
//! while its MPA Request is read (negotiating) and while its [`super::ConnectRequest`] waits
//! (unanswered). At most `backlog` ([`super::ListenOptions::backlog`]) are held; at the bound
//! the channel's thread stops calling `accept`, and further connections wait in the kernel's
//! accept queue (which is `backlog` long too, then the kernel drops SYNs), as with a plain
//! TCP listener whose application is slow. A [`Slot`] is one held connection: it travels
//! from the negotiating job into the request and gives its place back when dropped.
//!
//! Connections that never finish their MPA Request (silent, stopped halfway, trickling a
//! byte at a time) would otherwise keep a full listener's places until their timeout, and
//! a peer that keeps opening them would keep good clients in the kernel's queue for ever.
//! So while the listener is full and the kernel signals another connection waiting, the
//! channel's thread closes the negotiating connection that has waited longest for its
//! Request, once it has waited [`EVICT_AGE`] (never a delivered request: those belong to
//! the application), and accepts the waiting one in its place; each eviction is a
//! [`super::CmEvent::RequestError`] with [`crate::MpaError::Evicted`] and counts in
//! [`ListenerStats::evicted`]. A good client's Request follows its TCP handshake within a
//! round trip, far inside [`EVICT_AGE`].
//!
//! What one held connection costs while negotiating: its accepted socket, one epoll
//! registration, a 532-byte frame buffer (MPA header and the largest private data) and its
//! job record (about 200 bytes) on the channel's thread, and no timer of its own (the
//! thread's poll waits until the earliest deadline); no thread, whatever the number.
//!
//! No I/O here besides waking the channel's thread.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use softwarp_ras::errlog::{self, CriticalEvent, CriticalKind};

use super::channel::ChannelShared;
use super::event::ListenerId;
use crate::sync::lock;

/// Error log entries about one listener or channel are at most this frequent.
const REPORT_INTERVAL: Duration = Duration::from_secs(10);

/// How long a negotiating connection keeps its place at a full listener while another
/// connection waits (see the module docs); its own timeout still applies when shorter.
pub(crate) const EVICT_AGE: Duration = Duration::from_secs(1);

/// Counters of one listener ([`super::CmListener::stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ListenerStats {
    /// The bound on connections held (the listen backlog).
    pub backlog: usize,
    /// Connections accepted whose MPA Request is still being read.
    pub negotiating: usize,
    /// Requests delivered and not answered yet (accept, reject or drop answers one).
    pub unanswered: usize,
    /// TCP connections accepted.
    pub accepted: u64,
    /// Requests delivered as [`super::CmEvent::ConnectRequest`].
    pub requests: u64,
    /// Connections closed before a request was delivered (garbage, refused, silent past
    /// the timeout, closed by the peer).
    pub refused: u64,
    /// Times the listener stopped accepting because `backlog` connections were held (the
    /// next ones waited in the kernel's accept queue).
    pub backlog_full: u64,
    /// Negotiating connections closed to make room for a waiting one (also counted in
    /// `refused`); see [`crate::MpaError::Evicted`].
    pub evicted: u64,
}

/// What one listener holds and counts; shared by the channel's thread, the listener handle
/// and the requests.
#[derive(Debug)]
pub(crate) struct ListenerState {
    pub(crate) id: ListenerId,
    pub(crate) local_addr: SocketAddr,
    limit: usize,
    held: AtomicUsize,
    negotiating: AtomicUsize,
    accepted: AtomicU64,
    requests: AtomicU64,
    refused: AtomicU64,
    backlog_full: AtomicU64,
    evicted: AtomicU64,
    last_report: Mutex<Option<Instant>>,
}

impl ListenerState {
    pub(crate) fn new(id: ListenerId, local_addr: SocketAddr, backlog: u32) -> Self {
        Self {
            id,
            local_addr,
            limit: usize::try_from(backlog).unwrap_or(usize::MAX).max(1),
            held: AtomicUsize::new(0),
            negotiating: AtomicUsize::new(0),
            accepted: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            backlog_full: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            last_report: Mutex::new(None),
        }
    }

    /// True while fewer than `backlog` connections are held.
    pub(crate) fn has_room(&self) -> bool {
        self.held.load(Ordering::Acquire) < self.limit
    }

    /// Takes a place for a connection just accepted (the caller checked [`Self::has_room`];
    /// only the channel's thread takes places).
    pub(crate) fn take_slot(self: &Arc<Self>, channel: Weak<ChannelShared>) -> Slot {
        self.held.fetch_add(1, Ordering::AcqRel);
        self.negotiating.fetch_add(1, Ordering::AcqRel);
        self.accepted.fetch_add(1, Ordering::Relaxed);
        Slot {
            listener: Arc::clone(self),
            channel,
            negotiating: true,
        }
    }

    /// The listener stopped accepting at its bound: counted, traced, and reported to the
    /// error log (at most every [`REPORT_INTERVAL`]).
    pub(crate) fn backlog_reached(&self) {
        let n = self
            .backlog_full
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        tracing::warn!(
            listener = %self.id,
            local = %self.local_addr,
            backlog = self.limit,
            times = n,
            "listener backlog full: new connections wait in the kernel's accept queue"
        );
        if due(&self.last_report) {
            errlog::report(&CriticalEvent::new(
                CriticalKind::CmOverload,
                format!(
                    "{} on {}: {} connections held (negotiating or unanswered), backlog \
                     full {n} time(s); new connections wait in the kernel's accept queue",
                    self.id, self.local_addr, self.limit
                ),
            ));
        }
    }

    /// A negotiating connection was closed to make room (see the module docs).
    pub(crate) fn evicted_one(&self) {
        self.evicted.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn stats(&self) -> ListenerStats {
        let held = self.held.load(Ordering::Acquire);
        let negotiating = self.negotiating.load(Ordering::Acquire);
        ListenerStats {
            backlog: self.limit,
            negotiating,
            unanswered: held.saturating_sub(negotiating),
            accepted: self.accepted.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            backlog_full: self.backlog_full.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
        }
    }
}

/// One connection held by a listener. Dropping it gives the place back and wakes the
/// channel's thread, which resumes accepting if it had stopped at the bound.
#[derive(Debug)]
pub(crate) struct Slot {
    listener: Arc<ListenerState>,
    channel: Weak<ChannelShared>,
    negotiating: bool,
}

impl Slot {
    pub(crate) fn listener_id(&self) -> ListenerId {
        self.listener.id
    }

    pub(crate) fn channel(&self) -> Weak<ChannelShared> {
        self.channel.clone()
    }

    /// The connection is closed to make room for a newer one (counted; the drop that
    /// follows counts it as refused too).
    pub(crate) fn listener_evicted(&self) {
        self.listener.evicted_one();
    }

    /// The request was delivered: the connection now waits for the application's answer.
    pub(crate) fn delivered(&mut self) {
        if std::mem::take(&mut self.negotiating) {
            self.listener.negotiating.fetch_sub(1, Ordering::AcqRel);
            self.listener.requests.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.negotiating {
            // Closed before a request was delivered.
            self.listener.negotiating.fetch_sub(1, Ordering::AcqRel);
            self.listener.refused.fetch_add(1, Ordering::Relaxed);
        }
        self.listener.held.fetch_sub(1, Ordering::AcqRel);
        if let Some(ch) = self.channel.upgrade() {
            ch.wake_worker();
        }
    }
}

/// True (and remembers now) if nothing was reported within [`REPORT_INTERVAL`].
pub(crate) fn due(last: &Mutex<Option<Instant>>) -> bool {
    let now = Instant::now();
    let mut last = lock(last);
    let due = last.is_none_or(|t| now.saturating_duration_since(t) >= REPORT_INTERVAL);
    if due {
        *last = Some(now);
    }
    due
}
