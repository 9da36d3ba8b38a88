//! [`Deadline`]: the one place where a caller's timeout becomes a point in time.
//!
//! `Instant::now() + timeout` panics when `timeout` is too large for the clock
//! (`Duration::MAX`, the natural way to say "no limit"). Every deadline computed from a
//! duration in `softwarp` and `softwarp-ras` goes through [`Deadline::after`], which uses
//! `checked_add`: a timeout beyond what the clock can represent means no deadline at all.
//! The library crates deny `clippy::arithmetic_side_effects` on `Instant`/`Duration` (the
//! workspace's `clippy.toml` exempts the primitive number types), so the panicking
//! operators cannot come back unnoticed; this module holds the only allowed arithmetic.
//!
//! Pure apart from reading the monotonic clock.

use std::time::{Duration, Instant};

/// A point in time by which something must have happened, or [`Deadline::NEVER`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Deadline(Option<Instant>);

impl Deadline {
    /// No deadline: waits are unbounded, nothing expires.
    pub const NEVER: Deadline = Deadline(None);

    /// `timeout` from now; [`Deadline::NEVER`] when the clock cannot represent that point
    /// (e.g. `Duration::MAX`).
    pub fn after(timeout: Duration) -> Self {
        Self::after_from(Instant::now(), timeout)
    }

    /// `timeout` after `start` (or [`Deadline::NEVER`], as [`Deadline::after`]).
    pub fn after_from(start: Instant, timeout: Duration) -> Self {
        Deadline(start.checked_add(timeout))
    }

    /// `timeout` from now, `None` meaning no limit (the convention of the blocking waits).
    pub fn from_timeout(timeout: Option<Duration>) -> Self {
        timeout.map_or(Self::NEVER, Self::after)
    }

    /// The point in time, `None` for [`Deadline::NEVER`].
    pub fn instant(self) -> Option<Instant> {
        self.0
    }

    /// True for [`Deadline::NEVER`].
    pub fn is_never(self) -> bool {
        self.0.is_none()
    }

    /// Time left from now: `None` for no limit, `Some(Duration::ZERO)` once it passed.
    pub fn remaining(self) -> Option<Duration> {
        self.remaining_at(Instant::now())
    }

    /// Time left from `now` (as [`Deadline::remaining`]).
    pub fn remaining_at(self, now: Instant) -> Option<Duration> {
        self.0.map(|d| d.saturating_duration_since(now))
    }

    /// True once the deadline passed (never for [`Deadline::NEVER`]).
    pub fn expired(self) -> bool {
        self.expired_at(Instant::now())
    }

    /// True if the deadline is at or before `now`.
    pub fn expired_at(self, now: Instant) -> bool {
        self.0.is_some_and(|d| d <= now)
    }

    /// The earlier of two deadlines ([`Deadline::NEVER`] is later than any point in time).
    pub fn min(self, other: Deadline) -> Deadline {
        match (self.0, other.0) {
            (Some(a), Some(b)) => Deadline(Some(a.min(b))),
            (Some(a), None) | (None, Some(a)) => Deadline(Some(a)),
            (None, None) => Deadline::NEVER,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duration_max_means_no_deadline_instead_of_a_panic() {
        let d = Deadline::after(Duration::MAX);
        assert!(d.is_never());
        assert_eq!(d.remaining(), None);
        assert!(!d.expired());
        assert_eq!(Deadline::from_timeout(Some(Duration::MAX)), Deadline::NEVER);
        assert_eq!(Deadline::from_timeout(None), Deadline::NEVER);
    }

    #[test]
    fn an_ordinary_timeout_expires_on_time() {
        let t0 = Instant::now();
        let d = Deadline::after_from(t0, Duration::from_secs(2));
        assert!(!d.expired_at(t0));
        assert_eq!(d.remaining_at(t0), Some(Duration::from_secs(2)));
        let later = t0.checked_add(Duration::from_secs(3)).unwrap();
        assert!(d.expired_at(later));
        assert_eq!(d.remaining_at(later), Some(Duration::ZERO));
        assert!(Deadline::after(Duration::ZERO).expired());
    }

    #[test]
    fn never_is_later_than_any_point_in_time() {
        let soon = Deadline::after(Duration::from_secs(1));
        assert_eq!(soon.min(Deadline::NEVER), soon);
        assert_eq!(Deadline::NEVER.min(soon), soon);
        assert_eq!(Deadline::NEVER.min(Deadline::NEVER), Deadline::NEVER);
        let sooner = Deadline::after(Duration::ZERO);
        assert_eq!(soon.min(sooner), sooner);
    }
}
