//! In-flight tracking: which threads are inside a device's entry points, so that closing
//! the device ([`crate::Device::close`]) and recovering it ([`crate::Device::quiesce`])
//! wait for them to leave, with a bound, and name those that do not.
//!
//! - The count is one atomic word per device ([`gate::Gate`], on a cache line of its own):
//!   an entry point adds one when it starts and subtracts one when it returns (an RAII
//!   guard, [`Inflight`], so early returns and unwinding leave too). No lock on this path.
//!   The same word carries the "closed" and "quiesced" flags, so an entry after a shut is
//!   refused and one before it is counted (`gate.rs`; model-checked with loom in
//!   `tests/it/inflight_loom.rs`).
//! - Who is inside: each thread that enters has a slot (taken once per thread from a
//!   process-wide pool, given back when the thread exits) where the entry writes the
//!   device's gate number and the entry point with one relaxed store, and restores what
//!   was there when it leaves (entries nest: a tracing callback inside a verb may call
//!   another). A quiesce that runs out of time reads the slots: thread name, kernel thread
//!   id and entry point of every thread still inside ([`InflightReport`]). A thread that
//!   enters while its thread-local storage is being torn down (a verb in a thread-local
//!   destructor) is counted but has no slot of its own (it writes a shared one the reports
//!   do not read); the report says how many it could not name.
//!   The pool keeps one small slot per thread alive at the same time (it never shrinks:
//!   reused, not freed).
//! - Blocking waits (get_cq_event, wait_closed, blocking connects) are not entries: a
//!   thread parked there holds nothing the close tears down, and counting it would make a
//!   close wait for an event that the close itself prevents.
//!
//! Entries that are counted: posting (send, receive, SRQ receive), polling and arming CQs,
//! modifying, disconnecting, resetting and destroying QPs, creating PDs, CQs, QPs, SRQs
//! and memory registrations, deregistering memory. After `Device::close` those entry points
//! return [`Error::DeviceClosed`], except polls, which still hand out the completions the
//! close flushed (they then only take from the CQ's own queue, without moving any bytes),
//! and destroys, which always run.

mod gate;
/// Atomics for `gate` (the loom test maps this module to loom's).
mod sync {
    pub(super) use std::sync::atomic::{AtomicU64, Ordering};
}

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
pub(crate) use crate::error::{InflightReport, InsideThread};
use crate::sync::lock;

pub(crate) use gate::{Refused, CLOSED, QUIESCED};

/// The entry points that are counted (their names are what reports show).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub(crate) enum Entry {
    PostSend = 1,
    PostRecv,
    PostSrqRecv,
    Poll,
    PollOne,
    ReqNotify,
    ModifyToError,
    Disconnect,
    Reset,
    DestroyQp,
    CreateQp,
    CreateCq,
    AllocPd,
    RegMr,
    DeregMr,
    CreateSrq,
    Service,
    SetRnrWait,
}

const ENTRY_NAMES: [&str; 18] = [
    "QueuePair::post_send",
    "QueuePair::post_recv",
    "SharedReceiveQueue::post_recv",
    "CompletionQueue::poll",
    "CompletionQueue::poll_one",
    "CompletionQueue::req_notify",
    "QueuePair::modify_to_error",
    "QueuePair::disconnect",
    "QueuePair::reset",
    "QueuePair::drop (destroy)",
    "ProtectionDomain::create_qp",
    "Device::create_cq",
    "Device::alloc_pd",
    "ProtectionDomain::reg_mr",
    "MemoryRegion::drop (deregister)",
    "ProtectionDomain::create_srq",
    "QueuePair::service",
    "QueuePair::set_rnr_wait",
];

impl Entry {
    pub(crate) fn name(self) -> &'static str {
        entry_name(self as u16).unwrap_or("?")
    }
}

fn entry_name(code: u16) -> Option<&'static str> {
    ENTRY_NAMES.get(usize::from(code).checked_sub(1)?).copied()
}

/// A device's gate, on a cache line of its own (every thread of the device writes it), with
/// the process-unique number the thread slots name the device by.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct DeviceGate {
    gate: gate::Gate,
    number: u32,
    /// `number << 16`: what the slots hold besides the entry point.
    tag: u64,
}

impl DeviceGate {
    pub(crate) fn new() -> Self {
        static NUMBERS: AtomicU32 = AtomicU32::new(0);
        // Wrapping after 2^32 opens only confuses the names in a report, never the count.
        let number = NUMBERS.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        Self {
            gate: gate::Gate::new(),
            number,
            tag: u64::from(number) << 16,
        }
    }

