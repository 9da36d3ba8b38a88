//! Starting every RAS service of a process in one call: the error log, the control socket,
//! the host registry entry, (opt-in) the metrics endpoint and (opt-in) Softwarp's own
//! `tracing` subscriber (console + flight recorder).
//!
//! Nothing here starts by itself. The `softwarp` crate starts the process-wide services
//! ([`start_global`]) only when the application asks (`Device::builder().ras(..)`,
//! `softwarp::enable_ras`) or the operator does (`SOFTWARP_RAS=on`, see [`env_switch`]);
//! a process that drives the services itself calls [`start`] with a [`ServiceConfig`].
//!
//! Environment ([`ServiceConfig::from_env`]: what an operator chooses when the services
//! start; [`env_switch`]: whether they start without the application asking):
//!
//! | variable | effect |
//! | --- | --- |
//! | `SOFTWARP_RAS` | `on`: start the services (as the variables below say) at the first `Device::open` even if the application did not ask; `off`: never start them, even if it did; unset: the application decides |
//! | `SOFTWARP_TRACE` | initial trace levels (`qp=5,cq=2,default=1`); applied at the first `Device::open` whether or not the services run (it only sets levels) |
//! | `SOFTWARP_FLIGHT_RECORDER` | flight recorder capacity in records (default 4096) |
//! | `SOFTWARP_RUNTIME_DIR` | the runtime directory (see [`registry`](crate::registry)) |
//! | `SOFTWARP_CONTROL=0` | no control socket and no registry entry |
//! | `SOFTWARP_METRICS` | serve `/metrics`: a port (on 127.0.0.1) or an address; unset: off |
//! | `SOFTWARP_ERRLOG` | error log path, or `off`; default `<runtime dir>/errors-<uid>.jsonl` |
//! | `SOFTWARP_TRACE_CONSOLE=1` | also install Softwarp's own global `tracing` subscriber (console on stderr + flight recorder) if the application has none |
//! | `SOFTWARP_TCP_INFO_INTERVAL_MS` | TCP_INFO sampling interval for the runtime's samplers (default 1000) |

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use crate::control::{ControlHandler, ControlServer, DefaultHandler};
use crate::errlog::{self, ErrorLog, ErrorLogConfig};
use crate::registry::{HostRegistry, ProcessEntry, Registration};
use crate::stats::MetricsServer;
use crate::{sys, trace};

/// What to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceConfig {
    /// The runtime directory; `None`: [`registry::runtime_dir`](crate::registry::runtime_dir).
    pub runtime_dir: Option<PathBuf>,
    /// Start the control socket and register in the host registry.
    pub control: bool,
    /// Serve `/metrics` at this address.
    pub metrics_addr: Option<SocketAddr>,
    /// Write the error log; `None`: no error log. [`ServiceConfig::from_env`] fills the
    /// default path in the runtime directory.
    pub errlog: Option<ErrorLogConfig>,
    /// Install Softwarp's own process-wide `tracing` subscriber (console on stderr filtered
    /// by the trace levels, plus the flight recorder; [`trace::install_global`]). Off by
    /// default: Softwarp's records go through the `tracing` facade to the application's
    /// subscriber, which feeds the flight recorder by adding
    /// [`trace::recorder_layer`]. When a subscriber is installed already, this is reported
    /// in [`RasService::problems`] and changes nothing.
    pub install_tracing: bool,
}

impl Default for ServiceConfig {
    /// Control socket and host registry entry in the default runtime directory; no error
    /// log, no metrics endpoint, no subscriber.
    fn default() -> Self {
        Self {
            runtime_dir: None,
            control: true,
            metrics_addr: None,
            errlog: None,
            install_tracing: false,
        }
    }
}

/// The environment variable with which an operator turns the RAS services on or off
/// ([`env_switch`]).
pub const RAS_ENV: &str = "SOFTWARP_RAS";

/// What `SOFTWARP_RAS` says: `Some(true)` for `on`/`1`/`yes`/`true` (start the services
/// even if the application did not ask), `Some(false)` for `off`/`0`/`no`/`false` (never
/// start them), `None` when unset or empty (the application decides). Other values count as
/// unset.
pub fn env_switch() -> Option<bool> {
    switch_of(std::env::var(RAS_ENV).ok().as_deref())
}

