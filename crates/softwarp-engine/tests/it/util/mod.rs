//! Test support: a deterministic two-QP pair that moves bytes between two engines in chosen
//! splits (quinn's `Pair::drive` idea), without sockets.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use softwarp_engine::cq::{Cq, CqError, CqId};
use softwarp_engine::event::AsyncEvent;
use softwarp_engine::memory::Region;
use softwarp_engine::mr::{Access, MrTable, PdId, SeededKeys, Stag};
use softwarp_engine::qp::{
    copy_around, copy_to_dest, Qp, QpConfig, ReadDest, ReadUntil, RecvEnd, RxEnv, SendEnd,
    StreamConfig, TxPiece, VectoredRead, VectoredWrite, STAGE_LEN,
};
use softwarp_engine::srq::{Srq, SrqId};
use softwarp_engine::wr::{CqTarget, Payload, SendOp, SendWr, SgList, Sge, WorkCompletion};

/// How the bytes of one direction are cut before they are handed to the receiver (and how
/// many bytes the sender's "socket" accepts per write).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Everything available at once.
    Whole,
    /// One byte at a time.
    OneByte,
    /// Random pieces of 1..=max bytes from a seeded generator.
    Random { seed: u64, max: usize },
    /// As `Random`, with the runtime's buffers: the receiver reads ahead into a staging
    /// buffer (whole FPDUs in one step each), the sender coalesces small FPDUs into a
    /// batch.
    Staged { seed: u64, max: usize },
}

/// A small deterministic generator (xorshift64*).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in 1..=max.
    pub fn piece(&mut self, max: usize) -> usize {
        1 + (self.next_u64() % max.max(1) as u64) as usize
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for b in buf.iter_mut() {
            *b = self.next_u64() as u8;
        }
    }
}

/// One endpoint: a QP with its STag table, CQs, optional SRQ, and collected events.
pub struct Side {
    pub qp: Qp,
    pub mrs: MrTable,
    pub srq: Option<Srq>,
    pub send_cq: Cq,
    pub recv_cq: Cq,
    pub events: Vec<AsyncEvent>,
    /// Every byte this side transmitted, in order.
    pub sent: Vec<u8>,
    /// Completions a CQ refused (overflow), handed back by the CQ.
    pub refused: Vec<WorkCompletion>,
}

pub const PD: PdId = PdId(1);

pub fn qp_config(qp_num: u32, use_srq: bool) -> QpConfig {
    QpConfig {
        qp_num,
        pd: PD,
        sq_depth: 64,
        rq_depth: 64,
        use_srq,
        max_ird: 16,
        max_ord: 16,
    }
}

impl Side {
    pub fn new(qp_num: u32, stream: StreamConfig) -> Self {
        Self::with_config(qp_config(qp_num, false), stream)
    }

    pub fn with_config(cfg: QpConfig, stream: StreamConfig) -> Self {
        let mut qp = Qp::new(cfg);
        qp.establish(stream).unwrap();
        Side {
            qp,
            // Seeded STag keys: every run of a test puts the same bytes on the wire.
            mrs: MrTable::new(64, SeededKeys::new(u64::from(cfg.qp_num))),
            srq: cfg.use_srq.then(|| Srq::new(SrqId(1), cfg.pd, 64)),
            send_cq: Cq::new(CqId(cfg.qp_num * 2), 256),
            recv_cq: Cq::new(CqId(cfg.qp_num * 2 + 1), 256),
            events: Vec::new(),
            sent: Vec::new(),
            refused: Vec::new(),
        }
    }

    /// Registers a fresh zeroed region of `len` bytes; returns (region, STag, iova).
    pub fn region(&mut self, len: usize, access: Access) -> (Arc<Region>, Stag, u64) {
        let r = Arc::new(Region::new_zeroed(len).unwrap());
        let iova = 0x10_0000_0000 + (self.mrs.len() as u64) * 0x1_0000_0000;
        let stag = self
            .mrs
            .register(PD, r.clone(), 0, len, Some(iova), access)
            .unwrap();
        (r, stag, iova)
    }

    /// A region filled with pattern bytes from `seed`.
    pub fn filled_region(
        &mut self,
        len: usize,
        access: Access,
        seed: u64,
    ) -> (Arc<Region>, Stag, u64, Vec<u8>) {
        let (r, stag, iova) = self.region(len, access);
        let mut data = vec![0u8; len];
        Rng::new(seed).fill(&mut data);
        r.write_at(0, &data).unwrap();
        (r, stag, iova, data)
    }

