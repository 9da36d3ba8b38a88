//! Busy-poll CQs: polling the CQ moves the QP's bytes on the polling thread (Sends, Writes,
//! Reads answered by a busy-polled responder), and a closing peer is still noticed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use crate::util::*;
use softwarp::*;

fn busy_end() -> End {
    let e = End::new(None, None);
    e.scq.set_busy_poll(true);
    e.rcq.set_busy_poll(true);
    e
}

/// Polls `cq` (busy) until one completion arrives.
fn busy_wait(cq: &CompletionQueue) -> WorkCompletion {
    let deadline = Instant::now() + WAIT;
    let mut wc = [EMPTY_COMPLETION; 1];
    loop {
        if cq.poll(&mut wc).unwrap() == 1 {
            return wc[0];
        }
        assert!(Instant::now() < deadline, "no completion within {WAIT:?}");
    }
}

#[test]
fn busy_polled_ends_exchange_sends_writes_and_reads() {
    let mut a = busy_end();
    let mut b = busy_end();
    assert!(a.rcq.busy_poll() && !End::new(None, None).rcq.busy_poll());
    let (sink, _) = b.mr(
        1 << 20,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        0,
    );
    let (rbuf, _) = b.mr(1 << 20, AccessFlags::LOCAL_WRITE, 0);
    let (src, data) = a.mr(1 << 20, AccessFlags::REMOTE_READ, 7);
    b.qp.post_recv(&RecvWr {
        wr_id: 5,
        sgl: SgList::single(rbuf.sge(0, 1 << 20).unwrap()),
    })
    .unwrap();
    connect(&mut a, &mut b, &ConnectOptions::default());

    // A 1 MiB Send: many FPDUs, all read by b's polling thread.
    a.qp.post_send(&SendWr {
        wr_id: 1,
        op: SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        payload: Payload::Sgl(SgList::single(src.sge(0, 1 << 20).unwrap())),
        signaled: true,
        fence: false,
    })
    .unwrap();
    let wc = busy_wait(&b.rcq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (5, WcStatus::Success, 1 << 20)
    );
    assert_eq!(rbuf.to_vec().unwrap(), data);
    assert_eq!(busy_wait(&a.scq).status, WcStatus::Success);

    // An RDMA Write, then a Read back: b's polling thread answers the Read Request.
    a.qp.post_send(&SendWr {
        wr_id: 2,
        op: SendOp::Write {
            remote_addr: sink.addr(),
            rkey: sink.rkey(),
        },
        payload: Payload::Sgl(SgList::single(src.sge(0, 4096).unwrap())),
        signaled: true,
        fence: false,
    })
    .unwrap();
    assert_eq!(busy_wait(&a.scq).wr_id, 2);
    let (back, _) = a.mr(4096, AccessFlags::LOCAL_WRITE, 0);
    a.qp.post_send(&SendWr {
        wr_id: 3,
        op: SendOp::Read {
            remote_addr: sink.addr(),
            rkey: sink.rkey(),
        },
        payload: Payload::Sgl(SgList::single(back.sge(0, 4096).unwrap())),
        signaled: true,
        fence: false,
    })
    .unwrap();
    // Both sides poll: b to answer, a to receive the response.
    let deadline = Instant::now() + WAIT;
    let mut wc = [EMPTY_COMPLETION; 1];
    loop {
        assert_eq!(b.rcq.poll(&mut wc).unwrap(), 0);
        if a.scq.poll(&mut wc).unwrap() == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the Read did not complete");
    }
    assert_eq!((wc[0].wr_id, wc[0].status), (3, WcStatus::Success));
    let got = back.to_vec().unwrap();
    let first = got.iter().zip(&data).position(|(x, y)| x != y);
    assert_eq!(first, None, "sink {:?}", &sink.to_vec().unwrap()[..16]);
}

