//! Connection manager scale benchmark: one listener accepts N connections (2,000 by
//! default) from another process, and the setup rate and the memory per connected QP are
//! printed for both processes; or, host-wide (`--processes`), N connections between
//! several pairs of processes at once.
//!
//! ```sh
//! cargo run --release -p softwarp --example cm_scale                 # 2000 connections
//! cargo run --release -p softwarp --example cm_scale -- --count 5000 --window 128
//! cargo run --release -p softwarp --example cm_scale -- --count 100000 --processes auto
//! ```
//!
//! The parent is the server: it listens on 127.0.0.1, re-runs this program as the client
//! (`--client ADDR`), and accepts every request into a new QP (one shared CQ pair). The
//! client keeps `--window` connection attempts in flight through one CM event channel,
//! then each QP sends one message so that every connection is shown to carry data. Memory
//! per connected QP is the growth of the resident set size (`VmRSS`) divided by the count,
//! so it includes the QP, its socket buffers as far as user space sees them, and the CM's
//! bookkeeping. File descriptor limits are raised to the hard limit first.
//!
//! Host-wide (`--processes P`, or `auto`: as many pairs as keep each process at most
//! [`PER_PROCESS`] connections): this process only coordinates. It starts P servers
//! (`--serve`, each on its own listen port, so that each pair has loopback's whole range
//! of ephemeral ports), then P clients, one per server, which connect at the same time; it
//! waits until every connection is up and carried its message (all N connections exist at
//! once), asks the servers to close, and waits for every client to see every close. It
//! prints the host's set-up rate, the RSS growth of all the processes per connected QP, and
//! the kernel's TCP memory (`/proc/net/sockstat`) per connection. Everything is bounded by
//! `--timeout` (seconds; by default 120 plus 4 ms per connection): on failure or timeout
//! every child is killed and reaped, and children die with this process
//! (`PR_SET_PDEATHSIG`).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use softwarp::*;

type Res<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

const WAIT: Duration = Duration::from_secs(120);
const MSG: &[u8] = b"connected";
/// Most connections per process in `--processes auto`: each is a descriptor, and a process
/// here may hold 20,000 (the hard limit); loopback has about 28,000 ephemeral ports per
/// destination address and port, and each pair has its own listen port.
const PER_PROCESS: usize = 16_000;

struct Args {
    count: usize,
    window: usize,
    depth: usize,
    client: Option<String>,
    /// Host-wide: the number of server/client pairs (0: `auto`).
    processes: Option<usize>,
    /// A server of the host-wide mode: no client of its own; closes on `CLOSE` on stdin.
    serve: bool,
    timeout: Option<u64>,
    /// Host-wide: seconds to keep every connection up before closing (to ask the
    /// processes with `softwarp resources` or `softwarp stat` meanwhile).
    hold: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        count: 2000,
        window: 64,
        depth: 16,
        client: None,
        processes: None,
        serve: false,
        timeout: None,
        hold: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--count" => a.count = value("--count")?.parse().map_err(|e| format!("{e}"))?,
            "--window" => a.window = value("--window")?.parse().map_err(|e| format!("{e}"))?,
            "--depth" => a.depth = value("--depth")?.parse().map_err(|e| format!("{e}"))?,
            "--client" => a.client = Some(value("--client")?),
            "--processes" => {
                let v = value("--processes")?;
                a.processes = Some(if v == "auto" {
                    0
                } else {
                    v.parse().map_err(|e| format!("{e}"))?
                });
            }
            "--timeout" => {
                a.timeout = Some(value("--timeout")?.parse().map_err(|e| format!("{e}"))?)
            }
            "--serve" => a.serve = true,
            "--hold" => a.hold = value("--hold")?.parse().map_err(|e| format!("{e}"))?,
            "-h" | "--help" => {
                return Err("usage: cm_scale [--count N] [--window W] [--depth WRS] \
                            [--processes P|auto] [--timeout SECS] [--hold SECS]"
                    .into())
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

/// Raises the soft limit of open files to the hard limit (each connection is a socket).
fn raise_fd_limit() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let r = getrlimit(Resource::Nofile);
    // `None` is "unlimited".
    let below = match (r.current, r.maximum) {
        (Some(cur), Some(max)) => cur < max,
        (Some(_), None) => true,
        (None, _) => false,
    };
    if below {
        let raised = Rlimit {
            current: r.maximum,
            maximum: r.maximum,
        };
        // Refused: the soft limit stays as it was.
        let _ = setrlimit(Resource::Nofile, raised);
    }
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// Resident set size in bytes (`VmRSS` of /proc/self/status).
fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn attr<'a>(cq: &'a CompletionQueue, depth: usize) -> QpInitAttr<'a> {
    let mut a = QpInitAttr::new(cq, cq);
    a.cap.max_send_wr = depth;
    a.cap.max_recv_wr = depth;
    a.max_rd_atomic = 4;
    a.max_dest_rd_atomic = 4;
    a
}

