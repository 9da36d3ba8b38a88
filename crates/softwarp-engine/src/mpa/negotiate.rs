//! The rules of the MPA exchange as pure functions: the initiator's Request ([`request`])
//! and its check of the Reply ([`check_reply`]); the responder's screening of what arrived
//! ([`screen_request`]), its Reply ([`accept`]) or reject ([`reject_reply`]); what the
//! exchange settled ([`Negotiated`], and the engine's [`StreamConfig`] from it); the
//! Terminate an initiator sends before closing ([`terminate_fpdu`]). The table of rules is
//! in the module's parent docs.

use softwarp_wire::ddp::UNTAGGED_HEADER_LEN;
use softwarp_wire::mpa::fpdu::Fpdu;
use softwarp_wire::mpa::frame::{
    EnhancedParams, MpaFrame, MpaFrameKind, MpaFramePacket, MpaRevision, RtrFlags,
    ENHANCED_PARAMS_LEN, MAX_IRD_ORD, MAX_PRIVATE_DATA_LEN,
};
use softwarp_wire::rdmap::{
    LlpError, Message, MpaError as TermCode, Placement, Segment, TerminateError, TerminateRepr,
};
use softwarp_wire::WireError;

use super::error::NegotiationError;
use super::policy::{CrcMode, Offer, Role, RtrTypes};
use crate::qp::{Rtr, RtrKind, StreamConfig, TerminateLayout};

type Result<T, E = NegotiationError> = std::result::Result<T, E>;

/// The read queue limits of the local QP: what to offer and how far negotiation may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpLimits {
    /// IRD offered.
    pub ird: usize,
    /// ORD offered.
    pub ord: usize,
    /// The QP's IRD capacity (`max_dest_rd_atomic`).
    pub max_ird: usize,
    /// The QP's ORD capacity (`max_rd_atomic`).
    pub max_ord: usize,
}

impl QpLimits {
    /// The limits for a QP with capacities `max_ird`/`max_ord` under `offer`; an IRD or ORD
    /// offered beyond them is refused.
    pub fn new(max_ird: usize, max_ord: usize, offer: &Offer<'_>) -> Result<Self> {
        let ird = offer.ird.unwrap_or(max_ird);
        let ord = offer.ord.unwrap_or(max_ord);
        if ird > max_ird {
            return Err(NegotiationError::Limit {
                what: "offered IRD",
                requested: ird,
                limit: max_ird,
            });
        }
        if ord > max_ord {
            return Err(NegotiationError::Limit {
                what: "offered ORD",
                requested: ord,
                limit: max_ord,
            });
        }
        Ok(Self {
            ird,
            ord,
            max_ird,
            max_ord,
        })
    }
}

/// The most ULP private data a frame of `revision` can carry: 512 octets of PD_Length, less
/// the RFC 6581 prefix in revision 2.
pub fn max_private_data(revision: MpaRevision) -> usize {
    match revision {
        MpaRevision::Rev1 => MAX_PRIVATE_DATA_LEN,
        MpaRevision::Rev2 => MAX_PRIVATE_DATA_LEN - ENHANCED_PARAMS_LEN,
    }
}

/// Refuses private data longer than a frame of `revision` carries.
pub fn check_private_data(pd: &[u8], revision: MpaRevision) -> Result<()> {
    let max = max_private_data(revision);
    if pd.len() > max {
        return Err(NegotiationError::PrivateDataTooLong { len: pd.len(), max });
    }
    Ok(())
}

fn clamp14(v: usize) -> u16 {
    v.min(usize::from(MAX_IRD_ORD)) as u16
}

/// An MPA Request or Reply to send, owning its private data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameOut {
    /// Request or Reply.
    pub kind: MpaFrameKind,
    /// The M bit: asks the peer to insert markers.
    pub marker: bool,
    /// The C bit: asks for CRC (Request) or says CRC is in use (Reply).
    pub crc: bool,
    /// The R bit of a Reply: the connection is rejected.
    pub reject: bool,
    /// The revision.
    pub revision: MpaRevision,
    /// The RFC 6581 parameters (revision 2 with the E flag).
    pub enhanced: Option<EnhancedParams>,
    /// The ULP private data (after the RFC 6581 prefix).
    pub private_data: Vec<u8>,
}

