//! Use counts of the C objects that other C objects point to, the kernel's `usecnt`: a PD
//! counts its MRs, QPs and SRQs, a CQ the QPs that complete into it (as send CQ and as
//! receive CQ: a QP with one CQ for both counts twice), an SRQ its QPs. A destroy of an
//! object whose count is not zero answers `EBUSY` and leaves it as it was, as rdma-core's
//! kernel does (`ib_destroy_usecnt`, `ib_destroy_srq_user`): the application's other
//! objects keep pointers to it (`ibv_qp.send_cq`, `ibv_mr.pd`, ...) that this library and
//! the application read later. Softwarp's Rust objects hold each other by `Arc`, so the Rust
//! API needs no such rule; the C structures do.
//!
//! A count is taken once the using object exists and given back once it is gone. Counts are
//! atomic; like rdma-core, the library does not order a destroy against a concurrent create
//! that names the same object (the application may not use an object it is destroying).

use std::sync::atomic::{AtomicUsize, Ordering};

/// The number of live objects that use an object.
#[derive(Debug, Default)]
pub struct Users(AtomicUsize);

impl Users {
    pub const fn new() -> Self {
        Self(AtomicUsize::new(0))
    }

    /// One more object uses it.
    pub fn add(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }

    /// An object that used it is gone.
    pub fn remove(&self) {
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    /// True while some object uses it.
    pub fn busy(&self) -> bool {
        self.0.load(Ordering::Acquire) != 0
    }
}
