//! Transmit side of a QP: segmentation of messages into FPDUs described as gather lists.
//!
//! [`Qp::poll_tx_gather`] describes the next FPDUs (or what is left of one after a partial
//! write) as gather pieces: a small header array (MPA length and DDP/RDMAP header, plus
//! inline data), payload slices that point into registered regions, and a trailer (pad and
//! CRC, computed over the slices when the FPDU is built); [`Qp::tx_copy_fpdus`] copies small
//! ones whole into a batch instead. [`Qp::tx_commit`] reports how many bytes were written.
//! [`Qp::send_to`] (the `pump` module) drives them.
//!
//! With MPA markers in use (`StreamConfig::sends_markers`), the wire crate's
//! [`MarkerLayout`] says where the markers of each FPDU fall; the pieces are split at those
//! positions and the 4-byte markers, kept in the QP, are offered between them (the payload
//! is still never copied). The CRC covers the FPDU as sent, markers included, as the wire
//! crate's marker module defines. An FPDU whose gather list is longer than one [`TxGather`]
//! holds is offered in several parts.
//!
//! Order of transmission, message by message: a queued Terminate; the RFC 6581 RTR; the
//! message in progress; then Read and Atomic Responses (IRQ) before new send WRs (SQ), which
//! go in posting order, an RDMA Read or Atomic Request waiting while the ORQ is full (ORD)
//! and a fenced WR waiting until every earlier Read and atomic completed. The Immediate Data
//! message of a Write/Send with Immediate follows its data message directly (nothing is
//! sent between them). No I/O here.

mod alias;

use std::collections::VecDeque;
use std::sync::Arc;

use arrayvec::ArrayVec;

use softwarp_wire::mpa::marker::{MarkerLayout, Piece, MARKER_INTERVAL, MARKER_LEN};
use softwarp_wire::rdmap::{AtomicOpcode, AtomicRequestRepr, AtomicResponseRepr};

use crate::fault::Cause;
use crate::memory::Region;
use crate::mr::MrMemory;
use crate::qp::sq::SqStatus;
use crate::qp::{codec, sge_piece, OrqEntry, Qp, QpError, QpState, StreamConfig};
use crate::wr::{SendOp, WcStatus, MAX_INLINE, MAX_SGE};
use alias::{ALIAS_LEAD_MAX_BYTES, ALIAS_LEAD_MIN_LEN};

/// Smallest `max_fpdu_len` accepted (room for every header and some payload).
pub const MIN_FPDU_LEN: usize = 128;
/// Largest FPDU sent with markers, markers included: the largest multiple of 4 whose
/// markers' FPDUPTR values (at most the FPDU's wire length) fit 16 bits.
const MAX_MARKED_FPDU_LEN: usize = u16::MAX as usize & !3;
/// MPA length field + the largest header we build + inline data.
const HDR_CAP: usize = 2 + codec::MAX_TX_HEADER + MAX_INLINE;
/// Most markers one FPDU can carry: with markers, FPDUs stay below 64 KiB on the wire (the
/// FPDUPTR is 16 bits), and a marker comes every 512 octets.
const MAX_MARKERS: usize = u16::MAX as usize / MARKER_INTERVAL + 2;

/// One piece of an FPDU to transmit.
#[derive(Debug, Clone, Copy)]
pub enum TxPiece<'a> {
    /// Bytes held by the QP (header, inline data, trailer).
    Bytes(&'a [u8]),
    /// `len` bytes at `offset` of a registered region (the payload, never copied).
    Region {
        /// The region.
        region: &'a Region,
        /// Offset inside the region.
        offset: usize,
        /// Number of bytes.
        len: usize,
    },
}

impl<'a> TxPiece<'a> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            TxPiece::Bytes(b) => b.len(),
            TxPiece::Region { len, .. } => *len,
        }
    }
    /// True for an empty piece.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Raw pointer to the first byte, for an iovec (`writev`). The pointer is valid while
    /// the `TxFpdu` borrow lives.
    pub fn as_ptr(&self) -> *const u8 {
        match self {
            TxPiece::Bytes(b) => b.as_ptr(),
            TxPiece::Region {
                region,
                offset,
                len,
            } => region
                .ptr_range(*offset, *len)
                .map_or(std::ptr::null(), |p| p.cast_const()),
        }
    }
    /// The `len` bytes starting `at` bytes into this piece (clamped to the piece).
    pub(crate) fn sub(&self, at: usize, len: usize) -> TxPiece<'a> {
        match *self {
            TxPiece::Bytes(b) => {
                let from = at.min(b.len());
                let to = from.saturating_add(len).min(b.len());
                TxPiece::Bytes(b.get(from..to).unwrap_or(&[]))
            }
            TxPiece::Region {
                region,
                offset,
                len: l,
            } => {
                let from = at.min(l);
                TxPiece::Region {
                    region,
                    offset: offset + from,
                    len: len.min(l - from),
                }
            }
        }
    }

    /// Continues a CRC32c over the first `len` bytes of the piece.
    fn crc_append(&self, crc: u32, len: usize) -> u32 {
        match *self {
            TxPiece::Bytes(b) => softwarp_wire::crc::crc32c_append(crc, b.get(..len).unwrap_or(b)),
            TxPiece::Region { region, offset, .. } => {
                region.crc32c_append(crc, offset, len).unwrap_or(crc)
            }
        }
    }

    /// Copies the piece into `out` (which must be at least `len()` long); returns the bytes
    /// copied. Inlined: the small-FPDU copy calls it per piece (out of line it cost
    /// `examples/msgrate` about 46 instructions per 64-byte message).
    #[inline(always)]
    pub fn copy_to(&self, out: &mut [u8]) -> usize {
        let n = self.len().min(out.len());
        let Some(dst) = out.get_mut(..n) else {
            return 0;
        };
        match self {
            TxPiece::Bytes(b) => {
                if let Some(src) = b.get(..n) {
                    dst.copy_from_slice(src);
                }
            }
            TxPiece::Region { region, offset, .. } => {
                if region.read_at(*offset, dst).is_err() {
                    return 0;
                }
            }
        }
        n
    }
}

/// Most FPDUs one [`Qp::poll_tx_gather`] offers (the runtime's byte cap, 512 KiB in
/// [`Qp::send_to`], usually ends a call first: on loopback eight or nine FPDUs of 64 KiB
/// and up to eight short ones leading a message, [`alias::alias_lead`]). With MSS-sized FPDUs (a
/// hardware peer or siw at MTU 1500) this bound ends the call, at about 36 KB.
pub(crate) const MAX_GATHER_FPDUS: usize = 25;
/// Most pieces one [`TxGather`] holds: three per FPDU of [`MAX_GATHER_FPDUS`] with one
/// scatter/gather element (an FPDU without markers has at most `MAX_SGE + 2`). A writer
/// passes them to one `sendmsg` (`IOV_MAX` is 1024).
pub const GATHER_PIECES: usize = 80;

/// Several FPDUs to transmit with one system call, as gather pieces in stream order (see
/// [`Qp::poll_tx_gather`]). The caller keeps it on its stack; making an empty one costs
/// nothing (the pieces are not initialised until pushed), and the engine fills it in place.
pub type TxGather<'a> = ArrayVec<TxPiece<'a>, GATHER_PIECES>;

/// Most pieces of one gathered run ([`Qp::send_to`] with a batch buffer, a message in
/// MSS-sized FPDUs): two per FPDU (the trailer of one with the header of the next, then
/// the payload) and more where an FPDU's payload spans scatter/gather elements. A writer
/// passes them to one `sendmsg` (`IOV_MAX` is 1024); at 1460 bytes per FPDU a run of
/// [`BATCH_CAP`](super::pump::BATCH_CAP) wire bytes takes about 360 of them.
pub const RUN_GATHER_PIECES: usize = 400;

/// One piece of a gathered run: bytes of the caller's batch buffer (headers, trailers, and
/// FPDUs the copy paths wrote there), or a range of a send WR's validated scatter/gather
/// element (a payload, never copied).
#[derive(Debug, Clone, Copy)]
pub(crate) enum RunPiece {
    /// `len` bytes at `at` of the batch.
    Batch { at: usize, len: usize },
    /// `len` bytes at `offset` of the region of element `sge` of SQ entry `seq`.
    Sge {
        seq: u64,
        sge: usize,
        offset: usize,
        len: usize,
    },
}

/// What one gathered run sends: its pieces in stream order and their wire bytes.
#[derive(Debug)]
pub(crate) struct RunPlan {
    pub(crate) pieces: ArrayVec<RunPiece, RUN_GATHER_PIECES>,
    /// Bytes on the wire, all pieces.
    pub(crate) wire: usize,
}

impl RunPlan {
    #[inline(always)]
    pub(crate) fn new() -> Self {
        RunPlan {
            pieces: ArrayVec::new(),
            wire: 0,
        }
    }

    /// Appends `len` bytes at `at` of the batch (joined to the piece before when they
    /// follow it there); false when there is no room (the caller checks before).
    fn push_batch(&mut self, at: usize, len: usize) -> bool {
        if len == 0 {
            return true;
        }
        if let Some(RunPiece::Batch { at: a, len: l }) = self.pieces.last_mut() {
            if *a + *l == at {
                *l += len;
                return true;
            }
        }
        self.pieces.try_push(RunPiece::Batch { at, len }).is_ok()
    }

    /// Room for one more FPDU of a run (header, up to `MAX_SGE` payload pieces, trailer),
    /// and for bytes copied after it.
    fn has_room(&self) -> bool {
        self.pieces.remaining_capacity() >= MAX_SGE + 3
    }

    /// The pieces as the writer takes them, into `out`: batch bytes from `batch`, payloads
    /// from the SQ entries' validated elements. False when a piece names something that
    /// is not there (an engine bug). Fills the caller's list in place: moving a list this
    /// long by value is a 12 KiB copy.
    pub(super) fn resolve<'a>(
        &self,
        sq: &'a super::sq::SendQueue,
        batch: &'a [u8],
        out: &mut ArrayVec<TxPiece<'a>, RUN_GATHER_PIECES>,
    ) -> bool {
        // The elements of the entry the last payload piece came from.
        let mut last: Option<(u64, &'a [Option<crate::mr::Validated>])> = None;
        for p in &self.pieces {
            let piece = match *p {
                RunPiece::Batch { at, len } => {
                    match at.checked_add(len).and_then(|end| batch.get(at..end)) {
                        Some(b) => TxPiece::Bytes(b),
                        None => return false,
                    }
                }
                RunPiece::Sge {
                    seq,
                    sge,
                    offset,
                    len,
                } => {
                    let mem = match last {
                        Some((s, mem)) if s == seq => mem,
                        _ => {
                            let mem = sq.sges(seq).1;
                            last = Some((seq, mem));
                            mem
                        }
                    };
                    let Some(v) = mem.get(sge).and_then(Option::as_ref) else {
                        return false;
                    };
                    TxPiece::Region {
                        region: v.memory.region(),
                        offset,
                        len,
                    }
                }
            };
            if out.try_push(piece).is_err() {
                return false;
            }
        }
        true
    }
}

/// What the QP does when an FPDU has been completely handed to the runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TxDone {
    /// A segment of a Send or RDMA Write; `last` completes the WR.
    Sq { seq: u64, bytes: usize, last: bool },
    /// A Read Request.
    ReadRequest { bytes: u64 },
    /// An RFC 7306 Atomic Request.
    AtomicRequest,
    /// An RFC 7306 Atomic Response.
    AtomicResponse,
    /// A Read Response segment.
    ReadResponse { bytes: usize, last: bool },
    /// The Terminate.
    Terminate,
    /// The RTR message.
    Rtr,
}

