//! The host registry: every process using Softwarp leaves one JSON file in a runtime
//! directory (pid, name, start time, control socket), so the CLI finds every process on the
//! host. Files of dead processes are detected (the pid is gone, or was reused by another
//! process) and removed by readers, in their own directory.
//!
//! A file says only what its writer wanted: an entry of a running process is live (listed,
//! asked) only when the file's owner, its directory's owner, the uid in the entry and the
//! kernel's owner of the pid are one user, and its control socket is the layout's path for
//! the pid (`<dir>/<pid>.sock`); files are opened without following symbolic links, and
//! [`open_control_socket`] re-checks the socket file (a socket, that user's, no link) for
//! each connection. Anything else is a bad entry, never connected to. A scan reads at most
//! [`MAX_ENTRIES`] files.
//!
//! The runtime directory is the first of:
//! 1. `$SOFTWARP_RUNTIME_DIR`;
//! 2. `/run/softwarp/$UID`, when `/run/softwarp` (or that directory) is writable, or `/run`
//!    is writable to create it. `/run/softwarp` itself is shared (mode `1777`, sticky like
//!    `/tmp`, so every user creates their own directory in it and nobody removes another's);
//!    root's scans cover every user's directory in it;
//! 3. `$XDG_RUNTIME_DIR/softwarp`;
//! 4. `/tmp/softwarp-$UID`.
//!
//! Whichever it is, the runtime directory admits only its owner (and root): it is created
//! `0700`; an existing one of this user whose mode lets group or others in is set to `0700`
//! (it is Softwarp's directory: sockets, registry files, dumps, error log); one that belongs
//! to another user, or that others may write to (a shared directory such as `/tmp`), is
//! refused with a `PermissionDenied` error, and RAS does not start there. Registry files are
//! `0600`, control sockets `0600`, and the control server checks every connection's
//! `SO_PEERCRED` as well (see [`crate::control`]).

use std::ffi::OsString;
use std::fs;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::deadline::Deadline;
use crate::{clock, sys};

/// The shared directory in which every user has their own runtime directory (named by uid).
pub const SHARED_BASE: &str = "/run/softwarp";
/// Environment variable that overrides the runtime directory.
pub const RUNTIME_DIR_ENV: &str = "SOFTWARP_RUNTIME_DIR";
/// Largest registry file read, in bytes (a real one is a few hundred).
pub const MAX_ENTRY_BYTES: u64 = 64 * 1024;
/// Most registry files looked at per scan.
pub const MAX_ENTRIES: usize = 4096;

/// Where the runtime directory is, from the environment (`env`), the user id and which
/// directories are writable (`writable`). Pure: [`runtime_dir`] calls it with the real ones.
pub fn resolve_runtime_dir(
    env: impl Fn(&str) -> Option<OsString>,
    uid: u32,
    writable: impl Fn(&Path) -> bool,
) -> PathBuf {
    if let Some(d) = env(RUNTIME_DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let base = Path::new(SHARED_BASE);
    let own = base.join(uid.to_string());
    if writable(&own) || writable(base) || (!base.exists() && writable(Path::new("/run"))) {
        return own;
    }
    if let Some(x) = env("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(x).join("softwarp");
    }
    PathBuf::from(format!("/tmp/softwarp-{uid}"))
}

/// The runtime directory of this process's environment (not created).
pub fn runtime_dir() -> PathBuf {
    resolve_runtime_dir(|k| std::env::var_os(k), sys::uid(), sys::is_writable_dir)
}

/// Creates `dir` if needed with mode `0700` (and [`SHARED_BASE`] with mode `1777` when
/// `dir` is in it); sets an existing directory of this user to `0700`. Refuses
/// (`PermissionDenied`) a directory that belongs to another user or that others may write
/// to: the runtime directory admits only its owner and root.
pub fn ensure_dir(dir: &Path) -> io::Result<()> {
    if dir.parent() == Some(Path::new(SHARED_BASE)) {
        ensure_shared_base()?;
    }
    match fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = fs::symlink_metadata(dir)?;
    if check_private_dir(dir, meta.is_dir(), meta.uid(), meta.mode(), sys::euid())? {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
        crate::sw_event!(
            Ras,
            2,
            "runtime directory {} had mode {:04o}: set to 0700",
            dir.display(),
            meta.mode() & 0o7777
        );
    }
    Ok(())
}

/// Whether a directory with these facts may be the runtime directory of user `euid` (pure:
/// [`ensure_dir`] calls it with the real ones): `Ok(false)` as it is, `Ok(true)` once its
/// mode is set to `0700`, an error when it is not a directory, belongs to another user, or
/// others may write to it.
pub fn check_private_dir(
    dir: &Path,
    is_dir: bool,
    owner: u32,
    mode: u32,
    euid: u32,
) -> io::Result<bool> {
    if !is_dir {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a directory", dir.display()),
        ));
    }
    if owner != euid {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} belongs to uid {owner}, not to this user ({euid}); remove it or set \
                 {RUNTIME_DIR_ENV}",
                dir.display()
            ),
        ));
    }
    if mode & 0o1022 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} has mode {:04o}: others may write to it, so it is a shared directory, \
                 not a runtime directory; set {RUNTIME_DIR_ENV} to a directory of your own",
                dir.display(),
                mode & 0o7777
            ),
        ));
    }
    Ok(mode & 0o077 != 0)
}

