//! QP lifecycle and queue semantics: flush on modify-to-error and destroy, posts in error,
//! CQ overflow, SRQ limit, Send with Invalidate, ORD, completion ordering, received
//! Terminates, local protection errors, RTR, graceful close.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::util::{contents, qp_config, sge, signaled_wr, CutReader, Pair, Side, Split};
use softwarp_engine::cq::{Cq, CqId};
use softwarp_engine::event::AsyncEvent;
use softwarp_engine::fault::Cause;
use softwarp_engine::mr::{Access, Stag};
use softwarp_engine::qp::{
    QpError, QpState, ReadUntil, RecvEnd, Rtr, RtrKind, RxEnv, StreamConfig,
};
use softwarp_engine::srq::SrqId;
use softwarp_engine::wr::{Payload, RecvWr, SendOp, SendWr, SgList, WcOpcode, WcStatus};

fn stream() -> StreamConfig {
    let mut s = StreamConfig::for_mss(1448);
    s.crc = true;
    s
}

fn send_wr(wr_id: u64, sgl: SgList, signaled: bool) -> SendWr<'static> {
    SendWr {
        wr_id,
        op: SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        payload: Payload::Sgl(sgl),
        signaled,
        fence: false,
    }
}

fn recv(side: &mut Side, wr_id: u64, stag: Stag, iova: u64, len: u32) {
    side.qp
        .post_recv(RecvWr {
            wr_id,
            sgl: SgList::single(sge(stag, iova, 0, len)),
        })
        .unwrap();
}

#[test]
fn modify_to_error_flushes_every_outstanding_wr_in_order_and_tells_the_peer() {
    let mut p = Pair::new(Split::Whole, stream());
    let (_s, stag, iova, _) = p.a.filled_region(1 << 16, Access::NONE, 1);
    let (_r, rstag, riova) = p.a.region(4096, Access::LOCAL_WRITE);
    for i in 0..5 {
        p.a.qp
            .post_send(
                &send_wr(i, SgList::single(sge(stag, iova, 0, 60_000)), i % 2 == 0),
                &p.a.mrs,
            )
            .unwrap();
    }
    for i in 10..13 {
        recv(&mut p.a, i, rstag, riova, 4096);
    }
    // Transmit one FPDU (the writer fills up after it; its bytes are lost on the way),
    // then fail the QP.
    let mut wire = Vec::new();
    assert_eq!(p.a.transmit_limited(&mut wire, 2), 2);
    let ulpdu = usize::from(u16::from_be_bytes([wire[0], wire[1]]));
    let fpdu = 2 + ulpdu + (4 - (2 + ulpdu) % 4) % 4 + 4;
    p.a.transmit_limited(&mut wire, fpdu - 2);
    assert_eq!(wire.len(), fpdu);
    p.a.qp.modify(QpState::Error).unwrap();
    assert_eq!(p.a.qp.state(), QpState::Error);
    let sends = p.a.send_wcs();
    assert_eq!(
        sends.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4]
    );
    assert!(sends.iter().all(|w| w.status == WcStatus::WrFlushErr));
    let recvs = p.a.recv_wcs();
    assert_eq!(
        recvs.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        vec![10, 11, 12]
    );
    assert!(recvs.iter().all(|w| w.status == WcStatus::WrFlushErr));
    assert_eq!(p.a.qp.stats().flushed, 8);
    // The peer learns about it from a Terminate (RDMAP local catastrophic error).
    p.drive();
    assert!(
        p.b.events.iter().any(|e| matches!(
            e,
            AsyncEvent::QpFatal {
                cause: Cause::PeerTerminate {
                    layer: 0,
                    etype: 0,
                    code: 0
                },
                ..
            }
        )),
        "{:?}",
        p.b.events
    );
    assert_eq!(p.b.qp.state(), QpState::Error);
}

#[test]
fn posts_in_error_complete_at_once_with_flush_status() {
    let mut s = Side::new(1, stream());
    let (_r, stag, iova) = s.region(64, Access::LOCAL_WRITE);
    s.qp.modify(QpState::Error).unwrap();
    s.qp.post_send(
        &send_wr(1, SgList::single(sge(stag, iova, 0, 8)), false),
        &s.mrs,
    )
    .unwrap();
    recv(&mut s, 2, stag, iova, 64);
    assert_eq!(s.send_wcs()[0].status, WcStatus::WrFlushErr);
    assert_eq!(s.recv_wcs()[0].status, WcStatus::WrFlushErr);
}

