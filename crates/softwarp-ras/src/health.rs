//! Device health: what a failed device reports (state, fault, recovery, holders), the
//! process-wide list of devices that answer `fault-inject` and `fault-status` on the control
//! socket, and bounded recovery: waiting until every holder of a failed device's resources
//! let them go, terminating the processes named in the configuration.
//!
//! Generic over the device (the `softwarp` crate implements [`FaultTarget`]); holders are
//! [`ResourceInfo`]s of this process's tracker and of other registered processes, found
//! through the host registry and their control sockets. What another process says is
//! believed only as far as the kernel vouches for it (DESIGN.md, "Device health and
//! recovery"): the registry's entries are checked against file owners and `/proc`, the
//! socket against `SO_PEERCRED`, a reply speaks only for the process that sent it, names
//! are the kernel's, only processes of this user are waited for or signalled. No thread
//! here: [`recover`] runs on its caller's thread, asks the other processes concurrently on
//! one `poll`, and returns by the configured bound (every wait is cut to the time left).

use std::sync::{Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::control::{self, ClientError, Concurrently, FaultStatusResult, Request};
use crate::deadline::Deadline;
use crate::registry::{HostRegistry, ProcessEntry};
use crate::sys;
use crate::tracker::ResourceInfo;

/// Where a device is in its life (after the verbs provider's device states).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceState {
    /// Usable.
    Operational,
    /// A fault was contained (every QP in Error); no recovery is running: either none is
    /// configured, or the last one ran out of time. New objects are refused.
    Failed,
    /// A recovery is waiting for the holders of the failed device's resources to release
    /// them. New objects are refused.
    Recovering,
    /// The last handle of the device was dropped.
    Closed,
}

impl DeviceState {
    /// The name `softwarp resources` and the statistics show.
    pub const fn as_str(self) -> &'static str {
        match self {
            DeviceState::Operational => "OPERATIONAL",
            DeviceState::Failed => "FAILED",
            DeviceState::Recovering => "RECOVERING",
            DeviceState::Closed => "CLOSED",
        }
    }

    /// The number of the `softwarp_device_state` gauge.
    pub const fn code(self) -> u8 {
        match self {
            DeviceState::Operational => 0,
            DeviceState::Failed => 1,
            DeviceState::Recovering => 2,
            DeviceState::Closed => 3,
        }
    }
}

/// Why a device failed, as reported (the `softwarp` crate's `DeviceFault` in text form).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultInfo {
    /// The kind: `injected`, `interface_down`, `interface_removed`, `address_removed`.
    pub kind: String,
    /// What happened, in words.
    pub detail: String,
    /// When, RFC 3339 UTC.
    pub time: String,
    /// The number of the fault on this device (1 for the first).
    pub generation: u64,
}

/// How a recovery ended (or that it still runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryOutcome {
    /// Still waiting.
    Running,
    /// Every holder released; the device is operational again.
    Recovered,
    /// The bound ran out with resources still held; the device stays failed.
    TimedOut,
}

impl RecoveryOutcome {
    /// The outcome's name (statistics label, error log).
    pub const fn as_str(self) -> &'static str {
        match self {
            RecoveryOutcome::Running => "running",
            RecoveryOutcome::Recovered => "recovered",
            RecoveryOutcome::TimedOut => "timed_out",
        }
    }
}

/// A signal sent to a holder process by a recovery.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Termination {
    /// The process.
    pub pid: u32,
    /// Its name.
    pub process: String,
    /// `SIGTERM` or `SIGKILL`.
    pub signal: String,
    /// Milliseconds after the start of the recovery.
    pub at_ms: u64,
}

