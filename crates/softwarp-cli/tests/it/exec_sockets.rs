//! `softwarp exec --sockets`: the environment it gives the program, and socat over iWARP
//! through it. Skips, saying why, when the preload library was not built (it is, by
//! `cargo test --workspace`) or socat is missing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use softwarp_testkit::{free_port, require, root, skip, tool};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::softwarp;

/// The preload library cargo built in this target directory; `None` (after [`skip`]: a
/// failure under `CI=true`) when it was not built.
fn library() -> Option<PathBuf> {
    let lib = softwarp_testkit::library("libsoftwarp_preload.so");
    if lib.is_none() {
        skip("libsoftwarp_preload.so is not built (cargo build -p softwarp-preload)");
    }
    lib
}

#[test]
fn exec_sockets_options_without_sockets_or_a_library_explain_themselves() {
    let out = softwarp()
        .args(["exec", "--ports", "5201", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--sockets"));
    let out = softwarp()
        .args([
            "exec",
            "--sockets",
            "--library",
            "/nonexistent/lib.so",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));
}

#[test]
fn exec_sets_the_preload_environment() {
    let Some(lib) = library() else {
        return;
    };
    let out = softwarp()
        .args(["exec", "--sockets", "--ports", "5201,6000-6010", "--stats", "--library"])
        .arg(&lib)
        .args([
            "--",
            "sh",
            "-c",
            "echo \"$LD_PRELOAD|$SOFTWARP_SOCKETS|$SOFTWARP_SOCKETS_PORTS|$SOFTWARP_SOCKETS_STATS\"; exit 7",
        ])
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7), "the program's exit status");
    let line = String::from_utf8_lossy(&out.stdout);
    let want = format!(
        "{}|all|5201,6000-6010|1",
        std::fs::canonicalize(&lib).unwrap().display()
    );
    assert_eq!(line.trim(), want);
}

