//! Property tests of the stream protocol's parsers (`softwarp_sockets::wire`): whatever bytes
//! a peer sends as a message, a window, a WROTE notice or a hello, decoding returns a value or
//! `Malformed` and never panics; what decodes re-encodes to the same bytes; a window never
//! locates a range outside itself.
use proptest::prelude::*;
use softwarp_sockets::credits::MIN_SLOTS;
use softwarp_sockets::wire::{
    decode_wrote, encode_wrote, Header, Hello, Kind, WindowAd, HEADER_LEN, HELLO_LEN, WINDOW_LEN,
    WROTE_LEN,
};

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        Just(Kind::Data),
        Just(Kind::Grant),
        Just(Kind::Eof),
        Just(Kind::Window),
        Just(Kind::Wrote),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    /// Arbitrary bytes: a header and its body, or an error; a control message's body has
    /// exactly its kind's length, and the header re-encodes to the bytes it came from
    /// (reserved bytes aside).
    #[test]
    fn any_message_decodes_or_is_malformed(msg in proptest::collection::vec(any::<u8>(), 0..64)) {
        if let Ok((h, body)) = Header::decode(&msg) {
            prop_assert_eq!(body.len(), msg.len() - HEADER_LEN);
            let want = match h.kind {
                Kind::Data => body.len(),
                Kind::Grant | Kind::Eof => 0,
                Kind::Window => WINDOW_LEN,
                Kind::Wrote => WROTE_LEN,
            };
            prop_assert_eq!(body.len(), want);
            let again = h.encode();
            prop_assert_eq!(&again[..4], &[msg[0], 0, msg[2], msg[3]][..]);
            if h.kind == Kind::Window {
                let _ = WindowAd::decode(body);
            }
            if h.kind == Kind::Wrote {
                prop_assert!(decode_wrote(body).is_ok());
            }
        }
    }

    /// Every header the encoder writes decodes to itself, with the body it carries.
    #[test]
    fn headers_round_trip(k in kind(), grant in any::<u16>(), data in proptest::collection::vec(any::<u8>(), 0..40)) {
        let body: Vec<u8> = match k {
            Kind::Data => data,
            Kind::Grant | Kind::Eof => Vec::new(),
            Kind::Window => vec![0; WINDOW_LEN],
            Kind::Wrote => encode_wrote(3, 4).to_vec(),
        };
        let h = Header { kind: k, grant };
        let mut msg = h.encode().to_vec();
        msg.extend_from_slice(&body);
        prop_assert_eq!(Header::decode(&msg), Ok((h, &body[..])));
    }

    /// A window from any 28 bytes: decoded only if its end fits the offset space, then it
    /// re-encodes to the same bytes; what it locates always lies inside it.
    #[test]
    fn windows_locate_only_inside(b in proptest::array::uniform28(any::<u8>()), off in any::<u64>(), len in any::<u64>()) {
        if let Ok(w) = WindowAd::decode(&b) {
            prop_assert_eq!(w.encode(), b);
            if let Some(addr) = w.locate(off, len) {
                let rel = off - w.offset;
                prop_assert!(off >= w.offset);
                prop_assert!(rel.checked_add(len).is_some_and(|e| e <= w.len));
                prop_assert_eq!(addr, w.addr.wrapping_add(rel));
            }
        } else {
            let offset = u64::from_be_bytes(b[..8].try_into().expect("8 bytes"));
            let len = u64::from_be_bytes(b[20..28].try_into().expect("8 bytes"));
            prop_assert!(offset.checked_add(len).is_none());
        }
        prop_assert!(WindowAd::decode(&b[..WINDOW_LEN - 1]).is_err());
    }

    /// WROTE notices round trip; any other length is refused.
    #[test]
    fn wrote_notices_round_trip(off in any::<u64>(), len in any::<u64>(), junk in proptest::collection::vec(any::<u8>(), 0..40)) {
        prop_assert_eq!(decode_wrote(&encode_wrote(off, len)), Ok((off, len)));
        prop_assert_eq!(decode_wrote(&junk).is_ok(), junk.len() == WROTE_LEN);
    }

    /// Any private data: a hello only with the magic, the version and usable slots, and then
    /// it re-encodes to the bytes it came from (reserved bytes aside).
    #[test]
    fn any_private_data_is_a_hello_or_refused(b in proptest::collection::vec(any::<u8>(), 0..40), slots in any::<u32>(), size in any::<u32>()) {
        if let Ok(h) = Hello::decode(&b) {
            prop_assert!(b.len() >= HELLO_LEN);
            prop_assert!(h.slots >= MIN_SLOTS && h.slot_size as usize > HEADER_LEN);
            let again = h.encode();
            prop_assert_eq!(&again[..5], &b[..5]);
            prop_assert_eq!(&again[8..], &b[8..HELLO_LEN]);
        }
        let h = Hello { slots, slot_size: size };
        let usable = slots >= MIN_SLOTS && size as usize > HEADER_LEN;
        match Hello::decode(&h.encode()) {
            Ok(back) => prop_assert!(usable && back == h),
            Err(_) => prop_assert!(!usable),
        }
    }
}
