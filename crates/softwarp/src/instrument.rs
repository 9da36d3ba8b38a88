//! What every object carries for RAS, knowing no object of the crate: its registration
//! with a resource tracker ([`Tracked`]), a device's tracker ([`DeviceRas`]), a QP's RAS
//! state ([`QpRas`]: the last state seen, the TCP_INFO sampler, the addresses and snapshot
//! of its connection), the listeners' tracker, and the start of the process's RAS
//! services ([`init`]). The RAS wiring that reads the objects (descriptions, statistics,
//! critical events, snapshots) is `crate::ras`, reached through the device's hooks.
//!
//! No I/O here except reading TCP_INFO of a QP's socket (`getsockopt`, at most once per
//! sampling interval) and starting the process-wide services ([`init`]) when the
//! application or the operator asked for them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, Once, OnceLock, Weak};
use std::time::Instant;

use softwarp_engine::qp::QpState;
use softwarp_ras::service::{self, RasService, ServiceConfig};
use softwarp_ras::stats::{TcpInfo, TcpInfoSampler};
use softwarp_ras::sw_event;
use softwarp_ras::tracker::{
    DescribeResource, ResourceDetails, ResourceHandle, ResourceKind, Tracker,
};

use crate::sync::lock;

/// Called by every `Device::open` and listener bind: applies `SOFTWARP_TRACE` to the trace
/// levels the first time (levels only: no thread, no file, no subscriber), then starts the
/// process-wide RAS services if `requested` (the application's [`RasConfig`](crate::RasConfig))
/// or `SOFTWARP_RAS=on` (with [`ServiceConfig::from_env`]) asks, unless `SOFTWARP_RAS=off`.
/// Once started they stay; later calls cost an atomic load or two. What cannot start is
/// reported by the services themselves and never stops the caller.
pub(crate) fn init(requested: Option<&ServiceConfig>) {
    static LEVELS: Once = Once::new();
    LEVELS.call_once(|| {
        if let Err(e) = softwarp_ras::trace::init_from_env() {
            sw_event!(Ras, 1, "{}: {}", softwarp_ras::trace::TRACE_ENV, e);
        }
    });
    let _ = enable(requested);
}

/// Starts the process-wide services as [`init`] decides; the running services, if any.
pub(crate) fn enable(requested: Option<&ServiceConfig>) -> Option<&'static RasService> {
    if let Some(running) = service::global() {
        return Some(running);
    }
    match (service::env_switch(), requested) {
        (Some(false), _) | (None, None) => None,
        (_, Some(config)) => Some(service::start_global(config)),
        (Some(true), None) => Some(service::start_global(&ServiceConfig::from_env())),
    }
}

/// The tracker of objects that belong to no device (listeners), named `cm`.
pub(crate) fn cm_tracker() -> &'static Tracker {
    static CM: OnceLock<Tracker> = OnceLock::new();
    CM.get_or_init(|| Tracker::new("cm"))
}

/// Details that do not change while the resource lives.
struct Fixed(ResourceDetails);

impl DescribeResource for Fixed {
    fn describe(&self) -> ResourceDetails {
        self.0.clone()
    }
}

/// One object's registration with a tracker (unregistered when dropped), with the fixed
/// details it was given.
pub(crate) struct Tracked {
    handle: ResourceHandle,
    _fixed: Option<Arc<Fixed>>,
}

impl std::fmt::Debug for Tracked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.handle.fmt(f)
    }
}

impl Tracked {
    /// Registers a resource created by the caller's caller (keep `#[track_caller]` on
    /// every function between the public constructor and this call).
    #[track_caller]
    pub(crate) fn new(tracker: &Tracker, kind: ResourceKind, id: u64, bytes: u64) -> Self {
        Self {
            handle: tracker.register(kind, id, bytes),
            _fixed: None,
        }
    }

    /// [`Tracked::new`] with details that never change.
    #[track_caller]
    pub(crate) fn with_details(
        tracker: &Tracker,
        kind: ResourceKind,
        id: u64,
        bytes: u64,
        details: ResourceDetails,
    ) -> Self {
        let handle = tracker.register(kind, id, bytes);
        let fixed = Arc::new(Fixed(details));
        handle.set_describer(Arc::downgrade(&fixed) as Weak<dyn DescribeResource>);
        Self {
            handle,
            _fixed: Some(fixed),
        }
    }

    /// Has the owner describe the resource's live state (held weakly).
    pub(crate) fn describe_with(&self, owner: Weak<dyn DescribeResource>) {
        self.handle.set_describer(owner);
    }

