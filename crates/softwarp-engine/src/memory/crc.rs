//! CRC32c for MPA (RFC 5044 section 4.4) over region memory and over buffers the engine
//! owns: the CRC32-instruction loops and the carry-less-multiply folding. Region bytes are
//! loaded the way the memory model of the parent module allows (whole atomic words, or
//! `asm!` vector loads of whole words); never through a slice. No I/O here.

use std::sync::atomic::Ordering::Relaxed;

use super::{MemoryError, Piece, Region, WORD};

/// Payloads at least this long go through the carry-less-multiply CRC (below it a plain
/// CRC32-instruction loop wins: no set-up cost).
const FOLDING_CRC_MIN: usize = 512;

/// Continues a CRC32c (as `crc32c::crc32c_append`) over bytes this process owns (never over
/// region memory: [`Region::crc32c_append`] does that): large inputs use `crc_fast`, which
/// folds with (V)PCLMULQDQ and runs about three times faster than the `crc32c` crate on the
/// machine BENCHMARKS-history.md was first measured on (41 vs 15 GB/s, a 64 KiB buffer).
///
/// The short path is inlined into the callers (the small-message paths call it once per
/// FPDU each way) and the folding one is a function of its own, so that its large digest
/// state costs the short path nothing: with SSE 4.2 detected at run time rather than enabled
/// by the build, the whole out of line cost `examples/msgrate` about 6 instructions per call
/// (BENCHMARKS-history.md, item 24a).
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

/// The CRC32c register update for region pieces: the CPU's CRC32 instruction ([`Hw`]) when
/// the CPU has it (asked at run time, `softwarp_wire::crc::backend`, whatever flags the
/// program was built with), else the `crc32c` crate ([`Sw`]).
trait CrcRegister {
    /// True when [`Region::crc_with`] sends long word runs through
    /// [`Region::crc_words_folding`] (the register type is only used once the CPU was found
    /// to have what that path needs).
    const FOLDS: bool = false;
    /// Feeds an aligned word (its bytes in memory order) into the raw register `c`.
    fn word(c: u32, w: u64) -> u32;
    /// Feeds bytes into the raw register `c`.
    fn bytes(c: u32, b: &[u8]) -> u32;
}

/// The `crc32c` crate (CPUs without SSE 4.2, other architectures, and the shift table).
struct Sw;

impl CrcRegister for Sw {
    #[inline(always)]
    fn word(c: u32, w: u64) -> u32 {
        !crc32c::crc32c_append(!c, &w.to_ne_bytes())
    }

    #[inline(always)]
    fn bytes(c: u32, b: &[u8]) -> u32 {
        !crc32c::crc32c_append(!c, b)
    }
}

/// The CRC32 instruction. Only used inside [`Region::crc_hw`], which runs only after the CPU
/// was found to have SSE 4.2, and whose `#[target_feature]` lets these inline.
#[cfg(target_arch = "x86_64")]
struct Hw;

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
impl CrcRegister for Hw {
    #[inline(always)]
    fn word(c: u32, w: u64) -> u32 {
        // The word's bytes in memory order are its little-endian bytes.
        let w = u64::from_le_bytes(w.to_ne_bytes());
        // SAFETY: the instruction needs SSE 4.2, which the CPU has: `Hw` is used only by
        // `Region::crc_hw`, called after `softwarp_wire::crc::backend()` found it.
        unsafe { std::arch::x86_64::_mm_crc32_u64(u64::from(c), w) as u32 }
    }

    #[inline(always)]
    fn bytes(mut c: u32, b: &[u8]) -> u32 {
        for &x in b {
            // SAFETY: as in `word`.
            c = unsafe { std::arch::x86_64::_mm_crc32_u8(c, x) };
        }
        c
    }
}

