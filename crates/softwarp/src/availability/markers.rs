//! Structure markers: eye-catcher words at the beginning and the end of the runtime's
//! long-lived objects (device, QP, CQ, MR), next to the guard words the engine keeps around
//! its rings (`softwarp_engine::RingGuard`).
//!
//! Safe Rust never writes over them. They are there for what the language does not
//! control: foreign code scribbling over objects the C ABI hands out pointers into (a
//! `repr(C)` wrapper of `softwarp-verbs` holds each of these objects), and memory faults.
//! The words are ASCII (`SWQP-BEG` ... `SWQP-END`), so they are also what a person looks
//! for in a core file.
//!
//! Checks: the entry points check the markers of the object they work on (two relaxed
//! loads and compares; `QueuePair::post_send` and `post_recv` also the guard words of the
//! ring they fill, `CompletionQueue::poll` those of the completion ring; the device's words
//! at the device's own entry points, not at the per-message ones) and `Device::close` (and
//! `Device::check_markers`) checks every object of the device and every ring. A damaged word is never used
//! silently: the call returns [`Error::MarkerDamaged`], the damage is recorded
//! ([`softwarp_ras::markers::record`], the `markers` section of every dump) and the device
//! fails as `Device::inject_fatal_error` makes it fail (every QP to Error, work flushed, one
//! `DeviceFatal` event, snapshots, an error-log line, an automatic dump), once per device.
//! Resource details show every marker as found (`softwarp resources`, dumps), and
//! `softwarp decode` flags the damaged ones.
//!
//! Fault injection: the `#[doc(hidden)]` `damage_marker_for_testing` methods of the
//! objects flip a word through this module (no unsafe, no undefined behaviour: the words
//! are atomics), so tests can see the whole path.

use std::sync::atomic::{AtomicU64, Ordering};

use softwarp_engine::RingGuard;
use softwarp_ras::markers::{MarkerDamage, MarkerWord};

use crate::availability::recovery::Contained;
use crate::error::{Error, Result};

/// Kinds of objects with markers, with their begin and end words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Device,
    Qp,
    Cq,
    Mr,
}

impl Kind {
    /// The words (begin, end) of the kind.
    pub(crate) const fn words(self) -> (u64, u64) {
        match self {
            Kind::Device => (
                u64::from_le_bytes(*b"SWDV-BEG"),
                u64::from_le_bytes(*b"SWDV-END"),
            ),
            Kind::Qp => (
                u64::from_le_bytes(*b"SWQP-BEG"),
                u64::from_le_bytes(*b"SWQP-END"),
            ),
            Kind::Cq => (
                u64::from_le_bytes(*b"SWCQ-BEG"),
                u64::from_le_bytes(*b"SWCQ-END"),
            ),
            Kind::Mr => (
                u64::from_le_bytes(*b"SWMR-BEG"),
                u64::from_le_bytes(*b"SWMR-END"),
            ),
        }
    }

    /// The name RAS reports the kind under (as the resource tracker names it).
    pub(crate) const fn name(self) -> &'static str {
        match self {
            Kind::Device => "device",
            Kind::Qp => "qp",
            Kind::Cq => "cq",
            Kind::Mr => "mr",
        }
    }
}

/// One marker word, stored in an atomic so that the fault-injection hook can change it
/// without undefined behaviour (loads are relaxed: a word, not a synchronisation point).
#[derive(Debug)]
pub(crate) struct Word(AtomicU64);

impl Word {
    pub(crate) const fn new(word: u64) -> Self {
        Self(AtomicU64::new(word))
    }

    #[inline]
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    fn flip(&self) {
        self.0.fetch_xor(u64::MAX, Ordering::Relaxed);
    }
}

/// The begin word of an object of kind `K` (put it first in a `repr(C)` structure).
#[derive(Debug)]
pub(crate) struct Begin(Word);

/// The end word (put it last).
#[derive(Debug)]
pub(crate) struct End(Word);

impl Begin {
    pub(crate) const fn new(kind: Kind) -> Self {
        Self(Word::new(kind.words().0))
    }
}

impl End {
    pub(crate) const fn new(kind: Kind) -> Self {
        Self(Word::new(kind.words().1))
    }
}

/// Whether `begin` and `end` hold the words of `kind`: two loads, two compares, one branch
/// for the caller.
#[inline]
pub(crate) fn intact(kind: Kind, begin: &Begin, end: &End) -> bool {
    let (b, e) = kind.words();
    (begin.0.get() ^ b) | (end.0.get() ^ e) == 0
}

