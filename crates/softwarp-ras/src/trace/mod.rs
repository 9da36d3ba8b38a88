//! Tracing with Softwarp's levels 1-9 per component and per QP, changeable at run time, and
//! the flight recorder. No I/O here except the console layer's writes.
//!
//! # Levels
//!
//! | level | meaning | `tracing` level |
//! | --- | --- | --- |
//! | 0 | off | (nothing) |
//! | 1 | errors | `ERROR` |
//! | 2 | rare events an operator should see (connection up/down, Terminate, reset) | `WARN` |
//! | 3 | (between rare and entry/exit) | `INFO` |
//! | 4 | entry/exit of control-path calls (create, modify, destroy, connect) | `INFO` |
//! | 5 | control-path internals | `DEBUG` |
//! | 6 | (between internals and hot entry/exit) | `DEBUG` |
//! | 7 | hot-path entry/exit (post, poll, per-FPDU) | `TRACE` |
//! | 8 | hot-path internals | `TRACE` |
//! | 9 | data dumps (payload bytes) | `TRACE` |
//!
//! The exact level travels in the event's name (`swl5`), so the mapping onto `tracing`'s five
//! levels loses nothing: foreign `tracing` layers see a sensible level, ours filter on the
//! exact one. Plain `tracing` events (without our macro) count as `ERROR` → 1, `WARN` → 2,
//! `INFO` → 3, `DEBUG` → 5, `TRACE` → 8.
//!
//! # Components
//!
//! Each record belongs to a [`Component`], found from its target: [`sw_event!`](crate::sw_event) sets the
//! target `softwarp::<component>`; plain `tracing` events are attributed by module path (see
//! [`Component::from_target`]). Events of other crates are "foreign" and have their own level
//! (`other=` in a spec).
//!
//! # Run-time control
//!
//! The levels live in atomics in one process-wide [`TraceControl`] ([`control()`]). A record
//! is *traced* (shown by the console layer, or any layer filtered with [`TraceFilter`]) when
//! its level is at most its component's level, or at most the level of its QP (a per-QP level
//! raises a QP's verbosity, it never lowers it). The [flight recorder](FlightRecorder) keeps
//! every traced record and, in addition, every record up to its own level, so recent history
//! is in memory even when the console is quiet.
//!
//! The hot-path check of [`sw_event!`](crate::sw_event) is one relaxed atomic load (the component's *gate*,
//! the most verbose level anything could want for it); the exact decision (a few more
//! relaxed loads, and a scan of the per-QP slots while some QP has its own level) happens
//! only for records that pass it, before anything is formatted or dispatched. To guard an
//! expensive computation (a hex dump for level 9), test
//! [`control().gate(component, level)`](TraceControl::gate) first.
//!
//! Initial levels come from `SOFTWARP_TRACE` ([`init_from_env`]); later changes come from the
//! control socket (`trace-set`), the CLI, or the API ([`TraceControl::apply`]).

mod layer;
mod record;
mod recorder;
mod spec;

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

pub use layer::{
    install_global, recorder_layer, ConsoleLayer, FlightRecorderLayer, RecorderFilter, TraceFilter,
};
pub use record::{Record, MAX_RECORD_TEXT};
pub use recorder::{
    flight_recorder, init_flight_recorder, FlightRecorder, FlightRecorderDump,
    DEFAULT_FLIGHT_RECORDER_CAPACITY, FLIGHT_RECORDER_ENV, MAX_FLIGHT_RECORDER_CAPACITY,
};
pub use spec::{SpecError, TraceSpec, MAX_SPEC_LEN};

/// The environment variable with the initial trace levels, e.g. `qp=5,cq=2,default=1`.
pub const TRACE_ENV: &str = "SOFTWARP_TRACE";

/// A part of the stack that records belong to; each has its own level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Component {
    /// Wire codecs (`softwarp-wire`).
    Wire,
    /// The sans-IO RNIC (`softwarp-engine`).
    Engine,
    /// Queue pairs of the verbs layer.
    Qp,
    /// Completion queues.
    Cq,
    /// Memory registration, protection domains, STags.
    Mr,
    /// Connection management (MPA negotiation, listeners).
    Cm,
    /// The runtime: devices, progress threads, everything else of `softwarp`.
    Runtime,
    /// The extended sockets interface.
    Sockets,
    /// These RAS services themselves.
    Ras,
}

/// `a::b::c` → (`a`, `Some("b::c")`), `a` → (`a`, `None`): split at the first `:` (a
/// module path has them only in pairs) by a loop over the bytes. `split_once("::")` set a
/// substring searcher up at each call, and this runs several times for every event the
/// subscriber is asked about: a third of a connection set-up's instructions at 10,000
/// connections (issue 39, BENCHMARKS.md).
fn split_path(path: &str) -> (&str, Option<&str>) {
    let b = path.as_bytes();
    match b.iter().position(|&c| c == b':') {
        Some(i) => {
            let after = b[i..].iter().take_while(|&&c| c == b':').count();
            // Both cuts are next to an ASCII `:`: character boundaries.
            (&path[..i], path.get(i + after..))
        }
        None => (path, None),
    }
}

