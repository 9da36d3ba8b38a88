//! Async APIs over tokio (feature `tokio`): completions, connection manager events and device
//! asynchronous events as futures and [`Stream`]s, woken by the stack's eventfds through
//! tokio's [`AsyncFd`]. Nothing polls in a loop: a task that waits is parked until the
//! eventfd it waits on is written.
//!
//! | blocking | async |
//! | --- | --- |
//! | a CQ + [`CompletionChannel`] + `req_notify` + `get_cq_event` + `poll` | [`Device::create_async_cq`] → [`AsyncCq::next`], [`AsyncCq::next_batch`], `Stream` of completions |
//! | [`CompletionChannel::get_cq_event`] (one channel, several CQs) | [`CompletionChannel::get_cq_event_async`], [`AsyncCompletionChannel`] (a `Stream` of CQs) |
//! | [`CmEventChannel::get_event`] | [`CmEventChannel::next_event`], [`CmEventChannel::events`] (a `Stream`) |
//! | [`CmEventChannel::connect_blocking`] | [`CmEventChannel::connect_async`] |
//! | [`CmListener::get_request`], [`CmListener::accept`] | [`CmListener::get_request_async`], [`CmListener::accept_async`] |
//! | [`Device::get_async_event`] | [`Device::next_async_event`], [`Device::async_events`] (a `Stream`) |
//!
//! Each waiter registers its own duplicate of the eventfd with the runtime of the task that
//! creates it (the types that hold one, [`AsyncCq`], [`AsyncCompletionChannel`],
//! [`CmEvents`] and [`AsyncEvents`], belong to that runtime); calling them outside a tokio
//! runtime returns [`Error::InvalidArgument`]. The stack writes its eventfds at every event
//! (not only when a queue becomes non-empty), so that an edge-triggered waiter that found
//! nothing for itself wakes again at the next one. Timeouts are the runtime's
//! (`tokio::time::timeout`); dropping a future cancels the wait and loses nothing (events
//! stay queued until taken).
//!
//! Many tasks may await one [`AsyncCq`] at once: each completion goes to one of them. For
//! the lowest overhead give each task (or each group of QPs) its own CQ.

use std::future::poll_fn;
use std::net::ToSocketAddrs;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_core::Stream;
use softwarp_engine::event::AsyncEvent;
use softwarp_engine::wr::WorkCompletion;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::cm::{
    CmEvent, CmEventChannel, CmId, CmListener, ConnectOptions, ConnectRequest, ConnectionInfo,
};
use crate::error::{Error, Result};
use crate::verbs::cq::{CompletionChannel, CompletionQueue};
use crate::verbs::device::{Device, DeviceShared};
use crate::verbs::qp::QueuePair;

/// A duplicate of one of the stack's eventfds (readable while something is queued, written
/// at every new item), registered with the current tokio runtime.
#[derive(Debug)]
struct Readiness {
    fd: AsyncFd<OwnedFd>,
}

impl Readiness {
    #[allow(unsafe_code)]
    fn new(fd: BorrowedFd<'_>) -> Result<Self> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::InvalidArgument(
                "softwarp's async APIs must be called inside a tokio runtime",
            ));
        }
        let dup = fd
            .try_clone_to_owned()
            .map_err(|e| Error::io("dup an eventfd", e))?;
        // SAFETY: `dup` is an `OwnedFd`: a valid open descriptor that `AsyncFd` owns, and
        // whose `as_raw_fd` returns the same descriptor until the `AsyncFd` drops it.
        let fd = unsafe { AsyncFd::register_with_interest(dup, Interest::READABLE) }
            .map_err(|e| Error::io("register an eventfd with the tokio reactor", e.into()))?;
        Ok(Self { fd })
    }

    /// Calls `take` until it yields, parking the task on the eventfd in between.
    ///
    /// `take` runs again after every readiness the reactor reports, before that readiness is
    /// cleared: tokio clears only the readiness it reported, so an event written after the
    /// second `take` found nothing wakes the task again.
    fn poll_take<T>(
        &self,
        cx: &mut Context<'_>,
        mut take: impl FnMut() -> Result<Option<T>>,
    ) -> Poll<Result<T>> {
        loop {
            if let Some(v) = take()? {
                return Poll::Ready(Ok(v));
            }
            let mut guard = match self.fd.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => {
                    return Poll::Ready(Err(Error::io("wait for an eventfd", e)));
                }
                Poll::Ready(Ok(guard)) => guard,
            };
            if let Some(v) = take()? {
                return Poll::Ready(Ok(v));
            }
            guard.clear_ready();
        }
    }
}

