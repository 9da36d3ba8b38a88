//! The error type of every verbs call and of connection establishment.
//!
//! Errors say what was wrong: local misuse of the API (a bad argument, a call in the wrong
//! QP state, a full queue), a peer that is incompatible or misbehaves during MPA negotiation
//! (rejected, bad frame, timeout), or the operating system refusing something (with the
//! operation that failed and the `io::Error`).
//!
//! The types the errors carry are here too (a device's fault, a QP's or CQ's error reason,
//! the context of a refused blocking call, the threads a close waited for), so that this
//! module uses nothing else of the crate; the modules that produce them re-export them
//! (`recovery`, `context`, `inflight`).

use std::fmt;
use std::io;
use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use softwarp_engine::fault::Cause;
use softwarp_engine::memory::MemoryError;
use softwarp_engine::mpa::NegotiationError;
use softwarp_engine::mr::MrError;
use softwarp_engine::qp::QpError;
use softwarp_engine::srq::SrqError;
use softwarp_ras::health::DeviceState;
use softwarp_wire::WireError;
use thiserror::Error;

/// What a Softwarp call can fail with.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// No device has this name ([`crate::list_devices`] names the ones there are).
    #[error("no device named {0:?} (see softwarp::list_devices())")]
    DeviceNotFound(String),
    /// An argument is out of range or inconsistent; the text says which and why.
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// A limit of the device (see [`crate::DeviceAttr`]) would be exceeded.
    #[error("{what}: requested {requested}, the device limit is {limit}")]
    Limit {
        /// What was requested.
        what: &'static str,
        /// How much.
        requested: usize,
        /// The device's limit.
        limit: usize,
    },
    /// Objects from different devices or protection domains were combined.
    #[error("{0} belongs to another device or protection domain")]
    WrongOwner(&'static str),
    /// The engine refused a QP operation (state, queue full, malformed work request ...).
    #[error("queue pair: {0}")]
    Qp(#[from] QpError),
    /// The memory registration table refused (full, unknown STag, in use ...).
    #[error("memory registration: {0}")]
    Mr(#[from] MrError),
    /// A region access or allocation failed (out of bounds, out of memory).
    #[error("memory: {0}")]
    Memory(#[from] MemoryError),
    /// The shared receive queue refused a post.
    #[error("shared receive queue: {0}")]
    Srq(#[from] SrqError),
    /// The completion queue overflowed earlier and is in error; it accepts no more work.
    #[error("completion queue is in error after an overflow (capacity {capacity})")]
    CqOverflowed {
        /// The CQ's capacity.
        capacity: usize,
    },
    /// The QP is already connected (or connecting).
    #[error("the queue pair is already connected")]
    AlreadyConnected,
    /// The QP is not in the Idle state needed to connect or accept.
    #[error("the queue pair must be Idle to connect or accept, it is {0}")]
    NotIdle(&'static str),
    /// A system call failed.
    #[error("{op}: {source}")]
    Io {
        /// What the runtime was doing.
        op: &'static str,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// MPA connection establishment failed; the connection was closed.
    #[error("MPA negotiation failed: {0}")]
    Mpa(#[from] MpaError),
    /// A blocking wait ended without the awaited event.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// The device's progress thread is gone (the device failed or is shutting down).
    #[error("the device's progress thread has stopped")]
    DeviceStopped,
    /// The QP has no connection (never connected, or already closed).
    #[error("the queue pair is not connected")]
    NotConnected,
    /// The connection manager's event channel is shut down (its handle was dropped).
    #[error("the connection manager's event channel is closed")]
    ChannelClosed,
    /// A connection request was already accepted or rejected.
    #[error("the connection request was already answered")]
    AlreadyAnswered,
    /// The device has failed (or is recovering): nothing can be created on it, and its QPs
    /// cannot connect, until it recovers (`Device::state`, `Device::recover`). Nothing
    /// touched the network.
    #[error("device {device} is {}: {fault}", state.as_str())]
    DeviceFailed {
        /// The device instance.
        device: String,
        /// Failed or recovering.
        state: DeviceState,
        /// What happened.
        fault: Box<DeviceFault>,
    },
    /// The QP is in Error for this reason (`QueuePair::error_reason`); destroy it (or reset
    /// it, once its device is operational) and connect again. Nothing touched the network.
    #[error("queue pair {qpn} is in Error: {reason}")]
    QpFailed {
        /// The QP.
        qpn: u32,
        /// Why.
        reason: QpErrorReason,
    },
    /// Work requests still use a registered buffer (posted and not completed): wait for
    /// their completions, then try again.
    #[error("{users} in-flight work request(s) still use the buffer")]
    InUse {
        /// How many in-flight operations hold the registration's memory.
        users: usize,
    },
    /// A blocking call was made where it would deadlock (see [`BlockingContext`]): make it
    /// from one of the application's own threads, outside Softwarp's callbacks.
    #[error("{call} would deadlock here: it was called on {context}; make blocking calls from the application's own threads")]
    WouldDeadlock {
        /// The blocking call, e.g. `CompletionChannel::get_cq_event`.
        call: &'static str,
        /// Where it was called.
        context: BlockingContext,
    },
    /// The device was closed ([`crate::Device::close`]): nothing new is accepted (polls
    /// still return the completions the close flushed).
    #[error("the device is closed")]
    DeviceClosed,
    /// The device is quiesced ([`crate::Device::quiesce`], e.g. during a recovery): try
    /// again when it ends.
    #[error("the device is quiesced (recovery in progress)")]
    DeviceQuiesced,
    /// Threads were still inside the device's entry points when a close or quiesce ran out
    /// of time; the report names them. (A close still closed the device.)
    #[error("{0}")]
    StillInside(InflightReport),
    /// A structure marker of an object was found damaged (memory written over by foreign
    /// code or a hardware fault): the device failed (every QP in Error, a `DeviceFatal`
    /// event, a dump); the object must not be used.
    #[error("structure marker {marker:?} of {object} {id} is damaged: the device failed")]
    MarkerDamaged {
        /// The kind of object (`qp`, `cq`, `mr`, `device`).
        object: &'static str,
        /// Its number (QP number, CQ id, STag; 0 for the device).
        id: u64,
        /// The damaged word (`begin`, `end`, `sq.lo` ...).
        marker: String,
    },
}

impl Error {
    pub(crate) fn io(op: &'static str, source: io::Error) -> Self {
        Error::Io { op, source }
    }
}

/// Why MPA negotiation (RFC 5044 section 7.1, RFC 6581) failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MpaError {
    /// The peer's frame could not be parsed (bad key, revision, private data length ...).
    #[error("bad MPA frame from the peer: {0}")]
    BadFrame(#[from] WireError),
    /// The peer sent the other kind of frame (a Reply where a Request belongs, or vice versa).
    #[error("expected an MPA {expected}, got the other kind of frame")]
    WrongFrameKind {
        /// "Request" or "Reply".
        expected: &'static str,
    },
    /// The responder set the Reject flag; its private data is kept.
    #[error("the peer rejected the connection ({} bytes of private data)", private_data.len())]
    Rejected {
        /// The private data of the reject Reply.
        private_data: Vec<u8>,
    },
    /// The peer asks for MPA markers in what this side sends, and the local settings refuse
    /// them ([`crate::MarkerMode::Off`], like siw); a Request is answered with a reject.
    #[error("the peer requires MPA markers, which the local settings refuse (MarkerMode::Off)")]
    MarkersRequired,
    /// The peer offered a revision the local options do not allow.
    #[error("the peer uses MPA revision {peer}, the local options require {local}")]
    RevisionMismatch {
        /// The peer's revision.
        peer: u8,
        /// The local one.
        local: u8,
    },
    /// The peer asks for peer-to-peer mode (an RTR exchange), which this minimal connection
    /// path does not offer.
    #[error("the peer requires peer-to-peer mode (RFC 6581 RTR), not offered here")]
    PeerToPeerRequired,
    /// The peer closed the connection during negotiation.
    #[error("the peer closed the connection during MPA negotiation")]
    Closed,
    /// The negotiation did not finish in time.
    #[error("MPA negotiation did not finish within {0:?}")]
    Timeout(Duration),
    /// A connection manager listener closed this connection, whose MPA Request was still
    /// incomplete after the given time, to make room for a newer connection: it held its
    /// backlog of connections and another one was waiting (see
    /// [`crate::ListenOptions::backlog`]).
    #[error(
        "closed to make room for a newer connection: no complete MPA Request after {0:?} \
         while the listener was full"
    )]
    Evicted(Duration),
    /// Local private data longer than a frame can carry.
    #[error("private data of {len} bytes exceeds the limit of {max}")]
    PrivateDataTooLong {
        /// Length given.
        len: usize,
        /// Most allowed.
        max: usize,
    },
    /// CRC was required ([`crate::CrcMode::Required`]) and the peer's Reply did not confirm
    /// it (C = 0).
    #[error("CRC is required here and the peer's MPA Reply did not confirm it (C = 0)")]
    CrcNotConfirmed,
    /// The responder's ORD exceeds the IRD this QP can support (RFC 6581): a Terminate
    /// "insufficient IRD resources" was sent.
    #[error("the peer's ORD {peer_ord} exceeds this QP's largest IRD {max_ird}")]
    InsufficientIrd {
        /// The responder's ORD.
        peer_ord: u16,
        /// The QP's IRD capacity (`max_dest_rd_atomic`).
        max_ird: usize,
    },
    /// Peer-to-peer mode was offered and the responder chose none of the RTR types offered
    /// (or answered without RFC 6581 parameters): a Terminate "no matching RTR option" was
    /// sent.
    #[error("the peer chose no RTR type this side offered (RFC 6581 peer-to-peer mode)")]
    NoMatchingRtr,
    /// The connection attempt was cancelled locally before it was established.
    #[error("the connection attempt was cancelled")]
    Cancelled,
}

/// The engine's negotiation errors, mapped once: the peer's part of the exchange is an
/// [`MpaError`] of the same name, local settings that cannot work are an invalid argument or
/// a limit.
impl From<NegotiationError> for Error {
    fn from(e: NegotiationError) -> Self {
        use NegotiationError as N;
        match e {
            N::BadFrame(w) => MpaError::BadFrame(w).into(),
            N::WrongFrameKind { expected } => MpaError::WrongFrameKind { expected }.into(),
            N::Rejected { private_data } => MpaError::Rejected { private_data }.into(),
            N::MarkersRequired => MpaError::MarkersRequired.into(),
            N::RevisionMismatch { peer, local } => {
                MpaError::RevisionMismatch { peer, local }.into()
            }
            N::PrivateDataTooLong { len, max } => MpaError::PrivateDataTooLong { len, max }.into(),
            N::CrcNotConfirmed => MpaError::CrcNotConfirmed.into(),
            N::InsufficientIrd { peer_ord, max_ird } => {
                MpaError::InsufficientIrd { peer_ord, max_ird }.into()
            }
            N::NoMatchingRtr => MpaError::NoMatchingRtr.into(),
            N::Limit {
                what,
                requested,
                limit,
            } => Error::Limit {
                what,
                requested,
                limit,
            },
            N::InvalidOffer(why) => Error::InvalidArgument(why),
            N::Encode { .. } => Error::InvalidArgument("an MPA frame or Terminate does not encode"),
            // `NegotiationError` is non-exhaustive: a variant this runtime does not know yet.
            _ => Error::InvalidArgument("MPA negotiation failed"),
        }
    }
}

/// Result with [`enum@Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What made a device fail.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FaultKind {
    /// Injected: `Device::inject_fatal_error`, `Device::inject_fault` or `softwarp fault
    /// inject`.
    Injected,
    /// The device's network interface went down (administratively or lost its carrier).
    InterfaceDown {
        /// The interface.
        interface: String,
    },
    /// The device's network interface disappeared.
    InterfaceRemoved {
        /// The interface.
        interface: String,
    },
    /// The last address of the device's network interface was removed.
    AddressRemoved {
        /// The interface.
        interface: String,
        /// The address.
        addr: IpAddr,
    },
    /// A structure marker of the device or of one of its objects was found damaged
    /// (`Error::MarkerDamaged`). No automatic recovery follows: the damaged words stay
    /// damaged, and every call that checks them fails again.
    MarkerDamaged {
        /// What was found, e.g. `structure marker damaged: QP 3 begin=... (QueuePair::post_send)`.
        what: String,
    },
}

impl FaultKind {
    /// The kind's name (`fault-status`, the error log): `injected`, `interface_down`,
    /// `interface_removed`, `address_removed`.
    pub fn as_str(&self) -> &'static str {
        match self {
            FaultKind::Injected => "injected",
            FaultKind::InterfaceDown { .. } => "interface_down",
            FaultKind::InterfaceRemoved { .. } => "interface_removed",
            FaultKind::AddressRemoved { .. } => "address_removed",
            FaultKind::MarkerDamaged { .. } => "marker_damaged",
        }
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FaultKind::Injected => f.write_str("fault injected"),
            FaultKind::InterfaceDown { interface } => write!(f, "interface {interface} went down"),
            FaultKind::InterfaceRemoved { interface } => {
                write!(f, "interface {interface} disappeared")
            }
            FaultKind::AddressRemoved { interface, addr } => {
                write!(
                    f,
                    "address {addr} of interface {interface} was removed (none left)"
                )
            }
            FaultKind::MarkerDamaged { what } => f.write_str(what),
        }
    }
}

/// A device's fault: what, when, and its number on the device.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceFault {
    /// The device instance (`softwarp0/1`).
    pub device: String,
    /// What happened.
    pub kind: FaultKind,
    /// When.
    pub time: SystemTime,
    /// 1 for the device's first fault, 2 for the next ...
    pub generation: u64,
}

impl fmt::Display for DeviceFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device {} failed: {}", self.device, self.kind)
    }
}

