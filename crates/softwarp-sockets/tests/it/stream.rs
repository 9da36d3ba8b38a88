//! The Rust API end to end on loopback: both ends in this process, each on its own thread.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use softwarp_sockets::{
    IwarpListener, IwarpOptions, IwarpStream, Socket, SOL_SOFTWARP, SO_IWARP_ACTIVE, SO_IWARP_MODE,
};

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// An iWARP-mode pair: (client, server).
fn pair_with(opts: IwarpOptions) -> (IwarpStream, IwarpStream) {
    let l = IwarpListener::bind_with("127.0.0.1:0", opts.clone()).unwrap();
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || l.accept().unwrap().0);
    let c = IwarpStream::connect_with(addr, &opts).unwrap();
    let s = t.join().unwrap();
    assert!(c.is_iwarp() && s.is_iwarp());
    (c, s)
}

fn pair() -> (IwarpStream, IwarpStream) {
    pair_with(IwarpOptions::default())
}

/// Writes `data` in chunks of `chunk` and then shuts the writing side down.
fn send_all(s: &IwarpStream, data: &[u8], chunk: usize) {
    let mut w = s;
    for c in data.chunks(chunk) {
        w.write_all(c).unwrap();
    }
    s.shutdown(Shutdown::Write).unwrap();
}

/// Reads to EOF in reads of at most `chunk` bytes.
fn recv_all(s: &IwarpStream, chunk: usize, limit: usize) -> Vec<u8> {
    let mut r = s;
    let mut out = Vec::new();
    let mut buf = vec![0u8; chunk];
    loop {
        let n = r.read(&mut buf).unwrap();
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&buf[..n]);
        assert!(out.len() <= limit, "more bytes than were sent");
    }
}

#[test]
fn large_transfers_both_ways_at_once_arrive_intact() {
    let (c, s) = pair();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let len = 8 << 20;
    let up = pattern(len, 1);
    let down = pattern(len + 12345, 2);
    let t0 = Instant::now();
    thread::scope(|sc| {
        let (c2, s2) = (c.clone(), s.clone());
        let (up2, down2) = (&up, &down);
        sc.spawn(move || send_all(&c2, up2, 100_000));
        sc.spawn(move || send_all(&s2, down2, 7_777));
        let got_up = sc.spawn(|| recv_all(&s, 65536, len));
        let got_down = recv_all(&c, 3000, len + 12345);
        let got_up = got_up.join().unwrap();
        assert_eq!(got_up.len(), up.len());
        assert_eq!(crc32c::crc32c(&got_up), crc32c::crc32c(&up));
        assert_eq!(got_down.len(), down.len());
        assert_eq!(crc32c::crc32c(&got_down), crc32c::crc32c(&down));
    });
    let st = c.qp_stats().unwrap();
    assert!(
        st.tx.send.bytes >= len as u64,
        "the bytes went as iWARP Sends: {st:?}"
    );
    eprintln!(
        "2 x {} MiB both ways in {:?}; client sent {} Sends",
        len >> 20,
        t0.elapsed(),
        st.tx.send.messages
    );
}

#[test]
fn one_byte_writes_keep_order_and_small_slots_exercise_credits() {
    // 4 slots of 64 bytes: credits run out every few messages.
    let opts = IwarpOptions {
        recv_slots: 4,
        send_slots: 2,
        slot_size: 64,
        ..IwarpOptions::default()
    };
    let (c, s) = pair_with(opts);
    let data = pattern(3000, 3);
    thread::scope(|sc| {
        sc.spawn(|| send_all(&c, &data, 1));
        let got = recv_all(&s, 1, data.len());
        assert_eq!(got, data);
    });
    // Grant messages flowed back: the client sent about one message per byte.
    let st = c.qp_stats().unwrap();
    assert!(st.tx.send.messages >= 3000, "{st:?}");
}

