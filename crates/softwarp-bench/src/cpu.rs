//! CPU time and heap accounting for `softwarp bench`.
//!
//! CPU: user + system time of the whole process (every thread, including the progress
//! threads and threads that already exited), from `/proc/self/stat`, in clock ticks of
//! 10 ms (Linux `USER_HZ` = 100): runs shorter than a second or so are coarse.
//!
//! Placement: [`pin_current_thread`] (`sched_setaffinity`), so that the two ends of a
//! ping-pong sit on different cores run after run.
//!
//! Heap: a counting global allocator (bytes live), switched on only for the `qp_mem`
//! measurement so the other runs pay nothing but one relaxed load per allocation. Only the
//! `softwarp-bench` program installs it (`src/main.rs`); [`counting_installed`] tells
//! whether the running program did.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

/// Linux `USER_HZ`: the unit of the times in `/proc/self/stat`.
const TICKS_PER_SEC: f64 = 100.0;

/// User + system CPU seconds of this process so far (0 when `/proc` is unreadable).
pub fn process_cpu_secs() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name (which may contain spaces) start at field 3 (state):
    // utime is field 14, stime field 15.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    (ticks(11) + ticks(12)) as f64 / TICKS_PER_SEC
}

/// Pins the calling thread to CPU `cpu` (threads it creates afterwards inherit the
/// placement). Returns false when the system refused (or there is no such CPU).
pub fn pin_current_thread(cpu: usize) -> bool {
    use rustix::thread::{sched_setaffinity, CpuSet};
    if cpu >= CpuSet::MAX_CPU {
        return false;
    }
    let mut set = CpuSet::new();
    set.set(cpu);
    // No pid: the calling thread.
    sched_setaffinity(None, &set).is_ok()
}

static COUNTING: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicIsize = AtomicIsize::new(0);

/// The system allocator, counting live bytes while counting is on.
#[derive(Debug)]
pub struct CountingAlloc;

fn count(delta: isize) {
    if COUNTING.load(Ordering::Relaxed) {
        LIVE.fetch_add(delta, Ordering::Relaxed);
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged (so the
// `GlobalAlloc` contract is `System`'s); the counting touches only two atomics.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

/// Starts counting heap bytes (from zero).
pub fn start_counting() {
    LIVE.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::Relaxed);
}

/// Heap bytes allocated and not freed since counting started.
pub fn live_bytes() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// Starts counting (from zero) and tells whether [`CountingAlloc`] is the running program's
/// global allocator, by counting one allocation of its own.
pub fn counting_installed() -> bool {
    start_counting();
    let probe = std::hint::black_box(Box::new([0u8; 64]));
    let seen = live_bytes() >= 64;
    drop(probe);
    seen
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counting_is_not_installed_in_a_program_that_did_not_ask_for_it() {
        // The test harness runs on the system allocator: nothing can be counted.
        assert!(!counting_installed());
    }

    #[test]
    fn cpu_time_grows_while_the_process_works() {
        let t0 = process_cpu_secs();
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed().as_millis() < 50 {
            x = x.wrapping_mul(31).wrapping_add(7);
        }
        std::hint::black_box(x);
        assert!(process_cpu_secs() >= t0);
    }
}
