//! Known-answer tests for whole ULPDUs: real siw segments from the interop captures and
//! segments built by hand from the RFC layouts.

#![allow(clippy::unwrap_used)]

use super::*;
use crate::rdmap::{
    AtomicOpcode, DdpError, TaggedBufferError, TerminateError, TerminateLayout,
    TerminatedRdmapHeader,
};

/// The 64-byte payload rping sends (siw-crc-rping.pcap frames 10 and 13).
const RPING_PAYLOAD: &[u8; 64] =
    b"rdma-ping-0: ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqr\0";

/// siw-crc-rping.pcap frame 8: a Send, T=0 L=1 QN=0 MSN=1 MO=0, 16 bytes of payload.
const SIW_SEND: [u8; 34] = [
    0x41, 0x43, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00,
    0x00, 0x00, // DDP untagged header
    0x00, 0x00, 0x55, 0x7c, 0x5c, 0x16, 0x64, 0x30, 0x6b, 0x8c, 0xee, 0x00, 0x00, 0x00, 0x00,
    0x40, // payload
];

/// siw-crc-rping.pcap frame 9: an RDMA Read Request, QN=1 MSN=1,
/// sink=0x743e8b00@0x0000560e0e3a0a50 src=0x6b8cee00@0x0000557c5c166430 len=64.
const SIW_READ_REQUEST: [u8; 46] = [
    0x41, 0x41, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00,
    0x00, 0x00, // DDP untagged header
    0x74, 0x3e, 0x8b, 0x00, 0x00, 0x00, 0x56, 0x0e, 0x0e, 0x3a, 0x0a, 0x50, 0x00, 0x00, 0x00, 0x40,
    0x6b, 0x8c, 0xee, 0x00, 0x00, 0x00, 0x55, 0x7c, 0x5c, 0x16, 0x64, 0x30,
];

/// siw-crc-rping.pcap frame 10 (header): an RDMA Read Response, T=1 L=1
/// STag=0x743e8b00 TO=0x0000560e0e3a0a50; the payload is [`RPING_PAYLOAD`].
const SIW_READ_RESPONSE_HEADER: [u8; 14] = [
    0xc1, 0x42, 0x74, 0x3e, 0x8b, 0x00, 0x00, 0x00, 0x56, 0x0e, 0x0e, 0x3a, 0x0a, 0x50,
];

/// siw-crc-rping.pcap frame 13 (header): an RDMA Write, T=1 L=1 STag=0xb5b2ab00
/// TO=0x0000557c5c162a50; the payload is [`RPING_PAYLOAD`].
const SIW_WRITE_HEADER: [u8; 14] = [
    0xc1, 0x40, 0xb5, 0xb2, 0xab, 0x00, 0x00, 0x00, 0x55, 0x7c, 0x5c, 0x16, 0x2a, 0x50,
];

/// siw-terminate-rping.pcap frame 11: a Terminate in siw's layout, QN=2 MSN=1.
const SIW_TERMINATE: [u8; 38] = [
    0x41, 0x47, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00,
    0x00, 0x00, // DDP untagged header
    0x11, 0x01, 0x03, 0x00, 0x00, 0x80, // Terminate Control (siw), DDP Segment Length 128
    0xc1, 0x42, 0x7a, 0xf0, 0x9b, 0x00, 0x00, 0x00, 0x55, 0x8a, 0x6c, 0x3b, 0xba, 0x50,
];

fn with_payload(header: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut v = header.to_vec();
    v.extend_from_slice(payload);
    v
}

/// Parses, checks emit_header and emit reproduce the bytes, and returns the segment.
fn parse_and_reemit(ulpdu: &[u8]) -> Segment<'_> {
    let segment = Segment::parse(ulpdu).unwrap();
    assert_eq!(segment.buffer_len(), ulpdu.len());
    let mut header = vec![0u8; segment.header_len()];
    assert_eq!(segment.emit_header(&mut header), Ok(segment.header_len()));
    assert_eq!(header, ulpdu[..segment.header_len()]);
    let mut whole = vec![0u8; ulpdu.len()];
    assert_eq!(segment.emit(&mut whole), Ok(ulpdu.len()));
    assert_eq!(whole, ulpdu);
    segment
}

#[test]
fn parses_the_siw_send() {
    let s = parse_and_reemit(&SIW_SEND);
    assert_eq!(
        s,
        Segment {
            last: true,
            placement: Placement::Untagged { msn: 1, mo: 0 },
            message: Message::Send,
            payload: &SIW_SEND[18..],
        }
    );
    assert_eq!(s.opcode(), Opcode::Send);
    assert_eq!(s.queue_number(), Some(0));
    assert_eq!(s.header_len(), 18);
    assert_eq!(s.to_string(), "Send T=0 L=1 QN=0 MSN=1 MO=0 payload=16");
}

