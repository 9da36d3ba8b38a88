//! Early Sends (`Qp::recv_from`): once two large Send messages of one layout came in a
//! row, the next message's first large payload is read straight into the posted receive,
//! in the same read as its leading FPDUs and header. These tests check the read count that
//! this is for, and that whatever the next message really is (a Write, a Send laid out
//! otherwise, a short one), every byte still lands where its header names, nothing outside
//! the posted receive's scatter list or the Write's range changes, and every completion is
//! right, with whole and with cut reads.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use crate::util::*;
use softwarp_engine::memory::Region;
use softwarp_engine::mr::{Access, Stag};
use softwarp_engine::qp::StreamConfig;
use softwarp_engine::wr::{Payload, RecvWr, SendOp, SendWr, SgList, WcOpcode, WcStatus};

/// Guard bytes around every destination range.
const GUARD: usize = 4096;
const GUARD_BYTE: u8 = 0xEE;

/// What one message is.
#[derive(Debug, Clone, Copy)]
enum Msg {
    /// A Send of `len` bytes from `src_off` bytes into a page of the source.
    Send { len: usize, src_off: usize },
    /// A Write of `len` bytes from `src_off` bytes into a page.
    Write { len: usize, src_off: usize },
}

const MAX_LEN: usize = 300 * 1024;

/// Two QPs, a filled source on `a`; on `b` a receive buffer and a Write sink, each with
/// guard bytes around the range a message may use.
struct Rig {
    a: Side,
    b: Side,
    sstag: Stag,
    src_base: u64,
    src: Vec<u8>,
    rbuf: Arc<Region>,
    rstag: Stag,
    riova: u64,
    sink: Arc<Region>,
    kstag: Stag,
    kiova: u64,
    next_id: u64,
    /// The posted receive's id.
    recv_posted: Option<u64>,
    /// Receives posted from now on have two scatter elements, the first this long.
    recv_split: Option<u32>,
}

impl Rig {
    fn new() -> Self {
        let stream = StreamConfig::for_mss(65535);
        let (mut a, mut b) = (Side::new(1, stream), Side::new(2, stream));
        let (src_region, sstag, siova, filled) =
            a.filled_region(MAX_LEN + 3 * 4096, Access::NONE, 7);
        // Page-aligned start in the source (a page-aligned Send is led in with short FPDUs).
        let base = ((4096 - src_region.addr() % 4096) % 4096) as usize;
        let src = filled[base..].to_vec();
        let (rbuf, rstag, riova) = b.region(MAX_LEN + 2 * GUARD, Access::LOCAL_WRITE);
        let (sink, kstag, kiova) = b.region(
            MAX_LEN + 2 * GUARD,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        );
        rbuf.fill(0, rbuf.len(), GUARD_BYTE).unwrap();
        sink.fill(0, sink.len(), GUARD_BYTE).unwrap();
        Rig {
            a,
            b,
            sstag,
            src_base: siova + base as u64,
            src,
            rbuf,
            rstag,
            riova,
            sink,
            kstag,
            kiova,
            next_id: 0,
            recv_posted: None,
            recv_split: None,
        }
    }

