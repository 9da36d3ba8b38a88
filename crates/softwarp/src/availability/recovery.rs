//! Device health: the state machine (operational → failed → recovering → operational, or
//! closed), containment of a fault, error blocks and bounded recovery.
//!
//! - **Containment** ([`contain`]): the first fault of an operational device moves it to
//!   Failed (an atomic state the creating verbs check, one relaxed load), gives every QP the
//!   fault as its error reason and moves it to Error (outstanding and later work requests
//!   complete with a flush status), reports exactly one [`AsyncEvent::DeviceFatal`], takes a
//!   snapshot per QP, writes one error-log line with the recommended action and one
//!   automatic dump (while the RAS services run). A fault of a device that has failed
//!   already is recorded as a level 2 record only.
//! - **Error blocks**: creating anything on a failed or recovering device returns
//!   [`Error::DeviceFailed`] with the fault at once; a QP carries its
//!   [`QpErrorReason`] (`QueuePair::error_reason`), and connecting it returns
//!   [`Error::QpFailed`] without touching the network.
//! - **Recovery** ([`recover`]): Recovering while `softwarp_ras::health::recover` waits
//!   (bounded) for every holder to release what it held: this instance's objects (the
//!   tracker's, with pid, thread and file:line), and those of other registered processes
//!   whose instance of the same device (name and interface) is failed too; listed process
//!   names are terminated. Recovered: Operational again; timed out: Failed, with the
//!   holders reported. Runs on a thread of its own (`<device>-recovery`, living at most the
//!   bound) only when the application configured automatic recovery
//!   ([`crate::DeviceBuilder::recovery`]) or the RAS services run; otherwise on the thread
//!   that calls `Device::recover`.
//!
//! Nothing here is on the data path except the state check of the creating verbs.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, SystemTime};

use softwarp_engine::event::AsyncEvent;
use softwarp_engine::fault::Cause;
use softwarp_ras::errlog::CriticalKind;
use softwarp_ras::health::{self, DeviceHealthReport, FaultInfo, FaultTarget, RecoverySubject};
use softwarp_ras::sw_event;
use softwarp_ras::tracker::{ResourceInfo, ResourceKind};

pub use softwarp_ras::health::{DeviceState, RecoveryConfig, RecoveryOutcome, RecoveryReport};

pub use crate::error::{CqErrorReason, DeviceFault, FaultKind, QpErrorReason};

use crate::availability::inflight::DeviceGate;
use crate::error::{Error, Result};
use crate::sync::{self, lock};

/// The device as containment and recovery see it. The device's shared state (`verbs`)
/// implements it: nothing here knows the verbs objects.
pub(crate) trait Contained: std::fmt::Debug + Send + Sync + 'static {
    /// A QP of the device.
    type Qp: ContainedQp;
    /// Its health.
    fn health(&self) -> &Health;
    /// The in-flight gate of its entry points.
    fn gate(&self) -> &DeviceGate;
    /// The open instance it is reported under (`softwarp0/1`).
    fn instance(&self) -> &str;
    /// The device's name (`softwarp0`).
    fn name(&self) -> &str;
    /// Its live QPs.
    fn live_qps(&self) -> Vec<Arc<Self::Qp>>;
    /// Its live resources, as its RAS tracker lists them.
    fn resources(&self) -> Vec<ResourceInfo>;
    /// Reports `event` on the device's event queue.
    fn push_event(&self, event: AsyncEvent);
    /// RAS: a fault was contained (`qps` QPs moved to Error, `snapshots` taken of them).
    fn fault_contained(&self, fault: &str, qps: usize, snapshots: &[u64]);
    /// RAS: the automatic dump of a fault.
    fn fault_dump(&self, fault: &str);
    /// RAS: a recovery ended.
    fn recovery_ended(&self, report: &RecoveryReport);
}

/// A QP as containment sees it.
pub(crate) trait ContainedQp {
    /// The QP number.
    fn qp_num(&self) -> u32;
    /// Gives the QP the device's fault as its error reason and moves it to Error.
    fn fail_device(qp: &Arc<Self>, fault: &DeviceFault);
    /// Takes the QP's failure snapshot unless its connection has one; the snapshot's id.
    fn take_snapshot(&self, kind: CriticalKind, reason: String) -> Option<u64>;
}

