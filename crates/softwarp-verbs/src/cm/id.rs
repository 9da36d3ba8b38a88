//! `struct rdma_cm_id` and the calls on it.
//!
//! Each call checks the id's state as rdma-core's kernel (`drivers/infiniband/core/cma.c`)
//! does and answers `EINVAL` where the kernel's state machine refuses it: `rdma_bind_addr`
//! only on a fresh id; `rdma_resolve_addr` on a fresh or bound id (again after ADDR_ERROR,
//! never once resolved); `rdma_resolve_route` once, after the address; `rdma_connect` once,
//! after the route (a refused, failed or established connection keeps the id in the
//! kernel's CONNECT state until it is destroyed: nothing but `rdma_disconnect`, which answers
//! 0, and `rdma_destroy_id` applies); `rdma_listen` on a bound id; `rdma_accept` and
//! `rdma_reject` on a connection request not yet answered. `rdma_disconnect` answers 0 on an
//! id that connected or tried to (any number of times), and on a connection request;
//! `EINVAL` on any other.

use softwarp::sync::lock;
use std::cell::UnsafeCell;
use std::ffi::{c_int, c_void};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, TryLockError};
use std::time::Duration;

use softwarp_ras::tracker::{
    DescribeResource, ResourceDetails, ResourceHandle, ResourceKind, Tracker,
};

use softwarp::cm::PortReservation;
use softwarp::{
    CmEventChannel, CmId, CmListener, ConnId, ConnectOptions, ConnectRequest, ConnectionInfo,
    ListenOptions, Role,
};

use crate::cm::channel::{write_addr, EvChannel, Event};
use crate::cm::live::{CHANNELS, EVENTS, IDS};
use crate::cm::{cm_context, err, from_sockaddr, source_for};
use crate::errno;
use crate::ffi::*;
use crate::verbs::cq::{
    swv_ibv_create_comp_channel, swv_ibv_create_cq, swv_ibv_destroy_comp_channel,
    swv_ibv_destroy_cq,
};
use crate::verbs::qp::{
    create_qp_ex, swv_ibv_create_srq, swv_ibv_destroy_qp, swv_ibv_destroy_srq, Qp,
};

/// The most RDMA Reads a QP of this library has outstanding either way (its IRD and ORD);
/// larger `responder_resources`/`initiator_depth` are lowered to it, as providers do with
/// values above their limits.
const QP_RD_ATOMIC: usize = 16;

/// `struct rdma_cm_id` followed by the id's Softwarp state.
#[repr(C)]
pub struct Id {
    /// The application's `struct rdma_cm_id` (`UnsafeCell<T>` has `T`'s layout, so it is
    /// still the first member). The application reads it at any time and sets some fields
    /// (`context`); this library writes others from its calls (`pd`, `qp`, the CQs, `event`,
    /// the addresses) while holding `&Id`. Without the cell that `&Id` promised the optimizer
    /// those bytes never change, and it dropped such stores: release builds left
    /// `id->send_cq` NULL after `rdma_create_ep`, and Debian's `rdma_client` crashed. Read
    /// with [`Id::get`], written through [`Id::ptr`].
    c: UnsafeCell<rdma_cm_id>,
    st: Arc<Shared>,
    /// Its entry in `softwarp resources` (kind `cm_id`, tracker `rdma_cm`).
    _ras: ResourceHandle,
    /// Synchronous mode (created without a channel, or a request of a synchronous
    /// listener): each call waits for its event, on a private channel of its own (or its
    /// listener's), which the last of its ids frees. `rdma_migrate_id` changes it.
    sync: AtomicBool,
}

/// An id's state, shared with its resource tracker entry (which describes it on demand).
struct Shared(Mutex<IdState>);

// SAFETY: the tracker's thread calls `describe`, which reads the id's state under its lock.
// The only members that are not `Send` are the C pointers of `ep_qp_attr`, which this
// library copies into the attributes of the QPs `rdma_get_request` makes (on the
// application's thread) and never dereferences through the state.
unsafe impl Send for Shared {}
// SAFETY: as above; every access goes through the mutex.
unsafe impl Sync for Shared {}

#[derive(Default)]
struct IdState {
    bound: Option<SocketAddr>,
    dst: Option<SocketAddr>,
    listener: Option<CmListener>,
    request: Option<ConnectRequest>,
    conn: Option<CmId>,
    initiator: bool,
    /// A connection request's id (the kernel's passive side: it never binds, resolves,
    /// listens or connects).
    passive: bool,
    /// The port `rdma_bind_addr` took (chosen then for port 0), listened on by
    /// `rdma_listen`.
    reserved: Option<PortReservation>,
    /// `RDMA_OPTION_ID_AFONLY`: an IPv6 bind takes the port for IPv6 only (`Some(true)`) or
    /// for IPv4 too (`Some(false)`); unset, the host's default.
    afonly: Option<bool>,
    /// The id holds the device (bound, resolved, or a connection request), and with it a
    /// count on the device's PD, `id->pd` since then (rdma-core's `ucma_get_device`).
    holds_device: bool,
    /// CQs `rdma_create_qp` made because the application passed none.
    own_cqs: bool,
    /// QP attributes and PD kept by `rdma_create_ep` for the ids `rdma_get_request`
    /// returns.
    ep_qp_attr: Option<ibv_qp_init_attr>,
    ep_pd: usize,
    /// What `rdma_connect` asked for, and the tries left when the TCP connection is refused
    /// (`SOFTWARP_CONNECT_RETRIES`).
    connect_opts: Option<ConnectOptions>,
    retries_left: u32,
    /// `rdma_resolve_route` succeeded.
    route_resolved: bool,
    /// The number of the QP made on the id (`rdma_create_qp`, `rdma_create_ep`).
    qpn: Option<u32>,
    /// The Softwarp channel whose thread drives the id's listener or connection (the
    /// channel it listened or connected on, its listener's for a request): kept while the
    /// id lives, since `rdma_migrate_id` may leave it with no C channel of its own.
    origin: Option<Arc<CmEventChannel>>,
}

/// The tracker of this library's connection manager ids, named `rdma_cm` (rdma-core's ids
/// belong to no device until they are bound or resolved).
fn id_tracker() -> &'static Tracker {
    static T: OnceLock<Tracker> = OnceLock::new();
    T.get_or_init(|| Tracker::new("rdma_cm"))
}

impl DescribeResource for Shared {
    /// The id's state in rdma-core's terms, its addresses and QP. An id whose lock a call
    /// holds (a synchronous call waiting for its event) is described as busy rather than
    /// waited for.
    fn describe(&self) -> ResourceDetails {
        let st = match self.0.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => {
                return ResourceDetails {
                    state: Some("BUSY".into()),
                    ..ResourceDetails::default()
                }
            }
        };
        let conn = st.conn.as_ref().map(|c| (c.state(), c.connection()));
        let state = if st.listener.is_some() {
            "LISTEN"
        } else if let Some((s, _)) = &conn {
            match s {
                softwarp::CmState::Connecting => "CONNECTING",
                softwarp::CmState::Established => "CONNECTED",
                softwarp::CmState::Disconnecting => "DISCONNECTING",
                softwarp::CmState::Disconnected | softwarp::CmState::Closed => "DISCONNECTED",
                softwarp::CmState::Failed => "FAILED",
            }
        } else if st.request.is_some() {
            "CONNECT_REQUEST"
        } else if st.route_resolved {
            "ROUTE_RESOLVED"
        } else if st.dst.is_some() {
            "ADDR_RESOLVED"
        } else if st.bound.is_some() {
            "BOUND"
        } else {
            "IDLE"
        };
        let info = conn.and_then(|(_, i)| i);
        let mut attrs = std::collections::BTreeMap::new();
        if let Some(q) = st.qpn {
            attrs.insert("qp".to_string(), q.to_string());
        }
        if st.initiator {
            attrs.insert("role".to_string(), "active".to_string());
        }
        ResourceDetails {
            state: Some(state.into()),
            local_addr: info
                .as_ref()
                .map(|i| i.local_addr)
                .or(st.listener.as_ref().map(CmListener::local_addr))
                .or(st.bound),
            peer_addr: info.as_ref().map(|i| i.peer_addr).or(st.dst),
            attrs,
            ..ResourceDetails::default()
        }
    }
}

