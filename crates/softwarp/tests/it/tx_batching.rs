//! Small FPDUs coalesced into shared `sendmsg` calls: lists of small Sends arrive complete
//! and in order, also when the socket fills up in the middle of a batch (the rest waits in
//! the QP and goes first).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use crate::util::*;
use softwarp::*;

const N: usize = 1000;
const LEN: usize = 200;

#[test]
fn thousands_of_small_sends_posted_in_lists_arrive_in_order_behind_a_full_socket() {
    let deep = |a: &mut QpInitAttr<'_>| {
        a.cap.max_send_wr = 4096;
        a.cap.max_recv_wr = 4096;
    };
    let mut a = End::with(None, None, deep);
    let mut b = End::with(None, None, deep);
    // b reads only when polled: nothing drains its socket until the end.
    b.rcq.set_busy_poll(true);
    let (rbuf, _) = b.mr(N * LEN, AccessFlags::LOCAL_WRITE, 0);
    for i in 0..N {
        b.qp.post_recv(&RecvWr {
            wr_id: i as u64,
            sgl: SgList::single(rbuf.sge(i * LEN, LEN as u32).unwrap()),
        })
        .unwrap();
    }
    let opts = ConnectOptions::default().crc(true);
    connect(&mut a, &mut b, &opts);
    let payloads: Vec<Vec<u8>> = (0..N).map(|i| pattern(LEN, i as u64)).collect();
    for chunk in (0..N).collect::<Vec<_>>().chunks(64) {
        let wrs: Vec<SendWr<'_>> = chunk
            .iter()
            .map(|&i| SendWr {
                wr_id: i as u64,
                op: SendOp::Send {
                    solicited: false,
                    invalidate: None,
                },
                payload: Payload::Inline(&payloads[i]),
                signaled: i % 64 == 63,
                fence: false,
            })
            .collect();
        a.qp.post_send_list(&wrs).unwrap();
    }
    let deadline = Instant::now() + WAIT;
    let mut got = 0;
    let mut wcs = [EMPTY_COMPLETION; 64];
    while got < N {
        let n = b.rcq.poll(&mut wcs).unwrap();
        for wc in &wcs[..n] {
            assert_eq!(wc.status, WcStatus::Success);
            assert_eq!(wc.wr_id, got as u64, "receives complete in order");
            assert_eq!(wc.byte_len as usize, LEN);
            got += 1;
        }
        a.scq.poll(&mut wcs).unwrap();
        assert!(Instant::now() < deadline, "only {got} of {N} Sends arrived");
    }
    let all = rbuf.to_vec().unwrap();
    for (i, p) in payloads.iter().enumerate() {
        assert_eq!(&all[i * LEN..(i + 1) * LEN], &p[..], "message {i}");
    }
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(b.qp.stats().crc_errors, 0);
}

#[test]
fn a_failing_entry_of_a_list_stops_the_list_and_earlier_ones_still_go_out() {
    let (a, b) = pair(&ConnectOptions::default());
    let (rbuf, _) = b.mr(64, AccessFlags::LOCAL_WRITE, 0);
    b.qp.post_recv(&RecvWr {
        wr_id: 9,
        sgl: SgList::single(rbuf.sge(0, 64).unwrap()),
    })
    .unwrap();
    let big = vec![0u8; MAX_INLINE + 1];
    let send = |payload| SendWr {
        wr_id: 1,
        op: SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        payload,
        signaled: true,
        fence: false,
    };
    let r =
        a.qp.post_send_list(&[send(Payload::Inline(b"hi")), send(Payload::Inline(&big))]);
    assert!(matches!(r, Err((1, Error::InvalidArgument(_)))), "{r:?}");
    let deadline = Instant::now() + WAIT;
    let wc = loop {
        if let Some(wc) = b.rcq.poll_one() {
            break wc;
        }
        assert!(Instant::now() < deadline);
        std::thread::yield_now();
    };
    assert_eq!((wc.wr_id, wc.byte_len), (9, 2));
}

