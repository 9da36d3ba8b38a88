//! The byte pump: the QP's two data-path entry points, [`Qp::recv_from`] and [`Qp::send_to`],
//! over a vectored reader and writer the caller supplies. Still sans IO: the engine decides
//! where every byte goes and which bytes go out; the traits do the moving (the runtime over
//! `readv`/`sendmsg` on a non-blocking socket, the tests over byte slices cut as they
//! like), so tests run exactly the runtime's path.
//!
//! Receive ([`Qp::recv_from`]): each read names the receive state machine's current target
//! (a range of the destination region: zero copy) and, behind it, the caller's staging
//! buffer, so that one read also takes what follows; a target inside the QP (a header,
//! pad or CRC buffer, a few dozen bytes) is read through the staging buffer instead, so
//! that such a read fills one buffer (the runtime's `recv` rather than `readv`). Staged
//! bytes go to the engine's next targets by copying, the whole FPDUs at
//! their start in one step each ([`Qp::rx_whole_fpdu`], with the small-Send fast path),
//! and so does the header of an FPDU that is not all there.
//! A new FPDU is read into the staging buffer only (its header would otherwise cost a
//! read of its own). While messages are large (a payload of [`BIG_PAYLOAD`] bytes or
//! more, until two messages in a row start with a small FPDU) only a header's worth is
//! staged behind each read: one read takes a payload into its destination and the trailer
//! and next header behind it, so that large payloads keep landing without a copy, the
//! first FPDU of the next large message included. That is one read per large FPDU: the
//! next FPDU's destination is known only once its header is in, and nothing is placed
//! before its header named it, with one exception: once two large Send messages of one
//! layout came in a row, the next message's first large payload is read early, straight
//! into the posted receive, with its leading FPDUs and header in front of it in the
//! staging buffer ([`RxState::early_read`](super::rx::RxState::early_read); confirmed by the header or copied out again).
//! QPs on an SRQ never stage: their receiver may hold
//! a header back until completions are polled, with staged bytes it could not take. A QP
//! with its own RQ holds a header only for the RNR wait (a Send that finds no receive
//! posted, [`crate::qp::Timers::rnr_wait`]): the staged bytes behind it are then kept in
//! the QP (`RxState::parked`, allocated then, and given back once it is past) and handed
//! out first by the call that resumes, before anything more is read. Once
//! the QP no longer receives, reads go to the staging buffer and are dropped, so the end
//! of the stream is still seen.
//!
//! Transmit ([`Qp::send_to`]): bytes of an earlier batch the writer did not take go first;
//! then small FPDUs (up to [`COALESCE_MAX`] bytes) are copied whole into the caller's batch
//! buffer and committed (one write for many of them: a list of Sends, a queue that built
//! up behind a full socket), bytes of it the writer does not take wait in the QP; larger
//! FPDUs are gathered straight from registered memory, several per write. No coalescing
//! with markers: then every FPDU starts its own segment, as MPA asks senders with markers
//! and as the marker-aware dissectors expect.
//!
//! What the engine does not do: wait, read a clock, or know what a descriptor is. The caller
//! chooses the staging and batch buffers (and their sizes), the byte budget of a pass, and
//! whether a short read ends it ([`ReadUntil`]); the outcome ([`RecvEnd`], [`SendEnd`])
//! tells it what to do next.

use std::io;

use arrayvec::ArrayVec;

use crate::memory::Region;
use crate::mr::MrTable;
use crate::qp::rx::EarlyRead;
use crate::qp::tx::{RunPiece, RunPlan, MAX_GATHER_FPDUS, RUN_GATHER_PIECES};
use crate::qp::{Qp, QpState, RxTarget, TxGather, TxPiece};
use crate::srq::Srq;

