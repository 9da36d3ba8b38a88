//! Golden tests on real traffic: the Linux siw captures in `testdata/captures/`.
//!
//! Each capture `NAME.pcap` comes with `NAME.tshark.txt`, the output of
//! `../shared/tools/iwarp-decode` (Wireshark 4.0's iWARP dissectors through tshark) stored in
//! the repository, so that the comparison runs from a plain clone without tshark.
//!
//! What is checked, for every capture:
//! - every frame parses: no capture error, no decoding error, no ULPDU the codecs refuse;
//! - every CRC checks where the MPA frames negotiated CRC, and the CRC field is zero where
//!   they did not;
//! - emitting the parsed form reproduces the captured bytes: each MPA frame exactly, each
//!   FPDU exactly apart from its pad bytes (siw leaves them dirty; we emit zeros), and with
//!   the captured pad put back, exactly including the CRC;
//! - our decode lines equal the stored tshark lines, frame by frame, after the one
//!   normalisation documented in [`as_wireshark_4_0_sees_it`].
//!
//! A second test re-runs tshark live when it and `../shared` are present, to check that the
//! stored references are still what Wireshark says.
#![allow(clippy::unwrap_used)] // tests may unwrap: a panic is a test failure with its message

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use softwarp_testkit::{file, require, tool};

use softwarp_cli::decode::record::{CrcRecord, FpduRecord, Item, MpaFrameRecord, Record};
use softwarp_cli::decode::{decode_to_vec, Output};
use softwarp_wire::mpa::{fpdu, Fpdu, FpduPacket, MpaFrame};
use softwarp_wire::rdmap::{Segment, TerminateHeader, TerminateLayout};

/// The repository root (two levels above this crate).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every capture in `testdata/captures/`, sorted by name.
fn captures() -> Vec<PathBuf> {
    let dir = workspace_root().join("testdata/captures");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "pcap" || x == "pcapng"))
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no captures in {}", dir.display());
    v
}

/// The stored tshark reference for `capture`.
fn reference_path(capture: &Path) -> PathBuf {
    capture.with_extension("tshark.txt")
}

