//! Frames out of a pcap or pcapng file held in memory.
//!
//! Frames are numbered from 1 in file order, counting every packet record (pcap) or packet
//! block (pcapng: enhanced, simple and obsolete packet blocks), exactly as Wireshark numbers
//! them, so that our output and tshark's can be compared frame by frame. No I/O here: the
//! caller reads the file.

use std::borrow::Cow;

use pcap_file::pcap::PcapParser;
use pcap_file::pcapng::{Block, PcapNgParser};
use pcap_file::PcapError;

use super::error::CaptureError;

/// Magic numbers of classic pcap (micro- and nanosecond, both byte orders) and of a pcapng
/// section header block.
const PCAP_MAGICS: [u32; 4] = [0xa1b2_c3d4, 0xd4c3_b2a1, 0xa1b2_3c4d, 0x4d3c_b2a1];
const PCAPNG_MAGIC: u32 = 0x0a0d_0d0a;

/// The link layer at the start of each frame (pcap `LINKTYPE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkType {
    /// BSD loopback: a 4-byte address family in host byte order, then IP (LINKTYPE_NULL, 0).
    Null,
    /// Ethernet II, possibly VLAN tagged (LINKTYPE_ETHERNET, 1; Linux `lo` uses it too).
    Ethernet,
    /// Raw IPv4 or IPv6 (LINKTYPE_RAW, 101).
    RawIp,
    /// OpenBSD loopback: like [`LinkType::Null`] but network byte order (LINKTYPE_LOOP, 108).
    Loop,
    /// Linux cooked capture v1, `tcpdump -i any` (LINKTYPE_LINUX_SLL, 113).
    LinuxSll,
    /// Raw IPv4 (LINKTYPE_IPV4, 228).
    Ipv4,
    /// Raw IPv6 (LINKTYPE_IPV6, 229).
    Ipv6,
    /// Linux cooked capture v2 (LINKTYPE_LINUX_SLL2, 276).
    LinuxSll2,
    /// Any other link type; frames with it are reported and skipped.
    Other(u32),
}

impl From<u32> for LinkType {
    fn from(value: u32) -> Self {
        match value {
            0 => Self::Null,
            1 => Self::Ethernet,
            101 => Self::RawIp,
            108 => Self::Loop,
            113 => Self::LinuxSll,
            228 => Self::Ipv4,
            229 => Self::Ipv6,
            276 => Self::LinuxSll2,
            other => Self::Other(other),
        }
    }
}

impl From<LinkType> for u32 {
    fn from(value: LinkType) -> Self {
        match value {
            LinkType::Null => 0,
            LinkType::Ethernet => 1,
            LinkType::RawIp => 101,
            LinkType::Loop => 108,
            LinkType::LinuxSll => 113,
            LinkType::Ipv4 => 228,
            LinkType::Ipv6 => 229,
            LinkType::LinuxSll2 => 276,
            LinkType::Other(other) => other,
        }
    }
}

/// Which container format the file uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureFormat {
    /// Classic libpcap format.
    Pcap,
    /// pcapng.
    PcapNg,
}

/// One captured frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame<'a> {
    /// 1-based frame number, as Wireshark counts.
    pub number: u64,
    /// Link layer of `data`.
    pub link: LinkType,
    /// The captured bytes, starting with the link-layer header.
    pub data: Cow<'a, [u8]>,
    /// Length of the frame on the wire (larger than `data` when the snap length cut it).
    pub original_len: u32,
}

enum Parser {
    Pcap { parser: PcapParser, link: LinkType },
    PcapNg(Box<PcapNgParser>),
}

/// Iterates over the frames of a capture held in memory.
///
/// After the first error the iterator ends: a damaged record boundary cannot be resynchronised.
pub struct CaptureReader<'a> {
    parser: Parser,
    rest: &'a [u8],
    number: u64,
    failed: bool,
}

impl std::fmt::Debug for CaptureReader<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptureReader")
            .field("format", &self.format())
            .field("frames_read", &self.number)
            .field("bytes_left", &self.rest.len())
            .finish()
    }
}

