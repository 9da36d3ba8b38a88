//! Sans-IO codecs for every iWARP wire format.
//!
//! This crate parses from `&[u8]` and emits into `&mut [u8]`. It never allocates, never does
//! I/O, and never panics on any input: every malformed or truncated input yields a typed
//! [`WireError`] that names the field that was wrong.
//!
//! Layers, bottom up (each module quotes the RFC clauses it implements, `//#` style):
//! - [`crc`]: CRC32c (RFC 3720 B.4) as MPA uses it, computed over gathered slices.
//! - [`mpa`]: RFC 5044 MPA Request/Reply frames with RFC 6581 enhanced (v2) fields, FPDU
//!   framing (ULPDU_Length, pad, CRC) and markers.
//! - [`ddp`]: RFC 5041 tagged and untagged DDP segment headers.
//! - [`rdmap`]: RFC 5040 RDMAP control, opcodes, Read Request and Terminate, and the RFC 7306
//!   extensions (immediate data, atomics).
// `unsafe` only in `crc` (a call into a `#[target_feature]` function after the CPU feature
// was detected); the workspace lint denies it everywhere else.
#![cfg_attr(
    not(test),
    warn(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub mod crc;
pub mod ddp;
pub mod error;
pub mod mpa;
pub mod rdmap;

pub use error::WireError;
