//! Remote access errors, local misuse, connection loss and bad MPA negotiation, over real
//! loopback TCP: a protection error produces a Terminate that the other side reports as an
//! asynchronous event, both QPs go to Error and outstanding work requests flush; misuse is
//! refused with a typed error; a bad or silent peer never makes a call hang.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use crate::util::*;
use softwarp::*;
use softwarp_testkit::quick;

const LW: AccessFlags = AccessFlags::LOCAL_WRITE;

fn post_recvs(e: &End, mr: &MemoryRegion, ids: std::ops::Range<u64>) {
    for id in ids {
        e.qp.post_recv(&RecvWr {
            wr_id: id,
            sgl: SgList::single(mr.sge(0, 64).unwrap()),
        })
        .unwrap();
    }
}

fn qp_event_of(ev: &AsyncEvent, qp: u32) -> Option<Cause> {
    match *ev {
        AsyncEvent::QpFatal { qp_num, cause }
        | AsyncEvent::QpAccessError { qp_num, cause }
        | AsyncEvent::QpRequestError { qp_num, cause }
            if qp_num == qp =>
        {
            Some(cause)
        }
        _ => None,
    }
}

/// Posts a tagged operation that `b` must refuse; checks the Terminate's effects on both
/// sides. Returns a's send completions and b's detected fault.
fn remote_violation(
    b_access: AccessFlags,
    op: impl FnOnce(&MemoryRegion) -> SendOp,
    len: u32,
) -> (Vec<WorkCompletion>, Cause, Cause) {
    let (a, b) = pair(&ConnectOptions::default());
    let (a_buf, _) = a.mr(8192, LW, 1);
    let (b_buf, _) = b.mr(8192, LW, 2);
    let (target, _) = b.mr(4096, b_access, 3);
    post_recvs(&a, &a_buf, 0..3);
    post_recvs(&b, &b_buf, 10..13);
    let sgl = if len == 0 {
        SgList::new()
    } else {
        SgList::single(a_buf.sge(0, len).unwrap())
    };
    a.qp.post_send(&send_wr(100, op(&target), Payload::Sgl(sgl)))
        .unwrap();

    // b detects the violation, reports it, sends a Terminate and goes to Error.
    let (ev_b, _) = wait_event(&b.dev, |e| qp_event_of(e, b.qp.qp_num()).is_some());
    assert!(
        matches!(ev_b, AsyncEvent::QpAccessError { .. }),
        "b reports an access error: {ev_b:?}"
    );
    // a receives the Terminate and reports it.
    let (ev_a, _) = wait_event(&a.dev, |e| qp_event_of(e, a.qp.qp_num()).is_some());
    let cause_a = qp_event_of(&ev_a, a.qp.qp_num()).unwrap();
    assert!(
        matches!(cause_a, Cause::PeerTerminate { .. }),
        "a reports the peer's Terminate: {ev_a:?}"
    );
    wait_state(&a.qp, QpState::Error);
    wait_state(&b.qp, QpState::Error);

    // Outstanding receives flush on both sides.
    for (e, base) in [(&a, 0u64), (&b, 10)] {
        let wcs = wait_wcs(&e.rcq, 3);
        let ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, vec![base, base + 1, base + 2]);
        assert!(
            wcs.iter().all(|w| w.status == WcStatus::WrFlushErr),
            "{wcs:?}"
        );
    }
    let a_wcs = wait_wcs(&a.scq, 1);
    // New work after the error completes at once with a flush status.
    a.qp.post_send(&send_wr(
        101,
        send_op(false, None),
        Payload::Inline(b"late"),
    ))
    .unwrap();
    let late = wait_wcs(&a.scq, 1);
    assert_eq!(late[0].wr_id, 101);
    assert_eq!(late[0].status, WcStatus::WrFlushErr);
    // Both connections close.
    a.qp.wait_closed(WAIT).unwrap();
    b.qp.wait_closed(WAIT).unwrap();
    (a_wcs, qp_event_of(&ev_b, b.qp.qp_num()).unwrap(), cause_a)
}

#[test]
fn write_to_stag_without_remote_write_terminates_both_qps_and_flushes() {
    let (wcs, cause_b, cause_a) = remote_violation(
        LW,
        |t| SendOp::Write {
            remote_addr: t.addr(),
            rkey: t.rkey(),
        },
        64,
    );
    assert_eq!(
        cause_b,
        Cause::Detected(Fault::Tagged(AccessError::AccessRights))
    );
    // RFC 5040: the access rights violation is reported at the RDMAP layer (layer 0).
    assert!(
        matches!(cause_a, Cause::PeerTerminate { layer: 0, .. }),
        "{cause_a:?}"
    );
    assert_eq!(wcs[0].wr_id, 100);
    assert_eq!(wcs[0].opcode, WcOpcode::RdmaWrite);
}