/// Number of components.
const COMPONENTS: usize = 9;
/// Level slots: one per component, then one for foreign (non-Softwarp) events.
const SLOTS: usize = COMPONENTS + 1;
const FOREIGN: usize = COMPONENTS;

impl Component {
    /// Every component, in a fixed order.
    pub const ALL: [Component; COMPONENTS] = [
        Component::Wire,
        Component::Engine,
        Component::Qp,
        Component::Cq,
        Component::Mr,
        Component::Cm,
        Component::Runtime,
        Component::Sockets,
        Component::Ras,
    ];

    /// The component's name as used in specs, JSON and the CLI.
    pub const fn as_str(self) -> &'static str {
        match self {
            Component::Wire => "wire",
            Component::Engine => "engine",
            Component::Qp => "qp",
            Component::Cq => "cq",
            Component::Mr => "mr",
            Component::Cm => "cm",
            Component::Runtime => "runtime",
            Component::Sockets => "sockets",
            Component::Ras => "ras",
        }
    }

    /// The `tracing` target of the component's records (`softwarp::<name>`).
    pub const fn target(self) -> &'static str {
        match self {
            Component::Wire => "softwarp::wire",
            Component::Engine => "softwarp::engine",
            Component::Qp => "softwarp::qp",
            Component::Cq => "softwarp::cq",
            Component::Mr => "softwarp::mr",
            Component::Cm => "softwarp::cm",
            Component::Runtime => "softwarp::runtime",
            Component::Sockets => "softwarp::sockets",
            Component::Ras => "softwarp::ras",
        }
    }

    const fn index(self) -> usize {
        self as usize
    }

    /// The component called `name` (as in [`Component::as_str`]).
    pub fn from_name(name: &str) -> Option<Component> {
        Component::ALL.into_iter().find(|c| c.as_str() == name)
    }

    /// The component a `tracing` target belongs to, `None` for other crates.
    ///
    /// - `softwarp::<component>[::...]` → that component (the target [`sw_event!`](crate::sw_event) sets, and
    ///   the module path of the `softwarp` crate's `cm`, `runtime` and `ras` modules);
    ///   the verbs objects' modules (`softwarp::verbs::qp`, `::cq`) by the name under
    ///   `verbs`, with `softwarp::verbs::pd` → [`Mr`](Component::Mr) and
    ///   `softwarp::verbs::srq` → [`Qp`](Component::Qp); any other `softwarp[::...]` →
    ///   [`Runtime`](Component::Runtime);
    /// - the crates `softwarp_wire`, `softwarp_engine`, `softwarp_sockets`, `softwarp_ras` →
    ///   their component; any other `softwarp_*` crate → [`Runtime`](Component::Runtime).
    pub fn from_target(target: &str) -> Option<Component> {
        let (krate, rest) = split_path(target);
        match krate {
            "softwarp" => {
                let mut module = rest.map(split_path);
                // `verbs` is a layer of the crate, not a component: its modules are.
                if let Some(("verbs", Some(inner))) = module {
                    module = Some(split_path(inner));
                }
                Some(match module.map(|m| m.0) {
                    Some("pd") => Component::Mr,
                    Some("srq") => Component::Qp,
                    Some(m) => Component::from_name(m).unwrap_or(Component::Runtime),
                    None => Component::Runtime,
                })
            }
            "softwarp_wire" => Some(Component::Wire),
            "softwarp_engine" => Some(Component::Engine),
            "softwarp_sockets" => Some(Component::Sockets),
            "softwarp_ras" => Some(Component::Ras),
            k if k.starts_with("softwarp_") => Some(Component::Runtime),
            _ => None,
        }
    }
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Component {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Component::from_name(s).ok_or_else(|| SpecError::UnknownKey(s.to_string()))
    }
}

/// A Softwarp trace level, 0 (off) to 9 (data dumps); see the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "u8", into = "u8")]
pub struct Level(u8);

impl Level {
    /// Nothing is recorded.
    pub const OFF: Level = Level(0);
    /// 1: errors.
    pub const ERROR: Level = Level(1);
    /// 2: rare events an operator should see.
    pub const RARE: Level = Level(2);
    /// 4: entry/exit of control-path calls.
    pub const ENTRY_EXIT: Level = Level(4);
    /// 5: control-path internals.
    pub const INTERNALS: Level = Level(5);
    /// 7: hot-path entry/exit.
    pub const HOT_ENTRY_EXIT: Level = Level(7);
    /// 8: hot-path internals.
    pub const HOT_INTERNALS: Level = Level(8);
    /// 9: data dumps.
    pub const DATA: Level = Level(9);
    /// The most verbose level.
    pub const MAX: Level = Level(9);

