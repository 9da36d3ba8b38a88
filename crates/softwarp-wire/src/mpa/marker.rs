//! MPA markers (RFC 5044 section 4.3): a 4-byte marker every 512 octets of the FPDU stream.
//!
//! Pure arithmetic and copying: no I/O, no allocation, no panics on any input.
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |           RESERVED            |            FPDUPTR            |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! # Positions
//!
//! Offsets here are **stream offsets**: octets of one direction's FPDU stream counted from its
//! first octet, the one right after the MPA Request (initiator to responder) or the MPA Reply
//! (responder to initiator). The MPA Request/Reply frames carry no markers; the first marker
//! sits at stream offset 0, immediately before the first FPDU, and one follows every 512
//! octets (markers included) after that: stream offsets 0, 512, 1024, ... From TCP sequence
//! numbers use [`stream_offset`]; 512 divides 2^32, so sequence wrap-around is harmless, and
//! stream offsets themselves wrap at 2^64 for the same reason.
//!
//! FPDUs are multiples of 4 octets, so every FPDU starts at a stream offset that is a multiple
//! of 4, and a marker can never split ULPDU_Length or the CRC; [`MarkerLayout::new`] refuses
//! offsets and lengths that break this.
//!
//! # Which FPDU a marker belongs to, and its FPDUPTR
//!
//! A marker belongs to the FPDU whose octets surround it. A marker that falls exactly where an
//! FPDU begins is that FPDU's first four octets: ULPDU_Length follows it. A marker that falls
//! right after an FPDU's pad sits between pad and CRC. No marker follows the CRC of an FPDU
//! (that position is the start of the next FPDU).
//!
//! FPDUPTR is the distance back from the marker to the first octet of its FPDU, in stream
//! octets (markers included). This gives 0 for the first marker of the stream and for any
//! FPDU that starts on a marker position, which is what RFC 5044 section 4.3 gives the first
//! marker of the stream (it immediately precedes the first FPDU). For the later markers of an
//! FPDU that starts with a marker, counting from its ULPDU_Length field instead would give 4
//! less. We **emit** the count from the FPDU's first octet, as the OSC iWARP software stack
//! does when it inserts markers (Wireshark's dissector, which only displays FPDUPTR, likewise
//! treats a leading marker as part of the FPDU). On **receive**, [`strip`] accepts either value
//! in that one case, so that a peer counting the other way still interoperates; anything else
//! is [`WireError::MpaBadMarker`]. RESERVED is sent as zero and ignored on receipt.
//!
//! No siw or hardware peer in our captures uses markers (siw refuses M=1), so this code is
//! checked against the layout rules above and its own inverse, not against real traffic.
//!
//! # CRC
//!
//! With markers the CRC covers the FPDU as it is on the wire, markers included (a marker at
//! the FPDU's start too), from its first octet up to the CRC field. [`insert`] writes that
//! CRC; [`strip`] checks it and then writes the marker-free FPDU with the CRC recomputed over
//! the marker-free bytes, so that the result is an ordinary FPDU for
//! [`super::fpdu::Fpdu::parse`].
//!
//! # Traceability
//!
//! The RFC text could not be retrieved while this was written; requirements are cited with
//! `//=` links and plain-comment paraphrases, to be turned into `//#` quotes.

use core::ops::Range;

use super::fpdu;
use crate::crc::{self, Crc32c};
use crate::error::WireError;

/// Distance between two markers in the stream, in octets (markers included).
pub const MARKER_INTERVAL: usize = 512;
/// Length of a marker.
pub const MARKER_LEN: usize = 4;

const WHAT_WIRE: &str = "FPDU with markers";

/// Field offsets inside a marker.
mod field {
    use core::ops::Range;

    pub const RESERVED: Range<usize> = 0..2;
    pub const FPDUPTR: Range<usize> = 2..4;
}

/// The stream offset of TCP sequence number `seq` in a direction whose FPDU stream (the
/// first octet after the MPA Request or Reply) starts at sequence number `stream_start_seq`.
pub const fn stream_offset(seq: u32, stream_start_seq: u32) -> u64 {
    seq.wrapping_sub(stream_start_seq) as u64
}

/// One marker inside an FPDU on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Marker {
    /// Offset of the marker from the FPDU's first octet on the wire.
    pub wire_offset: usize,
    /// Stream offset of the marker (a multiple of 512).
    pub stream_offset: u64,
    /// The FPDUPTR value it carries.
    pub fpduptr: u16,
}

impl Marker {
    /// The 4 bytes of the marker: RESERVED zero, then FPDUPTR big-endian.
    pub fn to_bytes(&self) -> [u8; MARKER_LEN] {
        let mut bytes = [0u8; MARKER_LEN];
        if let Some(reserved) = bytes.get_mut(field::RESERVED) {
            reserved.fill(0);
        }
        if let Some(fpduptr) = bytes.get_mut(field::FPDUPTR) {
            fpduptr.copy_from_slice(&self.fpduptr.to_be_bytes());
        }
        bytes
    }
}

