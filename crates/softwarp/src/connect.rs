//! The minimal connection path: TCP connect/accept and the MPA Request/Reply exchange
//! (RFC 5044 section 7.1 with the RFC 6581 enhanced parameters), before a QP enters RTS.
//!
//! The exchange runs on the calling thread over a blocking socket with a deadline
//! ([`ConnectOptions::timeout`]): a peer that sends garbage is rejected with a typed
//! [`MpaError`], and one that sends nothing cannot make the call hang. Frames are read
//! exactly (header, then private data), so FPDUs that follow the Reply stay in the socket
//! for the QP. The full connection manager is a later layer; this is what two Softwarp
//! endpoints (or a Softwarp endpoint and Linux `siw`) need to talk.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use softwarp_engine::qp::{Rtr, RtrKind, TerminateLayout};
use softwarp_wire::mpa::frame::{
    EnhancedParams, MpaFrame, MpaFrameKind, MpaRevision, RtrFlags, ENHANCED_PARAMS_LEN, HEADER_LEN,
    MAX_IRD_ORD, MAX_PRIVATE_DATA_LEN,
};
use softwarp_wire::WireError;

use crate::error::{Error, MpaError, Result};
use crate::qp::QueuePair;
use crate::sys;

/// Options of MPA connection establishment.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectOptions {
    /// Ask for CRC32c on every FPDU (on by default). CRC is used when either side asks.
    pub crc: bool,
    /// The MPA revision to offer (initiator) or the highest to accept (responder).
    /// Revision 2 (RFC 6581) carries IRD/ORD; revision 1 does not.
    pub revision: MpaRevision,
    /// Offer RFC 6581 peer-to-peer mode (an RTR message before the first FPDU) as
    /// initiator. A responder always accepts it when offered.
    pub peer_to_peer: bool,
    /// Private data for the application (at most 508 bytes with revision 2, 512 with 1).
    pub private_data: Vec<u8>,
    /// Deadline for the TCP connect and the whole MPA exchange.
    pub timeout: Duration,
    /// Largest FPDU to send; `None`: the TCP maximum segment size (`TCP_MAXSEG`).
    pub max_fpdu_len: Option<usize>,
    /// Layout of the Terminate messages this side sends.
    pub terminate_layout: TerminateLayout,
    /// Initiator: how long to wait after the MPA Reply before the QP may send its first FPDU
    /// (default 20 ms; zero: no wait).
    ///
    /// Linux `siw` as responder sends its Reply first and only then installs the socket
    /// callback that receives FPDUs; an FPDU arriving in between stays unread in its socket
    /// until more bytes arrive, so a first Send that the peer must answer (rping's) deadlocks
    /// the connection. Observed with half of rping connections to siw under TCG; a 20 ms
    /// hold-off avoided it in every run (see `interop/README.md`).
    pub first_fpdu_delay: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            crc: true,
            revision: MpaRevision::Rev2,
            peer_to_peer: false,
            private_data: Vec::new(),
            timeout: Duration::from_secs(5),
            max_fpdu_len: None,
            terminate_layout: TerminateLayout::Rfc5040,
            first_fpdu_delay: Duration::from_millis(20),
        }
    }
}