impl FrameOut {
    /// The frame as the wire codec sees it.
    pub fn as_frame(&self) -> MpaFrame<'_> {
        MpaFrame {
            kind: self.kind,
            marker: self.marker,
            crc: self.crc,
            reject: self.reject,
            revision: self.revision,
            enhanced: self.enhanced,
            private_data: &self.private_data,
        }
    }

    /// The frame's bytes.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let frame = self.as_frame();
        let mut buf = vec![0u8; frame.buffer_len()];
        frame
            .emit(&mut buf)
            .map_err(|source| NegotiationError::Encode {
                what: "MPA frame",
                source,
            })?;
        Ok(buf)
    }
}

/// What a successful exchange settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// This side's end of the exchange.
    pub role: Role,
    /// The revision in use (1 or 2).
    pub revision: u8,
    /// CRC32c in use.
    pub crc: bool,
    /// This side inserts markers into what it sends (the peer's frame had M = 1).
    pub markers_tx: bool,
    /// The peer inserts markers into what it sends (our frame had M = 1).
    pub markers_rx: bool,
    /// This side's IRD.
    pub ird: usize,
    /// This side's ORD.
    pub ord: usize,
    /// The RFC 6581 RTR, in peer-to-peer mode.
    pub rtr: Option<Rtr>,
    /// The peer's IRD and ORD as its frame stated them (revision 2 only).
    pub peer_ird_ord: Option<(u16, u16)>,
    /// The peer's private data (after the RFC 6581 prefix).
    pub peer_private_data: Vec<u8>,
}

impl Negotiated {
    /// The engine's stream parameters for what this exchange settled: CRC, markers each way,
    /// IRD/ORD and the RTR from the frames; FPDUs of at most `max_fpdu_len` (clamped to what
    /// the engine accepts: [`StreamConfig::clamp_fpdu_len`]); the Terminate layout and RFC
    /// 7306 from the local offer (MPA has no bit for them); and, with
    /// [`Offer::responder_waits`], a responder that sends nothing before the initiator's
    /// first FPDU (RFC 5044; with an RFC 6581 RTR the responder waits for the RTR anyway).
    pub fn stream_config(&self, max_fpdu_len: usize, offer: &Offer<'_>) -> StreamConfig {
        StreamConfig {
            crc: self.crc,
            markers: false,
            //= https://www.rfc-editor.org/rfc/rfc5044#section-4.3
            // (paraphrase) Markers are placed relative to the start of each direction's FPDU
            // stream, the first octet after the MPA Request (initiator to responder) or the
            // MPA Reply (responder to initiator): both streams start at offset 0.
            markers_tx: self.markers_tx,
            markers_rx: self.markers_rx,
            tx_stream_offset: 0,
            rx_stream_offset: 0,
            max_fpdu_len: StreamConfig::clamp_fpdu_len(max_fpdu_len),
            max_rx_ulpdu: softwarp_wire::mpa::fpdu::MAX_ULPDU_LEN,
            ird: self.ird,
            ord: self.ord,
            terminate_layout: offer.terminate_layout,
            rtr: self.rtr,
            rfc7306: offer.rfc7306,
            responder_waits: offer.responder_waits && self.role == Role::Responder,
        }
    }
}

/// An initiator's failure: the error, and the Terminate (RFC 6581 section 9, LLP layer, MPA
/// error type) to send before closing, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Why.
    pub error: NegotiationError,
    /// The MPA error code of the Terminate to send, if one is sent.
    pub terminate: Option<TermCode>,
    /// CRC in force for the Terminate (our C bit, or either side's once the Reply parsed).
    pub crc: bool,
    /// Markers in force toward the peer for the Terminate (the Reply's M bit).
    pub markers: bool,
}

impl Failure {
    fn close(error: NegotiationError) -> Self {
        Self {
            error,
            terminate: None,
            crc: false,
            markers: false,
        }
    }
    fn terminate(error: NegotiationError, code: TermCode) -> Self {
        Self {
            error,
            terminate: Some(code),
            crc: false,
            markers: false,
        }
    }
    fn framing(mut self, crc: bool, markers: bool) -> Self {
        self.crc = crc;
        self.markers = markers;
        self
    }

    /// The Terminate FPDU to send before closing, if any.
    pub fn terminate_bytes(&self, layout: TerminateLayout) -> Option<Vec<u8>> {
        let code = self.terminate?;
        terminate_fpdu(code, self.crc, self.markers, layout).ok()
    }
}

