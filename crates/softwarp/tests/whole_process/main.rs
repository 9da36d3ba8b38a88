//! The tests that measure the whole process: its descriptors and threads (`floods`,
//! `cm_bounds`), its resident memory (`floods`, `soak`), its CPU time (`async_idle`). A binary
//! of their own, apart from `it`, so that no other test's sockets, threads or work are
//! counted, and each takes `softwarp_testkit::serial()`: one runs at a time.

#[path = "../it/raw_peer/peer.rs"]
mod peer;
#[path = "../it/util/mod.rs"]
mod util;

mod async_idle;
mod cm_bounds;
mod floods;
mod soak;
