//! The resource tracker: who created every device, PD, MR, MW, CQ, QP, SRQ and listener,
//! where in their source (`#[track_caller]`), when, on which thread, how much memory it
//! holds, and what state it is in now. A [`Tracker`] per device; a [`ResourceHandle`] per
//! object that unregisters on drop; a [`LeakReport`] of what is still registered when the
//! device closes. No I/O here.
//!
//! Objects made through a foreign-language interface (the C ABI of `softwarp-verbs`) were
//! created by a line the `#[track_caller]` chain cannot see: the C entry point records the
//! C caller's code address, resolved as text, with [`with_caller`]; it is listed as
//! [`ResourceInfo::caller`] beside the Rust location.
//!
//! Every live tracker of the process is reachable through [`all_trackers`], so the control
//! socket lists resources without the verbs layer doing more than holding its handles.
//!
//! Locking: the tracker's lock is never held while an owner's [`DescribeResource`] runs, so
//! an owner may hold its own lock while registering, dropping or updating a handle.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::panic::Location;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::cell::Cell;

use crate::{clock, sys};

/// What kind of object a resource is (the tables of `rdma resource show`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResourceKind {
    /// An open device.
    Device,
    /// A protection domain.
    Pd,
    /// A memory region.
    Mr,
    /// A memory window.
    Mw,
    /// A completion queue.
    Cq,
    /// A queue pair.
    Qp,
    /// A shared receive queue.
    Srq,
    /// A connection listener.
    Listener,
    /// A connection manager id (`struct rdma_cm_id` of the C library), with or without a QP.
    #[serde(rename = "cm_id")]
    CmId,
}

impl ResourceKind {
    /// Every kind, in a fixed order.
    pub const ALL: [ResourceKind; 9] = [
        ResourceKind::Device,
        ResourceKind::Pd,
        ResourceKind::Mr,
        ResourceKind::Mw,
        ResourceKind::Cq,
        ResourceKind::Qp,
        ResourceKind::Srq,
        ResourceKind::Listener,
        ResourceKind::CmId,
    ];

    /// The kind's name (`qp`, `mr`, ...).
    pub const fn as_str(self) -> &'static str {
        match self {
            ResourceKind::Device => "device",
            ResourceKind::Pd => "pd",
            ResourceKind::Mr => "mr",
            ResourceKind::Mw => "mw",
            ResourceKind::Cq => "cq",
            ResourceKind::Qp => "qp",
            ResourceKind::Srq => "srq",
            ResourceKind::Listener => "listener",
            ResourceKind::CmId => "cm_id",
        }
    }
}

impl fmt::Display for ResourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The text is not a resource kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown resource kind {0:?} (device, pd, mr, mw, cq, qp, srq, listener, cm_id)")]
pub struct UnknownKind(pub String);

impl FromStr for ResourceKind {
    type Err = UnknownKind;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ResourceKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| UnknownKind(s.to_string()))
    }
}

/// Which resources a listing carries (the control socket's `resources` request).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResourceFilter {
    /// Only of this kind.
    pub kind: Option<ResourceKind>,
    /// Only with this id (QP number, CQ id, STag ...).
    pub id: Option<u64>,
    /// When more than this many match, only the counts per kind are listed.
    pub max: Option<usize>,
}

impl ResourceFilter {
    /// Whether a resource of `kind` and `id` passes the kind and id filters.
    pub fn matches(&self, kind: ResourceKind, id: u64) -> bool {
        self.kind.is_none_or(|k| k == kind) && self.id.is_none_or(|i| i == id)
    }
}

/// Live details an owner reports about its resource (state, addresses, anything else).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ResourceDetails {
    /// The object's state (`RTS`, `ERROR`, `listening` ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// Local address of its connection or listener.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_addr: Option<SocketAddr>,
    /// Peer address of its connection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_addr: Option<SocketAddr>,
    /// Anything else, by name (`pd`, `send_cq`, `stag`, `cqe` ...).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attrs: BTreeMap<String, String>,
    /// The object's structure markers as found when it was described (its begin and end
    /// words, the guard words of its rings); see [`crate::markers`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub markers: Vec<crate::markers::MarkerWord>,
}

/// Implemented by the owner of a resource to report live details on demand (when resources
/// are listed or a leak is reported). Called without any tracker lock held.
pub trait DescribeResource: Send + Sync {
    /// The resource's current details.
    fn describe(&self) -> ResourceDetails;
}

