//! One direction of a TCP connection, put back in sequence order.
//!
//! Segments may arrive in any order, repeat (retransmissions) or overlap. The reassembler
//! turns them into in-order [`StreamEvent::Data`] runs, each tagged with the frame the bytes
//! arrived in and the frame whose arrival made them contiguous with what came before. Bytes
//! already delivered are dropped when they come again: the first copy wins, as in a receiving
//! TCP.
//!
//! Memory is bounded: at most `limit` bytes wait behind a hole (plus the segment that pushed
//! past the limit). When more arrive, the hole is declared lost with [`StreamEvent::Gap`] and
//! delivery resumes at the first buffered byte, as it does at the end of the capture
//! ([`StreamReassembler::finish`]). No I/O here.

use std::collections::BTreeMap;

/// Default bound on bytes held behind a hole, per direction.
pub const DEFAULT_PENDING_LIMIT: usize = 4 << 20;

/// What the reassembler hands to its consumer, in stream order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEvent<'a> {
    /// Bytes at stream offset `offset` (0 is the first byte after the SYN).
    Data {
        /// Stream offset of `bytes[0]`.
        offset: u64,
        /// The frame these bytes arrived in.
        arrived: u64,
        /// The frame whose arrival made these bytes contiguous with the stream so far (equal
        /// to `arrived` unless they waited behind a hole).
        delivered: u64,
        /// The bytes.
        bytes: &'a [u8],
    },
    /// Bytes the capture never showed: the stream skips `len` bytes at `offset`.
    Gap {
        /// Stream offset of the first missing byte.
        offset: u64,
        /// Number of missing bytes.
        len: u64,
        /// The frame being processed when the hole was declared lost (the last frame of the
        /// capture when it is declared at the end).
        frame: u64,
    },
}

#[derive(Debug)]
struct Pending {
    arrived: u64,
    bytes: Vec<u8>,
}

/// Reassembles one direction of one TCP connection.
#[derive(Debug)]
pub struct StreamReassembler {
    /// Sequence number of stream offset 0, once known (from the SYN or the first segment).
    base: Option<u32>,
    /// Next stream offset to deliver.
    next: u64,
    /// Segments beyond `next`, by start offset.
    pending: BTreeMap<u64, Pending>,
    pending_bytes: usize,
    limit: usize,
    duplicate_bytes: u64,
}

impl Default for StreamReassembler {
    fn default() -> Self {
        Self::new(DEFAULT_PENDING_LIMIT)
    }
}

impl StreamReassembler {
    /// A reassembler that holds at most about `limit` bytes behind a hole.
    pub fn new(limit: usize) -> Self {
        Self {
            base: None,
            next: 0,
            pending: BTreeMap::new(),
            pending_bytes: 0,
            limit,
            duplicate_bytes: 0,
        }
    }

    /// Stream offset of the next byte to deliver.
    pub fn next_offset(&self) -> u64 {
        self.next
    }

    /// Bytes currently held behind a hole.
    pub fn pending_bytes(&self) -> usize {
        self.pending_bytes
    }

    /// Bytes received more than once (retransmissions and overlaps) and dropped.
    pub fn duplicate_bytes(&self) -> u64 {
        self.duplicate_bytes
    }

    /// The sequence number of stream offset 0, once known.
    pub fn initial_sequence(&self) -> Option<u32> {
        self.base
    }

    /// Stream offset of sequence number `seq`, extended to 64 bits next to `self.next`.
    fn offset_of(&self, base: u32, seq: u32) -> i128 {
        let rel = seq.wrapping_sub(base);
        // The truncation is the point: distance in 32-bit sequence space, as a signed value.
        #[allow(clippy::cast_possible_truncation)]
        let next32 = self.next as u32;
        let delta = i128::from(rel.wrapping_sub(next32) as i32);
        i128::from(self.next) + delta
    }

