//! The error log: critical events (QP fatal, Terminate received, device fatal, leak at
//! close, connection manager overload) as structured JSON lines, each with a recommended
//! action, in a file rotated by size (`errors.jsonl`, `errors.jsonl.1`, ...
//! `errors.jsonl.<keep>`).
//!
//! Several processes may share one log file: lines are appended with `O_APPEND` (one
//! `write` per line), and a writer that finds the file rotated by someone else reopens it.
//! Two processes rotating at the same moment can shift one file twice; no line is lost
//! except in the oldest file, which rotation drops anyway.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use serde::{Deserialize, Serialize};

use crate::tracker::LeakReport;
use crate::{clock, sys};

/// Kinds of critical events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum CriticalKind {
    /// A QP went to the Error state because of a local or protocol failure.
    QpFatal,
    /// A peer sent a Terminate message.
    TerminateReceived,
    /// A device failed (injected, or its network interface went away).
    DeviceFatal,
    /// A recovery of a failed device ended: recovered, or timed out with holders left.
    DeviceRecovery,
    /// A QP's network went away under it (its local address was removed, its interface
    /// went down or disappeared): it was terminated at once.
    NetworkGone,
    /// A device closed with resources still allocated.
    LeakAtClose,
    /// The connection manager shed load: a listener stopped accepting at its backlog of
    /// unanswered connections, or an event channel dropped request errors.
    CmOverload,
    /// A process of another user (not root) connected to the control socket and was
    /// refused.
    ControlRefused,
    /// A connection's peer stopped answering: the kernel dropped the connection after
    /// keepalive probes or sent data went unanswered past their bound; its QP is in Error.
    PeerUnreachable,
    /// A peer broke the protocol a QP carries above RDMAP (the extended sockets' stream
    /// protocol): a message its state did not allow, or more than a queue's bound; the QP
    /// was terminated.
    PeerViolation,
}

impl CriticalKind {
    /// The kind's name in the log.
    pub const fn as_str(self) -> &'static str {
        match self {
            CriticalKind::QpFatal => "qp_fatal",
            CriticalKind::TerminateReceived => "terminate_received",
            CriticalKind::DeviceFatal => "device_fatal",
            CriticalKind::DeviceRecovery => "device_recovery",
            CriticalKind::NetworkGone => "network_gone",
            CriticalKind::LeakAtClose => "leak_at_close",
            CriticalKind::CmOverload => "cm_overload",
            CriticalKind::ControlRefused => "control_refused",
            CriticalKind::PeerUnreachable => "peer_unreachable",
            CriticalKind::PeerViolation => "peer_violation",
        }
    }

    /// What an operator should do about it.
    pub const fn recommended_action(self) -> &'static str {
        match self {
            CriticalKind::QpFatal => {
                "Check the detail and the QP's snapshot (softwarp snapshots --pid <pid> --qp \
                 <qpn>: state, counters, TCP_INFO and trace records); the application must \
                 destroy the QP and reconnect. Repeated QP errors on one \
                 path point at the network (softwarp doctor) or a peer bug."
            }
            CriticalKind::TerminateReceived => {
                "The peer reported a protocol or access error (layer/type/code in the detail): \
                 check STag, access rights and lengths on both sides, and the peer's logs; \
                 the connection is gone and must be re-established."
            }
            CriticalKind::DeviceFatal => {
                "Every QP of the device is in error: check the network interface (ip link), \
                 then have applications release their resources so the device can recover; \
                 softwarp resources names the processes that still hold some."
            }
            CriticalKind::DeviceRecovery => {
                "See the outcome in the detail. Timed out: the processes and source lines \
                 listed still hold resources of the failed device (softwarp resources \
                 --holders); have them destroy those objects (or add their names to the \
                 recovery's terminate list) and retry (Device::recover). Recovered: \
                 applications may create objects and connect again."
            }
            CriticalKind::NetworkGone => {
                "The local address or the network interface the connection used went away \
                 (ip addr, ip link): restore it, then destroy the QP and reconnect."
            }
            CriticalKind::LeakAtClose => {
                "Fix the application to destroy every listed resource before closing the \
                 device; the file:line of each shows where it was created."
            }
            CriticalKind::CmOverload => {
                "Connection requests arrive faster than the application answers them, or \
                 peers open connections that send no valid MPA Request: read the CM events \
                 and answer requests sooner, raise the listener's backlog if the load is \
                 legitimate, or filter the peers (softwarp stat: softwarp_cm_*)."
            }
            CriticalKind::ControlRefused => {
                "Another user's process tried to use this process's control socket (trace \
                 changes, dumps, statistics): only the owner and root may. Find who by the \
                 uid and pid in the detail; run softwarp as the owning user or as root."
            }
            CriticalKind::PeerUnreachable => {
                "The peer host stopped answering (down, unreachable, or its network cut): \
                 check it and the path to it (ping, ip route, softwarp doctor); the QP must \
                 be destroyed and the connection re-established. The bound is the \
                 connection's keepalive (ConnectOptions::tcp_keepalive, SOFTWARP_TCP_KEEPALIVE)."
            }
            CriticalKind::PeerViolation => {
                "The peer sent what the stream protocol forbids (the detail names the rule): \
                 a buggy or hostile peer, or a program that lets write notices pile up past \
                 their bound. The connection is gone; check the peer's software and version, \
                 and the snapshot named here."
            }
        }
    }
}

