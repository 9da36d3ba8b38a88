//! One connection API: the blocking helpers (`Listener::accept` with `QueuePair::connect`,
//! and the stream handover `accept_stream` / `connect_stream`) run the connection manager's
//! path on the calling thread. So a responder gates its first FPDU the same way on every
//! path (RFC 5044: nothing before the initiator's first FPDU; RFC 6581: the RTR opens the
//! gate), its posted work is held and never failed, and a bad peer gives the same error.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use softwarp::*;

use crate::cm_support::raw::*;
use crate::cm_support::*;
use crate::util::*;

const LW: AccessFlags = AccessFlags::LOCAL_WRITE;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// `Listener::accept` and `QueuePair::connect`.
    Blocking,
    /// `accept_stream` and `connect_stream` over TCP connections made by the test.
    Stream,
    /// `CmEventChannel::listen` / `ConnectRequest::accept` and `CmEventChannel::connect`.
    Cm,
}

const PATHS: [Path; 3] = [Path::Blocking, Path::Stream, Path::Cm];

/// What keeps a connection manager connection's handles alive.
type Keep = Option<(CmEventChannel, CmEventChannel, CmId, CmId, CmListener)>;

/// Connects `client` to `server` over `path` with `opts` on both ends.
fn connect_over(path: Path, client: &End, server: &End, opts: &ConnectOptions) -> Keep {
    match path {
        Path::Blocking => {
            let l = Listener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            std::thread::scope(|s| {
                let h = s.spawn(|| l.accept_timeout(&server.qp, opts, WAIT).unwrap());
                client.qp.connect(addr, opts).unwrap();
                h.join().unwrap();
            });
            None
        }
        Path::Stream => {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            std::thread::scope(|s| {
                let h = s.spawn(|| {
                    let (tcp, _) = l.accept().unwrap();
                    server.qp.accept_stream(tcp, opts).unwrap()
                });
                let tcp = TcpStream::connect(addr).unwrap();
                client.qp.connect_stream(tcp, opts).unwrap();
                h.join().unwrap();
            });
            None
        }
        Path::Cm => {
            let sch = CmEventChannel::new().unwrap();
            let cch = CmEventChannel::new().unwrap();
            let l = sch
                .listen(
                    "127.0.0.1:0",
                    &ListenOptions::default().options(opts.clone()),
                )
                .unwrap();
            let cid = cch.connect(&client.qp, l.local_addr(), opts).unwrap();
            let sid = request(&sch).accept(&server.qp, opts).unwrap();
            established(&cch, cid.conn_id());
            Some((sch, cch, cid, sid, l))
        }
    }
}

//= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
// (paraphrase) The responder must not send an FPDU before it received the initiator's
// first FPDU; RFC 6581 peer-to-peer mode has the initiator send an RTR so that either side
// may speak first.
#[test]
fn a_responder_that_posts_first_is_held_until_the_initiator_speaks_on_every_path() {
    for path in PATHS {
        for p2p in [false, true] {
            let what = format!("{path:?}, peer-to-peer {p2p}");
            let opts = ConnectOptions::default()
                .peer_to_peer(p2p)
                .first_fpdu_delay(Duration::ZERO);
            let client = End::new(None, None);
            let server = End::new(None, None);
            let (cbuf, _) = client.mr(4096, LW, 1);
            let (sbuf, sdata) = server.mr(4096, LW, 2);
            post_recv(&client.qp, &cbuf, 0, 4096, 10);
            post_recv(&server.qp, &sbuf, 1024, 1024, 20);
            let _keep = connect_over(path, &client, &server, &opts);
            // The responder speaks first.
            post_send(&server.qp, &sbuf, 0, 64, 1);
            if !p2p {
                // Held, not failed: nothing arrives and nothing completes.
                assert_no_wc(&client.rcq, Duration::from_millis(200));
                assert_eq!(server.scq.poll_one(), None, "{what}");
                assert_eq!(server.qp.state(), QpState::Rts, "{what}");
                // The initiator's first Send opens the gate.
                post_send(&client.qp, &cbuf, 2048, 8, 2);
                let wc = wait_wcs(&server.rcq, 1);
                assert_eq!((wc[0].status, wc[0].byte_len), (WcStatus::Success, 8));
            }
            let wc = wait_wcs(&client.rcq, 1);
            assert_eq!(
                (wc[0].status, wc[0].byte_len),
                (WcStatus::Success, 64),
                "{what}"
            );
            assert_eq!(cbuf.to_vec().unwrap()[..64], sdata[..64], "{what}");
            let wc = wait_wcs(&server.scq, 1);
            assert_eq!(wc[0].status, WcStatus::Success, "{what}");
        }
    }
}

