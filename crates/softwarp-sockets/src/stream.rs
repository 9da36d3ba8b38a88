//! `std::net`-shaped types: [`Socket`] (options before connect/listen), [`IwarpStream`],
//! [`IwarpListener`], and the one-sided [`Window`].

use softwarp::sync::lock;
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockAddr, Type};

use crate::conn::{Conn, Wait};
pub use crate::conn::{Readiness, Side};
use crate::options::{IwarpOptions, SOL_SOFTWARP, SO_IWARP_ACTIVE, SO_IWARP_MODE};

/// Time a one-sided call waits for the peer's window and for its completions.
const ONE_SIDED_TIMEOUT: Duration = Duration::from_secs(10);

fn invalid(why: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, why)
}

fn not_iwarp() -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        "the stream is plain TCP: one-sided operations need iWARP mode",
    )
}

/// A TCP socket before `connect` or `listen`: where iWARP mode is switched on, like
/// `setsockopt(fd, SOL_SOFTWARP, SO_IWARP_MODE, 1)` in C.
#[derive(Debug)]
pub struct Socket {
    inner: socket2::Socket,
    iwarp: Option<IwarpOptions>,
}

impl Socket {
    /// A TCP socket of `domain` (IPv4 or IPv6), plain TCP until switched.
    pub fn new(domain: Domain) -> io::Result<Self> {
        Ok(Self {
            inner: socket2::Socket::new(domain, Type::STREAM, Some(Protocol::TCP))?,
            iwarp: None,
        })
    }

    /// A TCP socket of the family of `addr`.
    pub fn for_addr(addr: &SocketAddr) -> io::Result<Self> {
        Self::new(Domain::for_address(*addr))
    }

    /// Switches iWARP mode on (default settings) or off.
    pub fn set_iwarp_mode(&mut self, on: bool) {
        self.iwarp = on.then(IwarpOptions::default);
    }

    /// Switches iWARP mode on with `opts`.
    pub fn set_iwarp_options(&mut self, opts: IwarpOptions) {
        self.iwarp = Some(opts);
    }

    /// True when iWARP mode is on.
    pub fn iwarp_mode(&self) -> bool {
        self.iwarp.is_some()
    }

    /// `setsockopt` of an `int` option at level [`SOL_SOFTWARP`] (other levels: use
    /// [`Socket::as_socket2`]).
    pub fn set_option(&mut self, level: i32, name: i32, value: i32) -> io::Result<()> {
        match (level, name) {
            (SOL_SOFTWARP, SO_IWARP_MODE) => {
                self.set_iwarp_mode(value != 0);
                Ok(())
            }
            (SOL_SOFTWARP, _) => Err(io::Error::from_raw_os_error(libc_enoprotoopt())),
            _ => Err(invalid("only SOL_SOFTWARP options here")),
        }
    }

    /// `getsockopt` of an `int` option at level [`SOL_SOFTWARP`].
    pub fn option(&self, level: i32, name: i32) -> io::Result<i32> {
        match (level, name) {
            (SOL_SOFTWARP, SO_IWARP_MODE) => Ok(i32::from(self.iwarp_mode())),
            (SOL_SOFTWARP, SO_IWARP_ACTIVE) => Ok(0),
            (SOL_SOFTWARP, _) => Err(io::Error::from_raw_os_error(libc_enoprotoopt())),
            _ => Err(invalid("only SOL_SOFTWARP options here")),
        }
    }

    /// The underlying socket, for TCP and IP options.
    pub fn as_socket2(&self) -> &socket2::Socket {
        &self.inner
    }

    /// Binds to `addr`.
    pub fn bind(&self, addr: &SocketAddr) -> io::Result<()> {
        self.inner.bind(&SockAddr::from(*addr))
    }

    /// Listens: in iWARP mode every accepted connection runs the MPA exchange as responder.
    pub fn listen(self, backlog: i32) -> io::Result<IwarpListener> {
        self.inner.listen(backlog)?;
        IwarpListener::new(self.inner.into(), self.iwarp)
    }

    /// Connects (without a time limit other than the kernel's); in iWARP mode then runs the
    /// MPA exchange as initiator.
    pub fn connect(self, addr: &SocketAddr) -> io::Result<IwarpStream> {
        self.inner.connect(&SockAddr::from(*addr))?;
        self.finish_connect()
    }

    /// Connects within `timeout`.
    pub fn connect_timeout(self, addr: &SocketAddr, timeout: Duration) -> io::Result<IwarpStream> {
        self.inner
            .connect_timeout(&SockAddr::from(*addr), timeout)?;
        self.finish_connect()
    }

    fn finish_connect(self) -> io::Result<IwarpStream> {
        let tcp: TcpStream = self.inner.into();
        match self.iwarp {
            None => Ok(IwarpStream::from_tcp(tcp)),
            Some(opts) => IwarpStream::establish(tcp, Side::Initiator, &opts),
        }
    }
}

impl AsRawFd for Socket {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.as_raw_fd()
    }
}

fn libc_enoprotoopt() -> i32 {
    rustix::io::Errno::NOPROTOOPT.raw_os_error()
}

/// Connections an iWARP-mode [`IwarpListener`] holds while their MPA Requests come in.
pub const LISTENER_HELD: usize = 128;

