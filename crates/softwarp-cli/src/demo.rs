//! `softwarp demo`: a server and a client on loopback (two threads, each with its own
//! device), every iWARP operation at several sizes over one real TCP connection, the bytes
//! verified at the destination, one line per operation with its size and timing, and a
//! remote access error at the end (a Terminate seen from both sides).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use softwarp::{
    AccessFlags, AsyncEvent, CompletionQueue, ConnectOptions, Device, Listener, MemoryRegion,
    Payload, QpInitAttr, QpState, QueuePair, RecvWr, SendOp, SendWr, SgList, Sge, Stag, WcOpcode,
    WcStatus, WorkCompletion, EMPTY_COMPLETION, MAX_SGE,
};

/// Options of `softwarp demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Payload sizes in bytes (suffixes K and M are powers of 1024).
    #[arg(long, value_delimiter = ',', default_value = "0,1,4095,1M,16M", value_parser = parse_size)]
    sizes: Vec<usize>,
    /// Do not ask for CRC32c (neither side then uses it).
    #[arg(long)]
    no_crc: bool,
    /// Largest FPDU to send (default: the TCP MSS, or MPA's 65,535 bytes to this host).
    #[arg(long)]
    fpdu: Option<usize>,
    /// Scatter/gather elements per work request (1 to 8).
    #[arg(long, default_value_t = 3)]
    sges: usize,
    /// Skip the remote access error at the end.
    #[arg(long)]
    no_error: bool,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1024),
        Some('M' | 'm') => (&s[..s.len() - 1], 1024 * 1024),
        _ => (s, 1),
    };
    let n: usize = num.parse().map_err(|e| format!("bad size {s:?}: {e}"))?;
    n.checked_mul(mul)
        .filter(|&n| n <= u32::MAX as usize)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

const WAIT: Duration = Duration::from_secs(30);

/// The operations, in the order they run for each size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Send,
    SendSe,
    SendInv,
    SendSeInv,
    Write,
    Read,
}

impl Op {
    const ALL: [Op; 6] = [
        Op::Send,
        Op::SendSe,
        Op::SendInv,
        Op::SendSeInv,
        Op::Write,
        Op::Read,
    ];
    fn name(self) -> &'static str {
        match self {
            Op::Send => "Send",
            Op::SendSe => "Send+SE",
            Op::SendInv => "Send+Invalidate",
            Op::SendSeInv => "Send+SE+Invalidate",
            Op::Write => "RDMA Write",
            Op::Read => "RDMA Read",
        }
    }
    fn solicited(self) -> bool {
        matches!(self, Op::SendSe | Op::SendSeInv)
    }
    fn invalidates(self) -> bool {
        matches!(self, Op::SendInv | Op::SendSeInv)
    }
    fn is_send(self) -> bool {
        !matches!(self, Op::Write | Op::Read)
    }
}

/// Deterministic pattern bytes.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

fn seed_of(step: usize) -> u64 {
    1000 + step as u64
}

/// Splits `len` bytes at `offset` of `mr` into up to `parts` SGEs of uneven sizes.
fn sgl(mr: &MemoryRegion, offset: usize, len: usize, parts: usize) -> Result<SgList> {
    let mut l = SgList::new();
    let parts = parts.clamp(1, MAX_SGE).min(len.max(1));
    let mut off = offset;
    let mut left = len;
    for i in 0..parts {
        if left == 0 {
            break;
        }
        let take = if i + 1 == parts {
            left
        } else {
            (left / 3).max(1).min(left - (parts - i - 1).min(left - 1))
        };
        let sge: Sge = mr.sge(off, u32::try_from(take)?)?;
        l.push(sge).map_err(|_| anyhow!("SGL full"))?;
        off += take;
        left -= take;
    }
    Ok(l)
}

fn wait_wc(cq: &CompletionQueue) -> Result<WorkCompletion> {
    let deadline = Instant::now() + WAIT;
    let mut wc = [EMPTY_COMPLETION; 1];
    loop {
        if cq.poll(&mut wc)? == 1 {
            return Ok(wc[0]);
        }
        if Instant::now() >= deadline {
            bail!("no completion within {WAIT:?}");
        }
        std::thread::yield_now();
    }
}

/// What the server tells the client about its memory (sent in a Send, 16 + 8 * n bytes).
struct Advert {
    read_src: (u64, Stag),
    write_sink: (u64, Stag),
    inv: Vec<Stag>,
}

