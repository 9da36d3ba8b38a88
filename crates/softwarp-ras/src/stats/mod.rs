//! Statistics export: a generic snapshot of counters and gauges with labels, rendered as JSON
//! (serde) and as the Prometheus text exposition format (version 0.0.4); TCP_INFO sampling
//! of a socket; and an opt-in local HTTP endpoint that serves `GET /metrics`.
//!
//! This module does not know what a QP is: the verbs layer implements [`StatsSource`] and
//! adds its counters through a [`StatsBuilder`], e.g. for a QP's engine counters:
//!
//! ```
//! use softwarp_ras::stats::StatsBuilder;
//! let mut b = StatsBuilder::new();
//! let labels = [("device", "softwarp0"), ("qpn", "7"), ("op", "send")];
//! b.counter("softwarp_qp_tx_messages_total", "Messages sent, per RDMAP operation.", &labels, 12);
//! b.counter("softwarp_qp_tx_bytes_total", "Payload bytes sent, per RDMAP operation.", &labels, 4096);
//! let text = b.finish().to_prometheus();
//! assert!(text.contains("# TYPE softwarp_qp_tx_messages_total counter\n"));
//! assert!(text.contains("softwarp_qp_tx_messages_total{device=\"softwarp0\",op=\"send\",qpn=\"7\"} 12\n"));
//! ```
//!
//! Collection does no I/O; the endpoint ([`MetricsServer`]) and [`tcp_info`] do.

mod http;
mod tcp_info;

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::sync::{Mutex, MutexGuard, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use http::{MetricsServer, PROMETHEUS_CONTENT_TYPE};
pub use tcp_info::{
    tcp_info, TcpInfo, TcpInfoSampler, DEFAULT_TCP_INFO_INTERVAL, TCP_INFO_INTERVAL_ENV,
};

use crate::clock;

/// Whether a metric only goes up (a counter) or goes up and down (a gauge).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricType {
    /// Monotonically increasing (resets only when the process restarts).
    Counter,
    /// A current value.
    Gauge,
}

impl MetricType {
    /// The `# TYPE` word.
    pub const fn as_str(self) -> &'static str {
        match self {
            MetricType::Counter => "counter",
            MetricType::Gauge => "gauge",
        }
    }
}

/// A sample's value: counters are exact integers, gauges may be fractional.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Value {
    /// An exact count.
    Int(u64),
    /// A measurement.
    Float(f64),
}

impl Value {
    /// The value as a float (counters above 2^53 lose precision).
    pub fn as_f64(self) -> f64 {
        match self {
            Value::Int(n) => n as f64,
            Value::Float(x) => x,
        }
    }
}

impl fmt::Display for Value {
    /// The Prometheus text form: integers exactly, `NaN`, `+Inf`, `-Inf` spelled out.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Value::Int(n) => write!(f, "{n}"),
            Value::Float(x) if x.is_nan() => f.write_str("NaN"),
            Value::Float(x) if x == f64::INFINITY => f.write_str("+Inf"),
            Value::Float(x) if x == f64::NEG_INFINITY => f.write_str("-Inf"),
            Value::Float(x) => write!(f, "{x}"),
        }
    }
}

/// One labelled value of a metric.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Label names and values (names sorted).
    pub labels: BTreeMap<String, String>,
    /// The value.
    pub value: Value,
}

/// A metric: name, help, type and its samples.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricFamily {
    /// The name (`[a-zA-Z_:][a-zA-Z0-9_:]*`).
    pub name: String,
    /// What it measures.
    pub help: String,
    /// Counter or gauge.
    #[serde(rename = "type")]
    pub kind: MetricType,
    /// Its samples.
    pub samples: Vec<Sample>,
}

/// Every metric at one moment.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct StatsSnapshot {
    /// When it was taken, milliseconds since the Unix epoch.
    pub taken_unix_ms: u64,
    /// The metrics, sorted by name.
    pub families: Vec<MetricFamily>,
    /// Samples dropped because their name was already used with the other type.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conflicts: Vec<String>,
}