/// A piece of an FPDU on the wire: bytes of the marker-free FPDU, or a marker.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Piece {
    /// This range of the marker-free FPDU comes next.
    Data(Range<usize>),
    /// This marker comes next.
    Marker(Marker),
}

/// Where the markers go in one FPDU: the FPDU's stream offset and marker-free length, and
/// everything that follows from them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MarkerLayout {
    stream_offset: u64,
    fpdu_len: usize,
    /// Wire offset of the first marker position at or after the FPDU's start.
    first_marker: usize,
    wire_len: usize,
}

/// Offset from `stream_offset` to the next marker position (0 when it is one).
fn first_marker_offset(stream_offset: u64) -> usize {
    let into = (stream_offset % MARKER_INTERVAL as u64) as usize;
    (MARKER_INTERVAL - into) % MARKER_INTERVAL
}

fn check_stream_offset(stream_offset: u64) -> Result<(), WireError> {
    if stream_offset & 3 != 0 {
        return Err(WireError::InvalidField {
            what: "MPA marker layout",
            field: "stream offset (FPDUs start on 4-octet boundaries)",
            value: stream_offset,
        });
    }
    Ok(())
}

impl MarkerLayout {
    /// The layout of an FPDU of `fpdu_len` marker-free octets (header to CRC) that starts at
    /// `stream_offset`. Refused with [`WireError::InvalidField`]: a stream offset that is not a
    /// multiple of 4, an FPDU length that is not a multiple of 4 or outside
    /// [`fpdu::MIN_FPDU_LEN`]..=[`fpdu::MAX_FPDU_LEN`], or a marker so far into the FPDU that
    /// its FPDUPTR would not fit 16 bits.
    pub fn new(stream_offset: u64, fpdu_len: usize) -> Result<Self, WireError> {
        check_stream_offset(stream_offset)?;
        if fpdu_len & 3 != 0 || !(fpdu::MIN_FPDU_LEN..=fpdu::MAX_FPDU_LEN).contains(&fpdu_len) {
            return Err(WireError::InvalidField {
                what: "MPA marker layout",
                field: "FPDU length",
                value: fpdu_len as u64,
            });
        }
        let first_marker = first_marker_offset(stream_offset);
        // Wire offset of the last marker-free octet, plus one.
        let last = fpdu_len - 1;
        let wire_len = if last < first_marker {
            fpdu_len
        } else {
            let data_per_gap = MARKER_INTERVAL - MARKER_LEN;
            fpdu_len + MARKER_LEN * ((last - first_marker) / data_per_gap + 1)
        };
        let layout = MarkerLayout {
            stream_offset,
            fpdu_len,
            first_marker,
            wire_len,
        };
        if let Some(last_marker) = layout.markers().last() {
            if u16::try_from(last_marker.wire_offset).is_err() {
                return Err(WireError::InvalidField {
                    what: "MPA marker",
                    field: "FPDUPTR",
                    value: last_marker.wire_offset as u64,
                });
            }
        }
        Ok(layout)
    }

    /// The stream offset of the FPDU's first octet on the wire.
    pub const fn stream_offset(&self) -> u64 {
        self.stream_offset
    }

    /// The marker-free FPDU length (header to CRC).
    pub const fn fpdu_len(&self) -> usize {
        self.fpdu_len
    }

    /// The FPDU's length on the wire, markers included.
    pub const fn wire_len(&self) -> usize {
        self.wire_len
    }

    /// How many markers the FPDU contains.
    pub const fn marker_count(&self) -> usize {
        (self.wire_len - self.fpdu_len) / MARKER_LEN
    }

    /// True when the FPDU starts on a marker position (its first four octets are a marker).
    pub const fn begins_with_marker(&self) -> bool {
        self.first_marker == 0
    }

    /// The stream offset right after this FPDU: where the next one starts (wrapping at
    /// 2^64, which keeps marker positions right since 512 divides 2^64).
    pub const fn next_stream_offset(&self) -> u64 {
        self.stream_offset.wrapping_add(self.wire_len as u64)
    }

    /// The wire offset of the CRC field (its last four octets).
    pub const fn crc_wire_offset(&self) -> usize {
        self.wire_len - fpdu::CRC_LEN
    }

    /// The markers, in order.
    pub fn markers(&self) -> Markers {
        Markers {
            next: self.first_marker,
            end: self.wire_len,
            stream_offset: self.stream_offset,
        }
    }

    /// The wire form as an alternation of marker-free byte ranges and markers, in order.
    pub fn pieces(&self) -> Pieces {
        Pieces {
            layout: *self,
            data: 0,
            wire: 0,
            next_marker: self.first_marker,
        }
    }