/// The fault of a device whose health is `health` while it is failed or recovering.
pub(crate) fn device_failure(health: &Health) -> Option<DeviceFault> {
    match health.state() {
        DeviceState::Failed | DeviceState::Recovering => health.fault(),
        DeviceState::Operational | DeviceState::Closed => None,
    }
}

/// The cause an engine event reports, if it is a QP error.
pub(crate) fn event_cause(ev: &AsyncEvent) -> Option<Cause> {
    match *ev {
        AsyncEvent::QpFatal { cause, .. }
        | AsyncEvent::QpRequestError { cause, .. }
        | AsyncEvent::QpAccessError { cause, .. } => Some(cause),
        _ => None,
    }
}

/// A QP's error reason: set once, by the first failure (a later one does not replace it).
/// Boxed: a QP that never fails holds a pointer, not the reason's 100 bytes.
#[derive(Debug, Default)]
pub(crate) struct ErrorBlock(Mutex<Option<Box<QpErrorReason>>>);

impl ErrorBlock {
    /// Records `reason` unless one is recorded.
    pub(crate) fn set(&self, reason: QpErrorReason) {
        let mut r = lock(&self.0);
        if r.is_none() {
            *r = Some(Box::new(reason));
        }
    }

    pub(crate) fn get(&self) -> Option<QpErrorReason> {
        lock(&self.0).as_deref().cloned()
    }

    /// Forgets the reason (the QP was reset to Idle).
    pub(crate) fn clear(&self) {
        *lock(&self.0) = None;
    }
}

const OPERATIONAL: u8 = DeviceState::Operational.code();

fn state_of(code: u8) -> DeviceState {
    match code {
        0 => DeviceState::Operational,
        1 => DeviceState::Failed,
        2 => DeviceState::Recovering,
        _ => DeviceState::Closed,
    }
}

/// The health of one device instance.
#[derive(Debug)]
pub(crate) struct Health {
    /// A [`DeviceState::code`]; written under `inner`'s lock, read without it.
    state: AtomicU8,
    inner: Mutex<HealthInner>,
    /// Signalled when a recovery ends.
    ended: Condvar,
    /// The network interface the device is bound to.
    pub(crate) interface: Option<String>,
    /// Automatic recovery after every fault.
    auto: Option<RecoveryConfig>,
    /// What the control socket's fault requests reach (holds the device weakly).
    target: Mutex<Option<Registered>>,
}

/// The registration with the control socket's fault requests (kept alive here: the
/// registry holds it weakly).
struct Registered {
    _target: Arc<dyn FaultTarget>,
}

impl std::fmt::Debug for Registered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Registered")
    }
}

#[derive(Debug, Default)]
struct HealthInner {
    fault: Option<DeviceFault>,
    recovery: Option<RecoveryReport>,
    generation: u64,
    recovering: bool,
    faults: u64,
    recovered: u64,
    timed_out: u64,
    /// Faults reported while the device had failed already.
    repeated: u64,
}

