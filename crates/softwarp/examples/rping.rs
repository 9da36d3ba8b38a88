//! rping over Softwarp: rdma-core's `rping` ping-pong test (librdmacm/examples/rping.c),
//! wire-compatible with it, so that one end can be Softwarp and the other Linux `siw` (or any
//! iWARP RNIC) running the real `rping`.
//!
//! ```text
//! cargo run --release -p softwarp --example rping -- -s -a 0.0.0.0 -p 7174 -v
//! cargo run --release -p softwarp --example rping -- -c -a 192.168.77.2 -p 7174 -C 3 -S 64 -v -V
//! ```
//!
//! The protocol, as rping.c runs it (one iteration; `-C` iterations, 0 = forever):
//!
//! 1. The client fills its source buffer ("rdma-ping-N: " then letters) and Sends
//!    `struct rping_rdma_info { __be64 buf; __be32 rkey; __be32 size; }` (16 bytes) naming it.
//! 2. The server RDMA Reads `size` bytes from it into its own buffer (`-v`: prints
//!    "server ping data: ...") and Sends "go ahead" (16 bytes; rping's server never fills its
//!    send buffer, so they are zeros).
//! 3. The client Sends the info of its sink buffer.
//! 4. The server RDMA Writes the ping string (up to and including its NUL) into the sink and
//!    Sends "go ahead" again.
//! 5. The client (`-V`) compares source and sink, (`-v`) prints "ping data: ...".
//!
//! The client ends with a disconnect; the server runs until its peer disconnects. Both sides
//! post one 16-byte receive and repost it after each receive completion, and negotiate IRD =
//! ORD = 1 (rping's `responder_resources`/`initiator_depth`).
//!
//! Flags as rping's: `-s`/`-c`, `-a addr`, `-p port` (7174), `-C count`, `-S size` (64; 26 to
//! 65535), `-v`, `-V`, `-d` (`-dd`: also the stack's own debug trace). Softwarp's: `--crc
//! off|on` (default off, like siw: CRC is then used only if the peer asks for it),
//! `--mpa-rev 1|2` (2), `--p2p` (offer RFC 6581 peer-to-peer RTR as initiator), `--timeout
//! SECS` (30: every wait is bounded, including the server's wait for a connection), `--mpa-timeout
//! SECS` (5, `ConnectOptions::timeout`'s default: the bound on the MPA exchange; a server
//! closes a connection whose MPA Request is not complete by then, RFC 5044's timer),
//! `--terminate-layout rfc|siw` (how our Terminates are laid out). A server given `-C N` also
//! checks that N pings happened before the client disconnected. Exit status 0 on success.
#![allow(clippy::unwrap_used)]

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use softwarp::{
    install_ras_subscriber, AccessFlags, AsyncEvent, Cause, CompletionChannel, CompletionQueue,
    ConnectOptions, ConnectionInfo, Device, Listener, MemoryRegion, MpaRevision, Payload,
    ProtectionDomain, QpCap, QpInitAttr, QueuePair, RasConfig, RecvWr, SendOp, SendWr, SgList,
    Stag, TerminateLayout, WcOpcode, WcStatus,
};

/// `sizeof(struct rping_rdma_info)`.
const INFO_LEN: usize = 16;
/// rping's `RPING_MIN_BUFSIZE`: `sizeof(stringify(INT_MAX)) + sizeof(RPING_MSG_FMT)`.
const MIN_SIZE: usize = 11 + 15;
/// rping's `RPING_BUFSIZE - 1`.
const MAX_SIZE: usize = 64 * 1024 - 1;
/// rping's `RPING_SQ_DEPTH`.
const SQ_DEPTH: usize = 16;

/// Work request ids.
const WR_RECV: u64 = 1;
const WR_SEND: u64 = 2;
const WR_RDMA: u64 = 3;

#[derive(Debug, Clone)]
pub(crate) struct Args {
    pub(crate) server: bool,
    addr: Option<String>,
    port: u16,
    count: u64,
    size: usize,
    verbose: bool,
    validate: bool,
    debug: u32,
    crc: bool,
    revision: MpaRevision,
    p2p: bool,
    timeout: Duration,
    mpa_timeout: Duration,
    terminate_layout: TerminateLayout,
    advertise_size: Option<u32>,
    first_fpdu_delay: Option<Duration>,
}