    /// The level `n`, if `n <= 9`.
    pub const fn new(n: u8) -> Option<Level> {
        if n <= 9 {
            Some(Level(n))
        } else {
            None
        }
    }

    /// The level as a number.
    pub const fn get(self) -> u8 {
        self.0
    }

    /// The `tracing` level records of this level are emitted with (see the module docs).
    pub const fn tracing_level(self) -> tracing::Level {
        tracing_level(self.0)
    }

    /// The Softwarp level of a plain `tracing` event.
    pub fn from_tracing(level: &tracing::Level) -> Level {
        match *level {
            tracing::Level::ERROR => Level(1),
            tracing::Level::WARN => Level(2),
            tracing::Level::INFO => Level(3),
            tracing::Level::DEBUG => Level(5),
            _ => Level(8),
        }
    }
}

impl TryFrom<u8> for Level {
    type Error = SpecError;
    fn try_from(n: u8) -> Result<Self, Self::Error> {
        Level::new(n).ok_or_else(|| SpecError::BadLevel(n.to_string()))
    }
}

impl From<Level> for u8 {
    fn from(l: Level) -> u8 {
        l.0
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The `tracing` level for Softwarp level `n` (for macros: a `const fn` on a plain number).
#[doc(hidden)]
pub const fn tracing_level(n: u8) -> tracing::Level {
    match n {
        0 | 1 => tracing::Level::ERROR,
        2 => tracing::Level::WARN,
        3 | 4 => tracing::Level::INFO,
        5 | 6 => tracing::Level::DEBUG,
        _ => tracing::Level::TRACE,
    }
}

/// The event name that carries Softwarp level `n` (`swl1` .. `swl9`).
#[doc(hidden)]
pub const fn level_name(n: u8) -> &'static str {
    match n {
        0 | 1 => "swl1",
        2 => "swl2",
        3 => "swl3",
        4 => "swl4",
        5 => "swl5",
        6 => "swl6",
        7 => "swl7",
        8 => "swl8",
        _ => "swl9",
    }
}

/// The Softwarp level carried by an event name made by [`level_name`].
fn level_from_name(name: &str) -> Option<u8> {
    match name.as_bytes() {
        [b's', b'w', b'l', d @ b'1'..=b'9'] => Some(d - b'0'),
        _ => None,
    }
}

/// Component (or `None` for foreign) and Softwarp level of a callsite.
pub(crate) fn classify(meta: &tracing::Metadata<'_>) -> (Option<Component>, u8) {
    let component = Component::from_target(meta.target());
    let level =
        level_from_name(meta.name()).unwrap_or_else(|| Level::from_tracing(meta.level()).get());
    (component, level)
}

/// How many QPs can have their own level at once.
pub const MAX_QP_LEVELS: usize = 64;

const QP_OCCUPIED: u64 = 1 << 40;

/// Why a trace setting was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The spec text is malformed.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// Every per-QP slot is taken; clear one first (`qpn:<n>=off` or `qpn:*=off`).
    #[error("at most {max} QPs can have their own trace level; clear one first")]
    TooManyQpLevels {
        /// [`MAX_QP_LEVELS`].
        max: usize,
    },
    /// A global `tracing` subscriber was already installed by someone else; add
    /// [`FlightRecorderLayer`] and a [`TraceFilter`]ed layer to it instead.
    #[error("a global tracing subscriber is already installed")]
    AlreadyInstalled,
}

/// The run-time trace levels: per component, for foreign events, per QP, and the flight
/// recorder's. Every read is a relaxed atomic load; writers serialise on a mutex.
#[derive(Debug)]
pub struct TraceControl {
    levels: [AtomicU8; SLOTS],
    /// Per slot: the most verbose level anything (component, recorder, any QP) could want.
    gates: [AtomicU8; SLOTS],
    recorder: AtomicU8,
    /// The most verbose per-QP level (0 when no QP has one).
    qp_max: AtomicU8,
    /// `QP_OCCUPIED | level << 32 | qpn`, or 0 for a free slot.
    qp_slots: [AtomicU64; MAX_QP_LEVELS],
    /// Bit `qpn % 64` set for every QP with a level: most other QPs are turned away without
    /// scanning the slots.
    qp_mask: AtomicU64,
    writer: Mutex<()>,
}

/// Console level of every component before any configuration: errors only.
pub const DEFAULT_LEVEL: Level = Level::ERROR;
/// Flight recorder level before any configuration: control-path internals.
pub const DEFAULT_RECORDER_LEVEL: Level = Level::INTERNALS;

