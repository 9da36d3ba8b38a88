//! The RFC 7306 Atomic Request and Atomic Response headers, after the DDP untagged header.
//! No I/O here.
//!
//! ```text
//! Atomic Request (52 bytes)
//!  | Reserved (28 bits) | AtomicOp (4) |
//!  | Request Identifier (32)           |
//!  | Remote STag (32)                  |
//!  | Remote Tagged Offset (64)         |
//!  | Add or Swap Data (64)             |
//!  | Add or Swap Mask (64)             |
//!  | Compare Data (64)                 |
//!  | Compare Mask (64)                 |
//! Atomic Response (12 bytes)
//!  | Original Request Identifier (32)  |
//!  | Original Remote Data Value (64)   |
//! ```

use crate::ddp::be;
use crate::WireError;
use core::fmt;

/// Length of the Atomic Request header.
pub const ATOMIC_REQUEST_HEADER_LEN: usize = 52;

/// Length of the Atomic Response header.
pub const ATOMIC_RESPONSE_HEADER_LEN: usize = 12;

/// The four AtomicOp bits in the first word of an Atomic Request.
const MASK_ATOMIC_OPCODE: u32 = 0x0000_000f;

/// Field offsets of the Atomic Request header.
mod request_field {
    /// Reserved (28 bits) and the atomic operation code (4 bits).
    pub const OPCODE_WORD: usize = 0;
    /// Request Identifier, 32 bits.
    pub const REQUEST_ID: usize = 4;
    /// Remote STag, 32 bits.
    pub const REMOTE_STAG: usize = 8;
    /// Remote Tagged Offset, 64 bits.
    pub const REMOTE_TO: usize = 12;
    /// Add or Swap Data, 64 bits.
    pub const ADD_SWAP_DATA: usize = 20;
    /// Add or Swap Mask, 64 bits.
    pub const ADD_SWAP_MASK: usize = 28;
    /// Compare Data, 64 bits.
    pub const COMPARE_DATA: usize = 36;
    /// Compare Mask, 64 bits.
    pub const COMPARE_MASK: usize = 44;
}

/// Field offsets of the Atomic Response header.
mod response_field {
    /// Original Request Identifier, 32 bits.
    pub const REQUEST_ID: usize = 0;
    /// Original Remote Data Value, 64 bits.
    pub const ORIGINAL_VALUE: usize = 4;
}

enum_with_unknown! {
    /// The atomic operation of an Atomic Request (IANA "RDMAP Message Atomic Operation
    /// Subcodes"; 0x1 is reserved, 0x3 to 0xF unassigned).
    pub enum AtomicOpcode(u8) {
        /// FetchAdd: add to the remote 64-bit word and return its original value.
        FetchAdd = 0x0,
        /// CmpSwap: swap the remote 64-bit word if it matches, and return its original value.
        CmpSwap = 0x2,
    }
}

impl fmt::Display for AtomicOpcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AtomicOpcode::FetchAdd => f.write_str("FetchAdd"),
            AtomicOpcode::CmpSwap => f.write_str("CmpSwap"),
            AtomicOpcode::Unknown(v) => write!(f, "AtomicOp({v:#x})"),
        }
    }
}

fn truncated(what: &'static str, need: usize, have: usize) -> WireError {
    WireError::Truncated { what, need, have }
}