/// The error an initiator gets from a peer at `addr` on `path` (never the CM's events).
fn initiator_error(path: Path, addr: SocketAddr, opts: &ConnectOptions) -> Error {
    let e = End::new(None, None);
    let err = match path {
        Path::Blocking => e.qp.connect(addr, opts).unwrap_err(),
        Path::Stream => {
            let tcp = TcpStream::connect(addr).unwrap();
            e.qp.connect_stream(tcp, opts).unwrap_err()
        }
        Path::Cm => {
            let ch = CmEventChannel::new().unwrap();
            ch.connect_blocking(&e.qp, addr, opts).unwrap_err()
        }
    };
    assert_eq!(
        e.qp.state(),
        QpState::Idle,
        "a failed attempt leaves the QP Idle"
    );
    err
}

#[test]
fn a_bad_or_rejecting_responder_gives_the_same_error_on_every_path() {
    let opts = ConnectOptions::default()
        .timeout(Duration::from_millis(400))
        .crc(false);
    let replies: [Option<Vec<u8>>; 5] = [
        // Not MPA.
        Some(b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec()),
        // A reject with the responder's reason.
        Some(frame(REP, 0x30, 2, &[0, 0, 0, 0, b'n', b'o'])),
        // A Request where the Reply belongs.
        Some(frame(REQ, 0x10, 2, &[0, 1, 0, 1])),
        // Markers demanded, which the default options refuse.
        Some(frame(REP, 0x90, 2, &[0, 1, 0, 1])),
        // Nothing at all: the attempt times out.
        None,
    ];
    for reply in replies {
        let errors: Vec<String> = PATHS
            .iter()
            .map(|&path| {
                let (addr, peer) = raw_responder(reply.clone());
                let e = initiator_error(path, addr, &opts);
                let _ = peer.join();
                assert!(matches!(e, Error::Mpa(_)), "{path:?}: {e}");
                format!("{e:?}")
            })
            .collect();
        assert!(
            errors.iter().all(|e| *e == errors[0]),
            "different errors for the same peer ({reply:02x?}): {errors:#?}"
        );
    }
    // Nobody listening: the same error too.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let a = format!("{:?}", initiator_error(Path::Blocking, addr, &opts));
    let b = format!("{:?}", initiator_error(Path::Cm, addr, &opts));
    assert_eq!(a, b);
}

/// A listener whose accept queue is full: the kernel drops further SYNs, so a connect to it
/// never completes. Returns the listener and the connections that fill its queue.
fn syn_black_hole() -> (TcpListener, Vec<TcpStream>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    rustix::net::listen(&l, 0).unwrap();
    let addr = l.local_addr().unwrap();
    let fill = (0..4)
        .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok())
        .collect();
    (l, fill)
}

#[test]
fn a_tcp_connect_that_never_completes_times_out_the_same_way_on_both_initiator_paths() {
    let (l, _fill) = syn_black_hole();
    let addr = l.local_addr().unwrap();
    let opts = ConnectOptions::default().timeout(Duration::from_millis(300));
    let blocking = initiator_error(Path::Blocking, addr, &opts);
    let cm = initiator_error(Path::Cm, addr, &opts);
    assert!(matches!(blocking, Error::Timeout(_)), "{blocking:?}");
    assert_eq!(format!("{blocking:?}"), format!("{cm:?}"));
}

