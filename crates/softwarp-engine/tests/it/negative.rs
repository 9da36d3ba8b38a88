//! Malicious or broken peers: crafted FPDUs (built with the wire crate's emitters) must each
//! produce the Terminate RFC 5040/5041/5044 prescribe, the right completion status and event,
//! move the QP to Error, and never change a byte outside a region the peer may write.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use softwarp_engine::event::AsyncEvent;
use softwarp_engine::fault::{Cause, Fault};
use softwarp_engine::memory::Region;
use softwarp_engine::mr::{Access, AccessError, PdId, Stag};
use softwarp_engine::qp::{QpState, StreamConfig, TerminateLayout};
use softwarp_engine::wr::{RecvWr, SgList, WcStatus};
use softwarp_wire::ddp::{
    self, HeaderRepr, TaggedHeader, TaggedRepr, UntaggedHeader, UntaggedRepr,
};
use softwarp_wire::mpa::Fpdu;
use softwarp_wire::rdmap::{
    DdpError, LlpError, Message, MpaError, Placement, RdmapError, ReadRequestRepr,
    RemoteOperationError, RemoteProtectionError, Segment, TaggedBufferError, TerminateError,
    TerminateRepr, TerminatedRdmapHeader, UntaggedBufferError,
};

use crate::util;
use crate::util::{contents, sge, Side};

fn stream(crc: bool) -> StreamConfig {
    let mut s = StreamConfig::for_mss(1448);
    s.crc = crc;
    s
}

/// Frames a segment as an FPDU.
fn fpdu(seg: &Segment<'_>, crc: bool) -> Vec<u8> {
    let mut ulpdu = vec![0u8; seg.buffer_len()];
    let n = seg.emit(&mut ulpdu).unwrap();
    ulpdu.truncate(n);
    frame(&ulpdu, crc)
}

fn frame(ulpdu: &[u8], crc: bool) -> Vec<u8> {
    let f = Fpdu { ulpdu };
    let mut out = vec![0u8; f.buffer_len()];
    f.emit(&mut out, crc).unwrap();
    out
}

fn write_seg(stag: Stag, to: u64, payload: &[u8]) -> Segment<'_> {
    Segment {
        last: true,
        placement: Placement::Tagged {
            stag: stag.0,
            tagged_offset: to,
        },
        message: Message::RdmaWrite,
        payload,
    }
}

fn send_seg(msn: u32, mo: u32, last: bool, message: Message, payload: &[u8]) -> Segment<'_> {
    Segment {
        last,
        placement: Placement::Untagged { msn, mo },
        message,
        payload,
    }
}

/// Everything the victim sent, split into ULPDUs.
fn sent_ulpdus(side: &mut Side, crc: bool) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    side.transmit(&mut out, || usize::MAX);
    let mut v = Vec::new();
    let mut at = 0;
    while at < out.len() {
        let (f, n) = Fpdu::parse(&out[at..], crc).unwrap();
        v.push(f.ulpdu.to_vec());
        at += n;
    }
    v
}

/// The victim's Terminate (its last FPDU), parsed.
fn terminate_of(side: &mut Side, crc: bool) -> (TerminateRepr, Vec<u8>) {
    let ulpdus = sent_ulpdus(side, crc);
    let last = ulpdus.last().expect("a Terminate was sent").clone();
    let seg = Segment::parse(&last).unwrap();
    assert_eq!(seg.placement, Placement::Untagged { msn: 1, mo: 0 });
    match seg.message {
        Message::Terminate(t) => (t, last),
        other => panic!("expected a Terminate, got {other:?}"),
    }
}

/// A victim with one remote-writable region and snapshots of every region it has.
struct Victim {
    side: Side,
    regions: Vec<Arc<Region>>,
    before: Vec<Vec<u8>>,
}

impl Victim {
    fn new(crc: bool) -> Self {
        Self::with_stream(stream(crc))
    }
    fn with_stream(s: StreamConfig) -> Self {
        Victim {
            side: Side::new(2, s),
            regions: Vec::new(),
            before: Vec::new(),
        }
    }
    fn region(&mut self, len: usize, access: Access) -> (Stag, u64) {
        let (r, stag, iova, _) = self.side.filled_region(len, access, 0xaa);
        self.regions.push(r);
        (stag, iova)
    }
    fn snapshot(&mut self) {
        self.before = self.regions.iter().map(|r| contents(r)).collect();
    }
    fn assert_untouched(&self) {
        for (r, b) in self.regions.iter().zip(&self.before) {
            assert_eq!(&contents(r), b, "a region changed");
        }
    }
    fn feed(&mut self, bytes: &[u8]) {
        self.side.receive(bytes, || 7);
    }
    /// Feeds `bytes` in one piece, whole FPDUs in one step each (`Qp::rx_whole_fpdu`, the
    /// runtime's path for bytes read ahead).
    fn feed_whole(&mut self, bytes: &[u8]) -> usize {
        self.side.receive_with(bytes, true, || usize::MAX)
    }
    fn expect_terminate(&mut self, crc: bool, error: TerminateError) -> TerminateRepr {
        let (t, _) = terminate_of(&mut self.side, crc);
        assert_eq!(t.error, error, "{t}");
        assert_eq!(self.side.qp.state(), QpState::Error);
        assert!(self.side.qp.terminate_sent());
        assert_eq!(self.side.qp.stats().terminates_sent, 1);
        t
    }
}

fn tagged_hdr(stag: Stag, to: u64) -> HeaderRepr {
    HeaderRepr::Tagged(TaggedRepr {
        version: softwarp_wire::ddp::DDP_VERSION,
        last: true,
        ulp_control: 0x40, // RV 1, opcode RDMA Write
        stag: stag.0,
        tagged_offset: to,
    })
}

/// An RDMA Write through `stag` at `to` must be refused with `error`, with the segment length
/// and the tagged header copied back, and nothing written.
fn refused_write(v: &mut Victim, stag: Stag, to: u64, error: TerminateError, fault: Fault) {
    v.snapshot();
    let payload = [0x55u8; 100];
    v.feed(&fpdu(&write_seg(stag, to, &payload), false));
    v.assert_untouched();
    let t = v.expect_terminate(false, error);
    assert_eq!(t.ddp_segment_length, Some(114), "ULPDU length: 14 + 100");
    assert_eq!(t.ddp_header, Some(tagged_hdr(stag, to)));
    assert_eq!(t.rdmap_header, TerminatedRdmapHeader::Absent);
    assert!(
        v.side.events.iter().any(|e| matches!(e,
            AsyncEvent::QpAccessError { cause: Cause::Detected(f), .. } if *f == fault)),
        "{:?}",
        v.side.events
    );
}

