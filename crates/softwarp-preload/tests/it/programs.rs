//! Unmodified programs over the preload library on loopback: Debian's `socat` (both ends
//! preloaded, files both ways, checksums compared) and a C program that opts in with the
//! header's `setsockopt`. Each test skips, saying why, when its program is missing (and fails
//! under `CI=true`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use softwarp_testkit::{free_port, require, tool, Reaped, SpawnReaped};

/// The preload library cargo built next to this test's executable.
fn library() -> PathBuf {
    softwarp_testkit::library("libsoftwarp_preload.so")
        .expect("libsoftwarp_preload.so (this package's library, built before its tests)")
}

fn work_dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// A preloaded command in `dir` with `env`.
fn preloaded(program: &str, args: &[&str], dir: &Path, env: &[(&str, &str)]) -> Command {
    let mut c = Command::new(program);
    c.args(args)
        .current_dir(dir)
        .env("LD_PRELOAD", library())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

/// Waits at most `limit` for `child`; kills it past that.
fn wait_bounded(child: Reaped, limit: Duration, what: &str) -> Output {
    let mut child = child.take();
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what} did not finish within {limit:?}; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs a client until its connection is accepted (the server may not listen yet), at most
/// 100 tries.
fn run_client(make: impl FnMut() -> Command, what: &str) -> Output {
    run_client_within(make, what, Duration::from_secs(60))
}

/// [`run_client`] with each run bounded by `limit`.
fn run_client_within(mut make: impl FnMut() -> Command, what: &str, limit: Duration) -> Output {
    for _ in 0..100 {
        let out = wait_bounded(make().spawn_reaped(), limit, what);
        let err = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() && err.contains("Connection refused") {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        return out;
    }
    panic!("{what}: the server never listened");
}

/// The byte counts of the stats lines (`SOFTWARP_SOCKETS_STATS=1`): (tx Send bytes, rx Send
/// bytes) of each stream the process closed.
fn stream_stats(stderr: &[u8]) -> Vec<(u64, u64)> {
    String::from_utf8_lossy(stderr)
        .lines()
        .filter(|l| l.contains("closed iWARP stream"))
        .map(|l| {
            // "... tx N Sends B bytes, rx M Sends C bytes, ..."
            let field = |from: &str, to: &str| -> u64 {
                let part = &l[l.find(from).unwrap()..];
                let part = &part[..part.find(to).unwrap_or(part.len())];
                part.split_whitespace().nth(3).unwrap().parse().unwrap()
            };
            (field("tx ", ", rx"), field("rx ", ","))
        })
        .collect()
}

const ALL: [(&str, &str); 2] = [("SOFTWARP_SOCKETS", "all"), ("SOFTWARP_SOCKETS_STATS", "1")];

#[test]
fn socat_moves_files_both_ways_over_iwarp() {
    if !require(tool("socat").package("socat")) {
        return;
    }
    let dir = work_dir("socat-both-ways");
    // CI moves 6 and 5 MiB; SOFTWARP_SOCAT_MIB=100 moves 100 MiB each way (a longer run).
    let mib: usize = std::env::var("SOFTWARP_SOCAT_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let limit = Duration::from_secs(60 + 2 * mib as u64);
    let up = pattern(mib << 20, 1);
    let down = pattern(((mib.max(2) - 1) << 20) + 4321, 2);
    std::fs::write(dir.join("up.bin"), &up).unwrap();
    std::fs::write(dir.join("down.bin"), &down).unwrap();
    let (p_up, p_down) = (free_port(), free_port());
    let t0 = Instant::now();
    // Up: the listener receives. Down: the listener sends.
    let s_up = preloaded(
        "socat",
        &[
            "-u",
            &format!("TCP-LISTEN:{p_up},reuseaddr"),
            "OPEN:up.out,creat,trunc",
        ],
        &dir,
        &ALL,
    )
    .spawn_reaped();
    let s_down = preloaded(
        "socat",
        &[
            "-u",
            "OPEN:down.bin",
            &format!("TCP-LISTEN:{p_down},reuseaddr"),
        ],
        &dir,
        &ALL,
    )
    .spawn_reaped();
    let d2 = dir.clone();
    let c_down = std::thread::spawn(move || {
        run_client_within(
            || {
                preloaded(
                    "socat",
                    &[
                        "-u",
                        &format!("TCP:127.0.0.1:{p_down}"),
                        "OPEN:down.out,creat,trunc",
                    ],
                    &d2,
                    &ALL,
                )
            },
            "socat client (down)",
            limit,
        )
    });
    let c_up = run_client_within(
        || {
            preloaded(
                "socat",
                &["-u", "OPEN:up.bin", &format!("TCP:127.0.0.1:{p_up}")],
                &dir,
                &ALL,
            )
        },
        "socat client (up)",
        limit,
    );
    let c_down = c_down.join().unwrap();
    let s_up = wait_bounded(s_up, limit, "socat server (up)");
    let s_down = wait_bounded(s_down, limit, "socat server (down)");
    for (what, out) in [
        ("client up", &c_up),
        ("client down", &c_down),
        ("server up", &s_up),
        ("server down", &s_down),
    ] {
        assert!(
            out.status.success(),
            "{what}: {:?}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let got_up = std::fs::read(dir.join("up.out")).unwrap();
    let got_down = std::fs::read(dir.join("down.out")).unwrap();
    assert_eq!(got_up.len(), up.len());
    assert_eq!(crc32c::crc32c(&got_up), crc32c::crc32c(&up));
    assert_eq!(got_down.len(), down.len());
    assert_eq!(crc32c::crc32c(&got_down), crc32c::crc32c(&down));
    // The bytes went as iWARP Sends: each file's bytes (plus an 8-byte header per Send)
    // left the sender's QP and arrived in the receiver's.
    let sent_up = stream_stats(&c_up.stderr);
    let recv_up = stream_stats(&s_up.stderr);
    let sent_down = stream_stats(&s_down.stderr);
    let recv_down = stream_stats(&c_down.stderr);
    assert_eq!(
        sent_up.len(),
        1,
        "{}",
        String::from_utf8_lossy(&c_up.stderr)
    );
    assert!(sent_up[0].0 >= up.len() as u64 && recv_up[0].1 == sent_up[0].0);
    assert!(sent_down[0].0 >= down.len() as u64 && recv_down[0].1 == sent_down[0].0);
    eprintln!(
        "socat over iWARP: {} + {} bytes both ways in {:?}; Send bytes up {:?} down {:?}",
        up.len(),
        down.len(),
        t0.elapsed(),
        sent_up[0],
        sent_down[0]
    );
}

#[test]
fn socat_in_pass_through_mode_stays_plain_tcp() {
    if !require(tool("socat").package("socat")) {
        return;
    }
    let dir = work_dir("socat-pass-through");
    let data = pattern(1 << 20, 3);
    std::fs::write(dir.join("in.bin"), &data).unwrap();
    let port = free_port();
    let env = [("SOFTWARP_SOCKETS_STATS", "1")];
    let server = preloaded(
        "socat",
        &[
            "-u",
            &format!("TCP-LISTEN:{port},reuseaddr"),
            "OPEN:out.bin,creat,trunc",
        ],
        &dir,
        &env,
    )
    .spawn_reaped();
    // The client is not preloaded at all: plain TCP on both ends.
    let client = run_client(
        || {
            let mut c = Command::new("socat");
            c.args(["-u", "OPEN:in.bin", &format!("TCP:127.0.0.1:{port}")])
                .current_dir(&dir)
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            c
        },
        "plain socat client",
    );
    assert!(client.status.success());
    let server = wait_bounded(server, Duration::from_secs(30), "preloaded socat server");
    assert!(
        server.status.success(),
        "{}",
        String::from_utf8_lossy(&server.stderr)
    );
    assert!(
        stream_stats(&server.stderr).is_empty(),
        "no iWARP stream in pass-through mode"
    );
    let got = std::fs::read(dir.join("out.bin")).unwrap();
    assert_eq!(crc32c::crc32c(&got), crc32c::crc32c(&data));
}

#[test]
fn a_c_program_opts_in_with_the_header_and_falls_back_without_the_library() {
    if !require(tool("cc").package("gcc")) {
        return;
    }
    let dir = work_dir("c-program");
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let include = manifest.join("../softwarp-sockets/include");
    let bin = dir.join("iwarp_sum");
    let cc = Command::new("cc")
        .args(["-O1", "-Wall", "-o"])
        .arg(&bin)
        .arg("-I")
        .arg(&include)
        .arg(manifest.join("tests/c/iwarp_sum.c"))
        .output()
        .unwrap();
    assert!(
        cc.status.success(),
        "{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let bin = bin.to_str().unwrap().to_string();
    for preload in [true, false] {
        let port = free_port().to_string();
        let cmd = |args: &[&str]| {
            let mut c = if preload {
                preloaded(&bin, args, &dir, &[("SOFTWARP_SOCKETS_STATS", "1")])
            } else {
                let mut c = Command::new(&bin);
                c.args(args)
                    .current_dir(&dir)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                c
            };
            c.stdin(Stdio::null());
            c
        };
        let server = cmd(&["server", &port]).spawn_reaped();
        let client = run_client(|| cmd(&["client", &port, "3000000"]), "C client");
        let server = wait_bounded(server, Duration::from_secs(30), "C server");
        let (cout, sout) = (
            String::from_utf8_lossy(&client.stdout).to_string(),
            String::from_utf8_lossy(&server.stdout).to_string(),
        );
        assert!(
            client.status.success() && server.status.success(),
            "client {cout} {} / server {sout} {}",
            String::from_utf8_lossy(&client.stderr),
            String::from_utf8_lossy(&server.stderr)
        );
        assert!(cout.contains("ok 3000000 bytes"), "{cout}");
        let mode = if preload { "mode=iwarp" } else { "mode=tcp" };
        assert!(
            cout.contains(mode) && sout.contains(mode),
            "{cout} / {sout}"
        );
        if preload {
            let st = stream_stats(&client.stderr);
            assert!(st.len() == 1 && st[0].0 >= 3_000_000, "{st:?}");
        }
    }
}

#[test]
fn iperf3_runs_over_iwarp_both_directions_and_four_parallel_streams() {
    if !require(tool("iperf3").package("iperf3")) {
        return;
    }
    let dir = work_dir("iperf3");
    for extra in [&[][..], &["-R", "-P", "4"][..]] {
        let port = free_port().to_string();
        let server = preloaded("iperf3", &["-s", "-1", "-p", &port], &dir, &ALL).spawn_reaped();
        let mut args = vec!["-c", "127.0.0.1", "-p", &port, "-n", "16M"];
        args.extend_from_slice(extra);
        let client = run_client(|| preloaded("iperf3", &args, &dir, &ALL), "iperf3 client");
        let server = wait_bounded(server, Duration::from_secs(60), "iperf3 server");
        let out = String::from_utf8_lossy(&client.stdout);
        assert!(
            client.status.success() && server.status.success(),
            "{out}\n{}\n{}",
            String::from_utf8_lossy(&client.stderr),
            String::from_utf8_lossy(&server.stderr)
        );
        assert!(
            out.contains("receiver") && out.contains("iperf Done"),
            "{out}"
        );
        // The data connections' bytes went as Sends (the control connection is iWARP too).
        let (tx, rx): (u64, u64) = stream_stats(&client.stderr)
            .iter()
            .fold((0, 0), |a, s| (a.0 + s.0, a.1 + s.1));
        let moved = if extra.is_empty() { tx } else { rx };
        assert!(
            moved >= 16 << 20,
            "client streams moved {tx}/{rx} bytes\n{out}"
        );
        let summary = out.lines().rfind(|l| l.contains("receiver")).unwrap_or("");
        eprintln!("iperf3 {extra:?} over iWARP: {summary}");
    }
}

#[test]
fn redis_benchmark_runs_against_redis_server_over_iwarp() {
    let needs = [
        tool("redis-server").package("redis-server"),
        tool("redis-benchmark").package("redis-tools"),
    ];
    if !require(needs) {
        return;
    }
    let dir = work_dir("redis");
    let port = free_port().to_string();
    let server = preloaded(
        "redis-server",
        &[
            "--port",
            &port,
            "--save",
            "",
            "--appendonly",
            "no",
            "--bind",
            "127.0.0.1",
        ],
        &dir,
        &ALL,
    )
    .spawn_reaped();
    // redis-benchmark does not give up when nobody listens: wait until the server does.
    let mut server = server;
    let log = server.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(log).lines().map_while(Result::ok) {
            if line.contains("Ready to accept connections") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("redis-server did not become ready within 60 s");
    for pipeline in ["1", "16"] {
        let bench = run_client(
            || {
                preloaded(
                    "redis-benchmark",
                    &[
                        "-p", &port, "-n", "2000", "-c", "4", "-P", pipeline, "-t", "set,get", "-q",
                    ],
                    &dir,
                    &ALL,
                )
            },
            "redis-benchmark",
        );
        let out = String::from_utf8_lossy(&bench.stdout);
        assert!(
            bench.status.success(),
            "{out}\n{}",
            String::from_utf8_lossy(&bench.stderr)
        );
        let finals: Vec<&str> = out
            .split(['\r', '\n'])
            .filter(|l| l.contains("requests per second"))
            .collect();
        assert!(
            finals.iter().any(|l| l.starts_with("SET"))
                && finals.iter().any(|l| l.trim_start().starts_with("GET")),
            "{out}"
        );
        let streams = stream_stats(&bench.stderr);
        assert!(
            streams.len() >= 4 && streams.iter().all(|s| s.0 > 0 && s.1 > 0),
            "benchmark connections over iWARP: {streams:?}"
        );
        eprintln!(
            "redis-benchmark -P {pipeline} over iWARP: {}",
            finals.join(" | ")
        );
    }
    // A graceful stop (SIGTERM) lets the server close its streams.
    let _ = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status();
    let server = wait_bounded(server, Duration::from_secs(30), "redis-server");
    assert!(
        !stream_stats(&server.stderr).is_empty(),
        "{}",
        String::from_utf8_lossy(&server.stderr)
    );
}

/// Compiles `tests/c/NAME.c` (with the sockets header) into the work directory `dir`.
fn compile_c(name: &str, dir: &Path) -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bin = dir.join(name);
    let cc = Command::new("cc")
        .args(["-O1", "-Wall", "-pthread", "-o"])
        .arg(&bin)
        .arg("-I")
        .arg(manifest.join("../softwarp-sockets/include"))
        .arg(manifest.join(format!("tests/c/{name}.c")))
        .output()
        .unwrap();
    assert!(
        cc.status.success(),
        "{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    bin
}

/// The checks of `tests/c/posix_semantics.c`: each is the kernel's behaviour (the program
/// passes them over plain TCP first), then the same over iWARP streams, then with the TCP
/// fallback configured.
#[test]
fn socket_semantics_match_the_kernels() {
    if !require(tool("cc").package("gcc")) {
        return;
    }
    let dir = work_dir("posix-semantics");
    let bin = compile_c("posix_semantics", &dir);
    let bin = bin.to_str().unwrap();
    let checks = [
        "nonblocking_connect",
        "nonblocking_connect_refused",
        "receive_timeout",
        "send_timeout",
        "signal_interrupts",
        "signal_restarts",
        "peek",
        "waitall",
        "sigpipe",
        "epoll_edge_and_level",
        "hangup_bits",
        "sendfile_and_mmsg",
        "recvmmsg_timeout",
        "plain_client",
        "fork_inherited",
    ];
    for mode in ["tcp", "iwarp", "fallback"] {
        let mut cmd = if mode == "tcp" {
            let mut c = Command::new(bin);
            c.stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            c
        } else {
            let mut env = vec![("SOFTWARP_SOCKETS", "all")];
            if mode == "fallback" {
                env.push(("SOFTWARP_SOCKETS_FALLBACK", "tcp"));
            }
            preloaded(bin, &[], &dir, &env)
        };
        cmd.arg(mode);
        let t0 = Instant::now();
        let out = wait_bounded(cmd.spawn_reaped(), Duration::from_secs(90), mode);
        let text = String::from_utf8_lossy(&out.stdout);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && text.contains("done 0 failures"),
            "{mode}: {:?}\n{text}\n{err}",
            out.status
        );
        for c in checks {
            assert!(
                text.contains(&format!("ok {c} ")),
                "{mode}: {c} did not run\n{text}"
            );
        }
        if mode != "tcp" {
            assert!(text.contains("ok peer_without_mpa "), "{mode}\n{text}");
        }
        eprintln!(
            "{mode}: {} checks passed in {:?}",
            text.matches("ok ").count(),
            t0.elapsed()
        );
    }
}

/// A forking server (`socat TCP-LISTEN:...,fork`): the parent accepts and forks, the child
/// serves the connection. The MPA exchange of an accepted connection is deferred to its
/// first use, so it runs in the child, with a device of the child's own.
#[test]
fn a_forking_server_serves_each_connection_in_its_child() {
    if !require(tool("socat").package("socat")) {
        return;
    }
    let dir = work_dir("socat-fork");
    let port = free_port();
    let server = preloaded(
        "socat",
        &[&format!("TCP-LISTEN:{port},reuseaddr,fork"), "PIPE"],
        &dir,
        &ALL,
    )
    .spawn_reaped();
    let server_pid = server.id();
    let mut clients = Vec::new();
    for i in 0..3 {
        let data = pattern(100_000 + i * 777, 10 + i as u32);
        std::fs::write(dir.join(format!("in{i}.bin")), &data).unwrap();
        let out = run_client(
            || {
                preloaded(
                    "socat",
                    &[
                        "-t",
                        "5",
                        &format!("OPEN:in{i}.bin!!OPEN:out{i}.bin,creat,trunc"),
                        &format!("TCP:127.0.0.1:{port}"),
                    ],
                    &dir,
                    &ALL,
                )
            },
            "socat client of the forking server",
        );
        assert!(
            out.status.success(),
            "client {i}: {:?}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let got = std::fs::read(dir.join(format!("out{i}.bin"))).unwrap();
        assert_eq!(got.len(), data.len(), "client {i}: echo length");
        assert_eq!(crc32c::crc32c(&got), crc32c::crc32c(&data), "client {i}");
        assert_eq!(
            stream_stats(&out.stderr).len(),
            1,
            "client {i} went over iWARP"
        );
        clients.push(out);
    }
    let _ = Command::new("kill")
        .args(["-TERM", &server_pid.to_string()])
        .status();
    let server = wait_bounded(server, Duration::from_secs(30), "forking socat server");
    let err = String::from_utf8_lossy(&server.stderr);
    // Each connection's stream was set up and closed by a child, none by the parent.
    let children: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("closed iWARP stream"))
        .collect();
    assert_eq!(children.len(), 3, "{err}");
    assert!(
        children
            .iter()
            .all(|l| !l.contains(&format!("pid {server_pid} "))),
        "{err}"
    );
    assert!(!err.contains("Input/output error"), "{err}");
}

/// `curl` (non-blocking connect, poll, `SO_ERROR`) fetching a file from Python's
/// `http.server` (threads), both preloaded: the bytes arrive intact and over iWARP.
#[test]
fn curl_fetches_from_python_http_server_over_iwarp() {
    if !require([
        tool("curl").package("curl"),
        tool("python3").package("python3"),
    ]) {
        return;
    }
    let dir = work_dir("curl-http");
    let data = pattern((2 << 20) + 99, 7);
    std::fs::write(dir.join("file.bin"), &data).unwrap();
    let port = free_port().to_string();
    let mut server = preloaded(
        "python3",
        &["-m", "http.server", &port, "--bind", "127.0.0.1"],
        &dir,
        &[("SOFTWARP_SOCKETS", "all")],
    )
    .spawn_reaped();
    let url = format!("http://127.0.0.1:{port}/file.bin");
    let deadline = Instant::now() + Duration::from_secs(30);
    let out = loop {
        let out = wait_bounded(
            preloaded("curl", &["-sS", "-o", "got.bin", &url], &dir, &ALL).spawn_reaped(),
            Duration::from_secs(60),
            "curl",
        );
        // 7: could not connect (the server does not listen yet).
        if out.status.code() != Some(7) || Instant::now() > deadline {
            break out;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = server.kill();
    let server = server.take().wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "curl {:?}: {}\nserver: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&server.stderr)
    );
    let got = std::fs::read(dir.join("got.bin")).unwrap();
    assert_eq!(got.len(), data.len());
    assert_eq!(crc32c::crc32c(&got), crc32c::crc32c(&data));
    let streams = stream_stats(&out.stderr);
    assert!(
        streams.len() == 1 && streams[0].1 >= data.len() as u64,
        "curl's stream: {streams:?}"
    );
}

/// The `result ...` line of `stalled_peers` as (key, value) pairs.
fn result_fields(stdout: &str) -> std::collections::HashMap<String, f64> {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("result "))
        .unwrap_or_else(|| panic!("no result line in:\n{stdout}"));
    let words: Vec<&str> = line.split_whitespace().skip(1).collect();
    words
        .chunks(2)
        .filter_map(|kv| {
            let v = kv.get(1)?;
            let v = match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).ok()? as f64,
                None => v.parse().ok()?,
            };
            Some((kv[0].to_string(), v))
        })
        .collect()
}

/// The first line of `child`'s stdout within 10 s (the child keeps running), and a thread
/// that reads the rest of it (until the child ends).
fn first_line(child: &mut Reaped) -> (String, std::thread::JoinHandle<String>) {
    use std::io::BufRead;
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut r = std::io::BufReader::new(out);
        let mut line = String::new();
        let _ = r.read_line(&mut line);
        let _ = tx.send((line, r));
    });
    let (line, rest) = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the program printed its first line");
    let rest = std::thread::spawn(move || {
        let mut rest = rest;
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut rest, &mut s);
        s
    });
    (line, rest)
}

/// How a stalled peer stalls its MPA exchange.
#[derive(Clone, Copy, Debug)]
enum Stall {
    /// Connects and sends nothing.
    Silent,
    /// Sends one byte of a Request.
    OneByte,
    /// Sends a Request's header announcing 100 bytes of private data, and 10 of them.
    PartialRequest,
}

fn stalled_client(addr: std::net::SocketAddr, how: Stall) -> std::net::TcpStream {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let key = softwarp_wire::mpa::frame::KEY_REQUEST;
    match how {
        Stall::Silent => {}
        Stall::OneByte => s.write_all(&key[..1]).unwrap(),
        Stall::PartialRequest => {
            let mut req = key.to_vec();
            req.extend_from_slice(&[0x40, 1, 0, 100]);
            req.extend_from_slice(&[0u8; 10]);
            s.write_all(&req).unwrap();
        }
    }
    s
}

/// A preloaded non-blocking server (`tests/c/stalled_peers.c`) whose event loop calls only
/// `poll`/`epoll_wait` with timeout 0, `accept4` and non-blocking `recv`/`send`, while 27
/// clients stall their MPA exchange (silent, 1 byte, half a Request) and 4 iWARP clients
/// connect behind them: no call takes 100 ms (before, a zero-timeout `poll` ran the whole
/// exchange of a readable accepted socket: 5 s per stalled client), the good clients are
/// echoed at once, and each stalled connection fails with `ECONNRESET` after the connect
/// timeout (5 s), reported by `poll`/`epoll` without a busy loop (no readiness without
/// bytes behind it). The stalled connections get no QP and buffers (1 MiB each) before
/// their Request is in: the server's memory stays flat.
#[test]
fn a_nonblocking_server_never_waits_for_a_stalled_mpa_exchange() {
    const STALLED: usize = 27;
    if !require(tool("cc").package("gcc")) {
        return;
    }
    let dir = work_dir("stalled-peers-server");
    let bin = compile_c("stalled_peers", &dir);
    let bin = bin.to_str().unwrap();
    let stalls = [Stall::Silent, Stall::OneByte, Stall::PartialRequest];
    for mode in ["poll", "epoll"] {
        let mut server = preloaded(
            bin,
            &["serve", mode, "15", "4", &STALLED.to_string()],
            &dir,
            &[("SOFTWARP_SOCKETS", "all")],
        )
        .spawn_reaped();
        let (line, rest) = first_line(&mut server);
        let port: u16 = line
            .strip_prefix("port ")
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("{mode}: no port in {line:?}"));
        let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
        let rss_before = rss_kib(server.id());
        let stalled: Vec<_> = (0..STALLED)
            .map(|i| stalled_client(addr, stalls[i % 3]))
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        let grown = rss_kib(server.id()).saturating_sub(rss_before);
        let mut took = Vec::new();
        for i in 0..4u8 {
            use std::io::{Read, Write};
            let t0 = Instant::now();
            let mut c = softwarp_sockets::IwarpStream::connect_iwarp(addr)
                .unwrap_or_else(|e| panic!("{mode}: good client {i}: {e}"));
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            c.write_all(&[b'p', i]).unwrap();
            let mut echo = [0u8; 2];
            c.read_exact(&mut echo)
                .unwrap_or_else(|e| panic!("{mode}: good client {i}'s echo: {e}"));
            assert_eq!(echo, [b'p', i], "{mode}");
            took.push(t0.elapsed());
        }
        let out = wait_bounded(server, Duration::from_secs(30), mode);
        drop(stalled);
        let text = rest.join().unwrap();
        assert!(out.status.success(), "{mode}: {:?}", out.status);
        let f = result_fields(&text);
        eprintln!(
            "{mode}: good clients served in {took:?}; RSS +{grown} KiB with {STALLED} \
             stalled connections; {}",
            text.trim()
        );
        assert_eq!(f["slow"], 0.0, "{mode}: calls of 100 ms or more: {text}");
        assert!(f["max_ms"] < 100.0, "{mode}: {text}");
        assert_eq!(f["served"], 4.0, "{mode}: {text}");
        assert!(
            took.iter().all(|t| *t < Duration::from_secs(2)),
            "{mode}: good clients waited: {took:?}"
        );
        assert_eq!(
            f["resets"], STALLED as f64,
            "{mode}: stalled connections reset: {text}"
        );
        assert!(
            grown < 4096,
            "{mode}: the server grew {grown} KiB with {STALLED} stalled connections"
        );
        assert_eq!(f["others"] + f["eofs"], 0.0, "{mode}: {text}");
        let (first, last) = (f["first_reset_ms"], f["last_reset_ms"]);
        assert!(
            (4500.0..9000.0).contains(&first) && last < 9000.0,
            "{mode}: the stalled exchanges fail after the connect timeout (5 s): {text}"
        );
        assert!(
            f["spurious"] < 10.0,
            "{mode}: readiness without bytes: {text}"
        );
    }
}

