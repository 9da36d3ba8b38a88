//! [`CmListener`]: a listening endpoint of the connection manager (after `rdma_listen`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::admission::{ListenerState, ListenerStats};
use super::channel::ChannelShared;
use super::event::{CmEvent, ListenerId};
use super::id::CmId;
use super::request::ConnectRequest;
use crate::error::{Error, Result};
use crate::verbs::qp::options::{ConnectOptions, ConnectionInfo};
use crate::verbs::qp::QueuePair;

/// Settings of a listener.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListenOptions {
    /// Length of the kernel's queue of TCP connections not yet accepted (`listen(2)`; the
    /// kernel caps it at `net.core.somaxconn`), and the most connections the listener holds
    /// itself: those whose MPA Request is being read plus the requests not answered yet
    /// (see [`crate::CmEventChannel::listen`]). 1024 by default; 0 counts as 1.
    pub backlog: u32,
    /// The policy requests are screened with before they are delivered (markers, highest
    /// revision) and the time a peer has to send its Request after the TCP connection;
    /// [`ConnectRequest::accept`] takes the settings of each Reply.
    pub options: ConnectOptions,
}

impl Default for ListenOptions {
    fn default() -> Self {
        Self {
            backlog: 1024,
            options: ConnectOptions::default(),
        }
    }
}

impl ListenOptions {
    /// Sets [`ListenOptions::backlog`].
    pub fn backlog(mut self, backlog: u32) -> Self {
        self.backlog = backlog;
        self
    }
    /// Sets [`ListenOptions::options`].
    pub fn options(mut self, options: ConnectOptions) -> Self {
        self.options = options;
        self
    }
}

/// A listening endpoint (after an `rdma_cm_id` in listen state). Its requests arrive on
/// the channel that created it ([`crate::CmEventChannel::listen`]). Dropping it stops
/// listening; requests not read yet stay on the channel.
#[derive(Debug)]
pub struct CmListener {
    id: ListenerId,
    local_addr: SocketAddr,
    state: Arc<ListenerState>,
    pub(crate) channel: Arc<ChannelShared>,
    /// Its entry in the resource tracker (`softwarp resources`), made where the application
    /// called [`crate::CmEventChannel::listen`].
    _ras: crate::instrument::Tracked,
}

impl CmListener {
    #[track_caller]
    pub(crate) fn new(state: Arc<ListenerState>, channel: Arc<ChannelShared>) -> Self {
        Self {
            id: state.id,
            local_addr: state.local_addr,
            _ras: crate::instrument::listener(Some(state.local_addr)),
            state,
            channel,
        }
    }

    /// Sends this listener's events ([`CmEvent::ConnectRequest`]s, request errors) to `to`
    /// from now on, with those already queued, and the events of the connections its
    /// requests become (after `rdma_migrate_id`). The channel that made the listener still
    /// drives it and must stay open; routed back to it, its events come home. The blocking
    /// [`CmListener::accept`] and [`CmListener::get_request`] read the channel that made
    /// it: read `to` instead.
    ///
    /// [`CmEvent::ConnectRequest`]: super::CmEvent::ConnectRequest
    pub fn route_events_to(&self, to: &super::CmEventChannel) {
        self.channel
            .route(super::channel::Route::Listener(self.id), to.shared());
    }

    /// Connections held (negotiating, unanswered) and what was accepted, delivered and
    /// shed; also exported as the `softwarp_cm_listener_*` statistics.
    pub fn stats(&self) -> ListenerStats {
        self.state.stats()
    }

    /// The identifier its events carry.
    pub fn id(&self) -> ListenerId {
        self.id
    }

    /// The address it listens on (with the port chosen for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The next connection request of this listener, waiting at most `timeout` (`None`: no
    /// limit). Other events stay queued on the channel.
    pub fn get_request(&self, timeout: Option<Duration>) -> Result<ConnectRequest> {
        crate::availability::context::check_wait("CmListener::get_request", timeout)?;
        let id = self.id;
        let ev = self
            .channel
            .events
            .take(
                timeout,
                |e| matches!(e, CmEvent::ConnectRequest(r) if r.listener_id() == id),
            )
            .ok_or(Error::Timeout(timeout.unwrap_or_default()))?;
        match ev {
            CmEvent::ConnectRequest(r) => Ok(r),
            _ => Err(Error::InvalidArgument(
                "unexpected connection manager event",
            )),
        }
    }

    /// Waits for the next request (at most `timeout`) and accepts it into `qp` with `opts`.
    /// Like [`crate::CmEventChannel::connect_blocking`], it takes the connection's
    /// [`CmEvent::Established`] off the channel (later events of the connection stay).
    pub fn accept(
        &self,
        qp: &QueuePair,
        opts: &ConnectOptions,
        timeout: Option<Duration>,
    ) -> Result<(CmId, ConnectionInfo)> {
        let req = self.get_request(timeout)?;
        self.accept_request(req, qp, opts)
    }

    /// Accepts `req` into `qp` and takes its `Established` event off the channel (it is
    /// queued before `accept` returns), for [`CmListener::accept`] and its async twin.
    pub(crate) fn accept_request(
        &self,
        req: ConnectRequest,
        qp: &QueuePair,
        opts: &ConnectOptions,
    ) -> Result<(CmId, ConnectionInfo)> {
        let id = req.accept(qp, opts)?;
        let conn = id.conn_id();
        // Reported before accept returned: no wait.
        let _ = self.channel.events.take(
            Some(Duration::ZERO),
            |e| matches!(e, CmEvent::Established { id, .. } if *id == conn),
        );
        let info = id.connection().ok_or(Error::InvalidArgument(
            "accepted connection has no information",
        ))?;
        Ok((id, info))
    }
}

impl Drop for CmListener {
    fn drop(&mut self) {
        self.channel.unlisten(self.id);
    }
}