fn switch_of(v: Option<&str>) -> Option<bool> {
    match v.map(str::trim) {
        Some(v) if is_off(v) => Some(false),
        Some("1" | "on" | "yes" | "true") => Some(true),
        _ => None,
    }
}

fn parse_metrics(v: &str) -> Option<SocketAddr> {
    let v = v.trim();
    if v.is_empty() || v.eq_ignore_ascii_case("off") || v == "0" {
        return None;
    }
    if let Ok(port) = v.parse::<u16>() {
        return Some(SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
    }
    v.parse().ok()
}

fn is_off(v: &str) -> bool {
    matches!(v.trim(), "0" | "off" | "no" | "false")
}

impl ServiceConfig {
    /// The configuration the environment asks for (see the [module docs](self)).
    pub fn from_env() -> Self {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// The configuration from an environment lookup (testable without touching the real
    /// environment).
    pub fn from_lookup(env: impl Fn(&str) -> Option<String>) -> Self {
        let runtime_dir = env(crate::registry::RUNTIME_DIR_ENV)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from);
        let dir = runtime_dir
            .clone()
            .unwrap_or_else(crate::registry::runtime_dir);
        let errlog = match env("SOFTWARP_ERRLOG") {
            Some(v) if is_off(&v) => None,
            Some(v) if !v.trim().is_empty() => Some(ErrorLogConfig {
                path: PathBuf::from(v.trim()),
                ..ErrorLogConfig::in_dir(&dir)
            }),
            _ => Some(ErrorLogConfig {
                path: dir.join(format!("errors-{}.jsonl", sys::uid())),
                ..ErrorLogConfig::in_dir(&dir)
            }),
        };
        Self {
            runtime_dir,
            control: !env("SOFTWARP_CONTROL").is_some_and(|v| is_off(&v)),
            metrics_addr: env("SOFTWARP_METRICS").and_then(|v| parse_metrics(&v)),
            errlog,
            install_tracing: env("SOFTWARP_TRACE_CONSOLE")
                .is_some_and(|v| matches!(v.trim(), "1" | "on" | "yes" | "true")),
        }
    }
}

/// The running services of a process; dropping it stops the control socket and the
/// metrics endpoint and removes the registry entry.
#[derive(Debug)]
pub struct RasService {
    registry: Option<HostRegistry>,
    // Field order is drop order: the entry goes before the socket it names.
    registration: Option<Registration>,
    control: Option<ControlServer>,
    metrics: Option<MetricsServer>,
    problems: Vec<String>,
}

impl RasService {
    /// The host registry it registered in.
    pub fn registry(&self) -> Option<&HostRegistry> {
        self.registry.as_ref()
    }

    /// The control socket's path.
    pub fn control_socket(&self) -> Option<&std::path::Path> {
        self.control.as_ref().map(ControlServer::path)
    }

    /// The metrics endpoint's address.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(MetricsServer::local_addr)
    }

    /// What could not be started (each also traced at level 1); the rest runs.
    pub fn problems(&self) -> &[String] {
        &self.problems
    }
}

