//! FPDU framing: `peek` and `parse` never panic on arbitrary bytes, agree on the length, and a
//! parsed FPDU re-emits (with zero pad) to bytes that parse to the same ULPDU.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softwarp_wire::mpa::fpdu::{self, Fpdu};

fuzz_target!(|data: &[u8]| {
    let Some((&flags, data)) = data.split_first() else {
        return;
    };
    let use_crc = flags & 1 == 1;
    let peeked = fpdu::peek(data);
    if let Ok((parsed, len)) = Fpdu::parse(data, use_crc) {
        assert_eq!(peeked, Ok(len));
        let mut out = vec![0u8; parsed.buffer_len()];
        let n = parsed.emit(&mut out, use_crc).expect("a parsed FPDU re-emits");
        let (again, m) = Fpdu::parse(&out[..n], use_crc).expect("re-emitted FPDU parses");
        assert_eq!((again, m), (parsed, len));
    }
});
