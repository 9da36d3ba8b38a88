//! The flight recorder: a bounded in-memory ring of the most recent trace records, always on
//! at its own level, read by snapshots, dumps and `softwarp trace --tail`. No I/O here.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use serde::{Deserialize, Serialize};

use super::Record;

/// Records the process-wide recorder keeps unless configured otherwise.
pub const DEFAULT_FLIGHT_RECORDER_CAPACITY: usize = 4096;
/// Most records a recorder can be configured to keep.
pub const MAX_FLIGHT_RECORDER_CAPACITY: usize = 1 << 20;
/// Environment variable with the process-wide recorder's capacity in records.
pub const FLIGHT_RECORDER_ENV: &str = "SOFTWARP_FLIGHT_RECORDER";

#[derive(Debug)]
struct Ring {
    records: VecDeque<Record>,
    next_seq: u64,
    evicted: u64,
    /// An evicted record whose buffers the next record reuses.
    spare: Option<Record>,
}

/// A bounded ring of the most recent records; the oldest is evicted when full.
#[derive(Debug)]
pub struct FlightRecorder {
    ring: Mutex<Ring>,
    capacity: usize,
}

/// Everything a recorder holds, with its bookkeeping (what the control socket returns).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlightRecorderDump {
    /// Records it can hold.
    pub capacity: usize,
    /// Records evicted since it started (older history that is gone).
    pub evicted: u64,
    /// The sequence number the next record will get (a client asks for records after the
    /// last one it saw to follow the recorder).
    pub next_seq: u64,
    /// The records, oldest first.
    pub records: Vec<Record>,
}

impl FlightRecorder {
    /// A recorder keeping the last `capacity` records (at least 1, at most
    /// [`MAX_FLIGHT_RECORDER_CAPACITY`]).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.clamp(1, MAX_FLIGHT_RECORDER_CAPACITY);
        Self {
            ring: Mutex::new(Ring {
                records: VecDeque::with_capacity(capacity.min(4096)),
                next_seq: 1,
                evicted: 0,
                spare: None,
            }),
            capacity,
        }
    }

    fn ring(&self) -> MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records it can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Records it holds.
    pub fn len(&self) -> usize {
        self.ring().records.len()
    }

    /// Whether it holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records evicted so far.
    pub fn evicted(&self) -> u64 {
        self.ring().evicted
    }

    /// The sequence number the next record gets.
    pub fn next_seq(&self) -> u64 {
        self.ring().next_seq
    }

    /// An evicted record whose buffers can be reused for the next one.
    pub(crate) fn take_spare(&self) -> Option<Record> {
        self.ring().spare.take()
    }

    /// Stores `record` (giving it the next sequence number, which is returned), evicting the
    /// oldest when full.
    pub fn push(&self, mut record: Record) -> u64 {
        let mut ring = self.ring();
        let seq = ring.next_seq;
        ring.next_seq += 1;
        record.seq = seq;
        if ring.records.len() >= self.capacity {
            let old = ring.records.pop_front();
            ring.evicted += 1;
            ring.spare = old;
        }
        ring.records.push_back(record);
        seq
    }

    /// Every record, oldest first.
    pub fn snapshot(&self) -> Vec<Record> {
        self.ring().records.iter().cloned().collect()
    }

    /// The newest `n` records, oldest first.
    pub fn tail(&self, n: usize) -> Vec<Record> {
        let ring = self.ring();
        let skip = ring.records.len().saturating_sub(n);
        ring.records.iter().skip(skip).cloned().collect()
    }

    /// At most `max` records with a sequence number above `seq`, oldest first.
    pub fn after(&self, seq: u64, max: usize) -> Vec<Record> {
        let ring = self.ring();
        // Sequence numbers are consecutive in the ring, so the start is computed, not
        // searched.
        let first = ring.records.front().map_or(ring.next_seq, |r| r.seq);
        let skip =
            usize::try_from(seq.saturating_add(1).saturating_sub(first)).unwrap_or(usize::MAX);
        ring.records.iter().skip(skip).take(max).cloned().collect()
    }

    /// What a QP snapshot keeps of the ring: the newest `max_qp` records about QP `qpn`
    /// (records that name another device in their fields are left out: QP numbers are per
    /// device), and the newest `context` records about no QP in particular, merged oldest
    /// first. One pass over the ring under its lock; call it only when a QP fails.
    pub fn records_of_qp(
        &self,
        qpn: u32,
        device: Option<&str>,
        max_qp: usize,
        context: usize,
    ) -> Vec<Record> {
        let needle = device.map(|d| format!("device={d:?}"));
        let other_device = |r: &Record| match &needle {
            Some(n) => r.fields.contains("device=") && !r.fields.contains(n.as_str()),
            None => false,
        };
        let ring = self.ring();
        let (mut of_qp, mut around) = (0usize, 0usize);
        let mut picked: Vec<&Record> = Vec::new();
        for r in ring.records.iter().rev() {
            if of_qp >= max_qp && around >= context {
                break;
            }
            match r.qpn {
                Some(q) if q == qpn && of_qp < max_qp && !other_device(r) => {
                    of_qp += 1;
                    picked.push(r);
                }
                None if around < context => {
                    around += 1;
                    picked.push(r);
                }
                _ => {}
            }
        }
        picked.into_iter().rev().cloned().collect()
    }

    /// Everything with bookkeeping; `tail` limits it to the newest records, `after` to those
    /// after a sequence number.
    pub fn dump(&self, tail: Option<usize>, after: Option<u64>) -> FlightRecorderDump {
        let records = match (after, tail) {
            (Some(seq), tail) => self.after(seq, tail.unwrap_or(usize::MAX)),
            (None, Some(n)) => self.tail(n),
            (None, None) => self.snapshot(),
        };
        let ring = self.ring();
        FlightRecorderDump {
            capacity: self.capacity,
            evicted: ring.evicted,
            next_seq: ring.next_seq,
            records,
        }
    }

    /// Forgets every record (sequence numbers keep counting).
    pub fn clear(&self) {
        let mut ring = self.ring();
        let n = ring.records.len() as u64;
        ring.evicted += n;
        ring.records.clear();
    }
}