/// [`Hw`] plus the folding path for long word runs ([`Region::crc_words_folding`]): used by
/// [`Region::crc_hw`] only when [`folding_available`] says the CPU has what it needs.
#[cfg(target_arch = "x86_64")]
struct HwFold;

#[cfg(target_arch = "x86_64")]
impl CrcRegister for HwFold {
    const FOLDS: bool = true;

    #[inline(always)]
    fn word(c: u32, w: u64) -> u32 {
        Hw::word(c, w)
    }

    #[inline(always)]
    fn bytes(c: u32, b: &[u8]) -> u32 {
        Hw::bytes(c, b)
    }
}

/// True when the CPU has what [`Region::crc_words_folding`] needs (AVX-512F and
/// VPCLMULQDQ; SSE 4.2 is checked before [`Region::crc_hw`] runs), asked at run time whatever
/// flags the program was built with (the standard library caches the answer). Never under
/// Miri, which cannot run that function's `asm!` loads.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn folding_available() -> bool {
    !cfg!(miri)
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("vpclmulqdq")
}

/// Bytes per round of [`Region::crc_words_folding`]: four 64-byte vectors.
#[cfg(target_arch = "x86_64")]
const FOLD_ROUND: usize = 256;

/// Word runs at least this long take [`Region::crc_words_folding`]: one round already
/// beats the three-stream CRC32-instruction loop (`examples/crc_speed`, 256-byte region
/// CRC, best of five: 11.7 GB/s folding, 7.8 GB/s without; BENCHMARKS.md, issue 18).
#[cfg(target_arch = "x86_64")]
const REGION_FOLDING_MIN: usize = FOLD_ROUND;

/// CRC32c's polynomial without its `x^32` term, normal (not reflected) bit order.
#[cfg(target_arch = "x86_64")]
const CRC32C_POLY: u64 = 0x1_1EDC_6F41;

/// `x^n mod P` (CRC32c's polynomial), bit-reflected into 64 bits as the carry-less multiply
/// of the reflected CRC takes it: bit `j` is the coefficient of `x^(63-j)`.
#[cfg(target_arch = "x86_64")]
const fn xpow_mod_reflected(n: u32) -> u64 {
    let mut r: u64 = 1;
    let mut i = 0;
    while i < n {
        r <<= 1;
        if r & (1 << 32) != 0 {
            r ^= CRC32C_POLY;
        }
        i += 1;
    }
    r.reverse_bits()
}

/// The two multipliers that move a 16-byte lane `bits` bits further along the message
/// (`V · x^bits mod P`), for its low and its high quadword. In reflected order the low
/// quadword (first in memory) holds `L · x^64` and the high one `H`, and a carry-less
/// product of two reflected 64-bit values reads as the polynomial product times `x`, hence
/// `x^(bits+63)` and `x^(bits-1)`.
#[cfg(target_arch = "x86_64")]
const fn fold_keys(bits: u32) -> [u64; 2] {
    [xpow_mod_reflected(bits + 63), xpow_mod_reflected(bits - 1)]
}

/// Keys of [`Region::crc_words_folding`], computed at compile time: one round forward.
#[cfg(target_arch = "x86_64")]
const KEYS_ROUND: [u64; 2] = fold_keys(8 * FOLD_ROUND as u32);
/// One 64-byte vector forward.
#[cfg(target_arch = "x86_64")]
const KEYS_VECTOR: [u64; 2] = fold_keys(8 * 64);
/// A vector's first three lanes onto its last: 48, 32 and 16 bytes forward.
#[cfg(target_arch = "x86_64")]
const KEYS_LANES: [[u64; 2]; 3] = [fold_keys(8 * 48), fold_keys(8 * 32), fold_keys(8 * 16)];

