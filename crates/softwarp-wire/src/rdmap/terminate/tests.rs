//! Known-answer tests for the Terminate header, from a real siw capture and from the RFC
//! 5040 layout by hand.

#![allow(clippy::unwrap_used)]

use super::*;
use crate::ddp::{HeaderRepr, TaggedRepr, UntaggedRepr};

/// The Terminate header siw sent in siw-terminate-rping.pcap frame 11 (after its 18-byte
/// DDP header): control `11 01 03 00` in siw's layout (layer DDP, EType tagged buffer, code
/// base or bounds violation, M = D = 1), DDP Segment Length 128, and the offending tagged
/// Read Response header (STag 0x7af09b00, TO 0x0000558a6c3bba50).
const SIW_TERMINATE: [u8; 20] = [
    0x11, 0x01, 0x03, 0x00, // Terminate Control, siw layout
    0x00, 0x80, // DDP Segment Length
    0xc1, 0x42, 0x7a, 0xf0, 0x9b, 0x00, // terminated DDP header: ctrl, RDMAP ctrl, STag
    0x00, 0x00, 0x55, 0x8a, 0x6c, 0x3b, 0xba, 0x50, // TO
];

fn siw_repr() -> TerminateRepr {
    TerminateRepr {
        layout: TerminateLayout::LinuxSiw,
        error: TerminateError::Ddp(DdpError::TaggedBuffer(
            TaggedBufferError::BaseOrBoundsViolation,
        )),
        ddp_segment_length: Some(128),
        ddp_header: Some(HeaderRepr::Tagged(TaggedRepr {
            version: crate::ddp::DDP_VERSION,
            last: true,
            ulp_control: 0x42,
            stag: 0x7af0_9b00,
            tagged_offset: 0x0000_558a_6c3b_ba50,
        })),
        rdmap_header: TerminatedRdmapHeader::Absent,
    }
}

/// Built by hand from RFC 5040 section 4.8: RDMAP remote protection error, invalid STag,
/// M = D = R = 1, DDP Segment Length 0, the untagged Read Request DDP header (QN 1, MSN 5)
/// and its 28-byte Read Request header.
const RFC_TERMINATE_WITH_READ_REQUEST: [u8; 52] = [
    0x01, 0x00, 0xe0, 0x00, // Layer 0, EType 1, code 0, M D R
    0x00, 0x00, // DDP Segment Length
    0x41, 0x41, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 5, 0, 0, 0, 0, // untagged DDP header
    0x11, 0x22, 0x33, 0x44, // Data Sink STag
    0, 0, 0, 0, 0, 0, 0x10, 0, // Data Sink TO
    0, 0, 0x10, 0, // RDMA Read Message Size
    0x55, 0x66, 0x77, 0x88, // Data Source STag
    0, 0, 0, 0, 0, 0, 0x20, 0, // Data Source TO
];

fn rfc_repr() -> TerminateRepr {
    TerminateRepr {
        layout: TerminateLayout::Rfc5040,
        error: TerminateError::Rdmap(RdmapError::RemoteProtection(
            RemoteProtectionError::InvalidStag,
        )),
        ddp_segment_length: Some(0),
        ddp_header: Some(HeaderRepr::Untagged(UntaggedRepr {
            version: crate::ddp::DDP_VERSION,
            last: true,
            ulp_control: 0x41,
            ulp_reserved: 0,
            queue_number: 1,
            msn: 5,
            mo: 0,
        })),
        rdmap_header: TerminatedRdmapHeader::ReadRequest(ReadRequestRepr {
            sink_stag: 0x1122_3344,
            sink_tagged_offset: 0x1000,
            read_size: 0x1000,
            source_stag: 0x5566_7788,
            source_tagged_offset: 0x2000,
        }),
    }
}

/// What siw sends for a remote protection error on a Send with Invalidate: its layout, R set
/// with M and D (`10 00 07 00`), the DDP header, and no RDMAP header after it.
const SIW_SEND_INVALIDATE_TERMINATE: [u8; 24] = [
    0x10, 0x00, 0x07, 0x00, // EType 1 | Layer 0, code 0, M D R (siw bits)
    0x00, 0x10, // DDP Segment Length 16
    0x41, 0x44, 0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0,
];

