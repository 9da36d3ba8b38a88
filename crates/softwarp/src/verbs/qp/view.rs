//! What RAS reads of a QP, copied under its lock ([`QpView`]); `crate::ras` turns it into
//! the QP's description and statistics.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::fd::BorrowedFd;

use softwarp_engine::qp::{Qp, QpState};
use softwarp_engine::stats::QpStats;
use softwarp_ras::stats::TcpInfo;

use super::options::ConnectionInfo;
use crate::instrument::QpRas;
use crate::sync::lock;

/// What RAS reports about a QP, copied under its lock.
#[derive(Debug, Clone)]
pub(crate) struct QpView {
    pub(crate) qpn: u32,
    pub(crate) state: QpState,
    pub(crate) stats: QpStats,
    pub(crate) sq: usize,
    pub(crate) rq: usize,
    pub(crate) reads: usize,
    pub(crate) connected: bool,
    pub(crate) conn: Option<ConnSummary>,
    pub(crate) tcp: Option<TcpInfo>,
    pub(crate) attrs: BTreeMap<String, String>,
    pub(crate) addrs: Option<(SocketAddr, SocketAddr)>,
}

/// The part of a [`QpView`] the device's sums over its QPs use.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QpCountersView {
    pub(crate) state: QpState,
    pub(crate) stats: QpStats,
    pub(crate) sq: usize,
    pub(crate) rq: usize,
    pub(crate) reads: usize,
}

impl QpView {
    /// Its counters part.
    pub(crate) fn counters(&self) -> QpCountersView {
        QpCountersView {
            state: self.state,
            stats: self.stats,
            sq: self.sq,
            rq: self.rq,
            reads: self.reads,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnSummary {
    pub(crate) revision: u8,
    pub(crate) crc: bool,
    pub(crate) ird: usize,
    pub(crate) ord: usize,
    pub(crate) mss: usize,
    pub(crate) max_fpdu_len: usize,
}

impl QpView {
    /// The view of `qp` (call with the QP locked); samples TCP_INFO of `fd` when due.
    pub(crate) fn take(
        ras: &QpRas,
        qp: &Qp,
        info: Option<&ConnectionInfo>,
        fd: Option<BorrowedFd<'_>>,
    ) -> Self {
        ras.state_seen(qp.state());
        ras.sample_tcp(fd);
        Self {
            qpn: ras.qpn,
            state: qp.state(),
            stats: *qp.stats(),
            sq: qp.sq_len(),
            rq: qp.rq_len(),
            reads: qp.outstanding_reads(),
            connected: fd.is_some(),
            conn: info.map(|i| ConnSummary {
                revision: i.revision,
                crc: i.crc,
                ird: i.ird,
                ord: i.ord,
                mss: i.mss,
                max_fpdu_len: i.max_fpdu_len,
            }),
            tcp: ras.last_tcp(),
            attrs: ras.attrs.to_map(),
            addrs: *lock(&ras.addrs),
        }
    }

    /// Adds a runtime fact about the QP to its details (`softwarp resources`).
    pub(crate) fn with_attr(mut self, key: &str, value: &str) -> Self {
        self.attrs.insert(key.into(), value.into());
        self
    }
}