fn usage() -> String {
    "usage:\n  rping -s [-vVd] [-S size] [-C count] [-a addr] [-p port] [OPTIONS]\n  \
     rping -c [-vVd] [-S size] [-C count] -a addr [-p port] [OPTIONS]\n\
     \t-c\t\tclient side\n\t-s\t\tserver side\n\t-v\t\tdisplay ping data to stdout\n\
     \t-V\t\tvalidate ping data\n\t-d\t\tdebug printfs (-dd: also the stack's trace)\n\
     \t-S size \tping data size\n\t-C count\tping count times\n\t-a addr\t\taddress\n\
     \t-p port\t\tport\n\
     OPTIONS (Softwarp):\n\t--crc off|on\task for MPA CRC32c (default off, as siw)\n\
     \t--mpa-rev 1|2\tMPA revision to offer/accept (default 2)\n\
     \t--p2p\t\toffer RFC 6581 peer-to-peer mode (RTR) as client\n\
     \t--timeout SECS\tbound on every wait (default 30)\n\
     \t--mpa-timeout SECS\tbound on the MPA exchange; a server closes a connection\n\t\t\twhose MPA Request is not complete by then (default 5)\n\
     \t--terminate-layout rfc|siw\tlayout of the Terminates we send (default rfc)\n\
     \t--first-fpdu-delay MS\tclient: wait after the MPA Reply (default: the library's)\n\
     \t--advertise-size BYTES\tclient: advertise this buffer size instead of -S (fault\n\
     \t\t\tinjection: a larger size makes the server overrun our buffers)\n"
        .to_string()
}

