//! Debian's rping over this crate's C libraries against Softwarp's Rust rping
//! (`crates/softwarp/examples/rping.rs`, compiled into this test): the C ABI and the Rust API
//! on the two ends of one connection, both roles. The programs' output goes to files: a pipe
//! nobody reads while they run fills up (rping -v prints every ping) and stops them. The
//! tests take the process's `serial` lock, as `debian_tools`' do: one pair of programs at a
//! time.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use softwarp_testkit::{free_port, listening, require, serial, tool, Reaped, SpawnReaped};

#[allow(dead_code, clippy::all)]
#[path = "../../../softwarp/examples/rping.rs"]
mod rust_rping;

fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("target/<profile>/deps");
    let lib = deps.join("libsoftwarp_verbs.so");
    assert!(lib.exists(), "{} not built", lib.display());
    let dir = deps
        .parent()
        .expect("target/<profile>")
        .join("softwarp-verbs-lib-mixed");
    std::fs::create_dir_all(&dir).expect("create the library directory");
    for name in ["libibverbs.so.1", "librdmacm.so.1"] {
        let tmp = dir.join(format!("{name}.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&lib, &tmp).expect("link the library");
        std::fs::rename(&tmp, dir.join(name)).expect("place the link");
    }
    dir
}

/// Debian's rping, or `None` after [`skip`] (a failure under `CI=true`).
fn debian_rping() -> Option<PathBuf> {
    if !require(tool("rping").package("rdmacm-utils")) {
        return None;
    }
    Some(PathBuf::from("rping"))
}

fn rust_args(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// A file for a child's output, in the temporary directory.
fn out_file(name: &str) -> (PathBuf, std::fs::File) {
    let path = std::env::temp_dir().join(format!(
        "softwarp-verbs-mixed-{}-{name}",
        std::process::id()
    ));
    let file = std::fs::File::create(&path).expect("create an output file");
    (path, file)
}

/// Waits for `child` at most `limit` (killing it past that); its exit status and the text
/// of its output file.
fn wait_child(
    child: Reaped,
    out: PathBuf,
    limit: Duration,
    what: &str,
) -> (std::process::ExitStatus, String) {
    let mut child = child.take();
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let text = std::fs::read_to_string(&out).unwrap_or_default();
            let _ = std::fs::remove_file(&out);
            panic!("{what} did not finish within {limit:?}:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    let _ = std::fs::remove_file(&out);
    (status, text)
}

fn run_rust(args: &[&str]) -> Result<(), String> {
    let a = rust_rping::parse_args(&rust_args(args))?;
    let server = a.server;
    let cb = rust_rping::Cb::new(a)?;
    if server {
        cb.run_server()
    } else {
        cb.run_client()
    }
}

#[test]
fn debian_rping_client_against_the_rust_rping_server() {
    let _serial = serial();
    let Some(rping) = debian_rping() else {
        return;
    };
    let port = free_port();
    let p = port.to_string();
    let server = std::thread::spawn({
        let p = p.clone();
        move || run_rust(&["-s", "-a", "127.0.0.1", "-p", &p, "-C", "50", "-S", "4096"])
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !listening(port) {
        assert!(
            Instant::now() < deadline,
            "the Rust rping server is not listening"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let (path, file) = out_file("client");
    let client = Command::new(&rping)
        .args([
            "-c",
            "-a",
            "127.0.0.1",
            "-p",
            &p,
            "-C",
            "50",
            "-S",
            "4096",
            "-v",
            "-V",
        ])
        .env("LD_LIBRARY_PATH", lib_dir())
        .stdin(Stdio::null())
        .stdout(file.try_clone().expect("clone the file"))
        .stderr(file)
        .spawn_reaped();
    let (status, text) = wait_child(client, path, Duration::from_secs(30), "Debian rping -c");
    assert!(status.success(), "{text}");
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("ping data: rdma-ping-"))
            .count(),
        50,
        "{text}"
    );
    let r = server.join().expect("server thread");
    assert!(r.is_ok(), "Rust server: {r:?}");
}

#[test]
fn rust_rping_client_against_the_debian_rping_server() {
    let _serial = serial();
    let Some(rping) = debian_rping() else {
        return;
    };
    let port = free_port();
    let p = port.to_string();
    let (path, file) = out_file("server");
    let server = Command::new(&rping)
        .args(["-s", "-a", "127.0.0.1", "-p", &p, "-C", "50", "-S", "4096"])
        .env("LD_LIBRARY_PATH", lib_dir())
        .stdin(Stdio::null())
        .stdout(file.try_clone().expect("clone the file"))
        .stderr(file)
        .spawn_reaped();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !listening(port) {
        assert!(
            Instant::now() < deadline,
            "Debian rping -s is not listening"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let r = run_rust(&[
        "-c",
        "-a",
        "127.0.0.1",
        "-p",
        &p,
        "-C",
        "50",
        "-S",
        "4096",
        "-V",
    ]);
    let (status, text) = wait_child(server, path, Duration::from_secs(20), "Debian rping -s");
    assert!(r.is_ok(), "Rust client: {r:?}");
    assert!(status.success(), "{text}");
}
