//! Every iWARP operation between two endpoints over a real loopback TCP connection, with
//! payloads of 0 B, 1 B, 4095 B, 1 MiB and 16 MiB and SGLs of several elements: the bytes at
//! the destination and the completions (status, opcode, byte_len, invalidated STag).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::util::*;
use softwarp::*;

const LW: AccessFlags = AccessFlags::LOCAL_WRITE;

/// Send (optionally with SE and/or Invalidate) of every size, gathered from 3 SGEs into a
/// receive WR of 4 SGEs; checks bytes, both completions and the invalidation.
fn sends(solicited: bool, invalidate: bool, crc: bool) {
    let (a, b) = pair(&ConnectOptions::default().crc(crc));
    assert_eq!(a.info.as_ref().unwrap().crc, crc);
    for (i, &len) in SIZES.iter().enumerate() {
        let seed = 100 + i as u64;
        let (src, data) = a.mr(len + 64, AccessFlags::NONE, seed);
        let (dst, _) = b.mr(len + 128, LW, 0);
        dst.fill(0, len + 128, 0xee).unwrap();
        let inv_mr =
            b.pd.reg_mr(
                64,
                LW | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_INVALIDATE,
            )
            .unwrap();
        b.qp.post_recv(&RecvWr {
            wr_id: 1000 + i as u64,
            sgl: sgl(&dst, 16, len + 100, 4),
        })
        .unwrap();
        let inv = invalidate.then(|| inv_mr.rkey());
        a.qp.post_send(&send_wr(
            i as u64,
            send_op(solicited, inv),
            Payload::Sgl(sgl(&src, 7, len, 3)),
        ))
        .unwrap();
        let swc = wait_wcs(&a.scq, 1);
        assert_eq!(swc[0].wr_id, i as u64);
        assert_eq!(swc[0].status, WcStatus::Success, "{swc:?}");
        assert_eq!(swc[0].opcode, WcOpcode::Send);
        assert_eq!(swc[0].byte_len as usize, len);
        let rwc = wait_wcs(&b.rcq, 1);
        assert_eq!(rwc[0].wr_id, 1000 + i as u64);
        assert_eq!(rwc[0].status, WcStatus::Success, "{rwc:?}");
        assert_eq!(rwc[0].opcode, WcOpcode::Recv);
        assert_eq!(rwc[0].byte_len as usize, len);
        assert_eq!(rwc[0].qp_num, b.qp.qp_num());
        assert_eq!(rwc[0].solicited, solicited);
        assert_eq!(rwc[0].invalidated_stag, inv);
        assert_eq!(inv_mr.is_valid(), !invalidate);
        let got = dst.to_vec().unwrap();
        assert!(
            got[..16].iter().all(|&x| x == 0xee),
            "bytes before the SGL untouched"
        );
        assert!(
            got[16..16 + len] == data[7..7 + len],
            "payload of {len} bytes differs"
        );
        assert!(
            got[16 + len..].iter().all(|&x| x == 0xee),
            "bytes after the message untouched"
        );
    }
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(b.qp.state(), QpState::Rts);
    assert_eq!(a.dev.try_get_async_event(), None);
    assert_eq!(b.dev.try_get_async_event(), None);
}

#[test]
fn send_of_every_size_gathers_and_scatters_across_sges() {
    sends(false, false, true);
}

#[test]
fn send_with_solicited_event_sets_the_flag_in_the_receive_completion() {
    sends(true, false, true);
}

#[test]
fn send_with_invalidate_invalidates_the_peer_stag_and_reports_it() {
    sends(false, true, true);
}

#[test]
fn send_with_solicited_event_and_invalidate_does_both() {
    sends(true, true, true);
}

#[test]
fn send_without_crc_when_neither_side_asks_for_it() {
    sends(false, false, false);
}