#[test]
fn receives_posted_as_a_list_are_used_in_order_and_a_bad_one_stops_the_list() {
    let mut a = End::new(None, None);
    let mut b = End::with(None, None, |attr| attr.cap.max_recv_sge = 2);
    let (rbuf, _) = b.mr(4 * 64, AccessFlags::LOCAL_WRITE, 0);
    let good = |i: usize| RecvWr {
        wr_id: i as u64,
        sgl: SgList::single(rbuf.sge(i * 64, 64).unwrap()),
    };
    let bad = RecvWr {
        wr_id: 99,
        sgl: sgl(&rbuf, 0, 192, 3),
    };
    let (at, e) =
        b.qp.post_recv_list(&[good(0), good(1), bad, good(3)])
            .unwrap_err();
    assert_eq!(at, 2, "the list stops at the bad work request");
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    connect(&mut a, &mut b, &ConnectOptions::default().crc(true));
    let payloads: Vec<Vec<u8>> = (0..4).map(|i| pattern(64, 100 + i)).collect();
    let send = |i: usize| {
        a.qp.post_send(&send_wr(
            i as u64,
            send_op(false, None),
            Payload::Inline(&payloads[i]),
        ))
        .unwrap()
    };
    send(0);
    send(1);
    let wcs = wait_wcs(&b.rcq, 2);
    assert_eq!(wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [0, 1]);
    // Only the two before the bad one were posted: the next ones come from a new list.
    b.qp.post_recv_list(&[good(2), good(3)]).unwrap();
    send(2);
    send(3);
    let wcs = wait_wcs(&b.rcq, 2);
    assert_eq!(wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [2, 3]);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success));
    let all = rbuf.to_vec().unwrap();
    for (i, p) in payloads.iter().enumerate() {
        assert_eq!(&all[i * 64..(i + 1) * 64], &p[..], "message {i}");
    }
    assert_eq!(b.qp.state(), QpState::Rts);
}

/// Behind a full socket that the progress thread watches for write readiness (a QP that
/// is not busy-polled), a post only queues its work: writing now would only fail with
/// EAGAIN. The progress thread sends it when the socket drains; everything arrives, in
/// order. (Counted by the QP's `tx_deferred` detail.)
#[test]
fn posts_behind_a_full_socket_queue_for_the_progress_thread() {
    const MSG: usize = 64 * 1024;
    const COUNT: usize = 200;
    let deep = |a: &mut QpInitAttr<'_>| {
        a.cap.max_send_wr = 1024;
        a.cap.max_recv_wr = 1024;
    };
    let mut a = End::with(None, None, deep);
    let mut b = End::with(None, None, deep);
    // b reads only when polled while its application is at work (below: empty posts; a
    // busy-polled QP whose application stops is taken over by the progress thread): a's
    // socket fills up (COUNT * MSG is 12.5 MiB).
    b.rcq.set_busy_poll(true);
    let (rbuf, _) = b.mr(MSG, AccessFlags::LOCAL_WRITE, 0);
    for i in 0..COUNT {
        b.qp.post_recv(&RecvWr {
            wr_id: i as u64,
            sgl: SgList::single(rbuf.sge(0, MSG as u32).unwrap()),
        })
        .unwrap();
    }
    // No first-FPDU hold-off: the posts below must meet a full socket, not a held QP.
    let opts = ConnectOptions::default().first_fpdu_delay(Duration::ZERO);
    connect(&mut a, &mut b, &opts);
    let (src, data) = a.mr(MSG, AccessFlags::NONE, 4);
    for i in 0..COUNT {
        let wr = SendWr {
            wr_id: i as u64,
            op: SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            payload: Payload::Sgl(SgList::single(src.sge(0, MSG as u32).unwrap())),
            signaled: false,
            fence: false,
        };
        a.qp.post_send(&wr).unwrap();
        b.qp.post_send_list(&[]).unwrap();
    }
    let deferred = qp_detail(&a, "tx_deferred").and_then(|v| v.parse::<u64>().ok());
    assert!(
        deferred.is_some_and(|d| d >= 1),
        "no post was queued behind the full socket: {deferred:?}"
    );
    let deadline = Instant::now() + WAIT;
    let mut got = 0;
    let mut wcs = [EMPTY_COMPLETION; 64];
    while got < COUNT {
        let n = b.rcq.poll(&mut wcs).unwrap();
        for wc in &wcs[..n] {
            assert_eq!(wc.status, WcStatus::Success);
            assert_eq!(wc.wr_id, got as u64, "receives complete in order");
            assert_eq!(wc.byte_len as usize, MSG);
            got += 1;
        }
        assert!(
            Instant::now() < deadline,
            "only {got} of {COUNT} Sends arrived"
        );
    }
    assert_eq!(rbuf.to_vec().unwrap(), data);
    assert_eq!(a.qp.state(), QpState::Rts);
}
