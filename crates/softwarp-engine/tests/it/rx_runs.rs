//! Runs of FPDUs (`Qp::rx_run_fpdu`): the middle FPDUs of a message sent over a 1500-byte MTU
//! are received by comparing their headers with the one before, not by parsing them. Here:
//! that Sends, Writes and Read Responses take that path when the runtime reads ahead, and
//! land byte for byte. What a hostile or broken peer gets from it is in `negative.rs` (a
//! run stopped by deregistration, invalidation, a bound or a corrupted FPDU; FPDUs out of
//! order).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::util::*;
use softwarp_engine::mr::Access;
use softwarp_engine::qp::StreamConfig;
use softwarp_engine::wr::{Payload, RecvWr, SendOp, SendWr, SgList, WcStatus};

#[derive(Clone, Copy, Debug)]
enum Kind {
    Send,
    Write,
    Read,
}

/// Moves one `kind` message of `len` bytes from a to b (a Read: from b to a) over a
/// 1448-byte MSS in `split`; checks every byte of the destination and the completions;
/// returns the receiving side's run FPDUs and all its FPDUs.
fn transfer(kind: Kind, len: usize, crc: bool, split: Split) -> (u64, u64) {
    let mut stream = StreamConfig::for_mss(1448);
    stream.crc = crc;
    let mut p = Pair::new(split, stream);
    let (_src, sstag, siova, data) = p.a.filled_region(len, Access::REMOTE_READ, 11);
    // The destination is 16 bytes larger on each side: neither end may change.
    let (sink, kstag, kiova) =
        p.b.region(len + 32, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let sink_sge = sge(kstag, kiova, 16, len as u32);
    let src_sge = sge(sstag, siova, 0, len as u32);
    let op = match kind {
        Kind::Send => {
            p.b.qp
                .post_recv(RecvWr {
                    wr_id: 5,
                    sgl: SgList::single(sink_sge),
                })
                .unwrap();
            SendOp::Send {
                solicited: false,
                invalidate: None,
            }
        }
        Kind::Write => SendOp::Write {
            remote_addr: kiova + 16,
            rkey: kstag,
        },
        Kind::Read => SendOp::Read {
            remote_addr: siova,
            rkey: sstag,
        },
    };
    // A Read is posted by the side whose memory receives: b reads a's source.
    let (poster, sgl) = match kind {
        Kind::Read => (&mut p.b, SgList::single(sink_sge)),
        _ => (&mut p.a, SgList::single(src_sge)),
    };
    let wr = SendWr {
        wr_id: 9,
        op,
        payload: Payload::Sgl(sgl),
        signaled: true,
        fence: false,
    };
    poster.qp.post_send(&wr, &poster.mrs).unwrap();
    p.drive();
    let got = contents(&sink);
    assert!(
        got[..16].iter().all(|&b| b == 0),
        "{kind:?}: before the sink"
    );
    assert!(
        got[16 + len..].iter().all(|&b| b == 0),
        "{kind:?}: after it"
    );
    assert!(got[16..16 + len] == data[..], "{kind:?}: the payload");
    let poster = match kind {
        Kind::Read => &mut p.b,
        _ => &mut p.a,
    };
    let wcs = poster.send_wcs();
    assert_eq!(wcs.len(), 1, "{kind:?}");
    assert_eq!(wcs[0].status, WcStatus::Success, "{kind:?}");
    if let Kind::Send = kind {
        let wcs = p.b.recv_wcs();
        assert_eq!(wcs.len(), 1);
        assert_eq!(
            (wcs[0].status, wcs[0].byte_len),
            (WcStatus::Success, len as u32)
        );
    }
    let s = p.b.qp.stats();
    (s.rx_run_fpdus, s.rx_fpdus)
}

#[test]
fn the_middle_fpdus_of_a_message_are_taken_as_a_run() {
    for kind in [Kind::Send, Kind::Write, Kind::Read] {
        for crc in [false, true] {
            let (runs, fpdus) = transfer(
                kind,
                64 << 10,
                crc,
                Split::Staged {
                    seed: 3,
                    max: usize::MAX,
                },
            );
            // All but the first and the last FPDU of the message (for a Read, b posted it
            // and receives only the Read Responses).
            assert!(fpdus >= 46, "{kind:?}: {fpdus} FPDUs");
            assert_eq!(
                runs,
                fpdus - 2,
                "{kind:?} crc {crc}: {runs} of {fpdus} in runs"
            );
        }
    }
}

#[test]
fn runs_land_byte_for_byte_in_any_split() {
    // Pieces of every size: a run FPDU is taken only when it is whole in the staging
    // buffer; the others go through the general path, and the two alternate.
    for kind in [Kind::Send, Kind::Write, Kind::Read] {
        for seed in 1..=4 {
            for max in [700, 3000, 20_000] {
                transfer(
                    kind,
                    (64 << 10) + 333,
                    seed % 2 == 0,
                    Split::Staged { seed, max },
                );
            }
        }
        // Without a staging buffer nothing is whole: no runs.
        assert_eq!(
            transfer(kind, 64 << 10, false, Split::Random { seed: 9, max: 5000 }).0,
            0
        );
    }
}
