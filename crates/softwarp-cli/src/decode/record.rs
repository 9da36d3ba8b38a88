//! What `softwarp decode` reports about each MPA frame and FPDU, and its one-line text form.
//!
//! The text form is the line format of `iwarp-decode` (the tshark wrapper in
//! `../shared/interop/decode.sh`), so that the two outputs can be compared line by line:
//!
//! ```text
//!      4 50638>7174   MPA-REQ   rev=2 M=0 C=1 R=0 res=0x10 pd_len=4 pd=00010001 (v2 IRD=1 ORD=1 P2P=0 RTR-flags=00)
//!      8 50638>7174   Send      T=0 L=1 QN=0 MSN=1 MO=0 payload=16 ulpdu=34 crc=good(0x398e2983)
//! ```
//!
//! Columns: the frame in which the PDU was complete, the TCP ports, the kind, then the fields.
//! Values are plain data copied out of the wire codecs' parsed forms; nothing here parses.

use std::fmt;
use std::net::SocketAddr;

/// One output line: an MPA frame, an FPDU, or an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The frame in which the PDU became complete (Wireshark's frame for it).
    pub frame: u64,
    /// The frame that carried its first byte.
    pub first_frame: u64,
    /// Connection number, in order of first appearance in the capture.
    pub connection: usize,
    /// Sender.
    pub src: SocketAddr,
    /// Receiver.
    pub dst: SocketAddr,
    /// Offset of the PDU in the sender's TCP byte stream (0 is the first byte after the SYN).
    pub stream_offset: u64,
    /// Bytes the PDU occupies in the stream (including markers, pad and CRC).
    pub wire_len: usize,
    /// The PDU exactly as it appeared in the stream (markers included); empty for errors
    /// that are not about one PDU. Not printed; kept for checks such as re-emitting.
    pub bytes: Vec<u8>,
    /// What it is.
    pub item: Item,
}

/// The three kinds of line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// An MPA Request or Reply frame.
    MpaFrame(MpaFrameRecord),
    /// An FPDU.
    Fpdu(FpduRecord),
    /// Something that could not be decoded.
    Error(ErrorRecord),
}

/// An MPA Request or Reply frame (RFC 5044 section 7.1, RFC 6581 section 3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpaFrameRecord {
    /// True for "MPA ID Req Frame", false for "MPA ID Rep Frame".
    pub request: bool,
    /// The Rev field.
    pub revision: u8,
    /// M: markers wanted.
    pub markers: bool,
    /// C: CRC wanted.
    pub crc: bool,
    /// R: rejected (Reply only).
    pub reject: bool,
    /// The five bits after M, C and R as they appear in the flags byte (siw sets 0x10 with
    /// revision 2).
    pub res: u8,
    /// The private data, including the RFC 6581 IRD/ORD words when present.
    pub private_data: Vec<u8>,
    /// RFC 6581 fields, when the frame has revision 2 and at least 4 bytes of private data.
    pub enhanced: Option<EnhancedRecord>,
}

/// RFC 6581 enhanced connection establishment fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnhancedRecord {
    /// Inbound RDMA Read queue depth.
    pub ird: u16,
    /// Outbound RDMA Read queue depth.
    pub ord: u16,
    /// Peer-to-peer mode requested.
    pub p2p: bool,
    /// Zero-length Send RTR offered/chosen.
    pub rtr_send: bool,
    /// Zero-length RDMA Write RTR offered/chosen.
    pub rtr_write: bool,
    /// Zero-length RDMA Read RTR offered/chosen.
    pub rtr_read: bool,
}

/// The CRC field of an FPDU and what we make of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrcRecord {
    /// CRC was not negotiated; `field` is what the sender put there (RFC 5044: zero).
    Off {
        /// The four CRC bytes, read big-endian (as Wireshark shows them).
        field: u32,
    },
    /// CRC negotiated and correct.
    Good {
        /// The four CRC bytes, read big-endian.
        field: u32,
    },
    /// CRC negotiated and wrong.
    Bad {
        /// The four CRC bytes, read big-endian.
        field: u32,
        /// The bytes that should have been there, read big-endian.
        expected: u32,
    },
}