#[test]
fn destroy_flushes_everything_and_refuses_later_posts() {
    let mut s = Side::new(1, stream());
    let (_r, stag, iova) = s.region(64, Access::LOCAL_WRITE);
    recv(&mut s, 1, stag, iova, 64);
    s.qp.post_send(
        &send_wr(2, SgList::single(sge(stag, iova, 0, 8)), true),
        &s.mrs,
    )
    .unwrap();
    s.qp.destroy();
    assert_eq!(s.send_wcs()[0].status, WcStatus::WrFlushErr);
    assert_eq!(s.recv_wcs()[0].status, WcStatus::WrFlushErr);
    assert_eq!(
        s.qp.post_recv(RecvWr {
            wr_id: 3,
            sgl: SgList::new()
        }),
        Err(QpError::Destroyed)
    );
    // References held by the flushed WRs are gone: nothing holds the MR's memory any more.
    assert_eq!(s.mrs.deregister(stag), Ok(0));
}

#[test]
fn deregister_while_a_posted_wr_uses_the_mr_invalidates_at_once_and_the_wr_finishes() {
    let mut p = Pair::new(Split::Whole, stream());
    let (_s, stag, iova, _) = p.a.filled_region(64, Access::NONE, 1);
    let (_r, rstag, riova) = p.b.region(64, Access::LOCAL_WRITE);
    recv(&mut p.b, 1, rstag, riova, 64);
    p.a.qp
        .post_send(
            &send_wr(1, SgList::single(sge(stag, iova, 0, 64)), true),
            &p.a.mrs,
        )
        .unwrap();
    let memory = p.a.mrs.memory(stag).unwrap();
    assert_eq!(
        p.a.mrs.deregister(stag),
        Ok(1),
        "the posted WR holds the memory"
    );
    assert!(p.a.mrs.info(stag).is_none(), "the STag is gone at once");
    assert_eq!(memory.strong_count(), 1);
    p.drive();
    assert_eq!(p.a.send_wcs()[0].status, WcStatus::Success);
    assert_eq!(memory.strong_count(), 0, "released once the WR completed");
    assert_eq!(p.a.mrs.releasing(), 0);
}

#[test]
fn cq_overflow_is_reported_as_an_async_event_and_the_completion_is_not_lost() {
    let mut p = Pair::new(Split::Whole, stream());
    p.a.send_cq = Cq::new(CqId(40), 2);
    let (_s, stag, iova, _) = p.a.filled_region(64, Access::NONE, 1);
    let (_r, rstag, riova) = p.b.region(64, Access::LOCAL_WRITE);
    for i in 0..3 {
        recv(&mut p.b, i, rstag, riova, 64);
        p.a.qp
            .post_send(
                &send_wr(i, SgList::single(sge(stag, iova, 0, 8)), true),
                &p.a.mrs,
            )
            .unwrap();
    }
    p.drive();
    // The third completion did not fit: handed back, CQ in error, event raised.
    assert_eq!(
        p.a.refused.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        vec![2]
    );
    assert!(p.a.send_cq.is_error());
    assert!(p.a.events.contains(&AsyncEvent::CqError { cq: CqId(40) }));
    assert_eq!(p.a.send_cq.refused(), 1);
}

#[test]
fn srq_feeds_sends_in_order_and_fires_its_limit_event_once() {
    let a = Side::new(1, stream());
    let b = Side::with_config(qp_config(2, true), stream());
    let mut p = Pair::from_sides(a, b, Split::Random { seed: 3, max: 100 });
    let (_s, stag, iova, data) = p.a.filled_region(4096, Access::NONE, 5);
    let (dst, rstag, riova) = p.b.region(8 * 512, Access::LOCAL_WRITE);
    let srq = p.b.srq.as_mut().unwrap();
    assert_eq!(srq.id(), SrqId(1));
    for i in 0..8u64 {
        srq.post_recv(RecvWr {
            wr_id: 100 + i,
            sgl: SgList::single(sge(rstag, riova, i * 512, 512)),
        })
        .unwrap();
    }
    srq.arm_limit(5);
    assert_eq!(
        p.b.qp.post_recv(RecvWr {
            wr_id: 1,
            sgl: SgList::new()
        }),
        Err(QpError::WrongReceiveQueue("receives from an SRQ"))
    );
    for i in 0..4u64 {
        p.a.qp
            .post_send(
                &send_wr(i, SgList::single(sge(stag, iova, i * 100, 100)), true),
                &p.a.mrs,
            )
            .unwrap();
    }
    p.drive();
    let wcs = p.b.recv_wcs();
    assert_eq!(
        wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        vec![100, 101, 102, 103]
    );
    let got = contents(&dst);
    for i in 0..4 {
        assert_eq!(&got[i * 512..i * 512 + 100], &data[i * 100..i * 100 + 100]);
    }
    let limits =
        p.b.events
            .iter()
            .filter(|e| matches!(e, AsyncEvent::SrqLimitReached { srq: SrqId(1) }))
            .count();
    assert_eq!(limits, 1);
}

