//! One end of a socket driven through an io_uring: the ring, the socket, one registered
//! buffer, and how completions are waited for.

use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::common::{pause, protocol_error};

/// How a thread learns about completions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reap {
    /// `io_uring_enter(to_submit, min_complete = 1, GETEVENTS)` for every operation: the
    /// thread sleeps in the kernel until its completion is posted.
    SubmitAndWait,
    /// `io_uring_enter(to_submit, 0)` to submit (nothing at all under SQPOLL unless the
    /// kernel thread went idle), then spin on the completion ring in user space.
    Peek,
    /// As `Peek` on a ring set up with IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG:
    /// the kernel does not interrupt the spinning thread (no IPI) to finish a completion; it
    /// sets IORING_SQ_TASKRUN instead, and the spinner enters the kernel (GETEVENTS) only
    /// when it sees that flag.
    PeekTaskrun,
}

/// How an operation names its socket and buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buffers {
    /// IORING_OP_SEND / IORING_OP_RECV on the file descriptor, plain user buffers.
    Plain,
    /// IORING_OP_WRITE_FIXED / IORING_OP_READ_FIXED on registered file 0 and registered
    /// buffer 0 (no fd lookup, no page pinning per operation).
    Registered,
}

/// No single wait may take longer than this: a stuck peer is an error, not a hang.
const WAIT_LIMIT: Duration = Duration::from_secs(10);

/// A ring bound to one socket, with one buffer the kernel may read and write.
pub struct RingEnd {
    // Field order matters: the ring (and its registrations) is torn down before the buffer
    // it may point into is freed.
    pub ring: IoUring,
    fd: RawFd,
    wait: Reap,
    buffers: Buffers,
    buf: Vec<u8>,
}

impl RingEnd {
    /// Binds `ring` to socket `fd` with a `buf_len`-byte buffer, registering both when
    /// `buffers` is `Registered`.
    pub fn new(
        ring: IoUring,
        fd: RawFd,
        wait: Reap,
        buffers: Buffers,
        buf_len: usize,
    ) -> io::Result<Self> {
        let mut buf = vec![0u8; buf_len];
        if buffers == Buffers::Registered {
            ring.submitter().register_files(&[fd])?;
            let iov = libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: buf.len(),
            };
            // SAFETY: `buf` is owned by the returned RingEnd, never reallocated, and freed
            // only after `ring` (declared first) is dropped, which unregisters it.
            unsafe { ring.submitter().register_buffers(&[iov])? };
        }
        Ok(Self {
            ring,
            fd,
            wait,
            buffers,
            buf,
        })
    }

    pub fn buf(&self) -> &[u8] {
        &self.buf
    }

    pub fn buf_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    fn check_range(&self, off: usize, len: usize) -> io::Result<u32> {
        if off.checked_add(len).is_none_or(|end| end > self.buf.len()) {
            return Err(protocol_error(format!(
                "range {off}+{len} outside the {}-byte buffer",
                self.buf.len()
            )));
        }
        u32::try_from(len).map_err(|_| protocol_error(format!("length {len} too large")))
    }

    /// Queues a send of `buf[off..off + len]` tagged `user_data` (`flags`: MSG_* flags, used by
    /// IORING_OP_SEND only).
    pub fn push_send(
        &mut self,
        off: usize,
        len: usize,
        flags: i32,
        user_data: u64,
    ) -> io::Result<()> {
        let n = self.check_range(off, len)?;
        let ptr = self.buf[off..].as_ptr();
        let sqe = match self.buffers {
            Buffers::Plain => opcode::Send::new(types::Fd(self.fd), ptr, n)
                .flags(flags)
                .build(),
            Buffers::Registered => opcode::WriteFixed::new(types::Fixed(0), ptr, n, 0).build(),
        };
        self.push(sqe.user_data(user_data))
    }

    /// Queues a receive into `buf[off..off + len]` tagged `user_data`.
    pub fn push_recv(&mut self, off: usize, len: usize, user_data: u64) -> io::Result<()> {
        let n = self.check_range(off, len)?;
        let ptr = self.buf[off..].as_mut_ptr();
        let sqe = match self.buffers {
            Buffers::Plain => opcode::Recv::new(types::Fd(self.fd), ptr, n).build(),
            Buffers::Registered => opcode::ReadFixed::new(types::Fixed(0), ptr, n, 0).build(),
        };
        self.push(sqe.user_data(user_data))
    }

    /// Queues IORING_OP_SEND_ZC of `buf[off..off + len]` from registered buffer 0, asking the
    /// kernel to report in the notification whether it had to copy after all.
    pub fn push_send_zc(
        &mut self,
        off: usize,
        len: usize,
        flags: i32,
        user_data: u64,
    ) -> io::Result<()> {
        /// IORING_SEND_ZC_REPORT_USAGE (include/uapi/linux/io_uring.h).
        const REPORT_USAGE: u16 = 1 << 3;
        let n = self.check_range(off, len)?;
        let ptr = self.buf[off..].as_ptr();
        let mut op = opcode::SendZc::new(types::Fd(self.fd), ptr, n)
            .flags(flags)
            .zc_flags(REPORT_USAGE);
        if self.buffers == Buffers::Registered {
            op = op.buf_index(Some(0));
        }
        self.push(op.build().user_data(user_data))
    }

    fn push(&mut self, sqe: squeue::Entry) -> io::Result<()> {
        // SAFETY: every SQE built here points into `self.buf`, which outlives the ring, and
        // the callers do not touch that range again until they have reaped its completion.
        unsafe { self.ring.submission().push(&sqe) }
            .map_err(|_| protocol_error("submission queue full".to_owned()))
    }

    /// Hands queued SQEs to the kernel without waiting. Under `SubmitAndWait` this does
    /// nothing: the next `next_cqe` submits and waits in one system call.
    pub fn flush(&mut self) -> io::Result<()> {
        if self.wait != Reap::SubmitAndWait {
            self.ring.submit()?;
        }
        Ok(())
    }

    /// The next completion: (user_data, result, flags).
    pub fn next_cqe(&mut self) -> io::Result<(u64, i32, u32)> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if let Some(cqe) = self.ring.completion().next() {
                return Ok((cqe.user_data(), cqe.result(), cqe.flags()));
            }
            match self.wait {
                Reap::SubmitAndWait => {
                    self.ring.submit_and_wait(1)?;
                }
                Reap::Peek => {
                    spins = spins.wrapping_add(1);
                    pause(spins);
                }
                Reap::PeekTaskrun => {
                    if self.ring.submission().taskrun() {
                        // Runs the pending task work, which posts the completion.
                        self.ring.submit()?;
                    } else {
                        spins = spins.wrapping_add(1);
                        pause(spins);
                    }
                }
            }
            if spins.is_multiple_of(1024) && start.elapsed() > WAIT_LIMIT {
                return Err(protocol_error("no completion within 10 s".to_owned()));
            }
        }
    }
}

/// Whether a completion carries IORING_CQE_F_NOTIF (a SEND_ZC buffer-release notification).
pub fn is_notif(flags: u32) -> bool {
    cqueue::notif(flags)
}

/// Whether more completions follow for the same request (SEND_ZC: its notification).
pub fn has_more(flags: u32) -> bool {
    cqueue::more(flags)
}

impl RingEnd {
    /// How this end waits for completions.
    pub fn wait(&self) -> Reap {
        self.wait
    }
}
