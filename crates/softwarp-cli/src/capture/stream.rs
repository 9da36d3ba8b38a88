//! The unconsumed tail of one reassembled byte stream, remembering which frame brought each
//! byte.
//!
//! A protocol decoder pushes [`StreamEvent::Data`](super::StreamEvent) runs in, looks at
//! [`StreamBuffer::bytes`], and [`consume`](StreamBuffer::consume)s whole PDUs; it learns
//! the stream offset of each PDU and the frames it came from. Memory is bounded by the
//! largest PDU the decoder waits for: pushing past `limit` unconsumed bytes fails. No I/O here.

use std::collections::VecDeque;

use thiserror::Error;

/// Why a run of bytes could not be added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum StreamBufferError {
    /// The run does not start where the buffered bytes end.
    #[error(
        "stream bytes at offset {offset} do not follow the buffered bytes, which end at {expected}"
    )]
    NotContiguous {
        /// Offset of the run.
        offset: u64,
        /// Offset where the buffered bytes end.
        expected: u64,
    },
    /// More than `limit` bytes would wait unconsumed.
    #[error("{len} unconsumed stream bytes would exceed the limit of {limit}")]
    LimitExceeded {
        /// Bytes that would be buffered.
        len: usize,
        /// The limit.
        limit: usize,
    },
}

/// Where a consumed range of the stream came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Stream offset of the first byte.
    pub offset: u64,
    /// Number of bytes.
    pub len: usize,
    /// The first frame that carried any of the bytes.
    pub first_frame: u64,
    /// The frame whose arrival completed the range: Wireshark shows a PDU that spans
    /// segments in this frame.
    pub complete_frame: u64,
}

#[derive(Debug, Clone, Copy)]
struct Run {
    /// Stream offset where the run starts.
    offset: u64,
    arrived: u64,
    delivered: u64,
}

/// Buffered, not yet consumed bytes of one stream.
#[derive(Debug)]
pub struct StreamBuffer {
    /// Stream offset of `data[head]`.
    offset: u64,
    data: Vec<u8>,
    head: usize,
    runs: VecDeque<Run>,
    limit: usize,
}

impl StreamBuffer {
    /// An empty buffer whose next byte is at stream offset `offset`; it refuses to hold more
    /// than `limit` unconsumed bytes.
    pub fn new(offset: u64, limit: usize) -> Self {
        Self {
            offset,
            data: Vec::new(),
            head: 0,
            runs: VecDeque::new(),
            limit,
        }
    }

    /// Stream offset of the first unconsumed byte.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Stream offset just past the last buffered byte.
    pub fn end_offset(&self) -> u64 {
        self.offset + self.len() as u64
    }

    /// The unconsumed bytes.
    pub fn bytes(&self) -> &[u8] {
        self.data.get(self.head..).unwrap_or_default()
    }

    /// Number of unconsumed bytes.
    pub fn len(&self) -> usize {
        self.data.len().saturating_sub(self.head)
    }

    /// True when nothing is buffered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends `bytes` found at stream `offset`, which arrived in frame `arrived` and became
    /// contiguous in frame `delivered`.
    pub fn push(
        &mut self,
        offset: u64,
        arrived: u64,
        delivered: u64,
        bytes: &[u8],
    ) -> Result<(), StreamBufferError> {
        if offset != self.end_offset() {
            return Err(StreamBufferError::NotContiguous {
                offset,
                expected: self.end_offset(),
            });
        }
        let len = self.len() + bytes.len();
        if len > self.limit {
            return Err(StreamBufferError::LimitExceeded {
                len,
                limit: self.limit,
            });
        }
        if bytes.is_empty() {
            return Ok(());
        }
        if self.head > 0 && self.head >= self.data.len() / 2 {
            self.data.drain(..self.head);
            self.head = 0;
        }
        self.data.extend_from_slice(bytes);
        self.runs.push_back(Run {
            offset,
            arrived,
            delivered,
        });
        Ok(())
    }

    /// Where the first `n` unconsumed bytes (fewer if fewer are buffered) came from, without
    /// consuming them.
    pub fn span(&self, n: usize) -> Span {
        let n = n.min(self.len());
        let start = self.offset;
        let end = start + n as u64;
        let mut first_frame = None;
        let mut complete_frame = 0;
        let buffered_end = self.end_offset();
        for (i, run) in self.runs.iter().enumerate() {
            if run.offset >= end && n > 0 {
                break;
            }
            let run_end = self
                .runs
                .get(i + 1)
                .map_or(buffered_end, |next| next.offset);
            if run_end > start || n == 0 {
                first_frame.get_or_insert(run.arrived);
                complete_frame = complete_frame.max(run.delivered);
            }
            if n == 0 {
                break;
            }
        }
        Span {
            offset: start,
            len: n,
            first_frame: first_frame.unwrap_or(0),
            complete_frame,
        }
    }

