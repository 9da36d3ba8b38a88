//! FPDU framing (RFC 5044 section 4): ULPDU_Length, ULPDU, pad, CRC.
//!
//! Pure codec: no I/O, no allocation, no panics on any input.
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |          ULPDU_Length         |                               |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+                               +
//! ~                ULPDU (a DDP segment)                          ~
//! |                               +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                               |     PAD (0-3 octets)          |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                       CRC (4 octets)                          |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! This module handles marker-free FPDUs; [`super::marker`] adds and removes markers.
//!
//! The CRC field is always present. With CRC in use it holds CRC32c over ULPDU_Length, ULPDU
//! and pad, as the little-endian bytes of the standard value ([`crate::crc`] explains why).
//! Without CRC it is sent as zeros (as siw does) and not checked on receipt.
//!
//! Pad bytes are written as zeros and ignored on receipt: siw sends stale pad bytes
//! (interop README, `siw-ib_*_bw.pcap` frames 15/16), and they are covered by the CRC anyway.
//!
//! Traceability: requirements are cited with `//=` links followed by plain-comment paraphrases
//! (the RFC text could not be retrieved while this was written); make them `//#` quotes when
//! the text is at hand.

use crate::crc::{self, Crc32c};
use crate::error::WireError;

/// Length of the ULPDU_Length field.
pub const HEADER_LEN: usize = 2;
/// Length of the CRC field.
pub const CRC_LEN: usize = crc::CRC_LEN;
/// The largest ULPDU the 16-bit ULPDU_Length can describe.
pub const MAX_ULPDU_LEN: usize = u16::MAX as usize;
/// The longest trailer (3 pad bytes and the CRC).
pub const MAX_TRAILER_LEN: usize = 3 + CRC_LEN;
/// The shortest marker-free FPDU (empty ULPDU: header, 2 pad bytes, CRC).
pub const MIN_FPDU_LEN: usize = fpdu_len(0);
/// The longest marker-free FPDU.
pub const MAX_FPDU_LEN: usize = fpdu_len(MAX_ULPDU_LEN);

const WHAT: &str = "FPDU";

/// Field offsets.
mod field {
    use core::ops::Range;

    pub const ULPDU_LENGTH: Range<usize> = 0..2;
    pub const ULPDU: usize = 2;
}

/// Pad bytes that follow a ULPDU of `ulpdu_len` bytes.
pub const fn pad_len(ulpdu_len: usize) -> usize {
    //= https://www.rfc-editor.org/rfc/rfc5044#section-4.2
    // (paraphrase) PAD is 0 to 3 octets that bring ULPDU_Length plus ULPDU plus pad to a
    // multiple of 4 octets.
    //
    // Wrapping is exact modulo 4 because 2^64 is a multiple of 4.
    (4 - ulpdu_len.wrapping_add(HEADER_LEN) % 4) % 4
}

/// Pad plus CRC: the bytes after the ULPDU.
pub const fn trailer_len(ulpdu_len: usize) -> usize {
    pad_len(ulpdu_len) + CRC_LEN
}

/// Total length of a marker-free FPDU carrying `ulpdu_len` bytes: header, ULPDU, pad, CRC.
/// Saturates instead of overflowing for absurd lengths.
pub const fn fpdu_len(ulpdu_len: usize) -> usize {
    ulpdu_len
        .saturating_add(HEADER_LEN)
        .saturating_add(trailer_len(ulpdu_len))
}

/// Stream framing: the total length of the (marker-free) FPDU that starts at `prefix`, read
/// from its first two bytes. [`WireError::Truncated`] while fewer than two bytes are there.
pub fn peek(prefix: &[u8]) -> Result<usize, WireError> {
    Ok(fpdu_len(usize::from(read_ulpdu_length(prefix)?)))
}

