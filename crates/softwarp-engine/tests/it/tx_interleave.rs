//! Interleaving on transmit: the send queue and the responses to the peer's Reads and
//! Atomics take turns of [`TX_INTERLEAVE_QUANTUM`] bytes when one side's message is tagged
//! and the other's untagged, so a small Send posted behind a long Read Response (or a
//! peer's Read behind a long Send) does not wait for the whole message. Two tagged or two
//! untagged messages are never interleaved: Linux siw's receive path keeps one context for
//! each kind and fails the stream with "packet intersection" otherwise. Every stream here
//! is decoded with the wire crate and checked against that rule, and the receiving engine
//! places every byte.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::util::*;
use softwarp_engine::mr::Access;
use softwarp_engine::qp::{StreamConfig, TX_INTERLEAVE_QUANTUM};
use softwarp_engine::wr::{RecvWr, SendOp, SgList, WcOpcode, WcStatus};
use softwarp_wire::mpa::Fpdu;
use softwarp_wire::rdmap::{Message, Placement, Segment};

/// MSS-sized FPDUs with CRCs, as to siw behind a 1500-byte MTU: many FPDUs per message.
fn stream() -> StreamConfig {
    StreamConfig {
        crc: true,
        ..StreamConfig::for_mss(1460)
    }
}

/// What one FPDU of a stream carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seg {
    /// Stream offset of the FPDU's first byte.
    at: usize,
    len: usize,
    kind: Kind,
    tagged: bool,
    last: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Write,
    ReadRequest,
    ReadResponse,
    Send,
    Immediate,
    AtomicRequest,
    AtomicResponse,
    Other,
}

/// Decodes a whole stream (CRCs checked) into its segments.
fn segments(wire: &[u8]) -> Vec<Seg> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < wire.len() {
        let (fpdu, n) = Fpdu::parse(&wire[at..], true)
            .unwrap_or_else(|e| panic!("FPDU at stream offset {at}: {e}"));
        let seg = Segment::parse(fpdu.ulpdu).unwrap_or_else(|e| panic!("segment at {at}: {e}"));
        let kind = match seg.message {
            Message::RdmaWrite => Kind::Write,
            Message::RdmaReadRequest(_) => Kind::ReadRequest,
            Message::RdmaReadResponse => Kind::ReadResponse,
            Message::Send | Message::SendWithSolicitedEvent => Kind::Send,
            Message::ImmediateData(_) | Message::ImmediateDataWithSolicitedEvent(_) => {
                Kind::Immediate
            }
            Message::AtomicRequest(_) => Kind::AtomicRequest,
            Message::AtomicResponse(_) => Kind::AtomicResponse,
            _ => Kind::Other,
        };
        out.push(Seg {
            at,
            len: n,
            kind,
            tagged: matches!(seg.placement, Placement::Tagged { .. }),
            last: seg.last,
        });
        at += n;
    }
    out
}

/// The rule of siw's receive path: a tagged message in progress may be interleaved with
/// untagged segments and the other way round, never with a segment of another message of
/// its own kind. Panics with the offending segment.
fn assert_siw_accepts(segs: &[Seg]) {
    let mut open: [Option<Kind>; 2] = [None, None];
    for s in segs {
        let slot = &mut open[usize::from(s.tagged)];
        if let Some(k) = *slot {
            assert_eq!(k, s.kind, "a {k:?} in progress intersected by {s:?}");
        }
        *slot = (!s.last).then_some(s.kind);
    }
}

/// Index of the first segment of `kind`.
fn first(segs: &[Seg], kind: Kind) -> usize {
    segs.iter()
        .position(|s| s.kind == kind)
        .unwrap_or_else(|| panic!("no {kind:?} in the stream"))
}

/// Index of the last segment of `kind`.
fn last(segs: &[Seg], kind: Kind) -> usize {
    segs.iter()
        .rposition(|s| s.kind == kind)
        .unwrap_or_else(|| panic!("no {kind:?} in the stream"))
}