impl TxDone {
    /// The queue whose turn the FPDU counts against ([`Qp::tx_pick`]); none for the
    /// Terminate and the RTR, which go out ahead of both.
    #[inline(always)]
    fn side(self) -> Option<TxSide> {
        match self {
            Self::Sq { .. } | Self::ReadRequest { .. } | Self::AtomicRequest => Some(TxSide::Sq),
            Self::ReadResponse { .. } | Self::AtomicResponse => Some(TxSide::Irq),
            Self::Terminate | Self::Rtr => None,
        }
    }
}

#[derive(Debug)]
struct FpduBuild {
    hdr: [u8; HDR_CAP],
    hdr_len: usize,
    /// The payload slices (region, offset, length), filled from the front: the first
    /// `None` ends them.
    payload: [Option<(Arc<MrMemory>, usize, usize)>; MAX_SGE],
    trailer: [u8; 8],
    trailer_len: usize,
    /// Where the markers go, when this FPDU carries markers.
    layout: Option<MarkerLayout>,
    /// The bytes of each marker, in order (`layout.marker_count()` of them); allocated by
    /// the first FPDU with markers (a build without markers holds none).
    markers: Vec<[u8; MARKER_LEN]>,
    /// Length on the wire (markers included).
    total: usize,
    sent: usize,
    /// `sent` plus the bytes of this FPDU the last offer held.
    offered_end: usize,
    done: TxDone,
    /// The CRC is not in the trailer yet (only between a build and the end of the
    /// [`Qp::tx_copy_fpdus`] that asked for it).
    crc_pending: bool,
    /// One of the short FPDUs leading a message ([`alias::alias_lead`]): left to the gather path,
    /// so that it goes out in the same write as the large FPDU after it (copied into a
    /// batch, it would take a write call of its own).
    lead: bool,
    /// The payload as it was when the CRC was computed, for an FPDU whose memory may change
    /// before the runtime writes it ([`FpduBuild::fill_crc`]: a Read Response with CRC); its
    /// first `snap_len` bytes replace the payload slices on the wire. The storage is kept
    /// while the build is the spare and dropped when it goes to the pool.
    snapshot: Vec<u8>,
    snap_len: usize,
}

impl FpduBuild {
    fn boxed() -> Box<Self> {
        Box::new(FpduBuild {
            hdr: [0; HDR_CAP],
            hdr_len: 0,
            payload: std::array::from_fn(|_| None),
            trailer: [0; 8],
            trailer_len: 0,
            layout: None,
            markers: Vec::new(),
            total: 0,
            sent: 0,
            offered_end: 0,
            done: TxDone::Rtr,
            crc_pending: false,
            lead: false,
            snapshot: Vec::new(),
            snap_len: 0,
        })
    }

    /// The payload slices in use.
    fn payload_slices(&self) -> impl Iterator<Item = &(Arc<MrMemory>, usize, usize)> {
        self.payload.iter().map_while(Option::as_ref)
    }

    /// Computes the CRC over the pieces as they go on the wire and puts it in the trailer.
    fn fill_crc(&mut self) {
        //= https://www.rfc-editor.org/rfc/rfc5044#section-4.4
        // (paraphrase) The CRC covers the FPDU as sent, from its first octet up to the
        // CRC field: ULPDU_Length, ULPDU, pad, and the markers when in use.
        if matches!(self.done, TxDone::ReadResponse { .. }) {
            self.take_snapshot();
        }
        let crc_len = self.total.saturating_sub(4);
        let mut crc = 0u32;
        let mut at = 0usize;
        self.wire_pieces(|p| {
            let take = p.len().min(crc_len - at);
            crc = p.crc_append(crc, take);
            at += take;
            at < crc_len
        });
        let pad = self.trailer_len.saturating_sub(4);
        if let Some(slot) = self.trailer.get_mut(pad..pad + 4) {
            slot.copy_from_slice(&codec::crc_to_wire(crc));
        }
        self.crc_pending = false;
    }

    /// Copies the payload slices into `snapshot`, so that the bytes the CRC covers are the
    /// bytes that go out. A Read Response's source is memory the responder's application
    /// may write at any time (a remote Read and a local store to the same bytes are not
    /// ordered: the Read returns either, RDMA's rule, but the stream must stay intact),
    /// and the runtime writes a gathered FPDU after the CRC was computed, possibly much
    /// later behind a full socket: a store in between made the peer see a CRC error and
    /// Terminate (uDAPL's dtest, whose both sides rewrite the buffers the other one reads).
    /// The copies of small FPDUs ([`Qp::tx_copy_fpdus`]) compute the CRC over the copy
    /// already; this is the gather path's equivalent, one copy per Read Response byte when
    /// the CRC is on (none without CRC: the bytes then only need to be some version of
    /// the memory, which the gather gives).
    fn take_snapshot(&mut self) {
        let len: usize = self.payload_slices().map(|p| p.2).sum();
        if len == 0 {
            self.snap_len = 0;
            return;
        }
        if self.snapshot.len() < len {
            self.snapshot.resize(len, 0);
        }
        let mut at = 0;
        for (mem, off, n) in self.payload.iter().map_while(Option::as_ref) {
            let Some(dst) = self.snapshot.get_mut(at..at + n) else {
                break;
            };
            // A slice that cannot be read (never: it was validated at build time) leaves
            // zeros, covered by the CRC like any other byte.
            let _ = mem.region().read_at(*off, dst);
            at += n;
        }
        self.snap_len = at;
    }

    /// The marker-free FPDU as pieces: MPA length and header, payload slices (or their
    /// snapshot), pad and CRC.
    fn plain_pieces(&self) -> impl Iterator<Item = TxPiece<'_>> {
        let hdr = TxPiece::Bytes(self.hdr.get(..self.hdr_len).unwrap_or(&[]));
        let snapped = self.snap_len > 0;
        let payload = self
            .payload_slices()
            .filter(move |_| !snapped)
            .map(|(mem, off, len)| TxPiece::Region {
                region: mem.region(),
                offset: *off,
                len: *len,
            });
        let snapshot =
            snapped.then(|| TxPiece::Bytes(self.snapshot.get(..self.snap_len).unwrap_or(&[])));
        let trailer = TxPiece::Bytes(self.trailer.get(..self.trailer_len).unwrap_or(&[]));
        std::iter::once(hdr)
            .chain(payload)
            .chain(snapshot)
            .chain(std::iter::once(trailer))
    }

    /// Calls `f` with each piece of the FPDU as it goes on the wire (markers included), in
    /// order, until `f` returns false.
    fn wire_pieces<'a>(&'a self, mut f: impl FnMut(TxPiece<'a>) -> bool) {
        let Some(layout) = self.layout else {
            for p in self.plain_pieces() {
                if !f(p) {
                    return;
                }
            }
            return;
        };
        let mut markers = self.markers.iter();
        for piece in layout.pieces() {
            match piece {
                Piece::Marker(_) => {
                    let Some(bytes) = markers.next() else {
                        return;
                    };
                    if !f(TxPiece::Bytes(bytes)) {
                        return;
                    }
                }
                Piece::Data(range) => {
                    // The marker-free pieces that overlap this range, cut to it.
                    let mut at = 0;
                    for p in self.plain_pieces() {
                        let (start, end) = (at, at + p.len());
                        at = end;
                        let (lo, hi) = (range.start.max(start), range.end.min(end));
                        if lo < hi && !f(p.sub(lo - start, hi - lo)) {
                            return;
                        }
                        if end >= range.end {
                            break;
                        }
                    }
                }
            }
        }
    }

    /// Appends the unsent part of the FPDU to `out`, as much of it as fits; returns the
    /// bytes appended.
    fn push_unsent<'a>(&'a self, out: &mut TxGather<'a>) -> usize {
        if self.sent == 0 && self.layout.is_none() {
            // A whole FPDU without markers (nearly every one): header, slices, trailer.
            let mut len = 0;
            for p in self.plain_pieces().filter(|p| !p.is_empty()) {
                if out.try_push(p).is_err() {
                    break;
                }
                len += p.len();
            }
            return len;
        }
        let mut skip = self.sent;
        let mut len = 0;
        self.wire_pieces(|p| {
            let l = p.len();
            if skip >= l {
                skip -= l;
                return true;
            }
            let p = p.sub(skip, l - skip);
            skip = 0;
            let taken = out.try_push(p).is_ok();
            if taken {
                len += p.len();
            }
            taken
        });
        len
    }
}

/// Records `n` bytes copied at `used` of the batch in a gathered run's plan (nothing
/// without one); false when the plan had no room (the caller checked, so never).
#[inline(always)]
fn plan_copied(plan: &mut Option<&mut RunPlan>, used: usize, n: usize) -> bool {
    match plan.as_deref_mut() {
        Some(p) => {
            p.wire += n;
            p.push_batch(used, n)
        }
        None => true,
    }
}

/// The next FPDU of a copy run ([`Qp::tx_copy_run`]) in the caller's batch: its MPA length
/// written, pad and CRC field zeroed, header and payload to fill.
struct RunSlot<'a> {
    /// The DDP/RDMAP header (after the MPA length).
    ulp_hdr: &'a mut [u8],
    payload: &'a mut [u8],
    /// The FPDU's length.
    total: usize,
}

impl<'a> RunSlot<'a> {
    /// The FPDU at `used` in `out` for the next `left` bytes of a message (at most
    /// `max_payload` of them) behind a `hdr_len`-byte header; `None` when it does not fit
    /// what is left of `out` or `max_each`.
    #[inline(always)]
    fn cut(
        out: &'a mut [u8],
        used: usize,
        hdr_len: usize,
        left: u64,
        max_payload: usize,
        max_each: usize,
    ) -> Option<Self> {
        let seg = usize::try_from(left).unwrap_or(usize::MAX).min(max_payload);
        let ulpdu_len = hdr_len + seg;
        let total = codec::fpdu_len(ulpdu_len);
        if total > out.len().saturating_sub(used).min(max_each) {
            return None;
        }
        let fpdu = out.get_mut(used..used + total)?;
        // Pad and CRC field first (as `tx_copy_small`): the payload and header bytes among
        // the last 8 are written after.
        if let Some(tail) = fpdu.last_chunk_mut::<8>() {
            *tail = [0; 8];
        }
        let (hdr, rest) = fpdu.split_at_mut_checked(2 + hdr_len)?;
        codec::emit_mpa_len(hdr, ulpdu_len);
        Some(RunSlot {
            ulp_hdr: hdr.get_mut(2..)?,
            payload: rest.get_mut(..seg)?,
            total,
        })
    }
}

/// The send queue's message being transmitted, when it spans several FPDUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TxMsg {
    None,
    Sq(u64),
    /// The data of a Write/Send with Immediate went out; its Immediate Data comes next.
    Imm(u64),
}

/// Where the next FPDU comes from: the send queue, or the queue of inbound Read and Atomic
/// Requests (their responses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TxSide {
    Sq,
    Irq,
}

impl TxSide {
    fn other(self) -> Self {
        match self {
            Self::Sq => Self::Irq,
            Self::Irq => Self::Sq,
        }
    }
}

/// Bytes (whole FPDUs) one side sends in a row while the other waits with a message that
/// may be interleaved with the first's (see [`Qp::tx_pick`]): a small Send posted behind a
/// long Read Response waits for at most this much of it (besides what the socket holds).
pub const TX_INTERLEAVE_QUANTUM: u64 = 64 * 1024;

