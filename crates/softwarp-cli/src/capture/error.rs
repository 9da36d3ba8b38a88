//! Errors from reading a capture file or the packets inside it.

use thiserror::Error;

/// What was wrong with a capture file or one of its frames.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CaptureError {
    /// The file starts with neither a pcap nor a pcapng magic number.
    #[error("not a pcap or pcapng file (magic number {magic:#010x})")]
    NotACapture {
        /// The first four bytes, big-endian.
        magic: u32,
    },
    /// The file header or section header could not be parsed.
    #[error("capture file header: {0}")]
    BadHeader(pcap_file::PcapError),
    /// The file ends in the middle of a record.
    #[error("capture ends in the middle of the record after frame {after_frame}")]
    TruncatedRecord {
        /// The last complete frame (0 when no frame was complete).
        after_frame: u64,
    },
    /// A record could not be parsed; the rest of the file is unreadable.
    #[error("capture record after frame {after_frame}: {source}")]
    BadRecord {
        /// The last complete frame (0 when no frame was complete).
        after_frame: u64,
        /// What pcap-file reported.
        source: pcap_file::PcapError,
    },
    /// A frame's link, IP or TCP headers are malformed (the frame is skipped).
    #[error("frame {frame}: malformed packet: {reason}")]
    MalformedPacket {
        /// The frame number (1-based, as Wireshark counts).
        frame: u64,
        /// What the header parser reported.
        reason: String,
    },
    /// The capture uses a link type this tool does not decode (the frame is skipped).
    #[error("frame {frame}: unsupported link type {link}")]
    UnsupportedLinkType {
        /// The frame number.
        frame: u64,
        /// The pcap LINKTYPE_ value.
        link: u32,
    },
}