/// Starts what `config` asks for, answering control requests with `handler`. Never fails
/// as a whole: what cannot start is listed in [`RasService::problems`] (RAS must never stop
/// the data path from working).
pub fn start(config: &ServiceConfig, handler: Arc<dyn ControlHandler>) -> RasService {
    let mut problems = Vec::new();
    if let Err(e) = trace::init_from_env() {
        problems.push(format!("{}: {e}", trace::TRACE_ENV));
    }
    if config.install_tracing && trace::install_global().is_err() {
        // The application's own subscriber stays; records reach the flight recorder only if
        // it adds our layer.
        problems.push(
            "a global tracing subscriber is already installed: add \
             softwarp_ras::trace::recorder_layer() to it"
                .to_string(),
        );
    }
    if let Some(c) = &config.errlog {
        match ErrorLog::open(c.clone()) {
            Ok(log) => {
                errlog::set_global(log);
            }
            Err(e) => problems.push(format!("error log {}: {e}", c.path.display())),
        }
    }
    let mut service = RasService {
        registry: None,
        registration: None,
        control: None,
        metrics: None,
        problems: Vec::new(),
    };
    if config.control {
        let dir = config
            .runtime_dir
            .clone()
            .unwrap_or_else(crate::registry::runtime_dir);
        match HostRegistry::open(&dir) {
            Ok(reg) => {
                // Clean what dead processes left behind, including a socket with our pid.
                let _ = reg.scan_and_clean();
                let path = reg.socket_path(sys::pid());
                match ControlServer::start(path.clone(), Arc::clone(&handler)) {
                    Ok(server) => {
                        match reg.register(&ProcessEntry::this_process(path)) {
                            Ok(r) => service.registration = Some(r),
                            Err(e) => {
                                problems.push(format!("registry entry in {}: {e}", dir.display()))
                            }
                        }
                        service.control = Some(server);
                    }
                    Err(e) => problems.push(format!("control socket {}: {e}", path.display())),
                }
                service.registry = Some(reg);
            }
            Err(e) => problems.push(format!("runtime directory {}: {e}", dir.display())),
        }
    }
    if let Some(addr) = config.metrics_addr {
        let h = Arc::clone(&handler);
        match MetricsServer::start_detailed(addr, move |d| h.stats(d).to_prometheus()) {
            Ok(m) => service.metrics = Some(m),
            Err(e) => problems.push(format!("metrics endpoint {addr}: {e}")),
        }
    }
    for p in &problems {
        crate::sw_event!(Ras, 1, "RAS service not started: {}", p);
    }
    service.problems = problems;
    service
}

static GLOBAL: OnceLock<RasService> = OnceLock::new();

/// Starts the process-wide services with `config` and [`DefaultHandler`] (resources from
/// every tracker, statistics from every registered source), once: later calls return the
/// services already running, whatever their `config`. They run until the process exits
/// (its registry entry is then cleaned by the next reader).
pub fn start_global(config: &ServiceConfig) -> &'static RasService {
    GLOBAL.get_or_init(|| start(config, Arc::new(DefaultHandler)))
}

/// The process-wide services, if [`start_global`] started them.
pub fn global() -> Option<&'static RasService> {
    GLOBAL.get()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_setting_is_a_local_port_or_an_address() {
        assert_eq!(parse_metrics("9100"), "127.0.0.1:9100".parse().ok());
        assert_eq!(parse_metrics("[::1]:9100"), "[::1]:9100".parse().ok());
        assert_eq!(parse_metrics("off"), None);
        assert_eq!(parse_metrics("0"), None);
        assert_eq!(parse_metrics("nonsense"), None);
    }

    #[test]
    fn softwarp_ras_turns_the_services_on_or_off_or_leaves_it_to_the_application() {
        assert_eq!(switch_of(None), None);
        assert_eq!(switch_of(Some("")), None);
        assert_eq!(switch_of(Some("maybe")), None);
        for on in ["1", "on", "yes", "true", " on "] {
            assert_eq!(switch_of(Some(on)), Some(true), "{on:?}");
        }
        for off in ["0", "off", "no", "false"] {
            assert_eq!(switch_of(Some(off)), Some(false), "{off:?}");
        }
        assert!(!ServiceConfig::default().install_tracing);
    }

    #[test]
    fn environment_switches_services_on_and_off() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let c = ServiceConfig::from_lookup(env(&[
            ("SOFTWARP_RUNTIME_DIR", "/tmp/rt"),
            ("SOFTWARP_METRICS", "9100"),
            ("SOFTWARP_CONTROL", "0"),
            ("SOFTWARP_ERRLOG", "off"),
        ]));
        assert_eq!(c.runtime_dir, Some(PathBuf::from("/tmp/rt")));
        assert!(!c.control);
        assert_eq!(c.metrics_addr, "127.0.0.1:9100".parse().ok());
        assert_eq!(c.errlog, None);
        assert!(!c.install_tracing);
        let d = ServiceConfig::from_lookup(env(&[
            ("SOFTWARP_RUNTIME_DIR", "/tmp/rt"),
            ("SOFTWARP_TRACE_CONSOLE", "1"),
        ]));
        assert!(d.install_tracing);
        assert!(d.control);
        assert_eq!(d.metrics_addr, None);
        assert_eq!(
            d.errlog.map(|e| e.path),
            Some(PathBuf::from(format!(
                "/tmp/rt/errors-{}.jsonl",
                sys::uid()
            )))
        );
    }
}
