//! The file descriptors applications get for completion channels, asynchronous events and
//! CM event channels.
//!
//! rdma-core hands out blocking descriptors, and a program that wants non-blocking calls
//! sets `O_NONBLOCK` on them itself; the calls then look at the flag (`ibv_get_cq_event`,
//! `ibv_get_async_event` and `rdma_get_cm_event` return `EAGAIN`). Softwarp's own eventfds
//! are non-blocking for its runtime, so the application gets an epoll instance of its own
//! that watches them: readable exactly when one of them is, its flags the application's.

use std::ffi::c_int;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// An epoll instance watching some descriptors for readability.
#[derive(Debug)]
pub struct Watch {
    epoll: OwnedFd,
}

impl Watch {
    /// A new instance watching `fds`, or the errno value.
    pub fn new(fds: &[RawFd]) -> Result<Self, c_int> {
        // SAFETY: creates a new descriptor, owned at once when valid.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(last_errno());
        }
        // SAFETY: `ep` is a fresh descriptor nobody else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(ep) };
        for &fd in fds {
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: fd as u64,
            };
            // SAFETY: both descriptors are open; `ev` is a valid epoll_event.
            if unsafe { libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
                return Err(last_errno());
            }
        }
        Ok(Self { epoll })
    }

    /// The descriptor the application sees.
    pub fn fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// True when the application set `O_NONBLOCK` on [`Watch::fd`].
    pub fn nonblocking(&self) -> bool {
        // SAFETY: F_GETFL on our descriptor has no memory effects.
        let flags = unsafe { libc::fcntl(self.fd(), libc::F_GETFL) };
        flags >= 0 && flags & libc::O_NONBLOCK != 0
    }

    /// Waits until a watched descriptor is readable. A signal handled on this thread ends
    /// the wait with `EINTR`, which the blocking calls return (-1 and `errno`), as
    /// rdma-core's `read` of its channel does: programs end a wait this way (qperf with
    /// `SIGALRM`). Softwarp's own threads block every signal, so a process signal lands on
    /// an application thread. (rdma-core's `read` restarts instead when the handler was
    /// installed with `SA_RESTART`; an epoll wait is never restarted, so here every
    /// handled signal ends it, and a program that retries on `EINTR` sees no difference.)
    pub fn wait(&self) -> Result<(), c_int> {
        // SAFETY: plain C data for epoll_wait's output.
        let mut out: libc::epoll_event = unsafe { std::mem::zeroed() };
        // SAFETY: our epoll descriptor and a one-element output array.
        let rc = unsafe { libc::epoll_wait(self.fd(), &mut out, 1, -1) };
        if rc < 0 {
            return Err(last_errno());
        }
        Ok(())
    }
}

fn last_errno() -> c_int {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}
