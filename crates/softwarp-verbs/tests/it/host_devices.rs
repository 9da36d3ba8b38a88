//! Softwarp beside the host's RDMA devices (`src/host`), proved without a kernel device:
//! the test builds a stand-in host rdma-core (`tests/c/host/fake_ibverbs.c`, one device
//! `fake0`, every call logged to a file) with `cc`, points `SOFTWARP_HOST_IBVERBS` at it,
//! and runs `tests/c/host_devices.c` over this crate's library: both devices are listed,
//! each object is made on its owner, and the data path of fake0 (inline verbs calling the
//! context's operations) reaches the stand-in's provider while softwarp0's calls never do.

use std::path::{Path, PathBuf};
use std::time::Duration;

use softwarp_testkit::{fake_host_ibverbs, serial};

use super::debian_tools::{build_c, command, finish, tool};

/// A directory of this test's own, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("softwarp-host-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("make the scratch directory");
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The stand-in `libibverbs.so.1` with the private version node `private`, built into
/// `dir`; `None` after a skip without `cc`.
fn fake_ibverbs(dir: &Path, private: &str) -> Option<PathBuf> {
    tool("cc", "gcc")?;
    Some(fake_host_ibverbs(dir, private))
}

/// The result of one run of `host_devices` (`args`) with the stand-in at `host`.
struct Run {
    stdout: String,
    stderr: String,
    /// The calls that reached the stand-in, in order.
    log: Vec<String>,
}

fn run(exe: &Path, host: &Path, dir: &Path, devices: Option<&str>, args: &[&str]) -> Run {
    let log = dir.join("calls.log");
    let _ = std::fs::remove_file(&log);
    let mut c = command(exe);
    c.args(args)
        .env("SOFTWARP_HOST_IBVERBS", host)
        .env("FAKE_IBV_LOG", &log)
        .env_remove("SOFTWARP_DEVICES");
    if let Some(d) = devices {
        c.env("SOFTWARP_DEVICES", d);
    }
    let out = finish(
        c.spawn().expect("run host_devices"),
        Duration::from_secs(20),
        "host_devices",
    );
    assert!(out.status.success(), "{}{}", out.stdout, out.stderr);
    Run {
        stdout: out.stdout,
        stderr: out.stderr,
        log: std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect(),
    }
}

