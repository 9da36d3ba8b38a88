//! `softwarp bench`: perftest's six shapes (`ib_send_bw`, `ib_write_bw`, `ib_read_bw`,
//! `ib_send_lat`, `ib_write_lat`, `ib_read_lat`) over Softwarp, each next to a raw TCP
//! baseline measured in the same invocation (same sizes, same threads, `TCP_NODELAY`), so
//! that results read as ratios that survive a noisy machine.
//!
//! The flags mean what perftest's mean where perftest has them (`-s` size, `-n` iterations,
//! `-D` duration, `-t`, `-r`, `-o`, `-l`, `-a`, `-b`, `-e`, `-q`, `-d`, `-p`, `-R`, `-F`,
//! `--report_gbits`); a few spellings of earlier versions are refused with the new one
//! ([`BenchArgs`]). Roles as in perftest: with a peer address this is the client, with none
//! the server (one client session, then exit); `--loopback` runs both in this process (two
//! threads). The client and the server agree on everything over a TCP control channel
//! ([`session`]); the data moves over one iWARP connection and one TCP connection per
//! shape, or with `-q N` (bandwidth shapes, as perftest) over N of each at once, reported
//! as their aggregate.
//!
//! `qp_mem` is a seventh, non-perftest measurement: heap bytes per connected, idle QP. It
//! needs the counting allocator ([`CountingAlloc`]), which only the `softwarp-bench`
//! program installs.
//!
//! With `-R` the tool speaks perftest's own rdma_cm exchange instead ([`perftest`]), so that
//! the peer can be perftest's `ib_*_bw`/`ib_*_lat -R` (there is no TCP baseline then).
//!
//! Results: a text table as they come, or with `--json` one [`report::Document`].
#![warn(missing_docs)]

mod cpu;
mod ctrl;
mod perftest;
mod progress;
mod rdma;
pub mod report;
mod session;
mod spec;
mod spin;
mod tcp;
pub mod ucx;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};

use self::report::{BwUnit, Config, Document, QpMemoryResult, Row};
use self::session::{Client, Listeners, Timed, Which};
pub use self::spec::Mode;
use self::spec::{fmt_size, parse_size, Kind, Shape, Spec};

pub use self::cpu::CountingAlloc;

/// perftest's default port; the iWARP and TCP baseline listeners use the next two.
const DEFAULT_PORT: u16 = 18515;

/// The old meaning of `-s` and where it went (as a hint in errors).
const OLD_SERVER_FLAG: &str = "-s is the message size now, as perftest's -s; it was the \
    server role, which is now the side given no peer, as in perftest (`softwarp bench`, \
    `softwarp bench -R write_bw`)";

