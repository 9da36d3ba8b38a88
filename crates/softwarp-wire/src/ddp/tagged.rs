//! The RFC 5041 tagged buffer model header (14 bytes). No I/O here.

use super::{be, check_version, control_byte, FLAG_LAST, FLAG_TAGGED, MASK_RESERVED, MASK_VERSION};
use super::{field as common, TAGGED_HEADER_LEN};
use crate::WireError;
use core::fmt;

/// Field offsets of the tagged header.
mod field {
    /// Data Sink STag, 32 bits.
    pub const STAG: usize = 2;
    /// Data Sink Tagged Offset, 64 bits.
    pub const TO: usize = 6;
    /// First payload byte.
    pub const PAYLOAD: usize = 14;
}

/// A read/write view of a tagged DDP segment (header and payload).
///
/// Build it with [`TaggedHeader::new_checked`]: afterwards every accessor reads in bounds.
/// A view built with [`TaggedHeader::new_unchecked`] over a short buffer reads missing bytes
/// as zero and drops writes past the end; it never panics either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaggedHeader<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> TaggedHeader<T> {
    /// Wraps a buffer without checking its length.
    pub const fn new_unchecked(buffer: T) -> Self {
        TaggedHeader { buffer }
    }

    /// Wraps a buffer after checking that it holds a whole tagged header.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if the buffer is shorter than [`TAGGED_HEADER_LEN`].
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let view = Self::new_unchecked(buffer);
        view.check_len()?;
        Ok(view)
    }

    /// Checks that the buffer holds a whole tagged header.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if the buffer is shorter than [`TAGGED_HEADER_LEN`].
    pub fn check_len(&self) -> Result<(), WireError> {
        let have = self.buffer.as_ref().len();
        if have < TAGGED_HEADER_LEN {
            Err(WireError::Truncated {
                what: "DDP tagged header",
                need: TAGGED_HEADER_LEN,
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

    /// The T flag (1 for a well-formed tagged segment).
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

    /// The byte reserved for the ULP (RDMAP's control byte).
    pub fn ulp_control(&self) -> u8 {
        be::u8_at(self.buffer.as_ref(), common::ULP_CONTROL)
    }

    /// The Data Sink STag.
    pub fn stag(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), field::STAG)
    }

    /// The Data Sink Tagged Offset.
    pub fn tagged_offset(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), field::TO)
    }

    /// The bytes after the header.
    pub fn payload(&self) -> &[u8] {
        be::tail(self.buffer.as_ref(), field::PAYLOAD)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> TaggedHeader<T> {
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

    /// Sets the byte reserved for the ULP.
    pub fn set_ulp_control(&mut self, value: u8) {
        be::set_u8(self.buffer.as_mut(), common::ULP_CONTROL, value);
    }

    /// Sets the Data Sink STag.
    pub fn set_stag(&mut self, value: u32) {
        be::set_u32(self.buffer.as_mut(), field::STAG, value);
    }

    /// Sets the Data Sink Tagged Offset.
    pub fn set_tagged_offset(&mut self, value: u64) {
        be::set_u64(self.buffer.as_mut(), field::TO, value);
    }

    /// The bytes after the header, writable.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        be::tail_mut(self.buffer.as_mut(), field::PAYLOAD)
    }
}

/// A parsed tagged buffer model header.
///
/// The reserved bits are not stored (zero on emit). DV is stored so that a received header
/// can be copied back unchanged (a Terminate reports the header of the segment in error, whose
/// DV may be the error); [`TaggedRepr::parse`] only accepts DV = [`super::DDP_VERSION`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TaggedRepr {
    /// The L flag: last segment of the DDP message.
    pub last: bool,
    /// DV, the DDP version: [`super::DDP_VERSION`] in everything we originate.
    pub version: u8,
    /// The byte reserved for the ULP (RDMAP's control byte).
    pub ulp_control: u8,
    /// Data Sink STag: names the tagged buffer.
    pub stag: u32,
    /// Data Sink Tagged Offset: where in that buffer this segment's payload goes.
    pub tagged_offset: u64,
}