#[test]
fn srq_receive_blocks_until_completions_are_polled() {
    let mut cfg = qp_config(2, true);
    cfg.rq_depth = 1;
    let mut b = Side::with_config(cfg, stream());
    let mut a = Side::new(1, stream());
    let (_s, stag, iova, _) = a.filled_region(64, Access::NONE, 5);
    let (_d, rstag, riova) = b.region(1024, Access::LOCAL_WRITE);
    for i in 0..2u64 {
        b.srq
            .as_mut()
            .unwrap()
            .post_recv(RecvWr {
                wr_id: i,
                sgl: SgList::single(sge(rstag, riova, i * 512, 512)),
            })
            .unwrap();
        a.qp.post_send(
            &send_wr(i, SgList::single(sge(stag, iova, 0, 10)), true),
            &a.mrs,
        )
        .unwrap();
    }
    let mut wire = Vec::new();
    a.transmit(&mut wire, || usize::MAX);
    let n = b.qp.handle_rx(&wire, &mut b.mrs, b.srq.as_mut());
    assert!(
        n < wire.len(),
        "the second Send waits for a completion slot"
    );
    let mut budget = usize::MAX;
    let mut res = RxEnv {
        mrs: &mut b.mrs,
        srq: b.srq.as_mut(),
    };
    let mut src = CutReader {
        data: &wire[n..],
        at: 0,
        piece: || usize::MAX,
    };
    let end = b.qp.recv_from(
        &mut src,
        &mut [0u8; 64],
        &mut budget,
        ReadUntil::WouldBlock,
        &mut res,
    );
    assert!(matches!(end, RecvEnd::Blocked), "{end:?}");
    assert_eq!(src.at, 0, "nothing read while blocked");
    let (_, wc) = b.qp.poll_completion().unwrap();
    assert_eq!(wc.wr_id, 0);
    // The held header goes on at the next receive.
    let m = b.qp.handle_rx(&wire[n..], &mut b.mrs, b.srq.as_mut());
    assert_eq!(n + m, wire.len());
    assert_eq!(b.qp.poll_completion().unwrap().1.wr_id, 1);
}

#[test]
fn send_with_invalidate_invalidates_the_named_stag_and_reports_it() {
    let mut p = Pair::new(Split::OneByte, stream());
    let (_s, stag, iova, _) = p.a.filled_region(64, Access::NONE, 1);
    let (_r, rstag, riova) = p.b.region(64, Access::LOCAL_WRITE);
    let (_w, wstag, wiova) =
        p.b.region(64, Access::REMOTE_WRITE | Access::REMOTE_INVALIDATE);
    recv(&mut p.b, 1, rstag, riova, 64);
    p.a.qp
        .post_send(
            &SendWr {
                wr_id: 1,
                op: SendOp::Send {
                    solicited: true,
                    invalidate: Some(wstag),
                },
                payload: Payload::Sgl(SgList::single(sge(stag, iova, 0, 16))),
                signaled: true,
                fence: false,
            },
            &p.a.mrs,
        )
        .unwrap();
    p.drive();
    let wc = p.b.recv_wcs()[0];
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(wc.invalidated_stag, Some(wstag));
    assert!(wc.solicited);
    assert!(!p.b.mrs.info(wstag).unwrap().valid);
    // A later Write through the invalidated STag is refused.
    p.a.qp
        .post_send(
            &SendWr {
                wr_id: 2,
                op: SendOp::Write {
                    remote_addr: wiova,
                    rkey: wstag,
                },
                payload: Payload::Sgl(SgList::single(sge(stag, iova, 0, 16))),
                signaled: true,
                fence: false,
            },
            &p.a.mrs,
        )
        .unwrap();
    p.drive();
    assert_eq!(p.b.qp.state(), QpState::Error);
    assert!(p.a.events.iter().any(|e| matches!(
        e,
        AsyncEvent::QpAccessError {
            cause: Cause::PeerTerminate {
                layer: 1,
                etype: 1,
                code: 0
            },
            ..
        }
    )));
}

fn read_wr(wr_id: u64, sink: SgList, rkey: Stag, raddr: u64) -> SendWr<'static> {
    SendWr {
        wr_id,
        op: SendOp::Read {
            remote_addr: raddr,
            rkey,
        },
        payload: Payload::Sgl(sink),
        signaled: true,
        fence: false,
    }
}

