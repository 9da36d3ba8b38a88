//! `SOFTWARP_SOCKETS_PROTOCOL=rsocket`: programs preloaded with this library on one end,
//! Debian's `librspreload.so` (rdma-core 44) over Softwarp's librdmacm on the other (as
//! `softwarp exec` runs it: `libibverbs.so.1` and `librdmacm.so.1` on `LD_LIBRARY_PATH`),
//! in both roles, every byte checked. librspreload speaks only rsocket's protocol: a
//! connection that is not an rsocket's fails, so what arrives intact went over it.
//!
//! A missing program or library is a skip with its reason (a failure under `CI=true`). The
//! tests run one at a time (`serial`): each runs two iWARP stacks on a two-core machine.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use softwarp_testkit::{
    file, free_port, payload, require, serial, tool, wait_listening, Reaped, SpawnReaped,
};

const RSPRELOAD: &str = "/usr/lib/x86_64-linux-gnu/rsocket/librspreload.so";

/// The environment that makes this library speak rsocket on every TCP socket.
const RSOCKET: [(&str, &str); 2] = [
    ("SOFTWARP_SOCKETS", "all"),
    ("SOFTWARP_SOCKETS_PROTOCOL", "rsocket"),
];

fn have_rspreload() -> bool {
    require(file(
        Path::new(RSPRELOAD),
        "Debian's librspreload (apt-get install librdmacm1)",
    ))
}

/// A directory with `libibverbs.so.1` and `librdmacm.so.1`, links to Softwarp's C libraries
/// that cargo built beside this test (what `softwarp exec` puts on `LD_LIBRARY_PATH`).
fn lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let lib = softwarp_testkit::library("libsoftwarp_verbs.so")
            .expect("libsoftwarp_verbs.so (a dependency of this package, built before its tests)");
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("preload-rsocket-lib");
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

fn work_dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("work directory");
    d
}

fn command(program: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(program);
    c.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env_remove("SOFTWARP_RAS");
    c
}

/// `program` preloaded with this library, speaking rsocket.
fn ours(program: &Path, args: &[&str]) -> Command {
    let lib = softwarp_testkit::library("libsoftwarp_preload.so")
        .expect("libsoftwarp_preload.so (this package's library, built before its tests)");
    let mut c = command(program, args);
    c.env("LD_PRELOAD", lib).envs(RSOCKET);
    c
}

/// `program` under Debian's librspreload over Softwarp's librdmacm.
fn theirs(program: &Path, args: &[&str]) -> Command {
    let mut c = command(program, args);
    c.env("LD_PRELOAD", RSPRELOAD)
        .env("LD_LIBRARY_PATH", lib_dir());
    c
}

/// The program `name` on `PATH`, or `None` after a skip.
fn program(name: &str, package: &str) -> Option<PathBuf> {
    if !require(tool(name).package(package)) {
        return None;
    }
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .map(|p| p.join(name))
        .find(|p| p.is_file())
}

