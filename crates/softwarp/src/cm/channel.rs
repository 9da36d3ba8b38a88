//! [`CmEventChannel`]: the connection manager's event channel (after
//! `rdma_event_channel`), the state its handle shares with its thread (the `worker`
//! module), and blocking connects over it.
//!
//! Established connections belong to their device's progress thread; they report back
//! through the QP's hook ([`crate::verbs::qp::ConnObserver`]).

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use mio::{Poll, Waker};
use softwarp_ras::stats::{StatsBuilder, StatsSource};

use super::admission::ListenerState;
use super::attempt::{Failed, Initiator};
use super::event::{CmEvent, ConnId, EventQueue, ListenerId};
use super::id::{CmId, IdShared};
use super::listener::{CmListener, ListenOptions};
use super::reserve::PortReservation;
use super::worker::{Active, Cmd, Worker, WAKE};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::verbs::qp::options::{ConnectOptions, ConnectionInfo, Role};
use crate::verbs::qp::QueuePair;

/// State shared by a channel handle, its thread, and the connections it made.
#[derive(Debug)]
pub(crate) struct ChannelShared {
    pub(crate) events: EventQueue,
    cmd: Mutex<Sender<Cmd>>,
    waker: Waker,
    /// The channel's listeners, for statistics.
    pub(super) listeners: Mutex<Vec<Weak<ListenerState>>>,
    /// Listeners and connections of this channel whose events go to another channel's
    /// queue ([`CmListener::route_events_to`], [`CmId::route_events_to`]): this channel's
    /// thread still drives them.
    routes: Mutex<HashMap<Route, Weak<ChannelShared>>>,
}

/// What a route is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Route {
    Listener(ListenerId),
    Conn(ConnId),
}

impl Route {
    fn matches(self, ev: &CmEvent) -> bool {
        match self {
            Route::Conn(c) => ev.conn_id() == Some(c),
            Route::Listener(l) => ev.listener_id() == Some(l),
        }
    }
}

/// Listener and connection numbers, unique in the process so that events routed to
/// another channel never meet a number of its own.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl ChannelShared {
    /// Queues `ev` on this channel, or on the channel its listener or connection is routed
    /// to. A connection request of a routed listener routes its connection there too (its
    /// id lives there); a connection's last event ends its route.
    pub(crate) fn push(&self, ev: CmEvent) {
        let mut routes = lock(&self.routes);
        if routes.is_empty() {
            drop(routes);
            self.events.push(ev);
            return;
        }
        let listener_dest = ev
            .listener_id()
            .and_then(|l| routes.get(&Route::Listener(l)).cloned());
        if let (Some(dest), CmEvent::ConnectRequest(r)) = (&listener_dest, &ev) {
            routes.insert(Route::Conn(r.conn_id()), dest.clone());
        }
        let conn_dest = ev
            .conn_id()
            .and_then(|c| routes.get(&Route::Conn(c)).cloned());
        let last = matches!(
            ev,
            CmEvent::TimewaitExit { .. }
                | CmEvent::Rejected { .. }
                | CmEvent::Unreachable { .. }
                | CmEvent::ConnectError { .. }
        );
        if let (true, Some(c)) = (last, ev.conn_id()) {
            routes.remove(&Route::Conn(c));
        }
        match conn_dest.or(listener_dest).and_then(|w| w.upgrade()) {
            Some(dest) => dest.events.push(ev),
            None => self.events.push(ev),
        }
    }

    /// Routes the events of `what` (a listener or connection this channel drives) to
    /// `dest` from now on (back to this channel when `dest` is it), and moves those already
    /// queued here or at the previous destination there, in order; a listener's queued
    /// connection requests take their connections along.
    pub(crate) fn route(self: &Arc<Self>, what: Route, dest: &Arc<ChannelShared>) {
        let mut routes = lock(&self.routes);
        let previous = routes.get(&what).and_then(Weak::upgrade);
        if Arc::ptr_eq(dest, self) {
            routes.remove(&what);
        } else {
            routes.insert(what, Arc::downgrade(dest));
        }
        let sources = [Some(Arc::clone(self)), previous];
        for src in sources.iter().flatten() {
            if Arc::ptr_eq(src, dest) {
                continue;
            }
            while let Some(ev) = src.events.take(Some(Duration::ZERO), |e| {
                what.matches(e)
                    || matches!(e, CmEvent::ConnectRequest(r) if what == Route::Listener(r.listener_id()))
            }) {
                if let CmEvent::ConnectRequest(r) = &ev {
                    if Arc::ptr_eq(dest, self) {
                        routes.remove(&Route::Conn(r.conn_id()));
                    } else {
                        routes.insert(Route::Conn(r.conn_id()), Arc::downgrade(dest));
                    }
                }
                dest.events.push(ev);
            }
        }
    }

    pub(super) fn send(&self, cmd: Cmd) -> Result<()> {
        lock(&self.cmd)
            .send(cmd)
            .map_err(|_| Error::ChannelClosed)?;
        self.waker
            .wake()
            .map_err(|e| Error::io("wake the connection manager", e))
    }

    pub(super) fn next_id(&self) -> u64 {
        NEXT_ID.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn cancel(&self, id: ConnId) -> Result<()> {
        self.send(Cmd::Cancel(id))
    }

    pub(crate) fn unlisten(&self, id: ListenerId) {
        let _ = self.send(Cmd::Unlisten(id));
    }

    /// Wakes the channel's thread (a listener's place was given back).
    pub(crate) fn wake_worker(&self) {
        if let Err(e) = self.waker.wake() {
            tracing::error!(error = %e, "cannot wake the connection manager");
        }
    }

    fn live_listeners(&self) -> Vec<Arc<ListenerState>> {
        let mut all = lock(&self.listeners);
        all.retain(|w| w.strong_count() > 0);
        all.iter().filter_map(Weak::upgrade).collect()
    }
}

