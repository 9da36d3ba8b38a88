//! Softwarp: a user-space software iWARP RNIC with a verbs API, over real TCP.
//!
//! This crate is what applications link. It has two halves:
//!
//! - **Verbs** (names after libibverbs): [`Device`] → [`ProtectionDomain`] →
//!   [`MemoryRegion`], [`CompletionQueue`] (+ [`CompletionChannel`] for event mode),
//!   [`SharedReceiveQueue`], [`QueuePair`]; a per-device asynchronous event stream
//!   ([`Device::get_async_event`]). Every call returns a typed [`Error`].
//! - **Runtime**: one progress thread per device (epoll over the QPs' non-blocking TCP
//!   sockets), inline transmission on the posting thread, the connection manager ([`cm`]:
//!   [`CmEventChannel`], listeners, connection requests, events) and its blocking helpers
//!   ([`Listener`], [`QueuePair::connect`]: the same connection path on the calling thread,
//!   without events).
//!
//! Protocol decisions (RDMAP/DDP/MPA) are made by the sans-IO engine
//! (`softwarp-engine`); the runtime only moves bytes between sockets and the places the
//! engine names (zero copy: `readv` straight into the destination region, `writev` of the
//! gather list), and wakes threads. `unsafe` code is confined to the private `sys` module
//! (system calls on raw iovecs), [`ProtectionDomain::reg_mr_raw`], its one caller in
//! [`owned`] and the registration of an eventfd with tokio in `aio`.
//!
//! - **Owned buffers** ([`owned`]): `Vec<u8>`, `Box<[u8]>` and (feature `bytes`)
//!   `bytes::BytesMut` registered by value ([`ProtectionDomain::reg_owned`]), with slice
//!   views only where nobody else may write the bytes, and given back by
//!   [`OwnedMr::into_inner`] once released.
//! - **Async** (feature `tokio`, module `aio`): completions (`Device::create_async_cq`),
//!   completion channels, CM events (`CmEventChannel::connect_async`,
//!   `CmListener::accept_async`, `CmEventChannel::events`) and device events
//!   (`Device::next_async_event`) as futures and `futures_core::Stream`s over tokio's
//!   `AsyncFd`.
//!
//! # Tracing and RAS: nothing unless asked
//!
//! Opening a device starts its progress thread and nothing else: no RAS thread, no file, no
//! global `tracing` subscriber. Softwarp's records go through the `tracing` facade (targets
//! `softwarp::<component>`) to whatever subscriber the program installs, before or after
//! the first open; [`flight_recorder_layer`] adds the flight recorder to it. The RAS services
//! (control socket and host registry entry, error log, metrics endpoint, automatic dumps)
//! start when the program asks ([`Device::builder`]`().ras(..)`, [`enable_ras`]) or the
//! operator sets `SOFTWARP_RAS=on`; `SOFTWARP_RAS=off` keeps them off. `SOFTWARP_TRACE`
//! sets the initial levels at the first open either way.
//!
//! # Locks
//!
//! Every lock of the runtime, in the only order in which a thread may hold several: a
//! thread that holds a lock takes only locks further down the table. Nothing is held across
//! a system call that can block (reads and writes are non-blocking; `epoll_wait`,
//! condition-variable waits and sleeps happen with no lock held).
//!
//! | # | lock | taken by | held while taking |
//! | --- | --- | --- | --- |
//! | 1 | a CQ's QP list (`CqShared::qps`) | busy polls ([`CompletionQueue::set_busy_poll`]), QP creation | QP locks, only with `try_lock` (a busy QP is skipped) |
//! | 2 | a QP (`QpShared::inner`) | every verb on the QP, progress passes, busy polls, timer looks and busy-poll receive looks (`try_lock`) | 3, 4, 5, 6, 7 and the leaves |
//! | 3 | an SRQ (`SrqShared::srq`) | `post_srq_recv`, the receive commits of its QPs | 4 |
//! | 4 | the STag table (`DeviceShared::mrs`, a read-write lock) | `post_send` (read), receive commits that place, validate or invalidate (write, taken lazily by the first that needs it), `reg_mr` and deregistration (write) | nothing: a leaf |
//! | 5 | a CQ's queue (`CqShared::state`) | completions pushed, `poll`, `req_notify` | nothing (the channel is signalled after it is released) |
//! | 6 | a completion channel's fired list | CQ notification, `get_cq_event` | nothing |
//! | 7 | a CM identifier's state (`cm::id`) | the connection's observer (called under the QP lock), CM verbs | the CM event queue |
//! | - | leaves: the device's event queue, QP list and number spaces, the device's health (`recovery::Health`), the progress thread's command sender, the CM event queue, RAS state (addresses, `TCP_INFO` sampler, CQ list), object counts, the in-flight thread-slot pool (a thread's first entry, reports), the structure-marker damage history | | nothing |
//!
//! The in-flight count of a device (`Device::close`, `Device::quiesce`) is an atomic word,
//! not a lock: entry points add and subtract without waiting.
//!
//! The STag table being a leaf is what lets deregistration run from any thread, even one
//! that holds a QP (a drop inside a completion handler): [`MemoryRegion`]'s drop takes the
//! table alone, once. `tests/it/raw_peer.rs` stresses the order (two threads registering and
//! dropping regions while a peer's half-placed Write holds a deregistered one and a
//! connected pair moves data on the same device).
//!
//! ```no_run
//! use softwarp::*;
//! # fn main() -> Result<()> {
//! let dev = Device::open_default()?;
//! let pd = dev.alloc_pd()?;
//! let cq = dev.create_cq(256, None)?;
//! let qp = pd.create_qp(&QpInitAttr::new(&cq, &cq))?;
//! let mr = pd.reg_mr(4096, AccessFlags::LOCAL_WRITE)?;
//! mr.write_at(0, b"hello")?;
//! qp.connect("192.0.2.1:7174", &ConnectOptions::default())?;
//! qp.post_send(&SendWr {
//!     wr_id: 1,
//!     op: SendOp::Send { solicited: false, invalidate: None },
//!     payload: Payload::Sgl(SgList::single(mr.sge(0, 5)?)),
//!     signaled: true,
//!     fence: false,
//! })?;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    warn(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]
// `Instant + Duration` panics on a large duration: deadlines go through
// `softwarp_ras::deadline` (the workspace's clippy.toml exempts the primitive number types).
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

