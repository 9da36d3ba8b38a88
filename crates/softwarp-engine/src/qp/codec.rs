//! The engine's only contact with wire formats: thin adapters over `softwarp-wire`.
//!
//! Every byte layout lives in the wire crate (MPA framing in `mpa::fpdu`, CRC byte order in
//! `crc`, DDP/RDMAP headers and Terminate in `rdmap::Segment`/`TerminateRepr`); this module
//! only translates between those codecs and the engine's needs (which header bytes to read
//! before the payload, which [`Fault`] a codec error is). No I/O here.

use softwarp_wire::ddp;
use softwarp_wire::mpa::fpdu;
use softwarp_wire::mpa::marker::{self, Marker, MarkerLayout, MARKER_LEN};
use softwarp_wire::rdmap::{
    AtomicRequestRepr, AtomicResponseRepr, ControlRepr, ImmediateDataRepr, Message, Opcode,
    Placement, ReadRequestRepr, Segment, TerminateLayout, TerminateRepr, ATOMIC_REQUEST_HEADER_LEN,
    ATOMIC_RESPONSE_HEADER_LEN, IMMEDIATE_DATA_LEN, READ_REQUEST_HEADER_LEN,
};
use softwarp_wire::{crc, WireError};

use crate::fault::Fault;

/// DDP tagged header length.
pub(crate) const TAGGED_HEADER_LEN: usize = ddp::TAGGED_HEADER_LEN;
/// DDP untagged header length.
pub(crate) const UNTAGGED_HEADER_LEN: usize = ddp::UNTAGGED_HEADER_LEN;
/// The largest ULPDU header the engine emits (a Terminate with a DDP and a Read Request
/// header copied back is 18 + 4 + 2 + 18 + 28 = 70 bytes).
pub(crate) const MAX_TX_HEADER: usize = 96;
/// The STag of siw's zero-length RTR (hardware rejects STag 0, see the mr module).
pub(crate) const RTR_STAG: u32 = 1;

/// Pad bytes after a ULPDU of `len` bytes.
pub(crate) fn pad_len(len: usize) -> usize {
    fpdu::pad_len(len)
}

/// Largest ULPDU of an FPDU of at most `max_fpdu` bytes on the wire (MPA's MULPDU for that
/// EMSS, with room for markers when they are in use).
pub(crate) fn mulpdu(max_fpdu: usize, markers: bool) -> usize {
    fpdu::mulpdu(max_fpdu, markers)
}

/// Length of the marker-free FPDU that carries a ULPDU of `ulpdu_len` bytes.
pub(crate) fn fpdu_len(ulpdu_len: usize) -> usize {
    fpdu::fpdu_len(ulpdu_len)
}

/// The shortest marker-free FPDU (for the marker positions known before ULPDU_Length is);
/// not [`super::MIN_FPDU_LEN`], the smallest `max_fpdu_len` a stream accepts.
pub(crate) const SHORTEST_FPDU_LEN: usize = fpdu::MIN_FPDU_LEN;

/// Where the markers of an FPDU of `fpdu_len` marker-free octets starting at stream offset
/// `stream_offset` go; `None` when the wire crate refuses the layout (misaligned offset, or
/// an FPDU too long for 16-bit FPDUPTRs).
pub(crate) fn marker_layout(stream_offset: u64, fpdu_len: usize) -> Option<MarkerLayout> {
    MarkerLayout::new(stream_offset, fpdu_len).ok()
}

/// Checks a received marker against the one `layout` puts at that place; returns the
/// FPDUPTR found when it is not acceptable.
///
/// The wire crate checks markers only inside its whole-FPDU `marker::strip`, which a
/// zero-copy receiver cannot use; this applies the same rule to one marker at a time:
/// RESERVED (the first two octets) is ignored, FPDUPTR (the last two, big-endian) must be
/// the value the wire crate emits, or, for a later marker of an FPDU that begins with a
/// marker, that value counted from ULPDU_Length instead (4 less). See the module
/// documentation of `softwarp_wire::mpa::marker`.
pub(crate) fn check_marker(
    layout: &MarkerLayout,
    expected: &Marker,
    bytes: [u8; MARKER_LEN],
) -> Result<(), u16> {
    let fpduptr = marker::fpduptr(bytes);
    if layout.accepts(expected, fpduptr) {
        Ok(())
    } else {
        Err(fpduptr)
    }
}

/// Writes the ULPDU_Length field at the start of `buf`.
pub(crate) fn emit_mpa_len(buf: &mut [u8], ulpdu_len: usize) {
    let _ = fpdu::emit_header(ulpdu_len, buf);
}

