//! `softwarp bench`: perftest's six shapes (`ib_send_bw`, `ib_write_bw`, `ib_read_bw`,
//! `ib_send_lat`, `ib_write_lat`, `ib_read_lat`) over Softwarp, each next to a raw TCP
//! baseline measured in the same invocation (same sizes, same threads, `TCP_NODELAY`), so
//! that results read as ratios that survive a noisy machine.
//!
//! Roles: `-s` serves one client session; with a peer address it is the client; with
//! neither, server and client run in this process (two threads, loopback). The client and
//! the server agree on everything over a TCP control channel ([`session`]); the data
//! moves over one iWARP connection and one TCP connection per shape.
//!
//! `qp_mem` is a seventh, non-perftest measurement: heap bytes per connected, idle QP.
//!
//! With `-R` the tool speaks perftest's own rdma_cm exchange instead ([`perftest`]), so that
//! the peer can be perftest's `ib_*_bw`/`ib_*_lat -R` (there is no TCP baseline then).

mod cpu;
mod ctrl;
mod perftest;
mod progress;
mod rdma;
mod report;
mod session;
mod spec;
mod spin;
mod tcp;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context, Result};

use self::report::{jnum, jstr, Row};
use self::session::{Client, Listeners, Which};
pub use self::spec::Mode;
use self::spec::{fmt_size, parse_size, Kind, Shape, Spec};

pub use self::cpu::CountingAlloc;

/// perftest's default port; the iWARP and TCP baseline listeners use the next two.
const DEFAULT_PORT: u16 = 18515;

