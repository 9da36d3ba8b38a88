//! DDP headers: arbitrary bytes never panic, and a parsed header re-emits to the same bytes
//! (reserved bits aside) that parse to the same value.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softwarp_wire::ddp::HeaderRepr;

fuzz_target!(|data: &[u8]| {
    for parse in [HeaderRepr::parse, HeaderRepr::parse_any_version] {
        if let Ok((hdr, len)) = parse(data) {
            assert_eq!(hdr.buffer_len(), len);
            let mut out = [0u8; 32];
            let n = hdr.emit(&mut out).expect("a parsed header re-emits");
            assert_eq!(n, len);
            let (again, m) = parse(&out[..n]).expect("re-emitted header parses");
            assert_eq!((again, m), (hdr, len));
        }
    }
});
