//! One TCP connection seen as iWARP: the MPA Request and Reply, then FPDUs in both directions.
//!
//! Each direction starts with an MPA frame. Once both frames are known, the negotiated CRC
//! and marker use is fixed and every later byte of each direction is split into FPDUs.
//! Bytes of a direction that arrive before the negotiation is complete wait in its buffer.
//!
//! Errors: a malformed PDU that leaves the framing intact (bad CRC, a ULPDU the DDP/RDMAP
//! codec refuses) is reported on its own line and decoding goes on. An error that loses the
//! framing (a bad MPA frame, a hole in the capture, a bad marker) is reported once and ends
//! decoding of that direction; the other direction carries on. A connection whose first bytes
//! are not an MPA frame is not iWARP and is skipped silently. No I/O here.

use std::net::SocketAddr;

use softwarp_wire::mpa::{fpdu, marker, FpduPacket, MpaFrame, MpaFrameKind, MpaFramePacket};
use softwarp_wire::{crc, WireError};

use super::record::{
    CrcRecord, EnhancedRecord, ErrorRecord, FpduRecord, Item, MpaFrameRecord, Record,
};
use super::segment::segment_record;
use crate::capture::stream::{Span, StreamBuffer};
use crate::capture::{Connection, Direction};

/// Most unconsumed bytes one direction may hold: the longest FPDU (65535-byte ULPDU, pad,
/// CRC and the markers inside it, about 66 KB) plus one more TCP segment of up to 64 KB.
const STREAM_LIMIT: usize = 256 * 1024;

/// What was negotiated, once both MPA frames are known.
#[derive(Debug, Clone, Copy)]
struct Mode {
    /// CRC32c in use in both directions.
    crc: bool,
    /// Markers in the FPDUs sent in each direction (index: [`dir_index`]).
    markers: [bool; 2],
    /// The Reply rejected the connection: no FPDUs follow.
    rejected: bool,
}

/// The MPA frame a direction began with.
#[derive(Debug, Clone, Copy)]
struct FrameSeen {
    kind: MpaFrameKind,
    markers: bool,
    crc: bool,
    reject: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for this direction's MPA frame.
    Frame,
    /// Frame seen; waiting for the other direction's.
    Negotiating,
    /// Splitting FPDUs.
    Fpdus,
    /// Nothing more is decoded in this direction.
    Done,
}

#[derive(Debug)]
struct Half {
    buf: StreamBuffer,
    phase: Phase,
    /// TCP stream offset of the first byte after this direction's MPA frame: FPDU stream
    /// offset 0, where markers are counted from.
    fpdu_base: u64,
    frame: Option<FrameSeen>,
    /// A fatal error or the end of the connection has been reported for this direction.
    closed_reported: bool,
}

impl Half {
    fn new() -> Self {
        Self {
            buf: StreamBuffer::new(0, STREAM_LIMIT),
            phase: Phase::Frame,
            fpdu_base: 0,
            frame: None,
            closed_reported: false,
        }
    }
}

fn dir_index(direction: Direction) -> usize {
    match direction {
        Direction::FromClient => 0,
        Direction::FromServer => 1,
    }
}

/// The decoder state of one connection.
#[derive(Debug)]
pub(crate) struct Session {
    connection: Connection,
    halves: [Half; 2],
    mode: Option<Mode>,
    /// The connection does not start with an MPA frame: everything is ignored.
    not_iwarp: bool,
}

impl Session {
    pub(crate) fn new(connection: Connection) -> Self {
        Self {
            connection,
            halves: [Half::new(), Half::new()],
            mode: None,
            not_iwarp: false,
        }
    }

    /// True once any direction has shown an MPA frame.
    pub(crate) fn is_iwarp(&self) -> bool {
        self.halves.iter().any(|h| h.frame.is_some())
    }

    fn endpoints(&self, direction: Direction) -> (SocketAddr, SocketAddr) {
        self.connection.endpoints(direction)
    }

    fn half(&mut self, direction: Direction) -> &mut Half {
        // dir_index is 0 or 1, both in bounds of the two-element array.
        let [client, server] = &mut self.halves;
        if dir_index(direction) == 0 {
            client
        } else {
            server
        }
    }

    fn record(&self, direction: Direction, span: Span, bytes: Vec<u8>, item: Item) -> Record {
        let (src, dst) = self.endpoints(direction);
        Record {
            frame: span.complete_frame,
            first_frame: span.first_frame,
            connection: self.connection.id.0,
            src,
            dst,
            stream_offset: span.offset,
            wire_len: span.len,
            bytes,
            item,
        }
    }