pub(crate) fn parse_args(argv: &[String]) -> Result<Args, String> {
    let mut a = Args {
        server: false,
        addr: None,
        port: 7174,
        count: 0,
        size: 64,
        verbose: false,
        validate: false,
        debug: 0,
        crc: false,
        revision: MpaRevision::Rev2,
        p2p: false,
        timeout: Duration::from_secs(30),
        mpa_timeout: ConnectOptions::default().timeout,
        terminate_layout: TerminateLayout::Rfc5040,
        advertise_size: None,
        first_fpdu_delay: None,
    };
    let mut role = None;
    let mut i = 0;
    let value = |i: &mut usize, inline: &str, name: &str| -> Result<String, String> {
        if !inline.is_empty() {
            return Ok(inline.to_string());
        }
        *i += 1;
        argv.get(*i)
            .cloned()
            .ok_or_else(|| format!("option {name} needs a value"))
    };
    while i < argv.len() {
        let arg = argv[i].clone();
        if let Some(long) = arg.strip_prefix("--") {
            let (name, inline) = long.split_once('=').unwrap_or((long, ""));
            match name {
                "crc" => {
                    a.crc = match value(&mut i, inline, "--crc")?.as_str() {
                        "on" => true,
                        "off" => false,
                        v => return Err(format!("--crc takes on or off, not {v:?}")),
                    }
                }
                "mpa-rev" => {
                    a.revision = match value(&mut i, inline, "--mpa-rev")?.as_str() {
                        "1" => MpaRevision::Rev1,
                        "2" => MpaRevision::Rev2,
                        v => return Err(format!("--mpa-rev takes 1 or 2, not {v:?}")),
                    }
                }
                "p2p" => a.p2p = true,
                "timeout" => {
                    let v = value(&mut i, inline, "--timeout")?;
                    let secs: f64 = v
                        .parse()
                        .ok()
                        .filter(|s: &f64| s.is_finite() && *s > 0.0)
                        .ok_or_else(|| format!("--timeout takes seconds, not {v:?}"))?;
                    a.timeout = Duration::from_secs_f64(secs);
                }
                "mpa-timeout" => {
                    let v = value(&mut i, inline, "--mpa-timeout")?;
                    let secs: f64 = v
                        .parse()
                        .ok()
                        .filter(|s: &f64| s.is_finite() && *s > 0.0)
                        .ok_or_else(|| format!("--mpa-timeout takes seconds, not {v:?}"))?;
                    a.mpa_timeout = Duration::from_secs_f64(secs);
                }
                "terminate-layout" => {
                    a.terminate_layout = match value(&mut i, inline, "--terminate-layout")?.as_str()
                    {
                        "rfc" => TerminateLayout::Rfc5040,
                        "siw" => TerminateLayout::LinuxSiw,
                        v => return Err(format!("--terminate-layout takes rfc or siw, not {v:?}")),
                    }
                }
                "advertise-size" => {
                    let v = value(&mut i, inline, "--advertise-size")?;
                    a.advertise_size = Some(v.parse().map_err(|_| format!("invalid size {v:?}"))?);
                }
                "first-fpdu-delay" => {
                    let v = value(&mut i, inline, "--first-fpdu-delay")?;
                    let ms: u64 = v
                        .parse()
                        .map_err(|_| format!("--first-fpdu-delay takes milliseconds, not {v:?}"))?;
                    a.first_fpdu_delay = Some(Duration::from_millis(ms));
                }
                "help" => return Err(String::new()),
                _ => return Err(format!("unknown option --{name}")),
            }
        } else if let Some(flags) = arg.strip_prefix('-').filter(|f| !f.is_empty()) {
            // getopt("a:p:C:S:scvVd"): flags may be grouped, values may be attached.
            for (pos, c) in flags.char_indices() {
                let rest = &flags[pos + c.len_utf8()..];
                match c {
                    's' => role = Some(true),
                    'c' => role = Some(false),
                    'v' => a.verbose = true,
                    'V' => a.validate = true,
                    'd' => a.debug += 1,
                    'a' | 'p' | 'C' | 'S' => {
                        let v = value(&mut i, rest, &format!("-{c}"))?;
                        match c {
                            'a' => a.addr = Some(v),
                            'p' => a.port = v.parse().map_err(|_| format!("invalid port {v:?}"))?,
                            'C' => {
                                a.count = v.parse().map_err(|_| format!("Invalid count {v:?}"))?
                            }
                            _ => {
                                let size: usize = v.parse().unwrap_or(0);
                                if !(MIN_SIZE..=MAX_SIZE).contains(&size) {
                                    return Err(format!(
                                        "Invalid size {v} (valid range is {MIN_SIZE} to {MAX_SIZE})"
                                    ));
                                }
                                a.size = size;
                            }
                        }
                        break;
                    }
                    _ => return Err(format!("unknown option -{c}")),
                }
            }
        } else {
            return Err(format!("unexpected argument {arg:?}"));
        }
        i += 1;
    }
    a.server = role.ok_or("one of -s or -c is required")?;
    if !a.server && a.addr.is_none() {
        return Err("the client needs -a addr".into());
    }
    Ok(a)
}

/// `struct rping_rdma_info`, big-endian on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RdmaInfo {
    buf: u64,
    rkey: u32,
    size: u32,
}

