//! What the verbs objects tell RAS: the device's hooks ([`RasHooks`]), installed at open.
//! `crate::ras` implements them; the crate root installs its implementation in every
//! device (`crate::RAS_HOOKS`), so that nothing here or below knows the RAS wiring. They
//! are called per event (a QP's asynchronous event, its connection, a device fault), never
//! per message: the per-message RAS work (the state-change check, TCP_INFO sampling) is
//! the objects' own ([`QpRas`]).

use std::fmt::Debug;
use std::os::fd::BorrowedFd;

use softwarp_engine::event::AsyncEvent;
use softwarp_engine::qp::Qp;
use softwarp_ras::errlog::CriticalKind;
use softwarp_ras::health::RecoveryReport;

use crate::instrument::{QpRas, Tracked};
use crate::verbs::device::DeviceShared;
use crate::verbs::qp::options::ConnectionInfo;

/// The RAS wiring of a device and its objects, as they call it.
pub(crate) trait RasHooks: Debug + Send + Sync + 'static {
    /// The last `Device` handle is gone (`device`: its registration): reports what is still
    /// allocated.
    fn device_closed(&self, dev: &DeviceShared, device: &Tracked);
    /// A fault of the device was contained: `qps` QPs moved to Error, `snapshots` taken.
    fn device_failed(&self, dev: &DeviceShared, fault: &str, qps: usize, snapshots: &[u64]);
    /// The automatic dump of a device fault (file and network I/O: call with no lock held).
    fn device_fault_dump(&self, fault: &str);
    /// A recovery of the device ended.
    fn device_recovery(&self, dev: &DeviceShared, report: &RecoveryReport);
    /// QP `qpn`, whose network went away, was terminated (`snapshot`: its failure's).
    fn network_gone(&self, dev: &DeviceShared, qpn: u32, detail: &str, snapshot: Option<u64>);
    /// An asynchronous event of a QP, under its lock, before it goes to the device's queue.
    fn qp_event(
        &self,
        ras: &QpRas,
        ev: &AsyncEvent,
        qp: &Qp,
        info: Option<&ConnectionInfo>,
        fd: Option<BorrowedFd<'_>>,
    );
    /// Takes a QP's failure snapshot (`kind`, `reason`) unless its connection has one;
    /// returns its id. Under the QP's lock (`qp` is its engine state).
    fn qp_snapshot(
        &self,
        ras: &QpRas,
        kind: CriticalKind,
        reason: String,
        qp: &Qp,
        info: Option<&ConnectionInfo>,
        fd: Option<BorrowedFd<'_>>,
    ) -> Option<u64>;
    /// A QP connected (MPA exchange done, RTS).
    fn qp_connected(&self, ras: &QpRas, info: &ConnectionInfo);
    /// The kernel timed a QP's connection out (`detail`: the error and what it means).
    fn peer_unreachable(&self, ras: &QpRas, detail: &str);
    /// A QP's peer broke the protocol above RDMAP (`detail`, the whole sentence).
    fn peer_violation(&self, ras: &QpRas, detail: String, snapshot: Option<u64>);
}