/// Creates [`SHARED_BASE`] (`1777`) if needed; fixes its mode when we own it (the umask may
/// have cleared bits of the mode given at creation).
fn ensure_shared_base() -> io::Result<()> {
    let base = Path::new(SHARED_BASE);
    match fs::DirBuilder::new().mode(0o1777).create(base) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = fs::symlink_metadata(base)?;
    if !meta.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{SHARED_BASE} exists and is not a directory"),
        ));
    }
    if meta.uid() == sys::euid() && meta.mode() & 0o7777 != 0o1777 {
        fs::set_permissions(base, fs::Permissions::from_mode(0o1777))?;
    }
    Ok(())
}

/// One registered process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessEntry {
    /// Process id.
    pub pid: u32,
    /// Process name.
    pub name: String,
    /// Owner user id.
    pub uid: u32,
    /// When it registered, milliseconds since the Unix epoch.
    pub start_unix_ms: u64,
    /// When it registered, RFC 3339 UTC.
    pub start_time: String,
    /// The process's start time in clock ticks since boot (`/proc/<pid>/stat`), to tell a
    /// reused pid from the registered process.
    #[serde(default)]
    pub proc_start_ticks: Option<u64>,
    /// Its control socket.
    pub control_socket: PathBuf,
    /// Softwarp version it runs.
    pub version: String,
}

impl ProcessEntry {
    /// An entry for this process with `control_socket`.
    pub fn this_process(control_socket: PathBuf) -> Self {
        let now = std::time::SystemTime::now();
        Self {
            pid: sys::pid(),
            name: sys::process_name().to_string(),
            uid: sys::uid(),
            start_unix_ms: clock::unix_ms(now),
            start_time: clock::rfc3339(now),
            proc_start_ticks: sys::process_start_ticks(sys::pid()),
            control_socket,
            version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }

    /// Whether the registered process is gone.
    pub fn liveness(&self) -> Liveness {
        if !sys::pid_exists(self.pid) {
            return Liveness::Dead;
        }
        match (self.proc_start_ticks, sys::process_start_ticks(self.pid)) {
            (Some(then), Some(now)) if then != now => Liveness::PidReused,
            _ => Liveness::Alive,
        }
    }
}

/// What became of a registered process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Liveness {
    /// It runs.
    Alive,
    /// No process has its pid.
    Dead,
    /// Its pid belongs to a process started later.
    PidReused,
}

/// A registry file that could not be used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadEntry {
    /// The file.
    pub path: PathBuf,
    /// Why.
    pub reason: String,
}

/// What a scan of the registry found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scan {
    /// Running processes, by pid.
    pub live: Vec<ProcessEntry>,
    /// Entries of processes that are gone (dead or pid reused).
    pub stale: Vec<ProcessEntry>,
    /// Files that could not be read or parsed, and entries not trusted.
    pub bad: Vec<BadEntry>,
    /// The deadline passed before every file was read ([`HostRegistry::scan_and_clean_until`]).
    #[serde(default)]
    pub truncated: bool,
}

/// The registry in one runtime directory.
#[derive(Debug, Clone)]
pub struct HostRegistry {
    dir: PathBuf,
    /// The shared directory whose per-user directories root's scans read too.
    shared_base: Option<PathBuf>,
}

