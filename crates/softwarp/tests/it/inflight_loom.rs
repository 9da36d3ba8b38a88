//! Model check of the in-flight gate (`src/inflight/gate.rs`) with loom: every
//! interleaving (up to loom's preemption bound) of threads entering and leaving against a
//! thread that shuts the gate, waits for the count to reach zero, changes what the entries
//! use, and opens the gate again.
//!
//! The gate's file is included by path over loom's atomics (this file's `sync` module), so
//! this runs in plain `cargo test` without `--cfg loom` rebuilding every dependency. What
//! it proves: an entry that was let in finishes its work before the shutting thread
//! touches the state (loom's `UnsafeCell` reports any access that is not ordered by
//! happens-before); an entry after the shut is refused; an entry after `open` sees the
//! new state; refused entries leave no count behind; one of two concurrent quiescers
//! wins.
#![allow(dead_code, clippy::unwrap_used, clippy::panic)]
// loom's `UnsafeCell` hands out raw pointers: reading or writing through one is how the
// model sees each access (and reports one that races); this file touches nothing else.
#![allow(unsafe_code)]

mod sync {
    pub(super) use loom::sync::atomic::{AtomicU64, Ordering};
}

#[path = "../../src/availability/inflight/gate.rs"]
mod gate;

use gate::{Gate, CLOSED, QUIESCED};
use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

/// The model with a preemption bound that keeps the run to seconds.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

/// The state entry points use and a quiesce replaces.
struct Device {
    gate: Gate,
    state: UnsafeCell<u64>,
}

impl Device {
    /// An entry point: enter, read the state, leave. `Some(state)` when let in.
    fn verb(&self) -> Option<u64> {
        self.gate.enter().ok()?;
        // SAFETY: `p` points to the cell's value, alive for the call; loom reports the read
        // if it is not ordered against the quiescer's write.
        let v = self.state.with(|p| unsafe { *p });
        self.gate.leave();
        Some(v)
    }
}

/// Waits (yielding to the model) until nobody is inside.
fn wait_empty(gate: &Gate) {
    while gate.inside() != 0 {
        thread::yield_now();
    }
}

#[test]
fn a_quiesce_waits_for_entries_and_later_entries_see_its_changes() {
    model(|| {
        let dev = Arc::new(Device {
            gate: Gate::new(),
            state: UnsafeCell::new(1),
        });
        let users: Vec<_> = (0..2)
            .map(|_| {
                let dev = Arc::clone(&dev);
                thread::spawn(move || {
                    // Let in before the shut: sees the old state; after the open: the new
                    // one; in between: refused.
                    let seen = dev.verb();
                    assert!(matches!(seen, None | Some(1) | Some(2)), "{seen:?}");
                })
            })
            .collect();
        assert_eq!(dev.gate.shut(QUIESCED), 0);
        wait_empty(&dev.gate);
        // Nobody is inside: replacing the state races with no entry (loom checks it).
        // SAFETY: `p` points to the cell's value, alive for the call.
        dev.state.with_mut(|p| unsafe { *p = 2 });
        dev.gate.open(QUIESCED);
        for u in users {
            u.join().unwrap();
        }
        // After the open, an entry is let in and sees the new state.
        assert_eq!(dev.verb(), Some(2));
        assert_eq!(dev.gate.inside(), 0);
    });
}

#[test]
fn a_close_refuses_later_entries_for_good_and_leaves_no_count_behind() {
    model(|| {
        let dev = Arc::new(Device {
            gate: Gate::new(),
            state: UnsafeCell::new(1),
        });
        let user = {
            let dev = Arc::clone(&dev);
            thread::spawn(move || {
                let first = dev.verb();
                let second = dev.verb();
                // Once refused, refused again (the close is for good).
                assert!(!(first.is_none() && second.is_some()));
            })
        };
        dev.gate.shut(CLOSED);
        wait_empty(&dev.gate);
        // Tear-down: no entry can be inside now.
        // SAFETY: `p` points to the cell's value, alive for the call.
        dev.state.with_mut(|p| unsafe { *p = 0 });
        assert!(dev.gate.enter().unwrap_err().closed());
        user.join().unwrap();
        assert_eq!(dev.gate.inside(), 0);
        assert_eq!(dev.gate.flags(), CLOSED);
    });
}

#[test]
fn of_two_concurrent_quiesces_exactly_one_proceeds() {
    model(|| {
        let gate = Arc::new(Gate::new());
        let other = {
            let gate = Arc::clone(&gate);
            thread::spawn(move || gate.shut(QUIESCED) == 0)
        };
        let mine = gate.shut(QUIESCED) == 0;
        let theirs = other.join().unwrap();
        assert!(mine ^ theirs, "exactly one quiesce proceeds");
    });
}
