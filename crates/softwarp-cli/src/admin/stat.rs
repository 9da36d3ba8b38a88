//! `softwarp stat`: the statistics of every Softwarp process (per QP, CQ and device, TCP_INFO
//! included), each sample labelled with the process's `pid` and `process` name; as text,
//! JSON or the Prometheus text format, and with `--watch` as per-second rates.
//!
//! Each QP's and CQ's own series come while its device has at most
//! [`PER_OBJECT_LIMIT`] of them; above that, the device's series (its sums over its QPs
//! included) only, unless `--qp N` or `--per-qp` asks (the processes choose: see
//! [`Detail`]).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use softwarp_ras::control::Request;
use softwarp_ras::registry::ProcessEntry;
use softwarp_ras::stats::{
    Detail, MetricFamily, MetricType, Sample, StatsSnapshot, Value, PER_OBJECT_LIMIT,
};

use super::{ask, processes, report_failures, Failure, Select};

/// Options of `softwarp stat`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct StatArgs {
    /// Which processes.
    #[command(flatten)]
    pub select: Select,
    /// JSON (one document; with --watch one line per interval).
    #[arg(long, conflicts_with = "prometheus")]
    pub json: bool,
    /// The Prometheus text exposition format.
    #[arg(long)]
    pub prometheus: bool,
    /// Print per-second rates of the counters every SECS seconds.
    #[arg(long, value_name = "SECS")]
    pub watch: Option<f64>,
    /// With --watch: stop after N intervals (default: until interrupted).
    #[arg(long, value_name = "N", requires = "watch")]
    pub count: Option<u64>,
    /// Also print samples that are zero (text output).
    #[arg(long)]
    pub all: bool,
    /// The series of the QP with this number (repeatable), on a device of any size.
    #[arg(long, value_name = "QPN")]
    pub qp: Vec<u32>,
    /// Every QP's and CQ's series, however many (by default only on devices of at most
    /// 256 QPs; larger ones give their sums over their QPs).
    #[arg(long, conflicts_with = "qp")]
    pub per_qp: bool,
}

impl StatArgs {
    /// The per-object series asked for.
    pub fn detail(&self) -> Detail {
        if self.per_qp {
            Detail::All
        } else if !self.qp.is_empty() {
            Detail::Qps(self.qp.clone())
        } else {
            Detail::Auto
        }
    }
}

/// Adds the `pid` and `process` labels of `entry` to every sample of `snap` and moves its
/// families into `into` (families of the same name are joined).
pub fn merge_into(
    into: &mut BTreeMap<String, MetricFamily>,
    entry: &ProcessEntry,
    snap: StatsSnapshot,
) {
    let pid = entry.pid.to_string();
    for fam in snap.families {
        let target = into
            .entry(fam.name.clone())
            .or_insert_with(|| MetricFamily {
                name: fam.name.clone(),
                help: fam.help.clone(),
                kind: fam.kind,
                samples: Vec::new(),
            });
        if target.kind != fam.kind {
            // Two versions disagreeing about a metric's type: keep the first one's.
            continue;
        }
        target.samples.extend(fam.samples.into_iter().map(|mut s| {
            s.labels.insert("pid".into(), pid.clone());
            s.labels.insert("process".into(), entry.name.clone());
            s
        }));
    }
}

/// The merged snapshot.
pub fn finish(families: BTreeMap<String, MetricFamily>, taken_unix_ms: u64) -> StatsSnapshot {
    StatsSnapshot {
        taken_unix_ms,
        families: families.into_values().collect(),
        conflicts: Vec::new(),
    }
}

fn sample_line(name: &str, s: &Sample, suffix: &str) -> String {
    let labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v:?}")).collect();
    let value = match s.value {
        Value::Float(x) if suffix.is_empty() => format!("{x}"),
        Value::Float(x) => format!("{x:.1}"),
        v => v.to_string(),
    };
    format!("{name}{{{}}} {value}{suffix}", labels.join(","))
}

