//! The error log rotates by size and keeps the configured number of files, each line a
//! complete JSON object with a recommended action.

#![allow(clippy::unwrap_used)]

use softwarp_ras::errlog::{CriticalEvent, CriticalKind, ErrorLog, ErrorLogConfig, LogLine};

use crate::common;

fn lines(path: &std::path::Path) -> Vec<LogLine> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn event(i: usize) -> CriticalEvent {
    CriticalEvent::new(CriticalKind::QpFatal, format!("event {i}"))
        .with_device("softwarp0")
        .with_qpn(i as u32)
        .with_peer("192.0.2.7:4791")
}

#[test]
fn the_log_rotates_by_size_and_keeps_n_files() {
    let dir = common::TempDir::new("rot");
    let config = ErrorLogConfig {
        path: dir.path().join("errors.jsonl"),
        max_bytes: 2048,
        keep: 2,
    };
    let log = ErrorLog::open(config.clone()).unwrap();
    for i in 0..40 {
        log.log(&event(i)).unwrap();
    }
    assert!(config.path.exists());
    assert!(config.rotated_path(1).exists());
    assert!(config.rotated_path(2).exists());
    assert!(
        !config.rotated_path(3).exists(),
        "only `keep` rotated files"
    );
    for p in [
        config.path.clone(),
        config.rotated_path(1),
        config.rotated_path(2),
    ] {
        let len = std::fs::metadata(&p).unwrap().len();
        assert!(len <= config.max_bytes, "{} is {len} bytes", p.display());
    }
    // Oldest file first, the events are consecutive and end with the last one.
    let mut all = lines(&config.rotated_path(2));
    all.extend(lines(&config.rotated_path(1)));
    all.extend(lines(&config.path));
    let qpns: Vec<u32> = all.iter().map(|l| l.qpn.unwrap()).collect();
    assert_eq!(*qpns.last().unwrap(), 39);
    assert!(qpns.windows(2).all(|w| w[1] == w[0] + 1), "{qpns:?}");
    assert!(qpns.len() < 40, "old events were dropped");
    let l = &all[0];
    assert_eq!(l.severity, "critical");
    assert_eq!(l.event, CriticalKind::QpFatal);
    assert_eq!(l.pid, std::process::id());
    assert_eq!(l.peer.as_deref(), Some("192.0.2.7:4791"));
    assert_eq!(l.action, CriticalKind::QpFatal.recommended_action());
}

#[test]
fn a_log_rotated_by_another_process_is_reopened() {
    let dir = common::TempDir::new("rot2");
    let config = ErrorLogConfig {
        path: dir.path().join("shared.jsonl"),
        max_bytes: 600,
        keep: 3,
    };
    let a = ErrorLog::open(config.clone()).unwrap();
    let b = ErrorLog::open(config.clone()).unwrap();
    for i in 0..10 {
        a.log(&event(i)).unwrap();
        b.log(&event(100 + i)).unwrap();
    }
    // Every line is complete JSON and no file grew past the limit, whoever rotated it.
    let mut total = 0;
    for p in [
        config.path.clone(),
        config.rotated_path(1),
        config.rotated_path(2),
        config.rotated_path(3),
    ] {
        if p.exists() {
            assert!(std::fs::metadata(&p).unwrap().len() <= config.max_bytes);
            total += lines(&p).len();
        }
    }
    assert!(total >= 4);
    let last = lines(&config.path);
    assert_eq!(last.last().unwrap().qpn, Some(109));
}

#[test]
fn a_specific_action_overrides_the_default_advice() {
    let dir = common::TempDir::new("rot3");
    let log = ErrorLog::open(ErrorLogConfig::in_dir(dir.path())).unwrap();
    let l = log
        .log(
            &CriticalEvent::new(CriticalKind::TerminateReceived, "DDP tagged: invalid STag")
                .with_action("re-register the buffer"),
        )
        .unwrap();
    assert_eq!(l.action, "re-register the buffer");
    assert_eq!(lines(&log.config().path), [l]);
}

#[test]
fn keep_zero_starts_the_file_over() {
    let dir = common::TempDir::new("rot4");
    let config = ErrorLogConfig {
        path: dir.path().join("e.jsonl"),
        max_bytes: 300,
        keep: 0,
    };
    let log = ErrorLog::open(config.clone()).unwrap();
    for i in 0..5 {
        log.log(&event(i)).unwrap();
    }
    assert!(!config.rotated_path(1).exists());
    assert_eq!(lines(&config.path).last().unwrap().qpn, Some(4));
}
