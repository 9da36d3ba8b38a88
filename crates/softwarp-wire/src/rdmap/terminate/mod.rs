//! The RFC 5040 Terminate header (section 4.8), in the RFC bit layout or in Linux siw's.
//! No I/O here.
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-------+-------+---------------+-----+-------------------------+
//! | Layer | EType |  Error Code   |Hdrct|        Reserved         |  RFC 5040
//! +-------+-------+---------------+-----+-------------------------+
//! | EType | Layer |  Error Code   |Rsvd |R|D|M|    Reserved       |  Linux siw
//! +-------+-------+---------------+-----+-------------------------+
//! |  DDP Segment Length (if M or D)|                               |
//! +--------------------------------+                               |
//! |          Terminated DDP Header (if D): 14 or 18 bytes          |
//! +----------------------------------------------------------------+
//! |   Terminated RDMAP Header (if R): the 28-byte Read Request     |
//! +----------------------------------------------------------------+
//! ```
//!
//! Hdrct is M (DDP Segment Length valid), D (DDP header included), R (RDMAP header
//! included). Decisions, all made to read what peers really send:
//!
//! - The 2-byte DDP Segment Length field is present when M or D is set (it precedes the DDP
//!   header in the layout; siw always sets M and D together). Its value is kept only when M
//!   says it is valid ([`TerminateRepr::ddp_segment_length`] is `None` otherwise, and 0 is
//!   sent).
//! - The terminated DDP header's length (14 or 18) comes from its own T flag, and its DV is
//!   not checked: it is a copy of the header that caused the error, possibly a bad version.
//! - R: the only RDMAP message with a header of its own beyond the DDP header is the RDMA
//!   Read Request (28 bytes). siw sets R for remote protection errors on Send-type messages
//!   too and then sends no RDMAP header ([`TerminatedRdmapHeader::FlagOnly`]). So the 28
//!   bytes are read when R is set, the included DDP header (if any) is an untagged Read
//!   Request, and bytes remain after it.
//!
//! See the [`crate::rdmap`] module documentation for how the layout is detected.

mod codes;

pub use codes::{
    DdpError, Layer, LlpError, MpaError, RdmapError, RemoteOperationError, RemoteProtectionError,
    TaggedBufferError, TerminateError, UntaggedBufferError,
};

use super::control::{ControlRepr, Opcode};
use super::read_request::{ReadRequestRepr, READ_REQUEST_HEADER_LEN};
use crate::ddp::{self, be};
use crate::WireError;
use core::fmt;

/// Length of the Terminate Control (Layer, EType, Error Code, Hdrct, reserved).
pub const TERMINATE_CONTROL_LEN: usize = 4;

/// Length of the DDP Segment Length field.
const SEGMENT_LENGTH_LEN: usize = 2;

/// Field offsets of the Terminate header (from the end of the DDP untagged header).
mod field {
    /// The 32-bit Terminate Control.
    pub const CONTROL: usize = 0;
    /// DDP Segment Length, 16 bits, present if M or D.
    pub const SEGMENT_LENGTH: usize = 4;
}

/// RFC 5040 Hdrct bits in byte 2.
const RFC_M: u8 = 0x80;
const RFC_D: u8 = 0x40;
const RFC_R: u8 = 0x20;
/// siw's M/D/R bits in byte 2 (little-endian bitfields).
const SIW_M: u8 = 0x01;
const SIW_D: u8 = 0x02;
const SIW_R: u8 = 0x04;

/// How the first 32 bits of a Terminate header are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TerminateLayout {
    /// RFC 5040 section 4.8: Layer in the high nibble of byte 0, M/D/R at 0x80/0x40/0x20 of
    /// byte 2.
    #[default]
    Rfc5040,
    /// Linux siw: Layer in the low nibble of byte 0, EType in the high nibble, M/D/R at
    /// 0x01/0x02/0x04 of byte 2.
    LinuxSiw,
}

