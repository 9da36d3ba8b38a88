//! MPA negotiation (RFC 5044 section 7.1, RFC 6581): what each end sends and what the
//! exchange settles, as pure functions of the local settings and the peer's frame.
//!
//! No I/O and no clocks here: the connection manager and the minimal connection path feed
//! the frames they read and write the frames these functions return, so every rule below is
//! unit-tested without sockets.
//!
//! | topic | rule |
//! | --- | --- |
//! | revision | the responder answers with the lower of the two revisions; an initiator refuses a Reply with a higher one |
//! | CRC | used when either side's C bit is set; [`CrcMode::Required`] also needs C = 1 in the Reply |
//! | markers | per direction: a side inserts markers when the other side's M bit is set; [`MarkerMode::Off`] refuses a peer that sets M |
//! | IRD/ORD (rev 2) | the responder raises its IRD to the initiator's ORD as far as its QP allows and lowers its ORD to the initiator's IRD; the initiator lowers its ORD to the responder's IRD and raises its IRD to the responder's ORD, or fails with a Terminate (insufficient IRD) |
//! | peer-to-peer (rev 2) | the responder picks Write, then Read, then Send among the RTR types offered and accepted; an initiator whose offer was not honoured sends a Terminate (no matching RTR) |
//! | rev 1 | no IRD/ORD exchange: both ends keep their configured IRD/ORD (QP defaults 16/16); no peer-to-peer mode |

use softwarp_engine::qp::{Rtr, RtrKind, StreamConfig, TerminateLayout};
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

use super::options::{ConnectOptions, CrcMode, Role, RtrTypes};
use crate::error::{Error, MpaError, Result};

/// The read queue limits of the local QP: what to offer and how far negotiation may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Local {
    /// IRD offered.
    pub(crate) ird: usize,
    /// ORD offered.
    pub(crate) ord: usize,
    /// The QP's IRD capacity (`max_dest_rd_atomic`).
    pub(crate) max_ird: usize,
    /// The QP's ORD capacity (`max_rd_atomic`).
    pub(crate) max_ord: usize,
}

impl Local {
    /// The limits for a QP with capacities `max_ird`/`max_ord` under `opts`.
    pub(crate) fn new(max_ird: usize, max_ord: usize, opts: &ConnectOptions) -> Result<Self> {
        let ird = opts.ird.unwrap_or(max_ird);
        let ord = opts.ord.unwrap_or(max_ord);
        if ird > max_ird {
            return Err(Error::Limit {
                what: "IRD (ConnectOptions::ird)",
                requested: ird,
                limit: max_ird,
            });
        }
        if ord > max_ord {
            return Err(Error::Limit {
                what: "ORD (ConnectOptions::ord)",
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
pub(crate) fn max_private_data(revision: MpaRevision) -> usize {
    match revision {
        MpaRevision::Rev1 => MAX_PRIVATE_DATA_LEN,
        MpaRevision::Rev2 => MAX_PRIVATE_DATA_LEN - ENHANCED_PARAMS_LEN,
    }
}

/// Refuses private data longer than a frame of `revision` carries.
pub(crate) fn check_private_data(pd: &[u8], revision: MpaRevision) -> Result<()> {
    let max = max_private_data(revision);
    if pd.len() > max {
        return Err(MpaError::PrivateDataTooLong { len: pd.len(), max }.into());
    }
    Ok(())
}

fn clamp14(v: usize) -> u16 {
    v.min(usize::from(MAX_IRD_ORD)) as u16
}

fn rtr_flags(types: RtrTypes) -> RtrFlags {
    RtrFlags {
        zero_length_send: types.send,
        zero_length_write: types.write,
        zero_length_read: types.read,
    }
}

fn rtr_types(flags: RtrFlags) -> RtrTypes {
    RtrTypes {
        write: flags.zero_length_write,
        read: flags.zero_length_read,
        send: flags.zero_length_send,
    }
}

/// An MPA Request or Reply to send, owning its private data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FrameOut {
    pub(crate) kind: MpaFrameKind,
    pub(crate) marker: bool,
    pub(crate) crc: bool,
    pub(crate) reject: bool,
    pub(crate) revision: MpaRevision,
    pub(crate) enhanced: Option<EnhancedParams>,
    pub(crate) private_data: Vec<u8>,
}

impl FrameOut {
    /// The frame as the wire codec sees it.
    pub(crate) fn as_frame(&self) -> MpaFrame<'_> {
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
    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        let frame = self.as_frame();
        let mut buf = vec![0u8; frame.buffer_len()];
        frame
            .emit(&mut buf)
            .map_err(|_| Error::InvalidArgument("MPA frame does not encode"))?;
        Ok(buf)
    }
}

/// What a successful exchange settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Negotiated {
    pub(crate) role: Role,
    pub(crate) revision: u8,
    pub(crate) crc: bool,
    pub(crate) markers_tx: bool,
    pub(crate) markers_rx: bool,
    pub(crate) ird: usize,
    pub(crate) ord: usize,
    pub(crate) rtr: Option<Rtr>,
    pub(crate) peer_ird_ord: Option<(u16, u16)>,
    pub(crate) peer_private_data: Vec<u8>,
}

impl Negotiated {
    /// The engine's stream parameters for what this exchange settled: CRC, markers each way,
    /// IRD/ORD and the RTR from the frames; FPDUs of at most `max_fpdu_len` (clamped to what
    /// the engine accepts: [`StreamConfig::clamp_fpdu_len`]); the Terminate layout and RFC
    /// 7306 from the local options (MPA has no bit for them); and, with `responder_waits`, a
    /// responder that sends nothing before the initiator's first FPDU (RFC 5044).
    pub(crate) fn stream_config(
        &self,
        max_fpdu_len: usize,
        opts: &ConnectOptions,
        responder_waits: bool,
    ) -> StreamConfig {
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
            terminate_layout: opts.terminate_layout,
            rtr: self.rtr,
            rfc7306: opts.rfc7306,
            responder_waits: responder_waits && self.role == Role::Responder,
        }
    }
}

/// An initiator's failure: the error, and the Terminate (RFC 6581 section 9, LLP layer, MPA
/// error type) to send before closing, if any.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) error: Error,
    pub(crate) terminate: Option<TermCode>,
    /// CRC in force for the Terminate (our C bit, or either side's once the Reply parsed).
    pub(crate) crc: bool,
    /// Markers in force toward the peer for the Terminate (the Reply's M bit).
    pub(crate) markers: bool,
}