#[test]
fn parses_the_siw_read_request() {
    let s = parse_and_reemit(&SIW_READ_REQUEST);
    assert_eq!(
        s.message,
        Message::RdmaReadRequest(ReadRequestRepr {
            sink_stag: 0x743e_8b00,
            sink_tagged_offset: 0x0000_560e_0e3a_0a50,
            read_size: 64,
            source_stag: 0x6b8c_ee00,
            source_tagged_offset: 0x0000_557c_5c16_6430,
        })
    );
    assert_eq!(s.placement, Placement::Untagged { msn: 1, mo: 0 });
    assert!(s.payload.is_empty());
    assert_eq!(s.queue_number(), Some(1));
    assert_eq!(s.header_len(), 46);
    assert_eq!(
        s.to_string(),
        "ReadReq T=0 L=1 QN=1 MSN=1 MO=0 sink=0x743e8b00@0x0000560e0e3a0a50 \
         src=0x6b8cee00@0x0000557c5c166430 len=64 payload=0"
    );
}

#[test]
fn parses_the_siw_read_response() {
    let ulpdu = with_payload(&SIW_READ_RESPONSE_HEADER, RPING_PAYLOAD);
    let s = parse_and_reemit(&ulpdu);
    assert_eq!(
        s,
        Segment {
            last: true,
            placement: Placement::Tagged {
                stag: 0x743e_8b00,
                tagged_offset: 0x0000_560e_0e3a_0a50,
            },
            message: Message::RdmaReadResponse,
            payload: RPING_PAYLOAD,
        }
    );
    assert_eq!(s.queue_number(), None);
    assert_eq!(
        s.to_string(),
        "ReadResp T=1 L=1 STag=0x743e8b00 TO=0x0000560e0e3a0a50 payload=64"
    );
}

#[test]
fn parses_the_siw_write() {
    let ulpdu = with_payload(&SIW_WRITE_HEADER, RPING_PAYLOAD);
    let s = parse_and_reemit(&ulpdu);
    assert_eq!(s.message, Message::RdmaWrite);
    assert_eq!(
        s.placement,
        Placement::Tagged {
            stag: 0xb5b2_ab00,
            tagged_offset: 0x0000_557c_5c16_2a50
        }
    );
    assert_eq!(
        s.to_string(),
        "Write T=1 L=1 STag=0xb5b2ab00 TO=0x0000557c5c162a50 payload=64"
    );
}

#[test]
fn parses_the_siw_terminate() {
    let s = parse_and_reemit(&SIW_TERMINATE);
    let Message::Terminate(t) = s.message else {
        panic!("not a Terminate: {s:?}");
    };
    assert_eq!(t.layout, TerminateLayout::LinuxSiw);
    assert_eq!(
        t.error,
        TerminateError::Ddp(DdpError::TaggedBuffer(
            TaggedBufferError::BaseOrBoundsViolation
        ))
    );
    assert_eq!(t.ddp_segment_length, Some(128));
    assert_eq!(t.rdmap_header, TerminatedRdmapHeader::Absent);
    assert_eq!(s.queue_number(), Some(2));
    assert_eq!(
        s.to_string(),
        "Terminate T=0 L=1 QN=2 MSN=1 MO=0 DDP tagged buffer error: base or bounds violation \
         (1/1/0x01) M=1 D=1 R=0 seglen=128 hdr=[T=1 L=1 STag=0x7af09b00 \
         TO=0x0000558a6c3bba50 ReadResp] layout=siw payload=0"
    );
}

