//! The send queue of a QP: the posted send WRs in posting order, their payloads (one SGE
//! in the entry; longer SGE lists and inline bytes in side tables at the entry's slot), and
//! the sequence numbers that say which WR completes next (`front_seq`), which one the
//! transmit path starts next (`tx_seq`) and which one a post gets (`next_seq`).
//!
//! Its own state machine per entry ([`SqStatus`]: Queued, Sending, AwaitingResponse, Done);
//! the transmit path (the `tx` module) moves entries along, the receive path completes
//! RDMA Reads and atomics, and completions leave in posting order (RFC 5040 section 5.5).
//! No I/O here.

use crate::mr::{Access, MrTable, PdId, Validated};
use crate::qp::{no_validated, QpError};
use crate::ring::Ring;
use crate::wr::{
    PayloadRef, SendOp, SendWrRef, SgList, Sge, WcOpcode, WcStatus, WorkCompletion, MAX_INLINE,
    MAX_SGE,
};

/// Status of a send queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SqStatus {
    /// Waiting to be transmitted.
    Queued,
    /// Partly transmitted: `sent` payload bytes handed to the runtime.
    Sending { sent: u64 },
    /// RDMA Read Request sent; waiting for the Read Response.
    AwaitingResponse,
    /// Finished with this status and byte count (waiting to be polled).
    Done(WcStatus, u32),
}

/// Where a send WR's payload lives. The SQ entry stays small (it is built at post time and
/// moved into the ring): no SGE or one is kept in it; longer lists and inline bytes go to
/// the QP's side tables, at the entry's slot (its sequence number modulo the SQ depth).
#[derive(Debug)]
pub(super) enum SqData {
    /// At most one SGE of registered memory, validated at post time (the reference keeps
    /// the memory alive).
    One {
        sge: Option<Sge>,
        mem: Option<Validated>,
    },
    /// Several SGEs, validated at post time, in `SendQueue::sgls`.
    Many,
    /// Inline bytes copied at post time, in `SendQueue::inline`.
    Inline { len: usize },
}

/// A send WR's list of several SGEs and the validated memory behind them.
#[derive(Debug, Default)]
pub(super) struct SqSgl {
    sgl: SgList,
    mem: [Option<Validated>; MAX_SGE],
}

#[derive(Debug)]
pub(super) struct SqEntry {
    pub(super) wr_id: u64,
    pub(super) op: SendOp,
    pub(super) signaled: bool,
    pub(super) fence: bool,
    /// An SGE failed validation at post time.
    pub(super) local_error: bool,
    pub(super) data: SqData,
    pub(super) len: u64,
    pub(super) status: SqStatus,
}

impl SqEntry {
    pub(super) fn wc_opcode(&self) -> WcOpcode {
        match self.op {
            SendOp::Send { .. } | SendOp::SendWithImm { .. } => WcOpcode::Send,
            SendOp::Write { .. } | SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
            SendOp::Read { .. } => WcOpcode::RdmaRead,
            SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
            SendOp::CmpSwap { .. } => WcOpcode::CmpSwap,
        }
    }
    pub(super) fn is_done(&self) -> bool {
        matches!(self.status, SqStatus::Done(..))
    }
}

/// The send queue: the ring of entries, their side tables and the three cursors.
#[derive(Debug)]
pub(super) struct SendQueue {
    pub(super) ring: Ring<SqEntry>,
    /// Side table of SGE lists longer than one, a slot per entry (`seq % depth`), allocated
    /// the first time a WR needs it.
    sgls: Vec<SqSgl>,
    /// Side table of inline bytes, a slot per entry (`seq % inline.len()`), grown with the
    /// WRs in flight when one is inline (an idle QP that sent one inline WR holds one slot
    /// of 256 bytes, not `depth` of them), never past `depth`.
    inline: Vec<[u8; MAX_INLINE]>,
    /// The queue's depth (at least 1: the side tables' modulus).
    depth: usize,
    /// Sequence number of `ring.front()`.
    pub(super) front_seq: u64,
    /// Sequence number the next posted WR gets.
    pub(super) next_seq: u64,
    /// Sequence number of the next WR to start transmitting.
    pub(super) tx_seq: u64,
}

impl SendQueue {
    pub(super) fn new(depth: usize) -> Self {
        Self {
            ring: Ring::new(depth),
            sgls: Vec::new(),
            inline: Vec::new(),
            depth: depth.max(1),
            front_seq: 0,
            next_seq: 0,
            tx_seq: 0,
        }
    }

    #[inline]
    pub(super) fn entry(&self, seq: u64) -> Option<&SqEntry> {
        let idx = usize::try_from(seq.checked_sub(self.front_seq)?).ok()?;
        self.ring.get(idx)
    }

