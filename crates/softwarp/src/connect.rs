//! The minimal, blocking connection path: TCP connect/accept and the MPA Request/Reply
//! exchange (RFC 5044 section 7.1 with the RFC 6581 enhanced parameters) on the calling
//! thread, before a QP enters RTS.
//!
//! The exchange runs over a blocking socket with a deadline ([`ConnectOptions::timeout`]): a
//! peer that sends garbage is answered as the connection manager answers it (same rules, in
//! [`crate::cm`]'s negotiation core) and the call fails with a typed [`MpaError`]; one that
//! sends nothing cannot make the call hang. Frames are read exactly (header, then private
//! data), so FPDUs that follow the Reply stay in the socket for the QP.
//!
//! This path has no events and no disconnect notification, and a responder here sends as
//! soon as it is connected (it does not hold FPDUs back until the initiator's first one).
//! The connection manager ([`crate::CmEventChannel`]) is the full-featured way.

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use softwarp_ras::deadline::Deadline;

use crate::cm::frame_io::{FrameReader, Progress, ReadError};
use crate::cm::negotiate::{self, FrameOut, Local, Negotiated, Screened};
use crate::cm::options::{ConnectOptions, ConnectionInfo};
use crate::error::{Error, MpaError, Result};
use crate::qp::{Establish, QueuePair};
use crate::sys;

/// Time left before `deadline` (`None`: no limit), or the timeout error once it passed.
fn remaining(deadline: Deadline, total: Duration) -> Result<Option<Duration>> {
    match deadline.remaining() {
        Some(left) if left.is_zero() => Err(MpaError::Timeout(total).into()),
        left => Ok(left),
    }
}

pub(crate) fn map_io(op: &'static str, e: std::io::Error, total: Duration) -> Error {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            MpaError::Timeout(total).into()
        }
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => MpaError::Closed.into(),
        _ => Error::io(op, e),
    }
}

/// Reads one frame on a blocking socket before `deadline`.
fn read_frame(
    stream: &mut TcpStream,
    reader: &mut FrameReader,
    deadline: Deadline,
    total: Duration,
) -> Result<(), ReadError> {
    loop {
        let left = remaining(deadline, total)
            .map_err(|_| ReadError::Io(std::io::Error::from(std::io::ErrorKind::TimedOut)))?;
        stream.set_read_timeout(left).map_err(ReadError::Io)?;
        if reader.fill(stream)? == Progress::Complete {
            return Ok(());
        }
    }
}

fn read_error(e: ReadError, total: Duration) -> Error {
    match e {
        ReadError::Wire(w) => MpaError::BadFrame(w).into(),
        ReadError::Closed => MpaError::Closed.into(),
        ReadError::Io(io) => map_io("read MPA frame", io, total),
    }
}

fn write_bytes(
    stream: &mut TcpStream,
    bytes: &[u8],
    deadline: Deadline,
    total: Duration,
) -> Result<()> {
    stream
        .set_write_timeout(remaining(deadline, total)?)
        .map_err(|e| Error::io("set socket timeout", e))?;
    stream
        .write_all(bytes)
        .map_err(|e| map_io("write MPA frame", e, total))
}

fn write_frame(
    stream: &mut TcpStream,
    frame: &FrameOut,
    deadline: Deadline,
    total: Duration,
) -> Result<()> {
    write_bytes(stream, &frame.encode()?, deadline, total)
}

/// Initiator side: TCP connect, send the MPA Request, read and check the Reply.
pub(crate) fn initiate(
    addrs: &[SocketAddr],
    opts: &ConnectOptions,
    local: &Local,
) -> Result<(TcpStream, Negotiated)> {
    let request = negotiate::request(opts, local)?;
    let total = opts.timeout;
    let deadline = Deadline::after(total);
    let mut last_err = None;
    let mut stream = None;
    for a in addrs {
        // No deadline: the kernel's own SYN retries bound the attempt.
        let left = remaining(deadline, total)?.unwrap_or(Duration::MAX);
        match TcpStream::connect_timeout(a, left) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last_err = Some(e),
        }
    }
    let Some(stream) = stream else {
        return Err(match last_err {
            Some(e) if e.kind() == std::io::ErrorKind::TimedOut => MpaError::Timeout(total).into(),
            Some(e) => Error::io("TCP connect", e),
            None => Error::InvalidArgument("the address resolved to nothing"),
        });
    };
    initiate_on(stream, request, opts, local, deadline)
}

/// Initiator side on a connected TCP stream: send the MPA Request, read and check the Reply
/// before `deadline`.
pub(crate) fn initiate_on(
    mut stream: TcpStream,
    request: FrameOut,
    opts: &ConnectOptions,
    local: &Local,
    deadline: Deadline,
) -> Result<(TcpStream, Negotiated)> {
    let total = opts.timeout;
    stream
        .set_nonblocking(false)
        .map_err(|e| Error::io("clear O_NONBLOCK", e))?;
    stream
        .set_nodelay(true)
        .map_err(|e| Error::io("set TCP_NODELAY", e))?;
    write_frame(&mut stream, &request, deadline, total)?;

    let mut reader = FrameReader::new();
    match read_frame(&mut stream, &mut reader, deadline, total) {
        Ok(()) | Err(ReadError::Wire(_)) => {}
        Err(e) => return Err(read_error(e, total)),
    }
    match negotiate::check_reply(&request, opts, local, reader.bytes()) {
        Ok(neg) => {
            // The peer may not be listening for FPDUs yet (siw): see `first_fpdu_delay`.
            // Nothing of ours can be sent before this returns (the QP enters RTS afterwards).
            let hold = deadline.remaining().map_or(opts.first_fpdu_delay, |left| {
                opts.first_fpdu_delay.min(left)
            });
            if !hold.is_zero() {
                std::thread::sleep(hold);
            }
            Ok((stream, neg))
        }
        Err(f) => {
            if let Some(t) = f.terminate_bytes(opts.terminate_layout) {
                // Best effort: the connection is closed right after.
                let _ = write_bytes(&mut stream, &t, deadline, total);
            }
            Err(f.error)
        }
    }
}

