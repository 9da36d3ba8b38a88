//! The threads Softwarp starts inside an application (the device's progress thread, the
//! connection manager's, the RAS services'): named, and with every signal blocked.
//!
//! A library is a guest in the application's process. A signal the application expects
//! (`SIGALRM` ending a wait, `SIGINT`, `SIGCHLD`) is delivered to any thread that does not
//! block it; were it one of ours, the application's handler would run there, and the
//! application's own thread, waiting in `ibv_get_cq_event` or `rdma_get_cm_event`, would
//! never see the `EINTR` it counts on. rdma-core starts no threads; Softwarp's block every
//! signal (the kernel keeps `SIGKILL` and `SIGSTOP`, glibc its two internal ones), so
//! signals reach the application's threads only.
//!
//! The mask is set on the spawning thread around `spawn` (a new thread inherits it), so no
//! signal can land on the new thread before it is blocked; the caller's mask is restored
//! right after. `pthread_sigmask` is a raw `libc` call, the only `unsafe` here.
//!
//! `spawn` returns once the new thread runs: the start of a Rust thread registers
//! thread-local destructors (`__cxa_thread_atexit_impl`), which takes the dynamic loader's
//! lock. A C library that is unloaded (`dlclose`) or finalised at `exit` runs its destructor
//! under that lock, and a destructor that closes what it opened (uDAPL's provider destroys
//! its rdma_cm event channel) joins the thread: a thread still starting then waited for the
//! lock its joiner held, for ever (dapltest's limit test hung about one run in five).

#![allow(unsafe_code)]

use std::io;
use std::thread::JoinHandle;

thread_local! {
    static OURS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// True on a thread [`spawn`] started: an interposer of the C library's socket calls
/// (the preload library, which carries Softwarp's stack inside it) tells the stack's own
/// sockets from the program's by it.
pub fn is_softwarp_thread() -> bool {
    OURS.with(std::cell::Cell::get)
}

/// Starts a thread named `name` running `f`, with every signal blocked.
pub fn spawn<F, T>(name: String, f: F) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    // SAFETY: `sigset_t` is plain data; `sigfillset` initialises it.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `all` is a valid set to fill; `pthread_sigmask` changes this thread's mask
    // only and writes the previous one into `old`.
    let blocked = unsafe {
        libc::sigfillset(&mut all) == 0
            && libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old) == 0
    };
    let (started, running) = std::sync::mpsc::sync_channel::<()>(1);
    let spawned = std::thread::Builder::new().name(name).spawn(move || {
        OURS.with(|o| o.set(true));
        // Past the thread's start-up (see the module docs): it can be joined from a
        // destructor that holds the loader's lock.
        let _ = started.send(());
        f()
    });
    if blocked {
        // SAFETY: restores the mask read above, on this thread.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    }
    if spawned.is_ok() {
        // Err only if the thread died before sending (it cannot: nothing before can panic).
        let _ = running.recv();
    }
    spawned
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `SigBlk` mask of this process's thread `tid`, from `/proc`.
    fn blocked(tid: u32) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status"))
            .expect("the thread's status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("SigBlk:"))
            .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
            .expect("SigBlk")
    }

    #[test]
    fn the_new_thread_blocks_every_signal_and_the_caller_keeps_its_mask() {
        let before = blocked(crate::sys::tid());
        let t = spawn("sigmask-test".into(), || blocked(crate::sys::tid())).expect("spawn");
        let inside = t.join().expect("join");
        for sig in [
            libc::SIGINT,
            libc::SIGALRM,
            libc::SIGTERM,
            libc::SIGUSR1,
            libc::SIGCHLD,
        ] {
            assert_ne!(
                inside & (1 << (sig - 1)),
                0,
                "signal {sig} not blocked: {inside:x}"
            );
        }
        assert_eq!(blocked(crate::sys::tid()), before);
    }
}
