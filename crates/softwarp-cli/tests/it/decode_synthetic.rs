//! `softwarp decode` on synthetic captures built with `softwarp-wire`: what the siw captures
//! do not exercise (markers, rejection, reordering, one-byte segments, non-iWARP traffic,
//! malformed PDUs), each with a known answer.
#![allow(clippy::unwrap_used)] // tests may unwrap: a panic is a test failure with its message

use crate::support::{
    fpdu, marked_fpdu, mpa_frame, send_ulpdu, write_ulpdu, Capture, Conn, Side::Client,
    Side::Server,
};
use softwarp_cli::decode::record::{CrcRecord, FpduRecord, Item, Placement, Record};
use softwarp_cli::decode::{decode_to_vec, Output, Summary};
use softwarp_wire::mpa::MpaFrameKind::{Reply, Request};

fn decode(cap: &Capture) -> (Vec<Record>, Summary) {
    let (outputs, summary) = decode_to_vec(&cap.pcap()).unwrap();
    let records = outputs
        .into_iter()
        .map(|o| match o {
            Output::Record(r) => *r,
            Output::CaptureError(e) => panic!("capture error {e}"),
        })
        .collect();
    (records, summary)
}

fn fpdus(records: &[Record]) -> Vec<(&Record, &FpduRecord)> {
    records
        .iter()
        .filter_map(|r| match &r.item {
            Item::Fpdu(p) => Some((r, p)),
            _ => None,
        })
        .collect()
}

