//! The queue pair: RDMAP/DDP/MPA protocol processing of one reliable connection, sans IO.
//!
//! A [`Qp`] owns its send queue, receive queue (or draws from an [`Srq`]), its outbound
//! (ORQ) and inbound (IRQ) RDMA Read queues, and the receive and transmit state machines of
//! one iWARP stream. It never touches a socket: the runtime hands it a vectored reader and
//! writer ([`Qp::recv_from`], [`Qp::send_to`], in the `pump` module) and the QP moves the
//! bytes through them, and the runtime moves completions and events to their CQs and to the
//! application ([`Qp::poll_completion`], [`Qp::poll_event`]).
//!
//! Methods are grouped quinn-style: getters; `handle_*` inputs; application commands
//! (`post_*`, `modify`, `establish`, `destroy`); `poll_*` outputs. No I/O, no clock reads
//! (time is passed in), and no allocation after [`Qp::new`] on the data path (the one
//! exception is off it: bytes read ahead past a Send held by the RNR wait are kept in a
//! buffer of the QP's own, see [`Qp::recv_from`]).
//!
//! # Sub-state machines and the clock
//!
//! A `Qp` holds three state machines, each a type with its own `impl` (as quinn-proto's
//! `Connection` holds its stream and packet-space states, and siw splits `siw_rx_stream`
//! from `siw_iwarp_tx`):
//!
//! - `sq::SendQueue`: the posted send WRs, their payload side tables and three cursors
//!   (next to complete, next to transmit, next to post); completions leave it in posting
//!   order.
//! - `rx::RxState`: the receive WRs (own RQ), the message being received, the receive
//!   completions, the expected MSNs and the FPDU state machine (header, payload, trailer,
//!   markers). Its header is planned by one function per opcode (`rx/plan.rs`) and, once the
//!   CRC checked, delivered by one per opcode (`rx/deliver.rs`).
//! - `tx::TxState`: the FPDUs built and in flight, the message in progress, the turn
//!   between the send queue and the responses, the MSNs to send (`tx/alias.rs`: the alias
//!   lead-in of large messages).
//!
//! The `Qp` itself keeps what the two directions share and decides what crosses them: the
//! ORQ (Reads and Atomic Requests sent: the transmit side adds, the receive side completes
//! their send WRs), the IRQ (requests received: the receive side adds, the transmit side
//! answers), the Terminate to send, the state, events and statistics, and the transitions
//! that touch all of them (`fail`, `flush`, `reset`).
//!
//! Time-based rules are engine decisions too, quinn-style (`clock.rs`): [`Qp::set_timers`]
//! turns them on, [`Qp::poll_timeout`] says when to call back, [`Qp::handle_timeout`]
//! acts on the instant given (the receive stall, the first-FPDU hold, the RNR wait's
//! bound); the runtime only sleeps, and tests pass made-up instants.

mod clock;
mod codec;
mod pump;
mod rx;
mod sq;
mod terminate;
mod tx;

use std::sync::Arc;

use thiserror::Error;

use crate::event::AsyncEvent;
use crate::fault::{Cause, EventKind, Fault};
use crate::mr::{MrMemory, MrTable, PdId, Validated};
use crate::ring::{Ring, RingGuard};
use crate::srq::Srq;
use crate::stats::QpStats;
use crate::wr::{
    CqTarget, RecvWr, RecvWrRef, SendWr, SendWrRef, SgList, Sge, WcOpcode, WcStatus,
    WorkCompletion, MAX_INLINE, MAX_SGE,
};
use sq::SendQueue;

pub use clock::{Timers, STALL_LOOK_MIN};
pub use pump::{
    copy_around, copy_to_dest, ReadDest, ReadUntil, RecvEnd, RxEnv, RxResources, SendEnd,
    VectoredRead, VectoredWrite, BATCH_CAP, BIG_PAYLOAD, COALESCE_MAX, LONE_COPY_MAX, STAGE_LEN,
};
pub(crate) use rx::RxTarget;
pub use terminate::TerminateLayout;
pub use tx::{
    TxGather, TxPiece, GATHER_PIECES, MIN_FPDU_LEN, RUN_GATHER_PIECES, TX_INTERLEAVE_QUANTUM,
};

/// RDMAP stream / QP states (RFC 5040 section 6 and the verbs QP states).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Created, or reset; receives may be posted, nothing is on the wire.
    Idle,
    /// Ready to send: the stream is established (after MPA negotiation).
    Rts,
    /// Graceful close requested: no new sends, outstanding work drains.
    Closing,
    /// An error was detected; the Terminate message is being sent.
    Terminate,
    /// The stream is dead; every outstanding work request has been flushed.
    Error,
}

