//! How every polling loop of `softwarp bench` (Softwarp and raw TCP alike) waits: spin,
//! and give the core away now and then.
//!
//! On a small machine shared with other work (2 cores here), two ping-pong threads that only
//! spin can end up on one core, where each turn waits for the scheduler's time slice
//! (milliseconds). Yielding every few dozen empty polls lets the peer run at once when it
//! shares the core, and costs one cheap system call otherwise.

/// Empty polls between two yields.
const YIELD_EVERY: u32 = 32;

/// Waits a little after the `spins`-th empty poll.
pub fn pause(spins: u32) {
    if spins % YIELD_EVERY == 0 {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}
