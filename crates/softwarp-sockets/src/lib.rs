//! Extended sockets over Softwarp: streams shaped like [`std::net::TcpStream`] and
//! [`std::net::TcpListener`] that behave as plain TCP until switched into iWARP mode, after
//! which their bytes travel as iWARP Sends over a queue pair (RDMAP/DDP/MPA on the same TCP
//! port), with one-sided extensions in the style of rsocket's `riomap`/`riowrite`.
//!
//! - [`Socket`]: a TCP socket before `connect`/`listen`, where iWARP mode is switched on
//!   ([`Socket::set_iwarp_mode`], or [`Socket::set_option`] with [`SOL_SOFTWARP`] /
//!   [`SO_IWARP_MODE`], the numbers of this crate's `include/softwarp_sockets.h`).
//! - [`IwarpStream`]: `Read`/`Write` (also on `&IwarpStream`), `shutdown`, non-blocking mode,
//!   timeouts, `AsRawFd`, addresses; [`IwarpStream::connect_iwarp`],
//!   [`IwarpStream::handover`] (adopt an established `TcpStream` when both ends agree).
//! - [`IwarpListener`]: `bind`, `accept`, `incoming`; [`IwarpListener::bind_iwarp`].
//! - With the `tokio` feature, `AsyncIwarpStream`: `AsyncRead`/`AsyncWrite` over an iWARP
//!   stream, woken by the connection's completion channel through tokio's `AsyncFd`.
//! - One-sided: [`IwarpStream::expose`] → [`Window`] (zero-copy receive),
//!   [`IwarpStream::write_remote`], [`IwarpStream::read_remote`],
//!   [`IwarpStream::write_remote_notify`] / [`IwarpStream::recv_write_notice`].
//!
//! # The protocol in iWARP mode
//!
//! Both ends are softwarp-sockets ends: the MPA private data carries a hello (receive slots
//! and their size, [`wire`]), every Send an 8-byte header. Flow control is by credits
//! ([`credits`]): a sender holds one credit per receive slot the peer posted; the receiver
//! returns slots when the application has read them, in the header of its next message or in
//! a small grant message. Stream semantics: partial reads, bytes never lost or reordered
//! (Sends are delivered in order), EOF after `shutdown(Write)` or close, errors after a reset.
//! Every message of the peer is checked against this end's state (the credits it gave, the
//! windows it exposed) and every queue the peer fills is bounded; a peer that breaks a rule
//! aborts the stream with a [`PeerViolation`] ([`violation`]).
//!
//! Memory per connection: `(recv_slots + send_slots) * slot_size` registered bytes, 1 MiB
//! by default ([`IwarpOptions`]). Copies: one on send (into a registered send slot), none
//! from the socket into the receive slot (the runtime reads straight into it), one on read;
//! none at all for one-sided Writes into a [`Window`] at the receiving end.
//!
//! No thread of its own: a process-wide device's progress thread moves the bytes
//! ([`default_device`]), and calls on a stream poll its completion queues. So a receiving
//! end returns credits (and drops bytes after `shutdown(Read)`) when its application calls
//! into the stream: `read`, `write`, [`IwarpStream::poll_ready`], or with the preload
//! library `poll`/`select`/`epoll_wait` on it. A program that stops calling while its
//! peer writes stalls the peer once the receive ring is full, as a full TCP window would.
#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    warn(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

#[cfg(feature = "tokio")]
mod aio;
mod conn;
pub mod credits;
mod handshake;
mod options;
mod stream;
pub mod violation;
pub mod wire;

pub use handshake::Handshake;
pub use options::{
    default_device, forget_default_device_after_fork, IwarpOptions, SOL_SOFTWARP, SO_IWARP_ACTIVE,
    SO_IWARP_MODE,
};
pub use stream::{IwarpListener, IwarpStream, Readiness, Side, Socket, StreamWaiter, Window};
pub use violation::{peer_violations, PeerViolation};

#[cfg(feature = "tokio")]
pub use aio::AsyncIwarpStream;