/// The resident memory of process `pid` in KiB (`VmRSS`).
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status"))
}

/// A raw TCP peer for the initiator: accepts one connection, then sends nothing
/// (`reply` empty) or reads the MPA Request and sends `reply`, and holds the connection
/// until the test ends (bounded: 20 s).
fn stalling_acceptor(reply: &'static [u8]) -> (u16, std::sync::mpsc::Sender<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut s, _) = l.accept().unwrap();
        if !reply.is_empty() {
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut req = [0u8; 64];
            let _ = s.read(&mut req);
            s.write_all(reply).unwrap();
        }
        let _ = done_rx.recv_timeout(Duration::from_secs(20));
    });
    (port, done_tx)
}

/// A preloaded non-blocking `connect` to a peer that accepts TCP and then sends nothing,
/// or part of an MPA Reply: `poll`/`epoll_wait` with timeout 0, a second `connect` and
/// `getsockopt(SO_ERROR)` return at once (before, the first zero-timeout `poll` after the
/// TCP handshake ran the whole exchange: 5 s), and the socket is reported ready (error)
/// after the connect timeout, `SO_ERROR` `ECONNREFUSED`.
#[test]
fn a_nonblocking_connect_never_waits_for_a_stalled_mpa_exchange() {
    if !require(tool("cc").package("gcc")) {
        return;
    }
    let dir = work_dir("stalled-peers-client");
    let bin = compile_c("stalled_peers", &dir);
    let bin = bin.to_str().unwrap();
    let partial_reply: &'static [u8] = b"MPA ID Rep Fr";
    for (what, reply) in [("silent", &b""[..]), ("partial Reply", partial_reply)] {
        for mode in ["poll", "epoll"] {
            let (port, done) = stalling_acceptor(reply);
            let client = preloaded(
                bin,
                &["connect", &port.to_string(), mode, "15"],
                &dir,
                &[("SOFTWARP_SOCKETS", "all")],
            )
            .spawn_reaped();
            let out = wait_bounded(client, Duration::from_secs(30), what);
            drop(done);
            let text = String::from_utf8_lossy(&out.stdout);
            eprintln!("{what}, {mode}: {}", text.trim());
            let f = result_fields(&text);
            assert_eq!(f["slow"], 0.0, "{what}, {mode}: {text}");
            assert!(f["max_ms"] < 100.0, "{what}, {mode}: {text}");
            assert!(
                (4500.0..9000.0).contains(&f["ready_ms"]),
                "{what}, {mode}: reported when the exchange failed: {text}"
            );
            assert_eq!(
                f["so_error"],
                f64::from(libc::ECONNREFUSED),
                "{what}, {mode}: {text}"
            );
        }
    }
}
