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

mod deliver;
mod plan;

use std::sync::Arc;

use softwarp_wire::mpa::marker::{Marker, MarkerLayout, Markers, MARKER_LEN};
use softwarp_wire::rdmap::AtomicRequestRepr;

use crate::fault::Fault;
use crate::memory::Region;
use crate::mr::{Access, AccessError, MrMemory, MrTable, PdId, Stag};
use crate::qp::codec;
use crate::qp::pump::{RxResources, BIG_PAYLOAD, SMALL_STAGE};
use crate::qp::terminate::OffendingHeader;
use crate::qp::{IrqEntry, Qp, QpConfig, QpError, RtrKind, RxMsg, StreamConfig};
use crate::ring::{CopyRing, Ring};
use crate::srq::Srq;
use crate::wr::{RecvWr, Sge, WcStatus, WorkCompletion};

/// Smallest `max_rx_ulpdu` accepted.
pub(crate) const MIN_RX_ULPDU: usize = 128;
/// MPA length + the largest ULPDU kept whole in the header buffer (a Terminate).
const HDR_CAP: usize = 2 + 128;
const SCRATCH: usize = 256;
/// Bytes read before the header length is known: MPA length and the two control bytes.
const FIRST_READ: usize = 4;
/// Memory of parked bytes ([`RxState::parked`]) a QP keeps once it resumed.
const PARKED_KEEP: usize = 4096;

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
    /// Header complete, held: waiting for an SRQ WR slot (completions to be polled) or,
    /// with [`RxState::rnr_hold`], for a receive to be posted ([`RxState::rnr_held`]).
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

/// The receive half of a QP: the receive WRs (own RQ; an SRQ's are taken per message),
/// the message being received, the completions waiting to be polled, the expected MSNs, and
/// the FPDU state machine ([`Phase`]) with its header, trailer and marker buffers.
#[derive(Debug)]
pub(crate) struct RxState {
    /// The QP's protection domain and whether it receives from an SRQ (its configuration).
    pd: PdId,
    use_srq: bool,
    /// Receive WRs posted to the own RQ (capacity 0 on an SRQ).
    pub(super) rq: CopyRing<RecvWr>,
    /// Receive completions waiting to be polled.
    pub(super) done: CopyRing<WorkCompletion>,
    /// The receive WR in use by the Send message being received. Boxed: only a message
    /// that is not delivered whole from one FPDU (`rx_small_send`) takes one (a malloc and
    /// a free per such message), and an idle QP holds a pointer instead of 296 bytes.
    pub(super) msg: Option<Box<RxMsg>>,
    /// Bytes the last `rx_target` offered, until the `rx_commit` that answers it.
    pub(super) offered: usize,
    /// Expected MSN per untagged queue (0 Send and Immediate Data, 1 Read and Atomic
    /// Request, 2 Terminate, 3 Atomic Response).
    pub(super) msn: [u32; 4],
    phase: Phase,
    hdr: [u8; HDR_CAP],
    hdr_have: usize,
    hdr_need: usize,
    trailer: [u8; 8],
    tr_have: usize,
    tr_need: usize,
    /// Where a payload with nowhere to go is read (to check its CRC and move on): allocated
    /// the first time one comes (an idle QP holds none).
    scratch: Option<Box<[u8; SCRATCH]>>,
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
    /// `send_templates`, what [`RxState::send_segment_plan`] accepts.
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
    /// A Send (or Immediate Data) that finds no receive posted is held, header complete,
    /// until one is posted ([`Timers::rnr_wait`](crate::qp::Timers::rnr_wait) set): the
    /// RNR wait. Off: it fails at once (the Terminate for no receive buffer).
    pub(crate) rnr_hold: bool,
    /// The header held ([`Phase::HeaderReady`]) waits for a receive to be posted (not for
    /// completions to be polled).
    pub(crate) rnr_held: bool,
    /// RNR waits started so far: tells the clock one wait from the next.
    pub(crate) rnr_waits: u64,
    /// Whether the held header's FPDU starts a message (what `process_header` decided
    /// when it held it; the retry plans it again).
    hold_starts: bool,
    /// Bytes read ahead past a held header, kept for the call that resumes (the staging
    /// buffer is the caller's and is reused by other QPs meanwhile). Empty except while
    /// an RNR wait holds a header of a QP that stages its reads.
    pub(crate) parked: Vec<u8>,
}

/// Where a Send message's first large payload was: `lead` stream bytes after the message's
/// first byte (its leading FPDUs and its own header), at message offset `mo`, `len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct EarlyLayout {
    lead: usize,
    mo: u64,
    len: usize,
}

