//! Decoding iWARP traffic out of a capture: MPA frames and FPDUs of every TCP connection.
//!
//! The capture layer ([`crate::capture`]) rebuilds each direction's byte stream; this module
//! finds the MPA Request/Reply, learns what was negotiated (CRC, markers, rejection), splits
//! the rest into FPDUs (removing markers when they are in use), checks CRCs and parses every
//! DDP/RDMAP segment with `softwarp-wire`. Each MPA frame and FPDU becomes a [`Record`],
//! reported in the frame in which it became complete, as Wireshark does, so that output can
//! be compared with `iwarp-decode` line by line. It never does I/O: it decodes bytes already
//! in memory.

pub mod dump;
pub mod json;
pub mod record;
mod segment;
mod session;

use std::fmt;

pub use json::{output_to_json, to_json};
pub use record::{Item, Record};

use crate::capture::{
    tcp_segment, CaptureError, CaptureReader, ConnectionId, ConnectionTracker, FlowEvent,
    StreamEvent, TcpSegment,
};
use session::Session;

/// One thing `softwarp decode` reports, in capture order.
#[derive(Debug)]
pub enum Output {
    /// An MPA frame, an FPDU or a decoding error on a connection.
    Record(Box<Record>),
    /// A problem with the capture itself (a frame that cannot be parsed, a cut file).
    CaptureError(CaptureError),
}

impl fmt::Display for Output {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Output::Record(r) => write!(f, "{r}"),
            Output::CaptureError(e) => write!(f, "{:>6} {:<12} {:<9} {e}", "-", "-", "ERROR"),
        }
    }
}

/// Counts for a whole capture.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    /// Frames read.
    pub frames: u64,
    /// TCP connections seen.
    pub connections: usize,
    /// Connections that started with an MPA frame.
    pub iwarp_connections: usize,
    /// MPA Request/Reply frames decoded.
    pub mpa_frames: usize,
    /// FPDUs decoded (with or without a good CRC and a valid segment).
    pub fpdus: usize,
    /// FPDUs whose CRC was negotiated and wrong.
    pub bad_crcs: usize,
    /// FPDUs whose ULPDU the DDP/RDMAP codec refused.
    pub bad_segments: usize,
    /// Error records plus capture errors.
    pub errors: usize,
}

impl Summary {
    /// True when everything decoded cleanly.
    pub fn is_clean(&self) -> bool {
        self.bad_crcs == 0 && self.bad_segments == 0 && self.errors == 0
    }

    fn count(&mut self, output: &Output) {
        match output {
            Output::CaptureError(_) => self.errors += 1,
            Output::Record(r) => match &r.item {
                Item::MpaFrame(_) => self.mpa_frames += 1,
                Item::Fpdu(p) => {
                    self.fpdus += 1;
                    if matches!(p.crc, record::CrcRecord::Bad { .. }) {
                        self.bad_crcs += 1;
                    }
                    if p.segment.is_err() {
                        self.bad_segments += 1;
                    }
                }
                Item::Error(_) => self.errors += 1,
            },
        }
    }
}

/// Decodes a whole capture (`bytes`: a pcap or pcapng file) and hands every [`Output`] to
/// `sink` in capture order.
///
/// Fails only when `bytes` is not a capture at all; damage inside the file is reported
/// through `sink` and decoding goes on as far as it can.
pub fn decode_capture(bytes: &[u8], sink: &mut dyn FnMut(Output)) -> Result<Summary, CaptureError> {
    let reader = CaptureReader::new(bytes)?;
    let mut decoder = Decoder::default();
    let mut summary = Summary::default();
    let mut emit = |output: Output, summary: &mut Summary| {
        summary.count(&output);
        sink(output);
    };
    for frame in reader {
        let frame = match frame {
            Ok(frame) => frame,
            Err(e) => {
                emit(Output::CaptureError(e), &mut summary);
                break;
            }
        };
        summary.frames += 1;
        let mut outputs = Vec::new();
        match tcp_segment(frame.number, frame.link, &frame.data) {
            Ok(Some(segment)) => decoder.segment(frame.number, &segment, &mut |r| {
                outputs.push(Output::Record(Box::new(r)));
            }),
            Ok(None) => {}
            Err(e) => outputs.push(Output::CaptureError(e)),
        }
        for output in outputs {
            emit(output, &mut summary);
        }
    }
    let mut outputs = Vec::new();
    decoder.finish(&mut |r| outputs.push(Output::Record(Box::new(r))));
    for output in outputs {
        emit(output, &mut summary);
    }
    summary.connections = decoder.tracker.connections().count();
    summary.iwarp_connections = decoder
        .sessions
        .iter()
        .flatten()
        .filter(|s| s.is_iwarp())
        .count();
    Ok(summary)
}

/// Decodes a whole capture into a list (see [`decode_capture`]).
pub fn decode_to_vec(bytes: &[u8]) -> Result<(Vec<Output>, Summary), CaptureError> {
    let mut outputs = Vec::new();
    let summary = decode_capture(bytes, &mut |o| outputs.push(o))?;
    Ok((outputs, summary))
}

/// Connection tracking plus one [`Session`] per connection.
#[derive(Debug, Default)]
struct Decoder {
    tracker: ConnectionTracker,
    /// Indexed by connection number.
    sessions: Vec<Option<Session>>,
}

/// Hands one stream event to its connection's session; a session is created on its
/// connection's first event (connections without payload never get one).
fn dispatch(
    sessions: &mut Vec<Option<Session>>,
    event: FlowEvent<'_>,
    out: &mut dyn FnMut(Record),
) {
    let ConnectionId(index) = event.connection;
    if sessions.len() <= index {
        sessions.resize_with(index + 1, || None);
    }
    let Some(slot) = sessions.get_mut(index) else {
        return;
    };
    let session = slot.get_or_insert_with(|| Session::new(event.endpoints));
    match event.kind {
        StreamEvent::Data {
            offset,
            arrived,
            delivered,
            bytes,
        } => session.data(event.direction, offset, arrived, delivered, bytes, out),
        StreamEvent::Gap { offset, len, frame } => {
            session.gap(event.direction, offset, len, frame, out);
        }
    }
}

impl Decoder {
    fn segment(&mut self, frame: u64, segment: &TcpSegment<'_>, out: &mut dyn FnMut(Record)) {
        let sessions = &mut self.sessions;
        self.tracker
            .segment(frame, segment, &mut |event| dispatch(sessions, event, out));
    }

    fn finish(&mut self, out: &mut dyn FnMut(Record)) {
        let sessions = &mut self.sessions;
        self.tracker
            .finish(&mut |event| dispatch(sessions, event, out));
        for session in self.sessions.iter_mut().flatten() {
            session.finish(out);
        }
    }
}