/// A completion queue with its own completion channel, awaited: [`AsyncCq::next`],
/// [`AsyncCq::next_batch`], or as a [`Stream`] of completions (which never ends). Made by
/// [`Device::create_async_cq`]; give [`AsyncCq::cq`] to [`crate::QpInitAttr`].
///
/// A wait polls the CQ, arms it ([`CompletionQueue::req_notify`]), polls once more and
/// only then parks on the channel's eventfd, so no completion is missed and none is waited
/// for twice.
///
/// Leave the CQ in event mode (not [`CompletionQueue::set_busy_poll`]): a busy-polled CQ's
/// QPs move their bytes when the CQ is polled, and a parked task polls nothing: they would
/// wait 10 to 20 ms for the progress thread to take them over each time it parks.
#[derive(Debug)]
pub struct AsyncCq {
    cq: CompletionQueue,
    channel: CompletionChannel,
    ready: Readiness,
}

impl Device {
    /// Creates a CQ for at least `cqe` completions with a completion channel of its own,
    /// for awaiting completions (inside a tokio runtime; see [`AsyncCq`]).
    #[track_caller]
    pub fn create_async_cq(&self, cqe: usize) -> Result<AsyncCq> {
        let channel = self.create_comp_channel()?;
        let ready = Readiness::new(channel.as_fd())?;
        let cq = self.create_cq(cqe, Some(&channel))?;
        Ok(AsyncCq { cq, channel, ready })
    }

    /// Waits for the next asynchronous event (QP fatal/access/request error, CQ error, SRQ
    /// limit, device fatal) without blocking a thread: the async form of
    /// [`Device::get_async_event`].
    pub async fn next_async_event(&self) -> Result<AsyncEvent> {
        let ready = Readiness::new(self.async_event_fd())?;
        let shared = &self.shared;
        poll_fn(|cx| ready.poll_take(cx, || Ok(shared.events.take(Some(Duration::ZERO))))).await
    }

    /// The device's asynchronous events as a [`Stream`] (it never ends).
    pub fn async_events(&self) -> Result<AsyncEvents> {
        Ok(AsyncEvents {
            ready: Readiness::new(self.async_event_fd())?,
            shared: Arc::clone(&self.shared),
        })
    }
}

impl AsyncCq {
    /// The CQ (for [`crate::QpInitAttr`], statistics, or a plain [`CompletionQueue::poll`]).
    pub fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// Polls for up to `wcs.len()` completions: ready with at least one (or an error, e.g.
    /// [`Error::CqOverflowed`]), pending until one arrives.
    pub fn poll_batch(
        &self,
        cx: &mut Context<'_>,
        wcs: &mut [WorkCompletion],
    ) -> Poll<Result<usize>> {
        if wcs.is_empty() {
            return Poll::Ready(Ok(0));
        }
        self.ready.poll_take(cx, || {
            let n = self.cq.poll(wcs)?;
            if n > 0 {
                return Ok(Some(n));
            }
            // Consume a notification already given (this channel serves only this CQ), arm
            // for the next completion, and look again for one that came before the arming.
            let _ = self.channel.try_get_cq_event();
            self.cq.req_notify(false)?;
            let n = self.cq.poll(wcs)?;
            Ok((n > 0).then_some(n))
        })
    }

    /// Waits for at least one completion and moves up to `wcs.len()` into `wcs`; returns how
    /// many.
    pub async fn next_batch(&self, wcs: &mut [WorkCompletion]) -> Result<usize> {
        poll_fn(|cx| self.poll_batch(cx, wcs)).await
    }

    /// Waits for the next completion.
    pub async fn next(&self) -> Result<WorkCompletion> {
        poll_fn(|cx| self.poll_one(cx)).await
    }

    fn poll_one(&self, cx: &mut Context<'_>) -> Poll<Result<WorkCompletion>> {
        let mut wc = [crate::verbs::cq::EMPTY_COMPLETION];
        self.poll_batch(cx, &mut wc).map_ok(|_| wc[0])
    }
}

impl Stream for AsyncCq {
    type Item = Result<WorkCompletion>;
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.poll_one(cx).map(Some)
    }
}

/// A [`CompletionChannel`] awaited: which of its CQs fired ([`AsyncCompletionChannel::get_cq_event`],
/// or as a [`Stream`] of CQs). Arm the CQs with [`CompletionQueue::req_notify`] as in event
/// mode; each fired CQ is disarmed.
#[derive(Debug)]
pub struct AsyncCompletionChannel {
    channel: CompletionChannel,
    ready: Readiness,
}

impl AsyncCompletionChannel {
    /// Registers `channel` with the current tokio runtime.
    pub fn new(channel: CompletionChannel) -> Result<Self> {
        Ok(Self {
            ready: Readiness::new(channel.as_fd())?,
            channel,
        })
    }

    /// The channel.
    pub fn channel(&self) -> &CompletionChannel {
        &self.channel
    }

    /// Polls for a CQ of this channel that fired.
    pub fn poll_cq_event(&self, cx: &mut Context<'_>) -> Poll<Result<CompletionQueue>> {
        self.ready
            .poll_take(cx, || Ok(self.channel.try_get_cq_event()))
    }