impl Advert {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        for (addr, stag) in [self.read_src, self.write_sink] {
            v.extend_from_slice(&addr.to_be_bytes());
            v.extend_from_slice(&stag.0.to_be_bytes());
        }
        for s in &self.inv {
            v.extend_from_slice(&s.0.to_be_bytes());
        }
        v
    }
    fn decode(b: &[u8]) -> Result<Self> {
        let u64_at = |o: usize| -> Result<u64> {
            Ok(u64::from_be_bytes(
                b.get(o..o + 8).context("short advert")?.try_into()?,
            ))
        };
        let u32_at = |o: usize| -> Result<u32> {
            Ok(u32::from_be_bytes(
                b.get(o..o + 4).context("short advert")?.try_into()?,
            ))
        };
        let mut inv = Vec::new();
        let mut o = 24;
        while o + 4 <= b.len() {
            inv.push(Stag(u32_at(o)?));
            o += 4;
        }
        Ok(Self {
            read_src: (u64_at(0)?, Stag(u32_at(8)?)),
            write_sink: (u64_at(12)?, Stag(u32_at(20)?)),
            inv,
        })
    }
}

/// The server's verdict on one step.
struct Verdict {
    done: Instant,
    detail: String,
}

/// Fields drop in declaration order: the QP first, the device last (a device closed before
/// what was created from it reports those as leaked).
struct Endpoint {
    qp: QueuePair,
    scq: CompletionQueue,
    rcq: CompletionQueue,
    pd: softwarp::ProtectionDomain,
    dev: Device,
}

fn endpoint() -> Result<Endpoint> {
    let dev = Device::open_default()?;
    let pd = dev.alloc_pd()?;
    let scq = dev.create_cq(256, None)?;
    let rcq = dev.create_cq(256, None)?;
    let qp = pd.create_qp(&QpInitAttr::new(&scq, &rcq))?;
    Ok(Endpoint {
        dev,
        pd,
        scq,
        rcq,
        qp,
    })
}

/// The steps: every operation at every size.
fn plan(sizes: &[usize]) -> Vec<(Op, usize)> {
    sizes
        .iter()
        .flat_map(|&s| Op::ALL.iter().map(move |&op| (op, s)))
        .collect()
}

fn server(
    ep: Endpoint,
    listener: Listener,
    opts: ConnectOptions,
    steps: Vec<(Op, usize)>,
    max: usize,
    ready: mpsc::Sender<()>,
    verdicts: mpsc::Sender<Result<Verdict>>,
) -> Result<(Endpoint, Vec<MemoryRegion>)> {
    let lw = AccessFlags::LOCAL_WRITE;
    let rbuf = ep.pd.reg_mr(max + 64, lw)?;
    let read_src = ep.pd.reg_mr(max, AccessFlags::REMOTE_READ)?;
    read_src.write_at(0, &pattern(max, 7))?;
    let write_sink = ep.pd.reg_mr(max, lw | AccessFlags::REMOTE_WRITE)?;
    let inv_mrs = steps
        .iter()
        .filter(|(op, _)| op.invalidates())
        .map(|_| ep.pd.reg_mr(64, lw | AccessFlags::REMOTE_INVALIDATE))
        .collect::<Result<Vec<_>, _>>()?;
    let recv = |len: usize| -> Result<()> {
        ep.qp.post_recv(&RecvWr {
            wr_id: len as u64,
            sgl: SgList::single(rbuf.sge(0, u32::try_from(len + 64)?)?),
        })?;
        Ok(())
    };
    listener.accept_timeout(&ep.qp, &opts, WAIT)?;
    let advert = Advert {
        read_src: (read_src.addr(), read_src.rkey()),
        write_sink: (write_sink.addr(), write_sink.rkey()),
        inv: inv_mrs.iter().map(|m| m.rkey()).collect(),
    }
    .encode();
    ep.qp.post_send(&SendWr {
        wr_id: 0,
        op: SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        payload: Payload::Inline(&advert),
        signaled: true,
        fence: false,
    })?;
    wait_wc(&ep.scq)?;
    let mut inv_iter = inv_mrs.iter();
    for (step, &(op, len)) in steps.iter().enumerate() {
        if op.is_send() || op == Op::Write {
            recv(len)?;
        }
        rbuf.fill(0, len + 64, 0xee)?;
        ready.send(()).ok();
        let verdict = (|| -> Result<Verdict> {
            if op == Op::Read {
                return Ok(Verdict {
                    done: Instant::now(),
                    detail: String::new(),
                });
            }
            let wc = wait_wc(&ep.rcq)?;
            let done = Instant::now();
            ensure!(
                wc.status == WcStatus::Success && wc.opcode == WcOpcode::Recv,
                "receive completion {wc:?}"
            );
            if op == Op::Write {
                let mut got = vec![0u8; len];
                write_sink.read_at(0, &mut got)?;
                ensure!(
                    got == pattern(len, seed_of(step)),
                    "RDMA Write: bytes differ at the sink"
                );
                return Ok(Verdict {
                    done,
                    detail: String::new(),
                });
            }
            ensure!(wc.byte_len as usize == len, "byte_len {}", wc.byte_len);
            ensure!(
                wc.solicited == op.solicited(),
                "solicited flag {}",
                wc.solicited
            );
            let mut got = vec![0u8; len + 64];
            rbuf.read_at(0, &mut got)?;
            ensure!(
                got[..len] == pattern(len, seed_of(step))[..],
                "received bytes differ"
            );
            ensure!(
                got[len..].iter().all(|&b| b == 0xee),
                "bytes after the message were touched"
            );
            let mut detail = format!("recv wc: {} B", wc.byte_len);
            if wc.solicited {
                detail.push_str(", solicited");
            }
            if op.invalidates() {
                let mr = inv_iter.next().context("no STag left to invalidate")?;
                ensure!(
                    wc.invalidated_stag == Some(mr.rkey()),
                    "invalidated STag {:?}",
                    wc.invalidated_stag
                );
                ensure!(!mr.is_valid(), "the STag is still valid");
                detail.push_str(&format!(", invalidated STag {:#010x}", mr.rkey().0));
            }
            Ok(Verdict { done, detail })
        })();
        let failed = verdict.is_err();
        verdicts.send(verdict).ok();
        if failed {
            bail!("server: step {step} failed");
        }
    }
    // The client may still be reading `read_src` (a Read needs no server verdict): the
    // registrations live until the caller is done.
    let mut mrs = inv_mrs;
    mrs.extend([rbuf, read_src, write_sink]);
    Ok((ep, mrs))
}

