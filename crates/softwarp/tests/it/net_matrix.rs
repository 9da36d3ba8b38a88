//! The network fault matrix (issue 17): the two ends in network namespaces this test creates,
//! a transfer of mixed Sends, RDMA Writes and RDMA Reads of random sizes (CRC on), every byte
//! checked, under:
//!
//! - loss of 1 % and 10 % of the packets in both directions (nftables `numgen random` drop
//!   rules on a veth pair: this kernel has no `netem`);
//! - a bandwidth cap (`tbf`, 20 Mbit/s) on both ends of the veth pair;
//! - delay with jitter, reordering and duplication, from a user-space impairment bridge
//!   between two TUN devices (`Bridge`): packets read from one namespace's TUN device are
//!   written into the other's after a delay, some held back so later ones overtake them,
//!   some written twice.
//!
//! Kernel TCP repairs all of these, so the iWARP stream above it must come through whole:
//! every operation completes successfully with the right bytes, and nothing lands outside
//! the ranges the operations named. Needs root, `ip` (iproute2), `nft` (nftables) for the
//! loss cases, `tc` for the cap, and `/dev/net/tun`; each case skips with a printed reason
//! when its tools are missing. Corruption above TCP is `tests/it/net_faults.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use softwarp::*;
use softwarp_testkit::{file, require};

use crate::netns;
use crate::netns::{drop_packets, in_ns, unavailable, Ns};
use crate::util::{pattern, wait_wcs, End, WAIT};

// ---------------------------------------------------------------------------------------
// Namespaces and links
// ---------------------------------------------------------------------------------------

/// Two namespaces joined by a link; `b_addr` is the responder's address in `b`.
struct Net {
    a: Ns,
    b: Ns,
    b_addr: IpAddr,
    /// The impairment bridge of a TUN pair (stopped and joined before the namespaces go).
    bridge: Option<Bridge>,
}

impl Drop for Net {
    fn drop(&mut self) {
        drop(self.bridge.take());
    }
}

/// A veth pair between two new namespaces, 10.77.0.1 and 10.77.0.2 ([`netns::veth`]).
fn veth() -> Net {
    let (a, b) = netns::veth();
    Net {
        a,
        b,
        b_addr: "10.77.0.2".parse().unwrap(),
        bridge: None,
    }
}