fn is_zero(v: Value) -> bool {
    match v {
        Value::Int(n) => n == 0,
        Value::Float(x) => x == 0.0,
    }
}

/// The text form: one `name{labels} value` line per sample (zeros left out unless `all`).
pub fn text_lines(snap: &StatsSnapshot, all: bool) -> Vec<String> {
    let mut out = Vec::new();
    for fam in &snap.families {
        for s in &fam.samples {
            if all || !is_zero(s.value) {
                out.push(sample_line(&fam.name, s, ""));
            }
        }
    }
    out
}

/// The `--watch` text form: the per-second rate of every counter in `counters` (zeros left
/// out unless `all`).
pub fn rate_lines(rates: &StatsSnapshot, counters: &BTreeSet<String>, all: bool) -> Vec<String> {
    let mut out = Vec::new();
    for fam in rates.families.iter().filter(|f| counters.contains(&f.name)) {
        for s in &fam.samples {
            if all || !is_zero(s.value) {
                out.push(sample_line(&fam.name, s, "/s"));
            }
        }
    }
    out
}

/// Asks every process in `entries` at once and merges their answers; a process that does
/// not answer is added to `failures` once.
fn collect(
    entries: &[ProcessEntry],
    detail: &Detail,
    failures: &mut Vec<Failure>,
) -> StatsSnapshot {
    let mut families = BTreeMap::new();
    let req = Request::Stats {
        detail: detail.clone(),
    };
    for a in ask(entries, &req) {
        match a.reply.and_then(|r| r.into_result::<StatsSnapshot>()) {
            Ok(s) => merge_into(&mut families, &a.entry, s),
            Err(e) => {
                if !failures.iter().any(|f| f.pid == a.entry.pid) {
                    failures.push(Failure::new(&a.entry, e));
                }
            }
        }
    }
    finish(families, softwarp_ras::clock::now_unix_ms())
}

/// QPs whose own series `snap` leaves out (`softwarp_device_qp_series_omitted`).
pub fn omitted_qps(snap: &StatsSnapshot) -> u64 {
    snap.families
        .iter()
        .filter(|f| f.name == "softwarp_device_qp_series_omitted")
        .flat_map(|f| &f.samples)
        .map(|s| s.value.as_f64() as u64)
        .sum()
}

/// Says on `err` that per-QP series were left out, and how to get them.
fn note_omitted(snap: &StatsSnapshot, err: &mut dyn Write) {
    let n = omitted_qps(snap);
    if n > 0 {
        let _ = writeln!(
            err,
            "softwarp: the series of {n} QPs are left out (devices of more than \
             {PER_OBJECT_LIMIT} QPs give their sums, softwarp_device_qp_*): \
             --qp N or --per-qp for them"
        );
    }
}

fn print_snapshot(args: &StatArgs, snap: &StatsSnapshot, out: &mut dyn Write) -> Result<()> {
    if args.json {
        serde_json::to_writer_pretty(&mut *out, snap)?;
        writeln!(out)?;
    } else if args.prometheus {
        out.write_all(snap.to_prometheus().as_bytes())?;
    } else {
        for l in text_lines(snap, args.all) {
            writeln!(out, "{l}")?;
        }
    }
    Ok(())
}