/// One registered resource, as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceInfo {
    /// The tracker (device) it belongs to.
    pub tracker: String,
    /// Its kind.
    pub kind: ResourceKind,
    /// Its number within the kind (QP number, PD id, STag, CQ id ...).
    pub id: u64,
    /// Owner process id.
    pub pid: u32,
    /// Owner process name.
    pub process: String,
    /// Name of the thread that created it.
    pub thread: String,
    /// Kernel id of the thread that created it.
    pub tid: u32,
    /// Source file of the creating call.
    pub file: Cow<'static, str>,
    /// Source line of the creating call.
    pub line: u32,
    /// Source column of the creating call.
    pub column: u32,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// Creation time, RFC 3339 UTC.
    pub created: String,
    /// The foreign (C) code that created it, when it was made through a foreign-language
    /// interface ([`with_caller`]): e.g. `/usr/bin/rping(+0x3a2f)` or `./app(make_qp+0x2b)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caller: Option<String>,
    /// Approximate memory it holds, in bytes.
    pub bytes: u64,
    /// Live details from its owner, if it attached a [`DescribeResource`] that is still
    /// alive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<ResourceDetails>,
}

impl ResourceInfo {
    /// The creating call: the foreign caller if there is one, else `file:line:column`.
    pub fn location(&self) -> String {
        match &self.caller {
            Some(c) => c.clone(),
            None => format!("{}:{}:{}", self.file, self.line, self.column),
        }
    }
}

/// A foreign (C) caller's code address and how to turn it into text (e.g. with `dladdr`),
/// which happens only when a resource is registered.
#[derive(Debug, Clone, Copy)]
pub struct ForeignCaller {
    /// The return address into the caller.
    pub addr: usize,
    /// Resolves `addr` (e.g. to `./app(make_qp+0x2b)`).
    pub resolve: fn(usize) -> String,
}

/// This thread's name, once per thread.
fn thread_name() -> Arc<str> {
    thread_local! {
        static NAME: Arc<str> = Arc::from(sys::thread_name());
    }
    NAME.with(Arc::clone)
}

thread_local! {
    /// The foreign caller [`with_caller`] set on this thread.
    static FOREIGN_CALLER: Cell<Option<ForeignCaller>> = const { Cell::new(None) };
}

/// Runs `f` with `caller` recorded as the creator of every resource registered on this
/// thread meanwhile, in addition to the Rust location. Costs two thread-local stores when
/// nothing is registered. Nested calls restore the outer caller when they return (or
/// unwind).
pub fn with_caller<R>(caller: ForeignCaller, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<ForeignCaller>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FOREIGN_CALLER.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(FOREIGN_CALLER.with(|c| c.replace(Some(caller))));
    f()
}

fn foreign_caller() -> Option<Arc<str>> {
    FOREIGN_CALLER
        .with(Cell::get)
        .map(|c| Arc::from((c.resolve)(c.addr)))
}

/// Count and memory of one kind of resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KindUsage {
    /// Registered resources of the kind.
    pub count: u64,
    /// Their approximate memory, in bytes.
    pub bytes: u64,
}

/// Memory per resource table of one tracker.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MemoryUsage {
    /// The tracker.
    pub tracker: String,
    /// Per kind (kinds with no resource are left out).
    pub kinds: BTreeMap<ResourceKind, KindUsage>,
    /// Sum over the kinds, in bytes.
    pub total_bytes: u64,
}

struct Entry {
    kind: ResourceKind,
    id: u64,
    /// Shared by the thread's records (`thread_name`): a record of the many a thread
    /// creates holds no string of its own.
    thread: Arc<str>,
    tid: u32,
    location: &'static Location<'static>,
    caller: Option<Arc<str>>,
    created: SystemTime,
    bytes: u64,
    describer: Option<Weak<dyn DescribeResource>>,
}

struct State {
    entries: BTreeMap<u64, Entry>,
    usage: BTreeMap<ResourceKind, KindUsage>,
}

struct Inner {
    name: String,
    next_key: AtomicU64,
    state: Mutex<State>,
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tracker")
            .field("name", &self.name)
            .field("resources", &self.state().entries.len())
            .finish()
    }
}

/// A registry of resources (one per device). Cloning gives another handle to the same
/// registry.
#[derive(Debug, Clone)]
pub struct Tracker {
    inner: Arc<Inner>,
}

static TRACKERS: Mutex<Vec<Weak<Inner>>> = Mutex::new(Vec::new());