fn ddp_tagged(e: TaggedBufferError) -> TerminateError {
    TerminateError::Ddp(DdpError::TaggedBuffer(e))
}

fn ddp_untagged(e: UntaggedBufferError) -> TerminateError {
    TerminateError::Ddp(DdpError::UntaggedBuffer(e))
}

#[test]
fn write_to_unknown_stag_gets_ddp_invalid_stag() {
    let mut v = Victim::new(false);
    let (stag, iova) = v.region(4096, Access::REMOTE_WRITE);
    let bogus = Stag::from_parts(stag.index() + 5, stag.key());
    refused_write(
        &mut v,
        bogus,
        iova,
        ddp_tagged(TaggedBufferError::InvalidStag),
        Fault::Tagged(AccessError::InvalidStag),
    );
}

#[test]
fn write_with_wrong_key_gets_ddp_invalid_stag() {
    let mut v = Victim::new(false);
    let (stag, iova) = v.region(4096, Access::REMOTE_WRITE);
    let stale = Stag::from_parts(stag.index(), stag.key().wrapping_add(1));
    refused_write(
        &mut v,
        stale,
        iova,
        ddp_tagged(TaggedBufferError::InvalidStag),
        Fault::Tagged(AccessError::KeyMismatch),
    );
}

#[test]
fn write_beyond_the_region_gets_base_or_bounds_violation_and_no_byte_changes() {
    let mut v = Victim::new(false);
    let (stag, iova) = v.region(4096, Access::REMOTE_WRITE);
    // 100 bytes starting 50 bytes before the end.
    refused_write(
        &mut v,
        stag,
        iova + 4096 - 50,
        ddp_tagged(TaggedBufferError::BaseOrBoundsViolation),
        Fault::Tagged(AccessError::BaseOrBounds),
    );
}

#[test]
fn write_below_the_base_gets_base_or_bounds_violation() {
    let mut v = Victim::new(false);
    let (stag, iova) = v.region(4096, Access::REMOTE_WRITE);
    refused_write(
        &mut v,
        stag,
        iova - 1,
        ddp_tagged(TaggedBufferError::BaseOrBoundsViolation),
        Fault::Tagged(AccessError::BaseOrBounds),
    );
}

#[test]
fn write_with_wrapping_to_gets_to_wrap() {
    let mut v = Victim::new(false);
    let (stag, _) = v.region(4096, Access::REMOTE_WRITE);
    refused_write(
        &mut v,
        stag,
        u64::MAX - 10,
        ddp_tagged(TaggedBufferError::ToWrap),
        Fault::Tagged(AccessError::ToWrap),
    );
}

#[test]
fn write_to_a_region_of_another_pd_gets_stag_not_associated() {
    let mut v = Victim::new(false);
    let r = Arc::new(Region::new_zeroed(4096).unwrap());
    let stag = v
        .side
        .mrs
        .register(
            PdId(9),
            r.clone(),
            0,
            4096,
            Some(0x5000),
            Access::REMOTE_WRITE,
        )
        .unwrap();
    v.regions.push(r);
    refused_write(
        &mut v,
        stag,
        0x5000,
        ddp_tagged(TaggedBufferError::StagNotAssociatedWithDdpStream),
        Fault::Tagged(AccessError::PdMismatch),
    );
}

#[test]
fn write_to_a_region_without_remote_write_gets_rdmap_access_rights_violation() {
    let mut v = Victim::new(false);
    let (stag, iova) = v.region(4096, Access::REMOTE_READ | Access::LOCAL_WRITE);
    refused_write(
        &mut v,
        stag,
        iova,
        TerminateError::Rdmap(RdmapError::RemoteProtection(
            RemoteProtectionError::AccessRightsViolation,
        )),
        Fault::Tagged(AccessError::AccessRights),
    );
}

#[test]
fn write_to_an_invalidated_stag_gets_ddp_invalid_stag() {
    let mut v = Victim::new(false);
    let (stag, iova) = v.region(4096, Access::REMOTE_WRITE);
    v.side.mrs.invalidate_local(stag, util::PD).unwrap();
    refused_write(
        &mut v,
        stag,
        iova,
        ddp_tagged(TaggedBufferError::InvalidStag),
        Fault::Tagged(AccessError::Invalidated),
    );
}

#[test]
fn terminate_bytes_match_rfc_5040_layout_by_hand() {
    let mut v = Victim::new(false);
    let (stag, iova) = v.region(64, Access::REMOTE_WRITE);
    v.feed(&fpdu(&write_seg(stag, iova + 60, &[1u8; 8]), false));
    let (_, ulpdu) = terminate_of(&mut v.side, false);
    let s = stag.0.to_be_bytes();
    let to = (iova + 60).to_be_bytes();
    #[rustfmt::skip]
    let expected: Vec<u8> = [
        // DDP untagged header: T=0 L=1 DV=1, RV=1 opcode Terminate (7), reserved ULP 0,
        // QN 2, MSN 1, MO 0.
        &[0x41, 0x47, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0][..],
        // Terminate control: layer DDP (1), etype tagged buffer (1), code base or bounds
        // (1), M and D set (0xC0), reserved 0.
        &[0x11, 0x01, 0xc0, 0x00],
        // DDP Segment Length: 14 + 8 = 22.
        &[0x00, 22],
        // The offending tagged header: T=1 L=1 DV=1, RV=1 RDMA Write (0), STag, TO.
        &[0xc1, 0x40], &s, &to,
    ]
    .concat();
    assert_eq!(ulpdu, expected);
}

#[test]
fn siw_layout_is_used_when_configured() {
    let mut s = stream(false);
    s.terminate_layout = TerminateLayout::LinuxSiw;
    let mut v = Victim::with_stream(s);
    let (stag, iova) = v.region(64, Access::REMOTE_WRITE);
    v.feed(&fpdu(&write_seg(stag, iova + 60, &[1u8; 8]), false));
    let (t, ulpdu) = terminate_of(&mut v.side, false);
    assert_eq!(t.layout, TerminateLayout::LinuxSiw);
    // siw: layer in the low nibble, M/D at 0x01/0x02 (the capture's `11 01 03 00`).
    assert_eq!(&ulpdu[18..22], &[0x11, 0x01, 0x03, 0x00]);
}

