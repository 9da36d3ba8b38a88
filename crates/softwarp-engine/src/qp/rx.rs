//! Receive side of a QP: the FPDU state machine, validation, placement and delivery.
//!
//! Zero copy: [`Qp::rx_target`] says where the next bytes go. Headers, pad and CRC go into
//! small buffers inside the QP; payload goes straight into the destination: the registered
//! region of an RDMA Write or Read Response, or the receive WR's buffers for a Send.
//! [`Qp::recv_from`] (the `pump` module) reads into that place and calls [`Qp::rx_commit`].
//!
//! Each FPDU is processed in three phases: header (MPA length, DDP/RDMAP header, validated
//! against the STag table, the MSN/MO state, the RQ and the IRD), payload (placed as it
//! arrives, CRC computed over the bytes placed), trailer (pad and CRC). The CRC is checked
//! before anything is delivered: completions, invalidation, Read Request queueing and
//! Terminate processing happen only after the CRC matched. A header that fails validation
//! places nothing (its payload goes to a scratch buffer) and its error is reported after the
//! CRC check, so a corrupted FPDU is reported as a CRC error, not as the protection error its
//! corruption looks like. No I/O here.
//!
//! With MPA markers in the received stream (`StreamConfig::receives_markers`), the wire
//! crate's [`MarkerLayout`] of the current FPDU says where its markers are (before
//! ULPDU_Length is read, only a marker at the FPDU's first octet matters, and the layout of
//! the shortest FPDU gives it). Every target stops at the next marker position; the marker
//! is read into a 4-byte buffer in the QP, its FPDUPTR checked (a mismatch fails the stream
//! at once with the LLP "marker mismatch" Terminate), fed to the CRC (which covers the
//! markers), and dropped. The payload still goes straight to its destination.

use std::sync::Arc;

use softwarp_wire::mpa::marker::{Marker, MarkerLayout, Markers, MARKER_LEN};
use softwarp_wire::rdmap::{AtomicOpcode, AtomicRequestRepr};

use crate::event::AsyncEvent;
use crate::fault::{Cause, Fault};
use crate::memory::Region;
use crate::mr::{Access, AccessError, MrError, MrMemory, MrTable, PdId, Stag, Validated};
use crate::qp::codec::{self, RxHeader};
use crate::qp::pump::{RxResources, BIG_PAYLOAD, SMALL_STAGE};
use crate::qp::terminate::OffendingHeader;
use crate::qp::{
    no_validated, IrqEntry, Qp, QpError, RtrKind, RxMsg, SqData, SqStatus, StreamConfig,
};
use crate::srq::Srq;
use crate::wr::{Sge, WcOpcode, WcStatus};

/// Smallest `max_rx_ulpdu` accepted.
pub(crate) const MIN_RX_ULPDU: usize = 128;
/// MPA length + the largest ULPDU kept whole in the header buffer (a Terminate).
const HDR_CAP: usize = 2 + 128;
const SCRATCH: usize = 256;
/// Bytes read before the header length is known: MPA length and the two control bytes.
const FIRST_READ: usize = 4;

/// Where the next received bytes must go.
#[derive(Debug)]
pub enum RxTarget<'a> {
    /// Into this buffer inside the QP (headers, pad and CRC, or discarded payload).
    Buffer(&'a mut [u8]),
    /// Straight into registered memory: up to `len` bytes at `offset` of `region`.
    Region {
        /// The destination region.
        region: &'a Region,
        /// Offset inside the region.
        offset: usize,
        /// Most bytes that may go there now.
        len: usize,
    },
    /// Nothing can be received until completions are polled (the QP holds as many SRQ
    /// receives as it may). Poll completions, then call `rx_commit(0, ..)`.
    Blocked,
    /// The QP does not receive (not established, or the stream failed): stop reading.
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Not established, or closed after an error.
    Closed,
    Header,
    /// Header complete, waiting for an SRQ WR slot.
    HeaderReady,
    Payload,
    Trailer,
}

/// What to do with the payload and at the end of the FPDU.
#[derive(Debug)]
enum Plan {
    Discard,
    /// An RDMA Write segment (`mem` is `None` for a zero-length one).
    Write {
        mem: Option<Arc<MrMemory>>,
        off: usize,
        last: bool,
    },
    ReadResponse {
        mem: Option<Arc<MrMemory>>,
        off: usize,
        last: bool,
    },
    Send {
        last: bool,
        solicited: bool,
        invalidate: Option<u32>,
    },
    SwallowRtrSend,
    ReadRequest(IrqEntry),
    Terminate,
    /// RFC 7306 Immediate Data: completes the receive WR taken for it.
    Immediate {
        solicited: bool,
        imm: u32,
    },
    /// RFC 7306 Atomic Request: performed on the validated target word after the CRC check.
    AtomicRequest {
        mem: Arc<MrMemory>,
        off: usize,
        req: AtomicRequestRepr,
    },
    /// RFC 7306 Atomic Response for the Atomic Request at the head of the ORQ.
    AtomicResponse {
        original: u64,
    },
}

/// A fault found in the header, reported after the CRC check.
#[derive(Debug, Clone, Copy)]
struct Deferred {
    fault: Fault,
    target: FaultTarget,
}

/// Which WR the fault completes with a specific status (others are flushed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FaultTarget {
    None,
    /// The receive WR in use.
    Recv(WcStatus),
    /// The RDMA Read at the head of the ORQ.
    Read(WcStatus),
}

#[derive(Debug)]
pub(crate) struct RxState {
    phase: Phase,
    hdr: [u8; HDR_CAP],
    hdr_have: usize,
    hdr_need: usize,
    trailer: [u8; 8],
    tr_have: usize,
    tr_need: usize,
    scratch: [u8; SCRATCH],
    crc_on: bool,
    crc: u32,
    max_ulpdu: usize,
    ulpdu_len: usize,
    payload_len: usize,
    payload_done: usize,
    plan: Plan,
    /// The memory the last tagged FPDU (Write or Read Response) was placed in, kept for the
    /// next one of the same `Qp::recv_from` call: a run of FPDUs into one region then takes
    /// and drops no reference per FPDU (two locked instructions, each waiting for the
    /// stores of the payload copy before it). Every FPDU is still validated against the
    /// STag table; this is dropped when the call returns, so it never outlives a call (a
    /// deregistered region's release waits for no peer).
    held: Option<Arc<MrMemory>>,
    deferred: Option<Deferred>,
    /// RTR responder with a zero-length Send RTR: the first Send is the RTR.
    swallow_rtr_send: bool,
    /// Marker tracking of the received stream.
    mk: RxMarkers,
    /// Bytes of the RDMA Write message being received.
    write_len: u64,
    /// Length of the last complete RDMA Write message, until an untagged queue 0 message
    /// (Send or Immediate Data) ends: an Immediate Data message then completes a Write with
    /// Immediate.
    last_write: Option<u64>,
    /// The first bytes (control fields, reserved field, queue number) of the header of a
    /// whole Send and of a whole Send with Solicited Event, as the codec emits them: what
    /// [`Qp::rx_small_send`] accepts.
    send_templates: [[u8; codec::SEND_PREFIX_LEN]; 2],
    /// The same for a segment that is not its message's last (Last flag clear): with
    /// `send_templates`, what [`Qp::send_segment_plan`] accepts.
    segment_templates: [[u8; codec::SEND_PREFIX_LEN]; 2],
    /// Recent messages were large: [`Qp::recv_from`] stages only a header's worth behind
    /// each read, so that their payloads land without a copy (see [`RxState::note_fpdu`]).
    pub(crate) big: bool,
    /// Messages in a row, since the last large payload, whose first FPDU was small.
    small_starts: u8,
    /// The last FPDU ended its message (DDP Last flag): the next one starts a message.
    prev_last: bool,
    /// Stream offset of the first FPDU of the Send message being received, until its first
    /// large FPDU gives [`RxState::early`] (`None` once a message is not a Send).
    early_start: Option<u64>,
    /// Where the first large payload of the last large Send message was (see [`EarlyRead`]).
    early: Option<EarlyLayout>,
    /// Large Send messages in a row with the layout `early`: from two on, the next message
    /// is read early.
    early_run: u8,
    /// The message in progress after an FPDU of it that did not end it (see [`RxRun`]);
    /// `None` once any other header is processed.
    run: Option<RxRun>,
}

/// Where a Send message's first large payload was: `lead` stream bytes after the message's
/// first byte (its leading FPDUs and its own header), at message offset `mo`, `len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct EarlyLayout {
    lead: usize,
    mo: u64,
    len: usize,
}

/// An early read (see [`Qp::early_read`]): the next message is expected to be a Send laid
/// out as the last ones were, so its first large payload is read straight into the posted
/// receive that Send will take, in the same read as its leading FPDUs and header (`lead`
/// bytes, read into the staging buffer). The header confirms it, or the bytes are copied
/// out again (`rx_early_missed_bytes`).
#[derive(Debug)]
pub(crate) struct EarlyRead {
    /// Bytes of staging before the payload.
    pub(crate) lead: usize,
    /// The receive buffer's memory, held until the header decided.
    pub(crate) memory: Arc<MrMemory>,
    /// Offset in `memory.region()` of the payload's first byte.
    pub(crate) offset: usize,
    /// Payload bytes read there at most.
    pub(crate) len: usize,
    /// The payload's message offset, and the message's MSN.
    mo: u64,
    msn: u32,
}

/// Offset of the MSN and of the MO in an untagged header.
const UNTAGGED_MSN: usize = codec::UNTAGGED_MSN_OFFSET;
const UNTAGGED_MO: usize = UNTAGGED_MSN + 4;
/// Bytes of a tagged header before its TO: control fields and STag.
const TAGGED_TO: usize = 6;

/// The kind of message a [`RxRun`] continues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunKind {
    Write,
    ReadResponse,
    Send,
}

/// A message whose FPDU just taken did not end it (DDP Last flag clear): what the header of
/// its next FPDU is, so that [`Qp::rx_run_fpdu`] can take that FPDU by comparing bytes
/// instead of parsing them (a 64 KiB message over a 1500-byte MTU is 46 FPDUs).
#[derive(Debug, Clone, Copy)]
struct RxRun {
    kind: RunKind,
    /// The header's bytes (after the MPA length) before its offset field: control fields
    /// and STag of a tagged header (the first [`TAGGED_TO`] bytes), or control fields,
    /// reserved field, queue number and MSN of an untagged one (all of them).
    fixed: [u8; UNTAGGED_MO],
    /// The offset field's value the next FPDU must carry: its TO (tagged) or MO (untagged),
    /// where the FPDU before it ended.
    next: u64,
}

