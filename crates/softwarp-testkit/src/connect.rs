//! Connect options for tests that wait for a timeout on purpose.

use std::time::Duration;

use softwarp::ConnectOptions;

/// Default connect options with a `ms`-millisecond timeout (MPA exchange, request and
/// accept): short, so that tests which expect a timeout do not wait for the default one.
pub fn quick(ms: u64) -> ConnectOptions {
    ConnectOptions::default().timeout(Duration::from_millis(ms))
}
