//! The RNR wait through the runtime (`ConnectOptions::rnr_wait`, on by default): a sender
//! whose Sends outrun a slow receiver's posted receives is held back by TCP's flow control
//! instead of failing the stream, and every message arrives, in order, byte for byte; in the
//! progress thread's mode, in busy-poll mode, and with a shared receive queue.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use crate::util::*;
use softwarp::*;

const LW: AccessFlags = AccessFlags::LOCAL_WRITE;
/// Sizes of the Sends, in turn: small ones (copied whole), a large one (read straight into
/// its receive), one of several large FPDUs.
const SIZES: [usize; 6] = [64, 4096, 1, 70_000, 300, 200_000];
const MESSAGES: usize = 240;
/// Receive buffer of each slot.
const SLOT: usize = 256 * 1024;
/// Receives the receiver keeps posted at most.
const POSTED: usize = 2;

fn size(i: usize) -> usize {
    SIZES[i % SIZES.len()]
}

/// The receiving side: its QP's receives go to its RQ, or to `srq`.
struct Receiver<'a> {
    end: &'a End,
    srq: Option<&'a SharedReceiveQueue>,
    buf: MemoryRegion,
}

impl Receiver<'_> {
    fn post(&self, k: usize) {
        let wr = RecvWr {
            wr_id: k as u64,
            sgl: SgList::single(self.buf.sge((k % POSTED) * SLOT, SLOT as u32).unwrap()),
        };
        match self.srq {
            Some(srq) => srq.post_recv(&wr).unwrap(),
            None => self.end.qp.post_recv(&wr).unwrap(),
        }
    }
}

/// `a` sends every message as fast as its send queue allows; `b` keeps at most
/// [`POSTED`] receives posted and pauses now and then before it posts again.
fn outrun(a: &End, b: &End, srq: Option<&SharedReceiveQueue>) {
    let rx = Receiver {
        end: b,
        srq,
        buf: b.pd.reg_mr(POSTED * SLOT, LW).unwrap(),
    };
    for k in 0..POSTED {
        rx.post(k);
    }
    let src = a.pd.reg_mr(SLOT, AccessFlags::NONE).unwrap();
    std::thread::scope(|s| {
        let sender = s.spawn(|| {
            let mut done = 0;
            for i in 0..MESSAGES {
                if i - done >= 64 {
                    let wcs = wait_wcs(&a.scq, 1);
                    assert_eq!(wcs[0].status, WcStatus::Success, "{wcs:?}");
                    done += 1;
                }
                let len = size(i);
                src.write_at(0, &pattern(len, i as u64)).unwrap();
                let sgl = if len == 0 {
                    SgList::new()
                } else {
                    SgList::single(src.sge(0, len as u32).unwrap())
                };
                a.qp.post_send(&send_wr(
                    i as u64,
                    send_op(i % 5 == 0, None),
                    Payload::Sgl(sgl),
                ))
                .unwrap();
                // The source is rewritten for the next message only once this one left.
                let wcs = wait_wcs(&a.scq, 1);
                assert_eq!(wcs[0].status, WcStatus::Success, "{wcs:?}");
                done += 1;
            }
        });
        let deadline = Instant::now() + WAIT;
        for i in 0..MESSAGES {
            let wc = loop {
                if let Some(wc) = b.rcq.poll_one() {
                    break wc;
                }
                assert!(Instant::now() < deadline, "message {i} did not come");
                std::thread::sleep(Duration::from_micros(100));
            };
            assert_eq!(wc.status, WcStatus::Success, "message {i}: {wc:?}");
            assert_eq!(wc.wr_id, i as u64, "in order");
            assert_eq!(wc.byte_len as usize, size(i), "message {i}");
            let mut got = vec![0u8; size(i)];
            rx.buf.read_at((i % POSTED) * SLOT, &mut got).unwrap();
            assert!(got == pattern(size(i), i as u64), "message {i} differs");
            // A slow receiver: the sender is far ahead by now.
            if i % 16 == 0 {
                std::thread::sleep(Duration::from_millis(20));
            }
            if i + POSTED < MESSAGES {
                rx.post(i + POSTED);
            }
        }
        sender.join().unwrap();
    });
    let st = b.qp.stats();
    assert!(st.rx_rnr_waits > 0, "the receiver never waited: {st:?}");
    assert_eq!(st.rx_rnr_expired, 0);
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(b.qp.state(), QpState::Rts);
    eprintln!(
        "{MESSAGES} Sends, {} RNR waits at the receiver",
        st.rx_rnr_waits
    );
}

#[test]
fn a_sender_that_outruns_a_slow_receiver_loses_nothing() {
    for busy in [false, true] {
        let (a, b) = pair(&ConnectOptions::default());
        if busy {
            b.rcq.set_busy_poll(true);
            b.scq.set_busy_poll(true);
        }
        outrun(&a, &b, None);
    }
}