/// Where the received stream's markers are, relative to the FPDU being received.
#[derive(Debug)]
struct RxMarkers {
    /// The peer sends markers.
    on: bool,
    /// Stream offset of the current FPDU's first octet.
    fpdu_offset: u64,
    /// Wire octets of the current FPDU consumed so far (markers included).
    wire_pos: usize,
    /// The current FPDU's layout: of the shortest FPDU until ULPDU_Length is known.
    layout: Option<MarkerLayout>,
    /// Markers of `layout` after `next`.
    rest: Option<Markers>,
    /// The next marker at or after `wire_pos`.
    next: Option<Marker>,
    buf: [u8; MARKER_LEN],
    have: usize,
}

impl RxMarkers {
    fn new() -> Self {
        RxMarkers {
            on: false,
            fpdu_offset: 0,
            wire_pos: 0,
            layout: None,
            rest: None,
            next: None,
            buf: [0; MARKER_LEN],
            have: 0,
        }
    }

    /// Uses `layout` for the current FPDU: the next marker is its first one not yet passed.
    fn set_layout(&mut self, layout: Option<MarkerLayout>) {
        self.layout = layout;
        let mut rest = layout.map(|l| l.markers());
        let pos = self.wire_pos;
        self.next = rest
            .as_mut()
            .and_then(|it| it.by_ref().find(|m| m.wire_offset >= pos));
        self.rest = rest;
    }

    /// A new FPDU starts at `fpdu_offset`: until its ULPDU_Length is read, the layout of the
    /// shortest FPDU tells whether a marker comes first.
    fn start_fpdu(&mut self) {
        self.wire_pos = 0;
        self.have = 0;
        if self.on {
            self.set_layout(codec::marker_layout(
                self.fpdu_offset,
                codec::SHORTEST_FPDU_LEN,
            ));
        } else {
            self.set_layout(None);
        }
    }

    /// True when the next bytes are (the rest of) a marker.
    fn due(&self) -> bool {
        self.next.is_some_and(|m| m.wire_offset == self.wire_pos)
    }

    /// Bytes that may be read before the next marker.
    fn room(&self) -> usize {
        self.next
            .map_or(usize::MAX, |m| m.wire_offset.saturating_sub(self.wire_pos))
    }
}

impl RxState {
    pub(crate) fn new() -> Self {
        Self {
            phase: Phase::Closed,
            hdr: [0; HDR_CAP],
            hdr_have: 0,
            hdr_need: FIRST_READ,
            trailer: [0; 8],
            tr_have: 0,
            tr_need: 0,
            scratch: [0; SCRATCH],
            crc_on: false,
            crc: 0,
            max_ulpdu: 65535,
            ulpdu_len: 0,
            payload_len: 0,
            payload_done: 0,
            plan: Plan::Discard,
            held: None,
            deferred: None,
            swallow_rtr_send: false,
            mk: RxMarkers::new(),
            write_len: 0,
            last_write: None,
            send_templates: codec::send_prefixes(true),
            segment_templates: codec::send_prefixes(false),
            big: false,
            small_starts: 0,
            prev_last: true,
            early_start: None,
            early: None,
            early_run: 0,
            run: None,
        }
    }

    /// Keeps [`RxState::big`], the staging hint of [`Qp::recv_from`], for an FPDU whose
    /// header arrived: a payload of [`BIG_PAYLOAD`] bytes or more sets it; it is cleared
    /// only by the second message in a row whose first FPDU is small. The small last FPDU
    /// of a large message (the 15 bytes left of a 64 KiB Write by 65,535-byte FPDUs) and a
    /// lone small message between large ones leave it set: otherwise the next large
    /// message's first FPDU would be read ahead into the staging buffer and copied out of
    /// it (64 KiB per message; BENCHMARKS.md, issue 18). A hint only: it decides how much is
    /// read ahead, never where a byte goes.
    fn note_fpdu(&mut self, payload_len: usize, last: bool) {
        if payload_len >= BIG_PAYLOAD {
            self.big = true;
            self.small_starts = 0;
        } else if self.prev_last && self.big {
            self.small_starts = self.small_starts.saturating_add(1);
            if self.small_starts >= 2 {
                self.big = false;
            }
        }
        self.prev_last = last;
    }

    pub(crate) fn on_establish(&mut self, s: &StreamConfig) {
        self.crc_on = s.crc;
        self.mk.on = s.receives_markers();
        self.mk.fpdu_offset = s.rx_stream_offset;
        self.max_ulpdu = s.max_rx_ulpdu;
        self.swallow_rtr_send = s
            .rtr
            .is_some_and(|r| !r.initiator && r.kind == RtrKind::Send);
        self.start_fpdu();
    }

    /// True while part of an FPDU has arrived and the rest has not (the peer owes bytes).
    /// An FPDU whose header is complete and that waits for an SRQ receive is not: the wait
    /// is on this side.
    pub(crate) fn in_fpdu(&self) -> bool {
        match self.phase {
            Phase::Header => self.hdr_have > 0,
            Phase::Payload | Phase::Trailer => true,
            Phase::Closed | Phase::HeaderReady => false,
        }
    }

    pub(crate) fn close(&mut self) {
        self.phase = Phase::Closed;
        self.plan = Plan::Discard;
        self.deferred = None;
        self.run = None;
    }

    #[inline]
    fn start_fpdu(&mut self) {
        self.phase = Phase::Header;
        self.hdr_have = 0;
        self.hdr_need = FIRST_READ;
        self.tr_have = 0;
        self.tr_need = 0;
        self.crc = 0;
        self.ulpdu_len = 0;
        self.payload_len = 0;
        self.payload_done = 0;
        self.plan = Plan::Discard;
        self.deferred = None;
        self.mk.start_fpdu();
    }

    fn defer(&mut self, fault: Fault, target: FaultTarget) {
        if self.deferred.is_none() {
            self.deferred = Some(Deferred { fault, target });
        }
        self.plan = Plan::Discard;
    }

    /// A reference to `mem`, just validated, for a tagged placement: the one [`RxState::held`]
    /// from the FPDU before when it is the same memory, else a new one.
    #[inline(always)]
    fn lend(&mut self, mem: &Arc<MrMemory>) -> Arc<MrMemory> {
        match self.held.take() {
            Some(h) if Arc::ptr_eq(&h, mem) => h,
            _ => Arc::clone(mem),
        }
    }

    /// Drops the reference kept between tagged FPDUs (at the end of every receive call).
    #[inline]
    pub(crate) fn let_go(&mut self) {
        self.held = None;
    }
}

/// The new value of an atomic's target word that held `old` (RFC 7306 masked semantics).
fn atomic_result(req: &AtomicRequestRepr, old: u64) -> u64 {
    match req.opcode {
        //= https://www.rfc-editor.org/rfc/rfc7306#section-6
        // (paraphrase) FetchAdd adds Add Data to the target; each bit set in the Add Mask
        // ends a field, and the carry out of it is not propagated into the next field (an
        // Add Mask of zero is a plain 64-bit add).
        AtomicOpcode::FetchAdd => masked_add(old, req.add_or_swap_data, req.add_or_swap_mask),
        //= https://www.rfc-editor.org/rfc/rfc7306#section-6
        // (paraphrase) CmpSwap compares the target with Compare Data on the bits set in
        // Compare Mask; when they match, the bits set in Swap Mask are replaced with those of
        // Swap Data.
        AtomicOpcode::CmpSwap => {
            if (old ^ req.compare_data) & req.compare_mask == 0 {
                (old & !req.add_or_swap_mask) | (req.add_or_swap_data & req.add_or_swap_mask)
            } else {
                old
            }
        }
        AtomicOpcode::Unknown(_) => old,
    }
}

/// `a + b` where each bit set in `boundaries` ends a field: no carry leaves a field.
fn masked_add(a: u64, b: u64, boundaries: u64) -> u64 {
    if boundaries == 0 {
        return a.wrapping_add(b);
    }
    let mut sum = 0u64;
    let mut carry = 0u64;
    for bit in 0..64 {
        let s = ((a >> bit) & 1) + ((b >> bit) & 1) + carry;
        sum |= (s & 1) << bit;
        carry = if (boundaries >> bit) & 1 == 1 {
            0
        } else {
            s >> 1
        };
    }
    sum
}

/// A completion's byte length (32 bits, as in verbs) for `n` bytes received. A receive WR
/// holds at most 2^32 - 1 bytes (`post_recv` refuses longer ones), so a Send's length always
/// fits; the length of an RDMA Write message completed by Immediate Data is not bounded by a
/// receive WR and is reported as 2^32 - 1 when it is longer.
fn wc_byte_len(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The first `room` bytes of `b` (the part before the next marker) as a target.
fn cut(b: &mut [u8], room: usize) -> RxTarget<'_> {
    let n = b.len().min(room);
    match b.get_mut(..n) {
        Some(b) => RxTarget::Buffer(b),
        None => RxTarget::Closed,
    }
}

/// Validates a receive WR's scatter element for a Send's payload: local write access to
/// registered memory of protection domain `pd`. The memory and the offset of the element's
/// first byte in its region.
#[inline]
fn recv_sge<'m>(
    mrs: &'m MrTable,
    pd: PdId,
    sge: &Sge,
) -> Result<(&'m Arc<MrMemory>, usize), AccessError> {
    mrs.validate_borrowed(
        sge.lkey,
        pd,
        Access::LOCAL_WRITE,
        sge.addr,
        u64::from(sge.length),
    )
}

/// The piece of a receive WR's SGL at message offset `msg_off` (at most `max` bytes).
#[inline]
fn recv_piece(msg: &RxMsg, msg_off: u64, max: usize) -> Option<(&Arc<MrMemory>, usize, usize)> {
    let mut base = 0u64;
    for (sge, m) in msg.wr.sgl.as_slice().iter().zip(msg.mem.iter()) {
        let l = u64::from(sge.length);
        if msg_off < base + l {
            let within = msg_off - base;
            let v = m.as_ref()?;
            let take = usize::try_from((l - within).min(max as u64)).ok()?;
            return Some((
                &v.memory,
                v.region_offset + usize::try_from(within).ok()?,
                take,
            ));
        }
        base += l;
    }
    None
}

