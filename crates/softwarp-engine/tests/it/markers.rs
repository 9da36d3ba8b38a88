//! MPA markers (RFC 5044 section 4.3) in the engine: where the transmit path puts them
//! (checked against the wire crate's `marker::strip`), receiving streams built with the wire
//! crate's `marker::insert` in any split, FPDUs that straddle several markers or start
//! exactly on one, and what a bad marker costs (the LLP "marker mismatch" Terminate).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::util::{contents, sge, strip_stream, Pair, Side, Split};
use softwarp_engine::event::AsyncEvent;
use softwarp_engine::fault::{Cause, Fault};
use softwarp_engine::mr::Access;
use softwarp_engine::qp::{QpState, StreamConfig};
use softwarp_engine::wr::{Payload, RecvWr, SendOp, SendWr, SgList, WcStatus};
use softwarp_wire::mpa::{marker, Fpdu};
use softwarp_wire::rdmap::{
    LlpError, Message, MpaError, Placement, Segment, TerminateError, TerminateRepr,
};

fn stream(crc: bool, mss: usize) -> StreamConfig {
    let mut s = StreamConfig::for_mss(mss);
    s.crc = crc;
    s
}

const SPLITS: [Split; 5] = [
    Split::Whole,
    Split::OneByte,
    Split::Random { seed: 5, max: 7 },
    Split::Random { seed: 9, max: 700 },
    // Markers keep the engine on its step-by-step path: the same results.
    Split::Staged { seed: 9, max: 700 },
];

/// Posts an RDMA Write of `len` pattern bytes from a to b and drives the pair; returns the
/// data and what landed.
fn write_through(p: &mut Pair, len: usize) -> (Vec<u8>, Vec<u8>) {
    let (_src, sstag, siova, data) = p.a.filled_region(len, Access::NONE, 3);
    let (dst, dstag, diova) = p.b.region(len, Access::REMOTE_WRITE);
    p.a.qp
        .post_send(
            &SendWr {
                wr_id: 1,
                op: SendOp::Write {
                    remote_addr: diova,
                    rkey: dstag,
                },
                payload: Payload::Sgl(SgList::single(sge(sstag, siova, 0, len as u32))),
                signaled: true,
                fence: false,
            },
            &p.a.mrs,
        )
        .unwrap();
    p.drive();
    let wcs = p.a.send_wcs();
    assert_eq!(wcs.len(), 1);
    assert_eq!(wcs[0].status, WcStatus::Success);
    (data, contents(&dst))
}

#[test]
fn fpdus_straddling_several_markers_strip_cleanly_and_land_intact() {
    for crc in [false, true] {
        for split in SPLITS {
            let mut p = Pair::with_markers(split, stream(crc, 9000), true, false);
            let (data, got) = write_through(&mut p, 64 << 10);
            assert!(got == data, "crc {crc} {split:?}");
            let fpdus = strip_stream(&p.a.sent, 0, true, crc);
            // 64 KiB in FPDUs of at most 9000 bytes on the wire, each with 17 or 18 markers.
            assert_eq!(fpdus.len(), 8);
            let mut markers = 0;
            for (wire_len, plain) in &fpdus {
                assert!(*wire_len <= 9000);
                let added = wire_len - plain.len();
                assert!(added / 4 >= 1 && added % 4 == 0);
                markers += added / 4;
                let (f, _) = Fpdu::parse(plain, crc).unwrap();
                Segment::parse(f.ulpdu).unwrap();
            }
            assert!(fpdus[0].0 - fpdus[0].1.len() >= 4 * 17);
            assert_eq!(p.a.qp.stats().tx_markers, markers as u64);
            assert_eq!(p.b.qp.stats().rx_markers, markers as u64);
        }
    }
}

#[test]
fn every_fpdu_starts_on_a_marker_when_fpdus_are_512_bytes_on_the_wire() {
    // max_fpdu_len 512 with markers: MULPDU 502, a 508-byte FPDU plus the marker it starts
    // with is 512 octets, so every full FPDU begins exactly at a marker position.
    for crc in [false, true] {
        for split in SPLITS {
            let mut p = Pair::with_markers(split, stream(crc, 512), true, true);
            let (data, got) = write_through(&mut p, 10_000);
            assert!(got == data);
            let fpdus = strip_stream(&p.a.sent, 0, true, crc);
            let (last, full) = fpdus.split_last().unwrap();
            for (wire_len, plain) in full {
                assert_eq!((*wire_len, plain.len()), (512, 508));
            }
            assert!(last.0 <= 512);
            // The marker at each FPDU's start points 0 octets back.
            let mut at = 0;
            for (wire_len, _) in &fpdus {
                assert_eq!(&p.a.sent[at..at + 4], &[0, 0, 0, 0]);
                at += wire_len;
            }
        }
    }
}