/// Exported with the devices' statistics (`softwarp stat`, the metrics endpoint): per
/// listener the connections held and what was shed, per channel the events dropped.
impl StatsSource for ChannelShared {
    fn collect(&self, out: &mut StatsBuilder) {
        let channel = format!("{:p}", self as *const Self);
        out.counter(
            "softwarp_cm_events_shed_total",
            "Request error events dropped because the channel held the maximum unread.",
            &[("channel", &channel)],
            self.events.shed(),
        );
        for l in self.live_listeners() {
            let s = l.stats();
            let (id, addr) = (l.id.to_string(), l.local_addr.to_string());
            let labels = [("listener", id.as_str()), ("local", addr.as_str())];
            let gauges = [
                (
                    "softwarp_cm_listener_backlog",
                    "Connections a listener holds at most.",
                    s.backlog,
                ),
                (
                    "softwarp_cm_listener_negotiating",
                    "Connections whose MPA Request is being read.",
                    s.negotiating,
                ),
                (
                    "softwarp_cm_listener_unanswered",
                    "Connection requests delivered and not answered.",
                    s.unanswered,
                ),
            ];
            for (name, help, v) in gauges {
                out.gauge_int(name, help, &labels, u64::try_from(v).unwrap_or(u64::MAX));
            }
            let counters = [
                (
                    "softwarp_cm_listener_accepted_total",
                    "TCP connections accepted.",
                    s.accepted,
                ),
                (
                    "softwarp_cm_listener_requests_total",
                    "Connection requests delivered.",
                    s.requests,
                ),
                (
                    "softwarp_cm_listener_refused_total",
                    "Connections closed before a request was delivered.",
                    s.refused,
                ),
                (
                    "softwarp_cm_listener_backlog_full_total",
                    "Times the listener stopped accepting at its backlog.",
                    s.backlog_full,
                ),
                (
                    "softwarp_cm_listener_evicted_total",
                    "Negotiating connections closed to make room for a waiting one.",
                    s.evicted,
                ),
            ];
            for (name, help, v) in counters {
                out.counter(name, help, &labels, v);
            }
        }
    }
}

