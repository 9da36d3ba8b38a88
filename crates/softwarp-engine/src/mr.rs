//! Protection domains, memory registrations and the STag table.
//!
//! An STag is `index << 8 | key`: a 24-bit index into the [`MrTable`] and an 8-bit key that
//! changes (unpredictably) every time an index is reused, so a stale or guessed STag fails
//! validation. Keys of one index come in cycles of 256: each registration (or
//! [`MrTable::rekey`]) of the index draws its key uniformly, from the table's [`KeySource`]
//! (given at construction: the runtime's is the operating system's random generator, tests
//! pass a seeded [`SeededKeys`]), among the keys not yet used in the current cycle, so within a cycle no
//! key repeats and a stale STag of the same index never validates; a new cycle starts once
//! all 256 were used, and its first key is never the previous cycle's last. (The price of
//! "never repeats" with 8 bits: the later keys of a cycle are drawn from fewer values, the
//! last one from one; a peer that saw the 255 keys before it, which takes 255
//! re-registrations of one index it can observe, knows it.) 32 bytes per index hold the
//! cycle. Tagged Offsets are virtual-address based, like siw and verbs: a registration
//! has an `iova` base (by default the buffer's address) and a length, and a TO is valid when
//! `iova <= TO` and `TO + len <= iova + length`.
//!
//! [`MrTable::validate`] performs every check RFC 5040/5041/5042 ask for on a tagged access
//! and says which one failed ([`AccessError`]), so the QP can build the exact Terminate.
//!
//! STag 0 is never handed out: index 0 is reserved. In the iWARP verbs specification STag 0
//! is the privileged "STag0" that names physical memory, and hardware RNICs reject it on the
//! wire; siw uses STag 1 for its zero-length RTR Write for that reason. Index 0 being
//! reserved means no STag below 0x100 (in particular neither 0 nor 1) ever names a
//! registration here, so an RTR's STag cannot alias a real region.
//!
//! Deregistration is immediate: [`MrTable::deregister`] removes the registration at once, so
//! no later access validates (a peer that names the STag gets the Terminate for an invalid
//! STag), even while in-flight work still holds the memory (a posted work request, a Read
//! Response being streamed, an FPDU whose payload is being placed). That work finishes with
//! the reference it took at validation; the index stays *releasing* (not reusable) until the
//! last reference is gone, and is free for a new registration from then on. The caller learns
//! when that happens from the [`Weak`] handle [`MrTable::memory`] gives out
//! (`strong_count() == 0`): only then may memory the application lent to the registration be
//! freed.
//!
//! The table is allocated once with a fixed capacity. No I/O here.

use std::sync::{Arc, Weak};

use thiserror::Error;

use crate::memory::Region;

/// Steering Tag: names a registered memory region on the wire (RFC 5040 section 2.1).
/// `repr(transparent)`: laid out as its `u32` (an [`crate::wr::Sge`] is `ibv_sge`'s layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[repr(transparent)]
pub struct Stag(pub u32);

impl Stag {
    /// The 24-bit table index.
    pub fn index(self) -> u32 {
        self.0 >> 8
    }
    /// The 8-bit key.
    pub fn key(self) -> u8 {
        (self.0 & 0xff) as u8
    }
    /// Builds an STag from index and key (the index is truncated to 24 bits).
    pub fn from_parts(index: u32, key: u8) -> Self {
        Stag(((index & 0x00ff_ffff) << 8) | u32::from(key))
    }
}

/// A protection domain. QPs and memory registrations with different PDs cannot be used
/// together. The runtime allocates the numbers; the engine only compares them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PdId(pub u32);

/// Access rights of a memory registration (a small bit set, after `ibv_access_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// No rights beyond local read (which every registration has).
    pub const NONE: Access = Access(0);
    /// The local QP may write into the region (receive buffers, RDMA Read sinks).
    pub const LOCAL_WRITE: Access = Access(1);
    /// A peer may RDMA Write into the region.
    pub const REMOTE_WRITE: Access = Access(1 << 1);
    /// A peer may RDMA Read from the region.
    pub const REMOTE_READ: Access = Access(1 << 2);
    /// A peer may invalidate the STag with Send with Invalidate.
    pub const REMOTE_INVALIDATE: Access = Access(1 << 3);
    /// A peer may run RFC 7306 atomic operations (FetchAdd, CmpSwap) on the region.
    pub const REMOTE_ATOMIC: Access = Access(1 << 4);

    /// The raw bits.
    pub fn bits(self) -> u32 {
        self.0
    }
    /// True when every right in `other` is also in `self`.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl std::ops::BitOrAssign for Access {
    fn bitor_assign(&mut self, rhs: Access) {
        self.0 |= rhs.0;
    }
}

