//! RFC 5041 DDP segment headers: the DDP control byte, the tagged buffer model header and the
//! untagged buffer model header.
//!
//! This module only encodes and decodes bytes: it never does I/O, never allocates and never
//! panics on any input. It works on the ULPDU, i.e. the bytes after MPA's `ULPDU_Length` and
//! before pad and CRC (framing is the [`crate::mpa`] module's job).
//!
//! ```text
//! DDP control byte          first byte of every DDP segment
//!   0 1 2 3 4 5 6 7
//!  +-+-+-+-+-+-+-+-+
//!  |T|L| Rsvd  | DV|       T: tagged, L: last segment of the message, DV: DDP version (1)
//!  +-+-+-+-+-+-+-+-+
//!
//! Tagged buffer model header (14 bytes)
//!  |DDP ctrl| RsvdULP |  STag (32)  |      TO (64)        |
//! Untagged buffer model header (18 bytes)
//!  |DDP ctrl| RsvdULP (40 bits)     | QN (32) | MSN (32) | MO (32) |
//! ```
//!
//! DDP leaves the byte after its control byte (and, in the untagged header, the following 32
//! bits) to its upper layer. RDMAP puts its own control byte there ([`crate::rdmap`]) and,
//! in Send with Invalidate, the STag to invalidate. This module calls them `ulp_control` and
//! `ulp_reserved` and carries them opaquely.
//!
//! Views: [`TaggedHeader`] and [`UntaggedHeader`] (`new_checked` guarantees that no accessor
//! can read out of bounds). Reprs: [`TaggedRepr`], [`UntaggedRepr`] and [`HeaderRepr`], which
//! picks the model from the T flag.

pub(crate) mod be;
mod tagged;
mod untagged;

pub use tagged::{TaggedHeader, TaggedRepr};
pub use untagged::{UntaggedHeader, UntaggedRepr};

use crate::WireError;
use core::fmt;

/// The only DDP version (DV) this crate speaks, and the only one RFC 5041 defines.
pub const DDP_VERSION: u8 = 1;

/// Length of a tagged buffer model DDP header, RDMAP control byte included.
pub const TAGGED_HEADER_LEN: usize = 14;

/// Length of an untagged buffer model DDP header, RDMAP control byte and the 32-bit field
/// reserved for the ULP included.
pub const UNTAGGED_HEADER_LEN: usize = 18;

/// The T (tagged) flag in the DDP control byte.
pub const FLAG_TAGGED: u8 = 0x80;
/// The L (last) flag in the DDP control byte.
pub const FLAG_LAST: u8 = 0x40;
/// The four reserved bits of the DDP control byte.
pub const MASK_RESERVED: u8 = 0x3c;
/// The two DDP version (DV) bits of the DDP control byte.
pub const MASK_VERSION: u8 = 0x03;

/// Offsets shared by both header models.
mod field {
    /// The DDP control byte (T, L, Rsvd, DV).
    pub const CONTROL: usize = 0;
    /// The first byte of RsvdULP, which RDMAP uses as its control byte.
    pub const ULP_CONTROL: usize = 1;
}

/// Builds a DDP control byte with DV = `version` ([`DDP_VERSION`] for everything we originate;
/// another value only when a received header is copied back, e.g. into a Terminate). Reserved
/// bits are zero.
pub(crate) fn control_byte(tagged: bool, last: bool, version: u8) -> u8 {
    // RFC 5041 section 4 (paraphrased; the exact text could not be retrieved here): the
    // four Rsvd bits are reserved for future use and MUST be set to zero, and DV MUST be set
    // to 1 in every DDP segment.
    let mut byte = version & MASK_VERSION;
    if tagged {
        byte |= FLAG_TAGGED;
    }
    if last {
        byte |= FLAG_LAST;
    }
    byte
}