/// The connection manager's event channel (after `rdma_event_channel`): listeners,
/// connection attempts and the [`CmEvent`]s they produce.
///
/// Events are read with [`CmEventChannel::get_event`] (blocking, bounded) or
/// [`CmEventChannel::try_get_event`]; the channel's file descriptor (an eventfd,
/// [`AsRawFd`]) is readable exactly while events are waiting, so it can sit in the same
/// `poll`/`epoll` loop as completion channels. Blocking conveniences:
/// [`CmEventChannel::connect_blocking`], [`CmListener::accept`].
///
/// Dropping the channel stops its thread: listeners close, attempts in progress are
/// abandoned (their QPs stay Idle). Established connections are not affected, but report
/// nothing more.
#[derive(Debug)]
pub struct CmEventChannel {
    shared: Arc<ChannelShared>,
    thread: Option<JoinHandle<()>>,
}

impl CmEventChannel {
    /// Creates a channel and starts its thread.
    pub fn new() -> Result<Self> {
        let poll = Poll::new().map_err(|e| Error::io("epoll_create", e))?;
        let waker = Waker::new(poll.registry(), WAKE).map_err(|e| Error::io("eventfd", e))?;
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(ChannelShared {
            events: EventQueue::new().map_err(|e| Error::io("eventfd", e))?,
            cmd: Mutex::new(tx),
            waker,
            listeners: Mutex::new(Vec::new()),
            routes: Mutex::new(HashMap::new()),
        });
        softwarp_ras::stats::register_source(Arc::downgrade(&shared) as Weak<dyn StatsSource>);
        let worker = Worker::new(poll, rx, Arc::clone(&shared));
        let thread = softwarp_ras::thread::spawn("softwarp-cm".into(), move || worker.run())
            .map_err(|e| Error::io("spawn the connection manager thread", e))?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// The next event, waiting at most `timeout` (`None`: no limit).
    pub fn get_event(&self, timeout: Option<Duration>) -> Result<CmEvent> {
        self.get_event_matching(timeout, |_| true)
    }

    /// The next event if one is waiting; never blocks.
    pub fn try_get_event(&self) -> Option<CmEvent> {
        self.shared.events.take(Some(Duration::ZERO), |_| true)
    }

    /// The oldest event for which `pred` holds, waiting at most `timeout`; other events stay
    /// queued in order.
    pub fn get_event_matching(
        &self,
        timeout: Option<Duration>,
        pred: impl FnMut(&CmEvent) -> bool,
    ) -> Result<CmEvent> {
        crate::availability::context::check_wait("CmEventChannel::get_event", timeout)?;
        self.shared
            .events
            .take(timeout, pred)
            .ok_or(Error::Timeout(timeout.unwrap_or_default()))
    }

    /// Events waiting to be read.
    pub fn pending_events(&self) -> usize {
        self.shared.events.len()
    }

    /// Request error events dropped because [`crate::MAX_QUEUED_REQUEST_ERRORS`] were unread (also
    /// the statistic `softwarp_cm_events_shed_total`).
    pub fn events_shed(&self) -> u64 {
        self.shared.events.shed()
    }

    /// Listens on `addr` (IPv4 or IPv6; port 0 picks a free port, see
    /// [`CmListener::local_addr`]). Requests arrive as [`CmEvent::ConnectRequest`]s after
    /// they passed the listener's policy (`opts.options`: markers, revision) and within its
    /// timeout.
    ///
    /// The listener holds at most `opts.backlog` connections, from `accept` until the
    /// application answers the request (accept, reject or drop): those whose Request is
    /// still being read and the requests delivered but unanswered. At that bound it stops
    /// accepting; further connections wait in the kernel's accept queue (`backlog` long,
    /// then the kernel drops SYNs and peers retry) until a place is given back. See
    /// [`CmListener::stats`].
    /// The listener is in the resource tracker (`softwarp resources`) while it lives,
    /// created at the caller's line.
    #[track_caller]
    pub fn listen<A: ToSocketAddrs>(&self, addr: A, opts: &ListenOptions) -> Result<CmListener> {
        let addrs = addr
            .to_socket_addrs()
            .map_err(|e| Error::io("bind listener", e))?;
        // The first address that binds, as `std::net::TcpListener::bind` takes it.
        let mut last = None;
        for a in addrs {
            match PortReservation::bind(a, None) {
                Ok(port) => return self.listen_reserved(port, opts),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            Error::io(
                "bind listener",
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "no address to bind"),
            )
        }))
    }

    /// Starts connecting `qp` (Idle, receives posted) to `addr`: TCP connect, MPA Request
    /// (with `opts`: private data, IRD/ORD, CRC, markers, peer-to-peer), Reply. Returns at
    /// once; the outcome is reported on this channel as [`CmEvent::Established`],
    /// [`CmEvent::Rejected`], [`CmEvent::Unreachable`] or [`CmEvent::ConnectError`], within
    /// `opts.timeout`. Settings that cannot work (private data too long, IRD/ORD beyond the
    /// QP, a QP that is not Idle) are refused here.
    pub fn connect<A: ToSocketAddrs>(
        &self,
        qp: &QueuePair,
        addr: A,
        opts: &ConnectOptions,
    ) -> Result<CmId> {
        let addrs = resolve(addr)?;
        let shared = qp.shared();
        let a = Initiator::new(shared, addrs, opts)?;
        let id = IdShared::new(
            ConnId(self.shared.next_id()),
            Role::Initiator,
            Arc::downgrade(&self.shared),
            Arc::downgrade(shared),
        );
        let job = Active {
            id: Arc::clone(&id),
            a,
        };
        if let Err(e) = self.shared.send(Cmd::Connect(Box::new(job))) {
            shared.abandon_connect();
            return Err(e);
        }
        Ok(CmId { shared: id })
    }

    /// [`CmEventChannel::connect`], then waits for the outcome: the connection and what
    /// negotiation settled, or the error (a reject is [`crate::MpaError::Rejected`] with the
    /// responder's private data). Other events stay queued.
    pub fn connect_blocking<A: ToSocketAddrs>(
        &self,
        qp: &QueuePair,
        addr: A,
        opts: &ConnectOptions,
    ) -> Result<(CmId, ConnectionInfo)> {
        crate::availability::context::check_blocking("CmEventChannel::connect_blocking")?;
        let id = self.connect(qp, addr, opts)?;
        let conn = id.conn_id();
        // The thread reports within `opts.timeout`; the margin only guards against a stuck
        // thread (saturating: `Duration::MAX` means no limit).
        let wait = opts.timeout.saturating_add(Duration::from_secs(5));
        let ev = self
            .shared
            .events
            .take(Some(wait), |e| {
                e.conn_id() == Some(conn) && e.ends_attempt()
            })
            .ok_or(Error::Timeout(wait))?;
        attempt_outcome(id, ev)
    }
}

