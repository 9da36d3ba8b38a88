//! The DDP/RDMAP segment inside an FPDU, as a [`SegmentRecord`], through `softwarp-wire`'s
//! combined parser ([`Segment::parse`]). No I/O here.

use softwarp_wire::ddp::UNTAGGED_HEADER_LEN;
use softwarp_wire::rdmap::{self, Message, Segment, TerminateHeader, TerminateLayout};
use softwarp_wire::WireError;

use super::record::{Placement, ReadRequestRecord, SegmentRecord, TerminateRecord};

/// Parses one ULPDU and copies out what a decode line shows.
pub(crate) fn segment_record(ulpdu: &[u8]) -> Result<SegmentRecord, WireError> {
    let segment = Segment::parse(ulpdu)?;
    let placement = match segment.placement {
        rdmap::Placement::Tagged {
            stag,
            tagged_offset,
        } => Placement::Tagged {
            stag,
            to: tagged_offset,
        },
        rdmap::Placement::Untagged { msn, mo } => Placement::Untagged {
            qn: segment.queue_number().unwrap_or_default(),
            msn,
            mo,
        },
    };
    let read_request = match segment.message {
        Message::RdmaReadRequest(r) => Some(ReadRequestRecord {
            sink_stag: r.sink_stag,
            sink_to: r.sink_tagged_offset,
            size: r.read_size,
            src_stag: r.source_stag,
            src_to: r.source_tagged_offset,
        }),
        _ => None,
    };
    let terminate = match segment.message {
        Message::Terminate(t) => {
            // The raw control fields in the layout the parser detected (RFC 5040 or siw's).
            let header = TerminateHeader::new_checked(
                ulpdu.get(UNTAGGED_HEADER_LEN..).unwrap_or_default(),
                t.layout,
            )?;
            Some(TerminateRecord {
                layer: header.layer(),
                etype: header.etype(),
                code: header.error_code(),
                m: header.flag_m(),
                d: header.flag_d(),
                r: header.flag_r(),
                reserved: header.reserved(),
                siw_layout: t.layout == TerminateLayout::LinuxSiw,
                description: t.error.to_string(),
            })
        }
        _ => None,
    };
    Ok(SegmentRecord {
        opcode: segment.opcode().short_name().to_string(),
        last: segment.last,
        placement,
        read_request,
        invalidate_stag: segment.message.invalidate_stag(),
        terminate,
        payload_len: segment.payload.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn siw_terminate_is_read_in_siw_layout() {
        // The ULPDU of frame 11 of siw-terminate-rping.pcap: untagged header (QN 2, MSN 1),
        // Terminate control `11 01 03 00`, DDP segment length 0x0080, the offending tagged
        // header.
        let ulpdu: [u8; 38] = [
            0x41, 0x47, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x01,
            0x00, 0x00, 0x00, 0x00, 0x11, 0x01, 0x03, 0x00, 0x00, 0x80, 0xc1, 0x42, 0x7a, 0xf0,
            0x9b, 0x00, 0x00, 0x00, 0x55, 0x8a, 0x6c, 0x3b, 0xba, 0x50,
        ];
        let rec = segment_record(&ulpdu).unwrap();
        assert_eq!(rec.opcode, "Terminate");
        assert_eq!(rec.payload_len, 0);
        let t = rec.terminate.unwrap();
        assert!(t.siw_layout);
        assert_eq!((t.layer, t.etype, t.code), (1, 1, 1));
        assert!(t.m && t.d && !t.r);
        assert_eq!(t.reserved, 0);
    }

    #[test]
    fn invalid_queue_number_is_the_codecs_typed_error() {
        let mut ulpdu = [0u8; 34];
        ulpdu[0] = 0x41;
        ulpdu[1] = 0x43;
        ulpdu[9] = 0xff; // QN 255
        assert_eq!(
            segment_record(&ulpdu),
            Err(WireError::DdpInvalidQueueNumber(255))
        );
    }
}
