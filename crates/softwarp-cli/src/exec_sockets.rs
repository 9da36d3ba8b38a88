//! `softwarp exec --sockets -- PROGRAM [ARGS]`: runs an unmodified program with the preload
//! library of `softwarp-preload` (`libsoftwarp_preload.so`), so that its TCP sockets run
//! over iWARP. (Without `--sockets`, `exec` runs an rdma-core program over
//! `softwarp-verbs`: the library crate's `exec` module.)

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

/// The library's file name.
pub const LIBRARY: &str = softwarp_cli::install::PRELOAD_LIBRARY;

/// The options of `softwarp exec` that only `--sockets` uses.
#[derive(Debug, clap::Args)]
pub struct SocketsArgs {
    /// With --sockets: only sockets that set SOL_SOFTWARP/SO_IWARP_MODE go iWARP (default:
    /// every TCP socket, within --ports/--deny-ports).
    #[arg(long)]
    pub opt_in: bool,
    /// With --sockets: only these ports go iWARP, e.g. 5201,6379,8000-8100 (destination
    /// port of connect, local port of listen).
    #[arg(long, value_name = "LIST")]
    pub ports: Option<String>,
    /// With --sockets: these ports never go iWARP.
    #[arg(long, value_name = "LIST")]
    pub deny_ports: Option<String>,
    /// With --sockets: print one line per iWARP stream on standard error when it closes
    /// (its QP counters).
    #[arg(long)]
    pub stats: bool,
    /// With --sockets: the preload library (default: $SOFTWARP_PRELOAD, else
    /// libsoftwarp_preload.so next to this executable or in ../lib).
    #[arg(long, value_name = "PATH")]
    pub library: Option<PathBuf>,
}

impl SocketsArgs {
    /// Whether any of these options was given (they need `--sockets`).
    pub fn any(&self) -> bool {
        self.opt_in
            || self.stats
            || self.ports.is_some()
            || self.deny_ports.is_some()
            || self.library.is_some()
    }
}

/// Where the preload library is.
pub fn find_library(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    let mut tried = Vec::new();
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = explicit {
        candidates.push(p.to_path_buf());
    } else {
        if let Some(p) = std::env::var_os("SOFTWARP_PRELOAD") {
            candidates.push(PathBuf::from(p));
        }
        if let Some(dir) = std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(Path::to_path_buf))
        {
            candidates.push(dir.join(LIBRARY));
            candidates.push(dir.join("../lib").join(LIBRARY));
            // `cargo test` runs binaries from target/<profile>; the library is built there too.
            candidates.push(dir.join("deps").join(LIBRARY));
        }
    }
    for c in candidates {
        if c.is_file() {
            return std::fs::canonicalize(&c).with_context(|| format!("resolving {}", c.display()));
        }
        tried.push(c.display().to_string());
    }
    bail!(
        "{LIBRARY} not found (tried {}); build it with `cargo build --release -p softwarp-preload` \
         or give --library",
        tried.join(", ")
    )
}

/// The command `exec` runs (without running it).
pub fn command(args: &SocketsArgs, program: &[OsString]) -> anyhow::Result<Command> {
    let lib = find_library(args.library.as_deref())?;
    let Some((program, rest)) = program.split_first() else {
        bail!("no program given");
    };
    let mut preload = OsString::from(lib);
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        preload.push(" ");
        preload.push(old);
    }
    let mut cmd = Command::new(program);
    cmd.args(rest).env("LD_PRELOAD", preload).env(
        "SOFTWARP_SOCKETS",
        if args.opt_in { "option" } else { "all" },
    );
    if let Some(p) = &args.ports {
        cmd.env("SOFTWARP_SOCKETS_PORTS", p);
    }
    if let Some(p) = &args.deny_ports {
        cmd.env("SOFTWARP_SOCKETS_DENY_PORTS", p);
    }
    if args.stats {
        cmd.env("SOFTWARP_SOCKETS_STATS", "1");
    }
    Ok(cmd)
}

/// Replaces this process with the program; returns only on failure.
pub fn run(args: &SocketsArgs, program: &[OsString]) -> anyhow::Error {
    match command(args, program) {
        Ok(mut cmd) => {
            let e = cmd.exec();
            anyhow::Error::new(e).context(format!("running {:?}", program.first()))
        }
        Err(e) => e,
    }
}
