//! A peer host that vanishes while nothing is in flight: the two ends in network namespaces
//! this test creates, joined by a veth pair; once connected (a Send each way proves it),
//! every packet the responder's namespace sends is dropped (nftables), as when its host
//! loses power or its cable is pulled: no FIN, no reset, no answer.
//!
//! With [`ConnectOptions::tcp_keepalive`] the initiator's kernel probes the silent peer and
//! drops the connection after `idle + count * interval`: the QP goes to Error with
//! [`QpErrorReason::PeerUnreachable`], its posted receive flushes, and the device reports
//! the fatal event; with the connection manager the id reports `Disconnected` with
//! [`DisconnectReason::PeerUnreachable`]. Without keepalive (the control) the QP stays in
//! RTS with its receive posted, as it did before keepalive existed. With the progress
//! thread moving the bytes (it watches the socket) and in busy-poll mode (the application
//! is not polling: the progress thread's take-over finds the failed socket) alike.
//!
//! Needs root, `ip` (iproute2) and `nft` (nftables); skips with a printed reason otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use softwarp::*;
use softwarp_testkit::require;

use crate::cm_support::{disconnected, established, request};
use crate::netns;
use crate::netns::{drop_packets, in_ns, unavailable, Ns};
use crate::util::{wait_wcs, End, WAIT};

/// 1 s of silence, then 2 probes 1 s apart: the kernel gives up about 3 s after the last
/// byte from the peer.
const FAST: Keepalive = Keepalive {
    idle: Duration::from_secs(1),
    interval: Duration::from_secs(1),
    count: 2,
};

/// How long a QP may take to notice (keepalive's 3 s plus scheduling), and how long the
/// control must stay in RTS after the keepalive QP failed.
const NOTICE: Duration = Duration::from_secs(15);
const CONTROL_MORE: Duration = Duration::from_secs(2);

/// `a` (in `ns_a`) connected to `b` (in `ns_b`, at 10.77.0.2) with `opts`, a receive
/// posted on each and one Send each way delivered.
fn connect_in(ns_a: &Ns, ns_b: &Ns, a: &End, b: &End, opts: &ConnectOptions) {
    let listener = in_ns(ns_b, || {
        Listener::bind(SocketAddr::new("10.77.0.2".parse().unwrap(), 0)).unwrap()
    });
    let addr = listener.local_addr().unwrap();
    std::thread::scope(|s| {
        let acc = s.spawn(|| listener.accept_timeout(&b.qp, opts, WAIT).unwrap());
        in_ns(ns_a, || a.qp.connect(addr, opts).unwrap());
        acc.join().unwrap();
    });
    for (from, to) in [(a, b), (b, a)] {
        let (mr, _) = to.mr(64, AccessFlags::LOCAL_WRITE, 1);
        to.qp
            .post_recv(&RecvWr {
                wr_id: 1,
                sgl: SgList::single(mr.sge(0, 64).unwrap()),
            })
            .unwrap();
        let (src, _) = from.mr(64, AccessFlags::LOCAL_WRITE, 2);
        from.qp
            .post_send(&SendWr {
                wr_id: 2,
                op: SendOp::Send {
                    solicited: false,
                    invalidate: None,
                },
                payload: Payload::Sgl(SgList::single(src.sge(0, 64).unwrap())),
                signaled: true,
                fence: false,
            })
            .unwrap();
        assert_eq!(wait_wcs(&from.scq, 1)[0].status, WcStatus::Success);
        assert_eq!(wait_wcs(&to.rcq, 1)[0].status, WcStatus::Success);
    }
}

/// Posts a receive the vanished peer will never fill.
fn post_pending_recv(e: &End) -> MemoryRegion {
    let (mr, _) = e.mr(64, AccessFlags::LOCAL_WRITE, 3);
    e.qp.post_recv(&RecvWr {
        wr_id: 77,
        sgl: SgList::single(mr.sge(0, 64).unwrap()),
    })
    .unwrap();
    mr
}

