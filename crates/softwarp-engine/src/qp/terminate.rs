//! Terminate generation (RFC 5040 section 4.8 and the error tables of RFC 5040 section 7,
//! RFC 5041 section 7 and RFC 5044 section 8): which Terminate each detected [`Fault`]
//! produces, and what a received Terminate means for the QP. No I/O here.
//!
//! Decisions (siw interop, see `shared/interop/README.md`):
//! - The layout is RFC 5040 by default; `StreamConfig::terminate_layout` selects siw's
//!   ([`TerminateLayout::LinuxSiw`]) per QP. Received Terminates are read in either layout
//!   (the wire crate detects it).
//! - The DDP Segment Length (M bit) is the ULPDU length of the offending segment, as
//!   RFC 5040 defines it; siw puts the payload length there.
//! - The offending DDP header is copied back (D bit) for every error found in a received
//!   segment; the Read Request header (R bit) for errors about a Read Request. CRC errors and
//!   local errors carry no header (the header cannot be trusted, or there is none).
//! - An RDMA Write or Read Response access-rights violation is reported at the RDMAP layer
//!   (remote protection error, access rights violation), which has the code for it; siw
//!   reports it as a DDP "invalid STag".

use softwarp_wire::ddp::HeaderRepr;
use softwarp_wire::rdmap::{
    DdpError, LlpError, MpaError, RdmapError, ReadRequestRepr, RemoteOperationError,
    RemoteProtectionError, TaggedBufferError, TerminateError, TerminateRepr, TerminatedRdmapHeader,
    UntaggedBufferError,
};

pub use softwarp_wire::rdmap::TerminateLayout;

use crate::fault::{EventKind, Fault};
use crate::mr::AccessError;
use crate::qp::codec;
use crate::qp::tx::TxState;
use crate::wr::WcStatus;

/// The header of the received segment an error is about, as the Terminate copies it back.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct OffendingHeader {
    seg_len: Option<u16>,
    ddp: Option<HeaderRepr>,
    rreq: Option<ReadRequestRepr>,
}

impl OffendingHeader {
    /// No segment (local errors, CRC errors).
    pub(crate) fn none() -> Self {
        Self::default()
    }
    /// The segment whose ULPDU starts with `hdr` and is `ulpdu_len` bytes long.
    pub(crate) fn from_ulpdu(hdr: &[u8], ulpdu_len: usize) -> Self {
        let (ddp, rreq) = codec::offending_headers(hdr);
        Self {
            seg_len: u16::try_from(ulpdu_len).ok(),
            ddp,
            rreq,
        }
    }
}

fn tagged_error(e: AccessError) -> TerminateError {
    let t = match e {
        AccessError::InvalidStag | AccessError::KeyMismatch | AccessError::Invalidated => {
            TaggedBufferError::InvalidStag
        }
        AccessError::PdMismatch => TaggedBufferError::StagNotAssociatedWithDdpStream,
        AccessError::ToWrap => TaggedBufferError::ToWrap,
        AccessError::BaseOrBounds => TaggedBufferError::BaseOrBoundsViolation,
        AccessError::AccessRights => {
            //= https://www.rfc-editor.org/rfc/rfc5040#section-7.2
            // (paraphrase) RDMAP validates the access rights of a tagged access; a violation
            // is a Remote Protection Error, "Access rights violation" (DDP has no such code).
            return TerminateError::Rdmap(RdmapError::RemoteProtection(
                RemoteProtectionError::AccessRightsViolation,
            ));
        }
    };
    TerminateError::Ddp(DdpError::TaggedBuffer(t))
}

fn protection_error(e: AccessError) -> RemoteProtectionError {
    match e {
        AccessError::InvalidStag | AccessError::KeyMismatch | AccessError::Invalidated => {
            RemoteProtectionError::InvalidStag
        }
        AccessError::PdMismatch => RemoteProtectionError::StagNotAssociatedWithRdmapStream,
        AccessError::AccessRights => RemoteProtectionError::AccessRightsViolation,
        AccessError::ToWrap => RemoteProtectionError::ToWrap,
        AccessError::BaseOrBounds => RemoteProtectionError::BaseOrBoundsViolation,
    }
}

fn untagged(e: UntaggedBufferError) -> TerminateError {
    TerminateError::Ddp(DdpError::UntaggedBuffer(e))
}

fn remote_op(e: RemoteOperationError) -> TerminateError {
    TerminateError::Rdmap(RdmapError::RemoteOperation(e))
}

/// What the headers section of the Terminate carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Include {
    /// Nothing (M = D = R = 0).
    Nothing,
    /// The DDP segment length only (M = 1): the header layout is unknown.
    LengthOnly,
    /// Length and DDP header (M = D = 1).
    Ddp,
    /// Length, DDP header and the Read Request header (M = D = R = 1).
    DdpAndReadRequest,
}