/// A payload at least this long is read straight into its destination, with only a
/// header's worth of staging behind it.
pub const BIG_PAYLOAD: usize = 16 * 1024;
/// Staging behind a large payload: room for the trailer, the next FPDU's header and a
/// short FPDU after it, so that the last FPDU of a message (what is left after the
/// 65,521-byte payloads of a Write's full FPDUs: 60 bytes of 256 KiB, 240 of 1 MiB) comes
/// in with the read of the payload before it instead of costing a read of its own (a
/// successful `readv` costs about 0.8 us on this kernel, a copy of 512 bytes some tens of
/// nanoseconds). At most this many bytes of a following payload are copied per read.
pub(crate) const SMALL_STAGE: usize = 512;
/// The staging buffer a runtime should give [`Qp::recv_from`]: 64 KiB, and 8 KiB more so
/// that an early read (a Send's payload read before its header, [`Qp::recv_from`]) takes
/// the largest FPDU (a 65,535-byte ULPDU) whole with its leading FPDUs and the
/// 512 bytes of staging behind it; with a smaller buffer the early read takes less and
/// the rest of the payload costs a read of its own.
pub const STAGE_LEN: usize = 72 * 1024;
/// FPDUs up to this long are copied into the batch rather than gathered (a copy this small
/// costs less than a system call of its own).
pub const COALESCE_MAX: usize = 2048;
/// An FPDU up to this long is copied into the batch also when it is the only work request
/// waiting (a ping-pong's message): one buffer, sent with the runtime's one-buffer call,
/// instead of three pieces gathered. On the VM measured (`scripts/syscall-cost.c`, thread
/// CPU time) a 4 KiB FPDU copied and sent cost 120 ns less than gathered, 8 KiB 20-60 ns
/// less, 16 KiB 120 ns more. A queue of such FPDUs is still gathered, many per write.
pub const LONE_COPY_MAX: usize = 8 * 1024;
/// Largest batch of coalesced FPDUs per write. A message in MSS-sized FPDUs (to siw or
/// any peer behind a 1500-byte MTU) is copied into batches this large: on loopback with
/// `--fpdu 1460`, 1 MiB Writes ran at 8.2-8.6 GB/s with 256 KiB batches (128 KiB
/// 5.0-8.4, 512 KiB 8.5-8.6) against 5.0-5.3 with 32 KiB (BENCHMARKS.md, "MSS-sized
/// FPDUs"): each write call costs the sender as much as copying several KiB.
pub const BATCH_CAP: usize = 256 * 1024;
/// What a QP's spill (the part of a batch the writer did not take, [`Qp::send_to`]) keeps
/// of its memory once the QP has nothing left to send: a QP that filled its socket in the
/// middle of a large batch gives the rest back when it goes idle.
const SPILL_KEEP: usize = 32 * 1024;
/// About how many bytes of large FPDUs one write gathers (the FPDU that reaches it is the
/// last): a 1 MiB message goes out in two `sendmsg` calls of about 512 KiB, the second
/// with the short FPDU at the end. On loopback the receiver sees nothing of a call until
/// the call returns, so with one 1 MiB call the ping-pong was the sender's whole copy and
/// then the receiver's; with two, the receiver reads the first half while the sender
/// copies the second: `send_lat -s 1M` 103-127 us against 106-214 with one call (raw TCP
/// 94-106; 256 KiB and 384 KiB calls were slower than 512 KiB; BENCHMARKS.md, "what each
/// FPDU costs").
const GATHER_BYTES: usize = 512 * 1024;

/// Where a read puts its first bytes: a buffer inside the QP, or a range of a registered
/// region. A reader that hands the region range to the kernel gets its address from
/// [`Region::ptr_range`] (the only way region memory reaches a system call); one that
/// copies uses [`Region::write_at`].
#[derive(Debug)]
pub enum ReadDest<'a> {
    /// A buffer inside the QP (or nothing: then the read goes to the staging buffer only).
    Buffer(&'a mut [u8]),
    /// `len` bytes at `offset` of `region`.
    Region {
        /// The destination region.
        region: &'a Region,
        /// Offset inside the region.
        offset: usize,
        /// Most bytes that may go there.
        len: usize,
    },
}

impl ReadDest<'_> {
    /// Bytes this destination takes.
    pub fn len(&self) -> usize {
        match self {
            ReadDest::Buffer(b) => b.len(),
            ReadDest::Region { len, .. } => *len,
        }
    }
    /// True when it takes nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A byte source read like `readv(2)`: into `dest`, then into `stage`.
pub trait VectoredRead {
    /// Reads at most `dest.len() + stage.len()` bytes, filling `dest` first. Returns the
    /// bytes read, `Ok(0)` at the end of the stream (never asked with both empty), or an
    /// error: `WouldBlock` when nothing is there now, `Interrupted` to be asked again,
    /// `InvalidInput` when `dest` names memory outside its region (an engine bug), any
    /// other when the stream failed.
    fn read_to(&mut self, dest: ReadDest<'_>, stage: &mut [u8]) -> io::Result<usize>;

    /// Reads like `readv(2)` of three buffers: `head`, then `dest`, then `tail` (an early
    /// read, [`Qp::recv_from`]). Errors as [`VectoredRead::read_to`]. The default reads
    /// into `head` only: a reader that does not implement it still gets every byte, none
    /// of them early.
    fn read_around(
        &mut self,
        head: &mut [u8],
        dest: ReadDest<'_>,
        tail: &mut [u8],
    ) -> io::Result<usize> {
        let _ = (dest, tail);
        self.read_to(ReadDest::Buffer(head), &mut [])
    }
}

/// A byte sink written like `sendmsg(2)`: a gather list, in order.
pub trait VectoredWrite {
    /// Writes a prefix of `pieces` (at most [`crate::qp::GATHER_PIECES`] are looked at,
    /// except in a gathered run of MSS-sized FPDUs, which offers up to
    /// [`crate::qp::RUN_GATHER_PIECES`]: a writer that takes fewer pieces is correct but
    /// has the rest copied); returns its length.
    /// Errors as for [`VectoredRead::read_to`] (`WouldBlock`: full now).
    fn write_from(&mut self, pieces: &[TxPiece<'_>]) -> io::Result<usize>;
}

/// What a receive commit may need: the STag table (a header to validate, an FPDU to
/// deliver) and the SRQ of a QP that receives from one. Taken only when a commit needs
/// them, so that most commits (payload and partial header or trailer bytes) never touch
/// them, and let go before every read: a runtime that locks them never holds them across
/// a system call.
pub trait RxResources {
    /// The STag table and the SRQ (`None` for a QP with its own RQ), for the rest of this
    /// step. A runtime that locks both takes the SRQ first.
    fn get(&mut self) -> (&mut MrTable, Option<&mut Srq>);
    /// Lets go of what [`RxResources::get`] took (called before every read).
    fn release(&mut self) {}
    /// Runs `f` with the STag table, only to read it (an early read's validation, asked at
    /// every poll while early reads are armed): a runtime may take a shared lock for it
    /// rather than [`RxResources::get`]'s exclusive one. Let go of before the read.
    fn with_mrs<R>(&mut self, f: impl FnOnce(&MrTable) -> R) -> R {
        f(self.get().0)
    }
}

impl RxResources for MrTable {
    fn get(&mut self) -> (&mut MrTable, Option<&mut Srq>) {
        (self, None)
    }
}

/// A QP's STag table and SRQ, held for the whole receive (tests and simple runtimes).
#[derive(Debug)]
pub struct RxEnv<'a> {
    /// The STag table.
    pub mrs: &'a mut MrTable,
    /// The SRQ, for a QP that receives from one.
    pub srq: Option<&'a mut Srq>,
}

impl RxResources for RxEnv<'_> {
    fn get(&mut self) -> (&mut MrTable, Option<&mut Srq>) {
        (self.mrs, self.srq.as_deref_mut())
    }
}

/// When [`Qp::recv_from`] stops reading a source that still has bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadUntil {
    /// Only when a read says `WouldBlock` (or the budget is spent): for an edge-triggered
    /// poller, which gives no new edge for an end of stream queued behind a short read.
    WouldBlock,
    /// Also after a read returned less than it asked for (the source is empty for now):
    /// for a caller that reads again at its next poll anyway.
    ShortRead,
}