#[test]
fn a_sender_that_outruns_a_slow_receiver_on_an_srq_loses_nothing() {
    let mut a = End::new(None, None);
    let dev = Device::open_default().unwrap();
    let pd = dev.alloc_pd().unwrap();
    let srq = pd
        .create_srq(&SrqInitAttr {
            max_wr: 16,
            max_sge: 1,
            srq_limit: 0,
        })
        .unwrap();
    let scq = dev.create_cq(1024, None).unwrap();
    let rcq = dev.create_cq(1024, None).unwrap();
    let mut attr = QpInitAttr::new(&scq, &rcq);
    attr.srq = Some(&srq);
    let qp = pd.create_qp(&attr).unwrap();
    let mut b = End {
        qp,
        scq,
        rcq,
        pd,
        info: None,
        dev,
    };
    connect(&mut a, &mut b, &ConnectOptions::default());
    outrun(&a, &b, Some(&srq));
    // The SRQ goes before its device does (a device closed with it still there reports a
    // leak).
    let End {
        qp,
        scq,
        rcq,
        pd,
        dev,
        ..
    } = b;
    drop(qp);
    drop(srq);
    drop((scq, rcq, pd, dev));
}

#[test]
fn a_qps_own_rnr_wait_overrides_the_connections_and_ends_in_the_no_buffer_terminate() {
    let (a, b) = pair(&ConnectOptions::default());
    assert_eq!(b.qp.rnr_wait(), Some(Some(DEFAULT_RNR_WAIT)));
    let wait = Duration::from_millis(150);
    b.qp.set_rnr_wait(Some(wait)).unwrap();
    assert_eq!(b.qp.rnr_wait(), Some(Some(wait)));
    let t0 = Instant::now();
    a.qp.post_send(&send_wr(1, send_op(false, None), Payload::Inline(b"late")))
        .unwrap();
    let (ev, _) = wait_event(&b.dev, |e| matches!(e, AsyncEvent::QpRequestError { .. }));
    assert!(t0.elapsed() >= wait, "failed after {:?}", t0.elapsed());
    assert_eq!(
        ev,
        AsyncEvent::QpRequestError {
            qp_num: b.qp.qp_num(),
            cause: Cause::Detected(Fault::NoReceiveBuffer)
        }
    );
    assert_eq!(b.qp.stats().rx_rnr_waits, 1);
    assert_eq!(b.qp.stats().rx_rnr_expired, 1);
    wait_state(&a.qp, QpState::Error);
}

/// Waits until `qp` leaves RTS; how long that took.
fn leaves_rts(qp: &QueuePair, bound: Duration) -> Duration {
    let t0 = Instant::now();
    while qp.state() == QpState::Rts {
        assert!(t0.elapsed() < bound, "still in RTS after {bound:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
    t0.elapsed()
}

#[test]
fn a_receiver_that_disconnects_while_it_holds_a_send_drops_it_without_a_terminate() {
    let (a, b) = pair(&ConnectOptions::default());
    a.qp.post_send(&send_wr(
        1,
        send_op(false, None),
        Payload::Inline(b"unread"),
    ))
    .unwrap();
    let t0 = Instant::now();
    while !b.qp.rnr_waiting() {
        assert!(t0.elapsed() < WAIT, "the Send never arrived");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(a.qp.state(), QpState::Rts);
    b.qp.disconnect().unwrap();
    // Both ends close long before the wait's bound, and nobody is terminated.
    let took = leaves_rts(&a.qp, DEFAULT_RNR_WAIT / 2);
    // The receiver reads on past the dropped Send and sees the sender's FIN: well within
    // the 2 s it would linger for it otherwise.
    let t1 = Instant::now();
    while b.qp.state() != QpState::Error {
        assert!(
            t1.elapsed() < Duration::from_millis(1500),
            "{:?}",
            b.qp.state()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let closed = t1.elapsed();
    eprintln!("the sender saw the close after {took:?}, the receiver was closed after {closed:?}");
    let (sa, sb) = (a.qp.stats(), b.qp.stats());
    assert_eq!(
        (sa.terminates_sent, sa.terminates_received),
        (0, 0),
        "{sa:?}"
    );
    assert_eq!(
        (sb.terminates_sent, sb.terminates_received),
        (0, 0),
        "{sb:?}"
    );
    assert_eq!((sb.rx_rnr_waits, sb.rx_rnr_expired), (1, 0));
    assert_eq!(sb.rx.send.messages, 0);
}

#[test]
fn a_sender_whose_sends_are_held_resets_its_close_so_the_holder_sees_it() {
    let (a, b) = pair(&ConnectOptions::default());
    // More than the two sockets hold: the last Sends stay in a's QP and socket.
    let src = a.pd.reg_mr(SLOT, AccessFlags::NONE).unwrap();
    let sends = 128;
    for i in 0..sends {
        let sgl = SgList::single(src.sge(0, SLOT as u32).unwrap());
        a.qp.post_send(&send_wr(i, send_op(false, None), Payload::Sgl(sgl)))
            .unwrap();
    }
    let t0 = Instant::now();
    while !b.qp.rnr_waiting() {
        assert!(t0.elapsed() < WAIT, "the Send never arrived");
        std::thread::sleep(Duration::from_millis(1));
    }
    // The sender closes; its FIN cannot pass the bytes b does not read. Past its linger
    // time it resets, and b, which holds a Send, sees that instead of waiting the bound.
    let closed = Instant::now();
    a.qp.disconnect().unwrap();
    drop(a);
    let took = leaves_rts(&b.qp, DEFAULT_RNR_WAIT / 2);
    eprintln!("the holder saw the sender's close after {took:?}");
    assert!(closed.elapsed() < DEFAULT_RNR_WAIT / 2);
    let sb = b.qp.stats();
    assert_eq!(sb.terminates_sent, 0, "{sb:?}");
    assert_eq!(sb.rx_rnr_expired, 0);
    assert_eq!(sb.rx.send.messages, 0);
}