#[test]
fn detects_and_parses_the_real_siw_terminate() {
    assert_eq!(
        TerminateLayout::detect([0x11, 0x01, 0x03, 0x00]),
        TerminateLayout::LinuxSiw
    );
    assert_eq!(TerminateRepr::parse(&SIW_TERMINATE), Ok((siw_repr(), 20)));
    let view = TerminateHeader::new_checked(&SIW_TERMINATE[..], TerminateLayout::LinuxSiw).unwrap();
    assert_eq!(view.layer(), 1);
    assert_eq!(view.etype(), 1);
    assert_eq!(view.error_code(), 1);
    assert!(view.flag_m() && view.flag_d() && !view.flag_r());
    assert_eq!(view.reserved(), 0);
    assert_eq!(view.ddp_segment_length(), 128);
    assert_eq!(view.terminated_ddp_header(), &SIW_TERMINATE[6..]);
    assert!(view.terminated_rdmap_header().is_empty());
    assert_eq!(view.total_len(), 20);
    assert_eq!(view.layout(), TerminateLayout::LinuxSiw);
}

#[test]
fn the_siw_bytes_read_in_rfc_order_lose_the_flags() {
    // What Wireshark shows: M/D/R = 0/0/0 and reserved bits 0x0300.
    let view = TerminateHeader::new_checked(&SIW_TERMINATE[..], TerminateLayout::Rfc5040).unwrap();
    assert!(!view.flag_m() && !view.flag_d() && !view.flag_r());
    assert_eq!(view.reserved(), 0x0300);
    assert_eq!(view.total_len(), 4);
}

#[test]
fn emits_the_siw_terminate_byte_for_byte_in_either_layout() {
    let mut out = [0u8; 20];
    assert_eq!(siw_repr().emit(&mut out), Ok(20));
    assert_eq!(out, SIW_TERMINATE);
    let rfc = TerminateRepr {
        layout: TerminateLayout::Rfc5040,
        ..siw_repr()
    };
    assert_eq!(rfc.emit(&mut out), Ok(20));
    assert_eq!(out[..4], [0x11, 0x01, 0xc0, 0x00]);
    assert_eq!(out[4..], SIW_TERMINATE[4..]);
    assert_eq!(TerminateRepr::parse(&out), Ok((rfc, 20)));
}

#[test]
fn round_trips_a_hand_built_rfc_terminate_with_read_request() {
    assert_eq!(
        TerminateRepr::parse(&RFC_TERMINATE_WITH_READ_REQUEST),
        Ok((rfc_repr(), 52))
    );
    assert_eq!(rfc_repr().buffer_len(), 52);
    let mut out = [0u8; 52];
    assert_eq!(rfc_repr().emit(&mut out), Ok(52));
    assert_eq!(out, RFC_TERMINATE_WITH_READ_REQUEST);
    let view = TerminateHeader::new_checked(&out[..], TerminateLayout::Rfc5040).unwrap();
    assert_eq!(
        view.terminated_rdmap_header(),
        &RFC_TERMINATE_WITH_READ_REQUEST[24..]
    );
}

#[test]
fn siw_r_flag_without_an_rdmap_header_is_flag_only() {
    let (repr, len) = TerminateRepr::parse(&SIW_SEND_INVALIDATE_TERMINATE).unwrap();
    assert_eq!(len, 24);
    assert_eq!(repr.layout, TerminateLayout::LinuxSiw);
    assert_eq!(
        repr.error,
        TerminateError::Rdmap(RdmapError::RemoteProtection(
            RemoteProtectionError::InvalidStag
        ))
    );
    assert_eq!(repr.rdmap_header, TerminatedRdmapHeader::FlagOnly);
    assert_eq!(repr.ddp_segment_length, Some(16));
    let mut out = [0u8; 24];
    assert_eq!(repr.emit(&mut out), Ok(24));
    assert_eq!(out, SIW_SEND_INVALIDATE_TERMINATE);
}

