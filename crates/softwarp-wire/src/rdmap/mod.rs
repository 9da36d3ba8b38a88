//! RFC 5040 RDMAP and the RFC 7306 extensions, on top of the [`crate::ddp`] headers.
//!
//! This module only encodes and decodes bytes: it never does I/O, never allocates and never
//! panics on any input. It works on one ULPDU (one DDP segment: the bytes after MPA's
//! `ULPDU_Length` and before pad and CRC).
//!
//! # What is here
//!
//! - [`ControlRepr`] and [`Opcode`]: the RDMAP control byte (RV = 1, 4-bit opcode) that RDMAP
//!   puts in the byte DDP reserves for its ULP, every opcode of RFC 5040 and RFC 7306, and the
//!   DDP buffer model and queue each one must use ([`Opcode::buffer_model`],
//!   [`Opcode::validate`]).
//! - [`ReadRequestRepr`]: the 28-byte RDMA Read Request header (RFC 5040 section 4.4).
//! - [`TerminateRepr`]: the Terminate header (RFC 5040 section 4.8) with the full error
//!   tables of RFC 5040, RFC 5041, RFC 5044 and RFC 6581 as typed enums ([`TerminateError`]),
//!   in the RFC bit layout or in Linux siw's ([`TerminateLayout`]).
//! - [`ImmediateDataRepr`], [`AtomicRequestRepr`], [`AtomicResponseRepr`]: RFC 7306.
//! - [`Segment`]: the one entry point for a whole ULPDU. [`Segment::parse`] validates DDP and
//!   RDMAP together and returns the placement information, the [`Message`] (opcode plus its
//!   own header) and the payload slice; [`Segment::emit_header`] writes everything but the
//!   payload so a sender can gather header and payload without copying. `Display` prints a
//!   segment on one line.
//!
//! # Opcodes, buffer models and queues
//!
//! | opcode | message | DDP model | queue |
//! | --- | --- | --- | --- |
//! | 0x0 | RDMA Write | tagged | |
//! | 0x1 | RDMA Read Request | untagged | 1 |
//! | 0x2 | RDMA Read Response | tagged | |
//! | 0x3 to 0x6 | Send, Send with Invalidate, Send with SE, Send with SE and Invalidate | untagged | 0 |
//! | 0x7 | Terminate | untagged | 2 |
//! | 0x8, 0x9 | Immediate Data, Immediate Data with SE (RFC 7306) | untagged | 0 |
//! | 0xA | Atomic Request (RFC 7306) | untagged | 1 |
//! | 0xB | Atomic Response (RFC 7306) | untagged | 3 |
//!
//! The opcode numbers and queue 3 come from the IANA "Remote Direct Data Placement (RDDP)"
//! registry (RDMAP Message Operation Codes, RDMAP DDP Untagged Queue Numbers). The registry
//! lists no queue of its own for Atomic Requests; they travel on queue 1 with the Read
//! Requests (RFC 7306; the text was not retrievable here, so check this against RFC 7306
//! section 5 before relying on interop with an atomics-capable RNIC). The registry assigns no opcode to "RDMA Write with Immediate Data" or "Send with
//! Immediate Data": the immediate data always travels in an Immediate Data message of its own
//! (0x8 or 0x9) next to the RDMA Write or Send it belongs to (RFC 7306 has the ordering rules,
//! the engine's business), so those operations are two segments here, not an [`Opcode`].
//!
//! # Linux siw's Terminate layout (a deliberate compatibility decision)
//!
//! RFC 5040 section 4.8 puts, in the first 32 bits of the Terminate header, Layer in the high
//! nibble of byte 0, EType in its low nibble, the Error Code in byte 1 and the Hdrct bits M, D,
//! R at 0x80, 0x40, 0x20 of byte 2. Linux siw fills the same word through little-endian C
//! bitfields, so on the wire it has Layer in the LOW nibble and EType in the HIGH nibble of
//! byte 0, and M, D, R at 0x01, 0x02, 0x04 of byte 2 (bits that RFC 5040 reserves). A real siw
//! Terminate (shared/interop/captures/siw-terminate-rping.pcap) starts `11 01 03 00`: layer
//! DDP, EType tagged buffer error, code base or bounds violation, M = D = 1.
//!
//! [`TerminateRepr::emit`] writes either layout (the [`TerminateRepr::layout`] field);
//! [`TerminateRepr::parse_with_layout`] reads a given one; [`TerminateRepr::parse`] (and so
//! [`Segment::parse`]) detects the layout with [`TerminateLayout::detect`]:
//!
//! 1. If any of the RFC Hdrct bits (0xE0 of byte 2) is set, the layout is RFC 5040: siw
//!    never sets them (they are its reserved bits).
//! 2. Otherwise, if any of siw's flag bits (0x07 of byte 2) is set, it is siw's: an RFC
//!    sender must send those reserved bits as zero.
//! 3. With no flag at all, the nibble order decides only if exactly one reading names a known
//!    (Layer, EType, Error Code) triple of the tables and that reading is siw's; in every other
//!    case RFC 5040 wins. RFC order is preferred because hardware RNICs follow the RFC and
//!    because several triples read validly both ways (siw's "RDMAP, remote operation error,
//!    invalid RDMAP version" `20 05 00 00` is also RFC's "LLP, MPA, local catastrophic error"):
//!    such a siw Terminate is misread, which costs a wrong reason in a log, never a wrong
//!    placement. An engine that knows its peer is siw can call
//!    [`TerminateRepr::parse_with_layout`] instead.
//!
//! What to send is the engine's choice: RFC layout is the standard; siw reads its own layout,
//! so a Terminate meant to be understood by a siw peer can be emitted with
//! [`TerminateLayout::LinuxSiw`].
//!
//! # RFC text
//!
//! Sentences quoted with `//#` were retrieved from the RFC text; where the exact text could
//! not be retrieved, the comment paraphrases it and names the section.

