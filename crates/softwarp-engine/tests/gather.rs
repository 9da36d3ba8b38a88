//! `Qp::send_to` gathers several FPDUs per write: the stream is as long as the one written
//! whole (the bytes differ only by the random STag keys of each setup), whatever prefix of
//! each offer the writer takes, and the peer checks every CRC, places every byte and
//! completes everything.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod util;

use softwarp_engine::mr::Access;
use softwarp_engine::qp::{SendEnd, StreamConfig, TxPiece, VectoredWrite};
use softwarp_engine::wr::{Payload, RecvWr, SendOp, SendWr, SgList, WcStatus};
use util::*;

/// A writer that takes a random prefix of each offer (sometimes all of it) and notes the
/// largest offer; with `lie`, it claims one byte more than it was offered.
struct Prefixes {
    out: Vec<u8>,
    rng: Rng,
    max_seen: usize,
    lie: bool,
}

impl VectoredWrite for Prefixes {
    fn write_from(&mut self, pieces: &[TxPiece<'_>]) -> std::io::Result<usize> {
        let offered: usize = pieces.iter().map(|p| p.len()).sum();
        assert!(offered > 0);
        self.max_seen = self.max_seen.max(offered);
        if self.lie {
            return Ok(offered + 1);
        }
        let want = if self.rng.next_u64().is_multiple_of(3) {
            offered
        } else {
            1 + (self.rng.next_u64() as usize % offered)
        };
        let mut done = 0;
        for p in pieces {
            if done == want {
                break;
            }
            let take = p.len().min(want - done);
            let start = self.out.len();
            self.out.resize(start + p.len(), 0);
            assert_eq!(p.copy_to(&mut self.out[start..]), p.len());
            self.out.truncate(start + take);
            done += take;
        }
        Ok(done)
    }
}

/// One sender with a mixed workload; returns (sender, receiver, (source bytes, sink,
/// receive buffer)).
fn setup(stream: StreamConfig) -> (Side, Side, Mem) {
    let mut a = Side::new(1, stream);
    let mut b = Side::new(2, stream);
    let (_src, sstag, siova, data) = a.filled_region(1 << 20, Access::NONE, 5);
    let (sink, kstag, kiova) = b.region(1 << 20, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let (rbuf, rstag, riova) = b.region(1 << 20, Access::LOCAL_WRITE);
    for i in 0..4u64 {
        b.qp.post_recv(RecvWr {
            wr_id: i,
            sgl: SgList::single(sge(rstag, riova, 0, 1 << 20)),
        })
        .unwrap();
    }
    let ops: [(u64, usize, bool); 6] = [
        (1, 1 << 20, true),
        (2, 100, false),
        (3, 300_000, true),
        (4, 70_000, false),
        (5, 1, true),
        (6, 65_536, false),
    ];
    for (id, len, write) in ops {
        let op = if write {
            SendOp::Write {
                remote_addr: kiova,
                rkey: kstag,
            }
        } else {
            SendOp::Send {
                solicited: false,
                invalidate: None,
            }
        };
        a.qp.post_send(
            &SendWr {
                wr_id: id,
                op,
                payload: Payload::Sgl(SgList::single(sge(sstag, siova, 0, len as u32))),
                signaled: true,
                fence: false,
            },
            &a.mrs,
        )
        .unwrap();
    }
    (a, b, (data, sink, rbuf))
}

type Mem = (
    Vec<u8>,
    std::sync::Arc<softwarp_engine::memory::Region>,
    std::sync::Arc<softwarp_engine::memory::Region>,
);

fn stream_for(mss: usize, crc: bool) -> StreamConfig {
    let mut s = StreamConfig::for_mss(mss);
    s.crc = crc;
    s
}

#[test]
fn gathered_fpdus_make_the_same_stream_as_one_at_a_time_for_any_commit_sizes() {
    for (mss, crc, seed) in [
        (65535, true, 1),
        (65535, false, 2),
        (1448, true, 3),
        (9000, true, 4),
    ] {
        let (mut a1, _, _) = setup(stream_for(mss, crc));
        let mut plain = Vec::new();
        a1.transmit(&mut plain, || usize::MAX);

        let (mut a2, mut b2, (data, sink, rbuf)) = setup(stream_for(mss, crc));
        let mut w = Prefixes {
            out: Vec::new(),
            rng: Rng::new(seed),
            max_seen: 0,
            lie: false,
        };
        let mut budget = usize::MAX;
        let end = a2.qp.send_to(&mut w, None, &mut budget);
        assert!(matches!(end, SendEnd::Idle), "{end:?}");
        let (gathered, max_seen) = (w.out, w.max_seen);
        assert_eq!(gathered.len(), plain.len(), "mss {mss}");
        if mss == 65535 {
            assert!(max_seen > 65535, "several FPDUs offered at once");
        }
        // And the peer takes it all.
        assert_eq!(b2.receive(&gathered, || 100_000), gathered.len());
        let wcs = a2.send_wcs();
        assert_eq!(wcs.len(), 6);
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success));
        assert_eq!(
            wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
            vec![1, 2, 3, 4, 5, 6]
        );
        let r = b2.recv_wcs();
        assert_eq!(
            r.iter().map(|w| w.byte_len).collect::<Vec<_>>(),
            vec![100, 70_000, 65_536]
        );
        assert!(
            b2.events.is_empty(),
            "no error at the receiver: {:?}",
            b2.events
        );
        assert_eq!(b2.qp.stats().crc_errors, 0);
        // Every Write went to the sink from offset 0 (the 1 MiB one covers it all); the
        // last Send (64 KiB) is in the receive buffer.
        assert!(contents(&sink) == data, "sink bytes");
        assert!(
            contents(&rbuf)[..65_536] == data[..65_536],
            "received bytes"
        );
    }
}

#[test]
fn a_writer_that_claims_more_than_it_was_offered_stops_the_transmit_path() {
    let (mut a, _, _) = setup(stream_for(65535, true));
    let mut w = Prefixes {
        out: Vec::new(),
        rng: Rng::new(1),
        max_seen: 0,
        lie: true,
    };
    let mut budget = usize::MAX;
    let end = a.qp.send_to(&mut w, None, &mut budget);
    assert!(matches!(end, SendEnd::Bug("tx_commit refused")), "{end:?}");
    assert!(w.max_seen > 0);
}
