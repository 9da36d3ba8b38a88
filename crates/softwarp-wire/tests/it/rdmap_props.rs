//! Property tests for RDMAP (RFC 5040, RFC 7306): every header and the whole Segment round
//! trip through emit and parse, parse is idempotent, and no input makes anything panic.

#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use softwarp_wire::ddp::{HeaderRepr, TaggedRepr, UntaggedRepr};
use softwarp_wire::rdmap::{
    AtomicOpcode, AtomicRequestRepr, AtomicResponseRepr, ControlRepr, ImmediateDataRepr, Message,
    Opcode, Placement, ReadRequestRepr, Segment, TerminateError, TerminateHeader, TerminateLayout,
    TerminateRepr, TerminatedRdmapHeader,
};

fn read_request() -> impl Strategy<Value = ReadRequestRepr> {
    (
        any::<u32>(),
        any::<u64>(),
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
    )
        .prop_map(
            |(sink_stag, sink_tagged_offset, read_size, source_stag, source_tagged_offset)| {
                ReadRequestRepr {
                    sink_stag,
                    sink_tagged_offset,
                    read_size,
                    source_stag,
                    source_tagged_offset,
                }
            },
        )
}

fn atomic_request() -> impl Strategy<Value = AtomicRequestRepr> {
    (
        (0u8..16).prop_map(AtomicOpcode::from),
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
        any::<[u64; 4]>(),
    )
        .prop_map(
            |(opcode, request_id, remote_stag, remote_tagged_offset, d)| AtomicRequestRepr {
                opcode,
                request_id,
                remote_stag,
                remote_tagged_offset,
                add_or_swap_data: d[0],
                add_or_swap_mask: d[1],
                compare_data: d[2],
                compare_mask: d[3],
            },
        )
}

fn atomic_response() -> impl Strategy<Value = AtomicResponseRepr> {
    (any::<u32>(), any::<u64>()).prop_map(|(original_request_id, original_value)| {
        AtomicResponseRepr {
            original_request_id,
            original_value,
        }
    })
}

fn immediate() -> impl Strategy<Value = ImmediateDataRepr> {
    any::<[u8; 8]>().prop_map(|data| ImmediateDataRepr { data })
}

fn terminate_error() -> impl Strategy<Value = TerminateError> {
    (0u8..16, 0u8..16, any::<u8>()).prop_map(|(l, t, c)| TerminateError::from_fields(l, t, c))
}

fn ddp_header() -> impl Strategy<Value = HeaderRepr> {
    prop_oneof![
        (any::<bool>(), any::<u8>(), any::<u32>(), any::<u64>()).prop_map(
            |(last, ulp_control, stag, tagged_offset)| HeaderRepr::Tagged(TaggedRepr {
                version: softwarp_wire::ddp::DDP_VERSION,
                last,
                ulp_control,
                stag,
                tagged_offset,
            })
        ),
        (any::<bool>(), any::<u8>(), any::<[u32; 4]>()).prop_map(|(last, ulp_control, w)| {
            HeaderRepr::Untagged(UntaggedRepr {
                version: softwarp_wire::ddp::DDP_VERSION,
                last,
                ulp_control,
                ulp_reserved: w[0],
                queue_number: w[1],
                msn: w[2],
                mo: w[3],
            })
        }),
    ]
}

/// Any consistent Terminate: a Read Request header only after no DDP header or after an
/// untagged Read Request one.
fn terminate() -> impl Strategy<Value = TerminateRepr> {
    (
        prop_oneof![
            Just(TerminateLayout::Rfc5040),
            Just(TerminateLayout::LinuxSiw)
        ],
        terminate_error(),
        proptest::option::of(any::<u16>()),
        proptest::option::of(ddp_header()),
        0u8..3,
        read_request(),
    )
        .prop_map(|(layout, error, seglen, ddp, r, rreq)| {
            let rr_may_follow = match ddp {
                None => true,
                Some(h) => !h.is_tagged() && h.ulp_control() & 0x0f == 1,
            };
            let rdmap_header = match r {
                0 => TerminatedRdmapHeader::Absent,
                2 if rr_may_follow => TerminatedRdmapHeader::ReadRequest(rreq),
                _ => TerminatedRdmapHeader::FlagOnly,
            };
            TerminateRepr {
                layout,
                error,
                ddp_segment_length: seglen,
                ddp_header: ddp,
                rdmap_header,
            }
        })
}

