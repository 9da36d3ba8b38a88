//! Application-owned buffers registered by value (`softwarp::owned`): a message built in
//! place and sent from a range, views refused while work requests use the buffer, the
//! buffer given back only after its release, and every kind of buffer and rights.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use softwarp::*;

use crate::util;
use crate::util::{pair, pattern, send_op, send_wr, wait_wcs, End, WAIT};

fn send_from(qp: &QueuePair, wr_id: u64, sge: Sge) {
    qp.post_send(&send_wr(
        wr_id,
        send_op(false, None),
        Payload::Sgl(SgList::single(sge)),
    ))
    .unwrap();
}

#[test]
fn a_message_built_in_place_is_sent_from_a_range_and_the_vec_comes_back() {
    let (a, b) = pair(&ConnectOptions::default());
    let recv =
        b.pd.reg_owned_writable(vec![0u8; 100].into_boxed_slice(), AccessFlags::LOCAL_WRITE)
            .unwrap();
    b.qp.post_recv(&RecvWr {
        wr_id: 1,
        sgl: SgList::single(recv.sge(0, 100).unwrap()),
    })
    .unwrap();

    let v = vec![0u8; 4096];
    let heap = v.as_ptr() as u64;
    let mut mr = a.pd.reg_owned(v).unwrap();
    assert_eq!(mr.addr(), heap, "registered where it is: no copy");
    {
        let mut buf = mr.edit().unwrap();
        buf[10..15].copy_from_slice(b"hello");
        buf[15..21].copy_from_slice(b" world");
    }
    assert_eq!(&mr.as_slice()[10..21], b"hello world");
    send_from(&a.qp, 2, mr.sge(10, 11).unwrap());
    let wc = wait_wcs(&a.scq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success));
    let wc = wait_wcs(&b.rcq, 1)[0];
    assert_eq!((wc.wr_id, wc.byte_len), (1, 11));

    let back = mr.into_inner(WAIT).unwrap();
    assert_eq!(back.as_ptr() as u64, heap, "the same allocation comes back");
    assert_eq!(back.len(), 4096);
    assert_eq!(&back[10..21], b"hello world");
    let got = recv.into_inner(WAIT).unwrap();
    assert_eq!(&got[..11], b"hello world");
    assert_eq!(got.len(), 100);
}

/// A pair whose receiving side (`b`) moves bytes only when its receive CQ is polled
/// (busy-poll mode): a large Send from `a` stays in flight until then.
fn stalled_pair() -> (End, End) {
    let mut a = End::new(None, None);
    let mut b = End::new(None, None);
    b.rcq.set_busy_poll(true);
    util::connect(&mut a, &mut b, &ConnectOptions::default());
    (a, b)
}

/// Polls `b`'s receive CQ (which moves its bytes) until one completion arrives.
fn drive_until_received(b: &End) -> WorkCompletion {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(wc) = b.rcq.poll_one() {
            return wc;
        }
        assert!(Instant::now() < deadline, "nothing received");
        std::thread::yield_now();
    }
}

/// Larger than loopback TCP buffers at both ends (4 MiB + 6 MiB at most by default).
const BIG: usize = 32 << 20;

#[test]
fn no_view_and_no_buffer_while_a_posted_send_reads_it() {
    let (a, b) = stalled_pair();
    let sink =
        b.pd.reg_owned_writable(vec![0u8; BIG], AccessFlags::LOCAL_WRITE)
            .unwrap();
    for wr_id in [1, 2] {
        b.qp.post_recv(&RecvWr {
            wr_id,
            sgl: SgList::single(sink.sge(0, BIG as u32).unwrap()),
        })
        .unwrap();
    }
    let data = pattern(BIG, 5);
    let mut mr = a.pd.reg_owned(data.clone()).unwrap();
    send_from(&a.qp, 10, mr.sge(0, BIG as u32).unwrap());

    // The Send is in flight (the peer does not read): no `&mut` view.
    match mr.edit() {
        Err(Error::InUse { users }) => assert!(users >= 1),
        other => panic!(
            "edit while a Send reads the buffer: {:?}",
            other.map(|_| ())
        ),
    }
    // Shared views are fine: the Send only reads.
    assert_eq!(mr.as_slice()[..64], data[..64]);

    let wc = drive_until_received(&b);
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success));
    assert_eq!(wait_wcs(&a.scq, 1)[0].wr_id, 10);
    // Completed: the view is given, and the registration works again under a new STag.
    let old = mr.stag();
    mr.edit().unwrap()[0] ^= 0xff;
    assert_ne!(mr.stag(), old, "a new STag after an edit");

    // Deregistered while a Send reads it: the buffer comes back only after the release.
    send_from(&a.qp, 11, mr.sge(0, BIG as u32).unwrap());
    let release = mr.deregister();
    assert!(release.users() >= 1);
    let release = release
        .try_into_inner()
        .expect_err("not given back while in use");
    assert!(matches!(
        release.wait(Duration::from_millis(20)),
        Err(Error::Timeout(_))
    ));
    let wc = drive_until_received(&b);
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success));
    assert_eq!(wait_wcs(&a.scq, 1)[0].wr_id, 11);
    release.wait(WAIT).unwrap();
    let back = release.try_into_inner().expect("released");
    assert_eq!(back[0], data[0] ^ 0xff);
    assert_eq!(back[1..], data[1..]);
    let got = sink.into_inner(WAIT).unwrap();
    assert_eq!(got[0], data[0] ^ 0xff, "the second Send carried the edit");
    assert_eq!(got[1..], data[1..]);
}

