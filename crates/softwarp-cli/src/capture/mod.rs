//! Reading packet captures and rebuilding the TCP byte streams inside them.
//!
//! This is the bottom half of `softwarp decode`: it knows nothing about iWARP. It reads pcap
//! and pcapng files ([`mod@file`]), peels link, IP and TCP headers off each frame ([`packet`]),
//! reassembles each direction of each TCP connection in sequence order ([`reassembly`]) and
//! hands the in-order bytes, tagged with the pcap frame they arrived in, to a consumer
//! ([`connection`], [`stream`]). It works on bytes already in memory: it never opens files or
//! sockets itself, and memory held per direction is bounded.

pub mod connection;
pub mod error;
pub mod file;
pub mod packet;
pub mod reassembly;
pub mod stream;

pub use connection::{
    Connection, ConnectionId, ConnectionTracker, Direction, FlowEvent, FlowEventKind,
};
pub use error::CaptureError;
pub use file::{CaptureFormat, CaptureReader, Frame, LinkType};
pub use packet::{tcp_segment, TcpSegment};
pub use reassembly::{StreamEvent, StreamReassembler};
pub use stream::StreamBuffer;
