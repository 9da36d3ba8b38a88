//! The few facts about the process, its threads and its sockets that need system calls, in
//! one place. They go through `rustix` (safe wrappers) wherever it has the call, except
//! `TCP_INFO`, which `rustix` does not offer, and `sched_getcpu`, whose `rustix` version
//! cannot run under valgrind: those two are raw `libc` calls, the only `unsafe` code of the
//! crate, each with its `// SAFETY:` note. Everything else in the crate is
//! safe Rust.
//!
//! Also the pure helpers around them (process name, `/proc/<pid>/stat` start time), so that
//! callers never parse `/proc` themselves.

#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

/// This process's id.
pub fn pid() -> u32 {
    std::process::id()
}

/// The kernel's id of the calling thread (what `top -H` and `/proc/<pid>/task` show).
pub fn tid() -> u32 {
    thread_local! {
        // A thread's id never changes: one system call per thread, not per record. (A child
        // of fork() keeps its parent's cached value for the forking thread; records of such a
        // child show the parent's tid.)
        static TID: u32 = u32::try_from(rustix::thread::gettid().as_raw_pid()).unwrap_or(0);
    }
    TID.try_with(|t| *t).unwrap_or(0)
}

/// The CPU the calling thread runs on right now (`sched_getcpu`), if the kernel says.
pub fn current_cpu() -> Option<u32> {
    // libc, not rustix: rustix's `sched_getcpu` goes through the vDSO, whose set-up (an
    // auxiliary-vector check) crashes under valgrind, which BENCHMARKS.md's instruction
    // counts run on (callgrind).
    // SAFETY: sched_getcpu takes no arguments and touches no memory of ours; it returns -1
    // on failure, which the conversion below turns into None.
    let cpu = unsafe { libc::sched_getcpu() };
    u32::try_from(cpu).ok()
}

/// The real user id of this process.
pub fn uid() -> u32 {
    rustix::process::getuid().as_raw()
}

/// The effective user id of this process (the owner of the files and sockets it creates).
pub fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// The user id and process id of the process at the other end of a connected Unix socket
/// (`SO_PEERCRED`: the credentials it had when it connected).
pub fn peer_credentials(fd: BorrowedFd<'_>) -> io::Result<(u32, u32)> {
    let cred = rustix::net::sockopt::socket_peercred(fd)?;
    let pid = u32::try_from(cred.pid.as_raw_nonzero().get()).unwrap_or(0);
    Ok((cred.uid.as_raw(), pid))
}

/// The process's name: the kernel's `comm` (what `ps` and `top` show), else the file name of
/// the executable, else `"?"`. Computed once.
pub fn process_name() -> &'static str {
    static NAME: OnceLock<String> = OnceLock::new();
    NAME.get_or_init(|| {
        if let Ok(comm) = std::fs::read_to_string("/proc/self/comm") {
            let comm = comm.trim_end_matches('\n');
            if !comm.is_empty() {
                return comm.to_string();
            }
        }
        std::env::current_exe()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "?".to_string())
    })
}

/// The name of the calling thread, or `"?"` for an unnamed one.
pub fn thread_name() -> String {
    std::thread::current().name().unwrap_or("?").to_string()
}

/// What `kill(pid, 0)` says about a process id.
pub fn pid_exists(pid: u32) -> bool {
    // 0 and negative values address process groups, never one process.
    let Some(pid) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return false;
    };
    if pid.as_raw_pid() <= 0 {
        return false;
    }
    // Signal 0: the existence and permission checks only, no signal is sent.
    match rustix::process::test_kill_process(pid) {
        Ok(()) => true,
        // EPERM: the process exists but belongs to someone else.
        Err(e) => e == rustix::io::Errno::PERM,
    }
}

/// What the kernel says about one process: who owns it, what it is called and when it
/// started (the pair pid + start time names one process for the life of the host). Read
/// from `/proc/<pid>/status`, `/proc/<pid>/comm` and `/proc/<pid>/stat`, never from
/// anything the process says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessIdentity {
    /// The process id.
    pub pid: u32,
    /// Its real, effective, saved and file-system user ids (`Uid:` of `status`).
    pub uids: [u32; 4],
    /// Its name as the kernel knows it (`comm`, at most 15 bytes).
    pub comm: String,
    /// Its start time in clock ticks since boot.
    pub start_ticks: u64,
}

impl ProcessIdentity {
    /// The user the process wholly belongs to: `Some(uid)` when its real, effective, saved
    /// and file-system uids are all `uid`; `None` for a process between two users (a
    /// set-user-id program), which is nobody's for the recovery and the registry.
    pub fn owner(&self) -> Option<u32> {
        let [r, e, s, f] = self.uids;
        (r == e && e == s && s == f).then_some(r)
    }
}