impl ConnectOptions {
    /// Sets [`ConnectOptions::crc`].
    pub fn crc(mut self, on: bool) -> Self {
        self.crc = on;
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
    /// Sets [`ConnectOptions::private_data`].
    pub fn private_data(mut self, pd: &[u8]) -> Self {
        self.private_data = pd.to_vec();
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
    /// Sets [`ConnectOptions::first_fpdu_delay`].
    pub fn first_fpdu_delay(mut self, delay: Duration) -> Self {
        self.first_fpdu_delay = delay;
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
    /// MPA revision in use (1 or 2).
    pub revision: u8,
    /// CRC32c in use.
    pub crc: bool,
    /// Our IRD: RDMA Read Requests the peer may have outstanding.
    pub ird: usize,
    /// Our ORD: RDMA Reads we may have outstanding.
    pub ord: usize,
    /// The RFC 6581 RTR message, when peer-to-peer mode was negotiated.
    pub rtr: Option<RtrKind>,
    /// The TCP maximum segment size of the connection.
    pub mss: usize,
    /// Largest FPDU this side sends.
    pub max_fpdu_len: usize,
    /// The peer's private data (after the RFC 6581 prefix).
    pub peer_private_data: Vec<u8>,
}

/// The QP's own limits offered in negotiation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LocalParams {
    pub(crate) ird: usize,
    pub(crate) ord: usize,
}

/// The outcome of a successful exchange.
#[derive(Debug, Clone)]
pub(crate) struct Negotiated {
    pub(crate) revision: u8,
    pub(crate) crc: bool,
    pub(crate) ird: usize,
    pub(crate) ord: usize,
    pub(crate) rtr: Option<Rtr>,
    pub(crate) peer_private_data: Vec<u8>,
}

/// Clamps a requested FPDU size to what the engine and MPA allow.
pub(crate) fn fpdu_len_for(requested: usize) -> usize {
    requested.clamp(128, softwarp_wire::mpa::fpdu::MAX_FPDU_LEN)
}

fn clamp_14(v: usize) -> u16 {
    v.min(usize::from(MAX_IRD_ORD)) as u16
}

fn check_private_data(opts: &ConnectOptions) -> Result<()> {
    let max = match opts.revision {
        MpaRevision::Rev1 => MAX_PRIVATE_DATA_LEN,
        MpaRevision::Rev2 => MAX_PRIVATE_DATA_LEN - ENHANCED_PARAMS_LEN,
    };
    if opts.private_data.len() > max {
        return Err(MpaError::PrivateDataTooLong {
            len: opts.private_data.len(),
            max,
        }
        .into());
    }
    Ok(())
}

fn remaining(deadline: Instant, total: Duration) -> Result<Duration> {
    let now = Instant::now();
    if now >= deadline {
        return Err(MpaError::Timeout(total).into());
    }
    Ok(deadline - now)
}

fn map_io(op: &'static str, e: std::io::Error, total: Duration) -> Error {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            MpaError::Timeout(total).into()
        }
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => MpaError::Closed.into(),
        _ => Error::io(op, e),
    }
}

/// Reads exactly one MPA frame into `buf`; returns its length.
fn read_frame(
    stream: &mut TcpStream,
    buf: &mut [u8; HEADER_LEN + MAX_PRIVATE_DATA_LEN],
    deadline: Instant,
    total: Duration,
) -> Result<usize> {
    let mut have = 0;
    loop {
        let need = MpaFrame::needed(buf.get(..have).unwrap_or_default()).map_err(MpaError::from)?;
        if need == 0 {
            return Ok(have);
        }
        stream
            .set_read_timeout(Some(remaining(deadline, total)?))
            .map_err(|e| Error::io("set socket timeout", e))?;
        let Some(dst) = buf.get_mut(have..have + need) else {
            // `needed` never asks beyond HEADER_LEN + 512 (PD_Length is checked).
            return Err(MpaError::BadFrame(WireError::MpaPrivateDataTooLong(have + need)).into());
        };
        match stream.read(dst) {
            Ok(0) => return Err(MpaError::Closed.into()),
            Ok(n) => have += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(map_io("read MPA frame", e, total)),
        }
    }
}

fn write_frame(
    stream: &mut TcpStream,
    frame: &MpaFrame<'_>,
    deadline: Instant,
    total: Duration,
) -> Result<()> {
    let mut buf = [0u8; HEADER_LEN + MAX_PRIVATE_DATA_LEN];
    let n = frame.emit(&mut buf).map_err(|_| {
        Error::InvalidArgument("MPA frame does not encode (private data too long?)")
    })?;
    stream
        .set_write_timeout(Some(remaining(deadline, total)?))
        .map_err(|e| Error::io("set socket timeout", e))?;
    stream
        .write_all(buf.get(..n).unwrap_or_default())
        .map_err(|e| map_io("write MPA frame", e, total))
}