    /// The calling thread enters `entry`: counted until the guard drops. Refused once the
    /// device is closed or while it is quiesced ([`refused`] makes the error the entry point
    /// returns). Inlined into every entry point: the error is a word, the rest is cold.
    #[inline(always)]
    pub(crate) fn enter(&self, entry: Entry) -> Result<Inflight<'_>, Refused> {
        self.gate.enter()?;
        let slot = match SLOT.with(Cell::get) {
            Some(s) => s,
            None => register(),
        };
        // Only this thread writes its slot: a load and a store, no read-modify-write.
        let prev = slot.now.load(Ordering::Relaxed);
        slot.now.store(self.tag | entry as u64, Ordering::Relaxed);
        Ok(Inflight {
            gate: &self.gate,
            slot,
            prev,
        })
    }

    /// Sets `flag` ([`CLOSED`], [`QUIESCED`]); the flags set before.
    pub(crate) fn shut(&self, flag: u64) -> u64 {
        self.gate.shut(flag)
    }

    /// Clears `flag`.
    pub(crate) fn open(&self, flag: u64) {
        self.gate.open(flag);
    }

    /// Waits until no thread is inside, at most `bound` (then the report of who is).
    /// Sleeps in steps growing from 10 us to 1 ms: the leaving threads signal nothing.
    pub(crate) fn wait_empty(&self, bound: Duration, device: &str) -> Result<(), InflightReport> {
        let start = Instant::now();
        let mut step = Duration::from_micros(10);
        loop {
            if self.gate.inside() == 0 {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= bound {
                return Err(self.report(device, waited));
            }
            std::thread::sleep(step.min(bound.saturating_sub(waited)));
            step = step.saturating_mul(2).min(Duration::from_millis(1));
        }
    }

    /// Who is inside now.
    fn report(&self, device: &str, waited: Duration) -> InflightReport {
        let inside = self.gate.inside();
        let mut threads = Vec::new();
        for slot in lock(&POOL).iter() {
            let now = slot.now.load(Ordering::Relaxed);
            if slot.in_use.load(Ordering::Acquire) && now >> 16 == u64::from(self.number) {
                let (name, tid) = lock(&slot.who).clone();
                threads.push(InsideThread {
                    thread: name,
                    tid,
                    entry: entry_name((now & 0xffff) as u16).unwrap_or("?"),
                });
            }
        }
        InflightReport {
            device: device.to_string(),
            waited,
            inside,
            threads,
        }
    }

    /// The entry point the calling thread is inside of, on any device (for context
    /// checks): `None` outside every entry point.
    pub(crate) fn current_entry() -> Option<&'static str> {
        let now = SLOT.with(Cell::get)?.now.load(Ordering::Relaxed);
        if now == 0 {
            return None;
        }
        entry_name((now & 0xffff) as u16)
    }
}

/// The error an entry point returns when the gate refused it.
#[cold]
pub(crate) fn refused(r: Refused) -> Error {
    if r.closed() {
        Error::DeviceClosed
    } else {
        Error::DeviceQuiesced
    }
}

/// A thread inside an entry point (see [`DeviceGate::enter`]); leaves when dropped.
#[derive(Debug)]
#[must_use = "the thread leaves the entry point when this is dropped"]
pub(crate) struct Inflight<'a> {
    gate: &'a gate::Gate,
    slot: &'static ThreadSlot,
    prev: u64,
}

impl Drop for Inflight<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        self.slot.now.store(self.prev, Ordering::Relaxed);
        self.gate.leave();
    }
}

/// Where a thread says which entry point it is inside.
#[derive(Debug)]
struct ThreadSlot {
    /// `(device gate number << 16) | entry`, 0 outside every entry point.
    now: AtomicU64,
    /// Taken by a live thread.
    in_use: AtomicBool,
    /// The thread's name and kernel id (written when the slot is taken).
    who: Mutex<(String, u32)>,
}

/// Every slot ever made (leaked on purpose and reused: at most one per thread alive at the
/// same time).
static POOL: Mutex<Vec<&'static ThreadSlot>> = Mutex::new(Vec::new());

/// The slot of threads that enter while their thread-local storage is torn down (shared by
/// them, outside the pool: reports do not read it, so they are counted but not named). A
/// slot always exists, so the entry path has no branch for it.
static NO_SLOT: ThreadSlot = ThreadSlot {
    now: AtomicU64::new(0),
    in_use: AtomicBool::new(true),
    who: Mutex::new((String::new(), 0)),
};

