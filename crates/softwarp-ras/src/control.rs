//! The control socket: a Unix stream socket per process, one JSON request per line, one
//! JSON reply per line, served by a small thread; and the client the CLI uses to ask one or
//! every registered process.
//!
//! Requests (`op` names the request):
//!
//! | request | reply `result` |
//! | --- | --- |
//! | `{"op":"info"}` | [`ProcessInfo`] |
//! | `{"op":"resources"}` (optional `"kind"`, `"id"`, `"max"`) | [`ResourcesResult`]: the tracked resources of that kind and id (all by default), or only their counts when more than `max` match; memory and counts per table |
//! | `{"op":"stats"}` (optional `"detail"`: `"all"` or `{"qps":[N]}`) | [`StatsSnapshot`]: the per-object series of the [`Detail`] |
//! | `{"op":"trace-get"}` | [`TraceLevels`] |
//! | `{"op":"trace-set","spec":"qp=5,qpn:7=9"}` | [`TraceLevels`] after the change |
//! | `{"op":"flight-recorder","tail":100}` (or `"after":<seq>`) | [`FlightRecorderDump`] |
//! | `{"op":"snapshots"}` (optional `"qpn"`, `"device"`, `"id"`) | [`SnapshotsResult`] |
//! | `{"op":"dump"}` (optional `"reason"`) | [`DumpResult`]: a [component dump](crate::dump) |
//! | `{"op":"fault-status"}` | [`FaultStatusResult`]: state, fault, recovery and holders of every device |
//! | `{"op":"fault-inject"}` (optional `"device"`, `"kind"`) | [`FaultStatusResult`] of the failed devices |
//!
//! Every reply is `{"ok":true,"pid":..,"process":..,"result":..}` or
//! `{"ok":false,"pid":..,"process":..,"error":"..."}`, one line. The result is serialized
//! straight into the line ([`answer`]), with no tree of `serde_json::Value`s in between.
//!
//! What each request returns comes from a [`ControlHandler`]; its default methods serve the
//! process-wide tracker, statistics sources, trace levels and flight recorder, so a handler
//! usually overrides nothing.
//!
//! Who may ask: the socket file is `0600` in a `0700` runtime directory, and every accepted
//! connection's `SO_PEERCRED` is checked as well (a socket file made accessible by mistake,
//! or a descriptor passed on, does not let another user in): only a process of the owning
//! user (the server's effective uid) or of root is served. Any other gets one error reply
//! (`permission denied: ...`), is disconnected before a request is read, and is reported
//! to the [error log](crate::errlog) as `control_refused` (at most one line per second; the
//! next line counts the refusals in between). That covers every request, trace changes and
//! dumps included.
//!
//! Bounds: a request line is at most 64 KiB; a connection idle for 60 s is closed; at most 8
//! connections are served at once; the server thread notices shutdown within 100 ms.
//!
//! The client side trusts no path a registry entry names: [`connect_entry`] connects only
//! to the registry's own socket file of the entry's pid (opened without following links,
//! owned by the entry's uid) and only keeps a connection whose listening process
//! (`SO_PEERCRED`) is the entry's pid and uid; every connect is bounded (`SO_SNDTIMEO`, or
//! non-blocking), and [`ask_concurrently`] asks many processes at once within a deadline.

use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::deadline::Deadline;
use crate::errlog::{self, CriticalEvent, CriticalKind};
use crate::registry::{HostRegistry, ProcessEntry};
use crate::snapshot::{self, SnapshotFilter, SnapshotsResult};
use crate::stats::{self, Detail, StatsSnapshot};
use crate::trace::{self, FlightRecorderDump, TraceLevels};
use crate::tracker::{self, MemoryUsage, ResourceFilter, ResourceInfo, ResourceKind};
use crate::{clock, sys};

/// Longest request line the server reads, in bytes.
pub const MAX_REQUEST_LINE: usize = 64 * 1024;
/// Longest reply line the client reads, in bytes.
pub const MAX_REPLY_LINE: usize = 64 * 1024 * 1024;
/// Most connections served at once.
pub const MAX_CONNECTIONS: usize = 8;
/// A connection with no request for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Most flight recorder records one reply carries.
pub const MAX_RECORDS_PER_REPLY: usize = 16 * 1024;

const POLL: Duration = Duration::from_millis(100);
/// At most one `control_refused` error-log line per this interval.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// A request to a process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    /// Who are you?
    Info,
    /// Tracked resources.
    Resources {
        /// Only of this kind.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kind: Option<ResourceKind>,
        /// Only with this id (QP number, CQ id, STag ...).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<u64>,
        /// When more than this many match, only the counts per kind (in `memory`) and the
        /// number left out (`omitted`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max: Option<usize>,
    },
    /// The statistics.
    Stats {
        /// Which per-object series (default: [`Detail::Auto`]).
        #[serde(default, skip_serializing_if = "Detail::is_auto")]
        detail: Detail,
    },
    /// The trace levels.
    TraceGet,
    /// Change trace levels (a [`TraceSpec`](crate::trace::TraceSpec) text).
    TraceSet {
        /// The spec, e.g. `qp=5,qpn:7=9`.
        spec: String,
    },
    /// Records of the flight recorder.
    FlightRecorder {
        /// Only the newest this many.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tail: Option<usize>,
        /// Only records after this sequence number (to follow the recorder).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        after: Option<u64>,
    },
    /// QP snapshots.
    Snapshots {
        /// Only of this QP number.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        qpn: Option<u32>,
        /// Only of this device instance.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device: Option<String>,
        /// Only this snapshot.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<u64>,
    },
    /// Injects a device fault (containment and, when configured, recovery follow).
    FaultInject {
        /// Only this device instance (`softwarp0/1`) or name (`softwarp0`); all when absent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device: Option<String>,
        /// The kind of fault (default `injected`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kind: Option<String>,
    },
    /// The state, fault, recovery and holders of every device.
    FaultStatus,
    /// A component dump of the whole process.
    Dump {
        /// Why (goes into the dump; default `on demand`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
}

