//! The blocking listener: [`Listener`] accepts TCP connections on the calling thread and
//! runs the responder's side of the connection manager's path on them
//! ([`crate::cm`]'s `attempt` module): the same MPA screening and Reply, the same errors and
//! deadline ([`ConnectOptions::timeout`]), and the same establishment, so the QP holds its
//! first FPDU until the initiator's first one arrives (RFC 5044), or its RTR (RFC 6581),
//! as [`ConnectOptions::responder_waits_for_initiator`] says. Its initiator twin is
//! [`QueuePair::connect`].
//!
//! The MPA Requests of the connections it took are read side by side, as the connection
//! manager's listener does: a peer that never finishes its Request (silent, half a Request,
//! a byte at a time) holds one of the listener's places until its timeout, not the
//! listener, and the good client behind it is answered as soon as its Request is in. At most
//! `backlog` connections are held ([`Listener::bind_backlog`]); when they are all held and
//! another waits in the kernel's queue, the one that has waited longest for its Request is
//! closed once it has waited a second (the connection manager's eviction rule).
//!
//! This path reports no events and no disconnect notification; the connection manager
//! ([`crate::CmEventChannel`]) is the full-featured way.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mio::net::TcpStream as MioStream;
use softwarp_ras::deadline::Deadline;

use crate::cm::attempt::{self, Responder};
use crate::cm::EVICT_AGE;
use crate::error::{Error, Result};
use crate::runtime::sys;
use crate::sync::lock;
use crate::verbs::qp::options::{ConnectOptions, ConnectionInfo};
use crate::verbs::qp::QueuePair;

/// Connections a [`Listener`] holds while it reads their MPA Requests, by default
/// ([`Listener::bind`]).
pub const LISTENER_BACKLOG: u32 = 128;

/// A TCP listener that accepts iWARP connections into QPs on the calling thread, one QP per
/// call: the connection manager's responder path without a channel or events (see
/// [`crate::CmEventChannel::listen`] for the connection manager's listener). The MPA
/// Requests of the connections it holds are read side by side (see the module docs);
/// concurrent calls on one listener take their turns.
#[derive(Debug)]
pub struct Listener {
    inner: TcpListener,
    /// Connections taken whose MPA Request is still being read, oldest first.
    held: Mutex<VecDeque<Held>>,
    backlog: usize,
    _ras: crate::instrument::Tracked,
}

/// A connection a [`Listener`] took, its MPA Request still being read (screened with the
/// options of the call that took it, within their timeout).
struct Held {
    r: Responder,
    peer: SocketAddr,
    accepted_at: Instant,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("peer", &self.peer)
            .field("accepted_at", &self.accepted_at)
            .finish_non_exhaustive()
    }
}

impl Listener {
    /// Listens on `addr` (port 0: any free port, see [`Listener::local_addr`]), holding at
    /// most [`LISTENER_BACKLOG`] connections while their MPA Requests are read.
    #[track_caller]
    pub fn bind<A: ToSocketAddrs>(addr: A) -> Result<Self> {
        Self::bind_backlog(addr, LISTENER_BACKLOG)
    }

    /// As [`Listener::bind`], holding at most `backlog` connections (0 counts as 1), which
    /// is also the kernel's accept queue (`listen(2)`, capped at `net.core.somaxconn`).
    #[track_caller]
    pub fn bind_backlog<A: ToSocketAddrs>(addr: A, backlog: u32) -> Result<Self> {
        let backlog = backlog.max(1);
        let inner = TcpListener::bind(addr).map_err(|e| Error::io("bind listener", e))?;
        sys::set_listen_backlog(inner.as_fd(), backlog)
            .map_err(|e| Error::io("listen backlog", e))?;
        inner
            .set_nonblocking(true)
            .map_err(|e| Error::io("set O_NONBLOCK", e))?;
        let _ras = crate::instrument::listener(inner.local_addr().ok());
        Ok(Self {
            inner,
            held: Mutex::new(VecDeque::new()),
            backlog: usize::try_from(backlog).unwrap_or(usize::MAX),
            _ras,
        })
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.inner
            .local_addr()
            .map_err(|e| Error::io("getsockname", e))
    }