#[test]
fn shutdown_gives_eof_after_the_bytes_and_the_other_direction_goes_on() {
    let (c, s) = pair();
    (&c).write_all(b"request").unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    let got = recv_all(&s, 3, 100);
    assert_eq!(got, b"request");
    // EOF again on later reads.
    assert_eq!((&s).read(&mut [0u8; 8]).unwrap(), 0);
    // Writing after shutdown fails; the server may still answer.
    assert_eq!((&c).write(b"x").unwrap_err().kind(), ErrorKind::BrokenPipe);
    (&s).write_all(b"response").unwrap();
    drop(s);
    let got = recv_all(&c, 100, 100);
    assert_eq!(got, b"response");
}

#[test]
fn dropping_a_stream_delivers_its_bytes_then_eof() {
    let (c, s) = pair();
    let data = pattern(1 << 20, 4);
    let d2 = data.clone();
    let writer = thread::spawn(move || {
        (&c).write_all(&d2).unwrap();
        // No shutdown: the drop ends the stream.
        drop(c);
    });
    let got = recv_all(&s, 10_000, data.len());
    writer.join().unwrap();
    assert_eq!(got.len(), data.len());
    assert_eq!(crc32c::crc32c(&got), crc32c::crc32c(&data));
}

#[test]
fn nonblocking_reads_and_writes_return_would_block_and_resume() {
    let (c, s) = pair();
    s.set_nonblocking(true).unwrap();
    c.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 100];
    assert_eq!(
        (&s).read(&mut buf).unwrap_err().kind(),
        ErrorKind::WouldBlock
    );
    // Fill the peer's slots: the writer runs out of credits.
    let chunk = vec![7u8; 64 * 1024];
    let mut written = 0usize;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match (&c).write(&chunk) {
            Ok(n) => written += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => panic!("{e}"),
        }
        assert!(Instant::now() < deadline, "never blocked");
    }
    // 16 slots of 32 KiB less headers, one credit kept for grants.
    assert!(
        written > 0 && written < 16 * 32 * 1024,
        "{written} bytes accepted before WouldBlock"
    );
    assert!(!c.poll_ready().writable);
    // The reader drains; the writer may write again.
    let mut got = 0usize;
    let mut rbuf = vec![0u8; 50_000];
    while got < written {
        match (&s).read(&mut rbuf) {
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => thread::sleep(Duration::from_millis(1)),
            Err(e) => panic!("{e}"),
        }
        assert!(
            Instant::now() < deadline,
            "reader stalled at {got}/{written}"
        );
    }
    assert_eq!(got, written);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !c.poll_ready().writable {
        assert!(Instant::now() < deadline, "credits never came back");
        thread::sleep(Duration::from_millis(1));
    }
    assert!((&c).write(&chunk).unwrap() > 0);
}

#[test]
fn read_timeout_expires_with_would_block() {
    let (_c, s) = pair();
    s.set_read_timeout(Some(Duration::from_millis(150)))
        .unwrap();
    let t0 = Instant::now();
    let e = (&s).read(&mut [0u8; 4]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::WouldBlock);
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(140) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert!(s.set_read_timeout(Some(Duration::ZERO)).is_err());
}

#[test]
fn socket_option_switches_iwarp_mode_before_listen_and_connect() {
    let mut ls = Socket::new(socket2::Domain::IPV4).unwrap();
    assert_eq!(ls.option(SOL_SOFTWARP, SO_IWARP_MODE).unwrap(), 0);
    ls.set_option(SOL_SOFTWARP, SO_IWARP_MODE, 1).unwrap();
    assert_eq!(ls.option(SOL_SOFTWARP, SO_IWARP_MODE).unwrap(), 1);
    assert!(ls.set_option(SOL_SOFTWARP, 999, 1).is_err());
    ls.bind(&"127.0.0.1:0".parse().unwrap()).unwrap();
    let l = ls.listen(8).unwrap();
    assert!(l.is_iwarp());
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || l.accept().unwrap());
    let mut cs = Socket::for_addr(&addr).unwrap();
    cs.set_option(SOL_SOFTWARP, SO_IWARP_MODE, 1).unwrap();
    let c = cs.connect(&addr).unwrap();
    let (s, peer) = t.join().unwrap();
    assert_eq!(c.option(SOL_SOFTWARP, SO_IWARP_ACTIVE).unwrap(), 1);
    assert_eq!(peer, c.local_addr().unwrap());
    assert_eq!(s.peer_addr().unwrap(), c.local_addr().unwrap());
    assert_eq!(c.peer_addr().unwrap(), addr);
    (&c).write_all(b"hi").unwrap();
    let mut b = [0u8; 2];
    (&s).read_exact(&mut b).unwrap();
    assert_eq!(&b, b"hi");
    // The descriptor is pollable and valid.
    assert!(std::os::fd::AsRawFd::as_raw_fd(&c) >= 0);
}

