//! Property tests for MPA markers: insert then strip is the identity for any FPDU size and
//! any (4-aligned) stream offset, FPDUs that begin exactly on a marker included; the gather
//! form produces the same bytes as insert; a stream of back-to-back FPDUs strips in order;
//! and no input of any length makes stripping panic.
#![allow(clippy::unwrap_used)] // tests may unwrap

use proptest::prelude::*;
use softwarp_wire::mpa::fpdu::{self, fpdu_len, Fpdu};
use softwarp_wire::mpa::marker::{
    insert, strip, MarkedSlices, MarkerLayout, Piece, WirePiece, MARKER_INTERVAL, MARKER_LEN,
};
use softwarp_wire::WireError;

/// Stream offsets: any multiple of 4, with marker positions (and their neighbours) favoured.
fn stream_offset() -> impl Strategy<Value = u64> {
    prop_oneof![
        (0u64..1 << 20).prop_map(|k| k * 4),
        (0u64..1 << 12).prop_map(|k| k * MARKER_INTERVAL as u64),
        (1u64..1 << 12, 1u64..4).prop_map(|(k, d)| k * MARKER_INTERVAL as u64 - 4 * d),
        (0u64..1 << 12, 1u64..4).prop_map(|(k, d)| k * MARKER_INTERVAL as u64 + 4 * d),
        Just(u64::from(u32::MAX) + 1 - 4), // just before a 32-bit sequence wrap
    ]
}

fn plain_fpdu(ulpdu: &[u8], use_crc: bool) -> Vec<u8> {
    let mut out = vec![0u8; fpdu_len(ulpdu.len())];
    Fpdu { ulpdu }.emit(&mut out, use_crc).unwrap();
    out
}