impl Default for TraceControl {
    fn default() -> Self {
        Self::new()
    }
}

/// One QP's own level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpLevel {
    /// The QP number.
    pub qpn: u32,
    /// Its level.
    pub level: Level,
}

/// A copy of every level, as `trace-get` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceLevels {
    /// Level per component.
    pub components: BTreeMap<Component, Level>,
    /// Level of events from other crates.
    pub other: Level,
    /// The flight recorder's own level.
    pub recorder: Level,
    /// QPs with their own level.
    pub qps: Vec<QpLevel>,
}

impl TraceLevels {
    /// The levels as a spec that [`TraceControl::apply`] accepts (and `SOFTWARP_TRACE`).
    pub fn to_spec(&self) -> TraceSpec {
        TraceSpec {
            default: None,
            components: self.components.iter().map(|(c, l)| (*c, *l)).collect(),
            other: Some(self.other),
            recorder: Some(self.recorder),
            clear_qps: false,
            qps: self.qps.iter().map(|q| (q.qpn, q.level)).collect(),
        }
    }
}

fn slot(component: Option<Component>) -> usize {
    component.map_or(FOREIGN, Component::index)
}

impl TraceControl {
    /// Levels at their defaults ([`DEFAULT_LEVEL`], [`DEFAULT_RECORDER_LEVEL`], no QP levels).
    pub const fn new() -> Self {
        const GATE: u8 = if DEFAULT_RECORDER_LEVEL.0 > DEFAULT_LEVEL.0 {
            DEFAULT_RECORDER_LEVEL.0
        } else {
            DEFAULT_LEVEL.0
        };
        Self {
            levels: [const { AtomicU8::new(DEFAULT_LEVEL.0) }; SLOTS],
            gates: [const { AtomicU8::new(GATE) }; SLOTS],
            recorder: AtomicU8::new(DEFAULT_RECORDER_LEVEL.0),
            qp_max: AtomicU8::new(0),
            qp_slots: [const { AtomicU64::new(0) }; MAX_QP_LEVELS],
            qp_mask: AtomicU64::new(0),
            writer: Mutex::new(()),
        }
    }

    /// The hot-path check of [`sw_event!`](crate::sw_event): could anything want a record of `component` at
    /// `level`? One relaxed atomic load.
    #[inline]
    pub fn gate(&self, component: Component, level: u8) -> bool {
        level <= self.gates[component.index()].load(Ordering::Relaxed)
    }

    /// The exact check of [`sw_event!`](crate::sw_event) for a record about QP `qpn`, after [`gate`] passed:
    /// is it traced or recorded? Keeps records of other QPs from reaching `tracing` while
    /// one QP has a high level of its own.
    ///
    /// [`gate`]: TraceControl::gate
    #[inline]
    pub fn wanted(&self, component: Component, level: u8, qpn: u32) -> bool {
        self.recorded(Some(component), level, Some(qpn))
    }

    /// The level of `component`.
    pub fn level(&self, component: Component) -> Level {
        Level(self.levels[component.index()].load(Ordering::Relaxed))
    }

    /// The level of events from other crates.
    pub fn other_level(&self) -> Level {
        Level(self.levels[FOREIGN].load(Ordering::Relaxed))
    }

    /// The flight recorder's own level.
    pub fn recorder_level(&self) -> Level {
        Level(self.recorder.load(Ordering::Relaxed))
    }

    /// The own level of QP `qpn`, if it has one.
    pub fn qp_level(&self, qpn: u32) -> Option<Level> {
        self.qp_slots.iter().find_map(|s| {
            let v = s.load(Ordering::Relaxed);
            (v & QP_OCCUPIED != 0 && (v & 0xffff_ffff) as u32 == qpn)
                .then_some(Level(((v >> 32) & 0xff) as u8))
        })
    }

    /// Is a record of this component (or foreign, `None`), level and QP *traced* (shown by
    /// [`TraceFilter`]ed layers)?
    pub fn traced(&self, component: Option<Component>, level: u8, qpn: Option<u32>) -> bool {
        if level <= self.levels[slot(component)].load(Ordering::Relaxed) {
            return true;
        }
        match qpn {
            Some(q)
                if level <= self.qp_max.load(Ordering::Relaxed)
                    && self.qp_mask.load(Ordering::Relaxed) & (1 << (q % 64)) != 0 =>
            {
                self.qp_level(q).is_some_and(|l| level <= l.0)
            }
            _ => false,
        }
    }

    /// Is such a record kept by the flight recorder (traced, or within the recorder's level)?
    pub fn recorded(&self, component: Option<Component>, level: u8, qpn: Option<u32>) -> bool {
        level <= self.recorder.load(Ordering::Relaxed) || self.traced(component, level, qpn)
    }