#[test]
fn write_beyond_the_region_is_a_bounds_violation_reported_by_terminate() {
    let (_, cause_b, cause_a) = remote_violation(
        LW | AccessFlags::REMOTE_WRITE,
        |t| SendOp::Write {
            remote_addr: t.addr() + 4096 - 10,
            rkey: t.rkey(),
        },
        64,
    );
    assert_eq!(
        cause_b,
        Cause::Detected(Fault::Tagged(AccessError::BaseOrBounds))
    );
    // DDP tagged buffer error (layer 1).
    assert!(
        matches!(cause_a, Cause::PeerTerminate { layer: 1, .. }),
        "{cause_a:?}"
    );
}

#[test]
fn write_with_an_unknown_stag_is_refused() {
    let (_, cause_b, _) = remote_violation(
        LW | AccessFlags::REMOTE_WRITE,
        |t| SendOp::Write {
            remote_addr: t.addr(),
            rkey: Stag(t.rkey().0 ^ 0x5a),
        },
        8,
    );
    assert!(
        matches!(
            cause_b,
            Cause::Detected(Fault::Tagged(
                AccessError::KeyMismatch | AccessError::InvalidStag
            ))
        ),
        "{cause_b:?}"
    );
}

#[test]
fn read_beyond_the_region_fails_the_read_with_a_remote_access_error() {
    let (wcs, cause_b, _) = remote_violation(
        LW | AccessFlags::REMOTE_READ,
        |t| SendOp::Read {
            remote_addr: t.addr() + 4000,
            rkey: t.rkey(),
        },
        200,
    );
    assert_eq!(
        cause_b,
        Cause::Detected(Fault::ReadSource(AccessError::BaseOrBounds))
    );
    assert_eq!(wcs[0].wr_id, 100);
    assert_eq!(wcs[0].opcode, WcOpcode::RdmaRead);
    assert_ne!(wcs[0].status, WcStatus::Success, "{wcs:?}");
}

#[test]
fn read_of_a_region_without_remote_read_is_refused() {
    let (wcs, cause_b, _) = remote_violation(
        LW | AccessFlags::REMOTE_WRITE,
        |t| SendOp::Read {
            remote_addr: t.addr(),
            rkey: t.rkey(),
        },
        16,
    );
    assert_eq!(
        cause_b,
        Cause::Detected(Fault::ReadSource(AccessError::AccessRights))
    );
    assert_ne!(wcs[0].status, WcStatus::Success);
}

#[test]
fn send_without_a_posted_receive_terminates_with_a_request_error() {
    // Once the RNR wait (ConnectOptions::rnr_wait) has passed.
    let wait = Duration::from_millis(200);
    let (a, b) = pair(&ConnectOptions::default().rnr_wait(Some(wait)));
    let t0 = std::time::Instant::now();
    a.qp.post_send(&send_wr(
        1,
        send_op(false, None),
        Payload::Inline(b"nobody"),
    ))
    .unwrap();
    let (ev, _) = wait_event(&b.dev, |e| qp_event_of(e, b.qp.qp_num()).is_some());
    assert_eq!(
        ev,
        AsyncEvent::QpRequestError {
            qp_num: b.qp.qp_num(),
            cause: Cause::Detected(Fault::NoReceiveBuffer)
        }
    );
    assert!(t0.elapsed() >= wait, "failed after {:?}", t0.elapsed());
    assert_eq!(b.qp.stats().rx_rnr_expired, 1);
    wait_event(&a.dev, |e| qp_event_of(e, a.qp.qp_num()).is_some());
    wait_state(&a.qp, QpState::Error);
}

#[test]
fn modify_to_error_flushes_and_the_peer_sees_the_terminate() {
    let (a, b) = pair(&ConnectOptions::default());
    let (buf, _) = a.mr(4096, LW, 0);
    let (bbuf, _) = b.mr(4096, LW, 0);
    post_recvs(&a, &buf, 0..4);
    post_recvs(&b, &bbuf, 0..2);
    a.qp.modify_to_error().unwrap();
    let wcs = wait_wcs(&a.rcq, 4);
    assert!(wcs.iter().all(|w| w.status == WcStatus::WrFlushErr));
    let (ev, _) = wait_event(&b.dev, |e| qp_event_of(e, b.qp.qp_num()).is_some());
    assert!(
        matches!(
            qp_event_of(&ev, b.qp.qp_num()),
            Some(Cause::PeerTerminate { .. })
        ),
        "{ev:?}"
    );
    let wcs = wait_wcs(&b.rcq, 2);
    assert!(wcs.iter().all(|w| w.status == WcStatus::WrFlushErr));
    wait_state(&b.qp, QpState::Error);
}

