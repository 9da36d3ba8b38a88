//! `softwarp doctor`: checks the host's configuration for what matters to an iWARP stack
//! over TCP (interface MTU, offloads, socket buffer limits, the clock source, the open-file
//! limit, the runtime directory) and prints a verdict with advice per finding.
//!
//! Facts are gathered first ([`HostFacts::gather`]: files under `/sys` and `/proc`, and
//! `ethtool -k` when it is installed), then judged by [`evaluate`], a pure function the tests
//! feed with made-up hosts.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::Result;
use serde::Serialize;

/// Options of `softwarp doctor`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct DoctorArgs {
    /// One JSON document instead of text.
    #[arg(long)]
    pub json: bool,
}

/// How a finding is judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Good as it is.
    Ok,
    /// Worth knowing; nothing to fix.
    Info,
    /// Works, but costs performance or robustness; the advice says how to fix it.
    Warn,
    /// Softwarp will not work well (or at all) like this.
    Fail,
}

impl Verdict {
    fn tag(self) -> &'static str {
        match self {
            Verdict::Ok => "[ OK ]",
            Verdict::Info => "[INFO]",
            Verdict::Warn => "[WARN]",
            Verdict::Fail => "[FAIL]",
        }
    }
}

/// One checked item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// What was checked (`mtu`, `offloads`, `tcp_rmem`, `clocksource`, `nofile`, ...).
    pub check: String,
    /// What it was checked on (an interface, a sysctl, ...).
    pub subject: String,
    /// The value found.
    pub value: String,
    /// The judgement.
    pub verdict: Verdict,
    /// What it means and what to do.
    pub advice: String,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The worst verdict of any finding.
    pub verdict: Verdict,
    /// Every finding.
    pub findings: Vec<Finding>,
}

/// One network interface.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Interface {
    /// Its name.
    pub name: String,
    /// Its MTU.
    pub mtu: Option<u32>,
    /// `/sys/class/net/<if>/operstate` (`up`, `down`, `unknown` ...).
    pub operstate: String,
    /// Offload features from `ethtool -k` (`None`: ethtool is not installed or failed).
    pub offloads: Option<BTreeMap<String, bool>>,
}

/// What the checks look at.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFacts {
    /// Network interfaces except loopback.
    pub interfaces: Vec<Interface>,
    /// Whether an `ethtool` binary was found.
    pub ethtool: bool,
    /// `net.core.rmem_max`, `net.core.wmem_max`.
    pub rmem_max: Option<u64>,
    /// See `rmem_max`.
    pub wmem_max: Option<u64>,
    /// `net.ipv4.tcp_rmem` and `tcp_wmem` (min, default, max).
    pub tcp_rmem: Option<[u64; 3]>,
    /// See `tcp_rmem`.
    pub tcp_wmem: Option<[u64; 3]>,
    /// The current clock source and the available ones.
    pub clocksource: Option<String>,
    /// See `clocksource`.
    pub clocksources_available: Vec<String>,
    /// Soft and hard `RLIMIT_NOFILE` of this process (`None` = unlimited).
    pub nofile: Option<(Option<u64>, Option<u64>)>,
    /// The runtime directory and how many processes are registered there.
    pub runtime_dir: PathBuf,
    /// Whether it exists.
    pub runtime_dir_exists: bool,
    /// Whether it exists and can be written.
    pub runtime_dir_writable: bool,
}

fn read_trim(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

fn read_u64(path: &Path) -> Option<u64> {
    read_trim(path)?.parse().ok()
}

/// `tcp_rmem`-style triple.
pub fn parse_triple(text: &str) -> Option<[u64; 3]> {
    let v: Vec<u64> = text
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    <[u64; 3]>::try_from(v).ok()
}

/// Soft and hard limit of `Max open files` in `/proc/<pid>/limits` text.
pub fn parse_nofile(limits: &str) -> Option<(Option<u64>, Option<u64>)> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let rest = line.strip_prefix("Max open files")?;
    let mut it = rest.split_whitespace();
    let parse = |s: &str| {
        if s == "unlimited" {
            Some(None)
        } else {
            s.parse().ok().map(Some)
        }
    };
    Some((parse(it.next()?)?, parse(it.next()?)?))
}