/// Which end sends the RFC 6581 Ready-To-Receive message, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RtrKind {
    /// A zero-length RDMA Write (siw uses STag 1, TO 0).
    Write,
    /// A zero-length RDMA Read Request (answered by a zero-length Read Response).
    Read,
    /// A zero-length Send (swallowed by the responder: it consumes no receive WR).
    Send,
}

/// The RFC 6581 peer-to-peer RTR in force on a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rtr {
    /// The message used.
    pub kind: RtrKind,
    /// True on the MPA initiator (which sends the RTR first); false on the responder,
    /// which sends nothing before the RTR arrived.
    pub initiator: bool,
}

/// Stream parameters fixed by MPA negotiation, given to [`Qp::establish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StreamConfig {
    /// CRC32c in use (either side asked for it, RFC 5044 section 7.1).
    pub crc: bool,
    /// MPA markers in both directions: shorthand for `markers_tx` and `markers_rx` together
    /// (RFC 5044 section 4.3; siw never uses them).
    pub markers: bool,
    /// Largest FPDU this side sends, all framing included (MPA length, pad, CRC, and the
    /// markers when it sends markers); rounded down to a multiple of 4. The MSS is the usual
    /// choice (siw: 1448 at MTU 1500). With markers it is capped below 64 KiB (16-bit
    /// FPDUPTR).
    pub max_fpdu_len: usize,
    /// Largest ULPDU accepted from the peer (at most 65535, the 16-bit ULPDU_Length).
    pub max_rx_ulpdu: usize,
    /// Inbound RDMA Read Requests the peer may have outstanding (our IRD).
    pub ird: usize,
    /// Outbound RDMA Read Requests we may have outstanding (our ORD).
    pub ord: usize,
    /// Terminate layout to send: RFC 5040 or siw's.
    pub terminate_layout: TerminateLayout,
    /// Peer-to-peer RTR, when negotiated (RFC 6581).
    pub rtr: Option<Rtr>,
    /// We insert MPA markers into the FPDUs we send: the peer's MPA Request or Reply had
    /// M = 1 (the M bit says "I want to receive markers"; each direction is negotiated on
    /// its own).
    pub markers_tx: bool,
    /// The peer inserts MPA markers into the FPDUs it sends: our MPA Request or Reply had
    /// M = 1.
    pub markers_rx: bool,
    /// Stream offset (octets after the MPA Request/Reply, markers included) of the first
    /// FPDU we send; 0 for a fresh stream, where the first marker precedes the first FPDU.
    /// Must be a multiple of 4 when we send markers.
    pub tx_stream_offset: u64,
    /// Stream offset of the first FPDU we receive (as `tx_stream_offset`, other direction).
    pub rx_stream_offset: u64,
    /// The RFC 7306 extensions (Immediate Data, Atomic Request and Response, and DDP queue 3
    /// for Atomic Responses) are in use on this stream (default true). MPA has no bit for
    /// them: both ends are configured. When false, a received untagged segment on queue 3
    /// gets DDP's Untagged Buffer Error "Invalid QN" and one with an RFC 7306 opcode (0x8 to
    /// 0xB) on queues 0 to 2 gets RDMAP's Remote Operation Error "Unexpected OpCode", as
    /// for any opcode RFC 5040 does not define.
    pub rfc7306: bool,
    /// This side is the MPA responder and sends no FPDU before the initiator's first one
    /// arrived (RFC 5044 section 7.1, outside peer-to-peer mode; default false). With an
    /// RFC 6581 RTR the responder waits for the RTR whatever this says. A Terminate is let
    /// through once the QP failed.
    pub responder_waits: bool,
}

impl StreamConfig {
    /// A requested largest FPDU (`max_fpdu_len`: the MSS, or what the application asked
    /// for) brought within what this engine and MPA accept: at least [`MIN_FPDU_LEN`], at
    /// most the longest FPDU MPA can frame.
    pub fn clamp_fpdu_len(requested: usize) -> usize {
        requested.clamp(MIN_FPDU_LEN, softwarp_wire::mpa::fpdu::MAX_FPDU_LEN)
    }

