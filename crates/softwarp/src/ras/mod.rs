//! RAS wiring of the verbs objects (the services themselves live in `softwarp_ras`).
//!
//! - **Resources**: every device, PD, MR, CQ, SRQ, QP and listener registers with a
//!   [`Tracker`] (one per device; listeners, which belong to no device, with the
//!   process-wide [`cm_tracker`]) through a `#[track_caller]` chain from the public
//!   constructor, so the recorded location is the application's line. QPs, CQs, SRQs and
//!   the device describe their live state; the others carry fixed details.
//! - **Statistics**: the device is a [`StatsSource`]: per-QP counters (engine `QpStats` and
//!   the last TCP_INFO sample), per-CQ counters and device counters.
//! - **Critical events**: QP errors with their cause, Terminates received, device faults and
//!   leaks at close go to the error log (and are level 1 trace records).
//! - **Snapshots**: a QP that fails (Terminate received or sent, local failure, device
//!   fault) is copied into the process's snapshot history once per connection, under the
//!   QP lock the event handler already holds (the history, the flight recorder and the
//!   QP's own RAS locks are leaves: nothing is called out to while they are held); its
//!   error log line names the snapshot. A device fault also writes an automatic component dump (while the
//!   RAS services run), on
//!   the injecting thread with no lock held.
//! - **Tracing**: QP state changes, connections, Terminates (levels 1-2); the hot path
//!   (post, poll: 7; FPDU bytes: 8) emits through `sw_event!`, which costs one relaxed load
//!   while disabled.
//!
//! No I/O here except reading TCP_INFO of a QP's socket (`getsockopt`, at most once per
//! sampling interval) and starting the process-wide services ([`init`]) when the
//! application or the operator asked for them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, Once, OnceLock, Weak};
use std::time::Instant;

use softwarp_engine::event::AsyncEvent;
use softwarp_engine::fault::Cause;
use softwarp_engine::qp::{Qp, QpState};
use softwarp_engine::stats::{Counter, OpCounters, QpStats};
use softwarp_ras::control::DefaultHandler;
use softwarp_ras::dump::{self, AutoDumpConfig};
use softwarp_ras::errlog::{self, CriticalEvent, CriticalKind};
use softwarp_ras::service::{self, RasService, ServiceConfig};
use softwarp_ras::snapshot::{
    self, QpSnapshot, TerminateInfo, SNAPSHOT_CONTEXT_RECORDS, SNAPSHOT_QP_RECORDS,
};
use softwarp_ras::stats::{StatsBuilder, StatsSource, TcpInfo, TcpInfoSampler};
use softwarp_ras::sw_event;
use softwarp_ras::tracker::{
    DescribeResource, ResourceDetails, ResourceHandle, ResourceKind, Tracker,
};
use softwarp_wire::rdmap::TerminateError;

use crate::sync::lock;
use crate::verbs::cq::CqShared;
use crate::verbs::device::DeviceShared;
use crate::verbs::qp::QpShared;
use crate::ConnectionInfo;

/// Called by every `Device::open` and listener bind: applies `SOFTWARP_TRACE` to the trace
/// levels the first time (levels only: no thread, no file, no subscriber), then starts the
/// process-wide RAS services if `requested` (the application's [`RasConfig`](crate::RasConfig))
/// or `SOFTWARP_RAS=on` (with [`ServiceConfig::from_env`]) asks, unless `SOFTWARP_RAS=off`.
/// Once started they stay; later calls cost an atomic load or two. What cannot start is
/// reported by the services themselves and never stops the caller.
pub(crate) fn init(requested: Option<&ServiceConfig>) {
    static LEVELS: Once = Once::new();
    LEVELS.call_once(|| {
        if let Err(e) = softwarp_ras::trace::init_from_env() {
            sw_event!(Ras, 1, "{}: {}", softwarp_ras::trace::TRACE_ENV, e);
        }
    });
    let _ = enable(requested);
}

