//! The MPA exchange over a TCP connection the caller established, advanced without
//! blocking: [`StreamHandshake`], the non-blocking twin of [`QueuePair::connect_stream`]
//! and [`QueuePair::accept_stream`] for callers that run their own event loop (the
//! preload library, whose program may have made the socket non-blocking).
//!
//! It drives the connection manager's attempt ([`crate::cm`]'s `attempt` module: the same
//! frames, screening, errors and deadline) one step per call, as far as the socket's bytes
//! allow, and never waits for the peer: a call reads what has arrived (the frame reader
//! keeps partial frames), writes what the socket takes, and returns. The one wait left is
//! the responder's Reply, at most 532 bytes written into a fresh connection's empty send
//! buffer (bounded by [`ConnectOptions::timeout`] should the peer's window be closed).

use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::Instant;

use mio::net::TcpStream as MioStream;

use crate::cm::attempt::{self, Initiator, Responder, Step};
use crate::cm::options::{ConnectOptions, ConnectionInfo};
use crate::error::{Error, Result};
use crate::qp::{QpShared, QueuePair};

/// An MPA exchange in progress on a TCP connection (see the module docs): call
/// [`StreamHandshake::advance`] whenever the socket ([`StreamHandshake::socket`]) is
/// ready as [`StreamHandshake::wants_write`] says, and at its
/// [`StreamHandshake::deadline`]. Dropped before its end, the QP goes back to Idle and
/// the socket is closed.
pub struct StreamHandshake {
    state: State,
}

enum State {
    Initiator(Box<Initiator>),
    Responder {
        qp: Arc<QpShared>,
        r: Box<Responder>,
    },
    /// Established or failed: the QP or the error has it.
    Over,
}

impl std::fmt::Debug for StreamHandshake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let side = match &self.state {
            State::Initiator(_) => "initiator",
            State::Responder { .. } => "responder",
            State::Over => "over",
        };
        f.debug_struct("StreamHandshake")
            .field("side", &side)
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
        if let Err(e) = stream.set_nonblocking(true) {
            qp.abandon_connect();
            return Err(Error::io("set O_NONBLOCK", e));
        }
        let r = Responder::new(MioStream::from_std(stream), Arc::new(opts.clone()));
        Ok(StreamHandshake {
            state: State::Responder {
                qp: Arc::clone(qp),
                r: Box::new(r),
            },
        })
    }
}

impl StreamHandshake {
    /// Advances the exchange as far as the socket allows, without waiting: `Ok(None)` while
    /// it waits for the peer's bytes (or the TCP handshake, or room to send), the
    /// connection once the QP is in RTS, or the error that ended it (also once its
    /// deadline passed: [`crate::MpaError::Timeout`]); the QP is then Idle again and the
    /// socket closed. After the end, `Err(Error::NotConnected)`.
    pub fn advance(&mut self) -> Result<Option<ConnectionInfo>> {
        match &mut self.state {
            State::Over => Err(Error::NotConnected),
            State::Initiator(a) => match a.step() {
                Step::Wait if !a.deadline.expired() => Ok(None),
                Step::Wait => {
                    let f = a.expired();
                    self.fail_initiator(f.into_error())
                }
                Step::Retry => {
                    let f = a.unreachable();
                    self.fail_initiator(f.into_error())
                }
                Step::Failed(f) => self.fail_initiator(f.into_error()),
                Step::Connected(neg) => {
                    let State::Initiator(a) = std::mem::replace(&mut self.state, State::Over)
                    else {
                        return Err(Error::NotConnected);
                    };
                    let hold = a.opts.first_fpdu_delay;
                    a.establish(neg, None, hold).map(Some)
                }
            },
            State::Responder { qp, r } => {
                let step = r
                    .step()
                    .or_else(|| r.deadline.expired().then(|| Err(r.expired())));
                let Some(done) = step else {
                    return Ok(None);
                };
                let qp = Arc::clone(qp);
                let State::Responder { r, .. } = std::mem::replace(&mut self.state, State::Over)
                else {
                    return Err(Error::NotConnected);
                };
                match done {
                    Ok(req) => {
                        attempt::answer_blocking(&qp, r.stream.into(), &req, &r.opts).map(Some)
                    }
                    Err(e) => {
                        qp.abandon_connect();
                        Err(e)
                    }
                }
            }
        }
    }

    fn fail_initiator(&mut self, e: Error) -> Result<Option<ConnectionInfo>> {
        if let State::Initiator(a) = std::mem::replace(&mut self.state, State::Over) {
            a.abandon();
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
            State::Over => None,
        }
    }

    /// The socket the exchange runs on (`None` after its end), to wait on.
    pub fn socket(&self) -> Option<BorrowedFd<'_>> {
        match &self.state {
            State::Initiator(a) => a.stream.as_ref().map(AsFd::as_fd),
            State::Responder { r, .. } => Some(r.stream.as_fd()),
            State::Over => None,
        }
    }
}

impl Drop for StreamHandshake {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.state, State::Over) {
            State::Initiator(a) => a.abandon(),
            State::Responder { qp, .. } => qp.abandon_connect(),
            State::Over => {}
        }
    }
}
