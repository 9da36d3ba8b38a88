//! Two processes over loopback TCP: this test binary re-runs itself as the server (the
//! ignored test `child_server_role`, selected by an environment variable), and the parent
//! is the client. Every operation crosses a real process boundary; every wait is bounded
//! and the child is killed if it overstays.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::util::*;
use softwarp::*;

const ROLE_VAR: &str = "SOFTWARP_TEST_ROLE";
const LEN: usize = 3 << 20;

#[test]
#[ignore = "run by two_processes_exchange_every_operation in a child process"]
fn child_server_role() {
    if std::env::var(ROLE_VAR).as_deref() != Ok("server") {
        return;
    }
    let e = End::new(None, None);
    let lw = AccessFlags::LOCAL_WRITE;
    let target =
        e.pd.reg_mr(
            LEN,
            lw | AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_INVALIDATE,
        )
        .unwrap();
    target.write_at(0, &pattern(LEN, 11)).unwrap();
    let inbox = e.pd.reg_mr(LEN, lw).unwrap();
    for id in 0..2 {
        e.qp.post_recv(&RecvWr {
            wr_id: id,
            sgl: sgl(&inbox, 0, LEN, 4),
        })
        .unwrap();
    }
    let l = Listener::bind("127.0.0.1:0").unwrap();
    println!("PORT={}", l.local_addr().unwrap().port());
    l.accept_timeout(&e.qp, &ConnectOptions::default(), WAIT)
        .unwrap();
    let mut advert = target.addr().to_be_bytes().to_vec();
    advert.extend_from_slice(&target.rkey().0.to_be_bytes());
    e.qp.post_send(&send_wr(1, send_op(false, None), Payload::Inline(&advert)))
        .unwrap();
    // 1: a Send with SE of LEN bytes; 2: a Send with Invalidate of the target.
    let wcs = wait_wcs(&e.rcq, 2);
    assert_eq!(wcs[0].byte_len as usize, LEN);
    assert!(wcs[0].solicited);
    assert_eq!(wcs[1].invalidated_stag, Some(target.rkey()));
    assert!(!target.is_valid());
    // The client wrote pattern 22 over the first half of the target before its Sends.
    let got = target.to_vec().unwrap();
    assert!(got[..LEN / 2] == pattern(LEN / 2, 22)[..]);
    assert!(got[LEN / 2..] == pattern(LEN, 11)[LEN / 2..]);
    let _ = inbox.to_vec().unwrap();
    e.qp.post_send(&send_wr(
        2,
        send_op(false, None),
        Payload::Inline(b"verified"),
    ))
    .unwrap();
    wait_wcs(&e.scq, 2);
    e.qp.disconnect().unwrap();
    e.qp.wait_closed(WAIT).unwrap();
    println!("SERVER-OK");
}

#[test]
fn two_processes_exchange_every_operation() {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args([
            "--exact",
            "two_process::child_server_role",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_VAR, "server")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + WAIT;
    let next_line = |want: &str| -> String {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(l) if l.contains(want) => return l,
                Ok(_) => {}
                Err(_) => panic!("the server process did not print {want:?}"),
            }
        }
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let port: u16 = next_line("PORT=")
            .trim_start_matches(|c: char| !c.is_ascii_digit())
            .parse()
            .unwrap();
        let e = End::new(None, None);
        let lw = AccessFlags::LOCAL_WRITE;
        let small = e.pd.reg_mr(64, lw).unwrap();
        for id in 0..2 {
            e.qp.post_recv(&RecvWr {
                wr_id: id,
                sgl: SgList::single(small.sge(0, 64).unwrap()),
            })
            .unwrap();
        }
        // The server (the MPA responder) speaks first: peer-to-peer mode's RTR is the
        // initiator's first FPDU that RFC 5044 has the responder wait for.
        e.qp.connect(
            ("127.0.0.1", port),
            &ConnectOptions::default().peer_to_peer(true),
        )
        .unwrap();
        let wc = wait_wcs(&e.rcq, 1);
        let mut a = [0u8; 12];
        small.read_at(0, &mut a).unwrap();
        assert_eq!(wc[0].byte_len, 12);
        let remote_addr = u64::from_be_bytes(a[..8].try_into().unwrap());
        let rkey = Stag(u32::from_be_bytes(a[8..].try_into().unwrap()));
        let (src, _) = e.mr(LEN, AccessFlags::NONE, 22);
        let sink = e.pd.reg_mr(LEN, lw).unwrap();
        // Read the server's pattern, Write over half of it, Send with SE, Send+Invalidate.
        e.qp.post_send(&send_wr(
            1,
            SendOp::Read { remote_addr, rkey },
            Payload::Sgl(SgList::single(sink.sge(0, LEN as u32).unwrap())),
        ))
        .unwrap();
        // The Write overwrites what the Read fetches: without the fence it could be placed
        // before the Read Response is generated (RFC 5040 orders only their starts).
        let mut write = send_wr(
            2,
            SendOp::Write { remote_addr, rkey },
            Payload::Sgl(sgl(&src, 0, LEN / 2, 5)),
        );
        write.fence = true;
        e.qp.post_send(&write).unwrap();
        e.qp.post_send(&send_wr(
            3,
            send_op(true, None),
            Payload::Sgl(sgl(&src, 0, LEN, 8)),
        ))
        .unwrap();
        e.qp.post_send(&send_wr(
            4,
            send_op(false, Some(rkey)),
            Payload::Sgl(SgList::new()),
        ))
        .unwrap();
        let wcs = wait_wcs(&e.scq, 4);
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
        assert_eq!(
            wcs.iter().map(|w| w.opcode).collect::<Vec<_>>(),
            vec![
                WcOpcode::RdmaRead,
                WcOpcode::RdmaWrite,
                WcOpcode::Send,
                WcOpcode::Send
            ]
        );
        assert!(sink.to_vec().unwrap() == pattern(LEN, 11));
        let reply = wait_wcs(&e.rcq, 1);
        assert_eq!(reply[0].byte_len, 8);
        let mut r = [0u8; 8];
        small.read_at(0, &mut r).unwrap();
        assert_eq!(&r, b"verified");
        next_line("SERVER-OK");
    }));
    // Reap the child within the deadline, or kill it.
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if Instant::now() > deadline + Duration::from_secs(5) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
    let status = status.expect("the server process did not exit in time");
    assert!(status.success(), "server process failed: {status}");
}