/// Options of `softwarp bench`, with perftest's letters and meanings where perftest has
/// them.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// What to run, then (client role) the server's address: `[SHAPES] [PEER]`. SHAPES is
    /// a comma-separated list of send_bw, write_bw, read_bw, send_lat, write_lat,
    /// read_lat (an `ib_` prefix is fine), `all` (the six), or `qp_mem` (heap bytes per
    /// connected idle QP; `softwarp-bench` only). Default: all. PEER is a host or
    /// host:port. As in perftest, with no PEER this is the server, which serves one client
    /// session and exits (the client chooses the shapes, except with -R).
    #[arg(value_name = "SHAPES|PEER", num_args = 0..=2)]
    positional: Vec<String>,
    /// Run the server and the client in this process (two threads, loopback).
    #[arg(long)]
    loopback: bool,
    /// Control port (the server also listens on PORT+1 for iWARP and PORT+2 for TCP; 0:
    /// three free ports, printed when the server starts). With -R: the one port.
    #[arg(short = 'p', long, default_value_t = DEFAULT_PORT)]
    port: u16,
    /// Address the server binds (default: all addresses).
    #[arg(long, default_value = "0.0.0.0")]
    bind: IpAddr,
    /// Message sizes (perftest -s; comma-separated; K and M suffixes are powers of 1024).
    /// Default: 64K for bandwidth shapes, 8 for latency shapes (-R: 2, as perftest).
    #[arg(short = 's', long = "size", value_delimiter = ',', value_parser = parse_size_arg,
          num_args = 0..=1, default_missing_value = "")]
    sizes: Vec<usize>,
    /// The old spelling of the size: refused with the new one (perftest's -S is the
    /// InfiniBand service level, which iWARP has not).
    #[arg(short = 'S', hide = true, value_parser = old_size_flag)]
    old_size: Option<String>,
    /// Every size from 2 B to 8 MiB (powers of two), as perftest's -a. With -R: all of them
    /// on one pair of connections, as perftest does (one -s then caps the sizes, for two
    /// softwarp ends only).
    #[arg(short = 'a', long)]
    all: bool,
    /// Iterations per size (default: about 1 GiB per size for bandwidth, clamped to
    /// 100..200000; 5000 for latency, fewer for sizes above 64 KiB; -R: 1000).
    #[arg(short = 'n', long, conflicts_with = "duration")]
    iters: Option<u64>,
    /// Seconds each run lasts (perftest -D): a short calibration run of Softwarp gives
    /// the iterations that fill it, and the raw TCP baseline runs the same number.
    #[arg(short = 'D', long, value_parser = clap::value_parser!(u64).range(1..))]
    duration: Option<u64>,
    /// Outstanding work requests of bandwidth shapes (perftest -t).
    #[arg(short = 't', long = "tx-depth", default_value_t = 128)]
    depth: usize,
    /// Post work requests in lists of this many (perftest --post_list); the TCP baseline
    /// writes the same number of records per system call.
    #[arg(
        short = 'l',
        long = "post_list",
        alias = "post-list",
        default_value_t = 1
    )]
    post_list: usize,
    /// Both directions at once (bandwidth shapes: both directions added up).
    #[arg(short = 'b', long)]
    bidirectional: bool,
    /// CRC32c on every FPDU.
    #[arg(long, default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    crc: bool,
    /// How completions are waited for: busy (the CQ poll drives the QP: no thread
    /// wake-ups), spin (spin on the CQ; the progress thread moves the bytes), or event
    /// (completion channel). Default busy; with -R spin (as perftest without -e polls
    /// while the progress thread moves the bytes), and -R --mode busy busy-polls its CQs
    /// as perftest under `softwarp exec --busy-poll` does.
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// Sleep on completion events (perftest -e): the same as --mode event.
    #[arg(short = 'e', long, conflicts_with = "mode")]
    events: bool,
    /// Largest FPDU to send (default: the connection's own choice, the TCP MSS, or MPA's
    /// largest, 65,535 bytes, to a peer on this host such as loopback).
    #[arg(long)]
    fpdu: Option<usize>,
    /// Send every FPDU of a message but the last with the largest payload, even when a
    /// page-aligned (or similarly placed) source makes the kernel's copy hit 4 KiB
    /// aliasing (`ConnectOptions::tx_alias_lead(false)`): for comparisons.
    #[arg(long)]
    no_alias_lead: bool,
    /// Repeat every measurement this many times and report the median.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Before the runs of each size, run Softwarp and the TCP baseline alternately, unmeasured,
    /// for at least this many milliseconds (0: no warm-up). Unpinned, the scheduler may start
    /// both ends of a ping-pong on one CPU and spread them only tens of milliseconds later:
    /// without it the first size of an invocation measured 27 us for a 4 KiB Write that
    /// takes 6 (BENCHMARKS.md).
    #[arg(long, default_value_t = 100)]
    warmup_ms: u64,
    /// Skip the raw TCP baseline.
    #[arg(long)]
    no_tcp: bool,
    /// Also run UCX's `ucx_perftest` over UCX's TCP transport on loopback (Debian:
    /// ucx-utils) for every write and send shape and size, with the same iterations,
    /// runs and placement, and print it under each row with Softwarp's ratio to it
    /// (`put_bw`/`put_lat` through UCT, `tag_bw`/`tag_lat` through UCP; reads have no UCX
    /// counterpart over TCP). Both ends in this process only (`--loopback`).
    #[arg(long)]
    ucx: bool,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    json: bool,
    /// Bandwidth in Gbit/s (10^9 bits per second) in the table instead of perftest's MB/s
    /// (2^20 bytes per second), as perftest's --report_gbits. The JSON has both.
    #[arg(long = "report_gbits")]
    report_gbits: bool,
    /// Do not warn when the CPU frequency may change during the run (perftest -F).
    #[arg(short = 'F', long = "CPU-freq")]
    cpu_freq: bool,
    /// Pin the benchmark threads: the client to CPU 0 and the server to CPU 1 (the last
    /// CPU on a one-CPU machine); each device's progress thread inherits its side's CPU.
    /// Same placement for Softwarp and TCP, run after run. Off by default: on a machine
    /// whose cores are shared with other busy work, a pinned spinning thread waits for
    /// the scheduler tick whenever its core's other task runs (4 ms per turn here).
    #[arg(long, default_value = "off", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    pin: bool,
    /// Polling loops (Softwarp's and TCP's alike) yield the CPU after this many empty
    /// polls (0: never), so that a ping-pong survives sharing a core with other work.
    #[arg(long, default_value_t = 32)]
    yield_every: u32,
    /// Number of QPs (perftest -q). Bandwidth shapes run on this many QPs between the same
    /// two ends at once (and the raw TCP baseline on as many connections), each with the
    /// same iterations; bandwidth and message rate are the aggregate. Latency shapes and
    /// -R take no -q above 1, as in perftest. `qp_mem`: how many connected QP pairs it
    /// creates (default 256).
    #[arg(short = 'q', long = "qp", alias = "qps")]
    qps: Option<usize>,
    /// The Softwarp device to use (perftest -d; Softwarp has one, softwarp0).
    #[arg(short = 'd', long = "ib-dev", default_value = softwarp::DEVICE_NAME)]
    device: String,
    /// Speak perftest's own exchange over rdma_cm (perftest -R), to run against
    /// `ib_send_bw`, `ib_write_bw`, `ib_read_bw` and the `_lat` tools (or another
    /// `softwarp bench -R`): one shape and one size (or -a) per session, both connections
    /// to --port. The server must be given the shape (perftest never sends it).
    #[arg(short = 'R', long = "rdma_cm")]
    rdma_cm: bool,
    /// With -R: receive queue depth of send_bw's receiver (perftest -r, default 512),
    /// which is also the sender's credit window.
    #[arg(short = 'r', long = "rx-depth")]
    rx_depth: Option<usize>,
    /// With -R: outstanding RDMA Reads (perftest -o), the IRD/ORD of the data connection
    /// of the Read shapes (at most the device's limit).
    #[arg(short = 'o', long = "outs", alias = "out-reads", default_value_t = 128)]
    out_reads: usize,
    /// With -R: seconds the server waits for a client.
    #[arg(long = "accept-timeout", default_value_t = 120)]
    accept_timeout: u64,
}

/// perftest's default receive queue depth (-r).
const DEFAULT_RX_DEPTH: usize = 512;

/// `-s`: a size list element, with the old meaning of `-s` named when it is not a size.
fn parse_size_arg(s: &str) -> Result<usize, String> {
    if s.is_empty() {
        return Err(format!("-s needs a size: {OLD_SERVER_FLAG}"));
    }
    parse_size(s).map_err(|e| {
        if s.starts_with(|c: char| c.is_ascii_digit()) {
            e
        } else {
            format!("{e}: {OLD_SERVER_FLAG}")
        }
    })
}

/// `-S`: the old spelling of the size.
fn old_size_flag(_: &str) -> Result<String, String> {
    Err(
        "-S was the message size: the size is -s now, as perftest's -s (perftest's -S, \
         the InfiniBand service level, has no iWARP meaning)"
            .into(),
    )
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" | "1" | "yes" | "true" => Ok(true),
        "off" | "0" | "no" | "false" => Ok(false),
        _ => Err(format!("expected on or off, got {s:?}")),
    }
}

/// What the positional arguments say.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Plan {
    shapes: Vec<Shape>,
    qp_mem: bool,
    peer: Option<String>,
}

fn parse_shapes(s: &str) -> Result<(Vec<Shape>, bool)> {
    let mut shapes = Vec::new();
    let mut qp_mem = false;
    for part in s.split(',').filter(|p| !p.is_empty()) {
        match part {
            "all" => shapes.extend(Shape::ALL),
            "qp_mem" => qp_mem = true,
            p => shapes.push(p.parse()?),
        }
    }
    ensure!(!shapes.is_empty() || qp_mem, "no shape given");
    Ok((shapes, qp_mem))
}