    /// Reports an error that ends decoding of `direction`, at `frame`.
    fn fatal(
        &mut self,
        direction: Direction,
        frame: u64,
        message: String,
        out: &mut dyn FnMut(Record),
    ) {
        let half = self.half(direction);
        half.phase = Phase::Done;
        if half.closed_reported {
            return;
        }
        half.closed_reported = true;
        let mut span = half.buf.span(half.buf.len());
        if span.complete_frame == 0 {
            span.complete_frame = frame;
            span.first_frame = frame;
        }
        let offset = half.buf.offset();
        half.buf.reset(offset);
        let record = self.record(
            direction,
            span,
            Vec::new(),
            Item::Error(ErrorRecord {
                message,
                fatal: true,
            }),
        );
        out(record);
    }

    /// In-order bytes of `direction` at TCP stream `offset`.
    pub(crate) fn data(
        &mut self,
        direction: Direction,
        offset: u64,
        arrived: u64,
        delivered: u64,
        bytes: &[u8],
        out: &mut dyn FnMut(Record),
    ) {
        if self.not_iwarp {
            return;
        }
        let half = self.half(direction);
        if half.phase == Phase::Done {
            return;
        }
        if let Err(e) = half.buf.push(offset, arrived, delivered, bytes) {
            self.fatal(direction, delivered, e.to_string(), out);
            return;
        }
        self.advance(direction, out);
    }

    /// The capture lost `len` bytes of `direction` at `offset` (noticed in frame `frame`).
    pub(crate) fn gap(
        &mut self,
        direction: Direction,
        offset: u64,
        len: u64,
        frame: u64,
        out: &mut dyn FnMut(Record),
    ) {
        if self.not_iwarp || self.half(direction).phase == Phase::Done {
            return;
        }
        if !self.is_iwarp() && self.half(direction).buf.is_empty() {
            // Nothing decoded yet on either side; the connection may not even be iWARP.
            // Without the MPA frames nothing here can be decoded, as with Wireshark.
            self.not_iwarp = true;
            return;
        }
        self.fatal(
            direction,
            frame,
            format!(
                "the capture lost {len} bytes at stream offset {offset}: framing of this \
                 direction cannot be recovered"
            ),
            out,
        );
    }

    /// End of the capture: report PDUs cut short.
    pub(crate) fn finish(&mut self, out: &mut dyn FnMut(Record)) {
        if self.not_iwarp || !self.is_iwarp() {
            return;
        }
        for direction in [Direction::FromClient, Direction::FromServer] {
            let half = self.half(direction);
            if half.phase == Phase::Done || half.buf.is_empty() {
                continue;
            }
            let what = match half.phase {
                Phase::Frame => "an MPA Request/Reply frame",
                Phase::Negotiating => "bytes sent before the MPA negotiation completed",
                _ => "an FPDU",
            };
            let have = half.buf.len();
            let span = half.buf.span(have);
            let message = format!("the capture ends inside {what} ({have} bytes present)");
            half.phase = Phase::Done;
            half.closed_reported = true;
            let record = self.record(
                direction,
                span,
                Vec::new(),
                Item::Error(ErrorRecord {
                    message,
                    fatal: false,
                }),
            );
            out(record);
        }
    }

    /// Decodes as much of `direction` as is buffered; re-runs the other direction when the
    /// negotiation completes.
    fn advance(&mut self, direction: Direction, out: &mut dyn FnMut(Record)) {
        loop {
            let phase = self.half(direction).phase;
            let progressed = match phase {
                Phase::Frame => self.step_frame(direction, out),
                Phase::Negotiating => self.step_negotiating(direction, out),
                Phase::Fpdus => self.step_fpdu(direction, out),
                Phase::Done => false,
            };
            if self.not_iwarp || !progressed {
                return;
            }
        }
    }

