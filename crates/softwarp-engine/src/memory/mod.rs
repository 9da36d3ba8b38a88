//! Memory shared with the network: [`Region`].
//!
//! A region is a range of bytes that the application and the network may both touch at the
//! same time. That is what RDMA is: a peer's RDMA Write lands in memory the application can
//! read whenever it likes. This module is the only place that touches those bytes, and it is
//! the only module of the crate that contains `unsafe` code. It never does I/O.
//!
//! # Memory model
//!
//! **Who accesses region bytes, and what may race.** Three kinds of agents:
//!
//! 1. *The kernel*, through the runtime's `readv`/`sendmsg` on iovecs built from
//!    [`Region::ptr_range`] (raw pointers). It runs outside the Rust abstract machine, like a
//!    DMA engine or another process sharing the memory: the compiler can assume nothing about
//!    those bytes while the system call runs on another thread. Two QPs can place into, or
//!    send from, the same bytes of one region on two threads at once (a second registration
//!    of the same buffer, two peers writing one MR, a send from bytes a Write is landing in).
//! 2. *Rust threads of this process*: the engine placing staged payload ([`Region::write_at`]),
//!    copying payload to send ([`Region::read_at`]), computing the MPA CRC
//!    ([`Region::crc32c_append`]) or performing RFC 7306 atomics, on whatever thread drives a
//!    QP (the progress thread, a busy-polling or posting application thread); and the
//!    application itself through the safe `MemoryRegion::read_at`/`write_at`/`fill` of the
//!    `softwarp` crate. Any of these can run at the same time as any other, on the same bytes.
//! 3. *Foreign code* holding a pointer to a raw region ([`Region::from_raw`], the C ABI): it
//!    is outside what this module controls; its contract is `from_raw`'s (below).
//!
//! **What Rust code may do with region bytes.** Never create a `&[u8]` or `&mut [u8]` over
//! them, not even for the length of one call: a shared reference asserts that the bytes do not
//! change while it lives, a mutable one that nothing else reads them, and the compiler
//! optimizes on both (`noalias`, re-reading, merging or eliding loads). Every access made by
//! Rust code is an **atomic access with `Relaxed` ordering** through an `AtomicU64` or
//! `AtomicU8` view of the bytes ([`AtomicU64::from_ptr`]), which is what the Rust memory model
//! requires for accesses that may race: racing atomic accesses are not data races; racing plain
//! accesses (`ptr::copy_nonoverlapping`, `read_volatile`, a slice) are undefined behaviour,
//! whatever the hardware does. Volatile accesses are *not* enough between two Rust threads:
//! `vm-memory`'s `VolatileSlice` and crosvm use them because their other party is a guest VM
//! outside the abstract machine, and they require "all other users of the memory" to be
//! volatile too; here the other party is often another Rust thread (the application's safe
//! `write_at`), so only atomics make the API sound. The ordering is `Relaxed` because region
//! bytes carry no synchronization: completions are published through the QP and CQ locks,
//! which order the placement before the application's read of the completion.
//!
//! **One access size per byte.** The memory model also forbids racing atomic accesses of
//! *different sizes* to overlapping bytes unless both are reads. So the access unit of each
//! byte is fixed by the region alone, never by the access: the region's *word range*
//! ([`Region::word_range`]) is every 8-byte-aligned word that lies wholly inside the memory
//! the region owns; a byte inside it is always accessed through its `AtomicU64` word, a byte
//! outside it through an `AtomicU8`. Owned regions are page-aligned and allocated in whole
//! words, so all their bytes are in words; a raw region has at most 7 bytes at each end (or all
//! of a region too short to hold an aligned word) accessed as bytes. An access that covers a
//! word only partly reads the whole word (it is inside the region) and keeps its bytes, or
//! stores its bytes into the word with a compare-and-swap loop, which never loses a concurrent
//! store to the word's other bytes (by another thread or by the kernel). Two regions over
//! overlapping memory with different ends (two `from_raw` registrations of one buffer) could
//! give one byte two units; `from_raw`'s contract makes the caller responsible for that case.
//!
//! **What a racing access yields.** Each aligned word (or byte at a raw region's ends) is
//! read or written indivisibly, so a reader racing a writer sees, word by word, either the old
//! or the new bytes; a copy or CRC over several words can mix them. That is the verbs
//! contract (shared with the application): while a region is the source of a posted send or of
//! an RDMA Read Response, or the target of a posted receive, an RDMA Read sink or an incoming
//! RDMA Write, the application must not write those bytes; if it does, the bytes transferred
//! (and the CRC computed over them: a receiver then reports a CRC error) are unspecified,
//! but never undefined behaviour, and no memory outside the region is ever touched.
//!
//! **Why this is sound.** Rust code reaches region bytes only through `AtomicU64`/`AtomicU8`
//! references of this module that live for one load or store, to aligned, in-bounds memory
//! that is valid for the region's lifetime (owned: until drop; raw: `from_raw`'s contract), in
//! one access size per byte; so Rust-to-Rust races are atomic races, which the model defines.
//! The kernel's and the foreign code's accesses happen outside the abstract machine; Rust code
//! holds no reference over the bytes they write (the runtime hands them raw pointers), and
//! every Rust read of those bytes is an atomic load that really happens and is not assumed
//! stable, which is the treatment the model gives to memory modified by another agent. The
//! cost: no `memcpy` or SIMD CRC straight over region bytes through Rust loads; copies move a
//! word per load and store (`BENCHMARKS-history.md`, "Memory model").
//!
//! **The one exception: the CRC's vector loads.** On CPUs with AVX-512F and VPCLMULQDQ (asked
//! at run time), [`Region::crc32c_append`] folds runs of 256 bytes and more with carry-less
//! multiplication, and loads the region's words 64 bytes at a time with `vmovdqu64` inside
//! `asm!` blocks (`Region::crc_words_folding`). An asm block's memory access is not a Rust
//! access: like the kernel's, it happens outside the abstract machine, no reference over the
//! bytes exists, and the compiler assumes nothing about what it reads (`readonly`, not `pure`:
//! every load really happens). Each load covers eight whole aligned words of the word range,
//! the bytes' own access unit, so a racing writer yields what eight relaxed `AtomicU64` loads
//! would, a mix of old and new bytes, the contract above. Miri cannot run `asm!`, so under
//! Miri the CRC keeps the word loads (`cfg!(miri)`).
//!
//! **Checking it.** The unit tests include a CRC over unaligned ranges of a region compared
//! with the CRC of a copy, and racing writer/reader threads; `cargo +nightly miri test -p
//! softwarp-engine --lib memory` runs them under Miri, which reports any non-atomic or
//! mixed-size race and any reference over the bytes (DESIGN.md says how).

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};