    /// FPDUPTR values a receiver accepts for `marker`: the one we emit and, for later markers
    /// of an FPDU that begins with a marker, the one counted from ULPDU_Length (module docs).
    pub fn accepts(&self, marker: &Marker, fpduptr: u16) -> bool {
        fpduptr == marker.fpduptr
            || (self.begins_with_marker()
                && marker.wire_offset > 0
                && usize::from(fpduptr) + MARKER_LEN == marker.wire_offset)
    }
}

/// The FPDUPTR field of a received marker's 4 bytes (RESERVED, then FPDUPTR, big endian).
/// RESERVED is ignored on receipt, as RFC 5044 asks.
pub fn fpduptr(marker: [u8; MARKER_LEN]) -> u16 {
    let [_, _, hi, lo] = marker;
    u16::from_be_bytes([hi, lo])
}

/// Iterator over the markers of a [`MarkerLayout`].
#[derive(Debug, Clone)]
pub struct Markers {
    next: usize,
    end: usize,
    stream_offset: u64,
}

impl Iterator for Markers {
    type Item = Marker;

    fn next(&mut self) -> Option<Marker> {
        if self.next >= self.end {
            return None;
        }
        let wire_offset = self.next;
        self.next += MARKER_INTERVAL;
        Some(Marker {
            wire_offset,
            stream_offset: self.stream_offset.wrapping_add(wire_offset as u64),
            // Checked by MarkerLayout::new; saturating keeps this total regardless.
            fpduptr: u16::try_from(wire_offset).unwrap_or(u16::MAX),
        })
    }
}

/// Iterator over the [`Piece`]s of a [`MarkerLayout`].
#[derive(Debug, Clone)]
pub struct Pieces {
    layout: MarkerLayout,
    /// Marker-free octets produced so far.
    data: usize,
    /// Wire octets produced so far.
    wire: usize,
    next_marker: usize,
}

impl Iterator for Pieces {
    type Item = Piece;

    fn next(&mut self) -> Option<Piece> {
        if self.data >= self.layout.fpdu_len {
            // A marker right after the CRC belongs to the next FPDU.
            return None;
        }
        if self.wire == self.next_marker {
            let marker = Marker {
                wire_offset: self.wire,
                stream_offset: self.layout.stream_offset.wrapping_add(self.wire as u64),
                fpduptr: u16::try_from(self.wire).unwrap_or(u16::MAX),
            };
            self.wire += MARKER_LEN;
            self.next_marker += MARKER_INTERVAL;
            return Some(Piece::Marker(marker));
        }
        let n = (self.layout.fpdu_len - self.data).min(self.next_marker - self.wire);
        let range = self.data..self.data + n;
        self.data += n;
        self.wire += n;
        Some(Piece::Data(range))
    }
}

/// The on-wire length of an FPDU of `fpdu_len` marker-free octets starting at
/// `stream_offset` (see [`MarkerLayout::new`] for what is refused).
pub fn wire_len(stream_offset: u64, fpdu_len: usize) -> Result<usize, WireError> {
    Ok(MarkerLayout::new(stream_offset, fpdu_len)?.wire_len())
}

/// Copies the marker-free FPDU at the start of `fpdu` into `out` with markers inserted for
/// stream offset `stream_offset`, and returns the wire length written.
///
/// The FPDU's length comes from its ULPDU_Length; bytes after it are ignored. With `use_crc`
/// the CRC field is replaced by the CRC over the wire form (markers included); without, it is
/// copied unchanged (zeros for an FPDU from [`super::fpdu::Fpdu::emit`]).
pub fn insert(
    fpdu: &[u8],
    stream_offset: u64,
    use_crc: bool,
    out: &mut [u8],
) -> Result<usize, WireError> {
    check_stream_offset(stream_offset)?;
    let fpdu_len = fpdu::peek(fpdu)?;
    let src = fpdu.get(..fpdu_len).ok_or(WireError::Truncated {
        what: "FPDU",
        need: fpdu_len,
        have: fpdu.len(),
    })?;
    let layout = MarkerLayout::new(stream_offset, fpdu_len)?;
    let wire_len = layout.wire_len();
    let have = out.len();
    let dst = out.get_mut(..wire_len).ok_or(WireError::BufferTooSmall {
        what: WHAT_WIRE,
        need: wire_len,
        have,
    })?;

    //= https://www.rfc-editor.org/rfc/rfc5044#section-4.3
    // (paraphrase) When markers are in use the sender inserts one at every 512th octet of the
    // stream, starting immediately before the first FPDU; RESERVED is zero and FPDUPTR gives
    // the distance back to the start of the FPDU that contains the marker.
    let mut wire = 0;
    for piece in layout.pieces() {
        let (bytes, len): (&[u8], usize) = match &piece {
            Piece::Data(range) => {
                let bytes = src.get(range.clone()).unwrap_or_default();
                (bytes, bytes.len())
            }
            Piece::Marker(_) => (&[], MARKER_LEN),
        };
        let Some(slot) = dst.get_mut(wire..wire + len) else {
            break;
        };
        match piece {
            Piece::Data(_) => slot.copy_from_slice(bytes),
            Piece::Marker(marker) => slot.copy_from_slice(&marker.to_bytes()),
        }
        wire += len;
    }

    if use_crc {
        //= https://www.rfc-editor.org/rfc/rfc5044#section-4.4
        // (paraphrase) The CRC covers the FPDU as sent, markers included.
        let crc_at = layout.crc_wire_offset();
        let value = crc::crc32c(dst.get(..crc_at).unwrap_or_default());
        if let Some(field) = dst.get_mut(crc_at..) {
            field.copy_from_slice(&crc::to_wire(value));
        }
    }
    Ok(wire_len)
}

