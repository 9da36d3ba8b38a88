//! [`PortReservation`]: a TCP port held before its listener listens, as rdma_cm's
//! `rdma_bind_addr` holds one (port 0 picks it then, and `rdma_get_src_port` says which),
//! and [`CmEventChannel::listen_reserved`], which listens on it.
//!
//! The reservation is a TCP socket bound to the address and not listening: the kernel
//! keeps its port from other binds (except by sockets that also set `SO_REUSEADDR`, which
//! both a reservation and a listener do, as `std::net::TcpListener` does, so that a server
//! restarts on its port while old connections are in TIME_WAIT; two reservations of one
//! port both bind and the second `listen` fails with `EADDRINUSE`). An IPv6 reservation
//! can be for IPv6 only (`IPV6_V6ONLY`, rdma_cm's `RDMA_OPTION_ID_AFONLY`), so that `[::]`
//! and `0.0.0.0` listen on the same port side by side.

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::Arc;

use mio::net::TcpListener as MioListener;
use socket2::{Domain, Protocol, Socket, Type};

use super::admission::ListenerState;
use super::channel::CmEventChannel;
use super::listener::{CmListener, ListenOptions};
use super::worker::Cmd;
use crate::error::{Error, Result};
use crate::runtime::sys;
use crate::sync::lock;

/// A bound TCP port, not listening yet.
#[derive(Debug)]
pub struct PortReservation {
    socket: Socket,
    local: SocketAddr,
}

impl PortReservation {
    /// Binds `addr` (port 0: the kernel picks a free port). `v6_only`: for an IPv6 address,
    /// `Some(true)` takes the port for IPv6 only, `Some(false)` for IPv4 too (the mapped
    /// addresses), `None` leaves the host's default (`net.ipv6.bindv6only`).
    pub fn bind(addr: SocketAddr, v6_only: Option<bool>) -> Result<Self> {
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| Error::io("socket", e))?;
        socket
            .set_reuse_address(true)
            .map_err(|e| Error::io("SO_REUSEADDR", e))?;
        if let (SocketAddr::V6(_), Some(only)) = (addr, v6_only) {
            socket
                .set_only_v6(only)
                .map_err(|e| Error::io("IPV6_V6ONLY", e))?;
        }
        socket
            .bind(&addr.into())
            .map_err(|e| Error::io("bind", e))?;
        let local = socket
            .local_addr()
            .map_err(|e| Error::io("getsockname", e))?
            .as_socket()
            .ok_or(Error::InvalidArgument("bound a socket that is not IP"))?;
        Ok(Self { socket, local })
    }

    /// The address and port it holds.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

impl CmEventChannel {
    /// [`CmEventChannel::listen`] on a port already held: the listener keeps the reserved
    /// address and port.
    #[track_caller]
    pub fn listen_reserved(
        &self,
        port: PortReservation,
        opts: &ListenOptions,
    ) -> Result<CmListener> {
        let PortReservation { socket, local } = port;
        sys::set_listen_backlog(socket.as_fd(), opts.backlog)
            .map_err(|e| Error::io("listen", e))?;
        socket
            .set_nonblocking(true)
            .map_err(|e| Error::io("set O_NONBLOCK", e))?;
        let std_listener: std::net::TcpListener = socket.into();
        let shared = self.shared();
        let id = super::event::ListenerId(shared.next_id());
        let state = Arc::new(ListenerState::new(id, local, opts.backlog));
        lock(&shared.listeners).push(Arc::downgrade(&state));
        shared.send(Cmd::Listen {
            state: Arc::clone(&state),
            listener: MioListener::from_std(std_listener),
            opts: Arc::new(opts.options.clone()),
        })?;
        tracing::debug!(listener = %id, local_addr = %local, backlog = opts.backlog, "listening");
        Ok(CmListener::new(state, Arc::clone(shared)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_zero_is_chosen_at_bind_and_held_until_listen() {
        let r = PortReservation::bind("127.0.0.1:0".parse().expect("addr"), None).expect("bind");
        let port = r.local_addr().port();
        assert_ne!(port, 0);
        // Held: a plain bind of the same port (no SO_REUSEADDR) is refused.
        let other = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
        let taken: SocketAddr = (std::net::Ipv4Addr::LOCALHOST, port).into();
        assert!(other.bind(&taken.into()).is_err());
        let ch = CmEventChannel::new().expect("channel");
        let l = ch
            .listen_reserved(r, &ListenOptions::default())
            .expect("listen");
        assert_eq!(l.local_addr().port(), port);
        assert!(std::net::TcpStream::connect(taken).is_ok());
    }

    #[test]
    fn an_ipv6_only_reservation_leaves_the_ipv4_port_free() {
        let Ok(v6) = PortReservation::bind("[::]:0".parse().expect("addr"), Some(true)) else {
            // A host without IPv6: nothing to check.
            return;
        };
        let port = v6.local_addr().port();
        let v4 = PortReservation::bind((std::net::Ipv4Addr::UNSPECIFIED, port).into(), None)
            .expect("IPv4 on the same port");
        let ch = CmEventChannel::new().expect("channel");
        let _l6 = ch
            .listen_reserved(v6, &ListenOptions::default())
            .expect("listen v6");
        let _l4 = ch
            .listen_reserved(v4, &ListenOptions::default())
            .expect("listen v4");
    }
}
