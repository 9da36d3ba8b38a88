//! Soak (issue 17): every operation, random sizes, 64 connected QP pairs on two devices over
//! loopback, for a bounded time, with every byte checked and the resident set size watched.
//!
//! Four threads each drive 16 pairs, one operation at a time per pair, chosen at random:
//! Send, Send with Solicited Event, Send with Invalidate (of a registration made for it and
//! dropped after), Send with Immediate, RDMA Write (read back by an RDMA Read), RDMA Write
//! with Immediate, RDMA Read, FetchAdd and CmpSwap, sizes 0 B to 256 KiB (half of them at
//! most 4 KiB). The initiator's source bytes are fresh for every operation and a mirror of
//! each responder's target region follows every Write and atomic, so each completion's data
//! is compared with what it must be.
//!
//! The run lasts `SOFTWARP_SOAK_SECS` seconds (default 6, the CI run). After the first
//! quarter the RSS is sampled as the baseline; it may not grow by more than `RSS_SLACK` by
//! the end (a leak of a few hundred bytes per operation would show within the CI run).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use softwarp::*;

use crate::util;
use crate::util::{pattern, End};

const PAIRS: usize = 64;
const THREADS: usize = 4;
const MAX: usize = 256 * 1024;
/// The target region: room for any Write at any offset of the first `MAX` bytes.
const TARGET: usize = 2 * MAX;
/// How much the RSS may grow between the end of the first quarter and the end.
const RSS_SLACK: u64 = 24 << 20;

/// One connected pair: `a` initiates every operation, `b` serves it.
struct Pair {
    a: End,
    b: End,
    src: MemoryRegion,
    sink: MemoryRegion,
    rbuf: MemoryRegion,
    target: MemoryRegion,
    /// What `target` holds.
    mirror: Vec<u8>,
    /// Operations done, per kind.
    done: [u64; OPS],
    bytes: u64,
    rng: u64,
}

const OPS: usize = 9;
const NAMES: [&str; OPS] = [
    "send",
    "send_se",
    "send_inv",
    "send_imm",
    "write+read",
    "write_imm",
    "read",
    "fetch_add",
    "cmp_swap",
];