/// The features of `ethtool -k` output (`name: on|off [fixed]`).
pub fn parse_ethtool_features(text: &str) -> BTreeMap<String, bool> {
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.trim().split_once(':')?;
            let v = v.split_whitespace().next()?;
            match v {
                "on" => Some((k.trim().to_string(), true)),
                "off" => Some((k.trim().to_string(), false)),
                _ => None,
            }
        })
        .collect()
}

fn find_ethtool() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from));
    dirs.into_iter()
        .map(|d| d.join("ethtool"))
        .find(|p| p.is_file())
}

fn ethtool_k(ethtool: &Path, iface: &str) -> Option<BTreeMap<String, bool>> {
    let out = Command::new(ethtool)
        .args(["-k", iface])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    Some(parse_ethtool_features(&String::from_utf8_lossy(
        &out.stdout,
    )))
}

impl HostFacts {
    /// Reads the facts of this host.
    pub fn gather() -> Self {
        let ethtool = find_ethtool();
        let mut interfaces = Vec::new();
        if let Ok(dir) = std::fs::read_dir("/sys/class/net") {
            let mut names: Vec<String> = dir
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n != "lo")
                .collect();
            names.sort();
            names.truncate(64);
            for name in names {
                let base = Path::new("/sys/class/net").join(&name);
                interfaces.push(Interface {
                    mtu: read_u64(&base.join("mtu")).and_then(|m| u32::try_from(m).ok()),
                    operstate: read_trim(&base.join("operstate")).unwrap_or_default(),
                    offloads: ethtool.as_deref().and_then(|e| ethtool_k(e, &name)),
                    name,
                });
            }
        }
        let clock = Path::new("/sys/devices/system/clocksource/clocksource0");
        let runtime_dir = softwarp_ras::registry::runtime_dir();
        Self {
            interfaces,
            ethtool: ethtool.is_some(),
            rmem_max: read_u64(Path::new("/proc/sys/net/core/rmem_max")),
            wmem_max: read_u64(Path::new("/proc/sys/net/core/wmem_max")),
            tcp_rmem: read_trim(Path::new("/proc/sys/net/ipv4/tcp_rmem"))
                .and_then(|t| parse_triple(&t)),
            tcp_wmem: read_trim(Path::new("/proc/sys/net/ipv4/tcp_wmem"))
                .and_then(|t| parse_triple(&t)),
            clocksource: read_trim(&clock.join("current_clocksource")),
            clocksources_available: read_trim(&clock.join("available_clocksource"))
                .map(|s| s.split_whitespace().map(String::from).collect())
                .unwrap_or_default(),
            nofile: read_trim(Path::new("/proc/self/limits")).and_then(|t| parse_nofile(&t)),
            runtime_dir_exists: runtime_dir.is_dir(),
            runtime_dir_writable: softwarp_ras::sys::is_writable_dir(&runtime_dir),
            runtime_dir,
        }
    }
}

const MIB: u64 = 1 << 20;

fn finding(check: &str, subject: &str, value: String, verdict: Verdict, advice: String) -> Finding {
    Finding {
        check: check.into(),
        subject: subject.into(),
        value,
        verdict,
        advice,
    }
}

/// Offload features that matter, with the `ethtool -K` name to turn each on.
const OFFLOADS: [(&str, &str); 5] = [
    ("tcp-segmentation-offload", "tso"),
    ("generic-segmentation-offload", "gso"),
    ("generic-receive-offload", "gro"),
    ("rx-checksumming", "rx"),
    ("tx-checksumming", "tx"),
];