#[test]
fn host_device_is_listed_beside_softwarp0_its_objects_and_data_path_on_the_host_provider() {
    let _serial = serial();
    let dir = Scratch::new("objects");
    let Some(host) = fake_ibverbs(&dir.0, "IBVERBS_PRIVATE_34") else {
        return;
    };
    let Some(exe) = build_c("host_devices", &["-libverbs"]) else {
        return;
    };
    let r = run(&exe, &host, &dir.0, None, &[]);
    let _ = std::fs::remove_file(&exe);
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(
        lines.get(..2),
        Some(&["device softwarp0", "device fake0"][..]),
        "{}",
        r.stdout
    );
    // softwarp0's objects are Softwarp's (its CQ is empty); fake0's are the stand-in's: its
    // firmware, GUID and index, and the completion its provider's poll made up.
    assert!(
        r.stdout
            .contains("softwarp0: gid type 0\nsoftwarp0: poll 0\n"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains(
            "fake0: fw fake-1.0, guid fa4e00000000fa4e, index 7\nfake0: gid type 1\nfake0: poll 1 wr_id fa4e\n"
        ),
        "{}",
        r.stdout
    );
    assert!(r.stdout.ends_with("checks\n"), "{}", r.stdout);
    // Exactly fake0's calls reached the host library, in the program's order: none of
    // softwarp0's (its own PD, MR, channel, CQ, QP, poll and notify), and the data path
    // (post_recv .. req_notify_cq: inline verbs) straight from the program to the provider.
    // The layer's own call: the device's index, the id of its `softwarp resources` entry.
    assert_eq!(
        r.log,
        [
            "get_device_list",
            "open_device",
            "get_device_index",
            "query_device",
            "query_port",
            "get_device_guid",
            "get_device_index",
            "query_gid_type",
            "alloc_pd",
            "reg_mr",
            "create_comp_channel",
            "create_cq",
            "create_qp",
            "query_qp",
            "post_recv",
            "post_send",
            "poll_cq",
            "req_notify_cq",
            "destroy_qp",
            "destroy_cq",
            "destroy_comp_channel",
            "dereg_mr",
            "dealloc_pd",
            "close_device",
        ],
        "{}{}",
        r.stdout,
        r.stderr
    );
    assert_eq!(r.stderr, "");
}

#[test]
fn softwarp_devices_orders_and_filters_the_list_and_softwarp0_alone_loads_nothing() {
    let _serial = serial();
    let dir = Scratch::new("order");
    let Some(host) = fake_ibverbs(&dir.0, "IBVERBS_PRIVATE_34") else {
        return;
    };
    let Some(exe) = build_c("host_devices", &["-libverbs"]) else {
        return;
    };
    let list = |devices| run(&exe, &host, &dir.0, devices, &["list"]);
    let r = list(Some("fake0,softwarp0"));
    assert_eq!(r.stdout, "device fake0\ndevice softwarp0\n");
    let r = list(Some("fake0 nosuch0"));
    assert_eq!(r.stdout, "device fake0\n");
    // softwarp0 alone: the host library is not even loaded (its list never asked for).
    let r = list(Some("softwarp0"));
    assert_eq!(r.stdout, "device softwarp0\n");
    assert!(r.log.is_empty(), "{:?}", r.log);
    // The default: all, softwarp0 first.
    let r = list(None);
    assert_eq!(r.stdout, "device softwarp0\ndevice fake0\n");
    assert_eq!(r.log, ["get_device_list"]);
    let _ = std::fs::remove_file(&exe);
}

#[test]
fn host_rdma_core_of_an_unknown_abi_is_refused_with_a_message_and_a_missing_one_silently() {
    let _serial = serial();
    let dir = Scratch::new("abi");
    let Some(host) = fake_ibverbs(&dir.0, "IBVERBS_PRIVATE_99") else {
        return;
    };
    let Some(exe) = build_c("host_devices", &["-libverbs"]) else {
        return;
    };
    let r = run(&exe, &host, &dir.0, None, &["list"]);
    assert_eq!(r.stdout, "device softwarp0\n");
    assert!(r.log.is_empty(), "refused, yet called: {:?}", r.log);
    assert_eq!(
        r.stderr,
        format!(
            "softwarp: the host's libibverbs {} is not used: its rdma-core ABI \
             IBVERBS_PRIVATE_99 is not one this layer knows (IBVERBS_PRIVATE_34); only \
             softwarp0 is listed (SOFTWARP_HOST_IBVERBS=none says not to look)\n",
            host.display()
        )
    );
    // No host rdma-core at all: today's behaviour, without a word.
    let r = run(&exe, &dir.0.join("missing.so.1"), &dir.0, None, &[]);
    assert_eq!(
        r.stdout
            .lines()
            .filter(|l| l.starts_with("device "))
            .collect::<Vec<_>>(),
        ["device softwarp0"]
    );
    assert_eq!(r.stderr, "");
    let _ = std::fs::remove_file(&exe);
}

#[test]
fn libibverbs_1_0_entries_list_softwarp0_alone_beside_a_host_device() {
    let _serial = serial();
    let dir = Scratch::new("compat");
    let Some(host) = fake_ibverbs(&dir.0, "IBVERBS_PRIVATE_34") else {
        return;
    };
    let Some(exe) = build_c("compat_1_0", &["-libverbs", "-lrdmacm"]) else {
        return;
    };
    // The program checks that the 1.0 list holds one device and runs on it.
    let r = run(&exe, &host, &dir.0, None, &[]);
    let _ = std::fs::remove_file(&exe);
    assert_eq!(r.stdout, "ok: 49 checks\n", "{}", r.stderr);
    assert_eq!(r.log, ["get_device_list"]);
}
