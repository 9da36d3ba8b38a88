//! The host registry: every process using Softwarp leaves one JSON file in a runtime
//! directory (pid, name, start time, control socket), so the CLI finds every process on the
//! host. Files of dead processes are detected (the pid is gone, or was reused by another
//! process) and removed by readers.
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
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

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
    /// Files that could not be read or parsed.
    pub bad: Vec<BadEntry>,
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

    /// Reads every entry and sorts it into live, stale and bad. Removes nothing.
    pub fn scan(&self) -> io::Result<Scan> {
        Ok(self.scan_files()?.0)
    }

    /// [`HostRegistry::scan`], and the file and socket of every stale entry.
    fn scan_files(&self) -> io::Result<(Scan, Vec<(PathBuf, PathBuf)>)> {
        let mut scan = Scan::default();
        let mut stale_files = Vec::new();
        let mut paths: Vec<PathBuf> = Vec::new();
        for (i, dir) in self.scan_dirs().iter().enumerate() {
            let read = match fs::read_dir(dir) {
                Ok(r) => r,
                // Our own directory must be readable; another user's may vanish meanwhile.
                Err(e) if i == 0 => return Err(e),
                Err(_) => continue,
            };
            let left = MAX_ENTRIES.saturating_sub(paths.len());
            paths.extend(
                read.filter_map(Result::ok)
                    .map(|e| e.path())
                    .filter(|p| {
                        p.extension().is_some_and(|e| e == "json")
                            && p.file_name()
                                .and_then(|n| n.to_str())
                                .is_some_and(|n| !n.starts_with('.'))
                    })
                    .take(left),
            );
        }
        paths.sort();
        for path in paths {
            let named_pid = path
                .file_stem()
                .and_then(|s| s.to_str())
                .and_then(|s| s.parse::<u32>().ok());
            match read_entry(&path) {
                Ok(e) if named_pid != Some(e.pid) => scan.bad.push(BadEntry {
                    path,
                    reason: format!("the file names pid {}, not its own", e.pid),
                }),
                Ok(e) => match e.liveness() {
                    Liveness::Alive => scan.live.push(e),
                    Liveness::Dead | Liveness::PidReused => {
                        stale_files.push((path, e.control_socket.clone()));
                        scan.stale.push(e);
                    }
                },
                Err(reason) => scan.bad.push(BadEntry { path, reason }),
            }
        }
        scan.live.sort_by_key(|e| e.pid);
        scan.stale.sort_by_key(|e| e.pid);
        Ok((scan, stale_files))
    }

    /// Scans, then removes the files (entry and socket) of stale processes, and bad files
    /// named after a pid that no longer runs. Returns what was found (removal failures are
    /// ignored: only the owner, or root, can remove).
    pub fn scan_and_clean(&self) -> io::Result<Scan> {
        let (scan, stale_files) = self.scan_files()?;
        for (entry, socket) in &stale_files {
            let _ = fs::remove_file(entry);
            // Only a socket beside its entry: never another path an entry merely names.
            if socket.parent().is_some() && socket.parent() == entry.parent() {
                let _ = fs::remove_file(socket);
            }
        }
        for b in &scan.bad {
            let pid = b
                .path
                .file_stem()
                .and_then(|s| s.to_str())
                .and_then(|s| s.parse::<u32>().ok());
            if let (Some(pid), Some(dir)) = (pid, b.path.parent()) {
                if !sys::pid_exists(pid) {
                    let _ = fs::remove_file(&b.path);
                    let _ = fs::remove_file(dir.join(format!("{pid}.sock")));
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

fn read_entry(path: &Path) -> Result<ProcessEntry, String> {
    let meta = fs::symlink_metadata(path).map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() > MAX_ENTRY_BYTES {
        return Err(format!("{} bytes, more than {MAX_ENTRY_BYTES}", meta.len()));
    }
    let text = fs::read(path).map_err(|e| e.to_string())?;
    serde_json::from_slice(&text).map_err(|e| e.to_string())
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
