//! Support for the connection manager tests: bounded waits for CM events, and small helpers
//! to post work requests. Builds on `tests/util` (endpoints, patterns, completions).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod matrix;
pub mod raw;

use std::time::{Duration, Instant};

use softwarp::*;

use crate::util::WAIT;

/// Waits (at most [`WAIT`]) for the oldest event on `ch` matching `pred`.
pub fn wait_ev(ch: &CmEventChannel, what: &str, pred: impl FnMut(&CmEvent) -> bool) -> CmEvent {
    match ch.get_event_matching(Some(WAIT), pred) {
        Ok(ev) => ev,
        Err(e) => panic!(
            "no {what} event within {WAIT:?} ({e}); {} others queued",
            ch.pending_events()
        ),
    }
}

/// The next event about connection `id`.
pub fn ev_of(ch: &CmEventChannel, id: ConnId) -> CmEvent {
    wait_ev(ch, "connection", |e| e.conn_id() == Some(id))
}

/// The next connection request on `ch`.
pub fn request(ch: &CmEventChannel) -> ConnectRequest {
    match wait_ev(ch, "CONNECT_REQUEST", |e| {
        matches!(e, CmEvent::ConnectRequest(_))
    }) {
        CmEvent::ConnectRequest(r) => r,
        other => panic!("{other:?}"),
    }
}

/// The next request error on `ch`.
pub fn request_error(ch: &CmEventChannel) -> Error {
    match wait_ev(ch, "REQUEST_ERROR", |e| {
        matches!(e, CmEvent::RequestError { .. })
    }) {
        CmEvent::RequestError { error, .. } => error,
        other => panic!("{other:?}"),
    }
}

/// The Established event of `id`, with its information.
pub fn established(ch: &CmEventChannel, id: ConnId) -> ConnectionInfo {
    match ev_of(ch, id) {
        CmEvent::Established { info, .. } => info,
        other => panic!("expected ESTABLISHED for {id}, got {other:?}"),
    }
}

/// The Disconnected event of `id` (then its TimewaitExit), returning the reason.
pub fn disconnected(ch: &CmEventChannel, id: ConnId) -> DisconnectReason {
    let reason = match ev_of(ch, id) {
        CmEvent::Disconnected { reason, .. } => reason,
        other => panic!("expected DISCONNECTED for {id}, got {other:?}"),
    };
    match ev_of(ch, id) {
        CmEvent::TimewaitExit { .. } => {}
        other => panic!("expected TIMEWAIT_EXIT for {id}, got {other:?}"),
    }
    reason
}

/// Asserts that no event arrives on `ch` within `d`.
pub fn no_event(ch: &CmEventChannel, d: Duration) {
    if let Ok(ev) = ch.get_event(Some(d)) {
        panic!("unexpected event {ev:?}");
    }
}

/// Posts a receive of `len` bytes at `off` of `mr`.
pub fn post_recv(qp: &QueuePair, mr: &MemoryRegion, off: usize, len: usize, wr_id: u64) {
    qp.post_recv(&RecvWr {
        wr_id,
        sgl: SgList::single(mr.sge(off, len as u32).unwrap()),
    })
    .unwrap();
}

/// Posts a signalled Send of `len` bytes at `off` of `mr`.
pub fn post_send(qp: &QueuePair, mr: &MemoryRegion, off: usize, len: usize, wr_id: u64) {
    let sgl = if len == 0 {
        SgList::new()
    } else {
        SgList::single(mr.sge(off, len as u32).unwrap())
    };
    qp.post_send(&SendWr {
        wr_id,
        op: SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        payload: Payload::Sgl(sgl),
        signaled: true,
        fence: false,
    })
    .unwrap();
}

/// Waits until `f` holds (at most [`WAIT`]).
pub fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}
