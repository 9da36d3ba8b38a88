//! The RFC 7306 Immediate Data message body: 8 bytes of data after the DDP untagged header.
//! No I/O here.
//!
//! The 8 bytes are opaque to RDMAP and are kept as bytes; a view type would add nothing over
//! the array itself.

use crate::WireError;
use core::fmt;

/// Length of the Immediate Data carried by an Immediate Data message.
pub const IMMEDIATE_DATA_LEN: usize = 8;

/// The body of an Immediate Data (or Immediate Data with Solicited Event) message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ImmediateDataRepr {
    /// The 8 bytes of Immediate Data, in wire order.
    pub data: [u8; IMMEDIATE_DATA_LEN],
}

impl ImmediateDataRepr {
    /// Parses the 8 bytes at the start of `buf`; returns them and their length (8).
    ///
    /// # Errors
    /// [`WireError::Truncated`] if fewer than 8 bytes are present.
    pub fn parse(buf: &[u8]) -> Result<(Self, usize), WireError> {
        match buf.get(..IMMEDIATE_DATA_LEN) {
            Some(bytes) => {
                let mut data = [0u8; IMMEDIATE_DATA_LEN];
                data.copy_from_slice(bytes);
                Ok((ImmediateDataRepr { data }, IMMEDIATE_DATA_LEN))
            }
            None => Err(WireError::Truncated {
                what: "Immediate Data",
                need: IMMEDIATE_DATA_LEN,
                have: buf.len(),
            }),
        }
    }

    /// The encoded length, [`IMMEDIATE_DATA_LEN`].
    pub fn buffer_len(&self) -> usize {
        IMMEDIATE_DATA_LEN
    }

    /// Writes the 8 bytes at the start of `buf`; returns 8.
    ///
    /// # Errors
    /// [`WireError::BufferTooSmall`] if `buf` is shorter than 8 bytes.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        let have = buf.len();
        match buf.get_mut(..IMMEDIATE_DATA_LEN) {
            Some(dst) => {
                dst.copy_from_slice(&self.data);
                Ok(IMMEDIATE_DATA_LEN)
            }
            None => Err(WireError::BufferTooSmall {
                what: "Immediate Data",
                need: IMMEDIATE_DATA_LEN,
                have,
            }),
        }
    }

    /// The data read as a big-endian integer.
    pub fn as_u64(&self) -> u64 {
        u64::from_be_bytes(self.data)
    }
}

impl fmt::Display for ImmediateDataRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "imm=0x")?;
        for byte in self.data {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn round_trips_eight_bytes() {
        let bytes = [1u8, 2, 3, 4, 5, 6, 7, 8, 9];
        let (repr, len) = ImmediateDataRepr::parse(&bytes).unwrap();
        assert_eq!(len, 8);
        assert_eq!(repr.data, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(repr.as_u64(), 0x0102_0304_0506_0708);
        assert_eq!(repr.to_string(), "imm=0x0102030405060708");
        let mut out = [0u8; 8];
        assert_eq!(repr.emit(&mut out), Ok(8));
        assert_eq!(out, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(repr.buffer_len(), 8);
    }

    #[test]
    fn every_truncation_is_rejected() {
        let bytes = [0u8; 8];
        for len in 0..8 {
            assert_eq!(
                ImmediateDataRepr::parse(&bytes[..len]),
                Err(WireError::Truncated {
                    what: "Immediate Data",
                    need: 8,
                    have: len
                })
            );
            let mut out = vec![0u8; len];
            assert!(matches!(
                ImmediateDataRepr::default().emit(&mut out),
                Err(WireError::BufferTooSmall { need: 8, .. })
            ));
        }
    }
}
