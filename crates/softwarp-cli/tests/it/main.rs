//! The integration tests of the `softwarp` command, one binary (one link): a module per
//! former test file. `support` builds synthetic captures for the decoder tests.

use std::process::Command;

mod support;

mod admin;
mod bench;
mod capture_props;
mod decode_damaged;
mod decode_synthetic;
mod demo;
mod exec;
mod exec_sockets;
mod exec_sysfs;
mod golden_captures;
mod markers_decode;

/// The `softwarp` binary cargo built for these tests.
fn softwarp() -> Command {
    Command::new(env!("CARGO_BIN_EXE_softwarp"))
}
