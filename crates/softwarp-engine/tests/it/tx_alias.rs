//! The 4 KiB aliasing lead-in (`Qp::set_tx_alias_lead`): a message of 64 KiB or more whose payload,
//! copied by the kernel into a page fragment that starts at offset 0, would land a few
//! bytes ahead of its source modulo 4 KiB starts with short FPDUs, so that the big copy
//! runs with the destination at distance 0 or at least 96 bytes from the source. What the
//! kernel sees is checked here: the stream position of each piece the engine hands the
//! writer against the address it comes from. The message arrives intact either way.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use softwarp_engine::mr::Access;
use softwarp_engine::qp::StreamConfig;
use softwarp_engine::wr::{Payload, RecvWr, SendOp, SendWr, SgList};
use softwarp_testkit::{RecordingWriter, WrittenPiece};

use crate::util::*;

/// The distances (destination minus source, modulo 4 KiB) at which the test machine's
/// kernel copy ran at half speed: 1 to 63 bytes.
const WINDOW: u64 = 64;

#[derive(Clone, Copy, Debug)]
enum Kind {
    Send,
    Write,
}

/// Sends one `kind` message of `len` bytes whose source starts `page_off` bytes into a page
/// over `stream`, with the lead-in on or off, through the runtime's batch; checks that it
/// arrives intact (a Send: completes with its length) and returns what the writer got, the
/// FPDUs sent and the source region's address range.
fn transfer(
    kind: Kind,
    len: usize,
    page_off: u64,
    stream: StreamConfig,
    lead: bool,
) -> (RecordingWriter<'static>, u64, std::ops::Range<u64>) {
    let (mut a, mut b) = (Side::new(1, stream), Side::new(2, stream));
    a.qp.set_tx_alias_lead(lead);
    let (src, sstag, siova, data) = a.filled_region(len + 8192, Access::NONE, 5);
    // The offset inside the region whose address is `page_off` into a page.
    let off = (page_off + 4096 - src.addr() % 4096) % 4096;
    let (sink, kstag, kiova) = b.region(len, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let op = match kind {
        Kind::Send => {
            b.qp.post_recv(RecvWr {
                wr_id: 7,
                sgl: SgList::single(sge(kstag, kiova, 0, len as u32)),
            })
            .unwrap();
            SendOp::Send {
                solicited: false,
                invalidate: None,
            }
        }
        Kind::Write => SendOp::Write {
            remote_addr: kiova,
            rkey: kstag,
        },
    };
    let wr = SendWr {
        wr_id: 1,
        op,
        payload: Payload::Sgl(SgList::single(sge(sstag, siova, off, len as u32))),
        signaled: true,
        fence: false,
    };
    a.qp.post_send(&wr, &a.mrs).unwrap();
    let mut rec = RecordingWriter::new();
    a.send_all(&mut rec);
    assert_eq!(b.receive_with(&rec.out, true, || usize::MAX), rec.out.len());
    let off = off as usize;
    assert!(
        contents(&sink) == data[off..off + len],
        "{kind:?} of {len} B from page offset {page_off}: the bytes differ"
    );
    assert_eq!(a.send_wcs().len(), 1);
    if let Kind::Send = kind {
        let wcs = b.recv_wcs();
        assert_eq!((wcs.len(), wcs[0].byte_len), (1, len as u32));
    }
    let range = src.addr()..src.addr() + src.len() as u64;
    (rec, a.qp.stats().tx_fpdus, range)
}

/// [`transfer`] over loopback's 65,535-byte FPDUs; returns (the distance of the first full
/// FPDU's payload from its source modulo 4 KiB, the FPDUs sent, the distances of every full
/// FPDU's payload).
fn send_one(kind: Kind, len: usize, page_off: u64, lead: bool) -> (u64, u64, Vec<u64>) {
    let (rec, fpdus, _) = transfer(kind, len, page_off, StreamConfig::for_mss(65535), lead);
    // The leading FPDUs go out in the same write as the full FPDUs after them (one
    // `sendmsg`; a 1 MiB message takes two of about 512 KiB), not in a copied batch of
    // their own.
    let calls = if len > 512 << 10 { 2 } else { 1 };
    assert_eq!(
        rec.calls.len(),
        calls,
        "{kind:?} from page offset {page_off}"
    );
    // The first large piece (a full FPDU's payload), and every large piece's distance.
    let distance = |p: &WrittenPiece| p.at.wrapping_sub(p.addr) % 4096;
    let large: Vec<u64> = rec
        .written()
        .filter(|p| p.len >= 4096)
        .map(distance)
        .collect();
    (large[0], fpdus, large)
}

#[test]
fn a_large_message_from_any_page_offset_is_copied_clear_of_the_aliasing_window() {
    for kind in [Kind::Send, Kind::Write] {
        for page_off in (0..4096).step_by(4).chain([1, 2, 3, 4093, 4094, 4095]) {
            for len in [64 << 10, 128 << 10] {
                let (_, _, distances) = send_one(kind, len, page_off, true);
                assert!(
                    distances.iter().all(|&d| d == 0 || d >= WINDOW),
                    "{kind:?} of {len} B from page offset {page_off}: distances {distances:?}"
                );
            }
        }
    }
}

#[test]
fn a_1_mib_message_is_led_in_where_it_helps_and_never_made_worse() {
    // Each FPDU boundary moves the distance by about 24 bytes: the 16 full FPDUs of 1 MiB
    // span about 400, and from some starts they wrap around into the window after a few
    // FPDUs, which a handful of short FPDUs cannot prevent (it would take about 20).
    let hits = |d: &[u64]| d.iter().filter(|&&d| d != 0 && d < WINDOW).count();
    for kind in [Kind::Send, Kind::Write] {
        for page_off in (0..4096).step_by(28).chain(1..=20) {
            let (_, _, with) = send_one(kind, 1 << 20, page_off, true);
            let (_, _, without) = send_one(kind, 1 << 20, page_off, false);
            assert!(
                hits(&with) <= hits(&without),
                "{kind:?} from page offset {page_off}: {with:?} against {without:?}"
            );
            if page_off <= 20 {
                // Page-aligned and nearby buffers, the common case: all clear.
                assert_eq!(
                    hits(&with),
                    0,
                    "{kind:?} from page offset {page_off}: {with:?}"
                );
            }
        }
    }
}

#[test]
fn without_the_lead_in_a_page_aligned_source_lands_inside_the_window() {
    // The condition the lead-in is for: MPA length and header (20 B before a Send's
    // payload, 16 B before a Write's) put the destination just ahead of a page-aligned
    // source.
    // 128 KiB: three FPDUs of up to 65,517 (Send) or 65,521 (Write) payload bytes.
    let head = |(first, fpdus, _)| (first, fpdus);
    assert_eq!(head(send_one(Kind::Send, 128 << 10, 0, false)), (20, 3));
    assert_eq!(head(send_one(Kind::Write, 128 << 10, 0, false)), (16, 3));
    // With it, short FPDUs lead: two for the Send and three for the Write, 1-byte ones
    // (3 pad bytes each) but for the last, which carries what would have been the
    // message's short last FPDU (56 bytes after two full FPDUs of 65,508 for the Send, 48
    // after two of 65,512 for the Write). The Send's distance is 20 + 27 + 25 (56 bytes,
    // 1 of pad), the Write's 16 + 2 x 23 + 22 (48 bytes, 2 of pad); one FPDU more than
    // without, not two or three.
    assert_eq!(head(send_one(Kind::Send, 128 << 10, 0, true)), (72, 4));
    assert_eq!(head(send_one(Kind::Write, 128 << 10, 0, true)), (84, 5));
    // A tail too long to fold (128 KiB + 4000 bytes: 4,056 after the full FPDUs): 1-byte
    // leading FPDUs only, and the tail in an FPDU of its own (three without the lead-in).
    assert_eq!(
        head(send_one(Kind::Send, (128 << 10) + 4000, 0, true)),
        (74, 5)
    );
}

#[test]
fn the_leading_fpdus_carry_a_short_tail_where_their_pads_keep_the_distance_clear() {
    // Every tail from 0 to 600 bytes after two full FPDUs, from page offsets around the
    // window: the message arrives intact (checked by `send_one`), its full FPDUs stay
    // clear, and it takes at most as many FPDUs as with 1-byte leads and a tail FPDU.
    for kind in [Kind::Send, Kind::Write] {
        let max = match kind {
            Kind::Send => 65_508,
            Kind::Write => 65_512,
        };
        for tail in (0..600).step_by(7).chain([1, 2, 3, 4, 5, 511, 512, 513]) {
            for page_off in [0, 4, 8, 20, 40, 60, 4090] {
                let len = 2 * max + tail;
                let (_, fpdus, distances) = send_one(kind, len, page_off, true);
                assert!(
                    distances.iter().all(|&d| d == 0 || d >= WINDOW),
                    "{kind:?} of {len} B from page offset {page_off}: {distances:?}"
                );
                let (_, plain, _) = send_one(kind, len, page_off, false);
                // At most four leading FPDUs move any distance out of the window.
                assert!(
                    fpdus - plain <= 4,
                    "{kind:?} of {len} B from page offset {page_off}: {fpdus} FPDUs, {plain} without"
                );
                if page_off == 0 {
                    // Two leading FPDUs for a Send, three for a Write, which carry a
                    // tail of 1 to 512 bytes (a tail shorter than the 1-byte FPDUs'
                    // payloads goes in them as well), so that only full FPDUs follow.
                    let leads: u64 = match kind {
                        Kind::Send => 2,
                        Kind::Write => 3,
                    };
                    let folded = (1..=512).contains(&tail);
                    let want = plain + leads - u64::from(folded);
                    assert_eq!(fpdus, want, "{kind:?} of {len} B, tail {tail}");
                }
            }
        }
    }
}

#[test]
fn messages_clear_of_the_window_or_small_are_not_led_in() {
    // 2000 bytes into a page: the full FPDUs stay far from the window.
    assert_eq!(send_one(Kind::Write, 128 << 10, 2000, true).1, 3);
    // Below 64 KiB, from a page-aligned buffer: as without the lead-in.
    assert_eq!(send_one(Kind::Send, 32 << 10, 0, true).1, 1);
    assert_eq!(send_one(Kind::Write, 8 << 10, 0, true).1, 1);
}

/// A Read of `len` bytes from b's memory `page_off` bytes into a page: the distances of
/// every full Read Response FPDU's payload that b sends (lead-in on or off), after checking
/// that the bytes arrived intact in a's sink.
fn read_one(len: usize, page_off: u64, lead: bool) -> Vec<u64> {
    let stream = StreamConfig::for_mss(65535);
    let (mut a, mut b) = (Side::new(1, stream), Side::new(2, stream));
    b.qp.set_tx_alias_lead(lead);
    let (src, sstag, siova, data) = b.filled_region(len + 8192, Access::REMOTE_READ, 6);
    let off = (page_off + 4096 - src.addr() % 4096) % 4096;
    let (sink, kstag, kiova) = a.region(len, Access::LOCAL_WRITE);
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::Read {
            remote_addr: siova + off,
            rkey: sstag,
        },
        payload: Payload::Sgl(SgList::single(sge(kstag, kiova, 0, len as u32))),
        signaled: true,
        fence: false,
    };
    a.qp.post_send(&wr, &a.mrs).unwrap();
    let mut request = Vec::new();
    a.transmit(&mut request, || usize::MAX);
    assert_eq!(b.receive_with(&request, true, || usize::MAX), request.len());
    let mut rec = RecordingWriter::new();
    b.send_all(&mut rec);
    assert_eq!(
        rec.calls.len(),
        1,
        "Read of {len} B from page offset {page_off}"
    );
    assert_eq!(a.receive_with(&rec.out, true, || usize::MAX), rec.out.len());
    let off = off as usize;
    assert!(contents(&sink) == data[off..off + len], "the bytes differ");
    assert_eq!(a.send_wcs().len(), 1);
    rec.written()
        .filter(|p| p.len >= 4096)
        .map(|p| p.at.wrapping_sub(p.addr) % 4096)
        .collect()
}

