//! The RFC 5040 RDMA Read Request header (section 4.4): 28 bytes after the DDP untagged
//! header. No I/O here.

use crate::ddp::be;
use crate::WireError;
use core::fmt;

/// Length of the RDMA Read Request header.
pub const READ_REQUEST_HEADER_LEN: usize = 28;

/// Field offsets of the Read Request header (from the end of the DDP header).
mod field {
    /// Data Sink STag, 32 bits.
    pub const SINK_STAG: usize = 0;
    /// Data Sink Tagged Offset, 64 bits.
    pub const SINK_TO: usize = 4;
    /// RDMA Read Message Size, 32 bits.
    pub const READ_SIZE: usize = 12;
    /// Data Source STag, 32 bits.
    pub const SOURCE_STAG: usize = 16;
    /// Data Source Tagged Offset, 64 bits.
    pub const SOURCE_TO: usize = 20;
}

/// A read/write view of an RDMA Read Request header.
///
/// After [`ReadRequestHeader::new_checked`] every accessor reads in bounds; an unchecked view
/// over a short buffer reads missing bytes as zero and never panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRequestHeader<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> ReadRequestHeader<T> {
    /// Wraps a buffer without checking its length.
    pub const fn new_unchecked(buffer: T) -> Self {
        ReadRequestHeader { buffer }
    }

    /// Wraps a buffer after checking that it holds a whole Read Request header.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if the buffer is shorter than [`READ_REQUEST_HEADER_LEN`].
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let view = Self::new_unchecked(buffer);
        view.check_len()?;
        Ok(view)
    }

    /// Checks that the buffer holds a whole Read Request header.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if the buffer is shorter than [`READ_REQUEST_HEADER_LEN`].
    pub fn check_len(&self) -> Result<(), WireError> {
        let have = self.buffer.as_ref().len();
        if have < READ_REQUEST_HEADER_LEN {
            Err(WireError::Truncated {
                what: "RDMA Read Request header",
                need: READ_REQUEST_HEADER_LEN,
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

    /// Data Sink STag: the requester's buffer the Read Response will be placed in.
    pub fn sink_stag(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), field::SINK_STAG)
    }

    /// Data Sink Tagged Offset.
    pub fn sink_tagged_offset(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), field::SINK_TO)
    }

    /// RDMA Read Message Size, in bytes.
    pub fn read_size(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), field::READ_SIZE)
    }

    /// Data Source STag: the responder's buffer to read.
    pub fn source_stag(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), field::SOURCE_STAG)
    }

    /// Data Source Tagged Offset.
    pub fn source_tagged_offset(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), field::SOURCE_TO)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ReadRequestHeader<T> {
    /// Sets the Data Sink STag.
    pub fn set_sink_stag(&mut self, value: u32) {
        be::set_u32(self.buffer.as_mut(), field::SINK_STAG, value);
    }

    /// Sets the Data Sink Tagged Offset.
    pub fn set_sink_tagged_offset(&mut self, value: u64) {
        be::set_u64(self.buffer.as_mut(), field::SINK_TO, value);
    }

    /// Sets the RDMA Read Message Size.
    pub fn set_read_size(&mut self, value: u32) {
        be::set_u32(self.buffer.as_mut(), field::READ_SIZE, value);
    }

    /// Sets the Data Source STag.
    pub fn set_source_stag(&mut self, value: u32) {
        be::set_u32(self.buffer.as_mut(), field::SOURCE_STAG, value);
    }

    /// Sets the Data Source Tagged Offset.
    pub fn set_source_tagged_offset(&mut self, value: u64) {
        be::set_u64(self.buffer.as_mut(), field::SOURCE_TO, value);
    }
}

/// A parsed RDMA Read Request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ReadRequestRepr {
    /// Data Sink STag: where the requester wants the data.
    pub sink_stag: u32,
    /// Data Sink Tagged Offset.
    pub sink_tagged_offset: u64,
    /// RDMA Read Message Size in bytes.
    pub read_size: u32,
    /// Data Source STag: what the requester wants to read.
    pub source_stag: u32,
    /// Data Source Tagged Offset.
    pub source_tagged_offset: u64,
}

impl ReadRequestRepr {
    /// Parses the header at the start of `buf` (the bytes after the DDP untagged header);
    /// returns it and its length (28). Whether STags, offsets and size are acceptable is the
    /// engine's decision (RFC 5042), not the codec's.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if fewer than 28 bytes are present.
    pub fn parse(buf: &[u8]) -> Result<(Self, usize), WireError> {
        //= https://www.rfc-editor.org/rfc/rfc5040#section-4
        //# The RDMA Read
        //# Request carries the Data Sink and Data Source buffer descriptions,
        //# including buffer length.
        let view = ReadRequestHeader::new_checked(buf)?;
        Ok((
            ReadRequestRepr {
                sink_stag: view.sink_stag(),
                sink_tagged_offset: view.sink_tagged_offset(),
                read_size: view.read_size(),
                source_stag: view.source_stag(),
                source_tagged_offset: view.source_tagged_offset(),
            },
            READ_REQUEST_HEADER_LEN,
        ))
    }

