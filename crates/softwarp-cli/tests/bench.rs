//! `softwarp bench` runs every shape for a few iterations, in every mode and role, and its
//! JSON output parses and holds the expected results. No timing is asserted: these runs
//! prove the tool works, not how fast anything is.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn softwarp(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_softwarp"))
        .arg("bench")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The port a `-R -s ... -p 0` server prints on its first line of stderr.
fn listening_port(server: &mut Child) -> String {
    port_after(server, "server listening on 127.0.0.1:")
}

/// The port that follows `marker` on a server's first line of stderr.
fn port_after(server: &mut Child, marker: &str) -> String {
    let mut line = String::new();
    let stderr = server.stderr.take().unwrap();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stderr), &mut line).unwrap();
    line.split(marker)
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no port in {line:?}"))
        .to_string()
}

fn finish(mut child: Child, limit: Duration) -> Output {
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "softwarp bench did not finish within {limit:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "exit {}: {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn json(args: &[&str]) -> serde_json::Value {
    let mut all = args.to_vec();
    all.push("--json");
    let out = finish(softwarp(&all), Duration::from_secs(120));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

fn results(v: &serde_json::Value) -> &Vec<serde_json::Value> {
    v["results"].as_array().unwrap()
}

fn shapes(v: &serde_json::Value) -> Vec<String> {
    results(v)
        .iter()
        .map(|r| r["shape"].as_str().unwrap().to_string())
        .collect()
}

/// Every figure a row should have is a positive number, for both stacks.
fn assert_measured(r: &serde_json::Value, with_tcp: bool) {
    let kind = r["kind"].as_str().unwrap();
    let key = if kind == "bw" { "gbit_per_s" } else { "lat_us" };
    assert!(r["softwarp"][key].as_f64().unwrap() > 0.0, "{r}");
    if with_tcp {
        assert!(r["tcp"][key].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["ratio"].as_f64().unwrap() > 0.0, "{r}");
    } else {
        assert!(r["tcp"].is_null() && r["ratio"].is_null(), "{r}");
    }
}

#[test]
fn every_shape_runs_in_busy_mode_with_the_tcp_baseline_and_prints_json() {
    let v = json(&["all", "-S", "64,5000", "-n", "20", "-t", "8"]);
    assert_eq!(v["tool"], "softwarp bench");
    assert_eq!(v["config"]["mode"], "busy");
    let names = shapes(&v);
    for s in [
        "write_bw",
        "send_bw",
        "read_bw",
        "write_lat",
        "send_lat",
        "read_lat",
    ] {
        assert_eq!(
            names.iter().filter(|n| *n == s).count(),
            2,
            "{s} at two sizes: {names:?}"
        );
    }
    for r in results(&v) {
        assert_measured(r, true);
        assert_eq!(r["iters"], 20);
    }
}

#[test]
fn spin_and_event_modes_run_bidirectional_bandwidth_without_crc() {
    for mode in ["spin", "event"] {
        let v = json(&[
            "write_bw,send_bw,read_bw,send_lat,read_lat",
            "-S",
            "4K",
            "-n",
            "30",
            "-b",
            "--crc",
            "off",
            "--mode",
            mode,
            "--no-tcp",
            "-l",
            "4",
        ]);
        assert_eq!(shapes(&v).len(), 5, "{v}");
        for r in results(&v) {
            assert_measured(r, false);
            assert_eq!(r["crc"], false);
            assert_eq!(r["mode"], mode);
        }
    }
}

#[test]
fn write_lat_is_skipped_in_event_mode_with_a_note() {
    let v = json(&["write_lat", "-n", "5", "--mode", "event"]);
    assert!(results(&v).is_empty());
    assert!(v["notes"][0].as_str().unwrap().contains("write_lat"));
}

#[test]
fn repeated_runs_report_every_run_and_the_median() {
    let v = json(&["send_bw", "-S", "1K", "-n", "50", "-r", "3", "-t", "4"]);
    let r = &results(&v)[0];
    assert_eq!(r["runs"], 3);
    assert_eq!(r["softwarp"]["run_secs"].as_array().unwrap().len(), 3);
    assert_eq!(r["tcp"]["run_secs"].as_array().unwrap().len(), 3);
}

#[test]
fn qp_mem_is_refused_by_softwarp_bench_which_has_no_counting_allocator() {
    // The counting allocator lives only in the softwarp-bench program (its tests run
    // qp_mem); the softwarp command runs on the system allocator and says where to go.
    let out = softwarp(&["qp_mem", "--qps", "4"]).wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("run `softwarp-bench qp_mem`"), "{err}");
}

#[test]
fn a_server_process_and_a_client_process_run_a_session() {
    // The server takes three free ports and says which; the client needs the first.
    let mut server = softwarp(&["-s", "--bind", "127.0.0.1", "-p", "0"]);
    let port = port_after(&mut server, "waiting for a client on 127.0.0.1:");
    let client = softwarp(&[
        "write_bw,send_lat",
        "127.0.0.1",
        "-p",
        &port,
        "-S",
        "2K",
        "-n",
        "10",
        "--json",
    ]);
    let out = finish(client, Duration::from_secs(120));
    finish(server, Duration::from_secs(30));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["config"]["role"], "client");
    assert_eq!(shapes(&v), vec!["write_bw", "send_lat"]);
    for r in results(&v) {
        assert_measured(r, true);
    }
}

#[test]
fn the_table_names_every_shape_and_the_ratio_column() {
    let out = finish(
        softwarp(&["write_bw,read_lat", "-S", "128", "-n", "10"]),
        Duration::from_secs(120),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("softwarp bench: loopback"), "{text}");
    assert!(text.contains("ratio"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("write_bw")), "{text}");
    assert!(text.lines().any(|l| l.starts_with("read_lat")), "{text}");
}

// ---------------------------------------------------------------------------------------
// -R: perftest's rdma_cm exchange (our client against our server; the interop with Linux
// siw's perftest is interop/run-siw-perftest.sh)
// ---------------------------------------------------------------------------------------

#[test]
fn perftest_exchange_runs_every_shape_on_loopback_and_prints_json() {
    for (shape, size) in [
        ("write_bw", "4096"),
        ("read_bw", "4096"),
        ("send_bw", "2000"),
        ("write_lat", "8"),
        ("send_lat", "3000"),
        ("read_lat", "64"),
    ] {
        let v = json(&[
            "-R",
            shape,
            "-S",
            size,
            "-n",
            "50",
            "-t",
            "16",
            "--rx-depth",
            "12",
        ]);
        assert_eq!(v["config"]["role"], "loopback", "{shape}");
        assert_eq!(v["config"]["mode"], "spin", "{shape}");
        assert_eq!(shapes(&v), vec![shape]);
        let r = &results(&v)[0];
        assert_measured(r, false);
        assert_eq!(r["iters"], 50);
        assert_eq!(r["size"].as_u64().unwrap().to_string(), size);
        let notes: Vec<&str> = v["notes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap())
            .collect();
        assert!(
            notes.iter().any(|n| n.contains("no raw TCP baseline")),
            "{notes:?}"
        );
        assert!(
            notes
                .iter()
                .any(|n| n.contains("peer perftest version 6.06")),
            "{notes:?}"
        );
        if shape.starts_with("read") {
            assert!(
                notes.iter().any(|n| n.contains("IRD/ORD 128/128")),
                "Read shapes negotiate out_reads: {notes:?}"
            );
        }
        if shape == "write_bw" || shape == "read_bw" {
            // perftest's report went across: the server printed the client's figures.
            assert!(
                notes
                    .iter()
                    .any(|n| n.contains("the client's report: 4096 B x 50")),
                "{notes:?}"
            );
        }
    }
}

#[test]
fn perftest_exchange_runs_between_a_server_process_and_a_client_process() {
    // write_lat: perftest's server writes first, so the server process drives the data QP
    // first; both processes report figures.
    let mut server = softwarp(&[
        "-R",
        "-s",
        "write_lat",
        "--bind",
        "127.0.0.1",
        "-p",
        "0",
        "-S",
        "1500",
        "-n",
        "30",
        "--json",
    ]);
    let port = listening_port(&mut server);
    let client = softwarp(&[
        "-R",
        "write_lat",
        "127.0.0.1",
        "-p",
        &port,
        "-S",
        "1500",
        "-n",
        "30",
        "--crc",
        "off",
        "--json",
    ]);
    let out = finish(client, Duration::from_secs(60));
    let sout = finish(server, Duration::from_secs(30));
    for (role, o) in [("client", &out), ("server", &sout)] {
        let v: serde_json::Value =
            serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{role}: not JSON ({e})"));
        assert_eq!(v["config"]["role"], role);
        assert_eq!(shapes(&v), vec!["write_lat"]);
        assert_measured(&results(&v)[0], false);
    }
}

/// The sizes of the rows, in order.
fn sizes(v: &serde_json::Value) -> Vec<u64> {
    results(v)
        .iter()
        .map(|r| r["size"].as_u64().unwrap())
        .collect()
}

/// 2, 4, ... `max`.
fn powers_of_two_to(max: u64) -> Vec<u64> {
    (1..64)
        .map(|k| 1u64 << k)
        .take_while(|&s| s <= max)
        .collect()
}

#[test]
fn perftest_exchange_runs_every_shape_with_all_sizes_on_loopback() {
    // -a on one pair of connections, capped at 4 KiB (perftest goes to 8 MiB): one row per
    // size, in order, each with the iterations of -n. The passive server's figures are in
    // the notes (write_bw/read_bw: the client's report of the last size only).
    for shape in [
        "send_bw",
        "write_bw",
        "read_bw",
        "send_lat",
        "write_lat",
        "read_lat",
    ] {
        let v = json(&[
            "-R",
            shape,
            "-a",
            "-S",
            "4K",
            "-n",
            "6",
            "-t",
            "4",
            "--rx-depth",
            "6",
        ]);
        assert_eq!(shapes(&v).len(), 12, "{shape}: {v}");
        assert!(shapes(&v).iter().all(|s| s == shape), "{v}");
        assert_eq!(sizes(&v), powers_of_two_to(4096), "{shape}");
        for r in results(&v) {
            assert_measured(r, false);
            assert_eq!(r["iters"], 6, "{r}");
        }
        let notes = v["notes"].to_string();
        assert!(notes.contains(&format!("{shape} -a up to 4K")), "{notes}");
        if shape == "write_bw" || shape == "read_bw" {
            assert!(notes.contains("the client's report: 4096 B x 6"), "{notes}");
        }
    }
}

#[test]
fn perftest_exchange_runs_all_sizes_between_a_server_process_and_a_client_process() {
    // send_bw: a handshake before and after every size, the credit word zeroed per size;
    // write_bw: no exchange between sizes, and the server reports the client's last size.
    for (shape, server_rows) in [("send_bw", 14usize), ("write_bw", 1)] {
        let mut server = softwarp(&[
            "-R",
            "-s",
            shape,
            "--bind",
            "127.0.0.1",
            "-p",
            "0",
            "-a",
            "-S",
            "16K",
            "-n",
            "20",
            "--rx-depth",
            "9",
            "--json",
        ]);
        let port = listening_port(&mut server);
        let client = softwarp(&[
            "-R",
            shape,
            "127.0.0.1",
            "-p",
            &port,
            "-a",
            "-S",
            "16K",
            "-n",
            "20",
            "--rx-depth",
            "9",
            "--crc",
            "off",
            "--json",
        ]);
        let out = finish(client, Duration::from_secs(60));
        let sout = finish(server, Duration::from_secs(30));
        let c: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let s: serde_json::Value = serde_json::from_slice(&sout.stdout).unwrap();
        assert_eq!(sizes(&c), powers_of_two_to(16384), "{shape} client");
        let want = powers_of_two_to(16384);
        assert_eq!(
            sizes(&s),
            want[want.len() - server_rows..].to_vec(),
            "{shape} server"
        );
        for r in results(&c).iter().chain(results(&s)) {
            assert_measured(r, false);
            assert_eq!(r["iters"], 20, "{r}");
        }
    }
}

#[test]
fn perftest_exchange_runs_the_bandwidth_shapes_bidirectionally() {
    // -b: both sides post and the two exchange their reports; the row adds both
    // directions up. Once at one size, once with -a (capped at 8 KiB).
    for shape in ["send_bw", "write_bw", "read_bw"] {
        for all in [false, true] {
            let mut args = vec!["-R", shape, "-b", "-n", "40", "-t", "8", "--rx-depth", "12"];
            if all {
                args.extend(["-a", "-S", "8K"]);
            } else {
                args.extend(["-S", "3K"]);
            }
            let v = json(&args);
            assert_eq!(v["config"]["bidirectional"], true, "{v}");
            assert!(
                results(&v).iter().all(|r| r["bidirectional"] == true),
                "{v}"
            );
            let want = if all {
                powers_of_two_to(8192)
            } else {
                vec![3072]
            };
            assert_eq!(sizes(&v), want, "{shape} all={all}");
            for r in results(&v) {
                assert_measured(r, false);
                assert_eq!(r["iters"], 40, "{r}");
            }
        }
    }
}

#[test]
fn perftest_exchange_refuses_what_perftest_cannot_express() {
    for args in [
        &["-R", "-s"][..],
        &["-R", "-s", "write_bw,read_bw"],
        &["-R", "write_bw", "127.0.0.1", "-S", "1K,2K"],
        &["-R", "qp_mem"],
        &["-R", "send_lat", "-b"],
        &["-R", "write_lat", "-b", "-a"],
        &["-R", "send_bw", "--mode", "event"],
        &["-R", "send_bw", "-a", "-S", "1K,2K"],
        &["-R", "send_bw", "-a", "-S", "3000"],
        &["-R", "write_bw", "-a", "--runs", "2"],
    ] {
        let out = softwarp(args).wait_with_output().unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(
            !String::from_utf8_lossy(&out.stderr).contains("panicked"),
            "{args:?}"
        );
    }
}

#[test]
fn a_perftest_server_answers_a_malformed_version_with_a_typed_error() {
    use softwarp::{
        AccessFlags, CmEventChannel, ConnectOptions, Device, Payload, QpInitAttr, RecvWr, SendOp,
        SendWr, SgList,
    };
    use std::io::Read;
    let mut server = softwarp(&[
        "-R",
        "-s",
        "write_bw",
        "--bind",
        "127.0.0.1",
        "-p",
        "0",
        "-S",
        "64",
        "-n",
        "5",
        "--accept-timeout",
        "20",
    ]);
    let mut stderr = std::io::BufReader::new(server.stderr.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stderr, &mut line).unwrap();
    let addr: std::net::SocketAddr = line
        .split("server listening on ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .parse()
        .unwrap();
    // A peer that connects the control QP like perftest and then sends a version message
    // that is not one.
    let dev = Device::open_default().unwrap();
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(16, None).unwrap();
    let qp = pd.create_qp(&QpInitAttr::new(&cq, &cq)).unwrap();
    // The server answers with its own version before it looks at ours.
    let buf = pd.reg_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    qp.post_recv(&RecvWr {
        wr_id: 0,
        sgl: SgList::single(buf.sge(0, 64).unwrap()),
    })
    .unwrap();
    let ch = CmEventChannel::new().unwrap();
    let (_id, _) = ch
        .connect_blocking(&qp, addr, &ConnectOptions::default())
        .unwrap();
    qp.post_send(&SendWr {
        wr_id: 1,
        op: SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        payload: Payload::Inline(b"6.0six\0\0\0\0\0\0\0\0\0\0"),
        signaled: true,
        fence: false,
    })
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = server.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the server did not give up");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut rest = String::new();
    stderr.read_to_string(&mut rest).unwrap();
    assert!(!status.success(), "accepted a malformed version: {rest}");
    assert!(
        rest.contains("perftest version: not a version string"),
        "{rest}"
    );
    assert!(!rest.contains("panicked"), "{rest}");
    drop((qp, buf, cq, pd));
}