/// Reads the ULPDU_Length field at the start of `buf`.
pub(crate) fn mpa_len(buf: &[u8]) -> usize {
    // peek gives the whole FPDU length; subtract the framing around the ULPDU.
    match buf.get(..fpdu::HEADER_LEN) {
        Some(b) => usize::from(u16::from_be_bytes([
            b.first().copied().unwrap_or(0),
            b.get(1).copied().unwrap_or(0),
        ])),
        None => 0,
    }
}

/// The CRC field bytes for a standard CRC32c value.
pub(crate) fn crc_to_wire(value: u32) -> [u8; 4] {
    crc::to_wire(value)
}

/// The standard CRC32c value a CRC field stands for.
pub(crate) fn crc_from_wire(bytes: [u8; 4]) -> u32 {
    crc::from_wire(bytes)
}

/// How many ULPDU bytes make up the header of a segment, known from its two control bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeaderLen {
    /// This many bytes (DDP header plus the opcode's own header).
    Fixed(usize),
    /// The whole ULPDU (a Terminate, whose length depends on its Hdrct bits).
    WholeUlpdu,
}

/// The header length implied by the DDP control byte and the RDMAP control byte. An unknown
/// opcode or version gives just the DDP header (the parse then reports the error).
#[inline]
pub(crate) fn rx_header_len(ddp_control: u8, rdmap_control: u8) -> HeaderLen {
    let ddp_len = ddp::header_len(ddp_control);
    let body = match ControlRepr::from_byte(rdmap_control).map(|c| c.opcode) {
        Ok(Opcode::RdmaReadRequest) => READ_REQUEST_HEADER_LEN,
        Ok(Opcode::Terminate) => return HeaderLen::WholeUlpdu,
        Ok(Opcode::ImmediateData | Opcode::ImmediateDataWithSolicitedEvent) => IMMEDIATE_DATA_LEN,
        Ok(Opcode::AtomicRequest) => ATOMIC_REQUEST_HEADER_LEN,
        Ok(Opcode::AtomicResponse) => ATOMIC_RESPONSE_HEADER_LEN,
        _ => 0,
    };
    if ddp_control & ddp::FLAG_TAGGED != 0 {
        HeaderLen::Fixed(ddp_len)
    } else {
        HeaderLen::Fixed(ddp_len + body)
    }
}

/// A received segment header, as the engine acts on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RxHeader {
    Write {
        last: bool,
        stag: u32,
        to: u64,
    },
    ReadResponse {
        last: bool,
        stag: u32,
        to: u64,
    },
    Send {
        last: bool,
        solicited: bool,
        invalidate: Option<u32>,
        msn: u32,
        mo: u32,
    },
    ReadRequest {
        last: bool,
        msn: u32,
        mo: u32,
        req: ReadRequestRepr,
    },
    Terminate,
    /// RFC 7306 Immediate Data (queue 0), with the value it carries.
    Immediate {
        solicited: bool,
        msn: u32,
        imm: u32,
    },
    /// RFC 7306 Atomic Request (queue 1).
    AtomicRequest {
        msn: u32,
        req: AtomicRequestRepr,
    },
    /// RFC 7306 Atomic Response (queue 3).
    AtomicResponse {
        msn: u32,
        resp: AtomicResponseRepr,
    },
}

/// The 8 bytes of Immediate Data carrying the 32-bit immediate value of the verbs API: the
/// value in the low-order half of the big-endian 64-bit field, the high-order half zero.
pub(crate) fn imm_to_wire(imm: u32) -> ImmediateDataRepr {
    ImmediateDataRepr {
        data: u64::from(imm).to_be_bytes(),
    }
}

/// The 32-bit immediate value of received Immediate Data (its low-order half; the verbs
/// completion has room for 32 bits only).
pub(crate) fn imm_from_wire(i: &ImmediateDataRepr) -> u32 {
    (i.as_u64() & u64::from(u32::MAX)) as u32
}

/// The Fault a wire codec error on a received header stands for.
fn fault_of(e: WireError, tagged: bool) -> Fault {
    match e {
        WireError::DdpBadVersion(_) => Fault::DdpVersion { tagged },
        WireError::DdpInvalidQueueNumber(_) => Fault::InvalidQn,
        WireError::RdmapBadVersion(_) => Fault::RdmapVersion,
        WireError::RdmapUnknownOpcode(_) | WireError::RdmapOpcodeMismatch { .. } => {
            Fault::UnexpectedOpcode
        }
        WireError::TrailingBytes { .. } => Fault::ControlMessageLength,
        WireError::Truncated { .. } => Fault::BadUlpduLength,
        _ => Fault::RdmapCatastrophic,
    }
}