fn read_ulpdu_length(prefix: &[u8]) -> Result<u16, WireError> {
    let bytes: [u8; 2] = prefix
        .get(field::ULPDU_LENGTH)
        .and_then(|b| b.try_into().ok())
        .ok_or(WireError::Truncated {
            what: "FPDU header (ULPDU_Length)",
            need: HEADER_LEN,
            have: prefix.len(),
        })?;
    Ok(u16::from_be_bytes(bytes))
}

fn check_ulpdu_len(len: usize) -> Result<u16, WireError> {
    u16::try_from(len).map_err(|_| WireError::MpaUlpduTooLong {
        len,
        max: MAX_ULPDU_LEN,
    })
}

/// MULPDU, the largest ULPDU a sender may put in one FPDU, from the EMSS (the TCP maximum
/// segment size in force) so that each FPDU fits one TCP segment.
///
/// Without markers: `EMSS - (6 + EMSS mod 4)`. With markers:
/// `EMSS - (6 + 4 * ceil(EMSS / 512) + EMSS mod 4)`. 6 is ULPDU_Length plus CRC; the
/// `EMSS mod 4` term keeps the FPDU a multiple of 4 without pad; the marker term reserves room
/// for the most markers a segment of EMSS bytes can hold. The result saturates at 0 for
/// absurdly small EMSS and is capped at [`MAX_ULPDU_LEN`].
///
/// siw at MTU 1500 (EMSS 1448) without markers: 1442, i.e. 1448-byte FPDUs, as captured.
pub fn mulpdu(emss: usize, markers: bool) -> usize {
    //= https://www.rfc-editor.org/rfc/rfc5044#section-4.5
    // (paraphrase) The sender chooses MULPDU from the current EMSS with the formulas above, so
    // that a full FPDU, with markers when they are in use, fits in one TCP segment.
    let mut overhead = HEADER_LEN + CRC_LEN + emss % 4;
    if markers {
        overhead = overhead.saturating_add(
            super::marker::MARKER_LEN.saturating_mul(emss.div_ceil(super::marker::MARKER_INTERVAL)),
        );
    }
    emss.saturating_sub(overhead).min(MAX_ULPDU_LEN)
}

/// Writes the 2-byte FPDU header (ULPDU_Length) for a ULPDU of `ulpdu_len` bytes into `buf`;
/// returns 2. For senders that gather header, payload slices and trailer.
pub fn emit_header(ulpdu_len: usize, buf: &mut [u8]) -> Result<usize, WireError> {
    //= https://www.rfc-editor.org/rfc/rfc5044#section-4.1
    // (paraphrase) ULPDU_Length is the length of the ULPDU in octets: it counts neither
    // itself, nor pad, nor CRC, nor markers.
    let len = check_ulpdu_len(ulpdu_len)?;
    let have = buf.len();
    let out = buf
        .get_mut(field::ULPDU_LENGTH)
        .ok_or(WireError::BufferTooSmall {
            what: "FPDU header (ULPDU_Length)",
            need: HEADER_LEN,
            have,
        })?;
    out.copy_from_slice(&len.to_be_bytes());
    Ok(HEADER_LEN)
}

/// Total length of gathered slices, refusing more than a ULPDU can hold.
fn gathered_len(ulpdu: &[&[u8]]) -> Result<u16, WireError> {
    let total = ulpdu
        .iter()
        .fold(0usize, |acc, s| acc.saturating_add(s.len()));
    check_ulpdu_len(total)
}

/// The standard CRC32c value of the marker-free FPDU that carries the ULPDU made of the
/// `ulpdu` slices: over its ULPDU_Length, the slices and zero pad.
pub fn fpdu_crc(ulpdu: &[&[u8]]) -> Result<u32, WireError> {
    let len = gathered_len(ulpdu)?;
    let mut crc = Crc32c::new();
    crc.update(&len.to_be_bytes());
    crc.update_slices(ulpdu);
    crc.update(&[0u8; 3][..pad_len(usize::from(len))]);
    Ok(crc.finish())
}