#[test]
fn round_trips_hand_built_rfc_7306_and_invalidate_segments() {
    let untagged = |msn| Placement::Untagged { msn, mo: 0 };
    let cases = [
        (
            Segment {
                last: true,
                placement: untagged(7),
                message: Message::SendWithSolicitedEventAndInvalidate {
                    invalidate_stag: 0xfeed_f00d,
                },
                payload: b"hi",
            },
            vec![
                0x41, 0x46, 0xfe, 0xed, 0xf0, 0x0d, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, b'h', b'i',
            ],
            "SendSEInv T=0 L=1 QN=0 MSN=7 MO=0 inv=0xfeedf00d payload=2",
        ),
        (
            Segment {
                last: false,
                placement: Placement::Untagged { msn: 2, mo: 1024 },
                message: Message::SendWithSolicitedEvent,
                payload: b"",
            },
            vec![0x01, 0x45, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 4, 0],
            "SendSE T=0 L=0 QN=0 MSN=2 MO=1024 payload=0",
        ),
        (
            Segment {
                last: true,
                placement: untagged(3),
                message: Message::ImmediateDataWithSolicitedEvent(ImmediateDataRepr {
                    data: [1, 2, 3, 4, 5, 6, 7, 8],
                }),
                payload: b"",
            },
            vec![
                0x41, 0x49, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8,
            ],
            "ImmDataSE T=0 L=1 QN=0 MSN=3 MO=0 imm=0x0102030405060708 payload=0",
        ),
        (
            Segment {
                last: true,
                placement: untagged(1),
                message: Message::AtomicResponse(AtomicResponseRepr {
                    original_request_id: 9,
                    original_value: 0x1122,
                }),
                payload: b"",
            },
            vec![
                0x41, 0x4b, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0,
                0, 0, 0x11, 0x22,
            ],
            "AtomicResp T=0 L=1 QN=3 MSN=1 MO=0 id=0x9 orig=0x1122 payload=0",
        ),
    ];
    for (segment, bytes, line) in cases {
        assert_eq!(Segment::parse(&bytes), Ok(segment), "{line}");
        assert_eq!(parse_and_reemit(&bytes), segment);
        assert_eq!(segment.to_string(), line);
    }

    let fetch_add = Segment {
        last: true,
        placement: untagged(1),
        message: Message::AtomicRequest(AtomicRequestRepr {
            opcode: AtomicOpcode::FetchAdd,
            request_id: 1,
            remote_stag: 0x100,
            remote_tagged_offset: 0x2000,
            add_or_swap_data: 5,
            add_or_swap_mask: 0,
            compare_data: 0,
            compare_mask: 0,
        }),
        payload: b"",
    };
    let mut buf = [0u8; 70];
    assert_eq!(fetch_add.emit_header(&mut buf), Ok(70));
    assert_eq!(
        buf[..18],
        [0x41, 0x4a, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0]
    );
    assert_eq!(Segment::parse(&buf), Ok(fetch_add));
    assert_eq!(fetch_add.queue_number(), Some(1));
}

#[test]
fn validation_errors_come_in_layer_order() {
    let mut bad = SIW_SEND;
    bad[0] = 0x42; // DV = 2
    bad[1] = 0x03; // and RV = 0: DDP is checked first
    assert_eq!(Segment::parse(&bad), Err(WireError::DdpBadVersion(2)));

    let mut bad = SIW_SEND;
    bad[9] = 4; // QN 4
    bad[1] = 0x03; // and RV = 0: the queue is DDP's, checked first
    assert_eq!(
        Segment::parse(&bad),
        Err(WireError::DdpInvalidQueueNumber(4))
    );

    let mut bad = SIW_SEND;
    bad[1] = 0x83; // RV = 2
    assert_eq!(Segment::parse(&bad), Err(WireError::RdmapBadVersion(2)));

    for opcode in 0xc..=0xf {
        let mut bad = SIW_SEND;
        bad[1] = 0x40 | opcode;
        assert_eq!(
            Segment::parse(&bad),
            Err(WireError::RdmapUnknownOpcode(opcode))
        );
    }

    let mut bad = SIW_SEND;
    bad[9] = 1; // a Send on the Read Request queue
    assert_eq!(
        Segment::parse(&bad),
        Err(WireError::RdmapOpcodeMismatch {
            opcode: 3,
            tagged: false,
            queue: 1
        })
    );
    let mut bad = SIW_SEND;
    bad[1] = 0x40; // an RDMA Write in an untagged segment
    assert_eq!(
        Segment::parse(&bad),
        Err(WireError::RdmapOpcodeMismatch {
            opcode: 0,
            tagged: false,
            queue: 0
        })
    );
    let mut bad = with_payload(&SIW_READ_RESPONSE_HEADER, RPING_PAYLOAD);
    bad[1] = 0x43; // a Send in a tagged segment
    assert_eq!(
        Segment::parse(&bad),
        Err(WireError::RdmapOpcodeMismatch {
            opcode: 3,
            tagged: true,
            queue: 0
        })
    );
}