/// A device with at most this many QPs (CQs) gives the series of each of them under
/// [`Detail::Auto`]; above it, only the device's own series and its sums over the QPs.
pub const PER_OBJECT_LIMIT: usize = 256;

/// Which per-object series (each QP's, each CQ's) a collection carries. The series of a
/// device itself (its resource counts, progress thread, sums over its QPs) are always
/// there: at 100,000 QPs the per-QP series are millions of samples, which no answer
/// carries in a second.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Detail {
    /// Each QP's and CQ's series while their device has at most [`PER_OBJECT_LIMIT`] of
    /// them (the QPs and the CQs are counted apart).
    #[default]
    Auto,
    /// Every QP's and CQ's series, however many.
    All,
    /// The series of the QPs with these numbers only (on any device), no CQ's.
    Qps(Vec<u32>),
}

impl Detail {
    /// Whether this is [`Detail::Auto`] (what a request leaves out).
    pub fn is_auto(&self) -> bool {
        *self == Detail::Auto
    }

    /// Whether a QP numbered `qpn` on a device of `qps` QPs has its series.
    pub fn wants_qp(&self, qpn: u32, qps: usize) -> bool {
        match self {
            Detail::Auto => qps <= PER_OBJECT_LIMIT,
            Detail::All => true,
            Detail::Qps(list) => list.contains(&qpn),
        }
    }

    /// Whether each CQ of a device of `cqs` CQs has its series.
    pub fn wants_cqs(&self, cqs: usize) -> bool {
        match self {
            Detail::Auto => cqs <= PER_OBJECT_LIMIT,
            Detail::All => true,
            Detail::Qps(_) => false,
        }
    }

    /// The detail a metrics endpoint's query asks for: `qp=N` (repeatable) for those QPs,
    /// `per_qp=1` (or `detail=all`) for every QP, anything else [`Detail::Auto`].
    pub fn from_query(query: &str) -> Self {
        let mut qps = Vec::new();
        for pair in query.split('&') {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match (k, v) {
                ("per_qp", "1" | "true" | "yes") | ("detail", "all") => return Detail::All,
                ("qp", n) => {
                    if let Ok(n) = n.parse() {
                        qps.push(n);
                    }
                }
                _ => {}
            }
        }
        if qps.is_empty() {
            Detail::Auto
        } else {
            Detail::Qps(qps)
        }
    }
}

/// Collects samples into families (one `# HELP`/`# TYPE` per name), cleaning names so the
/// output is always valid; carries the [`Detail`] the sources honour.
#[derive(Debug, Default)]
pub struct StatsBuilder {
    families: BTreeMap<String, MetricFamily>,
    conflicts: Vec<String>,
    detail: Detail,
}

/// Replaces characters not allowed in a metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`) or, with
/// `colon == false`, a label name (`[a-zA-Z_][a-zA-Z0-9_]*`) by `_`; prefixes `_` to a
/// leading digit; an empty name becomes `_`.
pub fn sanitize_name(name: &str, colon: bool) -> String {
    let mut out = String::with_capacity(name.len() + 1);
    for (i, ch) in name.chars().enumerate() {
        let ok = ch.is_ascii_alphabetic() || ch == '_' || (colon && ch == ':');
        if ok || (i > 0 && ch.is_ascii_digit()) {
            out.push(ch);
        } else if i == 0 && ch.is_ascii_digit() {
            out.push('_');
            out.push(ch);
        } else {
            out.push('_');
        }
    }
    if out.is_empty() {
        out.push('_');
    }
    out
}

impl StatsBuilder {
    /// An empty builder (with [`Detail::Auto`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty builder whose sources give the per-object series `detail` names.
    pub fn with_detail(detail: Detail) -> Self {
        Self {
            detail,
            ..Self::default()
        }
    }

    /// Which per-object series the sources are to add.
    pub fn detail(&self) -> &Detail {
        &self.detail
    }