impl Request {
    /// `resources` with no filter and no limit: every resource.
    pub fn all_resources() -> Self {
        Request::Resources {
            kind: None,
            id: None,
            max: None,
        }
    }

    /// `stats` with [`Detail::Auto`].
    pub fn stats() -> Self {
        Request::Stats {
            detail: Detail::Auto,
        }
    }
}

/// The `dump` result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DumpResult {
    /// The dump (its format is text: see [`crate::dump`]).
    pub dump: String,
}

/// A reply from a process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    /// Whether the request succeeded.
    pub ok: bool,
    /// The replying process.
    pub pid: u32,
    /// Its name.
    pub process: String,
    /// The result (see the [module docs](self) per request); `null` on error.
    #[serde(default)]
    pub result: serde_json::Value,
    /// What went wrong.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Reply {
    fn err(error: impl Into<String>) -> Self {
        Self {
            ok: false,
            pid: sys::pid(),
            process: sys::process_name().to_string(),
            result: serde_json::Value::Null,
            error: Some(error.into()),
        }
    }

    /// The result as `T` (e.g. [`ResourcesResult`] for a `resources` request), or the
    /// process's error.
    pub fn into_result<T: DeserializeOwned>(self) -> Result<T, ClientError> {
        if !self.ok {
            return Err(ClientError::Remote(
                self.error.unwrap_or_else(|| "unspecified error".into()),
            ));
        }
        serde_json::from_value(self.result).map_err(|e| ClientError::Protocol(e.to_string()))
    }
}

/// The `info` result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfo {
    /// Process id.
    pub pid: u32,
    /// Process name.
    pub name: String,
    /// Softwarp version.
    pub version: String,
    /// The process's time when it answered, RFC 3339 UTC (to compare clocks).
    pub now: String,
}

/// The `resources` result.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ResourcesResult {
    /// The resources asked for.
    pub resources: Vec<ResourceInfo>,
    /// Memory and count per table, per tracker (device), whatever the filter.
    pub memory: Vec<MemoryUsage>,
    /// Resources that matched but are not listed (more than the request's `max`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub omitted: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl ResourcesResult {
    /// The resources of `trackers` that `filter` selects: all listed, or none (only
    /// `omitted` counted) when more than its `max` match; memory of every tracker.
    pub fn of(trackers: &[tracker::Tracker], filter: &ResourceFilter) -> Self {
        let memory = trackers.iter().map(tracker::Tracker::memory).collect();
        let matching: u64 = trackers.iter().map(|t| t.count(filter)).sum();
        if filter.max.is_some_and(|max| matching > max as u64) {
            return Self {
                resources: Vec::new(),
                memory,
                omitted: matching,
            };
        }
        Self {
            resources: trackers.iter().flat_map(|t| t.select(filter)).collect(),
            memory,
            omitted: 0,
        }
    }
}

/// The `fault-status` and `fault-inject` result.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FaultStatusResult {
    /// Every device (for `fault-inject`: the ones that were failed).
    pub devices: Vec<crate::health::DeviceHealthReport>,
}

/// What a process answers; the `softwarp` crate implements it (usually overriding nothing
/// or only [`ControlHandler::stats`]). Methods run on the control thread, one request at a
/// time per connection; they must not block for long.
pub trait ControlHandler: Send + Sync + 'static {
    /// The resources `filter` selects, and memory per table. Default: of every live
    /// [`tracker::Tracker`] ([`ResourcesResult::of`]).
    fn resources(&self, filter: &ResourceFilter) -> ResourcesResult {
        ResourcesResult::of(&tracker::all_trackers(), filter)
    }

    /// The statistics, with the per-object series of `detail`. Default: every source given
    /// to [`stats::register_source`].
    fn stats(&self, detail: &Detail) -> StatsSnapshot {
        stats::collect(detail)
    }

    /// The trace levels. Default: the process-wide [`trace::control`].
    fn trace_get(&self) -> TraceLevels {
        trace::control().levels()
    }

    /// Changes trace levels; returns them after the change. Default: applies `spec` to the
    /// process-wide [`trace::control`].
    fn trace_set(&self, spec: &str) -> Result<TraceLevels, String> {
        trace::control()
            .apply_str(spec)
            .map_err(|e| e.to_string())?;
        crate::sw_event!(
            Ras,
            2,
            "trace levels set to {:?} over the control socket",
            spec
        );
        Ok(trace::control().levels())
    }

    /// Flight recorder records. Default: the process-wide [`trace::flight_recorder`].
    fn flight_recorder(&self, tail: Option<usize>, after: Option<u64>) -> FlightRecorderDump {
        trace::flight_recorder().dump(tail, after)
    }

    /// Device health. Default: every device given to [`crate::health::register_target`].
    fn fault_status(&self) -> FaultStatusResult {
        FaultStatusResult {
            devices: crate::health::status_all(),
        }
    }

    /// Injects a fault. Default: [`crate::health::inject_all`].
    fn fault_inject(
        &self,
        device: Option<&str>,
        kind: Option<&str>,
    ) -> Result<FaultStatusResult, String> {
        crate::sw_event!(
            Ras,
            1,
            "device fault injected over the control socket (device {:?}, kind {:?})",
            device,
            kind
        );
        crate::health::inject_all(device, kind).map(|devices| FaultStatusResult { devices })
    }

    /// QP snapshots. Default: the process-wide [`snapshot::history`].
    fn snapshots(&self, filter: &SnapshotFilter) -> SnapshotsResult {
        snapshot::history().list(filter)
    }
}