#[test]
fn reads_beyond_ord_wait_in_the_sq_and_completions_keep_posting_order() {
    let mut s = stream();
    s.ord = 1;
    let mut p = Pair::from_sides(Side::new(1, s), Side::new(2, stream()), Split::Whole);
    let (_src, sstag, siova, data) = p.b.filled_region(3000, Access::REMOTE_READ, 8);
    let (sink, kstag, kiova) = p.a.region(3000, Access::LOCAL_WRITE);
    let (_m, mstag, miova, _) = p.a.filled_region(16, Access::NONE, 2);
    let (_r, rstag, riova) = p.b.region(64, Access::LOCAL_WRITE);
    recv(&mut p.b, 9, rstag, riova, 64);
    for i in 0..3u64 {
        p.a.qp
            .post_send(
                &read_wr(
                    i,
                    SgList::single(sge(kstag, kiova, i * 1000, 1000)),
                    sstag,
                    siova + i * 1000,
                ),
                &p.a.mrs,
            )
            .unwrap();
    }
    p.a.qp
        .post_send(
            &send_wr(3, SgList::single(sge(mstag, miova, 0, 16)), true),
            &p.a.mrs,
        )
        .unwrap();
    // Before the peer answers: one Read Request on the wire, nothing completes.
    let mut wire = Vec::new();
    p.a.transmit(&mut wire, || usize::MAX);
    assert_eq!(wire.len(), 2 + 46 + 4, "exactly one Read Request");
    assert_eq!(p.a.qp.outstanding_reads(), 1);
    assert!(p.a.send_wcs().is_empty());
    p.b.receive(&wire, || usize::MAX);
    p.drive();
    let wcs = p.a.send_wcs();
    assert_eq!(
        wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    assert_eq!(wcs[2].opcode, WcOpcode::RdmaRead);
    assert_eq!(wcs[3].opcode, WcOpcode::Send);
    assert_eq!(contents(&sink), data);
    assert_eq!(p.b.recv_wcs().len(), 1);
}

#[test]
fn a_send_after_a_read_completes_only_after_the_read() {
    let mut p = Pair::new(Split::Whole, stream());
    let (_src, sstag, siova, _) = p.b.filled_region(100, Access::REMOTE_READ, 8);
    let (_sink, kstag, kiova) = p.a.region(100, Access::LOCAL_WRITE);
    let (_m, mstag, miova, _) = p.a.filled_region(16, Access::NONE, 2);
    let (_r, rstag, riova) = p.b.region(64, Access::LOCAL_WRITE);
    recv(&mut p.b, 9, rstag, riova, 64);
    p.a.qp
        .post_send(
            &read_wr(1, SgList::single(sge(kstag, kiova, 0, 100)), sstag, siova),
            &p.a.mrs,
        )
        .unwrap();
    p.a.qp
        .post_send(
            &send_wr(2, SgList::single(sge(mstag, miova, 0, 16)), true),
            &p.a.mrs,
        )
        .unwrap();
    let mut wire = Vec::new();
    p.a.transmit(&mut wire, || usize::MAX);
    assert!(
        p.a.send_wcs().is_empty(),
        "the Send is done but waits behind the Read"
    );
    p.b.receive(&wire, || usize::MAX);
    p.drive();
    let ids: Vec<u64> = p.a.send_wcs().iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, vec![1, 2]);
}

#[test]
fn a_refused_read_completes_with_remote_access_error() {
    let mut p = Pair::new(Split::Random { seed: 11, max: 5 }, stream());
    let (_src, sstag, siova, _) = p.b.filled_region(100, Access::REMOTE_WRITE, 8); // no read
    let (_sink, kstag, kiova) = p.a.region(100, Access::LOCAL_WRITE);
    p.a.qp
        .post_send(
            &read_wr(1, SgList::single(sge(kstag, kiova, 0, 100)), sstag, siova),
            &p.a.mrs,
        )
        .unwrap();
    p.drive();
    let wcs = p.a.send_wcs();
    assert_eq!(wcs[0].status, WcStatus::RemAccessErr);
    assert_eq!(p.a.qp.state(), QpState::Error);
    assert!(p.a.events.iter().any(|e| matches!(
        e,
        AsyncEvent::QpAccessError {
            cause: Cause::PeerTerminate {
                layer: 0,
                etype: 1,
                code: 2
            },
            ..
        }
    )));
    assert_eq!(p.a.qp.stats().terminates_received, 1);
}