/// How a [`Qp::recv_from`] ended.
#[derive(Debug)]
pub enum RecvEnd {
    /// The source has nothing more for now, or the QP does not read.
    Drained,
    /// The byte budget is spent with more to read.
    Budget,
    /// Nothing can be received until completions are polled (the QP holds as many SRQ
    /// receives as it may): poll them, then call again.
    Blocked,
    /// A Send (or Immediate Data) found no receive posted and is held for one (the RNR
    /// wait, [`crate::qp::Timers::rnr_wait`]): nothing more is read until a receive is
    /// posted (then call again) or the wait's bound passes ([`Qp::poll_timeout`], then
    /// [`Qp::handle_timeout`] and call again). Sending goes on meanwhile.
    NoReceive,
    /// The source reached its end (the peer closed the stream).
    Eof,
    /// A read failed: the stream is lost.
    Failed(io::Error),
    /// The engine offered a target it cannot use (a bug in the engine): stop receiving.
    Bug(&'static str),
}

/// How a [`Qp::send_to`] ended.
#[derive(Debug)]
pub enum SendEnd {
    /// Nothing (more) to send now.
    Idle,
    /// The writer is full (`WouldBlock`) with bytes pending.
    Full,
    /// The byte budget is spent with more to send.
    Budget,
    /// A write failed: the stream is lost (the bytes of a batch not yet written are
    /// dropped).
    Failed(io::Error),
    /// The engine offered something it cannot send (a bug in the engine).
    Bug(&'static str),
}

/// How many bytes to stage behind the current target.
fn stage_len(staging: bool, small: bool, cap: usize) -> usize {
    match (staging, small) {
        (false, _) => 0,
        (true, true) => SMALL_STAGE.min(cap),
        (true, false) => cap,
    }
}

impl Qp {
    /// Receives from `src` until it has nothing more for now (or `until` says stop), the
    /// `budget` (bytes, decremented by every byte read) is spent, the receiver blocks, or
    /// the stream ends; places, validates and delivers as the bytes arrive (see the module
    /// docs). `stage` is the read-ahead buffer (empty: read every target on its own);
    /// `res` gives the STag table and SRQ when a commit needs them.
    // Inlined into its caller: a frame of its own costs more per pass than anything it
    // does for a small message (callgrind, `examples/msgrate`).
    #[inline(always)]
    pub fn recv_from(
        &mut self,
        src: &mut impl VectoredRead,
        stage: &mut [u8],
        budget: &mut usize,
        until: ReadUntil,
        res: &mut impl RxResources,
    ) -> RecvEnd {
        let end = self.recv_from_inner(src, stage, budget, until, res);
        // No reference to placed memory outlives the call.
        self.rx.let_go();
        end
    }