impl Health {
    pub(crate) fn new(interface: Option<String>, auto: Option<RecoveryConfig>) -> Self {
        Self {
            state: AtomicU8::new(OPERATIONAL),
            inner: Mutex::new(HealthInner::default()),
            ended: Condvar::new(),
            interface,
            auto,
            target: Mutex::new(None),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HealthInner> {
        lock(&self.inner)
    }

    fn set_state(&self, st: DeviceState) {
        self.state.store(st.code(), Ordering::Release);
    }

    pub(crate) fn state(&self) -> DeviceState {
        state_of(self.state.load(Ordering::Acquire))
    }

    /// The current or last fault.
    pub(crate) fn fault(&self) -> Option<DeviceFault> {
        self.lock().fault.clone()
    }

    /// The current or last recovery.
    pub(crate) fn recovery(&self) -> Option<RecoveryReport> {
        self.lock().recovery.clone()
    }

    /// `Ok` while operational (one relaxed load); else the error naming the fault.
    pub(crate) fn check(&self, device: &str) -> Result<()> {
        if self.state.load(Ordering::Relaxed) == OPERATIONAL {
            return Ok(());
        }
        self.refusal(device)
    }

    #[cold]
    fn refusal(&self, device: &str) -> Result<()> {
        let g = self.lock();
        let state = self.state();
        match (&g.fault, state) {
            (_, DeviceState::Operational) => Ok(()),
            (Some(fault), _) => Err(Error::DeviceFailed {
                device: device.to_string(),
                state,
                fault: Box::new(fault.clone()),
            }),
            (None, _) => Err(Error::DeviceStopped),
        }
    }

    /// The device's last handle was dropped.
    pub(crate) fn closed(&self) {
        let _g = self.lock();
        self.set_state(DeviceState::Closed);
    }

    /// Statistics of the device's health.
    pub(crate) fn collect(&self, out: &mut softwarp_ras::stats::StatsBuilder, dev: &str) {
        let g = self.lock();
        let labels = [("device", dev)];
        out.gauge_int(
            "softwarp_device_state",
            "Device state: 0 operational, 1 failed, 2 recovering, 3 closed.",
            &labels,
            u64::from(self.state().code()),
        );
        out.counter(
            "softwarp_device_faults_total",
            "Device faults contained (a fault of a device that had failed already is not counted).",
            &labels,
            g.faults,
        );
        for (outcome, n) in [("recovered", g.recovered), ("timed_out", g.timed_out)] {
            out.counter(
                "softwarp_device_recoveries_total",
                "Recoveries of the device that ended, per outcome.",
                &[("device", dev), ("outcome", outcome)],
                n,
            );
        }
        if let Some(r) = &g.recovery {
            out.gauge(
                "softwarp_device_last_recovery_seconds",
                "How long the last recovery took (or has taken so far).",
                &labels,
                Duration::from_millis(r.elapsed_ms).as_secs_f64(),
            );
            out.gauge_int(
                "softwarp_device_recovery_holders",
                "Resources still held at the end of the last recovery (or now, while it runs).",
                &labels,
                r.holders.len() as u64,
            );
        }
    }

    /// Registers the device with the control socket's fault requests.
    pub(crate) fn register_target<D: Contained>(dev: &Arc<D>) {
        let target: Arc<dyn FaultTarget> = Arc::new(Target(Arc::downgrade(dev)));
        health::register_target(Arc::downgrade(&target));
        *lock(&dev.health().target) = Some(Registered { _target: target });
    }
}

/// The device as the control socket's fault requests see it.
#[derive(Debug)]
struct Target<D>(Weak<D>);

impl<D: Contained> FaultTarget for Target<D> {
    fn health(&self) -> DeviceHealthReport {
        match self.0.upgrade() {
            Some(dev) => report(&*dev),
            None => DeviceHealthReport {
                device: String::new(),
                name: String::new(),
                interface: None,
                state: DeviceState::Closed,
                fault: None,
                recovery: None,
                holders: Vec::new(),
            },
        }
    }

    fn inject(&self, kind: Option<&str>) -> std::result::Result<DeviceHealthReport, String> {
        let dev = self.0.upgrade().ok_or("the device is closed")?;
        let interface = dev
            .health()
            .interface
            .clone()
            .unwrap_or_else(|| "(none)".to_string());
        let kind = match kind.unwrap_or("injected") {
            "injected" => FaultKind::Injected,
            "interface-down" | "interface_down" => FaultKind::InterfaceDown { interface },
            "interface-removed" | "interface_removed" => FaultKind::InterfaceRemoved { interface },
            other => {
                return Err(format!(
                    "unknown fault kind {other:?} (injected, interface-down, interface-removed)"
                ))
            }
        };
        contain(&dev, kind);
        Ok(report(&*dev))
    }
}

/// The device's health report (`fault-status`).
pub(crate) fn report<D: Contained>(dev: &D) -> DeviceHealthReport {
    let (fault, recovery) = {
        let g = dev.health().lock();
        (g.fault.clone(), g.recovery.clone())
    };
    let state = dev.health().state();
    DeviceHealthReport {
        device: dev.instance().to_string(),
        name: dev.name().to_string(),
        interface: dev.health().interface.clone(),
        state,
        fault: fault.map(|f| FaultInfo {
            kind: f.kind.as_str().to_string(),
            detail: f.to_string(),
            time: softwarp_ras::clock::rfc3339(f.time),
            generation: f.generation,
        }),
        recovery,
        holders: if state == DeviceState::Operational {
            Vec::new()
        } else {
            local_holders(dev)
        },
    }
}

/// This instance's resources other than the device itself (created before the fault:
/// nothing can be created after it).
fn local_holders<D: Contained>(dev: &D) -> Vec<ResourceInfo> {
    let mut held = dev.resources();
    held.retain(|r| r.kind != ResourceKind::Device);
    held
}

/// Contains a fault of `dev` (see the module docs). Returns false when the device had
/// failed already (nothing is done again).
pub(crate) fn contain<D: Contained>(dev: &Arc<D>, kind: FaultKind) -> bool {
    contain_in(&**dev, kind, Some(dev))
}

/// [`contain`] where the caller has no `Arc` of the device (a marker check inside the
/// device's own entry point): `recover_with` is the device to hand to an automatic
/// recovery, if one may start.
pub(crate) fn contain_in<D: Contained>(
    dev: &D,
    kind: FaultKind,
    recover_with: Option<&Arc<D>>,
) -> bool {
    let fault = {
        let mut g = dev.health().lock();
        if dev.health().state() != DeviceState::Operational {
            g.repeated = g.repeated.saturating_add(1);
            drop(g);
            sw_event!(
                Runtime,
                2,
                device = dev.instance(),
                "{kind} while the device has failed already: nothing more to contain"
            );
            return false;
        }
        g.generation = g.generation.saturating_add(1);
        g.faults = g.faults.saturating_add(1);
        let fault = DeviceFault {
            device: dev.instance().to_string(),
            kind,
            time: SystemTime::now(),
            generation: g.generation,
        };
        g.fault = Some(fault.clone());
        g.recovery = None;
        dev.health().set_state(DeviceState::Failed);
        fault
    };
    sw_event!(Runtime, 1, device = dev.instance(), "{fault}: containing");
    let qps = dev.live_qps();
    let mut snapshots = Vec::new();
    for qp in &qps {
        D::Qp::fail_device(qp, &fault);
        snapshots.extend(qp.take_snapshot(
            CriticalKind::DeviceFatal,
            format!("{fault}: QP {} moved to Error", qp.qp_num()),
        ));
    }
    dev.push_event(AsyncEvent::DeviceFatal);
    let text = fault.to_string();
    dev.fault_contained(&text, qps.len(), &snapshots);
    // The recovery starts before the dump is written (tens of milliseconds): its time
    // counts from the fault.
    let auto = match (&fault.kind, recover_with) {
        (FaultKind::MarkerDamaged { .. }, _) | (_, None) => None,
        (_, Some(d)) => dev.health().auto.clone().map(|c| (c, Arc::clone(d))),
    };
    if let Some((config, d)) = auto {
        let spawned = softwarp_ras::thread::spawn(format!("{}-recovery", dev.name()), move || {
            let _ = recover(&d, &config);
        });
        if let Err(e) = spawned {
            sw_event!(Runtime, 1, error = %e, "cannot start the recovery thread; Device::recover recovers");
        }
    }
    dev.fault_dump(&text);
    true
}

/// The device seen by `softwarp_ras::health::recover`.
struct Subject<'a, D>(&'a D);

impl<D: Contained> RecoverySubject for Subject<'_, D> {
    fn local_holders(&self) -> Vec<ResourceInfo> {
        local_holders(self.0)
    }
    fn scope(&self) -> (String, Option<String>) {
        (self.0.name().to_string(), self.0.health().interface.clone())
    }
    fn progress(&self, report: &RecoveryReport) {
        self.0.health().lock().recovery = Some(report.clone());
    }
}