/// A handler that answers everything from the process-wide services.
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultHandler;

impl ControlHandler for DefaultHandler {}

/// The reply line of a successful request: `result` serialized straight into it.
fn ok_line<T: Serialize>(result: &T) -> Vec<u8> {
    let mut out = Vec::with_capacity(4096);
    out.extend_from_slice(br#"{"ok":true,"pid":"#);
    out.extend_from_slice(sys::pid().to_string().as_bytes());
    out.extend_from_slice(br#","process":"#);
    let encoded = serde_json::to_writer(&mut out, sys::process_name()).and_then(|()| {
        out.extend_from_slice(br#","result":"#);
        serde_json::to_writer(&mut out, result)
    });
    if let Err(e) = encoded {
        return encode(&Reply::err(format!("cannot encode the result: {e}")));
    }
    out.extend_from_slice(b"}\n");
    out
}

/// Answers one request line (no I/O: what the server does per line), as [`answer`]'s
/// line read back.
pub fn dispatch(handler: &dyn ControlHandler, line: &str) -> Reply {
    let text = answer(handler, line);
    serde_json::from_slice(&text)
        .unwrap_or_else(|e| Reply::err(format!("cannot read the reply back: {e}")))
}

/// Answers one request line with the reply line (newline included).
pub fn answer(handler: &dyn ControlHandler, line: &str) -> Vec<u8> {
    let req: Request = match serde_json::from_str(line) {
        Ok(r) => r,
        Err(e) => return encode(&Reply::err(format!("bad request: {e}"))),
    };
    match req {
        Request::Info => ok_line(&ProcessInfo {
            pid: sys::pid(),
            name: sys::process_name().to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            now: clock::rfc3339(std::time::SystemTime::now()),
        }),
        Request::Resources { kind, id, max } => {
            ok_line(&handler.resources(&ResourceFilter { kind, id, max }))
        }
        Request::Stats { detail } => ok_line(&handler.stats(&detail)),
        Request::TraceGet => ok_line(&handler.trace_get()),
        Request::TraceSet { spec } => match handler.trace_set(&spec) {
            Ok(levels) => ok_line(&levels),
            Err(e) => encode(&Reply::err(e)),
        },
        Request::FlightRecorder { tail, after } => {
            let tail = Some(
                tail.unwrap_or(MAX_RECORDS_PER_REPLY)
                    .min(MAX_RECORDS_PER_REPLY),
            );
            ok_line(&handler.flight_recorder(tail, after))
        }
        Request::Snapshots { qpn, device, id } => {
            ok_line(&handler.snapshots(&SnapshotFilter { qpn, device, id }))
        }
        Request::FaultStatus => ok_line(&handler.fault_status()),
        Request::FaultInject { device, kind } => {
            match handler.fault_inject(device.as_deref(), kind.as_deref()) {
                Ok(r) => ok_line(&r),
                Err(e) => encode(&Reply::err(e)),
            }
        }
        Request::Dump { reason } => {
            let reason = reason.unwrap_or_else(|| "on demand".to_string());
            let dump = crate::dump::collect(handler, &reason)
                .map_err(|e| e.to_string())
                .and_then(|b| String::from_utf8(b).map_err(|e| e.to_string()));
            match dump {
                Ok(dump) if escaped_len(&dump) > MAX_REPLY_LINE - 1024 => {
                    encode(&Reply::err(format!(
                        "the dump is {} bytes, more than one reply carries ({MAX_REPLY_LINE}); \
                         a smaller flight recorder (SOFTWARP_FLIGHT_RECORDER) makes it fit",
                        dump.len()
                    )))
                }
                Ok(dump) => ok_line(&DumpResult { dump }),
                Err(e) => encode(&Reply::err(format!("cannot make the dump: {e}"))),
            }
        }
    }
}

/// Bytes `text` takes as a JSON string (a dump holds no control character but newlines:
/// its JSON bodies escape theirs).
fn escaped_len(text: &str) -> usize {
    text.len()
        + text
            .bytes()
            .filter(|b| matches!(b, b'"' | b'\\' | b'\n'))
            .count()
}

fn encode(reply: &Reply) -> Vec<u8> {
    let mut out = serde_json::to_vec(reply).unwrap_or_else(|_| {
        br#"{"ok":false,"pid":0,"process":"","error":"cannot encode the reply"}"#.to_vec()
    });
    out.push(b'\n');
    out
}

/// A running control socket server; stops, joins its threads and removes the socket file
/// when dropped.
pub struct ControlServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    refused: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ControlServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlServer")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl ControlServer {
    /// Listens at `path` (mode `0600`) and serves `handler` on a thread named
    /// `softwarp-ctl` to processes of this user and of root only (see the
    /// [module docs](self)). A leftover socket file nobody listens on is replaced; a live
    /// one is an `AddrInUse` error.
    pub fn start(path: impl Into<PathBuf>, handler: Arc<dyn ControlHandler>) -> io::Result<Self> {
        let path = path.into();
        if path.exists() {
            if UnixStream::connect(&path).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("{} is served by a running process", path.display()),
                ));
            }
            std::fs::remove_file(&path)?;
        }
        let listener = UnixListener::bind(&path)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let refused = Arc::new(AtomicU64::new(0));
        let gate = Gate {
            owner: sys::euid(),
            path: path.clone(),
            refused: Arc::clone(&refused),
            last_logged: None,
            unlogged: 0,
        };
        let thread = crate::thread::spawn("softwarp-ctl".into(), {
            let stop = Arc::clone(&stop);
            move || accept_loop(&listener, &stop, &handler, gate)
        })?;
        Ok(Self {
            path,
            stop,
            refused,
            thread: Some(thread),
        })
    }

    /// Connections refused so far because they came from another user (see the
    /// [module docs](self)).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Who may use the socket: the `SO_PEERCRED` check of every accepted connection, and the
