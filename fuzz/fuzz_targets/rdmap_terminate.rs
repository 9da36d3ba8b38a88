//! Terminate headers: arbitrary bytes never panic in either layout (or with detection), and a
//! parsed Terminate re-emits in its layout to bytes that parse back to it.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softwarp_wire::rdmap::{TerminateLayout, TerminateRepr};

fuzz_target!(|data: &[u8]| {
    let _ = TerminateLayout::detect_in(data);
    let parsed = [
        TerminateRepr::parse(data),
        TerminateRepr::parse_with_layout(data, TerminateLayout::Rfc5040),
        TerminateRepr::parse_with_layout(data, TerminateLayout::LinuxSiw),
    ];
    for (term, _) in parsed.into_iter().flatten() {
        let mut out = vec![0u8; term.buffer_len()];
        let n = term.emit(&mut out).expect("a parsed Terminate re-emits");
        let (again, m) = TerminateRepr::parse_with_layout(&out[..n], term.layout)
            .expect("re-emitted Terminate parses");
        assert_eq!(m, n);
        assert_eq!(again, term);
    }
});