/// How long a held connection keeps its place at a full listener once another is waiting
/// (the connection manager's eviction age).
const EVICT_AGE: Duration = Duration::from_secs(1);

/// A listener shaped like [`TcpListener`]; in iWARP mode, accepted streams are iWARP.
///
/// In iWARP mode the listener waits for the MPA Requests of the connections it took side
/// by side: a peer that connects and never finishes its Request (silent, half a Request)
/// keeps one of [`LISTENER_HELD`] places until its [`IwarpOptions::connect_timeout`], not
/// the listener, and a good client is accepted as soon as its Request is in. Full, with
/// another connection waiting, the listener closes the one that has waited longest once it
/// has waited a second. Its descriptor ([`AsRawFd`]) is then an epoll set that becomes
/// readable when [`IwarpListener::accept`] has something to do: a connection waiting (while
/// there is room), more bytes of a held Request, or a held connection's time running out.
#[derive(Debug)]
pub struct IwarpListener {
    tcp: TcpListener,
    iwarp: Option<Screening>,
    /// The caller's mode ([`IwarpListener::set_nonblocking`]); in iWARP mode the socket
    /// itself is always non-blocking.
    nonblocking: AtomicBool,
}

/// What an iWARP-mode listener keeps besides its socket.
#[derive(Debug)]
struct Screening {
    opts: IwarpOptions,
    /// Connections taken whose MPA Request is not all in yet, oldest first.
    held: Mutex<VecDeque<HeldConn>>,
    /// The listener's socket (level-triggered, while there is room or the oldest held
    /// connection may go), the held sockets (edge-triggered: a half Request does not keep
    /// the set readable) and `timer`.
    epoll: OwnedFd,
    /// Armed for the first held connection's deadline or eviction.
    timer: OwnedFd,
}

/// A connection an iWARP-mode listener took, its MPA Request still coming in.
#[derive(Debug)]
struct HeldConn {
    tcp: TcpStream,
    peer: SocketAddr,
    accepted_at: Instant,
}

/// Whether a held connection's MPA Request is all in (as far as peeking at its socket
/// shows); true also for bytes that can never be a valid Request and for a closed or
/// failed socket, whose exchange then fails at once with the reason.
fn request_in(tcp: &TcpStream) -> bool {
    use softwarp_wire::mpa::frame::{MpaFrame, HEADER_LEN, MAX_PRIVATE_DATA_LEN};
    let mut buf = [0u8; HEADER_LEN + MAX_PRIVATE_DATA_LEN];
    match tcp.peek(&mut buf) {
        Ok(0) => true,
        Ok(n) => !matches!(MpaFrame::needed(buf.get(..n).unwrap_or_default()), Ok(1..)),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
        Err(_) => true,
    }
}

/// The token of the listener's socket and of the timer in the epoll set (held sockets use
/// their descriptor numbers, which are never these).
const LISTENER_TOKEN: u64 = u64::MAX;
const TIMER_TOKEN: u64 = u64::MAX - 1;

