//! [`CmEventChannel`]: the connection manager's event channel (after
//! `rdma_event_channel`) and the thread that runs it.
//!
//! One thread per channel waits (`epoll` through `mio`) on the channel's listeners and on
//! the connections still negotiating: TCP connects in progress, MPA Requests being sent,
//! Requests and Replies being read. It never blocks on anything else, so one slow or silent
//! peer does not delay the others, and every attempt has a deadline. Established connections
//! belong to their device's progress thread; they report back through the QP's hook
//! ([`crate::qp::ConnObserver`]).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::net::{TcpListener as MioListener, TcpStream as MioStream};
use mio::{Events, Interest, Poll, Token, Waker};
use softwarp_ras::deadline::Deadline;
use softwarp_ras::stats::{StatsBuilder, StatsSource};

use super::admission::{ListenerState, Slot, EVICT_AGE};
use super::event::{CmEvent, ConnId, EventQueue, ListenerId};
use super::frame_io::{self, FrameReader, Progress, ReadError};
use super::id::{CmId, IdShared};
use super::listener::{CmListener, ListenOptions};
use super::negotiate::{self, FrameOut, Local, Screened};
use super::options::{ConnectOptions, ConnectionInfo, Role};
use super::request::ConnectRequest;
use crate::device::lock;
use crate::error::{Error, MpaError, Result};
use crate::qp::{Establish, QpShared, QueuePair};
use crate::sys;

const WAKE: Token = Token(0);

enum Cmd {
    Listen {
        state: Arc<ListenerState>,
        listener: MioListener,
        opts: Arc<ConnectOptions>,
    },
    Unlisten(ListenerId),
    Connect(Box<Active>),
    Cancel(ConnId),
    Shutdown,
}

/// State shared by a channel handle, its thread, and the connections it made.
#[derive(Debug)]
pub(crate) struct ChannelShared {
    pub(crate) events: EventQueue,
    cmd: Mutex<Sender<Cmd>>,
    waker: Waker,
    next_id: AtomicU64,
    /// The channel's listeners, for statistics.
    listeners: Mutex<Vec<Weak<ListenerState>>>,
}

impl std::fmt::Debug for Cmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Cmd::Listen { .. } => "Listen",
            Cmd::Unlisten(_) => "Unlisten",
            Cmd::Connect(_) => "Connect",
            Cmd::Cancel(_) => "Cancel",
            Cmd::Shutdown => "Shutdown",
        })
    }
}

impl ChannelShared {
    pub(crate) fn push(&self, ev: CmEvent) {
        self.events.push(ev);
    }

