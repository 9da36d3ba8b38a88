//! The rdma_cm objects the application names by pointer, by address, while they live: ids,
//! event channels and events.
//!
//! Every rdma_cm call looks its pointers up here before it reads through them, so a call on
//! an object already destroyed (or a pointer that was never one) fails with `EINVAL` instead
//! of reading freed memory. rdma-core reads through them (its own structures, freed by the
//! destroy) and crashes or not depending on what the allocator left there; Debian's perftest
//! 4.5 does exactly this after a refused connection: its retry destroys its ids, its channel
//! and the array holding them, then resolves the ids again (a SIGSEGV inside
//! `rdma_resolve_addr` over this library). An address freed and then given to a new object
//! of the same kind names that new object, which answers for its own state: no memory is
//! read that is not an object's. A call racing the destroy of the same object on another
//! thread is the application's error, as with rdma-core.

use std::collections::{BTreeSet, VecDeque};
use std::sync::{Mutex, MutexGuard};

/// The addresses of the live objects of one kind.
pub struct Live(Mutex<BTreeSet<usize>>);

impl Live {
    pub const fn new() -> Self {
        Self(Mutex::new(BTreeSet::new()))
    }

    fn set(&self) -> MutexGuard<'_, BTreeSet<usize>> {
        softwarp::sync::lock(&self.0)
    }

    /// `p` was just handed to the application.
    pub fn add<T>(&self, p: *const T) {
        self.set().insert(p as usize);
    }

    /// True while `p` is live.
    pub fn contains<T>(&self, p: *const T) -> bool {
        !p.is_null() && self.set().contains(&(p as usize))
    }

    /// True when `pred` holds for a live object; `pred` runs under the set's lock, so no
    /// object it is given is destroyed meanwhile (a destroy removes it from the set first).
    pub fn any<T>(&self, pred: impl Fn(*const T) -> bool) -> bool {
        self.set().iter().any(|&a| pred(a as *const T))
    }

    /// `p` is being destroyed: true when it was live (the caller then frees it), false when it
    /// was not (destroyed already, or never one: the caller touches nothing).
    pub fn remove<T>(&self, p: *const T) -> bool {
        self.set().remove(&(p as usize))
    }
}

impl Default for Live {
    fn default() -> Self {
        Self::new()
    }
}

/// `struct rdma_cm_id`s (`rdma_create_id`, `rdma_create_ep`, connection requests).
pub static IDS: Live = Live::new();
/// `struct rdma_event_channel`s of `rdma_create_event_channel` (not the private channels of
/// synchronous ids, which the application does not own).
pub static CHANNELS: Live = Live::new();
/// `struct rdma_cm_event`s handed out and not yet acknowledged (`rdma_get_cm_event`, and the
/// `id->event` of a synchronous id).
pub static EVENTS: Live = Live::new();

/// The addresses of the last [`GONE_KEPT`] objects of one kind the application destroyed (an
/// address handed out again leaves it), for the calls that answer a destroyed object
/// differently from a pointer that never was one.
pub struct Gone(Mutex<VecDeque<usize>>);

/// How many destroyed addresses a [`Gone`] remembers.
pub const GONE_KEPT: usize = 1024;

impl Gone {
    pub const fn new() -> Self {
        Self(Mutex::new(VecDeque::new()))
    }

    fn list(&self) -> MutexGuard<'_, VecDeque<usize>> {
        softwarp::sync::lock(&self.0)
    }

    /// `p` was destroyed.
    pub fn add<T>(&self, p: *const T) {
        let mut l = self.list();
        if l.len() >= GONE_KEPT {
            l.pop_front();
        }
        l.push_back(p as usize);
    }

    /// `p` names a new object.
    pub fn forget<T>(&self, p: *const T) {
        self.list().retain(|&a| a != p as usize);
    }

    /// True when `p` was destroyed (and not handed out again).
    pub fn contains<T>(&self, p: *const T) -> bool {
        self.list().contains(&(p as usize))
    }
}

impl Default for Gone {
    fn default() -> Self {
        Self::new()
    }
}

/// Event channels the application destroyed.
pub static GONE_CHANNELS: Gone = Gone::new();
