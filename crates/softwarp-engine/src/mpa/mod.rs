//! MPA connection setup (RFC 5044 section 7.1, RFC 6581): what each end offers, the frames
//! it sends, and what the exchange settles, as pure functions of the local offer and the
//! peer's frame. The result is the [`crate::qp::StreamConfig`] a QP is established with
//! ([`Negotiated::stream_config`]).
//!
//! No I/O and no clocks here: the runtime reads the peer's frame (whole, as the wire
//! crate's frame codec delimits it) and writes the frames these functions return, so every
//! rule below is unit-tested without sockets. Its connection manager and its blocking
//! helpers call the same functions.
//!
//! | topic | rule |
//! | --- | --- |
//! | revision | the responder answers with the lower of the two revisions; an initiator refuses a Reply with a higher one |
//! | CRC | used when either side's C bit is set; [`CrcMode::Required`] also needs C = 1 in the Reply |
//! | markers | per direction: a side inserts markers when the other side's M bit is set; [`MarkerMode::Off`] refuses a peer that sets M |
//! | IRD/ORD (rev 2) | the responder raises its IRD to the initiator's ORD as far as its QP allows and lowers its ORD to the initiator's IRD; the initiator lowers its ORD to the responder's IRD and raises its IRD to the responder's ORD, or fails with a Terminate (insufficient IRD) |
//! | peer-to-peer (rev 2) | the responder picks Write, then Read, then Send among the RTR types offered and accepted; an initiator whose offer was not honoured sends a Terminate (no matching RTR) |
//! | rev 1 | no IRD/ORD exchange: both ends keep their configured IRD/ORD (QP defaults 16/16); no peer-to-peer mode |
//! | first FPDU | a responder sends nothing before the initiator's first FPDU ([`Offer::responder_waits`], RFC 5044) or, in peer-to-peer mode, before the RTR (RFC 6581); its posted work waits in the QP meanwhile |
//! | private data | at most 512 octets with revision 1, 508 with revision 2 ([`max_private_data`]) |

mod error;
mod negotiate;
mod policy;
#[cfg(test)]
mod tests;

pub use error::NegotiationError;
pub use negotiate::{
    accept, check_private_data, check_reply, max_private_data, reject_reply, request,
    screen_request, terminate_fpdu, Failure, FrameOut, Negotiated, PeerRequest, QpLimits, Screened,
};
pub use policy::{CrcMode, MarkerMode, Offer, Role, RtrTypes};
