//! The whole service of a process started in one call, driven over its control socket like
//! the CLI does: registry entry, trace-set changing levels at run time, the flight recorder
//! showing the result, resources from the process-wide trackers, the metrics endpoint.
//!
//! One test only: it installs the process-wide `tracing` subscriber. It changes the
//! process-wide levels too, so it takes its turn with `trace_levels`' tests.

#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use softwarp_ras::control::{query_all, DefaultHandler, Request, ResourcesResult};
use softwarp_ras::service::{start, ServiceConfig};
use softwarp_ras::sw_event;
use softwarp_ras::trace::{Component, FlightRecorderDump, Level, TraceLevels};
use softwarp_ras::tracker::{ResourceKind, Tracker};

use crate::common;

const T: Duration = Duration::from_secs(5);

#[test]
fn a_started_service_is_found_and_driven_over_its_control_socket() {
    let _turn = softwarp_testkit::serial();
    // The levels are process-wide: a `trace_levels` test that ran before may have left the
    // QP component (or QP 77) verbose, and "before" would then be recorded.
    softwarp_ras::trace::control().set_all(Level::ERROR);
    softwarp_ras::trace::control().clear_qp_levels();
    let dir = common::TempDir::new("svc");

    let config = ServiceConfig {
        runtime_dir: Some(dir.path().to_path_buf()),
        metrics_addr: "127.0.0.1:0".parse().ok(),
        errlog: None,
        install_tracing: true,
        ..ServiceConfig::default()
    };
    let service = start(&config, Arc::new(DefaultHandler));
    assert!(service.problems().is_empty(), "{:?}", service.problems());
    let reg = service.registry().unwrap().clone();

    let tracker = Tracker::new("svc0");
    let _cq = tracker.register(ResourceKind::Cq, 1, 1 << 16);

    // Level 5 QP records are recorded only after trace-set raises the level.
    softwarp_ras::trace::control().set_recorder_level(Level::RARE);
    let emit = |msg: &str| sw_event!(Qp, 5, qpn = 77, "{}", msg);
    emit("before");
    let replies = query_all(
        &reg,
        &Request::TraceSet {
            spec: "qp=5".into(),
        },
        T,
    )
    .unwrap();
    assert_eq!(replies.len(), 1);
    let levels: TraceLevels = replies
        .into_iter()
        .next()
        .unwrap()
        .reply
        .unwrap()
        .into_result()
        .unwrap();
    assert_eq!(levels.components[&Component::Qp], Level::INTERNALS);
    emit("after");

    let dump: FlightRecorderDump = query_all(
        &reg,
        &Request::FlightRecorder {
            tail: Some(50),
            after: None,
        },
        T,
    )
    .unwrap()
    .remove(0)
    .reply
    .unwrap()
    .into_result()
    .unwrap();
    let qp_msgs: Vec<&str> = dump
        .records
        .iter()
        .filter(|r| r.qpn == Some(77))
        .map(|r| r.message.as_str())
        .collect();
    assert_eq!(qp_msgs, ["after"]);
    assert!(
        dump.records
            .iter()
            .any(|r| r.message.contains("trace levels set")),
        "the change itself is recorded (level 2)"
    );

    let res: ResourcesResult = query_all(&reg, &Request::all_resources(), T)
        .unwrap()
        .remove(0)
        .reply
        .unwrap()
        .into_result()
        .unwrap();
    assert!(res
        .resources
        .iter()
        .any(|r| r.tracker == "svc0" && r.kind == ResourceKind::Cq));

    // The metrics endpoint answers on loopback.
    let addr = service.metrics_addr().unwrap();
    assert!(addr.ip().is_loopback());
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.0 200 OK\r\n"), "{resp}");

    let socket = service.control_socket().unwrap().to_path_buf();
    drop(service);
    assert!(!socket.exists());
    assert!(
        reg.scan().unwrap().live.is_empty(),
        "the entry went with the service"
    );
}