/// What a recovery did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryReport {
    /// How it ended.
    pub outcome: RecoveryOutcome,
    /// When it started, RFC 3339 UTC.
    pub started: String,
    /// How long it took (so far), in milliseconds.
    pub elapsed_ms: u64,
    /// The bound it had, in milliseconds.
    pub bound_ms: u64,
    /// The holders still there at the end (all of them while it runs): this process's,
    /// and those of other processes of the same user. The recovery waits for these.
    pub holders: Vec<ResourceInfo>,
    /// Holders in processes of other users, as those processes reported them (the pid
    /// and process name are the kernel's): reported, never waited for nor signalled. Each
    /// process has its own instance of the device, whose resources live in that process:
    /// they do not keep this one from recovering.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub foreign_holders: Vec<ResourceInfo>,
    /// Signals sent to holder processes.
    pub terminated: Vec<Termination>,
    /// Other processes whose holders could not be asked (their control socket did not
    /// answer), with why.
    pub unreachable: Vec<String>,
    /// What the last round refused to believe, with why: registry entries it did not trust
    /// (never connected to) and holders a reply named in another process than its own (at
    /// most 32 lines, the last one counting the rest).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rejected: Vec<String>,
}

/// A device's health as `fault-status` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceHealthReport {
    /// The device instance (`softwarp0/1`).
    pub device: String,
    /// The device's name (`softwarp0`): holders are looked for in instances of the same
    /// name and interface.
    pub name: String,
    /// The network interface the device is bound to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
    /// Its state.
    pub state: DeviceState,
    /// The current (or last) fault.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<FaultInfo>,
    /// The current (or last) recovery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery: Option<RecoveryReport>,
    /// Resources of this instance created before the fault and still held (empty while
    /// operational).
    pub holders: Vec<ResourceInfo>,
}

/// A device that answers the control socket's fault requests.
pub trait FaultTarget: Send + Sync {
    /// Its health now.
    fn health(&self) -> DeviceHealthReport;
    /// Injects a fault of `kind` (`None`: the default, `injected`); returns the health
    /// after containment, or why the kind is not known.
    fn inject(&self, kind: Option<&str>) -> Result<DeviceHealthReport, String>;
}

fn targets() -> MutexGuard<'static, Vec<Weak<dyn FaultTarget>>> {
    static TARGETS: Mutex<Vec<Weak<dyn FaultTarget>>> = Mutex::new(Vec::new());
    TARGETS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Adds a device to the process-wide list, held weakly (it leaves the list when dropped).
pub fn register_target(target: Weak<dyn FaultTarget>) {
    let mut all = targets();
    all.retain(|w| w.strong_count() > 0);
    all.push(target);
}

fn live_targets() -> Vec<std::sync::Arc<dyn FaultTarget>> {
    let mut all = targets();
    all.retain(|w| w.strong_count() > 0);
    all.iter().filter_map(Weak::upgrade).collect()
}

/// The health of every live device of this process (the `fault-status` request).
pub fn status_all() -> Vec<DeviceHealthReport> {
    // Targets are called without the list's lock.
    live_targets().iter().map(|t| t.health()).collect()
}

/// Injects a fault into the devices of this process whose instance or name is `device`
/// (all when `None`); the `fault-inject` request. An error when none matches.
pub fn inject_all(
    device: Option<&str>,
    kind: Option<&str>,
) -> Result<Vec<DeviceHealthReport>, String> {
    let mut out = Vec::new();
    for t in live_targets() {
        let h = t.health();
        if device.is_some_and(|d| d != h.device && d != h.name) {
            continue;
        }
        out.push(t.inject(kind)?);
    }
    if out.is_empty() {
        return Err(match device {
            Some(d) => format!("no open device {d:?} in this process"),
            None => "no open device in this process".to_string(),
        });
    }
    Ok(out)
}

