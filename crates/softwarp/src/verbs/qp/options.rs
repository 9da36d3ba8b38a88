//! Connection settings ([`ConnectOptions`] and its policies) and what establishment settled
//! ([`ConnectionInfo`]). Plain data: no I/O here.

use std::net::SocketAddr;
use std::time::Duration;

use softwarp_engine::mpa::Offer;
pub use softwarp_engine::mpa::{CrcMode, MarkerMode, Role, RtrTypes};
use softwarp_engine::qp::{RtrKind, TerminateLayout};
use softwarp_wire::mpa::frame::MpaRevision;

/// TCP keepalive settings of a connection ([`ConnectOptions::tcp_keepalive`]): a peer that
/// sent nothing for `idle` is probed every `interval`, and the connection is dropped after
/// `count` unanswered probes, about `idle + count * interval` after the peer's last byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    /// Silence from the peer before the first probe (`TCP_KEEPIDLE`, whole seconds, at
    /// least 1).
    pub idle: Duration,
    /// Time between probes (`TCP_KEEPINTVL`, whole seconds, at least 1).
    pub interval: Duration,
    /// Unanswered probes before the connection is dropped (`TCP_KEEPCNT`, at least 1).
    pub count: u32,
}

impl Keepalive {
    /// Softwarp's default: 60 s of silence, then 6 probes 10 s apart (a vanished peer is
    /// found in about 2 minutes; the kernel's own defaults, when keepalive is on, take
    /// 2 hours 11 minutes).
    pub const DEFAULT: Keepalive = Keepalive {
        idle: Duration::from_secs(60),
        interval: Duration::from_secs(10),
        count: 6,
    };

    /// The values the kernel takes (`TCP_KEEPIDLE`, `TCP_KEEPINTVL` in whole seconds),
    /// or why not: an idle time or interval under 1 s, or no probe.
    pub(crate) fn kernel_values(&self) -> Result<(Duration, Duration, u32), &'static str> {
        let secs = |d: Duration| Duration::from_secs(d.as_secs());
        if self.idle.as_secs() < 1 || self.interval.as_secs() < 1 || self.count < 1 {
            return Err(
                "ConnectOptions::tcp_keepalive needs an idle time and an interval \
                        of at least 1 s and a count of at least 1",
            );
        }
        Ok((secs(self.idle), secs(self.interval), self.count))
    }
}

