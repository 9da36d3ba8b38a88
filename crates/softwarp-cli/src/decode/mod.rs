//! Decoding iWARP traffic out of a capture: MPA frames and FPDUs of every TCP connection.
//!
//! The capture layer ([`crate::capture`]) rebuilds each direction's byte stream; this module
//! finds the MPA Request/Reply, learns what was negotiated, splits the rest into FPDUs, checks
//! CRCs and parses every DDP/RDMAP segment with `softwarp-wire`. It never does I/O: it decodes
//! bytes already in memory and returns [`Record`]s, printed by `softwarp decode`.

pub mod json;
pub mod record;

pub use json::to_json;
pub use record::{Item, Record};
