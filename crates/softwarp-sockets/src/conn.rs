//! The iWARP side of a stream: one QP, its CQs and completion channel, a ring of registered
//! receive slots and one of send slots, and the credit state ([`crate::credits`]).
//!
//! Bytes written are copied into a free send slot behind an 8-byte header
//! ([`crate::wire`]) and posted as one iWARP Send; the peer's Sends land (zero copy: the
//! runtime reads them from the socket straight into the registered slot) in this end's
//! receive slots and are copied out by `read`, which posts a slot again once the application
//! has consumed all of it. No thread of its own: the device's progress thread moves the
//! bytes and every call here polls the CQs ([`Conn::progress`]).
//!
//! Memory per connection: `(recv_slots + send_slots) * slot_size` of registered buffers
//! (1 MiB with the defaults of [`crate::IwarpOptions`]) plus the windows the application
//! exposes.

use softwarp::sync::lock;
use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Waker;
use std::time::{Duration, Instant};

use softwarp::{
    AccessFlags, CompletionChannel, CompletionQueue, ConnectOptions, ConnectionInfo, MemoryRegion,
    Payload, ProtectionDomain, QpCap, QpInitAttr, QueuePair, RecvWr, SendOp, SendWr, SgList, Stag,
    WcStatus, WorkCompletion,
};

use crate::credits::Credits;
use crate::options::IwarpOptions;
use crate::violation::{PeerViolation, MAX_NOTICES_UNREAD, MAX_NOTICES_UNSENT};
use crate::wire::{self, Header, Hello, Kind, WindowAd, HEADER_LEN};

/// The longest a blocked call sleeps before looking again. Several threads may wait on one
/// stream (a reader and a writer); the one that drains the completion channel makes the
/// progress for all and kicks the others ([`Conn::kick`]); this bounds a wait should
/// anything else go unseen.
const WAIT_SLICE: Duration = Duration::from_millis(20);

/// Longest [`Conn::close`] waits for the peer's end of the graceful close.
const CLOSE_WAIT: Duration = Duration::from_secs(3);

/// Send work request ids: kind in the top byte, slot (and operation number) below.
const WR_SLOT: u64 = 1 << 56;
const WR_ONE_SIDED: u64 = 2 << 56;
const WR_KIND_MASK: u64 = 0xff << 56;

/// Most windows one end may expose.
pub const MAX_WINDOWS: usize = 16;

pub(crate) fn io_err(e: softwarp::Error) -> io::Error {
    match e {
        softwarp::Error::Timeout(_) | softwarp::Error::Mpa(softwarp::MpaError::Timeout(_)) => {
            io::Error::new(io::ErrorKind::TimedOut, e)
        }
        softwarp::Error::Mpa(softwarp::MpaError::Closed) => {
            io::Error::new(io::ErrorKind::ConnectionReset, e)
        }
        softwarp::Error::Mpa(_) => io::Error::new(io::ErrorKind::ConnectionRefused, e),
        other => io::Error::other(other),
    }
}

/// How a call may wait for the connection: not at all (`nonblocking`: `WouldBlock`), at most
/// `timeout` (then `WouldBlock`), and whether a signal ends the wait (`interruptible`:
/// `Interrupted`, as a blocking socket call returns `EINTR`; otherwise the wait goes on).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Wait {
    pub(crate) nonblocking: bool,
    pub(crate) timeout: Option<Duration>,
    pub(crate) interruptible: bool,
}

impl Wait {
    /// Blocking, at most `timeout`, signals ignored.
    fn at_most(timeout: Duration) -> Self {
        Self {
            timeout: Some(timeout),
            ..Self::default()
        }
    }
}

/// The data side of a one-sided operation.
enum OneSided<'a> {
    /// An RDMA Write of these bytes.
    Write(&'a [u8]),
    /// An RDMA Read into this buffer.
    Read(&'a mut [u8]),
}

/// Where the end of this side's sending stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EofOut {
    Open,
    /// Asked for (shutdown) and waiting for a credit.
    Pending,
    Sent,
}

/// A received DATA message not yet read to its end.
#[derive(Debug)]
struct RxMsg {
    slot: u32,
    /// Next byte to read, relative to the slot.
    at: usize,
    /// End of the message, relative to the slot.
    end: usize,
}

/// Why a connection failed.
#[derive(Debug)]
enum Failure {
    /// A local or transport error (`why`), reported as `kind`.
    Local(io::ErrorKind, String),
    /// The peer broke the stream protocol: reported as `ConnectionAborted` with the
    /// violation inside.
    Peer(PeerViolation),
}

/// A window this end exposed: where the peer addresses it, and its registration.
#[derive(Debug)]
struct LocalWindow {
    ad: WindowAd,
    _mr: Arc<MemoryRegion>,
}

/// The queues a peer's messages fill and their bounds (see the `violation` module and
/// DESIGN.md): `rx_ready` holds a receive slot per entry (at most `recv_slots`: a Send
/// past the credits finds no receive posted and the engine terminates the connection);
/// `peer_windows` at most [`MAX_WINDOWS`]; `wrote` at most [`MAX_NOTICES_UNREAD`];
/// `ctrl_out` (this end's own WINDOW and WROTE messages waiting for the peer's grants) at
/// most [`MAX_WINDOWS`] WINDOWs and [`MAX_NOTICES_UNSENT`] WROTEs.
#[derive(Debug)]
struct State {
    credits: Credits,
    rx_ready: VecDeque<RxMsg>,
    free_tx: Vec<u32>,
    /// Reads return the end: the peer's EOF came, or the reading side was shut down.
    eof_in: bool,
    /// The peer's EOF came.
    peer_eof: bool,
    /// The application shut the reading side down.
    read_shut: bool,
    eof_out: EofOut,
    /// Control messages waiting for a credit (WINDOW, WROTE), in order.
    ctrl_out: VecDeque<(Kind, Vec<u8>)>,
    /// The connection failed: every later call returns this.
    error: Option<Failure>,
    /// The peer's windows.
    peer_windows: Vec<WindowAd>,
    /// WROTE notices from the peer, oldest first.
    wrote: VecDeque<(u64, u64)>,
    /// One-sided operations completed: (slot, status).
    one_sided_done: Vec<(u32, WcStatus)>,
    /// Send slots of one-sided operations whose caller stopped waiting.
    orphans: Vec<u32>,
    /// Local windows (kept registered while the stream lives).
    windows: Vec<LocalWindow>,
    closed: bool,
    /// Counts of events that may make a read newly possible (data, EOF, an error), and a
    /// write (a send slot freed, credits granted): edge-triggered readiness reports a
    /// change of these once.
    rx_events: u64,
    tx_events: u64,
    /// Tasks parked on reading and on writing (feature `tokio`), with the event count each
    /// last saw: see [`Conn::park`].
    parked: [Option<Parked>; 2],
    /// Bytes written and held (`MSG_MORE`, `TCP_CORK`): a send slot being filled, not
    /// posted yet.
    tail: Option<Tail>,
    /// `TCP_CORK`: writes are held until a message is full or the cork is removed.
    corked: bool,
    /// `TCP_NODELAY` as the program set it (reported back; a stream never waits on
    /// Nagle's algorithm, whose acknowledgements it does not have).
    nodelay: bool,
}

/// A DATA message being filled in send slot `slot` (`len` payload bytes so far, behind the
/// header's room), held while the program says more follows.
#[derive(Debug, Clone, Copy)]
struct Tail {
    slot: u32,
    len: usize,
    /// The program asked for it to leave (a write without `MSG_MORE` while uncorked, the
    /// cork removed, `TCP_NODELAY` set, shutdown): it goes with the next credit.
    released: bool,
}

/// A task waiting for one direction of the stream.
#[derive(Debug)]
struct Parked {
    waker: Waker,
    /// `rx_events` or `tx_events` when it parked.
    seen: u64,
}

impl State {
    /// The connection's failure as an error, once it failed.
    fn failure(&self) -> Option<io::Error> {
        self.error.as_ref().map(|f| match f {
            Failure::Local(kind, why) => io::Error::new(*kind, why.clone()),
            Failure::Peer(v) => io::Error::new(io::ErrorKind::ConnectionAborted, v.clone()),
        })
    }

    /// True once the peer broke the protocol (its later messages are ignored).
    fn aborted(&self) -> bool {
        matches!(self.error, Some(Failure::Peer(_)))
    }
}