    fn send(&self, cmd: Cmd) -> Result<()> {
        lock(&self.cmd)
            .send(cmd)
            .map_err(|_| Error::ChannelClosed)?;
        self.waker
            .wake()
            .map_err(|e| Error::io("wake the connection manager", e))
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
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
            next_id: AtomicU64::new(1),
            listeners: Mutex::new(Vec::new()),
        });
        softwarp_ras::stats::register_source(Arc::downgrade(&shared) as Weak<dyn StatsSource>);
        let worker = Worker {
            poll,
            rx,
            shared: Arc::clone(&shared),
            jobs: HashMap::new(),
            next_token: 1,
        };
        let thread = std::thread::Builder::new()
            .name("softwarp-cm".into())
            .spawn(move || worker.run())
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
        crate::context::check_wait("CmEventChannel::get_event", timeout)?;
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
    pub fn listen<A: ToSocketAddrs>(&self, addr: A, opts: &ListenOptions) -> Result<CmListener> {
        let std_listener =
            std::net::TcpListener::bind(addr).map_err(|e| Error::io("bind listener", e))?;
        sys::set_listen_backlog(std_listener.as_fd(), opts.backlog)
            .map_err(|e| Error::io("listen", e))?;
        std_listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("set O_NONBLOCK", e))?;
        let local_addr = std_listener
            .local_addr()
            .map_err(|e| Error::io("getsockname", e))?;
        let id = ListenerId(self.shared.next_id());
        let state = Arc::new(ListenerState::new(id, local_addr, opts.backlog));
        lock(&self.shared.listeners).push(Arc::downgrade(&state));
        self.shared.send(Cmd::Listen {
            state: Arc::clone(&state),
            listener: MioListener::from_std(std_listener),
            opts: Arc::new(opts.options.clone()),
        })?;
        tracing::debug!(listener = %id, %local_addr, backlog = opts.backlog, "listening");
        Ok(CmListener::new(state, Arc::clone(&self.shared)))
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
        let shared = Arc::clone(qp.shared());
        let local = shared.local_params(opts)?;
        let request = negotiate::request(opts, &local)?;
        let bytes = request.encode()?;
        shared.begin_connect()?;
        let id = IdShared::new(
            ConnId(self.shared.next_id()),
            Role::Initiator,
            Arc::downgrade(&self.shared),
            Arc::downgrade(&shared),
        );
        let job = Active {
            id: Arc::clone(&id),
            qp: Arc::clone(&shared),
            opts: opts.clone(),
            local,
            request,
            bytes,
            addrs: addrs.into(),
            stream: None,
            phase: Phase::Connecting,
            written: 0,
            reader: FrameReader::new(),
            deadline: Deadline::after(opts.timeout),
            last_err: None,
        };
        if let Err(e) = self.shared.send(Cmd::Connect(Box::new(job))) {
            shared.abandon_connect();
            return Err(e);
        }
        Ok(CmId { shared: id })
    }

    /// [`CmEventChannel::connect`], then waits for the outcome: the connection and what
    /// negotiation settled, or the error (a reject is [`MpaError::Rejected`] with the
    /// responder's private data). Other events stay queued.
    pub fn connect_blocking<A: ToSocketAddrs>(
        &self,
        qp: &QueuePair,
        addr: A,
        opts: &ConnectOptions,
    ) -> Result<(CmId, ConnectionInfo)> {
        crate::context::check_blocking("CmEventChannel::connect_blocking")?;
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
        CmEvent::Rejected { private_data, .. } => Err(MpaError::Rejected { private_data }.into()),
        CmEvent::Unreachable { error, .. } | CmEvent::ConnectError { error, .. } => Err(error),
        _ => Err(Error::InvalidArgument(
            "unexpected connection manager event",
        )),
    }
}

impl CmEventChannel {
    #[cfg(any(test, feature = "tokio"))]
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

// ---------------------------------------------------------------------------------------
// The channel's thread
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// TCP connect in progress.
    Connecting,
    /// Sending the MPA Request.
    Writing,
    /// Reading the MPA Reply.
    Reading,
}

/// An active connection attempt.
struct Active {
    id: Arc<IdShared>,
    qp: Arc<QpShared>,
    opts: ConnectOptions,
    local: Local,
    request: FrameOut,
    bytes: Vec<u8>,
    /// Addresses not tried yet.
    addrs: VecDeque<SocketAddr>,
    stream: Option<MioStream>,
    phase: Phase,
    written: usize,
    reader: FrameReader,
    deadline: Deadline,
    last_err: Option<io::Error>,
}

/// A TCP connection accepted by a listener, its MPA Request still being read.
struct Passive {
    conn_id: ConnId,
    listener: ListenerId,
    opts: Arc<ConnectOptions>,
    stream: MioStream,
    peer: SocketAddr,
    reader: FrameReader,
    deadline: Deadline,
    /// When it was accepted (the oldest is closed first when the listener must make room).
    accepted_at: Instant,
    /// Its place at the listener.
    slot: Slot,
}

enum Job {
    Listener {
        state: Arc<ListenerState>,
        listener: MioListener,
        opts: Arc<ConnectOptions>,
        /// Stopped accepting at the bound; resumed when a place is given back.
        paused: bool,
        /// The kernel signalled a connection while the listener was full, and no `accept`
        /// since found the queue empty: someone waits (see [`Worker::make_room`]).
        waiting: bool,
    },
    Active(Box<Active>),
    Passive(Box<Passive>),
}