static GLOBAL: OnceLock<Arc<FlightRecorder>> = OnceLock::new();

/// The process-wide flight recorder (capacity from `SOFTWARP_FLIGHT_RECORDER`, else
/// [`DEFAULT_FLIGHT_RECORDER_CAPACITY`]), created on first use.
pub fn flight_recorder() -> &'static Arc<FlightRecorder> {
    GLOBAL.get_or_init(|| {
        let capacity = std::env::var(FLIGHT_RECORDER_ENV)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_FLIGHT_RECORDER_CAPACITY);
        Arc::new(FlightRecorder::new(capacity))
    })
}

/// Creates the process-wide flight recorder with `capacity` records; `false` if it exists
/// already (then its capacity stays).
pub fn init_flight_recorder(capacity: usize) -> bool {
    GLOBAL.set(Arc::new(FlightRecorder::new(capacity))).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(msg: &str) -> Record {
        Record {
            message: msg.to_string(),
            ..Record::default()
        }
    }

    #[test]
    fn keeps_the_last_n_records_in_order() {
        let r = FlightRecorder::new(3);
        for i in 0..10 {
            r.push(rec(&format!("m{i}")));
        }
        let msgs: Vec<_> = r.snapshot().into_iter().map(|r| r.message).collect();
        assert_eq!(msgs, ["m7", "m8", "m9"]);
        assert_eq!(r.evicted(), 7);
        assert_eq!(r.len(), 3);
        let seqs: Vec<_> = r.snapshot().into_iter().map(|r| r.seq).collect();
        assert_eq!(seqs, [8, 9, 10]);
    }

    #[test]
    fn tail_and_after_select_the_newest() {
        let r = FlightRecorder::new(5);
        for i in 0..8 {
            r.push(rec(&format!("m{i}")));
        }
        // Holds seq 4..=8.
        let t: Vec<_> = r.tail(2).into_iter().map(|r| r.seq).collect();
        assert_eq!(t, [7, 8]);
        assert_eq!(r.tail(100).len(), 5);
        let a: Vec<_> = r.after(5, 100).into_iter().map(|r| r.seq).collect();
        assert_eq!(a, [6, 7, 8]);
        let a: Vec<_> = r.after(0, 2).into_iter().map(|r| r.seq).collect();
        assert_eq!(a, [4, 5], "records evicted since are skipped");
        assert!(r.after(8, 10).is_empty());
        assert!(r.after(u64::MAX, 10).is_empty());
        let d = r.dump(Some(1), None);
        assert_eq!(
            (d.capacity, d.evicted, d.next_seq, d.records.len()),
            (5, 3, 9, 1)
        );
    }

    #[test]
    fn an_evicted_record_is_offered_for_reuse() {
        let r = FlightRecorder::new(1);
        r.push(rec("a"));
        assert!(r.take_spare().is_none());
        r.push(rec("b"));
        assert_eq!(r.take_spare().map(|s| s.message), Some("a".to_string()));
    }

    #[test]
    fn capacity_is_clamped() {
        assert_eq!(FlightRecorder::new(0).capacity(), 1);
        assert_eq!(
            FlightRecorder::new(usize::MAX).capacity(),
            MAX_FLIGHT_RECORDER_CAPACITY
        );
    }

    #[test]
    fn records_of_a_qp_keep_its_own_and_a_little_context() {
        let r = FlightRecorder::new(100);
        let mk = |qpn: Option<u32>, msg: &str, fields: &str| Record {
            qpn,
            message: msg.to_string(),
            fields: fields.to_string(),
            ..Record::default()
        };
        r.push(mk(None, "old context", ""));
        r.push(mk(Some(7), "q7 a", ""));
        r.push(mk(Some(8), "q8", ""));
        r.push(mk(Some(7), "q7 other device", "device=\"dev/2\""));
        r.push(mk(Some(7), "q7 b", "device=\"dev/1\""));
        r.push(mk(None, "context", ""));
        r.push(mk(Some(7), "q7 c", ""));
        let msgs: Vec<String> = r
            .records_of_qp(7, Some("dev/1"), 10, 1)
            .into_iter()
            .map(|r| r.message)
            .collect();
        assert_eq!(msgs, ["q7 a", "q7 b", "context", "q7 c"]);
        let newest: Vec<String> = r
            .records_of_qp(7, None, 2, 0)
            .into_iter()
            .map(|r| r.message)
            .collect();
        assert_eq!(newest, ["q7 b", "q7 c"]);
    }

    #[test]
    fn clear_forgets_records_but_not_sequence_numbers() {
        let r = FlightRecorder::new(4);
        r.push(rec("a"));
        r.push(rec("b"));
        r.clear();
        assert!(r.is_empty());
        assert_eq!(r.push(rec("c")), 3);
    }
}