fn check_interface(i: &Interface, ethtool: bool, out: &mut Vec<Finding>) {
    if i.operstate == "down" {
        out.push(finding(
            "mtu",
            &i.name,
            "down".into(),
            Verdict::Info,
            "The interface is down; not checked.".into(),
        ));
        return;
    }
    match i.mtu {
        None => out.push(finding(
            "mtu",
            &i.name,
            "unknown".into(),
            Verdict::Info,
            "The MTU could not be read.".into(),
        )),
        Some(m) if m < 1500 => out.push(finding(
            "mtu",
            &i.name,
            m.to_string(),
            Verdict::Warn,
            format!(
                "Below Ethernet's 1500: FPDUs follow the TCP MSS (about {} bytes here), so more \
                 segments, headers and CRCs per byte. If the network allows it, raise it \
                 (ip link set {} mtu 1500, or 9000 for jumbo frames on an RDMA network); \
                 a tunnel or overlay may be why it is low.",
                m.saturating_sub(40),
                i.name
            ),
        )),
        Some(m) if m < 9000 => out.push(finding(
            "mtu",
            &i.name,
            m.to_string(),
            Verdict::Ok,
            "Standard frames. Jumbo frames (9000) on a dedicated RDMA network cut per-FPDU \
             overhead when every hop and the peer support them."
                .into(),
        )),
        Some(m) => out.push(finding(
            "mtu",
            &i.name,
            m.to_string(),
            Verdict::Ok,
            "Jumbo frames: make sure the peer and every switch use the same MTU, or \
             connections stall on the first large segment."
                .into(),
        )),
    }
    match &i.offloads {
        Some(f) => {
            let off: Vec<(&str, &str)> = OFFLOADS
                .iter()
                .filter(|(name, _)| f.get(*name) == Some(&false))
                .copied()
                .collect();
            if off.is_empty() {
                out.push(finding(
                    "offloads",
                    &i.name,
                    "tso gso gro rx/tx checksums on".into(),
                    Verdict::Ok,
                    "Segmentation, receive coalescing and checksums are offloaded.".into(),
                ));
            } else {
                let names: Vec<&str> = off.iter().map(|(n, _)| *n).collect();
                let k: Vec<String> = off.iter().map(|(_, k)| format!("{k} on")).collect();
                out.push(finding(
                    "offloads",
                    &i.name,
                    format!("off: {}", names.join(", ")),
                    Verdict::Warn,
                    format!(
                        "The kernel does this work on the CPU for every segment, which \
                         Softwarp's throughput competes with. Turn them on if the driver \
                         allows: ethtool -K {} {}",
                        i.name,
                        k.join(" ")
                    ),
                ));
            }
        }
        None => out.push(finding(
            "offloads",
            &i.name,
            "unknown".into(),
            Verdict::Info,
            if ethtool {
                format!("ethtool -k {} failed; offloads not checked.", i.name)
            } else {
                "ethtool is not installed; install it to check TSO/GSO/GRO and checksum \
                 offloads."
                    .into()
            },
        )),
    }
}

fn check_buffers(f: &HostFacts, out: &mut Vec<Finding>) {
    for (name, v) in [
        ("net.core.rmem_max", f.rmem_max),
        ("net.core.wmem_max", f.wmem_max),
    ] {
        let Some(v) = v else {
            continue;
        };
        let (verdict, advice) = if v < 4 * MIB {
            (
                Verdict::Info,
                format!(
                    "Caps SO_RCVBUF/SO_SNDBUF set explicitly; Softwarp relies on TCP \
                     autotuning (tcp_rmem/tcp_wmem), so this matters only to applications \
                     that set buffer sizes. For them: sysctl -w {name}=16777216."
                ),
            )
        } else {
            (
                Verdict::Ok,
                "Large enough for explicit buffer sizes.".into(),
            )
        };
        out.push(finding(
            "socket_buffers",
            name,
            v.to_string(),
            verdict,
            advice,
        ));
    }
    for (name, v) in [
        ("net.ipv4.tcp_rmem", f.tcp_rmem),
        ("net.ipv4.tcp_wmem", f.tcp_wmem),
    ] {
        let Some([min, def, max]) = v else {
            continue;
        };
        let (verdict, advice) = if max < 4 * MIB {
            (
                Verdict::Warn,
                format!(
                    "TCP autotuning stops at {max} bytes: the window limits one connection \
                     to max/RTT (e.g. {:.1} Gb/s at 1 ms). Raise the third value: sysctl -w \
                     {name}=\"{min} {def} 33554432\".",
                    max as f64 * 8.0 / 1e6
                ),
            )
        } else {
            (
                Verdict::Ok,
                format!(
                    "Autotuning can grow a connection's buffer to {} (about {:.0} Gb/s at \
                     1 ms RTT); raise it for faster or longer paths.",
                    super::human_bytes(max),
                    max as f64 * 8.0 / 1e6
                ),
            )
        };
        out.push(finding(
            "socket_buffers",
            name,
            format!("{min} {def} {max}"),
            verdict,
            advice,
        ));
    }
}

