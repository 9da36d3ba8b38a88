//! The host registry and the control socket, end to end: stale entries of dead processes
//! are detected and cleaned; the control socket answers a client in another thread; the CLI
//! path (query every registered process) works; bounds and timeouts hold.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use softwarp_ras::control::{
    query_all, request, ClientError, ControlClient, ControlHandler, ControlServer, DefaultHandler,
    ProcessInfo, Reply, Request, ResourcesResult, MAX_CONNECTIONS,
};
use softwarp_ras::registry::{HostRegistry, Liveness, ProcessEntry};
use softwarp_ras::stats::{Detail, StatsBuilder, StatsSnapshot, Value};
use softwarp_ras::trace::{FlightRecorderDump, TraceLevels};
use softwarp_ras::tracker::{ResourceFilter, ResourceKind, Tracker};

use crate::common;

const T: Duration = Duration::from_secs(5);

fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

#[test]
fn a_registry_entry_of_a_dead_process_is_stale_and_cleaned() {
    let dir = common::TempDir::new("stale");
    let reg = HostRegistry::open(dir.path()).unwrap();
    let pid = dead_pid();
    let mut dead = ProcessEntry::this_process(reg.socket_path(pid));
    dead.pid = pid;
    dead.proc_start_ticks = None;
    assert_eq!(dead.liveness(), Liveness::Dead);
    let _kept = reg.register(&dead).unwrap();
    std::fs::write(reg.socket_path(pid), b"").unwrap();
    let me = ProcessEntry::this_process(reg.socket_path(std::process::id()));
    let _mine = reg.register(&me).unwrap();

    let scan = reg.scan().unwrap();
    assert_eq!(scan.live, std::slice::from_ref(&me));
    assert_eq!(scan.stale, std::slice::from_ref(&dead));
    assert!(reg.entry_path(pid).exists(), "scan alone removes nothing");

    assert_eq!(reg.live().unwrap(), [me]);
    assert!(
        !reg.entry_path(pid).exists(),
        "the reader cleaned the stale entry"
    );
    assert!(!reg.socket_path(pid).exists(), "and its socket");
}

#[test]
fn a_reused_pid_is_stale_too() {
    let dir = common::TempDir::new("reuse");
    let reg = HostRegistry::open(dir.path()).unwrap();
    // Our pid, but the registered process started at another time: not us.
    let mut e = ProcessEntry::this_process(reg.socket_path(1));
    e.proc_start_ticks = e.proc_start_ticks.map(|t| t + 1);
    assert_eq!(e.liveness(), Liveness::PidReused);
    let _r = reg.register(&e).unwrap();
    assert_eq!(reg.scan().unwrap().stale.len(), 1);
}

#[test]
fn unreadable_entries_are_reported_and_those_of_dead_pids_removed() {
    let dir = common::TempDir::new("bad");
    let reg = HostRegistry::open(dir.path()).unwrap();
    let pid = dead_pid();
    std::fs::write(reg.entry_path(pid), b"{not json").unwrap();
    std::fs::write(dir.path().join("notes.json"), b"[]").unwrap();
    std::fs::write(dir.path().join("big.json"), vec![b' '; 70_000]).unwrap();
    // A live process's entry under another (dead) pid's name is not trusted.
    let other = dead_pid();
    let me = ProcessEntry::this_process(reg.socket_path(std::process::id()));
    std::fs::write(reg.entry_path(other), serde_json::to_vec(&me).unwrap()).unwrap();
    let scan = reg.scan_and_clean().unwrap();
    assert_eq!(scan.bad.len(), 4, "{scan:?}");
    assert!(scan.live.is_empty());
    assert!(scan.bad.iter().any(|b| b.reason.contains("70000 bytes")));
    assert!(scan.bad.iter().any(|b| b.reason.contains("not its own")));
    assert!(!reg.entry_path(pid).exists());
    assert!(!reg.entry_path(other).exists());
    assert!(
        dir.path().join("notes.json").exists(),
        "not named after a pid: left alone"
    );
}

#[test]
fn a_registration_removes_its_file_when_dropped() {
    let dir = common::TempDir::new("drop");
    let reg = HostRegistry::open(dir.path()).unwrap();
    let r = reg
        .register(&ProcessEntry::this_process(
            reg.socket_path(std::process::id()),
        ))
        .unwrap();
    assert!(r.path().exists());
    let path = r.path().to_path_buf();
    drop(r);
    assert!(!path.exists());
}