struct Worker {
    poll: Poll,
    rx: Receiver<Cmd>,
    shared: Arc<ChannelShared>,
    jobs: HashMap<Token, Job>,
    next_token: usize,
}

impl Worker {
    fn run(mut self) {
        crate::context::mark_cm_thread();
        let mut events = Events::with_capacity(1024);
        loop {
            let timeout = self.next_deadline().map(|d| {
                d.saturating_duration_since(Instant::now())
                    .saturating_add(Duration::from_millis(1))
            });
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(error = %e, "epoll_wait failed; the connection manager stops");
                    return;
                }
            }
            let ready: Vec<Token> = events
                .iter()
                .map(|e| e.token())
                .filter(|t| *t != WAKE)
                .collect();
            if !self.commands() {
                self.shutdown();
                return;
            }
            for token in ready {
                self.step(token);
            }
            self.expire();
            self.make_room();
            self.resume_listeners();
        }
    }

    /// At every full listener with a connection waiting in the kernel's queue: closes the
    /// negotiating connections that have waited [`EVICT_AGE`] or longer for their Request,
    /// oldest first, each one for one waiting connection accepted in its place, until the
    /// queue is empty or no connection is that old (see the admission module's docs).
    fn make_room(&mut self) {
        let pressed: Vec<(Token, ListenerId)> = self
            .jobs
            .iter()
            .filter_map(|(t, j)| match j {
                Job::Listener {
                    state,
                    waiting: true,
                    ..
                } if !state.has_room() => Some((*t, state.id)),
                _ => None,
            })
            .collect();
        for (token, id) in pressed {
            // At most every negotiating connection once (each accepted one is too young).
            let mut oldest = self.negotiating_by_age(id);
            let now = Instant::now();
            loop {
                // The kernel's count, where it gives one; else the readiness seen.
                let queued = match self.jobs.get(&token) {
                    Some(Job::Listener { listener, .. }) => {
                        sys::accept_queue_len(listener.as_fd()).map_or(1, |n| n)
                    }
                    _ => 0,
                };
                if queued == 0 {
                    if let Some(Job::Listener { waiting, .. }) = self.jobs.get_mut(&token) {
                        *waiting = false;
                    }
                    break;
                }
                let Some((t, since)) = oldest.pop() else {
                    break;
                };
                if now.saturating_duration_since(since) < EVICT_AGE {
                    break;
                }
                let Some(Job::Passive(p)) = self.remove(t) else {
                    continue;
                };
                p.slot.listener_evicted();
                tracing::debug!(listener = %id, peer = %p.peer, "negotiating connection evicted");
                self.shared.push(CmEvent::RequestError {
                    listener: p.listener,
                    peer: p.peer,
                    error: MpaError::Evicted(now.saturating_duration_since(since)).into(),
                });
                drop(p);
                self.accept_all(token);
            }
        }
    }

    /// The negotiating connections of listener `id` with their acceptance time, the oldest
    /// last.
    fn negotiating_by_age(&self, id: ListenerId) -> Vec<(Token, Instant)> {
        let mut v: Vec<(Token, Instant)> = self
            .jobs
            .iter()
            .filter_map(|(t, j)| match j {
                Job::Passive(p) if p.listener == id => Some((*t, p.accepted_at)),
                _ => None,
            })
            .collect();
        v.sort_by_key(|e| std::cmp::Reverse(e.1));
        v
    }

    /// Listeners that stopped at their bound and have room again accept what waits in the
    /// kernel's queue (epoll reports a listener only when a new connection arrives).
    fn resume_listeners(&mut self) {
        let ready: Vec<Token> = self
            .jobs
            .iter()
            .filter(
                |(_, j)| matches!(j, Job::Listener { state, paused: true, .. } if state.has_room()),
            )
            .map(|(t, _)| *t)
            .collect();
        for t in ready {
            self.accept_all(t);
        }
    }

    fn token(&mut self) -> Token {
        let t = Token(self.next_token);
        self.next_token += 1;
        t
    }

    fn next_deadline(&self) -> Option<Instant> {
        // Listeners that may make room (see `make_room`): their negotiating connections
        // become evictable EVICT_AGE after they were accepted.
        let pressed: Vec<ListenerId> = self
            .jobs
            .values()
            .filter_map(|j| match j {
                Job::Listener {
                    state,
                    waiting: true,
                    ..
                } if !state.has_room() => Some(state.id),
                _ => None,
            })
            .collect();
        self.jobs
            .values()
            .flat_map(|j| match j {
                Job::Active(a) => [a.deadline.instant(), None],
                Job::Passive(p) => [
                    p.deadline.instant(),
                    pressed
                        .contains(&p.listener)
                        .then(|| p.accepted_at.checked_add(EVICT_AGE))
                        .flatten(),
                ],
                Job::Listener { .. } => [None, None],
            })
            .flatten()
            .min()
    }

    /// Handles the commands waiting; false on shutdown.
    fn commands(&mut self) -> bool {
        loop {
            match self.rx.try_recv() {
                Ok(Cmd::Listen {
                    state,
                    mut listener,
                    opts,
                }) => {
                    let id = state.id;
                    let token = self.token();
                    match self
                        .poll
                        .registry()
                        .register(&mut listener, token, Interest::READABLE)
                    {
                        Ok(()) => {
                            self.jobs.insert(
                                token,
                                Job::Listener {
                                    state,
                                    listener,
                                    opts,
                                    paused: false,
                                    waiting: false,
                                },
                            );
                            // Connections queued before the registration are taken now.
                            self.step(token);
                        }
                        Err(e) => {
                            tracing::error!(listener = %id, error = %e, "cannot poll the listener")
                        }
                    }
                }
                Ok(Cmd::Unlisten(id)) => {
                    let gone: Vec<Token> = self
                        .jobs
                        .iter()
                        .filter(|(_, j)| match j {
                            Job::Listener { state, .. } => state.id == id,
                            Job::Passive(p) => p.listener == id,
                            Job::Active(_) => false,
                        })
                        .map(|(t, _)| *t)
                        .collect();
                    for t in gone {
                        self.remove(t);
                    }
                }
                Ok(Cmd::Connect(job)) => {
                    let token = self.token();
                    self.jobs.insert(token, Job::Active(job));
                    self.start_connect(token);
                }
                Ok(Cmd::Cancel(conn)) => {
                    let found = self.jobs.iter().find_map(|(t, j)| match j {
                        Job::Active(a) if a.id.conn_id() == conn => Some(*t),
                        _ => None,
                    });
                    if let Some(t) = found {
                        if let Some(Job::Active(a)) = self.remove(t) {
                            fail_active(a, Failed::Mpa(MpaError::Cancelled.into()));
                        }
                    }
                }
                Ok(Cmd::Shutdown) | Err(TryRecvError::Disconnected) => return false,
                Err(TryRecvError::Empty) => return true,
            }
        }
    }

    fn shutdown(&mut self) {
        let tokens: Vec<Token> = self.jobs.keys().copied().collect();
        for t in tokens {
            if let Some(Job::Active(a)) = self.remove(t) {
                a.qp.abandon_connect();
            }
        }
        tracing::debug!("connection manager thread stops");
    }

    /// Takes a job out, deregistering its socket.
    fn remove(&mut self, token: Token) -> Option<Job> {
        let mut job = self.jobs.remove(&token)?;
        let reg = self.poll.registry();
        let _ = match &mut job {
            Job::Listener { listener, .. } => reg.deregister(listener),
            Job::Active(a) => match a.stream.as_mut() {
                Some(s) => reg.deregister(s),
                None => Ok(()),
            },
            Job::Passive(p) => reg.deregister(&mut p.stream),
        };
        Some(job)
    }

    fn step(&mut self, token: Token) {
        if matches!(self.jobs.get(&token), Some(Job::Listener { .. })) {
            self.accept_all(token);
            return;
        }
        let step = match self.jobs.get_mut(&token) {
            Some(Job::Active(a)) => step_active(a),
            Some(Job::Passive(p)) => step_passive(p),
            _ => return,
        };
        match step {
            ActiveOrPassive::Wait => {}
            ActiveOrPassive::Retry => self.start_connect(token),
            ActiveOrPassive::Finish(f) => {
                if let Some(job) = self.remove(token) {
                    self.finish(job, f);
                }
            }
        }
    }

    /// Connects an active job to its next address (or fails it when none is left).
    fn start_connect(&mut self, token: Token) {
        loop {
            let Some(Job::Active(a)) = self.jobs.get_mut(&token) else {
                return;
            };
            if let Some(mut old) = a.stream.take() {
                let _ = self.poll.registry().deregister(&mut old);
            }
            let Some(addr) = a.addrs.pop_front() else {
                let err = a.last_err.take();
                if let Some(Job::Active(a)) = self.remove(token) {
                    let error = match err {
                        Some(e) => Error::io("TCP connect", e),
                        None => Error::InvalidArgument("the address resolved to nothing"),
                    };
                    fail_active(a, Failed::Unreachable(error));
                }
                return;
            };
            match MioStream::connect(addr) {
                Ok(mut s) => {
                    match self.poll.registry().register(
                        &mut s,
                        token,
                        Interest::READABLE | Interest::WRITABLE,
                    ) {
                        Ok(()) => {
                            a.stream = Some(s);
                            a.phase = Phase::Connecting;
                            return;
                        }
                        Err(e) => a.last_err = Some(e),
                    }
                }
                Err(e) => a.last_err = Some(e),
            }
        }
    }

    /// Accepts the connections waiting at a listener, as long as it has room for them
    /// (see [`CmEventChannel::listen`]); at the bound the rest stay in the kernel's queue.
    fn accept_all(&mut self, token: Token) {
        loop {
            let Some(Job::Listener {
                state,
                listener,
                opts,
                paused,
                waiting,
            }) = self.jobs.get_mut(&token)
            else {
                return;
            };
            if !state.has_room() {
                if !*paused {
                    *paused = true;
                    state.backlog_reached();
                }
                // Called on the listener's readiness (or after a place was freed): a
                // connection may wait; `make_room` finds out by accepting.
                *waiting = true;
                return;
            }
            *paused = false;
            let (state, opts) = (Arc::clone(state), Arc::clone(opts));
            let id = state.id;
            let (mut stream, peer) = match listener.accept() {
                Ok(v) => v,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    *waiting = false;
                    return;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE and friends: report and wait for the next readiness.
                    tracing::error!(listener = %id, error = %e, "accept failed");
                    self.shared.push(CmEvent::RequestError {
                        listener: id,
                        peer: SocketAddr::from(([0, 0, 0, 0], 0)),
                        error: Error::io("accept", e),
                    });
                    return;
                }
            };
            let slot = state.take_slot(Arc::downgrade(&self.shared));
            let _ = stream.set_nodelay(true);
            let t = self.token();
            if let Err(e) = self
                .poll
                .registry()
                .register(&mut stream, t, Interest::READABLE)
            {
                tracing::error!(error = %e, "cannot poll an accepted connection");
                continue;
            }
            tracing::debug!(listener = %id, %peer, "TCP connection accepted");
            self.jobs.insert(
                t,
                Job::Passive(Box::new(Passive {
                    conn_id: ConnId(self.shared.next_id()),
                    listener: id,
                    deadline: Deadline::after(opts.timeout),
                    accepted_at: Instant::now(),
                    opts,
                    stream,
                    peer,
                    reader: FrameReader::new(),
                    slot,
                })),
            );
            self.step(t);
        }
    }

    /// Fails the jobs whose deadline passed.
    fn expire(&mut self) {
        let now = Instant::now();
        let late: Vec<Token> = self
            .jobs
            .iter()
            .filter(|(_, j)| match j {
                Job::Active(a) => a.deadline.expired_at(now),
                Job::Passive(p) => p.deadline.expired_at(now),
                Job::Listener { .. } => false,
            })
            .map(|(t, _)| *t)
            .collect();
        for t in late {
            match self.remove(t) {
                Some(Job::Active(a)) => {
                    let total = a.opts.timeout;
                    let failed = if a.phase == Phase::Connecting {
                        Failed::Unreachable(Error::Timeout(total))
                    } else {
                        //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
                        // (paraphrase) An initiator that receives no Reply in time closes
                        // the connection.
                        Failed::Mpa(MpaError::Timeout(total).into())
                    };
                    fail_active(a, failed);
                }
                Some(Job::Passive(p)) => {
                    // A peer that never completes its Request: closed, without an answer.
                    self.shared.push(CmEvent::RequestError {
                        listener: p.listener,
                        peer: p.peer,
                        error: MpaError::Timeout(p.opts.timeout).into(),
                    });
                }
                _ => {}
            }
        }
    }

    fn finish(&mut self, job: Job, f: Finish) {
        match (job, f) {
            (Job::Active(a), Finish::Failed(failed)) => fail_active(a, failed),
            (Job::Active(a), Finish::Connected(neg)) => establish_active(a, neg),
            (Job::Passive(p), Finish::Request(req)) => {
                let Passive {
                    conn_id,
                    listener,
                    opts,
                    stream,
                    peer,
                    mut slot,
                    ..
                } = *p;
                let std_stream: std::net::TcpStream = stream.into();
                slot.delivered();
                match ConnectRequest::new(conn_id, std_stream, peer, req, opts, slot) {
                    Ok(r) => self.shared.push(CmEvent::ConnectRequest(r)),
                    Err(error) => self.shared.push(CmEvent::RequestError {
                        listener,
                        peer,
                        error,
                    }),
                }
            }
            (Job::Passive(p), Finish::Refused(error)) => {
                self.shared.push(CmEvent::RequestError {
                    listener: p.listener,
                    peer: p.peer,
                    error,
                });
            }
            _ => {}
        }
    }
}