/// Runs `softwarp stat`; returns the exit status.
pub fn run(args: &StatArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<u8> {
    let entries = processes(&args.select, err)?;
    let detail = args.detail();
    let mut failures = Vec::new();
    let Some(secs) = args.watch else {
        let snap = collect(&entries, &detail, &mut failures);
        print_snapshot(args, &snap, out)?;
        note_omitted(&snap, err);
        return Ok(report_failures(err, &failures));
    };
    if !(secs.is_finite() && secs > 0.0 && secs <= 86_400.0) {
        bail!("--watch needs an interval between 0 and 86400 seconds, not {secs}");
    }
    let interval = Duration::from_secs_f64(secs);
    let mut before = collect(&entries, &detail, &mut failures);
    note_omitted(&before, err);
    let mut at = Instant::now();
    let mut n = 0u64;
    while args.count.is_none_or(|c| n < c) {
        std::thread::sleep(interval);
        let now = collect(&entries, &detail, &mut failures);
        let now_at = Instant::now();
        let rates = now.rates(&before, now_at.saturating_duration_since(at));
        let counters: BTreeSet<String> = now
            .families
            .iter()
            .filter(|f| f.kind == MetricType::Counter)
            .map(|f| f.name.clone())
            .collect();
        if args.json {
            serde_json::to_writer(&mut *out, &rates)?;
            writeln!(out)?;
        } else if args.prometheus {
            out.write_all(rates.to_prometheus().as_bytes())?;
            writeln!(out)?;
        } else {
            writeln!(
                out,
                "--- {} (per second over {:.1} s)",
                softwarp_ras::clock::rfc3339(std::time::SystemTime::now()),
                now_at.saturating_duration_since(at).as_secs_f64()
            )?;
            let lines = rate_lines(&rates, &counters, args.all);
            if lines.is_empty() {
                writeln!(out, "(no activity)")?;
            }
            for l in lines {
                writeln!(out, "{l}")?;
            }
        }
        out.flush()?;
        before = now;
        at = now_at;
        n += 1;
    }
    Ok(report_failures(err, &failures))
}

#[cfg(test)]
mod tests {
    use super::*;
    use softwarp_ras::stats::StatsBuilder;
    use std::path::PathBuf;

    fn entry(pid: u32, name: &str) -> ProcessEntry {
        ProcessEntry {
            pid,
            name: name.into(),
            uid: 0,
            start_unix_ms: 0,
            start_time: String::new(),
            proc_start_ticks: None,
            control_socket: PathBuf::new(),
            version: String::new(),
        }
    }

    fn snap(bytes: u64) -> StatsSnapshot {
        let mut b = StatsBuilder::new();
        b.counter(
            "softwarp_qp_tx_bytes_total",
            "Bytes.",
            &[("qpn", "1")],
            bytes,
        );
        b.gauge_int("softwarp_cq_depth", "Depth.", &[("cq", "2")], 0);
        b.finish()
    }

    #[test]
    fn merged_samples_carry_pid_and_process_and_stay_apart() {
        let mut fams = BTreeMap::new();
        merge_into(&mut fams, &entry(10, "a"), snap(5));
        merge_into(&mut fams, &entry(11, "b"), snap(7));
        let s = finish(fams, 0);
        let l = |pid, p| [("pid", pid), ("process", p), ("qpn", "1")];
        assert_eq!(
            s.get("softwarp_qp_tx_bytes_total", &l("10", "a")),
            Some(Value::Int(5))
        );
        assert_eq!(
            s.get("softwarp_qp_tx_bytes_total", &l("11", "b")),
            Some(Value::Int(7))
        );
        // One HELP/TYPE per metric in the exposition.
        let text = s.to_prometheus();
        assert_eq!(text.matches("# TYPE softwarp_qp_tx_bytes_total").count(), 1);
    }

    #[test]
    fn text_leaves_out_zeros_unless_asked() {
        let mut fams = BTreeMap::new();
        merge_into(&mut fams, &entry(10, "a"), snap(5));
        let s = finish(fams, 0);
        assert_eq!(
            text_lines(&s, false),
            ["softwarp_qp_tx_bytes_total{pid=\"10\",process=\"a\",qpn=\"1\"} 5"]
        );
        assert_eq!(text_lines(&s, true).len(), 2);
    }

    #[test]
    fn watch_lines_are_counter_rates_per_second() {
        let then = snap(1000);
        let now = snap(3000);
        let rates = now.rates(&then, Duration::from_secs(2));
        let counters: BTreeSet<String> = ["softwarp_qp_tx_bytes_total".to_string()].into();
        assert_eq!(
            rate_lines(&rates, &counters, false),
            ["softwarp_qp_tx_bytes_total{qpn=\"1\"} 1000.0/s"]
        );
    }
}
