//! The resource tracker through a verbs-like entry point: a leaked resource is reported
//! with the application's own file and line, thread and time, and memory is accounted.

#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Weak};

use softwarp_ras::errlog::{CriticalEvent, CriticalKind, ErrorLog, ErrorLogConfig, LogLine};
use softwarp_ras::tracker::{
    DescribeResource, ResourceDetails, ResourceHandle, ResourceKind, Tracker,
};

use crate::common;

/// Stands for a verbs entry point (`Pd::create_qp`): `#[track_caller]` passes the
/// application's location through to the tracker.
#[track_caller]
fn create_qp(tracker: &Tracker, qpn: u32) -> ResourceHandle {
    tracker.register(ResourceKind::Qp, u64::from(qpn), 8192)
}

#[test]
fn a_leaked_resource_is_reported_with_the_tests_own_file_and_line() {
    let t = Tracker::new("leaktest0");
    let device = t.register(ResourceKind::Device, 0, 0);
    let line = line!() + 1;
    let leaked = create_qp(&t, 5);
    let released = create_qp(&t, 6);
    drop(released);

    let report = t.leak_report(Some(&device));
    assert_eq!(report.leaked.len(), 1, "{report}");
    let r = &report.leaked[0];
    assert_eq!((r.kind, r.id, r.bytes), (ResourceKind::Qp, 5, 8192));
    assert_eq!(r.file, file!());
    assert_eq!(r.line, line);
    assert_eq!(r.pid, std::process::id());
    assert!(!r.process.is_empty());
    assert_eq!(
        r.thread,
        std::thread::current().name().unwrap_or("?"),
        "the creating thread"
    );
    assert!(r.created.ends_with('Z'));
    let text = report.to_string();
    assert!(
        text.contains(&format!("qp 5 (8192 bytes) created at {}:{line}:", file!())),
        "{text}"
    );
    drop(leaked);
    assert!(t.leak_report(Some(&device)).is_empty());
}

#[test]
fn the_creating_thread_is_recorded() {
    let t = Tracker::new("leaktest-thread");
    let t2 = t.clone();
    let h = std::thread::Builder::new()
        .name("app-worker".into())
        .spawn(move || create_qp(&t2, 1))
        .unwrap()
        .join()
        .unwrap();
    let r = &t.resources()[0];
    assert_eq!(r.thread, "app-worker");
    assert_ne!(r.tid, 0);
    drop(h);
}

struct Listener;
impl DescribeResource for Listener {
    fn describe(&self) -> ResourceDetails {
        ResourceDetails {
            state: Some("listening".into()),
            local_addr: "127.0.0.1:7174".parse().ok(),
            ..ResourceDetails::default()
        }
    }
}

#[test]
fn a_leak_goes_to_the_error_log_with_its_location_and_advice() {
    let dir = common::TempDir::new("leaklog");
    let log = ErrorLog::open(ErrorLogConfig::in_dir(dir.path())).unwrap();
    let t = Tracker::new("leaktest-log");
    let owner = Arc::new(Listener);
    let line = line!() + 1;
    let h = t.register(ResourceKind::Listener, 3, 0);
    h.set_describer(Arc::downgrade(&owner) as Weak<dyn DescribeResource>);
    let report = t.leak_report(None);
    assert!(report.to_string().contains("state listening"));
    log.log(&CriticalEvent::leak(&report)).unwrap();
    let text = std::fs::read_to_string(&log.config().path).unwrap();
    let entry: LogLine = serde_json::from_str(text.trim_end()).unwrap();
    assert_eq!(entry.event, CriticalKind::LeakAtClose);
    assert_eq!(entry.device.as_deref(), Some("leaktest-log"));
    assert!(
        entry.detail.contains(&format!("{}:{line}:", file!())),
        "{}",
        entry.detail
    );
    assert_eq!(entry.action, CriticalKind::LeakAtClose.recommended_action());
}
