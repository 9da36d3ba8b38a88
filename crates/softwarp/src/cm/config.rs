//! The connection manager's settings that rdma-core has no knob for, from `SOFTWARP_*`
//! environment variables: the one place they are read, by the C libraries
//! (`softwarp-verbs`: librdmacm, rsocket), the preload library and Rust programs that want
//! the operator's settings. Each is read once per process (the first use). A value that
//! cannot be parsed is reported on stderr with the accepted spellings and the default is
//! kept: a C program cannot receive a typed error from its environment.
//!
//! | variable | values | default |
//! | --- | --- | --- |
//! | `SOFTWARP_SIW` | `1`: start from Linux siw's settings (`ConnectOptions::linux_siw`) | Softwarp's defaults |
//! | `SOFTWARP_CRC` | `off`, `preferred`, `required` | `preferred` (`off` with `SOFTWARP_SIW=1`) |
//! | `SOFTWARP_MPA_REV` | `1`, `2` | `2` |
//! | `SOFTWARP_MARKERS` | `off`, `accept`, `request` | `off` |
//! | `SOFTWARP_TERMINATE` | `rfc5040`, `siw` | `rfc5040` (`siw` with `SOFTWARP_SIW=1`) |
//! | `SOFTWARP_FIRST_FPDU_DELAY_MS` | milliseconds the initiator waits after the MPA Reply | 20 (also with `SOFTWARP_SIW=1`) |
//! | `SOFTWARP_P2P` | `0`: no RFC 6581 peer-to-peer mode (RTR) as initiator | on: rdma_cm programs may send first from either end once both saw ESTABLISHED (perftest's `ib_write_lat` server does), and an MPA responder may not send before the initiator's first FPDU (RFC 5044), so the initiator sends a zero-length RTR |
//! | `SOFTWARP_RFC7306` | `on`, `off`: Immediate Data and atomics | on |
//! | `SOFTWARP_TX_ALIAS_LEAD` | `off`: no short FPDUs leading a large message whose payload would hit 4 KiB aliasing in the kernel's copy (`ConnectOptions::tx_alias_lead`) | on |
//! | `SOFTWARP_RESPONDER_WAIT_MS` | how long a responder holds its FPDUs for the initiator's first (RFC 5044) before it sends anyway ([`DEFAULT_RESPONDER_WAIT`]); `0`: at once | 200 |
//! | `SOFTWARP_MPA_TIMEOUT_MS` | TCP connect and MPA exchange bound | 5000 |
//! | `SOFTWARP_TCP_KEEPALIVE` | `off`, or `IDLE,INTERVAL,COUNT` in seconds (`ConnectOptions::tcp_keepalive`: a peer silent for IDLE is probed every INTERVAL; COUNT unanswered probes drop the connection, the QP goes to Error and the error log says `peer_unreachable`) | `60,10,6` |
//! | `SOFTWARP_TCP_USER_TIMEOUT_MS` | how long sent data may stay unacknowledged before the connection is dropped (`ConnectOptions::tcp_user_timeout`); `0`: the kernel's own bound | the kernel's |
//! | `SOFTWARP_CLOSE_WAIT_MS` | how long a responder's `rdma_disconnect`/`ibv_destroy_qp` waits for the initiator to close first ([`CloseOrder`]); `0`: close at once | 2000 |
//! | `SOFTWARP_INITIATOR_CLOSE_WAIT_MS` | how long an initiator's `rdma_disconnect`/`ibv_destroy_qp` waits for the responder to close first ([`CloseOrder`]); `0`: close at once | 50 |
//! | `SOFTWARP_CONNECT_RETRIES` | how many times `rdma_connect` tries again when the TCP connection is refused (nothing listens yet) | 0 |
//! | `SOFTWARP_CONNECT_RETRY_MS` | the pause before each of those tries | 100 |
//! | `SOFTWARP_RNR_WAIT_MS` | how long a Send (or Immediate Data) that finds no receive posted waits for one, unread in the socket so that TCP holds the sender back, before the stream fails with the Terminate for no receive buffer (`ConnectOptions::rnr_wait`; per QP in the C library, `ibv_modify_qp`'s `min_rnr_timer` and `rnr_retry` and `rdma_conn_param`'s `rnr_retry_count`); `0`: fail at once | 10000 |