/// The Terminate a fault produces: (error, what is copied back).
fn classify(fault: Fault) -> (TerminateError, Include) {
    use Include::*;
    match fault {
        //= https://www.rfc-editor.org/rfc/rfc5044#section-8
        // (paraphrase) An FPDU that fails the CRC check is reported with Layer LLP, Error
        // Type MPA, Error Code "CRC Error".
        Fault::Crc => (
            TerminateError::Llp(LlpError::Mpa(MpaError::CrcError)),
            Nothing,
        ),
        //= https://www.rfc-editor.org/rfc/rfc5044#section-8
        // (paraphrase) A marker that does not agree with the FPDU framing is reported with
        // Layer LLP, Error Type MPA, Error Code "MPA Marker and ULPDU Length field mismatch".
        // Nothing of the segment is copied back: the framing cannot be trusted.
        Fault::BadMarker => (
            TerminateError::Llp(LlpError::Mpa(MpaError::MarkerMismatch)),
            Nothing,
        ),
        Fault::BadUlpduLength => (
            remote_op(RemoteOperationError::CatastrophicLocalToStream),
            LengthOnly,
        ),
        Fault::DdpVersion { tagged } => (
            if tagged {
                TerminateError::Ddp(DdpError::TaggedBuffer(TaggedBufferError::InvalidDdpVersion))
            } else {
                untagged(UntaggedBufferError::InvalidDdpVersion)
            },
            Ddp,
        ),
        Fault::Tagged(e) => (tagged_error(e), Ddp),
        Fault::UnexpectedReadResponse => (remote_op(RemoteOperationError::UnexpectedOpcode), Ddp),
        Fault::InvalidQn => (untagged(UntaggedBufferError::InvalidQueueNumber), Ddp),
        //= https://www.rfc-editor.org/rfc/rfc5041#section-7.2
        // (paraphrase) An untagged segment for which no buffer is available is an Untagged
        // Buffer Error, "Invalid MSN - no buffer available".
        Fault::NoReceiveBuffer => (untagged(UntaggedBufferError::InvalidMsnNoBuffer), Ddp),
        Fault::MsnRange => (untagged(UntaggedBufferError::InvalidMsnRange), Ddp),
        Fault::InvalidMo => (untagged(UntaggedBufferError::InvalidMessageOffset), Ddp),
        //= https://www.rfc-editor.org/rfc/rfc5041#section-7.2
        // (paraphrase) A message longer than the untagged buffer is an Untagged Buffer Error,
        // "DDP Message too long for available buffer".
        Fault::MessageTooLong => (untagged(UntaggedBufferError::MessageTooLong), Ddp),
        Fault::DdpCatastrophic => (
            TerminateError::Ddp(DdpError::LocalCatastrophic { code: 0 }),
            Ddp,
        ),
        Fault::RdmapVersion => (remote_op(RemoteOperationError::InvalidRdmapVersion), Ddp),
        Fault::UnexpectedOpcode => (remote_op(RemoteOperationError::UnexpectedOpcode), Ddp),
        Fault::ReadSource(e) => (
            TerminateError::Rdmap(RdmapError::RemoteProtection(protection_error(e))),
            DdpAndReadRequest,
        ),
        Fault::CannotInvalidate { protection: true } => (
            TerminateError::Rdmap(RdmapError::RemoteProtection(
                RemoteProtectionError::StagCannotBeInvalidated,
            )),
            Ddp,
        ),
        Fault::CannotInvalidate { protection: false } => (
            remote_op(RemoteOperationError::StagCannotBeInvalidated),
            Ddp,
        ),
        //= https://www.rfc-editor.org/rfc/rfc7306#section-9
        // (paraphrase) The responder validates an Atomic Request's Remote STag and Tagged
        // Offset like a tagged access (with remote atomic rights); a failure is an RDMAP
        // Remote Protection Error. RFC 7306 registers no error codes of its own (the IANA
        // RDMAP Errors registry lists only RFC 5040's), so a Tagged Offset that is not
        // 8-byte aligned is reported as "Base or bounds violation": the 8 bytes named are
        // not a valid target word.
        Fault::AtomicTarget(e) => (
            TerminateError::Rdmap(RdmapError::RemoteProtection(protection_error(e))),
            Ddp,
        ),
        Fault::AtomicMisaligned => (
            TerminateError::Rdmap(RdmapError::RemoteProtection(
                RemoteProtectionError::BaseOrBoundsViolation,
            )),
            Ddp,
        ),
        Fault::UnexpectedAtomicResponse => (remote_op(RemoteOperationError::UnexpectedOpcode), Ddp),
        Fault::IrdExceeded => (
            remote_op(RemoteOperationError::CatastrophicLocalToStream),
            DdpAndReadRequest,
        ),
        // A control message whose ULPDU is longer or shorter than its fixed header. The DDP
        // layer framed it correctly (its header is whole and valid), so this is an RDMAP
        // error, and the one RDMAP code that fits: RFC 7306 registers no error codes (the
        // IANA RDMAP Errors registry, updated in the month RFC 7306 was published, cites only
        // RFC 5040) and RFC 5040 has no "invalid length" code. The same Terminate as for an
        // RDMA Read Request carrying payload before this variant existed, and as for a control
        // message split over segments (`RdmapCatastrophic`); the DDP header and, for a Read
        // Request whose header is whole, the Read Request header are copied back.
        //= https://www.iana.org/assignments/rddp/
        //# 0x0/0x2/0x07 Remote Operation Error / Catastrophic error, localized to RDMAP Stream [RFC5040]
        Fault::ControlMessageLength => (
            remote_op(RemoteOperationError::CatastrophicLocalToStream),
            DdpAndReadRequest,
        ),
        Fault::RdmapCatastrophic => (
            remote_op(RemoteOperationError::CatastrophicLocalToStream),
            Ddp,
        ),
        // No RFC names a timer for a peer that stops inside an FPDU; the stream cannot go
        // on, which RFC 5040 section 7.2 reports as a Remote Operation Error, "Catastrophic
        // error, localized to RDMAP Stream". Nothing is copied back: the segment is
        // incomplete (its CRC was never checked, so its header cannot be trusted either).
        Fault::RxStall => (
            remote_op(RemoteOperationError::CatastrophicLocalToStream),
            Nothing,
        ),
    }
}