impl Screening {
    fn new(tcp: &TcpListener, opts: IwarpOptions) -> io::Result<Self> {
        use rustix::event::epoll;
        use rustix::time::{timerfd_create, TimerfdClockId, TimerfdFlags};
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let timer = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::CLOEXEC | TimerfdFlags::NONBLOCK,
        )?;
        epoll::add(
            &ep,
            tcp,
            epoll::EventData::new_u64(LISTENER_TOKEN),
            epoll::EventFlags::IN,
        )?;
        epoll::add(
            &ep,
            &timer,
            epoll::EventData::new_u64(TIMER_TOKEN),
            epoll::EventFlags::IN,
        )?;
        Ok(Self {
            opts,
            held: Mutex::new(VecDeque::new()),
            epoll: ep,
            timer,
        })
    }

    /// Waits for the set (at most `timeout`; `None`: no limit) and forgets what it
    /// reported (edges, the timer's expiry): the caller looks at everything anyway.
    fn wait(&self, timeout: Option<Duration>) -> io::Result<()> {
        use rustix::event::{epoll, Timespec};
        let ts = timeout.and_then(|d| Timespec::try_from(d).ok());
        let mut events = Vec::with_capacity(16);
        loop {
            match epoll::wait(
                &self.epoll,
                rustix::buffer::spare_capacity(&mut events),
                ts.as_ref(),
            ) {
                Ok(_) => break,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        let mut expiries = [0u8; 8];
        let _ = rustix::io::read(&self.timer, &mut expiries);
        Ok(())
    }
}

impl IwarpListener {
    fn new(tcp: TcpListener, iwarp: Option<IwarpOptions>) -> io::Result<Self> {
        let iwarp = match iwarp {
            Some(opts) => {
                tcp.set_nonblocking(true)?;
                Some(Screening::new(&tcp, opts)?)
            }
            None => None,
        };
        Ok(Self {
            tcp,
            iwarp,
            nonblocking: AtomicBool::new(false),
        })
    }

    /// A plain TCP listener on `addr`.
    pub fn bind<A: ToSocketAddrs>(addr: A) -> io::Result<Self> {
        Self::new(TcpListener::bind(addr)?, None)
    }

    /// An iWARP-mode listener on `addr` with default settings.
    pub fn bind_iwarp<A: ToSocketAddrs>(addr: A) -> io::Result<Self> {
        Self::bind_with(addr, IwarpOptions::default())
    }

    /// An iWARP-mode listener on `addr` with `opts`.
    pub fn bind_with<A: ToSocketAddrs>(addr: A, opts: IwarpOptions) -> io::Result<Self> {
        opts.check()?;
        Self::new(TcpListener::bind(addr)?, Some(opts))
    }

    /// True in iWARP mode.
    pub fn is_iwarp(&self) -> bool {
        self.iwarp.is_some()
    }

    /// Accepts a connection; in iWARP mode runs the MPA exchange as responder once the
    /// peer's Request is all in (each connection's Request bounded by
    /// [`IwarpOptions::connect_timeout`]), so a peer that is not an iWARP-mode
    /// softwarp-sockets peer is refused with an error (one per call; `TimedOut` for one
    /// that sent no whole Request in time) and the next accept goes on. The other
    /// connections taken stay held for the next call ([`IwarpListener::pending`]).
    /// Non-blocking, it returns `WouldBlock` when no Request is complete.
    pub fn accept(&self) -> io::Result<(IwarpStream, SocketAddr)> {
        let Some(sc) = &self.iwarp else {
            let (tcp, peer) = self.tcp.accept()?;
            return Ok((IwarpStream::from_tcp(tcp), peer));
        };
        let mut held = lock(&sc.held);
        loop {
            // Forget what the set reports now (edges, the timer): everything is looked at
            // below, and an unharvested edge would keep the set readable for the caller's
            // event loop.
            sc.wait(Some(Duration::ZERO))?;
            self.take_connections(sc, &mut held)?;
            let now = Instant::now();
            let mut taken = None;
            for (i, h) in held.iter().enumerate() {
                if request_in(&h.tcp) {
                    taken = Some((i, true));
                    break;
                }
                if now.saturating_duration_since(h.accepted_at) >= sc.opts.connect_timeout {
                    taken = Some((i, false));
                    break;
                }
            }
            if let Some((i, complete)) = taken {
                let Some(h) = held.remove(i) else {
                    continue;
                };
                let _ = rustix::event::epoll::delete(&sc.epoll, &h.tcp);
                self.arm(sc, &held, now)?;
                drop(held);
                if !complete {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "no MPA Request from {} within {:?}",
                            h.peer, sc.opts.connect_timeout
                        ),
                    ));
                }
                h.tcp.set_nonblocking(false)?;
                let stream = IwarpStream::establish(h.tcp, Side::Responder, &sc.opts)?;
                return Ok((stream, h.peer));
            }
            self.arm(sc, &held, now)?;
            if self.nonblocking.load(Ordering::Relaxed) {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            sc.wait(None)?;
        }
    }

    /// Sets what wakes the epoll set next: the listener's socket while there is room or
    /// once the oldest held connection may be closed for a newcomer (before that the timer:
    /// a waiting connection would keep the socket readable), and the timer for the first
    /// held connection's deadline.
    fn arm(&self, sc: &Screening, held: &VecDeque<HeldConn>, now: Instant) -> io::Result<()> {
        use rustix::event::epoll;
        use rustix::time::{timerfd_settime, Itimerspec, TimerfdTimerFlags, Timespec};
        let evictable_in = held
            .front()
            .map(|h| EVICT_AGE.saturating_sub(now.saturating_duration_since(h.accepted_at)));
        let watch = held.len() < LISTENER_HELD || evictable_in.is_some_and(|d| d.is_zero());
        let flags = if watch {
            epoll::EventFlags::IN
        } else {
            epoll::EventFlags::empty()
        };
        epoll::modify(
            &sc.epoll,
            &self.tcp,
            epoll::EventData::new_u64(LISTENER_TOKEN),
            flags,
        )?;
        let mut next = held.front().map(|h| {
            sc.opts
                .connect_timeout
                .saturating_sub(now.saturating_duration_since(h.accepted_at))
        });
        if !watch {
            next = next.into_iter().chain(evictable_in).min();
        }
        // Zero disarms a timerfd: a deadline already due fires in a nanosecond.
        let value = next.map_or(
            Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            |d| {
                let d = d.max(Duration::from_nanos(1));
                Timespec {
                    tv_sec: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
                    tv_nsec: i64::from(d.subsec_nanos()),
                }
            },
        );
        let spec = Itimerspec {
            it_interval: Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: value,
        };
        timerfd_settime(&sc.timer, TimerfdTimerFlags::empty(), &spec)?;
        Ok(())
    }

    /// Takes the connections waiting in the kernel's queue while there is room; full, takes
    /// one more in place of the oldest once that has waited [`EVICT_AGE`].
    fn take_connections(&self, sc: &Screening, held: &mut VecDeque<HeldConn>) -> io::Result<()> {
        use rustix::event::epoll;
        loop {
            let full = held.len() >= LISTENER_HELD;
            if full
                && held
                    .front()
                    .is_none_or(|h| h.accepted_at.elapsed() < EVICT_AGE)
            {
                return Ok(());
            }
            match self.tcp.accept() {
                Ok((tcp, peer)) => {
                    tcp.set_nonblocking(true)?;
                    if full {
                        if let Some(old) = held.pop_front() {
                            tracing::debug!(peer = %old.peer, "connection without an MPA Request evicted");
                        }
                    }
                    let token = u64::try_from(tcp.as_raw_fd()).unwrap_or(0);
                    epoll::add(
                        &sc.epoll,
                        &tcp,
                        epoll::EventData::new_u64(token),
                        epoll::EventFlags::IN | epoll::EventFlags::ET,
                    )?;
                    held.push_back(HeldConn {
                        tcp,
                        peer,
                        accepted_at: Instant::now(),
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// iWARP mode: connections taken whose MPA Request is not all in yet.
    pub fn pending(&self) -> usize {
        self.iwarp.as_ref().map_or(0, |sc| lock(&sc.held).len())
    }

    /// Accepted connections, as [`TcpListener::incoming`].
    pub fn incoming(&self) -> impl Iterator<Item = io::Result<IwarpStream>> + '_ {
        std::iter::repeat_with(move || self.accept().map(|(s, _)| s))
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// Non-blocking `accept` (in iWARP mode the MPA exchange of a connection whose Request
    /// is all in still runs in the call, which is quick).
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.nonblocking.store(on, Ordering::Relaxed);
        if self.iwarp.is_none() {
            self.tcp.set_nonblocking(on)?;
        }
        Ok(())
    }
}

impl AsFd for IwarpListener {
    /// The listening socket; in iWARP mode the epoll set described at [`IwarpListener`].
    fn as_fd(&self) -> BorrowedFd<'_> {
        match &self.iwarp {
            Some(sc) => sc.epoll.as_fd(),
            None => self.tcp.as_fd(),
        }
    }
}

impl AsRawFd for IwarpListener {
    /// As [`AsFd::as_fd`].
    fn as_raw_fd(&self) -> RawFd {
        self.as_fd().as_raw_fd()
    }
}

#[derive(Debug, Clone)]
enum Inner {
    Tcp(Arc<TcpStream>),
    Iwarp(Arc<Conn>),
}

#[derive(Debug, Default)]
struct Modes {
    nonblocking: AtomicBool,
    interrupts: AtomicBool,
    read_timeout: Mutex<Option<Duration>>,
    write_timeout: Mutex<Option<Duration>>,
}

/// A connected stream shaped like [`TcpStream`]: plain TCP, or iWARP Sends over a QP.
///
/// In iWARP mode [`AsRawFd`] gives the descriptor of the connection's completion channel:
/// it becomes readable when a completion arrives, so a `poll`/`epoll` loop wakes when the
/// stream may read or write; the wake-up may be early (call [`IwarpStream::poll_ready`], or
/// read and write in non-blocking mode and expect `WouldBlock`).
///
/// A read or write that waited for its timeout returns `WouldBlock`. A signal during a
/// blocking read or write does not end it, unless [`IwarpStream::set_report_interrupts`]
/// asks for `Interrupted` (the preload library's `EINTR`).
#[derive(Debug, Clone)]
pub struct IwarpStream {
    inner: Inner,
    modes: Arc<Modes>,
}

impl IwarpStream {
    fn from_tcp(tcp: TcpStream) -> Self {
        Self {
            inner: Inner::Tcp(Arc::new(tcp)),
            modes: Arc::default(),
        }
    }

    /// Runs the MPA exchange as `side` over `tcp` on the calling thread (bounded by
    /// [`IwarpOptions::connect_timeout`]).
    fn establish(tcp: TcpStream, side: Side, opts: &IwarpOptions) -> io::Result<Self> {
        crate::Handshake::start(tcp, side, opts)?
            .wait(None)?
            .ok_or_else(|| io::ErrorKind::TimedOut.into())
    }

    pub(crate) fn from_conn(conn: Arc<Conn>) -> Self {
        Self {
            inner: Inner::Iwarp(conn),
            modes: Arc::default(),
        }
    }

    /// Runs the MPA exchange as `role` over a TCP connection established by other means
    /// (the preload library's path: the program's own socket) and returns the iWARP stream.
    pub fn from_connected(tcp: TcpStream, role: Side, opts: &IwarpOptions) -> io::Result<Self> {
        tcp.set_nonblocking(false)?;
        Self::establish(tcp, role, opts)
    }

    /// A plain TCP connection to `addr`, as [`TcpStream::connect`].
    pub fn connect<A: ToSocketAddrs>(addr: A) -> io::Result<Self> {
        Ok(Self::from_tcp(TcpStream::connect(addr)?))
    }

    /// An iWARP-mode connection to `addr` (an iWARP-mode [`IwarpListener`] or preloaded
    /// program) with default settings.
    pub fn connect_iwarp<A: ToSocketAddrs>(addr: A) -> io::Result<Self> {
        Self::connect_with(addr, &IwarpOptions::default())
    }

    /// An iWARP-mode connection to `addr` with `opts` (the TCP connect is bounded by
    /// [`IwarpOptions::connect_timeout`] too).
    pub fn connect_with<A: ToSocketAddrs>(addr: A, opts: &IwarpOptions) -> io::Result<Self> {
        let mut last = None;
        for a in addr.to_socket_addrs()? {
            match TcpStream::connect_timeout(&a, opts.connect_timeout) {
                Ok(tcp) => return Self::establish(tcp, Side::Initiator, opts),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| invalid("the address resolved to nothing")))
    }

    /// Adopts an established TCP connection into iWARP mode (the stream handover): both
    /// ends call this on their end of the same connection once their own protocol agreed
    /// to switch (as with STARTTLS), with nothing in flight. The end with the lower
    /// `(address, port)` sends the MPA Request, the other answers; the MPA exchange is
    /// bounded by [`IwarpOptions::connect_timeout`].
    pub fn handover(tcp: TcpStream, opts: &IwarpOptions) -> io::Result<Self> {
        let local = tcp.local_addr()?;
        let peer = tcp.peer_addr()?;
        let side = match (local.ip(), local.port()).cmp(&(peer.ip(), peer.port())) {
            std::cmp::Ordering::Less => Side::Initiator,
            std::cmp::Ordering::Greater => Side::Responder,
            std::cmp::Ordering::Equal => return Err(invalid("a connection to itself")),
        };
        tcp.set_nonblocking(false)?;
        tcp.set_read_timeout(None)?;
        tcp.set_write_timeout(None)?;
        Self::establish(tcp, side, opts)
    }

    /// [`IwarpStream::handover`] of a plain stream (the only handle to it); an iWARP
    /// stream is returned as it is.
    pub fn into_iwarp(self, opts: &IwarpOptions) -> io::Result<Self> {
        match self.inner {
            Inner::Iwarp(_) => Ok(self),
            Inner::Tcp(tcp) => {
                let tcp = Arc::try_unwrap(tcp)
                    .map_err(|_| invalid("another clone of the stream is alive"))?;
                Self::handover(tcp, opts)
            }
        }
    }

    /// True when the bytes travel as iWARP Sends.
    pub fn is_iwarp(&self) -> bool {
        matches!(self.inner, Inner::Iwarp(_))
    }

    /// `getsockopt(SOL_SOFTWARP, SO_IWARP_ACTIVE)` and `SO_IWARP_MODE`.
    pub fn option(&self, level: i32, name: i32) -> io::Result<i32> {
        match (level, name) {
            (SOL_SOFTWARP, SO_IWARP_MODE | SO_IWARP_ACTIVE) => Ok(i32::from(self.is_iwarp())),
            (SOL_SOFTWARP, _) => Err(io::Error::from_raw_os_error(libc_enoprotoopt())),
            _ => Err(invalid("only SOL_SOFTWARP options here")),
        }
    }

    /// Another handle to the same stream (as [`TcpStream::try_clone`], sharing the
    /// non-blocking mode and timeouts).
    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(self.clone())
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        match &self.inner {
            Inner::Tcp(t) => t.peer_addr(),
            Inner::Iwarp(c) => Ok(c.info().peer_addr),
        }
    }

    /// This end's address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        match &self.inner {
            Inner::Tcp(t) => t.local_addr(),
            Inner::Iwarp(c) => Ok(c.info().local_addr),
        }
    }

    /// Shuts down reading, writing or both. Writing: the peer reads EOF after every byte
    /// written before (in iWARP mode an EOF message, sent as soon as a credit allows; a
    /// blocking stream waits for that credit, at most the linger time, because with no
    /// thread of its own an EOF left waiting would go out only at the program's next call
    /// into the stream).
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match &self.inner {
            Inner::Tcp(t) => t.shutdown(how),
            Inner::Iwarp(c) => {
                if matches!(how, Shutdown::Write | Shutdown::Both) {
                    // A blocking stream waits until the EOF has left (see Conn).
                    c.shutdown_write(!self.nonblocking());
                }
                if matches!(how, Shutdown::Read | Shutdown::Both) {
                    c.shutdown_read();
                }
                Ok(())
            }
        }
    }

    /// `shutdown(Write)` that never waits for the EOF's credit; then
    /// [`IwarpStream::eof_pending`] says whether it left (for the async wrapper).
    #[cfg(feature = "tokio")]
    pub(crate) fn shutdown_write_nowait(&self) -> io::Result<()> {
        match &self.inner {
            Inner::Tcp(t) => t.shutdown(Shutdown::Write),
            Inner::Iwarp(c) => {
                c.shutdown_write(false);
                Ok(())
            }
        }
    }

    /// Parks `waker` on reading or writing and arms the CQs (`Conn::park`): the next
    /// poll of the stream that counts an event of that direction wakes it.
    #[cfg(feature = "tokio")]
    pub(crate) fn park(&self, write: bool, waker: &std::task::Waker) {
        if let Inner::Iwarp(c) = &self.inner {
            c.park(write, waker);
        }
    }

    /// Forgets the task parked on reading or writing.
    #[cfg(feature = "tokio")]
    pub(crate) fn unpark(&self, write: bool) {
        if let Inner::Iwarp(c) = &self.inner {
            c.unpark(write);
        }
    }

    /// True while an iWARP stream's EOF waits for a credit.
    #[cfg(feature = "tokio")]
    pub(crate) fn eof_pending(&self) -> bool {
        match &self.inner {
            Inner::Tcp(_) => false,
            Inner::Iwarp(c) => c.eof_pending(),
        }
    }

    /// Non-blocking mode: reads and writes that would wait return `WouldBlock`.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        if let Inner::Tcp(t) = &self.inner {
            t.set_nonblocking(on)?;
        }
        self.modes.nonblocking.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// Read timeout (`None`: none; zero is refused, as by [`TcpStream`]). A read that
    /// times out returns `WouldBlock`.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(invalid("a zero timeout"));
        }
        if let Inner::Tcp(s) = &self.inner {
            s.set_read_timeout(t)?;
        }
        *lock(&self.modes.read_timeout) = t;
        Ok(())
    }

    /// Write timeout, as [`IwarpStream::set_read_timeout`].
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(invalid("a zero timeout"));
        }
        if let Inner::Tcp(s) = &self.inner {
            s.set_write_timeout(t)?;
        }
        *lock(&self.modes.write_timeout) = t;
        Ok(())
    }

    /// The read timeout.
    pub fn read_timeout(&self) -> io::Result<Option<Duration>> {
        Ok(*lock(&self.modes.read_timeout))
    }

    /// The write timeout.
    pub fn write_timeout(&self) -> io::Result<Option<Duration>> {
        Ok(*lock(&self.modes.write_timeout))
    }

    /// `TCP_NODELAY`. iWARP mode: remembered and reported by [`IwarpStream::nodelay`]
    /// (a stream never waits on Nagle's algorithm); setting it sends bytes held by
    /// `MSG_MORE` or the cork, as the kernel pushes its pending segments then.
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        match &self.inner {
            Inner::Tcp(t) => t.set_nodelay(on),
            Inner::Iwarp(c) => {
                c.set_nodelay(on);
                Ok(())
            }
        }
    }

    /// `TCP_NODELAY` as set.
    pub fn nodelay(&self) -> io::Result<bool> {
        match &self.inner {
            Inner::Tcp(t) => t.nodelay(),
            Inner::Iwarp(c) => Ok(c.nodelay()),
        }
    }

    /// `TCP_CORK`: while on, writes are held until a whole message (a receive slot of the
    /// peer) is full; turning it off sends what is held. iWARP mode: the stream holds them
    /// (never the connection's TCP socket, whose FPDUs would wait up to 200 ms); unlike
    /// the kernel, held bytes do not leave by themselves after 200 ms, only with the
    /// program's next call that sends or uncorks.
    pub fn set_cork(&self, on: bool) -> io::Result<()> {
        match &self.inner {
            Inner::Tcp(t) => socket2::SockRef::from(&**t).set_tcp_cork(on),
            Inner::Iwarp(c) => {
                c.set_cork(on);
                Ok(())
            }
        }
    }

    /// `TCP_CORK` as set.
    pub fn cork(&self) -> io::Result<bool> {
        match &self.inner {
            Inner::Tcp(t) => socket2::SockRef::from(&**t).tcp_cork(),
            Inner::Iwarp(c) => Ok(c.cork()),
        }
    }

    /// Bytes a read returns now without waiting (`FIONREAD`; plain TCP: 0 is not known
    /// here, use `ioctl` on the descriptor).
    pub fn bytes_readable(&self) -> usize {
        match &self.inner {
            Inner::Tcp(_) => 0,
            Inner::Iwarp(c) => c.bytes_readable(),
        }
    }

    /// What a read and a write would do now without waiting (plain TCP: both true; use
    /// `poll` on the descriptor).
    pub fn poll_ready(&self) -> Readiness {
        match &self.inner {
            Inner::Tcp(_) => Readiness {
                readable: true,
                writable: true,
                ..Readiness::default()
            },
            Inner::Iwarp(c) => c.poll_ready(),
        }
    }

    /// Reads with an explicit blocking choice for this call (`MSG_DONTWAIT`), honouring the
    /// read timeout.
    pub fn read_with(&self, buf: &mut [u8], nonblocking: bool) -> io::Result<usize> {
        match &self.inner {
            Inner::Tcp(t) => (&**t).read(buf),
            Inner::Iwarp(c) => c.read(buf, self.wait(nonblocking, self.read_timeout()?)),
        }
    }

    /// Copies the next bytes without consuming them (`MSG_PEEK`; with `all`, waits for
    /// `buf.len()` bytes or the end, as `MSG_PEEK | MSG_WAITALL`), honouring the read
    /// timeout. Plain TCP: `peek` of the socket.
    pub fn peek_with(&self, buf: &mut [u8], all: bool, nonblocking: bool) -> io::Result<usize> {
        match &self.inner {
            Inner::Tcp(t) => t.peek(buf),
            Inner::Iwarp(c) => c.peek(buf, all, self.wait(nonblocking, self.read_timeout()?)),
        }
    }

    /// Writes with an explicit blocking choice for this call; may write fewer bytes than
    /// given (as `write(2)`).
    pub fn write_with(&self, buf: &[u8], nonblocking: bool) -> io::Result<usize> {
        self.write_more_with(buf, false, nonblocking)
    }

    /// [`IwarpStream::write_with`] with `MSG_MORE` (`more`): more bytes follow, so a last
    /// piece smaller than a message is held (iWARP mode) until the next write without it
    /// fills or sends it (see [`IwarpStream::set_cork`]). Plain TCP: `send` with
    /// `MSG_MORE`.
    pub fn write_more_with(&self, buf: &[u8], more: bool, nonblocking: bool) -> io::Result<usize> {
        match &self.inner {
            Inner::Tcp(t) if more => {
                use rustix::net::SendFlags;
                let mut flags = SendFlags::MORE;
                if nonblocking {
                    flags |= SendFlags::DONTWAIT;
                }
                Ok(rustix::net::send(&**t, buf, flags)?)
            }
            Inner::Tcp(t) => (&**t).write(buf),
            Inner::Iwarp(c) => c.write(buf, more, self.wait(nonblocking, self.write_timeout()?)),
        }
    }

    /// [`IwarpStream::poll_ready`], and when neither is ready, arms the connection so that
    /// its descriptor ([`AsRawFd`]) becomes readable at the next completion: the pattern
    /// for an event loop (check, arm, then wait on the descriptor).
    pub fn arm_readiness(&self) -> Readiness {
        self.arm_readiness_for(true)
    }

    /// [`IwarpStream::arm_readiness`] for an event loop that waits to read only (`write`
    /// false: `POLLIN` without `POLLOUT`): room to send does not make the descriptor
    /// readable then, only what a read may return (and a send completion while a send is
    /// in flight, which a grant may wait for). A server that arms its streams for reading
    /// and then writes its replies is not woken by their completions.
    pub fn arm_readiness_for(&self, write: bool) -> Readiness {
        match &self.inner {
            Inner::Tcp(_) => self.poll_ready(),
            Inner::Iwarp(c) => c.arm(write),
        }
    }

    /// Counts the calling thread as waiting on this stream's descriptor ([`AsRawFd`]) until
    /// the returned guard drops (iWARP mode; `None` for plain TCP). Another thread's call
    /// on the stream that takes the completion this thread waits for then makes
    /// [`StreamWaiter::kick_fd`] readable: an event loop waits on both descriptors, arming
    /// with [`StreamWaiter::arm_readiness`] (the guard's thread does not kick itself). The
    /// completion channel alone cannot tell it: whoever looks first consumes its event.
    pub fn waiter(&self) -> Option<StreamWaiter<'_>> {
        let conn = self.conn().ok()?;
        conn.begin_wait();
        Some(StreamWaiter { conn })
    }

    /// The QP number of the connection (as `softwarp resources` lists it), in iWARP mode.
    pub fn qp_num(&self) -> Option<u32> {
        self.conn().ok().map(|c| c.qp_num())
    }

    /// The QP's counters (bytes and messages per opcode), in iWARP mode.
    pub fn qp_stats(&self) -> Option<softwarp::QpStats> {
        self.conn().ok().map(|c| c.stats())
    }

    /// Registered bytes of the connection's rings (iWARP mode; windows not included).
    pub fn ring_memory(&self) -> usize {
        self.conn().map_or(0, |c| c.ring_bytes())
    }

    /// Receive slots this end posted (iWARP mode).
    pub fn recv_slots(&self) -> Option<u32> {
        self.conn().ok().map(|c| c.recv_slots())
    }

    pub(crate) fn conn(&self) -> io::Result<&Arc<Conn>> {
        match &self.inner {
            Inner::Iwarp(c) => Ok(c),
            Inner::Tcp(_) => Err(not_iwarp()),
        }
    }

    fn nonblocking(&self) -> bool {
        self.modes.nonblocking.load(Ordering::Relaxed)
    }

    fn interrupts(&self) -> bool {
        self.modes.interrupts.load(Ordering::Relaxed)
    }

    /// How a call on the connection may wait: `nonblocking` for this call, at most
    /// `timeout`, ended by a signal when [`IwarpStream::set_report_interrupts`] asked.
    fn wait(&self, nonblocking: bool, timeout: Option<Duration>) -> Wait {
        Wait {
            nonblocking,
            timeout,
            interruptible: self.interrupts(),
        }
    }

    /// With `on`, a signal that arrives while a read or write waits ends it with
    /// `ErrorKind::Interrupted` (when it moved no bytes yet), as `EINTR` ends a blocking
    /// socket call; off (the default), the wait goes on. Shared by clones.
    pub fn set_report_interrupts(&self, on: bool) {
        self.modes.interrupts.store(on, Ordering::Relaxed);
    }

    // ---- one-sided extensions --------------------------------------------------------

    /// Registers `len` bytes that the peer may RDMA Write and Read as `offset .. offset +
    /// len` (like rsocket's `riomap`), and advertises them in order with the stream. The
    /// peer's [`IwarpStream::write_remote`] lands in the returned [`Window`] with no copy on
    /// this side (zero-copy receive). The window stays registered while the stream lives.
    pub fn expose(&self, len: usize, offset: u64) -> io::Result<Window> {
        if len == 0 {
            return Err(invalid("an empty window"));
        }
        let mr = self.conn()?.expose(len, offset)?;
        Ok(Window { mr, offset })
    }

    /// Waits (at most `timeout`) until the peer has exposed windows covering
    /// `offset .. offset + len`.
    pub fn wait_peer_window(&self, offset: u64, len: u64, timeout: Duration) -> io::Result<()> {
        self.conn()?.wait_peer_window(offset, len, timeout)
    }

    /// One-sided RDMA Write of `data` into the peer's window at `offset` (like rsocket's
    /// `riowrite`); returns once every byte was handed to TCP (at most 10 s). The peer's
    /// windows must cover the range (`NotFound` otherwise; see
    /// [`IwarpStream::wait_peer_window`]). The peer is not told: see
    /// [`IwarpStream::write_remote_notify`].
    pub fn write_remote(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.conn()?
            .write_remote(offset, data, false, ONE_SIDED_TIMEOUT)
    }

    /// [`IwarpStream::write_remote`], then a notice the peer receives with
    /// [`IwarpStream::recv_write_notice`] once the bytes are in its window. The notice
    /// needs a credit: while [`crate::violation::MAX_NOTICES_UNSENT`] notices wait for the
    /// peer's, this call waits too (`TimedOut` after 10 s in all).
    pub fn write_remote_notify(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.conn()?
            .write_remote(offset, data, true, ONE_SIDED_TIMEOUT)
    }

    /// One-sided RDMA Read of `buf.len()` bytes of the peer's window at `offset`.
    pub fn read_remote(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        self.conn()?.read_remote(offset, buf, ONE_SIDED_TIMEOUT)
    }

    /// The next `(offset, len)` the peer wrote with [`IwarpStream::write_remote_notify`]
    /// (the bytes are in the window by then), waiting at most `timeout` (non-blocking mode:
    /// not at all). Only notices inside a window this stream exposed are accepted, and at
    /// most [`crate::violation::MAX_NOTICES_UNREAD`] wait here: a peer past either aborts
    /// the stream ([`crate::PeerViolation`]).
    pub fn recv_write_notice(&self, timeout: Duration) -> io::Result<(u64, u64)> {
        self.conn()?.wrote_notice(self.nonblocking(), timeout)
    }
}