/// A read/write view of an Atomic Request header.
///
/// After [`AtomicRequestHeader::new_checked`] every accessor reads in bounds; an unchecked
/// view over a short buffer reads missing bytes as zero and never panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtomicRequestHeader<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> AtomicRequestHeader<T> {
    /// Wraps a buffer without checking its length.
    pub const fn new_unchecked(buffer: T) -> Self {
        AtomicRequestHeader { buffer }
    }

    /// Wraps a buffer after checking that it holds a whole Atomic Request header.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if it is shorter than [`ATOMIC_REQUEST_HEADER_LEN`].
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let have = buffer.as_ref().len();
        if have < ATOMIC_REQUEST_HEADER_LEN {
            return Err(truncated(
                "Atomic Request header",
                ATOMIC_REQUEST_HEADER_LEN,
                have,
            ));
        }
        Ok(Self::new_unchecked(buffer))
    }

    /// Returns the wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The atomic operation code (low 4 bits of the first word).
    pub fn atomic_opcode(&self) -> AtomicOpcode {
        let word = be::u32_at(self.buffer.as_ref(), request_field::OPCODE_WORD);
        // The mask keeps 4 bits, so the value always fits in a u8.
        AtomicOpcode::from((word & MASK_ATOMIC_OPCODE) as u8)
    }

    /// The 28 reserved bits of the first word, shifted down.
    pub fn reserved(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), request_field::OPCODE_WORD) >> 4
    }

    /// The Request Identifier, echoed by the Atomic Response.
    pub fn request_id(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), request_field::REQUEST_ID)
    }

    /// The Remote STag naming the buffer that holds the target word.
    pub fn remote_stag(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), request_field::REMOTE_STAG)
    }

    /// The Remote Tagged Offset of the target word.
    pub fn remote_tagged_offset(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), request_field::REMOTE_TO)
    }

    /// Add Data (FetchAdd) or Swap Data (CmpSwap).
    pub fn add_or_swap_data(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), request_field::ADD_SWAP_DATA)
    }

    /// Add Mask (FetchAdd) or Swap Mask (CmpSwap).
    pub fn add_or_swap_mask(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), request_field::ADD_SWAP_MASK)
    }

    /// Compare Data (CmpSwap).
    pub fn compare_data(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), request_field::COMPARE_DATA)
    }

    /// Compare Mask (CmpSwap).
    pub fn compare_mask(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), request_field::COMPARE_MASK)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicRequestHeader<T> {
    /// Sets the first word: reserved bits zero and the given operation code.
    ///
    /// # Errors
    /// [`WireError::InvalidField`] if the code does not fit in 4 bits.
    pub fn set_atomic_opcode(&mut self, opcode: AtomicOpcode) -> Result<(), WireError> {
        let code = u8::from(opcode);
        if u32::from(code) > MASK_ATOMIC_OPCODE {
            return Err(WireError::InvalidField {
                what: "Atomic Request header",
                field: "Atomic Operation",
                value: u64::from(code),
            });
        }
        be::set_u32(
            self.buffer.as_mut(),
            request_field::OPCODE_WORD,
            u32::from(code),
        );
        Ok(())
    }

    /// Sets the Request Identifier.
    pub fn set_request_id(&mut self, value: u32) {
        be::set_u32(self.buffer.as_mut(), request_field::REQUEST_ID, value);
    }

    /// Sets the Remote STag.
    pub fn set_remote_stag(&mut self, value: u32) {
        be::set_u32(self.buffer.as_mut(), request_field::REMOTE_STAG, value);
    }

    /// Sets the Remote Tagged Offset.
    pub fn set_remote_tagged_offset(&mut self, value: u64) {
        be::set_u64(self.buffer.as_mut(), request_field::REMOTE_TO, value);
    }

    /// Sets Add or Swap Data.
    pub fn set_add_or_swap_data(&mut self, value: u64) {
        be::set_u64(self.buffer.as_mut(), request_field::ADD_SWAP_DATA, value);
    }

    /// Sets Add or Swap Mask.
    pub fn set_add_or_swap_mask(&mut self, value: u64) {
        be::set_u64(self.buffer.as_mut(), request_field::ADD_SWAP_MASK, value);
    }

    /// Sets Compare Data.
    pub fn set_compare_data(&mut self, value: u64) {
        be::set_u64(self.buffer.as_mut(), request_field::COMPARE_DATA, value);
    }

    /// Sets Compare Mask.
    pub fn set_compare_mask(&mut self, value: u64) {
        be::set_u64(self.buffer.as_mut(), request_field::COMPARE_MASK, value);
    }
}

