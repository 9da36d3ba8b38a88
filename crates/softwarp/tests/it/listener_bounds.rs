//! The blocking `Listener` under peers that never finish their MPA Request: their Requests
//! are read side by side with everyone else's, so a good client is answered as soon as its
//! own Request is in, and a full listener closes the connection that has waited longest
//! (after a second) for one waiting in the kernel's queue. Before, the listener read one
//! connection at a time: each silent peer held it for its whole MPA timeout.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::util::*;
use softwarp::*;

/// The MPA timeout the listener's peers get: long, so that waiting for one shows.
const MPA_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects a good client to `addr` and checks a Send arrives at `server` over the
/// connection `accept` gives it; returns how long the client's connect took.
fn good_client_is_served(l: &Listener, server: &End) -> Duration {
    let addr = l.local_addr().unwrap();
    let opts = ConnectOptions::default().timeout(MPA_TIMEOUT);
    let (inbox, _) = server.mr(64, AccessFlags::LOCAL_WRITE, 0);
    server
        .qp
        .post_recv(&RecvWr {
            wr_id: 1,
            sgl: sgl(&inbox, 0, 64, 1),
        })
        .unwrap();
    let client = End::new(None, None);
    let started = Instant::now();
    let took = std::thread::scope(|s| {
        let h = s.spawn(|| l.accept_timeout(&server.qp, &opts, WAIT));
        client.qp.connect(addr, &opts).unwrap();
        let took = started.elapsed();
        h.join().unwrap().unwrap();
        took
    });
    client
        .qp
        .post_send(&send_wr(
            2,
            send_op(false, None),
            Payload::Inline(b"served"),
        ))
        .unwrap();
    let wc = wait_wcs(&server.rcq, 1);
    assert_eq!((wc[0].status, wc[0].byte_len), (WcStatus::Success, 6));
    assert_eq!(&inbox.to_vec().unwrap()[..6], b"served");
    took
}

#[test]
fn peers_that_never_finish_their_request_do_not_hold_up_a_good_client() {
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    // 30 silent connections and 10 that send half an MPA Request, all before the client.
    let mut bad = Vec::new();
    for i in 0..40 {
        let mut s = TcpStream::connect(addr).unwrap();
        if i % 4 == 3 {
            s.write_all(b"MPA ID Req").unwrap();
        }
        bad.push(s);
    }
    let server = End::new(None, None);
    let took = good_client_is_served(&l, &server);
    println!(
        "the good client behind 40 stalled peers connected in {took:?} (their MPA timeout: {MPA_TIMEOUT:?})"
    );
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert_eq!(l.pending(), 40, "the stalled peers are still held");
    // Their time runs out: each later call reports one of them.
    drop(bad);
    let spare = End::new(None, None);
    let r = l.accept_timeout(&spare.qp, &ConnectOptions::default(), WAIT);
    assert!(
        matches!(r, Err(Error::Mpa(MpaError::Closed))),
        "the first stalled peer closed: {r:?}"
    );
    assert_eq!(spare.qp.state(), QpState::Idle);
    assert_eq!(l.pending(), 39);
}

#[test]
fn a_full_listener_closes_its_oldest_stalled_peer_for_a_waiting_client() {
    let l = Listener::bind_backlog("127.0.0.1:0", 2).unwrap();
    let addr = l.local_addr().unwrap();
    let server = End::new(None, None);
    let opts = ConnectOptions::default().timeout(MPA_TIMEOUT);
    // The listener takes two silent peers and is full; an accept with a short wait returns.
    let _silent: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let r = l.accept_timeout(&server.qp, &opts, Duration::from_millis(300));
    assert!(matches!(r, Err(Error::Timeout(_))), "{r:?}");
    assert_eq!(l.pending(), 2);
    let took = good_client_is_served(&l, &server);
    println!("a good client at a listener full of silent peers connected in {took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert_eq!(l.pending(), 1, "one silent peer was closed to make room");
}

/// CPU time this thread has used (`/proc/thread-self/schedstat`, nanoseconds on CPU).
fn thread_cpu() -> Duration {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
    Duration::from_nanos(s.split_whitespace().next().unwrap().parse().unwrap())
}

/// A full listener whose oldest silent peer may be closed, with nobody waiting in the
/// kernel's queue, sleeps until something happens instead of spinning.
#[test]
fn a_full_listener_with_nobody_waiting_sleeps() {
    let l = Listener::bind_backlog("127.0.0.1:0", 1).unwrap();
    let addr = l.local_addr().unwrap();
    let server = End::new(None, None);
    let opts = ConnectOptions::default().timeout(MPA_TIMEOUT);
    let _silent = TcpStream::connect(addr).unwrap();
    let r = l.accept_timeout(&server.qp, &opts, Duration::from_millis(200));
    assert!(matches!(r, Err(Error::Timeout(_))), "{r:?}");
    assert_eq!(l.pending(), 1);
    // The silent peer is now old enough to be closed for a newcomer; none comes.
    std::thread::sleep(Duration::from_millis(1100));
    let cpu = thread_cpu();
    let r = l.accept_timeout(&server.qp, &opts, Duration::from_millis(500));
    let used = thread_cpu() - cpu;
    assert!(matches!(r, Err(Error::Timeout(_))), "{r:?}");
    println!("a 500 ms accept on a full listener used {used:?} of CPU");
    assert!(used < Duration::from_millis(100), "{used:?}");
    assert_eq!(l.pending(), 1, "nothing to make room for");
}