impl Region {
    /// Continues a CRC32c computation over `len` bytes at `offset` (the engine's on-the-fly
    /// MPA CRC over placed or transmitted payload), from the standard CRC32c value `crc`.
    ///
    /// The bytes are never read through a slice (module docs). With AVX-512F and VPCLMULQDQ
    /// (asked at run time), aligned word runs of 256 bytes and more are folded by carry-less
    /// multiplication over `asm!` vector loads ([`Region::crc_words_folding`], as fast as
    /// `crc_fast` over a slice); otherwise each atomically loaded word goes straight into the
    /// CRC32 instruction, three interleaved streams from 768 bytes on; the unaligned ends and
    /// a raw region's byte units go one piece at a time.
    #[inline]
    pub fn crc32c_append(&self, crc: u32, offset: usize, len: usize) -> Result<u32, MemoryError> {
        self.check(offset, len)?;
        #[cfg(target_arch = "x86_64")]
        if softwarp_wire::crc::backend() == softwarp_wire::crc::Backend::Sse42 {
            // SAFETY: `crc_hw` needs SSE 4.2, which the CPU was just found to have.
            #[allow(unsafe_code)]
            return Ok(unsafe { self.crc_hw(crc, offset, len) });
        }
        Ok(self.crc_with::<Sw>(crc, offset, len))
    }

    /// [`Region::crc_with`] with the CRC32 instruction, compiled for SSE 4.2.
    ///
    /// # Safety
    /// The CPU must support SSE 4.2.
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    #[target_feature(enable = "sse4.2")]
    unsafe fn crc_hw(&self, crc: u32, offset: usize, len: usize) -> u32 {
        if folding_available() {
            self.crc_with::<HwFold>(crc, offset, len)
        } else {
            self.crc_with::<Hw>(crc, offset, len)
        }
    }

    /// The CRC32c value `crc` continued over the (checked) range: aligned words through
    /// [`Region::crc_words`], the unaligned ends through [`Region::crc_pieces`].
    #[inline(always)]
    fn crc_with<R: CrcRegister>(&self, crc: u32, offset: usize, len: usize) -> u32 {
        let end = offset + len;
        let (w0, w1) = self.words;
        // The aligned words of the range: [first, last).
        let first = if offset <= w0 {
            w0
        } else {
            w0 + (offset - w0).next_multiple_of(WORD)
        };
        let limit = end.min(w1);
        let last = if first < limit {
            first + (limit - first) / WORD * WORD
        } else {
            first
        };
        let mut c = !crc;
        if first >= last {
            return !self.crc_pieces::<R>(c, offset, len);
        }
        if first > offset {
            c = self.crc_pieces::<R>(c, offset, first - offset);
        }
        c = self.crc_words_any::<R>(c, first, last);
        if end > last {
            if end <= w1 {
                // The start of one more word (the common tail).
                let b = self.word(last).load(Relaxed).to_ne_bytes();
                c = R::bytes(c, &b[..end - last]);
            } else {
                c = self.crc_pieces::<R>(c, last, end - last);
            }
        }
        !c
    }

    /// The raw CRC register `c` continued over `len` bytes at `offset` through
    /// [`Region::load_each`] (unaligned ends, byte units): off the common path.
    #[inline(never)]
    fn crc_pieces<R: CrcRegister>(&self, mut c: u32, offset: usize, len: usize) -> u32 {
        self.load_each(offset, len, |piece| {
            c = match piece {
                Piece::Word(w) => R::word(c, w),
                Piece::Part(b, n) => R::bytes(c, &b[..n]),
            }
        });
        c
    }

    /// The raw CRC register `c` continued over the words at offsets `[at, end)` (both word
    /// boundaries of the word range): long runs through [`Region::crc_words_folding`] when
    /// `R` folds, the rest through [`Region::crc_words`].
    #[inline(always)]
    fn crc_words_any<R: CrcRegister>(&self, c: u32, at: usize, end: usize) -> u32 {
        #[cfg(target_arch = "x86_64")]
        if R::FOLDS && end - at >= REGION_FOLDING_MIN {
            // SAFETY: `R::FOLDS` is only true for `HwFold`, used after `folding_available()`
            // and the SSE 4.2 check found what the function needs.
            #[allow(unsafe_code)]
            return unsafe { self.crc_words_folding(c, at, end) };
        }
        self.crc_words::<R>(c, at, end)
    }

