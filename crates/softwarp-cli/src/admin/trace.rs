//! `softwarp trace`: read and change the trace levels of running processes (per component,
//! per QP, the flight recorder's) without restarting them, and read their flight recorders
//! (`tail`, `tail -f`).

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use softwarp_ras::control::{ControlClient, Request};
use softwarp_ras::registry::ProcessEntry;
use softwarp_ras::trace::{FlightRecorderDump, Record, TraceLevels, TraceSpec};

use super::{ask, processes, report_failures, Failure, Select, TIMEOUT};

/// Options of `softwarp trace`.
#[derive(Debug, Clone, clap::Args)]
pub struct TraceArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: TraceCommand,
}

/// `softwarp trace` subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum TraceCommand {
    /// Print the trace levels of each process (as a spec `trace set` accepts).
    Get {
        /// Which processes.
        #[command(flatten)]
        select: Select,
        /// JSON, one object per process.
        #[arg(long)]
        json: bool,
    },
    /// Change trace levels at run time, e.g. `qp=7`, `default=2,cm=5`, `qpn:17=9`,
    /// `recorder=6`, `qpn:*=off` (components: wire engine qp cq mr cm runtime sockets ras;
    /// levels 0-9 or off: 1 errors, 2 rare events, 4 entry/exit, 5 internals, 7 hot-path
    /// entry/exit, 8 hot-path internals, 9 data dumps).
    Set {
        /// The settings.
        spec: String,
        /// Which processes.
        #[command(flatten)]
        select: Select,
        /// JSON, one object per process.
        #[arg(long)]
        json: bool,
    },
    /// Print the newest records of the flight recorders.
    Tail {
        /// Which processes.
        #[command(flatten)]
        select: Select,
        /// Keep printing records as they arrive (until interrupted, `--seconds`, or every
        /// process is gone).
        #[arg(short = 'f', long)]
        follow: bool,
        /// How many of the newest records to print first.
        #[arg(long, default_value_t = 20)]
        count: usize,
        /// With -f: stop after this many seconds.
        #[arg(long, value_name = "SECS", requires = "follow")]
        seconds: Option<f64>,
        /// One JSON object per record (with `pid` and `process`).
        #[arg(long)]
        json: bool,
    },
}

