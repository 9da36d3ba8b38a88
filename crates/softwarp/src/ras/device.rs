//! The RAS wiring of a device: its critical events (close with leaks, fault, recovery, a
//! QP whose network went), its description (`softwarp resources`) and its statistics,
//! which include those of its QPs and CQs.

use softwarp_ras::control::DefaultHandler;
use softwarp_ras::dump::{self, AutoDumpConfig};
use softwarp_ras::errlog::{self, CriticalEvent, CriticalKind};
use softwarp_ras::stats::{StatsBuilder, StatsSource};
use softwarp_ras::sw_event;
use softwarp_ras::tracker::{DescribeResource, ResourceDetails, ResourceKind};

use super::qp::QpSums;
use crate::instrument::{attrs, Tracked};
use crate::verbs::device::DeviceShared;

/// The last `Device` handle is gone: reports what is still allocated (with the source line
/// that created each) to the error log and as a level 1 trace record.
pub(super) fn device_closed(dev: &DeviceShared, device: &Tracked) {
    let report = dev.ras.tracker.leak_report(Some(device.handle()));
    sw_event!(
        Runtime,
        4,
        device = dev.ras.tracker.name(),
        leaked = report.leaked.len(),
        "device closed"
    );
    if !report.is_empty() {
        errlog::report(&CriticalEvent::leak(&report));
    }
}

/// `Device::inject_fatal_error` moved `qps` QPs to Error and snapshotted them (`snapshots`:
/// the ids): reports the device fatal error, then writes an automatic component dump if the
/// RAS services run (file
/// and network I/O: call it with no lock held).
/// A device fault was contained (`crate::availability::recovery::contain`): the error log line with the
/// recommended action.
pub(super) fn device_failed(dev: &DeviceShared, fault: &str, qps: usize, snapshots: &[u64]) {
    let ids: Vec<String> = snapshots.iter().map(u64::to_string).collect();
    errlog::report(
        &CriticalEvent::new(
            CriticalKind::DeviceFatal,
            format!(
                "{fault}: {qps} QP(s) moved to Error (snapshots: {})",
                if ids.is_empty() {
                    "none".to_string()
                } else {
                    ids.join(", ")
                }
            ),
        )
        .with_device(dev.ras.tracker.name()),
    );
}

/// The automatic dump of a device fault (while the RAS services run; at most one a second).
pub(super) fn device_fault_dump(fault: &str) {
    let reason = format!("device fatal: {fault}");
    dump::auto_dump(&AutoDumpConfig::from_env(), &DefaultHandler, &reason);
}

/// A recovery ended: the error log line (outcome, time, holders, terminations) and a level
/// 1 or 2 record.
pub(super) fn device_recovery(dev: &DeviceShared, r: &softwarp_ras::health::RecoveryReport) {
    let holders = crate::availability::recovery::holder_lines(&r.holders);
    let terminated: Vec<String> = r
        .terminated
        .iter()
        .map(|t| {
            format!(
                "{} to pid {} ({}) at {} ms",
                t.signal, t.pid, t.process, t.at_ms
            )
        })
        .collect();
    let mut detail = format!(
        "recovery {} after {} ms (bound {} ms)",
        r.outcome.as_str(),
        r.elapsed_ms,
        r.bound_ms
    );
    if !terminated.is_empty() {
        detail.push_str(&format!("; signals: {}", terminated.join(", ")));
    }
    if !holders.is_empty() {
        detail.push_str(&format!("; still held: {}", holders.join("; ")));
    }
    if !r.unreachable.is_empty() {
        detail.push_str(&format!("; not answering: {}", r.unreachable.join("; ")));
    }
    sw_event!(Runtime, 2, device = dev.ras.instance(), "{}", detail);
    errlog::report(
        &CriticalEvent::new(CriticalKind::DeviceRecovery, detail)
            .with_device(dev.ras.tracker.name()),
    );
}