#[test]
fn a_send_the_peer_cannot_take_reports_its_terminate_cause() {
    let mut p = Pair::new(Split::Whole, stream());
    let (_s, stag, iova, _) = p.a.filled_region(64, Access::NONE, 1);
    p.a.qp
        .post_send(
            &send_wr(1, SgList::single(sge(stag, iova, 0, 8)), true),
            &p.a.mrs,
        )
        .unwrap();
    p.drive();
    assert!(
        p.a.events.iter().any(|e| matches!(
            e,
            AsyncEvent::QpRequestError {
                cause: Cause::PeerTerminate {
                    layer: 1,
                    etype: 2,
                    code: 2
                },
                ..
            }
        )),
        "{:?}",
        p.a.events
    );
    assert_eq!(p.a.qp.state(), QpState::Error);
}

#[test]
fn a_bad_lkey_completes_with_local_protection_error_and_fails_the_qp() {
    let mut p = Pair::new(Split::Whole, stream());
    let (_s, stag, iova, _) = p.a.filled_region(64, Access::NONE, 1);
    let (_r, rstag, riova) = p.b.region(64, Access::LOCAL_WRITE);
    recv(&mut p.b, 1, rstag, riova, 64);
    recv(&mut p.b, 2, rstag, riova, 64);
    p.a.qp
        .post_send(
            &send_wr(1, SgList::single(sge(stag, iova, 0, 8)), false),
            &p.a.mrs,
        )
        .unwrap();
    // 100 bytes from a 64-byte registration.
    p.a.qp
        .post_send(
            &send_wr(2, SgList::single(sge(stag, iova, 0, 100)), false),
            &p.a.mrs,
        )
        .unwrap();
    p.a.qp
        .post_send(
            &send_wr(3, SgList::single(sge(stag, iova, 0, 8)), true),
            &p.a.mrs,
        )
        .unwrap();
    p.drive();
    let wcs = p.a.send_wcs();
    assert_eq!(wcs.len(), 2, "{wcs:?}");
    assert_eq!((wcs[0].wr_id, wcs[0].status), (2, WcStatus::LocProtErr));
    assert_eq!((wcs[1].wr_id, wcs[1].status), (3, WcStatus::WrFlushErr));
    assert_eq!(
        p.b.recv_wcs()[0].status,
        WcStatus::Success,
        "the first Send arrived"
    );
    assert_eq!(p.b.qp.state(), QpState::Error, "the peer got a Terminate");
}

#[test]
fn unsignaled_and_inline_sends_complete_silently_and_free_their_slots() {
    let mut p = Pair::new(Split::OneByte, stream());
    let (dst, rstag, riova) = p.b.region(64 * 40, Access::LOCAL_WRITE);
    for i in 0..40u64 {
        p.b.qp
            .post_recv(RecvWr {
                wr_id: i,
                sgl: SgList::single(sge(rstag, riova, i * 64, 64)),
            })
            .unwrap();
    }
    for round in 0..2u64 {
        for i in 0..20u64 {
            let msg = [(round * 20 + i) as u8; 33];
            p.a.qp
                .post_send(
                    &SendWr {
                        wr_id: round * 20 + i,
                        op: SendOp::Send {
                            solicited: false,
                            invalidate: None,
                        },
                        payload: Payload::Inline(&msg),
                        signaled: i == 19,
                        fence: false,
                    },
                    &p.a.mrs,
                )
                .unwrap();
        }
        p.drive();
    }
    let wcs = p.a.send_wcs();
    assert_eq!(
        wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        vec![19, 39]
    );
    assert_eq!(p.a.qp.sq_len(), 0);
    let got = contents(&dst);
    for i in 0..40usize {
        assert_eq!(&got[i * 64..i * 64 + 33], &[i as u8; 33]);
    }
    assert_eq!(p.b.recv_wcs().len(), 40);
    assert_eq!(p.b.qp.stats().rx.send.messages, 40);
    assert_eq!(p.a.qp.stats().tx.send.bytes, 40 * 33);
}

