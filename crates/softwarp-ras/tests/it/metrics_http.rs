//! The opt-in metrics endpoint: GET /metrics serves valid Prometheus text on loopback;
//! other paths and methods get proper errors; a client that sends nothing cannot block it.

#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use softwarp_ras::stats::{MetricsServer, StatsBuilder, PROMETHEUS_CONTENT_TYPE};

use crate::common;

fn render() -> String {
    let mut b = StatsBuilder::new();
    b.counter(
        "softwarp_qp_rx_messages_total",
        "Messages received.",
        &[("device", "softwarp0"), ("qpn", "1"), ("op", "write")],
        9,
    );
    b.gauge(
        "softwarp_tcp_rtt_seconds",
        "RTT.",
        &[("qpn", "1")],
        0.000_042,
    );
    b.finish().to_prometheus()
}

fn get(addr: SocketAddr, request: &str) -> (String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    (head.to_string(), body.to_string())
}

#[test]
fn get_metrics_serves_parseable_prometheus_text_on_loopback() {
    let server = MetricsServer::start_local(0, render).unwrap();
    let addr = server.local_addr();
    assert!(addr.ip().is_loopback());
    let (head, body) = get(
        addr,
        "GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n",
    );
    assert!(head.starts_with("HTTP/1.0 200 OK"), "{head}");
    assert!(head.contains(&format!("Content-Type: {PROMETHEUS_CONTENT_TYPE}")));
    assert!(head.contains(&format!("Content-Length: {}", body.len())));
    assert_eq!(body, render());
    let fams = common::prom::parse(&body).unwrap();
    assert_eq!(fams["softwarp_qp_rx_messages_total"].samples[0].1, 9.0);
}

#[test]
fn other_paths_methods_and_garbage_get_errors() {
    let server = MetricsServer::start_local(0, render).unwrap();
    let addr = server.local_addr();
    assert!(get(addr, "GET / HTTP/1.0\r\n\r\n")
        .0
        .starts_with("HTTP/1.0 404"));
    let (head, _) = get(addr, "POST /metrics HTTP/1.0\r\n\r\n");
    assert!(head.starts_with("HTTP/1.0 405"));
    assert!(head.contains("Allow: GET, HEAD"));
    assert!(get(addr, "hello\n\n").0.starts_with("HTTP/1.0 400"));
    let (head, body) = get(addr, "HEAD /metrics HTTP/1.0\r\n\r\n");
    assert!(head.starts_with("HTTP/1.0 200"));
    assert!(body.is_empty());
}

#[test]
fn a_silent_client_is_dropped_after_the_request_timeout() {
    let server = MetricsServer::start_local(0, render).unwrap();
    let addr = server.local_addr();
    let _silent = TcpStream::connect(addr).unwrap();
    let t0 = Instant::now();
    let (head, _) = get(addr, "GET /metrics HTTP/1.0\r\n\r\n");
    assert!(head.starts_with("HTTP/1.0 200"));
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    let t0 = Instant::now();
    drop(server);
    assert!(t0.elapsed() < Duration::from_secs(3));
}

#[test]
fn a_panicking_collector_gets_a_500_and_the_endpoint_survives() {
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let c = std::sync::Arc::clone(&calls);
    let server = MetricsServer::start_local(0, move || {
        if c.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 0 {
            panic!("collector bug");
        }
        render()
    })
    .unwrap();
    let addr = server.local_addr();
    assert!(get(addr, "GET /metrics HTTP/1.0\r\n\r\n")
        .0
        .starts_with("HTTP/1.0 500"));
    assert!(get(addr, "GET /metrics HTTP/1.0\r\n\r\n")
        .0
        .starts_with("HTTP/1.0 200"));
}