fn report(who: &str, n: usize, setup: Duration, rss0: u64, rss1: u64) {
    // For the host-wide coordinator.
    println!("STATS {who} {n} {} {rss0} {rss1}", setup.as_secs_f64());
    let rate = n as f64 / setup.as_secs_f64();
    let per_qp = rss1.saturating_sub(rss0) as f64 / n as f64;
    println!(
        "{who}: {n} connections in {:.3} s = {rate:.0} connections/s; RSS {:.1} MiB -> {:.1} MiB = {:.1} KiB per connected QP",
        setup.as_secs_f64(),
        rss0 as f64 / 1048576.0,
        rss1 as f64 / 1048576.0,
        per_qp / 1024.0
    );
}

fn client(addr: &str, args: &Args) -> Res {
    let dev = Device::builder().ras(RasConfig::from_env()).open()?;
    let pd = dev.alloc_pd()?;
    let cq = dev.create_cq(args.count * 2 + 16, None)?;
    let mr = pd.reg_mr(64, AccessFlags::LOCAL_WRITE)?;
    mr.write_at(0, MSG)?;
    let ch = CmEventChannel::new()?;
    let opts = ConnectOptions::default().timeout(Duration::from_secs(60));
    let rss0 = rss();
    let t0 = Instant::now();
    let mut qps = Vec::with_capacity(args.count);
    let mut ids = std::collections::HashMap::new();
    let (mut started, mut up) = (0, 0);
    while up < args.count {
        while started < args.count && started - up < args.window {
            let qp = pd.create_qp(&attr(&cq, args.depth))?;
            let id = ch.connect(&qp, addr, &opts)?;
            ids.insert(id.conn_id(), qps.len());
            qps.push((qp, id));
            started += 1;
        }
        match ch.get_event(Some(WAIT))? {
            CmEvent::Established { id, .. } => {
                up += 1;
                let (qp, _) = &qps[ids[&id]];
                qp.post_send(&SendWr {
                    wr_id: 1,
                    op: SendOp::Send {
                        solicited: false,
                        invalidate: None,
                    },
                    payload: Payload::Sgl(SgList::single(mr.sge(0, MSG.len() as u32)?)),
                    signaled: true,
                    fence: false,
                })?;
            }
            CmEvent::Rejected { id, .. } => return Err(format!("{id} rejected").into()),
            CmEvent::Unreachable { error, .. } | CmEvent::ConnectError { error, .. } => {
                return Err(error.into())
            }
            _ => {}
        }
    }
    let setup = t0.elapsed();
    // The memory of idle connected QPs: every message sent (its completion taken).
    wait_completions(&cq, args.count)?;
    report("client", args.count, setup, rss0, rss());
    println!("CLIENT-UP");
    // The server disconnects every connection; then we are done.
    let mut down = 0;
    while down < args.count {
        // The coordinator of the host-wide mode may hold the connections up first.
        if let CmEvent::Disconnected { .. } =
            ch.get_event(Some(WAIT + Duration::from_secs(args.hold)))?
        {
            down += 1;
        }
    }
    println!("CLIENT-DONE");
    Ok(())
}