impl Default for TaggedRepr {
    /// All fields zero except DV, which is [`super::DDP_VERSION`].
    fn default() -> Self {
        TaggedRepr {
            last: false,
            version: super::DDP_VERSION,
            ulp_control: 0,
            stag: 0,
            tagged_offset: 0,
        }
    }
}

impl TaggedRepr {
    pub(crate) fn from_view<T: AsRef<[u8]>>(view: &TaggedHeader<T>) -> Self {
        TaggedRepr {
            last: view.last_flag(),
            version: view.version(),
            ulp_control: view.ulp_control(),
            stag: view.stag(),
            tagged_offset: view.tagged_offset(),
        }
    }

    /// Parses a tagged header from the start of `segment`; returns it and its length (14).
    ///
    /// # Errors
    /// [`WireError::Truncated`] if fewer than 14 bytes are present,
    /// [`WireError::InvalidField`] if the T flag is clear, [`WireError::DdpBadVersion`] if DV
    /// is not 1.
    pub fn parse(segment: &[u8]) -> Result<(Self, usize), WireError> {
        let view = TaggedHeader::new_checked(segment)?;
        if !view.tagged_flag() {
            return Err(WireError::InvalidField {
                what: "DDP tagged header",
                field: "T",
                value: 0,
            });
        }
        check_version(be::u8_at(segment, common::CONTROL))?;
        Ok((Self::from_view(&view), TAGGED_HEADER_LEN))
    }

    /// The header length, [`TAGGED_HEADER_LEN`].
    pub fn buffer_len(&self) -> usize {
        TAGGED_HEADER_LEN
    }

    /// Writes the header at the start of `buf`; returns the bytes written (14).
    ///
    /// # Errors
    /// [`WireError::BufferTooSmall`] if `buf` is shorter than 14 bytes.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        if buf.len() < TAGGED_HEADER_LEN {
            return Err(WireError::BufferTooSmall {
                what: "DDP tagged header",
                need: TAGGED_HEADER_LEN,
                have: buf.len(),
            });
        }
        be::set_u8(
            buf,
            common::CONTROL,
            control_byte(true, self.last, self.version),
        );
        let mut view = TaggedHeader::new_unchecked(buf);
        view.set_ulp_control(self.ulp_control);
        view.set_stag(self.stag);
        view.set_tagged_offset(self.tagged_offset);
        Ok(TAGGED_HEADER_LEN)
    }
}

