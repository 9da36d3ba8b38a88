//! Local security of the control socket: the runtime directory is `0700`, the socket and
//! registry files `0600`, and a process of another user is refused twice over: by the file
//! modes at `connect`, and by the server's `SO_PEERCRED` check when the files were opened up
//! by mistake. A refused request (trace change, dump) changes nothing and leaves a
//! `control_refused` line in the error log.
//!
//! The other user is `nobody` (uid/gid 65534): a forked child drops to it with `setuid`
//! before it connects. That needs root; as any other user those tests print why they skip
//! (and fail under `CI=true`).

//! The child only makes raw system calls (no allocation, no lock) between `fork` and
//! `_exit`, so forking this multi-threaded test process is safe.

#![allow(clippy::unwrap_used, unsafe_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use softwarp_ras::control::{ControlServer, DefaultHandler, Reply};
use softwarp_ras::errlog::{self, CriticalKind, ErrorLog, ErrorLogConfig, LogLine};
use softwarp_ras::registry::{HostRegistry, ProcessEntry};
use softwarp_ras::trace;
use softwarp_testkit::{free_port, require, root};

use crate::common;

const NOBODY: u32 = 65534;
const WAIT: Duration = Duration::from_secs(10);

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

/// What the child running as another user saw.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// `connect` failed with this errno.
    ConnectFailed(i32),
    /// It connected, sent the request and read this until the server closed.
    Reply(Vec<u8>),
    /// The child could not become the other user (exit code).
    Setup(i32),
}

/// Forks a child that becomes `uid` (and gid `uid`), connects to the Unix socket `path`,
/// sends `request` and reads until the server closes; its findings come back over a pipe.
fn as_user(uid: u32, path: &Path, request: &[u8]) -> Outcome {
    use std::os::unix::ffi::OsStrExt;
    // Everything the child needs is prepared before the fork.
    // SAFETY: sockaddr_un is plain data; all zeros is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    assert!(bytes.len() < addr.sun_path.len(), "socket path too long");
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let mut reply = vec![0u8; 4096];
    let mut fds = [0i32; 2];
    // SAFETY: `fds` has room for the two descriptors pipe writes.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let (rd, wr) = (fds[0], fds[1]);
    // SAFETY: the child only calls async-signal-safe functions on memory prepared above,
    // then `_exit`s; it never returns into Rust code of this process.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: raw system calls on prepared memory (see above); every path ends in _exit.
        unsafe {
            libc::close(rd);
            let tag = |t: u8, v: i32| {
                let mut b = [t, 0, 0, 0, 0];
                b[1..].copy_from_slice(&v.to_le_bytes());
                libc::write(wr, b.as_ptr().cast(), b.len());
            };
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(uid) != 0
                || libc::setuid(uid) != 0
            {
                tag(b'S', 1);
                libc::_exit(1);
            }
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            if fd < 0 {
                tag(b'S', 2);
                libc::_exit(2);
            }
            let tv = libc::timeval {
                tv_sec: 5,
                tv_usec: 0,
            };
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            );
            let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
            if libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), len) != 0 {
                tag(b'C', *libc::__errno_location());
                libc::_exit(0);
            }
            libc::write(fd, request.as_ptr().cast(), request.len());
            let mut got = 0usize;
            while got < reply.len() {
                let n = libc::read(fd, reply.as_mut_ptr().add(got).cast(), reply.len() - got);
                if n <= 0 {
                    break;
                }
                got += n as usize;
            }
            tag(b'R', got as i32);
            libc::write(wr, reply.as_ptr().cast(), got);
            libc::_exit(0);
        }
    }
    // SAFETY: the parent's copy of the write end; the child holds its own.
    unsafe { libc::close(wr) };
    // SAFETY: `rd` is the pipe's read end, owned by this function from here on.
    let mut from_child = std::fs::File::from(unsafe {
        <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(rd)
    });
    let mut out = Vec::new();
    // The child's socket has a 5 s receive timeout, so this read ends.
    std::io::Read::read_to_end(&mut from_child, &mut out).unwrap();
    let mut status = 0;
    // SAFETY: waiting for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(out.len() >= 5, "the child reported nothing: {out:?}");
    let v = i32::from_le_bytes(out[1..5].try_into().unwrap());
    match out[0] {
        b'S' => Outcome::Setup(v),
        b'C' => Outcome::ConnectFailed(v),
        b'R' => Outcome::Reply(out[5..].to_vec()),
        t => panic!("unknown report {t}"),
    }
}

