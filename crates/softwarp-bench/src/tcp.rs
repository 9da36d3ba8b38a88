//! The raw TCP baseline of `softwarp bench`: the same sizes, iterations and threads over a
//! plain TCP connection with `TCP_NODELAY`, so that every Softwarp number can be printed as
//! a ratio to what the kernel's TCP does on the same machine at the same moment.
//!
//! - Bandwidth: the sender writes `size`-byte records, `post_list` records per system call
//!   (the batching a TCP application would do); the receiver reads with a 1 MiB buffer
//!   until it has every byte. Bidirectional: each side also runs the other role in a
//!   second thread (Softwarp has a progress thread per side too). The clock stops when the
//!   server reports, over the control channel, that every byte arrived.
//! - Latency: a ping-pong of `size` bytes; half the round trip is reported.
//!
//! Mode `busy`/`spin`: non-blocking sockets polled in a loop; `event`: blocking calls.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

use super::spec::{Kind, Spec};

const RECV_BUF: usize = 1 << 20;
const RUN_TIMEOUT: Duration = Duration::from_secs(300);

/// Largest single write of the bandwidth sender (records are batched up to this).
const MAX_BATCH_BYTES: usize = 1 << 20;

fn write_all(s: &mut TcpStream, mut buf: &[u8], deadline: Instant) -> Result<()> {
    let mut spins = 0u32;
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(0) => bail!("TCP: the peer closed the connection"),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                super::spin::wait_step(&mut spins, deadline, || "TCP: write stalled".to_string())?;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e).context("TCP write"),
        }
    }
    Ok(())
}

/// Reads exactly `total` bytes (into `buf`, reused).
fn read_total(
    s: &mut TcpStream,
    buf: &mut [u8],
    mut total: usize,
    deadline: Instant,
) -> Result<()> {
    let mut spins = 0u32;
    while total > 0 {
        let want = total.min(buf.len());
        match s.read(&mut buf[..want]) {
            Ok(0) => bail!("TCP: the peer closed the connection"),
            Ok(n) => total -= n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                super::spin::wait_step(&mut spins, deadline, || "TCP: read stalled".to_string())?;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e).context("TCP read"),
        }
    }
    Ok(())
}

/// One side of the baseline connection.
#[derive(Debug)]
pub struct Side {
    spec: Spec,
    stream: TcpStream,
    out: Vec<u8>,
    inbuf: Vec<u8>,
    /// Round-trip time of each iteration of the last latency run (client side), in ns.
    pub samples: Vec<u64>,
}

impl Side {
    /// Wraps the connected data stream.
    pub fn new(spec: Spec, stream: TcpStream) -> Result<Self> {
        stream.set_nodelay(true)?;
        stream.set_nonblocking(spec.mode.tcp_polls())?;
        let batch = Self::batch(&spec, spec.max_size);
        Ok(Self {
            spec,
            stream,
            out: vec![0x5a; (spec.max_size * batch).max(1)],
            inbuf: vec![0; RECV_BUF.max(spec.max_size.min(RECV_BUF))],
            samples: Vec::new(),
        })
    }

    /// Records per write for `size`.
    fn batch(spec: &Spec, size: usize) -> usize {
        spec.post_list
            .min((MAX_BATCH_BYTES / size.max(1)).max(1))
            .max(1)
    }

    /// Runs one measurement in the client (`client`) or server role; returns the bytes
    /// this side wrote as the active side of a bandwidth run (0 for latency).
    pub fn run(&mut self, client: bool, size: usize, iters: u64) -> Result<u64> {
        let deadline = Instant::now() + RUN_TIMEOUT;
        match self.spec.shape.kind {
            Kind::Lat => {
                let mut buf = vec![0u8; size];
                self.samples.clear();
                for _ in 0..iters {
                    if client {
                        let t = Instant::now();
                        write_all(&mut self.stream, &self.out[..size], deadline)?;
                        read_total(&mut self.stream, &mut buf, size, deadline)?;
                        self.samples.push(super::rdma::elapsed_ns(t));
                    } else {
                        read_total(&mut self.stream, &mut buf, size, deadline)?;
                        write_all(&mut self.stream, &self.out[..size], deadline)?;
                    }
                }
                Ok(0)
            }
            Kind::Bw => {
                let active = client || self.spec.bidir;
                let passive = !client || self.spec.bidir;
                let total = size as u64 * iters;
                let batch = Self::batch(&self.spec, size);
                let mut sent = 0;
                let writer = if active && passive {
                    // The second direction runs in its own thread.
                    let mut s = self.stream.try_clone()?;
                    let out = self.out.clone();
                    Some(std::thread::spawn(move || {
                        send_records(&mut s, &out, size, batch, total, deadline)
                    }))
                } else {
                    if active {
                        sent = send_records(
                            &mut self.stream,
                            &self.out,
                            size,
                            batch,
                            total,
                            deadline,
                        )?;
                    }
                    None
                };
                if passive {
                    let total = usize::try_from(total)?;
                    read_total(&mut self.stream, &mut self.inbuf, total, deadline)?;
                }
                if let Some(w) = writer {
                    sent = w
                        .join()
                        .map_err(|_| anyhow::anyhow!("TCP writer thread panicked"))??;
                }
                Ok(sent)
            }
        }
    }
}

fn send_records(
    s: &mut TcpStream,
    out: &[u8],
    size: usize,
    batch: usize,
    total: u64,
    deadline: Instant,
) -> Result<u64> {
    let mut left = usize::try_from(total)?;
    let chunk = size * batch;
    let mut sent = 0u64;
    while left > 0 {
        let n = chunk.min(left);
        write_all(s, &out[..n], deadline)?;
        left -= n;
        sent += n as u64;
    }
    Ok(sent)
}

/// Accepts one connection, waiting at most `timeout`.
pub fn accept_timeout(l: &TcpListener, timeout: Duration) -> Result<TcpStream> {
    l.set_nonblocking(true)?;
    let deadline = Instant::now() + timeout;
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                return Ok(s);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                ensure!(
                    Instant::now() < deadline,
                    "no TCP connection within {timeout:?}"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(e).context("TCP accept"),
        }
    }
}