#[test]
fn markers_follow_the_configured_stream_offsets() {
    // a -> b starts 4 octets before a marker position (the marker splits the first FPDU
    // right after ULPDU_Length and the control bytes); b -> a starts in the middle.
    for crc in [false, true] {
        for split in SPLITS {
            let mut s = stream(crc, 1448);
            s.tx_stream_offset = 508;
            s.rx_stream_offset = (1 << 40) + 1000;
            let mut p = Pair::with_markers(split, s, true, true);
            // A Read: the request goes a -> b, the response b -> a.
            let len = 5000;
            let (_src, rstag, riova, data) = p.b.filled_region(len, Access::REMOTE_READ, 8);
            let (sink, kstag, kiova) = p.a.region(len, Access::LOCAL_WRITE);
            p.a.qp
                .post_send(
                    &SendWr {
                        wr_id: 4,
                        op: SendOp::Read {
                            remote_addr: riova,
                            rkey: rstag,
                        },
                        payload: Payload::Sgl(SgList::single(sge(kstag, kiova, 0, len as u32))),
                        signaled: true,
                        fence: false,
                    },
                    &p.a.mrs,
                )
                .unwrap();
            p.drive();
            assert!(contents(&sink) == data);
            assert_eq!(p.a.send_wcs()[0].status, WcStatus::Success);
            assert_eq!(strip_stream(&p.a.sent, 508, true, crc).len(), 1);
            assert_eq!(
                &p.a.sent[4..8],
                &[0, 0, 0, 4],
                "marker 4 octets into the FPDU"
            );
            assert_eq!(
                strip_stream(&p.b.sent, (1 << 40) + 1000, true, crc).len(),
                4
            );
        }
    }
}

/// The FPDU for `seg`, marker-free.
fn plain_fpdu(seg: &Segment<'_>, crc: bool) -> Vec<u8> {
    let mut ulpdu = vec![0u8; seg.buffer_len()];
    let n = seg.emit(&mut ulpdu).unwrap();
    ulpdu.truncate(n);
    let f = Fpdu { ulpdu: &ulpdu };
    let mut out = vec![0u8; f.buffer_len()];
    f.emit(&mut out, crc).unwrap();
    out
}

/// `fpdus` as the wire carries them with markers from stream offset `offset`.
fn with_markers(fpdus: &[Vec<u8>], mut offset: u64, crc: bool) -> Vec<u8> {
    let mut wire = Vec::new();
    for f in fpdus {
        let mut out = vec![0u8; marker::wire_len(offset, f.len()).unwrap()];
        marker::insert(f, offset, crc, &mut out).unwrap();
        offset += out.len() as u64;
        wire.extend(out);
    }
    wire
}

fn send(msn: u32, payload: &[u8]) -> Segment<'_> {
    Segment {
        last: true,
        placement: Placement::Untagged { msn, mo: 0 },
        message: Message::Send,
        payload,
    }
}

/// A victim receiving (and sending) markers, with `n` receive WRs of 4 KiB each.
fn victim(crc: bool, n: u64) -> (Side, std::sync::Arc<softwarp_engine::memory::Region>) {
    let mut s = stream(crc, 1448);
    s.markers = true;
    let mut v = Side::new(2, s);
    let (buf, stag, iova) = v.region(4096 * n as usize, Access::LOCAL_WRITE);
    for i in 0..n {
        v.qp.post_recv(RecvWr {
            wr_id: i,
            sgl: SgList::single(sge(stag, iova, 4096 * i, 4096)),
        })
        .unwrap();
    }
    (v, buf)
}

