//! Debian's unmodified rdma-core programs (`ibverbs-utils`, `rdmacm-utils`) run over this
//! crate's `libibverbs.so.1`/`librdmacm.so.1` on loopback, their output checked. A test
//! whose program is not installed says so and passes (CI installs them: `.ci/run`).
//!
//! Every child process runs under a deadline and is killed past it.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The directory holding `libibverbs.so.1` and `librdmacm.so.1`: links to the library cargo
/// built next to this test's binary (`target/<profile>/libsoftwarp_verbs.so`).
fn lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("test executable path");
        let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>");
        let lib = profile_dir.join("libsoftwarp_verbs.so");
        assert!(lib.exists(), "{} not built", lib.display());
        let dir = profile_dir.join("softwarp-verbs-lib");
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

/// The installed program `name`, or `None` after saying why the test is skipped.
fn tool(name: &str, package: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(name))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        println!("skipped: {name} is not installed (apt-get install {package})");
    }
    found
}

fn command(program: &Path) -> Command {
    let mut c = Command::new(program);
    c.env("LD_LIBRARY_PATH", lib_dir())
        .env_remove("SOFTWARP_RAS")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

struct Output {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

/// Waits for `child` at most `limit`, killing it past that; collects its output.
fn finish(mut child: Child, limit: Duration, what: &str) -> Output {
    let mut out = child.stdout.take().expect("piped stdout");
    let mut err = child.stderr.take().expect("piped stderr");
    let o = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let e = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for the child") {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let (o, e) = (o.join().unwrap_or_default(), e.join().unwrap_or_default());
            panic!("{what} did not finish within {limit:?}\nstdout:\n{o}\nstderr:\n{e}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: o.join().unwrap_or_default(),
        stderr: e.join().unwrap_or_default(),
    }
}

/// A TCP port that was free a moment ago.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind an ephemeral port")
        .port()
}

/// True once something listens on 127.0.0.1:`port` (from `/proc/net/tcp`, without
/// connecting: a bare TCP connection would be a malformed MPA peer to the listener).
fn listening(port: u16) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return false;
    };
    let want = format!("0100007F:{port:04X}");
    let any = format!("00000000:{port:04X}");
    table.lines().skip(1).any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() > 3 && (f[1] == want || f[1] == any) && f[3] == "0A"
    })
}

