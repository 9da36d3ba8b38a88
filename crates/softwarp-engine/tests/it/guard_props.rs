//! Property test: placement never leaves the ranges a peer may write. Every registration
//! sits inside a larger buffer whose bytes outside it are guards; next to the regions in use
//! are a region of another PD, a region without remote rights and STags with and without the
//! remote invalidation right; receive WRs scatter into an area with gaps between their SGEs.
//! Random operations (Send, Send with Invalidate, Write, Read, Write/Send with Immediate,
//! FetchAdd, CmpSwap; most well formed, some aimed at the guards) run between two engines over
//! random TCP splits, MPA markers on and off, CRC on and off, an RQ or an SRQ, and sometimes
//! one wire byte flipped. Then:
//! - no byte outside a permitted range changed (snapshots of all memory before and after);
//! - no STag was invalidated unless it has the remote invalidation right and the QP's PD;
//! - with CRC on, a flipped byte the receiver read ends in a Terminate (or, when it made an
//!   FPDU longer than what followed, in an FPDU never finished, which a close of the
//!   connection ends), and every completion reported successful, with its data, is one the
//!   run without the flip reported too. ("Place first, check the CRC before delivering":
//!   bytes of the corrupted FPDU may have been placed, inside a range its header was allowed
//!   to write, never delivered.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::ops::Range;
use std::sync::Arc;

use crate::util::{contents, marker_streams, qp_config, sge, strip_stream, Rng, Side, PD};
use proptest::prelude::*;
use softwarp_engine::memory::Region;
use softwarp_engine::mr::{Access, PdId, Stag};
use softwarp_engine::qp::{QpState, StreamConfig};
use softwarp_engine::wr::{
    Payload, RecvWr, SendOp, SendWr, SgList, WcOpcode, WcStatus, WorkCompletion,
};

/// The other protection domain.
const OTHER_PD: PdId = PdId(2);
/// Guard bytes on each side of every registration.
const GUARD: usize = 1024;
/// Registered length of the remote targets (`target`, `read_src`) and of `a`'s sink.
const WIN: usize = 16 * 1024;
/// Receive WR slot: SGEs at [0, 100), [150, 400) and [500, 1000); the rest are gaps.
const SLOT: usize = 1024;
const RECV_SGES: [(usize, usize); 3] = [(0, 100), (150, 250), (500, 500)];
/// Most operations per case; each takes at most two receive WRs.
const MAX_OPS: usize = 8;

/// Where a remote access is aimed.
#[derive(Debug, Clone, Copy)]
enum Tgt {
    /// The region meant for it (writable, readable or atomic as the operation needs).
    Ok,
    /// A region with every right, in another PD.
    OtherPd,
    /// A region with no remote rights.
    NoRights,
    /// An STag nobody registered.
    Bogus,
}

#[derive(Debug, Clone, Copy)]
enum GOp {
    Send {
        len: u32,
        solicited: bool,
    },
    /// Send with Invalidate of: 0 an STag that may be invalidated, 1 one without the right,
    /// 2 one with the right in another PD, 3 the Write target (no right), 4 a bogus one.
    SendInv {
        len: u32,
        which: u8,
    },
    SendImm {
        len: u32,
    },
    Write {
        to: Tgt,
        off: i64,
        len: u32,
    },
    WriteImm {
        off: i64,
        len: u32,
    },
    Read {
        from: Tgt,
        off: i64,
        len: u32,
    },
    Atomic {
        cmp: bool,
        to: Tgt,
        off: i64,
    },
}

fn tgt() -> impl Strategy<Value = Tgt> {
    prop_oneof![
        8 => Just(Tgt::Ok),
        1 => Just(Tgt::OtherPd),
        1 => Just(Tgt::NoRights),
        1 => Just(Tgt::Bogus),
    ]
}

fn gop() -> impl Strategy<Value = GOp> {
    // Offsets from 64 bytes below the window to 64 past its end: mostly inside, some across
    // an edge (refused, nothing placed).
    let off = || -64i64..(WIN as i64 + 64);
    let len = || prop_oneof![0u32..16, 0u32..1000];
    prop_oneof![
        (len(), any::<bool>()).prop_map(|(len, solicited)| GOp::Send { len, solicited }),
        (len(), 0u8..5).prop_map(|(len, which)| GOp::SendInv { len, which }),
        len().prop_map(|len| GOp::SendImm { len }),
        (tgt(), off(), len()).prop_map(|(to, off, len)| GOp::Write { to, off, len }),
        (off(), len()).prop_map(|(off, len)| GOp::WriteImm { off, len }),
        (tgt(), off(), 1u32..1000).prop_map(|(from, off, len)| GOp::Read { from, off, len }),
        (
            any::<bool>(),
            tgt(),
            prop_oneof![(0i64..(WIN as i64 / 8)).prop_map(|w| w * 8), off()]
        )
            .prop_map(|(cmp, to, off)| GOp::Atomic { cmp, to, off }),
    ]
}

