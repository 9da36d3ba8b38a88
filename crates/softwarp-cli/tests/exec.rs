//! `softwarp exec --sockets`: the environment it gives the program, and socat over iWARP
//! through it. Skips, saying why, when the preload library was not built (it is, by
//! `cargo test --workspace`) or socat is missing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn softwarp() -> Command {
    Command::new(env!("CARGO_BIN_EXE_softwarp"))
}

/// The preload library cargo built in this target directory, if it did.
fn library() -> Option<PathBuf> {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_softwarp"));
    let dir = bin.parent()?;
    [
        dir.join("libsoftwarp_preload.so"),
        dir.join("deps/libsoftwarp_preload.so"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

#[test]
fn exec_without_sockets_or_library_explains_itself() {
    let out = softwarp().args(["exec", "--", "true"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--sockets"));
    let out = softwarp()
        .args([
            "exec",
            "--sockets",
            "--library",
            "/nonexistent/lib.so",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));
}

#[test]
fn exec_sets_the_preload_environment() {
    let Some(lib) = library() else {
        eprintln!("skipped: libsoftwarp_preload.so not built (cargo build -p softwarp-preload)");
        return;
    };
    let out = softwarp()
        .args(["exec", "--sockets", "--ports", "5201,6000-6010", "--stats", "--library"])
        .arg(&lib)
        .args([
            "--",
            "sh",
            "-c",
            "echo \"$LD_PRELOAD|$SOFTWARP_SOCKETS|$SOFTWARP_SOCKETS_PORTS|$SOFTWARP_SOCKETS_STATS\"; exit 7",
        ])
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7), "the program's exit status");
    let line = String::from_utf8_lossy(&out.stdout);
    let want = format!(
        "{}|all|5201,6000-6010|1",
        std::fs::canonicalize(&lib).unwrap().display()
    );
    assert_eq!(line.trim(), want);
}

#[test]
fn exec_runs_socat_over_iwarp() {
    let Some(lib) = library() else {
        eprintln!("skipped: libsoftwarp_preload.so not built (cargo build -p softwarp-preload)");
        return;
    };
    let have_socat = Command::new("sh")
        .args(["-c", "command -v socat"])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !have_socat {
        eprintln!("skipped: socat is not installed");
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let exec = |args: &[&str]| {
        let mut c = softwarp();
        c.args(["exec", "--sockets", "--stats", "--library"])
            .arg(&lib)
            .arg("--")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    let server = exec(&[
        "socat",
        "-u",
        &format!("TCP-LISTEN:{port},reuseaddr"),
        "STDOUT",
    ])
    .spawn()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let client = loop {
        let mut c = exec(&["socat", "-u", "STDIN", &format!("TCP:127.0.0.1:{port}")])
            .spawn()
            .unwrap();
        {
            use std::io::Write;
            let mut stdin = c.stdin.take().unwrap();
            stdin.write_all(b"hello over iWARP\n").unwrap();
        }
        let out = c.wait_with_output().unwrap();
        if out.status.success() {
            break out;
        }
        assert!(
            Instant::now() < deadline,
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let server = server.wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&server.stdout),
        "hello over iWARP\n"
    );
    for err in [&client.stderr, &server.stderr] {
        assert!(
            String::from_utf8_lossy(err).contains("closed iWARP stream"),
            "{}",
            String::from_utf8_lossy(err)
        );
    }
}