#[test]
fn control_messages_must_be_one_whole_segment() {
    let mut bad = SIW_READ_REQUEST;
    bad[17] = 4; // MO = 4
    assert_eq!(
        Segment::parse(&bad),
        Err(WireError::InvalidField {
            what: "RDMA Read Request",
            field: "MO",
            value: 4
        })
    );
    let mut bad = SIW_READ_REQUEST;
    bad[0] = 0x01; // L = 0
    assert_eq!(
        Segment::parse(&bad),
        Err(WireError::InvalidField {
            what: "RDMA Read Request",
            field: "L",
            value: 0
        })
    );
    let long = with_payload(&SIW_READ_REQUEST, &[0, 0]);
    assert_eq!(
        Segment::parse(&long),
        Err(WireError::TrailingBytes {
            what: "RDMA Read Request",
            extra: 2
        })
    );
    // A Send may carry anything after its header; a Send split over segments is fine.
    let mut split = SIW_SEND;
    split[0] = 0x01;
    split[17] = 16;
    assert!(Segment::parse(&split).is_ok());
}

#[test]
fn every_truncation_is_rejected() {
    let read_response = with_payload(&SIW_READ_RESPONSE_HEADER, RPING_PAYLOAD);
    for ulpdu in [
        &SIW_SEND[..],
        &SIW_READ_REQUEST[..],
        &SIW_TERMINATE[..],
        &read_response[..],
    ] {
        let header_len = Segment::parse(ulpdu).unwrap().header_len();
        for len in 0..ulpdu.len() {
            let got = Segment::parse(&ulpdu[..len]);
            if len >= header_len {
                // Only the payload was cut: still a valid (shorter) segment.
                assert_eq!(got.map(|s| s.payload.len()), Ok(len - header_len));
            } else {
                assert!(
                    matches!(got, Err(WireError::Truncated { .. })),
                    "len {len}: {got:?}"
                );
            }
        }
    }
}

#[test]
fn emit_header_rejects_what_parse_would_reject() {
    let send = Segment::parse(&SIW_SEND).unwrap();
    for len in 0..18 {
        let mut out = vec![0u8; len];
        assert_eq!(
            send.emit_header(&mut out),
            Err(WireError::BufferTooSmall {
                what: "RDMAP segment header",
                need: 18,
                have: len
            })
        );
    }
    let mut out = [0u8; 100];
    assert!(matches!(
        send.emit(&mut out[..20]),
        Err(WireError::BufferTooSmall {
            what: "RDMAP segment",
            need: 34,
            ..
        })
    ));

    let tagged_send = Segment {
        placement: Placement::Tagged {
            stag: 1,
            tagged_offset: 0,
        },
        ..send
    };
    assert_eq!(
        tagged_send.emit_header(&mut out),
        Err(WireError::RdmapOpcodeMismatch {
            opcode: 3,
            tagged: true,
            queue: 0
        })
    );
    let untagged_write = Segment {
        message: Message::RdmaWrite,
        ..send
    };
    assert!(matches!(
        untagged_write.emit_header(&mut out),
        Err(WireError::RdmapOpcodeMismatch { opcode: 0, .. })
    ));

    let read_request = Segment::parse(&SIW_READ_REQUEST).unwrap();
    let with_data = Segment {
        payload: b"x",
        ..read_request
    };
    assert!(matches!(
        with_data.emit_header(&mut out),
        Err(WireError::InvalidField {
            field: "payload",
            ..
        })
    ));
    let not_last = Segment {
        last: false,
        ..read_request
    };
    assert!(matches!(
        not_last.emit_header(&mut out),
        Err(WireError::InvalidField { field: "L", .. })
    ));
    let split = Segment {
        placement: Placement::Untagged { msn: 1, mo: 28 },
        ..read_request
    };
    assert!(matches!(
        split.emit_header(&mut out),
        Err(WireError::InvalidField { field: "MO", .. })
    ));
}

#[test]
fn message_accessors_describe_each_variant() {
    let inv = Message::SendWithInvalidate {
        invalidate_stag: 0x42,
    };
    assert_eq!(inv.invalidate_stag(), Some(0x42));
    assert_eq!(inv.opcode(), Opcode::SendWithInvalidate);
    assert!(!inv.is_control());
    assert_eq!(Message::Send.invalidate_stag(), None);
    assert_eq!(Message::RdmaWrite.header_len(), 0);
    let imm = Message::ImmediateData(ImmediateDataRepr::default());
    assert!(imm.is_control());
    assert_eq!(imm.header_len(), 8);
    assert_eq!(imm.opcode(), Opcode::ImmediateData);
    assert_eq!(Message::Send.to_string(), "");
}

