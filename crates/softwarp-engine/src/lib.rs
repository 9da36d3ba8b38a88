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
#[allow(dead_code)] // the QP module uses the crate-internal parts
pub mod fault;
#[allow(unsafe_code, dead_code)]
pub mod memory;
pub mod mr;
// Used by the QP module (data path rings); some helpers are only used there.
#[allow(dead_code)]
pub(crate) mod ring;
pub mod srq;
pub mod stats;
pub mod wr;