use std::sync::OnceLock;
use std::time::Duration;

use crate::verbs::qp::options::{ConnectOptions, CrcMode, Keepalive, MarkerMode};
use crate::{MpaRevision, QueuePair, TerminateLayout};
use softwarp_engine::mpa::Role;

pub use crate::verbs::qp::wait_for_held_closes;

/// The connection settings of this process.
pub fn options() -> ConnectOptions {
    static OPTS: OnceLock<ConnectOptions> = OnceLock::new();
    OPTS.get_or_init(|| {
        from(|k| std::env::var(k).ok()).unwrap_or_else(|(var, value, expected)| {
            eprintln!("softwarp: {var}={value:?} is not one of {expected}; using the default");
            ConnectOptions::default()
        })
    })
    .clone()
}

type Bad = (&'static str, String, &'static str);

/// The order of a connection's end: each end lets the other close first, for at most a
/// bound by its role (`SOFTWARP_CLOSE_WAIT_MS` for the responder, 2 s by default;
/// `SOFTWARP_INITIATOR_CLOSE_WAIT_MS` for the initiator, 50 ms; 0: close at once).
///
/// rdma_cm programs end a connection from both sides at about the same moment: perftest's
/// server reads the client's closing Send, answers it, and at once disconnects its data QP
/// and destroys its control QP. Linux siw completes a Send in the system call that posts it,
/// after the last FPDU went to TCP; if the peer's FIN is processed in between, siw fails that
/// Send with `IBV_WC_LOC_QP_OP_ERR` although the peer received it ("Bad wc status 2" of
/// siw's perftest client under emulation). So a close ([`CmId::disconnect_after_peer`],
/// [`QueuePair::hold_close`] before a destroy) holds this side's FIN until the peer's FIN
/// arrives or the bound passes. The hold runs on the device's progress thread (the engine's
/// clock): the call returns at once, as rdma-core's `rdma_disconnect` does, and nothing
/// else changes (the QP leaves RTS at once, queued work goes out, receives go on until the
/// close). The initiator's bound is short because a responder of this library waits for
/// its initiator: two ends of it close once that bound passes, never a deadlock.
///
/// [`CmId::disconnect_after_peer`]: crate::CmId::disconnect_after_peer
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CloseOrder {
    /// How long a responder holds its close for the initiator's.
    pub responder: Duration,
    /// How long an initiator holds its close for the responder's.
    pub initiator: Duration,
}

impl Default for CloseOrder {
    fn default() -> Self {
        Self {
            responder: DEFAULT_CLOSE_WAIT,
            initiator: DEFAULT_INITIATOR_CLOSE_WAIT,
        }
    }
}

impl CloseOrder {
    /// The order of this process: the defaults, or what `SOFTWARP_CLOSE_WAIT_MS` and
    /// `SOFTWARP_INITIATOR_CLOSE_WAIT_MS` say (read once).
    pub fn from_env() -> Self {
        static ORDER: OnceLock<CloseOrder> = OnceLock::new();
        *ORDER.get_or_init(|| Self::from(&env_var))
    }

    /// The order `get` (an environment) gives; a wrong value keeps its default (reported on
    /// stderr).
    pub fn from(get: &dyn Fn(&str) -> Option<String>) -> Self {
        let d = Self::default();
        Self {
            responder: reported(millis(get, "SOFTWARP_CLOSE_WAIT_MS"))
                .flatten()
                .unwrap_or(d.responder),
            initiator: reported(millis(get, "SOFTWARP_INITIATOR_CLOSE_WAIT_MS"))
                .flatten()
                .unwrap_or(d.initiator),
        }
    }