/// Memory watched for changes: the bytes outside `allowed` must never change.
struct Watch {
    name: &'static str,
    region: Arc<Region>,
    allowed: Vec<Range<usize>>,
    before: Vec<u8>,
}

impl Watch {
    fn check(&self) -> Result<(), TestCaseError> {
        let after = contents(&self.region);
        for (i, (a, b)) in after.iter().zip(&self.before).enumerate() {
            if a != b && !self.allowed.iter().any(|r| r.contains(&i)) {
                return Err(TestCaseError::fail(format!(
                    "{}: byte {i} outside the permitted ranges {:?} changed ({b:#04x} -> {a:#04x})",
                    self.name, self.allowed
                )));
            }
        }
        Ok(())
    }
}

/// A buffer of `GUARD + len + GUARD` pattern bytes whose middle `len` bytes are registered in
/// `pd` with `access` at an iova of its own; returns (region, STag, iova of the first
/// registered byte).
fn guarded(
    side: &mut Side,
    pd: PdId,
    len: usize,
    access: Access,
    seed: u64,
) -> (Arc<Region>, Stag, u64) {
    let r = Arc::new(Region::new_zeroed(GUARD + len + GUARD).unwrap());
    let mut fill = vec![0u8; r.len()];
    Rng::new(seed).fill(&mut fill);
    r.write_at(0, &fill).unwrap();
    let iova = 0x10_0000_0000 + seed * 0x1_0000_0000;
    let stag = side
        .mrs
        .register(pd, r.clone(), GUARD, len, Some(iova), access)
        .unwrap();
    (r, stag, iova)
}

/// The registered part of a [`guarded`] buffer of `len` bytes.
fn window(len: usize) -> Range<usize> {
    GUARD..GUARD + len
}

/// A case's configuration.
#[derive(Debug, Clone, Copy)]
struct Cfg {
    crc: bool,
    markers: (bool, bool),
    srq: bool,
    mss: usize,
    seed: u64,
    max: usize,
    staged: bool,
}

/// What a run delivered: successful completions and the data they name.
#[derive(Debug, PartialEq)]
struct Delivered {
    /// b's successful receive completions, each with the bytes of its receive slot.
    recv: Vec<(WorkCompletion, Vec<u8>)>,
    /// a's successful send completions, each with the bytes of its sink slot.
    send: Vec<(WorkCompletion, Vec<u8>)>,
}

/// A run's outcome.
struct Outcome {
    delivered: Delivered,
    /// Bytes each direction carried (a to b, b to a).
    wire_len: [usize; 2],
}

/// One direction of the simulated TCP connection.
#[derive(Default)]
struct Wire {
    /// Bytes sent and not yet consumed.
    buf: Vec<u8>,
    /// Bytes ever sent.
    sent: usize,
    /// Bytes the receiver consumed.
    consumed: usize,
}

/// Moves bytes from `tx` to `rx` once; flips the byte of this direction's stream at
/// `flip.0` with mask `flip.1` when it is sent. True when anything moved.
fn step(
    tx: &mut Side,
    rx: &mut Side,
    w: &mut Wire,
    rng: &mut Rng,
    cfg: Cfg,
    flip: Option<(usize, u8)>,
) -> bool {
    let start = w.buf.len();
    let n = tx.transmit_with(&mut w.buf, cfg.staged, || rng.piece(cfg.max));
    if let Some((at, mask)) = flip {
        if (w.sent..w.sent + n).contains(&at) {
            w.buf[start + at - w.sent] ^= mask;
        }
    }
    w.sent += n;
    let mut moved = n > 0;
    if !w.buf.is_empty() {
        let data = std::mem::take(&mut w.buf);
        let c = rx.receive_with(&data, cfg.staged, || rng.piece(cfg.max));
        w.buf = data[c..].to_vec();
        w.consumed += c;
        moved |= c > 0;
    }
    moved
}