/// Writes the trailer (zero pad, then CRC) of the FPDU whose ULPDU is the concatenation of the
/// `ulpdu` slices, and returns its length ([`trailer_len`]). With `use_crc` the CRC covers the
/// header this ULPDU implies, the slices and the pad; without, the CRC field is zero.
pub fn emit_trailer(ulpdu: &[&[u8]], use_crc: bool, buf: &mut [u8]) -> Result<usize, WireError> {
    let len = usize::from(gathered_len(ulpdu)?);
    let pad = pad_len(len);
    let need = pad + CRC_LEN;
    let have = buf.len();
    let out = buf.get_mut(..need).ok_or(WireError::BufferTooSmall {
        what: "FPDU trailer (pad and CRC)",
        need,
        have,
    })?;
    let crc = if use_crc { fpdu_crc(ulpdu)? } else { 0 };
    let (pad_bytes, crc_bytes) = out.split_at_mut(pad);
    //= https://www.rfc-editor.org/rfc/rfc5044#section-4.2
    // (paraphrase) The sender sets the pad octets to zero.
    pad_bytes.fill(0);
    crc_bytes.copy_from_slice(&crc::to_wire(crc));
    Ok(need)
}

/// Compares a CRC computed over a received FPDU (ULPDU_Length, ULPDU, pad as received) with
/// the FPDU's CRC field: [`WireError::MpaCrcMismatch`] when they differ. For receivers that
/// feed the pieces to a [`Crc32c`] as they read them.
pub fn check_crc(computed: u32, crc_field: [u8; CRC_LEN]) -> Result<(), WireError> {
    //= https://www.rfc-editor.org/rfc/rfc5044#section-4.4
    // (paraphrase) When CRC is in use the receiver computes CRC32c over the FPDU and treats a
    // mismatch with the CRC field as an error (the engine turns it into a Terminate).
    let received = crc::from_wire(crc_field);
    if received != computed {
        return Err(WireError::MpaCrcMismatch { received, computed });
    }
    Ok(())
}