    #[inline(always)]
    fn recv_from_inner(
        &mut self,
        src: &mut impl VectoredRead,
        stage: &mut [u8],
        budget: &mut usize,
        until: ReadUntil,
        res: &mut impl RxResources,
    ) -> RecvEnd {
        // QPs on an SRQ do not stage: their receiver may block with staged bytes.
        let staging = !self.cfg.use_srq;
        let mut empty_targets = 0;
        // Bytes read ahead into `stage[..staged]`, handed out from `fed`.
        let (mut fed, mut staged) = (0usize, 0usize);
        // The last read returned less than asked: the source is empty for now.
        let mut short_read = false;
        loop {
            if fed < staged {
                if let Some(end) = self.feed(stage, &mut fed, staged, res) {
                    return end;
                }
                continue;
            }
            if !self.rx.parked.is_empty() {
                // Bytes read past a held header in an earlier call come before any read.
                match self.unpark(stage, res) {
                    Ok(n) => (fed, staged) = (0, n),
                    Err(end) => return end,
                }
                continue;
            }
            if short_read {
                return RecvEnd::Drained;
            }
            if *budget == 0 {
                return RecvEnd::Budget;
            }
            if staging && self.rx.early_armed() {
                let early = res.with_mrs(|mrs| self.rx.early_read(stage.len(), mrs));
                if let Some(early) = early {
                    res.release();
                    let asked = early.lead + early.len + SMALL_STAGE;
                    match self.recv_early(src, stage, early, &mut fed, &mut staged, res) {
                        Err(end) => return end,
                        Ok(Ok(0)) => return RecvEnd::Eof,
                        Ok(Ok(n)) => {
                            empty_targets = 0;
                            *budget = budget.saturating_sub(n);
                            short_read = until == ReadUntil::ShortRead && n < asked;
                        }
                        Ok(Err(e)) => {
                            if let Some(end) = read_failed(e) {
                                return end;
                            }
                        }
                    }
                    continue;
                }
            }
            res.release();
            let small_stage = self.rx.big;
            let ahead =
                staging && !small_stage && !stage.is_empty() && self.rx.expects_whole_fpdu();
            let (r, target_len, asked) = if ahead {
                // A new FPDU starts: read it and what follows into the staging buffer only,
                // from where whole FPDUs go to the engine in one step each.
                let asked = stage.len();
                (
                    Some(src.read_to(ReadDest::Buffer(&mut []), stage)),
                    0,
                    asked,
                )
            } else {
                match self.rx_target() {
                    RxTarget::Buffer([]) | RxTarget::Region { len: 0, .. } => (None, 0, 0),
                    RxTarget::Buffer(b) => {
                        let len = b.len();
                        let extra = stage_len(staging, small_stage, stage.len());
                        if extra > 0 {
                            // A header or trailer (a few dozen bytes at most) and what
                            // follows go to the staging buffer only, from where `feed`
                            // copies them: one buffer per read, which a reader can take
                            // with a cheaper call than a two-buffer one (`recv` against
                            // `readv`), and the same bytes land where they did.
                            let asked = len.saturating_add(extra).min(stage.len());
                            let stage = stage.get_mut(..asked).unwrap_or_default();
                            (
                                Some(src.read_to(ReadDest::Buffer(&mut []), stage)),
                                0,
                                asked,
                            )
                        } else {
                            let asked = len;
                            (Some(src.read_to(ReadDest::Buffer(b), &mut [])), len, asked)
                        }
                    }
                    RxTarget::Region {
                        region,
                        offset,
                        len,
                    } => {
                        let big = len >= BIG_PAYLOAD;
                        let extra = stage_len(staging, small_stage || big, stage.len());
                        let extra = stage.get_mut(..extra).unwrap_or_default();
                        let asked = len + extra.len();
                        let dest = ReadDest::Region {
                            region,
                            offset,
                            len,
                        };
                        (Some(src.read_to(dest, extra)), len, asked)
                    }
                    RxTarget::Blocked => {
                        if let Some(end) = self.resume_held(res) {
                            return end;
                        }
                        continue;
                    }
                    RxTarget::Closed => {
                        // The QP no longer receives: read on (and drop the bytes) to see
                        // the end of the stream.
                        if stage.is_empty() {
                            return RecvEnd::Drained;
                        }
                        match src.read_to(ReadDest::Buffer(&mut []), stage) {
                            Ok(0) => return RecvEnd::Eof,
                            Ok(n) => {
                                *budget = budget.saturating_sub(n);
                                continue;
                            }
                            Err(e) => (Some(Err(e)), 0, 0),
                        }
                    }
                }
            };
            let Some(r) = r else {
                // Let the receiver advance, but never spin.
                empty_targets += 1;
                if empty_targets > 2 {
                    return RecvEnd::Bug("engine offers only empty rx targets");
                }
                let _ = self.rx_commit(0, res);
                continue;
            };
            match r {
                Ok(0) => return RecvEnd::Eof,
                Ok(n) => {
                    empty_targets = 0;
                    *budget = budget.saturating_sub(n);
                    let direct = n.min(target_len);
                    if direct > 0 && self.rx_commit(direct, res).is_err() {
                        return RecvEnd::Bug("rx_commit refused");
                    }
                    fed = 0;
                    staged = n - direct;
                    short_read = until == ReadUntil::ShortRead && n < asked;
                }
                Err(e) => {
                    if let Some(end) = read_failed(e) {
                        return end;
                    }
                }
            }
        }
    }

