//! Connection manager events ([`CmEvent`], after `rdma_cm_event`) and the queue behind an
//! event channel's file descriptor. No I/O here besides signalling the eventfd.

use std::collections::VecDeque;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use softwarp_ras::deadline::Deadline;
use softwarp_ras::errlog::{self, CriticalEvent, CriticalKind};

use super::request::ConnectRequest;
use crate::error::Error;
use crate::runtime::sys::EventFd;
use crate::sync::{self, lock};
use crate::verbs::qp::options::ConnectionInfo;

/// Identifies one connection (active or passive) in events: [`crate::CmId::conn_id`],
/// [`ConnectRequest::conn_id`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub(crate) u64);

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "conn#{}", self.0)
    }
}

/// Identifies a listener in events: [`crate::CmListener::id`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ListenerId(pub(crate) u64);

impl fmt::Display for ListenerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "listener#{}", self.0)
    }
}

/// Why an established connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DisconnectReason {
    /// This side disconnected gracefully ([`crate::CmId::disconnect`]) or destroyed its QP.
    Local,
    /// This side reset the connection ([`crate::CmId::abort`]).
    Aborted,
    /// The peer closed the connection (TCP FIN) while it was in use here.
    PeerClosed,
    /// The connection failed: reset by the peer, or a read or write error.
    ConnectionLost,
    /// The QP entered the Error state (a Terminate was sent or received, the QP was moved
    /// to Error), and the connection was closed.
    QpError,
    /// The device failed (`Device::fault` says how); the QP is in Error.
    DeviceFailed,
    /// The network under the connection went away: its local address was removed, or its
    /// interface went down or disappeared ("unexpected close"; `QueuePair::error_reason`
    /// has the detail). The QP was terminated at once.
    NetworkGone,
    /// The peer stopped answering: the kernel dropped the connection after keepalive
    /// probes ([`crate::ConnectOptions::tcp_keepalive`]) or sent data
    /// ([`crate::ConnectOptions::tcp_user_timeout`]) went unanswered past their bound.
    PeerUnreachable,
}

/// An event of the connection manager.
#[derive(Debug)]
#[non_exhaustive]
pub enum CmEvent {
    /// A peer's MPA Request arrived at a listener: accept or reject it
    /// ([`ConnectRequest::accept`], [`ConnectRequest::reject`]); dropping it rejects it.
    ConnectRequest(ConnectRequest),
    /// The connection is established: the QP is in RTS.
    Established {
        /// The connection.
        id: ConnId,
        /// What negotiation settled.
        info: ConnectionInfo,
    },
    /// The responder rejected the connection (MPA Reply with the R bit).
    Rejected {
        /// The connection.
        id: ConnId,
        /// The private data of the reject Reply (the responder's reason, if any).
        private_data: Vec<u8>,
    },
    /// The TCP connection could not be made (refused, no route, timed out).
    Unreachable {
        /// The connection.
        id: ConnId,
        /// Why.
        error: Error,
    },
    /// MPA negotiation failed (bad or incompatible Reply, peer silent past the timeout,
    /// cancelled, or the QP could not be established). The QP stays Idle.
    ConnectError {
        /// The connection.
        id: ConnId,
        /// Why.
        error: Error,
    },
    /// The connection ended; the QP is in Error and its outstanding work requests
    /// completed with a flush status (or will, once the connection is closed).
    Disconnected {
        /// The connection.
        id: ConnId,
        /// Why.
        reason: DisconnectReason,
    },
    /// The TCP connection is closed and the QP let go of it: it can be reset and reused.
    TimewaitExit {
        /// The connection.
        id: ConnId,
    },
    /// What arrived at a listener was refused before any request was delivered (not an MPA
    /// Request, unsupported revision or markers, peer silent past the timeout, ...): it was
    /// answered with a reject Reply where the RFCs call for one, and closed.
    RequestError {
        /// The listener.
        listener: ListenerId,
        /// The peer's address.
        peer: SocketAddr,
        /// Why.
        error: Error,
    },
}