/// How an active attempt failed.
enum Failed {
    Unreachable(Error),
    Rejected(Vec<u8>),
    Mpa(Error),
}

/// How a job ended.
enum Finish {
    Failed(Failed),
    Connected(negotiate::Negotiated),
    Request(negotiate::PeerRequest),
    Refused(Error),
}

enum ActiveOrPassive {
    Wait,
    /// Try the next address.
    Retry,
    Finish(Finish),
}

fn fail_active(a: Box<Active>, failed: Failed) {
    a.qp.abandon_connect();
    let id = a.id.conn_id();
    let ev = match failed {
        Failed::Unreachable(error) => CmEvent::Unreachable { id, error },
        Failed::Rejected(private_data) => CmEvent::Rejected { id, private_data },
        Failed::Mpa(error) => CmEvent::ConnectError { id, error },
    };
    tracing::debug!(conn = %id, event = ev.name(), "connection attempt failed");
    a.id.failed(ev);
}

fn establish_active(a: Box<Active>, neg: negotiate::Negotiated) {
    let Active {
        id,
        qp,
        opts,
        stream,
        ..
    } = *a;
    let Some(stream) = stream else {
        qp.abandon_connect();
        id.failed(CmEvent::ConnectError {
            id: id.conn_id(),
            error: Error::NotConnected,
        });
        return;
    };
    let std_stream: std::net::TcpStream = stream.into();
    let observer: Arc<dyn crate::qp::ConnObserver> = Arc::clone(&id) as _;
    match qp.finish_connect(
        Ok((std_stream, neg)),
        Establish {
            opts: &opts,
            observer: Some(observer),
            gate: opts.responder_waits_for_initiator,
            hold: opts.first_fpdu_delay,
        },
    ) {
        Ok(info) => id.established(info),
        Err(error) => id.failed(CmEvent::ConnectError {
            id: id.conn_id(),
            error,
        }),
    }
}