    /// Does the early read `early` (see [`RxState::early_read`](super::rx::RxState::early_read)): the lead into the staging
    /// buffer, the expected payload into the posted receive, and [`SMALL_STAGE`] bytes of
    /// staging behind it. When the lead is the expected one ([`RxState::early_lead_ok`](super::rx::RxState::early_lead_ok)) it is
    /// received, and if its header then targets exactly the bytes read early, they are
    /// committed where they are. Otherwise they are copied out of the receive buffer into
    /// the staging buffer, between the lead and the bytes behind, and received from there
    /// like any bytes read ahead (the receive buffer is the QP's until the receive
    /// completes; nothing else was touched). Leaves `stage[*fed..*staged]` to be fed and
    /// returns the read's outcome, or how the receive ends when the engine failed.
    fn recv_early(
        &mut self,
        src: &mut impl VectoredRead,
        stage: &mut [u8],
        early: EarlyRead,
        fed: &mut usize,
        staged: &mut usize,
        res: &mut impl RxResources,
    ) -> Result<io::Result<usize>, RecvEnd> {
        let lead = early.lead;
        let region = early.memory.region();
        let (head, rest) = stage.split_at_mut(lead.min(stage.len()));
        // Behind the lead the staging buffer must have room for the payload too, should it
        // be copied out ([`RxState::early_read`](super::rx::RxState::early_read) cuts the read to fit).
        if rest.len() < early.len + SMALL_STAGE {
            return Err(RecvEnd::Bug("early read larger than the staging buffer"));
        }
        let tail = rest.get_mut(..SMALL_STAGE).unwrap_or_default();
        let dest = ReadDest::Region {
            region,
            offset: early.offset,
            len: early.len,
        };
        let n = match src.read_around(head, dest, tail) {
            Ok(n) => n,
            Err(e) => return Ok(Err(e)),
        };
        *fed = 0;
        if n <= lead {
            *staged = n;
            return Ok(Ok(n));
        }
        let placed = (n - lead).min(early.len);
        let behind = n - lead - placed;
        if self
            .rx
            .early_lead_ok(&early, stage.get(..lead).unwrap_or_default(), placed)
        {
            *staged = lead;
            while *fed < lead {
                if let Some(end) = self.feed(stage, fed, lead, res) {
                    return Err(end);
                }
            }
            let hit = matches!(
                self.rx_target(),
                RxTarget::Region { region: r, offset, len }
                    if std::ptr::eq(r, region) && offset == early.offset && len >= placed
            );
            if hit {
                if self.rx_commit(placed, res).is_err() {
                    return Err(RecvEnd::Bug("rx_commit refused"));
                }
                self.stats.rx_early_bytes += placed as u64;
                *staged = lead + behind;
                return Ok(Ok(n));
            }
        }
        // Not the expected Send: the bytes go where their headers say, from the staging
        // buffer.
        stage.copy_within(lead..lead + behind, lead + placed);
        let copied = stage
            .get_mut(lead..lead + placed)
            .map(|d| region.read_at(early.offset, d));
        if !matches!(copied, Some(Ok(()))) {
            return Err(RecvEnd::Bug("unusable rx target"));
        }
        *staged = lead + placed + behind;
        self.stats.rx_early_missed_bytes += placed as u64;
        self.rx.early_missed();
        Ok(Ok(n))
    }

    /// Bytes read past a held header in an earlier call (the RNR wait) are waiting in the
    /// QP: once the header goes on, as many as fit go into `stage` to be fed (returns how
    /// many), else how the receive ends for now. Out of line: `recv_from` is inlined into
    /// the runtime's passes, which this rare case should not make larger.
    #[cold]
    #[inline(never)]
    fn unpark(&mut self, stage: &mut [u8], res: &mut impl RxResources) -> Result<usize, RecvEnd> {
        if let Some(end) = self.resume_held(res) {
            return Err(end);
        }
        match self.rx.unpark(stage) {
            0 => Err(RecvEnd::Bug("parked bytes and no staging buffer")),
            n => Ok(n),
        }
    }

    /// Plans a held header again (completions polled, or a receive posted since):
    /// `None` when it went on, else how the receive ends for now.
    #[inline(never)]
    fn resume_held(&mut self, res: &mut impl RxResources) -> Option<RecvEnd> {
        if !matches!(self.rx_target(), RxTarget::Blocked) {
            return None;
        }
        let _ = self.rx_commit(0, res);
        if self.state == QpState::Closing {
            self.rnr_abandon();
        }
        if !matches!(self.rx_target(), RxTarget::Blocked) {
            None
        } else if self.rx.rnr_waiting() {
            Some(RecvEnd::NoReceive)
        } else {
            Some(RecvEnd::Blocked)
        }
    }

