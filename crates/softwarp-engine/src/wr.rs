//! Work requests and work completions (after libibverbs: `ibv_send_wr`, `ibv_recv_wr`,
//! `ibv_wc`). Plain data; no I/O here.

use crate::mr::Stag;

/// Most scatter/gather elements one work request may carry.
pub const MAX_SGE: usize = 8;
/// Most bytes of inline data one send work request may carry (copied at post time).
pub const MAX_INLINE: usize = 256;

/// One scatter/gather element: `length` bytes at virtual address (TO) `addr` of the
/// registration named by `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    /// Address (tagged offset) of the first byte, in the registration's IOVA space.
    pub addr: u64,
    /// Number of bytes.
    pub length: u32,
    /// The local registration's STag.
    pub lkey: Stag,
}

/// A scatter/gather list of at most [`MAX_SGE`] elements, stored inline (no allocation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SgList {
    sges: [Sge; MAX_SGE],
    len: usize,
}

impl SgList {
    /// An empty list (a zero-length operation).
    pub fn new() -> Self {
        Self::default()
    }
    /// A list with one element.
    pub fn single(sge: Sge) -> Self {
        let mut l = Self::new();
        l.sges[0] = sge;
        l.len = 1;
        l
    }
    /// Builds a list from a slice; `None` when it has more than [`MAX_SGE`] elements.
    pub fn from_slice(sges: &[Sge]) -> Option<Self> {
        let mut l = Self::new();
        for s in sges {
            l.push(*s).ok()?;
        }
        Some(l)
    }
    /// Appends an element; gives it back when the list is full.
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
    pub fn as_slice(&self) -> &[Sge] {
        self.sges.get(..self.len).unwrap_or(&[])
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when the list has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Sum of the element lengths.
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

/// A receive queue work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr {
    /// Opaque id returned in the completion.
    pub wr_id: u64,
    /// Where an incoming Send's payload goes.
    pub sgl: SgList,
}

/// Completion status, named after `ibv_wc_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcStatus {
    /// The work request completed.
    Success,
    /// A received message was longer than the receive buffer.
    LocLenErr,
    /// Local QP operation error (e.g. a malformed WR detected at execution).
    LocQpOpErr,
    /// Local protection error: an SGE's lkey, PD, rights or bounds are wrong.
    LocProtErr,
    /// The work request was flushed because the QP is in the Error state.
    WrFlushErr,
    /// The peer reported a remote access error (its Terminate named a protection error).
    RemAccessErr,
    /// The peer reported an invalid request (bad opcode, no buffer, message too long ...).
    RemInvReqErr,
    /// The peer reported a remote operation error.
    RemOpErr,
    /// A fatal error (e.g. a CRC error on the stream).
    FatalErr,
    /// Any other error.
    GeneralErr,
}

/// Which kind of work request completed, named after `ibv_wc_opcode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// A Send (any variant).
    Send,
    /// An RDMA Write.
    RdmaWrite,
    /// An RDMA Read.
    RdmaRead,
    /// A receive.
    Recv,
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
    /// Immediate data (RFC 7306); never set by this engine yet.
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
