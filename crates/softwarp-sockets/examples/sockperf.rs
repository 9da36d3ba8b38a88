//! Ping-pong latency and bulk bandwidth over one stream connection, two processes.
//!
//! ```text
//! cargo build --release -p softwarp-sockets --example sockperf
//! target/release/examples/sockperf server 127.0.0.1:7480 [--api std|native]
//! target/release/examples/sockperf client 127.0.0.1:7480 [--api std|native] [--label L]
//!     [--sizes 8,64,4096,65536] [--iters 10000] [--bulk-sizes 65536,1048576] [--bulk-mib 512]
//! ```
//!
//! - `--api std` (the default): both ends are `std::net::TcpStream`/`TcpListener`, so the
//!   same binary measures plain kernel TCP, and, started with `LD_PRELOAD=
//!   libsoftwarp_preload.so`, the preload library's pass-through (the default mode: the
//!   program sets no option) or its iWARP mode (`SOFTWARP_SOCKETS=all` at both ends).
//! - `--api native`: both ends are `softwarp-sockets` iWARP streams
//!   (`IwarpListener::bind_iwarp`, `IwarpStream::connect_iwarp`); besides the stream tests it
//!   measures the one-sided fast path: each end exposes a 1 MiB window, a ping-pong of
//!   `write_remote_notify` / `recv_write_notice` (the bytes land in the peer's window, no
//!   copy at the receiver), and bulk `write_remote` ending with a notified Write.
//!
//! Tests, one connection for all of them, the client leading (a 16-byte request: test,
//! size, count):
//! - `pingpong SIZE`: the client writes SIZE bytes, the server reads them all and writes them
//!   back; `--iters` round trips per size (a fifth of that at 64 KiB and above), after a
//!   tenth as many unmeasured ones. Reported: the half round trip's median and 99th
//!   percentile, in microseconds.
//! - `bulk SIZE`: the client writes `--bulk-mib` MiB in writes of SIZE bytes, the server
//!   reads them and answers one byte; reported: Gbit/s from the first write to that byte.
//!
//! The client prints one line per test, `RESULT label=.. api=.. test=.. size=.. ...`
//! (`scripts/bench-sockets.sh` makes a table of them). Every read and write is bounded by a
//! 30 s timeout (a stall fails the run instead of hanging it), the connect retries for at
//! most 10 s (the server may not listen yet), and the server exits when its one client
//! leaves.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use softwarp_sockets::{IwarpListener, IwarpStream, Window};

/// Bound of every blocking read, write and one-sided wait.
const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the client tries to reach a server that does not listen yet.
const CONNECT_FOR: Duration = Duration::from_secs(10);
/// The window each end of a native connection exposes (at offset 0).
const WINDOW: usize = 1 << 20;

const T_QUIT: u32 = 0;
const T_PINGPONG: u32 = 1;
const T_BULK: u32 = 2;
const T_REMOTE_PINGPONG: u32 = 3;
const T_REMOTE_BULK: u32 = 4;

fn bad(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, why)
}

/// A connected stream of either API: the tests only need `Read`, `Write` and, natively, the
/// one-sided calls.
enum Conn {
    Std(TcpStream),
    Native {
        s: IwarpStream,
        /// This end's window, kept registered while the connection lives.
        _window: Window,
    },
}

impl Conn {
    fn std(s: TcpStream) -> io::Result<Self> {
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(IO_TIMEOUT))?;
        s.set_write_timeout(Some(IO_TIMEOUT))?;
        Ok(Self::Std(s))
    }

    fn native(s: IwarpStream) -> io::Result<Self> {
        s.set_read_timeout(Some(IO_TIMEOUT))?;
        s.set_write_timeout(Some(IO_TIMEOUT))?;
        let window = s.expose(WINDOW, 0)?;
        s.wait_peer_window(0, WINDOW as u64, IO_TIMEOUT)?;
        Ok(Self::Native { s, _window: window })
    }

    fn iwarp(&self) -> io::Result<&IwarpStream> {
        match self {
            Self::Native { s, .. } => Ok(s),
            Self::Std(_) => Err(bad("one-sided tests need --api native".into())),
        }
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        match self {
            Self::Std(s) => s.read_exact(buf),
            Self::Native { s, .. } => s.read_exact(buf),
        }
    }

    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Std(s) => s.read(buf),
            Self::Native { s, .. } => s.read(buf),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        match self {
            Self::Std(s) => s.write_all(buf),
            Self::Native { s, .. } => s.write_all(buf),
        }
    }

    /// Sends a request: test, size, count.
    fn request(&mut self, test: u32, size: u32, count: u64) -> io::Result<()> {
        let mut m = [0u8; 16];
        m[..4].copy_from_slice(&test.to_le_bytes());
        m[4..8].copy_from_slice(&size.to_le_bytes());
        m[8..].copy_from_slice(&count.to_le_bytes());
        self.write_all(&m)
    }

    /// The next request, or `None` when the client closed.
    fn next_request(&mut self) -> io::Result<Option<(u32, usize, u64)>> {
        let mut m = [0u8; 16];
        match self.read_exact(&mut m) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let word = |r: std::ops::Range<usize>| -> u64 {
            m[r].iter()
                .rev()
                .fold(0u64, |acc, b| (acc << 8) | u64::from(*b))
        };
        Ok(Some((word(0..4) as u32, word(4..8) as usize, word(8..16))))
    }
}