/// The object's markers as found, for resource details.
pub(crate) fn words(kind: Kind, begin: &Begin, end: &End) -> Vec<MarkerWord> {
    let (b, e) = kind.words();
    vec![
        MarkerWord::new("begin", b, begin.0.get()),
        MarkerWord::new("end", e, end.0.get()),
    ]
}

/// Ring guard words as marker words (`sq.lo`, `sq.hi` ...).
pub(crate) fn ring_words(guards: &[RingGuard]) -> Vec<MarkerWord> {
    guards
        .iter()
        .flat_map(|g| {
            [
                MarkerWord::new(
                    format!("{}.lo", g.ring),
                    softwarp_engine::RING_GUARD_LO,
                    g.lo,
                ),
                MarkerWord::new(
                    format!("{}.hi", g.ring),
                    softwarp_engine::RING_GUARD_HI,
                    g.hi,
                ),
            ]
        })
        .collect()
}

/// Fault injection: flips the begin (`"begin"`) or end (`"end"`) word.
pub(crate) fn damage(begin: &Begin, end: &End, which: &str) -> Result<()> {
    match which {
        "begin" => begin.0.flip(),
        "end" => end.0.flip(),
        _ => {
            return Err(Error::InvalidArgument(
                "no such marker (begin, end, or a ring guard such as sq.lo, cq.hi)",
            ))
        }
    }
    Ok(())
}

/// Splits a ring guard name (`sq.lo`, `cq.hi`) into the ring and whether it is the high
/// word.
pub(crate) fn ring_guard_name(which: &str) -> Option<(&str, bool)> {
    let (ring, side) = which.rsplit_once('.')?;
    match side {
        "lo" => Some((ring, false)),
        "hi" => Some((ring, true)),
        _ => None,
    }
}

/// A check found damaged words in object `id` of kind `object` (`found`: every word of the object
/// as found, damaged ones among them): records the damage, fails the device (once) and
/// returns the error the entry point gives its caller. Call with no QP or CQ lock held (the
/// device fault takes QP locks).
#[cold]
#[inline(never)]
pub(crate) fn damaged<D: Contained>(
    dev: &D,
    object: &'static str,
    id: u64,
    found: &[MarkerWord],
    check: &'static str,
) -> Error {
    let first = found
        .iter()
        .find(|w| !w.is_intact())
        .cloned()
        .unwrap_or_else(|| MarkerWord::new("?", 0, 0));
    let time_unix_ms = softwarp_ras::clock::unix_ms(std::time::SystemTime::now());
    for w in found.iter().filter(|w| !w.is_intact()) {
        softwarp_ras::markers::record(MarkerDamage {
            device: dev.instance().to_string(),
            object: object.to_string(),
            id,
            marker: w.clone(),
            check: check.to_string(),
            time_unix_ms,
        });
    }
    let text = format!("structure marker damaged: {object} {id} {first} ({check})");
    softwarp_ras::sw_event!(Ras, 1, device = dev.instance(), "{}", text);
    // Fails the device once: a device that failed already records nothing more.
    crate::availability::recovery::contain_in(
        dev,
        crate::availability::recovery::FaultKind::MarkerDamaged { what: text },
        None,
    );
    Error::MarkerDamaged {
        object,
        id,
        marker: first.name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_ascii_and_distinct() {
        let kinds = [Kind::Device, Kind::Qp, Kind::Cq, Kind::Mr];
        let mut all: Vec<u64> = kinds
            .iter()
            .flat_map(|k| [k.words().0, k.words().1])
            .collect();
        for w in &all {
            assert!(w.to_le_bytes().iter().all(u8::is_ascii_graphic));
        }
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 8);
    }

    #[test]
    fn damage_is_seen_and_named() {
        let (b, e) = (Begin::new(Kind::Qp), End::new(Kind::Qp));
        assert!(intact(Kind::Qp, &b, &e));
        assert!(!intact(Kind::Cq, &b, &e));
        damage(&b, &e, "end").unwrap();
        assert!(!intact(Kind::Qp, &b, &e));
        let w = words(Kind::Qp, &b, &e);
        assert!(w[0].is_intact());
        assert!(!w[1].is_intact());
        assert!(damage(&b, &e, "middle").is_err());
        assert_eq!(ring_guard_name("sq.hi"), Some(("sq", true)));
        assert_eq!(ring_guard_name("rx_done.lo"), Some(("rx_done", false)));
        assert_eq!(ring_guard_name("sq"), None);
    }
}
