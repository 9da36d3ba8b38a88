//! The device (after `ibv_context`): the software RNIC's attributes and limits, its STag
//! table, its asynchronous event stream and its progress thread.
//!
//! Softwarp has one kind of device, [`DEVICE_NAME`]: the software RNIC over the host's TCP
//! stack. Each [`Device::open`] makes an independent instance (own STag table, own progress
//! thread), as each `ibv_open_device` gives an own context.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};
use std::time::Duration;

use softwarp_engine::event::AsyncEvent;
use softwarp_engine::mr::{MrTable, Stag};
use softwarp_engine::wr::{MAX_INLINE, MAX_SGE};
use softwarp_ras::stats::StatsSource;
use softwarp_ras::tracker::{DescribeResource, ResourceKind};

use crate::availability::inflight::{DeviceGate, Entry, Inflight};
use crate::availability::markers;
use crate::availability::netwatch::Watched;
use crate::availability::recovery::{
    Contained, DeviceFault, DeviceState, FaultKind, Health, RecoveryConfig, RecoveryReport,
};
use crate::error::{Error, Result};
use crate::instrument::{DeviceRas, Tracked};
use crate::runtime::progress::{Progress, ProgressStats};
use crate::runtime::sys;
use crate::sync::{self, lock};
use crate::verbs::cq::{CompletionChannel, CompletionQueue, CqShared};
use crate::verbs::hooks::RasHooks;
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::qp::QpShared;
use crate::RasConfig;

/// The name of Softwarp's device.
pub const DEVICE_NAME: &str = "softwarp0";

/// The device's firmware version (`fw_ver`): Softwarp's own version.
pub const FIRMWARE_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Names of the devices that can be opened.
pub fn list_devices() -> Vec<String> {
    vec![DEVICE_NAME.to_string()]
}

/// Attributes and limits of a device (after `ibv_device_attr`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceAttr {
    /// Device name.
    pub name: String,
    /// Firmware (here: software) version.
    pub fw_ver: String,
    /// Transport: always "iWARP".
    pub transport: &'static str,
    /// Most QPs.
    pub max_qp: usize,
    /// Most outstanding work requests per queue.
    pub max_qp_wr: usize,
    /// Most scatter/gather elements per work request.
    pub max_sge: usize,
    /// Most bytes of inline data per send work request.
    pub max_inline_data: usize,
    /// Most CQs.
    pub max_cq: usize,
    /// Most entries per CQ.
    pub max_cqe: usize,
    /// Most memory registrations.
    pub max_mr: usize,
    /// Largest memory registration in bytes.
    pub max_mr_size: u64,
    /// Most protection domains.
    pub max_pd: usize,
    /// Most RDMA Read Requests a QP accepts outstanding (IRD).
    pub max_qp_rd_atom: usize,
    /// Most RDMA Reads a QP may have outstanding (ORD).
    pub max_qp_init_rd_atom: usize,
    /// Most SRQs.
    pub max_srq: usize,
    /// Most work requests per SRQ.
    pub max_srq_wr: usize,
    /// Page size of regions the stack allocates.
    pub page_size: usize,
}

impl DeviceAttr {
    fn softwarp() -> Self {
        Self {
            name: DEVICE_NAME.to_string(),
            fw_ver: FIRMWARE_VERSION.to_string(),
            transport: "iWARP",
            max_qp: 65536,
            max_qp_wr: 4096,
            max_sge: MAX_SGE,
            max_inline_data: MAX_INLINE,
            max_cq: 1024,
            // Linux siw's (SIW_MAX_CQE): a CQ's ring grows as completions arrive, so the
            // bound costs nothing until used, and libfabric's rxm asks for CQs of
            // (tx + rx) x 256 peers.
            max_cqe: 3_276_800,
            max_mr: 4096,
            max_mr_size: u64::from(u32::MAX),
            max_pd: 1024,
            max_qp_rd_atom: 128,
            max_qp_init_rd_atom: 128,
            max_srq: 256,
            max_srq_wr: 16384,
            page_size: softwarp_engine::memory::PAGE_SIZE,
        }
    }
}

/// Bounded queue of asynchronous events with a blocking take, and an eventfd that is
/// readable exactly while events are queued (written at every event, drained when the last
/// one is taken; both under the queue's lock), for `poll`/`epoll` loops and async runtimes.
#[derive(Debug)]
pub(crate) struct EventQueue {
    q: Mutex<VecDeque<AsyncEvent>>,
    cv: Condvar,
    fd: sys::EventFd,
    lost: AtomicUsize,
    /// Events reported, per [`EVENT_KINDS`] entry (statistics).
    reported: [AtomicU64; EVENT_KINDS.len()],
}

/// The device's STag key source ([`softwarp_engine::mr::KeySource`]): 64 bits from the
/// operating system's generator, which a peer cannot predict (RFC 5042 section 5.1).
fn os_stag_key() -> Option<u64> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).ok()?;
    Some(u64::from_le_bytes(b))
}

/// Names of the kinds of asynchronous events, as the statistics label them.
const EVENT_KINDS: [&str; 7] = [
    "qp_fatal",
    "qp_request_error",
    "qp_access_error",
    "cq_error",
    "srq_limit_reached",
    "device_fatal",
    "other",
];

