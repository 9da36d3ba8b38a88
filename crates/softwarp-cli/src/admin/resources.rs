//! `softwarp resources`: every device, PD, MR, CQ, SRQ, QP and listener of every Softwarp
//! process on the host, like `rdma resource show`: owner pid and name, state, local and peer
//! addresses, the source line that created it, and live details; memory per table.
//!
//! A process with more than [`ROWS_LIMIT`] resources answers with its counts per kind only
//! (one line per device), unless `--kind`, `--id` or `--all` asks for rows: the filters are
//! applied in the process, so only the rows asked for are described, sent and sorted.

use std::collections::BTreeMap;
use std::io::Write;

use anyhow::Result;
use serde::Serialize;
use softwarp_ras::control::{Request, ResourcesResult};
use softwarp_ras::tracker::{KindUsage, ResourceInfo, ResourceKind};

use super::table::Table;
use super::{ask, human_bytes, processes, report_failures, Failure, Select};

/// Most resources a process lists by default; above this it gives its counts per kind.
pub const ROWS_LIMIT: usize = 1000;

/// Options of `softwarp resources`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ResourcesArgs {
    /// Only resources of this kind (device, pd, mr, mw, cq, qp, srq, listener, cm_id).
    #[arg(long)]
    pub kind: Option<ResourceKind>,
    /// Only the resource with this id (QP number, CQ id, STag ...).
    #[arg(long)]
    pub id: Option<u64>,
    /// A row for every resource, however many (by default a process with more than 1000
    /// answers with its counts per kind).
    #[arg(long)]
    pub all: bool,
    /// Which processes.
    #[command(flatten)]
    pub select: Select,
    /// One JSON document instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Instead of the resources: the devices that failed (state, fault, last recovery with
    /// its outcome and time) and who holds resources of a failed one (pid, process, thread,
    /// creating source line), as during a recovery.
    #[arg(long)]
    pub holders: bool,
}

/// Memory of one device's resource tables in one process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProcessMemory {
    /// The process.
    pub pid: u32,
    /// Its name.
    pub process: String,
    /// The tracker (device instance, or `cm` for listeners).
    pub tracker: String,
    /// Count and bytes per kind.
    pub kinds: BTreeMap<ResourceKind, KindUsage>,
    /// Sum over the kinds.
    pub total_bytes: u64,
}

/// What `softwarp resources --json` prints.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Listing {
    /// The resources, by pid, device, kind and id.
    pub resources: Vec<ResourceInfo>,
    /// Memory per process and device.
    pub memory: Vec<ProcessMemory>,
    /// Processes that listed no rows because they hold more than [`ROWS_LIMIT`] resources.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub summarized: Vec<Summarized>,
    /// Processes that did not answer.
    pub errors: Vec<Failure>,
}

/// A process that gave counts instead of rows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Summarized {
    /// The process.
    pub pid: u32,
    /// Its name.
    pub process: String,
    /// Resources it did not list.
    pub omitted: u64,
}

/// The request `args` make: rows of their kind and id; without a filter, at most
/// [`ROWS_LIMIT`] unless `--all`.
pub fn request(args: &ResourcesArgs) -> Request {
    let filtered = args.kind.is_some() || args.id.is_some();
    Request::Resources {
        kind: args.kind,
        id: args.id,
        max: (!filtered && !args.all).then_some(ROWS_LIMIT),
    }
}

