//! The benchmark program `examples/sockperf.rs` (what `scripts/bench-sockets.sh` runs) in a
//! short run over std streams and over native iWARP streams: every test it reports ran and
//! moved its bytes. `cargo test` builds the examples; run without them (`cargo test --test it`)
//! the test skips and says so (and fails under `CI=true`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use softwarp_testkit::{example, free_port, skip, Reaped, SpawnReaped};

/// Waits at most `limit` for `child`; kills it past that.
fn wait_bounded(child: Reaped, limit: Duration, what: &str) -> Output {
    let mut child = child.take();
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what} did not finish within {limit:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

/// Runs a server and a client with `api`; returns the client's result lines.
fn run(bin: &PathBuf, api: &str) -> Vec<String> {
    let addr = format!("127.0.0.1:{}", free_port());
    let spawn = |role: &str, extra: &[&str]| {
        Command::new(bin)
            .args([role, &addr, "--api", api])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn_reaped()
    };
    let server = spawn("server", &[]);
    let client = spawn(
        "client",
        &[
            "--label",
            "t",
            "--sizes",
            "8,4096,65536",
            "--iters",
            "20",
            "--bulk-sizes",
            "65536,1048576",
            "--bulk-mib",
            "2",
        ],
    );
    let limit = Duration::from_secs(60);
    let out = wait_bounded(client, limit, "sockperf client");
    let served = wait_bounded(server, limit, "sockperf server");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && served.status.success(),
        "{api}: client {:?} server {:?}\n{text}\n{}\n{}",
        out.status,
        served.status,
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&served.stderr)
    );
    text.lines().map(str::to_string).collect()
}

/// The value of `key=` in a result line.
fn field(line: &str, key: &str) -> f64 {
    line.split_whitespace()
        .find_map(|f| f.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key} in {line}"))
        .parse()
        .unwrap()
}

#[test]
fn sockperf_measures_every_test_over_std_and_native_streams() {
    let Some(bin) = example("sockperf") else {
        skip("examples/sockperf is not built (cargo test builds the examples)");
        return;
    };

    for (api, tests) in [
        ("std", &["pingpong", "bulk"][..]),
        (
            "native",
            &["pingpong", "remote_pingpong", "bulk", "remote_bulk"][..],
        ),
    ] {
        let lines = run(&bin, api);
        for test in tests {
            let rows: Vec<&String> = lines
                .iter()
                .filter(|l| l.contains(&format!(" test={test} ")))
                .collect();
            let sizes = if test.ends_with("bulk") { 2 } else { 3 };
            assert_eq!(rows.len(), sizes, "{api} {test}: {lines:#?}");
            for r in rows {
                assert!(r.starts_with(&format!("RESULT label=t api={api} ")), "{r}");
                let value = if test.ends_with("bulk") {
                    field(r, "gbit_s")
                } else {
                    field(r, "median_us").min(field(r, "p99_us"))
                };
                assert!(value > 0.0, "{r}");
            }
        }
    }
}