    /// The bound of the end that is `role`.
    pub fn bound(&self, role: Role) -> Duration {
        match role {
            Role::Responder => self.responder,
            Role::Initiator => self.initiator,
        }
    }

    /// The longest hold of this order: how long a process that exits with closes held
    /// waits for them ([`wait_for_held_closes`]).
    pub fn longest(&self) -> Duration {
        self.responder.max(self.initiator)
    }

    /// Holds `qp`'s close for its peer's, for its role's bound, when it is connected (see
    /// [`QueuePair::hold_close`]). True when a hold was set.
    pub fn hold(&self, qp: &QueuePair) -> bool {
        qp.connection()
            .is_some_and(|c| qp.hold_close(self.bound(c.role)))
    }
}

/// The default of [`CloseOrder::responder`]: room for a peer under emulation (siw in a TCG
/// guest) to finish its last Send and close.
pub const DEFAULT_CLOSE_WAIT: Duration = Duration::from_millis(2000);

/// The default of [`CloseOrder::initiator`]: short, because a responder of this library
/// waits for its initiator (so two ends of it close after this bound), yet room for a
/// server that is still in the call that posted its last Send (siw under emulation).
pub const DEFAULT_INITIATOR_CLOSE_WAIT: Duration = Duration::from_millis(50);

/// The default of `SOFTWARP_RESPONDER_WAIT_MS` ([`ConnectOptions::responder_wait_limit`] of
/// the C libraries): how long a responder holds its FPDUs for the initiator's first (RFC
/// 5044) before it sends anyway. rdma_cm programs may speak first from the passive side
/// (perftest's `ib_write_lat` server); an initiator of this library opens the gate at once
/// with its RTR (RFC 6581), but stock Linux siw offers none, and without a bound both ends
/// wait for ever. 200 ms is room for an initiator that moves its connection into an RNIC
/// after the Reply, which is what the rule protects.
pub const DEFAULT_RESPONDER_WAIT: Duration = Duration::from_millis(200);

/// Retries of a refused connect: how many, and the pause before each
/// (`SOFTWARP_CONNECT_RETRIES`, `SOFTWARP_CONNECT_RETRY_MS`).
pub fn connect_retry() -> (u32, Duration) {
    static RETRY: OnceLock<(u32, Duration)> = OnceLock::new();
    *RETRY.get_or_init(|| retry_from(&env_var))
}

/// The retries of a refused connect that `get` gives (the defaults, 0 and 100 ms, for what
/// is unset or wrong; a wrong value is reported on stderr).
pub fn retry_from(get: &dyn Fn(&str) -> Option<String>) -> (u32, Duration) {
    let count = match get("SOFTWARP_CONNECT_RETRIES").filter(|v| !v.is_empty()) {
        None => 0,
        Some(v) => reported(
            v.parse::<u32>()
                .map_err(|_| ("SOFTWARP_CONNECT_RETRIES", v, "a number of tries")),
        )
        .unwrap_or(0),
    };
    let pause = reported(millis(get, "SOFTWARP_CONNECT_RETRY_MS"))
        .flatten()
        .unwrap_or(Duration::from_millis(100));
    (count, pause)
}

fn env_var(k: &str) -> Option<String> {
    std::env::var(k).ok()
}

/// The value, or `None` after reporting what is wrong on stderr.
fn reported<T>(r: Result<T, Bad>) -> Option<T> {
    r.map_err(|(var, value, expected)| {
        eprintln!("softwarp: {var}={value:?} is not one of {expected}; using the default");
    })
    .ok()
}

/// `var` as a number of milliseconds (`None` when unset or empty).
fn millis(
    get: &dyn Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<Option<Duration>, Bad> {
    match get(var).filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(v) => v
            .parse::<u64>()
            .map(|ms| Some(Duration::from_millis(ms)))
            .map_err(|_| (var, v, "a number of milliseconds")),
    }
}

