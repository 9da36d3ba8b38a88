//! The integration tests of softwarp-ras, one binary (one link): a module per area, with
//! `common` (temporary directories, a Prometheus text parser) shared. The tests that change
//! the process-wide trace levels are the `levels` binary; the `max_level_off` build's check
//! is `compiled_out`.

mod common;

mod control_registry;
mod control_security;
mod dump_props;
mod errlog_rotation;
mod metrics_http;
mod prometheus_format;
mod ras_props;
mod recovery_trust;
mod tracker_leaks;
