//! Results of `softwarp bench`: the numbers derived from timed runs (median of the runs),
//! the ratio to the raw TCP baseline, and their text and JSON forms.

use std::fmt::Write as _;

use super::session::Timed;
use super::spec::{fmt_size, Kind, Op, Spec};

const GIB: f64 = (1u64 << 30) as f64;

/// What one stack achieved at one size (from the median run).
#[derive(Debug, Clone, Copy, Default)]
pub struct Figures {
    /// Seconds of the median run.
    pub secs: f64,
    /// Bandwidth in Gbit/s (bandwidth shapes; both directions added when bidirectional).
    pub gbit_per_s: f64,
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
    /// Operations per run (per direction).
    pub iters: u64,
    /// Softwarp's runs.
    pub sw: Vec<Timed>,
    /// The TCP baseline's runs (empty with `--no-tcp`).
    pub tcp: Vec<Timed>,
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
        let ops = self.iters as f64 * dirs;
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
            msg_per_s: ops / secs,
            lat_us: t.rtt.map_or(avg, |r| per_iter(r.median)),
            lat_avg_us: avg,
            lat_min_us: t.rtt.map_or(avg, |r| per_iter(r.min)),
            lat_p99_us: t.rtt.map_or(avg, |r| per_iter(r.p99)),
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

    /// The header of the text table.
    pub fn text_header() -> String {
        format!(
            "{:<10} {:>6} {:>8}  {:<27} {:<27} {:>15}  {}",
            "shape", "size", "iters", "softwarp", "raw TCP", "ratio", "CPU (softwarp / TCP)"
        )
    }