// ---------------------------------------------------------------------------------------
// Initiator
// ---------------------------------------------------------------------------------------

/// The RTR types an initiator can offer with its QP.
fn offerable(offer: &Offer<'_>, limits: &QpLimits) -> RtrTypes {
    RtrTypes {
        // A zero-length Read occupies one ORD slot until its response arrives.
        read: offer.rtr_types.read && limits.max_ord >= 1,
        ..offer.rtr_types
    }
}

/// The MPA Request an initiator sends.
pub fn request(offer: &Offer<'_>, limits: &QpLimits) -> Result<FrameOut> {
    check_private_data(offer.private_data, offer.revision)?;
    let types = offerable(offer, limits);
    let p2p = offer.peer_to_peer;
    if p2p {
        if offer.revision != MpaRevision::Rev2 {
            return Err(NegotiationError::InvalidOffer(
                "peer-to-peer mode needs MPA revision 2 (RFC 6581)",
            ));
        }
        if types.is_empty() {
            return Err(NegotiationError::InvalidOffer(
                "peer-to-peer mode needs at least one RTR type this QP can send",
            ));
        }
    }
    let enhanced = (offer.revision == MpaRevision::Rev2).then(|| {
        // A Read RTR needs one ORD slot here and one IRD slot at the responder, which
        // sizes its IRD from our ORD.
        let ord = if p2p && types.read {
            limits.ord.max(1)
        } else {
            limits.ord
        };
        EnhancedParams {
            ird: clamp14(limits.ird),
            ord: clamp14(ord),
            peer_to_peer: p2p,
            rtr: if p2p { types.flags() } else { RtrFlags::NONE },
        }
    });
    Ok(FrameOut {
        kind: MpaFrameKind::Request,
        marker: offer.markers.asks(),
        crc: offer.crc.asks(),
        reject: false,
        revision: offer.revision,
        enhanced,
        private_data: offer.private_data.to_vec(),
    })
}

/// The ULP private data of a reject Reply that does not parse (siw may send the E flag with
/// fewer than 4 octets): everything, or what follows a whole enhanced prefix.
fn raw_reject_data(bytes: &[u8]) -> Option<Vec<u8>> {
    let packet = MpaFramePacket::new_checked(bytes).ok()?;
    if packet.kind() != Some(MpaFrameKind::Reply) || !packet.reject() {
        return None;
    }
    let pd = packet.private_data();
    let skip = if packet.revision() == 2 && packet.enhanced_flag() && pd.len() >= 4 {
        ENHANCED_PARAMS_LEN
    } else {
        0
    };
    Some(pd.get(skip..).unwrap_or_default().to_vec())
}

