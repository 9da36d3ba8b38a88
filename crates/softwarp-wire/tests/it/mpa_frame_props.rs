//! Property tests for MPA Request/Reply frames: emit then parse gives the same frame, and no
//! input of any length makes parsing, the incremental length helpers or the view panic.
#![allow(clippy::unwrap_used)] // tests may unwrap

use proptest::prelude::*;
use softwarp_wire::mpa::frame::{
    EnhancedParams, MpaFrame, MpaFrameKind, MpaFramePacket, MpaRevision, RtrFlags, HEADER_LEN,
    KEY_REPLY, KEY_REQUEST, MAX_IRD_ORD, MAX_PRIVATE_DATA_LEN,
};
use softwarp_wire::WireError;

fn enhanced() -> impl Strategy<Value = EnhancedParams> {
    (
        0..=MAX_IRD_ORD,
        0..=MAX_IRD_ORD,
        any::<bool>(),
        any::<[bool; 3]>(),
    )
        .prop_map(|(ird, ord, peer_to_peer, [s, w, r])| EnhancedParams {
            ird,
            ord,
            peer_to_peer,
            rtr: RtrFlags {
                zero_length_send: s,
                zero_length_write: w,
                zero_length_read: r,
            },
        })
}

/// A valid frame's fields, with private data sized to the limit.
fn frame_parts() -> impl Strategy<
    Value = (
        MpaFrameKind,
        [bool; 3],
        MpaRevision,
        Option<EnhancedParams>,
        Vec<u8>,
    ),
> {
    (
        prop_oneof![Just(MpaFrameKind::Request), Just(MpaFrameKind::Reply)],
        any::<[bool; 3]>(),
        prop_oneof![Just(MpaRevision::Rev1), Just(MpaRevision::Rev2)],
        proptest::option::of(enhanced()),
        proptest::collection::vec(any::<u8>(), 0..=MAX_PRIVATE_DATA_LEN - 4),
    )
        .prop_map(|(kind, flags, revision, enhanced, pd)| {
            // Enhanced parameters exist only in revision 2.
            let enhanced = if revision == MpaRevision::Rev2 {
                enhanced
            } else {
                None
            };
            (kind, flags, revision, enhanced, pd)
        })
}

/// Bytes that start with a valid key (so that parsing goes past the key check).
fn keyed_bytes() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<bool>(),
        proptest::collection::vec(any::<u8>(), 0..700),
    )
        .prop_map(|(req, rest)| {
            let mut v = if req {
                KEY_REQUEST.to_vec()
            } else {
                KEY_REPLY.to_vec()
            };
            v.extend(rest);
            v
        })
}

proptest! {
    #[test]
    fn emit_then_parse_gives_the_same_frame(
        (kind, [marker, crc, reject], revision, enhanced, pd) in frame_parts(),
        trailing in proptest::collection::vec(any::<u8>(), 0..16),
    ) {
        let frame = MpaFrame { kind, marker, crc, reject, revision, enhanced, private_data: &pd };
        let mut buf = vec![0u8; frame.buffer_len() + trailing.len()];
        let n = frame.emit(&mut buf).unwrap();
        prop_assert_eq!(n, frame.buffer_len());
        buf[n..].copy_from_slice(&trailing);

        prop_assert_eq!(MpaFrame::needed(&buf), Ok(0));
        prop_assert_eq!(MpaFrame::frame_len(&buf), Ok(Some(n)));
        let (parsed, used) = MpaFrame::parse(&buf).unwrap();
        prop_assert_eq!(used, n);
        prop_assert_eq!(parsed, frame);

        let view = MpaFramePacket::new_checked(&buf[..]).unwrap();
        prop_assert_eq!(view.kind(), Some(kind));
        prop_assert_eq!(view.res(), 0);
        prop_assert_eq!(usize::from(view.pd_length()), frame.pd_length());
    }

    #[test]
    fn every_prefix_of_a_valid_frame_asks_for_more_and_never_errs(
        (kind, [marker, crc, reject], revision, enhanced, pd) in frame_parts(),
    ) {
        let frame = MpaFrame { kind, marker, crc, reject, revision, enhanced, private_data: &pd };
        let mut buf = vec![0u8; frame.buffer_len()];
        frame.emit(&mut buf).unwrap();
        for cut in 0..buf.len() {
            let needed = MpaFrame::needed(&buf[..cut]).unwrap();
            prop_assert!(needed > 0);
            prop_assert!(cut + needed <= buf.len());
            let truncated = matches!(
                MpaFrame::parse(&buf[..cut]),
                Err(WireError::Truncated { .. })
            );
            prop_assert!(truncated);
        }
    }

    #[test]
    fn parse_of_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..700)) {
        let _ = MpaFrame::parse(&bytes);
        let _ = MpaFrame::needed(&bytes);
        let _ = MpaFrame::frame_len(&bytes);
        let _ = EnhancedParams::parse(&bytes);
        view_never_panics(&bytes);
    }

    #[test]
    fn parse_of_keyed_bytes_never_panics_and_agrees_with_needed(bytes in keyed_bytes()) {
        let result = MpaFrame::parse(&bytes);
        match MpaFrame::needed(&bytes) {
            Ok(0) => {
                let ok_or_field = matches!(result, Ok(_) | Err(WireError::InvalidField { .. }));
                prop_assert!(ok_or_field, "{:?}", result);
                if let Ok((frame, used)) = result {
                    prop_assert!(used >= HEADER_LEN && used <= bytes.len());
                    prop_assert_eq!(frame.buffer_len(), used);
                }
            }
            Ok(_) => {
                let truncated = matches!(result, Err(WireError::Truncated { .. }));
                prop_assert!(truncated);
            }
            Err(e) => prop_assert_eq!(result.map(|_| ()), Err(e)),
        }
        view_never_panics(&bytes);
    }
}

fn view_never_panics(bytes: &[u8]) {
    let view = MpaFramePacket::new_unchecked(bytes);
    let _ = (
        view.key(),
        view.kind(),
        view.marker(),
        view.crc(),
        view.reject(),
        view.enhanced_flag(),
        view.res(),
        view.revision(),
        view.pd_length(),
        view.frame_len(),
        view.private_data(),
        view.check_len(),
    );
    let mut owned = bytes.to_vec();
    let mut view = MpaFramePacket::new_unchecked(&mut owned[..]);
    view.set_key(MpaFrameKind::Reply);
    view.set_marker(true);
    view.set_crc(true);
    view.set_reject(true);
    view.set_enhanced_flag(true);
    view.set_res(0xff);
    view.set_revision(2);
    view.set_pd_length(0xffff);
    let _ = view.private_data_mut().len();
}
