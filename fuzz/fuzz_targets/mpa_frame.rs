//! MPA Request/Reply: parsing arbitrary bytes never panics, the incremental length agrees with
//! the full parse, and whatever parses re-emits to a frame that parses to the same value.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softwarp_wire::mpa::frame::MpaFrame;

fuzz_target!(|data: &[u8]| {
    let needed = MpaFrame::needed(data);
    match MpaFrame::parse(data) {
        Ok((frame, len)) => {
            assert!(len <= data.len());
            assert_eq!(needed, Ok(0));
            let mut out = [0u8; 20 + 512];
            let n = frame.emit(&mut out).expect("a parsed frame re-emits");
            assert_eq!(n, frame.buffer_len());
            let (again, m) = MpaFrame::parse(&out[..n]).expect("re-emitted frame parses");
            assert_eq!(m, n);
            assert_eq!(again, frame);
        }
        Err(_) => {
            // A prefix that the incremental check accepts may still be incomplete; nothing to do.
        }
    }
});