/// Parses the header bytes of a received segment (`hdr` is the start of the ULPDU: the
/// header, or the whole ULPDU for a Terminate) followed by `payload_len` more bytes of the
/// ULPDU (which the engine places, or discards, without copying them here).
///
/// Refuses what `Segment::parse` refuses for the whole ULPDU: in particular a control
/// message (Read Request, Terminate, Immediate Data, Atomic Request, Atomic Response) with
/// bytes after its header (`payload_len > 0`, the wire crate's `TrailingBytes`) or too
/// short for it with its DDP header whole (`Truncated`) is
/// [`Fault::ControlMessageLength`], found before any field of it is acted on.
///
/// Without RFC 7306 (`rfc7306` false), queue 3 is no queue of the stream and the RFC 7306
/// opcodes are no opcodes of RDMAP: see [`without_rfc7306`].
///
/// The data segments (nearly every FPDU) are read by [`data_header`] in the caller's frame;
/// everything else goes to the general path, out of line. A data header `data_header`
/// accepts passes `without_rfc7306` too (queue 0 or tagged, an RFC 5040 opcode), so taking
/// it first changes no outcome.
#[inline(always)]
pub(crate) fn parse_rx_header(
    hdr: &[u8],
    payload_len: usize,
    rfc7306: bool,
) -> Result<RxHeader, Fault> {
    match data_header(hdr) {
        Some(h) => Ok(h),
        None => parse_rx_header_general(hdr, payload_len, rfc7306),
    }
}

/// [`parse_rx_header`] for every header: `Segment::parse` and the engine's own rules.
#[inline(never)]
fn parse_rx_header_general(
    hdr: &[u8],
    payload_len: usize,
    rfc7306: bool,
) -> Result<RxHeader, Fault> {
    if !rfc7306 {
        without_rfc7306(hdr)?;
    }
    let tagged = hdr.first().is_some_and(|c| c & ddp::FLAG_TAGGED != 0);
    if is_terminate(hdr) && payload_len == 0 {
        //= https://www.rfc-editor.org/rfc/rfc5040#section-4.8
        // (paraphrase) The Terminate message ends the RDMAP stream: its receiver does not
        // answer it with a Terminate of its own. Whatever Layer, EType and Error Code it
        // carries (values no RFC defines included), a whole untagged segment on queue 2
        // with the Terminate opcode is the peer's Terminate; its cause is read leniently
        // by `parse_terminate_cause`.
        return Ok(RxHeader::Terminate);
    }
    let seg = Segment::parse(hdr).map_err(|e| match e {
        // The DDP header is whole: what is cut short is the RDMAP header of a control
        // message (data messages have none).
        WireError::Truncated { .. } if ddp::HeaderRepr::parse_any_version(hdr).is_ok() => {
            Fault::ControlMessageLength
        }
        e => fault_of(e, tagged),
    })?;
    // RFC 5040 and RFC 7306 give every control message a fixed-length header after the
    // DDP header and no ULP payload (the RFC texts could not be retrieved with the team's
    // lookup tools; paraphrase): the ULPDU ends with that header. The wire crate's rule,
    // which this applies to a ULPDU whose payload is not in `hdr`: "a control message ... is
    // one whole segment (MO = 0, L = 1), its header is whole and nothing follows it".
    if seg.message.is_control() && payload_len != 0 {
        return Err(Fault::ControlMessageLength);
    }
    let data = data_rx_header(
        seg.last,
        seg.placement,
        seg.message.opcode(),
        seg.message.invalidate_stag(),
    );
    if let Some(h) = data {
        return Ok(h);
    }
    Ok(match (seg.placement, seg.message) {
        (Placement::Untagged { msn, mo }, Message::RdmaReadRequest(r)) => RxHeader::ReadRequest {
            last: seg.last,
            msn,
            mo,
            req: r,
        },
        (Placement::Untagged { msn, .. }, m) => match m.opcode() {
            Opcode::Terminate => RxHeader::Terminate,
            _ => match m {
                Message::ImmediateData(i) => RxHeader::Immediate {
                    solicited: false,
                    msn,
                    imm: imm_from_wire(&i),
                },
                Message::ImmediateDataWithSolicitedEvent(i) => RxHeader::Immediate {
                    solicited: true,
                    msn,
                    imm: imm_from_wire(&i),
                },
                Message::AtomicRequest(req) => RxHeader::AtomicRequest { msn, req },
                Message::AtomicResponse(resp) => RxHeader::AtomicResponse { msn, resp },
                _ => return Err(Fault::UnexpectedOpcode),
            },
        },
        _ => return Err(Fault::UnexpectedOpcode),
    })
}

