//! 8-byte ping-pong latency over loopback TCP, four ways of moving the bytes.
//!
//! The client sends its iteration number (8 bytes), the server echoes it, the client checks
//! it. Every client iteration is timed; the result is the median iteration's half round trip
//! plus the CPU time of the whole process (both ends) per round trip.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::thread;
use std::time::{Duration, Instant};

use io_uring::IoUring;

use crate::common::{median, pause, process_cpu_seconds, protocol_error, tcp_pair};
use crate::ring::{Buffers, Reap, RingEnd};

pub const MSG: usize = 8;
const SEND: u64 = 1;
const RECV: u64 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// (a) non-blocking send/recv, the receiver spins on recv until its 8 bytes are there.
    Plain,
    /// (a2) blocking send/recv: the receiver sleeps in recv (the like-for-like of (b)).
    PlainBlocking,
    /// (b) io_uring SEND/RECV, one submit_and_wait(1) per operation (sleeps in the kernel).
    UringWait,
    /// (c) io_uring WRITE_FIXED/READ_FIXED on a registered file and buffer; send and the
    ///     next receive submitted together, completions found by spinning on the CQ ring.
    UringPeek,
    /// (c2) as (c) on a COOP_TASKRUN | TASKRUN_FLAG ring: no IPI to the spinner when a
    ///      receive becomes ready; it sees IORING_SQ_TASKRUN and enters the kernel for it.
    UringPeekTaskrun,
    /// (d) as (c) with IORING_SETUP_SQPOLL: a kernel thread (one, shared by both rings
    ///     through IORING_SETUP_ATTACH_WQ) polls the SQ, so steady state has no system call.
    UringSqpoll,
}

impl Variant {
    pub const ALL: [Variant; 6] = [
        Variant::Plain,
        Variant::PlainBlocking,
        Variant::UringWait,
        Variant::UringPeek,
        Variant::UringPeekTaskrun,
        Variant::UringSqpoll,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Variant::Plain => "(a) plain send/recv, non-blocking, busy poll",
            Variant::PlainBlocking => "(a2) plain send/recv, blocking (sleeps in recv)",
            Variant::UringWait => "(b) io_uring send/recv, submit_and_wait per op",
            Variant::UringPeek => "(c) io_uring fixed file+buf, submit, spin on CQ",
            Variant::UringPeekTaskrun => "(c2) as (c), COOP_TASKRUN+TASKRUN_FLAG",
            Variant::UringSqpoll => "(d) io_uring SQPOLL (1 shared kthread), spin on CQ",
        }
    }
}

/// One run: the median half round trip and the CPU per round trip (both ends).
pub struct Sample {
    pub half_rtt_us: f64,
    /// Mean and 99th percentile of the half round trips (the median hides a long tail).
    pub mean_us: f64,
    pub p99_us: f64,
    /// Timed iterations (fewer than asked when the run hit `RUN_CAP`).
    pub iters: usize,
    pub cpu_us_per_rt: f64,
}

/// Idle time of the SQPOLL kernel thread before it sleeps (ms): longer than any run.
const SQPOLL_IDLE_MS: u32 = 2000;

