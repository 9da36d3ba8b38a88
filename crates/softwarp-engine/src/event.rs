//! Asynchronous events (after `ibv_async_event`): what the runtime reports to the application
//! outside the completion path, each with its cause. No I/O here.

use crate::cq::CqId;
use crate::fault::Cause;
use crate::srq::SrqId;

/// An asynchronous event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AsyncEvent {
    /// The QP entered the Error state because of a fatal stream error (CRC error, protocol
    /// error, a Terminate received from the peer, the connection lost).
    QpFatal {
        /// The QP.
        qp_num: u32,
        /// Why.
        cause: Cause,
    },
    /// The QP entered the Error state because a peer's request was invalid (bad opcode, no
    /// receive buffer, message too long, Read Request beyond IRD).
    QpRequestError {
        /// The QP.
        qp_num: u32,
        /// Why.
        cause: Cause,
    },
    /// The QP entered the Error state because of an access violation (STag, PD, rights,
    /// bounds), detected here or reported by the peer.
    QpAccessError {
        /// The QP.
        qp_num: u32,
        /// Why.
        cause: Cause,
    },
    /// A CQ overflowed and is in error.
    CqError {
        /// The CQ.
        cq: CqId,
    },
    /// An SRQ's armed limit was reached.
    SrqLimitReached {
        /// The SRQ.
        srq: SrqId,
    },
    /// The device failed; every QP goes to error.
    DeviceFatal,
}
