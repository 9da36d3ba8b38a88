//! The tests of softwarp-ras that change the process-wide trace levels (`trace_levels`) or
//! install the process-wide `tracing` subscriber (`service_start`): a binary of their own,
//! because the tests of `it` must not see the levels change under them (`control_security`
//! checks that a refused request leaves the levels as they were), and they take turns
//! (`softwarp_testkit::serial`).

#[path = "../it/common/mod.rs"]
mod common;

mod service_start;
mod trace_levels;