/// Which validation check of a tagged (or local) access failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum AccessError {
    /// No registration has this STag's index.
    #[error("invalid STag: no registration at this index")]
    InvalidStag,
    /// The index exists but the key differs (stale or guessed STag).
    #[error("invalid STag: key mismatch")]
    KeyMismatch,
    /// The registration was invalidated (locally or by a peer's Send with Invalidate).
    #[error("invalid STag: the registration is invalidated")]
    Invalidated,
    /// The registration belongs to another protection domain than the QP.
    #[error("STag not associated with this stream: PD mismatch")]
    PdMismatch,
    /// The registration does not grant the required access right.
    #[error("access rights violation")]
    AccessRights,
    /// `TO + len` overflows 64 bits.
    #[error("TO wrap")]
    ToWrap,
    /// The range is not inside the registration.
    #[error("base or bounds violation")]
    BaseOrBounds,
}

/// Errors of registration management (local misuse or resource limits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum MrError {
    /// Every index of the table is in use.
    #[error("memory registration table is full")]
    TableFull,
    /// The requested range is not inside the region.
    #[error("registration range {offset}+{len} is outside the region of {region_len} bytes")]
    RangeOutsideRegion {
        /// Offset into the region.
        offset: usize,
        /// Length requested.
        len: usize,
        /// Region length.
        region_len: usize,
    },
    /// `iova + len` overflows.
    #[error("iova {iova:#x} + length {len} overflows")]
    IovaWrap {
        /// The base.
        iova: u64,
        /// The length.
        len: usize,
    },
    /// The STag does not name a current registration.
    #[error("unknown STag {0:#010x}")]
    UnknownStag(u32),
    /// The registration does not allow remote invalidation.
    #[error("STag {0:#010x} may not be invalidated remotely")]
    RemoteInvalidateNotAllowed(u32),
    /// The registration is in another protection domain.
    #[error("STag {0:#010x} belongs to another protection domain")]
    PdMismatch(u32),
    /// The table's [`KeySource`] had no random bits.
    #[error("no entropy for an STag key")]
    Entropy,
}

/// The memory behind one registration, shared with in-flight operations.
///
/// The QP holds an `Arc<MrMemory>` while an operation uses the registration; this keeps the
/// memory alive after a deregistration and keeps the table index from being reused until the
/// operation has finished with it.
#[derive(Debug)]
pub struct MrMemory {
    region: Arc<Region>,
    /// Offset of the registration's first byte inside `region`.
    base: usize,
    /// Length of the registration.
    len: usize,
}

impl MrMemory {
    /// The underlying region.
    pub fn region(&self) -> &Region {
        &self.region
    }
    /// Offset of the registration inside the region.
    pub fn base(&self) -> usize {
        self.base
    }
    /// Length of the registration.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for an empty registration.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A validated range: the memory and the offset (inside the region) where it starts.
#[derive(Debug, Clone)]
pub struct Validated {
    /// The registration's memory.
    pub memory: Arc<MrMemory>,
    /// Offset inside `memory.region()` of the first byte of the validated range.
    pub region_offset: usize,
}

/// A public snapshot of one registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrInfo {
    /// The current STag.
    pub stag: Stag,
    /// Protection domain.
    pub pd: PdId,
    /// Base of the tagged-offset range.
    pub iova: u64,
    /// Length of the registration.
    pub len: usize,
    /// Access rights.
    pub access: Access,
    /// False once invalidated.
    pub valid: bool,
}

#[derive(Debug)]
struct MrEntry {
    key: u8,
    pd: PdId,
    iova: u64,
    access: Access,
    valid: bool,
    memory: Arc<MrMemory>,
}

/// The keys one index has used in its current cycle of 256 (see the module docs).
#[derive(Debug, Default)]
struct KeyCycle {
    /// Bit `k` set: key `k` was used in this cycle.
    used: [u64; 4],
    /// How many bits of `used` are set.
    count: u16,
    /// The key of the last registration (the next cycle's first key avoids it).
    last: Option<u8>,
}