/// Runs `softwarp trace`; returns the exit status.
pub fn run(args: &TraceArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<u8> {
    match &args.command {
        TraceCommand::Get { select, json } => levels(select, &Request::TraceGet, *json, out, err),
        TraceCommand::Set { spec, select, json } => {
            // Refuse a malformed spec here, before any process sees it.
            spec.parse::<TraceSpec>()
                .with_context(|| format!("trace spec {spec:?}"))?;
            levels(
                select,
                &Request::TraceSet { spec: spec.clone() },
                *json,
                out,
                err,
            )
        }
        TraceCommand::Tail {
            select,
            follow,
            count,
            seconds,
            json,
        } => tail(select, *follow, *count, *seconds, *json, out, err),
    }
}

/// One line of `trace get`/`trace set`: `pid <n> (<name>): <spec>`.
pub fn levels_line(entry: &ProcessEntry, levels: &TraceLevels) -> String {
    format!("pid {} ({}): {}", entry.pid, entry.name, levels.to_spec())
}

fn levels(
    select: &Select,
    req: &Request,
    json: bool,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<u8> {
    let entries = processes(select, err)?;
    let mut failures = Vec::new();
    for a in ask(&entries, req) {
        match a.reply.and_then(|r| r.into_result::<TraceLevels>()) {
            Ok(levels) if json => {
                let v = serde_json::json!({
                    "pid": a.entry.pid,
                    "process": a.entry.name,
                    "levels": levels,
                });
                writeln!(out, "{v}")?;
            }
            Ok(levels) => writeln!(out, "{}", levels_line(&a.entry, &levels))?,
            Err(e) => failures.push(Failure::new(&a.entry, e)),
        }
    }
    Ok(report_failures(err, &failures))
}

/// A record as `trace tail` prints it: `pid <n> <name> | <record>`.
pub fn record_line(entry: &ProcessEntry, r: &Record) -> String {
    format!("pid {} {} | {r}", entry.pid, entry.name)
}

fn print_records(
    mut batch: Vec<(ProcessEntry, Record)>,
    json: bool,
    out: &mut dyn Write,
) -> Result<()> {
    batch.sort_by_key(|(e, r)| (r.time_unix_ns, e.pid, r.seq));
    for (e, r) in batch {
        if json {
            let mut v = serde_json::to_value(&r)?;
            if let Some(o) = v.as_object_mut() {
                o.insert("pid".into(), e.pid.into());
                o.insert("process".into(), e.name.clone().into());
            }
            writeln!(out, "{v}")?;
        } else {
            writeln!(out, "{}", record_line(&e, &r))?;
        }
    }
    out.flush()?;
    Ok(())
}

struct Followed {
    entry: ProcessEntry,
    client: ControlClient,
    /// Sequence number of the last record seen.
    last: u64,
}

const FOLLOW_POLL: Duration = Duration::from_millis(200);

fn tail(
    select: &Select,
    follow: bool,
    count: usize,
    seconds: Option<f64>,
    json: bool,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<u8> {
    let deadline = match seconds {
        Some(s) if s.is_finite() && (0.0..=31_536_000.0).contains(&s) => {
            Some(Instant::now() + Duration::from_secs_f64(s))
        }
        Some(s) => bail!("--seconds needs a duration in seconds, not {s}"),
        None => None,
    };
    let entries = processes(select, err)?;
    let mut failures = Vec::new();
    let mut followed = Vec::new();
    let mut batch = Vec::new();
    for entry in entries {
        let mut client = match ControlClient::connect_entry(&entry, TIMEOUT) {
            Ok(c) => c,
            Err(e) => {
                failures.push(Failure::new(&entry, e));
                continue;
            }
        };
        let req = Request::FlightRecorder {
            tail: Some(count),
            after: None,
        };
        let dump: FlightRecorderDump = match client.request(&req).and_then(|r| r.into_result()) {
            Ok(d) => d,
            Err(e) => {
                failures.push(Failure::new(&entry, e));
                continue;
            }
        };
        let last = dump.next_seq.saturating_sub(1);
        batch.extend(dump.records.into_iter().map(|r| (entry.clone(), r)));
        followed.push(Followed {
            entry,
            client,
            last,
        });
    }
    // The newest `count` over every process.
    batch.sort_by_key(|(e, r)| (r.time_unix_ns, e.pid, r.seq));
    let skip = batch.len().saturating_sub(count);
    print_records(batch.split_off(skip), json, out)?;
    if !follow {
        return Ok(report_failures(err, &failures));
    }
    while !followed.is_empty() && deadline.is_none_or(|d| Instant::now() < d) {
        std::thread::sleep(FOLLOW_POLL);
        let mut batch = Vec::new();
        let mut gone = Vec::new();
        for (i, f) in followed.iter_mut().enumerate() {
            let req = Request::FlightRecorder {
                tail: None,
                after: Some(f.last),
            };
            match f
                .client
                .request(&req)
                .and_then(|r| r.into_result::<FlightRecorderDump>())
            {
                Ok(dump) => {
                    if let Some(first) = dump.records.first() {
                        if first.seq > f.last.saturating_add(1) {
                            writeln!(
                                err,
                                "softwarp: pid {}: {} records were evicted before they could be read",
                                f.entry.pid,
                                first.seq - f.last - 1
                            )?;
                        }
                    }
                    f.last = dump.records.last().map_or(f.last, |r| r.seq).max(f.last);
                    batch.extend(dump.records.into_iter().map(|r| (f.entry.clone(), r)));
                }
                Err(e) => {
                    writeln!(
                        err,
                        "softwarp: pid {} ({}) stopped answering: {e}",
                        f.entry.pid, f.entry.name
                    )?;
                    gone.push(i);
                }
            }
        }
        for i in gone.into_iter().rev() {
            followed.remove(i);
        }
        print_records(batch, json, out)?;
    }
    Ok(report_failures(err, &failures))
}

#[cfg(test)]
mod tests {
    use super::*;
    use softwarp_ras::trace::{Component, Level};
    use std::path::PathBuf;

    fn entry() -> ProcessEntry {
        ProcessEntry {
            pid: 99,
            name: "app".into(),
            uid: 0,
            start_unix_ms: 0,
            start_time: String::new(),
            proc_start_ticks: None,
            control_socket: PathBuf::new(),
            version: String::new(),
        }
    }

    #[test]
    fn levels_print_as_a_spec_that_parses_back() {
        let levels = TraceLevels {
            components: [(Component::Qp, Level::HOT_ENTRY_EXIT)].into(),
            other: Level::ERROR,
            recorder: Level::INTERNALS,
            qps: Vec::new(),
        };
        let line = levels_line(&entry(), &levels);
        assert_eq!(line, "pid 99 (app): qp=7,other=1,recorder=5");
        let spec = line.split_once(": ").unwrap().1;
        assert!(spec.parse::<TraceSpec>().is_ok());
    }

    #[test]
    fn a_record_line_names_its_process() {
        let r = Record {
            level: 7,
            component: Some(Component::Qp),
            message: "post_send".into(),
            ..Record::default()
        };
        let line = record_line(&entry(), &r);
        assert!(line.starts_with("pid 99 app | "), "{line}");
        assert!(line.contains(" L7 qp "), "{line}");
        assert!(line.ends_with("post_send"), "{line}");
    }
}
