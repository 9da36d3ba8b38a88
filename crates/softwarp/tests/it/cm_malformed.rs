//! Malformed and unexpected MPA frames against the connection manager, from raw TCP peers
//! on both sides: every case ends the connection with the right reject Reply or Terminate
//! (checked byte by byte) or a plain close, reports a typed error, and never hangs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use softwarp::*;
use softwarp_testkit::quick;
use softwarp_wire::mpa::fpdu::Fpdu;
use softwarp_wire::mpa::frame::MpaFrame;
use softwarp_wire::rdmap::{Message, Segment};

use crate::cm_support::raw::*;
use crate::cm_support::*;
use crate::util::*;

// ---------------------------------------------------------------------------------------
// A raw initiator against the CM's listener
// ---------------------------------------------------------------------------------------

/// A listener with a short request timeout.
fn cm_listener(ch: &CmEventChannel, opts: ConnectOptions) -> CmListener {
    ch.listen(
        "127.0.0.1:0",
        &ListenOptions::default().options(opts.timeout(Duration::from_millis(400))),
    )
    .unwrap()
}

#[test]
fn garbage_instead_of_a_request_is_closed_without_an_answer() {
    let ch = CmEventChannel::new().unwrap();
    let l = cm_listener(&ch, ConnectOptions::default());
    for garbage in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        b"MPA ID Req FrXme and more",
        b"\x00\x00\x00\x00MPA ID Req Frame", // garbage before the frame
    ] {
        let got = raw_initiator(l.local_addr(), garbage);
        assert!(got.is_empty(), "no Reply to a non-MPA peer: {got:?}");
        let e = request_error(&ch);
        assert!(
            matches!(
                e,
                Error::Mpa(MpaError::BadFrame(softwarp_wire::WireError::MpaBadKey))
            ),
            "{e}"
        );
    }
    // A Reply where a Request belongs: also closed without an answer.
    let got = raw_initiator(l.local_addr(), &frame(REP, 0, 1, b""));
    assert!(got.is_empty());
    assert!(matches!(
        request_error(&ch),
        Error::Mpa(MpaError::WrongFrameKind { .. })
    ));
}

#[test]
fn unsupported_revision_short_prefix_and_markers_get_a_reject_reply() {
    let ch = CmEventChannel::new().unwrap();
    let l = cm_listener(&ch, ConnectOptions::default());
    let cases: [(Vec<u8>, &[u8]); 4] = [
        // Revision 3: reject with our revision 2 (no enhanced prefix: the Request is
        // unreadable).
        (frame(REQ, 0, 3, b""), &[0x20, 2, 0, 0]),
        // Revision 0 (pre-RFC drafts).
        (frame(REQ, 0, 0, b""), &[0x20, 2, 0, 0]),
        // Revision 2 with the enhanced flag and only 2 octets of private data.
        (frame(REQ, 0x10, 2, b"ab"), &[0x20, 2, 0, 0]),
        // Markers asked for, refused like siw does: R, and the RFC 6581 prefix kept.
        (
            frame(REQ, 0x90, 2, &[0, 1, 0, 1]),
            &[0x30, 2, 0, 4, 0, 0, 0, 0],
        ),
    ];
    for (req, expect) in cases {
        let got = raw_initiator(l.local_addr(), &req);
        assert_eq!(&got[..16], REP, "{req:?}");
        assert_eq!(&got[16..], expect, "{req:?}");
        let (reply, _) = MpaFrame::parse(&got).unwrap();
        assert!(reply.reject);
        let e = request_error(&ch);
        assert!(
            matches!(
                e,
                Error::Mpa(MpaError::BadFrame(_)) | Error::Mpa(MpaError::MarkersRequired)
            ),
            "{e}"
        );
    }
}

/// Requests whose PD_Length is above 512: 513 and 600 with no private data, and 513 and
/// 65535 followed by that many (or 600) octets.
fn oversized_requests() -> Vec<Vec<u8>> {
    let with_len = |len: u16, data: usize| {
        let mut v = frame(REQ, 0, 1, &vec![0x5a; data]);
        v[18..20].copy_from_slice(&len.to_be_bytes());
        v
    };
    vec![
        with_len(513, 0),
        with_len(600, 0),
        with_len(513, 513),
        with_len(65535, 600),
    ]
}

//= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
// (paraphrase) PD_Length: the length of the private data, at most 512 octets; if it is
// larger than 512, the receiver closes the connection (it sends no Reply, and so no reject
// Reply either).
#[test]
fn a_request_with_pd_length_over_512_is_closed_without_a_reply_on_the_cm_path() {
    let ch = CmEventChannel::new().unwrap();
    let l = cm_listener(&ch, ConnectOptions::default());
    for req in oversized_requests() {
        let got = raw_initiator(l.local_addr(), &req);
        assert!(got.is_empty(), "nothing is sent back: {got:02x?}");
        let e = request_error(&ch);
        assert!(
            matches!(
                e,
                Error::Mpa(MpaError::BadFrame(
                    softwarp_wire::WireError::MpaPrivateDataTooLong(_)
                ))
            ),
            "{e}"
        );
    }
}

#[test]
fn a_request_with_pd_length_over_512_is_closed_without_a_reply_by_the_blocking_listener() {
    let server = End::new(None, None);
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    for req in oversized_requests() {
        std::thread::scope(|s| {
            let stack = s.spawn(|| listener.accept_timeout(&server.qp, &quick(500), WAIT));
            let got = raw_initiator(addr, &req);
            assert!(got.is_empty(), "nothing is sent back: {got:02x?}");
            let e = stack.join().unwrap().unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Mpa(MpaError::BadFrame(
                        softwarp_wire::WireError::MpaPrivateDataTooLong(_)
                    ))
                ),
                "{e}"
            );
        });
        assert_eq!(server.qp.state(), QpState::Idle);
    }
}

/// Connects, sends `bytes` (nothing, or part of a Request), and returns what the stack sent
/// and how long it took the stack to close the connection.
fn stalled_initiator(addr: SocketAddr, bytes: &[u8]) -> (Vec<u8>, Duration) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let t0 = Instant::now();
    s.write_all(bytes).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    (got, t0.elapsed())
}

/// The bound on the wait for the Request in the tests below, and the slack allowed.
const REQUEST_WAIT: Duration = Duration::from_millis(400);
const SLACK: Duration = Duration::from_millis(1500);

/// Nothing, a few octets of the key, and a whole header announcing private data that never
/// comes.
fn stalled_requests() -> Vec<Vec<u8>> {
    let mut header_only = frame(REQ, 0x10, 2, b"");
    header_only[18..20].copy_from_slice(&4u16.to_be_bytes());
    vec![Vec::new(), b"MPA ID R".to_vec(), header_only]
}

//= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
// (paraphrase) The responder bounds its wait for the MPA Request with a timer; when it
// expires the responder closes the connection (without a Reply).
#[test]
fn silent_and_partial_requests_are_closed_after_the_request_timeout_on_the_cm_path() {
    let ch = CmEventChannel::new().unwrap();
    let l = cm_listener(&ch, ConnectOptions::default());
    for req in stalled_requests() {
        let (got, took) = stalled_initiator(l.local_addr(), &req);
        assert!(got.is_empty(), "nothing is sent back: {got:02x?}");
        assert!(
            took >= REQUEST_WAIT - Duration::from_millis(50) && took < REQUEST_WAIT + SLACK,
            "closed after {took:?} ({} octets sent)",
            req.len()
        );
        let e = request_error(&ch);
        assert!(matches!(e, Error::Mpa(MpaError::Timeout(_))), "{e}");
    }
}

#[test]
fn silent_and_partial_requests_are_closed_after_the_request_timeout_by_the_blocking_listener() {
    let server = End::new(None, None);
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let opts = ConnectOptions::default().timeout(REQUEST_WAIT);
    for req in stalled_requests() {
        std::thread::scope(|s| {
            let stack = s.spawn(|| listener.accept_timeout(&server.qp, &opts, WAIT));
            let (got, took) = stalled_initiator(addr, &req);
            assert!(got.is_empty(), "nothing is sent back: {got:02x?}");
            assert!(
                took >= REQUEST_WAIT - Duration::from_millis(50) && took < REQUEST_WAIT + SLACK,
                "closed after {took:?} ({} octets sent)",
                req.len()
            );
            let e = stack.join().unwrap().unwrap_err();
            assert!(matches!(e, Error::Mpa(MpaError::Timeout(_))), "{e}");
        });
        assert_eq!(server.qp.state(), QpState::Idle);
    }
}

