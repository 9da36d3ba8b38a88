//! Results of `softwarp bench`: the numbers derived from timed runs (median of the runs),
//! the ratio to the raw TCP baseline, and their text and JSON forms. The JSON document is
//! [`Document`] (serde): what `--json` prints and what a program reads back.

use serde::{Deserialize, Serialize};

use super::session::Timed;
use super::spec::{fmt_size, Kind, Mode, Op, Spec};
use super::ucx::{self, UcxRun};

const GIB: f64 = (1u64 << 30) as f64;

/// perftest's MB: 2^20 bytes (`format_factor` of its bandwidth report).
const MIB: f64 = (1u64 << 20) as f64;

/// The unit of bandwidth in the text table: perftest's MB/s (2^20 bytes per second), or
/// Gbit/s (10^9 bits per second) with `--report_gbits`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BwUnit {
    /// MB/s, perftest's default.
    #[default]
    MiBps,
    /// Gbit/s (`--report_gbits`).
    Gbps,
}

/// What one stack achieved at one size (from the median run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    /// Seconds of the median run.
    pub secs: f64,
    /// Bandwidth in Gbit/s (bandwidth shapes; both directions added when bidirectional).
    pub gbit_per_s: f64,
    /// The same in perftest's MB/s (2^20 bytes per second).
    pub mb_per_s: f64,
    /// Messages per second (bandwidth shapes).
    pub msg_per_s: f64,
    /// Latency in microseconds: half a round trip for Send and Write, a whole Read
    /// (request and response) for Read, as perftest reports them; from the median
    /// iteration (perftest's "typical") of the median run.
    pub lat_us: f64,
    /// The same from the average iteration (total time / iterations).
    pub lat_avg_us: f64,
    /// The same from the fastest iteration.
    pub lat_min_us: f64,
    /// The same from the 99th percentile iteration.
    pub lat_p99_us: f64,
    /// The same from the 99.9th percentile iteration (`None` when the iterations were
    /// not timed one by one: bandwidth shapes).
    pub lat_p99_9_us: Option<f64>,
    /// The same from the slowest iteration (`None` as above).
    pub lat_max_us: Option<f64>,
    /// Standard deviation of the iterations, same scale (`None` as above).
    pub lat_stdev_us: Option<f64>,
    /// CPU seconds (user + system, both ends) per GiB moved.
    pub cpu_s_per_gib: f64,
    /// CPU microseconds (both ends) per operation.
    pub cpu_us_per_op: f64,
}

/// One line of results.
#[derive(Debug, Clone)]
pub struct Row {
    /// The spec of the connection.
    pub spec: Spec,
    /// Message size.
    pub size: usize,
    /// Operations per run (per direction and per QP).
    pub iters: u64,
    /// Softwarp's runs.
    pub sw: Vec<Timed>,
    /// The TCP baseline's runs (empty with `--no-tcp`).
    pub tcp: Vec<Timed>,
    /// `--ucx`: the UCX test that stands for the shape and its runs.
    pub ucx: Option<(ucx::Test, Vec<UcxRun>)>,
}

/// The median run: by typical round trip for latency runs, by time otherwise.
fn median(runs: &[Timed]) -> Option<Timed> {
    let mut v: Vec<Timed> = runs.to_vec();
    let key = |t: &Timed| t.rtt.map_or(t.secs, |r| r.median);
    v.sort_by(|a, b| key(a).total_cmp(&key(b)));
    v.get(v.len() / 2).copied()
}

impl Row {
    fn figures(&self, runs: &[Timed]) -> Option<Figures> {
        let t = median(runs)?;
        let dirs = if self.spec.bidir && self.spec.shape.kind == Kind::Bw {
            2.0
        } else {
            1.0
        };
        // perftest -q: every QP runs the iterations; bandwidth and message rate are the
        // aggregate (all QPs' bytes over the time from the common start to the last end).
        let ops = self.iters as f64 * dirs * self.spec.qps.max(1) as f64;
        let bytes = ops * self.size as f64;
        let secs = t.secs.max(1e-9);
        // A Read is a whole round trip; a ping-pong iteration is two messages. The TCP
        // baseline of read_lat is reported as a whole round trip as well.
        let per_op = match (self.spec.shape.op, self.spec.shape.kind) {
            (Op::Read, Kind::Lat) => 1.0,
            (_, Kind::Lat) => 2.0,
            (_, Kind::Bw) => 1.0,
        };
        let avg = secs / self.iters.max(1) as f64 / per_op * 1e6;
        let per_iter = |v: f64| v / per_op * 1e6;
        Some(Figures {
            secs: t.secs,
            gbit_per_s: bytes * 8.0 / secs / 1e9,
            mb_per_s: bytes / secs / MIB,
            msg_per_s: ops / secs,
            lat_us: t.rtt.map_or(avg, |r| per_iter(r.median)),
            lat_avg_us: avg,
            lat_min_us: t.rtt.map_or(avg, |r| per_iter(r.min)),
            lat_p99_us: t.rtt.map_or(avg, |r| per_iter(r.p99)),
            lat_p99_9_us: t.rtt.map(|r| per_iter(r.p99_9)),
            lat_max_us: t.rtt.map(|r| per_iter(r.max)),
            lat_stdev_us: t.rtt.map(|r| per_iter(r.stdev)),
            cpu_s_per_gib: t.cpu / (bytes / GIB).max(1e-12),
            cpu_us_per_op: t.cpu / ops.max(1.0) * 1e6,
        })
    }