/// A read/write view of a marker-free FPDU in a buffer.
///
/// After [`FpduPacket::new_checked`] the buffer holds the whole FPDU that ULPDU_Length
/// announces and every accessor is exact. With [`FpduPacket::new_unchecked`] accessors never
/// panic either, but read zeros or short slices where the buffer ends, and setters do nothing
/// there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FpduPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> FpduPacket<T> {
    /// Wraps a buffer without checking its length.
    pub const fn new_unchecked(buffer: T) -> Self {
        FpduPacket { buffer }
    }

    /// Wraps a buffer after checking it holds the whole FPDU ([`Self::check_len`]).
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let packet = Self::new_unchecked(buffer);
        packet.check_len()?;
        Ok(packet)
    }

    /// Checks that the buffer holds ULPDU_Length and the whole FPDU it announces. Bytes
    /// after the FPDU (the next FPDU) are allowed.
    pub fn check_len(&self) -> Result<(), WireError> {
        let buf = self.buffer.as_ref();
        let need = peek(buf)?;
        if buf.len() < need {
            return Err(WireError::Truncated {
                what: WHAT,
                need,
                have: buf.len(),
            });
        }
        Ok(())
    }

    /// Returns the underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The ULPDU_Length field.
    pub fn ulpdu_length(&self) -> u16 {
        read_ulpdu_length(self.buffer.as_ref()).unwrap_or(0)
    }

    /// Length of the whole FPDU: [`fpdu_len`] of ULPDU_Length.
    pub fn fpdu_len(&self) -> usize {
        fpdu_len(usize::from(self.ulpdu_length()))
    }

    fn ulpdu_end(&self) -> usize {
        field::ULPDU + usize::from(self.ulpdu_length())
    }

    fn crc_start(&self) -> usize {
        self.fpdu_len() - CRC_LEN
    }

    fn bytes(&self, range: core::ops::Range<usize>) -> &[u8] {
        let buf = self.buffer.as_ref();
        let end = range.end.min(buf.len());
        buf.get(range.start..end).unwrap_or_default()
    }

    /// The ULPDU (the DDP segment).
    pub fn ulpdu(&self) -> &[u8] {
        self.bytes(field::ULPDU..self.ulpdu_end())
    }

    /// The pad bytes as received (possibly non-zero; see the module docs).
    pub fn pad(&self) -> &[u8] {
        self.bytes(self.ulpdu_end()..self.crc_start())
    }

    /// The 4 bytes of the CRC field as they are on the wire.
    pub fn crc_field(&self) -> [u8; CRC_LEN] {
        let mut field = [0u8; CRC_LEN];
        let got = self.bytes(self.crc_start()..self.fpdu_len());
        if let Some(dst) = field.get_mut(..got.len()) {
            dst.copy_from_slice(got);
        }
        field
    }

    /// CRC32c over ULPDU_Length, ULPDU and pad as they are in the buffer.
    pub fn computed_crc(&self) -> u32 {
        crc::crc32c(self.bytes(0..self.crc_start()))
    }

    /// Checks the CRC field against [`Self::computed_crc`].
    pub fn check_crc(&self) -> Result<(), WireError> {
        check_crc(self.computed_crc(), self.crc_field())
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> FpduPacket<T> {
    /// Writes the ULPDU_Length field.
    pub fn set_ulpdu_length(&mut self, len: u16) {
        if let Some(b) = self.buffer.as_mut().get_mut(field::ULPDU_LENGTH) {
            b.copy_from_slice(&len.to_be_bytes());
        }
    }

    fn bytes_mut(&mut self, range: core::ops::Range<usize>) -> &mut [u8] {
        let buf = self.buffer.as_mut();
        let end = range.end.min(buf.len());
        buf.get_mut(range.start..end).unwrap_or_default()
    }

    /// The ULPDU, writable.
    pub fn ulpdu_mut(&mut self) -> &mut [u8] {
        let range = field::ULPDU..self.ulpdu_end();
        self.bytes_mut(range)
    }

    /// Sets the pad bytes to zero.
    pub fn clear_pad(&mut self) {
        let range = self.ulpdu_end()..self.crc_start();
        self.bytes_mut(range).fill(0);
    }

    /// Writes the CRC field: the CRC over ULPDU_Length, ULPDU and pad with `use_crc`, zeros
    /// without.
    pub fn fill_crc(&mut self, use_crc: bool) {
        let value = if use_crc { self.computed_crc() } else { 0 };
        let range = self.crc_start()..self.fpdu_len();
        let dst = self.bytes_mut(range);
        if let Some(src) = crc::to_wire(value).get(..dst.len()) {
            dst.copy_from_slice(src);
        }
    }
}

/// A marker-free FPDU, decoded: the ULPDU it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fpdu<'a> {
    /// The ULPDU (one DDP segment).
    pub ulpdu: &'a [u8],
}

impl<'a> Fpdu<'a> {
    /// Decodes the FPDU at the start of `buf` and returns it with its length; bytes after it
    /// (the next FPDU) are left alone. With `use_crc` the CRC is checked
    /// ([`WireError::MpaCrcMismatch`]); without, the CRC field is ignored. Pad bytes are
    /// ignored (apart from being covered by the CRC).
    pub fn parse(buf: &'a [u8], use_crc: bool) -> Result<(Self, usize), WireError> {
        let packet = FpduPacket::new_checked(buf)?;
        if use_crc {
            packet.check_crc()?;
        }
        let len = packet.fpdu_len();
        let ulpdu = buf
            .get(field::ULPDU..field::ULPDU + usize::from(packet.ulpdu_length()))
            .unwrap_or_default();
        Ok((Fpdu { ulpdu }, len))
    }

