//! How every polling loop of `softwarp bench` (Softwarp and raw TCP alike) waits: spin,
//! and give the core away now and then.
//!
//! On a small machine shared with other work (2 cores here), two ping-pong threads that only
//! spin can end up on one core, where each turn waits for the scheduler's time slice
//! (milliseconds). Yielding every few dozen empty polls lets the peer run at once when it
//! shares the core, and costs one cheap system call otherwise.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

/// Empty polls between two yields (0: never yield).
static YIELD_EVERY: AtomicU32 = AtomicU32::new(32);

/// Sets how many empty polls pass between two yields (0: never yield).
pub fn set_yield_every(n: u32) {
    YIELD_EVERY.store(n, Ordering::Relaxed);
}

/// Waits a little after the `spins`-th empty poll.
pub fn pause(spins: u32) {
    let every = YIELD_EVERY.load(Ordering::Relaxed);
    if every != 0 && spins.is_multiple_of(every) {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// Empty polls between two looks at the clock in a bounded wait.
const CLOCK_EVERY: u32 = 4096;

/// One empty poll of a wait bounded by `deadline`: counts it in `spins`, fails with
/// `what()` once the deadline has passed (the clock is read every few thousand polls only),
/// then pauses as [`pause`] does.
pub fn wait_step(
    spins: &mut u32,
    deadline: Instant,
    what: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    *spins = spins.wrapping_add(1);
    if spins.is_multiple_of(CLOCK_EVERY) && Instant::now() >= deadline {
        anyhow::bail!(what());
    }
    pause(*spins);
    Ok(())
}
