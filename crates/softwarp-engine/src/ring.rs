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
use std::marker::PhantomData;

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

/// Where a ring keeps its items: `VecDeque` for any item, [`Slots`] for `Copy` items on the
/// per-message paths.
pub(crate) trait Store<T>: Default {
    fn len(&self) -> usize;
    /// Appends `item`; the storage never grows past `cap` items (the ring checked that
    /// there is room).
    fn push_back(&mut self, item: T, cap: usize);
    fn pop_front(&mut self) -> Option<T>;
    fn get(&self, i: usize) -> Option<&T>;
    /// The oldest item.
    #[inline(always)]
    fn front(&self) -> Option<&T> {
        self.get(0)
    }
    /// Removes the oldest item without moving it out (false when empty).
    #[inline(always)]
    fn skip_front(&mut self) -> bool {
        self.pop_front().is_some()
    }
    fn get_mut(&mut self, i: usize) -> Option<&mut T>;
    fn clear(&mut self);
    /// Keeps only the items `keep` accepts, in order.
    fn retain(&mut self, keep: impl FnMut(&T) -> bool);
    fn iter<'a>(&'a self) -> impl Iterator<Item = &'a T>
    where
        T: 'a;
    fn iter_mut<'a>(&'a mut self) -> impl Iterator<Item = &'a mut T>
    where
        T: 'a;
}

impl<T> Store<T> for VecDeque<T> {
    #[inline]
    fn len(&self) -> usize {
        VecDeque::len(self)
    }
    #[inline]
    fn push_back(&mut self, item: T, _cap: usize) {
        VecDeque::push_back(self, item);
    }
    #[inline]
    fn pop_front(&mut self) -> Option<T> {
        VecDeque::pop_front(self)
    }
    #[inline]
    fn get(&self, i: usize) -> Option<&T> {
        VecDeque::get(self, i)
    }
    #[inline]
    fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        VecDeque::get_mut(self, i)
    }
    fn clear(&mut self) {
        VecDeque::clear(self);
    }
    fn retain(&mut self, keep: impl FnMut(&T) -> bool) {
        VecDeque::retain(self, keep);
    }
    fn iter<'a>(&'a self) -> impl Iterator<Item = &'a T>
    where
        T: 'a,
    {
        VecDeque::iter(self)
    }
    fn iter_mut<'a>(&'a mut self) -> impl Iterator<Item = &'a mut T>
    where
        T: 'a,
    {
        VecDeque::iter_mut(self)
    }
}

/// A ring buffer of `Copy` items written in their slots: the receive queues (`RecvWr`,
/// 144 bytes) and the completion queues. Hand-written rather than a `VecDeque` because
/// std's `push_back` is sometimes left out of line by LLVM (it was in the C library's
/// `post_recv` after the engine split, issue 33): the work request was then built on the
/// stack and copied in by `memcpy`, +44 instructions per message. Here a push and a pop
/// are a few loads and stores the compiler always inlines; only growth is out of line.
/// Live items are the `len` slots from `head` on, wrapping; other slots hold stale copies.
#[derive(Debug, Clone)]
pub(crate) struct Slots<T> {
    buf: Vec<T>,
    head: usize,
    len: usize,
}

impl<T> Default for Slots<T> {
    fn default() -> Self {
        Self {
            buf: Vec::new(),
            head: 0,
            len: 0,
        }
    }
}

impl<T: Copy> Slots<T> {
    /// The slot of the `i`-th item from the head (`i <= len`, so `head + i < 2 * slots`).
    #[inline(always)]
    fn slot(&self, i: usize) -> usize {
        let at = self.head + i;
        if at >= self.buf.len() {
            at - self.buf.len()
        } else {
            at
        }
    }
    /// A push into full storage: the items are made contiguous from slot 0 and the
    /// storage doubles (one slot first), never past `cap`.
    #[cold]
    #[inline(never)]
    fn grow_push(&mut self, item: T, cap: usize) {
        self.buf.rotate_left(self.head);
        self.head = 0;
        let more = self.len.max(1).min(cap.saturating_sub(self.len).max(1));
        self.buf.reserve_exact(more);
        self.buf.push(item);
        self.len += 1;
    }
}

impl<T: Copy + Default> Slots<T> {
    /// Appends an item that `fill` writes in its slot (which holds a stale item, or the
    /// default when the storage grows): nothing is built on the stack and copied in.
    #[inline(always)]
    fn push_back_with(&mut self, fill: impl FnOnce(&mut T), cap: usize) {
        if self.len == self.buf.len() {
            self.grow_push(T::default(), cap);
        } else {
            self.len += 1;
        }
        let at = self.slot(self.len - 1);
        if let Some(slot) = self.buf.get_mut(at) {
            fill(slot);
        }
    }
}

