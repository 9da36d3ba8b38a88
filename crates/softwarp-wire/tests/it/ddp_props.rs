//! Property tests for the RFC 5041 DDP headers: emit then parse gives back the same Repr,
//! parse is faithful to the bytes, and no input makes parsing or the views panic.

#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use softwarp_wire::ddp::{
    self, HeaderRepr, TaggedHeader, TaggedRepr, UntaggedHeader, UntaggedRepr, TAGGED_HEADER_LEN,
    UNTAGGED_HEADER_LEN,
};
use softwarp_wire::WireError;

fn tagged_repr() -> impl Strategy<Value = TaggedRepr> {
    (any::<bool>(), any::<u8>(), any::<u32>(), any::<u64>()).prop_map(
        |(last, ulp_control, stag, tagged_offset)| TaggedRepr {
            version: softwarp_wire::ddp::DDP_VERSION,
            last,
            ulp_control,
            stag,
            tagged_offset,
        },
    )
}

fn untagged_repr() -> impl Strategy<Value = UntaggedRepr> {
    (
        any::<bool>(),
        any::<u8>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
    )
        .prop_map(
            |(last, ulp_control, ulp_reserved, queue_number, msn, mo)| UntaggedRepr {
                version: softwarp_wire::ddp::DDP_VERSION,
                last,
                ulp_control,
                ulp_reserved,
                queue_number,
                msn,
                mo,
            },
        )
}

fn header_repr() -> impl Strategy<Value = HeaderRepr> {
    prop_oneof![
        tagged_repr().prop_map(HeaderRepr::Tagged),
        untagged_repr().prop_map(HeaderRepr::Untagged),
    ]
}

proptest! {
    #[test]
    fn tagged_emit_then_parse_round_trips(repr in tagged_repr(), extra in 0usize..8) {
        let mut buf = vec![0u8; TAGGED_HEADER_LEN + extra];
        prop_assert_eq!(repr.emit(&mut buf), Ok(TAGGED_HEADER_LEN));
        prop_assert_eq!(TaggedRepr::parse(&buf), Ok((repr, TAGGED_HEADER_LEN)));
        let view = TaggedHeader::new_checked(&buf[..]).unwrap();
        prop_assert_eq!(view.payload().len(), extra);
    }

    #[test]
    fn untagged_emit_then_parse_round_trips(repr in untagged_repr(), extra in 0usize..8) {
        let mut buf = vec![0u8; UNTAGGED_HEADER_LEN + extra];
        prop_assert_eq!(repr.emit(&mut buf), Ok(UNTAGGED_HEADER_LEN));
        prop_assert_eq!(UntaggedRepr::parse(&buf), Ok((repr, UNTAGGED_HEADER_LEN)));
        let view = UntaggedHeader::new_checked(&buf[..]).unwrap();
        prop_assert_eq!(view.payload().len(), extra);
    }

    #[test]
    fn header_emit_then_parse_round_trips(repr in header_repr()) {
        let mut buf = vec![0u8; repr.buffer_len()];
        prop_assert_eq!(repr.emit(&mut buf), Ok(repr.buffer_len()));
        prop_assert_eq!(HeaderRepr::parse(&buf), Ok((repr, repr.buffer_len())));
        prop_assert_eq!(HeaderRepr::parse_any_version(&buf), Ok((repr, repr.buffer_len())));
        prop_assert_eq!(ddp::is_tagged(&buf), Ok(repr.is_tagged()));
        prop_assert_eq!(ddp::header_len(buf[0]), repr.buffer_len());
    }

    #[test]
    fn emit_never_writes_past_the_header_and_fails_cleanly_when_short(
        repr in header_repr(),
        short in 0usize..18,
    ) {
        let len = repr.buffer_len();
        let mut buf = vec![0x5au8; len + 4];
        repr.emit(&mut buf).unwrap();
        prop_assert_eq!(&buf[len..], &[0x5a; 4]);
        if short < len {
            let mut small = vec![0u8; short];
            let is_too_small = matches!(
                repr.emit(&mut small),
                Err(WireError::BufferTooSmall { .. })
            );
            prop_assert!(is_too_small);
        }
    }

    #[test]
    fn parse_is_faithful_to_the_bytes_up_to_reserved_bits(
        bytes in proptest::collection::vec(any::<u8>(), 0..40),
    ) {
        if let Ok((repr, len)) = HeaderRepr::parse(&bytes) {
            let mut out = vec![0u8; len];
            repr.emit(&mut out).unwrap();
            let mut expected = bytes[..len].to_vec();
            expected[0] &= !ddp::MASK_RESERVED;
            prop_assert_eq!(out, expected);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
        let _ = HeaderRepr::parse(&bytes);
        let _ = HeaderRepr::parse_any_version(&bytes);
        let _ = TaggedRepr::parse(&bytes);
        let _ = UntaggedRepr::parse(&bytes);
        let _ = ddp::is_tagged(&bytes);
        // Unchecked views over any buffer, including short ones, never panic either.
        let t = TaggedHeader::new_unchecked(&bytes[..]);
        let _ = (t.tagged_flag(), t.last_flag(), t.reserved(), t.version(), t.ulp_control());
        let _ = (t.stag(), t.tagged_offset(), t.payload().len());
        let u = UntaggedHeader::new_unchecked(&bytes[..]);
        let _ = (u.ulp_reserved(), u.queue_number(), u.msn(), u.mo(), u.payload().len());
        let mut copy = bytes.clone();
        let mut w = UntaggedHeader::new_unchecked(&mut copy[..]);
        w.set_mo(1);
        w.set_queue_number(2);
        w.set_reserved(0xf);
        let _ = w.payload_mut().len();
        let mut copy = bytes.clone();
        let mut w = TaggedHeader::new_unchecked(&mut copy[..]);
        w.set_tagged_offset(3);
        w.set_version(2);
        let _ = w.payload_mut().len();
    }
}
