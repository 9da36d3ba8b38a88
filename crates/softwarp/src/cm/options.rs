//! Connection settings ([`ConnectOptions`] and its policies) and what establishment settled
//! ([`ConnectionInfo`]). Plain data: no I/O here.

use std::net::SocketAddr;
use std::time::Duration;

use softwarp_engine::qp::{RtrKind, TerminateLayout};
use softwarp_wire::mpa::frame::MpaRevision;

/// When CRC32c protects FPDUs (RFC 5044 section 7.1: CRC is used when either side asks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CrcMode {
    /// Do not ask for CRC (C = 0); use it anyway when the peer asks, as the RFC requires.
    /// Linux siw's default.
    Off,
    /// Ask for CRC (C = 1); it is then in use whatever the peer says.
    #[default]
    Preferred,
    /// Ask for CRC and insist on the peer confirming it: as initiator, a Reply with C = 0 ends
    /// the connection ([`crate::MpaError::CrcNotConfirmed`]), like siw's `mpa_crc_required`.
    /// As responder the same as [`CrcMode::Preferred`] (the Reply always says C = 1).
    Required,
}

impl CrcMode {
    /// The C bit this side sends.
    pub fn asks(self) -> bool {
        !matches!(self, CrcMode::Off)
    }
}

/// A mode equals the C bit it sends: `Off` equals `false`, `Preferred` and `Required` equal
/// `true` (so `info.crc == opts.crc` says whether a connection uses the CRC it asked for).
impl PartialEq<bool> for CrcMode {
    fn eq(&self, other: &bool) -> bool {
        self.asks() == *other
    }
}

/// See `impl PartialEq<bool> for CrcMode`.
impl PartialEq<CrcMode> for bool {
    fn eq(&self, other: &CrcMode) -> bool {
        other.asks() == *self
    }
}

/// Whether MPA markers (RFC 5044 section 4.3) are used. Each direction is negotiated on its
/// own: the M bit of a frame asks the other side to insert markers into what it sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MarkerMode {
    /// Never use markers (M = 0), and refuse a peer that asks for them: a Request with M = 1
    /// is answered with a reject Reply, a Reply with M = 1 ends the connection. Linux siw's
    /// behaviour (it never sends markers and rejects M = 1).
    #[default]
    Off,
    /// Do not ask for markers (M = 0), but insert them into the FPDUs we send when the peer
    /// asks.
    Accept,
    /// Ask the peer to insert markers (M = 1), and insert them when the peer asks too.
    Request,
}

impl MarkerMode {
    /// The M bit this side sends.
    pub fn asks(self) -> bool {
        matches!(self, MarkerMode::Request)
    }

    /// True when this side agrees to insert markers for a peer that asks.
    pub fn sends_on_request(self) -> bool {
        !matches!(self, MarkerMode::Off)
    }
}

/// A set of RFC 6581 ready-to-receive (RTR) message types: offered by an initiator in
/// peer-to-peer mode, accepted by a responder. A responder chooses, among the types offered
/// and accepted, the zero-length RDMA Write first, then the zero-length Read, then the
/// zero-length Send (siw prefers the Write too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RtrTypes {
    /// Zero-length RDMA Write.
    pub write: bool,
    /// Zero-length RDMA Read (needs ORD >= 1 on the initiator, IRD >= 1 on the responder).
    pub read: bool,
    /// Zero-length Send (consumes no receive work request at the responder).
    pub send: bool,
}

impl RtrTypes {
    /// Every type.
    pub const ALL: RtrTypes = RtrTypes {
        write: true,
        read: true,
        send: true,
    };
    /// No type (peer-to-peer mode refused).
    pub const NONE: RtrTypes = RtrTypes {
        write: false,
        read: false,
        send: false,
    };
    /// What Linux siw offers and accepts: Write and Read.
    pub const WRITE_OR_READ: RtrTypes = RtrTypes {
        write: true,
        read: true,
        send: false,
    };

    /// The set with exactly `kind`.
    pub const fn only(kind: RtrKind) -> RtrTypes {
        RtrTypes {
            write: matches!(kind, RtrKind::Write),
            read: matches!(kind, RtrKind::Read),
            send: matches!(kind, RtrKind::Send),
        }
    }

    /// True when no type is in the set.
    pub const fn is_empty(self) -> bool {
        !(self.write || self.read || self.send)
    }

    /// True when `kind` is in the set.
    pub const fn contains(self, kind: RtrKind) -> bool {
        match kind {
            RtrKind::Write => self.write,
            RtrKind::Read => self.read,
            RtrKind::Send => self.send,
        }
    }

    /// The types in both sets.
    pub const fn intersect(self, other: RtrTypes) -> RtrTypes {
        RtrTypes {
            write: self.write && other.write,
            read: self.read && other.read,
            send: self.send && other.send,
        }
    }