    /// One line of the text table.
    pub fn text(&self) -> String {
        let fig = |f: Option<Figures>| -> String {
            match (f, self.spec.shape.kind) {
                (None, _) => "-".into(),
                (Some(f), Kind::Bw) => {
                    format!(
                        "{:>7.2} Gbit/s {:>7.3} Mmsg/s",
                        f.gbit_per_s,
                        f.msg_per_s / 1e6
                    )
                }
                (Some(f), Kind::Lat) => format!("{:>8.2} us", f.lat_us),
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
        format!(
            "{:<10} {:>6} {:>8}  {:<27} {:<27} {:>15}  {} / {}",
            self.spec.shape.name(),
            fmt_size(self.size),
            self.iters,
            fig(self.softwarp()),
            fig(self.baseline()),
            ratio,
            cpu(self.softwarp()),
            cpu(self.baseline()),
        )
    }

    /// The row as a JSON object.
    pub fn json(&self) -> String {
        let mut s = String::from("{");
        let _ = write!(
            s,
            "\"shape\":{},\"op\":{},\"kind\":{},\"size\":{},\"iters\":{},\"runs\":{},\
             \"mode\":{},\"bidirectional\":{},\"crc\":{},\"depth\":{},\"post_list\":{},\
             \"max_fpdu\":{}",
            jstr(self.spec.shape.name()),
            jstr(match self.spec.shape.op {
                Op::Send => "send",
                Op::Write => "write",
                Op::Read => "read",
            }),
            jstr(match self.spec.shape.kind {
                Kind::Bw => "bw",
                Kind::Lat => "lat",
            }),
            self.size,
            self.iters,
            self.sw.len(),
            jstr(self.spec.mode.name()),
            self.spec.bidir,
            self.spec.crc,
            self.spec.depth,
            self.spec.post_list,
            self.spec.fpdu,
        );
        let _ = write!(
            s,
            ",\"softwarp\":{}",
            figures_json(self.softwarp(), &self.sw)
        );
        let _ = write!(s, ",\"tcp\":{}", figures_json(self.baseline(), &self.tcp));
        let _ = write!(s, ",\"ratio\":{}", jnum(self.ratio()));
        s.push('}');
        s
    }
}

fn figures_json(f: Option<Figures>, runs: &[Timed]) -> String {
    let Some(f) = f else {
        return "null".into();
    };
    let secs: Vec<String> = runs.iter().map(|t| jnum(Some(t.secs))).collect();
    format!(
        "{{\"secs\":{},\"gbit_per_s\":{},\"msg_per_s\":{},\"lat_us\":{},\"lat_avg_us\":{},\
         \"lat_min_us\":{},\"lat_p99_us\":{},\"cpu_s_per_gib\":{},\
         \"cpu_us_per_op\":{},\"run_secs\":[{}]}}",
        jnum(Some(f.secs)),
        jnum(Some(f.gbit_per_s)),
        jnum(Some(f.msg_per_s)),
        jnum(Some(f.lat_us)),
        jnum(Some(f.lat_avg_us)),
        jnum(Some(f.lat_min_us)),
        jnum(Some(f.lat_p99_us)),
        jnum(Some(f.cpu_s_per_gib)),
        jnum(Some(f.cpu_us_per_op)),
        secs.join(",")
    )
}

/// A JSON string literal.
pub fn jstr(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A JSON number (`null` when absent or not finite).
pub fn jnum(v: Option<f64>) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x}"),
        _ => "null".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::spec::{Mode, Shape};
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
            post_list: 1,
        }
    }

    fn t(secs: f64) -> Timed {
        Timed {
            secs,
            cpu: secs / 2.0,
            rtt: None,
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
        };
        let s = row.softwarp().unwrap();
        assert_eq!(s.secs, 2.0);
        // 1 GiB in 2 s.
        assert!((s.gbit_per_s - 8.0 * GIB / 2.0 / 1e9).abs() < 1e-9);
        assert!((s.cpu_s_per_gib - 1.0).abs() < 1e-9);
        assert!((row.ratio().unwrap() - 0.5).abs() < 1e-9);
        assert!(row.text().contains("0.500"), "{}", row.text());
    }

    #[test]
    fn latency_is_half_a_round_trip_except_for_read() {
        let mut row = Row {
            spec: spec(Shape::ALL[4]),
            size: 8,
            iters: 1000,
            sw: vec![t(0.01)],
            tcp: vec![t(0.008)],
        };
        assert!((row.softwarp().unwrap().lat_us - 5.0).abs() < 1e-9);
        assert!((row.ratio().unwrap() - 1.25).abs() < 1e-9);
        row.spec.shape = Shape::ALL[5];
        assert!((row.softwarp().unwrap().lat_us - 10.0).abs() < 1e-9);
    }

    #[test]
    fn latency_comes_from_the_typical_iteration_when_iterations_were_timed() {
        let mut ns: Vec<u64> = (1..=100).map(|i| i * 1000).collect();
        ns.push(10_000_000); // one preempted iteration
        let rtt = super::super::session::Rtt::of(&mut ns).unwrap();
        assert_eq!(rtt.min, 1e-6);
        assert_eq!(rtt.median, 51e-6);
        let row = Row {
            spec: spec(Shape::ALL[4]),
            size: 8,
            iters: 101,
            sw: vec![Timed {
                rtt: Some(rtt),
                ..t(0.015)
            }],
            tcp: vec![],
        };
        let f = row.softwarp().unwrap();
        assert!((f.lat_us - 25.5).abs() < 1e-9, "{f:?}");
        assert!(f.lat_avg_us > 70.0, "{f:?}");
    }

    #[test]
    fn json_strings_are_escaped_and_missing_numbers_are_null() {
        assert_eq!(jstr("a\"b\\c\n\u{1}"), "\"a\\\"b\\\\c\\n\\u0001\"");
        assert_eq!(jnum(None), "null");
        assert_eq!(jnum(Some(f64::NAN)), "null");
        assert_eq!(jnum(Some(1.5)), "1.5");
        let row = Row {
            spec: spec(Shape::ALL[1]),
            size: 64,
            iters: 10,
            sw: vec![t(1.0)],
            tcp: vec![],
        };
        assert!(row.json().contains("\"tcp\":null,\"ratio\":null"));
    }
}
