//! What a device recovery believes, run as root against another local user (issue 32):
//!
//! - a user (uid 65534) registers a real process of theirs whose control socket answers
//!   `fault-status` with fake holders: one naming a process of a third user (a `sleep` of
//!   uid 65533, "rping" in the reply, and another of them) and one naming the liar itself;
//!   it also writes registry
//!   entries naming the third user's process, pid 1 and root's own process. Root's recovery,
//!   with every one of those names on its terminate list, signals nothing, and its device,
//!   which has no holders of its own, recovers at once instead of timing out;
//! - 4,096 hostile entries (silent processes of root and of 65534 that accept and never
//!   answer, entries naming every other live pid of the host, entries of dead pids) do not
//!   stretch a recovery bounded at 1,000 ms;
//! - an entry whose control socket is a root-only socket in a `0700` directory, named
//!   directly or through a symbolic link at the registry's own path, is never connected to,
//!   neither by the recovery nor by the CLI's path (`query_all`).
//!
//! The other users' processes are this test binary run again as a helper
//! (`helper_process`, selected by `SWT_HELPER`) under their uid, or `sleep`; a guard kills
//! and reaps them even when a test panics, and each helper ends by itself after 60 s (and
//! when the test thread that started it ends: `PR_SET_PDEATHSIG`). The tests need root:
//! they print why they skip otherwise, and fail when `CI=true`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, unsafe_code)]

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use softwarp_ras::control::{self, ControlHandler, ControlServer, FaultStatusResult, Request};
use softwarp_ras::health::{
    self, DeviceHealthReport, DeviceState, RecoveryConfig, RecoveryOutcome, RecoveryReport,
    RecoverySubject,
};
use softwarp_ras::registry::{HostRegistry, ProcessEntry};
use softwarp_ras::tracker::{ResourceInfo, ResourceKind, Tracker};
use softwarp_testkit::{require, root, Reaped, SpawnReaped};

use crate::common;

const NOBODY: u32 = 65534;
const THIRD: u32 = 65533;
const HELPER_ENV: &str = "SWT_HELPER";
/// The device every process here reports (name, no interface).
const SCOPE: &str = "trust-unit";
/// How long a helper lives at most.
const HELPER_LIFE: Duration = Duration::from_secs(60);

/// True (after printing why) when the test cannot run; panics instead under `CI=true`.
fn skip_unless_root(test: &str) -> bool {
    let why = format!("{test} switches to uids {NOBODY} and {THIRD}");
    !require(root(&why))
}

// ---------------------------------------------------------------------------------------
// The helper processes
// ---------------------------------------------------------------------------------------

/// The fake `fault-status`: a failed device of [`SCOPE`] whose holders are `claims`.
struct Liar(Vec<ResourceInfo>);

impl ControlHandler for Liar {
    fn fault_status(&self) -> FaultStatusResult {
        FaultStatusResult {
            devices: vec![DeviceHealthReport {
                device: format!("{SCOPE}/1"),
                name: SCOPE.into(),
                interface: None,
                state: DeviceState::Failed,
                fault: None,
                recovery: None,
                holders: self.0.clone(),
            }],
        }
    }
}

fn env_path(name: &str) -> PathBuf {
    PathBuf::from(std::env::var_os(name).unwrap())
}

/// A registry entry of pid `pid` claiming uid `uid` and naming `socket`, written by this
/// process (so owned by its user) as `<dir>/<pid>.json`.
fn write_entry(dir: &Path, pid: u32, uid: u32, socket: &Path) {
    let mut e = ProcessEntry::this_process(socket.to_path_buf());
    e.pid = pid;
    e.uid = uid;
    e.proc_start_ticks = None;
    e.name = "rping".into();
    std::fs::write(
        dir.join(format!("{pid}.json")),
        serde_json::to_vec(&e).unwrap(),
    )
    .unwrap();
}