/// What [`Qp::tx_pick`] decided: the side that builds next, the one to try when it
/// cannot (a fence or the ORD holds the send queue back), and how many bytes the first
/// may send in a row before the other is due.
#[derive(Debug, Clone, Copy)]
struct TxPick {
    side: TxSide,
    fallback: Option<TxSide>,
    budget: u64,
}

/// The transmit half of a QP: the FPDUs built and in flight, the message in progress, the
/// turn between the send queue and the Read/Atomic Responses, the MSNs to send, and the
/// stream's framing parameters. The send WRs themselves are in [`super::sq::SendQueue`].
#[derive(Debug)]
pub(crate) struct TxState {
    /// Next MSN per untagged queue (0 Send and Immediate Data, 1 Read and Atomic Request,
    /// 2 Terminate, 3 Atomic Response).
    pub(super) msn: [u32; 4],
    build: Option<Box<FpduBuild>>,
    /// The build the next FPDU is made in: none until the QP first transmits (an idle QP
    /// holds no build: about 1.2 KiB each), then reused for every FPDU.
    spare: Option<Box<FpduBuild>>,
    /// FPDUs built behind `build` for [`Qp::poll_tx_gather`] (none has started).
    ahead: VecDeque<Box<FpduBuild>>,
    /// Spare builds beyond `spare`, allocated the first time FPDUs are built ahead. Boxed
    /// because builds (about 1 KiB each) move between `spare`, `ahead` and `build`.
    #[allow(clippy::vec_box)]
    pool: Vec<Box<FpduBuild>>,
    /// Bytes the last [`Qp::poll_tx_gather`] offered (0 after a copy).
    gather_offered: usize,
    /// The send queue's message in progress.
    msg: TxMsg,
    /// The side whose FPDUs were built last, and their bytes since it took the turn.
    turn: TxSide,
    turn_bytes: u64,
    rtr_pending: bool,
    /// MPA responder (RFC 5044 `responder_waits`, or the RFC 6581 RTR responder): nothing
    /// but a Terminate may be sent before the peer's first FPDU arrived. The one copy of
    /// this rule; cleared when an FPDU's CRC checked.
    pub(crate) gate_until_rx: bool,
    /// The first-FPDU hold ([`super::clock::Timers::first_fpdu_hold`]): the same gate
    /// until the QP's clock ends it.
    pub(super) held: bool,
    max_fpdu: usize,
    crc: bool,
    /// Insert markers (RFC 5044 section 4.3).
    pub(crate) markers: bool,
    /// Stream offset of the next FPDU's first octet.
    stream_offset: u64,
    /// Set by [`Qp::tx_copy_fpdus`] while it builds: leave the CRC to the copy.
    defer_crc: bool,
    /// Lead a large message from memory that would hit 4 KiB aliasing in the kernel's
    /// copy with a few short FPDUs ([`alias::alias_lead`]; on by default,
    /// [`Qp::set_tx_alias_lead`]).
    alias_lead: bool,
    /// Send the FPDUs of a message in MSS-sized FPDUs from the WR's memory, headers and
    /// trailers gathered around the payloads ([`Qp::send_to`] with a batch buffer; on by
    /// default, [`Qp::set_tx_gather_runs`]), rather than copied into the batch.
    gather_runs: bool,
    /// Set by [`Qp::tx_copy_fpdus`] when it stopped before such a run: [`Qp::send_to`]
    /// then gathers it.
    pub(crate) run_waiting: bool,
    /// Headers of a whole Send (without, with Solicited Event; MSN and MO 0), from the
    /// codec: what [`Qp::tx_copy_fpdus`] writes for small messages.
    send_headers: [[u8; codec::UNTAGGED_HEADER_LEN]; 2],
    /// The same with the Last flag off, for the FPDUs of a message but its last, and the
    /// header prefixes of Write and Read Response segments (Last off, on): what
    /// [`Qp::build_sq`] and [`Qp::build_read_response`] write every Send (without
    /// Invalidate), Write and Read Response header from ([`codec::put_send`],
    /// [`codec::put_tagged`]), not encoding them field by field.
    segment_headers: [[u8; codec::UNTAGGED_HEADER_LEN]; 2],
    write_prefixes: [[u8; codec::WRITE_PREFIX_LEN]; 2],
    read_response_prefixes: [[u8; codec::WRITE_PREFIX_LEN]; 2],
    /// The largest payload of an untagged and of a tagged FPDU (`max_payload`, fixed once
    /// the stream is established).
    max_small: (usize, usize),
    /// Bytes of a coalesced batch, already committed, that the writer did not take: they
    /// go first at the next [`Qp::send_to`]. Empty unless a writer filled up in the middle
    /// of a batch (it then grows, at most to one batch, the only allocation of the
    /// transmit path after the first FPDUs built ahead; more than 32 KiB of it is given
    /// back when the QP goes idle, `SPILL_KEEP` in `pump.rs`).
    pub(crate) spill: Vec<u8>,
}

impl TxState {
    pub(crate) fn new() -> Self {
        Self {
            msn: [1; 4],
            build: None,
            // Allocated by the first FPDU (take_spare), reused after that.
            spare: None,
            ahead: VecDeque::new(),
            pool: Vec::new(),
            gather_offered: 0,
            msg: TxMsg::None,
            turn: TxSide::Sq,
            turn_bytes: 0,
            rtr_pending: false,
            gate_until_rx: false,
            held: false,
            max_fpdu: MIN_FPDU_LEN,
            crc: false,
            markers: false,
            stream_offset: 0,
            defer_crc: false,
            alias_lead: true,
            gather_runs: true,
            run_waiting: false,
            send_headers: codec::send_headers(),
            segment_headers: codec::send_segment_headers(false),
            write_prefixes: codec::write_prefixes(),
            read_response_prefixes: codec::read_response_prefixes(),
            max_small: (0, 0),
            spill: Vec::new(),
        }
    }

    pub(crate) fn on_establish(&mut self, s: &StreamConfig) {
        self.crc = s.crc;
        self.markers = s.sends_markers();
        self.stream_offset = s.tx_stream_offset;
        self.max_fpdu = if self.markers {
            // FPDUPTR is 16 bits: keep every FPDU with markers below 64 KiB on the wire.
            s.max_fpdu_len.min(MAX_MARKED_FPDU_LEN)
        } else {
            s.max_fpdu_len
        };
        self.max_small = (
            self.max_payload(codec::UNTAGGED_HEADER_LEN),
            self.max_payload(codec::TAGGED_HEADER_LEN),
        );
        self.rtr_pending = s.rtr.is_some_and(|r| r.initiator);
        //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
        // (paraphrase) Outside peer-to-peer mode the responder sends no FPDU before it has
        // received and validated the initiator's first FPDU.
        //= https://www.rfc-editor.org/rfc/rfc6581#section-3
        // (paraphrase) In peer-to-peer mode the responder sends nothing before the
        // initiator's RTR arrived.
        self.gate_until_rx = s.responder_waits || s.rtr.is_some_and(|r| !r.initiator);
    }

    /// True when no FPDU is in progress or waits in the spill, and no message is half sent.
    pub(crate) fn is_idle(&self) -> bool {
        self.build.is_none()
            && self.ahead.is_empty()
            && self.msg == TxMsg::None
            && self.spill.is_empty()
    }

    /// Forgets the FPDUs not yet started (nothing of them reached the wire) and the message
    /// in progress. A partly written FPDU is kept: it must be finished to keep the stream
    /// framed.
    pub(crate) fn abandon_unstarted(&mut self) {
        while let Some(b) = self.ahead.pop_back() {
            self.put_spare(b);
        }
        if self.build.as_ref().is_some_and(|b| b.sent == 0) {
            self.recycle();
        }
        self.msg = TxMsg::None;
    }

    /// Retires the front build; the next one built ahead (if any) becomes the front.
    fn recycle(&mut self) {
        if let Some(b) = self.build.take() {
            self.put_spare(b);
        }
        self.build = self.ahead.pop_front();
    }

    fn put_spare(&mut self, mut b: Box<FpduBuild>) {
        for p in b.payload.iter_mut() {
            if p.take().is_none() {
                break;
            }
        }
        b.lead = false;
        b.snap_len = 0;
        if self.spare.is_none() {
            self.spare = Some(b);
        } else {
            // Builds in the pool wait for the next burst of FPDUs built ahead: they keep
            // no snapshot storage (up to a maximal FPDU each).
            b.snapshot = Vec::new();
            self.pool.push(b);
        }
    }

    /// The header template of a Send segment (no Invalidate) with the Last flag `last`.
    #[inline(always)]
    fn send_template(&self, last: bool, solicited: bool) -> &[u8; codec::UNTAGGED_HEADER_LEN] {
        let set = if last {
            &self.send_headers
        } else {
            &self.segment_headers
        };
        &set[usize::from(solicited)]
    }

    /// Largest payload of one FPDU with a header of `hdr_len` bytes.
    fn max_payload(&self, hdr_len: usize) -> usize {
        // MPA's MULPDU for an EMSS of max_fpdu (with room for the markers when they are in
        // use): the FPDU then fits max_fpdu octets on the wire.
        codec::mulpdu(self.max_fpdu, self.markers)
            .saturating_sub(hdr_len)
            .max(1)
    }
}

impl Qp {
    /// Reports that the first `n` bytes offered by the last [`Qp::poll_tx_gather`] (or the
    /// copy of [`Qp::tx_copy_fpdus`]) were written.
    pub(crate) fn tx_commit(&mut self, n: usize) -> Result<(), QpError> {
        let Some(b) = self.tx.build.as_deref() else {
            return if n == 0 {
                Ok(())
            } else {
                Err(QpError::CommitTooLong {
                    committed: n,
                    offered: 0,
                })
            };
        };
        let offered = if self.tx.gather_offered > 0 {
            self.tx.gather_offered
        } else {
            b.offered_end.saturating_sub(b.sent)
        };
        if n > offered {
            return Err(QpError::CommitTooLong {
                committed: n,
                offered,
            });
        }
        self.tx.gather_offered -= n.min(self.tx.gather_offered);
        let mut left = n;
        while left > 0 {
            let Some(b) = self.tx.build.as_deref_mut() else {
                break;
            };
            let take = left.min(b.total - b.sent);
            b.sent += take;
            left -= take;
            self.stats.tx_stream_bytes += take as u64;
            if b.sent == b.total {
                let done = b.done;
                let markers = b.layout.map_or(0, |l| l.marker_count());
                self.tx.stream_offset = self.tx.stream_offset.wrapping_add(b.total as u64);
                self.tx.recycle();
                self.stats.tx_fpdus += 1;
                self.stats.tx_markers += markers as u64;
                self.on_fpdu_sent(done);
            }
        }
        Ok(())
    }