/// Runs `ops` from a to b with `flip` (direction a to b, stream offset, mask), checks the
/// invariants that hold for every run, and returns what was delivered.
fn run(ops: &[GOp], cfg: Cfg, flip: Option<(bool, usize, u8)>) -> Result<Outcome, TestCaseError> {
    let mut s = StreamConfig::for_mss(cfg.mss);
    s.crc = cfg.crc;
    s.tx_stream_offset = 0;
    s.rx_stream_offset = 0;
    let (sa, sb) = marker_streams(s, cfg.markers.0, cfg.markers.1);
    let mut a = Side::new(1, sa);
    let mut b = Side::with_config(qp_config(2, cfg.srq), sb);
    let all = Access::LOCAL_WRITE
        | Access::REMOTE_WRITE
        | Access::REMOTE_READ
        | Access::REMOTE_ATOMIC
        | Access::REMOTE_INVALIDATE;

    // b: the responder and receiver, with its guards.
    let (target, tstag, tiova) = guarded(
        &mut b,
        PD,
        WIN,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
        1,
    );
    let (read_src, rsstag, rsiova) = guarded(&mut b, PD, WIN, Access::REMOTE_READ, 2);
    let (b_other, bostag, boiova) = guarded(&mut b, OTHER_PD, WIN, all, 3);
    let (b_norights, bnstag, bniova) = guarded(&mut b, PD, WIN, Access::LOCAL_WRITE, 4);
    let (inv_ok, iokstag, _) = guarded(
        &mut b,
        PD,
        256,
        Access::REMOTE_INVALIDATE | Access::REMOTE_READ,
        5,
    );
    let (inv_no, inostag, _) = guarded(&mut b, PD, 256, Access::REMOTE_READ, 6);
    let recv_len = 2 * MAX_OPS * SLOT;
    let (recv_area, rstag, riova) = guarded(&mut b, PD, recv_len, Access::LOCAL_WRITE, 7);
    // a: the requester, with its own guards (Read and Atomic Responses land in `sink`).
    let (src, sstag, siova) = guarded(&mut a, PD, MAX_OPS * SLOT, Access::NONE, 8);
    let (sink, kstag, kiova) = guarded(&mut a, PD, WIN, Access::LOCAL_WRITE, 9);
    let (a_other, _, _) = guarded(&mut a, OTHER_PD, WIN, all, 10);
    let (a_norights, _, _) = guarded(&mut a, PD, WIN, Access::LOCAL_WRITE, 11);
    let bogus = Stag(0x00de_ad07);

    let mut recv_slots: Vec<Range<usize>> = Vec::new();
    let mut post_recv = |b: &mut Side, wr_id: u64| {
        let slot = recv_slots.len() * SLOT;
        let sgl = SgList::from_slice(
            &RECV_SGES.map(|(o, l)| sge(rstag, riova, (slot + o) as u64, l as u32)),
        )
        .unwrap();
        let wr = RecvWr { wr_id, sgl };
        match b.srq.as_mut() {
            Some(srq) => srq.post_recv(wr).unwrap(),
            None => b.qp.post_recv(wr).unwrap(),
        }
        recv_slots.push(GUARD + slot..GUARD + slot + SLOT);
    };
    let remote = |t: Tgt, ok: (Stag, u64)| match t {
        Tgt::Ok => ok,
        Tgt::OtherPd => (bostag, boiova),
        Tgt::NoRights => (bnstag, bniova),
        Tgt::Bogus => (bogus, 0x1000),
    };
    for (i, op) in ops.iter().enumerate() {
        let slot = (i * SLOT) as u64;
        let src_sgl = |len: u32| SgList::single(sge(sstag, siova, slot, len));
        let at = |base: u64, off: i64| base.wrapping_add_signed(off);
        let (op, payload) = match *op {
            GOp::Send { len, solicited } => {
                post_recv(&mut b, i as u64);
                (
                    SendOp::Send {
                        solicited,
                        invalidate: None,
                    },
                    src_sgl(len),
                )
            }
            GOp::SendInv { len, which } => {
                post_recv(&mut b, i as u64);
                let stag = [iokstag, inostag, bostag, tstag, bogus][usize::from(which % 5)];
                (
                    SendOp::Send {
                        solicited: false,
                        invalidate: Some(stag),
                    },
                    src_sgl(len),
                )
            }
            GOp::SendImm { len } => {
                post_recv(&mut b, i as u64 * 100);
                post_recv(&mut b, i as u64 * 100 + 1);
                (
                    SendOp::SendWithImm {
                        solicited: false,
                        imm: i as u32 ^ 0xabcd,
                    },
                    src_sgl(len),
                )
            }
            GOp::Write { to, off, len } => {
                let (stag, base) = remote(to, (tstag, tiova));
                (
                    SendOp::Write {
                        remote_addr: at(base, off),
                        rkey: stag,
                    },
                    src_sgl(len),
                )
            }
            GOp::WriteImm { off, len } => {
                post_recv(&mut b, i as u64);
                (
                    SendOp::WriteWithImm {
                        remote_addr: at(tiova, off),
                        rkey: tstag,
                        imm: i as u32,
                    },
                    src_sgl(len),
                )
            }
            GOp::Read { from, off, len } => {
                let (stag, base) = remote(from, (rsstag, rsiova));
                (
                    SendOp::Read {
                        remote_addr: at(base, off),
                        rkey: stag,
                    },
                    SgList::single(sge(kstag, kiova, slot, len)),
                )
            }
            GOp::Atomic { cmp, to, off } => {
                let (stag, base) = remote(to, (tstag, tiova));
                let remote_addr = at(base, off);
                let op = if cmp {
                    SendOp::CmpSwap {
                        remote_addr,
                        rkey: stag,
                        compare: 0,
                        swap: 0x5a5a,
                    }
                } else {
                    SendOp::FetchAdd {
                        remote_addr,
                        rkey: stag,
                        add: 3,
                    }
                };
                (op, SgList::single(sge(kstag, kiova, slot, 8)))
            }
        };
        let wr = SendWr {
            wr_id: i as u64,
            op,
            payload: Payload::Sgl(payload),
            signaled: true,
            fence: false,
        };
        a.qp.post_send(&wr, &a.mrs).unwrap();
    }
    let mut watches = vec![
        ("b target", target, vec![window(WIN)]),
        ("b read source", read_src, vec![]),
        ("b other PD", b_other, vec![]),
        ("b no remote rights", b_norights, vec![]),
        ("b invalidatable", inv_ok, vec![]),
        ("b not invalidatable", inv_no, vec![]),
        ("b receive area", recv_area.clone(), {
            // Only the SGEs of the receive WRs posted.
            let mut v = Vec::new();
            for r in &recv_slots {
                for (o, l) in RECV_SGES {
                    v.push(r.start + o..r.start + o + l);
                }
            }
            v
        }),
        ("a source", src, vec![]),
        ("a sink", sink.clone(), vec![window(WIN)]),
        ("a other PD", a_other, vec![]),
        ("a no remote rights", a_norights, vec![]),
    ]
    .into_iter()
    .map(|(name, region, allowed)| Watch {
        name,
        before: contents(&region),
        region,
        allowed,
    })
    .collect::<Vec<_>>();

    // Drive both directions until nothing moves.
    let mut rng = Rng::new(cfg.seed);
    let (mut ab, mut ba) = (Wire::default(), Wire::default());
    let flip_ab = flip.filter(|f| f.0).map(|f| (f.1, f.2));
    let flip_ba = flip.filter(|f| !f.0).map(|f| (f.1, f.2));
    let mut settled = false;
    for _ in 0..100_000 {
        let mut moved = step(&mut a, &mut b, &mut ab, &mut rng, cfg, flip_ab);
        moved |= step(&mut b, &mut a, &mut ba, &mut rng, cfg, flip_ba);
        a.pump();
        b.pump();
        if !moved {
            settled = true;
            break;
        }
    }
    prop_assert!(settled, "the pair did not settle");

    // A flipped byte the receiver read, with CRC on, ends in a Terminate, or in an FPDU
    // never finished (a longer ULPDU_Length than what followed), which a close ends.
    if let (true, Some((to_b, at, _))) = (cfg.crc, flip) {
        let (tx, rx, w, markers) = if to_b {
            (&a, &mut b, &ab, cfg.markers.0)
        } else {
            (&b, &mut a, &ba, cfg.markers.1)
        };
        if w.consumed > at {
            // Which FPDU of the stream (as sent, before the flip) the byte belongs to.
            let mut end = 0;
            let index = strip_stream(&tx.sent, 0, markers, true)
                .iter()
                .position(|(n, _)| {
                    end += n;
                    at < end
                })
                .unwrap();
            if rx.qp.state() == QpState::Rts {
                prop_assert!(
                    rx.qp.stats().rx_fpdus <= index as u64,
                    "FPDU {index} with byte {at} flipped was accepted"
                );
                rx.qp.handle_llp_closed();
                rx.pump();
            } else {
                prop_assert_eq!(rx.qp.state(), QpState::Error);
                prop_assert_eq!(rx.qp.stats().terminates_sent, 1);
            }
        }
    }

    for w in &mut watches {
        w.check()?;
    }
    // Only an STag with the remote invalidation right, in the QP's PD, may be invalidated.
    for side in [&a, &b] {
        for index in 0..64u32 {
            for key in 0..=255u8 {
                let Some(info) = side.mrs.info(Stag::from_parts(index, key)) else {
                    continue;
                };
                if !info.valid {
                    prop_assert!(
                        info.access.contains(Access::REMOTE_INVALIDATE) && info.pd == PD,
                        "{:?} invalidated",
                        info
                    );
                }
            }
        }
    }
    prop_assert!(
        b.mrs.info(inostag).unwrap().valid && b.mrs.info(bostag).unwrap().valid,
        "an STag without the right, or of another PD, was invalidated"
    );

    let recv_bytes = contents(&recv_area);
    let sink_bytes = contents(&sink);
    let mut recv_order: Vec<u64> = Vec::new();
    // Receive WR ids in posting order, to find each completion's slot.
    for (i, op) in ops.iter().enumerate() {
        match op {
            GOp::Send { .. } | GOp::SendInv { .. } | GOp::WriteImm { .. } => {
                recv_order.push(i as u64)
            }
            GOp::SendImm { .. } => {
                recv_order.push(i as u64 * 100);
                recv_order.push(i as u64 * 100 + 1);
            }
            _ => {}
        }
    }
    let recv = b
        .recv_wcs()
        .into_iter()
        .filter(|w| w.status == WcStatus::Success)
        .map(|w| {
            let k = recv_order.iter().position(|&id| id == w.wr_id).unwrap();
            (w, recv_bytes[recv_slots[k].clone()].to_vec())
        })
        .collect();
    let send = a
        .send_wcs()
        .into_iter()
        .filter(|w| w.status == WcStatus::Success)
        .map(|w| {
            let data = if matches!(w.opcode, WcOpcode::RdmaRead)
                || matches!(ops[w.wr_id as usize], GOp::Atomic { .. })
            {
                let s = GUARD + w.wr_id as usize * SLOT;
                sink_bytes[s..s + SLOT].to_vec()
            } else {
                Vec::new()
            };
            (w, data)
        })
        .collect();
    Ok(Outcome {
        delivered: Delivered { recv, send },
        wire_len: [ab.sent, ba.sent],
    })
}

