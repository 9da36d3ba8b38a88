//! What one end offers in MPA negotiation ([`Offer`]) and the policies it is made of
//! ([`CrcMode`], [`MarkerMode`], [`RtrTypes`]), plus which end of the exchange a side was
//! ([`Role`]). Plain data.

use softwarp_wire::mpa::frame::{MpaRevision, RtrFlags};

use crate::qp::{RtrKind, TerminateLayout};

/// When CRC32c protects FPDUs (RFC 5044 section 7.1: CRC is used when either side asks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CrcMode {
    /// Do not ask for CRC (C = 0); use it anyway when the peer asks, as the RFC requires.
    /// Linux siw's default.
    Off,
    /// Ask for CRC (C = 1); it is then in use whatever the peer says.
    #[default]
    Preferred,
    /// Ask for CRC and insist on the peer confirming it: as initiator, a Reply with C = 0 ends
    /// the connection ([`super::NegotiationError::CrcNotConfirmed`]), like siw's
    /// `mpa_crc_required`. As responder the same as [`CrcMode::Preferred`] (the Reply always
    /// says C = 1).
    Required,
}

impl CrcMode {
    /// The C bit this side sends.
    pub fn asks(self) -> bool {
        !matches!(self, CrcMode::Off)
    }
}

/// A mode equals the C bit it sends: `Off` equals `false`, `Preferred` and `Required` equal
/// `true` (so `info.crc == opts.crc` says whether a connection uses the CRC it asked for).
impl PartialEq<bool> for CrcMode {
    fn eq(&self, other: &bool) -> bool {
        self.asks() == *other
    }
}

/// See `impl PartialEq<bool> for CrcMode`.
impl PartialEq<CrcMode> for bool {
    fn eq(&self, other: &CrcMode) -> bool {
        other.asks() == *self
    }
}

/// Whether MPA markers (RFC 5044 section 4.3) are used. Each direction is negotiated on its
/// own: the M bit of a frame asks the other side to insert markers into what it sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MarkerMode {
    /// Never use markers (M = 0), and refuse a peer that asks for them: a Request with M = 1
    /// is answered with a reject Reply, a Reply with M = 1 ends the connection. Linux siw's
    /// behaviour (it never sends markers and rejects M = 1).
    #[default]
    Off,
    /// Do not ask for markers (M = 0), but insert them into the FPDUs we send when the peer
    /// asks.
    Accept,
    /// Ask the peer to insert markers (M = 1), and insert them when the peer asks too.
    Request,
}

impl MarkerMode {
    /// The M bit this side sends.
    pub fn asks(self) -> bool {
        matches!(self, MarkerMode::Request)
    }

    /// True when this side agrees to insert markers for a peer that asks.
    pub fn sends_on_request(self) -> bool {
        !matches!(self, MarkerMode::Off)
    }
}

/// A set of RFC 6581 ready-to-receive (RTR) message types: offered by an initiator in
/// peer-to-peer mode, accepted by a responder. A responder chooses, among the types offered
/// and accepted, the zero-length RDMA Write first, then the zero-length Read, then the
/// zero-length Send (siw prefers the Write too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RtrTypes {
    /// Zero-length RDMA Write.
    pub write: bool,
    /// Zero-length RDMA Read (needs ORD >= 1 on the initiator, IRD >= 1 on the responder).
    pub read: bool,
    /// Zero-length Send (consumes no receive work request at the responder).
    pub send: bool,
}

impl RtrTypes {
    /// Every type.
    pub const ALL: RtrTypes = RtrTypes {
        write: true,
        read: true,
        send: true,
    };
    /// No type (peer-to-peer mode refused).
    pub const NONE: RtrTypes = RtrTypes {
        write: false,
        read: false,
        send: false,
    };
    /// What Linux siw offers and accepts: Write and Read.
    pub const WRITE_OR_READ: RtrTypes = RtrTypes {
        write: true,
        read: true,
        send: false,
    };

    /// The set with exactly `kind`.
    pub const fn only(kind: RtrKind) -> RtrTypes {
        RtrTypes {
            write: matches!(kind, RtrKind::Write),
            read: matches!(kind, RtrKind::Read),
            send: matches!(kind, RtrKind::Send),
        }
    }

    /// True when no type is in the set.
    pub const fn is_empty(self) -> bool {
        !(self.write || self.read || self.send)
    }

    /// True when `kind` is in the set.
    pub const fn contains(self, kind: RtrKind) -> bool {
        match kind {
            RtrKind::Write => self.write,
            RtrKind::Read => self.read,
            RtrKind::Send => self.send,
        }
    }

    /// The types in both sets.
    pub const fn intersect(self, other: RtrTypes) -> RtrTypes {
        RtrTypes {
            write: self.write && other.write,
            read: self.read && other.read,
            send: self.send && other.send,
        }
    }

    /// The preferred type of the set: Write, then Read, then Send.
    pub const fn preferred(self) -> Option<RtrKind> {
        if self.write {
            Some(RtrKind::Write)
        } else if self.read {
            Some(RtrKind::Read)
        } else if self.send {
            Some(RtrKind::Send)
        } else {
            None
        }
    }