/// rate-limited error-log lines of refusals. Owned by the accept thread.
struct Gate {
    /// The effective uid the server runs as (the socket file's owner).
    owner: u32,
    path: PathBuf,
    refused: Arc<AtomicU64>,
    last_logged: Option<Instant>,
    /// Refusals since the last error-log line.
    unlogged: u64,
}

impl Gate {
    /// `Ok` for a connection of the owner or root; otherwise the reason, after counting and
    /// logging the refusal.
    fn admit(&mut self, stream: &UnixStream) -> Result<(), String> {
        let (uid, pid) = match sys::peer_credentials(stream.as_fd()) {
            Ok(c) => c,
            Err(e) => return Err(self.refuse(format!("credentials unknown ({e})"))),
        };
        if uid == self.owner || uid == 0 {
            return Ok(());
        }
        Err(self.refuse(format!("uid {uid} (pid {pid})")))
    }

    fn refuse(&mut self, who: String) -> String {
        self.refused.fetch_add(1, Ordering::Relaxed);
        self.unlogged = self.unlogged.saturating_add(1);
        let reason = format!(
            "permission denied: only uid {} and root may use {}",
            self.owner,
            self.path.display()
        );
        let due = self
            .last_logged
            .is_none_or(|t| t.elapsed() >= REFUSAL_LOG_INTERVAL);
        if due {
            let earlier = self.unlogged.saturating_sub(1);
            let mut detail = format!("control socket connection from {who} refused: {reason}");
            if earlier > 0 {
                detail.push_str(&format!(
                    " ({earlier} earlier refusals since the last such line)"
                ));
            }
            errlog::report(&CriticalEvent::new(CriticalKind::ControlRefused, detail));
            self.last_logged = Some(Instant::now());
            self.unlogged = 0;
        }
        reason
    }
}

fn accept_loop(
    listener: &UnixListener,
    stop: &Arc<AtomicBool>,
    handler: &Arc<dyn ControlHandler>,
    mut gate: Gate,
) {
    let active = Arc::new(AtomicUsize::new(0));
    let workers: Mutex<Vec<JoinHandle<()>>> = Mutex::new(Vec::new());
    while !stop.load(Ordering::Relaxed) {
        match sys::wait_readable(listener.as_fd(), POLL) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(_) => {
                std::thread::sleep(POLL);
                continue;
            }
        }
        let Ok((mut stream, _)) = listener.accept() else {
            continue;
        };
        if let Err(reason) = gate.admit(&stream) {
            // One short line fits the socket buffer; the timeout bounds the rest.
            let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = stream.write_all(&encode(&Reply::err(reason)));
            continue;
        }
        let mut w = workers.lock().unwrap_or_else(|e| e.into_inner());
        w.retain(|h| !h.is_finished());
        if active.load(Ordering::Relaxed) >= MAX_CONNECTIONS {
            let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = stream.write_all(&encode(&Reply::err(format!(
                "busy: {MAX_CONNECTIONS} connections are open, try again"
            ))));
            continue;
        }
        let slot = Slot::take(&active);
        let spawned = crate::thread::spawn("softwarp-ctl-conn".into(), {
            let (stop, handler) = (Arc::clone(stop), Arc::clone(handler));
            move || {
                let _slot = slot;
                let _ = serve_connection(stream, &stop, &*handler);
            }
        });
        // On a failed spawn the closure (and the slot in it) is dropped: the count is
        // given back.
        if let Ok(h) = spawned {
            w.push(h);
        }
    }
    // Each worker notices `stop` within one POLL.
    for h in workers.into_inner().unwrap_or_else(|e| e.into_inner()) {
        let _ = h.join();
    }
}

/// One of the [`MAX_CONNECTIONS`] connection slots; given back when dropped, even when a
/// handler panics.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(active: &Arc<AtomicUsize>) -> Self {
        active.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(active))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// [`answer`], with a panic in the handler turned into an error reply (a bug in one
/// object's description must not take the control socket down).
fn answer_guarded(handler: &dyn ControlHandler, line: &str) -> Vec<u8> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| answer(handler, line)))
        .unwrap_or_else(|_| encode(&Reply::err("internal error: the request handler panicked")))
}