impl Pair {
    fn new(dev_a: &Device, dev_b: &Device, seed: u64) -> Self {
        let deep = |attr: &mut QpInitAttr<'_>| {
            attr.cap.max_send_wr = 16;
            attr.cap.max_recv_wr = 16;
        };
        let mut a = End::with(None, Some(dev_a.clone()), deep);
        let mut b = End::with(None, Some(dev_b.clone()), deep);
        util::connect(&mut a, &mut b, &ConnectOptions::default());
        let lw = AccessFlags::LOCAL_WRITE;
        let src = a.pd.reg_mr(MAX, lw).unwrap();
        let sink = a.pd.reg_mr(MAX, lw).unwrap();
        let rbuf = b.pd.reg_mr(MAX, lw).unwrap();
        let remote =
            lw | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
        let target = b.pd.reg_mr(TARGET, remote).unwrap();
        let mirror = pattern(TARGET, seed);
        target.write_at(0, &mirror).unwrap();
        Self {
            a,
            b,
            src,
            sink,
            rbuf,
            target,
            mirror,
            done: [0; OPS],
            bytes: 0,
            rng: seed | 1,
        }
    }

    fn next(&mut self) -> u64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn size(&mut self) -> usize {
        let r = self.next();
        let cap = if r & 1 == 0 { 4096 } else { MAX };
        ((r >> 1) as usize) % (cap + 1)
    }

    fn post(&self, wr_id: u64, op: SendOp, payload: Payload<'_>) {
        self.a
            .qp
            .post_send(&SendWr {
                wr_id,
                op,
                payload,
                signaled: true,
                fence: false,
            })
            .unwrap();
    }

    fn recv(&self, wr_id: u64) {
        self.b
            .qp
            .post_recv(&RecvWr {
                wr_id,
                sgl: SgList::single(self.rbuf.sge(0, MAX as u32).unwrap()),
            })
            .unwrap();
    }

    fn one_wc(cq: &CompletionQueue, opcode: WcOpcode, what: &str) -> WorkCompletion {
        let w = take_one(cq);
        assert_eq!(
            (w.status, w.opcode),
            (WcStatus::Success, opcode),
            "{what}: {w:?}"
        );
        w
    }

    /// Fresh source bytes of `len` for this operation.
    fn fill(&mut self, len: usize) -> Vec<u8> {
        let seed = self.next();
        let data = pattern(len, seed);
        self.src.write_at(0, &data).unwrap();
        data
    }

    fn sgl(mr: &MemoryRegion, at: usize, len: usize) -> Payload<'static> {
        let mut l = SgList::new();
        if len > 0 {
            l = SgList::single(mr.sge(at, len as u32).unwrap());
        }
        Payload::Sgl(l)
    }

    fn step(&mut self) {
        let kind = (self.next() % OPS as u64) as usize;
        let id = self.done.iter().sum::<u64>();
        let len = self.size();
        match kind {
            0..=3 => self.send(kind, id, len),
            4 | 5 => self.write(kind == 5, id, len),
            6 => self.read(id, len),
            _ => self.atomic(kind == 8, id),
        }
        self.done[kind] += 1;
    }

    fn send(&mut self, kind: usize, id: u64, len: usize) {
        let data = self.fill(len);
        let imm = self.next() as u32;
        // Send with Invalidate needs a registration the peer may invalidate.
        let inv = (kind == 2).then(|| {
            self.b
                .pd
                .reg_mr(
                    64,
                    AccessFlags::LOCAL_WRITE
                        | AccessFlags::REMOTE_WRITE
                        | AccessFlags::REMOTE_INVALIDATE,
                )
                .unwrap()
        });
        let op = match kind {
            0 | 1 => SendOp::Send {
                solicited: kind == 1,
                invalidate: None,
            },
            2 => SendOp::Send {
                solicited: false,
                invalidate: inv.as_ref().map(|m| m.rkey()),
            },
            _ => SendOp::SendWithImm {
                solicited: false,
                imm,
            },
        };
        self.recv(id);
        if kind == 3 {
            self.recv(id + 1_000_000_000);
        }
        self.post(id, op, Self::sgl(&self.src, 0, len));
        Self::one_wc(&self.a.scq, WcOpcode::Send, "send");
        let w = Self::one_wc(&self.b.rcq, WcOpcode::Recv, "receive");
        assert_eq!((w.wr_id, w.byte_len as usize), (id, len));
        assert_eq!(w.solicited, kind == 1);
        assert_eq!(w.invalidated_stag, inv.as_ref().map(|m| m.rkey()));
        let mut got = vec![0u8; len];
        self.rbuf.read_at(0, &mut got).unwrap();
        assert!(got == data, "Send payload ({len} bytes)");
        if kind == 3 {
            let w = take_one(&self.b.rcq);
            assert_eq!((w.status, w.imm), (WcStatus::Success, Some(imm)), "{w:?}");
        }
        // The invalidated registration is dropped here: registration churn is soaked too.
        drop(inv);
        self.bytes += len as u64;
    }

    fn write(&mut self, with_imm: bool, id: u64, len: usize) {
        let data = self.fill(len);
        let at = (self.next() as usize) % (TARGET - len + 1);
        let (remote_addr, rkey) = (self.target.addr() + at as u64, self.target.rkey());
        let imm = self.next() as u32;
        if with_imm {
            self.recv(id);
            self.post(
                id,
                SendOp::WriteWithImm {
                    remote_addr,
                    rkey,
                    imm,
                },
                Self::sgl(&self.src, 0, len),
            );
            Self::one_wc(&self.a.scq, WcOpcode::RdmaWrite, "write with imm");
            let w = Self::one_wc(&self.b.rcq, WcOpcode::RecvRdmaWithImm, "imm");
            assert_eq!((w.imm, w.byte_len as usize), (Some(imm), len));
        } else {
            self.post(
                id,
                SendOp::Write { remote_addr, rkey },
                Self::sgl(&self.src, 0, len),
            );
            Self::one_wc(&self.a.scq, WcOpcode::RdmaWrite, "write");
            // Read it back: the Read Response follows the Write's placement (RDMAP order).
            self.post(
                id,
                SendOp::Read { remote_addr, rkey },
                Self::sgl(&self.sink, 0, len),
            );
            Self::one_wc(&self.a.scq, WcOpcode::RdmaRead, "read back");
            let mut back = vec![0u8; len];
            self.sink.read_at(0, &mut back).unwrap();
            assert!(back == data, "Write read back ({len} bytes at {at})");
        }
        self.mirror[at..at + len].copy_from_slice(&data);
        let mut now = vec![0u8; len];
        self.target.read_at(at, &mut now).unwrap();
        assert!(now == data, "Write target ({len} bytes at {at})");
        self.bytes += len as u64;
    }

    fn read(&mut self, id: u64, len: usize) {
        let at = (self.next() as usize) % (TARGET - len + 1);
        self.post(
            id,
            SendOp::Read {
                remote_addr: self.target.addr() + at as u64,
                rkey: self.target.rkey(),
            },
            Self::sgl(&self.sink, 0, len),
        );
        let w = Self::one_wc(&self.a.scq, WcOpcode::RdmaRead, "read");
        assert_eq!(w.byte_len as usize, len);
        let mut got = vec![0u8; len];
        self.sink.read_at(0, &mut got).unwrap();
        assert!(
            got == self.mirror[at..at + len],
            "Read ({len} bytes at {at})"
        );
        self.bytes += len as u64;
    }

    fn atomic(&mut self, cmp_swap: bool, id: u64) {
        let at = ((self.next() as usize) % (TARGET / 8)) * 8;
        let old = u64::from_ne_bytes(self.mirror[at..at + 8].try_into().unwrap());
        let (remote_addr, rkey) = (self.target.addr() + at as u64, self.target.rkey());
        let r = self.next();
        // CmpSwap: half the time with the right comparand.
        let (op, new, opcode) = if cmp_swap {
            let compare = if r & 1 == 0 { old } else { old ^ 1 };
            let new = if compare == old { r } else { old };
            (
                SendOp::CmpSwap {
                    remote_addr,
                    rkey,
                    compare,
                    swap: r,
                },
                new,
                WcOpcode::CmpSwap,
            )
        } else {
            (
                SendOp::FetchAdd {
                    remote_addr,
                    rkey,
                    add: r,
                },
                old.wrapping_add(r),
                WcOpcode::FetchAdd,
            )
        };
        self.post(id, op, Self::sgl(&self.sink, 0, 8));
        Self::one_wc(&self.a.scq, opcode, "atomic");
        let mut got = [0u8; 8];
        self.sink.read_at(0, &mut got).unwrap();
        assert_eq!(u64::from_ne_bytes(got), old, "atomic original at {at}");
        let mut now = [0u8; 8];
        self.target.read_at(at, &mut now).unwrap();
        assert_eq!(u64::from_ne_bytes(now), new, "atomic result at {at}");
        self.mirror[at..at + 8].copy_from_slice(&new.to_ne_bytes());
        self.bytes += 8;
    }
}

