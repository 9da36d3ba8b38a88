//! Interleaving on transmit through the runtime: a Send posted while a long Read Response
//! is going out does not wait for its end. (The engine's turns, bounds and the rule that
//! keeps the stream acceptable to Linux siw: `softwarp-engine/tests/tx_interleave.rs`.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use crate::util::*;
use softwarp::*;

const LW: AccessFlags = AccessFlags::LOCAL_WRITE;

/// Large enough that the kernel's socket buffers (a few MiB on loopback) hold a small part.
const READ_LEN: usize = 64 << 20;

/// B posts a small Send once it has started sending A the Read Response of a 64 MiB Read:
/// A, whose one CQ takes both its send and receive completions in the order its QP
/// finished them, completes the Send's receive first and the Read after it. Without
/// interleaving the Send left behind the whole Read Response, and the Read came first.
#[test]
fn a_send_posted_during_a_long_read_response_arrives_before_the_read_completes() {
    let opts = ConnectOptions::default();
    let mut a = End::with(None, None, |attr| attr.recv_cq = attr.send_cq);
    let mut b = End::new(None, None);
    connect(&mut a, &mut b, &opts);
    let (src, data) = b.mr(READ_LEN, AccessFlags::REMOTE_READ, 7);
    let (sink, _) = a.mr(READ_LEN, LW, 0);
    let (inbox, _) = a.mr(64, LW, 0);
    a.qp.post_recv(&RecvWr {
        wr_id: 1,
        sgl: sgl(&inbox, 0, 64, 1),
    })
    .unwrap();
    a.qp.post_send(&send_wr(
        2,
        SendOp::Read {
            remote_addr: src.addr(),
            rkey: src.rkey(),
        },
        Payload::Sgl(sgl(&sink, 0, READ_LEN, 1)),
    ))
    .unwrap();
    let deadline = Instant::now() + WAIT;
    while b.qp.stats().tx.read_response.bytes == 0 {
        assert!(Instant::now() < deadline, "{:?}", b.qp.stats());
        std::thread::sleep(Duration::from_micros(200));
    }
    let posted = Instant::now();
    b.qp.post_send(&send_wr(
        3,
        send_op(false, None),
        Payload::Inline(b"while reading"),
    ))
    .unwrap();
    // One completion at a time, each timed from the Send's post.
    let mut wcs = Vec::new();
    let mut took = Vec::new();
    while wcs.len() < 2 {
        match a.scq.poll_one() {
            Some(wc) => {
                wcs.push(wc);
                took.push(posted.elapsed());
            }
            None => {
                assert!(Instant::now() < deadline, "{wcs:?}");
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
    println!("A's completions after B posted its Send: {wcs:?} after {took:?}");
    assert_eq!(
        (wcs[0].wr_id, wcs[0].opcode, wcs[0].status),
        (1, WcOpcode::Recv, WcStatus::Success),
        "{wcs:?}"
    );
    assert_eq!(
        (wcs[1].wr_id, wcs[1].opcode, wcs[1].status),
        (2, WcOpcode::RdmaRead, WcStatus::Success),
        "{wcs:?}"
    );
    assert_eq!(&inbox.to_vec().unwrap()[..13], b"while reading");
    assert!(sink.to_vec().unwrap() == data, "the Read's bytes differ");
    let bw = wait_wcs(&b.scq, 1);
    assert_eq!((bw[0].wr_id, bw[0].status), (3, WcStatus::Success));
    let st = b.qp.stats();
    assert_eq!(st.tx.read_response.bytes, READ_LEN as u64, "{st:?}");
}