impl CmEvent {
    /// The connection the event is about, if it is about one.
    pub fn conn_id(&self) -> Option<ConnId> {
        match self {
            CmEvent::ConnectRequest(r) => Some(r.conn_id()),
            CmEvent::Established { id, .. }
            | CmEvent::Rejected { id, .. }
            | CmEvent::Unreachable { id, .. }
            | CmEvent::ConnectError { id, .. }
            | CmEvent::Disconnected { id, .. }
            | CmEvent::TimewaitExit { id } => Some(*id),
            CmEvent::RequestError { .. } => None,
        }
    }

    /// The listener the event is about, if it is about one.
    pub fn listener_id(&self) -> Option<ListenerId> {
        match self {
            CmEvent::ConnectRequest(r) => Some(r.listener_id()),
            CmEvent::RequestError { listener, .. } => Some(*listener),
            _ => None,
        }
    }

    /// The event's name, as in `rdma_event_str` (for logs).
    pub fn name(&self) -> &'static str {
        match self {
            CmEvent::ConnectRequest(_) => "CONNECT_REQUEST",
            CmEvent::Established { .. } => "ESTABLISHED",
            CmEvent::Rejected { .. } => "REJECTED",
            CmEvent::Unreachable { .. } => "UNREACHABLE",
            CmEvent::ConnectError { .. } => "CONNECT_ERROR",
            CmEvent::Disconnected { .. } => "DISCONNECTED",
            CmEvent::TimewaitExit { .. } => "TIMEWAIT_EXIT",
            CmEvent::RequestError { .. } => "REQUEST_ERROR",
        }
    }

    /// True for the events that end a connection attempt: established or failed.
    pub fn ends_attempt(&self) -> bool {
        matches!(
            self,
            CmEvent::Established { .. }
                | CmEvent::Rejected { .. }
                | CmEvent::Unreachable { .. }
                | CmEvent::ConnectError { .. }
        )
    }
}

/// Request errors (garbage or refused connections at a listener) kept on a channel at most;
/// more are dropped and counted ([`crate::CmEventChannel::events_shed`]). The other events
/// are bounded by what they are about: connection requests by the listeners' backlogs,
/// connection events by the application's own connections.
pub const MAX_QUEUED_REQUEST_ERRORS: usize = 128;

/// The events of one channel: a queue with a blocking take, and an eventfd that is readable
/// exactly while the queue is not empty.
#[derive(Debug)]
pub(crate) struct EventQueue {
    q: Mutex<Queue>,
    cv: Condvar,
    fd: EventFd,
    shed: AtomicU64,
    last_report: Mutex<Option<Instant>>,
}

#[derive(Debug, Default)]
struct Queue {
    events: VecDeque<CmEvent>,
    /// `RequestError`s among `events`.
    request_errors: usize,
}

