//! `softwarp fault inject|status` and `softwarp resources --holders`: device faults from
//! the operator's side. `inject` asks one process (its control socket's `fault-inject`) to
//! fail its devices as a real fault would (containment, then recovery as the process
//! configured it); `status` and `--holders` print each device's state, its fault, the last
//! recovery (outcome, time, signals sent) and who still holds resources of a failed device
//! (pid, process, thread, the source line that created each resource).

use std::io::Write;

use anyhow::{bail, Result};
use serde::Serialize;
use softwarp_ras::control::{FaultStatusResult, Request};
use softwarp_ras::health::{DeviceHealthReport, DeviceState, RecoveryOutcome};
use softwarp_ras::tracker::ResourceInfo;

use super::table::Table;
use super::{ask, processes, report_failures, Failure, Select};

/// `softwarp fault` subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum FaultCommand {
    /// Fail the devices of one process (all of them, or `--device`): every QP to Error,
    /// work requests flushed, a device-fatal event, snapshots, a dump, an error-log entry;
    /// then recovery as the process configured it.
    Inject(InjectArgs),
    /// Each device's state, fault, last recovery and holders, for every process (or the
    /// selected ones).
    Status(StatusArgs),
}

/// Options of `softwarp fault inject`.
#[derive(Debug, Clone, clap::Args)]
pub struct InjectArgs {
    /// The process.
    #[arg(long)]
    pub pid: u32,
    /// Only this device instance (`softwarp0/1`) or name (`softwarp0`).
    #[arg(long)]
    pub device: Option<String>,
    /// The kind of fault: injected (default), interface-down, interface-removed.
    #[arg(long)]
    pub kind: Option<String>,
    /// One JSON document instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Options of `softwarp fault status`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct StatusArgs {
    /// Which processes.
    #[command(flatten)]
    pub select: Select,
    /// One JSON document instead of text.
    #[arg(long)]
    pub json: bool,
}

/// One device of one process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProcessDevice {
    /// The process.
    pub pid: u32,
    /// Its name.
    pub process: String,
    /// The device's health.
    #[serde(flatten)]
    pub health: DeviceHealthReport,
}

/// What `softwarp fault status --json` prints.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct StatusListing {
    /// Every device.
    pub devices: Vec<ProcessDevice>,
    /// Processes that did not answer.
    pub errors: Vec<Failure>,
}

/// Asks the selected processes for their devices' health.
pub fn gather(select: &Select, err: &mut dyn Write) -> Result<StatusListing> {
    let entries = processes(select, err)?;
    let mut listing = StatusListing::default();
    for a in ask(&entries, &Request::FaultStatus) {
        match a.reply.and_then(|r| r.into_result::<FaultStatusResult>()) {
            Ok(r) => listing
                .devices
                .extend(r.devices.into_iter().map(|health| ProcessDevice {
                    pid: a.entry.pid,
                    process: a.entry.name.clone(),
                    health,
                })),
            Err(e) => listing.errors.push(Failure::new(&a.entry, e)),
        }
    }
    Ok(listing)
}

/// The text of one device: a line with its state and fault, one with the last recovery,
/// then its holders.
pub fn device_lines(d: &ProcessDevice) -> Vec<String> {
    let h = &d.health;
    let mut out = vec![format!(
        "pid {} ({}) {}{}: {}{}",
        d.pid,
        d.process,
        h.device,
        h.interface
            .as_deref()
            .map_or_else(String::new, |i| format!(" on {i}")),
        h.state.as_str(),
        h.fault.as_ref().map_or_else(String::new, |f| format!(
            " (fault {}: {} at {})",
            f.generation, f.detail, f.time
        ))
    )];
    if let Some(r) = &h.recovery {
        let mut line = format!(
            "  recovery {} after {} ms (bound {} ms, started {})",
            r.outcome.as_str(),
            r.elapsed_ms,
            r.bound_ms,
            r.started
        );
        for t in &r.terminated {
            line.push_str(&format!(
                "; {} to pid {} ({}) at {} ms",
                t.signal, t.pid, t.process, t.at_ms
            ));
        }
        out.push(line);
        for u in &r.unreachable {
            out.push(format!("  not answering: {u}"));
        }
        let mut foreign: Vec<(u32, &str)> = r
            .foreign_holders
            .iter()
            .map(|f| (f.pid, f.process.as_str()))
            .collect();
        foreign.sort_unstable();
        foreign.dedup();
        for (pid, process) in foreign {
            let n = r.foreign_holders.iter().filter(|f| f.pid == pid).count();
            out.push(format!(
                "  {n} resource(s) held by pid {pid} ({process}) of another user: \
                 reported, not waited for"
            ));
        }
        for x in &r.rejected {
            out.push(format!("  rejected: {x}"));
        }
        if h.state != DeviceState::Operational && !r.holders.is_empty() {
            let when = if r.outcome == RecoveryOutcome::Running {
                "now"
            } else {
                "at the end"
            };
            out.push(format!("  {} resource(s) held {when}:", r.holders.len()));
        }
    }
    out
}

/// The holders table: who holds what, created where.
pub fn holders_table(holders: &[ResourceInfo]) -> Table {
    let mut t = Table::new(&[
        "PID",
        "PROCESS",
        "THREAD",
        "DEVICE",
        "KIND",
        "ID",
        "CREATED-AT",
        "CREATED",
    ]);
    for h in holders {
        t.push(vec![
            h.pid.to_string(),
            h.process.clone(),
            h.thread.clone(),
            h.tracker.clone(),
            h.kind.to_string(),
            h.id.to_string(),
            format!("{}:{}", h.file, h.line),
            h.created.clone(),
        ]);
    }
    t
}

