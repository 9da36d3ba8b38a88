//! Receive-path fuzzing of the engine (issue 17), as a property test: byte streams into a
//! connected QP with guarded registrations (`rx_fuzz/harness.rs`, shared with the cargo-fuzz
//! target `fuzz/fuzz_targets/engine_rx.rs`), checking that the engine never panics or
//! reports a bug and that no byte outside the ranges the peer may write changes.
//!
//! Two kinds of streams: arbitrary bytes, and FPDUs built with the wire crate's emitters
//! (RDMA Writes and Read Responses aimed at every registration's STag and around its
//! bounds, Sends with random MSN/MO, Read Requests, raw ULPDUs), framed with a good or a bad
//! CRC, then with random bytes flipped: the structured ones get past the framing and the
//! header checks, where placement happens.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "rx_fuzz/harness.rs"]
mod harness;

use proptest::prelude::*;
use softwarp_wire::mpa::fpdu::Fpdu;
use softwarp_wire::rdmap::{Message, Placement, ReadRequestRepr, Segment};

use harness::{Target, IOVA, LEN};

#[derive(Debug, Clone)]
enum Seg {
    /// Tagged Write (`resp` false) or Read Response into target `t` (4: a random STag) at
    /// `off` from its iova (may be outside), `len` bytes.
    Tagged {
        resp: bool,
        t: usize,
        stag: u32,
        off: i64,
        len: usize,
        last: bool,
    },
    Send {
        msn: u32,
        mo: u32,
        len: usize,
        last: bool,
    },
    ReadRequest {
        t: usize,
        size: u32,
    },
    Raw(Vec<u8>),
    /// Consecutive FPDUs of one message, `lens` bytes each, the Last flag on the last one
    /// only (a run, `Qp::rx_run_fpdu`): Send segments of MSN 1 from MO 0 (`send`), or tagged
    /// FPDUs as `Tagged` into target `t` from `off` on, each continuing the one before.
    Run {
        send: bool,
        resp: bool,
        t: usize,
        off: i64,
        lens: Vec<usize>,
    },
}

fn seg() -> impl Strategy<Value = Seg> {
    prop_oneof![
        3 => (any::<bool>(), 0..5usize, any::<u32>(), -300i64..(LEN as i64 + 300), 0..700usize, any::<bool>())
            .prop_map(|(resp, t, stag, off, len, last)| Seg::Tagged { resp, t, stag, off, len, last }),
        3 => (0..12u32, 0..600u32, 0..700usize, any::<bool>())
            .prop_map(|(msn, mo, len, last)| Seg::Send { msn, mo, len, last }),
        1 => (0..5usize, 0..9000u32).prop_map(|(t, size)| Seg::ReadRequest { t, size }),
        1 => proptest::collection::vec(any::<u8>(), 0..64).prop_map(Seg::Raw),
        2 => run(),
    ]
}

fn run() -> impl Strategy<Value = Seg> {
    (
        any::<bool>(),
        any::<bool>(),
        0..5usize,
        -100i64..(LEN as i64),
        proptest::collection::vec(1..400usize, 2..8),
    )
        .prop_map(|(send, resp, t, off, lens)| Seg::Run {
            send,
            resp,
            t,
            off,
            lens,
        })
}

/// The ULPDUs of `s` for a target whose STags are `stags`: one, or a run's.
fn ulpdus(s: &Seg, stags: &[u32; 4]) -> Vec<Vec<u8>> {
    let Seg::Run {
        send,
        resp,
        t,
        off,
        lens,
    } = s
    else {
        return vec![ulpdu(s, stags)];
    };
    let mut at = 0;
    let mut out = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        let last = i + 1 == lens.len();
        let one = if *send {
            Seg::Send {
                msn: 1,
                mo: at as u32,
                len,
                last,
            }
        } else {
            Seg::Tagged {
                resp: *resp,
                t: *t,
                stag: 0,
                off: off + at as i64,
                len,
                last,
            }
        };
        out.push(ulpdu(&one, stags));
        at += len;
    }
    out
}

/// The ULPDU of `s` (not a run) for a target whose STags are `stags`.
fn ulpdu(s: &Seg, stags: &[u32; 4]) -> Vec<u8> {
    let payload: Vec<u8>;
    let seg = match s {
        Seg::Raw(b) => return b.clone(),
        Seg::Run { .. } => unreachable!("`ulpdus` expands a run"),
        &Seg::Tagged {
            resp,
            t,
            stag,
            off,
            len,
            last,
        } => {
            payload = vec![0xa5; len];
            let stag = if t < 4 { stags[t] } else { stag };
            let base = IOVA[t % 4];
            Segment {
                last,
                placement: Placement::Tagged {
                    stag,
                    tagged_offset: base.wrapping_add_signed(off),
                },
                message: if resp {
                    Message::RdmaReadResponse
                } else {
                    Message::RdmaWrite
                },
                payload: &payload,
            }
        }
        &Seg::Send { msn, mo, len, last } => {
            payload = vec![0x5a; len];
            Segment {
                last,
                placement: Placement::Untagged { msn, mo },
                message: Message::Send,
                payload: &payload,
            }
        }
        &Seg::ReadRequest { t, size } => {
            return emit(&Segment {
                last: true,
                placement: Placement::Untagged { msn: 1, mo: 0 },
                message: Message::RdmaReadRequest(ReadRequestRepr {
                    sink_stag: 0x0012_3400,
                    sink_tagged_offset: 0x7000_0000,
                    read_size: size,
                    source_stag: stags[t % 4],
                    source_tagged_offset: IOVA[t % 4],
                }),
                payload: &[],
            })
        }
    };
    emit(&seg)
}

