//! `softwarp decode` on damaged captures: cut short, bytes flipped, not a capture at all.
//! It must report what is wrong, keep decoding what it can, and never panic.
#![allow(clippy::unwrap_used)] // tests may unwrap: a panic is a test failure with its message

use std::path::{Path, PathBuf};

use crate::softwarp;
use crate::support::{mpa_frame, Capture, Conn, Side::Client, Side::Server};
use proptest::prelude::*;
use softwarp_cli::capture::CaptureError;
use softwarp_cli::decode::record::Item;
use softwarp_cli::decode::{decode_to_vec, Output};
use softwarp_wire::mpa::MpaFrameKind::{Reply, Request};

fn capture_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/captures")
        .join(name)
}

fn read(name: &str) -> Vec<u8> {
    std::fs::read(capture_path(name)).unwrap()
}

/// Byte offsets of the records of a little-endian classic pcap: (record start, data start,
/// data length).
fn records(pcap: &[u8]) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    let mut at = 24;
    while at + 16 <= pcap.len() {
        let len = u32::from_le_bytes(pcap[at + 8..at + 12].try_into().unwrap()) as usize;
        out.push((at, at + 16, len));
        at += 16 + len;
    }
    out
}

/// Writes `bytes` to a fresh file in the temporary directory.
fn temp_file(name: &str, bytes: &[u8]) -> PathBuf {
    let path = std::env::temp_dir().join(format!("softwarp-{}-{name}", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn every_truncation_of_a_real_capture_is_reported_without_panicking() {
    let full = read("siw-crc-rping.pcap");
    let boundaries: Vec<usize> = records(&full).iter().map(|r| r.0).collect();
    for cut in 0..full.len() {
        match decode_to_vec(&full[..cut]) {
            Err(e) => assert!(cut < 24, "cut {cut}: only a cut header fails outright: {e}"),
            Ok((outputs, summary)) => {
                let truncated = outputs.iter().any(|o| {
                    matches!(
                        o,
                        Output::CaptureError(CaptureError::TruncatedRecord { .. })
                    )
                });
                let at_boundary = cut == 24 || boundaries.contains(&cut);
                assert_eq!(truncated, !at_boundary, "cut {cut}");
                if !at_boundary {
                    assert!(!summary.is_clean(), "cut {cut}");
                }
            }
        }
    }
}

/// The same damage as a hand check with tshark: flipping one byte of the Send in frame 8 of
/// siw-crc-rping.pcap (its queue number's second byte) makes tshark print
/// `crc=BAD(0x398e2983 (Bad CRC32, should be 0xb7b45f82))`; we must say the same, and also
/// refuse the segment (queue 65280 does not exist), and go on with frame 9.
#[test]
fn a_flipped_byte_gives_tsharks_crc_verdict_and_the_codecs_error() {
    let mut pcap = read("siw-crc-rping.pcap");
    let (_, data, _) = records(&pcap)[7];
    // Ethernet 14 + IPv4 20 + TCP 32 (timestamps) = 66 bytes of headers; +10 is the QN field.
    pcap[data + 66 + 10] ^= 0xff;
    let (outputs, summary) = decode_to_vec(&pcap).unwrap();
    assert_eq!((summary.bad_crcs, summary.bad_segments), (1, 1));
    let lines: Vec<String> = outputs.iter().map(|o| o.to_string()).collect();
    let frame8 = lines.iter().find(|l| l.starts_with("     8 ")).unwrap();
    assert!(
        frame8.contains("crc=BAD(0x398e2983 (Bad CRC32, should be 0xb7b45f82))"),
        "{frame8}"
    );
    assert!(frame8.contains("ERROR DDP untagged header: invalid queue number 65280"));
    assert!(lines
        .iter()
        .any(|l| l.starts_with("     9 ") && l.contains("crc=good")));
}

#[test]
fn a_damaged_mpa_frame_is_an_error_and_the_other_direction_goes_on() {
    let mut pcap = read("siw-rping.pcap");
    // Frame 6 is the MPA Reply: make its revision 7.
    let (_, data, _) = records(&pcap)[5];
    pcap[data + 66 + 17] = 7;
    let (outputs, _) = decode_to_vec(&pcap).unwrap();
    let lines: Vec<String> = outputs.iter().map(|o| o.to_string()).collect();
    assert!(
        lines.iter().any(|l| l.contains("ERROR")
            && l.contains("unsupported revision 7")
            && l.contains("decoding of this direction stops")),
        "{lines:#?}"
    );
    // Without a Reply the negotiation never completes: the client's FPDUs cannot be split
    // (CRC and markers are unknown), so they wait and are reported at the end.
    assert!(lines.iter().any(|l| l.contains("MPA-REQ")));
    assert!(lines
        .iter()
        .any(|l| l.contains("ends inside bytes sent before the MPA negotiation completed")));
}

#[test]
fn a_file_that_is_not_a_capture_is_refused() {
    assert!(matches!(
        decode_to_vec(b"this is not a pcap file at all"),
        Err(CaptureError::NotACapture { .. })
    ));
    assert!(decode_to_vec(&[]).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Flipping bytes anywhere in a real capture (headers, lengths, MPA, DDP, CRC) never
    /// makes the decoder panic, and every damage shows up as a report of some kind or leaves
    /// a decode that still checks out.
    #[test]
    fn flipped_bytes_in_real_captures_never_panic(
        which in 0usize..4,
        flips in proptest::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let name = ["siw-crc-ib_write_bw.pcap", "siw-terminate-rping.pcap",
                    "siw-p2p-rping.pcap", "host-initiator-rping-server.pcap"][which];
        let mut pcap = read(name);
        for (at, x) in &flips {
            let i = at.index(pcap.len());
            pcap[i] ^= x;
        }
        if truncate {
            let n = cut.index(pcap.len());
            pcap.truncate(n);
        }
        if let Ok((outputs, _)) = decode_to_vec(&pcap) {
            for o in &outputs {
                let _ = o.to_string();
                if let Output::Record(r) = o {
                    let _ = softwarp_cli::decode::to_json(r);
                }
            }
        }
    }

    /// Arbitrary stream bytes after a valid MPA exchange (with any CRC and marker
    /// choice), cut into arbitrary segments: the FPDU decoder never panics, and every byte is
    /// accounted for by an FPDU or an error.
    #[test]
    fn arbitrary_fpdu_stream_bytes_never_panic(
        stream in proptest::collection::vec(any::<u8>(), 0..3000),
        cuts in proptest::collection::vec(1usize..300, 1..30),
        crc in any::<bool>(),
        markers in any::<bool>(),
    ) {
        let mut cap = Capture::default();
        let mut c = Conn::open(&mut cap, 50000, [3, 4]);
        c.send(&mut cap, Client, &mpa_frame(Request, markers, crc, false, true, &[]));
        c.send(&mut cap, Server, &mpa_frame(Reply, markers, crc, false, true, &[]));
        let mut rest = &stream[..];
        for n in cuts.iter().cycle() {
            if rest.is_empty() {
                break;
            }
            let (seg, tail) = rest.split_at((*n).min(rest.len()));
            c.send(&mut cap, Client, seg);
            rest = tail;
        }
        let (outputs, _) = decode_to_vec(&cap.pcap()).unwrap();
        let mut covered = 0;
        let mut error = false;
        for o in &outputs {
            if let Output::Record(r) = o {
                if r.src.port() == 50000 {
                    match r.item {
                        Item::Fpdu(_) => covered += r.wire_len,
                        Item::Error(_) => error = true,
                        Item::MpaFrame(_) => {}
                    }
                }
            }
        }
        prop_assert!(covered == stream.len() || error);
    }
}

#[test]
fn cli_prints_the_tshark_lines_and_exits_0_on_a_clean_capture() {
    let out = softwarp()
        .args(["decode", capture_path("siw-rping.pcap").to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let expected = std::fs::read_to_string(capture_path("siw-rping.tshark.txt")).unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), expected);
}

#[test]
fn cli_reports_damage_and_exits_2() {
    let mut pcap = read("siw-crc-rping.pcap");
    let (_, data, _) = records(&pcap)[7];
    pcap[data + 66 + 10] ^= 0xff;
    pcap.truncate(pcap.len() - 5);
    let path = temp_file("damaged.pcap", &pcap);
    let out = softwarp()
        .args(["decode", "--summary", path.to_str().unwrap()])
        .output()
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(stdout.contains("crc=BAD("), "{stdout}");
    assert!(stdout.contains("ERROR     capture ends in the middle of the record after frame"));
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("1 bad CRCs"), "{stderr}");
}

#[test]
fn cli_refuses_a_file_that_is_not_a_capture_with_exit_1() {
    let path = temp_file("not-a-capture.txt", b"hello, world\n");
    let out = softwarp()
        .args(["decode", path.to_str().unwrap()])
        .output()
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("is not a capture softwarp can read"),
        "{stderr}"
    );
    assert!(stderr.contains("not a pcap or pcapng file"), "{stderr}");
    let missing = softwarp()
        .args(["decode", "/nonexistent/capture.pcap"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(1));
}

#[test]
fn cli_json_prints_one_object_per_line() {
    let out = softwarp()
        .args([
            "decode",
            "--json",
            capture_path("siw-terminate-rping.pcap").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 6);
    assert!(lines.iter().all(|l| l.starts_with('{') && l.ends_with('}')));
    assert!(lines[5].contains(r#""layout":"linux_siw""#), "{}", lines[5]);
}
