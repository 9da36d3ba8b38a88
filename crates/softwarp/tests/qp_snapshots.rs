//! QP snapshots and automatic component dumps over real loopback connections: a QP that
//! fails is snapshotted exactly once (state, the Terminate's fields, counters that match the
//! traffic, its flight recorder records), the error log line names the snapshot, the
//! snapshot outlives the QP and the device, the history keeps its bound, and a device fault
//! writes an automatic dump into the runtime directory.
//!
//! The tests of this binary share the process-wide snapshot history, so they run one at a
//! time (a lock) with `SOFTWARP_SNAPSHOTS=4` and a runtime directory of their own, set
//! before the first device opens. A binary of its own (not a module of `it`): the history,
//! its bound and the environment are the process's.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "it/util/mod.rs"]
mod util;

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use softwarp::*;
use softwarp_ras::dump::{self, Section};
use softwarp_ras::snapshot::{self, QpSnapshot, SnapshotFilter};
use util::*;

const CAPACITY: usize = 4;

/// Serializes the tests and configures the RAS services once; returns the runtime dir.
fn setup() -> (MutexGuard<'static, ()>, &'static PathBuf) {
    static LOCK: Mutex<()> = Mutex::new(());
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = DIR.get_or_init(|| {
        // Under the target directory, so what a run leaves (registry entry, error log,
        // dump) never piles up in /tmp; directories of earlier runs that are gone are removed.
        let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        if let Ok(entries) = std::fs::read_dir(&base) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let dead = name
                    .strip_prefix("qp_snapshots-")
                    .is_some_and(|pid| !std::path::Path::new("/proc").join(pid).exists());
                if dead {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let dir = base.join(format!("qp_snapshots-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Before any device opens (the services read them once); the other tests of this
        // binary wait on the lock above, so nothing reads the environment meanwhile.
        std::env::set_var("SOFTWARP_RUNTIME_DIR", &dir);
        std::env::set_var(snapshot::SNAPSHOTS_ENV, CAPACITY.to_string());
        std::env::remove_var("SOFTWARP_ERRLOG");
        std::env::remove_var(dump::AUTO_DUMPS_ENV);
        dir
    });
    (guard, dir)
}

fn snapshots_of(dev: &str, qpn: u32) -> Vec<QpSnapshot> {
    snapshot::history()
        .list(&SnapshotFilter {
            qpn: Some(qpn),
            device: Some(dev.to_string()),
            id: None,
        })
        .snapshots
}

/// Waits (bounded) until QP `qpn` of `dev` has a snapshot; returns them all.
fn wait_snapshot(dev: &str, qpn: u32) -> Vec<QpSnapshot> {
    let deadline = Instant::now() + WAIT;
    loop {
        let s = snapshots_of(dev, qpn);
        if !s.is_empty() {
            return s;
        }
        assert!(Instant::now() < deadline, "no snapshot of {dev} QP {qpn}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The error log's lines (JSON text) in the runtime directory.
fn error_log_lines(dir: &std::path::Path) -> Vec<String> {
    let path = dir.join(format!("errors-{}.jsonl", softwarp_ras::sys::uid()));
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

fn peer_terminate(ev: &AsyncEvent, qp: u32) -> Option<(u8, u8, u8)> {
    match *ev {
        AsyncEvent::QpFatal { qp_num, cause }
        | AsyncEvent::QpAccessError { qp_num, cause }
        | AsyncEvent::QpRequestError { qp_num, cause }
            if qp_num == qp =>
        {
            match cause {
                Cause::PeerTerminate { layer, etype, code } => Some((layer, etype, code)),
                _ => None,
            }
        }
        _ => None,
    }
}

#[test]
fn a_terminate_received_leaves_one_snapshot_with_its_fields_counters_and_records() {
    let (_guard, dir) = setup();
    const SENDS: usize = 5;
    const LEN: usize = 100;
    const WRITE: u32 = 8;
    let (a, b) = pair(&ConnectOptions::default());
    let (sink, _) = b.mr(SENDS * LEN, AccessFlags::LOCAL_WRITE, 1);
    for i in 0..SENDS {
        b.qp.post_recv(&RecvWr {
            wr_id: i as u64,
            sgl: SgList::single(sink.sge(i * LEN, LEN as u32).unwrap()),
        })
        .unwrap();
    }
    let (src, _) = a.mr(LEN, AccessFlags::NONE, 2);
    for i in 0..SENDS {
        a.qp.post_send(&send_wr(
            i as u64,
            send_op(false, None),
            Payload::Sgl(SgList::single(src.sge(0, LEN as u32).unwrap())),
        ))
        .unwrap();
    }
    wait_wcs(&a.scq, SENDS);
    wait_wcs(&b.rcq, SENDS);
    // An RDMA Write to an STag b never gave out: b sends a Terminate, a receives it.
    let (target, _) = b.mr(
        4096,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        3,
    );
    a.qp.post_send(&send_wr(
        99,
        SendOp::Write {
            remote_addr: target.addr(),
            rkey: Stag(target.rkey().0 ^ 0x5a),
        },
        Payload::Sgl(SgList::single(src.sge(0, WRITE).unwrap())),
    ))
    .unwrap();
    let (ev, _) = wait_event(&a.dev, |e| peer_terminate(e, a.qp.qp_num()).is_some());
    let (layer, etype, code) = peer_terminate(&ev, a.qp.qp_num()).unwrap();
    assert_eq!(layer, 1, "a DDP tagged buffer error: {ev:?}");

    let (a_dev, a_qpn) = (a.dev.instance_name().to_string(), a.qp.qp_num());
    let (b_dev, b_qpn) = (b.dev.instance_name().to_string(), b.qp.qp_num());
    let snaps = wait_snapshot(&a_dev, a_qpn);
    assert_eq!(snaps.len(), 1, "{snaps:#?}");
    let s = &snaps[0];
    assert_eq!(s.event, "terminate_received");
    assert_eq!(s.pid, std::process::id());
    assert!(s.state == "ERROR" || s.state == "TERMINATE", "{}", s.state);
    let t = s.terminate.as_ref().expect("the Terminate's fields");
    assert_eq!(t.direction, "received");
    assert_eq!(
        (t.layer, t.etype, t.code),
        (Some(layer), Some(etype), Some(code))
    );
    assert!(
        s.reason.contains("the peer sent a Terminate"),
        "{}",
        s.reason
    );
    let info = a.info.clone().unwrap();
    assert_eq!(s.local_addr, Some(info.local_addr));
    assert_eq!(s.peer_addr, Some(info.peer_addr));
    // The counters are the traffic sent, exactly.
    let c = |k: &str| {
        s.counters
            .get(k)
            .copied()
            .unwrap_or_else(|| panic!("no {k}"))
    };
    assert_eq!(c("tx_send_messages"), SENDS as u64);
    assert_eq!(c("tx_send_bytes"), (SENDS * LEN) as u64);
    assert_eq!(c("tx_write_messages"), 1);
    assert_eq!(c("tx_write_bytes"), u64::from(WRITE));
    assert_eq!(c("rx_send_messages"), 0);
    assert_eq!(c("terminates_received"), 1);
    assert_eq!(c("terminates_sent"), 0);
    assert!(s.queues.contains_key("sq_outstanding"), "{:?}", s.queues);
    assert!(s.tcp_info.is_some(), "a connected QP has a TCP_INFO sample");
    // Its flight recorder records: its own (and a few about no QP), the Terminate among them.
    assert!(s
        .records
        .iter()
        .all(|r| r.qpn.is_none() || r.qpn == Some(a_qpn)));
    assert!(
        s.records
            .iter()
            .any(|r| r.qpn == Some(a_qpn) && r.message.contains("Terminate received")),
        "{:#?}",
        s.records
    );

    // The side that detected the violation sent the Terminate and is snapshotted too.
    let bs = wait_snapshot(&b_dev, b_qpn);
    assert_eq!(bs.len(), 1, "{bs:#?}");
    assert_eq!(bs[0].terminate.as_ref().unwrap().direction, "sent");
    assert_eq!(bs[0].counters["rx_send_messages"], SENDS as u64);
    assert_eq!(bs[0].counters["rx_send_bytes"], (SENDS * LEN) as u64);
    assert_eq!(bs[0].counters["terminates_sent"], 1);

    // The error log line of the failure names the snapshot.
    let line = error_log_lines(dir)
        .into_iter()
        .find(|l| {
            l.contains(&format!("\"qpn\":{a_qpn},"))
                && l.contains(&format!("\"device\":\"{a_dev}\""))
        })
        .expect("an error log line for a's QP");
    assert!(line.contains("\"event\":\"terminate_received\""), "{line}");
    assert!(line.contains(&format!("\"snapshot\":{}", s.id)), "{line}");
    assert!(
        line.contains(&format!("softwarp snapshots --pid {} --id {}", s.pid, s.id)),
        "{line}"
    );

    // It outlives the QP and the device.
    let id = s.id;
    drop((sink, src, target));
    drop(a);
    drop(b);
    let after = snapshots_of(&a_dev, a_qpn);
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].id, id);
}

#[test]
fn the_history_keeps_the_newest_n_snapshots_and_counts_the_dropped() {
    let (_guard, _) = setup();
    const EXTRA: usize = 3;
    let before = snapshot::history().list(&SnapshotFilter::default());
    assert_eq!(before.capacity, CAPACITY);
    let mut ids = Vec::new();
    for _ in 0..CAPACITY + EXTRA {
        // a's modify-to-error sends a Terminate; b receives it and is snapshotted.
        let (a, b) = pair(&ConnectOptions::default());
        a.qp.modify_to_error().unwrap();
        let s = wait_snapshot(b.dev.instance_name(), b.qp.qp_num());
        assert_eq!(s.len(), 1);
        ids.push(s[0].id);
        assert!(
            snapshots_of(a.dev.instance_name(), a.qp.qp_num()).is_empty(),
            "an application's own modify-to-error is not a failure"
        );
    }
    let after = snapshot::history().list(&SnapshotFilter::default());
    let kept: Vec<u64> = after.snapshots.iter().map(|s| s.id).collect();
    assert_eq!(kept, ids[EXTRA..], "the newest {CAPACITY} are kept");
    assert_eq!(after.taken - before.taken, (CAPACITY + EXTRA) as u64);
    assert_eq!(
        after.dropped - before.dropped,
        (before.snapshots.len() + EXTRA) as u64
    );
}

#[test]
fn an_injected_device_fatal_snapshots_its_qps_and_writes_an_automatic_dump() {
    let (_guard, dir) = setup();
    let before = dump::auto_dumps_in(dir).unwrap_or_default();
    let (a, b) = pair(&ConnectOptions::default());
    let (a_dev, a_qpn) = (a.dev.instance_name().to_string(), a.qp.qp_num());
    a.dev.inject_fatal_error();
    let s = wait_snapshot(&a_dev, a_qpn);
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].event, "device_fatal");
    // The dump was written before inject_fatal_error returned.
    let after = dump::auto_dumps_in(dir).unwrap();
    let new: Vec<&PathBuf> = after.iter().filter(|p| !before.contains(p)).collect();
    assert_eq!(new.len(), 1, "{after:?}");
    let parsed = dump::parse(&std::fs::read(new[0]).unwrap()).unwrap();
    assert!(parsed.is_complete(), "{:?}", parsed.error);
    let process = parsed.process().unwrap();
    assert_eq!(process.pid, std::process::id());
    assert!(process.reason.contains(&a_dev), "{}", process.reason);
    assert!(
        process.reason.contains("device fatal"),
        "{}",
        process.reason
    );
    let snaps = parsed
        .sections
        .iter()
        .find_map(|s| match s {
            Section::Snapshots(r) => Some(r),
            _ => None,
        })
        .expect("a snapshots section");
    assert!(snaps
        .snapshots
        .iter()
        .any(|s| s.device == a_dev && s.qpn == a_qpn && s.event == "device_fatal"));
    let recorder = parsed
        .sections
        .iter()
        .find_map(|s| match s {
            Section::FlightRecorder(f) => Some(f),
            _ => None,
        })
        .expect("a flight recorder section");
    assert!(recorder
        .records
        .iter()
        .any(|r| r.fields.contains("device_fatal") && r.fields.contains(&a_dev)));
    drop(b);
}
