//! Messages in MSS-sized FPDUs (issue 40): with the runtime's batch buffer the sender sends
//! the FPDUs of a message in progress from the WR's memory, headers and trailers gathered
//! around the payloads (a gathered run, `Qp::send_to`), and copies into its spill whatever
//! a write did not take. Checked here: the stream is byte for byte the one the copy run
//! (gathered runs off) and the general gather path (no batch) send, whatever the writes
//! take (whole, one byte, random cuts); the receiver, reading it whole, one byte at a time
//! or in random pieces, with and without its staging buffer, places every byte where the
//! peer wrote it and none outside (guard bytes around every destination), and completes
//! every WR; with CRC on, a flipped byte of a payload is caught before anything of its
//! message is delivered.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use proptest::prelude::*;

use softwarp_engine::mr::Access;
use softwarp_engine::qp::{QpState, StreamConfig};
use softwarp_engine::wr::{Payload, RecvWr, SendOp, SendWr, SgList, WcOpcode, WcStatus};

use crate::util::{contents, sge, Pair, Rng, Split};

/// Bytes around and between the destinations, which must never change.
const GUARD: usize = 3000;
/// The MSS of the stream: FPDUs of at most 1460 bytes, as over a 1500-byte MTU.
const MSS: usize = 1460;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Send,
    Write,
    WriteImm,
    SendImm,
}

/// One message: its kind, its length, and how many scatter/gather elements its source
/// is cut into (uneven pieces, so payload ranges cross elements inside FPDUs).
#[derive(Debug, Clone, Copy)]
struct Msg {
    kind: Kind,
    len: usize,
    sges: usize,
}

/// What a run left: the stream a sent, b's destination area (guards included), the
/// completions of both sides as (wr_id, status, byte_len, opcode), and the bytes each
/// message should have put in b's area (offset, bytes).
struct Outcome {
    wire: Vec<u8>,
    area: Vec<u8>,
    wcs: Vec<(u64, WcStatus, u32, WcOpcode)>,
    expect: Vec<(usize, Vec<u8>)>,
    area_before: Vec<u8>,
}

/// Where message `i` lands in b's area: after a guard, each message in a slot of its own
/// with a guard behind it.
fn slots(msgs: &[Msg]) -> (Vec<usize>, usize) {
    let mut at = GUARD;
    let mut out = Vec::new();
    for m in msgs {
        out.push(at);
        at += m.len + GUARD;
    }
    (out, at)
}

fn run(msgs: &[Msg], split: Split, crc: bool, gather: bool) -> Outcome {
    let mut s = StreamConfig::for_mss(MSS);
    s.crc = crc;
    let mut p = Pair::new(split, s);
    p.a.qp.set_tx_gather_runs(gather);
    p.b.qp.set_tx_gather_runs(gather);
    let (slot_at, area_len) = slots(msgs);
    // The source: every message at an odd offset of its slot (payload ranges at any
    // alignment).
    let (_src, sstag, siova, sdata) = p.a.filled_region(area_len, Access::NONE, 11);
    let (area, astag, aiova, area_before) =
        p.b.filled_region(area_len, Access::LOCAL_WRITE | Access::REMOTE_WRITE, 12);
    let mut expect = Vec::new();
    for (i, (m, &at)) in msgs.iter().zip(&slot_at).enumerate() {
        let i = i as u64;
        let from = at - 1;
        expect.push((at, sdata[from..from + m.len].to_vec()));
        // Uneven elements: the first `len / (2 * sges)` bytes, then halves of the rest.
        let mut sgl = Vec::new();
        let mut off = 0usize;
        for k in 0..m.sges {
            let left = m.len - off;
            let n = if k + 1 == m.sges {
                left
            } else {
                (left / 2).max(1).min(left) - usize::from(k == 0) * (left / 4)
            };
            sgl.push(sge(sstag, siova, (from + off) as u64, n as u32));
            off += n;
        }
        let sgl = SgList::from_slice(&sgl).unwrap();
        let recv = |p: &mut Pair, wr_id: u64, len: usize| {
            p.b.qp
                .post_recv(RecvWr {
                    wr_id,
                    sgl: SgList::single(sge(astag, aiova, at as u64, len as u32)),
                })
                .unwrap();
        };
        let op = match m.kind {
            Kind::Send => {
                recv(&mut p, i, m.len);
                SendOp::Send {
                    solicited: false,
                    invalidate: None,
                }
            }
            Kind::SendImm => {
                recv(&mut p, i, m.len);
                // The Immediate Data takes a receive of its own (no bytes).
                recv(&mut p, 1000 + i, 0);
                SendOp::SendWithImm {
                    solicited: true,
                    imm: i as u32,
                }
            }
            Kind::Write => SendOp::Write {
                remote_addr: aiova + at as u64,
                rkey: astag,
            },
            Kind::WriteImm => {
                recv(&mut p, 1000 + i, 0);
                SendOp::WriteWithImm {
                    remote_addr: aiova + at as u64,
                    rkey: astag,
                    imm: i as u32,
                }
            }
        };
        p.a.qp
            .post_send(
                &SendWr {
                    wr_id: i,
                    op,
                    payload: Payload::Sgl(sgl),
                    signaled: true,
                    fence: false,
                },
                &p.a.mrs,
            )
            .unwrap();
    }
    p.drive();
    assert_eq!(p.a.qp.state(), QpState::Rts, "a: {:?}", p.a.events);
    assert_eq!(p.b.qp.state(), QpState::Rts, "b: {:?}", p.b.events);
    let mut wcs: Vec<_> =
        p.a.send_wcs()
            .into_iter()
            .chain(p.b.recv_wcs())
            .map(|w| (w.wr_id, w.status, w.byte_len, w.opcode))
            .collect();
    wcs.sort_by_key(|w| (w.0, w.3 as u8));
    Outcome {
        wire: p.a.sent.clone(),
        area: contents(&area),
        wcs,
        expect,
        area_before,
    }
}

