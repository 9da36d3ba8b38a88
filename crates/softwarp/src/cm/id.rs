//! [`CmId`]: one connection of the connection manager (after `rdma_cm_id`), and the hook
//! through which its QP's connection reports that it went away.

use std::sync::{Arc, Mutex, Weak};

use super::channel::ChannelShared;
use super::event::{CmEvent, ConnId, DisconnectReason};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::verbs::qp::options::{ConnectionInfo, Role};
use crate::verbs::qp::{ConnObserver, LinkDown, QpShared};

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmState {
    /// Active side: TCP connect and MPA exchange in progress.
    Connecting,
    /// Established: the QP is in RTS.
    Established,
    /// A graceful disconnect was requested; outstanding work drains.
    Disconnecting,
    /// The connection ended ([`CmEvent::Disconnected`] was reported); the socket may still
    /// be closing.
    Disconnected,
    /// The socket is closed ([`CmEvent::TimewaitExit`] was reported).
    Closed,
    /// The connection attempt failed (rejected, unreachable, negotiation error).
    Failed,
}

#[derive(Debug)]
struct IdState {
    state: CmState,
    qp: Weak<QpShared>,
    info: Option<ConnectionInfo>,
    reason: Option<DisconnectReason>,
    disconnected_sent: bool,
    /// Events that happened before Established was reported (kept in order).
    deferred: Vec<CmEvent>,
}

/// State shared by the [`CmId`] handles of a connection, its QP's hook and the channel.
#[derive(Debug)]
pub(crate) struct IdShared {
    conn_id: ConnId,
    role: Role,
    channel: Weak<ChannelShared>,
    st: Mutex<IdState>,
}

impl IdShared {
    pub(crate) fn new(
        conn_id: ConnId,
        role: Role,
        channel: Weak<ChannelShared>,
        qp: Weak<QpShared>,
    ) -> Arc<Self> {
        Arc::new(Self {
            conn_id,
            role,
            channel,
            st: Mutex::new(IdState {
                state: CmState::Connecting,
                qp,
                info: None,
                reason: None,
                disconnected_sent: false,
                deferred: Vec::new(),
            }),
        })
    }

    pub(crate) fn conn_id(&self) -> ConnId {
        self.conn_id
    }

    fn push(&self, ev: CmEvent) {
        if let Some(ch) = self.channel.upgrade() {
            ch.push(ev);
        }
    }

    /// Reports the connection established, then whatever happened to it meanwhile.
    pub(crate) fn established(&self, info: ConnectionInfo) {
        // Under the lock, so that a close reported meanwhile cannot overtake it.
        let mut st = lock(&self.st);
        st.info = Some(info.clone());
        if st.state == CmState::Connecting {
            st.state = CmState::Established;
        }
        self.push(CmEvent::Established {
            id: self.conn_id,
            info,
        });
        for ev in std::mem::take(&mut st.deferred) {
            self.push(ev);
        }
    }

    /// Reports a failed connection attempt.
    pub(crate) fn failed(&self, ev: CmEvent) {
        lock(&self.st).state = CmState::Failed;
        self.push(ev);
    }

    /// Queues `ev` behind Established if that was not reported yet.
    fn report(&self, st: &mut IdState, ev: CmEvent) {
        if st.info.is_none() {
            st.deferred.push(ev);
        } else {
            self.push(ev);
        }
    }

    fn disconnected(&self, st: &mut IdState) {
        if st.disconnected_sent {
            return;
        }
        st.disconnected_sent = true;
        st.state = CmState::Disconnected;
        let reason = st.reason.unwrap_or(DisconnectReason::QpError);
        self.report(
            st,
            CmEvent::Disconnected {
                id: self.conn_id,
                reason,
            },
        );
    }
}

