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

/// Sends `SIGTERM` (or `SIGKILL` when `kill`) to process `pid` (a recovery terminating a
/// process that holds a failed device's resources).
pub fn signal_process(pid: u32, kill: bool) -> io::Result<()> {
    let pid = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .filter(|p| p.as_raw_pid() > 0)
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    let sig = if kill {
        rustix::process::Signal::KILL
    } else {
        rustix::process::Signal::TERM
    };
    rustix::process::kill_process(pid, sig).map_err(io::Error::from)
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
