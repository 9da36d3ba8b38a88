//! The C layer's settings of completion queues, from `SOFTWARP_*` environment variables,
//! read once per process. The connection settings (CRC, MPA, close order, connect retries,
//! ...) are the connection manager's: [`softwarp::cm::config`], re-exported here.
//!
//! | variable | values | default |
//! | --- | --- | --- |
//! | `SOFTWARP_BUSY_POLL` | `1`: CQs made without a completion channel are busy-polled (`CompletionQueue::set_busy_poll`: the thread polling the CQ moves its QPs' bytes; when its polls stop for 10-20 ms with bytes waiting, the progress thread moves them until they are back, so nothing stalls) | off |
//! | `SOFTWARP_IDLE_SLEEP` | `0`: a thread that keeps polling an empty CQ spins for ever; otherwise, after 262,144 empty polls in a row (about 3 ms), one poll in 1024 sleeps 100 us until a completion comes (`CompletionQueue::set_idle_sleep`), so that a program spinning on a CQ with nothing coming (perftest's passive `ib_write_bw` server) leaves the cores to the progress threads; busy-polled CQs never sleep | on |

use std::sync::OnceLock;

pub use softwarp::cm::config::*;

/// `SOFTWARP_BUSY_POLL=1`: CQs without a completion channel are busy-polled.
pub fn busy_poll() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        matches!(
            std::env::var("SOFTWARP_BUSY_POLL").as_deref(),
            Ok("1" | "on" | "yes" | "true")
        )
    })
}

/// `SOFTWARP_IDLE_SLEEP=0`: a thread polling an empty CQ spins for ever instead of sleeping
/// 100 us now and then after 1-3 ms (`CompletionQueue::set_idle_sleep`).
pub fn idle_sleep() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        !matches!(
            std::env::var("SOFTWARP_IDLE_SLEEP").as_deref(),
            Ok("0" | "off" | "no" | "false")
        )
    })
}