/// How a recovery behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecoveryConfig {
    /// Longest wait for the holders (default 10 s): then the device stays failed and the
    /// holders are reported.
    pub bound: Duration,
    /// Names of processes (as `/proc/<pid>/comm` shows them, at most 15 bytes) that may be
    /// terminated when they still hold resources after [`RecoveryConfig::release_wait`].
    /// Empty by default: holders are only reported.
    pub terminate: Vec<String>,
    /// How long holders get to release before the listed ones are sent `SIGTERM` (default
    /// 1 s).
    pub release_wait: Duration,
    /// From `SIGTERM` to `SIGKILL` (default 1 s).
    pub grace: Duration,
    /// How often the holders are looked for (default 20 ms).
    pub poll: Duration,
}

impl Default for RecoveryConfig {
    fn default() -> Self {
        Self {
            bound: Duration::from_secs(10),
            terminate: Vec::new(),
            release_wait: Duration::from_secs(1),
            grace: Duration::from_secs(1),
            poll: Duration::from_millis(20),
        }
    }
}

impl RecoveryConfig {
    /// Defaults changed by `SOFTWARP_RECOVERY_BOUND_MS`, `SOFTWARP_RECOVERY_TERMINATE`
    /// (comma-separated process names), `SOFTWARP_RECOVERY_RELEASE_MS` and
    /// `SOFTWARP_RECOVERY_GRACE_MS`. Values that do not parse are ignored (with a level 2
    /// record).
    pub fn from_env() -> Self {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`RecoveryConfig::from_env`] over any lookup (for tests).
    pub fn from_lookup(env: impl Fn(&str) -> Option<String>) -> Self {
        let mut c = Self::default();
        let ms = |name: &str, into: &mut Duration| {
            if let Some(v) = env(name) {
                match v.trim().parse::<u64>() {
                    Ok(n) => *into = Duration::from_millis(n),
                    Err(e) => crate::sw_event!(Ras, 2, "{name}={v:?} ignored: {e}"),
                }
            }
        };
        ms("SOFTWARP_RECOVERY_BOUND_MS", &mut c.bound);
        ms("SOFTWARP_RECOVERY_RELEASE_MS", &mut c.release_wait);
        ms("SOFTWARP_RECOVERY_GRACE_MS", &mut c.grace);
        if let Some(v) = env("SOFTWARP_RECOVERY_TERMINATE") {
            c.terminate = v
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect();
        }
        c
    }
}

/// What a recovery needs from the device it recovers.
pub trait RecoverySubject {
    /// The device's own holders now (resources of this instance created before the fault).
    fn local_holders(&self) -> Vec<ResourceInfo>;
    /// The device's name and interface: other processes' instances with the same ones that
    /// are failed or recovering at the same time hold resources of the same device.
    fn scope(&self) -> (String, Option<String>);
    /// The report so far (published for `fault-status` while the recovery runs).
    fn progress(&self, report: &RecoveryReport);
}

/// The longest a recovery waits for one other process's reply in a round (never past the
/// bound). A process that has not answered by then is listed as unreachable for that round
/// and does not keep the device failed; its place goes to the next process.
pub const REQUEST_TIMEOUT: Duration = Duration::from_millis(500);
/// Once every process of this user answered, how long after the start of the round the
/// replies of other users' processes are still waited for (they are only reported).
pub const FOREIGN_GRACE: Duration = Duration::from_millis(100);
/// The longest `fault-status` reply a recovery reads, in bytes (about 13,000 holders).
pub const MAX_STATUS_REPLY: usize = 4 * 1024 * 1024;
/// Most lines of [`RecoveryReport::rejected`] per round (the last one counts the rest).
pub const MAX_REJECTED_LINES: usize = 32;
/// Most distinct rejections a recovery writes as level 1 records.
const MAX_LOGGED_REJECTIONS: usize = 64;