/// The iWARP connection of a stream.
#[derive(Debug)]
pub(crate) struct Conn {
    // Field order is drop order: the QP goes first, then its buffers and queues.
    qp: QueuePair,
    rx: MemoryRegion,
    tx: MemoryRegion,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    channel: CompletionChannel,
    /// A semaphore eventfd that blocked calls wait on beside the channel: a look that
    /// consumed the channel's event while others wait writes a unit for each of them.
    kick: OwnedFd,
    /// An epoll set holding the connection's TCP socket (`QueuePair::watch_socket`): a
    /// blocked call sleeps on it too, and moves the peer's bytes itself when they wake it
    /// (`Conn::serve`), one thread wake-up per message instead of the progress thread's and
    /// then its own.
    socket_watch: OwnedFd,
    /// Threads waiting on the channel: blocked in [`Conn::run`]'s wait, or an event loop's
    /// [`crate::StreamWaiter`] (counted without the state's lock, before they look).
    waiting: AtomicU32,
    pd: ProtectionDomain,
    state: Mutex<State>,
    info: ConnectionInfo,
    slot_size: usize,
    /// Most payload bytes of one DATA message (the peer's slot less the header).
    max_data: usize,
    recv_slots: u32,
    send_slots: u32,
    linger: Duration,
}

/// What a stream can do without waiting, and what happened to it (the bits `poll` and
/// `epoll` report).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Readiness {
    /// A read returns bytes, EOF or an error.
    pub readable: bool,
    /// A write accepts bytes or returns an error.
    pub writable: bool,
    /// The peer closed its sending side (`POLLRDHUP`), or the connection failed.
    pub peer_closed: bool,
    /// Both directions are closed, or the connection failed (`POLLHUP`).
    pub hangup: bool,
    /// The connection failed (`POLLERR`).
    pub error: bool,
    /// A count that changes whenever data, the EOF or an error arrives: edge-triggered
    /// readiness reports `readable` again only after it changed.
    pub rx_events: u64,
    /// A count that changes whenever room to send may have appeared (a send completed,
    /// credits came back, an error).
    pub tx_events: u64,
}

/// Which end of the MPA exchange a stream runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Sends the MPA Request.
    Initiator,
    /// Answers it.
    Responder,
}

/// A connection's QP, queues and buffers, set up (receives posted) before its MPA exchange
/// ([`crate::Handshake`]); [`Prepared::finish`] makes the connection once it is done.
#[derive(Debug)]
pub(crate) struct Prepared {
    // Field order is drop order, as in [`Conn`].
    pub(crate) qp: QueuePair,
    rx: MemoryRegion,
    tx: MemoryRegion,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    channel: CompletionChannel,
    kick: OwnedFd,
    pd: ProtectionDomain,
    slot_size: usize,
    recv_slots: u32,
    send_slots: u32,
    linger: Duration,
}

impl Conn {
    /// The connection manager's options for the MPA exchange of a stream with `opts` (the
    /// hello in the private data).
    pub(crate) fn connect_options(opts: &IwarpOptions) -> ConnectOptions {
        let hello = Hello {
            slots: opts.recv_slots,
            slot_size: opts.slot_size,
        };
        // Either end of a socket may write first; an MPA responder may not send before the
        // initiator's first FPDU (RFC 5044), so the initiator negotiates RFC 6581
        // peer-to-peer mode, whose RTR message opens the responder's way at once.
        ConnectOptions::default()
            .peer_to_peer(true)
            .crc_mode(opts.crc)
            .timeout(opts.connect_timeout)
            .first_fpdu_delay(Duration::ZERO)
            // The program's own SO_KEEPALIVE settings on its socket stay as they are, as
            // over kernel TCP.
            .tcp_keepalive(None)
            .private_data(&hello.encode())
    }

    /// Sets up what a connection needs before its MPA exchange (the QP with its receives
    /// posted, the buffers, the CQs).
    pub(crate) fn prepare(opts: &IwarpOptions) -> io::Result<Prepared> {
        opts.check()?;
        let dev = match &opts.device {
            Some(d) => d.clone(),
            None => crate::options::default_device()?,
        };
        let slot_size = opts.slot_size as usize;
        let recv_slots = opts.recv_slots;
        let send_slots = opts.send_slots;
        let pd = dev.alloc_pd().map_err(io_err)?;
        let channel = dev.create_comp_channel().map_err(io_err)?;
        let kick = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC
                | rustix::event::EventfdFlags::NONBLOCK
                | rustix::event::EventfdFlags::SEMAPHORE,
        )?;
        let recv_cq = dev
            .create_cq(recv_slots as usize, Some(&channel))
            .map_err(io_err)?;
        let send_cq = dev
            .create_cq(send_slots as usize, Some(&channel))
            .map_err(io_err)?;
        let mut attr = QpInitAttr::new(&send_cq, &recv_cq);
        attr.cap = QpCap {
            max_send_wr: send_slots as usize,
            max_recv_wr: recv_slots as usize,
            ..QpCap::default()
        };
        let qp = pd.create_qp(&attr).map_err(io_err)?;
        let rx_len = slot_size.saturating_mul(recv_slots as usize);
        let tx_len = slot_size.saturating_mul(send_slots as usize);
        let rx = pd
            .reg_mr(rx_len, AccessFlags::LOCAL_WRITE)
            .map_err(io_err)?;
        // LOCAL_WRITE: send slots are also the sinks of RDMA Reads.
        let tx = pd
            .reg_mr(tx_len, AccessFlags::LOCAL_WRITE)
            .map_err(io_err)?;
        for slot in 0..recv_slots {
            post_slot(&qp, &rx, slot, slot_size).map_err(io_err)?;
        }
        Ok(Prepared {
            qp,
            rx,
            tx,
            send_cq,
            recv_cq,
            channel,
            kick,
            pd,
            slot_size,
            recv_slots,
            send_slots,
            linger: opts.linger,
        })
    }
}

impl Prepared {
    /// The connection, once the MPA exchange settled `info` (the QP is in RTS).
    pub(crate) fn finish(self, info: ConnectionInfo) -> io::Result<Arc<Conn>> {
        let Prepared {
            qp,
            rx,
            tx,
            send_cq,
            recv_cq,
            channel,
            kick,
            pd,
            slot_size,
            recv_slots,
            send_slots,
            linger,
        } = self;
        let peer = match Hello::decode(&info.peer_private_data) {
            Ok(p) => p,
            Err(wire::Malformed(why)) => {
                let _ = qp.modify_to_error();
                return Err(io::Error::new(io::ErrorKind::InvalidData, why));
            }
        };
        let max_data = (peer.slot_size as usize)
            .min(slot_size)
            .saturating_sub(HEADER_LEN);
        tracing::debug!(
            target: "softwarp::sockets",
            local = %info.local_addr, peer = %info.peer_addr, qpn = qp.qp_num(),
            peer_slots = peer.slots, peer_slot_size = peer.slot_size,
            "iWARP stream established"
        );
        let state = State {
            credits: Credits::new(recv_slots, peer.slots),
            rx_ready: VecDeque::new(),
            free_tx: (0..send_slots).rev().collect(),
            eof_in: false,
            peer_eof: false,
            read_shut: false,
            eof_out: EofOut::Open,
            ctrl_out: VecDeque::new(),
            error: None,
            peer_windows: Vec::new(),
            wrote: VecDeque::new(),
            one_sided_done: Vec::new(),
            orphans: Vec::new(),
            windows: Vec::new(),
            closed: false,
            rx_events: 0,
            tx_events: 0,
            parked: [None, None],
            tail: None,
            corked: false,
            nodelay: false,
        };
        crate::violation::register();
        let socket_watch =
            rustix::event::epoll::create(rustix::event::epoll::CreateFlags::CLOEXEC)?;
        match qp.watch_socket(socket_watch.as_fd(), 0) {
            Ok(()) => {}
            // The peer sent its bytes and closed before this end got here (a fast client
            // whose accepting server was slow to look): the runtime already finished the
            // graceful close and let go of the socket. What the peer sent, its EOF
            // included, waits in the CQs; the stream reads it, then the end. Failing here
            // lost all of it (the server of `exec_runs_socat_over_iwarp` printed nothing
            // under load).
            Err(softwarp::Error::NotConnected) => tracing::debug!(
                target: "softwarp::sockets",
                qpn = qp.qp_num(),
                "the connection closed before the stream was set up"
            ),
            Err(e) => return Err(io_err(e)),
        }
        Ok(Arc::new(Conn {
            qp,
            socket_watch,
            rx,
            tx,
            send_cq,
            recv_cq,
            channel,
            kick,
            waiting: AtomicU32::new(0),
            pd,
            state: Mutex::new(state),
            info,
            slot_size,
            max_data,
            recv_slots,
            send_slots,
            linger,
        }))
    }
}

impl Conn {
    /// What MPA negotiation settled (addresses included).
    pub(crate) fn info(&self) -> &ConnectionInfo {
        &self.info
    }