/// Settings of MPA connection establishment, for both ends: what an initiator asks for
/// (connect) and what a responder accepts and answers (listen, accept). The defaults are
/// Softwarp's; [`ConnectOptions::linux_siw`] gives Linux siw's.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectOptions {
    /// CRC32c policy ([`CrcMode::Preferred`] by default).
    pub crc: CrcMode,
    /// MPA marker policy ([`MarkerMode::Off`] by default, like siw).
    pub markers: MarkerMode,
    /// The MPA revision to offer (initiator) or the highest to accept (responder).
    /// Revision 2 (RFC 6581, the default) carries IRD/ORD; revision 1 does not.
    pub revision: MpaRevision,
    /// Initiator: offer RFC 6581 peer-to-peer mode (an RTR message before the first FPDU),
    /// with the types in [`ConnectOptions::rtr_types`]. The responder's RTR types say whether
    /// it agrees.
    pub peer_to_peer: bool,
    /// RTR message types offered (initiator) or accepted (responder; empty: peer-to-peer
    /// mode is refused and the Reply says so). Every type by default.
    pub rtr_types: RtrTypes,
    /// Private data for the application: at most 508 bytes with revision 2 (the RFC 6581
    /// IRD/ORD prefix takes 4 of the 512), 512 with revision 1. Longer is refused with
    /// [`crate::MpaError::PrivateDataTooLong`].
    pub private_data: Vec<u8>,
    /// IRD to offer: RDMA Read Requests the peer may have outstanding here. `None`: the QP's
    /// `max_dest_rd_atomic`. At most that.
    pub ird: Option<usize>,
    /// ORD to offer: RDMA Reads this side may have outstanding. `None`: the QP's
    /// `max_rd_atomic`. At most that.
    pub ord: Option<usize>,
    /// Deadline for the TCP connect and the whole MPA exchange (initiator), or for the
    /// Request to arrive after the TCP connection was accepted (responder). `Duration::MAX`
    /// (or any time the clock cannot reach): no limit. Default 5 s.
    ///
    /// As responder this is RFC 5044's timer on the MPA Request (section 7.1, paraphrase:
    /// the responder bounds its wait for the Request and closes the connection when it
    /// expires): a peer that sends nothing, or only part of a Request, is closed when it
    /// expires, without a Reply, and the connection attempt fails with
    /// [`crate::MpaError::Timeout`] (a [`crate::CmEvent::RequestError`] on a CM listener,
    /// whose `ListenOptions::options` carry it). Linux siw waits 10 s
    /// (`MPAREQ_TIMEOUT`). The same bound applies on the CM path and on the blocking
    /// [`crate::Listener::accept`] path.
    pub timeout: Duration,
    /// Largest FPDU to send; `None`: the TCP maximum segment size (`TCP_MAXSEG`), so that
    /// FPDUs stay aligned with segments (RFC 5044), except on a connection to this host
    /// itself (loopback), where segments are never cut or placed by a NIC: there MPA's
    /// largest FPDU (a 65,535-byte ULPDU), which halves the receiver's reads per MiB.
    pub max_fpdu_len: Option<usize>,
    /// Layout of the Terminate messages this side sends.
    pub terminate_layout: TerminateLayout,
    /// Responder without peer-to-peer mode: send no FPDU before one arrived from the
    /// initiator, as RFC 5044 section 7.1 requires (on by default). Work the responder
    /// posts meanwhile is held in the QP, not failed: it leaves as soon as the initiator's
    /// first FPDU arrives. So in an application protocol where the responder speaks first,
    /// the initiator must send something first or negotiate RFC 6581 peer-to-peer mode
    /// ([`ConnectOptions::peer_to_peer`]: the RTR opens the gate at once). Linux siw does
    /// not enforce this; turn it off only for peers that tolerate a responder speaking first.
    /// Every connection path honours it: the connection manager and the blocking
    /// [`crate::Listener::accept`] / [`crate::QueuePair::accept_stream`].
    pub responder_waits_for_initiator: bool,
    /// How long [`ConnectOptions::responder_waits_for_initiator`]'s gate waits for the
    /// initiator's first FPDU before it opens anyway (`Duration::MAX`, the default: for
    /// ever, as RFC 5044 has it). An initiator that waits for the responder to speak first
    /// without offering RFC 6581's RTR (perftest's `ib_write_lat` client over stock Linux
    /// siw) then gets the responder's FPDUs after this bound instead of never. The rule
    /// protects an initiator not yet ready for FPDUs right after the MPA Reply (a connection
    /// handed from the host's stack to an RNIC): a bound of a few hundred milliseconds is
    /// room for that. The C libraries use 200 ms (`SOFTWARP_RESPONDER_WAIT_MS`,
    /// [`crate::cm::config`]).
    pub responder_wait_limit: Duration,
    /// Initiator: how long to wait after the MPA Reply before the QP may send its first FPDU
    /// (default 20 ms; zero: no wait).
    ///
    /// Linux `siw` as responder sends its Reply first and only then installs the socket
    /// callback that receives FPDUs; an FPDU arriving in between stays unread in its socket
    /// until more bytes arrive, so a first Send that the peer must answer (rping's) deadlocks
    /// the connection. Observed with half of rping connections to siw under TCG; a 20 ms
    /// hold-off avoided it in every run (see `interop/README.md`). The blocking
    /// [`crate::QueuePair::connect`] waits that long before it returns; on the connection
    /// manager's path ([`crate::CmEventChannel::connect`]) the QP is established at once and
    /// holds its FPDUs back until the delay has passed: work posted meanwhile is queued and
    /// leaves when it expires (a rule of the engine's clock; the progress thread looks when
    /// it asks, nobody sleeps).
    pub first_fpdu_delay: Duration,
    /// How long the peer may stop in the middle of an FPDU (some of its bytes arrived, the
    /// rest did not) before the stream is terminated (default 30 s; `Duration::MAX`: no
    /// limit). A partial FPDU holds the memory it is placed into and the receive it fills:
    /// without a bound, a peer could pin a registration that the application deregistered
    /// ([`crate::MrRelease::wait`]) forever. The Terminate is RDMAP's "Catastrophic error,
    /// localized to RDMAP Stream"; the QP reports [`crate::Fault::RxStall`]. A rule of the
    /// engine's clock (`softwarp_engine::qp::Timers`): checked every quarter of the timeout
    /// (5 ms at the least) while the peer is inside an FPDU, and not at all otherwise: a
    /// stall is found between 1 and 1.25 times the timeout after the last byte.
    pub rx_stall_timeout: Duration,
    /// Use the RFC 7306 extensions on the connection (default true): Immediate Data,
    /// Atomic Requests and Responses, DDP queue 3. MPA negotiates nothing for them, so both
    /// ends must be configured alike. When false, a peer's untagged segment on queue 3 gets
    /// the DDP Terminate "Invalid QN", and one with an RFC 7306 opcode (0x8 to 0xB) the RDMAP
    /// Terminate "Unexpected OpCode" (DESIGN.md, engine section). Posting those operations
    /// is not refused locally: the application decides what it sends.
    pub rfc7306: bool,
    /// How long data this side sent may stay unacknowledged, or queued behind a peer's zero
    /// receive window, before the kernel drops the connection (`TCP_USER_TIMEOUT`); the QP
    /// then goes to Error with [`crate::Cause::LlpClosed`] and flushes its work. `None`
    /// (default): the kernel's own bound (retransmissions: about 15 minutes; a peer that
    /// keeps acknowledging zero-window probes: none at all). A peer that stops reading
    /// holds the send buffer and the work requests behind it for that long.
    pub tcp_user_timeout: Option<Duration>,
    /// TCP keepalive on the connection (`SO_KEEPALIVE` with `TCP_KEEPIDLE`,
    /// `TCP_KEEPINTVL`, `TCP_KEEPCNT`): after [`Keepalive::idle`] without a byte from the
    /// peer the kernel probes it, and when [`Keepalive::count`] probes in a row go
    /// unanswered it drops the connection; the QP then goes to Error with
    /// [`crate::Cause::LlpClosed`], flushes its work, and the error log says the peer
    /// stopped answering (`peer_unreachable`). Without it a peer host that vanishes (power
    /// lost, cable pulled, crashed without a reset) while nothing is in flight leaves the
    /// QP in RTS for ever, holding its memory and posted receives. Default
    /// [`Keepalive::DEFAULT`] (60 s idle, then 6 probes 10 s apart: about 2 minutes); `None`
    /// leaves the socket as the kernel made it (no keepalive).
    pub tcp_keepalive: Option<Keepalive>,
    /// Lead a message of 64 KiB or more with a few 1-byte FPDUs when its payload, copied by
    /// the kernel into the socket, would land 1-63 bytes ahead of its source modulo 4 KiB
    /// (default true). That is the case for a page-aligned buffer (most applications'), and
    /// there the copy runs at about half speed (4 KiB aliasing); the extra FPDU boundaries
    /// move the payload out of it. The peer sees a few more FPDUs (any segmentation is valid
    /// DDP). False: every FPDU of a message but the last carries the largest payload.
    pub tx_alias_lead: bool,
    /// How long a Send (with Solicited Event, with Invalidate, or RFC 7306 Immediate Data)
    /// that arrives when no receive is posted waits for one before the stream fails
    /// (default [`DEFAULT_RNR_WAIT`]; `None`: fail at once, as an RNIC without the wait
    /// does). iWARP has no RNR NAK and retry; instead the QP holds the Send's header and
    /// reads nothing more from the socket, so TCP's flow control stops the peer's sender
    /// (its Sends, Writes and Read Requests behind the held one wait in the peer's socket),
    /// while this side still sends (its own work and Read Responses). A receive posted to
    /// the QP's RQ or SRQ resumes it at once. Past the bound the Send fails as without the
    /// wait: the Terminate for no receive buffer (DDP, untagged buffer error, "Invalid
    /// MSN, no buffer available"), the QP goes to Error and flushes its work. A QP that
    /// closes (or whose peer closes) while it holds a Send drops it and the rest of the
    /// stream, with no Terminate. A rule of the
    /// engine's clock (`softwarp_engine::qp::Timers::rnr_wait`); per QP,
    /// [`crate::QueuePair::set_rnr_wait`] overrides it. `Some(Duration::MAX)` waits until
    /// a receive comes.
    pub rnr_wait: Option<Duration>,
}

