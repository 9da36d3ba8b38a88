//! One connection attempt, the same on every path: the initiator's TCP connect, MPA Request
//! and Reply ([`Initiator`]); the responder's read and screening of the Request
//! ([`Responder`]) and its Reply ([`reply_for`], [`send_reply`]); the errors each step and
//! each deadline give; and the establishment of the QP on the negotiated socket.
//!
//! The connection manager's thread drives many attempts at once on its `epoll`
//! ([`super::CmEventChannel`]). The blocking helpers ([`crate::QueuePair::connect`],
//! [`crate::QueuePair::connect_stream`], [`crate::QueuePair::accept_stream`],
//! [`crate::Listener::accept`]) drive one on the calling thread with [`initiate_blocking`]
//! and [`respond_blocking`], each on an `epoll` instance of its own: the same steps, so the
//! same errors, deadlines and responder gate (RFC 5044 / RFC 6581), without events. One
//! difference: a blocking initiator waits the first-FPDU hold-off out before it returns
//! (the CM's thread cannot, so its QP holds its FPDUs instead).
//!
//! The rules themselves are the engine's ([`softwarp_engine::mpa`]); this module moves the
//! frames and keeps the time.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use mio::net::TcpStream as MioStream;
use mio::{Events, Interest, Poll, Registry, Token};
use softwarp_engine::mpa::{self, FrameOut, Negotiated, PeerRequest, QpLimits, Screened};
use softwarp_ras::deadline::Deadline;

use super::frame_io::{self, FrameReader, Progress, ReadError};
use crate::error::{Error, MpaError, Result};
use crate::verbs::qp::options::{ConnectOptions, ConnectionInfo};
use crate::verbs::qp::{ConnObserver, QpShared};

/// The error of a failed socket operation during negotiation: a timeout, the peer gone, or
/// the operating system's error.
pub(crate) fn map_io(op: &'static str, e: io::Error, total: Duration) -> Error {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => MpaError::Timeout(total).into(),
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe => MpaError::Closed.into(),
        _ => Error::io(op, e),
    }
}

// ---------------------------------------------------------------------------------------
// Initiator
// ---------------------------------------------------------------------------------------

/// Where an initiator is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// TCP connect in progress.
    Connecting,
    /// Sending the MPA Request.
    Writing,
    /// Reading the MPA Reply.
    Reading,
}

/// How an initiator failed; each is a [`super::CmEvent`] of its own on the connection
/// manager's channel, and [`Failed::into_error`] on the blocking path (and from
/// `CmEventChannel::connect_blocking`).
#[derive(Debug)]
pub(crate) enum Failed {
    /// No TCP connection (`UNREACHABLE`).
    Unreachable(Error),
    /// The responder rejected the connection, with this private data (`REJECTED`).
    Rejected(Vec<u8>),
    /// The MPA exchange failed (`CONNECT_ERROR`).
    Mpa(Error),
}

impl Failed {
    /// The error a blocking connect returns.
    pub(crate) fn into_error(self) -> Error {
        match self {
            Failed::Unreachable(e) | Failed::Mpa(e) => e,
            Failed::Rejected(private_data) => MpaError::Rejected { private_data }.into(),
        }
    }
}

/// What a step of an initiator came to.
pub(crate) enum Step {
    /// The socket has nothing more for now.
    Wait,
    /// The TCP connect failed: try the next address ([`Initiator::next_address`]).
    Retry,
    /// The Reply was accepted: establish ([`Initiator::establish`]).
    Connected(Negotiated),
    /// The attempt failed (a Terminate was sent first when the rules ask for one).
    Failed(Failed),
}

/// An initiator's attempt, from the QP claimed for it to the Reply checked.
pub(crate) struct Initiator {
    pub(crate) qp: Arc<QpShared>,
    pub(crate) opts: ConnectOptions,
    limits: QpLimits,
    request: FrameOut,
    bytes: Vec<u8>,
    /// Addresses not tried yet.
    addrs: VecDeque<SocketAddr>,
    pub(crate) stream: Option<MioStream>,
    pub(crate) phase: Phase,
    written: usize,
    reader: FrameReader,
    pub(crate) deadline: Deadline,
    last_err: Option<io::Error>,
}