/// A sends B a Read Request for `len` bytes of a fresh region of B's into a fresh region of
/// its own; B receives it. Returns (source contents, sink region).
fn read_request(
    a: &mut Side,
    b: &mut Side,
    len: usize,
    wr_id: u64,
) -> (Vec<u8>, std::sync::Arc<softwarp_engine::memory::Region>) {
    let (_, sstag, siova, data) = b.filled_region(len, Access::REMOTE_READ, wr_id + 7);
    let (sink, kstag, kiova) = a.region(len, Access::LOCAL_WRITE);
    let op = SendOp::Read {
        remote_addr: siova,
        rkey: sstag,
    };
    let wr = signaled_wr(wr_id, op, SgList::single(sge(kstag, kiova, 0, len as u32)));
    a.qp.post_send(&wr, &a.mrs).unwrap();
    let mut wire = Vec::new();
    a.transmit(&mut wire, || usize::MAX);
    b.receive(&wire, || usize::MAX);
    (data, sink)
}

/// Posts a receive of `len` bytes on `side`; returns its region.
fn post_receive(side: &mut Side, len: usize) -> std::sync::Arc<softwarp_engine::memory::Region> {
    let (r, stag, iova) = side.region(len, Access::LOCAL_WRITE);
    side.qp
        .post_recv(RecvWr {
            wr_id: 500,
            sgl: SgList::single(sge(stag, iova, 0, len as u32)),
        })
        .unwrap();
    r
}

/// Posts a Send of `len` pattern bytes on `side`; returns them.
fn post_send(side: &mut Side, len: usize, wr_id: u64) -> Vec<u8> {
    let (_, stag, iova, data) = side.filled_region(len, Access::NONE, wr_id + 11);
    let op = SendOp::Send {
        solicited: false,
        invalidate: None,
    };
    let wr = signaled_wr(wr_id, op, SgList::single(sge(stag, iova, 0, len as u32)));
    side.qp.post_send(&wr, &side.mrs).unwrap();
    data
}

/// The bytes a side may have built for the socket before a post changes its mind: the
/// gather path's FPDUs built ahead (at most 25 of them) and the FPDU in progress.
fn built_ahead_bound() -> usize {
    26 * 1460
}

/// A small Send posted while a 2 MiB Read Response is going out leaves within one turn of
/// the Read Response (plus what was already built), long before its end; both complete
/// with every byte in place. Through the gather path and the copy path, whole writes and
/// writes cut into odd pieces.
#[test]
fn a_small_send_posted_behind_a_long_read_response_leaves_within_one_turn() {
    let len = 2 << 20;
    for (copy, cut) in [(false, 0usize), (true, 0), (false, 3001), (true, 7919)] {
        let (mut a, mut b) = (Side::new(1, stream()), Side::new(2, stream()));
        let got = post_receive(&mut a, 64);
        let (data, sink) = read_request(&mut a, &mut b, len, 1);
        // The socket takes 100 KiB of the Read Response, then is full.
        let mut wire = Vec::new();
        let before = b.transmit_limited(&mut wire, 100 * 1024);
        assert_eq!(before, 100 * 1024);
        let small = post_send(&mut b, 64, 2);
        let mut n = 0usize;
        b.transmit_with(&mut wire, copy, || {
            n += 1;
            if cut == 0 {
                usize::MAX
            } else {
                cut + n % 13
            }
        });
        let segs = segments(&wire);
        assert_siw_accepts(&segs);
        let send = first(&segs, Kind::Send);
        let rresp_end = last(&segs, Kind::ReadResponse);
        let waited = segs[send].at - before;
        let bound = TX_INTERLEAVE_QUANTUM as usize + built_ahead_bound();
        assert!(
            waited <= bound,
            "copy {copy} cut {cut}: the Send left {waited} bytes after it was posted (bound {bound})"
        );
        assert!(send < rresp_end, "the Send waited for the Read Response");
        assert!(
            segs[rresp_end].at - segs[send].at > len / 2,
            "copy {copy} cut {cut}: most of the Read Response is behind the Send"
        );
        println!("copy {copy} cut {cut}: the Send left {waited} bytes after its post ({len} bytes of Read Response)");

        a.receive(&wire, || 65_536);
        assert_eq!(contents(&sink), data);
        assert_eq!(&contents(&got)[..], &small[..]);
        let recv = a.recv_wcs();
        assert_eq!(recv.len(), 1);
        assert_eq!(recv[0].status, WcStatus::Success);
        assert_eq!(recv[0].byte_len, 64);
        let sent = a.send_wcs();
        assert_eq!(sent.len(), 1);
        assert_eq!(
            (sent[0].opcode, sent[0].status),
            (WcOpcode::RdmaRead, WcStatus::Success)
        );
        let bsent = b.send_wcs();
        assert_eq!(bsent.len(), 1);
        assert_eq!(bsent[0].status, WcStatus::Success);
        assert!(
            b.events.is_empty() && a.events.is_empty(),
            "{:?} {:?}",
            a.events,
            b.events
        );
    }
}

