//! `--ucx`: UCX's own benchmark, `ucx_perftest`, over UCX's TCP transport on loopback, run
//! beside Softwarp and the raw TCP baseline with the same sizes, iterations and placement,
//! so that the comparison with another RDMA-style stack over TCP is one command.
//!
//! Which UCX test stands for which shape:
//!
//! | shape | UCX test | API and transport |
//! |---|---|---|
//! | `write_bw` | `put_bw -D zcopy` | UCT, `-x tcp -d lo` (the reference command) |
//! | `write_lat` | `put_lat -D zcopy` | UCT, `-x tcp -d lo` (UCX's TCP has no short or bcopy put) |
//! | `send_bw` | `tag_bw` | UCP tag matching, `UCX_TLS=tcp UCX_NET_DEVICES=lo` (UCT active messages stop at 64 KiB) |
//! | `send_lat` | `tag_lat` | the same |
//! | `read_bw`, `read_lat` | none | UCX's TCP transport has no get; `ucp_get` emulates it over active messages (about 1 ms per operation here), which would compare nothing |
//!
//! UCX reports ping-pong latency as half a round trip (`ucx_perf_calc_result` divides by
//! two), as `softwarp bench` does for Send and Write. UCX always polls (busy), whatever
//! `--mode` is. The two `ucx_perftest` processes are the server (`-c` the server CPU with
//! `--pin on`) and the client (`-c 0`); the client's CSV line (`-v`) is parsed.
//!
//! Spawning the installed tool is the point: there is no crate that runs UCX's benchmark.

use std::io::Read;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::spec::{Kind, Op, Shape};

/// The UCX test that stands for a shape, and how it is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Test {
    /// `ucx_perftest -t` name.
    pub name: &'static str,
    /// Through UCP (transport from the environment) instead of UCT (`-x tcp -d lo`).
    pub ucp: bool,
}

impl Test {
    /// How the row names it, e.g. `put_bw (UCT tcp/lo, zcopy)`.
    pub fn label(self) -> String {
        if self.ucp {
            format!("{} (UCP over tcp/lo)", self.name)
        } else {
            format!("{} (UCT tcp/lo, zcopy)", self.name)
        }
    }
}

/// The UCX counterpart of a shape (`None` for Read: see the module docs).
pub fn test_for(shape: Shape) -> Option<Test> {
    let (name, ucp) = match (shape.op, shape.kind) {
        (Op::Write, Kind::Bw) => ("put_bw", false),
        (Op::Write, Kind::Lat) => ("put_lat", false),
        (Op::Send, Kind::Bw) => ("tag_bw", true),
        (Op::Send, Kind::Lat) => ("tag_lat", true),
        (Op::Read, _) => return None,
    };
    Some(Test { name, ucp })
}

/// What one `ucx_perftest` run reported (its `-v` CSV line).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct UcxRun {
    /// Iterations UCX counted.
    pub iters: u64,
    /// Median latency in microseconds (half a round trip for the `_lat` tests).
    pub lat_typical_us: f64,
    /// Average latency over the whole run, microseconds.
    pub lat_avg_us: f64,
    /// Bandwidth over the whole run, MB/s (2^20 bytes per second, as perftest's).
    pub mb_per_s: f64,
    /// Messages per second over the whole run.
    pub msg_per_s: f64,
}

impl UcxRun {
    /// Bandwidth in Gbit/s.
    pub fn gbit_per_s(&self) -> f64 {
        self.mb_per_s * (1u64 << 20) as f64 * 8.0 / 1e9
    }
}

/// Parses the last CSV line of `ucx_perftest -v`:
/// `iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr`.
pub fn parse_csv(out: &str) -> Result<UcxRun> {
    let line = out
        .lines()
        .map(str::trim)
        .rfind(|l| l.split(',').count() == 8 && l.starts_with(|c: char| c.is_ascii_digit()))
        .ok_or_else(|| anyhow!("no result line in ucx_perftest's output"))?;
    let f: Vec<&str> = line.split(',').collect();
    let num = |i: usize| -> Result<f64> {
        f[i].trim()
            .parse::<f64>()
            .with_context(|| format!("field {i} of {line:?}"))
    };
    Ok(UcxRun {
        iters: f[0]
            .trim()
            .parse()
            .with_context(|| format!("iterations of {line:?}"))?,
        lat_typical_us: num(1)?,
        lat_avg_us: num(3)?,
        mb_per_s: num(5)?,
        msg_per_s: num(7)?,
    })
}