fn event_kind(ev: &AsyncEvent) -> usize {
    match ev {
        AsyncEvent::QpFatal { .. } => 0,
        AsyncEvent::QpRequestError { .. } => 1,
        AsyncEvent::QpAccessError { .. } => 2,
        AsyncEvent::CqError { .. } => 3,
        AsyncEvent::SrqLimitReached { .. } => 4,
        AsyncEvent::DeviceFatal => 5,
        _ => 6,
    }
}

const EVENT_QUEUE_CAP: usize = 4096;

impl EventQueue {
    fn new() -> std::io::Result<Self> {
        Ok(Self {
            q: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
            fd: sys::EventFd::new()?,
            lost: AtomicUsize::new(0),
            reported: Default::default(),
        })
    }

    pub(crate) fn fd(&self) -> &sys::EventFd {
        &self.fd
    }

    /// Events reported so far, per kind (for statistics).
    pub(crate) fn counts(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        EVENT_KINDS
            .iter()
            .zip(self.reported.iter())
            .map(|(k, n)| (*k, n.load(Ordering::Relaxed)))
    }

    /// Events dropped because the queue was full.
    pub(crate) fn lost_count(&self) -> u64 {
        self.lost.load(Ordering::Relaxed) as u64
    }

    pub(crate) fn push(&self, ev: AsyncEvent) {
        tracing::debug!(?ev, "async event");
        if let Some(n) = self.reported.get(event_kind(&ev)) {
            n.fetch_add(1, Ordering::Relaxed);
        }
        let mut q = lock(&self.q);
        if q.len() >= EVENT_QUEUE_CAP {
            // Keep the newest: the oldest events are the least useful to a late reader.
            q.pop_front();
            self.lost.fetch_add(1, Ordering::Relaxed);
        }
        q.push_back(ev);
        // Every event writes the eventfd (not only the first of a run): an edge-triggered
        // waiter (tokio's `AsyncFd`) that found nothing for it wakes again at the next one.
        if let Err(e) = self.fd.signal() {
            tracing::error!(error = %e, "device events: eventfd write failed");
        }
        drop(q);
        self.cv.notify_all();
    }

    pub(crate) fn take(&self, timeout: Option<Duration>) -> Option<AsyncEvent> {
        let deadline = softwarp_ras::deadline::Deadline::from_timeout(timeout);
        let mut q = lock(&self.q);
        loop {
            if let Some(ev) = q.pop_front() {
                if q.is_empty() {
                    if let Err(e) = self.fd.drain() {
                        tracing::error!(error = %e, "device events: eventfd read failed");
                    }
                }
                return Some(ev);
            }
            match deadline.remaining() {
                None => q = sync::wait(&self.cv, q),
                Some(left) if left.is_zero() => return None,
                Some(left) => q = sync::wait_timeout(&self.cv, q, left),
            }
        }
    }
}

/// State shared by a device and everything created from it. `repr(C)`: the structure
/// markers begin and end it.
#[derive(Debug)]
#[repr(C)]
pub(crate) struct DeviceShared {
    begin: markers::Begin,
    /// Threads inside the device's entry points; closed by [`Device::close`], held by
    /// [`Device::quiesce`].
    pub(crate) inflight: DeviceGate,
    pub(crate) attr: DeviceAttr,
    /// The STag table. Locked only to register, look up or validate (never across I/O).
    mrs: RwLock<MrTable>,
    pub(crate) events: EventQueue,
    pub(crate) progress: Progress<QpShared>,
    /// Every QP, for device-wide errors (not on the data path).
    pub(crate) qps: WeakList<QpShared>,
    /// QP numbers.
    qp_nums: Arc<IdSpace>,
    /// Numbers of PDs, CQs and SRQs.
    ids: Arc<IdSpace>,
    pub(crate) counts: Counts,
    /// Resource tracker (see `crate::instrument`).
    pub(crate) ras: DeviceRas,
    /// The CQs whose statistics are exported with the device's.
    pub(crate) cqs: WeakList<CqShared>,
    /// What the device and its objects tell RAS (installed at open: `crate::RAS_HOOKS`).
    pub(crate) hooks: &'static dyn RasHooks,
    /// State, fault, recovery (see `crate::availability::recovery`).
    pub(crate) health: Health,
    end: markers::End,
}

/// The device as containment and recovery see it.
impl Contained for DeviceShared {
    type Qp = QpShared;
    fn health(&self) -> &Health {
        &self.health
    }
    fn gate(&self) -> &DeviceGate {
        &self.inflight
    }
    fn instance(&self) -> &str {
        self.ras.instance()
    }
    fn name(&self) -> &str {
        &self.attr.name
    }
    fn live_qps(&self) -> Vec<Arc<QpShared>> {
        DeviceShared::live_qps(self)
    }
    fn resources(&self) -> Vec<softwarp_ras::tracker::ResourceInfo> {
        self.ras.tracker.resources()
    }
    fn push_event(&self, event: AsyncEvent) {
        self.events.push(event);
    }
    fn fault_contained(&self, fault: &str, qps: usize, snapshots: &[u64]) {
        self.hooks.device_failed(self, fault, qps, snapshots);
    }
    fn fault_dump(&self, fault: &str) {
        self.hooks.device_fault_dump(fault);
    }
    fn recovery_ended(&self, report: &RecoveryReport) {
        self.hooks.device_recovery(self, report);
    }
}

