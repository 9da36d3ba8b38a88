//! The integration tests of `softwarp`, one binary (one link): a module per area, run over
//! loopback (and network namespaces, as root). Shared: `util` (two connected endpoints, each
//! on its own device, and bounded waits), `cm_support` (the connection manager's cases and a
//! raw MPA peer), `netns` (softwarp-testkit's namespaces joined by a veth pair), and `raw_peer`'s `peer` and
//! `memory` (a raw iWARP peer over TCP, guarded memory).
//!
//! Tests that need the process to themselves are binaries of their own, each saying why:
//! `whole_process` (they measure the process's descriptors, threads, memory or CPU time),
//! `polite`, `context_checks`, `qp_snapshots`, `dump_privacy` and `device_recovery`
//! (process-wide RAS state: what has started, the `tracing` subscriber, the snapshot
//! history, the trace levels, the runtime directory).

mod cm_support;
mod util;
use softwarp_testkit::netns;

mod async_tokio;
mod busy_poll;
mod close_race;
mod cm_api;
mod cm_capture;
mod cm_malformed;
mod cm_matrix;
mod cm_scale;
mod duration_max;
mod early_sends;
mod errors;
mod events;
mod external_polite;
mod inflight_loom;
mod interleave;
mod listener_bounds;
mod markers;
mod net_faults;
mod net_matrix;
mod one_path;
mod operations;
mod owned_buffers;
mod peer_faults;
mod peer_vanishes;
mod ras_wiring;
mod raw_peer;
mod rnr;
mod two_process;
mod tx_batching;
mod tx_interleave;
mod write_bounds;
mod zero_copy;