    /// The RTR flags of an MPA frame's RFC 6581 parameters for this set.
    pub(crate) fn flags(self) -> RtrFlags {
        RtrFlags {
            zero_length_send: self.send,
            zero_length_write: self.write,
            zero_length_read: self.read,
        }
    }

    /// The set an MPA frame's RTR flags name.
    pub(crate) fn from_flags(flags: RtrFlags) -> RtrTypes {
        RtrTypes {
            write: flags.zero_length_write,
            read: flags.zero_length_read,
            send: flags.zero_length_send,
        }
    }
}

impl Default for RtrTypes {
    fn default() -> Self {
        RtrTypes::ALL
    }
}

/// Which end of the MPA exchange this side was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Sent the MPA Request (connected).
    Initiator,
    /// Sent the MPA Reply (accepted).
    Responder,
}

/// What one end offers (initiator) or accepts and answers with (responder) in the MPA
/// exchange, and the stream settings MPA has no bit for. The defaults are Softwarp's; the
/// runtime's connection options convert to this in one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer<'a> {
    /// CRC32c policy ([`CrcMode::Preferred`] by default).
    pub crc: CrcMode,
    /// MPA marker policy ([`MarkerMode::Off`] by default, like siw).
    pub markers: MarkerMode,
    /// The revision to offer (initiator) or the highest to accept (responder); 2 by default.
    pub revision: MpaRevision,
    /// Initiator: offer RFC 6581 peer-to-peer mode with the types in `rtr_types`.
    pub peer_to_peer: bool,
    /// RTR types offered (initiator) or accepted (responder; empty: peer-to-peer refused).
    pub rtr_types: RtrTypes,
    /// Private data for the peer's application: at most [`super::max_private_data`] of the
    /// revision in use.
    pub private_data: &'a [u8],
    /// IRD to offer; `None`: the QP's capacity ([`super::QpLimits::max_ird`]).
    pub ird: Option<usize>,
    /// ORD to offer; `None`: the QP's capacity ([`super::QpLimits::max_ord`]).
    pub ord: Option<usize>,
    /// Layout of the Terminate messages this side sends.
    pub terminate_layout: TerminateLayout,
    /// The RFC 7306 extensions are used on the stream (MPA has no bit for them).
    pub rfc7306: bool,
    /// Responder outside peer-to-peer mode: send no FPDU before the initiator's first one
    /// arrived (RFC 5044 section 7.1; true by default). With an RFC 6581 RTR the responder
    /// waits for the RTR whatever this says.
    pub responder_waits: bool,
}

impl Default for Offer<'_> {
    fn default() -> Self {
        Self {
            crc: CrcMode::Preferred,
            markers: MarkerMode::Off,
            revision: MpaRevision::Rev2,
            peer_to_peer: false,
            rtr_types: RtrTypes::ALL,
            private_data: &[],
            ird: None,
            ord: None,
            terminate_layout: TerminateLayout::Rfc5040,
            rfc7306: true,
            responder_waits: true,
        }
    }
}

impl Offer<'_> {
    /// What Linux siw offers by default (Debian 6.1): revision 2 with IRD/ORD, CRC off (used
    /// when the peer asks), no markers (refused), no peer-to-peer mode (Write and Read RTR
    /// accepted when a peer asks), siw's Terminate layout, and FPDUs sent as soon as the
    /// connection is up.
    pub fn linux_siw() -> Self {
        Self {
            crc: CrcMode::Off,
            rtr_types: RtrTypes::WRITE_OR_READ,
            terminate_layout: TerminateLayout::LinuxSiw,
            responder_waits: false,
            ..Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rtr_preference_is_write_then_read_then_send() {
        assert_eq!(RtrTypes::ALL.preferred(), Some(RtrKind::Write));
        let rs = RtrTypes {
            write: false,
            ..RtrTypes::ALL
        };
        assert_eq!(rs.preferred(), Some(RtrKind::Read));
        assert_eq!(
            RtrTypes::only(RtrKind::Send).preferred(),
            Some(RtrKind::Send)
        );
        assert_eq!(RtrTypes::NONE.preferred(), None);
        assert!(RtrTypes::only(RtrKind::Read)
            .intersect(RtrTypes::WRITE_OR_READ)
            .contains(RtrKind::Read));
        assert!(RtrTypes::only(RtrKind::Send)
            .intersect(RtrTypes::WRITE_OR_READ)
            .is_empty());
        for t in [RtrTypes::ALL, RtrTypes::NONE, RtrTypes::WRITE_OR_READ] {
            assert_eq!(RtrTypes::from_flags(t.flags()), t);
        }
    }

    #[test]
    fn modes_say_which_bits_they_send() {
        assert!(CrcMode::Required.asks() && !CrcMode::Off.asks());
        assert!(CrcMode::Preferred == true && false == CrcMode::Off);
        assert!(MarkerMode::Request.asks() && !MarkerMode::Accept.asks());
        assert!(MarkerMode::Accept.sends_on_request() && !MarkerMode::Off.sends_on_request());
    }
}