fn trackers() -> MutexGuard<'static, Vec<Weak<Inner>>> {
    TRACKERS.lock().unwrap_or_else(|e| e.into_inner())
}

impl Tracker {
    /// An empty tracker called `name` (the device name, e.g. `softwarp0`), listed by
    /// [`all_trackers`] while it lives.
    pub fn new(name: impl Into<String>) -> Self {
        let inner = Arc::new(Inner {
            name: name.into(),
            next_key: AtomicU64::new(1),
            state: Mutex::new(State {
                entries: BTreeMap::new(),
                usage: BTreeMap::new(),
            }),
        });
        let mut all = trackers();
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&inner));
        Self { inner }
    }

    /// The tracker's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Registers a resource created by the caller's caller: pass `#[track_caller]` through
    /// the verbs entry points so the location is the application's line, not the stack's.
    /// `bytes` is its approximate memory. The returned handle unregisters it on drop.
    #[track_caller]
    pub fn register(&self, kind: ResourceKind, id: u64, bytes: u64) -> ResourceHandle {
        let location = Location::caller();
        let key = self.inner.next_key.fetch_add(1, Ordering::Relaxed);
        let entry = Entry {
            kind,
            id,
            thread: thread_name(),
            tid: sys::tid(),
            location,
            caller: foreign_caller(),
            created: SystemTime::now(),
            bytes,
            describer: None,
        };
        let mut st = self.inner.state();
        let u = st.usage.entry(kind).or_default();
        u.count += 1;
        u.bytes = u.bytes.saturating_add(bytes);
        st.entries.insert(key, entry);
        drop(st);
        crate::sw_event!(
            Ras,
            5,
            kind = kind.as_str(),
            id,
            bytes,
            "registered at {}:{}",
            location.file(),
            location.line()
        );
        ResourceHandle {
            tracker: Arc::clone(&self.inner),
            key,
            kind,
            id,
            location,
        }
    }

    /// Every registered resource, oldest first, with live details from owners that attached
    /// a [`DescribeResource`].
    pub fn resources(&self) -> Vec<ResourceInfo> {
        self.collect(|_, _| true)
    }

    /// The registered resources of `filter`'s kind and id (its `max` is the caller's), oldest
    /// first; only these are copied and described.
    pub fn select(&self, filter: &ResourceFilter) -> Vec<ResourceInfo> {
        self.collect(|_, e| filter.matches(e.kind, e.id))
    }

    /// How many registered resources are of `filter`'s kind and id (without an id, from the
    /// counts per kind: no walk).
    pub fn count(&self, filter: &ResourceFilter) -> u64 {
        let st = self.inner.state();
        match (filter.id, filter.kind) {
            (None, None) => st.entries.len() as u64,
            (None, Some(kind)) => st.usage.get(&kind).map_or(0, |u| u.count),
            (Some(_), _) => st
                .entries
                .values()
                .filter(|e| filter.matches(e.kind, e.id))
                .count() as u64,
        }
    }

    fn collect(&self, keep: impl Fn(u64, &Entry) -> bool) -> Vec<ResourceInfo> {
        // Copy under the lock, describe without it.
        let st = self.inner.state();
        let copied: Vec<(ResourceInfo, Option<Weak<dyn DescribeResource>>)> = st
            .entries
            .iter()
            .filter(|(k, e)| keep(**k, e))
            .map(|(_, e)| (self.info(e), e.describer.clone()))
            .collect();
        drop(st);
        copied
            .into_iter()
            .map(|(mut info, d)| {
                info.details = d.as_ref().and_then(Weak::upgrade).map(|d| d.describe());
                info
            })
            .collect()
    }

    fn info(&self, e: &Entry) -> ResourceInfo {
        ResourceInfo {
            tracker: self.inner.name.clone(),
            kind: e.kind,
            id: e.id,
            pid: sys::pid(),
            process: sys::process_name().to_string(),
            thread: e.thread.to_string(),
            tid: e.tid,
            file: Cow::Borrowed(e.location.file()),
            line: e.location.line(),
            column: e.location.column(),
            created_unix_ms: clock::unix_ms(e.created),
            created: clock::rfc3339(e.created),
            caller: e.caller.as_deref().map(str::to_string),
            bytes: e.bytes,
            details: None,
        }
    }

    /// Registered resources.
    pub fn len(&self) -> usize {
        self.inner.state().entries.len()
    }

    /// Whether nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Count and memory per kind.
    pub fn memory(&self) -> MemoryUsage {
        let st = self.inner.state();
        let kinds: BTreeMap<_, _> = st
            .usage
            .iter()
            .filter(|(_, u)| u.count > 0)
            .map(|(k, u)| (*k, *u))
            .collect();
        MemoryUsage {
            tracker: self.inner.name.clone(),
            total_bytes: kinds.values().fold(0u64, |a, u| a.saturating_add(u.bytes)),
            kinds,
        }
    }

    /// What is still registered, for the device's close. `except` leaves out the handle of
    /// the device itself (it is being closed, so it is not a leak).
    pub fn leak_report(&self, except: Option<&ResourceHandle>) -> LeakReport {
        let except = except.map(|h| h.key);
        let leaked = self.collect(|k, _| Some(k) != except);
        LeakReport {
            tracker: self.inner.name.clone(),
            pid: sys::pid(),
            process: sys::process_name().to_string(),
            leaked,
        }
    }
}