impl HostRegistry {
    /// The registry in [`runtime_dir`], created if needed.
    pub fn open_default() -> io::Result<Self> {
        Self::open(runtime_dir())
    }

    /// The registry in `dir`, created if needed.
    pub fn open(dir: impl Into<PathBuf>) -> io::Result<Self> {
        let dir = dir.into();
        ensure_dir(&dir)?;
        let shared_base = dir
            .parent()
            .filter(|p| *p == Path::new(SHARED_BASE))
            .map(Path::to_path_buf);
        Ok(Self { dir, shared_base })
    }

    /// Treats `base` as the shared directory of per-user directories (what [`SHARED_BASE`]
    /// is for the default layout): root's scans read every user's directory in it. For
    /// layouts of one's own, and for tests.
    pub fn with_shared_base(mut self, base: impl Into<PathBuf>) -> Self {
        self.shared_base = Some(base.into());
        self
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The registry file of `pid`.
    pub fn entry_path(&self, pid: u32) -> PathBuf {
        self.dir.join(format!("{pid}.json"))
    }

    /// The control socket path for `pid`.
    pub fn socket_path(&self, pid: u32) -> PathBuf {
        self.dir.join(format!("{pid}.sock"))
    }

    /// Writes `entry`'s file (atomically: a temporary file renamed over it). The returned
    /// guard removes it when dropped.
    pub fn register(&self, entry: &ProcessEntry) -> io::Result<Registration> {
        let path = self.entry_path(entry.pid);
        let tmp = self.dir.join(format!(".{}.json.tmp", entry.pid));
        let json = serde_json::to_vec_pretty(entry).map_err(io::Error::other)?;
        {
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&json)?;
            f.write_all(b"\n")?;
        }
        fs::rename(&tmp, &path)?;
        Ok(Registration {
            path,
            pid: entry.pid,
        })
    }

