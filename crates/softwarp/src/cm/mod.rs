//! The connection manager, in the spirit of rdma-core's `rdma_cm`: listeners, connection
//! requests, active connects, and events about every connection on a pollable channel.
//!
//! | rdma_cm | Softwarp |
//! | --- | --- |
//! | `rdma_create_event_channel` | [`CmEventChannel::new`] (its fd: [`std::os::fd::AsRawFd`]) |
//! | `rdma_get_cm_event` / `rdma_ack_cm_event` | [`CmEventChannel::get_event`], [`CmEventChannel::try_get_event`] (events are owned values: nothing to ack) |
//! | `rdma_resolve_addr` | [`resolve`] (or any `ToSocketAddrs` given to connect) |
//! | `rdma_listen` (with backlog) | [`CmEventChannel::listen`] with [`ListenOptions`] |
//! | `RDMA_CM_EVENT_CONNECT_REQUEST` | [`CmEvent::ConnectRequest`] |
//! | `rdma_accept` / `rdma_reject` | [`ConnectRequest::accept`] / [`ConnectRequest::reject`] |
//! | `rdma_connect` (private data, `responder_resources`, `initiator_depth`) | [`CmEventChannel::connect`] with [`ConnectOptions`] (`private_data`, `ird`, `ord`) |
//! | `ESTABLISHED`, `REJECTED`, `UNREACHABLE`, `CONNECT_ERROR`, `DISCONNECTED`, `TIMEWAIT_EXIT` | the [`CmEvent`] variants of the same names |
//! | `rdma_disconnect` | [`CmId::disconnect`] (graceful) and [`CmId::abort`] (reset) |
//!
//! Blocking conveniences are built on the channel: [`CmEventChannel::connect_blocking`],
//! [`CmListener::get_request`], [`CmListener::accept`].
//!
//! Negotiation (MPA revision 1 and 2, CRC, markers, RFC 6581 IRD/ORD and peer-to-peer RTR)
//! follows RFC 5044 and RFC 6581 as the table in the `negotiate` module's docs says; its
//! rules are pure functions, shared with the minimal path ([`crate::Listener`],
//! [`crate::QueuePair::connect`]).
//!
//! The channel's thread does the socket work of connections still negotiating; established
//! connections belong to the device's progress thread, whose QP hook reports their end.

mod channel;
mod event;
pub(crate) mod frame_io;
mod id;
mod listener;
pub(crate) mod negotiate;
pub(crate) mod options;
mod request;

pub use channel::{resolve, CmEventChannel};
pub use event::{CmEvent, ConnId, DisconnectReason, ListenerId};
pub use id::{CmId, CmState};
pub use listener::{CmListener, ListenOptions};
pub use options::{ConnectOptions, ConnectionInfo, CrcMode, MarkerMode, Role, RtrTypes};
pub use request::ConnectRequest;
