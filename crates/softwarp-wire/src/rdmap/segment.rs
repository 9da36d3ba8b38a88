//! One whole ULPDU (one DDP segment carrying RDMAP): the single entry point the engine and
//! the capture decoder use. No I/O here.

use super::atomic::{AtomicRequestRepr, AtomicResponseRepr};
use super::control::{queue, BufferModel, ControlRepr, Opcode};
use super::immediate::ImmediateDataRepr;
use super::read_request::ReadRequestRepr;
use super::terminate::{TerminateLayout, TerminateRepr};
use crate::ddp::{self, be, TaggedRepr, UntaggedRepr};
use crate::WireError;
use core::fmt;

/// Where a segment's payload goes: the DDP fields other than the flags and the ULP bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Tagged buffer model: a named buffer and an offset in it.
    Tagged {
        /// Data Sink STag.
        stag: u32,
        /// Data Sink Tagged Offset.
        tagged_offset: u64,
    },
    /// Untagged buffer model. The queue number is implied by the opcode
    /// ([`Opcode::buffer_model`]); [`Segment::parse`] has checked it.
    Untagged {
        /// Message Sequence Number.
        msn: u32,
        /// Message Offset.
        mo: u32,
    },
}

/// An RDMAP message: the opcode together with the header that opcode carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Message {
    /// RDMA Write (tagged). The payload is the data.
    RdmaWrite,
    /// RDMA Read Request (untagged, queue 1) with its 28-byte header. No payload.
    RdmaReadRequest(ReadRequestRepr),
    /// RDMA Read Response (tagged). The payload is the data.
    RdmaReadResponse,
    /// Send (untagged, queue 0). The payload is the data.
    Send,
    /// Send with Invalidate: the STag the receiver must invalidate rides in the DDP header.
    SendWithInvalidate {
        /// The Invalidate STag.
        invalidate_stag: u32,
    },
    /// Send with Solicited Event.
    SendWithSolicitedEvent,
    /// Send with Solicited Event and Invalidate.
    SendWithSolicitedEventAndInvalidate {
        /// The Invalidate STag.
        invalidate_stag: u32,
    },
    /// Terminate (untagged, queue 2) with its header. No payload.
    Terminate(TerminateRepr),
    /// RFC 7306 Immediate Data (untagged, queue 0): 8 bytes. No payload.
    ImmediateData(ImmediateDataRepr),
    /// RFC 7306 Immediate Data with Solicited Event. No payload.
    ImmediateDataWithSolicitedEvent(ImmediateDataRepr),
    /// RFC 7306 Atomic Request (untagged, queue 1). No payload.
    AtomicRequest(AtomicRequestRepr),
    /// RFC 7306 Atomic Response (untagged, queue 3). No payload.
    AtomicResponse(AtomicResponseRepr),
}

impl Message {
    /// The opcode of this message.
    pub fn opcode(&self) -> Opcode {
        match self {
            Message::RdmaWrite => Opcode::RdmaWrite,
            Message::RdmaReadRequest(_) => Opcode::RdmaReadRequest,
            Message::RdmaReadResponse => Opcode::RdmaReadResponse,
            Message::Send => Opcode::Send,
            Message::SendWithInvalidate { .. } => Opcode::SendWithInvalidate,
            Message::SendWithSolicitedEvent => Opcode::SendWithSolicitedEvent,
            Message::SendWithSolicitedEventAndInvalidate { .. } => {
                Opcode::SendWithSolicitedEventAndInvalidate
            }
            Message::Terminate(_) => Opcode::Terminate,
            Message::ImmediateData(_) => Opcode::ImmediateData,
            Message::ImmediateDataWithSolicitedEvent(_) => Opcode::ImmediateDataWithSolicitedEvent,
            Message::AtomicRequest(_) => Opcode::AtomicRequest,
            Message::AtomicResponse(_) => Opcode::AtomicResponse,
        }
    }