/// Checks the Reply (`bytes`, one whole frame as read) to `request` and settles the stream
/// parameters, or says why the connection fails and which Terminate to send.
pub fn check_reply(
    request: &FrameOut,
    offer: &Offer<'_>,
    limits: &QpLimits,
    bytes: &[u8],
) -> Result<Negotiated, Failure> {
    let reply = match MpaFrame::parse(bytes) {
        Ok((f, _)) => f,
        Err(e) => {
            if let Some(private_data) = raw_reject_data(bytes) {
                return Err(Failure::close(NegotiationError::Rejected { private_data }));
            }
            //= https://www.rfc-editor.org/rfc/rfc6581#section-9
            // (paraphrase) An invalid MPA Reply is reported with a Terminate carrying the
            // LLP/MPA error "Invalid MPA Request Frame or MPA Reply Frame".
            return Err(Failure::terminate(
                NegotiationError::BadFrame(e),
                TermCode::InvalidRequestOrReply,
            )
            .framing(request.crc, false));
        }
    };
    if reply.kind != MpaFrameKind::Reply {
        return Err(Failure::terminate(
            NegotiationError::WrongFrameKind { expected: "Reply" },
            TermCode::InvalidRequestOrReply,
        )
        .framing(request.crc, false));
    }
    //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
    // (paraphrase) A Reply with the R bit set rejects the connection; the initiator closes
    // the TCP connection. The private data says why, if the responder's ULP gave a reason.
    if reply.reject {
        return Err(Failure::close(NegotiationError::Rejected {
            private_data: reply.private_data.to_vec(),
        }));
    }
    //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
    // (paraphrase) The responder answers with the initiator's revision or a lower one it
    // supports; a higher revision is not a valid answer.
    if reply.revision > request.revision {
        return Err(Failure::terminate(
            NegotiationError::RevisionMismatch {
                peer: reply.revision.value(),
                local: request.revision.value(),
            },
            TermCode::InvalidRequestOrReply,
        )
        .framing(request.crc, false));
    }
    //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
    // (paraphrase) CRC is used on the connection when either the Request or the Reply has
    // the C bit set.
    let crc = request.crc || reply.crc;
    if offer.crc == CrcMode::Required && !reply.crc {
        // siw's mpa_crc_required does the same: the peer did not confirm CRC.
        return Err(Failure::close(NegotiationError::CrcNotConfirmed));
    }
    //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
    // (paraphrase) M in a frame asks the other side to insert markers into the FPDUs it
    // sends; each direction is decided by the frame of the receiving side.
    if reply.marker && !offer.markers.sends_on_request() {
        return Err(Failure::close(NegotiationError::MarkersRequired));
    }
    let markers_tx = reply.marker;
    let markers_rx = request.marker;
    let fail = |error: NegotiationError, code: TermCode| {
        Failure::terminate(error, code).framing(crc, markers_tx)
    };

    let (ird, ord, rtr, peer_ird_ord) = match (request.enhanced, reply.enhanced) {
        (Some(ours), Some(theirs)) if reply.revision == MpaRevision::Rev2 => {
            //= https://www.rfc-editor.org/rfc/rfc6581#section-3
            // (paraphrase) The initiator's ORD must not exceed the responder's IRD: it is
            // lowered to it.
            let ord = usize::from(ours.ord).min(usize::from(theirs.ird));
            //= https://www.rfc-editor.org/rfc/rfc6581#section-3
            // (paraphrase) The responder's ORD must not exceed the initiator's IRD; an
            // initiator that cannot raise its IRD that far terminates the connection with
            // "insufficient IRD resources".
            let peer_ord = usize::from(theirs.ord);
            let ird = if peer_ord <= usize::from(ours.ird) {
                usize::from(ours.ird)
            } else if peer_ord <= limits.max_ird {
                peer_ord
            } else {
                return Err(fail(
                    NegotiationError::InsufficientIrd {
                        peer_ord: theirs.ord,
                        max_ird: limits.max_ird,
                    },
                    TermCode::InsufficientIrd,
                ));
            };
            let rtr = if ours.peer_to_peer {
                let offered = RtrTypes::from_flags(ours.rtr);
                let chosen = RtrTypes::from_flags(theirs.rtr)
                    .intersect(offered)
                    .preferred();
                //= https://www.rfc-editor.org/rfc/rfc6581#section-5
                // (paraphrase) In peer-to-peer mode the responder selects one of the RTR
                // types the initiator offered; if it selects none of them the initiator
                // terminates the connection with "no matching RTR option".
                match chosen {
                    // A Read RTR needs an IRD slot at the responder.
                    Some(RtrKind::Read) if theirs.ird == 0 => None,
                    other => other,
                }
                .map(|kind| Rtr {
                    kind,
                    initiator: true,
                })
                .ok_or_else(|| fail(NegotiationError::NoMatchingRtr, TermCode::NoMatchingRtr))
                .map(Some)?
            } else {
                None
            };
            (ird, ord, rtr, Some((theirs.ird, theirs.ord)))
        }
        (Some(ours), _) => {
            // The responder answered without the RFC 6581 prefix (revision 1, or 2 without
            // the E flag): no IRD/ORD exchange and no RTR.
            if ours.peer_to_peer {
                return Err(fail(
                    NegotiationError::NoMatchingRtr,
                    TermCode::NoMatchingRtr,
                ));
            }
            (limits.ird, limits.ord, None, None)
        }
        // Revision 1 carries no IRD/ORD: keep the QP's own limits (siw reports 0 and then
        // refuses RDMA Reads; our defaults keep Reads usable between two Softwarp ends).
        (None, _) => (limits.ird, limits.ord, None, None),
    };
    Ok(Negotiated {
        role: Role::Initiator,
        revision: reply.revision.value(),
        crc,
        markers_tx,
        markers_rx,
        ird,
        ord,
        rtr,
        peer_ird_ord,
        peer_private_data: reply.private_data.to_vec(),
    })
}

// ---------------------------------------------------------------------------------------
// Responder
// ---------------------------------------------------------------------------------------