pub fn run(variant: Variant, warmup: usize, iters: usize) -> io::Result<Sample> {
    let (client, server) = tcp_pair()?;
    let (server_end, client_end) = match variant {
        Variant::Plain => {
            client.set_nonblocking(true)?;
            server.set_nonblocking(true)?;
            (None, None)
        }
        // Blocking sockets: the same loops never see WouldBlock, they sleep in the kernel.
        Variant::PlainBlocking => (None, None),
        Variant::UringWait | Variant::UringPeek => {
            let (wait, bufs) = if variant == Variant::UringWait {
                (Reap::SubmitAndWait, Buffers::Plain)
            } else {
                (Reap::Peek, Buffers::Registered)
            };
            let s = RingEnd::new(IoUring::new(64)?, server.as_raw_fd(), wait, bufs, 2 * MSG)?;
            let c = RingEnd::new(IoUring::new(64)?, client.as_raw_fd(), wait, bufs, 2 * MSG)?;
            (Some(s), Some(c))
        }
        Variant::UringPeekTaskrun => {
            let ring = || {
                IoUring::builder()
                    .setup_coop_taskrun()
                    .setup_taskrun_flag()
                    .build(64)
            };
            let (w, b) = (Reap::PeekTaskrun, Buffers::Registered);
            let s = RingEnd::new(ring()?, server.as_raw_fd(), w, b, 2 * MSG)?;
            let c = RingEnd::new(ring()?, client.as_raw_fd(), w, b, 2 * MSG)?;
            (Some(s), Some(c))
        }
        Variant::UringSqpoll => {
            let first = IoUring::builder().setup_sqpoll(SQPOLL_IDLE_MS).build(64)?;
            let second = IoUring::builder()
                .setup_sqpoll(SQPOLL_IDLE_MS)
                .setup_attach_wq(first.as_raw_fd())
                .build(64)?;
            let c = RingEnd::new(
                first,
                client.as_raw_fd(),
                Reap::Peek,
                Buffers::Registered,
                2 * MSG,
            )?;
            let s = RingEnd::new(
                second,
                server.as_raw_fd(),
                Reap::Peek,
                Buffers::Registered,
                2 * MSG,
            )?;
            (Some(s), Some(c))
        }
    };

    let server_thread = thread::spawn(move || -> io::Result<()> {
        match server_end {
            None => plain_server(server),
            Some(end) => {
                let r = uring_server(end);
                drop(server);
                r
            }
        }
    });
    let client_result = match client_end {
        None => plain_client(client, warmup, iters),
        Some(end) => {
            let r = uring_client(end, warmup, iters);
            drop(client);
            r
        }
    };
    let server_result = server_thread
        .join()
        .map_err(|_| protocol_error("server thread panicked".to_owned()))?;
    let (mut times, cpu) = client_result?;
    server_result?;
    let half_rtt_us = median(&mut times) / 2.0;
    let mean_us = times.iter().sum::<f64>() / times.len().max(1) as f64 / 2.0;
    // `median` sorted `times`.
    let p99_us = times
        .get(times.len() * 99 / 100)
        .copied()
        .unwrap_or(f64::NAN)
        / 2.0;
    Ok(Sample {
        half_rtt_us,
        mean_us,
        p99_us,
        cpu_us_per_rt: cpu * 1e6 / times.len().max(1) as f64,
        iters: times.len(),
    })
}

/// A run stops timing after this long even if it has not done `iters` iterations (it
/// happens only to SQPOLL, whose tail of scheduler-tick waits can stretch a run to 30 s).
const RUN_CAP: Duration = Duration::from_secs(4);

/// Client timing: (round trip of every timed iteration in us, process CPU seconds over them).
type Timed = (Vec<f64>, f64);