    /// Feeds one segment of frame `frame`: its sequence number, SYN flag and payload.
    ///
    /// Calls `sink` for every run of bytes that became deliverable, in stream order.
    pub fn segment(
        &mut self,
        frame: u64,
        seq: u32,
        syn: bool,
        payload: &[u8],
        sink: &mut dyn FnMut(StreamEvent<'_>),
    ) {
        let data_seq = if syn { seq.wrapping_add(1) } else { seq };
        let base = match self.base {
            Some(base) => base,
            None if syn || !payload.is_empty() => {
                self.base = Some(data_seq);
                data_seq
            }
            None => return,
        };
        if payload.is_empty() {
            return;
        }
        let start = self.offset_of(base, data_seq);
        let next = i128::from(self.next);
        if start + (payload.len() as i128) <= next {
            self.duplicate_bytes += payload.len() as u64;
            return;
        }
        // Skip what was already delivered; `start` is then at or after `self.next`.
        let skip = usize::try_from(next - start).unwrap_or(0);
        let payload = payload.get(skip..).unwrap_or_default();
        self.duplicate_bytes += skip as u64;
        let Ok(start) = u64::try_from(start.max(next)) else {
            return;
        };
        if start == self.next && self.pending.is_empty() {
            // The common case: in order, nothing waiting. No copy.
            self.deliver(frame, frame, payload, sink);
            return;
        }
        self.hold(frame, start, payload);
        self.drain(frame, sink);
        while self.pending_bytes > self.limit && self.skip_hole(frame, sink) {}
    }

    /// Keeps the parts of `payload` (at stream offset `start`) that no held segment covers
    /// yet: the first copy of every byte wins.
    fn hold(&mut self, frame: u64, start: u64, payload: &[u8]) {
        let end = start + payload.len() as u64;
        let mut covered = Vec::new();
        if let Some((&s, p)) = self.pending.range(..start).next_back() {
            covered.push((s, s + p.bytes.len() as u64));
        }
        covered.extend(
            self.pending
                .range(start..end)
                .map(|(&s, p)| (s, s + p.bytes.len() as u64)),
        );
        let mut cursor = start;
        let mut pieces = Vec::new();
        for (s, e) in covered {
            if s > cursor {
                pieces.push((cursor, s.min(end)));
            }
            cursor = cursor.max(e);
            if cursor >= end {
                break;
            }
        }
        if cursor < end {
            pieces.push((cursor, end));
        }
        let mut kept = 0;
        for (s, e) in pieces {
            let (Ok(from), Ok(to)) = (usize::try_from(s - start), usize::try_from(e - start))
            else {
                continue;
            };
            let Some(bytes) = payload.get(from..to) else {
                continue;
            };
            kept += bytes.len();
            self.pending.insert(
                s,
                Pending {
                    arrived: frame,
                    bytes: bytes.to_vec(),
                },
            );
        }
        self.pending_bytes += kept;
        self.duplicate_bytes += (payload.len() - kept) as u64;
    }

    /// Declares the rest of the stream final: every hole is reported as a [`StreamEvent::Gap`]
    /// and every byte held behind it is delivered. `frame` is the last frame of the capture.
    pub fn finish(&mut self, frame: u64, sink: &mut dyn FnMut(StreamEvent<'_>)) {
        while self.skip_hole(frame, sink) {}
    }

    fn deliver(
        &mut self,
        arrived: u64,
        delivered: u64,
        bytes: &[u8],
        sink: &mut dyn FnMut(StreamEvent<'_>),
    ) {
        if bytes.is_empty() {
            return;
        }
        sink(StreamEvent::Data {
            offset: self.next,
            arrived,
            delivered,
            bytes,
        });
        self.next += bytes.len() as u64;
    }

    /// Delivers every pending segment that now touches `self.next`.
    fn drain(&mut self, frame: u64, sink: &mut dyn FnMut(StreamEvent<'_>)) {
        while let Some(entry) = self.pending.first_entry() {
            let start = *entry.key();
            if start > self.next {
                break;
            }
            let pending = entry.remove();
            self.pending_bytes -= pending.bytes.len();
            let skip = usize::try_from(self.next - start).unwrap_or(usize::MAX);
            match pending.bytes.get(skip..) {
                Some(fresh) if !fresh.is_empty() => {
                    self.duplicate_bytes += skip as u64;
                    self.deliver(pending.arrived, frame, fresh, sink);
                }
                _ => self.duplicate_bytes += pending.bytes.len() as u64,
            }
        }
    }

    /// Gives up on the hole before the first pending segment; returns false if none is held.
    fn skip_hole(&mut self, frame: u64, sink: &mut dyn FnMut(StreamEvent<'_>)) -> bool {
        let Some((&start, _)) = self.pending.first_key_value() else {
            return false;
        };
        if start > self.next {
            sink(StreamEvent::Gap {
                offset: self.next,
                len: start - self.next,
                frame,
            });
            self.next = start;
        }
        self.drain(frame, sink);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the consumer saw: the stream bytes with their arrival frames, and gaps.
    #[derive(Default, Debug)]
    struct Seen {
        bytes: Vec<u8>,
        arrived: Vec<u64>,
        delivered: Vec<u64>,
        gaps: Vec<(u64, u64)>,
    }

    impl Seen {
        fn sink(&mut self) -> impl FnMut(StreamEvent<'_>) + '_ {
            move |ev| match ev {
                StreamEvent::Data {
                    offset,
                    arrived,
                    delivered,
                    bytes,
                } => {
                    assert_eq!(
                        offset,
                        (self.bytes.len() + self.gap_total()) as u64,
                        "data must be contiguous"
                    );
                    self.bytes.extend_from_slice(bytes);
                    self.arrived.extend(bytes.iter().map(|_| arrived));
                    self.delivered.extend(bytes.iter().map(|_| delivered));
                }
                StreamEvent::Gap { offset, len, .. } => self.gaps.push((offset, len)),
            }
        }
        fn gap_total(&self) -> usize {
            self.gaps.iter().map(|g| g.1 as usize).sum()
        }
    }

    const ISN: u32 = 1000;

    fn feed(r: &mut StreamReassembler, seen: &mut Seen, frame: u64, rel: u32, data: &[u8]) {
        r.segment(frame, ISN + 1 + rel, false, data, &mut seen.sink());
    }

    fn opened(limit: usize) -> (StreamReassembler, Seen) {
        let mut r = StreamReassembler::new(limit);
        let mut seen = Seen::default();
        r.segment(1, ISN, true, &[], &mut seen.sink());
        (r, seen)
    }

    #[test]
    fn in_order_segments_are_delivered_at_once_with_their_frames() {
        let (mut r, mut seen) = opened(1024);
        feed(&mut r, &mut seen, 2, 0, b"abc");
        feed(&mut r, &mut seen, 3, 3, b"de");
        assert_eq!(seen.bytes, b"abcde");
        assert_eq!(seen.arrived, [2, 2, 2, 3, 3]);
        assert_eq!(seen.delivered, seen.arrived);
        assert_eq!(r.next_offset(), 5);
        assert_eq!(r.initial_sequence(), Some(ISN + 1));
    }

    #[test]
    fn out_of_order_segment_waits_for_the_hole_and_is_delivered_by_the_filling_frame() {
        let (mut r, mut seen) = opened(1024);
        feed(&mut r, &mut seen, 2, 3, b"def");
        assert!(seen.bytes.is_empty());
        assert_eq!(r.pending_bytes(), 3);
        feed(&mut r, &mut seen, 3, 0, b"abc");
        assert_eq!(seen.bytes, b"abcdef");
        assert_eq!(seen.arrived, [3, 3, 3, 2, 2, 2]);
        assert_eq!(seen.delivered, [3; 6]);
        assert_eq!(r.pending_bytes(), 0);
    }

    #[test]
    fn retransmissions_and_overlaps_are_delivered_once_first_copy_wins() {
        let (mut r, mut seen) = opened(1024);
        feed(&mut r, &mut seen, 2, 0, b"abcd");
        feed(&mut r, &mut seen, 3, 0, b"abcd");
        feed(&mut r, &mut seen, 4, 2, b"XXef");
        feed(&mut r, &mut seen, 5, 10, b"kl");
        feed(&mut r, &mut seen, 6, 8, b"ijKL");
        feed(&mut r, &mut seen, 7, 6, b"gh");
        assert_eq!(seen.bytes, b"abcdefghijkl");
        assert_eq!(r.duplicate_bytes(), 4 + 2 + 2);
        assert!(seen.gaps.is_empty());
    }

    #[test]
    fn same_start_pending_segments_keep_the_longer_copy() {
        let (mut r, mut seen) = opened(1024);
        feed(&mut r, &mut seen, 2, 4, b"ef");
        feed(&mut r, &mut seen, 3, 4, b"efgh");
        feed(&mut r, &mut seen, 4, 4, b"e");
        feed(&mut r, &mut seen, 5, 0, b"abcd");
        assert_eq!(seen.bytes, b"abcdefgh");
    }

    #[test]
    fn sequence_numbers_wrap_around_zero() {
        let mut r = StreamReassembler::new(1024);
        let mut seen = Seen::default();
        r.segment(1, u32::MAX - 2, true, &[], &mut seen.sink());
        r.segment(2, u32::MAX - 1, false, b"ab", &mut seen.sink());
        r.segment(3, 0, false, b"cd", &mut seen.sink());
        assert_eq!(seen.bytes, b"abcd");
    }

    #[test]
    fn without_a_syn_the_first_segment_starts_the_stream() {
        let mut r = StreamReassembler::new(1024);
        let mut seen = Seen::default();
        r.segment(1, 5000, false, &[], &mut seen.sink());
        r.segment(2, 5000, false, b"xy", &mut seen.sink());
        r.segment(3, 5002, false, b"z", &mut seen.sink());
        assert_eq!(seen.bytes, b"xyz");
    }

    #[test]
    fn syn_payload_follows_the_syn_sequence_number() {
        let mut r = StreamReassembler::new(1024);
        let mut seen = Seen::default();
        r.segment(1, ISN, true, b"fast", &mut seen.sink());
        feed(&mut r, &mut seen, 2, 4, b"open");
        assert_eq!(seen.bytes, b"fastopen");
    }

    #[test]
    fn finish_reports_holes_and_delivers_what_waited_behind_them() {
        let (mut r, mut seen) = opened(1024);
        feed(&mut r, &mut seen, 2, 0, b"ab");
        feed(&mut r, &mut seen, 3, 5, b"fg");
        feed(&mut r, &mut seen, 4, 10, b"k");
        r.finish(4, &mut seen.sink());
        assert_eq!(seen.bytes, b"abfgk");
        assert_eq!(seen.gaps, [(2, 3), (7, 3)]);
        assert_eq!(r.pending_bytes(), 0);
    }

    #[test]
    fn memory_behind_a_hole_is_bounded_by_declaring_the_hole_lost() {
        let (mut r, mut seen) = opened(8);
        feed(&mut r, &mut seen, 2, 4, b"efgh");
        feed(&mut r, &mut seen, 3, 8, b"ijkl");
        assert!(seen.gaps.is_empty());
        feed(&mut r, &mut seen, 4, 12, b"m");
        assert_eq!(seen.gaps, [(0, 4)]);
        assert_eq!(seen.bytes, b"efghijklm");
        assert_eq!(r.pending_bytes(), 0);
        // A late copy of the lost bytes is a duplicate now.
        feed(&mut r, &mut seen, 5, 0, b"abcd");
        assert_eq!(seen.bytes, b"efghijklm");
    }

    #[test]
    fn data_before_the_stream_start_is_ignored() {
        let (mut r, mut seen) = opened(1024);
        r.segment(2, ISN - 10, false, b"old", &mut seen.sink());
        r.segment(3, ISN - 1, false, b"xyab", &mut seen.sink());
        assert_eq!(seen.bytes, b"ab");
    }
}
