//! The engine's receive path from arbitrary bytes (issue 17): byte 0 chooses CRC, markers
//! and RFC 7306, byte 1 staging and how many read sizes follow, then the read sizes, then
//! the stream, fed to a connected QP with guarded registrations. Fails on a panic, an
//! engine bug report, or a byte changed outside what the peer may write. The harness is
//! the one the proptest `crates/softwarp-engine/tests/it/rx_fuzz.rs` runs.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../crates/softwarp-engine/tests/it/rx_fuzz/harness.rs"]
mod harness;

fuzz_target!(|data: &[u8]| {
    harness::run_input(data);
});