fn plan(positional: &[String]) -> Result<Plan> {
    let (shapes, qp_mem, peer) = match positional {
        [] => (Shape::ALL.to_vec(), false, None),
        [one] => match parse_shapes(one) {
            Ok((s, q)) => (s, q, None),
            // A lone argument that is not a shape is the peer.
            Err(_) if one.contains('.') || one.contains(':') || one == "localhost" => {
                (Shape::ALL.to_vec(), false, Some(one.clone()))
            }
            Err(e) => return Err(e),
        },
        [shapes, peer] => {
            let (s, q) = parse_shapes(shapes)?;
            (s, q, Some(peer.clone()))
        }
        _ => bail!("at most two arguments: SHAPES and PEER"),
    };
    Ok(Plan {
        shapes,
        qp_mem,
        peer,
    })
}

/// The largest size of perftest's -a.
const MAX_ALL_SIZE: usize = 8 << 20;

/// Every power of two from 2 B to 8 MiB (perftest -a).
fn all_sizes() -> Vec<usize> {
    (1..=23).map(|k| 1usize << k).collect()
}

fn default_iters(kind: Kind, size: usize) -> u64 {
    let size = size.max(1) as u64;
    match kind {
        Kind::Bw => ((1u64 << 30) / size).clamp(100, 200_000),
        Kind::Lat => ((256u64 << 20) / size).clamp(100, 5000),
    }
}

fn resolve(peer: &str, port: u16) -> Result<SocketAddr> {
    let with_port = if peer.parse::<SocketAddr>().is_ok()
        || peer
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.contains(':') && p.parse::<u16>().is_ok())
    {
        peer.to_string()
    } else if peer.contains(':') {
        format!("[{peer}]:{port}")
    } else {
        format!("{peer}:{port}")
    };
    with_port
        .to_socket_addrs()
        .with_context(|| format!("resolving {peer}"))?
        .next()
        .ok_or_else(|| anyhow!("{peer} resolves to nothing"))
}

fn loadavg() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Heap bytes per QP, measured by `qp_mem`.
#[derive(Debug, Clone, Copy)]
struct QpMemory {
    qps: usize,
    created: f64,
    connected: f64,
}

/// Creates `n` QP pairs between two devices of this process, connects them, and counts the
/// heap bytes they hold while idle (no receives posted, no regions).
fn qp_memory(device: &str, n: usize) -> Result<QpMemory> {
    use softwarp::{ConnectOptions, Device, Listener, QpInitAttr};
    ensure!(n > 0, "-q must be at least 1");
    let (da, db) = (Device::open(device)?, Device::open(device)?);
    let (pa, pb) = (da.alloc_pd()?, db.alloc_pd()?);
    let (ca, cb) = (da.create_cq(4096, None)?, db.create_cq(4096, None)?);
    let listener = Listener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let opts = ConnectOptions::default();
    // Let the progress threads and the allocator settle before the baseline.
    std::thread::sleep(Duration::from_millis(50));
    let base = cpu::live_bytes();
    let mut qa = Vec::with_capacity(n);
    let mut qb = Vec::with_capacity(n);
    for _ in 0..n {
        qa.push(pa.create_qp(&QpInitAttr::new(&ca, &ca))?);
        qb.push(pb.create_qp(&QpInitAttr::new(&cb, &cb))?);
    }
    let created = cpu::live_bytes() - base;
    std::thread::scope(|s| -> Result<()> {
        let acceptor = s.spawn(|| -> Result<()> {
            for q in &qb {
                listener.accept_timeout(q, &opts, Duration::from_secs(30))?;
            }
            Ok(())
        });
        for q in &qa {
            q.connect(addr, &opts)?;
        }
        acceptor
            .join()
            .map_err(|_| anyhow!("the accepting thread panicked"))?
    })?;
    // The progress threads register the sockets asynchronously.
    std::thread::sleep(Duration::from_millis(300));
    let connected = cpu::live_bytes() - base;
    let per = |b: isize| b as f64 / (2 * n) as f64;
    let m = QpMemory {
        qps: n,
        created: per(created),
        connected: per(connected),
    };
    drop((qa, qb));
    Ok(m)
}

/// Which end(s) of a session this process is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Role {
    /// No peer given (as perftest): serve one client session.
    Server,
    /// A peer given: the client of a two-process run.
    Client(String),
    /// `--loopback` (or `qp_mem` alone): both ends in this process.
    Loopback,
}

impl Role {
    fn name(&self) -> &'static str {
        match self {
            Role::Server => "server",
            Role::Client(_) => "client",
            Role::Loopback => "loopback",
        }
    }
}

/// The role, as perftest decides it (a peer: the client; none: the server), with
/// `--loopback` for both ends in this process.
fn role(args: &BenchArgs, plan: &Plan) -> Result<Role> {
    match (&plan.peer, args.loopback) {
        (Some(_), true) => bail!("--loopback runs both ends in this process: give no peer"),
        (Some(peer), false) => Ok(Role::Client(peer.clone())),
        (None, true) => Ok(Role::Loopback),
        // qp_mem alone measures this process.
        (None, false) if plan.qp_mem && plan.shapes.is_empty() => Ok(Role::Loopback),
        (None, false) if args.rdma_cm || args.positional.is_empty() => Ok(Role::Server),
        (None, false) => bail!(
            "no peer given, so this is the server (as perftest's `ib_write_bw` alone), and \
             the client chooses the shapes: give the server's address (`softwarp bench {} \
             HOST`), or --loopback to run both ends in this process",
            args.positional.join(" ")
        ),
    }
}

/// perftest's CPU frequency warning (`-F` hides it): a scaling governor other than
/// `performance` under `cpus` (`/sys/devices/system/cpu`) may change the clock during the
/// run. `None` when every CPU's governor is `performance` or there is no cpufreq.
fn cpufreq_warning(cpus: &std::path::Path) -> Option<String> {
    let mut governors: Vec<String> = std::fs::read_dir(cpus)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("cpu"))
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("cpufreq/scaling_governor")).ok())
        .map(|g| g.trim().to_string())
        .filter(|g| g != "performance")
        .collect();
    governors.sort();
    governors.dedup();
    (!governors.is_empty()).then(|| {
        format!(
            "CPU frequency scaling governor {} (not performance): the clock may change \
             during the run and skew the figures (-F hides this warning)",
            governors.join(", ")
        )
    })
}

