//! [`ConnectRequest`]: a peer's MPA Request waiting at a listener for the application to
//! accept it into a QP or reject it.

use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use softwarp_engine::mpa::{self, PeerRequest};

use super::admission::Slot;
use super::attempt;
use super::channel::ChannelShared;
use super::event::{ConnId, ListenerId};
use super::id::{CmId, IdShared};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::verbs::qp::options::{ConnectOptions, ConnectionInfo, Role};
use crate::verbs::qp::QueuePair;

/// A peer's MPA Request, delivered as [`super::CmEvent::ConnectRequest`] (after
/// `RDMA_CM_EVENT_CONNECT_REQUEST`): the peer waits for the Reply.
///
/// Answer it once, from any thread: [`ConnectRequest::accept`] (the MPA Reply, then the QP
/// is in RTS) or [`ConnectRequest::reject`] (a Reply with the R bit). A call refused for a
/// local reason (private data too long, QP not Idle, IRD/ORD beyond the QP) leaves the
/// request answerable. Dropping an unanswered request rejects it.
#[derive(Debug)]
pub struct ConnectRequest {
    conn_id: ConnId,
    listener: ListenerId,
    peer_addr: SocketAddr,
    local_addr: SocketAddr,
    req: PeerRequest,
    /// The listener's options: the revision it answers with and its timeout.
    opts: Arc<ConnectOptions>,
    stream: Mutex<Option<TcpStream>>,
    channel: Weak<ChannelShared>,
    /// Its place at the listener (bounded by the backlog), given back when answered.
    slot: Mutex<Option<Slot>>,
}

impl ConnectRequest {
    pub(crate) fn new(
        conn_id: ConnId,
        stream: TcpStream,
        peer_addr: SocketAddr,
        req: PeerRequest,
        opts: Arc<ConnectOptions>,
        slot: Slot,
    ) -> Result<Self> {
        let (listener, channel) = (slot.listener_id(), slot.channel());
        let local_addr = stream
            .local_addr()
            .map_err(|e| Error::io("getsockname", e))?;
        Ok(Self {
            conn_id,
            listener,
            peer_addr,
            local_addr,
            req,
            opts,
            stream: Mutex::new(Some(stream)),
            channel,
            slot: Mutex::new(Some(slot)),
        })
    }

    /// The identifier the connection's events will carry.
    pub fn conn_id(&self) -> ConnId {
        self.conn_id
    }

    /// Sends the events of the connection this request becomes to `to` (after
    /// `rdma_migrate_id` of a request's id); see [`crate::CmId::route_events_to`].
    pub fn route_events_to(&self, to: &super::CmEventChannel) -> Result<()> {
        let ch = self.channel.upgrade().ok_or(Error::ChannelClosed)?;
        ch.route(super::channel::Route::Conn(self.conn_id), to.shared());
        Ok(())
    }

    /// The listener the request arrived at.
    pub fn listener_id(&self) -> ListenerId {
        self.listener
    }

    /// The initiator's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer_addr
    }

    /// The address the request arrived at.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The initiator's private data (after the RFC 6581 prefix).
    pub fn private_data(&self) -> &[u8] {
        &self.req.private_data
    }

    /// The MPA revision of the Request (1 or 2).
    pub fn revision(&self) -> u8 {
        self.req.revision.value()
    }

    /// The initiator's IRD and ORD (revision 2 with the RFC 6581 prefix only).
    pub fn peer_ird_ord(&self) -> Option<(u16, u16)> {
        self.req.enhanced.map(|e| (e.ird, e.ord))
    }

    /// The initiator asks for RFC 6581 peer-to-peer mode.
    pub fn peer_to_peer(&self) -> bool {
        self.req.enhanced.is_some_and(|e| e.peer_to_peer)
    }

    /// The initiator's C bit: it asks for CRC (then CRC is used whatever the reply says).
    pub fn crc_requested(&self) -> bool {
        self.req.crc
    }

    /// The initiator's M bit: it asks for markers in what we send.
    pub fn markers_requested(&self) -> bool {
        self.req.marker
    }

    /// The most private data a Reply under `opts` can carry (508 or 512 bytes, by the
    /// revision it answers with).
    pub fn max_reply_private_data(&self, opts: &ConnectOptions) -> usize {
        mpa::max_private_data(self.req.revision.min(opts.revision))
    }

    /// Accepts the request into `qp` (Idle, receives posted) with the settings `opts`
    /// (private data for the Reply, IRD/ORD, CRC, RTR types, ...): sends the MPA Reply and
    /// moves the QP to RTS. [`super::CmEvent::Established`] is reported on the channel too.
    pub fn accept(&self, qp: &QueuePair, opts: &ConnectOptions) -> Result<CmId> {
        let mut slot = lock(&self.stream);
        if slot.is_none() {
            return Err(Error::AlreadyAnswered);
        }
        let shared = qp.shared();
        let (bytes, neg) = attempt::reply_for(shared, &self.req, opts)?;
        shared.begin_connect()?;
        let Some(stream) = slot.take() else {
            shared.abandon_connect();
            return Err(Error::AlreadyAnswered);
        };
        drop(slot);
        self.answered();
        let id = IdShared::new(
            self.conn_id,
            Role::Responder,
            self.channel.clone(),
            Arc::downgrade(shared),
        );
        let info: ConnectionInfo =
            attempt::send_reply(shared, stream, &bytes, neg, opts, Some(id.clone()))?;
        id.established(info);
        Ok(CmId { shared: id })
    }

    /// Gives the request's place at the listener back (it may accept another connection).
    fn answered(&self) {
        drop(lock(&self.slot).take());
    }

    /// Rejects the request: an MPA Reply with the R bit carrying `private_data` (the
    /// reason, for the initiator's application; at most [`Self::max_reply_private_data`]),
    /// then the connection is closed.
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        let revision = self.req.revision.min(self.opts.revision);
        mpa::check_private_data(private_data, revision)?;
        let mut slot = lock(&self.stream);
        let Some(mut stream) = slot.take() else {
            return Err(Error::AlreadyAnswered);
        };
        drop(slot);
        self.answered();
        attempt::reject(
            &mut stream,
            Some(&self.req),
            &self.opts,
            private_data,
            self.opts.timeout,
        )
    }
}

impl Drop for ConnectRequest {
    fn drop(&mut self) {
        let slot = self
            .stream
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(mut stream) = slot {
            tracing::debug!(conn = %self.conn_id, "unanswered connection request rejected");
            let _ = attempt::reject(
                &mut stream,
                Some(&self.req),
                &self.opts,
                &[],
                Duration::from_millis(100),
            );
        }
    }
}
