//! The progress thread of a device: one `epoll` (through `mio`, edge-triggered) over the
//! non-blocking sockets of the device's connected QPs.
//!
//! On readiness it runs a QP's progress pass (receive until `EAGAIN`, transmit what is left,
//! move completions and events, close the connection when the QP is finished). Other
//! threads talk to it through a command channel and a `mio::Waker`: register a new
//! connection, kick a QP whose state changed, move the QPs of an overflowed CQ to Error.
//! It never blocks on anything but `epoll_wait`.
//!
//! Its timers cost nothing for a QP that needs none: a QP's timer look (the engine's clock,
//! `softwarp_engine::qp::Qp::poll_timeout`: the receive stall of
//! [`crate::ConnectOptions::rx_stall_timeout`] while the peer is inside an FPDU, the
//! first-FPDU hold) is armed in a heap of deadlines only when the engine asks for one at
//! the end of a pass or look; the thread only sleeps until then. The busy-poll look
//! ([`RX_LOOK_PERIOD`]) walks only the busy-polled QPs. Registering a QP, closing
//! one and a wake-up touch no other QP, so the work per connection is the same at ten
//! connections and at ten thousand ([`ProgressStats`] counts it).

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use mio::{Events, Poll, Registry, Token, Waker};

use crate::error::{Error, Result};
use crate::sync::lock;

const WAKE: Token = Token(0);
/// The device's rtnetlink socket (`crate::availability::netwatch`), when it watches the network.
const NETLINK: Token = Token(usize::MAX);
/// Delay before retrying QPs that wait for the peer's FIN or for completions to be taken.
const RETRY: Duration = Duration::from_millis(5);
/// Size of the progress thread's staging buffer (it also swallows bytes arriving after a
/// QP stopped receiving): the engine's advice.
pub(crate) const SCRATCH_LEN: usize = softwarp_engine::qp::STAGE_LEN;

/// What the progress thread did, counted for [`crate::Device::progress_stats`]: the work
/// that could grow with the number of connections, so that a test can see it does not.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    served: AtomicU64,
    wakeups: AtomicU64,
    timer_looks: AtomicU64,
    qp_visits: AtomicU64,
}

impl Counters {
    /// `n` QP entries of a per-device collection inserted, looked at or walked past.
    pub(crate) fn visit(&self, n: usize) {
        self.qp_visits
            .fetch_add(u64::try_from(n).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    fn add(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn stats(&self) -> ProgressStats {
        ProgressStats {
            served: self.served.load(Ordering::Relaxed),
            wakeups: self.wakeups.load(Ordering::Relaxed),
            timer_looks: self.timer_looks.load(Ordering::Relaxed),
            qp_visits: self.qp_visits.load(Ordering::Relaxed),
        }
    }
}

/// Counters of a device's progress thread and of its per-device QP collections
/// ([`crate::Device::progress_stats`]): what a connection costs besides its own bytes, so
/// that its growth with the number of connections can be measured by counting rather than
/// by timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ProgressStats {
    /// Connected QPs the progress thread serves now.
    pub served: u64,
    /// Times `epoll_wait` returned.
    pub wakeups: u64,
    /// QPs the progress thread looked at on a timer (a timer look of the engine's clock, a busy-poll
    /// receive look). An idle QP in the default mode is never looked at.
    pub timer_looks: u64,
    /// QP entries of the device's collections inserted, looked at or walked past: the
    /// device's and CQs' QP lists at QP creation and their compactions, the progress
    /// thread's registrations and timer looks. Constant per connection whatever the count.
    pub qp_visits: u64,
}

/// How often the progress thread looks whether the application still polls the CQs of its
/// busy-polled QPs ([`ServedQp::rx_look`]): a QP whose socket had bytes to read at two looks
/// in a row, with no application activity on it in between, is taken over (10 to 20 ms
/// after the application's last activity, or after the bytes came).
pub(crate) const RX_LOOK_PERIOD: Duration = Duration::from_millis(10);

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
    /// When the engine's clock wants the QP looked at next ([`softwarp_engine::qp::Qp::poll_timeout`], see
    /// [`ServedQp::on_timer`]).
    pub(crate) timeout: Option<Instant>,
}

/// What a timer look ([`ServedQp::on_timer`]) found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TimerLook {
    /// The engine acted (a receive stall ended the stream, the first-FPDU hold ended): the
    /// QP needs a pass.
    Acted,
    /// Nothing to do now; when the engine's clock wants the next look.
    Next(Option<Instant>),
    /// Another thread holds the QP (it is moving its bytes): look again a little later.
    Busy,
}

