//! Structure markers (issue 16): a damaged begin/end word of a QP, CQ, MR or the device, or
//! a damaged guard word of a ring, is found by the next entry point that checks it (or by
//! `Device::close`), is never used silently (the call fails with `Error::MarkerDamaged`
//! every time), fails the device (QPs to Error, one `DeviceFatal` event), is recorded in
//! the process's marker history and shows in the object's resource details. The damage is
//! made through the documented fault-injection hooks (`damage_marker_for_testing`), which
//! flip the words as atomics: no undefined behaviour. The automatic dump and `softwarp
//! decode`'s flag are checked end to end in `softwarp-cli/tests/markers_decode.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::util::*;
use softwarp::*;
use softwarp_ras::markers;
use softwarp_ras::tracker::{all_trackers, ResourceKind};

fn write_wr(id: u64) -> SendWr<'static> {
    send_wr(id, send_op(false, None), Payload::Inline(b"marker"))
}

/// The marker words of `kind` `id` in device `dev`'s resource details.
fn details_markers(
    dev: &Device,
    kind: ResourceKind,
    id: u64,
) -> Vec<softwarp_ras::markers::MarkerWord> {
    all_trackers()
        .iter()
        .filter(|t| t.name() == dev.instance_name())
        .flat_map(|t| t.resources())
        .find(|r| r.kind == kind && r.id == id)
        .and_then(|r| r.details)
        .map(|d| d.markers)
        .unwrap_or_default()
}

fn recorded(dev: &Device, object: &str, marker: &str) -> bool {
    markers::history()
        .damage
        .iter()
        .any(|d| d.device == dev.instance_name() && d.object == object && d.marker.name == marker)
}

#[test]
fn intact_markers_are_shown_and_pass_every_check() {
    let (a, b) = pair(&ConnectOptions::default());
    a.dev.check_markers().unwrap();
    let words = details_markers(&a.dev, ResourceKind::Qp, u64::from(a.qp.qp_num()));
    let names: Vec<String> = words.iter().map(ToString::to_string).collect();
    assert!(names.contains(&"begin=SWQP-BEG".to_string()), "{names:?}");
    assert!(names.contains(&"end=SWQP-END".to_string()), "{names:?}");
    assert!(names.contains(&"sq.lo=RING-LO>".to_string()), "{names:?}");
    assert_eq!(words.len(), 2 + 2 * 6, "{names:?}");
    assert!(words.iter().all(|w| w.is_intact()));
    let cq = details_markers(&a.dev, ResourceKind::Cq, u64::from(a.scq.id().0));
    assert_eq!(cq.len(), 4, "{cq:?}");
    let dev = details_markers(&a.dev, ResourceKind::Device, 0);
    assert_eq!(dev.len(), 2, "{dev:?}");
    drop(b);
}

#[test]
fn a_damaged_qp_marker_fails_the_device_at_the_next_post_and_every_post_after() {
    let (a, b) = pair(&ConnectOptions::default());
    let qpn = a.qp.qp_num();
    a.qp.damage_marker_for_testing("begin").unwrap();
    for _ in 0..2 {
        match a.qp.post_send(&write_wr(1)) {
            Err(Error::MarkerDamaged { object, id, marker }) => {
                assert_eq!(
                    (object, id, marker.as_str()),
                    ("qp", u64::from(qpn), "begin")
                );
            }
            other => panic!("post on a damaged QP: {other:?}"),
        }
    }
    let (ev, _) = wait_event(&a.dev, |e| matches!(e, AsyncEvent::DeviceFatal));
    assert_eq!(ev, AsyncEvent::DeviceFatal);
    wait_state(&a.qp, QpState::Error);
    assert!(recorded(&a.dev, "qp", "begin"));
    let words = details_markers(&a.dev, ResourceKind::Qp, u64::from(qpn));
    let begin = words.iter().find(|w| w.name == "begin").unwrap();
    assert!(!begin.is_intact());
    assert!(begin.to_string().starts_with("begin=DAMAGED"), "{begin}");
    // The device failed once: a second damaged object adds a record, not a second fault.
    a.qp.damage_marker_for_testing("rq.lo").unwrap();
    assert!(matches!(
        a.qp.post_recv(&RecvWr {
            wr_id: 1,
            sgl: SgList::new()
        }),
        Err(Error::MarkerDamaged { .. })
    ));
    assert!(recorded(&a.dev, "qp", "rq.lo"));
    std::thread::sleep(std::time::Duration::from_millis(50));
    let mut fatal = 0;
    while let Some(ev) = a.dev.try_get_async_event() {
        fatal += usize::from(ev == AsyncEvent::DeviceFatal);
    }
    assert_eq!(fatal, 0, "one DeviceFatal per device");
    drop(b);
}