impl Initiator {
    /// Claims `qp` (Idle) for an attempt to `addrs` under `opts`; refuses settings that
    /// cannot work (private data too long, IRD/ORD beyond the QP, an impossible
    /// peer-to-peer offer, a QP that is not Idle) before any connection is made.
    pub(crate) fn new(
        qp: &Arc<QpShared>,
        addrs: Vec<SocketAddr>,
        opts: &ConnectOptions,
    ) -> Result<Self> {
        let offer = opts.offer();
        let limits = qp.local_params(opts)?;
        let request = mpa::request(&offer, &limits)?;
        let bytes = request.encode()?;
        qp.begin_connect()?;
        Ok(Self {
            qp: Arc::clone(qp),
            opts: opts.clone(),
            limits,
            request,
            bytes,
            addrs: addrs.into(),
            stream: None,
            phase: Phase::Connecting,
            written: 0,
            reader: FrameReader::new(),
            deadline: Deadline::after(opts.timeout),
            last_err: None,
        })
    }

    /// As [`Initiator::new`], on a TCP connection the caller established.
    pub(crate) fn on_stream(
        qp: &Arc<QpShared>,
        stream: TcpStream,
        opts: &ConnectOptions,
    ) -> Result<Self> {
        stream
            .set_nonblocking(true)
            .map_err(|e| Error::io("set O_NONBLOCK", e))?;
        let mut a = Self::new(qp, Vec::new(), opts)?;
        a.stream = Some(MioStream::from_std(stream));
        Ok(a)
    }

    /// Lets go of the QP after a failure (it stays Idle).
    pub(crate) fn abandon(&self) {
        self.qp.abandon_connect();
    }

    /// Starts a TCP connect to the next address, its socket registered with `registry`
    /// under `token` (the previous one deregistered), or fails when no address is left.
    pub(crate) fn next_address(
        &mut self,
        registry: &Registry,
        token: Token,
    ) -> std::result::Result<(), Failed> {
        if let Some(mut old) = self.stream.take() {
            let _ = registry.deregister(&mut old);
        }
        while let Some(addr) = self.addrs.pop_front() {
            match MioStream::connect(addr) {
                Ok(mut s) => {
                    match registry.register(&mut s, token, Interest::READABLE | Interest::WRITABLE)
                    {
                        Ok(()) => {
                            self.stream = Some(s);
                            self.phase = Phase::Connecting;
                            return Ok(());
                        }
                        Err(e) => self.last_err = Some(e),
                    }
                }
                Err(e) => self.last_err = Some(e),
            }
        }
        Err(Failed::Unreachable(match self.last_err.take() {
            Some(e) => Error::io("TCP connect", e),
            None => Error::InvalidArgument("the address resolved to nothing"),
        }))
    }

    /// How the attempt fails when its TCP connect failed and no address is left to try
    /// (the connect of a caller's stream, [`Initiator::on_stream`]).
    pub(crate) fn unreachable(&mut self) -> Failed {
        Failed::Unreachable(match self.last_err.take() {
            Some(e) => Error::io("TCP connect", e),
            None => Error::NotConnected,
        })
    }

    /// How the attempt fails when its deadline passes.
    pub(crate) fn expired(&self) -> Failed {
        let total = self.opts.timeout;
        if self.phase == Phase::Connecting {
            Failed::Unreachable(Error::Timeout(total))
        } else {
            //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
            // (paraphrase) An initiator that receives no Reply in time closes the
            // connection.
            Failed::Mpa(MpaError::Timeout(total).into())
        }
    }

