//! The RNR wait (`Timers::rnr_wait`): a Send (or Immediate Data) that finds no receive posted
//! is held, header complete, and nothing more is read, until a receive is posted (then the
//! next `recv_from` goes on, bytes read ahead past the header first) or the bound passes
//! (then exactly the Terminate the QP sent without the wait). Made-up instants, every byte
//! split, with and without the runtime's staging buffer, RQ and SRQ.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use softwarp_engine::event::AsyncEvent;
use softwarp_engine::fault::{Cause, Fault};
use softwarp_engine::mr::Access;
use softwarp_engine::qp::{
    QpState, ReadUntil, RecvEnd, RxEnv, StreamConfig, Timers, VectoredRead, STAGE_LEN,
};
use softwarp_engine::wr::{RecvWr, SendOp, SgList, WcOpcode, WcStatus, WorkCompletion};

use crate::util::{contents, qp_config, sge, signaled_wr, CutReader, Rng, Side};

const WAIT: Duration = Duration::from_millis(100);
const MS: Duration = Duration::from_millis(1);
/// Bytes of each receive buffer.
const SLOT: usize = 8192;

fn timers(wait: Option<Duration>) -> Timers {
    Timers {
        rnr_wait: wait,
        ..Timers::default()
    }
}

/// One `recv_from` of `b` from `src` (staged when `stage` is not empty), then its
/// completions and events moved out.
fn recv(b: &mut Side, src: &mut impl VectoredRead, stage: &mut [u8]) -> RecvEnd {
    let mut budget = usize::MAX;
    let mut res = RxEnv {
        mrs: &mut b.mrs,
        srq: b.srq.as_mut(),
    };
    let end =
        b.qp.recv_from(src, stage, &mut budget, ReadUntil::WouldBlock, &mut res);
    b.pump();
    end
}