    /// Could a record of this callsite be traced for some QP (metadata-only check)?
    pub(crate) fn might_trace(&self, component: Option<Component>, level: u8) -> bool {
        level <= self.levels[slot(component)].load(Ordering::Relaxed)
            || level <= self.qp_max.load(Ordering::Relaxed)
    }

    /// Could a record of this callsite be recorded for some QP (metadata-only check)?
    pub(crate) fn might_record(&self, component: Option<Component>, level: u8) -> bool {
        level <= self.gates[slot(component)].load(Ordering::Relaxed)
    }

    /// The most verbose level any traced record can have.
    pub(crate) fn max_traced(&self) -> u8 {
        let max = self.levels.iter().map(|l| l.load(Ordering::Relaxed)).max();
        max.unwrap_or(0).max(self.qp_max.load(Ordering::Relaxed))
    }

    /// The most verbose level any recorded record can have.
    pub(crate) fn max_recorded(&self) -> u8 {
        self.gates
            .iter()
            .map(|l| l.load(Ordering::Relaxed))
            .max()
            .unwrap_or(0)
    }

    /// Sets the level of `component`.
    pub fn set_level(&self, component: Component, level: Level) {
        self.change(|c| c.levels[component.index()].store(level.0, Ordering::Relaxed));
    }

    /// Sets the level of events from other crates.
    pub fn set_other_level(&self, level: Level) {
        self.change(|c| c.levels[FOREIGN].store(level.0, Ordering::Relaxed));
    }

    /// Sets every component's level and the level of other crates' events.
    pub fn set_all(&self, level: Level) {
        self.change(|c| {
            for l in &c.levels {
                l.store(level.0, Ordering::Relaxed);
            }
        });
    }

    /// Sets the flight recorder's own level (what it keeps even when nothing is traced).
    pub fn set_recorder_level(&self, level: Level) {
        self.change(|c| c.recorder.store(level.0, Ordering::Relaxed));
    }

    /// Gives QP `qpn` its own level ([`Level::OFF`] removes it). Fails when
    /// [`MAX_QP_LEVELS`] QPs have one already.
    pub fn set_qp_level(&self, qpn: u32, level: Level) -> Result<(), TraceError> {
        let mut result = Ok(());
        self.change(|c| result = c.set_qp_locked(qpn, level));
        result
    }

    /// Removes every QP's own level.
    pub fn clear_qp_levels(&self) {
        self.change(|c| {
            for s in &c.qp_slots {
                s.store(0, Ordering::Relaxed);
            }
        });
    }

    /// Applies a spec: `default` first, then the rest in order. Stops at the first per-QP
    /// level that does not fit (what came before it stays applied).
    pub fn apply(&self, spec: &TraceSpec) -> Result<(), TraceError> {
        let mut result = Ok(());
        self.change(|c| {
            if let Some(l) = spec.default {
                for s in &c.levels {
                    s.store(l.0, Ordering::Relaxed);
                }
            }
            for (comp, l) in &spec.components {
                c.levels[comp.index()].store(l.0, Ordering::Relaxed);
            }
            if let Some(l) = spec.other {
                c.levels[FOREIGN].store(l.0, Ordering::Relaxed);
            }
            if let Some(l) = spec.recorder {
                c.recorder.store(l.0, Ordering::Relaxed);
            }
            if spec.clear_qps {
                for s in &c.qp_slots {
                    s.store(0, Ordering::Relaxed);
                }
            }
            for (qpn, l) in &spec.qps {
                if let Err(e) = c.set_qp_locked(*qpn, *l) {
                    result = Err(e);
                    return;
                }
            }
        });
        result
    }

    /// Parses `spec` (see [`TraceSpec`]) and applies it.
    pub fn apply_str(&self, spec: &str) -> Result<(), TraceError> {
        self.apply(&spec.parse()?)
    }

    /// A copy of every level.
    pub fn levels(&self) -> TraceLevels {
        let mut qps: Vec<QpLevel> = self
            .qp_slots
            .iter()
            .filter_map(|s| {
                let v = s.load(Ordering::Relaxed);
                (v & QP_OCCUPIED != 0).then_some(QpLevel {
                    qpn: (v & 0xffff_ffff) as u32,
                    level: Level(((v >> 32) & 0xff) as u8),
                })
            })
            .collect();
        qps.sort_by_key(|q| q.qpn);
        TraceLevels {
            components: Component::ALL
                .into_iter()
                .map(|c| (c, self.level(c)))
                .collect(),
            other: self.other_level(),
            recorder: self.recorder_level(),
            qps,
        }
    }

