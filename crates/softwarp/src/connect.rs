//! The blocking listener: [`Listener`] accepts TCP connections on the calling thread and
//! runs the responder's side of the connection manager's path on each
//! ([`crate::cm`]'s `attempt` module): the same MPA screening and Reply, the same errors and
//! deadline ([`ConnectOptions::timeout`]), and the same establishment, so the QP holds its
//! first FPDU until the initiator's first one arrives (RFC 5044), or its RTR (RFC 6581),
//! as [`ConnectOptions::responder_waits_for_initiator`] says. Its initiator twin is
//! [`QueuePair::connect`].
//!
//! This path reports no events and no disconnect notification; the connection manager
//! ([`crate::CmEventChannel`]) is the full-featured way.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use softwarp_ras::deadline::Deadline;

use crate::cm::attempt;
use crate::cm::options::{ConnectOptions, ConnectionInfo};
use crate::error::{Error, Result};
use crate::qp::QueuePair;
use crate::sys;

/// A TCP listener that accepts iWARP connections into QPs, one at a time, on the calling
/// thread: the connection manager's responder path without a channel or events (see
/// [`crate::CmEventChannel::listen`] for the connection manager's listener, which serves
/// many peers at once).
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
    /// posted) to RTS. As on the connection manager's path, the QP then sends nothing
    /// before the initiator's first FPDU (or, in peer-to-peer mode, its RTR) arrived, unless
    /// [`ConnectOptions::responder_waits_for_initiator`] is off: work posted meanwhile
    /// waits in the QP. On an MPA failure the connection is closed (a Request that `opts`
    /// cannot accept is answered with a reject) and `qp` stays Idle.
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
        attempt::claim_responder(shared, opts)?;
        let stream = match self.wait_accept(timeout) {
            Ok(s) => s,
            Err(e) => {
                shared.abandon_connect();
                return Err(e);
            }
        };
        attempt::respond_blocking(shared, stream, opts)
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
