//! `softwarp demo` runs every operation over loopback and says so (small sizes, so it stays
//! quick in debug builds).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::{Duration, Instant};

#[test]
fn demo_runs_every_operation_and_reports_each_one() {
    let mut child = crate::softwarp()
        .args(["demo", "--sizes", "0,1,4095,64K", "--sges", "4"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("softwarp demo did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "exit {}: {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    for op in [
        "Send ",
        "Send+SE ",
        "Send+Invalidate ",
        "Send+SE+Invalidate ",
        "RDMA Write ",
        "RDMA Read ",
    ] {
        assert_eq!(
            stdout
                .lines()
                .filter(|l| l.starts_with(op) && l.contains(" ok, "))
                .count(),
            4,
            "{op:?} once per size:\n{stdout}"
        );
    }
    assert!(stdout.contains("all 24 operations verified"), "{stdout}");
    assert!(stdout.contains("both QPs in Error"), "{stdout}");
    // Everything the demo created is released before its devices close: no leak report.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("still allocated at close") && !stdout.contains("still allocated"),
        "the demo leaks:\n{stderr}"
    );
}