    #[inline]
    pub(super) fn entry_mut(&mut self, seq: u64) -> Option<&mut SqEntry> {
        let idx = usize::try_from(seq.checked_sub(self.front_seq)?).ok()?;
        self.ring.get_mut(idx)
    }

    /// The side-table slot of the entry `seq`: distinct for every entry in the ring, which
    /// holds at most `depth` consecutive sequence numbers.
    #[inline]
    fn slot(&self, seq: u64) -> usize {
        usize::try_from(seq % self.depth as u64).unwrap_or(0)
    }

    /// The inline side-table slot of the entry `seq` (the table is not empty once an inline
    /// WR was posted): distinct for every entry in the ring while the table has more slots
    /// than the ring has entries.
    #[inline]
    fn inline_slot(&self, seq: u64) -> usize {
        usize::try_from(seq % self.inline.len().max(1) as u64).unwrap_or(0)
    }

    /// Gives the inline table room for one more WR than are in flight (doubling, at most
    /// `depth` slots), moving the bytes of the inline WRs in flight to their new slots.
    #[cold]
    #[inline(never)]
    fn grow_inline(&mut self) {
        let slots = (2 * self.inline.len())
            .max(self.ring.len() + 1)
            .min(self.depth);
        let mut table = vec![[0u8; MAX_INLINE]; slots];
        for seq in self.front_seq..self.next_seq {
            if let Some(SqData::Inline { .. }) = self.entry(seq).map(|e| &e.data) {
                let new = usize::try_from(seq % slots as u64).unwrap_or(0);
                if let (Some(dst), Some(src)) =
                    (table.get_mut(new), self.inline.get(self.inline_slot(seq)))
                {
                    *dst = *src;
                }
            }
        }
        self.inline = table;
    }

    /// The SGEs of the entry `seq` and their validated memory (empty for inline data).
    #[inline]
    pub(super) fn sges(&self, seq: u64) -> (&[Sge], &[Option<Validated>]) {
        match self.entry(seq).map(|e| &e.data) {
            Some(SqData::One { sge, mem }) => (sge.as_slice(), std::slice::from_ref(mem)),
            Some(SqData::Many) => match self.sgls.get(self.slot(seq)) {
                Some(s) => (s.sgl.as_slice(), &s.mem),
                None => (&[], &[]),
            },
            Some(SqData::Inline { .. }) | None => (&[], &[]),
        }
    }

    /// The inline bytes of the entry `seq` (`None` when it has registered memory).
    #[inline]
    pub(super) fn inline_bytes(&self, seq: u64) -> Option<&[u8]> {
        match self.entry(seq).map(|e| &e.data) {
            Some(SqData::Inline { len }) => self.inline.get(self.inline_slot(seq))?.get(..*len),
            _ => None,
        }
    }

    /// True when every entry is done (completed, waiting to be polled).
    pub(super) fn all_done(&self) -> bool {
        self.ring.iter().all(SqEntry::is_done)
    }

    /// True when the entry at the front is done ([`SendQueue::pop_completion`] has work).
    #[inline]
    pub(super) fn front_done(&self) -> bool {
        self.ring.front().is_some_and(SqEntry::is_done)
    }

