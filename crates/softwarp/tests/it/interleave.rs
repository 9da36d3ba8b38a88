//! Segments of different messages interleaved on one stream, as hardware RNICs send them
//! (issue 17): Chelsio RNICs interleave the segments of a long RDMA Read Response with Sends
//! and RDMA Writes, and Linux siw had to rework its receive path to accept that.
//!
//! A raw peer (`raw_peer/peer.rs`, real loopback TCP against the real runtime) answers the
//! stack's RDMA Read with a Read Response of three segments and, in the same stream, sends a
//! Send of two segments and an RDMA Write of two segments, in every one of the 210 orders
//! that keep each message's own segments in order (7! / (3! 2! 2!)), one round per order on
//! one connection, CRC on and off (every 21st round one byte per TCP write). Each round
//! checks that every byte landed where its segment said (and nowhere else: guard regions
//! around every target), that the Read and the receive each completed once with the right
//! length, and that the stack sent nothing but its Read Requests (no Terminate). An empty
//! Send after the three messages is each round's barrier: a Write completes nothing at its
//! target, so only a later message in the stream says that it was placed.
//!
//! RFC 5041 section 5 (paraphrase): each DDP segment is self-describing (tagged: STag and
//! TO; untagged: queue, MSN and MO), so a Data Sink places it without regard to segments of
//! other messages; RFC 5040 section 5.5 (paraphrase): messages are delivered in the order
//! their last segments complete on each queue.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use softwarp::*;
use softwarp_wire::rdmap::{Message, Placement, Segment};

use memory::Guarded;
use peer::{ulpdu, Offer, RawPeer, Role};

use crate::raw_peer::memory;
use crate::raw_peer::peer;
use crate::util::{pattern, wait_wcs, End, WAIT};

/// Payload bytes per segment of each message.
const RR_SEG: usize = 50;
const SEND_SEG: usize = 40;
const WRITE_SEG: usize = 30;
/// Segments per message.
const RR_SEGS: usize = 3;
const SEND_SEGS: usize = 2;
const WRITE_SEGS: usize = 2;
/// A round's Read, Send and Write lengths.
const READ_LEN: usize = RR_SEG * RR_SEGS;
const SEND_LEN: usize = SEND_SEG * SEND_SEGS;
const WRITE_LEN: usize = WRITE_SEG * WRITE_SEGS;
/// Each round writes into its own slice of the targets, so a byte placed in the wrong
/// round's slice is seen.
const RECV_SLOT: usize = 128;

/// Marks the `wr_id` of each round's barrier receive.
const BARRIER: u64 = 1 << 32;

/// The peer's "source" for the stack's Reads (the raw peer does not validate it).
const PEER_STAG: u32 = 0x00ab_cd00;
const PEER_TO: u64 = 0x4000_0000;

/// Which message a segment in an interleaving belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Msg {
    ReadResponse,
    Send,
    Write,
}

/// Every order of `RR_SEGS` Read Response, `SEND_SEGS` Send and `WRITE_SEGS` Write segments
/// (each message's segments stay in their own order: only the merge varies).
fn interleavings() -> Vec<Vec<Msg>> {
    fn go(left: [usize; 3], cur: &mut Vec<Msg>, out: &mut Vec<Vec<Msg>>) {
        if left == [0, 0, 0] {
            out.push(cur.clone());
            return;
        }
        for (i, m) in [Msg::ReadResponse, Msg::Send, Msg::Write]
            .into_iter()
            .enumerate()
        {
            if left[i] > 0 {
                let mut l = left;
                l[i] -= 1;
                cur.push(m);
                go(l, cur, out);
                cur.pop();
            }
        }
    }
    let mut out = Vec::new();
    go([RR_SEGS, SEND_SEGS, WRITE_SEGS], &mut Vec::new(), &mut out);
    out
}

#[test]
fn there_are_210_interleavings() {
    let all = interleavings();
    assert_eq!(all.len(), 210);
    let mut sorted = all.clone();
    sorted.sort_by_key(|o| format!("{o:?}"));
    sorted.dedup();
    assert_eq!(sorted.len(), 210, "every order once");
}

