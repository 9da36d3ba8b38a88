//! The RAS wiring of a QP: its critical events and failure snapshots, its description
//! (`softwarp resources`) and its statistics.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::fd::BorrowedFd;
use std::sync::atomic::Ordering;

use softwarp_engine::event::AsyncEvent;
use softwarp_engine::fault::Cause;
use softwarp_engine::qp::Qp;
use softwarp_engine::stats::{Counter, OpCounters, QpStats};
use softwarp_ras::errlog::{self, CriticalEvent, CriticalKind};
use softwarp_ras::snapshot::{
    self, QpSnapshot, TerminateInfo, SNAPSHOT_CONTEXT_RECORDS, SNAPSHOT_QP_RECORDS,
};
use softwarp_ras::stats::{StatsBuilder, TcpInfoSampler};
use softwarp_ras::sw_event;
use softwarp_ras::tracker::{DescribeResource, ResourceDetails};
use softwarp_wire::rdmap::TerminateError;

use crate::instrument::{state_name, QpRas};
use crate::sync::lock;
use crate::verbs::qp::options::ConnectionInfo;
use crate::verbs::qp::view::{QpCountersView, QpView};
use crate::verbs::qp::QpShared;

impl QpRas {
    fn peer(&self) -> Option<SocketAddr> {
        lock(&self.addrs).map(|(_, peer)| peer)
    }

    fn event(&self, kind: CriticalKind, detail: String) -> CriticalEvent {
        let ev = CriticalEvent::new(kind, detail)
            .with_device(&*self.device)
            .with_qpn(self.qpn);
        match self.peer() {
            Some(p) => ev.with_peer(p.to_string()),
            None => ev,
        }
    }

    /// Called (under the QP lock) for every asynchronous event of the QP before it goes to
    /// the device's event queue: errors become trace records and critical events, and the
    /// first failure of a connection a snapshot of `qp` that its error log line names.
    pub(super) fn on_event(
        &self,
        ev: &AsyncEvent,
        qp: &Qp,
        info: Option<&ConnectionInfo>,
        fd: Option<BorrowedFd<'_>>,
    ) {
        let (what, cause) = match *ev {
            AsyncEvent::QpFatal { cause, .. } => ("fatal error", cause),
            AsyncEvent::QpRequestError { cause, .. } => ("request error", cause),
            AsyncEvent::QpAccessError { cause, .. } => ("access error", cause),
            _ => return,
        };
        let (event, terminate) = match cause {
            Cause::PeerTerminate { layer, etype, code } => {
                let error = TerminateError::from_fields(layer, etype, code);
                sw_event!(
                    Qp,
                    2,
                    qpn = self.qpn,
                    device = &*self.device,
                    layer,
                    etype,
                    code,
                    "Terminate received: {}",
                    error
                );
                let event = self.event(
                    CriticalKind::TerminateReceived,
                    format!(
                        "QP {} {what}: the peer sent a Terminate: {error} \
                         (layer {layer}, error type {etype}, error code {code:#04x})",
                        self.qpn
                    ),
                );
                let terminate = TerminateInfo {
                    direction: "received".into(),
                    layer: Some(layer),
                    etype: Some(etype),
                    code: Some(code),
                    text: error.to_string(),
                };
                (event, Some(terminate))
            }
            Cause::Detected(fault) => {
                sw_event!(
                    Qp,
                    2,
                    qpn = self.qpn,
                    device = &*self.device,
                    "Terminate sent: {:?} detected in the incoming stream",
                    fault
                );
                let event = self.event(
                    CriticalKind::QpFatal,
                    format!(
                        "QP {} {what}: {fault:?} detected in the peer's stream; a Terminate \
                         was sent and the QP is in Error",
                        self.qpn
                    ),
                );
                let terminate = TerminateInfo {
                    direction: "sent".into(),
                    layer: None,
                    etype: None,
                    code: None,
                    text: format!("{fault:?} detected in the peer's stream"),
                };
                (event, Some(terminate))
            }
            Cause::LocalOperation => {
                let event = self
                    .event(
                        CriticalKind::QpFatal,
                        format!(
                            "QP {} {what}: a work request failed local validation \
                             (lkey, PD, bounds or access rights of an SGE)",
                            self.qpn
                        ),
                    )
                    .with_action(
                        "Check the SGEs the application posts (lkey, offsets, lengths, \
                         LOCAL_WRITE for Read sinks); the QP must be destroyed or reset.",
                    );
                (event, None)
            }
            // The transport closed while in RTS: the usual end when the peer disconnects
            // first, so not a critical event.
            Cause::LlpClosed => {
                sw_event!(
                    Qp,
                    2,
                    qpn = self.qpn,
                    "the TCP connection closed or failed; QP to Error"
                );
                return;
            }
            Cause::Application => {
                sw_event!(Qp, 2, qpn = self.qpn, "QP to Error by the application");
                return;
            }
            other => (
                self.event(
                    CriticalKind::QpFatal,
                    format!("QP {} {what}: {other:?}", self.qpn),
                ),
                None,
            ),
        };
        let id = self.claim_snapshot();
        let (kind, reason) = (event.kind, event.detail.clone());
        errlog::report(&match id {
            Some(id) => event.with_snapshot(id),
            None => event,
        });
        if let Some(id) = id {
            self.capture(id, kind, reason, terminate, qp, info, fd);
        }
    }