/// The Terminate for `fault` about the segment `hdr`, in `layout`.
pub(crate) fn terminate_for(
    fault: Option<Fault>,
    hdr: OffendingHeader,
    layout: TerminateLayout,
) -> TerminateRepr {
    let (error, copy) = match fault {
        Some(f) => classify(f),
        None => (
            TerminateError::Rdmap(RdmapError::LocalCatastrophic { code: 0 }),
            Include::Nothing,
        ),
    };
    let mut t = TerminateRepr::new(error);
    t.layout = layout;
    match copy {
        Include::Nothing => {}
        Include::LengthOnly => t.ddp_segment_length = hdr.seg_len,
        Include::Ddp | Include::DdpAndReadRequest => {
            if let Some(h) = hdr.ddp {
                t.ddp_segment_length = hdr.seg_len;
                t.ddp_header = Some(h);
                if copy == Include::DdpAndReadRequest {
                    if let Some(r) = hdr.rreq {
                        t.rdmap_header = TerminatedRdmapHeader::ReadRequest(r);
                    }
                }
            } else {
                t.ddp_segment_length = hdr.seg_len;
            }
        }
    }
    t
}

/// How a QP reacts to a Terminate received from its peer: the event kind and the status of
/// the RDMA Read it refused, from the Terminate's layer and error type.
pub(crate) fn classify_peer_terminate(layer: u8, etype: u8) -> (EventKind, WcStatus) {
    match (layer, etype) {
        // RDMAP remote protection, DDP tagged buffer error.
        (0, 1) | (1, 1) => (EventKind::AccessError, WcStatus::RemAccessErr),
        // DDP untagged buffer error: the peer had no buffer, or ours was too small.
        (1, 2) => (EventKind::RequestError, WcStatus::RemInvReqErr),
        // RDMAP remote operation error.
        (0, 2) => (EventKind::RequestError, WcStatus::RemOpErr),
        _ => (EventKind::Fatal, WcStatus::RemOpErr),
    }
}

/// The Terminate of a QP: at most one is ever sent per stream.
#[derive(Debug, Default)]
pub(crate) struct TerminateState {
    /// Queued for transmission: the fault (`None` for a local error) and the header.
    /// Boxed: a QP that never terminates holds a pointer, not 80 bytes.
    pending: Option<Box<(Option<Fault>, OffendingHeader)>>,
    /// Queued once already (a second error is not reported again).
    queued: bool,
    /// Handed to the runtime completely.
    pub(crate) sent: bool,
}

impl TerminateState {
    /// Queues the Terminate for a fault found in a received segment.
    pub(crate) fn queue(&mut self, fault: Fault, hdr: OffendingHeader, tx: &mut TxState) {
        self.queue_inner(Some(fault), hdr, tx);
    }

    /// Queues a Terminate reporting an RDMAP local catastrophic error (a local WR error, or
    /// the application moving the QP to Error).
    pub(crate) fn queue_local(&mut self, tx: &mut TxState) {
        self.queue_inner(None, OffendingHeader::none(), tx);
    }

    fn queue_inner(&mut self, fault: Option<Fault>, hdr: OffendingHeader, tx: &mut TxState) {
        if self.queued {
            return;
        }
        self.queued = true;
        self.pending = Some(Box::new((fault, hdr)));
        tx.abandon_unstarted();
    }

    /// True while a Terminate waits to be built.
    pub(crate) fn wants_tx(&self) -> bool {
        self.pending.is_some()
    }

    /// True while a Terminate is queued and not yet completely sent.
    pub(crate) fn is_pending(&self) -> bool {
        self.queued && !self.sent
    }

    /// Writes the Terminate ULPDU into `buf` (consuming the queued one); returns its length.
    pub(crate) fn emit(
        &mut self,
        buf: &mut [u8],
        msn: u32,
        layout: TerminateLayout,
    ) -> Option<usize> {
        let (fault, hdr) = *self.pending.take()?;
        let repr = terminate_for(fault, hdr, layout);
        codec::emit_terminate(buf, msn, repr)
    }
}