#[test]
fn crc_error_gets_llp_mpa_crc_terminate_and_no_completion() {
    let mut v = Victim::new(true);
    let (stag, iova) = v.region(4096, Access::LOCAL_WRITE);
    v.side
        .qp
        .post_recv(RecvWr {
            wr_id: 1,
            sgl: SgList::single(sge(stag, iova, 0, 4096)),
        })
        .unwrap();
    let mut bytes = fpdu(&send_seg(1, 0, true, Message::Send, &[7u8; 200]), true);
    bytes[100] ^= 0x10; // corrupt one payload byte
    v.feed(&bytes);
    let t = v.expect_terminate(true, TerminateError::Llp(LlpError::Mpa(MpaError::CrcError)));
    assert_eq!(t.ddp_segment_length, None);
    assert_eq!(t.ddp_header, None);
    let wcs = v.side.recv_wcs();
    assert_eq!(wcs.len(), 1);
    assert_eq!(wcs[0].status, WcStatus::WrFlushErr, "never delivered");
    assert_eq!(v.side.qp.stats().crc_errors, 1);
    assert!(v.side.events.iter().any(|e| matches!(
        e,
        AsyncEvent::QpFatal {
            cause: Cause::Detected(Fault::Crc),
            ..
        }
    )));
}

#[test]
fn whole_fpdu_path_checks_the_crc_before_delivering() {
    for corrupt in [None, Some(30), Some(100), Some(5)] {
        let mut v = Victim::new(true);
        let (stag, iova) = v.region(4096, Access::LOCAL_WRITE);
        v.side
            .qp
            .post_recv(RecvWr {
                wr_id: 1,
                sgl: SgList::single(sge(stag, iova, 0, 4096)),
            })
            .unwrap();
        let mut bytes = fpdu(&send_seg(1, 0, true, Message::Send, &[7u8; 200]), true);
        if let Some(at) = corrupt {
            bytes[at] ^= 0x10;
        }
        // The whole FPDU and a partial one behind it (taken step by step).
        let next = fpdu(&send_seg(2, 0, true, Message::Send, &[8u8; 20]), true);
        bytes.extend_from_slice(&next[..10]);
        let consumed = v.feed_whole(&bytes);
        let wcs = v.side.recv_wcs();
        assert_eq!(wcs.len(), 1);
        match corrupt {
            None => {
                assert_eq!(wcs[0].status, WcStatus::Success);
                assert_eq!(wcs[0].byte_len, 200);
                assert_eq!(v.side.qp.stats().rx_fpdus, 1);
                assert_eq!(consumed, bytes.len());
                assert_eq!(v.side.qp.stats().rx_stream_bytes, bytes.len() as u64);
                assert_eq!(v.side.qp.state(), QpState::Rts);
            }
            Some(_) => {
                assert_eq!(wcs[0].status, WcStatus::WrFlushErr, "never delivered");
                assert_eq!(v.side.qp.stats().crc_errors, 1);
                v.expect_terminate(true, TerminateError::Llp(LlpError::Mpa(MpaError::CrcError)));
            }
        }
    }
}

#[test]
fn whole_fpdu_path_reports_protection_and_length_errors_like_the_step_path() {
    // A Write outside the region: nothing placed, tagged base-or-bounds Terminate.
    let mut v = Victim::new(true);
    let (stag, iova) = v.region(64, Access::REMOTE_WRITE);
    v.snapshot();
    v.feed_whole(&fpdu(&write_seg(stag, iova + 60, &[1u8; 8]), true));
    v.assert_untouched();
    v.expect_terminate(true, ddp_tagged(TaggedBufferError::BaseOrBoundsViolation));
    // A Send longer than its receive: nothing placed past the buffer, LocLenErr.
    let mut v = Victim::new(true);
    let (stag, iova) = v.region(64, Access::LOCAL_WRITE);
    v.side
        .qp
        .post_recv(RecvWr {
            wr_id: 1,
            sgl: SgList::single(sge(stag, iova, 0, 16)),
        })
        .unwrap();
    v.snapshot();
    v.feed_whole(&fpdu(
        &send_seg(1, 0, true, Message::Send, &[1u8; 32]),
        true,
    ));
    v.assert_untouched();
    v.expect_terminate(true, ddp_untagged(UntaggedBufferError::MessageTooLong));
    assert_eq!(v.side.recv_wcs()[0].status, WcStatus::LocLenErr);
}

#[test]
fn corrupted_header_is_reported_as_crc_error_not_as_protection_error() {
    let mut v = Victim::new(true);
    let (stag, iova) = v.region(4096, Access::REMOTE_WRITE);
    v.snapshot();
    let mut bytes = fpdu(&write_seg(stag, iova, &[7u8; 64]), true);
    bytes[5] ^= 0x80; // flips a bit of the STag
    v.feed(&bytes);
    v.assert_untouched();
    v.expect_terminate(true, TerminateError::Llp(LlpError::Mpa(MpaError::CrcError)));
}

#[test]
fn ddp_version_error_gets_invalid_ddp_version() {
    for tagged in [true, false] {
        let mut v = Victim::new(false);
        let (stag, iova) = v.region(4096, Access::REMOTE_WRITE | Access::LOCAL_WRITE);
        v.side
            .qp
            .post_recv(RecvWr {
                wr_id: 1,
                sgl: SgList::single(sge(stag, iova, 0, 4096)),
            })
            .unwrap();
        v.snapshot();
        let seg = if tagged {
            write_seg(stag, iova, &[1u8; 32])
        } else {
            send_seg(1, 0, true, Message::Send, &[1u8; 32])
        };
        let mut ulpdu = vec![0u8; seg.buffer_len()];
        seg.emit(&mut ulpdu).unwrap();
        if tagged {
            TaggedHeader::new_unchecked(&mut ulpdu[..]).set_version(2);
        } else {
            UntaggedHeader::new_unchecked(&mut ulpdu[..]).set_version(2);
        }
        v.feed(&frame(&ulpdu, false));
        v.assert_untouched();
        let want = if tagged {
            ddp_tagged(TaggedBufferError::InvalidDdpVersion)
        } else {
            ddp_untagged(UntaggedBufferError::InvalidDdpVersion)
        };
        let t = v.expect_terminate(false, want);
        let (copied, _) = HeaderRepr::parse_any_version(&ulpdu).unwrap();
        assert_eq!(t.ddp_header, Some(copied));
    }
}