/// The default of [`ConnectOptions::rnr_wait`]: 10 s. Long enough that a receiver
/// descheduled on a loaded machine, or paused by its runtime, never kills its connection
/// (InfiniBand applications set `rnr_retry` 7, which retries for ever, and count on it);
/// short enough that a peer whose receives never come is still failed, well before the
/// receive stall's 30 s ([`ConnectOptions::rx_stall_timeout`]).
pub const DEFAULT_RNR_WAIT: Duration = Duration::from_secs(10);

impl Default for ConnectOptions {
    fn default() -> Self {
        Self::from_offer(Offer::default())
    }
}

impl ConnectOptions {
    /// Options carrying `o`'s negotiation settings (without private data), and the
    /// runtime's own defaults for the rest.
    fn from_offer(o: Offer<'_>) -> Self {
        Self {
            crc: o.crc,
            markers: o.markers,
            revision: o.revision,
            peer_to_peer: o.peer_to_peer,
            rtr_types: o.rtr_types,
            private_data: o.private_data.to_vec(),
            ird: o.ird,
            ord: o.ord,
            timeout: Duration::from_secs(5),
            max_fpdu_len: None,
            terminate_layout: o.terminate_layout,
            responder_waits_for_initiator: o.responder_waits,
            responder_wait_limit: Duration::MAX,
            first_fpdu_delay: Duration::from_millis(20),
            rx_stall_timeout: Duration::from_secs(30),
            rfc7306: o.rfc7306,
            tcp_user_timeout: None,
            tcp_keepalive: Some(Keepalive::DEFAULT),
            tx_alias_lead: true,
            rnr_wait: Some(DEFAULT_RNR_WAIT),
        }
    }