fn serve_connection(
    mut stream: UnixStream,
    stop: &AtomicBool,
    handler: &dyn ControlHandler,
) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(POLL))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = [0u8; 4096];
    let mut idle_since = Instant::now();
    loop {
        // Answer every complete line already received.
        while let Some(nl) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=nl).collect();
            let text = String::from_utf8_lossy(line.get(..nl).unwrap_or(&[]));
            let text = text.trim();
            if text.is_empty() {
                continue;
            }
            stream.write_all(&answer_guarded(handler, text))?;
            idle_since = Instant::now();
        }
        if pending.len() > MAX_REQUEST_LINE {
            stream.write_all(&encode(&Reply::err(format!(
                "request longer than {MAX_REQUEST_LINE} bytes"
            ))))?;
            return Ok(());
        }
        if stop.load(Ordering::Relaxed) || idle_since.elapsed() > IDLE_TIMEOUT {
            return Ok(());
        }
        match stream.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => pending.extend_from_slice(buf.get(..n).unwrap_or(&[])),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
}

/// Why a request to a process failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// Connecting, sending or receiving failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What the client was doing.
        op: &'static str,
        /// The socket.
        path: String,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// No reply within the time limit.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// The reply was not valid JSON of the expected shape, or too long.
    #[error("bad reply: {0}")]
    Protocol(String),
    /// The process answered with an error.
    #[error("the process refused: {0}")]
    Remote(String),
    /// The socket is not the registered process's own: its file or directory belongs to
    /// another user, is not at the registry's path, is reached through a symbolic link, or
    /// the process listening on it (`SO_PEERCRED`) is not the registered one. Nothing was
    /// sent.
    #[error("not trusted: {0}")]
    Untrusted(String),
    /// The caller's deadline passed before the request was sent, or before its reply came
    /// (not the process's fault: nothing can be concluded about it).
    #[error("the deadline passed {0}")]
    DeadlinePassed(&'static str),
}

/// A connection to one process's control socket (keep it open for repeated requests, e.g.
/// `stat --watch`).
#[derive(Debug)]
pub struct ControlClient {
    stream: UnixStream,
    path: PathBuf,
    pending: Vec<u8>,
    timeout: Duration,
}

impl ControlClient {
    /// Connects to `path` (waiting at most `timeout` for a place in the listener's
    /// backlog); every request then waits at most `timeout` for its reply. For a registered
    /// process, [`ControlClient::connect_entry`] is the one to use: this one trusts `path`.
    pub fn connect(path: impl Into<PathBuf>, timeout: Duration) -> Result<Self, ClientError> {
        let path = path.into();
        let stream = connect_unix(&path, Some(timeout)).map_err(|source| ClientError::Io {
            op: "connect to",
            path: path.display().to_string(),
            source,
        })?;
        Ok(Self {
            stream,
            path,
            pending: Vec::new(),
            timeout,
        })
    }

    /// Connects to the control socket of a live registered process (an entry of
    /// [`HostRegistry::scan`]) after checking that it is that process's own (see
    /// [`connect_entry`]); every request then waits at most `timeout` for its reply.
    pub fn connect_entry(entry: &ProcessEntry, timeout: Duration) -> Result<Self, ClientError> {
        let stream = connect_entry(entry, Some(timeout))?;
        stream
            .set_nonblocking(false)
            .map_err(|source| ClientError::Io {
                op: "configure",
                path: entry.control_socket.display().to_string(),
                source,
            })?;
        Ok(Self {
            stream,
            path: entry.control_socket.clone(),
            pending: Vec::new(),
            timeout,
        })
    }

    fn io(&self, op: &'static str) -> impl FnOnce(io::Error) -> ClientError + '_ {
        move |source| ClientError::Io {
            op,
            path: self.path.display().to_string(),
            source,
        }
    }

    /// Sends `req` and waits for its reply.
    pub fn request(&mut self, req: &Request) -> Result<Reply, ClientError> {
        let mut line = serde_json::to_vec(req).map_err(|e| ClientError::Protocol(e.to_string()))?;
        line.push(b'\n');
        let deadline = Deadline::after(self.timeout);
        self.stream
            .set_write_timeout(Some(self.timeout.max(Duration::from_millis(1))))
            .map_err(self.io("configure"))?;
        if let Err(e) = self.stream.write_all(&line) {
            // A server that refuses the connection (busy, another user) answers at once and
            // closes, perhaps before the request was sent: its reply is still readable, and
            // says more than the broken pipe.
            if matches!(
                e.kind(),
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
            ) {
                if let Ok(reply) = self.read_reply(deadline) {
                    return Ok(reply);
                }
            }
            return Err(self.io("send to")(e));
        }
        self.read_reply(deadline)
    }

    /// Reads one reply line, waiting until `deadline`.
    fn read_reply(&mut self, deadline: Deadline) -> Result<Reply, ClientError> {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            if let Some(nl) = self.pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=nl).collect();
                return serde_json::from_slice(line.get(..nl).unwrap_or(&[]))
                    .map_err(|e| ClientError::Protocol(e.to_string()));
            }
            if self.pending.len() > MAX_REPLY_LINE {
                return Err(ClientError::Protocol(format!(
                    "reply longer than {MAX_REPLY_LINE} bytes"
                )));
            }
            // `None`: no limit (a timeout the clock cannot represent, e.g. `Duration::MAX`).
            let left = deadline.remaining();
            if left.is_some_and(|l| l.is_zero()) {
                return Err(ClientError::Timeout(self.timeout));
            }
            self.stream
                .set_read_timeout(left)
                .map_err(self.io("configure"))?;
            match self.stream.read(&mut buf) {
                Ok(0) => {
                    return Err(ClientError::Protocol(
                        "the process closed the connection without a reply".into(),
                    ))
                }
                Ok(n) => self.pending.extend_from_slice(buf.get(..n).unwrap_or(&[])),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(ClientError::Timeout(self.timeout))
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io("receive from")(e)),
            }
        }
    }
}