/// An early read (see [`RxState::early_read`]): the next message is expected to be a Send laid
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
    pub(crate) fn new(cfg: &QpConfig) -> Self {
        let rq = Ring::new(if cfg.use_srq { 0 } else { cfg.rq_depth });
        Self::with_queues(cfg, rq, Ring::new(cfg.rq_depth))
    }

    /// Back to the state of a new QP (the QP's reset), keeping the queues' memory.
    pub(crate) fn reset(&mut self, cfg: &QpConfig) {
        let mut rq = std::mem::replace(&mut self.rq, Ring::new(0));
        let mut done = std::mem::replace(&mut self.done, Ring::new(0));
        rq.clear();
        done.clear();
        *self = Self::with_queues(cfg, rq, done);
    }

    fn with_queues(cfg: &QpConfig, rq: CopyRing<RecvWr>, done: CopyRing<WorkCompletion>) -> Self {
        Self {
            pd: cfg.pd,
            use_srq: cfg.use_srq,
            rq,
            done,
            msg: None,
            offered: 0,
            msn: [1; 4],
            phase: Phase::Closed,
            hdr: [0; HDR_CAP],
            hdr_have: 0,
            hdr_need: FIRST_READ,
            trailer: [0; 8],
            tr_have: 0,
            tr_need: 0,
            scratch: None,
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
            rnr_hold: false,
            rnr_held: false,
            rnr_waits: 0,
            hold_starts: false,
            parked: Vec::new(),
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
        self.rnr_held = false;
        self.parked = Vec::new();
    }

    /// True while a header is held for a receive to be posted (the RNR wait).
    #[inline]
    pub(crate) fn rnr_waiting(&self) -> bool {
        self.rnr_held && self.phase == Phase::HeaderReady
    }

    /// Keeps `bytes` (read ahead past a held header) for the call that resumes, before
    /// any kept already (those came after them in an earlier call).
    pub(crate) fn park(&mut self, bytes: &[u8]) {
        self.parked.splice(0..0, bytes.iter().copied());
    }

    /// Moves the first parked bytes into `stage` (as many as fit); returns how many.
    pub(crate) fn unpark(&mut self, stage: &mut [u8]) -> usize {
        let n = stage.len().min(self.parked.len());
        if let (Some(d), Some(s)) = (stage.get_mut(..n), self.parked.get(..n)) {
            d.copy_from_slice(s);
        }
        self.parked.drain(..n);
        if self.parked.is_empty() && self.parked.capacity() > PARKED_KEEP {
            self.parked = Vec::new();
        }
        n
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

    /// [`Qp::rx_target`]: the place from the FPDU state and the receive WR in use; the
    /// length offered is kept in `offered` for the commit that answers it.
    pub(crate) fn target(&mut self) -> RxTarget<'_> {
        let target = 'place: {
            if matches!(self.phase, Phase::Header | Phase::Payload | Phase::Trailer)
                && self.mk.due()
            {
                break 'place match self.mk.buf.get_mut(self.mk.have..) {
                    Some(b) => RxTarget::Buffer(b),
                    None => RxTarget::Closed,
                };
            }
            // Stop at the next marker position.
            let room = self.mk.room();
            match self.phase {
                Phase::Closed => RxTarget::Closed,
                Phase::HeaderReady => RxTarget::Blocked,
                Phase::Header => match self.hdr.get_mut(self.hdr_have..self.hdr_need) {
                    Some(b) => cut(b, room),
                    None => RxTarget::Closed,
                },
                Phase::Trailer => match self.trailer.get_mut(self.tr_have..self.tr_need) {
                    Some(b) => cut(b, room),
                    None => RxTarget::Closed,
                },
                Phase::Payload => {
                    let remaining = (self.payload_len - self.payload_done).min(room);
                    match &self.plan {
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
                            offset: off + self.payload_done,
                            len: remaining,
                        },
                        Plan::Send { .. } => {
                            match self
                                .msg
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
                            let scratch =
                                self.scratch.get_or_insert_with(|| Box::new([0; SCRATCH]));
                            match scratch.get_mut(..n) {
                                Some(b) => cut(b, room),
                                None => RxTarget::Closed,
                            }
                        }
                    }
                }
            }
        };
        self.offered = match &target {
            RxTarget::Buffer(b) => b.len(),
            RxTarget::Region { len, .. } => *len,
            RxTarget::Blocked | RxTarget::Closed => 0,
        };
        target
    }

    /// Copies `payload` into the receive WR of the Send message in progress, from the
    /// message's next byte on (`RxMsg::received`, not moved here); returns how many bytes
    /// went in: all of them unless a piece failed or the WR has no room left.
    fn place_send(&self, payload: &[u8]) -> usize {
        let Some(m) = self.msg.as_ref() else {
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

    /// CRC over the `n` payload bytes just placed (read back from where they went).
    fn payload_crc(&mut self, n: usize) {
        if !self.crc_on {
            return;
        }
        let crc = match &self.plan {
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
                .crc32c_append(self.crc, off + self.payload_done, n)
                .unwrap_or(self.crc),
            Plan::Send { .. } => match self.msg.as_ref().and_then(|m| recv_piece(m, m.received, n))
            {
                Some((mem, off, len)) => mem
                    .region()
                    .crc32c_append(self.crc, off, len)
                    .unwrap_or(self.crc),
                None => self.crc,
            },
            _ => softwarp_wire::crc::crc32c_append(
                self.crc,
                self.scratch
                    .as_deref()
                    .and_then(|s| s.get(..n))
                    .unwrap_or(&[]),
            ),
        };
        self.crc = crc;
    }

    fn enter_trailer(&mut self) {
        self.phase = Phase::Trailer;
        self.tr_have = 0;
        self.tr_need = codec::pad_len(self.ulpdu_len) + 4;
    }

    /// Keeps the layout of large Send messages for [`RxState::early_read`], from the header just
    /// planned (`starts_message`: the FPDU before it ended its message).
    #[inline]
    fn note_early_layout(&mut self, starts_message: bool) {
        let is_send = matches!(self.plan, Plan::Send { .. });
        if starts_message {
            if !is_send {
                // Another kind of message: no early read until Sends come twice again.
                self.early_start = None;
                self.early_run = 0;
                return;
            }
            self.early_start = Some(self.mk.fpdu_offset);
        }
        if !is_send || self.payload_len < BIG_PAYLOAD {
            return;
        }
        let (Some(start), Some(m)) = (self.early_start.take(), self.msg.as_ref()) else {
            return;
        };
        let payload_at = self.mk.fpdu_offset.wrapping_add(self.hdr_need as u64);
        let Ok(lead) = usize::try_from(payload_at.wrapping_sub(start)) else {
            return;
        };
        let layout = EarlyLayout {
            lead,
            mo: m.received,
            len: self.payload_len,
        };
        if self.early == Some(layout) {
            self.early_run = self.early_run.saturating_add(1);
        } else {
            self.early = Some(layout);
            self.early_run = 1;
        }
    }

    /// The early read to do next, if any: at a message boundary, after two large Send
    /// messages of one layout in a row, with a receive posted whose scatter list holds the
    /// expected payload's start (`room`: staging bytes the caller has for the lead and the
    /// tail behind the payload; the payload read is cut so that all of it fits the staging
    /// buffer if it has to be copied out again). Validates the receive's memory as
    /// [`RxState::start_recv`] will and holds it for the read.
    ///
    /// Why: a large message's first header otherwise costs a read of its own, since its
    /// payload's destination is known only from it (one more system call per message than
    /// TCP; +1.1 to +1.5 us of a 64 KiB ping-pong in the VM's slow state, BENCHMARKS.md).
    /// A Send's destination is the next posted receive, which the QP owns until it
    /// completes, so its bytes may go there before the header confirms them; a Write's
    /// destination is memory the application may be reading, so Writes are never read early.
    pub(crate) fn early_read(&self, room: usize, mrs: &MrTable) -> Option<EarlyRead> {
        let layout = self.early?;
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
        let (memory, region_offset) = recv_sge(mrs, self.pd, sge).ok()?;
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
            msn: self.msn[0],
        })
    }

    /// True when the next read may be an early one ([`RxState::early_read`] then says where):
    /// two large Send messages of one layout came in a row, and the next byte starts a
    /// message (no markers, no SRQ).
    #[inline]
    pub(crate) fn early_armed(&self) -> bool {
        self.early_run >= 2 && self.prev_last && self.msg.is_none() && self.expects_whole_fpdu()
    }

    /// An early read's bytes went elsewhere: no early reads until Sends of one layout come
    /// twice in a row again.
    pub(crate) fn early_missed(&mut self) {
        self.early_run = 0;
        self.early = None;
    }

    /// True when `lead` (the bytes an early read put before the payload) is what the early
    /// read expected: whole Send segments of the next message, each below the payload's
    /// message offset, then the header of a Send segment at that offset whose payload holds
    /// at least `placed` bytes. Only then may the leading FPDUs be received before the
    /// early bytes are confirmed (none of them places a byte where those are).
    pub(crate) fn early_lead_ok(&self, early: &EarlyRead, lead: &[u8], placed: usize) -> bool {
        const H: usize = codec::UNTAGGED_HEADER_LEN;
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
            let not_last = self.segment_templates.iter().any(|t| t == prefix);
            let is_send = not_last || self.send_templates.iter().any(|t| t == prefix);
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
        let m = self.msg.as_ref()?;
        let hdr = self.hdr.get(2..self.hdr_need)?;
        if hdr.len() != codec::UNTAGGED_HEADER_LEN {
            return None;
        }
        let prefix = hdr.get(..codec::SEND_PREFIX_LEN)?;
        // Index 1 of each is the Send with Solicited Event.
        let (last, solicited) = match self.segment_templates.iter().position(|t| t == prefix) {
            Some(i) => (false, i == 1),
            None => (
                true,
                self.send_templates.iter().position(|t| t == prefix)? == 1,
            ),
        };
        let mo = u32::try_from(m.received).ok()?;
        if hdr.get(UNTAGGED_MSN..UNTAGGED_MO)? != m.msn.to_be_bytes()
            || hdr.get(UNTAGGED_MO..)? != mo.to_be_bytes()
            || m.received + self.payload_len as u64 > m.capacity
        {
            return None;
        }
        Some(Plan::Send {
            last,
            solicited,
            invalidate: None,
        })
    }

    /// The FPDU just finished (its header in `rx.hdr`) did not end its message of `kind`:
    /// keeps what its next FPDU's header must be (see [`RxRun`]).
    fn start_run(&mut self, kind: RunKind) {
        let (hdr_len, fixed_len) = if kind == RunKind::Send {
            (codec::UNTAGGED_HEADER_LEN, UNTAGGED_MO)
        } else {
            (codec::TAGGED_HEADER_LEN, TAGGED_TO)
        };
        let Some(hdr) = self
            .hdr
            .get(2..self.hdr_need)
            .filter(|h| h.len() == hdr_len)
        else {
            return;
        };
        let next = if kind == RunKind::Send {
            let Some(m) = self.msg.as_ref() else {
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
            u64::from_be_bytes(to).wrapping_add(self.payload_len as u64)
        };
        let mut fixed = [0u8; UNTAGGED_MO];
        if let (Some(d), Some(s)) = (fixed.get_mut(..fixed_len), hdr.get(..fixed_len)) {
            d.copy_from_slice(s);
        }
        self.run = Some(RxRun { kind, fixed, next });
    }

    fn offending_header(&self) -> OffendingHeader {
        let h = self.hdr.get(2..self.hdr_need).unwrap_or(&[]);
        OffendingHeader::from_ulpdu(h, self.ulpdu_len)
    }

    /// True when the next received byte starts an FPDU that [`Qp::rx_whole_fpdu`] may take
    /// (no markers, no SRQ): [`Qp::recv_from`] then reads ahead into the staging buffer
    /// only, instead of into [`Qp::rx_target`]'s first four bytes of the header.
    pub(crate) fn expects_whole_fpdu(&self) -> bool {
        self.phase == Phase::Header && self.hdr_have == 0 && !self.mk.on && !self.use_srq
    }

    /// Drops the reference kept between tagged FPDUs (at the end of every receive call).
    #[inline]
    pub(crate) fn let_go(&mut self) {
        self.held = None;
    }
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
    #[inline]
    pub(crate) fn rx_target(&mut self) -> RxTarget<'_> {
        self.rx.target()
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
        let offered = std::mem::take(&mut self.rx.offered);
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
                self.rx.payload_crc(n);
                self.rx.payload_done += n;
                if matches!(self.rx.plan, Plan::Send { .. }) {
                    if let Some(m) = self.rx.msg.as_mut() {
                        m.received += n as u64;
                    }
                }
                if self.rx.payload_done == self.rx.payload_len {
                    self.rx.enter_trailer();
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
        self.rx.offered = 0;
        self.trailer_bytes(n, res);
        Some(n)
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
        self.rx.offered = 0;
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
        if self.rx.phase == Phase::HeaderReady {
            // Held for a receive to be posted (the RNR wait): the header alone is taken,
            // as on the step-by-step path; the rest stays with the caller's bytes.
            self.stats.rx_stream_bytes -= (total - hdr_len) as u64;
            self.rx.mk.wire_pos = hdr_len;
            if self.rx.crc_on {
                self.rx.crc = crate::memory::crc32c_append(0, hdr);
            }
            return Some(hdr_len);
        }
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
                let at = self.rx.place_send(payload);
                if let Some(m) = self.rx.msg.as_mut() {
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
                let m = self.rx.msg.as_ref()?;
                if m.received != next || m.received + seg > m.capacity {
                    return None;
                }
                if self.rx.place_send(payload) != len {
                    return None;
                }
                if let Some(m) = self.rx.msg.as_mut() {
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
        self.rx.offered = 0;
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
        if self.rx.msg.is_some() || rx.swallow_rtr_send || rx.deferred.is_some() {
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
        let msn = self.rx.msn[0];
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
        let wr = self.rx.rq.front()?;
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
        let wr_id = wr.wr_id;
        self.rx.rq.skip_front();
        let total = fpdu.len();
        let len = payload.len() as u64;
        self.stats.rx_stream_bytes += total as u64;
        self.stats.rx_staged_payload_bytes += len;
        self.stats.rx_fpdus += 1;
        self.stats.rx.send.bytes += len;
        self.stats.rx.send.messages += 1;
        self.rx.mk.fpdu_offset = self.rx.mk.fpdu_offset.wrapping_add(total as u64);
        self.tx.gate_until_rx = false;
        self.rx.msn[0] = msn.wrapping_add(1);
        self.rx.last_write = None;
        // A whole small message: one call to the staging hint only while it is set.
        if self.rx.big {
            self.rx.note_fpdu(payload.len(), true);
        }
        self.rx.prev_last = true;
        let qp_num = self.cfg.qp_num;
        let _ = self.rx.done.push_make(|| WorkCompletion {
            solicited,
            ..super::recv_completion(qp_num, wr_id, WcStatus::Success, len as u32)
        });
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
        // A held header planned again (completions polled, a receive posted): its FPDU
        // was counted when it arrived.
        let retry = self.rx.phase == Phase::HeaderReady;
        self.rx.phase = Phase::Payload;
        self.rx.run = None;
        let last = self
            .rx
            .hdr
            .get(2)
            .is_some_and(|c| c & softwarp_wire::ddp::FLAG_LAST != 0);
        let starts_message = if retry {
            self.rx.hold_starts
        } else {
            let s = self.rx.prev_last;
            self.rx.note_fpdu(self.rx.payload_len, last);
            s
        };
        if self.rx.deferred.is_some() {
            // Nothing more is read from a header whose FPDU already failed.
        } else if let Some(plan) = self.rx.send_segment_plan() {
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
            self.rx.hold_starts = starts_message;
            if self.rx.rnr_held && !retry {
                self.stats.rx_rnr_waits += 1;
            }
            return;
        }
        self.rx.note_early_layout(starts_message);
        if self.rx.payload_len == 0 {
            self.rx.enter_trailer();
        }
    }

    /// The QP is closing (graceful disconnect) while a Send waits for a receive, or a Send
    /// that finds none arrives then: the application closes with it unreceived, as a TCP
    /// application closes with bytes unread. Nothing more is received: the rest of the
    /// stream is read and dropped until the peer's close (whose work behind the held Send
    /// is flushed when the connection ends); no Terminate. A Terminate here would fail the
    /// peer's side in the middle of its own orderly close.
    ///
    /// Also for the runtime when the peer closed or reset the connection behind a held
    /// Send (the Send will not be received; nothing more is).
    pub fn rnr_abandon(&mut self) {
        if self.rx.rnr_waiting() {
            self.rx.close();
        }
    }

    /// The RNR wait ran out ([`Timers::rnr_wait`](crate::qp::Timers::rnr_wait)): the held
    /// header fails as it would have without the wait (no receive buffer: the fault is
    /// reported after the FPDU's CRC check, its payload discarded), and the QP reads on.
    pub(crate) fn rnr_give_up(&mut self) {
        if !self.rx.rnr_waiting() {
            return;
        }
        self.rx.rnr_held = false;
        self.rx.phase = Phase::Payload;
        self.rx.defer(Fault::NoReceiveBuffer, FaultTarget::None);
        self.stats.rx_rnr_expired += 1;
        self.rx.note_early_layout(self.rx.hold_starts);
        if self.rx.payload_len == 0 {
            self.rx.enter_trailer();
        }
    }
}