#[test]
fn an_rfc5044_responder_sends_nothing_before_the_initiators_first_fpdu_but_a_terminate() {
    for split in [Split::OneByte, Split::Staged { seed: 11, max: 300 }] {
        let si = stream();
        let mut sr = stream();
        sr.responder_waits = true;
        let mut p = Pair::from_sides(Side::new(1, si), Side::new(2, sr), split);
        let (_s, stag, iova, data) = p.b.filled_region(32, Access::NONE, 4);
        let (dst, rstag, riova) = p.a.region(32, Access::LOCAL_WRITE);
        recv(&mut p.a, 1, rstag, riova, 32);
        p.b.qp
            .post_send(
                &send_wr(7, SgList::single(sge(stag, iova, 0, 32)), true),
                &p.b.mrs,
            )
            .unwrap();
        p.drive();
        assert_eq!(p.b.qp.stats().tx_stream_bytes, 0, "held back ({split:?})");
        assert!(p.a.recv_wcs().is_empty());
        // The initiator's first FPDU (a Send) opens the gate.
        let (_t, tstag, tiova, _) = p.a.filled_region(8, Access::NONE, 5);
        let (_u, ustag, uiova) = p.b.region(8, Access::LOCAL_WRITE);
        recv(&mut p.b, 2, ustag, uiova, 8);
        p.a.qp
            .post_send(
                &send_wr(8, SgList::single(sge(tstag, tiova, 0, 8)), true),
                &p.a.mrs,
            )
            .unwrap();
        p.drive();
        assert_eq!(contents(&dst), data, "{split:?}");
        assert_eq!(p.a.recv_wcs().len(), 1);
        assert_eq!(p.b.send_wcs()[0].status, WcStatus::Success);
    }
    // A responder that fails before hearing from the initiator still sends its Terminate.
    let mut sr = stream();
    sr.responder_waits = true;
    let mut b = Side::new(2, sr);
    b.qp.modify(QpState::Error).unwrap();
    let mut wire = Vec::new();
    assert!(b.transmit(&mut wire, || usize::MAX) > 0, "the Terminate");
    assert!(b.qp.terminate_sent());
}

#[test]
fn rtr_write_read_and_send_are_exchanged_before_anything_else() {
    for kind in [RtrKind::Write, RtrKind::Read, RtrKind::Send] {
        let mut si = stream();
        si.rtr = Some(Rtr {
            kind,
            initiator: true,
        });
        let mut sr = stream();
        sr.rtr = Some(Rtr {
            kind,
            initiator: false,
        });
        let mut p = Pair::from_sides(Side::new(1, si), Side::new(2, sr), Split::Whole);
        // The responder has something to send but must wait for the RTR.
        let (_s, stag, iova, data) = p.b.filled_region(32, Access::NONE, 4);
        let (dst, rstag, riova) = p.a.region(32, Access::LOCAL_WRITE);
        recv(&mut p.a, 1, rstag, riova, 32);
        p.b.qp
            .post_send(
                &send_wr(7, SgList::single(sge(stag, iova, 0, 32)), true),
                &p.b.mrs,
            )
            .unwrap();
        assert_eq!(
            p.b.qp.handle_tx(&mut [0u8; 256]),
            0,
            "responder waits for the RTR ({kind:?})"
        );
        p.drive();
        assert_eq!(contents(&dst), data, "{kind:?}");
        assert_eq!(p.a.recv_wcs().len(), 1);
        assert_eq!(p.b.send_wcs()[0].status, WcStatus::Success);
        assert!(p.a.send_wcs().is_empty(), "the RTR completes nothing");
        assert!(p.a.events.is_empty() && p.b.events.is_empty(), "{kind:?}");
    }
}

#[test]
fn graceful_close_drains_then_goes_idle() {
    let mut p = Pair::new(Split::Whole, stream());
    let (_s, stag, iova, _) = p.a.filled_region(64, Access::NONE, 1);
    let (_r, rstag, riova) = p.b.region(64, Access::LOCAL_WRITE);
    recv(&mut p.b, 1, rstag, riova, 64);
    p.a.qp
        .post_send(
            &send_wr(1, SgList::single(sge(stag, iova, 0, 8)), true),
            &p.a.mrs,
        )
        .unwrap();
    p.a.qp.modify(QpState::Closing).unwrap();
    assert!(matches!(
        p.a.qp.post_send(&send_wr(2, SgList::new(), true), &p.a.mrs),
        Err(QpError::InvalidState { .. })
    ));
    assert!(!p.a.qp.is_drained());
    p.drive();
    assert_eq!(p.a.send_wcs().len(), 1);
    assert!(p.a.qp.is_drained());
    p.a.qp.handle_llp_closed();
    assert_eq!(p.a.qp.state(), QpState::Idle);
    p.b.qp.handle_llp_closed();
    p.b.pump();
    assert_eq!(p.b.qp.state(), QpState::Error);
    assert!(p.b.events.iter().any(|e| matches!(
        e,
        AsyncEvent::QpFatal {
            cause: Cause::LlpClosed,
            ..
        }
    )));
}