/// Re-runs iwarp-decode on every capture and checks that the stored references are still what
/// tshark says. Needs tshark and `../shared` (the interop harness beside the repository); without
/// them it explains why and passes (and fails under `CI=true`).
#[test]
fn stored_tshark_references_match_a_live_iwarp_decode_run() {
    let decode = workspace_root().join("../shared/tools/iwarp-decode");
    let needs = (
        file(
            &decode,
            "../shared's iwarp-decode (../shared beside this checkout)",
        ),
        tool("tshark").package("tshark"),
    );
    if !require(needs) {
        return;
    }
    for capture in captures() {
        let out = Command::new(&decode)
            .arg(&capture)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", decode.display()));
        assert!(
            out.status.success(),
            "iwarp-decode {} failed: {}",
            capture.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let live = String::from_utf8(out.stdout).unwrap();
        let stored = std::fs::read_to_string(reference_path(&capture)).unwrap();
        assert_eq!(
            live,
            stored,
            "{}: live tshark output differs from the stored reference",
            capture.display()
        );
    }
}

/// Every capture reads to the end, every frame's headers parse, and every TCP direction
/// reassembles without a hole: the captures are complete, so anything less is our bug.
#[test]
fn every_capture_reassembles_into_complete_tcp_streams() {
    use softwarp_cli::capture::{tcp_segment, CaptureReader, ConnectionTracker, StreamEvent};
    for capture in captures() {
        let bytes = std::fs::read(&capture).unwrap();
        let mut tracker = ConnectionTracker::default();
        let mut payload_bytes = 0usize;
        let mut delivered = 0usize;
        let mut gaps = Vec::new();
        let mut frames = 0;
        for frame in CaptureReader::new(&bytes).unwrap() {
            let frame = frame.unwrap_or_else(|e| panic!("{}: {e}", capture.display()));
            frames += 1;
            let Some(segment) = tcp_segment(frame.number, frame.link, &frame.data)
                .unwrap_or_else(|e| panic!("{}: {e}", capture.display()))
            else {
                continue;
            };
            payload_bytes += segment.payload.len();
            tracker.segment(frame.number, &segment, &mut |ev| match ev.kind {
                StreamEvent::Data { bytes, .. } => delivered += bytes.len(),
                StreamEvent::Gap { offset, len, .. } => gaps.push((ev.connection, offset, len)),
            });
        }
        tracker.finish(&mut |ev| {
            if let StreamEvent::Gap { offset, len, .. } = ev.kind {
                gaps.push((ev.connection, offset, len));
            }
        });
        assert!(frames > 0, "{}: no frames", capture.display());
        assert!(gaps.is_empty(), "{}: holes {gaps:?}", capture.display());
        assert_eq!(
            delivered,
            payload_bytes,
            "{}: the captures have no retransmissions, so every payload byte is delivered once",
            capture.display()
        );
    }
}

/// Decodes `capture` with our decoder; panics on a file-level error.
fn decode(capture: &Path) -> Vec<Output> {
    let bytes = std::fs::read(capture).unwrap();
    let (outputs, summary) =
        decode_to_vec(&bytes).unwrap_or_else(|e| panic!("{}: {e}", capture.display()));
    assert!(
        summary.is_clean(),
        "{}: not clean: {summary:?}",
        capture.display()
    );
    outputs
}

fn records(capture: &Path) -> Vec<Record> {
    decode(capture)
        .into_iter()
        .map(|o| match o {
            Output::Record(r) => *r,
            Output::CaptureError(e) => panic!("{}: capture error {e}", capture.display()),
        })
        .collect()
}

/// Every capture decodes into MPA frames and FPDUs only: no error line, no refused segment.
#[test]
fn every_frame_of_every_capture_parses() {
    for capture in captures() {
        let recs = records(&capture);
        assert!(
            recs.iter().any(|r| matches!(r.item, Item::MpaFrame(_))),
            "{}: no MPA frame found",
            capture.display()
        );
        for r in &recs {
            match &r.item {
                Item::MpaFrame(_) => {}
                Item::Fpdu(p) => assert!(
                    p.segment.is_ok(),
                    "{}: {r}: segment refused",
                    capture.display()
                ),
                Item::Error(e) => panic!("{}: error line {r} ({e:?})", capture.display()),
            }
        }
    }
}

/// Whether each connection negotiated CRC, from its two MPA frames (C set in either one),
/// worked out here independently of the decoder's own bookkeeping.
fn crc_negotiated(recs: &[Record]) -> HashMap<usize, bool> {
    let mut frames: HashMap<usize, Vec<&MpaFrameRecord>> = HashMap::new();
    for r in recs {
        if let Item::MpaFrame(m) = &r.item {
            frames.entry(r.connection).or_default().push(m);
        }
    }
    frames
        .into_iter()
        .map(|(conn, fs)| {
            assert_eq!(fs.len(), 2, "connection {conn}: one Request and one Reply");
            (conn, fs.iter().any(|m| m.crc))
        })
        .collect()
}

/// Where CRC was negotiated every CRC is good; where it was not, the CRC field is zero.
#[test]
fn every_crc_checks_where_negotiated_and_is_zero_where_not() {
    let mut good = 0;
    let mut off = 0;
    for capture in captures() {
        let recs = records(&capture);
        let negotiated = crc_negotiated(&recs);
        for r in &recs {
            let Item::Fpdu(p) = &r.item else { continue };
            let crc_bytes = &r.bytes[r.bytes.len() - 4..];
            match (negotiated[&r.connection], p.crc) {
                (true, CrcRecord::Good { field }) => {
                    assert_eq!(field.to_be_bytes(), crc_bytes);
                    // Independently of the codec: CRC32c of everything before the CRC field,
                    // sent as the little-endian bytes of the standard value.
                    let computed = crc32c::crc32c(&r.bytes[..r.bytes.len() - 4]);
                    assert_eq!(
                        computed.to_le_bytes(),
                        crc_bytes,
                        "{}: {r}",
                        capture.display()
                    );
                    good += 1;
                }
                (false, CrcRecord::Off { field: 0 }) => {
                    assert_eq!(crc_bytes, [0; 4]);
                    off += 1;
                }
                (neg, crc) => panic!(
                    "{}: {r}: CRC negotiated={neg} but {crc:?}",
                    capture.display()
                ),
            }
        }
    }
    assert!(good > 100 && off > 100, "good={good} off={off}");
}

/// Re-emits one FPDU from its parsed form and compares it with the captured bytes.
fn check_fpdu_reemits(capture: &Path, r: &Record, p: &FpduRecord, use_crc: bool) {
    assert_eq!(p.markers, 0, "the siw captures have no markers");
    let raw = &r.bytes[..];
    let packet = FpduPacket::new_checked(raw).unwrap();
    let ulpdu = packet.ulpdu();
    let segment = Segment::parse(ulpdu).unwrap();

    // The DDP/RDMAP headers and payload, from the parsed form.
    let mut emitted_ulpdu = vec![0u8; segment.buffer_len()];
    assert_eq!(segment.emit(&mut emitted_ulpdu).unwrap(), ulpdu.len());
    assert_eq!(emitted_ulpdu, ulpdu, "{}: {r}: ULPDU", capture.display());
    let mut header = vec![0u8; segment.header_len()];
    segment.emit_header(&mut header).unwrap();
    assert_eq!(
        header,
        ulpdu[..header.len()],
        "{}: {r}: headers",
        capture.display()
    );

    // The whole FPDU, from the parsed ULPDU: equal apart from the pad (we send zeros) ...
    let fpdu = Fpdu {
        ulpdu: &emitted_ulpdu,
    };
    let mut emitted = vec![0u8; fpdu.buffer_len()];
    assert_eq!(fpdu.emit(&mut emitted, use_crc).unwrap(), raw.len());
    let pad = fpdu::HEADER_LEN + ulpdu.len()..raw.len() - fpdu::CRC_LEN;
    assert_eq!(pad.len(), fpdu::pad_len(ulpdu.len()));
    assert_eq!(
        emitted[..pad.start],
        raw[..pad.start],
        "{}: {r}",
        capture.display()
    );
    assert!(emitted[pad.clone()].iter().all(|&b| b == 0));
    if raw[pad.clone()].iter().all(|&b| b == 0) || !use_crc {
        assert_eq!(
            emitted[pad.end..],
            raw[pad.end..],
            "{}: {r}: CRC",
            capture.display()
        );
    }
    // ... and with the captured pad put back (and the CRC recomputed over it), identical.
    emitted[pad.clone()].copy_from_slice(&raw[pad]);
    FpduPacket::new_checked(&mut emitted[..])
        .unwrap()
        .fill_crc(use_crc);
    assert_eq!(emitted, raw, "{}: {r}: whole FPDU", capture.display());
}

/// Emitting each parsed MPA frame gives its captured bytes exactly; emitting each parsed FPDU
/// gives its captured bytes apart from the pad, and exactly once the pad is put back.
#[test]
fn emitting_the_parsed_form_reproduces_the_captured_bytes() {
    let mut dirty_pads = 0;
    for capture in captures() {
        let recs = records(&capture);
        let negotiated = crc_negotiated(&recs);
        for r in &recs {
            assert_eq!(r.bytes.len(), r.wire_len);
            match &r.item {
                Item::MpaFrame(_) => {
                    let (frame, len) = MpaFrame::parse(&r.bytes).unwrap();
                    assert_eq!(len, r.bytes.len());
                    let mut out = vec![0u8; frame.buffer_len()];
                    assert_eq!(frame.emit(&mut out).unwrap(), len);
                    assert_eq!(out, r.bytes, "{}: {r}", capture.display());
                }
                Item::Fpdu(p) => {
                    if p.pad.iter().any(|&b| b != 0) {
                        dirty_pads += 1;
                    }
                    check_fpdu_reemits(&capture, r, p, negotiated[&r.connection]);
                }
                Item::Error(_) => unreachable!("checked by every_frame_of_every_capture_parses"),
            }
        }
    }
    assert!(dirty_pads > 0, "siw's dirty pads are in the captures");
}

/// Our line, rewritten the way Wireshark 4.0 shows it. The one difference:
///
/// siw writes the Terminate control through little-endian C bitfields, so its M and D flags
/// sit at 0x01/0x02 of byte 2 (and Layer/EType in swapped nibbles of byte 0). softwarp-wire
/// detects that layout and reports M=1 D=1 (and `layout=siw`); Wireshark 4.0 reads RFC 5040's
/// layout literally and shows M/D/R=0/0/0 with the flags in the reserved field
/// (`rsvd=0x0300`). The layer/etype/code/M/D/R/rsvd fields are therefore recomputed here
/// from the captured control bytes with the RFC 5040 layout, which is exactly Wireshark's
/// reading, and the `layout=siw` marker is dropped. Nothing else is normalised.
fn as_wireshark_4_0_sees_it(r: &Record) -> String {
    let line = r.to_string();
    let Item::Fpdu(p) = &r.item else {
        return line;
    };
    let Ok(segment) = &p.segment else {
        return line;
    };
    let Some(t) = &segment.terminate else {
        return line;
    };
    // The Terminate header follows the 2-byte ULPDU_Length and the 18-byte untagged header.
    let rfc = TerminateHeader::new_checked(&r.bytes[20..], TerminateLayout::Rfc5040).unwrap();
    let ours = format!(
        "term layer=0x{:02x} etype=0x{:02x} code=0x{:02x} M/D/R={}/{}/{} rsvd=0x{:04x}{}",
        t.layer,
        t.etype,
        t.code,
        u8::from(t.m),
        u8::from(t.d),
        u8::from(t.r),
        t.reserved,
        if t.siw_layout { " layout=siw" } else { "" }
    );
    let wireshark = format!(
        "term layer=0x{:02x} etype=0x{:02x} code=0x{:02x} M/D/R={}/{}/{} rsvd=0x{:04x}",
        rfc.layer(),
        rfc.etype(),
        rfc.error_code(),
        u8::from(rfc.flag_m()),
        u8::from(rfc.flag_d()),
        u8::from(rfc.flag_r()),
        rfc.reserved()
    );
    assert!(line.contains(&ours), "{line}");
    line.replace(&ours, &wireshark)
}

/// Our decode agrees with the stored tshark decode, line by line: same frames, same PDUs in
/// the same order, same fields.
#[test]
fn decode_lines_agree_with_stored_tshark_output_frame_by_frame() {
    let mut normalised = 0;
    for capture in captures() {
        let ours: Vec<String> = records(&capture)
            .iter()
            .map(|r| {
                let line = as_wireshark_4_0_sees_it(r);
                if line != r.to_string() {
                    normalised += 1;
                }
                line
            })
            .collect();
        let stored = std::fs::read_to_string(reference_path(&capture)).unwrap();
        let theirs: Vec<&str> = stored.lines().collect();
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert_eq!(a, b, "{}: line {} differs", capture.display(), i + 1);
        }
        assert_eq!(
            ours.len(),
            theirs.len(),
            "{}: we decode {} PDUs, tshark {}",
            capture.display(),
            ours.len(),
            theirs.len()
        );
    }
    assert_eq!(normalised, 1, "only siw's Terminate needs normalising");
}

/// The siw Terminate is read in siw's layout: DDP layer, tagged buffer error, base or bounds
/// violation, with the segment length and the offending header included (M = D = 1).
#[test]
fn siw_terminate_is_decoded_with_siws_layout() {
    let capture = workspace_root().join("testdata/captures/siw-terminate-rping.pcap");
    let recs = records(&capture);
    let line = recs
        .iter()
        .map(|r| r.to_string())
        .find(|l| l.contains("Terminate"))
        .unwrap();
    assert!(
        line.contains("term layer=0x01 etype=0x01 code=0x01 M/D/R=1/1/0 rsvd=0x0000 layout=siw"),
        "{line}"
    );
}