/// The decoded Terminate Control, layout-independent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ControlFields {
    layer: u8,
    etype: u8,
    code: u8,
    m: bool,
    d: bool,
    r: bool,
    /// The 13 reserved bits.
    reserved: u16,
}

impl TerminateLayout {
    fn decode(self, b: [u8; 4]) -> ControlFields {
        match self {
            TerminateLayout::Rfc5040 => ControlFields {
                layer: b[0] >> 4,
                etype: b[0] & 0x0f,
                code: b[1],
                m: b[2] & RFC_M != 0,
                d: b[2] & RFC_D != 0,
                r: b[2] & RFC_R != 0,
                reserved: (u16::from(b[2] & 0x1f) << 8) | u16::from(b[3]),
            },
            TerminateLayout::LinuxSiw => ControlFields {
                layer: b[0] & 0x0f,
                etype: b[0] >> 4,
                code: b[1],
                m: b[2] & SIW_M != 0,
                d: b[2] & SIW_D != 0,
                r: b[2] & SIW_R != 0,
                reserved: u16::from(b[2] >> 3) | (u16::from(b[3]) << 5),
            },
        }
    }

    /// Encodes the control; `layer` and `etype` must already fit in 4 bits.
    fn encode(self, f: ControlFields) -> [u8; 4] {
        let flag = |on: bool, bit: u8| if on { bit } else { 0 };
        let [res_hi, res_lo] = f.reserved.to_be_bytes();
        match self {
            TerminateLayout::Rfc5040 => [
                (f.layer << 4) | (f.etype & 0x0f),
                f.code,
                flag(f.m, RFC_M) | flag(f.d, RFC_D) | flag(f.r, RFC_R) | (res_hi & 0x1f),
                res_lo,
            ],
            TerminateLayout::LinuxSiw => {
                // siw: 5 reserved bits at the top of byte 2, 8 more in byte 3.
                let low5 = (f.reserved & 0x1f) as u8; // masked to 5 bits
                let high8 = ((f.reserved >> 5) & 0xff) as u8; // masked to 8 bits
                [
                    (f.etype << 4) | (f.layer & 0x0f),
                    f.code,
                    flag(f.m, SIW_M) | flag(f.d, SIW_D) | flag(f.r, SIW_R) | (low5 << 3),
                    high8,
                ]
            }
        }
    }

    /// Guesses the layout of a received Terminate Control (its first four bytes).
    ///
    /// Rules, in order: any RFC Hdrct bit (0xE0 of byte 2) means RFC 5040; else any siw flag
    /// bit (0x07 of byte 2) means siw; else siw only if the siw reading of byte 0 is a known
    /// (Layer, EType, Error Code) triple and the RFC reading is not; else RFC 5040. The
    /// [`crate::rdmap`] module documentation explains why.
    pub fn detect(control: [u8; 4]) -> Self {
        let flags = control[2];
        if flags & (RFC_M | RFC_D | RFC_R) != 0 {
            return TerminateLayout::Rfc5040;
        }
        if flags & (SIW_M | SIW_D | SIW_R) != 0 {
            return TerminateLayout::LinuxSiw;
        }
        let rfc = TerminateLayout::Rfc5040.decode(control);
        let siw = TerminateLayout::LinuxSiw.decode(control);
        let rfc_known = TerminateError::from_fields(rfc.layer, rfc.etype, rfc.code).is_known();
        let siw_known = TerminateError::from_fields(siw.layer, siw.etype, siw.code).is_known();
        if siw_known && !rfc_known {
            TerminateLayout::LinuxSiw
        } else {
            TerminateLayout::Rfc5040
        }
    }