/// A valid MPA Request, copied out of the receive buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerRequest {
    /// The revision asked for.
    pub revision: MpaRevision,
    /// The C bit: the initiator asks for CRC.
    pub crc: bool,
    /// The M bit: the initiator asks for markers in what the responder sends.
    pub marker: bool,
    /// The RFC 6581 parameters (IRD, ORD, peer-to-peer mode and RTR types offered).
    pub enhanced: Option<EnhancedParams>,
    /// The initiator's private data (after the RFC 6581 prefix).
    pub private_data: Vec<u8>,
}

/// What a responder does with what it read where a Request belongs.
#[derive(Debug)]
pub enum Screened {
    /// A Request the application may accept or reject.
    Request(PeerRequest),
    /// Refused at once: send `reply` (a reject) if there is one, then close.
    Refuse {
        /// The reject Reply to send first, if the peer gets one.
        reply: Option<FrameOut>,
        /// Why.
        error: NegotiationError,
    },
}

/// A reject Reply for `req` (or for an unreadable request, at `revision`) carrying
/// `private_data`.
pub fn reject_reply(
    req: Option<&PeerRequest>,
    revision: MpaRevision,
    private_data: &[u8],
) -> FrameOut {
    let revision = req.map_or(revision, |r| r.revision.min(revision));
    // Like siw, a reject to an enhanced Request keeps the RFC 6581 prefix (IRD = ORD = 0).
    let enhanced = req
        .and_then(|r| r.enhanced)
        .filter(|_| revision == MpaRevision::Rev2)
        .map(|_| EnhancedParams::default());
    let max = max_private_data(revision);
    FrameOut {
        kind: MpaFrameKind::Reply,
        marker: false,
        crc: false,
        reject: true,
        revision,
        enhanced,
        private_data: private_data.get(..max).unwrap_or(private_data).to_vec(),
    }
}

/// Screens what arrived where an MPA Request belongs: `read` is the frame (or the wire
/// error that ended reading it early).
pub fn screen_request(read: Result<&[u8], WireError>, offer: &Offer<'_>) -> Screened {
    //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
    // (paraphrase) What does not start with the Request key is not an MPA Request: the
    // responder closes the connection without an answer. PD_Length: if it is larger than
    // 512, the receiver closes the connection (no Reply, rejecting or not).
    let close_unanswered = |e: WireError| Screened::Refuse {
        reply: None,
        error: NegotiationError::BadFrame(e),
    };
    let reject = |error: NegotiationError| Screened::Refuse {
        reply: Some(reject_reply(None, offer.revision, &[])),
        error,
    };
    let bytes = match read {
        Ok(b) => b,
        Err(e @ (WireError::MpaBadKey | WireError::MpaPrivateDataTooLong(_))) => {
            return close_unanswered(e)
        }
        //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
        // (paraphrase) A responder that does not support the requested revision answers with
        // a Reply carrying its own revision and the R bit, then closes.
        Err(e) => return reject(NegotiationError::BadFrame(e)),
    };
    let frame = match MpaFrame::parse(bytes) {
        Ok((f, _)) => f,
        Err(e @ (WireError::MpaBadKey | WireError::MpaPrivateDataTooLong(_))) => {
            return close_unanswered(e)
        }
        Err(e) => return reject(NegotiationError::BadFrame(e)),
    };
    if frame.kind != MpaFrameKind::Request {
        return Screened::Refuse {
            reply: None,
            error: NegotiationError::WrongFrameKind {
                expected: "Request",
            },
        };
    }
    let req = PeerRequest {
        revision: frame.revision,
        crc: frame.crc,
        marker: frame.marker,
        enhanced: frame.enhanced,
        private_data: frame.private_data.to_vec(),
    };
    if req.marker && !offer.markers.sends_on_request() {
        // siw does the same: a Request asking for markers gets a reject Reply.
        return Screened::Refuse {
            reply: Some(reject_reply(Some(&req), offer.revision, &[])),
            error: NegotiationError::MarkersRequired,
        };
    }
    Screened::Request(req)
}

