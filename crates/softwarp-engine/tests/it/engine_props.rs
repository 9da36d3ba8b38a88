//! Property tests: any mix of operations (RFC 5040 and RFC 7306) gives the same placement
//! and completions whatever the byte splits and MPA marker modes; any bytes from a peer never
//! panic the engine and never change memory the peer may not write.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::util::{contents, sge, strip_stream, Pair, Side, Split};
use proptest::prelude::*;
use softwarp_engine::mr::{Access, Stag};
use softwarp_engine::qp::{QpState, StreamConfig};
use softwarp_engine::wr::{
    Payload, RecvWr, SendOp, SendWr, SgList, WcOpcode, WcStatus, WorkCompletion, MAX_INLINE,
};
use softwarp_wire::mpa::{marker, Fpdu};
use softwarp_wire::rdmap::{
    AtomicOpcode, AtomicRequestRepr, AtomicResponseRepr, ImmediateDataRepr, Message, Placement,
    ReadRequestRepr, Segment, TerminateError, TerminateRepr,
};

#[derive(Debug, Clone, Copy)]
enum Op {
    Send(u32),
    Write(u32),
    Read(u32),
    WriteImm(u32),
    SendImm(u32),
    FetchAdd(u32),
    CmpSwap(u32),
}

fn op() -> impl Strategy<Value = Op> {
    let len = prop_oneof![0u32..8, 1000u32..3000, 0u32..20_000];
    (0u8..7, len).prop_map(|(k, l)| match k {
        0 => Op::Send(l),
        1 => Op::Write(l),
        2 => Op::Read(l),
        3 => Op::WriteImm(l),
        4 => Op::SendImm(l),
        5 => Op::FetchAdd(l),
        _ => Op::CmpSwap(l),
    })
}

/// `default` cases unless `PROPTEST_CASES` asks for another number (for long runs).
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

const SLOT: u64 = 20_000;

/// MPA markers per direction and the stream offsets the two streams start at.
#[derive(Debug, Clone, Copy)]
struct MarkerCfg {
    a_to_b: bool,
    b_to_a: bool,
    a_to_b_offset: u64,
    b_to_a_offset: u64,
}

const NO_MARKERS: MarkerCfg = MarkerCfg {
    a_to_b: false,
    b_to_a: false,
    a_to_b_offset: 0,
    b_to_a_offset: 0,
};

fn marker_cfg() -> impl Strategy<Value = MarkerCfg> {
    let offset = || {
        prop_oneof![
            Just(0u64),
            0u64..4096,
            (u64::MAX - 8192)..=u64::MAX,
            any::<u64>()
        ]
    };
    (any::<bool>(), any::<bool>(), offset(), offset()).prop_map(|(ab, ba, oa, ob)| {
        MarkerCfg {
            a_to_b: ab,
            b_to_a: ba,
            // Any 4-aligned offset, including ones that wrap at 2^64 during the run.
            a_to_b_offset: oa & !3,
            b_to_a_offset: ob & !3,
        }
    })
}

/// Runs `ops` (a -> b) and returns b's and a's destination bytes and all completions.
fn run(
    ops: &[Op],
    split: Split,
    crc: bool,
    mss: usize,
    m: MarkerCfg,
) -> (Vec<u8>, Vec<u8>, Vec<WorkCompletion>) {
    let (b_bytes, a_bytes, wcs, _) = run_with_wire(ops, split, crc, mss, m);
    (b_bytes, a_bytes, wcs)
}

