//! [`NegotiationError`]: why an MPA exchange, or the frame this side was about to send,
//! failed.

use softwarp_wire::WireError;
use thiserror::Error;

/// Why MPA negotiation (RFC 5044 section 7.1, RFC 6581) failed: the peer's frame or answer,
/// or local settings that cannot work. The runtime maps each variant to its own error once
/// (`softwarp::MpaError` for the peer's part, an invalid argument or a limit for the local
/// part).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum NegotiationError {
    /// The peer's frame could not be parsed (bad key, revision, private data length ...).
    #[error("bad MPA frame from the peer: {0}")]
    BadFrame(WireError),
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
    /// them ([`super::MarkerMode::Off`]).
    #[error("the peer requires MPA markers, which the local settings refuse (MarkerMode::Off)")]
    MarkersRequired,
    /// The responder answered with a higher revision than the Request's.
    #[error("the peer uses MPA revision {peer}, the local options require {local}")]
    RevisionMismatch {
        /// The peer's revision.
        peer: u8,
        /// The local one.
        local: u8,
    },
    /// Local private data longer than a frame of the revision in use can carry.
    #[error("private data of {len} bytes exceeds the limit of {max}")]
    PrivateDataTooLong {
        /// Length given.
        len: usize,
        /// Most allowed.
        max: usize,
    },
    /// CRC was required ([`super::CrcMode::Required`]) and the Reply said C = 0.
    #[error("CRC is required here and the peer's MPA Reply did not confirm it (C = 0)")]
    CrcNotConfirmed,
    /// The responder's ORD exceeds the IRD this QP can support (RFC 6581).
    #[error("the peer's ORD {peer_ord} exceeds this QP's largest IRD {max_ird}")]
    InsufficientIrd {
        /// The responder's ORD.
        peer_ord: u16,
        /// The QP's IRD capacity.
        max_ird: usize,
    },
    /// Peer-to-peer mode was offered and the responder chose none of the RTR types offered
    /// (or answered without RFC 6581 parameters).
    #[error("the peer chose no RTR type this side offered (RFC 6581 peer-to-peer mode)")]
    NoMatchingRtr,
    /// An IRD or ORD offered beyond the QP's capacity.
    #[error("{what}: requested {requested}, the QP's limit is {limit}")]
    Limit {
        /// The IRD or the ORD.
        what: &'static str,
        /// How much.
        requested: usize,
        /// The QP's capacity.
        limit: usize,
    },
    /// The local offer cannot be made (the text says why).
    #[error("invalid MPA offer: {0}")]
    InvalidOffer(&'static str),
    /// A frame this side built does not encode (never expected: the offer was checked).
    #[error("{what} does not encode: {source}")]
    Encode {
        /// "MPA frame" or "Terminate".
        what: &'static str,
        /// The codec's reason.
        source: WireError,
    },
}