/// The median run: by typical latency for latency tests, by bandwidth otherwise.
pub fn median(runs: &[UcxRun], kind: Kind) -> Option<UcxRun> {
    let mut v = runs.to_vec();
    match kind {
        Kind::Lat => v.sort_by(|a, b| a.lat_typical_us.total_cmp(&b.lat_typical_us)),
        Kind::Bw => v.sort_by(|a, b| a.mb_per_s.total_cmp(&b.mb_per_s)),
    }
    v.get(v.len() / 2).copied()
}

/// `ucx_perftest` on `PATH`, if installed.
pub fn find() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("ucx_perftest"))
        .find(|p| p.is_file())
}

/// How one run is placed and sized.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    /// Message size.
    pub size: usize,
    /// Measured iterations.
    pub iters: u64,
    /// Pin the client to CPU 0 and the server to `server_cpu`.
    pub pin: Option<usize>,
}

/// Arguments common to both ends (`ucx_perftest` needs the test on both).
fn common_args(test: Test, p: &Params, port: u16) -> Vec<String> {
    let mut a = vec![
        "-p".to_string(),
        port.to_string(),
        "-t".into(),
        test.name.into(),
        "-s".into(),
        p.size.to_string(),
        "-n".into(),
        p.iters.to_string(),
        "-w".into(),
        (p.iters / 10).clamp(1, 1000).to_string(),
        "-v".into(),
    ];
    if !test.ucp {
        a.extend(["-x", "tcp", "-d", "lo", "-D", "zcopy"].map(String::from));
    }
    a
}

fn command(bin: &Path, test: Test) -> Command {
    let mut c = Command::new(bin);
    if test.ucp {
        c.env("UCX_TLS", "tcp").env("UCX_NET_DEVICES", "lo");
    }
    c.stdin(Stdio::null());
    c
}

/// A free loopback port for UCX's own exchange (the listener is closed before UCX binds).
fn free_port() -> Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