/// Responder side: read and check the MPA Request on an accepted connection, send the
/// Reply (or a reject).
pub(crate) fn respond(
    mut stream: TcpStream,
    opts: &ConnectOptions,
    local: &Local,
) -> Result<(TcpStream, Negotiated)> {
    negotiate::check_private_data(&opts.private_data, opts.revision)?;
    let total = opts.timeout;
    let deadline = Deadline::after(total);
    stream
        .set_nonblocking(false)
        .map_err(|e| Error::io("clear O_NONBLOCK", e))?;
    stream
        .set_nodelay(true)
        .map_err(|e| Error::io("set TCP_NODELAY", e))?;
    let mut reader = FrameReader::new();
    let read = match read_frame(&mut stream, &mut reader, deadline, total) {
        Ok(()) => Ok(reader.bytes()),
        Err(ReadError::Wire(w)) => Err(w),
        Err(e) => return Err(read_error(e, total)),
    };
    let req = match negotiate::screen_request(read, opts) {
        Screened::Request(r) => r,
        Screened::Refuse { reply, error } => {
            if let Some(reply) = reply {
                if let Err(e) = write_frame(&mut stream, &reply, deadline, total) {
                    tracing::debug!(error = %e, "could not send the MPA reject");
                }
            }
            return Err(error.into());
        }
    };
    let (reply, neg) = match negotiate::accept(&req, opts, local) {
        Ok(v) => v,
        Err(e) => {
            let rej = negotiate::reject_reply(Some(&req), opts.revision, &[]);
            let _ = write_frame(&mut stream, &rej, deadline, total);
            return Err(e);
        }
    };
    write_frame(&mut stream, &reply, deadline, total)?;
    Ok((stream, neg))
}

/// A TCP listener that accepts iWARP connections into QPs, one at a time, on the calling
/// thread (the minimal path; see [`crate::CmEventChannel::listen`] for the connection
/// manager's listener).
#[derive(Debug)]
pub struct Listener {
    inner: TcpListener,
    _ras: crate::ras::Tracked,
}

impl Listener {
    /// Listens on `addr` (port 0: any free port, see [`Listener::local_addr`]).
    #[track_caller]
    pub fn bind<A: ToSocketAddrs>(addr: A) -> Result<Self> {
        let inner = TcpListener::bind(addr).map_err(|e| Error::io("bind listener", e))?;
        inner
            .set_nonblocking(true)
            .map_err(|e| Error::io("set O_NONBLOCK", e))?;
        let _ras = crate::ras::listener(inner.local_addr().ok());
        Ok(Self { inner, _ras })
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.inner
            .local_addr()
            .map_err(|e| Error::io("getsockname", e))
    }

    /// Waits (without a time limit) for a connection, performs the MPA exchange as
    /// responder (bounded by [`ConnectOptions::timeout`]) and moves `qp` (Idle, receives
    /// posted) to RTS. On an MPA failure the connection is closed and `qp` stays Idle.
    pub fn accept(&self, qp: &QueuePair, opts: &ConnectOptions) -> Result<ConnectionInfo> {
        self.accept_inner(qp, opts, None)
    }

    /// As [`Listener::accept`], waiting at most `timeout` for the TCP connection.
    pub fn accept_timeout(
        &self,
        qp: &QueuePair,
        opts: &ConnectOptions,
        timeout: Duration,
    ) -> Result<ConnectionInfo> {
        self.accept_inner(qp, opts, Some(timeout))
    }

    fn accept_inner(
        &self,
        qp: &QueuePair,
        opts: &ConnectOptions,
        timeout: Option<Duration>,
    ) -> Result<ConnectionInfo> {
        crate::context::check_blocking("Listener::accept")?;
        let shared: &Arc<_> = qp.shared();
        let local = shared.local_params(opts)?;
        shared.begin_connect()?;
        let est = Establish::blocking(opts);
        let stream = match self.wait_accept(timeout) {
            Ok(s) => s,
            Err(e) => return shared.finish_connect(Err(e), est),
        };
        let result = respond(stream, opts, &local);
        shared.finish_connect(result, est)
    }

    fn wait_accept(&self, timeout: Option<Duration>) -> Result<TcpStream> {
        let deadline = Deadline::from_timeout(timeout);
        loop {
            match self.inner.accept() {
                Ok((s, peer)) => {
                    tracing::debug!(%peer, "TCP connection accepted");
                    return Ok(s);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("accept", e)),
            }
            let left = deadline.remaining();
            if left.is_some_and(|l| l.is_zero()) {
                return Err(Error::Timeout(timeout.unwrap_or_default()));
            }
            sys::poll_readable(self.inner.as_fd(), left)
                .map_err(|e| Error::io("poll on listener", e))?;
        }
    }
}