/// Declares a `Copy` enum for a code that arrives from the wire, with an `Unknown` variant for
/// values no table assigns (smoltcp's `enum_with_unknown!` idea) and lossless conversions
/// from and to the raw integer.
///
/// `From<raw>` never produces `Unknown(v)` for a value `v` that has a named variant.
macro_rules! enum_with_unknown {
    (
        $(#[$enum_attr:meta])*
        pub enum $name:ident($ty:ty) {
            $(
                $(#[$variant_attr:meta])*
                $variant:ident = $value:literal
            ),+ $(,)?
        }
    ) => {
        $(#[$enum_attr])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $(
                $(#[$variant_attr])*
                $variant,
            )+
            /// A value that no table known to this crate assigns, kept as received.
            Unknown($ty),
        }

        impl ::core::convert::From<$ty> for $name {
            fn from(value: $ty) -> Self {
                match value {
                    $( $value => $name::$variant, )+
                    other => $name::Unknown(other),
                }
            }
        }

        impl ::core::convert::From<$name> for $ty {
            fn from(value: $name) -> Self {
                match value {
                    $( $name::$variant => $value, )+
                    $name::Unknown(other) => other,
                }
            }
        }

        impl $name {
            /// Whether this value is one the tables name (not [`Self::Unknown`]).
            pub fn is_known(&self) -> bool {
                !matches!(self, $name::Unknown(_))
            }
        }
    };
}

mod atomic;
mod control;
mod immediate;
mod read_request;
mod segment;
mod terminate;

pub use atomic::{
    AtomicOpcode, AtomicRequestHeader, AtomicRequestRepr, AtomicResponseHeader, AtomicResponseRepr,
    ATOMIC_REQUEST_HEADER_LEN, ATOMIC_RESPONSE_HEADER_LEN,
};
pub use control::{queue, BufferModel, ControlRepr, Opcode, RDMAP_VERSION};
pub use immediate::{ImmediateDataRepr, IMMEDIATE_DATA_LEN};
pub use read_request::{ReadRequestHeader, ReadRequestRepr, READ_REQUEST_HEADER_LEN};
pub use segment::{Message, Placement, Segment};
pub use terminate::{
    DdpError, Layer, LlpError, MpaError, RdmapError, RemoteOperationError, RemoteProtectionError,
    TaggedBufferError, TerminateError, TerminateHeader, TerminateLayout, TerminateRepr,
    TerminatedRdmapHeader, UntaggedBufferError, TERMINATE_CONTROL_LEN,
};