    /// Advances the attempt as far as its socket allows (edge-triggered: until the socket
    /// would block).
    pub(crate) fn step(&mut self) -> Step {
        let total = self.opts.timeout;
        let Some(stream) = self.stream.as_mut() else {
            return Step::Retry;
        };
        if self.phase == Phase::Connecting {
            match stream.take_error() {
                Ok(Some(e)) | Err(e) => {
                    self.last_err = Some(e);
                    return Step::Retry;
                }
                Ok(None) => {}
            }
            match stream.peer_addr() {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::NotConnected => return Step::Wait,
                Err(e) => {
                    self.last_err = Some(e);
                    return Step::Retry;
                }
            }
            let _ = stream.set_nodelay(true);
            self.phase = Phase::Writing;
        }
        if self.phase == Phase::Writing {
            match frame_io::write_some(stream, &self.bytes, &mut self.written) {
                Ok(true) => self.phase = Phase::Reading,
                Ok(false) => return Step::Wait,
                Err(e) => {
                    let error = map_io("write MPA Request", e, total);
                    return Step::Failed(Failed::Mpa(error));
                }
            }
        }
        match self.reader.fill(stream) {
            Ok(Progress::WouldBlock) => return Step::Wait,
            Ok(Progress::Complete) | Err(ReadError::Wire(_)) => {}
            Err(ReadError::Closed) => return Step::Failed(Failed::Mpa(MpaError::Closed.into())),
            Err(ReadError::Io(e)) => {
                let error = map_io("read MPA Reply", e, total);
                return Step::Failed(Failed::Mpa(error));
            }
        }
        let offer = self.opts.offer();
        match mpa::check_reply(&self.request, &offer, &self.limits, self.reader.bytes()) {
            Ok(neg) => Step::Connected(neg),
            Err(f) => {
                if let Some(t) = f.terminate_bytes(self.opts.terminate_layout) {
                    let mut written = 0;
                    // Best effort into an empty socket buffer; the connection closes next.
                    let _ = frame_io::write_some(stream, &t, &mut written);
                    tracing::debug!(code = ?f.terminate, "Terminate sent");
                }
                Step::Failed(match f.error {
                    mpa::NegotiationError::Rejected { private_data } => {
                        Failed::Rejected(private_data)
                    }
                    other => Failed::Mpa(other.into()),
                })
            }
        }
    }

    /// Establishes the QP on the negotiated socket (its registration with the caller's
    /// `epoll` ended): the QP enters RTS and the device's progress thread takes the socket;
    /// `observer` (the connection manager's) hears of its end. The QP holds its FPDUs for
    /// `hold` (see [`ConnectOptions::first_fpdu_delay`]).
    pub(crate) fn establish(
        self,
        neg: Negotiated,
        observer: Option<Arc<dyn ConnObserver>>,
        hold: Duration,
    ) -> Result<ConnectionInfo> {
        let Initiator {
            qp, opts, stream, ..
        } = self;
        let Some(stream) = stream else {
            qp.abandon_connect();
            return Err(Error::NotConnected);
        };
        qp.finish_connect(stream.into(), neg, &opts, observer, hold)
    }
}