/// Checks the DV field of a received DDP control byte.
pub(crate) fn check_version(control: u8) -> Result<(), WireError> {
    // RFC 5041 section 4 (paraphrased): DV MUST be 1. RFC 5041 section 7 gives the error a
    // receiver reports for any other value: "Invalid DDP version" (tagged buffer code 0x04,
    // untagged buffer code 0x06). The Rsvd bits are not checked here: a receiver that
    // rejected them would break on a future use of the bits for no gain.
    let version = control & MASK_VERSION;
    if version == DDP_VERSION {
        Ok(())
    } else {
        Err(WireError::DdpBadVersion(version))
    }
}

/// Whether a DDP segment is tagged, read from its first byte.
///
/// # Errors
/// [`WireError::Truncated`] if `segment` is empty.
pub fn is_tagged(segment: &[u8]) -> Result<bool, WireError> {
    match segment.first() {
        Some(control) => Ok(control & FLAG_TAGGED != 0),
        None => Err(WireError::Truncated {
            what: "DDP control byte",
            need: 1,
            have: 0,
        }),
    }
}

/// The header length (14 or 18 bytes) implied by a DDP control byte's T flag.
pub fn header_len(control: u8) -> usize {
    if control & FLAG_TAGGED != 0 {
        TAGGED_HEADER_LEN
    } else {
        UNTAGGED_HEADER_LEN
    }
}

/// A DDP header of either buffer model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeaderRepr {
    /// T = 1: the payload goes to a tagged buffer named by STag and TO.
    Tagged(TaggedRepr),
    /// T = 0: the payload goes to the next untagged buffer of queue QN, at MO in message MSN.
    Untagged(UntaggedRepr),
}

impl HeaderRepr {
    /// Parses a tagged or untagged header (chosen by the T flag) from the start of a segment.
    /// Returns the header and the bytes it took (14 or 18); the payload follows.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if the header is cut short, [`WireError::DdpBadVersion`] if
    /// DV is not 1.
    pub fn parse(segment: &[u8]) -> Result<(Self, usize), WireError> {
        if is_tagged(segment)? {
            let (repr, len) = TaggedRepr::parse(segment)?;
            Ok((HeaderRepr::Tagged(repr), len))
        } else {
            let (repr, len) = UntaggedRepr::parse(segment)?;
            Ok((HeaderRepr::Untagged(repr), len))
        }
    }

    /// Like [`HeaderRepr::parse`] but accepts any DV value (the version is not kept).
    ///
    /// For copies of a peer's header that are reported back, e.g. the terminated DDP header
    /// in a Terminate message, whose DV may be the very reason for the error.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if the header is cut short.
    pub fn parse_any_version(segment: &[u8]) -> Result<(Self, usize), WireError> {
        if is_tagged(segment)? {
            let view = TaggedHeader::new_checked(segment)?;
            Ok((
                HeaderRepr::Tagged(TaggedRepr::from_view(&view)),
                TAGGED_HEADER_LEN,
            ))
        } else {
            let view = UntaggedHeader::new_checked(segment)?;
            Ok((
                HeaderRepr::Untagged(UntaggedRepr::from_view(&view)),
                UNTAGGED_HEADER_LEN,
            ))
        }
    }

    /// The header length: [`TAGGED_HEADER_LEN`] or [`UNTAGGED_HEADER_LEN`].
    pub fn buffer_len(&self) -> usize {
        match self {
            HeaderRepr::Tagged(r) => r.buffer_len(),
            HeaderRepr::Untagged(r) => r.buffer_len(),
        }
    }

    /// Writes the header at the start of `buf` and returns the bytes written.
    ///
    /// # Errors
    /// [`WireError::BufferTooSmall`] if `buf` is shorter than [`HeaderRepr::buffer_len`].
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        match self {
            HeaderRepr::Tagged(r) => r.emit(buf),
            HeaderRepr::Untagged(r) => r.emit(buf),
        }
    }

    /// The T flag.
    pub fn is_tagged(&self) -> bool {
        matches!(self, HeaderRepr::Tagged(_))
    }

    /// The L flag: this segment ends its DDP message.
    pub fn last(&self) -> bool {
        match self {
            HeaderRepr::Tagged(r) => r.last,
            HeaderRepr::Untagged(r) => r.last,
        }
    }

    /// The byte reserved for the ULP (RDMAP's control byte).
    pub fn ulp_control(&self) -> u8 {
        match self {
            HeaderRepr::Tagged(r) => r.ulp_control,
            HeaderRepr::Untagged(r) => r.ulp_control,
        }
    }
}