    /// Moves the QP's completions to the CQs and its events (and the CQs' and SRQ's) here.
    pub fn pump(&mut self) {
        loop {
            // The runtime skips `poll_completion` when `has_completion` says no: check on
            // every pump that the two agree.
            let had = self.qp.has_completion();
            let Some((target, wc)) = self.qp.poll_completion() else {
                assert!(!self.qp.has_completion(), "nothing polled, still pending");
                break;
            };
            assert!(had, "has_completion missed {wc:?}");
            let cq = match target {
                CqTarget::Send => &mut self.send_cq,
                CqTarget::Recv => &mut self.recv_cq,
            };
            match cq.push(wc) {
                Ok(()) => {}
                Err(CqError::Overflow { completion, .. } | CqError::InError { completion, .. }) => {
                    self.refused.push(completion)
                }
                Err(_) => {}
            }
        }
        while let Some(e) = self.qp.poll_event() {
            self.events.push(e);
        }
        for cq in [&mut self.send_cq, &mut self.recv_cq] {
            while let Some(e) = cq.poll_event() {
                self.events.push(e);
            }
        }
        if let Some(srq) = self.srq.as_mut() {
            while let Some(e) = srq.poll_event() {
                self.events.push(e);
            }
        }
    }

    pub fn send_wcs(&mut self) -> Vec<WorkCompletion> {
        self.pump();
        std::iter::from_fn(|| self.send_cq.poll()).collect()
    }

    pub fn recv_wcs(&mut self) -> Vec<WorkCompletion> {
        self.pump();
        std::iter::from_fn(|| self.recv_cq.poll()).collect()
    }

    /// Transmits into `out` with partial writes of at most `max_write` bytes each (exercises
    /// partial FPDUs). Returns the bytes written.
    pub fn transmit(&mut self, out: &mut Vec<u8>, max_write: impl FnMut() -> usize) -> usize {
        self.transmit_with(out, false, max_write)
    }

    /// As `transmit`, through `Qp::send_to` exactly as the runtime calls it; with `copy`,
    /// the runtime's batch buffer is given, so small FPDUs are coalesced (and a batch the
    /// writer takes only part of waits in the QP's spill).
    pub fn transmit_with(
        &mut self,
        out: &mut Vec<u8>,
        copy: bool,
        max_write: impl FnMut() -> usize,
    ) -> usize {
        let start = out.len();
        let mut batch = Vec::new();
        let mut sink = CutWriter {
            out: &mut *out,
            max_write,
            limit: 64 << 20,
        };
        for _ in 0..1_000_000 {
            // `wants_tx` may say yes for nothing, never no for something.
            let wanted = self.qp.wants_tx();
            let before = sink.out.len();
            let mut budget = usize::MAX;
            let end = self
                .qp
                .send_to(&mut sink, copy.then_some(&mut batch), &mut budget);
            if sink.out.len() > before {
                assert!(wanted, "wants_tx() said nothing to send, send_to sent");
            }
            match end {
                SendEnd::Idle | SendEnd::Full => break,
                SendEnd::Budget => {}
                SendEnd::Failed(e) => panic!("the test writer failed: {e}"),
                SendEnd::Bug(why) => panic!("engine bug: {why}"),
            }
        }
        let total = out.len() - start;
        self.sent.extend_from_slice(&out[start..]);
        total
    }

    /// Sends everything through `Qp::send_to` into the writer `w`, as the runtime does
    /// (with a batch buffer), until the QP has nothing left; for tests that look at the
    /// writer's calls and pieces themselves.
    pub fn send_all(&mut self, w: &mut impl VectoredWrite) {
        let mut batch = Vec::new();
        for _ in 0..1_000_000 {
            let mut budget = usize::MAX;
            match self.qp.send_to(w, Some(&mut batch), &mut budget) {
                SendEnd::Idle => return,
                SendEnd::Budget | SendEnd::Full => {}
                SendEnd::Failed(e) => panic!("the test writer failed: {e}"),
                SendEnd::Bug(why) => panic!("engine bug: {why}"),
            }
        }
        panic!("send_to never went idle");
    }