fn check_clock(f: &HostFacts, out: &mut Vec<Finding>) {
    let Some(cs) = &f.clocksource else {
        out.push(finding(
            "clocksource",
            "clocksource0",
            "unknown".into(),
            Verdict::Info,
            "The clock source could not be read.".into(),
        ));
        return;
    };
    let fast = [
        "tsc",
        "kvm-clock",
        "hyperv_clocksource_tsc_page",
        "arch_sys_counter",
        "xen",
        "timebase",
    ];
    if fast.contains(&cs.as_str()) {
        out.push(finding(
            "clocksource",
            "clocksource0",
            cs.clone(),
            Verdict::Ok,
            "Time is read without a system call (vDSO): trace records, statistics \
             timestamps and TCP_INFO sampling stay cheap."
                .into(),
        ));
    } else {
        let tsc = f.clocksources_available.iter().any(|c| c == "tsc");
        out.push(finding(
            "clocksource",
            "clocksource0",
            cs.clone(),
            Verdict::Warn,
            format!(
                "Every clock read is a system call or a slow device access, which the \
                 progress loop and tracing pay often.{}",
                if tsc {
                    " tsc is available: echo tsc > \
                     /sys/devices/system/clocksource/clocksource0/current_clocksource (and \
                     check dmesg for why the kernel did not pick it)."
                } else {
                    " Check the kernel log for why the TSC is not used (unstable TSC, \
                     virtualisation settings)."
                }
            ),
        ));
    }
}

fn check_nofile(f: &HostFacts, out: &mut Vec<Finding>) {
    let Some((soft, hard)) = f.nofile else {
        return;
    };
    let show = |v: Option<u64>| v.map_or("unlimited".to_string(), |n| n.to_string());
    let value = format!("soft {} hard {}", show(soft), show(hard));
    let (verdict, advice) = match soft {
        Some(n) if n < 4096 => (
            Verdict::Warn,
            format!(
                "Each connected QP holds a TCP socket, each device an epoll and eventfds, \
                 each completion channel an eventfd: {n} open files limit a process to fewer \
                 QPs. Raise it (ulimit -n {}, LimitNOFILE= in a systemd unit, nofile in \
                 /etc/security/limits.conf).",
                hard.map_or(65536, |h| h.min(65536))
            ),
        ),
        _ => (
            Verdict::Ok,
            "Enough open files for thousands of QPs per process.".into(),
        ),
    };
    out.push(finding("nofile", "RLIMIT_NOFILE", value, verdict, advice));
}

fn check_runtime_dir(f: &HostFacts, out: &mut Vec<Finding>) {
    let dir = f.runtime_dir.display().to_string();
    if f.runtime_dir_writable {
        out.push(finding(
            "runtime_dir",
            &dir,
            "writable".into(),
            Verdict::Ok,
            "Processes register here; softwarp resources/stat/trace find them here \
             (SOFTWARP_RUNTIME_DIR must be the same for both)."
                .into(),
        ));
    } else if !f.runtime_dir_exists {
        out.push(finding(
            "runtime_dir",
            &dir,
            "not created yet".into(),
            Verdict::Info,
            "Created by the first process that opens a device (set SOFTWARP_RUNTIME_DIR to \
             use another directory; the CLI must use the same)."
                .into(),
        ));
    } else {
        out.push(finding(
            "runtime_dir",
            &dir,
            "not writable".into(),
            Verdict::Info,
            "Processes of this user cannot register here and run without a control socket: \
             set SOFTWARP_RUNTIME_DIR to a writable directory."
                .into(),
        ));
    }
}