/// How many CPUs this process may use, read once, before any thread is pinned: a pinned
/// thread's `available_parallelism` is 1, and the threads (and `ucx_perftest` processes) it
/// starts inherit its placement, so reading it later would put both ends on CPU 0.
fn cpus() -> usize {
    static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The CPU of the server side: 1, or 0 on a one-CPU machine.
fn server_cpu() -> usize {
    usize::from(cpus() > 1)
}

impl BenchArgs {
    /// The waiting mode (`-e` is `--mode event`; default busy, with `-R` spin).
    fn wait_mode(&self) -> Mode {
        match (self.events, self.mode) {
            (true, _) => Mode::Event,
            (false, Some(mode)) => mode,
            (false, None) if self.rdma_cm => Mode::Spin,
            (false, None) => Mode::Busy,
        }
    }
}

/// Runs `softwarp bench`.
pub fn run(args: &BenchArgs) -> Result<()> {
    // Before any thread is pinned (see `cpus`).
    let _ = cpus();
    let devices = softwarp::list_devices();
    ensure!(
        devices.contains(&args.device),
        "no Softwarp device {:?} (-d): the devices are {}",
        args.device,
        devices.join(", ")
    );
    if !args.cpu_freq {
        if let Some(w) = cpufreq_warning(std::path::Path::new("/sys/devices/system/cpu")) {
            eprintln!("softwarp bench: warning: {w}");
        }
    }
    let plan = plan(&args.positional)?;
    let role = role(args, &plan)?;
    if args.rdma_cm {
        return run_perftest(args, &plan, &role);
    }
    ensure!(
        args.rx_depth.is_none(),
        "-r is perftest's receive queue depth, used with -R; to repeat every measurement \
         use --runs (it was -r)"
    );
    ensure!(args.runs >= 1, "--runs must be at least 1");
    ensure!(
        (1..=4000).contains(&args.depth),
        "--tx-depth must be 1 to 4000"
    );
    ensure!(args.post_list >= 1, "--post_list must be at least 1");
    // The server takes the QP count from the client (its -q, if given, must match).
    if let (Some(q), false) = (args.qps, role == Role::Server) {
        check_qps(q, &plan.shapes)?;
    }
    if role == Role::Server {
        spin::set_yield_every(args.yield_every);
        if args.pin {
            cpu::pin_current_thread(server_cpu());
        }
        let l = Listeners::bind(args.bind, args.port)?;
        eprintln!(
            "softwarp bench: waiting for a client on {} (iWARP on port {}, TCP on port {})",
            l.ctrl_addr()?,
            l.rdma_port()?,
            l.tcp_port()?
        );
        return session::serve(&l, None, args.qps);
    }
    if plan.qp_mem {
        ensure!(plan.peer.is_none(), "qp_mem runs in this process only");
        ensure!(
            cpu::counting_installed(),
            "qp_mem counts heap bytes with a counting global allocator, which only the \
             softwarp-bench program installs (so that no other softwarp command runs on it): \
             run `softwarp-bench qp_mem`"
        );
    }
    spin::set_yield_every(args.yield_every);
    if args.pin {
        cpu::pin_current_thread(0);
    }
    let mut out = Output::new(args, &role);
    if plan.qp_mem {
        let m = qp_memory(&args.device, args.qps.unwrap_or(DEFAULT_QP_MEM_QPS))?;
        out.qp_memory(m);
    }
    if !plan.shapes.is_empty() {
        match &role {
            Role::Client(peer) => {
                let addr = resolve(peer, args.port)?;
                let client = Client::connect(addr, false)?;
                run_client(args, &plan, client, &mut out, false)?;
            }
            // (The server returned above.)
            Role::Loopback | Role::Server => {
                let l = Listeners::bind(IpAddr::V4(Ipv4Addr::LOCALHOST), 0)?;
                let addr = l.ctrl_addr()?;
                let pin = args.pin;
                let server = std::thread::Builder::new()
                    .name("bench-server".into())
                    .spawn(move || {
                        if pin {
                            cpu::pin_current_thread(server_cpu());
                        }
                        session::serve(&l, Some(Duration::from_secs(60)), None)
                    })?;
                let client = Client::connect(addr, true)?;
                let r = run_client(args, &plan, client, &mut out, true);
                let s = server
                    .join()
                    .map_err(|_| anyhow!("the server thread panicked"))?;
                r?;
                s.context("server")?;
            }
        }
    }
    out.finish()
}

/// `-q` with the shapes: perftest's bandwidth tests take it (N QPs between the same two
/// ends); its latency tests do not.
fn check_qps(q: usize, shapes: &[Shape]) -> Result<()> {
    if shapes.is_empty() {
        // qp_mem alone: -q is its QP count.
        return Ok(());
    }
    ensure!(
        (1..=session::MAX_QPS).contains(&q),
        "-q {q}: the shapes run on 1 to {} QPs",
        session::MAX_QPS
    );
    if q > 1 {
        let lat: Vec<&str> = shapes
            .iter()
            .filter(|s| s.kind == Kind::Lat)
            .map(|s| s.name())
            .collect();
        ensure!(
            lat.is_empty(),
            "-q {q} with {}: as in perftest, -q is for the bandwidth tests only (ib_*_lat \
             measure the round trip of one QP and take no -q); run the latency shapes \
             without -q (`all` includes them: list the _bw shapes)",
            lat.join(", ")
        );
    }
    Ok(())
}

/// QP pairs `qp_mem` creates without -q.
const DEFAULT_QP_MEM_QPS: usize = 256;

/// perftest's defaults: 64 KiB for bandwidth, 2 bytes for latency, 1000 iterations.
fn perftest_size(kind: Kind) -> usize {
    match kind {
        Kind::Bw => 65536,
        Kind::Lat => 2,
    }
}

/// `softwarp bench -R`: one perftest session per shape and size (server: exactly one).
fn run_perftest(args: &BenchArgs, plan: &Plan, role: &Role) -> Result<()> {
    ensure!(
        args.wait_mode() != Mode::Event,
        "-R polls its completion queues (spin or busy): no event mode"
    );
    ensure!(
        args.post_list == 1 && args.runs == 1,
        "-R runs perftest's plain tests, -a and -b: no --post_list or --runs"
    );
    ensure!(
        args.duration.is_none(),
        "-R with -D is not built: perftest's duration mode runs another exchange; give -n"
    );
    ensure!(
        args.qps.unwrap_or(1) == 1,
        "-R with -q above 1 is not built: this side of perftest's exchange sets up one \
         data connection per session (perftest's -q with -R opens one rdma_cm connection \
         and exchange per QP); without -R, -q runs N QPs between two softwarp ends"
    );
    let rx_depth = args.rx_depth.unwrap_or(DEFAULT_RX_DEPTH);
    ensure!(
        (1..=4000).contains(&args.depth),
        "--tx-depth must be 1 to 4000"
    );
    ensure!(
        (1..=4000).contains(&rx_depth),
        "--rx-depth must be 1 to 4000"
    );
    ensure!(!plan.qp_mem, "qp_mem has no perftest counterpart");
    spin::set_yield_every(args.yield_every);
    // -a: every power of two from 2 B to 8 MiB on one pair of connections (perftest's
    // -a); one -s caps it (both ends must agree: perftest always goes up to 8 MiB).
    if args.all {
        ensure!(
            args.sizes.len() <= 1,
            "-R -a takes at most one -s: the largest size"
        );
    }
    let params = |shape: Shape, size: usize| perftest::Params {
        shape,
        size,
        all: args.all,
        bidir: args.bidirectional,
        iters: args.iters.unwrap_or(1000),
        tx_depth: args.depth,
        rx_depth,
        out_reads: args.out_reads.max(1),
        crc: args.crc,
        busy: args.wait_mode() == Mode::Busy,
        accept_timeout: Duration::from_secs(args.accept_timeout),
    };
    let sizes = |shape: Shape| -> Vec<usize> {
        if args.all {
            vec![args.sizes.first().copied().unwrap_or(MAX_ALL_SIZE)]
        } else if args.sizes.is_empty() {
            vec![perftest_size(shape.kind)]
        } else {
            args.sizes.clone()
        }
    };
    let mut out = Output::new(args, role);
    let single = *role != Role::Loopback;
    if single {
        ensure!(
            plan.shapes.len() == 1 && sizes(plan.shapes[0]).len() == 1,
            "-R with a perftest peer runs one shape and one size (or -a) per session (as \
             perftest does): give exactly one shape and at most one -s"
        );
    }
    out.note("perftest exchange (-R): no raw TCP baseline in this run (the peer speaks perftest's protocol, not ours)");
    if args.all && args.sizes.first().is_some_and(|&s| s != MAX_ALL_SIZE) {
        out.note("-a with -s: sizes up to -s only; a perftest peer's -a always goes up to 8 MiB, so this works only between two softwarp ends");
    }
    for &shape in &plan.shapes {
        for size in sizes(shape) {
            let p = params(shape, size);
            let label = if args.all {
                format!("-a up to {}", fmt_size(size))
            } else {
                fmt_size(size)
            };
            let outcome = if *role == Role::Server {
                let bind = SocketAddr::new(args.bind, args.port);
                let (tx, rx) = std::sync::mpsc::channel();
                let waiter = std::thread::spawn(move || {
                    if let Ok(a) = rx.recv() {
                        eprintln!("softwarp bench -R: {shape} server listening on {a}");
                    }
                });
                let r = perftest::server(bind, &p, Some(tx));
                let _ = waiter.join();
                r?
            } else if let Role::Client(peer) = role {
                perftest::client(resolve(peer, args.port)?, &p)?
            } else {
                let (tx, rx) = std::sync::mpsc::channel();
                let server = std::thread::Builder::new()
                    .name("bench-perftest-server".into())
                    .spawn(move || {
                        perftest::server(
                            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
                            &p,
                            Some(tx),
                        )
                    })?;
                let addr = rx
                    .recv_timeout(Duration::from_secs(30))
                    .map_err(|_| anyhow!("the loopback perftest server did not start"))?;
                let c = perftest::client(addr, &p);
                let s = server
                    .join()
                    .map_err(|_| anyhow!("the server thread panicked"))?;
                let s = s.context("server")?;
                let c = c?;
                out.note(&format!(
                    "{shape} {label}: server saw {}",
                    describe_outcome(&s)
                ));
                c
            };
            out.note(&format!(
                "{shape} {label}: peer perftest version {}, data connection {}",
                outcome.peer_version, outcome.data_conn
            ));
            if outcome.rows.is_empty() {
                out.note(&format!(
                    "{shape} {label}: this side is passive in {shape} and has no figures of its own"
                ));
            } else if args.all
                && !args.bidirectional
                && outcome.rows.len() == 1
                && outcome.report.is_some()
            {
                out.note(&format!(
                    "{shape} -a: this side is passive; perftest exchanges only the last size's report, so one row"
                ));
            }
            for r in outcome.rows {
                out.row(Row {
                    spec: Spec {
                        shape,
                        max_size: size,
                        depth: if shape.kind == Kind::Bw {
                            args.depth
                        } else {
                            1
                        },
                        bidir: args.bidirectional,
                        crc: args.crc,
                        mode: args.wait_mode(),
                        fpdu: 0,
                        alias_lead: true,
                        post_list: 1,
                        qps: 1,
                    },
                    size: r.size,
                    iters: r.iters,
                    sw: vec![r.timed],
                    tcp: Vec::new(),
                    ucx: None,
                });
            }
        }
    }
    out.finish()
}

fn describe_outcome(o: &perftest::Outcome) -> String {
    match (o.rows.as_slice(), &o.report) {
        (_, Some(r)) => format!(
            "the client's report: {} B x {}, {:.2} MB/s, {:.4} Mmsg/s",
            r.size, r.iters, r.bw_avg, r.msg_rate
        ),
        ([], None) => "no figures (passive side)".into(),
        (rows, None) => rows
            .iter()
            .map(|r| format!("{} {:.6} s", fmt_size(r.size), r.timed.secs))
            .collect::<Vec<_>>()
            .join(", "),
    }
}

/// `-D`: the iterations that make a run last about `secs` seconds, from one calibration
/// run of a twentieth of the default iterations (at least 10).
/// Runs Softwarp and (with `tcp`) the TCP baseline alternately through `run`, unmeasured,
/// until `ms` milliseconds passed (at most [`WARMUP_ROUNDS`] rounds): see `--warmup-ms`.
fn warm_up(ms: u64, tcp: bool, mut run: impl FnMut(Which) -> Result<()>) -> Result<()> {
    let until = Instant::now() + Duration::from_millis(ms);
    for _ in 0..WARMUP_ROUNDS {
        if Instant::now() >= until {
            break;
        }
        run(Which::Softwarp)?;
        if tcp {
            run(Which::Tcp)?;
        }
    }
    Ok(())
}

/// The most rounds of [`warm_up`] (runs of a tenth of the iterations each).
const WARMUP_ROUNDS: usize = 100;

fn iters_for(secs: u64, default: u64, mut run: impl FnMut(u64) -> Result<Timed>) -> Result<u64> {
    let probe = (default / 20).max(10);
    let t = run(probe)?;
    let per_iter = t.secs.max(1e-9) / probe as f64;
    Ok(((secs as f64 / per_iter).ceil() as u64).clamp(probe, u64::from(u32::MAX)))
}

/// `--ucx`: the installed `ucx_perftest`, or why there is no UCX row (a note).
fn ucx_binary(
    args: &BenchArgs,
    role_is_loopback: bool,
    out: &mut Output,
) -> Option<std::path::PathBuf> {
    if !args.ucx {
        return None;
    }
    if !role_is_loopback {
        out.note("--ucx: UCX runs on loopback only (both ucx_perftest ends on this machine): use --loopback; no UCX rows");
        return None;
    }
    if args.bidirectional || args.qps.unwrap_or(1) > 1 {
        out.note("--ucx: no UCX rows with -b or -q above 1 (ucx_perftest's tests here are one direction, one endpoint)");
        return None;
    }
    let bin = ucx::find();
    if bin.is_none() {
        out.note(
            "--ucx: ucx_perftest is not installed (Debian: apt install ucx-utils); no UCX rows",
        );
    }
    bin
}

fn run_client(
    args: &BenchArgs,
    plan: &Plan,
    mut client: Client,
    out: &mut Output,
    loopback: bool,
) -> Result<()> {
    let tcp = !args.no_tcp;
    let ucx_bin = ucx_binary(args, loopback, out);
    let mut todo = Vec::new();
    for &shape in &plan.shapes {
        if shape == Shape::ALL[3] && args.wait_mode() == Mode::Event {
            out.note(&format!(
                "{shape}: skipped in event mode (it polls memory, as perftest's ib_write_lat)"
            ));
            continue;
        }
        let sizes = if args.all {
            all_sizes()
        } else if !args.sizes.is_empty() {
            args.sizes.clone()
        } else {
            vec![match shape.kind {
                Kind::Bw => 65536,
                Kind::Lat => 8,
            }]
        };
        ensure!(
            sizes.iter().all(|&s| s >= 1),
            "sizes must be at least 1 byte"
        );
        todo.push((shape, sizes));
    }
    let units: usize = todo
        .iter()
        .map(|(_, s)| s.len() * args.runs * (1 + usize::from(tcp)))
        .sum();
    let mut bar = progress::Bar::new(units as u64);
    for (shape, sizes) in todo {
        let spec = Spec {
            shape,
            max_size: sizes.iter().copied().max().unwrap_or(1),
            depth: if shape.kind == Kind::Bw {
                args.depth
            } else {
                1
            },
            bidir: args.bidirectional,
            crc: args.crc,
            mode: args.wait_mode(),
            fpdu: args.fpdu.unwrap_or(0),
            alias_lead: !args.no_alias_lead,
            post_list: if shape.kind == Kind::Bw {
                args.post_list
            } else {
                1
            },
            qps: args.qps.unwrap_or(1),
        };
        client.shape(spec, tcp, |conn| {
            for &size in &sizes {
                let iters = match (args.iters, args.duration) {
                    (Some(n), _) => n,
                    (None, Some(secs)) => {
                        bar.label(format!("{shape} {} calibrating -D", fmt_size(size)));
                        iters_for(secs, default_iters(shape.kind, size), |n| {
                            conn.run(Which::Softwarp, size, n)
                        })?
                    }
                    (None, None) => default_iters(shape.kind, size),
                };
                let n = (iters / 10).max(1);
                warm_up(args.warmup_ms, tcp, |which| conn.run(which, size, n).map(|_| ()))?;
                let ucx_test = ucx_bin.as_ref().and_then(|_| ucx::test_for(shape));
                let mut row = Row {
                    spec,
                    size,
                    iters,
                    sw: Vec::new(),
                    tcp: Vec::new(),
                    ucx: ucx_test.map(|t| (t, Vec::new())),
                };
                let mut ucx_failed = None;
                for r in 0..args.runs {
                    // Alternate the two stacks so both see the same machine.
                    bar.label(format!(
                        "{shape} {} run {}/{} softwarp",
                        fmt_size(size),
                        r + 1,
                        args.runs
                    ));
                    row.sw.push(conn.run(Which::Softwarp, size, iters)?);
                    bar.inc(1);
                    if tcp {
                        bar.label(format!(
                            "{shape} {} run {}/{} TCP",
                            fmt_size(size),
                            r + 1,
                            args.runs
                        ));
                        row.tcp.push(conn.run(Which::Tcp, size, iters)?);
                        bar.inc(1);
                    }
                    if let (Some(bin), Some((test, runs)), None) =
                        (&ucx_bin, row.ucx.as_mut(), &ucx_failed)
                    {
                        bar.label(format!(
                            "{shape} {} run {}/{} UCX {}",
                            fmt_size(size),
                            r + 1,
                            args.runs,
                            test.name
                        ));
                        let p = ucx::Params {
                            size,
                            iters,
                            pin: args.pin.then(server_cpu),
                        };
                        match ucx::run(bin, *test, &p) {
                            Ok(u) => runs.push(u),
                            Err(e) => ucx_failed = Some(e),
                        }
                    }
                }
                bar.finish();
                if let Some(e) = ucx_failed {
                    row.ucx = None;
                    out.note(&format!("--ucx: {shape} {}: {e:#}", fmt_size(size)));
                } else if ucx_bin.is_some() && row.ucx.is_none() && size == sizes[0] {
                    out.note(&format!(
                        "--ucx: {shape} has no UCX counterpart over TCP (UCX's tcp transport has no get)"
                    ));
                }
                out.row(row);
            }
            Ok(())
        })?;
    }
    bar.finish();
    client.bye()
}

/// Collects and prints results (a table as they come, or one JSON document at the end).
struct Output {
    json: bool,
    unit: BwUnit,
    rdma_cm: bool,
    config: Config,
    rows: Vec<Row>,
    notes: Vec<String>,
    qp_mem: Option<QpMemory>,
    printed_header: bool,
}

impl Output {
    fn new(args: &BenchArgs, role: &Role) -> Self {
        let peer = match role {
            Role::Client(peer) => peer.clone(),
            Role::Server | Role::Loopback => "127.0.0.1".into(),
        };
        let config = Config {
            role: role.name().into(),
            peer,
            device: args.device.clone(),
            mode: args.wait_mode(),
            crc: args.crc,
            depth: args.depth,
            post_list: args.post_list,
            bidirectional: args.bidirectional,
            qps: if args.rdma_cm {
                1
            } else {
                args.qps.unwrap_or(1)
            },
            runs: args.runs,
            duration_secs: args.duration,
            max_fpdu: args.fpdu.unwrap_or(0),
            pinned: args.pin,
            warmup_ms: args.warmup_ms,
            cpus: cpus(),
            load_1m: loadavg(),
            build: if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            }
            .into(),
        };
        Self {
            json: args.json,
            unit: if args.report_gbits {
                BwUnit::Gbps
            } else {
                BwUnit::MiBps
            },
            rdma_cm: args.rdma_cm,
            config,
            rows: Vec::new(),
            notes: Vec::new(),
            qp_mem: None,
            printed_header: false,
        }
    }

    fn header(&self) -> String {
        let c = &self.config;
        format!(
            "softwarp bench: {} {}, device {}, mode {}{}, CRC {}, depth {}, post list {}, {}{}{} run(s) per number (median){}, FPDU {}, threads {}, load {}, {} build",
            c.role,
            c.peer,
            c.device,
            c.mode.name(),
            if self.rdma_cm { " (-R)" } else { "" },
            if c.crc { "on" } else { "off" },
            c.depth,
            c.post_list,
            if c.bidirectional { "bidirectional, " } else { "" },
            if c.qps > 1 {
                format!("{} QPs per bandwidth shape (aggregate figures, iters per QP), ", c.qps)
            } else {
                String::new()
            },
            c.runs,
            c.duration_secs
                .map_or(String::new(), |d| format!(" of about {d} s")),
            if c.max_fpdu == 0 {
                "the connection's default (the MSS; 65,535 B to this host)".into()
            } else {
                format!("up to {} B", c.max_fpdu)
            },
            if c.pinned {
                "pinned (client CPU 0, server CPU 1)"
            } else {
                "not pinned"
            },
            c.load_1m.map_or("?".into(), |l| format!("{l:.2}")),
            c.build,
        )
    }

    fn print_header(&mut self) {
        if !self.json && !self.printed_header {
            println!("{}", self.header());
            println!("{}", Row::text_header());
            self.printed_header = true;
        }
    }

    fn note(&mut self, s: &str) {
        if !self.json {
            self.print_header();
            println!("# {s}");
        }
        self.notes.push(s.to_string());
    }

    fn row(&mut self, row: Row) {
        if !self.json {
            self.print_header();
            println!("{}", row.text(self.unit));
        }
        self.rows.push(row);
    }

    fn qp_memory(&mut self, m: QpMemory) {
        if !self.json {
            self.print_header();
            println!(
                "qp_mem     {} connected idle QP pairs: {:.0} B of heap per QP ({:.0} B at creation, {:.0} B more once connected); receive buffers and kernel socket buffers not included",
                m.qps,
                m.connected,
                m.created,
                m.connected - m.created
            );
        }
        self.qp_mem = Some(m);
    }

    /// The JSON document of everything collected.
    fn document(&self) -> Document {
        Document {
            tool: "softwarp bench".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            config: self.config.clone(),
            results: self.rows.iter().map(Row::result).collect(),
            qp_memory: self.qp_mem.map(|m| QpMemoryResult {
                qps: m.qps,
                heap_bytes_per_qp: m.connected,
                heap_bytes_per_qp_created: m.created,
            }),
            notes: self.notes.clone(),
        }
    }

    /// Prints the JSON document (with `--json`; the table is already out otherwise).
    fn finish(&self) -> Result<()> {
        if self.json {
            println!("{}", serde_json::to_string(&self.document())?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cmd {
        #[command(flatten)]
        args: BenchArgs,
    }

    /// `--pin` in one process: the client pins the main thread to CPU 0 and then starts the
    /// server thread (and UCX's processes), which must still go to CPU 1. Reading the CPU
    /// count in the pinned thread put both ends on CPU 0 (2026-11-28).
    #[test]
    fn a_pinned_client_still_places_the_server_on_cpu_1() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        let _ = cpus(); // as `run` does before pinning
        std::thread::spawn(move || {
            if n < 2 || !cpu::pin_current_thread(0) {
                eprintln!("skipped: one CPU, or pinning refused");
                return;
            }
            assert_eq!(
                std::thread::available_parallelism().map_or(1, |n| n.get()),
                1
            );
            let inner = std::thread::spawn(server_cpu).join().unwrap();
            assert_eq!((server_cpu(), inner), (1, 1));
        })
        .join()
        .unwrap();
    }

    fn args(v: &[&str]) -> Result<BenchArgs, clap::Error> {
        Cmd::try_parse_from(std::iter::once("bench").chain(v.iter().copied())).map(|c| c.args)
    }

    fn role_of(v: &[&str]) -> Result<Role> {
        let a = args(v)?;
        role(&a, &plan(&a.positional)?)
    }

    #[test]
    fn perftest_flags_keep_perftest_meanings() {
        let a = args(&[
            "-s",
            "64K,1M",
            "-D",
            "3",
            "-q",
            "1",
            "-d",
            "softwarp0",
            "--report_gbits",
            "-F",
            "-t",
            "32",
            "-l",
            "4",
            "-e",
            "-r",
            "64",
            "-o",
            "8",
            "-R",
            "write_bw",
        ])
        .unwrap();
        assert_eq!(a.sizes, vec![65536, 1 << 20]);
        assert_eq!(a.duration, Some(3));
        assert_eq!(a.qps, Some(1));
        assert_eq!(a.device, "softwarp0");
        assert!(a.report_gbits && a.cpu_freq && a.rdma_cm);
        assert_eq!(
            (a.depth, a.post_list, a.rx_depth, a.out_reads),
            (32, 4, Some(64), 8)
        );
        assert_eq!(a.wait_mode(), Mode::Event);
        // perftest's long spellings too.
        let a = args(&[
            "--size",
            "8",
            "--duration",
            "2",
            "--qp",
            "3",
            "--ib-dev",
            "x",
            "--post_list",
            "2",
            "--CPU-freq",
            "--rx-depth",
            "5",
            "--outs",
            "4",
        ])
        .unwrap();
        assert_eq!(
            (a.sizes[0], a.duration, a.qps, a.post_list),
            (8, Some(2), Some(3), 2)
        );
        assert!(args(&["-n", "5", "-D", "1"]).is_err(), "-n and -D together");
    }

    #[test]
    fn the_default_mode_is_busy_and_with_rdma_cm_spin() {
        assert_eq!(args(&[]).unwrap().wait_mode(), Mode::Busy);
        assert_eq!(args(&["-R"]).unwrap().wait_mode(), Mode::Spin);
        assert_eq!(
            args(&["-R", "--mode", "busy"]).unwrap().wait_mode(),
            Mode::Busy
        );
        assert_eq!(args(&["--mode", "spin"]).unwrap().wait_mode(), Mode::Spin);
        assert_eq!(args(&["-R", "-e"]).unwrap().wait_mode(), Mode::Event);
    }

    #[test]
    fn no_peer_is_the_server_a_peer_the_client_and_loopback_is_asked_for() {
        assert_eq!(role_of(&[]).unwrap(), Role::Server);
        assert_eq!(role_of(&["-R", "write_lat"]).unwrap(), Role::Server);
        assert_eq!(
            role_of(&["write_bw", "10.0.0.2"]).unwrap(),
            Role::Client("10.0.0.2".into())
        );
        assert_eq!(
            role_of(&["10.0.0.2"]).unwrap(),
            Role::Client("10.0.0.2".into())
        );
        assert_eq!(role_of(&["--loopback"]).unwrap(), Role::Loopback);
        assert_eq!(
            role_of(&["-R", "send_bw", "--loopback"]).unwrap(),
            Role::Loopback
        );
        assert_eq!(role_of(&["qp_mem"]).unwrap(), Role::Loopback);
        // Shapes and no peer: the old loopback spelling, refused with the new one.
        let e = role_of(&["write_bw"]).unwrap_err().to_string();
        assert!(
            e.contains("this is the server") && e.contains("--loopback"),
            "{e}"
        );
        assert!(role_of(&["write_bw", "h:1", "--loopback"]).is_err());
    }

    #[test]
    fn old_spellings_are_refused_with_the_new_one() {
        // -s was the server.
        for v in [&["-s"][..], &["-s", "-p", "0"], &["-R", "-s", "write_lat"]] {
            let e = args(v).unwrap_err().to_string();
            assert!(e.contains("-s is the message size now"), "{v:?}: {e}");
            assert!(e.contains("the side given no peer"), "{v:?}: {e}");
        }
        // -S was the size.
        let e = args(&["--loopback", "-S", "64K"]).unwrap_err().to_string();
        assert!(e.contains("the size is -s now"), "{e}");
        // A bad number is an ordinary size error.
        let e = args(&["-s", "9G"]).unwrap_err().to_string();
        assert!(e.contains("too large") && !e.contains("server"), "{e}");
    }

    #[test]
    fn the_cpu_frequency_warning_names_governors_other_than_performance() {
        let dir =
            std::env::temp_dir().join(format!("softwarp-bench-cpufreq-{}", std::process::id()));
        let governor = |cpu: &str, g: &str| {
            let d = dir.join(cpu).join("cpufreq");
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("scaling_governor"), format!("{g}\n")).unwrap();
        };
        governor("cpu0", "performance");
        assert_eq!(cpufreq_warning(&dir), None);
        governor("cpu1", "ondemand");
        governor("cpu2", "ondemand");
        governor("cpufreq", "powersave"); // not a CPU
        let w = cpufreq_warning(&dir).unwrap();
        assert!(w.contains("governor ondemand (") && w.contains("-F"), "{w}");
        assert_eq!(cpufreq_warning(&dir.join("none")), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn duration_iterations_come_from_a_calibration_run() {
        let mut probes = Vec::new();
        // 1 ms per iteration: 3 s is 3000 iterations.
        let n = iters_for(3, 5000, |n| {
            probes.push(n);
            Ok(Timed {
                secs: n as f64 * 1e-3,
                cpu: 0.0,
                rtt: None,
                bytes: 0,
            })
        })
        .unwrap();
        assert_eq!(probes, vec![250]);
        assert_eq!(n, 3000);
    }

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn positionals_are_shapes_then_peer_and_a_lone_address_is_the_peer() {
        let p = plan(&[]).unwrap();
        assert_eq!(p.shapes, Shape::ALL.to_vec());
        assert_eq!(p.peer, None);
        let p = plan(&s(&["write_bw,ib_read_lat"])).unwrap();
        assert_eq!(p.shapes, vec![Shape::ALL[0], Shape::ALL[5]]);
        let p = plan(&s(&["10.0.0.2"])).unwrap();
        assert_eq!(p.shapes, Shape::ALL.to_vec());
        assert_eq!(p.peer.as_deref(), Some("10.0.0.2"));
        let p = plan(&s(&["send_lat", "host:9"])).unwrap();
        assert_eq!(p.peer.as_deref(), Some("host:9"));
        let p = plan(&s(&["qp_mem"])).unwrap();
        assert!(p.qp_mem && p.shapes.is_empty());
        assert!(plan(&s(&["bogus"])).is_err());
    }

    #[test]
    fn all_sizes_are_the_powers_of_two_from_2_bytes_to_8_mib() {
        let a = all_sizes();
        assert_eq!(a.first(), Some(&2));
        assert_eq!(a.last(), Some(&(8 << 20)));
        assert_eq!(a.len(), 23);
    }

    #[test]
    fn peer_addresses_get_the_default_port_unless_they_name_one() {
        assert_eq!(resolve("127.0.0.1", 7).unwrap().port(), 7);
        assert_eq!(resolve("127.0.0.1:9", 7).unwrap().port(), 9);
        assert_eq!(resolve("::1", 7).unwrap().port(), 7);
        assert_eq!(resolve("[::1]:9", 7).unwrap().port(), 9);
    }

    #[test]
    fn the_warm_up_alternates_both_stacks_for_its_time_and_no_longer() {
        let mut seen = Vec::new();
        warm_up(0, true, |w| {
            seen.push(w);
            Ok(())
        })
        .unwrap();
        assert!(seen.is_empty(), "no warm-up at 0 ms");
        // Load-independent checks (a loaded machine stretches the 5 ms sleeps, so the count
        // of rounds is not fixed): it ran until its time was up, and started no round after.
        let t0 = Instant::now();
        let mut starts = Vec::new();
        warm_up(30, true, |w| {
            seen.push(w);
            starts.push(Instant::now());
            std::thread::sleep(Duration::from_millis(5));
            Ok(())
        })
        .unwrap();
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(30), "{took:?}");
        assert!(seen.len() >= 2 && seen.len() % 2 == 0, "{seen:?}");
        let last_round = starts[starts.len() - 2];
        assert!(
            last_round.duration_since(starts[0]) < Duration::from_millis(30),
            "a round started after the warm-up's time: {:?}",
            last_round.duration_since(starts[0])
        );
        assert!(seen.chunks(2).all(|c| c == [Which::Softwarp, Which::Tcp]));
        seen.clear();
        warm_up(30, false, |w| {
            seen.push(w);
            Ok(())
        })
        .unwrap();
        assert!(seen.iter().all(|&w| w == Which::Softwarp));
        assert_eq!(seen.len(), WARMUP_ROUNDS, "bounded in rounds");
    }
}