fn server(args: &Args) -> Res {
    let dev = Device::builder().ras(RasConfig::from_env()).open()?;
    let pd = dev.alloc_pd()?;
    let cq = dev.create_cq(args.count * 2 + 16, None)?;
    let inbox = pd.reg_mr(64 * args.count.max(1), AccessFlags::LOCAL_WRITE)?;
    let ch = CmEventChannel::new()?;
    let l = ch.listen("127.0.0.1:0", &ListenOptions::default().backlog(4096))?;
    let addr = l.local_addr();
    if args.serve {
        // A server of the host-wide mode: the coordinator starts the client.
        println!("LISTEN {addr}");
        let qps = accept_all(args, &pd, &cq, &inbox, &ch)?;
        let mut stdin = std::io::stdin().lock().lines();
        while stdin
            .next()
            .transpose()?
            .ok_or("stdin closed before CLOSE")?
            != "CLOSE"
        {}
        for (_, id) in &qps {
            id.disconnect()?;
        }
        println!("CLOSING");
        // Until the coordinator saw every close at the clients (or went).
        while stdin.next().transpose()?.is_some() {}
        return Ok(());
    }
    let exe = std::env::current_exe()?;
    let child = Command::new(exe)
        .args([
            "--client",
            &addr.to_string(),
            "--count",
            &args.count.to_string(),
            "--window",
            &args.window.to_string(),
            "--depth",
            &args.depth.to_string(),
        ])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut child = Reaped(vec![child]);
    let out = child.0[0].stdout.take().ok_or("no client stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
            println!("{line}");
            let _ = tx.send(line);
        }
    });
    let qps = accept_all(args, &pd, &cq, &inbox, &ch)?;
    while rx.recv_timeout(WAIT)? != "CLIENT-UP" {}
    let t1 = Instant::now();
    for (_, id) in &qps {
        id.disconnect()?;
    }
    while rx.recv_timeout(WAIT)? != "CLIENT-DONE" {}
    println!(
        "server: {} graceful disconnects seen by the client in {:.3} s",
        args.count,
        t1.elapsed().as_secs_f64()
    );
    let _ = child.0[0].wait();
    Ok(())
}

/// Accepts `args.count` connections, each with a receive posted for its message, and waits
/// for every message.
fn accept_all(
    args: &Args,
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    inbox: &MemoryRegion,
    ch: &CmEventChannel,
) -> Res<Vec<(QueuePair, CmId)>> {
    let rss0 = rss();
    let mut qps = Vec::with_capacity(args.count);
    let mut t0 = None;
    while qps.len() < args.count {
        let req = match ch.get_event(Some(WAIT))? {
            CmEvent::ConnectRequest(r) => r,
            CmEvent::RequestError { error, .. } => return Err(error.into()),
            _ => continue,
        };
        t0.get_or_insert_with(Instant::now);
        let qp = pd.create_qp(&attr(cq, args.depth))?;
        let slot = qps.len();
        qp.post_recv(&RecvWr {
            wr_id: slot as u64,
            sgl: SgList::single(inbox.sge(slot * 64, 64)?),
        })?;
        let id = req.accept(&qp, &ConnectOptions::default())?;
        qps.push((qp, id));
    }
    let setup = t0.map(|t| t.elapsed()).unwrap_or_default();
    // Every connection carries its message; the memory is that of idle connected QPs.
    wait_completions(cq, args.count)?;
    report("server", args.count, setup, rss0, rss());
    println!(
        "server: a message arrived on each of the {} connections",
        args.count
    );
    println!("MESSAGES {}", args.count);
    Ok(qps)
}

/// Takes `n` successful completions from `cq`.
fn wait_completions(cq: &CompletionQueue, n: usize) -> Res {
    let mut got = 0;
    let deadline = Instant::now() + WAIT;
    while got < n {
        match cq.poll_one() {
            Some(wc) if wc.status == WcStatus::Success => got += 1,
            Some(wc) => return Err(format!("{wc:?}").into()),
            None if Instant::now() > deadline => {
                return Err(format!("{got} of {n} completions").into())
            }
            None => std::thread::sleep(Duration::from_micros(100)),
        }
    }
    Ok(())
}

/// Children killed and reaped when dropped (a failure or a timeout), unless they exited.
struct Reaped(Vec<Child>);