/// Why a QP is in the Error state (`QueuePair::error_reason`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum QpErrorReason {
    /// Its device failed.
    DeviceFault(DeviceFault),
    /// The network under the connection went away (its local address was removed, its
    /// interface went down or disappeared): the QP was terminated at once.
    NetworkGone {
        /// What went away.
        detail: String,
    },
    /// The peer stopped answering: the kernel dropped the connection after TCP keepalive
    /// probes ([`crate::ConnectOptions::tcp_keepalive`]), or data sent
    /// ([`crate::ConnectOptions::tcp_user_timeout`]), went unanswered past their bound.
    PeerUnreachable {
        /// The error the socket gave, and what it means.
        detail: String,
    },
    /// The protocol the QP carries above RDMAP (the extended sockets' stream) found the
    /// peer breaking it ([`crate::QueuePair::fail_peer_violation`]).
    PeerViolation {
        /// What the peer did.
        detail: String,
    },
    /// The engine's cause: a Terminate sent or received, the connection closed, the
    /// application moved the QP to Error, a work request failed locally.
    Cause(Cause),
}

impl fmt::Display for QpErrorReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QpErrorReason::DeviceFault(d) => d.fmt(f),
            QpErrorReason::NetworkGone { detail } => {
                write!(f, "unexpected close: {detail}")
            }
            QpErrorReason::PeerUnreachable { detail } => f.write_str(detail),
            QpErrorReason::PeerViolation { detail } => {
                write!(f, "the peer broke the protocol above RDMAP: {detail}")
            }
            QpErrorReason::Cause(Cause::PeerTerminate { layer, etype, code }) => write!(
                f,
                "the peer sent a Terminate (layer {layer}, error type {etype}, code {code:#04x})"
            ),
            QpErrorReason::Cause(Cause::Detected(fault)) => {
                write!(
                    f,
                    "{fault:?} detected in the peer's stream; a Terminate was sent"
                )
            }
            QpErrorReason::Cause(Cause::LlpClosed) => {
                f.write_str("the TCP connection closed or failed")
            }
            QpErrorReason::Cause(Cause::Application) => {
                f.write_str("the application moved the QP to Error")
            }
            QpErrorReason::Cause(Cause::LocalOperation) => {
                f.write_str("a work request failed local validation")
            }
            QpErrorReason::Cause(other) => write!(f, "{other:?}"),
        }
    }
}