#[test]
fn rdmap_version_error_gets_invalid_rdmap_version() {
    let mut v = Victim::new(false);
    let (stag, iova) = v.region(4096, Access::REMOTE_WRITE);
    v.snapshot();
    let seg = write_seg(stag, iova, &[1u8; 32]);
    let mut ulpdu = vec![0u8; seg.buffer_len()];
    seg.emit(&mut ulpdu).unwrap();
    TaggedHeader::new_unchecked(&mut ulpdu[..]).set_ulp_control(0x80); // RV 2
    v.feed(&frame(&ulpdu, false));
    v.assert_untouched();
    v.expect_terminate(
        false,
        TerminateError::Rdmap(RdmapError::RemoteOperation(
            RemoteOperationError::InvalidRdmapVersion,
        )),
    );
}

#[test]
fn unknown_opcode_gets_unexpected_opcode() {
    let mut v = Victim::new(false);
    let seg = send_seg(1, 0, true, Message::Send, &[1u8; 8]);
    let mut ulpdu = vec![0u8; seg.buffer_len()];
    seg.emit(&mut ulpdu).unwrap();
    UntaggedHeader::new_unchecked(&mut ulpdu[..]).set_ulp_control(0x4f); // opcode 0xF
    v.feed(&frame(&ulpdu, false));
    v.expect_terminate(
        false,
        TerminateError::Rdmap(RdmapError::RemoteOperation(
            RemoteOperationError::UnexpectedOpcode,
        )),
    );
}

#[test]
fn oversized_send_gets_message_too_long_and_loc_len_err() {
    let mut v = Victim::new(false);
    let (stag, iova) = v.region(4096, Access::LOCAL_WRITE);
    v.side
        .qp
        .post_recv(RecvWr {
            wr_id: 3,
            sgl: SgList::single(sge(stag, iova, 100, 50)),
        })
        .unwrap();
    v.snapshot();
    v.feed(&fpdu(
        &send_seg(1, 0, true, Message::Send, &[9u8; 100]),
        false,
    ));
    v.assert_untouched();
    let t = v.expect_terminate(false, ddp_untagged(UntaggedBufferError::MessageTooLong));
    assert_eq!(t.ddp_segment_length, Some(118));
    assert_eq!(
        t.ddp_header,
        Some(HeaderRepr::Untagged(UntaggedRepr {
            version: softwarp_wire::ddp::DDP_VERSION,
            last: true,
            ulp_control: 0x43,
            ulp_reserved: 0,
            queue_number: 0,
            msn: 1,
            mo: 0,
        }))
    );
    let wcs = v.side.recv_wcs();
    assert_eq!(wcs.len(), 1);
    assert_eq!(wcs[0].wr_id, 3);
    assert_eq!(wcs[0].status, WcStatus::LocLenErr);
    assert!(v.side.events.iter().any(|e| matches!(
        e,
        AsyncEvent::QpRequestError {
            cause: Cause::Detected(Fault::MessageTooLong),
            ..
        }
    )));
}

/// A Victim with one 150-byte receive posted (and its region snapshotted), fed a 100-byte
/// first segment of message 1 and then `second`.
fn second_segment(second: Segment<'_>) -> Victim {
    let mut v = Victim::new(false);
    let (stag, iova) = v.region(4096, Access::LOCAL_WRITE);
    v.side
        .qp
        .post_recv(RecvWr {
            wr_id: 3,
            sgl: SgList::single(sge(stag, iova, 0, 150)),
        })
        .unwrap();
    v.snapshot();
    let mut bytes = fpdu(&send_seg(1, 0, false, Message::Send, &[9u8; 100]), false);
    bytes.extend(fpdu(&second, false));
    v.feed(&bytes);
    v
}

#[test]
fn oversized_multi_segment_send_stops_at_the_buffer_end() {
    let mut v = second_segment(send_seg(1, 100, true, Message::Send, &[8u8; 100]));
    let got = contents(&v.regions[0]);
    assert_eq!(
        &got[..100],
        &[9u8; 100],
        "the first segment fits and is placed"
    );
    assert_eq!(&got[100..], &v.before[0][100..], "nothing past it");
    v.expect_terminate(false, ddp_untagged(UntaggedBufferError::MessageTooLong));
    assert_eq!(v.side.recv_wcs()[0].status, WcStatus::LocLenErr);
}

#[test]
fn a_later_send_segment_is_checked_like_the_first() {
    // The expected segment, with Solicited Event: accepted, completed as solicited.
    let mut v = second_segment(send_seg(
        1,
        100,
        true,
        Message::SendWithSolicitedEvent,
        &[8u8; 50],
    ));
    let wcs = v.side.recv_wcs();
    assert_eq!(wcs.len(), 1);
    assert_eq!((wcs[0].status, wcs[0].byte_len), (WcStatus::Success, 150));
    assert!(wcs[0].solicited);
    assert_eq!(&contents(&v.regions[0])[100..150], &[8u8; 50]);
    // The wrong MO: Invalid MO, the receive completes in error.
    let mut v = second_segment(send_seg(1, 96, true, Message::Send, &[8u8; 50]));
    v.expect_terminate(
        false,
        ddp_untagged(UntaggedBufferError::InvalidMessageOffset),
    );
    assert_eq!(v.side.recv_wcs()[0].status, WcStatus::LocQpOpErr);
    // The wrong MSN: Invalid MSN range.
    let mut v = second_segment(send_seg(2, 100, true, Message::Send, &[8u8; 50]));
    v.expect_terminate(false, ddp_untagged(UntaggedBufferError::InvalidMsnRange));
}

#[test]
fn send_without_posted_receive_gets_no_buffer_available() {
    let mut v = Victim::new(false);
    v.feed(&fpdu(
        &send_seg(1, 0, true, Message::Send, &[1u8; 10]),
        false,
    ));
    v.expect_terminate(false, ddp_untagged(UntaggedBufferError::InvalidMsnNoBuffer));
    assert!(v.side.events.iter().any(|e| matches!(
        e,
        AsyncEvent::QpRequestError {
            cause: Cause::Detected(Fault::NoReceiveBuffer),
            ..
        }
    )));
}

