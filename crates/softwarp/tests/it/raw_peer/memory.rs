//! Watched memory for the raw-peer tests: a target region with a guard region right before
//! it and one right after it, all three registered over one allocation, so that a byte
//! written just outside the target (below its base or past its bound) lands in a guard and
//! is seen. Every region is filled with a pattern and compared with a snapshot.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::ops::Range;

use softwarp::{AccessFlags, MemoryRegion, MrRelease, ProtectionDomain};

use crate::util::pattern;

/// Length of each guard region.
pub const GUARD_LEN: usize = 4096;

/// `target` between the guards `low` and `high`, contiguous in memory.
#[derive(Debug)]
pub struct Guarded {
    /// The `GUARD_LEN` bytes right below the target.
    pub low: MemoryRegion,
    /// The region the test aims at.
    pub target: MemoryRegion,
    /// The `GUARD_LEN` bytes right after the target.
    pub high: MemoryRegion,
    /// Contents of low, target, high when filled.
    before: [Vec<u8>; 3],
}

impl Guarded {
    /// Registers a target of `len` bytes with `access` in `pd`, between two guards, and fills
    /// all three with patterns from `seed`.
    ///
    /// The guards allow every remote access: only the stack's bounds and STag checks, never
    /// the guards' own rights, keep the peer's bytes out of them.
    pub fn new(pd: &ProtectionDomain, len: usize, access: AccessFlags, seed: u64) -> Self {
        let guard_access =
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let base = leak(GUARD_LEN + len + GUARD_LEN);
        let low = register(pd, base, 0, GUARD_LEN, guard_access);
        let target = register(pd, base, GUARD_LEN, len, access);
        let high = register(pd, base, GUARD_LEN + len, GUARD_LEN, guard_access);
        assert_eq!(low.addr() + GUARD_LEN as u64, target.addr());
        assert_eq!(target.addr() + len as u64, high.addr());
        let before = [
            pattern(GUARD_LEN, seed ^ 0x10),
            pattern(len, seed),
            pattern(GUARD_LEN, seed ^ 0x20),
        ];
        for (mr, data) in [&low, &target, &high].into_iter().zip(&before) {
            mr.write_at(0, data).unwrap();
        }
        Self {
            low,
            target,
            high,
            before,
        }
    }

    /// The target's contents before the test.
    pub fn target_before(&self) -> &[u8] {
        &self.before[1]
    }

    /// No byte of the guards or the target changed.
    pub fn assert_unchanged(&self) {
        self.assert_guards_unchanged();
        assert!(
            self.target.to_vec().unwrap() == self.before[1],
            "the target region changed"
        );
    }

    /// No byte of either guard changed.
    pub fn assert_guards_unchanged(&self) {
        assert!(
            self.low.to_vec().unwrap() == self.before[0],
            "the guard region below the target changed"
        );
        assert!(
            self.high.to_vec().unwrap() == self.before[2],
            "the guard region above the target changed"
        );
    }

    /// Only `range` of the target may have changed, and it holds `expected`; the guards are
    /// unchanged.
    pub fn assert_changed_only(&self, range: Range<usize>, expected: &[u8]) {
        self.assert_unchanged_outside(range.clone());
        let now = self.target.to_vec().unwrap();
        assert!(
            now[range.clone()] == *expected,
            "the target's bytes {range:?} are not what the peer sent"
        );
    }

    /// Bytes of the target outside `range` and both guards are unchanged (`range` may or may
    /// not have been written).
    pub fn assert_unchanged_outside(&self, range: Range<usize>) {
        self.assert_guards_unchanged();
        let now = self.target.to_vec().unwrap();
        let before = &self.before[1];
        assert!(
            now[..range.start] == before[..range.start],
            "the target changed below {range:?}"
        );
        assert!(
            now[range.end..] == before[range.end..],
            "the target changed above {range:?}"
        );
    }
}

/// Memory lent to the stack through [`ProtectionDomain::reg_mr_raw`] that outlives the
/// target's registration: `GUARD_LEN` bytes, the target's `len` bytes, `GUARD_LEN` bytes,
/// all seen through `view` (a registration of the whole allocation without remote rights,
/// which stays when the target is deregistered), filled with a pattern.
#[derive(Debug)]
pub struct Lent {
    /// The whole allocation, to read what happened to it.
    pub view: MemoryRegion,
    /// The middle `len` bytes, registered with the test's access rights (until
    /// [`Lent::deregister_target`]).
    target: Option<MemoryRegion>,
    /// Contents of the whole allocation when filled.
    before: Vec<u8>,
}

impl Lent {
    /// Lends `len` bytes with `access` in `pd` (between two guards), filled from `seed`.
    pub fn new(pd: &ProtectionDomain, len: usize, access: AccessFlags, seed: u64) -> Self {
        let total = GUARD_LEN + len + GUARD_LEN;
        let base = leak(total);
        let view = register(pd, base, 0, total, AccessFlags::NONE);
        let target = register(pd, base, GUARD_LEN, len, access);
        let before = pattern(total, seed);
        view.write_at(0, &before).unwrap();
        Self {
            view,
            target: Some(target),
            before,
        }
    }

    /// The target's registration (panics after [`Lent::deregister_target`]).
    pub fn target(&self) -> &MemoryRegion {
        self.target.as_ref().expect("the target is registered")
    }

    /// Deregisters the target ([`MemoryRegion::deregister`]); the memory stays readable
    /// through `view`.
    pub fn deregister_target(&mut self) -> MrRelease {
        self.target.take().expect("registered once").deregister()
    }

    /// The target's bytes `range` (offsets inside the target) as they are now.
    pub fn target_bytes(&self, range: Range<usize>) -> Vec<u8> {
        let mut out = vec![0u8; range.len()];
        self.view
            .read_at(GUARD_LEN + range.start, &mut out)
            .unwrap();
        out
    }

    /// Only the target's bytes `range` changed, and they hold `expected`.
    pub fn assert_changed_only(&self, range: Range<usize>, expected: &[u8]) {
        let now = self.view.to_vec().unwrap();
        let (start, end) = (GUARD_LEN + range.start, GUARD_LEN + range.end);
        assert!(
            now[..start] == self.before[..start],
            "changed below {range:?}"
        );
        assert!(now[end..] == self.before[end..], "changed above {range:?}");
        assert!(
            now[start..end] == *expected,
            "{range:?} is not what the peer sent"
        );
    }
}

/// `len` zeroed bytes that are never freed.
///
/// Leaked on purpose: a registration may outlive its `MemoryRegion` handle while work that
/// uses it drains, and the memory must stay valid for that whole time. The allocation is
/// only ever reached through the registrations (copies in and out), never through a Rust
/// reference.
fn leak(len: usize) -> *mut u8 {
    Box::into_raw(vec![0u8; len].into_boxed_slice()).cast::<u8>()
}

/// Registers `len` bytes at `offset` of the leaked allocation at `base`.
#[allow(unsafe_code)]
fn register(
    pd: &ProtectionDomain,
    base: *mut u8,
    offset: usize,
    len: usize,
    access: AccessFlags,
) -> MemoryRegion {
    let ptr = base.wrapping_add(offset);
    // SAFETY: `base` comes from `leak`, which allocated at least `offset + len` bytes (every
    // caller stays inside the allocation) and never frees them, so `ptr` is non-null and
    // valid for reads and writes of `len` bytes for the rest of the process, longer than the
    // registration and any work request using it. No Rust reference to these bytes exists.
    unsafe { pd.reg_mr_raw(ptr, len, access) }.unwrap()
}
