//! `Duration::MAX` given to every public API that takes a timeout means "no limit": no
//! panic (`Instant::now() + Duration::MAX` overflowed before), and a wait that is satisfied
//! returns normally. Each wait here is satisfied at once or within milliseconds, so the tests
//! end; an outer bound ([`WAIT`]) guards the ones that block on another thread.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::mpsc;
use std::time::Duration;

use softwarp::*;

use crate::cm_support::*;
use crate::util::*;

const NO_LIMIT: Duration = Duration::MAX;

fn unlimited() -> ConnectOptions {
    ConnectOptions::default().timeout(NO_LIMIT)
}

/// Runs `f` on a thread and waits at most [`WAIT`] for it, so that a wait that really
/// became endless fails the test instead of hanging it.
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(WAIT)
        .unwrap_or_else(|e| panic!("{what}: no result within {WAIT:?} ({e})"))
}

#[test]
fn a_cm_listener_with_timeout_duration_max_keeps_serving_connections() {
    // The listener's timeout is the time a peer has to send its Request; computing that
    // deadline panicked the channel's thread at the first connection, and every later call
    // returned ChannelClosed.
    let sch = CmEventChannel::new().unwrap();
    let cch = CmEventChannel::new().unwrap();
    let l = sch
        .listen(
            "127.0.0.1:0",
            &ListenOptions::default().options(unlimited()),
        )
        .unwrap();
    for round in 0..2 {
        let server = End::new(None, None);
        let client = End::new(None, None);
        let id = cch
            .connect(&client.qp, l.local_addr(), &ConnectOptions::default())
            .unwrap();
        let req = request(&sch);
        let sid = req.accept(&server.qp, &ConnectOptions::default()).unwrap();
        established(&sch, sid.conn_id());
        let info = established(&cch, id.conn_id());
        assert_eq!(info.peer_addr, l.local_addr(), "round {round}");
    }
    // The thread is alive: a new listener still works.
    sch.listen("127.0.0.1:0", &ListenOptions::default())
        .unwrap();
}

#[test]
fn cm_connect_accept_and_event_waits_take_duration_max() {
    let server = End::new(None, None);
    let client = End::new(None, None);
    let sch = CmEventChannel::new().unwrap();
    let cch = std::sync::Arc::new(CmEventChannel::new().unwrap());
    let l = sch
        .listen(
            "127.0.0.1:0",
            &ListenOptions::default().options(unlimited()),
        )
        .unwrap();
    let addr = l.local_addr();
    let cch2 = std::sync::Arc::clone(&cch);
    let connecting = std::thread::spawn(move || {
        let r = cch2.connect_blocking(&client.qp, addr, &unlimited());
        (r, client)
    });
    // CmListener::accept with a Duration::MAX wait and unlimited options.
    let (accepted, _server, _l) = bounded("accept", move || {
        let r = l.accept(&server.qp, &unlimited(), Some(NO_LIMIT));
        (r, server, l)
    });
    let (sid, sinfo) = accepted.unwrap();
    let (connected, client) = bounded("connect_blocking", move || connecting.join().unwrap());
    let (cid, cinfo) = connected.unwrap();
    assert_eq!(sinfo.role, Role::Responder);
    assert_eq!(cinfo.role, Role::Initiator);
    assert_eq!(cid.state(), CmState::Established);

    // get_event / get_event_matching with an event waiting.
    sid.disconnect().unwrap();
    let ev = cch
        .get_event_matching(Some(NO_LIMIT), |e| {
            matches!(e, CmEvent::Disconnected { .. })
        })
        .unwrap();
    assert_eq!(ev.conn_id(), Some(cid.conn_id()));
    let ev = cch.get_event(Some(NO_LIMIT)).unwrap();
    assert!(matches!(ev, CmEvent::TimewaitExit { .. }), "{ev:?}");
    // QueuePair::wait_closed with the connection gone.
    let st = client.qp.wait_closed(NO_LIMIT).unwrap();
    assert!(matches!(st, QpState::Error | QpState::Idle), "{st:?}");
}