/// Every message's bytes where it was sent, every other byte of the area as it was, every
/// WR completed.
fn check(msgs: &[Msg], o: &Outcome, what: &str) {
    let mut allowed = vec![false; o.area.len()];
    for (at, bytes) in &o.expect {
        assert!(
            o.area[*at..*at + bytes.len()] == bytes[..],
            "{what}: a message's bytes differ at {at}"
        );
        allowed[*at..*at + bytes.len()]
            .iter_mut()
            .for_each(|a| *a = true);
    }
    let outside = (0..o.area.len()).find(|&k| !allowed[k] && o.area[k] != o.area_before[k]);
    assert_eq!(outside, None, "{what}: a byte outside the messages changed");
    let sends = o
        .wcs
        .iter()
        .filter(|w| !matches!(w.3, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm));
    assert_eq!(sends.count(), msgs.len(), "{what}: send completions");
    assert!(
        o.wcs.iter().all(|w| w.1 == WcStatus::Success),
        "{what}: {:?}",
        o.wcs
    );
}

fn same_stream(a: &[u8], b: &[u8], what: &str) {
    let first = a.iter().zip(b).position(|(x, y)| x != y);
    assert!(
        first.is_none() && a.len() == b.len(),
        "{what}: streams of {} and {} bytes differ first at {first:?}",
        a.len(),
        b.len()
    );
}

/// The messages of the deterministic cases: every kind, one and three elements, lengths
/// that end a message with a short FPDU and with a full one.
fn mix(scale: usize) -> Vec<Msg> {
    let full = 1460 - 2 - 14 - 4 - 2; // a Write FPDU's payload at this MSS (pad 2)
    vec![
        Msg {
            kind: Kind::Send,
            len: 7 * scale + 100,
            sges: 1,
        },
        Msg {
            kind: Kind::Write,
            len: 9 * scale + 3,
            sges: 3,
        },
        Msg {
            kind: Kind::WriteImm,
            len: full * 5,
            sges: 1,
        },
        Msg {
            kind: Kind::SendImm,
            len: 5 * scale + 1,
            sges: 3,
        },
        Msg {
            kind: Kind::Write,
            len: 40,
            sges: 1,
        },
        Msg {
            kind: Kind::Send,
            len: 3 * scale,
            sges: 2,
        },
    ]
}

#[test]
fn gathered_runs_send_the_copy_runs_bytes_in_any_cut() {
    for crc in [false, true] {
        // Large messages in random cuts (writes and reads alike), and whole.
        let msgs = mix(10_000);
        let reference = run(&msgs, Split::Whole, crc, true);
        check(&msgs, &reference, "no batch");
        for (split, gather) in [
            (
                Split::Staged {
                    seed: 1,
                    max: usize::MAX >> 1,
                },
                true,
            ),
            (
                Split::Staged {
                    seed: 1,
                    max: usize::MAX >> 1,
                },
                false,
            ),
            (Split::Staged { seed: 7, max: 3000 }, true),
            (
                Split::Staged {
                    seed: 8,
                    max: 40_000,
                },
                true,
            ),
            (
                Split::Staged {
                    seed: 9,
                    max: 40_000,
                },
                false,
            ),
            (
                Split::Random {
                    seed: 10,
                    max: 5000,
                },
                true,
            ),
        ] {
            let what = format!("crc {crc}, {split:?}, gathered runs {gather}");
            let o = run(&msgs, split, crc, gather);
            check(&msgs, &o, &what);
            same_stream(&reference.wire, &o.wire, &what);
            assert_eq!(reference.wcs, o.wcs, "{what}");
        }
    }
}