/// What one round learnt from the other registered processes.
#[derive(Debug, Default, Clone)]
struct Remote {
    /// Holders in processes of this user: waited for.
    counted: Vec<ResourceInfo>,
    /// Holders in processes of other users: reported only.
    foreign: Vec<ResourceInfo>,
    /// The kernel's identity of each process of this user that answered (for
    /// [`terminate_listed`]).
    identities: Vec<sys::ProcessIdentity>,
    unreachable: Vec<String>,
    /// The deadline cut the round short: some entries were not read, or some processes of
    /// this user not asked or not answered. Such a round cannot tell that nobody holds.
    incomplete: bool,
}

/// The rejections of one round (at most [`MAX_REJECTED_LINES`] lines, then a count), and
/// the level 1 records of the recovery's distinct rejections (at most
/// [`MAX_LOGGED_REJECTIONS`]).
#[derive(Debug, Default)]
struct Rejections {
    round: Vec<String>,
    more: u64,
    logged: Vec<String>,
    silenced: bool,
}

impl Rejections {
    fn add(&mut self, line: String) {
        if !self.logged.contains(&line) {
            if self.logged.len() < MAX_LOGGED_REJECTIONS {
                crate::sw_event!(Ras, 1, "recovery: {line}");
                self.logged.push(line.clone());
            } else if !self.silenced {
                self.silenced = true;
                crate::sw_event!(Ras, 1, "recovery: more rejections, not logged one by one");
            }
        }
        if self.round.len() < MAX_REJECTED_LINES {
            if !self.round.contains(&line) {
                self.round.push(line);
            }
        } else {
            self.more = self.more.saturating_add(1);
        }
    }

    /// Whether another line would only be counted (the round's lines and the records are
    /// used up): the caller can skip making it.
    fn full(&self) -> bool {
        self.round.len() >= MAX_REJECTED_LINES
            && (self.silenced || self.logged.len() >= MAX_LOGGED_REJECTIONS)
    }

    /// Counts a line not made (see [`Rejections::full`]).
    fn count(&mut self) {
        self.more = self.more.saturating_add(1);
    }

    /// This round's lines (and the count of the others); starts the next round.
    fn take_round(&mut self) -> Vec<String> {
        let mut out = std::mem::take(&mut self.round);
        if self.more > 0 {
            out.push(format!("... and {} more", self.more));
        }
        self.more = 0;
        out
    }
}