impl Drop for Reaped {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

/// One line of a child of the host-wide mode: (server?, pair, line).
type Line = (bool, usize, String);

/// The children of the host-wide mode and their lines, all bounded by one deadline.
struct Host {
    tx: Option<mpsc::Sender<Line>>,
    rx: mpsc::Receiver<Line>,
    servers: Reaped,
    clients: Reaped,
    deadline: Instant,
}

impl Host {
    /// Starts this program with `args`, its stdout's lines tagged with `(server, pair)`
    /// (the child asks to be killed when this process dies: `main`).
    fn spawn(&mut self, args: &[String], server: bool, pair: usize) -> Res {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args(args).stdout(Stdio::piped()).stdin(Stdio::piped());
        let mut child = cmd.spawn()?;
        let out = child.stdout.take().ok_or("no stdout")?;
        let tx = self.tx.clone().ok_or("no more children")?;
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
                let _ = tx.send((server, pair, line));
            }
        });
        if server {
            &mut self.servers
        } else {
            &mut self.clients
        }
        .0
        .push(child);
        Ok(())
    }

    /// The next line of any child; an error when a child failed or the deadline passed.
    fn next(&mut self, what: &str) -> Res<Line> {
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!("timed out waiting for {what}").into());
            }
            match self.rx.recv_timeout(left.min(Duration::from_millis(200))) {
                Ok(line) => return Ok(line),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(e) => return Err(format!("{e} while waiting for {what}").into()),
            }
            for (role, r) in [("server", &mut self.servers), ("client", &mut self.clients)] {
                for (i, c) in r.0.iter_mut().enumerate() {
                    if let Some(st) = c.try_wait()? {
                        if !st.success() {
                            return Err(format!("{role} {i} {st} while waiting for {what}").into());
                        }
                    }
                }
            }
        }
    }

    /// Waits until `want` lines starting with `prefix` came (from any child), printing the
    /// others; returns the ones that matched.
    fn gather(&mut self, prefix: &str, want: usize) -> Res<Vec<Line>> {
        let mut got = Vec::new();
        while got.len() < want {
            let line = self.next(prefix)?;
            if line.2.starts_with(prefix) {
                got.push(line);
            } else if !line.2.starts_with("STATS") && !line.2.starts_with("CLIENT-") {
                println!(
                    "  {} {}: {}",
                    if line.0 { "server" } else { "client" },
                    line.1,
                    line.2
                );
            }
        }
        Ok(got)
    }
}