/// Sends one request to the control socket at `path` (a path the caller trusts; for a
/// registered process, [`request_entry`]). `timeout` bounds the connect, and then the
/// request.
pub fn request(path: &Path, req: &Request, timeout: Duration) -> Result<Reply, ClientError> {
    ControlClient::connect(path, timeout)?.request(req)
}

/// Sends one request to a live registered process, over its own control socket only (see
/// [`connect_entry`]).
pub fn request_entry(
    entry: &ProcessEntry,
    req: &Request,
    timeout: Duration,
) -> Result<Reply, ClientError> {
    ControlClient::connect_entry(entry, timeout)?.request(req)
}

/// A Unix stream socket connected to `path`. `Some(timeout)`: a blocking socket whose
/// connect waits at most `timeout` for a place in a full backlog (`SO_SNDTIMEO`; a timeout
/// the clock cannot represent waits without a bound). `None`: a non-blocking socket whose
/// connect fails at once (`EAGAIN`) when the backlog is full.
fn connect_unix(path: &Path, timeout: Option<Duration>) -> io::Result<UnixStream> {
    use rustix::net::{sockopt, AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let mut flags = SocketFlags::CLOEXEC;
    if timeout.is_none() {
        flags |= SocketFlags::NONBLOCK;
    }
    let fd = rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, flags, None)?;
    if let Some(t) = timeout.filter(|t| !Deadline::after(*t).is_never()) {
        // Zero means "no timeout" to the kernel: the shortest real one instead.
        let t = t.max(Duration::from_millis(1));
        sockopt::set_socket_timeout(&fd, sockopt::Timeout::Send, Some(t))?;
    }
    match rustix::net::connect(&fd, &SocketAddrUnix::new(path)?) {
        Ok(()) => {}
        // A blocking connect that timed out, or a non-blocking one with a full backlog.
        Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INPROGRESS) => {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the listener's backlog is full (the process does not accept)",
            ))
        }
        Err(e) => return Err(e.into()),
    }
    if timeout.is_some() {
        sockopt::set_socket_timeout(&fd, sockopt::Timeout::Send, None)?;
    }
    Ok(UnixStream::from(fd))
}

/// Connects to a registered process's control socket, trusting nothing the entry says
/// alone: the socket file is opened with [`crate::registry::open_control_socket`] (the
/// registry's path, no symbolic link, directory and file owned by the entry's uid) and
/// connected to through that descriptor (`/proc/self/fd/N`), and the listening process's
/// kernel credentials (`SO_PEERCRED`) must be the entry's pid and uid. Nothing is sent on
/// a connection that fails a check. `timeout` as [`connect_unix`]'s.
pub fn connect_entry(
    entry: &ProcessEntry,
    timeout: Option<Duration>,
) -> Result<UnixStream, ClientError> {
    use std::os::fd::AsRawFd;
    let path = entry.control_socket.display().to_string();
    let file = crate::registry::open_control_socket(entry).map_err(|source| {
        if source.kind() == io::ErrorKind::PermissionDenied {
            ClientError::Untrusted(source.to_string())
        } else {
            ClientError::Io {
                op: "open",
                path: path.clone(),
                source,
            }
        }
    })?;
    let via = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
    let stream = connect_unix(&via, timeout).map_err(|source| ClientError::Io {
        op: "connect to",
        path: path.clone(),
        source,
    })?;
    drop(file);
    let (uid, pid) = sys::peer_credentials(stream.as_fd()).map_err(|source| ClientError::Io {
        op: "read the credentials of",
        path: path.clone(),
        source,
    })?;
    if (uid, pid) != (entry.uid, entry.pid) {
        return Err(ClientError::Untrusted(format!(
            "{path} is served by pid {pid} of uid {uid}, not by pid {} of uid {}",
            entry.pid, entry.uid
        )));
    }
    Ok(stream)
}

/// Most requests [`ask_concurrently`] has open at once.
pub const MAX_IN_FLIGHT: usize = 16;

/// How [`ask_concurrently`] asks.
#[derive(Debug, Clone, Copy)]
pub struct Concurrently {
    /// Nothing is connected, sent or read after it; requests without a reply by then, and
    /// those not begun, are [`ClientError::DeadlinePassed`].
    pub deadline: Deadline,
    /// The longest one request waits for its reply (its slot then goes to the next).
    pub per_request: Duration,
    /// The first this many entries are essential: once they all have their answer, the
    /// others get until `grace` after the start, then are given up.
    pub essential: usize,
    /// See `essential`.
    pub grace: Duration,
    /// Longest reply line read, in bytes.
    pub max_reply: usize,
}

/// One request in flight.
struct Flight {
    index: usize,
    /// When it is given up.
    until: Deadline,
    stream: UnixStream,
    out: Vec<u8>,
    sent: usize,
    pending: Vec<u8>,
}