/// Judges `facts`.
pub fn evaluate(facts: &HostFacts) -> Report {
    let mut findings = Vec::new();
    if facts.interfaces.is_empty() {
        findings.push(finding(
            "mtu",
            "-",
            "no interface".into(),
            Verdict::Warn,
            "No network interface besides loopback: Softwarp can only talk to itself here.".into(),
        ));
    }
    for i in &facts.interfaces {
        check_interface(i, facts.ethtool, &mut findings);
    }
    check_buffers(facts, &mut findings);
    check_clock(facts, &mut findings);
    check_nofile(facts, &mut findings);
    check_runtime_dir(facts, &mut findings);
    Report {
        verdict: findings
            .iter()
            .map(|f| f.verdict)
            .max()
            .unwrap_or(Verdict::Ok),
        findings,
    }
}

/// Writes the report as text: one line per finding, its advice indented below, a verdict.
pub fn render(report: &Report, out: &mut dyn Write) -> std::io::Result<()> {
    for f in &report.findings {
        writeln!(
            out,
            "{} {} {}: {}",
            f.verdict.tag(),
            f.check,
            f.subject,
            f.value
        )?;
        writeln!(out, "       {}", f.advice)?;
    }
    let count = |v| report.findings.iter().filter(|f| f.verdict == v).count();
    let verdict = match report.verdict {
        Verdict::Ok | Verdict::Info => "ok".to_string(),
        Verdict::Warn => format!("{} warning(s)", count(Verdict::Warn)),
        Verdict::Fail => format!(
            "{} problem(s), {} warning(s)",
            count(Verdict::Fail),
            count(Verdict::Warn)
        ),
    };
    writeln!(out, "verdict: {verdict} ({} checks)", report.findings.len())
}

