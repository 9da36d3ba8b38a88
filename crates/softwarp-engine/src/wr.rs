//! Work requests and work completions (after libibverbs: `ibv_send_wr`, `ibv_recv_wr`,
//! `ibv_wc`). Plain data; no I/O here.

use crate::mr::Stag;

/// Most scatter/gather elements one work request may carry.
pub const MAX_SGE: usize = 8;
/// Most bytes of inline data one send work request may carry (copied at post time).
pub const MAX_INLINE: usize = 256;

/// One scatter/gather element: `length` bytes at virtual address (TO) `addr` of the
/// registration named by `lkey`.
///
/// `repr(C)` with the layout of libibverbs' `struct ibv_sge` (a `u64` address, a `u32`
/// length, a `u32` key; 16 bytes), so that a C scatter/gather list can be used in place as
/// a `&[Sge]` ([`SendWrRef`], [`RecvWrRef`]). The verbs crate asserts that the layouts match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct Sge {
    /// Address (tagged offset) of the first byte, in the registration's IOVA space.
    pub addr: u64,
    /// Number of bytes.
    pub length: u32,
    /// The local registration's STag.
    pub lkey: Stag,
}

/// A scatter/gather list of at most [`MAX_SGE`] elements, stored inline (no allocation).
/// Two lists are equal when their elements are (what lies past `len` is not compared:
/// a list written in a reused queue slot may hold stale elements there).
#[derive(Debug, Clone, Copy, Default)]
pub struct SgList {
    sges: [Sge; MAX_SGE],
    len: usize,
}

impl PartialEq for SgList {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for SgList {}

impl SgList {
    /// An empty list (a zero-length operation).
    #[inline]
    pub fn new() -> Self {
        Self::default()
    }
    /// A list with one element.
    #[inline]
    pub fn single(sge: Sge) -> Self {
        let mut l = Self::new();
        l.sges[0] = sge;
        l.len = 1;
        l
    }
    /// Builds a list from a slice; `None` when it has more than [`MAX_SGE`] elements.
    #[inline]
    pub fn from_slice(sges: &[Sge]) -> Option<Self> {
        let mut l = Self::new();
        l.assign(sges).then_some(l)
    }
    /// Makes the list `sges` (copied in place, one element without a `memcpy` call); false,
    /// the list unchanged, when `sges` has more than [`MAX_SGE`] elements.
    #[inline]
    pub fn assign(&mut self, sges: &[Sge]) -> bool {
        match sges {
            [one] => self.sges[0] = *one,
            _ => match self.sges.get_mut(..sges.len()) {
                Some(dst) => dst.copy_from_slice(sges),
                None => return false,
            },
        }
        self.len = sges.len();
        true
    }
    /// Appends an element; gives it back when the list is full.
    #[inline]
    pub fn push(&mut self, sge: Sge) -> Result<(), Sge> {
        match self.sges.get_mut(self.len) {
            Some(slot) => {
                *slot = sge;
                self.len += 1;
                Ok(())
            }
            None => Err(sge),
        }
    }
    /// The elements.
    #[inline]
    pub fn as_slice(&self) -> &[Sge] {
        self.sges.get(..self.len).unwrap_or(&[])
    }
    /// Number of elements.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when the list has no elements.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Sum of the element lengths.
    #[inline]
    pub fn total_len(&self) -> u64 {
        self.as_slice().iter().map(|s| u64::from(s.length)).sum()
    }
}

/// What a send work request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// RDMAP Send (optionally with Solicited Event, optionally with Invalidate of a remote
    /// STag the peer allows to be invalidated).
    Send {
        /// Set the Solicited Event flag (Send with SE).
        solicited: bool,
        /// Invalidate this STag at the peer (Send with Invalidate).
        invalidate: Option<Stag>,
    },
    /// RDMA Write of the local SGL to `remote_addr` of the peer's `rkey`.
    Write {
        /// Tagged offset at the peer.
        remote_addr: u64,
        /// The peer's STag.
        rkey: Stag,
    },
    /// RDMA Read of the peer's `rkey` at `remote_addr` into the local SGL (at most one
    /// element: the iWARP sink is one STag and one TO).
    Read {
        /// Tagged offset at the peer.
        remote_addr: u64,
        /// The peer's STag.
        rkey: Stag,
    },
    /// RDMA Write with Immediate Data (RFC 7306): the RDMA Write, then an Immediate Data
    /// message carrying `imm`, which consumes a receive WR at the peer and completes it with
    /// `imm` (opcode [`WcOpcode::RecvRdmaWithImm`], byte count of the Write).
    WriteWithImm {
        /// Tagged offset at the peer.
        remote_addr: u64,
        /// The peer's STag.
        rkey: Stag,
        /// The immediate value (sent as the low-order half of the 8-byte Immediate Data,
        /// big-endian; the high-order half is zero).
        imm: u32,
    },
    /// Send with Immediate Data (RFC 7306): the Send, then an Immediate Data message carrying
    /// `imm`. Each is an untagged message of its own on queue 0, so the peer consumes two
    /// receive WRs: the Send's (the data) and then the Immediate Data's (completed with
    /// `imm` and no data).
    SendWithImm {
        /// Send the Immediate Data message with the Solicited Event flag (Immediate Data
        /// with SE).
        solicited: bool,
        /// The immediate value.
        imm: u32,
    },
    /// Atomic FetchAdd (RFC 7306): adds `add` to the 64-bit word at `remote_addr` (8-byte
    /// aligned) of the peer's `rkey` and returns the original value into the local SGL,
    /// which must be exactly one 8-byte element (written in host byte order). Counted
    /// against ORD like an RDMA Read.
    FetchAdd {
        /// Tagged offset of the target word at the peer.
        remote_addr: u64,
        /// The peer's STag (the registration needs remote atomic access).
        rkey: Stag,
        /// The value added.
        add: u64,
    },
    /// Atomic CmpSwap (RFC 7306): if the 64-bit word at `remote_addr` equals `compare`,
    /// replaces it with `swap`; returns the original value into the local SGL (one 8-byte
    /// element, host byte order). Counted against ORD like an RDMA Read.
    CmpSwap {
        /// Tagged offset of the target word at the peer.
        remote_addr: u64,
        /// The peer's STag (the registration needs remote atomic access).
        rkey: Stag,
        /// The value expected.
        compare: u64,
        /// The value stored when the comparison succeeds.
        swap: u64,
    },
}