/// The device as the network watch sees it.
impl Watched for DeviceShared {
    fn instance(&self) -> &str {
        self.ras.instance()
    }
    fn network_gone(&self, lost: &[(Vec<IpAddr>, String)]) {
        let qps: Vec<_> = self
            .live_qps()
            .into_iter()
            .filter_map(|qp| qp.local_addr().map(|a| (qp, a.ip().to_canonical())))
            .collect();
        for (gone, detail) in lost {
            for (qp, ip) in &qps {
                if gone.iter().any(|g| g.to_canonical() == *ip) && qp.network_gone(detail) {
                    softwarp_ras::sw_event!(
                        Runtime,
                        1,
                        qpn = qp.qp_num(),
                        "QP terminated: {detail}"
                    );
                }
            }
        }
    }
    fn contain(self: Arc<Self>, kind: FaultKind) {
        crate::availability::recovery::contain(&self, kind);
    }
}

/// Live object counts, for the limits in [`DeviceAttr`].
#[derive(Debug, Default)]
pub(crate) struct Counts {
    pub(crate) qp: AtomicUsize,
    pub(crate) cq: AtomicUsize,
    pub(crate) pd: AtomicUsize,
    pub(crate) srq: AtomicUsize,
}

impl Counts {
    /// Takes one unit of `counter` unless `limit` is reached.
    pub(crate) fn take(
        counter: &AtomicUsize,
        limit: usize,
        what: &'static str,
    ) -> Result<CountGuard> {
        let mut cur = counter.load(Ordering::Relaxed);
        loop {
            if cur >= limit {
                return Err(Error::Limit {
                    what,
                    requested: cur + 1,
                    limit,
                });
            }
            match counter.compare_exchange(cur, cur + 1, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Ok(CountGuard(true)),
                Err(now) => cur = now,
            }
        }
    }
}

/// Marks a counted object; the owner calls [`CountGuard::release`] with its counter.
#[derive(Debug)]
pub(crate) struct CountGuard(bool);

impl CountGuard {
    pub(crate) fn release(&mut self, counter: &AtomicUsize) {
        if std::mem::take(&mut self.0) {
            counter.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl DeviceShared {
    /// `Ok` while the device is operational; else [`Error::DeviceFailed`] naming the fault
    /// (one relaxed load on the way to `Ok`).
    pub(crate) fn check_usable(&self) -> Result<()> {
        self.health.check(self.ras.instance())
    }

    /// (`#[inline]`: the posts that call it are generic, instantiated in other crates.)
    #[inline]
    pub(crate) fn mrs_read(&self) -> RwLockReadGuard<'_, MrTable> {
        sync::read(&self.mrs)
    }
    pub(crate) fn mrs_write(&self) -> RwLockWriteGuard<'_, MrTable> {
        sync::write(&self.mrs)
    }
    /// A number for a new QP, unused by any live one (held until the lease drops).
    pub(crate) fn next_qp_num(&self) -> Result<IdLease> {
        IdSpace::lease(&self.qp_nums)
    }
    /// A number for a new PD, CQ or SRQ, unused by any live one (held until the lease drops).
    pub(crate) fn next_id(&self) -> Result<IdLease> {
        IdSpace::lease(&self.ids)
    }
    pub(crate) fn add_qp(&self, qp: &Arc<QpShared>) {
        self.qps.insert(qp, &self.progress.counters);
    }
    pub(crate) fn live_qps(&self) -> Vec<Arc<QpShared>> {
        self.qps.live()
    }

    /// Enters entry point `entry` of the device (in-flight tracking) after checking the
    /// device's markers (object creation and the other entry points that are not per
    /// message; the per-message ones check their own object's markers only).
    pub(crate) fn enter(&self, entry: Entry) -> Result<Inflight<'_>> {
        let inside = self
            .inflight
            .enter(entry)
            .map_err(crate::availability::inflight::refused)?;
        if !markers::intact(markers::Kind::Device, &self.begin, &self.end) {
            return Err(self.markers_damaged(entry.name()));
        }
        Ok(inside)
    }

    /// The device's markers as found.
    pub(crate) fn marker_words(&self) -> Vec<softwarp_ras::markers::MarkerWord> {
        markers::words(markers::Kind::Device, &self.begin, &self.end)
    }

    #[cold]
    fn markers_damaged(&self, check: &'static str) -> Error {
        markers::damaged(
            self,
            markers::Kind::Device.name(),
            0,
            &self.marker_words(),
            check,
        )
    }

    /// Checks the markers of the device and of every QP and CQ of it (and the guard words of
    /// their rings); the first damage found fails the device. At close and on demand.
    pub(crate) fn check_all_markers(&self, check: &'static str) -> Result<()> {
        if !markers::intact(markers::Kind::Device, &self.begin, &self.end) {
            return Err(self.markers_damaged(check));
        }
        for qp in self.live_qps() {
            qp.check_markers(check)?;
        }
        for cq in self.cqs.live() {
            cq.check_markers(check)?;
        }
        Ok(())
    }

    /// Deregisters `stag` at once (no later access validates); in-flight work that holds its
    /// memory finishes with it, and the index is reused only after that.
    pub(crate) fn deregister(&self, stag: Stag) {
        // The table's guard is a temporary of this statement: released before the logging.
        let result = self.mrs_write().deregister(stag);
        match result {
            Ok(0) => {}
            Ok(users) => {
                tracing::debug!(
                    stag = stag.0,
                    users,
                    "deregistered; in-flight work still holds the memory"
                );
            }
            Err(e) => tracing::error!(stag = stag.0, error = %e, "deregistration failed"),
        }
    }
}