/// Options of `softwarp bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// What to run, then (client role) the server's address: `[SHAPES] [PEER]`. SHAPES is
    /// a comma-separated list of send_bw, write_bw, read_bw, send_lat, write_lat,
    /// read_lat (an `ib_` prefix is fine), `all` (the six), or `qp_mem` (heap bytes per
    /// connected idle QP). Default: all. PEER is a host or host:port.
    #[arg(value_name = "SHAPES|PEER", num_args = 0..=2)]
    positional: Vec<String>,
    /// Be the server: wait for one client session on --port, then exit.
    #[arg(short = 's', long)]
    server: bool,
    /// Control port (the server also listens on PORT+1 for iWARP and PORT+2 for TCP; 0:
    /// three free ports, printed when the server starts).
    #[arg(short = 'p', long, default_value_t = DEFAULT_PORT)]
    port: u16,
    /// Address the server binds (default: all addresses).
    #[arg(long, default_value = "0.0.0.0")]
    bind: IpAddr,
    /// Message sizes (comma-separated; K and M suffixes are powers of 1024). Default:
    /// 64K for bandwidth shapes, 8 for latency shapes.
    #[arg(short = 'S', long = "size", value_delimiter = ',', value_parser = parse_size)]
    sizes: Vec<usize>,
    /// Every size from 2 B to 8 MiB (powers of two), as perftest's -a. With -R: all of them
    /// on one pair of connections, as perftest does (one -S then caps the sizes, for two
    /// softwarp ends only).
    #[arg(short = 'a', long)]
    all: bool,
    /// Iterations per size (default: about 1 GiB per size for bandwidth, clamped to
    /// 100..200000; 5000 for latency, fewer for sizes above 64 KiB).
    #[arg(short = 'n', long)]
    iters: Option<u64>,
    /// Outstanding work requests of bandwidth shapes (perftest -t).
    #[arg(short = 't', long = "tx-depth", default_value_t = 128)]
    depth: usize,
    /// Post work requests in lists of this many (perftest --post_list); the TCP baseline
    /// writes the same number of records per system call.
    #[arg(short = 'l', long = "post-list", default_value_t = 1)]
    post_list: usize,
    /// Both directions at once (bandwidth shapes: both directions added up).
    #[arg(short = 'b', long)]
    bidirectional: bool,
    /// CRC32c on every FPDU.
    #[arg(long, default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    crc: bool,
    /// How completions are waited for: busy (the CQ poll drives the QP: no thread
    /// wake-ups), spin (spin on the CQ; the progress thread moves the bytes), or event
    /// (completion channel).
    #[arg(long, value_enum, default_value = "busy")]
    mode: Mode,
    /// Largest FPDU to send (default: the TCP MSS).
    #[arg(long)]
    fpdu: Option<usize>,
    /// Repeat every measurement this many times and report the median.
    #[arg(short = 'r', long, default_value_t = 1)]
    runs: usize,
    /// Skip the raw TCP baseline.
    #[arg(long)]
    no_tcp: bool,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    json: bool,
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
    /// Connected QP pairs created by `qp_mem`.
    #[arg(long, default_value_t = 256)]
    qps: usize,
    /// Speak perftest's own exchange over rdma_cm (perftest -R), to run against
    /// `ib_send_bw`, `ib_write_bw`, `ib_read_bw` and the `_lat` tools (or another
    /// `softwarp bench -R`): one shape and one size (or -a) per session, both connections
    /// to --port. The server must be given the shape (perftest never sends it).
    #[arg(short = 'R', long = "rdma_cm")]
    rdma_cm: bool,
    /// With -R: receive queue depth of send_bw's receiver (perftest -r), which is also the
    /// sender's credit window.
    #[arg(long = "rx-depth", default_value_t = 512)]
    rx_depth: usize,
    /// With -R: outstanding RDMA Reads (perftest -o), the IRD/ORD of the data connection
    /// of the Read shapes (at most the device's limit).
    #[arg(long = "out-reads", default_value_t = 128)]
    out_reads: usize,
    /// With -R: seconds the server waits for a client.
    #[arg(long = "accept-timeout", default_value_t = 120)]
    accept_timeout: u64,
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
fn qp_memory(n: usize) -> Result<QpMemory> {
    use softwarp::{ConnectOptions, Device, Listener, QpInitAttr};
    ensure!(n > 0, "--qps must be at least 1");
    let (da, db) = (Device::open_default()?, Device::open_default()?);
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

/// The CPU of the server side: 1, or 0 on a one-CPU machine.
fn server_cpu() -> usize {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    usize::from(n > 1)
}

/// Runs `softwarp bench`.
pub fn run(args: &BenchArgs) -> Result<()> {
    if args.rdma_cm {
        return run_perftest(args);
    }
    ensure!(args.runs >= 1, "--runs must be at least 1");
    ensure!(
        (1..=4000).contains(&args.depth),
        "--tx-depth must be 1 to 4000"
    );
    ensure!(args.post_list >= 1, "--post-list must be at least 1");
    if args.server {
        ensure!(
            args.positional.is_empty(),
            "the server takes no shapes or peer: the client chooses"
        );
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
        return session::serve(&l, None);
    }
    let plan = plan(&args.positional)?;
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
    let mut out = Output::new(args, &plan);
    if plan.qp_mem {
        let m = qp_memory(args.qps)?;
        out.qp_memory(m);
    }
    if !plan.shapes.is_empty() {
        match &plan.peer {
            Some(peer) => {
                let addr = resolve(peer, args.port)?;
                let client = Client::connect(addr, false)?;
                run_client(args, &plan, client, &mut out)?;
            }
            None => {
                let l = Listeners::bind(IpAddr::V4(Ipv4Addr::LOCALHOST), 0)?;
                let addr = l.ctrl_addr()?;
                let pin = args.pin;
                let server = std::thread::Builder::new()
                    .name("bench-server".into())
                    .spawn(move || {
                        if pin {
                            cpu::pin_current_thread(server_cpu());
                        }
                        session::serve(&l, Some(Duration::from_secs(60)))
                    })?;
                let client = Client::connect(addr, true)?;
                let r = run_client(args, &plan, client, &mut out);
                let s = server
                    .join()
                    .map_err(|_| anyhow!("the server thread panicked"))?;
                r?;
                s.context("server")?;
            }
        }
    }
    out.finish();
    Ok(())
}

/// perftest's defaults: 64 KiB for bandwidth, 2 bytes for latency, 1000 iterations.
fn perftest_size(kind: Kind) -> usize {
    match kind {
        Kind::Bw => 65536,
        Kind::Lat => 2,
    }
}

/// `softwarp bench -R`: one perftest session per shape and size (server: exactly one).
fn run_perftest(args: &BenchArgs) -> Result<()> {
    ensure!(
        args.mode != Mode::Event,
        "-R spins on completions (the progress thread moves the bytes): no event mode"
    );
    ensure!(
        args.post_list == 1 && args.runs == 1,
        "-R runs perftest's plain tests, -a and -b: no --post-list or --runs"
    );
    ensure!(
        (1..=4000).contains(&args.depth),
        "--tx-depth must be 1 to 4000"
    );
    ensure!(
        (1..=4000).contains(&args.rx_depth),
        "--rx-depth must be 1 to 4000"
    );
    let plan = plan(&args.positional)?;
    ensure!(!plan.qp_mem, "qp_mem has no perftest counterpart");
    spin::set_yield_every(args.yield_every);
    // -a: every power of two from 2 B to 8 MiB on one pair of connections (perftest's
    // -a); one -S caps it (both ends must agree: perftest always goes up to 8 MiB).
    if args.all {
        ensure!(
            args.sizes.len() <= 1,
            "-R -a takes at most one -S: the largest size"
        );
    }
    let params = |shape: Shape, size: usize| perftest::Params {
        shape,
        size,
        all: args.all,
        bidir: args.bidirectional,
        iters: args.iters.unwrap_or(1000),
        tx_depth: args.depth,
        rx_depth: args.rx_depth,
        out_reads: args.out_reads.max(1),
        crc: args.crc,
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
    let role = if args.server {
        "server"
    } else if plan.peer.is_some() {
        "client"
    } else {
        "loopback"
    };
    let mut out = Output::new(args, &plan);
    out.set_role(role);
    let single = args.server || plan.peer.is_some();
    if single {
        ensure!(
            plan.shapes.len() == 1 && sizes(plan.shapes[0]).len() == 1,
            "-R with a perftest peer runs one shape and one size (or -a) per session (as \
             perftest does): give exactly one shape and at most one -S"
        );
    }
    out.note("perftest exchange (-R): no raw TCP baseline in this run (the peer speaks perftest's protocol, not ours)");
    if args.all && args.sizes.first().is_some_and(|&s| s != MAX_ALL_SIZE) {
        out.note("-a with -S: sizes up to -S only; a perftest peer's -a always goes up to 8 MiB, so this works only between two softwarp ends");
    }
    for &shape in &plan.shapes {
        for size in sizes(shape) {
            let p = params(shape, size);
            let label = if args.all {
                format!("-a up to {}", fmt_size(size))
            } else {
                fmt_size(size)
            };
            let outcome = if args.server {
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
            } else if let Some(peer) = &plan.peer {
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
                        mode: Mode::Spin,
                        fpdu: 0,
                        post_list: 1,
                    },
                    size: r.size,
                    iters: r.iters,
                    sw: vec![r.timed],
                    tcp: Vec::new(),
                });
            }
        }
    }
    out.finish();
    Ok(())
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