#[test]
fn silent_and_vanishing_initiators_are_dropped_without_delaying_others() {
    let server = End::new(None, None);
    let client = End::new(None, None);
    let sch = CmEventChannel::new().unwrap();
    let cch = CmEventChannel::new().unwrap();
    // The silent peer has 2 s; the good one must not wait for that.
    let l = sch
        .listen(
            "127.0.0.1:0",
            &ListenOptions::default()
                .options(ConnectOptions::default().timeout(Duration::from_secs(2))),
        )
        .unwrap();
    // One peer sends half a header and goes silent, another closes mid-frame.
    let mut silent = TcpStream::connect(l.local_addr()).unwrap();
    silent.write_all(b"MPA ID Req").unwrap();
    {
        let mut gone = TcpStream::connect(l.local_addr()).unwrap();
        gone.write_all(&frame(REQ, 0, 1, b"abc")[..22]).unwrap();
    }
    // A well-behaved peer meanwhile is served at once.
    let t0 = Instant::now();
    let id = cch
        .connect(&client.qp, l.local_addr(), &ConnectOptions::default())
        .unwrap();
    request(&sch)
        .accept(&server.qp, &ConnectOptions::default())
        .unwrap();
    established(&cch, id.conn_id());
    assert!(
        t0.elapsed() < Duration::from_millis(300),
        "{:?}",
        t0.elapsed()
    );
    let mut errors = [request_error(&sch), request_error(&sch)];
    errors.sort_by_key(|e| matches!(e, Error::Mpa(MpaError::Timeout(_))));
    assert!(
        matches!(errors[0], Error::Mpa(MpaError::Closed)),
        "{}",
        errors[0]
    );
    assert!(
        matches!(errors[1], Error::Mpa(MpaError::Timeout(_))),
        "{}",
        errors[1]
    );
    // The silent peer's connection was closed by the listener.
    silent.set_read_timeout(Some(WAIT)).unwrap();
    let mut rest = Vec::new();
    assert_eq!(silent.read_to_end(&mut rest).unwrap_or(0), 0);
}

// ---------------------------------------------------------------------------------------
// The CM's initiator against a raw responder
// ---------------------------------------------------------------------------------------

/// Connects through the CM to `addr` and returns the event that ended the attempt.
fn attempt(addr: SocketAddr, opts: &ConnectOptions) -> (End, CmEvent) {
    let e = End::new(None, None);
    let ch = CmEventChannel::new().unwrap();
    let id = ch.connect(&e.qp, addr, opts).unwrap();
    let ev = wait_ev(&ch, "attempt outcome", |ev| {
        ev.conn_id() == Some(id.conn_id()) && ev.ends_attempt()
    });
    if !matches!(ev, CmEvent::Established { .. }) {
        assert_eq!(
            e.qp.state(),
            QpState::Idle,
            "a failed attempt leaves the QP Idle"
        );
    }
    (e, ev)
}

fn connect_error(ev: CmEvent) -> Error {
    match ev {
        CmEvent::ConnectError { error, .. } => error,
        other => panic!("expected CONNECT_ERROR, got {other:?}"),
    }
}

/// The MPA error code of the Terminate in `bytes` (one FPDU, CRC checked when `crc`).
fn terminate_code(bytes: &[u8], crc: bool) -> (u8, u8, u8) {
    let (fpdu, len) = Fpdu::parse(bytes, crc).unwrap();
    assert_eq!(len, bytes.len(), "exactly one FPDU, then the close");
    let seg = Segment::parse(fpdu.ulpdu).unwrap();
    assert_eq!(seg.queue_number(), Some(2), "Terminates go on queue 2");
    match seg.message {
        Message::Terminate(t) => t.error.fields(),
        other => panic!("not a Terminate: {other:?}"),
    }
}