/// What a thread that sleeps on a connection's socket needs (`softwarp-sockets`' blocking
/// calls): `QueuePair::watch_socket` puts the socket into the thread's epoll set, which is
/// readable once the peer's bytes are there, and `QueuePair::service` moves them on that
/// thread. b is busy-polled and nobody polls it, so nothing else reads its socket for the
/// 10-20 ms before the progress thread's take-over.
#[test]
fn watch_socket_and_service_let_the_woken_thread_move_the_bytes() {
    use rustix::event::{epoll, poll, PollFd, PollFlags, Timespec};
    use std::os::fd::AsFd;
    let mut a = End::new(None, None);
    let mut b = busy_end();
    let set = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
    assert!(matches!(
        b.qp.watch_socket(set.as_fd(), 7),
        Err(Error::NotConnected)
    ));
    connect(&mut a, &mut b, &ConnectOptions::default());
    b.qp.watch_socket(set.as_fd(), 7).unwrap();
    let (dst, _) = b.mr(64, AccessFlags::LOCAL_WRITE, 1);
    b.qp.post_recv(&RecvWr {
        wr_id: 5,
        sgl: SgList::single(dst.sge(0, 64).unwrap()),
    })
    .unwrap();
    let mut fds = [PollFd::new(&set, PollFlags::IN)];
    let none = Timespec::default();
    assert_eq!(poll(&mut fds, Some(&none)).unwrap(), 0, "nothing sent yet");
    let (src, data) = a.mr(64, AccessFlags::LOCAL_WRITE, 2);
    a.qp.post_send(&send_wr(
        1,
        send_op(false, None),
        Payload::Sgl(SgList::single(src.sge(0, 64).unwrap())),
    ))
    .unwrap();
    assert_eq!(wait_wcs(&a.scq, 1)[0].status, WcStatus::Success);
    // The Send is in b's socket: the set says so, and the pass on this thread takes it.
    let bound = Timespec {
        tv_sec: 5,
        tv_nsec: 0,
    };
    assert_eq!(
        poll(&mut fds, Some(&bound)).unwrap(),
        1,
        "the socket within 5 s"
    );
    let before = b.qp.stats().rx_fpdus;
    assert!(b.qp.service().unwrap(), "nobody else holds b");
    assert_eq!(b.qp.stats().rx_fpdus, before + 1, "service read the Send");
    assert_eq!(
        poll(&mut fds, Some(&none)).unwrap(),
        0,
        "the socket is read"
    );
    let wc = busy_wait(&b.rcq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (5, WcStatus::Success, 64)
    );
    assert_eq!(dst.to_vec().unwrap(), data);
    drop((src, dst));
}

#[test]
fn a_busy_polled_qp_notices_its_peer_going_away() {
    let mut a = End::new(None, None);
    let mut b = busy_end();
    connect(&mut a, &mut b, &ConnectOptions::default());
    drop(a);
    let deadline = Instant::now() + WAIT;
    let mut wc = [EMPTY_COMPLETION; 4];
    while b.qp.state() == QpState::Rts {
        b.rcq.poll(&mut wc).unwrap();
        assert!(Instant::now() < deadline, "the peer's close went unnoticed");
    }
    // The progress thread takes the closing over, even if nobody polls any more.
    assert!(matches!(
        b.qp.wait_closed(WAIT).unwrap(),
        QpState::Error | QpState::Idle
    ));
}

#[test]
fn a_busy_sender_that_stops_polling_still_gets_its_queued_bytes_out() {
    in_attempts(queued_bytes_get_out);
}