/// The helper side: does what `SWT_HELPER` says in `SWT_DIR`, prints `READY`, and lives
/// until killed (at most [`HELPER_LIFE`]).
#[test]
fn helper_process() {
    let Ok(mode) = std::env::var(HELPER_ENV) else {
        return;
    };
    // SAFETY: prctl with two integer arguments; no memory is passed.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let dir = env_path("SWT_DIR");
    let me = std::process::id();
    let reg = HostRegistry::open(&dir).unwrap();
    let own = reg.socket_path(me);
    let mut keep: Vec<Box<dyn std::any::Any>> = Vec::new();
    let mut silent: Option<UnixListener> = None;
    match mode.as_str() {
        // A process that accepts and never answers.
        "silent" => {
            let l = UnixListener::bind(&own).unwrap();
            l.set_nonblocking(true).unwrap();
            silent = Some(l);
            keep.push(Box::new(
                reg.register(&ProcessEntry::this_process(own)).unwrap(),
            ));
        }
        // A process that lies: holders in other processes, and entries for other pids.
        "liar" => {
            let victim: u32 = std::env::var("SWT_VICTIM").unwrap().parse().unwrap();
            let victim2: u32 = std::env::var("SWT_VICTIM2").unwrap().parse().unwrap();
            let root_pid: u32 = std::env::var("SWT_ROOT_PID").unwrap().parse().unwrap();
            let tracker = Tracker::new("liar");
            let held = tracker.register(ResourceKind::Qp, 1, 0);
            let mut claims = Vec::new();
            for (pid, name) in [(victim, "rping"), (victim2, "sleep"), (me, "rping")] {
                let mut info = tracker.resources().remove(0);
                info.pid = pid;
                info.process = name.into();
                claims.push(info);
            }
            drop(held);
            let server = ControlServer::start(&own, Arc::new(Liar(claims))).unwrap();
            keep.push(Box::new(server));
            keep.push(Box::new(
                reg.register(&ProcessEntry::this_process(own.clone()))
                    .unwrap(),
            ));
            write_entry(&dir, victim, THIRD, &own);
            write_entry(&dir, 1, 0, &own);
            write_entry(&dir, root_pid, NOBODY, &own);
        }
        // An entry of this process naming another socket.
        "pointer" => write_entry(&dir, me, NOBODY, &env_path("SWT_TARGET")),
        // The registry's own path for this process, a symbolic link to another socket.
        "link" => {
            std::os::unix::fs::symlink(env_path("SWT_TARGET"), &own).unwrap();
            keep.push(Box::new(
                reg.register(&ProcessEntry::this_process(own)).unwrap(),
            ));
        }
        other => panic!("unknown helper mode {other}"),
    }
    println!("READY");
    let mut accepted = Vec::new();
    let end = Instant::now() + HELPER_LIFE;
    while Instant::now() < end {
        if let Some(l) = &silent {
            while let Ok((s, _)) = l.accept() {
                accepted.push(s);
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    drop((keep, accepted));
}

/// Processes started by a test: killed and reaped when dropped, even on a panic.
#[derive(Default)]
struct Procs(Vec<Reaped>);

impl Procs {
    fn alive(&mut self, pid: u32) -> bool {
        self.0
            .iter_mut()
            .find(|c| c.id() == pid)
            .is_some_and(|c| c.try_wait().unwrap().is_none())
    }

    /// Starts a helper in `mode` as `uid` (`None`: as this process) and waits for it to be
    /// ready; returns its pid.
    fn helper(&mut self, mode: &str, uid: Option<u32>, env: &[(&str, &str)]) -> u32 {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "recovery_trust::helper_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HELPER_ENV, mode)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        if let Some(uid) = uid {
            cmd.uid(uid).gid(uid);
        }
        let mut child = cmd.spawn_reaped();
        let out = child.stdout.take().unwrap();
        let pid = child.id();
        self.0.push(child);
        // Bounded: the helper ends within HELPER_LIFE, which ends the output.
        let ready = BufReader::new(out)
            .lines()
            .map_while(Result::ok)
            .any(|l| l.contains("READY"));
        assert!(ready, "helper {mode} (pid {pid}) ended before it was ready");
        pid
    }

    /// `sleep` as `uid`.
    fn sleeper(&mut self, uid: u32) -> u32 {
        let child = Command::new("sleep")
            .arg("60")
            .uid(uid)
            .gid(uid)
            .spawn_reaped();
        let pid = child.id();
        self.0.push(child);
        pid
    }
}

// ---------------------------------------------------------------------------------------
// The recovering side (root)
// ---------------------------------------------------------------------------------------

/// A shared base with root's directory (`0`) and 65534's (owned by it, `0700`); root's
/// registry reads both.
struct Layout {
    _base: common::TempDir,
    reg: HostRegistry,
    user_dir: PathBuf,
}

fn layout(tag: &str) -> Layout {
    let base = common::TempDir::new(tag);
    std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let reg = HostRegistry::open(base.path().join("0"))
        .unwrap()
        .with_shared_base(base.path());
    let user_dir = base.path().join(NOBODY.to_string());
    std::fs::create_dir(&user_dir).unwrap();
    std::fs::set_permissions(&user_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&user_dir, Some(NOBODY), Some(NOBODY)).unwrap();
    Layout {
        _base: base,
        reg,
        user_dir,
    }
}

/// Root's failed device: its own holders are `tracker`'s.
struct Subject(Tracker);

impl RecoverySubject for Subject {
    fn local_holders(&self) -> Vec<ResourceInfo> {
        self.0.resources()
    }
    fn scope(&self) -> (String, Option<String>) {
        (SCOPE.into(), None)
    }
    fn progress(&self, _: &RecoveryReport) {}
}

/// Runs a recovery on a thread of its own and waits at most `limit` for it (a recovery
/// that does not respect its bound fails the test instead of hanging it).
fn recover_within(
    subject: Arc<Subject>,
    config: RecoveryConfig,
    reg: &HostRegistry,
    limit: Duration,
) -> (RecoveryReport, Duration) {
    let (tx, rx) = std::sync::mpsc::channel();
    let reg = reg.clone();
    let t = Instant::now();
    std::thread::spawn(move || {
        let r = health::recover(&*subject, &config, Some(&reg));
        let _ = tx.send((r, t.elapsed()));
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("the recovery did not end within {limit:?}"))
}

fn config(bound_ms: u64, terminate: &[&str]) -> RecoveryConfig {
    let mut c = RecoveryConfig::default();
    c.bound = Duration::from_millis(bound_ms);
    c.release_wait = Duration::ZERO;
    c.grace = Duration::from_millis(50);
    c.poll = Duration::from_millis(5);
    c.terminate = terminate.iter().map(|s| s.to_string()).collect();
    c
}

fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap()
        .trim()
        .to_string()
}

#[test]
fn another_users_fake_holders_neither_get_a_third_user_signalled_nor_keep_roots_device_failed() {
    let test = "another_users_fake_holders_neither_get_a_third_user_signalled_nor_keep_roots_device_failed";
    if skip_unless_root(test) {
        return;
    }
    let l = layout("liar");
    let mut procs = Procs::default();
    let victim = procs.sleeper(THIRD);
    let victim2 = procs.sleeper(THIRD);
    let dir = l.user_dir.to_str().unwrap();
    let (v, v2) = (victim.to_string(), victim2.to_string());
    let me = std::process::id().to_string();
    let liar = procs.helper(
        "liar",
        Some(NOBODY),
        &[
            ("SWT_DIR", dir),
            ("SWT_VICTIM", &v),
            ("SWT_VICTIM2", &v2),
            ("SWT_ROOT_PID", &me),
        ],
    );
    let liar_comm = comm(liar);
    // Every name involved is on the terminate list: only the kernel's facts protect them.
    // (No claim names a process of the host outside this test: run against a recovery
    // that believes replies, this test must harm nothing but its own processes.)
    let terminate = ["rping", "sleep", liar_comm.as_str()];
    let subject = Arc::new(Subject(Tracker::new("trust-liar")));
    let (r, took) = recover_within(
        subject,
        config(3000, &terminate),
        &l.reg,
        Duration::from_secs(20),
    );
    println!(
        "{test}: {:?} in {} ms ({took:?}); foreign holders {:?}; rejected {:#?}",
        r.outcome,
        r.elapsed_ms,
        r.foreign_holders
            .iter()
            .map(|h| (h.pid, h.process.as_str()))
            .collect::<Vec<_>>(),
        r.rejected
    );
    assert!(r.terminated.is_empty(), "signals were sent: {r:?}");
    assert!(
        procs.alive(victim),
        "the third user's process was signalled"
    );
    assert!(
        procs.alive(victim2),
        "the third user's process was signalled"
    );
    assert!(procs.alive(liar), "the other user's process was signalled");
    assert_eq!(r.outcome, RecoveryOutcome::Recovered, "{r:?}");
    assert!(r.holders.is_empty(), "{r:?}");
    assert!(took < Duration::from_millis(1000), "not at once: {took:?}");
    // The liar's claim about itself is reported, under its kernel name; the others are
    // rejected, and so are the entries it wrote for other users' pids.
    assert!(
        r.foreign_holders
            .iter()
            .all(|h| h.pid == liar && h.process == liar_comm),
        "{r:?}"
    );
    assert!(!r.foreign_holders.is_empty(), "{r:?}");
    let rejected = r.rejected.join("\n");
    for pid in [victim, victim2] {
        assert!(
            rejected.contains(&format!("named a holder in pid {pid} ")),
            "{rejected}"
        );
    }
    for pid in [victim, 1, std::process::id()] {
        assert!(
            rejected.contains(&format!("{}/{pid}.json skipped", l.user_dir.display())),
            "{rejected}"
        );
    }
}

/// Pids of running processes of the host that are not `uid`'s.
fn live_pids_not_of(uid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(format!("/proc/{pid}")).is_ok_and(|m| m.uid() != uid)
        })
        .collect()
}