impl IdState {
    /// The kernel's IDLE or ADDR_BOUND: nothing resolved, listened, requested or connected.
    fn unresolved(&self) -> bool {
        self.dst.is_none() && self.listener.is_none() && self.conn.is_none() && !self.passive
    }
}

impl Id {
    /// A new id, registered with the `rdma_cm` tracker (`#[track_caller]`: the C caller
    /// recorded by the creating call's trampoline, if any, else this library's line).
    #[track_caller]
    fn boxed(c: rdma_cm_id, st: IdState, sync: bool) -> Box<Id> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let shared = Arc::new(Shared(Mutex::new(st)));
        let ras = id_tracker().register(
            ResourceKind::CmId,
            NEXT.fetch_add(1, Ordering::Relaxed),
            std::mem::size_of::<Id>() as u64,
        );
        let describer: Arc<dyn DescribeResource> = shared.clone();
        ras.set_describer(Arc::downgrade(&describer));
        Box::new(Id {
            c: UnsafeCell::new(c),
            st: shared,
            _ras: ras,
            sync: AtomicBool::new(sync),
        })
    }

    /// Hands a new id out: it is counted on its channel, and its address becomes live
    /// (calls may name it).
    fn publish(id: Box<Id>) -> *mut Id {
        let ch = id.get(|c| c.channel);
        // SAFETY: an id's channel is live (checked by `rdma_create_id`, or a listener's).
        if let Some(c) = unsafe { ch.cast::<EvChannel>().as_ref() } {
            c.attach();
        }
        let p = Box::into_raw(id);
        IDS.add(p);
        p
    }

    fn state(&self) -> MutexGuard<'_, IdState> {
        lock(&self.st.0)
    }

    /// The id `id` names, or `None` when it is not a live id (destroyed, NULL, or never
    /// one: see `cm::live`).
    ///
    /// # Safety
    /// No other thread may be destroying `id` meanwhile (as with rdma-core).
    pub unsafe fn from_c<'a>(id: *mut rdma_cm_id) -> Option<&'a Id> {
        if !IDS.contains(id) {
            return None;
        }
        // SAFETY: a live id: `c` is the first member of the `repr(C)` `Id`.
        unsafe { id.cast::<Id>().as_ref() }
    }

    fn channel(&self) -> &EvChannel {
        // SAFETY: an id's channel lives while the id is on it (it counts its ids, and its
        // last id frees it when given up).
        unsafe { &*self.get(|c| c.channel).cast::<EvChannel>() }
    }

    /// The application's `struct rdma_cm_id *`: the address of the C struct, for writing
    /// its fields (the library's calls do, as rdma-core's do) and handing it out.
    fn ptr(&self) -> *mut rdma_cm_id {
        self.c.get()
    }

    /// A value read out of the C struct by `f` (a field, copied).
    pub(crate) fn get<T>(&self, f: impl FnOnce(&rdma_cm_id) -> T) -> T {
        // SAFETY: the id is live (`&self`); the reference lasts for `f` only, which copies a
        // field out, and no store to the struct happens during it: this library writes the
        // struct from its own calls, not from `f`, and the application writes its fields
        // (`context`) only between calls, as rdma-core's API has it.
        f(unsafe { &*self.c.get() })
    }

    fn is_sync(&self) -> bool {
        self.sync.load(Ordering::Acquire)
    }

    pub fn is_initiator(&self) -> bool {
        self.state().initiator
    }

    fn set_src(&self, addr: SocketAddr) {
        // SAFETY: the id's C struct (a place expression: no reference is made).
        let p = unsafe { std::ptr::addr_of_mut!((*self.ptr()).route.addr.__bindgen_anon_1) };
        // SAFETY: the union is sockaddr_storage-sized; the application reads it only
        // between calls (as with rdma-core, which writes it from its calls too).
        unsafe { write_addr(p.cast(), addr) };
    }

    fn set_dst(&self, addr: SocketAddr) {
        // SAFETY: as above.
        let p = unsafe { std::ptr::addr_of_mut!((*self.ptr()).route.addr.__bindgen_anon_2) };
        // SAFETY: as `set_src`.
        unsafe { write_addr(p.cast(), addr) };
    }

    /// The id has its device (bound, resolved, requested): `verbs`, `port_num` and `pd`, as
    /// rdma-core sets them then (`ucma_get_device`; uDAPL queries the port `port_num` names
    /// right after its bind). `pd` is the device's PD, shared by every id that holds the
    /// device ([`crate::cm::device_pd`]); the first call takes the id's count on it.
    fn set_verbs(&self, ctx: *mut ibv_context) -> Result<(), c_int> {
        {
            let mut st = self.state();
            if !st.holds_device {
                let pd = crate::cm::device_pd()?;
                st.holds_device = true;
                // SAFETY: the id's C struct (a place expression), written as rdma-core does.
                unsafe { std::ptr::addr_of_mut!((*self.ptr()).pd).write(pd) };
            }
        }
        // SAFETY: as in `set_src`.
        let (p, port) = unsafe {
            (
                std::ptr::addr_of_mut!((*self.ptr()).verbs),
                std::ptr::addr_of_mut!((*self.ptr()).port_num),
            )
        };
        // SAFETY: the application's view of `verbs` and `port_num`, written as rdma-core
        // does.
        unsafe {
            p.write(ctx);
            port.write(1);
        }
        Ok(())
    }

    fn qp(&self) -> Option<&Qp> {
        // SAFETY: `c.qp` is NULL or the QP `rdma_create_qp` made (or the application put).
        unsafe { Qp::from_ibv(self.get(|c| c.qp)) }
    }

    /// The connection is up: addresses as negotiated, the QP's state field updated.
    pub fn established(&self, info: &ConnectionInfo) {
        self.set_src(info.local_addr);
        self.set_dst(info.peer_addr);
        self.sync_qp_state();
    }

    pub fn sync_qp_state(&self) {
        if let Some(q) = self.qp() {
            q.sync_state();
        }
    }

    /// A new id for a connection request at `listener`, and its CONNECT_REQUEST event.
    ///
    /// # Safety
    /// `listener` must be a live listening id.
    pub unsafe fn child(listener: *mut Id, req: ConnectRequest) -> Option<Box<Event>> {
        // SAFETY: the caller's listening id.
        let l = unsafe { &*listener };
        let verbs = cm_context().ok()?;
        // SAFETY: plain C data; all-zero is valid.
        let mut c: rdma_cm_id = unsafe { std::mem::zeroed() };
        c.verbs = verbs;
        (c.channel, c.context, c.ps, c.qp_type) =
            l.get(|lc| (lc.channel, lc.context, lc.ps, lc.qp_type));
        c.port_num = 1;
        let (private, peer) = (req.private_data().to_vec(), req.peer_ird_ord());
        let conn = req.conn_id();
        let (local, remote) = (req.local_addr(), req.peer_addr());
        let (ep_qp_attr, ep_pd, origin) = {
            let st = l.state();
            (st.ep_qp_attr, st.ep_pd, st.origin.clone())
        };
        let id = Id::boxed(
            c,
            IdState {
                bound: Some(local),
                dst: Some(remote),
                request: Some(req),
                passive: true,
                ep_qp_attr,
                ep_pd,
                origin,
                ..IdState::default()
            },
            l.is_sync(),
        );
        id.set_src(local);
        id.set_dst(remote);
        // A request's id has the listener's device and its PD (rdma-core queries it).
        id.set_verbs(verbs).ok()?;
        let p = Id::publish(id);
        l.channel().state().conns.insert(conn, p as usize);
        // The peer's (IRD, ORD): what it may read from us is our responder resources.
        let (rr, depth) = peer.map_or((QP_RD_ATOMIC, QP_RD_ATOMIC), |(ird, ord)| {
            (usize::from(ord), usize::from(ird))
        });
        let mut ev =
            Event::new(p.cast(), RDMA_CM_EVENT_CONNECT_REQUEST, 0).conn(&private, rr, depth);
        ev.c.listen_id = listener.cast();
        Some(ev)
    }

    /// `rdma_connect` was refused at the TCP level (`conn`: nothing listened at the address):
    /// when tries are left (`SOFTWARP_CONNECT_RETRIES`), waits `SOFTWARP_CONNECT_RETRY_MS`
    /// and connects again with the same QP (Idle again after the failed attempt) and
    /// settings. True when a new attempt is under way: the refusal is not reported.
    ///
    /// perftest's client connects its data QP as soon as the server's message arrives, and
    /// perftest's server over Linux siw listens for it only a moment later; perftest's own
    /// retry of a refused connect then reuses the ids it has just destroyed.
    pub fn retry_refused(&self, conn: ConnId) -> bool {
        let (pause, dst, opts) = {
            let mut st = self.state();
            if st.retries_left == 0 || st.conn.as_ref().map(CmId::conn_id) != Some(conn) {
                return false;
            }
            let (Some(dst), Some(opts)) = (st.dst, st.connect_opts.clone()) else {
                return false;
            };
            st.retries_left -= 1;
            (crate::env::connect_retry().1, dst, opts)
        };
        let Some(q) = self.qp() else {
            return false;
        };
        tracing::debug!(target: "softwarp::verbs", %dst, ?pause, "rdma_connect: refused, trying again");
        std::thread::sleep(pause);
        let mut st = self.state();
        if st.conn.as_ref().map(CmId::conn_id) != Some(conn) {
            // The application disconnected or connected again meanwhile.
            return false;
        }
        let ch = self.channel();
        let mut chs = ch.state();
        match ch.inner.connect(&q.qp, dst, &opts) {
            Ok(cm) => {
                chs.conns.remove(&conn);
                chs.conns.insert(cm.conn_id(), self.ptr() as usize);
                st.conn = Some(cm);
                st.origin = Some(Arc::clone(&ch.inner));
                true
            }
            Err(e) => {
                tracing::debug!(target: "softwarp::verbs", %dst, error = %e, "rdma_connect: no new try");
                false
            }
        }
    }

    /// In synchronous mode, waits for the event the last call started and returns its
    /// status as the call's result (rdma-core's `ucma_complete`): the event is kept in
    /// `id->event` until the next one.
    fn complete(&self) -> c_int {
        if !self.is_sync() {
            return 0;
        }
        let me = self.ptr();
        let ev = match self.channel().next_matching(|ev| ev.c.id == me) {
            Ok(ev) => ev,
            Err(e) => return err(e),
        };
        let status = ev.c.status;
        let ty = ev.c.event;
        self.keep_event(ev);
        if status != 0 {
            return err(-status);
        }
        match ty {
            RDMA_CM_EVENT_ADDR_RESOLVED
            | RDMA_CM_EVENT_ROUTE_RESOLVED
            | RDMA_CM_EVENT_ESTABLISHED
            | RDMA_CM_EVENT_DISCONNECTED => 0,
            RDMA_CM_EVENT_UNREACHABLE => err(libc::EHOSTUNREACH),
            _ => err(libc::ECONNREFUSED),
        }
    }

    /// Keeps `ev` as the synchronous id's `id->event` (rdma-core's convention), releasing
    /// the previous one.
    fn keep_event(&self, ev: Box<Event>) {
        let old = self.get(|c| c.event);
        // SAFETY: as in `set_src`.
        let p = unsafe { std::ptr::addr_of_mut!((*self.ptr()).event) };
        let new = Box::into_raw(ev).cast::<rdma_cm_event>();
        EVENTS.add(new);
        // SAFETY: `id->event` is the library's to set in synchronous mode.
        unsafe { p.write(new) };
        // The previous event (ours, boxed) is released, unless the application acknowledged
        // it already.
        if EVENTS.remove(old) {
            // SAFETY: a live event of this library (Box), no longer named anywhere.
            drop(unsafe { Box::from_raw(old.cast::<Event>()) });
        }
    }
}