fn has_flags(t: &TerminateRepr) -> bool {
    t.ddp_segment_length.is_some()
        || t.ddp_header.is_some()
        || t.rdmap_header != TerminatedRdmapHeader::Absent
}

/// Terminates whose layout the detection rules are guaranteed to find.
fn detectable_terminate() -> impl Strategy<Value = TerminateRepr> {
    terminate().prop_filter("layout must be detectable", |t| {
        has_flags(t) || (t.layout == TerminateLayout::Rfc5040 && t.error.is_known())
    })
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        Just(Message::RdmaWrite),
        read_request().prop_map(Message::RdmaReadRequest),
        Just(Message::RdmaReadResponse),
        Just(Message::Send),
        any::<u32>().prop_map(|invalidate_stag| Message::SendWithInvalidate { invalidate_stag }),
        Just(Message::SendWithSolicitedEvent),
        any::<u32>().prop_map(|invalidate_stag| {
            Message::SendWithSolicitedEventAndInvalidate { invalidate_stag }
        }),
        detectable_terminate().prop_map(Message::Terminate),
        immediate().prop_map(Message::ImmediateData),
        immediate().prop_map(Message::ImmediateDataWithSolicitedEvent),
        atomic_request().prop_map(Message::AtomicRequest),
        atomic_response().prop_map(Message::AtomicResponse),
    ]
}

/// A message with a placement and flags that fit it, and a payload for data messages.
fn segment_parts() -> impl Strategy<Value = (bool, Placement, Message, Vec<u8>)> {
    (
        message(),
        any::<bool>(),
        any::<u32>(),
        any::<u64>(),
        any::<u32>(),
        proptest::collection::vec(any::<u8>(), 0..64),
    )
        .prop_map(|(message, last, a, b, mo, payload)| {
            let tagged = matches!(message, Message::RdmaWrite | Message::RdmaReadResponse);
            if message.is_control() {
                (
                    true,
                    Placement::Untagged { msn: a, mo: 0 },
                    message,
                    Vec::new(),
                )
            } else if tagged {
                let placement = Placement::Tagged {
                    stag: a,
                    tagged_offset: b,
                };
                (last, placement, message, payload)
            } else {
                (last, Placement::Untagged { msn: a, mo }, message, payload)
            }
        })
}

/// Bytes that look like an RDMAP ULPDU (valid DV and RV, a small QN, any opcode) followed by
/// random bytes, so that random input reaches the opcode-specific parsers.
fn plausible_ulpdu() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![Just(0x41u8), Just(0x01), Just(0xc1), Just(0x81)],
        0u8..16,
        any::<u32>(),
        0u32..5,
        any::<[u8; 8]>(),
        proptest::collection::vec(any::<u8>(), 0..90),
    )
        .prop_map(|(ddp, opcode, rsvd, qn, msn_mo, tail)| {
            let mut v = vec![ddp, 0x40 | opcode];
            v.extend_from_slice(&rsvd.to_be_bytes());
            if ddp & 0x80 == 0 {
                v.extend_from_slice(&qn.to_be_bytes());
                v.extend_from_slice(&msn_mo);
            } else {
                v.extend_from_slice(&msn_mo);
            }
            // Often a zero MO, so that control messages get parsed.
            if ddp & 0x80 == 0 && msn_mo[0] & 1 == 0 {
                v[14..18].copy_from_slice(&[0, 0, 0, 0]);
            }
            v.extend_from_slice(&tail);
            v
        })
}