/// Sends `req` to each of `entries` (live registered processes) and collects their
/// replies, at most [`MAX_IN_FLIGHT`] at once on non-blocking sockets and one `poll`, in
/// the entries' order (so essential ones first), without a thread. Each connection is
/// [`connect_entry`]'s (trusted or not made); the deadline is checked before each connect
/// and bounds every wait, so the whole call returns by `how.deadline` (plus the time of
/// one connect and one read); a request without a reply after `how.per_request` is a
/// [`ClientError::Timeout`] and frees its place. Answers are in the entries' order.
pub fn ask_concurrently(
    entries: &[ProcessEntry],
    req: &Request,
    how: &Concurrently,
) -> Vec<Result<Reply, ClientError>> {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let start = Instant::now();
    let grace_end = Deadline::after_from(start, how.grace);
    let mut line = match serde_json::to_vec(req) {
        Ok(l) => l,
        Err(e) => {
            return entries
                .iter()
                .map(|_| Err(ClientError::Protocol(e.to_string())))
                .collect()
        }
    };
    line.push(b'\n');
    let mut answers: Vec<Option<Result<Reply, ClientError>>> =
        entries.iter().map(|_| None).collect();
    let mut flights: Vec<Flight> = Vec::new();
    let mut next = 0usize;
    let essential = how.essential.min(entries.len());
    loop {
        while flights.len() < MAX_IN_FLIGHT && next < entries.len() && !how.deadline.expired() {
            let index = next;
            next = next.saturating_add(1);
            let Some(entry) = entries.get(index) else {
                break;
            };
            match connect_entry(entry, None) {
                Ok(stream) => flights.push(Flight {
                    index,
                    until: how.deadline.min(Deadline::after(how.per_request)),
                    stream,
                    out: line.clone(),
                    sent: 0,
                    pending: Vec::new(),
                }),
                Err(e) => {
                    if let Some(a) = answers.get_mut(index) {
                        *a = Some(Err(e));
                    }
                }
            }
        }
        if flights.is_empty() && next >= entries.len() {
            break;
        }
        let essentials_done = answers.iter().take(essential).all(Option::is_some);
        let mut until = how.deadline;
        if essentials_done {
            if grace_end.expired() {
                break;
            }
            until = until.min(grace_end);
        }
        if until.expired() {
            break;
        }
        if flights.is_empty() {
            // Only entries not begun: the loop above begins them unless the deadline passed.
            continue;
        }
        let ready: Vec<PollFlags> = {
            let mut fds: Vec<PollFd<'_>> = flights
                .iter()
                .map(|f| {
                    let mut flags = PollFlags::IN;
                    if f.sent < f.out.len() {
                        flags |= PollFlags::OUT;
                    }
                    PollFd::new(&f.stream, flags)
                })
                .collect();
            let wake = flights.iter().fold(until, |w, f| w.min(f.until));
            let ts = wake
                .remaining()
                .and_then(|left| Timespec::try_from(left).ok());
            match rustix::event::poll(&mut fds, ts.as_ref()) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
            fds.iter().map(PollFd::revents).collect()
        };
        let mut finished: Vec<(usize, Result<Reply, ClientError>)> = Vec::new();
        for (slot, (f, revents)) in flights.iter_mut().zip(ready).enumerate() {
            let result = if revents.is_empty() {
                None
            } else {
                advance(f, how.max_reply)
            };
            match result {
                Some(r) => finished.push((slot, r)),
                None if how.deadline.expired() => {
                    finished.push((slot, Err(ClientError::DeadlinePassed("before it answered"))))
                }
                None if f.until.expired() => {
                    finished.push((slot, Err(ClientError::Timeout(how.per_request))))
                }
                None => {}
            }
        }
        // Remove from the back so the slots stay valid.
        for (slot, result) in finished.into_iter().rev() {
            let f = flights.swap_remove(slot);
            if let Some(a) = answers.get_mut(f.index) {
                *a = Some(result);
            }
        }
    }
    let waited = start.elapsed();
    let cut = how.deadline.expired();
    for f in flights {
        if let Some(a) = answers.get_mut(f.index) {
            *a = Some(Err(if cut {
                ClientError::DeadlinePassed("before it answered")
            } else {
                ClientError::Timeout(waited)
            }));
        }
    }
    answers
        .into_iter()
        .map(|a| a.unwrap_or(Err(ClientError::DeadlinePassed("before it was asked"))))
        .collect()
}

/// Sends what is left of `f`'s request and reads what arrived, without blocking; `Some`
/// once the exchange is over.
fn advance(f: &mut Flight, max_reply: usize) -> Option<Result<Reply, ClientError>> {
    use rustix::net::{RecvFlags, SendFlags};
    let io_err = |op: &'static str, e: rustix::io::Errno| ClientError::Io {
        op,
        path: "a control socket".into(),
        source: e.into(),
    };
    while f.sent < f.out.len() {
        let rest = f.out.get(f.sent..).unwrap_or(&[]);
        // NOSIGNAL: a process that closed its end must not kill this one with SIGPIPE
        // (the library may run in a C program that did not ignore it).
        match rustix::net::send(&f.stream, rest, SendFlags::NOSIGNAL) {
            Ok(n) => f.sent = f.sent.saturating_add(n),
            Err(rustix::io::Errno::AGAIN) => break,
            Err(rustix::io::Errno::INTR) => {}
            // Closed early (a refusal): what it said is still readable below.
            Err(rustix::io::Errno::PIPE | rustix::io::Errno::CONNRESET) => {
                f.sent = f.out.len();
            }
            Err(e) => return Some(Err(io_err("send to", e))),
        }
    }
    let mut buf = [0u8; 16 * 1024];
    loop {
        match rustix::net::recv(&f.stream, &mut buf[..], RecvFlags::DONTWAIT) {
            Ok((0, _)) => {
                return Some(Err(ClientError::Protocol(
                    "the process closed the connection without a reply".into(),
                )))
            }
            Ok((n, _)) => {
                let got = buf.get(..n).unwrap_or(&[]);
                let had = f.pending.len();
                f.pending.extend_from_slice(got);
                if let Some(nl) = got.iter().position(|b| *b == b'\n') {
                    let end = had.saturating_add(nl);
                    let line = f.pending.get(..end).unwrap_or(&[]);
                    return Some(
                        serde_json::from_slice(line)
                            .map_err(|e| ClientError::Protocol(e.to_string())),
                    );
                }
                if f.pending.len() > max_reply {
                    return Some(Err(ClientError::Protocol(format!(
                        "reply longer than {max_reply} bytes"
                    ))));
                }
            }
            Err(rustix::io::Errno::AGAIN) => return None,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Some(Err(io_err("receive from", e))),
        }
    }
}

