//! The order of a connection's end: a responder lets the initiator close first.
//!
//! rdma_cm programs end a connection from both sides at about the same moment: perftest's
//! server, for one, reads the client's closing Send, answers it, and at once disconnects its
//! data QP (`rdma_disconnect`) and destroys its control QP (`ibv_destroy_qp`) before it exits.
//! Linux siw completes a Send in the system call that posts it, after the last FPDU went to
//! TCP; if the peer's FIN is processed in between (its socket callback sets `tx_suspend`),
//! siw fails that Send with `IBV_WC_LOC_QP_OP_ERR` although the bytes went out and the peer
//! received them. siw's perftest client under emulation (qemu TCG) hit this as "Bad wc status
//! 2 / Unable to write to socket/rdma_cm" after a complete run against Debian's perftest server
//! over this library, which closed right after its last message.
//!
//! So a responder's graceful close (`rdma_disconnect`) and the destroy of its connected QP
//! first wait, up to `SOFTWARP_CLOSE_WAIT_MS` (2 s by default, 0 to turn it off), for the
//! initiator to close its side: when the initiator's FIN arrives the QP leaves RTS and the
//! close goes on at once (our FIN answers the peer's). An initiator closes without waiting,
//! so two ends of this library never wait for each other. Busy-polled QPs do not wait
//! (nobody reads their socket while the application is inside the close). Nothing else
//! changes: the close itself is the same graceful one (queued work goes out, then the FIN).

use std::time::{Duration, Instant};

use softwarp::{QpState, QueuePair, Role};

/// How often the wait looks at the QP's state (the progress thread moves it).
const LOOK_EVERY: Duration = Duration::from_millis(2);

/// Waits (at most `bound`) until the peer of `qp` has closed the connection, when `qp` is
/// the responder of a connection still in RTS; returns at once otherwise. True when the
/// peer closed within the bound (or there was nothing to wait for).
pub fn let_initiator_close_first(qp: &QueuePair, bound: Duration, call: &'static str) -> bool {
    if bound.is_zero() || qp.state() != QpState::Rts {
        return true;
    }
    if qp.connection().is_none_or(|c| c.role != Role::Responder) {
        return true;
    }
    if qp.send_cq().busy_poll() || qp.recv_cq().busy_poll() {
        return true;
    }
    let start = Instant::now();
    while qp.state() == QpState::Rts {
        if start.elapsed() >= bound {
            tracing::debug!(target: "softwarp::verbs", qpn = qp.qp_num(), ?bound, call,
                "the initiator did not close within the bound: closing first");
            return false;
        }
        std::thread::sleep(LOOK_EVERY);
    }
    tracing::debug!(target: "softwarp::verbs", qpn = qp.qp_num(), waited = ?start.elapsed(), call,
        "the initiator closed first");
    true
}