    /// The QP number (as `softwarp resources` shows it).
    pub(crate) fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }

    /// The QP's statistics.
    pub(crate) fn stats(&self) -> softwarp::QpStats {
        self.qp.stats()
    }

    /// Registered bytes of this connection's rings.
    pub(crate) fn ring_bytes(&self) -> usize {
        self.rx.len().saturating_add(self.tx.len())
    }

    // ---- progress -------------------------------------------------------------------

    /// Consumes the completion channel's events, then takes every completion
    /// ([`Conn::take_completions`]). An event means its CQ fired and is no longer armed:
    /// while a task is parked ([`Conn::park`]) the CQs are armed again at once and polled
    /// once more, so the next completion signals the channel whoever consumed this one.
    fn progress(&self, st: &mut State) {
        self.progress_as(st, 0);
    }

    /// [`Conn::progress`] for a caller that is itself counted in `waiting` `me` times (it
    /// does not kick itself).
    fn progress_as(&self, st: &mut State, me: u32) {
        let mut fired = false;
        while self.channel.try_get_cq_event().is_some() {
            fired = true;
        }
        self.take_completions(st);
        if fired && st.parked.iter().any(Option::is_some) {
            self.arm_cqs(st, true);
            self.take_completions(st);
        }
        let others = self.waiting.load(Ordering::SeqCst).saturating_sub(me);
        if fired && others > 0 {
            self.kick(others);
        }
    }

    /// Wakes `n` waiting threads (blocked in [`Conn::run`], or holding a
    /// [`crate::StreamWaiter`]): the event this look consumed may have been one of theirs
    /// (each arms the CQs again when it looks).
    fn kick(&self, n: u32) {
        let _ = rustix::io::write(&self.kick, &u64::from(n).to_ne_bytes());
    }

    /// Takes every completion and acts on it, sends what waited for credits, and grants;
    /// then wakes the parked tasks whose direction saw an event. Leaves the completion
    /// channel alone: after [`Conn::arm_cqs`], an event that arrives is left for the
    /// descriptor's waiter.
    fn take_completions(&self, st: &mut State) {
        self.drain(st, &self.recv_cq, Self::on_recv);
        self.drain(st, &self.send_cq, Self::on_send);
        self.flush_control(st);
        wake_parked(st);
    }

    /// Polls `cq` until it is empty, handing each completion to `on`.
    fn drain(
        &self,
        st: &mut State,
        cq: &CompletionQueue,
        on: fn(&Self, &mut State, &WorkCompletion),
    ) {
        let mut wcs = [softwarp::EMPTY_COMPLETION; 32];
        loop {
            let n = match cq.poll(&mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    fail(st, io::ErrorKind::Other, e.to_string());
                    0
                }
            };
            for wc in wcs.iter().take(n) {
                on(self, st, wc);
            }
            if n < wcs.len() {
                break;
            }
        }
    }

    /// Asks the CQs to signal the completion channel at their next completion: the
    /// receive CQ always (data, the EOF, credits, errors come there), the send CQ when the
    /// caller waits to write (`write`: a send completion frees a send slot) or a send is in
    /// flight (its completion may be what a grant or control message waits for). A send
    /// posted later while a thread waits arms it then ([`Conn::posted`]). Before
    /// 2026-12-02 both were always armed: every reply a server wrote after its event loop
    /// had armed the stream for reading signalled the channel (an eventfd write, then a
    /// read and an early wake-up of the loop), 2 system calls per redis request.
    fn arm_cqs(&self, st: &State, write: bool) {
        let _ = self.recv_cq.req_notify(false);
        if write || st.free_tx.len() < self.send_slots as usize {
            let _ = self.send_cq.req_notify(false);
        }
    }

    /// After a post of a send: arms the send CQ if a thread waits (it may have armed only
    /// the receive CQ before the post took a slot; the post holds the state's lock, under
    /// which a blocked call counts itself as waiting after arming).
    fn posted(&self) {
        if self.waiting.load(Ordering::SeqCst) > 0 {
            let _ = self.send_cq.req_notify(false);
        }
    }

    fn on_recv(&self, st: &mut State, wc: &WorkCompletion) {
        let Ok(slot) = u32::try_from(wc.wr_id) else {
            return;
        };
        if wc.status != WcStatus::Success {
            if !st.closed {
                let kind = if st.eof_in {
                    io::ErrorKind::BrokenPipe
                } else {
                    io::ErrorKind::ConnectionReset
                };
                fail(st, kind, format!("receive completed with {:?}", wc.status));
            }
            return;
        }
        let base = self.slot_off(slot);
        let len = (wc.byte_len as usize).min(self.slot_size);
        let mut msg = [0u8; HEADER_LEN + wire::WINDOW_LEN];
        let head = len.min(msg.len());
        if let Err(e) = self.rx.read_at(base, &mut msg[..head]) {
            fail(st, io::ErrorKind::Other, e.to_string());
            return;
        }
        // Control bodies are short and fully in `msg`; DATA bodies stay in the slot.
        let parsed = if len > head {
            Header::decode(&msg[..HEADER_LEN]).and_then(|(h, _)| {
                if h.kind == Kind::Data {
                    Ok((h, &msg[HEADER_LEN..HEADER_LEN]))
                } else {
                    Err(wire::Malformed("control message too long"))
                }
            })
        } else {
            Header::decode(&msg[..head])
        };
        let (h, body) = match parsed {
            Ok(v) => v,
            Err(wire::Malformed(why)) => {
                self.violation(st, PeerViolation::Malformed(why));
                return;
            }
        };
        if st.aborted() {
            // Messages the peer sent after its violation: the stream is gone.
            return;
        }
        if let Err(outstanding) = st.credits.on_receive(u32::from(h.grant)) {
            let grant = u32::from(h.grant);
            self.violation(st, PeerViolation::Overgrant { grant, outstanding });
            return;
        }
        if h.grant > 0 {
            st.tx_events = st.tx_events.wrapping_add(1);
        }
        if let Err(v) = self.on_message(st, h, body, slot, len) {
            self.violation(st, v);
        }
    }

    /// Acts on a received message of the peer that holds receive slot `slot` (`len` bytes,
    /// header included; a DATA body stays in the slot, `body` is empty then), checked
    /// against this end's state: the rule of each kind is in DESIGN.md.
    fn on_message(
        &self,
        st: &mut State,
        h: Header,
        body: &[u8],
        slot: u32,
        len: usize,
    ) -> Result<(), PeerViolation> {
        match h.kind {
            Kind::Data => {
                if st.peer_eof {
                    return Err(PeerViolation::DataAfterEof);
                }
                if len <= HEADER_LEN {
                    return Err(PeerViolation::EmptyData);
                }
                st.rx_events = st.rx_events.wrapping_add(1);
                if st.read_shut {
                    // After shutdown(Read) bytes are dropped as they come (the peer keeps
                    // its credits).
                    self.repost(st, slot);
                } else {
                    st.rx_ready.push_back(RxMsg {
                        slot,
                        at: HEADER_LEN,
                        end: len,
                    });
                }
            }
            Kind::Grant => {
                if h.grant == 0 {
                    return Err(PeerViolation::EmptyGrant);
                }
                self.repost(st, slot);
            }
            Kind::Eof => {
                if st.peer_eof {
                    return Err(PeerViolation::SecondEof);
                }
                st.peer_eof = true;
                st.eof_in = true;
                st.rx_events = st.rx_events.wrapping_add(1);
                self.repost(st, slot);
            }
            Kind::Window => {
                let ad = WindowAd::decode(body)
                    .map_err(|wire::Malformed(why)| PeerViolation::Malformed(why))?;
                if ad.len == 0 {
                    return Err(PeerViolation::EmptyWindow);
                }
                // The same offset again replaces the window (the peer exposed it anew).
                st.peer_windows.retain(|w| w.offset != ad.offset);
                if st.peer_windows.len() >= MAX_WINDOWS {
                    return Err(PeerViolation::TooManyWindows);
                }
                st.peer_windows.push(ad);
                self.repost(st, slot);
            }
            Kind::Wrote => {
                let (offset, len) = wire::decode_wrote(body)
                    .map_err(|wire::Malformed(why)| PeerViolation::Malformed(why))?;
                if st.windows.is_empty() {
                    return Err(PeerViolation::WroteWithoutWindow { offset, len });
                }
                if !st
                    .windows
                    .iter()
                    .any(|w| w.ad.locate(offset, len).is_some())
                {
                    return Err(PeerViolation::WroteOutsideWindow { offset, len });
                }
                if st.wrote.len() >= MAX_NOTICES_UNREAD {
                    return Err(PeerViolation::TooManyNotices);
                }
                st.wrote.push_back((offset, len));
                self.repost(st, slot);
            }
        }
        Ok(())
    }

    /// The peer broke the stream protocol: the stream fails with `v` (the first failure
    /// stays), the violation is counted, and the QP is terminated (a Terminate, a snapshot,
    /// the error log's `peer_violation` line). The message's slot is not posted again.
    fn violation(&self, st: &mut State, v: PeerViolation) {
        if st.error.is_some() {
            return;
        }
        crate::violation::count(&v);
        let detail = v.to_string();
        tracing::warn!(
            target: "softwarp::sockets",
            qpn = self.qp.qp_num(), peer = %self.info.peer_addr, violation = v.name(),
            "{detail}: the stream is aborted"
        );
        set_failure(st, Failure::Peer(v));
        let _ = self.qp.fail_peer_violation(&detail);
    }

    fn on_send(&self, st: &mut State, wc: &WorkCompletion) {
        let slot = (wc.wr_id & 0xffff_ffff) as u32;
        st.tx_events = st.tx_events.wrapping_add(1);
        match wc.wr_id & WR_KIND_MASK {
            WR_SLOT => st.free_tx.push(slot),
            WR_ONE_SIDED => {
                // The caller copies a Read's bytes out before the slot is free again; one
                // whose caller gave up (timeout) is freed here.
                if let Some(i) = st.orphans.iter().position(|o| *o == slot) {
                    st.orphans.swap_remove(i);
                    st.free_tx.push(slot);
                } else {
                    st.one_sided_done.push((slot, wc.status));
                }
            }
            _ => {}
        }
        if wc.status != WcStatus::Success && !st.closed {
            fail(
                st,
                io::ErrorKind::BrokenPipe,
                format!("send completed with {:?}", wc.status),
            );
        }
    }

    fn slot_off(&self, slot: u32) -> usize {
        (slot as usize).saturating_mul(self.slot_size)
    }

    fn repost(&self, st: &mut State, slot: u32) {
        if st.error.is_some() {
            return;
        }
        match post_slot(&self.qp, &self.rx, slot, self.slot_size) {
            Ok(()) => st.credits.on_repost(),
            Err(e) => fail(st, io::ErrorKind::BrokenPipe, e.to_string()),
        }
    }

    /// Sends the EOF and control messages that waited, and a grant if one is due.
    fn flush_control(&self, st: &mut State) {
        if st.error.is_some() {
            return;
        }
        while !st.ctrl_out.is_empty() && st.credits.can_send_message() && !st.free_tx.is_empty() {
            if let Some((kind, body)) = st.ctrl_out.pop_front() {
                self.send_message(st, kind, &body);
            }
        }
        if st.tail.is_some_and(|t| t.released) {
            self.post_tail(st);
        }
        if st.ctrl_out.is_empty()
            && st.tail.is_none()
            && st.eof_out == EofOut::Pending
            && st.credits.can_send_message()
            && !st.free_tx.is_empty()
        {
            self.send_message(st, Kind::Eof, &[]);
            st.eof_out = EofOut::Sent;
        }
        if st.credits.wants_grant_message() && !st.free_tx.is_empty() {
            if let (Some(slot), Some(grant)) = (st.free_tx.pop(), st.credits.take_grant_message()) {
                self.post_message(st, slot, Kind::Grant, grant, &[]);
            }
        }
    }

    /// Sends one message of `kind` (a credit and a free slot must be there).
    fn send_message(&self, st: &mut State, kind: Kind, body: &[u8]) {
        let Some(slot) = st.free_tx.pop() else {
            return;
        };
        let Some(grant) = st.credits.take_message() else {
            st.free_tx.push(slot);
            return;
        };
        self.post_message(st, slot, kind, grant, body);
    }

    fn post_message(&self, st: &mut State, slot: u32, kind: Kind, grant: u32, body: &[u8]) {
        let result = self
            .fill_slot(slot, kind, grant, body)
            .and_then(|wr| self.qp.post_send(&wr));
        self.posted();
        if let Err(e) = result {
            st.free_tx.push(slot);
            fail(st, io::ErrorKind::BrokenPipe, e.to_string());
        }
    }

    /// Writes a message (header and `body`) into send slot `slot` and returns the Send
    /// that carries it.
    fn fill_slot(
        &self,
        slot: u32,
        kind: Kind,
        grant: u32,
        body: &[u8],
    ) -> softwarp::Result<SendWr<'static>> {
        let base = self.slot_off(slot);
        let header = Header {
            kind,
            grant: u16::try_from(grant).unwrap_or(u16::MAX),
        }
        .encode();
        let len = HEADER_LEN.saturating_add(body.len());
        self.tx.write_at(base, &header)?;
        self.tx.write_at(base.saturating_add(HEADER_LEN), body)?;
        let sge = self.tx.sge(base, len as u32)?;
        Ok(SendWr {
            wr_id: WR_SLOT | u64::from(slot),
            op: SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            payload: Payload::Sgl(SgList::single(sge)),
            signaled: true,
            fence: false,
        })
    }

    // ---- readiness and waiting -------------------------------------------------------

    /// Polls the CQs and says whether a read and a write would make progress now (data,
    /// EOF or an error to report; room to send or an error to report).
    pub(crate) fn poll_ready(&self) -> Readiness {
        let mut st = lock(&self.state);
        self.progress(&mut st);
        self.readiness(&st)
    }

    fn readiness(&self, st: &State) -> Readiness {
        // As the kernel's TCP: the peer's EOF is a half close (POLLRDHUP); both directions
        // closed, or a reset, is a hang-up (POLLHUP).
        let peer_closed = st.eof_in && !st.read_shut;
        Readiness {
            readable: self.readable(st),
            writable: self.writable(st),
            peer_closed: peer_closed || st.error.is_some(),
            hangup: st.error.is_some() || (st.eof_in && st.eof_out != EofOut::Open),
            error: st.error.is_some(),
            rx_events: st.rx_events,
            tx_events: st.tx_events,
        }
    }

    fn readable(&self, st: &State) -> bool {
        !st.rx_ready.is_empty() || st.eof_in || st.error.is_some()
    }

    fn writable(&self, st: &State) -> bool {
        st.error.is_some()
            || st.eof_out != EofOut::Open
            || (st.credits.can_send_message() && !st.free_tx.is_empty())
            || st.tail.is_some_and(|t| t.len < self.max_data)
    }

    /// The completion channel's descriptor: readable when a completion arrived since the
    /// CQs were last armed (see [`Conn::arm`]).
    pub(crate) fn event_fd(&self) -> RawFd {
        self.channel.as_raw_fd()
    }

    /// [`Conn::event_fd`], borrowed.
    pub(crate) fn event_fd_borrowed(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.channel)
    }

    /// Arms both CQs, then polls them once more: afterwards, either something is ready or
    /// the next completion makes [`Conn::event_fd`] readable. Returns the readiness.
    pub(crate) fn arm(&self, write: bool) -> Readiness {
        let mut st = lock(&self.state);
        self.progress(&mut st);
        self.arm_cqs(&st, write);
        self.take_completions(&mut st);
        self.readiness(&st)
    }

    /// Parks `waker` on reading (`write` false) or writing, then arms both CQs as
    /// [`Conn::arm`] does. From then on, the first [`Conn::progress`] (whoever calls it: the
    /// other half of a split stream, `poll_ready`, a blocking call) that counts an event of
    /// that direction wakes it. A completion a poll takes drains the completion channel,
    /// and an edge-triggered waiter on the channel (tokio's reactor) then never hears of
    /// it: so a task that parks must be woken by the poll that took its event.
    #[cfg(feature = "tokio")]
    pub(crate) fn park(&self, write: bool, waker: &Waker) {
        let mut st = lock(&self.state);
        self.progress(&mut st);
        let seen = if write { st.tx_events } else { st.rx_events };
        st.parked[usize::from(write)] = Some(Parked {
            waker: waker.clone(),
            seen,
        });
        self.arm_cqs(&st, true);
        self.take_completions(&mut st);
    }

    /// Forgets the task parked on reading or writing (its operation went through).
    #[cfg(feature = "tokio")]
    pub(crate) fn unpark(&self, write: bool) {
        lock(&self.state).parked[usize::from(write)] = None;
    }

    /// Counts an event loop's thread as waiting on the channel ([`crate::StreamWaiter`]):
    /// from now on a look by another thread that consumes a channel event kicks it.
    pub(crate) fn begin_wait(&self) {
        self.waiting.fetch_add(1, Ordering::SeqCst);
    }

    /// Ends [`Conn::begin_wait`].
    pub(crate) fn end_wait(&self) {
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }

    /// [`Conn::arm`] for a thread counted by [`Conn::begin_wait`].
    pub(crate) fn arm_as_waiter(&self, write: bool) -> Readiness {
        let mut st = lock(&self.state);
        self.progress_as(&mut st, 1);
        self.arm_cqs(&st, write);
        self.take_completions(&mut st);
        self.readiness(&st)
    }

    /// The epoll set holding the connection's socket: readable while the peer's bytes
    /// wait in the socket.
    pub(crate) fn socket_fd(&self) -> BorrowedFd<'_> {
        self.socket_watch.as_fd()
    }

    /// The kick descriptor: readable while a unit for a waiting thread is there.
    pub(crate) fn kick_fd(&self) -> BorrowedFd<'_> {
        self.kick.as_fd()
    }

    /// Takes one unit of the kick (after a wait reported it readable).
    pub(crate) fn take_kick(&self) {
        let _ = rustix::io::read(&self.kick, &mut [0u8; 8]);
    }

    /// Moves the connection's bytes on this thread (its socket woke a wait), then looks (as
    /// a caller counted `me` times among the waiting threads: it does not kick itself).
    /// True when that brought an event (data, room to send, the end, an error). False when
    /// another thread was moving the bytes (its completion follows) or the pass brought
    /// nothing (a socket readable for good, at its end): the next wait should leave the
    /// socket out, or it would wake at once again.
    pub(crate) fn serve(&self, me: u32) -> bool {
        if !matches!(self.qp.service(), Ok(true)) {
            return false;
        }
        let mut st = lock(&self.state);
        let seen = (st.rx_events, st.tx_events);
        self.progress_as(&mut st, me);
        seen != (st.rx_events, st.tx_events)
    }

    /// Runs `attempt` until it returns `Some`, waiting for completions in between as `wait`
    /// allows: the one blocking-wait loop of every call on the connection that may wait
    /// for room to send (see [`Conn::run_as`]).
    fn run<T>(
        &self,
        wait: Wait,
        attempt: impl FnMut(&Conn, &mut State) -> Option<io::Result<T>>,
    ) -> io::Result<T> {
        self.run_as(wait, true, attempt)
    }

    /// [`Conn::run`] for a call that waits only for what the peer sends (data, the EOF,
    /// a window, a notice): its waits leave the send CQ unarmed when no send is in flight.
    fn run_reading<T>(
        &self,
        wait: Wait,
        attempt: impl FnMut(&Conn, &mut State) -> Option<io::Result<T>>,
    ) -> io::Result<T> {
        self.run_as(wait, false, attempt)
    }

    /// The one blocking-wait loop: `write` says whether the call may wait for room to send
    /// (a send completion), so that its waits arm the send CQ.
    fn run_as<T>(
        &self,
        wait: Wait,
        write: bool,
        mut attempt: impl FnMut(&Conn, &mut State) -> Option<io::Result<T>>,
    ) -> io::Result<T> {
        let Wait {
            nonblocking,
            timeout,
            interruptible,
        } = wait;
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        // The socket woke the last wait: its bytes are moved on this thread first.
        let mut serve = false;
        // Whether the next wait sleeps on the socket too. Not right after a pass another
        // thread held (it is moving the bytes; its completion wakes this one), nor after
        // one that brought nothing (a socket readable for good, at its end, must not spin
        // this loop).
        let mut watch = true;
        loop {
            if serve {
                watch = self.serve(0);
            }
            let slice = {
                let mut st = lock(&self.state);
                self.progress(&mut st);
                if let Some(r) = attempt(self, &mut st) {
                    return r;
                }
                if nonblocking {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                self.arm_cqs(&st, write);
                self.take_completions(&mut st);
                if let Some(r) = attempt(self, &mut st) {
                    return r;
                }
                let mut slice = WAIT_SLICE;
                if let Some(d) = deadline {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(io::ErrorKind::WouldBlock.into());
                    }
                    slice = slice.min(left);
                }
                self.waiting.fetch_add(1, Ordering::SeqCst);
                slice
            };
            let socket = watch.then(|| self.socket_watch.as_fd());
            let woke = wait_readable(&self.channel, &self.kick, socket, slice);
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            watch = true;
            serve = match woke {
                Ok(by_socket) => by_socket,
                Err(e) if e.kind() == io::ErrorKind::Interrupted && !interruptible => false,
                Err(e) => return Err(e),
            };
        }
    }

    // ---- the stream --------------------------------------------------------------------

    /// Reads stream bytes: 0 at the end of the stream.
    pub(crate) fn read(&self, buf: &mut [u8], wait: Wait) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        self.run_reading(wait, |c, st| c.try_read(st, buf))
    }

    fn try_read(&self, st: &mut State, buf: &mut [u8]) -> Option<io::Result<usize>> {
        let mut n = 0;
        while n < buf.len() {
            let Some(m) = st.rx_ready.front_mut() else {
                break;
            };
            let take = match self.copy_out(m, &mut buf[n..]) {
                Ok(t) => t,
                Err(e) => return Some(Err(e)),
            };
            n = n.saturating_add(take);
            m.at = m.at.saturating_add(take);
            if m.at >= m.end {
                let slot = m.slot;
                st.rx_ready.pop_front();
                self.repost(st, slot);
            }
        }
        if n > 0 {
            self.flush_control(st);
            return Some(Ok(n));
        }
        Self::nothing_to_read(st)
    }

    /// Copies the unread bytes of `m` (as many as fit) to the start of `dst`.
    fn copy_out(&self, m: &RxMsg, dst: &mut [u8]) -> io::Result<usize> {
        let take = (m.end.saturating_sub(m.at)).min(dst.len());
        let from = self.slot_off(m.slot).saturating_add(m.at);
        self.rx
            .read_at(from, &mut dst[..take])
            .map_err(io::Error::other)?;
        Ok(take)
    }

    /// What a read with no bytes to give returns: 0 at the EOF, the error, or (`None`) wait.
    /// A peer's violation is reported even after its EOF (the stream was aborted).
    fn nothing_to_read(st: &State) -> Option<io::Result<usize>> {
        if st.eof_in && !st.aborted() {
            return Some(Ok(0));
        }
        st.failure().map(Err)
    }

    /// Copies stream bytes without consuming them (`MSG_PEEK`): waits until at least one
    /// byte (with `all`, `buf.len()` bytes, as `MSG_PEEK | MSG_WAITALL`), the EOF or an
    /// error is there.
    pub(crate) fn peek(&self, buf: &mut [u8], all: bool, wait: Wait) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        self.run_reading(wait, |c, st| c.try_peek(st, buf, all))
    }

    fn try_peek(&self, st: &mut State, buf: &mut [u8], all: bool) -> Option<io::Result<usize>> {
        let avail: usize = st.rx_ready.iter().map(|m| m.end.saturating_sub(m.at)).sum();
        let want = if all { buf.len() } else { 1 };
        let ended = st.eof_in || st.error.is_some();
        if avail >= want || (avail > 0 && ended) {
            let mut n = 0;
            for m in &st.rx_ready {
                if n >= buf.len() {
                    break;
                }
                match self.copy_out(m, &mut buf[n..]) {
                    Ok(t) => n = n.saturating_add(t),
                    Err(e) => return Some(Err(e)),
                }
            }
            return Some(Ok(n));
        }
        Self::nothing_to_read(st)
    }

    /// Bytes that a read would return now without waiting (`FIONREAD`).
    pub(crate) fn bytes_readable(&self) -> usize {
        let mut st = lock(&self.state);
        self.progress(&mut st);
        st.rx_ready.iter().map(|m| m.end.saturating_sub(m.at)).sum()
    }

    /// Writes stream bytes: as many as credits and free send slots allow at once (at least
    /// one, waiting for room as `wait` allows). `more` (`MSG_MORE`), or the cork, holds a
    /// last piece smaller than a message in a send slot, filled by the next writes and
    /// sent when full, or with the next write without `more` while uncorked, or when the
    /// cork is removed, `TCP_NODELAY` set or the stream shut down (as the kernel holds a
    /// partial segment). Unlike the kernel's, held bytes do not leave when an
    /// acknowledgement of earlier bytes arrives, nor after the cork's 200 ms: only with
    /// one of the program's calls.
    pub(crate) fn write(&self, buf: &[u8], more: bool, wait: Wait) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        self.run(wait, |c, st| c.try_write(st, buf, more))
    }

    fn try_write(&self, st: &mut State, buf: &[u8], more: bool) -> Option<io::Result<usize>> {
        if let Some(e) = st.failure() {
            return Some(Err(e));
        }
        if st.eof_out != EofOut::Open || st.closed {
            return Some(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the stream was shut down for writing",
            )));
        }
        let hold = more || st.corked;
        let mut n = 0;
        if st.tail.is_some() {
            // Earlier bytes are held: these follow them into the same message.
            n = self.append_tail(st, buf);
            let full = st.tail.is_some_and(|t| t.len >= self.max_data);
            if !full && hold {
                return Some(Ok(n));
            }
            if let Some(t) = st.tail.as_mut() {
                t.released = true;
            }
            if !self.post_tail(st) {
                // No credit: the message leaves with the next one (`flush_control`).
                return if n > 0 {
                    Some(Ok(n))
                } else {
                    st.failure().map(Err)
                };
            }
        }
        let rest = &buf[n..];
        if !rest.is_empty() {
            if hold {
                // Whole messages leave; a last smaller piece is held.
                let whole = rest.len().saturating_sub(rest.len() % self.max_data);
                let sent = self.send_data(st, &rest[..whole]);
                n = n.saturating_add(sent);
                if sent == whole && st.error.is_none() {
                    n = n.saturating_add(self.append_tail(st, &rest[whole..]));
                }
            } else {
                n = n.saturating_add(self.send_data(st, rest));
            }
        }
        if n > 0 {
            return Some(Ok(n));
        }
        st.failure().map(Err)
    }

    /// Copies the start of `data` into the held message (started in a free send slot when
    /// there is none); returns the bytes taken (0 without a free slot).
    fn append_tail(&self, st: &mut State, data: &[u8]) -> usize {
        if data.is_empty() {
            return 0;
        }
        let mut tail = match st.tail {
            Some(t) => t,
            None => match st.free_tx.pop() {
                Some(slot) => Tail {
                    slot,
                    len: 0,
                    released: false,
                },
                None => return 0,
            },
        };
        let take = self.max_data.saturating_sub(tail.len).min(data.len());
        let at = self
            .slot_off(tail.slot)
            .saturating_add(HEADER_LEN)
            .saturating_add(tail.len);
        if let Err(e) = self.tx.write_at(at, &data[..take]) {
            st.free_tx.push(tail.slot);
            st.tail = None;
            fail(st, io::ErrorKind::BrokenPipe, e.to_string());
            return 0;
        }
        tail.len = tail.len.saturating_add(take);
        st.tail = Some(tail);
        take
    }

    /// Sends the held message if a credit allows (true when nothing is held any more).
    fn post_tail(&self, st: &mut State) -> bool {
        let Some(t) = st.tail else {
            return true;
        };
        if st.error.is_some() {
            return false;
        }
        let Some(grant) = st.credits.take_message() else {
            return false;
        };
        st.tail = None;
        let base = self.slot_off(t.slot);
        let header = Header {
            kind: Kind::Data,
            grant: u16::try_from(grant).unwrap_or(u16::MAX),
        }
        .encode();
        let len = HEADER_LEN.saturating_add(t.len);
        let result = self
            .tx
            .write_at(base, &header)
            .and_then(|()| self.tx.sge(base, len as u32))
            .and_then(|sge| {
                self.qp.post_send(&SendWr {
                    wr_id: WR_SLOT | u64::from(t.slot),
                    op: SendOp::Send {
                        solicited: false,
                        invalidate: None,
                    },
                    payload: Payload::Sgl(SgList::single(sge)),
                    signaled: true,
                    fence: false,
                })
            });
        self.posted();
        if let Err(e) = result {
            st.free_tx.push(t.slot);
            fail(st, io::ErrorKind::BrokenPipe, e.to_string());
            return false;
        }
        true
    }

    /// Lets the held message leave (at once if a credit allows, else with the next).
    fn release_tail(&self, st: &mut State) {
        if let Some(t) = st.tail.as_mut() {
            t.released = true;
        }
        self.progress(st);
    }

    /// `TCP_CORK`: while on, writes are held until a message is full; off sends what is
    /// held.
    pub(crate) fn set_cork(&self, on: bool) {
        let mut st = lock(&self.state);
        st.corked = on;
        if !on {
            self.release_tail(&mut st);
        }
    }

    /// `TCP_CORK` as set.
    pub(crate) fn cork(&self) -> bool {
        lock(&self.state).corked
    }

    /// `TCP_NODELAY`: remembered (and reported); setting it sends what is held, as the
    /// kernel pushes its pending segments then.
    pub(crate) fn set_nodelay(&self, on: bool) {
        let mut st = lock(&self.state);
        st.nodelay = on;
        if on {
            self.release_tail(&mut st);
        }
    }

    /// `TCP_NODELAY` as set.
    pub(crate) fn nodelay(&self) -> bool {
        lock(&self.state).nodelay
    }

    /// Sends the start of `buf` as DATA messages, as many as credits and free send slots
    /// allow, posted as one list: one lock of the QP and one transmit pass for all of them,
    /// whose FPDUs leave in as few `sendmsg` calls as the socket allows (one post per
    /// message made one transmit pass and one `sendmsg` per message: 32 for a 1 MiB write).
    /// Returns the bytes sent (0 with the error in the state when the post failed).
    fn send_data(&self, st: &mut State, buf: &[u8]) -> usize {
        let mut n = 0;
        let mut wrs: Vec<SendWr<'static>> = Vec::new();
        while n < buf.len() && st.credits.can_send_message() {
            let Some(slot) = st.free_tx.pop() else {
                break;
            };
            let Some(grant) = st.credits.take_message() else {
                st.free_tx.push(slot);
                break;
            };
            let take = buf.len().saturating_sub(n).min(self.max_data);
            let to = n.saturating_add(take);
            match self.fill_slot(slot, Kind::Data, grant, &buf[n..to]) {
                Ok(wr) => wrs.push(wr),
                Err(e) => {
                    st.free_tx.push(slot);
                    fail(st, io::ErrorKind::BrokenPipe, e.to_string());
                    break;
                }
            }
            n = to;
        }
        if wrs.is_empty() {
            return 0;
        }
        let posted = self.qp.post_send_list(&wrs);
        self.posted();
        if let Err((i, e)) = posted {
            // Those before `i` are posted; the rest return their slots.
            for wr in &wrs[i..] {
                st.free_tx.push((wr.wr_id & 0xffff_ffff) as u32);
            }
            fail(st, io::ErrorKind::BrokenPipe, e.to_string());
            return 0;
        }
        if st.error.is_some() {
            return 0;
        }
        n
    }

    /// Ends this side's sending stream: the peer reads EOF after the bytes already written.
    /// The EOF leaves as soon as a credit allows; `wait`: waits for that (at most the linger
    /// time), since with no thread of its own a stream whose program stops calling into it
    /// would keep an EOF that found no credit (the peer's grant arrives, nobody reads it).
    pub(crate) fn shutdown_write(&self, wait: bool) {
        {
            let mut st = lock(&self.state);
            if st.eof_out == EofOut::Open {
                st.eof_out = EofOut::Pending;
            }
            // What is held leaves first, then the EOF (`flush_control`).
            if let Some(t) = st.tail.as_mut() {
                t.released = true;
            }
            self.progress(&mut st);
            if !wait || st.eof_out != EofOut::Pending {
                return;
            }
        }
        let sent = self.run(Wait::at_most(self.linger), |_, st| {
            (st.eof_out != EofOut::Pending || st.error.is_some()).then_some(Ok(()))
        });
        if sent.is_err() {
            tracing::debug!(
                target: "softwarp::sockets",
                qpn = self.qp.qp_num(), linger = ?self.linger,
                "shutdown: no credit for the EOF within the linger time"
            );
        }
    }

    /// True while this side's EOF waits for a credit (polls the CQs first).
    #[cfg(feature = "tokio")]
    pub(crate) fn eof_pending(&self) -> bool {
        let mut st = lock(&self.state);
        self.progress(&mut st);
        st.eof_out == EofOut::Pending && st.error.is_none()
    }

    /// Ends the reading side: later reads return EOF (bytes still arriving are dropped).
    pub(crate) fn shutdown_read(&self) {
        let mut st = lock(&self.state);
        self.progress(&mut st);
        st.eof_in = true;
        st.read_shut = true;
        st.rx_events = st.rx_events.wrapping_add(1);
        while let Some(m) = st.rx_ready.pop_front() {
            self.repost(&mut st, m.slot);
        }
        wake_parked(&mut st);
    }

    /// Closes the connection: sends the EOF, waits (at most the linger time) until every
    /// Send was handed to TCP, then disconnects the QP gracefully.
    pub(crate) fn close(&self) {
        self.shutdown_write(false);
        let deadline = Instant::now().checked_add(self.linger);
        let drained = self.run(Wait::at_most(self.linger), |c, st| {
            let done = st.error.is_some()
                || (st.eof_out == EofOut::Sent && st.free_tx.len() == c.send_slots as usize);
            done.then_some(Ok(()))
        });
        if drained.is_err() {
            tracing::debug!(
                target: "softwarp::sockets",
                qpn = self.qp.qp_num(), linger = ?self.linger,
                reached = deadline.is_some_and(|d| Instant::now() >= d),
                "close: bytes still queued after the linger time"
            );
        }
        lock(&self.state).closed = true;
        let _ = self.qp.disconnect();
        // Wait for the graceful close to finish (our FIN out, the peer's in; the runtime
        // gives up after its own linger of 2 s): a process that exits right after closing
        // would otherwise close the TCP socket with unread bytes (the peer's last grants),
        // and the kernel would answer with a reset that throws away the bytes still in
        // its send buffer (the capture test lost the tail of its data this way).
        let left = deadline.map_or(Duration::ZERO, |d| {
            d.saturating_duration_since(Instant::now())
        });
        let _ = self.qp.wait_closed(left.min(CLOSE_WAIT));
    }

    // ---- one-sided extensions ------------------------------------------------------------

    /// Registers `len` bytes the peer may RDMA Write and Read at `offset .. offset + len`
    /// of its view, and tells the peer (in order with the stream).
    pub(crate) fn expose(&self, len: usize, offset: u64) -> io::Result<Arc<MemoryRegion>> {
        let mr = self
            .pd
            .reg_mr(
                len,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            )
            .map_err(io_err)?;
        let ad = WindowAd {
            offset,
            addr: mr.addr(),
            stag: mr.rkey().0,
            len: len as u64,
        };
        if offset.checked_add(len as u64).is_none() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "window past the end of the offset space",
            ));
        }
        let mr = Arc::new(mr);
        let mut st = lock(&self.state);
        if st.windows.len() >= MAX_WINDOWS {
            return Err(io::Error::new(
                io::ErrorKind::OutOfMemory,
                "too many windows on this stream",
            ));
        }
        if let Some(e) = st.failure() {
            return Err(e);
        }
        st.windows.push(LocalWindow {
            ad,
            _mr: Arc::clone(&mr),
        });
        st.ctrl_out.push_back((Kind::Window, ad.encode().to_vec()));
        self.progress(&mut st);
        Ok(mr)
    }

    /// Waits until the peer's windows cover `offset .. offset + len` (`None`: looks once);
    /// returns the window.
    fn peer_window(
        &self,
        offset: u64,
        len: u64,
        timeout: Option<Duration>,
    ) -> io::Result<WindowAd> {
        let wait = Wait {
            nonblocking: timeout.is_none(),
            timeout,
            interruptible: false,
        };
        self.run_reading(wait, |_, st| {
            if let Some(w) = st
                .peer_windows
                .iter()
                .find(|w| w.locate(offset, len).is_some())
            {
                return Some(Ok(*w));
            }
            st.failure().map(Err)
        })
        .map_err(|e| {
            if e.kind() == io::ErrorKind::WouldBlock {
                io::Error::new(
                    io::ErrorKind::NotFound,
                    "the peer exposed no window covering that range",
                )
            } else {
                e
            }
        })
    }

    /// Waits until the peer's windows cover `offset .. offset + len`.
    pub(crate) fn wait_peer_window(
        &self,
        offset: u64,
        len: u64,
        timeout: Duration,
    ) -> io::Result<()> {
        self.peer_window(offset, len, Some(timeout)).map(|_| ())
    }

    /// RDMA Writes `data` into the peer's window at `offset` (through the send slots: one
    /// copy here, none at the peer) and waits until every byte was handed to TCP. With
    /// `notify`, a WROTE notice follows, in order after the Write's bytes.
    pub(crate) fn write_remote(
        &self,
        offset: u64,
        data: &[u8],
        notify: bool,
        timeout: Duration,
    ) -> io::Result<()> {
        self.one_sided(OneSided::Write(data), offset, data.len(), timeout)?;
        if !notify {
            return Ok(());
        }
        // The notice waits for a credit behind at most MAX_NOTICES_UNSENT others: a peer
        // that grants nothing stops this end's notices, not its memory.
        let notice = wire::encode_wrote(offset, data.len() as u64);
        self.run(Wait::at_most(timeout), |c, st| {
            if let Some(e) = st.failure() {
                return Some(Err(e));
            }
            let unsent = st.ctrl_out.iter().filter(|m| m.0 == Kind::Wrote).count();
            if unsent >= MAX_NOTICES_UNSENT {
                return None;
            }
            st.ctrl_out.push_back((Kind::Wrote, notice.to_vec()));
            c.flush_control(st);
            Some(Ok(()))
        })
        .map_err(|e| {
            if e.kind() == io::ErrorKind::WouldBlock {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the WROTE notice found no room: the peer returned no credits",
                )
            } else {
                e
            }
        })
    }

    /// RDMA Reads `buf.len()` bytes of the peer's window at `offset` into `buf`.
    pub(crate) fn read_remote(
        &self,
        offset: u64,
        buf: &mut [u8],
        timeout: Duration,
    ) -> io::Result<()> {
        let len = buf.len();
        self.one_sided(OneSided::Read(buf), offset, len, timeout)
    }

    /// Posts one slot-sized piece of a one-sided operation at `offset` of the peer's window
    /// `w`: `(slot, at, take)`, `take` bytes at `at` of the operation, from (a Write: copied
    /// into) or into (a Read) send slot `slot`. `None`: the piece is outside the window, or
    /// the post failed (then the error is in the state).
    fn post_piece(
        &self,
        st: &mut State,
        op: &OneSided<'_>,
        w: &WindowAd,
        offset: u64,
        (slot, at, take): (u32, usize, usize),
    ) -> Option<()> {
        let base = self.slot_off(slot);
        let remote_addr = w.locate(offset.wrapping_add(at as u64), take as u64)?;
        let rkey = Stag(w.stag);
        let (copied, op) = match op {
            OneSided::Write(data) => (
                self.tx.write_at(base, &data[at..at.saturating_add(take)]),
                SendOp::Write { remote_addr, rkey },
            ),
            OneSided::Read(_) => (Ok(()), SendOp::Read { remote_addr, rkey }),
        };
        let posted = copied
            .and_then(|()| self.tx.sge(base, take as u32))
            .and_then(|sge| {
                self.qp.post_send(&SendWr {
                    wr_id: WR_ONE_SIDED | u64::from(slot),
                    op,
                    payload: Payload::Sgl(SgList::single(sge)),
                    signaled: true,
                    fence: false,
                })
            });
        self.posted();
        if let Err(e) = posted {
            fail(st, io::ErrorKind::BrokenPipe, e.to_string());
            return None;
        }
        Some(())
    }

    /// Runs a one-sided operation over `len` bytes at `offset` of the peer's windows, in
    /// slot-sized pieces (as many at once as free slots allow), and waits for all of them
    /// (a Read's bytes are copied out of the slot as each piece completes).
    fn one_sided(
        &self,
        mut op: OneSided<'_>,
        offset: u64,
        len: usize,
        timeout: Duration,
    ) -> io::Result<()> {
        let w = self.peer_window(offset, len as u64, None)?;
        // Reads are bounded by the ORD: keep fewer than 16 outstanding.
        let max_outstanding = (self.send_slots as usize).min(8);
        let mut at = 0usize;
        // (slot, offset in the operation, length) of each piece in flight.
        let mut outstanding: Vec<(u32, usize, usize)> = Vec::new();
        let result = self.run(Wait::at_most(timeout), |c, st| {
            let done: Vec<(u32, WcStatus)> = st
                .one_sided_done
                .iter()
                .filter(|(s, _)| outstanding.iter().any(|o| o.0 == *s))
                .copied()
                .collect();
            st.one_sided_done
                .retain(|(s, _)| !outstanding.iter().any(|o| o.0 == *s));
            for (slot, status) in done {
                let Some(i) = outstanding.iter().position(|o| o.0 == slot) else {
                    continue;
                };
                let (_, piece_at, piece_len) = outstanding.swap_remove(i);
                st.free_tx.push(slot);
                if status != WcStatus::Success {
                    return Some(Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        format!("one-sided operation completed with {status:?}"),
                    )));
                }
                if let OneSided::Read(buf) = &mut op {
                    let dst = &mut buf[piece_at..piece_at.saturating_add(piece_len)];
                    if let Err(e) = c.tx.read_at(c.slot_off(slot), dst) {
                        return Some(Err(io::Error::other(e)));
                    }
                }
            }
            if let Some(e) = st.failure() {
                return Some(Err(e));
            }
            while at < len && outstanding.len() < max_outstanding {
                let Some(slot) = st.free_tx.pop() else {
                    break;
                };
                let take = len.saturating_sub(at).min(c.slot_size);
                if c.post_piece(st, &op, &w, offset, (slot, at, take))
                    .is_none()
                {
                    st.free_tx.push(slot);
                    return Some(Err(st.failure().unwrap_or_else(|| {
                        io::Error::new(io::ErrorKind::InvalidInput, "outside the peer's window")
                    })));
                }
                outstanding.push((slot, at, take));
                at = at.saturating_add(take);
            }
            (at >= len && outstanding.is_empty()).then_some(Ok(()))
        });
        if !outstanding.is_empty() {
            let mut st = lock(&self.state);
            for (slot, _, _) in outstanding {
                if let Some(i) = st.one_sided_done.iter().position(|d| d.0 == slot) {
                    st.one_sided_done.swap_remove(i);
                    st.free_tx.push(slot);
                } else {
                    st.orphans.push(slot);
                }
            }
        }
        result.map_err(|e| {
            if e.kind() == io::ErrorKind::WouldBlock {
                io::Error::new(io::ErrorKind::TimedOut, "one-sided operation timed out")
            } else {
                e
            }
        })
    }

    /// The oldest WROTE notice from the peer, waiting at most `timeout`.
    pub(crate) fn wrote_notice(
        &self,
        nonblocking: bool,
        timeout: Duration,
    ) -> io::Result<(u64, u64)> {
        let wait = Wait {
            nonblocking,
            ..Wait::at_most(timeout)
        };
        self.run_reading(wait, |_, st| {
            if let Some(n) = st.wrote.pop_front() {
                return Some(Ok(n));
            }
            st.failure().map(Err)
        })
    }

    /// Receive slots of this end.
    pub(crate) fn recv_slots(&self) -> u32 {
        self.recv_slots
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        let closed = lock(&self.state).closed;
        if !closed {
            self.close();
        }
    }
}

