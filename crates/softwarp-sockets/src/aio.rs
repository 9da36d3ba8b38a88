//! `AsyncRead`/`AsyncWrite` for iWARP streams (feature `tokio`).
//!
//! The stream's completion channel (an eventfd the stack writes at every completion once
//! the CQs are armed) wakes the task through tokio's [`AsyncFd`]: an operation that would
//! block arms the CQs ([`IwarpStream::arm_readiness`]), tries once more, and only then parks
//! the task. The reading and the writing side each register their own duplicate of the
//! eventfd, so the halves of `tokio::io::split` may run in different tasks.

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
}

/// Runs `op` until it does not return `WouldBlock`, parking the task on `fd` in between.
fn poll_op<T>(
    stream: &IwarpStream,
    fd: &AsyncFd<OwnedFd>,
    cx: &mut Context<'_>,
    mut op: impl FnMut() -> io::Result<T>,
) -> Poll<io::Result<T>> {
    loop {
        match op() {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            r => return Poll::Ready(r),
        }
        // After arming, either the operation can proceed or the next completion writes
        // the eventfd.
        stream.arm_readiness();
        let mut guard = match fd.poll_read_ready(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Ready(Ok(g)) => g,
        };
        match op() {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            r => return Poll::Ready(r),
        }
        guard.clear_ready();
    }
}

impl AsyncRead for AsyncIwarpStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let n = match poll_op(&this.stream, &this.reads, cx, || {
            this.stream.read_with(buf.initialize_unfilled(), true)
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
        poll_op(&this.stream, &this.writes, cx, || {
            this.stream.write_with(buf, true)
        })
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Written bytes are posted Sends already; the stack moves them.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.stream.shutdown(std::net::Shutdown::Write))
    }
}