/// True (after printing why) when the test cannot run; panics instead under `CI=true`.
fn skip_unless_root(test: &str) -> bool {
    let why = format!("{test} switches to another user (uid {NOBODY})");
    !require(root(&why))
}

/// The process-wide error log of this test binary (set once). It outlives every test, so it
/// lives under Cargo's scratch directory for integration tests (`target/tmp`, emptied here at
/// the first use) rather than in a [`common::TempDir`] that a static would never drop.
fn error_log() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("control_security-errlog");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    });
    let path = dir.join("errors.jsonl");
    if errlog::global().is_none() {
        let _ = errlog::set_global(
            ErrorLog::open(ErrorLogConfig {
                path: path.clone(),
                ..ErrorLogConfig::in_dir(dir)
            })
            .unwrap(),
        );
    }
    errlog::global().unwrap().config().path.as_path()
}

fn refused_lines(log: &Path) -> Vec<LogLine> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<LogLine>(l).unwrap())
        .filter(|l| l.event == CriticalKind::ControlRefused)
        .collect()
}

#[test]
fn runtime_directory_registry_files_and_socket_admit_only_the_owner() {
    let parent = common::TempDir::new("perm");
    // Created by the registry: 0700 whatever the umask.
    let fresh = parent.path().join("rt");
    let reg = HostRegistry::open(&fresh).unwrap();
    assert_eq!(mode(&fresh), 0o700);
    // An existing directory of ours open to reading is closed.
    let loose = parent.path().join("loose");
    std::fs::create_dir(&loose).unwrap();
    std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o755)).unwrap();
    HostRegistry::open(&loose).unwrap();
    assert_eq!(mode(&loose), 0o700);
    // A directory others may write to is refused, and left as it is.
    let shared = parent.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let e = HostRegistry::open(&shared).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    assert_eq!(mode(&shared), 0o1777);

    let socket = reg.socket_path(std::process::id());
    let _server = ControlServer::start(&socket, Arc::new(DefaultHandler)).unwrap();
    assert_eq!(mode(&socket), 0o600);
    let entry = reg
        .register(&ProcessEntry::this_process(socket.clone()))
        .unwrap();
    assert_eq!(mode(entry.path()), 0o600);
}

#[test]
fn a_directory_of_another_user_is_refused() {
    if skip_unless_root("a_directory_of_another_user_is_refused") {
        return;
    }
    let parent = common::TempDir::new("other");
    let theirs = parent.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&theirs, Some(NOBODY), Some(NOBODY)).unwrap();
    let e = HostRegistry::open(&theirs).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    assert!(e.to_string().contains("belongs to uid 65534"), "{e}");
}

#[test]
fn another_user_cannot_even_connect_to_the_socket() {
    if skip_unless_root("another_user_cannot_even_connect_to_the_socket") {
        return;
    }
    let dir = common::TempDir::new("noconn");
    let reg = HostRegistry::open(dir.path()).unwrap();
    let socket = reg.socket_path(std::process::id());
    let server = ControlServer::start(&socket, Arc::new(DefaultHandler)).unwrap();
    let got = as_user(NOBODY, &socket, b"{\"op\":\"info\"}\n");
    assert_eq!(got, Outcome::ConnectFailed(libc::EACCES));
    assert_eq!(server.refused(), 0, "nothing reached the server");
}