/// The objects of a device or CQ (QPs, CQs), held weakly for device-wide actions (never on
/// the data path). An entry stays until a compaction after its object died: the object's
/// drop counts it dead ([`WeakList::died`], no lock: an object may die while the list is
/// locked by a walk over it), and an insertion compacts the list once the dead are half of
/// it. So an insertion walks fewer than two entries on average whatever the count; it
/// walked the whole list before, which made setting up `n` connections cost `n^2 / 2`
/// entries (issue 39).
#[derive(Debug)]
pub(crate) struct WeakList<T> {
    list: Mutex<Vec<Weak<T>>>,
    dead: AtomicUsize,
}

impl<T> Default for WeakList<T> {
    fn default() -> Self {
        Self {
            list: Mutex::new(Vec::new()),
            dead: AtomicUsize::new(0),
        }
    }
}

impl<T> WeakList<T> {
    /// Adds `obj`, first compacting when the dead are half of the list. Counts the entries
    /// inserted and walked in `counters`.
    pub(crate) fn insert(&self, obj: &Arc<T>, counters: &crate::runtime::progress::Counters) {
        let mut list = lock(&self.list);
        let dead = self.dead.load(Ordering::Relaxed);
        if dead > 0 && dead.saturating_mul(2) >= list.len() {
            let before = list.len();
            list.retain(|w| w.strong_count() > 0);
            let removed = before - list.len();
            // An object whose last reference went but whose drop has not counted it yet
            // is removed too: it counts later, and compacts a little early once.
            let _ = self
                .dead
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| {
                    Some(d.saturating_sub(removed))
                });
            counters.visit(before);
        }
        list.push(Arc::downgrade(obj));
        counters.visit(1);
    }

    /// One object of the list died (from its `Drop`).
    pub(crate) fn died(&self) {
        self.dead.fetch_add(1, Ordering::Relaxed);
    }

    /// The live objects.
    pub(crate) fn live(&self) -> Vec<Arc<T>> {
        lock(&self.list).iter().filter_map(Weak::upgrade).collect()
    }

    /// The list itself, for a walk without a copy (an object that dies during the walk
    /// only counts itself dead).
    pub(crate) fn lock(&self) -> MutexGuard<'_, Vec<Weak<T>>> {
        lock(&self.list)
    }
}

/// The numbers of a device's PDs, CQs and SRQs: handed out in increasing order from 1,
/// wrapping at the end of the space and skipping those still in use, so that no two live
/// objects ever share a number however many were created before (a plain counter would wrap
/// after 2^32 allocations and hand a new PD a live PD's number).
#[derive(Debug)]
pub(crate) struct IdSpace {
    st: Mutex<IdState>,
}

#[derive(Debug)]
struct IdState {
    /// The next number to try.
    next: u32,
    /// Largest number handed out.
    max: u32,
    live: std::collections::HashSet<u32>,
}

impl IdSpace {
    pub(crate) fn new(max: u32) -> Self {
        Self {
            st: Mutex::new(IdState {
                next: 1,
                max: max.max(1),
                live: std::collections::HashSet::new(),
            }),
        }
    }

    /// Leases the next free number.
    pub(crate) fn lease(space: &Arc<IdSpace>) -> Result<IdLease> {
        let mut st = lock(&space.st);
        let max = st.max;
        // At most one full turn: every number in use means none is left.
        for _ in 0..=u64::from(max) {
            let id = st.next;
            st.next = if id >= max { 1 } else { id + 1 };
            if st.live.insert(id) {
                return Ok(IdLease {
                    id,
                    space: Arc::clone(space),
                });
            }
        }
        Err(Error::Limit {
            what: "object numbers",
            requested: st.live.len().saturating_add(1),
            limit: max as usize,
        })
    }
}

/// A number from an [`IdSpace`], free again when this is dropped.
#[derive(Debug)]
pub(crate) struct IdLease {
    id: u32,
    space: Arc<IdSpace>,
}

impl IdLease {
    pub(crate) fn id(&self) -> u32 {
        self.id
    }
}

impl Drop for IdLease {
    fn drop(&mut self) {
        lock(&self.space.st).live.remove(&self.id);
    }
}

/// Held only by [`Device`] handles: when the last one goes, the device is *closed* and
/// what is still allocated from it is reported as leaked (objects keep the shared state,
/// and so the progress thread, alive until they go too).
#[derive(Debug)]
struct DeviceOwner {
    shared: Arc<DeviceShared>,
    /// The device's registration with its tracker.
    ras: Tracked,
}

impl Drop for DeviceOwner {
    fn drop(&mut self) {
        self.shared.hooks.device_closed(&self.shared, &self.ras);
        self.shared.health.closed();
    }
}

/// An open device: the root of every other verbs object.
///
/// Cloning gives another handle to the same device. The device (its progress thread) stops
/// when the last handle and the last object created from it are gone.
///
/// Dropping the last handle *closes* the device: every PD, MR, CQ, SRQ and QP still
/// allocated from it is reported as a leak (error log and a level 1 trace record), with
/// the source line that created it. Drop the device after everything created from it.
#[derive(Debug, Clone)]
pub struct Device {
    pub(crate) shared: Arc<DeviceShared>,
    _owner: Arc<DeviceOwner>,
}

