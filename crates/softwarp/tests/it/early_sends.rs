//! Early Sends over real sockets (the engine's `early_sends.rs` covers the cases in detail):
//! a ping-pong's large Sends are read straight into the posted receive before their header
//! (`rx_early_bytes`), through the runtime's three-buffer `readv`, in busy and in event mode;
//! a Write and a Send of another layout between them still land exactly where their headers
//! say, and nothing around the Write's range changes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Instant;

use crate::util::*;
use softwarp::*;

const MSG: usize = 64 * 1024;
/// Guard bytes on each side of the Write's range in the sink.
const GUARD: usize = 4096;

/// Waits until `a` has `sends` more send completions and `b` `recvs` more receive
/// completions; returns the receive completions' byte lengths.
fn wait(a: &End, b: &End, sends: usize, recvs: usize, what: &str) -> Vec<u32> {
    let deadline = Instant::now() + WAIT;
    let (mut sent, mut lens) = (0, Vec::new());
    let mut wc = [EMPTY_COMPLETION; 4];
    while sent < sends || lens.len() < recvs {
        let n = a.scq.poll(&mut wc).unwrap();
        assert!(
            wc[..n].iter().all(|w| w.status == WcStatus::Success),
            "{what}: {:?}",
            &wc[..n]
        );
        sent += n;
        let n = b.rcq.poll(&mut wc).unwrap();
        for w in &wc[..n] {
            assert_eq!(w.status, WcStatus::Success, "{what}");
            lens.push(w.byte_len);
        }
        assert!(Instant::now() < deadline, "{what}: no completion");
    }
    lens
}

#[test]
fn a_ping_pongs_large_sends_are_read_into_their_receives_and_other_messages_still_land() {
    for busy in [true, false] {
        let (a, b) = pair(&ConnectOptions::default());
        for cq in [&a.scq, &a.rcq, &b.scq, &b.rcq] {
            cq.set_busy_poll(busy);
        }
        // Two sources (every message differs from the one before), a receive buffer, a
        // Write sink with guard bytes around the Write's range.
        let (src, data) = a.mr(2 * MSG, AccessFlags::NONE, 21);
        let (rbuf, _) = b.mr(MSG, AccessFlags::LOCAL_WRITE, 0);
        let (sink, guards) = b.mr(
            MSG + 2 * GUARD,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            22,
        );
        let send = |i: u64, half: usize, len: usize| {
            b.qp.post_recv(&RecvWr {
                wr_id: i,
                sgl: SgList::single(rbuf.sge(0, MSG as u32).unwrap()),
            })
            .unwrap();
            a.qp.post_send(&send_wr(
                i,
                send_op(false, None),
                Payload::Sgl(SgList::single(src.sge(half * MSG, len as u32).unwrap())),
            ))
            .unwrap();
            let lens = wait(&a, &b, 1, 1, &format!("busy {busy}, Send {i}"));
            assert_eq!(lens, [len as u32], "busy {busy}, Send {i}");
            let got = rbuf.to_vec().unwrap();
            assert!(
                got[..len] == data[half * MSG..half * MSG + len],
                "busy {busy}, Send {i}: other bytes in the receive"
            );
        };
        let early_before = b.qp.stats().rx_early_bytes;
        for i in 0..8u64 {
            send(i, i as usize % 2, MSG);
        }
        let early = b.qp.stats().rx_early_bytes - early_before;
        assert!(
            early >= 3 * 60_000,
            "busy {busy}: {early} bytes read early in 8 Sends of 64 KiB"
        );
        // A Write while Sends are expected (a receive is posted first, as a ping-pong's
        // receiver keeps one): its bytes land in the sink only where it says.
        b.qp.post_recv(&RecvWr {
            wr_id: 100,
            sgl: SgList::single(rbuf.sge(0, MSG as u32).unwrap()),
        })
        .unwrap();
        let write = SendOp::Write {
            remote_addr: sink.addr() + GUARD as u64,
            rkey: sink.rkey(),
        };
        a.qp.post_send(&send_wr(
            50,
            write,
            Payload::Sgl(SgList::single(src.sge(MSG, MSG as u32).unwrap())),
        ))
        .unwrap();
        // The receive posted before the Write takes the next Send whole (its completion
        // also says the Write before it was placed: a Write's own completion only says it
        // was sent).
        a.qp.post_send(&send_wr(
            51,
            send_op(false, None),
            Payload::Sgl(SgList::single(src.sge(0, MSG as u32).unwrap())),
        ))
        .unwrap();
        assert_eq!(wait(&a, &b, 2, 1, "Write, then a Send"), [MSG as u32]);
        let got = sink.to_vec().unwrap();
        assert!(
            got[GUARD..GUARD + MSG] == data[MSG..],
            "busy {busy}: Write bytes"
        );
        assert!(
            got[..GUARD] == guards[..GUARD] && got[GUARD + MSG..] == guards[GUARD + MSG..],
            "busy {busy}: the Write changed bytes around its range"
        );
        assert!(
            rbuf.to_vec().unwrap() == data[..MSG],
            "busy {busy}: Send after the Write"
        );
        // Sends again, then one of another layout (from another offset, shorter).
        for i in 0..3u64 {
            send(200 + i, 0, MSG);
        }
        send(300, 1, MSG - 4000);
        send(301, 0, MSG);
    }
}