#[test]
fn a_bad_reply_is_answered_with_an_invalid_reply_terminate() {
    type Check = fn(&Error) -> bool;
    let cases: [(Vec<u8>, Check); 4] = [
        (b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec(), |e| {
            matches!(e, Error::Mpa(MpaError::BadFrame(_)))
        }),
        (frame(REP, 0x40, 3, b""), |e| {
            matches!(e, Error::Mpa(MpaError::BadFrame(_)))
        }),
        (frame(REQ, 0x40, 2, &[0, 1, 0, 1]), |e| {
            matches!(e, Error::Mpa(MpaError::WrongFrameKind { .. }))
        }),
        (frame(REP, 0x50, 2, &[0, 1]), |e| {
            matches!(e, Error::Mpa(MpaError::BadFrame(_)))
        }),
    ];
    for (reply, check) in cases {
        let (addr, h) = raw_responder(Some(reply.clone()));
        let (_e, ev) = attempt(addr, &quick(500));
        let err = connect_error(ev);
        assert!(check(&err), "{reply:?}: {err}");
        let (_, after) = h.join().unwrap();
        // Our Request asked for CRC, so the Terminate carries a good one.
        assert_eq!(terminate_code(&after, true), (2, 0, 0x04), "{reply:?}");
    }
}

#[test]
fn a_reply_with_a_higher_revision_is_refused() {
    let (addr, h) = raw_responder(Some(frame(REP, 0, 2, b"")));
    let (_e, ev) = attempt(addr, &quick(500).revision(MpaRevision::Rev1).crc(false));
    assert!(matches!(
        connect_error(ev),
        Error::Mpa(MpaError::RevisionMismatch { peer: 2, local: 1 })
    ));
    let (req, after) = h.join().unwrap();
    assert_eq!(
        &req[16..],
        &[0, 1, 0, 0],
        "rev 1 Request, no CRC, no private data"
    );
    assert_eq!(terminate_code(&after, false), (2, 0, 0x04));
    assert_eq!(&after[after.len() - 4..], &[0; 4], "CRC off: zeros");
}

#[test]
fn insufficient_ird_and_no_matching_rtr_terminate_the_connection() {
    // Responder ORD 20 exceeds the QP's IRD capacity of 16.
    let (addr, h) = raw_responder(Some(frame(REP, 0x50, 2, &[0, 1, 0, 20])));
    let (_e, ev) = attempt(addr, &quick(500));
    assert!(matches!(
        connect_error(ev),
        Error::Mpa(MpaError::InsufficientIrd {
            peer_ord: 20,
            max_ird: 16
        })
    ));
    assert_eq!(terminate_code(&h.join().unwrap().1, true), (2, 0, 0x06));

    // Peer-to-peer with Write offered only; the responder picks the zero-length Send.
    let opts = quick(500)
        .peer_to_peer(true)
        .rtr_types(RtrTypes::only(RtrKind::Write))
        .crc(false);
    let (addr, h) = raw_responder(Some(frame(REP, 0x10, 2, &[0xc0, 1, 0, 1])));
    let (_e, ev) = attempt(addr, &opts);
    assert!(matches!(
        connect_error(ev),
        Error::Mpa(MpaError::NoMatchingRtr)
    ));
    let (req, after) = h.join().unwrap();
    assert_eq!(&req[20..], &[0x80, 16, 0x80, 16], "P2P, Write offered");
    assert_eq!(terminate_code(&after, false), (2, 0, 0x07));

    // Peer-to-peer answered by a revision 1 responder: no RTR possible.
    let (addr, h) = raw_responder(Some(frame(REP, 0, 1, b"")));
    let (_e, ev) = attempt(addr, &opts);
    assert!(matches!(
        connect_error(ev),
        Error::Mpa(MpaError::NoMatchingRtr)
    ));
    assert_eq!(terminate_code(&h.join().unwrap().1, false), (2, 0, 0x07));
}