#[test]
fn without_the_option_the_same_types_are_plain_tcp() {
    let l = IwarpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || l.accept().unwrap().0);
    // A std client: the bytes are plain TCP.
    let mut c = TcpStream::connect(addr).unwrap();
    let s = t.join().unwrap();
    assert!(!s.is_iwarp());
    c.write_all(b"plain").unwrap();
    let mut b = [0u8; 5];
    (&s).read_exact(&mut b).unwrap();
    assert_eq!(&b, b"plain");
    assert!(s.expose(10, 0).is_err(), "one-sided needs iWARP mode");
}

/// A plain TCP client that connects first and says nothing does not hold up the iWARP
/// client behind it: the iWARP one is accepted at once, and the plain one is refused at
/// the next call, once its MPA timeout (300 ms here) ran out.
#[test]
fn an_iwarp_listener_refuses_a_plain_tcp_client_without_holding_up_an_iwarp_one() {
    let opts = IwarpOptions {
        connect_timeout: Duration::from_millis(300),
        ..IwarpOptions::default()
    };
    let l = IwarpListener::bind_with("127.0.0.1:0", opts.clone()).unwrap();
    let addr = l.local_addr().unwrap();
    let plain = TcpStream::connect(addr).unwrap();
    let t = thread::spawn(move || {
        let first = l.accept().map(|(s, _)| s);
        let held = l.pending();
        let second = l.accept().map(|_| ());
        (first, held, second)
    });
    let c = IwarpStream::connect_iwarp(addr).unwrap();
    let (first, held, second) = t.join().unwrap();
    let s = first.unwrap();
    assert_eq!(held, 1, "the plain client is still held");
    let e = second.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
    drop(plain);
    (&c).write_all(b"ok").unwrap();
    let mut b = [0u8; 2];
    (&s).read_exact(&mut b).unwrap();
    assert_eq!(&b, b"ok");
}