#[test]
fn send_with_wrong_msn_gets_msn_range_error() {
    let mut v = Victim::new(false);
    let (stag, iova) = v.region(64, Access::LOCAL_WRITE);
    v.side
        .qp
        .post_recv(RecvWr {
            wr_id: 1,
            sgl: SgList::single(sge(stag, iova, 0, 64)),
        })
        .unwrap();
    v.feed(&fpdu(
        &send_seg(5, 0, true, Message::Send, &[1u8; 10]),
        false,
    ));
    v.expect_terminate(false, ddp_untagged(UntaggedBufferError::InvalidMsnRange));
}

#[test]
fn send_with_wrong_mo_gets_invalid_mo() {
    let mut v = Victim::new(false);
    let (stag, iova) = v.region(64, Access::LOCAL_WRITE);
    v.side
        .qp
        .post_recv(RecvWr {
            wr_id: 1,
            sgl: SgList::single(sge(stag, iova, 0, 64)),
        })
        .unwrap();
    v.snapshot();
    v.feed(&fpdu(
        &send_seg(1, 8, true, Message::Send, &[1u8; 10]),
        false,
    ));
    v.assert_untouched();
    v.expect_terminate(
        false,
        ddp_untagged(UntaggedBufferError::InvalidMessageOffset),
    );
}

fn read_request(msn: u32, src: Stag, src_to: u64, size: u32) -> Segment<'static> {
    Segment {
        last: true,
        placement: Placement::Untagged { msn, mo: 0 },
        message: Message::RdmaReadRequest(ReadRequestRepr {
            sink_stag: 0x1234_5600,
            sink_tagged_offset: 0x7000,
            read_size: size,
            source_stag: src.0,
            source_tagged_offset: src_to,
        }),
        payload: &[],
    }
}

#[test]
fn read_request_for_a_bad_source_gets_remote_protection_with_the_read_request_header() {
    let cases = [
        (0, Access::REMOTE_READ, RemoteProtectionError::InvalidStag),
        (
            1,
            Access::REMOTE_READ,
            RemoteProtectionError::BaseOrBoundsViolation,
        ),
        (
            2,
            Access::REMOTE_WRITE,
            RemoteProtectionError::AccessRightsViolation,
        ),
    ];
    for (case, access, want) in cases {
        let mut v = Victim::new(false);
        let (stag, iova) = v.region(4096, access);
        let (src, to, size) = match case {
            0 => (Stag::from_parts(stag.index(), stag.key() ^ 0xff), iova, 16),
            1 => (stag, iova + 4000, 200),
            _ => (stag, iova, 16),
        };
        let seg = read_request(1, src, to, size);
        v.feed(&fpdu(&seg, false));
        let ulpdus = sent_ulpdus(&mut v.side, false);
        assert_eq!(ulpdus.len(), 1, "no Read Response, only the Terminate");
        let Message::Terminate(t) = Segment::parse(&ulpdus[0]).unwrap().message else {
            panic!()
        };
        assert_eq!(
            t.error,
            TerminateError::Rdmap(RdmapError::RemoteProtection(want))
        );
        assert_eq!(t.ddp_segment_length, Some(46));
        assert_eq!(t.ddp_header, Some(seg.ddp_header()));
        let Message::RdmaReadRequest(r) = seg.message else {
            panic!()
        };
        assert_eq!(t.rdmap_header, TerminatedRdmapHeader::ReadRequest(r));
        assert_eq!(v.side.qp.state(), QpState::Error);
    }
}

#[test]
fn a_read_request_beyond_ird_gets_a_catastrophic_terminate_naming_that_request() {
    let mut s = stream(false);
    s.ird = 1;
    let mut v = Victim::with_stream(s);
    let (stag, iova) = v.region(4096, Access::REMOTE_READ);
    // Two requests arrive before the responder transmits anything.
    let mut bytes = fpdu(&read_request(1, stag, iova, 100), false);
    bytes.extend(fpdu(&read_request(2, stag, iova, 100), false));
    v.feed(&bytes);
    let ulpdus = sent_ulpdus(&mut v.side, false);
    let Message::Terminate(t) = Segment::parse(ulpdus.last().unwrap()).unwrap().message else {
        panic!()
    };
    assert_eq!(
        t.error,
        TerminateError::Rdmap(RdmapError::RemoteOperation(
            RemoteOperationError::CatastrophicLocalToStream
        ))
    );
    assert!(matches!(t.rdmap_header, TerminatedRdmapHeader::ReadRequest(r) if r.read_size == 100));
    assert!(v.side.events.iter().any(|e| matches!(
        e,
        AsyncEvent::QpRequestError {
            cause: Cause::Detected(Fault::IrdExceeded),
            ..
        }
    )));
}

#[test]
fn send_with_invalidate_of_a_protected_stag_gets_cannot_invalidate_and_rem_inv_req_err() {
    let mut v = Victim::new(false);
    let (rstag, riova) = v.region(64, Access::LOCAL_WRITE);
    let (protected, _) = v.region(64, Access::REMOTE_WRITE); // no REMOTE_INVALIDATE
    v.side
        .qp
        .post_recv(RecvWr {
            wr_id: 4,
            sgl: SgList::single(sge(rstag, riova, 0, 64)),
        })
        .unwrap();
    v.feed(&fpdu(
        &send_seg(
            1,
            0,
            true,
            Message::SendWithInvalidate {
                invalidate_stag: protected.0,
            },
            &[1u8; 10],
        ),
        false,
    ));
    v.expect_terminate(
        false,
        TerminateError::Rdmap(RdmapError::RemoteProtection(
            RemoteProtectionError::StagCannotBeInvalidated,
        )),
    );
    let wcs = v.side.recv_wcs();
    assert_eq!(wcs[0].status, WcStatus::RemInvReqErr);
    assert!(v.side.mrs.info(protected).unwrap().valid, "not invalidated");
}

