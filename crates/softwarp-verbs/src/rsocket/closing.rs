//! Connections an rsocket shut down (its disconnect message sent, the QP disconnecting)
//! whose program may exit without `rclose`: socat, for one, calls `shutdown` and exits with
//! the socket open. With rdma-core the kernel (siw, an RNIC) owns such a connection and
//! finishes it after the process is gone. Softwarp's connection is a TCP socket of the
//! process: the exit closes it with the tail of the stream (the last data and the
//! disconnect message behind it) possibly still in the kernel's send queue, and the next
//! byte the peer sends (its credits, as it reads that tail), or one not yet read at the
//! exit, makes the kernel reset the connection and drop the queue. So the process waits at
//! exit, as `rclose` does, until each such connection closed gracefully (FIN out, the
//! peer's FIN in, or the linger time), at most [`EXIT_WAIT`] in all.

use std::sync::{Arc, Mutex, Once, Weak};
use std::time::Duration;

use softwarp_ras::deadline::Deadline;

use super::stream::Endpoint;

/// The longest the exit waits for the closes in progress, all together (`rclose`'s bound).
pub const EXIT_WAIT: Duration = super::CLOSE_WAIT;

/// The endpoints whose connection is closing, with the process that disconnected them (a
/// forked child inherits the list but not the threads that would finish the closes).
static CLOSING: Mutex<Vec<(u32, Weak<Endpoint>)>> = Mutex::new(Vec::new());

/// Remembers `ep`, whose QP was just disconnected, for the exit; registers the exit
/// handler at the first call.
pub fn register(ep: &Arc<Endpoint>) {
    static AT_EXIT: Once = Once::new();
    AT_EXIT.call_once(|| {
        // SAFETY: registers a plain `extern "C" fn()`; the library stays loaded until exit
        // (rdma-core's libraries are never unloaded by their programs).
        if unsafe { libc::atexit(finish_closes) } != 0 {
            tracing::warn!(target: "softwarp::verbs", "atexit failed: rsocket closes at exit are cut short");
        }
    });
    let mut l = softwarp::sync::lock(&CLOSING);
    l.retain(|(_, w)| w.strong_count() > 0);
    l.push((std::process::id(), Arc::downgrade(ep)));
}

/// Waits (at most `limit` in all) until every connection [`register`]ed by this process
/// whose socket still exists has closed. True when none is left open.
pub fn wait_all(limit: Duration) -> bool {
    let me = std::process::id();
    let eps: Vec<Arc<Endpoint>> = {
        let mut l = softwarp::sync::lock(&CLOSING);
        std::mem::take(&mut *l)
            .into_iter()
            .filter(|(pid, _)| *pid == me)
            .filter_map(|(_, w)| w.upgrade())
            .collect()
    };
    let deadline = Deadline::after(limit);
    let mut all = true;
    for ep in eps {
        let left = deadline.remaining().unwrap_or(Duration::ZERO);
        all &= ep.qp.wait_closed(left).is_ok();
    }
    all
}

extern "C" fn finish_closes() {
    wait_all(EXIT_WAIT);
}
