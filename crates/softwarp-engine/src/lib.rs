//! The sans-IO software RNIC of Softwarp.
//!
//! (Crate documentation is completed together with the QP module.)
#![deny(unsafe_op_in_unsafe_fn)]
#![cfg_attr(
    not(test),
    warn(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod cq;
pub mod event;
pub mod fault;
#[allow(unsafe_code)]
pub mod memory;
pub mod mr;
pub mod qp;
pub(crate) mod ring;
pub mod srq;
pub mod stats;
pub mod wr;
