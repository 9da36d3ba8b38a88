//! Event channels and events.
//!
//! A `struct rdma_event_channel` owns a `softwarp::CmEventChannel` (connection requests and
//! connection events) and a queue of events this library makes itself (address and route
//! resolution, which need no network exchange here). Its `fd` is an epoll instance watching
//! both eventfds, so it is readable exactly while an event waits, as rdma-core's is.
//! `rdma_get_cm_event` turns Softwarp's events into `struct rdma_cm_event`s; connection
//! requests become new ids (on the listener's channel, as in rdma-core).
//!
//! A channel lives while it has ids, whatever the order of the destroys: it counts its ids
//! ([`ChanState::ids`]), and `rdma_destroy_event_channel` of a channel with ids left only
//! takes it from the application (later calls naming it fail with `EINVAL`); the destroy of
//! its last id frees it. rdma-core frees it at once, under ids that still read it
//! (`rdma_destroy_id` writes to `id->channel->fd`). The private channel of a synchronous id
//! is made already given up, so its last id (the listener or one of its requests) frees it.

use softwarp::sync::lock;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use softwarp::{CmEvent, CmEventChannel, ConnId, ListenerId};

use crate::cm::id::Id;
use crate::cm::live::{CHANNELS, EVENTS, GONE_CHANNELS};
use crate::cm::{err, to_storage};
use crate::errno;
use crate::ffi::*;
use crate::watch::Watch;

/// `struct rdma_event_channel` followed by Softwarp's channel.
#[repr(C)]
pub struct EvChannel {
    pub c: rdma_event_channel,
    /// Softwarp's channel; ids that listen or connect on it keep it too (`IdState::origin`):
    /// after `rdma_migrate_id` its thread still drives them.
    pub inner: Arc<CmEventChannel>,
    watch: Watch,
    notify: OwnedFd,
    st: Mutex<ChanState>,
}

#[derive(Default)]
pub struct ChanState {
    /// Events made here, waiting to be read (before Softwarp's).
    queue: VecDeque<Box<Event>>,
    /// Ids by the connection their Softwarp events name.
    pub conns: HashMap<ConnId, usize>,
    /// Listening ids by listener.
    pub listeners: HashMap<ListenerId, usize>,
    /// The ids on the channel (created on it, requests of its listeners, migrated to it).
    ids: usize,
    /// The application gave it up (or never had it: a synchronous id's own channel); the
    /// last of its ids to go frees it.
    given_up: bool,
}

/// `struct rdma_cm_event` and the private data it points to.
#[repr(C)]
pub struct Event {
    pub c: rdma_cm_event,
    private_data: Vec<u8>,
}

impl Event {
    pub fn new(id: *mut rdma_cm_id, ty: rdma_cm_event_type, status: c_int) -> Box<Event> {
        // SAFETY: plain C data; all-zero is valid.
        let mut c: rdma_cm_event = unsafe { std::mem::zeroed() };
        c.id = id;
        c.event = ty;
        c.status = status;
        Box::new(Event {
            c,
            private_data: Vec::new(),
        })
    }

    /// Sets the connection parameters (private data, IRD/ORD as the peer's view of them).
    pub fn conn(
        mut self: Box<Self>,
        data: &[u8],
        responder_resources: usize,
        initiator_depth: usize,
    ) -> Box<Self> {
        self.private_data = data.to_vec();
        let p = rdma_conn_param {
            private_data: if data.is_empty() {
                std::ptr::null()
            } else {
                self.private_data.as_ptr().cast()
            },
            private_data_len: u8::try_from(data.len()).unwrap_or(u8::MAX),
            responder_resources: u8::try_from(responder_resources).unwrap_or(u8::MAX),
            initiator_depth: u8::try_from(initiator_depth).unwrap_or(u8::MAX),
            flow_control: 0,
            retry_count: 0,
            rnr_retry_count: 0,
            srq: 0,
            qp_num: 0,
        };
        self.c.param.conn = p;
        self
    }
}