/// Packets the rule of [`drop_packets`] dropped in `ns` so far.
fn dropped(ns: &Ns) -> u64 {
    let o = Command::new("ip")
        .args([
            "netns", "exec", &ns.0, "nft", "list", "chain", "inet", "swt", "out",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    let mut words = text.split_whitespace();
    while let Some(w) = words.next() {
        if w == "packets" {
            return words.next().and_then(|n| n.parse().ok()).unwrap_or(0);
        }
    }
    0
}

// ---------------------------------------------------------------------------------------
// The impairment bridge
// ---------------------------------------------------------------------------------------

/// What the bridge does to each packet, in each direction.
#[derive(Debug, Clone, Copy, Default)]
struct Impair {
    /// Every packet waits this long...
    delay: Duration,
    /// ...plus a uniformly random part of this.
    jitter: Duration,
    /// Percent of packets held back `HOLD` longer, so later packets overtake them.
    reorder_pct: u32,
    /// Percent of packets written twice.
    dup_pct: u32,
}

/// How much longer a reordered packet waits.
const HOLD: Duration = Duration::from_millis(3);

/// Packets the bridge moved, per kind, for the report.
#[derive(Debug, Default)]
struct BridgeStats {
    packets: AtomicU64,
    reordered: AtomicU64,
    duplicated: AtomicU64,
}

/// Two forwarding threads between a TUN device in each namespace.
struct Bridge {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    stats: Arc<BridgeStats>,
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A TUN device created inside `ns` (from a thread that entered it), with `local` and the
/// point-to-point `peer` address, up.
fn tun_in(ns: &Ns, local: &str, peer: &str) -> tun_tap::Iface {
    let iface = std::thread::scope(|s| {
        s.spawn(|| {
            ns.enter();
            tun_tap::Iface::without_packet_info("swtun%d", tun_tap::Mode::Tun).unwrap()
        })
        .join()
        .unwrap()
    });
    iface.set_non_blocking().unwrap();
    ns.ip(&["addr", "add", local, "peer", peer, "dev", iface.name()]);
    ns.ip(&["link", "set", iface.name(), "up"]);
    iface
}

/// Namespaces `a` (10.78.0.1) and `b` (10.78.0.2) whose only link is the bridge.
fn tun_pair(imp: Impair) -> Net {
    let a = Ns::new("a");
    let b = Ns::new("b");
    let ta = Arc::new(tun_in(&a, "10.78.0.1", "10.78.0.2"));
    let tb = Arc::new(tun_in(&b, "10.78.0.2", "10.78.0.1"));
    let stop = Arc::new(AtomicBool::new(false));
    let stats = Arc::new(BridgeStats::default());
    let threads = [(ta.clone(), tb.clone(), 1u64), (tb, ta, 2u64)]
        .into_iter()
        .map(|(from, to, seed)| {
            let (stop, stats) = (stop.clone(), stats.clone());
            std::thread::spawn(move || forward(&from, &to, imp, seed, &stop, &stats))
        })
        .collect();
    Net {
        a,
        b,
        b_addr: "10.78.0.2".parse().unwrap(),
        bridge: Some(Bridge {
            stop,
            threads,
            stats,
        }),
    }
}

/// Moves packets from `from` to `to` with the impairments until `stop` (or a minute).
fn forward(
    from: &tun_tap::Iface,
    to: &tun_tap::Iface,
    imp: Impair,
    seed: u64,
    stop: &AtomicBool,
    stats: &BridgeStats,
) {
    let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    // Packets waiting for their time, ordered by (release time, arrival order).
    let mut due: BinaryHeap<Reverse<(Instant, u64, Vec<u8>)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut buf = vec![0u8; 65536];
    let end = Instant::now() + Duration::from_secs(60);
    while !stop.load(Ordering::Relaxed) && Instant::now() < end && due.len() < 100_000 {
        let mut idle = true;
        match from.recv(&mut buf) {
            Ok(n) => {
                idle = false;
                stats.packets.fetch_add(1, Ordering::Relaxed);
                let jitter_ns = imp.jitter.as_nanos() as u64;
                let mut wait = imp.delay
                    + Duration::from_nanos(if jitter_ns == 0 {
                        0
                    } else {
                        next() % jitter_ns
                    });
                if (next() % 100) < u64::from(imp.reorder_pct) {
                    wait += HOLD;
                    stats.reordered.fetch_add(1, Ordering::Relaxed);
                }
                let copies = if (next() % 100) < u64::from(imp.dup_pct) {
                    stats.duplicated.fetch_add(1, Ordering::Relaxed);
                    2
                } else {
                    1
                };
                for _ in 0..copies {
                    seq += 1;
                    due.push(Reverse((Instant::now() + wait, seq, buf[..n].to_vec())));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => break,
        }
        let now = Instant::now();
        while due.peek().is_some_and(|Reverse((t, _, _))| *t <= now) {
            let Reverse((_, _, p)) = due.pop().unwrap();
            // A full queue on the other side drops the packet, as a wire would.
            let _ = to.send(&p);
            idle = false;
        }
        if idle {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

// ---------------------------------------------------------------------------------------
// The transfer
// ---------------------------------------------------------------------------------------

/// Operations per case, at most `WINDOW` outstanding; sizes 1 B to `MAX_SIZE`.
const OPS: usize = 48;
const WINDOW: usize = 8;
const MAX_SIZE: usize = 64 * 1024;

/// Connects `a` (in `net.a`) to `b` (in `net.b`), runs the transfer, checks every byte and
/// returns the bytes moved.
fn transfer(net: &Net, a: &End, b: &End) -> usize {
    let opts = ConnectOptions::default();
    let listener = in_ns(&net.b, || {
        Listener::bind(SocketAddr::new(net.b_addr, 0)).unwrap()
    });
    let addr = listener.local_addr().unwrap();
    std::thread::scope(|s| {
        let acc = s.spawn(|| listener.accept_timeout(&b.qp, &opts, WAIT).unwrap());
        in_ns(&net.a, || a.qp.connect(addr, &opts).unwrap());
        acc.join().unwrap();
    });

    let lw = AccessFlags::LOCAL_WRITE;
    let remote = lw | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let span = OPS * MAX_SIZE;
    let (src, src_data) = a.mr(span, lw, 0xa1);
    let (sink, sink_before) = a.mr(span, lw, 0xa2);
    let (rbuf, rbuf_before) = b.mr(span, lw, 0xb1);
    let (target, target_before) = b.mr(span, remote, 0xb2);
    let sizes: Vec<usize> = pattern(OPS * 8, 0x5125)
        .chunks(8)
        .map(|c| 1 + (u64::from_le_bytes(c.try_into().unwrap()) as usize % MAX_SIZE))
        .collect();
    let mut want_rbuf = rbuf_before.clone();
    let mut want_target = target_before.clone();
    let mut want_sink = sink_before.clone();
    let mut moved = 0;
    for chunk in (0..OPS).collect::<Vec<_>>().chunks(WINDOW) {
        let mut sends = 0;
        for &i in chunk {
            let (at, len) = (i * MAX_SIZE, sizes[i]);
            let local = SgList::single(src.sge(at, len as u32).unwrap());
            let op = match i % 3 {
                0 => {
                    b.qp.post_recv(&RecvWr {
                        wr_id: i as u64,
                        sgl: SgList::single(rbuf.sge(at, MAX_SIZE as u32).unwrap()),
                    })
                    .unwrap();
                    sends += 1;
                    want_rbuf[at..at + len].copy_from_slice(&src_data[at..at + len]);
                    SendOp::Send {
                        solicited: false,
                        invalidate: None,
                    }
                }
                1 => {
                    want_target[at..at + len].copy_from_slice(&src_data[at..at + len]);
                    SendOp::Write {
                        remote_addr: target.addr() + at as u64,
                        rkey: target.rkey(),
                    }
                }
                _ => {
                    want_sink[at..at + len].copy_from_slice(&target_before[at..at + len]);
                    a.qp.post_send(&SendWr {
                        wr_id: i as u64,
                        op: SendOp::Read {
                            remote_addr: target.addr() + at as u64,
                            rkey: target.rkey(),
                        },
                        payload: Payload::Sgl(SgList::single(sink.sge(at, len as u32).unwrap())),
                        signaled: true,
                        fence: false,
                    })
                    .unwrap();
                    moved += len;
                    continue;
                }
            };
            a.qp.post_send(&SendWr {
                wr_id: i as u64,
                op,
                payload: Payload::Sgl(local),
                signaled: true,
                fence: false,
            })
            .unwrap();
            moved += len;
        }
        let wcs = wait_wcs(&a.scq, chunk.len());
        assert!(
            wcs.iter().all(|w| w.status == WcStatus::Success),
            "initiator completions: {wcs:?}"
        );
        let rwcs = wait_wcs(&b.rcq, sends);
        assert!(
            rwcs.iter().all(|w| w.status == WcStatus::Success),
            "responder completions: {rwcs:?}"
        );
        for w in &rwcs {
            assert_eq!(w.byte_len as usize, sizes[w.wr_id as usize]);
        }
    }
    // Reads target only bytes no Write touches (each op has its own slot), so their data is
    // the target's initial pattern.
    assert!(rbuf.to_vec().unwrap() == want_rbuf, "received Sends");
    assert!(target.to_vec().unwrap() == want_target, "RDMA Write target");
    assert!(sink.to_vec().unwrap() == want_sink, "RDMA Read sink");
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(b.qp.state(), QpState::Rts);
    moved
}

/// One case: builds the network with `setup`, transfers, prints the figures.
fn case(name: &str, tools: &[&str], setup: impl FnOnce() -> Net) {
    if !require(unavailable(tools).map(|why| format!("{name}: {why}"))) {
        return;
    }
    let deep = |attr: &mut QpInitAttr<'_>| {
        attr.cap.max_send_wr = 2 * WINDOW;
        attr.cap.max_recv_wr = 2 * WINDOW;
    };
    let a = End::with(None, None, deep);
    let b = End::with(None, None, deep);
    let net = setup();
    let t = Instant::now();
    let bytes = transfer(&net, &a, &b);
    let lost = dropped(&net.a) + dropped(&net.b);
    let extra = net
        .bridge
        .as_ref()
        .map_or(format!(", {lost} packets dropped"), |br| {
            format!(
                ", bridge: {} packets, {} held back, {} duplicated",
                br.stats.packets.load(Ordering::Relaxed),
                br.stats.reordered.load(Ordering::Relaxed),
                br.stats.duplicated.load(Ordering::Relaxed)
            )
        });
    println!(
        "{name}: {OPS} operations, {bytes} bytes checked in {:.2} s{extra}",
        t.elapsed().as_secs_f64()
    );
    drop((a, b));
    drop(net);
}

#[test]
fn loss_1_percent_both_ways() {
    case("loss 1%", &["ip", "nft"], || {
        let net = veth();
        drop_packets(&net.a, 1);
        drop_packets(&net.b, 1);
        net
    });
}

#[test]
fn loss_10_percent_both_ways() {
    case("loss 10%", &["ip", "nft"], || {
        let net = veth();
        drop_packets(&net.a, 10);
        drop_packets(&net.b, 10);
        net
    });
}

#[test]
fn bandwidth_cap_20_mbit() {
    case("tbf 20 Mbit/s", &["ip", "tc"], || {
        let net = veth();
        for (ns, dev) in [(&net.a, "sw0"), (&net.b, "sw1")] {
            ns.exec(
                "tc",
                &[
                    "qdisc", "add", "dev", dev, "root", "tbf", "rate", "20mbit", "burst", "32kbit",
                    "latency", "100ms",
                ],
            );
        }
        net
    });
}

fn tun_case(name: &str, imp: Impair) {
    let tun = std::path::Path::new("/dev/net/tun");
    if !require(file(tun, &format!("{name}: /dev/net/tun"))) {
        return;
    }

    case(name, &["ip"], || tun_pair(imp));
}

#[test]
fn delay_5ms_with_5ms_jitter() {
    tun_case(
        "delay 5 ms + jitter 0-5 ms",
        Impair {
            delay: Duration::from_millis(5),
            jitter: Duration::from_millis(5),
            ..Impair::default()
        },
    );
}

#[test]
fn reordering_20_percent() {
    tun_case(
        "reorder 20% (held 3 ms)",
        Impair {
            delay: Duration::from_micros(200),
            reorder_pct: 20,
            ..Impair::default()
        },
    );
}

#[test]
fn duplication_10_percent() {
    tun_case(
        "duplicate 10%",
        Impair {
            delay: Duration::from_micros(200),
            dup_pct: 10,
            ..Impair::default()
        },
    );
}
