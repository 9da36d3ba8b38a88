//! Peer faults with a real second process: the peer (this test binary re-run as a raw iWARP
//! peer, `raw_peer/peer.rs`) is killed with SIGKILL in the middle of an RDMA Write it
//! receives, of an RDMA Read Response it sends, and of a multi-segment Send it sends; or it
//! sends half an FPDU and closes. The surviving Softwarp QP goes to Error, reports why
//! (`QpFatal` with its cause), completes every work request (the interrupted one and
//! everything behind it flushed, none reported successful), and, once the application drops
//! its objects, the resource tracker holds nothing of the device but the device itself.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use peer::{ulpdu, Offer, RawPeer};
use softwarp::*;
use softwarp_testkit::{Reaped, SpawnReaped};

use softwarp_wire::rdmap::{Message, Placement, Segment};

use crate::raw_peer::peer;
use crate::util::*;

const ROLE_VAR: &str = "SOFTWARP_TEST_PEER_FAULT";
const PORT_VAR: &str = "SOFTWARP_TEST_PEER_PORT";
const LW: AccessFlags = AccessFlags::LOCAL_WRITE;
/// Bytes per segment the raw peer sends.
const SEG: usize = 16 * 1024;
/// Size of the interrupted Read and Send.
const HALVED: usize = 1 << 20;

// ---------------------------------------------------------------------------------------
// The peer's side (a child process)
// ---------------------------------------------------------------------------------------

#[test]
#[ignore = "run by the peer fault tests in a child process"]
fn child_peer_role() {
    let Ok(scenario) = std::env::var(ROLE_VAR) else {
        return;
    };
    let port: u16 = std::env::var(PORT_VAR).unwrap().parse().unwrap();
    let mut peer = RawPeer::initiate_to(([127, 0, 0, 1], port).into(), Offer::default());
    let payload = vec![0xc3u8; SEG];
    match scenario.as_str() {
        // Reads nothing: the stack's Write fills the socket buffers and stalls.
        "write" => {
            peer.speak_first();
            println!("READY")
        }
        // Answers the stack's Read Request with half of the Response.
        "read" => {
            peer.speak_first();
            let r = peer.next_fpdu().expect("a Read Request");
            let Message::RdmaReadRequest(req) = Segment::parse(&r.ulpdu).unwrap().message else {
                panic!("expected a Read Request");
            };
            for off in (0..req.read_size as usize / 2).step_by(SEG) {
                peer.send(&Segment {
                    last: false,
                    placement: Placement::Tagged {
                        stag: req.sink_stag,
                        tagged_offset: req.sink_tagged_offset + off as u64,
                    },
                    message: Message::RdmaReadResponse,
                    payload: &payload,
                });
            }
            println!("HALF");
        }
        // Sends the first half of a Send's segments.
        "send" => {
            for off in (0..HALVED / 2).step_by(SEG) {
                peer.send(&Segment {
                    last: false,
                    placement: Placement::Untagged {
                        msn: 1,
                        mo: off as u32,
                    },
                    message: Message::Send,
                    payload: &payload,
                });
            }
            println!("HALF");
        }
        // Half an FPDU, then an orderly close.
        "half-fpdu" => {
            let f = peer.frame(&ulpdu(&Segment {
                last: true,
                placement: Placement::Untagged { msn: 1, mo: 0 },
                message: Message::Send,
                payload: &payload[..1024],
            }));
            peer.send_bytes(&f[..f.len() / 2]);
            peer.shutdown();
            println!("HALF");
            return;
        }
        other => panic!("unknown scenario {other}"),
    }
    // Killed by the parent meanwhile.
    std::thread::sleep(WAIT);
}

// ---------------------------------------------------------------------------------------
// The survivor's side
// ---------------------------------------------------------------------------------------

/// The peer process; killed and reaped when dropped.
struct PeerProcess {
    child: Reaped,
    lines: mpsc::Receiver<String>,
}

impl PeerProcess {
    fn spawn(scenario: &str, port: u16) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "peer_faults::child_peer_role",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE_VAR, scenario)
            .env(PORT_VAR, port.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn_reaped();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self { child, lines }
    }

    fn wait_for(&self, want: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(want) => return,
                Ok(_) => {}
                Err(_) => panic!("the peer process did not print {want:?}"),
            }
        }
    }

    /// SIGKILL, and reap it.
    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

/// A Softwarp QP (Idle, `recvs` receives of `recv_len` bytes posted) accepts the raw peer
/// process running `scenario`.
fn survivor(scenario: &str, recvs: u64, recv_len: usize) -> (End, MemoryRegion, PeerProcess) {
    survivor_with(scenario, recvs, recv_len, &ConnectOptions::default())
}