impl SendOp {
    /// True for the operations that wait for a response (RDMA Read and the atomics): they
    /// are counted against ORD and write into the local SGL.
    #[inline]
    pub fn awaits_response(&self) -> bool {
        matches!(
            self,
            SendOp::Read { .. } | SendOp::FetchAdd { .. } | SendOp::CmpSwap { .. }
        )
    }

    /// True for the operations whose message is tagged (RDMA Write, with or without
    /// Immediate Data: its data segments; the Immediate Data message is untagged).
    #[inline]
    pub fn is_tagged(&self) -> bool {
        matches!(self, SendOp::Write { .. } | SendOp::WriteWithImm { .. })
    }

    /// True for the atomics.
    #[inline]
    pub fn is_atomic(&self) -> bool {
        matches!(self, SendOp::FetchAdd { .. } | SendOp::CmpSwap { .. })
    }

    /// The immediate value of Write/Send with Immediate.
    #[inline]
    pub fn imm(&self) -> Option<u32> {
        match *self {
            SendOp::WriteWithImm { imm, .. } | SendOp::SendWithImm { imm, .. } => Some(imm),
            _ => None,
        }
    }
}

/// Where the data of a send work request comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload<'a> {
    /// Registered memory named by a scatter/gather list.
    Sgl(SgList),
    /// Inline data, copied into the send queue at post time (at most [`MAX_INLINE`] bytes;
    /// not valid for RDMA Read).
    Inline(&'a [u8]),
}

/// A send queue work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr<'a> {
    /// Opaque id returned in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// The data.
    pub payload: Payload<'a>,
    /// Generate a completion on success (errors always complete).
    pub signaled: bool,
    /// Do not start this WR before every earlier RDMA Read has completed (IBV_SEND_FENCE).
    pub fence: bool,
}

impl SendWr<'_> {
    /// The work request as a [`SendWrRef`] (its SGL borrowed, nothing copied but the fields).
    #[inline]
    pub fn borrowed(&self) -> SendWrRef<'_> {
        SendWrRef {
            wr_id: self.wr_id,
            op: self.op,
            payload: match &self.payload {
                Payload::Sgl(sgl) => PayloadRef::Sges(sgl.as_slice()),
                Payload::Inline(bytes) => PayloadRef::Inline(bytes),
            },
            signaled: self.signaled,
            fence: self.fence,
        }
    }
}