fn rtr_kind(flags: RtrFlags) -> Option<RtrKind> {
    // siw, as responder, chooses the zero-length RDMA Write; we prefer it too.
    if flags.zero_length_write {
        Some(RtrKind::Write)
    } else if flags.zero_length_read {
        Some(RtrKind::Read)
    } else if flags.zero_length_send {
        Some(RtrKind::Send)
    } else {
        None
    }
}

fn rtr_flags(kind: RtrKind) -> RtrFlags {
    RtrFlags {
        zero_length_send: kind == RtrKind::Send,
        zero_length_write: kind == RtrKind::Write,
        zero_length_read: kind == RtrKind::Read,
    }
}

/// Initiator side: TCP connect, send the MPA Request, read and check the Reply.
pub(crate) fn initiate(
    addrs: &[SocketAddr],
    opts: &ConnectOptions,
    local: LocalParams,
) -> Result<(TcpStream, Negotiated)> {
    check_private_data(opts)?;
    let total = opts.timeout;
    let deadline = Instant::now() + total;
    let mut last_err = None;
    let mut stream = None;
    for a in addrs {
        match TcpStream::connect_timeout(a, remaining(deadline, total)?) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last_err = Some(e),
        }
    }
    let Some(mut stream) = stream else {
        return Err(match last_err {
            Some(e) if e.kind() == std::io::ErrorKind::TimedOut => MpaError::Timeout(total).into(),
            Some(e) => Error::io("TCP connect", e),
            None => Error::InvalidArgument("the address resolved to nothing"),
        });
    };
    stream
        .set_nodelay(true)
        .map_err(|e| Error::io("set TCP_NODELAY", e))?;

    let enhanced = (opts.revision == MpaRevision::Rev2).then(|| EnhancedParams {
        ird: clamp_14(local.ird),
        ord: clamp_14(local.ord),
        peer_to_peer: opts.peer_to_peer,
        rtr: if opts.peer_to_peer {
            RtrFlags {
                zero_length_send: true,
                zero_length_write: true,
                zero_length_read: true,
            }
        } else {
            RtrFlags::NONE
        },
    });
    let request = MpaFrame {
        kind: MpaFrameKind::Request,
        // Markers are not implemented (siw rejects them too): never asked for.
        marker: false,
        crc: opts.crc,
        reject: false,
        revision: opts.revision,
        enhanced,
        private_data: &opts.private_data,
    };
    write_frame(&mut stream, &request, deadline, total)?;

    let mut buf = [0u8; HEADER_LEN + MAX_PRIVATE_DATA_LEN];
    let len = read_frame(&mut stream, &mut buf, deadline, total)?;
    let (reply, _) = MpaFrame::parse(buf.get(..len).unwrap_or_default()).map_err(MpaError::from)?;
    if reply.kind != MpaFrameKind::Reply {
        return Err(MpaError::WrongFrameKind { expected: "Reply" }.into());
    }
    //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
    // (paraphrase) A Reply with the R bit set rejects the connection; the initiator closes
    // the TCP connection.
    if reply.reject {
        return Err(MpaError::Rejected {
            private_data: reply.private_data.to_vec(),
        }
        .into());
    }
    //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
    // (paraphrase) M in the Reply says the responder wants markers in the FPDUs it receives;
    // this stack cannot send them, so the connection cannot be used.
    if reply.marker {
        return Err(MpaError::MarkersRequired.into());
    }
    //= https://www.rfc-editor.org/rfc/rfc6581#section-5
    // (paraphrase) The responder answers with the initiator's revision or a lower one.
    if reply.revision > opts.revision {
        return Err(MpaError::RevisionMismatch {
            peer: reply.revision.value(),
            local: opts.revision.value(),
        }
        .into());
    }
    //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
    // (paraphrase) CRC is used when either side's C bit is set.
    let crc = opts.crc || reply.crc;
    let (ird, ord, rtr) = match reply.enhanced {
        Some(e) => {
            //= https://www.rfc-editor.org/rfc/rfc6581#section-3
            // (paraphrase) The responder's IRD bounds the Read Requests we may have
            // outstanding: our ORD is at most the IRD it returns.
            let ord = local.ord.min(usize::from(e.ird));
            let rtr = if opts.peer_to_peer && e.peer_to_peer {
                rtr_kind(e.rtr).map(|kind| Rtr {
                    kind,
                    initiator: true,
                })
            } else {
                None
            };
            (local.ird, ord, rtr)
        }
        // Revision 1 carries no IRD/ORD: keep the QP's own limits (siw reports 0 and then
        // refuses RDMA Reads; our defaults keep Reads usable between two Softwarp ends).
        None => (local.ird, local.ord, None),
    };
    // The peer may not be listening for FPDUs yet (siw): see `first_fpdu_delay`. Nothing of
    // ours can be sent before this returns (the QP enters RTS afterwards).
    let hold = opts
        .first_fpdu_delay
        .min(deadline.saturating_duration_since(Instant::now()));
    if !hold.is_zero() {
        std::thread::sleep(hold);
    }
    Ok((
        stream,
        Negotiated {
            revision: reply.revision.value(),
            crc,
            ird,
            ord,
            rtr,
            peer_private_data: reply.private_data.to_vec(),
        },
    ))
}

