//! CRC32c as MPA uses it (RFC 5044 section 4.4, RFC 3720 section 12.1 and appendix B.4).
//!
//! MPA protects each FPDU with the same CRC as iSCSI: CRC32c (Castagnoli polynomial
//! 0x1EDC6F41, reflected, initial value and final XOR all ones). This module computes it with
//! the `crc32c` crate, which uses the CPU's CRC32 instructions (SSE 4.2, ARMv8) when present, or
//! for short inputs its own loop of the CRC32 instruction (chosen at run time, [`backend`]), and
//! it can do so over gathered slices (length field, ULPDU slices, pad) without copying them
//! together first.
//!
//! The module never does I/O and never allocates; nothing in it can panic.
//!
//! # Byte order on the wire
//!
//! We call the *standard* CRC32c value the number that `crc32c("123456789") == 0xE3069283`
//! defines (the value every CRC32c library returns). The four CRC bytes of an FPDU are the
//! **little-endian** bytes of that value: [`to_wire`] / [`from_wire`].
//!
//! Decision and evidence: RFC 5044 takes its CRC from iSCSI, and RFC 3720 appendix B.4 lists
//! its test vectors as the bytes that go on the wire. For 32 zero bytes it gives `aa 36 91 8a`,
//! which are the little-endian bytes of the standard value `0x8a9136aa`. Real traffic agrees:
//! Linux `siw` with CRC on sends `39 8e 29 83` for an FPDU whose standard CRC32c is `0x83298e39`
//! (frame 8 of `siw-crc-rping.pcap`, a KAT below), and Wireshark's MPA dissector marks that CRC
//! good. So "little-endian bytes of the standard value" is what the RFC's own vectors, siw and
//! Wireshark all mean; writing the standard value big-endian would break interop.

/// Length of the CRC field of an FPDU, in bytes.
pub const CRC_LEN: usize = 4;

/// A running CRC32c over data fed in pieces (gathered slices).
///
/// ```
/// use softwarp_wire::crc::{crc32c, Crc32c};
/// let mut crc = Crc32c::new();
/// crc.update(b"1234");
/// crc.update(b"56789");
/// assert_eq!(crc.finish(), crc32c(b"123456789"));
/// assert_eq!(crc.finish(), 0xe306_9283);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Crc32c {
    /// The standard CRC32c value of everything fed so far (0 for no data).
    value: u32,
}

impl Crc32c {
    /// A CRC over no data yet.
    pub const fn new() -> Self {
        Crc32c { value: 0 }
    }

    /// Feeds the next piece of data.
    pub fn update(&mut self, data: &[u8]) {
        self.value = crc32c_append(self.value, data);
    }

    /// Feeds several pieces in order, as if they were one contiguous buffer.
    pub fn update_slices(&mut self, slices: &[&[u8]]) {
        for slice in slices {
            self.update(slice);
        }
    }

    /// The standard CRC32c value of everything fed so far. Does not reset the state, so more
    /// data may be fed afterwards.
    pub const fn finish(&self) -> u32 {
        self.value
    }

    /// The CRC of everything fed so far as the 4 bytes that go on the wire (see [`to_wire`]).
    pub const fn finish_wire(&self) -> [u8; CRC_LEN] {
        to_wire(self.value)
    }
}

/// The standard CRC32c value of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c_append(0, data)
}

/// Inputs shorter than this take [`crc32c_append`]'s short loop when the CPU has SSE 4.2.
pub const SHORT_INPUT: usize = 512;

/// Which implementation [`crc32c_append`] uses for inputs under [`SHORT_INPUT`] bytes, as
/// chosen at run time for this CPU ([`backend`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// A plain loop of the CRC32 instruction (x86-64 with SSE 4.2, detected at run time or
    /// enabled by the build).
    Sse42,
    /// The `crc32c` crate (which itself uses the CPU's CRC instructions when it detects
    /// them, after a longer set-up).
    Crate,
}

impl Backend {
    /// The backend's name: `sse4.2` or `crc32c-crate`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Backend::Sse42 => "sse4.2",
            Backend::Crate => "crc32c-crate",
        }
    }
}