    /// Waits (without a time limit) for a connection whose MPA Request is acceptable,
    /// performs the MPA exchange as responder (each connection's Request bounded by
    /// [`ConnectOptions::timeout`]) and moves `qp` (Idle, receives posted) to RTS. As on the
    /// connection manager's path, the QP then sends nothing before the initiator's first
    /// FPDU (or, in peer-to-peer mode, its RTR) arrived, unless
    /// [`ConnectOptions::responder_waits_for_initiator`] is off: work posted meanwhile waits
    /// in the QP. A connection that fails its MPA exchange (garbage, a Request `opts` cannot
    /// accept, which is answered with a reject, silence past its timeout, a close) is closed
    /// and its error returned, one per call, and `qp` stays Idle; the other connections the
    /// listener holds stay for the next call.
    pub fn accept(&self, qp: &QueuePair, opts: &ConnectOptions) -> Result<ConnectionInfo> {
        self.accept_inner(qp, opts, None)
    }

    /// As [`Listener::accept`], waiting at most `timeout` for a connection to finish its
    /// Request ([`Error::Timeout`]).
    pub fn accept_timeout(
        &self,
        qp: &QueuePair,
        opts: &ConnectOptions,
        timeout: Duration,
    ) -> Result<ConnectionInfo> {
        self.accept_inner(qp, opts, Some(timeout))
    }

    /// Connections held while their MPA Requests are read (taken by earlier calls and not
    /// finished yet).
    pub fn pending(&self) -> usize {
        lock(&self.held).len()
    }

    fn accept_inner(
        &self,
        qp: &QueuePair,
        opts: &ConnectOptions,
        timeout: Option<Duration>,
    ) -> Result<ConnectionInfo> {
        crate::availability::context::check_blocking("Listener::accept")?;
        let shared = qp.shared();
        attempt::claim_responder(shared, opts)?;
        let deadline = Deadline::from_timeout(timeout);
        let screen_opts = Arc::new(opts.clone());
        let mut held = lock(&self.held);
        let outcome = loop {
            if let Err(e) = self.take_connections(&mut held, &screen_opts) {
                break Err(e);
            }
            if let Some(done) = Self::screen(&mut held) {
                break done;
            }
            let now = Instant::now();
            let left = deadline.remaining_at(now);
            if left.is_some_and(|l| l.is_zero()) {
                break Err(Error::Timeout(timeout.unwrap_or_default()));
            }
            // Until the call's deadline or the first Request's; the listener's socket while
            // there is room, or once the oldest held connection may be closed for a new one
            // (before that, until it may: a connection waiting in the kernel's queue would
            // make the socket readable at once, again and again).
            let mut wait = held
                .iter()
                .filter_map(|h| h.r.deadline.remaining_at(now))
                .chain(left)
                .min();
            let evictable_in = held
                .front()
                .map(|h| EVICT_AGE.saturating_sub(now.saturating_duration_since(h.accepted_at)));
            let full = held.len() >= self.backlog;
            let watch_listener = !full || evictable_in.is_some_and(|d| d.is_zero());
            if !watch_listener {
                wait = wait.into_iter().chain(evictable_in).min();
            }
            let mut fds: Vec<BorrowedFd<'_>> = Vec::with_capacity(held.len() + 1);
            if watch_listener {
                fds.push(self.inner.as_fd());
            }
            fds.extend(held.iter().map(|h| h.r.stream.as_fd()));
            if let Err(e) = sys::poll_any_readable(&fds, wait) {
                break Err(Error::io("poll on listener", e));
            }
        };
        drop(held);
        match outcome {
            Ok((stream, req)) => attempt::answer_blocking(shared, stream, &req, opts),
            Err(e) => {
                shared.abandon_connect();
                Err(e)
            }
        }
    }

