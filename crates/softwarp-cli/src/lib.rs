//! The `softwarp` command's library half: capture reading and iWARP decoding (and dump
//! decoding), and the operator commands (`resources`, `stat`, `trace`, `snapshots`, `dump`,
//! `doctor`) and `exec`'s library setup, kept out of `main.rs` so that tests can call them directly.
// `unsafe` only in `sysfs_view` (the `unshare` system call); denied everywhere else.
#![deny(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    warn(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub mod admin;
pub mod capture;
pub mod decode;
pub mod exec;
pub mod install;
pub mod sysfs_view;