/// The error a responder reports for a peer that sends `bytes` on `path` (the CM reports
/// it as a `RequestError` event), and what the peer got back.
fn responder_error(path: Path, bytes: &[u8], opts: &ConnectOptions) -> (Error, Vec<u8>) {
    let server = End::new(None, None);
    let out = match path {
        Path::Blocking => {
            let l = Listener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            std::thread::scope(|s| {
                let h = s.spawn(|| l.accept_timeout(&server.qp, opts, WAIT).unwrap_err());
                let got = raw_initiator(addr, bytes);
                (h.join().unwrap(), got)
            })
        }
        Path::Stream => {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            std::thread::scope(|s| {
                let h = s.spawn(|| {
                    let (tcp, _) = l.accept().unwrap();
                    server.qp.accept_stream(tcp, opts).unwrap_err()
                });
                let got = raw_initiator(addr, bytes);
                (h.join().unwrap(), got)
            })
        }
        Path::Cm => {
            let ch = CmEventChannel::new().unwrap();
            let l = ch
                .listen(
                    "127.0.0.1:0",
                    &ListenOptions::default().options(opts.clone()),
                )
                .unwrap();
            let got = raw_initiator(l.local_addr(), bytes);
            (request_error(&ch), got)
        }
    };
    assert_eq!(server.qp.state(), QpState::Idle);
    out
}

#[test]
fn a_bad_initiator_gets_the_same_answer_and_error_on_every_path() {
    let opts = ConnectOptions::default().timeout(Duration::from_millis(400));
    let requests: [Vec<u8>; 4] = [
        // Not MPA: closed without an answer.
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        // Revision 3: a reject Reply with our revision.
        frame(REQ, 0, 3, b""),
        // Markers asked for: a reject Reply.
        frame(REQ, 0x90, 2, &[0, 1, 0, 1]),
        // Half a header, then silence: closed after the timeout.
        b"MPA ID R".to_vec(),
    ];
    for req in requests {
        let seen: Vec<(String, Vec<u8>)> = PATHS
            .iter()
            .map(|&path| {
                let (e, got) = responder_error(path, &req, &opts);
                assert!(matches!(e, Error::Mpa(_)), "{path:?}: {e}");
                (format!("{e:?}"), got)
            })
            .collect();
        assert!(
            seen.iter().all(|s| *s == seen[0]),
            "different outcomes for the same peer ({req:02x?}): {seen:#?}"
        );
    }
}

/// A graceful close ends the same way on every path, as `rdma_disconnect` promises: the side
/// that disconnects gets its posted receive back with a flush status and its QP ends in
/// Error (so does the peer's, which saw the stream end), and `reset` makes both Idle to
/// connect again. The blocking paths used to leave the closing side's receives posted in
/// an Idle QP, never completed.
#[test]
fn a_graceful_close_flushes_the_closing_sides_receives_on_every_path() {
    for path in PATHS {
        let opts = ConnectOptions::default();
        let client = End::new(None, None);
        let server = End::new(None, None);
        let (cbuf, _) = client.mr(4096, LW, 1);
        let (sbuf, _) = server.mr(4096, LW, 2);
        post_recv(&client.qp, &cbuf, 0, 4096, 10);
        post_recv(&server.qp, &sbuf, 0, 4096, 20);
        let keep = connect_over(path, &client, &server, &opts);
        client.qp.disconnect().unwrap();
        assert_eq!(
            client.qp.wait_closed(WAIT).unwrap(),
            QpState::Error,
            "{path:?}"
        );
        let wc = wait_wcs(&client.rcq, 1);
        assert_eq!(
            (wc[0].wr_id, wc[0].status),
            (10, WcStatus::WrFlushErr),
            "{path:?}"
        );
        let wc = wait_wcs(&server.rcq, 1);
        assert_eq!(
            (wc[0].wr_id, wc[0].status),
            (20, WcStatus::WrFlushErr),
            "{path:?}"
        );
        assert_eq!(
            server.qp.wait_closed(WAIT).unwrap(),
            QpState::Error,
            "{path:?}"
        );
        drop(keep);
        client.qp.reset().unwrap();
        server.qp.reset().unwrap();
        assert_eq!(client.qp.state(), QpState::Idle, "{path:?}");
        // The same QPs connect again and carry a Send.
        post_recv(&server.qp, &sbuf, 0, 4096, 21);
        let _keep = connect_over(path, &client, &server, &opts);
        post_send(&client.qp, &cbuf, 0, 64, 3);
        let wc = wait_wcs(&server.rcq, 1);
        assert_eq!(
            (wc[0].wr_id, wc[0].status, wc[0].byte_len),
            (21, WcStatus::Success, 64),
            "{path:?}"
        );
    }
}