/// The header of a data segment (RDMA Write, RDMA Read Response, a Send variant) that
/// `Segment::parse` accepts, read with the checks it makes for one, in its order (the DDP
/// header is whole with DV = 1, RV = 1, the opcode uses its buffer model and queue; a data
/// message has no header of its own and no rule about what follows); `None` for anything
/// else, which [`parse_rx_header`]'s general path then parses and reports as before.
#[inline(always)]
fn data_header(hdr: &[u8]) -> Option<RxHeader> {
    let (ddp_header, _) = ddp::HeaderRepr::parse(hdr).ok()?;
    let opcode = ControlRepr::from_byte(ddp_header.ulp_control())
        .ok()?
        .opcode;
    let (placement, queue_number, invalidate) = match ddp_header {
        ddp::HeaderRepr::Tagged(t) => (
            Placement::Tagged {
                stag: t.stag,
                tagged_offset: t.tagged_offset,
            },
            0,
            None,
        ),
        ddp::HeaderRepr::Untagged(u) => (
            Placement::Untagged {
                msn: u.msn,
                mo: u.mo,
            },
            u.queue_number,
            opcode.carries_invalidate_stag().then_some(u.ulp_reserved),
        ),
    };
    opcode.validate(ddp_header.is_tagged(), queue_number).ok()?;
    data_rx_header(ddp_header.last(), placement, opcode, invalidate)
}

/// The [`RxHeader`] of a data segment that parsed (`invalidate`: the Invalidate STag of the
/// Send with Invalidate variants); `None` for a control message's opcode.
#[inline(always)]
fn data_rx_header(
    last: bool,
    placement: Placement,
    opcode: Opcode,
    invalidate: Option<u32>,
) -> Option<RxHeader> {
    Some(match (placement, opcode) {
        (
            Placement::Tagged {
                stag,
                tagged_offset,
            },
            Opcode::RdmaWrite,
        ) => RxHeader::Write {
            last,
            stag,
            to: tagged_offset,
        },
        (
            Placement::Tagged {
                stag,
                tagged_offset,
            },
            Opcode::RdmaReadResponse,
        ) => RxHeader::ReadResponse {
            last,
            stag,
            to: tagged_offset,
        },
        (
            Placement::Untagged { msn, mo },
            Opcode::Send
            | Opcode::SendWithInvalidate
            | Opcode::SendWithSolicitedEvent
            | Opcode::SendWithSolicitedEventAndInvalidate,
        ) => RxHeader::Send {
            last,
            solicited: opcode.solicits_event(),
            invalidate,
            msn,
            mo,
        },
        _ => return None,
    })
}

/// The checks a stream without RFC 7306 adds for an untagged header, in layer order (DDP's
/// queue number before RDMAP's opcode). A header that does not parse is left to
/// `Segment::parse`, which reports it as before.
fn without_rfc7306(hdr: &[u8]) -> Result<(), Fault> {
    let Ok((ddp::HeaderRepr::Untagged(u), _)) = ddp::HeaderRepr::parse(hdr) else {
        return Ok(());
    };
    //= https://www.rfc-editor.org/rfc/rfc5040#section-4.2
    // (paraphrase) RDMAP uses three untagged queues: 0 for the Send variants, 1 for RDMA
    // Read Requests, 2 for Terminate. Queue 3 (Atomic Responses) is RFC 7306's addition.
    //= https://www.rfc-editor.org/rfc/rfc5041#section-7.2
    // (paraphrase) An untagged segment whose QN the stream does not use is an Untagged
    // Buffer Error, "Invalid QN" (code 0x01), reported by DDP.
    if u.queue_number == softwarp_wire::rdmap::queue::ATOMIC_RESPONSE {
        return Err(Fault::InvalidQn);
    }
    //= https://www.rfc-editor.org/rfc/rfc5040#section-4.8
    // (paraphrase) An opcode this RDMAP stream does not implement is a Remote Operation
    // Error, "Unexpected OpCode" (0x0/0x2/0x06); without RFC 7306, 0x8 (Immediate Data),
    // 0x9 (Immediate Data with SE), 0xA (Atomic Request) and 0xB (Atomic Response) are such
    // opcodes, as 0xC to 0xF are for every stream.
    if let Ok(c) = ControlRepr::from_byte(u.ulp_control) {
        if matches!(
            c.opcode,
            Opcode::ImmediateData
                | Opcode::ImmediateDataWithSolicitedEvent
                | Opcode::AtomicRequest
                | Opcode::AtomicResponse
        ) {
            return Err(Fault::UnexpectedOpcode);
        }
    }
    Ok(())
}