    /// Queues the send WR `wr` (the QP checked its state; `in_error`: it completes at once
    /// with `WrFlushErr`). Local SGEs are validated against `mrs` in protection domain `pd`
    /// (see [`crate::qp::Qp::post_send`]); a failed validation is recorded in the entry and
    /// reported when the transmit path reaches it.
    #[inline]
    pub(super) fn post(
        &mut self,
        wr: SendWrRef<'_>,
        mrs: &MrTable,
        pd: PdId,
        in_error: bool,
    ) -> Result<(), QpError> {
        if self.ring.is_full() {
            return Err(QpError::QueueFull("send"));
        }
        let is_read = wr.op.awaits_response();
        let mut status = SqStatus::Queued;
        // The side-table slot (a division) is computed only for entries that use one.
        let (data, len) = match wr.payload {
            PayloadRef::Inline(_) if wr.op.is_atomic() => return Err(QpError::AtomicSink),
            PayloadRef::Inline(bytes) => {
                if bytes.len() > MAX_INLINE || is_read {
                    return Err(QpError::Inline(bytes.len()));
                }
                if self.ring.len() >= self.inline.len() {
                    self.grow_inline();
                }
                let slot = self.inline_slot(self.next_seq);
                if let Some(dst) = self
                    .inline
                    .get_mut(slot)
                    .and_then(|b| b.get_mut(..bytes.len()))
                {
                    dst.copy_from_slice(bytes);
                }
                (SqData::Inline { len: bytes.len() }, bytes.len() as u64)
            }
            PayloadRef::Sges(sges) => {
                if sges.len() > MAX_SGE {
                    return Err(QpError::TooManySges(sges.len()));
                }
                let total: u64 = sges.iter().map(|s| u64::from(s.length)).sum();
                if wr.op.is_atomic() && (sges.len() != 1 || total != 8) {
                    return Err(QpError::AtomicSink);
                }
                if is_read && sges.len() > 1 {
                    return Err(QpError::ReadSinkSgl);
                }
                if total > u64::from(u32::MAX) {
                    return Err(QpError::MessageTooLong(total));
                }
                let required = if is_read {
                    Access::LOCAL_WRITE
                } else {
                    Access::NONE
                };
                let validate = |sge: &Sge, status: &mut SqStatus| {
                    if sge.length == 0 {
                        return None;
                    }
                    let v = mrs.validate(sge.lkey, pd, required, sge.addr, u64::from(sge.length));
                    if v.is_err() {
                        *status = SqStatus::Done(WcStatus::LocProtErr, 0);
                    }
                    v.ok()
                };
                let data = match sges {
                    [] => SqData::One {
                        sge: None,
                        mem: None,
                    },
                    [sge] => SqData::One {
                        sge: Some(*sge),
                        mem: validate(sge, &mut status),
                    },
                    sges => {
                        let slot = self.slot(self.next_seq);
                        if self.sgls.is_empty() {
                            self.sgls = std::iter::repeat_with(SqSgl::default)
                                .take(self.depth)
                                .collect();
                        }
                        if let Some(side) = self.sgls.get_mut(slot) {
                            // At most `MAX_SGE` (checked above).
                            side.sgl.assign(sges);
                            for (m, sge) in side.mem.iter_mut().zip(sges) {
                                *m = validate(sge, &mut status);
                            }
                        }
                        SqData::Many
                    }
                };
                (data, total)
            }
        };
        if len > u64::from(u32::MAX) {
            return Err(QpError::MessageTooLong(len));
        }
        let local_error = status != SqStatus::Queued;
        let status = if in_error {
            SqStatus::Done(WcStatus::WrFlushErr, 0)
        } else {
            // A local error is reported when the transmit path reaches the WR, so that
            // completions stay in posting order.
            SqStatus::Queued
        };
        let entry = SqEntry {
            wr_id: wr.wr_id,
            op: wr.op,
            signaled: wr.signaled,
            fence: wr.fence,
            local_error,
            data,
            len,
            status,
        };
        if self.ring.push(entry).is_err() {
            // Unreachable (checked above); the side slot must not keep memory in use.
            let slot = self.slot(self.next_seq);
            if let Some(side) = self.sgls.get_mut(slot) {
                side.mem = no_validated();
            }
            return Err(QpError::QueueFull("send"));
        }
        self.next_seq += 1;
        Ok(())
    }

    /// The next completion (of QP `qp_num`): finished unsignaled WRs at the front are retired
    /// silently on the way.
    #[inline]
    pub(super) fn pop_completion(&mut self, qp_num: u32) -> Option<WorkCompletion> {
        //= https://www.rfc-editor.org/rfc/rfc5040#section-5.5
        // (paraphrase) Completions of the send queue are delivered to the ULP in the order
        // the work requests were submitted, whatever order their operations finish in (an
        // RDMA Read finishes when its last Read Response arrives, a later Send earlier).
        while let Some(front) = self.ring.front() {
            let SqStatus::Done(status, byte_len) = front.status else {
                break;
            };
            let signaled = front.signaled || status != WcStatus::Success;
            let wc = signaled.then(|| WorkCompletion {
                wr_id: front.wr_id,
                status,
                opcode: front.wc_opcode(),
                byte_len,
                qp_num,
                invalidated_stag: None,
                solicited: false,
                imm: None,
            });
            if matches!(front.data, SqData::Many) {
                // Release the memory references of the entry's SGE list.
                let slot = self.slot(self.front_seq);
                if let Some(side) = self.sgls.get_mut(slot) {
                    side.mem = no_validated();
                }
            }
            // Dropped here: an SGE's validated memory reference goes with it.
            let _ = self.ring.pop();
            self.front_seq += 1;
            if wc.is_some() {
                return wc;
            }
        }
        None
    }

    /// Completes every entry not done yet with `WrFlushErr`; returns how many.
    pub(super) fn flush(&mut self) -> u64 {
        let mut flushed = 0;
        for e in self.ring.iter_mut() {
            if !e.is_done() {
                e.status = SqStatus::Done(WcStatus::WrFlushErr, 0);
                e.signaled = true;
                flushed += 1;
            }
        }
        flushed
    }

    /// Empties the queue without completions (the QP's reset).
    pub(super) fn reset(&mut self) {
        self.ring.clear();
        for side in self.sgls.iter_mut() {
            side.mem = no_validated();
        }
        self.front_seq = self.next_seq;
        self.tx_seq = self.next_seq;
    }
}