#[test]
fn markers_demanded_or_crc_not_confirmed_close_without_a_terminate() {
    let (addr, h) = raw_responder(Some(frame(REP, 0xd0, 2, &[0, 1, 0, 1])));
    let (_e, ev) = attempt(addr, &quick(500));
    assert!(matches!(
        connect_error(ev),
        Error::Mpa(MpaError::MarkersRequired)
    ));
    assert!(h.join().unwrap().1.is_empty());

    let (addr, h) = raw_responder(Some(frame(REP, 0x10, 2, &[0, 1, 0, 1])));
    let (_e, ev) = attempt(addr, &quick(500).crc_mode(CrcMode::Required));
    assert!(matches!(
        connect_error(ev),
        Error::Mpa(MpaError::CrcNotConfirmed)
    ));
    assert!(h.join().unwrap().1.is_empty());

    // Preferred: the same Reply is fine, and CRC is used (we asked).
    let (addr, _h) = raw_responder(Some(frame(REP, 0x10, 2, &[0, 1, 0, 1])));
    let (_e, ev) = attempt(addr, &quick(500));
    match ev {
        CmEvent::Established { info, .. } => assert!(info.crc),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_silent_or_closing_responder_ends_the_attempt_in_time() {
    let (addr, h) = raw_responder(None);
    let t0 = Instant::now();
    let (_e, ev) = attempt(addr, &quick(500));
    assert!(matches!(
        connect_error(ev),
        Error::Mpa(MpaError::Timeout(_))
    ));
    assert!(t0.elapsed() < Duration::from_secs(3));
    let (req, after) = h.join().unwrap();
    assert_eq!(&req[..16], REQ);
    assert!(after.is_empty(), "a timeout sends no Terminate");

    // Half a Reply, then the close.
    let (addr, h) = raw_responder(Some(REP[..10].to_vec()));
    let (_e, ev) = attempt(addr, &quick(500));
    // The responder thread keeps the socket until the initiator closes it.
    assert!(matches!(
        connect_error(ev),
        Error::Mpa(MpaError::Timeout(_)) | Error::Mpa(MpaError::Closed)
    ));
    h.join().unwrap();
}

#[test]
fn fpdus_right_behind_the_reply_stay_for_the_qp() {
    // A siw-style responder: Reply (rev 1, no CRC) and, in the same write, a Send FPDU
    // (DDP untagged, QN 0, MSN 1, MO 0, L) carrying "hi!!".
    let mut bytes = frame(REP, 0, 1, b"x");
    // DDP control (L, DV 1), RDMAP control (RV 1, Send), reserved, QN, MSN, MO.
    let mut ulpdu = vec![0x41, 0x43, 0, 0, 0, 0];
    for field in [0u32, 1, 0] {
        ulpdu.extend_from_slice(&field.to_be_bytes());
    }
    ulpdu.extend_from_slice(b"hi!!");
    let mut fpdu = vec![0u8; Fpdu { ulpdu: &ulpdu }.buffer_len()];
    Fpdu { ulpdu: &ulpdu }.emit(&mut fpdu, false).unwrap();
    bytes.extend_from_slice(&fpdu);
    let (addr, _h) = raw_responder(Some(bytes));
    let e = End::new(None, None);
    let (buf, _) = e.mr(64, AccessFlags::LOCAL_WRITE, 0);
    post_recv(&e.qp, &buf, 0, 64, 5);
    let ch = CmEventChannel::new().unwrap();
    let opts = quick(500).revision(MpaRevision::Rev1).crc(false);
    let id = ch.connect(&e.qp, addr, &opts).unwrap();
    let info = established(&ch, id.conn_id());
    assert_eq!((info.revision, info.crc), (1, false));
    assert_eq!(info.peer_private_data, b"x");
    let wc = wait_wcs(&e.rcq, 1);
    assert_eq!((wc[0].status, wc[0].byte_len), (WcStatus::Success, 4));
    assert_eq!(&buf.to_vec().unwrap()[..4], b"hi!!");
}

#[test]
fn a_rev1_reply_to_a_rev2_request_keeps_the_configured_ird_ord() {
    let (addr, _h) = raw_responder(Some(frame(REP, 0x40, 1, b"")));
    let (_e, ev) = attempt(addr, &quick(500).ird(3).ord(5));
    match ev {
        CmEvent::Established { info, .. } => {
            assert_eq!(
                (info.revision, info.ird, info.ord, info.peer_ird_ord),
                (1, 3, 5, None)
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_peer_that_never_closes_its_side_does_not_hold_the_qp() {
    let server = End::new(None, None);
    let (buf, _) = server.mr(64, AccessFlags::LOCAL_WRITE, 0);
    post_recv(&server.qp, &buf, 0, 64, 1);
    let ch = CmEventChannel::new().unwrap();
    let l = cm_listener(&ch, ConnectOptions::default());
    let mut raw = TcpStream::connect(l.local_addr()).unwrap();
    raw.write_all(&frame(REQ, 0, 1, b"")).unwrap();
    let sid = request(&ch)
        .accept(&server.qp, &ConnectOptions::default())
        .unwrap();
    established(&ch, sid.conn_id());
    let mut rep = [0u8; 20];
    raw.read_exact(&mut rep).unwrap();
    // Graceful close; the raw peer keeps its side open and never answers the FIN.
    sid.disconnect().unwrap();
    let t0 = Instant::now();
    assert_eq!(disconnected(&ch, sid.conn_id()), DisconnectReason::Local);
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert_eq!(server.qp.state(), QpState::Error);
    let wc = wait_wcs(&server.rcq, 1);
    assert_eq!(wc[0].status, WcStatus::WrFlushErr);
    drop(raw);
}

// ---------------------------------------------------------------------------------------
// The initiator's first-FPDU hold-off on the connection manager's path
// ---------------------------------------------------------------------------------------

/// A raw responder that answers the Request with a revision 2 Reply (C = 0, IRD = ORD = 1)
/// and returns how long after writing the Reply the first byte of an FPDU arrived.
fn timing_responder() -> (SocketAddr, JoinHandle<Duration>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        read_request(&mut s);
        s.write_all(&frame(REP, 0x10, 2, &[0, 1, 0, 1])).unwrap();
        let replied = Instant::now();
        let mut first = [0u8; 1];
        s.read_exact(&mut first).unwrap();
        replied.elapsed()
    });
    (addr, h)
}

/// The hold-off of the first-FPDU tests, and their options.
const DELAY: Duration = Duration::from_millis(400);

fn delayed() -> ConnectOptions {
    ConnectOptions::default()
        .crc(false)
        .timeout(WAIT)
        .first_fpdu_delay(DELAY)
}

/// Posts a Send on `e`, just established: without the hold-off it would leave at once.
/// Checks that `peer` (a [`timing_responder`]) saw it only `DELAY` after its Reply, and that
/// the held Send still completes.
fn first_send_is_held(e: &End, peer: JoinHandle<Duration>) {
    let (buf, _) = e.mr(64, AccessFlags::LOCAL_WRITE, 1);
    post_send(&e.qp, &buf, 0, 8, 1);
    let after_reply = peer.join().unwrap();
    assert!(
        after_reply >= DELAY,
        "the first FPDU left {after_reply:?} after the Reply, before the {DELAY:?} hold-off"
    );
    let wc = wait_wcs(&e.scq, 1);
    assert_eq!(wc[0].status, WcStatus::Success);
}

#[test]
fn the_first_fpdu_delay_holds_a_send_posted_at_establishment_on_the_cm_path() {
    let (addr, peer) = timing_responder();
    let (e, ev) = attempt(addr, &delayed());
    assert!(matches!(ev, CmEvent::Established { .. }), "{ev:?}");
    first_send_is_held(&e, peer);
}

/// The blocking connect holds the first FPDU the same way and returns at once: it used to
/// sleep out the hold-off before returning (400 ms here).
#[test]
fn the_blocking_connect_returns_at_once_and_holds_its_first_fpdu() {
    let (addr, peer) = timing_responder();
    let e = End::new(None, None);
    let started = Instant::now();
    e.qp.connect(addr, &delayed()).unwrap();
    let took = started.elapsed();
    assert!(took < DELAY / 2, "connect took {took:?}");
    first_send_is_held(&e, peer);
}

#[test]
fn without_a_first_fpdu_delay_the_send_leaves_and_completes() {
    let (addr, peer) = timing_responder();
    let opts = ConnectOptions::default()
        .crc(false)
        .timeout(WAIT)
        .first_fpdu_delay(Duration::ZERO);
    let (e, ev) = attempt(addr, &opts);
    assert!(matches!(ev, CmEvent::Established { .. }), "{ev:?}");
    let (buf, _) = e.mr(64, AccessFlags::LOCAL_WRITE, 1);
    post_send(&e.qp, &buf, 0, 8, 1);
    let _ = peer.join().unwrap();
    let wc = wait_wcs(&e.scq, 1);
    assert_eq!(wc[0].status, WcStatus::Success);
}