    /// The registration.
    pub(crate) fn handle(&self) -> &ResourceHandle {
        &self.handle
    }
}

/// Attribute map from name/value pairs.
pub(crate) fn attrs<const N: usize>(pairs: [(&str, String); N]) -> BTreeMap<String, String> {
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// Access rights as `softwarp resources` shows them (`LOCAL_WRITE|REMOTE_READ`, `NONE`).
pub(crate) fn access_text(a: softwarp_engine::mr::Access) -> String {
    use softwarp_engine::mr::Access;
    let names: Vec<&str> = [
        (Access::LOCAL_WRITE, "LOCAL_WRITE"),
        (Access::REMOTE_WRITE, "REMOTE_WRITE"),
        (Access::REMOTE_READ, "REMOTE_READ"),
        (Access::REMOTE_INVALIDATE, "REMOTE_INVALIDATE"),
        (Access::REMOTE_ATOMIC, "REMOTE_ATOMIC"),
    ]
    .into_iter()
    .filter(|(f, _)| a.contains(*f))
    .map(|(_, n)| n)
    .collect();
    if names.is_empty() {
        "NONE".to_string()
    } else {
        names.join("|")
    }
}

/// The device's part: its tracker.
///
/// Registrations live in the application's handles (`Device`, `QueuePair`,
/// `CompletionQueue` ...), not in the shared states: a destroyed QP whose connection is
/// still closing (the progress thread holds its state for up to the linger time) is no
/// longer the application's, and must not be reported as leaked.
#[derive(Debug)]
pub(crate) struct DeviceRas {
    pub(crate) tracker: Tracker,
    /// The tracker's name, shared by the device's QPs ([`QpRas::device`]).
    name: Arc<str>,
}

impl DeviceRas {
    /// Makes the device's tracker, named after the device and the open instance (`softwarp0/3` for the third `Device::open` of the process), so that
    /// the QPs, CQs and statistics of two open instances never share labels.
    pub(crate) fn new(name: &str) -> Self {
        static OPENED: AtomicU32 = AtomicU32::new(0);
        let n = OPENED.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        let name = format!("{name}/{n}");
        Self {
            name: Arc::from(name.as_str()),
            tracker: Tracker::new(name),
        }
    }

    /// [`DeviceRas::instance`], shared.
    pub(crate) fn instance_shared(&self) -> Arc<str> {
        Arc::clone(&self.name)
    }

    /// The name the device's resources, statistics and events are reported under.
    pub(crate) fn instance(&self) -> &str {
        self.tracker.name()
    }
}

pub(crate) const STATE_UNSEEN: u8 = u8::MAX;

pub(crate) fn state_code(s: QpState) -> u8 {
    match s {
        QpState::Idle => 0,
        QpState::Rts => 1,
        QpState::Closing => 2,
        QpState::Terminate => 3,
        QpState::Error => 4,
    }
}

/// The QP state's name as `softwarp resources` shows it.
pub(crate) fn state_name(s: QpState) -> &'static str {
    match s {
        QpState::Idle => "IDLE",
        QpState::Rts => "RTS",
        QpState::Closing => "CLOSING",
        QpState::Terminate => "TERMINATE",
        QpState::Error => "ERROR",
    }
}

pub(crate) fn code_name(code: u8) -> &'static str {
    match code {
        0 => "IDLE",
        1 => "RTS",
        2 => "CLOSING",
        3 => "TERMINATE",
        4 => "ERROR",
        _ => "-",
    }
}

/// A QP's fixed attributes as `softwarp resources` shows them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QpAttrs {
    pub(crate) pd: u32,
    pub(crate) send_cq: u32,
    pub(crate) recv_cq: u32,
    pub(crate) srq: Option<u32>,
    pub(crate) sq_depth: usize,
    pub(crate) rq_depth: usize,
}

impl QpAttrs {
    /// The attributes by name (`srq` is `-` without one).
    pub(crate) fn to_map(self) -> BTreeMap<String, String> {
        attrs([
            ("pd", self.pd.to_string()),
            ("send_cq", self.send_cq.to_string()),
            ("recv_cq", self.recv_cq.to_string()),
            (
                "srq",
                self.srq.map_or_else(|| "-".to_string(), |s| s.to_string()),
            ),
            ("sq_depth", self.sq_depth.to_string()),
            ("rq_depth", self.rq_depth.to_string()),
        ])
    }
}

