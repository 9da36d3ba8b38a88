//! The operator commands against real running processes: a child process (this test binary
//! run again with `SWTEST_CHILD` set, so it runs [`child_process`] only) opens a device and a
//! QP pair over loopback; the built `softwarp` binary then talks to it through the host
//! registry and its control socket. Each test has its own `SOFTWARP_RUNTIME_DIR`, so tests
//! never see each other's processes. Every wait is bounded; nothing asserts on timing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value as Json;
use softwarp_testkit::{Reaped, SpawnReaped};

/// Upper bound of every wait.
const WAIT: Duration = Duration::from_secs(30);

/// Environment variables of the RAS services a test must not inherit.
const RAS_ENV: [&str; 8] = [
    "SOFTWARP_RAS",
    "SOFTWARP_TRACE",
    "SOFTWARP_METRICS",
    "SOFTWARP_ERRLOG",
    "SOFTWARP_CONTROL",
    "SOFTWARP_TRACE_CONSOLE",
    "SOFTWARP_FLIGHT_RECORDER",
    "SOFTWARP_TCP_INFO_INTERVAL_MS",
];

// ---------------------------------------------------------------------------------------
// The parent's side
// ---------------------------------------------------------------------------------------

/// A fresh runtime directory, removed on drop (short: socket paths must stay < 108 bytes).
struct RuntimeDir(PathBuf);