impl KeyCycle {
    fn is_used(&self, key: u8) -> bool {
        let word = self.used.get(usize::from(key >> 6)).copied().unwrap_or(0);
        word & (1u64 << (key & 63)) != 0
    }

    /// Draws the next key with `draw(n)`, a uniform number below `n` (`n` in 1..=256).
    fn next(&mut self, mut draw: impl FnMut(u16) -> Result<u16, MrError>) -> Result<u8, MrError> {
        let mut avoid = None;
        if self.count >= 256 {
            *self = KeyCycle {
                last: self.last,
                ..KeyCycle::default()
            };
            avoid = self.last;
        }
        let candidates = 256 - self.count - u16::from(avoid.is_some());
        let mut pick = draw(candidates)?;
        for key in 0..=u8::MAX {
            if self.is_used(key) || Some(key) == avoid {
                continue;
            }
            if pick == 0 {
                if let Some(word) = self.used.get_mut(usize::from(key >> 6)) {
                    *word |= 1u64 << (key & 63);
                }
                self.count += 1;
                self.last = Some(key);
                return Ok(key);
            }
            pick -= 1;
        }
        // `draw` returned a number at or above `candidates`.
        Err(MrError::Entropy)
    }
}

#[derive(Debug)]
struct Slot {
    /// The keys this index used in its current cycle.
    keys: KeyCycle,
    entry: Option<MrEntry>,
    /// The memory of a deregistered registration that in-flight work may still reference:
    /// the index is reusable once no strong reference is left.
    releasing: Option<Weak<MrMemory>>,
}

impl Slot {
    /// True when a new registration may take this index.
    fn is_free(&self) -> bool {
        self.entry.is_none()
            && self
                .releasing
                .as_ref()
                .is_none_or(|w| w.strong_count() == 0)
    }
}

/// Where an [`MrTable`]'s STag keys come from: 64 random bits per draw. RFC 5042
/// (section 5.1) asks for keys a peer cannot predict, so a table whose STags face a network
/// takes the operating system's generator (the runtime's source); [`SeededKeys`] is for
/// tests and replays. The engine itself never asks the operating system for anything.
/// Closures returning `Option<u64>` are sources too.
pub trait KeySource: Send + Sync {
    /// 64 random bits, or `None` when the source has none (the registration then fails
    /// with [`MrError::Entropy`]).
    fn next_u64(&mut self) -> Option<u64>;
}

impl<F: FnMut() -> Option<u64> + Send + Sync> KeySource for F {
    fn next_u64(&mut self) -> Option<u64> {
        self()
    }
}

/// A reproducible [`KeySource`] (xorshift64*): the same registrations get the same STags in
/// every run. For deterministic tests and replays only: its keys are predictable.
#[derive(Debug, Clone)]
pub struct SeededKeys(u64);

impl SeededKeys {
    /// A source seeded with `seed` (any value, 0 included).
    pub fn new(seed: u64) -> Self {
        SeededKeys(seed | 1)
    }
}

impl KeySource for SeededKeys {
    fn next_u64(&mut self) -> Option<u64> {
        let s = &mut self.0;
        *s ^= *s >> 12;
        *s ^= *s << 25;
        *s ^= *s >> 27;
        Some(s.wrapping_mul(0x2545_f491_4f6c_dd1d))
    }
}

/// The STag table of one device: every memory registration, by index.
pub struct MrTable {
    /// `slots[0]` is index 1 (index 0 is reserved, see the module docs).
    slots: Vec<Slot>,
    /// Round-robin search start, so freed indices are not reused at once.
    next: usize,
    live: usize,
    /// Where the keys come from.
    keys: Box<dyn KeySource>,
}

impl std::fmt::Debug for MrTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MrTable")
            .field("slots", &self.slots)
            .field("next", &self.next)
            .field("live", &self.live)
            .finish_non_exhaustive()
    }
}

/// Largest index an STag can carry (24 bits).
const MAX_INDEX: usize = 0x00ff_ffff;

/// A uniform number below `n` (`n >= 1`) from `keys`: 64 random bits scaled down
/// (Lemire's multiply-shift): the bias is below `n / 2^64`.
fn uniform_below(n: u16, keys: &mut dyn KeySource) -> Result<u16, MrError> {
    let x = keys.next_u64().ok_or(MrError::Entropy)?;
    let scaled = (u128::from(x) * u128::from(n)) >> 64;
    u16::try_from(scaled).map_err(|_| MrError::Entropy)
}

