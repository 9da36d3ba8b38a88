//! `AsyncRead`/`AsyncWrite` for iWARP streams (feature `tokio`).
//!
//! The stream's completion channel (an eventfd the stack writes at every completion once
//! the CQs are armed) wakes the task through tokio's [`AsyncFd`]: an operation that would
//! block parks the task's waker on the connection and arms the CQs
//! ([`IwarpStream::park`]), tries once more, and only then waits for the channel. The
//! reading and the writing side each register their own duplicate of the eventfd, so the
//! halves of `tokio::io::split` may run in different tasks.
//!
//! Whoever polls the stream drains the eventfd, so a completion that one side took (data
//! for a parked reader, a grant for a parked writer) may never reach the reactor as an
//! event: the poll that counts an event of a parked direction wakes that task itself.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

use crate::IwarpStream;

/// An iWARP stream for tokio: [`AsyncRead`] and [`AsyncWrite`], made inside a tokio runtime
/// from an [`IwarpStream`] in iWARP mode ([`AsyncIwarpStream::new`]). Its blocking mode
/// does not matter: every operation here is non-blocking.
#[derive(Debug)]
pub struct AsyncIwarpStream {
    stream: IwarpStream,
    reads: AsyncFd<OwnedFd>,
    writes: AsyncFd<OwnedFd>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Read,
    Write,
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

    /// Runs `op` for `side` until it does not return `WouldBlock`, parking the task on
    /// that side's eventfd in between. The waker is parked on the connection before the
    /// last try, so an event of this side that any poll takes from then on wakes it.
    fn poll_op<T>(
        &self,
        side: Side,
        cx: &mut Context<'_>,
        mut op: impl FnMut() -> io::Result<T>,
    ) -> Poll<io::Result<T>> {
        let write = side == Side::Write;
        let fd = if write { &self.writes } else { &self.reads };
        let done = |r: io::Result<T>| {
            self.stream.unpark(write);
            Poll::Ready(r)
        };
        loop {
            match op() {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return done(r),
            }
            self.stream.park(write, cx.waker());
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