#[test]
fn peer_destroy_closes_the_connection_and_flushes_the_survivor() {
    let (a, b) = pair(&ConnectOptions::default());
    let (bbuf, _) = b.mr(4096, LW, 0);
    post_recvs(&b, &bbuf, 0..3);
    let End { qp, .. } = a;
    drop(qp);
    let (ev, _) = wait_event(&b.dev, |e| qp_event_of(e, b.qp.qp_num()).is_some());
    assert_eq!(
        ev,
        AsyncEvent::QpFatal {
            qp_num: b.qp.qp_num(),
            cause: Cause::LlpClosed
        }
    );
    let wcs = wait_wcs(&b.rcq, 3);
    assert!(wcs.iter().all(|w| w.status == WcStatus::WrFlushErr));
    b.qp.wait_closed(WAIT).unwrap();
}

#[test]
fn destroying_a_qp_flushes_its_outstanding_work_into_the_cq() {
    let (a, _b) = pair(&ConnectOptions::default());
    let (buf, _) = a.mr(4096, LW, 0);
    post_recvs(&a, &buf, 0..5);
    let End { qp, rcq, .. } = a;
    drop(qp);
    let wcs = wait_wcs(&rcq, 5);
    assert!(wcs.iter().all(|w| w.status == WcStatus::WrFlushErr));
}

#[test]
fn misuse_is_refused_with_typed_errors() {
    assert!(matches!(
        Device::open("mlx5_0"),
        Err(Error::DeviceNotFound(_))
    ));
    assert_eq!(list_devices(), vec![DEVICE_NAME.to_string()]);
    let e = End::new(None, None);
    assert!(matches!(
        e.pd.reg_mr(16, AccessFlags::REMOTE_WRITE),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        e.dev.create_cq(0, None),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        e.dev.create_cq(1 << 30, None),
        Err(Error::Limit { .. })
    ));
    assert!(matches!(
        e.scq.req_notify(false),
        Err(Error::InvalidArgument(_))
    ));
    let (mr, _) = e.mr(16, LW, 0);
    assert!(mr.sge(8, 9).is_err(), "SGE beyond the region");
    assert!(mr.write_at(10, &[0; 7]).is_err());
    // Posting a send before the QP is connected.
    assert!(matches!(
        e.qp.post_send(&send_wr(1, send_op(false, None), Payload::Inline(b"x"))),
        Err(Error::Qp(_))
    ));
    // Too many SGEs for the QP's capacity.
    let e2 = End::with(None, Some(e.dev.clone()), |a| a.cap.max_send_sge = 1);
    let (m2, _) = e2.mr(64, LW, 0);
    let two = SgList::from_slice(&[m2.sge(0, 8).unwrap(), m2.sge(8, 8).unwrap()]).unwrap();
    assert!(matches!(
        e2.qp
            .post_send(&send_wr(1, send_op(false, None), Payload::Sgl(two))),
        Err(Error::InvalidArgument(_))
    ));
    let attr = e.dev.query();
    assert_eq!(attr.max_sge, MAX_SGE);
    assert_eq!(attr.transport, "iWARP");
    // A QP with a CQ from another device.
    let other = Device::open_default().unwrap();
    let cq = other.create_cq(4, None).unwrap();
    assert!(matches!(
        e.pd.create_qp(&QpInitAttr::new(&cq, &cq)),
        Err(Error::WrongOwner(_))
    ));
}

#[test]
fn connecting_twice_is_refused() {
    let (a, _b) = pair(&ConnectOptions::default());
    let addr = a.info.as_ref().unwrap().peer_addr;
    assert!(matches!(
        a.qp.connect(addr, &ConnectOptions::default()),
        Err(Error::AlreadyConnected)
    ));
}

#[test]
fn accept_rejects_garbage_instead_of_an_mpa_request() {
    let e = End::new(None, None);
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut rest = Vec::new();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let _ = s.read_to_end(&mut rest);
    });
    let r = l.accept_timeout(&e.qp, &quick(300), WAIT);
    assert!(matches!(r, Err(Error::Mpa(MpaError::BadFrame(_)))), "{r:?}");
    assert_eq!(e.qp.state(), QpState::Idle, "the QP can accept again");
    t.join().unwrap();
}

#[test]
fn accept_times_out_when_the_peer_sends_nothing() {
    let e = End::new(None, None);
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let _silent = TcpStream::connect(addr).unwrap();
    let r = l.accept_timeout(&e.qp, &quick(300), WAIT);
    assert!(matches!(r, Err(Error::Mpa(MpaError::Timeout(_)))), "{r:?}");
    // No connection at all: the accept itself times out.
    let r = l.accept_timeout(&e.qp, &quick(300), Duration::from_millis(50));
    assert!(matches!(r, Err(Error::Timeout(_))), "{r:?}");
}