#[test]
fn rdma_write_of_every_size_lands_at_the_remote_offset() {
    let (a, b) = pair(&ConnectOptions::default());
    for (i, &len) in SIZES.iter().enumerate() {
        let (src, data) = a.mr(len + 64, AccessFlags::NONE, 200 + i as u64);
        let (sink, _) = b.mr(len + 256, LW | AccessFlags::REMOTE_WRITE, 0);
        sink.fill(0, len + 256, 0x55).unwrap();
        let (note, _) = b.mr(16, LW, 0);
        b.qp.post_recv(&RecvWr {
            wr_id: 1,
            sgl: SgList::single(note.sge(0, 16).unwrap()),
        })
        .unwrap();
        a.qp.post_send(&send_wr(
            10 + i as u64,
            SendOp::Write {
                remote_addr: sink.addr() + 100,
                rkey: sink.rkey(),
            },
            Payload::Sgl(sgl(&src, 3, len, 5)),
        ))
        .unwrap();
        // A Send after the Write: when it arrives, the Write was placed (RDMAP ordering).
        a.qp.post_send(&send_wr(99, send_op(false, None), Payload::Inline(b"done")))
            .unwrap();
        let swc = wait_wcs(&a.scq, 2);
        assert_eq!(swc[0].wr_id, 10 + i as u64);
        assert_eq!(swc[0].status, WcStatus::Success);
        assert_eq!(swc[0].opcode, WcOpcode::RdmaWrite);
        assert_eq!(swc[0].byte_len as usize, len);
        assert_eq!(swc[1].wr_id, 99);
        let rwc = wait_wcs(&b.rcq, 1);
        assert_eq!(rwc[0].byte_len, 4);
        let got = sink.to_vec().unwrap();
        assert!(got[..100].iter().all(|&x| x == 0x55));
        assert!(
            got[100..100 + len] == data[3..3 + len],
            "write of {len} bytes differs"
        );
        assert!(got[100 + len..].iter().all(|&x| x == 0x55));
        assert_eq!(b.rcq.poll_one(), None, "an RDMA Write consumes no receive");
    }
}

#[test]
fn rdma_read_of_every_size_fetches_the_remote_bytes() {
    let (a, b) = pair(&ConnectOptions::default());
    for (i, &len) in SIZES.iter().enumerate() {
        let (src, data) = b.mr(len + 64, AccessFlags::REMOTE_READ, 300 + i as u64);
        let (sink, _) = a.mr(len + 64, LW, 0);
        sink.fill(0, len + 64, 0x77).unwrap();
        a.qp.post_send(&send_wr(
            20 + i as u64,
            SendOp::Read {
                remote_addr: src.addr() + 9,
                rkey: src.rkey(),
            },
            Payload::Sgl(if len == 0 {
                SgList::new()
            } else {
                SgList::single(sink.sge(32, len as u32).unwrap())
            }),
        ))
        .unwrap();
        let swc = wait_wcs(&a.scq, 1);
        assert_eq!(swc[0].wr_id, 20 + i as u64);
        assert_eq!(swc[0].status, WcStatus::Success, "{swc:?}");
        assert_eq!(swc[0].opcode, WcOpcode::RdmaRead);
        assert_eq!(swc[0].byte_len as usize, len);
        let got = sink.to_vec().unwrap();
        assert!(got[..32].iter().all(|&x| x == 0x77));
        assert!(
            got[32..32 + len] == data[9..9 + len],
            "read of {len} bytes differs"
        );
        assert!(got[32 + len..].iter().all(|&x| x == 0x77));
        assert_eq!(b.scq.poll_one(), None, "the responder completes nothing");
    }
}