/// Waits, at most `within`, until no thread is inside one of the device's verbs entry points
/// (the in-flight gate: new entries are refused meanwhile), so that no call that began
/// before the fault still runs when the device is declared operational again; then lets
/// entries in again (they see the device's state). False, with the threads still inside
/// in the error log, when the bound ran out. A closed device has nothing to wait for; a
/// device another caller holds quiesced is waited for without taking it over.
fn threads_left_verbs<D: Contained>(dev: &D, within: Duration) -> bool {
    use crate::availability::inflight::{CLOSED, QUIESCED};
    let before = dev.gate().shut(QUIESCED);
    if before & CLOSED != 0 {
        if before & QUIESCED == 0 {
            dev.gate().open(QUIESCED);
        }
        return true;
    }
    let waited = dev.gate().wait_empty(within, dev.instance());
    if before & QUIESCED == 0 {
        dev.gate().open(QUIESCED);
    }
    match waited {
        Ok(()) => true,
        Err(report) => {
            sw_event!(
                Runtime,
                1,
                device = dev.instance(),
                "recovery: threads still inside verbs calls after the bound: {report}"
            );
            false
        }
    }
}

/// Recovers `dev` (see the module docs); waits for a recovery already running instead of
/// starting a second one. An error when the device is operational or closed.
pub(crate) fn recover<D: Contained>(
    dev: &Arc<D>,
    config: &RecoveryConfig,
) -> Result<RecoveryReport> {
    {
        let mut g = dev.health().lock();
        match dev.health().state() {
            DeviceState::Operational => {
                return Err(Error::InvalidArgument(
                    "the device has not failed: nothing to recover",
                ))
            }
            DeviceState::Closed => return Err(Error::DeviceStopped),
            DeviceState::Failed | DeviceState::Recovering => {}
        }
        if g.recovering {
            let deadline = softwarp_ras::deadline::Deadline::after(config.bound.saturating_mul(2));
            while g.recovering {
                let left = deadline.remaining().unwrap_or(Duration::from_millis(100));
                if left.is_zero() {
                    return Err(Error::Timeout(config.bound));
                }
                g = sync::wait_timeout(&dev.health().ended, g, left);
            }
            return g.recovery.clone().ok_or(Error::DeviceStopped);
        }
        g.recovering = true;
        dev.health().set_state(DeviceState::Recovering);
    }
    sw_event!(Runtime, 2, device = dev.instance(), bound = ?config.bound, "recovery starts");
    let registry = softwarp_ras::service::global().and_then(|s| s.registry());
    let mut report = health::recover(&Subject(&**dev), config, registry);
    let left = Duration::from_millis(report.bound_ms.saturating_sub(report.elapsed_ms));
    if report.outcome == RecoveryOutcome::Recovered && !threads_left_verbs(&**dev, left) {
        report.outcome = RecoveryOutcome::TimedOut;
    }
    {
        let mut g = dev.health().lock();
        g.recovering = false;
        g.recovery = Some(report.clone());
        let next = match report.outcome {
            RecoveryOutcome::Recovered => {
                g.recovered = g.recovered.saturating_add(1);
                DeviceState::Operational
            }
            _ => {
                g.timed_out = g.timed_out.saturating_add(1);
                DeviceState::Failed
            }
        };
        // The last handle may have been dropped meanwhile: closed stays closed.
        if dev.health().state() != DeviceState::Closed {
            dev.health().set_state(next);
        }
    }
    dev.health().ended.notify_all();
    dev.recovery_ended(&report);
    Ok(report)
}