/// Gathers the answers of the selected processes, keeping resources of `kind` only.
pub fn gather(args: &ResourcesArgs, err: &mut dyn Write) -> Result<Listing> {
    let entries = processes(&args.select, err)?;
    let mut listing = Listing::default();
    for a in ask(&entries, &request(args)) {
        let result: ResourcesResult = match a.reply.and_then(|r| r.into_result()) {
            Ok(r) => r,
            Err(e) => {
                listing.errors.push(Failure::new(&a.entry, e));
                continue;
            }
        };
        if result.omitted > 0 {
            listing.summarized.push(Summarized {
                pid: a.entry.pid,
                process: a.entry.name.clone(),
                omitted: result.omitted,
            });
        }
        // The process filtered already (one of an older version may not have).
        listing
            .resources
            .extend(result.resources.into_iter().filter(|r| {
                args.kind.is_none_or(|k| r.kind == k) && args.id.is_none_or(|i| r.id == i)
            }));
        listing
            .memory
            .extend(result.memory.into_iter().map(|m| ProcessMemory {
                pid: a.entry.pid,
                process: a.entry.name.clone(),
                tracker: m.tracker,
                kinds: m.kinds,
                total_bytes: m.total_bytes,
            }));
    }
    listing.resources.sort_by(|a, b| {
        (a.pid, &a.tracker, a.kind, a.id, a.created_unix_ms).cmp(&(
            b.pid,
            &b.tracker,
            b.kind,
            b.id,
            b.created_unix_ms,
        ))
    });
    Ok(listing)
}

fn id_text(r: &ResourceInfo) -> String {
    match r.kind {
        // An MR's id is its STag, which people read in hex.
        ResourceKind::Mr => format!("{:#010x}", r.id),
        _ => r.id.to_string(),
    }
}

fn file_name(path: &str) -> &str {
    // Keep the path below the crate (`src/...`, `tests/...`, `examples/...`) readable:
    // strip the workspace prefixes before them.
    for marker in ["/src/", "/tests/", "/examples/", "/benches/"] {
        if let Some(i) = path.rfind(marker) {
            if let Some(start) = path.get(..i).and_then(|p| p.rfind('/')) {
                return path.get(start + 1..).unwrap_or(path);
            }
            return path;
        }
    }
    path
}

/// Where the resource was created: the C caller for objects made through the C ABI
/// (`softwarp-verbs`), else the Rust `file:line`.
fn created_at(r: &ResourceInfo) -> String {
    match &r.caller {
        Some(c) => c.clone(),
        None => format!("{}:{}", file_name(&r.file), r.line),
    }
}

/// The table of `resources` (one row each).
pub fn table(resources: &[ResourceInfo]) -> Table {
    let mut t = Table::new(&[
        "PID",
        "PROCESS",
        "DEVICE",
        "KIND",
        "ID",
        "STATE",
        "LOCAL",
        "PEER",
        "CREATED-AT",
        "DETAILS",
    ]);
    for r in resources {
        let d = r.details.clone().unwrap_or_default();
        let dash = || "-".to_string();
        let mut details: Vec<String> = d.attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
        // Intact structure markers say nothing; a damaged one is what the operator must see.
        details.extend(
            d.markers
                .iter()
                .filter(|w| !w.is_intact())
                .map(|w| format!("MARKER {w}")),
        );
        t.push(vec![
            r.pid.to_string(),
            r.process.clone(),
            r.tracker.clone(),
            r.kind.to_string(),
            id_text(r),
            d.state.unwrap_or_else(dash),
            d.local_addr.map_or_else(dash, |a| a.to_string()),
            d.peer_addr.map_or_else(dash, |a| a.to_string()),
            created_at(r),
            details.join(" "),
        ]);
    }
    t
}

/// One line per process and device: count and memory per kind.
pub fn memory_lines(memory: &[ProcessMemory]) -> Vec<String> {
    memory
        .iter()
        .filter(|m| !m.kinds.is_empty())
        .map(|m| {
            let kinds: Vec<String> = m
                .kinds
                .iter()
                .map(|(k, u)| format!("{k} {} ({})", u.count, human_bytes(u.bytes)))
                .collect();
            format!(
                "pid {} ({}) {}: {}; total {}",
                m.pid,
                m.process,
                m.tracker,
                kinds.join(", "),
                human_bytes(m.total_bytes)
            )
        })
        .collect()
}