    fn set_qp_locked(&self, qpn: u32, level: Level) -> Result<(), TraceError> {
        let value = QP_OCCUPIED | u64::from(level.0) << 32 | u64::from(qpn);
        let own = self.qp_slots.iter().find(|s| {
            let v = s.load(Ordering::Relaxed);
            v & QP_OCCUPIED != 0 && (v & 0xffff_ffff) as u32 == qpn
        });
        if let Some(s) = own {
            s.store(
                if level == Level::OFF { 0 } else { value },
                Ordering::Relaxed,
            );
            return Ok(());
        }
        if level == Level::OFF {
            return Ok(());
        }
        match self
            .qp_slots
            .iter()
            .find(|s| s.load(Ordering::Relaxed) == 0)
        {
            Some(s) => {
                s.store(value, Ordering::Relaxed);
                Ok(())
            }
            None => Err(TraceError::TooManyQpLevels { max: MAX_QP_LEVELS }),
        }
    }

    /// Runs a change under the writer lock, recomputes the gates, and has `tracing` re-ask
    /// every callsite (our filters answer "never" for callsites no level can enable).
    fn change(&self, f: impl FnOnce(&Self)) {
        {
            let _w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
            f(self);
            let (mut qp_max, mut qp_mask) = (0u8, 0u64);
            for s in &self.qp_slots {
                let v = s.load(Ordering::Relaxed);
                if v & QP_OCCUPIED != 0 {
                    qp_max = qp_max.max(((v >> 32) & 0xff) as u8);
                    qp_mask |= 1 << ((v & 0xffff_ffff) % 64);
                }
            }
            self.qp_max.store(qp_max, Ordering::Relaxed);
            self.qp_mask.store(qp_mask, Ordering::Relaxed);
            let recorder = self.recorder.load(Ordering::Relaxed);
            for (gate, level) in self.gates.iter().zip(&self.levels) {
                let l = level.load(Ordering::Relaxed);
                gate.store(l.max(recorder).max(qp_max), Ordering::Relaxed);
            }
        }
        tracing::callsite::rebuild_interest_cache();
    }
}

/// The process-wide trace levels that [`sw_event!`](crate::sw_event), [`TraceFilter::global`] and the control
/// socket use.
pub fn control() -> &'static TraceControl {
    static CONTROL: TraceControl = TraceControl::new();
    &CONTROL
}

/// False when the crate is built with the `max_level_off` feature: every [`sw_event!`](crate::sw_event) is then
/// a constant-false branch the compiler removes, and `tracing`'s own macros are compiled out
/// by its `max_level_off` feature (enabled along with ours). Levels can still be set and read,
/// but no record is ever produced, neither for subscribers nor for the flight recorder. The
/// build exists to measure what tracing costs (BENCHMARKS-history.md, "RAS overhead").
pub const COMPILED_IN: bool = !cfg!(feature = "max_level_off");

