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
//! The fault reaches the child through its control socket (`fault-inject`, what `softwarp
//! fault inject --pid P` sends). This binary uses a runtime directory of its own, so other
//! test processes' devices are never counted as holders.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod util;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use softwarp::*;
use softwarp_ras::control::{self, FaultStatusResult, Request};
use softwarp_ras::tracker::ResourceKind;
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