#[test]
fn cm_get_request_and_reject_take_duration_max() {
    let client = End::new(None, None);
    let sch = CmEventChannel::new().unwrap();
    let cch = CmEventChannel::new().unwrap();
    let l = sch
        .listen(
            "127.0.0.1:0",
            &ListenOptions::default().options(unlimited()),
        )
        .unwrap();
    let id = cch
        .connect(&client.qp, l.local_addr(), &unlimited())
        .unwrap();
    let req = l.get_request(Some(NO_LIMIT)).unwrap();
    // The reject Reply is written with the listener's (unlimited) timeout.
    req.reject(b"no").unwrap();
    match ev_of(&cch, id.conn_id()) {
        CmEvent::Rejected { private_data, .. } => assert_eq!(private_data, b"no"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn blocking_connect_and_listener_accept_take_duration_max() {
    let mut client = End::new(None, None);
    let server = End::new(None, None);
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let accepting = std::thread::spawn(move || {
        let r = l.accept_timeout(&server.qp, &unlimited(), NO_LIMIT);
        (r, server)
    });
    let cinfo = client.qp.connect(addr, &unlimited()).unwrap();
    let (accepted, _server) = bounded("accept_timeout", move || accepting.join().unwrap());
    let sinfo = accepted.unwrap();
    assert_eq!((cinfo.role, sinfo.role), (Role::Initiator, Role::Responder));
    client.info = Some(cinfo);
}

#[test]
fn completion_and_async_event_waits_take_duration_max() {
    let ch = Device::open_default()
        .unwrap()
        .create_comp_channel()
        .unwrap();
    let mut a = End::new(None, None);
    let mut b = End::new(Some(&ch), None);
    connect(&mut a, &mut b, &ConnectOptions::default());
    let (buf, _) = b.mr(4096, AccessFlags::LOCAL_WRITE, 0);
    post_recv(&b.qp, &buf, 0, 256, 1);
    b.rcq.req_notify(false).unwrap();
    a.qp.post_send(&send_wr(1, send_op(false, None), Payload::Inline(b"one")))
        .unwrap();
    let cq = ch.get_cq_event(Some(NO_LIMIT)).unwrap();
    assert_eq!(cq.id(), b.rcq.id());
    wait_wcs(&b.rcq, 1);

    // The device's asynchronous events: a device fault reports one at once.
    let dev = Device::open_default().unwrap();
    dev.inject_fatal_error();
    let ev = dev.get_async_event_timeout(NO_LIMIT).unwrap();
    assert!(matches!(ev, AsyncEvent::DeviceFatal), "{ev:?}");
}

#[test]
fn a_release_wait_and_a_stall_timeout_of_duration_max_mean_no_limit() {
    // An MR nothing else holds is released at once; the wait returns without computing an
    // end that the clock cannot represent.
    let end = End::new(None, None);
    let (mr, _) = end.mr(64, AccessFlags::LOCAL_WRITE, 1);
    let release = mr.deregister();
    bounded("MrRelease::wait(Duration::MAX)", move || {
        release.wait(NO_LIMIT).unwrap()
    });

    // A connection without a receive stall bound still moves data, and the progress thread's
    // stall looks (a period derived from the timeout) do not overflow.
    let opts = ConnectOptions::default().rx_stall_timeout(NO_LIMIT);
    let (a, b) = pair(&opts);
    let (src, data) = a.mr(128, AccessFlags::LOCAL_WRITE, 2);
    let (dst, _) = b.mr(128, AccessFlags::LOCAL_WRITE, 3);
    b.qp.post_recv(&RecvWr {
        wr_id: 7,
        sgl: SgList::single(dst.sge(0, 128).unwrap()),
    })
    .unwrap();
    a.qp.post_send(&send_wr(
        1,
        send_op(false, None),
        Payload::Sgl(SgList::single(src.sge(0, 128).unwrap())),
    ))
    .unwrap();
    assert_eq!(wait_wcs(&b.rcq, 1)[0].status, WcStatus::Success);
    assert_eq!(dst.to_vec().unwrap(), data);
}