/// Holders in other registered processes: resources of their failed or recovering
/// instances of the same device (name and interface). Only what the kernel vouches for is
/// used (see DESIGN.md, "Device health and recovery"): the registry gives only trusted
/// entries (file, directory, entry and process of one uid, socket at the layout's path);
/// each is asked over [`control::connect_entry`] (the socket is that process's, by
/// `SO_PEERCRED`); a reply speaks only for the process that sent it (holders naming
/// another pid are rejected), and a holder's process name is the kernel's. Holders in
/// processes of this user are counted; those of other users are reported as foreign.
/// The processes of this user are asked first, up to [`control::MAX_IN_FLIGHT`] at once,
/// each for at most [`REQUEST_TIMEOUT`], all within `deadline`. Processes that do not answer are listed in
/// `unreachable` (a process that is gone holds nothing: it is not listed).
fn remote_holders(
    registry: Option<&HostRegistry>,
    scope: &(String, Option<String>),
    deadline: Deadline,
    rejections: &mut Rejections,
) -> Remote {
    let mut out = Remote::default();
    let Some(registry) = registry else {
        return out;
    };
    let scan = match registry.scan_and_clean_until(deadline) {
        Ok(s) => s,
        Err(e) => {
            out.unreachable
                .push(format!("the host registry cannot be read: {e}"));
            return out;
        }
    };
    for b in &scan.bad {
        // 4,096 hostile entries make as many lines a round: only those shown are made.
        if rejections.full() {
            rejections.count();
            continue;
        }
        rejections.add(format!(
            "registry entry {} skipped: {}",
            b.path.display(),
            b.reason
        ));
    }
    let me = sys::pid();
    let euid = sys::euid();
    let mut entries: Vec<ProcessEntry> = scan.live.into_iter().filter(|e| e.pid != me).collect();
    // This user's processes first: they are the essential ones.
    entries.sort_by_key(|e| e.uid != euid);
    let essential = entries.iter().filter(|e| e.uid == euid).count();
    let how = Concurrently {
        deadline,
        per_request: REQUEST_TIMEOUT,
        essential,
        grace: FOREIGN_GRACE,
        max_reply: MAX_STATUS_REPLY,
    };
    out.incomplete = scan.truncated;
    if scan.truncated {
        out.unreachable
            .push("the time ran out before every registry entry was read".into());
    }
    let answers = control::ask_concurrently(&entries, &Request::FaultStatus, &how);
    for (entry, answer) in entries.iter().zip(answers) {
        let who = format!("pid {} ({}, uid {})", entry.pid, entry.name, entry.uid);
        let own = entry.uid == euid;
        let status: FaultStatusResult = match answer.and_then(|r| r.into_result()) {
            Ok(s) => s,
            Err(e @ ClientError::Untrusted(_)) => {
                rejections.add(format!("{who} not asked: {e}"));
                continue;
            }
            Err(e) => {
                if sys::pid_exists(entry.pid) && !is_zombie(entry.pid) {
                    // Not asked, or not answered, before the deadline: it may hold. (One
                    // that did not answer within REQUEST_TIMEOUT is unreachable, and does
                    // not keep the device failed.)
                    if own && matches!(e, ClientError::DeadlinePassed(_)) {
                        out.incomplete = true;
                    }
                    out.unreachable.push(format!("{who}: {e}"));
                }
                continue;
            }
        };
        // The process that answered is entry.pid of entry.uid (its socket's SO_PEERCRED);
        // its name is the kernel's. Gone or changed meanwhile: it holds nothing of ours.
        let Some(identity) =
            sys::process_identity(entry.pid).filter(|i| i.owner() == Some(entry.uid))
        else {
            continue;
        };
        for dev in status.devices {
            let failed = matches!(dev.state, DeviceState::Failed | DeviceState::Recovering);
            if !(failed && dev.name == scope.0 && dev.interface == scope.1) {
                continue;
            }
            for mut h in dev.holders {
                if h.pid != entry.pid && rejections.full() {
                    rejections.count();
                    continue;
                }
                if h.pid != entry.pid {
                    rejections.add(format!(
                        "{who} named a holder in pid {} ({}): ignored, a reply speaks only \
                         for its own process",
                        h.pid, h.process
                    ));
                    continue;
                }
                h.process.clone_from(&identity.comm);
                if own {
                    out.counted.push(h);
                } else {
                    out.foreign.push(h);
                }
            }
        }
        if own {
            out.identities.push(identity);
        }
    }
    out
}