/// As [`run`], and also returns the two byte streams as sent (a's, then b's).
fn run_with_wire(
    ops: &[Op],
    split: Split,
    crc: bool,
    mss: usize,
    m: MarkerCfg,
) -> (Vec<u8>, Vec<u8>, Vec<WorkCompletion>, [Vec<u8>; 2]) {
    let mut s = StreamConfig::for_mss(mss);
    s.crc = crc;
    s.tx_stream_offset = m.a_to_b_offset;
    s.rx_stream_offset = m.b_to_a_offset;
    let mut p = Pair::with_markers(split, s, m.a_to_b, m.b_to_a);
    let n = ops.len() as u64;
    let (_src, sstag, siova, _) = p.a.filled_region((SLOT * n) as usize, Access::NONE, 1);
    let (sink, kstag, kiova) = p.a.region((SLOT * n) as usize, Access::LOCAL_WRITE);
    let (bmem, bstag, biova, _) = p.b.filled_region(
        (SLOT * n) as usize,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
        2,
    );
    let (dst, dstag, diova) = p.b.region((SLOT * n) as usize, Access::LOCAL_WRITE);
    for (i, op) in ops.iter().enumerate() {
        let i = i as u64;
        let slot = i * SLOT;
        match *op {
            Op::Send(len) => {
                p.b.qp
                    .post_recv(RecvWr {
                        wr_id: i,
                        sgl: SgList::single(sge(dstag, diova, slot, SLOT as u32)),
                    })
                    .unwrap();
                // One SGE, inline data when it fits, or three SGEs: the forms a post can
                // take (the small-FPDU copy path reads each of them).
                let third = len / 3;
                let inline: Vec<u8> = (0..len).map(|k| (k as u8) ^ (i as u8)).collect();
                let payload = match i % 3 {
                    1 if inline.len() <= MAX_INLINE => Payload::Inline(&inline),
                    2 => Payload::Sgl(
                        SgList::from_slice(&[
                            sge(sstag, siova, slot, third),
                            sge(sstag, siova, slot + u64::from(third), third),
                            sge(sstag, siova, slot + u64::from(2 * third), len - 2 * third),
                        ])
                        .unwrap(),
                    ),
                    _ => Payload::Sgl(SgList::single(sge(sstag, siova, slot, len))),
                };
                let wr = SendWr {
                    wr_id: i,
                    op: SendOp::Send {
                        solicited: i & 1 == 0,
                        invalidate: None,
                    },
                    payload,
                    signaled: true,
                    fence: false,
                };
                p.a.qp.post_send(&wr, &p.a.mrs).unwrap();
            }
            Op::Write(len) => {
                let wr = SendWr {
                    wr_id: i,
                    op: SendOp::Write {
                        remote_addr: biova + slot,
                        rkey: bstag,
                    },
                    payload: Payload::Sgl(SgList::single(sge(sstag, siova, slot, len))),
                    signaled: i.is_multiple_of(3),
                    fence: false,
                };
                p.a.qp.post_send(&wr, &p.a.mrs).unwrap();
            }
            Op::Read(len) => {
                let wr = SendWr {
                    wr_id: i,
                    op: SendOp::Read {
                        remote_addr: biova + slot,
                        rkey: bstag,
                    },
                    payload: Payload::Sgl(SgList::single(sge(kstag, kiova, slot, len))),
                    signaled: true,
                    fence: false,
                };
                p.a.qp.post_send(&wr, &p.a.mrs).unwrap();
            }
            Op::WriteImm(len) | Op::SendImm(len) => {
                // One receive for the Immediate Data, and for a Send with Immediate one
                // more, taken first, for the Send's data. A Write with Immediate consumes only
                // the one: its data is tagged, and a spare receive would be taken (too small)
                // by a later Send.
                let half = SLOT / 2;
                let recvs = if matches!(op, Op::WriteImm(_)) { 1 } else { 2 };
                for r in 0..recvs {
                    p.b.qp
                        .post_recv(RecvWr {
                            wr_id: i * 2 + r,
                            sgl: SgList::single(sge(dstag, diova, slot + r * half, half as u32)),
                        })
                        .unwrap();
                }
                let op = match *op {
                    Op::WriteImm(_) => SendOp::WriteWithImm {
                        remote_addr: biova + slot,
                        rkey: bstag,
                        imm: len ^ 0x5a5a,
                    },
                    _ => SendOp::SendWithImm {
                        solicited: i & 1 == 1,
                        imm: len,
                    },
                };
                let len = len.min(half as u32);
                let wr = SendWr {
                    wr_id: i,
                    op,
                    payload: Payload::Sgl(SgList::single(sge(sstag, siova, slot, len))),
                    signaled: true,
                    fence: false,
                };
                p.a.qp.post_send(&wr, &p.a.mrs).unwrap();
            }
            Op::FetchAdd(x) | Op::CmpSwap(x) => {
                let remote_addr = biova + slot + 8 * u64::from(x % 8);
                let op = match *op {
                    Op::FetchAdd(_) => SendOp::FetchAdd {
                        remote_addr,
                        rkey: bstag,
                        add: u64::from(x) << 20,
                    },
                    _ => SendOp::CmpSwap {
                        remote_addr,
                        rkey: bstag,
                        compare: u64::from(x),
                        swap: !u64::from(x),
                    },
                };
                let wr = SendWr {
                    wr_id: i,
                    op,
                    payload: Payload::Sgl(SgList::single(sge(kstag, kiova, slot, 8))),
                    signaled: true,
                    fence: false,
                };
                p.a.qp.post_send(&wr, &p.a.mrs).unwrap();
            }
        }
    }
    p.drive();
    assert_eq!(p.a.qp.state(), QpState::Rts, "a: {:?}", p.a.events);
    assert_eq!(p.b.qp.state(), QpState::Rts, "b: {:?}", p.b.events);
    // What went over the wire strips cleanly with the wire crate (markers where in use).
    for (side, markers, offset) in [
        (&p.a, m.a_to_b, m.a_to_b_offset),
        (&p.b, m.b_to_a, m.b_to_a_offset),
    ] {
        for (wire_len, fpdu) in strip_stream(&side.sent, offset, markers, crc) {
            assert!(
                wire_len <= mss,
                "FPDU of {wire_len} bytes for an MSS of {mss}"
            );
            Fpdu::parse(&fpdu, crc).unwrap();
        }
    }
    let mut wcs = p.a.send_wcs();
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success));
    wcs.extend(p.b.recv_wcs());
    let mut b_bytes = contents(&dst);
    b_bytes.extend(contents(&bmem));
    let wire = [p.a.sent.clone(), p.b.sent.clone()];
    (b_bytes, contents(&sink), wcs, wire)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(24), ..ProptestConfig::default() })]

    #[test]
    fn any_operation_mix_places_and_completes_identically_in_any_split(
        ops in prop::collection::vec(op(), 1..6),
        seed in any::<u64>(),
        max in 1usize..2000,
        crc in any::<bool>(),
        mss in prop_oneof![Just(1448usize), Just(128usize), Just(9000usize)],
        markers in marker_cfg(),
    ) {
        let whole = run(&ops, Split::Whole, crc, mss, NO_MARKERS);
        let random = run(&ops, Split::Random { seed, max }, crc, mss, markers);
        prop_assert_eq!(&whole, &random);
        // Whole FPDUs taken in one step each (as the runtime does with bytes read ahead).
        let staged = run(&ops, Split::Staged { seed, max: max * 8 }, crc, mss, markers);
        prop_assert_eq!(&whole, &staged);
        // The FPDUs copied whole (`tx_copy_fpdu`, with its small-message path) are the
        // bytes the gather path builds: same streams, byte for byte, both directions.
        let gathered = run_with_wire(&ops, Split::Whole, crc, mss, NO_MARKERS).3;
        let copied = run_with_wire(&ops, Split::Staged { seed, max: max * 8 }, crc, mss, NO_MARKERS).3;
        for (g, c) in gathered.iter().zip(&copied) {
            let first = g.iter().zip(c).position(|(x, y)| x != y);
            prop_assert!(
                first.is_none() && g.len() == c.len(),
                "streams of {} and {} bytes differ first at {:?}: {:?} / {:?}",
                g.len(),
                c.len(),
                first,
                first.map(|i| &g[i.saturating_sub(8)..(i + 8).min(g.len())]),
                first.map(|i| &c[i.saturating_sub(8)..(i + 8).min(c.len())]),
            );
        }
        // Completions in posting order, one per signaled WR, byte counts as asked.
        let sends: Vec<u64> = whole
            .2
            .iter()
            .filter(|w| !matches!(w.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm))
            .map(|w| w.wr_id)
            .collect();
        // The receives carry the immediates.
        let imms = whole.2.iter().filter(|w| w.imm.is_some()).count();
        let with_imm = ops
            .iter()
            .filter(|o| matches!(o, Op::WriteImm(_) | Op::SendImm(_)))
            .count();
        prop_assert_eq!(imms, with_imm);
        let mut sorted = sends.clone();
        sorted.sort_unstable();
        prop_assert_eq!(sends, sorted);
    }
}

