//! Device faults and bounded recovery (issue 16), without a network namespace:
//!
//! - a fault is contained (QPs to Error with the fault as their reason, work requests
//!   flushed, exactly one `DeviceFatal`), the failed device refuses new objects with the
//!   fault, a recovery times out naming what the application still holds (with its source
//!   line), and once everything is dropped the device is operational again and a new
//!   connection works;
//! - a child process that ignores the fault and keeps its resources is named by the
//!   parent's recovery with the child's pid, process name and file:line; not on the
//!   terminate list it is only reported (timeout); on the list it gets `SIGTERM`, ignores
//!   it, gets `SIGKILL`, and the device recovers.
//!
//! - real faults (root, `ip`; skipped otherwise), two namespaces joined by a veth pair and
//!   a transfer of RDMA Writes running from `a` to `b`: the interface is deleted (`ip link
//!   del`): `a`'s device, bound to `sw0`, fails (rtnetlink: interface down or gone), `b`'s
//!   QP, whose local address went with `sw1`, is terminated at once by `b`'s network watch
//!   ("unexpected close"); in a second case `a`'s only address is removed: `a`'s QP is
//!   terminated at once and `a`'s device fails (no address left on its interface). In both
//!   the work requests flush, the application sees `DeviceFatal` and the reasons, releases
//!   its objects, the automatic recovery (bound 3 s) makes the device operational again,
//!   the network comes back and a new connection moves data. Times are printed.
//!
//! The fault reaches the child through its control socket (`fault-inject`, what `softwarp
//! fault inject --pid P` sends). This binary uses a runtime directory of its own, so other
//! test processes' devices are never counted as holders; it is not a module of `it`, whose
//! tests open devices on `lo` all the time, and whose runtime directory is set before this
//! file's could be.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "it/util/mod.rs"]
mod util;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use softwarp::*;
use softwarp_ras::control::{self, FaultStatusResult, Request};
use softwarp_ras::tracker::ResourceKind;
use softwarp_testkit::netns::{in_ns, unavailable, Ns};
use softwarp_testkit::require;
use util::{connect, wait_event, wait_wcs, End, WAIT};

const CHILD_ENV: &str = "SOFTWARP_TEST_RECOVERY_CHILD";
/// The child and its parent bind their devices to the loopback interface: the same device
/// for the recovery (name and interface), another one than the other test's, whose
/// recovery must not wait for the child.
const SCOPE: &str = "lo";

/// This binary's own runtime directory, set before the RAS services start (the child
/// inherits it).
fn private_runtime_dir() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os(CHILD_ENV).is_none() {
            let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join(format!("recovery-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            std::env::set_var("SOFTWARP_RUNTIME_DIR", &dir);
        }
        util::opt_in_ras();
    });
}

fn quick(bound_ms: u64) -> RecoveryConfig {
    let mut c = RecoveryConfig::default();
    c.bound = Duration::from_millis(bound_ms);
    c.release_wait = Duration::from_millis(100);
    c.grace = Duration::from_millis(300);
    c.poll = Duration::from_millis(10);
    c
}