impl RdmaInfo {
    fn to_bytes(self) -> [u8; INFO_LEN] {
        let mut b = [0u8; INFO_LEN];
        b[..8].copy_from_slice(&self.buf.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b[12..].copy_from_slice(&self.size.to_be_bytes());
        b
    }
    fn from_bytes(b: &[u8; INFO_LEN]) -> Self {
        Self {
            buf: u64::from_be_bytes(b[..8].try_into().unwrap()),
            rkey: u32::from_be_bytes(b[8..12].try_into().unwrap()),
            size: u32::from_be_bytes(b[12..].try_into().unwrap()),
        }
    }
}

/// What the completion handler reports (rping's state changes).
#[derive(Debug)]
enum Event {
    /// A 16-byte message arrived (the receive is already reposted).
    Recv(RdmaInfo),
    /// The RDMA Read completed with this many bytes.
    ReadComplete(u32),
    /// The RDMA Write completed.
    WriteComplete,
    /// The connection ended (the peer disconnected): work requests were flushed.
    Disconnected(String),
}

/// The control block (rping's `struct rping_cb`). Fields drop in this order: the QP first.
pub(crate) struct Cb {
    qp: QueuePair,
    recv_mr: MemoryRegion,
    /// rping's `rdma_buf`: the server's RDMA Read sink and Write source; the client's sink.
    rdma_mr: MemoryRegion,
    /// rping's `start_buf`: the client's source (None on the server).
    start_mr: Option<MemoryRegion>,
    cq: CompletionQueue,
    channel: CompletionChannel,
    _pd: ProtectionDomain,
    dev: Device,
    args: Args,
}

macro_rules! debug {
    ($cb:expr, $($fmt:tt)*) => {
        if $cb.args.debug > 0 {
            println!($($fmt)*);
        }
    };
}

impl Cb {
    pub(crate) fn new(args: Args) -> Result<Self, String> {
        let e = |what: &str| {
            let what = what.to_string();
            move |err: softwarp::Error| format!("{what}: {err}")
        };
        let dev = Device::builder()
            .ras(RasConfig::from_env())
            .open()
            .map_err(e("open device"))?;
        let pd = dev.alloc_pd().map_err(e("ibv_alloc_pd"))?;
        let channel = dev
            .create_comp_channel()
            .map_err(e("ibv_create_comp_channel"))?;
        let cq = dev
            .create_cq(SQ_DEPTH * 2, Some(&channel))
            .map_err(e("ibv_create_cq"))?;
        let mut attr = QpInitAttr::new(&cq, &cq);
        attr.cap = QpCap {
            max_send_wr: SQ_DEPTH,
            max_recv_wr: 2,
            max_send_sge: 1,
            max_recv_sge: 1,
            ..QpCap::default()
        };
        // rping_init_conn_param: responder_resources = initiator_depth = 1.
        attr.max_rd_atomic = 1;
        attr.max_dest_rd_atomic = 1;
        let qp = pd.create_qp(&attr).map_err(e("rdma_create_qp"))?;
        if args.debug > 0 {
            println!("created pd, channel, cq and qp {}", qp.qp_num());
        }
        let lw = AccessFlags::LOCAL_WRITE;
        let rw = lw | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
        let recv_mr = pd.reg_mr(INFO_LEN, lw).map_err(e("recv_buf reg_mr"))?;
        let rdma_mr = pd.reg_mr(args.size, rw).map_err(e("rdma_buf reg_mr"))?;
        let start_mr = if args.server {
            None
        } else {
            Some(pd.reg_mr(args.size, rw).map_err(e("start_buf reg_mr"))?)
        };
        let cb = Self {
            args,
            dev,
            channel,
            cq,
            qp,
            recv_mr,
            rdma_mr,
            start_mr,
            _pd: pd,
        };
        debug!(cb, "allocated & registered buffers...");
        cb.post_recv()?;
        Ok(cb)
    }

    fn options(&self) -> ConnectOptions {
        let opts = ConnectOptions::default()
            .crc(self.args.crc)
            .revision(self.args.revision)
            .peer_to_peer(self.args.p2p)
            .timeout(self.args.mpa_timeout)
            .terminate_layout(self.args.terminate_layout);
        match self.args.first_fpdu_delay {
            Some(d) => opts.first_fpdu_delay(d),
            None => opts,
        }
    }

    fn post_recv(&self) -> Result<(), String> {
        let sge = self
            .recv_mr
            .sge(0, INFO_LEN as u32)
            .map_err(|e| e.to_string())?;
        self.qp
            .post_recv(&RecvWr {
                wr_id: WR_RECV,
                sgl: SgList::single(sge),
            })
            .map_err(|e| format!("post recv error: {e}"))
    }

    fn post_send(&self, op: SendOp, payload: Payload<'_>, wr_id: u64) -> Result<(), String> {
        self.qp
            .post_send(&SendWr {
                wr_id,
                op,
                payload,
                signaled: true,
                fence: false,
            })
            .map_err(|e| format!("post send error: {e}"))
    }

    fn send_info(&self, info: RdmaInfo) -> Result<(), String> {
        let bytes = info.to_bytes();
        self.post_send(
            SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            Payload::Inline(&bytes),
            WR_SEND,
        )
    }

