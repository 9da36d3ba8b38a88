//! Softwarp RAS services: what makes every Softwarp process observable and diagnosable by
//! an operator who did not write it, without restarting anything.
//!
//! The crate is generic over what it observes: it knows resource *kinds* and counters, not
//! QPs and CQs. The verbs layer (`softwarp`) plugs its objects in with a few lines each.
//!
//! | module | what |
//! | --- | --- |
//! | [`trace`] | levels 1-9 per component and per QP in atomics, changeable at run time; the [`sw_event!`] macro; `tracing-subscriber` filters; the flight recorder; a console layer |
//! | [`tracker`] | resource registry: owner pid, process, thread, `#[track_caller]` location, creation time, bytes per kind; live details; leak report |
//! | [`registry`] | host registry: one JSON file per process in the runtime directory; stale entries detected and cleaned |
//! | [`control`] | control socket (JSON lines over a Unix socket) with a handler trait; the client the CLI uses |
//! | [`stats`] | counters and gauges as JSON and Prometheus text; TCP_INFO sampling; the opt-in `/metrics` endpoint |
//! | [`health`] | device states, faults and bounded recovery (holders here and in other processes, termination of listed processes); the devices that answer `fault-inject`/`fault-status` |
//! | [`errlog`] | critical events as JSON lines with a recommended action, rotated by size |
//! | [`snapshot`] | bounded history of QP snapshots (state, counters, TCP_INFO, records) taken when a QP fails |
//! | [`dump`] | component dump: the whole RAS state in a self-describing file; its parser; automatic dumps |
//! | [`service`] | starts all of the above for a process in one call |
//! | [`deadline`] | a caller's timeout as a point in time, `Duration::MAX` meaning none (used by `softwarp` too) |
//!
//! Nothing starts by itself: no thread, no file and no global `tracing` subscriber until a
//! caller starts a [`service`] (the `softwarp` crate does only when the application or the
//! operator's `SOFTWARP_RAS=on` asks). Records always go through the `tracing` facade; the
//! flight recorder is fed by [`trace::recorder_layer`] in whatever subscriber the process
//! has. Threads, once started: the control socket has one accept thread (plus one per open
//! connection, at most 8), the metrics endpoint one; nothing else runs in the background. Every loop is
//! bounded and every wait has a timeout. `unsafe` is confined to [`sys`] (libc calls).
//!
//! # Wiring (what the `softwarp` crate does)
//!
//! ```
//! use std::sync::{Arc, Weak};
//! use softwarp_ras::tracker::{DescribeResource, ResourceDetails, ResourceHandle, ResourceKind, Tracker};
//! use softwarp_ras::stats::{self, StatsBuilder, StatsSource};
//! use softwarp_ras::sw_event;
//!
//! struct DeviceShared { tracker: Tracker, handle: Option<ResourceHandle> }
//! impl StatsSource for DeviceShared {
//!     fn collect(&self, out: &mut StatsBuilder) {
//!         out.gauge_int("softwarp_device_resources", "Resources allocated.", &[("device", "softwarp0")], self.tracker.len() as u64);
//!     }
//! }
//!
//! struct QpShared { qpn: u32, handle: Option<ResourceHandle> }
//! impl DescribeResource for QpShared {
//!     fn describe(&self) -> ResourceDetails {
//!         ResourceDetails { state: Some("RTS".into()), ..Default::default() }
//!     }
//! }
//!
//! // Device::open (when the application asked for RAS: service::start_global(&config))
//! let tracker = Tracker::new("softwarp0");
//! let handle = tracker.register(ResourceKind::Device, 0, 0);
//! let dev = Arc::new(DeviceShared { tracker: tracker.clone(), handle: Some(handle) });
//! stats::register_source(Arc::downgrade(&dev) as Weak<dyn StatsSource>);
//!
//! // create_qp (a #[track_caller] verbs entry point)
//! let qp = Arc::new_cyclic(|weak: &Weak<QpShared>| {
//!     let h = dev.tracker.register(ResourceKind::Qp, 1, 8192);
//!     h.set_describer(weak.clone() as Weak<dyn DescribeResource>);
//!     QpShared { qpn: 1, handle: Some(h) }
//! });
//! sw_event!(Qp, 4, qpn = qp.qpn, "create_qp");
//!
//! // Device close: report leaks (the QP above is still alive).
//! let report = dev.tracker.leak_report(dev.handle.as_ref());
//! assert_eq!(report.leaked.len(), 1);
//! if !report.is_empty() {
//!     softwarp_ras::errlog::report(&softwarp_ras::errlog::CriticalEvent::leak(&report));
//! }
//! ```
#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    warn(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]
// `Instant + Duration` panics on a large duration: deadlines go through `deadline` (the
// workspace's clippy.toml exempts the primitive number types from this lint).
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

pub mod clock;
pub mod control;
pub mod deadline;
pub mod dump;
pub mod errlog;
pub mod health;
pub mod markers;
pub mod registry;
pub mod service;
pub mod snapshot;
pub mod stats;
pub mod sys;
pub mod thread;
pub mod trace;
pub mod tracker;

#[doc(hidden)]
pub mod __private {
    pub use tracing;
}
