//! What a peer may not do on an iWARP stream ([`PeerViolation`]), the bounds of the queues a
//! peer fills, and the process-wide count of violations (exported with the RAS statistics as
//! `softwarp_sockets_peer_violations_total`, one series per kind).
//!
//! A stream checks every message against the state it created (the credits it gave, the
//! windows it exposed, its view of the peer's stream); the first violation aborts the
//! stream: later calls return `io::ErrorKind::ConnectionAborted` with the violation inside
//! (`ECONNABORTED` through the preload library), the QP is terminated
//! (`QueuePair::fail_peer_violation`: a Terminate, a snapshot, a `peer_violation` line in the
//! error log) and the count of its kind goes up.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use softwarp_ras::stats::{StatsBuilder, StatsSource};

/// Most WROTE notices a stream keeps for [`crate::IwarpStream::recv_write_notice`]: one
/// more from the peer aborts the stream ([`PeerViolation::TooManyNotices`]).
pub const MAX_NOTICES_UNREAD: usize = 1024;

/// Most WROTE notices of this end waiting for a credit:
/// [`crate::IwarpStream::write_remote_notify`] waits (within its timeout) while this many
/// are queued.
pub const MAX_NOTICES_UNSENT: usize = 64;

/// A message of the peer that the stream protocol forbids, or one more than a bound allows.
/// The stream is aborted at the first one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PeerViolation {
    /// A message that does not decode (unknown type, a control message of the wrong length,
    /// a window past the end of the offset space).
    #[error("the peer sent a malformed message: {0}")]
    Malformed(&'static str),
    /// A grant that returns more receive slots than this end's messages had filled.
    #[error(
        "the peer granted {grant} credits while only {outstanding} of its receive slots were \
         filled by this end"
    )]
    Overgrant {
        /// Credits the message returned.
        grant: u32,
        /// Slots of the peer that this end's messages filled and no grant returned yet.
        outstanding: u32,
    },
    /// A GRANT message that returns no slot.
    #[error("the peer sent a GRANT that returns no receive slot")]
    EmptyGrant,
    /// A DATA message without bytes.
    #[error("the peer sent a DATA message without bytes")]
    EmptyData,
    /// DATA after the peer's EOF.
    #[error("the peer sent DATA after its EOF")]
    DataAfterEof,
    /// A second EOF.
    #[error("the peer sent a second EOF")]
    SecondEof,
    /// A WINDOW of no bytes.
    #[error("the peer advertised an empty window")]
    EmptyWindow,
    /// More windows than an end may expose.
    #[error("the peer advertised more than {max} windows", max = crate::conn::MAX_WINDOWS)]
    TooManyWindows,
    /// A WROTE notice while this end exposed no window.
    #[error(
        "the peer sent a WROTE notice ({len} bytes at {offset}) while this end exposes no window"
    )]
    WroteWithoutWindow {
        /// The notice's offset.
        offset: u64,
        /// Its length.
        len: u64,
    },
    /// A WROTE notice for bytes outside every window this end exposed.
    #[error(
        "the peer sent a WROTE notice ({len} bytes at {offset}) outside every window this end \
         exposed"
    )]
    WroteOutsideWindow {
        /// The notice's offset.
        offset: u64,
        /// Its length.
        len: u64,
    },
    /// One WROTE notice more than [`MAX_NOTICES_UNREAD`] unread.
    #[error(
        "the peer sent more than {MAX_NOTICES_UNREAD} WROTE notices that the program did not take \
         (recv_write_notice)"
    )]
    TooManyNotices,
}

/// Names of the kinds, in the order of [`PeerViolation::index`] (the `violation` label).
const NAMES: [&str; 11] = [
    "malformed",
    "overgrant",
    "empty_grant",
    "empty_data",
    "data_after_eof",
    "second_eof",
    "empty_window",
    "too_many_windows",
    "wrote_without_window",
    "wrote_outside_window",
    "too_many_notices",
];

impl PeerViolation {
    fn index(&self) -> usize {
        match self {
            PeerViolation::Malformed(_) => 0,
            PeerViolation::Overgrant { .. } => 1,
            PeerViolation::EmptyGrant => 2,
            PeerViolation::EmptyData => 3,
            PeerViolation::DataAfterEof => 4,
            PeerViolation::SecondEof => 5,
            PeerViolation::EmptyWindow => 6,
            PeerViolation::TooManyWindows => 7,
            PeerViolation::WroteWithoutWindow { .. } => 8,
            PeerViolation::WroteOutsideWindow { .. } => 9,
            PeerViolation::TooManyNotices => 10,
        }
    }

    /// The kind's name: the `violation` label of `softwarp_sockets_peer_violations_total`.
    pub fn name(&self) -> &'static str {
        NAMES.get(self.index()).copied().unwrap_or("?")
    }
}

/// The process-wide counts, one per kind.
#[derive(Debug, Default)]
struct Counts([AtomicU64; NAMES.len()]);

impl StatsSource for Counts {
    fn collect(&self, out: &mut StatsBuilder) {
        for (name, n) in NAMES.iter().zip(&self.0) {
            out.counter(
                "softwarp_sockets_peer_violations_total",
                "iWARP streams aborted because the peer broke the stream protocol or a queue's \
                 bound, per kind.",
                &[("violation", name)],
                n.load(Ordering::Relaxed),
            );
        }
    }
}

/// The counts, registered as a statistics source at first use.
fn counts() -> &'static Arc<Counts> {
    static COUNTS: OnceLock<Arc<Counts>> = OnceLock::new();
    COUNTS.get_or_init(|| {
        let c = Arc::new(Counts::default());
        softwarp_ras::stats::register_source(Arc::downgrade(&c) as Weak<dyn StatsSource>);
        c
    })
}

/// Makes the counts part of the RAS statistics (at zero) before any violation.
pub(crate) fn register() {
    counts();
}

/// Counts one violation.
pub(crate) fn count(v: &PeerViolation) {
    if let Some(n) = counts().0.get(v.index()) {
        n.fetch_add(1, Ordering::Relaxed);
    }
}

/// Streams this process aborted for a peer's violation, all kinds together.
pub fn peer_violations() -> u64 {
    counts()
        .0
        .iter()
        .map(|n| n.load(Ordering::Relaxed))
        .fold(0, u64::wrapping_add)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_own_name() {
        let all = [
            PeerViolation::Malformed("x"),
            PeerViolation::Overgrant {
                grant: 1,
                outstanding: 0,
            },
            PeerViolation::EmptyGrant,
            PeerViolation::EmptyData,
            PeerViolation::DataAfterEof,
            PeerViolation::SecondEof,
            PeerViolation::EmptyWindow,
            PeerViolation::TooManyWindows,
            PeerViolation::WroteWithoutWindow { offset: 0, len: 1 },
            PeerViolation::WroteOutsideWindow { offset: 0, len: 1 },
            PeerViolation::TooManyNotices,
        ];
        let names: std::collections::BTreeSet<_> = all.iter().map(PeerViolation::name).collect();
        assert_eq!(names.len(), NAMES.len());
        assert!(all.iter().all(|v| v.index() < NAMES.len()));
    }
}