/// A process that exited and was not reaped yet holds nothing.
fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rfind(')')
            .and_then(|i| s.get(i.saturating_add(1)..))
            .and_then(|rest| rest.split_ascii_whitespace().next())
            == Some("Z")
    })
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Waits (at most `config.bound`) until no holder of `subject`'s resources is left, here or
/// in other processes of this user in `registry` (`None`: this process only); holders in
/// processes of other users are reported ([`RecoveryReport::foreign_holders`]), not waited
/// for. Processes of this user named in `config.terminate` (by the kernel's name) that
/// still hold resources after `config.release_wait` get `SIGTERM`, and `SIGKILL` after
/// `config.grace` more; every other holder is only reported. Runs on the caller's thread
/// and returns by the bound (plus the time of one registry file or one `poll` wake-up):
/// the registry scan checks the deadline before each entry, and every connect, send and
/// receive to another process is bounded by the time left.
pub fn recover(
    subject: &dyn RecoverySubject,
    config: &RecoveryConfig,
    registry: Option<&HostRegistry>,
) -> RecoveryReport {
    let start = Instant::now();
    let deadline = Deadline::after(config.bound);
    let scope = subject.scope();
    let mut report = RecoveryReport {
        outcome: RecoveryOutcome::Running,
        started: crate::clock::rfc3339(std::time::SystemTime::now()),
        elapsed_ms: 0,
        bound_ms: ms(config.bound),
        holders: Vec::new(),
        foreign_holders: Vec::new(),
        terminated: Vec::new(),
        unreachable: Vec::new(),
        rejected: Vec::new(),
    };
    // Processes sent SIGTERM, and when.
    let mut termed: Vec<(sys::ProcessIdentity, Instant)> = Vec::new();
    let mut rejections = Rejections::default();
    // The last round that saw every process of this user.
    let mut complete: Option<Remote> = None;
    loop {
        let mut holders = subject.local_holders();
        let mut remote = remote_holders(registry, &scope, deadline, &mut rejections);
        if !remote.incomplete {
            complete = Some(remote.clone());
        } else if let Some(last) = &complete {
            // The deadline cut this round short (it may begin right at the deadline): the
            // last complete round's view of the other processes stands.
            remote = Remote {
                incomplete: true,
                unreachable: std::mem::take(&mut remote.unreachable),
                ..last.clone()
            };
        }
        holders.extend(remote.counted);
        report.elapsed_ms = ms(start.elapsed());
        report.holders = holders;
        report.foreign_holders = remote.foreign;
        report.unreachable = remote.unreachable;
        report.rejected = rejections.take_round();
        // A round the deadline cut short did not see every process of this user: it
        // cannot tell that nobody holds.
        if report.holders.is_empty() && !remote.incomplete {
            report.outcome = RecoveryOutcome::Recovered;
            return report;
        }
        if deadline.expired() {
            report.outcome = RecoveryOutcome::TimedOut;
            return report;
        }
        if start.elapsed() >= config.release_wait {
            let holders = std::mem::take(&mut report.holders);
            terminate_listed(
                config,
                start,
                &holders,
                &remote.identities,
                &mut termed,
                &mut report,
            );
            report.holders = holders;
        }
        subject.progress(&report);
        let left = deadline.remaining().unwrap_or(config.poll);
        std::thread::sleep(config.poll.min(left));
    }
}

