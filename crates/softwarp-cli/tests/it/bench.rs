//! `softwarp bench` runs every shape for a few iterations, in every mode and role, with
//! perftest's flags, and its JSON output reads back (serde, into softwarp-bench's
//! `Document`) with the expected results. No timing is asserted: these runs prove the tool
//! works, not how fast anything is.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use softwarp_bench::report::{Document, ResultRow};

fn softwarp(args: &[&str]) -> Child {
    crate::softwarp()
        .arg("bench")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The port a `-R SHAPE -p 0` server (no peer) prints on its first line of stderr.
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

fn json(args: &[&str]) -> Document {
    let mut all = args.to_vec();
    all.push("--json");
    let out = finish(softwarp(&all), Duration::from_secs(120));
    parse(&out.stdout)
}

/// The JSON document, read back into softwarp-bench's own types.
fn parse(stdout: &[u8]) -> Document {
    serde_json::from_slice(stdout).unwrap_or_else(|e| {
        panic!(
            "not a bench document ({e}): {}",
            String::from_utf8_lossy(stdout)
        )
    })
}

fn results(v: &Document) -> &Vec<ResultRow> {
    &v.results
}

fn shapes(v: &Document) -> Vec<String> {
    v.results.iter().map(|r| r.shape.clone()).collect()
}

/// Every figure a row should have is a positive number, for both stacks, and a latency
/// row has its distribution in order: min <= typical <= p99 <= p99.9 <= max.
fn assert_measured(r: &ResultRow, with_tcp: bool) {
    let stacks: Vec<_> = if with_tcp {
        assert!(r.ratio.unwrap() > 0.0, "{r:?}");
        vec![r.softwarp.as_ref().unwrap(), r.tcp.as_ref().unwrap()]
    } else {
        assert!(r.tcp.is_none() && r.ratio.is_none(), "{r:?}");
        vec![r.softwarp.as_ref().unwrap()]
    };
    for s in stacks {
        let f = &s.figures;
        if r.kind == "bw" {
            assert!(f.gbit_per_s > 0.0 && f.mb_per_s > 0.0, "{r:?}");
        } else {
            assert!(f.lat_us > 0.0, "{r:?}");
            let (p99_9, max) = (f.lat_p99_9_us.unwrap(), f.lat_max_us.unwrap());
            assert!(f.lat_stdev_us.unwrap() >= 0.0, "{r:?}");
            assert!(
                f.lat_min_us <= f.lat_us
                    && f.lat_us <= f.lat_p99_us
                    && f.lat_p99_us <= p99_9
                    && p99_9 <= max,
                "{r:?}"
            );
        }
    }
}

#[test]
fn every_shape_runs_in_busy_mode_with_the_tcp_baseline_and_prints_json() {
    let v = json(&["all", "--loopback", "-s", "64,5000", "-n", "20", "-t", "8"]);
    assert_eq!(v.tool, "softwarp bench");
    assert_eq!(v.config.mode, softwarp_bench::Mode::Busy);
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
        assert_eq!(r.iters, 20);
    }
}

/// `ucx_perftest` on `PATH` (Debian: ucx-utils), or why the UCX test skips (a failure under
/// `CI=true`).
fn ucx_perftest() -> Option<std::path::PathBuf> {
    let found = softwarp_bench::ucx::find();
    if found.is_none() {
        softwarp_testkit::skip("`ucx_perftest` is not installed (apt-get install ucx-utils)");
    }
    found
}

#[test]
fn ucx_runs_beside_the_write_and_send_shapes_and_reads_get_a_note() {
    if ucx_perftest().is_none() {
        return;
    }
    let v = json(&[
        "write_bw,send_bw,read_bw,write_lat,send_lat",
        "--loopback",
        "-s",
        "4K",
        "-n",
        "200",
        "--runs",
        "2",
        "--ucx",
    ]);
    for r in results(&v) {
        assert_measured(r, true);
        let expect = match r.shape.as_str() {
            "write_bw" => Some("put_bw (UCT tcp/lo, zcopy)"),
            "write_lat" => Some("put_lat (UCT tcp/lo, zcopy)"),
            "send_bw" => Some("tag_bw (UCP over tcp/lo)"),
            "send_lat" => Some("tag_lat (UCP over tcp/lo)"),
            _ => None,
        };
        match (expect, &r.ucx) {
            (None, None) => {}
            (Some(test), Some(u)) => {
                assert_eq!(u.test, test, "{r:?}");
                assert_eq!(u.runs.len(), 2, "one UCX run per --runs: {r:?}");
                assert!(u.runs.iter().all(|x| x.iters == 200), "{r:?}");
                if r.kind == "bw" {
                    assert!(u.median.mb_per_s > 0.0, "{r:?}");
                } else {
                    assert!(u.median.lat_typical_us > 0.0, "{r:?}");
                }
                assert!(u.ratio.unwrap() > 0.0, "{r:?}");
            }
            other => panic!("{}: UCX {other:?}", r.shape),
        }
    }
    assert!(
        v.notes
            .iter()
            .any(|n| n.contains("read_bw has no UCX counterpart")),
        "{:?}",
        v.notes
    );
}

