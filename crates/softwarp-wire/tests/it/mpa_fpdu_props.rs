//! Property tests for FPDU framing: emit then parse gives the same ULPDU, gathered emission
//! equals one-shot emission, corruption is caught by the CRC, MULPDU-sized FPDUs fit the EMSS,
//! and no input of any length makes parsing or the view panic.
#![allow(clippy::unwrap_used)] // tests may unwrap

use proptest::prelude::*;
use softwarp_wire::crc::Crc32c;
use softwarp_wire::mpa::fpdu::{
    check_crc, emit_header, emit_trailer, fpdu_len, mulpdu, pad_len, peek, Fpdu, FpduPacket,
    HEADER_LEN, MAX_TRAILER_LEN,
};
use softwarp_wire::mpa::marker::MarkerLayout;
use softwarp_wire::WireError;

proptest! {
    #[test]
    fn emit_then_parse_gives_the_same_ulpdu(
        ulpdu in proptest::collection::vec(any::<u8>(), 0..3000),
        use_crc in any::<bool>(),
        next in proptest::collection::vec(any::<u8>(), 0..8),
    ) {
        let fpdu = Fpdu { ulpdu: &ulpdu };
        let mut buf = vec![0u8; fpdu.buffer_len() + next.len()];
        let n = fpdu.emit(&mut buf, use_crc).unwrap();
        prop_assert_eq!(n, fpdu_len(ulpdu.len()));
        prop_assert_eq!(n % 4, 0);
        prop_assert_eq!(n, HEADER_LEN + ulpdu.len() + pad_len(ulpdu.len()) + 4);
        buf[n..].copy_from_slice(&next);
        prop_assert_eq!(peek(&buf), Ok(n));
        let (parsed, used) = Fpdu::parse(&buf, use_crc).unwrap();
        prop_assert_eq!(used, n);
        prop_assert_eq!(parsed, fpdu);
        // A receiver without CRC accepts what a CRC sender sent, and vice versa for zeros.
        prop_assert!(Fpdu::parse(&buf, false).is_ok());
    }

    #[test]
    fn gathered_header_slices_trailer_equal_one_shot_emit(
        ulpdu in proptest::collection::vec(any::<u8>(), 0..2000),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..5),
        use_crc in any::<bool>(),
    ) {
        let mut points: Vec<usize> = cuts.iter().map(|c| c.index(ulpdu.len() + 1)).collect();
        points.sort_unstable();
        let mut slices: Vec<&[u8]> = Vec::new();
        let mut start = 0;
        for p in points {
            slices.push(&ulpdu[start..p]);
            start = p;
        }
        slices.push(&ulpdu[start..]);

        let mut header = [0u8; HEADER_LEN];
        let mut trailer = [0u8; MAX_TRAILER_LEN];
        emit_header(ulpdu.len(), &mut header).unwrap();
        let t = emit_trailer(&slices, use_crc, &mut trailer).unwrap();
        let mut gathered = header.to_vec();
        for s in &slices {
            gathered.extend_from_slice(s);
        }
        gathered.extend_from_slice(&trailer[..t]);

        let mut one_shot = vec![0u8; fpdu_len(ulpdu.len())];
        Fpdu { ulpdu: &ulpdu }.emit(&mut one_shot, use_crc).unwrap();
        prop_assert_eq!(gathered, one_shot);
    }

    #[test]
    fn any_single_bit_flip_before_the_crc_is_detected(
        ulpdu in proptest::collection::vec(any::<u8>(), 0..600),
        at in any::<prop::sample::Index>(),
        bit in 0u8..8,
    ) {
        let mut buf = vec![0u8; fpdu_len(ulpdu.len())];
        Fpdu { ulpdu: &ulpdu }.emit(&mut buf, true).unwrap();
        // Flip a bit in the ULPDU, pad or CRC (not ULPDU_Length, which would reframe).
        let i = HEADER_LEN + at.index(buf.len() - HEADER_LEN);
        buf[i] ^= 1 << bit;
        let mismatch = matches!(Fpdu::parse(&buf, true), Err(WireError::MpaCrcMismatch { .. }));
        prop_assert!(mismatch);
    }

    #[test]
    fn streaming_receiver_check_matches_parse(
        ulpdu in proptest::collection::vec(any::<u8>(), 0..600),
        pad_bytes in any::<[u8; 3]>(),
    ) {
        let mut buf = vec![0u8; fpdu_len(ulpdu.len())];
        Fpdu { ulpdu: &ulpdu }.emit(&mut buf, false).unwrap();
        // Dirty pad, then a CRC computed the way a sender with stale pad bytes would.
        let pad = pad_len(ulpdu.len());
        let crc_at = buf.len() - 4;
        buf[crc_at - pad..crc_at].copy_from_slice(&pad_bytes[..pad]);
        FpduPacket::new_checked(&mut buf[..]).unwrap().fill_crc(true);
        let mut crc = Crc32c::new();
        crc.update(&buf[..HEADER_LEN]);
        crc.update(&buf[HEADER_LEN..crc_at]);
        let field: [u8; 4] = buf[crc_at..].try_into().unwrap();
        prop_assert_eq!(check_crc(crc.finish(), field), Ok(()));
        let (parsed, _) = Fpdu::parse(&buf, true).unwrap();
        prop_assert_eq!(parsed.ulpdu, &ulpdu[..]);
    }

    #[test]
    fn mulpdu_sized_fpdus_fit_the_emss(emss in 0usize..70_000, offset in 0u64..4096) {
        let plain = mulpdu(emss, false);
        if plain > 0 {
            prop_assert!(fpdu_len(plain) <= emss);
        }
        let marked = mulpdu(emss, true);
        prop_assert!(marked <= plain);
        if marked > 0 && fpdu_len(marked) <= 65_000 {
            let layout = MarkerLayout::new(offset * 4, fpdu_len(marked)).unwrap();
            prop_assert!(layout.wire_len() <= emss, "wire {} emss {}", layout.wire_len(), emss);
        }
    }

    #[test]
    fn parse_of_arbitrary_bytes_never_panics(
        bytes in proptest::collection::vec(any::<u8>(), 0..1200),
        use_crc in any::<bool>(),
    ) {
        let _ = peek(&bytes);
        match Fpdu::parse(&bytes, use_crc) {
            Ok((fpdu, used)) => {
                prop_assert!(used <= bytes.len());
                prop_assert_eq!(used, fpdu_len(fpdu.ulpdu.len()));
            }
            Err(WireError::Truncated { .. } | WireError::MpaCrcMismatch { .. }) => {}
            Err(other) => prop_assert!(false, "unexpected {:?}", other),
        }
        let view = FpduPacket::new_unchecked(&bytes[..]);
        let _ = (
            view.ulpdu_length(),
            view.fpdu_len(),
            view.ulpdu(),
            view.pad(),
            view.crc_field(),
            view.computed_crc(),
            view.check_crc(),
            view.check_len(),
        );
        let mut owned = bytes.clone();
        let mut view = FpduPacket::new_unchecked(&mut owned[..]);
        view.clear_pad();
        view.fill_crc(true);
        let _ = view.ulpdu_mut().len();
        view.set_ulpdu_length(0xffff);
        view.fill_crc(false);
    }

    #[test]
    fn small_ulpdu_lengths_frame_exactly(len in 0u16..=u16::MAX) {
        let bytes = len.to_be_bytes();
        prop_assert_eq!(peek(&bytes), Ok(fpdu_len(usize::from(len))));
    }
}