/// Opens a device with options: [`Device::builder`].
///
/// ```no_run
/// use softwarp::{Device, RasConfig};
/// # fn main() -> softwarp::Result<()> {
/// // The RAS services as the operator's environment configures them (control socket and
/// // host registry entry in SOFTWARP_RUNTIME_DIR, error log, SOFTWARP_METRICS ...).
/// let dev = Device::builder().ras(RasConfig::from_env()).open()?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `open` is called"]
pub struct DeviceBuilder {
    name: String,
    ras: Option<RasConfig>,
    interface: Option<String>,
    watch_network: Option<bool>,
    recovery: Option<RecoveryConfig>,
    automatic_recovery: Option<bool>,
}

impl DeviceBuilder {
    /// The device to open (default [`DEVICE_NAME`]).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Starts the process's RAS services with `config` when the device opens, unless they
    /// run already (the first configuration wins) or the operator set `SOFTWARP_RAS=off`.
    /// See [`enable_ras`](crate::enable_ras).
    pub fn ras(mut self, config: RasConfig) -> Self {
        self.ras = Some(config);
        self
    }

    /// Binds the device to a network interface (`eth0`): the device fails when the
    /// interface goes down, disappears or loses its last address (watched through
    /// rtnetlink, which this option turns on).
    pub fn interface(mut self, name: impl Into<String>) -> Self {
        self.interface = Some(name.into());
        self
    }

    /// Watches the network through rtnetlink (a netlink socket in the progress thread's
    /// epoll, in the network namespace of the thread that opens the device): a QP whose
    /// local address is removed, or whose interface goes down or disappears, is terminated
    /// at once. On by default when the RAS services run or an interface is bound; `false`
    /// turns it off even then.
    pub fn watch_network(mut self, on: bool) -> Self {
        self.watch_network = Some(on);
        self
    }

    /// Recovers automatically after every fault, with `config` (bound, processes that may
    /// be terminated): on a thread of its own that lives at most the bound. Without this,
    /// automatic recovery runs only while the RAS services run (with
    /// `RecoveryConfig::from_env()`); otherwise the device stays failed until
    /// [`Device::recover`].
    pub fn recovery(mut self, config: RecoveryConfig) -> Self {
        self.recovery = Some(config);
        self
    }

    /// `false`: no automatic recovery at all, even while the RAS services run; the device
    /// stays failed until the application calls [`Device::recover`].
    pub fn automatic_recovery(mut self, on: bool) -> Self {
        self.automatic_recovery = Some(on);
        self
    }

    /// Opens the device.
    #[track_caller]
    pub fn open(self) -> Result<Device> {
        Device::open_with(self)
    }
}

impl Device {
    /// A builder to open a device with options (the RAS services).
    pub fn builder() -> DeviceBuilder {
        DeviceBuilder {
            name: DEVICE_NAME.to_string(),
            ras: None,
            interface: None,
            watch_network: None,
            recovery: None,
            automatic_recovery: None,
        }
    }

    /// Opens the device called `name` ([`DEVICE_NAME`]).
    ///
    /// The first open of a process applies `SOFTWARP_TRACE` to the trace levels. It starts
    /// no RAS service (no thread besides the device's progress thread, no file, no global
    /// `tracing` subscriber) unless the operator set `SOFTWARP_RAS=on`; an application asks
    /// for them with [`Device::builder`]`().ras(..)` or [`enable_ras`](crate::enable_ras).
    #[track_caller]
    pub fn open(name: &str) -> Result<Self> {
        Self::builder().name(name).open()
    }

    #[track_caller]
    fn open_with(b: DeviceBuilder) -> Result<Self> {
        let name = b.name.as_str();
        if name != DEVICE_NAME {
            return Err(Error::DeviceNotFound(name.to_string()));
        }
        crate::instrument::init(b.ras.as_ref());
        let ras_on = softwarp_ras::service::global().is_some();
        let auto = b
            .recovery
            .clone()
            .or_else(|| ras_on.then(RecoveryConfig::from_env))
            .filter(|_| b.automatic_recovery != Some(false));
        let asked = b.interface.is_some() || b.watch_network == Some(true);
        let watch = b.watch_network.unwrap_or(ras_on || asked);
        // The netlink socket lives in the network namespace of the opening thread, as the
        // sockets of the QPs the application makes on it usually do. Asked for by the
        // application, a failure fails the open; implied by the RAS services, it is
        // reported and the device opens without the watch.
        let netwatch = match watch
            .then(|| crate::availability::netwatch::NetWatch::open(b.interface.as_deref()))
        {
            Some(Ok(w)) => Some(w),
            Some(Err(e)) if asked => return Err(e),
            Some(Err(e)) => {
                softwarp_ras::sw_event!(Runtime, 1, error = %e, "the network is not watched");
                None
            }
            None => None,
        };
        let attr = DeviceAttr::softwarp();
        let progress = Progress::start(name)?;
        let ras = DeviceRas::new(name);
        let shared = Arc::new(DeviceShared {
            begin: markers::Begin::new(markers::Kind::Device),
            inflight: DeviceGate::new(),
            mrs: RwLock::new(MrTable::new(attr.max_mr, os_stag_key)),
            attr,
            events: EventQueue::new().map_err(|e| Error::io("eventfd", e))?,
            progress,
            qps: WeakList::default(),
            qp_nums: Arc::new(IdSpace::new(u32::MAX)),
            ids: Arc::new(IdSpace::new(u32::MAX)),
            counts: Counts::default(),
            ras,
            cqs: WeakList::default(),
            hooks: crate::RAS_HOOKS,
            health: Health::new(b.interface.clone(), auto),
            end: markers::End::new(markers::Kind::Device),
        });
        // The shared state and the progress thread's staging buffer (approximate).
        let bytes = std::mem::size_of::<DeviceShared>() + crate::runtime::progress::SCRATCH_LEN;
        let ras = Tracked::new(&shared.ras.tracker, ResourceKind::Device, 0, bytes as u64);
        ras.describe_with(Arc::downgrade(&shared) as Weak<dyn DescribeResource>);
        softwarp_ras::stats::register_source(Arc::downgrade(&shared) as Weak<dyn StatsSource>);
        softwarp_ras::sw_event!(
            Runtime,
            4,
            device = shared.ras.tracker.name(),
            "device opened"
        );
        Health::register_target(&shared);
        if let Some(w) = netwatch {
            shared
                .progress
                .net_watch(w.attach(Arc::downgrade(&shared) as Weak<dyn Watched>))?;
        }
        Ok(Self {
            _owner: Arc::new(DeviceOwner {
                shared: Arc::clone(&shared),
                ras,
            }),
            shared,
        })
    }