/// True when `hdr` starts with a well-formed DDP untagged header (DDP and RDMAP version 1)
/// of a single-segment message (L = 1, MO = 0) on queue 2 whose RDMAP opcode is Terminate,
/// whatever follows it.
fn is_terminate(hdr: &[u8]) -> bool {
    let Ok((ddp::HeaderRepr::Untagged(u), _)) = ddp::HeaderRepr::parse(hdr) else {
        return false;
    };
    u.last
        && u.mo == 0
        && u.queue_number == softwarp_wire::rdmap::queue::TERMINATE
        && ControlRepr::from_byte(u.ulp_control).is_ok_and(|c| c.opcode == Opcode::Terminate)
}

/// The DDP header (any version) and, for a Read Request, its RDMAP header, of the segment
/// whose header bytes are `hdr`, for copying into a Terminate.
pub(crate) fn offending_headers(hdr: &[u8]) -> (Option<ddp::HeaderRepr>, Option<ReadRequestRepr>) {
    let Ok((ddp_header, n)) = ddp::HeaderRepr::parse_any_version(hdr) else {
        return (None, None);
    };
    let rreq = match ControlRepr::from_byte(ddp_header.ulp_control()) {
        Ok(c) if c.opcode == Opcode::RdmaReadRequest && !ddp_header.is_tagged() => hdr
            .get(n..)
            .and_then(|b| ReadRequestRepr::parse(b).ok())
            .map(|r| r.0),
        _ => None,
    };
    (Some(ddp_header), rreq)
}

fn emit(seg: &Segment<'_>, buf: &mut [u8]) -> usize {
    seg.emit_header(buf).unwrap_or(0)
}

/// Writes a Send-type header; returns its length.
pub(crate) fn emit_send(
    buf: &mut [u8],
    last: bool,
    solicited: bool,
    invalidate: Option<u32>,
    msn: u32,
    mo: u32,
) -> usize {
    let message = match (solicited, invalidate) {
        (false, None) => Message::Send,
        (true, None) => Message::SendWithSolicitedEvent,
        (false, Some(invalidate_stag)) => Message::SendWithInvalidate { invalidate_stag },
        (true, Some(invalidate_stag)) => {
            Message::SendWithSolicitedEventAndInvalidate { invalidate_stag }
        }
    };
    emit(
        &Segment {
            last,
            placement: Placement::Untagged { msn, mo },
            message,
            payload: &[],
        },
        buf,
    )
}

/// Bytes of an untagged header before its MSN (DDP and RDMAP control, the reserved or
/// Invalidate STag field, the queue number): fixed for a whole Send of one kind.
pub(crate) const SEND_PREFIX_LEN: usize = 10;
/// Offset of the MSN in an untagged header (the MO follows it).
pub(crate) const UNTAGGED_MSN_OFFSET: usize = SEND_PREFIX_LEN;
/// Bytes of a tagged header before its STag (DDP and RDMAP control).
pub(crate) const WRITE_PREFIX_LEN: usize = 2;

/// The whole header of a whole (Last) Send without and with Solicited Event, with MSN and MO
/// 0, as [`emit_send`] writes it: the small-message paths copy it into sent FPDUs (then set
/// the MSN) and compare received headers' prefixes against it, so these bytes come from the
/// codec, not from constants.
pub(crate) fn send_headers() -> [[u8; UNTAGGED_HEADER_LEN]; 2] {
    send_segment_headers(true)
}

/// [`send_headers`] of a segment with the Last flag `last`.
pub(crate) fn send_segment_headers(last: bool) -> [[u8; UNTAGGED_HEADER_LEN]; 2] {
    [false, true].map(|solicited| {
        let mut hdr = [0u8; UNTAGGED_HEADER_LEN];
        emit_send(&mut hdr, last, solicited, None, 0, 0);
        hdr
    })
}

/// The first [`SEND_PREFIX_LEN`] bytes of [`send_headers`], or of the same headers without
/// the Last flag (`last` false: a segment that is not its message's last).
pub(crate) fn send_prefixes(last: bool) -> [[u8; SEND_PREFIX_LEN]; 2] {
    send_segment_headers(last).map(|hdr| {
        let mut p = [0u8; SEND_PREFIX_LEN];
        p.copy_from_slice(hdr.get(..SEND_PREFIX_LEN).unwrap_or(&[0; SEND_PREFIX_LEN]));
        p
    })
}