    /// Softwarp's figures.
    pub fn softwarp(&self) -> Option<Figures> {
        self.figures(&self.sw)
    }

    /// The baseline's figures.
    pub fn baseline(&self) -> Option<Figures> {
        self.figures(&self.tcp)
    }

    /// Softwarp relative to TCP: bandwidth ratio (higher is better) or latency ratio
    /// (lower is better).
    pub fn ratio(&self) -> Option<f64> {
        let (s, t) = (self.softwarp()?, self.baseline()?);
        Some(match self.spec.shape.kind {
            Kind::Bw => s.gbit_per_s / t.gbit_per_s.max(1e-12),
            Kind::Lat => s.lat_us / t.lat_us.max(1e-12),
        })
    }

    /// UCX's median run (`--ucx`).
    pub fn ucx(&self) -> Option<UcxRun> {
        self.ucx
            .as_ref()
            .and_then(|(_, runs)| ucx::median(runs, self.spec.shape.kind))
    }

    /// Softwarp relative to UCX, as [`Row::ratio`] to TCP.
    pub fn ucx_ratio(&self) -> Option<f64> {
        let (s, u) = (self.softwarp()?, self.ucx()?);
        Some(match self.spec.shape.kind {
            Kind::Bw => s.mb_per_s / u.mb_per_s.max(1e-12),
            Kind::Lat => s.lat_us / u.lat_typical_us.max(1e-12),
        })
    }

    /// The header of the text table.
    pub fn text_header() -> String {
        format!(
            "{:<10} {:>6} {:>8}  {:<27} {:<27} {:>15}  {}",
            "shape", "size", "iters", "softwarp", "raw TCP", "ratio", "CPU (softwarp / TCP)"
        )
    }