/// Wakes the parked tasks whose direction counted an event since they parked.
fn wake_parked(st: &mut State) {
    let events = [st.rx_events, st.tx_events];
    for (slot, now) in st.parked.iter_mut().zip(events) {
        if slot.as_ref().is_some_and(|p| p.seen != now) {
            if let Some(p) = slot.take() {
                p.waker.wake();
            }
        }
    }
}

fn fail(st: &mut State, kind: io::ErrorKind, why: String) {
    if st.error.is_none() {
        tracing::debug!(target: "softwarp::sockets", %why, "iWARP stream failed");
    }
    set_failure(st, Failure::Local(kind, why));
}

/// Records the connection's failure (the first one stays) and counts it as an event of
/// both directions.
fn set_failure(st: &mut State, f: Failure) {
    if st.error.is_none() {
        st.error = Some(f);
        st.rx_events = st.rx_events.wrapping_add(1);
        st.tx_events = st.tx_events.wrapping_add(1);
    }
}

fn post_slot(
    qp: &QueuePair,
    rx: &MemoryRegion,
    slot: u32,
    slot_size: usize,
) -> softwarp::Result<()> {
    let base = (slot as usize).saturating_mul(slot_size);
    qp.post_recv(&RecvWr {
        wr_id: u64::from(slot),
        sgl: SgList::single(rx.sge(base, slot_size as u32)?),
    })
}