    /// The raw CRC register `c` continued over the words at offsets `[at, end)` (both word
    /// boundaries of the word range, at least [`FOLD_ROUND`] bytes apart) by carry-less
    /// multiplication, then the last `(end - at) % FOLD_ROUND` bytes by [`Region::crc_words`].
    ///
    /// Four 64-byte accumulators (16 lanes of 16 bytes) each fold 256 bytes forward per round
    /// (VPCLMULQDQ) onto the next 256 bytes; at the end they fold into one 16-byte lane `V`
    /// whose CRC from a zero register (two CRC32 instructions) is the register over the whole
    /// run: the incoming register is XORed into the first four bytes, which is how a CRC
    /// starts from a non-zero register.
    ///
    /// The region bytes are loaded by `vmovdqu64` inside `asm!` blocks, not by Rust code: an
    /// asm block's memory access is not a Rust access, so no reference over region bytes
    /// exists and the compiler assumes nothing about them (as with the kernel's `readv`
    /// into the same bytes, module docs). Each load reads eight whole aligned words of the
    /// word range, the region's access unit for those bytes; a racing writer makes the
    /// result a mix of old and new bytes, the verbs contract of the module docs.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, VPCLMULQDQ and SSE 4.2 ([`folding_available`] and
    /// `softwarp_wire::crc::backend`).
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    #[target_feature(enable = "avx512f,vpclmulqdq,sse4.2")]
    #[inline(never)]
    unsafe fn crc_words_folding(&self, c: u32, at: usize, end: usize) -> u32 {
        use std::arch::x86_64::*;
        debug_assert!(
            at >= self.words.0
                && end <= self.words.1
                && (at - self.words.0).is_multiple_of(WORD)
                && (end - at).is_multiple_of(WORD)
                && end - at >= FOLD_ROUND
        );
        /// 64 bytes at offset `$off` from the region's base pointer `$base`.
        macro_rules! load {
            ($base:expr, $off:expr) => {{
                let v: __m512i;
                // SAFETY: `$off..$off + 64` is eight words of the word range (the loop
                // bounds below: `at`, `end` are word boundaries of it), memory the region
                // keeps valid for its lifetime; the block only reads those 64 bytes
                // (`readonly`, an unaligned load is allowed) and writes only `v`.
                unsafe {
                    std::arch::asm!(
                        "vmovdqu64 {v}, [{p}]",
                        v = lateout(zmm_reg) v,
                        p = in(reg) $base.wrapping_add($off),
                        options(readonly, nostack, preserves_flags),
                    );
                }
                v
            }};
        }
        /// `$x` (16-byte lanes) moved forward by the lanes' keys `$k`.
        macro_rules! fold {
            ($x:expr, $k:expr) => {
                _mm512_xor_si512(
                    _mm512_clmulepi64_epi128::<0x00>($x, $k),
                    _mm512_clmulepi64_epi128::<0x11>($x, $k),
                )
            };
        }
        let keys = |k: [u64; 2]| _mm512_broadcast_i32x4(_mm_set_epi64x(k[1] as i64, k[0] as i64));
        let base = self.ptr.as_ptr().cast_const();
        let stop = at + (end - at) / FOLD_ROUND * FOLD_ROUND;
        let mut x0 = _mm512_xor_si512(
            load!(base, at),
            _mm512_castsi128_si512(_mm_cvtsi32_si128(c as i32)),
        );
        let mut x1 = load!(base, at + 64);
        let mut x2 = load!(base, at + 128);
        let mut x3 = load!(base, at + 192);
        let mut p = at + FOLD_ROUND;
        let k_round = keys(KEYS_ROUND);
        while p < stop {
            x0 = _mm512_xor_si512(fold!(x0, k_round), load!(base, p));
            x1 = _mm512_xor_si512(fold!(x1, k_round), load!(base, p + 64));
            x2 = _mm512_xor_si512(fold!(x2, k_round), load!(base, p + 128));
            x3 = _mm512_xor_si512(fold!(x3, k_round), load!(base, p + 192));
            p += FOLD_ROUND;
        }
        // Four vectors into one (each 64 bytes before the next), then its four lanes into
        // the last (48, 32 and 16 bytes before it; the last lane's keys are zero).
        let k_vec = keys(KEYS_VECTOR);
        let x = _mm512_xor_si512(fold!(x0, k_vec), x1);
        let x = _mm512_xor_si512(fold!(x, k_vec), x2);
        let x = _mm512_xor_si512(fold!(x, k_vec), x3);
        let [[a0, a1], [b0, b1], [c0, c1]] = KEYS_LANES;
        let k_lanes = _mm512_set_epi64(
            0, 0, c1 as i64, c0 as i64, b1 as i64, b0 as i64, a1 as i64, a0 as i64,
        );
        let y = fold!(x, k_lanes);
        let v = _mm_xor_si128(
            _mm_xor_si128(_mm512_castsi512_si128(y), _mm512_extracti32x4_epi32::<1>(y)),
            _mm_xor_si128(
                _mm512_extracti32x4_epi32::<2>(y),
                _mm512_extracti32x4_epi32::<3>(x),
            ),
        );
        let lo = _mm_cvtsi128_si64(v) as u64;
        let hi = _mm_extract_epi64::<1>(v) as u64;
        let c = _mm_crc32_u64(_mm_crc32_u64(0, lo), hi) as u32;
        self.crc_words::<Hw>(c, stop, end)
    }