    /// Transmits into `out` until the writer took `limit` bytes (a socket that fills up).
    pub fn transmit_limited(&mut self, out: &mut Vec<u8>, limit: usize) -> usize {
        let start = out.len();
        let mut sink = CutWriter {
            out: &mut *out,
            max_write: || usize::MAX,
            limit,
        };
        let mut budget = usize::MAX;
        let end = self.qp.send_to(&mut sink, None, &mut budget);
        assert!(matches!(end, SendEnd::Idle | SendEnd::Full), "{end:?}");
        self.sent.extend_from_slice(&out[start..]);
        out.len() - start
    }

    /// Receives all of `wire`, queued at once (a [`Queued`] source), through
    /// `Qp::recv_from` with the runtime's staging buffer, as a busy poll does; returns the
    /// reads it took.
    pub fn receive_queued(&mut self, wire: &[u8]) -> Vec<QueuedRead> {
        let mut stage = vec![0u8; STAGE_LEN];
        let mut src = Queued::new(wire);
        let mut budget = usize::MAX;
        let mut res = RxEnv {
            mrs: &mut self.mrs,
            srq: self.srq.as_mut(),
        };
        let end = self.qp.recv_from(
            &mut src,
            &mut stage,
            &mut budget,
            ReadUntil::ShortRead,
            &mut res,
        );
        assert!(matches!(end, RecvEnd::Drained), "{end:?}");
        assert_eq!(src.at, wire.len(), "not all read");
        src.reads
    }

    /// Receives `data` in pieces chosen by `piece`. Returns bytes consumed.
    pub fn receive(&mut self, data: &[u8], piece: impl FnMut() -> usize) -> usize {
        self.receive_with(data, false, piece)
    }

    /// As `receive`, through `Qp::recv_from` exactly as the runtime calls it, each read
    /// cut to the next piece; with `whole`, the runtime's staging buffer ([`STAGE_LEN`]) is
    /// given (read-ahead, whole FPDUs in one step each, early Sends), without it none.
    pub fn receive_with(
        &mut self,
        data: &[u8],
        whole: bool,
        piece: impl FnMut() -> usize,
    ) -> usize {
        let mut stage = if whole {
            vec![0u8; STAGE_LEN]
        } else {
            Vec::new()
        };
        let mut src = CutReader { data, at: 0, piece };
        let mut retried = false;
        loop {
            let mut budget = usize::MAX;
            let mut res = RxEnv {
                mrs: &mut self.mrs,
                srq: self.srq.as_mut(),
            };
            let end = self.qp.recv_from(
                &mut src,
                &mut stage,
                &mut budget,
                ReadUntil::WouldBlock,
                &mut res,
            );
            match end {
                // Blocked: make room (poll completions) and retry once.
                RecvEnd::Blocked if !retried => {
                    retried = true;
                    self.pump();
                }
                RecvEnd::Drained | RecvEnd::Blocked | RecvEnd::NoReceive => break,
                RecvEnd::Budget | RecvEnd::Eof => unreachable!("no budget, no end of stream"),
                RecvEnd::Failed(e) => panic!("the test reader failed: {e}"),
                RecvEnd::Bug(why) => panic!("engine bug: {why}"),
            }
        }
        self.pump();
        src.at
    }
}

/// A reader over bytes that returns at most `piece()` bytes per read (a socket whose
/// segments arrive in those pieces), then `WouldBlock`.
pub struct CutReader<'a, F> {
    pub data: &'a [u8],
    pub at: usize,
    pub piece: F,
}

impl<F: FnMut() -> usize> VectoredRead for CutReader<'_, F> {
    fn read_to(&mut self, dest: ReadDest<'_>, stage: &mut [u8]) -> std::io::Result<usize> {
        let rest = &self.data[self.at..];
        if rest.is_empty() {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        let n = (self.piece)().clamp(1, rest.len());
        let got = copy_to_dest(&rest[..n], dest, stage)?;
        assert!(got > 0, "a read into nothing");
        self.at += got;
        Ok(got)
    }

    fn read_around(
        &mut self,
        head: &mut [u8],
        dest: ReadDest<'_>,
        tail: &mut [u8],
    ) -> std::io::Result<usize> {
        let rest = &self.data[self.at..];
        if rest.is_empty() {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        let n = (self.piece)().clamp(1, rest.len());
        let got = copy_around(&rest[..n], head, dest, tail)?;
        self.at += got;
        Ok(got)
    }
}

/// One read as the engine asked for it (see [`Queued`]).
#[derive(Debug, Clone, Copy)]
pub struct QueuedRead {
    /// A three-buffer read (an early one): bytes of its head.
    pub head: Option<usize>,
    /// The (middle) destination is a range of a region (zero copy), not a buffer in the QP.
    pub region: bool,
    /// Bytes that destination takes.
    pub dest: usize,
    /// Bytes of staging behind it.
    pub stage: usize,
}

/// A source with everything queued: each read takes all it asks for, as far as there is (a
/// ping-pong's receiver once the peer's `sendmsg` returned); records each read.
pub struct Queued<'a> {
    pub data: &'a [u8],
    pub at: usize,
    pub reads: Vec<QueuedRead>,
}