impl core::fmt::Display for Backend {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The implementation [`crc32c_append`] uses for short inputs on this CPU. The CPU is asked
/// once (`std::arch::is_x86_feature_detected!`) and the answer cached in a static atomic; a
/// build with
/// `-C target-feature=+sse4.2` (the workspace's `.cargo/config.toml`) needs no question.
pub fn backend() -> Backend {
    if sse42::available() {
        Backend::Sse42
    } else {
        Backend::Crate
    }
}

/// The standard CRC32c value of the data whose value is `crc` followed by `data`.
///
/// Small FPDUs (a 64-byte Send is 88 bytes on the wire) are the common case of message-rate
/// work, and at that size the `crc32c` crate's set-up costs more than the CRC itself: a CPU
/// feature check, byte-wise alignment of both ends and its three-way interleaving scaffold,
/// about 150 instructions for 84 bytes. When the CPU has SSE 4.2 (found at run time, so
/// whatever flags the program was built with; see [`backend`]), inputs under
/// [`SHORT_INPUT`] bytes go through a plain loop of the CRC32 instruction instead: 8 bytes a
/// step, then 4, then single bytes. Other CPUs and longer inputs use the crate, which
/// interleaves three streams and wins there. Both give the same value (unit-tested and
/// proptested against the crate).
///
/// Inlined into its callers (a length test, a relaxed load and a call); the other path is a
/// function of its own.
#[inline(always)]
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    if data.len() < SHORT_INPUT {
        if let Some(v) = sse42::append(crc, data) {
            return v;
        }
    }
    crate_append(crc, data)
}

#[inline(never)]
fn crate_append(crc: u32, data: &[u8]) -> u32 {
    crc32c::crc32c_append(crc, data)
}

/// The CRC32 instruction behind a run-time CPU check: the one `unsafe` block of this crate,
/// calling a `#[target_feature(enable = "sse4.2")]` function after the CPU was found to have
/// the feature.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod sse42 {
    use std::arch::x86_64::{_mm_crc32_u32, _mm_crc32_u64, _mm_crc32_u8};
    use std::sync::atomic::{AtomicU8, Ordering};

    /// [`DETECTED`] before the first question.
    const UNKNOWN: u8 = 0;
    /// The CPU has SSE 4.2.
    const YES: u8 = 1;
    /// It has not.
    const NO: u8 = 2;
    /// The CPU's answer, asked once ([`detect`]).
    static DETECTED: AtomicU8 = AtomicU8::new(UNKNOWN);

    /// Whether the CPU has SSE 4.2: a constant when the build enables it, otherwise one
    /// relaxed load of the cached answer (the first call asks the CPU). Inlined: it runs
    /// twice per small message.
    #[inline(always)]
    pub(super) fn available() -> bool {
        if cfg!(target_feature = "sse4.2") {
            return true;
        }
        match DETECTED.load(Ordering::Relaxed) {
            YES => true,
            NO => false,
            _ => detect(),
        }
    }

    /// Asks the CPU and caches the answer (threads racing here store the same value).
    #[cold]
    #[inline(never)]
    fn detect() -> bool {
        let yes = std::arch::is_x86_feature_detected!("sse4.2");
        DETECTED.store(if yes { YES } else { NO }, Ordering::Relaxed);
        yes
    }

    /// CRC32c of `data` continuing from the standard value `crc`, or `None` when the CPU
    /// lacks the instruction.
    #[inline(always)]
    pub(super) fn append(crc: u32, data: &[u8]) -> Option<u32> {
        if !available() {
            return None;
        }
        // SAFETY: `append_sse42` only needs the CPU to support SSE 4.2 (it touches no
        // memory but `data`'s, through safe slice code), and `available()` just found that
        // it does.
        Some(unsafe { append_sse42(crc, data) })
    }

    #[target_feature(enable = "sse4.2")]
    fn append_sse42(crc: u32, data: &[u8]) -> u32 {
        let (words, rest) = data.as_chunks::<8>();
        let mut c = u64::from(!crc);
        for w in words {
            c = _mm_crc32_u64(c, u64::from_le_bytes(*w));
        }
        // The instruction leaves the 32-bit register zero-extended.
        let mut c = c as u32;
        let (quads, bytes) = rest.as_chunks::<4>();
        for q in quads {
            c = _mm_crc32_u32(c, u32::from_le_bytes(*q));
        }
        for &b in bytes {
            c = _mm_crc32_u8(c, b);
        }
        !c
    }
}

/// Other architectures: the `crc32c` crate always (it uses ARMv8's CRC instructions when it
/// detects them).
#[cfg(not(target_arch = "x86_64"))]
mod sse42 {
    #[inline]
    pub(super) fn available() -> bool {
        false
    }

    #[inline]
    pub(super) fn append(_crc: u32, _data: &[u8]) -> Option<u32> {
        None
    }
}

/// The standard CRC32c value of the concatenation of `slices`, without copying them together.
pub fn crc32c_slices(slices: &[&[u8]]) -> u32 {
    let mut crc = Crc32c::new();
    crc.update_slices(slices);
    crc.finish()
}

/// The 4 bytes an FPDU carries for the standard CRC32c value `crc`: its little-endian bytes
/// (see the module documentation for why).
pub const fn to_wire(crc: u32) -> [u8; CRC_LEN] {
    crc.to_le_bytes()
}