/// A parsed Atomic Request header.
///
/// The codec carries every field for either operation; which fields an operation uses (and
/// what an unknown [`AtomicOpcode`] deserves) is the engine's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AtomicRequestRepr {
    /// FetchAdd, CmpSwap or an unknown code.
    pub opcode: AtomicOpcode,
    /// Request Identifier, echoed by the response.
    pub request_id: u32,
    /// Remote STag of the buffer holding the target word.
    pub remote_stag: u32,
    /// Remote Tagged Offset of the target word.
    pub remote_tagged_offset: u64,
    /// Add Data or Swap Data.
    pub add_or_swap_data: u64,
    /// Add Mask or Swap Mask.
    pub add_or_swap_mask: u64,
    /// Compare Data.
    pub compare_data: u64,
    /// Compare Mask.
    pub compare_mask: u64,
}

impl AtomicRequestRepr {
    /// Parses the header at the start of `buf`; returns it and its length (52). The 28
    /// reserved bits are ignored.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if fewer than 52 bytes are present.
    pub fn parse(buf: &[u8]) -> Result<(Self, usize), WireError> {
        let view = AtomicRequestHeader::new_checked(buf)?;
        Ok((
            AtomicRequestRepr {
                opcode: view.atomic_opcode(),
                request_id: view.request_id(),
                remote_stag: view.remote_stag(),
                remote_tagged_offset: view.remote_tagged_offset(),
                add_or_swap_data: view.add_or_swap_data(),
                add_or_swap_mask: view.add_or_swap_mask(),
                compare_data: view.compare_data(),
                compare_mask: view.compare_mask(),
            },
            ATOMIC_REQUEST_HEADER_LEN,
        ))
    }

    /// The header length, [`ATOMIC_REQUEST_HEADER_LEN`].
    pub fn buffer_len(&self) -> usize {
        ATOMIC_REQUEST_HEADER_LEN
    }

    /// Writes the header at the start of `buf` (reserved bits zero); returns 52.
    ///
    /// # Errors
    /// [`WireError::BufferTooSmall`] if `buf` is shorter than 52 bytes,
    /// [`WireError::InvalidField`] if the operation code does not fit in 4 bits.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        if buf.len() < ATOMIC_REQUEST_HEADER_LEN {
            return Err(WireError::BufferTooSmall {
                what: "Atomic Request header",
                need: ATOMIC_REQUEST_HEADER_LEN,
                have: buf.len(),
            });
        }
        let mut view = AtomicRequestHeader::new_unchecked(buf);
        view.set_atomic_opcode(self.opcode)?;
        view.set_request_id(self.request_id);
        view.set_remote_stag(self.remote_stag);
        view.set_remote_tagged_offset(self.remote_tagged_offset);
        view.set_add_or_swap_data(self.add_or_swap_data);
        view.set_add_or_swap_mask(self.add_or_swap_mask);
        view.set_compare_data(self.compare_data);
        view.set_compare_mask(self.compare_mask);
        Ok(ATOMIC_REQUEST_HEADER_LEN)
    }
}

impl fmt::Display for AtomicRequestRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} id={:#x} remote={:#010x}@{:#018x} data={:#x}/{:#x} cmp={:#x}/{:#x}",
            self.opcode,
            self.request_id,
            self.remote_stag,
            self.remote_tagged_offset,
            self.add_or_swap_data,
            self.add_or_swap_mask,
            self.compare_data,
            self.compare_mask
        )
    }
}

