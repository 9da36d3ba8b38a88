//! Memory shared with the network: [`Region`].
//!
//! A region is a range of bytes that the application and the network may both touch at the
//! same time. That is what RDMA is: a peer's RDMA Write lands in memory the application can
//! read whenever it likes. So this module never hands out a `&mut [u8]` (or a `&[u8]`) that
//! could alias a concurrent access: every safe access goes through raw pointers with a bounds
//! check ([`Region::read_at`], [`Region::write_at`], [`Region::fill`]); the runtime gets raw
//! pointers ([`Region::ptr_range`]) or an `unsafe` slice ([`Region::slice`],
//! [`Region::slice_mut`]) for `readv`/`writev`.
//!
//! This is the only module of the crate that contains `unsafe` code. It never does I/O.
//!
//! Contract shared with the application (the same as the verbs contract): while a region is
//! the source of a posted send or of an RDMA Read Response, or the target of a posted receive,
//! an RDMA Read sink or an incoming RDMA Write, the application must not write those bytes;
//! if it does, the bytes transferred (and the CRC computed over them) are unspecified, but no
//! memory outside the region is ever touched.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

use thiserror::Error;

/// Alignment of regions the stack allocates: one page.
pub const PAGE_SIZE: usize = 4096;

/// Serializes the RFC 7306 atomics the engine performs (see [`Region::atomic_update`]).
static ATOMICS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// An access to a region that does not fit inside it, or an allocation that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// `offset + len` is beyond the end of the region (or overflows).
    #[error(
        "region access out of bounds: offset {offset} + length {len} > region length {region_len}"
    )]
    OutOfBounds {
        /// Offset of the access inside the region.
        offset: usize,
        /// Length of the access.
        len: usize,
        /// Length of the region.
        region_len: usize,
    },
    /// The allocator could not provide the memory (or the size is not representable).
    #[error("could not allocate a region of {0} bytes")]
    AllocationFailed(usize),
}

/// Who owns the bytes of a [`Region`].
#[derive(Debug)]
enum Backing {
    /// Allocated by [`Region::new_zeroed`]; freed on drop with this layout.
    Owned(Layout),
    /// Allocated by nobody (zero-length owned region): nothing to free.
    Empty,
    /// Provided by the caller of [`Region::from_raw`]; never freed here.
    Raw,
}

/// A range of memory registered (or registrable) for RDMA.
///
/// Owned regions are page-aligned and zeroed; raw regions wrap memory provided through FFI.
/// All accessors take `&self`: the bytes have interior mutability, as the network writes
/// them while the application holds the region (typically in an `Arc`).
#[derive(Debug)]
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

// SAFETY: a Region is a pointer and a length to memory that is valid for the Region's
// lifetime (owned: until drop; raw: guaranteed by the `from_raw` caller). No method creates
// a long-lived reference to the bytes; every safe access copies through raw pointers after
// a bounds check, so moving the Region to another thread cannot create aliasing references.
unsafe impl Send for Region {}
// SAFETY: all safe methods take `&self` and access the bytes only through raw-pointer copies
// bounded by `len`; concurrent copies from several threads are data races on plain bytes,
// which is the documented RDMA sharing model (see the module docs) and never touch memory
// outside the region.
unsafe impl Sync for Region {}

/// Payloads at least this long go through the carry-less-multiply CRC (below it
/// `softwarp_wire::crc::crc32c_append`'s plain CRC32-instruction loop wins: no set-up cost).
const FOLDING_CRC_MIN: usize = 512;

/// Continues a CRC32c (as `crc32c::crc32c_append`): large payloads use `crc_fast`, which
/// folds with (V)PCLMULQDQ and runs about three times faster here than the `crc32c` crate
/// (41 vs 15 GB/s on the benchmark machine, a 64 KiB buffer). With CRC on, the CRC over
/// sent and placed payload was the largest user-space cost of streaming.
///
/// The short path is inlined into the callers (the small-message paths call it once per
/// FPDU each way) and the folding one is a function of its own, so that its large digest
/// state costs the short path nothing: with SSE 4.2 detected at run time rather than enabled
/// by the build, the whole out of line cost `examples/msgrate` about 6 instructions per call
/// (BENCHMARKS.md, item 24a).
#[inline(always)]
pub(crate) fn crc32c_append(crc: u32, bytes: &[u8]) -> u32 {
    if bytes.len() < FOLDING_CRC_MIN {
        return softwarp_wire::crc::crc32c_append(crc, bytes);
    }
    crc32c_append_folding(crc, bytes)
}

#[inline(never)]
fn crc32c_append_folding(crc: u32, bytes: &[u8]) -> u32 {
    // crc_fast keeps the raw (not yet inverted) register: resume from the inverted value.
    let mut d =
        crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    d.update(bytes);
    d.finalize() as u32
}

