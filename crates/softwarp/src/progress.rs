//! The progress thread of a device: one `epoll` (through `mio`, edge-triggered) over the
//! non-blocking sockets of the device's connected QPs.
//!
//! On readiness it runs a QP's progress pass (receive until `EAGAIN`, transmit what is left,
//! move completions and events, close the connection when the QP is finished). Every
//! [`crate::qp::RX_LOOK_PERIOD`], while it has busy-polled QPs, it looks whether their
//! polls stopped with bytes waiting, and takes such a QP over (`QpShared::rx_look`). Other
//! threads talk to it through a command channel and a `mio::Waker`: register a new
//! connection, kick a QP whose state changed, move the QPs of an overflowed CQ to Error.
//! It never blocks on anything but `epoll_wait`.

use std::collections::{BTreeSet, HashMap};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use mio::{Events, Poll, Token, Waker};

use crate::cq::CqShared;
use crate::device::lock;
use crate::error::{Error, Result};
use crate::qp::QpShared;

const WAKE: Token = Token(0);
/// The device's rtnetlink socket (`crate::netwatch`), when it watches the network.
const NETLINK: Token = Token(usize::MAX);
/// Delay before retrying QPs that wait for the peer's FIN or for completions to be taken.
const RETRY: Duration = Duration::from_millis(5);
/// Size of the progress thread's staging buffer (it also swallows bytes arriving after a
/// QP stopped receiving): the engine's advice.
pub(crate) const SCRATCH_LEN: usize = softwarp_engine::qp::STAGE_LEN;
/// Shortest interval between two receive stall looks.
const STALL_LOOK_MIN: Duration = Duration::from_millis(5);

/// A periodic look of the progress thread: off while it has no period, else due every
/// period. Two kinds: for peers stalled in the middle of an FPDU (every quarter of the
/// shortest receive stall timeout among its QPs, so a stall is found between the timeout
/// and 1.5 times it), and for busy-polled QPs whose polls stopped
/// ([`crate::qp::RX_LOOK_PERIOD`], while it has busy-polled QPs).
#[derive(Debug, Default)]
struct Looks {
    period: Option<Duration>,
    next: Option<Instant>,
}

impl Looks {
    /// Sets the period (at registration and close); `None` stops the looks.
    fn set(&mut self, period: Option<Duration>) {
        self.period = period;
        if self.period.is_none() {
            self.next = None;
        } else if self.next.is_none() {
            self.next = self.period.and_then(|p| Instant::now().checked_add(p));
        }
    }

    /// How long `epoll_wait` may sleep before the next look.
    fn wait(&self, now: Instant) -> Option<Duration> {
        self.next.map(|t| t.saturating_duration_since(now))
    }

    /// True when a look is due (and schedules the next one).
    fn due(&mut self, now: Instant) -> bool {
        match (self.next, self.period) {
            (Some(t), Some(p)) if now >= t => {
                self.next = now.checked_add(p);
                true
            }
            _ => false,
        }
    }
}

/// The periods of the progress thread's looks, from its QPs (at registration and close).
fn set_looks(stall: &mut Looks, busy: &mut Looks, qps: &HashMap<Token, Arc<QpShared>>) {
    stall.set(
        qps.values()
            .filter_map(|qp| qp.rx_stall_timeout())
            .min()
            .map(|t| (t / 4).max(STALL_LOOK_MIN)),
    );
    busy.set(
        qps.values()
            .any(|qp| qp.busy_polled())
            .then_some(crate::qp::RX_LOOK_PERIOD),
    );
}

pub(crate) enum Cmd {
    Register(Arc<QpShared>),
    Kick(Arc<QpShared>),
    /// Look at a busy-polled QP's write watchdog after a delay (by its token).
    Watch(Token),
    CqOverflow(Arc<CqShared>),
    /// Watch the network with this rtnetlink socket (registered for readability).
    NetWatch(Box<crate::netwatch::NetWatch>),
    Shutdown,
}

/// Handle to a device's progress thread.
#[derive(Debug)]
pub(crate) struct Progress {
    tx: Mutex<Sender<Cmd>>,
    waker: Waker,
    thread: Mutex<Option<JoinHandle<()>>>,
    thread_id: ThreadId,
}