/// A segment built from fuzz choices, aimed at the victim's regions.
fn crafted(
    kind: u8,
    stag: u32,
    to: u64,
    msn: u32,
    mo: u32,
    last: bool,
    payload: &[u8],
) -> Segment<'_> {
    let tagged = |message| Segment {
        last,
        placement: Placement::Tagged {
            stag,
            tagged_offset: to,
        },
        message,
        payload,
    };
    let untagged = |message, payload| Segment {
        last,
        placement: Placement::Untagged { msn, mo },
        message,
        payload,
    };
    let control = |message| Segment {
        last: true,
        placement: Placement::Untagged { msn, mo: 0 },
        message,
        payload: &[],
    };
    match kind % 10 {
        7 => control(Message::AtomicRequest(AtomicRequestRepr {
            opcode: AtomicOpcode::from(kind >> 4),
            request_id: msn,
            remote_stag: stag,
            remote_tagged_offset: to,
            add_or_swap_data: u64::from(mo),
            add_or_swap_mask: if last { 0 } else { to },
            compare_data: to,
            compare_mask: u64::from(msn),
        })),
        8 => control(Message::AtomicResponse(AtomicResponseRepr {
            original_request_id: mo,
            original_value: to,
        })),
        9 => control(if last {
            Message::ImmediateData(ImmediateDataRepr {
                data: to.to_be_bytes(),
            })
        } else {
            Message::ImmediateDataWithSolicitedEvent(ImmediateDataRepr {
                data: to.to_be_bytes(),
            })
        }),
        6 => Segment {
            last: true,
            placement: Placement::Untagged { msn, mo: 0 },
            message: Message::Terminate(TerminateRepr::new(TerminateError::from_fields(
                (stag & 0xf) as u8,
                ((stag >> 4) & 0xf) as u8,
                (stag >> 8) as u8,
            ))),
            payload: &[],
        },
        0 => tagged(Message::RdmaWrite),
        1 => tagged(Message::RdmaReadResponse),
        2 => untagged(Message::Send, payload),
        3 => untagged(
            Message::SendWithSolicitedEventAndInvalidate {
                invalidate_stag: stag,
            },
            payload,
        ),
        4 => Segment {
            last: true,
            placement: Placement::Untagged { msn, mo: 0 },
            message: Message::RdmaReadRequest(ReadRequestRepr {
                sink_stag: stag,
                sink_tagged_offset: to,
                read_size: payload.len() as u32,
                source_stag: stag,
                source_tagged_offset: to,
            }),
            payload: &[],
        },
        _ => untagged(Message::SendWithSolicitedEvent, payload),
    }
}

