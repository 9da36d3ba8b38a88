//! Property tests of the component dump reader: it is input from outside (a file, a
//! collector's stream), so no bytes make it panic, a cut dump is never taken for a whole
//! one, and a damaged one is reported.

#![allow(clippy::unwrap_used)]

use std::sync::OnceLock;

use proptest::prelude::*;
use softwarp_ras::control::DefaultHandler;
use softwarp_ras::dump::{self, DumpError};

/// A real dump of this process (with a few records of its own).
fn real_dump() -> &'static [u8] {
    static DUMP: OnceLock<Vec<u8>> = OnceLock::new();
    DUMP.get_or_init(|| {
        for i in 0..20 {
            softwarp_ras::sw_event!(Ras, 1, qpn = i, "dump property record {}", i);
        }
        dump::collect(&DefaultHandler, "property test").unwrap()
    })
}

#[test]
fn a_real_dump_reads_back_whole() {
    let d = dump::parse(real_dump()).unwrap();
    assert!(d.is_complete(), "{:?}", d.error);
    assert_eq!(d.process().unwrap().reason, "property test");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = dump::parse(&bytes);
        let mut with_magic = b"SOFTWARP-DUMP 1\n".to_vec();
        with_magic.extend_from_slice(&bytes);
        let _ = dump::parse(&with_magic);
    }

    #[test]
    fn a_cut_dump_is_reported_as_truncated(frac in 0.0f64..1.0) {
        let bytes = real_dump();
        let cut = ((bytes.len() as f64) * frac) as usize;
        match dump::parse(&bytes[..cut]) {
            Ok(d) => prop_assert!(
                matches!(d.error, Some(DumpError::Truncated { .. })),
                "cut at {} of {}: {:?}", cut, bytes.len(), d.error
            ),
            // Cut inside the header line.
            Err(e) => prop_assert!(cut < 16, "cut at {}: {}", cut, e),
        }
    }

    #[test]
    fn a_damaged_dump_is_never_taken_for_a_sound_one(
        at in any::<prop::sample::Index>(),
        xor in 1u8..=255,
    ) {
        let mut bytes = real_dump().to_vec();
        let i = at.index(bytes.len());
        bytes[i] ^= xor;
        if let Ok(d) = dump::parse(&bytes) {
            prop_assert!(!d.is_complete(), "byte {} ^ {:#x} went unnoticed", i, xor);
        }
    }

    #[test]
    fn a_marker_line_with_any_text_never_panics(
        name in "[ -~]{0,80}",
        len in any::<u64>(),
        body in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut bytes = format!(
            "SOFTWARP-DUMP 1\n=== SOFTWARP-DUMP SECTION {name} {len} fnv1a64:{:016x} ===\n",
            dump::section_hash(&name, &body)
        )
        .into_bytes();
        bytes.extend_from_slice(&body);
        bytes.extend_from_slice(b"\n=== SOFTWARP-DUMP END 1 ===\n");
        let _ = dump::parse(&bytes);
    }
}