/// A connected QP as the progress thread serves it (implemented by the verbs layer's QP
/// state): the progress thread owns its epoll registration and calls its passes and looks.
pub(crate) trait ServedQp: Send + Sync + 'static {
    /// The QP number (for records).
    fn qp_num(&self) -> u32;
    /// Registers the QP's socket as `token`; false if it has no connection any more.
    fn register(&self, registry: &Registry, token: Token) -> bool;
    /// The period of a busy-polled QP's timer looks while it is connected, if any.
    fn look_period(&self) -> Option<Duration>;
    /// Busy-polled (its receive CQ was when it connected).
    fn busy_polled(&self) -> bool;
    /// A progress pass on readiness or a timer.
    fn service(&self, registry: &Registry, scratch: &mut [u8]) -> Pass;
    /// A timer look: the engine's clock acts if its time has come.
    fn on_timer(&self, now: Instant) -> TimerLook;
    /// A busy-polled QP's receive look: true if the progress thread takes it over now.
    fn rx_look(&self, registry: &Registry) -> bool;
    /// Moves the QP to Error (its CQ overflowed).
    fn set_error(&self);
}

/// A connected QP the progress thread serves, with its timers.
struct Served<Q> {
    qp: Arc<Q>,
    /// A busy-polled QP's timer looks go on at this period while it is connected, whatever
    /// its clock asks (its polls read, not the progress thread, which cannot tell when a
    /// read ended inside an FPDU); `None` without a receive stall timeout.
    look_period: Option<Duration>,
    /// When its next timer look is due, while one is armed (its entry in [`Timers`]).
    timer_at: Option<Instant>,
    /// Busy-polled (its receive CQ was when it connected): looked at every
    /// [`RX_LOOK_PERIOD`], and its timer looks go on while it is
    /// connected.
    busy: bool,
}

/// The deadlines of the QPs' timer looks, earliest first. An entry is checked against the
/// QP's own [`Served::timer_at`] when it comes due: a QP that closed, or whose look was
/// moved earlier, leaves a stale entry behind, dropped then (tokens are never reused).
#[derive(Default)]
struct Timers {
    heap: BinaryHeap<Reverse<(Instant, Token)>>,
}

impl Timers {
    /// Arms `s`'s look at `next` (the QP's clock asks for it then) or, for a busy-polled QP,
    /// at the latest one look period from `now`; an earlier look already armed stays.
    fn arm<Q>(&mut self, s: &mut Served<Q>, token: Token, next: Option<Instant>, now: Instant) {
        let periodic = if s.busy {
            s.look_period.and_then(|p| now.checked_add(p))
        } else {
            None
        };
        let at = match (next, periodic) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => match a.or(b) {
                Some(t) => t,
                None => return,
            },
        };
        if s.timer_at.is_some_and(|t| t <= at) {
            return;
        }
        s.timer_at = Some(at);
        self.heap.push(Reverse((at, token)));
    }

    /// How long `epoll_wait` may sleep before the next deadline.
    fn wait(&self, now: Instant) -> Option<Duration> {
        self.heap
            .peek()
            .map(|Reverse((t, _))| t.saturating_duration_since(now))
    }

    /// The next entry due at `now`, if any.
    fn pop_due(&mut self, now: Instant) -> Option<(Instant, Token)> {
        match self.heap.peek() {
            Some(Reverse((t, _))) if *t <= now => self.heap.pop().map(|Reverse(e)| e),
            _ => None,
        }
    }
}

/// The busy-poll look's period: on while the progress thread has busy-polled QPs.
#[derive(Debug, Default)]
struct Periodic {
    next: Option<Instant>,
}

impl Periodic {
    fn set(&mut self, on: bool, now: Instant) {
        if !on {
            self.next = None;
        } else if self.next.is_none() {
            self.next = now.checked_add(RX_LOOK_PERIOD);
        }
    }

    fn wait(&self, now: Instant) -> Option<Duration> {
        self.next.map(|t| t.saturating_duration_since(now))
    }

    /// True when a look is due (and schedules the next one).
    fn due(&mut self, now: Instant) -> bool {
        match self.next {
            Some(t) if now >= t => {
                self.next = now.checked_add(RX_LOOK_PERIOD);
                true
            }
            _ => false,
        }
    }
}

pub(crate) enum Cmd<Q> {
    Register(Arc<Q>),
    Kick(Arc<Q>),
    /// Look at a busy-polled QP's write watchdog after a delay (by its token).
    Watch(Token),
    /// Move these QPs to Error: their CQ overflowed (listed on the progress thread, which
    /// may take a CQ's QP list).
    CqOverflow(Box<dyn FnOnce() -> Vec<Arc<Q>> + Send>),
    /// Watch the network with this rtnetlink socket (registered for readability).
    NetWatch(Box<crate::availability::netwatch::NetWatch>),
    Shutdown,
}

