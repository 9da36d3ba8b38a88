//! Property tests for the CRC32c helpers: streaming over any split equals the one-shot value,
//! and the wire byte conversions are inverse.
#![allow(clippy::unwrap_used)] // tests may unwrap

use proptest::prelude::*;
use softwarp_wire::crc::{crc32c, crc32c_slices, from_wire, to_wire, Crc32c};

proptest! {
    #[test]
    fn streaming_over_any_split_equals_one_shot(
        data in proptest::collection::vec(any::<u8>(), 0..2048),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
    ) {
        let mut points: Vec<usize> = cuts.iter().map(|c| c.index(data.len() + 1)).collect();
        points.sort_unstable();
        let mut slices = Vec::new();
        let mut start = 0;
        for p in points {
            slices.push(&data[start..p]);
            start = p;
        }
        slices.push(&data[start..]);

        let mut crc = Crc32c::new();
        for s in &slices {
            crc.update(s);
        }
        prop_assert_eq!(crc.finish(), crc32c(&data));
        prop_assert_eq!(crc32c_slices(&slices), crc32c(&data));
        prop_assert_eq!(crc.finish_wire(), to_wire(crc32c(&data)));
    }

    #[test]
    fn wire_bytes_round_trip(value in any::<u32>()) {
        prop_assert_eq!(from_wire(to_wire(value)), value);
        prop_assert_eq!(to_wire(value), value.to_le_bytes());
    }
}