/// A QP's RAS state, outside the QP lock's data (its own small locks, never held while
/// taking the QP lock).
#[derive(Debug)]
pub(crate) struct QpRas {
    /// The device instance's name (shared: no string per QP).
    pub(crate) device: Arc<str>,
    pub(crate) qpn: u32,
    /// The last state seen by [`QpRas::state_seen`] (a [`state_code`]).
    state: AtomicU8,
    /// Local and peer address of the current or last connection.
    pub(crate) addrs: Mutex<Option<(SocketAddr, SocketAddr)>>,
    pub(crate) tcp: Mutex<TcpInfoSampler>,
    /// Fixed attributes, kept as numbers (a map of strings per QP cost about 600 bytes)
    /// and written out by [`QpAttrs::to_map`] when `softwarp resources` asks.
    pub(crate) attrs: QpAttrs,
    /// The id of the snapshot taken for the current connection's failure (0: none yet).
    pub(crate) snapshot: AtomicU64,
}

impl QpRas {
    /// The RAS state of QP `qpn` with fixed attributes (`pd`, CQs, queue depths ...).
    pub(crate) fn new(device: Arc<str>, qpn: u32, attrs: QpAttrs) -> Self {
        sw_event!(Qp, 4, qpn = qpn, "QP created");
        Self {
            device,
            qpn,
            state: AtomicU8::new(STATE_UNSEEN),
            addrs: Mutex::new(None),
            tcp: Mutex::new(TcpInfoSampler::new(TcpInfoSampler::interval_from_env())),
            attrs,
            snapshot: AtomicU64::new(0),
        }
    }

    /// Called with the QP's current state whenever completions and events are moved (after
    /// every post and progress pass): traces a change (level 2). One relaxed load when the
    /// state did not change.
    #[inline]
    pub(crate) fn state_seen(&self, state: QpState) {
        let code = state_code(state);
        if self.state.load(Ordering::Relaxed) != code {
            self.state_changed(code, state);
        }
    }

    #[cold]
    #[inline(never)]
    fn state_changed(&self, code: u8, state: QpState) {
        let prev = self.state.swap(code, Ordering::Relaxed);
        if prev == code {
            // Another thread saw the change first and traced it.
            return;
        }
        sw_event!(
            Qp,
            2,
            qpn = self.qpn,
            device = &*self.device,
            from = code_name(prev),
            to = state_name(state),
            "QP state change"
        );
    }

    /// Samples TCP_INFO of the QP's socket if an interval has passed (progress pass and
    /// statistics). Never waits for the sampler's lock.
    pub(crate) fn sample_tcp(&self, fd: Option<BorrowedFd<'_>>) {
        let Some(fd) = fd else {
            return;
        };
        let Ok(mut sampler) = self.tcp.try_lock() else {
            return;
        };
        if let Some(Err(e)) = sampler.poll(Instant::now(), fd) {
            sw_event!(Qp, 5, qpn = self.qpn, "TCP_INFO: {}", e);
        }
    }

    pub(crate) fn last_tcp(&self) -> Option<TcpInfo> {
        lock(&self.tcp).last().copied()
    }
}

impl Drop for QpRas {
    fn drop(&mut self) {
        sw_event!(Qp, 4, qpn = self.qpn, "QP destroyed");
    }
}

/// Registers a listener bound to `local` (`#[track_caller]`: the application's `bind` or
/// `listen` line).
#[track_caller]
pub(crate) fn listener(local: Option<SocketAddr>) -> Tracked {
    init(None);
    let port = local.map_or(0, |a| a.port());
    sw_event!(Cm, 4, port, "listener bound");
    Tracked::with_details(
        cm_tracker(),
        ResourceKind::Listener,
        u64::from(port),
        std::mem::size_of::<std::net::TcpListener>() as u64,
        ResourceDetails {
            state: Some("LISTEN".into()),
            local_addr: local,
            ..ResourceDetails::default()
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_rights_are_named() {
        use softwarp_engine::mr::Access;
        assert_eq!(access_text(Access::NONE), "NONE");
        assert_eq!(
            access_text(Access::LOCAL_WRITE | Access::REMOTE_READ),
            "LOCAL_WRITE|REMOTE_READ"
        );
    }

    #[test]
    fn state_codes_and_names_agree() {
        for s in [
            QpState::Idle,
            QpState::Rts,
            QpState::Closing,
            QpState::Terminate,
            QpState::Error,
        ] {
            assert_eq!(code_name(state_code(s)), state_name(s));
        }
        assert_eq!(code_name(STATE_UNSEEN), "-");
    }
}