#[test]
fn a_recovery_bounded_at_1000_ms_ends_on_time_with_4096_hostile_entries() {
    let test = "a_recovery_bounded_at_1000_ms_ends_on_time_with_4096_hostile_entries";
    if skip_unless_root(test) {
        return;
    }
    const ENTRIES: usize = 4096;
    const SILENT: usize = 24;
    let l = layout("bound");
    let mut procs = Procs::default();
    let root_dir = l.reg.dir().to_str().unwrap().to_string();
    let user_dir = l.user_dir.to_str().unwrap().to_string();
    // Silent processes of root (the recovering user: their answers are waited for) and of
    // 65534; more of each than requests in flight at once.
    for _ in 0..SILENT {
        procs.helper("silent", None, &[("SWT_DIR", &root_dir)]);
    }
    let mut silent_sockets = Vec::new();
    for _ in 0..SILENT {
        let pid = procs.helper("silent", Some(NOBODY), &[("SWT_DIR", &user_dir)]);
        silent_sockets.push(l.user_dir.join(format!("{pid}.sock")));
    }
    // Every other live pid of the host, then dead pids, up to 4,096 entries, each naming a
    // silent socket.
    let mut pids = live_pids_not_of(NOBODY);
    let live_named = pids.len();
    let mut dead = 4_000_000u32;
    while pids.len() + 2 * SILENT < ENTRIES {
        if !Path::new(&format!("/proc/{dead}")).exists() {
            pids.push(dead);
        }
        dead += 1;
    }
    for (i, pid) in pids.iter().enumerate() {
        let socket = &silent_sockets[i % silent_sockets.len()];
        write_entry(&l.user_dir, *pid, NOBODY, socket);
        std::os::unix::fs::chown(
            l.user_dir.join(format!("{pid}.json")),
            Some(NOBODY),
            Some(NOBODY),
        )
        .unwrap();
    }
    let t = Instant::now();
    let scan = l.reg.scan().unwrap();
    let scanned = t.elapsed();
    println!(
        "{test}: {} entries: {SILENT} silent processes of root and of {NOBODY} each, \
         {live_named} entries naming live pids of other users, the rest dead pids; one \
         scan took {scanned:?}",
        scan.live.len() + scan.stale.len() + scan.bad.len()
    );
    assert_eq!(
        scan.live.len() + scan.stale.len() + scan.bad.len(),
        ENTRIES,
        "{scan:?}"
    );
    assert_eq!(
        scan.live.len(),
        2 * SILENT,
        "only the silent processes' own entries"
    );
    // (Some of the pids named may have ended since: their entries are stale.)
    assert!(
        scan.bad.len() <= live_named && scan.bad.len() + scan.stale.len() == ENTRIES - 2 * SILENT,
        "entries naming other users' pids are not trusted: {} of {live_named}",
        scan.bad.len()
    );

    // The device has a holder of its own: the recovery runs to its bound.
    let tracker = Tracker::new("trust-bound");
    let _held = tracker.register(ResourceKind::Qp, 1, 0);
    let subject = Arc::new(Subject(tracker));
    let (r, took) = recover_within(
        Arc::clone(&subject),
        config(1000, &[]),
        &l.reg,
        Duration::from_secs(20),
    );
    println!(
        "{test}: {:?} after {took:?} (report {} ms, bound 1000 ms); {} unreachable, {} \
         rejection lines",
        r.outcome,
        r.elapsed_ms,
        r.unreachable.len(),
        r.rejected.len()
    );
    assert_eq!(r.outcome, RecoveryOutcome::TimedOut, "{r:?}");
    assert!(took >= Duration::from_millis(1000), "{took:?}");
    assert!(
        took < Duration::from_millis(1250),
        "the bound of 1000 ms took {took:?}"
    );
    assert!(
        !r.unreachable.is_empty(),
        "the silent processes are reported"
    );

    // Without a holder of its own the device recovers: each silent process of root is
    // waited for one request timeout (500 ms; 16 at once, so two in a row here), those of
    // other users not at all.
    drop(_held);
    let (r, took) = recover_within(subject, config(3000, &[]), &l.reg, Duration::from_secs(20));
    println!("{test}: without holders: {:?} after {took:?}", r.outcome);
    assert_eq!(r.outcome, RecoveryOutcome::Recovered, "{r:?}");
    assert!(took < Duration::from_millis(2000), "{took:?}");
}