    /// Hands staged bytes `stage[*fed..staged]` to the receiver: the whole FPDUs at their
    /// start in one step each, then the next target's worth of the rest (a copy). Returns
    /// how the receive ends when it cannot go on.
    fn feed(
        &mut self,
        stage: &[u8],
        fed: &mut usize,
        staged: usize,
        res: &mut impl RxResources,
    ) -> Option<RecvEnd> {
        // Whole FPDUs keep the staging hint through their headers (`RxState::note_fpdu`):
        // after a large one, the following payloads are read straight into their
        // destinations (FPDUs that fit the staging buffer exactly, as 32 KiB ones on a
        // 32 KiB-MSS loopback do in pairs, would otherwise never leave it).
        // The trailer of an FPDU whose payload was read into its destination comes first.
        loop {
            let bytes = stage.get(*fed..staged).unwrap_or_default();
            let Some(n) = self
                .rx_whole_fpdu(bytes, res)
                .or_else(|| self.rx_staged_trailer(bytes, res))
            else {
                break;
            };
            *fed += n;
        }
        if *fed >= staged {
            return None;
        }
        let bytes = stage.get(*fed..staged).unwrap_or_default();
        let mut staged_payload = false;
        let rnr_waiting = self.rx.rnr_waiting();
        let closing = self.state == QpState::Closing;
        let n = match self.rx_target() {
            RxTarget::Buffer(b) => {
                let n = b.len().min(bytes.len());
                if let (Some(d), Some(s)) = (b.get_mut(..n), bytes.get(..n)) {
                    d.copy_from_slice(s);
                }
                n
            }
            RxTarget::Region {
                region,
                offset,
                len,
            } => {
                let n = len.min(bytes.len());
                if region
                    .write_at(offset, bytes.get(..n).unwrap_or_default())
                    .is_err()
                {
                    return Some(RecvEnd::Bug("unusable rx target"));
                }
                staged_payload = true;
                n
            }
            // A Send held for a receive (the RNR wait): the bytes behind its header wait
            // in the QP. (A QP on an SRQ, which may also hold for completions, does not
            // stage.)
            RxTarget::Blocked if rnr_waiting && closing => {
                // Closing: nothing more is received (`Qp::rnr_abandon`).
                self.rnr_abandon();
                *fed = staged;
                return None;
            }
            RxTarget::Blocked if rnr_waiting => {
                self.rx.park(bytes);
                *fed = staged;
                return Some(RecvEnd::NoReceive);
            }
            RxTarget::Blocked => return Some(RecvEnd::Bug("receiver blocked with staged bytes")),
            RxTarget::Closed => {
                // The QP no longer receives: the rest is dropped.
                *fed = staged;
                return None;
            }
        };
        if staged_payload {
            self.stats.rx_staged_payload_bytes += n as u64;
        }
        if n == 0 {
            let _ = self.rx_commit(0, res);
            if matches!(
                self.rx_target(),
                RxTarget::Buffer([]) | RxTarget::Region { len: 0, .. }
            ) {
                return Some(RecvEnd::Bug("engine offers only empty rx targets"));
            }
            return None;
        }
        if self.rx_commit(n, res).is_err() {
            return Some(RecvEnd::Bug("rx_commit refused"));
        }
        *fed += n;
        None
    }

    /// Sends to `dst` until there is nothing to send, `dst` is full, or the `budget`
    /// (bytes, decremented by every byte written) is spent. With `batch` (a buffer the
    /// caller keeps; it grows to [`BATCH_CAP`] once), small FPDUs are coalesced into one
    /// write; without it every FPDU is gathered from its pieces.
    #[inline(always)]
    pub fn send_to(
        &mut self,
        dst: &mut impl VectoredWrite,
        mut batch: Option<&mut Vec<u8>>,
        budget: &mut usize,
    ) -> SendEnd {
        loop {
            if *budget == 0 {
                return SendEnd::Budget;
            }
            // 1. Bytes of an earlier batch that the writer did not take.
            if !self.tx.spill.is_empty() {
                let r = dst.write_from(&[TxPiece::Bytes(&self.tx.spill)]);
                if let Ok(n) = r {
                    *budget = budget.saturating_sub(n);
                    self.tx.spill.drain(..n.min(self.tx.spill.len()));
                    continue;
                }
                match self.tx_error(r) {
                    Some(end) => return end,
                    None => continue,
                }
            }
            // Nothing (more) to send: spare the questions below.
            if !self.wants_tx() {
                if self.tx.spill.capacity() > SPILL_KEEP {
                    self.tx.spill = Vec::new();
                }
                return SendEnd::Idle;
            }
            // 2. Small FPDUs, copied into one batch (not with markers).
            if let Some(batch) = batch.as_deref_mut().filter(|_| !self.tx.markers) {
                if batch.len() < BATCH_CAP {
                    batch.resize(BATCH_CAP, 0);
                }
                let out = batch.get_mut(..BATCH_CAP).unwrap_or_default();
                // The only WR waiting (a ping-pong's message): up to LONE_COPY_MAX.
                let lone = self.sq.next_seq == self.sq.tx_seq.wrapping_add(1);
                let max_each = if lone { LONE_COPY_MAX } else { COALESCE_MAX };
                let used = self.tx_copy_fpdus(out, max_each);
                if self.tx.run_waiting {
                    // A message in MSS-sized FPDUs goes on from the WR's memory.
                    self.tx.run_waiting = false;
                    match self.send_gathered(dst, out, used, max_each, budget) {
                        Gathered::End(end) => return end,
                        Gathered::Sent => continue,
                        // Nothing to write: the general path's turn (below).
                        Gathered::Nothing => {}
                    }
                }
                let batch = batch.get(..used).unwrap_or_default();
                if !batch.is_empty() {
                    let r = dst.write_from(&[TxPiece::Bytes(batch)]);
                    let n = *r.as_ref().unwrap_or(&0);
                    // The batch is committed: what the writer did not take waits here.
                    self.tx
                        .spill
                        .extend_from_slice(batch.get(n..).unwrap_or_default());
                    *budget = budget.saturating_sub(n);
                    if r.is_ok() {
                        continue;
                    }
                    match self.tx_error(r) {
                        Some(end) => return end,
                        None => continue,
                    }
                }
            }
            // 3. Large FPDUs, gathered from their pieces (zero copy), several per write.
            let r = {
                let mut fpdus = TxGather::new();
                if !self.poll_tx_gather(MAX_GATHER_FPDUS, GATHER_BYTES, &mut fpdus) {
                    return SendEnd::Idle;
                }
                dst.write_from(&fpdus)
            };
            match r {
                // Only an FPDU without bytes writes nothing; never spin on it.
                Ok(0) => return SendEnd::Bug("engine offered an empty FPDU"),
                Ok(written) => {
                    *budget = budget.saturating_sub(written);
                    if self.tx_commit(written).is_err() {
                        return SendEnd::Bug("tx_commit refused");
                    }
                }
                Err(_) => {
                    if let Some(end) = self.tx_error(r) {
                        return end;
                    }
                }
            }
        }
    }