#[test]
fn inline_send_and_unsignaled_writes_complete_as_asked() {
    let (a, b) = pair(&ConnectOptions::default());
    let (dst, _) = b.mr(4096, LW | AccessFlags::REMOTE_WRITE, 0);
    let (src, data) = a.mr(4096, AccessFlags::NONE, 7);
    b.qp.post_recv(&RecvWr {
        wr_id: 5,
        sgl: SgList::single(dst.sge(0, 256).unwrap()),
    })
    .unwrap();
    // Three unsignaled Writes, then a signalled inline Send: one send completion only.
    for k in 0..3u64 {
        let mut wr = send_wr(
            k,
            SendOp::Write {
                remote_addr: dst.addr() + 1024 + k * 1000,
                rkey: dst.rkey(),
            },
            Payload::Sgl(SgList::single(src.sge(k as usize * 1000, 1000).unwrap())),
        );
        wr.signaled = false;
        a.qp.post_send(&wr).unwrap();
    }
    let inline = pattern(MAX_INLINE, 9);
    a.qp.post_send(&send_wr(42, send_op(false, None), Payload::Inline(&inline)))
        .unwrap();
    let swc = wait_wcs(&a.scq, 1);
    assert_eq!(swc[0].wr_id, 42);
    assert_no_wc(&a.scq, std::time::Duration::from_millis(50));
    let rwc = wait_wcs(&b.rcq, 1);
    assert_eq!(rwc[0].byte_len as usize, MAX_INLINE);
    let got = dst.to_vec().unwrap();
    assert_eq!(&got[..MAX_INLINE], &inline[..]);
    assert_eq!(&got[1024..4024], &data[..3000]);
    // Too much inline data is refused at post time with a typed error.
    let big = vec![0u8; MAX_INLINE + 1];
    assert!(matches!(
        a.qp.post_send(&send_wr(1, send_op(false, None), Payload::Inline(&big))),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn both_directions_run_at_once_without_interference() {
    let (a, b) = pair(&ConnectOptions::default());
    let len = 4 << 20;
    let (a_src, a_data) = a.mr(len, AccessFlags::REMOTE_READ, 1);
    let (b_src, b_data) = b.mr(len, AccessFlags::REMOTE_READ, 2);
    let (a_sink, _) = a.mr(len, LW | AccessFlags::REMOTE_WRITE, 0);
    let (b_sink, _) = b.mr(len, LW | AccessFlags::REMOTE_WRITE, 0);
    std::thread::scope(|s| {
        s.spawn(|| {
            a.qp.post_send(&send_wr(
                1,
                SendOp::Write {
                    remote_addr: b_sink.addr(),
                    rkey: b_sink.rkey(),
                },
                Payload::Sgl(sgl(&a_src, 0, len, 4)),
            ))
            .unwrap();
            a.qp.post_send(&send_wr(
                2,
                SendOp::Read {
                    remote_addr: b_src.addr(),
                    rkey: b_src.rkey(),
                },
                Payload::Sgl(SgList::single(a_sink.sge(0, len as u32).unwrap())),
            ))
            .unwrap();
        });
        s.spawn(|| {
            b.qp.post_send(&send_wr(
                3,
                SendOp::Read {
                    remote_addr: a_src.addr(),
                    rkey: a_src.rkey(),
                },
                Payload::Sgl(SgList::single(b_sink.sge(0, len as u32).unwrap())),
            ))
            .unwrap();
        });
    });
    let aw = wait_wcs(&a.scq, 2);
    let bw = wait_wcs(&b.scq, 1);
    assert!(aw.iter().chain(&bw).all(|w| w.status == WcStatus::Success));
    assert!(a_sink.to_vec().unwrap() == b_data);
    // b's sink got a's Write and then its own Read of a's source: both carry a_data.
    assert!(b_sink.to_vec().unwrap() == a_data);
}

/// Send, Write and Read of 200 000 bytes under each stream option: CRC off, MPA revision 1,
/// RFC 6581 peer-to-peer mode (RTR before the first FPDU), siw-sized 1448-byte FPDUs, the
/// smallest FPDU the engine accepts, and siw's Terminate layout.
#[test]
fn every_stream_option_carries_send_write_and_read() {
    let variants = [
        ConnectOptions::default().crc(false),
        ConnectOptions::default().revision(MpaRevision::Rev1),
        ConnectOptions::default().peer_to_peer(true),
        ConnectOptions::default().max_fpdu_len(Some(1448)),
        ConnectOptions::default().max_fpdu_len(Some(128)).crc(false),
        ConnectOptions::default().terminate_layout(TerminateLayout::LinuxSiw),
        ConnectOptions::default().private_data(b"hello responder"),
    ];
    let len = 200_000;
    for (v, opts) in variants.iter().enumerate() {
        let (a, b) = pair(opts);
        let ai = a.info.clone().unwrap();
        let bi = b.info.clone().unwrap();
        assert_eq!(ai.crc, opts.crc);
        assert_eq!(ai.revision, opts.revision.value());
        assert_eq!(bi.revision, opts.revision.value());
        assert_eq!(bi.peer_private_data, opts.private_data);
        if opts.peer_to_peer {
            assert_eq!(ai.rtr, Some(RtrKind::Write), "siw's choice, and ours");
            assert_eq!(bi.rtr, Some(RtrKind::Write));
        }
        if let Some(f) = opts.max_fpdu_len {
            assert_eq!(ai.max_fpdu_len, f);
        }
        let (src, data) = a.mr(len, AccessFlags::REMOTE_READ, 40 + v as u64);
        let (dst, _) = b.mr(len, LW | AccessFlags::REMOTE_WRITE, 0);
        b.qp.post_recv(&RecvWr {
            wr_id: 1,
            sgl: sgl(&dst, 0, len, 2),
        })
        .unwrap();
        // a (the initiator) speaks first: RFC 5044 holds b's first FPDU until a's arrived
        // (or, with peer-to-peer mode, a's RTR).
        a.qp.post_send(&send_wr(
            1,
            SendOp::Write {
                remote_addr: dst.addr(),
                rkey: dst.rkey(),
            },
            Payload::Sgl(sgl(&src, 0, len, 3)),
        ))
        .unwrap();
        a.qp.post_send(&send_wr(
            2,
            send_op(false, None),
            Payload::Sgl(sgl(&src, 0, len, 4)),
        ))
        .unwrap();
        let wcs = wait_wcs(&a.scq, 2);
        assert!(
            wcs.iter().all(|w| w.status == WcStatus::Success),
            "variant {v}: {wcs:?}"
        );
        // The Send lands behind the Write, in the same buffer, with the same bytes.
        let rwc = wait_wcs(&b.rcq, 1);
        assert_eq!(rwc[0].byte_len as usize, len, "variant {v}");
        assert!(dst.to_vec().unwrap() == data, "variant {v}: Send bytes");
        dst.fill(0, len, 0).unwrap();
        // Then b reads a's memory.
        b.qp.post_send(&send_wr(
            5,
            SendOp::Read {
                remote_addr: src.addr(),
                rkey: src.rkey(),
            },
            Payload::Sgl(SgList::single(dst.sge(0, len as u32).unwrap())),
        ))
        .unwrap();
        let wc = wait_wcs(&b.scq, 1);
        assert_eq!(wc[0].status, WcStatus::Success, "variant {v}: {wc:?}");
        assert!(dst.to_vec().unwrap() == data, "variant {v}: Read bytes");
    }
}

/// Without a chosen FPDU length, a connection to this host itself sends MPA's largest FPDUs
/// (segments on loopback are never cut or placed by a NIC); the MSS is reported beside it.
#[test]
fn loopback_connections_send_the_largest_fpdus_by_default() {
    let (a, b) = pair(&ConnectOptions::default());
    for info in [a.info.clone().unwrap(), b.info.clone().unwrap()] {
        assert_eq!(
            info.max_fpdu_len,
            softwarp_wire::mpa::fpdu::MAX_FPDU_LEN,
            "{info:?}"
        );
        assert!(info.mss > 0 && info.mss < info.max_fpdu_len, "{info:?}");
    }
}