#[test]
fn requests_of_another_user_are_refused_by_peer_credentials_and_logged() {
    if skip_unless_root("requests_of_another_user_are_refused_by_peer_credentials_and_logged") {
        return;
    }
    let log = error_log();
    let dir = common::TempDir::new("cred");
    let socket = dir.path().join("ctl.sock");
    let server = ControlServer::start(&socket, Arc::new(DefaultHandler)).unwrap();
    // Open the files up, as a mistaken chmod would: only the credential check is left.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();

    let before = trace::control().levels();
    let requests: [&[u8]; 3] = [
        b"{\"op\":\"trace-set\",\"spec\":\"default=9\"}\n",
        b"{\"op\":\"dump\"}\n",
        b"{\"op\":\"stats\"}\n",
    ];
    for (i, req) in requests.iter().enumerate() {
        let Outcome::Reply(bytes) = as_user(NOBODY, &socket, req) else {
            panic!("request {i}: the child could not talk to the server");
        };
        let text = String::from_utf8(bytes).unwrap();
        let line = text.lines().next().unwrap_or_default();
        let reply: Reply = serde_json::from_str(line).unwrap();
        assert!(!reply.ok, "{text}");
        let error = reply.error.unwrap();
        assert!(error.starts_with("permission denied"), "{error}");
        assert_eq!(
            text.lines().count(),
            1,
            "one refusal, no answer to the request: {text}"
        );
        assert_eq!(server.refused(), i as u64 + 1);
    }
    assert_eq!(
        trace::control().levels(),
        before,
        "the trace levels did not change"
    );

    // The owner (root here) is still served.
    let reply =
        softwarp_ras::control::request(&socket, &softwarp_ras::control::Request::TraceGet, WAIT)
            .unwrap();
    assert!(reply.ok, "{:?}", reply.error);

    // The first refusal is in the error log at once; the next two within a second of it are
    // counted on the following line.
    let lines = refused_lines(log);
    assert_eq!(lines.len(), 1, "{lines:?}");
    let detail = &lines[0].detail;
    assert!(detail.contains("uid 65534"), "{detail}");
    assert!(detail.contains(&socket.display().to_string()), "{detail}");
    std::thread::sleep(Duration::from_millis(1100));
    let deadline = Instant::now() + WAIT;
    let _ = as_user(NOBODY, &socket, b"{\"op\":\"info\"}\n");
    let lines = loop {
        let lines = refused_lines(log);
        if lines.len() >= 2 || Instant::now() > deadline {
            break lines;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(
        lines[1]
            .detail
            .contains("(2 earlier refusals since the last such line)"),
        "{:?}",
        lines[1]
    );
    assert_eq!(server.refused(), 4);
}

#[test]
fn the_metrics_endpoint_listens_on_loopback_unless_an_address_is_given() {
    use softwarp_ras::service::{start, ServiceConfig};
    assert_eq!(
        ServiceConfig::default().metrics_addr,
        None,
        "off by default"
    );
    let port = free_port();
    let config = ServiceConfig::from_lookup(|k| match k {
        "SOFTWARP_METRICS" => Some(port.to_string()),
        "SOFTWARP_CONTROL" | "SOFTWARP_ERRLOG" => Some("off".into()),
        _ => None,
    });
    let service = start(&config, Arc::new(DefaultHandler));
    assert!(service.problems().is_empty(), "{:?}", service.problems());
    let addr = service.metrics_addr().unwrap();
    assert_eq!(addr, std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    std::net::TcpStream::connect_timeout(&addr, WAIT).unwrap();
    // The bound address is the whole check: the tests use no address but loopback (or
    // namespaces they create), so another interface of the host is not tried.
}

#[test]
fn root_scans_every_users_directory_in_the_shared_base_and_skips_impostors() {
    if skip_unless_root("root_scans_every_users_directory_in_the_shared_base_and_skips_impostors") {
        return;
    }
    let base = common::TempDir::new("shared");
    std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let ours = HostRegistry::open(base.path().join("0"))
        .unwrap()
        .with_shared_base(base.path());
    // A live process of user 65534 registered in its own directory, and one in a directory
    // named after another uid but owned by 65534 (an impostor's). The processes are
    // 65534's: an entry counts only for a process of the user it names.
    let mut sleepers: Vec<std::process::Child> = (0..2)
        .map(|_| {
            use std::os::unix::process::CommandExt;
            std::process::Command::new("sleep")
                .arg("30")
                .uid(NOBODY)
                .gid(NOBODY)
                .spawn()
                .unwrap()
        })
        .collect();
    let place = |dir_name: &str, child: &std::process::Child| {
        let dir = base.path().join(dir_name);
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let mut entry = ProcessEntry::this_process(dir.join(format!("{}.sock", child.id())));
        entry.pid = child.id();
        entry.uid = NOBODY;
        entry.proc_start_ticks = None;
        let path = dir.join(format!("{}.json", child.id()));
        std::fs::write(&path, serde_json::to_vec(&entry).unwrap()).unwrap();
        for p in [&dir, &path] {
            std::os::unix::fs::chown(p, Some(NOBODY), Some(NOBODY)).unwrap();
        }
    };
    place(&NOBODY.to_string(), &sleepers[0]);
    place("1234", &sleepers[1]);
    let live: Vec<u32> = ours.scan().unwrap().live.iter().map(|e| e.pid).collect();
    for s in &mut sleepers {
        let _ = s.kill();
        let _ = s.wait();
    }
    assert!(live.contains(&sleepers[0].id()), "{live:?}");
    assert!(
        !live.contains(&sleepers[1].id()),
        "a directory named after uid 1234 but owned by 65534 is skipped: {live:?}"
    );
    // Without the shared base, root reads its own directory only.
    let alone = HostRegistry::open(base.path().join("0")).unwrap();
    assert_eq!(alone.scan_dirs(), vec![base.path().join("0")]);
}