    /// What the engine's MPA negotiation needs of these options: the one place they are
    /// converted ([`softwarp_engine::mpa`]).
    pub(crate) fn offer(&self) -> Offer<'_> {
        Offer {
            crc: self.crc,
            markers: self.markers,
            revision: self.revision,
            peer_to_peer: self.peer_to_peer,
            rtr_types: self.rtr_types,
            private_data: &self.private_data,
            ird: self.ird,
            ord: self.ord,
            terminate_layout: self.terminate_layout,
            rfc7306: self.rfc7306,
            responder_waits: self.responder_waits_for_initiator,
        }
    }

    /// The settings Linux siw uses by default (Debian 6.1): MPA revision 2 with IRD/ORD, CRC
    /// off (used when the peer asks), no markers (refused), no peer-to-peer mode (Write and
    /// Read RTR accepted when a peer asks), siw's Terminate layout, and FPDUs sent as soon as
    /// the connection is up.
    pub fn linux_siw() -> Self {
        Self::from_offer(Offer::linux_siw())
    }

    /// Asks for CRC ([`CrcMode::Preferred`]) or not ([`CrcMode::Off`]).
    pub fn crc(mut self, on: bool) -> Self {
        self.crc = if on { CrcMode::Preferred } else { CrcMode::Off };
        self
    }
    /// Sets [`ConnectOptions::crc`].
    pub fn crc_mode(mut self, mode: CrcMode) -> Self {
        self.crc = mode;
        self
    }
    /// Sets [`ConnectOptions::tcp_user_timeout`].
    pub fn tcp_user_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.tcp_user_timeout = timeout;
        self
    }

    /// Sets [`ConnectOptions::tcp_keepalive`].
    pub fn tcp_keepalive(mut self, keepalive: Option<Keepalive>) -> Self {
        self.tcp_keepalive = keepalive;
        self
    }

    /// Sets [`ConnectOptions::rnr_wait`].
    pub fn rnr_wait(mut self, wait: Option<Duration>) -> Self {
        self.rnr_wait = wait;
        self
    }

    /// Sets [`ConnectOptions::rx_stall_timeout`].
    pub fn rx_stall_timeout(mut self, timeout: Duration) -> Self {
        self.rx_stall_timeout = timeout;
        self
    }

    /// Sets [`ConnectOptions::tx_alias_lead`].
    pub fn tx_alias_lead(mut self, on: bool) -> Self {
        self.tx_alias_lead = on;
        self
    }

    /// Sets [`ConnectOptions::rfc7306`].
    pub fn rfc7306(mut self, on: bool) -> Self {
        self.rfc7306 = on;
        self
    }

    /// Sets [`ConnectOptions::first_fpdu_delay`].
    pub fn first_fpdu_delay(mut self, delay: Duration) -> Self {
        self.first_fpdu_delay = delay;
        self
    }
    /// Sets [`ConnectOptions::markers`].
    pub fn markers(mut self, mode: MarkerMode) -> Self {
        self.markers = mode;
        self
    }
    /// Sets [`ConnectOptions::revision`].
    pub fn revision(mut self, rev: MpaRevision) -> Self {
        self.revision = rev;
        self
    }
    /// Sets [`ConnectOptions::peer_to_peer`].
    pub fn peer_to_peer(mut self, on: bool) -> Self {
        self.peer_to_peer = on;
        self
    }
    /// Sets [`ConnectOptions::rtr_types`].
    pub fn rtr_types(mut self, types: RtrTypes) -> Self {
        self.rtr_types = types;
        self
    }
    /// Sets [`ConnectOptions::private_data`].
    pub fn private_data(mut self, pd: &[u8]) -> Self {
        self.private_data = pd.to_vec();
        self
    }
    /// Sets [`ConnectOptions::ird`].
    pub fn ird(mut self, ird: usize) -> Self {
        self.ird = Some(ird);
        self
    }
    /// Sets [`ConnectOptions::ord`].
    pub fn ord(mut self, ord: usize) -> Self {
        self.ord = Some(ord);
        self
    }
    /// Sets [`ConnectOptions::timeout`].
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }
    /// Sets [`ConnectOptions::max_fpdu_len`].
    pub fn max_fpdu_len(mut self, len: Option<usize>) -> Self {
        self.max_fpdu_len = len;
        self
    }
    /// Sets [`ConnectOptions::terminate_layout`].
    pub fn terminate_layout(mut self, layout: TerminateLayout) -> Self {
        self.terminate_layout = layout;
        self
    }
    /// Sets [`ConnectOptions::responder_wait_limit`].
    pub fn responder_wait_limit(mut self, bound: Duration) -> Self {
        self.responder_wait_limit = bound;
        self
    }

    /// Sets [`ConnectOptions::responder_waits_for_initiator`].
    pub fn responder_waits_for_initiator(mut self, on: bool) -> Self {
        self.responder_waits_for_initiator = on;
        self
    }
}