#[test]
fn a_bare_control_has_no_optional_parts() {
    // RDMAP local catastrophic error, as siw sends on a QP moved to TERMINATE.
    let bytes = [0x00, 0xff, 0x00, 0x00];
    let (repr, len) = TerminateRepr::parse(&bytes).unwrap();
    assert_eq!(len, 4);
    assert_eq!(
        repr,
        TerminateRepr::new(TerminateError::Rdmap(RdmapError::LocalCatastrophic {
            code: 0xff
        }))
    );
    // R without D and with nothing after it: flag only.
    let (repr, len) = TerminateRepr::parse(&[0x02, 0x06, 0x20, 0x00]).unwrap();
    assert_eq!(len, 4);
    assert_eq!(repr.rdmap_header, TerminatedRdmapHeader::FlagOnly);
    // M without D: the length field alone.
    let (repr, len) = TerminateRepr::parse(&[0x20, 0x02, 0x80, 0x00, 0x01, 0x00]).unwrap();
    assert_eq!(len, 6);
    assert_eq!(repr.ddp_segment_length, Some(256));
    assert_eq!(repr.ddp_header, None);
    // D without M: the length field is there but not valid.
    let mut bytes = [0u8; 20];
    bytes[..4].copy_from_slice(&[0x11, 0x00, 0x40, 0x00]);
    bytes[4..6].copy_from_slice(&[0x12, 0x34]);
    bytes[6..].copy_from_slice(&SIW_TERMINATE[6..]);
    let (repr, len) = TerminateRepr::parse(&bytes).unwrap();
    assert_eq!(len, 20);
    assert_eq!(repr.ddp_segment_length, None);
    assert!(repr.ddp_header.is_some());
}

#[test]
fn layout_detection_without_flags_prefers_rfc_unless_only_siw_reads_a_known_error() {
    use TerminateLayout::*;
    // 0/0: the same either way.
    assert_eq!(TerminateLayout::detect([0x00, 0x00, 0x00, 0x00]), Rfc5040);
    // RFC: LLP/MPA/local catastrophic; siw: RDMAP/remote operation/invalid RDMAP version.
    // Both known: RFC wins (the documented ambiguity).
    assert_eq!(TerminateLayout::detect([0x20, 0x05, 0x00, 0x00]), Rfc5040);
    // RFC: LLP with EType 1 (unknown); siw: DDP/untagged/invalid DDP version.
    assert_eq!(TerminateLayout::detect([0x21, 0x06, 0x00, 0x00]), LinuxSiw);
    // Neither reading is known: RFC.
    assert_eq!(TerminateLayout::detect([0x77, 0x06, 0x00, 0x00]), Rfc5040);
    // RFC flags win even if siw bits are also set (siw never sets 0xE0).
    assert_eq!(TerminateLayout::detect([0x11, 0x01, 0xff, 0x00]), Rfc5040);
    assert_eq!(TerminateLayout::detect([0x11, 0x01, 0x04, 0x00]), LinuxSiw);
    assert!(matches!(
        TerminateLayout::detect_in(&[0x11, 0x01, 0x03]),
        Err(WireError::Truncated {
            need: 4,
            have: 3,
            ..
        })
    ));
    assert_eq!(Rfc5040.to_string(), "rfc5040");
    assert_eq!(LinuxSiw.to_string(), "siw");
    assert_eq!(TerminateLayout::default(), Rfc5040);
}

#[test]
fn reserved_bits_are_ignored_on_receive() {
    let mut bytes = RFC_TERMINATE_WITH_READ_REQUEST;
    bytes[2] |= 0x1f;
    bytes[3] = 0xff;
    let (repr, _) = TerminateRepr::parse(&bytes).unwrap();
    assert_eq!(repr, rfc_repr());
    let view = TerminateHeader::new_checked(&bytes[..], TerminateLayout::Rfc5040).unwrap();
    assert_eq!(view.reserved(), 0x1fff);
}

#[test]
fn every_truncation_is_rejected() {
    for bytes in [
        &SIW_TERMINATE[..],
        &RFC_TERMINATE_WITH_READ_REQUEST[..],
        &SIW_SEND_INVALIDATE_TERMINATE[..],
    ] {
        let layout = TerminateLayout::detect_in(bytes).unwrap();
        let (_, full) = TerminateRepr::parse(bytes).unwrap();
        assert_eq!(full, bytes.len());
        for len in 0..bytes.len() {
            let short = &bytes[..len];
            let got = TerminateRepr::parse_with_layout(short, layout);
            // Cutting exactly before the optional Read Request leaves a valid flag-only
            // Terminate; every other cut is reported as truncated.
            if layout == TerminateLayout::Rfc5040 && len == 24 {
                let (repr, used) = got.unwrap();
                assert_eq!(used, 24);
                assert_eq!(repr.rdmap_header, TerminatedRdmapHeader::FlagOnly);
                continue;
            }
            assert!(
                matches!(got, Err(WireError::Truncated { have, .. }) if have == len),
                "len {len}: {got:?}"
            );
            assert!(TerminateHeader::new_checked(short, layout).is_err());
        }
    }
}