    /// The id for this connection's snapshot, unless it has one already (one snapshot per
    /// failure: a QP reports several events as it fails).
    /// `None` as well when the history keeps none (`SOFTWARP_SNAPSHOTS=0`).
    fn claim_snapshot(&self) -> Option<u64> {
        let history = snapshot::history();
        if self.snapshot.load(Ordering::Relaxed) != 0 || history.capacity() == 0 {
            return None;
        }
        let id = history.reserve_id();
        self.snapshot
            .compare_exchange(0, id, Ordering::Relaxed, Ordering::Relaxed)
            .ok()
            .map(|_| id)
    }

    /// Takes the snapshot of this connection's failure (`kind`, `reason`) unless one was
    /// taken already; returns its id. Call with the QP locked (`qp` is its engine state).
    pub(super) fn snapshot(
        &self,
        kind: CriticalKind,
        reason: String,
        qp: &Qp,
        info: Option<&ConnectionInfo>,
        fd: Option<BorrowedFd<'_>>,
    ) -> Option<u64> {
        let id = self.claim_snapshot()?;
        self.capture(id, kind, reason, None, qp, info, fd);
        Some(id)
    }

    /// Copies the QP into snapshot `id` of the process's history. Takes only leaf locks
    /// (this QP's RAS locks, the flight recorder's, the history's).
    #[allow(clippy::too_many_arguments)]
    #[cold]
    fn capture(
        &self,
        id: u64,
        kind: CriticalKind,
        reason: String,
        terminate: Option<TerminateInfo>,
        qp: &Qp,
        info: Option<&ConnectionInfo>,
        fd: Option<BorrowedFd<'_>>,
    ) {
        let view = QpView::take(self, qp, info, fd);
        let mut s = QpSnapshot::new(id, &self.device, self.qpn);
        s.state = state_name(view.state).to_string();
        s.event = kind.as_str().to_string();
        s.reason = reason;
        s.terminate = terminate;
        s.local_addr = view.addrs.map(|(l, _)| l);
        s.peer_addr = view.addrs.map(|(_, p)| p);
        s.counters = counters_of(&view.stats);
        s.queues = [
            ("sq_outstanding", view.sq),
            ("rq_posted", view.rq),
            ("reads_outstanding", view.reads),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v as u64))
        .collect();
        s.tcp_info = view.tcp;
        s.attrs = view.details().attrs;
        s.records = softwarp_ras::trace::flight_recorder().records_of_qp(
            self.qpn,
            Some(&self.device),
            SNAPSHOT_QP_RECORDS,
            SNAPSHOT_CONTEXT_RECORDS,
        );
        snapshot::history().push(s);
        sw_event!(
            Ras,
            2,
            qpn = self.qpn,
            device = &*self.device,
            snapshot = id,
            "QP snapshot taken"
        );
    }

    /// The QP connected (MPA exchange done, RTS).
    pub(super) fn connected(&self, info: &ConnectionInfo) {
        *lock(&self.addrs) = Some((info.local_addr, info.peer_addr));
        // A new connection may fail and be snapshotted again.
        self.snapshot.store(0, Ordering::Relaxed);
        // A new connection (after a reset) starts without the old one's TCP_INFO.
        let interval = lock(&self.tcp).interval();
        *lock(&self.tcp) = TcpInfoSampler::new(interval);
        sw_event!(
            Cm,
            2,
            qpn = self.qpn,
            device = &*self.device,
            local = %info.local_addr,
            peer = %info.peer_addr,
            revision = info.revision,
            crc = info.crc,
            ird = info.ird,
            ord = info.ord,
            max_fpdu_len = info.max_fpdu_len,
            "QP connected"
        );
    }

    /// The kernel timed the connection out (`detail`: the error and what it means): a
    /// trace record and the error log's `peer_unreachable` line.
    pub(super) fn peer_unreachable(&self, detail: &str) {
        sw_event!(Qp, 2, qpn = self.qpn, "{}", detail);
        errlog::report(&self.event(
            CriticalKind::PeerUnreachable,
            format!("QP {}: {detail}; QP to Error", self.qpn),
        ));
    }

    /// The peer broke the protocol above RDMAP (`detail`, the whole sentence): a trace
    /// record and the error log's `peer_violation` line, naming the failure's snapshot.
    pub(super) fn peer_violation(&self, detail: String, snapshot: Option<u64>) {
        sw_event!(Qp, 2, qpn = self.qpn, "{}", detail);
        let event = self.event(CriticalKind::PeerViolation, detail);
        errlog::report(&match snapshot {
            Some(id) => event.with_snapshot(id),
            None => event,
        });
    }
}

