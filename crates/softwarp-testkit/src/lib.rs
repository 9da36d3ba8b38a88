//! What Softwarp's integration tests share, written once: what a test needs from the
//! machine ([`require`]: a skip on a user's machine, a failure under `CI=true`), free ports,
//! one process-wide lock, children reaped on panic, the build's own artifacts, network
//! namespaces ([`netns`]), short connect options, a recording writer for the engine's
//! transmit path, and the stand-in host rdma-core of the device layer's tests.
//!
//! A dev-dependency only (`publish = false`): nothing here is part of Softwarp's API. It
//! panics freely: a panic in a test helper is a test failure with its message.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod artifacts;
#[cfg(feature = "softwarp")]
mod connect;
mod fake_host;
mod listen;
pub mod netns;
mod process;
mod require;
#[cfg(feature = "engine")]
mod writer;

pub use artifacts::{example, library, profile_dir};
#[cfg(feature = "softwarp")]
pub use connect::quick;
pub use fake_host::fake_host_ibverbs;
pub use listen::{listening, listening_in, wait_listening, wait_listening_in, TCP_TABLES};
pub use process::{Reaped, SpawnReaped};
pub use require::{file, have, in_ci, is_root, require, root, skip, tool, File, Need, Root, Tool};
#[cfg(feature = "engine")]
pub use writer::{RecordingWriter, WriteCall, WrittenPiece};

/// A TCP port on 127.0.0.1 that was free a moment ago (the listener that found it is closed
/// again, so another process may take it first: for programs that must be told a port).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind an ephemeral port on 127.0.0.1")
        .port()
}

/// The one lock of this test process: tests that must not overlap with each other (they
/// count the process's descriptors, listen on a fixed port, capture on `lo`) take it for
/// their whole run. A test that panicked while holding it does not poison it for the rest.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `len` bytes that show a misplaced or lost block (a xorshift sequence, not a pattern that
/// repeats every few bytes): the payload of the echo tests.
pub fn payload(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