    /// One line of the text table (bandwidth in `unit`), and for a latency row whose
    /// iterations were timed one by one, one more line per stack with the distribution
    /// (perftest's t_min, t_typical, t_avg, t_stdev, 99%, 99.9%, t_max).
    pub fn text(&self, unit: BwUnit) -> String {
        let fig = |f: Option<Figures>| -> String {
            match (f, self.spec.shape.kind, unit) {
                (None, _, _) => "-".into(),
                (Some(f), Kind::Bw, BwUnit::Gbps) => {
                    format!(
                        "{:>7.2} Gbit/s {:>7.3} Mmsg/s",
                        f.gbit_per_s,
                        f.msg_per_s / 1e6
                    )
                }
                (Some(f), Kind::Bw, BwUnit::MiBps) => {
                    format!("{:>9.2} MB/s {:>7.3} Mmsg/s", f.mb_per_s, f.msg_per_s / 1e6)
                }
                (Some(f), Kind::Lat, _) => format!("{:>8.2} us", f.lat_us),
            }
        };
        let ratio = match (self.ratio(), self.spec.shape.kind) {
            (None, _) => "-".to_string(),
            (Some(r), Kind::Bw) => format!("{r:.3}"),
            (Some(r), Kind::Lat) => {
                let d = self.softwarp().map_or(0.0, |s| s.lat_us)
                    - self.baseline().map_or(0.0, |t| t.lat_us);
                format!("{r:.3} ({d:+.2} us)")
            }
        };
        let cpu = |f: Option<Figures>| -> String {
            match (f, self.spec.shape.kind) {
                (None, _) => "-".into(),
                (Some(f), Kind::Bw) => format!("{:.3} s/GiB", f.cpu_s_per_gib),
                (Some(f), Kind::Lat) => format!("{:.1} us/op", f.cpu_us_per_op),
            }
        };
        let mut line = format!(
            "{:<10} {:>6} {:>8}  {:<27} {:<27} {:>15}  {} / {}",
            self.spec.shape.name(),
            fmt_size(self.size),
            self.iters,
            fig(self.softwarp()),
            fig(self.baseline()),
            ratio,
            cpu(self.softwarp()),
            cpu(self.baseline()),
        );
        for (stack, f) in [("softwarp", self.softwarp()), ("raw TCP", self.baseline())] {
            let Some(f) = f else { continue };
            let (Some(p99_9), Some(max), Some(stdev)) =
                (f.lat_p99_9_us, f.lat_max_us, f.lat_stdev_us)
            else {
                continue;
            };
            line.push_str(&format!(
                "\n{:>26}{stack:<9} min {:.2} typical {:.2} avg {:.2} stdev {:.2} p99 {:.2} p99.9 {:.2} max {:.2} us",
                "", f.lat_min_us, f.lat_us, f.lat_avg_us, stdev, f.lat_p99_us, p99_9, max
            ));
        }
        if let (Some((test, _)), Some(u)) = (&self.ucx, self.ucx()) {
            let figure = match (self.spec.shape.kind, unit) {
                (Kind::Bw, BwUnit::Gbps) => format!(
                    "{:.2} Gbit/s {:.3} Mmsg/s",
                    u.gbit_per_s(),
                    u.msg_per_s / 1e6
                ),
                (Kind::Bw, BwUnit::MiBps) => {
                    format!("{:.2} MB/s {:.3} Mmsg/s", u.mb_per_s, u.msg_per_s / 1e6)
                }
                (Kind::Lat, _) => {
                    format!("typical {:.2} avg {:.2} us", u.lat_typical_us, u.lat_avg_us)
                }
            };
            let ratio = self
                .ucx_ratio()
                .map_or("-".into(), |r| format!("softwarp / UCX {r:.3}"));
            line.push_str(&format!(
                "\n{:>26}UCX      {} {figure}, {ratio}",
                "",
                test.label()
            ));
        }
        line
    }

    /// The row as its JSON object.
    pub fn result(&self) -> ResultRow {
        let stack = |f: Option<Figures>, runs: &[Timed]| {
            f.map(|figures| StackResult {
                figures,
                run_secs: runs.iter().map(|t| t.secs).collect(),
                run_bytes: runs.iter().map(|t| t.bytes).collect(),
            })
        };
        ResultRow {
            shape: self.spec.shape.name().to_string(),
            op: match self.spec.shape.op {
                Op::Send => "send",
                Op::Write => "write",
                Op::Read => "read",
            }
            .to_string(),
            kind: match self.spec.shape.kind {
                Kind::Bw => "bw",
                Kind::Lat => "lat",
            }
            .to_string(),
            size: self.size,
            iters: self.iters,
            runs: self.sw.len(),
            mode: self.spec.mode,
            bidirectional: self.spec.bidir,
            crc: self.spec.crc,
            depth: self.spec.depth,
            post_list: self.spec.post_list,
            max_fpdu: self.spec.fpdu,
            qps: self.spec.qps,
            softwarp: stack(self.softwarp(), &self.sw),
            tcp: stack(self.baseline(), &self.tcp),
            ratio: self.ratio().filter(|r| r.is_finite()),
            ucx: self.ucx.as_ref().and_then(|(test, runs)| {
                Some(UcxResult {
                    test: test.label(),
                    median: self.ucx()?,
                    runs: runs.clone(),
                    ratio: self.ucx_ratio().filter(|r| r.is_finite()),
                })
            }),
        }
    }
}

/// The JSON document `--json` prints: the configuration, one entry per row, `qp_mem`'s
/// figures and the notes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Document {
    /// Always `softwarp bench`.
    pub tool: String,
    /// The version of the softwarp-bench crate.
    pub version: String,
    /// How the run was configured.
    pub config: Config,
    /// One entry per shape and size.
    pub results: Vec<ResultRow>,
    /// `qp_mem`'s figures, when it ran.
    pub qp_memory: Option<QpMemoryResult>,
    /// Notes printed with `#` in the table (skipped shapes, the peer's version, ...).
    pub notes: Vec<String>,
}

