//! The connection manager's API over loopback: events on both sides, the blocking helpers,
//! IPv4 and IPv6, private data and IRD/ORD, reject, unreachable and silent peers, graceful
//! and abortive disconnect with flushes, the RFC 5044 first-FPDU rule, and an event loop
//! that polls the CM channel and a completion channel from one `epoll`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use softwarp::*;
use softwarp_testkit::quick;

use crate::cm_support::*;
use crate::util::*;

const LW: AccessFlags = AccessFlags::LOCAL_WRITE;

fn listener(ch: &CmEventChannel, opts: ConnectOptions) -> CmListener {
    ch.listen("127.0.0.1:0", &ListenOptions::default().options(opts))
        .unwrap()
}

#[test]
fn connect_and_accept_report_established_on_both_sides_and_carry_data() {
    let server = End::new(None, None);
    let client = End::new(None, None);
    let (sbuf, _) = server.mr(4096, LW, 1);
    let (cbuf, cdata) = client.mr(4096, LW, 2);
    post_recv(&server.qp, &sbuf, 0, 4096, 10);
    post_recv(&client.qp, &cbuf, 2048, 2048, 20);
    let sch = CmEventChannel::new().unwrap();
    let cch = CmEventChannel::new().unwrap();
    let l = listener(&sch, ConnectOptions::default());

    let opts = ConnectOptions::default().private_data(b"hello, responder");
    let id = cch.connect(&client.qp, l.local_addr(), &opts).unwrap();
    assert_eq!(id.state(), CmState::Connecting);
    assert_eq!(id.role(), Role::Initiator);

    let req = request(&sch);
    assert_eq!(req.private_data(), b"hello, responder");
    assert_eq!(req.listener_id(), l.id());
    assert_eq!(req.revision(), 2);
    assert_eq!(req.peer_ird_ord(), Some((16, 16)));
    assert!(req.crc_requested() && !req.markers_requested() && !req.peer_to_peer());
    assert_eq!(req.local_addr(), l.local_addr());
    let sid = req
        .accept(
            &server.qp,
            &ConnectOptions::default().private_data(b"welcome"),
        )
        .unwrap();
    assert_eq!(sid.conn_id(), req.conn_id());
    assert!(matches!(req.reject(b""), Err(Error::AlreadyAnswered)));
    let sinfo = established(&sch, sid.conn_id());
    assert_eq!(sinfo.role, Role::Responder);
    assert_eq!(sinfo.peer_private_data, b"hello, responder");

    let cinfo = established(&cch, id.conn_id());
    assert_eq!(id.state(), CmState::Established);
    assert_eq!(cinfo.peer_private_data, b"welcome");
    assert_eq!((cinfo.revision, cinfo.crc, cinfo.rtr), (2, true, None));
    assert_eq!(cinfo.peer_addr, l.local_addr());
    assert_eq!(id.connection(), Some(cinfo.clone()));
    assert_eq!(client.qp.connection(), Some(cinfo));

    // Initiator first (RFC 5044), then the responder.
    post_send(&client.qp, &cbuf, 0, 1000, 1);
    let wc = wait_wcs(&server.rcq, 1);
    assert_eq!((wc[0].wr_id, wc[0].byte_len), (10, 1000));
    assert_eq!(sbuf.to_vec().unwrap()[..1000], cdata[..1000]);
    post_send(&server.qp, &sbuf, 0, 1000, 2);
    let wc = wait_wcs(&client.rcq, 1);
    assert_eq!((wc[0].wr_id, wc[0].byte_len), (20, 1000));
    wait_wcs(&client.scq, 1);
    wait_wcs(&server.scq, 1);
    assert_eq!(cbuf.to_vec().unwrap()[2048..3048], cdata[..1000]);
}