/// Responder side: read and check the MPA Request on an accepted connection, send the
/// Reply (or a reject).
pub(crate) fn respond(
    mut stream: TcpStream,
    opts: &ConnectOptions,
    local: LocalParams,
) -> Result<(TcpStream, Negotiated)> {
    check_private_data(opts)?;
    let total = opts.timeout;
    let deadline = Instant::now() + total;
    stream
        .set_nonblocking(false)
        .map_err(|e| Error::io("clear O_NONBLOCK", e))?;
    stream
        .set_nodelay(true)
        .map_err(|e| Error::io("set TCP_NODELAY", e))?;
    let mut buf = [0u8; HEADER_LEN + MAX_PRIVATE_DATA_LEN];
    let len = match read_frame(&mut stream, &mut buf, deadline, total) {
        Ok(len) => len,
        Err(Error::Mpa(MpaError::BadFrame(WireError::MpaUnsupportedRevision(rev)))) => {
            //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
            // (paraphrase) A responder that does not support the requested revision
            // answers with a Reply carrying its own revision and the R bit, then closes.
            send_reject(&mut stream, opts.revision, deadline, total);
            return Err(MpaError::BadFrame(WireError::MpaUnsupportedRevision(rev)).into());
        }
        Err(e) => return Err(e),
    };
    let (request, _) =
        MpaFrame::parse(buf.get(..len).unwrap_or_default()).map_err(MpaError::from)?;
    if request.kind != MpaFrameKind::Request {
        return Err(MpaError::WrongFrameKind {
            expected: "Request",
        }
        .into());
    }
    let revision = request.revision.min(opts.revision);
    if request.marker {
        // siw does the same: markers are refused with a reject Reply.
        send_reject(&mut stream, revision, deadline, total);
        return Err(MpaError::MarkersRequired.into());
    }
    let crc = opts.crc || request.crc;
    let (ird, ord, rtr, reply_enhanced) = match (revision, request.enhanced) {
        (MpaRevision::Rev2, Some(e)) => {
            //= https://www.rfc-editor.org/rfc/rfc6581#section-3
            // (paraphrase) The responder's ORD must not exceed the initiator's IRD; it
            // returns its own IRD and the ORD it will use.
            let ord = local.ord.min(usize::from(e.ird));
            let ird = local.ird;
            let chosen = if e.peer_to_peer {
                rtr_kind(e.rtr)
            } else {
                None
            };
            let params = EnhancedParams {
                ird: clamp_14(ird),
                ord: clamp_14(ord),
                peer_to_peer: chosen.is_some(),
                rtr: chosen.map(rtr_flags).unwrap_or(RtrFlags::NONE),
            };
            let rtr = chosen.map(|kind| Rtr {
                kind,
                initiator: false,
            });
            (ird, ord, rtr, Some(params))
        }
        _ => (local.ird, local.ord, None, None),
    };
    let reply = MpaFrame {
        kind: MpaFrameKind::Reply,
        marker: false,
        crc,
        reject: false,
        revision,
        enhanced: reply_enhanced,
        private_data: &opts.private_data,
    };
    write_frame(&mut stream, &reply, deadline, total)?;
    Ok((
        stream,
        Negotiated {
            revision: revision.value(),
            crc,
            ird,
            ord,
            rtr,
            peer_private_data: request.private_data.to_vec(),
        },
    ))
}