#[test]
fn gathered_runs_in_one_byte_writes_and_reads() {
    // Every write takes one byte (the rest of each gathered run waits in the spill) and
    // every read gives one, with and without the staging buffer.
    for crc in [false, true] {
        let msgs = mix(700);
        let reference = run(&msgs, Split::Whole, crc, true);
        check(&msgs, &reference, "no batch");
        for (split, gather) in [
            (Split::Staged { seed: 3, max: 1 }, true),
            (Split::Staged { seed: 3, max: 1 }, false),
            (Split::OneByte, true),
        ] {
            let what = format!("crc {crc}, {split:?}, gathered runs {gather}");
            let o = run(&msgs, split, crc, gather);
            check(&msgs, &o, &what);
            same_stream(&reference.wire, &o.wire, &what);
            assert_eq!(reference.wcs, o.wcs, "{what}");
        }
    }
}

fn msg() -> impl Strategy<Value = Msg> {
    (
        prop_oneof![
            Just(Kind::Send),
            Just(Kind::Write),
            Just(Kind::WriteImm),
            Just(Kind::SendImm)
        ],
        prop_oneof![1usize..600, 600usize..5000, 5000usize..70_000],
        1usize..=4,
    )
        .prop_map(|(kind, len, sges)| Msg {
            kind,
            len,
            sges: sges.min(len),
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// Random messages in random cuts: the gathered runs' stream is the copy runs' and
    /// the general path's, and the receiver (staged or not) places it where it belongs
    /// and nowhere else.
    #[test]
    fn gathered_runs_place_only_what_the_peer_wrote(
        msgs in prop::collection::vec(msg(), 1..5),
        seed in any::<u64>(),
        max in prop_oneof![1usize..64, 64usize..4000, 4000usize..200_000],
        crc in any::<bool>(),
    ) {
        let reference = run(&msgs, Split::Whole, crc, false);
        check(&msgs, &reference, "no batch");
        // One-byte cuts of long messages take long (the spill gives one byte per write):
        // random cuts that small only for short mixes.
        let total: usize = msgs.iter().map(|m| m.len).sum();
        let max = if total > 40_000 { max.max(64) } else { max };
        for gather in [true, false] {
            let o = run(&msgs, Split::Staged { seed, max }, crc, gather);
            check(&msgs, &o, "staged");
            prop_assert!(reference.wire == o.wire, "gathered runs {}: streams differ", gather);
            prop_assert_eq!(&reference.wcs, &o.wcs);
        }
        let o = run(&msgs, Split::Random { seed, max }, crc, true);
        check(&msgs, &o, "random");
        prop_assert!(reference.wire == o.wire);
    }
}

#[test]
fn a_flipped_payload_byte_of_a_gathered_run_delivers_nothing_of_its_message() {
    // The receiver checks each FPDU's CRC before its bytes count as placed: a Send whose
    // FPDU in the middle of a gathered run was corrupted on the wire completes nothing
    // (a Terminate), and the Sends before it are delivered intact.
    let msgs = [
        Msg {
            kind: Kind::Send,
            len: 3000,
            sges: 1,
        },
        Msg {
            kind: Kind::Send,
            len: 30_000,
            sges: 2,
        },
    ];
    let mut s = StreamConfig::for_mss(MSS);
    s.crc = true;
    let clean = run(&msgs, Split::Whole, true, true);
    // A byte in the middle of the second message (about 3 KB of the stream are the
    // first's), well inside its gathered run.
    let mut wire = clean.wire.clone();
    let at = wire.len() / 2 + (Rng::new(5).next_u64() % 500) as usize;
    wire[at] ^= 0x40;
    let mut b = crate::util::Side::new(2, s);
    let (area, astag, aiova, _) = b.filled_region(clean.area.len(), Access::LOCAL_WRITE, 12);
    let (slot_at, _) = slots(&msgs);
    for (i, (m, at)) in msgs.iter().zip(&slot_at).enumerate() {
        b.qp.post_recv(RecvWr {
            wr_id: i as u64,
            sgl: SgList::single(sge(astag, aiova, *at as u64, m.len as u32)),
        })
        .unwrap();
    }
    let mut r = Rng::new(6);
    b.receive_with(&wire, true, || r.piece(5000));
    let wcs = b.recv_wcs();
    let ok: Vec<_> = wcs
        .iter()
        .filter(|w| w.status == WcStatus::Success)
        .map(|w| w.wr_id)
        .collect();
    assert_eq!(ok, vec![0], "{wcs:?}");
    assert_ne!(b.qp.state(), QpState::Rts);
    // The first message's bytes are there.
    let got = contents(&area);
    let (at0, bytes0) = &clean.expect[0];
    assert!(got[*at0..*at0 + bytes0.len()] == bytes0[..]);
}
