//! Golden tests on real traffic: the Linux siw captures in `testdata/captures/`.
//!
//! Each capture `NAME.pcap` comes with `NAME.tshark.txt`, the output of
//! `../shared/tools/iwarp-decode` (Wireshark 4.0's iWARP dissectors through tshark) stored in
//! the repository, so that the comparison runs from a plain clone without tshark.
#![allow(clippy::unwrap_used)] // tests may unwrap: a panic is a test failure with its message

use std::path::{Path, PathBuf};
use std::process::Command;

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

fn tshark_available() -> bool {
    Command::new("tshark")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Re-runs iwarp-decode on every capture and checks that the stored references are still what
/// tshark says. Needs tshark and `../shared` (the interop harness beside the repository); without
/// them it explains why and passes.
#[test]
fn stored_tshark_references_match_a_live_iwarp_decode_run() {
    let tool = workspace_root().join("../shared/tools/iwarp-decode");
    if !tool.exists() {
        eprintln!(
            "SKIP: {} not found (../shared is not beside this checkout)",
            tool.display()
        );
        return;
    }
    if !tshark_available() {
        eprintln!("SKIP: tshark is not installed (CI installs it; apt-get install tshark)");
        return;
    }
    for capture in captures() {
        let out = Command::new(&tool)
            .arg(&capture)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", tool.display()));
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