impl RuntimeDir {
    fn new(tag: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("swcli-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for RuntimeDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child process running [`child_process`] in `mode`; killed and reaped when dropped.
struct Peer {
    child: Reaped,

    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Peer {
    fn spawn(dir: &Path, mode: &str) -> Self {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "admin::child_process",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("SWTEST_CHILD", mode)
        .env("SOFTWARP_RUNTIME_DIR", dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        // The child's console trace output (errors, and every record while a test
        // raises a level) would fill a pipe nobody reads.
        .stderr(Stdio::null());
        for v in RAS_ENV {
            cmd.env_remove(v);
        }
        // The child is an application that did not ask for RAS: the operator turns the
        // services on (and Softwarp's own subscriber, which feeds the flight recorder) with
        // the environment.
        cmd.env("SOFTWARP_RAS", "on")
            .env("SOFTWARP_TRACE_CONSOLE", "1");
        let mut child = cmd.spawn_reaped();
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // libtest may have printed "test child_process ... " before it on the line.
                if let Some(i) = line.find("SWCHILD ") {
                    if tx.send(line[i + "SWCHILD ".len()..].to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        Self {
            child,
            stdin,
            lines,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The child's next protocol line (`SWCHILD <line>`).
    fn line(&self) -> String {
        self.lines
            .recv_timeout(WAIT)
            .expect("the child process did not report within the time limit")
    }

    /// Asks the child to finish (closes its stdin) and waits for it.
    fn finish(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + WAIT;
        while self.child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("the child process did not exit when asked");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Output of one `softwarp` run.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

/// Runs the built `softwarp` with `args` against the runtime directory `dir`.
fn softwarp(dir: &Path, args: &[&str]) -> Run {
    let mut cmd = crate::softwarp();
    cmd.args(args)
        .env("SOFTWARP_RUNTIME_DIR", dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for v in RAS_ENV {
        cmd.env_remove(v);
    }
    let child = cmd.spawn().unwrap();
    let pid = child.id();
    // Bounded: a watchdog kills the command if it hangs.
    let done = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            let deadline = Instant::now() + WAIT;
            while !done.load(Ordering::Relaxed) {
                if Instant::now() > deadline {
                    let _ = Command::new("kill").arg(pid.to_string()).status();
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let out = child.wait_with_output().unwrap();
    done.store(true, Ordering::Relaxed);
    watchdog.join().unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn ok(dir: &Path, args: &[&str]) -> String {
    let r = softwarp(dir, args);
    assert_eq!(
        r.code, 0,
        "softwarp {args:?} exited {}:\n{}{}",
        r.code, r.stdout, r.stderr
    );
    r.stdout
}

/// Flight recorder records of `pid` as `trace tail --json` prints them.
fn tail(dir: &Path, pid: u32) -> Vec<Json> {
    let pid = pid.to_string();
    ok(
        dir,
        &[
            "trace", "tail", "--pid", &pid, "--count", "100000", "--json",
        ],
    )
    .lines()
    .map(|l| serde_json::from_str(l).unwrap())
    .collect()
}

fn is_qp_post(r: &Json) -> bool {
    r["level"] == 7 && r["component"] == "qp" && r["message"] == "post_send"
}

fn max_seq(records: &[Json]) -> u64 {
    records
        .iter()
        .filter_map(|r| r["seq"].as_u64())
        .max()
        .unwrap_or(0)
}

/// The value of `name` with exactly `labels` in `stat --json` output.
fn metric(stats: &Json, name: &str, labels: &[(&str, &str)]) -> Option<u64> {
    let fam = stats["families"]
        .as_array()?
        .iter()
        .find(|f| f["name"] == name)?;
    fam["samples"].as_array()?.iter().find_map(|s| {
        let l = s["labels"].as_object()?;
        let all = l.len() == labels.len()
            && labels
                .iter()
                .all(|(k, v)| l.get(*k).and_then(Json::as_str) == Some(*v));
        if all {
            s["value"].as_u64()
        } else {
            None
        }
    })
}

fn sends_total(dir: &Path, pid: u32, instance: &str, qpn: &str) -> u64 {
    let pid_s = pid.to_string();
    let stats: Json = serde_json::from_str(&ok(dir, &["stat", "--pid", &pid_s, "--json"])).unwrap();
    let process = stats["families"][0]["samples"][0]["labels"]["process"]
        .as_str()
        .unwrap()
        .to_string();
    metric(
        &stats,
        "softwarp_qp_tx_messages_total",
        &[
            ("device", instance),
            ("op", "send"),
            ("pid", &pid_s),
            ("process", &process),
            ("qpn", qpn),
        ],
    )
    .unwrap()
}

#[test]
fn trace_set_through_the_cli_changes_the_levels_of_a_running_process() {
    let dir = RuntimeDir::new("trace");
    let mut peer = Peer::spawn(&dir.0, "traffic");
    let ready = peer.line();
    let fields: Vec<&str> = ready.split_whitespace().collect();
    assert_eq!(fields[0], "ready", "{ready}");
    let (instance, qpn) = (fields[1], fields[2]);
    let pid = peer.pid();
    let pid_s = pid.to_string();

    // At the default levels (qp=1, recorder=5) no post_send (level 7) is recorded.
    let before = tail(&dir.0, pid);
    assert!(!before.iter().any(is_qp_post), "level 7 records at level 1");
    let get = ok(&dir.0, &["trace", "get", "--pid", &pid_s]);
    assert!(get.contains("qp=1"), "{get}");

    // Raise QPs to 7: the process's post_send records appear.
    let set = ok(&dir.0, &["trace", "set", "qp=7", "--pid", &pid_s]);
    assert!(set.starts_with(&format!("pid {pid} (")), "{set}");
    assert!(set.contains("qp=7"), "{set}");
    let deadline = Instant::now() + WAIT;
    let raised = loop {
        let records = tail(&dir.0, pid);
        if records.iter().any(is_qp_post) {
            break records;
        }
        assert!(Instant::now() < deadline, "no post_send record after qp=7");
        std::thread::sleep(Duration::from_millis(50));
    };
    let post = raised.iter().find(|r| is_qp_post(r)).unwrap();
    assert_eq!(post["qpn"].as_u64().unwrap().to_string(), qpn);
    assert_eq!(post["pid"], pid);
    assert!(
        post["file"].as_str().unwrap().ends_with("qp/mod.rs"),
        "{post}"
    );
    // Following shows them as they come.
    let followed = ok(
        &dir.0,
        &[
            "trace",
            "tail",
            "--pid",
            &pid_s,
            "-f",
            "--count",
            "0",
            "--seconds",
            "1",
        ],
    );
    assert!(
        followed
            .lines()
            .any(|l| l.starts_with(&format!("pid {pid} "))
                && l.contains(" L7 qp ")
                && l.contains("post_send")),
        "{followed}"
    );

    // Back to 1: no new post_send records while the traffic goes on.
    ok(&dir.0, &["trace", "set", "qp=1", "--pid", &pid_s]);
    let mark = max_seq(&tail(&dir.0, pid));
    let sent_before = sends_total(&dir.0, pid, instance, qpn);
    let deadline = Instant::now() + WAIT;
    while sends_total(&dir.0, pid, instance, qpn) < sent_before + 20 {
        assert!(Instant::now() < deadline, "the traffic stopped");
        std::thread::sleep(Duration::from_millis(20));
    }
    let after: Vec<Json> = tail(&dir.0, pid)
        .into_iter()
        .filter(|r| r["seq"].as_u64().unwrap() > mark)
        .collect();
    assert!(
        !after.iter().any(is_qp_post),
        "post_send records after qp=1: {after:?}"
    );
    let get = ok(&dir.0, &["trace", "get", "--pid", &pid_s, "--json"]);
    let levels: Json = serde_json::from_str(get.trim()).unwrap();
    assert_eq!(levels["levels"]["components"]["qp"], 1);
    peer.finish();
}

#[test]
fn stat_shows_exactly_the_sends_made() {
    const N: u32 = 25;
    const S: u32 = 3000;
    let dir = RuntimeDir::new("stat");
    let mut peer = Peer::spawn(&dir.0, &format!("sends {N} {S}"));
    let done = peer.line();
    let f: Vec<&str> = done.split_whitespace().collect();
    assert_eq!(f[0], "done", "{done}");
    let (client, client_qpn, server, server_qpn) = (f[1], f[2], f[3], f[4]);
    let pid = peer.pid().to_string();

    let stats: Json =
        serde_json::from_str(&ok(&dir.0, &["stat", "--pid", &pid, "--json"])).unwrap();
    let process = stats["families"][0]["samples"][0]["labels"]["process"]
        .as_str()
        .unwrap()
        .to_string();
    let get = |name: &str, dev: &str, qpn: &str| {
        metric(
            &stats,
            name,
            &[
                ("device", dev),
                ("op", "send"),
                ("pid", &pid),
                ("process", &process),
                ("qpn", qpn),
            ],
        )
    };
    let total = u64::from(N * S);
    assert_eq!(
        get("softwarp_qp_tx_messages_total", client, client_qpn),
        Some(u64::from(N))
    );
    assert_eq!(
        get("softwarp_qp_tx_bytes_total", client, client_qpn),
        Some(total)
    );
    assert_eq!(
        get("softwarp_qp_rx_messages_total", server, server_qpn),
        Some(u64::from(N))
    );
    assert_eq!(
        get("softwarp_qp_rx_bytes_total", server, server_qpn),
        Some(total)
    );
    assert_eq!(
        get("softwarp_qp_rx_messages_total", client, client_qpn),
        Some(0)
    );

    // The same numbers in the Prometheus text and the plain text.
    let prom = ok(&dir.0, &["stat", "--pid", &pid, "--prometheus"]);
    let line = format!(
        "softwarp_qp_rx_bytes_total{{device=\"{server}\",op=\"send\",pid=\"{pid}\",process=\"{process}\",qpn=\"{server_qpn}\"}} {total}"
    );
    assert!(prom.lines().any(|l| l == line), "{line} not in\n{prom}");
    assert!(prom.contains("# TYPE softwarp_qp_rx_bytes_total counter\n"));
    let text = ok(&dir.0, &["stat", "--pid", &pid]);
    assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");

    // --watch: idle traffic gives rates of zero, so "no activity", twice.
    let watch = ok(
        &dir.0,
        &["stat", "--pid", &pid, "--watch", "0.2", "--count", "2"],
    );
    assert_eq!(watch.matches("--- ").count(), 2, "{watch}");
    peer.finish();
}

#[test]
fn resources_lists_the_qps_of_a_process_until_it_is_killed() {
    let dir = RuntimeDir::new("res");
    let peer = Peer::spawn(&dir.0, "sends 1 64");
    let done = peer.line();
    let f: Vec<&str> = done.split_whitespace().collect();
    let (client, client_qpn) = (f[1], f[2]);
    let created_at = f[5];
    let pid = peer.pid();
    let pid_s = pid.to_string();

    let listing: Json =
        serde_json::from_str(&ok(&dir.0, &["resources", "--json", "--kind", "qp"])).unwrap();
    let qps = listing["resources"].as_array().unwrap();
    assert_eq!(qps.len(), 2, "{listing}");
    let qp = qps
        .iter()
        .find(|r| r["tracker"] == client && r["id"].as_u64().unwrap().to_string() == client_qpn)
        .unwrap();
    assert_eq!(qp["pid"], pid);
    assert_eq!(qp["details"]["state"], "RTS");
    assert!(qp["details"]["peer_addr"]
        .as_str()
        .unwrap()
        .starts_with("127.0.0.1:"));
    let at = format!(
        "{}:{}",
        qp["file"].as_str().unwrap(),
        qp["line"].as_u64().unwrap()
    );
    assert_eq!(at, created_at);

    // The table: one row per resource with owner, state and the creating line.
    let table = ok(&dir.0, &["resources", "--pid", &pid_s]);
    let rows: Vec<&str> = table.lines().collect();
    assert!(rows[0].starts_with("PID  "), "{table}");
    let qp_row = rows
        .iter()
        .find(|r| r.contains(&format!(" {client} ")) && r.contains(" qp "))
        .unwrap_or_else(|| panic!("no QP row in\n{table}"));
    assert!(qp_row.starts_with(&pid_s), "{qp_row}");
    assert!(qp_row.contains(" RTS "), "{qp_row}");
    assert!(qp_row.contains("tests/it/admin.rs:"), "{qp_row}");
    for kind in ["device", "pd", "mr", "cq", "listener"] {
        assert!(
            rows.iter().any(|r| r.contains(&format!(" {kind} "))),
            "no {kind} in\n{table}"
        );
    }
    assert!(
        table.contains(&format!("pid {pid} (")),
        "memory summary:\n{table}"
    );

    // Killed: gone from the listing (its stale registry entry is cleaned).
    drop(peer);
    let listing: Json = serde_json::from_str(&ok(&dir.0, &["resources", "--json"])).unwrap();
    assert_eq!(
        listing["resources"].as_array().unwrap().len(),
        0,
        "{listing}"
    );
    assert!(!dir.0.join(format!("{pid}.json")).exists());
    let r = softwarp(&dir.0, &["resources", "--pid", &pid_s]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("no running Softwarp process"),
        "{}",
        r.stderr
    );
}

#[test]
fn a_process_of_many_qps_gives_counts_and_the_rows_and_series_asked_for() {
    // More resources than the CLI lists by default (1,000 per process).
    const QPS: usize = 1_100;
    let dir = RuntimeDir::new("many");
    let mut peer = Peer::spawn(&dir.0, &format!("many {QPS}"));
    let line = peer.line();
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(f[0], "many", "{line}");
    let (device, qpn) = (f[1], f[2]);
    let pid = peer.pid().to_string();

    // By default: no rows, the counts per kind, and how to get rows.
    let table = ok(&dir.0, &["resources", "--pid", &pid]);
    assert_eq!(
        table
            .lines()
            .filter(|l| l.starts_with(&pid) && l.contains(" qp "))
            .count(),
        0,
        "{table}"
    );
    assert!(
        table.contains(&format!("{} resources, more than 1000", QPS + 3)),
        "{table}"
    );
    assert!(table.contains(&format!("qp {QPS} (")), "{table}");
    // Filtered in the process: the rows of one kind, or one QP.
    let pds: Json = serde_json::from_str(&ok(
        &dir.0,
        &["resources", "--pid", &pid, "--kind", "pd", "--json"],
    ))
    .unwrap();
    assert_eq!(pds["resources"].as_array().unwrap().len(), 1, "{pds}");
    let one: Json = serde_json::from_str(&ok(
        &dir.0,
        &[
            "resources",
            "--pid",
            &pid,
            "--kind",
            "qp",
            "--id",
            qpn,
            "--json",
        ],
    ))
    .unwrap();
    let rows = one["resources"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{one}");
    assert_eq!(rows[0]["id"].as_u64().unwrap().to_string(), qpn);
    let all: Json = serde_json::from_str(&ok(
        &dir.0,
        &["resources", "--pid", &pid, "--all", "--json"],
    ))
    .unwrap();
    assert_eq!(all["resources"].as_array().unwrap().len(), QPS + 3);

    // stat: the device's sums, no QP's own series, unless asked for by number.
    let r = softwarp(&dir.0, &["stat", "--pid", &pid, "--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let stats: Json = serde_json::from_str(&r.stdout).unwrap();
    let samples = |s: &Json, name: &str| -> Vec<Json> {
        s["families"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["name"] == name)
            .flat_map(|f| f["samples"].as_array().unwrap().clone())
            .collect()
    };
    assert!(samples(&stats, "softwarp_qp_tx_messages_total").is_empty());
    let omitted = samples(&stats, "softwarp_device_qp_series_omitted");
    assert_eq!(omitted.len(), 1, "{omitted:?}");
    assert_eq!(omitted[0]["labels"]["device"], device);
    assert_eq!(omitted[0]["value"], QPS as u64);
    assert!(r.stderr.contains("--qp N or --per-qp"), "{}", r.stderr);
    let one: Json =
        serde_json::from_str(&ok(&dir.0, &["stat", "--pid", &pid, "--qp", qpn, "--json"])).unwrap();
    let tx = samples(&one, "softwarp_qp_tx_messages_total");
    assert_eq!(tx.len(), 8, "one QP's series, per operation: {tx:?}");
    assert!(tx.iter().all(|s| s["labels"]["qpn"] == qpn));
    peer.finish();
}

#[test]
fn the_cli_asks_every_process_at_once() {
    // Each process answers only once all of them have been asked (or after 10 s): asked
    // one after the other, the first would not answer within the CLI's 3 s.
    const N: usize = 3;
    let dir = RuntimeDir::new("gate");
    let mut peers: Vec<Peer> = (0..N)
        .map(|_| Peer::spawn(&dir.0, &format!("gate {N}")))
        .collect();
    for p in &peers {
        assert_eq!(p.line(), "ready");
    }
    let r = softwarp(&dir.0, &["resources", "--json"]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let listing: Json = serde_json::from_str(&r.stdout).unwrap();
    let memory = listing["memory"].as_array().unwrap();
    assert_eq!(memory.len(), N, "{listing}");
    for m in memory {
        assert_eq!(m["tracker"], format!("saw {N} asked"), "{listing}");
    }
    for p in &mut peers {
        p.finish();
    }
}

#[test]
fn fault_inject_fails_a_device_and_the_holders_are_named_with_their_lines() {
    let dir = RuntimeDir::new("fault");
    let mut peer = Peer::spawn(&dir.0, "sends 1 64");
    let done = peer.line();
    let f: Vec<&str> = done.split_whitespace().collect();
    let (client, created_at) = (f[1], f[5]);
    let pid_s = peer.pid().to_string();
    assert!(ok(&dir.0, &["resources", "--holders"]).contains("no device has failed"));

    let out = ok(
        &dir.0,
        &["fault", "inject", "--pid", &pid_s, "--device", client],
    );
    assert!(out.contains(&format!("{client}: ")), "{out}");
    assert!(out.contains("fault injected"), "{out}");
    let status: Json = serde_json::from_str(&ok(&dir.0, &["fault", "status", "--json"])).unwrap();
    let devices = status["devices"].as_array().unwrap();
    let dev = devices.iter().find(|d| d["device"] == client).unwrap();
    assert_ne!(dev["state"], "operational", "{status}");
    assert_eq!(dev["fault"]["kind"], "injected");
    assert_eq!(dev["fault"]["generation"], 1);
    // Who holds what, created where (the QP of the child's line among them).
    let holders = ok(&dir.0, &["resources", "--holders", "--pid", &pid_s]);
    assert!(holders.contains("PID"), "{holders}");
    assert!(
        holders.contains(created_at),
        "{created_at} not in\n{holders}"
    );
    assert!(holders.contains(" qp "), "{holders}");

    // A kind that does not exist changes nothing and says why.
    let r = softwarp(
        &dir.0,
        &["fault", "inject", "--pid", &pid_s, "--kind", "nope"],
    );
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("unknown fault kind"), "{}", r.stderr);
    peer.finish();
}

#[test]
fn a_leaked_qp_is_in_the_error_log_with_the_line_that_created_it() {
    let dir = RuntimeDir::new("leak");
    let mut peer = Peer::spawn(&dir.0, "leak");
    let line = peer.line();
    let created_at = line.strip_prefix("leaked ").unwrap().to_string();
    peer.finish();
    let events = error_log(&dir.0);
    let leak = events
        .iter()
        .find(|e| e["event"] == "leak_at_close")
        .unwrap_or_else(|| panic!("no leak_at_close in {events:?}"));
    assert_eq!(leak["pid"], peer.pid());
    let detail = leak["detail"].as_str().unwrap();
    assert!(
        detail
            .lines()
            .any(|l| l.trim_start().starts_with("qp ") && l.contains(&created_at)),
        "{created_at} not in {detail}"
    );
    assert!(leak["action"].as_str().unwrap().contains("file:line"));
}

/// The error log lines of the runtime directory `dir`.
fn error_log(dir: &Path) -> Vec<Json> {
    let log = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            n.starts_with("errors-") && n.ends_with(".jsonl")
        })
        .expect("an error log in the runtime directory");
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_terminate_received_is_in_the_error_log_with_qp_peer_and_advice() {
    let dir = RuntimeDir::new("term");
    let mut peer = Peer::spawn(&dir.0, "terminate");
    let line = peer.line();
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(f[0], "terminated", "{line}");
    let (device, qpn, addr) = (f[1], f[2], f[3]);
    peer.finish();
    let events = error_log(&dir.0);
    let ev = events
        .iter()
        .find(|e| e["event"] == "terminate_received")
        .unwrap_or_else(|| panic!("no terminate_received in {events:?}"));
    assert_eq!(ev["device"], device);
    assert_eq!(ev["qpn"].as_u64().unwrap().to_string(), qpn);
    assert_eq!(ev["peer"], addr);
    assert_eq!(ev["pid"], peer.pid());
    let detail = ev["detail"].as_str().unwrap();
    assert!(detail.contains("layer 0, error type 0"), "{detail}");
    // The advice names the QP's snapshot.
    let snapshot = ev["snapshot"].as_u64().expect("a snapshot id");
    let action = ev["action"].as_str().unwrap();
    assert!(
        action.contains(&format!(
            "softwarp snapshots --pid {} --id {snapshot}",
            peer.pid()
        )),
        "{action}"
    );
}

#[test]
fn snapshots_and_dump_of_a_running_process_read_back_through_decode() {
    let dir = RuntimeDir::new("dump");
    let mut peer = Peer::spawn(&dir.0, "terminate");
    let line = peer.line();
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(f[0], "terminated", "{line}");
    let (device, qpn) = (f[1], f[2]);
    let pid_s = peer.pid().to_string();

    // `snapshots`: the server QP's snapshot, with the Terminate and the traffic it saw.
    let json: Json = serde_json::from_str(
        ok(
            &dir.0,
            &["snapshots", "--pid", &pid_s, "--qp", qpn, "--json"],
        )
        .trim(),
    )
    .unwrap();
    assert_eq!(json["pid"], peer.pid());
    let snaps = json["snapshots"].as_array().unwrap();
    let snap = snaps
        .iter()
        .find(|s| s["device"] == device)
        .unwrap_or_else(|| panic!("no snapshot of {device} in {json}"));
    assert_eq!(snaps.iter().filter(|s| s["device"] == device).count(), 1);
    assert_eq!(snap["qpn"].as_u64().unwrap().to_string(), qpn);
    assert_eq!(snap["event"], "terminate_received");
    assert_eq!(snap["terminate"]["direction"], "received");
    assert_eq!(snap["terminate"]["layer"], 0);
    assert_eq!(snap["counters"]["rx_send_messages"], 3);
    assert_eq!(snap["counters"]["rx_send_bytes"], 192);
    assert!(!snap["records"].as_array().unwrap().is_empty());
    let id = snap["id"].as_u64().unwrap().to_string();
    let table = ok(&dir.0, &["snapshots", "--pid", &pid_s]);
    assert!(table.starts_with("PID "), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.contains(device) && l.contains("terminate_received")),
        "{table}"
    );
    let full = ok(&dir.0, &["snapshots", "--pid", &pid_s, "--id", &id, "-v"]);
    assert!(
        full.contains(&format!("snapshot {id} ")) && full.contains("records ("),
        "{full}"
    );

    // `dump -o FILE --to collector`: one dump, the same bytes in the file and at the
    // collector.
    let collector = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = collector.local_addr().unwrap().to_string();
    let received = std::thread::spawn(move || {
        let (mut s, _) = collector.accept().unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut s, &mut v).unwrap();
        v
    });
    let file = dir.0.join("one.swdump");
    let file_s = file.to_str().unwrap();
    let said = ok(
        &dir.0,
        &["dump", "--pid", &pid_s, "-o", file_s, "--to", &addr],
    );
    assert!(said.contains(&format!("sent to {addr}")), "{said}");
    let bytes = std::fs::read(&file).unwrap();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "a dump file is its owner's only");
    assert_eq!(
        received.join().unwrap(),
        bytes,
        "the collector got the file's bytes"
    );
    assert!(bytes.starts_with(
        b"SOFTWARP-DUMP 1
"
    ));

    // `decode` reads it back: the QP, the levels, the flight recorder records.
    let text = ok(&dir.0, &["decode", file_s]);
    for needle in [
        "== process ==",
        "== levels ==",
        "qp=1",
        "== resources ==",
        "== snapshots ==",
        "== flight-recorder ==",
        "the dump is complete (7 sections)",
    ] {
        assert!(text.contains(needle), "{needle} not in the decoded dump");
    }
    assert!(
        text.lines()
            .any(|l| l.starts_with(&format!("{device} qp {qpn} state ERROR"))),
        "the QP is in the resources section"
    );
    assert!(text.contains(&format!("snapshot {id} ")));
    assert!(
        text.contains("Terminate received"),
        "a flight recorder record"
    );
    let decoded: Json =
        serde_json::from_str(ok(&dir.0, &["decode", "--json", file_s]).trim()).unwrap();
    assert_eq!(decoded["complete"], true);
    let names: Vec<&str> = decoded["sections"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "process",
            "levels",
            "resources",
            "stats",
            "snapshots",
            "flight-recorder",
            "markers"
        ]
    );
    let records = decoded["sections"][5]["body"]["records"]
        .as_array()
        .unwrap();
    assert!(records
        .iter()
        .any(|r| r["qpn"].as_u64().map(|q| q.to_string()).as_deref() == Some(qpn)));

    // A truncated copy is reported as truncated (exit status 2), not taken for a dump.
    let cut = dir.0.join("cut.swdump");
    std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let r = softwarp(&dir.0, &["decode", cut.to_str().unwrap()]);
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("truncated"), "{}", r.stderr);
    assert!(r.stdout.contains("DUMP INCOMPLETE"), "{}", r.stdout);
    peer.finish();
}

#[test]
fn doctor_reports_a_verdict_in_text_and_json() {
    let dir = RuntimeDir::new("doc");
    let text = ok(&dir.0, &["doctor"]);
    assert!(
        text.lines().last().unwrap().starts_with("verdict: "),
        "{text}"
    );
    let report: Json = serde_json::from_str(&ok(&dir.0, &["doctor", "--json"])).unwrap();
    let checks: Vec<&str> = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["check"].as_str().unwrap())
        .collect();
    for c in ["socket_buffers", "clocksource", "nofile", "runtime_dir"] {
        assert!(checks.contains(&c), "{c} not in {checks:?}");
    }
}

// ---------------------------------------------------------------------------------------
// The child's side
// ---------------------------------------------------------------------------------------

mod child {
    use std::io::Read;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use softwarp::*;

    /// The longest a child runs, whatever happens to its parent.
    const LIFETIME: Duration = Duration::from_secs(120);

    fn say(line: &str) {
        println!("SWCHILD {line}");
    }

    /// Set when the parent closes our stdin.
    fn stop_flag() -> Arc<AtomicBool> {
        let stop = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            while matches!(std::io::stdin().read(&mut buf), Ok(n) if n > 0) {}
            s.store(true, Ordering::Relaxed);
        });
        stop
    }

    fn wait_one(cq: &CompletionQueue) -> WorkCompletion {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(wc) = cq.poll_one() {
                assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                return wc;
            }
            assert!(Instant::now() < deadline, "no completion");
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// A QP pair on one device over loopback, with `recvs` receives of `len` bytes posted
    /// on the server side. Field order is drop order: the device goes last.
    pub struct Pair {
        pub client: QueuePair,
        pub server: QueuePair,
        pub src: MemoryRegion,
        pub sink: MemoryRegion,
        pub ccq: CompletionQueue,
        pub scq: CompletionQueue,
        pub _listener: Listener,
        pub _pd: ProtectionDomain,
        pub dev: Device,
        pub created_at: String,
    }

    impl Pair {
        pub fn new(recvs: u32, len: u32) -> Self {
            let dev = Device::open_default().unwrap();
            let pd = dev.alloc_pd().unwrap();
            let ccq = dev.create_cq(1024, None).unwrap();
            let scq = dev.create_cq(1024, None).unwrap();
            let client = pd.create_qp(&QpInitAttr::new(&ccq, &ccq)).unwrap();
            let created_at = format!("{}:{}", file!(), line!() - 1);
            let server = pd.create_qp(&QpInitAttr::new(&scq, &scq)).unwrap();
            let src = pd.reg_mr(len as usize, AccessFlags::NONE).unwrap();
            let sink = pd
                .reg_mr((len * recvs) as usize, AccessFlags::LOCAL_WRITE)
                .unwrap();
            for i in 0..recvs {
                server
                    .post_recv(&RecvWr {
                        wr_id: u64::from(i),
                        sgl: SgList::single(sink.sge((i * len) as usize, len).unwrap()),
                    })
                    .unwrap();
            }
            let listener = Listener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let opts = ConnectOptions::default();
            std::thread::scope(|s| {
                let h = s.spawn(|| {
                    listener
                        .accept_timeout(&server, &opts, Duration::from_secs(20))
                        .unwrap()
                });
                client.connect(addr, &opts).unwrap();
                h.join().unwrap();
            });
            Self {
                client,
                server,
                src,
                sink,
                ccq,
                scq,
                _listener: listener,
                _pd: pd,
                dev,
                created_at,
            }
        }

        pub fn send(&self, wr_id: u64, len: u32) {
            self.client
                .post_send(&SendWr {
                    wr_id,
                    op: SendOp::Send {
                        solicited: false,
                        invalidate: None,
                    },
                    payload: Payload::Sgl(SgList::single(self.src.sge(0, len).unwrap())),
                    signaled: true,
                    fence: false,
                })
                .unwrap();
        }
    }

    /// `traffic`: one 64-byte Send at a time, each received and its receive reposted,
    /// until stdin closes.
    pub fn traffic() {
        let stop = stop_flag();
        let p = Pair::new(1, 64);
        say(&format!(
            "ready {} {}",
            p.dev.instance_name(),
            p.client.qp_num()
        ));
        let until = Instant::now() + LIFETIME;
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) && Instant::now() < until {
            n += 1;
            p.send(n, 64);
            wait_one(&p.ccq);
            wait_one(&p.scq);
            p.server
                .post_recv(&RecvWr {
                    wr_id: n,
                    sgl: SgList::single(p.sink.sge(0, 64).unwrap()),
                })
                .unwrap();
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// `sends N S`: N Sends of S bytes, all completed, then idle until stdin closes.
    pub fn sends(n: u32, len: u32) {
        let stop = stop_flag();
        let p = Pair::new(n, len);
        for i in 0..n {
            p.send(u64::from(i), len);
        }
        for _ in 0..n {
            wait_one(&p.ccq);
            wait_one(&p.scq);
        }
        say(&format!(
            "done {} {} {} {} {}",
            p.dev.instance_name(),
            p.client.qp_num(),
            p.dev.instance_name(),
            p.server.qp_num(),
            p.created_at
        ));
        let until = Instant::now() + LIFETIME;
        while !stop.load(Ordering::Relaxed) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// `terminate`: 3 Sends of 64 bytes, then the client moves its QP to Error, so the
    /// server receives a Terminate; then idle until stdin closes.
    pub fn terminate() {
        let stop = stop_flag();
        let p = Pair::new(3, 64);
        for i in 0..3 {
            p.send(i, 64);
        }
        for _ in 0..3 {
            wait_one(&p.ccq);
            wait_one(&p.scq);
        }
        let peer = p.server.connection().unwrap().peer_addr;
        p.client.modify_to_error().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while p.server.state() != QpState::Error {
            assert!(Instant::now() < deadline, "the server QP did not fail");
            std::thread::sleep(Duration::from_millis(1));
        }
        say(&format!(
            "terminated {} {} {peer}",
            p.dev.instance_name(),
            p.server.qp_num()
        ));
        let until = Instant::now() + LIFETIME;
        while !stop.load(Ordering::Relaxed) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// `many N`: N QPs on one device (not connected), idle until stdin closes.
    pub fn many(n: usize) {
        let stop = stop_flag();
        let dev = Device::open_default().unwrap();
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(16, None).unwrap();
        let qps: Vec<QueuePair> = (0..n)
            .map(|_| pd.create_qp(&QpInitAttr::new(&cq, &cq)).unwrap())
            .collect();
        say(&format!(
            "many {} {}",
            dev.instance_name(),
            qps[n / 2].qp_num()
        ));
        let until = Instant::now() + LIFETIME;
        while !stop.load(Ordering::Relaxed) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// `gate N`: a control socket whose `resources` answers once N processes of the
    /// runtime directory were asked (each leaves a file there), or after 10 s; its one
    /// table is named `saw <count> asked`.
    pub fn gate(n: usize) {
        use softwarp_ras::control::{ControlHandler, ResourcesResult};
        use softwarp_ras::service::{self, ServiceConfig};
        use softwarp_ras::tracker::{MemoryUsage, ResourceFilter};
        use std::path::PathBuf;

        struct Gate {
            dir: PathBuf,
            n: usize,
        }
        impl ControlHandler for Gate {
            fn resources(&self, _: &ResourceFilter) -> ResourcesResult {
                let mine = self.dir.join(format!("asked-{}", std::process::id()));
                std::fs::write(&mine, b"").unwrap();
                let count = || {
                    std::fs::read_dir(&self.dir)
                        .unwrap()
                        .filter_map(Result::ok)
                        .filter(|e| e.file_name().to_string_lossy().starts_with("asked-"))
                        .count()
                };
                let until = Instant::now() + Duration::from_secs(10);
                while count() < self.n && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                }
                ResourcesResult {
                    memory: vec![MemoryUsage {
                        tracker: format!("saw {} asked", count()),
                        ..MemoryUsage::default()
                    }],
                    ..ResourcesResult::default()
                }
            }
        }
        let stop = stop_flag();
        let dir = PathBuf::from(std::env::var_os("SOFTWARP_RUNTIME_DIR").unwrap());
        let config = ServiceConfig {
            runtime_dir: Some(dir.clone()),
            ..ServiceConfig::default()
        };
        let svc = service::start(&config, Arc::new(Gate { dir, n }));
        assert!(svc.problems().is_empty(), "{:?}", svc.problems());
        say("ready");
        let until = Instant::now() + LIFETIME;
        while !stop.load(Ordering::Relaxed) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(svc);
    }

    /// `leak`: closes the device while a QP (and its CQ) are still allocated.
    pub fn leak() {
        let stop = stop_flag();
        let dev = Device::open_default().unwrap();
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(16, None).unwrap();
        let qp = pd.create_qp(&QpInitAttr::new(&cq, &cq)).unwrap();
        let created_at = format!("{}:{}", file!(), line!() - 1);
        drop(pd);
        drop(dev);
        say(&format!("leaked {created_at}"));
        let until = Instant::now() + LIFETIME;
        while !stop.load(Ordering::Relaxed) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(qp);
        drop(cq);
    }
}

/// The child process's entry point: does nothing unless `SWTEST_CHILD` names a mode.
#[test]
fn child_process() {
    let Ok(mode) = std::env::var("SWTEST_CHILD") else {
        return;
    };
    let args: Vec<&str> = mode.split_whitespace().collect();
    match args.as_slice() {
        ["traffic"] => child::traffic(),
        ["sends", n, len] => child::sends(n.parse().unwrap(), len.parse().unwrap()),
        ["leak"] => child::leak(),
        ["many", n] => child::many(n.parse().unwrap()),
        ["gate", n] => child::gate(n.parse().unwrap()),
        ["terminate"] => child::terminate(),
        _ => panic!("unknown child mode {mode:?}"),
    }
    std::io::stdout().flush().unwrap();
}