impl MrTable {
    /// Creates a table for at most `capacity` registrations (clamped to the 24-bit index
    /// space minus the reserved index 0), drawing STag keys from `keys`. Allocates once.
    pub fn new(capacity: usize, keys: impl KeySource + 'static) -> Self {
        let capacity = capacity.min(MAX_INDEX);
        let mut slots = Vec::with_capacity(capacity);
        for _ in 0..capacity {
            slots.push(Slot {
                keys: KeyCycle::default(),
                entry: None,
                releasing: None,
            });
        }
        Self {
            slots,
            next: 0,
            live: 0,
            keys: Box::new(keys),
        }
    }

    /// Number of current registrations (deregistered ones still referenced by in-flight work
    /// are not counted: see [`MrTable::releasing`]).
    pub fn len(&self) -> usize {
        self.live
    }

    /// Number of deregistered registrations whose memory in-flight work still references
    /// (their indices are not reusable yet). Walks the table: for statistics, not the data
    /// path.
    pub fn releasing(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.entry.is_none() && !s.is_free())
            .count()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Capacity given at creation.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Registers `len` bytes at `offset` of `region` in `pd` with `access`, with tagged
    /// offsets starting at `iova` (or the address of the first byte when `None`).
    pub fn register(
        &mut self,
        pd: PdId,
        region: Arc<Region>,
        offset: usize,
        len: usize,
        iova: Option<u64>,
        access: Access,
    ) -> Result<Stag, MrError> {
        let region_len = region.len();
        match offset.checked_add(len) {
            Some(end) if end <= region_len => {}
            _ => {
                return Err(MrError::RangeOutsideRegion {
                    offset,
                    len,
                    region_len,
                })
            }
        }
        let iova = iova.unwrap_or_else(|| region.addr().wrapping_add(offset as u64));
        if iova.checked_add(len as u64).is_none() {
            return Err(MrError::IovaWrap { iova, len });
        }
        let n = self.slots.len();
        let pos = (0..n)
            .map(|i| (self.next + i) % n)
            .find(|&i| self.slots.get(i).is_some_and(Slot::is_free))
            .ok_or(MrError::TableFull)?;
        let slot = self.slots.get_mut(pos).ok_or(MrError::TableFull)?;
        let keys = &mut *self.keys;
        let key = slot.keys.next(|n| uniform_below(n, keys))?;
        slot.releasing = None;
        slot.entry = Some(MrEntry {
            key,
            pd,
            iova,
            access,
            valid: true,
            memory: Arc::new(MrMemory {
                region,
                base: offset,
                len,
            }),
        });
        self.next = (pos + 1) % n.max(1);
        self.live += 1;
        Ok(Stag::from_parts(pos as u32 + 1, key))
    }

    fn entry(&self, stag: Stag) -> Result<&MrEntry, AccessError> {
        let idx = stag.index() as usize;
        let entry = idx
            .checked_sub(1)
            .and_then(|i| self.slots.get(i))
            .and_then(|s| s.entry.as_ref())
            .ok_or(AccessError::InvalidStag)?;
        if entry.key != stag.key() {
            return Err(AccessError::KeyMismatch);
        }
        Ok(entry)
    }

    fn entry_mut(&mut self, stag: Stag) -> Result<&mut MrEntry, MrError> {
        let idx = stag.index() as usize;
        let entry = idx
            .checked_sub(1)
            .and_then(|i| self.slots.get_mut(i))
            .and_then(|s| s.entry.as_mut())
            .ok_or(MrError::UnknownStag(stag.0))?;
        if entry.key != stag.key() {
            return Err(MrError::UnknownStag(stag.0));
        }
        Ok(entry)
    }

    /// A handle on the memory of a current registration that outlives its deregistration:
    /// `strong_count()` is the number of holders (the table, while registered, and in-flight
    /// work); once it is 0, nothing references the memory any more and the index is free.
    pub fn memory(&self, stag: Stag) -> Option<Weak<MrMemory>> {
        self.entry(stag).ok().map(|e| Arc::downgrade(&e.memory))
    }

    /// A snapshot of a registration.
    pub fn info(&self, stag: Stag) -> Option<MrInfo> {
        let e = self.entry(stag).ok()?;
        Some(MrInfo {
            stag,
            pd: e.pd,
            iova: e.iova,
            len: e.memory.len,
            access: e.access,
            valid: e.valid,
        })
    }

