//! A damaged structure marker end to end (issue 16): the test damages a connected QP's
//! begin word through the documented fault-injection hook, the next post fails with
//! `Error::MarkerDamaged`, the device fails (`DeviceFatal`, QP in Error) and writes an
//! automatic dump that shows the damaged word (resource details and the `markers`
//! section); the built `softwarp decode` flags it in text and in JSON.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use softwarp::*;
use softwarp_ras::dump::{self, Section};
use softwarp_ras::tracker::ResourceKind;

const WAIT: Duration = Duration::from_secs(20);

#[test]
fn a_damaged_marker_fails_the_device_shows_in_the_dump_and_decode_flags_it() {
    // RAS services on, runtime directory of our own (automatic dumps go there).
    let dir = std::env::temp_dir().join(format!("swcli-mark-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::env::set_var("SOFTWARP_RUNTIME_DIR", &dir);
    std::env::remove_var("SOFTWARP_AUTO_DUMPS");
    std::env::remove_var("SOFTWARP_RAS");
    enable_ras(&RasConfig::from_env()).expect("RAS services");

    let dev = Device::open_default().unwrap();
    let peer = Device::open_default().unwrap();
    let (pd, ppd) = (dev.alloc_pd().unwrap(), peer.alloc_pd().unwrap());
    let (cq, pcq) = (
        dev.create_cq(16, None).unwrap(),
        peer.create_cq(16, None).unwrap(),
    );
    let qp = pd.create_qp(&QpInitAttr::new(&cq, &cq)).unwrap();
    let pqp = ppd.create_qp(&QpInitAttr::new(&pcq, &pcq)).unwrap();
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let opts = ConnectOptions::default();
    std::thread::scope(|s| {
        let h = s.spawn(|| l.accept_timeout(&pqp, &opts, WAIT).unwrap());
        qp.connect(addr, &opts).unwrap();
        h.join().unwrap();
    });
    let before = dump::auto_dumps_in(&dir).unwrap_or_default();

    qp.damage_marker_for_testing("begin").unwrap();
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        payload: Payload::Inline(b"never sent"),
        signaled: true,
        fence: false,
    };
    match qp.post_send(&wr) {
        Err(Error::MarkerDamaged {
            object: "qp",
            marker,
            ..
        }) => assert_eq!(marker, "begin"),
        other => panic!("post on a damaged QP: {other:?}"),
    }
    // The fault: DeviceFatal, the QP in Error.
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match dev.get_async_event_timeout(left) {
            Ok(AsyncEvent::DeviceFatal) => break,
            Ok(_) => {}
            Err(e) => panic!("no DeviceFatal: {e}"),
        }
    }
    assert_eq!(qp.state(), QpState::Error);

    // The dump, written before post_send returned.
    let after = dump::auto_dumps_in(&dir).unwrap();
    let new: Vec<_> = after.iter().filter(|p| !before.contains(p)).collect();
    assert_eq!(new.len(), 1, "{after:?}");
    let bytes = std::fs::read(new[0]).unwrap();
    let parsed = dump::parse(&bytes).unwrap();
    assert!(parsed.is_complete(), "{:?}", parsed.error);
    let reason = &parsed.process().unwrap().reason;
    assert!(reason.contains("structure marker damaged"), "{reason}");
    let qp_markers = parsed
        .sections
        .iter()
        .find_map(|s| match s {
            Section::Resources(r) => r.resources.iter().find(|res| {
                res.tracker == dev.instance_name()
                    && res.kind == ResourceKind::Qp
                    && res.id == u64::from(qp.qp_num())
            }),
            _ => None,
        })
        .and_then(|r| r.details.clone())
        .expect("the QP in the dump's resources")
        .markers;
    assert!(
        qp_markers
            .iter()
            .any(|w| w.name == "begin" && !w.is_intact()),
        "{qp_markers:?}"
    );
    let damage = parsed
        .sections
        .iter()
        .find_map(|s| match s {
            Section::Markers(m) => Some(m.clone()),
            _ => None,
        })
        .expect("a markers section");
    assert!(damage.damage.iter().any(|d| d.device == dev.instance_name()
        && d.object == "qp"
        && d.marker.name == "begin"
        && d.check == "QueuePair::post_send"));

    // softwarp decode flags it.
    let out = crate::softwarp()
        .args(["decode", new[0].to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("MARKERS DAMAGED: markers begin=DAMAGED(found "),
        "{text}"
    );
    assert!(text.contains("expected SWQP-BEG)"), "{text}");
    assert!(text.contains("DAMAGED STRUCTURE MARKER(S)"), "{text}");
    for line in text.lines().filter(|l| l.contains("DAMAGED")) {
        println!("{line}");
    }
    let json = crate::softwarp()
        .args(["decode", "--json", new[0].to_str().unwrap()])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert!(v["damaged_markers"].as_u64().unwrap() >= 2, "{v}");
    println!(
        "{} damaged marker(s) flagged by decode",
        v["damaged_markers"]
    );
    drop((qp, pqp, cq, pcq, pd, ppd, l));
    drop((dev, peer));
    let _ = std::fs::remove_dir_all(&dir);
}