#[test]
fn emit_checks_the_output_buffer_and_impossible_values() {
    for len in 0..20 {
        let mut out = vec![0u8; len];
        assert_eq!(
            siw_repr().emit(&mut out),
            Err(WireError::BufferTooSmall {
                what: "Terminate header",
                need: 20,
                have: len
            })
        );
    }
    let mut out = [0u8; 64];
    let wide_layer = TerminateRepr::new(TerminateError::UnknownLayer {
        layer: 0x10,
        etype: 0,
        code: 0,
    });
    assert!(matches!(
        wide_layer.emit(&mut out),
        Err(WireError::InvalidField { field: "Layer", .. })
    ));
    let wide_etype = TerminateRepr::new(TerminateError::Llp(LlpError::UnknownType {
        etype: 0x10,
        code: 0,
    }));
    assert!(matches!(
        wide_etype.emit(&mut out),
        Err(WireError::InvalidField { field: "EType", .. })
    ));
    // A Read Request header after a tagged DDP header could never be found by a receiver.
    let inconsistent = TerminateRepr {
        rdmap_header: rfc_repr().rdmap_header,
        ..siw_repr()
    };
    assert!(matches!(
        inconsistent.emit(&mut out),
        Err(WireError::InvalidField {
            field: "Terminated RDMAP header",
            ..
        })
    ));
}

#[test]
fn view_setters_write_either_layout() {
    for layout in [TerminateLayout::Rfc5040, TerminateLayout::LinuxSiw] {
        let mut buf = [0u8; 6];
        let mut view = TerminateHeader::new_unchecked(&mut buf[..], layout);
        view.set_error(TerminateError::from_fields(2, 0, 4))
            .unwrap();
        view.set_flags(true, false, false);
        view.set_reserved(0x1abc);
        view.set_ddp_segment_length(0x0102);
        assert_eq!(view.layer(), 2);
        assert_eq!(view.etype(), 0);
        assert_eq!(view.error_code(), 4);
        assert!(view.flag_m() && !view.flag_d() && !view.flag_r());
        assert_eq!(view.reserved(), 0x1abc);
        assert_eq!(view.ddp_segment_length(), 0x0102);
        assert_eq!(
            view.error(),
            TerminateError::Llp(LlpError::Mpa(MpaError::InvalidRequestOrReply))
        );
        view.set_reserved(0);
        let bytes = view.into_inner();
        let expected: [u8; 4] = match layout {
            TerminateLayout::Rfc5040 => [0x20, 0x04, 0x80, 0x00],
            TerminateLayout::LinuxSiw => [0x02, 0x04, 0x01, 0x00],
        };
        assert_eq!(bytes[..4], expected);
    }
}

#[test]
fn display_is_one_readable_line() {
    assert_eq!(
        siw_repr().to_string(),
        "DDP tagged buffer error: base or bounds violation (1/1/0x01) M=1 D=1 R=0 seglen=128 \
         hdr=[T=1 L=1 STag=0x7af09b00 TO=0x0000558a6c3bba50 ReadResp] layout=siw"
    );
    assert_eq!(
        rfc_repr().to_string(),
        "RDMAP remote protection error: invalid STag (0/1/0x00) M=1 D=1 R=1 seglen=0 \
         hdr=[T=0 L=1 QN=1 MSN=5 MO=0 ReadReq] rreq=[sink=0x11223344@0x0000000000001000 \
         src=0x55667788@0x0000000000002000 len=4096]"
    );
    let bad_rv = TerminateRepr {
        ddp_header: Some(HeaderRepr::Tagged(TaggedRepr {
            version: crate::ddp::DDP_VERSION,
            ulp_control: 0x02,
            ..TaggedRepr::default()
        })),
        ..TerminateRepr::new(TerminateError::from_fields(1, 1, 0))
    };
    assert!(bad_rv.to_string().ends_with("rdmap-ctrl=0x02]"));
}