    /// rping_cq_event_handler + the semaphore: the next completion that changes the test's
    /// state, waiting on the completion channel (bounded by `--timeout`).
    fn next_event(&self, waiting_for: &str) -> Result<Event, String> {
        let deadline = Instant::now() + self.args.timeout;
        let mut flushed = false;
        loop {
            while let Some(wc) = self.cq.poll_one() {
                if wc.status != WcStatus::Success {
                    if wc.status == WcStatus::WrFlushErr {
                        debug!(self, "flushed completion (wr_id {})", wc.wr_id);
                        flushed = true;
                        continue;
                    }
                    return Err(format!(
                        "cq completion failed status {:?} ({:?}, wr_id {}){}",
                        wc.status,
                        wc.opcode,
                        wc.wr_id,
                        self.async_events()
                    ));
                }
                match wc.opcode {
                    WcOpcode::Send => debug!(self, "send completion"),
                    WcOpcode::RdmaWrite => {
                        debug!(self, "rdma write completion");
                        return Ok(Event::WriteComplete);
                    }
                    WcOpcode::RdmaRead => {
                        debug!(self, "rdma read completion");
                        return Ok(Event::ReadComplete(wc.byte_len));
                    }
                    WcOpcode::Recv => {
                        debug!(self, "recv completion");
                        if wc.byte_len as usize != INFO_LEN {
                            return Err(format!("Received bogus data, size {}", wc.byte_len));
                        }
                        let mut b = [0u8; INFO_LEN];
                        self.recv_mr.read_at(0, &mut b).map_err(|e| e.to_string())?;
                        self.post_recv()?;
                        return Ok(Event::Recv(RdmaInfo::from_bytes(&b)));
                    }
                    // rping posts no atomics and no immediate-data operations.
                    other => {
                        return Err(format!("unexpected completion opcode {other:?}"));
                    }
                }
            }
            if flushed {
                return Ok(Event::Disconnected(self.async_events()));
            }
            self.cq.req_notify(false).map_err(|e| e.to_string())?;
            if !self.cq.is_empty() {
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(format!(
                    "no completion within {:?} while waiting for {waiting_for} (QP {:?})",
                    self.args.timeout,
                    self.qp.state()
                ));
            }
            match self.channel.get_cq_event(Some(deadline - now)) {
                Ok(_) | Err(softwarp::Error::Timeout(_)) => {}
                Err(e) => return Err(format!("Failed to get cq event: {e}")),
            }
        }
    }

    /// Asynchronous events so far, as text (empty when there were none, or only the
    /// connection's end).
    fn async_events(&self) -> String {
        let mut s = String::new();
        while let Some(ev) = self.dev.try_get_async_event() {
            let closed = matches!(
                ev,
                AsyncEvent::QpFatal {
                    cause: Cause::LlpClosed,
                    ..
                }
            );
            debug!(self, "async event: {ev:?}");
            if !closed {
                let _ = write!(s, "; {}", describe_event(&ev));
            }
        }
        s
    }

    fn print_connected(&self, info: &ConnectionInfo) {
        debug!(
            self,
            "connected to {} from {}: MPA rev {}, CRC {}, IRD {} ORD {}, RTR {:?}, MSS {}, FPDU {} B",
            info.peer_addr,
            info.local_addr,
            info.revision,
            if info.crc { "on" } else { "off" },
            info.ird,
            info.ord,
            info.rtr,
            info.mss,
            info.max_fpdu_len
        );
    }

    /// The NUL-terminated string at the start of `mr` (rping prints `%s`).
    fn c_string(mr: &MemoryRegion) -> Result<Vec<u8>, String> {
        let mut v = mr.to_vec().map_err(|e| e.to_string())?;
        if let Some(nul) = v.iter().position(|&b| b == 0) {
            v.truncate(nul);
        }
        Ok(v)
    }

    pub(crate) fn run_server(&self) -> Result<(), String> {
        let host = self.args.addr.as_deref().unwrap_or("0.0.0.0");
        let listener =
            Listener::bind((host, self.args.port)).map_err(|e| format!("rdma_bind_addr: {e}"))?;
        debug!(self, "rdma_bind_addr successful");
        debug!(self, "rdma_listen");
        let info = listener
            .accept_timeout(&self.qp, &self.options(), self.args.timeout)
            .map_err(|e| format!("connect error: {e}"))?;
        drop(listener);
        self.print_connected(&info);
        let result = self.test_server();
        let _ = self.qp.disconnect();
        let _ = self.qp.wait_closed(Duration::from_secs(5));
        result
    }