/// Writes into `buf` the header of a Send segment from `template`, one of
/// [`send_segment_headers`] (they differ in the Last and Solicited Event flags only), with
/// `msn` and `mo`: what [`emit_send`] writes for a Send without an Invalidate STag, without
/// encoding it field by field (a large message's FPDUs each take one). Returns its length
/// (0 when `buf` is shorter).
#[inline(always)]
pub(crate) fn put_send(
    buf: &mut [u8],
    template: &[u8; UNTAGGED_HEADER_LEN],
    msn: u32,
    mo: u32,
) -> usize {
    let Some(h) = buf.first_chunk_mut::<UNTAGGED_HEADER_LEN>() else {
        return 0;
    };
    *h = *template;
    let (_, numbers) = h.split_at_mut(UNTAGGED_MSN_OFFSET);
    if let Some((m, o)) = numbers.split_first_chunk_mut::<4>() {
        *m = msn.to_be_bytes();
        if let Some(o) = o.first_chunk_mut::<4>() {
            *o = mo.to_be_bytes();
        }
    }
    UNTAGGED_HEADER_LEN
}

/// Writes into `buf` a tagged header from `prefix` (of [`write_prefixes`] or
/// [`read_response_prefixes`]) with `stag` and the tagged offset `to`: what [`emit_write`]
/// or [`emit_read_response`] writes. Returns its length (0 when `buf` is shorter).
#[inline(always)]
pub(crate) fn put_tagged(
    buf: &mut [u8],
    prefix: &[u8; WRITE_PREFIX_LEN],
    stag: u32,
    to: u64,
) -> usize {
    let Some(h) = buf.first_chunk_mut::<TAGGED_HEADER_LEN>() else {
        return 0;
    };
    let (p, tail) = h.split_at_mut(WRITE_PREFIX_LEN);
    p.copy_from_slice(prefix);
    let (st, off) = tail.split_at_mut(4);
    st.copy_from_slice(&stag.to_be_bytes());
    off.copy_from_slice(&to.to_be_bytes());
    TAGGED_HEADER_LEN
}

/// The header prefixes (DDP and RDMAP control) of an RDMA Write segment with the Last flag
/// off and on, as [`emit_write`] writes them.
pub(crate) fn write_prefixes() -> [[u8; WRITE_PREFIX_LEN]; 2] {
    [false, true].map(|last| tagged_prefix(emit_write, last))
}

/// [`write_prefixes`] for RDMA Read Response segments ([`emit_read_response`]).
pub(crate) fn read_response_prefixes() -> [[u8; WRITE_PREFIX_LEN]; 2] {
    [false, true].map(|last| tagged_prefix(emit_read_response, last))
}

/// A tagged header's encoder ([`emit_write`], [`emit_read_response`]): buffer, Last flag,
/// STag, tagged offset; returns the header's length.
type EmitTagged = fn(&mut [u8], bool, u32, u64) -> usize;

/// The first [`WRITE_PREFIX_LEN`] bytes of the tagged header `emit` writes.
fn tagged_prefix(emit: EmitTagged, last: bool) -> [u8; WRITE_PREFIX_LEN] {
    let mut hdr = [0u8; TAGGED_HEADER_LEN];
    emit(&mut hdr, last, 0, 0);
    let mut p = [0u8; WRITE_PREFIX_LEN];
    p.copy_from_slice(
        hdr.get(..WRITE_PREFIX_LEN)
            .unwrap_or(&[0; WRITE_PREFIX_LEN]),
    );
    p
}

/// Writes an RDMA Write header; returns its length.
pub(crate) fn emit_write(buf: &mut [u8], last: bool, stag: u32, to: u64) -> usize {
    emit(
        &Segment {
            last,
            placement: Placement::Tagged {
                stag,
                tagged_offset: to,
            },
            message: Message::RdmaWrite,
            payload: &[],
        },
        buf,
    )
}

/// Writes an RDMA Read Response header; returns its length.
pub(crate) fn emit_read_response(buf: &mut [u8], last: bool, stag: u32, to: u64) -> usize {
    emit(
        &Segment {
            last,
            placement: Placement::Tagged {
                stag,
                tagged_offset: to,
            },
            message: Message::RdmaReadResponse,
            payload: &[],
        },
        buf,
    )
}