    /// The directories a scan reads: this registry's own, and, when this process is root
    /// and the directory is a user's directory in the shared base ([`SHARED_BASE`], or
    /// [`HostRegistry::with_shared_base`]), every user's directory there: one named by a
    /// uid and owned by that uid (a directory one user made under another's number is
    /// skipped). Root sees every process on the host; each user only their own.
    pub fn scan_dirs(&self) -> Vec<PathBuf> {
        let mut dirs = vec![self.dir.clone()];
        let Some(base) = self.shared_base.as_deref() else {
            return dirs;
        };
        if sys::euid() != 0 || self.dir.parent() != Some(base) {
            return dirs;
        }
        let Ok(read) = fs::read_dir(base) else {
            return dirs;
        };
        let mut others: Vec<PathBuf> = read
            .filter_map(Result::ok)
            .filter(|e| {
                let uid = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok());
                let meta = fs::symlink_metadata(e.path());
                matches!((uid, meta), (Some(uid), Ok(m)) if m.is_dir() && m.uid() == uid)
            })
            .map(|e| e.path())
            .filter(|p| *p != self.dir)
            .take(MAX_ENTRIES)
            .collect();
        others.sort();
        dirs.extend(others);
        dirs
    }

    /// Reads every entry and sorts it into live, stale and bad. Removes nothing. A live
    /// entry is one that the kernel and the file system vouch for (see [`trust`]); an
    /// entry of a running process that does not pass is bad, with the reason, and is never
    /// connected to.
    pub fn scan(&self) -> io::Result<Scan> {
        Ok(self.scan_files(Deadline::NEVER)?.0)
    }

    /// [`HostRegistry::scan`], and the pids of the stale entries of this registry's own
    /// directory (the only ones a reader removes).
    fn scan_files(&self, deadline: Deadline) -> io::Result<(Scan, Vec<u32>)> {
        let mut scan = Scan::default();
        let mut stale_own = Vec::new();
        let mut dirs: Vec<ScanDir> = Vec::new();
        let mut names: Vec<(PathBuf, usize, String)> = Vec::new();
        for (i, path) in self.scan_dirs().into_iter().enumerate() {
            let opened = open_dir_nofollow(&path).and_then(|(fd, owner)| {
                let listed = list_json(&fd, MAX_ENTRIES.saturating_sub(names.len()))?;
                Ok((fd, owner, listed))
            });
            let (fd, owner, listed) = match opened {
                Ok(o) => o,
                // Our own directory must be readable; another user's may vanish meanwhile.
                Err(e) if i == 0 => return Err(e),
                Err(_) => continue,
            };
            // Another user's directory is theirs (named by their uid and owned by it) when
            // opened, not only when `scan_dirs` looked at it.
            if i > 0 && path.file_name().and_then(|n| n.to_str()) != Some(&owner.to_string()) {
                continue;
            }
            let d = dirs.len();
            names.extend(listed.into_iter().map(|n| (path.join(&n), d, n)));
            dirs.push(ScanDir { path, fd, owner });
        }
        names.sort();
        for (path, d, name) in names {
            // About 20 us per entry: checked for each, a scan of 4,096 takes up to 80 ms.
            if deadline.expired() {
                scan.truncated = true;
                break;
            }
            let Some(dir) = dirs.get(d) else { continue };
            let named_pid = name
                .strip_suffix(".json")
                .and_then(|s| s.parse::<u32>().ok());
            match read_entry_at(&dir.fd, &name) {
                Ok((e, _)) if named_pid != Some(e.pid) => scan.bad.push(BadEntry {
                    path,
                    reason: format!("the file names pid {}, not its own", e.pid),
                }),
                Ok((e, file_owner)) => match e.liveness() {
                    Liveness::Alive => match trust(&e, dir, file_owner) {
                        Ok(()) => scan.live.push(e),
                        Err(why) => scan.bad.push(BadEntry {
                            path,
                            reason: format!("not trusted: {why}"),
                        }),
                    },
                    Liveness::Dead | Liveness::PidReused => {
                        if d == 0 {
                            stale_own.push(e.pid);
                        }
                        scan.stale.push(e);
                    }
                },
                Err(reason) => scan.bad.push(BadEntry { path, reason }),
            }
        }
        scan.live.sort_by_key(|e| e.pid);
        scan.stale.sort_by_key(|e| e.pid);
        Ok((scan, stale_own))
    }

    /// Scans, then removes the files (entry and socket) of stale processes, and bad files
    /// named after a pid that no longer runs, in this registry's own directory only: root's
    /// scans read other users' directories but leave their files to them (a path in a
    /// directory another user controls is never one root removes). Returns what was found
    /// (removal failures are ignored).
    pub fn scan_and_clean(&self) -> io::Result<Scan> {
        self.scan_and_clean_until(Deadline::NEVER)
    }

    /// [`HostRegistry::scan_and_clean`] that reads no more entries once `deadline` passed
    /// (the scan is then [`Scan::truncated`]).
    pub fn scan_and_clean_until(&self, deadline: Deadline) -> io::Result<Scan> {
        let (scan, stale_own) = self.scan_files(deadline)?;
        for pid in stale_own {
            let _ = fs::remove_file(self.entry_path(pid));
            // Only the socket the layout gives the pid: never another path an entry names.
            let _ = fs::remove_file(self.socket_path(pid));
        }
        for b in &scan.bad {
            if b.path.parent() != Some(self.dir.as_path()) {
                continue;
            }
            let pid = b
                .path
                .file_stem()
                .and_then(|s| s.to_str())
                .and_then(|s| s.parse::<u32>().ok());
            if let Some(pid) = pid {
                if !sys::pid_exists(pid) {
                    let _ = fs::remove_file(self.entry_path(pid));
                    let _ = fs::remove_file(self.socket_path(pid));
                }
            }
        }
        Ok(scan)
    }

    /// The running processes (stale entries are cleaned on the way).
    pub fn live(&self) -> io::Result<Vec<ProcessEntry>> {
        Ok(self.scan_and_clean()?.live)
    }
}

/// A directory of a scan, opened without following a symbolic link.
struct ScanDir {
    path: PathBuf,
    fd: OwnedFd,
    /// Its owner when it was opened.
    owner: u32,
}

/// Opens the directory `path` for reading; its last component must not be a symbolic link
/// (a user may replace their own directory by a link to another one at any time). Returns
/// it and its owner.
fn open_dir_nofollow(path: &Path) -> io::Result<(OwnedFd, u32)> {
    use rustix::fs::{Mode, OFlags};
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let st = rustix::fs::fstat(&fd)?;
    Ok((fd, st.st_uid))
}