    /// The header length, [`READ_REQUEST_HEADER_LEN`].
    pub fn buffer_len(&self) -> usize {
        READ_REQUEST_HEADER_LEN
    }

    /// Writes the header at the start of `buf`; returns the bytes written (28).
    ///
    /// # Errors
    /// [`WireError::BufferTooSmall`] if `buf` is shorter than 28 bytes.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        if buf.len() < READ_REQUEST_HEADER_LEN {
            return Err(WireError::BufferTooSmall {
                what: "RDMA Read Request header",
                need: READ_REQUEST_HEADER_LEN,
                have: buf.len(),
            });
        }
        let mut view = ReadRequestHeader::new_unchecked(buf);
        view.set_sink_stag(self.sink_stag);
        view.set_sink_tagged_offset(self.sink_tagged_offset);
        view.set_read_size(self.read_size);
        view.set_source_stag(self.source_stag);
        view.set_source_tagged_offset(self.source_tagged_offset);
        Ok(READ_REQUEST_HEADER_LEN)
    }
}

impl fmt::Display for ReadRequestRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "sink={:#010x}@{:#018x} src={:#010x}@{:#018x} len={}",
            self.sink_stag,
            self.sink_tagged_offset,
            self.source_stag,
            self.source_tagged_offset,
            self.read_size
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The Read Request header siw sent in siw-crc-rping.pcap frame 9:
    /// sink=0x743e8b00@0x0000560e0e3a0a50 src=0x6b8cee00@0x0000557c5c166430 len=64.
    const SIW_READ_REQUEST: [u8; 28] = [
        0x74, 0x3e, 0x8b, 0x00, // Data Sink STag
        0x00, 0x00, 0x56, 0x0e, 0x0e, 0x3a, 0x0a, 0x50, // Data Sink TO
        0x00, 0x00, 0x00, 0x40, // RDMA Read Message Size
        0x6b, 0x8c, 0xee, 0x00, // Data Source STag
        0x00, 0x00, 0x55, 0x7c, 0x5c, 0x16, 0x64, 0x30, // Data Source TO
    ];

    fn siw_repr() -> ReadRequestRepr {
        ReadRequestRepr {
            sink_stag: 0x743e_8b00,
            sink_tagged_offset: 0x0000_560e_0e3a_0a50,
            read_size: 64,
            source_stag: 0x6b8c_ee00,
            source_tagged_offset: 0x0000_557c_5c16_6430,
        }
    }

    #[test]
    fn deconstructs_the_siw_read_request() {
        let view = ReadRequestHeader::new_checked(&SIW_READ_REQUEST[..]).unwrap();
        assert_eq!(view.sink_stag(), 0x743e_8b00);
        assert_eq!(view.sink_tagged_offset(), 0x0000_560e_0e3a_0a50);
        assert_eq!(view.read_size(), 64);
        assert_eq!(view.source_stag(), 0x6b8c_ee00);
        assert_eq!(view.source_tagged_offset(), 0x0000_557c_5c16_6430);
        assert_eq!(
            ReadRequestRepr::parse(&SIW_READ_REQUEST),
            Ok((siw_repr(), 28))
        );
        assert_eq!(
            siw_repr().to_string(),
            "sink=0x743e8b00@0x0000560e0e3a0a50 src=0x6b8cee00@0x0000557c5c166430 len=64"
        );
    }

    #[test]
    fn constructs_the_siw_read_request() {
        let mut buf = [0xaau8; 30];
        assert_eq!(siw_repr().emit(&mut buf), Ok(28));
        assert_eq!(buf[..28], SIW_READ_REQUEST);
        assert_eq!(buf[28..], [0xaa, 0xaa]);
        assert_eq!(siw_repr().buffer_len(), 28);
    }

    #[test]
    fn every_truncation_is_rejected() {
        for len in 0..READ_REQUEST_HEADER_LEN {
            assert_eq!(
                ReadRequestRepr::parse(&SIW_READ_REQUEST[..len]),
                Err(WireError::Truncated {
                    what: "RDMA Read Request header",
                    need: 28,
                    have: len
                })
            );
            let mut out = vec![0u8; len];
            assert!(matches!(
                siw_repr().emit(&mut out),
                Err(WireError::BufferTooSmall { need: 28, .. })
            ));
        }
    }

    #[test]
    fn extreme_values_survive_the_round_trip() {
        let repr = ReadRequestRepr {
            sink_stag: u32::MAX,
            sink_tagged_offset: u64::MAX,
            read_size: u32::MAX,
            source_stag: 0,
            source_tagged_offset: 1,
        };
        let mut buf = [0u8; 28];
        repr.emit(&mut buf).unwrap();
        assert_eq!(ReadRequestRepr::parse(&buf), Ok((repr, 28)));
        let view = ReadRequestHeader::new_unchecked(&buf[..3]);
        assert!(view.check_len().is_err());
        assert_eq!(view.source_tagged_offset(), 0);
        assert_eq!(view.into_inner().len(), 3);
    }
}
