//! RAS wiring of the verbs objects (the services themselves live in `softwarp_ras`), by
//! object: `device`, `qp`, `cq`. Nothing in the crate imports this module: the objects
//! reach it through the device's [`RasHooks`] (which [`Wiring`] implements and the crate
//! root installs at every device open) and the `softwarp_ras` traits they are registered
//! under (`DescribeResource`, `StatsSource`); what they carry themselves is
//! `crate::instrument`.
//!
//! - **Resources**: every device, PD, MR, CQ, SRQ, QP and listener registers with a
//!   `Tracker` (one per device; listeners, which belong to no device, with the
//!   process-wide `instrument::cm_tracker`) through a `#[track_caller]` chain from the public
//!   constructor, so the recorded location is the application's line. QPs, CQs, SRQs and
//!   the device describe their live state; the others carry fixed details.
//! - **Statistics**: the device is a `StatsSource`: per-QP counters (engine `QpStats` and
//!   the last TCP_INFO sample), per-CQ counters and device counters.
//! - **Critical events**: QP errors with their cause, Terminates received, device faults and
//!   leaks at close go to the error log (and are level 1 trace records).
//! - **Snapshots**: a QP that fails (Terminate received or sent, local failure, device
//!   fault) is copied into the process's snapshot history once per connection, under the
//!   QP lock the event handler already holds (the history, the flight recorder and the
//!   QP's own RAS locks are leaves: nothing is called out to while they are held); its
//!   error log line names the snapshot. A device fault also writes an automatic component
//!   dump (while the RAS services run), on the injecting thread with no lock held.
//! - **Tracing**: QP state changes, connections, Terminates (levels 1-2); the hot path
//!   (post, poll: 7; FPDU bytes: 8) emits through `sw_event!`, which costs one relaxed load
//!   while disabled.
//!
//! No I/O here except reading TCP_INFO of a QP's socket for a statistics request (the
//! sampler is the QP's, in `instrument`) and the dump of a device fault.

use std::os::fd::BorrowedFd;

use softwarp_engine::event::AsyncEvent;
use softwarp_engine::qp::Qp;
use softwarp_ras::errlog::CriticalKind;
use softwarp_ras::health::RecoveryReport;

use crate::instrument::{QpRas, Tracked};
use crate::verbs::device::DeviceShared;
use crate::verbs::hooks::RasHooks;
use crate::verbs::qp::options::ConnectionInfo;

mod cq;
mod device;
mod qp;

/// The RAS wiring every device gets at open.
#[derive(Debug)]
pub(crate) struct Wiring;

impl RasHooks for Wiring {
    fn device_closed(&self, dev: &DeviceShared, device: &Tracked) {
        device::device_closed(dev, device);
    }
    fn device_failed(&self, dev: &DeviceShared, fault: &str, qps: usize, snapshots: &[u64]) {
        device::device_failed(dev, fault, qps, snapshots);
    }
    fn device_fault_dump(&self, fault: &str) {
        device::device_fault_dump(fault);
    }
    fn device_recovery(&self, dev: &DeviceShared, report: &RecoveryReport) {
        device::device_recovery(dev, report);
    }
    fn network_gone(&self, dev: &DeviceShared, qpn: u32, detail: &str, snapshot: Option<u64>) {
        device::network_gone(dev, qpn, detail, snapshot);
    }
    fn qp_event(
        &self,
        ras: &QpRas,
        ev: &AsyncEvent,
        qp: &Qp,
        info: Option<&ConnectionInfo>,
        fd: Option<BorrowedFd<'_>>,
    ) {
        ras.on_event(ev, qp, info, fd);
    }
    fn qp_snapshot(
        &self,
        ras: &QpRas,
        kind: CriticalKind,
        reason: String,
        qp: &Qp,
        info: Option<&ConnectionInfo>,
        fd: Option<BorrowedFd<'_>>,
    ) -> Option<u64> {
        ras.snapshot(kind, reason, qp, info, fd)
    }
    fn qp_connected(&self, ras: &QpRas, info: &ConnectionInfo) {
        ras.connected(info);
    }
    fn peer_unreachable(&self, ras: &QpRas, detail: &str) {
        ras.peer_unreachable(detail);
    }
    fn peer_violation(&self, ras: &QpRas, detail: String, snapshot: Option<u64>) {
        ras.peer_violation(detail, snapshot);
    }
}
