//! A writer for the engine's transmit path (`Qp::send_to`) that records every write call:
//! what it was offered, which pieces it took, where each landed in the stream and where it
//! came from in memory. It takes everything by default, a prefix of each offer with
//! [`RecordingWriter::taking`], and can lie ([`RecordingWriter::lying`]).

use softwarp_engine::qp::{TxPiece, VectoredWrite};

/// One non-empty piece taken by a write call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WrittenPiece {
    /// Its offset in the written stream.
    pub at: u64,
    /// Bytes taken from it (all of it unless the writer takes a prefix).
    pub len: usize,
    /// The address it was offered from (a region's memory or a staged buffer).
    pub addr: u64,
}

/// One call of [`VectoredWrite::write_from`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WriteCall {
    /// Bytes offered.
    pub offered: usize,
    /// Pieces offered, empty ones included.
    pub pieces: usize,
    /// The non-empty pieces taken, in order.
    pub written: Vec<WrittenPiece>,
}

impl WriteCall {
    /// Bytes taken.
    pub fn taken(&self) -> usize {
        self.written.iter().map(|p| p.len).sum()
    }
}

/// Records every write call; the stream written so far is `out`.
pub struct RecordingWriter<'a> {
    pub out: Vec<u8>,
    pub calls: Vec<WriteCall>,
    take: Option<Box<dyn FnMut(usize) -> usize + 'a>>,
    lie: bool,
}

impl Default for RecordingWriter<'_> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'a> RecordingWriter<'a> {
    /// A writer that takes all it is offered.
    pub fn new() -> Self {
        Self {
            out: Vec::new(),
            calls: Vec::new(),
            take: None,
            lie: false,
        }
    }

    /// A writer that takes `take(offered)` bytes of each offer (kept within 1..=offered), a
    /// prefix, as a socket that is short of room does.
    pub fn taking(take: impl FnMut(usize) -> usize + 'a) -> Self {
        Self {
            take: Some(Box::new(take)),
            ..Self::new()
        }
    }

    /// A writer that writes nothing and claims one byte more than it was offered.
    pub fn lying() -> Self {
        Self {
            lie: true,
            ..Self::new()
        }
    }

    /// The largest offer of any call (0 before the first).
    pub fn max_offered(&self) -> usize {
        self.calls.iter().map(|c| c.offered).max().unwrap_or(0)
    }

    /// The non-empty pieces taken by each call.
    pub fn pieces_per_call(&self) -> Vec<usize> {
        self.calls.iter().map(|c| c.written.len()).collect()
    }

    /// The bytes taken by each call.
    pub fn bytes_per_call(&self) -> Vec<usize> {
        self.calls.iter().map(WriteCall::taken).collect()
    }

    /// Every non-empty piece taken, in stream order.
    pub fn written(&self) -> impl Iterator<Item = &WrittenPiece> {
        self.calls.iter().flat_map(|c| c.written.iter())
    }
}

impl VectoredWrite for RecordingWriter<'_> {
    fn write_from(&mut self, pieces: &[TxPiece<'_>]) -> std::io::Result<usize> {
        let offered: usize = pieces.iter().map(TxPiece::len).sum();
        assert!(offered > 0, "an empty write");
        let mut call = WriteCall {
            offered,
            pieces: pieces.len(),
            written: Vec::new(),
        };
        if self.lie {
            self.calls.push(call);
            return Ok(offered + 1);
        }
        let want = match &mut self.take {
            Some(take) => take(offered).clamp(1, offered),
            None => offered,
        };
        let mut done = 0;
        for p in pieces.iter().filter(|p| !p.is_empty()) {
            if done == want {
                break;
            }
            let take = p.len().min(want - done);
            let mut whole = vec![0u8; p.len()];
            assert_eq!(p.copy_to(&mut whole), p.len());
            call.written.push(WrittenPiece {
                at: self.out.len() as u64,
                len: take,
                addr: p.as_ptr() as u64,
            });
            self.out.extend_from_slice(&whole[..take]);
            done += take;
        }
        self.calls.push(call);
        Ok(done)
    }
}