fn emit(seg: &Segment<'_>) -> Vec<u8> {
    let mut out = vec![0u8; seg.buffer_len()];
    let n = seg.emit(&mut out).unwrap();
    out.truncate(n);
    out
}

fn frame(ulpdu: &[u8], crc: bool) -> Vec<u8> {
    let f = Fpdu { ulpdu };
    let mut out = vec![0u8; f.buffer_len()];
    match f.emit(&mut out, crc) {
        Ok(n) => {
            out.truncate(n);
            out
        }
        // Too long for an FPDU: send the bytes as they are.
        Err(_) => ulpdu.to_vec(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_write_outside_what_the_peer_may_write(
        cfg in any::<u8>(),
        staged in any::<bool>(),
        cuts in proptest::collection::vec(any::<u8>(), 0..8),
        data in proptest::collection::vec(any::<u8>(), 0..4096),
    ) {
        let mut t = Target::new(cfg);
        t.feed(&data, &cuts, staged);
    }

    #[test]
    fn crafted_fpdus_with_flips_never_write_outside_what_the_peer_may_write(
        cfg in any::<u8>(),
        staged in any::<bool>(),
        cuts in proptest::collection::vec(any::<u8>(), 0..8),
        segs in proptest::collection::vec(seg(), 1..12),
        bad_crc in proptest::collection::vec(any::<bool>(), 12),
        flips in proptest::collection::vec((any::<usize>(), 1u8..=255), 0..3),
    ) {
        let mut t = Target::new(cfg);
        let stags = [t.write.stag.0, t.read.stag.0, t.none.stag.0, t.other_pd.stag.0];
        let crc = harness::stream_config(cfg).crc;
        let mut stream = Vec::new();
        for (i, s) in segs.iter().enumerate() {
            for (j, u) in ulpdus(s, &stags).iter().enumerate() {
                let mut f = frame(u, crc);
                if bad_crc[i] && crc && f.len() >= 4 && j == i % 3 {
                    let n = f.len();
                    f[n - 1] ^= 0x5a;
                }
                stream.extend_from_slice(&f);
            }
        }
        for (at, mask) in flips {
            if !stream.is_empty() {
                let n = stream.len();
                stream[at % n] ^= mask;
            }
        }
        t.feed(&stream, &cuts, staged);
    }

    /// Runs only, read whole into the staging buffer without markers (where
    /// `Qp::rx_run_fpdu` takes their middle FPDUs), some CRCs bad, some bytes flipped.
    #[test]
    fn runs_never_write_outside_what_the_peer_may_write(
        cfg in any::<u8>(),
        runs in proptest::collection::vec(run(), 1..4),
        bad_crc in any::<u8>(),
        flips in proptest::collection::vec((any::<usize>(), 1u8..=255), 0..2),
    ) {
        let cfg = cfg & !2;
        let mut t = Target::new(cfg);
        let stags = [t.write.stag.0, t.read.stag.0, t.none.stag.0, t.other_pd.stag.0];
        let crc = harness::stream_config(cfg).crc;
        let mut stream = Vec::new();
        for (i, u) in runs.iter().flat_map(|s| ulpdus(s, &stags)).enumerate() {
            let mut f = frame(&u, crc);
            if crc && i == usize::from(bad_crc) {
                let n = f.len();
                f[n - 1] ^= 0x5a;
            }
            stream.extend_from_slice(&f);
        }
        for (at, mask) in flips {
            let n = stream.len();
            stream[at % n] ^= mask;
        }
        t.feed(&stream, &[], true);
    }
}

/// The harness itself catches a write outside the permitted ranges (the check is not
/// vacuous): a byte of a guard changed behind the engine's back is reported.
#[test]
#[should_panic(expected = "a guard of WRITE changed")]
fn the_check_sees_a_changed_guard() {
    let t = Target::new(0);
    t.write
        .region
        .write_at(harness::GUARD - 1, &[0xff])
        .unwrap();
    t.check();
}

/// A well-formed Write into the permitted range lands (the streams reach placement).
#[test]
fn a_good_write_is_placed() {
    let mut t = Target::new(0);
    let stags = [
        t.write.stag.0,
        t.read.stag.0,
        t.none.stag.0,
        t.other_pd.stag.0,
    ];
    let s = Seg::Tagged {
        resp: false,
        t: 0,
        stag: 0,
        off: 100,
        len: 64,
        last: true,
    };
    let f = frame(&ulpdu(&s, &stags), false);
    t.feed(&f, &[], false);
    let mut got = [0u8; 64];
    t.write
        .region
        .read_at(harness::GUARD + 100, &mut got)
        .unwrap();
    assert_eq!(got, [0xa5; 64]);
}