#[test]
fn a_contained_fault_blocks_new_objects_until_the_application_lets_go() {
    private_runtime_dir();
    // No automatic recovery on b's device: this test drives it.
    let dev_b = Device::builder().automatic_recovery(false).open().unwrap();
    let mut a = End::new(None, None);
    let mut b = End::new(None, Some(dev_b.clone()));
    connect(&mut a, &mut b, &ConnectOptions::default());
    let (buf, _) = b.mr(4096, AccessFlags::LOCAL_WRITE, 1);
    b.qp.post_recv(&RecvWr {
        wr_id: 7,
        sgl: SgList::single(buf.sge(0, 4096).unwrap()),
    })
    .unwrap();

    b.dev.inject_fatal_error();
    b.dev.inject_fatal_error();
    assert_eq!(dev_b.state(), DeviceState::Failed);
    let fault = dev_b.fault().unwrap();
    assert_eq!(fault.kind, FaultKind::Injected);
    assert_eq!(fault.generation, 1);
    wait_event(&b.dev, |e| *e == AsyncEvent::DeviceFatal);
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !std::iter::from_fn(|| b.dev.try_get_async_event()).any(|e| e == AsyncEvent::DeviceFatal),
        "a second fault of a failed device reported a second DeviceFatal"
    );
    // The outstanding receive flushed; a later send flushes too.
    let wcs = wait_wcs(&b.rcq, 1);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (7, WcStatus::WrFlushErr));
    b.qp.post_send(&util::send_wr(
        8,
        util::send_op(false, None),
        Payload::Inline(b"x"),
    ))
    .unwrap();
    let wcs = wait_wcs(&b.scq, 1);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (8, WcStatus::WrFlushErr));
    match b.qp.error_reason() {
        Some(QpErrorReason::DeviceFault(f)) => assert_eq!(f, fault),
        other => panic!("error reason {other:?}"),
    }
    // Error blocks: refused at once, naming the fault.
    let t = Instant::now();
    match dev_b.alloc_pd() {
        Err(Error::DeviceFailed {
            fault: f, state, ..
        }) => {
            assert_eq!(*f, fault);
            assert_eq!(state, DeviceState::Failed);
        }
        other => panic!("alloc_pd on a failed device: {other:?}"),
    }
    assert!(matches!(
        dev_b.create_cq(4, None),
        Err(Error::DeviceFailed { .. })
    ));
    assert!(matches!(
        b.pd.reg_mr(64, AccessFlags::LOCAL_WRITE),
        Err(Error::DeviceFailed { .. })
    ));
    let e =
        b.qp.connect("127.0.0.1:9", &ConnectOptions::default())
            .unwrap_err();
    assert!(matches!(e, Error::DeviceFailed { .. }), "{e}");
    assert!(e.to_string().contains("fault injected"), "{e}");
    assert!(
        t.elapsed() < Duration::from_millis(100),
        "refusals took {:?}",
        t.elapsed()
    );

    // The application still holds everything: the recovery names it, with this file.
    let r = dev_b.recover(&quick(150)).unwrap();
    assert_eq!(r.outcome, RecoveryOutcome::TimedOut);
    assert_eq!(dev_b.state(), DeviceState::Failed);
    let qp_holder = r
        .holders
        .iter()
        .find(|h| h.kind == ResourceKind::Qp)
        .expect("the QP is a holder");
    assert_eq!(qp_holder.pid, std::process::id());
    assert!(
        qp_holder.file.ends_with("util/mod.rs"),
        "{}",
        qp_holder.file
    );
    assert!(r.holders.iter().any(|h| h.kind == ResourceKind::Mr));
    let stat = |name: &str, extra: &[(&str, &str)]| {
        let mut labels = vec![("device", dev_b.instance_name())];
        labels.extend_from_slice(extra);
        softwarp_ras::stats::collect_all().get(name, &labels)
    };
    use softwarp_ras::stats::Value;
    assert_eq!(stat("softwarp_device_state", &[]), Some(Value::Int(1)));
    assert_eq!(
        stat("softwarp_device_faults_total", &[]),
        Some(Value::Int(1))
    );
    assert_eq!(
        stat(
            "softwarp_device_recoveries_total",
            &[("outcome", "timed_out")]
        ),
        Some(Value::Int(1))
    );

    // Everything dropped but the device: it recovers, and works again.
    drop(buf);
    let End {
        qp, scq, rcq, pd, ..
    } = b;
    drop((qp, scq, rcq, pd));
    let r = dev_b.recover(&quick(2000)).unwrap();
    assert_eq!(r.outcome, RecoveryOutcome::Recovered, "{r:?}");
    println!("recovered in {} ms after the last release", r.elapsed_ms);
    assert_eq!(dev_b.state(), DeviceState::Operational);
    assert_eq!(
        dev_b.last_recovery().unwrap().outcome,
        RecoveryOutcome::Recovered
    );
    assert_eq!(stat("softwarp_device_state", &[]), Some(Value::Int(0)));
    assert_eq!(
        stat(
            "softwarp_device_recoveries_total",
            &[("outcome", "recovered")]
        ),
        Some(Value::Int(1))
    );
    assert!(matches!(
        stat("softwarp_device_last_recovery_seconds", &[]),
        Some(Value::Float(_))
    ));
    // The error log: the fault with its advice, then both recoveries with their outcome.
    let dir = std::env::var_os("SOFTWARP_RUNTIME_DIR").unwrap();
    let log = std::fs::read_to_string(std::path::Path::new(&dir).join(format!(
        "errors-{}.jsonl",
        rustix::process::getuid().as_raw()
    )))
    .unwrap();
    let device = format!("\"device\":\"{}\"", dev_b.instance_name());
    let lines: Vec<&str> = log.lines().filter(|l| l.contains(&device)).collect();
    assert!(lines
        .iter()
        .any(|l| l.contains("\"event\":\"device_fatal\"")
            && l.contains("fault injected")
            && l.contains("\"action\":")));
    assert!(lines
        .iter()
        .any(|l| l.contains("\"event\":\"device_recovery\"")
            && l.contains("recovery timed_out")
            && l.contains("util/mod.rs")));
    assert!(lines
        .iter()
        .any(|l| l.contains("\"event\":\"device_recovery\"") && l.contains("recovery recovered")));
    let mut a2 = End::new(None, None);
    let mut b2 = End::new(None, Some(dev_b));
    connect(&mut a2, &mut b2, &ConnectOptions::default());
    assert_eq!(b2.qp.state(), QpState::Rts);
    drop(a);
}

/// The child side: opens a device with RAS, holds a PD and a CQ, prints where they were
/// created, and ignores the fault (and `SIGTERM`, see `spawn_child`).
#[test]
fn child_holder() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    // SIGTERM is ignored: the parent started this process through `sh -c "trap '' TERM;
    // exec ..."` (an ignored signal stays ignored across exec).
    util::opt_in_ras();
    let dev = Device::builder().interface(SCOPE).open().unwrap();
    let pd = dev.alloc_pd().unwrap();
    let line = line!() + 1;
    let cq = dev.create_cq(16, None).unwrap();
    println!("HOLD {}:{line}", file!());
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    drop((cq, pd, dev));
}