#[test]
fn read_responses_are_led_in_too() {
    // A page-aligned source: the first Read Response lands 16 bytes ahead without.
    assert_eq!(read_one(128 << 10, 0, false)[0], 16);
    for page_off in (0..4096).step_by(16) {
        let d = read_one(128 << 10, page_off, true);
        assert!(
            d.iter().all(|&d| d == 0 || d >= WINDOW),
            "from page offset {page_off}: distances {d:?}"
        );
    }
}

/// [`transfer`] of a message from a page-aligned source in MSS-sized FPDUs (1460 bytes);
/// returns (the FPDUs sent, the pieces the writer got from the source memory itself rather
/// than from the batch).
fn send_mss(kind: Kind, len: usize, lead: bool) -> (u64, usize) {
    let (rec, fpdus, src) = transfer(kind, len, 0, StreamConfig::for_mss(1460), lead);
    let from_source = rec.written().filter(|p| src.contains(&p.addr)).count();
    (fpdus, from_source)
}

#[test]
fn mss_sized_fpdus_are_gathered_from_the_source_and_not_led_in() {
    // FPDUs this short are not led in (as many FPDUs as with the lead-in off): a distance
    // in the aliasing window moves on by the framing of each FPDU (about 24 bytes), so few
    // of them are ever in it. Every FPDU but the message's first (built by the general
    // path and copied into the batch) is gathered from the source: a gathered run.
    for kind in [Kind::Send, Kind::Write] {
        for len in [64 << 10, (256 << 10) + 100] {
            let (with_lead, from_source) = send_mss(kind, len, true);
            assert_eq!(
                with_lead,
                send_mss(kind, len, false).0,
                "{kind:?} of {len} B"
            );
            assert_eq!(
                from_source as u64,
                with_lead - 1,
                "{kind:?} of {len} B: pieces gathered from the source"
            );
        }
    }
}