    /// Detects the layout of the Terminate header at the start of `buf`.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if fewer than 4 bytes are present.
    pub fn detect_in(buf: &[u8]) -> Result<Self, WireError> {
        match buf.get(..TERMINATE_CONTROL_LEN) {
            Some(_) => Ok(Self::detect(be::get(buf, field::CONTROL))),
            None => Err(WireError::Truncated {
                what: "Terminate header",
                need: TERMINATE_CONTROL_LEN,
                have: buf.len(),
            }),
        }
    }
}

impl fmt::Display for TerminateLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TerminateLayout::Rfc5040 => "rfc5040",
            TerminateLayout::LinuxSiw => "siw",
        })
    }
}

/// Where the optional parts of a Terminate header lie in a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Extent {
    /// Offset and length of the terminated DDP header.
    ddp_header: Option<(usize, usize)>,
    /// Offset of the 28-byte terminated Read Request header.
    read_request: Option<usize>,
    /// Total length of the Terminate header.
    total: usize,
}

fn truncated(need: usize, have: usize) -> WireError {
    WireError::Truncated {
        what: "Terminate header",
        need,
        have,
    }
}

/// Whether a terminated DDP header is an untagged RDMA Read Request (then R means 28 bytes).
fn is_untagged_read_request(header: &[u8]) -> bool {
    let control = be::u8_at(header, 0);
    let rdmap = be::u8_at(header, 1);
    control & ddp::FLAG_TAGGED == 0 && Opcode::from(rdmap & 0x0f) == Opcode::RdmaReadRequest
}

/// The raw triple of `error`, checked to fit the 4-bit Layer and EType fields.
fn checked_fields(error: TerminateError) -> Result<(u8, u8, u8), WireError> {
    let (layer, etype, code) = error.fields();
    if layer > 0x0f {
        return Err(WireError::InvalidField {
            what: "Terminate header",
            field: "Layer",
            value: u64::from(layer),
        });
    }
    if etype > 0x0f {
        return Err(WireError::InvalidField {
            what: "Terminate header",
            field: "EType",
            value: u64::from(etype),
        });
    }
    Ok((layer, etype, code))
}

/// A read/write view of a Terminate header in a given layout.
///
/// After [`TerminateHeader::new_checked`] every part the Hdrct bits announce is in bounds;
/// an unchecked view over a short buffer reads missing bytes as zero and never panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TerminateHeader<T: AsRef<[u8]>> {
    buffer: T,
    layout: TerminateLayout,
}

impl<T: AsRef<[u8]>> TerminateHeader<T> {
    /// Wraps a buffer without checking it.
    pub const fn new_unchecked(buffer: T, layout: TerminateLayout) -> Self {
        TerminateHeader { buffer, layout }
    }

    /// Wraps a buffer after checking that it holds every part the Hdrct bits announce.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if a part is cut short.
    pub fn new_checked(buffer: T, layout: TerminateLayout) -> Result<Self, WireError> {
        let view = Self::new_unchecked(buffer, layout);
        view.check_len()?;
        Ok(view)
    }

    /// Checks that the buffer holds every part the Hdrct bits announce.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if a part is cut short.
    pub fn check_len(&self) -> Result<(), WireError> {
        self.extent().map(|_| ())
    }

    fn extent(&self) -> Result<Extent, WireError> {
        let buf = self.buffer.as_ref();
        let have = buf.len();
        if have < TERMINATE_CONTROL_LEN {
            return Err(truncated(TERMINATE_CONTROL_LEN, have));
        }
        let f = self.control();
        let mut offset = TERMINATE_CONTROL_LEN;
        if f.m || f.d {
            offset += SEGMENT_LENGTH_LEN;
            if have < offset {
                return Err(truncated(offset, have));
            }
        }
        let mut ddp_header = None;
        if f.d {
            let control = buf.get(offset).ok_or(truncated(offset + 1, have))?;
            let len = ddp::header_len(*control);
            if have < offset + len {
                return Err(truncated(offset + len, have));
            }
            ddp_header = Some((offset, len));
            offset += len;
        }
        let mut read_request = None;
        if f.r {
            let may_follow = match ddp_header {
                Some((start, _)) => is_untagged_read_request(be::tail(buf, start)),
                None => true,
            };
            if may_follow && have > offset {
                if have < offset + READ_REQUEST_HEADER_LEN {
                    return Err(truncated(offset + READ_REQUEST_HEADER_LEN, have));
                }
                read_request = Some(offset);
                offset += READ_REQUEST_HEADER_LEN;
            }
        }
        Ok(Extent {
            ddp_header,
            read_request,
            total: offset,
        })
    }

