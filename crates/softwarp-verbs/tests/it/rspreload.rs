//! Debian's `librspreload.so` (rdma-core 44, package `librdmacm1`) over this crate's
//! librdmacm, as `softwarp exec -- env LD_PRELOAD=.../librspreload.so PROGRAM` runs it:
//! unmodified socat and iperf3 with every TCP socket an rsocket on both ends, the bytes
//! checked. A missing program or library is a skip with its reason (a failure under
//! `CI=true`, where `.ci/run` installs them).
//!
//! Every server is killed and reaped when its test ends, also when it panics ([`Reaped`]).
//! The tests run one at a time (`serial`, with the other modules of this binary): the machine
//! has two cores.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use softwarp_testkit::{
    free_port, payload, serial, skip, wait_listening, wait_listening_in, Reaped,
};

use super::debian_tools::finish_in;

const RSPRELOAD: &str = "/usr/lib/x86_64-linux-gnu/rsocket/librspreload.so";

/// The directory holding `libibverbs.so.1` and `librdmacm.so.1`, links to the library cargo
/// built beside this test (what `softwarp exec` puts on `LD_LIBRARY_PATH`).
fn lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("test executable path");
        let deps = exe.parent().expect("target/<profile>/deps");
        let lib = deps.join("libsoftwarp_verbs.so");
        assert!(lib.exists(), "{} not built", lib.display());
        let dir = deps
            .parent()
            .expect("target/<profile>")
            .join("softwarp-verbs-rspreload-lib");
        std::fs::create_dir_all(&dir).expect("create the library directory");
        for name in ["libibverbs.so.1", "librdmacm.so.1"] {
            // A new link renamed over the old one: atomic for concurrent test runs.
            let tmp = dir.join(format!("{name}.{}", std::process::id()));
            let _ = std::fs::remove_file(&tmp);
            std::os::unix::fs::symlink(&lib, &tmp).expect("link the library");
            std::fs::rename(&tmp, dir.join(name)).expect("place the link");
        }
        dir
    })
}

/// The installed program `name` and librspreload, or `None` after [`skip`].
fn tool(name: &str, package: &str) -> Option<PathBuf> {
    if !Path::new(RSPRELOAD).exists() {
        skip(format!(
            "{RSPRELOAD} is not installed (apt-get install librdmacm1)"
        ));
        return None;
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(name))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        skip(format!(
            "{name} is not installed (apt-get install {package})"
        ));
    }
    found
}