    /// The Invalidate STag of the two Send with Invalidate variants.
    pub fn invalidate_stag(&self) -> Option<u32> {
        match *self {
            Message::SendWithInvalidate { invalidate_stag }
            | Message::SendWithSolicitedEventAndInvalidate { invalidate_stag } => {
                Some(invalidate_stag)
            }
            _ => None,
        }
    }

    /// Whether the message is all header (Read Request, Terminate, Immediate Data, Atomic):
    /// such a message travels in one segment with no payload after its header.
    pub fn is_control(&self) -> bool {
        self.header_len() != 0
    }

    /// The length of the opcode-specific header after the DDP header (0 for data messages).
    pub fn header_len(&self) -> usize {
        match self {
            Message::RdmaReadRequest(r) => r.buffer_len(),
            Message::Terminate(t) => t.buffer_len(),
            Message::ImmediateData(i) | Message::ImmediateDataWithSolicitedEvent(i) => {
                i.buffer_len()
            }
            Message::AtomicRequest(a) => a.buffer_len(),
            Message::AtomicResponse(a) => a.buffer_len(),
            _ => 0,
        }
    }

    /// A name for errors about this message.
    fn what(&self) -> &'static str {
        match self {
            Message::RdmaReadRequest(_) => "RDMA Read Request",
            Message::Terminate(_) => "Terminate",
            Message::ImmediateData(_) | Message::ImmediateDataWithSolicitedEvent(_) => {
                "Immediate Data"
            }
            Message::AtomicRequest(_) => "Atomic Request",
            Message::AtomicResponse(_) => "Atomic Response",
            _ => "RDMAP message",
        }
    }

    /// Parses the opcode-specific header that follows the DDP header.
    fn parse_body(
        opcode: Opcode,
        ulp_reserved: u32,
        rest: &[u8],
        terminate_layout: Option<TerminateLayout>,
    ) -> Result<(Self, usize), WireError> {
        Ok(match opcode {
            Opcode::RdmaWrite => (Message::RdmaWrite, 0),
            Opcode::RdmaReadResponse => (Message::RdmaReadResponse, 0),
            Opcode::Send => (Message::Send, 0),
            Opcode::SendWithSolicitedEvent => (Message::SendWithSolicitedEvent, 0),
            //= https://www.rfc-editor.org/rfc/rfc5040#section-4
            //# For Send
            //# with Invalidate and Send with Solicited Event and Invalidate,
            //# RDMAP uses the second through fifth octets, provided by DDP on
            //# Untagged DDP Messages, to carry the STag that will be Invalidated.
            Opcode::SendWithInvalidate => (
                Message::SendWithInvalidate {
                    invalidate_stag: ulp_reserved,
                },
                0,
            ),
            Opcode::SendWithSolicitedEventAndInvalidate => (
                Message::SendWithSolicitedEventAndInvalidate {
                    invalidate_stag: ulp_reserved,
                },
                0,
            ),
            //= https://www.rfc-editor.org/rfc/rfc5040#section-4
            //# Two RDMA Messages carry additional RDMAP headers.
            Opcode::RdmaReadRequest => {
                let (r, n) = ReadRequestRepr::parse(rest)?;
                (Message::RdmaReadRequest(r), n)
            }
            Opcode::Terminate => {
                let (t, n) = match terminate_layout {
                    Some(layout) => TerminateRepr::parse_with_layout(rest, layout)?,
                    None => TerminateRepr::parse(rest)?,
                };
                (Message::Terminate(t), n)
            }
            Opcode::ImmediateData => {
                let (i, n) = ImmediateDataRepr::parse(rest)?;
                (Message::ImmediateData(i), n)
            }
            Opcode::ImmediateDataWithSolicitedEvent => {
                let (i, n) = ImmediateDataRepr::parse(rest)?;
                (Message::ImmediateDataWithSolicitedEvent(i), n)
            }
            Opcode::AtomicRequest => {
                let (a, n) = AtomicRequestRepr::parse(rest)?;
                (Message::AtomicRequest(a), n)
            }
            Opcode::AtomicResponse => {
                let (a, n) = AtomicResponseRepr::parse(rest)?;
                (Message::AtomicResponse(a), n)
            }
            Opcode::Unknown(v) => return Err(WireError::RdmapUnknownOpcode(v)),
        })
    }

    /// Writes the opcode-specific header (nothing for data messages).
    fn emit_body(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        match self {
            Message::RdmaReadRequest(r) => r.emit(buf),
            Message::Terminate(t) => t.emit(buf),
            Message::ImmediateData(i) | Message::ImmediateDataWithSolicitedEvent(i) => i.emit(buf),
            Message::AtomicRequest(a) => a.emit(buf),
            Message::AtomicResponse(a) => a.emit(buf),
            _ => Ok(0),
        }
    }
}