impl<'a> CaptureReader<'a> {
    /// Reads the file header of `bytes` (a whole pcap or pcapng file).
    pub fn new(bytes: &'a [u8]) -> Result<Self, CaptureError> {
        let magic = match bytes.get(..4) {
            Some(&[a, b, c, d]) => u32::from_be_bytes([a, b, c, d]),
            _ => {
                return Err(CaptureError::BadHeader(PcapError::IncompleteBuffer));
            }
        };
        let (rest, parser) = if PCAP_MAGICS.contains(&magic) {
            let (rest, parser) = PcapParser::new(bytes).map_err(CaptureError::BadHeader)?;
            let link = LinkType::from(u32::from(parser.header().datalink));
            (rest, Parser::Pcap { parser, link })
        } else if magic == PCAPNG_MAGIC {
            let (rest, parser) = PcapNgParser::new(bytes).map_err(CaptureError::BadHeader)?;
            (rest, Parser::PcapNg(Box::new(parser)))
        } else {
            return Err(CaptureError::NotACapture { magic });
        };
        Ok(Self {
            parser,
            rest,
            number: 0,
            failed: false,
        })
    }

    /// The container format of the file.
    pub fn format(&self) -> CaptureFormat {
        match self.parser {
            Parser::Pcap { .. } => CaptureFormat::Pcap,
            Parser::PcapNg(_) => CaptureFormat::PcapNg,
        }
    }

    fn record_error(&self, error: PcapError) -> CaptureError {
        match error {
            PcapError::IncompleteBuffer => CaptureError::TruncatedRecord {
                after_frame: self.number,
            },
            source => CaptureError::BadRecord {
                after_frame: self.number,
                source,
            },
        }
    }

    fn next_pcap(&mut self) -> Result<Option<Frame<'a>>, CaptureError> {
        let Parser::Pcap { parser, link } = &self.parser else {
            return Ok(None);
        };
        let link = *link;
        let (rest, packet) = parser
            .next_raw_packet(self.rest)
            .map_err(|e| self.record_error(e))?;
        self.rest = rest;
        self.number += 1;
        Ok(Some(Frame {
            number: self.number,
            link,
            data: packet.data,
            original_len: packet.orig_len,
        }))
    }

    fn next_pcapng(&mut self) -> Result<Option<Frame<'a>>, CaptureError> {
        loop {
            if self.rest.is_empty() {
                return Ok(None);
            }
            let Parser::PcapNg(parser) = &mut self.parser else {
                return Ok(None);
            };
            let (rest, block) = match parser.next_block(self.rest) {
                Ok(ok) => ok,
                Err(e) => return Err(self.record_error(e)),
            };
            self.rest = rest;
            let (interface, data, original_len) = match block {
                Block::EnhancedPacket(p) => (p.interface_id, p.data, p.original_len),
                Block::SimplePacket(p) => (0, p.data, p.original_len),
                Block::Packet(p) => (u32::from(p.interface_id), p.data, p.original_len),
                _ => continue,
            };
            let link = usize::try_from(interface)
                .ok()
                .and_then(|i| parser.interfaces().get(i))
                .map_or(LinkType::Other(u32::MAX), |idb| {
                    LinkType::from(u32::from(idb.linktype))
                });
            self.number += 1;
            return Ok(Some(Frame {
                number: self.number,
                link,
                data,
                original_len,
            }));
        }
    }
}