proptest! {
    #[test]
    fn read_request_round_trips(repr in read_request()) {
        let mut buf = [0u8; 28];
        prop_assert_eq!(repr.emit(&mut buf), Ok(28));
        prop_assert_eq!(ReadRequestRepr::parse(&buf), Ok((repr, 28)));
    }

    #[test]
    fn atomic_request_round_trips(repr in atomic_request()) {
        let mut buf = [0u8; 52];
        prop_assert_eq!(repr.emit(&mut buf), Ok(52));
        prop_assert_eq!(AtomicRequestRepr::parse(&buf), Ok((repr, 52)));
    }

    #[test]
    fn atomic_response_round_trips(repr in atomic_response()) {
        let mut buf = [0u8; 12];
        prop_assert_eq!(repr.emit(&mut buf), Ok(12));
        prop_assert_eq!(AtomicResponseRepr::parse(&buf), Ok((repr, 12)));
    }

    #[test]
    fn immediate_data_round_trips(repr in immediate()) {
        let mut buf = [0u8; 8];
        prop_assert_eq!(repr.emit(&mut buf), Ok(8));
        prop_assert_eq!(ImmediateDataRepr::parse(&buf), Ok((repr, 8)));
    }

    #[test]
    fn control_byte_round_trips(opcode in (0u8..16).prop_map(Opcode::from)) {
        let repr = ControlRepr { opcode };
        let mut buf = [0u8; 1];
        prop_assert_eq!(repr.emit(&mut buf), Ok(1));
        prop_assert_eq!(ControlRepr::parse(&buf), Ok((repr, 1)));
    }

    #[test]
    fn terminate_round_trips_in_its_own_layout(repr in terminate()) {
        let len = repr.buffer_len();
        let mut buf = vec![0u8; len];
        prop_assert_eq!(repr.emit(&mut buf), Ok(len));
        prop_assert_eq!(TerminateRepr::parse_with_layout(&buf, repr.layout), Ok((repr, len)));
        let view = TerminateHeader::new_checked(&buf[..], repr.layout).unwrap();
        prop_assert_eq!(view.total_len(), len);
        prop_assert_eq!(view.error(), repr.error);
    }

    #[test]
    fn terminate_layout_is_detected_whenever_a_flag_is_set(repr in terminate()) {
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut buf).unwrap();
        let detected = TerminateLayout::detect([buf[0], buf[1], buf[2], buf[3]]);
        if has_flags(&repr) {
            prop_assert_eq!(detected, repr.layout);
            prop_assert_eq!(TerminateRepr::parse(&buf), Ok((repr, buf.len())));
        } else if repr.layout == TerminateLayout::Rfc5040 && repr.error.is_known() {
            prop_assert_eq!(detected, TerminateLayout::Rfc5040);
        }
    }

    #[test]
    fn segment_emit_then_parse_round_trips(parts in segment_parts()) {
        let (last, placement, message, payload) = parts;
        let segment = Segment { last, placement, message, payload: &payload };
        let mut buf = vec![0u8; segment.buffer_len()];
        prop_assert_eq!(segment.emit(&mut buf), Ok(segment.buffer_len()));
        prop_assert_eq!(Segment::parse(&buf), Ok(segment));
        // emit_header writes exactly the header: the payload can be gathered after it.
        let mut header = vec![0u8; segment.header_len()];
        prop_assert_eq!(segment.emit_header(&mut header), Ok(segment.header_len()));
        prop_assert_eq!(&header[..], &buf[..segment.header_len()]);
        prop_assert_eq!(&buf[segment.header_len()..], &payload[..]);
        let line = segment.to_string();
        prop_assert!(!line.contains('\n'));
        prop_assert!(line.starts_with(segment.opcode().short_name()));
    }

    #[test]
    fn parse_is_idempotent_on_plausible_input(bytes in plausible_ulpdu()) {
        if let Ok(segment) = Segment::parse(&bytes) {
            prop_assert_eq!(segment.buffer_len(), bytes.len());
            let mut out = vec![0u8; segment.buffer_len()];
            prop_assert_eq!(segment.emit(&mut out), Ok(bytes.len()));
            prop_assert_eq!(Segment::parse(&out), Ok(segment));
            let _ = segment.to_string();
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..120)) {
        if let Ok(s) = Segment::parse(&bytes) {
            let _ = s.to_string();
        }
        let _ = ReadRequestRepr::parse(&bytes);
        let _ = AtomicRequestRepr::parse(&bytes);
        let _ = AtomicResponseRepr::parse(&bytes);
        let _ = ImmediateDataRepr::parse(&bytes);
        let _ = ControlRepr::parse(&bytes);
        if let Ok((t, _)) = TerminateRepr::parse(&bytes) {
            let _ = t.to_string();
        }
        for layout in [TerminateLayout::Rfc5040, TerminateLayout::LinuxSiw] {
            let _ = TerminateRepr::parse_with_layout(&bytes, layout);
            let view = TerminateHeader::new_unchecked(&bytes[..], layout);
            let _ = (view.error(), view.flag_m(), view.flag_d(), view.flag_r());
            let _ = (view.reserved(), view.ddp_segment_length(), view.total_len());
            let _ = (view.terminated_ddp_header().len(), view.terminated_rdmap_header().len());
        }
    }

    #[test]
    fn plausible_bytes_never_panic(bytes in plausible_ulpdu()) {
        if let Ok(s) = Segment::parse(&bytes) {
            let _ = s.to_string();
        }
        if bytes.len() > 18 {
            let _ = TerminateRepr::parse(&bytes[18..]);
        }
    }
}