#[test]
fn ring_guards_cq_mr_and_device_markers_are_checked_where_they_are_used() {
    // The CQ's ring guard, at the next poll.
    let e = End::new(None, None);
    e.scq.damage_marker_for_testing("cq.hi").unwrap();
    let mut wcs = [EMPTY_COMPLETION; 4];
    match e.scq.poll(&mut wcs) {
        Err(Error::MarkerDamaged { object, marker, .. }) => {
            assert_eq!((object, marker.as_str()), ("cq", "cq.hi"));
        }
        other => panic!("poll of a damaged CQ: {other:?}"),
    }
    assert_eq!(e.scq.poll_one(), None);
    wait_event(&e.dev, |e| matches!(e, AsyncEvent::DeviceFatal));
    assert!(recorded(&e.dev, "cq", "cq.hi"));
    assert!(e.scq.damage_marker_for_testing("sq.hi").is_err());

    // A memory region's end word, at its next copy.
    let e = End::new(None, None);
    let mr = e.pd.reg_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    mr.damage_marker_for_testing("end").unwrap();
    match mr.write_at(0, b"x") {
        Err(Error::MarkerDamaged { object, id, marker }) => {
            assert_eq!(
                (object, id, marker.as_str()),
                ("mr", u64::from(mr.stag().0), "end")
            );
        }
        other => panic!("write to a damaged MR: {other:?}"),
    }
    wait_event(&e.dev, |e| matches!(e, AsyncEvent::DeviceFatal));
    assert!(recorded(&e.dev, "mr", "end"));
    drop(mr);

    // The device's begin word, at the next object creation.
    let e = End::new(None, None);
    e.dev.damage_marker_for_testing("begin").unwrap();
    assert!(matches!(
        e.dev.alloc_pd(),
        Err(Error::MarkerDamaged {
            object: "device",
            ..
        })
    ));
    wait_event(&e.dev, |e| matches!(e, AsyncEvent::DeviceFatal));
    assert!(recorded(&e.dev, "device", "begin"));
    assert!(e.dev.damage_marker_for_testing("middle").is_err());
}

#[test]
fn close_checks_the_markers_no_entry_point_looks_at() {
    let e = End::new(None, None);
    // The event ring is not checked by any entry point: only by close (and check_markers).
    e.qp.damage_marker_for_testing("events.hi").unwrap();
    let wr = RecvWr {
        wr_id: 1,
        sgl: SgList::new(),
    };
    e.qp.post_recv(&wr).unwrap();
    let dev = e.dev.clone();
    match dev.close(std::time::Duration::from_secs(5)) {
        Err(Error::MarkerDamaged { object, marker, .. }) => {
            assert_eq!((object, marker.as_str()), ("qp", "events.hi"));
        }
        other => panic!("close with a damaged ring guard: {other:?}"),
    }
    assert!(recorded(&e.dev, "qp", "events.hi"));
    // Closed all the same.
    assert!(matches!(e.qp.post_recv(&wr), Err(Error::DeviceClosed)));
}