/// `program` over this library with librspreload preloaded.
fn preloaded(program: &Path) -> Command {
    let mut c = Command::new(program);
    c.env("LD_LIBRARY_PATH", lib_dir())
        .env("LD_PRELOAD", RSPRELOAD)
        .env_remove("SOFTWARP_RAS")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// socat's echo server (`EXEC:cat`) and a client that sends a file through it and writes
/// what comes back to another, both preloaded: 4 MiB out and back, byte for byte, and both
/// ends exit 0. (The client reads a file: socat calls `recv` before any other socket call,
/// which librspreload 44 does not look up on its own; the library makes it at load, see
/// `rsocket/mod.rs`.)
#[test]
fn socat_echo_through_librspreload_on_both_ends_returns_every_byte() {
    let _g = serial();
    let Some(socat) = tool("socat", "socat") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("softwarp-rspreload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let sent = payload(4 << 20);
    let port = free_port();
    let mut server = Reaped::spawn(
        preloaded(&socat).args([&format!("TCP-LISTEN:{port},reuseaddr"), "EXEC:cat"]),
        "the socat echo server",
    );
    wait_listening(port, &mut server);
    let back = echo(
        &socat,
        &dir,
        &sent,
        &format!("TCP:127.0.0.1:{port}"),
        &mut server,
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(back.len(), sent.len(), "bytes echoed");
    assert!(back == sent, "the echoed bytes differ from those sent");
}

/// Sends `sent` from a file in `dir` through the echo server `server` at socat's address
/// `to` with a preloaded socat client; both must exit 0. What came back.
fn echo(socat: &Path, dir: &Path, sent: &[u8], to: &str, server: &mut Reaped) -> Vec<u8> {
    let (input, output) = (dir.join("in.bin"), dir.join("out.bin"));
    std::fs::write(&input, sent).expect("write the input");
    let _ = std::fs::remove_file(&output);
    let mut client = Reaped::spawn(
        preloaded(socat).args([
            &format!("OPEN:{}!!CREATE:{}", input.display(), output.display()),
            to,
        ]),
        "the socat client",
    );
    let c = finish_in(&mut client, Duration::from_secs(60), "socat client");
    let s = finish_in(server, Duration::from_secs(20), "socat server");
    assert!(
        c.status.success() && s.status.success(),
        "{to}: client {} server {}\nclient:\n{}\nserver:\n{}",
        c.status,
        s.status,
        c.stderr,
        s.stderr
    );
    std::fs::read(&output).unwrap_or_default()
}

/// An IPv4 listener and an IPv6-only one (`IPV6_V6ONLY`, which rsocket passes on to the
/// bind as rdma_cm's `AFONLY`) on one port, as redis-server listens: both bind and listen,
/// and each echoes its own client's bytes.
#[test]
fn socat_ipv4_and_ipv6_only_rsocket_listeners_share_a_port() {
    let _g = serial();
    let Some(socat) = tool("socat", "socat") else {
        return;
    };
    if !std::fs::read_to_string("/proc/net/if_inet6").is_ok_and(|t| !t.is_empty()) {
        return skip("the host has no IPv6");
    }
    let dir = std::env::temp_dir().join(format!("softwarp-rspreload6-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let port = free_port();
    let mut v4 = Reaped::spawn(
        preloaded(&socat).args([&format!("TCP4-LISTEN:{port},reuseaddr"), "EXEC:cat"]),
        "the IPv4 echo server",
    );
    wait_listening_in(&["/proc/net/tcp"], port, &mut v4);
    let mut v6 = Reaped::spawn(
        preloaded(&socat).args([
            &format!("TCP6-LISTEN:{port},ipv6only=1,reuseaddr"),
            "EXEC:cat",
        ]),
        "the IPv6 echo server",
    );
    wait_listening_in(&["/proc/net/tcp6"], port, &mut v6);
    let (a, b) = (payload(100_000), payload(70_000));
    let back6 = echo(&socat, &dir, &b, &format!("TCP6:[::1]:{port}"), &mut v6);
    let back4 = echo(&socat, &dir, &a, &format!("TCP4:127.0.0.1:{port}"), &mut v4);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        back4 == a,
        "IPv4: {} bytes back of {}",
        back4.len(),
        a.len()
    );
    assert!(
        back6 == b,
        "IPv6: {} bytes back of {}",
        back6.len(),
        b.len()
    );
}

/// The number after `"key":` in iperf3's JSON, from `at` on.
fn json_number(json: &str, at: &str, key: &str) -> Option<f64> {
    let from = json.find(at)?;
    let rest = &json[from..];
    let k = rest.find(&format!("\"{key}\":"))?;
    let v = rest[k + key.len() + 3..].trim_start();
    let end = v
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == 'e' || c == '+' || c == '-'))
        .unwrap_or(v.len());
    v[..end].parse().ok()
}

/// iperf3 server and client (2 s, one stream, JSON) both preloaded: the server receives
/// what the client sent but the last buffers in flight, and both report the same total.
#[test]
fn iperf3_through_librspreload_on_both_ends_receives_what_was_sent() {
    let _g = serial();
    let Some(iperf3) = tool("iperf3", "iperf3") else {
        return;
    };
    let port = free_port();
    let mut server = Reaped::spawn(
        preloaded(&iperf3).args(["-s", "-1", "-J", "-p", &port.to_string()]),
        "the iperf3 server",
    );
    wait_listening(port, &mut server);
    let mut client = Reaped::spawn(
        preloaded(&iperf3).args(["-c", "127.0.0.1", "-t", "2", "-J", "-p", &port.to_string()]),
        "the iperf3 client",
    );
    let c = finish_in(&mut client, Duration::from_secs(60), "iperf3 client");
    let s = finish_in(&mut server, Duration::from_secs(20), "iperf3 server");
    assert!(
        c.status.success() && s.status.success(),
        "client {} server {}\nclient:\n{}{}\nserver:\n{}{}",
        c.status,
        s.status,
        c.stdout,
        c.stderr,
        s.stdout,
        s.stderr
    );
    let sent = json_number(&c.stdout, "\"sum_sent\"", "bytes").expect("client sum_sent");
    let received = json_number(&c.stdout, "\"sum_received\"", "bytes").expect("sum_received");
    let at_server =
        json_number(&s.stdout, "\"sum_received\"", "bytes").expect("server sum_received");
    assert!(received > 0.0, "nothing received:\n{}", c.stdout);
    // The server stops reading when the client says the test is over, as over TCP: what is
    // still in the socket buffers then (at most both ends' buffers and a write) is sent and
    // not counted.
    assert!(
        received <= sent && sent - received <= f64::from(1 << 20),
        "sent {sent}, received {received}"
    );
    assert_eq!(received, at_server, "the client's and the server's totals");
}