/// The kernel's [`ProcessIdentity`] of `pid`; `None` when the process is gone (or `/proc`
/// says something unexpected).
pub fn process_identity(pid: u32) -> Option<ProcessIdentity> {
    if pid == 0 {
        return None;
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let uids = parse_status_uids(&status)?;
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    let start_ticks = process_start_ticks(pid)?;
    Some(ProcessIdentity {
        pid,
        uids,
        comm: comm.trim_end_matches('\n').to_string(),
        start_ticks,
    })
}

/// The four numbers of the `Uid:` line of a `/proc/<pid>/status` text.
pub(crate) fn parse_status_uids(status: &str) -> Option<[u32; 4]> {
    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    let mut it = line.split_ascii_whitespace().map(str::parse::<u32>);
    let mut out = [0u32; 4];
    for slot in &mut out {
        *slot = it.next()?.ok()?;
    }
    Some(out)
}

/// Sends `SIGTERM` (or `SIGKILL` when `kill`) to the process `expected` describes, and only
/// to it: a pidfd is opened first (it keeps naming that one process even if the pid is
/// reused later), then the kernel's identity of the pid is read again and must equal
/// `expected` (same start time: not a reused pid; same uids and name), and the signal goes
/// through the pidfd (`pidfd_send_signal`). A process that changed or is gone is an error
/// (`ESRCH` or `InvalidData`), and nothing is sent. Without pidfds (Linux before 5.3) it
/// refuses (`Unsupported`) rather than signal a pid that may have been reused.
pub fn signal_verified(expected: &ProcessIdentity, kill: bool) -> io::Result<()> {
    let pid = i32::try_from(expected.pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .filter(|p| p.as_raw_pid() > 0)
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    let pidfd = match rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOSYS) => {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "no pidfd_open (Linux 5.3 or later): a reused pid cannot be ruled out",
            ))
        }
        Err(e) => return Err(e.into()),
    };
    match process_identity(expected.pid) {
        Some(now) if now == *expected => {}
        Some(now) => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "pid {} is not the verified process any more: {now:?}",
                    expected.pid
                ),
            ))
        }
        None => return Err(rustix::io::Errno::SRCH.into()),
    }
    let sig = if kill {
        rustix::process::Signal::KILL
    } else {
        rustix::process::Signal::TERM
    };
    rustix::process::pidfd_send_signal(&pidfd, sig).map_err(io::Error::from)
}

/// The start time of process `pid` in clock ticks since boot (field 22 of
/// `/proc/<pid>/stat`). Together with the pid it names one process for the life of the
/// host: a reused pid has a different start time.
pub fn process_start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat_start_ticks(&stat)
}

/// Field 22 (`starttime`) of a `/proc/<pid>/stat` line. The second field (the command name in
/// parentheses) may contain spaces and parentheses, so fields are counted after the last `)`.
pub(crate) fn parse_stat_start_ticks(stat: &str) -> Option<u64> {
    let after = stat.get(stat.rfind(')')? + 1..)?;
    // After the name come field 3 (state) onwards; starttime is field 22, the 20th of them.
    after.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// Whether this process may create files in `path` (`access(path, W_OK)`).
pub fn is_writable_dir(path: &Path) -> bool {
    let access = rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK;
    rustix::fs::access(path, access).is_ok() && path.is_dir()
}

/// Waits at most `timeout` until `fd` is readable (for a listening socket: a connection is
/// waiting). `Ok(false)` when the time ran out. An interrupted wait counts as a timeout.
pub fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    // A timeout too long for a timespec waits without a bound.
    let ts = Timespec::try_from(timeout).ok();
    match rustix::event::poll(&mut fds, ts.as_ref()) {
        Ok(n) => Ok(n > 0),
        Err(rustix::io::Errno::INTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// `getsockopt(fd, IPPROTO_TCP, TCP_INFO)` into `buf`; returns how many bytes the kernel
/// filled (older kernels fill fewer fields than newer ones).
pub fn tcp_info_raw(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    let mut len = libc::socklen_t::try_from(buf.len()).unwrap_or(libc::socklen_t::MAX);
    // SAFETY: `buf` is valid for writes of `len` bytes (len <= buf.len()), `len` is a valid
    // socklen_t the kernel updates, both outlive the call, and `fd` is borrowed so it stays
    // open. The kernel writes at most `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            buf.as_mut_ptr().cast::<libc::c_void>(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(len).unwrap_or(0).min(buf.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_start_ticks_skips_a_name_with_spaces_and_parentheses() {
        let line = "4242 (a b) c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 \
                    987654 1000 200 18446744073709551615";
        assert_eq!(parse_stat_start_ticks(line), Some(987_654));
    }

    #[test]
    fn stat_start_ticks_of_a_truncated_line_is_none() {
        assert_eq!(parse_stat_start_ticks("12 (x) S 1 2 3"), None);
        assert_eq!(parse_stat_start_ticks("no parenthesis"), None);
        assert_eq!(parse_stat_start_ticks(""), None);
    }

    #[test]
    fn status_uids_are_the_four_numbers_of_the_uid_line() {
        let status = "Name:\tx\nUmask:\t0022\nUid:\t1000\t0\t1000\t1000\nGid:\t5\t5\t5\t5\n";
        assert_eq!(parse_status_uids(status), Some([1000, 0, 1000, 1000]));
        assert_eq!(parse_status_uids("Uid:\t1 2 3\n"), None);
        assert_eq!(parse_status_uids("Gid:\t1 2 3 4\n"), None);
        let me = process_identity(pid()).unwrap();
        assert_eq!(me.owner(), Some(uid()));
        assert_eq!(me.comm, process_name());
        assert_eq!(
            ProcessIdentity {
                uids: [1, 0, 1, 1],
                ..me
            }
            .owner(),
            None
        );
    }

    #[test]
    fn own_process_is_alive_and_has_a_start_time() {
        assert!(pid_exists(pid()));
        assert!(process_start_ticks(pid()).is_some());
        assert!(!pid_exists(0), "pid 0 addresses a process group");
    }

    #[test]
    fn cpu_and_tid_are_reported() {
        assert!(current_cpu().is_some());
        assert_ne!(tid(), 0);
        assert!(!process_name().is_empty());
    }
}