/// One process's answer in [`query_all`].
#[derive(Debug)]
pub struct ProcessReply {
    /// The registered process.
    pub entry: ProcessEntry,
    /// Its reply, or why there is none.
    pub reply: Result<Reply, ClientError>,
}

/// Sends `req` to every live process of `registry` (stale entries are cleaned first; only
/// trusted entries are live), one after the other, each with `timeout`, over
/// [`request_entry`].
pub fn query_all(
    registry: &HostRegistry,
    req: &Request,
    timeout: Duration,
) -> io::Result<Vec<ProcessReply>> {
    Ok(registry
        .live()?
        .into_iter()
        .map(|entry| {
            let reply = request_entry(&entry, req, timeout);
            ProcessReply { entry, reply }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_have_the_documented_json_form() {
        let cases = [
            (Request::Info, r#"{"op":"info"}"#),
            (
                Request::Resources {
                    kind: None,
                    id: None,
                    max: None,
                },
                r#"{"op":"resources"}"#,
            ),
            (
                Request::Resources {
                    kind: Some(ResourceKind::Qp),
                    id: Some(7),
                    max: Some(10),
                },
                r#"{"op":"resources","kind":"qp","id":7,"max":10}"#,
            ),
            (
                Request::Stats {
                    detail: Detail::Auto,
                },
                r#"{"op":"stats"}"#,
            ),
            (
                Request::Stats {
                    detail: Detail::Qps(vec![7]),
                },
                r#"{"op":"stats","detail":{"qps":[7]}}"#,
            ),
            (Request::TraceGet, r#"{"op":"trace-get"}"#),
            (
                Request::TraceSet {
                    spec: "qp=5".into(),
                },
                r#"{"op":"trace-set","spec":"qp=5"}"#,
            ),
            (
                Request::FlightRecorder {
                    tail: Some(10),
                    after: None,
                },
                r#"{"op":"flight-recorder","tail":10}"#,
            ),
            (
                Request::Snapshots {
                    qpn: Some(3),
                    device: None,
                    id: None,
                },
                r#"{"op":"snapshots","qpn":3}"#,
            ),
            (Request::Dump { reason: None }, r#"{"op":"dump"}"#),
            (Request::FaultStatus, r#"{"op":"fault-status"}"#),
            (
                Request::FaultInject {
                    device: Some("softwarp0/1".into()),
                    kind: None,
                },
                r#"{"op":"fault-inject","device":"softwarp0/1"}"#,
            ),
        ];
        for (req, json) in cases {
            assert_eq!(serde_json::to_string(&req).unwrap(), json);
            assert_eq!(serde_json::from_str::<Request>(json).unwrap(), req);
        }
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"flight-recorder"}"#).unwrap(),
            Request::FlightRecorder {
                tail: None,
                after: None
            }
        );
    }

    #[test]
    fn bad_requests_get_an_error_reply() {
        for line in [
            "",
            "{",
            r#"{"op":"reboot"}"#,
            r#"{"op":"trace-set"}"#,
            "[1,2]",
        ] {
            let r = dispatch(&DefaultHandler, line);
            assert!(!r.ok, "{line}");
            assert!(r.error.unwrap().starts_with("bad request"), "{line}");
            assert_eq!(r.pid, std::process::id());
        }
    }

    #[test]
    fn a_bad_trace_spec_is_refused_and_changes_nothing() {
        let before = trace::control().levels();
        let r = dispatch(&DefaultHandler, r#"{"op":"trace-set","spec":"bogus=3"}"#);
        assert!(!r.ok);
        assert!(r.error.unwrap().contains("unknown trace key"));
        assert_eq!(trace::control().levels(), before);
    }

    #[test]
    fn a_dump_reply_is_measured_as_json_will_carry_it() {
        let dump = crate::dump::collect(&DefaultHandler, "a \"quoted\" reason\n").unwrap();
        let dump = String::from_utf8(dump).unwrap();
        let json = serde_json::to_string(&dump).unwrap();
        assert_eq!(escaped_len(&dump), json.len() - 2);
        let r = dispatch(&DefaultHandler, r#"{"op":"dump","reason":"test"}"#);
        assert!(r.ok, "{:?}", r.error);
        let d: DumpResult = r.into_result().unwrap();
        assert!(crate::dump::parse(d.dump.as_bytes()).unwrap().is_complete());
    }

    #[test]
    fn info_names_this_process() {
        let info: ProcessInfo = dispatch(&DefaultHandler, r#"{"op":"info"}"#)
            .into_result()
            .unwrap();
        assert_eq!(info.pid, std::process::id());
        assert_eq!(info.version, env!("CARGO_PKG_VERSION"));
    }
}