impl ConnObserver for IdShared {
    fn link_down(&self, why: LinkDown) {
        let mut st = lock(&self.st);
        let reason = match why {
            LinkDown::PeerClosed => DisconnectReason::PeerClosed,
            LinkDown::ConnectionLost => DisconnectReason::ConnectionLost,
            LinkDown::QpFailed => DisconnectReason::QpError,
            LinkDown::Destroyed => DisconnectReason::Local,
            LinkDown::DeviceFailed => DisconnectReason::DeviceFailed,
            LinkDown::NetworkGone => DisconnectReason::NetworkGone,
            LinkDown::PeerUnreachable => DisconnectReason::PeerUnreachable,
        };
        if st.reason.is_none() {
            st.reason = Some(reason);
        }
        // The peer's close is news now; a local end is reported when the socket is closed.
        if why != LinkDown::Destroyed {
            self.disconnected(&mut st);
        }
    }

    fn closed(&self) {
        let mut st = lock(&self.st);
        self.disconnected(&mut st);
        st.state = CmState::Closed;
        self.report(&mut st, CmEvent::TimewaitExit { id: self.conn_id });
    }
}

/// One connection of the connection manager (after `rdma_cm_id`): returned by
/// [`crate::CmEventChannel::connect`] and [`crate::ConnectRequest::accept`]. Cloning gives
/// another handle to the same connection; dropping the handles does not close it (the QP
/// owns the connection: destroy the QP, or call [`CmId::disconnect`]).
#[derive(Debug, Clone)]
pub struct CmId {
    pub(crate) shared: Arc<IdShared>,
}

impl CmId {
    /// The identifier its events carry.
    pub fn conn_id(&self) -> ConnId {
        self.shared.conn_id
    }

    /// Which end of the MPA exchange this side is.
    pub fn role(&self) -> Role {
        self.shared.role
    }

    /// Where the connection is in its life.
    pub fn state(&self) -> CmState {
        lock(&self.shared.st).state
    }

    /// What negotiation settled, once established.
    pub fn connection(&self) -> Option<ConnectionInfo> {
        lock(&self.shared.st).info.clone()
    }

    /// Why the connection ended, once it did.
    pub fn disconnect_reason(&self) -> Option<DisconnectReason> {
        let st = lock(&self.shared.st);
        st.disconnected_sent
            .then(|| st.reason.unwrap_or(DisconnectReason::QpError))
    }

    fn qp(&self) -> Result<Arc<QpShared>> {
        lock(&self.shared.st)
            .qp
            .upgrade()
            .ok_or(Error::NotConnected)
    }

    /// Graceful disconnect: the QP stops taking new sends, the work already posted goes
    /// out, then the TCP connection closes (FIN). When it is closed, the QP is in Error,
    /// the receives still posted complete with a flush status, and [`CmEvent::Disconnected`]
    /// (reason [`DisconnectReason::Local`]) and [`CmEvent::TimewaitExit`] are reported.
    /// A connection attempt still in progress is cancelled instead.
    pub fn disconnect(&self) -> Result<()> {
        if self.state() == CmState::Connecting && self.shared.role == Role::Initiator {
            return self.cancel();
        }
        let qp = self.qp()?;
        {
            let mut st = lock(&self.shared.st);
            if st.reason.is_none() {
                st.reason = Some(DisconnectReason::Local);
            }
            if st.state == CmState::Established {
                st.state = CmState::Disconnecting;
            }
        }
        qp.disconnect()
    }

    /// [`CmId::disconnect`], with this side's close (its FIN) held until the peer closed
    /// its side or `order`'s bound for this end's role passed ([`CloseOrder`]): returns at
    /// once, as rdma-core's `rdma_disconnect` does; the QP leaves RTS now (no new sends,
    /// queued work goes out, receives go on) and the progress thread closes the connection
    /// when the peer's FIN arrives or the hold ends. [`CmEvent::Disconnected`] comes when
    /// the connection is closed, as after [`CmId::disconnect`]: a program that reuses the QP
    /// once it saw the event (uDAPL's endpoints) finds it free. (Reported at once, as
    /// rdma-core over Linux siw does, it made dapltest's server reuse a QP whose connection
    /// was still held, and the run hung.)
    ///
    /// [`CloseOrder`]: crate::cm::CloseOrder
    pub fn disconnect_after_peer(&self, order: &crate::cm::CloseOrder) -> Result<()> {
        if let Ok(qp) = self.qp() {
            if self.state() == CmState::Established {
                qp.hold_close(order.bound(self.shared.role));
            }
        }
        self.disconnect()
    }

