//! Starting every RAS service of a process in one call: trace levels from the environment,
//! the `tracing` subscriber (console + flight recorder), the error log, the control socket,
//! the host registry entry, and (opt-in) the metrics endpoint.
//!
//! The `softwarp` crate calls [`start_global`] once (at the first `Device::open`); a process
//! that wants different settings calls [`start`] itself with a [`ServiceConfig`].
//!
//! Environment ([`ServiceConfig::from_env`]):
//!
//! | variable | effect |
//! | --- | --- |
//! | `SOFTWARP_TRACE` | initial trace levels (`qp=5,cq=2,default=1`) |
//! | `SOFTWARP_FLIGHT_RECORDER` | flight recorder capacity in records (default 4096) |
//! | `SOFTWARP_RUNTIME_DIR` | the runtime directory (see [`registry`](crate::registry)) |
//! | `SOFTWARP_CONTROL=0` | no control socket and no registry entry |
//! | `SOFTWARP_METRICS` | serve `/metrics`: a port (on 127.0.0.1) or an address; unset: off |
//! | `SOFTWARP_ERRLOG` | error log path, or `off`; default `<runtime dir>/errors-<uid>.jsonl` |
//! | `SOFTWARP_TRACE_CONSOLE=0` | do not install the `tracing` subscriber (the application has its own) |
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
    /// Apply `SOFTWARP_TRACE` and install the `tracing` subscriber.
    pub install_tracing: bool,
}

impl Default for ServiceConfig {
    /// Control socket and tracing on, no metrics endpoint, error log in the runtime
    /// directory.
    fn default() -> Self {
        Self {
            runtime_dir: None,
            control: true,
            metrics_addr: None,
            errlog: None,
            install_tracing: true,
        }
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
            install_tracing: !env("SOFTWARP_TRACE_CONSOLE").is_some_and(|v| is_off(&v)),
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
    if config.install_tracing {
        if let Err(e) = trace::init_from_env() {
            problems.push(format!("{}: {e}", trace::TRACE_ENV));
        }
        if trace::install_global().is_err() {
            // The application's own subscriber stays; records reach the flight recorder only
            // if it adds our layer.
            problems.push(
                "a global tracing subscriber is already installed: add \
                 FlightRecorderLayer::global().with_filter(RecorderFilter::global()) to it"
                    .to_string(),
            );
        }
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
        match MetricsServer::start(addr, move || h.stats().to_prometheus()) {
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

/// Starts the process-wide services once, from the environment, with [`DefaultHandler`]
/// (resources from every tracker, statistics from every registered source); later calls
/// return the same services. They run until the process exits (its registry entry is then
/// cleaned by the next reader).
pub fn start_global() -> &'static RasService {
    static SERVICE: OnceLock<RasService> = OnceLock::new();
    SERVICE.get_or_init(|| start(&ServiceConfig::from_env(), Arc::new(DefaultHandler)))
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
        assert!(c.install_tracing);
        let d = ServiceConfig::from_lookup(env(&[("SOFTWARP_RUNTIME_DIR", "/tmp/rt")]));
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
