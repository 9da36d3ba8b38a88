//! Whether a server listens on a port, read from the kernel's socket tables without
//! connecting: a bare TCP connection would be a malformed MPA peer to an iWARP or rsocket
//! listener.

use std::process::Child;
use std::time::{Duration, Instant};

/// The IPv4 and the IPv6 table.
pub const TCP_TABLES: [&str; 2] = ["/proc/net/tcp", "/proc/net/tcp6"];

/// How long [`wait_listening`] waits for a server.
const LISTEN_LIMIT: Duration = Duration::from_secs(20);

/// True once something listens on `port` (any local address) in one of `tables`.
pub fn listening_in(tables: &[&str], port: u16) -> bool {
    let port = format!("{port:04X}");
    tables.iter().any(|table| {
        std::fs::read_to_string(table).is_ok_and(|t| {
            t.lines().skip(1).any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                // `local_address` is ADDR:PORT in hex; state 0A is LISTEN.
                f.len() > 3 && f[1].rsplit(':').next() == Some(port.as_str()) && f[3] == "0A"
            })
        })
    })
}

/// True once something listens on `port`, IPv4 or IPv6.
pub fn listening(port: u16) -> bool {
    listening_in(&TCP_TABLES, port)
}

/// Waits until something listens on `port` in `tables`; panics when `server` exits first or
/// after 20 s.
pub fn wait_listening_in(tables: &[&str], port: u16, server: &mut Child) {
    let deadline = Instant::now() + LISTEN_LIMIT;
    while !listening_in(tables, port) {
        if let Ok(Some(st)) = server.try_wait() {
            panic!("the server exited before listening on port {port}: {st}");
        }
        assert!(
            Instant::now() < deadline,
            "no listener on port {port} after {LISTEN_LIMIT:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until something listens on `port`, IPv4 or IPv6 (see [`wait_listening_in`]).
pub fn wait_listening(port: u16, server: &mut Child) {
    wait_listening_in(&TCP_TABLES, port, server);
}