    /// Validates an access of `len` bytes at tagged offset `to` through `stag` from a QP in
    /// `pd` that needs `required` rights.
    ///
    /// Checks, in this order: the STag names a registration (index, then key), the
    /// registration is valid (not invalidated), the PD matches, the access rights suffice,
    /// `to + len` does not wrap, and `[to, to + len)` lies inside `[iova, iova + length)`.
    /// A zero-length access at the end of the region is inside it.
    pub fn validate(
        &self,
        stag: Stag,
        pd: PdId,
        required: Access,
        to: u64,
        len: u64,
    ) -> Result<Validated, AccessError> {
        let (memory, region_offset) = self.validate_borrowed(stag, pd, required, to, len)?;
        Ok(Validated {
            memory: Arc::clone(memory),
            region_offset,
        })
    }

    /// As [`MrTable::validate`], for an access made while the table is borrowed: the memory
    /// is lent, not shared (no reference count changes), with the offset of the range's first
    /// byte inside its region.
    pub fn validate_borrowed(
        &self,
        stag: Stag,
        pd: PdId,
        required: Access,
        to: u64,
        len: u64,
    ) -> Result<(&Arc<MrMemory>, usize), AccessError> {
        let e = self.entry(stag)?;
        if !e.valid {
            return Err(AccessError::Invalidated);
        }
        if e.pd != pd {
            return Err(AccessError::PdMismatch);
        }
        if !e.access.contains(required) {
            return Err(AccessError::AccessRights);
        }
        let end = to.checked_add(len).ok_or(AccessError::ToWrap)?;
        let reg_end = e.iova.saturating_add(e.memory.len as u64);
        if to < e.iova || end > reg_end {
            return Err(AccessError::BaseOrBounds);
        }
        let off = usize::try_from(to - e.iova).map_err(|_| AccessError::BaseOrBounds)?;
        Ok((&e.memory, e.memory.base + off))
    }

    /// Invalidates a registration from the local side (a Local Invalidate work request or an
    /// application call). Later tagged accesses fail with [`AccessError::Invalidated`].
    pub fn invalidate_local(&mut self, stag: Stag, pd: PdId) -> Result<(), MrError> {
        let e = self.entry_mut(stag)?;
        if e.pd != pd {
            return Err(MrError::PdMismatch(stag.0));
        }
        e.valid = false;
        Ok(())
    }

    /// Invalidates a registration on behalf of a peer's Send with Invalidate. Allowed only
    /// when the registration has [`Access::REMOTE_INVALIDATE`] and is in the QP's PD.
    pub fn invalidate_remote(&mut self, stag: Stag, pd: PdId) -> Result<(), MrError> {
        let e = self.entry_mut(stag)?;
        if e.pd != pd {
            return Err(MrError::PdMismatch(stag.0));
        }
        if !e.access.contains(Access::REMOTE_INVALIDATE) {
            return Err(MrError::RemoteInvalidateNotAllowed(stag.0));
        }
        e.valid = false;
        Ok(())
    }

    /// Makes an invalidated registration valid again under a fresh key (as a fast
    /// registration does); returns the new STag. The old STag no longer validates.
    pub fn rekey(&mut self, stag: Stag) -> Result<Stag, MrError> {
        let idx = stag.index();
        self.entry_mut(stag)?;
        let pos = (idx as usize)
            .checked_sub(1)
            .ok_or(MrError::UnknownStag(stag.0))?;
        let slot = self
            .slots
            .get_mut(pos)
            .ok_or(MrError::UnknownStag(stag.0))?;
        let keys = &mut *self.keys;
        let key = slot.keys.next(|n| uniform_below(n, keys))?;
        let e = slot.entry.as_mut().ok_or(MrError::UnknownStag(stag.0))?;
        e.key = key;
        e.valid = true;
        Ok(Stag::from_parts(idx, key))
    }