/// The kernel's TCP sockets in use (`/proc/net/sockstat`) and its slab memory in bytes
/// (`Slab` of `/proc/meminfo`: socket structures, and whatever else the host allocates
/// meanwhile).
fn kernel_usage() -> (u64, u64) {
    let field = |file: &str, line: &str, name: &str| {
        let s = std::fs::read_to_string(file).unwrap_or_default();
        let l = s
            .lines()
            .find(|l| l.starts_with(line))
            .unwrap_or_default()
            .to_string();
        let f: Vec<&str> = l.split_whitespace().collect();
        f.iter()
            .position(|w| *w == name)
            .and_then(|i| f.get(i + 1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (
        field("/proc/net/sockstat", "TCP:", "inuse"),
        field("/proc/meminfo", "Slab:", "Slab:") * 1024,
    )
}

/// The RSS growth summed over `STATS` lines: (bytes, connected QPs).
fn rss_growth(stats: &[Line]) -> (u64, usize) {
    stats.iter().fold((0, 0), |(bytes, qps), (_, _, l)| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        (bytes + num(5).saturating_sub(num(4)), qps + num(2) as usize)
    })
}

/// Host-wide: `args.count` connections between server/client pairs of processes.
fn coordinate(args: &Args, nofile: u64) -> Res {
    let per = PER_PROCESS.min(nofile.saturating_sub(256) as usize).max(1);
    let pairs = match args.processes {
        Some(0) | None => args.count.div_ceil(per).max(1),
        Some(p) => p.max(1),
    };
    let share = |i: usize| args.count / pairs + usize::from(i < args.count % pairs);
    if share(0) + 64 > nofile as usize {
        return Err(format!(
            "{} connections per process, open files limited to {nofile}",
            share(0)
        )
        .into());
    }
    let timeout =
        Duration::from_secs(args.timeout.unwrap_or(120 + 4 * args.count as u64 / 1000) + args.hold);
    println!(
        "host-wide: {} connections between {pairs} pairs of processes ({} to {} each), \
         open files limit {nofile} per process, timeout {} s",
        args.count,
        share(pairs - 1),
        share(0),
        timeout.as_secs()
    );
    let (tx, rx) = mpsc::channel();
    let mut host = Host {
        tx: Some(tx),
        rx,
        servers: Reaped(Vec::new()),
        clients: Reaped(Vec::new()),
        deadline: Instant::now() + timeout,
    };
    let member = |i: usize| {
        let mut a = vec![
            "--count",
            &share(i).to_string(),
            "--window",
            &args.window.to_string(),
        ]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
        a.extend(["--depth".to_string(), args.depth.to_string()]);
        a.extend(["--hold".to_string(), args.hold.to_string()]);
        a
    };
    for i in 0..pairs {
        let mut a = member(i);
        a.push("--serve".into());
        host.spawn(&a, true, i)?;
    }
    let mut addrs = vec![String::new(); pairs];
    for (_, i, l) in host.gather("LISTEN ", pairs)? {
        addrs[i] = l["LISTEN ".len()..].to_string();
    }
    let (socks0, kmem0) = kernel_usage();
    let t0 = Instant::now();
    for (i, addr) in addrs.iter().enumerate() {
        let mut a = member(i);
        a.extend(["--client".to_string(), addr.clone()]);
        host.spawn(&a, false, i)?;
    }
    host.tx = None;
    let mut stats = Vec::new();
    let (mut up, mut messages, mut setup, mut kernel) = (0, 0, Duration::ZERO, (0, 0));
    // Every client's connections up, and every server counted its connections' messages.
    while up < pairs || messages < pairs {
        let line = host.next("every connection up and its message")?;
        if line.2.starts_with("STATS") {
            stats.push(line);
        } else if line.2 == "CLIENT-UP" {
            up += 1;
            if up == pairs {
                setup = t0.elapsed();
                kernel = kernel_usage();
            }
        } else if line.2.starts_with("MESSAGES") {
            messages += 1;
        } else {
            println!(
                "  {} {}: {}",
                if line.0 { "server" } else { "client" },
                line.1,
                line.2
            );
        }
    }
    let (socks1, kmem1) = kernel;
    let (grown, qps) = rss_growth(&stats);
    println!(
        "host-wide: {} connections ({qps} connected QPs) up in {:.3} s = {:.0} connections/s; \
         RSS of the {} processes grew {:.1} MiB = {:.2} KiB per connected QP; \
         kernel: TCP sockets {socks0} -> {socks1}, slab {:.1} -> {:.1} MiB = {:.2} KiB per socket",
        args.count,
        setup.as_secs_f64(),
        args.count as f64 / setup.as_secs_f64(),
        2 * pairs,
        grown as f64 / 1048576.0,
        grown as f64 / qps.max(1) as f64 / 1024.0,
        kmem0 as f64 / 1048576.0,
        kmem1 as f64 / 1048576.0,
        kmem1.saturating_sub(kmem0) as f64 / socks1.saturating_sub(socks0).max(1) as f64 / 1024.0,
    );
    if args.hold > 0 {
        println!("HOLD {} s: every connection stays up", args.hold);
        std::thread::sleep(Duration::from_secs(args.hold));
    }
    let t1 = Instant::now();
    for s in &mut host.servers.0 {
        writeln!(s.stdin.as_mut().ok_or("no stdin")?, "CLOSE")?;
    }
    host.gather("CLIENT-DONE", pairs)?;
    println!(
        "host-wide: {} graceful disconnects seen by the clients in {:.3} s",
        args.count,
        t1.elapsed().as_secs_f64()
    );
    // The servers exit at the end of their input.
    for s in &mut host.servers.0 {
        drop(s.stdin.take());
    }
    for r in [&mut host.servers, &mut host.clients] {
        for c in &mut r.0 {
            while c.try_wait()?.is_none() {
                if Instant::now() > host.deadline {
                    return Err("children still running at the deadline".into());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    Ok(())
}

fn main() {
    // Opt in to what an operator sees: Softwarp's console + flight recorder subscriber, and
    // (at the device open below) the RAS services the environment configures.
    install_ras_subscriber();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    if args.client.is_some() || args.serve {
        // A child of the benchmark dies with its parent (a failed or killed run leaves
        // nothing behind); if the parent is already gone, at once.
        let _ =
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
        if rustix::process::getppid().is_none_or(|p| p.as_raw_nonzero().get() == 1) {
            std::process::exit(1);
        }
    }
    let nofile = raise_fd_limit();
    if args.processes.is_none() && (nofile as usize) < args.count + 64 {
        eprintln!(
            "open files limited to {nofile}: not enough for {} connections",
            args.count
        );
        std::process::exit(2);
    }
    let r = match (&args.client, args.processes) {
        (Some(addr), _) => client(addr, &args),
        (None, Some(_)) if !args.serve => coordinate(&args, nofile),
        (None, _) => server(&args),
    };
    if let Err(e) = r {
        eprintln!("cm_scale: {e}");
        std::process::exit(1);
    }
}
