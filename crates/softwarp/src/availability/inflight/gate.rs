//! The in-flight gate of a device: how many threads are inside its entry points, and
//! whether new entries are let in. One atomic word; no lock.
//!
//! This file depends on nothing but `super::sync` (atomics), so that the model checker's
//! test (`tests/it/inflight_loom.rs`) includes it by path over loom's atomics, and the
//! library over the standard ones.
//!
//! The word holds a count of threads inside (bits 0-61) and two flags: [`CLOSED`] (the
//! device was closed: for good) and [`QUIESCED`] (a quiesce is in progress or holds the
//! device: until it ends). An entry adds one to the word and looks at the flags in the
//! value it replaced; if either is set it takes its one back and is refused. Because the
//! flags and the count are one word, every entry is ordered against every `shut`: an entry
//! before it was counted (and the shutting thread waits for it to leave), an entry after it
//! sees the flag. Entry is `Acquire` (it sees what the thread that reopened the gate did
//! before `open`), leaving is `Release` (the thread that waits for the count to reach zero
//! sees everything done inside).

use super::sync::{AtomicU64, Ordering};

/// The device is closed: entries are refused for good.
pub const CLOSED: u64 = 1 << 63;
/// A quiesce holds the device: entries are refused until it ends.
pub const QUIESCED: u64 = 1 << 62;
/// The bits that count threads inside.
pub const COUNT: u64 = QUIESCED - 1;

/// Why an entry was refused: the flags that were set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused(pub u64);

impl Refused {
    /// The device was closed.
    pub fn closed(self) -> bool {
        self.0 & CLOSED != 0
    }
}

/// The gate (see the module docs).
#[derive(Debug)]
pub struct Gate {
    word: AtomicU64,
}

impl Default for Gate {
    fn default() -> Self {
        Self::new()
    }
}

impl Gate {
    /// An open gate with nobody inside.
    pub fn new() -> Self {
        Self {
            word: AtomicU64::new(0),
        }
    }

    /// Lets the calling thread in (one atomic add), or refuses it when the gate is shut.
    /// Every `Ok` must be paired with one [`Gate::leave`].
    #[inline]
    pub fn enter(&self) -> Result<(), Refused> {
        let before = self.word.fetch_add(1, Ordering::Acquire);
        if before & (CLOSED | QUIESCED) != 0 {
            self.leave();
            return Err(Refused(before & (CLOSED | QUIESCED)));
        }
        Ok(())
    }

    /// The calling thread leaves (one atomic subtract).
    #[inline]
    pub fn leave(&self) {
        self.word.fetch_sub(1, Ordering::Release);
    }

    /// Sets `flag` ([`CLOSED`] or [`QUIESCED`]): later entries are refused. Returns the
    /// flags that were set before (a second quiesce sees [`QUIESCED`] and must not proceed).
    pub fn shut(&self, flag: u64) -> u64 {
        self.word.fetch_or(flag, Ordering::AcqRel) & (CLOSED | QUIESCED)
    }

    /// Clears `flag`: entries are let in again (unless another flag is still set).
    pub fn open(&self, flag: u64) {
        self.word.fetch_and(!flag, Ordering::Release);
    }

    /// Threads inside now (including ones being refused at this instant, which leave at
    /// once). `Acquire`: once it reads 0 after a `shut`, everything those threads did inside
    /// happened before.
    pub fn inside(&self) -> u64 {
        self.word.load(Ordering::Acquire) & COUNT
    }

    /// The flags set now.
    #[allow(dead_code)] // the library's unit tests and tests/it/inflight_loom.rs
    pub fn flags(&self) -> u64 {
        self.word.load(Ordering::Relaxed) & (CLOSED | QUIESCED)
    }
}
