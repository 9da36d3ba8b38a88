//! Two processes exchange every iWARP operation over one TCP connection.
//!
//! ```text
//! cargo run --release -p softwarp --example pingpong -- --server 127.0.0.1:7174
//! cargo run --release -p softwarp --example pingpong -- --client 127.0.0.1:7174
//! ```
//!
//! The server advertises a memory region (address, STag); the client RDMA Writes a pattern
//! into it, RDMA Reads it back, sends a message with Solicited Event, and ends with a
//! Send with Invalidate of the server's STag. Both sides check every byte, print one line
//! per operation, and exit with status 0 on success. Options: `--size BYTES` (default
//! 1048576), `--no-crc`.
//!
//! The server (the MPA responder) speaks first. RFC 5044 lets a responder send nothing
//! before the initiator's first FPDU, and Softwarp holds its posted work until then; so the
//! client negotiates RFC 6581 peer-to-peer mode, whose ready-to-receive message (RTR) is
//! that first FPDU and opens the server's way at once.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use softwarp::{
    install_ras_subscriber, AccessFlags, CompletionQueue, ConnectOptions, Device, Listener,
    MemoryRegion, Payload, QpInitAttr, QueuePair, RasConfig, RecvWr, Result, SendOp, SendWr,
    SgList, Stag, WcStatus, WorkCompletion,
};

const WAIT: Duration = Duration::from_secs(30);

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn wait(cq: &CompletionQueue, what: &str) -> WorkCompletion {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(wc) = cq.poll_one() {
            if wc.status != WcStatus::Success {
                fail(&format!("{what}: completion {wc:?}"));
            }
            return wc;
        }
        if Instant::now() > deadline {
            fail(&format!("{what}: no completion within {WAIT:?}"));
        }
        std::thread::yield_now();
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("pingpong: FAILED: {msg}");
    std::process::exit(1);
}

fn check(ok: bool, msg: &str) {
    if !ok {
        fail(msg);
    }
}

fn send(qp: &QueuePair, wr_id: u64, op: SendOp, payload: Payload<'_>) -> Result<()> {
    qp.post_send(&SendWr {
        wr_id,
        op,
        payload,
        signaled: true,
        fence: false,
    })
}

fn recv(qp: &QueuePair, mr: &MemoryRegion, wr_id: u64) -> Result<()> {
    qp.post_recv(&RecvWr {
        wr_id,
        sgl: SgList::single(mr.sge(0, mr.len() as u32)?),
    })
}

fn line(op: &str, bytes: usize, t0: Instant, note: &str) {
    let secs = t0.elapsed().as_secs_f64();
    println!("{op:<22} {bytes:>10} B  {:>9.3} ms  {note}", secs * 1e3);
}

fn server(addr: &str, size: usize, opts: &ConnectOptions) -> Result<()> {
    let dev = Device::builder().ras(RasConfig::from_env()).open()?;
    let pd = dev.alloc_pd()?;
    let cq = dev.create_cq(64, None)?;
    let qp = pd.create_qp(&QpInitAttr::new(&cq, &cq))?;
    let lw = AccessFlags::LOCAL_WRITE;
    let msg_buf = pd.reg_mr(size, lw)?;
    let inv_buf = pd.reg_mr(64, lw)?;
    let target = pd.reg_mr(
        size,
        lw | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_INVALIDATE,
    )?;
    // Receives first: the client may send as soon as the connection is up.
    recv(&qp, &msg_buf, 1)?;
    recv(&qp, &inv_buf, 2)?;
    let listener = Listener::bind(addr)?;
    println!("pingpong server: listening on {}", listener.local_addr()?);
    let info = listener.accept(&qp, opts)?;
    println!(
        "pingpong server: connected to {} (MPA rev {}, CRC {}, FPDU {} B)",
        info.peer_addr, info.revision, info.crc, info.max_fpdu_len
    );
    // Advertise the target: address, STag, size.
    let mut advert = Vec::new();
    advert.extend_from_slice(&target.addr().to_be_bytes());
    advert.extend_from_slice(&target.rkey().0.to_be_bytes());
    advert.extend_from_slice(&(size as u32).to_be_bytes());
    send(
        &qp,
        10,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        Payload::Inline(&advert),
    )?;
    wait(&cq, "advert");

    let t0 = Instant::now();
    let wc = wait(&cq, "receive of the client's Send");
    check(wc.wr_id == 1 && wc.byte_len as usize == size, "Send length");
    check(wc.solicited, "Solicited Event flag");
    check(msg_buf.to_vec()? == pattern(size, 3), "Send payload bytes");
    line("recv Send+SE", size, t0, "bytes verified");

    let t0 = Instant::now();
    let wc = wait(&cq, "receive of the Send with Invalidate");
    check(wc.wr_id == 2, "second receive");
    check(
        wc.invalidated_stag == Some(target.rkey()),
        "invalidated STag",
    );
    check(!target.is_valid(), "target STag invalidated");
    check(
        target.to_vec()? == pattern(size, 7),
        "RDMA Write bytes at the target",
    );
    line(
        "recv Send+Invalidate",
        wc.byte_len as usize,
        t0,
        &format!(
            "STag {:#010x} invalidated; Write bytes verified",
            target.rkey().0
        ),
    );
    send(
        &qp,
        11,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        Payload::Inline(b"bye"),
    )?;
    wait(&cq, "bye");
    // Let the client read the reply before the connection closes.
    qp.disconnect()?;
    let _ = qp.wait_closed(Duration::from_secs(5));
    println!("pingpong server: OK");
    Ok(())
}

