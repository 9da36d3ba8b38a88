//! QP snapshots: when a QP fails (enters Error or Terminate because of a Terminate sent or
//! received, a local failure or a device fault), its state, error reason, addresses,
//! counters, queue depths, last TCP_INFO sample and the flight recorder records about it
//! are copied into a bounded per-process history that outlives the QP and its device.
//!
//! The crate is generic over what it snapshots: counters and queue depths are named
//! numbers, filled in by the verbs layer. Taking a snapshot is a few copies under the
//! history's own lock (a leaf lock: nothing else is locked while it is held), so it may be
//! called under a QP lock; nothing here runs unless a QP fails. No I/O here.
//!
//! Bound: [`DEFAULT_SNAPSHOTS`] snapshots unless `SOFTWARP_SNAPSHOTS` says otherwise (0
//! keeps none); the oldest is dropped and counted.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use serde::{Deserialize, Serialize};

use crate::stats::TcpInfo;
use crate::trace::Record;
use crate::{clock, sys};

/// Snapshots the process-wide history keeps unless configured otherwise.
pub const DEFAULT_SNAPSHOTS: usize = 64;
/// Most snapshots a history can be configured to keep.
pub const MAX_SNAPSHOTS: usize = 4096;
/// Environment variable with the process-wide history's capacity.
pub const SNAPSHOTS_ENV: &str = "SOFTWARP_SNAPSHOTS";
/// Most flight recorder records about the QP one snapshot keeps (the newest).
pub const SNAPSHOT_QP_RECORDS: usize = 256;
/// Records about no QP in particular (process-wide context) one snapshot keeps.
pub const SNAPSHOT_CONTEXT_RECORDS: usize = 16;

/// The Terminate message behind a snapshot, when there was one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TerminateInfo {
    /// `received` (the peer sent it) or `sent` (this QP detected a fault in the peer's
    /// stream and sent it).
    pub direction: String,
    /// Layer (0 RDMAP, 1 DDP, 2 LLP), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<u8>,
    /// Error type within the layer, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etype: Option<u8>,
    /// Error code, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<u8>,
    /// What it means.
    pub text: String,
}

/// Everything kept about one failed QP.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QpSnapshot {
    /// Number within the process (the error log line of the failure names it).
    pub id: u64,
    /// When, RFC 3339 UTC.
    pub time: String,
    /// When, milliseconds since the Unix epoch.
    pub time_unix_ms: u64,
    /// The process.
    pub pid: u32,
    /// Its name.
    pub process: String,
    /// The device instance (`softwarp0/2`).
    pub device: String,
    /// The QP number.
    pub qpn: u32,
    /// The QP's state when the snapshot was taken (`ERROR`, `TERMINATE` ...).
    pub state: String,
    /// The critical event kind (`terminate_received`, `qp_fatal`, `device_fatal` ...).
    pub event: String,
    /// Why it failed.
    pub reason: String,
    /// The Terminate behind it, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub terminate: Option<TerminateInfo>,
    /// Local address of the connection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_addr: Option<SocketAddr>,
    /// Peer address of the connection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_addr: Option<SocketAddr>,
    /// The engine's counters of the QP (`tx_send_messages`, `terminates_received` ...).
    pub counters: BTreeMap<String, u64>,
    /// Queue depths (`sq_outstanding`, `rq_posted`, `reads_outstanding` ...).
    pub queues: BTreeMap<String, u64>,
    /// Fixed and connection attributes (PD, CQs, MPA revision, CRC, IRD/ORD ...).
    pub attrs: BTreeMap<String, String>,
    /// The last TCP_INFO sample of its connection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_info: Option<TcpInfo>,
    /// Flight recorder records about the QP, with a few process-wide ones around them,
    /// oldest first.
    pub records: Vec<Record>,
}

impl QpSnapshot {
    /// A snapshot of QP `qpn` of `device` stamped now with this process; fill in the rest.
    pub fn new(id: u64, device: &str, qpn: u32) -> Self {
        let now = std::time::SystemTime::now();
        Self {
            id,
            time: clock::rfc3339(now),
            time_unix_ms: clock::unix_ms(now),
            pid: sys::pid(),
            process: sys::process_name().to_string(),
            device: device.to_string(),
            qpn,
            state: String::new(),
            event: String::new(),
            reason: String::new(),
            terminate: None,
            local_addr: None,
            peer_addr: None,
            counters: BTreeMap::new(),
            queues: BTreeMap::new(),
            attrs: BTreeMap::new(),
            tcp_info: None,
            records: Vec::new(),
        }
    }
}