impl<'a> Queued<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Queued {
            data,
            at: 0,
            reads: Vec::new(),
        }
    }
}

impl Queued<'_> {
    /// Takes all it can into `head`, `dest` and `tail`, recording the read (`early`: a
    /// three-buffer one).
    fn take(
        &mut self,
        head: &mut [u8],
        dest: ReadDest<'_>,
        tail: &mut [u8],
        early: bool,
    ) -> std::io::Result<usize> {
        let rest = &self.data[self.at..];
        if rest.is_empty() {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        self.reads.push(QueuedRead {
            head: early.then_some(head.len()),
            region: matches!(dest, ReadDest::Region { .. }),
            dest: dest.len(),
            stage: tail.len(),
        });
        let got = copy_around(rest, head, dest, tail)?;
        self.at += got;
        Ok(got)
    }
}

impl VectoredRead for Queued<'_> {
    fn read_to(&mut self, dest: ReadDest<'_>, stage: &mut [u8]) -> std::io::Result<usize> {
        self.take(&mut [], dest, stage, false)
    }

    fn read_around(
        &mut self,
        head: &mut [u8],
        dest: ReadDest<'_>,
        tail: &mut [u8],
    ) -> std::io::Result<usize> {
        self.take(head, dest, tail, true)
    }
}

/// A writer that takes at most `max_write()` bytes per write (a socket that takes part of
/// what it is offered), up to `limit` bytes in all, then says `WouldBlock`.
pub struct CutWriter<'a, F> {
    pub out: &'a mut Vec<u8>,
    pub max_write: F,
    pub limit: usize,
}

impl<F: FnMut() -> usize> VectoredWrite for CutWriter<'_, F> {
    fn write_from(&mut self, pieces: &[TxPiece<'_>]) -> std::io::Result<usize> {
        if self.limit == 0 {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        let offered: usize = pieces.iter().map(TxPiece::len).sum();
        assert!(offered > 0, "an empty write");
        let mut want = (self.max_write)().clamp(1, offered).min(self.limit);
        let start = self.out.len();
        for p in pieces {
            if want == 0 {
                break;
            }
            let take = p.len().min(want);
            let at = self.out.len();
            self.out.resize(at + take, 0);
            let mut tmp = vec![0u8; p.len()];
            assert_eq!(p.copy_to(&mut tmp), p.len());
            self.out[at..].copy_from_slice(&tmp[..take]);
            want -= take;
        }
        let n = self.out.len() - start;
        self.limit -= n;
        Ok(n)
    }
}

/// Two connected endpoints.
pub struct Pair {
    pub a: Side,
    pub b: Side,
    pub split: Split,
    rng: Rng,
    /// Bytes sent by a not yet consumed by b, and the reverse.
    a_to_b: Vec<u8>,
    b_to_a: Vec<u8>,
}

impl Pair {
    pub fn new(split: Split, stream: StreamConfig) -> Self {
        Self::from_sides(Side::new(1, stream), Side::new(2, stream), split)
    }

    /// A pair whose directions use markers as asked: `a_to_b` when a inserts markers for b,
    /// `b_to_a` the other way (each side's MPA frame asking for what it receives).
    pub fn with_markers(split: Split, stream: StreamConfig, a_to_b: bool, b_to_a: bool) -> Self {
        let (sa, sb) = marker_streams(stream, a_to_b, b_to_a);
        Self::from_sides(Side::new(1, sa), Side::new(2, sb), split)
    }

    pub fn from_sides(a: Side, b: Side, split: Split) -> Self {
        let seed = match split {
            Split::Random { seed, .. } | Split::Staged { seed, .. } => seed,
            _ => 1,
        };
        Pair {
            a,
            b,
            split,
            rng: Rng::new(seed),
            a_to_b: Vec::new(),
            b_to_a: Vec::new(),
        }
    }

    fn piece_fn(split: Split, rng: &mut Rng) -> impl FnMut() -> usize + '_ {
        move || match split {
            Split::Whole => usize::MAX,
            Split::OneByte => 1,
            Split::Random { max, .. } | Split::Staged { max, .. } => rng.piece(max),
        }
    }

    /// Moves bytes both ways until neither side has anything to send or to consume.
    pub fn drive(&mut self) {
        for _ in 0..1_000_000 {
            let mut progress = false;
            let split = self.split;
            let whole = matches!(split, Split::Staged { .. });
            progress |= self.a.transmit_with(
                &mut self.a_to_b,
                whole,
                Self::piece_fn(split, &mut self.rng),
            ) > 0;
            progress |= self.b.transmit_with(
                &mut self.b_to_a,
                whole,
                Self::piece_fn(split, &mut self.rng),
            ) > 0;
            if !self.a_to_b.is_empty() {
                let data = std::mem::take(&mut self.a_to_b);
                let n = self
                    .b
                    .receive_with(&data, whole, Self::piece_fn(split, &mut self.rng));
                self.a_to_b = data[n..].to_vec();
                progress |= n > 0;
            }
            if !self.b_to_a.is_empty() {
                let data = std::mem::take(&mut self.b_to_a);
                let n = self
                    .a
                    .receive_with(&data, whole, Self::piece_fn(split, &mut self.rng));
                self.b_to_a = data[n..].to_vec();
                progress |= n > 0;
            }
            self.a.pump();
            self.b.pump();
            if !progress {
                return;
            }
        }
        panic!("pair did not settle");
    }

    /// Bytes a sent that b did not consume (e.g. after b stopped receiving).
    pub fn undelivered_to_b(&self) -> usize {
        self.a_to_b.len()
    }
}