/// The next completion of `cq`, exactly one (panics after `util::WAIT`).
fn take_one(cq: &CompletionQueue) -> WorkCompletion {
    let deadline = Instant::now() + util::WAIT;
    loop {
        if let Some(w) = cq.poll_one() {
            return w;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for a completion"
        );
        std::thread::yield_now();
    }
}

fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

#[test]
fn soak_every_operation_over_64_qps() {
    // The RSS it watches is the whole process's: one test at a time.
    let _serial = softwarp_testkit::serial();
    let secs: u64 = std::env::var("SOFTWARP_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    util::opt_in_ras();
    let dev_a = Device::open_default().unwrap();
    let dev_b = Device::open_default().unwrap();
    let mut pairs: Vec<Pair> = (0..PAIRS)
        .map(|i| Pair::new(&dev_a, &dev_b, 0x50a4 + i as u64))
        .collect();
    let start = Instant::now();
    let total = Duration::from_secs(secs);
    let quarter = start + total / 4;
    let end = start + total;
    let baseline = std::sync::Mutex::new(None::<u64>);
    std::thread::scope(|s| {
        for chunk in pairs.chunks_mut(PAIRS / THREADS) {
            let baseline = &baseline;
            s.spawn(move || {
                while Instant::now() < end {
                    for p in chunk.iter_mut() {
                        p.step();
                    }
                    if Instant::now() >= quarter {
                        baseline.lock().unwrap().get_or_insert_with(rss);
                    }
                }
            });
        }
    });
    let after = rss();
    let before = baseline.into_inner().unwrap().unwrap_or(after);
    let mut by_kind = [0u64; OPS];
    for p in &pairs {
        for (k, n) in p.done.iter().enumerate() {
            by_kind[k] += n;
        }
    }
    let ops: u64 = by_kind.iter().sum();
    let bytes: u64 = pairs.iter().map(|p| p.bytes).sum();
    let kinds: Vec<String> = NAMES
        .iter()
        .zip(by_kind)
        .map(|(n, c)| format!("{n} {c}"))
        .collect();
    println!(
        "soak: {PAIRS} QP pairs, {secs} s, {ops} operations ({}), {bytes} bytes checked; \
         RSS {} KiB after the first quarter, {} KiB at the end",
        kinds.join(", "),
        before / 1024,
        after / 1024
    );
    assert!(
        by_kind.iter().all(|&n| n > 0),
        "every operation ran: {kinds:?}"
    );
    assert!(
        after <= before + RSS_SLACK,
        "RSS grew from {before} to {after} bytes"
    );
    for p in &pairs {
        assert_eq!(p.a.qp.state(), QpState::Rts);
        assert_eq!(p.b.qp.state(), QpState::Rts);
    }
}