impl Failure {
    fn close(error: impl Into<Error>) -> Self {
        Self {
            error: error.into(),
            terminate: None,
            crc: false,
            markers: false,
        }
    }
    fn terminate(error: impl Into<Error>, code: TermCode) -> Self {
        Self {
            error: error.into(),
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
    pub(crate) fn terminate_bytes(&self, layout: TerminateLayout) -> Option<Vec<u8>> {
        let code = self.terminate?;
        terminate_fpdu(code, self.crc, self.markers, layout).ok()
    }
}

// ---------------------------------------------------------------------------------------
// Initiator
// ---------------------------------------------------------------------------------------

/// The RTR types an initiator can offer with its QP.
fn offerable(opts: &ConnectOptions, local: &Local) -> RtrTypes {
    RtrTypes {
        // A zero-length Read occupies one ORD slot until its response arrives.
        read: opts.rtr_types.read && local.max_ord >= 1,
        ..opts.rtr_types
    }
}

/// The MPA Request an initiator sends.
pub(crate) fn request(opts: &ConnectOptions, local: &Local) -> Result<FrameOut> {
    check_private_data(&opts.private_data, opts.revision)?;
    let offer = offerable(opts, local);
    if opts.peer_to_peer {
        if opts.revision != MpaRevision::Rev2 {
            return Err(Error::InvalidArgument(
                "peer-to-peer mode needs MPA revision 2 (RFC 6581)",
            ));
        }
        if offer.is_empty() {
            return Err(Error::InvalidArgument(
                "peer-to-peer mode needs at least one RTR type this QP can send",
            ));
        }
    }
    let enhanced = (opts.revision == MpaRevision::Rev2).then(|| {
        let p2p = opts.peer_to_peer;
        // A Read RTR needs one ORD slot here and one IRD slot at the responder, which
        // sizes its IRD from our ORD.
        let ord = if p2p && offer.read {
            local.ord.max(1)
        } else {
            local.ord
        };
        EnhancedParams {
            ird: clamp14(local.ird),
            ord: clamp14(ord),
            peer_to_peer: p2p,
            rtr: if p2p {
                rtr_flags(offer)
            } else {
                RtrFlags::NONE
            },
        }
    });
    Ok(FrameOut {
        kind: MpaFrameKind::Request,
        marker: opts.markers.asks(),
        crc: opts.crc.asks(),
        reject: false,
        revision: opts.revision,
        enhanced,
        private_data: opts.private_data.clone(),
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
pub(crate) fn check_reply(
    request: &FrameOut,
    opts: &ConnectOptions,
    local: &Local,
    bytes: &[u8],
) -> std::result::Result<Negotiated, Failure> {
    let reply = match MpaFrame::parse(bytes) {
        Ok((f, _)) => f,
        Err(e) => {
            if let Some(private_data) = raw_reject_data(bytes) {
                return Err(Failure::close(MpaError::Rejected { private_data }));
            }
            //= https://www.rfc-editor.org/rfc/rfc6581#section-9
            // (paraphrase) An invalid MPA Reply is reported with a Terminate carrying the
            // LLP/MPA error "Invalid MPA Request Frame or MPA Reply Frame".
            return Err(
                Failure::terminate(MpaError::BadFrame(e), TermCode::InvalidRequestOrReply)
                    .framing(request.crc, false),
            );
        }
    };
    if reply.kind != MpaFrameKind::Reply {
        return Err(Failure::terminate(
            MpaError::WrongFrameKind { expected: "Reply" },
            TermCode::InvalidRequestOrReply,
        )
        .framing(request.crc, false));
    }
    //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
    // (paraphrase) A Reply with the R bit set rejects the connection; the initiator closes
    // the TCP connection. The private data says why, if the responder's ULP gave a reason.
    if reply.reject {
        return Err(Failure::close(MpaError::Rejected {
            private_data: reply.private_data.to_vec(),
        }));
    }
    //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
    // (paraphrase) The responder answers with the initiator's revision or a lower one it
    // supports; a higher revision is not a valid answer.
    if reply.revision > request.revision {
        return Err(Failure::terminate(
            MpaError::RevisionMismatch {
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
    if opts.crc == CrcMode::Required && !reply.crc {
        // siw's mpa_crc_required does the same: the peer did not confirm CRC.
        return Err(Failure::close(MpaError::CrcNotConfirmed));
    }
    //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
    // (paraphrase) M in a frame asks the other side to insert markers into the FPDUs it
    // sends; each direction is decided by the frame of the receiving side.
    if reply.marker && !opts.markers.sends_on_request() {
        return Err(Failure::close(MpaError::MarkersRequired));
    }
    let markers_tx = reply.marker;
    let markers_rx = request.marker;
    let fail =
        |error: MpaError, code: TermCode| Failure::terminate(error, code).framing(crc, markers_tx);

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
            } else if peer_ord <= local.max_ird {
                peer_ord
            } else {
                return Err(fail(
                    MpaError::InsufficientIrd {
                        peer_ord: theirs.ord,
                        max_ird: local.max_ird,
                    },
                    TermCode::InsufficientIrd,
                ));
            };
            let rtr = if ours.peer_to_peer {
                let offered = rtr_types(ours.rtr);
                let chosen = rtr_types(theirs.rtr).intersect(offered).preferred();
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
                .ok_or_else(|| fail(MpaError::NoMatchingRtr, TermCode::NoMatchingRtr))
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
                return Err(fail(MpaError::NoMatchingRtr, TermCode::NoMatchingRtr));
            }
            (local.ird, local.ord, None, None)
        }
        // Revision 1 carries no IRD/ORD: keep the QP's own limits (siw reports 0 and then
        // refuses RDMA Reads; our defaults keep Reads usable between two Softwarp ends).
        (None, _) => (local.ird, local.ord, None, None),
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
pub(crate) struct PeerRequest {
    pub(crate) revision: MpaRevision,
    pub(crate) crc: bool,
    pub(crate) marker: bool,
    pub(crate) enhanced: Option<EnhancedParams>,
    pub(crate) private_data: Vec<u8>,
}

/// What a responder does with what it read where a Request belongs.
#[derive(Debug)]
pub(crate) enum Screened {
    /// A Request the application may accept or reject.
    Request(PeerRequest),
    /// Refused at once: send `reply` (a reject) if there is one, then close.
    Refuse {
        reply: Option<FrameOut>,
        error: MpaError,
    },
}

/// A reject Reply for `req` (or for an unreadable request, at `revision`) carrying
/// `private_data`.
pub(crate) fn reject_reply(
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
pub(crate) fn screen_request(
    read: std::result::Result<&[u8], WireError>,
    opts: &ConnectOptions,
) -> Screened {
    //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
    // (paraphrase) What does not start with the Request key is not an MPA Request: the
    // responder closes the connection without an answer. PD_Length: if it is larger than
    // 512, the receiver closes the connection (no Reply, rejecting or not).
    let close_unanswered = |e: WireError| Screened::Refuse {
        reply: None,
        error: MpaError::BadFrame(e),
    };
    let reject = |error: MpaError| Screened::Refuse {
        reply: Some(reject_reply(None, opts.revision, &[])),
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
        Err(e) => return reject(MpaError::BadFrame(e)),
    };
    let frame = match MpaFrame::parse(bytes) {
        Ok((f, _)) => f,
        Err(e @ (WireError::MpaBadKey | WireError::MpaPrivateDataTooLong(_))) => {
            return close_unanswered(e)
        }
        Err(e) => return reject(MpaError::BadFrame(e)),
    };
    if frame.kind != MpaFrameKind::Request {
        return Screened::Refuse {
            reply: None,
            error: MpaError::WrongFrameKind {
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
    if req.marker && !opts.markers.sends_on_request() {
        // siw does the same: a Request asking for markers gets a reject Reply.
        return Screened::Refuse {
            reply: Some(reject_reply(Some(&req), opts.revision, &[])),
            error: MpaError::MarkersRequired,
        };
    }
    Screened::Request(req)
}

/// The Reply accepting `req` under `opts` with the QP limits `local`, and what it settles.
/// Fails (the request stays answerable) for private data that does not fit the negotiated
/// revision, and for a markers request `opts` refuses.
pub(crate) fn accept(
    req: &PeerRequest,
    opts: &ConnectOptions,
    local: &Local,
) -> Result<(FrameOut, Negotiated)> {
    if req.marker && !opts.markers.sends_on_request() {
        return Err(MpaError::MarkersRequired.into());
    }
    let revision = req.revision.min(opts.revision);
    check_private_data(&opts.private_data, revision)?;
    //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
    // (paraphrase) If the initiator set C, CRC is used, and the responder's Reply says so;
    // a responder may also ask for CRC on its own.
    let crc = opts.crc.asks() || req.crc;
    let markers_rx = opts.markers.asks();
    let (ird, ord, rtr, enhanced, peer_ird_ord) = match req.enhanced {
        Some(e) if revision == MpaRevision::Rev2 => {
            let accepted = RtrTypes {
                // A Read RTR takes one IRD slot here.
                read: opts.rtr_types.read && local.max_ird >= 1,
                ..opts.rtr_types
            };
            let chosen = if e.peer_to_peer && !accepted.is_empty() {
                // Among the types offered; if none is acceptable, propose our own preferred
                // one (as siw does) and let the initiator decide.
                rtr_types(e.rtr)
                    .intersect(accepted)
                    .preferred()
                    .or(accepted.preferred())
            } else {
                None
            };
            //= https://www.rfc-editor.org/rfc/rfc6581#section-3
            // (paraphrase) The responder's ORD must not exceed the initiator's IRD; its IRD
            // should cover the initiator's ORD, within what the responder's QP supports.
            let mut ird = local.ird.max(usize::from(e.ord)).min(local.max_ird);
            if chosen == Some(RtrKind::Read) {
                ird = ird.max(1);
            }
            let ord = local.ord.min(usize::from(e.ird));
            let params = EnhancedParams {
                ird: clamp14(ird),
                ord: clamp14(ord),
                peer_to_peer: chosen.is_some(),
                rtr: chosen.map_or(RtrFlags::NONE, |k| rtr_flags(RtrTypes::only(k))),
            };
            let rtr = chosen.map(|kind| Rtr {
                kind,
                initiator: false,
            });
            (ird, ord, rtr, Some(params), Some((e.ird, e.ord)))
        }
        _ => (local.ird, local.ord, None, None, None),
    };
    let reply = FrameOut {
        kind: MpaFrameKind::Reply,
        marker: markers_rx,
        crc,
        reject: false,
        revision,
        enhanced,
        private_data: opts.private_data.clone(),
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
pub(crate) fn terminate_fpdu(
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
    let bad = |_| Error::InvalidArgument("Terminate does not encode");
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cm::options::MarkerMode;

    const LOCAL: Local = Local {
        ird: 16,
        ord: 16,
        max_ird: 16,
        max_ord: 16,
    };

    fn enhanced(ird: u16, ord: u16, p2p: bool, rtr: RtrTypes) -> Option<EnhancedParams> {
        Some(EnhancedParams {
            ird,
            ord,
            peer_to_peer: p2p,
            rtr: rtr_flags(rtr),
        })
    }

    #[test]
    fn the_stream_config_carries_what_was_settled_and_clamps_the_fpdu_length() {
        let neg = Negotiated {
            role: Role::Responder,
            revision: 2,
            crc: true,
            markers_tx: true,
            markers_rx: false,
            ird: 3,
            ord: 5,
            rtr: None,
            peer_ird_ord: Some((5, 3)),
            peer_private_data: Vec::new(),
        };
        let opts = ConnectOptions::default();
        let cfg = neg.stream_config(9000, &opts, true);
        assert!(cfg.crc && cfg.markers_tx && !cfg.markers_rx && !cfg.markers);
        assert_eq!((cfg.ird, cfg.ord, cfg.max_fpdu_len), (3, 5, 9000));
        assert_eq!((cfg.tx_stream_offset, cfg.rx_stream_offset), (0, 0));
        assert_eq!(cfg.terminate_layout, opts.terminate_layout);
        assert!(
            cfg.responder_waits,
            "an RFC 5044 responder waits when asked"
        );
        assert!(!neg.stream_config(9000, &opts, false).responder_waits);
        let initiator = Negotiated {
            role: Role::Initiator,
            ..neg.clone()
        };
        assert!(
            !initiator.stream_config(9000, &opts, true).responder_waits,
            "an initiator never waits"
        );
        // Below the engine's minimum and beyond MPA's longest FPDU: clamped.
        assert_eq!(
            neg.stream_config(1, &opts, true).max_fpdu_len,
            softwarp_engine::qp::MIN_FPDU_LEN
        );
        assert_eq!(
            neg.stream_config(usize::MAX, &opts, true).max_fpdu_len,
            softwarp_wire::mpa::fpdu::MAX_FPDU_LEN
        );
    }

    fn reply_bytes(f: &FrameOut) -> Vec<u8> {
        f.encode().unwrap()
    }

    fn reply(crc: bool, marker: bool, rev: MpaRevision, e: Option<EnhancedParams>) -> FrameOut {
        FrameOut {
            kind: MpaFrameKind::Reply,
            marker,
            crc,
            reject: false,
            revision: rev,
            enhanced: e,
            private_data: b"rep".to_vec(),
        }
    }

    fn peer_request(bytes: &[u8]) -> PeerRequest {
        match screen_request(Ok(bytes), &ConnectOptions::default()) {
            Screened::Request(r) => r,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn default_request_is_rev2_with_crc_and_the_qp_ird_ord() {
        let r = request(&ConnectOptions::default(), &LOCAL).unwrap();
        assert_eq!(
            reply_bytes(&r)[16..],
            [0x50, 2, 0, 4, 0, 16, 0, 16],
            "C + E flags, rev 2, PD_Length 4, IRD 16 ORD 16"
        );
        let siw = request(&ConnectOptions::linux_siw(), &LOCAL).unwrap();
        assert_eq!(reply_bytes(&siw)[16..], [0x10, 2, 0, 4, 0, 16, 0, 16]);
    }

    #[test]
    fn p2p_request_offers_the_rtr_types_and_needs_rev2() {
        let opts = ConnectOptions::default()
            .peer_to_peer(true)
            .rtr_types(RtrTypes::WRITE_OR_READ)
            .ord(0);
        let local = Local::new(16, 16, &opts).unwrap();
        let r = request(&opts, &local).unwrap();
        // P2P bit on the IRD word; Write and Read on the ORD word; ORD raised to 1 for the
        // Read RTR (siw's c001).
        assert_eq!(reply_bytes(&r)[20..], [0x80, 16, 0xc0, 1]);
        let r = request(&opts.clone().revision(MpaRevision::Rev1), &local);
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        let r = request(&opts.rtr_types(RtrTypes::NONE), &local);
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    }

    #[test]
    fn private_data_limits_are_508_with_rev2_and_512_with_rev1() {
        let ok2 = ConnectOptions::default().private_data(&[7; 508]);
        assert!(request(&ok2, &LOCAL).is_ok());
        let long2 = ConnectOptions::default().private_data(&[7; 509]);
        assert!(matches!(
            request(&long2, &LOCAL),
            Err(Error::Mpa(MpaError::PrivateDataTooLong {
                len: 509,
                max: 508
            }))
        ));
        let ok1 = long2
            .clone()
            .revision(MpaRevision::Rev1)
            .private_data(&[1; 512]);
        assert_eq!(request(&ok1, &LOCAL).unwrap().encode().unwrap().len(), 532);
        let long1 = ok1.private_data(&[1; 513]);
        assert!(matches!(
            request(&long1, &LOCAL),
            Err(Error::Mpa(MpaError::PrivateDataTooLong {
                len: 513,
                max: 512
            }))
        ));
    }

    #[test]
    fn ird_ord_beyond_the_qp_are_refused() {
        let r = Local::new(4, 4, &ConnectOptions::default().ird(5));
        assert!(matches!(r, Err(Error::Limit { requested: 5, .. })));
        let l = Local::new(4, 8, &ConnectOptions::default().ord(2)).unwrap();
        assert_eq!((l.ird, l.ord, l.max_ird, l.max_ord), (4, 2, 4, 8));
    }

    #[test]
    fn markers_are_settled_per_direction() {
        // The initiator asks (M = 1); the responder agrees to send them but does not ask.
        let ask = ConnectOptions::default().markers(MarkerMode::Request);
        let req = request(&ask, &LOCAL).unwrap();
        assert_eq!(req.encode().unwrap()[16] & 0x80, 0x80);
        let accepting = ConnectOptions::default().markers(MarkerMode::Accept);
        let Screened::Request(peer) = screen_request(Ok(&req.encode().unwrap()), &accepting) else {
            panic!("screened out");
        };
        let (rep, rneg) = accept(&peer, &accepting, &LOCAL).unwrap();
        assert!(!rep.marker, "Accept does not ask");
        assert_eq!((rneg.markers_tx, rneg.markers_rx), (true, false));
        let ineg = check_reply(&req, &ask, &LOCAL, &reply_bytes(&rep)).unwrap();
        assert_eq!((ineg.markers_tx, ineg.markers_rx), (false, true));
        // A responder that refuses markers rejects the Request at screening.
        assert!(matches!(
            screen_request(Ok(&req.encode().unwrap()), &ConnectOptions::default()),
            Screened::Refuse {
                error: MpaError::MarkersRequired,
                ..
            }
        ));
    }

    #[test]
    fn initiator_settles_crc_when_either_side_asks() {
        for (ours, theirs, used) in [
            (CrcMode::Off, false, false),
            (CrcMode::Off, true, true),
            (CrcMode::Preferred, false, true),
            (CrcMode::Preferred, true, true),
            (CrcMode::Required, true, true),
        ] {
            let opts = ConnectOptions::default().crc_mode(ours);
            let req = request(&opts, &LOCAL).unwrap();
            let rep = reply(
                theirs,
                false,
                MpaRevision::Rev2,
                enhanced(4, 4, false, RtrTypes::NONE),
            );
            let n = check_reply(&req, &opts, &LOCAL, &reply_bytes(&rep)).unwrap();
            assert_eq!(n.crc, used, "{ours:?} vs C={theirs}");
            assert_eq!(n.peer_private_data, b"rep");
        }
        let opts = ConnectOptions::default().crc_mode(CrcMode::Required);
        let req = request(&opts, &LOCAL).unwrap();
        let rep = reply(
            false,
            false,
            MpaRevision::Rev2,
            enhanced(4, 4, false, RtrTypes::NONE),
        );
        let f = check_reply(&req, &opts, &LOCAL, &reply_bytes(&rep)).unwrap_err();
        assert!(matches!(f.error, Error::Mpa(MpaError::CrcNotConfirmed)));
        assert_eq!(f.terminate, None);
    }

    #[test]
    fn initiator_adjusts_ord_down_and_ird_up_within_the_qp() {
        let opts = ConnectOptions::default().ird(2).ord(8);
        let local = Local::new(16, 16, &opts).unwrap();
        let req = request(&opts, &local).unwrap();
        // Responder IRD 3 (our ORD drops to 3), ORD 10 (our IRD rises to 10 <= 16).
        let rep = reply(
            false,
            false,
            MpaRevision::Rev2,
            enhanced(3, 10, false, RtrTypes::NONE),
        );
        let n = check_reply(&req, &opts, &local, &reply_bytes(&rep)).unwrap();
        assert_eq!((n.ird, n.ord, n.peer_ird_ord), (10, 3, Some((3, 10))));
        // ORD 17 is beyond the QP's 16: insufficient IRD, with the Terminate for it.
        let rep = reply(
            false,
            false,
            MpaRevision::Rev2,
            enhanced(3, 17, false, RtrTypes::NONE),
        );
        let f = check_reply(&req, &opts, &local, &reply_bytes(&rep)).unwrap_err();
        assert!(matches!(
            f.error,
            Error::Mpa(MpaError::InsufficientIrd {
                peer_ord: 17,
                max_ird: 16
            })
        ));
        assert_eq!(f.terminate, Some(TermCode::InsufficientIrd));
    }

    #[test]
    fn initiator_takes_the_rtr_it_offered_or_terminates() {
        let opts = ConnectOptions::default()
            .peer_to_peer(true)
            .rtr_types(RtrTypes::WRITE_OR_READ);
        let req = request(&opts, &LOCAL).unwrap();
        for (chosen, expect) in [
            (RtrTypes::only(RtrKind::Write), Some(RtrKind::Write)),
            (RtrTypes::only(RtrKind::Read), Some(RtrKind::Read)),
            (RtrTypes::only(RtrKind::Send), None),
            (RtrTypes::NONE, None),
        ] {
            let rep = reply(
                false,
                false,
                MpaRevision::Rev2,
                enhanced(1, 1, true, chosen),
            );
            let r = check_reply(&req, &opts, &LOCAL, &reply_bytes(&rep));
            match expect {
                Some(kind) => assert_eq!(
                    r.unwrap().rtr,
                    Some(Rtr {
                        kind,
                        initiator: true
                    })
                ),
                None => {
                    let f = r.unwrap_err();
                    assert!(matches!(f.error, Error::Mpa(MpaError::NoMatchingRtr)));
                    assert_eq!(f.terminate, Some(TermCode::NoMatchingRtr));
                }
            }
        }
        // A revision 1 answer cannot carry peer-to-peer mode.
        let rep = reply(false, false, MpaRevision::Rev1, None);
        let f = check_reply(&req, &opts, &LOCAL, &reply_bytes(&rep)).unwrap_err();
        assert_eq!(f.terminate, Some(TermCode::NoMatchingRtr));
        // Without P2P a revision 1 answer is fine: no IRD/ORD exchange.
        let opts = ConnectOptions::default().ird(3).ord(5);
        let local = Local::new(16, 16, &opts).unwrap();
        let req = request(&opts, &local).unwrap();
        let n = check_reply(&req, &opts, &local, &reply_bytes(&rep)).unwrap();
        assert_eq!((n.revision, n.ird, n.ord, n.rtr), (1, 3, 5, None));
    }

    #[test]
    fn initiator_refuses_bad_replies_with_the_right_terminate() {
        let opts = ConnectOptions::default().revision(MpaRevision::Rev1);
        let req = request(&opts, &LOCAL).unwrap();
        let higher = reply(false, false, MpaRevision::Rev2, None);
        let f = check_reply(&req, &opts, &LOCAL, &reply_bytes(&higher)).unwrap_err();
        assert!(matches!(
            f.error,
            Error::Mpa(MpaError::RevisionMismatch { peer: 2, local: 1 })
        ));
        assert_eq!(f.terminate, Some(TermCode::InvalidRequestOrReply));
        let mut wrong_kind = reply_bytes(&reply(false, false, MpaRevision::Rev1, None));
        wrong_kind[..16].copy_from_slice(b"MPA ID Req Frame");
        let f = check_reply(&req, &opts, &LOCAL, &wrong_kind).unwrap_err();
        assert!(matches!(
            f.error,
            Error::Mpa(MpaError::WrongFrameKind { .. })
        ));
        let f = check_reply(&req, &opts, &LOCAL, b"HTTP/1.1 400 Bad Request\r\n").unwrap_err();
        assert!(matches!(f.error, Error::Mpa(MpaError::BadFrame(_))));
        assert_eq!(f.terminate, Some(TermCode::InvalidRequestOrReply));
        let markers = reply(false, true, MpaRevision::Rev1, None);
        let f = check_reply(&req, &opts, &LOCAL, &reply_bytes(&markers)).unwrap_err();
        assert!(matches!(f.error, Error::Mpa(MpaError::MarkersRequired)));
        assert_eq!(f.terminate, None);
    }

    #[test]
    fn reject_replies_yield_their_private_data_even_when_malformed() {
        let req = request(&ConnectOptions::default(), &LOCAL).unwrap();
        let mut rej = reject_reply(None, MpaRevision::Rev2, b"no");
        rej.enhanced = Some(EnhancedParams::default());
        let f =
            check_reply(&req, &ConnectOptions::default(), &LOCAL, &reply_bytes(&rej)).unwrap_err();
        assert!(
            matches!(f.error, Error::Mpa(MpaError::Rejected { ref private_data }) if private_data == b"no")
        );
        // siw-style reject: E flag with PD_Length 0 does not parse as an enhanced frame.
        let mut raw = b"MPA ID Rep Frame".to_vec();
        raw.extend_from_slice(&[0x30, 2, 0, 0]);
        let f = check_reply(&req, &ConnectOptions::default(), &LOCAL, &raw).unwrap_err();
        assert!(
            matches!(f.error, Error::Mpa(MpaError::Rejected { ref private_data }) if private_data.is_empty())
        );
        assert_eq!(f.terminate, None);
    }

    #[test]
    fn responder_answers_siw_requests_like_siw() {
        // siw-crc-rping.pcap frame 4: rev 2, C, E, IRD 1 ORD 1.
        let mut siw = b"MPA ID Req Frame".to_vec();
        siw.extend_from_slice(&[0x50, 2, 0, 4, 0, 1, 0, 1]);
        let req = peer_request(&siw);
        let (rep, n) = accept(&req, &ConnectOptions::linux_siw(), &LOCAL).unwrap();
        // CRC turned on because the request asked; IRD 16 covers ORD 1; ORD lowered to 1.
        assert_eq!(reply_bytes(&rep)[16..], [0x50, 2, 0, 4, 0, 16, 0, 1]);
        assert_eq!(&reply_bytes(&rep)[..16], b"MPA ID Rep Frame");
        assert!(n.crc && n.rtr.is_none() && n.role == Role::Responder);
        assert_eq!((n.ird, n.ord), (16, 1));
        // siw-p2p-rping.pcap: offered Write + Read (c001), siw chose Write (8001).
        let mut p2p = b"MPA ID Req Frame".to_vec();
        p2p.extend_from_slice(&[0x10, 2, 0, 4, 0x80, 1, 0xc0, 1]);
        let req = peer_request(&p2p);
        let (rep, n) = accept(&req, &ConnectOptions::linux_siw(), &LOCAL).unwrap();
        assert_eq!(reply_bytes(&rep)[20..], [0x80, 16, 0x80, 1]);
        assert_eq!(
            n.rtr,
            Some(Rtr {
                kind: RtrKind::Write,
                initiator: false
            })
        );
    }

    #[test]
    fn responder_picks_rtr_by_preference_and_refuses_p2p_with_no_types() {
        let mut p2p = b"MPA ID Req Frame".to_vec();
        p2p.extend_from_slice(&[0x10, 2, 0, 4, 0xc0, 0, 0x40, 0]); // Send + Read, ORD 0
        let req = peer_request(&p2p);
        let (rep, n) = accept(&req, &ConnectOptions::default(), &LOCAL).unwrap();
        assert_eq!(n.rtr.map(|r| r.kind), Some(RtrKind::Read));
        // The Read RTR needs IRD >= 1 here; ORD is limited by the initiator's IRD 0.
        assert_eq!((n.ird, n.ord), (16, 0));
        assert_eq!(reply_bytes(&rep)[20..], [0x80, 16, 0x40, 0]);
        let only_send = ConnectOptions::default().rtr_types(RtrTypes::only(RtrKind::Send));
        let (_, n) = accept(&req, &only_send, &LOCAL).unwrap();
        assert_eq!(n.rtr.map(|r| r.kind), Some(RtrKind::Send));
        let none = ConnectOptions::default().rtr_types(RtrTypes::NONE);
        let (rep, n) = accept(&req, &none, &LOCAL).unwrap();
        assert_eq!(n.rtr, None);
        assert_eq!(reply_bytes(&rep)[20..], [0x00, 16, 0x00, 0]);
        // No common type: our own preference is proposed; the initiator will decide.
        let only_write = ConnectOptions::default().rtr_types(RtrTypes::only(RtrKind::Write));
        let (_, n) = accept(&req, &only_write, &LOCAL).unwrap();
        assert_eq!(n.rtr.map(|r| r.kind), Some(RtrKind::Write));
    }

    #[test]
    fn responder_answers_with_the_lower_revision() {
        let mut rev1 = b"MPA ID Req Frame".to_vec();
        rev1.extend_from_slice(&[0x00, 1, 0, 2, b'h', b'i']);
        let req = peer_request(&rev1);
        let (rep, n) = accept(&req, &ConnectOptions::default(), &LOCAL).unwrap();
        assert_eq!(reply_bytes(&rep)[16..], [0x40, 1, 0, 0]);
        assert_eq!(
            (n.revision, n.peer_private_data.as_slice()),
            (1, &b"hi"[..])
        );
        let mut rev2 = b"MPA ID Req Frame".to_vec();
        rev2.extend_from_slice(&[0x10, 2, 0, 4, 0, 1, 0, 1]);
        let req = peer_request(&rev2);
        let opts = ConnectOptions::default()
            .revision(MpaRevision::Rev1)
            .crc(false)
            .private_data(&[9; 512]);
        let (rep, n) = accept(&req, &opts, &LOCAL).unwrap();
        assert_eq!(n.revision, 1);
        assert_eq!(reply_bytes(&rep)[16..20], [0x00, 1, 2, 0]);
        // 512 bytes do not fit a revision 2 Reply: refused, the request stays answerable.
        let r = accept(&req, &opts.revision(MpaRevision::Rev2), &LOCAL);
        assert!(matches!(
            r,
            Err(Error::Mpa(MpaError::PrivateDataTooLong {
                len: 512,
                max: 508
            }))
        ));
    }

    #[test]
    fn screening_closes_on_garbage_and_rejects_unsupported_requests() {
        let opts = ConnectOptions::default();
        match screen_request(Err(WireError::MpaBadKey), &opts) {
            Screened::Refuse { reply: None, .. } => {}
            other => panic!("{other:?}"),
        }
        match screen_request(Err(WireError::MpaUnsupportedRevision(3)), &opts) {
            Screened::Refuse {
                reply: Some(r),
                error: MpaError::BadFrame(WireError::MpaUnsupportedRevision(3)),
            } => assert_eq!(reply_bytes(&r)[16..], [0x20, 2, 0, 0]),
            other => panic!("{other:?}"),
        }
        match screen_request(Err(WireError::MpaPrivateDataTooLong(600)), &opts) {
            Screened::Refuse {
                reply: None,
                error: MpaError::BadFrame(WireError::MpaPrivateDataTooLong(600)),
            } => {}
            other => panic!("{other:?}"),
        }
        let mut markers = b"MPA ID Req Frame".to_vec();
        markers.extend_from_slice(&[0x90, 2, 0, 4, 0, 1, 0, 1]);
        match screen_request(Ok(&markers), &opts) {
            Screened::Refuse {
                reply: Some(r),
                error: MpaError::MarkersRequired,
            } => assert_eq!(reply_bytes(&r)[16..], [0x30, 2, 0, 4, 0, 0, 0, 0]),
            other => panic!("{other:?}"),
        }
        let mut reply_key = b"MPA ID Rep Frame".to_vec();
        reply_key.extend_from_slice(&[0, 1, 0, 0]);
        assert!(matches!(
            screen_request(Ok(&reply_key), &opts),
            Screened::Refuse {
                reply: None,
                error: MpaError::WrongFrameKind { .. }
            }
        ));
    }

    #[test]
    fn terminate_fpdu_reports_the_mpa_error_on_queue_2() {
        let t = terminate_fpdu(
            TermCode::NoMatchingRtr,
            true,
            false,
            TerminateLayout::Rfc5040,
        )
        .unwrap();
        let (fpdu, len) = Fpdu::parse(&t, true).unwrap();
        assert_eq!(len, t.len());
        let seg = Segment::parse(fpdu.ulpdu).unwrap();
        match seg.message {
            Message::Terminate(r) => {
                assert_eq!(r.error.fields(), (2, 0, 7), "LLP / MPA / no matching RTR")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(seg.queue_number(), Some(2));
        let m = terminate_fpdu(
            TermCode::InsufficientIrd,
            false,
            true,
            TerminateLayout::Rfc5040,
        )
        .unwrap();
        assert_eq!(m.len(), t.len() + 4, "one marker at stream offset 0");
        assert_eq!(&m[..4], &[0, 0, 0, 0]);
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        fn crc_mode() -> impl Strategy<Value = CrcMode> {
            prop_oneof![
                Just(CrcMode::Off),
                Just(CrcMode::Preferred),
                Just(CrcMode::Required)
            ]
        }

        fn marker_mode() -> impl Strategy<Value = MarkerMode> {
            prop_oneof![
                Just(MarkerMode::Off),
                Just(MarkerMode::Accept),
                Just(MarkerMode::Request)
            ]
        }

        fn rtr() -> impl Strategy<Value = RtrTypes> {
            (any::<bool>(), any::<bool>(), any::<bool>()).prop_map(|(write, read, send)| RtrTypes {
                write,
                read,
                send,
            })
        }

        prop_compose! {
            fn end()(
                rev2 in any::<bool>(),
                crc in crc_mode(),
                markers in marker_mode(),
                p2p in any::<bool>(),
                rtr in rtr(),
                pd in proptest::collection::vec(any::<u8>(), 0..=508),
                max_ird in 0usize..40,
                max_ord in 0usize..40,
                ird in 0usize..40,
                ord in 0usize..40,
            ) -> (ConnectOptions, Local) {
                let rev = if rev2 { MpaRevision::Rev2 } else { MpaRevision::Rev1 };
                let opts = ConnectOptions::default()
                    .revision(rev)
                    .crc_mode(crc)
                    .markers(markers)
                    .peer_to_peer(p2p && rev2)
                    .rtr_types(rtr)
                    .private_data(&pd)
                    .ird(ird.min(max_ird))
                    .ord(ord.min(max_ord));
                let local = Local::new(max_ird, max_ord, &opts).unwrap();
                (opts, local)
            }
        }

        proptest! {
            #[test]
            fn any_reply_bytes_are_judged_without_panicking(
                bytes in proptest::collection::vec(any::<u8>(), 0..600),
                keyed in any::<bool>(),
            ) {
                let mut bytes = bytes;
                if keyed && bytes.len() >= 16 {
                    bytes[..16].copy_from_slice(b"MPA ID Rep Frame");
                }
                let req = request(&ConnectOptions::default().peer_to_peer(true), &LOCAL).unwrap();
                let _ = check_reply(&req, &ConnectOptions::default(), &LOCAL, &bytes);
                if let Screened::Request(r) = screen_request(Ok(&bytes), &ConnectOptions::default()) {
                    let _ = accept(&r, &ConnectOptions::default(), &LOCAL);
                }
            }

            /// Whatever the two ends ask for, a successful exchange leaves them agreeing:
            /// same revision, CRC and RTR, mirrored markers, each ORD within the other's
            /// IRD, every IRD within its QP, and each side's private data delivered.
            #[test]
            fn both_ends_agree_on_what_they_settled((iopts, ilocal) in end(), (ropts, rlocal) in end()) {
                let Ok(req) = request(&iopts, &ilocal) else {
                    // Only an impossible peer-to-peer offer is refused locally.
                    prop_assert!(iopts.peer_to_peer);
                    return Ok(());
                };
                let bytes = req.encode().unwrap();
                let peer = match screen_request(Ok(&bytes), &ropts) {
                    Screened::Request(p) => p,
                    Screened::Refuse { error, .. } => {
                        prop_assert!(matches!(error, MpaError::MarkersRequired));
                        return Ok(());
                    }
                };
                let rev = iopts.revision.min(ropts.revision);
                let ropts = ropts.clone().private_data(
                    &ropts.private_data[..ropts.private_data.len().min(max_private_data(rev))],
                );
                let (reply, rneg) = match accept(&peer, &ropts, &rlocal) {
                    Ok(v) => v,
                    Err(e) => {
                        prop_assert!(matches!(e, Error::Mpa(MpaError::MarkersRequired)), "{e}");
                        return Ok(());
                    }
                };
                let ineg = match check_reply(&req, &iopts, &ilocal, &reply.encode().unwrap()) {
                    Ok(n) => n,
                    Err(f) => {
                        // Refusals that the initiator is entitled to.
                        prop_assert!(matches!(
                            f.error,
                            Error::Mpa(MpaError::MarkersRequired)
                                | Error::Mpa(MpaError::NoMatchingRtr)
                                | Error::Mpa(MpaError::InsufficientIrd { .. })
                        ), "{}", f.error);
                        return Ok(());
                    }
                };
                prop_assert_eq!(ineg.revision, rev.value());
                prop_assert_eq!(rneg.revision, rev.value());
                prop_assert_eq!(ineg.crc, iopts.crc.asks() || ropts.crc.asks());
                prop_assert_eq!(rneg.crc, ineg.crc);
                prop_assert_eq!(ineg.markers_tx, rneg.markers_rx);
                prop_assert_eq!(ineg.markers_rx, rneg.markers_tx);
                prop_assert_eq!(ineg.rtr.map(|r| r.kind), rneg.rtr.map(|r| r.kind));
                prop_assert!(ineg.rtr.is_none_or(|r| r.initiator));
                prop_assert!(rneg.rtr.is_none_or(|r| !r.initiator));
                if let Some(r) = ineg.rtr {
                    prop_assert!(iopts.rtr_types.contains(r.kind));
                }
                prop_assert!(ineg.ird <= ilocal.max_ird && ineg.ord <= ilocal.max_ord.max(1));
                prop_assert!(rneg.ird <= rlocal.max_ird.max(1) && rneg.ord <= rlocal.max_ord);
                if rev == MpaRevision::Rev2 {
                    prop_assert!(ineg.ord <= rneg.ird, "{} > {}", ineg.ord, rneg.ird);
                    prop_assert!(rneg.ord <= ineg.ird, "{} > {}", rneg.ord, ineg.ird);
                }
                prop_assert_eq!(&rneg.peer_private_data, &iopts.private_data);
                prop_assert_eq!(&ineg.peer_private_data, &ropts.private_data);
            }
        }
    }
}