impl Progress {
    pub(crate) fn start(device_name: &str) -> Result<Self> {
        let poll = Poll::new().map_err(|e| Error::io("epoll_create", e))?;
        let waker = Waker::new(poll.registry(), WAKE).map_err(|e| Error::io("eventfd", e))?;
        let (tx, rx) = mpsc::channel();
        let handle =
            softwarp_ras::thread::spawn(format!("{device_name}-progress"), move || run(poll, rx))
                .map_err(|e| Error::io("spawn progress thread", e))?;
        Ok(Self {
            tx: Mutex::new(tx),
            waker,
            thread_id: handle.thread().id(),
            thread: Mutex::new(Some(handle)),
        })
    }

    fn send(&self, cmd: Cmd) -> Result<()> {
        lock(&self.tx).send(cmd).map_err(|_| Error::DeviceStopped)?;
        self.waker
            .wake()
            .map_err(|e| Error::io("wake the progress thread", e))
    }

    /// Hands a connected QP to the progress thread.
    pub(crate) fn register(&self, qp: Arc<QpShared>) -> Result<()> {
        self.send(Cmd::Register(qp))
    }

    /// Asks for a progress pass of `qp` (its state changed outside the data path).
    pub(crate) fn kick(&self, qp: Arc<QpShared>) {
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
    pub(crate) fn net_watch(&self, w: crate::netwatch::NetWatch) -> Result<()> {
        self.send(Cmd::NetWatch(Box::new(w)))
    }

    /// Moves every QP of `cq` to Error (the CQ overflowed).
    pub(crate) fn cq_overflow(&self, cq: Arc<CqShared>) {
        if let Err(e) = self.send(Cmd::CqOverflow(cq)) {
            tracing::error!(error = %e, "cannot reach the progress thread");
        }
    }
}

impl Drop for Progress {
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

fn run(mut poll: Poll, rx: Receiver<Cmd>) {
    crate::context::mark_progress_thread();
    let mut events = Events::with_capacity(1024);
    let mut qps: HashMap<Token, Arc<QpShared>> = HashMap::new();
    // Token of each registered QP, by the address of its shared state (for kicks).
    let mut tokens: HashMap<usize, Token> = HashMap::new();
    let key = |qp: &Arc<QpShared>| Arc::as_ptr(qp) as usize;
    let mut next_token = 1usize;
    // QPs to service without waiting for readiness: budget left over (`again`) or waiting
    // on a timer (`delayed`).
    let mut again: BTreeSet<Token> = BTreeSet::new();
    let mut delayed: BTreeSet<Token> = BTreeSet::new();
    let mut scratch = vec![0u8; SCRATCH_LEN];
    let mut stall = Looks::default();
    let mut busy = Looks::default();
    let mut netwatch: Option<Box<crate::netwatch::NetWatch>> = None;
    loop {
        let timeout = if !again.is_empty() {
            Some(Duration::ZERO)
        } else if !delayed.is_empty() {
            Some(RETRY)
        } else {
            None
        };
        let now = Instant::now();
        let timeout = [timeout, stall.wait(now), busy.wait(now)]
            .into_iter()
            .flatten()
            .min();
        if let Err(e) = poll.poll(&mut events, timeout) {
            if e.kind() != std::io::ErrorKind::Interrupted {
                tracing::error!(error = %e, "epoll_wait failed; progress thread stops");
                return;
            }
        }
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
                        tokens.insert(key(&qp), token);
                        qps.insert(token, qp);
                        todo.insert(token);
                        set_looks(&mut stall, &mut busy, &qps);
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
                Ok(Cmd::CqOverflow(cq)) => {
                    for qp in cq.qps() {
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
        if stall.due(Instant::now()) {
            let now = Instant::now();
            for (token, qp) in &qps {
                if qp.check_rx_stall(now) {
                    todo.insert(*token);
                }
            }
        }
        if busy.due(Instant::now()) {
            for (token, qp) in &qps {
                if qp.rx_look(poll.registry()) {
                    todo.insert(*token);
                }
            }
        }
        let mut closed_any = false;
        for token in todo {
            let Some(qp) = qps.get(&token) else {
                continue;
            };
            let pass = qp.service(poll.registry(), &mut scratch);
            if pass.closed {
                tokens.remove(&key(qp));
                qps.remove(&token);
                closed_any = true;
                continue;
            }
            if pass.more {
                again.insert(token);
            }
            if pass.retry || pass.lingering {
                delayed.insert(token);
            }
        }
        if closed_any {
            set_looks(&mut stall, &mut busy, &qps);
        }
    }
}