impl fmt::Display for Message {
    /// The opcode-specific part of a segment's line (empty for plain data messages).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Message::RdmaReadRequest(r) => write!(f, "{r}"),
            Message::Terminate(t) => write!(f, "{t}"),
            Message::ImmediateData(i) | Message::ImmediateDataWithSolicitedEvent(i) => {
                write!(f, "{i}")
            }
            Message::AtomicRequest(a) => write!(f, "{a}"),
            Message::AtomicResponse(a) => write!(f, "{a}"),
            Message::SendWithInvalidate { invalidate_stag }
            | Message::SendWithSolicitedEventAndInvalidate { invalidate_stag } => {
                write!(f, "inv={invalidate_stag:#010x}")
            }
            _ => Ok(()),
        }
    }
}

/// One parsed ULPDU: DDP flags and placement, the RDMAP message, and the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Segment<'a> {
    /// The DDP L flag: this segment ends its DDP message.
    pub last: bool,
    /// Where the payload goes.
    pub placement: Placement,
    /// The RDMAP message (opcode and opcode-specific header).
    pub message: Message,
    /// The ULP payload: everything after the headers (empty for control messages).
    pub payload: &'a [u8],
}

impl<'a> Segment<'a> {
    /// Parses and validates one ULPDU.
    ///
    /// Checks, in the order the layers see them: the DDP header is whole and DV = 1; an
    /// untagged segment names a queue RDMAP defines (0 to 3); RV = 1; the opcode is defined
    /// and uses its buffer model and queue; a control message (Read Request, Terminate,
    /// Immediate Data, Atomic) is one whole segment (MO = 0, L = 1), its header is whole and
    /// nothing follows it. Reserved bits are ignored. The Terminate layout is detected
    /// ([`super::TerminateLayout::detect`]).
    ///
    /// # Errors
    /// [`WireError::Truncated`], [`WireError::DdpBadVersion`],
    /// [`WireError::DdpInvalidQueueNumber`], [`WireError::RdmapBadVersion`],
    /// [`WireError::RdmapUnknownOpcode`], [`WireError::RdmapOpcodeMismatch`],
    /// [`WireError::InvalidField`] (a control message split over segments),
    /// [`WireError::TrailingBytes`] (bytes after a control message's header).
    pub fn parse(ulpdu: &'a [u8]) -> Result<Self, WireError> {
        Self::parse_inner(ulpdu, None)
    }

    /// Like [`Segment::parse`], but reads a Terminate in the given layout instead of
    /// detecting it: for an engine that knows its peer (e.g. that it is Linux siw).
    ///
    /// # Errors
    /// As [`Segment::parse`].
    pub fn parse_with_terminate_layout(
        ulpdu: &'a [u8],
        layout: TerminateLayout,
    ) -> Result<Self, WireError> {
        Self::parse_inner(ulpdu, Some(layout))
    }