#[test]
fn blocking_helpers_connect_and_accept_over_ipv6() {
    let server = End::new(None, None);
    let client = End::new(None, None);
    let sch = CmEventChannel::new().unwrap();
    let cch = CmEventChannel::new().unwrap();
    let l = sch
        .listen("[::1]:0", &ListenOptions::default().backlog(8))
        .unwrap();
    assert!(l.local_addr().is_ipv6());
    let addr = l.local_addr();
    let (cid, cinfo, sinfo) = std::thread::scope(|s| {
        let h = s.spawn(|| {
            l.accept(&server.qp, &ConnectOptions::default(), Some(WAIT))
                .unwrap()
        });
        let (cid, cinfo) = cch
            .connect_blocking(&client.qp, addr, &ConnectOptions::default())
            .unwrap();
        (cid, cinfo, h.join().unwrap().1)
    });
    assert!(cinfo.local_addr.is_ipv6() && sinfo.peer_addr.is_ipv6());
    assert_eq!(cinfo.local_addr, sinfo.peer_addr);
    assert_eq!(cid.state(), CmState::Established);
    // The blocking helpers took their Established events.
    assert!(cch.try_get_event().is_none());
    assert!(sch.try_get_event().is_none());
    assert_eq!(client.qp.state(), QpState::Rts);
    assert_eq!(server.qp.state(), QpState::Rts);
}

#[test]
fn reject_carries_private_data_and_the_qp_can_connect_again() {
    let server = End::new(None, None);
    let client = End::new(None, None);
    let sch = CmEventChannel::new().unwrap();
    let cch = CmEventChannel::new().unwrap();
    let l = listener(&sch, ConnectOptions::default());
    let id = cch
        .connect(&client.qp, l.local_addr(), &ConnectOptions::default())
        .unwrap();
    let req = request(&sch);
    assert!(matches!(
        req.reject(&[0; 509]),
        Err(Error::Mpa(MpaError::PrivateDataTooLong {
            len: 509,
            max: 508
        }))
    ));
    req.reject(b"busy, try later").unwrap();
    match ev_of(&cch, id.conn_id()) {
        CmEvent::Rejected { private_data, .. } => assert_eq!(private_data, b"busy, try later"),
        other => panic!("{other:?}"),
    }
    assert_eq!(id.state(), CmState::Failed);
    assert_eq!(client.qp.state(), QpState::Idle);
    // Same QP, second attempt, accepted this time.
    let (_, info) = std::thread::scope(|s| {
        let h = s.spawn(|| request(&sch).accept(&server.qp, &ConnectOptions::default()));
        let r = cch.connect_blocking(&client.qp, l.local_addr(), &ConnectOptions::default());
        h.join().unwrap().unwrap();
        r.unwrap()
    });
    assert_eq!(info.revision, 2);
}

#[test]
fn blocking_connect_reports_a_reject_as_an_error() {
    let client = End::new(None, None);
    let sch = CmEventChannel::new().unwrap();
    let cch = CmEventChannel::new().unwrap();
    let l = listener(&sch, ConnectOptions::default());
    std::thread::scope(|s| {
        s.spawn(|| drop(request(&sch))); // an unanswered request is rejected
        let r = cch.connect_blocking(&client.qp, l.local_addr(), &ConnectOptions::default());
        assert!(
            matches!(r, Err(Error::Mpa(MpaError::Rejected { ref private_data })) if private_data.is_empty()),
            "{r:?}"
        );
    });
}

