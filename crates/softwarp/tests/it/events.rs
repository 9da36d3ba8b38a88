//! Event mode (completion channels with a pollable file descriptor, solicited-only
//! notification), shared receive queues with the limit event, CQ overflow reported as an
//! asynchronous error, and device fault injection, over real loopback TCP.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::fd::AsRawFd;
use std::time::Duration;

use crate::util::*;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use softwarp::*;

const LW: AccessFlags = AccessFlags::LOCAL_WRITE;

/// True when `fd` becomes readable within `timeout` (level check through a fresh epoll).
fn readable_within(fd: &impl AsRawFd, timeout: Duration) -> bool {
    let mut poll = Poll::new().unwrap();
    let raw = fd.as_raw_fd();
    poll.registry()
        .register(&mut SourceFd(&raw), Token(1), Interest::READABLE)
        .unwrap();
    let mut events = Events::with_capacity(4);
    poll.poll(&mut events, Some(timeout)).unwrap();
    !events.is_empty()
}

fn recv(e: &End, mr: &MemoryRegion, id: u64) {
    e.qp.post_recv(&RecvWr {
        wr_id: id,
        sgl: SgList::single(mr.sge(0, 256).unwrap()),
    })
    .unwrap();
}

#[test]
fn completion_channel_fd_becomes_readable_on_an_armed_completion() {
    opt_in_ras();
    let ch = Device::open_default()
        .unwrap()
        .create_comp_channel()
        .unwrap();
    let mut a = End::new(None, None);
    let mut b = End::new(Some(&ch), None);
    // The channel was made on another device handle: CQs of b use it anyway (a channel is
    // only a file descriptor).
    connect(&mut a, &mut b, &ConnectOptions::default());
    let (buf, _) = b.mr(4096, LW, 0);
    for id in 0..3 {
        recv(&b, &buf, id);
    }
    // Not armed: a completion does not signal.
    a.qp.post_send(&send_wr(1, send_op(false, None), Payload::Inline(b"one")))
        .unwrap();
    wait_wcs(&b.rcq, 1);
    assert!(!readable_within(&ch, Duration::from_millis(50)));
    assert!(ch.try_get_cq_event().is_none());

    // Armed: the next completion makes the fd readable, and get_cq_event names the CQ.
    b.rcq.req_notify(false).unwrap();
    a.qp.post_send(&send_wr(2, send_op(false, None), Payload::Inline(b"two")))
        .unwrap();
    assert!(readable_within(&ch, WAIT));
    let cq = ch.get_cq_event(Some(WAIT)).unwrap();
    assert_eq!(cq.id(), b.rcq.id());
    let wcs = wait_wcs(&cq, 1);
    assert_eq!(wcs[0].byte_len, 3);
    assert!(
        !readable_within(&ch, Duration::from_millis(10)),
        "event consumed"
    );

    // One notification per arming.
    a.qp.post_send(&send_wr(3, send_op(false, None), Payload::Inline(b"three")))
        .unwrap();
    wait_wcs(&b.rcq, 1);
    assert!(matches!(
        ch.get_cq_event(Some(Duration::from_millis(50))),
        Err(Error::Timeout(_))
    ));
}

#[test]
fn solicited_only_notification_waits_for_a_send_with_solicited_event() {
    opt_in_ras();
    let ch = Device::open_default()
        .unwrap()
        .create_comp_channel()
        .unwrap();
    let mut a = End::new(None, None);
    let mut b = End::new(Some(&ch), None);
    connect(&mut a, &mut b, &ConnectOptions::default());
    let (buf, _) = b.mr(4096, LW, 0);
    recv(&b, &buf, 1);
    recv(&b, &buf, 2);
    b.rcq.req_notify(true).unwrap();
    a.qp.post_send(&send_wr(1, send_op(false, None), Payload::Inline(b"plain")))
        .unwrap();
    wait_wcs(&b.rcq, 1);
    assert!(ch.get_cq_event(Some(Duration::from_millis(100))).is_err());
    a.qp.post_send(&send_wr(
        2,
        send_op(true, None),
        Payload::Inline(b"wake up"),
    ))
    .unwrap();
    let cq = ch.get_cq_event(Some(WAIT)).unwrap();
    let wcs = wait_wcs(&cq, 1);
    assert!(wcs[0].solicited);
}