#[test]
fn exec_runs_socat_over_iwarp() {
    let Some(lib) = library() else {
        return;
    };
    if !require(tool("socat").package("socat")) {
        return;
    }
    let port = free_port();
    let exec = |args: &[&str]| {
        let mut c = softwarp();
        c.args(["exec", "--sockets", "--stats", "--library"])
            .arg(&lib)
            .arg("--")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    let server = exec(&[
        "socat",
        "-u",
        &format!("TCP-LISTEN:{port},reuseaddr"),
        "STDOUT",
    ])
    .spawn()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let client = loop {
        let mut c = exec(&["socat", "-u", "STDIN", &format!("TCP:127.0.0.1:{port}")])
            .spawn()
            .unwrap();
        {
            use std::io::Write;
            let mut stdin = c.stdin.take().unwrap();
            let _ = stdin.write_all(b"hello over iWARP\n");
        }
        let out = c.wait_with_output().unwrap();
        if out.status.success() {
            break out;
        }
        assert!(
            Instant::now() < deadline,
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let server = server.wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&server.stdout),
        "hello over iWARP\n"
    );
    for err in [&client.stderr, &server.stderr] {
        assert!(
            String::from_utf8_lossy(err).contains("closed iWARP stream"),
            "{}",
            String::from_utf8_lossy(err)
        );
    }
}

/// socat through `softwarp exec --sockets [extra]`: `data` from a client to a server on
/// `port`; returns what the server wrote out.
fn socat_once(lib: &std::path::Path, port: u16, extra: &[&str], data: &[u8]) -> Vec<u8> {
    let exec = |args: &[&str]| {
        let mut c = softwarp();
        c.args(["exec", "--sockets", "--library"])
            .arg(lib)
            .args(extra)
            .arg("--")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    let server = exec(&[
        "socat",
        "-u",
        &format!("TCP-LISTEN:{port},reuseaddr"),
        "STDOUT",
    ])
    .spawn()
    .unwrap();
    // Read the server's output while the client sends (a full pipe would stop the server).
    let server = std::thread::spawn(move || server.wait_with_output().unwrap().stdout);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut c = exec(&["socat", "-u", "STDIN", &format!("TCP:127.0.0.1:{port}")])
            .spawn()
            .unwrap();
        {
            use std::io::Write;
            // A client that failed to connect has exited: its stdin is closed.
            let _ = c.stdin.take().unwrap().write_all(data);
        }
        let out = c.wait_with_output().unwrap();
        if out.status.success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    server.join().unwrap()
}

#[test]
fn a_capture_of_exec_sockets_decodes_as_iwarp_and_opt_in_stays_tcp() {
    let Some(lib) = library() else {
        return;
    };
    let needs = [
        tool("tcpdump").package("tcpdump"),
        tool("socat").package("socat"),
    ];
    if !require((root("capturing on lo"), needs)) {
        return;
    }
    let data: Vec<u8> = (0..300_000u32)
        .map(|i| (i.wrapping_mul(7919) >> 3) as u8)
        .collect();
    for attempt in 1..=3 {
        let (p_iwarp, p_tcp) = (free_port(), free_port());
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let pcap = dir.join(format!("exec-sockets-{}.pcap", std::process::id()));
        let mut dump = Command::new("tcpdump")
            .args([
                "-i",
                "lo",
                "-U",
                "--immediate-mode",
                "-s",
                "0",
                "-B",
                "16384",
                "-n",
                "-w",
            ])
            .arg(&pcap)
            .args([
                "tcp",
                "port",
                &p_iwarp.to_string(),
                "or",
                "tcp",
                "port",
                &p_tcp.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // tcpdump prints "listening on" once it captures.
        let mut err = dump.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::Read;
            let mut all = String::new();
            let mut buf = [0u8; 256];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                all.push_str(&String::from_utf8_lossy(&buf[..n]));
                let _ = tx.send(all.clone());
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut seen = String::new();
        while !seen.contains("listening on") {
            let left = deadline.saturating_duration_since(Instant::now());
            seen = rx.recv_timeout(left).expect("tcpdump did not start");
        }
        let got_iwarp = socat_once(&lib, p_iwarp, &[], &data);
        let got_tcp = socat_once(&lib, p_tcp, &["--opt-in"], &data);
        std::thread::sleep(Duration::from_millis(1500));
        let _ = Command::new("kill")
            .args(["-INT", &dump.id().to_string()])
            .status();
        let _ = dump.wait();
        let mut report = String::new();
        while let Ok(s) = rx.recv_timeout(Duration::from_millis(300)) {
            report = s;
        }
        assert_eq!(got_iwarp, data, "bytes over iWARP");
        assert_eq!(got_tcp, data, "bytes over plain TCP");
        let dropped = report
            .lines()
            .find_map(|l| l.strip_suffix(" packets dropped by kernel"))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if dropped > 0 && attempt < 3 {
            eprintln!("tcpdump lost {dropped} packets; capturing again");
            continue;
        }
        let out = softwarp()
            .arg("decode")
            .arg("--summary")
            .arg(&pcap)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let summary = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}\n{summary}");
        assert!(
            text.contains("MPA-REQ") && text.contains("MPA-REP") && text.contains(" Send "),
            "{text}"
        );
        // Refused attempts of a client that started before its server count as connections
        // too; exactly one of them all is iWARP, and its peer port is the iWARP one.
        assert!(
            summary.contains("(1 iWARP)") && summary.contains("0 bad CRCs"),
            "{summary}"
        );
        assert!(
            text.lines()
                .filter(|l| l.contains("MPA-REQ"))
                .all(|l| l.contains(&format!(">{p_iwarp} "))),
            "{text}"
        );
        let sends: u64 = text
            .lines()
            .filter(|l| l.contains(" Send "))
            .filter_map(|l| l.split("payload=").nth(1))
            .filter_map(|p| p.split_whitespace().next()?.parse::<u64>().ok())
            .sum();
        assert!(
            sends >= data.len() as u64,
            "{sends} Send payload bytes in the capture"
        );
        let _ = std::fs::remove_file(&pcap);
        return;
    }
}

/// RAS: the QPs of a preloaded program (`SOFTWARP_RAS=on`) appear in `softwarp resources`
/// under the program's pid and name while its connection is open.
#[test]
fn resources_lists_a_preloaded_programs_qps_with_its_name() {
    let Some(lib) = library() else {
        return;
    };
    if !require(tool("socat").package("socat")) {
        return;
    }
    // Short: control socket paths must stay under 108 bytes.
    let rt = std::env::temp_dir().join(format!("swsock-ras-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&rt);
    std::fs::create_dir_all(&rt).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&rt, std::fs::Permissions::from_mode(0o700)).unwrap();
    }
    let port = free_port();
    let exec = |args: &[&str]| {
        let mut c = softwarp();
        c.args(["exec", "--sockets", "--library"])
            .arg(&lib)
            .arg("--")
            .args(args)
            .env("SOFTWARP_RAS", "on")
            .env("SOFTWARP_RUNTIME_DIR", &rt)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    let mut server = exec(&[
        "socat",
        "-u",
        &format!("TCP-LISTEN:{port},reuseaddr"),
        "STDOUT",
    ])
    .spawn()
    .unwrap();
    let server_pid = u64::from(server.id());
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut found = None;
    let mut client = None;
    let mut last = String::new();
    while Instant::now() < deadline && found.is_none() {
        // A client that holds the connection open (its stdin stays open).
        if client.is_none() {
            let mut c = exec(&["socat", "-u", "STDIN", &format!("TCP:127.0.0.1:{port}")])
                .spawn()
                .unwrap();
            use std::io::Write;
            let _ = c.stdin.as_mut().unwrap().write_all(b"hello\n");
            client = Some(c);
        }
        std::thread::sleep(Duration::from_millis(200));
        if let Some(c) = client.as_mut() {
            if c.try_wait().unwrap().is_some() {
                client = None; // refused (the server did not listen yet): again
                continue;
            }
        }
        let out = softwarp()
            .args(["resources", "--json", "--kind", "qp"])
            .env("SOFTWARP_RUNTIME_DIR", &rt)
            .output()
            .unwrap();
        last = String::from_utf8_lossy(&out.stdout).to_string();
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&last) else {
            continue;
        };
        found = v["resources"].as_array().and_then(|rows| {
            rows.iter()
                .find(|r| r["pid"].as_u64() == Some(server_pid))
                .cloned()
        });
    }
    let mut client = client.expect("a client");
    drop(client.stdin.take());
    let _ = client.wait();
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(&rt);
    let qp = found.unwrap_or_else(|| panic!("no QP of pid {server_pid} in\n{last}"));
    assert_eq!(qp["process"], "socat", "{qp}");
    assert_eq!(qp["details"]["state"], "RTS", "{qp}");
}