fn client(addr: &str, opts: &ConnectOptions) -> Result<()> {
    let dev = Device::builder().ras(RasConfig::from_env()).open()?;
    let pd = dev.alloc_pd()?;
    let cq = dev.create_cq(64, None)?;
    let qp = pd.create_qp(&QpInitAttr::new(&cq, &cq))?;
    let lw = AccessFlags::LOCAL_WRITE;
    let advert_buf = pd.reg_mr(64, lw)?;
    let bye_buf = pd.reg_mr(64, lw)?;
    recv(&qp, &advert_buf, 1)?;
    recv(&qp, &bye_buf, 2)?;
    // The server speaks first: see the module docs.
    let info = qp.connect(addr, &opts.clone().peer_to_peer(true))?;
    println!(
        "pingpong client: connected to {} (MPA rev {}, CRC {}, FPDU {} B)",
        info.peer_addr, info.revision, info.crc, info.max_fpdu_len
    );
    let wc = wait(&cq, "advert");
    let mut a = [0u8; 16];
    advert_buf.read_at(0, &mut a)?;
    check(wc.byte_len == 16, "advert length");
    let remote_addr = u64::from_be_bytes(a[..8].try_into().unwrap());
    let rkey = Stag(u32::from_be_bytes(a[8..12].try_into().unwrap()));
    let size = u32::from_be_bytes(a[12..16].try_into().unwrap()) as usize;

    let src = pd.reg_mr(size, AccessFlags::NONE)?;
    let sink = pd.reg_mr(size, lw)?;
    let sgl = |mr: &MemoryRegion| -> Result<SgList> {
        Ok(if size == 0 {
            SgList::new()
        } else {
            SgList::single(mr.sge(0, size as u32)?)
        })
    };

    src.write_at(0, &pattern(size, 7))?;
    let t0 = Instant::now();
    send(
        &qp,
        20,
        SendOp::Write { remote_addr, rkey },
        Payload::Sgl(sgl(&src)?),
    )?;
    wait(&cq, "RDMA Write");
    line("RDMA Write", size, t0, "handed to TCP");

    let t0 = Instant::now();
    send(
        &qp,
        21,
        SendOp::Read { remote_addr, rkey },
        Payload::Sgl(sgl(&sink)?),
    )?;
    let wc = wait(&cq, "RDMA Read");
    check(wc.byte_len as usize == size, "Read length");
    check(sink.to_vec()? == pattern(size, 7), "RDMA Read bytes");
    line("RDMA Read", size, t0, "bytes verified");

    src.write_at(0, &pattern(size, 3))?;
    let t0 = Instant::now();
    send(
        &qp,
        22,
        SendOp::Send {
            solicited: true,
            invalidate: None,
        },
        Payload::Sgl(sgl(&src)?),
    )?;
    wait(&cq, "Send+SE");
    line("Send+SE", size, t0, "handed to TCP");

    let t0 = Instant::now();
    send(
        &qp,
        23,
        SendOp::Send {
            solicited: false,
            invalidate: Some(rkey),
        },
        Payload::Sgl(SgList::new()),
    )?;
    wait(&cq, "Send+Invalidate");
    let wc = wait(&cq, "server's reply");
    check(wc.wr_id == 2 && wc.byte_len == 3, "reply");
    line("Send+Invalidate", 0, t0, "server confirmed everything");
    println!("pingpong client: OK");
    Ok(())
}

fn main() {
    // Opt in to what an operator sees: Softwarp's console + flight recorder subscriber, and
    // (at the device open below) the RAS services the environment configures.
    install_ras_subscriber();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut role = None;
    let mut size = 1 << 20;
    let mut opts = ConnectOptions::default();
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--server" | "--client" => {
                let addr = args.get(i + 1).cloned().unwrap_or_else(|| {
                    fail(&format!("{} needs an address (host:port)", args[i]))
                });
                role = Some((args[i].clone(), addr));
                i += 1;
            }
            "--size" => {
                size = args
                    .get(i + 1)
                    .and_then(|s| s.parse().ok())
                    .unwrap_or_else(|| fail("--size needs a number of bytes"));
                i += 1;
            }
            "--no-crc" => opts = opts.crc(false),
            other => fail(&format!(
                "unknown argument {other:?}; use --server ADDR | --client ADDR [--size N] [--no-crc]"
            )),
        }
        i += 1;
    }
    let result = match role {
        Some((r, addr)) if r == "--server" => server(&addr, size, &opts),
        Some((_, addr)) => client(&addr, &opts),
        None => fail("use --server ADDR or --client ADDR"),
    };
    if let Err(e) = result {
        fail(&e.to_string());
    }
}