/// The configuration of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// `client`, `server` or `loopback`.
    pub role: String,
    /// The peer's address (`127.0.0.1` on loopback and for a server).
    pub peer: String,
    /// The Softwarp device both ends opened (`-d`).
    pub device: String,
    /// How completions are waited for (`spin` with `-R`).
    pub mode: Mode,
    /// CRC32c on every FPDU.
    pub crc: bool,
    /// Outstanding work requests of bandwidth shapes (`-t`).
    pub depth: usize,
    /// Work requests per post (`-l`).
    pub post_list: usize,
    /// Both directions at once (`-b`).
    pub bidirectional: bool,
    /// QPs per bandwidth shape (`-q`; latency shapes and `-R` always run one). 1 in older
    /// documents.
    #[serde(default = "one")]
    pub qps: usize,
    /// Runs per figure (`--runs`), the median reported.
    pub runs: usize,
    /// Seconds each run lasts (`-D`), when the iterations come from a duration.
    pub duration_secs: Option<u64>,
    /// Largest FPDU (0: the connection's default: the TCP MSS, 65,535 bytes to this host).
    pub max_fpdu: usize,
    /// Threads pinned (`--pin`).
    pub pinned: bool,
    /// Unmeasured warm-up before each size, milliseconds (`--warmup-ms`; 0 in documents
    /// from before it existed).
    #[serde(default)]
    pub warmup_ms: u64,
    /// CPUs of the machine.
    pub cpus: usize,
    /// The 1-minute load average at the start (`None` when unknown).
    pub load_1m: Option<f64>,
    /// `release` or `debug`: whether the benchmark was built with debug assertions (a
    /// debug build's figures mean nothing; `unknown` in documents from before this field).
    #[serde(default = "unknown")]
    pub build: String,
}

fn unknown() -> String {
    "unknown".into()
}

fn one() -> usize {
    1
}

/// One row: a shape at one size, both stacks' figures and their ratio.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultRow {
    /// perftest's name without `ib_`, e.g. `write_bw`.
    pub shape: String,
    /// `send`, `write` or `read`.
    pub op: String,
    /// `bw` or `lat`.
    pub kind: String,
    /// Message size in bytes.
    pub size: usize,
    /// Operations per run (per direction).
    pub iters: u64,
    /// Runs measured per stack.
    pub runs: usize,
    /// Waiting mode.
    pub mode: Mode,
    /// Both directions at once.
    pub bidirectional: bool,
    /// CRC32c on the FPDUs.
    pub crc: bool,
    /// Outstanding operations.
    pub depth: usize,
    /// Work requests per post.
    pub post_list: usize,
    /// Largest FPDU (0: the connection's default: the TCP MSS, 65,535 bytes to this host).
    pub max_fpdu: usize,
    /// QPs (and raw TCP connections) that ran the shape at once (perftest `-q`); the
    /// figures are their aggregate and `iters` is per QP. 1 in older documents.
    #[serde(default = "one")]
    pub qps: usize,
    /// Softwarp's figures.
    pub softwarp: Option<StackResult>,
    /// The raw TCP baseline's figures (`None` with `--no-tcp` and `-R`).
    pub tcp: Option<StackResult>,
    /// Softwarp relative to TCP (bandwidth: higher is better; latency: lower is better).
    pub ratio: Option<f64>,
    /// `--ucx`: UCX's figures for the same shape and size (missing in older documents).
    #[serde(default)]
    pub ucx: Option<UcxResult>,
}

/// UCX's `ucx_perftest` beside a row (`--ucx`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UcxResult {
    /// The UCX test and transport, e.g. `put_bw (UCT tcp/lo, zcopy)`.
    pub test: String,
    /// The median run (by bandwidth, or by typical latency).
    pub median: UcxRun,
    /// Every run, in order.
    pub runs: Vec<UcxRun>,
    /// Softwarp relative to UCX, as `ratio` is to TCP.
    pub ratio: Option<f64>,
}

/// One stack's figures (from the median run) and every run's seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StackResult {
    /// The figures.
    #[serde(flatten)]
    pub figures: Figures,
    /// Seconds of every run, in order.
    pub run_secs: Vec<f64>,
    /// Bandwidth shapes: payload bytes of every run, in order, as the client's active
    /// side counted them completing, added up over its QPs (TCP: its connections); one
    /// direction even with `-b`. 0 for latency shapes. Missing in older documents.
    #[serde(default)]
    pub run_bytes: Vec<u64>,
}

/// `qp_mem`'s figures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct QpMemoryResult {
    /// Connected QP pairs created.
    pub qps: usize,
    /// Heap bytes per connected, idle QP.
    pub heap_bytes_per_qp: f64,
    /// Heap bytes per QP right after creation.
    pub heap_bytes_per_qp_created: f64,
}

#[cfg(test)]
mod tests {
    use super::super::spec::Shape;
    use super::*;