/// Handle to a device's progress thread.
#[derive(Debug)]
pub(crate) struct Progress<Q> {
    tx: Mutex<Sender<Cmd<Q>>>,
    waker: Waker,
    thread: Mutex<Option<JoinHandle<()>>>,
    thread_id: ThreadId,
    /// What it did ([`ProgressStats`]); also counted by the device's QP lists.
    pub(crate) counters: Arc<Counters>,
}

impl<Q: ServedQp> Progress<Q> {
    pub(crate) fn start(device_name: &str) -> Result<Self> {
        let poll = Poll::new().map_err(|e| Error::io("epoll_create", e))?;
        let waker = Waker::new(poll.registry(), WAKE).map_err(|e| Error::io("eventfd", e))?;
        let (tx, rx) = mpsc::channel();
        let counters = Arc::new(Counters::default());
        let c = Arc::clone(&counters);
        let handle = softwarp_ras::thread::spawn(format!("{device_name}-progress"), move || {
            run(poll, rx, &c)
        })
        .map_err(|e| Error::io("spawn progress thread", e))?;
        Ok(Self {
            tx: Mutex::new(tx),
            waker,
            thread_id: handle.thread().id(),
            thread: Mutex::new(Some(handle)),
            counters,
        })
    }

    /// Hands a connected QP to the progress thread.
    pub(crate) fn register(&self, qp: Arc<Q>) -> Result<()> {
        self.send(Cmd::Register(qp))
    }

    /// Asks for a progress pass of `qp` (its state changed outside the data path).
    pub(crate) fn kick(&self, qp: Arc<Q>) {
        if let Err(e) = self.send(Cmd::Kick(qp)) {
            tracing::error!(error = %e, "cannot reach the progress thread");
        }
    }

    /// Has the progress thread look at the write watchdog of the QP registered as `token`
    /// on its timer (not at once: the application is polling it right now).
    pub(crate) fn watch(&self, token: Token) {
        if let Err(e) = self.send(Cmd::Watch(token)) {
            tracing::error!(error = %e, "cannot reach the progress thread");
        }
    }

    /// Hands the device's rtnetlink watcher to the progress thread (its socket joins the
    /// epoll set: no thread of its own).
    pub(crate) fn net_watch(&self, w: crate::availability::netwatch::NetWatch) -> Result<()> {
        self.send(Cmd::NetWatch(Box::new(w)))
    }

    /// Moves every QP `qps` lists (those of a CQ that overflowed) to Error.
    pub(crate) fn cq_overflow(&self, qps: impl FnOnce() -> Vec<Arc<Q>> + Send + 'static) {
        if let Err(e) = self.send(Cmd::CqOverflow(Box::new(qps))) {
            tracing::error!(error = %e, "cannot reach the progress thread");
        }
    }
}

impl<Q> Progress<Q> {
    fn send(&self, cmd: Cmd<Q>) -> Result<()> {
        lock(&self.tx).send(cmd).map_err(|_| Error::DeviceStopped)?;
        self.waker
            .wake()
            .map_err(|e| Error::io("wake the progress thread", e))
    }
}

impl<Q> Drop for Progress<Q> {
    fn drop(&mut self) {
        // Fails only when the thread is already gone.
        let _ = self.send(Cmd::Shutdown);
        let handle = lock(&self.thread).take();
        if let Some(h) = handle {
            // The last reference may go away on the progress thread itself (it drops the
            // last QP of the device): it then exits on the Shutdown command by itself.
            if std::thread::current().id() != self.thread_id && h.join().is_err() {
                tracing::error!("the progress thread panicked");
            }
        }
    }
}