impl fmt::Display for QpSnapshot {
    /// Several lines: a heading, the reason, the Terminate, addresses, queues, non-zero
    /// counters, attributes, TCP_INFO and the records (indented).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "snapshot {} {} pid {} ({}) {} QP {} {} [{}]",
            self.id,
            self.time,
            self.pid,
            self.process,
            self.device,
            self.qpn,
            self.state,
            self.event
        )?;
        writeln!(f, "  reason: {}", self.reason)?;
        if let Some(t) = &self.terminate {
            write!(f, "  terminate {}:", t.direction)?;
            if let (Some(l), Some(e), Some(c)) = (t.layer, t.etype, t.code) {
                write!(f, " layer {l} type {e} code {c:#04x}")?;
            }
            writeln!(f, " {}", t.text)?;
        }
        let addr = |a: Option<SocketAddr>| a.map_or_else(|| "-".to_string(), |a| a.to_string());
        writeln!(
            f,
            "  local {} peer {}",
            addr(self.local_addr),
            addr(self.peer_addr)
        )?;
        let join = |m: &BTreeMap<String, u64>, all: bool| {
            m.iter()
                .filter(|(_, v)| all || **v != 0)
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        writeln!(f, "  queues: {}", join(&self.queues, true))?;
        writeln!(f, "  counters (non-zero): {}", join(&self.counters, false))?;
        if !self.attrs.is_empty() {
            let a: Vec<String> = self.attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
            writeln!(f, "  attrs: {}", a.join(" "))?;
        }
        if let Some(t) = &self.tcp_info {
            writeln!(
                f,
                "  tcp_info: rtt {} us rttvar {} us retransmits {} total_retrans {} cwnd {} \
                 unacked {} lost {} bytes_acked {}",
                t.rtt_us,
                t.rttvar_us,
                t.retransmits,
                t.total_retrans,
                t.snd_cwnd,
                t.unacked,
                t.lost,
                t.bytes_acked
                    .map_or_else(|| "-".to_string(), |b| b.to_string())
            )?;
        }
        writeln!(f, "  records ({}):", self.records.len())?;
        for r in &self.records {
            writeln!(f, "    {r}")?;
        }
        Ok(())
    }
}

/// What the history holds (the `snapshots` control request's result).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SnapshotsResult {
    /// Snapshots it keeps at most.
    pub capacity: usize,
    /// Snapshots taken since the process started.
    pub taken: u64,
    /// Snapshots dropped to respect the bound (the oldest first).
    pub dropped: u64,
    /// The snapshots asked for, oldest first.
    pub snapshots: Vec<QpSnapshot>,
}

/// Which snapshots to return.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotFilter {
    /// Only of this QP number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qpn: Option<u32>,
    /// Only of this device instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Only this snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<u64>,
}

impl SnapshotFilter {
    /// Whether `s` is selected.
    pub fn matches(&self, s: &QpSnapshot) -> bool {
        self.qpn.is_none_or(|q| q == s.qpn)
            && self.device.as_deref().is_none_or(|d| d == s.device)
            && self.id.is_none_or(|i| i == s.id)
    }
}

#[derive(Debug, Default)]
struct Kept {
    snapshots: VecDeque<Arc<QpSnapshot>>,
    taken: u64,
    dropped: u64,
}

/// A bounded history of snapshots; the oldest is dropped (and counted) when full.
#[derive(Debug)]
pub struct SnapshotHistory {
    kept: Mutex<Kept>,
    capacity: usize,
    next_id: AtomicU64,
}

impl SnapshotHistory {
    /// A history keeping the newest `capacity` snapshots (at most [`MAX_SNAPSHOTS`]; 0
    /// keeps none, every snapshot is counted as dropped).
    pub fn new(capacity: usize) -> Self {
        Self {
            kept: Mutex::new(Kept::default()),
            capacity: capacity.min(MAX_SNAPSHOTS),
            next_id: AtomicU64::new(1),
        }
    }

    fn kept(&self) -> MutexGuard<'_, Kept> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Snapshots it keeps at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The id of the next snapshot (given out before the snapshot is filled in, so the
    /// error log line of the failure can name it).
    pub fn reserve_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Keeps `snapshot`, dropping the oldest when full.
    pub fn push(&self, snapshot: QpSnapshot) {
        let mut k = self.kept();
        k.taken += 1;
        if self.capacity == 0 {
            k.dropped += 1;
            return;
        }
        while k.snapshots.len() >= self.capacity {
            k.snapshots.pop_front();
            k.dropped += 1;
        }
        k.snapshots.push_back(Arc::new(snapshot));
    }

