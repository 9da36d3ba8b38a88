//! Shared receive queues (after `ibv_srq`): one pool of receive work requests for several
//! QPs, with the limit event ([`SharedReceiveQueue::arm_limit`]) reported on the device's
//! asynchronous event stream.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use softwarp_engine::srq::{Srq, SrqId};
use softwarp_engine::wr::RecvWr;
use softwarp_ras::tracker::{DescribeResource, ResourceDetails, ResourceKind};

use crate::availability::inflight::Entry;
use crate::error::{Error, Result};
use crate::instrument::{attrs, Tracked};
use crate::sync::lock;
use crate::verbs::device::{CountGuard, Counts, DeviceShared};
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::qp::QpShared;

/// Creation parameters of a shared receive queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SrqInitAttr {
    /// Most receive work requests queued.
    pub max_wr: usize,
    /// Most scatter/gather elements per receive work request.
    pub max_sge: usize,
    /// Limit armed at creation (0: not armed); see [`SharedReceiveQueue::arm_limit`].
    pub srq_limit: usize,
}

#[derive(Debug)]
pub(crate) struct SrqShared {
    device: Arc<DeviceShared>,
    srq: Mutex<Srq>,
    max_sge: usize,
    count: Mutex<CountGuard>,
    /// The SRQ's number, reserved while it lives.
    _number: crate::verbs::device::IdLease,
    /// The QPs that receive from it (held weakly): a post after one of them found the SRQ
    /// empty and holds a Send for a receive (the RNR wait) has them read again.
    qps: Mutex<Vec<Weak<QpShared>>>,
}

impl Drop for SrqShared {
    fn drop(&mut self) {
        lock(&self.count).release(&self.device.counts.srq);
    }
}

impl SrqShared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Srq> {
        lock(&self.srq)
    }
    /// Live details for `softwarp resources`.
    fn details(&self) -> ResourceDetails {
        let srq = self.lock();
        ResourceDetails {
            state: Some("OK".into()),
            attrs: attrs([
                ("pd", srq.pd().0.to_string()),
                ("posted", srq.len().to_string()),
                ("max_sge", self.max_sge.to_string()),
                (
                    "limit",
                    srq.limit()
                        .map_or_else(|| "-".to_string(), |l| l.to_string()),
                ),
            ]),
            markers: crate::availability::markers::ring_words(&[srq.ring_guard()]),
            ..ResourceDetails::default()
        }
    }

    /// Adds `qp`, which receives from this SRQ, to those a post resumes (dropping those
    /// gone).
    pub(crate) fn add_qp(&self, qp: &Arc<QpShared>) {
        let mut qps = lock(&self.qps);
        qps.retain(|q| q.strong_count() > 0);
        qps.push(Arc::downgrade(qp));
    }

    /// A receive was posted after a QP found the SRQ empty (the RNR wait): each QP on
    /// the SRQ gets a progress pass, which goes on with a Send it holds.
    fn resume_waiting(&self) {
        let qps: Vec<Arc<QpShared>> = lock(&self.qps).iter().filter_map(Weak::upgrade).collect();
        for qp in qps {
            self.device.progress.kick(qp);
        }
    }

    /// Moves a pending limit event to the device's event stream.
    pub(crate) fn forward_event(&self) {
        let ev = self.lock().poll_event();
        if let Some(ev) = ev {
            self.device.events.push(ev);
        }
    }
}

/// A shared receive queue. Cloning gives another handle to the same SRQ.
#[derive(Debug, Clone)]
pub struct SharedReceiveQueue {
    pub(crate) shared: Arc<SrqShared>,
    /// Registered with the device's tracker while the application holds a handle (QPs on
    /// the SRQ keep its state alive, not this).
    _ras: Arc<Tracked>,
}

impl DescribeResource for SrqShared {
    fn describe(&self) -> ResourceDetails {
        self.details()
    }
}

impl SharedReceiveQueue {
    #[track_caller]
    pub(crate) fn new(pd: &ProtectionDomain, attr: &SrqInitAttr) -> Result<Self> {
        let device = pd.device();
        if attr.max_wr == 0 {
            return Err(Error::InvalidArgument("an SRQ needs max_wr of at least 1"));
        }
        if attr.max_wr > device.attr.max_srq_wr {
            return Err(Error::Limit {
                what: "SRQ work requests",
                requested: attr.max_wr,
                limit: device.attr.max_srq_wr,
            });
        }
        if attr.max_sge > device.attr.max_sge {
            return Err(Error::Limit {
                what: "SRQ scatter/gather elements",
                requested: attr.max_sge,
                limit: device.attr.max_sge,
            });
        }
        let count = Counts::take(
            &device.counts.srq,
            device.attr.max_srq,
            "shared receive queues",
        )?;
        let number = device.next_id()?;
        let id = SrqId(number.id());
        let mut srq = Srq::new(id, pd.id(), attr.max_wr);
        if attr.srq_limit > 0 {
            srq.arm_limit(attr.srq_limit);
        }
        let bytes = std::mem::size_of::<SrqShared>() + attr.max_wr * std::mem::size_of::<RecvWr>();
        let ras = Tracked::new(
            &device.ras.tracker,
            ResourceKind::Srq,
            u64::from(id.0),
            bytes as u64,
        );
        let shared = Arc::new(SrqShared {
            device: Arc::clone(device),
            srq: Mutex::new(srq),
            max_sge: attr.max_sge,
            count: Mutex::new(count),
            _number: number,
            qps: Mutex::new(Vec::new()),
        });
        ras.describe_with(Arc::downgrade(&shared) as Weak<dyn DescribeResource>);
        Ok(Self {
            shared,
            _ras: Arc::new(ras),
        })
    }

    pub(crate) fn device(&self) -> &Arc<DeviceShared> {
        &self.shared.device
    }

    /// The SRQ's id (as reported in the limit event).
    pub fn id(&self) -> SrqId {
        self.shared.lock().id()
    }

    /// Receive work requests queued.
    pub fn len(&self) -> usize {
        self.shared.lock().len()
    }

    /// True when no receive work request is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues a receive work request for any QP attached to this SRQ.
    pub fn post_recv(&self, wr: &RecvWr) -> Result<()> {
        let s = &self.shared;
        let _inside = s.device.enter(Entry::PostSrqRecv)?;
        if wr.sgl.len() > s.max_sge {
            return Err(Error::InvalidArgument(
                "receive work request has more SGEs than the SRQ's max_sge",
            ));
        }
        let mut srq = s.lock();
        if !srq.guards_intact() {
            let (id, guard) = (srq.id(), srq.ring_guard());
            drop(srq);
            return Err(crate::availability::markers::damaged(
                &*s.device,
                "srq",
                u64::from(id.0),
                &crate::availability::markers::ring_words(&[guard]),
                "SharedReceiveQueue::post_recv",
            ));
        }
        srq.post_recv(*wr)?;
        let resume = srq.take_rnr_waiting();
        drop(srq);
        if resume {
            s.resume_waiting();
        }
        Ok(())
    }

    /// Arms the limit event (after `ibv_modify_srq` with `IBV_SRQ_LIMIT`): when fewer than
    /// `limit` work requests remain queued, an [`softwarp_engine::event::AsyncEvent::SrqLimitReached`]
    /// is reported once and the limit is disarmed.
    pub fn arm_limit(&self, limit: usize) {
        self.shared.lock().arm_limit(limit);
    }
}
