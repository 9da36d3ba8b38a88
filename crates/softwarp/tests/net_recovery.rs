//! Real device faults (issue 16): two namespaces joined by a veth pair, a transfer of RDMA
//! Writes running from `a` to `b`, and then, under it:
//!
//! - the interface is deleted (`ip link del`): `a`'s device, bound to `sw0`, fails
//!   (rtnetlink: interface down or gone), `b`'s QP, whose local address went with `sw1`, is
//!   terminated at once by `b`'s network watch ("unexpected close");
//! - in a second case, `a`'s only address is removed: `a`'s QP is terminated at once and
//!   `a`'s device fails (no address left on its interface).
//!
//! In both the work requests flush, the application sees `DeviceFatal` and the reasons
//! (`QueuePair::error_reason`, `Device::fault`), releases its objects, the automatic
//! recovery (bound 3 s) makes the device operational again, the network comes back and a
//! new connection moves data. Times are printed: fault to QPs in Error, fault to device
//! operational, and the recovery's own time. Needs root and `ip`; skips otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod netns;
mod util;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use netns::{unavailable, Ns};
use softwarp::*;
use util::{wait_wcs, End, WAIT};

const A_ADDR: &str = "10.78.0.1";
const B_ADDR: &str = "10.78.0.2";
const BOUND: Duration = Duration::from_secs(3);

fn private_runtime_dir() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("net-recovery-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::env::set_var("SOFTWARP_RUNTIME_DIR", &dir);
        util::opt_in_ras();
    });
}

/// (Re)creates the veth pair `sw0` (in `a`) - `sw1` (in `b`) with one address each.
fn link(a: &Ns, b: &Ns) {
    a.ip(&[
        "link", "add", "sw0", "type", "veth", "peer", "name", "sw1", "netns", &b.0,
    ]);
    a.ip(&["addr", "add", &format!("{A_ADDR}/24"), "dev", "sw0"]);
    b.ip(&["addr", "add", &format!("{B_ADDR}/24"), "dev", "sw1"]);
    a.ip(&["link", "set", "sw0", "up"]);
    b.ip(&["link", "set", "sw1", "up"]);
}

/// Runs `f` on a thread inside `ns` (devices opened there watch that namespace; sockets
/// made there live there).
fn in_ns<T: Send>(ns: &Ns, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            ns.enter();
            f()
        })
        .join()
        .unwrap()
    })
}

/// Connects `a` (from namespace `na`) to `b` (listening in namespace `nb`).
fn connect(na: &Ns, nb: &Ns, a: &mut End, b: &mut End) {
    let opts = ConnectOptions::default();
    let listener = in_ns(nb, || Listener::bind(format!("{B_ADDR}:0")).unwrap());
    let addr: SocketAddr = listener.local_addr().unwrap();
    std::thread::scope(|s| {
        let acc = s.spawn(|| listener.accept_timeout(&b.qp, &opts, WAIT).unwrap());
        let ci = in_ns(na, || a.qp.connect(addr, &opts).unwrap());
        a.info = Some(ci);
        b.info = Some(acc.join().unwrap());
    });
}

enum Removal {
    Interface,
    Address,
}