/// The settings that `get` (an environment) gives, or the variable that is wrong.
pub fn from(get: impl Fn(&str) -> Option<String>) -> Result<ConnectOptions, Bad> {
    let flag = |var: &'static str, expected: &'static str| -> Result<Option<bool>, Bad> {
        match get(var).as_deref() {
            None | Some("") => Ok(None),
            Some("1" | "on" | "yes" | "true") => Ok(Some(true)),
            Some("0" | "off" | "no" | "false") => Ok(Some(false)),
            Some(v) => Err((var, v.to_string(), expected)),
        }
    };
    let mut o = if flag("SOFTWARP_SIW", "1, 0")? == Some(true) {
        ConnectOptions::linux_siw()
    } else {
        ConnectOptions::default()
    };
    o.peer_to_peer = true;
    o.responder_wait_limit = DEFAULT_RESPONDER_WAIT;
    if let Some(v) = get("SOFTWARP_CRC").filter(|v| !v.is_empty()) {
        o.crc = match v.as_str() {
            "off" | "0" => CrcMode::Off,
            "preferred" | "on" | "1" => CrcMode::Preferred,
            "required" => CrcMode::Required,
            _ => return Err(("SOFTWARP_CRC", v, "off, preferred, required")),
        };
    }
    if let Some(v) = get("SOFTWARP_MPA_REV").filter(|v| !v.is_empty()) {
        o.revision = match v.as_str() {
            "1" => MpaRevision::Rev1,
            "2" => MpaRevision::Rev2,
            _ => return Err(("SOFTWARP_MPA_REV", v, "1, 2")),
        };
    }
    if let Some(v) = get("SOFTWARP_MARKERS").filter(|v| !v.is_empty()) {
        o.markers = match v.as_str() {
            "off" => MarkerMode::Off,
            "accept" => MarkerMode::Accept,
            "request" => MarkerMode::Request,
            _ => return Err(("SOFTWARP_MARKERS", v, "off, accept, request")),
        };
    }
    if let Some(v) = get("SOFTWARP_TERMINATE").filter(|v| !v.is_empty()) {
        o.terminate_layout = match v.as_str() {
            "rfc5040" => TerminateLayout::Rfc5040,
            "siw" => TerminateLayout::LinuxSiw,
            _ => return Err(("SOFTWARP_TERMINATE", v, "rfc5040, siw")),
        };
    }
    if let Some(d) = millis(&get, "SOFTWARP_FIRST_FPDU_DELAY_MS")? {
        o.first_fpdu_delay = d;
    }
    if let Some(d) = millis(&get, "SOFTWARP_MPA_TIMEOUT_MS")? {
        o.timeout = d;
    }
    if let Some(d) = millis(&get, "SOFTWARP_RESPONDER_WAIT_MS")? {
        o.responder_wait_limit = d;
    }
    if let Some(on) = flag("SOFTWARP_P2P", "1, 0")? {
        o.peer_to_peer = on;
    }
    if let Some(on) = flag("SOFTWARP_RFC7306", "on, off")? {
        o.rfc7306 = on;
    }
    if let Some(on) = flag("SOFTWARP_TX_ALIAS_LEAD", "on, off")? {
        o.tx_alias_lead = on;
    }
    if let Some(v) = get("SOFTWARP_TCP_KEEPALIVE").filter(|v| !v.is_empty()) {
        o.tcp_keepalive = keepalive(&v).ok_or(("SOFTWARP_TCP_KEEPALIVE", v, KEEPALIVE))?;
    }
    if let Some(d) = millis(&get, "SOFTWARP_TCP_USER_TIMEOUT_MS")? {
        o.tcp_user_timeout = (!d.is_zero()).then_some(d);
    }
    if let Some(d) = millis(&get, "SOFTWARP_RNR_WAIT_MS")? {
        o.rnr_wait = (!d.is_zero()).then_some(d);
    }
    Ok(o)
}