/// `default` cases unless `PROPTEST_CASES` asks for another number.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn cfg() -> impl Strategy<Value = Cfg> {
    (
        any::<bool>(),
        (any::<bool>(), any::<bool>()),
        any::<bool>(),
        prop_oneof![Just(1448usize), Just(256usize)],
        any::<u64>(),
        prop_oneof![Just(1usize), 1usize..16, 1usize..4000],
        any::<bool>(),
    )
        .prop_map(|(crc, markers, srq, mss, seed, max, staged)| Cfg {
            crc,
            markers,
            srq,
            mss,
            seed,
            max,
            staged,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(256), ..ProptestConfig::default() })]

    #[test]
    fn placement_never_leaves_permitted_ranges_and_flipped_bytes_never_deliver(
        ops in prop::collection::vec(gop(), 1..=MAX_OPS),
        cfg in cfg(),
        flip in prop::option::of((any::<bool>(), any::<usize>(), 1u8..=255)),
    ) {
        let clean = run(&ops, cfg, None)?;
        if let Some((to_b, at, mask)) = flip {
            let len = clean.wire_len[usize::from(!to_b)];
            prop_assume!(len > 0);
            let flipped = run(&ops, cfg, Some((to_b, at % len, mask)))?;
            if cfg.crc {
                // Everything delivered was delivered by the clean run too, byte for byte.
                for (wc, data) in &flipped.delivered.recv {
                    prop_assert!(
                        clean.delivered.recv.iter().any(|(c, d)| c == wc && d == data),
                        "receive {:?} delivered what the clean run did not", wc
                    );
                }
                for (wc, data) in &flipped.delivered.send {
                    prop_assert!(
                        clean.delivered.send.iter().any(|(c, d)| c == wc && d == data),
                        "send {:?} delivered what the clean run did not", wc
                    );
                }
            }
        }
    }
}