#[test]
fn fpdus_starting_exactly_on_a_marker_are_received_in_any_split() {
    // A 508-byte FPDU from offset 0 ends at 512, so the next two FPDUs begin with markers
    // (the second one also straddles the marker at 1024).
    let payloads: [Vec<u8>; 3] = [
        (0..484).map(|i| i as u8).collect(), // ULPDU 502: FPDU 508
        (0..496).map(|i| (i * 7) as u8).collect(),
        (0..1000).map(|i| (i * 3) as u8).collect(),
    ];
    for crc in [false, true] {
        let fpdus: Vec<Vec<u8>> = payloads
            .iter()
            .enumerate()
            .map(|(i, p)| plain_fpdu(&send(i as u32 + 1, p), crc))
            .collect();
        assert_eq!(fpdus[0].len(), 508);
        let wire = with_markers(&fpdus, 0, crc);
        assert_eq!(
            &wire[512..516],
            &[0, 0, 0, 0],
            "second FPDU begins with a marker"
        );
        for piece in [usize::MAX, 1, 3, 7, 512, 513] {
            let (mut v, buf) = victim(crc, 3);
            v.receive(&wire, || piece);
            let wcs = v.recv_wcs();
            assert_eq!(wcs.len(), 3, "crc {crc} piece {piece}: {:?}", v.events);
            let got = contents(&buf);
            for (i, (wc, p)) in wcs.iter().zip(&payloads).enumerate() {
                assert_eq!(
                    (wc.status, wc.byte_len),
                    (WcStatus::Success, p.len() as u32)
                );
                assert_eq!(&got[4096 * i..4096 * i + p.len()], &p[..]);
            }
            assert_eq!(
                v.qp.stats().rx_markers,
                5,
                "markers at 0, 512, 1024, 1536, 2048"
            );
            assert_eq!(v.qp.state(), QpState::Rts);
        }
    }
}

#[test]
fn fpduptr_counted_from_ulpdu_length_is_accepted_after_a_leading_marker() {
    // The reading the wire crate tolerates: later markers of an FPDU that begins with a
    // marker counted from ULPDU_Length (4 less than what we send).
    let payload: Vec<u8> = (0..1200).map(|i| i as u8).collect();
    let fpdu = plain_fpdu(&send(1, &payload), false);
    let mut wire = with_markers(std::slice::from_ref(&fpdu), 0, false);
    assert_eq!(&wire[512..516], &[0, 0, 0x02, 0x00]);
    wire[514..516].copy_from_slice(&508u16.to_be_bytes());
    wire[1026..1028].copy_from_slice(&1020u16.to_be_bytes());
    let (mut v, buf) = victim(false, 1);
    v.receive(&wire, || 5);
    let wcs = v.recv_wcs();
    assert_eq!(wcs[0].status, WcStatus::Success);
    assert_eq!(&contents(&buf)[..1200], &payload[..]);
}

#[test]
fn reserved_marker_bits_are_ignored_but_covered_by_the_crc() {
    let payload = [0x5au8; 700];
    for crc in [false, true] {
        let fpdu = plain_fpdu(&send(1, &payload), crc);
        let mut wire = with_markers(std::slice::from_ref(&fpdu), 0, crc);
        wire[512] = 0xff;
        wire[513] = 0x01;
        let (mut v, _) = victim(crc, 1);
        v.receive(&wire, || 64);
        let wcs = v.recv_wcs();
        if crc {
            assert_eq!(
                terminate_sent(&mut v, crc).error,
                TerminateError::Llp(LlpError::Mpa(MpaError::CrcError))
            );
            assert_eq!(v.qp.state(), QpState::Error);
            assert!(v.events.iter().any(|e| matches!(
                e,
                AsyncEvent::QpFatal {
                    cause: Cause::Detected(Fault::Crc),
                    ..
                }
            )));
            assert_eq!(wcs[0].status, WcStatus::WrFlushErr);
        } else {
            assert_eq!(wcs[0].status, WcStatus::Success);
            assert_eq!(v.qp.state(), QpState::Rts);
        }
    }
}

/// The victim's Terminate: the last FPDU it sent, stripped of its markers.
fn terminate_sent(v: &mut Side, crc: bool) -> TerminateRepr {
    let mut out = Vec::new();
    v.transmit(&mut out, || usize::MAX);
    let (_, last) = strip_stream(&out, 0, true, crc).pop().expect("a Terminate");
    let (f, _) = Fpdu::parse(&last, crc).unwrap();
    match Segment::parse(f.ulpdu).unwrap().message {
        Message::Terminate(t) => t,
        other => panic!("expected a Terminate, got {other:?}"),
    }
}