/// Waits until `done` or the test's upper bound.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn case(name: &str, removal: Removal) {
    if let Some(why) = unavailable(&["ip"]) {
        println!("skipped {name}: {why}");
        return;
    }
    private_runtime_dir();
    let na = Ns::new("ra");
    let nb = Ns::new("rb");
    link(&na, &nb);
    let mut cfg = RecoveryConfig::default();
    cfg.bound = BOUND;
    cfg.poll = Duration::from_millis(5);
    let dev_a = in_ns(&na, || {
        Device::builder()
            .interface("sw0")
            .recovery(cfg)
            .open()
            .unwrap()
    });
    let dev_b = in_ns(&nb, || {
        Device::builder()
            .watch_network(true)
            .automatic_recovery(false)
            .open()
            .unwrap()
    });
    let mut a = End::new(None, Some(dev_a.clone()));
    let mut b = End::new(None, Some(dev_b.clone()));
    connect(&na, &nb, &mut a, &mut b);
    const LEN: usize = 64 * 1024;
    let (src, _) = a.mr(LEN, AccessFlags::LOCAL_WRITE, 1);
    let remote = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let (target, _) = b.mr(LEN, remote, 2);
    let (rbuf, _) = b.mr(LEN, AccessFlags::LOCAL_WRITE, 3);
    b.qp.post_recv(&RecvWr {
        wr_id: 99,
        sgl: SgList::single(rbuf.sge(0, LEN as u32).unwrap()),
    })
    .unwrap();

    // The transfer: one 64 KiB RDMA Write after the other until one does not succeed.
    let running = AtomicBool::new(false);
    let (writes, last, fault_at, flushed_after) = std::thread::scope(|s| {
        let sender = s.spawn(|| {
            let mut n = 0u64;
            loop {
                a.qp.post_send(&SendWr {
                    wr_id: n,
                    op: SendOp::Write {
                        remote_addr: target.addr(),
                        rkey: target.rkey(),
                    },
                    payload: Payload::Sgl(SgList::single(src.sge(0, LEN as u32).unwrap())),
                    signaled: true,
                    fence: false,
                })
                .unwrap();
                let wc = wait_wcs(&a.scq, 1)[0];
                if wc.status != WcStatus::Success {
                    return (n, wc, Instant::now());
                }
                n += 1;
                running.store(true, Ordering::Relaxed);
            }
        });
        wait_until("the transfer to run", || running.load(Ordering::Relaxed));
        std::thread::sleep(Duration::from_millis(100));
        let fault_at = Instant::now();
        match removal {
            Removal::Interface => na.ip(&["link", "del", "sw0"]),
            Removal::Address => na.ip(&["addr", "del", &format!("{A_ADDR}/24"), "dev", "sw0"]),
        }
        let (writes, last, at) = sender.join().unwrap();
        (writes, last, fault_at, at.duration_since(fault_at))
    });
    assert_eq!(last.status, WcStatus::WrFlushErr, "{last:?}");

    // a: the device failed, its QP says why, DeviceFatal was reported.
    let (ev, _) = util::wait_event(&dev_a, |e| *e == AsyncEvent::DeviceFatal);
    assert_eq!(ev, AsyncEvent::DeviceFatal);
    let fault = dev_a.fault().unwrap();
    match (&removal, &fault.kind) {
        (Removal::Interface, FaultKind::InterfaceRemoved { interface })
        | (Removal::Interface, FaultKind::InterfaceDown { interface })
        | (Removal::Address, FaultKind::AddressRemoved { interface, .. }) => {
            assert_eq!(interface, "sw0")
        }
        (_, other) => panic!("{name}: device fault {other:?}"),
    }
    let a_reason = a.qp.error_reason().unwrap();
    match (&removal, &a_reason) {
        (Removal::Address, QpErrorReason::NetworkGone { detail }) => {
            assert!(detail.contains(A_ADDR), "{detail}")
        }
        (Removal::Interface, QpErrorReason::NetworkGone { .. })
        | (Removal::Interface, QpErrorReason::DeviceFault(_)) => {}
        (_, other) => panic!("{name}: a's reason {other:?}"),
    }
    assert!(matches!(dev_a.alloc_pd(), Err(Error::DeviceFailed { .. })));
    // b: with the interface, its address went: terminated at once, receive flushed.
    if let Removal::Interface = removal {
        wait_until("b's QP to Error", || b.qp.state() == QpState::Error);
        match b.qp.error_reason() {
            Some(QpErrorReason::NetworkGone { detail }) => {
                assert!(
                    detail.contains("sw1") || detail.contains(B_ADDR),
                    "{detail}"
                )
            }
            other => panic!("b's reason {other:?}"),
        }
        let wc = wait_wcs(&b.rcq, 1)[0];
        assert_eq!((wc.wr_id, wc.status), (99, WcStatus::WrFlushErr));
    }
    let b_error_after = fault_at.elapsed();
    println!(
        "{name}: {writes} writes of 64 KiB before the fault; a's QP flushed {:.1} ms after it; \
         fault {fault}; a's QP: {a_reason}",
        flushed_after.as_secs_f64() * 1e3
    );
    assert!(
        flushed_after < Duration::from_secs(1),
        "{flushed_after:?}: not at once"
    );

    // The application lets go; the automatic recovery brings the device back.
    drop((src, target, rbuf));
    let End {
        qp, scq, rcq, pd, ..
    } = a;
    drop((qp, scq, rcq, pd));
    let released = Instant::now();
    wait_until("a's device to recover", || {
        dev_a.state() == DeviceState::Operational
    });
    let recovered = fault_at.elapsed();
    let report = dev_a.last_recovery().unwrap();
    assert_eq!(report.outcome, RecoveryOutcome::Recovered, "{report:?}");
    assert!(
        released.elapsed() <= BOUND,
        "recovered {:?} after the release",
        released.elapsed()
    );
    println!(
        "{name}: device operational {:.1} ms after the fault ({:.1} ms after the release; \
         the recovery took {} ms, bound {} ms); b's QP in Error by {:.1} ms",
        recovered.as_secs_f64() * 1e3,
        released.elapsed().as_secs_f64() * 1e3,
        report.elapsed_ms,
        report.bound_ms,
        b_error_after.as_secs_f64() * 1e3
    );

    // The network comes back; a new connection works.
    drop(b);
    match removal {
        Removal::Interface => link(&na, &nb),
        Removal::Address => na.ip(&["addr", "add", &format!("{A_ADDR}/24"), "dev", "sw0"]),
    }
    let mut a2 = End::new(None, Some(dev_a.clone()));
    let mut b2 = End::new(None, Some(dev_b.clone()));
    connect(&na, &nb, &mut a2, &mut b2);
    let (rbuf, _) = b2.mr(16, AccessFlags::LOCAL_WRITE, 4);
    b2.qp
        .post_recv(&RecvWr {
            wr_id: 1,
            sgl: SgList::single(rbuf.sge(0, 16).unwrap()),
        })
        .unwrap();
    a2.qp
        .post_send(&util::send_wr(
            2,
            util::send_op(false, None),
            Payload::Inline(b"after recovery"),
        ))
        .unwrap();
    let wc = wait_wcs(&b2.rcq, 1)[0];
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 14));
    assert_eq!(&rbuf.to_vec().unwrap()[..14], b"after recovery");
    drop((rbuf, a2, b2, dev_a, dev_b));
}

#[test]
fn deleting_the_interface_under_a_transfer_fails_and_recovers_the_device() {
    case("interface deleted", Removal::Interface);
}

#[test]
fn removing_the_address_under_a_transfer_terminates_the_qp_and_recovers_the_device() {
    case("address removed", Removal::Address);
}