    /// Posts `m` on `a` (and, for a Send, a receive of `MAX_LEN` bytes on `b`, the
    /// buffer's guard bytes restored first), transmits it, receives it with `receive` and
    /// checks where every byte went and the completions.
    fn exchange(&mut self, m: Msg, receive: impl FnOnce(&mut Side, &[u8])) {
        let id = self.next_id;
        self.next_id += 1;
        let (len, src_off, send) = match m {
            Msg::Send { len, src_off } => (len, src_off, true),
            Msg::Write { len, src_off } => (len, src_off, false),
        };
        // A receive is always posted, before Writes too (as applications keep them), so
        // that an early read has somewhere to go whatever the message is.
        if self.recv_posted.is_none() {
            // One scatter element, or two back to back in the buffer (cut at `recv_split`).
            let (g, max) = (GUARD as u64, MAX_LEN as u32);
            let sgl = match self.recv_split {
                None => SgList::single(sge(self.rstag, self.riova, g, max)),
                Some(cut) => SgList::from_slice(&[
                    sge(self.rstag, self.riova, g, cut),
                    sge(self.rstag, self.riova, g + u64::from(cut), max - cut),
                ])
                .unwrap(),
            };
            self.b.qp.post_recv(RecvWr { wr_id: id, sgl }).unwrap();
            self.recv_posted = Some(id);
        }
        let op = if send {
            self.rbuf.fill(0, self.rbuf.len(), GUARD_BYTE).unwrap();
            SendOp::Send {
                solicited: false,
                invalidate: None,
            }
        } else {
            self.sink.fill(0, self.sink.len(), GUARD_BYTE).unwrap();
            SendOp::Write {
                remote_addr: self.kiova + GUARD as u64,
                rkey: self.kstag,
            }
        };
        let wr = SendWr {
            wr_id: id,
            op,
            payload: Payload::Sgl(SgList::single(sge(
                self.sstag,
                self.src_base,
                src_off as u64,
                len as u32,
            ))),
            signaled: true,
            fence: false,
        };
        self.a.qp.post_send(&wr, &self.a.mrs).unwrap();
        let mut wire = Vec::new();
        self.a.transmit_with(&mut wire, true, || usize::MAX);
        receive(&mut self.b, &wire);
        let wcs = self.a.send_wcs();
        assert!(
            wcs.len() == 1 && wcs[0].status == WcStatus::Success,
            "message {id} ({m:?}): {wcs:?}"
        );
        let data = &self.src[src_off..src_off + len];
        let (into, what) = if send {
            let wcs = self.b.recv_wcs();
            assert_eq!(wcs.len(), 1, "message {id} ({m:?}): {wcs:?}");
            assert_eq!(wcs[0].status, WcStatus::Success, "message {id} ({m:?})");
            assert_eq!(wcs[0].opcode, WcOpcode::Recv, "message {id} ({m:?})");
            assert_eq!(wcs[0].byte_len as usize, len, "message {id} ({m:?})");
            assert_eq!(
                Some(wcs[0].wr_id),
                self.recv_posted.take(),
                "message {id} ({m:?})"
            );
            (&self.rbuf, "receive buffer")
        } else {
            assert!(self.b.recv_wcs().is_empty(), "message {id} ({m:?})");
            (&self.sink, "sink")
        };
        let got = contents(into);
        assert!(
            got[GUARD..GUARD + len] == *data,
            "message {id} ({m:?}): the {what} holds other bytes"
        );
        assert!(
            got[..GUARD].iter().all(|&b| b == GUARD_BYTE),
            "message {id} ({m:?}): the {what} changed before the range"
        );
        if send {
            // Beyond the posted scatter list: never touched.
            assert!(
                got[GUARD + MAX_LEN..].iter().all(|&b| b == GUARD_BYTE),
                "message {id} ({m:?}): the {what} changed after its scatter list"
            );
        } else {
            assert!(
                got[GUARD + len..].iter().all(|&b| b == GUARD_BYTE),
                "message {id} ({m:?}): the {what} changed after the Write's range"
            );
        }
    }
}

/// A ping-pong of 64 KiB Sends from a page-aligned buffer (two 1-byte leading FPDUs, a
/// full one, a short last one): the first two messages cost two reads each (the leading
/// FPDUs and the full one's header into the staging buffer, then the payload straight into
/// the receive; the very first is read ahead whole and copied, as messages are not known to
/// be large yet); from the third on, one read each, its payload read early and confirmed.
#[test]
fn after_two_large_sends_of_one_layout_each_is_one_read() {
    let mut rig = Rig::new();
    for i in 0..6 {
        let before = rig.b.qp.stats().rx_early_bytes;
        let mut reads = Vec::new();
        rig.exchange(
            Msg::Send {
                len: 64 * 1024,
                src_off: 0,
            },
            |b, wire| reads = b.receive_queued(wire),
        );
        let early = rig.b.qp.stats().rx_early_bytes - before;
        if i < 2 {
            // The first is read ahead whole (messages were not known to be large yet).
            if i == 1 {
                assert_eq!(reads.len(), 2, "message {i}: {reads:?}");
            }
            assert_eq!(early, 0, "message {i}");
        } else {
            assert_eq!(reads.len(), 1, "message {i}: {reads:?}");
            assert!(reads[0].head.is_some(), "message {i}: {reads:?}");
            assert!(early > 60_000, "message {i}: {early} bytes early");
        }
    }
    assert_eq!(rig.b.qp.stats().rx_early_missed_bytes, 0);
}