fn notice(s: &IwarpStream, size: usize) -> io::Result<()> {
    let (off, len) = s.recv_write_notice(IO_TIMEOUT)?;
    if off != 0 || len != size as u64 {
        return Err(bad(format!("notice ({off}, {len}), expected (0, {size})")));
    }
    Ok(())
}

// ---- server -------------------------------------------------------------------------------

fn serve(mut c: Conn) -> io::Result<()> {
    let mut buf = vec![0u8; WINDOW];
    while let Some((test, size, count)) = c.next_request()? {
        if size > buf.len() {
            return Err(bad(format!("size {size} above {}", buf.len())));
        }
        match test {
            T_QUIT => break,
            T_PINGPONG => {
                for _ in 0..count {
                    c.read_exact(&mut buf[..size])?;
                    c.write_all(&buf[..size])?;
                }
            }
            T_BULK => {
                let mut left = count;
                while left > 0 {
                    let n = c.read(&mut buf[..size])?;
                    if n == 0 {
                        return Err(bad("EOF in the middle of a bulk test".into()));
                    }
                    left = left.saturating_sub(n as u64);
                }
                c.write_all(&[1])?;
            }
            T_REMOTE_PINGPONG => {
                let s = c.iwarp()?;
                for _ in 0..count {
                    notice(s, size)?;
                    s.write_remote_notify(0, &buf[..size])?;
                }
            }
            T_REMOTE_BULK => {
                // The client's last Write is notified: every byte before it has landed.
                notice(c.iwarp()?, size)?;
                c.write_all(&[1])?;
            }
            other => return Err(bad(format!("unknown test {other}"))),
        }
    }
    Ok(())
}

// ---- client -------------------------------------------------------------------------------