fn wait_listening(port: u16, server: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !listening(port) {
        if let Ok(Some(st)) = server.try_wait() {
            panic!("the server exited before listening: {st}");
        }
        assert!(Instant::now() < deadline, "no listener on port {port} after 10 s");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn ibv_devinfo_shows_softwarp0_active_on_ethernet() {
    let Some(devinfo) = tool("ibv_devinfo", "ibverbs-utils") else {
        return;
    };
    let list = finish(
        command(&devinfo).arg("-l").spawn().expect("run ibv_devinfo -l"),
        Duration::from_secs(20),
        "ibv_devinfo -l",
    );
    assert!(list.status.success(), "{}", list.stderr);
    assert!(list.stdout.contains("1 HCA found:"), "{}", list.stdout);
    assert!(list.stdout.contains("\tsoftwarp0"), "{}", list.stdout);

    let out = finish(
        command(&devinfo).arg("-v").spawn().expect("run ibv_devinfo -v"),
        Duration::from_secs(20),
        "ibv_devinfo -v",
    );
    assert!(out.status.success(), "exit {}: {}", out.status, out.stderr);
    let s = &out.stdout;
    for expected in [
        "hca_id:\tsoftwarp0",
        "transport:\t\t\tiWARP (1)",
        "fw_ver:\t\t\t\t0.1.0",
        "max_qp_wr:\t\t\t4096",
        "max_sge:\t\t\t8",
        "max_qp_rd_atom:\t\t\t128",
        "phys_port_cnt:\t\t\t1",
        "state:\t\t\tPORT_ACTIVE (4)",
        "link_layer:\t\tEthernet",
        "gid_tbl_len:\t\t1",
    ] {
        assert!(s.contains(expected), "missing {expected:?} in:\n{s}");
    }
    // The GID is the link-local address of the first interface that is up, when there is
    // one (a network namespace with only `lo` has none).
    let has_interface = std::fs::read_dir("/sys/class/net")
        .map(|d| {
            d.filter_map(|e| e.ok()).any(|e| {
                let n = e.file_name();
                n != "lo"
                    && std::fs::read_to_string(e.path().join("operstate"))
                        .is_ok_and(|s| s.trim() == "up")
            })
        })
        .unwrap_or(false);
    if has_interface {
        assert!(s.contains("GID[  0]:\t\tfe80:0000:0000:0000:"), "{s}");
    }
}

/// What rping's client prints with `-v` for ping `n` of `size` bytes: the message it sent,
/// read back by the server and written into the client's buffer.
fn rping_line(n: usize, size: usize) -> String {
    let mut buf = format!("rdma-ping-{n}: ").into_bytes();
    buf.truncate(size);
    let mut c = 65 + (n % 58) as u8;
    while buf.len() < size {
        buf.push(c);
        c = if c >= 122 { 65 } else { c + 1 };
    }
    buf.truncate(size - 1); // the last byte is the terminating NUL
    format!("ping data: {}", String::from_utf8(buf).expect("ASCII"))
}

fn rping_pair(rping: &Path, size: usize, count: usize) {
    let port = free_port().to_string();
    let size_s = size.to_string();
    let count_s = count.to_string();
    let mut server = command(rping)
        .args(["-s", "-a", "127.0.0.1", "-p", &port, "-C", &count_s, "-S", &size_s])
        .spawn()
        .expect("start rping -s");
    wait_listening(port.parse().expect("port"), &mut server);
    let client = command(rping)
        .args(["-c", "-a", "127.0.0.1", "-p", &port, "-C", &count_s, "-S", &size_s, "-v", "-V"])
        .spawn()
        .expect("start rping -c");
    let c = finish(client, Duration::from_secs(30), "rping -c");
    let s = finish(server, Duration::from_secs(10), "rping -s");
    assert!(c.status.success(), "client exit {}:\n{}\n{}", c.status, c.stdout, c.stderr);
    assert!(s.status.success(), "server exit {}:\n{}\n{}", s.status, s.stdout, s.stderr);
    let lines: Vec<&str> = c.stdout.lines().collect();
    assert_eq!(lines.len(), count, "size {size}: {}", c.stdout);
    for (n, line) in lines.iter().enumerate() {
        assert_eq!(*line, rping_line(n, size), "size {size}, ping {n}");
    }
    assert!(!c.stderr.contains("data mismatch"), "{}", c.stderr);
}

#[test]
fn rping_100_pings_validated_from_26_bytes_to_64k_minus_1() {
    let Some(rping) = tool("rping", "rdmacm-utils") else {
        return;
    };
    let started = Instant::now();
    for size in [26, 1000, 4096, 65535] {
        rping_pair(&rping, size, 100);
    }
    println!("rping: 4 sizes x 100 pings in {:?}", started.elapsed());
}

#[test]
fn rping_client_without_server_is_rejected_with_econnrefused() {
    let Some(rping) = tool("rping", "rdmacm-utils") else {
        return;
    };
    let port = free_port().to_string();
    let c = finish(
        command(&rping)
            .args(["-c", "-a", "127.0.0.1", "-p", &port, "-C", "1"])
            .spawn()
            .expect("start rping -c"),
        Duration::from_secs(20),
        "rping -c without a server",
    );
    assert!(!c.status.success(), "{}", c.stdout);
    assert!(
        c.stderr.contains("RDMA_CM_EVENT_REJECTED, error -111"),
        "stderr: {}",
        c.stderr
    );
}