    fn parse_inner(
        ulpdu: &'a [u8],
        terminate_layout: Option<TerminateLayout>,
    ) -> Result<Self, WireError> {
        let (ddp_header, ddp_len) = ddp::HeaderRepr::parse(ulpdu)?;
        let (placement, tagged, queue_number, ulp_reserved) = match ddp_header {
            ddp::HeaderRepr::Tagged(t) => (
                Placement::Tagged {
                    stag: t.stag,
                    tagged_offset: t.tagged_offset,
                },
                true,
                0,
                0,
            ),
            ddp::HeaderRepr::Untagged(u) => {
                // RFC 5041 section 7 (paraphrased): a segment for a queue the ULP does not
                // define is an untagged buffer error, "Invalid QN".
                if !queue::is_defined(u.queue_number) {
                    return Err(WireError::DdpInvalidQueueNumber(u.queue_number));
                }
                (
                    Placement::Untagged {
                        msn: u.msn,
                        mo: u.mo,
                    },
                    false,
                    u.queue_number,
                    u.ulp_reserved,
                )
            }
        };
        let control = ControlRepr::from_byte(ddp_header.ulp_control())?;
        let opcode = control.opcode;
        // RFC 5040 section 4.2 (paraphrased): the RDMA Message Definitions table gives each
        // message type its buffer model (tagged flag) and queue number. A segment that does
        // not match is rejected here as RdmapOpcodeMismatch.
        opcode.validate(tagged, queue_number)?;

        let rest = be::tail(ulpdu, ddp_len);
        let (message, body_len) =
            Message::parse_body(opcode, ulp_reserved, rest, terminate_layout)?;
        let last = ddp_header.last();
        if message.is_control() {
            check_single_segment(&message, last, placement)?;
            let extra = rest.len().saturating_sub(body_len);
            if extra != 0 {
                return Err(WireError::TrailingBytes {
                    what: message.what(),
                    extra,
                });
            }
        }
        Ok(Segment {
            last,
            placement,
            message,
            payload: be::tail(rest, body_len),
        })
    }

    /// The RDMAP opcode.
    pub fn opcode(&self) -> Opcode {
        self.message.opcode()
    }

    /// The DDP queue number (untagged segments only).
    pub fn queue_number(&self) -> Option<u32> {
        match (self.placement, self.opcode().buffer_model()) {
            (Placement::Untagged { .. }, Some(BufferModel::Untagged { queue_number })) => {
                Some(queue_number)
            }
            _ => None,
        }
    }

    /// The DDP header this segment is sent with (RDMAP control byte and Invalidate STag
    /// included).
    pub fn ddp_header(&self) -> ddp::HeaderRepr {
        // A Message's opcode is always known and fits in 4 bits, so this never falls back.
        let ulp_control = ControlRepr {
            opcode: self.opcode(),
        }
        .to_byte()
        .unwrap_or_default();
        match self.placement {
            Placement::Tagged {
                stag,
                tagged_offset,
            } => ddp::HeaderRepr::Tagged(TaggedRepr {
                version: ddp::DDP_VERSION,
                last: self.last,
                ulp_control,
                stag,
                tagged_offset,
            }),
            Placement::Untagged { msn, mo } => ddp::HeaderRepr::Untagged(UntaggedRepr {
                version: ddp::DDP_VERSION,
                last: self.last,
                ulp_control,
                ulp_reserved: self.message.invalidate_stag().unwrap_or(0),
                queue_number: self.queue_number().unwrap_or(0),
                msn,
                mo,
            }),
        }
    }

    /// The length of everything but the payload: DDP header plus opcode-specific header.
    pub fn header_len(&self) -> usize {
        let ddp_len = match self.placement {
            Placement::Tagged { .. } => ddp::TAGGED_HEADER_LEN,
            Placement::Untagged { .. } => ddp::UNTAGGED_HEADER_LEN,
        };
        ddp_len + self.message.header_len()
    }

    /// The length of the whole ULPDU: [`Segment::header_len`] plus the payload.
    pub fn buffer_len(&self) -> usize {
        self.header_len() + self.payload.len()
    }