#[test]
fn a_known_peer_can_force_the_terminate_layout() {
    // siw's "RDMAP remote operation error: invalid RDMAP version" has no flags and reads
    // validly in RFC order too (LLP, MPA, local catastrophic): detection picks RFC order.
    let mut bytes = SIW_TERMINATE[..22].to_vec();
    bytes[18..22].copy_from_slice(&[0x20, 0x05, 0x00, 0x00]);
    let detected = Segment::parse(&bytes).unwrap();
    let Message::Terminate(t) = detected.message else {
        panic!("not a Terminate");
    };
    assert_eq!(t.layout, TerminateLayout::Rfc5040);
    assert_eq!(
        t.error,
        TerminateError::Llp(crate::rdmap::LlpError::Mpa(
            crate::rdmap::MpaError::LocalCatastrophic
        ))
    );
    let forced = Segment::parse_with_terminate_layout(&bytes, TerminateLayout::LinuxSiw).unwrap();
    let Message::Terminate(t) = forced.message else {
        panic!("not a Terminate");
    };
    assert_eq!(
        t.error,
        TerminateError::Rdmap(crate::rdmap::RdmapError::RemoteOperation(
            crate::rdmap::RemoteOperationError::InvalidRdmapVersion
        ))
    );
    // Other messages are not affected by the layout.
    assert_eq!(
        Segment::parse_with_terminate_layout(&SIW_SEND, TerminateLayout::LinuxSiw),
        Segment::parse(&SIW_SEND)
    );
}

#[test]
fn parses_the_siw_zero_length_write_rtr() {
    // siw-p2p-rping.pcap frame 8: the MPA v2 ready-to-receive, a zero-length RDMA Write to
    // STag 1, TO 0 (siw uses STag 1 because hardware rejected STag 0).
    let rtr = [
        0xc1, 0x40, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    ];
    let s = parse_and_reemit(&rtr);
    assert_eq!(
        s,
        Segment {
            last: true,
            placement: Placement::Tagged {
                stag: 1,
                tagged_offset: 0
            },
            message: Message::RdmaWrite,
            payload: &[],
        }
    );
    assert_eq!(
        s.to_string(),
        "Write T=1 L=1 STag=0x00000001 TO=0x0000000000000000 payload=0"
    );
}

#[test]
fn parses_siw_messages_split_over_three_segments() {
    // siw-ib_write_bw.pcap: a 4096-byte RDMA Write as 1428 + 1428 + 1240 bytes, only the
    // last with L = 1, each placed at its own TO.
    let write_headers: [([u8; 14], usize); 3] = [
        (
            [
                0x81, 0x40, 0xa3, 0x05, 0xc4, 0x00, 0x00, 0x00, 0x56, 0x38, 0x3c, 0xe3, 0xf0, 0x00,
            ],
            1428,
        ),
        (
            [
                0x81, 0x40, 0xa3, 0x05, 0xc4, 0x00, 0x00, 0x00, 0x56, 0x38, 0x3c, 0xe3, 0xf5, 0x94,
            ],
            1428,
        ),
        (
            [
                0xc1, 0x40, 0xa3, 0x05, 0xc4, 0x00, 0x00, 0x00, 0x56, 0x38, 0x3c, 0xe3, 0xfb, 0x28,
            ],
            1240,
        ),
    ];
    let mut next_to = 0x0000_5638_3ce3_f000u64;
    for (i, (header, len)) in write_headers.iter().enumerate() {
        let ulpdu = with_payload(header, &vec![0u8; *len]);
        let s = parse_and_reemit(&ulpdu);
        assert_eq!(s.message, Message::RdmaWrite);
        assert_eq!(s.last, i == 2);
        assert_eq!(
            s.placement,
            Placement::Tagged {
                stag: 0xa305_c400,
                tagged_offset: next_to
            }
        );
        next_to += s.payload.len() as u64;
    }
    assert_eq!(next_to - 0x0000_5638_3ce3_f000, 4096);

    // siw-ib_send_bw.pcap: a 4096-byte Send as MO 0, 1424 and 2848 in MSN 1.
    let mut mo = 0u32;
    for (i, len) in [1424usize, 1424, 1248].into_iter().enumerate() {
        let mut header = [0x01, 0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0];
        if i == 2 {
            header[0] = 0x41;
        }
        header[14..].copy_from_slice(&mo.to_be_bytes());
        let ulpdu = with_payload(&header, &vec![0u8; len]);
        let s = parse_and_reemit(&ulpdu);
        assert_eq!(s.message, Message::Send);
        assert_eq!(s.last, i == 2);
        assert_eq!(s.placement, Placement::Untagged { msn: 1, mo });
        mo += u32::try_from(s.payload.len()).unwrap();
    }
    assert_eq!(mo, 4096);
}
