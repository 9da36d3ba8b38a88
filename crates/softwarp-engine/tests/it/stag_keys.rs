//! STag keys, statistically: 100,000 registrations of one index (register, deregister,
//! register again ...) and a mix with `rekey`.
//!
//! - No key repeats within a cycle of 256 (every cycle is a permutation of the 256 keys),
//!   and a cycle's first key is never the previous one's last: a stale STag never
//!   validates for the registration that follows it.
//! - Successive keys are unpredictable: the step `next - previous (mod 256)` is uniform over
//!   its 255 possible values (the process is invariant under any relabeling of the keys, so
//!   an ordered pair of successive keys is uniform over all 256 x 255 pairs; a counter or
//!   any fixed stride fails this), checked by a chi-square bound.
//! - Cycles are independent of each other: two successive cycles agree in as many positions
//!   as two independent random permutations do (about one); a cycle that repeats the same
//!   order fails this.
//!
//! Bounds: the chi-square threshold is the 1 - 1e-12 quantile of the chi-square
//! distribution with 254 degrees of freedom (Wilson-Hilferty, z = 7); the matches bound is
//! 7 standard deviations. The seeded table makes the run deterministic (it cannot flake);
//! the same bounds on the operating system's generator fail by chance with a probability
//! of about 1e-12 per run.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use softwarp_engine::memory::Region;
use softwarp_engine::mr::{Access, MrTable, PdId, SeededKeys, Stag};

/// The operating system's generator, as the runtime gives the table.
fn os_keys() -> Option<u64> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).ok()?;
    Some(u64::from_le_bytes(b))
}

const CYCLE: usize = 256;
const REGISTRATIONS: usize = 100_000;
const Z: f64 = 7.0;

/// Keys of `n` successive registrations of the single index of `table`.
fn keys(table: &mut MrTable, n: usize, with_rekey: bool) -> Vec<u8> {
    let region = Arc::new(Region::new_zeroed(64).unwrap());
    let mut out = Vec::with_capacity(n);
    let mut stag: Option<Stag> = None;
    while out.len() < n {
        let s = match stag {
            Some(s) if with_rekey && out.len() % 3 == 1 => {
                table.invalidate_local(s, PdId(1)).unwrap();
                table.rekey(s).unwrap()
            }
            Some(s) => {
                assert_eq!(table.deregister(s).unwrap(), 0);
                table
                    .register(PdId(1), region.clone(), 0, 64, None, Access::REMOTE_WRITE)
                    .unwrap()
            }
            None => table
                .register(PdId(1), region.clone(), 0, 64, None, Access::REMOTE_WRITE)
                .unwrap(),
        };
        assert_eq!(s.index(), 1, "one index only");
        if let Some(old) = stag {
            assert!(
                table.info(old).is_none(),
                "the stale STag {old:?} still names it"
            );
        }
        out.push(s.key());
        stag = Some(s);
    }
    out
}

/// Upper `z`-sigma quantile of chi-square with `k` degrees of freedom (Wilson-Hilferty).
fn chi_square_bound(k: f64, z: f64) -> f64 {
    let a = 2.0 / (9.0 * k);
    k * (1.0 - a + z * a.sqrt()).powi(3)
}

fn check_cycles(keys: &[u8]) {
    for (c, cycle) in keys.chunks(CYCLE).enumerate() {
        let mut seen = [false; CYCLE];
        for (i, k) in cycle.iter().enumerate() {
            assert!(
                !seen[usize::from(*k)],
                "cycle {c}: key {k} repeats at position {i}"
            );
            seen[usize::from(*k)] = true;
        }
    }
    for b in (CYCLE..keys.len()).step_by(CYCLE) {
        assert_ne!(keys[b], keys[b - 1], "cycle boundary at {b} repeats a key");
    }
}

/// Chi-square of the steps between successive keys against the uniform 1..=255.
fn step_chi_square(keys: &[u8]) -> (f64, f64) {
    let mut counts = [0u64; CYCLE];
    for w in keys.windows(2) {
        counts[usize::from(w[1].wrapping_sub(w[0]))] += 1;
    }
    assert_eq!(counts[0], 0, "a key followed itself");
    let n = (keys.len() - 1) as f64;
    let expected = n / 255.0;
    let chi: f64 = counts[1..]
        .iter()
        .map(|&c| (c as f64 - expected).powi(2) / expected)
        .sum();
    (chi, chi_square_bound(254.0, Z))
}

/// Positions where successive full cycles agree, and how many pairs were compared.
fn cycle_matches(keys: &[u8]) -> (usize, usize) {
    let cycles: Vec<&[u8]> = keys.chunks_exact(CYCLE).collect();
    let matches = cycles
        .windows(2)
        .map(|p| p[0].iter().zip(p[1]).filter(|(a, b)| a == b).count())
        .sum();
    (matches, cycles.len() - 1)
}

fn check_all(keys: &[u8]) {
    check_cycles(keys);
    let (chi, bound) = step_chi_square(keys);
    assert!(
        chi < bound,
        "steps are not uniform: chi-square {chi:.1} >= {bound:.1}"
    );
    // Matches per pair of independent permutations: mean 1, variance 1 (the number of fixed
    // points of a random permutation), so `pairs` of them: mean and variance `pairs`.
    let (matches, pairs) = cycle_matches(keys);
    let sd = (pairs as f64).sqrt();
    assert!(
        (matches as f64 - pairs as f64).abs() < Z * sd,
        "successive cycles agree in {matches} positions over {pairs} pairs"
    );
    eprintln!(
        "{} keys: chi-square {chi:.1} (bound {bound:.1}), {matches} matches in {pairs} cycle pairs",
        keys.len()
    );
}

#[test]
fn seeded_keys_never_repeat_within_a_cycle_and_steps_are_uniform() {
    let mut table = MrTable::new(1, SeededKeys::new(0x5eed_0017));
    check_all(&keys(&mut table, REGISTRATIONS, false));
    let mut table = MrTable::new(1, SeededKeys::new(0x5eed_0018));
    check_all(&keys(&mut table, REGISTRATIONS / 4, true));
}

#[test]
fn os_random_keys_never_repeat_within_a_cycle_and_steps_are_uniform() {
    let mut table = MrTable::new(1, os_keys);
    check_all(&keys(&mut table, REGISTRATIONS, false));
    let mut table = MrTable::new(1, os_keys);
    check_all(&keys(&mut table, REGISTRATIONS / 4, true));
}

#[test]
fn the_checks_catch_predictable_keys() {
    // A counter: no repeat within a cycle, but every step is 1.
    let counter: Vec<u8> = (0..REGISTRATIONS).map(|i| (i % 256) as u8).collect();
    check_cycles(&counter[..CYCLE]);
    let (chi, bound) = step_chi_square(&counter);
    assert!(chi > bound);
    // One random order repeated: steps look uniform, successive cycles agree everywhere.
    let mut table = MrTable::new(1, SeededKeys::new(7));
    let first = keys(&mut table, CYCLE, false);
    let repeated: Vec<u8> = first.iter().copied().cycle().take(100 * CYCLE).collect();
    let (matches, pairs) = cycle_matches(&repeated);
    assert_eq!(matches, pairs * CYCLE);
}
