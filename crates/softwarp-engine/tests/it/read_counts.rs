//! How many reads a large Write costs the receiver, with the runtime's staging buffer
//! ([`STAGE_LEN`]) and a source that has the whole message queued (a ping-pong's receiver, once its
//! peer's `sendmsg` returned). Each read is a system call of about 0.8 us on the machine
//! this was measured on (BENCHMARKS.md, issue 18): the count is the load-independent
//! figure of the mid-size latency. Also: a read whose target is a buffer inside the QP (a
//! header, a trailer) fills one buffer only, the staging buffer (the runtime then uses
//! `recv` instead of the dearer two-buffer `readv`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::util::*;
use softwarp_engine::mr::Access;
use softwarp_engine::qp::StreamConfig;
use softwarp_engine::wr::{Payload, SendOp, SendWr, SgList, WcStatus};

/// Writes `len` bytes `count` times from `a` to `b`, each message received on its own
/// before the next is sent; returns the reads of each message and checks the bytes.
fn write_messages(len: usize, count: usize) -> Vec<Vec<QueuedRead>> {
    write_messages_from(len, count, None)
}

/// [`write_messages`] from a source `page_off` bytes into a page when given (a 64 KiB or
/// larger Write from a page-aligned source is led in with short FPDUs against 4 KiB
/// aliasing; `tx_alias.rs`).
fn write_messages_from(len: usize, count: usize, page_off: Option<u64>) -> Vec<Vec<QueuedRead>> {
    let stream = StreamConfig::for_mss(65535);
    let (mut a, mut b) = (Side::new(1, stream), Side::new(2, stream));
    let (src, sstag, siova, filled) = a.filled_region(len + 8192, Access::NONE, 3);
    let off = page_off.map_or(0, |o| (o + 4096 - src.addr() % 4096) % 4096) as usize;
    let data = filled[off..off + len].to_vec();
    let siova = siova + off as u64;
    let (sink, kstag, kiova) = b.region(len, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let mut per_message = Vec::new();
    for i in 0..count {
        let wr = SendWr {
            wr_id: i as u64,
            op: SendOp::Write {
                remote_addr: kiova,
                rkey: kstag,
            },
            payload: Payload::Sgl(SgList::single(sge(sstag, siova, 0, len as u32))),
            signaled: true,
            fence: false,
        };
        a.qp.post_send(&wr, &a.mrs).unwrap();
        let mut wire = Vec::new();
        a.transmit_with(&mut wire, true, || usize::MAX);
        per_message.push(b.receive_queued(&wire));
        let wcs = a.send_wcs();
        assert!(
            wcs.iter().all(|wc| wc.status == WcStatus::Success),
            "{wcs:?}"
        );
    }
    assert_eq!(contents(&sink), data);
    per_message
}

/// A 256 KiB Write on loopback is four full FPDUs (65,521 payload bytes each) and one of
/// 60 bytes. Once the receiver knows messages are large, it reads the first header (with
/// a little staging behind it), then each full payload straight into the sink with the
/// trailer, the next header and (since the staging behind a payload holds a short FPDU)
/// the whole last FPDU behind it: five reads. It was six, the last FPDU on its own.
#[test]
fn a_large_writes_short_last_fpdu_comes_with_the_payload_before_it() {
    let reads = write_messages(256 * 1024, 3);
    for (i, r) in reads.iter().enumerate().skip(1) {
        assert_eq!(r.len(), 5, "message {i}: {r:?}");
        assert_eq!(
            r.iter().filter(|r| r.region).count(),
            4,
            "message {i}: {r:?}"
        );
    }
}

/// A 64 KiB Write: one full FPDU and one of 15 bytes; two reads (the header, then the
/// payload with everything behind it). TCP's ping-pong reads it in one: the next FPDU's
/// destination is known only once its header is in, and no byte of a Write is placed
/// before that (Sends are read early: `early_sends.rs`).
#[test]
fn a_64_kib_write_costs_two_reads_the_header_and_the_payload() {
    let reads = write_messages(64 * 1024, 3);
    for (i, r) in reads.iter().enumerate().skip(1) {
        assert_eq!(r.len(), 2, "message {i}: {r:?}");
        assert!(r[1].region, "message {i}: {r:?}");
    }
}

/// A 64 KiB Write led in with short FPDUs (a page-aligned source): the receiver still
/// reads it in two (the short FPDUs and the full one's header into the staging buffer,
/// then the payload straight into the sink): the full FPDU that follows keeps the staging
/// hint set, so no payload is read ahead and copied.
#[test]
fn a_led_in_write_is_still_placed_without_a_copy() {
    let reads = write_messages_from(64 * 1024, 5, Some(0));
    for (i, r) in reads.iter().enumerate().skip(1) {
        assert!(
            r.iter().any(|r| r.region && r.dest > 60_000),
            "message {i}: {r:?}"
        );
        assert!(r.len() <= 2, "message {i}: {r:?}");
    }
}

/// A read that starts at a header (or any buffer inside the QP) fills only the staging
/// buffer: one buffer per read, which the runtime reads with `recv`.
#[test]
fn header_reads_fill_one_buffer() {
    for len in [4 * 1024, 64 * 1024, 256 * 1024] {
        for (i, reads) in write_messages(len, 3).iter().enumerate() {
            for r in reads.iter().filter(|r| !r.region) {
                assert_eq!(r.dest, 0, "{len} B, message {i}: {reads:?}");
                assert!(r.stage > 0, "{len} B, message {i}: {reads:?}");
            }
        }
    }
}
