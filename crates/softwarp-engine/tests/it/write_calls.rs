//! The shape of the sender's writes for mid-size messages: a lone FPDU of up to
//! `LONE_COPY_MAX` bytes (a ping-pong's 4 KiB message) goes out as one buffer (the runtime
//! then uses `send`, cheaper than a three-piece `sendmsg` at that size), while a queue of
//! them, and larger FPDUs, are still gathered from registered memory. The bytes that arrive
//! are the same either way.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use softwarp_engine::mr::Access;
use softwarp_engine::qp::{StreamConfig, LONE_COPY_MAX};
use softwarp_engine::wr::{Payload, SendOp, SendWr, SgList};
use softwarp_testkit::RecordingWriter;

use crate::util::*;

/// Posts `count` Writes of `len` bytes, then transmits as the runtime does (with a batch
/// buffer); returns the pieces of each write call, after checking what arrived.
fn write_calls(len: usize, count: usize) -> Vec<usize> {
    written(len, count).pieces_per_call()
}

/// [`write_calls`]' writer, with the bytes of each call too.
fn written(len: usize, count: usize) -> RecordingWriter<'static> {
    let stream = StreamConfig::for_mss(65535);
    let (mut a, mut b) = (Side::new(1, stream), Side::new(2, stream));
    let (_src, sstag, siova, data) = a.filled_region(len * count, Access::NONE, 9);
    let (sink, kstag, kiova) = b.region(len * count, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    for i in 0..count {
        let wr = SendWr {
            wr_id: i as u64,
            op: SendOp::Write {
                remote_addr: kiova + (i * len) as u64,
                rkey: kstag,
            },
            payload: Payload::Sgl(SgList::single(sge(
                sstag,
                siova,
                (i * len) as u64,
                len as u32,
            ))),
            signaled: true,
            fence: false,
        };
        a.qp.post_send(&wr, &a.mrs).unwrap();
    }
    let mut rec = RecordingWriter::new();
    a.send_all(&mut rec);
    assert_eq!(b.receive_with(&rec.out, true, || usize::MAX), rec.out.len());
    assert_eq!(contents(&sink), data, "{count} x {len} B");
    assert_eq!(a.send_wcs().len(), count);
    rec
}

#[test]
fn a_lone_4_kib_write_goes_out_as_one_buffer() {
    const { assert!(4096 + 20 <= LONE_COPY_MAX) };
    assert_eq!(write_calls(4096, 1), vec![1]);
}

#[test]
fn a_queue_of_4_kib_writes_and_a_lone_16_kib_one_are_gathered() {
    let calls = write_calls(4096, 4);
    assert!(calls.iter().any(|&pieces| pieces > 1), "{calls:?}");
    let calls = write_calls(16 * 1024, 1);
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert!(calls[0] > 1, "{calls:?}");
}

#[test]
fn a_1_mib_write_goes_out_in_two_halves_so_the_receiver_starts_early() {
    // On loopback a reader sees nothing of a `sendmsg` until it returns: two calls of about
    // 512 KiB let the peer read the first while the second is copied.
    let rec = written(1 << 20, 1);
    let bytes = rec.bytes_per_call();
    assert_eq!(bytes.len(), 2, "{bytes:?}");
    assert!(
        (512 << 10..(512 + 64) << 10).contains(&bytes[0]),
        "{bytes:?}"
    );
    assert_eq!(bytes.iter().sum::<usize>(), rec.out.len());
    // Up to 512 KiB, one call.
    assert_eq!(written(256 << 10, 1).calls.len(), 1);
}