#[derive(Debug, Clone)]
struct Piece {
    kind: u8,
    stag_pick: u8,
    to_delta: i32,
    msn: u32,
    mo: u32,
    last: bool,
    len: usize,
    flips: Vec<(usize, u8)>,
}

fn piece() -> impl Strategy<Value = Piece> {
    (
        any::<u8>(),
        any::<u8>(),
        -5000i32..5000,
        prop_oneof![Just(1u32), Just(2), any::<u32>()],
        prop_oneof![Just(0u32), 0u32..5000],
        any::<bool>(),
        0usize..3000,
        prop::collection::vec((any::<usize>(), any::<u8>()), 0..3),
    )
        .prop_map(
            |(kind, stag_pick, to_delta, msn, mo, last, len, flips)| Piece {
                kind,
                stag_pick,
                to_delta,
                msn,
                mo,
                last,
                len,
                flips,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(256), ..ProptestConfig::default() })]

    #[test]
    fn crafted_and_corrupted_fpdus_never_panic_nor_touch_protected_memory(
        pieces in prop::collection::vec(piece(), 1..6),
        crc in any::<bool>(),
        split in 1usize..64,
        garbage in prop::collection::vec(any::<u8>(), 0..64),
        markers in any::<bool>(),
        offset in any::<u64>(),
    ) {
        let mut s = StreamConfig::for_mss(1448);
        s.crc = crc;
        // The victim receives markers (inserted below) from a 4-aligned stream offset.
        let mut stream_offset = offset & !3;
        s.markers_rx = markers;
        s.rx_stream_offset = stream_offset;
        let mut v = Side::new(2, s);
        let (prot, pstag, piova, _) = v.filled_region(8192, Access::REMOTE_READ | Access::LOCAL_WRITE, 5);
        let (_w, wstag, wiova, _) = v.filled_region(8192, Access::REMOTE_WRITE, 6);
        // Atomics may change this one (8-byte words only; checked below).
        let (atomics, astag, aiova, atomics_before) =
            v.filled_region(8192, Access::REMOTE_ATOMIC, 7);
        let (recvbuf, rstag, riova) = v.region(4096, Access::LOCAL_WRITE);
        v.qp.post_recv(RecvWr { wr_id: 1, sgl: SgList::single(sge(rstag, riova, 1024, 2048)) }).unwrap();
        let before_prot = contents(&prot);
        let before_recv = contents(&recvbuf);
        let mut wire = Vec::new();
        for p in &pieces {
            let (stag, base) = match p.stag_pick % 5 {
                0 => (pstag, piova),
                1 => (wstag, wiova),
                2 => (rstag, riova),
                3 => (astag, aiova),
                _ => (Stag(u32::from(p.stag_pick) << 8 | 7), 0x1000),
            };
            let to = base.wrapping_add_signed(i64::from(p.to_delta));
            let payload = vec![0xeeu8; p.len];
            let seg = crafted(p.kind, stag.0, to, p.msn, p.mo, p.last, &payload);
            let mut ulpdu = vec![0u8; seg.buffer_len()];
            let n = seg.emit(&mut ulpdu).unwrap();
            ulpdu.truncate(n);
            let f = Fpdu { ulpdu: &ulpdu };
            let mut bytes = vec![0u8; f.buffer_len()];
            f.emit(&mut bytes, crc).unwrap();
            if markers {
                let mut wire = vec![0u8; marker::wire_len(stream_offset, bytes.len()).unwrap()];
                marker::insert(&bytes, stream_offset, crc, &mut wire).unwrap();
                stream_offset = stream_offset.wrapping_add(wire.len() as u64);
                bytes = wire;
            }
            for (at, x) in &p.flips {
                let i = at % bytes.len();
                bytes[i] ^= x;
            }
            wire.extend(bytes);
        }
        wire.extend(garbage);
        v.receive(&wire, || split);
        let _ = v.transmit(&mut Vec::new(), || usize::MAX);
        v.pump();
        // The read-only region never changes; the receive buffer only inside the posted SGE.
        prop_assert_eq!(contents(&prot), before_prot);
        let after_recv = contents(&recvbuf);
        prop_assert_eq!(&after_recv[..1024], &before_recv[..1024]);
        prop_assert_eq!(&after_recv[3072..], &before_recv[3072..]);
        // Atomics change at most one aligned word per accepted request.
        let changed_words = contents(&atomics)
            .chunks(8)
            .zip(atomics_before.chunks(8))
            .filter(|(a, b)| a != b)
            .count();
        prop_assert!(changed_words <= pieces.len());
        // Either still running or failed with exactly one Terminate sent.
        match v.qp.state() {
            QpState::Rts => prop_assert_eq!(v.qp.stats().terminates_sent, 0),
            QpState::Error => prop_assert!(v.qp.stats().terminates_sent <= 1),
            other => prop_assert!(false, "unexpected state {:?}", other),
        }
    }
}