use thiserror::Error;

mod crc;
pub(crate) use crc::crc32c_append;

/// Alignment of regions the stack allocates: one page.
pub const PAGE_SIZE: usize = 4096;

/// Size of the access unit inside a region's word range (an `AtomicU64`).
const WORD: usize = 8;

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
    /// Allocated by [`Region::new_zeroed`]; freed on drop with this layout (whole words).
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
/// them while the application holds the region (typically in an `Arc`). See the module
/// documentation for the memory model.
#[derive(Debug)]
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    /// Offsets `[words.0, words.1)` of the aligned 8-byte words that lie wholly inside the
    /// memory this region owns (for owned regions `words.1` may exceed `len`: the allocation
    /// is whole words). Bytes inside are accessed as `AtomicU64`, bytes outside as `AtomicU8`.
    words: (usize, usize),
    backing: Backing,
}

// SAFETY: a Region is a pointer and a length to memory that is valid for the Region's
// lifetime (owned: until drop; raw: guaranteed by the `from_raw` caller). No method creates
// a reference to the bytes other than a one-access atomic view, so moving the Region to
// another thread cannot create aliasing references.
unsafe impl Send for Region {}
// SAFETY: all methods take `&self` and access the bytes only through `AtomicU64`/`AtomicU8`
// loads and stores (one access size per byte, fixed by the region), bounded by `len`:
// concurrent calls from several threads are atomic races, which are defined behaviour in
// Rust's memory model (module docs), and never touch memory outside the region.
unsafe impl Sync for Region {}

/// Whole-word runs at least this long are copied in and out of a region with aligned
/// 16-byte vector moves when the CPU has AVX ([`Region::copy_blocks`]); shorter ones word
/// by word.
const VEC_COPY_MIN: usize = 256;
/// Bytes one round of the vector copy moves: four 16-byte moves.
const VEC_BLOCK: usize = 64;