/// Writes an RDMA Read Request (DDP header and Read Request header); returns its length.
pub(crate) fn emit_read_request(
    buf: &mut [u8],
    msn: u32,
    sink_stag: u32,
    sink_to: u64,
    size: u32,
    src_stag: u32,
    src_to: u64,
) -> usize {
    emit(
        &Segment {
            last: true,
            placement: Placement::Untagged { msn, mo: 0 },
            message: Message::RdmaReadRequest(ReadRequestRepr {
                sink_stag,
                sink_tagged_offset: sink_to,
                read_size: size,
                source_stag: src_stag,
                source_tagged_offset: src_to,
            }),
            payload: &[],
        },
        buf,
    )
}

/// Writes an RFC 7306 Immediate Data message (with SE when `solicited`); returns its length.
pub(crate) fn emit_immediate(buf: &mut [u8], msn: u32, solicited: bool, imm: u32) -> usize {
    let i = imm_to_wire(imm);
    emit(
        &Segment {
            last: true,
            placement: Placement::Untagged { msn, mo: 0 },
            message: if solicited {
                Message::ImmediateDataWithSolicitedEvent(i)
            } else {
                Message::ImmediateData(i)
            },
            payload: &[],
        },
        buf,
    )
}

/// Writes an RFC 7306 Atomic Request (queue 1); returns its length.
pub(crate) fn emit_atomic_request(buf: &mut [u8], msn: u32, req: AtomicRequestRepr) -> usize {
    emit(
        &Segment {
            last: true,
            placement: Placement::Untagged { msn, mo: 0 },
            message: Message::AtomicRequest(req),
            payload: &[],
        },
        buf,
    )
}

/// Writes an RFC 7306 Atomic Response (queue 3); returns its length.
pub(crate) fn emit_atomic_response(buf: &mut [u8], msn: u32, resp: AtomicResponseRepr) -> usize {
    emit(
        &Segment {
            last: true,
            placement: Placement::Untagged { msn, mo: 0 },
            message: Message::AtomicResponse(resp),
            payload: &[],
        },
        buf,
    )
}

/// Writes a Terminate message (DDP header and Terminate header); returns its length, or
/// `None` if it does not fit.
pub(crate) fn emit_terminate(buf: &mut [u8], msn: u32, repr: TerminateRepr) -> Option<usize> {
    let seg = Segment {
        last: true,
        placement: Placement::Untagged { msn, mo: 0 },
        message: Message::Terminate(repr),
        payload: &[],
    };
    seg.emit_header(buf).ok()
}

