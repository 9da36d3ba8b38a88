//! `AsyncRead`/`AsyncWrite` for iWARP streams (feature `tokio`).
//!
//! The stream's completion channel (an eventfd the stack writes at every completion once
//! the CQs are armed) wakes the task through tokio's [`AsyncFd`]: an operation that would
//! block arms the CQs ([`IwarpStream::arm_readiness`]), tries once more, and only then parks
//! the task. The reading and the writing side each register their own duplicate of the
//! eventfd, so the halves of `tokio::io::split` may run in different tasks.
//!
//! Whoever polls the stream drains the eventfd, so a completion that one side processed (a
//! grant that lets the other side write, say) may never reach the reactor as an event for
//! the other side. Each side therefore leaves its waker here before it arms the CQs, and a
//! poll that finds the other side able to go on wakes it.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

use crate::{IwarpStream, Readiness};

/// An iWARP stream for tokio: [`AsyncRead`] and [`AsyncWrite`], made inside a tokio runtime
/// from an [`IwarpStream`] in iWARP mode ([`AsyncIwarpStream::new`]). Its blocking mode
/// does not matter: every operation here is non-blocking.
#[derive(Debug)]
pub struct AsyncIwarpStream {
    stream: IwarpStream,
    reads: AsyncFd<OwnedFd>,
    writes: AsyncFd<OwnedFd>,
    /// The parked sides' wakers: reading, writing.
    parked: Mutex<[Option<Waker>; 2]>,
}

#[derive(Debug, Clone, Copy)]
enum Side {
    Read = 0,
    Write = 1,
}

fn can(side: Side, r: &Readiness) -> bool {
    match side {
        Side::Read => r.readable,
        Side::Write => r.writable,
    }
}

#[allow(unsafe_code)]
fn register(stream: &IwarpStream) -> io::Result<AsyncFd<OwnedFd>> {
    let dup = stream.as_fd().try_clone_to_owned()?;
    // SAFETY: `dup` is an `OwnedFd`: a valid open descriptor that `AsyncFd` owns, and whose
    // `as_raw_fd` returns the same descriptor until the `AsyncFd` drops it.
    unsafe { AsyncFd::register_with_interest(dup, Interest::READABLE) }.map_err(Into::into)
}

impl AsyncIwarpStream {
    /// Wraps `stream` (iWARP mode; `Unsupported` for a plain TCP stream, which tokio's own
    /// `TcpStream` serves). Must be called inside a tokio runtime.
    pub fn new(stream: IwarpStream) -> io::Result<Self> {
        if !stream.is_iwarp() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "a plain TCP stream: use tokio::net::TcpStream",
            ));
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(io::Error::other(
                "AsyncIwarpStream must be made inside a tokio runtime",
            ));
        }
        let reads = register(&stream)?;
        let writes = register(&stream)?;
        Ok(Self {
            stream,
            reads,
            writes,
            parked: Mutex::new([None, None]),
        })
    }

    /// The stream (for the one-sided extensions, addresses, counters).
    pub fn get_ref(&self) -> &IwarpStream {
        &self.stream
    }

    /// The stream again.
    pub fn into_inner(self) -> IwarpStream {
        self.stream
    }

    fn parked(&self) -> MutexGuard<'_, [Option<Waker>; 2]> {
        self.parked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes the parked sides other than `me` that `r` says can go on.
    fn wake_ready(&self, me: Option<Side>, r: &Readiness) {
        let mut parked = self.parked();
        for side in [Side::Read, Side::Write] {
            if me.is_some_and(|m| m as usize == side as usize) {
                continue;
            }
            if can(side, r) || r.error {
                if let Some(w) = parked[side as usize].take() {
                    w.wake();
                }
            }
        }
    }

    /// Runs `op` for `side` until it does not return `WouldBlock`, parking the task on
    /// that side's eventfd in between. The waker is left here before the CQs are armed, so
    /// a completion that the other side processes from then on wakes this one.
    fn poll_op<T>(
        &self,
        side: Side,
        cx: &mut Context<'_>,
        mut op: impl FnMut() -> io::Result<T>,
    ) -> Poll<io::Result<T>> {
        let fd = match side {
            Side::Read => &self.reads,
            Side::Write => &self.writes,
        };
        let done = |r: io::Result<T>| {
            self.parked()[side as usize] = None;
            // This call may have processed what the other side waits for.
            if self.parked().iter().any(Option::is_some) {
                self.wake_ready(Some(side), &self.stream.poll_ready());
            }
            Poll::Ready(r)
        };
        loop {
            match op() {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return done(r),
            }
            self.parked()[side as usize] = Some(cx.waker().clone());
            let r = self.stream.arm_readiness();
            self.wake_ready(Some(side), &r);
            match op() {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return done(r),
            }
            let mut guard = match fd.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return done(Err(e)),
                Poll::Ready(Ok(g)) => g,
            };
            match op() {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return done(r),
            }
            guard.clear_ready();
        }
    }
}

impl AsyncRead for AsyncIwarpStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let stream = &this.stream;
        let n = match this.poll_op(Side::Read, cx, || {
            stream.read_with(buf.initialize_unfilled(), true)
        }) {
            Poll::Ready(Ok(n)) => n,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => return Poll::Pending,
        };
        buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for AsyncIwarpStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.poll_op(Side::Write, cx, || this.stream.write_with(buf, true))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Written bytes are posted Sends already; the stack moves them.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Done once the EOF has left (it may wait for a credit): a task that ends after its
        // shutdown leaves no EOF behind that only a later call would send.
        let this = self.get_mut();
        this.stream.shutdown_write_nowait()?;
        this.poll_op(Side::Write, cx, || {
            if this.stream.eof_pending() {
                Err(io::ErrorKind::WouldBlock.into())
            } else {
                Ok(())
            }
        })
    }
}
