//! Which descriptors of the program are Softwarp's: a bitmap for the fast "not ours" answer
//! every intercepted call asks first, and a map with the details.
//!
//! The map's lock is held only to read or change the map: never across a call into the
//! stack or into libc (the stack's own threads call intercepted functions too).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use softwarp_sockets::{Handshake, IwarpStream, Side};

/// A connected iWARP stream behind a descriptor (shared by its `dup`s).
#[derive(Debug)]
pub struct StreamEntry {
    /// The stream (closing it sends the EOF and disconnects, once the last dup is closed).
    pub stream: IwarpStream,
    /// A duplicate of the TCP socket, for the socket options and addresses the program
    /// asks about (dropped after the stream).
    pub tcp: OwnedFd,
    /// `O_NONBLOCK` as the program set it (shared by dups, as the open file description's).
    pub nonblocking: AtomicBool,
    /// The process that set the stream up: in the child of a `fork` the parent's streams
    /// are unusable (their progress thread did not survive the fork).
    pub pid: u32,
}

/// An rsocket of `softwarp-verbs`' `rsocket` module behind a descriptor of the program
/// (`SOFTWARP_SOCKETS_PROTOCOL=rsocket`; shared by the descriptor's `dup`s): the program's
/// number is a duplicate of the rsocket's own number (an eventfd nothing signals), and
/// every call on it goes to the rsocket's entry point.
#[derive(Debug)]
pub struct RsocketEntry {
    /// The rsocket's number.
    pub rs: i32,
    /// The process that made it (a `fork`ed child's copies are unusable, as streams').
    pub pid: u32,
}

impl Drop for RsocketEntry {
    /// The last descriptor of the rsocket went: `rclose` (shutdown, disconnect, the
    /// connection's graceful close awaited), except in a forked child, which only forgets
    /// its parent's rsocket.
    fn drop(&mut self) {
        if FORKED.load(Ordering::Relaxed) && self.pid != std::process::id() {
            return;
        }
        softwarp_verbs::rsocket::swv_rclose(self.rs);
    }
}

/// A socket whose MPA exchange is under way, advanced as its bytes arrive by whatever the
/// program calls on it (`poll`, `select`, `epoll_wait`, `getsockopt`, I/O), never waiting
/// in a call the program made non-blocking:
/// - [`Side::Initiator`]: a non-blocking `connect` in progress (`EINPROGRESS`), then the
///   MPA Request and Reply.
/// - [`Side::Responder`]: an accepted connection; the exchange starts when the program
///   first looks at it (so that the child of a forking server, `socat fork`, runs it with a
///   device of its own) and answers the peer's Request once it is all in.
#[derive(Debug)]
pub struct Deferred {
    pub side: Side,
    /// `O_NONBLOCK` as the program set it: the socket itself is non-blocking once the
    /// exchange started (its open file description is shared with the exchange's
    /// duplicate), so `fcntl`/`ioctl(FIONBIO)` answer from here.
    pub nonblocking: AtomicBool,
    /// True while the exchange waits for room to send (a TCP connect in progress, the
    /// Request not all written), false while it waits for bytes: what `poll` and `epoll`
    /// watch the socket for.
    pub wants_write: AtomicBool,
    /// When the connection was accepted or the connect started (the TCP fallback waits for
    /// an accepted connection's first bytes at most the connect timeout from then).
    pub since: Instant,
    /// The address a `connect` went to (`sockaddr_storage` bytes and length), for the TCP
    /// fallback.
    pub addr: Option<([u8; 128], u32)>,
    /// The exchange; one thread advances it at a time (the others find it busy and look
    /// again later).
    pub exchange: Mutex<Exchange>,
}

/// Where a [`Deferred`] socket's MPA exchange is.
#[derive(Debug)]
pub enum Exchange {
    /// Not started: the program has not looked at the socket yet.
    NotStarted,
    /// Under way, started by process `pid` (a child of a `fork` does not advance its
    /// parent's: the QP belongs to the parent's device).
    Running { handshake: Box<Handshake>, pid: u32 },
    /// Over: the descriptor became a stream, a failed connection or a plain socket (a
    /// `dup` of the descriptor made meanwhile still holds this).
    Over,
}

impl Deferred {
    pub fn new(side: Side, nonblocking: bool, addr: Option<([u8; 128], u32)>) -> Arc<Self> {
        Arc::new(Self {
            side,
            nonblocking: nonblocking.into(),
            wants_write: (side == Side::Initiator).into(),
            since: Instant::now(),
            addr,
            exchange: Mutex::new(Exchange::NotStarted),
        })
    }
}