/// Where the data of a [`SendWrRef`] comes from: as [`Payload`], the SGL borrowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadRef<'a> {
    /// Registered memory named by these scatter/gather elements (at most [`MAX_SGE`]; a
    /// post refuses more).
    Sges(&'a [Sge]),
    /// Inline data, copied into the send queue at post time (at most [`MAX_INLINE`] bytes;
    /// not valid for RDMA Read).
    Inline(&'a [u8]),
}

/// A send work request whose scatter/gather list is borrowed (say, a C `ibv_send_wr`'s
/// `sg_list` used in place): the same fields as [`SendWr`] without the inline
/// [`SgList`], so that a post copies each element once, into the send queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWrRef<'a> {
    /// Opaque id returned in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// The data.
    pub payload: PayloadRef<'a>,
    /// Generate a completion on success (errors always complete).
    pub signaled: bool,
    /// Do not start this WR before every earlier RDMA Read has completed (IBV_SEND_FENCE).
    pub fence: bool,
}

/// A receive queue work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecvWr {
    /// Opaque id returned in the completion.
    pub wr_id: u64,
    /// Where an incoming Send's payload goes.
    pub sgl: SgList,
}

/// A receive work request whose scatter/gather list is borrowed (a C `ibv_recv_wr`'s
/// `sg_list` used in place); the post copies the elements into the receive queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWrRef<'a> {
    /// Opaque id returned in the completion.
    pub wr_id: u64,
    /// Where an incoming Send's payload goes (at most [`MAX_SGE`] elements; a post
    /// refuses more).
    pub sges: &'a [Sge],
}

/// Completion status, named after `ibv_wc_status`, whose values the discriminants are (so
/// that the C ABI converts with a cast; the verbs crate tests each against rdma-core's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcStatus {
    /// The work request completed.
    Success = 0,
    /// A received message was longer than the receive buffer.
    LocLenErr = 1,
    /// Local QP operation error (e.g. a malformed WR detected at execution).
    LocQpOpErr = 2,
    /// Local protection error: an SGE's lkey, PD, rights or bounds are wrong.
    LocProtErr = 4,
    /// The work request was flushed because the QP is in the Error state.
    WrFlushErr = 5,
    /// The peer reported a remote access error (its Terminate named a protection error).
    RemAccessErr = 10,
    /// The peer reported an invalid request (bad opcode, no buffer, message too long ...).
    RemInvReqErr = 9,
    /// The peer reported a remote operation error.
    RemOpErr = 11,
    /// A fatal error (e.g. a CRC error on the stream).
    FatalErr = 19,
    /// Any other error.
    GeneralErr = 21,
}

/// Which kind of work request completed, named after `ibv_wc_opcode`, whose values the
/// discriminants are (as for [`WcStatus`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// A Send (any variant).
    Send = 0,
    /// An RDMA Write.
    RdmaWrite = 1,
    /// An RDMA Read.
    RdmaRead = 2,
    /// A receive.
    Recv = 128,
    /// An atomic FetchAdd (the original value is in the local SGL).
    FetchAdd = 4,
    /// An atomic CmpSwap (the original value is in the local SGL).
    CmpSwap = 3,
    /// A receive consumed by the Immediate Data of an RDMA Write with Immediate: `imm` holds
    /// the value and `byte_len` the length of the RDMA Write.
    RecvRdmaWithImm = 129,
}

/// One work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request's id.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// What completed.
    pub opcode: WcOpcode,
    /// Bytes transferred (received message length for receives).
    pub byte_len: u32,
    /// The QP the work request was posted to.
    pub qp_num: u32,
    /// For receives of Send with Invalidate: the STag that was invalidated.
    pub invalidated_stag: Option<Stag>,
    /// For receives: the Send carried the Solicited Event flag.
    pub solicited: bool,
    /// For receives consumed by an RFC 7306 Immediate Data message: the immediate value (the
    /// low-order 32 bits of the 8-byte Immediate Data read big-endian).
    pub imm: Option<u32>,
}

/// Which of the QP's two completion queues a completion belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CqTarget {
    /// The send CQ (Send, Write, Read work requests).
    Send,
    /// The receive CQ (receive work requests, from the RQ or the SRQ).
    Recv,
}