#[test]
fn corrupted_marker_gets_the_llp_marker_mismatch_terminate_and_stops_placement() {
    let payload: Vec<u8> = (0..2000).map(|i| (i % 251) as u8).collect();
    for crc in [false, true] {
        for (at, what) in [
            (512 + 2, "FPDUPTR high byte"),
            (1024 + 3, "FPDUPTR low byte"),
        ] {
            let fpdu = plain_fpdu(&send(1, &payload), crc);
            let mut wire = with_markers(std::slice::from_ref(&fpdu), 0, crc);
            wire[at] ^= 0x10;
            for piece in [usize::MAX, 1, 9] {
                let (mut v, buf) = victim(crc, 1);
                v.receive(&wire, || piece);
                let t = terminate_sent(&mut v, crc);
                assert_eq!(v.qp.state(), QpState::Error, "{what}");
                assert_eq!(
                    t.error,
                    TerminateError::Llp(LlpError::Mpa(MpaError::MarkerMismatch))
                );
                assert_eq!(t.ddp_header, None, "the framing is not trusted");
                assert!(v.events.iter().any(|e| matches!(
                    e,
                    AsyncEvent::QpFatal {
                        cause: Cause::Detected(Fault::BadMarker),
                        ..
                    }
                )));
                let wcs = v.recv_wcs();
                assert_eq!(wcs.len(), 1);
                assert_eq!(wcs[0].status, WcStatus::WrFlushErr);
                // Payload before the bad marker was placed (zero copy); nothing after it.
                // Wire: marker, 2 + 18 header bytes, then payload up to the marker at 512.
                let placed_before = (at & !3) - 4 - 20 - 4 * ((at >> 9) - 1);
                let got = contents(&buf);
                assert_eq!(&got[..placed_before], &payload[..placed_before]);
                assert!(got[placed_before..].iter().all(|&b| b == 0), "{what}");
            }
        }
    }
}

#[test]
fn leading_marker_that_does_not_point_at_its_fpdu_is_a_marker_mismatch() {
    let fpdu = plain_fpdu(&send(1, &[1u8; 40]), false);
    let mut wire = with_markers(std::slice::from_ref(&fpdu), 0, false);
    wire[3] = 4;
    let (mut v, buf) = victim(false, 1);
    v.receive(&wire, || usize::MAX);
    assert_eq!(
        terminate_sent(&mut v, false).error,
        TerminateError::Llp(LlpError::Mpa(MpaError::MarkerMismatch))
    );
    assert_eq!(v.qp.state(), QpState::Error);
    assert!(contents(&buf).iter().all(|&b| b == 0));
}

#[test]
fn a_peer_that_omits_negotiated_markers_is_caught() {
    // No markers from a peer that promised them: the 4 octets read as the leading marker
    // are ULPDU_Length and the control bytes, which never form a zero FPDUPTR here.
    let fpdu = plain_fpdu(&send(1, &[1u8; 40]), false);
    let (mut v, _) = victim(false, 1);
    v.receive(&fpdu, || usize::MAX);
    assert_eq!(
        terminate_sent(&mut v, false).error,
        TerminateError::Llp(LlpError::Mpa(MpaError::MarkerMismatch))
    );
    assert_eq!(v.qp.state(), QpState::Error);
    assert!(v.events.iter().any(|e| matches!(
        e,
        AsyncEvent::QpFatal {
            cause: Cause::Detected(Fault::BadMarker),
            ..
        }
    )));
}

#[test]
fn a_gather_list_longer_than_one_txgather_is_offered_in_parts() {
    use softwarp_engine::qp::{SendEnd, GATHER_PIECES};
    use softwarp_testkit::RecordingWriter;
    // A 48,000-byte FPDU gathered from 8 SGEs with about 94 markers: each marker splits a
    // piece, so the gather list is about 200 pieces, more than one TxGather holds.
    let mut s = stream(true, 60_000);
    s.markers_tx = true;
    let mut a = Side::new(1, s);
    let (_src, stag, iova, _) = a.filled_region(48_000, Access::NONE, 1);
    let sges: Vec<_> = (0..8).map(|i| sge(stag, iova, i * 6000, 6000)).collect();
    a.qp.post_send(
        &SendWr {
            wr_id: 1,
            op: SendOp::Write {
                remote_addr: 0x1000,
                rkey: softwarp_engine::mr::Stag(0x4242),
            },
            payload: Payload::Sgl(SgList::from_slice(&sges).unwrap()),
            signaled: true,
            fence: false,
        },
        &a.mrs,
    )
    .unwrap();
    // A writer that takes all it is offered; every gather list is checked after.
    let mut w = RecordingWriter::new();
    let mut budget = usize::MAX;
    let end = a.qp.send_to(&mut w, None, &mut budget);
    assert!(matches!(end, SendEnd::Idle), "{end:?}");
    for c in &w.calls {
        assert!(c.pieces <= GATHER_PIECES, "{} pieces offered", c.pieces);
        assert_eq!(c.taken(), c.offered);
    }
    let parts = w.calls.len();
    let wire = w.out;
    assert!(parts >= 2, "offered in {parts} part(s)");
    let fpdus = strip_stream(&wire, 0, true, true);
    assert_eq!(fpdus.len(), 1);
    assert_eq!(fpdus[0].0, wire.len());
}