/// Runs the demo; prints one line per operation.
pub fn run(args: &DemoArgs) -> Result<()> {
    ensure!(!args.sizes.is_empty(), "no sizes given");
    ensure!(
        (1..=MAX_SGE).contains(&args.sges),
        "--sges must be 1 to {MAX_SGE}"
    );
    let max = args.sizes.iter().copied().max().unwrap_or(0).max(64);
    let opts = ConnectOptions::default()
        .crc(!args.no_crc)
        .max_fpdu_len(args.fpdu);
    let steps = plan(&args.sizes);
    let listener = Listener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let started = Instant::now();

    let server_ep = endpoint()?;
    let (ready_tx, ready_rx) = mpsc::channel();
    let (verdict_tx, verdict_rx) = mpsc::channel();
    let server_steps = steps.clone();
    let server_opts = opts.clone();
    let server_thread = std::thread::Builder::new()
        .name("demo-server".into())
        .spawn(move || {
            server(
                server_ep,
                listener,
                server_opts,
                server_steps,
                max,
                ready_tx,
                verdict_tx,
            )
        })?;

    let client = endpoint()?;
    let lw = AccessFlags::LOCAL_WRITE;
    let advert_buf = client.pd.reg_mr(256, lw)?;
    client.qp.post_recv(&RecvWr {
        wr_id: 0,
        sgl: SgList::single(advert_buf.sge(0, 256)?),
    })?;
    // The server speaks first (its advert), and a responder sends nothing before the
    // initiator's first FPDU (RFC 5044): the client negotiates RFC 6581 peer-to-peer mode,
    // whose RTR message is that first FPDU.
    let info = client.qp.connect(addr, &opts.clone().peer_to_peer(true))?;
    let advert_wc = wait_wc(&client.rcq)?;
    let mut advert = vec![0u8; advert_wc.byte_len as usize];
    advert_buf.read_at(0, &mut advert)?;
    let advert = Advert::decode(&advert)?;
    println!(
        "softwarp demo: {} -> {} over loopback TCP, MPA rev {}, CRC {}, FPDU up to {} B (MSS {} B), IRD/ORD {}/{}, {} SGE(s) per WR",
        info.local_addr,
        info.peer_addr,
        info.revision,
        if info.crc { "on" } else { "off" },
        info.max_fpdu_len,
        info.mss,
        info.ird,
        info.ord,
        args.sges
    );
    println!(
        "{:<20} {:>10}  {:>10}  {:>10}  result",
        "operation", "bytes", "time", "rate"
    );

    let src = client.pd.reg_mr(max, AccessFlags::NONE)?;
    let sink = client.pd.reg_mr(max + 64, lw)?;
    let read_pattern = pattern(max, 7);
    let mut inv = advert.inv.iter();
    let mut total_bytes = 0usize;
    for (step, &(op, len)) in steps.iter().enumerate() {
        src.write_at(0, &pattern(len, seed_of(step)))?;
        ready_rx
            .recv_timeout(WAIT)
            .map_err(|_| anyhow!("the server is not ready (step {step})"))?;
        let t0 = Instant::now();
        let (sop, payload) = match op {
            Op::Read => {
                sink.fill(0, len + 64, 0x77)?;
                (
                    SendOp::Read {
                        remote_addr: advert.read_src.0,
                        rkey: advert.read_src.1,
                    },
                    if len == 0 {
                        SgList::new()
                    } else {
                        SgList::single(sink.sge(0, u32::try_from(len)?)?)
                    },
                )
            }
            Op::Write => (
                SendOp::Write {
                    remote_addr: advert.write_sink.0,
                    rkey: advert.write_sink.1,
                },
                sgl(&src, 0, len, args.sges)?,
            ),
            _ => (
                SendOp::Send {
                    solicited: op.solicited(),
                    invalidate: if op.invalidates() {
                        Some(*inv.next().context("no STag to invalidate")?)
                    } else {
                        None
                    },
                },
                sgl(&src, 0, len, args.sges)?,
            ),
        };
        client.qp.post_send(&SendWr {
            wr_id: step as u64,
            op: sop,
            payload: Payload::Sgl(payload),
            signaled: true,
            fence: false,
        })?;
        if op == Op::Write {
            // A zero-length Send behind the Write: its arrival proves the Write was placed.
            client.qp.post_send(&SendWr {
                wr_id: u64::MAX,
                op: SendOp::Send {
                    solicited: false,
                    invalidate: None,
                },
                payload: Payload::Sgl(SgList::new()),
                signaled: false,
                fence: false,
            })?;
        }
        let wc = wait_wc(&client.scq)?;
        let local_done = Instant::now();
        ensure!(
            wc.status == WcStatus::Success && wc.byte_len as usize == len,
            "{}: completion {wc:?}",
            op.name()
        );
        if op == Op::Read {
            let mut got = vec![0u8; len + 64];
            sink.read_at(0, &mut got)?;
            ensure!(got[..len] == read_pattern[..len], "RDMA Read: bytes differ");
            ensure!(got[len..].iter().all(|&b| b == 0x77), "RDMA Read: overrun");
        }
        let verdict = verdict_rx
            .recv_timeout(WAIT)
            .map_err(|_| anyhow!("no verdict from the server (step {step})"))??;
        let end = if op == Op::Read {
            local_done
        } else {
            verdict.done
        };
        let secs = end.duration_since(t0).as_secs_f64();
        let rate = if len >= 4096 && secs > 0.0 {
            format!("{:.0} MB/s", len as f64 / secs / 1e6)
        } else {
            "-".to_string()
        };
        let mut detail = format!("ok, {:?} wc {:?} {} B", wc.status, wc.opcode, wc.byte_len);
        if !verdict.detail.is_empty() {
            detail.push_str("; ");
            detail.push_str(&verdict.detail);
        }
        println!(
            "{:<20} {:>10}  {:>7.3} ms  {:>10}  {}",
            op.name(),
            len,
            secs * 1e3,
            rate,
            detail
        );
        total_bytes += len;
    }
    let (server_ep, _server_mrs) = server_thread
        .join()
        .map_err(|_| anyhow!("the server thread panicked"))??;
    println!(
        "all {} operations verified ({} payload bytes) in {:.2} s",
        steps.len(),
        total_bytes,
        started.elapsed().as_secs_f64()
    );
    if !args.no_error {
        remote_access_error(&client, &server_ep, &src)?;
    }
    Ok(())
}