/// Removes the markers from the FPDU that starts at `wire` (whose first octet is at stream
/// offset `stream_offset`), writes the marker-free FPDU into `out`, and returns
/// `(wire octets consumed, marker-free octets written)`. Octets after the FPDU are left
/// alone.
///
/// Every marker's FPDUPTR is checked ([`WireError::MpaBadMarker`]). With `use_crc` the CRC
/// over the wire form is checked ([`WireError::MpaCrcMismatch`]) and the output's CRC field is
/// recomputed over the marker-free bytes, so that the output passes
/// [`super::fpdu::Fpdu::parse`] with CRC on; without, the CRC field is copied unchanged.
pub fn strip(
    wire: &[u8],
    stream_offset: u64,
    use_crc: bool,
    out: &mut [u8],
) -> Result<(usize, usize), WireError> {
    check_stream_offset(stream_offset)?;
    // ULPDU_Length comes right after a marker when the FPDU starts on a marker position.
    let header_at = if first_marker_offset(stream_offset) == 0 {
        MARKER_LEN
    } else {
        0
    };
    let header = wire.get(header_at..).unwrap_or_default();
    let fpdu_len = fpdu::peek(header).map_err(|_| WireError::Truncated {
        what: WHAT_WIRE,
        need: header_at + fpdu::HEADER_LEN,
        have: wire.len(),
    })?;
    let layout = MarkerLayout::new(stream_offset, fpdu_len)?;
    let wire_len = layout.wire_len();
    let src = wire.get(..wire_len).ok_or(WireError::Truncated {
        what: WHAT_WIRE,
        need: wire_len,
        have: wire.len(),
    })?;
    let have = out.len();
    let dst = out.get_mut(..fpdu_len).ok_or(WireError::BufferTooSmall {
        what: "FPDU",
        need: fpdu_len,
        have,
    })?;

    let mut at = 0;
    for piece in layout.pieces() {
        match piece {
            Piece::Data(range) => {
                let len = range.len();
                let bytes = src.get(at..at + len).unwrap_or_default();
                if let Some(slot) = dst.get_mut(range) {
                    slot.copy_from_slice(bytes);
                }
                at += len;
            }
            Piece::Marker(marker) => {
                //= https://www.rfc-editor.org/rfc/rfc5044#section-4.3
                // (paraphrase) RESERVED is ignored on receipt; FPDUPTR must lead back to the
                // start of the FPDU that contains the marker.
                let fpduptr = src
                    .get(at..at + MARKER_LEN)
                    .and_then(|m| m.get(field::FPDUPTR))
                    .and_then(|b| b.try_into().ok())
                    .map(u16::from_be_bytes)
                    .unwrap_or(0);
                if !layout.accepts(&marker, fpduptr) {
                    return Err(WireError::MpaBadMarker {
                        stream_offset: marker.stream_offset,
                        pointer: fpduptr,
                        expected: marker.fpduptr,
                    });
                }
                at += MARKER_LEN;
            }
        }
    }

    if use_crc {
        let crc_at = layout.crc_wire_offset();
        let computed = crc::crc32c(src.get(..crc_at).unwrap_or_default());
        let field: [u8; crc::CRC_LEN] = src
            .get(crc_at..)
            .and_then(|b| b.try_into().ok())
            .unwrap_or_default();
        fpdu::check_crc(computed, field)?;
        let plain_at = fpdu_len - fpdu::CRC_LEN;
        let plain = crc::crc32c(dst.get(..plain_at).unwrap_or_default());
        if let Some(field) = dst.get_mut(plain_at..) {
            field.copy_from_slice(&crc::to_wire(plain));
        }
    }
    Ok((wire_len, fpdu_len))
}

/// What a sender hands to `writev` for one FPDU with markers: a borrowed slice or a marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WirePiece<'a> {
    /// Bytes from one of the caller's slices.
    Data(&'a [u8]),
    /// A marker's 4 bytes.
    Marker([u8; MARKER_LEN]),
}