    /// rping_test_server.
    fn test_server(&self) -> Result<(), String> {
        let zeros = [0u8; INFO_LEN];
        let go = || {
            self.post_send(
                SendOp::Send {
                    solicited: false,
                    invalidate: None,
                },
                Payload::Inline(&zeros),
                WR_SEND,
            )
        };
        let mut pings = 0u64;
        loop {
            // Wait for client's Start STAG/TO/Len.
            let src = match self.next_event("the client's source buffer info")? {
                Event::Recv(info) => info,
                Event::Disconnected(why) => {
                    eprintln!("server DISCONNECT EVENT...");
                    if !why.is_empty() {
                        return Err(format!("connection ended with an error{why}"));
                    }
                    if self.args.count > 0 && pings < self.args.count {
                        return Err(format!(
                            "the client disconnected after {pings} of {} pings",
                            self.args.count
                        ));
                    }
                    debug!(self, "{pings} pings served");
                    return Ok(());
                }
                other => return Err(format!("wait for RDMA_READ_ADV state: {other:?}")),
            };
            debug!(
                self,
                "Received rkey {:x} addr {:x} len {} from peer", src.rkey, src.buf, src.size
            );
            debug!(self, "server received sink adv");
            if src.size as usize > self.rdma_mr.len() {
                return Err(format!(
                    "the client's buffer ({} bytes) is larger than ours (-S {}): give both \
                     sides the same -S",
                    src.size,
                    self.rdma_mr.len()
                ));
            }
            // Issue RDMA Read.
            let sink = self.rdma_mr.sge(0, src.size).map_err(|e| e.to_string())?;
            self.post_send(
                SendOp::Read {
                    remote_addr: src.buf,
                    rkey: Stag(src.rkey),
                },
                Payload::Sgl(SgList::single(sink)),
                WR_RDMA,
            )?;
            debug!(self, "server posted rdma read req ");
            match self.next_event("the RDMA Read")? {
                Event::ReadComplete(n) if n == src.size => {}
                Event::ReadComplete(n) => {
                    return Err(format!(
                        "RDMA Read of {} bytes completed with {n}",
                        src.size
                    ))
                }
                other => return Err(format!("wait for RDMA_READ_COMPLETE state: {other:?}")),
            }
            debug!(self, "server received read complete");
            let data = Self::c_string(&self.rdma_mr)?;
            if self.args.verbose {
                println!("server ping data: {}", String::from_utf8_lossy(&data));
            }
            // Tell client to continue.
            go()?;
            debug!(self, "server posted go ahead");

            // Wait for client's RDMA STAG/TO/Len.
            let sink = match self.next_event("the client's sink buffer info")? {
                Event::Recv(info) => info,
                other => return Err(format!("wait for RDMA_WRITE_ADV state: {other:?}")),
            };
            debug!(self, "server received sink adv");
            // RDMA Write echo data: strlen(rdma_buf) + 1, bounded by the buffer.
            let len = (data.len() + 1).min(self.rdma_mr.len()) as u32;
            if len > sink.size {
                return Err(format!(
                    "the client's sink ({} bytes) cannot take the {len}-byte echo",
                    sink.size
                ));
            }
            let src_sge = self.rdma_mr.sge(0, len).map_err(|e| e.to_string())?;
            debug!(
                self,
                "rdma write from lkey {:x} laddr {:x} len {}", src_sge.lkey.0, src_sge.addr, len
            );
            self.post_send(
                SendOp::Write {
                    remote_addr: sink.buf,
                    rkey: Stag(sink.rkey),
                },
                Payload::Sgl(SgList::single(src_sge)),
                WR_RDMA,
            )?;
            match self.next_event("the RDMA Write")? {
                Event::WriteComplete => {}
                other => return Err(format!("wait for RDMA_WRITE_COMPLETE state: {other:?}")),
            }
            debug!(self, "server rdma write complete ");
            // Tell client to begin again.
            go()?;
            debug!(self, "server posted go ahead");
            pings += 1;
        }
    }

