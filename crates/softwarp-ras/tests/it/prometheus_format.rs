//! The Prometheus text written by `StatsSnapshot::to_prometheus` is checked by an
//! independent strict parser (tests/it/common/prom.rs): HELP and TYPE per metric before its
//! samples, samples grouped, names valid, escapes correct, values numeric.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use softwarp_ras::stats::{StatsBuilder, TcpInfo};

use crate::common;

#[test]
fn a_realistic_qp_export_parses_with_every_value_and_label() {
    let mut b = StatsBuilder::new();
    for qpn in [1u32, 2] {
        let q = qpn.to_string();
        for (op, n) in [("send", 10u64), ("write", 20), ("read_request", 3)] {
            let labels = [("device", "softwarp0"), ("qpn", q.as_str()), ("op", op)];
            b.counter(
                "softwarp_qp_tx_messages_total",
                "Messages sent, per RDMAP operation.",
                &labels,
                n * u64::from(qpn),
            );
            b.counter(
                "softwarp_qp_tx_bytes_total",
                "Payload bytes sent, per RDMAP operation.",
                &labels,
                n * 4096,
            );
        }
        b.counter(
            "softwarp_qp_crc_errors_total",
            "FPDUs whose CRC did not match.",
            &[("device", "softwarp0"), ("qpn", q.as_str())],
            0,
        );
        b.gauge_int(
            "softwarp_qp_state",
            "QP state (1 RTS, 4 error) with the peer as a label.",
            &[("qpn", q.as_str()), ("peer", "[fe80::1%eth0]:4791")],
            1,
        );
    }
    let mut raw = [0u8; 232];
    raw[68..72].copy_from_slice(&1500u32.to_ne_bytes());
    TcpInfo::parse(&raw)
        .unwrap()
        .collect_into(&mut b, &[("device", "softwarp0"), ("qpn", "1")]);

    let text = b.finish().to_prometheus();
    let fams = common::prom::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let tx = &fams["softwarp_qp_tx_messages_total"];
    assert_eq!(tx.kind.as_deref(), Some("counter"));
    assert_eq!(
        tx.help.as_deref(),
        Some("Messages sent, per RDMAP operation.")
    );
    assert_eq!(tx.samples.len(), 6);
    let want: BTreeMap<String, String> = [("device", "softwarp0"), ("op", "write"), ("qpn", "2")]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    assert!(tx.samples.contains(&(want, 40.0)));
    assert_eq!(fams["softwarp_qp_state"].kind.as_deref(), Some("gauge"));
    assert_eq!(
        fams["softwarp_qp_state"].samples[0].0["peer"],
        "[fe80::1%eth0]:4791"
    );
    assert_eq!(fams["softwarp_tcp_rtt_seconds"].samples[0].1, 0.0015);
    assert_eq!(fams["softwarp_tcp_acked_bytes_total"].samples[0].1, 0.0);
}

#[test]
fn hostile_help_and_label_text_round_trips_through_the_parser() {
    let help = "multi\nline \\ help with \"quotes\" and {braces}";
    let value = "a\"b\\c\nd} e,f=g";
    let mut b = StatsBuilder::new();
    b.gauge(
        "weird_metric",
        help,
        &[("label", value), ("9bad-name", "x")],
        f64::NAN,
    );
    b.gauge("inf_metric", "inf", &[], f64::NEG_INFINITY);
    let text = b.finish().to_prometheus();
    let fams = common::prom::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let w = &fams["weird_metric"];
    assert_eq!(w.help.as_deref(), Some(help));
    assert_eq!(w.samples[0].0["label"], value);
    assert_eq!(
        w.samples[0].0["_9bad_name"], "x",
        "label names are sanitized"
    );
    assert!(w.samples[0].1.is_nan());
    assert_eq!(fams["inf_metric"].samples[0].1, f64::NEG_INFINITY);
}

#[test]
fn the_parser_rejects_what_prometheus_rejects() {
    use common::prom::parse;
    assert!(parse("m 1\n").is_ok());
    assert!(parse("m 1").is_err(), "no final newline");
    assert!(parse("m{a=\"1\"} x\n").is_err(), "bad value");
    assert!(parse("m{a=\"1} 1\n").is_err(), "unterminated label");
    assert!(parse("m{a=\"\\t\"} 1\n").is_err(), "bad escape");
    assert!(parse("1m 1\n").is_err(), "bad name");
    assert!(
        parse("m 1\n# TYPE m counter\n").is_err(),
        "TYPE after samples"
    );
    assert!(
        parse("# TYPE m counter\n# TYPE m gauge\n").is_err(),
        "second TYPE"
    );
    assert!(parse("a 1\nb 1\na 2\n").is_err(), "samples not grouped");
}

#[test]
fn an_empty_snapshot_is_an_empty_exposition() {
    let text = StatsBuilder::new().finish().to_prometheus();
    assert_eq!(text, "");
    assert!(common::prom::parse(&text).unwrap().is_empty());
}