    fn control(&self) -> ControlFields {
        self.layout
            .decode(be::get(self.buffer.as_ref(), field::CONTROL))
    }

    /// Returns the wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The layout this view reads.
    pub fn layout(&self) -> TerminateLayout {
        self.layout
    }

    /// The Layer field.
    pub fn layer(&self) -> u8 {
        self.control().layer
    }

    /// The EType field.
    pub fn etype(&self) -> u8 {
        self.control().etype
    }

    /// The Error Code field.
    pub fn error_code(&self) -> u8 {
        self.control().code
    }

    /// Layer, EType and Error Code, typed.
    pub fn error(&self) -> TerminateError {
        let f = self.control();
        TerminateError::from_fields(f.layer, f.etype, f.code)
    }

    /// M: the DDP Segment Length field is valid.
    pub fn flag_m(&self) -> bool {
        self.control().m
    }

    /// D: the terminated DDP header is included.
    pub fn flag_d(&self) -> bool {
        self.control().d
    }

    /// R: the terminated RDMAP header is included.
    pub fn flag_r(&self) -> bool {
        self.control().r
    }

    /// The 13 reserved bits of the Terminate Control.
    pub fn reserved(&self) -> u16 {
        self.control().reserved
    }

    /// The DDP Segment Length field (0 when M and D are both clear).
    pub fn ddp_segment_length(&self) -> u16 {
        let f = self.control();
        if f.m || f.d {
            be::u16_at(self.buffer.as_ref(), field::SEGMENT_LENGTH)
        } else {
            0
        }
    }

    /// The terminated DDP header bytes (empty when D is clear or the view is truncated).
    pub fn terminated_ddp_header(&self) -> &[u8] {
        match self.extent() {
            Ok(Extent {
                ddp_header: Some((start, len)),
                ..
            }) => self.buffer.as_ref().get(start..start + len).unwrap_or(&[]),
            _ => &[],
        }
    }

    /// The terminated RDMAP (Read Request) header bytes (empty when absent).
    pub fn terminated_rdmap_header(&self) -> &[u8] {
        match self.extent() {
            Ok(Extent {
                read_request: Some(start),
                ..
            }) => self
                .buffer
                .as_ref()
                .get(start..start + READ_REQUEST_HEADER_LEN)
                .unwrap_or(&[]),
            _ => &[],
        }
    }

