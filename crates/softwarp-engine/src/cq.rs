//! Completion queues: a fixed-capacity ring of [`WorkCompletion`]s.
//!
//! A completion that does not fit is never dropped silently: [`Cq::push`] gives it back in
//! the error, the CQ enters its error state, and a [`AsyncEvent::CqError`] is queued for
//! [`Cq::poll_event`]. The runtime then moves the QPs that use this CQ to the Error state
//! (as verbs do on a CQ overrun). No I/O here.

use thiserror::Error;

use crate::event::AsyncEvent;
use crate::ring::{Ring, RingGuard};
use crate::wr::WorkCompletion;

/// Identifies a CQ in the runtime's tables (the engine only reports it back in events).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CqId(pub u32);

/// A completion could not be queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum CqError {
    /// The ring was full: the CQ is now in error. The completion is handed back.
    #[error("completion queue {cq:?} overflowed (capacity {capacity})")]
    Overflow {
        /// The CQ.
        cq: CqId,
        /// Its capacity.
        capacity: usize,
        /// The completion that did not fit.
        completion: WorkCompletion,
    },
    /// The CQ is already in error after an overflow; the completion is handed back.
    #[error("completion queue {cq:?} is in error after an overflow")]
    InError {
        /// The CQ.
        cq: CqId,
        /// The completion that was refused.
        completion: WorkCompletion,
    },
}

/// A CQ cannot be resized to a capacity below the completions waiting in it (rdma-core's
/// providers refuse such an `ibv_resize_cq` with `EINVAL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("{pending} completions wait, more than the new capacity {capacity}")]
pub struct ResizeError {
    /// Completions waiting to be polled.
    pub pending: usize,
    /// The capacity asked for.
    pub capacity: usize,
}

/// A completion queue.
#[derive(Debug)]
pub struct Cq {
    id: CqId,
    ring: Ring<WorkCompletion>,
    error: bool,
    /// Completions refused since the overflow.
    refused: u64,
    event: Option<AsyncEvent>,
}

impl Cq {
    /// Creates a CQ that holds up to `capacity` completions (allocated now).
    pub fn new(id: CqId, capacity: usize) -> Self {
        Self {
            id,
            ring: Ring::new(capacity),
            error: false,
            refused: 0,
            event: None,
        }
    }

