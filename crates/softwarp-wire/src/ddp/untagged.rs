//! The RFC 5041 untagged buffer model header (18 bytes). No I/O here.

use super::{be, check_version, control_byte, FLAG_LAST, FLAG_TAGGED, MASK_RESERVED, MASK_VERSION};
use super::{field as common, UNTAGGED_HEADER_LEN};
use crate::WireError;
use core::fmt;

/// Field offsets of the untagged header.
mod field {
    /// Bits 8..39 of RsvdULP (RDMAP: the Invalidate STag, or reserved).
    pub const ULP_RESERVED: usize = 2;
    /// Queue Number, 32 bits.
    pub const QN: usize = 6;
    /// Message Sequence Number, 32 bits.
    pub const MSN: usize = 10;
    /// Message Offset, 32 bits.
    pub const MO: usize = 14;
    /// First payload byte.
    pub const PAYLOAD: usize = 18;
}

/// A read/write view of an untagged DDP segment (header and payload).
///
/// Build it with [`UntaggedHeader::new_checked`]: afterwards every accessor reads in
/// bounds. A view built with [`UntaggedHeader::new_unchecked`] over a short buffer reads
/// missing bytes as zero and drops writes past the end; it never panics either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UntaggedHeader<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> UntaggedHeader<T> {
    /// Wraps a buffer without checking its length.
    pub const fn new_unchecked(buffer: T) -> Self {
        UntaggedHeader { buffer }
    }

    /// Wraps a buffer after checking that it holds a whole untagged header.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if the buffer is shorter than [`UNTAGGED_HEADER_LEN`].
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let view = Self::new_unchecked(buffer);
        view.check_len()?;
        Ok(view)
    }

    /// Checks that the buffer holds a whole untagged header.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if the buffer is shorter than [`UNTAGGED_HEADER_LEN`].
    pub fn check_len(&self) -> Result<(), WireError> {
        let have = self.buffer.as_ref().len();
        if have < UNTAGGED_HEADER_LEN {
            Err(WireError::Truncated {
                what: "DDP untagged header",
                need: UNTAGGED_HEADER_LEN,
                have,
            })
        } else {
            Ok(())
        }
    }

    /// Returns the wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The T flag (0 for a well-formed untagged segment).
    pub fn tagged_flag(&self) -> bool {
        be::u8_at(self.buffer.as_ref(), common::CONTROL) & FLAG_TAGGED != 0
    }

    /// The L flag: this is the last segment of its DDP message.
    pub fn last_flag(&self) -> bool {
        be::u8_at(self.buffer.as_ref(), common::CONTROL) & FLAG_LAST != 0
    }

    /// The four reserved bits of the control byte, shifted down.
    pub fn reserved(&self) -> u8 {
        (be::u8_at(self.buffer.as_ref(), common::CONTROL) & MASK_RESERVED) >> 2
    }

    /// The DDP version (DV).
    pub fn version(&self) -> u8 {
        be::u8_at(self.buffer.as_ref(), common::CONTROL) & MASK_VERSION
    }

    /// The first byte reserved for the ULP (RDMAP's control byte).
    pub fn ulp_control(&self) -> u8 {
        be::u8_at(self.buffer.as_ref(), common::ULP_CONTROL)
    }

    /// The 32 bits reserved for the ULP after its control byte (RDMAP: Invalidate STag).
    pub fn ulp_reserved(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), field::ULP_RESERVED)
    }

    /// The Queue Number (QN).
    pub fn queue_number(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), field::QN)
    }

    /// The Message Sequence Number (MSN).
    pub fn msn(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), field::MSN)
    }

    /// The Message Offset (MO).
    pub fn mo(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), field::MO)
    }

    /// The bytes after the header.
    pub fn payload(&self) -> &[u8] {
        be::tail(self.buffer.as_ref(), field::PAYLOAD)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> UntaggedHeader<T> {
    fn set_control_bit(&mut self, mask: u8, on: bool) {
        let buf = self.buffer.as_mut();
        let byte = be::u8_at(buf, common::CONTROL);
        be::set_u8(
            buf,
            common::CONTROL,
            if on { byte | mask } else { byte & !mask },
        );
    }

    /// Sets the T flag.
    pub fn set_tagged_flag(&mut self, on: bool) {
        self.set_control_bit(FLAG_TAGGED, on);
    }

    /// Sets the L flag.
    pub fn set_last_flag(&mut self, on: bool) {
        self.set_control_bit(FLAG_LAST, on);
    }

    /// Sets the four reserved bits (only the low four bits of `value` are used).
    pub fn set_reserved(&mut self, value: u8) {
        let buf = self.buffer.as_mut();
        let byte = be::u8_at(buf, common::CONTROL) & !MASK_RESERVED;
        be::set_u8(buf, common::CONTROL, byte | ((value << 2) & MASK_RESERVED));
    }

    /// Sets DV (only the low two bits of `value` are used).
    pub fn set_version(&mut self, value: u8) {
        let buf = self.buffer.as_mut();
        let byte = be::u8_at(buf, common::CONTROL) & !MASK_VERSION;
        be::set_u8(buf, common::CONTROL, byte | (value & MASK_VERSION));
    }

    /// Sets the first byte reserved for the ULP.
    pub fn set_ulp_control(&mut self, value: u8) {
        be::set_u8(self.buffer.as_mut(), common::ULP_CONTROL, value);
    }

    /// Sets the 32 bits reserved for the ULP after its control byte.
    pub fn set_ulp_reserved(&mut self, value: u32) {
        be::set_u32(self.buffer.as_mut(), field::ULP_RESERVED, value);
    }

    /// Sets the Queue Number.
    pub fn set_queue_number(&mut self, value: u32) {
        be::set_u32(self.buffer.as_mut(), field::QN, value);
    }

    /// Sets the Message Sequence Number.
    pub fn set_msn(&mut self, value: u32) {
        be::set_u32(self.buffer.as_mut(), field::MSN, value);
    }

    /// Sets the Message Offset.
    pub fn set_mo(&mut self, value: u32) {
        be::set_u32(self.buffer.as_mut(), field::MO, value);
    }

    /// The bytes after the header, writable.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        be::tail_mut(self.buffer.as_mut(), field::PAYLOAD)
    }
}

