//! A Write changes exactly the bytes its FPDUs' headers name, even when one read takes
//! several FPDUs (the receiver's read-ahead: a payload read straight into its destination,
//! the trailer and the next header into the staging buffer behind it, whole FPDUs copied
//! out of it). Multi-FPDU Writes whose successor is not their continuation (so bytes placed
//! ahead of the next header would land in a guard gap), adjacent Writes, a Send in between,
//! every split: one byte per read, random pieces, random pieces with the runtime's 64 KiB
//! staging buffer (several FPDUs per read), CRC on and off. Every byte outside the written
//! ranges keeps its guard value.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::util::*;
use softwarp_engine::mr::Access;
use softwarp_engine::qp::StreamConfig;
use softwarp_engine::wr::{Payload, RecvWr, SendOp, SendWr, SgList, WcStatus};

const SINK: usize = 1 << 20;
const RBUF: usize = 4096;
const SEND_LEN: usize = 100;

/// (sink offset, length) of each Write, in posting order, for FPDUs of about `fpdu` bytes:
/// a Send goes between the second and the third.
fn writes(fpdu: usize) -> Vec<(usize, usize)> {
    let w1 = (1000, 3 * fpdu + 17);
    // Not the continuation of w1: a guard gap of 4096 bytes between them.
    let w2 = (w1.0 + w1.1 + 4096, 2 * fpdu + 1);
    // The continuation of w2 (adjacent ranges).
    let w3 = (w2.0 + w2.1, 2 * fpdu);
    // Before w1, one guard byte short of it.
    let w4 = (0, 999);
    // One byte, the sink's last.
    let w5 = (SINK - 1, 1);
    vec![w1, w2, w3, w4, w5]
}

fn run(mss: usize, crc: bool, split: Split) {
    let mut stream = StreamConfig::for_mss(mss);
    stream.crc = crc;
    let mut p = Pair::new(split, stream);
    let (_src, sstag, siova, data) = p.a.filled_region(SINK, Access::NONE, 7);
    let (sink, kstag, kiova, guard) =
        p.b.filled_region(SINK, Access::LOCAL_WRITE | Access::REMOTE_WRITE, 99);
    let (rbuf, rstag, riova, rguard) = p.b.filled_region(RBUF, Access::LOCAL_WRITE, 98);
    p.b.qp
        .post_recv(RecvWr {
            wr_id: 100,
            sgl: SgList::single(sge(rstag, riova, 0, RBUF as u32)),
        })
        .unwrap();
    let plan = writes(mss);
    let mut expect = guard.clone();
    for (i, &(off, len)) in plan.iter().enumerate() {
        if i == 2 {
            let wr = SendWr {
                wr_id: 50,
                op: SendOp::Send {
                    solicited: false,
                    invalidate: None,
                },
                payload: Payload::Sgl(SgList::single(sge(sstag, siova, 0, SEND_LEN as u32))),
                signaled: true,
                fence: false,
            };
            p.a.qp.post_send(&wr, &p.a.mrs).unwrap();
        }
        // Source bytes from the same offset as the destination: each range differs.
        let wr = SendWr {
            wr_id: i as u64,
            op: SendOp::Write {
                remote_addr: kiova + off as u64,
                rkey: kstag,
            },
            payload: Payload::Sgl(SgList::single(sge(sstag, siova, off as u64, len as u32))),
            signaled: true,
            fence: false,
        };
        p.a.qp.post_send(&wr, &p.a.mrs).unwrap();
        expect[off..off + len].copy_from_slice(&data[off..off + len]);
    }
    p.drive();
    let what = format!("mss {mss}, crc {crc}, {split:?}");
    let sent = p.a.send_wcs();
    assert_eq!(sent.len(), plan.len() + 1, "{what}: {sent:?}");
    assert!(
        sent.iter().all(|wc| wc.status == WcStatus::Success),
        "{what}"
    );
    let got = contents(&sink);
    let written = |i: usize| plan.iter().any(|&(o, l)| (o..o + l).contains(&i));
    // First any byte outside the written ranges (placed where no header named it), then
    // the ranges themselves.
    if let Some(at) = (0..SINK).find(|&i| got[i] != expect[i] && !written(i)) {
        panic!("{what}: sink byte {at}, outside every written range, changed");
    }
    if let Some(at) = (0..SINK).find(|&i| got[i] != expect[i]) {
        panic!("{what}: sink byte {at}, inside a written range, differs");
    }
    let wcs = p.b.recv_wcs();
    assert_eq!(wcs.len(), 1, "{what}: {wcs:?}");
    assert_eq!(wcs[0].byte_len, SEND_LEN as u32, "{what}");
    let mut rexpect = rguard;
    rexpect[..SEND_LEN].copy_from_slice(&data[..SEND_LEN]);
    assert_eq!(contents(&rbuf), rexpect, "{what}: receive buffer");
}

#[test]
fn writes_change_no_byte_outside_their_range_with_many_fpdus_per_read() {
    for crc in [true, false] {
        for (i, mss) in [1448usize, 9000, 65535].into_iter().enumerate() {
            let seed = 10 * i as u64 + u64::from(crc);
            // Several FPDUs per read, through the runtime-sized staging buffer (`STAGE_LEN`).
            run(mss, crc, Split::Staged { seed, max: 4 * mss });
            // Everything at once that a read takes.
            run(mss, crc, Split::Staged { seed, max: 1 << 22 });
            // Without staging: a read ends at its target.
            run(mss, crc, Split::Random { seed, max: 3 * mss });
        }
    }
}

#[test]
fn writes_change_no_byte_outside_their_range_one_byte_per_read() {
    for crc in [true, false] {
        // (FPDUs of an Ethernet MSS: the test writer copies each offered piece per byte.)
        run(1448, crc, Split::OneByte);
        run(1448, crc, Split::Staged { seed: 5, max: 1 });
    }
}