    /// Defaults for a TCP MSS: no CRC, no markers, FPDUs of `mss` bytes, IRD = ORD = 16,
    /// RFC 5040 Terminate layout, no RTR, both streams starting at offset 0, RFC 7306 in
    /// use.
    pub fn for_mss(mss: usize) -> Self {
        Self {
            crc: false,
            markers: false,
            max_fpdu_len: mss,
            max_rx_ulpdu: 65535,
            ird: 16,
            ord: 16,
            terminate_layout: TerminateLayout::Rfc5040,
            rtr: None,
            markers_tx: false,
            markers_rx: false,
            tx_stream_offset: 0,
            rx_stream_offset: 0,
            rfc7306: true,
            responder_waits: false,
        }
    }

    /// True when the FPDUs we send carry markers (`markers` or `markers_tx`).
    pub fn sends_markers(&self) -> bool {
        self.markers || self.markers_tx
    }

    /// True when the FPDUs we receive carry markers (`markers` or `markers_rx`).
    pub fn receives_markers(&self) -> bool {
        self.markers || self.markers_rx
    }
}

/// Creation parameters of a QP (fixed for its lifetime; everything is allocated from them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QpConfig {
    /// The QP number reported in completions and events.
    pub qp_num: u32,
    /// Protection domain of the QP.
    pub pd: PdId,
    /// Send queue depth (outstanding send WRs, including those awaiting a Read Response or
    /// whose completion was not polled yet).
    pub sq_depth: usize,
    /// Receive queue depth. With an SRQ: how many SRQ WRs this QP may hold (in progress or
    /// completed but not polled).
    pub rq_depth: usize,
    /// Receive from an SRQ instead of an own RQ.
    pub use_srq: bool,
    /// Upper bound for the negotiated IRD (allocated at creation).
    pub max_ird: usize,
    /// Upper bound for the negotiated ORD (allocated at creation).
    pub max_ord: usize,
}