    fn add(
        &mut self,
        name: &str,
        help: &str,
        kind: MetricType,
        labels: &[(&str, &str)],
        value: Value,
    ) {
        let name = sanitize_name(name, true);
        let family = self
            .families
            .entry(name.clone())
            .or_insert_with(|| MetricFamily {
                name: name.clone(),
                help: help.to_string(),
                kind,
                samples: Vec::new(),
            });
        if family.kind != kind {
            if !self.conflicts.contains(&name) {
                self.conflicts.push(name);
            }
            return;
        }
        let labels = labels
            .iter()
            .map(|(k, v)| (sanitize_name(k, false), (*v).to_string()))
            .collect();
        family.samples.push(Sample { labels, value });
    }

    /// Adds a counter sample.
    pub fn counter(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: u64) {
        self.add(name, help, MetricType::Counter, labels, Value::Int(value));
    }

    /// Adds a gauge sample.
    pub fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        self.add(name, help, MetricType::Gauge, labels, Value::Float(value));
    }

    /// Adds an integer gauge sample.
    pub fn gauge_int(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: u64) {
        self.add(name, help, MetricType::Gauge, labels, Value::Int(value));
    }

    /// The snapshot, time-stamped now.
    pub fn finish(self) -> StatsSnapshot {
        StatsSnapshot {
            taken_unix_ms: clock::now_unix_ms(),
            families: self.families.into_values().collect(),
            conflicts: self.conflicts,
        }
    }
}

fn escape_help(s: &str, out: &mut String) {
    for ch in s.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

fn escape_label_value(s: &str, out: &mut String) {
    for ch in s.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' => out.push_str("\\\""),
            c => out.push(c),
        }
    }
}

impl StatsSnapshot {
    /// The Prometheus text exposition format (version 0.0.4): per metric a `# HELP` line
    /// (backslash and newline escaped), a `# TYPE` line, then one line per sample with its
    /// labels (backslash, double quote and newline escaped in values).
    pub fn to_prometheus(&self) -> String {
        let mut out = String::new();
        for fam in &self.families {
            out.push_str("# HELP ");
            out.push_str(&fam.name);
            out.push(' ');
            escape_help(&fam.help, &mut out);
            out.push('\n');
            let _ = writeln!(out, "# TYPE {} {}", fam.name, fam.kind.as_str());
            for s in &fam.samples {
                out.push_str(&fam.name);
                if !s.labels.is_empty() {
                    out.push('{');
                    for (i, (k, v)) in s.labels.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        out.push_str(k);
                        out.push_str("=\"");
                        escape_label_value(v, &mut out);
                        out.push('"');
                    }
                    out.push('}');
                }
                let _ = writeln!(out, " {}", s.value);
            }
        }
        out
    }

    /// The snapshot as one line of JSON (what the control socket's `stats` returns).
    pub fn to_json(&self) -> String {
        // Serialising plain data with string keys cannot fail; an empty object is the
        // fallback that keeps this infallible.
        serde_json::to_string(self).unwrap_or_else(|_| "{}".to_string())
    }

    /// The value of metric `name` with exactly these labels.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<Value> {
        let fam = self.families.iter().find(|f| f.name == name)?;
        fam.samples
            .iter()
            .find(|s| {
                s.labels.len() == labels.len()
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
    }

    /// Per-second rates since `earlier`, for `softwarp stat --watch`: each counter becomes
    /// (now - then) / `elapsed` (a counter that went down was reset: its rate is now /
    /// `elapsed`; a counter new since then counts from 0); gauges are kept as they are.
    pub fn rates(&self, earlier: &StatsSnapshot, elapsed: Duration) -> StatsSnapshot {
        let secs = elapsed.as_secs_f64();
        let families = self
            .families
            .iter()
            .map(|fam| {
                if fam.kind != MetricType::Counter {
                    return fam.clone();
                }
                let before = earlier
                    .families
                    .iter()
                    .find(|f| f.name == fam.name && f.kind == MetricType::Counter);
                let samples = fam
                    .samples
                    .iter()
                    .map(|s| {
                        let then = before
                            .and_then(|b| b.samples.iter().find(|o| o.labels == s.labels))
                            .map_or(0.0, |o| o.value.as_f64());
                        let now = s.value.as_f64();
                        let delta = if now >= then { now - then } else { now };
                        let rate = if secs > 0.0 { delta / secs } else { 0.0 };
                        Sample {
                            labels: s.labels.clone(),
                            value: Value::Float(rate),
                        }
                    })
                    .collect();
                MetricFamily {
                    name: fam.name.clone(),
                    help: format!("{} (per second)", fam.help),
                    kind: MetricType::Gauge,
                    samples,
                }
            })
            .collect();
        StatsSnapshot {
            taken_unix_ms: self.taken_unix_ms,
            families,
            conflicts: Vec::new(),
        }
    }
}

