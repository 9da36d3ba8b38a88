//! The MPA exchange over a TCP connection the caller established, advanced without
//! blocking: [`StreamHandshake`], the non-blocking twin of [`QueuePair::connect_stream`]
//! and [`QueuePair::accept_stream`] for callers that run their own event loop (the
//! preload library, whose program may have made the socket non-blocking).
//!
//! It drives the connection manager's attempt ([`crate::cm`]'s `attempt` module: the same
//! frames, screening, errors and deadline) one step per call, as far as the socket's bytes
//! allow, and never waits for the peer: a call reads what has arrived (the frame reader
//! keeps partial frames), writes what the socket takes, and returns. The responder's Reply
//! (at most 532 bytes) goes into the fresh connection's empty send buffer, which takes it
//! whatever the peer's window.
//!
//! A responder may read and screen the Request before it has a QP
//! ([`StreamHandshake::start_accept`], then [`StreamHandshake::bind_qp`] once
//! [`StreamHandshake::needs_qp`] says the Request is in): a peer that never finishes its
//! Request then costs its socket and the frame reader, not a QP and its buffers.

use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::Instant;

use mio::net::TcpStream as MioStream;
use softwarp_engine::mpa::PeerRequest;
use softwarp_ras::deadline::Deadline;

use crate::cm::attempt::{self, Initiator, Responder, Step};
use crate::error::{Error, Result};
use crate::verbs::qp::options::{ConnectOptions, ConnectionInfo};
use crate::verbs::qp::{QpShared, QueuePair};

/// An MPA exchange in progress on a TCP connection (see the module docs): call
/// [`StreamHandshake::advance`] whenever the socket ([`StreamHandshake::socket`]) is ready
/// as [`StreamHandshake::wants_write`] says, and at its [`StreamHandshake::deadline`].
/// Dropped before its end, the QP (if one was bound) goes back to Idle and the socket is
/// closed.
pub struct StreamHandshake {
    state: State,
}

enum State {
    Initiator(Box<Initiator>),
    /// Reading the Request; `qp` claimed already, or `None` until [`StreamHandshake::bind_qp`].
    Responder {
        qp: Option<Arc<QpShared>>,
        r: Box<Responder>,
    },
    /// The Request is in and acceptable; no QP yet to answer it with.
    Screened(Box<Screened>),
    /// Answered by [`StreamHandshake::bind_qp`]: the next advance returns the connection.
    Answered(Box<ConnectionInfo>),
    /// Established or failed: the QP or the error has it.
    Over,
}

/// A responder's Request read and screened, waiting for its QP.
struct Screened {
    stream: MioStream,
    req: PeerRequest,
    opts: Arc<ConnectOptions>,
    deadline: Deadline,
}

impl std::fmt::Debug for StreamHandshake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Initiator(_) => "initiator",
            State::Responder { .. } => "responder",
            State::Screened(_) => "request in",
            State::Answered(_) => "answered",
            State::Over => "over",
        };
        f.debug_struct("StreamHandshake")
            .field("state", &state)
            .finish_non_exhaustive()
    }
}

impl QueuePair {
    /// Starts [`QueuePair::connect_stream`] without waiting: the QP (Idle) is claimed and
    /// the MPA Request goes out on `stream` (which may still be connecting: a non-blocking
    /// `connect` in progress) as [`StreamHandshake::advance`] finds the socket ready.
    pub fn start_connect_stream(
        &self,
        stream: TcpStream,
        opts: &ConnectOptions,
    ) -> Result<StreamHandshake> {
        let a = Initiator::on_stream(self.shared(), stream, opts)?;
        Ok(StreamHandshake {
            state: State::Initiator(Box::new(a)),
        })
    }

    /// Starts [`QueuePair::accept_stream`] without waiting: the QP (Idle) is claimed and
    /// the MPA Request is read from `stream` as [`StreamHandshake::advance`] finds it.
    pub fn start_accept_stream(
        &self,
        stream: TcpStream,
        opts: &ConnectOptions,
    ) -> Result<StreamHandshake> {
        let qp = self.shared();
        attempt::claim_responder(qp, opts)?;
        match StreamHandshake::start_accept(stream, opts) {
            Ok(mut h) => {
                if let State::Responder { qp: bound, .. } = &mut h.state {
                    *bound = Some(Arc::clone(qp));
                }
                Ok(h)
            }
            Err(e) => {
                qp.abandon_connect();
                Err(e)
            }
        }
    }
}

impl StreamHandshake {
    /// Starts the responder's side on `stream` without a QP: [`StreamHandshake::advance`]
    /// reads and screens the Request; once it is in ([`StreamHandshake::needs_qp`]),
    /// [`StreamHandshake::bind_qp`] gives the QP that answers it.
    pub fn start_accept(stream: TcpStream, opts: &ConnectOptions) -> Result<StreamHandshake> {
        stream
            .set_nonblocking(true)
            .map_err(|e| Error::io("set O_NONBLOCK", e))?;
        let r = Responder::new(MioStream::from_std(stream), Arc::new(opts.clone()));
        Ok(StreamHandshake {
            state: State::Responder {
                qp: None,
                r: Box::new(r),
            },
        })
    }

