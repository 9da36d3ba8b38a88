//! A bounded FIFO whose storage grows on demand up to its capacity: an idle queue costs no
//! memory (a connected, idle QP with the default 128-deep queues would otherwise hold about
//! 70 KiB), and a busy one allocates only while it grows to its high-water mark, never per
//! item afterwards. No I/O here.

use std::collections::VecDeque;

/// A FIFO that refuses pushes beyond the capacity given at creation.
#[derive(Debug, Clone)]
pub(crate) struct Ring<T> {
    items: VecDeque<T>,
    cap: usize,
}

impl<T> Ring<T> {
    /// A ring of at most `cap` items (storage is allocated as items arrive).
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            items: VecDeque::new(),
            cap,
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