/// Advances an active attempt as far as its socket allows.
fn step_active(a: &mut Active) -> ActiveOrPassive {
    let total = a.opts.timeout;
    let Some(stream) = a.stream.as_mut() else {
        return ActiveOrPassive::Retry;
    };
    if a.phase == Phase::Connecting {
        match stream.take_error() {
            Ok(Some(e)) | Err(e) => {
                a.last_err = Some(e);
                return ActiveOrPassive::Retry;
            }
            Ok(None) => {}
        }
        match stream.peer_addr() {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotConnected => return ActiveOrPassive::Wait,
            Err(e) => {
                a.last_err = Some(e);
                return ActiveOrPassive::Retry;
            }
        }
        let _ = stream.set_nodelay(true);
        a.phase = Phase::Writing;
    }
    if a.phase == Phase::Writing {
        match frame_io::write_some(stream, &a.bytes, &mut a.written) {
            Ok(true) => a.phase = Phase::Reading,
            Ok(false) => return ActiveOrPassive::Wait,
            Err(e) => {
                let error = crate::connect::map_io("write MPA Request", e, total);
                return ActiveOrPassive::Finish(Finish::Failed(Failed::Mpa(error)));
            }
        }
    }
    match a.reader.fill(stream) {
        Ok(Progress::WouldBlock) => return ActiveOrPassive::Wait,
        Ok(Progress::Complete) | Err(ReadError::Wire(_)) => {}
        Err(ReadError::Closed) => {
            return ActiveOrPassive::Finish(Finish::Failed(Failed::Mpa(MpaError::Closed.into())))
        }
        Err(ReadError::Io(e)) => {
            let error = crate::connect::map_io("read MPA Reply", e, total);
            return ActiveOrPassive::Finish(Finish::Failed(Failed::Mpa(error)));
        }
    }
    match negotiate::check_reply(&a.request, &a.opts, &a.local, a.reader.bytes()) {
        Ok(neg) => ActiveOrPassive::Finish(Finish::Connected(neg)),
        Err(f) => {
            if let Some(t) = f.terminate_bytes(a.opts.terminate_layout) {
                let mut written = 0;
                // Best effort into an empty socket buffer; the connection closes next.
                let _ = frame_io::write_some(stream, &t, &mut written);
                tracing::debug!(conn = %a.id.conn_id(), code = ?f.terminate, "Terminate sent");
            }
            let failed = match f.error {
                Error::Mpa(MpaError::Rejected { private_data }) => Failed::Rejected(private_data),
                other => Failed::Mpa(other),
            };
            ActiveOrPassive::Finish(Finish::Failed(failed))
        }
    }
}