/// What a descriptor of ours is.
#[derive(Debug, Clone)]
pub enum Entry {
    /// A TCP socket in iWARP mode, not yet connected or listening.
    Pending,
    /// A connected TCP socket whose MPA exchange is still to run ([`Deferred`]).
    Deferred(Arc<Deferred>),
    /// A connect that failed (TCP or MPA): the socket is shut down; the error is reported
    /// once by `getsockopt(SO_ERROR)` (then 0), as the kernel's pending socket error.
    Failed(Arc<AtomicI32>),
    /// A listening socket in iWARP mode: accepted connections run MPA.
    Listener,
    /// An iWARP stream: the descriptor is a duplicate of its completion channel.
    Stream(Arc<StreamEntry>),
    /// An rsocket (connecting, connected or listening).
    Rsocket(Arc<RsocketEntry>),
}

const FAST: usize = 1 << 16;
static MARK: [AtomicU8; FAST] = [const { AtomicU8::new(0) }; FAST];
static MAP: Mutex<Option<HashMap<i32, Entry>>> = Mutex::new(None);
/// How many descriptors the map holds (stored under its lock after each change).
static OURS: AtomicUsize = AtomicUsize::new(0);
/// Set in the child of a `fork`: its copies of the parent's streams are unusable (no
/// progress thread), so they fail with `EIO` and closing them only forgets them.
pub static FORKED: AtomicBool = AtomicBool::new(false);

fn map() -> MutexGuard<'static, Option<HashMap<i32, Entry>>> {
    MAP.lock().unwrap_or_else(|p| p.into_inner())
}

fn mark(fd: i32, on: bool) {
    if let Some(m) = usize::try_from(fd).ok().and_then(|i| MARK.get(i)) {
        m.store(u8::from(on), Ordering::Release);
    }
}

/// True when some descriptor is ours: when not, `poll` and `select` go to libc without
/// looking at their descriptors.
#[inline]
pub fn any_ours() -> bool {
    OURS.load(Ordering::Relaxed) != 0
}

/// True when `fd` is in the bitmap's range and not marked: certainly not ours. No call,
/// so that it can sit in the pass-through's fast path ([`maybe_ours`] for the rest).
#[inline(always)]
pub fn surely_not_ours(fd: i32) -> bool {
    usize::try_from(fd)
        .ok()
        .and_then(|i| MARK.get(i))
        .is_some_and(|m| m.load(Ordering::Acquire) == 0)
}

/// True when `fd` may be ours (above the bitmap's range: when the map has it). The first
/// question of every intercepted call, so inlined: a load of the descriptor's byte.
#[inline]
pub fn maybe_ours(fd: i32) -> bool {
    match usize::try_from(fd) {
        Ok(i) if i < FAST => MARK[i].load(Ordering::Acquire) != 0,
        Ok(_) => in_map(fd),
        Err(_) => false,
    }
}

#[cold]
#[inline(never)]
fn in_map(fd: i32) -> bool {
    map().as_ref().is_some_and(|m| m.contains_key(&fd))
}

/// The entry of `fd`.
#[inline]
pub fn get(fd: i32) -> Option<Entry> {
    if !maybe_ours(fd) {
        return None;
    }
    entry(fd)
}

#[inline(never)]
fn entry(fd: i32) -> Option<Entry> {
    map().as_ref().and_then(|m| m.get(&fd).cloned())
}

/// The stream of `fd`.
pub fn stream(fd: i32) -> Option<Arc<StreamEntry>> {
    match get(fd) {
        Some(Entry::Stream(s)) => Some(s),
        _ => None,
    }
}

/// Records `fd` (replacing what it was); returns the old entry.
pub fn insert(fd: i32, e: Entry) -> Option<Entry> {
    let mut g = map();
    let m = g.get_or_insert_with(HashMap::new);
    let old = m.insert(fd, e);
    OURS.store(m.len(), Ordering::Relaxed);
    mark(fd, true);
    old
}

/// Forgets `fd`; returns its entry (the caller drops it outside the lock).
#[inline]
pub fn remove(fd: i32) -> Option<Entry> {
    if !maybe_ours(fd) {
        return None;
    }
    forget(fd)
}

#[inline(never)]
fn forget(fd: i32) -> Option<Entry> {
    mark(fd, false);
    let mut g = map();
    let m = g.as_mut()?;
    let old = m.remove(&fd);
    OURS.store(m.len(), Ordering::Relaxed);
    old
}

/// Takes every stream and rsocket entry out of the map (process exit).
pub fn drain_streams() -> Vec<Entry> {
    let mut g = map();
    let Some(m) = g.as_mut() else {
        return Vec::new();
    };
    let fds: Vec<i32> = m
        .iter()
        .filter(|(_, e)| matches!(e, Entry::Stream(_) | Entry::Rsocket(_)))
        .map(|(fd, _)| *fd)
        .collect();
    let mut out = Vec::new();
    for fd in fds {
        if let Some(e) = m.remove(&fd) {
            mark(fd, false);
            out.push(e);
        }
    }
    OURS.store(m.len(), Ordering::Relaxed);
    out
}