/// One line per holder: `pid 42 (app) thread main: qp 3 at src/main.rs:17:9`.
pub(crate) fn holder_lines(holders: &[ResourceInfo]) -> Vec<String> {
    holders
        .iter()
        .map(|h| {
            format!(
                "pid {} ({}) thread {}: {} {} at {}",
                h.pid,
                h.process,
                h.thread,
                h.kind,
                h.id,
                h.location()
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_say_what_happened() {
        let f = DeviceFault {
            device: "softwarp0/1".into(),
            kind: FaultKind::InterfaceRemoved {
                interface: "sw0".into(),
            },
            time: SystemTime::now(),
            generation: 1,
        };
        assert_eq!(
            f.to_string(),
            "device softwarp0/1 failed: interface sw0 disappeared"
        );
        let r = QpErrorReason::NetworkGone {
            detail: "local address 10.0.0.1 removed".into(),
        };
        assert_eq!(
            r.to_string(),
            "unexpected close: local address 10.0.0.1 removed"
        );
    }

    #[test]
    fn the_first_reason_stays() {
        let b = ErrorBlock::default();
        b.set(QpErrorReason::Cause(Cause::LlpClosed));
        b.set(QpErrorReason::Cause(Cause::Application));
        assert_eq!(b.get(), Some(QpErrorReason::Cause(Cause::LlpClosed)));
        b.clear();
        assert_eq!(b.get(), None);
    }

    #[test]
    fn an_operational_device_refuses_nothing_and_states_map_back() {
        let h = Health::new(None, None);
        assert!(h.check("d").is_ok());
        for s in [
            DeviceState::Operational,
            DeviceState::Failed,
            DeviceState::Recovering,
            DeviceState::Closed,
        ] {
            assert_eq!(state_of(s.code()), s);
        }
    }
}