impl fmt::Display for HeaderRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeaderRepr::Tagged(r) => fmt::Display::fmt(r, f),
            HeaderRepr::Untagged(r) => fmt::Display::fmt(r, f),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn control_byte_sets_version_one_and_zero_reserved_bits() {
        assert_eq!(control_byte(false, false, DDP_VERSION), 0x01);
        assert_eq!(control_byte(false, true, DDP_VERSION), 0x41);
        assert_eq!(control_byte(true, false, DDP_VERSION), 0x81);
        assert_eq!(control_byte(true, true, DDP_VERSION), 0xc1);
    }

    #[test]
    fn check_version_accepts_only_one() {
        assert_eq!(check_version(0x41), Ok(()));
        // Reserved bits are ignored on receive.
        assert_eq!(check_version(0x7d), Ok(()));
        for dv in [0u8, 2, 3] {
            assert_eq!(check_version(0xc0 | dv), Err(WireError::DdpBadVersion(dv)));
        }
    }

    #[test]
    fn header_len_follows_the_t_flag() {
        assert_eq!(header_len(0xc1), TAGGED_HEADER_LEN);
        assert_eq!(header_len(0x41), UNTAGGED_HEADER_LEN);
        assert_eq!(is_tagged(&[0x81]), Ok(true));
        assert_eq!(is_tagged(&[0x01]), Ok(false));
        assert!(matches!(is_tagged(&[]), Err(WireError::Truncated { .. })));
    }

    #[test]
    fn header_repr_dispatches_on_the_t_flag() {
        // siw Read Response header (siw-crc-rping.pcap frame 10).
        let tagged = [
            0xc1, 0x42, 0x74, 0x3e, 0x8b, 0x00, 0x00, 0x00, 0x56, 0x0e, 0x0e, 0x3a, 0x0a, 0x50,
        ];
        let (repr, len) = HeaderRepr::parse(&tagged).unwrap();
        assert_eq!(len, 14);
        assert!(repr.is_tagged() && repr.last());
        assert_eq!(repr.ulp_control(), 0x42);
        assert_eq!(repr.buffer_len(), 14);
        let mut out = [0u8; 14];
        assert_eq!(repr.emit(&mut out), Ok(14));
        assert_eq!(out, tagged);

        // siw Send header (siw-crc-rping.pcap frame 8).
        let untagged = [0x41, 0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0];
        let (repr, len) = HeaderRepr::parse(&untagged).unwrap();
        assert_eq!(len, 18);
        assert!(!repr.is_tagged() && repr.last());
        let mut out = [0u8; 18];
        assert_eq!(repr.emit(&mut out), Ok(18));
        assert_eq!(out, untagged);
    }

    #[test]
    fn parse_any_version_keeps_headers_with_a_bad_dv() {
        let mut bytes = [0u8; 18];
        bytes[0] = 0x43; // untagged, last, DV = 3
        assert_eq!(HeaderRepr::parse(&bytes), Err(WireError::DdpBadVersion(3)));
        let (repr, len) = HeaderRepr::parse_any_version(&bytes).unwrap();
        assert_eq!(len, 18);
        assert!(repr.last());
        // A copy reported back (e.g. in a Terminate) keeps the DV that was received.
        let mut out = [0u8; 18];
        assert_eq!(repr.emit(&mut out), Ok(18));
        assert_eq!(out, bytes);
        assert!(matches!(
            HeaderRepr::parse_any_version(&bytes[..17]),
            Err(WireError::Truncated { .. })
        ));
        assert!(matches!(
            HeaderRepr::parse_any_version(&[]),
            Err(WireError::Truncated { .. })
        ));
    }
}
