//! A bounded FIFO whose storage grows on demand up to its capacity: an idle queue costs no
//! memory (a connected, idle QP with the default 128-deep queues would otherwise hold about
//! 70 KiB), and a busy one allocates only while it grows to its high-water mark, never per
//! item afterwards. No I/O here.
//!
//! Each ring is framed by two guard words, [`RING_GUARD_LO`] before its fields and
//! [`RING_GUARD_HI`] after them (`repr(C)` keeps that order): a write that runs over the
//! ring's header from a neighbouring structure changes one of them. Safe Rust never does;
//! the words are for memory that foreign code can reach (the C ABI hands out pointers into
//! the objects that hold rings) and for hardware faults. The runtime checks them
//! ([`RingGuard`]) at its entry points and at close, and shows them in dumps.

use std::collections::VecDeque;

/// The word before every ring's fields ("RING-LO>" in memory).
pub const RING_GUARD_LO: u64 = u64::from_le_bytes(*b"RING-LO>");
/// The word after every ring's fields ("<RING-HI" in memory).
pub const RING_GUARD_HI: u64 = u64::from_le_bytes(*b"<RING-HI");

/// The guard words of one ring as found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingGuard {
    /// The ring: `sq`, `rq`, `rx_done`, `orq`, `irq`, `events` (a QP's), `cq`, `srq`.
    pub ring: &'static str,
    /// The word before it (must be [`RING_GUARD_LO`]).
    pub lo: u64,
    /// The word after it (must be [`RING_GUARD_HI`]).
    pub hi: u64,
}

impl RingGuard {
    /// Whether both words hold what they must.
    pub fn is_intact(&self) -> bool {
        self.lo == RING_GUARD_LO && self.hi == RING_GUARD_HI
    }
}

/// A FIFO that refuses pushes beyond the capacity given at creation.
#[derive(Debug, Clone)]
#[repr(C)]
pub(crate) struct Ring<T> {
    guard_lo: u64,
    items: VecDeque<T>,
    cap: usize,
    guard_hi: u64,
}

impl<T> Ring<T> {
    /// A ring of at most `cap` items (storage is allocated as items arrive).
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            guard_lo: RING_GUARD_LO,
            items: VecDeque::new(),
            cap,
            guard_hi: RING_GUARD_HI,
        }
    }
    /// Whether both guard words are intact (two loads and compares).
    #[inline]
    pub(crate) fn guards_intact(&self) -> bool {
        (self.guard_lo ^ RING_GUARD_LO) | (self.guard_hi ^ RING_GUARD_HI) == 0
    }
    /// The guard words, named `ring`.
    pub(crate) fn guard(&self, ring: &'static str) -> RingGuard {
        RingGuard {
            ring,
            lo: self.guard_lo,
            hi: self.guard_hi,
        }
    }
    /// Fault injection: flips the bits of the low (`hi == false`) or high guard word.
    pub(crate) fn damage_guard(&mut self, hi: bool) {
        if hi {
            self.guard_hi = !self.guard_hi;
        } else {
            self.guard_lo = !self.guard_lo;
        }
    }
    /// Appends `item`, or gives it back when the ring is full.
    pub(crate) fn push(&mut self, item: T) -> Result<(), T> {
        if self.items.len() >= self.cap {
            return Err(item);
        }
        self.items.push_back(item);
        Ok(())
    }
    pub(crate) fn pop(&mut self) -> Option<T> {
        self.items.pop_front()
    }
    pub(crate) fn front(&self) -> Option<&T> {
        self.items.front()
    }
    pub(crate) fn front_mut(&mut self) -> Option<&mut T> {
        self.items.front_mut()
    }
    /// The newest item (the one the last push appended).
    #[inline]
    pub(crate) fn back_mut(&mut self) -> Option<&mut T> {
        self.items.back_mut()
    }
    pub(crate) fn get(&self, i: usize) -> Option<&T> {
        self.items.get(i)
    }
    pub(crate) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.items.get_mut(i)
    }
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.items.iter()
    }
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.items.iter_mut()
    }
    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }
    pub(crate) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
    pub(crate) fn is_full(&self) -> bool {
        self.items.len() >= self.cap
    }
    pub(crate) fn capacity(&self) -> usize {
        self.cap
    }
    pub(crate) fn clear(&mut self) {
        self.items.clear();
    }
    /// Keeps only the items `keep` accepts, in order.
    pub(crate) fn retain(&mut self, keep: impl FnMut(&T) -> bool) {
        self.items.retain(keep);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_frame_the_ring_and_damage_shows() {
        let mut r: Ring<u8> = Ring::new(4);
        assert!(r.guards_intact());
        assert!(r.guard("sq").is_intact());
        r.damage_guard(true);
        assert!(!r.guards_intact());
        let g = r.guard("sq");
        assert_eq!((g.lo, g.hi), (RING_GUARD_LO, !RING_GUARD_HI));
        r.damage_guard(true);
        r.damage_guard(false);
        assert!(!r.guard("sq").is_intact());
    }

    #[test]
    fn ring_refuses_beyond_capacity_and_keeps_fifo_order() {
        let mut r = Ring::new(2);
        r.push(1).unwrap();
        r.push(2).unwrap();
        assert_eq!(r.push(3), Err(3));
        assert_eq!(r.pop(), Some(1));
        r.push(3).unwrap();
        assert_eq!(r.pop(), Some(2));
        assert_eq!(r.pop(), Some(3));
        assert_eq!(r.pop(), None);
    }
}