impl Region {
    /// Allocates a zeroed, page-aligned region of `len` bytes.
    pub fn new_zeroed(len: usize) -> Result<Self, MemoryError> {
        if len == 0 {
            return Ok(Self {
                ptr: NonNull::dangling(),
                len: 0,
                backing: Backing::Empty,
            });
        }
        let layout = Layout::from_size_align(len, PAGE_SIZE)
            .map_err(|_| MemoryError::AllocationFailed(len))?;
        // SAFETY: `layout` has a non-zero size (len > 0 checked above).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(MemoryError::AllocationFailed(len))?;
        Ok(Self {
            ptr,
            len,
            backing: Backing::Owned(layout),
        })
    }

    /// Wraps memory the caller owns (for FFI registration of application buffers).
    ///
    /// # Safety
    /// `ptr` must be non-null and valid for reads and writes of `len` bytes for as long as
    /// this `Region` (and every clone of an `Arc` holding it) lives, and the memory must not
    /// be freed or unmapped during that time. Other code may read and write the bytes
    /// concurrently (that is RDMA), but must not rely on them being stable while an RDMA
    /// operation on them is in flight.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> Result<Self, MemoryError> {
        let ptr = NonNull::new(ptr).ok_or(MemoryError::AllocationFailed(len))?;
        Ok(Self {
            ptr,
            len,
            backing: Backing::Raw,
        })
    }

    /// Length of the region in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of the first byte, as a number (the default IOVA of a registration).
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as usize as u64
    }

    /// True for regions made by [`Region::from_raw`].
    pub fn is_raw(&self) -> bool {
        matches!(self.backing, Backing::Raw)
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), MemoryError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(MemoryError::OutOfBounds {
                offset,
                len,
                region_len: self.len,
            }),
        }
    }

    /// Raw pointer to `len` bytes at `offset`, after a bounds check. Producing the pointer is
    /// safe; using it is the caller's `unsafe` business (e.g. an iovec for `readv`).
    pub fn ptr_range(&self, offset: usize, len: usize) -> Result<*mut u8, MemoryError> {
        self.check(offset, len)?;
        // `wrapping_add` keeps this free of `unsafe`; the bounds check above makes the result
        // lie within (or one past) the allocation.
        Ok(self.ptr.as_ptr().wrapping_add(offset))
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), MemoryError> {
        self.check(offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: the source range [offset, offset + dst.len()) lies inside the region
        // (checked), which is valid for reads for the Region's lifetime; `dst` is a distinct
        // Rust buffer, so the ranges cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
        Ok(())
    }

    /// Copies `src` into the region starting at `offset`.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), MemoryError> {
        self.check(offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: the destination range lies inside the region (checked), which is valid for
        // writes for the Region's lifetime; `src` is a Rust slice that cannot be a reference
        // into the region (this module never creates one outside the `unsafe` accessors,
        // whose callers promise not to alias), so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len());
        }
        Ok(())
    }

    /// Sets `len` bytes at `offset` to `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<(), MemoryError> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the range lies inside the region (checked) and is valid for writes.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(offset), byte, len) };
        Ok(())
    }

    /// Reads the 64-bit word (host byte order) at `offset`, stores `f(word)` in its place, and
    /// returns the original word, atomically with respect to every other `atomic_update` of
    /// this process (one lock for all regions, so aliasing registrations are covered too).
    /// `f` must not panic. Not atomic with respect to plain CPU accesses by the
    /// application, as with RNICs that do not use PCIe atomics.
    pub(crate) fn atomic_update(
        &self,
        offset: usize,
        f: impl FnOnce(u64) -> u64,
    ) -> Result<u64, MemoryError> {
        self.check(offset, 8)?;
        let _guard = ATOMICS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut word = [0u8; 8];
        self.read_at(offset, &mut word)?;
        let old = u64::from_ne_bytes(word);
        self.write_at(offset, &f(old).to_ne_bytes())?;
        Ok(old)
    }

    /// Continues a CRC32c computation over `len` bytes at `offset` (the engine's on-the-fly
    /// MPA CRC over placed or transmitted payload).
    pub(crate) fn crc32c_append(
        &self,
        crc: u32,
        offset: usize,
        len: usize,
    ) -> Result<u32, MemoryError> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(crc);
        }
        // SAFETY: the range lies inside the region (checked) and is valid for reads. The
        // shared slice lives only for this call. Concurrent writes by the application to
        // bytes that are the source or target of an in-flight operation are excluded by the
        // region contract (module docs); concurrent reads are fine.
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) };
        Ok(crc32c_append(crc, bytes))
    }

    /// A shared slice of `len` bytes at `offset`, for `writev`-style gathering.
    ///
    /// # Safety
    /// While the returned slice lives, nothing may write those bytes (neither the
    /// application, nor an incoming RDMA Write or receive placed by the engine).
    pub unsafe fn slice(&self, offset: usize, len: usize) -> Result<&[u8], MemoryError> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(&[]);
        }
        // SAFETY: in bounds (checked) and valid for reads; the caller promises that no write
        // happens while the slice lives.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) })
    }

    /// A mutable slice of `len` bytes at `offset`, for `readv`-style placement.
    ///
    /// # Safety
    /// While the returned slice lives, nothing else may read or write those bytes through any
    /// path (another slice, [`Region::read_at`], the application, the engine).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: usize, len: usize) -> Result<&mut [u8], MemoryError> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: in bounds (checked) and valid for writes; the caller promises exclusivity
        // for the slice's lifetime.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Backing::Owned(layout) = self.backing {
            // SAFETY: `ptr` was returned by `alloc_zeroed(layout)` in `new_zeroed` and is
            // freed exactly once, here.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_folding_crc_continues_exactly_like_crc32c_across_any_split() {
        let data: Vec<u8> = (0..20_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let whole = crc32c::crc32c(&data);
        for split in [0, 1, 511, 512, 513, 4096, 10_007, 19_999, 20_000] {
            let (a, b) = data.split_at(split);
            assert_eq!(
                crc32c_append(crc32c_append(0, a), b),
                whole,
                "split at {split}"
            );
        }
        assert_eq!(crc32c_append(0, b"123456789"), 0xe306_9283);
        let region = Region::new_zeroed(20_000).unwrap();
        region.write_at(0, &data).unwrap();
        assert_eq!(region.crc32c_append(0, 0, 20_000).unwrap(), whole);
    }

    #[test]
    fn owned_region_is_zeroed_and_page_aligned() {
        let r = Region::new_zeroed(10_000).unwrap();
        assert_eq!(r.len(), 10_000);
        assert_eq!(r.addr() % PAGE_SIZE as u64, 0);
        let mut buf = vec![0xffu8; 10_000];
        r.read_at(0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
    }

    #[test]
    fn write_then_read_round_trips_and_bounds_are_enforced() {
        let r = Region::new_zeroed(16).unwrap();
        r.write_at(4, &[1, 2, 3]).unwrap();
        let mut out = [0u8; 5];
        r.read_at(3, &mut out).unwrap();
        assert_eq!(out, [0, 1, 2, 3, 0]);
        assert!(r.write_at(14, &[1, 2, 3]).is_err());
        assert!(r.read_at(17, &mut []).is_err());
        assert!(r.read_at(usize::MAX, &mut [0]).is_err());
        assert!(r.fill(8, 9, 0xaa).is_err());
        r.fill(8, 8, 0xaa).unwrap();
        let mut all = [0u8; 16];
        r.read_at(0, &mut all).unwrap();
        assert_eq!(&all[8..], &[0xaa; 8]);
    }

    #[test]
    fn zero_length_region_accepts_only_empty_accesses() {
        let r = Region::new_zeroed(0).unwrap();
        assert!(r.is_empty());
        r.read_at(0, &mut []).unwrap();
        assert!(r.write_at(0, &[1]).is_err());
    }

    #[test]
    fn raw_region_writes_into_caller_memory() {
        let mut backing = vec![0u8; 8];
        // SAFETY (test): `backing` outlives `r` and is not otherwise accessed meanwhile.
        #[allow(unsafe_code)]
        let r = unsafe { Region::from_raw(backing.as_mut_ptr(), backing.len()) }.unwrap();
        assert!(r.is_raw());
        r.write_at(2, &[9, 9]).unwrap();
        drop(r);
        assert_eq!(backing, [0, 0, 9, 9, 0, 0, 0, 0]);
    }

    #[test]
    fn atomic_update_returns_the_old_word_and_stores_the_new_one() {
        let r = Region::new_zeroed(16).unwrap();
        r.write_at(8, &41u64.to_ne_bytes()).unwrap();
        assert_eq!(r.atomic_update(8, |v| v + 1).unwrap(), 41);
        let mut b = [0u8; 8];
        r.read_at(8, &mut b).unwrap();
        assert_eq!(u64::from_ne_bytes(b), 42);
        assert!(r.atomic_update(9, |v| v).is_err(), "beyond the end");
        assert!(r.atomic_update(usize::MAX, |v| v).is_err());
    }

    #[test]
    fn crc_over_region_matches_crc_over_copy() {
        let r = Region::new_zeroed(100).unwrap();
        let data: Vec<u8> = (0..100u8).collect();
        r.write_at(0, &data).unwrap();
        assert_eq!(
            r.crc32c_append(0, 10, 50).unwrap(),
            crc32c::crc32c(&data[10..60])
        );
    }
}
