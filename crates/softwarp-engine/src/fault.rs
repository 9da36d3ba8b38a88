//! What went wrong on a stream: the errors the engine detects ([`Fault`]) and the cause
//! reported with an asynchronous event ([`Cause`]).
//!
//! Each fault maps to exactly one Terminate (layer, error type, error code, and which
//! headers it carries; see `qp::terminate`), to the completion status of the work request it
//! breaks, and to the kind of asynchronous event. No I/O here.

use crate::mr::AccessError;

/// An error the engine detected on the stream, named after the RFC 5040/5041/5044 Terminate
/// error it produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    // --- LLP (MPA, RFC 5044) ---
    /// The FPDU's CRC did not match.
    Crc,
    /// An FPDU's ULPDU_Length is too short for any DDP header or longer than we accept.
    BadUlpduLength,
    /// An MPA marker's FPDUPTR does not point back to the start of its FPDU (the marker and
    /// the ULPDU_Length fields disagree about where FPDUs are).
    BadMarker,

    // --- DDP (RFC 5041) ---
    /// The DDP version is not 1 (tagged tells which error type reports it).
    DdpVersion {
        /// The segment had the T flag.
        tagged: bool,
    },
    /// A tagged segment (RDMA Write, Read Response) failed validation.
    Tagged(AccessError),
    /// A Read Response arrived with no RDMA Read outstanding, or not for the expected sink.
    UnexpectedReadResponse,
    /// An untagged segment names a queue number RDMAP does not use.
    InvalidQn,
    /// A Send arrived and no receive WR was posted.
    NoReceiveBuffer,
    /// An untagged segment's MSN is not the expected one.
    MsnRange,
    /// An untagged segment's MO is not where the message continues (or is out of range).
    InvalidMo,
    /// A Send is longer than the receive WR's buffers.
    MessageTooLong,
    /// A local failure while placing (a receive SGE failed validation).
    DdpCatastrophic,

    // --- RDMAP (RFC 5040) ---
    /// The RDMAP version is not 1.
    RdmapVersion,
    /// The opcode is unknown, unsupported, or not valid with this buffer model/queue.
    UnexpectedOpcode,
    /// A Read Request's source failed validation.
    ReadSource(AccessError),
    /// A Send with Invalidate named an STag that may not be invalidated (the flag says
    /// whether it was for a protection reason, i.e. PD or right missing).
    CannotInvalidate {
        /// A protection error (remote invalidation not allowed, wrong PD) rather than an
        /// unknown STag.
        protection: bool,
    },
    /// More Read Requests (and Atomic Requests) arrived than the IRD allows.
    IrdExceeded,
    /// An RFC 7306 Atomic Request's target (Remote STag and Tagged Offset, 8 bytes) failed
    /// validation (remote atomic access is the right needed).
    AtomicTarget(AccessError),
    /// An RFC 7306 Atomic Request's Remote Tagged Offset is not 8-byte aligned.
    AtomicMisaligned,
    /// An RFC 7306 Atomic Response arrived with no Atomic Request outstanding at the head of
    /// the ORQ, or for another Request Identifier.
    UnexpectedAtomicResponse,
    /// A control message (RDMA Read Request, Terminate, RFC 7306 Immediate Data, Atomic
    /// Request or Atomic Response) whose ULPDU is not exactly its DDP header and its
    /// fixed-length RDMAP header: bytes after that header, or fewer bytes than it has (with
    /// the DDP header whole). `softwarp_wire`'s `Segment::parse` rejects the same ULPDUs
    /// (`TrailingBytes`, `Truncated`).
    ControlMessageLength,
    /// A control message split over segments, a malformed Terminate, or another
    /// stream-level error.
    RdmapCatastrophic,
    /// The peer stopped in the middle of an FPDU for longer than the runtime's receive stall
    /// timeout (the partial FPDU held a receive buffer or a registration's memory).
    RxStall,
}

/// Which kind of asynchronous event a fault raises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventKind {
    Fatal,
    RequestError,
    AccessError,
}

impl Fault {
    /// The event kind the QP reports when it detects this fault.
    pub(crate) fn event_kind(self) -> EventKind {
        match self {
            Fault::Tagged(_)
            | Fault::ReadSource(_)
            | Fault::AtomicTarget(_)
            | Fault::AtomicMisaligned => EventKind::AccessError,
            Fault::CannotInvalidate { protection: true } => EventKind::AccessError,
            Fault::NoReceiveBuffer
            | Fault::MessageTooLong
            | Fault::UnexpectedOpcode
            | Fault::InvalidQn
            | Fault::IrdExceeded
            | Fault::CannotInvalidate { protection: false } => EventKind::RequestError,
            _ => EventKind::Fatal,
        }
    }
}

/// Why a QP left the RTS state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Cause {
    /// The engine detected this fault in the incoming stream and sent a Terminate for it.
    Detected(Fault),
    /// The peer sent a Terminate with these fields (`layer`, `etype`, `code` as on the wire).
    PeerTerminate {
        /// Layer (0 RDMAP, 1 DDP, 2 LLP).
        layer: u8,
        /// Error type within the layer.
        etype: u8,
        /// Error code.
        code: u8,
    },
    /// The transport (TCP) connection closed or failed while the QP was in RTS.
    LlpClosed,
    /// The application moved the QP to Error (or destroyed it).
    Application,
    /// A work request failed locally (e.g. an lkey that does not validate).
    LocalOperation,
}
