//! The verbs objects are wired into the RAS services: resources with the application's
//! source line and live state, exact statistics, critical events, leak reports at device
//! close, and flight recorder records. In-process checks through `softwarp_ras`'s process-wide
//! views (the CLI's end-to-end tests are in `softwarp-cli/tests/admin.rs`).
//!
//! Every check filters on the device's instance name (`softwarp0/<n>`): tests of this binary
//! run in parallel and each opens its own devices.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use crate::util::*;
use softwarp::*;
use softwarp_ras::stats::{self, Detail, StatsSnapshot, Value, PER_OBJECT_LIMIT};
use softwarp_ras::trace::{self, Record};
use softwarp_ras::tracker::{self, ResourceInfo, ResourceKind};

const LW: AccessFlags = AccessFlags::LOCAL_WRITE;

fn resources_of(dev: &Device) -> Vec<ResourceInfo> {
    tracker::all_resources()
        .into_iter()
        .filter(|r| r.tracker == dev.instance_name())
        .collect()
}

fn counter(s: &StatsSnapshot, name: &str, labels: &[(&str, &str)]) -> u64 {
    match s.get(name, labels) {
        Some(Value::Int(n)) => n,
        other => panic!("{name} {labels:?}: {other:?}"),
    }
}

/// Records of the flight recorder whose message or fields contain `needle`, waiting up to
/// `WAIT` for at least one.
fn wait_records(needle: &str) -> Vec<Record> {
    let deadline = Instant::now() + WAIT;
    loop {
        let found: Vec<Record> = trace::flight_recorder()
            .snapshot()
            .into_iter()
            .filter(|r| r.message.contains(needle) || r.fields.contains(needle))
            .collect();
        if !found.is_empty() {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "no flight recorder record contains {needle:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn counters_match_the_traffic_sent_exactly() {
    const N: usize = 40;
    const S: usize = 1500;
    let (a, b) = pair(&ConnectOptions::default());
    let (sink, _) = b.mr(N * S, LW, 0);
    for i in 0..N {
        b.qp.post_recv(&RecvWr {
            wr_id: i as u64,
            sgl: SgList::single(sink.sge(i * S, S as u32).unwrap()),
        })
        .unwrap();
    }
    let (src, _) = a.mr(S, AccessFlags::NONE, 1);
    for i in 0..N {
        a.qp.post_send(&send_wr(
            i as u64,
            send_op(false, None),
            Payload::Sgl(SgList::single(src.sge(0, S as u32).unwrap())),
        ))
        .unwrap();
    }
    wait_wcs(&a.scq, N);
    wait_wcs(&b.rcq, N);

    let snap = stats::collect_all();
    let (aq, bq) = (a.qp.qp_num().to_string(), b.qp.qp_num().to_string());
    let la = [
        ("device", a.dev.instance_name()),
        ("qpn", aq.as_str()),
        ("op", "send"),
    ];
    let lb = [
        ("device", b.dev.instance_name()),
        ("qpn", bq.as_str()),
        ("op", "send"),
    ];
    assert_eq!(
        counter(&snap, "softwarp_qp_tx_messages_total", &la),
        N as u64
    );
    assert_eq!(
        counter(&snap, "softwarp_qp_tx_bytes_total", &la),
        (N * S) as u64
    );
    assert_eq!(
        counter(&snap, "softwarp_qp_rx_messages_total", &lb),
        N as u64
    );
    assert_eq!(
        counter(&snap, "softwarp_qp_rx_bytes_total", &lb),
        (N * S) as u64
    );
    // The device's sums over its QPs (the default answer's series at any scale).
    let sums = stats::collect(&Detail::Auto);
    let da = [("device", a.dev.instance_name()), ("op", "send")];
    let db = [("device", b.dev.instance_name()), ("op", "send")];
    assert_eq!(
        counter(&sums, "softwarp_device_qp_tx_bytes", &da),
        (N * S) as u64
    );
    assert_eq!(
        counter(&sums, "softwarp_device_qp_rx_messages", &db),
        N as u64
    );
    // Nothing was received by the sender, nothing sent by the receiver.
    assert_eq!(counter(&snap, "softwarp_qp_rx_messages_total", &la), 0);
    assert_eq!(counter(&snap, "softwarp_qp_tx_messages_total", &lb), 0);
    // The CQs saw exactly the completions polled.
    let cq = |dev: &Device, cq: &CompletionQueue| {
        let id = cq.id().0.to_string();
        let l = [("device", dev.instance_name()), ("cq", id.as_str())];
        (
            counter(&snap, "softwarp_cq_completions_total", &l),
            counter(&snap, "softwarp_cq_polled_total", &l),
        )
    };
    assert_eq!(cq(&a.dev, &a.scq), (N as u64, N as u64));
    assert_eq!(cq(&b.dev, &b.rcq), (N as u64, N as u64));
    // Each device's progress thread serves its one connected QP; its counters are there.
    for e in [&a, &b] {
        let d = [("device", e.dev.instance_name())];
        assert_eq!(
            snap.get("softwarp_progress_qps", &d),
            Some(Value::Int(1)),
            "{d:?}"
        );
        assert!(counter(&snap, "softwarp_progress_wakeups_total", &d) > 0);
        assert_eq!(
            counter(&snap, "softwarp_progress_qp_visits_total", &d),
            e.dev.progress_stats().qp_visits
        );
    }
    // A connected QP has a TCP_INFO sample.
    let tcp = [("device", a.dev.instance_name()), ("qpn", aq.as_str())];
    assert!(snap.get("softwarp_tcp_rtt_seconds", &tcp).is_some());
    // The Prometheus text carries them too.
    let text = snap.to_prometheus();
    let line = format!(
        "softwarp_qp_tx_bytes_total{{device=\"{}\",op=\"send\",qpn=\"{aq}\"}} {}\n",
        a.dev.instance_name(),
        N * S
    );
    assert!(text.contains(&line), "{line} not in the exposition");
}

/// One 8-byte Send from `from` into a receive posted at `to` (completions left queued);
/// returns the two regions, to be kept until the Send completed.
fn one_send(from: &End, to: &End) -> (MemoryRegion, MemoryRegion) {
    let (sink, _) = to.mr(8, LW, 0);
    to.qp
        .post_recv(&RecvWr {
            wr_id: 1,
            sgl: SgList::single(sink.sge(0, 8).unwrap()),
        })
        .unwrap();
    let (src, _) = from.mr(8, AccessFlags::NONE, 1);
    from.qp
        .post_send(&send_wr(
            9,
            send_op(false, None),
            Payload::Sgl(SgList::single(src.sge(0, 8).unwrap())),
        ))
        .unwrap();
    (src, sink)
}

#[test]
fn a_thread_polling_an_empty_cq_for_long_sleeps_now_and_then() {
    let (a, b) = pair(&ConnectOptions::default());
    let id = a.scq.id().0.to_string();
    let sleeps = || {
        let l = [("device", a.dev.instance_name()), ("cq", id.as_str())];
        counter(&stats::collect_all(), "softwarp_cq_idle_sleeps_total", &l)
    };
    let mut wcs = [EMPTY_COMPLETION; 4];
    let mut poll_empty = |n: u32| {
        for _ in 0..n {
            assert_eq!(a.scq.poll(&mut wcs).unwrap(), 0);
        }
    };
    assert!(a.scq.idle_sleep(), "on by default");
    // A first message from a (the initiator: b may send once a has).
    let _first = one_send(&a, &b);
    assert_eq!(wait_wcs(&b.rcq, 1)[0].status, WcStatus::Success);
    wait_wcs(&a.scq, 1);
    // Spinning first: no sleep within IDLE_SPIN_POLLS empty polls.
    poll_empty(IDLE_SPIN_POLLS - 1);
    assert_eq!(sleeps(), 0);
    // Then one sleep every 1024 empty polls: the IDLE_SPIN_POLLS-th and two more.
    poll_empty(1 + 2048);
    assert_eq!(sleeps(), 3);
    // Off: spins for ever.
    a.scq.set_idle_sleep(false);
    poll_empty(4096);
    assert_eq!(sleeps(), 3);
    // Busy-poll mode never sleeps either (its polls move the bytes).
    a.scq.set_idle_sleep(true);
    a.scq.set_busy_poll(true);
    poll_empty(2048);
    assert_eq!(sleeps(), 3);
    a.scq.set_busy_poll(false);
    // A completion taken on this thread, from another CQ, ends the run: a thread that
    // takes completions is not idle, even if it also polls a CQ that stays empty.
    let _second = one_send(&b, &a);
    assert_eq!(wait_wcs(&a.rcq, 1)[0].status, WcStatus::Success);
    poll_empty(IDLE_SPIN_POLLS - 1);
    assert_eq!(sleeps(), 3);
}

#[test]
fn every_object_is_listed_with_the_line_that_created_it() {
    opt_in_ras();
    let dev = Device::open_default().unwrap();
    let dev_line = line!() - 1;
    let pd = dev.alloc_pd().unwrap();
    let pd_line = line!() - 1;
    let cq = dev.create_cq(64, None).unwrap();
    let cq_line = line!() - 1;
    let mr = pd.reg_mr(8192, LW).unwrap();
    let mr_line = line!() - 1;
    let srq_attr = SrqInitAttr {
        max_wr: 16,
        max_sge: 1,
        srq_limit: 0,
    };
    let srq = pd.create_srq(&srq_attr).unwrap();
    let srq_line = line!() - 1;
    let qp = pd.create_qp(&QpInitAttr::new(&cq, &cq)).unwrap();
    let qp_line = line!() - 1;

    let res = resources_of(&dev);
    let find = |kind: ResourceKind| {
        res.iter()
            .find(|r| r.kind == kind)
            .unwrap_or_else(|| panic!("no {kind} in {res:#?}"))
    };
    for (kind, line) in [
        (ResourceKind::Device, dev_line),
        (ResourceKind::Pd, pd_line),
        (ResourceKind::Cq, cq_line),
        (ResourceKind::Mr, mr_line),
        (ResourceKind::Srq, srq_line),
        (ResourceKind::Qp, qp_line),
    ] {
        let r = find(kind);
        assert!(r.file.ends_with("ras_wiring.rs"), "{kind}: {}", r.file);
        assert_eq!(r.line, line, "{kind}");
        assert_eq!(r.pid, std::process::id());
        assert!(r.bytes > 0, "{kind} has a size");
    }
    assert_eq!(find(ResourceKind::Qp).id, u64::from(qp.qp_num()));
    assert_eq!(find(ResourceKind::Mr).id, u64::from(mr.stag().0));
    let qp_details = find(ResourceKind::Qp).details.clone().unwrap();
    assert_eq!(qp_details.state.as_deref(), Some("IDLE"));
    assert_eq!(
        qp_details.attrs.get("send_cq"),
        Some(&cq.id().0.to_string())
    );
    assert_eq!(
        find(ResourceKind::Mr)
            .details
            .as_ref()
            .and_then(|d| d.attrs.get("len"))
            .map(String::as_str),
        Some("8192")
    );
    assert_eq!(
        find(ResourceKind::Device)
            .details
            .as_ref()
            .and_then(|d| d.state.as_deref()),
        Some("OPERATIONAL")
    );

    // Destroying an object unregisters it at once.
    drop(qp);
    drop(srq);
    drop(mr);
    let kinds: Vec<ResourceKind> = resources_of(&dev).iter().map(|r| r.kind).collect();
    assert_eq!(
        kinds,
        vec![ResourceKind::Device, ResourceKind::Pd, ResourceKind::Cq]
    );
    drop(cq);
    drop(pd);
    drop(dev);
}

#[test]
fn a_connected_qp_shows_its_state_and_peer_and_a_listener_its_address() {
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let l_line = line!() - 1;
    let addr = l.local_addr().unwrap();
    check_listed_listener(addr, l_line);
    drop(l);
    assert!(listed_listener(addr).is_none());

    let (a, b) = pair(&ConnectOptions::default());
    let qp = resources_of(&a.dev)
        .into_iter()
        .find(|r| r.kind == ResourceKind::Qp)
        .unwrap();
    let d = qp.details.unwrap();
    let info = a.info.clone().unwrap();
    assert_eq!(d.state.as_deref(), Some("RTS"));
    assert_eq!(d.peer_addr, Some(info.peer_addr));
    assert_eq!(d.local_addr, Some(info.local_addr));
    assert_eq!(d.attrs.get("crc").map(String::as_str), Some("on"));
    assert_eq!(d.attrs.get("mpa_rev").map(String::as_str), Some("2"));
    drop(b);
}

#[test]
fn a_connection_manager_listener_is_listed_at_its_listen_line_while_it_lives() {
    let ch = CmEventChannel::new().unwrap();
    let l = ch.listen("127.0.0.1:0", &ListenOptions::default());
    let l_line = line!() - 1;
    let l = l.unwrap();
    let addr = l.local_addr();
    check_listed_listener(addr, l_line);
    drop(l);
    assert!(listed_listener(addr).is_none());
}

/// The tracker's entry of the listener on `addr`, if any.
fn listed_listener(addr: std::net::SocketAddr) -> Option<ResourceInfo> {
    tracker::all_resources()
        .into_iter()
        .find(|r| r.kind == ResourceKind::Listener && r.id == u64::from(addr.port()))
}

/// The listener on `addr` is listed in the `cm` tracker, made at this file's `line`, LISTEN.
fn check_listed_listener(addr: std::net::SocketAddr, line: u32) {
    let listed = listed_listener(addr).expect("the listener is listed");
    assert_eq!(listed.tracker, "cm");
    assert!(listed.file.ends_with("ras_wiring.rs"), "{}", listed.file);
    assert_eq!(listed.line, line);
    let d = listed.details.unwrap();
    assert_eq!(d.state.as_deref(), Some("LISTEN"));
    assert_eq!(d.local_addr, Some(addr));
}

#[test]
fn a_leaked_qp_is_reported_at_device_close_with_its_file_and_line() {
    opt_in_ras();
    let dev = Device::open_default().unwrap();
    let instance = dev.instance_name().to_string();
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(16, None).unwrap();
    let qp = pd.create_qp(&QpInitAttr::new(&cq, &cq)).unwrap();
    let line = line!() - 1;
    drop(pd);
    drop(dev);
    // The close reported the QP (and the CQ its QP keeps); the PD was released in time.
    let records = wait_records(&format!("{instance}: "));
    let report = records
        .iter()
        .find(|r| r.message.contains("still allocated at close"))
        .expect("a leak report");
    assert_eq!(report.level, 1);
    let here = format!("{}:{line}:", file!());
    assert!(
        report
            .message
            .lines()
            .any(|l| l.contains(&format!("qp {} ", qp.qp_num())) && l.contains(&here)),
        "{here} not in {}",
        report.message
    );
    assert!(report.fields.contains("leak_at_close"), "{}", report.fields);
    assert!(
        !report
            .message
            .lines()
            .any(|l| l.trim_start().starts_with("pd ")),
        "{}",
        report.message
    );
    drop(qp);
    drop(cq);
}

#[test]
fn a_terminate_received_is_a_level_1_record_with_layer_type_and_code() {
    let (a, b) = pair(&ConnectOptions::default());
    a.qp.modify_to_error().unwrap();
    wait_state(&b.qp, QpState::Error);
    let needle = format!("device=\"{}\"", b.dev.instance_name());
    let deadline = Instant::now() + WAIT;
    let rec = loop {
        let found = wait_records(&needle)
            .into_iter()
            .find(|r| r.fields.contains("terminate_received"));
        if let Some(r) = found {
            break r;
        }
        assert!(Instant::now() < deadline, "no terminate_received record");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(rec.level, 1);
    assert_eq!(rec.qpn, Some(b.qp.qp_num()));
    assert!(rec.message.contains("layer 0"), "{}", rec.message);
    assert!(rec.message.contains("catastrophic"), "{}", rec.message);
    // The state change was traced at level 2 (kept by the flight recorder).
    assert!(trace::flight_recorder()
        .snapshot()
        .iter()
        .any(|r| r.qpn == Some(b.qp.qp_num())
            && r.message == "QP state change"
            && r.fields.contains(&needle)
            && r.fields.contains("to=\"ERROR\"")));
}

#[test]
fn an_injected_device_fault_is_a_device_fatal_record_naming_the_device() {
    let (a, b) = pair(&ConnectOptions::default());
    a.dev.inject_fatal_error();
    let needle = format!("device=\"{}\"", a.dev.instance_name());
    let deadline = Instant::now() + WAIT;
    loop {
        let found = trace::flight_recorder().snapshot().into_iter().any(|r| {
            r.level == 1 && r.fields.contains("device_fatal") && r.fields.contains(&needle)
        });
        if found {
            break;
        }
        assert!(Instant::now() < deadline, "no device_fatal record");
        std::thread::sleep(Duration::from_millis(5));
    }
    wait_state(&a.qp, QpState::Error);
    drop(b);
}

/// Samples of `name` whose `device` label is `dev`.
fn samples_of(s: &StatsSnapshot, name: &str, dev: &str) -> usize {
    s.families
        .iter()
        .filter(|f| f.name == name)
        .flat_map(|f| &f.samples)
        .filter(|x| x.labels.get("device").map(String::as_str) == Some(dev))
        .count()
}

#[test]
fn a_device_of_many_qps_gives_its_sums_and_the_qps_asked_for() {
    let dev = Device::open_default().unwrap();
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(16, None).unwrap();
    let n = PER_OBJECT_LIMIT + 1;
    let qps: Vec<QueuePair> = (0..n)
        .map(|_| pd.create_qp(&QpInitAttr::new(&cq, &cq)).unwrap())
        .collect();
    let name = dev.instance_name();
    let per_qp = "softwarp_qp_tx_messages_total";

    // The default: no QP's own series, the device's sums and how many were left out.
    let auto = stats::collect(&Detail::Auto);
    assert_eq!(samples_of(&auto, per_qp, name), 0);
    assert_eq!(samples_of(&auto, "softwarp_qp_info", name), 0);
    let l = [("device", name)];
    assert_eq!(
        counter(&auto, "softwarp_device_qp_series_omitted", &l),
        n as u64
    );
    assert_eq!(
        counter(
            &auto,
            "softwarp_device_qps",
            &[("device", name), ("state", "IDLE")]
        ),
        n as u64
    );
    assert_eq!(
        counter(
            &auto,
            "softwarp_device_resources",
            &[("device", name), ("kind", "qp")]
        ),
        n as u64
    );

    // One QP asked for by number: its series (8 operations), no other QP's.
    let qpn = qps[7].qp_num();
    let one = stats::collect(&Detail::Qps(vec![qpn]));
    assert_eq!(samples_of(&one, per_qp, name), 8);
    let q = qpn.to_string();
    assert_eq!(
        counter(
            &one,
            per_qp,
            &[("device", name), ("qpn", q.as_str()), ("op", "send")]
        ),
        0
    );
    assert_eq!(
        counter(&one, "softwarp_device_qp_series_omitted", &l),
        n as u64 - 1
    );

    // All of them when asked.
    let all = stats::collect(&Detail::All);
    assert_eq!(samples_of(&all, per_qp, name), 8 * n);
    assert_eq!(counter(&all, "softwarp_device_qp_series_omitted", &l), 0);
    drop(qps);
}
