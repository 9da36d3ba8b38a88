//! The QP's clock (`Qp::set_timers`, `poll_timeout`, `handle_timeout`): the receive stall
//! and the first-FPDU hold decided by the engine from instants the test makes up, so each
//! rule runs in full without sleeping.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use softwarp_engine::event::AsyncEvent;
use softwarp_engine::fault::{Cause, Fault};
use softwarp_engine::mr::Access;
use softwarp_engine::qp::{QpState, StreamConfig, Timers};
use softwarp_engine::wr::{SendOp, SgList, WcStatus};

use crate::util::{contents, sge, signaled_wr, Side};

const MS: Duration = Duration::from_millis(1);
const STALL: Duration = Duration::from_secs(1);
/// The look period of a 1 s stall timeout: a quarter of it.
const PERIOD: Duration = Duration::from_millis(250);
const LEN: usize = 4000;

/// Two established sides, a's RDMA Write of `LEN` pattern bytes into b's region posted;
/// returns them with b's region and the bytes the Write must leave there.
fn write_pair(
    crc: bool,
) -> (
    Side,
    Side,
    std::sync::Arc<softwarp_engine::memory::Region>,
    Vec<u8>,
) {
    let mut s = StreamConfig::for_mss(1448);
    s.crc = crc;
    let (mut a, mut b) = (Side::new(1, s), Side::new(2, s));
    let (_src, s_stag, s_iova, data) = a.filled_region(LEN, Access::NONE, 3);
    let (dst, d_stag, d_iova) = b.region(LEN, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let op = SendOp::Write {
        remote_addr: d_iova,
        rkey: d_stag,
    };
    let sgl = SgList::single(sge(s_stag, s_iova, 0, LEN as u32));
    a.qp.post_send(&signaled_wr(1, op, sgl), &a.mrs).unwrap();
    // The source stays registered (and alive) in a's table.
    (a, b, dst, data)
}

fn wire_of(a: &mut Side) -> Vec<u8> {
    let mut wire = Vec::new();
    a.transmit(&mut wire, || usize::MAX);
    wire
}

#[test]
fn a_peer_stopped_inside_an_fpdu_is_terminated_once_a_look_finds_no_byte_for_the_timeout() {
    for crc in [false, true] {
        let (mut a, mut b, _dst, _) = write_pair(crc);
        let wire = wire_of(&mut a);
        let t0 = Instant::now();
        let timers = Timers {
            rx_stall: Some(STALL),
            first_fpdu_hold: None,
            responder_gate: None,
            rnr_wait: None,
        };
        assert_eq!(timers.look_period(), Some(PERIOD));
        b.qp.set_timers(timers, t0);
        assert_eq!(b.qp.poll_timeout(), None, "between FPDUs no timer runs");
        assert!(
            !b.qp.handle_timeout(t0 + 10 * STALL),
            "nothing to find between FPDUs"
        );

        b.receive(&wire[..100], || usize::MAX);
        assert!(b.qp.rx_in_fpdu());
        // The clock has not looked since the peer entered an FPDU: a look is due at once.
        assert_eq!(b.qp.poll_timeout(), Some(t0 + 10 * STALL));
        let t1 = t0 + 11 * STALL;
        assert!(!b.qp.handle_timeout(t1));
        assert_eq!(b.qp.poll_timeout(), Some(t1 + PERIOD));
        for k in 1..4 {
            assert!(!b.qp.handle_timeout(t1 + k * PERIOD), "look {k}");
        }
        assert!(
            !b.qp.handle_timeout(t1 + STALL - MS),
            "just short of the timeout"
        );
        assert_eq!(b.qp.state(), QpState::Rts);

        assert!(b.qp.handle_timeout(t1 + STALL), "the stall is found");
        assert_eq!(b.qp.state(), QpState::Terminate);
        assert!(!b.qp.rx_in_fpdu());
        assert_eq!(b.qp.poll_timeout(), None, "no look after the stream ended");
        let mut out = Vec::new();
        assert!(
            b.transmit(&mut out, || usize::MAX) > 0,
            "the Terminate goes out"
        );
        assert!(b.qp.terminate_sent());
        b.pump();
        assert!(
            b.events.iter().any(|e| matches!(
                e,
                AsyncEvent::QpFatal {
                    cause: Cause::Detected(Fault::RxStall),
                    ..
                }
            )),
            "{:?}",
            b.events
        );
    }
}

#[test]
fn bytes_arriving_between_looks_keep_a_slow_peer_alive_for_any_total_time() {
    let (mut a, mut b, dst, data) = write_pair(true);
    let wire = wire_of(&mut a);
    let t0 = Instant::now();
    b.qp.set_timers(
        Timers {
            rx_stall: Some(STALL),
            first_fpdu_hold: None,
            responder_gate: None,
            rnr_wait: None,
        },
        t0,
    );
    // Seven bytes per look, a look every 900 ms: the whole Write takes about ten minutes,
    // and no look ever sees the same byte count for a second.
    let mut now = t0;
    let mut at = 0;
    while at < wire.len() {
        let n = 7.min(wire.len() - at);
        assert_eq!(b.receive(&wire[at..at + n], || usize::MAX), n);
        at += n;
        now += Duration::from_millis(900);
        if b.qp.poll_timeout().is_some_and(|t| t <= now) {
            assert!(!b.qp.handle_timeout(now), "no stall at byte {at}");
        }
        assert_eq!(b.qp.state(), QpState::Rts, "byte {at}");
    }
    assert!(!b.qp.rx_in_fpdu());
    assert_eq!(b.qp.poll_timeout(), None);
    assert_eq!(contents(&dst), data);
}

#[test]
fn the_first_fpdu_hold_queues_posted_work_until_the_clock_ends_it() {
    let (mut a, mut b, dst, data) = write_pair(false);
    let t0 = Instant::now();
    let hold = 20 * MS;
    a.qp.set_timers(
        Timers {
            rx_stall: None,
            first_fpdu_hold: Some(hold),
            responder_gate: None,
            rnr_wait: None,
        },
        t0,
    );
    assert!(a.qp.is_held());
    assert!(wire_of(&mut a).is_empty(), "nothing leaves during the hold");
    assert_eq!(a.qp.poll_timeout(), Some(t0 + hold));
    assert!(!a.qp.handle_timeout(t0 + hold - MS));
    assert!(wire_of(&mut a).is_empty());

    assert!(a.qp.handle_timeout(t0 + hold), "the hold ends");
    assert!(!a.qp.is_held());
    assert_eq!(a.qp.poll_timeout(), None);
    let wire = wire_of(&mut a);
    assert!(!wire.is_empty());
    assert_eq!(b.receive(&wire, || usize::MAX), wire.len());
    assert_eq!(contents(&dst), data);
    let wcs = a.send_wcs();
    assert_eq!(wcs.len(), 1);
    assert_eq!(wcs[0].status, WcStatus::Success);
}

#[test]
fn a_terminate_is_not_held() {
    let (mut a, _b, _dst, _) = write_pair(false);
    let t0 = Instant::now();
    a.qp.set_timers(
        Timers {
            rx_stall: None,
            first_fpdu_hold: Some(Duration::from_secs(60)),
            responder_gate: None,
            rnr_wait: None,
        },
        t0,
    );
    a.qp.modify(QpState::Error).unwrap();
    assert!(!a.qp.is_held(), "a failed QP holds nothing back");
    assert!(
        !wire_of(&mut a).is_empty(),
        "the Terminate goes out at once"
    );
    assert!(a.qp.terminate_sent());
}

#[test]
fn without_timers_no_timer_runs() {
    let (mut a, mut b, _dst, _) = write_pair(false);
    let wire = wire_of(&mut a);
    b.receive(&wire[..100], || usize::MAX);
    assert!(b.qp.rx_in_fpdu());
    assert_eq!(b.qp.poll_timeout(), None);
    assert!(!b
        .qp
        .handle_timeout(Instant::now() + Duration::from_secs(3600)));
    assert_eq!(b.qp.state(), QpState::Rts);
}

#[test]
fn the_close_hold_runs_until_its_instant_and_never_grows() {
    let s = StreamConfig::for_mss(1448);
    let mut a = Side::new(1, s);
    let t0 = Instant::now();
    a.qp.set_timers(Timers::default(), t0);
    assert!(!a.qp.close_held());
    assert_eq!(a.qp.poll_timeout(), None);
    a.qp.hold_close(t0 + 50 * MS);
    assert!(a.qp.close_held());
    assert_eq!(a.qp.poll_timeout(), Some(t0 + 50 * MS));
    // A later hold keeps the earlier instant.
    a.qp.hold_close(t0 + 2000 * MS);
    assert_eq!(a.qp.poll_timeout(), Some(t0 + 50 * MS));
    assert!(!a.qp.handle_timeout(t0 + 49 * MS));
    assert!(a.qp.close_held());
    assert!(
        a.qp.handle_timeout(t0 + 50 * MS),
        "the hold ends: the runtime closes"
    );
    assert!(!a.qp.close_held());
    assert_eq!(a.qp.poll_timeout(), None);
    // An earlier one shortens it.
    a.qp.hold_close(t0 + 900 * MS);
    a.qp.hold_close(t0 + 100 * MS);
    assert_eq!(a.qp.poll_timeout(), Some(t0 + 100 * MS));
    assert_eq!(
        a.qp.state(),
        QpState::Rts,
        "the hold leaves the QP's state alone"
    );
}

/// RFC 5044's responder gate, bounded: the responder's Write waits for the initiator's first
/// FPDU until the bound, then leaves; a gate without a bound waits for ever.
#[test]
fn the_responders_gate_opens_at_its_bound_without_the_initiators_first_fpdu() {
    for bound in [Some(200 * MS), None] {
        let mut s = StreamConfig::for_mss(1448);
        s.responder_waits = true;
        let (mut a, mut b) = (Side::new(1, s), Side::new(2, StreamConfig::for_mss(1448)));
        let (_src, s_stag, s_iova, data) = a.filled_region(LEN, Access::NONE, 3);
        let (dst, d_stag, d_iova) = b.region(LEN, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        let op = SendOp::Write {
            remote_addr: d_iova,
            rkey: d_stag,
        };
        let sgl = SgList::single(sge(s_stag, s_iova, 0, LEN as u32));
        a.qp.post_send(&signaled_wr(1, op, sgl), &a.mrs).unwrap();
        let t0 = Instant::now();
        a.qp.set_timers(
            Timers {
                rx_stall: None,
                first_fpdu_hold: None,
                responder_gate: bound,
                rnr_wait: None,
            },
            t0,
        );
        assert!(wire_of(&mut a).is_empty(), "the gate holds the Write");
        assert_eq!(a.qp.poll_timeout(), bound.map(|d| t0 + d));
        let Some(bound) = bound else {
            assert!(!a.qp.handle_timeout(t0 + 3600 * 1000 * MS));
            assert!(wire_of(&mut a).is_empty(), "no bound: the gate waits");
            continue;
        };
        assert!(!a.qp.handle_timeout(t0 + bound - MS));
        assert!(wire_of(&mut a).is_empty());
        assert!(a.qp.handle_timeout(t0 + bound), "the bound opens the gate");
        assert_eq!(a.qp.poll_timeout(), None);
        let wire = wire_of(&mut a);
        assert_eq!(b.receive(&wire, || usize::MAX), wire.len());
        assert_eq!(contents(&dst), data);
    }
}