impl Qp {
    /// Where the next received bytes must go (see [`RxTarget`]). At most that many bytes
    /// are read there, then committed with [`Qp::rx_commit`].
    ///
    /// The length offered is kept for the commit that answers it (the next
    /// [`Qp::rx_commit`] refuses more) instead of being worked out again there.
    pub(crate) fn rx_target(&mut self) -> RxTarget<'_> {
        let target = Self::target_of(&mut self.rx, &self.rx_msg);
        self.rx_offered = match &target {
            RxTarget::Buffer(b) => b.len(),
            RxTarget::Region { len, .. } => *len,
            RxTarget::Blocked | RxTarget::Closed => 0,
        };
        target
    }

    /// [`Qp::rx_target`]'s place, from the receive state and the receive WR in use.
    fn target_of<'a>(rx: &'a mut RxState, rx_msg: &'a Option<RxMsg>) -> RxTarget<'a> {
        if matches!(rx.phase, Phase::Header | Phase::Payload | Phase::Trailer) && rx.mk.due() {
            return match rx.mk.buf.get_mut(rx.mk.have..) {
                Some(b) => RxTarget::Buffer(b),
                None => RxTarget::Closed,
            };
        }
        // Stop at the next marker position.
        let room = rx.mk.room();
        match rx.phase {
            Phase::Closed => RxTarget::Closed,
            Phase::HeaderReady => RxTarget::Blocked,
            Phase::Header => match rx.hdr.get_mut(rx.hdr_have..rx.hdr_need) {
                Some(b) => cut(b, room),
                None => RxTarget::Closed,
            },
            Phase::Trailer => match rx.trailer.get_mut(rx.tr_have..rx.tr_need) {
                Some(b) => cut(b, room),
                None => RxTarget::Closed,
            },
            Phase::Payload => {
                let remaining = (rx.payload_len - rx.payload_done).min(room);
                match &rx.plan {
                    Plan::Write {
                        mem: Some(mem),
                        off,
                        ..
                    }
                    | Plan::ReadResponse {
                        mem: Some(mem),
                        off,
                        ..
                    } => RxTarget::Region {
                        region: mem.region(),
                        offset: off + rx.payload_done,
                        len: remaining,
                    },
                    Plan::Send { .. } => {
                        match rx_msg
                            .as_ref()
                            .and_then(|m| recv_piece(m, m.received, remaining))
                        {
                            Some((mem, offset, len)) => RxTarget::Region {
                                region: mem.region(),
                                offset,
                                len,
                            },
                            None => RxTarget::Closed,
                        }
                    }
                    _ => {
                        let n = remaining.min(SCRATCH);
                        match rx.scratch.get_mut(..n) {
                            Some(b) => cut(b, room),
                            None => RxTarget::Closed,
                        }
                    }
                }
            }
        }
    }

    /// Reports that `n` bytes were read into the place the last [`Qp::rx_target`] named.
    /// Processes what became complete (header validation, delivery after the CRC check),
    /// with the STag table and SRQ from `res`. `n == 0` retries a blocked header.
    pub(crate) fn rx_commit(
        &mut self,
        n: usize,
        res: &mut impl RxResources,
    ) -> Result<(), QpError> {
        if n == 0 {
            if self.rx.phase == Phase::HeaderReady {
                let (mrs, srq) = res.get();
                self.process_header(mrs, srq);
            }
            return Ok(());
        }
        // What the last `rx_target` offered, once: a commit without a new target is refused.
        let offered = std::mem::take(&mut self.rx_offered);
        if n > offered {
            return Err(QpError::CommitTooLong {
                committed: n,
                offered,
            });
        }
        self.stats.rx_stream_bytes += n as u64;
        if matches!(
            self.rx.phase,
            Phase::Header | Phase::Payload | Phase::Trailer
        ) && self.rx.mk.due()
        {
            self.marker_bytes(n);
            return Ok(());
        }
        self.rx.mk.wire_pos += n;
        match self.rx.phase {
            Phase::Header => {
                let (from, to) = (self.rx.hdr_have, self.rx.hdr_have + n);
                if self.rx.crc_on {
                    let bytes = self.rx.hdr.get(from..to).unwrap_or(&[]);
                    self.rx.crc = softwarp_wire::crc::crc32c_append(self.rx.crc, bytes);
                }
                self.rx.hdr_have = to;
                if self.rx.hdr_have == self.rx.hdr_need {
                    let (mrs, srq) = res.get();
                    self.on_header_bytes(mrs, srq);
                }
            }
            Phase::Payload => {
                self.payload_crc(n);
                self.rx.payload_done += n;
                if matches!(self.rx.plan, Plan::Send { .. }) {
                    if let Some(m) = self.rx_msg.as_mut() {
                        m.received += n as u64;
                    }
                }
                if self.rx.payload_done == self.rx.payload_len {
                    self.enter_trailer();
                }
            }
            Phase::Trailer => self.trailer_bytes(n, res),
            Phase::HeaderReady | Phase::Closed => {}
        }
        Ok(())
    }

    /// `n` more trailer bytes are in `rx.trailer` (after `tr_have`): the pad among them is
    /// fed to the CRC, and a complete trailer finishes the FPDU.
    fn trailer_bytes(&mut self, n: usize, res: &mut impl RxResources) {
        if self.rx.crc_on {
            // The pad is CRC-covered and may precede a marker: feed it in order.
            let pad = codec::pad_len(self.rx.ulpdu_len);
            let (from, to) = (self.rx.tr_have, (self.rx.tr_have + n).min(pad));
            if from < to {
                let bytes = self.rx.trailer.get(from..to).unwrap_or(&[]);
                self.rx.crc = softwarp_wire::crc::crc32c_append(self.rx.crc, bytes);
            }
        }
        self.rx.tr_have += n;
        if self.rx.tr_have == self.rx.tr_need {
            self.finish_fpdu(res.get().0);
        }
    }

    /// Takes the rest of the current FPDU's trailer from the start of `bytes` (bytes read
    /// ahead) in one step, as [`Qp::rx_target`] and [`Qp::rx_commit`] of those bytes would:
    /// the FPDU is then checked and delivered. Returns the bytes taken; `None`, with
    /// nothing changed, when the FPDU is not in its trailer, `bytes` does not hold the
    /// rest of it, or the stream carries markers (one may come first).
    pub(crate) fn rx_staged_trailer(
        &mut self,
        bytes: &[u8],
        res: &mut impl RxResources,
    ) -> Option<usize> {
        let rx = &mut self.rx;
        if rx.phase != Phase::Trailer || rx.mk.on {
            return None;
        }
        let n = rx.tr_need.checked_sub(rx.tr_have).filter(|&n| n > 0)?;
        let (dst, src) = (rx.trailer.get_mut(rx.tr_have..rx.tr_need)?, bytes.get(..n)?);
        // The trailer is kept for the CRC check only (`trailer_bytes`, `finish_fpdu`).
        if rx.crc_on {
            dst.copy_from_slice(src);
        }
        rx.mk.wire_pos += n;
        self.stats.rx_stream_bytes += n as u64;
        // The bytes are taken here: no earlier offer stands.
        self.rx_offered = 0;
        self.trailer_bytes(n, res);
        Some(n)
    }

    /// True when the next received byte starts an FPDU that [`Qp::rx_whole_fpdu`] may take
    /// (no markers, no SRQ): [`Qp::recv_from`] then reads ahead into the staging buffer
    /// only, instead of into [`Qp::rx_target`]'s first four bytes of the header.
    pub(crate) fn rx_expects_whole_fpdu(&self) -> bool {
        self.rx.phase == Phase::Header
            && self.rx.hdr_have == 0
            && !self.rx.mk.on
            && !self.cfg.use_srq
    }

    /// Receives one whole FPDU from the start of `bytes` (bytes read ahead) in
    /// one step, instead of the four target/commit rounds (length, header, payload,
    /// trailer) of [`Qp::rx_target`] and [`Qp::rx_commit`]: the header is copied into the
    /// QP and validated as usual, the payload is copied to its destination, and the CRC is
    /// computed over the FPDU in one pass over `bytes` (the same bytes that were placed).
    /// Delivery is the same as on the step-by-step path, CRC check first.
    ///
    /// When `bytes` holds the FPDU's header but not all of the FPDU, takes the header
    /// alone the same way (copied, CRC fed, validated) and returns its length: the payload
    /// and trailer then go through [`Qp::rx_target`] and [`Qp::rx_commit`].
    ///
    /// Returns the FPDU's (or the header's) length when it did so; `None`, with nothing
    /// changed, when this path does not apply: `bytes` does not start a new FPDU or does
    /// not hold its header, the stream carries markers, the QP receives from an SRQ (which
    /// may hold a header back), or the header is not a fixed-length one (a Terminate). The
    /// caller then uses [`Qp::rx_target`] and [`Qp::rx_commit`], which handle every case.
    pub(crate) fn rx_whole_fpdu(
        &mut self,
        bytes: &[u8],
        res: &mut impl RxResources,
    ) -> Option<usize> {
        let rx = &self.rx;
        if rx.phase != Phase::Header || rx.hdr_have != 0 || rx.mk.on || self.cfg.use_srq {
            return None;
        }
        if rx.run.is_some() {
            if let Some(total) = self.rx_run_fpdu(bytes, res.get().0) {
                return Some(total);
            }
        }
        if let Some(total) = self.rx_small_send(bytes, res.get().0) {
            return Some(total);
        }
        let ulpdu_len = codec::mpa_len(bytes);
        let total = codec::fpdu_len(ulpdu_len);
        let (&ddp_ctrl, &rdmap_ctrl) = (bytes.get(2)?, bytes.get(3)?);
        if ulpdu_len < codec::TAGGED_HEADER_LEN {
            return None;
        }
        let codec::HeaderLen::Fixed(h) = codec::rx_header_len(ddp_ctrl, rdmap_ctrl) else {
            return None;
        };
        let hdr_len = 2 + h.min(ulpdu_len);
        let pad = codec::pad_len(ulpdu_len);
        if hdr_len > HDR_CAP {
            return None;
        }
        let hdr = bytes.get(..hdr_len)?;
        // The whole FPDU, or (None) its header only.
        let whole = match bytes.get(..total) {
            Some(fpdu) => {
                let rest = fpdu.get(hdr_len..)?;
                let (payload, trailer) = rest.split_at_checked(ulpdu_len + 2 - hdr_len)?;
                if trailer.len() != pad + 4 {
                    return None;
                }
                Some((fpdu, payload, trailer))
            }
            None => None,
        };
        let taken = if whole.is_some() { total } else { hdr_len };
        // Header: as `rx_commit` would leave it after the header bytes.
        self.stats.rx_stream_bytes += taken as u64;
        // The bytes are taken here: no earlier offer stands.
        self.rx_offered = 0;
        let rx = &mut self.rx;
        if let Some(dst) = rx.hdr.get_mut(..hdr_len) {
            dst.copy_from_slice(hdr);
        }
        rx.hdr_have = hdr_len;
        rx.hdr_need = hdr_len;
        rx.ulpdu_len = ulpdu_len;
        rx.mk.wire_pos = taken;
        if ulpdu_len > rx.max_ulpdu {
            rx.defer(Fault::BadUlpduLength, FaultTarget::None);
        }
        rx.payload_len = ulpdu_len + 2 - hdr_len;
        rx.payload_done = 0;
        let Some((fpdu, payload, trailer)) = whole else {
            // Only the header is here: it is validated now, in one step instead of two
            // target/commit rounds (length, then the rest of the header); its payload and
            // trailer follow through `rx_target` and `rx_commit`.
            if rx.crc_on {
                rx.crc = crate::memory::crc32c_append(0, hdr);
            }
            self.process_header(res.get().0, None);
            return Some(hdr_len);
        };
        self.process_header(res.get().0, None);
        // Payload: straight to where the plan says.
        let placed = match &self.rx.plan {
            Plan::Write {
                mem: Some(mem),
                off,
                ..
            }
            | Plan::ReadResponse {
                mem: Some(mem),
                off,
                ..
            } => {
                let ok = mem.region().write_at(*off, payload).is_ok();
                if ok {
                    self.stats.rx_staged_payload_bytes += payload.len() as u64;
                }
                ok
            }
            Plan::Send { .. } => {
                let at = self.place_send(payload);
                if let Some(m) = self.rx_msg.as_mut() {
                    m.received += at as u64;
                }
                self.stats.rx_staged_payload_bytes += at as u64;
                at == payload.len()
            }
            // Discarded (a header that failed validation) or no payload.
            _ => true,
        };
        if !placed {
            // The plan named memory it cannot write: an engine bug, not the peer's doing.
            self.rx.defer(Fault::DdpCatastrophic, FaultTarget::None);
        }
        // Trailer: pad and CRC, with the CRC over everything before the CRC field.
        let rx = &mut self.rx;
        rx.payload_done = rx.payload_len;
        rx.phase = Phase::Trailer;
        rx.tr_need = pad + 4;
        rx.tr_have = rx.tr_need;
        // The trailer is kept for the CRC check only (`finish_fpdu`).
        if rx.crc_on {
            if let Some(dst) = rx.trailer.get_mut(..trailer.len()) {
                dst.copy_from_slice(trailer);
            }
            let covered = fpdu.get(..total - 4).unwrap_or(&[]);
            rx.crc = crate::memory::crc32c_append(0, covered);
        }
        self.finish_fpdu(res.get().0);
        Some(total)
    }

    /// Copies `payload` into the receive WR of the Send message in progress, from the
    /// message's next byte on (`RxMsg::received`, not moved here); returns how many bytes
    /// went in: all of them unless a piece failed or the WR has no room left.
    fn place_send(&self, payload: &[u8]) -> usize {
        let Some(m) = self.rx_msg.as_ref() else {
            return 0;
        };
        let mut at = 0;
        while let Some(rest) = payload.get(at..).filter(|r| !r.is_empty()) {
            let Some((mem, off, len)) = recv_piece(m, m.received + at as u64, rest.len()) else {
                break;
            };
            let src = rest.get(..len).unwrap_or(&[]);
            if len == 0 || mem.region().write_at(off, src).is_err() {
                break;
            }
            at += len;
        }
        at
    }

    /// [`Qp::rx_whole_fpdu`]'s path for the middle FPDUs of a message (a run): the FPDU at
    /// the start of `bytes` continues the Write, Read Response or Send whose FPDU before it
    /// did not end it (`RxState::run`), and is not its last either. Its header is accepted
    /// only when its bytes are exactly the ones the general path accepted for the FPDU
    /// before, with the offset field moved on by that FPDU's payload (so no field needs
    /// parsing), and the payload is under [`BIG_PAYLOAD`] bytes (as a 1500-byte MTU's are;
    /// larger ones are read into their destinations, not staged). Each FPDU is still validated as the
    /// general path does: a Write's or Read Response's STag, rights and bounds against the
    /// STag table (an STag deregistered or invalidated since the FPDU before fails here),
    /// a Read Response against the ORQ, a Send against its receive WR's room; and its CRC
    /// is checked before a byte is placed. Anything else (the message's last FPDU, any
    /// other header byte, a failed check, a CRC mismatch) returns `None` with nothing
    /// changed, and the general path takes the FPDU and reports what is wrong with it.
    ///
    /// Why: parsing, planning and finishing an FPDU on the general path costs about 500
    /// instructions on top of its copy (callgrind, `examples/msgrate --fpdu 1460`).
    #[inline(never)]
    fn rx_run_fpdu(&mut self, bytes: &[u8], mrs: &MrTable) -> Option<usize> {
        let run = self.rx.run?;
        let ulpdu_len = codec::mpa_len(bytes);
        if ulpdu_len > self.rx.max_ulpdu {
            return None;
        }
        let total = codec::fpdu_len(ulpdu_len);
        let fpdu = bytes.get(..total)?;
        let ulpdu = fpdu.get(2..2 + ulpdu_len)?;
        let hdr_len = if run.kind == RunKind::Send {
            codec::UNTAGGED_HEADER_LEN
        } else {
            codec::TAGGED_HEADER_LEN
        };
        let (hdr, payload) = ulpdu.split_at_checked(hdr_len)?;
        let len = payload.len();
        if len == 0 || len >= BIG_PAYLOAD {
            return None;
        }
        // Fixed-size compares (a few word compares, no `memcmp` call).
        let (fixed, next) = if run.kind == RunKind::Send {
            let (fixed, mo) = hdr.split_first_chunk::<UNTAGGED_MO>()?;
            if *fixed != run.fixed {
                return None;
            }
            (
                &fixed[..],
                u64::from(u32::from_be_bytes(mo.try_into().ok()?)),
            )
        } else {
            let (fixed, to) = hdr.split_first_chunk::<TAGGED_TO>()?;
            if Some(fixed) != run.fixed.first_chunk::<TAGGED_TO>() {
                return None;
            }
            (&fixed[..], u64::from_be_bytes(to.try_into().ok()?))
        };
        if next != run.next {
            return None;
        }
        if self.rx.crc_on {
            let (covered, field) = fpdu.split_at_checked(total.checked_sub(4)?)?;
            let wire: [u8; 4] = field.try_into().ok()?;
            if codec::crc_from_wire(wire) != crate::memory::crc32c_append(0, covered) {
                return None;
            }
        }
        let seg = len as u64;
        match run.kind {
            RunKind::Write | RunKind::ReadResponse => {
                let stag = Stag(u32::from_be_bytes(fixed.get(2..6)?.try_into().ok()?));
                let access = if run.kind == RunKind::Write {
                    Access::REMOTE_WRITE
                } else {
                    // As `plan`: the Read at the head of the ORQ, this far along.
                    let head = self.orq.front().filter(|h| h.atomic.is_none())?;
                    if stag.0 != head.sink_stag
                        || next != head.sink_to.wrapping_add(head.received)
                        || head.received + seg > head.len
                    {
                        return None;
                    }
                    Access::LOCAL_WRITE
                };
                let (mem, off) = mrs
                    .validate_borrowed(stag, self.cfg.pd, access, next, seg)
                    .ok()?;
                let mem = self.rx.lend(mem);
                let placed = mem.region().write_at(off, payload).is_ok();
                self.rx.held = Some(mem);
                if !placed {
                    return None;
                }
                if run.kind == RunKind::Write {
                    self.stats.rx.write.bytes += seg;
                    self.rx.write_len += seg;
                } else {
                    self.stats.rx.read_response.bytes += seg;
                    if let Some(head) = self.orq.front_mut() {
                        head.received += seg;
                    }
                }
            }
            RunKind::Send => {
                let m = self.rx_msg.as_ref()?;
                if m.received != next || m.received + seg > m.capacity {
                    return None;
                }
                if self.place_send(payload) != len {
                    return None;
                }
                if let Some(m) = self.rx_msg.as_mut() {
                    m.received += seg;
                }
                self.stats.rx.send.bytes += seg;
            }
        }
        // What the general path's header, payload and trailer steps record for such an
        // FPDU (its staging hint and early-read layout do not change: a payload under
        // `BIG_PAYLOAD` in the middle of a message).
        self.stats.rx_stream_bytes += total as u64;
        self.stats.rx_staged_payload_bytes += seg;
        self.stats.rx_fpdus += 1;
        self.stats.rx_run_fpdus += 1;
        self.rx_offered = 0;
        self.rx.mk.fpdu_offset = self.rx.mk.fpdu_offset.wrapping_add(total as u64);
        self.tx.gate_until_rx = false;
        if let Some(r) = self.rx.run.as_mut() {
            r.next = next + seg;
        }
        Some(total)
    }

    /// [`Qp::rx_whole_fpdu`]'s path for the commonest FPDU of small messages, tried first on
    /// the FPDU at the start of `bytes` (returns its length when it took it): a whole
    /// untagged Send (or Send with Solicited Event) that is a message by itself (Last set,
    /// MO 0) with the next MSN of queue 0, for the receive WR at the head of the RQ whose
    /// SGEs validate and hold it. The header is accepted only when its bytes are exactly
    /// those the codec emits for such a Send (so every field the general path checks has
    /// its one valid value), and the CRC is checked before anything is placed. Anything else
    /// (another message, any other header byte, a CRC mismatch, a message in progress, no
    /// receive WR, one too small or whose SGEs do not validate) returns `None` before any
    /// state changed, and the general path takes the FPDU and reports what is wrong with it
    /// as before. (A receive WR whose later SGE fails validation may have had its first
    /// SGEs written; it then completes in error, when its buffer's content is undefined.)
    ///
    /// The tests that turn most other FPDUs away (a message in progress, a DDP control byte
    /// no whole Send has) are made here, in the caller's frame; the rest out of line.
    #[inline(always)]
    fn rx_small_send(&mut self, bytes: &[u8], mrs: &MrTable) -> Option<usize> {
        let rx = &self.rx;
        if self.rx_msg.is_some() || rx.swallow_rtr_send || rx.deferred.is_some() {
            return None;
        }
        let ddp_control = bytes.get(2)?;
        if !rx
            .send_templates
            .iter()
            .any(|t| t.first() == Some(ddp_control))
        {
            return None;
        }
        self.rx_small_send_rest(bytes, mrs)
    }

    /// [`Qp::rx_small_send`] once its first tests passed.
    #[inline(never)]
    fn rx_small_send_rest(&mut self, bytes: &[u8], mrs: &MrTable) -> Option<usize> {
        let rx = &self.rx;
        let ulpdu_len = codec::mpa_len(bytes);
        if ulpdu_len < codec::UNTAGGED_HEADER_LEN || ulpdu_len > rx.max_ulpdu {
            return None;
        }
        let fpdu = bytes.get(..codec::fpdu_len(ulpdu_len))?;
        let msn = self.rx_msn[0];
        let hdr = fpdu.get(2..2 + codec::UNTAGGED_HEADER_LEN)?;
        let prefix = hdr.get(..codec::SEND_PREFIX_LEN)?;
        // Template 1 is the Send with Solicited Event.
        let solicited = rx.send_templates.iter().position(|t| t == prefix)? == 1;
        if hdr.get(UNTAGGED_MSN..UNTAGGED_MO)? != msn.to_be_bytes()
            || hdr.get(UNTAGGED_MO..)? != [0u8; 4]
        {
            return None;
        }
        let payload = fpdu.get(2 + codec::UNTAGGED_HEADER_LEN..2 + ulpdu_len)?;
        if rx.crc_on {
            let (covered, field) = fpdu.split_at_checked(fpdu.len().checked_sub(4)?)?;
            let wire: [u8; 4] = field.try_into().ok()?;
            if codec::crc_from_wire(wire) != crate::memory::crc32c_append(0, covered) {
                return None;
            }
        }
        let wr = self.rq.front()?;
        if (payload.len() as u64) > wr.sgl.total_len() {
            return None;
        }
        let mut at = 0;
        for sge in wr.sgl.as_slice() {
            if at == payload.len() {
                break;
            }
            if sge.length == 0 {
                continue;
            }
            let (memory, offset) = recv_sge(mrs, self.cfg.pd, sge).ok()?;
            let n = (sge.length as usize).min(payload.len() - at);
            memory
                .region()
                .write_at(offset, payload.get(at..at + n)?)
                .ok()?;
            at += n;
        }
        if at != payload.len() {
            return None;
        }
        // Placed: what the general path's header, trailer and delivery steps record.
        let wr_id = self.rq.pop()?.wr_id;
        let total = fpdu.len();
        let len = payload.len() as u64;
        self.stats.rx_stream_bytes += total as u64;
        self.stats.rx_staged_payload_bytes += len;
        self.stats.rx_fpdus += 1;
        self.stats.rx.send.bytes += len;
        self.stats.rx.send.messages += 1;
        self.rx.mk.fpdu_offset = self.rx.mk.fpdu_offset.wrapping_add(total as u64);
        self.tx.gate_until_rx = false;
        self.rx_msn[0] = msn.wrapping_add(1);
        self.rx.last_write = None;
        // A whole small message: one call to the staging hint only while it is set.
        if self.rx.big {
            self.rx.note_fpdu(payload.len(), true);
        }
        self.rx.prev_last = true;
        let mut wc = self.recv_wc(wr_id, WcStatus::Success, len as u32);
        wc.solicited = solicited;
        let _ = self.rx_done.push(wc);
        Some(total)
    }

    /// `n` bytes of the marker due were read; a complete marker is checked, fed to the CRC
    /// and dropped.
    fn marker_bytes(&mut self, n: usize) {
        let mk = &mut self.rx.mk;
        mk.have += n;
        if mk.have < MARKER_LEN {
            return;
        }
        let (Some(layout), Some(expected)) = (mk.layout, mk.next) else {
            return;
        };
        let bytes = mk.buf;
        mk.have = 0;
        mk.wire_pos += MARKER_LEN;
        mk.next = mk.rest.as_mut().and_then(Iterator::next);
        self.stats.rx_markers += 1;
        if codec::check_marker(&layout, &expected, bytes).is_err() {
            self.fail(Fault::BadMarker, OffendingHeader::none());
            return;
        }
        if self.rx.crc_on {
            self.rx.crc = softwarp_wire::crc::crc32c_append(self.rx.crc, &bytes);
        }
    }

    /// CRC over the `n` payload bytes just placed (read back from where they went).
    fn payload_crc(&mut self, n: usize) {
        if !self.rx.crc_on {
            return;
        }
        let rx = &mut self.rx;
        let crc = match &rx.plan {
            Plan::Write {
                mem: Some(mem),
                off,
                ..
            }
            | Plan::ReadResponse {
                mem: Some(mem),
                off,
                ..
            } => mem
                .region()
                .crc32c_append(rx.crc, off + rx.payload_done, n)
                .unwrap_or(rx.crc),
            Plan::Send { .. } => match self
                .rx_msg
                .as_ref()
                .and_then(|m| recv_piece(m, m.received, n))
            {
                Some((mem, off, len)) => mem
                    .region()
                    .crc32c_append(rx.crc, off, len)
                    .unwrap_or(rx.crc),
                None => rx.crc,
            },
            _ => softwarp_wire::crc::crc32c_append(rx.crc, rx.scratch.get(..n).unwrap_or(&[])),
        };
        rx.crc = crc;
    }

    fn enter_trailer(&mut self) {
        self.rx.phase = Phase::Trailer;
        self.rx.tr_have = 0;
        self.rx.tr_need = codec::pad_len(self.rx.ulpdu_len) + 4;
    }

    /// The header buffer filled up to `hdr_need`.
    fn on_header_bytes(&mut self, mrs: &mut MrTable, srq: Option<&mut Srq>) {
        if self.rx.hdr_need == FIRST_READ {
            let ulpdu_len = codec::mpa_len(&self.rx.hdr);
            self.rx.ulpdu_len = ulpdu_len;
            let (ddp_ctrl, rdmap_ctrl) = (
                self.rx.hdr.get(2).copied().unwrap_or(0),
                self.rx.hdr.get(3).copied().unwrap_or(0),
            );
            if ulpdu_len < codec::TAGGED_HEADER_LEN {
                // Too short for any DDP header: the framing cannot be trusted.
                self.fail(Fault::BadUlpduLength, OffendingHeader::none());
                return;
            }
            if self.rx.mk.on {
                // The FPDU's length is known: so are all its marker positions.
                let layout =
                    codec::marker_layout(self.rx.mk.fpdu_offset, codec::fpdu_len(ulpdu_len));
                if layout.is_none() {
                    // Too long for 16-bit FPDUPTRs: no sender with markers builds this.
                    self.fail(Fault::BadUlpduLength, OffendingHeader::none());
                    return;
                }
                self.rx.mk.set_layout(layout);
            }
            let want = match codec::rx_header_len(ddp_ctrl, rdmap_ctrl) {
                codec::HeaderLen::Fixed(h) => h.min(ulpdu_len),
                codec::HeaderLen::WholeUlpdu => {
                    if ulpdu_len + 2 <= HDR_CAP {
                        ulpdu_len
                    } else {
                        self.rx.defer(Fault::RdmapCatastrophic, FaultTarget::None);
                        codec::UNTAGGED_HEADER_LEN
                    }
                }
            };
            if ulpdu_len > self.rx.max_ulpdu {
                self.rx.defer(Fault::BadUlpduLength, FaultTarget::None);
            }
            self.rx.hdr_need = 2 + want;
            if self.rx.hdr_have < self.rx.hdr_need {
                return;
            }
        }
        self.rx.payload_len = self.rx.ulpdu_len - (self.rx.hdr_need - 2);
        self.rx.payload_done = 0;
        self.process_header(mrs, srq);
    }

    /// Validates the complete header and decides where the payload goes.
    fn process_header(&mut self, mrs: &mut MrTable, srq: Option<&mut Srq>) {
        self.rx.phase = Phase::Payload;
        self.rx.run = None;
        let last = self
            .rx
            .hdr
            .get(2)
            .is_some_and(|c| c & softwarp_wire::ddp::FLAG_LAST != 0);
        let starts_message = self.rx.prev_last;
        self.rx.note_fpdu(self.rx.payload_len, last);
        if self.rx.deferred.is_some() {
            // Nothing more is read from a header whose FPDU already failed.
        } else if let Some(plan) = self.send_segment_plan() {
            self.rx.plan = plan;
        } else {
            let parsed = codec::parse_rx_header(
                self.rx.hdr.get(2..self.rx.hdr_need).unwrap_or(&[]),
                self.rx.payload_len,
                self.stream.rfc7306,
            );
            match parsed {
                Err(fault) => self.rx.defer(fault, FaultTarget::None),
                Ok(h) => {
                    if let Err((fault, target)) = self.plan(h, mrs, srq) {
                        self.rx.defer(fault, target);
                    }
                }
            }
        }
        if self.rx.phase == Phase::HeaderReady {
            return;
        }
        self.note_early_layout(starts_message);
        if self.rx.payload_len == 0 {
            self.enter_trailer();
        }
    }

    /// Keeps the layout of large Send messages for [`Qp::early_read`], from the header just
    /// planned (`starts_message`: the FPDU before it ended its message).
    #[inline]
    fn note_early_layout(&mut self, starts_message: bool) {
        let rx = &mut self.rx;
        let is_send = matches!(rx.plan, Plan::Send { .. });
        if starts_message {
            if !is_send {
                // Another kind of message: no early read until Sends come twice again.
                rx.early_start = None;
                rx.early_run = 0;
                return;
            }
            rx.early_start = Some(rx.mk.fpdu_offset);
        }
        if !is_send || rx.payload_len < BIG_PAYLOAD {
            return;
        }
        let (Some(start), Some(m)) = (rx.early_start.take(), self.rx_msg.as_ref()) else {
            return;
        };
        let payload_at = rx.mk.fpdu_offset.wrapping_add(rx.hdr_need as u64);
        let Ok(lead) = usize::try_from(payload_at.wrapping_sub(start)) else {
            return;
        };
        let layout = EarlyLayout {
            lead,
            mo: m.received,
            len: rx.payload_len,
        };
        if rx.early == Some(layout) {
            rx.early_run = rx.early_run.saturating_add(1);
        } else {
            rx.early = Some(layout);
            rx.early_run = 1;
        }
    }

    /// The early read to do next, if any: at a message boundary, after two large Send
    /// messages of one layout in a row, with a receive posted whose scatter list holds the
    /// expected payload's start (`room`: staging bytes the caller has for the lead and the
    /// tail behind the payload; the payload read is cut so that all of it fits the staging
    /// buffer if it has to be copied out again). Validates the receive's memory as
    /// [`Qp::start_recv`] will and holds it for the read.
    ///
    /// Why: a large message's first header otherwise costs a read of its own, since its
    /// payload's destination is known only from it (one more system call per message than
    /// TCP; +1.1 to +1.5 us of a 64 KiB ping-pong in the VM's slow state, BENCHMARKS.md).
    /// A Send's destination is the next posted receive, which the QP owns until it
    /// completes, so its bytes may go there before the header confirms them; a Write's
    /// destination is memory the application may be reading, so Writes are never read early.
    pub(crate) fn early_read(&self, room: usize, mrs: &MrTable) -> Option<EarlyRead> {
        let layout = self.rx.early?;
        let wr = self.rq.front()?;
        // The scatter element holding message offset `mo`.
        let mut base = 0u64;
        let sge = wr.sgl.as_slice().iter().find(|sge| {
            let end = base + u64::from(sge.length);
            let found = layout.mo < end;
            if !found {
                base = end;
            }
            found
        })?;
        let within = layout.mo - base;
        let (memory, region_offset) = recv_sge(mrs, self.cfg.pd, sge).ok()?;
        let fits = usize::try_from(u64::from(sge.length) - within).ok()?;
        let len = layout
            .len
            .min(fits)
            .min(room.checked_sub(layout.lead + SMALL_STAGE)?);
        if len < BIG_PAYLOAD {
            return None;
        }
        Some(EarlyRead {
            lead: layout.lead,
            offset: region_offset + usize::try_from(within).ok()?,
            memory: Arc::clone(memory),
            len,
            mo: layout.mo,
            msn: self.rx_msn[0],
        })
    }

    /// True when the next read may be an early one ([`Qp::early_read`] then says where):
    /// two large Send messages of one layout came in a row, and the next byte starts a
    /// message (no markers, no SRQ).
    #[inline]
    pub(crate) fn early_armed(&self) -> bool {
        self.rx.early_run >= 2
            && self.rx.prev_last
            && self.rx_msg.is_none()
            && self.rx_expects_whole_fpdu()
    }

    /// An early read's bytes went elsewhere: no early reads until Sends of one layout come
    /// twice in a row again.
    pub(crate) fn early_missed(&mut self) {
        self.rx.early_run = 0;
        self.rx.early = None;
    }

    /// True when `lead` (the bytes an early read put before the payload) is what the early
    /// read expected: whole Send segments of the next message, each below the payload's
    /// message offset, then the header of a Send segment at that offset whose payload holds
    /// at least `placed` bytes. Only then may the leading FPDUs be received before the
    /// early bytes are confirmed (none of them places a byte where those are).
    pub(crate) fn early_lead_ok(&self, early: &EarlyRead, lead: &[u8], placed: usize) -> bool {
        const H: usize = codec::UNTAGGED_HEADER_LEN;
        let rx = &self.rx;
        let mut at = 0usize;
        let mut mo = 0u64;
        loop {
            let Some(hdr) = lead.get(at + 2..at + 2 + H) else {
                return false;
            };
            let ulpdu = codec::mpa_len(lead.get(at..).unwrap_or_default());
            let Some(payload) = ulpdu.checked_sub(H) else {
                return false;
            };
            let prefix = hdr.get(..codec::SEND_PREFIX_LEN).unwrap_or_default();
            let not_last = rx.segment_templates.iter().any(|t| t == prefix);
            let is_send = not_last || rx.send_templates.iter().any(|t| t == prefix);
            let Ok(mo32) = u32::try_from(mo) else {
                return false;
            };
            if !is_send
                || hdr.get(UNTAGGED_MSN..UNTAGGED_MO) != Some(&early.msn.to_be_bytes()[..])
                || hdr.get(UNTAGGED_MO..) != Some(&mo32.to_be_bytes()[..])
            {
                return false;
            }
            if at + 2 + H == lead.len() {
                return mo == early.mo && payload >= placed;
            }
            if !not_last || mo + payload as u64 > early.mo {
                return false;
            }
            at += codec::fpdu_len(ulpdu);
            mo += payload as u64;
        }
    }

    /// The plan of the next segment of the Send being received, when its header is exactly
    /// the one the codec emits for that segment (a Send or Send with Solicited Event, Last
    /// flag set or not, with the message's MSN and, as MO, the bytes received so far) and
    /// its payload fits the receive WR: what [`codec::parse_rx_header`] and [`Qp::plan`]
    /// decide for such a header (every field has the one value their checks accept),
    /// without parsing it. `None` for anything else, which they then read as before.
    #[inline]
    fn send_segment_plan(&self) -> Option<Plan> {
        let m = self.rx_msg.as_ref()?;
        let rx = &self.rx;
        let hdr = rx.hdr.get(2..rx.hdr_need)?;
        if hdr.len() != codec::UNTAGGED_HEADER_LEN {
            return None;
        }
        let prefix = hdr.get(..codec::SEND_PREFIX_LEN)?;
        // Index 1 of each is the Send with Solicited Event.
        let (last, solicited) = match rx.segment_templates.iter().position(|t| t == prefix) {
            Some(i) => (false, i == 1),
            None => (
                true,
                rx.send_templates.iter().position(|t| t == prefix)? == 1,
            ),
        };
        let mo = u32::try_from(m.received).ok()?;
        if hdr.get(UNTAGGED_MSN..UNTAGGED_MO)? != m.msn.to_be_bytes()
            || hdr.get(UNTAGGED_MO..)? != mo.to_be_bytes()
            || m.received + rx.payload_len as u64 > m.capacity
        {
            return None;
        }
        Some(Plan::Send {
            last,
            solicited,
            invalidate: None,
        })
    }

    fn plan(
        &mut self,
        h: RxHeader,
        mrs: &mut MrTable,
        srq: Option<&mut Srq>,
    ) -> Result<(), (Fault, FaultTarget)> {
        let len = self.rx.payload_len as u64;
        let pd = self.cfg.pd;
        match h {
            RxHeader::Write { last, stag, to } => {
                if len == 0 {
                    // A zero-length Write places nothing and is not validated (siw does the
                    // same; its RTR is a zero-length Write to STag 1).
                    self.rx.plan = Plan::Write {
                        mem: None,
                        off: 0,
                        last,
                    };
                    return Ok(());
                }
                //= https://www.rfc-editor.org/rfc/rfc5040#section-5.1
                // (paraphrase) Before placing an RDMA Write the Data Sink validates the STag
                // (valid, associated with this stream's PD, remote write allowed) and that TO
                // and length stay inside the tagged buffer.
                let (mem, off) = mrs
                    .validate_borrowed(Stag(stag), pd, Access::REMOTE_WRITE, to, len)
                    .map_err(|e| (Fault::Tagged(e), FaultTarget::None))?;
                self.rx.plan = Plan::Write {
                    mem: Some(self.rx.lend(mem)),
                    off,
                    last,
                };
                Ok(())
            }
            RxHeader::ReadResponse { last, stag, to } => {
                let Some(head) = self.orq.front().filter(|h| h.atomic.is_none()) else {
                    return Err((Fault::UnexpectedReadResponse, FaultTarget::None));
                };
                let bad = |e| Err((Fault::Tagged(e), FaultTarget::Read(WcStatus::LocProtErr)));
                if stag != head.sink_stag {
                    return bad(AccessError::InvalidStag);
                }
                let expect_to = head.sink_to.wrapping_add(head.received);
                let end = head.received + len;
                if to != expect_to || end > head.len || (last && end != head.len) {
                    return bad(AccessError::BaseOrBounds);
                }
                let mut mem = None;
                let mut off = 0;
                if len > 0 {
                    let (m, o) =
                        match mrs.validate_borrowed(Stag(stag), pd, Access::LOCAL_WRITE, to, len) {
                            Ok(v) => v,
                            Err(e) => return bad(e),
                        };
                    off = o;
                    mem = Some(self.rx.lend(m));
                }
                self.rx.plan = Plan::ReadResponse { mem, off, last };
                Ok(())
            }
            RxHeader::Send {
                last,
                solicited,
                invalidate,
                msn,
                mo,
            } => {
                if self.rx.swallow_rtr_send && self.rx_msg.is_none() {
                    if msn != self.rx_msn[0] {
                        return Err((Fault::MsnRange, FaultTarget::None));
                    }
                    if len != 0 || !last {
                        return Err((Fault::UnexpectedOpcode, FaultTarget::None));
                    }
                    self.rx.plan = Plan::SwallowRtrSend;
                    return Ok(());
                }
                //= https://www.rfc-editor.org/rfc/rfc5041#section-5.3
                // (paraphrase) Untagged messages of a queue carry consecutive MSNs starting at
                // 1; a segment whose MSN is not the one expected is an Untagged Buffer Error,
                // "Invalid MSN - MSN range is not valid".
                let expected = self.rx_msg.as_ref().map_or(self.rx_msn[0], |m| m.msn);
                if msn != expected {
                    return Err((Fault::MsnRange, FaultTarget::None));
                }
                if self.rx_msg.is_none() {
                    self.start_recv(msn, mrs, srq)?;
                    if self.rx.phase == Phase::HeaderReady {
                        return Ok(());
                    }
                }
                let Some(msg) = self.rx_msg.as_ref() else {
                    return Err((Fault::NoReceiveBuffer, FaultTarget::None));
                };
                if u64::from(mo) != msg.received {
                    return Err((Fault::InvalidMo, FaultTarget::Recv(WcStatus::LocQpOpErr)));
                }
                if msg.received + len > msg.capacity {
                    return Err((
                        Fault::MessageTooLong,
                        FaultTarget::Recv(WcStatus::LocLenErr),
                    ));
                }
                self.rx.plan = Plan::Send {
                    last,
                    solicited,
                    invalidate,
                };
                Ok(())
            }
            RxHeader::ReadRequest {
                last,
                msn,
                mo,
                sink_stag,
                sink_to,
                size,
                src_stag,
                src_to,
            } => {
                if msn != self.rx_msn[1] {
                    return Err((Fault::MsnRange, FaultTarget::None));
                }
                if mo != 0 {
                    return Err((Fault::InvalidMo, FaultTarget::None));
                }
                if !last {
                    return Err((Fault::RdmapCatastrophic, FaultTarget::None));
                }
                //= https://www.rfc-editor.org/rfc/rfc5040#section-5.2
                // (paraphrase) The Data Source accepts at most IRD outstanding RDMA Read
                // Requests; one more is a stream error (reported like siw: Remote Operation
                // Error, catastrophic error localized to the RDMAP stream).
                if self.irq.len() >= self.stream.ird || self.irq.is_full() {
                    return Err((Fault::IrdExceeded, FaultTarget::None));
                }
                let src = if size == 0 {
                    None
                } else {
                    Some(
                        mrs.validate(
                            Stag(src_stag),
                            pd,
                            Access::REMOTE_READ,
                            src_to,
                            u64::from(size),
                        )
                        .map_err(|e| (Fault::ReadSource(e), FaultTarget::None))?,
                    )
                };
                self.rx.plan = Plan::ReadRequest(IrqEntry {
                    atomic: None,
                    sink_stag,
                    sink_to,
                    len: u64::from(size),
                    src,
                    sent: 0,
                });
                Ok(())
            }
            RxHeader::Terminate => {
                self.rx.plan = Plan::Terminate;
                Ok(())
            }
            RxHeader::Immediate {
                solicited,
                msn,
                imm,
            } => {
                if self.rx.swallow_rtr_send && self.rx_msg.is_none() {
                    // The RTR (a zero-length Send) must come first.
                    return Err((Fault::UnexpectedOpcode, FaultTarget::None));
                }
                if let Some(m) = self.rx_msg.as_ref() {
                    // A Send is half received: its next segment was due, not a new message.
                    let fault = if m.msn == msn {
                        Fault::UnexpectedOpcode
                    } else {
                        Fault::MsnRange
                    };
                    return Err((fault, FaultTarget::Recv(WcStatus::LocQpOpErr)));
                }
                //= https://www.rfc-editor.org/rfc/rfc7306#section-7
                // (paraphrase) Immediate Data is an untagged message on queue 0: it takes the
                // next MSN of that queue and consumes an untagged buffer (a receive WR) at
                // the Data Sink, which is completed with the Immediate Data.
                if msn != self.rx_msn[0] {
                    return Err((Fault::MsnRange, FaultTarget::None));
                }
                self.start_recv(msn, mrs, srq)?;
                if self.rx.phase == Phase::HeaderReady {
                    return Ok(());
                }
                self.rx.plan = Plan::Immediate { solicited, imm };
                Ok(())
            }
            RxHeader::AtomicRequest { msn, req } => {
                if msn != self.rx_msn[1] {
                    return Err((Fault::MsnRange, FaultTarget::None));
                }
                //= https://www.rfc-editor.org/rfc/rfc7306#section-6
                // (paraphrase) Atomic Requests share queue 1 and the IRD limit with RDMA Read
                // Requests: one beyond IRD is a stream error, as for Reads.
                if self.irq.len() >= self.stream.ird || self.irq.is_full() {
                    return Err((Fault::IrdExceeded, FaultTarget::None));
                }
                if !matches!(req.opcode, AtomicOpcode::FetchAdd | AtomicOpcode::CmpSwap) {
                    // A reserved or unassigned AtomicOp.
                    return Err((Fault::UnexpectedOpcode, FaultTarget::None));
                }
                //= https://www.rfc-editor.org/rfc/rfc7306#section-6
                // (paraphrase) The responder validates the Remote STag and Tagged Offset of
                // the 64-bit target like any tagged access, with the remote atomic right,
                // and the Tagged Offset must be 8-byte aligned.
                let v = mrs
                    .validate(
                        Stag(req.remote_stag),
                        pd,
                        Access::REMOTE_ATOMIC,
                        req.remote_tagged_offset,
                        8,
                    )
                    .map_err(|e| (Fault::AtomicTarget(e), FaultTarget::None))?;
                if !req.remote_tagged_offset.is_multiple_of(8) {
                    return Err((Fault::AtomicMisaligned, FaultTarget::None));
                }
                self.rx.plan = Plan::AtomicRequest {
                    mem: v.memory,
                    off: v.region_offset,
                    req,
                };
                Ok(())
            }
            RxHeader::AtomicResponse { msn, resp } => {
                if msn != self.rx_msn[3] {
                    return Err((Fault::MsnRange, FaultTarget::None));
                }
                //= https://www.rfc-editor.org/rfc/rfc7306#section-6
                // (paraphrase) Atomic Responses come back in request order and echo the
                // Request Identifier of the Atomic Request they answer.
                let expected = self.orq.front().and_then(|h| h.atomic);
                if expected != Some(resp.original_request_id) {
                    return Err((Fault::UnexpectedAtomicResponse, FaultTarget::None));
                }
                self.rx.plan = Plan::AtomicResponse {
                    original: resp.original_value,
                };
                Ok(())
            }
        }
    }

    /// Takes the receive WR for a new Send message (RQ or SRQ) and validates its SGEs.
    fn start_recv(
        &mut self,
        msn: u32,
        mrs: &MrTable,
        srq: Option<&mut Srq>,
    ) -> Result<(), (Fault, FaultTarget)> {
        let (wr, pd) = if self.cfg.use_srq {
            let Some(srq) = srq else {
                return Err((Fault::NoReceiveBuffer, FaultTarget::None));
            };
            if self.rx_done.len() + 1 > self.rx_done.capacity() {
                // Hold the header until completions are polled.
                self.rx.phase = Phase::HeaderReady;
                return Ok(());
            }
            let pd = srq.pd();
            match srq.take() {
                Some(wr) => (wr, pd),
                None => return Err((Fault::NoReceiveBuffer, FaultTarget::None)),
            }
        } else {
            match self.rq.pop() {
                Some(wr) => (wr, self.cfg.pd),
                None => return Err((Fault::NoReceiveBuffer, FaultTarget::None)),
            }
        };
        // Built in place: the receive state is a few hundred bytes.
        let msg = self.rx_msg.insert(RxMsg {
            capacity: 0,
            wr,
            mem: no_validated(),
            received: 0,
            msn,
        });
        // Summed where the list now lives: reading the WR before the move had it taken
        // apart field by field on the stack and copied twice.
        msg.capacity = msg.wr.sgl.total_len();
        let mut ok = true;
        for (slot, sge) in msg.mem.iter_mut().zip(msg.wr.sgl.as_slice()) {
            if sge.length == 0 {
                continue;
            }
            match recv_sge(mrs, pd, sge) {
                Ok((memory, region_offset)) => {
                    *slot = Some(Validated {
                        memory: Arc::clone(memory),
                        region_offset,
                    })
                }
                Err(_) => ok = false,
            }
        }
        if ok {
            Ok(())
        } else {
            Err((
                Fault::DdpCatastrophic,
                FaultTarget::Recv(WcStatus::LocProtErr),
            ))
        }
    }

    /// The trailer arrived: check the CRC, then deliver (or report the deferred fault).
    fn finish_fpdu(&mut self, mrs: &mut MrTable) {
        self.stats.rx_fpdus += 1;
        let pad = codec::pad_len(self.rx.ulpdu_len);
        // The next FPDU starts right after this one.
        self.rx.mk.fpdu_offset = self
            .rx
            .mk
            .fpdu_offset
            .wrapping_add(self.rx.mk.wire_pos as u64);
        if self.rx.crc_on {
            // Everything up to the CRC field (pad and markers included) was fed as it came.
            let computed = self.rx.crc;
            let mut wire = [0u8; 4];
            if let Some(src) = self.rx.trailer.get(pad..pad + 4) {
                wire.copy_from_slice(src);
            }
            if codec::crc_from_wire(wire) != computed {
                self.stats.crc_errors += 1;
                //= https://www.rfc-editor.org/rfc/rfc5044#section-7.2
                // (paraphrase) An FPDU whose CRC does not match is not passed to DDP; the
                // error is reported with a Terminate (LLP layer, MPA CRC error) and the
                // stream is closed.
                self.fail(Fault::Crc, OffendingHeader::none());
                return;
            }
        }
        //= https://www.rfc-editor.org/rfc/rfc6581#section-3
        // (paraphrase) In peer-to-peer mode the responder sends nothing before the
        // initiator's RTR arrived; any FPDU from the peer means its RTR (sent first) did.
        self.tx.gate_until_rx = false;
        // The offending header is built only for a fault (every FPDU paid for it before).
        if let Some(d) = self.rx.deferred.take() {
            self.apply_fault_target(d.target);
            self.fail(d.fault, self.offending_header());
            return;
        }
        let plan = std::mem::replace(&mut self.rx.plan, Plan::Discard);
        let seg = self.rx.payload_len as u64;
        match plan {
            Plan::Discard => {}
            Plan::Write { last, mem, .. } => {
                if !last && mem.is_some() {
                    self.start_run(RunKind::Write);
                }
                self.rx.held = mem;
                self.stats.rx.write.bytes += seg;
                self.rx.write_len += seg;
                if last {
                    self.stats.rx.write.messages += 1;
                    self.rx.last_write = Some(self.rx.write_len);
                    self.rx.write_len = 0;
                }
            }
            Plan::ReadResponse { last, mem, .. } => {
                if !last && mem.is_some() {
                    self.start_run(RunKind::ReadResponse);
                }
                self.rx.held = mem;
                self.stats.rx.read_response.bytes += seg;
                let mut done = None;
                if let Some(head) = self.orq.front_mut() {
                    head.received += seg;
                    if last {
                        done = Some((head.seq, head.received));
                    }
                }
                if let Some((seq, bytes)) = done {
                    self.orq.pop();
                    self.stats.rx.read_response.messages += 1;
                    if let Some(e) = seq.and_then(|s| self.sq_entry_mut(s)) {
                        if e.status == SqStatus::AwaitingResponse {
                            e.status = SqStatus::Done(WcStatus::Success, bytes as u32);
                        }
                    }
                }
            }
            Plan::Send {
                last,
                solicited,
                invalidate,
            } => {
                self.stats.rx.send.bytes += seg;
                if last {
                    self.deliver_send(solicited, invalidate, mrs);
                } else {
                    self.start_run(RunKind::Send);
                }
            }
            Plan::SwallowRtrSend => {
                self.rx.swallow_rtr_send = false;
                self.rx_msn[0] = self.rx_msn[0].wrapping_add(1);
            }
            Plan::ReadRequest(entry) => {
                self.stats.rx.read_request.add(entry.len);
                self.rx_msn[1] = self.rx_msn[1].wrapping_add(1);
                if self.irq.push(entry).is_err() {
                    self.fail(Fault::IrdExceeded, self.offending_header());
                    return;
                }
            }
            Plan::Terminate => {
                self.handle_terminate_received();
                return;
            }
            Plan::Immediate { solicited, imm } => self.deliver_immediate(solicited, imm),
            Plan::AtomicRequest { mem, off, req } => {
                self.rx_msn[1] = self.rx_msn[1].wrapping_add(1);
                self.stats.rx.atomic_request.add(8);
                let Ok(original) = mem
                    .region()
                    .atomic_update(off, |old| atomic_result(&req, old))
                else {
                    // Unreachable: the 8 bytes were validated inside the registration.
                    self.fail(Fault::RdmapCatastrophic, self.offending_header());
                    return;
                };
                let entry = IrqEntry {
                    atomic: Some((req.request_id, original)),
                    sink_stag: 0,
                    sink_to: 0,
                    len: 0,
                    src: None,
                    sent: 0,
                };
                if self.irq.push(entry).is_err() {
                    self.fail(Fault::IrdExceeded, self.offending_header());
                    return;
                }
            }
            Plan::AtomicResponse { original } => {
                self.rx_msn[3] = self.rx_msn[3].wrapping_add(1);
                self.stats.rx.atomic_response.add(8);
                if let Some(seq) = self.orq.pop().and_then(|h| h.seq) {
                    self.complete_atomic(seq, original);
                }
            }
        }
        if self.rx.phase != Phase::Closed {
            self.rx.start_fpdu();
        }
    }

    /// The FPDU just finished (its header in `rx.hdr`) did not end its message of `kind`:
    /// keeps what its next FPDU's header must be (see [`RxRun`]).
    fn start_run(&mut self, kind: RunKind) {
        let rx = &self.rx;
        let (hdr_len, fixed_len) = if kind == RunKind::Send {
            (codec::UNTAGGED_HEADER_LEN, UNTAGGED_MO)
        } else {
            (codec::TAGGED_HEADER_LEN, TAGGED_TO)
        };
        let Some(hdr) = rx.hdr.get(2..rx.hdr_need).filter(|h| h.len() == hdr_len) else {
            return;
        };
        let next = if kind == RunKind::Send {
            let Some(m) = self.rx_msg.as_ref() else {
                return;
            };
            m.received
        } else {
            let Some(to) = hdr
                .get(TAGGED_TO..)
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
            else {
                return;
            };
            u64::from_be_bytes(to).wrapping_add(rx.payload_len as u64)
        };
        let mut fixed = [0u8; UNTAGGED_MO];
        if let (Some(d), Some(s)) = (fixed.get_mut(..fixed_len), hdr.get(..fixed_len)) {
            d.copy_from_slice(s);
        }
        self.rx.run = Some(RxRun { kind, fixed, next });
    }

    /// An Immediate Data message passed its checks: complete its receive WR with the value.
    fn deliver_immediate(&mut self, solicited: bool, imm: u32) {
        self.rx_msn[0] = self.rx_msn[0].wrapping_add(1);
        self.stats.rx.immediate.add(8);
        let Some(msg) = self.rx_msg.take() else {
            return;
        };
        // Right after an RDMA Write (no Send in between) this is Write with Immediate.
        let (opcode, byte_len) = match self.rx.last_write.take() {
            Some(len) => (WcOpcode::RecvRdmaWithImm, wc_byte_len(len)),
            None => (WcOpcode::Recv, 0),
        };
        let mut wc = self.recv_wc(msg.wr.wr_id, WcStatus::Success, byte_len);
        wc.opcode = opcode;
        wc.imm = Some(imm);
        wc.solicited = solicited;
        let _ = self.rx_done.push(wc);
    }

    /// The Atomic Response for the WR `seq` arrived: the original value goes into its local
    /// SGE (host byte order) and the WR completes.
    fn complete_atomic(&mut self, seq: u64, original: u64) {
        let Some(e) = self.sq_entry_mut(seq) else {
            return;
        };
        if e.status != SqStatus::AwaitingResponse {
            return;
        }
        let written = match &e.data {
            SqData::One { mem: Some(v), .. } => v
                .memory
                .region()
                .write_at(v.region_offset, &original.to_ne_bytes())
                .is_ok(),
            _ => false,
        };
        e.status = if written {
            SqStatus::Done(WcStatus::Success, 8)
        } else {
            SqStatus::Done(WcStatus::LocProtErr, 0)
        };
    }

    fn deliver_send(&mut self, solicited: bool, invalidate: Option<u32>, mrs: &mut MrTable) {
        // Read in place and dropped there (no move of the receive state).
        let Some((wr_id, received)) = self.rx_msg.as_ref().map(|m| (m.wr.wr_id, m.received)) else {
            return;
        };
        self.rx_msg = None;
        self.rx_msn[0] = self.rx_msn[0].wrapping_add(1);
        self.rx.last_write = None;
        self.stats.rx.send.messages += 1;
        let mut wc = self.recv_wc(wr_id, WcStatus::Success, wc_byte_len(received));
        wc.solicited = solicited;
        if let Some(stag) = invalidate {
            match mrs.invalidate_remote(Stag(stag), self.cfg.pd) {
                Ok(()) => wc.invalidated_stag = Some(Stag(stag)),
                Err(e) => {
                    wc.status = WcStatus::RemInvReqErr;
                    let _ = self.rx_done.push(wc);
                    let protection = matches!(
                        e,
                        MrError::PdMismatch(_) | MrError::RemoteInvalidateNotAllowed(_)
                    );
                    let hdr = self.offending_header();
                    self.fail(Fault::CannotInvalidate { protection }, hdr);
                    return;
                }
            }
        }
        let _ = self.rx_done.push(wc);
    }

    /// Completes the WR a fault is about before everything else is flushed.
    fn apply_fault_target(&mut self, target: FaultTarget) {
        match target {
            FaultTarget::None => {}
            FaultTarget::Recv(status) => {
                if let Some(msg) = self.rx_msg.take() {
                    let wc = self.recv_wc(msg.wr.wr_id, status, wc_byte_len(msg.received));
                    let _ = self.rx_done.push(wc);
                }
            }
            FaultTarget::Read(status) => {
                if let Some(seq) = self.orq.front().and_then(|h| h.seq) {
                    if let Some(e) = self.sq_entry_mut(seq) {
                        e.status = SqStatus::Done(status, 0);
                    }
                }
            }
        }
    }

    fn offending_header(&self) -> OffendingHeader {
        let h = self.rx.hdr.get(2..self.rx.hdr_need).unwrap_or(&[]);
        OffendingHeader::from_ulpdu(h, self.rx.ulpdu_len)
    }

    /// A Terminate arrived (its CRC checked): report it and go to Error. No Terminate is
    /// sent back.
    fn handle_terminate_received(&mut self) {
        self.stats.terminates_received += 1;
        self.stats.rx.terminate.messages += 1;
        let body = self.rx.hdr.get(2..2 + self.rx.ulpdu_len).unwrap_or(&[]);
        let (layer, etype, code) = codec::parse_terminate_cause(body, self.stream.terminate_layout);
        let cause = Cause::PeerTerminate { layer, etype, code };
        let qp_num = self.cfg.qp_num;
        let (event, status) = super::terminate::classify_peer_terminate(layer, etype);
        self.push_event(match event {
            crate::fault::EventKind::AccessError => AsyncEvent::QpAccessError { qp_num, cause },
            crate::fault::EventKind::RequestError => AsyncEvent::QpRequestError { qp_num, cause },
            crate::fault::EventKind::Fatal => AsyncEvent::QpFatal { qp_num, cause },
        });
        // The oldest RDMA Read still waiting for its response is the operation the peer
        // most likely refused: it completes with the remote status; the rest is flushed.
        if let Some(seq) = self.orq.front().and_then(|h| h.seq) {
            if let Some(e) = self.sq_entry_mut(seq) {
                e.status = SqStatus::Done(status, 0);
            }
        }
        self.enter_error();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(
        opcode: AtomicOpcode,
        data: u64,
        mask: u64,
        cmp: u64,
        cmp_mask: u64,
    ) -> AtomicRequestRepr {
        AtomicRequestRepr {
            opcode,
            request_id: 0,
            remote_stag: 0,
            remote_tagged_offset: 0,
            add_or_swap_data: data,
            add_or_swap_mask: mask,
            compare_data: cmp,
            compare_mask: cmp_mask,
        }
    }

    #[test]
    fn fetch_add_without_boundaries_is_a_wrapping_64_bit_add() {
        let r = req(AtomicOpcode::FetchAdd, 5, 0, 0, 0);
        assert_eq!(atomic_result(&r, 10), 15);
        assert_eq!(atomic_result(&r, u64::MAX), 4);
    }

    #[test]
    fn fetch_add_boundaries_stop_carries_between_fields() {
        // Eight byte-wide fields: 0xff + 1 wraps inside its byte.
        let bytes = 0x8080_8080_8080_8080;
        assert_eq!(masked_add(0x00ff_00ff, 0x0001_0001, bytes), 0x0000_0000);
        assert_eq!(masked_add(0x0102_0304, 0x0101_0101, bytes), 0x0203_0405);
        // A boundary at bit 63 only: the same as a plain add.
        assert_eq!(masked_add(u64::MAX, 2, 1 << 63), 1);
        for (a, b) in [(0u64, 0u64), (123, 456), (u64::MAX, u64::MAX)] {
            assert_eq!(masked_add(a, b, 1 << 63), a.wrapping_add(b));
        }
    }

    #[test]
    fn cmp_swap_compares_and_swaps_the_masked_bits_only() {
        let full = req(AtomicOpcode::CmpSwap, 9, u64::MAX, 7, u64::MAX);
        assert_eq!(atomic_result(&full, 7), 9);
        assert_eq!(atomic_result(&full, 8), 8);
        // Compare the high byte only, swap the low byte only.
        let masked = req(
            AtomicOpcode::CmpSwap,
            0xaa,
            0xff,
            0x1100_0000_0000_0000,
            0xff << 56,
        );
        assert_eq!(
            atomic_result(&masked, 0x11ff_ffff_ffff_ff00),
            0x11ff_ffff_ffff_ffaa
        );
        assert_eq!(
            atomic_result(&masked, 0x12ff_ffff_ffff_ff00),
            0x12ff_ffff_ffff_ff00
        );
    }

    #[test]
    fn an_unknown_atomic_operation_changes_nothing() {
        let r = req(AtomicOpcode::Unknown(3), 5, 0, 0, 0);
        assert_eq!(atomic_result(&r, 10), 10);
    }
}
