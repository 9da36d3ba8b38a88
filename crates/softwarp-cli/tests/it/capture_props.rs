//! Property tests for capture reading and TCP reassembly: any arrival order, duplication and
//! overlap of segments rebuilds the original stream; arbitrary capture bytes never panic.

use proptest::prelude::*;
use softwarp_cli::capture::{tcp_segment, CaptureReader, StreamEvent, StreamReassembler};

/// Cuts `stream` into segments at `cuts`, then yields them in the order given by `order`
/// (indices, repeats allowed: retransmissions), followed by every segment once more so the
/// stream is complete.
fn segments(stream: &[u8], cuts: &[usize], order: &[usize]) -> Vec<(usize, Vec<u8>)> {
    let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (stream.len() + 1)).collect();
    bounds.push(0);
    bounds.push(stream.len());
    bounds.sort_unstable();
    bounds.dedup();
    let pieces: Vec<(usize, Vec<u8>)> = bounds
        .windows(2)
        .map(|w| (w[0], stream[w[0]..w[1]].to_vec()))
        .collect();
    let mut out: Vec<_> = order
        .iter()
        .filter_map(|&i| pieces.get(i % pieces.len().max(1)).cloned())
        .collect();
    out.extend(pieces);
    out
}

proptest! {
    #[test]
    fn any_order_with_retransmissions_rebuilds_the_stream(
        stream in proptest::collection::vec(any::<u8>(), 1..600),
        cuts in proptest::collection::vec(any::<usize>(), 0..20),
        order in proptest::collection::vec(any::<usize>(), 0..40),
        isn in any::<u32>(),
        overlap in 0usize..8,
    ) {
        let mut r = StreamReassembler::new(1 << 20);
        let mut got = Vec::new();
        let mut gaps = 0;
        let mut sink = |ev: StreamEvent<'_>| match ev {
            StreamEvent::Data { offset, bytes, .. } => {
                assert_eq!(offset as usize, got.len());
                got.extend_from_slice(bytes);
            }
            StreamEvent::Gap { .. } => gaps += 1,
        };
        r.segment(0, isn, true, &[], &mut sink);
        for (frame, (offset, bytes)) in segments(&stream, &cuts, &order).into_iter().enumerate() {
            // Widen some segments backwards so that they overlap their predecessor.
            let from = offset.saturating_sub(overlap);
            let bytes = [&stream[from..offset], &bytes[..]].concat();
            let seq = isn.wrapping_add(1).wrapping_add(from as u32);
            r.segment(frame as u64 + 1, seq, false, &bytes, &mut sink);
        }
        r.finish(u64::MAX, &mut sink);
        prop_assert_eq!(gaps, 0);
        prop_assert_eq!(got, stream);
        prop_assert_eq!(r.pending_bytes(), 0);
    }

    #[test]
    fn bounded_reassembly_delivers_each_offset_at_most_once_in_order(
        stream in proptest::collection::vec(any::<u8>(), 1..600),
        cuts in proptest::collection::vec(any::<usize>(), 0..20),
        order in proptest::collection::vec(any::<usize>(), 0..40),
        limit in 0usize..64,
    ) {
        let mut r = StreamReassembler::new(limit);
        let mut next = 0u64;
        let mut sink = |ev: StreamEvent<'_>| match ev {
            StreamEvent::Data { offset, bytes, .. } => {
                assert_eq!(offset, next);
                assert_eq!(&stream[offset as usize..offset as usize + bytes.len()], bytes);
                next += bytes.len() as u64;
            }
            StreamEvent::Gap { offset, len, .. } => {
                assert_eq!(offset, next);
                assert!(len > 0);
                next += len;
            }
        };
        r.segment(0, 0, true, &[], &mut sink);
        for (frame, (offset, bytes)) in segments(&stream, &cuts, &order).into_iter().enumerate() {
            r.segment(frame as u64 + 1, 1 + offset as u32, false, &bytes, &mut sink);
            prop_assert!(r.pending_bytes() <= limit + 600);
        }
        r.finish(u64::MAX, &mut sink);
        prop_assert_eq!(next, stream.len() as u64);
    }

    #[test]
    fn arbitrary_capture_bytes_never_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..512),
        pcapng in any::<bool>(),
    ) {
        let mut file = if pcapng {
            vec![0x0a, 0x0d, 0x0d, 0x0a]
        } else {
            vec![0xd4, 0xc3, 0xb2, 0xa1]
        };
        file.extend_from_slice(&bytes);
        if let Ok(reader) = CaptureReader::new(&file) {
            for frame in reader.flatten() {
                let _ = tcp_segment(frame.number, frame.link, &frame.data);
            }
        }
    }

    #[test]
    fn arbitrary_packets_on_every_link_type_never_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..256),
        link in prop_oneof![Just(0u32), Just(1), Just(101), Just(108), Just(113), Just(228), Just(229), Just(276), any::<u32>()],
    ) {
        let _ = tcp_segment(1, link.into(), &bytes);
    }
}