#[test]
fn read_response_without_outstanding_read_is_refused_and_writes_nothing() {
    let mut v = Victim::new(false);
    let (stag, iova) = v.region(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    v.snapshot();
    let seg = Segment {
        last: true,
        placement: Placement::Tagged {
            stag: stag.0,
            tagged_offset: iova,
        },
        message: Message::RdmaReadResponse,
        payload: &[3u8; 64],
    };
    v.feed(&fpdu(&seg, false));
    v.assert_untouched();
    v.expect_terminate(
        false,
        TerminateError::Rdmap(RdmapError::RemoteOperation(
            RemoteOperationError::UnexpectedOpcode,
        )),
    );
}

#[test]
fn ulpdu_too_short_for_a_header_gets_a_terminate() {
    let mut v = Victim::new(false);
    v.feed(&frame(&[0x41, 0x43, 0, 0], false));
    let (t, _) = terminate_of(&mut v.side, false);
    assert!(matches!(t.error, TerminateError::Rdmap(_)));
    assert_eq!(v.side.qp.state(), QpState::Error);
}

#[test]
fn nothing_is_received_after_a_terminate_was_queued() {
    let mut v = Victim::new(false);
    let (stag, iova) = v.region(4096, Access::REMOTE_WRITE);
    let bogus = Stag::from_parts(stag.index() + 1, 0);
    let mut bytes = fpdu(&write_seg(bogus, iova, &[1u8; 8]), false);
    bytes.extend(fpdu(&write_seg(stag, iova, &[2u8; 8]), false));
    v.snapshot();
    let n = v.side.qp.handle_rx(&bytes, &mut v.side.mrs, None);
    assert_eq!(n, 22 + 2 + 4, "only the first FPDU is consumed");
    v.assert_untouched();
    let _ = ddp::TAGGED_HEADER_LEN;
}

#[test]
fn a_siw_layout_terminate_from_the_peer_is_understood() {
    // What siw sent in siw-terminate-rping.pcap: DDP, tagged buffer error, base or bounds,
    // M and D in siw's bit positions, the payload length, the offending tagged header.
    let mut v = Victim::new(false);
    let (kstag, kiova) = v.region(64, Access::LOCAL_WRITE);
    v.side
        .qp
        .post_send(
            &softwarp_engine::wr::SendWr {
                wr_id: 8,
                op: softwarp_engine::wr::SendOp::Read {
                    remote_addr: 0x1000,
                    rkey: Stag(0x4400),
                },
                payload: softwarp_engine::wr::Payload::Sgl(SgList::single(sge(
                    kstag, kiova, 0, 64,
                ))),
                signaled: true,
                fence: false,
            },
            &v.side.mrs,
        )
        .unwrap();
    let _ = sent_ulpdus(&mut v.side, false); // the Read Request
    let mut t = TerminateRepr::new(TerminateError::Ddp(DdpError::TaggedBuffer(
        TaggedBufferError::BaseOrBoundsViolation,
    )));
    t.layout = TerminateLayout::LinuxSiw;
    t.ddp_segment_length = Some(128);
    t.ddp_header = Some(tagged_hdr(kstag, kiova));
    let mut ulpdu = vec![0u8; 64];
    let n = Segment {
        last: true,
        placement: Placement::Untagged { msn: 1, mo: 0 },
        message: Message::Terminate(t),
        payload: &[],
    }
    .emit_header(&mut ulpdu)
    .unwrap();
    ulpdu.truncate(n);
    assert_eq!(
        &ulpdu[18..22],
        &[0x11, 0x01, 0x03, 0x00],
        "siw's control bytes"
    );
    v.feed(&frame(&ulpdu, false));
    assert_eq!(v.side.qp.state(), QpState::Error);
    assert!(
        v.side.events.iter().any(|e| matches!(
            e,
            AsyncEvent::QpAccessError {
                cause: Cause::PeerTerminate {
                    layer: 1,
                    etype: 1,
                    code: 1
                },
                ..
            }
        )),
        "{:?}",
        v.side.events
    );
    let wcs = v.side.send_wcs();
    assert_eq!((wcs[0].wr_id, wcs[0].status), (8, WcStatus::RemAccessErr));
    assert_eq!(v.side.qp.stats().terminates_received, 1);
    assert_eq!(
        v.side.qp.stats().terminates_sent,
        0,
        "no Terminate answers a Terminate"
    );
}

#[test]
fn a_read_request_with_extra_or_missing_bytes_gets_a_catastrophic_terminate_naming_it() {
    for delta in [1isize, 4, 1000, -1, -27] {
        for crc in [false, true] {
            let mut v = Victim::new(crc);
            let (stag, iova) = v.region(4096, Access::REMOTE_READ);
            let seg = read_request(1, stag, iova, 100);
            let mut ulpdu = vec![0u8; seg.buffer_len()];
            let n = seg.emit(&mut ulpdu).unwrap();
            ulpdu.truncate(n);
            if delta > 0 {
                ulpdu.extend(std::iter::repeat_n(0xee, delta.unsigned_abs()));
            } else {
                ulpdu.truncate(n - delta.unsigned_abs());
            }
            v.feed(&frame(&ulpdu, crc));
            let ulpdus = sent_ulpdus(&mut v.side, crc);
            assert_eq!(
                ulpdus.len(),
                1,
                "{delta}: no Read Response, only the Terminate"
            );
            // The exact Terminate: M and D always (the DDP header is whole), R when the Read
            // Request header is whole too.
            let mut t = TerminateRepr::new(TerminateError::Rdmap(RdmapError::RemoteOperation(
                RemoteOperationError::CatastrophicLocalToStream,
            )));
            t.ddp_segment_length = Some(ulpdu.len() as u16);
            t.ddp_header = Some(seg.ddp_header());
            if delta > 0 {
                let Message::RdmaReadRequest(r) = seg.message else {
                    panic!()
                };
                t.rdmap_header = TerminatedRdmapHeader::ReadRequest(r);
            }
            let want = Segment {
                last: true,
                placement: Placement::Untagged { msn: 1, mo: 0 },
                message: Message::Terminate(t),
                payload: &[],
            };
            let mut want_bytes = vec![0u8; want.buffer_len()];
            let n = want.emit(&mut want_bytes).unwrap();
            want_bytes.truncate(n);
            assert_eq!(ulpdus[0], want_bytes, "{delta} crc {crc}");
            assert_eq!(v.side.qp.state(), QpState::Error);
            assert!(v.side.events.iter().any(|e| matches!(
                e,
                AsyncEvent::QpFatal {
                    cause: Cause::Detected(Fault::ControlMessageLength),
                    ..
                }
            )));
        }
    }
}

/// A peer that stops inside an FPDU: the runtime's stall timer calls `handle_rx_stall`. At
/// every split point of a Write's FPDU (inside the header, the payload and the CRC) the QP
/// reports that it is inside an FPDU, and the stall ends the stream with RDMAP "Catastrophic
/// error, localized to RDMAP Stream" with nothing copied back, lets go of the registration
/// (deregistered meanwhile) and completes nothing. At an FPDU boundary the QP is not inside
/// one and the call does nothing.
#[test]
fn a_stall_inside_an_fpdu_terminates_the_stream_and_releases_the_registration() {
    for crc in [false, true] {
        let whole = fpdu(&write_seg(Stag(0x100), 0, &[0x55u8; 100]), crc);
        for split in 1..whole.len() {
            let mut v = Victim::new(crc);
            let (stag, to) = v.region(256, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
            let bytes = fpdu(&write_seg(stag, to, &[0x55u8; 100]), crc);
            assert_eq!(bytes.len(), whole.len());
            assert!(!v.side.qp.rx_in_fpdu(), "nothing received yet");
            v.side.qp.handle_rx_stall();
            assert_eq!(
                v.side.qp.state(),
                QpState::Rts,
                "a stall between FPDUs is none"
            );

            v.feed(&bytes[..split]);
            assert!(v.side.qp.rx_in_fpdu(), "split {split}: inside the FPDU");
            let memory = v.side.mrs.memory(stag).unwrap();
            v.side.mrs.deregister(stag).unwrap();
            v.side.qp.handle_rx_stall();
            let t = v.expect_terminate(
                crc,
                TerminateError::Rdmap(RdmapError::RemoteOperation(
                    RemoteOperationError::CatastrophicLocalToStream,
                )),
            );
            assert_eq!(t.ddp_segment_length, None, "nothing copied back");
            assert_eq!(t.ddp_header, None);
            assert!(!v.side.qp.rx_in_fpdu());
            assert_eq!(
                memory.strong_count(),
                0,
                "split {split}: the memory is let go"
            );
            let wcs = v.side.recv_wcs();
            assert!(
                wcs.iter().all(|wc| wc.status == WcStatus::WrFlushErr),
                "{wcs:?}"
            );
            assert!(v.side.events.iter().any(|e| matches!(
                e,
                AsyncEvent::QpFatal {
                    cause: Cause::Detected(Fault::RxStall),
                    ..
                }
            )));
        }
    }
}

//= https://www.rfc-editor.org/rfc/rfc5040#section-4.8
// (paraphrase) A received Terminate ends the RDMAP stream; it is never answered with a
// Terminate, whatever Layer, EType and Error Code it carries.
#[test]
fn a_terminate_with_undefined_error_values_is_reported_and_not_answered() {
    // The Terminate control word (Layer/EType, Error Code, Hdrct, reserved) and what follows
    // it; the cause the QP reports.
    type Case<'a> = (&'a [u8], (u8, u8, u8));
    let cases: [Case<'_>; 5] = [
        // Layer 0xF, EType 0xE, Error Code 0xEE: no RFC defines them.
        (&[0xfe, 0xee, 0x00, 0x00], (0xf, 0xe, 0xee)),
        // Layer 3, EType 0xF, Error Code 0xFF, reserved bits set.
        (&[0x3f, 0xff, 0x1f, 0xff], (3, 0xf, 0xff)),
        // M and D set but no DDP Segment Length or header copied.
        (&[0xfe, 0xee, 0xc0, 0x00], (0xf, 0xe, 0xee)),
        // Octets after the control word that no Hdrct bit announces.
        (&[0x3f, 0xff, 0x00, 0x00, 1, 2, 3, 4], (3, 0xf, 0xff)),
        // Only half a control word: Layer, EType and Error Code as far as they came.
        (&[0x25, 0x10], (2, 5, 0x10)),
    ];
    for (body, (layer, etype, code)) in cases {
        let mut v = Victim::new(false);
        // DDP untagged header (L = 1, queue 2, MSN 1, MO 0), RDMAP Terminate opcode.
        let mut ulpdu = vec![0x41, 0x47, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0];
        ulpdu.extend_from_slice(body);
        v.feed(&frame(&ulpdu, false));
        assert_eq!(v.side.qp.state(), QpState::Error, "{body:02x?}");
        let want = Cause::PeerTerminate { layer, etype, code };
        assert!(
            v.side.events.iter().any(|e| matches!(
                e,
                AsyncEvent::QpFatal { cause, .. } if *cause == want
            )),
            "{body:02x?}: {:?}",
            v.side.events
        );
        assert_eq!(v.side.qp.stats().terminates_received, 1, "{body:02x?}");
        assert!(
            sent_ulpdus(&mut v.side, false).is_empty(),
            "{body:02x?}: nothing is sent back"
        );
        assert!(!v.side.qp.terminate_sent());
        assert_eq!(v.side.qp.stats().terminates_sent, 0);
    }
}

/// Without RFC 7306 on the stream, its opcodes are unexpected (RDMAP 0/2/0x06) and its
/// queue 3 is no queue (DDP 1/2/0x01); with it, a Send on queue 3 is an opcode on the
/// wrong queue.
#[test]
fn rfc7306_opcodes_and_queue_3_follow_the_streams_rfc7306_setting() {
    let unexpected = TerminateError::Rdmap(RdmapError::RemoteOperation(
        RemoteOperationError::UnexpectedOpcode,
    ));
    let invalid_qn = ddp_untagged(UntaggedBufferError::InvalidQueueNumber);
    // (RDMAP control byte, queue, RFC 7306 on, expected error)
    let cases = [
        (0x48u8, 0u32, false, unexpected), // Immediate Data
        (0x49, 0, false, unexpected),      // Immediate Data with SE
        (0x4a, 1, false, unexpected),      // Atomic Request
        (0x4b, 3, false, invalid_qn),      // Atomic Response
        (0x43, 3, false, invalid_qn),      // Send on queue 3
        (0x43, 3, true, unexpected),       // Send on queue 3
        (0x43, 4, true, invalid_qn),       // Send on queue 4
    ];
    for (ctrl, qn, rfc7306, error) in cases {
        let mut s = stream(false);
        s.rfc7306 = rfc7306;
        let mut v = Victim::with_stream(s);
        let seg = send_seg(1, 0, true, Message::Send, &[1u8; 8]);
        let mut ulpdu = vec![0u8; seg.buffer_len()];
        seg.emit(&mut ulpdu).unwrap();
        let mut h = UntaggedHeader::new_unchecked(&mut ulpdu[..]);
        h.set_ulp_control(ctrl);
        h.set_queue_number(qn);
        v.feed(&frame(&ulpdu, false));
        let t = v.expect_terminate(false, error);
        assert_eq!(
            t.ddp_segment_length,
            Some(ulpdu.len() as u16),
            "{ctrl:#x} {qn}"
        );
    }
}

// Runs (`Qp::rx_run_fpdu`): the middle FPDUs of a message, taken by comparing their headers
// with the one before, are still checked one by one. Each test feeds whole FPDUs (the
// runtime's read-ahead), where runs are taken, and counts them, so that it tests the run
// path and not only the general one.

/// The FPDUs of one Write of `n` segments of `each` bytes (segment `i` filled with `i + 1`)
/// to `stag` from `iova` on, the last one with the Last flag.
fn write_run(stag: Stag, iova: u64, n: usize, each: usize, crc: bool) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            let payload = vec![i as u8 + 1; each];
            let seg = Segment {
                last: i + 1 == n,
                placement: Placement::Tagged {
                    stag: stag.0,
                    tagged_offset: iova + (i * each) as u64,
                },
                message: Message::RdmaWrite,
                payload: &payload,
            };
            fpdu(&seg, crc)
        })
        .collect()
}