/// The error fields of a received Terminate ULPDU: (layer, etype, code). A Terminate too
/// malformed to read reports RDMAP, remote operation error, unspecified.
pub(crate) fn parse_terminate_cause(ulpdu: &[u8], layout: TerminateLayout) -> (u8, u8, u8) {
    // RFC 5040 layout: auto-detect (a siw peer is recognised by its flag bits); a QP told
    // its peer is siw reads siw's layout.
    let parsed = match layout {
        TerminateLayout::Rfc5040 => Segment::parse(ulpdu),
        TerminateLayout::LinuxSiw => Segment::parse_with_terminate_layout(ulpdu, layout),
    };
    match parsed {
        Ok(Segment {
            message: Message::Terminate(t),
            ..
        }) => t.error.fields(),
        _ => {
            // The control word alone, if the rest is malformed; its raw fields if they name
            // no error the RFCs define (a peer's Terminate is reported as it was sent).
            let body = ulpdu.get(UNTAGGED_HEADER_LEN..);
            match body.and_then(|b| TerminateRepr::parse(b).ok()) {
                Some((t, _)) => t.error.fields(),
                None => match body.and_then(|b| b.get(..2)) {
                    Some(&[first, code]) => match layout {
                        TerminateLayout::LinuxSiw => (first & 0xf, first >> 4, code),
                        TerminateLayout::Rfc5040 => (first >> 4, first & 0xf, code),
                    },
                    _ => (0, 2, 0xff),
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_from_templates_are_what_the_codec_emits() {
        let numbers = [0u32, 1, 0x1234_5678, u32::MAX];
        for last in [false, true] {
            let sends = send_segment_headers(last);
            for (solicited, template) in [false, true].into_iter().zip(&sends) {
                for (&msn, &mo) in numbers.iter().zip(numbers.iter().rev()) {
                    let (mut want, mut got) = ([0u8; 24], [0xaa_u8; 24]);
                    let n = emit_send(&mut want, last, solicited, None, msn, mo);
                    assert_eq!(put_send(&mut got, template, msn, mo), n);
                    assert_eq!(got[..n], want[..n], "last {last} solicited {solicited}");
                    assert!(got[n..].iter().all(|&b| b == 0xaa));
                }
            }
            let at = usize::from(last);
            let tagged: [(EmitTagged, _); 2] = [
                (emit_write, write_prefixes()[at]),
                (emit_read_response, read_response_prefixes()[at]),
            ];
            for (emit, prefix) in tagged {
                for (stag, to) in [
                    (0u32, 0u64),
                    (0xdead_beef, 0x0102_0304_0506_0708),
                    (1, u64::MAX),
                ] {
                    let (mut want, mut got) = ([0u8; 24], [0xaa_u8; 24]);
                    let n = emit(&mut want, last, stag, to);
                    assert_eq!(put_tagged(&mut got, &prefix, stag, to), n);
                    assert_eq!(got[..n], want[..n], "last {last}");
                    assert!(got[n..].iter().all(|&b| b == 0xaa));
                }
            }
        }
        assert_eq!(put_send(&mut [0u8; 17], &send_headers()[0], 1, 2), 0);
        assert_eq!(put_tagged(&mut [0u8; 13], &write_prefixes()[1], 1, 2), 0);
    }

    #[test]
    fn markers_are_checked_like_the_wire_crate_strips_them() {
        // An FPDU of 1200 octets at stream offset 1024 begins with a marker; the next is at
        // 512 octets into it.
        let layout = marker_layout(1024, 1200).unwrap();
        let markers: Vec<Marker> = layout.markers().collect();
        let second = markers[1];
        assert_eq!((second.wire_offset, second.fpduptr), (512, 512));
        assert_eq!(check_marker(&layout, &second, second.to_bytes()), Ok(()));
        // RESERVED is ignored.
        assert_eq!(
            check_marker(&layout, &second, [0xff, 0xff, 0x02, 0x00]),
            Ok(())
        );
        // Counted from ULPDU_Length (4 less) is accepted after a leading marker.
        assert_eq!(check_marker(&layout, &second, [0, 0, 0x01, 0xfc]), Ok(()));
        assert_eq!(
            check_marker(&layout, &second, [0, 0, 0x01, 0xf8]),
            Err(0x1f8)
        );
        // The leading marker must say 0.
        assert_eq!(check_marker(&layout, &markers[0], [0, 0, 0, 4]), Err(4));
        // Without a leading marker there is no second reading.
        let layout = marker_layout(1000, 1200).unwrap();
        let first = layout.markers().next().unwrap();
        assert_eq!(first.fpduptr, 24);
        assert_eq!(check_marker(&layout, &first, [0, 0, 0, 20]), Err(20));
        // Layouts the wire crate refuses are None.
        assert!(marker_layout(2, 1200).is_none());
        assert!(marker_layout(0, fpdu_len(65535)).is_none());
    }

    #[test]
    fn the_data_header_fast_path_reads_every_header_as_the_general_path_does() {
        // Every RDMAP control byte, the DDP control bytes that differ in T, L, DV and the
        // reserved bits, queue numbers in and out of range, whole and cut-short headers.
        let ddp_controls = [
            0x00, 0x01, 0x02, 0x03, 0x40, 0x41, 0x42, 0x43, 0x7d, 0x80, 0x81, 0x82, 0x83, 0xc0,
            0xc1, 0xc2, 0xc3, 0xfd,
        ];
        let mut checked = 0;
        for ddp_control in ddp_controls {
            for rdmap_control in 0..=255u8 {
                for qn in [0u8, 1, 2, 3, 7] {
                    let mut buf = [0u8; 46];
                    buf[0] = ddp_control;
                    buf[1] = rdmap_control;
                    buf[2..6].copy_from_slice(&0x1234_5678u32.to_be_bytes());
                    buf[9] = qn;
                    buf[13] = 5;
                    for len in [13, 14, 18, 46] {
                        let hdr = &buf[..len];
                        for payload_len in [0, 3] {
                            for rfc7306 in [false, true] {
                                assert_eq!(
                                    parse_rx_header(hdr, payload_len, rfc7306),
                                    parse_rx_header_general(hdr, payload_len, rfc7306),
                                    "{hdr:02x?} payload {payload_len} rfc7306 {rfc7306}"
                                );
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(checked, 18 * 256 * 5 * 4 * 2 * 2);
    }

    #[test]
    fn immediate_values_are_the_low_half_of_the_immediate_data() {
        let i = imm_to_wire(0x0102_0304);
        assert_eq!(i.data, [0, 0, 0, 0, 1, 2, 3, 4]);
        assert_eq!(imm_from_wire(&i), 0x0102_0304);
        let high = ImmediateDataRepr {
            data: [9, 9, 9, 9, 0, 0, 0, 7],
        };
        assert_eq!(imm_from_wire(&high), 7);
    }
}
