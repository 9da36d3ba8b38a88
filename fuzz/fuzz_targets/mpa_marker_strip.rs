//! Marker stripping: arbitrary wire bytes at an arbitrary stream offset never panic, and what
//! strips cleanly re-inserts and strips again to the same FPDU.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softwarp_wire::mpa::marker;

fuzz_target!(|data: &[u8]| {
    if data.len() < 9 {
        return;
    }
    let (head, wire) = data.split_at(9);
    let mut off = [0u8; 8];
    off.copy_from_slice(&head[..8]);
    // Stream offsets are multiples of 4 for FPDUs (the API rejects others with an error).
    let stream_offset = u64::from_le_bytes(off) >> 16;
    let use_crc = head[8] & 1 == 1;
    let mut out = vec![0u8; wire.len()];
    if let Ok((consumed, written)) = marker::strip(wire, stream_offset, use_crc, &mut out) {
        assert!(consumed <= wire.len() && written <= consumed);
        let mut again = vec![0u8; consumed];
        let n = marker::insert(&out[..written], stream_offset, use_crc, &mut again)
            .expect("a stripped FPDU re-inserts");
        assert_eq!(n, consumed);
        let mut twice = vec![0u8; written];
        let (c2, w2) = marker::strip(&again[..n], stream_offset, use_crc, &mut twice)
            .expect("re-inserted FPDU strips");
        assert_eq!((c2, w2), (consumed, written));
        assert_eq!(twice, out[..written]);
    }
});