const KEEPALIVE: &str = "off, or IDLE,INTERVAL,COUNT (seconds, seconds, probes; each at least 1)";

/// `off`, or `IDLE,INTERVAL,COUNT`: the keepalive settings it names (`None` inside for
/// `off`), or `None` when it names none.
fn keepalive(v: &str) -> Option<Option<Keepalive>> {
    if matches!(v, "off" | "0") {
        return Some(None);
    }
    let n: Vec<u64> = v
        .split(',')
        .map(|p| p.trim().parse().ok().filter(|&n| n >= 1))
        .collect::<Option<_>>()?;
    let [idle, interval, count] = n[..] else {
        return None;
    };
    Some(Some(Keepalive {
        idle: Duration::from_secs(idle),
        interval: Duration::from_secs(interval),
        count: u32::try_from(count).ok()?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn unset_gives_softwarp_defaults() {
        let o = from(env(&[])).expect("defaults");
        let d = ConnectOptions::default();
        assert_eq!(
            (o.crc, o.revision, o.markers),
            (d.crc, d.revision, d.markers)
        );
        assert_eq!(o.first_fpdu_delay, d.first_fpdu_delay);
    }

    #[test]
    fn the_rnr_wait_comes_from_the_environment_and_0_turns_it_off() {
        assert_eq!(
            from(env(&[])).expect("defaults").rnr_wait,
            Some(crate::DEFAULT_RNR_WAIT)
        );
        let o = from(env(&[("SOFTWARP_RNR_WAIT_MS", "250")])).expect("valid");
        assert_eq!(o.rnr_wait, Some(Duration::from_millis(250)));
        let o = from(env(&[("SOFTWARP_RNR_WAIT_MS", "0")])).expect("valid");
        assert_eq!(o.rnr_wait, None);
        let e = from(env(&[("SOFTWARP_RNR_WAIT_MS", "long")])).expect_err("refused");
        assert_eq!(e.0, "SOFTWARP_RNR_WAIT_MS");
    }

    #[test]
    fn every_variable_is_read() {
        let o = from(env(&[
            ("SOFTWARP_CRC", "required"),
            ("SOFTWARP_MPA_REV", "1"),
            ("SOFTWARP_MARKERS", "request"),
            ("SOFTWARP_TERMINATE", "siw"),
            ("SOFTWARP_FIRST_FPDU_DELAY_MS", "0"),
            ("SOFTWARP_MPA_TIMEOUT_MS", "1500"),
            ("SOFTWARP_RESPONDER_WAIT_MS", "0"),
            ("SOFTWARP_P2P", "0"),
            ("SOFTWARP_RFC7306", "off"),
            ("SOFTWARP_TX_ALIAS_LEAD", "off"),
        ]))
        .expect("valid");
        assert_eq!(o.crc, CrcMode::Required);
        assert_eq!(o.revision, MpaRevision::Rev1);
        assert_eq!(o.markers, MarkerMode::Request);
        assert_eq!(o.terminate_layout, TerminateLayout::LinuxSiw);
        assert_eq!(o.first_fpdu_delay, Duration::ZERO);
        assert_eq!(o.timeout, Duration::from_millis(1500));
        assert_eq!(o.responder_wait_limit, Duration::ZERO);
        assert_eq!(
            from(env(&[])).expect("defaults").responder_wait_limit,
            DEFAULT_RESPONDER_WAIT
        );
        assert!(!o.peer_to_peer);
        assert!(!o.rfc7306);
        assert!(!o.tx_alias_lead && ConnectOptions::default().tx_alias_lead);
    }

    #[test]
    fn siw_preset_then_overrides() {
        let o = from(env(&[("SOFTWARP_SIW", "1"), ("SOFTWARP_CRC", "preferred")])).expect("valid");
        assert_eq!(o.terminate_layout, TerminateLayout::LinuxSiw);
        assert_eq!(o.crc, CrcMode::Preferred);
        assert!(
            o.peer_to_peer,
            "rdma_cm programs may send first from the passive side"
        );
    }

    #[test]
    fn the_close_order_comes_from_the_environment_by_role() {
        let d = CloseOrder::from(&env(&[]));
        assert_eq!(d, CloseOrder::default());
        assert_eq!(d.bound(Role::Responder), DEFAULT_CLOSE_WAIT);
        assert_eq!(d.bound(Role::Initiator), DEFAULT_INITIATOR_CLOSE_WAIT);
        let o = CloseOrder::from(&env(&[
            ("SOFTWARP_CLOSE_WAIT_MS", "0"),
            ("SOFTWARP_INITIATOR_CLOSE_WAIT_MS", "400"),
        ]));
        assert_eq!(o.bound(Role::Responder), Duration::ZERO);
        assert_eq!(o.bound(Role::Initiator), Duration::from_millis(400));
        let bad = CloseOrder::from(&env(&[("SOFTWARP_CLOSE_WAIT_MS", "soon")]));
        assert_eq!(bad, CloseOrder::default());
    }

    #[test]
    fn connect_retries_are_off_unless_asked_and_a_bad_value_keeps_the_default() {
        assert_eq!(retry_from(&env(&[])), (0, Duration::from_millis(100)));
        assert_eq!(
            retry_from(&env(&[
                ("SOFTWARP_CONNECT_RETRIES", "20"),
                ("SOFTWARP_CONNECT_RETRY_MS", "50")
            ])),
            (20, Duration::from_millis(50))
        );
        assert_eq!(
            retry_from(&env(&[
                ("SOFTWARP_CONNECT_RETRIES", "many"),
                ("SOFTWARP_CONNECT_RETRY_MS", "soon")
            ])),
            (0, Duration::from_millis(100))
        );
    }

    #[test]
    fn a_bad_value_names_the_variable_and_the_accepted_ones() {
        let e = from(env(&[("SOFTWARP_MPA_REV", "3")])).expect_err("refused");
        assert_eq!(e, ("SOFTWARP_MPA_REV", "3".to_string(), "1, 2"));
        let e = from(env(&[("SOFTWARP_FIRST_FPDU_DELAY_MS", "soon")])).expect_err("refused");
        assert_eq!(e.0, "SOFTWARP_FIRST_FPDU_DELAY_MS");
    }

    #[test]
    fn keepalive_and_user_timeout_come_from_the_environment() {
        let d = from(env(&[])).expect("defaults");
        assert_eq!(d.tcp_keepalive, Some(Keepalive::DEFAULT));
        assert_eq!(d.tcp_user_timeout, None);
        let o = from(env(&[
            ("SOFTWARP_TCP_KEEPALIVE", "5,2,3"),
            ("SOFTWARP_TCP_USER_TIMEOUT_MS", "1500"),
        ]))
        .expect("set");
        assert_eq!(
            o.tcp_keepalive,
            Some(Keepalive {
                idle: Duration::from_secs(5),
                interval: Duration::from_secs(2),
                count: 3
            })
        );
        assert_eq!(o.tcp_user_timeout, Some(Duration::from_millis(1500)));
        let off = from(env(&[
            ("SOFTWARP_TCP_KEEPALIVE", "off"),
            ("SOFTWARP_TCP_USER_TIMEOUT_MS", "0"),
        ]))
        .expect("off");
        assert_eq!((off.tcp_keepalive, off.tcp_user_timeout), (None, None));
        for bad in ["5,2", "5,0,3", "a,b,c", "5,2,3,4", "on"] {
            let e = from(env(&[("SOFTWARP_TCP_KEEPALIVE", bad)])).expect_err(bad);
            assert_eq!(e.0, "SOFTWARP_TCP_KEEPALIVE", "{bad}");
        }
    }
}