#[test]
fn state_machine_refuses_transitions_the_rfc_does_not_allow() {
    let mut s = Side::new(1, stream());
    assert!(matches!(
        s.qp.establish(stream()),
        Err(QpError::InvalidTransition { .. })
    ));
    assert!(matches!(
        s.qp.modify(QpState::Terminate),
        Err(QpError::InvalidTransition { .. })
    ));
    assert!(matches!(
        s.qp.modify(QpState::Idle),
        Err(QpError::InvalidTransition { .. })
    ));
    s.qp.modify(QpState::Error).unwrap();
    s.qp.modify(QpState::Idle).unwrap();
    let mut markers = stream();
    markers.markers = true;
    markers.rx_stream_offset = 6;
    assert!(matches!(
        s.qp.establish(markers),
        Err(QpError::InvalidStreamConfig(_))
    ));
    s.qp.establish(stream()).unwrap();
    assert_eq!(s.qp.state(), QpState::Rts);
}

#[test]
fn sixteen_mib_write_lands_intact() {
    let mut s = StreamConfig::for_mss(9000);
    s.crc = true;
    let mut p = Pair::new(Split::Whole, s);
    // The FPDU count below is the plain geometry: no short FPDUs leading the message from
    // a page-aligned region (`tx_alias.rs` tests those).
    p.a.qp.set_tx_alias_lead(false);
    let len = 16 << 20;
    let (_src, sstag, siova, data) = p.a.filled_region(len, Access::NONE, 77);
    let (dst, dstag, diova) = p.b.region(len, Access::REMOTE_WRITE);
    p.a.qp
        .post_send(
            &SendWr {
                wr_id: 1,
                op: SendOp::Write {
                    remote_addr: diova,
                    rkey: dstag,
                },
                payload: Payload::Sgl(SgList::single(sge(sstag, siova, 0, len as u32))),
                signaled: true,
                fence: false,
            },
            &p.a.mrs,
        )
        .unwrap();
    p.drive();
    assert!(contents(&dst) == data);
    let wcs = p.a.send_wcs();
    assert_eq!(
        (wcs[0].status, wcs[0].byte_len),
        (WcStatus::Success, len as u32)
    );
    assert_eq!(p.b.qp.stats().rx.write.bytes, len as u64);
    assert_eq!(p.b.qp.stats().rx.write.messages, 1);
    // 9000-byte FPDUs: 8980 payload bytes each.
    assert_eq!(p.a.qp.stats().tx_fpdus, (len as u64).div_ceil(8980));
}

#[test]
fn a_receive_wr_of_more_than_4_gib_is_refused_at_post_time_on_the_rq_and_the_srq() {
    use softwarp_engine::srq::SrqError;
    // Two SGEs of 2^32 - 1 bytes: their sum does not fit the completion's 32-bit byte length
    // (the SGEs are validated only when a Send uses them, so none is registered here).
    let max = sge(Stag(0x100), 0x1000, 0, u32::MAX);
    let huge = SgList::from_slice(&[max, max]).unwrap();
    let total = 2 * u64::from(u32::MAX);
    let mut side = Side::new(1, stream());
    assert_eq!(
        side.qp.post_recv(RecvWr {
            wr_id: 1,
            sgl: huge
        }),
        Err(QpError::MessageTooLong(total))
    );
    // Exactly 2^32 - 1 bytes is a valid receive.
    side.qp
        .post_recv(RecvWr {
            wr_id: 2,
            sgl: SgList::single(max),
        })
        .unwrap();
    let mut srq_side = Side::with_config(qp_config(2, true), stream());
    let srq = srq_side.srq.as_mut().unwrap();
    assert_eq!(
        srq.post_recv(RecvWr {
            wr_id: 3,
            sgl: huge
        }),
        Err(SrqError::MessageTooLong(total))
    );
    srq.post_recv(RecvWr {
        wr_id: 4,
        sgl: SgList::single(max),
    })
    .unwrap();
    assert_eq!(srq.len(), 1);
}