/// Something with statistics to export (a device, with its QPs and CQs).
pub trait StatsSource: Send + Sync {
    /// Adds the current values to `out`.
    fn collect(&self, out: &mut StatsBuilder);
}

static SOURCES: Mutex<Vec<Weak<dyn StatsSource>>> = Mutex::new(Vec::new());

fn sources() -> MutexGuard<'static, Vec<Weak<dyn StatsSource>>> {
    SOURCES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Adds a process-wide statistics source, held weakly: it stops being collected when its
/// owner drops it.
pub fn register_source(source: Weak<dyn StatsSource>) {
    let mut all = sources();
    all.retain(|w| w.strong_count() > 0);
    all.push(source);
}

/// Collects every live source registered with [`register_source`], with every per-object
/// series ([`Detail::All`]).
pub fn collect_all() -> StatsSnapshot {
    collect(&Detail::All)
}

/// Collects every live source registered with [`register_source`], with the per-object
/// series of `detail` (the control socket's `stats` and the metrics endpoint use this).
pub fn collect(detail: &Detail) -> StatsSnapshot {
    // Sources are called without the registry lock, so a source may register another.
    let live: Vec<_> = {
        let mut all = sources();
        all.retain(|w| w.strong_count() > 0);
        all.iter().filter_map(Weak::upgrade).collect()
    };
    let mut b = StatsBuilder::with_detail(detail.clone());
    for s in live {
        s.collect(&mut b);
    }
    b.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn prometheus_text_has_help_type_and_sorted_labels() {
        let mut b = StatsBuilder::new();
        b.counter("b_total", "B things.", &[("z", "1"), ("a", "2")], 5);
        b.gauge("a_seconds", "A time.", &[], 0.25);
        b.counter(
            "b_total",
            "ignored second help",
            &[("z", "3"), ("a", "4")],
            6,
        );
        let text = b.finish().to_prometheus();
        assert_eq!(
            text,
            "# HELP a_seconds A time.\n# TYPE a_seconds gauge\na_seconds 0.25\n\
             # HELP b_total B things.\n# TYPE b_total counter\n\
             b_total{a=\"2\",z=\"1\"} 5\nb_total{a=\"4\",z=\"3\"} 6\n"
        );
    }

    #[test]
    fn help_and_label_values_are_escaped() {
        let mut b = StatsBuilder::new();
        b.gauge_int(
            "x",
            "line1\nback\\slash \"quoted\"",
            &[("peer", "a\"b\\c\nd")],
            1,
        );
        let text = b.finish().to_prometheus();
        assert!(
            text.contains("# HELP x line1\\nback\\\\slash \"quoted\"\n"),
            "{text}"
        );
        assert!(text.contains("x{peer=\"a\\\"b\\\\c\\nd\"} 1\n"), "{text}");
    }

    #[test]
    fn invalid_names_are_sanitized() {
        assert_eq!(sanitize_name("softwarp.qp-tx", true), "softwarp_qp_tx");
        assert_eq!(sanitize_name("9lives", true), "_9lives");
        assert_eq!(sanitize_name("a:b", true), "a:b");
        assert_eq!(sanitize_name("a:b", false), "a_b");
        assert_eq!(sanitize_name("", false), "_");
        assert_eq!(sanitize_name("qpé", false), "qp_");
    }

    #[test]
    fn detail_picks_per_object_series_by_count_or_number() {
        let auto = Detail::default();
        assert!(auto.wants_qp(7, PER_OBJECT_LIMIT));
        assert!(!auto.wants_qp(7, PER_OBJECT_LIMIT + 1));
        assert!(auto.wants_cqs(1) && !auto.wants_cqs(PER_OBJECT_LIMIT + 1));
        assert!(Detail::All.wants_qp(7, 100_000) && Detail::All.wants_cqs(100_000));
        let some = Detail::Qps(vec![7]);
        assert!(some.wants_qp(7, 100_000) && !some.wants_qp(8, 1) && !some.wants_cqs(1));
        assert_eq!(Detail::from_query(""), Detail::Auto);
        assert_eq!(Detail::from_query("qp=7&qp=9&x=1"), Detail::Qps(vec![7, 9]));
        assert_eq!(Detail::from_query("per_qp=1"), Detail::All);
        assert_eq!(Detail::from_query("detail=all&qp=3"), Detail::All);
        assert_eq!(
            serde_json::to_string(&Detail::Qps(vec![5])).unwrap(),
            r#"{"qps":[5]}"#
        );
        assert_eq!(serde_json::to_string(&Detail::All).unwrap(), r#""all""#);
    }

    #[test]
    fn special_float_values_use_prometheus_spelling() {
        assert_eq!(Value::Float(f64::NAN).to_string(), "NaN");
        assert_eq!(Value::Float(f64::INFINITY).to_string(), "+Inf");
        assert_eq!(Value::Float(f64::NEG_INFINITY).to_string(), "-Inf");
        assert_eq!(Value::Int(u64::MAX).to_string(), "18446744073709551615");
    }

    #[test]
    fn a_name_used_with_both_types_keeps_the_first_and_reports_the_conflict() {
        let mut b = StatsBuilder::new();
        b.counter("m", "counter", &[], 1);
        b.gauge("m", "gauge", &[], 2.0);
        let s = b.finish();
        assert_eq!(s.families.len(), 1);
        assert_eq!(s.families[0].samples.len(), 1);
        assert_eq!(s.conflicts, ["m"]);
    }

    #[test]
    fn json_round_trips() {
        let mut b = StatsBuilder::new();
        b.counter("c_total", "c", &[("qpn", "1")], 7);
        b.gauge("g", "g", &[], 1.5);
        let s = b.finish();
        let back: StatsSnapshot = serde_json::from_str(&s.to_json()).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.get("c_total", &[("qpn", "1")]), Some(Value::Int(7)));
        assert_eq!(back.get("c_total", &[]), None);
    }

    #[test]
    fn rates_are_deltas_per_second_and_survive_resets() {
        let snap = |v: u64, g: f64| {
            let mut b = StatsBuilder::new();
            b.counter("c_total", "c", &[("qpn", "1")], v);
            b.gauge("g", "g", &[], g);
            b.finish()
        };
        let r = snap(300, 2.0).rates(&snap(100, 1.0), Duration::from_secs(2));
        assert_eq!(r.get("c_total", &[("qpn", "1")]), Some(Value::Float(100.0)));
        assert_eq!(r.get("g", &[]), Some(Value::Float(2.0)));
        let reset = snap(50, 0.0).rates(&snap(100, 0.0), Duration::from_secs(1));
        assert_eq!(
            reset.get("c_total", &[("qpn", "1")]),
            Some(Value::Float(50.0))
        );
        let zero = snap(50, 0.0).rates(&snap(0, 0.0), Duration::ZERO);
        assert_eq!(
            zero.get("c_total", &[("qpn", "1")]),
            Some(Value::Float(0.0))
        );
    }

    #[test]
    fn registered_sources_are_collected_while_alive() {
        struct S(u64);
        impl StatsSource for S {
            fn collect(&self, out: &mut StatsBuilder) {
                out.counter(
                    "unit_source_total",
                    "t",
                    &[("id", &self.0.to_string())],
                    self.0,
                );
            }
        }
        let s: Arc<dyn StatsSource> = Arc::new(S(4242));
        register_source(Arc::downgrade(&s));
        assert_eq!(
            collect_all().get("unit_source_total", &[("id", "4242")]),
            Some(Value::Int(4242))
        );
        drop(s);
        assert_eq!(
            collect_all().get("unit_source_total", &[("id", "4242")]),
            None
        );
    }
}
