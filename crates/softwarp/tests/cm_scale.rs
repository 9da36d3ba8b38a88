//! One listener accepts 200 connections from another process (this test binary re-run as
//! the client), each connection carries a message, and the server's disconnects reach the
//! client. The functional version of `examples/cm_scale.rs` (2,000 connections, with the
//! setup rate and memory per QP printed); nothing here is timed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod cm_support;
mod util;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use softwarp::*;
use util::WAIT;

const ROLE_VAR: &str = "SOFTWARP_CM_SCALE_CLIENT";
const COUNT: usize = 200;
const WINDOW: usize = 32;

fn attr(cq: &CompletionQueue) -> QpInitAttr<'_> {
    let mut a = QpInitAttr::new(cq, cq);
    a.cap.max_send_wr = 4;
    a.cap.max_recv_wr = 4;
    a
}

#[test]
#[ignore = "run by one_listener_accepts_many_connections_from_another_process"]
fn child_client_role() {
    let Ok(addr) = std::env::var(ROLE_VAR) else {
        return;
    };
    let dev = Device::open_default().unwrap();
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(4 * COUNT, None).unwrap();
    let ch = CmEventChannel::new().unwrap();
    let mut qps = Vec::new();
    let mut slot = HashMap::new();
    let (mut started, mut up) = (0, 0);
    while up < COUNT {
        while started < COUNT && started - up < WINDOW {
            let qp = pd.create_qp(&attr(&cq)).unwrap();
            let opts = ConnectOptions::default().private_data(&(started as u32).to_be_bytes());
            let id = ch.connect(&qp, addr.as_str(), &opts).unwrap();
            slot.insert(id.conn_id(), qps.len());
            qps.push((qp, id));
            started += 1;
        }
        match ch.get_event(Some(WAIT)).unwrap() {
            CmEvent::Established { id, .. } => {
                up += 1;
                let i = slot[&id];
                let msg = (i as u32).to_be_bytes();
                qps[i]
                    .0
                    .post_send(&SendWr {
                        wr_id: i as u64,
                        op: SendOp::Send {
                            solicited: false,
                            invalidate: None,
                        },
                        payload: Payload::Inline(&msg),
                        signaled: false,
                        fence: false,
                    })
                    .unwrap();
            }
            other => panic!("{other:?}"),
        }
    }
    println!("CLIENT-UP {up}");
    let mut down = 0;
    while down < COUNT {
        match ch.get_event(Some(WAIT)).unwrap() {
            CmEvent::Disconnected { reason, .. } => {
                assert_eq!(reason, DisconnectReason::PeerClosed);
                down += 1;
            }
            CmEvent::TimewaitExit { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    println!("CLIENT-DONE {down}");
}

#[test]
fn one_listener_accepts_many_connections_from_another_process() {
    let dev = Device::open_default().unwrap();
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(4 * COUNT, None).unwrap();
    let inbox = pd.reg_mr(4 * COUNT, AccessFlags::LOCAL_WRITE).unwrap();
    let ch = CmEventChannel::new().unwrap();
    let l = ch
        .listen(
            "127.0.0.1:0",
            &ListenOptions::default().backlog(COUNT as u32),
        )
        .unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["child_client_role", "--exact", "--ignored", "--nocapture"])
        .env(ROLE_VAR, l.local_addr().to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut ids = Vec::new();
    let mut seen_pd = [false; COUNT];
    while ids.len() < COUNT {
        let req = match ch.get_event(Some(WAIT)).unwrap() {
            CmEvent::ConnectRequest(r) => r,
            CmEvent::Established { .. } => continue,
            other => panic!("{other:?}"),
        };
        let n = u32::from_be_bytes(req.private_data().try_into().unwrap()) as usize;
        assert!(!seen_pd[n], "request {n} twice");
        seen_pd[n] = true;
        let qp = pd.create_qp(&attr(&cq)).unwrap();
        qp.post_recv(&RecvWr {
            wr_id: n as u64,
            sgl: SgList::single(inbox.sge(4 * n, 4).unwrap()),
        })
        .unwrap();
        ids.push((req.accept(&qp, &ConnectOptions::default()).unwrap(), qp));
    }
    // Each connection's message: its own number.
    let deadline = Instant::now() + WAIT;
    let mut got = 0;
    while got < COUNT {
        match cq.poll_one() {
            Some(wc) => {
                assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                let mut b = [0u8; 4];
                inbox.read_at(4 * wc.wr_id as usize, &mut b).unwrap();
                assert_eq!(u32::from_be_bytes(b) as u64, wc.wr_id);
                got += 1;
            }
            None => {
                assert!(Instant::now() < deadline, "{got} of {COUNT} messages");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    // The harness prints its own lines around the client's.
    let next = |what: &str| loop {
        let l = rx.recv_timeout(WAIT).unwrap();
        if l.starts_with(what) || l.contains("panicked") {
            break l;
        }
    };
    assert_eq!(next("CLIENT-UP"), format!("CLIENT-UP {COUNT}"));
    for (id, _) in &ids {
        id.disconnect().unwrap();
    }
    assert_eq!(next("CLIENT-DONE"), format!("CLIENT-DONE {COUNT}"));
    let status = child.wait().unwrap();
    assert!(status.success(), "client exited with {status}");
    for (id, _) in &ids {
        cm_support::wait_until("every connection closed", || id.state() == CmState::Closed);
    }
}
