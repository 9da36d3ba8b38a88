//! Whole ULPDUs (DDP + RDMAP): arbitrary bytes never panic in any Terminate layout, and a
//! parsed segment re-emits to bytes that parse to the same segment.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softwarp_wire::rdmap::{Segment, TerminateLayout};

fn check(seg: Segment<'_>, reparse: impl Fn(&[u8]) -> Segment<'_>) {
    let mut out = vec![0u8; seg.buffer_len()];
    let n = seg.emit(&mut out).expect("a parsed segment re-emits");
    assert_eq!(n, seg.buffer_len());
    let mut hdr = vec![0u8; seg.header_len()];
    assert_eq!(seg.emit_header(&mut hdr), Ok(seg.header_len()));
    assert_eq!(&out[..seg.header_len()], &hdr[..]);
    assert_eq!(reparse(&out[..n]), seg);
}

fuzz_target!(|data: &[u8]| {
    if let Ok(seg) = Segment::parse(data) {
        let _ = seg.to_string();
        check(seg, |b| Segment::parse(b).expect("re-emitted segment parses"));
    }
    for layout in [TerminateLayout::Rfc5040, TerminateLayout::LinuxSiw] {
        if let Ok(seg) = Segment::parse_with_terminate_layout(data, layout) {
            check(seg, |b| {
                Segment::parse_with_terminate_layout(b, layout).expect("re-emitted segment parses")
            });
        }
    }
});