    /// Writes everything but the payload at the start of `out`; returns
    /// [`Segment::header_len`]. The sender then sends `out[..n]` and `self.payload` together
    /// (gathered), without copying the payload.
    ///
    /// # Errors
    /// [`WireError::BufferTooSmall`] if `out` is too short; [`WireError::RdmapOpcodeMismatch`]
    /// if the placement's buffer model is not the one the message uses;
    /// [`WireError::InvalidField`] for a control message that is not a whole segment
    /// (L = 0, MO != 0) or has a payload, or for impossible header values.
    pub fn emit_header(&self, out: &mut [u8]) -> Result<usize, WireError> {
        let opcode = self.opcode();
        let tagged = matches!(self.placement, Placement::Tagged { .. });
        let model_fits = matches!(
            (opcode.buffer_model(), tagged),
            (Some(BufferModel::Tagged), true) | (Some(BufferModel::Untagged { .. }), false)
        );
        if !model_fits {
            return Err(WireError::RdmapOpcodeMismatch {
                opcode: u8::from(opcode),
                tagged,
                queue: 0,
            });
        }
        if self.message.is_control() {
            check_single_segment(&self.message, self.last, self.placement)?;
            if !self.payload.is_empty() {
                return Err(WireError::InvalidField {
                    what: self.message.what(),
                    field: "payload",
                    value: self.payload.len() as u64,
                });
            }
        }
        let need = self.header_len();
        if out.len() < need {
            return Err(WireError::BufferTooSmall {
                what: "RDMAP segment header",
                need,
                have: out.len(),
            });
        }
        let ddp_len = self.ddp_header().emit(out)?;
        let body_len = self.message.emit_body(be::tail_mut(out, ddp_len))?;
        Ok(ddp_len + body_len)
    }

    /// Writes the whole ULPDU (headers and a copy of the payload) at the start of `out`;
    /// returns [`Segment::buffer_len`]. Prefer [`Segment::emit_header`] on the data path.
    ///
    /// # Errors
    /// As [`Segment::emit_header`], and [`WireError::BufferTooSmall`] if the payload does not
    /// fit.
    pub fn emit(&self, out: &mut [u8]) -> Result<usize, WireError> {
        let need = self.buffer_len();
        if out.len() < need {
            return Err(WireError::BufferTooSmall {
                what: "RDMAP segment",
                need,
                have: out.len(),
            });
        }
        let header_len = self.emit_header(out)?;
        match out.get_mut(header_len..need) {
            Some(dst) => dst.copy_from_slice(self.payload),
            None => {
                return Err(WireError::BufferTooSmall {
                    what: "RDMAP segment",
                    need,
                    have: out.len(),
                })
            }
        }
        Ok(need)
    }
}

/// Control messages are all header and travel whole: MO = 0 and L = 1.
///
/// Every implementation known (siw included) sends them in one segment, and the codec needs
/// the whole header to type it. A split one is reported as an invalid MO or L.
fn check_single_segment(
    message: &Message,
    last: bool,
    placement: Placement,
) -> Result<(), WireError> {
    if let Placement::Untagged { mo, .. } = placement {
        if mo != 0 {
            return Err(WireError::InvalidField {
                what: message.what(),
                field: "MO",
                value: u64::from(mo),
            });
        }
    }
    if !last {
        return Err(WireError::InvalidField {
            what: message.what(),
            field: "L",
            value: 0,
        });
    }
    Ok(())
}

impl fmt::Display for Segment<'_> {
    /// One line, e.g.
    /// `ReadReq T=0 L=1 QN=1 MSN=1 MO=0 sink=0x743e8b00@0x0000560e0e3a0a50
    /// src=0x6b8cee00@0x0000557c5c166430 len=64 payload=0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.opcode(), self.ddp_header())?;
        let mut detail = DetailWriter { f, any: false };
        fmt::write(&mut detail, format_args!("{}", self.message))?;
        write!(f, " payload={}", self.payload.len())
    }
}

/// Writes a message's detail with a leading space, only when there is one.
struct DetailWriter<'f, 'g> {
    f: &'f mut fmt::Formatter<'g>,
    any: bool,
}

impl fmt::Write for DetailWriter<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if s.is_empty() {
            return Ok(());
        }
        if !self.any {
            self.any = true;
            self.f.write_str(" ")?;
        }
        self.f.write_str(s)
    }
}

#[cfg(test)]
mod tests;