/// The other way round: a peer's Read that arrives while a 2 MiB Send is going out is
/// answered within one turn of the Send, not after it.
#[test]
fn a_peers_read_arriving_during_a_long_send_is_answered_within_one_turn() {
    let len = 2 << 20;
    for copy in [false, true] {
        let (mut a, mut b) = (Side::new(1, stream()), Side::new(2, stream()));
        let got = post_receive(&mut a, len);
        let big = post_send(&mut b, len, 1);
        let mut wire = Vec::new();
        let before = b.transmit_limited(&mut wire, 100 * 1024);
        let (data, sink) = read_request(&mut a, &mut b, 4096, 2);
        b.transmit_with(&mut wire, copy, || usize::MAX);
        let segs = segments(&wire);
        assert_siw_accepts(&segs);
        let rresp = first(&segs, Kind::ReadResponse);
        let waited = segs[rresp].at - before;
        let bound = TX_INTERLEAVE_QUANTUM as usize + built_ahead_bound();
        assert!(waited <= bound, "copy {copy}: {waited} > {bound}");
        assert!(last(&segs, Kind::ReadResponse) < last(&segs, Kind::Send));

        a.receive(&wire, || usize::MAX);
        assert_eq!(contents(&sink), data);
        assert_eq!(contents(&got), big);
        assert_eq!(a.recv_wcs().len(), 1);
        let sent = a.send_wcs();
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].status, WcStatus::Success);
        assert_eq!(b.send_wcs().len(), 1);
    }
}

/// Two long messages, a Read Response and a Send, both in progress: they alternate in
/// turns of about one quantum each (never more than a quantum and one FPDU of one side
/// while the other waits), and both arrive whole.
#[test]
fn a_long_read_response_and_a_long_send_take_turns() {
    let len = 1 << 20;
    for copy in [false, true] {
        let (mut a, mut b) = (Side::new(1, stream()), Side::new(2, stream()));
        let got = post_receive(&mut a, len);
        let (data, sink) = read_request(&mut a, &mut b, len, 1);
        let mut wire = Vec::new();
        let before = b.transmit_limited(&mut wire, 4096);
        let big = post_send(&mut b, len, 2);
        b.transmit_with(&mut wire, copy, || usize::MAX);
        let segs = segments(&wire);
        assert_siw_accepts(&segs);
        // Runs of one kind while the other is still to finish (after what was built).
        let both_until = last(&segs, Kind::ReadResponse).min(last(&segs, Kind::Send));
        let mut runs = Vec::new();
        let mut i = segs
            .iter()
            .position(|s| s.at >= before + built_ahead_bound())
            .unwrap();
        while i < both_until {
            let kind = segs[i].kind;
            let start = segs[i].at;
            while i < both_until && segs[i].kind == kind {
                i += 1;
            }
            runs.push((kind, segs[i].at - start));
        }
        assert!(runs.len() >= 20, "copy {copy}: {runs:?}");
        let max = TX_INTERLEAVE_QUANTUM as usize + 1500;
        assert!(
            runs[..runs.len() - 1].iter().all(|&(_, n)| n <= max),
            "copy {copy}: {runs:?}"
        );
        a.receive(&wire, || usize::MAX);
        assert_eq!(contents(&sink), data);
        assert_eq!(contents(&got), big);
        assert_eq!(a.recv_wcs().len(), 1);
        assert_eq!(a.send_wcs().len(), 1);
        assert_eq!(b.send_wcs().len(), 1);
    }
}