    /// The preferred type of the set: Write, then Read, then Send.
    pub const fn preferred(self) -> Option<RtrKind> {
        if self.write {
            Some(RtrKind::Write)
        } else if self.read {
            Some(RtrKind::Read)
        } else if self.send {
            Some(RtrKind::Send)
        } else {
            None
        }
    }
}

impl Default for RtrTypes {
    fn default() -> Self {
        RtrTypes::ALL
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
    /// initiator, as RFC 5044 section 7.1 requires (on by default). Linux siw does not
    /// enforce this; turn it off only for an application protocol in which the responder
    /// speaks first and whose peers tolerate it. The connection manager honours it; the
    /// minimal [`crate::Listener`] path never holds FPDUs back.
    pub responder_waits_for_initiator: bool,
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
    /// leaves when it expires (nobody sleeps: the progress thread retries on its timer).
    pub first_fpdu_delay: Duration,
    /// How long the peer may stop in the middle of an FPDU (some of its bytes arrived, the
    /// rest did not) before the stream is terminated (default 30 s; `Duration::MAX`: no
    /// limit). A partial FPDU holds the memory it is placed into and the receive it fills:
    /// without a bound, a peer could pin a registration that the application deregistered
    /// ([`crate::MrRelease::wait`]) forever. The Terminate is RDMAP's "Catastrophic error,
    /// localized to RDMAP Stream"; the QP reports [`crate::Fault::RxStall`]. Checked by the
    /// progress thread every quarter of the shortest such timeout of its device's QPs.
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
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            crc: CrcMode::Preferred,
            markers: MarkerMode::Off,
            revision: MpaRevision::Rev2,
            peer_to_peer: false,
            rtr_types: RtrTypes::ALL,
            private_data: Vec::new(),
            ird: None,
            ord: None,
            timeout: Duration::from_secs(5),
            max_fpdu_len: None,
            terminate_layout: TerminateLayout::Rfc5040,
            responder_waits_for_initiator: true,
            first_fpdu_delay: Duration::from_millis(20),
            rx_stall_timeout: Duration::from_secs(30),
            rfc7306: true,
            tcp_user_timeout: None,
        }
    }
}

impl ConnectOptions {
    /// The settings Linux siw uses by default (Debian 6.1): MPA revision 2 with IRD/ORD, CRC
    /// off (used when the peer asks), no markers (refused), no peer-to-peer mode (Write and
    /// Read RTR accepted when a peer asks), siw's Terminate layout, and FPDUs sent as soon as
    /// the connection is up.
    pub fn linux_siw() -> Self {
        Self {
            crc: CrcMode::Off,
            markers: MarkerMode::Off,
            revision: MpaRevision::Rev2,
            peer_to_peer: false,
            rtr_types: RtrTypes::WRITE_OR_READ,
            terminate_layout: TerminateLayout::LinuxSiw,
            responder_waits_for_initiator: false,
            ..Self::default()
        }
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

    /// Sets [`ConnectOptions::rx_stall_timeout`].
    pub fn rx_stall_timeout(mut self, timeout: Duration) -> Self {
        self.rx_stall_timeout = timeout;
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
    /// Sets [`ConnectOptions::responder_waits_for_initiator`].
    pub fn responder_waits_for_initiator(mut self, on: bool) -> Self {
        self.responder_waits_for_initiator = on;
        self
    }
}

/// Which end of the MPA exchange this side was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Sent the MPA Request (connected).
    Initiator,
    /// Sent the MPA Reply (accepted).
    Responder,
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
    fn rtr_preference_is_write_then_read_then_send() {
        assert_eq!(RtrTypes::ALL.preferred(), Some(RtrKind::Write));
        let rs = RtrTypes {
            write: false,
            ..RtrTypes::ALL
        };
        assert_eq!(rs.preferred(), Some(RtrKind::Read));
        assert_eq!(
            RtrTypes::only(RtrKind::Send).preferred(),
            Some(RtrKind::Send)
        );
        assert_eq!(RtrTypes::NONE.preferred(), None);
        assert!(RtrTypes::only(RtrKind::Read)
            .intersect(RtrTypes::WRITE_OR_READ)
            .contains(RtrKind::Read));
        assert!(RtrTypes::only(RtrKind::Send)
            .intersect(RtrTypes::WRITE_OR_READ)
            .is_empty());
    }

    #[test]
    fn crc_builder_keeps_the_boolean_meaning() {
        assert_eq!(ConnectOptions::default().crc(false).crc, CrcMode::Off);
        assert_eq!(ConnectOptions::default().crc(true).crc, CrcMode::Preferred);
        assert!(CrcMode::Required.asks() && !CrcMode::Off.asks());
        assert!(MarkerMode::Request.asks() && !MarkerMode::Accept.asks());
        assert!(MarkerMode::Accept.sends_on_request() && !MarkerMode::Off.sends_on_request());
    }
}
