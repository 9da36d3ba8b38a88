//! Latency of a stream used by two threads at once: one writes timestamped 16-byte messages
//! (one every `GAP_US` microseconds), another reads their echo, and a server thread echoes;
//! the same over kernel TCP in the same run. A program with a reading and a writing thread
//! on one socket is the case where one thread's call takes the completion another thread
//! waits for (see DESIGN.md, "Decisions: extended sockets").
//!
//! ```text
//! cargo run --release -p softwarp-sockets --example split_echo [N] [GAP_US] [tcp]
//! ```
//!
//! Prints, for iWARP and TCP: the median, 99th percentile and largest round trip in
//! microseconds, and how many took over 1, 5 and 15 ms. N (default 2000) is the number of
//! messages; GAP_US defaults to 200. With `tcp` only the `std::net` run, for the preload
//! library (`SOFTWARP_SOCKETS=all LD_PRELOAD=libsoftwarp_preload.so`, which makes it iWARP).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use softwarp_sockets::{IwarpListener, IwarpStream};

/// A stream both threads may hold a handle of.
trait Split: Read + Write + Send + 'static {
    fn handle(&self) -> Self;
}

impl Split for IwarpStream {
    fn handle(&self) -> Self {
        self.try_clone().expect("try_clone")
    }
}

impl Split for TcpStream {
    fn handle(&self) -> Self {
        self.try_clone().expect("try_clone")
    }
}

/// `c` against the server end that `accept` gives on the echo thread (over the preload
/// library an accepted connection runs its MPA exchange at its first read).
fn run<T: Split>(
    c: impl FnOnce() -> T,
    accept: impl FnOnce() -> T + Send + 'static,
    what: &str,
    n: usize,
    gap: Duration,
) {
    let echo = std::thread::spawn(move || {
        let mut s = accept();
        let mut buf = [0u8; 16];
        for _ in 0..n {
            s.read_exact(&mut buf).unwrap();
            s.write_all(&buf).unwrap();
        }
    });
    let c = c();
    let start = Instant::now();
    let mut w = c.handle();
    let writer = std::thread::spawn(move || {
        for _ in 0..n {
            let mut m = [0u8; 16];
            let t = start.elapsed().as_nanos() as u64;
            m[..8].copy_from_slice(&t.to_le_bytes());
            w.write_all(&m).unwrap();
            std::thread::sleep(gap);
        }
    });
    let mut c = c;
    let mut lat = Vec::with_capacity(n);
    let mut buf = [0u8; 16];
    for _ in 0..n {
        c.read_exact(&mut buf).unwrap();
        let mut t = [0u8; 8];
        t.copy_from_slice(&buf[..8]);
        let sent = u64::from_le_bytes(t);
        lat.push((start.elapsed().as_nanos() as u64).saturating_sub(sent));
    }
    writer.join().unwrap();
    echo.join().unwrap();
    lat.sort_unstable();
    let over = |ms: u64| lat.iter().filter(|l| **l > ms * 1_000_000).count();
    println!(
        "{what:5} n={n} median={} p99={} max={} us; over 1 ms: {}, 5 ms: {}, 15 ms: {}",
        lat[n / 2] / 1000,
        lat[n * 99 / 100] / 1000,
        lat[n - 1] / 1000,
        over(1),
        over(5),
        over(15)
    );
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map_or(2000, |a| a.parse().expect("N"));
    let gap = Duration::from_micros(args.next().map_or(200, |a| a.parse().expect("GAP_US")));
    assert!(n > 0, "N must be positive");
    let tcp_only = args.next().is_some_and(|a| a == "tcp");

    if !tcp_only {
        native(n, gap);
    }
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let accept = move || {
        let s = l.accept().unwrap().0;
        s.set_nodelay(true).unwrap();
        s
    };
    let connect = move || {
        let c = TcpStream::connect(addr).unwrap();
        c.set_nodelay(true).unwrap();
        c
    };
    run(connect, accept, "tcp", n, gap);
}

fn native(n: usize, gap: Duration) {
    let l = IwarpListener::bind_iwarp("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let accept = move || l.accept().unwrap().0;
    let connect = move || IwarpStream::connect_iwarp(addr).unwrap();
    run(connect, accept, "iwarp", n, gap);
}