    /// Tries to decode this direction's MPA frame. Returns true on progress.
    fn step_frame(&mut self, direction: Direction, out: &mut dyn FnMut(Record)) -> bool {
        let nothing_seen = !self.is_iwarp();
        let half = self.half(direction);
        let bytes = half.buf.bytes();
        if bytes.is_empty() {
            return false;
        }
        let total = match MpaFrame::frame_len(bytes) {
            Ok(None) => return false,
            Ok(Some(total)) if bytes.len() < total => return false,
            Ok(Some(total)) => total,
            Err(WireError::MpaBadKey) if nothing_seen => {
                // Not an MPA connection: skip it, as Wireshark's heuristic does.
                self.not_iwarp = true;
                return false;
            }
            Err(e) => {
                let frame = half.buf.span(half.buf.len()).complete_frame;
                self.fatal(direction, frame, format!("MPA frame: {e}"), out);
                return false;
            }
        };
        let frame_bytes = bytes.get(..total).unwrap_or_default();
        let parsed = MpaFrame::parse(frame_bytes).and_then(|(frame, _)| {
            MpaFramePacket::new_checked(frame_bytes).map(|packet| (frame, packet))
        });
        let (frame, packet) = match parsed {
            Ok(ok) => ok,
            Err(e) => {
                let at = half.buf.span(total).complete_frame;
                self.fatal(direction, at, format!("MPA frame: {e}"), out);
                return false;
            }
        };
        let item = Item::MpaFrame(MpaFrameRecord {
            request: frame.kind == MpaFrameKind::Request,
            revision: packet.revision(),
            markers: frame.marker,
            crc: frame.crc,
            reject: frame.reject,
            res: (u8::from(packet.enhanced_flag()) << 4) | packet.res(),
            private_data: packet.private_data().to_vec(),
            enhanced: frame.enhanced.map(|e| EnhancedRecord {
                ird: e.ird,
                ord: e.ord,
                p2p: e.peer_to_peer,
                rtr_send: e.rtr.zero_length_send,
                rtr_write: e.rtr.zero_length_write,
                rtr_read: e.rtr.zero_length_read,
            }),
        });
        let seen = FrameSeen {
            kind: frame.kind,
            markers: frame.marker,
            crc: frame.crc,
            reject: frame.reject,
        };
        let raw = frame_bytes.to_vec();
        let span = half.buf.consume(total);
        half.fpdu_base = half.buf.offset();
        half.frame = Some(seen);
        half.phase = Phase::Negotiating;
        let record = self.record(direction, span, raw, item);
        out(record);

        let other = self.half(direction.reverse()).frame;
        if let Some(other) = other {
            if other.kind == seen.kind {
                let kind = match seen.kind {
                    MpaFrameKind::Request => "Request",
                    MpaFrameKind::Reply => "Reply",
                };
                self.fatal(
                    direction,
                    span.complete_frame,
                    format!("both directions sent an MPA {kind} frame"),
                    out,
                );
                return false;
            }
            self.negotiate(direction, seen, other, out);
        }
        true
    }

    /// Both frames are known: fix what the connection uses, and let the other direction,
    /// which may have FPDUs waiting, go on.
    fn negotiate(
        &mut self,
        direction: Direction,
        this: FrameSeen,
        other: FrameSeen,
        out: &mut dyn FnMut(Record),
    ) {
        let (request, reply, request_dir) = match this.kind {
            MpaFrameKind::Request => (this, other, direction),
            MpaFrameKind::Reply => (other, this, direction.reverse()),
        };
        //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
        // (paraphrase) C in the Request says the initiator wants CRC; the responder answers
        // with C in the Reply, and CRC is used in both directions when either frame has C set
        // (siw's "CRC MUST be used if peer requests it"; Wireshark decides the same way).
        let crc = request.crc || reply.crc;
        // (paraphrase) M declares that the frame's sender wants to receive markers: markers
        // go into the FPDUs sent *to* the peer that set M.
        let mut markers = [false; 2];
        let reply_dir = request_dir.reverse();
        if let Some(m) = markers.get_mut(dir_index(reply_dir)) {
            *m = request.markers;
        }
        if let Some(m) = markers.get_mut(dir_index(request_dir)) {
            *m = reply.markers;
        }
        self.mode = Some(Mode {
            crc,
            markers,
            rejected: reply.reject,
        });
        // The other direction may hold FPDUs that waited for this.
        let other_dir = direction.reverse();
        if self.half(other_dir).phase == Phase::Negotiating {
            self.advance(other_dir, out);
        }
    }

    fn step_negotiating(&mut self, direction: Direction, out: &mut dyn FnMut(Record)) -> bool {
        let Some(mode) = self.mode else {
            return false;
        };
        if mode.rejected {
            let half = self.half(direction);
            if half.buf.is_empty() {
                return false;
            }
            let frame = half.buf.span(half.buf.len()).complete_frame;
            self.fatal(
                direction,
                frame,
                "data after an MPA Reply that rejected the connection".into(),
                out,
            );
            return false;
        }
        self.half(direction).phase = Phase::Fpdus;
        true
    }