#[test]
fn while_edited_the_stag_validates_for_nothing() {
    let (a, _b) = pair(&ConnectOptions::default());
    let mut mr = a.pd.reg_owned(vec![1u8; 64]).unwrap();
    let before = mr.sge(0, 64).unwrap();
    let guard = mr.edit().unwrap();
    // A work request naming the registration while a `&mut` view exists is refused.
    send_from(&a.qp, 3, before);
    let wc = wait_wcs(&a.scq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (3, WcStatus::LocProtErr));
    drop(guard);
    assert_ne!(mr.stag(), before.lkey);
    assert_eq!(mr.into_inner(WAIT).unwrap(), vec![1u8; 64]);
}

#[test]
fn bytes_mut_remote_read_and_remote_write_registrations() {
    let (a, b) = pair(&ConnectOptions::default());
    let src = pattern(8192, 9);
    // b lends a BytesMut for the peer to read, and a Vec for it to write.
    let lent = bytes::BytesMut::from(&src[..]);
    let heap = lent.as_ptr() as u64;
    let readable = b.pd.reg_owned_remote_read(lent).unwrap();
    assert_eq!(readable.addr(), heap, "registered where it is: no copy");
    let writable =
        b.pd.reg_owned_writable(
            vec![0u8; 8192],
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    assert_eq!(readable.as_slice(), &src[..]);

    // a reads b's bytes into a writable Box, then writes them back into b's Vec.
    let sink =
        a.pd.reg_owned_writable(vec![0u8; 8192].into_boxed_slice(), AccessFlags::LOCAL_WRITE)
            .unwrap();
    a.qp.post_send(&send_wr(
        1,
        SendOp::Read {
            remote_addr: readable.addr(),
            rkey: readable.rkey(),
        },
        Payload::Sgl(SgList::single(sink.sge(0, 8192).unwrap())),
    ))
    .unwrap();
    assert_eq!(wait_wcs(&a.scq, 1)[0].status, WcStatus::Success);
    assert_eq!(sink.to_vec().unwrap(), src);
    a.qp.post_send(&send_wr(
        2,
        SendOp::Write {
            remote_addr: writable.addr() + 100,
            rkey: writable.rkey(),
        },
        Payload::Sgl(SgList::single(sink.sge(0, 4000).unwrap())),
    ))
    .unwrap();
    assert_eq!(wait_wcs(&a.scq, 1)[0].status, WcStatus::Success);
    // Placement may trail the Write's local completion: look by copies until it is there.
    let deadline = Instant::now() + WAIT;
    let mut seen = [0u8; 4000];
    loop {
        writable.read_at(100, &mut seen).unwrap();
        if seen[..] == src[..4000] {
            break;
        }
        assert!(Instant::now() < deadline, "the Write was not placed");
        std::thread::sleep(Duration::from_millis(1));
    }

    let back: bytes::BytesMut = readable.into_inner(WAIT).unwrap();
    assert_eq!(&back[..], &src[..]);
    assert_eq!(back.as_ptr() as u64, heap, "the same allocation comes back");
    let written = writable.into_inner(WAIT).unwrap();
    assert_eq!(&written[100..4100], &src[..4000]);
    assert!(written[..100].iter().all(|&x| x == 0));
    assert_eq!(&sink.into_inner(WAIT).unwrap()[..], &src[..]);
}

#[test]
fn a_dropped_registration_frees_its_buffer_and_its_stag() {
    let dev = Device::open_default().unwrap();
    let pd = dev.alloc_pd().unwrap();
    let mr = pd.reg_owned(vec![7u8; 128]).unwrap();
    let stag = mr.stag();
    drop(mr);
    // The STag names nothing any more; an empty buffer registers too.
    let again = pd.reg_owned(Vec::new()).unwrap();
    assert!(again.is_empty());
    assert_ne!(again.stag(), stag);
    assert!(again.into_inner(WAIT).unwrap().is_empty());
}