thread_local! {
    /// The calling thread's slot (no destructor: readable in every thread-local destructor).
    static SLOT: Cell<Option<&'static ThreadSlot>> = const { Cell::new(None) };
    /// Gives the slot back when the thread exits.
    static OWNER: RefCell<Option<SlotOwner>> = const { RefCell::new(None) };
}

#[derive(Debug)]
struct SlotOwner(&'static ThreadSlot);

impl Drop for SlotOwner {
    fn drop(&mut self) {
        let _ = SLOT.try_with(|s| s.set(None));
        self.0.now.store(0, Ordering::Relaxed);
        self.0.in_use.store(false, Ordering::Release);
    }
}

/// The calling thread's first entry: takes a slot from the pool ([`NO_SLOT`] while the
/// thread's storage is being torn down).
#[cold]
#[inline(never)]
fn register() -> &'static ThreadSlot {
    OWNER
        .try_with(|owner| {
            let mut owner = owner.try_borrow_mut().ok()?;
            if let Some(o) = owner.as_ref() {
                return Some(o.0);
            }
            let slot = take_slot();
            *owner = Some(SlotOwner(slot));
            SLOT.with(|s| s.set(Some(slot)));
            Some(slot)
        })
        .ok()
        .flatten()
        .unwrap_or(&NO_SLOT)
}

fn take_slot() -> &'static ThreadSlot {
    let who = (softwarp_ras::sys::thread_name(), softwarp_ras::sys::tid());
    let mut pool = lock(&POOL);
    let free = pool.iter().copied().find(|s| {
        s.in_use
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    });
    let slot = free.unwrap_or_else(|| {
        let s: &'static ThreadSlot = Box::leak(Box::new(ThreadSlot {
            now: AtomicU64::new(0),
            in_use: AtomicBool::new(true),
            who: Mutex::new((String::new(), 0)),
        }));
        pool.push(s);
        s
    });
    *lock(&slot.who) = who;
    slot
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_has_a_name() {
        for code in 1..=ENTRY_NAMES.len() as u16 {
            assert!(entry_name(code).is_some());
        }
        assert_eq!(entry_name(0), None);
        assert_eq!(Entry::CreateSrq.name(), "ProtectionDomain::create_srq");
        assert_eq!(Entry::PostSend.name(), "QueuePair::post_send");
    }

    #[test]
    fn a_thread_inside_is_counted_named_and_waited_for() {
        let g = std::sync::Arc::new(DeviceGate::new());
        let (tx, rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let g2 = std::sync::Arc::clone(&g);
        let t = std::thread::Builder::new()
            .name("inside-test".into())
            .spawn(move || {
                let _in = g2.enter(Entry::PostSend).unwrap();
                assert_eq!(DeviceGate::current_entry(), Some("QueuePair::post_send"));
                tx.send(()).unwrap();
                release_rx.recv().unwrap();
            })
            .unwrap();
        rx.recv().unwrap();
        assert_eq!(g.shut(QUIESCED), 0);
        // Refused while quiesced.
        let r = g.enter(Entry::Poll).unwrap_err();
        assert!(matches!(refused(r), Error::DeviceQuiesced));
        let r = g.wait_empty(Duration::from_millis(20), "dev").unwrap_err();
        assert_eq!(r.inside, 1);
        assert_eq!(r.threads.len(), 1, "{r}");
        assert_eq!(r.threads[0].thread, "inside-test");
        assert_eq!(r.threads[0].entry, "QueuePair::post_send");
        assert!(r.to_string().contains("inside-test"), "{r}");
        release_tx.send(()).unwrap();
        t.join().unwrap();
        g.wait_empty(Duration::from_secs(5), "dev").unwrap();
        g.open(QUIESCED);
        drop(g.enter(Entry::Poll).unwrap());
        assert_eq!(DeviceGate::current_entry(), None);
        g.shut(CLOSED);
        assert_eq!(g.gate.flags(), CLOSED);
        assert!(matches!(
            refused(g.enter(Entry::Poll).unwrap_err()),
            Error::DeviceClosed
        ));
    }

    #[test]
    fn nested_entries_restore_the_outer_one() {
        let a = DeviceGate::new();
        let b = DeviceGate::new();
        let outer = a.enter(Entry::Poll).unwrap();
        {
            let _inner = b.enter(Entry::PostRecv).unwrap();
            assert_eq!(DeviceGate::current_entry(), Some("QueuePair::post_recv"));
        }
        assert_eq!(DeviceGate::current_entry(), Some("CompletionQueue::poll"));
        drop(outer);
        assert_eq!(DeviceGate::current_entry(), None);
        assert_eq!(a.gate.inside(), 0);
        assert_eq!(b.gate.inside(), 0);
    }
}
