//! Softwarp linked into a program outside the workspace, built with default flags (the
//! workspace's `.cargo/config.toml`, which enables SSE 4.2, does not reach it: `RUSTFLAGS`
//! is set to empty, which overrides it). The program is `tests-external/polite` (its own
//! package, lockfile and workspace), built offline from the registry cache into
//! `target/tmp/external-polite` (its own directory: other flags would otherwise evict the
//! workspace's artifacts); after the first run the build is incremental.
//!
//! Each of its two programs runs without and with `--ras`, in a fresh runtime directory
//! (`SOFTWARP_RUNTIME_DIR`):
//! - `subscriber_first` installs its own global subscriber (`tracing_subscriber`'s `init`)
//!   and then opens a device; `subscriber_after` opens a device first, then installs it
//!   (which panics if the library had installed one), then opens a second device;
//! - both check that their own records and Softwarp's (`device opened`, target
//!   `softwarp::runtime`) reach their subscriber, and that their `Targets` filter
//!   (`softwarp::qp=warn`) hides Softwarp's `QP created`;
//! - without `--ras`: no file in the runtime directory and no thread besides main and one
//!   progress thread per device; with `--ras` (`Device::builder().ras(..)` and the flight
//!   recorder layer in their subscriber): the control socket, registry entry and error log
//!   are there, a control socket thread runs, the flight recorder kept `device opened`;
//! - the CRC32-instruction loop is the active CRC backend on a CPU with SSE 4.2 although
//!   the build lacks the flag (which the program asserts).
//!
//! Skipped, with the reason printed, when `cargo` cannot be run (a failure under `CI=true`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn cargo() -> PathBuf {
    std::env::var_os("CARGO").map_or_else(|| PathBuf::from("cargo"), PathBuf::from)
}

#[test]
fn a_program_outside_the_workspace_finds_softwarp_polite_and_fast() {
    let cargo = cargo();
    if Command::new(&cargo).arg("--version").output().is_err() {
        softwarp_testkit::skip(format!("cannot run {}", cargo.display()));
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests-external/polite");
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("external-polite");
    let build = Command::new(&cargo)
        .args([
            "build",
            "--offline",
            "--locked",
            "--bins",
            "--manifest-path",
        ])
        .arg(root.join("Cargo.toml"))
        .current_dir(&root)
        .env("CARGO_TARGET_DIR", &target)
        .env("RUSTFLAGS", "")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_BUILD_RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET")
        .output()
        .unwrap();
    assert!(
        build.status.success(),
        "building tests-external/polite failed:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    for bin in ["subscriber_first", "subscriber_after"] {
        for ras in [false, true] {
            let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join(format!("polite-{bin}-{ras}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let mut cmd = Command::new(target.join("debug").join(bin));
            if ras {
                cmd.arg("--ras");
            }
            for v in [
                "SOFTWARP_RAS",
                "SOFTWARP_TRACE",
                "SOFTWARP_TRACE_CONSOLE",
                "SOFTWARP_CONTROL",
                "SOFTWARP_ERRLOG",
                "SOFTWARP_METRICS",
                "RUST_LOG",
            ] {
                cmd.env_remove(v);
            }
            let out = cmd.env("SOFTWARP_RUNTIME_DIR", &dir).output().unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{bin} (ras: {ras}) failed:\n{stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(stdout.contains(&format!("{bin}: ok")), "{stdout}");
            println!("{bin} (ras: {ras}):\n{stdout}");
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}