/// The Reply accepting `req` under `offer` with the QP limits `limits`, and what it settles.
/// Fails (the request stays answerable) for private data that does not fit the negotiated
/// revision, and for a markers request `offer` refuses.
pub fn accept(
    req: &PeerRequest,
    offer: &Offer<'_>,
    limits: &QpLimits,
) -> Result<(FrameOut, Negotiated)> {
    if req.marker && !offer.markers.sends_on_request() {
        return Err(NegotiationError::MarkersRequired);
    }
    let revision = req.revision.min(offer.revision);
    check_private_data(offer.private_data, revision)?;
    //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
    // (paraphrase) If the initiator set C, CRC is used, and the responder's Reply says so;
    // a responder may also ask for CRC on its own.
    let crc = offer.crc.asks() || req.crc;
    let markers_rx = offer.markers.asks();
    let (ird, ord, rtr, enhanced, peer_ird_ord) = match req.enhanced {
        Some(e) if revision == MpaRevision::Rev2 => {
            let accepted = RtrTypes {
                // A Read RTR takes one IRD slot here.
                read: offer.rtr_types.read && limits.max_ird >= 1,
                ..offer.rtr_types
            };
            let chosen = if e.peer_to_peer && !accepted.is_empty() {
                // Among the types offered; if none is acceptable, propose our own preferred
                // one (as siw does) and let the initiator decide.
                RtrTypes::from_flags(e.rtr)
                    .intersect(accepted)
                    .preferred()
                    .or(accepted.preferred())
            } else {
                None
            };
            //= https://www.rfc-editor.org/rfc/rfc6581#section-3
            // (paraphrase) The responder's ORD must not exceed the initiator's IRD; its IRD
            // should cover the initiator's ORD, within what the responder's QP supports.
            let mut ird = limits.ird.max(usize::from(e.ord)).min(limits.max_ird);
            if chosen == Some(RtrKind::Read) {
                ird = ird.max(1);
            }
            let ord = limits.ord.min(usize::from(e.ird));
            let params = EnhancedParams {
                ird: clamp14(ird),
                ord: clamp14(ord),
                peer_to_peer: chosen.is_some(),
                rtr: chosen.map_or(RtrFlags::NONE, |k| RtrTypes::only(k).flags()),
            };
            let rtr = chosen.map(|kind| Rtr {
                kind,
                initiator: false,
            });
            (ird, ord, rtr, Some(params), Some((e.ird, e.ord)))
        }
        _ => (limits.ird, limits.ord, None, None, None),
    };
    let reply = FrameOut {
        kind: MpaFrameKind::Reply,
        marker: markers_rx,
        crc,
        reject: false,
        revision,
        enhanced,
        private_data: offer.private_data.to_vec(),
    };
    let neg = Negotiated {
        role: Role::Responder,
        revision: revision.value(),
        crc,
        markers_tx: req.marker,
        markers_rx,
        ird,
        ord,
        rtr,
        peer_ird_ord,
        peer_private_data: req.private_data.clone(),
    };
    Ok((reply, neg))
}

// ---------------------------------------------------------------------------------------
// Terminate
// ---------------------------------------------------------------------------------------

/// The FPDU of a Terminate reporting the MPA error `code` (layer LLP, error type MPA, no
/// header copied back), as the first FPDU of a stream: DDP queue 2, MSN 1. With `markers`
/// the first marker (stream offset 0) is inserted; with `crc` the CRC is filled in.
pub fn terminate_fpdu(
    code: TermCode,
    crc: bool,
    markers: bool,
    layout: TerminateLayout,
) -> Result<Vec<u8>> {
    let mut repr = TerminateRepr::new(TerminateError::Llp(LlpError::Mpa(code)));
    repr.layout = layout;
    let seg = Segment {
        last: true,
        placement: Placement::Untagged { msn: 1, mo: 0 },
        message: Message::Terminate(repr),
        payload: &[],
    };
    let bad = |source| NegotiationError::Encode {
        what: "Terminate",
        source,
    };
    let mut ulpdu = vec![0u8; UNTAGGED_HEADER_LEN + 64];
    let n = seg.emit_header(&mut ulpdu).map_err(bad)?;
    ulpdu.truncate(n);
    let fpdu = Fpdu { ulpdu: &ulpdu };
    let mut out = vec![0u8; fpdu.buffer_len()];
    fpdu.emit(&mut out, crc).map_err(bad)?;
    if !markers {
        return Ok(out);
    }
    let len = softwarp_wire::mpa::marker::wire_len(0, out.len()).map_err(bad)?;
    let mut wire = vec![0u8; len];
    softwarp_wire::mpa::marker::insert(&out, 0, crc, &mut wire).map_err(bad)?;
    Ok(wire)
}