/// Zero-copy gather with markers: splits the caller's slices (ULPDU_Length, ULPDU slices, pad;
/// everything but the CRC) at marker positions and yields them interleaved with the markers,
/// including a marker that falls right before the CRC. It computes the CRC over everything it
/// yields; after the last piece, [`MarkedSlices::crc_wire`] gives the CRC field to append.
///
/// ```
/// use softwarp_wire::mpa::{fpdu, marker::{MarkedSlices, MarkerLayout, WirePiece}};
/// let payload: &[u8] = &[7u8; 1000];
/// let mut header = [0u8; 2];
/// fpdu::emit_header(payload.len(), &mut header).unwrap();
/// let pad = [0u8; 3];
/// let pad = &pad[..fpdu::pad_len(payload.len())];
/// let layout = MarkerLayout::new(0, fpdu::fpdu_len(payload.len())).unwrap();
/// let slices = [&header[..], payload, pad];
/// let mut gather = MarkedSlices::new(layout, &slices).unwrap();
/// let mut wire = Vec::new();
/// for piece in &mut gather {
///     match piece {
///         WirePiece::Data(bytes) => wire.extend_from_slice(bytes),
///         WirePiece::Marker(marker) => wire.extend_from_slice(&marker),
///     }
/// }
/// wire.extend_from_slice(&gather.crc_wire());
/// assert_eq!(wire.len(), layout.wire_len());
/// ```
#[derive(Debug, Clone)]
pub struct MarkedSlices<'a, 's> {
    pieces: Pieces,
    /// Marker-free octets to yield (the FPDU without its CRC).
    data_len: usize,
    slices: &'s [&'a [u8]],
    slice: usize,
    within: usize,
    crc: Crc32c,
}

impl<'a, 's> MarkedSlices<'a, 's> {
    /// Prepares the gather for `layout`. The `slices` must add up to the FPDU without its CRC
    /// (`layout.fpdu_len() - 4`), else [`WireError::InvalidField`].
    pub fn new(layout: MarkerLayout, slices: &'s [&'a [u8]]) -> Result<Self, WireError> {
        let data_len = layout.fpdu_len() - fpdu::CRC_LEN;
        let total = slices
            .iter()
            .fold(0usize, |acc, s| acc.saturating_add(s.len()));
        if total != data_len {
            return Err(WireError::InvalidField {
                what: "MPA marker gather",
                field: "slices length (must be the FPDU without its CRC)",
                value: total as u64,
            });
        }
        Ok(MarkedSlices {
            pieces: layout.pieces(),
            data_len,
            slices,
            slice: 0,
            within: 0,
            crc: Crc32c::new(),
        })
    }

    /// The CRC over everything yielded so far (the wire form up to the CRC field once the
    /// iterator is exhausted).
    pub fn crc(&self) -> u32 {
        self.crc.finish()
    }

    /// [`Self::crc`] as the 4 wire bytes of the CRC field.
    pub fn crc_wire(&self) -> [u8; crc::CRC_LEN] {
        self.crc.finish_wire()
    }

    /// The next piece of the current slice, at most `limit` bytes.
    fn take(&mut self, limit: usize) -> Option<&'a [u8]> {
        loop {
            let slice = *self.slices.get(self.slice)?;
            let rest = slice.get(self.within..).unwrap_or_default();
            if rest.is_empty() {
                self.slice += 1;
                self.within = 0;
                continue;
            }
            let n = rest.len().min(limit);
            self.within += n;
            return rest.get(..n);
        }
    }
}

