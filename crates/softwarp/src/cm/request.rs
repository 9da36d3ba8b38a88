//! [`ConnectRequest`]: a peer's MPA Request waiting at a listener for the application to
//! accept it into a QP or reject it.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::admission::Slot;
use super::channel::ChannelShared;
use super::event::{ConnId, ListenerId};
use super::id::{CmId, IdShared};
use super::negotiate::{self, FrameOut, PeerRequest};
use super::options::{ConnectOptions, ConnectionInfo, Role};
use crate::connect::map_io;
use crate::device::lock;
use crate::error::{Error, Result};
use crate::qp::{Establish, QueuePair};

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
        negotiate::max_private_data(self.req.revision.min(opts.revision))
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
        let local = shared.local_params(opts)?;
        let (reply, neg) = negotiate::accept(&self.req, opts, &local)?;
        let bytes = reply.encode()?;
        shared.begin_connect()?;
        let Some(mut stream) = slot.take() else {
            shared.abandon_connect();
            return Err(Error::AlreadyAnswered);
        };
        drop(slot);
        self.answered();
        if let Err(e) = write_blocking(&mut stream, &bytes, opts.timeout) {
            shared.abandon_connect();
            return Err(e);
        }
        let id = IdShared::new(
            self.conn_id,
            Role::Responder,
            self.channel.clone(),
            Arc::downgrade(shared),
        );
        let info: ConnectionInfo = shared.finish_connect(
            Ok((stream, neg)),
            Establish {
                opts,
                observer: Some(id.clone()),
                gate: opts.responder_waits_for_initiator,
                hold: std::time::Duration::ZERO,
            },
        )?;
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
        negotiate::check_private_data(private_data, revision)?;
        let mut slot = lock(&self.stream);
        let Some(mut stream) = slot.take() else {
            return Err(Error::AlreadyAnswered);
        };
        drop(slot);
        self.answered();
        let reply = negotiate::reject_reply(Some(&self.req), self.opts.revision, private_data);
        send_and_close(&mut stream, &reply, self.opts.timeout)
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
            let reply = negotiate::reject_reply(Some(&self.req), self.opts.revision, &[]);
            let _ = send_and_close(&mut stream, &reply, Duration::from_millis(100));
        }
    }
}

fn write_blocking(stream: &mut TcpStream, bytes: &[u8], timeout: Duration) -> Result<()> {
    stream
        .set_nonblocking(false)
        .map_err(|e| Error::io("clear O_NONBLOCK", e))?;
    stream
        .set_write_timeout(Some(timeout.max(Duration::from_millis(1))))
        .map_err(|e| Error::io("set socket timeout", e))?;
    stream
        .write_all(bytes)
        .map_err(|e| map_io("write MPA frame", e, timeout))
}

fn send_and_close(stream: &mut TcpStream, reply: &FrameOut, timeout: Duration) -> Result<()> {
    let r = write_blocking(stream, &reply.encode()?, timeout);
    let _ = stream.shutdown(std::net::Shutdown::Both);
    r
}
