//! Locks that ignore poisoning (public: Softwarp's other crates, the sockets, the C
//! libraries and the preload library, take their locks through these too): every structure behind Softwarp's locks stays consistent
//! between statements (the engine never panics by design), so a panic on another thread
//! must not wedge the device. Every mutex, read-write lock and condition variable of the
//! crate is taken through these (the order in which they may nest is the table in the
//! crate docs, "Locks").
//!
//! A leaf: nothing of the crate is used here.

use std::sync::{
    Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError,
};
use std::time::Duration;

/// Locks `m`.
#[inline]
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Locks `m` unless another thread holds it (then `None`).
#[inline]
pub fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// Takes `l` for reading.
#[inline]
pub fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

/// Takes `l` for writing.
#[inline]
pub fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|e| e.into_inner())
}

/// Waits on `cv`, giving `g` back locked.
pub fn wait<'a, T>(cv: &Condvar, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(g).unwrap_or_else(|e| e.into_inner())
}

/// Waits on `cv` at most `timeout`, giving `g` back locked.
pub fn wait_timeout<'a, T>(
    cv: &Condvar,
    g: MutexGuard<'a, T>,
    timeout: Duration,
) -> MutexGuard<'a, T> {
    cv.wait_timeout(g, timeout)
        .unwrap_or_else(|e| e.into_inner())
        .0
}