proptest! {
    #[test]
    fn insert_then_strip_is_identity(
        ulpdu in proptest::collection::vec(any::<u8>(), 0..4000),
        offset in stream_offset(),
        use_crc in any::<bool>(),
    ) {
        let plain = plain_fpdu(&ulpdu, use_crc);
        let layout = MarkerLayout::new(offset, plain.len()).unwrap();
        let mut wire = vec![0u8; layout.wire_len()];
        prop_assert_eq!(insert(&plain, offset, use_crc, &mut wire), Ok(layout.wire_len()));
        let mut back = vec![0u8; plain.len()];
        prop_assert_eq!(
            strip(&wire, offset, use_crc, &mut back),
            Ok((layout.wire_len(), plain.len()))
        );
        prop_assert_eq!(&back, &plain);
        let (parsed, _) = Fpdu::parse(&back, use_crc).unwrap();
        prop_assert_eq!(parsed.ulpdu, &ulpdu[..]);
    }

    #[test]
    fn fpdus_beginning_exactly_on_a_marker_round_trip(
        ulpdu in proptest::collection::vec(any::<u8>(), 0..3000),
        k in 0u64..100_000,
        use_crc in any::<bool>(),
    ) {
        let offset = k * MARKER_INTERVAL as u64;
        let plain = plain_fpdu(&ulpdu, use_crc);
        let layout = MarkerLayout::new(offset, plain.len()).unwrap();
        prop_assert!(layout.begins_with_marker());
        let mut wire = vec![0u8; layout.wire_len()];
        insert(&plain, offset, use_crc, &mut wire).unwrap();
        prop_assert_eq!(&wire[..MARKER_LEN], &[0u8, 0, 0, 0][..]);
        prop_assert_eq!(&wire[MARKER_LEN..MARKER_LEN + 2], &plain[..2]);
        let mut back = vec![0u8; plain.len()];
        strip(&wire, offset, use_crc, &mut back).unwrap();
        prop_assert_eq!(back, plain);
    }

    #[test]
    fn layout_is_consistent(
        ulpdu_len in 0usize..=60_000,
        offset in stream_offset(),
    ) {
        let len = fpdu_len(ulpdu_len);
        let layout = MarkerLayout::new(offset, len).unwrap();
        prop_assert_eq!(layout.wire_len(), len + MARKER_LEN * layout.marker_count());
        prop_assert_eq!(layout.markers().count(), layout.marker_count());
        prop_assert_eq!(layout.next_stream_offset(), offset + layout.wire_len() as u64);
        // Pieces cover the FPDU in order; markers sit on multiples of 512 and point back to
        // the FPDU's first octet; no marker follows the last data octet.
        let mut data = 0;
        let mut wire = 0;
        let mut last_was_data = false;
        for piece in layout.pieces() {
            match piece {
                Piece::Data(range) => {
                    prop_assert_eq!(range.start, data);
                    data = range.end;
                    wire += range.len();
                    last_was_data = true;
                }
                Piece::Marker(m) => {
                    prop_assert_eq!(m.wire_offset, wire);
                    prop_assert_eq!(m.stream_offset % MARKER_INTERVAL as u64, 0);
                    prop_assert_eq!(m.stream_offset, offset + wire as u64);
                    prop_assert_eq!(usize::from(m.fpduptr), wire);
                    wire += MARKER_LEN;
                    last_was_data = false;
                }
            }
        }
        prop_assert_eq!(data, len);
        prop_assert_eq!(wire, layout.wire_len());
        prop_assert!(last_was_data);
    }

    #[test]
    fn gather_form_equals_insert(
        ulpdu in proptest::collection::vec(any::<u8>(), 0..3000),
        cut in any::<prop::sample::Index>(),
        offset in stream_offset(),
    ) {
        let len = ulpdu.len();
        let mut header = [0u8; 2];
        fpdu::emit_header(len, &mut header).unwrap();
        let pad = [0u8; 3];
        let (a, b) = ulpdu.split_at(cut.index(len + 1));
        let slices = [&header[..], a, b, &pad[..fpdu::pad_len(len)]];
        let layout = MarkerLayout::new(offset, fpdu_len(len)).unwrap();
        let mut gather = MarkedSlices::new(layout, &slices).unwrap();
        let mut wire = Vec::new();
        for piece in &mut gather {
            match piece {
                WirePiece::Data(bytes) => {
                    prop_assert!(!bytes.is_empty());
                    wire.extend_from_slice(bytes);
                }
                WirePiece::Marker(m) => wire.extend_from_slice(&m),
            }
        }
        wire.extend_from_slice(&gather.crc_wire());

        let mut expected = vec![0u8; layout.wire_len()];
        insert(&plain_fpdu(&ulpdu, true), offset, true, &mut expected).unwrap();
        prop_assert_eq!(wire, expected);
    }

    #[test]
    fn back_to_back_fpdus_strip_in_order(
        ulpdus in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..1500), 1..6),
        start in stream_offset(),
    ) {
        let mut stream = Vec::new();
        let mut at = start;
        for u in &ulpdus {
            let plain = plain_fpdu(u, true);
            let n = MarkerLayout::new(at, plain.len()).unwrap().wire_len();
            let mut wire = vec![0u8; n];
            insert(&plain, at, true, &mut wire).unwrap();
            stream.extend_from_slice(&wire);
            at += n as u64;
        }
        // Every marker position of the stream holds a marker, FPDU boundaries included.
        let mut pos = 0usize;
        let mut at = start;
        for u in &ulpdus {
            let mut back = vec![0u8; fpdu_len(u.len())];
            let (used, written) = strip(&stream[pos..], at, true, &mut back).unwrap();
            prop_assert_eq!(written, back.len());
            prop_assert_eq!(Fpdu::parse(&back, true).unwrap().0.ulpdu, &u[..]);
            pos += used;
            at += used as u64;
        }
        prop_assert_eq!(pos, stream.len());
        let markers_in_stream = (0..stream.len())
            .filter(|i| (start + *i as u64) & (MARKER_INTERVAL as u64 - 1) == 0)
            .count();
        let plain_total: usize = ulpdus.iter().map(|u| fpdu_len(u.len())).sum();
        prop_assert_eq!(stream.len(), plain_total + MARKER_LEN * markers_in_stream);
    }

    #[test]
    fn strip_of_arbitrary_bytes_never_panics(
        bytes in proptest::collection::vec(any::<u8>(), 0..2000),
        offset in prop_oneof![any::<u64>(), any::<u64>().prop_map(|o| o & !3), stream_offset()],
        use_crc in any::<bool>(),
    ) {
        let mut out = vec![0u8; 2000];
        match strip(&bytes, offset, use_crc, &mut out) {
            Ok((used, written)) => {
                prop_assert!(used <= bytes.len());
                prop_assert!(written <= used);
            }
            Err(
                WireError::Truncated { .. }
                | WireError::InvalidField { .. }
                | WireError::MpaBadMarker { .. }
                | WireError::MpaCrcMismatch { .. }
                | WireError::BufferTooSmall { .. },
            ) => {}
            Err(other) => prop_assert!(false, "unexpected {:?}", other),
        }
        let _ = insert(&bytes, offset, use_crc, &mut out);
        let _ = MarkerLayout::new(offset, bytes.len());
    }

    #[test]
    fn corrupted_marked_fpdu_is_refused_with_crc_and_never_panics(
        ulpdu in proptest::collection::vec(any::<u8>(), 0..1500),
        offset in stream_offset(),
        at in any::<prop::sample::Index>(),
        xor in 1u8..=255,
    ) {
        let plain = plain_fpdu(&ulpdu, true);
        let n = MarkerLayout::new(offset, plain.len()).unwrap().wire_len();
        let mut wire = vec![0u8; n];
        insert(&plain, offset, true, &mut wire).unwrap();
        wire[at.index(n)] ^= xor;
        let mut back = vec![0u8; 70_000];
        // With CRC on, any change is caught: by the framing, a marker check or the CRC.
        prop_assert!(strip(&wire, offset, true, &mut back).is_err());
        // Without CRC, corruption of data bytes goes unnoticed, but nothing panics.
        let _ = strip(&wire, offset, false, &mut back);
    }
}