impl fmt::Display for TaggedRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "T=1 L={} STag={:#010x} TO={:#018x}",
            u8::from(self.last),
            self.stag,
            self.tagged_offset
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// siw's Read Response header from siw-crc-rping.pcap frame 10: T=1 L=1 DV=1, RDMAP
    /// control 0x42 (RV=1, opcode 2), STag 0x743e8b00, TO 0x0000560e0e3a0a50.
    const SIW_READ_RESPONSE: [u8; 14] = [
        0xc1, 0x42, 0x74, 0x3e, 0x8b, 0x00, 0x00, 0x00, 0x56, 0x0e, 0x0e, 0x3a, 0x0a, 0x50,
    ];

    #[test]
    fn deconstructs_the_siw_read_response_header() {
        let view = TaggedHeader::new_checked(&SIW_READ_RESPONSE[..]).unwrap();
        assert!(view.tagged_flag());
        assert!(view.last_flag());
        assert_eq!(view.reserved(), 0);
        assert_eq!(view.version(), 1);
        assert_eq!(view.ulp_control(), 0x42);
        assert_eq!(view.stag(), 0x743e_8b00);
        assert_eq!(view.tagged_offset(), 0x0000_560e_0e3a_0a50);
        assert!(view.payload().is_empty());
        let (repr, len) = TaggedRepr::parse(&SIW_READ_RESPONSE).unwrap();
        assert_eq!(len, 14);
        assert_eq!(
            repr,
            TaggedRepr {
                version: crate::ddp::DDP_VERSION,
                last: true,
                ulp_control: 0x42,
                stag: 0x743e_8b00,
                tagged_offset: 0x0000_560e_0e3a_0a50,
            }
        );
        assert_eq!(
            repr.to_string(),
            "T=1 L=1 STag=0x743e8b00 TO=0x0000560e0e3a0a50"
        );
    }

    #[test]
    fn constructs_the_siw_read_response_header() {
        let repr = TaggedRepr {
            version: crate::ddp::DDP_VERSION,
            last: true,
            ulp_control: 0x42,
            stag: 0x743e_8b00,
            tagged_offset: 0x0000_560e_0e3a_0a50,
        };
        let mut buf = [0xffu8; 16];
        assert_eq!(repr.emit(&mut buf), Ok(14));
        assert_eq!(buf[..14], SIW_READ_RESPONSE);
        assert_eq!(buf[14..], [0xff, 0xff], "emit writes only the header");
    }

    #[test]
    fn setters_write_every_field_and_keep_the_others() {
        let mut buf = [0u8; 20];
        let mut view = TaggedHeader::new_checked(&mut buf[..]).unwrap();
        view.set_tagged_flag(true);
        view.set_last_flag(true);
        view.set_reserved(0xf);
        view.set_version(1);
        view.set_ulp_control(0x40);
        view.set_stag(0x0102_0304);
        view.set_tagged_offset(0x1112_1314_1516_1718);
        view.payload_mut().copy_from_slice(&[9; 6]);
        assert_eq!(view.reserved(), 0xf);
        view.set_reserved(0);
        view.set_last_flag(false);
        assert!(!view.last_flag() && view.tagged_flag());
        assert_eq!(view.version(), 1);
        assert_eq!(view.payload(), &[9; 6]);
        assert_eq!(
            buf,
            [
                0x81, 0x40, 1, 2, 3, 4, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 9, 9, 9, 9,
                9, 9
            ]
        );
    }

    #[test]
    fn every_truncation_is_rejected() {
        for len in 0..TAGGED_HEADER_LEN {
            assert_eq!(
                TaggedRepr::parse(&SIW_READ_RESPONSE[..len]),
                Err(WireError::Truncated {
                    what: "DDP tagged header",
                    need: 14,
                    have: len
                })
            );
            let mut out = vec![0u8; len];
            assert!(matches!(
                TaggedRepr::default().emit(&mut out),
                Err(WireError::BufferTooSmall { need: 14, .. })
            ));
        }
    }

    #[test]
    fn impossible_values_are_rejected() {
        let mut bytes = SIW_READ_RESPONSE;
        bytes[0] = 0x41; // T = 0
        assert_eq!(
            TaggedRepr::parse(&bytes),
            Err(WireError::InvalidField {
                what: "DDP tagged header",
                field: "T",
                value: 0
            })
        );
        for dv in [0u8, 2, 3] {
            bytes[0] = 0xc0 | dv;
            assert_eq!(TaggedRepr::parse(&bytes), Err(WireError::DdpBadVersion(dv)));
        }
        // Reserved bits are ignored by the receiver.
        bytes[0] = 0xfd;
        assert!(TaggedRepr::parse(&bytes).is_ok());
    }

    #[test]
    fn unchecked_view_over_a_short_buffer_reads_zero_and_never_panics() {
        let mut short = [0xc1u8, 0x42, 0x74];
        let mut view = TaggedHeader::new_unchecked(&mut short[..]);
        assert!(view.check_len().is_err());
        assert_eq!(view.stag(), 0);
        assert_eq!(view.tagged_offset(), 0);
        view.set_tagged_offset(7);
        assert!(view.payload().is_empty());
        assert!(view.payload_mut().is_empty());
        assert_eq!(view.into_inner(), &[0xc1, 0x42, 0x74]);
    }
}