fn print_status(listing: &StatusListing, out: &mut dyn Write, only_failed: bool) -> Result<()> {
    let mut holders = Vec::new();
    for d in &listing.devices {
        if only_failed && d.health.state == DeviceState::Operational && d.health.recovery.is_none()
        {
            continue;
        }
        for l in device_lines(d) {
            writeln!(out, "{l}")?;
        }
        if d.health.state != DeviceState::Operational {
            // The recovery's holders span processes; a device's own are in `holders`.
            match &d.health.recovery {
                Some(r) if !r.holders.is_empty() => holders.extend(r.holders.iter().cloned()),
                _ => holders.extend(d.health.holders.iter().cloned()),
            }
        }
    }
    holders
        .sort_by(|a, b| (a.pid, &a.tracker, a.kind, a.id).cmp(&(b.pid, &b.tracker, b.kind, b.id)));
    holders.dedup_by(|a, b| (a.pid, &a.tracker, a.kind, a.id) == (b.pid, &b.tracker, b.kind, b.id));
    if !holders.is_empty() {
        writeln!(out)?;
        holders_table(&holders).render(out)?;
    }
    Ok(())
}

/// Runs `softwarp fault status`; returns the exit status.
pub fn status(args: &StatusArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<u8> {
    let listing = gather(&args.select, err)?;
    if args.json {
        serde_json::to_writer_pretty(&mut *out, &listing)?;
        writeln!(out)?;
    } else {
        print_status(&listing, out, false)?;
    }
    Ok(report_failures(err, &listing.errors))
}

/// `softwarp resources --holders`: the devices that failed or recovered, and who holds
/// resources of a failed one.
pub fn holders(
    select: &Select,
    json: bool,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<u8> {
    let mut listing = gather(select, err)?;
    listing
        .devices
        .retain(|d| d.health.state != DeviceState::Operational || d.health.recovery.is_some());
    if json {
        serde_json::to_writer_pretty(&mut *out, &listing)?;
        writeln!(out)?;
    } else if listing.devices.is_empty() {
        writeln!(out, "no device has failed")?;
    } else {
        print_status(&listing, out, true)?;
    }
    Ok(report_failures(err, &listing.errors))
}

/// Runs `softwarp fault inject`; returns the exit status.
pub fn inject(args: &InjectArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<u8> {
    let select = Select {
        pid: Some(args.pid),
        name: None,
    };
    let entries = processes(&select, err)?;
    let req = Request::FaultInject {
        device: args.device.clone(),
        kind: args.kind.clone(),
    };
    let mut listing = StatusListing::default();
    for a in ask(&entries, &req) {
        match a.reply.and_then(|r| r.into_result::<FaultStatusResult>()) {
            Ok(r) => listing
                .devices
                .extend(r.devices.into_iter().map(|health| ProcessDevice {
                    pid: a.entry.pid,
                    process: a.entry.name.clone(),
                    health,
                })),
            Err(e) => bail!("pid {} ({}): {e}", a.entry.pid, a.entry.name),
        }
    }
    if args.json {
        serde_json::to_writer_pretty(&mut *out, &listing)?;
        writeln!(out)?;
    } else {
        print_status(&listing, out, false)?;
    }
    Ok(0)
}

/// Runs a `softwarp fault` subcommand.
pub fn run(cmd: &FaultCommand, out: &mut dyn Write, err: &mut dyn Write) -> Result<u8> {
    match cmd {
        FaultCommand::Inject(a) => inject(a, out, err),
        FaultCommand::Status(a) => status(a, out, err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use softwarp_ras::health::{FaultInfo, RecoveryReport, Termination};

    fn device(state: DeviceState) -> ProcessDevice {
        ProcessDevice {
            pid: 7,
            process: "app".into(),
            health: DeviceHealthReport {
                device: "softwarp0/1".into(),
                name: "softwarp0".into(),
                interface: Some("eth1".into()),
                state,
                fault: Some(FaultInfo {
                    kind: "interface_removed".into(),
                    detail: "device softwarp0/1 failed: interface eth1 disappeared".into(),
                    time: "2026-01-01T00:00:00.000Z".into(),
                    generation: 1,
                }),
                recovery: Some(RecoveryReport {
                    outcome: RecoveryOutcome::TimedOut,
                    started: "2026-01-01T00:00:00.001Z".into(),
                    elapsed_ms: 2000,
                    bound_ms: 2000,
                    holders: Vec::new(),
                    terminated: vec![Termination {
                        pid: 9,
                        process: "rogue".into(),
                        signal: "SIGTERM".into(),
                        at_ms: 500,
                    }],
                    unreachable: Vec::new(),
                    foreign_holders: Vec::new(),
                    rejected: vec!["pid 8 (liar, uid 65534) named a holder in pid 1 (init): \
                                    ignored"
                        .into()],
                }),
                holders: Vec::new(),
            },
        }
    }

    #[test]
    fn a_failed_device_shows_its_fault_and_recovery() {
        let lines = device_lines(&device(DeviceState::Failed));
        assert_eq!(
            lines[0],
            "pid 7 (app) softwarp0/1 on eth1: FAILED (fault 1: device softwarp0/1 failed: \
             interface eth1 disappeared at 2026-01-01T00:00:00.000Z)"
        );
        assert!(lines[1].starts_with("  recovery timed_out after 2000 ms (bound 2000 ms"));
        assert!(
            lines[1].ends_with("; SIGTERM to pid 9 (rogue) at 500 ms"),
            "{}",
            lines[1]
        );
        assert_eq!(
            lines[2],
            "  rejected: pid 8 (liar, uid 65534) named a holder in pid 1 (init): ignored"
        );
    }
}