/// An FPDU: MPA framing plus the DDP/RDMAP segment inside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FpduRecord {
    /// ULPDU_Length.
    pub ulpdu_len: u16,
    /// The pad bytes as received (siw leaves them dirty; receivers ignore them).
    pub pad: Vec<u8>,
    /// Number of markers removed from inside this FPDU.
    pub markers: usize,
    /// CRC verdict.
    pub crc: CrcRecord,
    /// The DDP/RDMAP segment, or why it could not be parsed.
    pub segment: Result<SegmentRecord, String>,
}

/// DDP buffer model and addressing fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Tagged buffer model.
    Tagged {
        /// Data sink STag.
        stag: u32,
        /// Data sink tagged offset.
        to: u64,
    },
    /// Untagged buffer model.
    Untagged {
        /// Queue number.
        qn: u32,
        /// Message sequence number.
        msn: u32,
        /// Message offset.
        mo: u32,
    },
}

/// An RDMA Read Request message (RFC 5040 section 4.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRequestRecord {
    /// Data sink STag.
    pub sink_stag: u32,
    /// Data sink tagged offset.
    pub sink_to: u64,
    /// RDMA Read message size.
    pub size: u32,
    /// Data source STag.
    pub src_stag: u32,
    /// Data source tagged offset.
    pub src_to: u64,
}

/// A Terminate message's control fields (RFC 5040 section 4.8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TerminateRecord {
    /// Layer.
    pub layer: u8,
    /// Error type.
    pub etype: u8,
    /// Error code.
    pub code: u8,
    /// M: the DDP segment length field is valid.
    pub m: bool,
    /// D: the terminated DDP header is included.
    pub d: bool,
    /// R: the terminated RDMAP header is included.
    pub r: bool,
    /// The reserved bits after M, D and R (13 bits).
    pub reserved: u16,
    /// True when the control bits are in Linux siw's layout rather than RFC 5040's.
    pub siw_layout: bool,
    /// The error in words, from the RFC tables (JSON only).
    pub description: String,
}

/// The DDP/RDMAP segment of an FPDU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentRecord {
    /// RDMAP opcode name (`Write`, `ReadReq`, ... as tshark's line shows them).
    pub opcode: String,
    /// DDP Last flag.
    pub last: bool,
    /// Buffer model and addressing.
    pub placement: Placement,
    /// Read Request fields, for RDMA Read Requests.
    pub read_request: Option<ReadRequestRecord>,
    /// Invalidate STag, for Send with Invalidate (and with SE).
    pub invalidate_stag: Option<u32>,
    /// Terminate control fields, for Terminate.
    pub terminate: Option<TerminateRecord>,
    /// ULPDU bytes after every header the opcode defines (for a Terminate, after the
    /// terminated headers it carries).
    pub payload_len: usize,
}

/// A decoding error for one PDU or for the rest of a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorRecord {
    /// The error, as the wire codec or the capture layer reports it.
    pub message: String,
    /// True when decoding of this direction stops here (framing is lost).
    pub fatal: bool,
}

fn bit(b: bool) -> u8 {
    u8::from(b)
}

struct Hex<'a>(&'a [u8]);

impl fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ports = format!("{}>{}", self.src.port(), self.dst.port());
        write!(f, "{:>6} {:<12} ", self.frame, ports)?;
        match &self.item {
            Item::MpaFrame(m) => write!(f, "{m}"),
            Item::Fpdu(p) => write!(f, "{p}"),
            Item::Error(e) => write!(
                f,
                "{:<9} {}{}",
                "ERROR",
                e.message,
                if e.fatal {
                    " (decoding of this direction stops)"
                } else {
                    ""
                }
            ),
        }
    }
}