#[cfg(feature = "tokio")]
pub mod aio;
mod availability;
pub mod cm;
mod error;
pub mod identity;
mod instrument;
mod ras;
mod runtime;
pub mod sync;
mod verbs;

pub use availability::recovery;
pub use verbs::owned;

/// The RAS wiring every device gets at open: the crate root wires the layers, so that the
/// verbs objects reach `ras` only through these hooks.
pub(crate) static RAS_HOOKS: &dyn verbs::hooks::RasHooks = &ras::Wiring;

#[cfg(feature = "tokio")]
pub use aio::{AsyncCompletionChannel, AsyncCq, AsyncEvents, CmEvents};
pub use cm::connect::{Listener, LISTENER_BACKLOG};
pub use cm::handshake::StreamHandshake;
pub use cm::{
    CmEvent, CmEventChannel, CmId, CmListener, CmState, ConnId, ConnectOptions, ConnectRequest,
    ConnectionInfo, CrcMode, DisconnectReason, Keepalive, ListenOptions, ListenerId, ListenerStats,
    MarkerMode, Role, RtrTypes, DEFAULT_RNR_WAIT, MAX_QUEUED_REQUEST_ERRORS,
};
pub use error::{BlockingContext, Error, InflightReport, InsideThread, MpaError, Result};
pub use owned::{EditGuard, OwnedBuf, OwnedMr, OwnedRelease};
pub use recovery::{
    CqErrorReason, DeviceFault, DeviceState, FaultKind, QpErrorReason, RecoveryConfig,
    RecoveryOutcome, RecoveryReport,
};
pub use runtime::progress::ProgressStats;
pub use verbs::cq::{
    CompletionChannel, CompletionQueue, EMPTY_COMPLETION, IDLE_SLEEP, IDLE_SPIN_POLLS,
};
pub use verbs::device::{
    list_devices, Device, DeviceAttr, DeviceBuilder, Quiesced, DEVICE_NAME, FIRMWARE_VERSION,
};
pub use verbs::pd::{AccessFlags, MemoryRegion, MrRelease, ProtectionDomain};
pub use verbs::qp::{QpCap, QpInitAttr, QueuePair};
pub use verbs::srq::{SharedReceiveQueue, SrqInitAttr};

pub use softwarp_engine::cq::CqId;
pub use softwarp_engine::event::AsyncEvent;
pub use softwarp_engine::fault::{Cause, Fault};
pub use softwarp_engine::mr::{AccessError, PdId, Stag};
pub use softwarp_engine::qp::{QpState, RtrKind, TerminateLayout};
pub use softwarp_engine::srq::SrqId;
pub use softwarp_engine::stats::QpStats;
pub use softwarp_engine::wr::{
    Payload, PayloadRef, RecvWr, RecvWrRef, SendOp, SendWr, SendWrRef, SgList, Sge, WcOpcode,
    WcStatus, WorkCompletion, MAX_INLINE, MAX_SGE,
};
pub use softwarp_wire::mpa::frame::MpaRevision;

pub use softwarp_ras::service::RasService;
/// What the RAS services of the process run: control socket and host registry entry,
/// error log, metrics endpoint, Softwarp's own `tracing` subscriber (see
/// [`softwarp_ras::service`]). [`RasConfig::from_env`] is what the operator's environment
/// says.
pub use softwarp_ras::service::ServiceConfig as RasConfig;
/// The flight recorder as a `tracing_subscriber` layer for the application's subscriber.
pub use softwarp_ras::trace::recorder_layer as flight_recorder_layer;

/// Starts the process's RAS services with `config` (control socket and host registry entry,
/// error log, metrics endpoint, as `config` says), or returns the ones already running (the
/// first configuration wins). `None` when the operator set `SOFTWARP_RAS=off`.
///
/// Without this (or [`Device::builder`]`().ras(..)`, or `SOFTWARP_RAS=on`), Softwarp starts
/// no thread besides each device's progress thread, writes no file and installs no global
/// `tracing` subscriber: its records go through the `tracing` facade to the application's
/// subscriber, and reach the flight recorder when that subscriber has
/// [`flight_recorder_layer`].
pub fn enable_ras(config: &RasConfig) -> Option<&'static RasService> {
    instrument::enable(Some(config))
}

/// Installs Softwarp's own process-wide `tracing` subscriber: records within the trace
/// levels printed on stderr, and the flight recorder. For programs that have no subscriber
/// of their own (the `softwarp` CLI, the examples); `false` if the process has one already
/// (add [`flight_recorder_layer`] to it instead).
pub fn install_ras_subscriber() -> bool {
    softwarp_ras::trace::install_global().is_ok()
}