/// The standard CRC32c value that the 4 CRC bytes of an FPDU stand for (inverse of
/// [`to_wire`]).
pub const fn from_wire(bytes: [u8; CRC_LEN]) -> u32 {
    u32::from_le_bytes(bytes)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    // RFC 3720 appendix B.4 lists each vector's CRC as wire bytes; the comments give them, the
    // constants are the standard values (their little-endian reading).

    #[test]
    fn rfc3720_b4_32_zero_bytes() {
        // CRC: aa 36 91 8a
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(to_wire(crc32c(&[0u8; 32])), [0xaa, 0x36, 0x91, 0x8a]);
    }

    #[test]
    fn rfc3720_b4_32_ones_bytes() {
        // CRC: 43 ab a8 62
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43);
        assert_eq!(to_wire(0x62a8_ab43), [0x43, 0xab, 0xa8, 0x62]);
    }

    #[test]
    fn rfc3720_b4_32_incrementing_bytes() {
        // CRC: 4e 79 dd 46
        let data: [u8; 32] = core::array::from_fn(|i| i as u8);
        assert_eq!(crc32c(&data), 0x46dd_794e);
    }

    #[test]
    fn rfc3720_b4_32_decrementing_bytes() {
        // CRC: 5c db 3f 11
        let data: [u8; 32] = core::array::from_fn(|i| 31 - i as u8);
        assert_eq!(crc32c(&data), 0x113f_db5c);
    }

    #[test]
    fn rfc3720_b4_iscsi_read_command_pdu() {
        // An iSCSI SCSI Read (10) command PDU; CRC: 56 3a 96 d9
        let pdu: [u8; 48] = [
            0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, //
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, //
            0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00, //
            0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x18, //
            0x28, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, //
            0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, //
        ];
        assert_eq!(crc32c(&pdu), 0xd996_3a56);
        assert_eq!(to_wire(crc32c(&pdu)), [0x56, 0x3a, 0x96, 0xd9]);
    }

    #[test]
    fn check_value_of_the_crc32c_catalogue() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn siw_crc_rping_frame_8_send_fpdu_crc_is_little_endian_standard_value() {
        // TCP payload of frame 8 of siw-crc-rping.pcap (siw, CRC on): ULPDU_Length 0x0022,
        // an untagged Send (DDP/RDMAP header 18 bytes + 16 bytes payload), no pad, then CRC.
        let fpdu: [u8; 40] = [
            0x00, 0x22, 0x41, 0x43, 0x00, 0x00, 0x00, 0x00, //
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, //
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x55, 0x7c, //
            0x5c, 0x16, 0x64, 0x30, 0x6b, 0x8c, 0xee, 0x00, //
            0x00, 0x00, 0x00, 0x40, 0x39, 0x8e, 0x29, 0x83, //
        ];
        let (covered, field) = fpdu.split_at(36);
        assert_eq!(crc32c(covered), 0x8329_8e39);
        assert_eq!(field, to_wire(0x8329_8e39));
        assert_eq!(from_wire([0x39, 0x8e, 0x29, 0x83]), 0x8329_8e39);
    }

    #[test]
    fn streaming_over_gathered_slices_equals_one_shot() {
        let data: [u8; 100] = core::array::from_fn(|i| (i * 7) as u8);
        let (a, rest) = data.split_at(2);
        let (b, c) = rest.split_at(61);
        assert_eq!(crc32c_slices(&[a, b, &[], c]), crc32c(&data));
        let mut crc = Crc32c::new();
        crc.update(a);
        crc.update(b);
        crc.update(c);
        assert_eq!(crc.finish(), crc32c(&data));
        assert_eq!(crc.finish_wire(), to_wire(crc32c(&data)));
    }

    #[test]
    fn short_loop_equals_the_crate_at_every_length_offset_and_start() {
        let data: Vec<u8> = (0..SHORT_INPUT + 40).map(|i| (i * 131 + 7) as u8).collect();
        for start in [0u32, 1, 0xffff_ffff, 0x8329_8e39] {
            for off in 0..8 {
                for len in 0..data.len() - off {
                    let piece = &data[off..off + len];
                    assert_eq!(
                        crc32c_append(start, piece),
                        crc32c::crc32c_append(start, piece),
                        "start {start:#x} offset {off} length {len}"
                    );
                }
            }
        }
    }

    /// On an x86-64 CPU with SSE 4.2 the short loop is chosen whatever the build flags (the
    /// external test crate `tests-external/polite` checks it in a build without the
    /// workspace's flag).
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_crc32_instruction_is_chosen_when_the_cpu_has_it() {
        let expected = if std::arch::is_x86_feature_detected!("sse4.2") {
            Backend::Sse42
        } else {
            Backend::Crate
        };
        assert_eq!(backend(), expected);
        assert_eq!(backend().to_string(), expected.as_str());
    }

    #[test]
    fn empty_input_has_crc_zero() {
        assert_eq!(Crc32c::new().finish(), 0);
        assert_eq!(Crc32c::default(), Crc32c::new());
        assert_eq!(crc32c(&[]), 0);
        assert_eq!(crc32c_slices(&[]), 0);
    }
}