/// Local misuse of the QP API (the stream is not affected).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum QpError {
    /// The operation is not allowed in the current state.
    #[error("operation {op} not allowed in state {state:?}")]
    InvalidState {
        /// The operation.
        op: &'static str,
        /// The state.
        state: QpState,
    },
    /// A state transition the RFC 5040 / verbs state machine does not allow.
    #[error("transition from {from:?} to {to:?} is not allowed")]
    InvalidTransition {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// The work queue is full.
    #[error("{0} queue is full")]
    QueueFull(&'static str),
    /// The RQ is not used by this QP (it receives from an SRQ) or vice versa.
    #[error("this QP {0}")]
    WrongReceiveQueue(&'static str),
    /// An RDMA Read's local sink must be exactly one SGE (or none for zero length).
    #[error("an RDMA Read needs at most one local SGE")]
    ReadSinkSgl,
    /// An atomic's local sink (where the original value goes) must be exactly one SGE of 8
    /// bytes, in registered memory (not inline).
    #[error("an atomic needs exactly one local SGE of 8 bytes")]
    AtomicSink,
    /// Inline data is longer than [`MAX_INLINE`] or used with an RDMA Read.
    #[error("inline data of {0} bytes not allowed (max {MAX_INLINE}, not for RDMA Read)")]
    Inline(usize),
    /// A message longer than 2^32 - 1 bytes.
    #[error("message length {0} exceeds the 32-bit limit")]
    MessageTooLong(u64),
    /// A borrowed scatter/gather list ([`SendWrRef`], [`RecvWrRef`]) longer than
    /// [`MAX_SGE`] elements.
    #[error("{0} scatter/gather elements (max {MAX_SGE})")]
    TooManySges(usize),
    /// The stream configuration is not usable.
    #[error("invalid stream configuration: {0}")]
    InvalidStreamConfig(&'static str),
    /// MPA markers were negotiated and this engine does not implement them. No longer
    /// returned: markers are supported (kept so that existing matches compile).
    #[error("MPA markers are not supported")]
    MarkersUnsupported,
    /// The QP was destroyed.
    #[error("the QP was destroyed")]
    Destroyed,
    /// `tx_commit`/`rx_commit` with more bytes than offered.
    #[error("committed {committed} bytes but only {offered} were offered")]
    CommitTooLong {
        /// Bytes committed.
        committed: usize,
        /// Bytes offered by the last transmit offer or receive target.
        offered: usize,
    },
}

/// An RDMA Read or RFC 7306 Atomic Request we sent and whose response we await.
#[derive(Debug)]
struct OrqEntry {
    /// The SQ entry to complete (`None` for an RTR zero-length Read).
    seq: Option<u64>,
    /// For an Atomic Request: its Request Identifier (the response must echo it).
    atomic: Option<u32>,
    sink_stag: u32,
    sink_to: u64,
    len: u64,
    received: u64,
}

/// An RDMA Read Request we accepted and answer with Read Responses, or an Atomic Request
/// we performed and answer with an Atomic Response.
#[derive(Debug)]
struct IrqEntry {
    /// For an Atomic Request: its Request Identifier and the original value of the word.
    atomic: Option<(u32, u64)>,
    sink_stag: u32,
    sink_to: u64,
    len: u64,
    /// The validated source (`None` for zero length).
    src: Option<Validated>,
    sent: u64,
}

/// A receive WR in use by the message being received.
#[derive(Debug)]
struct RxMsg {
    wr: RecvWr,
    mem: [Option<Validated>; MAX_SGE],
    capacity: u64,
    received: u64,
    msn: u32,
}

const EVENT_RING: usize = 16;

/// One queue pair.
#[derive(Debug)]
pub struct Qp {
    cfg: QpConfig,
    state: QpState,
    stream: StreamConfig,
    destroyed: bool,

    /// The send WRs (the application's transmit work).
    sq: SendQueue,
    /// The receive state machine and the receive WRs it fills (see the `rx` module).
    rx: rx::RxState,
    /// The transmit state machine (see the `tx` module).
    tx: tx::TxState,

    /// RDMA Reads and Atomic Requests sent, awaiting their responses: the transmit side
    /// adds, the receive side completes.
    orq: Ring<OrqEntry>,
    /// Read and Atomic Requests received, to answer: the receive side adds, the transmit
    /// side answers.
    irq: Ring<IrqEntry>,

    terminate: terminate::TerminateState,
    /// The time-based rules and what they last saw (see the `clock` module).
    clock: clock::Clock,
    events: Ring<AsyncEvent>,
    stats: QpStats,
}

fn no_validated() -> [Option<Validated>; MAX_SGE] {
    std::array::from_fn(|_| None)
}

impl Qp {
    /// Creates a QP in the Idle state, allocating all its queues.
    pub fn new(cfg: QpConfig) -> Self {
        Self {
            cfg,
            state: QpState::Idle,
            stream: StreamConfig::for_mss(1448),
            destroyed: false,
            sq: SendQueue::new(cfg.sq_depth),
            rx: rx::RxState::new(&cfg),
            tx: tx::TxState::new(),
            orq: Ring::new(cfg.max_ord),
            irq: Ring::new(cfg.max_ird),
            terminate: terminate::TerminateState::default(),
            clock: clock::Clock::default(),
            events: Ring::new(EVENT_RING),
            stats: QpStats::default(),
        }
    }

    // ----- getters -----

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.cfg.qp_num
    }
    /// The protection domain.
    pub fn pd(&self) -> PdId {
        self.cfg.pd
    }
    /// Current state.
    pub fn state(&self) -> QpState {
        self.state
    }
    /// Creation parameters.
    pub fn config(&self) -> &QpConfig {
        &self.cfg
    }
    /// The stream configuration in force (meaningful after [`Qp::establish`]).
    pub fn stream_config(&self) -> &StreamConfig {
        &self.stream
    }
    /// Statistics counters.
    pub fn stats(&self) -> &QpStats {
        &self.stats
    }
    /// Send WRs outstanding (posted and not yet polled).
    pub fn sq_len(&self) -> usize {
        self.sq.ring.len()
    }
    /// Receive WRs posted to the own RQ and not yet used.
    pub fn rq_len(&self) -> usize {
        self.rx.rq.len()
    }
    /// True while a Send (or Immediate Data) that found no receive posted is held for one
    /// (the RNR wait, [`Timers::rnr_wait`]): the QP reads nothing more until a receive is
    /// posted (to its RQ or its SRQ) and [`Qp::recv_from`] is called again, or the wait's
    /// bound passes ([`Qp::handle_timeout`]).
    #[inline]
    pub fn rnr_waiting(&self) -> bool {
        self.rx.rnr_waiting()
    }
    /// Whether the guard words of the send queue ring are intact (checked by the runtime
    /// at every post; two loads).
    #[inline]
    pub fn sq_guards_intact(&self) -> bool {
        self.sq.ring.guards_intact()
    }
    /// Whether the guard words of the receive queue ring are intact.
    #[inline]
    pub fn rq_guards_intact(&self) -> bool {
        self.rx.rq.guards_intact()
    }
    /// The guard words of every ring of the QP, as found.
    pub fn ring_guards(&self) -> [RingGuard; 6] {
        [
            self.sq.ring.guard("sq"),
            self.rx.rq.guard("rq"),
            self.rx.done.guard("rx_done"),
            self.orq.guard("orq"),
            self.irq.guard("irq"),
            self.events.guard("events"),
        ]
    }
    /// Fault injection for RAS tests (not for applications): flips a guard word of the
    /// ring named `ring` (as [`Qp::ring_guards`] names them), the word after it when `hi`.
    /// False when there is no such ring.
    #[doc(hidden)]
    pub fn damage_ring_guard(&mut self, ring: &str, hi: bool) -> bool {
        match ring {
            "sq" => self.sq.ring.damage_guard(hi),
            "rq" => self.rx.rq.damage_guard(hi),
            "rx_done" => self.rx.done.damage_guard(hi),
            "orq" => self.orq.damage_guard(hi),
            "irq" => self.irq.damage_guard(hi),
            "events" => self.events.damage_guard(hi),
            _ => return false,
        }
        true
    }
    /// RDMA Reads outstanding (ORQ occupancy).
    pub fn outstanding_reads(&self) -> usize {
        self.orq.len()
    }
    /// Inbound RDMA Read Requests accepted and not yet fully answered (IRQ occupancy).
    pub fn pending_read_responses(&self) -> usize {
        self.irq.len()
    }
    /// True when nothing is left to transmit and no operation awaits the peer: in Closing,
    /// the runtime may close the connection.
    pub fn is_drained(&self) -> bool {
        self.tx.is_idle()
            && self.orq.is_empty()
            && self.irq.is_empty()
            && !self.terminate.is_pending()
            && self.sq.all_done()
    }
    /// True once a Terminate was handed to the runtime (it should now close the connection).
    pub fn terminate_sent(&self) -> bool {
        self.terminate.sent
    }

    // ----- application commands -----

    /// Moves an Idle QP to RTS with the negotiated stream parameters.
    pub fn establish(&mut self, stream: StreamConfig) -> Result<(), QpError> {
        self.check_alive()?;
        if self.state != QpState::Idle {
            return Err(QpError::InvalidTransition {
                from: self.state,
                to: QpState::Rts,
            });
        }
        //= https://www.rfc-editor.org/rfc/rfc5044#section-4.3
        // (paraphrase) FPDUs are multiples of 4 octets and markers sit every 512 octets of
        // the stream, so an FPDU always starts on a 4-octet boundary of the stream.
        if (stream.sends_markers() && !stream.tx_stream_offset.is_multiple_of(4))
            || (stream.receives_markers() && !stream.rx_stream_offset.is_multiple_of(4))
        {
            return Err(QpError::InvalidStreamConfig(
                "stream offsets must be multiples of 4 when markers are in use",
            ));
        }
        if stream.max_fpdu_len < tx::MIN_FPDU_LEN {
            return Err(QpError::InvalidStreamConfig("max_fpdu_len below 128 bytes"));
        }
        if stream.max_rx_ulpdu > 65535 || stream.max_rx_ulpdu < rx::MIN_RX_ULPDU {
            return Err(QpError::InvalidStreamConfig(
                "max_rx_ulpdu must be between 128 and 65535",
            ));
        }
        if stream.ird > self.cfg.max_ird || stream.ord > self.cfg.max_ord {
            return Err(QpError::InvalidStreamConfig(
                "negotiated IRD/ORD exceed the QP's maximum",
            ));
        }
        self.stream = stream;
        // One send entry, not the four of `VecDeque`'s first growth (issue 39: an idle QP).
        self.sq.ring.reserve_one();
        self.tx.on_establish(&stream);
        self.rx.on_establish(&stream);
        self.state = QpState::Rts;
        Ok(())
    }

    /// Requests a state change.
    ///
    /// Allowed: RTS to Closing (graceful: no new sends; outstanding work drains), any state to
    /// Error (flushes every outstanding WR with `WrFlushErr`; from RTS a Terminate reporting
    /// a local catastrophic error is sent to the peer), Error to Idle (reset: queues are
    /// emptied without completions, as verbs' RESET). RTS is entered with
    /// [`Qp::establish`]; Terminate only by the engine.
    pub fn modify(&mut self, to: QpState) -> Result<(), QpError> {
        let from = self.state;
        match (from, to) {
            (QpState::Rts, QpState::Closing) => {
                self.set_state(QpState::Closing);
                self.rnr_abandon();
                Ok(())
            }
            (_, QpState::Error) => {
                if matches!(from, QpState::Rts | QpState::Closing) {
                    self.terminate.queue_local(&mut self.tx);
                }
                self.enter_error();
                Ok(())
            }
            (QpState::Error, QpState::Idle) => {
                self.check_alive()?;
                self.reset();
                Ok(())
            }
            (a, b) if a == b => Ok(()),
            _ => Err(QpError::InvalidTransition { from, to }),
        }
    }

    /// Destroys the QP: moves it to Error, flushing every outstanding WR. The runtime then
    /// drains [`Qp::poll_completion`] (the flushed completions) before dropping it. Posts are
    /// refused afterwards.
    pub fn destroy(&mut self) {
        if self.state != QpState::Error {
            self.enter_error();
        }
        self.destroyed = true;
    }

    fn check_alive(&self) -> Result<(), QpError> {
        if self.destroyed {
            Err(QpError::Destroyed)
        } else {
            Ok(())
        }
    }

    /// Posts a send WR (Send variants, RDMA Write, RDMA Read, and the RFC 7306 operations:
    /// Write/Send with Immediate, FetchAdd, CmpSwap).
    ///
    /// Local SGEs are validated here (lkey, PD, bounds, and local write for a Read or atomic
    /// sink, which for an atomic must be one SGE of 8 bytes); the
    /// references taken keep the memory registered until the WR completes. A WR whose SGE
    /// fails validation is accepted and completes with `LocProtErr` when it reaches the head
    /// of the queue, which moves the QP to Error (verbs semantics for RC QPs).
    ///
    /// In the Error state the WR is accepted and completes at once with `WrFlushErr`.
    pub fn post_send(&mut self, wr: &SendWr<'_>, mrs: &MrTable) -> Result<(), QpError> {
        self.post_send_ref(wr.borrowed(), mrs)
    }

    /// As [`Qp::post_send`], for a work request whose SGL is borrowed (copied once, into
    /// the send queue). More than [`MAX_SGE`] elements are refused
    /// ([`QpError::TooManySges`]).
    #[inline]
    pub fn post_send_ref(&mut self, wr: SendWrRef<'_>, mrs: &MrTable) -> Result<(), QpError> {
        self.check_alive()?;
        let in_error = matches!(self.state, QpState::Error | QpState::Terminate);
        if !(in_error || self.state == QpState::Rts) {
            return Err(QpError::InvalidState {
                op: "post_send",
                state: self.state,
            });
        }
        self.sq.post(wr, mrs, self.cfg.pd, in_error)?;
        if in_error {
            self.stats.flushed += 1;
        }
        Ok(())
    }

    /// Posts a receive WR to the QP's own RQ. Its SGEs are validated (local write, PD,
    /// bounds) when a Send starts using it. In the Error state the WR completes at once with
    /// `WrFlushErr`. A WR whose SGEs add up to more than 2^32 - 1 bytes is refused
    /// ([`QpError::MessageTooLong`], as for a send WR): no Send may be that long, and the
    /// completion's byte length (32 bits, as in verbs) could not say how much was received.
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), QpError> {
        self.post_recv_ref(&wr)
    }

    /// As [`Qp::post_recv`], copying the WR from `wr` straight into the receive queue.
    pub fn post_recv_ref(&mut self, wr: &RecvWr) -> Result<(), QpError> {
        self.post_recv_borrowed(RecvWrRef {
            wr_id: wr.wr_id,
            sges: wr.sgl.as_slice(),
        })
    }

    /// As [`Qp::post_recv`], for a work request whose SGL is borrowed: its elements are
    /// copied once, into the receive queue. More than [`MAX_SGE`] elements are refused
    /// ([`QpError::TooManySges`]).
    #[inline]
    pub fn post_recv_borrowed(&mut self, wr: RecvWrRef<'_>) -> Result<(), QpError> {
        if wr.sges.len() > MAX_SGE {
            return Err(QpError::TooManySges(wr.sges.len()));
        }
        let total = match wr.sges {
            // The common case, summed without a loop.
            [one] => u64::from(one.length),
            sges => sges.iter().map(|s| u64::from(s.length)).sum(),
        };
        if self.admit_recv(wr.wr_id, total)? {
            // The entry is written in its slot: no `RecvWr` (whose eight inline elements
            // make it 144 bytes) is built on the stack and copied in.
            let filled = match wr.sges {
                // Apart, so that the one element is two stores, not a `memcpy` call
                // (LLVM merges it into the general case's copy otherwise).
                [one] => self.rx.rq.push_with(|slot| {
                    slot.wr_id = wr.wr_id;
                    slot.sgl = SgList::single(*one);
                }),
                sges => self.rx.rq.push_with(|slot| {
                    slot.wr_id = wr.wr_id;
                    // At most `MAX_SGE` elements (checked above).
                    slot.sgl.assign(sges);
                }),
            };
            if !filled {
                return Err(QpError::QueueFull("receive"));
            }
        }
        Ok(())
    }

    /// The checks of a receive post (`total` bytes): true when the WR goes to the receive
    /// queue, false when it was completed at once with `WrFlushErr` (Error state).
    #[inline]
    fn admit_recv(&mut self, wr_id: u64, total: u64) -> Result<bool, QpError> {
        self.check_alive()?;
        if self.cfg.use_srq {
            return Err(QpError::WrongReceiveQueue("receives from an SRQ"));
        }
        if total > u64::from(u32::MAX) {
            return Err(QpError::MessageTooLong(total));
        }
        let used = self.rx.rq.len() + self.rx.done.len() + usize::from(self.rx.msg.is_some());
        if used >= self.cfg.rq_depth {
            return Err(QpError::QueueFull("receive"));
        }
        if matches!(self.state, QpState::Error | QpState::Terminate) {
            self.stats.flushed += 1;
            let wc = self.recv_wc(wr_id, WcStatus::WrFlushErr, 0);
            self.rx
                .done
                .push(wc)
                .map_err(|_| QpError::QueueFull("receive"))?;
            return Ok(false);
        }
        Ok(true)
    }

    // ----- outputs -----

    /// The next completion, with the CQ it belongs to.
    ///
    /// Send-queue completions come in posting order (a WR completes only after every earlier
    /// WR did, RFC 5040 section 5.5); unsignaled successful WRs free their slot silently.
    /// Then receive completions, in message order.
    pub fn poll_completion(&mut self) -> Option<(CqTarget, WorkCompletion)> {
        if let Some(wc) = self.poll_send_completion() {
            return Some((CqTarget::Send, wc));
        }
        self.poll_recv_completion().map(|wc| (CqTarget::Recv, wc))
    }

    /// The next completion of the send queue ([`Qp::poll_completion`]'s first half): finished
    /// unsignaled WRs at the front are retired silently on the way.
    pub fn poll_send_completion(&mut self) -> Option<WorkCompletion> {
        self.sq.pop_completion(self.cfg.qp_num)
    }

    /// The next completion of the receive side ([`Qp::poll_completion`]'s second half).
    #[inline]
    pub fn poll_recv_completion(&mut self) -> Option<WorkCompletion> {
        self.rx.done.pop()
    }

    /// Whether [`Qp::poll_completion`] has anything to look at: a finished send WR at the
    /// front of the send queue (it may be unsignaled and complete silently) or a receive
    /// completion. Cheap enough to ask before every drain.
    #[inline]
    pub fn has_completion(&self) -> bool {
        !self.rx.done.is_empty() || self.sq.front_done()
    }

    /// The next asynchronous event of this QP (errors with their cause).
    pub fn poll_event(&mut self) -> Option<AsyncEvent> {
        self.events.pop()
    }

    // ----- inputs -----

    /// The transport connection closed (FIN or reset) or failed.
    ///
    /// In Closing with nothing outstanding this is the graceful end (the QP goes to Idle);
    /// otherwise the QP goes to Error, flushes, and reports [`Cause::LlpClosed`].
    pub fn handle_llp_closed(&mut self) {
        match self.state {
            QpState::Closing if self.is_drained() => self.set_state(QpState::Idle),
            QpState::Idle | QpState::Error => {}
            QpState::Terminate => self.enter_error(),
            QpState::Rts | QpState::Closing => {
                self.push_event(AsyncEvent::QpFatal {
                    qp_num: self.cfg.qp_num,
                    cause: Cause::LlpClosed,
                });
                self.enter_error();
            }
        }
    }

    /// True while the peer is in the middle of an FPDU: some of its bytes arrived, the rest
    /// did not (what the receive stall rule of [`Qp::set_timers`] watches).
    pub fn rx_in_fpdu(&self) -> bool {
        matches!(self.state, QpState::Rts | QpState::Closing) && self.rx.in_fpdu()
    }

    /// The peer stalled inside an FPDU ([`Qp::handle_timeout`] decides this with the rule
    /// of [`Qp::set_timers`]; a test may say so directly): the stream is
    /// terminated ([`Fault::RxStall`]: RDMAP "Catastrophic error, localized to RDMAP
    /// Stream"), outstanding work is flushed, and the memory and receive the partial FPDU
    /// held are let go. Does nothing when the QP is not in the middle of an FPDU.
    pub fn handle_rx_stall(&mut self) {
        if self.rx_in_fpdu() {
            self.fail(Fault::RxStall, terminate::OffendingHeader::none());
        }
    }

    /// Convenience for tests and simple runtimes: [`Qp::recv_from`] over `data`, without
    /// staging. Returns the number of bytes consumed (less than `data.len()` when the QP
    /// stopped receiving or is blocked).
    pub fn handle_rx(&mut self, data: &[u8], mrs: &mut MrTable, srq: Option<&mut Srq>) -> usize {
        let mut src = pump::SliceSource::new(data);
        let mut budget = usize::MAX;
        let mut res = RxEnv { mrs, srq };
        let _ = self.recv_from(
            &mut src,
            &mut [],
            &mut budget,
            ReadUntil::WouldBlock,
            &mut res,
        );
        src.consumed()
    }

    // ----- internal state transitions -----

    fn set_state(&mut self, to: QpState) {
        self.state = to;
    }

    fn push_event(&mut self, ev: AsyncEvent) {
        if self.events.push(ev).is_err() {
            self.stats.events_lost += 1;
        }
    }

    fn recv_wc(&self, wr_id: u64, status: WcStatus, byte_len: u32) -> WorkCompletion {
        recv_completion(self.cfg.qp_num, wr_id, status, byte_len)
    }

    /// Reports a fault detected on the stream: queues the Terminate, raises the event, moves
    /// to Terminate and flushes.
    fn fail(&mut self, fault: Fault, hdr: terminate::OffendingHeader) {
        let cause = Cause::Detected(fault);
        let qp_num = self.cfg.qp_num;
        self.push_event(match fault.event_kind() {
            EventKind::Fatal => AsyncEvent::QpFatal { qp_num, cause },
            EventKind::RequestError => AsyncEvent::QpRequestError { qp_num, cause },
            EventKind::AccessError => AsyncEvent::QpAccessError { qp_num, cause },
        });
        self.terminate.queue(fault, hdr, &mut self.tx);
        self.rx.close();
        self.flush();
        self.set_state(QpState::Terminate);
    }

    /// Moves to Error (flushing); the Terminate, if one is queued, is still sent.
    fn enter_error(&mut self) {
        self.rx.close();
        self.flush();
        self.set_state(QpState::Error);
    }

    /// Completes every outstanding WR with `WrFlushErr` (or the status already decided).
    fn flush(&mut self) {
        let mut flushed = self.sq.flush();
        if let Some(msg) = self.rx.msg.take() {
            let wc = self.recv_wc(msg.wr.wr_id, WcStatus::WrFlushErr, 0);
            flushed += 1;
            let _ = self.rx.done.push(wc);
        }
        while let Some(wr) = self.rx.rq.pop() {
            let wc = self.recv_wc(wr.wr_id, WcStatus::WrFlushErr, 0);
            flushed += 1;
            let _ = self.rx.done.push(wc);
        }
        self.orq.clear();
        self.irq.clear();
        self.tx.abandon_unstarted();
        self.stats.flushed += flushed;
    }

    fn reset(&mut self) {
        self.sq.reset();
        self.orq.clear();
        self.irq.clear();
        self.tx = tx::TxState::new();
        self.rx.reset(&self.cfg);
        self.terminate = terminate::TerminateState::default();
        self.clock = clock::Clock::default();
        self.set_state(QpState::Idle);
    }
}

/// Shared helpers for payload bookkeeping.
fn sge_piece(
    sges: &[Sge],
    mem: &[Option<Validated>],
    msg_off: u64,
    max: usize,
) -> Option<(Arc<MrMemory>, usize, usize)> {
    let mut base = 0u64;
    for (sge, m) in sges.iter().zip(mem.iter()) {
        let l = u64::from(sge.length);
        if msg_off < base + l {
            let within = msg_off - base;
            let v = m.as_ref()?;
            let take = usize::try_from((l - within).min(max as u64)).ok()?;
            let off = v.region_offset + usize::try_from(within).ok()?;
            return Some((Arc::clone(&v.memory), off, take));
        }
        base += l;
    }
    None
}

/// A receive completion of QP `qp_num` (no invalidation, not solicited, no immediate).
#[inline(always)]
fn recv_completion(qp_num: u32, wr_id: u64, status: WcStatus, byte_len: u32) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status,
        opcode: WcOpcode::Recv,
        byte_len,
        qp_num,
        invalidated_stag: None,
        solicited: false,
        imm: None,
    }
}