fn survivor_with(
    scenario: &str,
    recvs: u64,
    recv_len: usize,
    opts: &ConnectOptions,
) -> (End, MemoryRegion, PeerProcess) {
    let e = End::new(None, None);
    let inbox = e.pd.reg_mr(recv_len.max(1), LW).unwrap();
    for id in 0..recvs {
        e.qp.post_recv(&RecvWr {
            wr_id: 100 + id,
            sgl: SgList::single(inbox.sge(0, recv_len as u32).unwrap()),
        })
        .unwrap();
    }
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let peer = PeerProcess::spawn(scenario, l.local_addr().unwrap().port());
    l.accept_timeout(&e.qp, opts, WAIT).unwrap();
    (e, inbox, peer)
}

/// The QP reports the lost connection, is in Error, and every posted WR completes: `sends`
/// in order, the first (the interrupted one) not successful and the others flushed or, when
/// they had left whole before the failure (a Send behind a Read), successful; each receive
/// flushed; and a WR posted afterwards is flushed too (verbs accept posts in Error).
fn assert_failed_and_flushed(e: &End, sends: &[u64], recvs: u64) -> Vec<WorkCompletion> {
    let qp_num = e.qp.qp_num();
    let (ev, _) = wait_event(&e.dev, |ev| {
        matches!(ev, AsyncEvent::QpFatal { qp_num: n, .. }
            | AsyncEvent::QpRequestError { qp_num: n, .. }
            | AsyncEvent::QpAccessError { qp_num: n, .. } if *n == qp_num)
    });
    wait_state(&e.qp, QpState::Error);
    let swc = wait_wcs(&e.scq, sends.len());
    let got: Vec<u64> = swc.iter().map(|w| w.wr_id).collect();
    assert_eq!(got, sends, "send completions in order");
    if let Some(first) = swc.first() {
        assert_ne!(
            first.status,
            WcStatus::Success,
            "the interrupted WR: {first:?}"
        );
    }
    for w in swc.iter().skip(1) {
        assert!(
            matches!(w.status, WcStatus::WrFlushErr | WcStatus::Success),
            "{w:?}"
        );
    }
    let rwc = wait_wcs(&e.rcq, recvs as usize);
    for w in &rwc {
        assert_eq!(w.status, WcStatus::WrFlushErr, "{w:?}");
    }
    assert_no_wc(&e.scq, Duration::from_millis(20));
    assert_no_wc(&e.rcq, Duration::from_millis(20));
    // Later work is not lost: it completes, flushed.
    e.qp.post_send(&send_wr(9, send_op(false, None), Payload::Inline(b"late")))
        .unwrap();
    let late = wait_wcs(&e.scq, 1);
    assert_eq!((late[0].wr_id, late[0].status), (9, WcStatus::WrFlushErr));
    eprintln!(
        "event {ev:?}; send completions {:?}; {} receives flushed",
        swc.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        rwc.len(),
    );
    swc
}

/// Drops the application's objects; then the device holds nothing but itself.
fn assert_no_leak(e: End, mrs: Vec<MemoryRegion>) {
    let End {
        qp,
        scq,
        rcq,
        pd,
        dev,
        ..
    } = e;
    drop(qp);
    drop(mrs);
    drop((scq, rcq, pd));
    let left: Vec<_> = softwarp_ras::tracker::all_resources()
        .into_iter()
        .filter(|r| r.tracker == dev.instance_name())
        .filter(|r| r.kind != softwarp_ras::tracker::ResourceKind::Device)
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    drop(dev);
}

/// Waits until the QP's transmitted byte count stops growing (the socket is full); returns
/// it.
fn stalled_tx(qp: &QueuePair) -> u64 {
    let deadline = Instant::now() + WAIT;
    let mut last = qp.stats().tx_stream_bytes;
    let mut still = 0;
    while still < 10 {
        assert!(Instant::now() < deadline, "the transfer never stalled");
        std::thread::sleep(Duration::from_millis(20));
        let now = qp.stats().tx_stream_bytes;
        if now == last && now > 0 {
            still += 1;
        } else {
            still = 0;
        }
        last = now;
    }
    last
}