impl Read for &IwarpStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_with(buf, self.nonblocking())
    }
}

impl Read for IwarpStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for &IwarpStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_with(buf, self.nonblocking())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Write for IwarpStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl From<TcpStream> for IwarpStream {
    /// A plain TCP stream (see [`IwarpStream::into_iwarp`]).
    fn from(tcp: TcpStream) -> Self {
        Self::from_tcp(tcp)
    }
}

impl std::os::fd::AsFd for IwarpStream {
    /// As [`AsRawFd`]: the TCP socket, or in iWARP mode the completion channel.
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match &self.inner {
            Inner::Tcp(t) => t.as_fd(),
            Inner::Iwarp(c) => c.event_fd_borrowed(),
        }
    }
}

impl AsRawFd for IwarpStream {
    fn as_raw_fd(&self) -> RawFd {
        match &self.inner {
            Inner::Tcp(t) => t.as_raw_fd(),
            Inner::Iwarp(c) => c.event_fd(),
        }
    }
}

/// Registered memory exposed to the peer ([`IwarpStream::expose`]): the peer's one-sided
/// Writes land here and its Reads read from here. Offsets of the methods are relative to
/// the window's start.
#[derive(Debug, Clone)]
pub struct Window {
    mr: Arc<softwarp::MemoryRegion>,
    offset: u64,
}