impl<'a> Iterator for CaptureReader<'a> {
    type Item = Result<Frame<'a>, CaptureError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.rest.is_empty() {
            return None;
        }
        let result = match self.format() {
            CaptureFormat::Pcap => self.next_pcap(),
            CaptureFormat::PcapNg => self.next_pcapng(),
        };
        match result {
            Ok(frame) => frame.map(Ok),
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A little-endian microsecond pcap header with the given link type.
    fn pcap_header(link: u32) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&0xa1b2_c3d4u32.to_le_bytes());
        v.extend_from_slice(&2u16.to_le_bytes());
        v.extend_from_slice(&4u16.to_le_bytes());
        v.extend_from_slice(&0i32.to_le_bytes());
        v.extend_from_slice(&0u32.to_le_bytes());
        v.extend_from_slice(&65535u32.to_le_bytes());
        v.extend_from_slice(&link.to_le_bytes());
        v
    }

    fn pcap_record(v: &mut Vec<u8>, data: &[u8]) {
        v.extend_from_slice(&1u32.to_le_bytes());
        v.extend_from_slice(&2u32.to_le_bytes());
        v.extend_from_slice(&(data.len() as u32).to_le_bytes());
        v.extend_from_slice(&(data.len() as u32).to_le_bytes());
        v.extend_from_slice(data);
    }

    #[test]
    fn pcap_frames_are_numbered_from_one_with_the_file_link_type() {
        let mut file = pcap_header(113);
        pcap_record(&mut file, b"first");
        pcap_record(&mut file, b"second!");
        let frames: Vec<_> = CaptureReader::new(&file)
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[0].number, 1);
        assert_eq!(&*frames[0].data, b"first");
        assert_eq!(frames[1].number, 2);
        assert_eq!(frames[1].link, LinkType::LinuxSll);
        assert_eq!(&*frames[1].data, b"second!");
    }

    #[test]
    fn pcap_cut_inside_a_record_reports_truncation_after_the_last_whole_frame() {
        let mut file = pcap_header(1);
        pcap_record(&mut file, b"whole");
        pcap_record(&mut file, b"cut short");
        file.truncate(file.len() - 3);
        let mut reader = CaptureReader::new(&file).unwrap();
        assert!(reader.next().unwrap().is_ok());
        match reader.next() {
            Some(Err(CaptureError::TruncatedRecord { after_frame: 1 })) => {}
            other => panic!("unexpected {other:?}"),
        }
        assert!(reader.next().is_none());
    }

    #[test]
    fn unknown_magic_is_not_a_capture() {
        assert!(matches!(
            CaptureReader::new(b"GET / HTTP/1.1\r\n"),
            Err(CaptureError::NotACapture { magic: 0x4745_5420 })
        ));
        assert!(matches!(
            CaptureReader::new(b"ab"),
            Err(CaptureError::BadHeader(_))
        ));
    }

    #[test]
    fn pcapng_enhanced_packets_carry_their_interface_link_type() {
        fn block(v: &mut Vec<u8>, kind: u32, body: &[u8]) {
            let len = 12 + body.len() as u32;
            v.extend_from_slice(&kind.to_le_bytes());
            v.extend_from_slice(&len.to_le_bytes());
            v.extend_from_slice(body);
            v.extend_from_slice(&len.to_le_bytes());
        }
        let mut file = Vec::new();
        let mut shb = Vec::new();
        shb.extend_from_slice(&0x1a2b_3c4du32.to_le_bytes());
        shb.extend_from_slice(&1u16.to_le_bytes());
        shb.extend_from_slice(&0u16.to_le_bytes());
        shb.extend_from_slice(&(-1i64).to_le_bytes());
        block(&mut file, 0x0a0d_0d0a, &shb);
        let mut idb = Vec::new();
        idb.extend_from_slice(&101u16.to_le_bytes());
        idb.extend_from_slice(&0u16.to_le_bytes());
        idb.extend_from_slice(&0u32.to_le_bytes());
        block(&mut file, 1, &idb);
        let mut epb = Vec::new();
        epb.extend_from_slice(&0u32.to_le_bytes());
        epb.extend_from_slice(&0u32.to_le_bytes());
        epb.extend_from_slice(&0u32.to_le_bytes());
        epb.extend_from_slice(&4u32.to_le_bytes());
        epb.extend_from_slice(&4u32.to_le_bytes());
        epb.extend_from_slice(b"abcd");
        block(&mut file, 6, &epb);
        let reader = CaptureReader::new(&file).unwrap();
        assert_eq!(reader.format(), CaptureFormat::PcapNg);
        let frames: Vec<_> = reader.collect::<Result<_, _>>().unwrap();
        assert_eq!(frames.len(), 1);
        assert_eq!(frames[0].number, 1);
        assert_eq!(frames[0].link, LinkType::RawIp);
        assert_eq!(&*frames[0].data, b"abcd");
    }

    #[test]
    fn link_type_numbers_round_trip() {
        for n in [0u32, 1, 101, 108, 113, 228, 229, 276, 12345] {
            assert_eq!(u32::from(LinkType::from(n)), n);
        }
    }
}