    /// Describes the next bytes to send as gather pieces in `out` (cleared first): the rest
    /// of the FPDU in progress (or a new one), then up to `max_fpdus - 1` whole FPDUs built
    /// ahead (about `max_bytes` in all), so that one `sendmsg` carries several large FPDUs;
    /// false when there is nothing to send. Commit with [`Qp::tx_commit`] (any prefix of
    /// what is offered). With markers only the FPDU in progress is offered, in parts when
    /// its gather list is longer than [`GATHER_PIECES`]. The builds ahead are allocated the
    /// first time they are needed (at most `max_fpdus - 1` of them per QP).
    pub(crate) fn poll_tx_gather<'a>(
        &'a mut self,
        max_fpdus: usize,
        max_bytes: usize,
        out: &mut TxGather<'a>,
    ) -> bool {
        out.clear();
        if self.tx.build.is_none() {
            self.build_next();
        }
        let Some(front) = self.tx.build.as_deref_mut() else {
            return false;
        };
        front.offered_end = front.total;
        let mut bytes = front.total - front.sent;
        let mut count = 1 + self.tx.ahead.len();
        if !self.tx.markers {
            while count < max_fpdus.min(MAX_GATHER_FPDUS) && bytes < max_bytes {
                let Some(b) = self.build_ahead() else {
                    break;
                };
                bytes += b;
                count += 1;
            }
        }
        let Some(front) = self.tx.build.as_deref() else {
            return false;
        };
        let mut len = 0;
        let mut fpdus = 0;
        for b in std::iter::once(front).chain(self.tx.ahead.iter().map(|b| &**b)) {
            if fpdus > 0 && len >= max_bytes {
                break;
            }
            let n = out.len();
            let got = b.push_unsent(out);
            if fpdus > 0 && got != b.total - b.sent {
                // Only whole FPDUs (or the first part of the front) are gathered.
                out.truncate(n);
                break;
            }
            len += got;
            fpdus += 1;
            if fpdus >= max_fpdus.max(1) {
                break;
            }
        }
        self.tx.gather_offered = len;
        true
    }

    /// Builds the next FPDU behind the ones already built; returns its length.
    fn build_ahead(&mut self) -> Option<usize> {
        let local_error_next = self.tx.msg == TxMsg::None
            && !self.rresp_in_progress()
            && self.sq.entry(self.sq.tx_seq).is_some_and(|e| e.local_error);
        if local_error_next || !matches!(self.state, QpState::Rts | QpState::Closing) {
            // A failed QP sends its Terminate (the front build) and nothing after it; a WR
            // with a local error fails the QP only once everything before it went out, as
            // when FPDUs are built one at a time. (Building on would take the failure
            // check below and recycle the unstarted front: the Terminate, or the FPDU of an
            // earlier WR.)
            return None;
        }
        let front = self.tx.build.take();
        if self.tx.spare.is_none() {
            self.tx.spare = Some(self.tx.pool.pop().unwrap_or_else(FpduBuild::boxed));
        }
        self.build_next();
        let built = self.tx.build.take();
        self.tx.build = front;
        if !matches!(self.state, QpState::Rts | QpState::Closing) {
            // Building failed the QP (a local protection error): nothing unstarted goes out,
            // as if the FPDUs had never been built ahead.
            if let Some(b) = built {
                self.tx.put_spare(b);
            }
            self.tx.abandon_unstarted();
            return None;
        }
        let b = built?;
        let len = b.total;
        self.tx.ahead.push_back(b);
        Some(len)
    }

    /// Whether a large message whose payload would hit 4 KiB aliasing in the kernel's copy
    /// into the socket starts with a few short FPDUs that move it out of the window (on by
    /// default; see `alias.rs` and DESIGN.md). Off: every FPDU but a
    /// message's last carries the largest payload.
    pub fn set_tx_alias_lead(&mut self, on: bool) {
        self.tx.alias_lead = on;
    }

    /// Whether [`Qp::send_to`] with a batch buffer sends the FPDUs of a message in
    /// MSS-sized FPDUs from the WR's memory, gathering headers and trailers around the
    /// payloads (on by default), or copies them into the batch (off; the bytes on the
    /// wire are the same).
    pub fn set_tx_gather_runs(&mut self, on: bool) {
        self.tx.gather_runs = on;
    }

    /// False when [`Qp::send_to`] would certainly send nothing: no FPDU in progress, built
    /// ahead or waiting in the spill, no message half sent, no Terminate, RTR, Read or
    /// Atomic Response, or send WR waiting. A cheap check for runtimes that would otherwise ask for nothing
    /// several times per pass. (True does not promise an FPDU: the ORD, a fence or the
    /// state may still hold the next one back.)
    pub fn wants_tx(&self) -> bool {
        !self.tx.spill.is_empty()
            || self.tx.build.is_some()
            || !self.tx.ahead.is_empty()
            || self.tx.msg != TxMsg::None
            || self.tx.rtr_pending
            || self.terminate.wants_tx()
            || !self.irq.is_empty()
            || self.sq.tx_seq < self.sq.next_seq
    }

    /// The next FPDU by the general path, copied whole into the start of `out` and
    /// committed when it fits and none of it was offered yet: it is built (unless one is)
    /// with its CRC left to the copy, computed over it in one pass. `None` when there is
    /// nothing to send or it does not fit (or was partly sent, or carries markers).
    fn tx_copy_built(&mut self, out: &mut [u8]) -> Option<usize> {
        if self.tx.build.is_none() {
            self.tx.defer_crc = true;
            self.build_next();
            self.tx.defer_crc = false;
        }
        let b = self.tx.build.as_deref_mut()?;
        let total = b.total;
        let fits = b.sent == 0 && b.layout.is_none() && !b.lead && total <= out.len() && total >= 4;
        let copied = fits && {
            let dst = out.get_mut(..total).unwrap_or_default();
            let mut at = 0;
            let mut ok = true;
            for p in b.plain_pieces() {
                let n = p.len();
                if dst.get_mut(at..at + n).is_some_and(|d| p.copy_to(d) == n) {
                    at += n;
                } else {
                    ok = false;
                    break;
                }
            }
            ok && at == total
        };
        if !copied {
            if b.crc_pending {
                b.fill_crc();
            }
            return None;
        }
        if b.crc_pending {
            let (covered, field) = out.get_mut(..total)?.split_at_mut(total - 4);
            let crc = codec::crc_to_wire(crate::memory::crc32c_append(0, covered));
            field.copy_from_slice(&crc);
            let pad = b.trailer_len.saturating_sub(4);
            if let Some(slot) = b.trailer.get_mut(pad..pad + 4) {
                slot.copy_from_slice(&crc);
            }
            b.crc_pending = false;
        }
        b.offered_end = total;
        self.tx.gather_offered = 0;
        self.tx_commit(total).ok()?;
        Some(total)
    }

    /// Copies whole FPDUs of at most `max_each` bytes into `out`, one after the other, as
    /// many as fit, and commits them; returns the bytes written (0: nothing to send, or the
    /// next FPDU is larger than `max_each` or than what is left of `out`, or is partly sent;
    /// [`Qp::poll_tx_gather`] then offers it). Runs of small Sends and Writes take a loop
    /// that checks the QP's state once per run instead of once per FPDU.
    pub(crate) fn tx_copy_fpdus(&mut self, out: &mut [u8], max_each: usize) -> usize {
        self.tx_fill(out, 0, max_each, None)
    }

    /// [`Qp::tx_copy_fpdus`] from `used` bytes into `out`. Without `plan` (the copy paths
    /// alone) it stops before the rest of a Send or Write in FPDUs of at most `max_each`
    /// bytes when such runs are gathered (`TxState::run_waiting` then says so). With
    /// `plan` (a gathered run, [`Qp::send_to`]) it writes only the headers and trailers of
    /// such runs into `out` and the payloads go into the plan as ranges of the WR's
    /// memory ([`Qp::tx_gather_run`]); everything it copies goes into the plan as batch
    /// bytes; it stops at [`BATCH_CAP`](super::pump::BATCH_CAP) bytes on the wire or when
    /// the plan is full. Returns the bytes of `out` used. Inlined into its two callers, so
    /// that the copy paths' caller (no plan) carries none of the plan's checks (out of
    /// line they cost 7 instructions per 64 B message).
    #[inline(always)]
    pub(crate) fn tx_fill(
        &mut self,
        out: &mut [u8],
        mut used: usize,
        max_each: usize,
        mut plan: Option<&mut RunPlan>,
    ) -> usize {
        loop {
            // With a plan, the copies stop at the wire bytes' cap as well as at `out`'s end.
            let cap = match plan.as_deref() {
                Some(p) if !p.has_room() => return used,
                Some(p) => super::pump::BATCH_CAP.saturating_sub(p.wire),
                None => usize::MAX,
            };
            let end = used.saturating_add(cap).min(out.len());
            let rest = out.get_mut(used..end).unwrap_or_default();
            let n = self.tx_copy_small(rest, max_each, usize::MAX);
            if !plan_copied(&mut plan, used, n) {
                return used;
            }
            used += n;
            if !self.wants_tx() {
                return used;
            }
            // The rest of a message in progress, FPDU after FPDU.
            if self.tx.gather_runs {
                match plan.as_deref_mut() {
                    None => {
                        if self.sq_run_next(max_each).is_some() {
                            self.tx.run_waiting = true;
                            return used;
                        }
                    }
                    Some(p) => match self.tx_gather_run(out, used, p, max_each) {
                        // Room for none: the plan or the batch is full.
                        Some(0) => return used,
                        Some(n) => {
                            used += n;
                            continue;
                        }
                        None => {}
                    },
                }
            }
            let cap = plan.as_deref().map_or(usize::MAX, |p| {
                super::pump::BATCH_CAP.saturating_sub(p.wire)
            });
            let end = used.saturating_add(cap).min(out.len());
            let rest = out.get_mut(used..end).unwrap_or_default();
            let run = self.tx_copy_run(rest, max_each);
            if run > 0 {
                if !plan_copied(&mut plan, used, run) {
                    return used;
                }
                used += run;
                continue;
            }
            // An FPDU the fast paths leave to the general one (or does not fit).
            let rest = out.get_mut(used..end).unwrap_or_default();
            let window = rest.len().min(max_each);
            match rest.get_mut(..window).and_then(|w| self.tx_copy_built(w)) {
                Some(n) => {
                    if !plan_copied(&mut plan, used, n) {
                        return used;
                    }
                    used += n;
                }
                None => return used,
            }
        }
    }

    /// The Send or Write whose FPDUs a gathered run would send next ([`Qp::tx_gather_run`]):
    /// the message in progress on the send queue, past its first [`ALIAS_LEAD_MAX_BYTES`]
    /// (as [`Qp::tx_copy_run`] takes it), from registered memory (not inline), its next
    /// FPDU at most `max_each` bytes, its queue's turn, nothing to go before it.
    fn sq_run_next(&self, max_each: usize) -> Option<u64> {
        let tx = &self.tx;
        if !tx.gather_runs
            || tx.build.is_some()
            || !tx.ahead.is_empty()
            || tx.rtr_pending
            || tx.gate_until_rx
            || tx.held
            || tx.markers
            || self.terminate.wants_tx()
            || !matches!(self.state, QpState::Rts | QpState::Closing)
        {
            return None;
        }
        let TxMsg::Sq(seq) = tx.msg else {
            return None;
        };
        let e = self.sq.entry(seq)?;
        let SqStatus::Sending { sent } = e.status else {
            return None;
        };
        if e.local_error || sent < ALIAS_LEAD_MAX_BYTES || sent >= e.len {
            return None;
        }
        let (hdr_len, max_payload) = match e.op {
            SendOp::Send { .. } | SendOp::SendWithImm { .. } => {
                (codec::UNTAGGED_HEADER_LEN, self.tx.max_small.0)
            }
            SendOp::Write { .. } | SendOp::WriteWithImm { .. } => {
                (codec::TAGGED_HEADER_LEN, self.tx.max_small.1)
            }
            _ => return None,
        };
        let seg = usize::try_from(e.len - sent)
            .unwrap_or(usize::MAX)
            .min(max_payload);
        let total = codec::fpdu_len(hdr_len + seg);
        if total > max_each || self.sq.inline_bytes(seq).is_some() {
            return None;
        }
        // Its turn, with room for the FPDU before the turn ends (else the general path
        // builds the one that crosses it).
        let pick = self.tx_pick();
        (matches!(pick.side, TxSide::Sq) && total as u64 <= pick.budget).then_some(seq)
    }

    /// A gathered run: the next FPDUs of the Send or Write [`Qp::sq_run_next`] names, each
    /// its MPA length and header (from the codec's templates, as [`Qp::tx_copy_run`]) in
    /// `out` at `used`, its payload as ranges of the WR's validated elements in `plan`,
    /// then its pad and CRC (over the header, the payload read from the WR's memory and
    /// the pad) in `out` behind the header; committed as the copy run commits them (the
    /// bytes on the wire are the same). `None` when no such run is next (or its first
    /// payload cannot be named); else the bytes of `out` used (0: no room for an FPDU in
    /// `out`, in the plan or under the wire cap).
    fn tx_gather_run(
        &mut self,
        out: &mut [u8],
        used: usize,
        plan: &mut RunPlan,
        max_each: usize,
    ) -> Option<usize> {
        let seq = self.sq_run_next(max_each)?;
        // The turn's end: a run takes the whole FPDUs that fit before it.
        let budget = usize::try_from(self.tx_pick().budget).unwrap_or(usize::MAX);
        let e = self.sq.entry(seq)?;
        let SqStatus::Sending { sent } = e.status else {
            return None;
        };
        let (op, len) = (e.op, e.len);
        let (hdr_len, max_payload) = match op {
            SendOp::Send { .. } | SendOp::SendWithImm { .. } => {
                (codec::UNTAGGED_HEADER_LEN, self.tx.max_small.0)
            }
            _ => (codec::TAGGED_HEADER_LEN, self.tx.max_small.1),
        };
        let mut at = used;
        let mut wire = 0usize;
        let mut sent = sent;
        // A stop for want of room (not for a payload that cannot be named).
        let mut full = !plan.has_room();
        while sent < len && plan.has_room() {
            let seg = usize::try_from(len - sent)
                .unwrap_or(usize::MAX)
                .min(max_payload);
            let ulpdu_len = hdr_len + seg;
            let total = codec::fpdu_len(ulpdu_len);
            let head = 2 + hdr_len;
            let trailer = total - head - seg;
            if total > max_each
                || wire + total > budget
                || plan.wire + total > super::pump::BATCH_CAP
            {
                full = true;
                break;
            }
            let Some(room) = out.get_mut(at..at + head + trailer) else {
                full = true;
                break;
            };
            // The payload's ranges first: a range that cannot be named leaves the general
            // path to report it, with nothing changed.
            let mut ranges = ArrayVec::<(usize, usize, usize), MAX_SGE>::new();
            if !self.sq_ranges(seq, sent, seg, &mut ranges) {
                break;
            }
            let (hdr, tail) = room.split_at_mut(head);
            codec::emit_mpa_len(hdr, ulpdu_len);
            let new_sent = sent + seg as u64;
            let last = new_sent >= len;
            let imm_follows = self.put_sq_segment(
                hdr.get_mut(2..).unwrap_or_default(),
                seq,
                op,
                sent,
                new_sent,
                last,
            );
            tail.fill(0);
            if self.tx.crc {
                let mut crc = crate::memory::crc32c_append(0, hdr);
                let mem = self.sq.sges(seq).1;
                for &(sge, offset, n) in &ranges {
                    if let Some(v) = mem.get(sge).and_then(Option::as_ref) {
                        crc = v
                            .memory
                            .region()
                            .crc32c_append(crc, offset, n)
                            .unwrap_or(crc);
                    }
                }
                let (pad, field) = tail.split_at_mut(trailer - 4);
                crc = crate::memory::crc32c_append(crc, pad);
                field.copy_from_slice(&codec::crc_to_wire(crc));
            }
            plan.push_batch(at, head);
            for &(sge, offset, n) in &ranges {
                let _ = plan.pieces.try_push(RunPiece::Sge {
                    seq,
                    sge,
                    offset,
                    len: n,
                });
            }
            plan.push_batch(at + head, trailer);
            plan.wire += total;
            at += head + trailer;
            wire += total;
            self.tx.stream_offset = self.tx.stream_offset.wrapping_add(total as u64);
            self.stats.tx_stream_bytes += total as u64;
            self.stats.tx_fpdus += 1;
            self.on_fpdu_sent(TxDone::Sq {
                seq,
                bytes: seg,
                last: last && !imm_follows,
            });
            sent = new_sent;
            if last {
                break;
            }
        }
        if wire > 0 {
            self.tx.gather_offered = 0;
            self.tx_turn_account(TxSide::Sq, wire);
        } else if !full {
            // The copy paths and the general path take it (and report what is wrong).
            return None;
        }
        Some(at - used)
    }

    /// The payload bytes `from..from + len` of SQ entry `seq` as (element, region offset,
    /// length) ranges of its validated elements, into `out`; false when they cannot be
    /// named (an element not validated, or the range runs past the payload).
    fn sq_ranges(
        &self,
        seq: u64,
        from: u64,
        len: usize,
        out: &mut ArrayVec<(usize, usize, usize), MAX_SGE>,
    ) -> bool {
        let (sges, mem) = self.sq.sges(seq);
        let mut skip = from;
        let mut at = 0usize;
        for (i, (sge, m)) in sges.iter().zip(mem).enumerate() {
            if at == len {
                break;
            }
            let l = u64::from(sge.length);
            if skip >= l {
                skip -= l;
                continue;
            }
            let Some(v) = m.as_ref() else {
                return false;
            };
            // `l - skip` is below 2^32: an element's length.
            let n = ((l - skip) as usize).min(len - at);
            if out
                .try_push((i, v.region_offset + skip as usize, n))
                .is_err()
            {
                return false;
            }
            at += n;
            skip = 0;
        }
        at == len
    }

    /// [`Qp::tx_copy_fpdus`]' path for the commonest FPDUs of small messages: Sends and RDMA
    /// Writes without Immediate Data whose whole payload fits one FPDU of at most `max_each`
    /// bytes, next in the send queue with nothing ahead of them (no FPDU in progress or built
    /// ahead, no Terminate, RTR, Read or Atomic Response, no markers). Up to `max_fpdus` of
    /// them are written one after the other straight from their SQ entries into `out` (MPA
    /// length, DDP/RDMAP header from the codec's own prefix, payload, pad, CRC over the copy)
    /// and committed, without the build, its payload references and the gather list of the
    /// general path; the bytes are the same (`tests/it/engine_props.rs` compares the two paths'
    /// streams). Returns the bytes written; it stops, with that entry untouched, at the first
    /// one the general path has to decide.
    fn tx_copy_small(&mut self, out: &mut [u8], max_each: usize, max_fpdus: usize) -> usize {
        let tx = &self.tx;
        if tx.build.is_some()
            || !tx.ahead.is_empty()
            || tx.msg != TxMsg::None
            || tx.rtr_pending
            || tx.gate_until_rx
            || tx.held
            || tx.markers
            || self.terminate.wants_tx()
            || !self.irq.is_empty()
            || !matches!(self.state, QpState::Rts | QpState::Closing)
        {
            return 0;
        }
        let (max_send, max_write) = self.tx.max_small;
        let mut used = 0;
        let mut fpdus = 0;
        while fpdus < max_fpdus {
            let seq = self.sq.tx_seq;
            let Some(e) = self.sq.entry(seq) else {
                break;
            };
            if e.local_error
                || !matches!(e.status, SqStatus::Queued)
                || (e.fence && !self.orq.is_empty())
            {
                break;
            }
            let op = e.op;
            let Ok(len) = usize::try_from(e.len) else {
                break;
            };
            let (hdr_len, max_payload) = match op {
                SendOp::Send { .. } => (codec::UNTAGGED_HEADER_LEN, max_send),
                SendOp::Write { .. } => (codec::TAGGED_HEADER_LEN, max_write),
                _ => break,
            };
            let ulpdu_len = hdr_len + len;
            let total = codec::fpdu_len(ulpdu_len);
            let room = out.len().saturating_sub(used).min(max_each);
            if len > max_payload || total > room {
                break;
            }
            let Some(fpdu) = out.get_mut(used..used + total) else {
                break;
            };
            // Pad and CRC field (zeros when CRC is off) first: the last 8 bytes hold both (at
            // most 3 + 4; an FPDU has at least 20), and the payload and header bytes among
            // them are written next.
            if let Some(tail) = fpdu.last_chunk_mut::<8>() {
                *tail = [0; 8];
            }
            let Some((hdr, rest)) = fpdu.split_at_mut_checked(2 + hdr_len) else {
                break;
            };
            let Some(payload) = rest.get_mut(..len) else {
                break;
            };
            // A payload copy that cannot be made leaves the general path to report it.
            if !self.sq_copy_range(seq, 0, payload) {
                break;
            }
            codec::emit_mpa_len(hdr, ulpdu_len);
            let ulp_hdr = hdr.get_mut(2..).unwrap_or_default();
            match op {
                SendOp::Send {
                    solicited,
                    invalidate: None,
                } => {
                    let msn = self.tx.msn[0];
                    let t = &self.tx.send_headers[usize::from(solicited)];
                    if codec::put_send(ulp_hdr, t, msn, 0) == 0 {
                        break;
                    }
                    self.tx.msn[0] = msn.wrapping_add(1);
                }
                SendOp::Send {
                    solicited,
                    invalidate,
                } => {
                    let msn = self.tx.msn[0];
                    codec::emit_send(ulp_hdr, true, solicited, invalidate.map(|s| s.0), msn, 0);
                    self.tx.msn[0] = msn.wrapping_add(1);
                }
                SendOp::Write { remote_addr, rkey } => {
                    // Control bytes from the template, then STag and TO (big-endian).
                    let p = &self.tx.write_prefixes[1];
                    if codec::put_tagged(ulp_hdr, p, rkey.0, remote_addr) == 0 {
                        break;
                    }
                }
                _ => break,
            }
            if self.tx.crc {
                let Some((covered, field)) = fpdu.split_at_mut_checked(total - 4) else {
                    break;
                };
                field.copy_from_slice(&codec::crc_to_wire(crate::memory::crc32c_append(
                    0, covered,
                )));
            }
            // What building the FPDU, committing all of it and `on_fpdu_sent` would have
            // recorded: the WR is done (it completes when the send queue is polled).
            if let Some(e) = self.sq.entry_mut(seq) {
                e.status = SqStatus::Done(WcStatus::Success, len as u32);
            }
            match op {
                SendOp::Write { .. } => self.stats.tx.write.add(len as u64),
                _ => self.stats.tx.send.add(len as u64),
            }
            self.sq.tx_seq = seq + 1;
            self.tx.stream_offset = self.tx.stream_offset.wrapping_add(total as u64);
            self.stats.tx_stream_bytes += total as u64;
            self.stats.tx_fpdus += 1;
            used += total;
            fpdus += 1;
        }
        if fpdus > 0 {
            self.tx.gather_offered = 0;
        }
        used
    }

    /// [`Qp::tx_copy_fpdus`]' path for the rest of a message in progress (a Send or Write,
    /// with or without Immediate Data, or a Read Response, past its first
    /// [`ALIAS_LEAD_MAX_BYTES`], so past any leading FPDUs): its FPDUs of at most `max_each`
    /// bytes written one after the other straight from the SQ entry or the validated Read
    /// source into `out` (MPA length, header from the codec's templates,
    /// payload, pad, CRC over the copy) and committed, without the build, its payload
    /// references and the per-FPDU commit of the general path. A message in MSS-sized FPDUs
    /// (to siw, or any peer behind a 1500-byte MTU) is nearly all such FPDUs. The bytes are
    /// the general path's (`tests/it/engine_props.rs` compares the streams). Returns the bytes
    /// written: 0 when the next FPDU is not such a one, or does not fit.
    #[inline(never)]
    fn tx_copy_run(&mut self, out: &mut [u8], max_each: usize) -> usize {
        let tx = &self.tx;
        if tx.build.is_some()
            || !tx.ahead.is_empty()
            || tx.rtr_pending
            || tx.gate_until_rx
            || tx.held
            || tx.markers
            || self.terminate.wants_tx()
            || !matches!(self.state, QpState::Rts | QpState::Closing)
        {
            return 0;
        }
        let pick = self.tx_pick();
        // The turn's end: a run takes the whole FPDUs that fit before it (the general path
        // then builds the one that crosses it).
        let budget = usize::try_from(pick.budget).unwrap_or(usize::MAX);
        let out = out.get_mut(..budget.min(out.len())).unwrap_or_default();
        match (pick.side, self.tx.msg) {
            (TxSide::Sq, TxMsg::Sq(seq)) => self.tx_copy_sq_run(seq, out, max_each),
            (TxSide::Irq, _) if self.rresp_in_progress() => {
                self.tx_copy_read_response_run(out, max_each)
            }
            _ => 0,
        }
    }

    /// [`Qp::tx_copy_run`] for the Read Response in progress (the front of the IRQ, past its
    /// first [`ALIAS_LEAD_MAX_BYTES`]): its FPDUs straight from the validated source, as
    /// [`Qp::build_read_response`] would build them.
    fn tx_copy_read_response_run(&mut self, out: &mut [u8], max_each: usize) -> usize {
        let hdr_len = codec::TAGGED_HEADER_LEN;
        let max_payload = self.tx.max_small.1;
        let mut used = 0;
        while let Some(irq) = self.irq.front() {
            let Some(src) = irq.src.as_ref() else {
                break;
            };
            let (sent, len) = (irq.sent, irq.len);
            if irq.atomic.is_some() || sent < ALIAS_LEAD_MAX_BYTES || sent >= len {
                break;
            }
            let Some(slot) = RunSlot::cut(out, used, hdr_len, len - sent, max_payload, max_each)
            else {
                break;
            };
            let (seg, total) = (slot.payload.len(), slot.total);
            let piece = TxPiece::Region {
                region: src.memory.region(),
                offset: src.region_offset + sent as usize,
                len: seg,
            };
            if piece.copy_to(slot.payload) != seg {
                break;
            }
            let last = sent + seg as u64 >= len;
            let prefix = &self.tx.read_response_prefixes[usize::from(last)];
            let to = irq.sink_to.wrapping_add(sent);
            codec::put_tagged(slot.ulp_hdr, prefix, irq.sink_stag, to);
            if let Some(irq) = self.irq.front_mut() {
                irq.sent += seg as u64;
            }
            let fpdu = out.get_mut(used..used + total).unwrap_or_default();
            self.tx_copy_run_done(fpdu, TxDone::ReadResponse { bytes: seg, last });
            used += total;
            if last {
                self.irq.pop();
                break;
            }
        }
        if used > 0 {
            self.tx.gather_offered = 0;
            self.tx_turn_account(TxSide::Irq, used);
        }
        used
    }

    /// What [`Qp::tx_copy_run`] records for each FPDU it wrote (`fpdu`, whole): its CRC,
    /// then what committing a built FPDU would have (stream offset, counters,
    /// [`Qp::on_fpdu_sent`]). The run's bytes count against its side's turn once, at its
    /// end.
    #[inline(always)]
    fn tx_copy_run_done(&mut self, fpdu: &mut [u8], done: TxDone) {
        let total = fpdu.len();
        if self.tx.crc {
            if let Some((covered, field)) = fpdu.split_at_mut_checked(total - 4) {
                field.copy_from_slice(&codec::crc_to_wire(crate::memory::crc32c_append(
                    0, covered,
                )));
            }
        }
        self.tx.stream_offset = self.tx.stream_offset.wrapping_add(total as u64);
        self.stats.tx_stream_bytes += total as u64;
        self.stats.tx_fpdus += 1;
        self.on_fpdu_sent(done);
    }

    /// [`Qp::tx_copy_run`] for the Send or Write (`seq`) in progress.
    fn tx_copy_sq_run(&mut self, seq: u64, out: &mut [u8], max_each: usize) -> usize {
        let Some(e) = self.sq.entry(seq) else {
            return 0;
        };
        let SqStatus::Sending { sent } = e.status else {
            return 0;
        };
        if e.local_error || sent < ALIAS_LEAD_MAX_BYTES {
            return 0;
        }
        let (op, len) = (e.op, e.len);
        let (hdr_len, max_payload) = match op {
            SendOp::Send { .. } | SendOp::SendWithImm { .. } => {
                (codec::UNTAGGED_HEADER_LEN, self.tx.max_small.0)
            }
            SendOp::Write { .. } | SendOp::WriteWithImm { .. } => {
                (codec::TAGGED_HEADER_LEN, self.tx.max_small.1)
            }
            _ => return 0,
        };
        let mut used = 0;
        let mut sent = sent;
        while sent < len {
            let Some(slot) = RunSlot::cut(out, used, hdr_len, len - sent, max_payload, max_each)
            else {
                break;
            };
            let (seg, total) = (slot.payload.len(), slot.total);
            // A copy that cannot be made leaves the general path to report it.
            if !self.sq_copy_range(seq, sent, slot.payload) {
                break;
            }
            let new_sent = sent + seg as u64;
            let last = new_sent >= len;
            let imm_follows = self.put_sq_segment(slot.ulp_hdr, seq, op, sent, new_sent, last);
            let done = TxDone::Sq {
                seq,
                bytes: seg,
                last: last && !imm_follows,
            };
            let fpdu = out.get_mut(used..used + total).unwrap_or_default();
            self.tx_copy_run_done(fpdu, done);
            used += total;
            sent = new_sent;
            if last {
                break;
            }
        }
        if used > 0 {
            self.tx.gather_offered = 0;
            self.tx_turn_account(TxSide::Sq, used);
        }
        used
    }

    /// Copies the bytes `from..from + out.len()` of SQ entry `seq`'s payload (inline bytes or
    /// its validated SGEs) into `out`; false when it cannot (an SGE not validated, or the
    /// range runs past the payload). Inlined: the copy paths' per-message cost (out of
    /// line it added about 60 instructions to a 64-byte Send).
    #[inline(always)]
    fn sq_copy_range(&self, seq: u64, from: u64, out: &mut [u8]) -> bool {
        if let Some(bytes) = self.sq.inline_bytes(seq) {
            let src = usize::try_from(from)
                .ok()
                .and_then(|f| bytes.get(f..f.checked_add(out.len())?));
            return match src {
                Some(src) => {
                    out.copy_from_slice(src);
                    true
                }
                None => false,
            };
        }
        let (sges, mem) = self.sq.sges(seq);
        // Payload bytes still to pass over before `from` (zero-length SGEs pass too).
        let mut skip = from;
        let mut at = 0usize;
        for (sge, m) in sges.iter().zip(mem) {
            let l = u64::from(sge.length);
            if skip >= l {
                skip -= l;
                continue;
            }
            let Some(v) = m.as_ref() else {
                return false;
            };
            // `l - skip` is below 2^32: an SGE's length.
            let n = ((l - skip) as usize).min(out.len() - at);
            let piece = TxPiece::Region {
                region: v.memory.region(),
                offset: v.region_offset + skip as usize,
                len: n,
            };
            let Some(dst) = out.get_mut(at..at + n) else {
                return false;
            };
            if piece.copy_to(dst) != n {
                return false;
            }
            at += n;
            skip = 0;
            if at == out.len() {
                break;
            }
        }
        at == out.len()
    }

    /// Convenience for tests and simple runtimes: [`Qp::send_to`] into `out` (several FPDUs
    /// if they fit, the last one cut where `out` ends), without coalescing. Returns the
    /// bytes written.
    pub fn handle_tx(&mut self, out: &mut [u8]) -> usize {
        let mut sink = SliceSink { out, at: 0 };
        let mut budget = usize::MAX;
        let _ = self.send_to(&mut sink, None, &mut budget);
        sink.at
    }

    /// What a whole FPDU's going out means: a completed WR, counters, a Terminate sent.
    /// Inlined into its two callers (the commit and [`Qp::tx_copy_run`]).
    #[inline(always)]
    fn on_fpdu_sent(&mut self, done: TxDone) {
        match done {
            TxDone::Sq { seq, bytes, last } => {
                if !last {
                    return;
                }
                let mut counted = None;
                if let Some(e) = self.sq.entry_mut(seq) {
                    if let SqStatus::Sending { .. } = e.status {
                        e.status = SqStatus::Done(WcStatus::Success, e.len as u32);
                    }
                    counted = Some((e.op, e.len));
                }
                match counted {
                    Some((SendOp::Send { .. }, len)) => self.stats.tx.send.add(len),
                    Some((SendOp::Write { .. }, len)) => self.stats.tx.write.add(len),
                    Some((SendOp::SendWithImm { .. }, len)) => {
                        self.stats.tx.send.add(len);
                        self.stats.tx.immediate.add(8);
                    }
                    Some((SendOp::WriteWithImm { .. }, len)) => {
                        self.stats.tx.write.add(len);
                        self.stats.tx.immediate.add(8);
                    }
                    _ => {}
                }
                let _ = bytes;
            }
            TxDone::ReadRequest { bytes } => self.stats.tx.read_request.add(bytes),
            TxDone::AtomicRequest => self.stats.tx.atomic_request.add(8),
            TxDone::AtomicResponse => self.stats.tx.atomic_response.add(8),
            TxDone::ReadResponse { bytes, last } => {
                self.stats.tx.read_response.bytes += bytes as u64;
                if last {
                    self.stats.tx.read_response.messages += 1;
                }
            }
            TxDone::Terminate => {
                self.stats.terminates_sent += 1;
                self.stats.tx.terminate.messages += 1;
                self.terminate.sent = true;
                if self.state == QpState::Terminate {
                    self.set_state(QpState::Error);
                }
            }
            TxDone::Rtr => {}
        }
    }

    fn take_spare(&mut self) -> Option<Box<FpduBuild>> {
        let mut b = match self.tx.spare.take() {
            Some(b) => b,
            // No build is busy: the QP's first FPDU (or one after its builds went to
            // `ahead` and back). Allocated once; `put_spare` keeps it.
            None if self.tx.build.is_none() => FpduBuild::boxed(),
            None => return None,
        };
        b.hdr_len = 0;
        b.trailer_len = 0;
        b.layout = None;
        b.total = 0;
        b.sent = 0;
        b.offered_end = 0;
        b.snap_len = 0;
        Some(b)
    }

    /// Frames a ULPDU whose header (and inline data) is already in `b.hdr[2..2 + ulpdu_hdr]`
    /// and whose payload pieces are in `b.payload`: writes the MPA length, pad and CRC, and
    /// places the markers when they are in use.
    fn frame_fpdu(&mut self, mut b: Box<FpduBuild>, hdr_and_inline: usize, done: TxDone) {
        let payload_len: usize = b.payload_slices().map(|p| p.2).sum();
        let ulpdu_len = hdr_and_inline + payload_len;
        codec::emit_mpa_len(&mut b.hdr, ulpdu_len);
        b.hdr_len = 2 + hdr_and_inline;
        let pad = codec::pad_len(ulpdu_len);
        b.trailer = [0u8; 8];
        b.trailer_len = pad + 4;
        let plain_len = b.hdr_len + payload_len + b.trailer_len;
        b.layout = None;
        b.total = plain_len;
        if let Some(side) = done.side() {
            self.tx_turn_account(side, plain_len);
        }
        if self.tx.markers {
            //= https://www.rfc-editor.org/rfc/rfc5044#section-4.3
            // (paraphrase) With markers negotiated for this direction, the sender inserts a
            // marker every 512 octets of the stream, the first one immediately before the
            // first FPDU; each marker's FPDUPTR points back to the start of its FPDU.
            let layout = codec::marker_layout(self.tx.stream_offset, plain_len)
                .filter(|l| l.marker_count() <= MAX_MARKERS);
            let Some(layout) = layout else {
                // Unreachable: stream offsets stay multiples of 4 (checked at establish) and
                // max_payload keeps FPDUs short enough for 16-bit FPDUPTRs. Never send an
                // FPDU without the markers the peer expects: fail the stream instead.
                for p in b.payload.iter_mut() {
                    *p = None;
                }
                self.tx.spare = Some(b);
                self.fail_local();
                return;
            };
            if b.markers.is_empty() {
                // The first FPDU with markers of this build (none without markers).
                b.markers = vec![[0; MARKER_LEN]; MAX_MARKERS];
            }
            for (slot, marker) in b.markers.iter_mut().zip(layout.markers()) {
                *slot = marker.to_bytes();
            }
            b.layout = Some(layout);
            b.total = layout.wire_len();
        }
        b.crc_pending = false;
        b.done = done;
        if self.tx.crc {
            if self.tx.defer_crc && b.layout.is_none() {
                // `tx_copy_fpdus` computes it over the copy, in one pass.
                b.crc_pending = true;
            } else {
                b.fill_crc();
            }
        }
        b.sent = 0;
        b.offered_end = 0;
        self.tx.build = Some(b);
    }

    fn build_next(&mut self) {
        if self.terminate.wants_tx() {
            self.build_terminate();
            return;
        }
        if !matches!(self.state, QpState::Rts | QpState::Closing)
            || self.tx.gate_until_rx
            || self.tx.held
        {
            return;
        }
        if self.tx.rtr_pending {
            self.build_rtr();
            return;
        }
        let pick = self.tx_pick();
        self.build_from(pick.side);
        if self.tx.build.is_none() {
            if let Some(side) = pick.fallback {
                self.build_from(side);
            }
        }
    }

    /// Builds the next FPDU of `side` (none when it has nothing it may send now).
    fn build_from(&mut self, side: TxSide) {
        match (side, self.tx.msg) {
            (TxSide::Irq, _) => self.build_read_response(),
            (TxSide::Sq, TxMsg::Sq(seq)) => self.build_sq(seq),
            (TxSide::Sq, TxMsg::Imm(seq)) => self.build_immediate(seq),
            (TxSide::Sq, TxMsg::None) => self.build_sq(self.sq.tx_seq),
        }
    }

    /// Chooses between the send queue and the IRQ (Read and Atomic Responses) for the next
    /// FPDU. Messages of the two may be interleaved FPDU by FPDU when one is tagged (a Write,
    /// a Read Response) and the other untagged (a Send, a Read or Atomic Request, Immediate
    /// Data, an Atomic Response), the mix Linux siw accepts (its receive path keeps one
    /// context for the tagged message in progress and one for the untagged one) and
    /// RFC 5041 places from each segment's own header. Such a pair takes turns of
    /// [`TX_INTERLEAVE_QUANTUM`] bytes, so a small Send posted behind a long Read Response
    /// (or a peer's Read behind a long Send) waits for one turn, not the whole message. A
    /// message in progress that may not be interleaved with the other side's next one (two
    /// tagged, two untagged) finishes first; with nothing in progress the turns alternate
    /// the same way.
    //= https://www.rfc-editor.org/rfc/rfc5041#section-5.1
    // (paraphrase) Tagged segments carry their STag and tagged offset, untagged ones their
    // queue number, MSN and message offset: each is placed from its own header.
    #[inline(always)]
    fn tx_pick(&self) -> TxPick {
        let alone = |side| TxPick {
            side,
            fallback: None,
            budget: u64::MAX,
        };
        let Some(front) = self.irq.front() else {
            return alone(TxSide::Sq);
        };
        let irq_tagged = front.atomic.is_none();
        let sq_tagged = match self.tx.msg {
            TxMsg::Sq(seq) => self.sq.entry(seq).map(|e| e.op.is_tagged()),
            TxMsg::Imm(_) => Some(false),
            TxMsg::None => self
                .sq
                .entry(self.sq.tx_seq)
                .filter(|e| !e.local_error)
                .map(|e| e.op.is_tagged()),
        };
        let Some(sq_tagged) = sq_tagged else {
            // Nothing on the send queue, or a WR that fails the QP once the Read Response
            // in progress is out.
            return alone(TxSide::Irq);
        };
        let mixable = sq_tagged != irq_tagged;
        if !mixable && self.tx.msg != TxMsg::None {
            return alone(TxSide::Sq);
        }
        if !mixable && self.rresp_in_progress() {
            return alone(TxSide::Irq);
        }
        let (side, spent) = if self.tx.turn_bytes >= TX_INTERLEAVE_QUANTUM {
            (self.tx.turn.other(), 0)
        } else {
            (self.tx.turn, self.tx.turn_bytes)
        };
        TxPick {
            side,
            fallback: Some(side.other()),
            budget: if mixable {
                TX_INTERLEAVE_QUANTUM - spent
            } else {
                u64::MAX
            },
        }
    }

    /// A Read Response is in progress: the IRQ's front has sent some of its bytes (it
    /// leaves the IRQ with its last).
    #[inline(always)]
    fn rresp_in_progress(&self) -> bool {
        self.irq.front().is_some_and(|f| f.sent > 0)
    }

    /// Counts an FPDU of `total` bytes built from `side` against its turn.
    #[inline(always)]
    fn tx_turn_account(&mut self, side: TxSide, total: usize) {
        if self.tx.turn != side {
            self.tx.turn = side;
            self.tx.turn_bytes = 0;
        }
        self.tx.turn_bytes += total as u64;
    }

    fn build_terminate(&mut self) {
        let Some(mut b) = self.take_spare() else {
            return;
        };
        let msn = self.tx.msn[2];
        let layout = self.stream.terminate_layout;
        let Some(len) = self
            .terminate
            .emit(b.hdr.get_mut(2..).unwrap_or(&mut []), msn, layout)
        else {
            self.tx.spare = Some(b);
            return;
        };
        self.tx.msn[2] = self.tx.msn[2].wrapping_add(1);
        self.frame_fpdu(b, len, TxDone::Terminate);
    }

    fn build_rtr(&mut self) {
        let Some(kind) = self.stream.rtr.map(|r| r.kind) else {
            self.tx.rtr_pending = false;
            return;
        };
        let Some(mut b) = self.take_spare() else {
            return;
        };
        let hdr = b.hdr.get_mut(2..).unwrap_or(&mut []);
        let len = match kind {
            super::RtrKind::Write => codec::emit_write(hdr, true, codec::RTR_STAG, 0),
            super::RtrKind::Send => {
                let msn = self.tx.msn[0];
                self.tx.msn[0] = msn.wrapping_add(1);
                codec::emit_send(hdr, true, false, None, msn, 0)
            }
            super::RtrKind::Read => {
                if self.orq.is_full() {
                    self.tx.spare = Some(b);
                    return;
                }
                let msn = self.tx.msn[1];
                self.tx.msn[1] = msn.wrapping_add(1);
                let _ = self.orq.push(OrqEntry {
                    seq: None,
                    atomic: None,
                    sink_stag: codec::RTR_STAG,
                    sink_to: 0,
                    len: 0,
                    received: 0,
                });
                codec::emit_read_request(hdr, msn, codec::RTR_STAG, 0, 0, codec::RTR_STAG, 0)
            }
        };
        self.tx.rtr_pending = false;
        self.frame_fpdu(b, len, TxDone::Rtr);
    }

    fn build_read_response(&mut self) {
        let Some(max) = Some(self.tx.max_payload(codec::TAGGED_HEADER_LEN)) else {
            return;
        };
        let Some(mut b) = self.take_spare() else {
            return;
        };
        let Some(irq) = self.irq.front_mut() else {
            self.tx.spare = Some(b);
            return;
        };
        if let Some((request_id, original_value)) = irq.atomic {
            //= https://www.rfc-editor.org/rfc/rfc7306#section-6
            // (paraphrase) The responder answers each Atomic Request, in order, with an
            // Atomic Response on untagged queue 3 that echoes the Request Identifier and
            // carries the value the target word had before the operation.
            let msn = self.tx.msn[3];
            self.tx.msn[3] = msn.wrapping_add(1);
            let hdr_len = codec::emit_atomic_response(
                b.hdr.get_mut(2..).unwrap_or(&mut []),
                msn,
                AtomicResponseRepr {
                    original_request_id: request_id,
                    original_value,
                },
            );
            self.irq.pop();
            self.frame_fpdu(b, hdr_len, TxDone::AtomicResponse);
            return;
        }
        let remaining = irq.len - irq.sent;
        let mut max = max;
        let hdr_len = codec::TAGGED_HEADER_LEN;
        let lead = irq
            .src
            .as_ref()
            .and_then(|src| self.tx.alias_cap(src, hdr_len, irq.len, irq.sent, max));
        if let Some(lead) = lead {
            max = lead;
            b.lead = true;
        }
        let seg = usize::try_from(remaining.min(max as u64)).unwrap_or(max);
        if seg > 0 {
            if let Some(src) = &irq.src {
                let off = src.region_offset + usize::try_from(irq.sent).unwrap_or(usize::MAX);
                if let Some(slot) = b.payload.get_mut(0) {
                    *slot = Some((Arc::clone(&src.memory), off, seg));
                }
            }
        }
        let to = irq.sink_to.wrapping_add(irq.sent);
        irq.sent += seg as u64;
        let last = irq.sent >= irq.len;
        let hdr_len = codec::put_tagged(
            b.hdr.get_mut(2..).unwrap_or(&mut []),
            &self.tx.read_response_prefixes[usize::from(last)],
            irq.sink_stag,
            to,
        );
        if last {
            self.irq.pop();
        }
        self.frame_fpdu(b, hdr_len, TxDone::ReadResponse { bytes: seg, last });
    }

    fn build_sq(&mut self, seq: u64) {
        let ord = self.stream.ord;
        let orq_len = self.orq.len();
        let (op, fence, local_error, status, len) = match self.sq.entry(seq) {
            Some(e) => (e.op, e.fence, e.local_error, e.status, e.len),
            None => return,
        };
        if local_error {
            if let Some(e) = self.sq.entry_mut(seq) {
                e.status = SqStatus::Done(WcStatus::LocProtErr, 0);
            }
            self.sq.tx_seq = seq + 1;
            self.tx.msg = TxMsg::None;
            self.fail_local();
            return;
        }
        let sent = match status {
            SqStatus::Queued => 0,
            SqStatus::Sending { sent } => sent,
            SqStatus::AwaitingResponse | SqStatus::Done(..) => {
                // Already handled (e.g. flushed): move on.
                self.sq.tx_seq = self.sq.tx_seq.max(seq + 1);
                self.tx.msg = TxMsg::None;
                return;
            }
        };
        if sent == 0 && fence && orq_len > 0 {
            return;
        }
        if let SendOp::Read { remote_addr, rkey } = op {
            if orq_len >= ord || self.orq.is_full() {
                return;
            }
            let (sink_stag, sink_to) = self
                .sq
                .sges(seq)
                .0
                .first()
                .map_or((0, 0), |s| (s.lkey.0, s.addr));
            let Some(mut b) = self.take_spare() else {
                return;
            };
            let msn = self.tx.msn[1];
            let hdr_len = codec::emit_read_request(
                b.hdr.get_mut(2..).unwrap_or(&mut []),
                msn,
                sink_stag,
                sink_to,
                len as u32,
                rkey.0,
                remote_addr,
            );
            self.tx.msn[1] = msn.wrapping_add(1);
            let _ = self.orq.push(OrqEntry {
                seq: Some(seq),
                atomic: None,
                sink_stag,
                sink_to,
                len,
                received: 0,
            });
            if let Some(e) = self.sq.entry_mut(seq) {
                e.status = SqStatus::AwaitingResponse;
            }
            self.sq.tx_seq = seq + 1;
            self.tx.msg = TxMsg::None;
            self.frame_fpdu(b, hdr_len, TxDone::ReadRequest { bytes: len });
            return;
        }

        if op.is_atomic() {
            if orq_len >= ord || self.orq.is_full() {
                return;
            }
            self.build_atomic_request(seq, op);
            return;
        }

        let Some(mut b) = self.take_spare() else {
            return;
        };
        let hdr_len = match op {
            SendOp::Send { .. } | SendOp::SendWithImm { .. } => codec::UNTAGGED_HEADER_LEN,
            _ => codec::TAGGED_HEADER_LEN,
        };
        let mut max = self.tx.max_payload(hdr_len);
        if sent < ALIAS_LEAD_MAX_BYTES {
            let (sges, mem) = self.sq.sges(seq);
            // The copy that matters is of the first element's bytes.
            let lead = sges
                .first()
                .zip(mem.first().and_then(Option::as_ref))
                .filter(|(sge, _)| u64::from(sge.length) >= ALIAS_LEAD_MIN_LEN)
                .and_then(|(_, v)| self.tx.alias_cap(v, hdr_len, len, sent, max));
            if let Some(lead) = lead {
                max = lead;
                b.lead = true;
            }
        }
        // Gather the segment's payload.
        let mut seg = 0usize;
        let mut inline_len = 0usize;
        match self.sq.inline_bytes(seq) {
            None => {
                let (sges, mem) = self.sq.sges(seq);
                let mut i = 0;
                while seg < max && sent + (seg as u64) < len && i < MAX_SGE {
                    match sge_piece(sges, mem, sent + seg as u64, max - seg) {
                        Some(p) => {
                            seg += p.2;
                            if let Some(slot) = b.payload.get_mut(i) {
                                *slot = Some(p);
                            }
                            i += 1;
                        }
                        None => break,
                    }
                }
            }
            Some(buf) => {
                // Inline data fits one FPDU (MAX_INLINE < MIN_FPDU_LEN - headers is not
                // guaranteed, so it is segmented like any payload).
                let start = usize::try_from(sent).unwrap_or(usize::MAX);
                let take = buf.len().saturating_sub(start).min(max);
                if let (Some(dst), Some(src)) = (
                    b.hdr.get_mut(2 + hdr_len..2 + hdr_len + take),
                    buf.get(start..start + take),
                ) {
                    dst.copy_from_slice(src);
                    inline_len = take;
                    seg = take;
                }
            }
        }
        let new_sent = sent + seg as u64;
        let last = new_sent >= len;
        let hdr = b.hdr.get_mut(2..).unwrap_or(&mut []);
        let imm_follows = self.put_sq_segment(hdr, seq, op, sent, new_sent, last);
        self.frame_fpdu(
            b,
            hdr_len + inline_len,
            TxDone::Sq {
                seq,
                bytes: seg,
                last: last && !imm_follows,
            },
        );
    }

    /// Writes the DDP/RDMAP header of the segment `sent..new_sent` of SQ message `seq`
    /// (`op`; `last`: it ends the message's data) into `hdr` from the codec's templates, and
    /// records the segment as built: the entry's progress, the Send MSN after a message's
    /// last segment, what comes next (the rest, the Immediate Data message, or the next
    /// WR). Returns whether an Immediate Data message follows. The one copy of this for
    /// [`Qp::build_sq`] and [`Qp::tx_copy_run`], inlined into both (out of line it cost
    /// about 70 instructions per FPDU more).
    #[inline(always)]
    fn put_sq_segment(
        &mut self,
        hdr: &mut [u8],
        seq: u64,
        op: SendOp,
        sent: u64,
        new_sent: u64,
        last: bool,
    ) -> bool {
        match op {
            SendOp::Send {
                solicited,
                invalidate,
            } => {
                let msn = self.tx.msn[0];
                match invalidate {
                    None => {
                        let t = self.tx.send_template(last, solicited);
                        codec::put_send(hdr, t, msn, sent as u32);
                    }
                    Some(s) => {
                        codec::emit_send(hdr, last, solicited, Some(s.0), msn, sent as u32);
                    }
                }
                if last {
                    self.tx.msn[0] = msn.wrapping_add(1);
                }
            }
            SendOp::SendWithImm { .. } => {
                // The Solicited Event, if asked for, rides on the Immediate Data message,
                // which is what completes the operation at the peer.
                let msn = self.tx.msn[0];
                codec::put_send(hdr, self.tx.send_template(last, false), msn, sent as u32);
                if last {
                    self.tx.msn[0] = msn.wrapping_add(1);
                }
            }
            SendOp::Write { remote_addr, rkey }
            | SendOp::WriteWithImm {
                remote_addr, rkey, ..
            } => {
                let prefix = &self.tx.write_prefixes[usize::from(last)];
                codec::put_tagged(hdr, prefix, rkey.0, remote_addr.wrapping_add(sent));
            }
            SendOp::Read { .. } | SendOp::FetchAdd { .. } | SendOp::CmpSwap { .. } => {}
        }
        if let Some(e) = self.sq.entry_mut(seq) {
            e.status = SqStatus::Sending { sent: new_sent };
        }
        let imm_follows = last && op.imm().is_some();
        if imm_follows {
            self.tx.msg = TxMsg::Imm(seq);
        } else if last {
            self.sq.tx_seq = seq + 1;
            self.tx.msg = TxMsg::None;
        } else {
            self.tx.msg = TxMsg::Sq(seq);
        }
        imm_follows
    }

    /// The Immediate Data message that ends a Write/Send with Immediate.
    fn build_immediate(&mut self, seq: u64) {
        let (imm, solicited) = match self.sq.entry(seq).map(|e| e.op) {
            Some(SendOp::WriteWithImm { imm, .. }) => (imm, false),
            Some(SendOp::SendWithImm { imm, solicited }) => (imm, solicited),
            _ => {
                self.tx.msg = TxMsg::None;
                return;
            }
        };
        let Some(mut b) = self.take_spare() else {
            return;
        };
        //= https://www.rfc-editor.org/rfc/rfc7306#section-7
        // (paraphrase) Immediate Data travels in an Immediate Data (or Immediate Data with
        // Solicited Event) message of its own, an untagged message on queue 0 with the next
        // MSN, sent right after the RDMA Write or Send it belongs to.
        let msn = self.tx.msn[0];
        self.tx.msn[0] = msn.wrapping_add(1);
        let hdr_len =
            codec::emit_immediate(b.hdr.get_mut(2..).unwrap_or(&mut []), msn, solicited, imm);
        self.sq.tx_seq = seq + 1;
        self.tx.msg = TxMsg::None;
        self.frame_fpdu(
            b,
            hdr_len,
            TxDone::Sq {
                seq,
                bytes: 0,
                last: true,
            },
        );
    }

    /// An RFC 7306 Atomic Request (the ORD check was done by the caller).
    fn build_atomic_request(&mut self, seq: u64, op: SendOp) {
        let (opcode, remote_addr, rkey, data, mask, compare, compare_mask) = match op {
            // A plain FetchAdd: no field boundaries in the Add Mask.
            SendOp::FetchAdd {
                remote_addr,
                rkey,
                add,
            } => (AtomicOpcode::FetchAdd, remote_addr, rkey, add, 0, 0, 0),
            // A plain CmpSwap: the whole word is compared and swapped.
            SendOp::CmpSwap {
                remote_addr,
                rkey,
                compare,
                swap,
            } => (
                AtomicOpcode::CmpSwap,
                remote_addr,
                rkey,
                swap,
                u64::MAX,
                compare,
                u64::MAX,
            ),
            _ => return,
        };
        let Some(mut b) = self.take_spare() else {
            return;
        };
        // The Request Identifier only has to tell outstanding requests apart: the SQ
        // sequence number's low half does (ORD is far below 2^32).
        let request_id = seq as u32;
        let msn = self.tx.msn[1];
        self.tx.msn[1] = msn.wrapping_add(1);
        //= https://www.rfc-editor.org/rfc/rfc7306#section-6
        // (paraphrase) Atomic Requests are untagged messages on queue 1, the queue of RDMA
        // Read Requests, and count against the same ORD/IRD limits.
        let hdr_len = codec::emit_atomic_request(
            b.hdr.get_mut(2..).unwrap_or(&mut []),
            msn,
            AtomicRequestRepr {
                opcode,
                request_id,
                remote_stag: rkey.0,
                remote_tagged_offset: remote_addr,
                add_or_swap_data: data,
                add_or_swap_mask: mask,
                compare_data: compare,
                compare_mask,
            },
        );
        let _ = self.orq.push(OrqEntry {
            seq: Some(seq),
            atomic: Some(request_id),
            sink_stag: 0,
            sink_to: 0,
            len: 8,
            received: 0,
        });
        if let Some(e) = self.sq.entry_mut(seq) {
            e.status = SqStatus::AwaitingResponse;
        }
        self.sq.tx_seq = seq + 1;
        self.tx.msg = TxMsg::None;
        self.frame_fpdu(b, hdr_len, TxDone::AtomicRequest);
    }

    /// A WR failed locally (bad lkey): Terminate the stream (RDMAP local catastrophic error),
    /// flush, and report it.
    fn fail_local(&mut self) {
        self.push_event(crate::event::AsyncEvent::QpFatal {
            qp_num: self.cfg.qp_num,
            cause: Cause::LocalOperation,
        });
        self.terminate.queue_local(&mut self.tx);
        self.rx.close();
        self.flush();
        self.set_state(QpState::Terminate);
    }
}

/// A writer into a slice: takes what fits, then says `WouldBlock`.
struct SliceSink<'a> {
    out: &'a mut [u8],
    at: usize,
}

impl crate::qp::pump::VectoredWrite for SliceSink<'_> {
    fn write_from(&mut self, pieces: &[TxPiece<'_>]) -> std::io::Result<usize> {
        let start = self.at;
        for p in pieces {
            let Some(rest) = self.out.get_mut(self.at..).filter(|r| !r.is_empty()) else {
                break;
            };
            self.at += p.copy_to(rest);
        }
        match self.at - start {
            0 => Err(std::io::ErrorKind::WouldBlock.into()),
            n => Ok(n),
        }
    }
}