/// The two sides' stream configurations for markers `a_to_b` and `b_to_a`.
pub fn marker_streams(
    stream: StreamConfig,
    a_to_b: bool,
    b_to_a: bool,
) -> (StreamConfig, StreamConfig) {
    let mut a = stream;
    a.markers_tx = a_to_b;
    a.markers_rx = b_to_a;
    let mut b = stream;
    b.markers_tx = b_to_a;
    b.markers_rx = a_to_b;
    b.tx_stream_offset = stream.rx_stream_offset;
    b.rx_stream_offset = stream.tx_stream_offset;
    (a, b)
}

/// The four marker configurations: none, a to b only, b to a only, both.
pub const MARKER_MODES: [(bool, bool); 4] =
    [(false, false), (true, false), (false, true), (true, true)];

/// Splits a stream of FPDUs sent with markers (`markers`) from stream offset `offset` into
/// marker-free FPDUs, with `softwarp_wire::mpa::marker::strip`; panics on any error.
/// Returns each FPDU's length on the wire and its marker-free bytes.
pub fn strip_stream(
    wire: &[u8],
    mut offset: u64,
    markers: bool,
    crc: bool,
) -> Vec<(usize, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < wire.len() {
        if markers {
            let mut plain = vec![0u8; 70_000];
            let (used, len) =
                softwarp_wire::mpa::marker::strip(&wire[at..], offset, crc, &mut plain)
                    .unwrap_or_else(|e| panic!("strip at {at} (stream offset {offset}): {e}"));
            plain.truncate(len);
            out.push((used, plain));
            at += used;
            offset = offset.wrapping_add(used as u64);
        } else {
            let (_, n) = softwarp_wire::mpa::Fpdu::parse(&wire[at..], crc).unwrap();
            out.push((n, wire[at..at + n].to_vec()));
            at += n;
        }
    }
    out
}

/// An SGE over `len` bytes at `off` of the registration (stag, iova).
/// A signaled, unfenced work request of `op` over `sgl`.
pub fn signaled_wr(wr_id: u64, op: SendOp, sgl: SgList) -> SendWr<'static> {
    SendWr {
        wr_id,
        op,
        payload: Payload::Sgl(sgl),
        signaled: true,
        fence: false,
    }
}

pub fn sge(stag: Stag, iova: u64, off: u64, len: u32) -> Sge {
    Sge {
        addr: iova + off,
        length: len,
        lkey: stag,
    }
}

/// Reads a whole region.
pub fn contents(r: &Region) -> Vec<u8> {
    let mut v = vec![0u8; r.len()];
    r.read_at(0, &mut v).unwrap();
    v
}
