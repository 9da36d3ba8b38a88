//! Large payloads are read by the kernel straight into their destination: no user-space
//! copy, whichever thread moves the bytes (the progress thread, or a busy-polling one) and
//! however the FPDUs line up with the runtime's read-ahead buffer. Small messages go
//! through that buffer by design. Measured with the QP's `rx_staged_payload_bytes`
//! statistic (payload bytes copied out of the read-ahead buffer).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Instant;

use crate::util::*;
use softwarp::*;

const LEN: usize = 4 << 20;

/// Writes then Sends `LEN` bytes from `a` to `b` with FPDUs of at most `fpdu` bytes;
/// returns the payload bytes `b` copied out of its read-ahead buffer.
fn staged_bytes(busy: bool, fpdu: usize) -> u64 {
    let mut a = End::new(None, None);
    let mut b = End::new(None, None);
    for cq in [&a.scq, &a.rcq, &b.scq, &b.rcq] {
        cq.set_busy_poll(busy);
    }
    let (sink, _) = b.mr(LEN, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE, 0);
    let (rbuf, _) = b.mr(LEN, AccessFlags::LOCAL_WRITE, 0);
    let (src, data) = a.mr(LEN, AccessFlags::NONE, 11);
    b.qp.post_recv(&RecvWr {
        wr_id: 1,
        sgl: SgList::single(rbuf.sge(0, LEN as u32).unwrap()),
    })
    .unwrap();
    let opts = ConnectOptions::default().max_fpdu_len(Some(fpdu));
    connect(&mut a, &mut b, &opts);
    let before = b.qp.stats().rx_staged_payload_bytes;
    let payload = || Payload::Sgl(SgList::single(src.sge(0, LEN as u32).unwrap()));
    let write = SendOp::Write {
        remote_addr: sink.addr(),
        rkey: sink.rkey(),
    };
    a.qp.post_send(&send_wr(1, write, payload())).unwrap();
    a.qp.post_send(&send_wr(2, send_op(false, None), payload()))
        .unwrap();
    // Both ends polled from this thread (busy mode moves the bytes in the polls).
    let deadline = Instant::now() + WAIT;
    let (mut sent, mut received) = (0, 0);
    let mut wc = [EMPTY_COMPLETION; 4];
    while sent < 2 || received < 1 {
        sent += a.scq.poll(&mut wc).unwrap();
        received += b.rcq.poll(&mut wc).unwrap();
        assert!(
            Instant::now() < deadline,
            "sent {sent} of 2, received {received} of 1"
        );
    }
    assert_eq!(sink.to_vec().unwrap(), data);
    assert_eq!(rbuf.to_vec().unwrap(), data);
    b.qp.stats().rx_staged_payload_bytes - before
}

/// FPDUs of 32 KiB filled the read-ahead buffer (64 KiB then) exactly in pairs: before the
/// fix the runtime kept reading ahead and copied every payload out of it.
#[test]
fn large_payloads_of_fpdus_that_fill_the_read_ahead_buffer_exactly_are_not_copied() {
    assert_large_payloads_not_copied(32 * 1024);
}

/// In event and in busy mode, at most 5 % of the payload is copied (the first FPDUs of a
/// message may come through the read-ahead buffer).
fn assert_large_payloads_not_copied(fpdu: usize) {
    for busy in [false, true] {
        let staged = staged_bytes(busy, fpdu);
        assert!(
            staged < (2 * LEN / 20) as u64,
            "busy {busy}: {staged} of {} payload bytes copied out of the read-ahead buffer",
            2 * LEN
        );
    }
}

/// FPDUs whose payload is at least 16 KiB, of a size that does not divide the read-ahead
/// buffer. (Smaller FPDUs, as with a hardware peer's 1460- or 9000-byte MSS, are read ahead
/// many per system call and copied by design: a copy of a few KiB costs less than a system
/// call each.)
#[test]
fn large_payloads_of_odd_sized_fpdus_are_not_copied() {
    assert_large_payloads_not_copied(20_000);
}

#[test]
fn small_sends_are_read_ahead_and_counted() {
    let (a, b) = pair(&ConnectOptions::default());
    let (rbuf, _) = b.mr(64, AccessFlags::LOCAL_WRITE, 0);
    let (src, _) = a.mr(64, AccessFlags::NONE, 3);
    for i in 0..20 {
        b.qp.post_recv(&RecvWr {
            wr_id: i,
            sgl: SgList::single(rbuf.sge(0, 64).unwrap()),
        })
        .unwrap();
    }
    let before = b.qp.stats().rx_staged_payload_bytes;
    let wrs: Vec<SendWr<'_>> = (0..20)
        .map(|i| {
            send_wr(
                i,
                send_op(false, None),
                Payload::Sgl(SgList::single(src.sge(0, 64).unwrap())),
            )
        })
        .collect();
    a.qp.post_send_list(&wrs).unwrap();
    wait_wcs(&b.rcq, 20);
    // Each whole small FPDU is read ahead and copied (one system call for many).
    assert_eq!(b.qp.stats().rx_staged_payload_bytes - before, 20 * 64);
}

/// One 64 KiB Send at a time (a ping-pong's traffic): each message is a 65,535-byte FPDU
/// and a small last FPDU. That small FPDU used to switch the receiver back to reading
/// ahead, so the next message's first FPDU went through the read-ahead buffer and was
/// copied out of it (all but the tail of every message). Now only the first message's is.
#[test]
fn successive_large_messages_are_not_copied_after_their_small_last_fpdus() {
    const MSG: usize = 64 * 1024;
    const COUNT: usize = 40;
    for busy in [true, false] {
        let (a, b) = pair(&ConnectOptions::default());
        for cq in [&a.scq, &a.rcq, &b.scq, &b.rcq] {
            cq.set_busy_poll(busy);
        }
        let (rbuf, _) = b.mr(MSG, AccessFlags::LOCAL_WRITE, 0);
        let (src, data) = a.mr(MSG, AccessFlags::NONE, 5);
        let before = b.qp.stats().rx_staged_payload_bytes;
        let mut wc = [EMPTY_COMPLETION; 4];
        for i in 0..COUNT as u64 {
            b.qp.post_recv(&RecvWr {
                wr_id: i,
                sgl: SgList::single(rbuf.sge(0, MSG as u32).unwrap()),
            })
            .unwrap();
            a.qp.post_send(&send_wr(
                i,
                send_op(false, None),
                Payload::Sgl(SgList::single(src.sge(0, MSG as u32).unwrap())),
            ))
            .unwrap();
            let deadline = Instant::now() + WAIT;
            let (mut sent, mut received) = (0, 0);
            while sent < 1 || received < 1 {
                sent += a.scq.poll(&mut wc).unwrap();
                let n = b.rcq.poll(&mut wc).unwrap();
                if n > 0 {
                    assert_eq!(wc[0].byte_len, MSG as u32);
                }
                received += n;
                assert!(Instant::now() < deadline, "message {i}: no completion");
            }
        }
        assert_eq!(rbuf.to_vec().unwrap(), data);
        let staged = b.qp.stats().rx_staged_payload_bytes - before;
        assert!(
            staged < (COUNT * MSG / 10) as u64,
            "busy {busy}: {staged} of {} payload bytes copied out of the read-ahead buffer",
            COUNT * MSG
        );
    }
}
