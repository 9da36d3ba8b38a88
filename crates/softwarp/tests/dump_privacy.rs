//! A component dump never contains registered-memory contents: with every trace level at 9
//! (data dumps), a buffer full of a unique pattern is registered, sent, written and read
//! over a connected pair, the device then fails (QP snapshots, an automatic dump), and
//! neither the on-demand dump over the control socket, nor the automatic dumps, nor the
//! QP snapshots contain the pattern: not as raw bytes, not as hex, not as decimal bytes.
//!
//! A binary of its own (not a module of `it`): the trace levels it raises to 9 are the
//! process's, and every other test would then record and print its data at level 9 (and
//! fill the flight recorder that `ras_wiring` reads).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "it/util/mod.rs"]
mod util;

use std::time::Duration;

use softwarp::*;
use softwarp_ras::control::{DumpResult, Request};
use softwarp_ras::trace::{self, Level};
use util::*;

const LW: AccessFlags = AccessFlags::LOCAL_WRITE;
const LEN: usize = 64 * 1024;

/// The pattern: a marker no other code writes, repeated over the whole buffer.
fn secret() -> Vec<u8> {
    let unit = format!("swarp-secret-{:08x}|", std::process::id());
    unit.as_bytes().iter().copied().cycle().take(LEN).collect()
}

/// Ways the first 24 bytes of `data` could appear in a text dump.
fn encodings(data: &[u8]) -> Vec<(&'static str, String)> {
    let piece = &data[..24];
    let hex: String = piece.iter().map(|b| format!("{b:02x}")).collect();
    let spaced: Vec<String> = piece.iter().map(|b| format!("{b:02x}")).collect();
    let decimal: Vec<String> = piece.iter().map(u8::to_string).collect();
    vec![
        ("raw", String::from_utf8(piece.to_vec()).unwrap()),
        ("hex", hex.clone()),
        ("HEX", hex.to_uppercase()),
        ("spaced hex", spaced.join(" ")),
        ("decimal list", decimal.join(",")),
        // The marker's distinctive middle alone (catches a shifted or partial copy).
        ("marker", "swarp-secret-".to_string()),
    ]
}

fn assert_clean(what: &str, text: &str, data: &[u8]) {
    for (name, needle) in encodings(data) {
        assert!(
            !text.contains(&needle),
            "{what} contains registered memory ({name}: {needle:?})"
        );
    }
}

#[test]
fn dumps_and_snapshots_never_contain_registered_memory() {
    opt_in_ras();
    trace::control().apply_str("default=9").unwrap();
    trace::control().set_recorder_level(Level::MAX);
    let (a, b) = pair(&ConnectOptions::default());
    let data = secret();

    let src = a.pd.reg_mr(LEN, LW | AccessFlags::REMOTE_READ).unwrap();
    src.write_at(0, &data).unwrap();
    let sink = b.pd.reg_mr(LEN, LW | AccessFlags::REMOTE_WRITE).unwrap();
    let recv = b.pd.reg_mr(LEN, LW).unwrap();
    let back = b.pd.reg_mr(LEN, LW).unwrap();
    b.qp.post_recv(&RecvWr {
        wr_id: 1,
        sgl: SgList::single(recv.sge(0, LEN as u32).unwrap()),
    })
    .unwrap();
    b.qp.post_recv(&RecvWr {
        wr_id: 2,
        sgl: SgList::single(recv.sge(0, 64).unwrap()),
    })
    .unwrap();
    a.qp.post_send(&send_wr(
        10,
        SendOp::Write {
            remote_addr: sink.addr(),
            rkey: sink.rkey(),
        },
        Payload::Sgl(sgl(&src, 0, LEN, 3)),
    ))
    .unwrap();
    a.qp.post_send(&send_wr(
        11,
        send_op(false, None),
        Payload::Sgl(sgl(&src, 0, LEN, 2)),
    ))
    .unwrap();
    a.qp.post_send(&send_wr(
        12,
        send_op(false, None),
        Payload::Inline(&data[..48]),
    ))
    .unwrap();
    assert!(wait_wcs(&a.scq, 3)
        .iter()
        .all(|wc| wc.status == WcStatus::Success));
    assert_eq!(wait_wcs(&b.rcq, 2).len(), 2);
    b.qp.post_send(&send_wr(
        20,
        SendOp::Read {
            remote_addr: src.addr(),
            rkey: src.rkey(),
        },
        Payload::Sgl(sgl(&back, 0, LEN, 1)),
    ))
    .unwrap();
    assert_eq!(wait_wcs(&b.scq, 1)[0].status, WcStatus::Success);
    assert_eq!(sink.to_vec().unwrap(), data);
    assert_eq!(back.to_vec().unwrap(), data);

    // The device fails: QP snapshots and an automatic dump are taken.
    a.dev.inject_fatal_error();
    wait_state(&a.qp, QpState::Error);

    let socket = softwarp_ras::service::global()
        .and_then(|s| s.control_socket())
        .expect("the RAS services run with a control socket")
        .to_path_buf();
    let dump: DumpResult = softwarp_ras::control::request(
        &socket,
        &Request::Dump {
            reason: Some("dump_privacy".into()),
        },
        Duration::from_secs(20),
    )
    .unwrap()
    .into_result()
    .unwrap();
    let parsed = softwarp_ras::dump::parse(dump.dump.as_bytes()).unwrap();
    assert!(parsed.is_complete());
    let records = trace::flight_recorder().snapshot();
    assert!(
        records.iter().any(|r| r.level >= 5),
        "level 5+ records were taken (the check covers them)"
    );
    assert!(
        dump.dump.contains("snapshots") && dump.dump.contains("device_fatal"),
        "the dump holds the failure it should"
    );
    assert_clean("the on-demand dump", &dump.dump, &data);

    let reply = softwarp_ras::control::request(
        &socket,
        &Request::Snapshots {
            qpn: None,
            device: None,
            id: None,
        },
        Duration::from_secs(20),
    )
    .unwrap();
    assert_clean("the QP snapshots", &reply.result.to_string(), &data);
    let snapshots: softwarp_ras::snapshot::SnapshotsResult = reply.into_result().unwrap();
    assert!(
        !snapshots.snapshots.is_empty(),
        "the failure took snapshots"
    );

    let dir = softwarp_ras::registry::runtime_dir();
    let autos = softwarp_ras::dump::auto_dumps_in(&dir).unwrap();
    for path in &autos {
        let text = String::from_utf8_lossy(&std::fs::read(path).unwrap()).into_owned();
        assert_clean(&path.display().to_string(), &text, &data);
    }
    eprintln!(
        "dump of {} bytes, {} snapshots, {} automatic dumps, {} flight recorder records: clean",
        dump.dump.len(),
        snapshots.snapshots.len(),
        autos.len(),
        records.len()
    );
    // Registrations before their devices (else the close reports them as leaked).
    drop((src, sink, recv, back));
    drop((a, b));
}