    /// Opens the default (first) device.
    #[track_caller]
    pub fn open_default() -> Result<Self> {
        Self::open(DEVICE_NAME)
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.shared.attr.name
    }

    /// The name this open instance is reported under by the RAS services (`softwarp
    /// resources`, `softwarp stat`, the error log): the device's name and the number of the
    /// open within the process, e.g. `softwarp0/2`.
    pub fn instance_name(&self) -> &str {
        self.shared.ras.instance()
    }

    /// Attributes and limits (after `ibv_query_device`).
    pub fn query(&self) -> DeviceAttr {
        self.shared.attr.clone()
    }

    /// Allocates a protection domain.
    #[track_caller]
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        let _inside = self.shared.enter(Entry::AllocPd)?;
        self.shared.check_usable()?;
        let guard = Counts::take(
            &self.shared.counts.pd,
            self.shared.attr.max_pd,
            "protection domains",
        )?;
        Ok(ProtectionDomain::new(
            Arc::clone(&self.shared),
            self.shared.next_id()?,
            guard,
        ))
    }

    /// Creates a completion queue for at least `cqe` completions, optionally attached to a
    /// completion channel for event mode.
    #[track_caller]
    pub fn create_cq(
        &self,
        cqe: usize,
        channel: Option<&CompletionChannel>,
    ) -> Result<CompletionQueue> {
        let _inside = self.shared.enter(Entry::CreateCq)?;
        self.shared.check_usable()?;
        CompletionQueue::new(&self.shared, cqe, channel)
    }

    /// Creates a completion channel (a pollable file descriptor for completion events).
    pub fn create_comp_channel(&self) -> Result<CompletionChannel> {
        CompletionChannel::new()
    }

    /// Waits for the next asynchronous event (QP fatal/access/request error, CQ error, SRQ
    /// limit, device fatal), without a time limit.
    ///
    /// Fails only with [`Error::WouldDeadlock`], on a thread where waiting would deadlock
    /// (a device's progress thread, a callback inside a Softwarp call).
    pub fn get_async_event(&self) -> Result<AsyncEvent> {
        crate::availability::context::check_blocking("Device::get_async_event")?;
        loop {
            if let Some(ev) = self.shared.events.take(None) {
                return Ok(ev);
            }
        }
    }

    /// Waits at most `timeout` for the next asynchronous event ([`Error::WouldDeadlock`]
    /// where waiting would deadlock, unless `timeout` is zero).
    pub fn get_async_event_timeout(&self, timeout: Duration) -> Result<AsyncEvent> {
        crate::availability::context::check_wait("Device::get_async_event_timeout", Some(timeout))?;
        self.shared
            .events
            .take(Some(timeout))
            .ok_or(Error::Timeout(timeout))
    }

    /// The next asynchronous event if one is pending; never blocks.
    pub fn try_get_async_event(&self) -> Option<AsyncEvent> {
        self.shared.events.take(Some(Duration::ZERO))
    }

    /// A file descriptor (an eventfd) that is readable exactly while asynchronous events are
    /// queued (after `ibv_context.async_fd`): put it in your own `poll`/`epoll` set and call
    /// [`Device::try_get_async_event`] when it is readable. With the `tokio` feature,
    /// `Device::next_async_event` awaits it.
    pub fn async_event_fd(&self) -> BorrowedFd<'_> {
        self.shared.events.fd().as_fd()
    }

    /// Asynchronous events dropped because nobody read the queue (it keeps the newest
    /// 4096).
    pub fn async_events_lost(&self) -> usize {
        self.shared.events.lost.load(Ordering::Relaxed)
    }

    /// Simulates a device failure (fault injection, [`FaultKind::Injected`]): the device
    /// becomes [`DeviceState::Failed`] and the fault is contained: every QP of the device
    /// goes to the Error state with the fault as its error reason (outstanding and later
    /// work requests flush, connections close) and one [`AsyncEvent::DeviceFatal`] is
    /// reported. Each QP is snapshotted (`softwarp snapshots`), the failure goes to the
    /// error log with the recommended action, and, while the RAS services run, an automatic
    /// component dump is written into the runtime directory (at most one per second;
    /// `SOFTWARP_AUTO_DUMPS`). A device that has failed already is left as it is (no second
    /// event). Recovery follows as configured ([`DeviceBuilder::recovery`],
    /// [`Device::recover`]). `softwarp fault inject --pid P` does the same from outside.
    pub fn inject_fatal_error(&self) {
        crate::availability::recovery::contain(&self.shared, FaultKind::Injected);
    }

    /// What the device's progress thread and its QP bookkeeping did so far: QPs served,
    /// wake-ups, timer looks, QP entries visited. The work a connection costs besides its
    /// bytes, counted, so that its growth with the number of connections can be checked
    /// without a clock (`tests/it/cm_scale.rs`).
    pub fn progress_stats(&self) -> ProgressStats {
        self.shared.progress.counters.stats()
    }

    /// The device's state: [`DeviceState::Operational`], `Failed` after a fault,
    /// `Recovering` while a recovery waits for the holders of its resources.
    pub fn state(&self) -> DeviceState {
        self.shared.health.state()
    }

    /// The current fault while the device is failed or recovering, else the last one (its
    /// generation tells which), or `None` if it never failed.
    pub fn fault(&self) -> Option<DeviceFault> {
        self.shared.health.fault()
    }

    /// The current (while recovering) or last recovery.
    pub fn last_recovery(&self) -> Option<RecoveryReport> {
        self.shared.health.recovery()
    }

    /// Recovers a failed device on this thread: waits (at most `config.bound`) until every
    /// object created on it before the fault was dropped, in this process and in other
    /// registered processes whose instance of the device failed too (terminating those
    /// named in `config.terminate`), then makes it operational again. Returns the report:
    /// its outcome is `TimedOut`, with the holders (pid, process, thread, file:line), when
    /// the bound ran out; the device then stays failed. If a recovery runs already, waits
    /// for it and returns its report. An error when the device has not failed.
    pub fn recover(&self, config: &RecoveryConfig) -> Result<RecoveryReport> {
        crate::availability::recovery::recover(&self.shared, config)
    }

    /// Closes the device, for every handle of it: new work is refused
    /// ([`Error::DeviceClosed`]), threads inside its entry points are waited for (at most
    /// `bound`), the structure markers of the device and of every QP and CQ are checked,
    /// and every QP goes to Error, so that every work request posted before completes
    /// (flushed if it had not finished) and the connections close. Polls keep returning
    /// those completions; the objects can still be dropped, in any order.
    ///
    /// What is still allocated is reported as leaked when the last `Device` handle goes, as
    /// when the device is simply dropped.
    ///
    /// Errors: [`Error::WouldDeadlock`] on a thread where waiting would deadlock (nothing
    /// is done); [`Error::StillInside`] when threads were still inside after `bound` (named
    /// in the report; the device is closed all the same and they return normally);
    /// [`Error::MarkerDamaged`] when a marker was found damaged (the device failed; it is
    /// closed all the same).
    pub fn close(self, bound: Duration) -> Result<()> {
        crate::availability::context::check_blocking("Device::close")?;
        let sh = &self.shared;
        sh.inflight.shut(crate::availability::inflight::CLOSED);
        let waited = sh.inflight.wait_empty(bound, sh.ras.instance());
        let checked = sh.check_all_markers("Device::close");
        for qp in sh.live_qps() {
            qp.set_error_and_kick();
        }
        softwarp_ras::sw_event!(
            Runtime,
            4,
            device = sh.ras.instance(),
            "device closed by close()"
        );
        drop(self);
        waited.map_err(Error::StillInside)?;
        checked
    }

    /// Quiesces the device for a recovery (or anything that must replace device state no
    /// entry point may see half done): new entries are refused ([`Error::DeviceQuiesced`])
    /// and the threads inside entry points are waited for, at most `bound`. The device stays
    /// quiesced until the returned guard is dropped (or [`Quiesced::end`]).
    ///
    /// Errors: [`Error::StillInside`] with the threads still inside after `bound` (the
    /// device is let go again: nothing is held); [`Error::DeviceQuiesced`] while another
    /// quiesce holds it; [`Error::DeviceClosed`] after [`Device::close`];
    /// [`Error::WouldDeadlock`] on a thread where waiting would deadlock (a progress thread,
    /// or inside an entry point: the wait would be for the caller itself).
    pub fn quiesce(&self, bound: Duration) -> Result<Quiesced> {
        crate::availability::context::check_blocking("Device::quiesce")?;
        let sh = &self.shared;
        let before = sh.inflight.shut(crate::availability::inflight::QUIESCED);
        if before & crate::availability::inflight::CLOSED != 0 {
            if before & crate::availability::inflight::QUIESCED == 0 {
                sh.inflight.open(crate::availability::inflight::QUIESCED);
            }
            return Err(Error::DeviceClosed);
        }
        if before & crate::availability::inflight::QUIESCED != 0 {
            return Err(Error::DeviceQuiesced);
        }
        if let Err(report) = sh.inflight.wait_empty(bound, sh.ras.instance()) {
            sh.inflight.open(crate::availability::inflight::QUIESCED);
            return Err(Error::StillInside(report));
        }
        Ok(Quiesced {
            shared: Arc::clone(sh),
        })
    }

    /// Checks the structure markers of the device and of every QP and CQ of it, and the
    /// guard words of their rings (what [`Device::close`] does); a damaged one fails the
    /// device ([`Error::MarkerDamaged`]).
    pub fn check_markers(&self) -> Result<()> {
        self.shared.check_all_markers("Device::check_markers")
    }

    /// Fault injection for RAS tests (not for applications): flips the device's `begin` or
    /// `end` marker word. The next entry point sees the damage.
    #[doc(hidden)]
    pub fn damage_marker_for_testing(&self, which: &str) -> Result<()> {
        markers::damage(&self.shared.begin, &self.shared.end, which)
    }
}

