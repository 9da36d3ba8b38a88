//! Connection manager scale benchmark: one listener accepts N connections (2,000 by
//! default) from another process, and the setup rate and the memory per connected QP are
//! printed for both processes.
//!
//! ```sh
//! cargo run --release -p softwarp --example cm_scale                 # 2000 connections
//! cargo run --release -p softwarp --example cm_scale -- --count 5000 --window 128
//! ```
//!
//! The parent is the server: it listens on 127.0.0.1, re-runs this program as the client
//! (`--client ADDR`), and accepts every request into a new QP (one shared CQ pair). The
//! client keeps `--window` connection attempts in flight through one CM event channel,
//! then each QP sends one message so that every connection is shown to carry data. Memory
//! per connected QP is the growth of the resident set size (`VmRSS`) divided by the count,
//! so it includes the QP, its socket buffers as far as user space sees them, and the CM's
//! bookkeeping. File descriptor limits are raised to the hard limit first.
#![allow(unsafe_code)] // setrlimit(2) only; see raise_fd_limit.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use softwarp::*;

type Res<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

const WAIT: Duration = Duration::from_secs(120);
const MSG: &[u8] = b"connected";

struct Args {
    count: usize,
    window: usize,
    depth: usize,
    client: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        count: 2000,
        window: 64,
        depth: 16,
        client: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--count" => a.count = value("--count")?.parse().map_err(|e| format!("{e}"))?,
            "--window" => a.window = value("--window")?.parse().map_err(|e| format!("{e}"))?,
            "--depth" => a.depth = value("--depth")?.parse().map_err(|e| format!("{e}"))?,
            "--client" => a.client = Some(value("--client")?),
            "-h" | "--help" => {
                return Err("usage: cm_scale [--count N] [--window W] [--depth WRS]".into())
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
                    signaled: false,
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
    report("client", args.count, setup, rss0, rss());
    println!("CLIENT-UP");
    // The server disconnects every connection; then we are done.
    let mut down = 0;
    while down < args.count {
        if let CmEvent::Disconnected { .. } = ch.get_event(Some(WAIT))? {
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
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
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
    let out = child.stdout.take().ok_or("no client stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
            println!("{line}");
            let _ = tx.send(line);
        }
    });

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
        let qp = pd.create_qp(&attr(&cq, args.depth))?;
        let slot = qps.len();
        qp.post_recv(&RecvWr {
            wr_id: slot as u64,
            sgl: SgList::single(inbox.sge(slot * 64, 64)?),
        })?;
        let id = req.accept(&qp, &ConnectOptions::default())?;
        qps.push((qp, id));
    }
    let setup = t0.map(|t| t.elapsed()).unwrap_or_default();
    report("server", args.count, setup, rss0, rss());
    // Every connection carries its message.
    let mut got = 0;
    let deadline = Instant::now() + WAIT;
    while got < args.count {
        match cq.poll_one() {
            Some(wc) if wc.status == WcStatus::Success => got += 1,
            Some(wc) => return Err(format!("{wc:?}").into()),
            None if Instant::now() > deadline => return Err("messages missing".into()),
            None => std::thread::sleep(Duration::from_micros(100)),
        }
    }
    println!("server: a message arrived on each of the {got} connections");
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
    let _ = child.wait();
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
    let nofile = raise_fd_limit();
    if (nofile as usize) < args.count + 64 {
        eprintln!(
            "open files limited to {nofile}: not enough for {} connections",
            args.count
        );
        std::process::exit(2);
    }
    let r = match &args.client {
        Some(addr) => client(addr, &args),
        None => server(&args),
    };
    if let Err(e) = r {
        eprintln!("cm_scale: {e}");
        std::process::exit(1);
    }
}