struct Plan {
    label: String,
    api: &'static str,
    sizes: Vec<usize>,
    iters: u64,
    bulk_sizes: Vec<usize>,
    bulk_bytes: u64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Half round trips in microseconds, sorted.
fn pingpong(c: &mut Conn, size: usize, iters: u64, remote: bool) -> io::Result<Vec<f64>> {
    let warmup = (iters / 10).max(1);
    let test = if remote {
        T_REMOTE_PINGPONG
    } else {
        T_PINGPONG
    };
    c.request(test, size as u32, warmup + iters)?;
    let mut out = vec![0u8; size];
    let mut back = vec![0u8; size];
    let mut half = Vec::with_capacity(iters as usize);
    for i in 0..warmup + iters {
        let mark = (i % 251) as u8;
        out[0] = mark;
        out[size - 1] = mark;
        let t0 = Instant::now();
        if remote {
            let s = c.iwarp()?;
            s.write_remote_notify(0, &out)?;
            notice(s, size)?;
        } else {
            c.write_all(&out)?;
            c.read_exact(&mut back)?;
            if back[0] != mark || back[size - 1] != mark {
                return Err(bad(format!("round trip {i}: the echo differs")));
            }
        }
        let dt = t0.elapsed();
        if i >= warmup {
            half.push(dt.as_secs_f64() * 1e6 / 2.0);
        }
    }
    half.sort_by(f64::total_cmp);
    Ok(half)
}

/// Gbit/s of `bytes` written in writes of `size`.
fn bulk(c: &mut Conn, size: usize, bytes: u64, remote: bool) -> io::Result<f64> {
    let data = vec![0x5au8; size];
    let writes = bytes.div_ceil(size as u64).max(1);
    let total = writes * size as u64;
    let t0 = Instant::now();
    if remote {
        c.request(T_REMOTE_BULK, size as u32, total)?;
        let s = c.iwarp()?;
        for _ in 1..writes {
            s.write_remote(0, &data)?;
        }
        s.write_remote_notify(0, &data)?;
    } else {
        c.request(T_BULK, size as u32, total)?;
        for _ in 0..writes {
            c.write_all(&data)?;
        }
    }
    let mut ack = [0u8; 1];
    c.read_exact(&mut ack)?;
    let secs = t0.elapsed().as_secs_f64();
    Ok(total as f64 * 8.0 / secs / 1e9)
}

fn run_client(mut c: Conn, plan: &Plan) -> io::Result<()> {
    let native = matches!(c, Conn::Native { .. });
    let mut shapes = vec![("pingpong", false)];
    if native {
        shapes.push(("remote_pingpong", true));
    }
    for &(name, remote) in &shapes {
        for &size in &plan.sizes {
            let iters = if size >= 65536 {
                (plan.iters / 5).max(1)
            } else {
                plan.iters
            };
            let half = pingpong(&mut c, size, iters, remote)?;
            println!(
                "RESULT label={} api={} test={name} size={size} iters={iters} median_us={:.2} \
                 p99_us={:.2}",
                plan.label,
                plan.api,
                percentile(&half, 0.5),
                percentile(&half, 0.99),
            );
        }
    }
    let mut shapes = vec![("bulk", false)];
    if native {
        shapes.push(("remote_bulk", true));
    }
    for &(name, remote) in &shapes {
        for &size in &plan.bulk_sizes {
            let gbit = bulk(&mut c, size, plan.bulk_bytes, remote)?;
            println!(
                "RESULT label={} api={} test={name} size={size} mib={} gbit_s={gbit:.2}",
                plan.label,
                plan.api,
                plan.bulk_bytes >> 20,
            );
        }
    }
    c.request(T_QUIT, 0, 0)
}

fn connect(addr: SocketAddr, native: bool) -> io::Result<Conn> {
    let deadline = Instant::now().checked_add(CONNECT_FOR);
    loop {
        let r = if native {
            IwarpStream::connect_iwarp(addr).and_then(Conn::native)
        } else {
            TcpStream::connect(addr).and_then(Conn::std)
        };
        match r {
            Err(e)
                if e.kind() == io::ErrorKind::ConnectionRefused
                    && deadline.is_some_and(|d| Instant::now() < d) =>
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            r => return r,
        }
    }
}

fn list(v: &str) -> io::Result<Vec<usize>> {
    v.split(',')
        .map(|x| {
            x.trim()
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=WINDOW).contains(n))
                .ok_or_else(|| bad(format!("size {x:?}: 1 to {WINDOW} bytes")))
        })
        .collect()
}

fn main() {
    if let Err(e) = real_main() {
        eprintln!("sockperf: {e}");
        std::process::exit(1);
    }
}

fn real_main() -> io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = || {
        bad(
            "usage: sockperf server|client ADDR [--api std|native] [--label L] [--sizes LIST] \
             [--iters N] [--bulk-sizes LIST] [--bulk-mib M]"
                .into(),
        )
    };
    let (role, addr) = match args.as_slice() {
        [r, a, ..] => (r.as_str(), a.parse::<SocketAddr>().map_err(|_| usage())?),
        _ => return Err(usage()),
    };
    let mut native = false;
    let mut plan = Plan {
        label: "run".into(),
        api: "std",
        sizes: vec![8, 64, 4096, 65536],
        iters: 10_000,
        bulk_sizes: vec![65536, 1 << 20],
        bulk_bytes: 512 << 20,
    };
    let mut it = args[2..].iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().cloned().ok_or_else(usage);
        match flag.as_str() {
            "--api" => match value()?.as_str() {
                "std" => native = false,
                "native" => native = true,
                _ => return Err(usage()),
            },
            "--label" => plan.label = value()?,
            "--sizes" => plan.sizes = list(&value()?)?,
            "--iters" => plan.iters = value()?.parse().map_err(|_| usage())?,
            "--bulk-sizes" => plan.bulk_sizes = list(&value()?)?,
            "--bulk-mib" => {
                let mib: u64 = value()?.parse().map_err(|_| usage())?;
                plan.bulk_bytes = mib.clamp(1, 1 << 20) << 20;
            }
            _ => return Err(usage()),
        }
    }
    if native {
        plan.api = "native";
    }
    match role {
        "server" => {
            let c = if native {
                let l = IwarpListener::bind_iwarp(addr)?;
                Conn::native(l.accept()?.0)?
            } else {
                let l = TcpListener::bind(addr)?;
                Conn::std(l.accept()?.0)?
            };
            serve(c)
        }
        "client" => run_client(connect(addr, native)?, &plan),
        _ => Err(usage()),
    }
}
