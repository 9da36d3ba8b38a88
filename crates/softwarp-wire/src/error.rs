//! The one error type of the wire codecs.
//!
//! Every variant says which message and which field was wrong, so that the engine can map it
//! to the Terminate that RFC 5040/5041/5044 prescribe (peer misbehaved), to an MPA reject
//! (peer incompatible), or to an API error (local misuse, e.g. an output buffer too small).

use thiserror::Error;

/// What went wrong while parsing or emitting a wire format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum WireError {
    /// The input ends before the named structure does.
    #[error("{what}: truncated, need {need} bytes but only {have} are present")]
    Truncated {
        /// The structure being parsed, e.g. "DDP tagged header".
        what: &'static str,
        /// Bytes required.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// The output buffer cannot hold what is being emitted (local misuse).
    #[error("{what}: output buffer too small, need {need} bytes but only {have} are available")]
    BufferTooSmall {
        /// The structure being emitted.
        what: &'static str,
        /// Bytes required.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// Bytes remain after a structure that must fill its input exactly.
    #[error("{what}: {extra} unexpected trailing bytes")]
    TrailingBytes {
        /// The structure being parsed.
        what: &'static str,
        /// Number of bytes left over.
        extra: usize,
    },
    /// A field holds a value the RFC forbids.
    #[error("{what}: field {field} has invalid value {value:#x}")]
    InvalidField {
        /// The structure being parsed or emitted.
        what: &'static str,
        /// The field, named as in the RFC.
        field: &'static str,
        /// The offending value.
        value: u64,
    },

    // --- MPA (RFC 5044, RFC 6581) ---
    /// The 16-byte key is neither "MPA ID Req Frame" nor "MPA ID Rep Frame".
    #[error("MPA frame: key is not \"MPA ID Req Frame\" or \"MPA ID Rep Frame\"")]
    MpaBadKey,
    /// The MPA revision is not 1 or 2.
    #[error("MPA frame: unsupported revision {0} (1 and 2 are supported)")]
    MpaUnsupportedRevision(u8),
    /// Private data longer than the 512 bytes RFC 5044 allows.
    #[error("MPA frame: private data length {0} exceeds the limit of 512 bytes")]
    MpaPrivateDataTooLong(usize),
    /// An FPDU's CRC field does not match the CRC32c of its contents.
    #[error("FPDU: CRC mismatch, received {received:#010x}, computed {computed:#010x}")]
    MpaCrcMismatch {
        /// The value in the CRC field.
        received: u32,
        /// The value computed over length, ULPDU and pad.
        computed: u32,
    },
    /// A ULPDU larger than the MULPDU in force, or than the 16-bit length allows.
    #[error("FPDU: ULPDU length {len} exceeds the maximum {max}")]
    MpaUlpduTooLong {
        /// Length requested or received.
        len: usize,
        /// The maximum in force.
        max: usize,
    },
    /// A marker does not point back at the start of the FPDU that contains it.
    #[error("MPA marker at stream offset {stream_offset}: points {pointer} bytes back, expected {expected}")]
    MpaBadMarker {
        /// Stream offset of the marker.
        stream_offset: u64,
        /// The FPDUPTR value found.
        pointer: u16,
        /// The value that was expected.
        expected: u16,
    },

    // --- DDP (RFC 5041) ---
    /// DDP version (DV) is not 1.
    #[error("DDP header: version {0} is not supported (expected 1)")]
    DdpBadVersion(u8),
    /// An untagged segment names a queue number RDMAP does not define (RFC 5040: 0, 1, 2; RFC 7306 adds 3).
    #[error("DDP untagged header: invalid queue number {0}")]
    DdpInvalidQueueNumber(u32),

    // --- RDMAP (RFC 5040, RFC 7306) ---
    /// RDMAP version (RV) is not 1.
    #[error("RDMAP header: version {0} is not supported (expected 1)")]
    RdmapBadVersion(u8),
    /// The RDMAP opcode is not defined by RFC 5040 or RFC 7306.
    #[error("RDMAP header: unknown opcode {0:#x}")]
    RdmapUnknownOpcode(u8),
    /// The opcode is defined but not valid with this DDP buffer model or queue number.
    #[error("RDMAP header: opcode {opcode:#x} is not valid with tagged={tagged} queue={queue}")]
    RdmapOpcodeMismatch {
        /// The RDMAP opcode.
        opcode: u8,
        /// The DDP T flag.
        tagged: bool,
        /// The DDP queue number (untagged only; 0 when tagged).
        queue: u32,
    },
}