impl QpView {
    fn details(self) -> ResourceDetails {
        let mut attrs = self.attrs;
        attrs.insert("sq_outstanding".into(), self.sq.to_string());
        attrs.insert("rq_posted".into(), self.rq.to_string());
        attrs.insert(
            "tcp".into(),
            if self.connected { "open" } else { "closed" }.into(),
        );
        if let Some(c) = self.conn {
            attrs.insert("mpa_rev".into(), c.revision.to_string());
            attrs.insert("crc".into(), if c.crc { "on" } else { "off" }.into());
            attrs.insert("ird".into(), c.ird.to_string());
            attrs.insert("ord".into(), c.ord.to_string());
            attrs.insert("mss".into(), c.mss.to_string());
            attrs.insert("max_fpdu".into(), c.max_fpdu_len.to_string());
        }
        if let Some(t) = self.tcp {
            attrs.insert("rtt_us".into(), t.rtt().as_micros().to_string());
            attrs.insert("retrans".into(), t.total_retrans.to_string());
        }
        if self.stats.terminates_sent + self.stats.terminates_received > 0 {
            attrs.insert(
                "terminates".into(),
                format!(
                    "sent {} received {}",
                    self.stats.terminates_sent, self.stats.terminates_received
                ),
            );
        }
        ResourceDetails {
            state: Some(state_name(self.state).to_string()),
            local_addr: self.addrs.map(|(l, _)| l),
            peer_addr: self.addrs.map(|(_, p)| p),
            attrs,
            markers: Vec::new(),
        }
    }

    pub(super) fn collect(&self, out: &mut StatsBuilder, dev: &str) {
        let qpn = self.qpn.to_string();
        let labels = [("device", dev), ("qpn", qpn.as_str())];
        let s = &self.stats;
        collect_ops(out, "tx", "sent", &s.tx, &labels);
        collect_ops(out, "rx", "received", &s.rx, &labels);
        for (name, help, v) in scalar_counters(s) {
            out.counter(name, help, &labels, v);
        }
        out.gauge_int(
            "softwarp_qp_rdma_reads_outstanding",
            "RDMA Reads (and atomics) outstanding.",
            &labels,
            self.reads as u64,
        );
        out.gauge_int(
            "softwarp_qp_send_queue_wrs",
            "Send work requests not yet completed.",
            &labels,
            self.sq as u64,
        );
        out.gauge_int(
            "softwarp_qp_recv_queue_wrs",
            "Receive work requests posted and not yet used.",
            &labels,
            self.rq as u64,
        );
        let peer = self
            .addrs
            .map(|(_, p)| p.to_string())
            .unwrap_or_else(|| "-".to_string());
        out.gauge_int(
            "softwarp_qp_info",
            "Always 1; the labels carry the QP's state and peer.",
            &[
                ("device", dev),
                ("qpn", qpn.as_str()),
                ("state", state_name(self.state)),
                ("peer", peer.as_str()),
            ],
            1,
        );
        if let Some(t) = &self.tcp {
            t.collect_into(out, &labels);
        }
    }
}

