//! The thread of a [`super::CmEventChannel`]: one `epoll` (through `mio`) over the channel's
//! listeners and the connections still negotiating (TCP connects in progress, MPA Requests
//! being sent, Requests and Replies being read), each a job stepped on readiness by the
//! shared connection path ([`super::attempt`]). It never blocks on anything else, so one slow
//! or silent peer does not delay the others; every job has a deadline, and a full listener
//! makes room as the admission module says.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::TcpListener as MioListener;
use mio::{Events, Interest, Poll, Token};
use softwarp_engine::mpa::{Negotiated, PeerRequest};

use super::admission::{ListenerState, Slot, EVICT_AGE};
use super::attempt::{Failed, Initiator, Responder, Step};
use super::channel::ChannelShared;
use super::event::{CmEvent, ConnId, ListenerId};
use super::id::IdShared;
use super::request::ConnectRequest;
use crate::error::{Error, MpaError};
use crate::runtime::sys;
use crate::verbs::qp::options::ConnectOptions;

/// The waker's token.
pub(super) const WAKE: Token = Token(0);

/// What a channel handle asks of its thread.
pub(super) enum Cmd {
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

/// An active connection attempt.
pub(super) struct Active {
    pub(super) id: Arc<IdShared>,
    pub(super) a: Initiator,
}

/// A TCP connection accepted by a listener, its MPA Request still being read.
struct Passive {
    conn_id: ConnId,
    listener: ListenerId,
    peer: SocketAddr,
    r: Responder,
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

/// The channel's thread: its epoll, its commands, and every job it drives.
pub(super) struct Worker {
    poll: Poll,
    rx: Receiver<Cmd>,
    shared: Arc<ChannelShared>,
    jobs: HashMap<Token, Job>,
    next_token: usize,
}

impl Worker {
    pub(super) fn new(poll: Poll, rx: Receiver<Cmd>, shared: Arc<ChannelShared>) -> Self {
        Self {
            poll,
            rx,
            shared,
            jobs: HashMap::new(),
            next_token: 1,
        }
    }

    /// Runs until the channel is dropped (or epoll fails).
    pub(super) fn run(mut self) {
        crate::availability::context::mark_cm_thread();
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
                Job::Active(a) => [a.a.deadline.instant(), None],
                Job::Passive(p) => [
                    p.r.deadline.instant(),
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
                a.a.abandon();
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
            Job::Active(a) => match a.a.stream.as_mut() {
                Some(s) => reg.deregister(s),
                None => Ok(()),
            },
            Job::Passive(p) => reg.deregister(&mut p.r.stream),
        };
        Some(job)
    }

    fn step(&mut self, token: Token) {
        if matches!(self.jobs.get(&token), Some(Job::Listener { .. })) {
            self.accept_all(token);
            return;
        }
        let finish = match self.jobs.get_mut(&token) {
            Some(Job::Active(a)) => match a.a.step() {
                Step::Wait => return,
                Step::Retry => {
                    self.start_connect(token);
                    return;
                }
                Step::Connected(neg) => Finish::Connected(neg),
                Step::Failed(f) => Finish::Failed(f),
            },
            Some(Job::Passive(p)) => match p.r.step() {
                None => return,
                Some(Ok(req)) => Finish::Request(req),
                Some(Err(error)) => {
                    tracing::debug!(peer = %p.peer, %error, "connection request refused");
                    Finish::Refused(error)
                }
            },
            _ => return,
        };
        if let Some(job) = self.remove(token) {
            self.finish(job, finish);
        }
    }

    /// Connects an active job to its next address (or fails it when none is left).
    fn start_connect(&mut self, token: Token) {
        let Some(Job::Active(a)) = self.jobs.get_mut(&token) else {
            return;
        };
        if let Err(f) = a.a.next_address(self.poll.registry(), token) {
            if let Some(Job::Active(a)) = self.remove(token) {
                fail_active(a, f);
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
                    accepted_at: Instant::now(),
                    r: Responder::new(stream, opts),
                    peer,
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
                Job::Active(a) => a.a.deadline.expired_at(now),
                Job::Passive(p) => p.r.deadline.expired_at(now),
                Job::Listener { .. } => false,
            })
            .map(|(t, _)| *t)
            .collect();
        for t in late {
            match self.remove(t) {
                Some(Job::Active(a)) => {
                    let failed = a.a.expired();
                    fail_active(a, failed);
                }
                Some(Job::Passive(p)) => {
                    // A peer that never completes its Request: closed, without an answer.
                    self.shared.push(CmEvent::RequestError {
                        listener: p.listener,
                        peer: p.peer,
                        error: p.r.expired(),
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
                    r,
                    peer,
                    mut slot,
                    ..
                } = *p;
                let (opts, std_stream) = (r.opts, r.stream.into());
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

/// How a job ended.
enum Finish {
    Failed(Failed),
    Connected(Negotiated),
    Request(PeerRequest),
    Refused(Error),
}

fn fail_active(a: Box<Active>, failed: Failed) {
    a.a.abandon();
    let id = a.id.conn_id();
    let ev = match failed {
        Failed::Unreachable(error) => CmEvent::Unreachable { id, error },
        Failed::Rejected(private_data) => CmEvent::Rejected { id, private_data },
        Failed::Mpa(error) => CmEvent::ConnectError { id, error },
    };
    tracing::debug!(conn = %id, event = ev.name(), "connection attempt failed");
    a.id.failed(ev);
}

fn establish_active(a: Box<Active>, neg: Negotiated) {
    let Active { id, a } = *a;
    let observer: Arc<dyn crate::verbs::qp::ConnObserver> = Arc::clone(&id) as _;
    let hold = a.opts.first_fpdu_delay;
    match a.establish(neg, Some(observer), hold) {
        Ok(info) => id.established(info),
        Err(error) => id.failed(CmEvent::ConnectError {
            id: id.conn_id(),
            error,
        }),
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
        assert_eq!(crate::cm::frame_io::MAX_FRAME_LEN, 532);
        // The jobs map holds a token and a boxed job per entry.
        assert!(std::mem::size_of::<(Token, Job)>() <= 64);
    }
}