    /// Takes the connections waiting in the kernel's queue while there is room; at the
    /// bound, with another waiting, closes the connection that has waited longest for its
    /// Request once it has waited [`EVICT_AGE`] and takes the next.
    fn take_connections(
        &self,
        held: &mut VecDeque<Held>,
        opts: &Arc<ConnectOptions>,
    ) -> Result<()> {
        loop {
            if held.len() >= self.backlog {
                let queued = sys::accept_queue_len(self.inner.as_fd()).map_or(1, |n| n);
                let old = held
                    .front()
                    .is_some_and(|h| h.accepted_at.elapsed() >= EVICT_AGE);
                if queued == 0 || !old {
                    return Ok(());
                }
                if let Some(h) = held.pop_front() {
                    tracing::debug!(peer = %h.peer, waited = ?h.accepted_at.elapsed(),
                        "negotiating connection evicted");
                }
            }
            match self.inner.accept() {
                Ok((s, peer)) => {
                    tracing::debug!(%peer, "TCP connection accepted");
                    s.set_nonblocking(true)
                        .map_err(|e| Error::io("set O_NONBLOCK", e))?;
                    held.push_back(Held {
                        r: Responder::new(MioStream::from_std(s), Arc::clone(opts)),
                        peer,
                        accepted_at: Instant::now(),
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("accept", e)),
            }
        }
    }

    /// Reads what the held connections' Requests still need, oldest first, and takes out
    /// the first that is complete and screened (or failed, or ran out of time).
    fn screen(
        held: &mut VecDeque<Held>,
    ) -> Option<Result<(TcpStream, softwarp_engine::mpa::PeerRequest)>> {
        let mut i = 0;
        while let Some(h) = held.get_mut(i) {
            let step =
                h.r.step()
                    .or_else(|| h.r.deadline.expired().then(|| Err(h.r.expired())));
            let Some(done) = step else {
                i += 1;
                continue;
            };
            let h = held.remove(i)?;
            return Some(done.map(|req| (h.r.stream.into(), req)));
        }
        None
    }
}

/// The blocking connection of a QP: the connection manager's path on the calling thread.
impl QueuePair {
    /// Connects to a listening peer (`addr`) and performs the MPA Request/Reply exchange
    /// (RFC 5044 section 7.1, RFC 6581) on this thread, then moves the QP to RTS. The QP
    /// must be Idle; post receives first if the peer may send at once. This is the
    /// connection manager's path ([`crate::CmEventChannel::connect_blocking`]) run on the
    /// calling thread, without a channel or events: the same steps, deadline
    /// ([`ConnectOptions::timeout`]) and errors, and the same first-FPDU hold-off
    /// ([`ConnectOptions::first_fpdu_delay`]: work posted meanwhile waits in the QP).
    pub fn connect<A: ToSocketAddrs>(
        &self,
        addr: A,
        opts: &ConnectOptions,
    ) -> Result<ConnectionInfo> {
        crate::availability::context::check_blocking("QueuePair::connect")?;
        let addrs = crate::cm::resolve(addr)?;
        let a = attempt::Initiator::new(self.shared(), addrs, opts)?;
        attempt::initiate_blocking(a)
    }

    /// Like [`QueuePair::connect`], over a TCP connection the caller already established
    /// (the stream handover of the OpenRDMA design: a connection that spoke plain TCP moves
    /// to iWARP). Sends the MPA Request on `stream` and checks the Reply (bounded by
    /// [`ConnectOptions::timeout`]); the peer must run the responder side on its end
    /// ([`QueuePair::accept_stream`]) and nothing else may be in flight on the connection.
    /// The QP owns the stream from then on; on failure the stream is closed and the QP
    /// stays Idle.
    pub fn connect_stream(
        &self,
        stream: std::net::TcpStream,
        opts: &ConnectOptions,
    ) -> Result<ConnectionInfo> {
        crate::availability::context::check_blocking("QueuePair::connect_stream")?;
        let a = attempt::Initiator::on_stream(self.shared(), stream, opts)?;
        attempt::initiate_blocking(a)
    }

    /// The responder side of [`QueuePair::connect_stream`] (and of a [`QueuePair::connect`]
    /// whose TCP connection the caller accepted itself): reads and checks the MPA Request on
    /// `stream`, sends the Reply (or a reject) and moves the QP to RTS, as
    /// [`crate::Listener::accept`] does (the same gate on the first FPDU). Bounded by
    /// [`ConnectOptions::timeout`]; on failure the stream is closed and the QP stays Idle.
    pub fn accept_stream(
        &self,
        stream: std::net::TcpStream,
        opts: &ConnectOptions,
    ) -> Result<ConnectionInfo> {
        crate::availability::context::check_blocking("QueuePair::accept_stream")?;
        attempt::claim_responder(self.shared(), opts)?;
        attempt::respond_blocking(self.shared(), stream, opts)
    }
}