/// Runs `a` to its end on the calling thread: the connection manager's steps on an `epoll`
/// instance of its own, bounded by the attempt's deadline.
pub(crate) fn initiate_blocking(mut a: Initiator) -> Result<ConnectionInfo> {
    const TOKEN: Token = Token(0);
    let mut poll = match Poll::new() {
        Ok(p) => p,
        Err(e) => {
            a.abandon();
            return Err(Error::io("epoll_create", e));
        }
    };
    let fail = |a: &Initiator, f: Failed| {
        a.abandon();
        Err(f.into_error())
    };
    match a.stream.as_mut() {
        Some(s) => {
            if let Err(e) =
                poll.registry()
                    .register(s, TOKEN, Interest::READABLE | Interest::WRITABLE)
            {
                a.abandon();
                return Err(Error::io("epoll_ctl", e));
            }
        }
        None => {
            if let Err(f) = a.next_address(poll.registry(), TOKEN) {
                return fail(&a, f);
            }
        }
    }
    let mut events = Events::with_capacity(4);
    loop {
        match a.step() {
            Step::Wait => {}
            Step::Retry => {
                if let Err(f) = a.next_address(poll.registry(), TOKEN) {
                    return fail(&a, f);
                }
                continue;
            }
            Step::Connected(neg) => {
                if let Some(s) = a.stream.as_mut() {
                    let _ = poll.registry().deregister(s);
                }
                // The first-FPDU hold-off (siw's Reply race): the QP holds its FPDUs for
                // it, as on the connection manager's path, and the call returns at once
                // (work posted meanwhile leaves when the hold ends).
                let hold = a.opts.first_fpdu_delay;
                return a.establish(neg, None, hold);
            }
            Step::Failed(f) => return fail(&a, f),
        }
        let left = a.deadline.remaining();
        if left.is_some_and(|l| l.is_zero()) {
            let f = a.expired();
            return fail(&a, f);
        }
        if let Err(e) = poll.poll(&mut events, left) {
            if e.kind() != io::ErrorKind::Interrupted {
                a.abandon();
                return Err(Error::io("epoll_wait", e));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Responder
// ---------------------------------------------------------------------------------------

/// A responder's accepted TCP connection, its MPA Request still being read.
pub(crate) struct Responder {
    pub(crate) opts: Arc<ConnectOptions>,
    pub(crate) stream: MioStream,
    reader: FrameReader,
    pub(crate) deadline: Deadline,
}

impl Responder {
    /// Starts reading the Request on `stream` (non-blocking), within `opts.timeout`.
    pub(crate) fn new(stream: MioStream, opts: Arc<ConnectOptions>) -> Self {
        let _ = stream.set_nodelay(true);
        Self {
            deadline: Deadline::after(opts.timeout),
            opts,
            stream,
            reader: FrameReader::new(),
        }
    }

    /// Reads what the Request still needs and screens it once complete: `None` while the
    /// socket has nothing more; the Request; or why the connection is refused (a reject
    /// Reply was sent first when the rules give the peer one).
    pub(crate) fn step(&mut self) -> Option<Result<PeerRequest>> {
        let read = match self.reader.fill(&mut self.stream) {
            Ok(Progress::WouldBlock) => return None,
            Ok(Progress::Complete) => Ok(self.reader.bytes()),
            Err(ReadError::Wire(w)) => Err(w),
            Err(ReadError::Closed) => return Some(Err(MpaError::Closed.into())),
            Err(ReadError::Io(e)) => {
                return Some(Err(map_io("read MPA Request", e, self.opts.timeout)))
            }
        };
        match mpa::screen_request(read, &self.opts.offer()) {
            Screened::Request(req) => Some(Ok(req)),
            Screened::Refuse { reply, error } => {
                if let Some(reply) = reply {
                    if let Ok(bytes) = reply.encode() {
                        let mut written = 0;
                        let _ = frame_io::write_some(&mut self.stream, &bytes, &mut written);
                    }
                }
                tracing::debug!(%error, "connection request refused");
                Some(Err(error.into()))
            }
        }
    }

    /// The error of a peer whose Request did not arrive in time: closed without an answer.
    pub(crate) fn expired(&self) -> Error {
        MpaError::Timeout(self.opts.timeout).into()
    }
}

/// The Reply accepting `req` into `qp` under `opts`, and what it settles. Fails (the
/// request stays answerable, the QP untouched) for settings that cannot work.
pub(crate) fn reply_for(
    qp: &QpShared,
    req: &PeerRequest,
    opts: &ConnectOptions,
) -> Result<(Vec<u8>, Negotiated)> {
    let limits = qp.local_params(opts)?;
    let (reply, neg) = mpa::accept(req, &opts.offer(), &limits)?;
    Ok((reply.encode()?, neg))
}

/// Sends the Reply `bytes` on `stream` and establishes `qp` (claimed with `begin_connect`)
/// on it, with `observer` (the connection manager's) told of its end.
pub(crate) fn send_reply(
    qp: &Arc<QpShared>,
    mut stream: TcpStream,
    bytes: &[u8],
    neg: Negotiated,
    opts: &ConnectOptions,
    observer: Option<Arc<dyn ConnObserver>>,
) -> Result<ConnectionInfo> {
    if let Err(e) = write_blocking(&mut stream, bytes, opts.timeout) {
        qp.abandon_connect();
        return Err(e);
    }
    qp.finish_connect(stream, neg, opts, observer, Duration::ZERO)
}

/// Sends a reject Reply for `req` (or an unreadable request) and closes the connection.
pub(crate) fn reject(
    stream: &mut TcpStream,
    req: Option<&PeerRequest>,
    opts: &ConnectOptions,
    private_data: &[u8],
    timeout: Duration,
) -> Result<()> {
    let reply = mpa::reject_reply(req, opts.revision, private_data);
    let r = reply
        .encode()
        .map_err(Error::from)
        .and_then(|b| write_blocking(stream, &b, timeout));
    let _ = stream.shutdown(std::net::Shutdown::Both);
    r
}

fn write_blocking(stream: &mut TcpStream, bytes: &[u8], timeout: Duration) -> Result<()> {
    stream
        .set_nonblocking(false)
        .map_err(|e| Error::io("clear O_NONBLOCK", e))?;
    stream
        .set_write_timeout(Some(timeout.max(Duration::from_millis(1))))
        .map_err(|e| Error::io("set socket timeout", e))?;
    stream
        .write_all(bytes)
        .map_err(|e| map_io("write MPA frame", e, timeout))
}

/// Claims `qp` (Idle) for the responder's side of a blocking helper, refusing settings
/// that cannot work (IRD/ORD beyond the QP, private data longer than a frame of
/// `opts.revision` carries) before a connection is taken.
pub(crate) fn claim_responder(qp: &QpShared, opts: &ConnectOptions) -> Result<()> {
    qp.local_params(opts)?;
    mpa::check_private_data(&opts.private_data, opts.revision)?;
    qp.begin_connect()
}

/// The responder's side on the calling thread, on an accepted TCP connection, with `qp`
/// already claimed (`begin_connect`): the connection manager's steps for the Request (on
/// an `epoll` instance of its own, within `opts.timeout`), then the Reply (or a reject,
/// for a Request `opts` cannot accept) and the establishment.
pub(crate) fn respond_blocking(
    qp: &Arc<QpShared>,
    stream: TcpStream,
    opts: &ConnectOptions,
) -> Result<ConnectionInfo> {
    match screen_blocking(stream, opts) {
        Ok((stream, req)) => answer_blocking(qp, stream, &req, opts),
        Err(e) => {
            qp.abandon_connect();
            Err(e)
        }
    }
}

/// The rest of the responder's side once `req` was read and screened on `stream`: the
/// Reply accepting it into `qp` (claimed) under `opts` and the establishment, or, for a
/// Request `opts` cannot accept, a reject; `qp` is given back (Idle) on any failure.
pub(crate) fn answer_blocking(
    qp: &Arc<QpShared>,
    mut stream: TcpStream,
    req: &PeerRequest,
    opts: &ConnectOptions,
) -> Result<ConnectionInfo> {
    match reply_for(qp, req, opts) {
        Ok((bytes, neg)) => send_reply(qp, stream, &bytes, neg, opts, None),
        Err(e) => {
            // As a dropped `ConnectRequest`: the peer hears a reject.
            let _ = reject(&mut stream, Some(req), opts, &[], opts.timeout);
            qp.abandon_connect();
            Err(e)
        }
    }
}

/// Reads and screens the Request on `stream` as the connection manager's listener does.
fn screen_blocking(stream: TcpStream, opts: &ConnectOptions) -> Result<(TcpStream, PeerRequest)> {
    const TOKEN: Token = Token(0);
    stream
        .set_nonblocking(true)
        .map_err(|e| Error::io("set O_NONBLOCK", e))?;
    let mut r = Responder::new(MioStream::from_std(stream), Arc::new(opts.clone()));
    let mut poll = Poll::new().map_err(|e| Error::io("epoll_create", e))?;
    poll.registry()
        .register(&mut r.stream, TOKEN, Interest::READABLE)
        .map_err(|e| Error::io("epoll_ctl", e))?;
    let mut events = Events::with_capacity(4);
    let req = loop {
        if let Some(done) = r.step() {
            break done?;
        }
        let left = r.deadline.remaining();
        if left.is_some_and(|l| l.is_zero()) {
            return Err(r.expired());
        }
        if let Err(e) = poll.poll(&mut events, left) {
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(Error::io("epoll_wait", e));
            }
        }
    };
    let _ = poll.registry().deregister(&mut r.stream);
    Ok((r.stream.into(), req))
}