/// Starts the process-wide services as [`init`] decides; the running services, if any.
pub(crate) fn enable(requested: Option<&ServiceConfig>) -> Option<&'static RasService> {
    if let Some(running) = service::global() {
        return Some(running);
    }
    match (service::env_switch(), requested) {
        (Some(false), _) | (None, None) => None,
        (_, Some(config)) => Some(service::start_global(config)),
        (Some(true), None) => Some(service::start_global(&ServiceConfig::from_env())),
    }
}

/// The tracker of objects that belong to no device (listeners), named `cm`.
pub(crate) fn cm_tracker() -> &'static Tracker {
    static CM: OnceLock<Tracker> = OnceLock::new();
    CM.get_or_init(|| Tracker::new("cm"))
}

/// Details that do not change while the resource lives.
struct Fixed(ResourceDetails);

impl DescribeResource for Fixed {
    fn describe(&self) -> ResourceDetails {
        self.0.clone()
    }
}

/// One object's registration with a tracker (unregistered when dropped), with the fixed
/// details it was given.
pub(crate) struct Tracked {
    handle: ResourceHandle,
    _fixed: Option<Arc<Fixed>>,
}

impl std::fmt::Debug for Tracked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.handle.fmt(f)
    }
}

impl Tracked {
    /// Registers a resource created by the caller's caller (keep `#[track_caller]` on
    /// every function between the public constructor and this call).
    #[track_caller]
    pub(crate) fn new(tracker: &Tracker, kind: ResourceKind, id: u64, bytes: u64) -> Self {
        Self {
            handle: tracker.register(kind, id, bytes),
            _fixed: None,
        }
    }

    /// [`Tracked::new`] with details that never change.
    #[track_caller]
    pub(crate) fn with_details(
        tracker: &Tracker,
        kind: ResourceKind,
        id: u64,
        bytes: u64,
        details: ResourceDetails,
    ) -> Self {
        let handle = tracker.register(kind, id, bytes);
        let fixed = Arc::new(Fixed(details));
        handle.set_describer(Arc::downgrade(&fixed) as Weak<dyn DescribeResource>);
        Self {
            handle,
            _fixed: Some(fixed),
        }
    }

    /// Has the owner describe the resource's live state (held weakly).
    pub(crate) fn describe_with(&self, owner: Weak<dyn DescribeResource>) {
        self.handle.set_describer(owner);
    }

    /// The registration.
    pub(crate) fn handle(&self) -> &ResourceHandle {
        &self.handle
    }
}