#[test]
fn an_entry_pointing_at_a_root_only_socket_is_never_connected_to() {
    let test = "an_entry_pointing_at_a_root_only_socket_is_never_connected_to";
    if skip_unless_root(test) {
        return;
    }
    let l = layout("pointer");
    let private = common::TempDir::new("rootonly");
    std::fs::set_permissions(private.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let target = private.path().join("ctl.sock");
    let listener = UnixListener::bind(&target).unwrap();
    listener.set_nonblocking(true).unwrap();
    let mut procs = Procs::default();
    let dir = l.user_dir.to_str().unwrap();
    let t = target.to_str().unwrap();
    let pointer = procs.helper(
        "pointer",
        Some(NOBODY),
        &[("SWT_DIR", dir), ("SWT_TARGET", t)],
    );
    let link = procs.helper("link", Some(NOBODY), &[("SWT_DIR", dir), ("SWT_TARGET", t)]);

    let subject = Arc::new(Subject(Tracker::new("trust-pointer")));
    let (r, took) = recover_within(subject, config(1000, &[]), &l.reg, Duration::from_secs(20));
    println!(
        "{test}: {:?} after {took:?}; rejected {:#?}",
        r.outcome, r.rejected
    );
    // The CLI's path to every registered process.
    let answers = control::query_all(&l.reg, &Request::Info, Duration::from_millis(500)).unwrap();
    let accepted = std::iter::from_fn(|| listener.accept().ok()).count();
    assert_eq!(accepted, 0, "root connected to the root-only socket");
    assert_eq!(r.outcome, RecoveryOutcome::Recovered, "{r:?}");
    let rejected = r.rejected.join("\n");
    assert!(
        rejected.contains(&format!("{}/{pointer}.json skipped", l.user_dir.display())),
        "{rejected}"
    );
    assert!(rejected.contains(&format!("pid {link} ")), "{rejected}");
    assert!(
        answers.iter().all(|a| a.entry.pid != pointer),
        "{answers:?}"
    );
    let to_link = answers.iter().find(|a| a.entry.pid == link).unwrap();
    assert!(
        matches!(to_link.reply, Err(control::ClientError::Untrusted(_))),
        "{to_link:?}"
    );
}