/// A read/write view of an Atomic Response header.
///
/// After [`AtomicResponseHeader::new_checked`] every accessor reads in bounds; an unchecked
/// view over a short buffer reads missing bytes as zero and never panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtomicResponseHeader<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> AtomicResponseHeader<T> {
    /// Wraps a buffer without checking its length.
    pub const fn new_unchecked(buffer: T) -> Self {
        AtomicResponseHeader { buffer }
    }

    /// Wraps a buffer after checking that it holds a whole Atomic Response header.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if it is shorter than [`ATOMIC_RESPONSE_HEADER_LEN`].
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let have = buffer.as_ref().len();
        if have < ATOMIC_RESPONSE_HEADER_LEN {
            return Err(truncated(
                "Atomic Response header",
                ATOMIC_RESPONSE_HEADER_LEN,
                have,
            ));
        }
        Ok(Self::new_unchecked(buffer))
    }

    /// Returns the wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The Request Identifier of the Atomic Request this answers.
    pub fn original_request_id(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), response_field::REQUEST_ID)
    }

    /// The value the target word had before the operation.
    pub fn original_value(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), response_field::ORIGINAL_VALUE)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicResponseHeader<T> {
    /// Sets the Original Request Identifier.
    pub fn set_original_request_id(&mut self, value: u32) {
        be::set_u32(self.buffer.as_mut(), response_field::REQUEST_ID, value);
    }

    /// Sets the Original Remote Data Value.
    pub fn set_original_value(&mut self, value: u64) {
        be::set_u64(self.buffer.as_mut(), response_field::ORIGINAL_VALUE, value);
    }
}

/// A parsed Atomic Response header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AtomicResponseRepr {
    /// The Request Identifier of the Atomic Request this answers.
    pub original_request_id: u32,
    /// The Original Remote Data Value: the target word before the operation.
    pub original_value: u64,
}

impl AtomicResponseRepr {
    /// Parses the header at the start of `buf`; returns it and its length (12).
    ///
    /// # Errors
    /// [`WireError::Truncated`] if fewer than 12 bytes are present.
    pub fn parse(buf: &[u8]) -> Result<(Self, usize), WireError> {
        let view = AtomicResponseHeader::new_checked(buf)?;
        Ok((
            AtomicResponseRepr {
                original_request_id: view.original_request_id(),
                original_value: view.original_value(),
            },
            ATOMIC_RESPONSE_HEADER_LEN,
        ))
    }

    /// The header length, [`ATOMIC_RESPONSE_HEADER_LEN`].
    pub fn buffer_len(&self) -> usize {
        ATOMIC_RESPONSE_HEADER_LEN
    }

    /// Writes the header at the start of `buf`; returns 12.
    ///
    /// # Errors
    /// [`WireError::BufferTooSmall`] if `buf` is shorter than 12 bytes.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        if buf.len() < ATOMIC_RESPONSE_HEADER_LEN {
            return Err(WireError::BufferTooSmall {
                what: "Atomic Response header",
                need: ATOMIC_RESPONSE_HEADER_LEN,
                have: buf.len(),
            });
        }
        let mut view = AtomicResponseHeader::new_unchecked(buf);
        view.set_original_request_id(self.original_request_id);
        view.set_original_value(self.original_value);
        Ok(ATOMIC_RESPONSE_HEADER_LEN)
    }
}