/// Writes to an STag without remote write access: the server's QP detects it, sends a
/// Terminate, and both sides report the error and go to Error.
fn remote_access_error(client: &Endpoint, server: &Endpoint, src: &MemoryRegion) -> Result<()> {
    let ro = server.pd.reg_mr(4096, AccessFlags::REMOTE_READ)?;
    let t0 = Instant::now();
    client.qp.post_send(&SendWr {
        wr_id: 9999,
        op: SendOp::Write {
            remote_addr: ro.addr(),
            rkey: ro.rkey(),
        },
        payload: Payload::Sgl(SgList::single(src.sge(0, 64)?)),
        signaled: true,
        fence: false,
    })?;
    let server_ev = server.dev.get_async_event_timeout(WAIT)?;
    let client_ev = client.dev.get_async_event_timeout(WAIT)?;
    let deadline = Instant::now() + WAIT;
    while client.qp.state() != QpState::Error || server.qp.state() != QpState::Error {
        ensure!(
            Instant::now() < deadline,
            "the QPs did not both reach Error"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    println!(
        "{:<20} {:>10}  {:>7.3} ms  {:>10}  expected error: server {}; client {}; both QPs in Error",
        "RDMA Write (no access)",
        64,
        t0.elapsed().as_secs_f64() * 1e3,
        "-",
        describe(&server_ev),
        describe(&client_ev)
    );
    Ok(())
}

fn describe(ev: &AsyncEvent) -> String {
    match ev {
        AsyncEvent::QpAccessError { cause, .. } => format!("QP access error ({cause:?})"),
        AsyncEvent::QpFatal { cause, .. } => format!("QP fatal ({cause:?})"),
        AsyncEvent::QpRequestError { cause, .. } => format!("QP request error ({cause:?})"),
        other => format!("{other:?}"),
    }
}