#[test]
fn nobody_listening_is_unreachable_and_the_qp_stays_idle() {
    let client = End::new(None, None);
    let cch = CmEventChannel::new().unwrap();
    let port = {
        let t = TcpListener::bind("127.0.0.1:0").unwrap();
        t.local_addr().unwrap().port()
    };
    let id = cch
        .connect(&client.qp, ("127.0.0.1", port), &quick(400))
        .unwrap();
    match ev_of(&cch, id.conn_id()) {
        CmEvent::Unreachable { error, .. } => {
            assert!(matches!(error, Error::Io { .. }), "{error}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(client.qp.state(), QpState::Idle);
    assert!(matches!(
        cch.connect_blocking(&client.qp, ("127.0.0.1", port), &quick(400)),
        Err(Error::Io { .. })
    ));
}

#[test]
fn a_silent_listener_times_out_with_a_clear_error_and_a_pending_connect_can_be_cancelled() {
    let client = End::new(None, None);
    let cch = CmEventChannel::new().unwrap();
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let t0 = Instant::now();
    let r = cch.connect_blocking(&client.qp, addr, &quick(400));
    assert!(matches!(r, Err(Error::Mpa(MpaError::Timeout(_)))), "{r:?}");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert_eq!(client.qp.state(), QpState::Idle);

    let id = cch
        .connect(&client.qp, addr, &ConnectOptions::default())
        .unwrap();
    assert!(matches!(
        cch.connect(&client.qp, addr, &ConnectOptions::default()),
        Err(Error::AlreadyConnected)
    ));
    id.abort().unwrap();
    match ev_of(&cch, id.conn_id()) {
        CmEvent::ConnectError { error, .. } => {
            assert!(matches!(error, Error::Mpa(MpaError::Cancelled)), "{error}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(client.qp.state(), QpState::Idle);
}

/// A connected pair through the CM, with receives posted on both sides.
struct Pair {
    server: End,
    client: End,
    sch: CmEventChannel,
    cch: CmEventChannel,
    sid: CmId,
    cid: CmId,
    _l: CmListener,
    _bufs: (MemoryRegion, MemoryRegion),
}

fn cm_pair(copts: &ConnectOptions, sopts: &ConnectOptions, recvs: u64) -> Pair {
    let server = End::new(None, None);
    let client = End::new(None, None);
    let (sbuf, _) = server.mr(1 << 16, LW, 1);
    let (cbuf, _) = client.mr(1 << 16, LW, 2);
    for i in 0..recvs {
        post_recv(&server.qp, &sbuf, 0, 4096, 100 + i);
        post_recv(&client.qp, &cbuf, 0, 4096, 200 + i);
    }
    let sch = CmEventChannel::new().unwrap();
    let cch = CmEventChannel::new().unwrap();
    let l = listener(&sch, sopts.clone());
    let cid = cch.connect(&client.qp, l.local_addr(), copts).unwrap();
    let sid = request(&sch).accept(&server.qp, sopts).unwrap();
    established(&sch, sid.conn_id());
    established(&cch, cid.conn_id());
    Pair {
        server,
        client,
        sch,
        cch,
        sid,
        cid,
        _l: l,
        _bufs: (sbuf, cbuf),
    }
}

fn assert_all_flushed(cq: &CompletionQueue, n: usize) {
    let wcs = wait_wcs(cq, n);
    assert!(
        wcs.iter().all(|w| w.status == WcStatus::WrFlushErr),
        "{wcs:?}"
    );
}

fn no_llp_closed_fatal(dev: &Device) {
    while let Some(ev) = dev.try_get_async_event() {
        assert!(
            !matches!(
                ev,
                AsyncEvent::QpFatal {
                    cause: Cause::LlpClosed,
                    ..
                }
            ),
            "a disconnect is a CM event, not a fatal QP error: {ev:?}"
        );
    }
}

#[test]
fn graceful_disconnect_is_reported_on_both_sides_and_flushes_the_receives() {
    let p = cm_pair(&ConnectOptions::default(), &ConnectOptions::default(), 3);
    p.cid.disconnect().unwrap();
    assert_eq!(
        disconnected(&p.cch, p.cid.conn_id()),
        DisconnectReason::Local
    );
    assert_eq!(
        disconnected(&p.sch, p.sid.conn_id()),
        DisconnectReason::PeerClosed
    );
    assert_eq!(p.cid.state(), CmState::Closed);
    assert_eq!(
        p.sid.disconnect_reason(),
        Some(DisconnectReason::PeerClosed)
    );
    assert_all_flushed(&p.client.rcq, 3);
    assert_all_flushed(&p.server.rcq, 3);
    assert_eq!(p.client.qp.state(), QpState::Error);
    assert_eq!(p.server.qp.state(), QpState::Error);
    no_llp_closed_fatal(&p.client.dev);
    no_llp_closed_fatal(&p.server.dev);
    // The QP can be reset and used for a new connection.
    p.client.qp.reset().unwrap();
    assert_eq!(p.client.qp.state(), QpState::Idle);
    assert!(matches!(p.cid.disconnect(), Ok(()) | Err(_)));
}

#[test]
fn graceful_disconnect_lets_posted_sends_finish_first() {
    let p = cm_pair(&ConnectOptions::default(), &ConnectOptions::default(), 2);
    let (buf, _) = p.client.mr(8192, LW, 3);
    post_send(&p.client.qp, &buf, 0, 4096, 1);
    post_send(&p.client.qp, &buf, 4096, 4096, 2);
    p.cid.disconnect().unwrap();
    let wcs = wait_wcs(&p.client.scq, 2);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    let got = wait_wcs(&p.server.rcq, 2);
    assert!(got.iter().all(|w| w.status == WcStatus::Success), "{got:?}");
    assert_eq!(
        disconnected(&p.cch, p.cid.conn_id()),
        DisconnectReason::Local
    );
    assert_eq!(
        disconnected(&p.sch, p.sid.conn_id()),
        DisconnectReason::PeerClosed
    );
}

#[test]
fn abort_resets_the_connection_and_the_peer_sees_it_lost() {
    let p = cm_pair(&ConnectOptions::default(), &ConnectOptions::default(), 2);
    p.cid.abort().unwrap();
    assert_eq!(
        disconnected(&p.cch, p.cid.conn_id()),
        DisconnectReason::Aborted
    );
    assert_eq!(
        disconnected(&p.sch, p.sid.conn_id()),
        DisconnectReason::ConnectionLost
    );
    assert_all_flushed(&p.client.rcq, 2);
    assert_all_flushed(&p.server.rcq, 2);
    assert!(matches!(p.cid.abort(), Err(Error::NotConnected)));
    no_llp_closed_fatal(&p.client.dev);
    no_llp_closed_fatal(&p.server.dev);
}

#[test]
fn destroying_the_peer_qp_disconnects_the_survivor() {
    let p = cm_pair(&ConnectOptions::default(), &ConnectOptions::default(), 2);
    let Pair {
        server,
        client,
        sch,
        cch,
        sid,
        cid,
        _l,
        _bufs,
    } = p;
    let End { qp, rcq, .. } = server;
    drop(qp);
    assert_all_flushed(&rcq, 2);
    assert_eq!(disconnected(&sch, sid.conn_id()), DisconnectReason::Local);
    assert_eq!(
        disconnected(&cch, cid.conn_id()),
        DisconnectReason::PeerClosed
    );
    assert_all_flushed(&client.rcq, 2);
}

#[test]
fn a_terminate_ends_the_connection_with_reason_qp_error() {
    let p = cm_pair(&ConnectOptions::default(), &ConnectOptions::default(), 1);
    p.client.qp.modify_to_error().unwrap();
    assert_eq!(
        disconnected(&p.cch, p.cid.conn_id()),
        DisconnectReason::QpError
    );
    assert_eq!(
        disconnected(&p.sch, p.sid.conn_id()),
        DisconnectReason::QpError
    );
}

#[test]
fn private_data_over_the_limit_is_refused_and_the_request_stays_answerable() {
    let server = End::new(None, None);
    let client = End::new(None, None);
    let sch = CmEventChannel::new().unwrap();
    let cch = CmEventChannel::new().unwrap();
    let l = listener(&sch, ConnectOptions::default());
    let long2 = ConnectOptions::default().private_data(&[1; 509]);
    assert!(matches!(
        cch.connect(&client.qp, l.local_addr(), &long2),
        Err(Error::Mpa(MpaError::PrivateDataTooLong {
            len: 509,
            max: 508
        }))
    ));
    let long1 = long2
        .clone()
        .revision(MpaRevision::Rev1)
        .private_data(&[1; 513]);
    assert!(matches!(
        cch.connect(&client.qp, l.local_addr(), &long1),
        Err(Error::Mpa(MpaError::PrivateDataTooLong {
            len: 513,
            max: 512
        }))
    ));
    assert_eq!(client.qp.state(), QpState::Idle, "nothing was claimed");
    let id = cch
        .connect(
            &client.qp,
            l.local_addr(),
            &ConnectOptions::default().private_data(&[2; 508]),
        )
        .unwrap();
    let req = request(&sch);
    assert_eq!(req.private_data(), &[2; 508][..]);
    assert_eq!(req.max_reply_private_data(&ConnectOptions::default()), 508);
    let r = req.accept(
        &server.qp,
        &ConnectOptions::default().private_data(&[3; 512]),
    );
    assert!(
        matches!(
            r,
            Err(Error::Mpa(MpaError::PrivateDataTooLong {
                len: 512,
                max: 508
            }))
        ),
        "{r:?}"
    );
    assert_eq!(server.qp.state(), QpState::Idle);
    req.accept(
        &server.qp,
        &ConnectOptions::default().private_data(&[3; 508]),
    )
    .unwrap();
    assert_eq!(established(&cch, id.conn_id()).peer_private_data, [3; 508]);
}

#[test]
fn ird_and_ord_are_exchanged_and_adjusted_on_both_sides() {
    let copts = ConnectOptions::default().ird(2).ord(8);
    let sopts = ConnectOptions::default().ird(4).ord(1);
    let p = cm_pair(&copts, &sopts, 0);
    let c = p.cid.connection().unwrap();
    let s = p.sid.connection().unwrap();
    // Responder: IRD raised to the initiator's ORD 8, ORD lowered to its IRD 2 (then to
    // its own 1). Initiator: ORD lowered to the responder's IRD 8, IRD 2 covers ORD 1.
    assert_eq!((s.ird, s.ord, s.peer_ird_ord), (8, 1, Some((2, 8))));
    assert_eq!((c.ird, c.ord, c.peer_ird_ord), (2, 8, Some((8, 1))));
    let e = End::new(None, None);
    let ch = CmEventChannel::new().unwrap();
    assert!(matches!(
        ch.connect(&e.qp, "127.0.0.1:9", &ConnectOptions::default().ird(17)),
        Err(Error::Limit { requested: 17, .. })
    ));
}

#[test]
fn the_responder_sends_nothing_before_the_initiators_first_fpdu() {
    for wait in [true, false] {
        let opts = ConnectOptions::default().responder_waits_for_initiator(wait);
        let p = cm_pair(&ConnectOptions::default(), &opts, 1);
        let (sbuf, _) = p.server.mr(64, LW, 5);
        post_send(&p.server.qp, &sbuf, 0, 64, 1);
        if wait {
            assert_no_wc(&p.client.rcq, Duration::from_millis(200));
            let (cbuf, _) = p.client.mr(64, LW, 6);
            post_send(&p.client.qp, &cbuf, 0, 8, 2);
        }
        let wc = wait_wcs(&p.client.rcq, 1);
        assert_eq!((wc[0].status, wc[0].byte_len), (WcStatus::Success, 64));
    }
}

#[test]
fn dropping_the_channel_abandons_attempts_and_closes_listeners() {
    let client = End::new(None, None);
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let cch = CmEventChannel::new().unwrap();
    let _id = cch
        .connect(
            &client.qp,
            silent.local_addr().unwrap(),
            &ConnectOptions::default(),
        )
        .unwrap();
    let sch = CmEventChannel::new().unwrap();
    let l = listener(&sch, ConnectOptions::default());
    let addr = l.local_addr();
    drop(l);
    drop(cch);
    assert_eq!(client.qp.state(), QpState::Idle);
    client
        .qp
        .connect(silent.local_addr().unwrap(), &quick(400))
        .unwrap_err();
    wait_until("the listener to close", || {
        std::net::TcpStream::connect(addr).is_err()
    });
}

#[test]
fn one_epoll_loop_serves_the_cm_channel_and_a_completion_channel() {
    use mio::unix::SourceFd;
    use mio::{Events, Interest, Poll, Token};

    let cc = Device::open_default().unwrap();
    let comp = cc.create_comp_channel().unwrap();
    let client = End::new(Some(&comp), Some(cc));
    let server = End::new(None, None);
    let (sbuf, _) = server.mr(4096, LW, 1);
    let (cbuf, cdata) = client.mr(4096, LW, 2);
    post_recv(&client.qp, &cbuf, 0, 4096, 7);
    post_recv(&server.qp, &sbuf, 0, 4096, 8);
    let sch = CmEventChannel::new().unwrap();
    let cch = CmEventChannel::new().unwrap();
    let l = listener(&sch, ConnectOptions::default());

    let mut poll = Poll::new().unwrap();
    let (cm_fd, cq_fd) = (cch.as_raw_fd(), comp.as_raw_fd());
    poll.registry()
        .register(&mut SourceFd(&cm_fd), Token(1), Interest::READABLE)
        .unwrap();
    poll.registry()
        .register(&mut SourceFd(&cq_fd), Token(2), Interest::READABLE)
        .unwrap();
    client.rcq.req_notify(false).unwrap();
    let id = cch
        .connect(&client.qp, l.local_addr(), &ConnectOptions::default())
        .unwrap();
    // The server answers from its own thread, sends once it heard from us, then
    // disconnects.
    std::thread::scope(|s| {
        s.spawn(|| {
            let sid = request(&sch)
                .accept(&server.qp, &ConnectOptions::default())
                .unwrap();
            wait_wcs(&server.rcq, 1);
            post_send(&server.qp, &sbuf, 0, 100, 9);
            wait_wcs(&server.scq, 1);
            sid.disconnect().unwrap();
        });
        let mut events = Events::with_capacity(8);
        let mut log = Vec::new();
        let deadline = Instant::now() + WAIT;
        while !(log.contains(&"TIMEWAIT_EXIT") && log.contains(&"RECV")) {
            assert!(Instant::now() < deadline, "event loop stuck after {log:?}");
            poll.poll(&mut events, Some(Duration::from_millis(100)))
                .unwrap();
            for ev in events.iter() {
                match ev.token() {
                    Token(1) => {
                        // Edge-triggered: take everything that is waiting.
                        while let Some(cm) = cch.try_get_event() {
                            assert_eq!(cm.conn_id(), Some(id.conn_id()));
                            log.push(cm.name());
                            if let CmEvent::Established { .. } = cm {
                                post_send(&client.qp, &cbuf, 0, 10, 1);
                            }
                        }
                    }
                    Token(2) => {
                        while let Some(cq) = comp.try_get_cq_event() {
                            cq.req_notify(false).unwrap();
                            while let Some(wc) = cq.poll_one() {
                                if wc.opcode == WcOpcode::Recv && wc.status == WcStatus::Success {
                                    log.push("RECV");
                                }
                            }
                        }
                    }
                    _ => unreachable!(),
                }
            }
        }
        // One loop saw everything: the CM events in their order, and the receive (the
        // loop may take the two fds in either order).
        let cm: Vec<_> = log.iter().filter(|e| **e != "RECV").copied().collect();
        assert_eq!(
            cm,
            ["ESTABLISHED", "DISCONNECTED", "TIMEWAIT_EXIT"],
            "{log:?}"
        );
    });
    assert_eq!(cbuf.to_vec().unwrap()[..100], sbuf.to_vec().unwrap()[..100]);
    let _ = cdata;
}

#[test]
fn resolve_names_and_connect_tries_every_address() {
    let addrs = softwarp::cm::resolve("localhost:7").unwrap();
    assert!(addrs.iter().all(|a| a.ip().is_loopback() && a.port() == 7));
    // No port: refused without asking any resolver.
    assert!(matches!(
        softwarp::cm::resolve("localhost"),
        Err(Error::Io { .. })
    ));
    // An address that refuses, then the listener: the attempt moves on to the second.
    let server = End::new(None, None);
    let client = End::new(None, None);
    let sch = CmEventChannel::new().unwrap();
    let cch = CmEventChannel::new().unwrap();
    let l = listener(&sch, ConnectOptions::default());
    let closed = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let both = [closed, l.local_addr()];
    std::thread::scope(|s| {
        s.spawn(|| request(&sch).accept(&server.qp, &ConnectOptions::default()));
        let (_, info) = cch
            .connect_blocking(&client.qp, &both[..], &ConnectOptions::default())
            .unwrap();
        assert_eq!(info.peer_addr, l.local_addr());
    });
}

#[test]
fn markers_both_ways_carry_large_messages_in_the_largest_fpdus() {
    // The largest FPDU MPA allows; with markers the engine keeps it within what FPDUPTR
    // can point back over.
    let opts = ConnectOptions::default()
        .markers(MarkerMode::Request)
        .max_fpdu_len(Some(usize::MAX));
    let server = End::new(None, None);
    let client = End::new(None, None);
    let len = 1 << 20;
    let rw = LW | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let (sbuf, sdata) = server.mr(2 * len, rw, 11);
    let (cbuf, cdata) = client.mr(2 * len, rw, 12);
    post_recv(&server.qp, &sbuf, 0, len, 1);
    let sch = CmEventChannel::new().unwrap();
    let cch = CmEventChannel::new().unwrap();
    let l = listener(&sch, opts.clone());
    let cid = cch.connect(&client.qp, l.local_addr(), &opts).unwrap();
    let sid = request(&sch).accept(&server.qp, &opts).unwrap();
    established(&sch, sid.conn_id());
    let info = established(&cch, cid.conn_id());
    assert!(info.markers_tx && info.markers_rx && info.crc, "{info:?}");
    // Send, then a Write and a Read of the second halves.
    post_send(&client.qp, &cbuf, 0, len, 1);
    let wc = wait_wcs(&server.rcq, 1);
    assert_eq!(
        (wc[0].status, wc[0].byte_len as usize),
        (WcStatus::Success, len)
    );
    assert!(sbuf.to_vec().unwrap()[..len] == cdata[..len]);
    client
        .qp
        .post_send(&SendWr {
            wr_id: 2,
            op: SendOp::Write {
                remote_addr: sbuf.addr() + len as u64,
                rkey: sbuf.rkey(),
            },
            payload: Payload::Sgl(SgList::single(cbuf.sge(len, len as u32).unwrap())),
            signaled: true,
            fence: false,
        })
        .unwrap();
    client
        .qp
        .post_send(&SendWr {
            wr_id: 3,
            op: SendOp::Read {
                remote_addr: sbuf.addr(),
                rkey: sbuf.rkey(),
            },
            payload: Payload::Sgl(SgList::single(cbuf.sge(0, len as u32).unwrap())),
            signaled: true,
            fence: true,
        })
        .unwrap();
    let wcs = wait_wcs(&client.scq, 3);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    let s = sbuf.to_vec().unwrap();
    assert!(s[len..] == cdata[len..]);
    assert!(
        cbuf.to_vec().unwrap()[..len] == cdata[..len],
        "read back what was sent"
    );
    let _ = sdata;
    assert_eq!(
        client.qp.stats().crc_errors + server.qp.stats().crc_errors,
        0
    );
    cid.disconnect().unwrap();
    assert_eq!(
        disconnected(&sch, sid.conn_id()),
        DisconnectReason::PeerClosed
    );
}

/// `rdma_migrate_id` of a listening id, and of a connected one: a listener routed to another
/// channel delivers its queued and its later requests there, and the connections they become
/// report there too; a connection routed on its own follows, and back home its events return.
/// The channel that made them still drives them.
#[test]
fn routed_listeners_and_connections_report_on_the_channel_they_were_moved_to() {
    let server = End::new(None, None);
    let server2 = End::new(None, None);
    let client = End::new(None, None);
    let client2 = End::new(None, None);
    let home = CmEventChannel::new().unwrap();
    let away = CmEventChannel::new().unwrap();
    let cch = CmEventChannel::new().unwrap();
    let l = listener(&home, ConnectOptions::default());
    // A request queued before the move goes with it.
    let c1 = cch
        .connect(&client.qp, l.local_addr(), &ConnectOptions::default())
        .unwrap();
    wait_until("the request queued at home", || home.pending_events() == 1);
    l.route_events_to(&away);
    assert_eq!(home.pending_events(), 0);
    let r1 = request(&away);
    let s1 = r1.accept(&server.qp, &ConnectOptions::default()).unwrap();
    established(&away, s1.conn_id());
    established(&cch, c1.conn_id());
    // A later request arrives there too.
    let c2 = cch
        .connect(&client2.qp, l.local_addr(), &ConnectOptions::default())
        .unwrap();
    let r2 = request(&away);
    let s2 = r2.accept(&server2.qp, &ConnectOptions::default()).unwrap();
    established(&away, s2.conn_id());
    established(&cch, c2.conn_id());
    // The first connection goes home; the second stays away.
    s1.route_events_to(&home).unwrap();
    c1.disconnect().unwrap();
    c2.disconnect().unwrap();
    assert_eq!(
        disconnected(&home, s1.conn_id()),
        DisconnectReason::PeerClosed
    );
    assert_eq!(
        disconnected(&away, s2.conn_id()),
        DisconnectReason::PeerClosed
    );
    disconnected(&cch, c1.conn_id());
    disconnected(&cch, c2.conn_id());
    no_event(&home, Duration::from_millis(50));
    no_event(&away, Duration::from_millis(50));
}

/// A held disconnect (`rdma_disconnect`): it returns at once, and the FIN waits for the
/// peer's until the bound: the peer's Send after it still lands; DISCONNECTED comes when
/// the connection is closed.
#[test]
fn a_disconnect_after_the_peer_returns_at_once_and_holds_its_fin_until_the_bound() {
    let p = cm_pair(&ConnectOptions::default(), &ConnectOptions::default(), 3);
    let order = softwarp::cm::CloseOrder {
        responder: Duration::from_millis(1500),
        initiator: Duration::from_millis(1500),
    };
    let t = Instant::now();
    p.sid.disconnect_after_peer(&order).unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(100),
        "{:?}",
        t.elapsed()
    );
    // The client has not seen a FIN: its Send still reaches the server's posted receive.
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(p.client.qp.state(), QpState::Rts);
    let (cbuf, _) = p.client.mr(64, LW, 7);
    post_send(&p.client.qp, &cbuf, 0, 64, 9);
    let wc = wait_wcs(&p.server.rcq, 1);
    assert_eq!((wc[0].status, wc[0].byte_len), (WcStatus::Success, 64));
    // Nobody closes from the client: the server's FIN goes when the bound passes.
    assert_eq!(
        disconnected(&p.cch, p.cid.conn_id()),
        DisconnectReason::PeerClosed
    );
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(1400) && waited < Duration::from_millis(4000),
        "{waited:?}"
    );
    assert_eq!(
        disconnected(&p.sch, p.sid.conn_id()),
        DisconnectReason::Local
    );
}
