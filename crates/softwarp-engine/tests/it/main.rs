//! The integration tests of the sans-IO engine, one binary (one link): a module per area,
//! with `util` (a deterministic pair of engine QPs that moves bytes in chosen splits, without
//! sockets) shared;
//! `rx_fuzz/harness.rs` is also the cargo-fuzz target `engine_rx`'s.

mod util;

mod clock;
mod early_sends;
mod engine_props;
mod gather;
mod guard_props;
mod lifecycle;
mod markers;
mod mss_runs;
mod negative;
mod operations;
mod read_counts;
mod rfc7306;
mod rnr;
mod rx_fuzz;
mod rx_runs;
mod stag_keys;
mod tx_alias;
mod tx_interleave;
mod write_bounds;
mod write_calls;