impl<T: Copy> Slots<T> {
    /// Appends the item `make` returns, written in its slot (the closure runs after the
    /// room is known, so the compiler builds the item there, not on the stack).
    #[inline(always)]
    fn push_back_make(&mut self, make: impl FnOnce() -> T, cap: usize) {
        if self.len == self.buf.len() {
            self.grow_push(make(), cap);
            return;
        }
        let at = self.slot(self.len);
        if let Some(slot) = self.buf.get_mut(at) {
            *slot = make();
            self.len += 1;
        }
    }
}

impl<T: Copy> Store<T> for Slots<T> {
    #[inline(always)]
    fn len(&self) -> usize {
        self.len
    }
    #[inline(always)]
    fn push_back(&mut self, item: T, cap: usize) {
        if self.len == self.buf.len() {
            self.grow_push(item, cap);
            return;
        }
        let at = self.slot(self.len);
        self.buf[at] = item;
        self.len += 1;
    }
    #[inline(always)]
    fn pop_front(&mut self) -> Option<T> {
        if self.len == 0 {
            return None;
        }
        let item = self.buf[self.head];
        self.head = self.slot(1);
        self.len -= 1;
        Some(item)
    }
    #[inline(always)]
    fn get(&self, i: usize) -> Option<&T> {
        if i >= self.len {
            return None;
        }
        self.buf.get(self.slot(i))
    }
    #[inline(always)]
    fn front(&self) -> Option<&T> {
        if self.len == 0 {
            return None;
        }
        self.buf.get(self.head)
    }
    #[inline(always)]
    fn skip_front(&mut self) -> bool {
        if self.len == 0 {
            return false;
        }
        self.head = self.slot(1);
        self.len -= 1;
        true
    }
    #[inline(always)]
    fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        if i >= self.len {
            return None;
        }
        let at = self.slot(i);
        self.buf.get_mut(at)
    }
    fn clear(&mut self) {
        self.head = 0;
        self.len = 0;
    }
    fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        // Made contiguous from slot 0, then the kept items moved down in order.
        self.buf.rotate_left(self.head);
        self.head = 0;
        let mut kept = 0;
        for i in 0..self.len {
            let item = self.buf[i];
            if keep(&item) {
                self.buf[kept] = item;
                kept += 1;
            }
        }
        self.len = kept;
    }
    fn iter<'a>(&'a self) -> impl Iterator<Item = &'a T>
    where
        T: 'a,
    {
        let (wrapped, from_head) = self.buf.split_at(self.head);
        from_head.iter().chain(wrapped).take(self.len)
    }
    fn iter_mut<'a>(&'a mut self) -> impl Iterator<Item = &'a mut T>
    where
        T: 'a,
    {
        let len = self.len;
        let (wrapped, from_head) = self.buf.split_at_mut(self.head);
        from_head.iter_mut().chain(wrapped).take(len)
    }
}

/// A ring of `Copy` items kept in [`Slots`].
pub(crate) type CopyRing<T> = Ring<T, Slots<T>>;

impl<T: Copy> CopyRing<T> {
    /// Appends the item `make` returns, built in its slot (a receive completion on the
    /// small-Send path); false, nothing called, when the ring is full.
    #[inline(always)]
    pub(crate) fn push_make(&mut self, make: impl FnOnce() -> T) -> bool {
        if self.items.len() >= self.cap {
            return false;
        }
        self.items.push_back_make(make, self.cap);
        true
    }
}

impl<T: Copy + Default> CopyRing<T> {
    /// Appends an item that `fill` writes in place (the receive queues: a 144-byte work
    /// request, of which a post writes the id and the elements it has); false, nothing
    /// called, when the ring is full.
    #[inline(always)]
    pub(crate) fn push_with(&mut self, fill: impl FnOnce(&mut T)) -> bool {
        if self.items.len() >= self.cap {
            return false;
        }
        self.items.push_back_with(fill, self.cap);
        true
    }
}

/// A FIFO that refuses pushes beyond the capacity given at creation.
#[derive(Debug, Clone)]
#[repr(C)]
pub(crate) struct Ring<T, S = VecDeque<T>> {
    guard_lo: u64,
    items: S,
    cap: usize,
    guard_hi: u64,
    _item: PhantomData<T>,
}

impl<T, S: Store<T>> Ring<T, S> {
    /// A ring of at most `cap` items (storage is allocated as items arrive).
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            guard_lo: RING_GUARD_LO,
            items: S::default(),
            cap,
            guard_hi: RING_GUARD_HI,
            _item: PhantomData,
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
    #[inline]
    pub(crate) fn push(&mut self, item: T) -> Result<(), T> {
        if self.items.len() >= self.cap {
            return Err(item);
        }
        self.items.push_back(item, self.cap);
        Ok(())
    }
    #[inline]
    pub(crate) fn pop(&mut self) -> Option<T> {
        self.items.pop_front()
    }
    #[inline]
    pub(crate) fn front(&self) -> Option<&T> {
        self.items.front()
    }
    /// Removes the oldest item without moving it out (what a caller that read it with
    /// [`Ring::front`] does); false when the ring is empty.
    #[inline]
    pub(crate) fn skip_front(&mut self) -> bool {
        self.items.skip_front()
    }
    #[inline]
    pub(crate) fn front_mut(&mut self) -> Option<&mut T> {
        self.items.get_mut(0)
    }
    #[inline]
    pub(crate) fn get(&self, i: usize) -> Option<&T> {
        self.items.get(i)
    }
    #[inline]
    pub(crate) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.items.get_mut(i)
    }
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.items.iter()
    }
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.items.iter_mut()
    }
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.items.len() == 0
    }
    #[inline]
    pub(crate) fn is_full(&self) -> bool {
        self.items.len() >= self.cap
    }
    pub(crate) fn capacity(&self) -> usize {
        self.cap
    }
    /// Empties the ring; its storage stays for the items to come.
    pub(crate) fn clear(&mut self) {
        self.items.clear();
    }
    /// Keeps only the items `keep` accepts, in order.
    pub(crate) fn retain(&mut self, keep: impl FnMut(&T) -> bool) {
        self.items.retain(keep);
    }
}