#[test]
fn borrowed_work_requests_post_as_owned_ones_and_refuse_more_than_max_sge() {
    use softwarp_engine::wr::{PayloadRef, RecvWrRef, SendWrRef, MAX_SGE};
    let mut p = Pair::new(Split::Whole, stream());
    let (_s, stag, iova, data) = p.a.filled_region(300, Access::NONE, 7);
    let (dst, dstag, diova) = p.b.region(400, Access::LOCAL_WRITE);
    // A receive of three SGEs and a Send gathered from two, both borrowed.
    let rsges = [
        sge(dstag, diova, 0, 100),
        sge(dstag, diova, 200, 50),
        sge(dstag, diova, 300, 100),
    ];
    p.b.qp
        .post_recv_borrowed(RecvWrRef {
            wr_id: 21,
            sges: &rsges,
        })
        .unwrap();
    let ssges = [sge(stag, iova, 0, 120), sge(stag, iova, 150, 80)];
    let send = |wr_id, payload| SendWrRef {
        wr_id,
        op: SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        payload,
        signaled: true,
        fence: false,
    };
    p.a.qp
        .post_send_ref(send(11, PayloadRef::Sges(&ssges)), &p.a.mrs)
        .unwrap();
    // More than MAX_SGE elements: refused on both queues, nothing queued.
    let many = [sge(stag, iova, 0, 1); MAX_SGE + 1];
    assert_eq!(
        p.a.qp
            .post_send_ref(send(12, PayloadRef::Sges(&many)), &p.a.mrs),
        Err(QpError::TooManySges(MAX_SGE + 1))
    );
    assert_eq!(
        p.b.qp.post_recv_borrowed(RecvWrRef {
            wr_id: 22,
            sges: &many,
        }),
        Err(QpError::TooManySges(MAX_SGE + 1))
    );
    p.drive();
    let sent: Vec<u8> = [&data[..120], &data[150..230]].concat();
    let got = contents(&dst);
    assert_eq!(&got[..100], &sent[..100]);
    assert_eq!(&got[200..250], &sent[100..150]);
    assert_eq!(&got[300..350], &sent[150..200]);
    let s = p.a.send_wcs();
    let r = p.b.recv_wcs();
    assert_eq!(
        s.iter()
            .map(|w| (w.wr_id, w.status, w.byte_len))
            .collect::<Vec<_>>(),
        [(11, WcStatus::Success, 200)]
    );
    assert_eq!(
        r.iter()
            .map(|w| (w.wr_id, w.status, w.byte_len))
            .collect::<Vec<_>>(),
        [(21, WcStatus::Success, 200)]
    );
}

/// Receives `wire` on `b` through `recv_from` (staged reads, so whole FPDUs go one after the
/// other through one call).
fn receive_all(b: &mut Side, wire: &[u8]) {
    assert_eq!(b.receive_with(wire, true, || usize::MAX), wire.len());
}

#[test]
fn tagged_placements_hold_no_reference_once_the_receive_call_returns() {
    // A Write of 20 MSS-sized FPDUs, and a Read of as many Read Responses: the receiver
    // keeps the target's memory from one FPDU to the next inside a call, and lets it go when
    // the call returns, also in the middle of a message (a deregistration then waits for
    // nothing the peer does).
    let len = 20 * 1400;
    let mut p = Pair::new(Split::Whole, stream());
    let (_src, sstag, siova, _) = p.a.filled_region(len, Access::NONE, 3);
    let (_sink, kstag, kiova) = p.b.region(
        len,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    );
    let write = SendOp::Write {
        remote_addr: kiova,
        rkey: kstag,
    };
    let wr = signaled_wr(1, write, SgList::single(sge(sstag, siova, 0, len as u32)));
    p.a.qp.post_send(&wr, &p.a.mrs).unwrap();
    let mut wire = Vec::new();
    p.a.transmit_with(&mut wire, true, || usize::MAX);
    // The first ten FPDUs (MPA length, ULPDU, pad, CRC each), then the rest.
    let mut half = 0;
    for _ in 0..10 {
        let ulpdu = usize::from(u16::from_be_bytes([wire[half], wire[half + 1]]));
        half += (2 + ulpdu).next_multiple_of(4) + 4;
    }
    receive_all(&mut p.b, &wire[..half]);
    let memory = p.b.mrs.memory(kstag).unwrap();
    assert_eq!(
        memory.strong_count(),
        1,
        "only the STag table refers to the memory between two receive calls"
    );
    receive_all(&mut p.b, &wire[half..]);
    assert_eq!(p.a.send_wcs()[0].status, WcStatus::Success);
    // The Read: b's memory back to a's sink, in Read Responses.
    let (_back, bstag, biova) = p.a.region(len, Access::LOCAL_WRITE);
    let read = SendOp::Read {
        remote_addr: kiova,
        rkey: kstag,
    };
    let wr = signaled_wr(2, read, SgList::single(sge(bstag, biova, 0, len as u32)));
    p.a.qp.post_send(&wr, &p.a.mrs).unwrap();
    p.drive();
    assert_eq!(p.a.send_wcs()[0].status, WcStatus::Success);
    // Nothing in flight on either side holds either region.
    assert_eq!(p.b.mrs.deregister(kstag), Ok(0));
    assert_eq!(p.a.mrs.deregister(bstag), Ok(0));
}