/// What connection establishment settled.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionInfo {
    /// Our address.
    pub local_addr: SocketAddr,
    /// The peer's address.
    pub peer_addr: SocketAddr,
    /// Our end of the MPA exchange.
    pub role: Role,
    /// MPA revision in use (1 or 2).
    pub revision: u8,
    /// CRC32c in use.
    pub crc: bool,
    /// We insert markers into the FPDUs we send (the peer asked).
    pub markers_tx: bool,
    /// The peer inserts markers into the FPDUs it sends (we asked).
    pub markers_rx: bool,
    /// Our IRD: RDMA Read Requests the peer may have outstanding.
    pub ird: usize,
    /// Our ORD: RDMA Reads we may have outstanding.
    pub ord: usize,
    /// The peer's IRD and ORD as its frame stated them (revision 2 only).
    pub peer_ird_ord: Option<(u16, u16)>,
    /// The RFC 6581 RTR message, when peer-to-peer mode was negotiated.
    pub rtr: Option<RtrKind>,
    /// The TCP maximum segment size of the connection.
    pub mss: usize,
    /// Largest FPDU this side sends (with markers the engine also keeps every FPDU below
    /// 64 KiB on the wire, as the 16-bit FPDUPTR requires).
    pub max_fpdu_len: usize,
    /// The peer's private data (after the RFC 6581 prefix).
    pub peer_private_data: Vec<u8>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_builder_keeps_the_boolean_meaning() {
        assert_eq!(ConnectOptions::default().crc(false).crc, CrcMode::Off);
        assert_eq!(ConnectOptions::default().crc(true).crc, CrcMode::Preferred);
    }

    #[test]
    fn the_offer_carries_every_negotiation_setting() {
        let o = ConnectOptions::linux_siw()
            .private_data(b"pd")
            .ird(3)
            .ord(4)
            .markers(MarkerMode::Accept)
            .rfc7306(false);
        let offer = o.offer();
        assert_eq!(
            offer,
            Offer {
                markers: MarkerMode::Accept,
                private_data: b"pd",
                ird: Some(3),
                ord: Some(4),
                rfc7306: false,
                ..Offer::linux_siw()
            }
        );
        // The defaults are the engine's.
        let d = ConnectOptions::default();
        assert_eq!(d.offer(), Offer::default());
    }

    #[test]
    fn keepalive_is_on_by_default_and_refuses_what_the_kernel_would() {
        assert_eq!(
            ConnectOptions::default().tcp_keepalive,
            Some(Keepalive::DEFAULT)
        );
        let s = Duration::from_secs;
        let k = |idle, interval, count| Keepalive {
            idle,
            interval,
            count,
        };
        assert_eq!(
            k(s(5), Duration::from_millis(2500), 3).kernel_values(),
            Ok((s(5), s(2), 3)),
            "whole seconds"
        );
        for bad in [
            k(Duration::from_millis(500), s(1), 1),
            k(s(1), Duration::ZERO, 1),
            k(s(1), s(1), 0),
        ] {
            assert!(bad.kernel_values().is_err(), "{bad:?}");
        }
    }
}