/// True when the CPU has AVX, whose aligned 16-byte moves are atomic (Intel SDM vol. 3A,
/// 9.1.1: "processors that enumerate support for Intel AVX ... guarantee that the 16-byte
/// memory operations performed by ... VMOVDQA when encoded with VEX.128 ... will always be
/// carried out atomically"; AMD documents the same for aligned 16-byte SSE/AVX accesses on
/// CPUs with AVX): each such move loads or stores two whole aligned words, so a racing
/// reader still sees every word wholly old or wholly new. Asked at run time (std caches
/// the answer), never assumed from build flags; never under Miri, which cannot run `asm!`.
#[inline(always)]
fn vec_copy_available() -> bool {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    {
        std::arch::is_x86_feature_detected!("avx")
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    {
        false
    }
}

/// A run of a copy out of a region (into the slice) or into it (from the slice).
enum Run<'a> {
    Out(&'a mut [u8]),
    In(&'a [u8]),
}

/// One piece of an access to region bytes, in address order (see [`Region::load_each`]).
enum Piece {
    /// A whole aligned word, as loaded (host byte order).
    Word(u64),
    /// `.1` bytes (at most 8) at the start of `.0`: a part of a word, or bytes outside the
    /// word range.
    Part([u8; WORD], usize),
}

impl Region {
    /// Allocates a zeroed, page-aligned region of `len` bytes.
    pub fn new_zeroed(len: usize) -> Result<Self, MemoryError> {
        if len == 0 {
            return Ok(Self {
                ptr: NonNull::dangling(),
                len: 0,
                words: (0, 0),
                backing: Backing::Empty,
            });
        }
        // Whole words, so that every byte of the region is inside an aligned word that lies
        // in the allocation (one access unit for all bytes: the module docs).
        let alloc_len = len
            .checked_next_multiple_of(WORD)
            .ok_or(MemoryError::AllocationFailed(len))?;
        let layout = Layout::from_size_align(alloc_len, PAGE_SIZE)
            .map_err(|_| MemoryError::AllocationFailed(len))?;
        // SAFETY: `layout` has a non-zero size (len > 0 checked above).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(MemoryError::AllocationFailed(len))?;
        Ok(Self {
            ptr,
            len,
            words: (0, alloc_len),
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
    /// operation on them is in flight. Concurrent accesses by Rust (or C) code outside this
    /// module must be atomic, or happen outside the Rust abstract machine (the kernel, a
    /// device, another process); plain accesses may race only with the kernel's. If another
    /// `Region` covers some of the same bytes with different ends, the two must not be
    /// accessed concurrently within 8 bytes of either region's ends (their access sizes could
    /// differ there: the module docs).
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> Result<Self, MemoryError> {
        let ptr = NonNull::new(ptr).ok_or(MemoryError::AllocationFailed(len))?;
        let head = (ptr.as_ptr() as usize).wrapping_neg() % WORD;
        let words = match len.checked_sub(head) {
            Some(rest) if rest >= WORD => (head, head + rest / WORD * WORD),
            _ => (len, len),
        };
        Ok(Self {
            ptr,
            len,
            words,
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

    /// The offsets of the region's word range: bytes in `start..end` are accessed through
    /// their aligned `AtomicU64` word, the others through an `AtomicU8` (module docs).
    /// `end` may exceed [`Region::len`] for owned regions (allocated in whole words).
    pub fn word_range(&self) -> std::ops::Range<usize> {
        self.words.0..self.words.1
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
    /// safe; using it is the caller's `unsafe` business (e.g. an iovec for `readv`): never
    /// turn it into a slice (module docs).
    pub fn ptr_range(&self, offset: usize, len: usize) -> Result<*mut u8, MemoryError> {
        self.check(offset, len)?;
        // `wrapping_add` keeps this free of `unsafe`; the bounds check above makes the result
        // lie within (or one past) the allocation.
        Ok(self.ptr.as_ptr().wrapping_add(offset))
    }

    /// The atomic view of the word at offset `at`, which the caller guarantees to be a word
    /// of the word range (`words.0 <= at`, `at + 8 <= words.1`, `at - words.0` a multiple
    /// of 8).
    #[inline(always)]
    fn word(&self, at: usize) -> &AtomicU64 {
        debug_assert!(
            at >= self.words.0
                && at + WORD <= self.words.1
                && (at - self.words.0).is_multiple_of(WORD)
        );
        // SAFETY: `at` names a word of the word range (caller), which lies inside memory the
        // region owns and keeps valid for its lifetime, and whose address is a multiple of 8
        // (`words.0` is aligned: page-aligned owned memory, or rounded up in `from_raw`),
        // as `AtomicU64::from_ptr` requires. Every Rust access to these 8 bytes goes through
        // this same `AtomicU64` view (one access size per byte), so no non-atomic or
        // mixed-size access races with it; the kernel's accesses are outside the abstract
        // machine (module docs).
        unsafe { AtomicU64::from_ptr(self.ptr.as_ptr().add(at).cast::<u64>()) }
    }

    /// The atomic view of the byte at offset `at`, which the caller guarantees to be outside
    /// the word range and inside the region.
    #[inline(always)]
    fn byte(&self, at: usize) -> &AtomicU8 {
        debug_assert!(at < self.len && (at < self.words.0 || at >= self.words.1));
        // SAFETY: `at < len` (caller), so the byte is inside the region's memory, valid for
        // its lifetime; `AtomicU8` has alignment 1. Bytes outside the word range are only ever
        // accessed through this `AtomicU8` view (one access size per byte).
        unsafe { AtomicU8::from_ptr(self.ptr.as_ptr().add(at)) }
    }

    /// Loads the `len` bytes at `offset` (bounds already checked) and hands them to `f` in
    /// address order: whole words as [`Piece::Word`], the rest as [`Piece::Part`].
    #[inline(always)]
    fn load_each(&self, offset: usize, len: usize, mut f: impl FnMut(Piece)) {
        let end = offset + len;
        let (w0, w1) = self.words;
        let mut at = offset;
        // Bytes below the word range (raw regions only).
        while at < end.min(w0) {
            let n = (end.min(w0) - at).min(WORD);
            let mut b = [0u8; WORD];
            for (i, x) in b.iter_mut().take(n).enumerate() {
                *x = self.byte(at + i).load(Relaxed);
            }
            f(Piece::Part(b, n));
            at += n;
        }
        let wend = end.min(w1);
        if at < wend {
            let skew = (at - w0) % WORD;
            if skew != 0 {
                let b = self.word(at - skew).load(Relaxed).to_ne_bytes();
                let n = (WORD - skew).min(wend - at);
                let mut part = [0u8; WORD];
                part[..n].copy_from_slice(&b[skew..skew + n]);
                f(Piece::Part(part, n));
                at += n;
            }
            while at + WORD <= wend {
                f(Piece::Word(self.word(at).load(Relaxed)));
                at += WORD;
            }
            if at < wend {
                f(Piece::Part(
                    self.word(at).load(Relaxed).to_ne_bytes(),
                    wend - at,
                ));
                at = wend;
            }
        }
        // Bytes above the word range (raw regions only).
        while at < end {
            let n = (end - at).min(WORD);
            let mut b = [0u8; WORD];
            for (i, x) in b.iter_mut().take(n).enumerate() {
                *x = self.byte(at + i).load(Relaxed);
            }
            f(Piece::Part(b, n));
            at += n;
        }
    }

    /// Stores `src` at `offset` (bounds already checked), one access unit at a time: whole
    /// words by a store, parts of words by a compare-and-swap loop that keeps the word's
    /// other bytes (a concurrent store to them is never lost), bytes outside the word range
    /// by byte stores.
    #[inline(never)]
    fn store_each(&self, offset: usize, src: &[u8]) {
        let end = offset + src.len();
        let (w0, w1) = self.words;
        let mut at = offset;
        let mut rest = src;
        let bytes_out = |at: usize, b: &[u8]| {
            for (i, &x) in b.iter().enumerate() {
                self.byte(at + i).store(x, Relaxed);
            }
        };
        let below = end.min(w0).saturating_sub(at);
        if below > 0 {
            let (b, r) = rest.split_at(below);
            bytes_out(at, b);
            rest = r;
            at += below;
        }
        let wend = end.min(w1);
        if at < wend {
            let skew = (at - w0) % WORD;
            if skew != 0 {
                let n = (WORD - skew).min(wend - at);
                let (b, r) = rest.split_at(n);
                self.store_part(at - skew, skew, b);
                rest = r;
                at += n;
            }
            let whole = (wend - at) / WORD * WORD;
            let (words, r) = rest.split_at(whole);
            if whole >= VEC_COPY_MIN && vec_copy_available() {
                // A long run from a word boundary (what follows a partial first word, say
                // the payload of an MSS-sized FPDU): as `write_at`'s common case.
                self.write_long(at, words);
                at += whole;
            } else {
                for chunk in words.chunks_exact(WORD) {
                    let mut w = [0u8; WORD];
                    w.copy_from_slice(chunk);
                    self.word(at).store(u64::from_ne_bytes(w), Relaxed);
                    at += WORD;
                }
            }
            rest = r;
            if at < wend {
                let (b, r) = rest.split_at(wend - at);
                self.store_part(at, 0, b);
                rest = r;
                at = wend;
            }
        }
        if !rest.is_empty() {
            bytes_out(at, rest);
        }
    }

    /// Stores `b` into the word at `word_at`, starting `skew` bytes into it, keeping the
    /// word's other bytes (compare-and-swap loop).
    #[inline]
    fn store_part(&self, word_at: usize, skew: usize, b: &[u8]) {
        let word = self.word(word_at);
        let mut old = word.load(Relaxed);
        loop {
            let mut new = old.to_ne_bytes();
            new[skew..skew + b.len()].copy_from_slice(b);
            match word.compare_exchange_weak(old, u64::from_ne_bytes(new), Relaxed, Relaxed) {
                Ok(_) => return,
                Err(now) => old = now,
            }
        }
    }

    /// The address of the byte at `offset` (for alignment decisions only).
    #[inline(always)]
    fn addr_at(&self, offset: usize) -> usize {
        (self.ptr.as_ptr() as usize).wrapping_add(offset)
    }

    /// Copies `len` bytes (a multiple of [`VEC_BLOCK`]) between the words at `at`, a
    /// 16-byte-aligned word boundary of the word range, and the buffer at `buf` with aligned
    /// 16-byte `vmovdqa` accesses to the region (see [`vec_copy_available`]): out of the
    /// region into `buf`, or into it from `buf`. The region bytes are read or written inside
    /// an `asm!` block, not by Rust code (as the CRC's loads are,
    /// [`Region::crc_words_folding`]): no reference over them exists.
    ///
    /// # Safety
    /// The CPU has AVX; `buf` is valid for `len` bytes of writes (out) or reads (in), a buffer
    /// of the caller's that does not overlap the region.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    #[allow(unsafe_code)]
    #[inline(always)]
    unsafe fn copy_blocks(&self, at: usize, buf: *mut u8, len: usize, out: bool) {
        let blocks = len / VEC_BLOCK;
        if blocks == 0 {
            return;
        }
        debug_assert!(
            at >= self.words.0 && at + len <= self.words.1 && self.addr_at(at).is_multiple_of(16)
        );
        let region = self.ptr.as_ptr().wrapping_add(at);
        if out {
            // SAFETY: `at..at + len` lies in the word range (the caller's bounds check:
            // whole words from a word boundary), memory the region keeps valid for its
            // lifetime, and starts 16-byte aligned, as `vmovdqa` needs; `buf` is valid for
            // `len` bytes of writes (unaligned stores; the caller). The block reads only those
            // region bytes, writes only `buf`, and leaves the stack alone.
            unsafe {
                std::arch::asm!(
                    "2:",
                    "vmovdqa {a}, xmmword ptr [{src}]",
                    "vmovdqa {b}, xmmword ptr [{src} + 16]",
                    "vmovdqa {c}, xmmword ptr [{src} + 32]",
                    "vmovdqa {d}, xmmword ptr [{src} + 48]",
                    "vmovdqu xmmword ptr [{dst}], {a}",
                    "vmovdqu xmmword ptr [{dst} + 16], {b}",
                    "vmovdqu xmmword ptr [{dst} + 32], {c}",
                    "vmovdqu xmmword ptr [{dst} + 48], {d}",
                    "add {src}, 64",
                    "add {dst}, 64",
                    "dec {n}",
                    "jnz 2b",
                    src = inout(reg) region => _,
                    dst = inout(reg) buf => _,
                    n = inout(reg) blocks => _,
                    a = out(xmm_reg) _,
                    b = out(xmm_reg) _,
                    c = out(xmm_reg) _,
                    d = out(xmm_reg) _,
                    options(nostack),
                );
            }
        } else {
            // SAFETY: as above the other way: the block reads `len` bytes at `buf` (unaligned
            // loads; valid for reads, the caller) and writes only the region bytes
            // `at..at + len`, whole aligned 16-byte units of the word range.
            unsafe {
                std::arch::asm!(
                    "2:",
                    "vmovdqu {a}, xmmword ptr [{src}]",
                    "vmovdqu {b}, xmmword ptr [{src} + 16]",
                    "vmovdqu {c}, xmmword ptr [{src} + 32]",
                    "vmovdqu {d}, xmmword ptr [{src} + 48]",
                    "vmovdqa xmmword ptr [{dst}], {a}",
                    "vmovdqa xmmword ptr [{dst} + 16], {b}",
                    "vmovdqa xmmword ptr [{dst} + 32], {c}",
                    "vmovdqa xmmword ptr [{dst} + 48], {d}",
                    "add {src}, 64",
                    "add {dst}, 64",
                    "dec {n}",
                    "jnz 2b",
                    src = inout(reg) buf.cast_const() => _,
                    dst = inout(reg) region => _,
                    n = inout(reg) blocks => _,
                    a = out(xmm_reg) _,
                    b = out(xmm_reg) _,
                    c = out(xmm_reg) _,
                    d = out(xmm_reg) _,
                    options(nostack),
                );
            }
        }
    }

    /// [`Region::read_at`]'s common case (`offset` starts a word, the range ends inside the
    /// word range) for [`VEC_COPY_MIN`] bytes and more with AVX: words up to a 16-byte
    /// boundary, 64-byte rounds of vector moves, then the remaining words and the start of
    /// the last one. Out of line, so that short copies inline only the word loop.
    #[inline(never)]
    fn read_long(&self, offset: usize, dst: &mut [u8]) {
        let mut at = offset;
        let mut dst = dst;
        while !self.addr_at(at).is_multiple_of(16) {
            let Some((w, more)) = std::mem::take(&mut dst).split_first_chunk_mut::<WORD>() else {
                break;
            };
            *w = self.word(at).load(Relaxed).to_ne_bytes();
            at += WORD;
            dst = more;
        }
        let cut = dst.len() / VEC_BLOCK * VEC_BLOCK;
        let (run, more) = dst.split_at_mut(cut);
        self.copy_run(at, Run::Out(run));
        at += cut;
        let (words, rest) = more.as_chunks_mut::<WORD>();
        let whole = words.len() * WORD;
        self.copy_words_out(at, words.as_flattened_mut());
        at += whole;
        if !rest.is_empty() {
            let b = self.word(at).load(Relaxed).to_ne_bytes();
            rest.copy_from_slice(&b[..rest.len()]);
        }
    }

    /// [`Region::write_at`]'s common case (whole words from a word boundary) for
    /// [`VEC_COPY_MIN`] bytes and more with AVX, as [`Region::read_long`] the other way.
    #[inline(never)]
    fn write_long(&self, offset: usize, src: &[u8]) {
        let mut at = offset;
        let mut src = src;
        while !self.addr_at(at).is_multiple_of(16) {
            let Some((w, more)) = src.split_first_chunk::<WORD>() else {
                break;
            };
            self.word(at).store(u64::from_ne_bytes(*w), Relaxed);
            at += WORD;
            src = more;
        }
        let (run, more) = src.split_at(src.len() / VEC_BLOCK * VEC_BLOCK);
        self.copy_run(at, Run::In(run));
        self.copy_words_in(at + run.len(), more);
    }

    /// Copies a run of whole words at `at` (16-byte aligned, a multiple of [`VEC_BLOCK`]
    /// long) out of or into the region: by [`Region::copy_blocks`] when the CPU has AVX,
    /// else word by word.
    #[inline(always)]
    fn copy_run(&self, at: usize, run: Run<'_>) {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        if vec_copy_available() {
            let (buf, len, out) = match run {
                Run::Out(d) => (d.as_mut_ptr(), d.len(), true),
                Run::In(s) => (s.as_ptr().cast_mut(), s.len(), false),
            };
            // SAFETY: the CPU has AVX (just asked); `buf` is the caller's slice of `len`
            // bytes, valid for writes when copying out (a `&mut`) and only read when
            // copying in; it is the caller's own memory, never region memory.
            #[allow(unsafe_code)]
            unsafe {
                self.copy_blocks(at, buf, len, out);
            }
            return;
        }
        match run {
            Run::Out(d) => self.copy_words_out(at, d),
            Run::In(s) => self.copy_words_in(at, s),
        }
    }

    /// Word-by-word copy of whole words out (the fallback of [`Region::copy_run`]).
    #[inline(always)]
    fn copy_words_out(&self, mut at: usize, dst: &mut [u8]) {
        for w in dst.as_chunks_mut::<WORD>().0 {
            *w = self.word(at).load(Relaxed).to_ne_bytes();
            at += WORD;
        }
    }

    /// Word-by-word copy of whole words in (the fallback of [`Region::copy_run`]).
    #[inline(always)]
    fn copy_words_in(&self, mut at: usize, src: &[u8]) {
        for w in src.as_chunks::<WORD>().0 {
            self.word(at).store(u64::from_ne_bytes(*w), Relaxed);
            at += WORD;
        }
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region.
    #[inline]
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), MemoryError> {
        self.check(offset, dst.len())?;
        if self.starts_a_word_in_words(offset, dst.len()) {
            // The common case (aligned buffers of an owned region): whole words, then the
            // start of the last one.
            if dst.len() >= VEC_COPY_MIN && vec_copy_available() {
                self.read_long(offset, dst);
                return Ok(());
            }
            let (words, rest) = dst.as_chunks_mut::<WORD>();
            let mut at = offset;
            for w in words {
                *w = self.word(at).load(Relaxed).to_ne_bytes();
                at += WORD;
            }
            if !rest.is_empty() {
                let b = self.word(at).load(Relaxed).to_ne_bytes();
                rest.copy_from_slice(&b[..rest.len()]);
            }
        } else {
            self.read_general(offset, dst);
        }
        Ok(())
    }

    /// True when `offset` is the start of a word of the word range and `offset + len` lies
    /// inside the word range: the access needs no partial first word and no byte units.
    #[inline(always)]
    fn starts_a_word_in_words(&self, offset: usize, len: usize) -> bool {
        let (w0, w1) = self.words;
        // `offset + len` cannot overflow: the caller checked it against the region's length.
        offset >= w0 && (offset - w0).is_multiple_of(WORD) && offset + len <= w1
    }

    /// [`Region::read_at`] of any range, bounds already checked: kept out of line, off the
    /// common path. A range that does not start a word (a payload of MSS-sized FPDUs, 1,436
    /// bytes each, lands at every offset) but holds [`VEC_COPY_MIN`] bytes of whole words
    /// takes its whole words as [`Region::read_long`] does, the ends piece by piece.
    #[inline(never)]
    fn read_general(&self, offset: usize, dst: &mut [u8]) {
        if let Some((mid, mid_end)) = self.long_words_inside(offset, dst.len()) {
            let (head, rest) = dst.split_at_mut(mid - offset);
            let (middle, tail) = rest.split_at_mut(mid_end - mid);
            self.read_pieces(offset, head);
            self.read_long(mid, middle);
            self.read_pieces(mid_end, tail);
            return;
        }
        self.read_pieces(offset, dst);
    }

    /// The whole words of `offset..offset + len` (from the first word boundary of the word
    /// range at or after `offset` to the last one at or before the end) when they are
    /// [`VEC_COPY_MIN`] bytes or more and the CPU copies them with vector moves
    /// ([`vec_copy_available`]): the run [`Region::read_long`] and [`Region::write_long`]
    /// take. `None` otherwise.
    #[inline(always)]
    fn long_words_inside(&self, offset: usize, len: usize) -> Option<(usize, usize)> {
        let (w0, w1) = self.words;
        let end = offset + len;
        let mid = w0 + offset.max(w0).checked_sub(w0)?.div_ceil(WORD) * WORD;
        let mid_end = w0 + end.min(w1).checked_sub(w0)? / WORD * WORD;
        (mid_end >= mid + VEC_COPY_MIN && vec_copy_available()).then_some((mid, mid_end))
    }

    /// [`Region::read_general`] one access unit at a time ([`Region::load_each`]); a range
    /// inside one word of the word range (the partial end of a longer copy) by that word's
    /// one load.
    #[inline(always)]
    fn read_pieces(&self, offset: usize, dst: &mut [u8]) {
        if let Some(skew) = self.inside_one_word(offset, dst.len()) {
            let b = self.word(offset - skew).load(Relaxed).to_ne_bytes();
            dst.copy_from_slice(&b[skew..skew + dst.len()]);
            return;
        }
        let mut out = dst;
        self.load_each(offset, out.len(), |piece| {
            let (bytes, n) = match piece {
                Piece::Word(w) => (w.to_ne_bytes(), WORD),
                Piece::Part(b, n) => (b, n),
            };
            let (head, tail) = std::mem::take(&mut out).split_at_mut(n);
            head.copy_from_slice(&bytes[..n]);
            out = tail;
        });
    }

    /// Copies `src` into the region starting at `offset`.
    #[inline(always)]
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), MemoryError> {
        self.check(offset, src.len())?;
        if self.starts_a_word_in_words(offset, src.len()) && src.len().is_multiple_of(WORD) {
            // The common case (aligned buffers and lengths): whole words only, four at a
            // time where it can (the compiler unrolls this loop at some of its inlined
            // copies only: 6 instructions a word instead of about 3 where it does not).
            if src.len() >= VEC_COPY_MIN && vec_copy_available() {
                self.write_long(offset, src);
                return Ok(());
            }
            let mut at = offset;
            let (quads, rest) = src.as_chunks::<{ 4 * WORD }>();
            for q in quads {
                for w in q.as_chunks::<WORD>().0 {
                    self.word(at).store(u64::from_ne_bytes(*w), Relaxed);
                    at += WORD;
                }
            }
            for w in rest.as_chunks::<WORD>().0 {
                self.word(at).store(u64::from_ne_bytes(*w), Relaxed);
                at += WORD;
            }
        } else if let Some(skew) = self.inside_one_word(offset, src.len()) {
            // A few bytes inside one word of the word range (the payload of a short FPDU):
            // the one compare-and-swap `store_each` would come to.
            self.store_part(offset - skew, skew, src);
        } else {
            self.store_each(offset, src);
        }
        Ok(())
    }

    /// `Some(skew)` when the `len` bytes (at least one) at `offset` lie inside one word of
    /// the word range, `skew` bytes into it.
    #[inline(always)]
    fn inside_one_word(&self, offset: usize, len: usize) -> Option<usize> {
        let (w0, w1) = self.words;
        // `offset + len` cannot overflow: the caller checked it against the region's length.
        if len == 0 || offset < w0 || offset + len > w1 {
            return None;
        }
        let skew = (offset - w0) % WORD;
        (skew + len <= WORD).then_some(skew)
    }

    /// Sets `len` bytes at `offset` to `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<(), MemoryError> {
        self.check(offset, len)?;
        let pattern = [byte; 256];
        let mut at = offset;
        while at < offset + len {
            let n = (offset + len - at).min(pattern.len());
            self.store_each(at, &pattern[..n]);
            at += n;
        }
        Ok(())
    }

    /// Reads the 64-bit word (host byte order) at `offset`, stores `f(word)` in its place, and
    /// returns the original word, atomically with respect to every other `atomic_update` of
    /// this process (one lock for all regions, so aliasing registrations are covered too).
    /// `f` must not panic. Not atomic with respect to the application's own accesses or to
    /// placements by other QPs, as with RNICs that do not use PCIe atomics.
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
        #[allow(unsafe_code)]
        // SAFETY: `backing` (8 bytes, the length given) outlives `r`, dropped before the
        // assertion reads it, and nothing else touches it meanwhile.
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

    /// Bytes that differ at every position (so a shifted or torn copy shows).
    pub(crate) fn pattern(len: usize, seed: u32) -> Vec<u8> {
        (0..len as u32)
            .map(|i| (i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect()
    }

    /// A raw region of `len` bytes starting `misalign` bytes past an 8-aligned address of
    /// `backing` (which must be at least `len + 8` words long).
    #[allow(unsafe_code)]
    pub(crate) fn raw_at(backing: &mut [u64], misalign: usize, len: usize) -> Region {
        assert!(misalign < 8 && misalign + len <= backing.len() * 8);
        let ptr = backing.as_mut_ptr().cast::<u8>().wrapping_add(misalign);
        // SAFETY: `ptr..ptr + len` lies inside `backing` (asserted above), which outlives the
        // region (every caller drops the region first) and is not otherwise accessed
        // meanwhile.
        unsafe { Region::from_raw(ptr, len) }.unwrap()
    }

    #[test]
    fn copies_round_trip_at_every_alignment_of_base_offset_and_length() {
        // Under Miri (slow): two misalignments and the lengths around one word.
        let (misaligns, lens): (&[usize], &[usize]) = if cfg!(miri) {
            (&[0, 3], &[1, 7, 9, 17])
        } else {
            (
                &[0, 1, 2, 3, 4, 5, 6, 7],
                &[0, 1, 5, 7, 8, 9, 15, 16, 17, 24, 31],
            )
        };
        for &misalign in misaligns {
            for &len in lens {
                let mut backing = vec![0u64; 6];
                let r = raw_at(&mut backing, misalign, len.max(1));
                let word_range = r.word_range();
                assert!(word_range.start <= word_range.end && word_range.end <= r.len());
                assert!(word_range.is_empty() || word_range.start < 8);
                for offset in 0..r.len() {
                    for n in 0..=r.len() - offset {
                        assert_copy_round_trips(&r, offset, n, &format!("misalign {misalign}"));
                    }
                }
                drop(r);
                // Nothing outside the region was touched.
                let bytes: Vec<u8> = backing.iter().flat_map(|w| w.to_ne_bytes()).collect();
                assert!(bytes[..misalign].iter().all(|&b| b == 0));
                assert!(bytes[misalign + len.max(1)..].iter().all(|&b| b == 0));
            }
        }
    }

    /// Copies long enough for the 16-byte vector moves (`VEC_COPY_MIN` and more), from every
    /// word offset and length around the 16-byte and 64-byte boundaries, into owned and
    /// misaligned raw regions: the bytes are those copied, and nothing around them changes.
    /// (On a CPU without AVX, and under Miri, the word path runs and the test still holds.)
    #[test]
    fn vector_copies_place_exactly_the_bytes_at_every_offset_and_length() {
        let lens: &[usize] = if cfg!(miri) {
            &[256, 328]
        } else {
            &[
                248, 256, 264, 320, 328, 333, 384, 1000, 1436, 1437, 4096, 4103, 4104,
            ]
        };
        // Offsets inside a word too: the payloads of MSS-sized FPDUs start anywhere.
        let offsets: &[usize] = if cfg!(miri) {
            &[0, 8, 5]
        } else {
            &[0, 8, 16, 24, 40, 56, 3, 4, 7, 13, 17, 1436]
        };
        for misalign in [None, Some(0), Some(4)] {
            let mut backing = vec![0u64; 800];
            let r = match misalign {
                None => Region::new_zeroed(6000).unwrap(),
                Some(m) => raw_at(&mut backing, m, 6000),
            };
            for &offset in offsets {
                for &n in lens {
                    assert_copy_round_trips(&r, offset, n, &format!("{misalign:?}"));
                }
            }
            drop(r);
            if let Some(m) = misalign {
                // Nothing outside the raw region was touched.
                let bytes: Vec<u8> = backing.iter().flat_map(|w| w.to_ne_bytes()).collect();
                assert!(bytes[..m].iter().all(|&b| b == 0), "{misalign:?}: before");
                assert!(
                    bytes[m + 6000..].iter().all(|&b| b == 0),
                    "{misalign:?}: after"
                );
            }
        }
    }

    /// Writes `n` pattern bytes at `offset` of `r` over other pattern bytes, then checks that
    /// the whole region reads back as the old bytes with the new ones at that place, and that
    /// reading the place alone gives the new bytes.
    fn assert_copy_round_trips(r: &Region, offset: usize, n: usize, what: &str) {
        let before = pattern(r.len(), 3);
        r.write_at(0, &before).unwrap();
        let src = pattern(n, 9);
        r.write_at(offset, &src).unwrap();
        let mut all = vec![0u8; r.len()];
        r.read_at(0, &mut all).unwrap();
        let mut want = before;
        want[offset..offset + n].copy_from_slice(&src);
        assert!(all == want, "{what} at {offset}+{n}: other bytes");
        let mut part = vec![0u8; n];
        r.read_at(offset, &mut part).unwrap();
        assert!(part == src, "{what} at {offset}+{n}: read back");
    }

    /// The documented model: a reader racing a writer on the same bytes is defined behaviour
    /// and sees every aligned word either wholly old or wholly new (never a torn word), and
    /// its CRC is the CRC of some such mix (here: one of the two whole patterns, or a value
    /// that the reader's own copy confirms is a mix of them).
    #[test]
    fn a_reader_racing_a_writer_sees_whole_words_under_the_documented_model() {
        const LEN: usize = 256;
        let rounds = if cfg!(miri) { 20 } else { 20_000 };
        let region = std::sync::Arc::new(Region::new_zeroed(LEN + 8).unwrap());
        let (a, b) = ([0x11u8; LEN], [0xeeu8; LEN]);
        region.write_at(8, &a).unwrap();
        let writer = {
            let region = std::sync::Arc::clone(&region);
            std::thread::spawn(move || {
                for i in 0..rounds {
                    region
                        .write_at(8, if i % 2 == 0 { &b } else { &a })
                        .unwrap();
                    region
                        .fill(8, LEN, if i % 2 == 0 { 0x11 } else { 0xee })
                        .unwrap();
                }
            })
        };
        let mut copy = [0u8; LEN];
        for _ in 0..rounds {
            region.read_at(8, &mut copy).unwrap();
            for word in copy.chunks_exact(8) {
                assert!(
                    word == [0x11; 8] || word == [0xee; 8],
                    "torn word {word:x?}"
                );
            }
            let crc = region.crc32c_append(0, 8, LEN).unwrap();
            let crc_long = region.crc32c_append(0, 0, LEN + 8).unwrap();
            std::hint::black_box((crc, crc_long));
        }
        writer.join().unwrap();
    }

    /// The same model for a range that starts and ends inside words (the payload of an
    /// MSS-sized FPDU): the copies take the whole words between its ends with vector moves
    /// ([`Region::read_general`], [`Region::store_each`]), and every word wholly inside the
    /// range is still seen wholly old or wholly new.
    #[test]
    fn a_reader_racing_a_writer_on_a_range_inside_words_sees_whole_words() {
        const AT: usize = 12;
        const LEN: usize = 300;
        let rounds = if cfg!(miri) { 20 } else { 20_000 };
        let region = std::sync::Arc::new(Region::new_zeroed(AT + LEN + 16).unwrap());
        let (a, b) = ([0x11u8; LEN], [0xeeu8; LEN]);
        region.write_at(AT, &a).unwrap();
        let writer = {
            let region = std::sync::Arc::clone(&region);
            std::thread::spawn(move || {
                for i in 0..rounds {
                    region
                        .write_at(AT, if i % 2 == 0 { &b } else { &a })
                        .unwrap();
                }
            })
        };
        let mut copy = [0u8; LEN];
        // The region words 16..312 are copy[4..300].
        let first = AT.next_multiple_of(8) - AT;
        for _ in 0..rounds {
            region.read_at(AT, &mut copy).unwrap();
            for word in copy[first..].chunks_exact(8) {
                assert!(
                    word == [0x11; 8] || word == [0xee; 8],
                    "torn word {word:x?}"
                );
            }
        }
        writer.join().unwrap();
    }

    /// Two threads storing into different bytes of one word (a partial-word store is a
    /// compare-and-swap loop) never lose each other's stores.
    #[test]
    fn concurrent_stores_to_different_bytes_of_one_word_are_never_lost() {
        let rounds: u8 = if cfg!(miri) { 30 } else { 255 };
        let repeats = if cfg!(miri) { 1 } else { 200 };
        let region = std::sync::Arc::new(Region::new_zeroed(16).unwrap());
        let spawn = |at: usize| {
            let region = std::sync::Arc::clone(&region);
            std::thread::spawn(move || {
                for _ in 0..repeats {
                    for v in 1..=rounds {
                        region.write_at(at, &[v]).unwrap();
                    }
                }
            })
        };
        let (t1, t2) = (spawn(2), spawn(5));
        t1.join().unwrap();
        t2.join().unwrap();
        let mut w = [0u8; 8];
        region.read_at(0, &mut w).unwrap();
        assert_eq!(w, [0, 0, rounds, 0, 0, rounds, 0, 0]);
    }
}