    /// Waits until an armed CQ of this channel fires and returns it.
    pub async fn get_cq_event(&self) -> Result<CompletionQueue> {
        poll_fn(|cx| self.poll_cq_event(cx)).await
    }
}

impl Stream for AsyncCompletionChannel {
    type Item = Result<CompletionQueue>;
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.poll_cq_event(cx).map(Some)
    }
}

impl CompletionChannel {
    /// [`CompletionChannel::get_cq_event`] without blocking a thread (registers the
    /// channel with the current runtime for this one wait; [`AsyncCompletionChannel`] keeps
    /// the registration).
    pub async fn get_cq_event_async(&self) -> Result<CompletionQueue> {
        let ready = Readiness::new(self.as_fd())?;
        poll_fn(|cx| ready.poll_take(cx, || Ok(self.try_get_cq_event()))).await
    }
}

/// A device's asynchronous events as a [`Stream`] ([`Device::async_events`]). It does not
/// keep the device open.
#[derive(Debug)]
pub struct AsyncEvents {
    shared: Arc<DeviceShared>,
    ready: Readiness,
}

impl Stream for AsyncEvents {
    type Item = Result<AsyncEvent>;
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let shared = &this.shared;
        this.ready
            .poll_take(cx, || Ok(shared.events.take(Some(Duration::ZERO))))
            .map(Some)
    }
}

/// A CM event channel's events as a [`Stream`] ([`CmEventChannel::events`]; it never
/// ends).
#[derive(Debug)]
pub struct CmEvents<'a> {
    channel: &'a CmEventChannel,
    ready: Readiness,
}

impl Stream for CmEvents<'_> {
    type Item = Result<CmEvent>;
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let events = &this.channel.shared().events;
        this.ready
            .poll_take(cx, || Ok(events.take(Some(Duration::ZERO), |_| true)))
            .map(Some)
    }
}

impl CmEventChannel {
    /// The next event, without blocking a thread: the async form of
    /// [`CmEventChannel::get_event`].
    pub async fn next_event(&self) -> Result<CmEvent> {
        self.next_event_matching(|_| true).await
    }

    /// The oldest event for which `pred` holds; other events stay queued in order.
    pub async fn next_event_matching(
        &self,
        mut pred: impl FnMut(&CmEvent) -> bool,
    ) -> Result<CmEvent> {
        let ready = Readiness::new(self.as_fd())?;
        let events = &self.shared().events;
        poll_fn(|cx| ready.poll_take(cx, || Ok(events.take(Some(Duration::ZERO), &mut pred)))).await
    }

    /// The channel's events as a [`Stream`].
    pub fn events(&self) -> Result<CmEvents<'_>> {
        Ok(CmEvents {
            ready: Readiness::new(self.as_fd())?,
            channel: self,
        })
    }

    /// [`CmEventChannel::connect`], then awaits the outcome: the async form of
    /// [`CmEventChannel::connect_blocking`] (a host name in `addr` is resolved by the system
    /// resolver on the calling thread). Other events stay queued.
    pub async fn connect_async<A: ToSocketAddrs>(
        &self,
        qp: &QueuePair,
        addr: A,
        opts: &ConnectOptions,
    ) -> Result<(CmId, ConnectionInfo)> {
        let id = self.connect(qp, addr, opts)?;
        let conn = id.conn_id();
        let ev = self
            .next_event_matching(|e| e.conn_id() == Some(conn) && e.ends_attempt())
            .await?;
        crate::cm::attempt_outcome(id, ev)
    }
}

impl CmListener {
    /// The next connection request of this listener, without blocking a thread. Other
    /// events stay queued on the channel.
    pub async fn get_request_async(&self) -> Result<ConnectRequest> {
        let id = self.id();
        let events = &self.channel.events;
        let ready = Readiness::new(events.fd().as_fd())?;
        let ev = poll_fn(|cx| {
            ready.poll_take(cx, || {
                Ok(events.take(
                    Some(Duration::ZERO),
                    |e| matches!(e, CmEvent::ConnectRequest(r) if r.listener_id() == id),
                ))
            })
        })
        .await?;
        match ev {
            CmEvent::ConnectRequest(r) => Ok(r),
            _ => Err(Error::InvalidArgument(
                "unexpected connection manager event",
            )),
        }
    }

    /// Awaits the next request and accepts it into `qp` with `opts`: the async form of
    /// [`CmListener::accept`] (it takes the connection's [`CmEvent::Established`] off the
    /// channel as well). The MPA Reply is written on the calling thread by
    /// [`ConnectRequest::accept`]: one small write to a fresh connection, which blocks only if
    /// the peer's receive window is closed (bounded by `opts.timeout`).
    pub async fn accept_async(
        &self,
        qp: &QueuePair,
        opts: &ConnectOptions,
    ) -> Result<(CmId, ConnectionInfo)> {
        let req = self.get_request_async().await?;
        self.accept_request(req, qp, opts)
    }
}