/// [`a_busy_sender_that_stops_polling_still_gets_its_queued_bytes_out`]'s scenario; false
/// when b's progress thread took b's reading over during the set-up.
fn queued_bytes_get_out() -> bool {
    // 4000 Sends of 2000 bytes (8 MB, more than loopback's socket buffers hold): each is
    // small enough to be coalesced into batches.
    const N: usize = 4000;
    // b does not read yet: a's socket fills and the rest of a's batches wait in the QP.
    // While a's thread is at work, nobody else writes its socket: its write watchdog is
    // armed instead of the socket joining the progress thread's epoll (which would wake the
    // progress thread at every drain).
    let (a, b, _buffers) = filled_socket(N, 2000);
    if rx_takeover(&b).is_some() {
        return false;
    }
    let (armed, _) = watchdog(&a).expect("a's socket filled up but no watchdog was armed");
    assert!(armed >= 1);
    // a never polls again; b polls until everything is in: the progress thread took over
    // (nobody else writes a's socket now).
    let deadline = Instant::now() + WAIT;
    let mut got = 0;
    let mut wcs = [EMPTY_COMPLETION; 64];
    while got < N {
        let n = b.rcq.poll(&mut wcs).unwrap();
        for wc in &wcs[..n] {
            assert_eq!(wc.status, WcStatus::Success);
            got += 1;
        }
        assert!(Instant::now() < deadline, "{got} of {N} Sends arrived");
    }
    // The progress thread took over from the watchdog and, everything sent, handed the
    // socket back to a's polls.
    let (_, took_over) = watchdog(&a).unwrap();
    assert!(took_over >= 1, "the progress thread never took over");
    assert_eq!(tx_by(&a), Some("polls"));
    true
}

#[test]
fn a_busy_sender_whose_polls_come_back_gets_its_writing_back() {
    in_attempts(writing_comes_back);
}

/// Two connected ends, a busy-polled (both CQs) and b with its receive CQ busy-polled and
/// `n` receives of `len` bytes posted (its CQs hold 4096 completions: if b's progress thread
/// takes b's reading over, because b's thread was off its CPU for longer than the take-over's
/// period on a loaded machine, it reads everything before b polls); a has posted `n`
/// unsignaled Sends of `len` bytes in lists of 50 while b stayed at work with empty posts.
/// Returns a's source and b's receive buffer too: they must outlive the transfer.
fn filled_socket(n: usize, len: u32) -> (End, End, [MemoryRegion; 2]) {
    let deep = |a: &mut QpInitAttr<'_>| {
        a.cap.max_send_wr = 4096;
        a.cap.max_recv_wr = 4096;
    };
    let mut a = End::with(None, None, deep);
    let mut b = End::with_cqe(None, None, 4096, deep);
    a.scq.set_busy_poll(true);
    a.rcq.set_busy_poll(true);
    b.rcq.set_busy_poll(true);
    let (rbuf, _) = b.mr(len as usize, AccessFlags::LOCAL_WRITE, 0);
    for i in 0..n {
        b.qp.post_recv(&RecvWr {
            wr_id: i as u64,
            sgl: SgList::single(rbuf.sge(0, len).unwrap()),
        })
        .unwrap();
    }
    // No first-FPDU hold-off: the Sends posted right away must leave on a's own thread
    // (held, the progress thread would send them when the hold ends).
    let opts = ConnectOptions::default().first_fpdu_delay(Duration::ZERO);
    connect(&mut a, &mut b, &opts);
    let (src, _) = a.mr(len as usize, AccessFlags::NONE, 3);
    let send = SendWr {
        wr_id: 0,
        op: SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        payload: Payload::Sgl(SgList::single(src.sge(0, len).unwrap())),
        signaled: false,
        fence: false,
    };
    for _ in 0..n / 50 {
        a.qp.post_send_list(&[send; 50]).unwrap();
        b.qp.post_send_list(&[]).unwrap();
    }
    (a, b, [src, rbuf])
}

/// Runs a scenario whose set-up needs b's reading to stay with b's thread while a fills
/// its socket or pauses; on a loaded machine a thread can be off its CPU for longer than
/// the receive take-over's period, and then b's progress thread reads everything: that
/// attempt (`scenario` returns false) proves nothing, and the scenario starts again with
/// new ends, at most three times.
fn in_attempts(scenario: impl Fn() -> bool) {
    for attempt in 1..=3 {
        if scenario() {
            return;
        }
        eprintln!("attempt {attempt}: b's reading was taken over during the set-up; again");
    }
    panic!("b's reading was taken over in every attempt");
}