/// Runs `softwarp resources`; returns the exit status.
pub fn run(args: &ResourcesArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<u8> {
    if args.holders {
        return super::fault::holders(&args.select, args.json, out, err);
    }
    let listing = gather(args, err)?;
    if args.json {
        serde_json::to_writer_pretty(&mut *out, &listing)?;
        writeln!(out)?;
    } else {
        table(&listing.resources).render(out)?;
        for p in &listing.summarized {
            writeln!(
                out,
                "pid {} ({}): {} resources, more than {ROWS_LIMIT}: counts per kind below \
                 (--kind, --id or --all for rows)",
                p.pid, p.process, p.omitted
            )?;
        }
        if args.kind.is_none() || !listing.summarized.is_empty() {
            let lines = memory_lines(&listing.memory);
            if !lines.is_empty() {
                writeln!(out)?;
                for l in lines {
                    writeln!(out, "{l}")?;
                }
            }
        }
    }
    Ok(report_failures(err, &listing.errors))
}

#[cfg(test)]
mod tests {
    use super::*;
    use softwarp_ras::tracker::ResourceDetails;
    use std::borrow::Cow;

    fn qp() -> ResourceInfo {
        ResourceInfo {
            tracker: "softwarp0/1".into(),
            kind: ResourceKind::Qp,
            id: 3,
            pid: 42,
            process: "pingpong".into(),
            thread: "main".into(),
            tid: 42,
            file: Cow::Borrowed("/home/u/app/examples/pingpong.rs"),
            line: 88,
            column: 5,
            created_unix_ms: 0,
            created: String::new(),
            caller: None,
            bytes: 1000,
            details: Some(ResourceDetails {
                state: Some("RTS".into()),
                local_addr: "127.0.0.1:7174".parse().ok(),
                peer_addr: "127.0.0.1:40000".parse().ok(),
                attrs: [("crc".to_string(), "on".to_string())].into(),
                ..ResourceDetails::default()
            }),
        }
    }

    #[test]
    fn a_qp_row_shows_owner_state_addresses_and_creating_line() {
        let mut out = Vec::new();
        table(&[qp()]).render(&mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let row = text.lines().nth(1).unwrap();
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            cells,
            [
                "42",
                "pingpong",
                "softwarp0/1",
                "qp",
                "3",
                "RTS",
                "127.0.0.1:7174",
                "127.0.0.1:40000",
                "app/examples/pingpong.rs:88",
                "crc=on"
            ]
        );
    }

    #[test]
    fn an_mr_id_is_its_stag_in_hex_and_missing_details_are_dashes() {
        let mut r = qp();
        r.kind = ResourceKind::Mr;
        r.id = 0x1234;
        r.details = None;
        let mut out = Vec::new();
        table(&[r]).render(&mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("mr    0x00001234  -      -      -"), "{text}");
    }

    #[test]
    fn a_c_callers_address_replaces_the_rust_line() {
        let mut r = qp();
        r.caller = Some("/usr/bin/rping(+0x3a2f)".into());
        let mut out = Vec::new();
        table(&[r]).render(&mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains(" /usr/bin/rping(+0x3a2f) "), "{text}");
        assert!(!text.contains("pingpong.rs"), "{text}");
    }

    #[test]
    fn source_paths_keep_the_crate_and_below() {
        assert_eq!(
            file_name("/work/x/crates/softwarp/tests/ras_wiring.rs"),
            "softwarp/tests/ras_wiring.rs"
        );
        assert_eq!(file_name("src/main.rs"), "src/main.rs");
        assert_eq!(file_name("main.rs"), "main.rs");
    }

    #[test]
    fn memory_lines_sum_each_device() {
        let m = ProcessMemory {
            pid: 1,
            process: "p".into(),
            tracker: "softwarp0/1".into(),
            kinds: [(
                ResourceKind::Qp,
                KindUsage {
                    count: 2,
                    bytes: 2048,
                },
            )]
            .into(),
            total_bytes: 2048,
        };
        assert_eq!(
            memory_lines(&[m]),
            ["pid 1 (p) softwarp0/1: qp 2 (2.0 KiB); total 2.0 KiB"]
        );
    }
}