impl<T> Ring<T> {
    /// Storage for one item if the ring has none: `VecDeque`'s first growth takes four, so
    /// a QP that has one WR at a time would otherwise hold four entries. Called once, at
    /// the QP's establishment, not in `push`: a capacity check there cost the C library's
    /// post path 24 instructions per message and the CQ's push 7 (issue 39).
    pub(crate) fn reserve_one(&mut self) {
        if self.items.capacity() == 0 {
            self.items.reserve_exact(1);
        }
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
        let mut r: Ring<i32> = Ring::new(2);
        r.push(1).unwrap();
        r.push(2).unwrap();
        assert_eq!(r.push(3), Err(3));
        assert_eq!(r.pop(), Some(1));
        r.push(3).unwrap();
        assert_eq!(r.pop(), Some(2));
        assert_eq!(r.pop(), Some(3));
        assert_eq!(r.pop(), None);
    }

    #[test]
    fn copy_ring_grows_on_demand_wraps_and_keeps_order_against_a_model() {
        // A deterministic mix of pushes and pops (more pushes than pops), checked item by
        // item against VecDeque, with get, get_mut and iteration while the live items wrap
        // around the end of the storage.
        let mut r: CopyRing<u32> = Ring::new(37);
        let mut model = VecDeque::new();
        let mut x: u32 = 12345;
        for n in 0..5_000u32 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            if x % 5 < 3 {
                let pushed = r.push(n);
                if model.len() < 37 {
                    assert_eq!(pushed, Ok(()));
                    model.push_back(n);
                } else {
                    assert_eq!(pushed, Err(n));
                }
            } else {
                assert_eq!(r.pop(), model.pop_front());
            }
            assert_eq!(r.len(), model.len());
            assert_eq!(r.front(), model.front());
            assert_eq!(r.get(model.len() / 2), model.get(model.len() / 2));
            assert_eq!(r.get(model.len()), None);
            assert!(r.iter().eq(model.iter()));
            if let Some(b) = r.get_mut(model.len().wrapping_sub(1)) {
                *b += 1_000_000;
                *model.back_mut().unwrap() += 1_000_000;
            }
            assert!(
                r.items.buf.capacity() <= 37,
                "storage grew past the capacity"
            );
        }
        r.iter_mut().for_each(|v| *v += 1);
        model.iter_mut().for_each(|v| *v += 1);
        assert!(r.iter().eq(model.iter()));
        assert!(r.skip_front());
        model.pop_front();
        assert!(r.iter().eq(model.iter()));
        r.retain(|v| v % 3 != 0);
        model.retain(|v| v % 3 != 0);
        assert!(r.iter().eq(model.iter()));
        assert_eq!(r.len(), model.len());
        r.clear();
        assert!(!r.skip_front());
        assert!(r.is_empty() && r.iter().next().is_none() && r.pop().is_none());
        r.push(7).unwrap();
        assert_eq!((r.front(), r.len()), (Some(&7), 1));
        // In place: the slot is written by the closure, also when the storage grows.
        let mut w: CopyRing<(u32, u32)> = Ring::new(3);
        for i in 0..3 {
            assert!(w.push_with(|slot| slot.0 = i));
        }
        assert!(!w.push_with(|_| unreachable!("a full ring calls nothing")));
        assert!(!w.push_make(|| unreachable!("a full ring calls nothing")));
        assert_eq!(w.pop(), Some((0, 0)));
        assert!(w.push_with(|slot| slot.1 = 9));
        // The reused slot held (0, 0): only the field written changes.
        assert!(w.iter().eq([(1, 0), (2, 0), (0, 9)].iter()));
        assert_eq!(w.pop(), Some((1, 0)));
        assert!(w.push_make(|| (5, 5)));
        assert!(w.iter().eq([(2, 0), (0, 9), (5, 5)].iter()));
    }

    #[test]
    fn an_idle_copy_ring_holds_no_storage() {
        let r: CopyRing<[u8; 144]> = Ring::new(128);
        assert_eq!(r.items.buf.capacity(), 0);
    }
}