/// A QP whose network went away was terminated: the error log line, naming its snapshot.
pub(super) fn network_gone(dev: &DeviceShared, qpn: u32, detail: &str, snapshot: Option<u64>) {
    let event = CriticalEvent::new(
        CriticalKind::NetworkGone,
        format!("QP {qpn} terminated at once (unexpected close): {detail}"),
    )
    .with_device(dev.ras.tracker.name())
    .with_qpn(qpn);
    errlog::report(&match snapshot {
        Some(id) => event.with_snapshot(id),
        None => event,
    });
}

impl DescribeResource for DeviceShared {
    fn describe(&self) -> ResourceDetails {
        ResourceDetails {
            state: Some(self.health.state().as_str().to_string()),
            attrs: attrs([
                (
                    "fault",
                    self.health
                        .fault()
                        .map_or_else(|| "-".to_string(), |f| f.to_string()),
                ),
                (
                    "interface",
                    self.health.interface.clone().unwrap_or_else(|| "-".into()),
                ),
                (
                    "recovery",
                    self.health.recovery().map_or_else(
                        || "-".to_string(),
                        |r| format!("{} {} ms", r.outcome.as_str(), r.elapsed_ms),
                    ),
                ),
                ("fw_ver", self.attr.fw_ver.clone()),
                ("transport", self.attr.transport.to_string()),
                (
                    "resources",
                    self.ras.tracker.len().saturating_sub(1).to_string(),
                ),
            ]),
            markers: self.marker_words(),
            ..ResourceDetails::default()
        }
    }
}

impl StatsSource for DeviceShared {
    fn collect(&self, out: &mut StatsBuilder) {
        let dev = self.ras.tracker.name();
        let memory = self.ras.tracker.memory();
        for kind in ResourceKind::ALL {
            let usage = memory.kinds.get(&kind).copied().unwrap_or_default();
            let labels = [("device", dev), ("kind", kind.as_str())];
            out.gauge_int(
                "softwarp_device_resources",
                "Resources allocated, per kind.",
                &labels,
                usage.count,
            );
            out.gauge_int(
                "softwarp_device_resource_bytes",
                "Approximate memory held by the resources of each kind, in bytes.",
                &labels,
                usage.bytes,
            );
        }
        for (event, n) in self.events.counts() {
            out.counter(
                "softwarp_device_async_events_total",
                "Asynchronous events reported, per kind.",
                &[("device", dev), ("event", event)],
                n,
            );
        }
        out.counter(
            "softwarp_device_async_events_lost_total",
            "Asynchronous events dropped because nobody read the event queue.",
            &[("device", dev)],
            self.events.lost_count(),
        );
        self.health.collect(out, dev);
        let p = self.progress.counters.stats();
        let labels = [("device", dev)];
        out.gauge_int(
            "softwarp_progress_qps",
            "Connected QPs the device's progress thread serves.",
            &labels,
            p.served,
        );
        let counters = [
            (
                "softwarp_progress_wakeups_total",
                "Times the progress thread's epoll_wait returned.",
                p.wakeups,
            ),
            (
                "softwarp_progress_timer_looks_total",
                "QPs the progress thread looked at on a timer (receive stall and busy-poll looks).",
                p.timer_looks,
            ),
            (
                "softwarp_progress_qp_visits_total",
                "QP entries of the device's collections inserted, looked at or walked past.",
                p.qp_visits,
            ),
        ];
        for (name, help, v) in counters {
            out.counter(name, help, &labels, v);
        }
        // Each QP's series only as the builder's detail asks (at 100,000 QPs they are
        // millions of samples); the sums over all of them always.
        let detail = out.detail().clone();
        let qps = self.live_qps();
        let mut sums = QpSums::default();
        for qp in &qps {
            if detail.wants_qp(qp.qp_num(), qps.len()) {
                let view = qp.ras_view();
                sums.add(&view.counters());
                view.collect(out, dev);
            } else {
                sums.add(&qp.counters_view());
                sums.omitted += 1;
            }
        }
        sums.collect(out, dev);
        let cqs = self.cqs.live();
        if detail.wants_cqs(cqs.len()) {
            for cq in cqs {
                cq.ras_view().collect(out, dev);
            }
        }
    }
}