fn ids_options(param: *const rdma_conn_param, call: &'static str) -> Result<ConnectOptions, c_int> {
    let mut o = crate::env::options();
    // SAFETY: NULL or the application's parameters.
    if let Some(p) = unsafe { param.as_ref() } {
        if p.private_data_len > 0 {
            if p.private_data.is_null() {
                return Err(errno::invalid(
                    call,
                    "private_data_len without private_data",
                ));
            }
            // SAFETY: the application's private data of `private_data_len` bytes.
            let d = unsafe {
                std::slice::from_raw_parts(
                    p.private_data.cast::<u8>(),
                    usize::from(p.private_data_len),
                )
            };
            o.private_data = d.to_vec();
        }
        o.ird = Some(usize::from(p.responder_resources).min(QP_RD_ATOMIC));
        o.ord = Some(usize::from(p.initiator_depth).min(QP_RD_ATOMIC));
    }
    Ok(o)
}

/// `rdma_connect`'s or `rdma_accept`'s `rnr_retry_count` set on the id's QP as
/// `ibv_modify_qp`'s `rnr_retry` would be (with the `min_rnr_timer` the QP has): its RNR
/// wait. On InfiniBand each end's count goes to the peer, which retries its Sends to this
/// end that often; here the end that receives holds a Send that finds no receive, so each
/// end's count is its own wait, the same exchange seen from the receiver. 0 leaves the QP
/// as it is: a zeroed `rdma_conn_param` (fio's, ucmatose's) asks for nothing, and the
/// kernel's iWARP connection manager ignores the field (`ibv_modify_qp` or
/// `SOFTWARP_RNR_WAIT_MS=0` turn the wait off).
fn conn_rnr_retry(q: &Qp, param: *const rdma_conn_param, call: &'static str) -> Result<(), c_int> {
    // SAFETY: NULL or the application's parameters.
    let count = unsafe { param.as_ref() }.map_or(0, |p| p.rnr_retry_count);
    if count == 0 {
        return Ok(());
    }
    q.set_rnr(None, Some(count))
        .map_err(|e| errno::fail(call, &e))
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_create_id(
    channel: *mut rdma_event_channel,
    out: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: rdma_port_space,
) -> c_int {
    if out.is_null() {
        return err(libc::EINVAL);
    }
    // SAFETY: the caller's pointer.
    unsafe { create_id(channel, out, context, ps, IBV_QPT_RC) }
}

unsafe fn create_id(
    channel: *mut rdma_event_channel,
    out: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: rdma_port_space,
    qp_type: ibv_qp_type,
) -> c_int {
    if ps != RDMA_PS_TCP && ps != RDMA_PS_IB {
        return err(errno::unsupported(
            "rdma_create_id",
            "port spaces other than TCP (iWARP is connected only)",
        ));
    }
    let sync = channel.is_null();
    let ch = if sync {
        // A private channel, freed by its last id (this one, or its requests when it listens).
        match EvChannel::create(true) {
            Ok(c) => Box::into_raw(c).cast::<rdma_event_channel>(),
            Err(e) => return err(e),
        }
    } else if CHANNELS.contains(channel) {
        channel
    } else {
        return err(libc::EINVAL);
    };
    // SAFETY: plain C data; all-zero is valid.
    let mut c: rdma_cm_id = unsafe { std::mem::zeroed() };
    c.channel = ch;
    c.context = context;
    c.ps = ps;
    c.qp_type = qp_type;
    let id = Id::publish(Id::boxed(c, IdState::default(), sync));
    // SAFETY: `out` is writable.
    unsafe { *out = id.cast() };
    0
}

/// Longest `rdma_destroy_id` waits for the application to acknowledge the id's events.
const ACK_WAIT: Duration = Duration::from_secs(2);

/// rdma-core's `rdma_destroy_id` returns once every event it reported about the id was
/// acknowledged. Programs count on that order: rping's main thread destroys its id and then
/// its channel when its CM thread has handled DISCONNECTED, and that thread acknowledges
/// the event and waits in `rdma_get_cm_event` again before the channel goes; destroyed
/// first, the channel answered `EINVAL` and rping exited with an error. Connection requests
/// are not waited for (rdma-core counts them on the listener, and programs reject and
/// destroy a request's id in the handler). Bounded, where rdma-core waits for ever: a
/// program that destroys an id on the thread holding its event goes on after `ACK_WAIT`.
///
/// `requests`: the connection requests of a listening id count too (`rdma_migrate_id`, as
/// rdma-core counts them on the listener).
fn wait_for_acks(i: &Id, id: *mut rdma_cm_id, requests: bool) {
    let kept = i.get(|c| c.event) as usize;
    let deadline = softwarp_ras::deadline::Deadline::after(ACK_WAIT);
    let unacked = || {
        EVENTS.any(|p: *const rdma_cm_event| {
            // SAFETY: a live event (the set's lock keeps it so): a boxed `Event`, whose C
            // struct comes first.
            let c = unsafe { &(*p.cast::<Event>()).c };
            let request = c.event == RDMA_CM_EVENT_CONNECT_REQUEST;
            p as usize != kept
                && ((c.id == id && !request) || (requests && request && c.listen_id == id))
        })
    };
    while unacked() && !deadline.expired() {
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_destroy_id(id: *mut rdma_cm_id) -> c_int {
    if !IDS.remove(id) {
        // Destroyed already, or never an id: nothing is read or freed.
        return err(libc::EINVAL);
    }
    // SAFETY: a live id until the line above, which took it from the application: ours to
    // free.
    let i = unsafe { &*id.cast::<Id>() };
    wait_for_acks(i, id, false);
    let channel = i.get(|c| c.channel);
    // Its count on the device's PD (`ucma_put_device`): the last id's destroy deallocates
    // it, unless something still uses it.
    if std::mem::take(&mut i.state().holds_device) {
        crate::cm::put_device_pd();
    }
    {
        let mut st = i.state();
        let mut ch = i.channel().state();
        ch.conns.retain(|_, p| *p != id as usize);
        ch.listeners.retain(|_, p| *p != id as usize);
        drop(ch);
        st.listener = None;
        st.request = None;
        st.conn = None;
    }
    let last = i.get(|c| c.event);
    if EVENTS.remove(last) {
        // SAFETY: a synchronous id's last event is ours (boxed), not acknowledged.
        drop(unsafe { Box::from_raw(last.cast::<Event>()) });
    }
    // SAFETY: ids are allocated with Box; the application gives it up.
    drop(unsafe { Box::from_raw(id.cast::<Id>()) });
    // Its queued events go, and its channel when it was the last id of a channel given up.
    // SAFETY: the id's channel, on which it was counted; the id is gone.
    unsafe { EvChannel::detach(channel, id) };
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut sockaddr) -> c_int {
    // SAFETY: the caller's id and address.
    let (Some(i), Some(a)) = (unsafe { Id::from_c(id) }, unsafe {
        from_sockaddr(addr.cast())
    }) else {
        return err(libc::EINVAL);
    };
    let mut st = i.state();
    if st.bound.is_some() || !st.unresolved() {
        return err(libc::EINVAL);
    }
    let ctx = match cm_context() {
        Ok(c) => c,
        Err(e) => return err(e),
    };
    // The port is taken now, as the kernel's rdma_cm takes it: port 0 picks one, which
    // `rdma_get_src_port` reports before `rdma_listen` (qperf sends it to its peer then). An
    // address this host does not have fails here (EADDRNOTAVAIL), a port in use at listen.
    let res = match PortReservation::bind(a, st.afonly) {
        Ok(r) => r,
        Err(e) => return err(errno::fail("rdma_bind_addr", &e)),
    };
    let local = res.local_addr();
    st.bound = Some(local);
    st.reserved = Some(res);
    drop(st);
    i.set_src(local);
    // The kernel's rdma_cm gives a bound id its device only for an address of an interface:
    // a wildcard or loopback bind (`cma_any_addr`) leaves `verbs` NULL, and so does
    // `rdma_listen` on it; `rdma_resolve_addr` (127.0.0.1 included) and a connection
    // request attach the device. libfabric's verbs provider counts on it: it binds
    // `localhost` to find the address an RDM endpoint listens on and takes the interface
    // addresses of the device when `verbs` stays NULL (with a device there, every rank
    // listened on 127.0.0.1, out of reach of another host or network namespace).
    if !(local.ip().is_loopback() || local.ip().is_unspecified()) {
        if let Err(e) = i.set_verbs(ctx) {
            return err(e);
        }
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_resolve_addr(
    id: *mut rdma_cm_id,
    src: *mut sockaddr,
    dst: *mut sockaddr,
    _timeout_ms: c_int,
) -> c_int {
    // SAFETY: the caller's id and addresses.
    let (Some(i), Some(d)) = (unsafe { Id::from_c(id) }, unsafe {
        from_sockaddr(dst.cast())
    }) else {
        return err(libc::EINVAL);
    };
    if !i.state().unresolved() {
        // Resolved, listening, requested or connected: the kernel's id is past ADDR_BOUND.
        return err(libc::EINVAL);
    }
    // SAFETY: as above.
    let s = unsafe { from_sockaddr(src.cast()) };
    if s.is_some() && i.state().bound.is_none() {
        // SAFETY: forwarded.
        if unsafe { swv_rdma_bind_addr(id, src) } != 0 {
            return -1;
        }
    }
    let ctx = match cm_context() {
        Ok(c) => c,
        Err(e) => return err(e),
    };
    let bound = i.state().bound;
    let ev = match bound.map(|b| Ok(b.ip())).unwrap_or_else(|| source_for(d)) {
        Ok(ip) if !ip.is_unspecified() => {
            i.state().dst = Some(d);
            i.set_dst(d);
            i.set_src(SocketAddr::new(ip, bound.map_or(0, |b| b.port())));
            resolved(i, id, ctx)
        }
        Ok(_) => {
            i.state().dst = Some(d);
            i.set_dst(d);
            resolved(i, id, ctx)
        }
        Err(e) => Event::new(
            id,
            RDMA_CM_EVENT_ADDR_ERROR,
            -e.raw_os_error().unwrap_or(libc::EHOSTUNREACH),
        ),
    };
    i.channel().push(ev);
    i.complete()
}

/// ADDR_RESOLVED for `id`, which now has its device; ADDR_ERROR when the device's PD cannot
/// be had (rdma-core's query fails then).
fn resolved(i: &Id, id: *mut rdma_cm_id, ctx: *mut ibv_context) -> Box<Event> {
    match i.set_verbs(ctx) {
        Ok(()) => Event::new(id, RDMA_CM_EVENT_ADDR_RESOLVED, 0),
        Err(e) => Event::new(id, RDMA_CM_EVENT_ADDR_ERROR, -e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_resolve_route(id: *mut rdma_cm_id, _timeout_ms: c_int) -> c_int {
    // SAFETY: the caller's id.
    let Some(i) = (unsafe { Id::from_c(id) }) else {
        return err(libc::EINVAL);
    };
    {
        let mut st = i.state();
        // The kernel's ADDR_RESOLVED only.
        if st.dst.is_none()
            || st.route_resolved
            || st.conn.is_some()
            || st.passive
            || st.listener.is_some()
        {
            return err(libc::EINVAL);
        }
        st.route_resolved = true;
    }
    i.channel()
        .push(Event::new(id, RDMA_CM_EVENT_ROUTE_RESOLVED, 0));
    i.complete()
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_listen(id: *mut rdma_cm_id, backlog: c_int) -> c_int {
    // SAFETY: the caller's id.
    let Some(i) = (unsafe { Id::from_c(id) }) else {
        return err(libc::EINVAL);
    };
    let mut st = i.state();
    let Some(addr) = st.bound else {
        return err(libc::EINVAL);
    };
    if !st.unresolved() {
        return err(libc::EINVAL);
    }
    let backlog = u32::try_from(backlog)
        .ok()
        .filter(|&b| b > 0)
        .unwrap_or(1024);
    let opts = ListenOptions::default()
        .backlog(backlog)
        .options(crate::env::options());
    let ch = i.channel();
    let listened = match st.reserved.take() {
        Some(port) => ch.inner.listen_reserved(port, &opts),
        None => ch.inner.listen(addr, &opts),
    };
    let l = match listened {
        Ok(l) => l,
        Err(e) => return err(errno::fail("rdma_listen", &e)),
    };
    ch.state().listeners.insert(l.id(), id as usize);
    let local = l.local_addr();
    st.listener = Some(l);
    st.origin = Some(Arc::clone(&ch.inner));
    drop(st);
    i.set_src(local);
    0
}

/// The PD and CQs an id's QP gets when the application passes none: `id->pd`, the device's
/// PD (rdma-core's `rdma_create_qp_ex`; an id that has no device yet takes it now, where
/// rdma-core would pass a NULL PD and fail), and CQs made for it.
unsafe fn default_objects(i: &Id, attr: &mut ibv_qp_init_attr_ex) -> Result<(), c_int> {
    let verbs = i.get(|c| c.verbs);
    let ctx = if verbs.is_null() {
        cm_context()?
    } else {
        verbs
    };
    let idp = i.ptr();
    if attr.pd.is_null() {
        if i.get(|c| c.pd).is_null() {
            i.set_verbs(ctx)?;
        }
        attr.pd = i.get(|c| c.pd);
    }
    if attr.send_cq.is_null() || attr.recv_cq.is_null() {
        // SAFETY: as above: rdma-core's ucma_create_cqs fills these fields.
        unsafe {
            let rch = swv_ibv_create_comp_channel(ctx);
            let sch = swv_ibv_create_comp_channel(ctx);
            if rch.is_null() || sch.is_null() {
                return Err(libc::ENOMEM);
            }
            let rcq = swv_ibv_create_cq(
                ctx,
                attr.cap.max_recv_wr.max(1) as c_int,
                idp.cast(),
                rch,
                0,
            );
            let scq = swv_ibv_create_cq(
                ctx,
                attr.cap.max_send_wr.max(1) as c_int,
                idp.cast(),
                sch,
                0,
            );
            if rcq.is_null() || scq.is_null() {
                return Err(libc::ENOMEM);
            }
            (*idp).recv_cq_channel = rch;
            (*idp).send_cq_channel = sch;
            (*idp).recv_cq = rcq;
            (*idp).send_cq = scq;
            attr.recv_cq = rcq;
            attr.send_cq = scq;
        }
        i.state().own_cqs = true;
    }
    Ok(())
}

unsafe fn create_qp_on(id: *mut rdma_cm_id, attr: &mut ibv_qp_init_attr_ex) -> c_int {
    // SAFETY: the caller's id.
    let Some(i) = (unsafe { Id::from_c(id) }) else {
        return err(libc::EINVAL);
    };
    if !i.get(|c| c.qp).is_null() {
        return err(libc::EINVAL);
    }
    // SAFETY: the id is live.
    if let Err(e) = unsafe { default_objects(i, attr) } {
        return err(e);
    }
    attr.comp_mask |= IBV_QP_INIT_ATTR_PD;
    // An SRQ made with `rdma_create_srq` serves the QP unless the attributes name one.
    if attr.srq.is_null() {
        attr.srq = i.get(|c| c.srq);
    }
    // SAFETY: the PD is the application's or ours.
    let ctx = unsafe { (*attr.pd).context };
    let verbs = i.get(|c| c.verbs);
    if !verbs.is_null() && ctx != verbs {
        return err(errno::invalid(
            "rdma_create_qp",
            "the PD belongs to another device context than the id",
        ));
    }
    // SAFETY: our context and the attributes.
    let qp = unsafe { create_qp_ex(ctx, attr) };
    if qp.is_null() {
        return -1;
    }
    // SAFETY: the id's QP and PD fields, as rdma-core sets them.
    unsafe {
        (*id).qp = qp;
        (*id).pd = attr.pd;
        i.state().qpn = Some((*qp).qp_num);
    }
    // SAFETY: the QP just made.
    if let Some(q) = unsafe { Qp::from_ibv(qp) } {
        q.cm_id.store(id as usize, Ordering::Release);
    }
    0
}

/// `ibv_destroy_qp` of `qp`, the QP of `id` (`rdma_create_qp`): the id no longer names it
/// (`id->qp` NULL), when the id is still live and still names it. rdma-core leaves `id->qp`
/// pointing to the freed QP, which its later `rdma_connect` or `rdma_destroy_qp` use.
///
/// # Safety
/// `id` is NULL or the address an id had when it made `qp`.
pub unsafe fn forget_qp(id: *mut rdma_cm_id, qp: *mut ibv_qp) {
    // SAFETY: looked up first: a live id (`Id::from_c`), whose fields this library writes.
    let Some(i) = (unsafe { Id::from_c(id) }) else {
        return;
    };
    if i.get(|c| c.qp) == qp {
        // SAFETY: the id's C field, as `rdma_destroy_qp` clears it.
        unsafe { (*id).qp = std::ptr::null_mut() };
        i.state().qpn = None;
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_create_qp(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> c_int {
    // SAFETY: the caller's attributes.
    let Some(a) = (unsafe { attr.as_mut() }) else {
        return err(libc::EINVAL);
    };
    // SAFETY: plain C data; all-zero is valid.
    let mut ex: ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
    ex.qp_context = a.qp_context;
    ex.send_cq = a.send_cq;
    ex.recv_cq = a.recv_cq;
    ex.srq = a.srq;
    ex.cap = a.cap;
    ex.qp_type = a.qp_type;
    ex.sq_sig_all = a.sq_sig_all;
    ex.pd = pd;
    // SAFETY: forwarded.
    let rc = unsafe { create_qp_on(id, &mut ex) };
    if rc == 0 {
        a.cap = ex.cap;
        a.send_cq = ex.send_cq;
        a.recv_cq = ex.recv_cq;
    }
    rc
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_create_qp_ex(
    id: *mut rdma_cm_id,
    attr: *mut ibv_qp_init_attr_ex,
) -> c_int {
    // SAFETY: the caller's attributes.
    let Some(a) = (unsafe { attr.as_mut() }) else {
        return err(libc::EINVAL);
    };
    // SAFETY: forwarded.
    unsafe { create_qp_on(id, a) }
}

/// `rdma_create_srq_ex`: an SRQ on the id's device, in `attr.pd` (else the id's PD), kept in
/// `id->srq` for the QP `rdma_create_qp` makes next. Basic SRQs only (XRC is InfiniBand's).
#[no_mangle]
pub unsafe extern "C" fn swv_rdma_create_srq_ex(
    id: *mut rdma_cm_id,
    attr: *mut ibv_srq_init_attr_ex,
) -> c_int {
    const CALL: &str = "rdma_create_srq_ex";
    // SAFETY: the caller's id and attributes.
    let (Some(i), Some(a)) = (unsafe { Id::from_c(id) }, unsafe { attr.as_mut() }) else {
        return err(libc::EINVAL);
    };
    if a.comp_mask & IBV_SRQ_INIT_ATTR_TYPE == 0 {
        return err(libc::EINVAL);
    }
    if a.srq_type != IBV_SRQT_BASIC {
        return err(errno::unsupported(CALL, "SRQ types other than basic"));
    }
    if a.comp_mask & IBV_SRQ_INIT_ATTR_PD == 0 || a.pd.is_null() {
        a.pd = i.get(|c| c.pd);
        a.comp_mask |= IBV_SRQ_INIT_ATTR_PD;
    }
    let mut basic = ibv_srq_init_attr {
        srq_context: a.srq_context,
        attr: a.attr,
    };
    // SAFETY: the PD is the application's (or the id's); the attributes are ours.
    let srq = unsafe { swv_ibv_create_srq(a.pd, &mut basic) };
    a.attr = basic.attr;
    if srq.is_null() {
        return -1;
    }
    let idp = i.ptr();
    // SAFETY: the id's C fields, as rdma-core sets them.
    unsafe {
        if (*idp).pd.is_null() {
            (*idp).pd = a.pd;
        }
        (*idp).srq = srq;
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_create_srq(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    attr: *mut ibv_srq_init_attr,
) -> c_int {
    // SAFETY: the caller's attributes.
    let Some(a) = (unsafe { attr.as_mut() }) else {
        return err(libc::EINVAL);
    };
    // SAFETY: plain C data; all-zero is valid.
    let mut ex: ibv_srq_init_attr_ex = unsafe { std::mem::zeroed() };
    ex.srq_context = a.srq_context;
    ex.attr = a.attr;
    ex.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD;
    ex.srq_type = IBV_SRQT_BASIC;
    ex.pd = pd;
    // SAFETY: forwarded.
    let rc = unsafe { swv_rdma_create_srq_ex(id, &mut ex) };
    a.attr = ex.attr;
    rc
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_destroy_srq(id: *mut rdma_cm_id) {
    // SAFETY: the caller's id.
    let Some(i) = (unsafe { Id::from_c(id) }) else {
        return;
    };
    let idp = i.ptr();
    // SAFETY: the id's SRQ is NULL or the one `rdma_create_srq` made; rdma-core destroys it
    // the same way (and ignores the result).
    unsafe {
        let srq = std::mem::replace(&mut (*idp).srq, std::ptr::null_mut());
        if !srq.is_null() {
            let _ = swv_ibv_destroy_srq(srq);
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_destroy_qp(id: *mut rdma_cm_id) {
    // SAFETY: the caller's id.
    let Some(i) = (unsafe { Id::from_c(id) }) else {
        return;
    };
    let own_cqs = {
        let mut st = i.state();
        st.qpn = None;
        std::mem::take(&mut st.own_cqs)
    };
    // SAFETY: the id's C fields are the application's view of objects this library made;
    // they are released as rdma-core releases them.
    unsafe {
        if !(*id).qp.is_null() {
            swv_ibv_destroy_qp((*id).qp);
            (*id).qp = std::ptr::null_mut();
        }
        if own_cqs {
            swv_ibv_destroy_cq((*id).send_cq);
            swv_ibv_destroy_cq((*id).recv_cq);
            swv_ibv_destroy_comp_channel((*id).send_cq_channel);
            swv_ibv_destroy_comp_channel((*id).recv_cq_channel);
            (*id).send_cq = std::ptr::null_mut();
            (*id).recv_cq = std::ptr::null_mut();
            (*id).send_cq_channel = std::ptr::null_mut();
            (*id).recv_cq_channel = std::ptr::null_mut();
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_connect(
    id: *mut rdma_cm_id,
    param: *mut rdma_conn_param,
) -> c_int {
    const CALL: &str = "rdma_connect";
    // SAFETY: the caller's id.
    let Some(i) = (unsafe { Id::from_c(id) }) else {
        return err(libc::EINVAL);
    };
    let Some(q) = i.qp() else {
        return err(errno::invalid(
            CALL,
            "no QP on the id (rdma_create_qp first)",
        ));
    };
    let opts = match ids_options(param, CALL) {
        Ok(o) => o,
        Err(e) => return err(e),
    };
    let mut st = i.state();
    let Some(dst) = st.dst else {
        return err(errno::invalid(CALL, "the address is not resolved"));
    };
    // The kernel's ROUTE_RESOLVED only: once connecting (whatever became of it) the id
    // stays in CONNECT until it is destroyed.
    if !st.route_resolved || st.conn.is_some() || st.passive {
        return err(errno::invalid(
            CALL,
            "the route is not resolved, or the id connected already",
        ));
    }
    if let Err(e) = conn_rnr_retry(q, param, CALL) {
        return err(e);
    }
    let ch = i.channel();
    // Registered under the channel's lock, before its events can be read.
    let mut chs = ch.state();
    match ch.inner.connect(&q.qp, dst, &opts) {
        Ok(cm) => {
            chs.conns.insert(cm.conn_id(), id as usize);
            st.conn = Some(cm);
            st.origin = Some(Arc::clone(&ch.inner));
            st.initiator = true;
            st.retries_left = crate::env::connect_retry().0;
            st.connect_opts = Some(opts);
        }
        Err(e) => return err(errno::fail(CALL, &e)),
    }
    drop(chs);
    drop(st);
    i.complete()
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_accept(
    id: *mut rdma_cm_id,
    param: *mut rdma_conn_param,
) -> c_int {
    const CALL: &str = "rdma_accept";
    // SAFETY: the caller's id.
    let Some(i) = (unsafe { Id::from_c(id) }) else {
        return err(libc::EINVAL);
    };
    let Some(q) = i.qp() else {
        return err(errno::invalid(
            CALL,
            "no QP on the id (rdma_create_qp first)",
        ));
    };
    let opts = match ids_options(param, CALL) {
        Ok(o) => o,
        Err(e) => return err(e),
    };
    let mut st = i.state();
    if st.request.is_none() {
        return err(errno::invalid(CALL, "not a connection request"));
    }
    if let Err(e) = conn_rnr_retry(q, param, CALL) {
        return err(e);
    }
    let Some(req) = st.request.take() else {
        return err(errno::invalid(CALL, "not a connection request"));
    };
    match req.accept(&q.qp, &opts) {
        Ok(cm) => {
            debug_assert_eq!(cm.role(), Role::Responder);
            st.conn = Some(cm);
        }
        Err(e) => {
            st.request = Some(req);
            return err(errno::fail(CALL, &e));
        }
    }
    drop(st);
    q.sync_state();
    // A synchronous id reports the connection when it is established (its event is on the
    // listener's channel, where the request came from).
    if i.is_sync() {
        return i.complete();
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_reject(
    id: *mut rdma_cm_id,
    data: *const c_void,
    len: u8,
) -> c_int {
    // SAFETY: the caller's id.
    let Some(i) = (unsafe { Id::from_c(id) }) else {
        return err(libc::EINVAL);
    };
    let data = if len > 0 && !data.is_null() {
        // SAFETY: the application's `len` bytes.
        unsafe { std::slice::from_raw_parts(data.cast::<u8>(), usize::from(len)) }
    } else {
        &[]
    };
    let Some(req) = i.state().request.take() else {
        return err(libc::EINVAL);
    };
    match req.reject(data) {
        Ok(()) => 0,
        Err(e) => err(errno::fail("rdma_reject", &e)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_disconnect(id: *mut rdma_cm_id) -> c_int {
    // SAFETY: the caller's id.
    let Some(i) = (unsafe { Id::from_c(id) }) else {
        return err(libc::EINVAL);
    };
    let (conn, passive) = {
        let st = i.state();
        (st.conn.clone(), st.passive)
    };
    let Some(conn) = conn else {
        // A request not accepted (or rejected) has its kernel iWARP id: its disconnect is 0.
        return if passive { 0 } else { err(libc::EINVAL) };
    };
    if matches!(
        conn.state(),
        softwarp::CmState::Failed | softwarp::CmState::Disconnected | softwarp::CmState::Closed
    ) {
        // Refused, failed or closed already: the kernel's iWARP CM answers 0 (its id is
        // IDLE or CLOSING), however many times.
        i.sync_qp_state();
        return 0;
    }
    // Returns at once, as rdma-core's does; this side's FIN waits for the peer's (within the
    // close order's bound) on the progress thread.
    let rc = match conn.disconnect_after_peer(&crate::cm::close_order()) {
        Ok(()) => 0,
        Err(softwarp::Error::NotConnected) => 0,
        Err(e) => err(errno::fail("rdma_disconnect", &e)),
    };
    i.sync_qp_state();
    rc
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_notify(id: *mut rdma_cm_id, _event: ibv_event_type) -> c_int {
    // iWARP has no communication-established event to forward (rdma-core: a no-op there).
    if !IDS.contains(id) {
        return err(libc::EINVAL);
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_establish(id: *mut rdma_cm_id) -> c_int {
    if !IDS.contains(id) {
        return err(libc::EINVAL);
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_init_qp_attr(
    id: *mut rdma_cm_id,
    attr: *mut ibv_qp_attr,
    mask: *mut c_int,
) -> c_int {
    // SAFETY: the caller's id and outputs.
    let (Some(_), Some(a), false) = (
        unsafe { Id::from_c(id) },
        unsafe { attr.as_mut() },
        mask.is_null(),
    ) else {
        return err(libc::EINVAL);
    };
    let m = match a.qp_state {
        IBV_QPS_INIT => {
            a.qp_access_flags =
                IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
            a.port_num = 1;
            IBV_QP_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_PORT
        }
        IBV_QPS_RTR | IBV_QPS_RTS => IBV_QP_STATE,
        _ => return err(libc::EINVAL),
    };
    // SAFETY: `mask` is writable.
    unsafe { *mask = m as c_int };
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_set_option(
    id: *mut rdma_cm_id,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: usize,
) -> c_int {
    if !IDS.contains(id) || (val.is_null() && len > 0) {
        return err(libc::EINVAL);
    }
    match (level as u32, name as u32) {
        // IPv6 only or both families, for the bind to come (the kernel takes it while the id
        // is fresh or bound; the port is held from the bind on, so a bound id keeps it).
        (RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY) => {
            if len != std::mem::size_of::<c_int>() {
                return err(libc::EINVAL);
            }
            // SAFETY: the caller's `int` (length checked).
            let v = unsafe { val.cast::<c_int>().read_unaligned() };
            // SAFETY: a live id (checked above).
            let Some(i) = (unsafe { Id::from_c(id) }) else {
                return err(libc::EINVAL);
            };
            let mut st = i.state();
            if !st.unresolved() {
                return err(libc::EINVAL);
            }
            st.afonly = Some(v != 0);
            0
        }
        // Accepted and without effect here: the TOS, address reuse and the ACK timeout
        // belong to the TCP connection, which uses the host's defaults.
        (
            RDMA_OPTION_ID,
            RDMA_OPTION_ID_TOS | RDMA_OPTION_ID_REUSEADDR | RDMA_OPTION_ID_ACK_TIMEOUT,
        ) => 0,
        _ => {
            tracing::warn!(target: "softwarp::verbs", level, name, "rdma_set_option: not supported by softwarp");
            err(libc::ENOSYS)
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_get_local_addr(id: *mut rdma_cm_id) -> *mut sockaddr {
    if !IDS.contains(id) {
        return std::ptr::null_mut();
    }
    // SAFETY: the caller's id; the address lives in it.
    unsafe { std::ptr::addr_of_mut!((*id).route.addr.__bindgen_anon_1).cast() }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_get_peer_addr(id: *mut rdma_cm_id) -> *mut sockaddr {
    if !IDS.contains(id) {
        return std::ptr::null_mut();
    }
    // SAFETY: as above.
    unsafe { std::ptr::addr_of_mut!((*id).route.addr.__bindgen_anon_2).cast() }
}

unsafe fn port_of(sa: *mut sockaddr) -> u16 {
    // SAFETY: the id's address storage.
    unsafe { from_sockaddr(sa.cast()) }.map_or(0, |a| a.port().to_be())
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    // SAFETY: forwarded.
    unsafe { port_of(swv_rdma_get_local_addr(id)) }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    // SAFETY: forwarded.
    unsafe { port_of(swv_rdma_get_peer_addr(id)) }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_get_devices(num: *mut c_int) -> *mut *mut ibv_context {
    let ctx = match cm_context() {
        Ok(c) => c,
        Err(e) => {
            errno::set(e);
            return std::ptr::null_mut();
        }
    };
    // SAFETY: calloc of two pointers; NULL is handled.
    let list = unsafe { libc::calloc(2, std::mem::size_of::<*mut ibv_context>()) }
        .cast::<*mut ibv_context>();
    if list.is_null() {
        errno::set(libc::ENOMEM);
        return list;
    }
    // SAFETY: room for two pointers; the second stays NULL.
    unsafe { *list = ctx };
    if !num.is_null() {
        // SAFETY: the caller's int.
        unsafe { *num = 1 };
    }
    list
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_free_devices(list: *mut *mut ibv_context) {
    // SAFETY: from `rdma_get_devices` (calloc) or NULL.
    unsafe { libc::free(list.cast()) };
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_migrate_id(
    id: *mut rdma_cm_id,
    channel: *mut rdma_event_channel,
) -> c_int {
    // SAFETY: the caller's id.
    let Some(i) = (unsafe { Id::from_c(id) }) else {
        return err(libc::EINVAL);
    };
    let st = i.state();
    if !channel.is_null() && !CHANNELS.contains(channel) {
        return err(libc::EINVAL);
    }
    // rdma-core: a synchronous id cannot become synchronous again.
    if channel.is_null() && i.is_sync() {
        return err(libc::EINVAL);
    }
    let old = i.get(|c| c.channel);
    if old == channel {
        return 0;
    }
    drop(st);
    // rdma-core returns once the application acknowledged every event it was given about
    // the id (a listener's connection requests included); bounded here, as in
    // `rdma_destroy_id`.
    wait_for_acks(i, id, true);
    // NULL: the id becomes synchronous, on a private channel of its own (rdma-core makes
    // one too); else the application's channel.
    let (new_ptr, to_sync) = if channel.is_null() {
        match EvChannel::create(true) {
            Ok(c) => (Box::into_raw(c).cast::<rdma_event_channel>(), true),
            Err(e) => return err(e),
        }
    } else {
        (channel, false)
    };
    // SAFETY: a live channel (checked above, or just made).
    let new = unsafe { &*new_ptr.cast::<EvChannel>() };
    new.attach();
    // Its listener's and connection's events go to the new channel from now on, those
    // Softwarp queued already included (the channel they began on still drives them:
    // `IdState::origin` keeps it). The new channel learns their numbers first and the old
    // one forgets them last, so that an event read meanwhile on either finds its id. One
    // channel's lock at a time (another migrate may go the other way).
    let mine = id as usize;
    let (conns, listeners) = {
        let from = i.channel().state();
        let conns: Vec<ConnId> = from
            .conns
            .iter()
            .filter(|(_, p)| **p == mine)
            .map(|(c, _)| *c)
            .collect();
        let listeners: Vec<softwarp::ListenerId> = from
            .listeners
            .iter()
            .filter(|(_, p)| **p == mine)
            .map(|(l, _)| *l)
            .collect();
        (conns, listeners)
    };
    {
        let mut to = new.state();
        to.conns.extend(conns.iter().map(|c| (*c, mine)));
        to.listeners.extend(listeners.iter().map(|l| (*l, mine)));
    }
    {
        let st = i.state();
        if let Some(l) = &st.listener {
            l.route_events_to(&new.inner);
        }
        if let Some(c) = &st.conn {
            if let Err(e) = c.route_events_to(&new.inner) {
                tracing::debug!(target: "softwarp::verbs", error = %e, "rdma_migrate_id: the connection's channel is gone");
            }
        }
        if let Some(r) = &st.request {
            if let Err(e) = r.route_events_to(&new.inner) {
                tracing::debug!(target: "softwarp::verbs", error = %e, "rdma_migrate_id: the request's channel is gone");
            }
        }
    }
    {
        let mut from = i.channel().state();
        for c in &conns {
            from.conns.remove(c);
        }
        for l in &listeners {
            from.listeners.remove(l);
        }
    }
    // The events made here and not read yet move with it.
    for ev in i.channel().take_events(id) {
        new.push(ev);
    }
    if i.is_sync() {
        // The last event a synchronous call kept in `id->event` is released, as rdma-core
        // acknowledges it.
        let last = i.get(|c| c.event);
        if EVENTS.remove(last) {
            // SAFETY: a live event of this library (Box), named only by `id->event`.
            drop(unsafe { Box::from_raw(last.cast::<Event>()) });
        }
        // SAFETY: the id's field, ours to clear.
        unsafe { (*id).event = std::ptr::null_mut() };
    }
    i.sync.store(to_sync, Ordering::Release);
    // SAFETY: the id's channel field, as rdma-core sets it.
    unsafe { (*id).channel = new_ptr };
    // SAFETY: the channel the id was counted on; the id now names the new one. A
    // synchronous id's private channel goes with its last id.
    unsafe { EvChannel::detach(old, id) };
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_create_ep(
    out: *mut *mut rdma_cm_id,
    res: *mut rdma_addrinfo,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    // SAFETY: the caller's pointers.
    let Some(r) = (unsafe { res.as_ref() }) else {
        return err(libc::EINVAL);
    };
    if out.is_null() {
        return err(libc::EINVAL);
    }
    let ps = if r.ai_port_space == 0 {
        RDMA_PS_TCP
    } else {
        r.ai_port_space as rdma_port_space
    };
    // The QP type comes from the address information, as in rdma-core.
    let qp_type = if r.ai_qp_type == 0 {
        IBV_QPT_RC
    } else {
        r.ai_qp_type as ibv_qp_type
    };
    // SAFETY: NULL or the caller's attributes.
    if let Some(a) = unsafe { qp_init_attr.as_mut() } {
        a.qp_type = qp_type;
    }
    let mut id: *mut rdma_cm_id = std::ptr::null_mut();
    // SAFETY: a new synchronous id.
    if unsafe {
        create_id(
            std::ptr::null_mut(),
            &mut id,
            std::ptr::null_mut(),
            ps,
            qp_type,
        )
    } != 0
    {
        return -1;
    }
    // SAFETY: `id` was just created; the rest are the caller's.
    let rc = unsafe {
        if r.ai_flags & crate::cm::addrinfo::RAI_PASSIVE != 0 {
            let rc = swv_rdma_bind_addr(id, r.ai_src_addr);
            if rc == 0 {
                if let Some(i) = Id::from_c(id) {
                    let mut st = i.state();
                    st.ep_qp_attr = qp_init_attr.as_ref().copied();
                    st.ep_pd = pd as usize;
                }
            }
            rc
        } else {
            let mut rc = swv_rdma_resolve_addr(id, r.ai_src_addr, r.ai_dst_addr, 2000);
            if rc == 0 {
                rc = swv_rdma_resolve_route(id, 2000);
            }
            if rc == 0 && !qp_init_attr.is_null() {
                rc = swv_rdma_create_qp(id, pd, qp_init_attr);
            }
            rc
        }
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL);
        // SAFETY: our id, not handed out.
        unsafe { swv_rdma_destroy_id(id) };
        return err(e);
    }
    // SAFETY: `out` is writable.
    unsafe { *out = id };
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_destroy_ep(id: *mut rdma_cm_id) {
    if id.is_null() {
        return;
    }
    // SAFETY: the caller's id; its QP, its SRQ and the objects made for it go first.
    unsafe {
        swv_rdma_destroy_qp(id);
        swv_rdma_destroy_srq(id);
        swv_rdma_destroy_id(id);
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rdma_get_request(
    listen: *mut rdma_cm_id,
    out: *mut *mut rdma_cm_id,
) -> c_int {
    // SAFETY: the caller's id.
    let Some(l) = (unsafe { Id::from_c(listen) }) else {
        return err(libc::EINVAL);
    };
    if out.is_null() || !l.is_sync() || l.state().listener.is_none() {
        return err(libc::EINVAL);
    }
    let ev = match l
        .channel()
        .next_matching(|ev| ev.c.listen_id == listen && ev.c.event == RDMA_CM_EVENT_CONNECT_REQUEST)
    {
        Ok(ev) => ev,
        Err(e) => return err(e),
    };
    let child = ev.c.id;
    // SAFETY: the event's id is the new id this library made for the request.
    let Some(c) = (unsafe { Id::from_c(child) }) else {
        return err(libc::EINVAL);
    };
    c.keep_event(ev);
    let (attr, pd) = {
        let st = c.state();
        (st.ep_qp_attr, st.ep_pd)
    };
    if let Some(mut a) = attr {
        // SAFETY: the new id, and the PD the application gave `rdma_create_ep` (or NULL).
        if unsafe { swv_rdma_create_qp(child, pd as *mut ibv_pd, &mut a) } != 0 {
            let e = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EINVAL);
            // SAFETY: our id, not handed out.
            unsafe { swv_rdma_destroy_id(child) };
            return err(e);
        }
    }
    // SAFETY: `out` is writable.
    unsafe { *out = child };
    0
}