/// A parsed untagged buffer model header.
///
/// The reserved bits are not stored (zero on emit). DV is stored so that a received header
/// can be copied back unchanged (a Terminate reports the header of the segment in error, whose
/// DV may be the error); [`UntaggedRepr::parse`] only accepts DV = [`super::DDP_VERSION`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UntaggedRepr {
    /// The L flag: last segment of the DDP message.
    pub last: bool,
    /// DV, the DDP version: [`super::DDP_VERSION`] in everything we originate.
    pub version: u8,
    /// The first byte reserved for the ULP (RDMAP's control byte).
    pub ulp_control: u8,
    /// The 32 bits reserved for the ULP after its control byte (RDMAP: Invalidate STag).
    pub ulp_reserved: u32,
    /// Queue Number: which untagged buffer queue of the stream receives the message.
    pub queue_number: u32,
    /// Message Sequence Number within that queue (the first message is 1).
    pub msn: u32,
    /// Message Offset: where in the message this segment's payload starts.
    pub mo: u32,
}

impl Default for UntaggedRepr {
    /// All fields zero except DV, which is [`super::DDP_VERSION`].
    fn default() -> Self {
        UntaggedRepr {
            last: false,
            version: super::DDP_VERSION,
            ulp_control: 0,
            ulp_reserved: 0,
            queue_number: 0,
            msn: 0,
            mo: 0,
        }
    }
}

impl UntaggedRepr {
    pub(crate) fn from_view<T: AsRef<[u8]>>(view: &UntaggedHeader<T>) -> Self {
        UntaggedRepr {
            last: view.last_flag(),
            version: view.version(),
            ulp_control: view.ulp_control(),
            ulp_reserved: view.ulp_reserved(),
            queue_number: view.queue_number(),
            msn: view.msn(),
            mo: view.mo(),
        }
    }

    /// Parses an untagged header from the start of `segment`; returns it and its length
    /// (18). Any QN is accepted here: which queues exist is the ULP's business.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if fewer than 18 bytes are present,
    /// [`WireError::InvalidField`] if the T flag is set, [`WireError::DdpBadVersion`] if DV is
    /// not 1.
    pub fn parse(segment: &[u8]) -> Result<(Self, usize), WireError> {
        let view = UntaggedHeader::new_checked(segment)?;
        if view.tagged_flag() {
            return Err(WireError::InvalidField {
                what: "DDP untagged header",
                field: "T",
                value: 1,
            });
        }
        check_version(be::u8_at(segment, common::CONTROL))?;
        Ok((Self::from_view(&view), UNTAGGED_HEADER_LEN))
    }

    /// The header length, [`UNTAGGED_HEADER_LEN`].
    pub fn buffer_len(&self) -> usize {
        UNTAGGED_HEADER_LEN
    }

    /// Writes the header at the start of `buf`; returns the bytes written (18).
    ///
    /// # Errors
    /// [`WireError::BufferTooSmall`] if `buf` is shorter than 18 bytes.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        if buf.len() < UNTAGGED_HEADER_LEN {
            return Err(WireError::BufferTooSmall {
                what: "DDP untagged header",
                need: UNTAGGED_HEADER_LEN,
                have: buf.len(),
            });
        }
        be::set_u8(
            buf,
            common::CONTROL,
            control_byte(false, self.last, self.version),
        );
        let mut view = UntaggedHeader::new_unchecked(buf);
        view.set_ulp_control(self.ulp_control);
        view.set_ulp_reserved(self.ulp_reserved);
        view.set_queue_number(self.queue_number);
        view.set_msn(self.msn);
        view.set_mo(self.mo);
        Ok(UNTAGGED_HEADER_LEN)
    }
}