/// Peers that never finish their MPA Request (30 silent, 10 with half of one) do not hold
/// up a good client: a blocking accept waits for their Requests side by side. Before, each
/// held the accepting thread for its whole `connect_timeout`.
#[test]
fn stalled_peers_do_not_hold_up_a_good_client_at_an_iwarp_listener() {
    let l = IwarpListener::bind_iwarp("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let mut bad = Vec::new();
    for i in 0..40 {
        let mut s = TcpStream::connect(addr).unwrap();
        if i % 4 == 3 {
            s.write_all(b"MPA ID Req").unwrap();
        }
        bad.push(s);
    }
    let started = std::time::Instant::now();
    let t = thread::spawn(move || {
        let got = l.accept().map(|(s, _)| s);
        (got, l.pending())
    });
    let c = IwarpStream::connect_iwarp(addr).unwrap();
    let (got, held) = t.join().unwrap();
    let took = started.elapsed();
    let s = got.unwrap();
    println!("a good client behind 40 stalled peers accepted in {took:?} (their timeout: 5 s)");
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert_eq!(held, 40);
    (&c).write_all(b"ok").unwrap();
    let mut b = [0u8; 2];
    (&s).read_exact(&mut b).unwrap();
    assert_eq!(&b, b"ok");
    drop(bad);
}

#[test]
fn one_sided_write_and_read_reach_the_exposed_window() {
    let (c, s) = pair();
    let win = s.expose(100_000, 1 << 20).unwrap();
    assert_eq!(win.offset(), 1 << 20);
    c.wait_peer_window(1 << 20, 100_000, Duration::from_secs(5))
        .unwrap();
    let data = pattern(70_000, 5);
    c.write_remote_notify((1 << 20) + 1000, &data).unwrap();
    let (off, len) = s.recv_write_notice(Duration::from_secs(5)).unwrap();
    assert_eq!((off, len), ((1 << 20) + 1000, 70_000));
    let mut got = vec![0u8; data.len()];
    win.read_at(1000, &mut got).unwrap();
    assert_eq!(
        got, data,
        "the bytes are in the window, no receive involved"
    );
    // The server fills another part; the client reads it back one-sided.
    let back = pattern(90_000, 6);
    win.write_at(5000, &back).unwrap();
    let mut rb = vec![0u8; back.len()];
    c.read_remote((1 << 20) + 5000, &mut rb).unwrap();
    assert_eq!(rb, back);
    // Outside the window: refused locally, the connection stays up.
    let e = c.write_remote(0, b"nope").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    (&c).write_all(b"still a stream").unwrap();
    let mut b = [0u8; 14];
    (&s).read_exact(&mut b).unwrap();
    assert_eq!(&b, b"still a stream");
    let st = c.qp_stats().unwrap();
    assert!(
        st.tx.write.bytes >= 70_000 && st.tx.read_request.messages >= 1,
        "{st:?}"
    );
}

#[test]
fn handover_moves_an_established_tcp_connection_to_iwarp() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let server = thread::spawn(move || {
        let (mut t, _) = l.accept().unwrap();
        // The application's own protocol agrees to switch.
        let mut b = [0u8; 8];
        t.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"STARTRDM");
        t.write_all(b"OK").unwrap();
        let s = IwarpStream::handover(t, &IwarpOptions::default()).unwrap();
        let got = recv_all(&s, 50_000, 4 << 20);
        (&s).write_all(&crc32c::crc32c(&got).to_be_bytes()).unwrap();
        got.len()
    });
    let mut t = TcpStream::connect(addr).unwrap();
    t.write_all(b"STARTRDM").unwrap();
    let mut ok = [0u8; 2];
    t.read_exact(&mut ok).unwrap();
    let c = IwarpStream::from(t)
        .into_iwarp(&IwarpOptions::default())
        .unwrap();
    assert!(c.is_iwarp());
    let data = pattern(3 << 20, 7);
    send_all(&c, &data, 65536);
    let mut sum = [0u8; 4];
    (&c).read_exact(&mut sum).unwrap();
    assert_eq!(u32::from_be_bytes(sum), crc32c::crc32c(&data));
    assert_eq!(server.join().unwrap(), data.len());
    assert!(c.qp_stats().unwrap().tx.send.bytes >= data.len() as u64);
}

