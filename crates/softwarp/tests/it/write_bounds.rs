//! Over loopback TCP, Writes change exactly the bytes the peer wrote: guard bytes (a
//! pattern) around and between the target ranges keep their values while the receiver
//! reads several FPDUs per system call (payload straight into the region, the trailer and
//! the next header into the read-ahead buffer). Multi-FPDU Writes followed by a Write that
//! is not their continuation, adjacent Writes, Sends in between and last, all posted as one list so
//! that they sit in the socket together; busy polling and the progress thread; the default
//! (largest) FPDUs and odd-sized ones.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Instant;

use crate::util::*;
use softwarp::*;

const SINK: usize = 4 << 20;
const RBUF: usize = 4096;
const SEND_LEN: usize = 100;

fn run(busy: bool, fpdu: Option<usize>) {
    let mut a = End::new(None, None);
    let mut b = End::new(None, None);
    for cq in [&a.scq, &a.rcq, &b.scq, &b.rcq] {
        cq.set_busy_poll(busy);
    }
    let (sink, guard) = b.mr(
        SINK,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        99,
    );
    let (rbuf, rguard) = b.mr(RBUF, AccessFlags::LOCAL_WRITE, 98);
    let (src, data) = a.mr(SINK, AccessFlags::NONE, 7);
    for wr_id in [100, 101] {
        b.qp.post_recv(&RecvWr {
            wr_id,
            sgl: SgList::single(rbuf.sge(0, RBUF as u32).unwrap()),
        })
        .unwrap();
    }
    let opts = ConnectOptions::default().max_fpdu_len(fpdu);
    connect(&mut a, &mut b, &opts);

    let w1 = (1000, (1 << 20) + 17);
    // A guard gap of 4096 bytes: not w1's continuation.
    let w2 = (w1.0 + w1.1 + 4096, 300_001);
    // w2's continuation.
    let w3 = (w2.0 + w2.1, 200_000);
    let w4 = (0, 999);
    let w5 = (SINK - 1, 1);
    let plan = [w1, w2, w3, w4, w5];
    let mut expect = guard;
    let mut wrs = Vec::new();
    for (i, &(off, len)) in plan.iter().enumerate() {
        if i == 2 {
            wrs.push(send_wr(
                50,
                send_op(false, None),
                Payload::Sgl(SgList::single(src.sge(0, SEND_LEN as u32).unwrap())),
            ));
        }
        let write = SendOp::Write {
            remote_addr: sink.addr() + off as u64,
            rkey: sink.rkey(),
        };
        wrs.push(send_wr(
            i as u64,
            write,
            Payload::Sgl(SgList::single(src.sge(off, len as u32).unwrap())),
        ));
        expect[off..off + len].copy_from_slice(&data[off..off + len]);
    }
    // A last Send: its completion at b says every Write before it was placed (a send WR
    // completes when handed to TCP, not when the peer has it).
    wrs.push(send_wr(
        51,
        send_op(false, None),
        Payload::Sgl(SgList::single(src.sge(0, SEND_LEN as u32).unwrap())),
    ));
    a.qp.post_send_list(&wrs).unwrap();

    let deadline = Instant::now() + WAIT;
    let (mut sent, mut received) = (0, 0);
    let mut wc = [EMPTY_COMPLETION; 8];
    while sent < wrs.len() || received < 2 {
        let n = a.scq.poll(&mut wc).unwrap();
        assert!(
            wc[..n].iter().all(|c| c.status == WcStatus::Success),
            "{wc:?}"
        );
        sent += n;
        let n = b.rcq.poll(&mut wc).unwrap();
        assert!(
            wc[..n].iter().all(|c| c.byte_len == SEND_LEN as u32),
            "{wc:?}"
        );
        received += n;
        assert!(
            Instant::now() < deadline,
            "busy {busy}, fpdu {fpdu:?}: sent {sent} of {}, received {received} of 2",
            wrs.len()
        );
    }
    let got = sink.to_vec().unwrap();
    let written = |i: usize| plan.iter().any(|&(o, l)| (o..o + l).contains(&i));
    // First any byte outside the written ranges (placed where no header named it), then
    // the ranges themselves.
    if let Some(at) = (0..SINK).find(|&i| got[i] != expect[i] && !written(i)) {
        panic!("busy {busy}, fpdu {fpdu:?}: sink byte {at}, outside every written range, changed");
    }
    if let Some(at) = (0..SINK).find(|&i| got[i] != expect[i]) {
        panic!("busy {busy}, fpdu {fpdu:?}: sink byte {at}, inside a written range, differs");
    }
    let mut rexpect = rguard;
    rexpect[..SEND_LEN].copy_from_slice(&data[..SEND_LEN]);
    assert_eq!(rbuf.to_vec().unwrap(), rexpect, "receive buffer");
}

#[test]
fn writes_over_loopback_change_no_byte_outside_their_ranges() {
    for busy in [true, false] {
        for fpdu in [None, Some(20_000), Some(1460)] {
            run(busy, fpdu);
        }
    }
}