#[test]
fn peer_killed_in_the_middle_of_an_rdma_write_flushes_it_and_leaks_nothing() {
    const LEN: usize = 64 << 20;
    let (e, inbox, peer) = survivor("write", 2, 64);
    peer.wait_for("READY");
    let src = e.pd.reg_mr(LEN, LW).unwrap();
    e.qp.post_send(&send_wr(
        1,
        SendOp::Write {
            remote_addr: 0x1000,
            rkey: Stag(0x4242_4200),
        },
        Payload::Sgl(sgl(&src, 0, LEN, 1)),
    ))
    .unwrap();
    e.qp.post_send(&send_wr(2, send_op(false, None), Payload::Inline(b"after")))
        .unwrap();
    let sent = stalled_tx(&e.qp);
    assert!(sent < LEN as u64, "the Write went out whole ({sent} bytes)");
    eprintln!("SIGKILL after {sent} of {LEN} bytes of the Write");
    peer.kill();
    assert_failed_and_flushed(&e, &[1, 2], 2);
    assert_no_leak(e, vec![inbox, src]);
}

/// A peer that stays connected but reads nothing (its receive window closes): with
/// `tcp_user_timeout` the kernel drops the connection once the Write's bytes have waited
/// that long behind the zero window, and the QP fails as if the peer had died.
#[test]
fn a_zero_window_peer_fails_the_qp_after_the_tcp_user_timeout() {
    const LEN: usize = 64 << 20;
    const USER_TIMEOUT: Duration = Duration::from_secs(1);
    let opts = ConnectOptions::default().tcp_user_timeout(Some(USER_TIMEOUT));
    let (e, inbox, peer) = survivor_with("write", 1, 64, &opts);
    peer.wait_for("READY");
    let src = e.pd.reg_mr(LEN, LW).unwrap();
    e.qp.post_send(&send_wr(
        1,
        SendOp::Write {
            remote_addr: 0x1000,
            rkey: Stag(0x4242_4200),
        },
        Payload::Sgl(sgl(&src, 0, LEN, 1)),
    ))
    .unwrap();
    let sent = stalled_tx(&e.qp);
    let stalled = Instant::now();
    assert!(sent < LEN as u64, "the Write went out whole ({sent} bytes)");
    assert_failed_and_flushed(&e, &[1], 1);
    // The kernel checks at its zero-window probes (backing off from 200 ms on loopback).
    let took = stalled.elapsed();
    eprintln!("zero window after {sent} bytes: connection dropped {took:?} after the stall");
    assert!(took < USER_TIMEOUT + Duration::from_secs(8), "{took:?}");
    assert_no_leak(e, vec![inbox, src]);
    drop(peer);
}

#[test]
fn peer_killed_in_the_middle_of_a_read_response_flushes_the_read_and_leaks_nothing() {
    let (e, inbox, peer) = survivor("read", 1, 64);
    let sink = e.pd.reg_mr(HALVED, LW).unwrap();
    sink.fill(0, HALVED, 0x11).unwrap();
    e.qp.post_send(&send_wr(
        1,
        SendOp::Read {
            remote_addr: 0x2000,
            rkey: Stag(0x4343_4300),
        },
        Payload::Sgl(sgl(&sink, 0, HALVED, 1)),
    ))
    .unwrap();
    e.qp.post_send(&send_wr(2, send_op(false, None), Payload::Inline(b"after")))
        .unwrap();
    peer.wait_for("HALF");
    let deadline = Instant::now() + WAIT;
    while e.qp.stats().rx.read_response.bytes < (HALVED / 2) as u64 {
        assert!(Instant::now() < deadline, "{:?}", e.qp.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    peer.kill();
    assert_failed_and_flushed(&e, &[1, 2], 1);
    assert_no_leak(e, vec![inbox, sink]);
}

#[test]
fn peer_killed_in_the_middle_of_a_send_flushes_the_receive_and_leaks_nothing() {
    let (e, inbox, peer) = survivor("send", 2, HALVED);
    peer.wait_for("HALF");
    let deadline = Instant::now() + WAIT;
    while e.qp.stats().rx_stream_bytes < (HALVED / 2) as u64 {
        assert!(Instant::now() < deadline, "{:?}", e.qp.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    peer.kill();
    assert_failed_and_flushed(&e, &[], 2);
    assert_eq!(e.qp.stats().rx.send.messages, 0, "half a Send is no Send");
    assert_no_leak(e, vec![inbox]);
}

#[test]
fn peer_that_sends_half_an_fpdu_and_closes_fails_the_qp_and_leaks_nothing() {
    let (e, inbox, peer) = survivor("half-fpdu", 2, 2048);
    peer.wait_for("HALF");
    assert_failed_and_flushed(&e, &[], 2);
    assert_eq!(e.qp.stats().rx.send.messages, 0);
    drop(peer);
    assert_no_leak(e, vec![inbox]);
}
