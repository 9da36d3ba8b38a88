//! `Qp::send_to` gathers several FPDUs per write: the stream is as long as the one written
//! whole (the bytes differ only by the random STag keys of each setup), whatever prefix of
//! each offer the writer takes, and the peer checks every CRC, places every byte and
//! completes everything.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use softwarp_engine::mr::Access;
use softwarp_engine::qp::{SendEnd, StreamConfig};
use softwarp_engine::wr::{Payload, RecvWr, SendOp, SendWr, SgList, WcStatus};
use softwarp_testkit::RecordingWriter;

use crate::util::*;

/// A writer that takes a random prefix of each offer (sometimes all of it).
fn prefixes(seed: u64) -> RecordingWriter<'static> {
    let mut rng = Rng::new(seed);
    RecordingWriter::taking(move |offered| {
        if rng.next_u64().is_multiple_of(3) {
            offered
        } else {
            1 + (rng.next_u64() as usize % offered)
        }
    })
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
        let mut w = prefixes(seed);
        let mut budget = usize::MAX;
        let end = a2.qp.send_to(&mut w, None, &mut budget);
        assert!(matches!(end, SendEnd::Idle), "{end:?}");
        let max_seen = w.max_offered();
        let gathered = w.out;
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
    let mut w = RecordingWriter::lying();
    let mut budget = usize::MAX;
    let end = a.qp.send_to(&mut w, None, &mut budget);
    assert!(matches!(end, SendEnd::Bug("tx_commit refused")), "{end:?}");
    assert!(w.max_offered() > 0);
}

/// A Read Response's source is memory the responder's application may write at any time.
/// The responder builds the first Response FPDUs (CRC computed) and the socket fills after
/// 100 bytes; then the application rewrites the whole source; then the rest goes out. The
/// requester must see an intact stream (every CRC right, the Read complete), whichever
/// version of each byte it got: before FPDUs built with their CRC were sent from a
/// snapshot, the bytes written after the store no longer matched their CRC and the
/// requester sent a Terminate (uDAPL's dtest, both of whose sides rewrite the buffer the
/// other one reads).
#[test]
fn a_read_response_stays_intact_when_its_source_changes_before_it_is_written() {
    for crc in [true, false] {
        let len = 200_000usize;
        let mut a = Side::new(1, stream_for(65535, crc));
        let mut b = Side::new(2, stream_for(65535, crc));
        let (sink, kstag, kiova) = a.region(len, Access::LOCAL_WRITE);
        let (src, sstag, siova, old) = b.filled_region(len, Access::REMOTE_READ, 11);
        a.qp.post_send(
            &signaled_wr(
                7,
                SendOp::Read {
                    remote_addr: siova,
                    rkey: sstag,
                },
                SgList::single(sge(kstag, kiova, 0, len as u32)),
            ),
            &a.mrs,
        )
        .unwrap();
        let mut request = Vec::new();
        a.transmit(&mut request, || usize::MAX);
        assert_eq!(b.receive(&request, || usize::MAX), request.len());

        let mut wire = Vec::new();
        assert_eq!(b.transmit_limited(&mut wire, 100), 100);
        let new = vec![0x5a_u8; len];
        src.write_at(0, &new).unwrap();
        b.transmit(&mut wire, || usize::MAX);

        assert_eq!(a.receive(&wire, || usize::MAX), wire.len());
        assert!(a.events.is_empty(), "crc {crc}: {:?}", a.events);
        assert_eq!(a.qp.stats().crc_errors, 0, "crc {crc}");
        let wcs = a.send_wcs();
        assert_eq!(wcs.len(), 1, "crc {crc}");
        assert_eq!(wcs[0].status, WcStatus::Success, "crc {crc}");
        assert_eq!(wcs[0].byte_len, len as u32, "crc {crc}");
        // Each byte is one version of the source.
        let got = contents(&sink);
        assert!(
            got.iter()
                .zip(old.iter())
                .all(|(g, o)| *g == *o || *g == 0x5a),
            "crc {crc}: a byte that was never in the source"
        );
    }
}