/// The outcome of a connection attempt from the event that ended it.
pub(crate) fn attempt_outcome(id: CmId, ev: CmEvent) -> Result<(CmId, ConnectionInfo)> {
    match ev {
        CmEvent::Established { info, .. } => Ok((id, info)),
        CmEvent::Rejected { private_data, .. } => Err(Failed::Rejected(private_data).into_error()),
        CmEvent::Unreachable { error, .. } => Err(Failed::Unreachable(error).into_error()),
        CmEvent::ConnectError { error, .. } => Err(Failed::Mpa(error).into_error()),
        _ => Err(Error::InvalidArgument(
            "unexpected connection manager event",
        )),
    }
}

impl CmEventChannel {
    pub(crate) fn shared(&self) -> &Arc<ChannelShared> {
        &self.shared
    }
}

impl AsFd for CmEventChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.shared.events.fd().as_fd()
    }
}

impl AsRawFd for CmEventChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.shared.events.fd().as_raw_fd()
    }
}

impl Drop for CmEventChannel {
    fn drop(&mut self) {
        let _ = self.shared.send(Cmd::Shutdown);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the connection manager thread panicked");
            }
        }
    }
}

/// Resolves `addr` to socket addresses (after `rdma_resolve_addr`; uses the system
/// resolver, so a host name may block for the resolver's time).
pub fn resolve<A: ToSocketAddrs>(addr: A) -> Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| Error::io("resolve address", e))?
        .collect();
    if addrs.is_empty() {
        return Err(Error::InvalidArgument("the address resolved to nothing"));
    }
    Ok(addrs)
}