/// Fills `buf`; false if the peer closed before its first byte.
fn recv_exact_nb(s: &mut TcpStream, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    let mut spins = 0u32;
    let start = Instant::now();
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(protocol_error("peer closed mid-message".to_owned())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                spins = spins.wrapping_add(1);
                pause(spins);
                if spins.is_multiple_of(1024) && start.elapsed() > Duration::from_secs(10) {
                    return Err(protocol_error("no data within 10 s".to_owned()));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

fn send_all_nb(s: &mut TcpStream, mut buf: &[u8]) -> io::Result<()> {
    let mut spins = 0u32;
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                spins = spins.wrapping_add(1);
                pause(spins);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Echoes messages until the client closes the connection between two of them.
fn plain_server(mut s: TcpStream) -> io::Result<()> {
    let mut buf = [0u8; MSG];
    while recv_exact_nb(&mut s, &mut buf)? {
        send_all_nb(&mut s, &buf)?;
    }
    Ok(())
}

fn plain_client(mut s: TcpStream, warmup: usize, iters: usize) -> io::Result<Timed> {
    let mut times = Vec::with_capacity(iters);
    let mut cpu0 = 0.0;
    let mut rbuf = [0u8; MSG];
    let mut timed_start = Instant::now();
    for i in 0..warmup + iters {
        if i == warmup {
            cpu0 = process_cpu_seconds()?;
            timed_start = Instant::now();
        } else if i > warmup && timed_start.elapsed() > RUN_CAP {
            break;
        }
        let t = Instant::now();
        send_all_nb(&mut s, &(i as u64).to_le_bytes())?;
        if !recv_exact_nb(&mut s, &mut rbuf)? {
            return Err(protocol_error("server closed".to_owned()));
        }
        let dt = t.elapsed();
        check_echo(i, &rbuf)?;
        if i >= warmup {
            times.push(dt.as_secs_f64() * 1e6);
        }
    }
    Ok((times, process_cpu_seconds()? - cpu0))
}

fn check_echo(i: usize, got: &[u8]) -> io::Result<()> {
    if got != (i as u64).to_le_bytes() {
        return Err(protocol_error(format!("iteration {i}: echo {got:?}")));
    }
    Ok(())
}

/// Ping-pong state of one ring end. The buffer holds the send half (0..8) and the receive
/// half (8..16).
struct PingPong {
    end: RingEnd,
    sends_in_flight: usize,
    recv_in_flight: bool,
    received: usize,
    /// The peer closed the connection between two messages.
    eof: bool,
}

impl PingPong {
    fn new(end: RingEnd) -> Self {
        Self {
            end,
            sends_in_flight: 0,
            recv_in_flight: false,
            received: 0,
            eof: false,
        }
    }

    fn post_send(&mut self) -> io::Result<()> {
        self.end.push_send(0, MSG, 0, SEND)?;
        self.sends_in_flight += 1;
        Ok(())
    }

    fn post_recv(&mut self) -> io::Result<()> {
        self.end
            .push_recv(MSG + self.received, MSG - self.received, RECV)?;
        self.recv_in_flight = true;
        Ok(())
    }

    fn reap(&mut self) -> io::Result<()> {
        let (tag, res, _) = self.end.next_cqe()?;
        match tag {
            SEND if res == MSG as i32 => self.sends_in_flight -= 1,
            SEND => return Err(protocol_error(format!("send completed with {res}"))),
            RECV if res > 0 => {
                self.recv_in_flight = false;
                self.received += res as usize;
            }
            RECV if res == 0 && self.received == 0 => {
                self.recv_in_flight = false;
                self.eof = true;
            }
            RECV => return Err(protocol_error(format!("receive completed with {res}"))),
            _ => return Err(protocol_error(format!("unknown completion {tag}"))),
        }
        Ok(())
    }

    fn wait_sends(&mut self) -> io::Result<()> {
        while self.sends_in_flight > 0 {
            self.reap()?;
        }
        Ok(())
    }

    /// Waits until the posted receive has all 8 bytes (re-posting the rest after a short one);
    /// false if the peer closed the connection instead.
    fn wait_message(&mut self) -> io::Result<bool> {
        loop {
            while self.recv_in_flight {
                self.reap()?;
            }
            if self.eof {
                return Ok(false);
            }
            if self.received == MSG {
                self.received = 0;
                return Ok(true);
            }
            self.post_recv()?;
            self.end.flush()?;
        }
    }
}

/// Echoes messages until the client closes the connection between two of them.
fn uring_server(end: RingEnd) -> io::Result<()> {
    let mut p = PingPong::new(end);
    let per_op = matches!(p.wait_mode(), Reap::SubmitAndWait);
    p.post_recv()?;
    p.end.flush()?;
    while p.wait_message()? {
        // The previous echo's buffer is free only once its send completed.
        p.wait_sends()?;
        let (tx, rx) = p.end.buf_mut().split_at_mut(MSG);
        tx.copy_from_slice(&rx[..MSG]);
        p.post_send()?;
        if per_op {
            p.wait_sends()?;
        }
        p.post_recv()?;
        p.end.flush()?;
    }
    p.wait_sends()
}

fn uring_client(end: RingEnd, warmup: usize, iters: usize) -> io::Result<Timed> {
    let mut p = PingPong::new(end);
    let per_op = matches!(p.wait_mode(), Reap::SubmitAndWait);
    let mut times = Vec::with_capacity(iters);
    let mut cpu0 = 0.0;
    let mut timed_start = Instant::now();
    for i in 0..warmup + iters {
        if i == warmup {
            cpu0 = process_cpu_seconds()?;
            timed_start = Instant::now();
        } else if i > warmup && timed_start.elapsed() > RUN_CAP {
            break;
        }
        let t = Instant::now();
        p.end.buf_mut()[..MSG].copy_from_slice(&(i as u64).to_le_bytes());
        p.post_send()?;
        if per_op {
            p.wait_sends()?;
        }
        p.post_recv()?;
        p.end.flush()?;
        if !p.wait_message()? {
            return Err(protocol_error("server closed".to_owned()));
        }
        p.wait_sends()?;
        let dt = t.elapsed();
        check_echo(i, &p.end.buf()[MSG..2 * MSG])?;
        if i >= warmup {
            times.push(dt.as_secs_f64() * 1e6);
        }
    }
    Ok((times, process_cpu_seconds()? - cpu0))
}

impl PingPong {
    fn wait_mode(&self) -> Reap {
        self.end.wait()
    }
}
