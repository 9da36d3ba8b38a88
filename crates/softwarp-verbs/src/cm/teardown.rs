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
//! close goes on at once (our FIN answers the peer's).
//!
//! The mirror case: a client reads the server's last message and closes at once, while the
//! server (siw's `ib_send_lat` under emulation) is still in the call that posted it; siw then
//! fails that Send the same way. So an initiator's close waits too, for a much shorter bound
//! (`SOFTWARP_INITIATOR_CLOSE_WAIT_MS`, 50 ms by default): two ends of this library, whose
//! responder waits for the initiator, then close after that bound, never a deadlock.
//! Busy-polled QPs do not wait (nobody reads their socket while the application is inside
//! the close). Nothing else changes: the close itself is the same graceful one (queued work
//! goes out, then the FIN).

use std::time::{Duration, Instant};

use softwarp::{QpState, QueuePair, Role};

/// How often the wait looks at the QP's state (the progress thread moves it).
const LOOK_EVERY: Duration = Duration::from_millis(2);

/// Waits until the peer of `qp` has closed the connection, when `qp`'s connection is still
/// in RTS: at most `responder` when `qp` is its responder, `initiator` when it is its
/// initiator; returns at once otherwise. True when the peer closed within the bound (or
/// there was nothing to wait for).
pub fn let_peer_close_first(
    qp: &QueuePair,
    responder: Duration,
    initiator: Duration,
    call: &'static str,
) -> bool {
    if qp.state() != QpState::Rts {
        return true;
    }
    let Some(role) = qp.connection().map(|c| c.role) else {
        return true;
    };
    let bound = match role {
        Role::Responder => responder,
        Role::Initiator => initiator,
    };
    if bound.is_zero() || qp.send_cq().busy_poll() || qp.recv_cq().busy_poll() {
        return true;
    }
    let start = Instant::now();
    while qp.state() == QpState::Rts {
        if start.elapsed() >= bound {
            tracing::debug!(target: "softwarp::verbs", qpn = qp.qp_num(), ?role, ?bound, call,
                "the peer did not close within the bound: closing first");
            return false;
        }
        std::thread::sleep(LOOK_EVERY);
    }
    tracing::debug!(target: "softwarp::verbs", qpn = qp.qp_num(), ?role, waited = ?start.elapsed(),
        call, "the peer closed first");
    true
}