#[test]
fn a_run_stops_at_the_first_fpdu_after_its_stag_was_deregistered_or_invalidated() {
    for deregister in [true, false] {
        let mut v = Victim::new(false);
        let (stag, iova) = v.region(8192, Access::REMOTE_WRITE);
        let fpdus = write_run(stag, iova, 6, 1000, false);
        v.feed_whole(&fpdus[..3].concat());
        assert_eq!(v.side.qp.stats().rx_run_fpdus, 2, "FPDUs 2 and 3 in a run");
        let got = contents(&v.regions[0]);
        assert!(got[..3000]
            .iter()
            .enumerate()
            .all(|(i, &b)| b == (i / 1000) as u8 + 1));
        if deregister {
            v.side.mrs.deregister(stag).unwrap();
        } else {
            v.side.mrs.invalidate_local(stag, util::PD).unwrap();
        }
        // The application may reuse the memory from here on: the peer writes nothing more.
        v.snapshot();
        v.feed_whole(&fpdus[3..].concat());
        v.assert_untouched();
        v.expect_terminate(false, ddp_tagged(TaggedBufferError::InvalidStag));
        assert_eq!(v.side.qp.stats().rx_run_fpdus, 2, "deregister {deregister}");
    }
}

#[test]
fn a_run_stops_at_the_end_of_its_registration_not_of_the_memory() {
    let mut v = Victim::new(false);
    let (r, _, _, _) = v.side.filled_region(4000, Access::NONE, 0xbb);
    let iova = 0x7700_0000;
    let stag = v
        .side
        .mrs
        .register(
            util::PD,
            r.clone(),
            0,
            2500,
            Some(iova),
            Access::REMOTE_WRITE,
        )
        .unwrap();
    v.regions.push(r);
    v.snapshot();
    v.feed_whole(&write_run(stag, iova, 4, 1000, false).concat());
    assert_eq!(v.side.qp.stats().rx_run_fpdus, 1, "FPDU 2 in a run");
    let got = contents(&v.regions[0]);
    assert!(got[..2000]
        .iter()
        .enumerate()
        .all(|(i, &b)| b == (i / 1000) as u8 + 1));
    assert_eq!(
        &got[2000..],
        &v.before[0][2000..],
        "nothing past the first two"
    );
    v.expect_terminate(false, ddp_tagged(TaggedBufferError::BaseOrBoundsViolation));
}