    /// This CQ's id.
    pub fn id(&self) -> CqId {
        self.id
    }
    /// Capacity given at creation.
    pub fn capacity(&self) -> usize {
        self.ring.capacity()
    }
    /// Completions waiting to be polled.
    pub fn len(&self) -> usize {
        self.ring.len()
    }
    /// True when no completion waits.
    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }
    /// True after an overflow.
    pub fn is_error(&self) -> bool {
        self.error
    }
    /// Completions refused (overflow and after), for statistics and error reports.
    pub fn refused(&self) -> u64 {
        self.refused
    }
    /// Whether the guard words of the completion ring are intact (two loads).
    #[inline]
    pub fn guards_intact(&self) -> bool {
        self.ring.guards_intact()
    }
    /// The guard words of the completion ring, as found.
    pub fn ring_guard(&self) -> RingGuard {
        self.ring.guard("cq")
    }
    /// Fault injection for RAS tests (not for applications): flips a guard word of the
    /// ring (the word after it when `hi`).
    #[doc(hidden)]
    pub fn damage_ring_guard(&mut self, hi: bool) {
        self.ring.damage_guard(hi);
    }

    /// Queues a completion. On overflow the CQ enters the error state, queues a
    /// [`AsyncEvent::CqError`], and hands the completion back in the error.
    pub fn push(&mut self, wc: WorkCompletion) -> Result<(), CqError> {
        if self.error {
            self.refused += 1;
            return Err(CqError::InError {
                cq: self.id,
                completion: wc,
            });
        }
        match self.ring.push(wc) {
            Ok(()) => Ok(()),
            Err(wc) => {
                self.error = true;
                self.refused += 1;
                self.event = Some(AsyncEvent::CqError { cq: self.id });
                Err(CqError::Overflow {
                    cq: self.id,
                    capacity: self.ring.capacity(),
                    completion: wc,
                })
            }
        }
    }

    /// Changes the capacity to `capacity`, keeping the completions waiting, in order (a new
    /// ring, allocated now). Refused when more completions wait than `capacity` holds. A CQ
    /// in error after an overflow stays in error.
    pub fn resize(&mut self, capacity: usize) -> Result<(), ResizeError> {
        let pending = self.ring.len();
        if pending > capacity {
            return Err(ResizeError { pending, capacity });
        }
        let mut ring = Ring::new(capacity);
        while let Some(wc) = self.ring.pop() {
            // Cannot fail: `capacity` holds every waiting completion.
            let _ = ring.push(wc);
        }
        self.ring = ring;
        Ok(())
    }

    /// Takes the oldest completion. Completions queued before an overflow stay pollable.
    pub fn poll(&mut self) -> Option<WorkCompletion> {
        self.ring.pop()
    }

    /// Removes the completions of QP `qp_num` that wait to be polled (the others keep their
    /// order); returns how many went. For a destroyed QP, as rdma-core's providers do (see
    /// `softwarp::CompletionQueue::discard_qp`).
    pub fn discard_qp(&mut self, qp_num: u32) -> usize {
        let before = self.ring.len();
        self.ring.retain(|wc| wc.qp_num != qp_num);
        before - self.ring.len()
    }

    /// Takes the pending asynchronous event (the overflow report), once.
    pub fn poll_event(&mut self) -> Option<AsyncEvent> {
        self.event.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wr::{WcOpcode, WcStatus};

    fn wc(id: u64) -> WorkCompletion {
        WorkCompletion {
            wr_id: id,
            status: WcStatus::Success,
            opcode: WcOpcode::Send,
            byte_len: 0,
            qp_num: 1,
            invalidated_stag: None,
            solicited: false,
            imm: None,
        }
    }

    #[test]
    fn discard_qp_removes_that_qps_completions_and_keeps_the_order_of_the_rest() {
        let mut cq = Cq::new(CqId(1), 8);
        for (id, qpn) in [(1, 1), (2, 2), (3, 1), (4, 3), (5, 2)] {
            cq.push(WorkCompletion {
                qp_num: qpn,
                ..wc(id)
            })
            .unwrap();
        }
        assert_eq!(cq.discard_qp(2), 2);
        assert_eq!(cq.discard_qp(9), 0);
        let left: Vec<u64> = std::iter::from_fn(|| cq.poll()).map(|w| w.wr_id).collect();
        assert_eq!(left, [1, 3, 4]);
    }

    #[test]
    fn cq_overflow_is_reported_and_the_completion_handed_back() {
        let mut cq = Cq::new(CqId(7), 2);
        cq.push(wc(1)).unwrap();
        cq.push(wc(2)).unwrap();
        match cq.push(wc(3)) {
            Err(CqError::Overflow { completion, .. }) => assert_eq!(completion.wr_id, 3),
            other => panic!("{other:?}"),
        }
        assert!(cq.is_error());
        assert_eq!(cq.poll_event(), Some(AsyncEvent::CqError { cq: CqId(7) }));
        assert_eq!(cq.poll_event(), None);
        assert_eq!(cq.poll().map(|w| w.wr_id), Some(1));
        assert!(matches!(cq.push(wc(4)), Err(CqError::InError { .. })));
        assert_eq!(cq.refused(), 2);
        assert_eq!(cq.poll().map(|w| w.wr_id), Some(2));
        assert_eq!(cq.poll(), None);
    }

    #[test]
    fn resize_keeps_waiting_completions_in_order_and_refuses_below_them() {
        let mut cq = Cq::new(CqId(8), 4);
        for id in 1..=3 {
            cq.push(wc(id)).unwrap();
        }
        assert_eq!(
            cq.resize(2),
            Err(ResizeError {
                pending: 3,
                capacity: 2
            })
        );
        assert_eq!(cq.capacity(), 4);
        cq.resize(3).unwrap();
        assert_eq!(cq.capacity(), 3);
        assert!(matches!(cq.push(wc(4)), Err(CqError::Overflow { .. })));
        let mut cq = Cq::new(CqId(9), 2);
        cq.push(wc(1)).unwrap();
        cq.push(wc(2)).unwrap();
        cq.resize(8).unwrap();
        for id in 3..=8 {
            cq.push(wc(id)).unwrap();
        }
        let order: Vec<u64> = std::iter::from_fn(|| cq.poll().map(|w| w.wr_id)).collect();
        assert_eq!(order, (1..=8).collect::<Vec<_>>());
        assert!(!cq.is_error());
    }
}
