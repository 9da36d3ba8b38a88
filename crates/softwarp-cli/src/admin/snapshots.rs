//! `softwarp snapshots`: the QP snapshots of running processes (what each failed QP looked
//! like when it failed: state, reason, Terminate, addresses, counters, queue depths,
//! TCP_INFO, flight recorder records), as a table, in full (`-v`), or as JSON.

use std::io::Write;

use anyhow::Result;
use softwarp_ras::control::Request;
use softwarp_ras::registry::ProcessEntry;
use softwarp_ras::snapshot::{QpSnapshot, SnapshotsResult};

use super::table::Table;
use super::{ask, processes, report_failures, Failure, Select};

/// Options of `softwarp snapshots`.
#[derive(Debug, Clone, clap::Args)]
pub struct SnapshotsArgs {
    /// Which processes.
    #[command(flatten)]
    pub select: Select,
    /// Only snapshots of this QP number.
    #[arg(long = "qp", value_name = "QPN")]
    pub qpn: Option<u32>,
    /// Only snapshots of this device instance (`softwarp0/2`).
    #[arg(long)]
    pub device: Option<String>,
    /// Only the snapshot with this id (the error log line of a failure names it).
    #[arg(long)]
    pub id: Option<u64>,
    /// Print every snapshot in full (counters, TCP_INFO, trace records), not a table.
    #[arg(short, long)]
    pub verbose: bool,
    /// JSON, one object per process: `{pid, process, capacity, taken, dropped, snapshots}`.
    #[arg(long)]
    pub json: bool,
}

/// One row of the table.
pub fn snapshot_row(s: &QpSnapshot) -> Vec<String> {
    let terminate = s.terminate.as_ref().map_or_else(
        || "-".to_string(),
        |t| match (t.layer, t.etype, t.code) {
            (Some(l), Some(e), Some(c)) => format!("{} {l}/{e}/{c:#04x}", t.direction),
            _ => t.direction.clone(),
        },
    );
    vec![
        s.pid.to_string(),
        s.process.clone(),
        s.id.to_string(),
        s.time.clone(),
        s.device.clone(),
        s.qpn.to_string(),
        s.state.clone(),
        s.event.clone(),
        terminate,
        s.peer_addr
            .map_or_else(|| "-".to_string(), |p| p.to_string()),
        s.records.len().to_string(),
        s.reason.clone(),
    ]
}

/// The table's header.
pub const HEADER: [&str; 12] = [
    "PID",
    "PROCESS",
    "ID",
    "TIME",
    "DEVICE",
    "QPN",
    "STATE",
    "EVENT",
    "TERMINATE",
    "PEER",
    "RECORDS",
    "REASON",
];

/// The bookkeeping line of one process's history.
pub fn history_line(pid: u32, name: &str, r: &SnapshotsResult) -> String {
    format!(
        "pid {pid} ({name}): {} shown, {} taken, {} dropped (keeps {})",
        r.snapshots.len(),
        r.taken,
        r.dropped,
        r.capacity
    )
}

/// Runs `softwarp snapshots`; returns the exit status.
pub fn run(args: &SnapshotsArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<u8> {
    let entries = processes(&args.select, err)?;
    let req = Request::Snapshots {
        qpn: args.qpn,
        device: args.device.clone(),
        id: args.id,
    };
    let mut failures = Vec::new();
    let mut got: Vec<(ProcessEntry, SnapshotsResult)> = Vec::new();
    for a in ask(&entries, &req) {
        match a.reply.and_then(|r| r.into_result::<SnapshotsResult>()) {
            Ok(r) => got.push((a.entry, r)),
            Err(e) => failures.push(Failure::new(&a.entry, e)),
        }
    }
    if args.json {
        for (e, r) in &got {
            let mut v = serde_json::to_value(r)?;
            if let Some(o) = v.as_object_mut() {
                o.insert("pid".into(), e.pid.into());
                o.insert("process".into(), e.name.clone().into());
            }
            writeln!(out, "{v}")?;
        }
    } else if args.verbose {
        for (e, r) in &got {
            writeln!(out, "{}", history_line(e.pid, &e.name, r))?;
            for s in &r.snapshots {
                write!(out, "{s}")?;
            }
        }
    } else {
        let mut t = Table::new(&HEADER);
        for s in got.iter().flat_map(|(_, r)| &r.snapshots) {
            t.push(snapshot_row(s));
        }
        if !t.is_empty() {
            t.render(out)?;
        }
        for (e, r) in &got {
            writeln!(out, "{}", history_line(e.pid, &e.name, r))?;
        }
    }
    Ok(report_failures(err, &failures))
}

#[cfg(test)]
mod tests {
    use super::*;
    use softwarp_ras::snapshot::TerminateInfo;

    #[test]
    fn a_row_shows_the_terminate_fields_and_the_reason() {
        let mut s = QpSnapshot::new(4, "softwarp0/1", 2);
        s.state = "ERROR".into();
        s.event = "terminate_received".into();
        s.reason = "the peer sent a Terminate".into();
        s.terminate = Some(TerminateInfo {
            direction: "received".into(),
            layer: Some(1),
            etype: Some(0),
            code: Some(1),
            text: "x".into(),
        });
        let row = snapshot_row(&s);
        assert_eq!(row.len(), HEADER.len());
        assert_eq!(row[2], "4");
        assert_eq!(row[8], "received 1/0/0x01");
        assert_eq!(row[11], "the peer sent a Terminate");
    }
}