/// Waits at most `limit` for `child` and collects its output; kills it past that.
fn finish(child: Reaped, limit: Duration, what: &str) -> Output {
    let mut child = child.take();
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            return child.wait_with_output().expect("the output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("the output");
            panic!(
                "{what} did not finish within {limit:?}; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// socat's echo server (`EXEC:cat`) made by `server`, and a socat client made by `client`
/// that sends a 4 MiB file through it and writes what comes back to another: both exit 0
/// and the bytes are the same.
fn socat_echo(
    socat: &Path,
    dir: &Path,
    server: impl Fn(&Path, &[&str]) -> Command,
    client: impl Fn(&Path, &[&str]) -> Command,
    what: &str,
) {
    let sent = payload(4 << 20);
    let (input, output) = (dir.join("in.bin"), dir.join("out.bin"));
    std::fs::write(&input, &sent).expect("write the input");
    let _ = std::fs::remove_file(&output);
    let port = free_port();
    let mut srv = server(
        socat,
        &[&format!("TCP-LISTEN:{port},reuseaddr"), "EXEC:cat"],
    )
    .spawn_reaped();
    wait_listening(port, &mut srv);
    let cli = client(
        socat,
        &[
            &format!("OPEN:{}!!CREATE:{}", input.display(), output.display()),
            &format!("TCP:127.0.0.1:{port}"),
        ],
    )
    .spawn_reaped();
    let c = finish(cli, Duration::from_secs(90), "the socat client");
    let s = finish(srv, Duration::from_secs(30), "the socat server");
    assert!(
        c.status.success() && s.status.success(),
        "{what}: client {} server {}\nclient:\n{}\nserver:\n{}",
        c.status,
        s.status,
        text(&c.stderr),
        text(&s.stderr)
    );
    let back = std::fs::read(&output).unwrap_or_default();
    assert_eq!(back.len(), sent.len(), "{what}: bytes echoed");
    assert!(
        back == sent,
        "{what}: the echoed bytes differ from those sent"
    );
}

#[test]
fn socat_over_our_rsocket_protocol_reaches_librspreload_in_both_roles() {
    let _g = serial();
    let Some(socat) = program("socat", "socat") else {
        return;
    };
    if !have_rspreload() {
        return;
    }
    let dir = work_dir("rsocket-socat");
    socat_echo(
        &socat,
        &dir,
        theirs,
        ours,
        "our client, librspreload's server",
    );
    socat_echo(
        &socat,
        &dir,
        ours,
        theirs,
        "librspreload's client, our server",
    );
}

/// The number after `"key":` in iperf3's JSON, from `at` on.
fn json_number(json: &str, at: &str, key: &str) -> Option<f64> {
    let rest = &json[json.find(at)?..];
    let k = rest.find(&format!("\"{key}\":"))?;
    let v = rest[k + key.len() + 3..].trim_start();
    let end = v
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == 'e' || c == '+' || c == '-'))
        .unwrap_or(v.len());
    v[..end].parse().ok()
}

/// iperf3 (2 s, one stream, JSON): the server receives what the client sent but the last
/// buffers in flight, and both report the same total.
fn iperf3_run(
    iperf3: &Path,
    server: impl Fn(&Path, &[&str]) -> Command,
    client: impl Fn(&Path, &[&str]) -> Command,
    what: &str,
) {
    let port = free_port().to_string();
    let mut srv = server(iperf3, &["-s", "-1", "-J", "-p", &port]).spawn_reaped();
    wait_listening(port.parse().expect("port"), &mut srv);
    let cli = client(iperf3, &["-c", "127.0.0.1", "-t", "2", "-J", "-p", &port]).spawn_reaped();
    let c = finish(cli, Duration::from_secs(60), "the iperf3 client");
    let s = finish(srv, Duration::from_secs(20), "the iperf3 server");
    let (cout, sout) = (text(&c.stdout), text(&s.stdout));
    assert!(
        c.status.success() && s.status.success(),
        "{what}: client {} server {}\nclient:\n{cout}{}\nserver:\n{sout}{}",
        c.status,
        s.status,
        text(&c.stderr),
        text(&s.stderr)
    );
    let sent = json_number(&cout, "\"sum_sent\"", "bytes").expect("client sum_sent");
    let received = json_number(&cout, "\"sum_received\"", "bytes").expect("sum_received");
    let at_server = json_number(&sout, "\"sum_received\"", "bytes").expect("server sum_received");
    assert!(received > 0.0, "{what}: nothing received:\n{cout}");
    // The server stops reading when the client says the test is over, as over TCP: what
    // is still in the buffers then is not counted.
    assert!(
        received <= sent && sent - received <= f64::from(1 << 20),
        "{what}: sent {sent}, received {received}"
    );
    assert_eq!(
        received, at_server,
        "{what}: the client's and the server's totals"
    );
    eprintln!("iperf3, {what}: {received} bytes in 2 s");
}

#[test]
fn iperf3_over_our_rsocket_protocol_reaches_librspreload_in_both_roles() {
    let _g = serial();
    let Some(iperf3) = program("iperf3", "iperf3") else {
        return;
    };
    if !have_rspreload() {
        return;
    }
    iperf3_run(&iperf3, theirs, ours, "our client, librspreload's server");
    iperf3_run(&iperf3, ours, theirs, "librspreload's client, our server");
}

/// `tests/c/event_echo.c`: a non-blocking connect completed through `poll` and
/// `SO_ERROR`, `select`, an edge-triggered epoll loop (client); a non-blocking listener in
/// epoll, `accept4(SOCK_NONBLOCK)` until `EAGAIN`, a `poll` loop (server). First over plain
/// TCP (its checks are the kernel's behaviour), then with the rsocket protocol against socat
/// under librspreload in each role; the server also with its listener made non-blocking
/// after `listen` through `fcntl64` (`late`, as redis does: that listener stayed blocking
/// and its second accept waited for the next client).
#[test]
fn nonblocking_poll_and_epoll_programs_reach_librspreload() {
    let _g = serial();
    if !require(tool("cc").package("gcc")) {
        return;
    }
    let Some(socat) = program("socat", "socat") else {
        return;
    };
    if !have_rspreload() {
        return;
    }
    let dir = work_dir("rsocket-events");
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bin = dir.join("event_echo");
    let cc = Command::new("cc")
        // fcntl is fcntl64 then, as in Debian's redis.
        .args(["-O1", "-Wall", "-D_FILE_OFFSET_BITS=64", "-o"])
        .arg(&bin)
        .arg(manifest.join("tests/c/event_echo.c"))
        .output()
        .expect("run cc");
    assert!(cc.status.success(), "{}", text(&cc.stderr));
    let plain = |p: &Path, a: &[&str]| command(p, a);
    let total = 3_000_000usize;
    let bytes = total.to_string();
    for (name, server, client) in [
        (
            "plain TCP",
            &plain as &dyn Fn(&Path, &[&str]) -> Command,
            &plain as &dyn Fn(&Path, &[&str]) -> Command,
        ),
        ("rsocket", &theirs, &ours),
    ] {
        // The event-driven client against socat's echo server.
        let port = free_port();
        let mut srv = server(
            &socat,
            &[&format!("TCP-LISTEN:{port},reuseaddr"), "EXEC:cat"],
        )
        .spawn_reaped();
        wait_listening(port, &mut srv);
        let cli = client(&bin, &["client", "127.0.0.1", &port.to_string(), &bytes]).spawn_reaped();
        let c = finish(cli, Duration::from_secs(90), "event_echo client");
        let s = finish(srv, Duration::from_secs(30), "the socat server");
        assert!(
            c.status.success() && s.status.success(),
            "{name}, event_echo client: {} / socat {}\n{}\n{}",
            c.status,
            s.status,
            text(&c.stderr),
            text(&s.stderr)
        );
        assert_eq!(text(&c.stdout).trim(), format!("ok client {total}"));
    }
    let sent = payload(total);
    let (input, output) = (dir.join("in.bin"), dir.join("out.bin"));
    std::fs::write(&input, &sent).expect("write the input");
    for (name, server, client, late) in [
        (
            "plain TCP",
            &plain as &dyn Fn(&Path, &[&str]) -> Command,
            &plain as &dyn Fn(&Path, &[&str]) -> Command,
            true,
        ),
        ("rsocket", &ours, &theirs, false),
        ("rsocket, late", &ours, &theirs, true),
    ] {
        // The event-driven server echoing socat's file.
        let _ = std::fs::remove_file(&output);
        let port = free_port().to_string();
        let args: &[&str] = if late {
            &["server", &port, "late"]
        } else {
            &["server", &port]
        };
        let mut srv = server(&bin, args).spawn_reaped();
        let port: u16 = port.parse().expect("port");
        wait_listening(port, &mut srv);
        let cli = client(
            &socat,
            &[
                &format!("OPEN:{}!!CREATE:{}", input.display(), output.display()),
                &format!("TCP:127.0.0.1:{port}"),
            ],
        )
        .spawn_reaped();
        let c = finish(cli, Duration::from_secs(90), "the socat client");
        let s = finish(srv, Duration::from_secs(30), "event_echo server");
        assert!(
            c.status.success() && s.status.success(),
            "{name}, event_echo server: {} / socat {}\n{}\n{}",
            s.status,
            c.status,
            text(&s.stderr),
            text(&c.stderr)
        );
        assert_eq!(text(&s.stdout).trim(), format!("ok server {total}"));
        let back = std::fs::read(&output).unwrap_or_default();
        assert!(back == sent, "{name}: {} bytes back of {total}", back.len());
    }
}

/// redis-server preloaded with this library in rsocket mode (a non-blocking listener made
/// so after `listen` through `fcntl64`, accepted until `EAGAIN`, an epoll loop): redis-cli
/// and redis-benchmark preloaded the same way, then redis-cli under librspreload (hiredis
/// connects again once `poll` says writable: rsocket's `rconnect` must answer as rdma-core's,
/// or librspreload moves the socket to plain TCP). Before the `fcntl64` interposer the
/// server's second `accept4` slept in `raccept` and every client hung.
#[test]
fn redis_server_over_our_rsocket_protocol_serves_our_clients_and_librspreloads() {
    let _g = serial();
    let (Some(server), Some(cli), Some(bench)) = (
        program("redis-server", "redis-server"),
        program("redis-cli", "redis-tools"),
        program("redis-benchmark", "redis-tools"),
    ) else {
        return;
    };
    let port = free_port().to_string();
    let mut srv = ours(
        &server,
        &[
            "--port",
            &port,
            "--save",
            "",
            "--appendonly",
            "no",
            "--bind",
            "127.0.0.1",
        ],
    )
    .spawn_reaped();
    wait_listening(port.parse().expect("port"), &mut srv);
    let run = |mut c: Command, what: &str| {
        let out = finish(c.spawn_reaped(), Duration::from_secs(60), what);
        assert!(
            out.status.success(),
            "{what}: {}\n{}{}",
            out.status,
            text(&out.stdout),
            text(&out.stderr)
        );
        text(&out.stdout)
    };
    let value = "over-rsocket-".repeat(100);
    let set = run(
        ours(&cli, &["-p", &port, "set", "k", &value]),
        "redis-cli set",
    );
    assert_eq!(set.trim(), "OK");
    let get = run(ours(&cli, &["-p", &port, "get", "k"]), "redis-cli get");
    assert_eq!(get.trim(), value);
    let out = run(
        ours(
            &bench,
            &[
                "-p", &port, "-n", "2000", "-c", "4", "-P", "16", "-t", "set,get", "-q",
            ],
        ),
        "redis-benchmark",
    );
    let finals: Vec<&str> = out
        .split(['\r', '\n'])
        .filter(|l| l.contains("requests per second"))
        .collect();
    assert!(
        finals.iter().any(|l| l.trim_start().starts_with("SET"))
            && finals.iter().any(|l| l.trim_start().starts_with("GET")),
        "{out}"
    );
    eprintln!("redis-benchmark -P 16 over rsocket: {}", finals.join(" | "));
    if have_rspreload() {
        let get = run(
            theirs(&cli, &["-p", &port, "get", "k"]),
            "redis-cli under librspreload",
        );
        assert_eq!(get.trim(), value, "redis-cli under librspreload");
        let set = run(
            theirs(&cli, &["-p", &port, "set", "k2", "theirs"]),
            "redis-cli set under librspreload",
        );
        assert_eq!(set.trim(), "OK");
        let get = run(ours(&cli, &["-p", &port, "get", "k2"]), "redis-cli get k2");
        assert_eq!(get.trim(), "theirs");
    }
    // A graceful stop (SIGTERM) lets the server close its rsockets.
    let _ = Command::new("kill")
        .args(["-TERM", &srv.id().to_string()])
        .status();
    let out = finish(srv, Duration::from_secs(30), "redis-server");
    assert!(out.status.success(), "redis-server: {}", out.status);
}