impl fmt::Display for MpaFrameRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<9} rev={} M={} C={} R={} res=0x{:02x} pd_len={} pd=",
            if self.request { "MPA-REQ" } else { "MPA-REP" },
            self.revision,
            bit(self.markers),
            bit(self.crc),
            bit(self.reject),
            self.res,
            self.private_data.len(),
        )?;
        if self.private_data.is_empty() {
            f.write_str("-")?;
        } else {
            write!(f, "{}", Hex(&self.private_data))?;
        }
        if let Some(e) = &self.enhanced {
            write!(
                f,
                " (v2 IRD={} ORD={} P2P={} RTR-flags={}{})",
                e.ird,
                e.ord,
                bit(e.p2p),
                bit(e.rtr_write),
                bit(e.rtr_read)
            )?;
        }
        Ok(())
    }
}

impl fmt::Display for CrcRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Off { field } => write!(f, "crc=off(0x{field:08x})"),
            Self::Good { field } => write!(f, "crc=good(0x{field:08x})"),
            Self::Bad { field, expected } => write!(
                f,
                "crc=BAD(0x{field:08x} (Bad CRC32, should be 0x{expected:08x}))"
            ),
        }
    }
}

impl fmt::Display for FpduRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mpa = |f: &mut fmt::Formatter<'_>| -> fmt::Result {
            write!(f, "ulpdu={}", self.ulpdu_len)?;
            if !self.pad.is_empty() {
                write!(f, " pad={}", Hex(&self.pad))?;
            }
            write!(f, " {}", self.crc)
        };
        match &self.segment {
            Ok(s) => {
                write!(
                    f,
                    "{:<9} T={} L={} ",
                    s.opcode,
                    bit(matches!(s.placement, Placement::Tagged { .. })),
                    bit(s.last)
                )?;
                match s.placement {
                    Placement::Tagged { stag, to } => {
                        write!(f, "STag=0x{stag:08x} TO=0x{to:016x}")?
                    }
                    Placement::Untagged { qn, msn, mo } => write!(f, "QN={qn} MSN={msn} MO={mo}")?,
                }
                if let Some(r) = &s.read_request {
                    write!(
                        f,
                        " sink=0x{:08x}@0x{:016x} src=0x{:08x}@0x{:016x} len={}",
                        r.sink_stag, r.sink_to, r.src_stag, r.src_to, r.size
                    )?;
                }
                if let Some(inv) = s.invalidate_stag {
                    write!(f, " inv=0x{inv:08x}")?;
                }
                if let Some(t) = &s.terminate {
                    write!(
                        f,
                        " term layer=0x{:02x} etype=0x{:02x} code=0x{:02x} M/D/R={}/{}/{} rsvd=0x{:04x}",
                        t.layer,
                        t.etype,
                        t.code,
                        bit(t.m),
                        bit(t.d),
                        bit(t.r),
                        t.reserved
                    )?;
                    if t.siw_layout {
                        f.write_str(" layout=siw")?;
                    }
                }
                write!(f, " payload={} ", s.payload_len)?;
                mpa(f)
            }
            Err(e) => {
                mpa(f)?;
                write!(f, " ERROR {e}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(item: Item) -> Record {
        Record {
            frame: 8,
            first_frame: 7,
            connection: 0,
            src: "192.168.77.2:50638".parse().unwrap(),
            dst: "192.168.77.2:7174".parse().unwrap(),
            stream_offset: 24,
            wire_len: 40,
            bytes: vec![],
            item,
        }
    }

    #[test]
    fn mpa_request_line_matches_iwarp_decode() {
        let line = record(Item::MpaFrame(MpaFrameRecord {
            request: true,
            revision: 2,
            markers: false,
            crc: true,
            reject: false,
            res: 0x10,
            private_data: vec![0x80, 0x01, 0xc0, 0x01],
            enhanced: Some(EnhancedRecord {
                ird: 1,
                ord: 1,
                p2p: true,
                rtr_send: false,
                rtr_write: true,
                rtr_read: true,
            }),
        }))
        .to_string();
        assert_eq!(
            line,
            "     8 50638>7174   MPA-REQ   rev=2 M=0 C=1 R=0 res=0x10 pd_len=4 pd=8001c001 (v2 IRD=1 ORD=1 P2P=1 RTR-flags=11)"
        );
    }

    #[test]
    fn rev1_reply_without_private_data_prints_a_dash() {
        let line = record(Item::MpaFrame(MpaFrameRecord {
            request: false,
            revision: 1,
            markers: false,
            crc: false,
            reject: false,
            res: 0,
            private_data: vec![],
            enhanced: None,
        }))
        .to_string();
        assert!(line.ends_with("MPA-REP   rev=1 M=0 C=0 R=0 res=0x00 pd_len=0 pd=-"));
    }

    #[test]
    fn fpdu_lines_match_iwarp_decode_for_each_placement() {
        let read_req = record(Item::Fpdu(FpduRecord {
            ulpdu_len: 46,
            pad: vec![],
            markers: 0,
            crc: CrcRecord::Good { field: 0x1e3d_aeef },
            segment: Ok(SegmentRecord {
                opcode: "ReadReq".into(),
                last: true,
                placement: Placement::Untagged {
                    qn: 1,
                    msn: 1,
                    mo: 0,
                },
                read_request: Some(ReadRequestRecord {
                    sink_stag: 0x743e_8b00,
                    sink_to: 0x0000_560e_0e3a_0a50,
                    size: 64,
                    src_stag: 0x6b8c_ee00,
                    src_to: 0x0000_557c_5c16_6430,
                }),
                invalidate_stag: None,
                terminate: None,
                payload_len: 0,
            }),
        }));
        assert_eq!(
            read_req.to_string(),
            "     8 50638>7174   ReadReq   T=0 L=1 QN=1 MSN=1 MO=0 sink=0x743e8b00@0x0000560e0e3a0a50 src=0x6b8cee00@0x0000557c5c166430 len=64 payload=0 ulpdu=46 crc=good(0x1e3daeef)"
        );
        let write = record(Item::Fpdu(FpduRecord {
            ulpdu_len: 20,
            pad: vec![0x00, 0x40],
            markers: 0,
            crc: CrcRecord::Off { field: 0 },
            segment: Ok(SegmentRecord {
                opcode: "Write".into(),
                last: false,
                placement: Placement::Tagged {
                    stag: 0xdd21_6c00,
                    to: 0x5582_9b6c_4a50,
                },
                read_request: None,
                invalidate_stag: None,
                terminate: None,
                payload_len: 6,
            }),
        }));
        assert!(write.to_string().ends_with(
            "Write     T=1 L=0 STag=0xdd216c00 TO=0x000055829b6c4a50 payload=6 ulpdu=20 pad=0040 crc=off(0x00000000)"
        ));
    }

    #[test]
    fn terminate_and_bad_crc_lines_match_iwarp_decode() {
        let term = record(Item::Fpdu(FpduRecord {
            ulpdu_len: 38,
            pad: vec![],
            markers: 0,
            crc: CrcRecord::Bad {
                field: 0x398e_2983,
                expected: 0xb7b4_5f82,
            },
            segment: Ok(SegmentRecord {
                opcode: "Terminate".into(),
                last: true,
                placement: Placement::Untagged {
                    qn: 2,
                    msn: 1,
                    mo: 0,
                },
                read_request: None,
                invalidate_stag: None,
                terminate: Some(TerminateRecord {
                    layer: 1,
                    etype: 1,
                    code: 1,
                    m: false,
                    d: false,
                    r: false,
                    reserved: 0x0300,
                    siw_layout: false,
                    description: String::new(),
                }),
                payload_len: 0,
            }),
        }));
        assert!(term.to_string().ends_with(
            "Terminate T=0 L=1 QN=2 MSN=1 MO=0 term layer=0x01 etype=0x01 code=0x01 M/D/R=0/0/0 rsvd=0x0300 payload=0 ulpdu=38 crc=BAD(0x398e2983 (Bad CRC32, should be 0xb7b45f82))"
        ));
    }

    #[test]
    fn errors_say_whether_decoding_stops() {
        let line = record(Item::Error(ErrorRecord {
            message: "boom".into(),
            fatal: true,
        }))
        .to_string();
        assert_eq!(
            line,
            "     8 50638>7174   ERROR     boom (decoding of this direction stops)"
        );
    }
}