/// A raw TCP server that reads the MPA Request (returned) and answers `reply` (or nothing).
fn raw_server(reply: Option<Vec<u8>>) -> (std::net::SocketAddr, std::thread::JoinHandle<Vec<u8>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut req = vec![0u8; 24];
        s.read_exact(&mut req).unwrap();
        match reply {
            Some(r) => s.write_all(&r).unwrap(),
            None => std::thread::sleep(Duration::from_millis(600)),
        }
        req
    });
    (addr, h)
}

fn frame(key: &[u8; 16], flags: u8, rev: u8, pd: &[u8]) -> Vec<u8> {
    let mut v = key.to_vec();
    v.push(flags);
    v.push(rev);
    v.extend_from_slice(&(pd.len() as u16).to_be_bytes());
    v.extend_from_slice(pd);
    v
}

#[test]
fn connect_sends_a_rev2_request_with_crc_and_ird_ord() {
    let (addr, h) = raw_server(None);
    let e = End::new(None, None);
    let r = e.qp.connect(addr, &quick(300));
    assert!(matches!(r, Err(Error::Mpa(MpaError::Timeout(_)))), "{r:?}");
    let req = h.join().unwrap();
    // Key, flags C (0x40) + enhanced (0x10), rev 2, PD_Length 4, IRD 16, ORD 16.
    assert_eq!(&req[..16], b"MPA ID Req Frame");
    assert_eq!(&req[16..], &[0x50, 2, 0, 4, 0, 16, 0, 16]);
    assert_eq!(e.qp.state(), QpState::Idle);
}

#[test]
fn connect_reports_a_reject_reply_with_its_private_data() {
    let (addr, h) = raw_server(Some(frame(b"MPA ID Rep Frame", 0x20, 1, b"go away")));
    let e = End::new(None, None);
    let r = e.qp.connect(addr, &quick(300));
    match r {
        Err(Error::Mpa(MpaError::Rejected { private_data })) => {
            assert_eq!(private_data, b"go away")
        }
        other => panic!("{other:?}"),
    }
    h.join().unwrap();
}

#[test]
fn connect_refuses_a_reply_that_requires_markers_or_has_a_bad_key() {
    let (addr, h) = raw_server(Some(frame(b"MPA ID Rep Frame", 0x80, 1, b"")));
    let e = End::new(None, None);
    let r = e.qp.connect(addr, &quick(300));
    assert!(
        matches!(r, Err(Error::Mpa(MpaError::MarkersRequired))),
        "{r:?}"
    );
    h.join().unwrap();

    let (addr, h) = raw_server(Some(frame(b"MPA ID Req Frame", 0x00, 1, b"")));
    let r = e.qp.connect(addr, &quick(300));
    assert!(
        matches!(r, Err(Error::Mpa(MpaError::WrongFrameKind { .. }))),
        "{r:?}"
    );
    h.join().unwrap();

    let (addr, h) = raw_server(Some(b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec()));
    let r = e.qp.connect(addr, &quick(300));
    assert!(matches!(r, Err(Error::Mpa(MpaError::BadFrame(_)))), "{r:?}");
    h.join().unwrap();
}

#[test]
fn accept_answers_a_markers_request_with_a_reject() {
    let e = End::new(None, None);
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.write_all(&frame(b"MPA ID Req Frame", 0x80, 1, b""))
            .unwrap();
        let mut rep = vec![0u8; 20];
        s.read_exact(&mut rep).unwrap();
        rep
    });
    let r = l.accept_timeout(&e.qp, &quick(300), WAIT);
    assert!(
        matches!(r, Err(Error::Mpa(MpaError::MarkersRequired))),
        "{r:?}"
    );
    let rep = t.join().unwrap();
    assert_eq!(&rep[..16], b"MPA ID Rep Frame");
    assert_eq!(rep[16] & 0x20, 0x20, "R (reject) is set");
}

#[test]
fn rev1_peer_is_answered_with_rev1_and_no_ird_ord() {
    let e = End::new(None, None);
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.write_all(&frame(b"MPA ID Req Frame", 0x00, 1, b"hi"))
            .unwrap();
        let mut rep = vec![0u8; 20];
        s.read_exact(&mut rep).unwrap();
        rep
    });
    let info = l.accept_timeout(&e.qp, &quick(300), WAIT).unwrap();
    assert_eq!(info.revision, 1);
    assert!(info.crc, "we asked for CRC, so it is used");
    assert_eq!(info.peer_private_data, b"hi");
    let rep = t.join().unwrap();
    assert_eq!(
        &rep[16..],
        &[0x40, 1, 0, 0],
        "rev 1 reply: C set, no private data"
    );
}