/// Why a CQ is in error (`CompletionQueue::error_reason`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CqErrorReason {
    /// It overflowed (more completions than its capacity); its QPs went to Error.
    Overflow {
        /// Its capacity.
        capacity: usize,
    },
    /// Its device failed.
    DeviceFault(DeviceFault),
}

impl fmt::Display for CqErrorReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CqErrorReason::Overflow { capacity } => {
                write!(f, "the CQ overflowed (capacity {capacity})")
            }
            CqErrorReason::DeviceFault(d) => d.fmt(f),
        }
    }
}

/// Where a blocking call was made that would deadlock there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BlockingContext {
    /// A device's progress thread (a `tracing` callback or a drop running on it).
    ProgressThread,
    /// A connection manager event channel's thread (a `tracing` callback or a drop
    /// running on it).
    CmThread,
    /// Inside a Softwarp call on the same thread (a callback it made), named.
    InsideCall(&'static str),
}

impl fmt::Display for BlockingContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlockingContext::ProgressThread => f.write_str(
                "a device's progress thread (a tracing callback or a drop running on it), \
                 which moves the data and events every wait depends on",
            ),
            BlockingContext::CmThread => f.write_str(
                "a connection manager event channel's thread (a tracing callback or a drop \
                 running on it), which makes the events the wait depends on",
            ),
            BlockingContext::InsideCall(call) => write!(
                f,
                "inside {call} on the same thread (a callback it made, with its locks held)"
            ),
        }
    }
}