/// The engine's scalar counters of a QP: metric name, help, value.
fn scalar_counters(s: &QpStats) -> [(&'static str, &'static str, u64); 15] {
    [
        ("softwarp_qp_tx_fpdus_total", "FPDUs sent.", s.tx_fpdus),
        ("softwarp_qp_rx_fpdus_total", "FPDUs received.", s.rx_fpdus),
        (
            "softwarp_qp_tx_stream_bytes_total",
            "Bytes handed to TCP, all framing included.",
            s.tx_stream_bytes,
        ),
        (
            "softwarp_qp_rx_stream_bytes_total",
            "Bytes consumed from TCP, all framing included.",
            s.rx_stream_bytes,
        ),
        (
            "softwarp_qp_rx_staged_payload_bytes_total",
            "Payload bytes read ahead into a staging buffer and copied to their destination (the rest was read straight into it).",
            s.rx_staged_payload_bytes,
        ),
        (
            "softwarp_qp_rx_early_bytes_total",
            "Send payload bytes read into the next posted receive before their header was read, then confirmed by it.",
            s.rx_early_bytes,
        ),
        (
            "softwarp_qp_rx_early_missed_bytes_total",
            "Bytes read early into a posted receive that their header sent elsewhere (copied out again).",
            s.rx_early_missed_bytes,
        ),
        (
            "softwarp_qp_rx_run_fpdus_total",
            "FPDUs in the middle of a message taken by comparing their header with the one before (still validated and CRC-checked).",
            s.rx_run_fpdus,
        ),
        (
            "softwarp_qp_crc_errors_total",
            "FPDUs whose CRC did not match.",
            s.crc_errors,
        ),
        (
            "softwarp_qp_tx_markers_total",
            "MPA markers sent.",
            s.tx_markers,
        ),
        (
            "softwarp_qp_rx_markers_total",
            "MPA markers received and checked.",
            s.rx_markers,
        ),
        (
            "softwarp_qp_terminates_sent_total",
            "Terminate messages sent.",
            s.terminates_sent,
        ),
        (
            "softwarp_qp_terminates_received_total",
            "Terminate messages received.",
            s.terminates_received,
        ),
        (
            "softwarp_qp_flushed_total",
            "Work requests completed with a flush status.",
            s.flushed,
        ),
        (
            "softwarp_qp_events_lost_total",
            "Asynchronous events that did not fit the QP's event ring.",
            s.events_lost,
        ),
    ]
}

/// Sums over the QPs of a device (`softwarp stat`'s default at any scale: a device's
/// series, not millions of per-QP ones). Of the live QPs only: a closed QP's counts leave
/// the sums, so they are gauges.
#[derive(Debug, Default)]
pub(crate) struct QpSums {
    qps: u64,
    states: BTreeMap<&'static str, u64>,
    tx: [Counter; 8],
    rx: [Counter; 8],
    scalars: [u64; 15],
    sq: u64,
    rq: u64,
    reads: u64,
    /// QPs whose own series were left out.
    pub(crate) omitted: u64,
}

impl QpSums {
    /// Adds one QP.
    pub(crate) fn add(&mut self, v: &QpCountersView) {
        self.qps += 1;
        *self.states.entry(state_name(v.state)).or_default() += 1;
        for (sum, c) in [(&mut self.tx, &v.stats.tx), (&mut self.rx, &v.stats.rx)] {
            for (slot, (_, counter)) in sum.iter_mut().zip(ops(c)) {
                slot.messages = slot.messages.saturating_add(counter.messages);
                slot.bytes = slot.bytes.saturating_add(counter.bytes);
            }
        }
        for (slot, (_, _, n)) in self.scalars.iter_mut().zip(scalar_counters(&v.stats)) {
            *slot = slot.saturating_add(n);
        }
        self.sq = self.sq.saturating_add(v.sq as u64);
        self.rq = self.rq.saturating_add(v.rq as u64);
        self.reads = self.reads.saturating_add(v.reads as u64);
    }

    /// The device's `softwarp_device_qp*` series.
    pub(crate) fn collect(&self, out: &mut StatsBuilder, dev: &str) {
        let labels = [("device", dev)];
        for (state, n) in &self.states {
            out.gauge_int(
                "softwarp_device_qps",
                "Live QPs of the device, per state.",
                &[("device", dev), ("state", state)],
                *n,
            );
        }
        out.gauge_int(
            "softwarp_device_qp_series_omitted",
            "QPs whose own series this answer leaves out (more than the per-QP limit on the \
             device: ask for them by QP number or for all).",
            &labels,
            self.omitted,
        );
        let empty = OpCounters::default();
        for (dir, verb, sums) in [("tx", "sent", &self.tx), ("rx", "received", &self.rx)] {
            let messages = format!("softwarp_device_qp_{dir}_messages");
            let bytes = format!("softwarp_device_qp_{dir}_bytes");
            let messages_help =
                format!("RDMAP messages {verb} by the device's live QPs, per operation.");
            let bytes_help =
                format!("Payload bytes {verb} by the device's live QPs, per RDMAP operation.");
            for ((op, _), sum) in ops(&empty).into_iter().zip(sums) {
                let l = [("device", dev), ("op", op)];
                out.gauge_int(&messages, &messages_help, &l, sum.messages);
                out.gauge_int(&bytes, &bytes_help, &l, sum.bytes);
            }
        }
        for ((name, help, _), sum) in scalar_counters(&QpStats::default())
            .into_iter()
            .zip(self.scalars)
        {
            let name = name
                .replacen("softwarp_qp_", "softwarp_device_qp_", 1)
                .trim_end_matches("_total")
                .to_string();
            let help = format!("Sum over the device's live QPs: {help}");
            out.gauge_int(&name, &help, &labels, sum);
        }
        for (name, help, v) in [
            (
                "softwarp_device_qp_rdma_reads_outstanding",
                "RDMA Reads (and atomics) outstanding, over the device's QPs.",
                self.reads,
            ),
            (
                "softwarp_device_qp_send_queue_wrs",
                "Send work requests not yet completed, over the device's QPs.",
                self.sq,
            ),
            (
                "softwarp_device_qp_recv_queue_wrs",
                "Receive work requests posted and not yet used, over the device's QPs.",
                self.rq,
            ),
        ] {
            out.gauge_int(name, help, &labels, v);
        }
    }
}