    /// Removes a registration at once: from now on the STag validates for nothing (a tagged
    /// access gets [`AccessError::InvalidStag`]), whether or not in-flight work still holds
    /// the memory. Returns how many in-flight references there are; the index becomes free
    /// for a new registration when the last of them is dropped.
    pub fn deregister(&mut self, stag: Stag) -> Result<usize, MrError> {
        self.entry_mut(stag)?;
        let pos = (stag.index() as usize)
            .checked_sub(1)
            .ok_or(MrError::UnknownStag(stag.0))?;
        let slot = self
            .slots
            .get_mut(pos)
            .ok_or(MrError::UnknownStag(stag.0))?;
        let entry = slot.entry.take().ok_or(MrError::UnknownStag(stag.0))?;
        let users = Arc::strong_count(&entry.memory) - 1;
        slot.releasing = (users > 0).then(|| Arc::downgrade(&entry.memory));
        self.live -= 1;
        Ok(users)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table_with(len: usize, access: Access) -> (MrTable, Stag, Arc<Region>) {
        let mut t = MrTable::new(4, SeededKeys::new(4));
        let r = Arc::new(Region::new_zeroed(len).unwrap());
        let s = t
            .register(PdId(1), r.clone(), 0, len, Some(0x1000), access)
            .unwrap();
        (t, s, r)
    }

    #[test]
    fn stag_is_never_zero_or_one() {
        let mut t = MrTable::new(300, SeededKeys::new(300));
        let r = Arc::new(Region::new_zeroed(8).unwrap());
        for _ in 0..300 {
            let s = t
                .register(PdId(1), r.clone(), 0, 8, None, Access::NONE)
                .unwrap();
            assert!(s.index() >= 1 && s.0 > 1);
        }
        assert_eq!(
            t.register(PdId(1), r, 0, 8, None, Access::NONE),
            Err(MrError::TableFull)
        );
    }

    #[test]
    fn validate_names_each_failed_check() {
        let (mut t, s, _r) = table_with(100, Access::REMOTE_WRITE);
        let ok = t
            .validate(s, PdId(1), Access::REMOTE_WRITE, 0x1000, 100)
            .unwrap();
        assert_eq!(ok.region_offset, 0);
        let mid = t
            .validate(s, PdId(1), Access::REMOTE_WRITE, 0x1010, 4)
            .unwrap();
        assert_eq!(mid.region_offset, 0x10);
        let v = |t: &MrTable, stag, pd, acc, to, len| t.validate(stag, pd, acc, to, len).err();
        assert_eq!(
            v(
                &t,
                Stag::from_parts(3, s.key()),
                PdId(1),
                Access::NONE,
                0x1000,
                1
            ),
            Some(AccessError::InvalidStag)
        );
        assert_eq!(
            v(
                &t,
                Stag::from_parts(s.index(), s.key() ^ 1),
                PdId(1),
                Access::NONE,
                0x1000,
                1
            ),
            Some(AccessError::KeyMismatch)
        );
        assert_eq!(
            v(&t, s, PdId(2), Access::NONE, 0x1000, 1),
            Some(AccessError::PdMismatch)
        );
        assert_eq!(
            v(&t, s, PdId(1), Access::REMOTE_READ, 0x1000, 1),
            Some(AccessError::AccessRights)
        );
        assert_eq!(
            v(&t, s, PdId(1), Access::REMOTE_WRITE, 0xfff, 1),
            Some(AccessError::BaseOrBounds)
        );
        assert_eq!(
            v(&t, s, PdId(1), Access::REMOTE_WRITE, 0x1000, 101),
            Some(AccessError::BaseOrBounds)
        );
        assert_eq!(
            v(&t, s, PdId(1), Access::REMOTE_WRITE, u64::MAX, 2),
            Some(AccessError::ToWrap)
        );
        assert!(t
            .validate(s, PdId(1), Access::REMOTE_WRITE, 0x1064, 0)
            .is_ok());
        t.invalidate_local(s, PdId(1)).unwrap();
        assert_eq!(
            v(&t, s, PdId(1), Access::REMOTE_WRITE, 0x1000, 1),
            Some(AccessError::Invalidated)
        );
        let s2 = t.rekey(s).unwrap();
        assert_ne!(s2, s);
        assert!(t
            .validate(s2, PdId(1), Access::REMOTE_WRITE, 0x1000, 1)
            .is_ok());
        assert_eq!(
            v(&t, s, PdId(1), Access::REMOTE_WRITE, 0x1000, 1),
            Some(AccessError::KeyMismatch)
        );
    }

    #[test]
    fn reuse_of_an_index_changes_the_key() {
        let mut t = MrTable::new(1, SeededKeys::new(1));
        let r = Arc::new(Region::new_zeroed(8).unwrap());
        let mut prev = t
            .register(PdId(1), r.clone(), 0, 8, None, Access::NONE)
            .unwrap();
        for _ in 0..50 {
            t.deregister(prev).unwrap();
            let s = t
                .register(PdId(1), r.clone(), 0, 8, None, Access::NONE)
                .unwrap();
            assert_eq!(s.index(), prev.index());
            assert_ne!(s.key(), prev.key());
            assert!(t.info(prev).is_none());
            prev = s;
        }
    }

    #[test]
    fn remote_invalidate_requires_the_right() {
        let (mut t, s, _r) = table_with(8, Access::REMOTE_WRITE);
        assert_eq!(
            t.invalidate_remote(s, PdId(1)),
            Err(MrError::RemoteInvalidateNotAllowed(s.0))
        );
        assert_eq!(
            t.invalidate_remote(s, PdId(9)),
            Err(MrError::PdMismatch(s.0))
        );
        let (mut t, s, _r) = table_with(8, Access::REMOTE_WRITE | Access::REMOTE_INVALIDATE);
        t.invalidate_remote(s, PdId(1)).unwrap();
        assert!(!t.info(s).unwrap().valid);
    }

    #[test]
    fn deregister_invalidates_at_once_and_frees_the_index_after_the_last_user() {
        let mut t = MrTable::new(1, SeededKeys::new(1));
        let r = Arc::new(Region::new_zeroed(8).unwrap());
        let s = t
            .register(PdId(1), r.clone(), 0, 8, Some(0x1000), Access::REMOTE_WRITE)
            .unwrap();
        let held = t
            .validate(s, PdId(1), Access::REMOTE_WRITE, 0x1000, 8)
            .unwrap();
        let memory = t.memory(s).unwrap();
        assert_eq!(
            memory.strong_count(),
            2,
            "the table and the in-flight access"
        );
        assert_eq!(t.deregister(s), Ok(1), "one in-flight user");
        // No new access validates, with any right, while the old one still runs.
        for access in [Access::NONE, Access::REMOTE_WRITE, Access::LOCAL_WRITE] {
            assert_eq!(
                t.validate(s, PdId(1), access, 0x1000, 1).err(),
                Some(AccessError::InvalidStag)
            );
        }
        assert!(t.info(s).is_none());
        assert!(t.memory(s).is_none());
        assert_eq!(
            t.invalidate_local(s, PdId(1)),
            Err(MrError::UnknownStag(s.0))
        );
        assert_eq!(t.rekey(s), Err(MrError::UnknownStag(s.0)));
        assert_eq!(t.deregister(s), Err(MrError::UnknownStag(s.0)));
        assert_eq!((t.len(), t.releasing()), (0, 1));
        // The index is not reused while the in-flight access holds the memory.
        assert_eq!(
            t.register(PdId(1), r.clone(), 0, 8, None, Access::NONE),
            Err(MrError::TableFull)
        );
        assert_eq!(memory.strong_count(), 1);
        drop(held);
        assert_eq!(memory.strong_count(), 0, "nothing references the memory");
        assert_eq!(t.releasing(), 0);
        let s2 = t
            .register(PdId(1), r, 0, 8, Some(0x1000), Access::REMOTE_WRITE)
            .unwrap();
        assert_eq!(s2.index(), s.index());
        assert_ne!(s2.key(), s.key());
        assert_eq!(
            t.validate(s, PdId(1), Access::REMOTE_WRITE, 0x1000, 1)
                .err(),
            Some(AccessError::KeyMismatch)
        );
    }

    #[test]
    fn deregister_without_users_frees_the_index_at_once() {
        let (mut t, s, _r) = table_with(8, Access::LOCAL_WRITE);
        let memory = t.memory(s).unwrap();
        assert_eq!(t.deregister(s), Ok(0));
        assert_eq!(memory.strong_count(), 0);
        assert!(t.is_empty());
        assert_eq!(t.releasing(), 0);
    }

    #[test]
    fn registration_range_must_fit_the_region() {
        let mut t = MrTable::new(2, SeededKeys::new(2));
        let r = Arc::new(Region::new_zeroed(8).unwrap());
        assert!(matches!(
            t.register(PdId(1), r.clone(), 4, 5, None, Access::NONE),
            Err(MrError::RangeOutsideRegion { .. })
        ));
        assert!(matches!(
            t.register(PdId(1), r, 0, 8, Some(u64::MAX - 3), Access::NONE),
            Err(MrError::IovaWrap { .. })
        ));
    }
}