/// The names of the registry files in the directory `dir` (`*.json`, not hidden), at most
/// `max`.
fn list_json(dir: &OwnedFd, max: usize) -> io::Result<Vec<String>> {
    let mut out = Vec::new();
    let mut read = rustix::fs::Dir::read_from(dir)?;
    while out.len() < max {
        let Some(entry) = read.read() else { break };
        let entry = entry?;
        let Ok(name) = entry.file_name().to_str() else {
            continue;
        };
        if name.ends_with(".json") && !name.starts_with('.') {
            out.push(name.to_string());
        }
    }
    Ok(out)
}

/// Whether a live process's entry, read from `file_owner`'s file in `dir`, speaks for that
/// process. Everything is checked against the kernel and the file system, nothing is taken
/// from the entry alone: the file's owner, the directory's owner, the uid in the entry and
/// the real owner of the pid (`/proc/<pid>/status`: real, effective, saved and file-system
/// uid all that uid) agree, and the control socket is exactly the path the layout gives
/// the pid (`<dir>/<pid>.sock`). Another user can write any text into a file of theirs;
/// this makes such a file count only for that user's own running processes, at the
/// registry's own path.
fn trust(entry: &ProcessEntry, dir: &ScanDir, file_owner: u32) -> Result<(), String> {
    if file_owner != entry.uid {
        return Err(format!(
            "the file belongs to uid {file_owner}, the entry says uid {}",
            entry.uid
        ));
    }
    if dir.owner != entry.uid {
        return Err(format!(
            "the directory belongs to uid {}, the entry says uid {}",
            dir.owner, entry.uid
        ));
    }
    match sys::process_identity(entry.pid).map(|i| i.owner()) {
        Some(Some(owner)) if owner == entry.uid => {}
        Some(Some(owner)) => {
            return Err(format!(
                "pid {} belongs to uid {owner}, the entry says uid {}",
                entry.pid, entry.uid
            ))
        }
        Some(None) => {
            return Err(format!(
                "pid {} runs with several user ids (set-user-id)",
                entry.pid
            ))
        }
        None => return Err(format!("pid {} cannot be read in /proc", entry.pid)),
    }
    let layout = dir.path.join(format!("{}.sock", entry.pid));
    if entry.control_socket != layout {
        return Err(format!(
            "its control socket {} is not {} (the registry's layout)",
            entry.control_socket.display(),
            layout.display()
        ));
    }
    Ok(())
}

/// Opens the control socket file of a live entry (from [`HostRegistry::scan`]) for a
/// connection, again without trusting any path: the socket must be named `<pid>.sock`, its
/// directory and the socket file must be reached without following a symbolic link, and
/// both must belong to the entry's uid. Returns an `O_PATH` descriptor of the socket file;
/// [`crate::control`] connects through `/proc/self/fd/<fd>`, so the socket connected to is
/// the very file checked here, whatever happens to the path meanwhile.
pub fn open_control_socket(entry: &ProcessEntry) -> io::Result<OwnedFd> {
    use rustix::fs::{FileType, Mode, OFlags};
    let denied = |why: String| io::Error::new(io::ErrorKind::PermissionDenied, why);
    let name = format!("{}.sock", entry.pid);
    let path = &entry.control_socket;
    if path.file_name().and_then(|n| n.to_str()) != Some(name.as_str()) {
        return Err(denied(format!(
            "{} is not the control socket of pid {}",
            path.display(),
            entry.pid
        )));
    }
    let dir = path.parent().unwrap_or(Path::new("/"));
    let flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let dfd = rustix::fs::open(dir, flags | OFlags::DIRECTORY, Mode::empty())?;
    let dst = rustix::fs::fstat(&dfd)?;
    if dst.st_uid != entry.uid {
        return Err(denied(format!(
            "{} belongs to uid {}, not to uid {}",
            dir.display(),
            dst.st_uid,
            entry.uid
        )));
    }
    let fd = rustix::fs::openat(&dfd, name.as_str(), flags, Mode::empty())?;
    let st = rustix::fs::fstat(&fd)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::Socket {
        return Err(denied(format!("{} is not a socket", path.display())));
    }
    if st.st_uid != entry.uid {
        return Err(denied(format!(
            "{} belongs to uid {}, not to uid {}",
            path.display(),
            st.st_uid,
            entry.uid
        )));
    }
    Ok(fd)
}