    /// The raw CRC register `c` continued over the words at offsets `[at, end)` (both word
    /// boundaries of the word range) with the CRC32 instruction. Runs of [`CRC_ROUND`] bytes go through three
    /// independent CRC streams (the CRC32 instruction's latency is three times its
    /// throughput), joined by [`crc_shift`]; the rest one word at a time.
    #[inline(always)]
    fn crc_words<R: CrcRegister>(&self, mut c: u32, mut at: usize, end: usize) -> u32 {
        if end - at >= CRC_ROUND {
            let shift = crc_shift_table();
            while end - at >= CRC_ROUND {
                let (mut x, mut y, mut z) = (c, 0u32, 0u32);
                let mut i = at;
                while i < at + CRC_STREAM {
                    x = R::word(x, self.word(i).load(Relaxed));
                    y = R::word(y, self.word(i + CRC_STREAM).load(Relaxed));
                    z = R::word(z, self.word(i + 2 * CRC_STREAM).load(Relaxed));
                    i += WORD;
                }
                c = crc_shift(shift, crc_shift(shift, x) ^ y) ^ z;
                at += CRC_ROUND;
            }
        }
        while at < end {
            c = R::word(c, self.word(at).load(Relaxed));
            at += WORD;
        }
        c
    }
}

/// Bytes per stream of one round of [`Region::crc_words`].
const CRC_STREAM: usize = 256;
/// Bytes per round of [`Region::crc_words`]: three streams.
const CRC_ROUND: usize = 3 * CRC_STREAM;

/// `SHIFT[i][b]` is the raw CRC register `b << 8i` continued over [`CRC_STREAM`] zero bytes.
type ShiftTable = [[u32; 256]; 4];

/// The table of [`crc_shift`], computed once.
fn crc_shift_table() -> &'static ShiftTable {
    static TABLE: std::sync::OnceLock<Box<ShiftTable>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = Box::new([[0u32; 256]; 4]);
        for (i, row) in t.iter_mut().enumerate() {
            for (b, entry) in row.iter_mut().enumerate() {
                let mut r = (b as u32) << (8 * i);
                for _ in 0..CRC_STREAM / WORD {
                    r = Sw::word(r, 0);
                }
                *entry = r;
            }
        }
        t
    })
}