impl Window {
    /// Where the window starts in the peer's view.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.mr.len()
    }

    /// True for an empty window (never: [`IwarpStream::expose`] refuses them).
    pub fn is_empty(&self) -> bool {
        self.mr.is_empty()
    }

    /// Copies bytes out of the window.
    pub fn read_at(&self, at: usize, buf: &mut [u8]) -> io::Result<()> {
        self.mr.read_at(at, buf).map_err(crate::conn::io_err)
    }

    /// Copies bytes into the window (for the peer's Reads).
    pub fn write_at(&self, at: usize, data: &[u8]) -> io::Result<()> {
        self.mr.write_at(at, data).map_err(crate::conn::io_err)
    }

    /// The whole window.
    pub fn to_vec(&self) -> io::Result<Vec<u8>> {
        self.mr.to_vec().map_err(crate::conn::io_err)
    }
}

/// A thread waiting on an iWARP stream's descriptor: see [`IwarpStream::waiter`].
#[derive(Debug)]
pub struct StreamWaiter<'a> {
    conn: &'a Conn,
}

impl StreamWaiter<'_> {
    /// [`IwarpStream::arm_readiness`] for the waiting thread.
    pub fn arm_readiness(&self) -> Readiness {
        self.conn.arm_as_waiter(true)
    }

    /// [`IwarpStream::arm_readiness_for`] for the waiting thread.
    pub fn arm_readiness_for(&self, write: bool) -> Readiness {
        self.conn.arm_as_waiter(write)
    }

    /// Readable while another thread's call took a completion this one may wait for: wait
    /// on it beside the stream's descriptor, and call [`StreamWaiter::take_kick`] when it
    /// was readable.
    pub fn kick_fd(&self) -> BorrowedFd<'_> {
        self.conn.kick_fd()
    }

    /// Takes the kick this thread's wait reported (one unit: every waiting thread gets
    /// its own).
    pub fn take_kick(&self) {
        self.conn.take_kick();
    }

    /// Readable while the peer's bytes wait in the connection's TCP socket (an epoll set
    /// holding it): wait on it too, and call [`StreamWaiter::serve`] when it was readable,
    /// so that this thread moves them instead of waiting for the device's progress thread
    /// to move them and signal the stream's descriptor (one thread wake-up instead of two).
    pub fn socket_fd(&self) -> BorrowedFd<'_> {
        self.conn.socket_fd()
    }

    /// Moves the connection's bytes on this thread (after [`StreamWaiter::socket_fd`] was
    /// readable) and takes what that completed; true when it brought an event (ask the
    /// readiness again). False when another thread was moving them (its completion follows,
    /// signalling the stream's descriptor) or the pass brought nothing (a socket readable
    /// for good, at its end): leave the socket out of the next wait then, or it wakes at
    /// once again.
    pub fn serve(&self) -> bool {
        self.conn.serve(1)
    }
}

impl Drop for StreamWaiter<'_> {
    fn drop(&mut self) {
        self.conn.end_wait();
    }
}