/// Attribute map from name/value pairs.
pub(crate) fn attrs<const N: usize>(pairs: [(&str, String); N]) -> BTreeMap<String, String> {
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// Access rights as `softwarp resources` shows them (`LOCAL_WRITE|REMOTE_READ`, `NONE`).
pub(crate) fn access_text(a: softwarp_engine::mr::Access) -> String {
    use softwarp_engine::mr::Access;
    let names: Vec<&str> = [
        (Access::LOCAL_WRITE, "LOCAL_WRITE"),
        (Access::REMOTE_WRITE, "REMOTE_WRITE"),
        (Access::REMOTE_READ, "REMOTE_READ"),
        (Access::REMOTE_INVALIDATE, "REMOTE_INVALIDATE"),
        (Access::REMOTE_ATOMIC, "REMOTE_ATOMIC"),
    ]
    .into_iter()
    .filter(|(f, _)| a.contains(*f))
    .map(|(_, n)| n)
    .collect();
    if names.is_empty() {
        "NONE".to_string()
    } else {
        names.join("|")
    }
}

// ----- device -----

/// The device's part: its tracker and the CQs it exports statistics of.
///
/// Registrations live in the application's handles (`Device`, `QueuePair`,
/// `CompletionQueue` ...), not in the shared states: a destroyed QP whose connection is
/// still closing (the progress thread holds its state for up to the linger time) is no
/// longer the application's, and must not be reported as leaked.
#[derive(Debug)]
pub(crate) struct DeviceRas {
    pub(crate) tracker: Tracker,
    pub(crate) cqs: crate::verbs::device::WeakList<CqShared>,
}

impl DeviceRas {
    /// Makes the device's tracker, named after the device and the open instance (`softwarp0/3` for the third `Device::open` of the process), so that
    /// the QPs, CQs and statistics of two open instances never share labels.
    pub(crate) fn new(name: &str) -> Self {
        static OPENED: AtomicU32 = AtomicU32::new(0);
        let n = OPENED.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        Self {
            tracker: Tracker::new(format!("{name}/{n}")),
            cqs: crate::verbs::device::WeakList::default(),
        }
    }

    /// The name the device's resources, statistics and events are reported under.
    pub(crate) fn instance(&self) -> &str {
        self.tracker.name()
    }

    /// Exports `cq`'s statistics with the device's.
    pub(crate) fn add_cq(&self, cq: &Arc<CqShared>, counters: &crate::runtime::progress::Counters) {
        self.cqs.insert(cq, counters);
    }

    pub(crate) fn live_cqs(&self) -> Vec<Arc<CqShared>> {
        self.cqs.live()
    }
}

/// Wires a freshly opened device: registers it (`#[track_caller]`: the application's
/// `Device::open` line), exports its statistics. The registration goes into the
/// `Device` handles' shared owner.
#[track_caller]
pub(crate) fn device_opened(dev: &Arc<DeviceShared>, bytes: u64) -> Tracked {
    let tracked = Tracked::new(&dev.ras.tracker, ResourceKind::Device, 0, bytes);
    tracked.describe_with(Arc::downgrade(dev) as Weak<dyn DescribeResource>);
    softwarp_ras::stats::register_source(Arc::downgrade(dev) as Weak<dyn StatsSource>);
    sw_event!(Runtime, 4, device = dev.ras.tracker.name(), "device opened");
    tracked
}

/// The last `Device` handle is gone: reports what is still allocated (with the source line
/// that created each) to the error log and as a level 1 trace record.
pub(crate) fn device_closed(dev: &DeviceShared, device: &Tracked) {
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
pub(crate) fn device_failed(dev: &DeviceShared, fault: &str, qps: usize, snapshots: &[u64]) {
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
pub(crate) fn device_fault_dump(fault: &str) {
    let reason = format!("device fatal: {fault}");
    dump::auto_dump(&AutoDumpConfig::from_env(), &DefaultHandler, &reason);
}

/// A recovery ended: the error log line (outcome, time, holders, terminations) and a level
/// 1 or 2 record.
pub(crate) fn device_recovery(dev: &DeviceShared, r: &softwarp_ras::health::RecoveryReport) {
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
pub(crate) fn network_gone(dev: &DeviceShared, qpn: u32, detail: &str, snapshot: Option<u64>) {
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
        for qp in self.live_qps() {
            qp.ras_view().collect(out, dev);
        }
        for cq in self.ras.live_cqs() {
            cq.ras_view().collect(out, dev);
        }
    }
}

// ----- QP -----

const STATE_UNSEEN: u8 = u8::MAX;

fn state_code(s: QpState) -> u8 {
    match s {
        QpState::Idle => 0,
        QpState::Rts => 1,
        QpState::Closing => 2,
        QpState::Terminate => 3,
        QpState::Error => 4,
    }
}

/// The QP state's name as `softwarp resources` shows it.
pub(crate) fn state_name(s: QpState) -> &'static str {
    match s {
        QpState::Idle => "IDLE",
        QpState::Rts => "RTS",
        QpState::Closing => "CLOSING",
        QpState::Terminate => "TERMINATE",
        QpState::Error => "ERROR",
    }
}

fn code_name(code: u8) -> &'static str {
    match code {
        0 => "IDLE",
        1 => "RTS",
        2 => "CLOSING",
        3 => "TERMINATE",
        4 => "ERROR",
        _ => "-",
    }
}

/// A QP's RAS state, outside the QP lock's data (its own small locks, never held while
/// taking the QP lock).
#[derive(Debug)]
pub(crate) struct QpRas {
    device: String,
    qpn: u32,
    /// The last state seen by [`QpRas::state_seen`] (a [`state_code`]).
    state: AtomicU8,
    /// Local and peer address of the current or last connection.
    addrs: Mutex<Option<(SocketAddr, SocketAddr)>>,
    tcp: Mutex<TcpInfoSampler>,
    attrs: BTreeMap<String, String>,
    /// The id of the snapshot taken for the current connection's failure (0: none yet).
    snapshot: AtomicU64,
}

impl QpRas {
    /// The RAS state of QP `qpn` with fixed attributes (`pd`, CQs, queue depths ...).
    pub(crate) fn new(device: &DeviceShared, qpn: u32, attrs: BTreeMap<String, String>) -> Self {
        sw_event!(Qp, 4, qpn = qpn, "QP created");
        Self {
            device: device.ras.tracker.name().to_string(),
            qpn,
            state: AtomicU8::new(STATE_UNSEEN),
            addrs: Mutex::new(None),
            tcp: Mutex::new(TcpInfoSampler::new(TcpInfoSampler::interval_from_env())),
            attrs,
            snapshot: AtomicU64::new(0),
        }
    }

    /// Registers the QP (`#[track_caller]`: the application's `create_qp` line); it
    /// describes its live state. The registration goes into the `QueuePair` handle.
    #[track_caller]
    pub(crate) fn track(qp: &Arc<QpShared>, bytes: u64) -> Tracked {
        let tracked = Tracked::new(
            &qp.device.ras.tracker,
            ResourceKind::Qp,
            u64::from(qp.qp_num()),
            bytes,
        );
        tracked.describe_with(Arc::downgrade(qp) as Weak<dyn DescribeResource>);
        tracked
    }

    /// Called with the QP's current state whenever completions and events are moved (after
    /// every post and progress pass): traces a change (level 2). One relaxed load when the
    /// state did not change.
    #[inline]
    pub(crate) fn state_seen(&self, state: QpState) {
        let code = state_code(state);
        if self.state.load(Ordering::Relaxed) != code {
            self.state_changed(code, state);
        }
    }

    #[cold]
    #[inline(never)]
    fn state_changed(&self, code: u8, state: QpState) {
        let prev = self.state.swap(code, Ordering::Relaxed);
        if prev == code {
            // Another thread saw the change first and traced it.
            return;
        }
        sw_event!(
            Qp,
            2,
            qpn = self.qpn,
            device = self.device.as_str(),
            from = code_name(prev),
            to = state_name(state),
            "QP state change"
        );
    }

    fn peer(&self) -> Option<SocketAddr> {
        lock(&self.addrs).map(|(_, peer)| peer)
    }

    fn event(&self, kind: CriticalKind, detail: String) -> CriticalEvent {
        let ev = CriticalEvent::new(kind, detail)
            .with_device(self.device.as_str())
            .with_qpn(self.qpn);
        match self.peer() {
            Some(p) => ev.with_peer(p.to_string()),
            None => ev,
        }
    }

    /// Called (under the QP lock) for every asynchronous event of the QP before it goes to
    /// the device's event queue: errors become trace records and critical events, and the
    /// first failure of a connection a snapshot of `qp` that its error log line names.
    pub(crate) fn on_event(
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
                    device = self.device.as_str(),
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
                    device = self.device.as_str(),
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
    pub(crate) fn snapshot(
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
            device = self.device.as_str(),
            snapshot = id,
            "QP snapshot taken"
        );
    }

    /// The QP connected (MPA exchange done, RTS).
    pub(crate) fn connected(&self, info: &ConnectionInfo) {
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
            device = self.device.as_str(),
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
    pub(crate) fn peer_unreachable(&self, detail: &str) {
        sw_event!(Qp, 2, qpn = self.qpn, "{}", detail);
        errlog::report(&self.event(
            CriticalKind::PeerUnreachable,
            format!("QP {}: {detail}; QP to Error", self.qpn),
        ));
    }

    /// The peer broke the protocol above RDMAP (`detail`, the whole sentence): a trace
    /// record and the error log's `peer_violation` line, naming the failure's snapshot.
    pub(crate) fn peer_violation(&self, detail: String, snapshot: Option<u64>) {
        sw_event!(Qp, 2, qpn = self.qpn, "{}", detail);
        let event = self.event(CriticalKind::PeerViolation, detail);
        errlog::report(&match snapshot {
            Some(id) => event.with_snapshot(id),
            None => event,
        });
    }

    /// Samples TCP_INFO of the QP's socket if an interval has passed (progress pass and
    /// statistics). Never waits for the sampler's lock.
    pub(crate) fn sample_tcp(&self, fd: Option<BorrowedFd<'_>>) {
        let Some(fd) = fd else {
            return;
        };
        let Ok(mut sampler) = self.tcp.try_lock() else {
            return;
        };
        if let Some(Err(e)) = sampler.poll(Instant::now(), fd) {
            sw_event!(Qp, 5, qpn = self.qpn, "TCP_INFO: {}", e);
        }
    }

    fn last_tcp(&self) -> Option<TcpInfo> {
        lock(&self.tcp).last().copied()
    }
}

impl Drop for QpRas {
    fn drop(&mut self) {
        sw_event!(Qp, 4, qpn = self.qpn, "QP destroyed");
    }
}

/// What RAS reports about a QP, copied under its lock.
#[derive(Debug, Clone)]
pub(crate) struct QpView {
    qpn: u32,
    state: QpState,
    stats: QpStats,
    sq: usize,
    rq: usize,
    reads: usize,
    connected: bool,
    conn: Option<ConnSummary>,
    tcp: Option<TcpInfo>,
    attrs: BTreeMap<String, String>,
    addrs: Option<(SocketAddr, SocketAddr)>,
}

#[derive(Debug, Clone, Copy)]
struct ConnSummary {
    revision: u8,
    crc: bool,
    ird: usize,
    ord: usize,
    mss: usize,
    max_fpdu_len: usize,
}

impl QpView {
    /// The view of `qp` (call with the QP locked); samples TCP_INFO of `fd` when due.
    pub(crate) fn take(
        ras: &QpRas,
        qp: &Qp,
        info: Option<&ConnectionInfo>,
        fd: Option<BorrowedFd<'_>>,
    ) -> Self {
        ras.state_seen(qp.state());
        ras.sample_tcp(fd);
        Self {
            qpn: ras.qpn,
            state: qp.state(),
            stats: *qp.stats(),
            sq: qp.sq_len(),
            rq: qp.rq_len(),
            reads: qp.outstanding_reads(),
            connected: fd.is_some(),
            conn: info.map(|i| ConnSummary {
                revision: i.revision,
                crc: i.crc,
                ird: i.ird,
                ord: i.ord,
                mss: i.mss,
                max_fpdu_len: i.max_fpdu_len,
            }),
            tcp: ras.last_tcp(),
            attrs: ras.attrs.clone(),
            addrs: *lock(&ras.addrs),
        }
    }

    /// Adds a runtime fact about the QP to its details (`softwarp resources`).
    pub(crate) fn with_attr(mut self, key: &str, value: &str) -> Self {
        self.attrs.insert(key.into(), value.into());
        self
    }

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

    fn collect(&self, out: &mut StatsBuilder, dev: &str) {
        let qpn = self.qpn.to_string();
        let labels = [("device", dev), ("qpn", qpn.as_str())];
        let s = &self.stats;
        collect_ops(out, "tx", "sent", &s.tx, &labels);
        collect_ops(out, "rx", "received", &s.rx, &labels);
        let counters: [(&str, &str, u64); 15] = [
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
        ];
        for (name, help, v) in counters {
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

// ----- CQ -----

/// What RAS reports about a CQ, copied under its lock.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CqView {
    pub(crate) id: u32,
    pub(crate) capacity: usize,
    pub(crate) len: usize,
    pub(crate) in_error: bool,
    pub(crate) refused: u64,
    pub(crate) completions: u64,
    pub(crate) error_completions: u64,
    pub(crate) polled: u64,
    pub(crate) notifications: u64,
    pub(crate) idle_sleeps: u64,
    pub(crate) channel: bool,
}

impl CqView {
    fn collect(&self, out: &mut StatsBuilder, dev: &str) {
        let id = self.id.to_string();
        let labels = [("device", dev), ("cq", id.as_str())];
        out.counter(
            "softwarp_cq_completions_total",
            "Completions queued.",
            &labels,
            self.completions,
        );
        out.counter(
            "softwarp_cq_error_completions_total",
            "Completions queued with a status other than success.",
            &labels,
            self.error_completions,
        );
        out.counter(
            "softwarp_cq_polled_total",
            "Completions taken by the application.",
            &labels,
            self.polled,
        );
        out.counter(
            "softwarp_cq_notifications_total",
            "Completion channel notifications.",
            &labels,
            self.notifications,
        );
        out.counter(
            "softwarp_cq_idle_sleeps_total",
            "Sleeps of a thread that kept polling the CQ while it stayed empty.",
            &labels,
            self.idle_sleeps,
        );
        out.counter(
            "softwarp_cq_refused_total",
            "Completions refused by a full (overflowed) CQ.",
            &labels,
            self.refused,
        );
        out.gauge_int(
            "softwarp_cq_depth",
            "Completions waiting to be polled.",
            &labels,
            self.len as u64,
        );
        out.gauge_int(
            "softwarp_cq_capacity",
            "Capacity in completions.",
            &labels,
            self.capacity as u64,
        );
        out.gauge_int(
            "softwarp_cq_error",
            "1 when the CQ overflowed and is in error.",
            &labels,
            u64::from(self.in_error),
        );
    }

    /// Live details for `softwarp resources`.
    pub(crate) fn details(&self) -> ResourceDetails {
        ResourceDetails {
            state: Some(if self.in_error { "ERROR" } else { "OK" }.to_string()),
            attrs: attrs([
                ("cqe", self.capacity.to_string()),
                ("depth", self.len.to_string()),
                ("completions", self.completions.to_string()),
                (
                    "channel",
                    if self.channel { "yes" } else { "no" }.to_string(),
                ),
            ]),
            ..ResourceDetails::default()
        }
    }
}

impl DescribeResource for CqShared {
    fn describe(&self) -> ResourceDetails {
        let mut details = self.ras_view().details();
        details.markers = self.marker_words();
        details
    }
}

// ----- listener -----

/// Registers a listener bound to `local` (`#[track_caller]`: the application's `bind` or
/// `listen` line).
#[track_caller]
pub(crate) fn listener(local: Option<SocketAddr>) -> Tracked {
    init(None);
    let port = local.map_or(0, |a| a.port());
    sw_event!(Cm, 4, port, "listener bound");
    Tracked::with_details(
        cm_tracker(),
        ResourceKind::Listener,
        u64::from(port),
        std::mem::size_of::<std::net::TcpListener>() as u64,
        ResourceDetails {
            state: Some("LISTEN".into()),
            local_addr: local,
            ..ResourceDetails::default()
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_rights_are_named() {
        use softwarp_engine::mr::Access;
        assert_eq!(access_text(Access::NONE), "NONE");
        assert_eq!(
            access_text(Access::LOCAL_WRITE | Access::REMOTE_READ),
            "LOCAL_WRITE|REMOTE_READ"
        );
    }

    #[test]
    fn state_codes_and_names_agree() {
        for s in [
            QpState::Idle,
            QpState::Rts,
            QpState::Closing,
            QpState::Terminate,
            QpState::Error,
        ] {
            assert_eq!(code_name(state_code(s)), state_name(s));
        }
        assert_eq!(code_name(STATE_UNSEEN), "-");
    }

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