    /// The length of the Terminate header (0 if the view is truncated).
    pub fn total_len(&self) -> usize {
        self.extent().map(|e| e.total).unwrap_or(0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> TerminateHeader<T> {
    fn set_control(&mut self, f: ControlFields) {
        let bytes = self.layout.encode(f);
        be::put(self.buffer.as_mut(), field::CONTROL, bytes);
    }

    /// Sets Layer, EType and Error Code.
    ///
    /// # Errors
    /// [`WireError::InvalidField`] if Layer or EType does not fit in 4 bits (only possible
    /// with hand-made `Unknown` values).
    pub fn set_error(&mut self, error: TerminateError) -> Result<(), WireError> {
        let (layer, etype, code) = checked_fields(error)?;
        let f = self.control();
        self.set_control(ControlFields {
            layer,
            etype,
            code,
            ..f
        });
        Ok(())
    }

    /// Sets the Hdrct bits M, D and R.
    pub fn set_flags(&mut self, m: bool, d: bool, r: bool) {
        let f = self.control();
        self.set_control(ControlFields { m, d, r, ..f });
    }

    /// Sets the 13 reserved bits (send zero; for tests of receivers).
    pub fn set_reserved(&mut self, value: u16) {
        let f = self.control();
        self.set_control(ControlFields {
            reserved: value & 0x1fff,
            ..f
        });
    }

    /// Sets the DDP Segment Length field (which must be present: M or D set).
    pub fn set_ddp_segment_length(&mut self, value: u16) {
        be::set_u16(self.buffer.as_mut(), field::SEGMENT_LENGTH, value);
    }
}

/// The terminated RDMAP header of a Terminate (the R bit and what follows it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TerminatedRdmapHeader {
    /// R clear.
    #[default]
    Absent,
    /// R set but no header follows: what siw sends for a remote protection error caused by a
    /// Send-type message, which has no RDMAP header beyond the DDP header.
    FlagOnly,
    /// R set, followed by the Read Request header of the message that caused the error.
    ReadRequest(ReadRequestRepr),
}

/// A parsed Terminate header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TerminateRepr {
    /// The bit layout of the Terminate Control: found by [`TerminateRepr::parse`], used by
    /// [`TerminateRepr::emit`].
    pub layout: TerminateLayout,
    /// The error being reported.
    pub error: TerminateError,
    /// DDP Segment Length of the segment that caused the error; `Some` exactly when M is set.
    /// siw reports the ULP payload length there (128 for a 142-byte tagged ULPDU).
    pub ddp_segment_length: Option<u16>,
    /// The DDP header of the segment that caused the error; `Some` exactly when D is set.
    pub ddp_header: Option<ddp::HeaderRepr>,
    /// The RDMAP header of the message that caused the error (R).
    pub rdmap_header: TerminatedRdmapHeader,
}

impl TerminateRepr {
    /// A Terminate reporting `error` with no header copied back, in the RFC 5040 layout.
    pub fn new(error: TerminateError) -> Self {
        TerminateRepr {
            layout: TerminateLayout::Rfc5040,
            error,
            ddp_segment_length: None,
            ddp_header: None,
            rdmap_header: TerminatedRdmapHeader::Absent,
        }
    }

    /// Parses a Terminate header at the start of `buf` (the bytes after the DDP untagged
    /// header), detecting its layout with [`TerminateLayout::detect`]. Returns the header and
    /// the bytes it took.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if a part announced by the Hdrct bits is cut short.
    pub fn parse(buf: &[u8]) -> Result<(Self, usize), WireError> {
        let layout = TerminateLayout::detect_in(buf)?;
        Self::parse_with_layout(buf, layout)
    }

    /// Parses a Terminate header in the given layout. The reserved bits are ignored.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if a part announced by the Hdrct bits is cut short.
    pub fn parse_with_layout(
        buf: &[u8],
        layout: TerminateLayout,
    ) -> Result<(Self, usize), WireError> {
        //= https://www.rfc-editor.org/rfc/rfc5040#section-4
        //# The Terminate carries additional
        //# information associated with the error that caused the Terminate.
        let view = TerminateHeader::new_checked(buf, layout)?;
        let extent = view.extent()?;
        let f = view.control();
        let ddp_header = match extent.ddp_header {
            Some((start, _)) => Some(ddp::HeaderRepr::parse_any_version(be::tail(buf, start))?.0),
            None => None,
        };
        let rdmap_header = match (f.r, extent.read_request) {
            (false, _) => TerminatedRdmapHeader::Absent,
            (true, None) => TerminatedRdmapHeader::FlagOnly,
            (true, Some(start)) => {
                TerminatedRdmapHeader::ReadRequest(ReadRequestRepr::parse(be::tail(buf, start))?.0)
            }
        };
        Ok((
            TerminateRepr {
                layout,
                error: view.error(),
                ddp_segment_length: f.m.then(|| view.ddp_segment_length()),
                ddp_header,
                rdmap_header,
            },
            extent.total,
        ))
    }

