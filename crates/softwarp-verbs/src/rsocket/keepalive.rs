//! rsocket's keepalive (`SO_KEEPALIVE`, `TCP_KEEPIDLE`), as rdma-core's `tcp_svc` thread
//! does it: every `keepalive_time` seconds a socket with keepalive on sends
//! `RS_CTRL_KEEPALIVE` as a zero-length RDMA Write to STag 0 at offset 0 (not a Send: the
//! peer consumes no receive and sees nothing but the traffic), when a control slot is free
//! and it is connected. One thread for the process, started by the first socket that
//! turns keepalive on; it holds only weak references, so a closed socket leaves it.

use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::Duration;

use softwarp_ras::deadline::Deadline;

use super::stream::Rsocket;

struct Svc {
    /// Each socket with keepalive on and when it next sends one.
    list: Mutex<Vec<(Weak<Rsocket>, Deadline, u32)>>,
    changed: Condvar,
}

fn svc() -> &'static Svc {
    static SVC: OnceLock<Svc> = OnceLock::new();
    static STARTED: OnceLock<()> = OnceLock::new();
    let s = SVC.get_or_init(|| Svc {
        list: Mutex::new(Vec::new()),
        changed: Condvar::new(),
    });
    STARTED.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("softwarp-rs-keepalive".into())
            .spawn(|| run(svc()));
        if let Err(e) = spawned {
            tracing::error!(target: "softwarp::verbs", error = %e, "rsocket keepalive thread not started");
        }
    });
    s
}

/// Sends `rs`'s keepalives every `secs` seconds from now on (replacing an earlier period).
pub fn add(rs: &Arc<Rsocket>, secs: u32) {
    let s = svc();
    let mut l = s.list.lock().unwrap_or_else(|e| e.into_inner());
    l.retain(|(w, _, _)| w.strong_count() > 0 && !std::ptr::eq(w.as_ptr(), Arc::as_ptr(rs)));
    l.push((
        Arc::downgrade(rs),
        Deadline::after(Duration::from_secs(u64::from(secs))),
        secs,
    ));
    s.changed.notify_all();
}

/// Stops `rs`'s keepalives.
pub fn remove(rs: &Rsocket) {
    let s = svc();
    let mut l = s.list.lock().unwrap_or_else(|e| e.into_inner());
    l.retain(|(w, _, _)| w.strong_count() > 0 && !std::ptr::eq(w.as_ptr(), rs));
    s.changed.notify_all();
}

fn run(s: &Svc) {
    let mut l = s.list.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let mut due = Vec::new();
        let mut next: Option<Duration> = None;
        l.retain(|(w, _, _)| w.strong_count() > 0);
        for (w, d, secs) in l.iter_mut() {
            let left = d.remaining().unwrap_or(Duration::MAX);
            if left.is_zero() {
                if let Some(rs) = w.upgrade() {
                    *d = Deadline::after(Duration::from_secs(u64::from(*secs)));
                    due.push(rs);
                }
            }
            let left = d.remaining().unwrap_or(Duration::MAX);
            next = Some(next.map_or(left, |n| n.min(left)));
        }
        if !due.is_empty() {
            // Sockets are locked with the list released: a socket's lock is taken before
            // the list's by `rsetsockopt`.
            drop(l);
            for rs in due {
                rs.send_keepalive();
            }
            l = s.list.lock().unwrap_or_else(|e| e.into_inner());
            continue;
        }
        l = match next {
            None => s.changed.wait(l).unwrap_or_else(|e| e.into_inner()),
            Some(t) => {
                s.changed
                    .wait_timeout(l, t)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
        };
    }
}

/// `/proc/sys/net/ipv4/tcp_keepalive_time`, or 7200 s (rdma-core's default).
pub fn default_time() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_keepalive_time")
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(7200)
}