    pub(crate) fn run_client(&self) -> Result<(), String> {
        let host = self.args.addr.as_deref().unwrap_or_default();
        let info = self
            .qp
            .connect((host, self.args.port), &self.options())
            .map_err(|e| format!("connect error: {e}"))?;
        debug!(self, "rdma_connect successful");
        self.print_connected(&info);
        let result = self.test_client();
        // rping_disconnect: a graceful close, then wait for the connection to end.
        let closed = self
            .qp
            .disconnect()
            .and_then(|()| self.qp.wait_closed(self.args.timeout));
        match (result, closed) {
            (Err(e), _) => Err(e),
            (Ok(()), Err(e)) => Err(format!("disconnect: {e}")),
            (Ok(()), Ok(state)) => {
                debug!(self, "disconnected (QP {state:?})");
                Ok(())
            }
        }
    }

    /// rping_test_client.
    fn test_client(&self) -> Result<(), String> {
        let Some(start_mr) = &self.start_mr else {
            return Err("client without a source buffer".into());
        };
        let size = self.args.size;
        let mut start: u8 = 65;
        let mut ping = 0u64;
        while self.args.count == 0 || ping < self.args.count {
            // Put some ascii text in the buffer.
            let buf = ping_pattern(ping, start, size);
            start = if start >= 122 { 65 } else { start + 1 };
            start_mr.write_at(0, &buf).map_err(|e| e.to_string())?;
            let advertised = self.args.advertise_size.unwrap_or(size as u32);
            let src = RdmaInfo {
                buf: start_mr.addr(),
                rkey: start_mr.rkey().0,
                size: advertised,
            };
            debug!(
                self,
                "RDMA addr {:x} rkey {:x} len {}", src.buf, src.rkey, src.size
            );
            self.send_info(src)?;

            // Wait for server to ACK.
            match self.next_event("the server's go-ahead after its RDMA Read")? {
                Event::Recv(_) => {}
                other => return Err(format!("wait for RDMA_WRITE_ADV state: {other:?}")),
            }
            let sink = RdmaInfo {
                buf: self.rdma_mr.addr(),
                rkey: self.rdma_mr.rkey().0,
                size: advertised,
            };
            debug!(
                self,
                "RDMA addr {:x} rkey {:x} len {}", sink.buf, sink.rkey, sink.size
            );
            self.send_info(sink)?;

            // Wait for the server to say the RDMA Write is complete.
            match self.next_event("the server's go-ahead after its RDMA Write")? {
                Event::Recv(_) => {}
                other => return Err(format!("wait for RDMA_WRITE_COMPLETE state: {other:?}")),
            }
            let got = self.rdma_mr.to_vec().map_err(|e| e.to_string())?;
            if self.args.validate && got != buf {
                return Err("data mismatch!".into());
            }
            if self.args.verbose {
                let s = Self::c_string(&self.rdma_mr)?;
                println!("ping data: {}", String::from_utf8_lossy(&s));
            }
            ping += 1;
        }
        Ok(())
    }
}

/// An asynchronous event in words (layer/type/code numbers as on the wire).
fn describe_event(ev: &AsyncEvent) -> String {
    let cause = match ev {
        AsyncEvent::QpFatal { cause, .. }
        | AsyncEvent::QpRequestError { cause, .. }
        | AsyncEvent::QpAccessError { cause, .. } => *cause,
        other => return format!("{other:?}"),
    };
    match cause {
        Cause::PeerTerminate { layer, etype, code } => {
            let layer_name = match layer {
                0 => "RDMAP",
                1 => "DDP",
                2 => "LLP",
                _ => "unknown layer",
            };
            format!(
                "the peer sent a Terminate: layer {layer} ({layer_name}), error type {etype}, \
                 code {code:#04x} ({ev:?})"
            )
        }
        Cause::Detected(fault) => {
            format!("we detected {fault:?} in the peer's traffic and sent a Terminate ({ev:?})")
        }
        other => format!("{other:?} ({ev:?})"),
    }
}

/// rping_test_client's buffer: "rdma-ping-N: ", then letters from `start` cycling A..z,
/// the last byte NUL.
fn ping_pattern(ping: u64, start: u8, size: usize) -> Vec<u8> {
    let mut buf = format!("rdma-ping-{ping}: ").into_bytes();
    buf.truncate(size.saturating_sub(1));
    let mut c = start;
    while buf.len() < size {
        buf.push(c);
        c = if c >= 122 { 65 } else { c + 1 };
    }
    if let Some(last) = buf.last_mut() {
        *last = 0;
    }
    buf
}

/// `-dd`: a minimal `tracing` subscriber that prints the stack's debug records to stderr.
mod trace {
    use std::fmt::Write as _;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Instant;

    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Level, Metadata, Subscriber};