/// A handler with fixed statistics, resources from one tracker.
struct TestHandler {
    tracker: Tracker,
}

impl ControlHandler for TestHandler {
    fn resources(&self, _: &ResourceFilter) -> ResourcesResult {
        ResourcesResult {
            resources: self.tracker.resources(),
            memory: vec![self.tracker.memory()],
            omitted: 0,
        }
    }
    fn stats(&self, _: &Detail) -> StatsSnapshot {
        let mut b = StatsBuilder::new();
        b.counter(
            "softwarp_qp_tx_messages_total",
            "Sent.",
            &[("qpn", "3")],
            42,
        );
        b.finish()
    }
}

#[test]
fn the_control_socket_answers_a_client_in_another_thread() {
    let dir = common::TempDir::new("ctl");
    let path = dir.path().join("ctl.sock");
    let tracker = Tracker::new("ctltest0");
    let _qp = tracker.register(ResourceKind::Qp, 3, 4096);
    let server = ControlServer::start(&path, Arc::new(TestHandler { tracker })).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "only the owner may connect");

    let client_path = path.clone();
    let answers = std::thread::spawn(move || {
        let mut c = ControlClient::connect(client_path, T).unwrap();
        let info: ProcessInfo = c.request(&Request::Info).unwrap().into_result().unwrap();
        let res: ResourcesResult = c
            .request(&Request::all_resources())
            .unwrap()
            .into_result()
            .unwrap();
        let stats: StatsSnapshot = c.request(&Request::stats()).unwrap().into_result().unwrap();
        let levels: TraceLevels = c
            .request(&Request::TraceGet)
            .unwrap()
            .into_result()
            .unwrap();
        let fr: FlightRecorderDump = c
            .request(&Request::FlightRecorder {
                tail: Some(5),
                after: None,
            })
            .unwrap()
            .into_result()
            .unwrap();
        (info, res, stats, levels, fr)
    })
    .join()
    .unwrap();
    let (info, res, stats, levels, fr) = answers;
    assert_eq!(info.pid, std::process::id());
    assert_eq!(res.resources.len(), 1);
    assert_eq!(res.resources[0].kind, ResourceKind::Qp);
    assert_eq!(res.resources[0].file, file!());
    assert_eq!(res.memory[0].total_bytes, 4096);
    assert_eq!(
        stats.get("softwarp_qp_tx_messages_total", &[("qpn", "3")]),
        Some(Value::Int(42))
    );
    assert_eq!(levels.components.len(), 9);
    assert!(fr.records.len() <= 5);
    drop(server);
    assert!(!path.exists(), "the socket file goes with the server");
}

#[test]
fn pipelined_requests_get_replies_in_order_and_bad_lines_get_errors() {
    let dir = common::TempDir::new("pipe");
    let path = dir.path().join("ctl.sock");
    let _server = ControlServer::start(&path, Arc::new(DefaultHandler)).unwrap();
    let mut s = UnixStream::connect(&path).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s.write_all(b"{\"op\":\"info\"}\n\n   \nnot json\n{\"op\":\"trace-get\"}\n")
        .unwrap();
    let mut r = BufReader::new(s);
    let mut replies = Vec::new();
    for _ in 0..3 {
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        replies.push(serde_json::from_str::<Reply>(&line).unwrap());
    }
    assert!(replies[0].ok);
    assert!(!replies[1].ok);
    assert!(replies[1]
        .error
        .as_deref()
        .unwrap()
        .starts_with("bad request"));
    assert!(replies[2].ok);
}

#[test]
fn an_overlong_request_is_refused_and_the_connection_closed() {
    let dir = common::TempDir::new("long");
    let path = dir.path().join("ctl.sock");
    let _server = ControlServer::start(&path, Arc::new(DefaultHandler)).unwrap();
    let mut s = UnixStream::connect(&path).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    // The server may close before reading everything: a failed write is fine.
    let _ = s.write_all(&vec![b'x'; 70 * 1024]);
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    let reply: Reply = serde_json::from_str(&line).unwrap();
    assert!(reply.error.unwrap().contains("longer than"));
}