/// Every live tracker of the process.
pub fn all_trackers() -> Vec<Tracker> {
    let mut all = trackers();
    all.retain(|w| w.strong_count() > 0);
    all.iter()
        .filter_map(Weak::upgrade)
        .map(|inner| Tracker { inner })
        .collect()
}

/// Every resource of every live tracker of the process.
pub fn all_resources() -> Vec<ResourceInfo> {
    all_trackers().iter().flat_map(Tracker::resources).collect()
}

/// Registration of one resource; unregisters it when dropped. Keep it inside the object
/// (e.g. in the `Arc`-shared state of a QP) so it lives exactly as long as the resource.
pub struct ResourceHandle {
    tracker: Arc<Inner>,
    key: u64,
    kind: ResourceKind,
    id: u64,
    location: &'static Location<'static>,
}

impl fmt::Debug for ResourceHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResourceHandle")
            .field("tracker", &self.tracker.name)
            .field("kind", &self.kind)
            .field("id", &self.id)
            .field("location", &self.location)
            .finish()
    }
}

impl ResourceHandle {
    /// The resource's kind.
    pub fn kind(&self) -> ResourceKind {
        self.kind
    }

    /// The resource's id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Where it was created.
    pub fn location(&self) -> &'static Location<'static> {
        self.location
    }

    /// Updates its approximate memory (e.g. after a resize).
    pub fn set_bytes(&self, bytes: u64) {
        let mut st = self.tracker.state();
        let State { entries, usage } = &mut *st;
        if let Some(e) = entries.get_mut(&self.key) {
            let u = usage.entry(e.kind).or_default();
            u.bytes = u.bytes.saturating_sub(e.bytes).saturating_add(bytes);
            e.bytes = bytes;
        }
    }

    /// Attaches the owner's live details (held weakly: the tracker never keeps the owner
    /// alive, and a dead owner just has no details).
    pub fn set_describer(&self, describer: Weak<dyn DescribeResource>) {
        if let Some(e) = self.tracker.state().entries.get_mut(&self.key) {
            e.describer = Some(describer);
        }
    }
}

impl Drop for ResourceHandle {
    fn drop(&mut self) {
        let mut st = self.tracker.state();
        if let Some(e) = st.entries.remove(&self.key) {
            let u = st.usage.entry(e.kind).or_default();
            u.count = u.count.saturating_sub(1);
            u.bytes = u.bytes.saturating_sub(e.bytes);
        }
    }
}

/// Resources still registered when their device closed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeakReport {
    /// The tracker (device).
    pub tracker: String,
    /// The process.
    pub pid: u32,
    /// The process's name.
    pub process: String,
    /// What was not released, oldest first.
    pub leaked: Vec<ResourceInfo>,
}

impl LeakReport {
    /// Whether nothing leaked.
    pub fn is_empty(&self) -> bool {
        self.leaked.is_empty()
    }
}