impl fmt::Display for AtomicResponseRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "id={:#x} orig={:#x}",
            self.original_request_id, self.original_value
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A CmpSwap request built by hand from the RFC 7306 layout.
    const HAND_CMP_SWAP: [u8; 52] = [
        0x00, 0x00, 0x00, 0x02, // reserved, AtomicOp = CmpSwap
        0x00, 0x00, 0x00, 0x07, // Request Identifier
        0x12, 0x34, 0x56, 0x78, // Remote STag
        0x00, 0x00, 0x7f, 0x00, 0x00, 0x00, 0x10, 0x00, // Remote TO
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2a, // Swap Data
        0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, // Swap Mask
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, // Compare Data
        0xff, 0xff, 0xff, 0xff, 0x00, 0x00, 0x00, 0x00, // Compare Mask
    ];

    fn hand_cmp_swap() -> AtomicRequestRepr {
        AtomicRequestRepr {
            opcode: AtomicOpcode::CmpSwap,
            request_id: 7,
            remote_stag: 0x1234_5678,
            remote_tagged_offset: 0x0000_7f00_0000_1000,
            add_or_swap_data: 42,
            add_or_swap_mask: u64::MAX,
            compare_data: 1,
            compare_mask: 0xffff_ffff_0000_0000,
        }
    }

    #[test]
    fn atomic_opcodes_match_the_iana_registry() {
        assert_eq!(AtomicOpcode::from(0), AtomicOpcode::FetchAdd);
        assert_eq!(AtomicOpcode::from(1), AtomicOpcode::Unknown(1));
        assert_eq!(AtomicOpcode::from(2), AtomicOpcode::CmpSwap);
        assert_eq!(u8::from(AtomicOpcode::CmpSwap), 2);
        assert_eq!(AtomicOpcode::Unknown(5).to_string(), "AtomicOp(0x5)");
    }

    #[test]
    fn deconstructs_and_constructs_a_cmp_swap_request() {
        let view = AtomicRequestHeader::new_checked(&HAND_CMP_SWAP[..]).unwrap();
        assert_eq!(view.atomic_opcode(), AtomicOpcode::CmpSwap);
        assert_eq!(view.reserved(), 0);
        assert_eq!(
            AtomicRequestRepr::parse(&HAND_CMP_SWAP),
            Ok((hand_cmp_swap(), 52))
        );
        let mut out = [0xeeu8; 52];
        assert_eq!(hand_cmp_swap().emit(&mut out), Ok(52));
        assert_eq!(out, HAND_CMP_SWAP);
        assert_eq!(
            hand_cmp_swap().to_string(),
            "CmpSwap id=0x7 remote=0x12345678@0x00007f0000001000 data=0x2a/0xffffffffffffffff \
             cmp=0x1/0xffffffff00000000"
        );
    }

    #[test]
    fn reserved_bits_are_ignored_and_unknown_operations_kept() {
        let mut bytes = HAND_CMP_SWAP;
        bytes[0] = 0xff;
        bytes[3] = 0xf5;
        let (repr, _) = AtomicRequestRepr::parse(&bytes).unwrap();
        assert_eq!(repr.opcode, AtomicOpcode::Unknown(5));
        assert_eq!(
            AtomicRequestHeader::new_unchecked(&bytes[..]).reserved(),
            0x0ff0_000f
        );
        let bad = AtomicRequestRepr {
            opcode: AtomicOpcode::Unknown(0x10),
            ..hand_cmp_swap()
        };
        assert!(matches!(
            bad.emit(&mut [0u8; 52]),
            Err(WireError::InvalidField { .. })
        ));
    }

    #[test]
    fn response_round_trips() {
        let bytes = [0, 0, 0, 7, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08];
        let view = AtomicResponseHeader::new_checked(&bytes[..]).unwrap();
        assert_eq!(view.original_request_id(), 7);
        assert_eq!(view.original_value(), 0x0102_0304_0506_0708);
        let (repr, len) = AtomicResponseRepr::parse(&bytes).unwrap();
        assert_eq!(len, 12);
        assert_eq!(repr.to_string(), "id=0x7 orig=0x102030405060708");
        let mut out = [0u8; 12];
        assert_eq!(repr.emit(&mut out), Ok(12));
        assert_eq!(out, bytes);
        assert_eq!(view.into_inner().len(), 12);
    }

    #[test]
    fn every_truncation_is_rejected() {
        for len in 0..ATOMIC_REQUEST_HEADER_LEN {
            assert!(matches!(
                AtomicRequestRepr::parse(&HAND_CMP_SWAP[..len]),
                Err(WireError::Truncated { need: 52, have, .. }) if have == len
            ));
            assert!(matches!(
                hand_cmp_swap().emit(&mut vec![0u8; len]),
                Err(WireError::BufferTooSmall { need: 52, .. })
            ));
        }
        for len in 0..ATOMIC_RESPONSE_HEADER_LEN {
            assert!(matches!(
                AtomicResponseRepr::parse(&[0u8; 12][..len]),
                Err(WireError::Truncated { need: 12, have, .. }) if have == len
            ));
            assert!(matches!(
                AtomicResponseRepr::default().emit(&mut vec![0u8; len]),
                Err(WireError::BufferTooSmall { need: 12, .. })
            ));
        }
        assert_eq!(
            AtomicRequestHeader::new_unchecked(&HAND_CMP_SWAP[..10]).compare_mask(),
            0
        );
    }
}