#[test]
fn a_live_socket_is_not_taken_over_but_a_leftover_file_is_replaced() {
    let dir = common::TempDir::new("addr");
    let path = dir.path().join("ctl.sock");
    let first = ControlServer::start(&path, Arc::new(DefaultHandler)).unwrap();
    let err = ControlServer::start(&path, Arc::new(DefaultHandler)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse);
    drop(first);
    // A socket file left by a crashed process.
    drop(UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let second = ControlServer::start(&path, Arc::new(DefaultHandler)).unwrap();
    assert!(request(&path, &Request::Info, T).unwrap().ok);
    drop(second);
}

#[test]
fn a_silent_process_times_the_client_out() {
    let dir = common::TempDir::new("silent");
    let path = dir.path().join("silent.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let t0 = Instant::now();
    let err = request(&path, &Request::Info, Duration::from_millis(200)).unwrap_err();
    assert!(matches!(err, ClientError::Timeout(_)), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(3));
    drop(listener);
    let err = request(&dir.path().join("none.sock"), &Request::Info, T).unwrap_err();
    assert!(matches!(err, ClientError::Io { .. }), "{err}");
}

#[test]
fn connections_beyond_the_limit_are_told_to_retry() {
    let dir = common::TempDir::new("busy");
    let path = dir.path().join("ctl.sock");
    let server = ControlServer::start(&path, Arc::new(DefaultHandler)).unwrap();
    let mut open: Vec<ControlClient> = (0..MAX_CONNECTIONS)
        .map(|_| ControlClient::connect(&path, T).unwrap())
        .collect();
    for c in &mut open {
        assert!(c.request(&Request::Info).unwrap().ok);
    }
    let s = UnixStream::connect(&path).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    let reply: Reply = serde_json::from_str(&line).unwrap();
    assert!(reply.error.unwrap().starts_with("busy"));
    drop(open.pop());
    // A slot frees up once the worker sees the close (within its poll interval).
    let deadline = Instant::now() + T;
    loop {
        let mut c = ControlClient::connect(&path, T).unwrap();
        if c.request(&Request::Info).unwrap().ok {
            break;
        }
        assert!(Instant::now() < deadline, "no slot was freed");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Stopping does not wait for the idle clients to leave.
    let t0 = Instant::now();
    drop(server);
    assert!(t0.elapsed() < Duration::from_secs(2));
}

#[test]
fn the_cli_path_queries_every_registered_process() {
    let dir = common::TempDir::new("all");
    let reg = HostRegistry::open(dir.path()).unwrap();
    let path = reg.socket_path(std::process::id());
    let _server = ControlServer::start(&path, Arc::new(DefaultHandler)).unwrap();
    let _entry = reg.register(&ProcessEntry::this_process(path)).unwrap();
    let pid = dead_pid();
    let mut dead = ProcessEntry::this_process(reg.socket_path(pid));
    dead.pid = pid;
    let _dead = reg.register(&dead).unwrap();

    let replies = query_all(&reg, &Request::Info, T).unwrap();
    assert_eq!(replies.len(), 1, "the dead process is skipped");
    let info: ProcessInfo = replies
        .into_iter()
        .next()
        .unwrap()
        .reply
        .unwrap()
        .into_result()
        .unwrap();
    assert_eq!(info.pid, std::process::id());
}

struct Panicky;

impl ControlHandler for Panicky {
    fn stats(&self, _: &Detail) -> StatsSnapshot {
        panic!("a collector bug");
    }
}

#[test]
fn a_panicking_handler_gets_an_error_reply_and_the_socket_keeps_serving() {
    let dir = common::TempDir::new("panic");
    let path = dir.path().join("ctl.sock");
    let _server = ControlServer::start(&path, Arc::new(Panicky)).unwrap();
    let mut c = ControlClient::connect(&path, T).unwrap();
    let r = c.request(&Request::stats()).unwrap();
    assert!(!r.ok);
    assert!(r.error.unwrap().contains("panicked"));
    assert!(
        c.request(&Request::Info).unwrap().ok,
        "same connection still served"
    );
    assert!(
        request(&path, &Request::Info, T).unwrap().ok,
        "new connections too"
    );
}

#[test]
fn a_client_timeout_of_duration_max_means_no_limit() {
    // `Instant::now() + Duration::MAX` panicked in `ControlClient::request`.
    let dir = common::TempDir::new("max");
    let path = dir.path().join("ctl.sock");
    let _server = ControlServer::start(&path, Arc::new(DefaultHandler)).unwrap();
    let mut c = ControlClient::connect(&path, Duration::MAX).unwrap();
    let info: ProcessInfo = c.request(&Request::Info).unwrap().into_result().unwrap();
    assert_eq!(info.pid, std::process::id());
}
