//! Message rate of small Sends between two busy-polled QPs on loopback, driven by one thread.
//!
//! ```text
//! cargo run --release -p softwarp --example msgrate -- [MESSAGES] [--size B] [--list N] [--recv-each] [--crc-off] [--fpdu B] [--write-imm]
//! valgrind --tool=callgrind target/release/examples/msgrate 20000
//! ```
//!
//! The sender posts its Sends in lists of `--list` (default 64; every 16th signalled), the
//! receiver polls its CQ until the whole list arrived and posts the receives back as one
//! list (`--recv-each`: one `post_recv` per message), then the sender's signalled completions are taken. Both CQs are in busy-poll mode,
//! so every byte is moved by this one thread: the run is repeatable, and under callgrind the
//! instructions per message are the difference of two runs of different lengths divided by
//! the difference of their message counts (setup and teardown cancel out). Prints the
//! messages, the time, and the rate (wall clock: meaningful only on a quiet machine).
//! `--write-imm` posts RDMA Writes with Immediate Data into the receiver's buffer instead of
//! Sends (each still completes a receive WR), to count the tagged receive path.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use softwarp::{
    install_ras_subscriber, AccessFlags, CompletionQueue, ConnectOptions, Device, Listener,
    Payload, QpInitAttr, RasConfig, RecvWr, SendOp, SendWr, SgList, WcStatus, WorkCompletion,
    EMPTY_COMPLETION,
};

const SIGNAL_EVERY: u64 = 16;
const WAIT: Duration = Duration::from_secs(30);

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| v.parse().expect("a number"))
}

/// Polls `cq` until `want` completions arrived; returns how many were receives.
fn take(cq: &CompletionQueue, wcs: &mut [WorkCompletion], want: usize) -> usize {
    let deadline = Instant::now() + WAIT;
    let mut got = 0;
    let mut spins = 0u64;
    while got < want {
        let n = cq.poll(wcs).unwrap();
        for wc in wcs.iter().take(n) {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        }
        got += n;
        spins += 1;
        if spins.is_multiple_of(1024) {
            assert!(Instant::now() < deadline, "no completion within {WAIT:?}");
        }
    }
    got
}

fn main() {
    // Opt in to what an operator sees: Softwarp's console + flight recorder subscriber, and
    // (at the device open below) the RAS services the environment configures.
    install_ras_subscriber();
    let args: Vec<String> = std::env::args().collect();
    let messages = args
        .get(1)
        .filter(|a| !a.starts_with("--"))
        .map_or(20_000, |v| v.parse().expect("a message count")) as u64;
    let size = arg(&args, "--size", 64);
    let list = arg(&args, "--list", 64).max(1);
    // Repost receives one `post_recv` at a time instead of one list.
    let recv_each = args.iter().any(|a| a == "--recv-each");
    // Both ends ask for no CRC: what is left is the runtime's and the engine's own work.
    let crc = !args.iter().any(|a| a == "--crc-off");
    // FPDUs of at most this many bytes (`ConnectOptions::max_fpdu_len`; 0: the loopback
    // default of 65,535), as against a peer whose MSS is 1460: `--fpdu 1460`.
    let fpdu = arg(&args, "--fpdu", 0);
    let write_imm = args.iter().any(|a| a == "--write-imm");

    let dev = Device::builder().ras(RasConfig::from_env()).open().unwrap();
    let pd = dev.alloc_pd().unwrap();
    let depth = list * 2;
    let (scq, rcq) = (
        dev.create_cq(depth * 2, None).unwrap(),
        dev.create_cq(depth * 2, None).unwrap(),
    );
    scq.set_busy_poll(true);
    rcq.set_busy_poll(true);
    let mut attr = QpInitAttr::new(&scq, &scq);
    attr.cap.max_send_wr = depth;
    let sender = pd.create_qp(&attr).unwrap();
    let mut attr = QpInitAttr::new(&rcq, &rcq);
    attr.cap.max_recv_wr = depth;
    let receiver = pd.create_qp(&attr).unwrap();
    let src = pd.reg_mr(size.max(1), AccessFlags::NONE).unwrap();
    let dst = pd
        .reg_mr(
            size.max(1),
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    let (dst_addr, dst_rkey) = (dst.sge(0, 0).unwrap().addr, dst.rkey());
    let recv_wr = RecvWr {
        wr_id: 0,
        sgl: SgList::single(dst.sge(0, size as u32).unwrap()),
    };
    let recvs = vec![recv_wr; list];
    receiver.post_recv_list(&recvs).unwrap();

    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let opts = ConnectOptions::default()
        .crc(crc)
        .max_fpdu_len((fpdu > 0).then_some(fpdu));
    std::thread::scope(|s| {
        let server = s.spawn(|| listener.accept(&receiver, &opts).map(|_| ()));
        sender.connect(addr, &opts).unwrap();
        server.join().unwrap().unwrap();
    });

    let mut wcs = vec![EMPTY_COMPLETION; 128];
    let mut wrs = Vec::with_capacity(list);
    let t0 = Instant::now();
    let mut sent = 0u64;
    while sent < messages {
        let n = (list as u64).min(messages - sent);
        wrs.clear();
        let mut signaled = 0;
        for i in 0..n {
            let id = sent + i;
            let signal = (id + 1).is_multiple_of(SIGNAL_EVERY) || id + 1 == messages;
            signaled += usize::from(signal);
            wrs.push(SendWr {
                wr_id: id,
                op: if write_imm {
                    SendOp::WriteWithImm {
                        remote_addr: dst_addr,
                        rkey: dst_rkey,
                        imm: id as u32,
                    }
                } else {
                    SendOp::Send {
                        solicited: false,
                        invalidate: None,
                    }
                },
                payload: Payload::Sgl(SgList::single(src.sge(0, size as u32).unwrap())),
                signaled: signal,
                fence: false,
            });
        }
        sender.post_send_list(&wrs).unwrap();
        let got = take(&rcq, &mut wcs, n as usize);
        if recv_each {
            for wr in &recvs[..got] {
                receiver.post_recv(wr).unwrap();
            }
        } else {
            receiver.post_recv_list(&recvs[..got]).unwrap();
        }
        take(&scq, &mut wcs, signaled);
        sent += n;
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "msgrate: {messages} messages of {size} B in lists of {list}: {:.3} s, {:.3} Mmsg/s",
        secs,
        messages as f64 / secs / 1e6
    );
}