impl<'a> Iterator for MarkedSlices<'a, '_> {
    type Item = WirePiece<'a>;

    fn next(&mut self) -> Option<WirePiece<'a>> {
        // A marker comes next whenever the layout says so, including one that falls right
        // before the CRC (the CRC itself is the caller's, so data stops at `data_len`).
        if self.pieces.wire == self.pieces.next_marker {
            let Some(Piece::Marker(marker)) = self.pieces.next() else {
                return None;
            };
            let bytes = marker.to_bytes();
            self.crc.update(&bytes);
            return Some(WirePiece::Marker(bytes));
        }
        if self.pieces.data >= self.data_len {
            return None;
        }
        let limit =
            (self.data_len - self.pieces.data).min(self.pieces.next_marker - self.pieces.wire);
        let bytes = self.take(limit)?;
        self.pieces.data += bytes.len();
        self.pieces.wire += bytes.len();
        self.crc.update(bytes);
        Some(WirePiece::Data(bytes))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;
    use crate::mpa::fpdu::{fpdu_len, Fpdu};

    fn fpdu_bytes(ulpdu_len: usize, use_crc: bool) -> Vec<u8> {
        let ulpdu: Vec<u8> = (0..ulpdu_len).map(|i| (i % 251) as u8 + 1).collect();
        let mut out = vec![0u8; fpdu_len(ulpdu_len)];
        Fpdu { ulpdu: &ulpdu }.emit(&mut out, use_crc).unwrap();
        out
    }

    #[test]
    fn stream_offsets_from_sequence_numbers_wrap() {
        assert_eq!(stream_offset(1000, 1000), 0);
        assert_eq!(stream_offset(4, 0xffff_fffc), 8);
        assert_eq!(first_marker_offset(0), 0);
        assert_eq!(first_marker_offset(8), 504);
        assert_eq!(first_marker_offset(512), 0);
        assert_eq!(first_marker_offset(1020), 4);
    }

    #[test]
    fn fpdu_not_reaching_a_marker_has_none() {
        let layout = MarkerLayout::new(4, 40).unwrap();
        assert_eq!(layout.wire_len(), 40);
        assert_eq!(layout.marker_count(), 0);
        assert_eq!(layout.markers().count(), 0);
        assert_eq!(
            layout.pieces().collect::<Vec<_>>(),
            vec![Piece::Data(0..40)]
        );
        assert!(!layout.begins_with_marker());
    }

    #[test]
    fn fpdu_ending_exactly_at_a_marker_leaves_it_to_the_next_fpdu() {
        let layout = MarkerLayout::new(472, 40).unwrap();
        assert_eq!(layout.wire_len(), 40);
        assert_eq!(layout.next_stream_offset(), 512);
        let next = MarkerLayout::new(512, 40).unwrap();
        assert!(next.begins_with_marker());
        assert_eq!(next.wire_len(), 44);
    }

    #[test]
    fn first_fpdu_of_the_stream_begins_with_a_marker_whose_fpduptr_is_zero() {
        let layout = MarkerLayout::new(0, 40).unwrap();
        assert_eq!(
            layout.pieces().collect::<Vec<_>>(),
            vec![
                Piece::Marker(Marker {
                    wire_offset: 0,
                    stream_offset: 0,
                    fpduptr: 0
                }),
                Piece::Data(0..40),
            ]
        );
        let mut out = [0u8; 44];
        assert_eq!(insert(&fpdu_bytes(34, false), 0, false, &mut out), Ok(44));
        assert_eq!(&out[..6], &[0, 0, 0, 0, 0x00, 0x22]);
    }

    #[test]
    fn marker_inside_an_fpdu_points_back_to_its_start() {
        // FPDU at stream offset 500: the marker at 512 is 12 octets in.
        let fpdu = fpdu_bytes(34, false);
        let mut out = [0u8; 44];
        assert_eq!(insert(&fpdu, 500, false, &mut out), Ok(44));
        assert_eq!(&out[..12], &fpdu[..12]);
        assert_eq!(&out[12..16], &[0, 0, 0, 12]);
        assert_eq!(&out[16..], &fpdu[12..]);
    }

    #[test]
    fn marker_between_pad_and_crc() {
        // ULPDU 34: header+ULPDU+pad is 36 octets; starting at 476, 476 + 36 = 512.
        let fpdu = fpdu_bytes(34, true);
        let layout = MarkerLayout::new(476, 40).unwrap();
        assert_eq!(layout.crc_wire_offset(), 40);
        let mut out = [0u8; 44];
        insert(&fpdu, 476, true, &mut out).unwrap();
        assert_eq!(&out[..36], &fpdu[..36]);
        assert_eq!(&out[36..40], &[0, 0, 0, 36]);
        assert_eq!(out[40..], crc::to_wire(crc::crc32c(&out[..40])));
        let mut back = [0u8; 40];
        assert_eq!(strip(&out, 476, true, &mut back), Ok((44, 40)));
        assert_eq!(back[..], fpdu[..]);
    }

    #[test]
    fn large_fpdu_straddles_several_markers() {
        let fpdu = fpdu_bytes(1442, true);
        let layout = MarkerLayout::new(100, fpdu.len()).unwrap();
        let markers: Vec<_> = layout.markers().collect();
        assert_eq!(
            markers.iter().map(|m| m.wire_offset).collect::<Vec<_>>(),
            vec![412, 924, 1436]
        );
        assert_eq!(
            markers.iter().map(|m| m.stream_offset).collect::<Vec<_>>(),
            vec![512, 1024, 1536]
        );
        assert_eq!(layout.wire_len(), 1448 + 12);
        let mut wire = vec![0u8; layout.wire_len()];
        insert(&fpdu, 100, true, &mut wire).unwrap();
        let mut back = vec![0u8; 1448];
        assert_eq!(strip(&wire, 100, true, &mut back), Ok((1460, 1448)));
        assert_eq!(back, fpdu);
        assert!(Fpdu::parse(&back, true).is_ok());
    }

    #[test]
    fn fpdu_starting_on_a_marker_counts_fpduptr_from_the_marker() {
        let fpdu = fpdu_bytes(1000, false);
        let layout = MarkerLayout::new(1024, fpdu.len()).unwrap();
        let ptrs: Vec<u16> = layout.markers().map(|m| m.fpduptr).collect();
        assert_eq!(ptrs, vec![0, 512]);
        let mut wire = vec![0u8; layout.wire_len()];
        insert(&fpdu, 1024, false, &mut wire).unwrap();
        assert_eq!(&wire[512..516], &[0, 0, 0x02, 0x00]);
        let mut back = vec![0u8; fpdu.len()];
        assert_eq!(strip(&wire, 1024, false, &mut back).unwrap().1, fpdu.len());
        assert_eq!(back, fpdu);
        // The reading "from ULPDU_Length" (508) is accepted too.
        wire[514..516].copy_from_slice(&508u16.to_be_bytes());
        assert!(strip(&wire, 1024, false, &mut back).is_ok());
        // Anything else is a bad marker.
        wire[514..516].copy_from_slice(&504u16.to_be_bytes());
        assert_eq!(
            strip(&wire, 1024, false, &mut back),
            Err(WireError::MpaBadMarker {
                stream_offset: 1536,
                pointer: 504,
                expected: 512
            })
        );
    }

    #[test]
    fn bad_fpduptr_is_reported_with_its_stream_offset() {
        let fpdu = fpdu_bytes(34, false);
        let mut wire = [0u8; 44];
        insert(&fpdu, 500, false, &mut wire).unwrap();
        wire[15] = 8;
        let mut back = [0u8; 40];
        assert_eq!(
            strip(&wire, 500, false, &mut back),
            Err(WireError::MpaBadMarker {
                stream_offset: 512,
                pointer: 8,
                expected: 12
            })
        );
        // A leading marker that does not say 0 is bad as well.
        let mut wire = [0u8; 44];
        insert(&fpdu, 0, false, &mut wire).unwrap();
        wire[3] = 4;
        assert!(matches!(
            strip(&wire, 0, false, &mut back),
            Err(WireError::MpaBadMarker {
                stream_offset: 0,
                pointer: 4,
                expected: 0
            })
        ));
    }

    #[test]
    fn reserved_bits_of_a_marker_are_ignored() {
        let fpdu = fpdu_bytes(34, false);
        let mut wire = [0u8; 44];
        insert(&fpdu, 500, false, &mut wire).unwrap();
        wire[12] = 0xff;
        wire[13] = 0xff;
        let mut back = [0u8; 40];
        assert_eq!(strip(&wire, 500, false, &mut back), Ok((44, 40)));
    }

    #[test]
    fn wire_crc_covers_markers() {
        let fpdu = fpdu_bytes(34, true);
        let mut wire = [0u8; 44];
        insert(&fpdu, 500, true, &mut wire).unwrap();
        assert_eq!(wire[40..], crc::to_wire(crc::crc32c(&wire[..40])));
        assert_ne!(wire[40..], fpdu[36..], "differs from the marker-free CRC");
        let mut bad = wire;
        bad[13] ^= 1; // a reserved marker bit: ignored as a field, but CRC-covered
        let mut back = [0u8; 40];
        assert!(matches!(
            strip(&bad, 500, true, &mut back),
            Err(WireError::MpaCrcMismatch { .. })
        ));
    }

    #[test]
    fn strip_truncated_at_every_length_is_a_typed_error() {
        let fpdu = fpdu_bytes(600, true);
        for offset in [0u64, 8, 500] {
            let n = wire_len(offset, fpdu.len()).unwrap();
            let mut wire = vec![0u8; n];
            insert(&fpdu, offset, true, &mut wire).unwrap();
            let mut back = vec![0u8; fpdu.len()];
            for cut in 0..n {
                let err = strip(&wire[..cut], offset, true, &mut back).unwrap_err();
                assert!(
                    matches!(err, WireError::Truncated { have, .. } if have == cut),
                    "offset {offset} cut {cut}: {err:?}"
                );
            }
            assert_eq!(strip(&wire, offset, true, &mut back), Ok((n, fpdu.len())));
        }
    }

    #[test]
    fn misaligned_offsets_and_lengths_are_refused() {
        assert!(matches!(
            MarkerLayout::new(2, 40),
            Err(WireError::InvalidField { value: 2, .. })
        ));
        assert!(matches!(
            MarkerLayout::new(0, 42),
            Err(WireError::InvalidField {
                field: "FPDU length",
                ..
            })
        ));
        assert!(MarkerLayout::new(0, 4).is_err());
        assert!(MarkerLayout::new(0, fpdu::MAX_FPDU_LEN + 2).is_err());
        let fpdu = fpdu_bytes(34, false);
        let mut out = [0u8; 64];
        assert!(insert(&fpdu, 6, false, &mut out).is_err());
        assert!(strip(&out, 6, false, &mut [0u8; 64]).is_err());
    }

    #[test]
    fn fpduptr_beyond_16_bits_is_refused() {
        // The longest FPDU placed so that its last marker lies beyond 65535 octets.
        let at = 0;
        let layout = MarkerLayout::new(at, fpdu::MAX_FPDU_LEN);
        assert!(matches!(
            layout,
            Err(WireError::InvalidField {
                field: "FPDUPTR",
                ..
            })
        ));
        // A large FPDU that stays within range is fine.
        assert!(MarkerLayout::new(at, fpdu_len(60_000)).is_ok());
    }

    #[test]
    fn insert_and_strip_report_short_buffers() {
        let fpdu = fpdu_bytes(34, true);
        let mut small = [0u8; 43];
        assert_eq!(
            insert(&fpdu, 500, true, &mut small),
            Err(WireError::BufferTooSmall {
                what: WHAT_WIRE,
                need: 44,
                have: 43
            })
        );
        assert!(matches!(
            insert(&fpdu[..39], 500, true, &mut [0u8; 64]),
            Err(WireError::Truncated {
                need: 40,
                have: 39,
                ..
            })
        ));
        let mut wire = [0u8; 44];
        insert(&fpdu, 500, true, &mut wire).unwrap();
        assert!(matches!(
            strip(&wire, 500, true, &mut [0u8; 39]),
            Err(WireError::BufferTooSmall {
                need: 40,
                have: 39,
                ..
            })
        ));
    }

    #[test]
    fn gather_with_markers_equals_insert() {
        let payload: Vec<u8> = (0..1500u32).map(|i| i as u8).collect();
        for offset in [0u64, 4, 476, 508, 1000] {
            let len = payload.len();
            let mut header = [0u8; 2];
            fpdu::emit_header(len, &mut header).unwrap();
            let pad = [0u8; 3];
            let pad = &pad[..fpdu::pad_len(len)];
            let (a, b) = payload.split_at(700);
            let slices = [&header[..], a, b, pad];
            let layout = MarkerLayout::new(offset, fpdu_len(len)).unwrap();
            let mut gather = MarkedSlices::new(layout, &slices).unwrap();
            let mut wire = Vec::new();
            for piece in &mut gather {
                match piece {
                    WirePiece::Data(bytes) => wire.extend_from_slice(bytes),
                    WirePiece::Marker(m) => wire.extend_from_slice(&m),
                }
            }
            wire.extend_from_slice(&gather.crc_wire());
            assert_eq!(gather.crc(), crc::crc32c(&wire[..wire.len() - 4]));

            let mut plain = vec![0u8; fpdu_len(len)];
            Fpdu { ulpdu: &payload }.emit(&mut plain, true).unwrap();
            let mut expected = vec![0u8; layout.wire_len()];
            insert(&plain, offset, true, &mut expected).unwrap();
            assert_eq!(wire, expected, "offset {offset}");
        }
    }

    #[test]
    fn gather_yields_the_marker_that_falls_right_before_the_crc() {
        let ulpdu: Vec<u8> = (1..=34).collect();
        let mut header = [0u8; 2];
        fpdu::emit_header(ulpdu.len(), &mut header).unwrap();
        let slices = [&header[..], &ulpdu[..]];
        let layout = MarkerLayout::new(476, 40).unwrap();
        let mut gather = MarkedSlices::new(layout, &slices).unwrap();
        let pieces: Vec<WirePiece> = (&mut gather).collect();
        assert_eq!(pieces.len(), 3);
        assert_eq!(pieces[2], WirePiece::Marker([0, 0, 0, 36]));
        let mut plain = [0u8; 40];
        Fpdu { ulpdu: &ulpdu }.emit(&mut plain, true).unwrap();
        let mut wire = [0u8; 44];
        insert(&plain, 476, true, &mut wire).unwrap();
        assert_eq!(gather.crc_wire()[..], wire[40..]);
    }

    #[test]
    fn gather_refuses_slices_that_do_not_match_the_layout() {
        let layout = MarkerLayout::new(0, 40).unwrap();
        let short = [0u8; 35];
        assert!(matches!(
            MarkedSlices::new(layout, &[&short[..]]),
            Err(WireError::InvalidField { value: 35, .. })
        ));
    }

    #[test]
    fn stream_offsets_wrap_at_2_pow_64_without_panicking() {
        let at = u64::MAX - 3; // 4 octets before a marker position
        let fpdu = fpdu_bytes(34, true);
        let layout = MarkerLayout::new(at, fpdu.len()).unwrap();
        let marker = layout.markers().next().unwrap();
        assert_eq!((marker.wire_offset, marker.stream_offset), (4, 0));
        assert_eq!(layout.next_stream_offset(), 40);
        let mut wire = [0u8; 44];
        insert(&fpdu, at, true, &mut wire).unwrap();
        let mut back = [0u8; 40];
        assert_eq!(strip(&wire, at, true, &mut back), Ok((44, 40)));
        assert_eq!(back[..], fpdu[..]);
    }

    #[test]
    fn marker_bytes_are_reserved_zero_then_fpduptr() {
        let marker = Marker {
            wire_offset: 0x1234,
            stream_offset: 0,
            fpduptr: 0x1234,
        };
        assert_eq!(marker.to_bytes(), [0, 0, 0x12, 0x34]);
    }
}
