//! `Device::close` racing with 8 threads posting and polling (issue 16): four connected QPs
//! on the closing device, each with a thread posting RDMA Writes and Reads as fast as it can and a
//! thread polling its send CQ, while the main thread closes the device after a few
//! milliseconds. Every work request that `post_send` accepted must complete exactly once
//! (success, or a flush if the close caught it), none may complete that was not accepted,
//! posts after the close fail with `Error::DeviceClosed`, and nothing hangs (every loop is
//! bounded in time). Memory safety: the close path has no `unsafe`; the objects the
//! threads still hold stay valid (they keep the device's state alive).
//!
//! Rounds: 3 in `cargo test` (about a second); `SOFTWARP_SOAK_SECS=N` repeats rounds for N
//! seconds.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use crate::util::*;
use softwarp::*;

const QPS: usize = 4;
/// Bytes per RDMA Write and Read. Reads complete only when their response arrives, so some
/// work is always outstanding when the close comes (it flushes those).
const LEN: usize = 4096;
/// Most posts per thread per round (a bound besides the close).
const MAX_POSTS: u64 = 200_000;

struct Side {
    qp: QueuePair,
    cq: CompletionQueue,
}

/// One round: returns (accepted, completed with success, flushed).
fn round(seed: u64) -> (usize, usize, usize) {
    opt_in_ras();
    let dev = Device::open_default().unwrap();
    let peer_dev = Device::open_default().unwrap();
    let pd = dev.alloc_pd().unwrap();
    let peer_pd = peer_dev.alloc_pd().unwrap();
    let src = pd.reg_mr(LEN, AccessFlags::LOCAL_WRITE).unwrap();
    let mut sides = Vec::new();
    let mut peers = Vec::new();
    let mut sinks = Vec::new();
    for _ in 0..QPS {
        let cq = dev.create_cq(1024, None).unwrap();
        let mut attr = QpInitAttr::new(&cq, &cq);
        attr.cap.max_send_wr = 64;
        let qp = pd.create_qp(&attr).unwrap();
        let pcq = peer_dev.create_cq(64, None).unwrap();
        let pqp = peer_pd.create_qp(&QpInitAttr::new(&pcq, &pcq)).unwrap();
        let sink = peer_pd
            .reg_mr(
                LEN,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            )
            .unwrap();
        let l = Listener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let opts = ConnectOptions::default();
        std::thread::scope(|s| {
            let h = s.spawn(|| l.accept_timeout(&pqp, &opts, WAIT).unwrap());
            qp.connect(addr, &opts).unwrap();
            h.join().unwrap();
        });
        sides.push(Side { qp, cq });
        peers.push((pqp, pcq));
        sinks.push(sink);
    }
    let deadline = Instant::now() + WAIT;
    let start = Barrier::new(2 * QPS + 1);
    let posting_done: Vec<AtomicBool> = (0..QPS).map(|_| AtomicBool::new(false)).collect();
    let (accepted, completions) = std::thread::scope(|s| {
        let mut posters = Vec::new();
        let mut pollers = Vec::new();
        for (i, side) in sides.iter().enumerate() {
            let (start, done, sink) = (&start, &posting_done[i], &sinks[i]);
            let src = &src;
            posters.push(s.spawn(move || {
                start.wait();
                let mut accepted = Vec::new();
                for id in 0..MAX_POSTS {
                    // Writes and Reads alternate (the Reads land in `src`, which nothing
                    // checks: the test is about completions).
                    let (remote_addr, rkey) = (sink.addr(), sink.rkey());
                    let op = if id % 2 == 0 {
                        SendOp::Write { remote_addr, rkey }
                    } else {
                        SendOp::Read { remote_addr, rkey }
                    };
                    let wr = SendWr {
                        wr_id: id,
                        op,
                        payload: Payload::Sgl(SgList::single(src.sge(0, LEN as u32).unwrap())),
                        signaled: true,
                        fence: false,
                    };
                    loop {
                        assert!(Instant::now() < deadline, "poster {i} did not finish");
                        match side.qp.post_send(&wr) {
                            Ok(()) => {
                                accepted.push(id);
                                break;
                            }
                            Err(Error::Qp(_)) => std::thread::yield_now(), // queue full
                            Err(Error::DeviceClosed) => {
                                done.store(true, Ordering::Release);
                                return accepted;
                            }
                            Err(e) => panic!("post {id} on QP {i}: {e}"),
                        }
                    }
                }
                done.store(true, Ordering::Release);
                accepted
            }));
            pollers.push(s.spawn(move || {
                start.wait();
                let mut got: Vec<WorkCompletion> = Vec::new();
                let mut wcs = [EMPTY_COMPLETION; 32];
                let mut idle_after_done = 0u32;
                loop {
                    assert!(Instant::now() < deadline, "poller {i} did not finish");
                    let n = side.cq.poll(&mut wcs).unwrap();
                    got.extend_from_slice(&wcs[..n]);
                    if n == 0 {
                        if done.load(Ordering::Acquire) {
                            // The poster stopped; the close flushed the rest into the CQ
                            // (synchronously, before `close` returned). A few empty polls
                            // after that mean everything is in.
                            idle_after_done += 1;
                            if idle_after_done > 200 {
                                return got;
                            }
                            std::thread::sleep(Duration::from_micros(200));
                        } else {
                            std::thread::yield_now();
                        }
                    }
                }
            }));
        }
        start.wait();
        // Let the threads get going, then close under them.
        std::thread::sleep(Duration::from_millis(5 + seed % 20));
        let closer = dev.clone();
        match closer.close(Duration::from_secs(5)) {
            Ok(()) => {}
            Err(e) => panic!("close: {e}"),
        }
        // Posts after the close are refused at once.
        let wr = SendWr {
            wr_id: u64::MAX,
            op: SendOp::Write {
                remote_addr: sinks[0].addr(),
                rkey: sinks[0].rkey(),
            },
            payload: Payload::Inline(b"late"),
            signaled: true,
            fence: false,
        };
        assert!(matches!(
            sides[0].qp.post_send(&wr),
            Err(Error::DeviceClosed)
        ));
        let accepted: Vec<Vec<u64>> = posters.into_iter().map(|h| h.join().unwrap()).collect();
        let completions: Vec<Vec<WorkCompletion>> =
            pollers.into_iter().map(|h| h.join().unwrap()).collect();
        (accepted, completions)
    });
    let (mut total, mut ok, mut flushed) = (0, 0, 0);
    for (i, (acc, wcs)) in accepted.iter().zip(&completions).enumerate() {
        let mut seen: HashMap<u64, usize> = HashMap::new();
        for wc in wcs {
            assert!(
                matches!(wc.status, WcStatus::Success | WcStatus::WrFlushErr),
                "QP {i}: {wc:?}"
            );
            *seen.entry(wc.wr_id).or_default() += 1;
            match wc.status {
                WcStatus::Success => ok += 1,
                _ => flushed += 1,
            }
        }
        for id in acc {
            assert_eq!(
                seen.remove(id),
                Some(1),
                "QP {i}: accepted WR {id} did not complete exactly once"
            );
        }
        assert!(
            seen.is_empty(),
            "QP {i}: completions of WRs never accepted: {seen:?}"
        );
        total += acc.len();
    }
    // New objects cannot be made on a closed device.
    assert!(matches!(
        pd.reg_mr(64, AccessFlags::NONE),
        Err(Error::DeviceClosed)
    ));
    drop(sides);
    drop(peers);
    drop(sinks);
    (total, ok, flushed)
}

#[test]
fn close_racing_eight_posting_and_polling_threads_completes_every_wr_exactly_once() {
    let soak = std::env::var("SOFTWARP_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_secs);
    let t0 = Instant::now();
    let mut rounds = 0u64;
    let mut all_flushed = 0;
    loop {
        let (total, ok, flushed) = round(rounds.wrapping_mul(7919).wrapping_add(3));
        println!("round {rounds}: {total} WRs accepted, {ok} completed, {flushed} flushed");
        assert_eq!(total, ok + flushed);
        all_flushed += flushed;
        rounds += 1;
        let more = match soak {
            Some(d) => t0.elapsed() < d,
            None => rounds < 3,
        };
        if !more {
            break;
        }
    }
    println!("{rounds} rounds in {:?}", t0.elapsed());
    // The close caught work in flight (the sockets were full): the flush path ran.
    assert!(
        all_flushed > 0,
        "no work request was in flight at any close"
    );
}