/// The messages a sends: Sends of several sizes (one of several FPDUs), with Solicited
/// Event, an RDMA Write between them, a Send with Immediate (two receives); returns the
/// payload each receive must get, in order (`None`: an Immediate Data receive, with its
/// value).
fn post_messages(a: &mut Side, b: &mut Side) -> (Vec<Result<Vec<u8>, u32>>, Vec<u8>) {
    let sizes = [64usize, 5000, 1, 0, 300, 4096, 2000, 17];
    let total: usize = sizes.iter().sum::<usize>() + 3000 + 100;
    let (_src, s_stag, s_iova, data) = a.filled_region(total, Access::NONE, 7);
    let (_w, w_stag, w_iova) = b.region(3000, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let mut expect = Vec::new();
    let mut at = 0usize;
    let mut id = 1;
    for (i, &len) in sizes.iter().enumerate() {
        let sgl = SgList::single(sge(s_stag, s_iova, at as u64, len as u32));
        let op = SendOp::Send {
            solicited: i % 3 == 1,
            invalidate: None,
        };
        a.qp.post_send(&signaled_wr(id, op, sgl), &a.mrs).unwrap();
        expect.push(Ok(data[at..at + len].to_vec()));
        at += len;
        id += 1;
        if i == 2 {
            let sgl = SgList::single(sge(s_stag, s_iova, at as u64, 3000));
            let op = SendOp::Write {
                remote_addr: w_iova,
                rkey: w_stag,
            };
            a.qp.post_send(&signaled_wr(id, op, sgl), &a.mrs).unwrap();
            at += 3000;
            id += 1;
        }
        if i == 5 {
            let sgl = SgList::single(sge(s_stag, s_iova, at as u64, 100));
            let op = SendOp::SendWithImm {
                solicited: false,
                imm: 0xfeed,
            };
            a.qp.post_send(&signaled_wr(id, op, sgl), &a.mrs).unwrap();
            expect.push(Ok(data[at..at + 100].to_vec()));
            expect.push(Err(0xfeed));
            at += 100;
            id += 1;
        }
    }
    let mut wire = Vec::new();
    a.transmit(&mut wire, || usize::MAX);
    (expect, wire)
}

/// Posts receive `k` (a slot of `SLOT` bytes of `buf`) to b's RQ or SRQ.
fn post(b: &mut Side, stag: softwarp_engine::mr::Stag, iova: u64, k: usize) {
    let wr = RecvWr {
        wr_id: 1000 + k as u64,
        sgl: SgList::single(sge(stag, iova, (k * SLOT) as u64, SLOT as u32)),
    };
    match b.srq.as_mut() {
        Some(srq) => srq.post_recv(wr).unwrap(),
        None => b.qp.post_recv(wr).unwrap(),
    }
}

/// Runs the messages of [`post_messages`] into b, which posts one receive to begin with and
/// another only each time the QP holds a Send for one; checks that a held QP reads nothing
/// more, still sends, and that every message lands whole and in order.
fn run(srq: bool, staged: bool, mut piece: impl FnMut() -> usize) {
    let s = StreamConfig::for_mss(1448);
    let mut a = Side::new(1, s);
    let mut b = Side::with_config(qp_config(2, srq), s);
    let t0 = Instant::now();
    b.qp.set_timers(timers(Some(WAIT)), t0);
    let (expect, wire) = post_messages(&mut a, &mut b);
    let (buf, stag, iova) = b.region(SLOT * expect.len(), Access::LOCAL_WRITE);
    // For b's Send back to a while held.
    let (_back_src, bs_stag, bs_iova, _) = b.filled_region(64, Access::NONE, 9);
    let (_back_dst, bd_stag, bd_iova) = a.region(64, Access::LOCAL_WRITE);
    a.qp.post_recv(RecvWr {
        wr_id: 77,
        sgl: SgList::single(sge(bd_stag, bd_iova, 0, 64)),
    })
    .unwrap();
    let mut stage = if staged {
        vec![0u8; STAGE_LEN]
    } else {
        Vec::new()
    };
    let mut src = CutReader {
        data: &wire,
        at: 0,
        piece: &mut piece,
    };
    let mut posted = 0;
    post(&mut b, stag, iova, posted);
    posted += 1;
    let mut waits = 0;
    let mut sent_back = false;
    let mut wcs: Vec<WorkCompletion> = Vec::new();
    for _ in 0..1_000_000 {
        let end = recv(&mut b, &mut src, &mut stage);
        wcs.extend(std::iter::from_fn(|| b.recv_cq.poll()));
        match end {
            RecvEnd::NoReceive => {
                assert!(b.qp.rnr_waiting());
                assert!(!b.qp.rx_in_fpdu(), "the wait is on this side");
                waits += 1;
                // Held: another call reads nothing.
                let at = src.at;
                assert!(matches!(
                    recv(&mut b, &mut src, &mut stage),
                    RecvEnd::NoReceive
                ));
                assert_eq!(src.at, at, "a held QP read on");
                // The clock asks for a look at once, then at the bound.
                let now = t0 + MS * waits;
                assert!(b.qp.poll_timeout().is_some_and(|t| t < now), "at once");
                assert!(!b.qp.handle_timeout(now));
                assert_eq!(b.qp.poll_timeout(), Some(now + WAIT));
                if !sent_back {
                    // Sending goes on while held.
                    let sgl = SgList::single(sge(bs_stag, bs_iova, 0, 64));
                    let op = SendOp::Send {
                        solicited: false,
                        invalidate: None,
                    };
                    b.qp.post_send(&signaled_wr(5, op, sgl), &b.mrs).unwrap();
                    let mut back = Vec::new();
                    assert!(b.transmit(&mut back, || usize::MAX) > 0);
                    a.receive(&back, || usize::MAX);
                    assert_eq!(a.recv_wcs()[0].status, WcStatus::Success);
                    sent_back = true;
                }
                assert!(posted < expect.len(), "held with every receive posted");
                post(&mut b, stag, iova, posted);
                posted += 1;
                if srq {
                    assert!(b.srq.as_mut().unwrap().take_rnr_waiting());
                }
            }
            RecvEnd::Drained if src.at == wire.len() && !b.qp.rnr_waiting() => break,
            RecvEnd::Drained => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(src.at, wire.len());
    assert!(waits >= 1, "never held");
    assert_eq!(b.qp.stats().rx_rnr_waits, u64::from(waits));
    assert_eq!(b.qp.stats().rx_rnr_expired, 0);
    assert!(b.events.is_empty(), "{:?}", b.events);
    assert_eq!(b.qp.state(), QpState::Rts);
    assert_eq!(wcs.len(), expect.len(), "{wcs:?}");
    let got = contents(&buf);
    for (k, (wc, want)) in wcs.iter().zip(&expect).enumerate() {
        assert_eq!(wc.wr_id, 1000 + k as u64);
        assert_eq!(wc.status, WcStatus::Success);
        match want {
            Ok(data) => {
                assert_eq!(wc.opcode, WcOpcode::Recv);
                assert_eq!(wc.byte_len as usize, data.len(), "receive {k}");
                assert_eq!(&got[k * SLOT..k * SLOT + data.len()], &data[..], "{k}");
            }
            Err(imm) => assert_eq!(wc.imm, Some(*imm), "receive {k}"),
        }
    }
    assert_eq!(b.qp.poll_timeout(), None, "no timer after the last wait");
}

#[test]
fn a_send_without_a_receive_waits_and_a_posted_receive_resumes_it_in_every_split() {
    for srq in [false, true] {
        run(srq, true, || usize::MAX);
        run(srq, false, || usize::MAX);
        run(srq, false, || 1);
        run(srq, true, || 1);
        for seed in 0..12 {
            let mut rng = Rng::new(seed);
            run(srq, seed % 2 == 0, move || rng.piece(3000));
        }
    }
}

/// Bytes b sends after receiving `wire` (a's messages, no receive posted) with the clock
/// `wait`, the bound ended after `ended` when it waits; with its events.
fn terminate_of(wire: &[u8], wait: Option<Duration>, staged: bool) -> (Vec<u8>, Side) {
    let s = StreamConfig::for_mss(1448);
    let mut b = Side::new(2, s);
    let t0 = Instant::now();
    b.qp.set_timers(timers(wait), t0);
    let mut stage = if staged {
        vec![0u8; STAGE_LEN]
    } else {
        Vec::new()
    };
    let mut src = CutReader {
        data: wire,
        at: 0,
        piece: || 700,
    };
    let end = recv(&mut b, &mut src, &mut stage);
    if wait.is_some() {
        assert!(matches!(end, RecvEnd::NoReceive), "{end:?}");
        let t1 = t0 + 3 * MS;
        assert!(!b.qp.handle_timeout(t1), "the first look starts the wait");
        assert_eq!(b.qp.poll_timeout(), Some(t1 + WAIT));
        assert!(
            !b.qp.handle_timeout(t1 + WAIT - MS),
            "just short of the bound"
        );
        assert!(b.qp.rnr_waiting());
        assert_eq!(b.qp.state(), QpState::Rts);
        assert!(b.qp.handle_timeout(t1 + WAIT), "the bound passed");
        assert!(!b.qp.rnr_waiting());
        assert_eq!(b.qp.stats().rx_rnr_expired, 1);
        // The rest of the FPDU is read and checked; then the Terminate.
        let end = recv(&mut b, &mut src, &mut stage);
        assert!(matches!(end, RecvEnd::Drained), "{end:?}");
    }
    let mut out = Vec::new();
    b.transmit(&mut out, || usize::MAX);
    b.pump();
    (out, b)
}

#[test]
fn an_rnr_wait_that_runs_out_ends_in_the_terminate_sent_without_the_wait() {
    for staged in [false, true] {
        let s = StreamConfig::for_mss(1448);
        let mut a = Side::new(1, s);
        let (_src, s_stag, s_iova, _) = a.filled_region(5000, Access::NONE, 1);
        for (id, len) in [(1, 5000u32), (2, 10)] {
            let sgl = SgList::single(sge(s_stag, s_iova, 0, len));
            let op = SendOp::Send {
                solicited: false,
                invalidate: None,
            };
            a.qp.post_send(&signaled_wr(id, op, sgl), &a.mrs).unwrap();
        }
        let mut wire = Vec::new();
        a.transmit(&mut wire, || usize::MAX);
        let (then, old) = terminate_of(&wire, None, staged);
        let (now, new) = terminate_of(&wire, Some(WAIT), staged);
        assert!(!then.is_empty());
        assert_eq!(now, then, "the same Terminate");
        assert_eq!(new.events, old.events);
        assert!(new.events.iter().any(|e| matches!(
            e,
            AsyncEvent::QpRequestError {
                cause: Cause::Detected(Fault::NoReceiveBuffer),
                ..
            }
        )));
        assert_eq!(new.qp.state(), old.qp.state());
        assert!(new.qp.terminate_sent());
    }
}

#[test]
fn turning_the_wait_off_fails_a_held_send_and_a_reset_qp_forgets_it() {
    let s = StreamConfig::for_mss(1448);
    let mut a = Side::new(1, s);
    let (_src, s_stag, s_iova, _) = a.filled_region(100, Access::NONE, 1);
    let sgl = SgList::single(sge(s_stag, s_iova, 0, 100));
    let op = SendOp::Send {
        solicited: false,
        invalidate: None,
    };
    a.qp.post_send(&signaled_wr(1, op, sgl), &a.mrs).unwrap();
    let mut wire = Vec::new();
    a.transmit(&mut wire, || usize::MAX);
    let mut b = Side::new(2, s);
    b.qp.set_timers(timers(Some(Duration::MAX)), Instant::now());
    let mut stage = vec![0u8; STAGE_LEN];
    let mut src = CutReader {
        data: &wire,
        at: 0,
        piece: || usize::MAX,
    };
    assert!(matches!(
        recv(&mut b, &mut src, &mut stage),
        RecvEnd::NoReceive
    ));
    // An unbounded wait asks for one look (to start it), then for none.
    let t = Instant::now();
    assert!(b.qp.poll_timeout().is_some());
    assert!(!b.qp.handle_timeout(t));
    assert_eq!(b.qp.poll_timeout(), None);
    b.qp.set_rnr_wait(None);
    assert!(!b.qp.rnr_waiting());
    assert!(matches!(
        recv(&mut b, &mut src, &mut stage),
        RecvEnd::Drained
    ));
    let mut out = Vec::new();
    b.transmit(&mut out, || usize::MAX);
    assert!(b.qp.terminate_sent());
    b.pump();
    assert!(b.events.iter().any(|e| matches!(
        e,
        AsyncEvent::QpRequestError {
            cause: Cause::Detected(Fault::NoReceiveBuffer),
            ..
        }
    )));
}

#[test]
fn a_qp_that_closes_drops_a_held_send_and_what_follows_without_a_terminate() {
    for (close_first, staged) in [(true, true), (true, false), (false, true), (false, false)] {
        let s = StreamConfig::for_mss(1448);
        let mut a = Side::new(1, s);
        let (_src, s_stag, s_iova, _) = a.filled_region(3000, Access::NONE, 1);
        for id in 1..=3 {
            let sgl = SgList::single(sge(s_stag, s_iova, 0, 3000));
            let op = SendOp::Send {
                solicited: false,
                invalidate: None,
            };
            a.qp.post_send(&signaled_wr(id, op, sgl), &a.mrs).unwrap();
        }
        let mut wire = Vec::new();
        a.transmit(&mut wire, || usize::MAX);
        let mut b = Side::new(2, s);
        b.qp.set_timers(timers(Some(WAIT)), Instant::now());
        let mut stage = if staged {
            vec![0u8; STAGE_LEN]
        } else {
            Vec::new()
        };
        let mut src = CutReader {
            data: &wire,
            at: 0,
            piece: || 1000,
        };
        if close_first {
            // Closing before the Sends come: the first one finds no receive.
            b.qp.modify(QpState::Closing).unwrap();
        } else {
            assert!(matches!(
                recv(&mut b, &mut src, &mut stage),
                RecvEnd::NoReceive
            ));
            b.qp.modify(QpState::Closing).unwrap();
        }
        assert!(!b.qp.rnr_waiting());
        assert!(matches!(
            recv(&mut b, &mut src, &mut stage),
            RecvEnd::Drained
        ));
        if staged {
            // (A reader without a staging buffer has nowhere to drop bytes into.)
            assert_eq!(src.at, wire.len(), "the rest is read (and dropped)");
        }
        let mut out = Vec::new();
        b.transmit(&mut out, || usize::MAX);
        assert!(out.is_empty(), "no Terminate");
        assert!(!b.qp.terminate_sent());
        assert!(b.events.is_empty(), "{:?}", b.events);
        assert_eq!(b.qp.stats().rx.send.messages, 0);
    }
}