/// A quiesced device ([`Device::quiesce`]): entry points are refused until this is dropped.
#[derive(Debug)]
#[must_use = "the device is let go again when this is dropped"]
pub struct Quiesced {
    shared: Arc<DeviceShared>,
}

impl Quiesced {
    /// Ends the quiesce (as dropping does).
    pub fn end(self) {}
}

impl Drop for Quiesced {
    fn drop(&mut self) {
        self.shared
            .inflight
            .open(crate::availability::inflight::QUIESCED);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key source the STag table gets draws from the operating system (two draws agree
    /// with probability 2^-64), and a table with it hands out keys.
    #[test]
    fn the_stag_key_source_is_the_operating_systems_generator() {
        let (a, b) = (os_stag_key().unwrap(), os_stag_key().unwrap());
        assert_ne!(a, b);
        let mut mrs = MrTable::new(1, os_stag_key);
        let region = Arc::new(softwarp_engine::memory::Region::new_zeroed(64).unwrap());
        let pd = softwarp_engine::mr::PdId(1);
        let access = softwarp_engine::mr::Access::NONE;
        assert!(mrs.register(pd, region, 0, 64, None, access).is_ok());
    }

    /// Objects come and go 10 at a time among 1,000 that stay: the list never holds more
    /// than twice the live ones plus the dead not yet counted, and an insertion walks fewer
    /// than 2 entries on average (a walk at every insertion made it 1,000).
    #[test]
    fn a_weak_list_walks_a_constant_number_of_entries_per_insertion() {
        struct Obj(std::sync::Weak<WeakList<Obj>>);
        impl Drop for Obj {
            fn drop(&mut self) {
                if let Some(l) = self.0.upgrade() {
                    l.died();
                }
            }
        }
        let list = Arc::new(WeakList::default());
        let counters = crate::runtime::progress::Counters::default();
        let obj = || Arc::new(Obj(Arc::downgrade(&list)));
        let kept: Vec<Arc<Obj>> = (0..1000).map(|_| obj()).collect();
        for o in &kept {
            list.insert(o, &counters);
        }
        let before = counters.stats().qp_visits;
        const ROUNDS: usize = 1000;
        for _ in 0..ROUNDS {
            let churn: Vec<Arc<Obj>> = (0..10).map(|_| obj()).collect();
            for o in &churn {
                list.insert(o, &counters);
            }
            drop(churn);
            assert!(list.lock().len() <= 2 * 1000 + 10, "{}", list.lock().len());
        }
        let per = (counters.stats().qp_visits - before) as f64 / (10 * ROUNDS) as f64;
        // One for the insertion itself, under two for the compactions.
        assert!(per < 3.0, "{per} entries per insertion");
        assert_eq!(list.live().len(), 1000);
    }

    #[test]
    fn the_event_fd_is_readable_exactly_while_events_are_queued() {
        let q = EventQueue::new().unwrap();
        let readable =
            |q: &EventQueue| sys::poll_readable(q.fd().as_fd(), Some(Duration::ZERO)).unwrap();
        assert!(!readable(&q));
        q.push(AsyncEvent::DeviceFatal);
        q.push(AsyncEvent::DeviceFatal);
        assert!(readable(&q));
        assert!(q.take(Some(Duration::ZERO)).is_some());
        assert!(readable(&q), "one event is still queued");
        assert!(q.take(Some(Duration::ZERO)).is_some());
        assert!(!readable(&q));
        assert!(q.take(Some(Duration::ZERO)).is_none());
    }

    #[test]
    fn numbers_wrap_at_the_end_of_the_space_and_skip_the_live_ones() {
        let space = Arc::new(IdSpace::new(5));
        let mut held: Vec<IdLease> = (0..5).map(|_| IdSpace::lease(&space).unwrap()).collect();
        let ids: Vec<u32> = held.iter().map(IdLease::id).collect();
        assert_eq!(ids, [1, 2, 3, 4, 5]);
        // Every number is live: none is handed out twice.
        assert!(matches!(
            IdSpace::lease(&space),
            Err(Error::Limit { limit: 5, .. })
        ));
        // 2 and 4 go; the counter wraps and skips the live 1 and 3.
        held.remove(3);
        held.remove(1);
        let a = IdSpace::lease(&space).unwrap();
        let b = IdSpace::lease(&space).unwrap();
        assert_eq!((a.id(), b.id()), (2, 4));
        drop(a);
        // After 4 comes 5 (live), 1 (live), 2 (free again).
        assert_eq!(IdSpace::lease(&space).unwrap().id(), 2);
    }

    #[test]
    fn a_wrapped_counter_never_hands_out_a_live_number() {
        // Many more allocations than numbers, with one long-lived holder.
        let space = Arc::new(IdSpace::new(16));
        let long_lived = IdSpace::lease(&space).unwrap();
        for _ in 0..1000 {
            let l = IdSpace::lease(&space).unwrap();
            assert_ne!(l.id(), long_lived.id());
        }
    }
}