    /// Removes the first `n` unconsumed bytes (fewer if fewer are buffered) and says where
    /// they came from.
    pub fn consume(&mut self, n: usize) -> Span {
        let span = self.span(n);
        let n = span.len;
        let end = span.offset + n as u64;
        while self.runs.len() > 1 && self.runs.get(1).is_some_and(|r| r.offset <= end) {
            self.runs.pop_front();
        }
        if let Some(front) = self.runs.front_mut() {
            front.offset = front.offset.max(end);
        }
        self.head += n;
        self.offset = end;
        if self.head == self.data.len() {
            self.data.clear();
            self.head = 0;
            self.runs.clear();
        }
        span
    }

    /// Drops everything buffered and continues at stream offset `offset` (after a gap).
    pub fn reset(&mut self, offset: u64) {
        self.data.clear();
        self.head = 0;
        self.runs.clear();
        self.offset = offset;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pdu_spanning_runs_reports_its_first_and_completing_frames() {
        let mut b = StreamBuffer::new(100, 64);
        b.push(100, 7, 7, b"abcd").unwrap();
        b.push(104, 9, 9, b"efgh").unwrap();
        b.push(108, 10, 10, b"ij").unwrap();
        let span = b.consume(6);
        assert_eq!(
            span,
            Span {
                offset: 100,
                len: 6,
                first_frame: 7,
                complete_frame: 9
            }
        );
        assert_eq!(b.bytes(), b"ghij");
        let span = b.consume(4);
        assert_eq!(
            (span.offset, span.first_frame, span.complete_frame),
            (106, 9, 10)
        );
        assert!(b.is_empty());
    }

    #[test]
    fn several_pdus_in_one_run_all_belong_to_that_frame() {
        let mut b = StreamBuffer::new(0, 64);
        b.push(0, 3, 3, b"aabbcc").unwrap();
        for i in 0..3 {
            let span = b.consume(2);
            assert_eq!(
                (span.offset, span.first_frame, span.complete_frame),
                (i * 2, 3, 3)
            );
        }
    }

    #[test]
    fn bytes_delivered_late_complete_in_the_delivering_frame() {
        let mut b = StreamBuffer::new(0, 64);
        b.push(0, 5, 5, b"ab").unwrap();
        b.push(2, 4, 5, b"cd").unwrap();
        let span = b.consume(4);
        assert_eq!((span.first_frame, span.complete_frame), (5, 5));
    }

    #[test]
    fn non_contiguous_and_oversized_pushes_are_refused() {
        let mut b = StreamBuffer::new(0, 4);
        assert_eq!(
            b.push(1, 1, 1, b"x"),
            Err(StreamBufferError::NotContiguous {
                offset: 1,
                expected: 0
            })
        );
        b.push(0, 1, 1, b"abc").unwrap();
        assert_eq!(
            b.push(3, 1, 1, b"de"),
            Err(StreamBufferError::LimitExceeded { len: 5, limit: 4 })
        );
        assert_eq!(b.bytes(), b"abc");
    }

    #[test]
    fn consuming_more_than_buffered_takes_what_is_there() {
        let mut b = StreamBuffer::new(0, 64);
        b.push(0, 1, 1, b"ab").unwrap();
        let span = b.consume(10);
        assert_eq!(span.len, 2);
        assert_eq!(b.offset(), 2);
        b.push(2, 2, 2, b"c").unwrap();
        assert_eq!(b.consume(1).first_frame, 2);
    }

    #[test]
    fn memory_is_reclaimed_as_pdus_are_consumed() {
        let mut b = StreamBuffer::new(0, 16);
        for i in 0..1000u64 {
            b.push(i * 4, i + 1, i + 1, b"wxyz").unwrap();
            let span = b.consume(3);
            assert_eq!(span.complete_frame, i + 1);
            assert!(b.len() <= 4);
            assert!(b.data.len() <= 16);
            b.consume(1);
        }
    }

    #[test]
    fn reset_skips_to_a_new_offset() {
        let mut b = StreamBuffer::new(0, 16);
        b.push(0, 1, 1, b"ab").unwrap();
        b.reset(10);
        assert!(b.is_empty());
        b.push(10, 2, 2, b"k").unwrap();
        assert_eq!(b.consume(1).offset, 10);
    }
}