/// [`a_busy_sender_whose_polls_come_back_gets_its_writing_back`]'s scenario; false when
/// b's progress thread took b's reading over during the set-up.
fn writing_comes_back() -> bool {
    // 1000 Sends of 32,000 bytes: a fills its socket (b does not read yet) and then pauses
    // while b stays at work (empty posts, so b's reading is not taken over): the watchdog
    // hands a's writing to the progress thread.
    const N: usize = 1000;
    let (a, b, _buffers) = filled_socket(N, 32_000);
    // b's keeping at work runs on a thread of its own: the looks at a's statistics take
    // every QP's lock in the process and may wait longer than the receive take-over's
    // period.
    let deadline = Instant::now() + WAIT;
    keep_at_work(&b.qp, || {
        while watchdog(&a).is_none_or(|(_, took_over)| took_over == 0) {
            assert!(Instant::now() < deadline, "the watchdog never took over");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    });
    if rx_takeover(&b).is_some() {
        return false;
    }
    assert_eq!(tx_by(&a), Some("progress"));
    assert_eq!(watchdog_handbacks(&a), Some(0));
    // a is back (a post; a busy poll skips a QP whose lock the progress thread holds, so
    // alone it might not be seen before everything is written). b reads a batch and stops
    // (staying at work): the progress thread writes into the room and its pass ends on a
    // full socket with a's pass count moved, so it hands the writing back to a's polls,
    // with bytes still pending. (Had b read on, the progress thread's passes could end on
    // its budget every time, keeping the writing, as the hand-back rule wants.)
    a.qp.post_send_list(&[]).unwrap();
    let mut got = 0;
    let mut wcs = [EMPTY_COMPLETION; 64];
    let mut take = |got: &mut usize| {
        let n = b.rcq.poll(&mut wcs).unwrap();
        for wc in &wcs[..n] {
            assert_eq!(wc.status, WcStatus::Success);
            *got += 1;
        }
        assert!(Instant::now() < deadline, "{got} of {N} Sends arrived");
    };
    while got < 50 {
        take(&mut got);
    }
    keep_at_work(&b.qp, || {
        while watchdog_handbacks(&a) == Some(0) {
            assert!(
                Instant::now() < deadline,
                "the progress thread kept a's writing"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    });
    if rx_takeover(&b).is_some() {
        return false;
    }
    while got < N {
        a.scq.poll(&mut [EMPTY_COMPLETION; 4]).unwrap();
        take(&mut got);
    }
    let back = watchdog_handbacks(&a).unwrap();
    assert!(back >= 1, "the progress thread kept a's writing");
    // The polls write (the watchdog may still be armed from the last full socket: it
    // disarms at its next look).
    let by = tx_by(&a);
    assert!(matches!(by, Some("polls" | "polls+watchdog")), "{by:?}");
    true
}

/// Runs `f` while another thread makes empty posts to `qp` (application activity, so the
/// progress thread does not take its reading over).
fn keep_at_work<R>(qp: &QueuePair, f: impl FnOnce() -> R) -> R {
    use std::sync::atomic::{AtomicBool, Ordering};
    /// Stops the posting thread on the way out, also when `f` panics (a deadline assertion):
    /// otherwise the scope would wait for that thread forever and the test would hang
    /// instead of failing.
    struct Done<'a>(&'a AtomicBool);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                qp.post_send_list(&[]).unwrap();
            }
        });
        let _done = Done(&done);
        f()
    })
}

/// `e`'s QP's write watchdog statistics (its `watchdog` detail): times armed, times the
/// progress thread took over. `None` before it was first armed.
fn watchdog(e: &End) -> Option<(u64, u64)> {
    two_counts(e, "watchdog", "armed=", "took_over=")
}

/// Times the progress thread handed `e`'s QP's writing back to its polls (`handed_back`
/// in its `watchdog` detail).
fn watchdog_handbacks(e: &End) -> Option<u64> {
    two_counts(e, "watchdog", "took_over=", "handed_back=").map(|(_, back)| back)
}

/// Two counts of a `k1=N,k2=M` detail of `e`'s QP.
fn two_counts(e: &End, detail: &str, k1: &str, k2: &str) -> Option<(u64, u64)> {
    let d = qp_detail(e, detail)?;
    let num = |k: &str| -> Option<u64> {
        d.split(',')
            .find_map(|kv| kv.strip_prefix(k))
            .and_then(|v| v.parse().ok())
    };
    Some((num(k1)?, num(k2)?))
}