/// The path of the function that contains a [`sw_event!`](crate::sw_event): the macro names a
/// local `fn __sw_here` and passes its type name (`crate::module::function::__sw_here`),
/// which the compiler spells out; this drops the last segment. Not for other uses.
#[doc(hidden)]
pub fn function_path(marker: &'static str) -> &'static str {
    marker.strip_suffix("::__sw_here").unwrap_or(marker)
}

/// Applies `SOFTWARP_TRACE` (if set) to [`control()`].
pub fn init_from_env() -> Result<(), TraceError> {
    match std::env::var(TRACE_ENV) {
        Ok(spec) => control().apply_str(&spec),
        Err(_) => Ok(()),
    }
}

/// Emits a Softwarp trace record: component, level 1-9, optionally the QP number, then
/// `tracing` fields and/or a format string.
///
/// ```
/// use softwarp_ras::sw_event;
/// let (qpn, len) = (7u32, 4096usize);
/// sw_event!(Qp, 4, qpn = qpn, len, "post_send");
/// sw_event!(Cq, 2, "completion queue overflow");
/// sw_event!(Engine, 9, qpn = qpn, bytes = ?[1u8, 2, 3]);
/// ```
///
/// The component is a [`Component`] variant name; the level must be a constant in 1..=9
/// (checked at compile time). The first check is one relaxed atomic load
/// ([`TraceControl::gate`]); the QP number expression is evaluated only after it passes.
/// The record's file, line, module path and function come from the call site (the function
/// as the path the compiler gives a local marker item, only once the gate passed); the layers
/// add cpu, thread id and time.
#[macro_export]
macro_rules! sw_event {
    ($comp:ident, $lvl:expr, qpn = $qpn:expr) => {
        $crate::sw_event!($comp, $lvl, qpn = $qpn, "")
    };
    ($comp:ident, $lvl:expr, qpn = $qpn:expr, $($rest:tt)+) => {{
        const __SW_LEVEL: u8 = $lvl;
        const _: () = ::core::assert!(
            __SW_LEVEL >= 1 && __SW_LEVEL <= 9,
            "Softwarp trace levels are 1..=9"
        );
        if $crate::trace::COMPILED_IN
            && $crate::trace::control().gate($crate::trace::Component::$comp, __SW_LEVEL)
        {
            let __sw_qpn: u32 = $qpn;
            let __sw_comp = $crate::trace::Component::$comp;
            if $crate::trace::control().wanted(__sw_comp, __SW_LEVEL, __sw_qpn) {
                fn __sw_here() {}
                let __sw_fn = $crate::trace::function_path(::core::any::type_name_of_val(&__sw_here));
                $crate::__private::tracing::event!(
                    name: $crate::trace::level_name(__SW_LEVEL),
                    target: $crate::trace::Component::$comp.target(),
                    $crate::trace::tracing_level(__SW_LEVEL),
                    swfn = __sw_fn,
                    qpn = __sw_qpn,
                    $($rest)+
                );
            }
        }
    }};
    ($comp:ident, $lvl:expr, $($rest:tt)+) => {{
        const __SW_LEVEL: u8 = $lvl;
        const _: () = ::core::assert!(
            __SW_LEVEL >= 1 && __SW_LEVEL <= 9,
            "Softwarp trace levels are 1..=9"
        );
        if $crate::trace::COMPILED_IN
            && $crate::trace::control().gate($crate::trace::Component::$comp, __SW_LEVEL)
        {
            fn __sw_here() {}
            let __sw_fn = $crate::trace::function_path(::core::any::type_name_of_val(&__sw_here));
            $crate::__private::tracing::event!(
                name: $crate::trace::level_name(__SW_LEVEL),
                target: $crate::trace::Component::$comp.target(),
                $crate::trace::tracing_level(__SW_LEVEL),
                swfn = __sw_fn,
                $($rest)+
            );
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_component_round_trips_through_its_name_and_target() {
        for c in Component::ALL {
            assert_eq!(Component::from_name(c.as_str()), Some(c));
            assert_eq!(Component::from_target(c.target()), Some(c));
            assert_eq!(
                Component::from_target(&format!("{}::inner", c.target())),
                Some(c)
            );
        }
    }

    #[test]
    fn a_target_splits_at_its_first_path_separator() {
        assert_eq!(
            split_path("softwarp::qp::pump"),
            ("softwarp", Some("qp::pump"))
        );
        assert_eq!(split_path("qp::pump"), ("qp", Some("pump")));
        assert_eq!(split_path("softwarp"), ("softwarp", None));
        assert_eq!(split_path("softwarp::"), ("softwarp", Some("")));
        assert_eq!(split_path(""), ("", None));
        assert_eq!(split_path("é::ü"), ("é", Some("ü")));
        assert_eq!(
            Component::from_target("softwarp::qp::pump"),
            Some(Component::Qp)
        );
        assert_eq!(Component::from_target("softwarp::cm"), Some(Component::Cm));
        assert_eq!(Component::from_target("mio::poll"), None);
    }

    #[test]
    fn targets_of_the_workspace_crates_map_to_components() {
        assert_eq!(
            Component::from_target("softwarp::verbs::device"),
            Some(Component::Runtime)
        );
        assert_eq!(
            Component::from_target("softwarp::verbs::pd"),
            Some(Component::Mr)
        );
        assert_eq!(
            Component::from_target("softwarp::verbs::qp::pump"),
            Some(Component::Qp)
        );
        assert_eq!(
            Component::from_target("softwarp::verbs::cq"),
            Some(Component::Cq)
        );
        assert_eq!(
            Component::from_target("softwarp::verbs::srq"),
            Some(Component::Qp)
        );
        assert_eq!(
            Component::from_target("softwarp::verbs"),
            Some(Component::Runtime)
        );
        assert_eq!(
            Component::from_target("softwarp::cm::connect"),
            Some(Component::Cm)
        );
        assert_eq!(
            Component::from_target("softwarp::runtime::progress"),
            Some(Component::Runtime)
        );
        assert_eq!(
            Component::from_target("softwarp::availability::recovery"),
            Some(Component::Runtime)
        );
        assert_eq!(Component::from_target("softwarp"), Some(Component::Runtime));
        assert_eq!(
            Component::from_target("softwarp_wire::mpa"),
            Some(Component::Wire)
        );
        assert_eq!(
            Component::from_target("softwarp_engine::qp"),
            Some(Component::Engine)
        );
        assert_eq!(
            Component::from_target("softwarp_cli"),
            Some(Component::Runtime)
        );
        assert_eq!(Component::from_target("softwarpx::qp"), None);
        assert_eq!(Component::from_target("mio::poll"), None);
    }

    #[test]
    fn levels_map_monotonically_onto_tracing_levels() {
        // More verbose Softwarp levels never map to a less verbose tracing level (tracing
        // orders TRACE above ERROR).
        for n in 1..9u8 {
            assert!(tracing_level(n) <= tracing_level(n + 1));
        }
        for l in [
            tracing::Level::ERROR,
            tracing::Level::WARN,
            tracing::Level::INFO,
            tracing::Level::DEBUG,
            tracing::Level::TRACE,
        ] {
            // A plain tracing event's level maps back onto the same tracing level.
            assert_eq!(Level::from_tracing(&l).tracing_level(), l);
        }
        assert_eq!(Level::new(10), None);
        assert_eq!(Level::try_from(9u8), Ok(Level::DATA));
    }

    #[test]
    fn level_names_carry_the_exact_level() {
        for n in 1..=9u8 {
            assert_eq!(level_from_name(level_name(n)), Some(n));
        }
        assert_eq!(level_from_name("event src/x.rs:1"), None);
        assert_eq!(level_from_name("swl0"), None);
    }

    #[test]
    fn component_level_decides_what_is_traced() {
        let c = TraceControl::new();
        assert!(c.traced(Some(Component::Qp), 1, None));
        assert!(!c.traced(Some(Component::Qp), 5, None));
        c.set_level(Component::Qp, Level::INTERNALS);
        assert!(c.traced(Some(Component::Qp), 5, None));
        assert!(!c.traced(Some(Component::Qp), 6, None));
        assert!(!c.traced(Some(Component::Cq), 5, None));
        c.set_level(Component::Qp, Level::OFF);
        assert!(!c.traced(Some(Component::Qp), 1, None));
    }

    #[test]
    fn a_qp_level_raises_only_that_qp() {
        let c = TraceControl::new();
        c.set_qp_level(17, Level::DATA).unwrap();
        assert!(c.traced(Some(Component::Engine), 9, Some(17)));
        assert!(!c.traced(Some(Component::Engine), 9, Some(18)));
        // Same bit of the quick mask, another QP.
        assert!(!c.traced(Some(Component::Engine), 9, Some(17 + 64)));
        assert!(!c.traced(Some(Component::Engine), 9, None));
        assert!(c.gate(Component::Engine, 9), "the gate opens for any QP");
        c.set_qp_level(17, Level::OFF).unwrap();
        assert!(!c.traced(Some(Component::Engine), 9, Some(17)));
        assert!(!c.gate(Component::Engine, 9));
        assert!(c.levels().qps.is_empty());
    }

    #[test]
    fn qp_level_slots_are_bounded_and_reusable() {
        let c = TraceControl::new();
        for q in 0..MAX_QP_LEVELS as u32 {
            c.set_qp_level(q, Level::HOT_INTERNALS).unwrap();
        }
        assert_eq!(
            c.set_qp_level(1000, Level::DATA),
            Err(TraceError::TooManyQpLevels { max: MAX_QP_LEVELS })
        );
        // Updating an existing QP needs no new slot.
        c.set_qp_level(3, Level::DATA).unwrap();
        assert_eq!(c.qp_level(3), Some(Level::DATA));
        c.set_qp_level(0, Level::OFF).unwrap();
        c.set_qp_level(1000, Level::DATA).unwrap();
        assert_eq!(c.qp_level(1000), Some(Level::DATA));
        c.clear_qp_levels();
        assert!(c.levels().qps.is_empty());
    }

    #[test]
    fn the_recorder_level_keeps_records_that_are_not_traced() {
        let c = TraceControl::new();
        c.set_recorder_level(Level::INTERNALS);
        assert!(!c.traced(Some(Component::Cq), 5, None));
        assert!(c.recorded(Some(Component::Cq), 5, None));
        assert!(!c.recorded(Some(Component::Cq), 6, None));
        assert!(c.gate(Component::Cq, 5));
        assert!(!c.gate(Component::Cq, 6));
    }

    #[test]
    fn apply_sets_default_first_then_the_named_levels() {
        let c = TraceControl::new();
        c.apply_str("qp=5,default=2,recorder=3,other=0,qpn:9=8")
            .unwrap();
        assert_eq!(c.level(Component::Qp), Level::INTERNALS);
        assert_eq!(c.level(Component::Wire), Level::RARE);
        assert_eq!(c.other_level(), Level::OFF);
        assert_eq!(c.recorder_level(), Level(3));
        assert_eq!(c.qp_level(9), Some(Level::HOT_INTERNALS));
        // trace-get output is itself a valid spec that reproduces the levels.
        let levels = c.levels();
        let again = TraceControl::new();
        again.apply(&levels.to_spec()).unwrap();
        assert_eq!(again.levels(), levels);
        let text = levels.to_spec().to_string();
        let third = TraceControl::new();
        third.apply_str(&text).unwrap();
        assert_eq!(third.levels(), levels);
    }
}