#[test]
fn interleaved_read_response_send_and_write_segments_crc_on() {
    interleaved(true);
}

#[test]
fn interleaved_read_response_send_and_write_segments_crc_off() {
    interleaved(false);
}

fn interleaved(crc: bool) {
    let orders = interleavings();
    let rounds = orders.len();
    let end = End::new(None, None);
    let lw = AccessFlags::LOCAL_WRITE;
    let sink = Guarded::new(&end.pd, READ_LEN * rounds, lw, 0x51);
    let rbuf = Guarded::new(&end.pd, RECV_SLOT * rounds, lw, 0x52);
    let target = Guarded::new(
        &end.pd,
        WRITE_LEN * rounds,
        lw | AccessFlags::REMOTE_WRITE,
        0x53,
    );
    let opts = ConnectOptions::default().crc_mode(if crc {
        CrcMode::Preferred
    } else {
        CrcMode::Off
    });
    let offer = Offer {
        crc,
        ..Offer::default()
    };
    let (mut peer, _info) = RawPeer::connect(Role::Initiator, &end.qp, &opts, offer);
    assert_eq!(peer.crc, crc);
    // The stack (the responder) sends the first Read Request: the peer speaks first.
    peer.speak_first();

    let mut expect_sink = sink.target_before().to_vec();
    let mut expect_rbuf = rbuf.target_before().to_vec();
    let mut expect_target = target.target_before().to_vec();
    for (round, order) in orders.iter().enumerate() {
        let r = round as u64;
        // The stack: one receive for the peer's Send, one Read of the peer's memory.
        let slot = round * RECV_SLOT;
        end.qp
            .post_recv(&RecvWr {
                wr_id: r,
                sgl: SgList::single(rbuf.target.sge(slot, RECV_SLOT as u32).unwrap()),
            })
            .unwrap();
        end.qp
            .post_recv(&RecvWr {
                wr_id: BARRIER | r,
                sgl: SgList::new(),
            })
            .unwrap();
        let sink_at = round * READ_LEN;
        end.qp
            .post_send(&SendWr {
                wr_id: r,
                op: SendOp::Read {
                    remote_addr: PEER_TO,
                    rkey: Stag(PEER_STAG),
                },
                payload: Payload::Sgl(SgList::single(
                    sink.target.sge(sink_at, READ_LEN as u32).unwrap(),
                )),
                signaled: true,
                fence: false,
            })
            .unwrap();

        // The peer: take the Read Request, then send the three messages interleaved.
        let req = peer.next_fpdu().expect("the stack's Read Request");
        let seg = Segment::parse(&req.ulpdu).unwrap();
        let Message::RdmaReadRequest(rr) = seg.message else {
            panic!("round {round}: expected a Read Request, got {seg:?}");
        };
        assert_eq!(rr.read_size as usize, READ_LEN);
        assert_eq!(
            (rr.source_stag, rr.source_tagged_offset),
            (PEER_STAG, PEER_TO)
        );

        let rr_data = pattern(READ_LEN, 0x1000 + r);
        let send_data = pattern(SEND_LEN, 0x2000 + r);
        let write_data = pattern(WRITE_LEN, 0x3000 + r);
        let write_at = round * WRITE_LEN;
        // Two Sends per round: the interleaved one, then an empty one after everything else
        // (MSNs from 1).
        let msn = u32::try_from(2 * round + 1).unwrap();
        let mut next = [0usize; 3];
        let mut stream = Vec::new();
        for m in order {
            let seg = match m {
                Msg::ReadResponse => {
                    let i = next[0];
                    next[0] += 1;
                    Segment {
                        last: i + 1 == RR_SEGS,
                        placement: Placement::Tagged {
                            stag: rr.sink_stag,
                            tagged_offset: rr.sink_tagged_offset + (i * RR_SEG) as u64,
                        },
                        message: Message::RdmaReadResponse,
                        payload: &rr_data[i * RR_SEG..(i + 1) * RR_SEG],
                    }
                }
                Msg::Send => {
                    let i = next[1];
                    next[1] += 1;
                    Segment {
                        last: i + 1 == SEND_SEGS,
                        placement: Placement::Untagged {
                            msn,
                            mo: (i * SEND_SEG) as u32,
                        },
                        message: Message::Send,
                        payload: &send_data[i * SEND_SEG..(i + 1) * SEND_SEG],
                    }
                }
                Msg::Write => {
                    let i = next[2];
                    next[2] += 1;
                    Segment {
                        last: i + 1 == WRITE_SEGS,
                        placement: Placement::Tagged {
                            stag: target.target.rkey().0,
                            tagged_offset: target.target.addr() + (write_at + i * WRITE_SEG) as u64,
                        },
                        message: Message::RdmaWrite,
                        payload: &write_data[i * WRITE_SEG..(i + 1) * WRITE_SEG],
                    }
                }
            };
            stream.extend_from_slice(&peer.frame(&ulpdu(&seg)));
        }
        // A Write completes nothing at its target, so when its segments come last the Read
        // and the receive may complete before it is placed. The empty Send behind all of
        // them is the barrier: the stack handles the stream in order, so once its receive
        // completes every segment before it was placed.
        let barrier = Segment {
            last: true,
            placement: Placement::Untagged {
                msn: msn + 1,
                mo: 0,
            },
            message: Message::Send,
            payload: &[],
        };
        stream.extend_from_slice(&peer.frame(&ulpdu(&barrier)));
        // Mostly one write, which TCP and the runtime split wherever they like; every 21st
        // round one byte per write, so the runtime also sees each FPDU cut at every byte.
        if round % 21 == 0 {
            for b in &stream {
                peer.send_bytes(std::slice::from_ref(b));
            }
        } else {
            peer.send_bytes(&stream);
        }

        let read = wait_wcs(&end.scq, 1);
        assert_eq!(read.len(), 1, "round {round} {order:?}: {read:?}");
        assert_eq!(
            (
                read[0].wr_id,
                read[0].status,
                read[0].opcode,
                read[0].byte_len
            ),
            (r, WcStatus::Success, WcOpcode::RdmaRead, READ_LEN as u32),
            "round {round} {order:?}"
        );
        let recv = wait_wcs(&end.rcq, 2);
        assert_eq!(recv.len(), 2, "round {round} {order:?}: {recv:?}");
        let got: Vec<_> = recv
            .iter()
            .map(|w| (w.wr_id, w.status, w.opcode, w.byte_len))
            .collect();
        assert_eq!(
            got,
            [
                (r, WcStatus::Success, WcOpcode::Recv, SEND_LEN as u32),
                (BARRIER | r, WcStatus::Success, WcOpcode::Recv, 0),
            ],
            "round {round} {order:?}"
        );
        assert_eq!(end.qp.state(), QpState::Rts, "round {round} {order:?}");

        expect_sink[sink_at..sink_at + READ_LEN].copy_from_slice(&rr_data);
        expect_rbuf[slot..slot + SEND_LEN].copy_from_slice(&send_data);
        expect_target[write_at..write_at + WRITE_LEN].copy_from_slice(&write_data);
        // Checked every round, so a misplaced byte names its order.
        sink.assert_changed_only(0..READ_LEN * rounds, &expect_sink);
        rbuf.assert_changed_only(0..RECV_SLOT * rounds, &expect_rbuf);
        target.assert_changed_only(0..WRITE_LEN * rounds, &expect_target);
    }

    // Nothing else completed, and the stack sent nothing but its Read Requests: a stray
    // Terminate or Read Request would be the next FPDU, a close would end the stream.
    let mut wc = [EMPTY_COMPLETION; 4];
    assert_eq!(end.scq.poll(&mut wc).unwrap(), 0);
    assert_eq!(end.rcq.poll(&mut wc).unwrap(), 0);
    assert_eq!(end.qp.state(), QpState::Rts);
    drop(peer);
    assert_eq!(end.qp.wait_closed(WAIT).unwrap(), QpState::Error);
}
