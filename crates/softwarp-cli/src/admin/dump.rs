//! `softwarp dump`: asks running processes for a component dump (their whole RAS state in
//! the self-describing format of `softwarp_ras::dump`) and writes it to a file, standard
//! output, or a remote TCP collector. `softwarp decode FILE` reads it back.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use softwarp_ras::control::{ControlClient, DumpResult, Request};
use softwarp_ras::dump;

use super::{processes, report_failures, Failure, Select};

/// How long a process may take to make its dump (it copies the whole flight recorder).
pub const DUMP_TIMEOUT: Duration = Duration::from_secs(20);
/// How long connecting and sending to a collector may take.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// Options of `softwarp dump`.
#[derive(Debug, Clone, clap::Args)]
pub struct DumpArgs {
    /// Which processes (every registered one by default; `-o FILE` needs exactly one).
    #[command(flatten)]
    pub select: Select,
    /// Write the dump to this file (`-` for standard output). Default:
    /// `softwarp-<pid>-<unix ms>.swdump` in the current directory, one per process.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Send the dump to a TCP collector at HOST:PORT (a plain stream of the dump's bytes)
    /// instead of writing a file (with `-o` as well: both).
    #[arg(long = "to", value_name = "HOST:PORT")]
    pub to: Option<String>,
    /// Why the dump is taken (recorded in its `process` section).
    #[arg(long, default_value = "on demand (softwarp dump)")]
    pub reason: String,
}

fn write_file(path: &Path, bytes: &[u8], out: &mut dyn Write) -> Result<()> {
    if path == Path::new("-") {
        out.write_all(bytes)?;
        out.flush()?;
        return Ok(());
    }
    // 0600, as the process's own automatic dumps: a dump names peers, resources and trace
    // records, for its owner only.
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("writing {}", path.display()))
}

/// Runs `softwarp dump`; returns the exit status.
pub fn run(args: &DumpArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<u8> {
    let entries = processes(&args.select, err)?;
    if args.output.is_some() && entries.len() > 1 {
        bail!(
            "{} processes are selected and -o names one file: choose one with --pid",
            entries.len()
        );
    }
    // With the dump on standard output, the messages go to standard error.
    let to_stdout = args.output.as_deref() == Some(Path::new("-"));
    let mut failures = Vec::new();
    for entry in &entries {
        let req = Request::Dump {
            reason: Some(args.reason.clone()),
        };
        let got = ControlClient::connect_entry(entry, DUMP_TIMEOUT)
            .and_then(|mut c| c.request(&req))
            .and_then(|r| r.into_result::<DumpResult>());
        let bytes = match got {
            Ok(d) => d.dump.into_bytes(),
            Err(e) => {
                failures.push(Failure::new(entry, e));
                continue;
            }
        };
        let sections = match dump::parse(&bytes) {
            Ok(d) if d.is_complete() => d.sections.len(),
            Ok(d) => {
                let e = d.error.map(|e| e.to_string()).unwrap_or_default();
                failures.push(Failure::new(entry, format!("its dump is damaged: {e}")));
                continue;
            }
            Err(e) => {
                failures.push(Failure::new(entry, format!("its dump is not one: {e}")));
                continue;
            }
        };
        let mut said = Vec::new();
        if let Some(addr) = &args.to {
            dump::send_to(addr, &bytes, SEND_TIMEOUT)
                .with_context(|| format!("sending the dump of pid {} to {addr}", entry.pid))?;
            said.push(format!("sent to {addr}"));
        }
        if args.output.is_some() || args.to.is_none() {
            let path = args.output.clone().unwrap_or_else(|| {
                let ms = softwarp_ras::clock::unix_ms(std::time::SystemTime::now());
                PathBuf::from(format!("softwarp-{}-{ms}{}", entry.pid, dump::DUMP_SUFFIX))
            });
            write_file(&path, &bytes, out)?;
            said.push(if to_stdout {
                "written to standard output".to_string()
            } else {
                format!("written to {}", path.display())
            });
        }
        let line = format!(
            "pid {} ({}): dump {} ({} bytes, {sections} sections)",
            entry.pid,
            entry.name,
            said.join(" and "),
            bytes.len()
        );
        if to_stdout {
            writeln!(err, "{line}")?;
        } else {
            writeln!(out, "{line}")?;
        }
    }
    Ok(report_failures(err, &failures))
}
