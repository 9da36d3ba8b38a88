//! The MPA exchange of an iWARP-mode stream, advanced as its bytes arrive:
//! [`Handshake`]. The blocking constructors ([`crate::IwarpStream::from_connected`],
//! [`crate::IwarpStream::connect_iwarp`], the listener's accept) run it to its end on the
//! calling thread; an event loop (the preload library's `poll`/`epoll_wait` of a
//! non-blocking socket) advances it whenever the socket is ready and never waits inside.

use std::io;
use std::net::TcpStream;
use std::os::fd::BorrowedFd;
use std::time::Instant;

use softwarp::StreamHandshake;

use crate::conn::{io_err, Conn, Prepared};
use crate::options::IwarpOptions;
use crate::stream::IwarpStream;
use crate::Side;

/// An MPA exchange in progress on a TCP connection (connected, or a non-blocking connect
/// in progress on the initiator's side). The initiator sets the stream's QP and buffers up
/// first; the responder only once the peer's Request is in and acceptable, so a peer that
/// never finishes its Request costs its socket and a small frame reader, not 1 MiB of
/// registered buffers.
///
/// [`Handshake::advance`] reads what has arrived and writes what the socket takes, then
/// returns: `Ok(None)` while the peer's bytes are still to come. Wait for the socket
/// ([`Handshake::socket`]) to be writable while [`Handshake::wants_write`] says so,
/// readable otherwise, and call it again, at the latest at [`Handshake::deadline`]
/// ([`IwarpOptions::connect_timeout`] after the start), when it fails with `TimedOut`.
#[derive(Debug)]
pub struct Handshake {
    // Field order is drop order: the exchange lets go of the QP before the QP goes.
    mpa: StreamHandshake,
    prepared: Option<Prepared>,
    opts: IwarpOptions,
}

impl Handshake {
    /// Starts the exchange as `side` on `tcp` (made non-blocking).
    pub fn start(tcp: TcpStream, side: Side, opts: &IwarpOptions) -> io::Result<Self> {
        opts.check()?;
        let copts = Conn::connect_options(opts);
        let (mpa, prepared) = match side {
            Side::Initiator => {
                let prepared = Conn::prepare(opts)?;
                let mpa = prepared
                    .qp
                    .start_connect_stream(tcp, &copts)
                    .map_err(io_err)?;
                (mpa, Some(prepared))
            }
            Side::Responder => (
                StreamHandshake::start_accept(tcp, &copts).map_err(io_err)?,
                None,
            ),
        };
        Ok(Self {
            mpa,
            prepared,
            opts: opts.clone(),
        })
    }

    /// Advances the exchange without waiting: `Ok(None)` while it waits for the peer, the
    /// stream once it is established, or the error that ended it (the socket is then
    /// closed; `TimedOut` past the deadline; `ConnectionReset` for a peer that closed;
    /// `ConnectionRefused` for one that is not an iWARP-mode softwarp-sockets peer). After
    /// the end: `NotConnected`.
    pub fn advance(&mut self) -> io::Result<Option<IwarpStream>> {
        let mut info = self.mpa.advance().map_err(io_err)?;
        if info.is_none() && self.mpa.needs_qp() {
            // The responder's Request is in: now the stream's QP and buffers.
            let prepared = Conn::prepare(&self.opts)?;
            self.mpa.bind_qp(&prepared.qp).map_err(io_err)?;
            self.prepared = Some(prepared);
            info = self.mpa.advance().map_err(io_err)?;
        }
        let Some(info) = info else {
            return Ok(None);
        };
        let prepared = self
            .prepared
            .take()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotConnected))?;
        Ok(Some(IwarpStream::from_conn(prepared.finish(info)?)))
    }

    /// Runs the exchange to its end on the calling thread, waiting for the socket; `Ok(None)`
    /// when `limit` came first (the exchange goes on at the next call).
    pub fn wait(&mut self, limit: Option<Instant>) -> io::Result<Option<IwarpStream>> {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        loop {
            if let Some(s) = self.advance()? {
                return Ok(Some(s));
            }
            let now = Instant::now();
            let until = match (self.deadline(), limit) {
                (Some(d), Some(l)) => Some(d.min(l)),
                (d, l) => d.or(l),
            };
            if limit.is_some_and(|l| l <= now) {
                return Ok(None);
            }
            let Some(fd) = self.socket() else {
                return Err(io::ErrorKind::NotConnected.into());
            };
            let flags = if self.wants_write() {
                PollFlags::OUT
            } else {
                PollFlags::IN
            };
            let ts = until.and_then(|u| Timespec::try_from(u.saturating_duration_since(now)).ok());
            let mut set = [PollFd::new(&fd, flags)];
            match poll(&mut set, ts.as_ref()) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// True while the exchange waits for room to send (a TCP connect in progress, or the
    /// Request not all written); otherwise it waits for bytes to read.
    pub fn wants_write(&self) -> bool {
        self.mpa.wants_write()
    }

    /// When the exchange fails unless it finished (`None` after its end).
    pub fn deadline(&self) -> Option<Instant> {
        self.mpa.deadline()
    }

    /// The socket the exchange runs on (`None` after its end).
    pub fn socket(&self) -> Option<BorrowedFd<'_>> {
        self.mpa.socket()
    }
}