    /// Advances the exchange as far as the socket allows, without waiting: `Ok(None)` while
    /// it waits for the peer's bytes (or the TCP handshake, or room to send, or a QP:
    /// [`StreamHandshake::needs_qp`]), the connection once the QP is in RTS, or the error
    /// that ended it (also once its deadline passed: [`crate::MpaError::Timeout`]); the QP
    /// is then Idle again and the socket closed. After the end, `Err(Error::NotConnected)`.
    pub fn advance(&mut self) -> Result<Option<ConnectionInfo>> {
        match &mut self.state {
            State::Over => Err(Error::NotConnected),
            State::Answered(_) => match std::mem::replace(&mut self.state, State::Over) {
                State::Answered(info) => Ok(Some(*info)),
                _ => Err(Error::NotConnected),
            },
            State::Initiator(a) => match a.step() {
                Step::Wait if !a.deadline.expired() => Ok(None),
                Step::Wait => {
                    let f = a.expired();
                    self.fail(f.into_error())
                }
                Step::Retry => {
                    let f = a.unreachable();
                    self.fail(f.into_error())
                }
                Step::Failed(f) => self.fail(f.into_error()),
                Step::Connected(neg) => {
                    let State::Initiator(a) = std::mem::replace(&mut self.state, State::Over)
                    else {
                        return Err(Error::NotConnected);
                    };
                    let hold = a.opts.first_fpdu_delay;
                    a.establish(neg, None, hold).map(Some)
                }
            },
            State::Screened(s) => {
                if s.deadline.expired() {
                    let e = crate::error::MpaError::Timeout(s.opts.timeout).into();
                    return self.fail(e);
                }
                Ok(None)
            }
            State::Responder { r, .. } => {
                let step = r
                    .step()
                    .or_else(|| r.deadline.expired().then(|| Err(r.expired())));
                let Some(done) = step else {
                    return Ok(None);
                };
                let req = match done {
                    Ok(req) => req,
                    Err(e) => return self.fail(e),
                };
                let State::Responder { qp, r } = std::mem::replace(&mut self.state, State::Over)
                else {
                    return Err(Error::NotConnected);
                };
                let Responder {
                    stream,
                    opts,
                    deadline,
                    ..
                } = *r;
                match qp {
                    Some(qp) => attempt::answer_blocking(&qp, stream.into(), &req, &opts).map(Some),
                    None => {
                        self.state = State::Screened(Box::new(Screened {
                            stream,
                            req,
                            opts,
                            deadline,
                        }));
                        Ok(None)
                    }
                }
            }
        }
    }

    /// True when the responder read an acceptable Request and waits for
    /// [`StreamHandshake::bind_qp`].
    pub fn needs_qp(&self) -> bool {
        matches!(self.state, State::Screened(_))
    }

    /// Gives the responder whose Request is in ([`StreamHandshake::needs_qp`]) the QP
    /// (Idle) that answers it: the next [`StreamHandshake::advance`] sends the Reply and
    /// moves the QP to RTS. A QP that cannot take the connection (not Idle, limits below
    /// the settings) fails the exchange: the peer hears a reject.
    pub fn bind_qp(&mut self, qp: &QueuePair) -> Result<()> {
        let State::Screened(s) = std::mem::replace(&mut self.state, State::Over) else {
            return Err(Error::InvalidArgument("no MPA Request waits for a QP"));
        };
        let shared = qp.shared();
        let Screened {
            stream, req, opts, ..
        } = *s;
        if let Err(e) = attempt::claim_responder(shared, &opts) {
            let mut tcp: TcpStream = stream.into();
            let _ = attempt::reject(&mut tcp, Some(&req), &opts, &[], opts.timeout);
            return Err(e);
        }
        let info = attempt::answer_blocking(shared, stream.into(), &req, &opts)?;
        self.state = State::Answered(Box::new(info));
        Ok(())
    }

    fn fail(&mut self, e: Error) -> Result<Option<ConnectionInfo>> {
        match std::mem::replace(&mut self.state, State::Over) {
            State::Initiator(a) => a.abandon(),
            State::Responder { qp: Some(qp), .. } => qp.abandon_connect(),
            _ => {}
        }
        Err(e)
    }

    /// True while the exchange waits for room to send (the initiator's TCP connect, or its
    /// Request not all written); otherwise it waits for bytes to read.
    pub fn wants_write(&self) -> bool {
        matches!(&self.state, State::Initiator(a)
            if matches!(a.phase, attempt::Phase::Connecting | attempt::Phase::Writing))
    }

    /// When the exchange fails unless it finished ([`ConnectOptions::timeout`] after it
    /// started); `None` after its end or without a limit.
    pub fn deadline(&self) -> Option<Instant> {
        match &self.state {
            State::Initiator(a) => a.deadline.instant(),
            State::Responder { r, .. } => r.deadline.instant(),
            State::Screened(s) => s.deadline.instant(),
            _ => None,
        }
    }

    /// The socket the exchange runs on (`None` after its end), to wait on.
    pub fn socket(&self) -> Option<BorrowedFd<'_>> {
        match &self.state {
            State::Initiator(a) => a.stream.as_ref().map(AsFd::as_fd),
            State::Responder { r, .. } => Some(r.stream.as_fd()),
            State::Screened(s) => Some(s.stream.as_fd()),
            _ => None,
        }
    }
}

impl Drop for StreamHandshake {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.state, State::Over) {
            State::Initiator(a) => a.abandon(),
            State::Responder { qp: Some(qp), .. } => qp.abandon_connect(),
            _ => {}
        }
    }
}