/// Until `qp` leaves RTS or `NOTICE` passed: how long it took.
fn until_failed(qp: &QueuePair, since: Instant) -> Option<Duration> {
    while since.elapsed() < NOTICE {
        if qp.state() != QpState::Rts {
            return Some(since.elapsed());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

fn case(busy: bool) {
    if !require(unavailable(&["ip", "nft"])) {
        return;
    }

    let (ns_a, ns_b) = netns::veth();
    let keep = ConnectOptions::default().tcp_keepalive(Some(FAST));
    let none = ConnectOptions::default().tcp_keepalive(None);
    // Busy-poll mode: CQs in busy-poll mode that the test does not poll while it waits.
    // Otherwise the progress thread moves the bytes.
    let ends = || {
        let (a, b) = (End::new(None, None), End::new(None, None));
        for cq in [&a.scq, &a.rcq, &b.scq, &b.rcq] {
            cq.set_busy_poll(busy);
        }
        (a, b)
    };
    let (ka, kb) = ends();
    let (na, nb) = ends();
    connect_in(&ns_a, &ns_b, &ka, &kb, &keep);
    connect_in(&ns_a, &ns_b, &na, &nb, &none);
    let kmr = post_pending_recv(&ka);
    let nmr = post_pending_recv(&na);

    // The responder's host goes silent.
    drop_packets(&ns_b, 100);
    let t0 = Instant::now();
    let took = until_failed(&ka.qp, t0).unwrap_or_else(|| {
        panic!(
            "with keepalive 1 s + 2 x 1 s the QP was still {:?} after {NOTICE:?}",
            ka.qp.state()
        )
    });
    assert_eq!(ka.qp.state(), QpState::Error);
    let reason = ka.qp.error_reason();
    assert!(
        matches!(reason, Some(QpErrorReason::PeerUnreachable { .. })),
        "{reason:?}"
    );
    let wcs = wait_wcs(&ka.rcq, 1);
    assert_eq!(
        (wcs[0].wr_id, wcs[0].status),
        (77, WcStatus::WrFlushErr),
        "the pending receive is flushed"
    );
    let fatal = std::iter::from_fn(|| ka.dev.try_get_async_event()).any(|e| {
        matches!(
            e,
            AsyncEvent::QpFatal {
                cause: Cause::LlpClosed,
                ..
            }
        )
    });
    assert!(fatal, "the device reports the QP's fatal event");
    println!(
        "{}: keepalive QP in Error {:.2} s after its peer went silent: {}",
        if busy { "busy-poll" } else { "progress thread" },
        took.as_secs_f64(),
        reason.unwrap()
    );

    // The control, without keepalive, is still connected a while later.
    std::thread::sleep(CONTROL_MORE);
    assert_eq!(
        na.qp.state(),
        QpState::Rts,
        "without keepalive a silent peer goes unnoticed (the control)"
    );
    assert_eq!(na.rcq.poll_one().map(|w| w.wr_id), None);
    println!(
        "control without keepalive: still {:?} after {:.2} s",
        na.qp.state(),
        t0.elapsed().as_secs_f64()
    );
    // Registrations before their devices (a device closed with them reports a leak).
    drop((kmr, nmr));
    drop((ka, kb, na, nb));
}

#[test]
fn a_vanished_peer_fails_the_qp_after_keepalive_with_the_progress_thread() {
    case(false);
}

#[test]
fn a_vanished_peer_fails_the_qp_after_keepalive_in_busy_poll_mode() {
    case(true);
}

#[test]
fn a_vanished_peer_ends_a_cm_connection_as_peer_unreachable() {
    if !require(unavailable(&["ip", "nft"])) {
        return;
    }

    let (ns_a, ns_b) = netns::veth();
    let keep = ConnectOptions::default().tcp_keepalive(Some(FAST));
    // Each end opens its device and event channel inside its namespace (the connection
    // manager's sockets are made on their threads), and listens or connects from there.
    let end = || (End::new(None, None), CmEventChannel::new().unwrap());
    let (client, cch) = in_ns(&ns_a, end);
    let (server, sch) = in_ns(&ns_b, end);
    let opts = ListenOptions::default().options(keep.clone());
    let l = in_ns(&ns_b, || sch.listen("10.77.0.2:0", &opts).unwrap());
    let cid = in_ns(&ns_a, || {
        cch.connect(&client.qp, l.local_addr(), &keep).unwrap()
    });
    let sid = request(&sch).accept(&server.qp, &keep).unwrap();
    established(&sch, sid.conn_id());
    established(&cch, cid.conn_id());
    let mr = post_pending_recv(&client);

    drop_packets(&ns_b, 100);
    let t0 = Instant::now();
    assert_eq!(
        disconnected(&cch, cid.conn_id()),
        DisconnectReason::PeerUnreachable
    );
    let took = t0.elapsed();
    let reason = client.qp.error_reason();
    assert!(
        matches!(reason, Some(QpErrorReason::PeerUnreachable { .. })),
        "{reason:?}"
    );
    let wcs = wait_wcs(&client.rcq, 1);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (77, WcStatus::WrFlushErr));
    println!(
        "connection manager: Disconnected (PeerUnreachable) {:.2} s after the peer went silent",
        took.as_secs_f64()
    );
    drop(mr);
    drop((cid, sid, l, cch, sch));
}