fn run<Q: ServedQp>(mut poll: Poll, rx: Receiver<Cmd<Q>>, counters: &Counters) {
    crate::availability::context::mark_progress_thread();
    let mut events = Events::with_capacity(1024);
    let mut qps: HashMap<Token, Served<Q>> = HashMap::new();
    // Token of each registered QP, by the address of its shared state (for kicks).
    let mut tokens: HashMap<usize, Token> = HashMap::new();
    let key = |qp: &Arc<Q>| Arc::as_ptr(qp) as usize;
    let mut next_token = 1usize;
    // QPs to service without waiting for readiness: budget left over (`again`) or waiting
    // on a timer (`delayed`).
    let mut again: BTreeSet<Token> = BTreeSet::new();
    let mut delayed: BTreeSet<Token> = BTreeSet::new();
    let mut scratch = vec![0u8; SCRATCH_LEN];
    let mut timers = Timers::default();
    // The busy-polled QPs, and the period of their look.
    let mut busy: BTreeSet<Token> = BTreeSet::new();
    let mut busy_look = Periodic::default();
    let mut netwatch: Option<Box<crate::availability::netwatch::NetWatch>> = None;
    loop {
        let timeout = if !again.is_empty() {
            Some(Duration::ZERO)
        } else if !delayed.is_empty() {
            Some(RETRY)
        } else {
            None
        };
        let now = Instant::now();
        let timeout = [timeout, timers.wait(now), busy_look.wait(now)]
            .into_iter()
            .flatten()
            .min();
        if let Err(e) = poll.poll(&mut events, timeout) {
            if e.kind() != std::io::ErrorKind::Interrupted {
                tracing::error!(error = %e, "epoll_wait failed; progress thread stops");
                return;
            }
        }
        Counters::add(&counters.wakeups);
        let mut todo: BTreeSet<Token> = std::mem::take(&mut again);
        todo.extend(std::mem::take(&mut delayed));
        let mut net_readable = false;
        for ev in events.iter() {
            if ev.token() == NETLINK {
                net_readable = true;
            } else if ev.token() != WAKE {
                todo.insert(ev.token());
            }
        }
        loop {
            match rx.try_recv() {
                Ok(Cmd::Register(qp)) => {
                    let token = Token(next_token);
                    next_token += 1;
                    if qp.register(poll.registry(), token) {
                        // Its first pass (below) arms its timer look.
                        let s = Served {
                            look_period: qp.look_period(),
                            timer_at: None,
                            busy: qp.busy_polled(),
                            qp,
                        };
                        if s.busy {
                            busy.insert(token);
                            busy_look.set(true, Instant::now());
                        }
                        tokens.insert(key(&s.qp), token);
                        qps.insert(token, s);
                        todo.insert(token);
                        counters.visit(1);
                        counters.served.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok(Cmd::Kick(qp)) => {
                    if let Some(t) = tokens.get(&key(&qp)) {
                        todo.insert(*t);
                    }
                }
                Ok(Cmd::Watch(token)) => {
                    if qps.contains_key(&token) {
                        delayed.insert(token);
                    }
                }
                Ok(Cmd::CqOverflow(qps_of)) => {
                    for qp in qps_of() {
                        tracing::error!(qp = qp.qp_num(), "QP to Error: its CQ overflowed");
                        qp.set_error();
                        if let Some(t) = tokens.get(&key(&qp)) {
                            todo.insert(*t);
                        }
                    }
                }
                Ok(Cmd::NetWatch(mut w)) => match w.register(poll.registry(), NETLINK) {
                    Ok(()) => {
                        // Events that came before the registration are read now.
                        net_readable = true;
                        netwatch = Some(w);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "rtnetlink socket: epoll registration failed; the network is not watched");
                    }
                },
                Ok(Cmd::Shutdown) | Err(TryRecvError::Disconnected) => {
                    tracing::debug!("progress thread stops");
                    return;
                }
                Err(TryRecvError::Empty) => break,
            }
        }
        if net_readable {
            if let Some(w) = netwatch.as_mut() {
                // QPs it terminates are kicked through the command channel: serviced at
                // the next turn.
                w.readable();
            }
        }
        // The timer looks that are due, and only those.
        let now = Instant::now();
        while let Some((at, token)) = timers.pop_due(now) {
            let Some(s) = qps.get_mut(&token) else {
                continue;
            };
            if s.timer_at != Some(at) {
                continue;
            }
            s.timer_at = None;
            Counters::add(&counters.timer_looks);
            counters.visit(1);
            match s.qp.on_timer(now) {
                // The pass re-arms from what the clock asks then.
                TimerLook::Acted => {
                    todo.insert(token);
                }
                TimerLook::Next(next) => timers.arm(s, token, next, now),
                TimerLook::Busy => timers.arm(s, token, now.checked_add(RETRY), now),
            }
        }
        if busy_look.due(Instant::now()) {
            for token in &busy {
                if let Some(s) = qps.get(token) {
                    Counters::add(&counters.timer_looks);
                    counters.visit(1);
                    if s.qp.rx_look(poll.registry()) {
                        todo.insert(*token);
                    }
                }
            }
        }
        for token in todo {
            let Some(s) = qps.get_mut(&token) else {
                continue;
            };
            let pass = s.qp.service(poll.registry(), &mut scratch);
            if pass.closed {
                tokens.remove(&key(&s.qp));
                qps.remove(&token);
                if busy.remove(&token) {
                    busy_look.set(!busy.is_empty(), Instant::now());
                }
                counters.served.fetch_sub(1, Ordering::Relaxed);
                continue;
            }
            // The engine's clock asks for a look (the peer stopped inside an FPDU for now,
            // the first-FPDU hold runs), or a busy-polled QP's looks go on.
            if pass.timeout.is_some() || (s.busy && s.timer_at.is_none()) {
                timers.arm(s, token, pass.timeout, Instant::now());
            }
            if pass.more {
                again.insert(token);
            }
            if pass.retry || pass.lingering {
                delayed.insert(token);
            }
        }
    }
}
