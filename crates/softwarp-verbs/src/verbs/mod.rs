//! libibverbs: devices, contexts, PDs, MRs, CQs, SRQs, QPs and the fast-path operations.

pub mod compat;
pub mod context;
pub mod cq;
pub mod cq_ex;
pub mod foreign;
pub mod marshall;
pub mod mr;
pub mod qp;
pub mod qp_ex;
pub mod users;