    /// Sends this connection's events to `to` from now on, with those already queued (after
    /// `rdma_migrate_id`). The channel that made the connection still drives it until it is
    /// established and must stay open; routed back to it, its events come home.
    pub fn route_events_to(&self, to: &super::CmEventChannel) -> Result<()> {
        let ch = self.shared.channel.upgrade().ok_or(Error::ChannelClosed)?;
        ch.route(
            super::channel::Route::Conn(self.shared.conn_id),
            to.shared(),
        );
        Ok(())
    }

    /// Abortive disconnect: the TCP connection is reset at once (RST, no Terminate), the QP
    /// goes to Error and every outstanding work request completes with a flush status;
    /// [`CmEvent::Disconnected`] (reason [`DisconnectReason::Aborted`]) and
    /// [`CmEvent::TimewaitExit`] follow. A connection attempt still in progress is
    /// cancelled instead.
    pub fn abort(&self) -> Result<()> {
        if self.state() == CmState::Connecting && self.shared.role == Role::Initiator {
            return self.cancel();
        }
        let qp = self.qp()?;
        {
            let mut st = lock(&self.shared.st);
            if !st.disconnected_sent {
                st.reason = Some(DisconnectReason::Aborted);
            }
        }
        qp.abort_connection()
    }

    fn cancel(&self) -> Result<()> {
        let ch = self.shared.channel.upgrade().ok_or(Error::ChannelClosed)?;
        ch.cancel(self.shared.conn_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cm::channel::CmEventChannel;
    use std::time::Duration;

    fn names(ch: &CmEventChannel) -> Vec<&'static str> {
        std::iter::from_fn(|| ch.try_get_event().map(|e| e.name())).collect()
    }

    fn info() -> ConnectionInfo {
        let a = std::net::SocketAddr::from(([127, 0, 0, 1], 1));
        ConnectionInfo {
            local_addr: a,
            peer_addr: a,
            role: Role::Initiator,
            revision: 2,
            crc: true,
            markers_tx: false,
            markers_rx: false,
            ird: 1,
            ord: 1,
            peer_ird_ord: None,
            rtr: None,
            mss: 1448,
            max_fpdu_len: 1448,
            peer_private_data: Vec::new(),
        }
    }

    #[test]
    fn what_happens_before_established_is_reported_after_it() {
        let ch = CmEventChannel::new().unwrap();
        let id = IdShared::new(
            ConnId(9),
            Role::Initiator,
            Arc::downgrade(ch.shared()),
            Weak::new(),
        );
        id.link_down(LinkDown::PeerClosed);
        id.closed();
        assert!(ch.get_event(Some(Duration::from_millis(20))).is_err());
        id.established(info());
        assert_eq!(names(&ch), ["ESTABLISHED", "DISCONNECTED", "TIMEWAIT_EXIT"]);
    }

    #[test]
    fn the_first_reason_wins_and_disconnected_is_reported_once() {
        let ch = CmEventChannel::new().unwrap();
        let id = IdShared::new(
            ConnId(1),
            Role::Responder,
            Arc::downgrade(ch.shared()),
            Weak::new(),
        );
        id.established(info());
        let handle = CmId {
            shared: Arc::clone(&id),
        };
        // A local end is reported when the socket is closed, with its reason.
        id.link_down(LinkDown::Destroyed);
        assert_eq!(handle.disconnect_reason(), None);
        id.link_down(LinkDown::ConnectionLost);
        id.closed();
        assert_eq!(names(&ch), ["ESTABLISHED", "DISCONNECTED", "TIMEWAIT_EXIT"]);
        assert_eq!(handle.disconnect_reason(), Some(DisconnectReason::Local));
        assert_eq!(handle.state(), CmState::Closed);
        assert!(matches!(handle.disconnect(), Err(Error::NotConnected)));
    }
}
