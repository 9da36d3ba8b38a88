//! What the environment asks for (read once, at the first intercepted call that needs it).
//!
//! | variable | meaning |
//! | --- | --- |
//! | `SOFTWARP_SOCKETS` | `option` (default): only sockets that set `SOL_SOFTWARP`/`SO_IWARP_MODE` switch; `all`: every IPv4/IPv6 TCP socket switches (within the port lists); `off`: pure pass-through |
//! | `SOFTWARP_SOCKETS_PORTS` | in `all` mode, only these ports (destination port for `connect`, local port for `listen`): `5201,6379,8000-8100`; unset: every port |
//! | `SOFTWARP_SOCKETS_DENY_PORTS` | in `all` mode, never these ports |
//! | `SOFTWARP_SOCKETS_STATS` | `1`: print one line per iWARP stream on stderr when it closes (its QP's counters) |
//! | `SOFTWARP_SOCKETS_PROTOCOL` | `softwarp` (default): a switched socket speaks Softwarp's extended-sockets protocol (`softwarp-sockets`); `rsocket`: rdma-core's rsocket protocol (`softwarp-verbs`' `rsocket` module), so the program reaches one running under rdma-core's `librspreload.so` |
//! | `SOFTWARP_SOCKETS_FALLBACK` | `tcp`: when the peer of a connecting socket does not answer the MPA exchange, connect again over plain TCP (a new connection to the same address; a line on stderr says so), and serve an accepted connection whose client sends no MPA Request over plain TCP; unset or `none`: the connect fails with `ECONNREFUSED`, the accepted connection reads as a reset |

use std::sync::OnceLock;

/// How sockets are chosen for iWARP mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Only sockets that set the option.
    Option,
    /// Every TCP socket within the port lists.
    All,
    /// Nothing is intercepted beyond the table lookups.
    Off,
}

/// The protocol a switched socket speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// Softwarp's extended sockets (`softwarp-sockets`: Sends with its own credits).
    Softwarp,
    /// rdma-core's rsocket (RDMA Writes and 4-byte messages), wire-compatible with
    /// `librspreload.so` over rdma-core's librdmacm.
    Rsocket,
}

#[derive(Debug)]
pub struct Config {
    pub protocol: Protocol,
    pub mode: Mode,
    pub stats: bool,
    /// `SOFTWARP_SOCKETS_FALLBACK=tcp`.
    pub fallback_tcp: bool,
    allow: Vec<(u16, u16)>,
    deny: Vec<(u16, u16)>,
}

fn ranges(var: &str) -> Vec<(u16, u16)> {
    let Ok(v) = std::env::var(var) else {
        return Vec::new();
    };
    v.split(',')
        .filter_map(|p| {
            let p = p.trim();
            match p.split_once('-') {
                Some((a, b)) => Some((a.trim().parse().ok()?, b.trim().parse().ok()?)),
                None => p.parse().ok().map(|x| (x, x)),
            }
        })
        .collect()
}

impl Config {
    fn from_env() -> Self {
        let mode = match std::env::var("SOFTWARP_SOCKETS").as_deref() {
            Ok("all") => Mode::All,
            Ok("off") => Mode::Off,
            _ => Mode::Option,
        };
        let protocol = match std::env::var("SOFTWARP_SOCKETS_PROTOCOL").as_deref() {
            Ok("rsocket") => Protocol::Rsocket,
            _ => Protocol::Softwarp,
        };
        Self {
            protocol,
            mode,
            stats: std::env::var("SOFTWARP_SOCKETS_STATS").is_ok_and(|v| v == "1"),
            fallback_tcp: std::env::var("SOFTWARP_SOCKETS_FALLBACK").is_ok_and(|v| v == "tcp"),
            allow: ranges("SOFTWARP_SOCKETS_PORTS"),
            deny: ranges("SOFTWARP_SOCKETS_DENY_PORTS"),
        }
    }

    /// In `all` mode: may a connection to (or listener on) `port` go iWARP?
    pub fn port_allowed(&self, port: u16) -> bool {
        let inside = |r: &[(u16, u16)]| r.iter().any(|&(a, b)| (a..=b).contains(&port));
        (self.allow.is_empty() || inside(&self.allow)) && !inside(&self.deny)
    }
}

pub fn get() -> &'static Config {
    static C: OnceLock<Config> = OnceLock::new();
    C.get_or_init(Config::from_env)
}
