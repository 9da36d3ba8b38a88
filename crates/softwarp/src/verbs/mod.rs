//! The verbs objects (names after libibverbs): [`device`] → [`pd`] (protection domains and
//! memory regions, [`owned`] buffers registered by value), [`cq`] (+ completion channels),
//! [`srq`], and [`qp`] (the QP handle and the state it shares with the progress thread).

pub(crate) mod cq;
pub(crate) mod device;
pub(crate) mod hooks;
pub mod owned;
pub(crate) mod pd;
pub(crate) mod qp;
pub(crate) mod srq;