    /// Bytes [`Fpdu::emit`] writes: [`fpdu_len`] of the ULPDU length.
    pub fn buffer_len(&self) -> usize {
        fpdu_len(self.ulpdu.len())
    }

    /// Encodes the FPDU (header, ULPDU, zero pad, CRC or zeros) at the start of `buf` and
    /// returns its length. [`WireError::MpaUlpduTooLong`] for a ULPDU over 65535 bytes,
    /// [`WireError::BufferTooSmall`] for a short buffer; nothing is written then.
    pub fn emit(&self, buf: &mut [u8], use_crc: bool) -> Result<usize, WireError> {
        let len = check_ulpdu_len(self.ulpdu.len())?;
        let total = self.buffer_len();
        let have = buf.len();
        let out = buf.get_mut(..total).ok_or(WireError::BufferTooSmall {
            what: WHAT,
            need: total,
            have,
        })?;
        let mut packet = FpduPacket::new_unchecked(out);
        packet.set_ulpdu_length(len);
        packet.ulpdu_mut().copy_from_slice(self.ulpdu);
        packet.clear_pad();
        packet.fill_crc(use_crc);
        Ok(total)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    /// Frame 8 of siw-crc-rping.pcap: a Send FPDU, ULPDU 34 bytes, no pad, good CRC.
    const SIW_SEND_CRC: [u8; 40] = [
        0x00, 0x22, 0x41, 0x43, 0x00, 0x00, 0x00, 0x00, //
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, //
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x55, 0x7c, //
        0x5c, 0x16, 0x64, 0x30, 0x6b, 0x8c, 0xee, 0x00, //
        0x00, 0x00, 0x00, 0x40, 0x39, 0x8e, 0x29, 0x83, //
    ];

    /// A hand-built FPDU: ULPDU "abcde" (5 bytes), 1 pad byte, CRC over 00 05 'abcde' 00.
    fn five_byte_fpdu(pad: u8) -> [u8; 12] {
        let mut b = [0u8, 5, b'a', b'b', b'c', b'd', b'e', pad, 0, 0, 0, 0];
        let crc = crc::crc32c(&b[..8]);
        b[8..].copy_from_slice(&crc::to_wire(crc));
        b
    }

    #[test]
    fn pad_and_lengths_follow_the_4_byte_rule() {
        assert_eq!(
            [0, 1, 2, 3, 4, 5].map(pad_len),
            [2, 1, 0, 3, 2, 1],
            "header + ULPDU + pad is a multiple of 4"
        );
        assert_eq!(fpdu_len(0), 8);
        assert_eq!(fpdu_len(34), 40);
        assert_eq!(fpdu_len(78), 84);
        assert_eq!(fpdu_len(1442), 1448);
        assert_eq!(MAX_FPDU_LEN, 65544);
        assert_eq!(MIN_FPDU_LEN, 8);
        assert_eq!(trailer_len(5), 5);
        assert_eq!(fpdu_len(usize::MAX), usize::MAX);
        assert_eq!(pad_len(usize::MAX), 3);
    }

    #[test]
    fn peek_reads_the_total_length_from_two_bytes() {
        assert_eq!(peek(&[0x00, 0x22]), Ok(40));
        assert_eq!(peek(&[0x00, 0x4e, 0xc1]), Ok(84));
        assert_eq!(peek(&[0xff, 0xff]), Ok(MAX_FPDU_LEN));
        assert!(matches!(
            peek(&[0x00]),
            Err(WireError::Truncated {
                need: 2,
                have: 1,
                ..
            })
        ));
        assert!(matches!(
            peek(&[]),
            Err(WireError::Truncated {
                need: 2,
                have: 0,
                ..
            })
        ));
    }

    #[test]
    fn parses_siw_send_fpdu_with_good_crc() {
        let (fpdu, len) = Fpdu::parse(&SIW_SEND_CRC, true).unwrap();
        assert_eq!(len, 40);
        assert_eq!(fpdu.ulpdu, &SIW_SEND_CRC[2..36]);
        let packet = FpduPacket::new_checked(&SIW_SEND_CRC[..]).unwrap();
        assert_eq!(packet.ulpdu_length(), 34);
        assert_eq!(packet.pad(), &[] as &[u8]);
        assert_eq!(packet.crc_field(), [0x39, 0x8e, 0x29, 0x83]);
        assert_eq!(packet.computed_crc(), 0x8329_8e39);
    }

    #[test]
    fn emits_siw_send_fpdu_byte_for_byte() {
        let fpdu = Fpdu {
            ulpdu: &SIW_SEND_CRC[2..36],
        };
        let mut out = [0u8; 40];
        assert_eq!(fpdu.emit(&mut out, true), Ok(40));
        assert_eq!(out, SIW_SEND_CRC);
    }

    #[test]
    fn corrupted_byte_is_a_crc_mismatch() {
        let mut bad = SIW_SEND_CRC;
        bad[20] ^= 0x01;
        assert!(matches!(
            Fpdu::parse(&bad, true),
            Err(WireError::MpaCrcMismatch {
                received: 0x8329_8e39,
                ..
            })
        ));
        // Without CRC in use the same bytes parse.
        assert_eq!(Fpdu::parse(&bad, false).unwrap().1, 40);
    }

    #[test]
    fn dirty_pad_is_ignored_but_covered_by_the_crc() {
        let dirty = five_byte_fpdu(0x40);
        let (fpdu, len) = Fpdu::parse(&dirty, true).unwrap();
        assert_eq!((fpdu.ulpdu, len), (&b"abcde"[..], 12));
        assert_eq!(FpduPacket::new_checked(&dirty[..]).unwrap().pad(), &[0x40]);
        // Our own emit writes a zero pad, hence a different CRC.
        let mut out = [0u8; 12];
        fpdu.emit(&mut out, true).unwrap();
        assert_eq!(out, five_byte_fpdu(0));
    }

    #[test]
    fn siw_fpdu_with_stale_pad_bytes_and_good_crc_parses() {
        // siw-crc-ib_send_bw.pcap, a 2-byte perftest Send with CRC on: ULPDU 20 bytes, pad
        // `00 40` (stale bytes from siw's header buffer), CRC over those pad bytes.
        const SIW_DIRTY_PAD_CRC: [u8; 28] = [
            0x00, 0x14, 0x41, 0x43, 0x00, 0x00, 0x00, 0x00, //
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, //
            0x00, 0x00, 0x00, 0x00, 0x33, 0x00, 0x00, 0x40, //
            0xbf, 0xe0, 0xac, 0x94, //
        ];
        let (fpdu, len) = Fpdu::parse(&SIW_DIRTY_PAD_CRC, true).unwrap();
        assert_eq!(len, 28);
        assert_eq!(fpdu.ulpdu, &SIW_DIRTY_PAD_CRC[2..22]);
        let packet = FpduPacket::new_checked(&SIW_DIRTY_PAD_CRC[..]).unwrap();
        assert_eq!(packet.pad(), &[0x00, 0x40]);
        // We send zero pad, so our CRC for the same ULPDU differs from siw's.
        let mut ours = [0u8; 28];
        fpdu.emit(&mut ours, true).unwrap();
        assert_eq!(&ours[..22], &SIW_DIRTY_PAD_CRC[..22]);
        assert_eq!(&ours[22..24], &[0, 0]);
        assert_ne!(ours[24..], SIW_DIRTY_PAD_CRC[24..]);
        assert!(Fpdu::parse(&ours, true).is_ok());
    }

    #[test]
    fn crc_off_writes_zeros_and_ignores_the_field() {
        let fpdu = Fpdu { ulpdu: b"abcde" };
        let mut out = [0xffu8; 12];
        fpdu.emit(&mut out, false).unwrap();
        assert_eq!(out, [0, 5, b'a', b'b', b'c', b'd', b'e', 0, 0, 0, 0, 0]);
        let mut garbage = out;
        garbage[8..].copy_from_slice(&[1, 2, 3, 4]);
        assert_eq!(Fpdu::parse(&garbage, false).unwrap().0.ulpdu, b"abcde");
    }

    #[test]
    fn truncated_at_every_length_is_a_typed_error() {
        for n in 0..SIW_SEND_CRC.len() {
            let err = Fpdu::parse(&SIW_SEND_CRC[..n], true).unwrap_err();
            assert!(
                matches!(err, WireError::Truncated { have, .. } if have == n),
                "n={n}: {err:?}"
            );
        }
    }

    #[test]
    fn next_fpdu_after_this_one_is_left_alone() {
        let mut two = [0u8; 52];
        two[..40].copy_from_slice(&SIW_SEND_CRC);
        two[40..].copy_from_slice(&five_byte_fpdu(0));
        let (_, len) = Fpdu::parse(&two, true).unwrap();
        assert_eq!(len, 40);
        let (second, len2) = Fpdu::parse(&two[len..], true).unwrap();
        assert_eq!((second.ulpdu, len2), (&b"abcde"[..], 12));
    }

    #[test]
    fn empty_ulpdu_is_framed_with_two_pad_bytes() {
        let mut out = [0u8; 8];
        assert_eq!(Fpdu { ulpdu: &[] }.emit(&mut out, true), Ok(8));
        assert_eq!(&out[..4], &[0, 0, 0, 0]);
        assert_eq!(out[4..], crc::to_wire(crc::crc32c(&[0, 0, 0, 0])));
        assert_eq!(Fpdu::parse(&out, true).unwrap().0.ulpdu, &[] as &[u8]);
    }

    #[test]
    fn emit_refuses_oversized_ulpdu_and_short_buffers() {
        let big = vec![0u8; MAX_ULPDU_LEN + 1];
        let mut out = vec![0u8; MAX_FPDU_LEN + 8];
        assert_eq!(
            Fpdu { ulpdu: &big }.emit(&mut out, true),
            Err(WireError::MpaUlpduTooLong {
                len: 65536,
                max: 65535
            })
        );
        assert_eq!(
            Fpdu {
                ulpdu: &big[..MAX_ULPDU_LEN]
            }
            .emit(&mut out, true),
            Ok(MAX_FPDU_LEN)
        );
        let mut short = [0u8; 11];
        assert_eq!(
            Fpdu { ulpdu: b"abcde" }.emit(&mut short, true),
            Err(WireError::BufferTooSmall {
                what: WHAT,
                need: 12,
                have: 11
            })
        );
        assert_eq!(short, [0u8; 11]);
    }

    #[test]
    fn gathered_header_payload_trailer_equal_the_one_shot_emit() {
        let payload: [&[u8]; 3] = [b"ab", b"", b"cde"];
        let mut header = [0u8; HEADER_LEN];
        let mut trailer = [0u8; MAX_TRAILER_LEN];
        assert_eq!(emit_header(5, &mut header), Ok(2));
        let n = emit_trailer(&payload, true, &mut trailer).unwrap();
        assert_eq!(n, 5);
        let mut gathered = Vec::new();
        gathered.extend_from_slice(&header);
        for p in payload {
            gathered.extend_from_slice(p);
        }
        gathered.extend_from_slice(&trailer[..n]);
        assert_eq!(gathered, five_byte_fpdu(0));
        assert_eq!(
            fpdu_crc(&payload),
            Ok(crc::from_wire(five_byte_fpdu(0)[8..].try_into().unwrap()))
        );
        assert_eq!(emit_trailer(&payload, false, &mut trailer), Ok(5));
        assert_eq!(&trailer[..5], &[0; 5]);
    }

    #[test]
    fn header_and_trailer_emit_report_errors() {
        let mut one = [0u8; 1];
        assert!(matches!(
            emit_header(5, &mut one),
            Err(WireError::BufferTooSmall {
                need: 2,
                have: 1,
                ..
            })
        ));
        let mut two = [0u8; 2];
        assert_eq!(
            emit_header(70_000, &mut two),
            Err(WireError::MpaUlpduTooLong {
                len: 70_000,
                max: 65535
            })
        );
        let mut four = [0u8; 4];
        assert!(matches!(
            emit_trailer(&[b"abcde"], true, &mut four),
            Err(WireError::BufferTooSmall {
                need: 5,
                have: 4,
                ..
            })
        ));
        let big = vec![0u8; 40_000];
        assert!(matches!(
            emit_trailer(&[&big, &big], true, &mut [0u8; 8]),
            Err(WireError::MpaUlpduTooLong { len: 80_000, .. })
        ));
    }

    #[test]
    fn receiver_side_streaming_crc_check() {
        let fpdu = five_byte_fpdu(0x77);
        let mut crc = Crc32c::new();
        crc.update(&fpdu[..2]);
        crc.update(&fpdu[2..4]);
        crc.update(&fpdu[4..7]);
        crc.update(&fpdu[7..8]);
        let field: [u8; 4] = fpdu[8..].try_into().unwrap();
        assert_eq!(check_crc(crc.finish(), field), Ok(()));
        assert!(matches!(
            check_crc(crc.finish() ^ 1, field),
            Err(WireError::MpaCrcMismatch { .. })
        ));
    }

    #[test]
    fn mulpdu_follows_the_rfc_formulas() {
        assert_eq!(mulpdu(1448, false), 1442);
        assert_eq!(mulpdu(1448, true), 1448 - (6 + 4 * 3));
        assert_eq!(mulpdu(1460, false), 1454);
        assert_eq!(mulpdu(1450, false), 1450 - 6 - 2);
        assert_eq!(mulpdu(536, true), 536 - (6 + 8));
        assert_eq!(mulpdu(512, true), 512 - (6 + 4));
        assert_eq!(mulpdu(513, true), 513 - (6 + 8 + 1));
        assert_eq!(mulpdu(5, false), 0);
        assert_eq!(mulpdu(0, true), 0);
        assert_eq!(mulpdu(1 << 20, false), MAX_ULPDU_LEN);
        // The FPDU built from MULPDU fits the EMSS exactly when EMSS is a multiple of 4.
        assert_eq!(fpdu_len(mulpdu(1448, false)), 1448);
    }

    #[test]
    fn view_setters_build_an_fpdu() {
        let mut buf = [0xeeu8; 12];
        let mut packet = FpduPacket::new_unchecked(&mut buf[..]);
        packet.set_ulpdu_length(5);
        packet.ulpdu_mut().copy_from_slice(b"abcde");
        packet.clear_pad();
        packet.fill_crc(true);
        assert_eq!(packet.check_crc(), Ok(()));
        assert_eq!(packet.into_inner(), &five_byte_fpdu(0)[..]);
    }

    #[test]
    fn unchecked_view_of_a_short_buffer_never_panics() {
        let mut buf = [0x00u8, 0x40, 1, 2];
        let mut packet = FpduPacket::new_unchecked(&mut buf[..]);
        assert_eq!(packet.ulpdu_length(), 0x40);
        assert_eq!(packet.ulpdu(), &[1, 2]);
        assert_eq!(packet.pad(), &[] as &[u8]);
        assert_eq!(packet.crc_field(), [0; 4]);
        packet.clear_pad();
        packet.fill_crc(true);
        assert_eq!(packet.ulpdu_mut().len(), 2);
        assert!(packet.check_len().is_err());
        let empty = FpduPacket::new_unchecked(&[][..]);
        assert_eq!(empty.ulpdu_length(), 0);
        assert_eq!(empty.ulpdu(), &[] as &[u8]);
    }
}