/// Runs `softwarp doctor`; returns the exit status (0 unless a check failed outright: 1).
pub fn run(args: &DoctorArgs, out: &mut dyn Write) -> Result<u8> {
    let report = evaluate(&HostFacts::gather());
    if args.json {
        serde_json::to_writer_pretty(&mut *out, &report)?;
        writeln!(out)?;
    } else {
        render(&report, out)?;
    }
    Ok(u8::from(report.verdict == Verdict::Fail))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good_host() -> HostFacts {
        HostFacts {
            interfaces: vec![Interface {
                name: "eth0".into(),
                mtu: Some(1500),
                operstate: "up".into(),
                offloads: Some(
                    OFFLOADS
                        .iter()
                        .map(|(n, _)| (n.to_string(), true))
                        .collect(),
                ),
            }],
            ethtool: true,
            rmem_max: Some(16 * MIB),
            wmem_max: Some(16 * MIB),
            tcp_rmem: Some([4096, 131072, 6 * MIB]),
            tcp_wmem: Some([4096, 16384, 4 * MIB]),
            clocksource: Some("tsc".into()),
            clocksources_available: vec!["tsc".into(), "hpet".into()],
            nofile: Some((Some(65536), Some(65536))),
            runtime_dir: PathBuf::from("/run/softwarp"),
            runtime_dir_exists: true,
            runtime_dir_writable: true,
        }
    }

    fn find<'a>(r: &'a Report, check: &str, subject: &str) -> &'a Finding {
        r.findings
            .iter()
            .find(|f| f.check == check && f.subject == subject)
            .unwrap_or_else(|| panic!("no {check} {subject} in {r:#?}"))
    }

    #[test]
    fn a_well_configured_host_is_ok() {
        let r = evaluate(&good_host());
        assert_eq!(r.verdict, Verdict::Ok, "{r:#?}");
        assert_eq!(find(&r, "mtu", "eth0").value, "1500");
    }

    #[test]
    fn each_problem_gets_a_warning_with_the_fix() {
        let mut h = good_host();
        h.interfaces[0].mtu = Some(1400);
        h.interfaces[0]
            .offloads
            .as_mut()
            .unwrap()
            .insert("generic-receive-offload".into(), false);
        h.tcp_rmem = Some([4096, 87380, MIB]);
        h.clocksource = Some("hpet".into());
        h.nofile = Some((Some(1024), Some(4096)));
        let r = evaluate(&h);
        assert_eq!(r.verdict, Verdict::Warn);
        assert_eq!(find(&r, "mtu", "eth0").verdict, Verdict::Warn);
        let off = find(&r, "offloads", "eth0");
        assert_eq!(off.verdict, Verdict::Warn);
        assert!(
            off.advice.contains("ethtool -K eth0 gro on"),
            "{}",
            off.advice
        );
        let rmem = find(&r, "socket_buffers", "net.ipv4.tcp_rmem");
        assert_eq!(rmem.verdict, Verdict::Warn);
        assert!(
            rmem.advice.contains("4096 87380 33554432"),
            "{}",
            rmem.advice
        );
        let clock = find(&r, "clocksource", "clocksource0");
        assert_eq!(clock.verdict, Verdict::Warn);
        assert!(clock.advice.contains("echo tsc"), "{}", clock.advice);
        let nofile = find(&r, "nofile", "RLIMIT_NOFILE");
        assert_eq!(nofile.verdict, Verdict::Warn);
        assert!(
            nofile.advice.contains("ulimit -n 4096"),
            "{}",
            nofile.advice
        );
        let mut text = Vec::new();
        render(&r, &mut text).unwrap();
        let text = String::from_utf8(text).unwrap();
        assert!(text.contains("[WARN] mtu eth0: 1400"), "{text}");
        assert!(
            text.ends_with("verdict: 5 warning(s) (9 checks)\n"),
            "{text}"
        );
    }

    #[test]
    fn missing_ethtool_and_down_interfaces_are_information_only() {
        let mut h = good_host();
        h.ethtool = false;
        h.interfaces[0].offloads = None;
        h.interfaces.push(Interface {
            name: "ifb0".into(),
            mtu: Some(1500),
            operstate: "down".into(),
            offloads: None,
        });
        let r = evaluate(&h);
        assert_eq!(r.verdict, Verdict::Info);
        assert!(find(&r, "offloads", "eth0")
            .advice
            .contains("ethtool is not installed"));
        assert_eq!(find(&r, "mtu", "ifb0").value, "down");
    }

    #[test]
    fn proc_and_ethtool_texts_parse() {
        assert_eq!(
            parse_triple("4096\t131072\t33554432\n"),
            Some([4096, 131072, 33554432])
        );
        assert_eq!(parse_triple("1 2"), None);
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1024                 unlimited            files\n";
        assert_eq!(parse_nofile(limits), Some((Some(1024), None)));
        let k = "Features for eth0:\nrx-checksumming: on\ntcp-segmentation-offload: off [fixed]\n\
                 \ttx-tcp-segmentation: off\nhighdma: on [fixed]\n";
        let f = parse_ethtool_features(k);
        assert_eq!(f.get("rx-checksumming"), Some(&true));
        assert_eq!(f.get("tcp-segmentation-offload"), Some(&false));
        assert_eq!(f.get("tx-tcp-segmentation"), Some(&false));
        assert!(!f.contains_key("Features for eth0"));
    }

    #[test]
    fn the_real_host_can_be_checked() {
        let r = evaluate(&HostFacts::gather());
        assert!(!r.findings.is_empty());
        let json = serde_json::to_value(&r).unwrap();
        assert!(json["verdict"].is_string());
    }
}