/// Kills and reaps `child` (a server whose client failed, or a run past its limit).
fn reap(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Waits for `child` for at most `limit`, then kills it; its exit status if it ended.
fn wait_bounded(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(st)) => return Some(st),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

fn read_all(r: Option<impl Read>) -> String {
    let mut s = String::new();
    if let Some(mut r) = r {
        let _ = r.read_to_string(&mut s);
    }
    s
}

/// How long one client run may take before it is abandoned.
const RUN_LIMIT: Duration = Duration::from_secs(300);
/// How long the client retries while the server is not listening yet.
const START_LIMIT: Duration = Duration::from_secs(5);

/// What `ucx_perftest`'s client says when no server listens yet.
const NOT_LISTENING: &str = "Connection refused";

/// Runs one UCX measurement: a server process, then the client (retried while the server
/// is not listening yet, for at most [`START_LIMIT`]), and parses the client's result.
pub fn run(bin: &Path, test: Test, p: &Params) -> Result<UcxRun> {
    let port = free_port()?;
    let args = common_args(test, p, port);
    let mut server = command(bin, test);
    server
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(cpu) = p.pin {
        server.args(["-c", &cpu.to_string()]);
    }
    let mut server = server.spawn().context("starting ucx_perftest (server)")?;
    let started = Instant::now();
    let (status, stdout, stderr) = loop {
        let mut client = command(bin, test);
        client
            .arg("127.0.0.1")
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if p.pin.is_some() {
            client.args(["-c", "0"]);
        }
        let mut child = client.spawn().context("running ucx_perftest (client)")?;
        // The output is small (a header and one line), so reading after the exit cannot
        // block on a full pipe.
        let status = wait_bounded(&mut child, RUN_LIMIT);
        let stdout = read_all(child.stdout.take());
        let stderr = read_all(child.stderr.take());
        // UCX logs to standard output.
        let retry = status.is_some_and(|s| !s.success())
            && (stdout.contains(NOT_LISTENING) || stderr.contains(NOT_LISTENING))
            && started.elapsed() < START_LIMIT
            && matches!(server.try_wait(), Ok(None));
        if retry {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        break (status, stdout, stderr);
    };
    let ok = status.is_some_and(|s| s.success());
    // The server ends by itself once the client is done.
    let server_status = if ok {
        wait_bounded(&mut server, Duration::from_secs(10))
    } else {
        None
    };
    if !ok || server_status.is_none() {
        let server_err = if matches!(server.try_wait(), Ok(Some(_))) {
            read_all(server.stdout.take())
        } else {
            String::new()
        };
        reap(server);
        let last = stdout
            .lines()
            .chain(stderr.lines())
            .chain(server_err.lines())
            .rfind(|l| l.contains("ERROR"))
            .map_or_else(
                || match status {
                    None => format!("no result within {} s", RUN_LIMIT.as_secs()),
                    Some(_) if ok => "the server did not end".to_string(),
                    Some(s) => s.to_string(),
                },
                |l| l.trim().to_string(),
            );
        bail!("ucx_perftest -t {} -s {}: {last}", test.name, p.size);
    }
    parse_csv(&stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_csv_line_gives_half_round_trip_latency_and_bandwidth() {
        let out = "iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n\
                   2000,309.160,326.517,326.517,3062.63,3062.63,3064,3064\n";
        let r = parse_csv(out).unwrap();
        assert_eq!(r.iters, 2000);
        assert_eq!(r.lat_typical_us, 309.160);
        assert_eq!(r.lat_avg_us, 326.517);
        assert_eq!(r.mb_per_s, 3062.63);
        assert_eq!(r.msg_per_s, 3064.0);
        assert!((r.gbit_per_s() - 3062.63 * 1048576.0 * 8.0 / 1e9).abs() < 1e-9);
        // Leading spaces (UCX pads the iteration count) and trailing noise.
        let r = parse_csv(" 500,8.633,9.204,9.204,0.83,0.83,108647,108647\n").unwrap();
        assert_eq!(r.iters, 500);
        assert!(parse_csv("[1795] UCX ERROR tcp/lo does not support operation\n").is_err());
        assert!(parse_csv("1,2,3\n").is_err());
    }

    #[test]
    fn reads_have_no_counterpart_and_sends_go_through_ucp() {
        let [wbw, sbw, rbw, wlat, slat, rlat] = Shape::ALL;
        assert_eq!(
            test_for(wbw).map(|t| (t.name, t.ucp)),
            Some(("put_bw", false))
        );
        assert_eq!(
            test_for(wlat).map(|t| (t.name, t.ucp)),
            Some(("put_lat", false))
        );
        assert_eq!(
            test_for(sbw).map(|t| (t.name, t.ucp)),
            Some(("tag_bw", true))
        );
        assert_eq!(
            test_for(slat).map(|t| (t.name, t.ucp)),
            Some(("tag_lat", true))
        );
        assert_eq!(test_for(rbw), None);
        assert_eq!(test_for(rlat), None);
    }

    #[test]
    fn uct_runs_name_the_transport_and_ucp_runs_take_it_from_the_environment() {
        let p = Params {
            size: 1 << 20,
            iters: 4000,
            pin: None,
        };
        let put = common_args(test_for(Shape::ALL[0]).unwrap(), &p, 4242).join(" ");
        assert_eq!(
            put,
            "-p 4242 -t put_bw -s 1048576 -n 4000 -w 400 -v -x tcp -d lo -D zcopy"
        );
        let tag = common_args(test_for(Shape::ALL[1]).unwrap(), &p, 4242).join(" ");
        assert_eq!(tag, "-p 4242 -t tag_bw -s 1048576 -n 4000 -w 400 -v");
        let c = command(Path::new("ucx_perftest"), test_for(Shape::ALL[1]).unwrap());
        let envs: Vec<_> = c.get_envs().collect();
        assert!(envs
            .iter()
            .any(|(k, v)| *k == "UCX_TLS" && *v == Some("tcp".as_ref())));
    }

    #[test]
    fn the_median_run_is_by_latency_or_by_bandwidth() {
        let r = |lat: f64, bw: f64| UcxRun {
            iters: 1,
            lat_typical_us: lat,
            lat_avg_us: lat,
            mb_per_s: bw,
            msg_per_s: 1.0,
        };
        let runs = [r(3.0, 10.0), r(1.0, 30.0), r(2.0, 20.0)];
        assert_eq!(median(&runs, Kind::Lat).unwrap().lat_typical_us, 2.0);
        assert_eq!(median(&runs, Kind::Bw).unwrap().mb_per_s, 20.0);
        assert_eq!(median(&[], Kind::Bw), None);
    }
}