#[test]
fn shutdown_read_drops_later_bytes_without_stalling_the_writer() {
    let (c, s) = pair();
    s.shutdown(Shutdown::Read).unwrap();
    assert_eq!((&s).read(&mut [0u8; 4]).unwrap(), 0);
    // Far more than the receive ring holds: the writer never blocks for good while the
    // receiving end calls into its stream (here: readiness polls, as an event loop does).
    let data = vec![1u8; 4 << 20];
    let t0 = Instant::now();
    let done = std::sync::atomic::AtomicBool::new(false);
    thread::scope(|sc| {
        sc.spawn(|| {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                assert!(s.poll_ready().readable, "EOF after shutdown(Read)");
                assert!(t0.elapsed() < Duration::from_secs(20), "writer stalled");
                thread::sleep(Duration::from_millis(1));
            }
        });
        (&c).write_all(&data).unwrap();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    assert_eq!((&s).read(&mut [0u8; 4]).unwrap(), 0);
    // The other direction still works.
    (&s).write_all(b"still").unwrap();
    let mut b = [0u8; 5];
    (&c).read_exact(&mut b).unwrap();
    assert_eq!(&b, b"still");
}

#[test]
fn peek_copies_without_consuming_and_waitall_waits_for_the_rest() {
    let (c, s) = pair();
    (&s).write_all(b"hello").unwrap();
    let mut buf = [0u8; 16];
    // Blocking peek: the bytes, still there afterwards.
    assert_eq!(c.peek_with(&mut buf[..3], false, false).unwrap(), 3);
    assert_eq!(&buf[..3], b"hel");
    // Not all 16 are there: a non-blocking peek of all says WouldBlock.
    let e = c.peek_with(&mut buf, true, true).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::WouldBlock);
    s.shutdown(Shutdown::Write).unwrap();
    // At the end of the stream, peeking all gives what there is.
    let deadline = Instant::now() + Duration::from_secs(10);
    let n = loop {
        match c.peek_with(&mut buf, true, true) {
            Ok(n) => break n,
            Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(&buf[..n], b"hello");
    let mut r = &c;
    assert_eq!(r.read(&mut buf).unwrap(), 5);
    assert_eq!(r.read(&mut buf).unwrap(), 0, "EOF after the peeked bytes");
}

/// Whether `fd` is readable now (a poll without waiting).
fn readable_now(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    let mut fds = [rustix::event::PollFd::new(
        &fd,
        rustix::event::PollFlags::IN,
    )];
    let zero = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    rustix::event::poll(&mut fds, Some(&zero)).unwrap() == 1
}

/// Polls `ready` every millisecond until it says yes (at most 10 s).
fn until_within_10s(mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ready() {
        assert!(Instant::now() < deadline, "not within 10 s");
        thread::sleep(Duration::from_millis(1));
    }
}

/// An event loop's thread waits on the stream's descriptor with a `StreamWaiter`; another
/// thread's call that takes its completion (here `poll_ready`) kicks it, one unit for one
/// waiter. The waiter's own look never kicks itself.
#[test]
fn a_waiter_is_kicked_by_another_threads_look_and_never_by_its_own() {
    let (c, mut s) = pair();
    let w = c.waiter().expect("an iWARP stream has waiters");
    assert!(!w.arm_readiness().readable);
    assert!(!readable_now(w.kick_fd()));
    s.write_all(b"one").unwrap();
    until_within_10s(|| c.poll_ready().readable);
    assert!(
        readable_now(w.kick_fd()),
        "another thread's look took the event: kicked"
    );
    w.take_kick();
    assert!(!readable_now(w.kick_fd()), "one unit for one waiter");
    let mut buf = [0u8; 3];
    (&c).read_exact(&mut buf).unwrap();
    // Now the waiter's own look takes the next event.
    assert!(!w.arm_readiness().readable);
    s.write_all(b"two").unwrap();
    until_within_10s(|| w.arm_readiness().readable);
    assert!(
        !readable_now(w.kick_fd()),
        "its own look does not kick the waiter"
    );
    drop(w);
    // No waiter: nobody is kicked.
    (&c).read_exact(&mut buf).unwrap();
    let w2 = c.waiter().unwrap();
    assert!(!w2.arm_readiness().readable);
    drop(w2);
    s.write_all(b"three").unwrap();
    until_within_10s(|| c.poll_ready().readable);
    let w3 = c.waiter().unwrap();
    assert!(
        !readable_now(w3.kick_fd()),
        "a waiter that left is not kicked"
    );
    let plain = TcpListener::bind("127.0.0.1:0").unwrap();
    let t = IwarpStream::connect(plain.local_addr().unwrap()).unwrap();
    assert!(t.waiter().is_none(), "plain TCP has no waiter");
}

/// Waits until `fd` is readable or `timeout` passes.
fn poll_in(fd: &impl std::os::fd::AsFd, timeout: Duration) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(fd, PollFlags::IN)];
    let ts = Timespec::try_from(timeout).unwrap();
    rustix::event::poll(&mut fds, Some(&ts)).unwrap() > 0
}

