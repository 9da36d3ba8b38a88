//! Shared receive queues: one pool of receive work requests that several QPs draw from, with
//! the verbs "limit" event (armed with a threshold, fired once when the number of queued WRs
//! drops below it). No I/O here.

use thiserror::Error;

use crate::event::AsyncEvent;
use crate::mr::PdId;
use crate::ring::{CopyRing, Ring, RingGuard};
use crate::wr::RecvWr;

/// Identifies an SRQ in the runtime's tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SrqId(pub u32);

/// Posting to an SRQ failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum SrqError {
    /// The SRQ holds as many WRs as its capacity.
    #[error("shared receive queue is full")]
    Full,
    /// The WR's SGEs add up to more than 2^32 - 1 bytes: the completion's byte length (32
    /// bits, as in verbs) could not say how much was received, and no Send may be longer
    /// (`QpError::MessageTooLong` refuses such a post on the sending side).
    #[error("receive WR of {0} bytes exceeds the 32-bit limit")]
    MessageTooLong(u64),
}

/// A shared receive queue.
#[derive(Debug)]
pub struct Srq {
    id: SrqId,
    pd: PdId,
    ring: CopyRing<RecvWr>,
    limit: Option<usize>,
    event: Option<AsyncEvent>,
    /// A QP found the SRQ empty and holds a Send for a receive to be posted (the RNR
    /// wait), since [`Srq::take_rnr_waiting`] last asked.
    rnr_waiting: bool,
}

impl Srq {
    /// Creates an SRQ in `pd` for up to `capacity` receive WRs (allocated now).
    pub fn new(id: SrqId, pd: PdId, capacity: usize) -> Self {
        Self {
            id,
            pd,
            ring: Ring::new(capacity),
            limit: None,
            event: None,
            rnr_waiting: false,
        }
    }
    /// This SRQ's id.
    pub fn id(&self) -> SrqId {
        self.id
    }
    /// Whether the guard words of the receive ring are intact (two loads).
    #[inline]
    pub fn guards_intact(&self) -> bool {
        self.ring.guards_intact()
    }
    /// The guard words of the receive ring, as found.
    pub fn ring_guard(&self) -> RingGuard {
        self.ring.guard("srq")
    }
    /// The protection domain receive buffers are checked against.
    pub fn pd(&self) -> PdId {
        self.pd
    }
    /// Receive WRs queued.
    pub fn len(&self) -> usize {
        self.ring.len()
    }
    /// True when no WR is queued.
    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }
    /// Queues a receive WR (its SGEs are validated when a Send starts using it). A WR whose
    /// SGEs add up to more than 2^32 - 1 bytes is refused.
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), SrqError> {
        let total = wr.sgl.total_len();
        if total > u64::from(u32::MAX) {
            return Err(SrqError::MessageTooLong(total));
        }
        self.ring.push(wr).map_err(|_| SrqError::Full)
    }
    /// Arms the limit event: it fires once when fewer than `limit` WRs remain queued.
    pub fn arm_limit(&mut self, limit: usize) {
        self.limit = Some(limit);
    }
    /// The armed limit, if any (disarmed after it fired).
    pub fn limit(&self) -> Option<usize> {
        self.limit
    }
    /// Takes the next WR for a QP's incoming Send (engine use).
    pub(crate) fn take(&mut self) -> Option<RecvWr> {
        let wr = self.ring.pop()?;
        if let Some(limit) = self.limit {
            if self.ring.len() < limit {
                self.limit = None;
                self.event = Some(AsyncEvent::SrqLimitReached { srq: self.id });
            }
        }
        Some(wr)
    }
    /// A QP holds a Send because the SRQ was empty (engine use).
    pub(crate) fn note_rnr_wait(&mut self) {
        self.rnr_waiting = true;
    }
    /// True (once) when a QP on this SRQ found it empty and holds a Send for a receive
    /// since the last call: the runtime, having posted, has those QPs resume reading.
    pub fn take_rnr_waiting(&mut self) -> bool {
        std::mem::take(&mut self.rnr_waiting)
    }
    /// Takes the pending limit event, once.
    pub fn poll_event(&mut self) -> Option<AsyncEvent> {
        self.event.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wr::SgList;

    #[test]
    fn srq_limit_event_fires_once_below_the_limit() {
        let mut srq = Srq::new(SrqId(3), PdId(1), 4);
        for i in 0..4 {
            srq.post_recv(RecvWr {
                wr_id: i,
                sgl: SgList::new(),
            })
            .unwrap();
        }
        assert_eq!(
            srq.post_recv(RecvWr {
                wr_id: 9,
                sgl: SgList::new()
            }),
            Err(SrqError::Full)
        );
        srq.arm_limit(2);
        assert_eq!(srq.take().map(|w| w.wr_id), Some(0));
        assert_eq!(srq.poll_event(), None);
        assert_eq!(srq.take().map(|w| w.wr_id), Some(1));
        assert_eq!(srq.poll_event(), None, "2 left is not below 2");
        srq.take();
        assert_eq!(
            srq.poll_event(),
            Some(AsyncEvent::SrqLimitReached { srq: SrqId(3) })
        );
        srq.take();
        assert_eq!(srq.poll_event(), None);
        assert_eq!(srq.limit(), None);
    }
}