/// After Sends armed the early read, a Write comes: its bytes, read early into the posted
/// receive, are copied out and written where the Write names (nothing around it changes),
/// the receive then takes the next Send whole, and the early reads stop until two Sends of
/// one layout came again. A Send laid out otherwise (from another page offset, a short
/// one) is the same.
#[test]
fn what_is_not_the_expected_send_still_lands_where_its_header_names() {
    let mut rig = Rig::new();
    let big = Msg::Send {
        len: 64 * 1024,
        src_off: 0,
    };
    let others = [
        Msg::Write {
            len: 64 * 1024,
            src_off: 0,
        },
        Msg::Write {
            len: 200 * 1024,
            src_off: 40,
        },
        Msg::Send {
            len: 64 * 1024,
            src_off: 100,
        },
        Msg::Send {
            len: 20 * 1024,
            src_off: 0,
        },
        Msg::Send { len: 1, src_off: 0 },
        // Led in with its own 112-byte tail (FPDUs carry up to 65,508 payload bytes here,
        // `for_mss(65535)`): the large payload starts at message offset 112, not 28.
        Msg::Send {
            len: 256 * 1024,
            src_off: 0,
        },
        // 2 x 65,508 + 28 bytes: led in as a 64 KiB Send is.
        Msg::Send {
            len: 131_044,
            src_off: 0,
        },
    ];
    for other in others {
        for _ in 0..3 {
            rig.exchange(big, |b, wire| {
                b.receive_queued(wire);
            });
        }
        let missed = rig.b.qp.stats().rx_early_missed_bytes;
        let early = rig.b.qp.stats().rx_early_bytes;
        rig.exchange(other, |b, wire| {
            b.receive_queued(wire);
        });
        let stats = rig.b.qp.stats();
        match other {
            // A longer Send of the same start is the expected one.
            Msg::Send {
                len: 131_044,
                src_off: 0,
            } => {
                assert!(stats.rx_early_bytes > early, "{other:?}");
                assert_eq!(stats.rx_early_missed_bytes, missed, "{other:?}");
            }
            // Shorter than the expected lead: all of it went to the staging buffer.
            Msg::Send { len: 1, .. } => {
                assert_eq!(stats.rx_early_missed_bytes, missed, "{other:?}");
                assert_eq!(stats.rx_early_bytes, early, "{other:?}");
            }
            _ => {
                assert!(stats.rx_early_missed_bytes > missed, "{other:?}");
                // The next big Send is not read early (one Send of the layout since).
                let before = rig.b.qp.stats().rx_early_bytes;
                rig.exchange(big, |b, wire| {
                    b.receive_queued(wire);
                });
                assert_eq!(rig.b.qp.stats().rx_early_bytes, before, "after {other:?}");
            }
        }
    }
}

/// Random messages (large Sends of one layout most of the time, so that early reads are
/// armed often, and Writes and Sends of other layouts between them), into receives of one
/// or two scatter elements, each received in random pieces, as a socket delivers them:
/// every byte and completion is right, and both outcomes of an early read happened.
#[test]
fn random_messages_in_random_pieces_land_where_their_headers_name() {
    // Four seeds: about half a second in all.
    for seed in [0x005e_ed18, 1, 2, 3] {
        let mut rig = Rig::new();
        let mut rng = Rng::new(seed);
        for _ in 0..60 {
            // FPDUs carry up to 65,508 payload bytes here (`for_mss(65535)`). 131,044 =
            // 2 x 65,508 + 28: led in like 64 KiB (the 28-byte tail goes with the leading
            // FPDUs), so the same layout; 100,000 and 200 KiB are led in with 1-byte FPDUs
            // only (their tails are long), another layout.
            let len = [64 * 1024, 131_044, 100_000, 20_000, 1, 200 * 1024];
            let m = match rng.next_u64() % 10 {
                0..=5 => Msg::Send {
                    len: 64 * 1024,
                    src_off: 0,
                },
                6 | 7 => Msg::Send {
                    len: len[rng.next_u64() as usize % len.len()],
                    src_off: [0, 8, 4000][rng.next_u64() as usize % 3],
                },
                _ => Msg::Write {
                    len: len[rng.next_u64() as usize % len.len()],
                    src_off: [0, 20][rng.next_u64() as usize % 2],
                },
            };
            // Receives of one scatter element or two, cut before, inside or after the place
            // of the first large payload (message offset 28 for an aligned 64 KiB Send here, up
            // to 65,536).
            rig.recv_split = [
                None,
                None,
                Some(1),
                Some(30_000),
                Some(28),
                Some(65_530),
                Some(70_000),
            ][rng.next_u64() as usize % 7];
            let mode = rng.next_u64() % 4;
            let mut pieces = Rng::new(rng.next_u64());
            rig.exchange(m, |b, wire| {
                let piece = move || match mode {
                    // Everything queued.
                    0 => usize::MAX,
                    // Large pieces, as a socket of a fast peer.
                    1 => 1 + pieces.piece(100_000),
                    // Small ones.
                    2 => 1 + pieces.piece(200),
                    // Either.
                    _ => {
                        if pieces.next_u64().is_multiple_of(2) {
                            1 + pieces.piece(80)
                        } else {
                            1 + pieces.piece(70_000)
                        }
                    }
                };
                assert_eq!(b.receive_with(wire, true, piece), wire.len());
            });
        }
        let s = rig.b.qp.stats();
        assert!(s.rx_early_bytes > 0, "no early read was confirmed");
        // The four seeds give 237,599 to 628,098 bytes early.
        assert!(
            s.rx_early_bytes > 3 * 60_000,
            "{} bytes early: few early reads confirmed",
            s.rx_early_bytes
        );
        assert!(s.rx_early_missed_bytes > 0, "no early read missed");
    }
}