    fn spec(shape: Shape) -> Spec {
        Spec {
            shape,
            max_size: 1 << 20,
            depth: 16,
            bidir: false,
            crc: true,
            mode: Mode::Busy,
            fpdu: 0,
            alias_lead: true,
            post_list: 1,
            qps: 1,
        }
    }

    fn t(secs: f64) -> Timed {
        Timed {
            secs,
            cpu: secs / 2.0,
            rtt: None,
            bytes: 0,
        }
    }

    #[test]
    fn bandwidth_figures_come_from_the_median_run_and_ratio_to_tcp() {
        let row = Row {
            spec: spec(Shape::ALL[0]),
            size: 1 << 20,
            iters: 1024,
            sw: vec![t(4.0), t(1.0), t(2.0)],
            tcp: vec![t(1.0)],
            ucx: None,
        };
        let s = row.softwarp().unwrap();
        assert_eq!(s.secs, 2.0);
        // 1 GiB in 2 s.
        assert!((s.gbit_per_s - 8.0 * GIB / 2.0 / 1e9).abs() < 1e-9);
        assert!((s.cpu_s_per_gib - 1.0).abs() < 1e-9);
        assert!((row.ratio().unwrap() - 0.5).abs() < 1e-9);
        assert!(
            row.text(BwUnit::Gbps).contains("0.500"),
            "{}",
            row.text(BwUnit::Gbps)
        );
        // perftest's MB/s by default: 1 GiB in 2 s is 512 MB/s.
        assert!((s.mb_per_s - 512.0).abs() < 1e-9);
        assert!(
            row.text(BwUnit::MiBps).contains("512.00 MB/s"),
            "{}",
            row.text(BwUnit::MiBps)
        );
    }

    #[test]
    fn latency_is_half_a_round_trip_except_for_read() {
        let mut row = Row {
            spec: spec(Shape::ALL[4]),
            size: 8,
            iters: 1000,
            sw: vec![t(0.01)],
            tcp: vec![t(0.008)],
            ucx: None,
        };
        assert!((row.softwarp().unwrap().lat_us - 5.0).abs() < 1e-9);
        assert!((row.ratio().unwrap() - 1.25).abs() < 1e-9);
        row.spec.shape = Shape::ALL[5];
        assert!((row.softwarp().unwrap().lat_us - 10.0).abs() < 1e-9);
    }

    #[test]
    fn latency_comes_from_the_typical_iteration_and_reports_the_tail() {
        let mut ns: Vec<u64> = (1..=1000).map(|i| i * 1000).collect();
        ns.push(10_000_000); // one preempted iteration
        let rtt = super::super::session::Rtt::of(&ns).unwrap();
        let near = |a: f64, b: f64| (a - b).abs() <= b * 1e-3;
        assert!(near(rtt.min, 1e-6), "{rtt:?}");
        assert!(near(rtt.median, 501e-6), "{rtt:?}");
        assert!(near(rtt.p99, 991e-6), "{rtt:?}");
        assert!(near(rtt.p99_9, 1000e-6), "{rtt:?}");
        assert!(near(rtt.max, 10e-3), "{rtt:?}");
        assert!(rtt.stdev > 300e-6, "{rtt:?}");
        let row = Row {
            spec: spec(Shape::ALL[4]),
            size: 8,
            iters: 1001,
            sw: vec![Timed {
                rtt: Some(rtt),
                ..t(0.51)
            }],
            tcp: vec![],
            ucx: None,
        };
        let f = row.softwarp().unwrap();
        // Half a round trip for Send.
        assert!(near(f.lat_us, 250.5), "{f:?}");
        assert!(near(f.lat_max_us.unwrap(), 5000.0), "{f:?}");
        assert!(near(f.lat_p99_9_us.unwrap(), 500.0), "{f:?}");
        assert!(f.lat_avg_us > 250.0, "{f:?}");
        let text = row.text(BwUnit::MiBps);
        assert!(
            text.contains("p99 495.") && text.contains("p99.9 500.") && text.contains("max 50"),
            "{text}"
        );
    }

    #[test]
    fn a_row_without_a_baseline_has_null_tcp_and_ratio_and_reads_back() {
        let row = Row {
            spec: spec(Shape::ALL[1]),
            size: 64,
            iters: 10,
            sw: vec![t(1.0)],
            tcp: vec![],
            ucx: None,
        };
        let json = serde_json::to_string(&row.result()).unwrap();
        assert!(json.contains("\"tcp\":null,\"ratio\":null"), "{json}");
        let back: ResultRow = serde_json::from_str(&json).unwrap();
        assert_eq!(back, row.result());
        assert_eq!(back.softwarp.unwrap().run_secs, vec![1.0]);
    }
}