/// Waits until `fd`, `kick` or `socket` (an epoll set holding the connection's socket,
/// when given) is readable or `timeout` passes (`Interrupted` when a signal came); takes
/// one unit of `kick` (a semaphore eventfd) when it was. True when the socket was readable.
fn wait_readable(
    fd: impl AsFd,
    kick: impl AsFd,
    socket: Option<BorrowedFd<'_>>,
    timeout: Duration,
) -> io::Result<bool> {
    use rustix::event::{PollFd, PollFlags};
    let mut fds = [
        PollFd::new(&fd, PollFlags::IN),
        PollFd::new(&kick, PollFlags::IN),
        // Without a socket to watch, the kick again with no event asked (poll ignores it).
        match socket {
            Some(sock) => PollFd::from_borrowed_fd(sock, PollFlags::IN),
            None => PollFd::new(&kick, PollFlags::empty()),
        },
    ];
    let ts = rustix::event::Timespec {
        tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    rustix::event::poll(&mut fds, Some(&ts))?;
    let [_, kicked, by_socket] = fds.map(|p| p.revents().contains(PollFlags::IN));
    if kicked {
        // Another thread may have taken the unit first: nothing to do then.
        let _ = rustix::io::read(&kick, &mut [0u8; 8]);
    }
    Ok(socket.is_some() && by_socket)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::io::Write;

    use super::*;
    use crate::{IwarpListener, IwarpStream};

    fn pair() -> (IwarpStream, IwarpStream) {
        let l = IwarpListener::bind_iwarp("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || l.accept().unwrap().0);
        let c = IwarpStream::connect_iwarp(addr).unwrap();
        (c, t.join().unwrap())
    }

    /// A peer that sends and closes at once, while the accepting end is between its MPA
    /// Reply and setting up the stream (a slow server: the runtime already has the socket),
    /// makes the runtime finish the graceful close alone and let go of the socket. The
    /// stream set up after that must still read the bytes and the EOF (the CQs hold them);
    /// it failed with "the queue pair is not connected" and the bytes were lost.
    #[test]
    fn a_peer_that_sent_and_closed_before_the_stream_was_set_up_is_read_to_the_end() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let client = std::thread::spawn(move || {
            let mut c = IwarpStream::connect_iwarp(addr).unwrap();
            c.write_all(b"hello over iWARP\n").unwrap();
            // Dropping closes: EOF, FIN, and a wait for the peer's FIN (its runtime's).
        });
        let (tcp, _) = l.accept().unwrap();
        let opts = IwarpOptions::default();
        let mut mpa =
            softwarp::StreamHandshake::start_accept(tcp, &Conn::connect_options(&opts)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut prepared = None;
        let info = loop {
            assert!(Instant::now() < deadline, "the MPA exchange within 10 s");
            if let Some(info) = mpa.advance().unwrap() {
                break info;
            }
            if mpa.needs_qp() {
                let p = Conn::prepare(&opts).unwrap();
                mpa.bind_qp(&p.qp).unwrap();
                prepared = Some(p);
            } else {
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        let prepared = prepared.expect("the Request asked for the QP");
        client.join().unwrap();
        // The client is gone: its close waited for our runtime's FIN.
        while prepared.qp.state() != softwarp::QpState::Error {
            assert!(Instant::now() < deadline, "the runtime's close within 10 s");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut s = IwarpStream::from_conn(prepared.finish(info).unwrap());
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut s, &mut got).unwrap();
        assert_eq!(got, b"hello over iWARP\n");
    }

    /// True when the connection's completion channel is readable now.
    fn channel_readable(conn: &Conn) -> bool {
        use rustix::event::{PollFd, PollFlags};
        let fd = conn.event_fd_borrowed();
        let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
        let zero = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        rustix::event::poll(&mut fds, Some(&zero)).unwrap() > 0
    }

    /// A stream armed for reading (an event loop waiting for `POLLIN`, a blocked read)
    /// whose own Send then completes stays quiet: the send CQ is armed only for a caller
    /// that waits to write, or while a send is in flight. Before, a server's every reply
    /// signalled its channel (an eventfd write, a read, an early return of its event loop).
    #[test]
    fn a_send_completing_does_not_signal_a_stream_armed_for_reading() {
        use std::io::Read;
        let (c, s) = pair();
        let conn = Arc::clone(c.conn().unwrap());
        let mut buf = [0u8; 5];
        let r = conn.arm(false);
        assert!(!r.readable && r.writable);
        (&c).write_all(b"reply").unwrap();
        // The peer has the bytes: the Send was handed to TCP, its completion made.
        (&s).read_exact(&mut buf).unwrap();
        assert!(
            !channel_readable(&conn),
            "a send completion signalled a stream armed for reading"
        );
        // Armed for writing too, the same completion signals it.
        conn.arm(true);
        (&c).write_all(b"again").unwrap();
        (&s).read_exact(&mut buf).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !channel_readable(&conn) {
            assert!(Instant::now() < deadline, "the send completion within 10 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A thread blocked in a read waits on the completion channel; when another thread's
    /// call consumes the channel's event (its data), the blocked one must be kicked, not
    /// left to sleep out its slice (20 ms per message for a program with a reading and a
    /// writing thread).
    #[test]
    fn a_look_that_consumes_a_blocked_threads_event_kicks_it() {
        let (c, mut s) = pair();
        let conn = Arc::clone(c.conn().unwrap());
        // As `run` leaves it before it sleeps: the CQs armed, one thread counted.
        {
            let mut st = lock(&conn.state);
            conn.progress(&mut st);
            conn.arm_cqs(&st, true);
            conn.take_completions(&mut st);
        }
        conn.waiting.store(1, Ordering::SeqCst);
        s.write_all(b"data").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !conn.poll_ready().readable {
            assert!(Instant::now() < deadline, "the data within 10 s");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut unit = [0u8; 8];
        assert_eq!(
            rustix::io::read(&conn.kick, &mut unit).ok(),
            Some(8),
            "the blocked thread was not kicked"
        );
        assert_eq!(u64::from_ne_bytes(unit), 1);
        conn.waiting.store(0, Ordering::SeqCst);
    }
}