/// One critical event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CriticalEvent {
    /// What happened.
    pub kind: CriticalKind,
    /// The device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The QP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qpn: Option<u32>,
    /// The peer's address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    /// What exactly (the error, the Terminate's layer/type/code, the leak report).
    pub detail: String,
    /// What to do, when the kind's default advice ([`CriticalKind::recommended_action`]) is
    /// not the best.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    /// The id of the QP snapshot taken for it (see [`crate::snapshot`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<u64>,
}

impl CriticalEvent {
    /// An event of `kind` with `detail`.
    pub fn new(kind: CriticalKind, detail: impl Into<String>) -> Self {
        Self {
            kind,
            device: None,
            qpn: None,
            peer: None,
            detail: detail.into(),
            action: None,
            snapshot: None,
        }
    }

    /// A leak at the close of the device a report is about.
    pub fn leak(report: &LeakReport) -> Self {
        Self::new(CriticalKind::LeakAtClose, report.to_string()).with_device(&report.tracker)
    }

    /// With the device.
    pub fn with_device(mut self, device: impl Into<String>) -> Self {
        self.device = Some(device.into());
        self
    }

    /// With the QP.
    pub fn with_qpn(mut self, qpn: u32) -> Self {
        self.qpn = Some(qpn);
        self
    }

    /// With the peer.
    pub fn with_peer(mut self, peer: impl Into<String>) -> Self {
        self.peer = Some(peer.into());
        self
    }

    /// With the id of the QP snapshot taken for it: the recommended action then names it.
    pub fn with_snapshot(mut self, id: u64) -> Self {
        self.snapshot = Some(id);
        self
    }

    /// The recommended action as logged: the specific or the kind's advice, preceded by
    /// the command that shows the snapshot when there is one.
    pub fn action_text(&self) -> String {
        let advice = self
            .action
            .clone()
            .unwrap_or_else(|| self.kind.recommended_action().to_string());
        match self.snapshot {
            Some(id) => format!(
                "Snapshot {id} holds the QP's state, counters, TCP_INFO and trace records: \
                 softwarp snapshots --pid {} --id {id}. {advice}",
                sys::pid()
            ),
            None => advice,
        }
    }

    /// With a specific recommended action.
    pub fn with_action(mut self, action: impl Into<String>) -> Self {
        self.action = Some(action.into());
        self
    }
}

/// One line of the log, as written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogLine {
    /// When, RFC 3339 UTC.
    pub time: String,
    /// When, milliseconds since the Unix epoch.
    pub time_unix_ms: u64,
    /// Always `critical`.
    pub severity: String,
    /// The process.
    pub pid: u32,
    /// Its name.
    pub process: String,
    /// The event's kind.
    pub event: CriticalKind,
    /// The device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The QP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qpn: Option<u32>,
    /// The peer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    /// What exactly.
    pub detail: String,
    /// What to do.
    pub action: String,
    /// The QP snapshot taken for the event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<u64>,
}

/// Where the log goes and how big it grows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorLogConfig {
    /// The current file; rotated files get `.1`, `.2`, ... appended.
    pub path: PathBuf,
    /// Size at which the current file is rotated, in bytes.
    pub max_bytes: u64,
    /// Rotated files kept (the oldest beyond are deleted).
    pub keep: usize,
}

impl ErrorLogConfig {
    /// `errors.jsonl` in `dir`, 1 MiB per file, 4 rotated files kept.
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            path: dir.join("errors.jsonl"),
            max_bytes: 1 << 20,
            keep: 4,
        }
    }

    /// The path of rotated file `n` (1 = newest).
    pub fn rotated_path(&self, n: usize) -> PathBuf {
        let mut p = self.path.clone().into_os_string();
        p.push(format!(".{n}"));
        PathBuf::from(p)
    }
}

/// A size-rotated JSON-lines log of critical events.
#[derive(Debug)]
pub struct ErrorLog {
    config: ErrorLogConfig,
    file: Mutex<Option<File>>,
}

fn open_append(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path)
}

