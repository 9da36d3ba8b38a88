//! The integration tests of `softwarp-sockets`, one binary (one link): a module per area.

mod async_tokio;
mod coalesce;
mod peer_violations;
mod sockperf;
mod stream;
mod wire_props;