/// The raw CRC register `r` continued over [`CRC_STREAM`] zero bytes (`r · x^(8·256) mod P`).
/// The register update is linear, so this is the XOR of the four bytes' table entries; and
/// the register after `A ‖ B` is `shift(register after A) ^ (register of B from 0)` when `B`
/// is [`CRC_STREAM`] bytes long.
#[inline(always)]
fn crc_shift(t: &ShiftTable, r: u32) -> u32 {
    t[0][(r & 0xff) as usize]
        ^ t[1][((r >> 8) & 0xff) as usize]
        ^ t[2][((r >> 16) & 0xff) as usize]
        ^ t[3][(r >> 24) as usize]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::tests::{pattern, raw_at};

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

    /// Lengths the CRC tests cover: all of 0..600 natively, a sample under Miri (slow), and
    /// lengths around the three-stream rounds (`CRC_ROUND`).
    fn crc_lengths() -> Vec<usize> {
        let mut v: Vec<usize> = if cfg!(miri) {
            vec![0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 511, 512, 513, 600]
        } else {
            (0..=600).collect()
        };
        v.extend([
            CRC_ROUND - 1,
            CRC_ROUND,
            CRC_ROUND + 1,
            CRC_ROUND + 8,
            2 * CRC_ROUND + 13,
            3000,
        ]);
        v
    }

    #[test]
    fn both_crc_registers_give_the_copys_crc_whichever_the_cpu_chooses() {
        // `crc32c_append` takes the CRC32 instruction on this CPU; the crate's path is what a
        // CPU without SSE 4.2 takes. Both over the same ranges, against a copy.
        let data = pattern(2000, 3);
        let r = Region::new_zeroed(2000).unwrap();
        r.write_at(0, &data).unwrap();
        for offset in [0, 1, 7, 8, 13] {
            for len in [0, 1, 7, 8, 9, 100, 767, 768, 769, 1600] {
                if offset + len > data.len() {
                    continue;
                }
                let want = crc32c::crc32c_append(7, &data[offset..offset + len]);
                assert_eq!(r.crc_with::<Sw>(7, offset, len), want, "{offset} {len}");
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("sse4.2") {
                    // SAFETY: the CPU has SSE 4.2 (just checked).
                    #[allow(unsafe_code)]
                    let hw = unsafe { r.crc_hw(7, offset, len) };
                    assert_eq!(hw, want, "{offset} {len}");
                }
            }
        }
    }

    /// True (after printing why) when this CPU cannot run the folding path, so a test of it
    /// must skip.
    #[cfg(target_arch = "x86_64")]
    fn folding_unavailable() -> bool {
        let ok = folding_available() && std::arch::is_x86_feature_detected!("sse4.2");
        if !ok {
            eprintln!("skipped: the CPU lacks AVX-512F, VPCLMULQDQ or SSE 4.2 (or Miri runs)");
        }
        !ok
    }

    /// A small deterministic generator (xorshift64) for offsets and lengths.
    fn xorshift(s: &mut u64) -> u64 {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        *s
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn folding_crc_matches_crc32c_for_every_length_to_4096_at_every_offset_mod_64() {
        // (Also what keeps this test out of the Miri run: `folding_available` is false there.)
        if folding_unavailable() {
            return;
        }
        let data = pattern(4096 + 64, 5);
        let r = Region::new_zeroed(data.len()).unwrap();
        r.write_at(0, &data).unwrap();
        for len in 0..=4096 {
            // Every byte alignment and every word of a 64-byte vector, in turn.
            let offset = (len * 9) % 64;
            let start = 0x9e37_79b9;
            let want = crc32c::crc32c_append(start, &data[offset..offset + len]);
            let fold = r.crc_with::<HwFold>(start, offset, len);
            assert_eq!(fold, want, "offset {offset} len {len}");
            // The three-stream CRC32-instruction path over the same range (a CPU without
            // AVX-512 takes it), every 7th length to keep the test fast.
            if len % 7 == 0 {
                assert_eq!(
                    r.crc_with::<Hw>(start, offset, len),
                    want,
                    "hw {offset} {len}"
                );
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn folding_crc_matches_crc32c_over_large_random_ranges_of_owned_and_raw_regions() {
        if folding_unavailable() {
            return;
        }
        const LEN: usize = (1 << 20) + 77;
        let data = pattern(LEN, 11);
        let owned = Region::new_zeroed(LEN).unwrap();
        owned.write_at(0, &data).unwrap();
        let mut backing = vec![0u64; LEN / 8 + 2];
        let raw = raw_at(&mut backing, 3, LEN);
        raw.write_at(0, &data).unwrap();
        let mut seed = 0x2545_f491_4f6c_dd1d;
        for round in 0..24 {
            let len = if round < 4 {
                LEN - round // the whole region and nearly
            } else {
                (xorshift(&mut seed) % (LEN as u64 / 2)) as usize
            };
            let offset = (xorshift(&mut seed) % (LEN - len + 1) as u64) as usize;
            let start = xorshift(&mut seed) as u32;
            let want = crc32c::crc32c_append(start, &data[offset..offset + len]);
            for (name, r) in [("owned", &owned), ("raw", &raw)] {
                assert_eq!(
                    r.crc_with::<HwFold>(start, offset, len),
                    want,
                    "{name} offset {offset} len {len}"
                );
                assert_eq!(
                    r.crc32c_append(start, offset, len).unwrap(),
                    want,
                    "{name} offset {offset} len {len}"
                );
            }
        }
        drop(raw);
    }

    #[test]
    fn crc_over_region_equals_crc_over_copy_for_unaligned_offsets_and_lengths_0_to_600_and_more() {
        let data = pattern(3100, 1);
        let owned = Region::new_zeroed(3100).unwrap();
        owned.write_at(0, &data).unwrap();
        for offset in [0, 1, 3, 7, 8, 9, 13, 64, 95] {
            for &len in &crc_lengths() {
                if offset + len > data.len() {
                    continue;
                }
                let copy = &data[offset..offset + len];
                let want = crc32c::crc32c(copy);
                assert_eq!(
                    owned.crc32c_append(0, offset, len).unwrap(),
                    want,
                    "owned, offset {offset}, len {len}"
                );
                // Continuing from a non-zero CRC, too.
                assert_eq!(
                    owned.crc32c_append(0x1234_5678, offset, len).unwrap(),
                    crc32c::crc32c_append(0x1234_5678, copy),
                    "owned, continued, offset {offset}, len {len}"
                );
            }
        }
        // Raw regions at every misalignment of their base: bytes at the ends are accessed as
        // `AtomicU8`, the rest as words.
        for misalign in 0..8 {
            let mut backing = vec![0u64; 3100 / 8 + 2];
            let raw = raw_at(&mut backing, misalign, 3100);
            raw.write_at(0, &data).unwrap();
            for offset in [0, 1, 5, 8, 11] {
                for &len in &crc_lengths() {
                    if offset + len > data.len() {
                        continue;
                    }
                    assert_eq!(
                        raw.crc32c_append(0, offset, len).unwrap(),
                        crc32c::crc32c(&data[offset..offset + len]),
                        "raw misaligned by {misalign}, offset {offset}, len {len}"
                    );
                }
            }
            assert!(raw.crc32c_append(0, 1, 3100).is_err());
        }
        assert!(owned.crc32c_append(0, 0, 3101).is_err());
        assert!(owned.crc32c_append(0, usize::MAX, 2).is_err());
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