fn send_reject(stream: &mut TcpStream, revision: MpaRevision, deadline: Instant, total: Duration) {
    let reject = MpaFrame {
        kind: MpaFrameKind::Reply,
        marker: false,
        crc: false,
        reject: true,
        revision,
        enhanced: None,
        private_data: &[],
    };
    if let Err(e) = write_frame(stream, &reject, deadline, total) {
        tracing::debug!(error = %e, "could not send the MPA reject");
    }
}

/// A TCP listener that accepts iWARP connections into QPs.
#[derive(Debug)]
pub struct Listener {
    inner: TcpListener,
    _ras: crate::ras::Tracked,
}

impl Listener {
    /// Listens on `addr` (port 0: any free port, see [`Listener::local_addr`]).
    #[track_caller]
    pub fn bind<A: ToSocketAddrs>(addr: A) -> Result<Self> {
        let inner = TcpListener::bind(addr).map_err(|e| Error::io("bind listener", e))?;
        inner
            .set_nonblocking(true)
            .map_err(|e| Error::io("set O_NONBLOCK", e))?;
        let _ras = crate::ras::listener(inner.local_addr().ok());
        Ok(Self { inner, _ras })
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.inner
            .local_addr()
            .map_err(|e| Error::io("getsockname", e))
    }

    /// Waits (without a time limit) for a connection, performs the MPA exchange as
    /// responder (bounded by [`ConnectOptions::timeout`]) and moves `qp` (Idle, receives
    /// posted) to RTS. On an MPA failure the connection is closed and `qp` stays Idle.
    pub fn accept(&self, qp: &QueuePair, opts: &ConnectOptions) -> Result<ConnectionInfo> {
        self.accept_inner(qp, opts, None)
    }

    /// As [`Listener::accept`], waiting at most `timeout` for the TCP connection.
    pub fn accept_timeout(
        &self,
        qp: &QueuePair,
        opts: &ConnectOptions,
        timeout: Duration,
    ) -> Result<ConnectionInfo> {
        self.accept_inner(qp, opts, Some(timeout))
    }

    fn accept_inner(
        &self,
        qp: &QueuePair,
        opts: &ConnectOptions,
        timeout: Option<Duration>,
    ) -> Result<ConnectionInfo> {
        qp.begin_connect()?;
        let stream = match self.wait_accept(timeout) {
            Ok(s) => s,
            Err(e) => return qp.finish_connect(Err(e), opts),
        };
        let result = respond(stream, opts, qp.local_params());
        qp.finish_connect(result, opts)
    }

    fn wait_accept(&self, timeout: Option<Duration>) -> Result<TcpStream> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            match self.inner.accept() {
                Ok((s, peer)) => {
                    tracing::debug!(%peer, "TCP connection accepted");
                    return Ok(s);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("accept", e)),
            }
            let left = match deadline {
                None => None,
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(Error::Timeout(timeout.unwrap_or_default()));
                    }
                    Some(d - now)
                }
            };
            sys::poll_readable(self.inner.as_fd(), left)
                .map_err(|e| Error::io("poll on listener", e))?;
        }
    }
}