impl EventQueue {
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(Self {
            q: Mutex::new(Queue::default()),
            cv: Condvar::new(),
            fd: EventFd::new()?,
            shed: AtomicU64::new(0),
            last_report: Mutex::new(None),
        })
    }

    pub(crate) fn fd(&self) -> &EventFd {
        &self.fd
    }

    pub(crate) fn push(&self, ev: CmEvent) {
        tracing::debug!(event = ev.name(), conn = ?ev.conn_id(), "CM event");
        let mut q = lock(&self.q);
        if let CmEvent::RequestError { listener, peer, .. } = &ev {
            if q.request_errors >= MAX_QUEUED_REQUEST_ERRORS {
                drop(q);
                self.shed_one(*listener, *peer);
                return;
            }
            q.request_errors = q.request_errors.saturating_add(1);
        }
        // Every event writes the eventfd (not only the first of a run): an edge-triggered
        // waiter (tokio's `AsyncFd`) waiting for one connection's event while others stay
        // queued wakes again at the next event.
        if let Err(e) = self.fd.signal() {
            tracing::error!(error = %e, "cannot signal the CM event channel");
        }
        q.events.push_back(ev);
        drop(q);
        self.cv.notify_all();
    }

    /// A request error found [`MAX_QUEUED_REQUEST_ERRORS`] queued: dropped, counted, traced,
    /// and reported to the error log (at most every few seconds).
    fn shed_one(&self, listener: ListenerId, peer: SocketAddr) {
        let n = self.shed.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        tracing::warn!(%listener, %peer, shed = n, "CM event queue full: request error dropped");
        if super::admission::due(&self.last_report) {
            errlog::report(&CriticalEvent::new(
                CriticalKind::CmOverload,
                format!(
                    "CM event channel: {MAX_QUEUED_REQUEST_ERRORS} request errors unread, \
                     {n} more dropped so far (last from {peer} at {listener})"
                ),
            ));
        }
    }

    /// Events dropped because the queue held [`MAX_QUEUED_REQUEST_ERRORS`] request errors.
    pub(crate) fn shed(&self) -> u64 {
        self.shed.load(Ordering::Relaxed)
    }

    /// The oldest event matching `pred`, waiting at most `timeout` (`None`: no limit).
    pub(crate) fn take(
        &self,
        timeout: Option<Duration>,
        mut pred: impl FnMut(&CmEvent) -> bool,
    ) -> Option<CmEvent> {
        let deadline = Deadline::from_timeout(timeout);
        let mut q = lock(&self.q);
        loop {
            if let Some(i) = q.events.iter().position(&mut pred) {
                let ev = q.events.remove(i);
                if matches!(ev, Some(CmEvent::RequestError { .. })) {
                    q.request_errors = q.request_errors.saturating_sub(1);
                }
                if q.events.is_empty() {
                    if let Err(e) = self.fd.drain() {
                        tracing::error!(error = %e, "cannot reset the CM event channel");
                    }
                }
                return ev;
            }
            match deadline.remaining() {
                None => q = sync::wait(&self.cv, q),
                Some(left) if left.is_zero() => return None,
                Some(left) => q = sync::wait_timeout(&self.cv, q, left),
            }
        }
    }

    /// Events waiting.
    pub(crate) fn len(&self) -> usize {
        lock(&self.q).events.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::sys::poll_readable;
    use std::os::fd::AsFd;

    fn readable(q: &EventQueue) -> bool {
        poll_readable(q.fd().as_fd(), Some(Duration::ZERO)).unwrap()
    }

    #[test]
    fn the_fd_is_readable_exactly_while_events_wait() {
        let q = EventQueue::new().unwrap();
        assert!(!readable(&q));
        q.push(CmEvent::TimewaitExit { id: ConnId(1) });
        q.push(CmEvent::TimewaitExit { id: ConnId(2) });
        assert!(readable(&q));
        // Taking by predicate leaves the others, in order.
        let e = q.take(Some(Duration::ZERO), |e| e.conn_id() == Some(ConnId(2)));
        assert_eq!(e.and_then(|e| e.conn_id()), Some(ConnId(2)));
        assert!(readable(&q));
        assert_eq!(q.len(), 1);
        let e = q.take(Some(Duration::ZERO), |_| true);
        assert_eq!(e.and_then(|e| e.conn_id()), Some(ConnId(1)));
        assert!(!readable(&q));
        assert!(q.take(Some(Duration::from_millis(5)), |_| true).is_none());
    }

    #[test]
    fn a_blocked_take_wakes_up_for_a_matching_event_only() {
        let q = std::sync::Arc::new(EventQueue::new().unwrap());
        let q2 = std::sync::Arc::clone(&q);
        let t = std::thread::spawn(move || {
            q2.take(Some(Duration::from_secs(10)), |e| {
                e.conn_id() == Some(ConnId(7))
            })
        });
        q.push(CmEvent::TimewaitExit { id: ConnId(6) });
        std::thread::sleep(Duration::from_millis(20));
        q.push(CmEvent::TimewaitExit { id: ConnId(7) });
        let got = t.join().unwrap();
        assert_eq!(got.and_then(|e| e.conn_id()), Some(ConnId(7)));
        assert_eq!(q.len(), 1, "the other event stays");
    }

    #[test]
    fn events_name_their_connection_and_listener() {
        let e = CmEvent::RequestError {
            listener: ListenerId(3),
            peer: SocketAddr::from(([127, 0, 0, 1], 9)),
            error: Error::Timeout(Duration::ZERO),
        };
        assert_eq!((e.conn_id(), e.listener_id()), (None, Some(ListenerId(3))));
        assert_eq!(e.name(), "REQUEST_ERROR");
        assert!(!e.ends_attempt());
        let e = CmEvent::Unreachable {
            id: ConnId(4),
            error: Error::Timeout(Duration::ZERO),
        };
        assert!(e.ends_attempt());
        assert_eq!(format!("{}", ConnId(4)), "conn#4");
    }
}