/// An event loop over a non-blocking iWARP listener: its descriptor wakes the loop for a
/// good client behind stalled peers (accepted at once), not for their half Requests (no
/// spinning), and again when each stalled peer's time runs out (one `TimedOut` per call).
#[test]
fn a_nonblocking_iwarp_listener_wakes_its_event_loop_for_requests_and_timeouts() {
    let opts = IwarpOptions {
        connect_timeout: Duration::from_millis(600),
        ..IwarpOptions::default()
    };
    let l = IwarpListener::bind_with("127.0.0.1:0", opts).unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap();
    let mut bad = Vec::new();
    for i in 0..8 {
        let mut s = TcpStream::connect(addr).unwrap();
        if i % 2 == 1 {
            s.write_all(b"MPA ID Req").unwrap();
        }
        bad.push(s);
    }
    let client = thread::spawn(move || {
        thread::sleep(Duration::from_millis(100));
        IwarpStream::connect_iwarp(addr).unwrap()
    });
    let started = Instant::now();
    let (mut good, mut timed_out, mut wakeups) = (None, 0, 0);
    while started.elapsed() < Duration::from_secs(10) && (good.is_none() || timed_out < 8) {
        if !poll_in(&l, Duration::from_secs(2)) {
            continue;
        }
        wakeups += 1;
        match l.accept() {
            Ok((s, _)) => good = Some((s, started.elapsed())),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == ErrorKind::TimedOut => timed_out += 1,
            Err(e) => panic!("{e}"),
        }
    }
    let (s, at) = good.expect("the good client was accepted");
    println!("good client accepted after {at:?}; {timed_out} stalled peers timed out; {wakeups} wake-ups");
    assert!(at < Duration::from_millis(550), "{at:?}");
    assert_eq!(timed_out, 8);
    assert!(wakeups < 60, "the loop spun: {wakeups} wake-ups");
    assert_eq!(l.pending(), 0);
    let c = client.join().unwrap();
    (&c).write_all(b"ok").unwrap();
    let mut b = [0u8; 2];
    (&s).read_exact(&mut b).unwrap();
    assert_eq!(&b, b"ok");
    drop(bad);
}

/// The MPA exchange as an event loop drives it (the preload library's path): each
/// `advance` returns at once, whatever the peer sent (nothing, one byte of a Request, or its
/// header without the private data), and fails with `TimedOut` once the connect timeout
/// passed; two handshakes advanced in turns (the initiator's started while its TCP connect
/// is still in progress) make a working pair.
#[test]
fn a_handshake_advances_without_waiting_and_fails_at_its_deadline() {
    use softwarp_sockets::{Handshake, Side};
    let opts = IwarpOptions {
        connect_timeout: Duration::from_millis(400),
        ..IwarpOptions::default()
    };
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let mut header = b"MPA ID Req Frame".to_vec();
    header.extend_from_slice(&[0x40, 1, 0, 100]);
    for sent in [&b""[..], &b"M"[..], &header[..]] {
        let mut peer = TcpStream::connect(addr).unwrap();
        peer.write_all(sent).unwrap();
        let (tcp, _) = l.accept().unwrap();
        let mut h = Handshake::start(tcp, Side::Responder, &opts).unwrap();
        assert!(!h.wants_write());
        let t0 = Instant::now();
        let mut calls = 0;
        let err = loop {
            let t = Instant::now();
            let r = h.advance();
            assert!(
                t.elapsed() < Duration::from_millis(50),
                "{sent:?}: advance waited"
            );
            calls += 1;
            match r {
                Ok(None) => thread::sleep(Duration::from_millis(5)),
                Ok(Some(_)) => panic!("{sent:?}: established without a Request"),
                Err(e) => break e,
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "{sent:?}: never failed"
            );
        };
        assert_eq!(err.kind(), ErrorKind::TimedOut, "{sent:?}: {err}");
        let after = t0.elapsed();
        assert!(
            (Duration::from_millis(390)..Duration::from_secs(2)).contains(&after),
            "{sent:?}: failed after {after:?} ({calls} calls)"
        );
    }

    let client = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    client.set_nonblocking(true).unwrap();
    match client.connect(&addr.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INPROGRESS.raw_os_error()) => {}
        Err(e) => panic!("connect: {e}"),
    }
    let mut ini = Handshake::start(client.into(), Side::Initiator, &opts).unwrap();
    let (tcp, _) = l.accept().unwrap();
    let mut res = Handshake::start(tcp, Side::Responder, &opts).unwrap();
    let (mut a, mut b) = (None, None);
    let t0 = Instant::now();
    while a.is_none() || b.is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the pair never connected"
        );
        if a.is_none() {
            a = ini.advance().unwrap();
        }
        if b.is_none() {
            b = res.advance().unwrap();
        }
        thread::sleep(Duration::from_millis(1));
    }
    let (mut a, mut b) = (a.unwrap(), b.unwrap());
    assert!(a.is_iwarp() && b.is_iwarp());
    a.write_all(b"over iWARP").unwrap();
    let mut got = [0u8; 10];
    b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    b.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"over iWARP");
}