    /// A gathered run ([`Qp::send_to`]): the `used` bytes the copy paths left in `batch`,
    /// then the next FPDUs of the message in progress with their headers and trailers in
    /// `batch` and their payloads in the WR's memory ([`Qp::tx_fill`] with a plan),
    /// then whatever the copy paths add behind them, in one write. Everything is
    /// committed, as a batch is: the bytes the writer did not take are copied into the
    /// spill before this returns, so no WR completes (or has its memory released) with
    /// bytes of it still to be read from its memory. Out of line: its lists are too
    /// large for the stack frame of every small message's pass.
    #[inline(never)]
    fn send_gathered(
        &mut self,
        dst: &mut impl VectoredWrite,
        batch: &mut [u8],
        used: usize,
        max_each: usize,
        budget: &mut usize,
    ) -> Gathered {
        let mut plan = RunPlan::new();
        if used > 0 {
            plan.wire = used;
            let _ = plan.pieces.try_push(RunPiece::Batch { at: 0, len: used });
        }
        let used = self.tx_fill(batch, used, max_each, Some(&mut plan));
        if plan.pieces.is_empty() {
            return Gathered::Nothing;
        }
        let batch = batch.get(..used).unwrap_or_default();
        let r = {
            let mut pieces = ArrayVec::<TxPiece<'_>, RUN_GATHER_PIECES>::new();
            if !plan.resolve(&self.sq, batch, &mut pieces) {
                return Gathered::End(SendEnd::Bug("a gathered run names memory it cannot reach"));
            }
            let r = dst.write_from(&pieces);
            let mut skip = *r.as_ref().unwrap_or(&0);
            *budget = budget.saturating_sub(skip);
            // What the writer did not take waits in the spill.
            let spill = &mut self.tx.spill;
            for p in &pieces {
                let l = p.len();
                if skip >= l {
                    skip -= l;
                    continue;
                }
                let rest = p.sub(skip, l - skip);
                skip = 0;
                let start = spill.len();
                spill.resize(start + rest.len(), 0);
                if rest.copy_to(spill.get_mut(start..).unwrap_or_default()) != rest.len() {
                    return Gathered::End(SendEnd::Bug("a gathered run could not be spilled"));
                }
            }
            r
        };
        match self.tx_error(r) {
            Some(end) => Gathered::End(end),
            None => Gathered::Sent,
        }
    }

    /// What a failed write means for [`Qp::send_to`] (`None`: try again).
    fn tx_error(&mut self, r: io::Result<usize>) -> Option<SendEnd> {
        let e = r.err()?;
        match e.kind() {
            io::ErrorKind::WouldBlock => Some(SendEnd::Full),
            io::ErrorKind::Interrupted => None,
            _ => {
                self.tx.spill.clear();
                Some(SendEnd::Failed(e))
            }
        }
    }
}

/// How a gathered run went ([`Qp::send_to`]).
enum Gathered {
    /// Written (all, or the rest spilled): go on.
    Sent,
    /// Nothing to write: the general gather path's turn.
    Nothing,
    /// How [`Qp::send_to`] ends.
    End(SendEnd),
}

/// How a receive ends on a failed read; `None` to read again (interrupted).
fn read_failed(e: io::Error) -> Option<RecvEnd> {
    match e.kind() {
        io::ErrorKind::WouldBlock => Some(RecvEnd::Drained),
        io::ErrorKind::Interrupted => None,
        // The engine offered a range outside its own region: stop receiving rather than
        // touch memory nobody can vouch for.
        io::ErrorKind::InvalidInput => Some(RecvEnd::Bug("unusable rx target")),
        _ => Some(RecvEnd::Failed(e)),
    }
}

/// A reader over a byte slice: everything at once, then `WouldBlock` (never an end).
#[derive(Debug)]
pub(crate) struct SliceSource<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> SliceSource<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Self {
        SliceSource { data, at: 0 }
    }
    /// Bytes read so far.
    pub(crate) fn consumed(&self) -> usize {
        self.at
    }
}

impl VectoredRead for SliceSource<'_> {
    fn read_to(&mut self, dest: ReadDest<'_>, stage: &mut [u8]) -> io::Result<usize> {
        let rest = self.data.get(self.at..).unwrap_or_default();
        if rest.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let n = copy_to_dest(rest, dest, stage)?;
        self.at += n;
        Ok(n)
    }