impl ErrorLog {
    /// Opens (creating) the log.
    pub fn open(config: ErrorLogConfig) -> io::Result<Self> {
        if let Some(dir) = config.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir)?;
        }
        let f = open_append(&config.path)?;
        Ok(Self {
            config,
            file: Mutex::new(Some(f)),
        })
    }

    /// Its configuration.
    pub fn config(&self) -> &ErrorLogConfig {
        &self.config
    }

    /// Appends `event` as one JSON line (rotating first when the line would take the file
    /// past its size); returns the line as written.
    pub fn log(&self, event: &CriticalEvent) -> io::Result<LogLine> {
        let now = std::time::SystemTime::now();
        let line = LogLine {
            time: clock::rfc3339(now),
            time_unix_ms: clock::unix_ms(now),
            severity: "critical".into(),
            pid: sys::pid(),
            process: sys::process_name().to_string(),
            event: event.kind,
            device: event.device.clone(),
            qpn: event.qpn,
            peer: event.peer.clone(),
            detail: event.detail.clone(),
            action: event.action_text(),
            snapshot: event.snapshot,
        };
        let mut bytes = serde_json::to_vec(&line).map_err(io::Error::other)?;
        bytes.push(b'\n');
        let mut guard = self.file.lock().unwrap_or_else(|e| e.into_inner());
        let mut file = match guard.take() {
            Some(f) if self.is_current(&f) => f,
            _ => open_append(&self.config.path)?,
        };
        let size = file.metadata()?.len();
        if size > 0 && size + bytes.len() as u64 > self.config.max_bytes {
            drop(file);
            self.rotate()?;
            file = open_append(&self.config.path)?;
        }
        let written = file.write_all(&bytes);
        *guard = Some(file);
        written?;
        Ok(line)
    }

    /// Whether `f` is still the file at the configured path (not rotated away by another
    /// process).
    fn is_current(&self, f: &File) -> bool {
        match (f.metadata(), fs::metadata(&self.config.path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }

    /// Shifts `path.(n)` to `path.(n+1)` down to `path` → `path.1`, dropping the oldest.
    fn rotate(&self) -> io::Result<()> {
        let keep = self.config.keep;
        if keep == 0 {
            return match fs::remove_file(&self.config.path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            };
        }
        let _ = fs::remove_file(self.config.rotated_path(keep));
        for n in (1..keep).rev() {
            let from = self.config.rotated_path(n);
            if from.exists() {
                fs::rename(&from, self.config.rotated_path(n + 1))?;
            }
        }
        fs::rename(&self.config.path, self.config.rotated_path(1))
    }
}

static GLOBAL: OnceLock<ErrorLog> = OnceLock::new();

/// Makes `log` the process-wide error log used by [`report`]; `false` if one is set already.
pub fn set_global(log: ErrorLog) -> bool {
    GLOBAL.set(log).is_ok()
}

/// The process-wide error log, if set.
pub fn global() -> Option<&'static ErrorLog> {
    GLOBAL.get()
}

/// Reports a critical event: a level 1 trace record (so it is in the flight recorder and
/// on the console) and a line in the process-wide error log when there is one. Never fails:
/// a log that cannot be written is itself traced.
pub fn report(event: &CriticalEvent) {
    let device = event.device.as_deref().unwrap_or("-");
    match event.qpn {
        Some(qpn) => crate::sw_event!(
            Ras,
            1,
            qpn = qpn,
            event = event.kind.as_str(),
            device,
            "{}",
            event.detail
        ),
        None => crate::sw_event!(
            Ras,
            1,
            event = event.kind.as_str(),
            device,
            "{}",
            event.detail
        ),
    }
    if let Some(log) = global() {
        if let Err(e) = log.log(event) {
            crate::sw_event!(
                Ras,
                1,
                "cannot write the error log {}: {e}",
                log.config.path.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_a_name_and_advice() {
        for k in [
            CriticalKind::QpFatal,
            CriticalKind::TerminateReceived,
            CriticalKind::DeviceFatal,
            CriticalKind::LeakAtClose,
        ] {
            assert_eq!(
                serde_json::to_string(&k).unwrap(),
                format!("\"{}\"", k.as_str())
            );
            assert!(k.recommended_action().len() > 20);
        }
    }

    #[test]
    fn an_event_with_a_snapshot_names_it_in_its_action() {
        let ev = CriticalEvent::new(CriticalKind::TerminateReceived, "x").with_snapshot(12);
        let action = ev.action_text();
        assert!(
            action.contains(&format!("softwarp snapshots --pid {} --id 12", sys::pid())),
            "{action}"
        );
        assert!(action.ends_with(CriticalKind::TerminateReceived.recommended_action()));
        assert_eq!(
            CriticalEvent::new(CriticalKind::QpFatal, "x").action_text(),
            CriticalKind::QpFatal.recommended_action()
        );
    }

    #[test]
    fn rotated_paths_append_a_number() {
        let c = ErrorLogConfig::in_dir(Path::new("/x"));
        assert_eq!(c.rotated_path(2), PathBuf::from("/x/errors.jsonl.2"));
    }
}