/// Threads still inside a device's entry points when a close or quiesce ran out of time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InflightReport {
    /// The device (open instance, e.g. `softwarp0/2`).
    pub device: String,
    /// How long the caller waited.
    pub waited: Duration,
    /// How many threads were counted inside.
    pub inside: u64,
    /// The threads that could be named (a thread inside another device's entry point
    /// nested in this one's, or one without a slot, is counted but not listed).
    pub threads: Vec<InsideThread>,
}

/// One thread inside an entry point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InsideThread {
    /// The thread's name (`<unnamed>` without one).
    pub thread: String,
    /// Its kernel thread id.
    pub tid: u32,
    /// The entry point, e.g. `QueuePair::post_send`.
    pub entry: &'static str,
}

impl fmt::Display for InflightReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} thread(s) still inside entry points of {} after {:?}",
            self.inside, self.device, self.waited
        )?;
        for (i, t) in self.threads.iter().enumerate() {
            let sep = if i == 0 { ": " } else { ", " };
            write!(f, "{sep}{} (tid {}) in {}", t.thread, t.tid, t.entry)?;
        }
        let unnamed = self.inside.saturating_sub(self.threads.len() as u64);
        if unnamed > 0 {
            write!(f, " ({unnamed} not identified)")?;
        }
        Ok(())
    }
}

impl std::error::Error for InflightReport {}