    /// Tries to decode one FPDU. Returns true on progress.
    fn step_fpdu(&mut self, direction: Direction, out: &mut dyn FnMut(Record)) -> bool {
        let Some(mode) = self.mode else {
            return false;
        };
        let use_markers = mode
            .markers
            .get(dir_index(direction))
            .copied()
            .unwrap_or(false);
        let half = self.half(direction);
        let bytes = half.buf.bytes();
        let stream_offset = half.buf.offset().saturating_sub(half.fpdu_base);
        // With markers, an FPDU that starts on a marker position begins with that marker.
        let header_at =
            if use_markers && stream_offset.is_multiple_of(marker::MARKER_INTERVAL as u64) {
                marker::MARKER_LEN
            } else {
                0
            };
        let Some(header) = bytes.get(header_at..) else {
            return false;
        };
        let Ok(fpdu_len) = fpdu::peek(header) else {
            return false;
        };
        let wire_len = if use_markers {
            match marker::MarkerLayout::new(stream_offset, fpdu_len) {
                Ok(layout) => layout.wire_len(),
                Err(e) => {
                    let frame = half.buf.span(half.buf.len()).complete_frame;
                    self.fatal(direction, frame, format!("FPDU with markers: {e}"), out);
                    return false;
                }
            }
        } else {
            fpdu_len
        };
        let Some(wire) = bytes.get(..wire_len) else {
            return false;
        };
        let decoded = decode_fpdu(wire, stream_offset, fpdu_len, use_markers, mode.crc);
        let raw = wire.to_vec();
        let span = half.buf.consume(wire_len);
        match decoded {
            Ok(fpdu) => {
                let record = self.record(direction, span, raw, Item::Fpdu(fpdu));
                out(record);
                true
            }
            Err(e) => {
                // Only marker errors get here: the markers no longer say where FPDUs are.
                self.fatal(direction, span.complete_frame, format!("FPDU: {e}"), out);
                false
            }
        }
    }
}

/// Decodes one whole FPDU as it is on the wire (`wire`, markers included when `use_markers`),
/// which starts at FPDU stream offset `stream_offset` and is `fpdu_len` bytes without markers.
fn decode_fpdu(
    wire: &[u8],
    stream_offset: u64,
    fpdu_len: usize,
    use_markers: bool,
    use_crc: bool,
) -> Result<FpduRecord, WireError> {
    let mut stripped = Vec::new();
    let (plain, markers, crc_covered): (&[u8], usize, &[u8]) = if use_markers {
        let layout = marker::MarkerLayout::new(stream_offset, fpdu_len)?;
        stripped.resize(fpdu_len, 0);
        // CRC off here: the CRC is judged below over the wire form, so that a bad CRC is
        // reported on its FPDU's line rather than as a framing error.
        marker::strip(wire, stream_offset, false, &mut stripped)?;
        let covered = wire.get(..layout.crc_wire_offset()).unwrap_or_default();
        (&stripped, layout.marker_count(), covered)
    } else {
        let covered = wire
            .get(..fpdu_len.saturating_sub(fpdu::CRC_LEN))
            .unwrap_or_default();
        (wire, 0, covered)
    };
    let packet = FpduPacket::new_checked(plain)?;
    let field = packet.crc_field();
    let field_value = u32::from_be_bytes(field);
    let crc = if use_crc {
        //= https://www.rfc-editor.org/rfc/rfc5044#section-4.4
        // (paraphrase) When CRC is in use the receiver checks the CRC over the FPDU as
        // received (ULPDU_Length, ULPDU, pad, and any markers inside it).
        let computed = crc::crc32c(crc_covered);
        match fpdu::check_crc(computed, field) {
            Ok(()) => CrcRecord::Good { field: field_value },
            Err(_) => CrcRecord::Bad {
                field: field_value,
                expected: u32::from_be_bytes(crc::to_wire(computed)),
            },
        }
    } else {
        CrcRecord::Off { field: field_value }
    };
    Ok(FpduRecord {
        ulpdu_len: packet.ulpdu_length(),
        pad: packet.pad().to_vec(),
        markers,
        crc,
        segment: segment_record(packet.ulpdu()).map_err(|e| e.to_string()),
    })
}