    /// Snapshots kept.
    pub fn len(&self) -> usize {
        self.kept().snapshots.len()
    }

    /// Whether it keeps none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The snapshots `filter` selects, with the history's bookkeeping. The list is copied
    /// outside the lock.
    pub fn list(&self, filter: &SnapshotFilter) -> SnapshotsResult {
        let (kept, taken, dropped) = {
            let k = self.kept();
            let kept: Vec<Arc<QpSnapshot>> = k
                .snapshots
                .iter()
                .filter(|s| filter.matches(s))
                .cloned()
                .collect();
            (kept, k.taken, k.dropped)
        };
        SnapshotsResult {
            capacity: self.capacity,
            taken,
            dropped,
            snapshots: kept.iter().map(|s| QpSnapshot::clone(s)).collect(),
        }
    }
}

static GLOBAL: OnceLock<SnapshotHistory> = OnceLock::new();

/// The process-wide history (capacity from `SOFTWARP_SNAPSHOTS`, else
/// [`DEFAULT_SNAPSHOTS`]), created on first use.
pub fn history() -> &'static SnapshotHistory {
    GLOBAL.get_or_init(|| {
        let capacity = std::env::var(SNAPSHOTS_ENV)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_SNAPSHOTS);
        SnapshotHistory::new(capacity)
    })
}

/// Creates the process-wide history with `capacity`; `false` if it exists already (then
/// its capacity stays).
pub fn init_history(capacity: usize) -> bool {
    GLOBAL.set(SnapshotHistory::new(capacity)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(h: &SnapshotHistory, qpn: u32) -> u64 {
        let id = h.reserve_id();
        let mut s = QpSnapshot::new(id, "dev/1", qpn);
        s.reason = format!("qp {qpn} failed");
        h.push(s);
        id
    }

    #[test]
    fn the_newest_n_are_kept_and_the_dropped_counted() {
        let h = SnapshotHistory::new(3);
        let ids: Vec<u64> = (0..5).map(|q| snap(&h, q)).collect();
        let all = h.list(&SnapshotFilter::default());
        assert_eq!((all.capacity, all.taken, all.dropped), (3, 5, 2));
        let kept: Vec<u64> = all.snapshots.iter().map(|s| s.id).collect();
        assert_eq!(kept, ids[2..]);
        let one = h.list(&SnapshotFilter {
            qpn: Some(3),
            ..SnapshotFilter::default()
        });
        assert_eq!(one.snapshots.len(), 1);
        assert_eq!(one.snapshots[0].qpn, 3);
        let none = h.list(&SnapshotFilter {
            device: Some("dev/2".into()),
            ..SnapshotFilter::default()
        });
        assert!(none.snapshots.is_empty());
    }

    #[test]
    fn a_zero_capacity_keeps_nothing_but_counts() {
        let h = SnapshotHistory::new(0);
        snap(&h, 1);
        assert!(h.is_empty());
        let r = h.list(&SnapshotFilter::default());
        assert_eq!((r.taken, r.dropped), (1, 1));
    }

    #[test]
    fn a_snapshot_prints_its_reason_terminate_and_records() {
        let mut s = QpSnapshot::new(9, "dev/1", 4);
        s.state = "ERROR".into();
        s.event = "terminate_received".into();
        s.reason = "the peer sent a Terminate".into();
        s.terminate = Some(TerminateInfo {
            direction: "received".into(),
            layer: Some(1),
            etype: Some(0),
            code: Some(2),
            text: "DDP tagged buffer: base or bounds".into(),
        });
        s.counters.insert("tx_send_messages".into(), 3);
        s.counters.insert("crc_errors".into(), 0);
        s.queues.insert("sq_outstanding".into(), 0);
        s.records.push(Record {
            message: "Terminate received".into(),
            ..Record::default()
        });
        let text = s.to_string();
        assert!(text.starts_with("snapshot 9 "), "{text}");
        assert!(
            text.contains("dev/1 QP 4 ERROR [terminate_received]"),
            "{text}"
        );
        assert!(
            text.contains("terminate received: layer 1 type 0 code 0x02"),
            "{text}"
        );
        assert!(text.contains("tx_send_messages=3"), "{text}");
        assert!(
            !text.contains("crc_errors"),
            "zero counters are left out: {text}"
        );
        assert!(text.contains("sq_outstanding=0"), "{text}");
        assert!(text.contains("records (1):"), "{text}");
        let back: QpSnapshot = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }
}