/// The engine's counters of a QP by name (`tx_send_messages`, `rx_write_bytes`,
/// `terminates_received` ...), as a snapshot keeps them.
fn counters_of(s: &QpStats) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for (dir, c) in [("tx", &s.tx), ("rx", &s.rx)] {
        for (op, counter) in ops(c) {
            m.insert(format!("{dir}_{op}_messages"), counter.messages);
            m.insert(format!("{dir}_{op}_bytes"), counter.bytes);
        }
    }
    for (name, v) in [
        ("tx_fpdus", s.tx_fpdus),
        ("rx_fpdus", s.rx_fpdus),
        ("tx_stream_bytes", s.tx_stream_bytes),
        ("rx_stream_bytes", s.rx_stream_bytes),
        ("rx_staged_payload_bytes", s.rx_staged_payload_bytes),
        ("rx_early_bytes", s.rx_early_bytes),
        ("rx_early_missed_bytes", s.rx_early_missed_bytes),
        ("rx_run_fpdus", s.rx_run_fpdus),
        ("crc_errors", s.crc_errors),
        ("tx_markers", s.tx_markers),
        ("rx_markers", s.rx_markers),
        ("terminates_sent", s.terminates_sent),
        ("terminates_received", s.terminates_received),
        ("flushed", s.flushed),
        ("events_lost", s.events_lost),
    ] {
        m.insert(name.to_string(), v);
    }
    m
}

fn ops(c: &OpCounters) -> [(&'static str, Counter); 8] {
    [
        ("send", c.send),
        ("write", c.write),
        ("read_request", c.read_request),
        ("read_response", c.read_response),
        ("terminate", c.terminate),
        ("immediate", c.immediate),
        ("atomic_request", c.atomic_request),
        ("atomic_response", c.atomic_response),
    ]
}

fn collect_ops(
    out: &mut StatsBuilder,
    dir: &str,
    verb: &str,
    c: &OpCounters,
    labels: &[(&str, &str); 2],
) {
    let messages = format!("softwarp_qp_{dir}_messages_total");
    let bytes = format!("softwarp_qp_{dir}_bytes_total");
    let messages_help = format!("RDMAP messages {verb}, per operation.");
    let bytes_help = format!("Payload bytes {verb}, per RDMAP operation.");
    for (op, counter) in ops(c) {
        let l = [labels[0], labels[1], ("op", op)];
        out.counter(&messages, &messages_help, &l, counter.messages);
        out.counter(&bytes, &bytes_help, &l, counter.bytes);
    }
}

impl DescribeResource for QpShared {
    fn describe(&self) -> ResourceDetails {
        let mut details = self.ras_view().details();
        details.markers = self.marker_words();
        details
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_operation_gets_a_message_and_a_byte_counter() {
        let mut c = OpCounters::default();
        c.send.messages = 3;
        c.send.bytes = 300;
        c.write.messages = 1;
        let mut b = StatsBuilder::new();
        collect_ops(&mut b, "tx", "sent", &c, &[("device", "d"), ("qpn", "7")]);
        let s = b.finish();
        let l = [("device", "d"), ("qpn", "7"), ("op", "send")];
        assert_eq!(
            s.get("softwarp_qp_tx_messages_total", &l),
            Some(softwarp_ras::stats::Value::Int(3))
        );
        assert_eq!(
            s.get("softwarp_qp_tx_bytes_total", &l),
            Some(softwarp_ras::stats::Value::Int(300))
        );
        let fam = s
            .families
            .iter()
            .find(|f| f.name == "softwarp_qp_tx_messages_total")
            .unwrap();
        assert_eq!(fam.samples.len(), 8);
    }
}
