//! The connection manager, in the spirit of rdma-core's `rdma_cm`: listeners, connection
//! requests, active connects, and events about every connection on a pollable channel.
//!
//! | rdma_cm | Softwarp |
//! | --- | --- |
//! | `rdma_create_event_channel` | [`CmEventChannel::new`] (its fd: [`std::os::fd::AsRawFd`]) |
//! | `rdma_get_cm_event` / `rdma_ack_cm_event` | [`CmEventChannel::get_event`], [`CmEventChannel::try_get_event`] (events are owned values: nothing to ack) |
//! | `rdma_resolve_addr` | [`resolve`] (or any `ToSocketAddrs` given to connect) |
//! | `rdma_bind_addr` | [`PortReservation::bind`] (port 0 picks one at once) |
//! | `rdma_listen` (with backlog) | [`CmEventChannel::listen`] with [`ListenOptions`], or [`CmEventChannel::listen_reserved`] on a bound port |
//! | `RDMA_CM_EVENT_CONNECT_REQUEST` | [`CmEvent::ConnectRequest`] |
//! | `rdma_accept` / `rdma_reject` | [`ConnectRequest::accept`] / [`ConnectRequest::reject`] |
//! | `rdma_connect` (private data, `responder_resources`, `initiator_depth`) | [`CmEventChannel::connect`] with [`ConnectOptions`] (`private_data`, `ird`, `ord`) |
//! | `ESTABLISHED`, `REJECTED`, `UNREACHABLE`, `CONNECT_ERROR`, `DISCONNECTED`, `TIMEWAIT_EXIT` | the [`CmEvent`] variants of the same names |
//! | `rdma_disconnect` | [`CmId::disconnect`] (graceful), [`CmId::disconnect_after_peer`] (graceful, this side's FIN held for the peer's: [`CloseOrder`]) and [`CmId::abort`] (reset) |
//!
//! Blocking conveniences are built on the channel: [`CmEventChannel::connect_blocking`],
//! [`CmListener::get_request`], [`CmListener::accept`].
//!
//! Negotiation (MPA revision 1 and 2, CRC, markers, RFC 6581 IRD/ORD and peer-to-peer RTR)
//! follows RFC 5044 and RFC 6581 as the table in [`softwarp_engine::mpa`] says: the rules
//! are the engine's pure functions; [`ConnectOptions`] converts to the engine's offer in one
//! place and the engine's error maps to [`crate::Error`] in one place.
//!
//! The blocking helpers ([`crate::Listener::accept`], [`crate::QueuePair::connect`],
//! [`crate::QueuePair::connect_stream`] / [`crate::QueuePair::accept_stream`]) are thin
//! wrappers over the same path (module `attempt`): the same negotiation steps, deadlines
//! and errors, and the same establishment, so a responder gates its first FPDU the same
//! way on both (RFC 5044, or the RFC 6581 RTR). They run it on the calling thread instead
//! of the channel's, and report no events.
//!
//! The channel's thread does the socket work of connections still negotiating; established
//! connections belong to the device's progress thread, whose QP hook reports their end.
//!
//! The settings an operator gives through the environment (`SOFTWARP_CRC`, the close order,
//! connect retries, ...) are read in one place, [`config`], by the C libraries, the preload
//! library and any Rust program that wants them.
//!
//! # Settings, defaults, and Linux siw
//!
//! [`ConnectOptions`] holds every negotiation setting for both ends;
//! [`ConnectOptions::linux_siw`] gives siw's.
//!
//! | setting | Softwarp default | Linux siw (Debian 6.1) | notes |
//! | --- | --- | --- | --- |
//! | MPA revision | 2 (RFC 6581, IRD/ORD prefix, flag 0x10) | 2 | a responder answers with the lower revision; rev 1 carries no IRD/ORD (both ends keep their own, QP default 16/16; siw reports 0 and then refuses RDMA Reads) |
//! | CRC | [`CrcMode::Preferred`] (C = 1) | off (C = 0), on when the peer asks | used when either side asks; [`CrcMode::Required`] also refuses a Reply with C = 0, like siw's `mpa_crc_required` |
//! | markers | [`MarkerMode::Off`] (refused) | never; M = 1 is rejected | per direction: [`MarkerMode::Accept`] inserts them for a peer that asks, [`MarkerMode::Request`] asks |
//! | peer-to-peer (RFC 6581) | off; as responder every RTR type accepted | off; Write and Read accepted | initiator offers [`ConnectOptions::rtr_types`]; responder picks Write, then Read, then Send |
//! | IRD / ORD | the QP's `max_dest_rd_atomic` / `max_rd_atomic` (16/16) | from the application | [`ConnectOptions::ird`], [`ConnectOptions::ord`]; adjusted as RFC 6581 says |
//! | private data | up to 508 bytes (rev 2) or 512 (rev 1) each way | same limit | longer is refused with [`crate::MpaError::PrivateDataTooLong`] |
//! | first FPDU | a responder without peer-to-peer mode waits for the initiator's (RFC 5044) | sends at once | [`ConnectOptions::responder_waits_for_initiator`] |
//! | Terminate layout | RFC 5040 | siw's own | received Terminates are understood in either |
//! | timeout | 5 s for TCP connect and MPA exchange | | [`ConnectOptions::timeout`]; a listener's is the time a peer has to send its Request; `Duration::MAX`: no limit |
//! | listener bound | `backlog` (1024) connections negotiating or unanswered | | [`ListenOptions::backlog`]; beyond it peers wait in the kernel's accept queue ([`CmListener::stats`]) |

mod admission;
pub(crate) mod attempt;
mod channel;
pub mod config;
pub(crate) mod connect;
mod event;
pub(crate) mod frame_io;
pub(crate) mod handshake;
mod id;
mod listener;
mod request;
mod reserve;
mod worker;

pub use crate::verbs::qp::options::{
    ConnectOptions, ConnectionInfo, CrcMode, Keepalive, MarkerMode, Role, RtrTypes,
    DEFAULT_RNR_WAIT,
};
pub use admission::ListenerStats;
pub(crate) use admission::EVICT_AGE;
#[cfg(feature = "tokio")]
pub(crate) use channel::attempt_outcome;
pub use channel::{resolve, CmEventChannel};
pub use config::CloseOrder;
pub use event::{CmEvent, ConnId, DisconnectReason, ListenerId, MAX_QUEUED_REQUEST_ERRORS};
pub use id::{CmId, CmState};
pub use listener::{CmListener, ListenOptions};
pub use request::ConnectRequest;
pub use reserve::PortReservation;