#[test]
fn ucx_is_refused_politely_outside_loopback_and_with_bidirectional_runs() {
    let v = json(&[
        "write_bw",
        "--loopback",
        "-s",
        "4K",
        "-n",
        "20",
        "-b",
        "--ucx",
    ]);
    assert!(results(&v).iter().all(|r| r.ucx.is_none()));
    assert!(
        v.notes.iter().any(|n| n.contains("no UCX rows with -b")),
        "{:?}",
        v.notes
    );
}

#[test]
fn spin_and_event_modes_run_bidirectional_bandwidth_without_crc() {
    for mode in ["spin", "event"] {
        let v = json(&[
            "write_bw,send_bw,read_bw,send_lat,read_lat",
            "--loopback",
            "-s",
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
        assert_eq!(shapes(&v).len(), 5, "{v:?}");
        for r in results(&v) {
            assert_measured(r, false);
            assert!(!r.crc);
            assert_eq!(r.mode.name(), mode);
        }
    }
}

#[test]
fn write_lat_is_skipped_in_event_mode_with_a_note() {
    // -e is perftest's spelling of the event mode.
    let v = json(&["write_lat", "--loopback", "-n", "5", "-e"]);
    assert!(results(&v).is_empty());
    assert_eq!(v.config.mode, softwarp_bench::Mode::Event);
    assert!(v.notes[0].contains("write_lat"));
}

#[test]
fn repeated_runs_report_every_run_and_the_median() {
    let v = json(&[
        "send_bw",
        "--loopback",
        "-s",
        "1K",
        "-n",
        "50",
        "--runs",
        "3",
        "-t",
        "4",
    ]);
    let r = &results(&v)[0];
    assert_eq!(r.runs, 3);
    assert_eq!(r.softwarp.as_ref().unwrap().run_secs.len(), 3);
    assert_eq!(r.tcp.as_ref().unwrap().run_secs.len(), 3);
}

#[test]
fn qp_mem_is_refused_by_softwarp_bench_which_has_no_counting_allocator() {
    // The counting allocator lives only in the softwarp-bench program (its tests run
    // qp_mem); the softwarp command runs on the system allocator and says where to go.
    let out = softwarp(&["qp_mem", "-q", "4"]).wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("run `softwarp-bench qp_mem`"), "{err}");
}

#[test]
fn a_server_process_and_a_client_process_run_a_session() {
    // No peer: the server (as perftest). It takes three free ports and says which; the
    // client needs the first.
    let mut server = softwarp(&["--bind", "127.0.0.1", "-p", "0"]);
    let port = port_after(&mut server, "waiting for a client on 127.0.0.1:");
    let client = softwarp(&[
        "write_bw,send_lat",
        "127.0.0.1",
        "-p",
        &port,
        "-s",
        "2K",
        "-n",
        "10",
        "--json",
    ]);
    let out = finish(client, Duration::from_secs(120));
    finish(server, Duration::from_secs(30));
    let v = parse(&out.stdout);
    assert_eq!(v.config.role, "client");
    assert_eq!(shapes(&v), vec!["write_bw", "send_lat"]);
    for r in results(&v) {
        assert_measured(r, true);
    }
}

#[test]
fn the_table_names_every_shape_and_the_ratio_column() {
    let out = finish(
        softwarp(&["write_bw,read_lat", "--loopback", "-s", "128", "-n", "10"]),
        Duration::from_secs(120),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("softwarp bench: loopback"), "{text}");
    assert!(text.contains("ratio"), "{text}");
    // perftest's MB/s unless --report_gbits.
    let bw = text.lines().find(|l| l.starts_with("write_bw")).unwrap();
    assert!(bw.contains(" MB/s") && !bw.contains("Gbit/s"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("read_lat")), "{text}");
    // The latency distribution of both stacks, under the row.
    for stack in ["softwarp", "raw TCP"] {
        let l = text
            .lines()
            .find(|l| l.trim_start().starts_with(stack) && l.contains("p99.9"))
            .unwrap_or_else(|| panic!("no {stack} distribution: {text}"));
        for w in ["min ", "typical ", "stdev ", "p99 ", "p99.9 ", "max "] {
            assert!(l.contains(w), "{w}: {l}");
        }
    }
}

#[test]
fn perftest_flags_size_duration_qp_device_gbits_and_cpu_freq_are_taken() {
    let out = finish(
        softwarp(&[
            "write_bw,send_lat",
            "--loopback",
            "-s",
            "4K",
            "-D",
            "1",
            "-q",
            "1",
            "-d",
            "softwarp0",
            "--report_gbits",
            "-F",
            "--no-tcp",
        ]),
        Duration::from_secs(120),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let bw = text.lines().find(|l| l.starts_with("write_bw")).unwrap();
    assert!(bw.contains("Gbit/s") && bw.contains("4K"), "{text}");
    assert!(
        text.contains("of about 1 s") && text.contains("device softwarp0"),
        "{text}"
    );
    assert!(!String::from_utf8_lossy(&out.stderr).contains("CPU frequency"));
    let v = json(&["send_lat", "--loopback", "-s", "8", "-D", "1", "--no-tcp"]);
    assert_eq!(v.config.duration_secs, Some(1));
    // The calibration run alone is 250 iterations; a second's worth is more.
    assert!(v.results[0].iters > 250, "{v:?}");
    assert_measured(&v.results[0], false);
}

#[test]
fn old_spellings_are_refused_with_the_new_spelling() {
    for (args, says) in [
        // -s was the server; the server is the side given no peer.
        (&["-s"][..], "-s is the message size now"),
        (&["-s", "-p", "0"], "the side given no peer"),
        (
            &["-R", "-s", "write_lat", "-p", "0"],
            "-s is the message size now",
        ),
        // -S was the size.
        (
            &["write_bw", "--loopback", "-S", "64K"],
            "the size is -s now",
        ),
        // -r was --runs; it is perftest's receive queue depth.
        (
            &["send_bw", "--loopback", "-r", "3"],
            "use --runs (it was -r)",
        ),
        // Shapes and no peer was the loopback; it is the server now.
        (&["write_bw", "-n", "5"], "or --loopback"),
        // Several QPs per latency shape: perftest has none either.
        (&["send_lat", "--loopback", "-q", "4"], "-q 4"),
        (
            &["--loopback", "-d", "mlx5_0"],
            "no Softwarp device \"mlx5_0\"",
        ),
    ] {
        let child = softwarp(args);
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut child = child;
        while child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "{args:?} did not give up");
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

// ---------------------------------------------------------------------------------------
// -R: perftest's rdma_cm exchange (our client against our server; the interop with Linux
// siw's perftest is interop/run-siw-perftest.sh)
// ---------------------------------------------------------------------------------------

#[test]
fn perftest_exchange_runs_every_shape_on_loopback_and_prints_json() {
    // Spinning by default; with --mode busy the CQs are busy-polled, as perftest's under
    // `softwarp exec --busy-poll`, and what a side waits for without polling (the passive
    // end of write_bw and read_bw, write_lat's byte, send_bw's credit word) still arrives,
    // through the progress thread's take-over.
    for (mode, busy) in [
        (softwarp_bench::Mode::Spin, &[][..]),
        (softwarp_bench::Mode::Busy, &["--mode", "busy"]),
    ] {
        for (shape, size) in [
            ("write_bw", "4096"),
            ("read_bw", "4096"),
            ("send_bw", "2000"),
            ("write_lat", "8"),
            ("send_lat", "3000"),
            ("read_lat", "64"),
        ] {
            let mut args = vec![
                "-R",
                shape,
                "--loopback",
                "-s",
                size,
                "-n",
                "50",
                "-t",
                "16",
                "--rx-depth",
                "12",
            ];
            args.extend_from_slice(busy);
            let v = json(&args);
            assert_eq!(v.config.role, "loopback", "{shape}");
            assert_eq!(v.config.mode, mode, "{shape}");
            assert_eq!(shapes(&v), vec![shape]);
            let r = &results(&v)[0];
            assert_eq!(r.mode, mode, "{shape}");
            assert_measured(r, false);
            assert_eq!(r.iters, 50);
            assert_eq!(r.size.to_string(), size);
            let notes: Vec<&str> = v.notes.iter().map(String::as_str).collect();
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
}

#[test]
fn perftest_exchange_runs_between_a_server_process_and_a_client_process() {
    // write_lat: perftest's server writes first, so the server process drives the data QP
    // first; both processes report figures.
    // No peer: the server (perftest's `ib_write_lat -R`).
    let mut server = softwarp(&[
        "-R",
        "write_lat",
        "--bind",
        "127.0.0.1",
        "-p",
        "0",
        "-s",
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
        "-s",
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
        let v = parse(&o.stdout);
        assert_eq!(v.config.role, role);
        assert_eq!(shapes(&v), vec!["write_lat"]);
        assert_measured(&results(&v)[0], false);
    }
}

/// The sizes of the rows, in order.
fn sizes(v: &Document) -> Vec<u64> {
    results(v).iter().map(|r| r.size as u64).collect()
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
            "--loopback",
            "-a",
            "-s",
            "4K",
            "-n",
            "6",
            "-t",
            "4",
            "--rx-depth",
            "6",
        ]);
        assert_eq!(shapes(&v).len(), 12, "{shape}: {v:?}");
        assert!(shapes(&v).iter().all(|s| s == shape), "{v:?}");
        assert_eq!(sizes(&v), powers_of_two_to(4096), "{shape}");
        for r in results(&v) {
            assert_measured(r, false);
            assert_eq!(r.iters, 6, "{r:?}");
        }
        let notes = v.notes.join("\n");
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
            shape,
            "--bind",
            "127.0.0.1",
            "-p",
            "0",
            "-a",
            "-s",
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
            "-s",
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
        let (c, s) = (parse(&out.stdout), parse(&sout.stdout));
        assert_eq!(sizes(&c), powers_of_two_to(16384), "{shape} client");
        let want = powers_of_two_to(16384);
        assert_eq!(
            sizes(&s),
            want[want.len() - server_rows..].to_vec(),
            "{shape} server"
        );
        for r in results(&c).iter().chain(results(&s)) {
            assert_measured(r, false);
            assert_eq!(r.iters, 20, "{r:?}");
        }
    }
}

#[test]
fn perftest_exchange_runs_the_bandwidth_shapes_bidirectionally() {
    // -b: both sides post and the two exchange their reports; the row adds both
    // directions up. Once at one size, once with -a (capped at 8 KiB).
    for shape in ["send_bw", "write_bw", "read_bw"] {
        for all in [false, true] {
            let mut args = vec![
                "-R",
                shape,
                "--loopback",
                "-b",
                "-n",
                "40",
                "-t",
                "8",
                "-r",
                "12",
            ];
            if all {
                args.extend(["-a", "-s", "8K"]);
            } else {
                args.extend(["-s", "3K"]);
            }
            let v = json(&args);
            assert!(v.config.bidirectional, "{v:?}");
            assert!(results(&v).iter().all(|r| r.bidirectional), "{v:?}");
            let want = if all {
                powers_of_two_to(8192)
            } else {
                vec![3072]
            };
            assert_eq!(sizes(&v), want, "{shape} all={all}");
            for r in results(&v) {
                assert_measured(r, false);
                assert_eq!(r.iters, 40, "{r:?}");
            }
        }
    }
}

#[test]
fn perftest_exchange_refuses_what_perftest_cannot_express() {
    for args in [
        &["-R"][..],
        &["-R", "write_bw,read_bw"],
        &["-R", "write_bw", "127.0.0.1", "-s", "1K,2K"],
        &["-R", "qp_mem"],
        &["-R", "send_lat", "--loopback", "-b"],
        &["-R", "write_lat", "--loopback", "-b", "-a"],
        &["-R", "send_bw", "--loopback", "--mode", "event"],
        &["-R", "send_bw", "--loopback", "-a", "-s", "1K,2K"],
        &["-R", "send_bw", "--loopback", "-a", "-s", "3000"],
        &["-R", "write_bw", "--loopback", "-a", "--runs", "2"],
        &["-R", "write_bw", "--loopback", "-D", "2"],
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
        "write_bw",
        "--bind",
        "127.0.0.1",
        "-p",
        "0",
        "-s",
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

/// The bandwidth shapes' rows of a `-q` run: every row ran on `qps` QPs, and every run of
/// both stacks moved `qps` times one QP's bytes (counted by the client as they completed).
fn assert_qps_rows(v: &Document, qps: usize, size: u64, iters: u64) {
    assert_eq!(v.config.qps, qps, "{v:?}");
    assert_eq!(shapes(v), vec!["write_bw", "send_bw", "read_bw"]);
    for r in results(v) {
        assert_measured(r, true);
        assert_eq!((r.qps, r.size as u64, r.iters), (qps, size, iters), "{r:?}");
        for s in [r.softwarp.as_ref().unwrap(), r.tcp.as_ref().unwrap()] {
            assert_eq!(s.run_bytes, vec![qps as u64 * iters * size], "{r:?}");
            // Aggregate message rate: every QP's messages over the one elapsed time.
            let rate = (qps as u64 * iters) as f64 / s.run_secs[0];
            assert!((s.figures.msg_per_s / rate - 1.0).abs() < 1e-6, "{r:?}");
        }
    }
}

#[test]
fn several_qps_per_bandwidth_shape_on_loopback_move_that_many_times_the_bytes() {
    let args = |q: &'static str| {
        vec![
            "write_bw,send_bw,read_bw",
            "--loopback",
            "-s",
            "4K",
            "-n",
            "50",
            "-t",
            "16",
            "-q",
            q,
        ]
    };
    let one = json(&args("1"));
    assert_qps_rows(&one, 1, 4096, 50);
    let four = json(&args("4"));
    assert_qps_rows(&four, 4, 4096, 50);
    for (a, b) in results(&one).iter().zip(results(&four)) {
        for (x, y) in [(&a.softwarp, &b.softwarp), (&a.tcp, &b.tcp)] {
            let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
            assert_eq!(y.run_bytes[0], 4 * x.run_bytes[0], "{a:?} {b:?}");
        }
    }
    // The table says so too.
    let out = finish(
        softwarp(&["write_bw", "--loopback", "-s", "4K", "-n", "20", "-q", "3"]),
        Duration::from_secs(120),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("3 QPs per bandwidth shape"), "{text}");
}

#[test]
fn several_qps_per_bandwidth_shape_between_a_server_and_a_client_process() {
    let mut server = softwarp(&["--bind", "127.0.0.1", "-p", "0"]);
    let port = port_after(&mut server, "waiting for a client on 127.0.0.1:");
    let client = softwarp(&[
        "write_bw,send_bw,read_bw",
        "127.0.0.1",
        "-p",
        &port,
        "-s",
        "4K",
        "-n",
        "50",
        "-t",
        "16",
        "-q",
        "4",
        "--json",
    ]);
    let out = finish(client, Duration::from_secs(120));
    finish(server, Duration::from_secs(30));
    let v = parse(&out.stdout);
    assert_eq!(v.config.role, "client");
    assert_qps_rows(&v, 4, 4096, 50);
}

#[test]
fn a_server_given_another_qp_count_refuses_the_client_with_both_counts() {
    let mut server = softwarp(&["--bind", "127.0.0.1", "-p", "0", "-q", "2"]);
    let port = port_after(&mut server, "waiting for a client on 127.0.0.1:");
    let client = softwarp(&["write_bw", "127.0.0.1", "-p", &port, "-q", "4", "-n", "10"]);
    let c = client.wait_with_output().unwrap();
    let s = server.wait_with_output().unwrap();
    assert!(!c.status.success() && !s.status.success());
    // (The server's stderr went to port_after; the client prints the server's reason.)
    let err = String::from_utf8_lossy(&c.stderr);
    assert!(
        err.contains("mismatched -q") && err.contains("4 QP(s)") && err.contains("-q 2"),
        "{err}"
    );
}

#[test]
fn several_qps_are_refused_for_latency_shapes_and_with_rdma_cm() {
    for (args, says) in [
        (
            &["write_lat", "--loopback", "-q", "4"][..],
            "bandwidth tests only",
        ),
        (
            &["send_lat", "--loopback", "-q", "2"],
            "bandwidth tests only",
        ),
        (&["write_bw,read_lat", "--loopback", "-q", "2"], "read_lat"),
        (&["all", "--loopback", "-q", "2"], "bandwidth tests only"),
        (&["write_bw", "--loopback", "-q", "0"], "1 to 64 QPs"),
        (&["write_bw", "--loopback", "-q", "65"], "1 to 64 QPs"),
        (
            &["-R", "write_bw", "--loopback", "-q", "2"],
            "-R with -q above 1",
        ),
    ] {
        let out = softwarp(args).wait_with_output().unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
    // -q 1 with a latency shape is perftest's default, and fine.
    let v = json(&["write_lat", "--loopback", "-q", "1", "-n", "20", "--no-tcp"]);
    assert_eq!(v.results[0].qps, 1);
}
