//! The operator commands: `resources`, `stat`, `trace`, `snapshots`, `dump`, `fault` and
//! `doctor`.
//!
//! All but `doctor` ask running Softwarp processes: every process that opened a device is in
//! the host registry (one file per process in the runtime directory, `$SOFTWARP_RUNTIME_DIR`
//! or its default, see `softwarp_ras::registry`) with its control socket; the commands send
//! one JSON request per process over that socket, to all of them at once (up to
//! [`control::MAX_IN_FLIGHT`] in flight, see [`ask`]), and print the answers, each with a
//! time limit ([`TIMEOUT`]). Registry entries of processes that are
//! gone are cleaned on the way, so a killed process disappears from every listing. `doctor`
//! only reads the host's configuration.
//!
//! Each command writes to the writer it is given (tests capture it) and returns the exit
//! status: 0 when every selected process answered, [`EXIT_PARTIAL`] when some did not (they
//! are named on standard error), and an error when nothing could be asked at all (the
//! registry cannot be read, or `--pid` names no registered process).

pub mod doctor;
pub mod dump;
pub mod fault;
pub mod resources;
pub mod snapshots;
pub mod stat;
pub mod table;
pub mod trace;

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use softwarp_ras::control::{self, ClientError, Concurrently, Reply, Request};
use softwarp_ras::deadline::Deadline;
use softwarp_ras::registry::{HostRegistry, ProcessEntry};

/// How long one process may take to answer one request.
pub const TIMEOUT: Duration = Duration::from_secs(3);

/// Exit status when some selected processes did not answer.
pub const EXIT_PARTIAL: u8 = 2;

/// Which processes a command asks (every registered process by default).
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct Select {
    /// Only the process with this pid.
    #[arg(long)]
    pub pid: Option<u32>,
    /// Only processes whose name contains this text.
    #[arg(long)]
    pub name: Option<String>,
}

impl Select {
    /// Whether `entry` is selected.
    pub fn matches(&self, entry: &ProcessEntry) -> bool {
        self.pid.is_none_or(|p| p == entry.pid)
            && self.name.as_deref().is_none_or(|n| entry.name.contains(n))
    }
}

/// The registry of the runtime directory this command uses.
pub fn registry() -> Result<HostRegistry> {
    let dir: PathBuf = softwarp_ras::registry::runtime_dir();
    HostRegistry::open(&dir)
        .with_context(|| format!("opening the host registry in {}", dir.display()))
}

/// The live registered processes `select` names (stale entries are cleaned first). Fails
/// when `--pid` names a process that is not registered; says so on `err` when there is
/// none at all.
pub fn processes(select: &Select, err: &mut dyn Write) -> Result<Vec<ProcessEntry>> {
    let reg = registry()?;
    let live = reg
        .live()
        .with_context(|| format!("reading the host registry in {}", reg.dir().display()))?;
    let chosen: Vec<ProcessEntry> = live.into_iter().filter(|e| select.matches(e)).collect();
    if let Some(pid) = select.pid {
        if chosen.is_empty() {
            bail!(
                "no running Softwarp process with pid {pid} is registered in {} \
                 (is SOFTWARP_RUNTIME_DIR the same as the process's?)",
                reg.dir().display()
            );
        }
    }
    if chosen.is_empty() {
        let _ = writeln!(
            err,
            "softwarp: no running Softwarp process{} is registered in {}",
            if *select == Select::default() {
                ""
            } else {
                " matches"
            },
            reg.dir().display()
        );
    }
    Ok(chosen)
}

/// One process's answer.
#[derive(Debug)]
pub struct Answer {
    /// The process.
    pub entry: ProcessEntry,
    /// Its reply, or why there is none.
    pub reply: Result<Reply, ClientError>,
}

/// Sends `req` to each of `entries`, all at once ([`control::ask_concurrently`]: up to
/// [`control::MAX_IN_FLIGHT`] requests in flight, one `poll`): the time is the slowest
/// process's, not the sum. Each process has [`TIMEOUT`] to answer; answers are in the
/// entries' order.
pub fn ask(entries: &[ProcessEntry], req: &Request) -> Vec<Answer> {
    // Enough for every round of MAX_IN_FLIGHT processes to take its whole TIMEOUT.
    let rounds = entries.len().div_ceil(control::MAX_IN_FLIGHT).max(1);
    let how = Concurrently {
        deadline: Deadline::after(
            TIMEOUT.saturating_mul(u32::try_from(rounds).unwrap_or(u32::MAX))
                + Duration::from_secs(1),
        ),
        per_request: TIMEOUT,
        essential: entries.len(),
        grace: Duration::ZERO,
        max_reply: control::MAX_REPLY_LINE,
    };
    entries
        .iter()
        .zip(control::ask_concurrently(entries, req, &how))
        .map(|(entry, reply)| Answer {
            entry: entry.clone(),
            reply,
        })
        .collect()
}

/// A process that did not answer, as the JSON outputs list it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Failure {
    /// Its pid.
    pub pid: u32,
    /// Its name.
    pub process: String,
    /// What went wrong.
    pub error: String,
}

impl Failure {
    /// The failure of `entry` with `error`.
    pub fn new(entry: &ProcessEntry, error: impl ToString) -> Self {
        Self {
            pid: entry.pid,
            process: entry.name.clone(),
            error: error.to_string(),
        }
    }
}

/// Names the failures on `err` (standard error); returns the exit status.
pub fn report_failures(err: &mut dyn Write, failures: &[Failure]) -> u8 {
    for f in failures {
        let _ = writeln!(
            err,
            "softwarp: pid {} ({}) did not answer: {}",
            f.pid, f.process, f.error
        );
    }
    if failures.is_empty() {
        0
    } else {
        EXIT_PARTIAL
    }
}

/// Bytes in a short human form (`512 B`, `12.5 KiB`, `3.0 MiB`).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = UNITS[0];
    for u in UNITS.iter().skip(1) {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    format!("{v:.1} {unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(pid: u32, name: &str) -> ProcessEntry {
        ProcessEntry {
            pid,
            name: name.into(),
            uid: 0,
            start_unix_ms: 0,
            start_time: String::new(),
            proc_start_ticks: None,
            control_socket: PathBuf::from("/nonexistent.sock"),
            version: String::new(),
        }
    }

    #[test]
    fn selection_by_pid_and_name_fragment() {
        let all = Select::default();
        assert!(all.matches(&entry(7, "pingpong")));
        let pid = Select {
            pid: Some(7),
            name: None,
        };
        assert!(pid.matches(&entry(7, "a")));
        assert!(!pid.matches(&entry(8, "a")));
        let name = Select {
            pid: None,
            name: Some("pong".into()),
        };
        assert!(name.matches(&entry(1, "pingpong")));
        assert!(!name.matches(&entry(1, "bench")));
    }

    #[test]
    fn a_process_that_cannot_be_reached_is_a_failure_not_a_panic() {
        let answers = ask(&[entry(1, "gone")], &Request::Info);
        assert_eq!(answers.len(), 1);
        assert!(answers[0].reply.is_err());
        let mut err = Vec::new();
        let f = [Failure::new(&answers[0].entry, "x")];
        assert_eq!(report_failures(&mut err, &f), EXIT_PARTIAL);
        assert!(String::from_utf8(err).unwrap().contains("pid 1 (gone)"));
        assert_eq!(report_failures(&mut Vec::new(), &[]), 0);
    }

    #[test]
    fn bytes_are_shown_in_binary_units() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
        assert_eq!(human_bytes(5 << 40), "5.0 TiB");
    }
}