/// Reads the registry file `name` of the directory `dir` (not following a symbolic link);
/// returns the entry and the file's owner.
fn read_entry_at(dir: &OwnedFd, name: &str) -> Result<(ProcessEntry, u32), String> {
    use rustix::fs::{Mode, OFlags};
    let fd = rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| match e {
        rustix::io::Errno::LOOP => "a symbolic link".to_string(),
        e => e.to_string(),
    })?;
    read_entry_fd(fd)
}

fn read_entry_fd(fd: OwnedFd) -> Result<(ProcessEntry, u32), String> {
    use std::io::Read;
    let st = rustix::fs::fstat(&fd).map_err(|e| e.to_string())?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err("not a regular file".into());
    }
    let len = u64::try_from(st.st_size).unwrap_or(u64::MAX);
    if len > MAX_ENTRY_BYTES {
        return Err(format!("{len} bytes, more than {MAX_ENTRY_BYTES}"));
    }
    let mut text = Vec::new();
    fs::File::from(fd)
        .take(MAX_ENTRY_BYTES)
        .read_to_end(&mut text)
        .map_err(|e| e.to_string())?;
    let entry = serde_json::from_slice(&text).map_err(|e| e.to_string())?;
    Ok((entry, st.st_uid))
}

fn read_entry(path: &Path) -> Result<ProcessEntry, String> {
    use rustix::fs::{Mode, OFlags};
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| e.to_string())?;
    Ok(read_entry_fd(fd)?.0)
}

/// A process's registry file; removed when dropped.
#[derive(Debug)]
pub struct Registration {
    path: PathBuf,
    pid: u32,
}

impl Registration {
    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // Only our own file: never one a later process with our pid wrote.
        if read_entry(&self.path).is_ok_and(|e| e.pid == self.pid && e.pid == sys::pid()) {
            let _ = fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| OsString::from(v))
        }
    }

    #[test]
    fn the_environment_variable_wins() {
        let d = resolve_runtime_dir(env(&[(RUNTIME_DIR_ENV, "/x/y")]), 5, |_| true);
        assert_eq!(d, PathBuf::from("/x/y"));
    }

    #[test]
    fn run_softwarp_when_writable() {
        let d = resolve_runtime_dir(env(&[("XDG_RUNTIME_DIR", "/run/user/5")]), 5, |p| {
            p == Path::new("/run/softwarp")
        });
        assert_eq!(d, PathBuf::from("/run/softwarp/5"));
    }

    #[test]
    fn a_runtime_directory_of_another_user_or_writable_by_others_is_refused() {
        let d = Path::new("/x");
        assert!(!check_private_dir(d, true, 5, 0o40700, 5).unwrap());
        // Our own directory open to reading: set to 0700.
        assert!(check_private_dir(d, true, 5, 0o40755, 5).unwrap());
        assert!(check_private_dir(d, true, 5, 0o40701, 5).unwrap());
        for (owner, mode) in [(6, 0o40700), (5, 0o40770), (5, 0o40702), (5, 0o41777)] {
            let e = check_private_dir(d, true, owner, mode, 5).unwrap_err();
            assert_eq!(
                e.kind(),
                io::ErrorKind::PermissionDenied,
                "{owner} {mode:o}"
            );
        }
        // Root is not special here: root's directory must be root's too.
        assert!(check_private_dir(d, true, 5, 0o40700, 0).is_err());
        assert_eq!(
            check_private_dir(d, false, 5, 0o100600, 5)
                .unwrap_err()
                .kind(),
            io::ErrorKind::AlreadyExists
        );
    }

    #[test]
    fn xdg_runtime_dir_when_run_is_not_writable() {
        let d = resolve_runtime_dir(env(&[("XDG_RUNTIME_DIR", "/run/user/5")]), 5, |_| false);
        assert_eq!(d, PathBuf::from("/run/user/5/softwarp"));
    }

    #[test]
    fn tmp_with_the_uid_as_the_last_resort() {
        let d = resolve_runtime_dir(
            env(&[(RUNTIME_DIR_ENV, ""), ("XDG_RUNTIME_DIR", "")]),
            1234,
            |_| false,
        );
        assert_eq!(d, PathBuf::from("/tmp/softwarp-1234"));
    }
}