#[test]
fn event_mode_loop_receives_many_messages_without_polling_idle() {
    opt_in_ras();
    let ch = Device::open_default()
        .unwrap()
        .create_comp_channel()
        .unwrap();
    let mut a = End::new(None, None);
    let mut b = End::new(Some(&ch), None);
    connect(&mut a, &mut b, &ConnectOptions::default());
    let (buf, _) = b.mr(4096, LW, 0);
    let n = 50u64;
    for id in 0..n {
        recv(&b, &buf, id);
    }
    let sender = std::thread::spawn(move || {
        for id in 0..n {
            a.qp.post_send(&send_wr(id, send_op(false, None), Payload::Inline(b"msg")))
                .unwrap();
            if id % 7 == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        wait_wcs(&a.scq, n as usize);
        a
    });
    let mut got = Vec::new();
    let mut wcs = [EMPTY_COMPLETION; 8];
    while got.len() < n as usize {
        b.rcq.req_notify(false).unwrap();
        // Poll once more after arming (the verbs pattern), then sleep on the channel.
        let k = b.rcq.poll(&mut wcs).unwrap();
        if k == 0 {
            ch.get_cq_event(Some(WAIT)).unwrap();
            continue;
        }
        got.extend(wcs[..k].iter().map(|w| w.wr_id));
    }
    assert_eq!(got, (0..n).collect::<Vec<_>>());
    let _a = sender.join().unwrap();
}

#[test]
fn srq_feeds_two_qps_and_reports_the_limit_event() {
    opt_in_ras();
    let dev = Device::open_default().unwrap();
    let pd = dev.alloc_pd().unwrap();
    let srq = pd
        .create_srq(&SrqInitAttr {
            max_wr: 16,
            max_sge: 2,
            srq_limit: 0,
        })
        .unwrap();
    let buf = pd.reg_mr(16 * 256, LW).unwrap();
    for i in 0..8u64 {
        srq.post_recv(&RecvWr {
            wr_id: 500 + i,
            sgl: SgList::single(buf.sge(i as usize * 256, 256).unwrap()),
        })
        .unwrap();
    }
    srq.arm_limit(5);
    let mut servers = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..2 {
        let scq = dev.create_cq(16, None).unwrap();
        let rcq = dev.create_cq(16, None).unwrap();
        let qp = pd
            .create_qp(&QpInitAttr {
                srq: Some(&srq),
                ..QpInitAttr::new(&scq, &rcq)
            })
            .unwrap();
        let mut b = End {
            dev: dev.clone(),
            pd: pd.clone(),
            scq,
            rcq,
            qp,
            info: None,
        };
        let mut a = End::new(None, None);
        connect(&mut a, &mut b, &ConnectOptions::default());
        servers.push(b);
        clients.push(a);
    }
    assert!(matches!(
        servers[0].qp.post_recv(&RecvWr {
            wr_id: 1,
            sgl: SgList::new()
        }),
        Err(Error::Qp(_))
    ));
    // Two messages from each client: 4 of the 8 WRs are used, 4 < 5 fires the limit.
    for (k, a) in clients.iter().enumerate() {
        for j in 0..2u64 {
            let msg = format!("client {k} message {j}");
            a.qp.post_send(&send_wr(
                j,
                send_op(false, None),
                Payload::Inline(msg.as_bytes()),
            ))
            .unwrap();
        }
    }
    let mut ids = Vec::new();
    for b in &servers {
        let wcs = wait_wcs(&b.rcq, 2);
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success));
        assert!(wcs.iter().all(|w| w.qp_num == b.qp.qp_num()));
        ids.extend(wcs.iter().map(|w| w.wr_id));
    }
    ids.sort();
    assert_eq!(ids, vec![500, 501, 502, 503]);
    let (ev, _) = wait_event(&dev, |e| matches!(e, AsyncEvent::SrqLimitReached { .. }));
    assert_eq!(ev, AsyncEvent::SrqLimitReached { srq: srq.id() });
    assert_eq!(srq.len(), 4);
}

#[test]
fn cq_overflow_is_an_async_error_and_moves_its_qps_to_error() {
    opt_in_ras();
    let dev = Device::open_default().unwrap();
    let mut a = End::new(None, None);
    let pd = dev.alloc_pd().unwrap();
    let small = dev.create_cq(2, None).unwrap();
    let scq = dev.create_cq(16, None).unwrap();
    let qp = pd.create_qp(&QpInitAttr::new(&scq, &small)).unwrap();
    let mut b = End {
        dev: dev.clone(),
        pd: pd.clone(),
        scq: scq.clone(),
        rcq: small.clone(),
        qp,
        info: None,
    };
    let buf = pd.reg_mr(4096, LW).unwrap();
    for id in 0..4 {
        recv(&b, &buf, id);
    }
    connect(&mut a, &mut b, &ConnectOptions::default());
    for id in 0..3 {
        a.qp.post_send(&send_wr(id, send_op(false, None), Payload::Inline(b"x")))
            .unwrap();
    }
    let (ev, _) = wait_event(&dev, |e| matches!(e, AsyncEvent::CqError { .. }));
    assert_eq!(ev, AsyncEvent::CqError { cq: small.id() });
    wait_state(&b.qp, QpState::Error);
    // The completions that fit are still there; then the CQ reports its overflow.
    let mut wcs = [EMPTY_COMPLETION; 4];
    assert_eq!(small.poll(&mut wcs).unwrap(), 2);
    assert!(matches!(
        small.poll(&mut wcs),
        Err(Error::CqOverflowed { capacity: 2 })
    ));
    // The peer sees the Terminate that the move to Error sent.
    wait_event(&a.dev, |e| {
        matches!(
            e,
            AsyncEvent::QpFatal { .. }
                | AsyncEvent::QpAccessError { .. }
                | AsyncEvent::QpRequestError { .. }
        )
    });
    wait_state(&a.qp, QpState::Error);
}

#[test]
fn injected_device_failure_errors_every_qp_and_reports_device_fatal() {
    let (a, b) = pair(&ConnectOptions::default());
    let (buf, _) = b.mr(4096, LW, 0);
    recv(&b, &buf, 1);
    b.dev.inject_fatal_error();
    wait_event(&b.dev, |e| *e == AsyncEvent::DeviceFatal);
    wait_state(&b.qp, QpState::Error);
    let wcs = wait_wcs(&b.rcq, 1);
    assert_eq!(wcs[0].status, WcStatus::WrFlushErr);
    wait_state(&a.qp, QpState::Error);
}