impl EvChannel {
    /// A new channel (its Softwarp channel thread included); `private` for the own channel
    /// of a synchronous id, which the application does not own and its last id frees.
    pub fn create(private: bool) -> Result<Box<EvChannel>, c_int> {
        let inner =
            CmEventChannel::new().map_err(|e| errno::fail("rdma_create_event_channel", &e))?;
        // SAFETY: creates a new descriptor, owned at once when valid.
        let nf = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if nf < 0 {
            return Err(std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EMFILE));
        }
        // SAFETY: `nf` is a fresh descriptor nobody else owns.
        let notify = unsafe { OwnedFd::from_raw_fd(nf) };
        let watch = Watch::new(&[inner.as_raw_fd(), notify.as_raw_fd()])?;
        Ok(Box::new(EvChannel {
            c: rdma_event_channel { fd: watch.fd() },
            inner: Arc::new(inner),
            watch,
            notify,
            st: Mutex::new(ChanState {
                given_up: private,
                ..ChanState::default()
            }),
        }))
    }

    pub fn state(&self) -> MutexGuard<'_, ChanState> {
        lock(&self.st)
    }

    /// Queues an event made here.
    pub fn push(&self, ev: Box<Event>) {
        let mut st = self.state();
        st.queue.push_back(ev);
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our eventfd; it cannot block (EFD_NONBLOCK) and a full
        // counter only means it is already readable.
        let _ = unsafe { libc::write(self.notify.as_raw_fd(), std::ptr::addr_of!(one).cast(), 8) };
    }

    /// One more id is on the channel.
    pub fn attach(&self) {
        let mut st = self.state();
        st.ids = st.ids.saturating_add(1);
    }

    /// The id `id` leaves the channel `ch` (destroyed, or migrated elsewhere): its queued
    /// events go with it (the kernel drops the events of a destroyed id), and the channel is
    /// freed when the application gave it up and this was its last id.
    ///
    /// # Safety
    /// `ch` must be the channel of `id`, which was attached to it; nothing uses `ch` after
    /// this call unless other ids are still on it.
    pub unsafe fn detach(ch: *mut rdma_event_channel, id: *mut rdma_cm_id) {
        // SAFETY: the caller's live channel.
        let Some(c) = (unsafe { ch.cast::<EvChannel>().as_ref() }) else {
            return;
        };
        let free = {
            let mut st = c.state();
            st.queue.retain(|ev| ev.c.id != id);
            if st.queue.is_empty() {
                c.reset_notify();
            }
            st.ids = st.ids.saturating_sub(1);
            st.given_up && st.ids == 0
        };
        if free {
            // SAFETY: allocated with Box (`rdma_create_event_channel`, or a synchronous id's
            // own); given up by its owner, and its last id is gone.
            drop(unsafe { Box::from_raw(ch.cast::<EvChannel>()) });
        }
    }

    /// Takes the queued events of `id` out of the queue (`rdma_migrate_id` moves them to
    /// the id's new channel, as the kernel does).
    pub fn take_events(&self, id: *mut rdma_cm_id) -> Vec<Box<Event>> {
        let mut st = self.state();
        let (taken, kept): (VecDeque<Box<Event>>, VecDeque<Box<Event>>) =
            std::mem::take(&mut st.queue)
                .into_iter()
                .partition(|ev| ev.c.id == id);
        st.queue = kept;
        if st.queue.is_empty() {
            self.reset_notify();
        }
        taken.into()
    }

    /// Empties the notification eventfd (the queue of events made here is empty).
    fn reset_notify(&self) {
        let mut v: u64 = 0;
        // SAFETY: reading our non-blocking eventfd resets it; EAGAIN when already 0.
        let _ = unsafe { libc::read(self.notify.as_raw_fd(), std::ptr::addr_of_mut!(v).cast(), 8) };
    }

    fn pop(&self) -> Option<Box<Event>> {
        let mut st = self.state();
        let ev = st.queue.pop_front();
        if st.queue.is_empty() {
            self.reset_notify();
        }
        ev
    }

    /// The next event for the application: queued ones first, then Softwarp's (translated;
    /// those that rdma-core never reports are dropped). Blocks unless the fd is
    /// non-blocking (then `EAGAIN`).
    pub fn next(&self, block: bool) -> Result<Box<Event>, c_int> {
        loop {
            if let Some(ev) = self.pop() {
                return Ok(ev);
            }
            if let Some(ev) = self.inner.try_get_event() {
                if let Some(ev) = self.translate(ev) {
                    return Ok(ev);
                }
                continue;
            }
            if !block || self.watch.nonblocking() {
                return Err(libc::EAGAIN);
            }
            self.watch.wait()?;
        }
    }

    /// The next event for which `want` holds, blocking; the others read meanwhile stay
    /// queued, in order, ahead of newer ones (synchronous ids share their listener's
    /// channel with the requests still to come).
    pub fn next_matching(&self, want: impl Fn(&Event) -> bool) -> Result<Box<Event>, c_int> {
        let mut others = Vec::new();
        let found = loop {
            match self.next(true) {
                Ok(ev) if want(&ev) => break Ok(ev),
                Ok(ev) => others.push(ev),
                Err(e) => break Err(e),
            }
        };
        if !others.is_empty() {
            let mut st = self.state();
            for ev in others.into_iter().rev() {
                st.queue.push_front(ev);
            }
            drop(st);
            let one: u64 = 1;
            // SAFETY: as in `push`.
            let _ =
                unsafe { libc::write(self.notify.as_raw_fd(), std::ptr::addr_of!(one).cast(), 8) };
        }
        found
    }

    /// Softwarp's event as the application's, or `None` for events rdma-core does not report
    /// on iWARP (TIMEWAIT_EXIT) or about ids already destroyed.
    fn translate(&self, ev: CmEvent) -> Option<Box<Event>> {
        let st = self.state();
        let id_of = |conn: &ConnId| st.conns.get(conn).copied().map(|p| p as *mut Id);
        match ev {
            CmEvent::ConnectRequest(req) => {
                let listener = st.listeners.get(&req.listener_id()).copied()? as *mut Id;
                drop(st);
                // SAFETY: listening ids are registered while alive (under the state lock).
                let child = unsafe { Id::child(listener, req) }?;
                Some(child)
            }
            CmEvent::Established { id, info } => {
                let p = id_of(&id)?;
                drop(st);
                // SAFETY: registered ids are alive.
                let idr = unsafe { &*p };
                idr.established(&info);
                let data = if idr.is_initiator() {
                    info.peer_private_data.as_slice()
                } else {
                    &[]
                };
                Some(
                    Event::new(p.cast(), RDMA_CM_EVENT_ESTABLISHED, 0)
                        .conn(data, info.ird, info.ord),
                )
            }
            CmEvent::Rejected { id, private_data } => {
                let p = id_of(&id)?;
                Some(
                    Event::new(p.cast(), RDMA_CM_EVENT_REJECTED, -libc::ECONNREFUSED).conn(
                        &private_data,
                        0,
                        0,
                    ),
                )
            }
            CmEvent::Unreachable { id, error } => {
                let p = id_of(&id)?;
                let e = errno::of(&error);
                drop(st);
                // SAFETY: registered ids are alive.
                if e == libc::ECONNREFUSED && unsafe { &*p }.retry_refused(id) {
                    return None;
                }
                // The kernel's iWARP CM reports a refused TCP connection as a reject.
                let ty = if e == libc::ECONNREFUSED {
                    RDMA_CM_EVENT_REJECTED
                } else {
                    RDMA_CM_EVENT_UNREACHABLE
                };
                Some(Event::new(p.cast(), ty, -e))
            }
            CmEvent::ConnectError { id, error } => {
                let p = id_of(&id)?;
                Some(Event::new(
                    p.cast(),
                    RDMA_CM_EVENT_CONNECT_ERROR,
                    -errno::of(&error),
                ))
            }
            CmEvent::Disconnected { id, .. } => {
                let p = id_of(&id)?;
                drop(st);
                // SAFETY: registered ids are alive.
                unsafe { &*p }.sync_qp_state();
                Some(Event::new(p.cast(), RDMA_CM_EVENT_DISCONNECTED, 0))
            }
            CmEvent::RequestError { peer, error, .. } => {
                tracing::debug!(target: "softwarp::verbs", %peer, %error, "connection refused before a request");
                None
            }
            _ => None,
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_create_event_channel() -> *mut rdma_event_channel {
    match EvChannel::create(false) {
        Ok(ch) => {
            let p = Box::into_raw(ch).cast::<rdma_event_channel>();
            CHANNELS.add(p);
            GONE_CHANNELS.forget(p);
            p
        }
        Err(e) => {
            errno::set(e);
            std::ptr::null_mut()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_destroy_event_channel(ch: *mut rdma_event_channel) {
    const CALL: &str = "rdma_destroy_event_channel";
    if !CHANNELS.remove(ch) {
        // Destroyed already, or never a channel: nothing to free (the call returns nothing).
        tracing::debug!(target: "softwarp::verbs", call = CALL, "not a live event channel");
        errno::set(libc::EINVAL);
        return;
    }
    GONE_CHANNELS.add(ch);
    // SAFETY: a live channel of `rdma_create_event_channel` (Box).
    let c = unsafe { &*ch.cast::<EvChannel>() };
    let free = {
        let mut st = c.state();
        st.given_up = true;
        st.ids == 0
    };
    if free {
        // SAFETY: as above; the application gives it up and no id is on it.
        drop(unsafe { Box::from_raw(ch.cast::<EvChannel>()) });
    } else {
        // rdma-core frees it under its ids; here the last id's destroy does.
        tracing::debug!(target: "softwarp::verbs", call = CALL, "ids still on the channel: freed with the last");
        errno::set(libc::EBUSY);
    }
}

/// How long `rdma_get_cm_event` holds a thread that calls it on a channel the application
/// destroyed before answering `EINVAL`.
pub const DESTROYED_CHANNEL_HOLD: std::time::Duration = std::time::Duration::from_secs(1);

/// Holds a thread that reads a channel the application destroyed for
/// [`DESTROYED_CHANNEL_HOLD`]. rdma-core programs read their channel in a thread of their own
/// while the main thread tears down and returns from `main` (Debian's rping: its `cm_thread`
/// acknowledges the DISCONNECTED event and calls `rdma_get_cm_event` again, the main thread
/// meanwhile destroys the id and the channel, and a failed call makes it `exit(-1)`). Over
/// rdma-core that thread is most often already blocked in `read()` on the channel's fd, which
/// closing it does not wake, and the process ends with `main`'s status. Held here, it stays
/// blocked long enough for that, and a program that reads its destroyed channel from its only
/// thread still gets its `EINVAL`, a second later.
fn hold_reader_of_destroyed_channel() {
    tracing::debug!(target: "softwarp::verbs", call = "rdma_get_cm_event", "the channel was destroyed: held, then EINVAL");
    std::thread::sleep(DESTROYED_CHANNEL_HOLD);
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_get_cm_event(
    ch: *mut rdma_event_channel,
    event: *mut *mut rdma_cm_event,
) -> c_int {
    if !CHANNELS.contains(ch) {
        if GONE_CHANNELS.contains(ch) {
            hold_reader_of_destroyed_channel();
        }
        return err(libc::EINVAL);
    }
    if event.is_null() {
        return err(libc::EINVAL);
    }
    // SAFETY: a live channel of `rdma_create_event_channel`.
    let c = unsafe { &*ch.cast::<EvChannel>() };
    match c.next(true) {
        Ok(ev) => {
            let p = Box::into_raw(ev).cast::<rdma_cm_event>();
            EVENTS.add(p);
            // SAFETY: `event` is writable.
            unsafe { *event = p };
            0
        }
        Err(e) => err(e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int {
    if !EVENTS.remove(event) {
        // Acknowledged already (or never an event).
        return err(libc::EINVAL);
    }
    // SAFETY: a live event of `rdma_get_cm_event` (Box); the application gives it up.
    drop(unsafe { Box::from_raw(event.cast::<Event>()) });
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_event_str(event: rdma_cm_event_type) -> *const c_char {
    const NAMES: [&CStr; 16] = [
        c"RDMA_CM_EVENT_ADDR_RESOLVED",
        c"RDMA_CM_EVENT_ADDR_ERROR",
        c"RDMA_CM_EVENT_ROUTE_RESOLVED",
        c"RDMA_CM_EVENT_ROUTE_ERROR",
        c"RDMA_CM_EVENT_CONNECT_REQUEST",
        c"RDMA_CM_EVENT_CONNECT_RESPONSE",
        c"RDMA_CM_EVENT_CONNECT_ERROR",
        c"RDMA_CM_EVENT_UNREACHABLE",
        c"RDMA_CM_EVENT_REJECTED",
        c"RDMA_CM_EVENT_ESTABLISHED",
        c"RDMA_CM_EVENT_DISCONNECTED",
        c"RDMA_CM_EVENT_DEVICE_REMOVAL",
        c"RDMA_CM_EVENT_MULTICAST_JOIN",
        c"RDMA_CM_EVENT_MULTICAST_ERROR",
        c"RDMA_CM_EVENT_ADDR_CHANGE",
        c"RDMA_CM_EVENT_TIMEWAIT_EXIT",
    ];
    NAMES
        .get(event as usize)
        .copied()
        .unwrap_or(c"UNKNOWN EVENT")
        .as_ptr()
}

/// Writes `addr` into a `sockaddr_storage`-sized union of `rdma_addr`.
///
/// # Safety
/// `dst` must be writable for `size_of::<sockaddr_storage>()` bytes.
pub unsafe fn write_addr(dst: *mut c_void, addr: std::net::SocketAddr) {
    let (st, _) = to_storage(addr);
    // SAFETY: the caller's storage is large enough.
    unsafe {
        std::ptr::copy_nonoverlapping(
            std::ptr::addr_of!(st).cast::<u8>(),
            dst.cast::<u8>(),
            std::mem::size_of::<libc::sockaddr_storage>(),
        )
    };
}