fn run_client(args: &BenchArgs, plan: &Plan, mut client: Client, out: &mut Output) -> Result<()> {
    let tcp = !args.no_tcp;
    let mut todo = Vec::new();
    for &shape in &plan.shapes {
        if shape == Shape::ALL[3] && args.mode == Mode::Event {
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
            mode: args.mode,
            fpdu: args.fpdu.unwrap_or(0),
            post_list: if shape.kind == Kind::Bw {
                args.post_list
            } else {
                1
            },
        };
        client.shape(spec, tcp, |conn| {
            for &size in &sizes {
                let iters = args
                    .iters
                    .unwrap_or_else(|| default_iters(shape.kind, size));
                let mut row = Row {
                    spec,
                    size,
                    iters,
                    sw: Vec::new(),
                    tcp: Vec::new(),
                };
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
                }
                bar.finish();
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
    header: String,
    config_json: String,
    rows: Vec<Row>,
    notes: Vec<String>,
    qp_mem: Option<QpMemory>,
    printed_header: bool,
}

impl Output {
    fn new(args: &BenchArgs, plan: &Plan) -> Self {
        let role = if plan.peer.is_some() {
            "client"
        } else {
            "loopback"
        };
        let peer = plan.peer.clone().unwrap_or_else(|| "127.0.0.1".into());
        let load = loadavg();
        let header = format!(
            "softwarp bench: {role} {peer}, mode {}, CRC {}, depth {}, post list {}, {}{} run(s) per number (median), FPDU {}, threads {}, load {}",
            args.mode.name(),
            if args.crc { "on" } else { "off" },
            args.depth,
            args.post_list,
            if args.bidirectional { "bidirectional, " } else { "" },
            args.runs,
            args.fpdu.map_or("up to the MSS".into(), |f| format!("up to {f} B")),
            if args.pin {
                "pinned (client CPU 0, server CPU 1)"
            } else {
                "not pinned"
            },
            load.map_or("?".into(), |l| format!("{l:.2}")),
        );
        let config_json = format!(
            "{{\"role\":{},\"peer\":{},\"mode\":{},\"crc\":{},\"depth\":{},\"post_list\":{},\
             \"bidirectional\":{},\"runs\":{},\"max_fpdu\":{},\"pinned\":{},\"cpus\":{},\"load_1m\":{}}}",
            jstr(role),
            jstr(&peer),
            jstr(args.mode.name()),
            args.crc,
            args.depth,
            args.post_list,
            args.bidirectional,
            args.runs,
            args.fpdu.unwrap_or(0),
            args.pin,
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            jnum(load),
        );
        Self {
            json: args.json,
            header,
            config_json,
            rows: Vec::new(),
            notes: Vec::new(),
            qp_mem: None,
            printed_header: false,
        }
    }

    /// Names this side's role in the header and the JSON config.
    fn set_role(&mut self, role: &str) {
        for r in ["client", "loopback"] {
            self.header = self
                .header
                .replacen(&format!(": {r} "), &format!(": {role} "), 1);
            self.config_json = self.config_json.replacen(
                &format!("\"role\":{}", jstr(r)),
                &format!("\"role\":{}", jstr(role)),
                1,
            );
        }
        // -R always spins on its CQs (the progress thread moves the bytes).
        let spin = format!("\"mode\":{}", jstr(Mode::Spin.name()));
        for m in [Mode::Busy, Mode::Spin] {
            let was = format!("\"mode\":{}", jstr(m.name()));
            self.config_json = self.config_json.replacen(&was, &spin, 1);
            let was = format!(", mode {},", m.name());
            self.header = self.header.replacen(&was, ", mode spin (-R),", 1);
        }
    }

    fn print_header(&mut self) {
        if !self.json && !self.printed_header {
            println!("{}", self.header);
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
            println!("{}", row.text());
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

    fn finish(&mut self) {
        if !self.json {
            return;
        }
        let rows: Vec<String> = self.rows.iter().map(Row::json).collect();
        let notes: Vec<String> = self.notes.iter().map(|n| jstr(n)).collect();
        let qp = self.qp_mem.map_or("null".to_string(), |m| {
            format!(
                "{{\"qps\":{},\"heap_bytes_per_qp\":{},\"heap_bytes_per_qp_created\":{}}}",
                m.qps,
                jnum(Some(m.connected)),
                jnum(Some(m.created))
            )
        });
        println!(
            "{{\"tool\":\"softwarp bench\",\"version\":{},\"config\":{},\"results\":[{}],\"qp_memory\":{},\"notes\":[{}]}}",
            jstr(env!("CARGO_PKG_VERSION")),
            self.config_json,
            rows.join(","),
            qp,
            notes.join(",")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