#[test]
fn a_corrupted_fpdu_in_a_run_is_a_crc_error_and_delivers_nothing() {
    for write in [false, true] {
        let mut v = Victim::new(true);
        let (stag, iova) = v.region(8192, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        let mut fpdus = if write {
            write_run(stag, iova, 5, 1000, true)
        } else {
            v.side
                .qp
                .post_recv(RecvWr {
                    wr_id: 1,
                    sgl: SgList::single(sge(stag, iova, 0, 8192)),
                })
                .unwrap();
            (0..5u8)
                .map(|i| {
                    let payload = [i + 1; 1000];
                    let seg = send_seg(1, u32::from(i) * 1000, i == 4, Message::Send, &payload);
                    fpdu(&seg, true)
                })
                .collect()
        };
        fpdus[2][500] ^= 0x08; // a payload byte of the third FPDU
        v.feed_whole(&fpdus.concat());
        assert_eq!(v.side.qp.stats().rx_run_fpdus, 1, "FPDU 2 in a run");
        assert_eq!(v.side.qp.stats().crc_errors, 1);
        v.expect_terminate(true, TerminateError::Llp(LlpError::Mpa(MpaError::CrcError)));
        let wcs = v.side.recv_wcs();
        if write {
            assert!(wcs.is_empty());
            assert_eq!(v.side.qp.stats().rx.write.messages, 0);
        } else {
            assert_eq!(wcs.len(), 1);
            assert_eq!(wcs[0].status, WcStatus::WrFlushErr, "never delivered");
        }
    }
}

#[test]
fn fpdus_of_a_write_out_of_order_land_where_their_headers_name() {
    // DDP lets a tagged FPDU name any offset of its buffer: one that does not continue
    // the run is not placed where the run would have put it.
    for crc in [false, true] {
        let mut v = Victim::new(crc);
        let (stag, iova) = v.region(6000, Access::REMOTE_WRITE);
        let mut fpdus = write_run(stag, iova, 6, 1000, crc);
        fpdus.swap(2, 3);
        v.feed_whole(&fpdus.concat());
        let got = contents(&v.regions[0]);
        assert!(
            got.iter()
                .enumerate()
                .all(|(i, &b)| b == (i / 1000) as u8 + 1),
            "crc {crc}"
        );
        assert_eq!(v.side.qp.state(), QpState::Rts);
        assert!(!v.side.qp.terminate_sent());
        let s = v.side.qp.stats();
        assert_eq!((s.rx_run_fpdus, s.rx_fpdus, s.rx.write.messages), (1, 6, 1));
    }
}
