//! MPA, Marker PDU Aligned framing (RFC 5044), with the RFC 6581 enhanced connection setup.
//!
//! MPA sits between TCP and DDP. A connection starts with one MPA Request (initiator to
//! responder) and one MPA Reply ([`frame`]); after that each direction is a stream of FPDUs
//! ([`fpdu`]): a 2-byte ULPDU_Length, the ULPDU (one DDP segment), pad to a 4-byte boundary and
//! a CRC32c ([`crate::crc`]), with an optional Marker every 512 octets of the stream
//! ([`marker`]) when a peer asked for markers.
//!
//! Everything here is sans-IO: it parses from `&[u8]` and emits into `&mut [u8]`, never
//! allocates, never does I/O and never panics on any input. Malformed input gives a typed
//! [`WireError`](crate::WireError).
//!
//! Sending is designed for gathered output (header, MR slices, pad and CRC in one `writev`):
//! [`fpdu::emit_header`] and [`fpdu::emit_trailer`] build the small pieces around payload
//! slices that stay where they are, and [`marker::MarkedSlices`] splits those slices at marker
//! positions when markers are in use. Receiving can go through [`fpdu::peek`] (how long is the
//! next FPDU) and [`fpdu::Fpdu::parse`], or a receiver reading the payload straight into its
//! destination can feed the pieces to a [`crate::crc::Crc32c`] and call [`fpdu::check_crc`].

pub mod fpdu;
pub mod frame;
pub mod marker;

pub use fpdu::{Fpdu, FpduPacket};
pub use frame::{EnhancedParams, MpaFrame, MpaFrameKind, MpaFramePacket, MpaRevision, RtrFlags};
pub use marker::{Marker, MarkerLayout};