/// Never two tagged or two untagged messages at once: a Read Response waits for the
/// Write in progress, an Atomic Response for the Send in progress (siw would fail either
/// stream). Both still complete.
#[test]
fn messages_of_one_kind_are_never_interleaved() {
    let len = 1 << 20;
    // A Write in progress, then the peer's Read.
    let (mut a, mut b) = (Side::new(1, stream()), Side::new(2, stream()));
    let (wsink, wstag, wiova) = a.region(len, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let (_, sstag, siova, wdata) = b.filled_region(len, Access::NONE, 3);
    let op = SendOp::Write {
        remote_addr: wiova,
        rkey: wstag,
    };
    let wr = signaled_wr(1, op, SgList::single(sge(sstag, siova, 0, len as u32)));
    b.qp.post_send(&wr, &b.mrs).unwrap();
    let mut wire = Vec::new();
    b.transmit_limited(&mut wire, 100 * 1024);
    let (data, sink) = read_request(&mut a, &mut b, 4096, 2);
    b.transmit_with(&mut wire, true, || usize::MAX);
    let segs = segments(&wire);
    assert_siw_accepts(&segs);
    assert!(first(&segs, Kind::ReadResponse) > last(&segs, Kind::Write));
    a.receive(&wire, || usize::MAX);
    assert_eq!(contents(&wsink), wdata);
    assert_eq!(contents(&sink), data);
    assert_eq!(a.send_wcs().len(), 1);

    // A Send in progress, then the peer's Fetch and Add.
    let (mut a, mut b) = (Side::new(1, stream()), Side::new(2, stream()));
    let got = post_receive(&mut a, len);
    let big = post_send(&mut b, len, 1);
    let mut wire = Vec::new();
    b.transmit_limited(&mut wire, 100 * 1024);
    let (target, tstag, tiova) = b.region(8, Access::REMOTE_ATOMIC | Access::LOCAL_WRITE);
    target.write_at(0, &40u64.to_le_bytes()).unwrap();
    let (result, rstag, riova) = a.region(8, Access::LOCAL_WRITE);
    let op = SendOp::FetchAdd {
        remote_addr: tiova,
        rkey: tstag,
        add: 2,
    };
    a.qp.post_send(
        &signaled_wr(9, op, SgList::single(sge(rstag, riova, 0, 8))),
        &a.mrs,
    )
    .unwrap();
    let mut req = Vec::new();
    a.transmit(&mut req, || usize::MAX);
    b.receive(&req, || usize::MAX);
    b.transmit_with(&mut wire, true, || usize::MAX);
    let segs = segments(&wire);
    assert_siw_accepts(&segs);
    assert!(first(&segs, Kind::AtomicResponse) > last(&segs, Kind::Send));
    a.receive(&wire, || usize::MAX);
    assert_eq!(contents(&got), big);
    assert_eq!(contents(&result), 40u64.to_le_bytes());
    let wcs = a.send_wcs();
    assert_eq!(wcs.len(), 1);
    assert_eq!(wcs[0].status, WcStatus::Success);
}

/// The checker itself: a Read Response inside a Write is refused, a Send inside one is not.
#[test]
fn the_siw_rule_checker_refuses_an_intersection() {
    let seg = |kind, tagged, last| Seg {
        at: 0,
        len: 0,
        kind,
        tagged,
        last,
    };
    assert_siw_accepts(&[
        seg(Kind::Write, true, false),
        seg(Kind::Send, false, true),
        seg(Kind::Write, true, true),
    ]);
    let bad = std::panic::catch_unwind(|| {
        assert_siw_accepts(&[
            seg(Kind::Write, true, false),
            seg(Kind::ReadResponse, true, true),
        ])
    });
    assert!(bad.is_err());
}