fn errors(records: &[Record]) -> Vec<String> {
    records
        .iter()
        .filter_map(|r| match &r.item {
            Item::Error(e) => Some(e.message.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn markers_in_both_directions_are_removed_and_crcs_over_the_marked_fpdus_check() {
    let mut cap = Capture::default();
    let mut c = Conn::open(&mut cap, 40000, [100, 900]);
    c.send(
        &mut cap,
        Client,
        &mpa_frame(Request, true, true, false, false, &[]),
    );
    c.send(
        &mut cap,
        Server,
        &mpa_frame(Reply, true, true, false, false, &[]),
    );
    // Client FPDUs of assorted sizes so that markers fall at the start, in the middle,
    // between pad and CRC, and several in one FPDU.
    let sizes = [0usize, 3, 490, 1000, 17, 2000, 1, 510];
    let mut offset = 0u64;
    for (i, &n) in sizes.iter().enumerate() {
        let payload: Vec<u8> = (0..n).map(|b| b as u8).collect();
        let wire = marked_fpdu(&send_ulpdu(i as u32 + 1, &payload), offset, true);
        offset += wire.len() as u64;
        c.send(&mut cap, Client, &wire);
    }
    // One server FPDU, so the server direction's markers are exercised too.
    let wire = marked_fpdu(&write_ulpdu(0x1234_5600, 0x10, &[7; 600]), 0, true);
    c.send(&mut cap, Server, &wire);

    let (records, summary) = decode(&cap);
    assert!(summary.is_clean(), "{summary:?}\n{records:#?}");
    let f = fpdus(&records);
    assert_eq!(f.len(), sizes.len() + 1);
    let mut total_markers = 0;
    for ((r, p), &n) in f.iter().zip(&sizes) {
        assert!(matches!(p.crc, CrcRecord::Good { .. }), "{r}");
        let seg = p.segment.as_ref().unwrap();
        assert_eq!(seg.payload_len, n, "{r}");
        assert_eq!(seg.opcode, "Send");
        total_markers += p.markers;
    }
    // 8 FPDUs of 4570 marker-free bytes in all need a marker every 512 stream octets.
    assert!(total_markers >= 8, "{total_markers}");
    let (r, p) = f[sizes.len()];
    assert_eq!(r.src.port(), 7174);
    assert_eq!(p.markers, 2, "a marker at offset 0 and at 512");
    assert!(matches!(
        p.segment.as_ref().unwrap().placement,
        Placement::Tagged {
            stag: 0x1234_5600,
            to: 0x10
        }
    ));
}

#[test]
fn markers_go_only_toward_the_peer_that_asked_for_them() {
    let mut cap = Capture::default();
    let mut c = Conn::open(&mut cap, 40001, [1, 2]);
    // The initiator wants markers (M in the Request): the responder's FPDUs carry them.
    c.send(
        &mut cap,
        Client,
        &mpa_frame(Request, true, false, false, true, &[]),
    );
    c.send(
        &mut cap,
        Server,
        &mpa_frame(Reply, false, false, false, true, &[]),
    );
    c.send(&mut cap, Client, &fpdu(&send_ulpdu(1, &[1; 600]), false));
    c.send(
        &mut cap,
        Server,
        &marked_fpdu(&send_ulpdu(1, &[2; 600]), 0, false),
    );
    let (records, summary) = decode(&cap);
    assert!(summary.is_clean(), "{records:#?}");
    let f = fpdus(&records);
    assert_eq!(f.len(), 2);
    assert_eq!((f[0].0.src.port(), f[0].1.markers), (40001, 0));
    assert_eq!((f[1].0.src.port(), f[1].1.markers), (7174, 2));
    assert!(f
        .iter()
        .all(|(_, p)| p.segment.as_ref().unwrap().payload_len == 600));
}

#[test]
fn a_bad_marker_stops_that_direction_only() {
    let mut cap = Capture::default();
    let mut c = Conn::open(&mut cap, 40002, [1, 2]);
    c.send(
        &mut cap,
        Client,
        &mpa_frame(Request, true, false, false, true, &[]),
    );
    c.send(
        &mut cap,
        Server,
        &mpa_frame(Reply, true, false, false, true, &[]),
    );
    let mut wire = marked_fpdu(&send_ulpdu(1, &[1; 600]), 0, false);
    // The second marker (stream offset 512) must point 512 octets back; make it lie.
    wire[512 + 3] ^= 0x40;
    c.send(&mut cap, Client, &wire);
    c.send(
        &mut cap,
        Client,
        &marked_fpdu(&send_ulpdu(2, &[1; 8]), 620, false),
    );
    c.send(
        &mut cap,
        Server,
        &marked_fpdu(&send_ulpdu(1, &[3; 8]), 0, false),
    );
    let (records, summary) = decode(&cap);
    assert!(!summary.is_clean());
    let errs = errors(&records);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(errs[0].contains("marker"), "{errs:?}");
    let f = fpdus(&records);
    assert_eq!(f.len(), 1, "only the server's FPDU is decoded");
    assert_eq!(f[0].0.src.port(), 7174);
}

#[test]
fn an_fpdu_sent_one_byte_per_segment_is_reported_in_the_frame_of_its_last_byte() {
    let mut cap = Capture::default();
    let mut c = Conn::open(&mut cap, 40003, [u32::MAX - 30, 5]);
    for b in mpa_frame(Request, false, true, false, true, &[]) {
        c.send(&mut cap, Client, &[b]);
    }
    c.send(
        &mut cap,
        Server,
        &mpa_frame(Reply, false, true, false, true, &[]),
    );
    let wire = fpdu(&send_ulpdu(1, b"hello"), true);
    let mut first = 0;
    let mut last = 0;
    for (i, b) in wire.iter().enumerate() {
        let frame = c.send(&mut cap, Client, &[*b]);
        if i == 0 {
            first = frame;
        }
        last = frame;
    }
    let (records, summary) = decode(&cap);
    assert!(summary.is_clean(), "{records:#?}");
    assert_eq!(records.len(), 3);
    assert_eq!(
        records[0].frame,
        2 + 24,
        "the Request completes with its 24th byte"
    );
    let (r, p) = fpdus(&records)[0];
    assert_eq!((r.first_frame, r.frame), (first, last));
    assert!(matches!(p.crc, CrcRecord::Good { .. }));
    assert_eq!(
        p.pad.len(),
        3,
        "18 + 5 bytes of ULPDU after the 2-byte length"
    );
    assert_eq!(r.bytes, wire);
}

#[test]
fn reordered_and_retransmitted_segments_decode_once_in_stream_order() {
    let mut cap = Capture::default();
    let mut c = Conn::open(&mut cap, 40004, [7, 9]);
    c.send(
        &mut cap,
        Client,
        &mpa_frame(Request, false, false, false, true, &[]),
    );
    c.send(
        &mut cap,
        Server,
        &mpa_frame(Reply, false, false, false, true, &[]),
    );
    let a = fpdu(&send_ulpdu(1, &[0xaa; 20]), false);
    let b = fpdu(&send_ulpdu(2, &[0xbb; 40]), false);
    let stream = [a.clone(), b.clone()].concat();
    // Second half first, then the first half, then a retransmission of everything.
    let cut = a.len() + 10;
    c.send_at(&mut cap, Client, cut as u32, &stream[cut..]);
    let filling = c.send_at(&mut cap, Client, 0, &stream[..cut]);
    c.send_at(&mut cap, Client, 0, &stream);
    c.advance(Client, stream.len());
    let (records, summary) = decode(&cap);
    assert!(summary.is_clean(), "{records:#?}");
    let f = fpdus(&records);
    assert_eq!(f.len(), 2);
    assert_eq!(f[0].0.bytes, a);
    assert_eq!(f[1].0.bytes, b);
    // Both became complete when the hole was filled.
    assert_eq!((f[0].0.frame, f[1].0.frame), (filling, filling));
}

#[test]
fn non_iwarp_connections_are_skipped_silently() {
    let mut cap = Capture::default();
    let mut http = Conn::open(&mut cap, 40005, [1, 1]);
    http.send(&mut cap, Client, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    http.send(&mut cap, Server, b"HTTP/1.1 200 OK\r\n\r\n");
    let mut c = Conn::open(&mut cap, 40006, [1, 1]);
    c.send(
        &mut cap,
        Client,
        &mpa_frame(Request, false, false, false, true, &[]),
    );
    c.send(
        &mut cap,
        Server,
        &mpa_frame(Reply, false, false, false, true, &[]),
    );
    // A frame that is not IP at all (ARP) is not a problem either.
    let mut arp = vec![0xff; 12];
    arp.extend_from_slice(&[0x08, 0x06]);
    arp.resize(42, 0);
    cap.raw(arp);
    let (records, summary) = decode(&cap);
    assert!(summary.is_clean());
    assert_eq!(summary.connections, 2);
    assert_eq!(summary.iwarp_connections, 1);
    assert_eq!(records.len(), 2);
    assert!(records.iter().all(|r| r.connection == 1));
}

#[test]
fn a_rejected_connection_carries_no_fpdus() {
    let mut cap = Capture::default();
    let mut c = Conn::open(&mut cap, 40007, [1, 1]);
    c.send(
        &mut cap,
        Client,
        &mpa_frame(Request, false, false, false, true, b"hi"),
    );
    c.send(
        &mut cap,
        Server,
        &mpa_frame(Reply, false, false, true, true, b"no thanks"),
    );
    c.send(&mut cap, Client, &fpdu(&send_ulpdu(1, &[1; 4]), false));
    let (records, _) = decode(&cap);
    let Item::MpaFrame(rep) = &records[1].item else {
        panic!("{records:#?}")
    };
    assert!(rep.reject);
    assert_eq!(&rep.private_data[4..], b"no thanks");
    assert!(records[1].to_string().contains(" R=1 "));
    assert!(fpdus(&records).is_empty());
    assert_eq!(errors(&records).len(), 1);
    assert!(errors(&records)[0].contains("rejected"));
}

#[test]
fn bad_crc_is_reported_on_its_line_and_the_next_fpdu_still_decodes() {
    let mut cap = Capture::default();
    let mut c = Conn::open(&mut cap, 40008, [1, 1]);
    c.send(
        &mut cap,
        Client,
        &mpa_frame(Request, false, true, false, true, &[]),
    );
    c.send(
        &mut cap,
        Server,
        &mpa_frame(Reply, false, false, false, true, &[]),
    );
    let mut bad = fpdu(&send_ulpdu(1, &[5; 16]), true);
    bad[30] ^= 1;
    c.send(&mut cap, Client, &bad);
    c.send(&mut cap, Client, &fpdu(&send_ulpdu(2, &[5; 16]), true));
    let (records, summary) = decode(&cap);
    assert_eq!(summary.bad_crcs, 1);
    let f = fpdus(&records);
    assert_eq!(f.len(), 2);
    assert!(matches!(f[0].1.crc, CrcRecord::Bad { .. }));
    assert!(f[0].0.to_string().contains("crc=BAD("));
    assert!(matches!(f[1].1.crc, CrcRecord::Good { .. }));
}

#[test]
fn a_segment_the_codec_refuses_is_reported_and_framing_goes_on() {
    let mut cap = Capture::default();
    let mut c = Conn::open(&mut cap, 40009, [1, 1]);
    c.send(
        &mut cap,
        Client,
        &mpa_frame(Request, false, false, false, true, &[]),
    );
    c.send(
        &mut cap,
        Server,
        &mpa_frame(Reply, false, false, false, true, &[]),
    );
    let mut ulpdu = send_ulpdu(1, &[0; 8]);
    ulpdu[9] = 9; // queue number 9 does not exist
    c.send(&mut cap, Client, &fpdu(&ulpdu, false));
    c.send(&mut cap, Client, &fpdu(&send_ulpdu(2, &[0; 8]), false));
    let (records, summary) = decode(&cap);
    assert_eq!(summary.bad_segments, 1);
    let f = fpdus(&records);
    assert_eq!(f.len(), 2);
    let line = f[0].0.to_string();
    assert!(
        line.contains("ERROR DDP untagged header: invalid queue number 9"),
        "{line}"
    );
    assert!(f[1].1.segment.is_ok());
}

#[test]
fn fpdus_waiting_for_the_reply_are_decoded_once_it_arrives() {
    // The capture shows the client's FPDU before the Reply (as a capture point near the
    // responder can): the FPDU waits until the negotiation is known.
    let mut cap = Capture::default();
    let mut c = Conn::open(&mut cap, 40010, [1, 1]);
    c.send(
        &mut cap,
        Client,
        &mpa_frame(Request, false, true, false, true, &[]),
    );
    c.send(&mut cap, Client, &fpdu(&send_ulpdu(1, &[1; 4]), true));
    let reply_frame = c.send(
        &mut cap,
        Server,
        &mpa_frame(Reply, false, true, false, true, &[]),
    );
    let (records, summary) = decode(&cap);
    assert!(summary.is_clean(), "{records:#?}");
    assert_eq!(records.len(), 3);
    assert!(matches!(records[1].item, Item::MpaFrame(_)));
    let (r, p) = fpdus(&records)[0];
    assert!(matches!(p.crc, CrcRecord::Good { .. }));
    assert_eq!(r.frame, 4, "reported where its bytes completed");
    assert_eq!(reply_frame, 5);
}

#[test]
fn a_capture_that_ends_inside_an_fpdu_says_so() {
    let mut cap = Capture::default();
    let mut c = Conn::open(&mut cap, 40011, [1, 1]);
    c.send(
        &mut cap,
        Client,
        &mpa_frame(Request, false, false, false, true, &[]),
    );
    c.send(
        &mut cap,
        Server,
        &mpa_frame(Reply, false, false, false, true, &[]),
    );
    let wire = fpdu(&send_ulpdu(1, &[1; 100]), false);
    c.send(&mut cap, Client, &wire[..50]);
    let (records, summary) = decode(&cap);
    assert_eq!(summary.errors, 1);
    let errs = errors(&records);
    assert!(
        errs[0].contains("ends inside an FPDU (50 bytes present)"),
        "{errs:?}"
    );
}

#[test]
fn a_hole_in_the_capture_stops_decoding_of_that_direction() {
    let mut cap = Capture::default();
    let mut c = Conn::open(&mut cap, 40012, [1, 1]);
    c.send(
        &mut cap,
        Client,
        &mpa_frame(Request, false, false, false, true, &[]),
    );
    c.send(
        &mut cap,
        Server,
        &mpa_frame(Reply, false, false, false, true, &[]),
    );
    let a = fpdu(&send_ulpdu(1, &[1; 10]), false);
    let b = fpdu(&send_ulpdu(2, &[1; 10]), false);
    c.advance(Client, a.len()); // `a` was never captured
    c.send(&mut cap, Client, &b);
    c.send(&mut cap, Server, &fpdu(&send_ulpdu(1, &[1; 10]), false));
    let (records, _) = decode(&cap);
    let errs = errors(&records);
    assert_eq!(errs.len(), 1, "{records:#?}");
    assert!(
        errs[0].contains("lost 36 bytes at stream offset 24"),
        "{errs:?}"
    );
    assert_eq!(fpdus(&records).len(), 1, "the server's FPDU still decodes");
}

#[test]
fn json_lines_are_one_object_per_record() {
    let mut cap = Capture::default();
    let mut c = Conn::open(&mut cap, 40013, [1, 1]);
    c.send(
        &mut cap,
        Client,
        &mpa_frame(Request, false, true, false, true, &[]),
    );
    c.send(
        &mut cap,
        Server,
        &mpa_frame(Reply, false, true, false, true, &[]),
    );
    c.send(&mut cap, Client, &fpdu(&send_ulpdu(1, &[1; 3]), true));
    let (records, _) = decode(&cap);
    let lines: Vec<String> = records.iter().map(softwarp_cli::decode::to_json).collect();
    assert!(lines[0].contains(r#""kind":"mpa_request""#));
    assert!(lines[1].contains(r#""kind":"mpa_reply""#));
    assert!(lines[2].contains(r#""kind":"fpdu""#));
    assert!(lines[2].contains(r#""crc":{"state":"good""#));
    assert!(lines[2].contains(r#""opcode":"Send","last":true,"tagged":false,"qn":0,"msn":1"#));
    assert!(lines.iter().all(|l| l.starts_with('{') && l.ends_with('}')));
}

#[test]
fn interleaved_connections_keep_their_own_endpoints() {
    // Connection 0 is opened first but speaks last; connection 1 speaks in between.
    let mut cap = Capture::default();
    let mut first = Conn::open(&mut cap, 41000, [1, 1]);
    let mut second = Conn::open(&mut cap, 42000, [1, 1]);
    second.send(
        &mut cap,
        Client,
        &mpa_frame(Request, false, false, false, true, &[]),
    );
    second.send(
        &mut cap,
        Server,
        &mpa_frame(Reply, false, false, false, true, &[]),
    );
    first.send(
        &mut cap,
        Client,
        &mpa_frame(Request, false, false, false, true, &[]),
    );
    first.send(
        &mut cap,
        Server,
        &mpa_frame(Reply, false, false, false, true, &[]),
    );
    second.send(&mut cap, Client, &fpdu(&send_ulpdu(1, &[1; 4]), false));
    first.send(&mut cap, Client, &fpdu(&send_ulpdu(1, &[1; 4]), false));
    let (records, summary) = decode(&cap);
    assert!(summary.is_clean());
    assert_eq!(summary.iwarp_connections, 2);
    let seen: Vec<(usize, u16, u16)> = records
        .iter()
        .map(|r| (r.connection, r.src.port(), r.dst.port()))
        .collect();
    assert_eq!(
        seen,
        [
            (1, 42000, 7174),
            (1, 7174, 42000),
            (0, 41000, 7174),
            (0, 7174, 41000),
            (1, 42000, 7174),
            (0, 41000, 7174),
        ]
    );
}