/// Who writes `e`'s QP's socket when it drains (its `tx_by` detail in the RAS resources).
fn tx_by(e: &End) -> Option<&'static str> {
    let found = qp_detail(e, "tx_by")?;
    ["progress", "polls", "polls+watchdog"]
        .into_iter()
        .find(|k| *k == found)
}

#[test]
fn a_busy_polled_qp_whose_cq_nobody_polls_still_receives() {
    let mut a = End::new(None, None);
    let mut b = busy_end();
    let (sink, _) = b.mr(
        64 << 10,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        0,
    );
    let (rbuf, _) = b.mr(4096, AccessFlags::LOCAL_WRITE, 0);
    b.qp.post_recv(&RecvWr {
        wr_id: 9,
        sgl: SgList::single(rbuf.sge(0, 4096).unwrap()),
    })
    .unwrap();
    connect(&mut a, &mut b, &ConnectOptions::default());
    let (src, data) = a.mr(64 << 10, AccessFlags::NONE, 11);
    // A 64 KiB Write (several FPDUs), then a Send; b never polls its CQs from here on (as
    // the passive side of ib_write_bw, or ib_write_lat spinning on its buffer).
    a.qp.post_send(&send_wr(
        1,
        SendOp::Write {
            remote_addr: sink.addr(),
            rkey: sink.rkey(),
        },
        Payload::Sgl(SgList::single(src.sge(0, 64 << 10).unwrap())),
    ))
    .unwrap();
    a.qp.post_send(&send_wr(
        2,
        send_op(false, None),
        Payload::Sgl(SgList::single(src.sge(0, 4096).unwrap())),
    ))
    .unwrap();
    assert_eq!(wait_wcs(&a.scq, 2).len(), 2);
    // Looked at without polling (a poll of the empty CQ would itself read the socket):
    // the Write's bytes land and the Send's completion is queued, by the progress thread.
    let deadline = Instant::now() + WAIT;
    while b.rcq.is_empty() || sink.to_vec().unwrap() != data {
        assert!(
            Instant::now() < deadline,
            "nothing read within {WAIT:?} while nobody polled (rx_by {:?})",
            qp_detail(&b, "rx_by")
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(rbuf.to_vec().unwrap(), data[..4096]);
    assert_eq!(qp_detail(&b, "rx_by").as_deref(), Some("progress"));
    let (took, _) = rx_takeover(&b).expect("no rx_takeover detail");
    assert!(took >= 1);
    let mut wc = [EMPTY_COMPLETION; 1];
    assert_eq!(b.rcq.poll(&mut wc).unwrap(), 1);
    assert_eq!(
        (wc[0].wr_id, wc[0].status, wc[0].byte_len),
        (9, WcStatus::Success, 4096)
    );

    // b polls again: once its polls read the Sends before the progress thread does, the
    // progress thread hands the socket back to them (bounded: at most 2000 Sends).
    let mut sent = 0;
    while qp_detail(&b, "rx_by").as_deref() != Some("polls") {
        assert!(
            sent < 2000,
            "still read by the progress thread after {sent} Sends"
        );
        b.qp.post_recv(&RecvWr {
            wr_id: 10,
            sgl: SgList::single(rbuf.sge(0, 64).unwrap()),
        })
        .unwrap();
        a.qp.post_send(&send_wr(
            3,
            send_op(false, None),
            Payload::Sgl(SgList::single(src.sge(0, 64).unwrap())),
        ))
        .unwrap();
        assert_eq!(busy_wait(&b.rcq).wr_id, 10);
        assert_eq!(busy_wait(&a.scq).wr_id, 3);
        sent += 1;
    }
    let (took, back) = rx_takeover(&b).unwrap();
    assert!(
        back >= 1 && back <= took,
        "took over {took}, handed back {back}"
    );
}

/// `e`'s QP's receive take-over statistics (its `rx_takeover` detail): times the progress
/// thread took the reading over, times it handed it back to the polls.
fn rx_takeover(e: &End) -> Option<(u64, u64)> {
    two_counts(e, "rx_takeover", "took_over=", "handed_back=")
}