/// Advances a passive connection: reads its Request and screens it.
fn step_passive(p: &mut Passive) -> ActiveOrPassive {
    let read = match p.reader.fill(&mut p.stream) {
        Ok(Progress::WouldBlock) => return ActiveOrPassive::Wait,
        Ok(Progress::Complete) => Ok(p.reader.bytes()),
        Err(ReadError::Wire(w)) => Err(w),
        Err(ReadError::Closed) => {
            return ActiveOrPassive::Finish(Finish::Refused(MpaError::Closed.into()))
        }
        Err(ReadError::Io(e)) => {
            let error = crate::connect::map_io("read MPA Request", e, p.opts.timeout);
            return ActiveOrPassive::Finish(Finish::Refused(error));
        }
    };
    match negotiate::screen_request(read, &p.opts) {
        Screened::Request(req) => ActiveOrPassive::Finish(Finish::Request(req)),
        Screened::Refuse { reply, error } => {
            if let Some(reply) = reply {
                if let Ok(bytes) = reply.encode() {
                    let mut written = 0;
                    let _ = frame_io::write_some(&mut p.stream, &bytes, &mut written);
                }
            }
            tracing::debug!(peer = %p.peer, %error, "connection request refused");
            ActiveOrPassive::Finish(Finish::Refused(error.into()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the admission module's docs state a negotiating connection costs in memory,
    /// besides its socket: its job record and its frame buffer.
    #[test]
    fn a_negotiating_connection_costs_its_job_and_a_532_byte_frame_buffer() {
        let job = std::mem::size_of::<Passive>();
        assert!(job <= 256, "a negotiating job is {job} bytes");
        assert_eq!(frame_io::MAX_FRAME_LEN, 532);
        // The jobs map holds a token and a boxed job per entry.
        assert!(std::mem::size_of::<(Token, Job)>() <= 64);
    }
}