struct Child {
    proc: std::process::Child,
    hold: String,
}

fn spawn_child() -> Child {
    let exe = std::env::current_exe().unwrap();
    let mut proc = Command::new("sh")
        .arg("-c")
        .arg("trap '' TERM; exec \"$0\" \"$@\"")
        .arg(exe)
        .args(["--exact", "child_holder", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(proc.stdout.take().unwrap()).lines();
    let hold = loop {
        let l = lines
            .next()
            .expect("the child ended before holding")
            .unwrap();
        // The harness prints "test child_holder ... " before it on the same line.
        if let Some(at) = l.find("HOLD ") {
            break l[at + 5..].trim().to_string();
        }
    };
    Child { proc, hold }
}

fn control_socket(pid: u32) -> std::path::PathBuf {
    let dir = std::env::var_os("SOFTWARP_RUNTIME_DIR").unwrap();
    std::path::Path::new(&dir).join(format!("{pid}.sock"))
}

/// What `softwarp fault inject --pid P` does.
fn inject_into(pid: u32) {
    let reply = control::request(
        &control_socket(pid),
        &Request::FaultInject {
            device: None,
            kind: None,
        },
        WAIT,
    )
    .unwrap();
    let r: FaultStatusResult = reply.into_result().unwrap();
    assert!(
        r.devices
            .iter()
            .all(|d| d.state != DeviceState::Operational),
        "{r:?}"
    );
}

#[test]
fn a_child_that_keeps_its_resources_is_named_and_killed_only_when_listed() {
    private_runtime_dir();
    let mut child = spawn_child();
    let pid = child.proc.id();
    let name = std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap()
        .trim()
        .to_string();
    let dev = Device::builder()
        .interface(SCOPE)
        .automatic_recovery(false)
        .open()
        .unwrap();
    // Both instances of the device fail; the child ignores it.
    inject_into(pid);
    dev.inject_fatal_error();

    // Not on the list: reported with pid, name, thread and the child's source line.
    let t = Instant::now();
    let r = dev.recover(&quick(400)).unwrap();
    assert_eq!(r.outcome, RecoveryOutcome::TimedOut, "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let held = r
        .holders
        .iter()
        .find(|h| h.pid == pid && h.kind == ResourceKind::Cq)
        .unwrap_or_else(|| panic!("the child's CQ is not a holder: {r:?}"));
    assert_eq!(held.process, name);
    assert_eq!(format!("{}:{}", held.file, held.line), child.hold);
    assert!(r.terminated.is_empty());
    assert!(
        child.proc.try_wait().unwrap().is_none(),
        "the child was not signalled"
    );
    println!(
        "timed out after {} ms, holder pid {} ({}) thread {} at {}:{}",
        r.elapsed_ms, held.pid, held.process, held.thread, held.file, held.line
    );

    // On the list: SIGTERM (ignored), SIGKILL after the grace, then recovered.
    let mut listed = quick(3000);
    listed.terminate = vec![name.clone()];
    let t = Instant::now();
    let r = dev.recover(&listed).unwrap();
    let took = t.elapsed();
    assert_eq!(r.outcome, RecoveryOutcome::Recovered, "{r:?}");
    let signals: Vec<&str> = r.terminated.iter().map(|t| t.signal.as_str()).collect();
    assert_eq!(signals, ["SIGTERM", "SIGKILL"], "{r:?}");
    assert!(r
        .terminated
        .iter()
        .all(|t| t.pid == pid && t.process == name));
    assert!(
        r.terminated[1].at_ms >= r.terminated[0].at_ms + 300,
        "{r:?}"
    );
    let status = child.proc.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    assert_eq!(dev.state(), DeviceState::Operational);
    println!(
        "recovered in {} ms ({took:?}): SIGTERM at {} ms, SIGKILL at {} ms",
        r.elapsed_ms, r.terminated[0].at_ms, r.terminated[1].at_ms
    );
    assert!(dev.alloc_pd().is_ok());
}

// ---------------------------------------------------------------------------------------
// Real faults in network namespaces
// ---------------------------------------------------------------------------------------

const A_ADDR: &str = "10.78.0.1";
const B_ADDR: &str = "10.78.0.2";
const BOUND: Duration = Duration::from_secs(3);

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

/// Connects `a` (from namespace `na`) to `b` (listening in namespace `nb`).
fn connect_in(na: &Ns, nb: &Ns, a: &mut End, b: &mut End) {
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
    if !require(unavailable(&["ip"]).map(|why| format!("{name}: {why}"))) {
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
    connect_in(&na, &nb, &mut a, &mut b);
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
    connect_in(&na, &nb, &mut a2, &mut b2);
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