    fn read_around(
        &mut self,
        head: &mut [u8],
        dest: ReadDest<'_>,
        tail: &mut [u8],
    ) -> io::Result<usize> {
        let rest = self.data.get(self.at..).unwrap_or_default();
        if rest.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let n = copy_around(rest, head, dest, tail)?;
        self.at += n;
        Ok(n)
    }
}

/// Copies the start of `bytes` into `head`, then `dest`, then `tail`, as a three-buffer
/// read would place it; returns the bytes copied. For readers over memory (tests).
pub fn copy_around(
    bytes: &[u8],
    head: &mut [u8],
    dest: ReadDest<'_>,
    tail: &mut [u8],
) -> io::Result<usize> {
    let first = head.len().min(bytes.len());
    let (h, rest) = bytes.split_at(first);
    if let Some(d) = head.get_mut(..first) {
        d.copy_from_slice(h);
    }
    if rest.is_empty() {
        return Ok(first);
    }
    Ok(first + copy_to_dest(rest, dest, tail)?)
}

/// Copies the start of `bytes` into `dest`, then into `stage`, as a read would place it;
/// returns the bytes copied. For readers over memory (tests, [`Qp::handle_rx`]).
pub fn copy_to_dest(bytes: &[u8], dest: ReadDest<'_>, stage: &mut [u8]) -> io::Result<usize> {
    let first = dest.len().min(bytes.len());
    let (head, tail) = bytes.split_at(first);
    match dest {
        ReadDest::Buffer(b) => {
            if let Some(d) = b.get_mut(..first) {
                d.copy_from_slice(head);
            }
        }
        ReadDest::Region { region, offset, .. } => region
            .write_at(offset, head)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?,
    }
    let more = stage.len().min(tail.len());
    if let (Some(d), Some(s)) = (stage.get_mut(..more), tail.get(..more)) {
        d.copy_from_slice(s);
    }
    Ok(first + more)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::Arc;

    use super::*;
    use crate::mr::{Access, PdId};
    use crate::qp::{QpConfig, StreamConfig};
    use crate::wr::{Payload, SendOp, SendWr, SgList, Sge};

    /// A socket with `room` bytes of space left, then full (`WouldBlock`).
    struct Socket {
        room: usize,
        taken: usize,
    }

    impl VectoredWrite for Socket {
        fn write_from(&mut self, pieces: &[TxPiece<'_>]) -> io::Result<usize> {
            let len: usize = pieces.iter().map(TxPiece::len).sum();
            let n = len.min(self.room);
            if n == 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            self.room -= n;
            self.taken += n;
            Ok(n)
        }
    }

    #[test]
    fn a_large_spill_is_given_back_when_the_qp_goes_idle() {
        let pd = PdId(1);
        let mut qp = Qp::new(QpConfig {
            qp_num: 1,
            pd,
            sq_depth: 8,
            rq_depth: 8,
            use_srq: false,
            max_ird: 16,
            max_ord: 16,
        });
        // MSS-sized FPDUs: a large Write is copied into the batch, FPDU after FPDU.
        qp.establish(StreamConfig::for_mss(1460)).unwrap();
        let mut mrs = MrTable::new(4, crate::mr::SeededKeys::new(4));
        let len = 1 << 20;
        let region = Arc::new(Region::new_zeroed(len).unwrap());
        let stag = mrs
            .register(pd, region, 0, len, Some(0x1000), Access::NONE)
            .unwrap();
        let wr = SendWr {
            wr_id: 1,
            op: SendOp::Write {
                remote_addr: 0,
                rkey: crate::mr::Stag(0x100),
            },
            payload: Payload::Sgl(SgList::single(Sge {
                addr: 0x1000,
                length: len as u32,
                lkey: stag,
            })),
            signaled: true,
            fence: false,
        };
        qp.post_send(&wr, &mrs).unwrap();
        let mut batch = Vec::new();
        // The socket takes 10,000 bytes of the first batch: the rest waits in the spill.
        let mut socket = Socket {
            room: 10_000,
            taken: 0,
        };
        let mut budget = usize::MAX;
        assert!(matches!(
            qp.send_to(&mut socket, Some(&mut batch), &mut budget),
            SendEnd::Full
        ));
        let spilled = qp.tx.spill.len();
        assert!(spilled > SPILL_KEEP, "{spilled} bytes spilled");
        // Room again: everything goes, and the spill's memory with the QP idle.
        socket.room = usize::MAX;
        for _ in 0..100 {
            let mut budget = usize::MAX;
            if let SendEnd::Idle = qp.send_to(&mut socket, Some(&mut batch), &mut budget) {
                break;
            }
        }
        assert!(socket.taken > len, "{} bytes sent", socket.taken);
        assert!(!qp.wants_tx());
        assert!(
            qp.tx.spill.capacity() <= SPILL_KEEP,
            "the spill keeps {} bytes",
            qp.tx.spill.capacity()
        );
    }
}