impl fmt::Display for UntaggedRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "T=0 L={} QN={} MSN={} MO={}",
            u8::from(self.last),
            self.queue_number,
            self.msn,
            self.mo
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// siw's Send header from siw-crc-rping.pcap frame 8: T=0 L=1 DV=1, RDMAP control 0x43
    /// (RV=1, opcode 3 Send), reserved 0, QN=0 MSN=1 MO=0.
    const SIW_SEND: [u8; 18] = [0x41, 0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0];

    /// A Send with Invalidate header built by hand from RFC 5041's untagged layout: not last,
    /// RDMAP control 0x44, Invalidate STag 0xa1b2c3d4, QN 0, MSN 0x01020304, MO 0x00001000.
    const HAND_SEND_INVALIDATE: [u8; 18] = [
        0x01, 0x44, 0xa1, 0xb2, 0xc3, 0xd4, 0, 0, 0, 0, 1, 2, 3, 4, 0, 0, 0x10, 0,
    ];

    #[test]
    fn deconstructs_the_siw_send_header() {
        let mut segment = SIW_SEND.to_vec();
        segment.extend_from_slice(b"payload");
        let view = UntaggedHeader::new_checked(&segment[..]).unwrap();
        assert!(!view.tagged_flag());
        assert!(view.last_flag());
        assert_eq!(view.reserved(), 0);
        assert_eq!(view.version(), 1);
        assert_eq!(view.ulp_control(), 0x43);
        assert_eq!(view.ulp_reserved(), 0);
        assert_eq!(view.queue_number(), 0);
        assert_eq!(view.msn(), 1);
        assert_eq!(view.mo(), 0);
        assert_eq!(view.payload(), b"payload");
        let (repr, len) = UntaggedRepr::parse(&segment).unwrap();
        assert_eq!(len, 18);
        assert_eq!(
            repr,
            UntaggedRepr {
                version: crate::ddp::DDP_VERSION,
                last: true,
                ulp_control: 0x43,
                ulp_reserved: 0,
                queue_number: 0,
                msn: 1,
                mo: 0,
            }
        );
        assert_eq!(repr.to_string(), "T=0 L=1 QN=0 MSN=1 MO=0");
    }

    #[test]
    fn round_trips_a_hand_built_send_with_invalidate_header() {
        let (repr, _) = UntaggedRepr::parse(&HAND_SEND_INVALIDATE).unwrap();
        assert_eq!(
            repr,
            UntaggedRepr {
                version: crate::ddp::DDP_VERSION,
                last: false,
                ulp_control: 0x44,
                ulp_reserved: 0xa1b2_c3d4,
                queue_number: 0,
                msn: 0x0102_0304,
                mo: 0x1000,
            }
        );
        let mut out = [0u8; 18];
        assert_eq!(repr.emit(&mut out), Ok(18));
        assert_eq!(out, HAND_SEND_INVALIDATE);
    }

    #[test]
    fn setters_write_every_field() {
        let mut buf = [0u8; 19];
        let mut view = UntaggedHeader::new_checked(&mut buf[..]).unwrap();
        view.set_tagged_flag(true);
        view.set_tagged_flag(false);
        view.set_last_flag(true);
        view.set_reserved(0x5);
        view.set_version(3);
        view.set_ulp_control(0x47);
        view.set_ulp_reserved(0x0a0b_0c0d);
        view.set_queue_number(2);
        view.set_msn(0x0102_0304);
        view.set_mo(0x0506_0708);
        view.payload_mut()[0] = 0xee;
        assert_eq!(view.reserved(), 5);
        assert_eq!(view.version(), 3);
        assert_eq!(
            buf,
            [0x57, 0x47, 0x0a, 0x0b, 0x0c, 0x0d, 0, 0, 0, 2, 1, 2, 3, 4, 5, 6, 7, 8, 0xee]
        );
    }

    #[test]
    fn every_truncation_is_rejected() {
        for len in 0..UNTAGGED_HEADER_LEN {
            assert_eq!(
                UntaggedRepr::parse(&SIW_SEND[..len]),
                Err(WireError::Truncated {
                    what: "DDP untagged header",
                    need: 18,
                    have: len
                })
            );
            let mut out = vec![0u8; len];
            assert!(matches!(
                UntaggedRepr::default().emit(&mut out),
                Err(WireError::BufferTooSmall { need: 18, .. })
            ));
        }
    }

    #[test]
    fn impossible_values_are_rejected() {
        let mut bytes = SIW_SEND;
        bytes[0] = 0xc1; // T = 1
        assert_eq!(
            UntaggedRepr::parse(&bytes),
            Err(WireError::InvalidField {
                what: "DDP untagged header",
                field: "T",
                value: 1
            })
        );
        for dv in [0u8, 2, 3] {
            bytes[0] = 0x40 | dv;
            assert_eq!(
                UntaggedRepr::parse(&bytes),
                Err(WireError::DdpBadVersion(dv))
            );
        }
    }

    #[test]
    fn unchecked_view_over_a_short_buffer_reads_zero_and_never_panics() {
        let view = UntaggedHeader::new_unchecked(&SIW_SEND[..9]);
        assert!(view.check_len().is_err());
        assert_eq!(view.msn(), 0);
        assert_eq!(view.mo(), 0);
        assert!(view.payload().is_empty());
    }
}