    /// The encoded length: 4, plus 2 if M or D, plus the DDP header, plus 28 for a Read
    /// Request header.
    pub fn buffer_len(&self) -> usize {
        let mut len = TERMINATE_CONTROL_LEN;
        if self.ddp_segment_length.is_some() || self.ddp_header.is_some() {
            len += SEGMENT_LENGTH_LEN;
        }
        if let Some(h) = &self.ddp_header {
            len += h.buffer_len();
        }
        if let TerminatedRdmapHeader::ReadRequest(r) = &self.rdmap_header {
            len += r.buffer_len();
        }
        len
    }

    /// Writes the Terminate header at the start of `buf` in [`TerminateRepr::layout`];
    /// returns the bytes written. Reserved bits are zero.
    ///
    /// # Errors
    /// [`WireError::BufferTooSmall`] if `buf` is shorter than [`TerminateRepr::buffer_len`];
    /// [`WireError::InvalidField`] if Layer or EType does not fit in 4 bits, or if a Read
    /// Request header is paired with an included DDP header that is not an untagged Read
    /// Request (a receiver could not tell it is there).
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        let need = self.buffer_len();
        if buf.len() < need {
            return Err(WireError::BufferTooSmall {
                what: "Terminate header",
                need,
                have: buf.len(),
            });
        }
        if let (TerminatedRdmapHeader::ReadRequest(_), Some(h)) =
            (&self.rdmap_header, &self.ddp_header)
        {
            let opcode = h.ulp_control() & 0x0f;
            if h.is_tagged() || Opcode::from(opcode) != Opcode::RdmaReadRequest {
                return Err(WireError::InvalidField {
                    what: "Terminate header",
                    field: "Terminated RDMAP header",
                    value: u64::from(opcode),
                });
            }
        }
        let (layer, etype, code) = checked_fields(self.error)?;
        let mut view = TerminateHeader::new_unchecked(&mut *buf, self.layout);
        view.set_control(ControlFields {
            layer,
            etype,
            code,
            m: self.ddp_segment_length.is_some(),
            d: self.ddp_header.is_some(),
            r: !matches!(self.rdmap_header, TerminatedRdmapHeader::Absent),
            reserved: 0,
        });
        let mut offset = TERMINATE_CONTROL_LEN;
        if self.ddp_segment_length.is_some() || self.ddp_header.is_some() {
            view.set_ddp_segment_length(self.ddp_segment_length.unwrap_or(0));
            offset += SEGMENT_LENGTH_LEN;
        }
        if let Some(h) = &self.ddp_header {
            offset += h.emit(be::tail_mut(buf, offset))?;
        }
        if let TerminatedRdmapHeader::ReadRequest(r) = &self.rdmap_header {
            offset += r.emit(be::tail_mut(buf, offset))?;
        }
        Ok(offset)
    }
}

impl fmt::Display for TerminateRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} M={} D={} R={}",
            self.error,
            u8::from(self.ddp_segment_length.is_some()),
            u8::from(self.ddp_header.is_some()),
            u8::from(!matches!(self.rdmap_header, TerminatedRdmapHeader::Absent))
        )?;
        if let Some(len) = self.ddp_segment_length {
            write!(f, " seglen={len}")?;
        }
        if let Some(h) = &self.ddp_header {
            write!(f, " hdr=[{h} ")?;
            match ControlRepr::from_byte(h.ulp_control()) {
                Ok(c) => write!(f, "{}]", c.opcode)?,
                Err(_) => write!(f, "rdmap-ctrl={:#04x}]", h.ulp_control())?,
            }
        }
        if let TerminatedRdmapHeader::ReadRequest(r) = &self.rdmap_header {
            write!(f, " rreq=[{r}]")?;
        }
        if self.layout != TerminateLayout::Rfc5040 {
            write!(f, " layout={}", self.layout)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