impl fmt::Display for LeakReport {
    /// One header line, then one line per leaked resource with its `file:line:column`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.leaked.is_empty() {
            return write!(f, "{}: no leaked resources", self.tracker);
        }
        write!(
            f,
            "{}: {} resource(s) still allocated at close by pid {} ({}):",
            self.tracker,
            self.leaked.len(),
            self.pid,
            self.process
        )?;
        for r in &self.leaked {
            write!(
                f,
                "\n  {} {} ({} bytes) created at {} by thread {} (tid {}) at {}",
                r.kind,
                r.id,
                r.bytes,
                r.location(),
                r.thread,
                r.tid,
                r.created
            )?;
            if let Some(state) = r.details.as_ref().and_then(|d| d.state.as_deref()) {
                write!(f, ", state {state}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Qp {
        state: Mutex<&'static str>,
    }

    impl DescribeResource for Qp {
        fn describe(&self) -> ResourceDetails {
            ResourceDetails {
                state: Some(self.state.lock().unwrap().to_string()),
                peer_addr: "192.0.2.1:4791".parse().ok(),
                ..ResourceDetails::default()
            }
        }
    }

    #[test]
    fn a_resource_is_listed_until_its_handle_drops() {
        let t = Tracker::new("unit-list");
        let h = t.register(ResourceKind::Qp, 7, 4096);
        let list = t.resources();
        assert_eq!(list.len(), 1);
        assert_eq!(
            (list[0].kind, list[0].id, list[0].bytes),
            (ResourceKind::Qp, 7, 4096)
        );
        assert_eq!(list[0].pid, std::process::id());
        assert_eq!(list[0].file, file!());
        drop(h);
        assert!(t.is_empty());
    }

    #[test]
    fn a_filtered_listing_copies_and_describes_only_what_matches() {
        struct Counted(AtomicU64);
        impl DescribeResource for Counted {
            fn describe(&self) -> ResourceDetails {
                self.0.fetch_add(1, Ordering::Relaxed);
                ResourceDetails::default()
            }
        }
        let t = Tracker::new("unit-filter");
        let described: Arc<Counted> = Arc::new(Counted(AtomicU64::new(0)));
        let weak: Weak<dyn DescribeResource> = {
            let d: Arc<dyn DescribeResource> = described.clone();
            Arc::downgrade(&d)
        };
        let mut handles = vec![t.register(ResourceKind::Pd, 1, 0)];
        for qpn in 0..2_000u64 {
            let h = t.register(ResourceKind::Qp, qpn, 0);
            h.set_describer(weak.clone());
            handles.push(h);
        }
        let pds = ResourceFilter {
            kind: Some(ResourceKind::Pd),
            ..ResourceFilter::default()
        };
        assert_eq!(t.count(&pds), 1);
        assert_eq!(t.select(&pds).len(), 1);
        let one = ResourceFilter {
            kind: Some(ResourceKind::Qp),
            id: Some(1234),
            max: None,
        };
        assert_eq!(t.count(&one), 1);
        let got = t.select(&one);
        assert_eq!((got.len(), got[0].id), (1, 1234));
        // Only the one QP asked for was described, not the 2,000.
        assert_eq!(described.0.load(Ordering::Relaxed), 1);
        assert_eq!(t.count(&ResourceFilter::default()), 2_001);
        drop(handles);
    }

    #[test]
    fn a_foreign_caller_is_recorded_only_inside_with_caller() {
        let t = Tracker::new("unit-caller");
        let plain = t.register(ResourceKind::Pd, 1, 0);
        let caller = |addr| ForeignCaller {
            addr,
            resolve: |a| {
                if a == 0x2b {
                    "./app(make_qp+0x2b)".to_string()
                } else {
                    format!("./app(+{a:#x})")
                }
            },
        };
        let (outer, inner, after) = with_caller(caller(0x2b), || {
            let outer = t.register(ResourceKind::Qp, 2, 0);
            let inner = with_caller(caller(0x10), || t.register(ResourceKind::Cq, 3, 0));
            let after = t.register(ResourceKind::Mr, 4, 0);
            (outer, inner, after)
        });
        let last = t.register(ResourceKind::Srq, 5, 0);
        let by_id = |id| t.resources().into_iter().find(|r| r.id == id).unwrap();
        assert_eq!(by_id(1).caller, None);
        assert_eq!(by_id(2).caller.as_deref(), Some("./app(make_qp+0x2b)"));
        assert_eq!(by_id(3).caller.as_deref(), Some("./app(+0x10)"));
        assert_eq!(by_id(4).caller.as_deref(), Some("./app(make_qp+0x2b)"));
        assert_eq!(by_id(5).caller, None);
        assert_eq!(by_id(2).location(), "./app(make_qp+0x2b)");
        assert!(by_id(1).location().starts_with(file!()));
        let json = serde_json::to_string(&by_id(1)).unwrap();
        assert!(!json.contains("\"caller\""), "{json}");
        drop((plain, outer, inner, after, last));
    }

    #[test]
    fn memory_is_accounted_per_kind_and_follows_resizes_and_drops() {
        let t = Tracker::new("unit-mem");
        let a = t.register(ResourceKind::Mr, 1, 1 << 20);
        let b = t.register(ResourceKind::Mr, 2, 4096);
        let c = t.register(ResourceKind::Cq, 1, 512);
        let m = t.memory();
        assert_eq!(
            m.kinds[&ResourceKind::Mr],
            KindUsage {
                count: 2,
                bytes: (1 << 20) + 4096
            }
        );
        assert_eq!(
            m.kinds[&ResourceKind::Cq],
            KindUsage {
                count: 1,
                bytes: 512
            }
        );
        assert_eq!(m.total_bytes, (1 << 20) + 4096 + 512);
        c.set_bytes(2048);
        drop(a);
        let m = t.memory();
        assert_eq!(
            m.kinds[&ResourceKind::Mr],
            KindUsage {
                count: 1,
                bytes: 4096
            }
        );
        assert_eq!(m.kinds[&ResourceKind::Cq].bytes, 2048);
        drop((b, c));
        assert_eq!(t.memory().kinds.len(), 0);
        assert_eq!(t.memory().total_bytes, 0);
    }

    #[test]
    fn live_details_come_from_the_owner_while_it_lives() {
        let t = Tracker::new("unit-details");
        let qp = Arc::new(Qp {
            state: Mutex::new("RTS"),
        });
        let h = t.register(ResourceKind::Qp, 3, 0);
        let weak: Weak<dyn DescribeResource> = Arc::downgrade(&qp) as Weak<dyn DescribeResource>;
        h.set_describer(weak);
        let d = t.resources()[0].details.clone().unwrap();
        assert_eq!(d.state.as_deref(), Some("RTS"));
        assert_eq!(d.peer_addr, "192.0.2.1:4791".parse().ok());
        *qp.state.lock().unwrap() = "ERROR";
        assert_eq!(
            t.resources()[0].details.as_ref().unwrap().state.as_deref(),
            Some("ERROR")
        );
        drop(qp);
        assert_eq!(t.resources()[0].details, None);
    }

    #[test]
    fn a_describer_may_use_the_tracker_without_deadlock() {
        struct Nosy(Tracker);
        impl DescribeResource for Nosy {
            fn describe(&self) -> ResourceDetails {
                let mut d = ResourceDetails::default();
                d.attrs.insert("peers".into(), self.0.len().to_string());
                d
            }
        }
        let t = Tracker::new("unit-nosy");
        let n = Arc::new(Nosy(t.clone()));
        let h = t.register(ResourceKind::Listener, 1, 0);
        h.set_describer(Arc::downgrade(&n) as Weak<dyn DescribeResource>);
        assert_eq!(
            t.resources()[0].details.as_ref().unwrap().attrs["peers"],
            "1"
        );
    }

    #[test]
    fn the_leak_report_leaves_out_the_closing_device() {
        let t = Tracker::new("unit-leak");
        let dev = t.register(ResourceKind::Device, 0, 0);
        let _pd = t.register(ResourceKind::Pd, 1, 64);
        let report = t.leak_report(Some(&dev));
        assert_eq!(report.leaked.len(), 1);
        assert_eq!(report.leaked[0].kind, ResourceKind::Pd);
        let text = report.to_string();
        assert!(text.contains("1 resource(s) still allocated"), "{text}");
        assert!(text.contains("pd 1 (64 bytes) created at "), "{text}");
        assert!(Tracker::new("empty").leak_report(None).is_empty());
    }

    #[test]
    fn kinds_parse_from_their_names() {
        for k in ResourceKind::ALL {
            assert_eq!(k.as_str().parse::<ResourceKind>(), Ok(k));
        }
        assert!("disk".parse::<ResourceKind>().is_err());
    }

    #[test]
    fn live_trackers_are_listed_and_dead_ones_are_not() {
        let t = Tracker::new("unit-all-live");
        let _h = t.register(ResourceKind::Srq, 9, 1);
        assert!(all_trackers().iter().any(|x| x.name() == "unit-all-live"));
        assert!(all_resources()
            .iter()
            .any(|r| r.tracker == "unit-all-live" && r.id == 9));
        drop(_h);
        drop(t);
        assert!(!all_trackers().iter().any(|x| x.name() == "unit-all-live"));
    }
}
