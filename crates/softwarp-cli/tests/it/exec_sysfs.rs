//! `softwarp exec --sysfs`: the program sees `/sys/class/infiniband/softwarp0` (and the
//! host's classes as before) in a mount namespace of its own; the host does not; rdma-core's
//! rdma_cm tests, which look for the device's network interface there, run instead of
//! skipping.
//!
//! The namespace needs root (CI runs as root) or unprivileged user namespaces: without
//! either the tests say so and pass on a user's machine, and fail under `CI=true`.

use softwarp_testkit::{file, netns, require, root, skip};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::softwarp;

/// Runs `cmd` with its output collected, killed past `limit`.
fn run(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("collect the output")
}

/// Whether this user can have a mount namespace; `false` after saying why (a failure
/// under CI, which runs as root).
fn namespaces_allowed() -> bool {
    let probe = run(
        {
            let mut c = softwarp();
            c.args(["exec", "--sysfs", "--sysfs-netdev", "lo", "--", "true"]);
            c
        },
        Duration::from_secs(20),
    );
    if probe.status.success() {
        return true;
    }
    let why = String::from_utf8_lossy(&probe.stderr).into_owned();
    skip(format!(
        "no mount namespace for this user (softwarp exec --sysfs failed): {why}"
    ));
    false
}

fn sh(script: &str) -> Output {
    let mut c = softwarp();
    c.args([
        "exec",
        "--sysfs",
        "--sysfs-netdev",
        "lo",
        "--",
        "sh",
        "-c",
        script,
    ]);
    run(c, Duration::from_secs(20))
}

#[test]
fn the_program_sees_softwarp0_with_its_port_and_interface_and_the_host_does_not() {
    if !namespaces_allowed() {
        return;
    }
    let d = "/sys/class/infiniband/softwarp0";
    let out = sh(&format!(
        "cat {d}/node_type {d}/ports/1/state {d}/ports/1/link_layer {d}/ports/1/gid_attrs/ndevs/0; \
         ls {d}/device/net; cat {d}/device/net/lo/address; \
         cat /sys/class/infiniband_verbs/uverbs-softwarp0/ibdev; \
         test -e /sys/class/net/lo && echo net-kept; \
         touch {d}/node_type 2>/dev/null || echo read-only"
    ));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        text.lines().collect::<Vec<_>>(),
        [
            "4: RNIC",
            "4: ACTIVE",
            "Ethernet",
            "lo",
            "lo",
            "00:00:00:00:00:00",
            "softwarp0",
            "net-kept",
            "read-only"
        ]
    );
    // The GID the view shows is the one the library reports (ibv_devinfo -v, over
    // Softwarp's libibverbs in the same namespace).
    let gid = sh(&format!("cat {d}/ports/1/gids/0"));
    let gid = String::from_utf8_lossy(&gid.stdout).trim().to_string();
    assert_eq!(gid.len(), 39, "{gid:?}");
    if Path::new("/usr/bin/ibv_devinfo").exists() {
        let mut c = softwarp();
        c.args(["exec", "--", "ibv_devinfo", "-v"]);
        let info = String::from_utf8_lossy(&run(c, Duration::from_secs(20)).stdout).into_owned();
        assert!(
            info.contains(&format!("GID[  0]:\t\t{gid},")),
            "{gid}\n{info}"
        );
    }
    assert!(
        !Path::new("/sys/class/infiniband/softwarp0").exists(),
        "the view leaked to the host"
    );
}

#[test]
fn an_interface_the_host_lacks_is_refused_and_nothing_runs() {
    let out = run(
        {
            let mut c = softwarp();
            c.args([
                "exec",
                "--sysfs",
                "--sysfs-netdev",
                "no-such-if0",
                "--",
                "sh",
                "-c",
                "echo ran",
            ]);
            c
        },
        Duration::from_secs(20),
    );
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no-such-if0"));
}

/// The softwarp executable and the C library copied where another user can run them.
fn copies_for_another_user() -> (PathBuf, PathBuf) {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_softwarp"));
    let lib = softwarp_testkit::library("libsoftwarp_verbs.so")
        .expect("libsoftwarp_verbs.so (a dev-dependency, built before the tests)");
    let dir = std::env::temp_dir().join(format!("softwarp-sysfs-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a directory");
    let mut copied = Vec::new();
    for (from, name) in [(&exe, "softwarp"), (&lib, "libsoftwarp_verbs.so")] {
        let to = dir.join(name);
        std::fs::copy(from, &to).expect("copy");
        copied.push(to);
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    (copied.remove(0), copied.remove(0))
}

#[test]
fn another_user_gets_the_view_through_a_user_namespace() {
    let setpriv = Path::new("/usr/bin/setpriv");
    let userns = std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
        .is_ok_and(|n| n.trim() != "0");
    let needs = (
        root("to become another user"),
        file(setpriv, "setpriv (apt-get install util-linux)"),
        (!userns).then_some("user namespaces are off (/proc/sys/user/max_user_namespaces is 0)"),
    );
    if !require(needs) {
        return;
    }
    let (exe, lib) = copies_for_another_user();
    let mut c = Command::new(setpriv);
    c.args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(&exe)
        .args(["exec", "--sysfs", "--sysfs-netdev", "lo", "--lib"])
        .arg(&lib)
        .args([
            "--",
            "sh",
            "-c",
            "id -u; cat /sys/class/infiniband/softwarp0/node_type",
        ]);
    let out = run(c, Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(exe.parent().expect("the copies' directory"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "65534\n4: RNIC\n");
}

#[test]
fn rdma_core_rdma_cm_tests_run_over_softwarp_with_the_view() {
    let python = Path::new("/usr/bin/python3");
    let installed = Path::new("/usr/share/doc/rdma-core/tests").is_dir()
        && Command::new(python)
            .args(["-c", "import pyverbs"])
            .output()
            .is_ok_and(|o| o.status.success());
    if !installed {
        skip("rdma-core's test suite is not installed (apt-get install python3-pyverbs)");
        return;
    }
    if !namespaces_allowed() {
        return;
    }
    // The tests bind the address of the interface the view names, which must give the id a
    // device: an interface's address, not a loopback one (an id bound to 127.0.0.1 has no
    // device, as with the kernel's rdma_cm, and pyverbs then fails). So the suite runs in
    // a network namespace of its own, on `sw0` (10.77.0.1) of a veth pair.
    if !require(netns::unavailable(&["ip"])) {
        return;
    }
    let (ns, _peer) = netns::veth();
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("../softwarp-verbs/tests/rdma-core");
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &ns.0])
        .arg(softwarp().get_program())
        .args(["exec", "--sysfs", "--sysfs-netdev", "sw0", "--"])
        .arg(python)
        .arg(here.join("run_suite.py"))
        .arg(here.join("expected.txt"))
        .arg("only=test_rdmacm")
        .env_remove("SOFTWARP_RAS");
    let out = run(c, Duration::from_secs(240));
    let text = String::from_utf8_lossy(&out.stdout);
    let summary: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("SUMMARY") || l.starts_with("DIFFER"))
        .collect();
    assert!(
        out.status.success(),
        "{}\n{}",
        summary.join("\n"),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{}", summary.join("\n"));
}
