//! Structure markers ("eye-catchers") as RAS reports them: the words that begin and end the
//! runtime's long-lived objects and guard its internal rings, how an object's markers are
//! shown (resource details, dumps) and the process's history of damaged markers found by
//! the checks.
//!
//! Generic over what carries the markers (the `softwarp` crate decides which objects have
//! which words); nothing here checks memory. No I/O, no thread: a bounded in-memory history
//! that dumps include (section `markers`) and `softwarp decode` flags.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// Damage records kept (the oldest are dropped and counted).
pub const MAX_DAMAGE_RECORDS: usize = 64;

/// One marker word of an object, as found when it was looked at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkerWord {
    /// Which word: `begin`, `end`, or a ring guard such as `sq.lo`, `cq.hi`.
    pub name: String,
    /// The word it must hold.
    pub expected: u64,
    /// The word it held.
    pub found: u64,
}

impl MarkerWord {
    /// The marker `name` that should hold `expected` and holds `found`.
    pub fn new(name: impl Into<String>, expected: u64, found: u64) -> Self {
        Self {
            name: name.into(),
            expected,
            found,
        }
    }

    /// Whether the word holds what it must.
    pub fn is_intact(&self) -> bool {
        self.expected == self.found
    }
}

/// A marker word as text: its eight bytes in memory order when they are printable ASCII
/// (every marker Softwarp writes is, so a hex dump of memory shows them), else hex.
pub fn word_text(word: u64) -> String {
    let bytes = word.to_le_bytes();
    if bytes.iter().all(|b| b.is_ascii_graphic()) {
        bytes.iter().map(|b| char::from(*b)).collect()
    } else {
        format!("{word:#018x}")
    }
}

impl fmt::Display for MarkerWord {
    /// `begin=SWQP-BEG`, or `begin=DAMAGED(found 0x..., expected SWQP-BEG)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_intact() {
            write!(f, "{}={}", self.name, word_text(self.found))
        } else {
            write!(
                f,
                "{}=DAMAGED(found {}, expected {})",
                self.name,
                word_text(self.found),
                word_text(self.expected)
            )
        }
    }
}

/// A damaged marker found by a check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkerDamage {
    /// The device (open instance) the object belongs to.
    pub device: String,
    /// The object's kind (`device`, `qp`, `cq`, `mr`).
    pub object: String,
    /// Its number within the kind (QP number, CQ id, STag; 0 for the device).
    pub id: u64,
    /// The damaged word.
    pub marker: MarkerWord,
    /// Which check found it (an entry point such as `QueuePair::post_send`, or `close`).
    pub check: String,
    /// When, milliseconds since the Unix epoch.
    pub time_unix_ms: u64,
}

impl fmt::Display for MarkerDamage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {}: {} (found by {})",
            self.device, self.object, self.id, self.marker, self.check
        )
    }
}

/// The `markers` section of a dump: the damage found so far in this process.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkersResult {
    /// The newest [`MAX_DAMAGE_RECORDS`] damage records, oldest first.
    pub damage: Vec<MarkerDamage>,
    /// Damaged markers found since the process started (including dropped records).
    pub detected: u64,
}

#[derive(Default)]
struct History {
    damage: VecDeque<MarkerDamage>,
    detected: u64,
}

static HISTORY: Mutex<History> = Mutex::new(History {
    damage: VecDeque::new(),
    detected: 0,
});

fn history_lock() -> std::sync::MutexGuard<'static, History> {
    HISTORY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records damage found by a check (a leaf lock, held for a push).
pub fn record(damage: MarkerDamage) {
    let mut h = history_lock();
    h.detected = h.detected.saturating_add(1);
    if h.damage.len() >= MAX_DAMAGE_RECORDS {
        h.damage.pop_front();
    }
    h.damage.push_back(damage);
}

/// The damage found so far.
pub fn history() -> MarkersResult {
    let h = history_lock();
    MarkersResult {
        damage: h.damage.iter().cloned().collect(),
        detected: h.detected,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_print_as_text_and_damage_is_flagged() {
        let w = u64::from_le_bytes(*b"SWQP-BEG");
        let ok = MarkerWord::new("begin", w, w);
        assert!(ok.is_intact());
        assert_eq!(ok.to_string(), "begin=SWQP-BEG");
        let bad = MarkerWord::new("begin", w, w ^ 0xff);
        assert!(!bad.is_intact());
        let text = bad.to_string();
        assert!(text.starts_with("begin=DAMAGED(found 0x"), "{text}");
        assert!(text.ends_with("expected SWQP-BEG)"), "{text}");
    }

    #[test]
    fn the_history_is_bounded_and_counts_what_it_dropped() {
        let before = history().detected;
        for i in 0..(MAX_DAMAGE_RECORDS as u64 + 3) {
            record(MarkerDamage {
                device: "d".into(),
                object: "qp".into(),
                id: i,
                marker: MarkerWord::new("end", 1, 2),
                check: "test".into(),
                time_unix_ms: 0,
            });
        }
        let h = history();
        assert_eq!(h.damage.len(), MAX_DAMAGE_RECORDS);
        assert!(h.detected >= before + MAX_DAMAGE_RECORDS as u64 + 3);
        assert_eq!(
            h.damage.last().map(|d| d.id),
            Some(MAX_DAMAGE_RECORDS as u64 + 2)
        );
    }
}