    pub struct Stderr {
        pub max: Level,
        pub start: Instant,
        pub next_id: AtomicU64,
    }

    struct Fields(String);

    impl Visit for Fields {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                let _ = write!(self.0, " {value:?}");
            } else {
                let _ = write!(self.0, " {}={value:?}", field.name());
            }
        }
    }

    impl Subscriber for Stderr {
        fn enabled(&self, m: &Metadata<'_>) -> bool {
            *m.level() <= self.max
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(self.next_id.fetch_add(1, Ordering::Relaxed).max(1))
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, e: &Event<'_>) {
            let mut f = Fields(String::new());
            e.record(&mut f);
            let m = e.metadata();
            eprintln!(
                "[{:9.6}] {:5} {}:{}",
                self.start.elapsed().as_secs_f64(),
                m.level(),
                m.target(),
                f.0
            );
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }
}

fn main() {
    // Opt in to what an operator sees: Softwarp's console + flight recorder subscriber, and
    // (at the device open below) the RAS services the environment configures.
    install_ras_subscriber();
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse_args(&argv) {
        Ok(a) => a,
        Err(msg) => {
            if !msg.is_empty() {
                eprintln!("rping: {msg}");
            }
            eprint!("{}", usage());
            std::process::exit(if msg.is_empty() { 0 } else { 1 });
        }
    };
    if args.debug >= 2 {
        let sub = trace::Stderr {
            max: tracing::Level::DEBUG,
            start: Instant::now(),
            next_id: std::sync::atomic::AtomicU64::new(1),
        };
        let _ = tracing::subscriber::set_global_default(sub);
    }
    let server = args.server;
    let result = Cb::new(args).and_then(|cb| {
        if server {
            cb.run_server()
        } else {
            cb.run_client()
        }
    });
    if let Err(e) = result {
        eprintln!(
            "rping {} failed: {e}",
            if server { "server" } else { "client" }
        );
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_matches_rping_for_the_first_two_pings() {
        let p = ping_pattern(0, 65, 32);
        assert_eq!(&p[..], b"rdma-ping-0: ABCDEFGHIJKLMNOPQR\0");
        let p = ping_pattern(1, 66, 32);
        assert_eq!(&p[..], b"rdma-ping-1: BCDEFGHIJKLMNOPQRS\0");
    }

    #[test]
    fn pattern_wraps_from_z_to_capital_a() {
        let p = ping_pattern(0, 121, 17);
        assert_eq!(&p[..], b"rdma-ping-0: yzA\0");
    }

    #[test]
    fn info_is_big_endian_16_bytes() {
        let i = RdmaInfo {
            buf: 0x0102030405060708,
            rkey: 0x0a0b0c0d,
            size: 64,
        };
        let b = i.to_bytes();
        assert_eq!(b, [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 0, 0, 0, 64]);
        assert_eq!(RdmaInfo::from_bytes(&b), i);
    }

    #[test]
    fn grouped_flags_and_attached_values_parse_like_getopt() {
        let v: Vec<String> = ["-cvV", "-a192.0.2.1", "-C", "3", "-S64", "--crc", "on"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let a = parse_args(&v).unwrap();
        assert!(!a.server && a.verbose && a.validate && a.crc);
        assert_eq!(a.addr.as_deref(), Some("192.0.2.1"));
        assert_eq!((a.count, a.size), (3, 64));
        assert!(parse_args(&["-s".into(), "-S".into(), "25".into()]).is_err());
        assert!(parse_args(&["-c".into()]).is_err());
    }
}