/// Sends `SIGTERM` to listed holder processes not signalled yet, `SIGKILL` to those whose
/// grace ran out. Only processes in `verified` are candidates: processes of this user
/// whose identity the kernel gave (the `SO_PEERCRED` of the connection that answered, then
/// `/proc`), that hold resources, and whose kernel name is listed. Each signal goes to
/// that very process ([`sys::signal_verified`]: a pidfd, and the same start time, uids and
/// name as when it answered). Never this process, never another user's.
fn terminate_listed(
    config: &RecoveryConfig,
    start: Instant,
    holders: &[ResourceInfo],
    verified: &[sys::ProcessIdentity],
    termed: &mut Vec<(sys::ProcessIdentity, Instant)>,
    report: &mut RecoveryReport,
) {
    let me = sys::pid();
    let euid = sys::euid();
    for id in verified {
        if id.pid == me
            || id.owner() != Some(euid)
            || !config.terminate.contains(&id.comm)
            || !holders.iter().any(|h| h.pid == id.pid)
        {
            continue;
        }
        let sent = termed
            .iter()
            .find(|(t, _)| t.pid == id.pid && t.start_ticks == id.start_ticks)
            .map(|(_, at)| *at);
        let signal = match sent {
            None => "SIGTERM",
            Some(t) if t.elapsed() >= config.grace => "SIGKILL",
            Some(_) => continue,
        };
        if report
            .terminated
            .iter()
            .any(|x| x.pid == id.pid && x.signal == signal)
        {
            continue;
        }
        let (pid, process) = (id.pid, id.comm.clone());
        match sys::signal_verified(id, signal == "SIGKILL") {
            Ok(()) => {
                crate::sw_event!(Ras, 1, pid, process = %process, "recovery: {signal} sent to a holder");
                if sent.is_none() {
                    termed.push((id.clone(), Instant::now()));
                }
                report.terminated.push(Termination {
                    pid,
                    process,
                    signal: signal.to_string(),
                    at_ms: ms(start.elapsed()),
                });
            }
            Err(e) => {
                crate::sw_event!(Ras, 1, pid, error = %e, "recovery: cannot send {signal}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracker::{ResourceKind, Tracker};
    use std::sync::Arc;

    struct Subject(Tracker, Mutex<Vec<RecoveryReport>>);

    impl RecoverySubject for Subject {
        fn local_holders(&self) -> Vec<ResourceInfo> {
            self.0.resources()
        }
        fn scope(&self) -> (String, Option<String>) {
            ("unit".into(), None)
        }
        fn progress(&self, report: &RecoveryReport) {
            self.1.lock().unwrap().push(report.clone());
        }
    }

    fn quick(bound_ms: u64) -> RecoveryConfig {
        RecoveryConfig {
            bound: Duration::from_millis(bound_ms),
            poll: Duration::from_millis(5),
            ..RecoveryConfig::default()
        }
    }

    #[test]
    fn a_device_nobody_holds_recovers_at_once() {
        let s = Subject(Tracker::new("health-unit-a"), Mutex::new(Vec::new()));
        let r = recover(&s, &quick(1000), None);
        assert_eq!(r.outcome, RecoveryOutcome::Recovered);
        assert!(r.holders.is_empty());
        assert!(r.elapsed_ms < 1000);
    }

    #[test]
    fn a_holder_that_stays_is_reported_with_its_line_at_the_bound() {
        let s = Arc::new(Subject(
            Tracker::new("health-unit-b"),
            Mutex::new(Vec::new()),
        ));
        let line = line!() + 1;
        let _held = s.0.register(ResourceKind::Qp, 7, 0);
        let t = Instant::now();
        let r = recover(&*s, &quick(60), None);
        assert!(t.elapsed() >= Duration::from_millis(60));
        assert!(t.elapsed() < Duration::from_millis(1000));
        assert_eq!(r.outcome, RecoveryOutcome::TimedOut);
        assert_eq!(r.holders.len(), 1);
        assert_eq!(r.holders[0].line, line);
        assert!(r.holders[0].file.ends_with("health.rs"));
        assert!(!s.1.lock().unwrap().is_empty(), "progress was published");
    }

    #[test]
    fn a_holder_released_during_the_wait_ends_it() {
        let s = Arc::new(Subject(
            Tracker::new("health-unit-c"),
            Mutex::new(Vec::new()),
        ));
        let held = s.0.register(ResourceKind::Cq, 1, 0);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            drop(held);
        });
        let r = recover(&*s, &quick(2000), None);
        t.join().unwrap();
        assert_eq!(r.outcome, RecoveryOutcome::Recovered);
        assert!(
            r.elapsed_ms >= 25 && r.elapsed_ms < 2000,
            "{}",
            r.elapsed_ms
        );
    }

    #[test]
    fn the_configuration_reads_the_environment() {
        let env = |k: &str| match k {
            "SOFTWARP_RECOVERY_BOUND_MS" => Some("2500".to_string()),
            "SOFTWARP_RECOVERY_TERMINATE" => Some("a, b,,c".to_string()),
            "SOFTWARP_RECOVERY_GRACE_MS" => Some("nope".to_string()),
            _ => None,
        };
        let c = RecoveryConfig::from_lookup(env);
        assert_eq!(c.bound, Duration::from_millis(2500));
        assert_eq!(c.terminate, ["a", "b", "c"]);
        assert_eq!(c.grace, RecoveryConfig::default().grace);
    }

    #[test]
    fn zombie_detection_reads_the_state_after_the_name() {
        assert!(!is_zombie(sys::pid()));
    }
}
