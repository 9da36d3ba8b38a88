//! `softwarp`: the command-line tool of the Softwarp iWARP stack.
//!
//! `decode` prints one line per MPA frame and FPDU of a pcap/pcapng capture (or one JSON
//! object per line with `--json`). Exit status: 0 when everything decoded cleanly, 1 when the
//! file could not be read as a capture, 2 when it was decoded but something in it was
//! malformed (a bad CRC, a segment the codecs refuse, a cut capture).
//!
//! `bench` measures Softwarp against raw TCP with perftest's shapes and flags (the
//! `softwarp-bench` crate; this is its front end).
//!
//! `demo` runs a server and a client on loopback and exercises every iWARP operation (exit
//! status 0 when every byte and completion checked out, 1 otherwise).
//!
//! `decode` also reads component dumps (`SOFTWARP-DUMP` eye-catcher): exit status 0 when
//! the dump is whole, 2 when it is truncated or damaged.
//!
//! `exec --sockets -- PROGRAM` runs a program with the extended sockets preload library
//! (exit status: the program's, or 1 when it could not be started).
//!
//! `resources`, `stat`, `trace`, `snapshots`, `dump` ask running Softwarp processes over their control sockets
//! (exit status 0, or 2 when some process did not answer); `doctor` checks the host.
//!
//! `exec -- PROGRAM ARGS` runs an rdma-core program over Softwarp's libibverbs/librdmacm
//! (exit status: the program's; 1 when it could not be started).

use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use softwarp_cli::admin;
use softwarp_cli::decode::{decode_capture, output_to_json, Output};

mod demo;
mod exec_sockets;

#[derive(Debug, Parser)]
#[command(name = "softwarp", version, about = "Softwarp iWARP stack tools")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Decode the iWARP traffic (MPA frames and FPDUs) of a pcap or pcapng capture, or a
    /// component dump (`softwarp dump`, automatic dumps).
    ///
    /// Captures: one line per MPA Request/Reply and FPDU, in the format of iwarp-decode
    /// (tshark): frame, TCP ports, kind, fields, payload, ULPDU length, pad, CRC verdict.
    /// The capture must contain the start of each connection (the MPA Request). Dumps
    /// (recognised by their `SOFTWARP-DUMP` eye-catcher): every section as text; a
    /// truncated or damaged dump is reported (exit status 2).
    Decode {
        /// The capture or dump file.
        file: PathBuf,
        /// Print one JSON object per line instead of text.
        #[arg(long)]
        json: bool,
        /// Print a summary (counts) to standard error at the end.
        #[arg(long)]
        summary: bool,
    },
    /// Run a server and a client on loopback (two threads) and exercise every iWARP
    /// operation: one line per operation with its size and timing.
    Demo(demo::DemoArgs),
    /// Benchmark Softwarp with perftest's shapes (send/write/read, bandwidth/latency) and
    /// flags, each next to a raw TCP baseline, printed as ratios.
    ///
    /// As perftest: with no PEER this is the server, `softwarp bench SHAPES PEER` the client
    /// of a two-process run; `--loopback` runs both in this process. `qp_mem` runs in the
    /// `softwarp-bench` program (the one with a counting allocator).
    Bench(softwarp_bench::BenchArgs),
    /// List the devices, PDs, MRs, CQs, SRQs, QPs and listeners of every Softwarp process on
    /// the host (like `rdma resource show`): owner, state, addresses, creating source line.
    Resources(admin::resources::ResourcesArgs),
    /// Print the statistics of Softwarp processes (per QP, CQ, device; TCP_INFO), or with
    /// --watch their per-second rates.
    Stat(admin::stat::StatArgs),
    /// Get or set trace levels of running processes, or read their flight recorders.
    Trace(admin::trace::TraceArgs),
    /// Show the snapshots of failed QPs kept by running processes (state, reason,
    /// Terminate, counters, TCP_INFO, trace records).
    Snapshots(admin::snapshots::SnapshotsArgs),
    /// Write a component dump of running processes (their whole RAS state) to a file or a
    /// TCP collector; `softwarp decode` reads it.
    Dump(admin::dump::DumpArgs),
    /// Inject a device fault into a running process, or show the state, fault, recovery
    /// and holders of every device.
    #[command(subcommand)]
    Fault(admin::fault::FaultCommand),
    /// Check this host's configuration for Softwarp (MTU, offloads, socket buffers, clock
    /// source, open-file limit) and give advice.
    Doctor(admin::doctor::DoctorArgs),
    /// Run an unmodified rdma-core program (ibv_devinfo, rping, perftest, your own) over
    /// Softwarp: its libibverbs.so.1 and librdmacm.so.1 are Softwarp's
    /// (`crates/softwarp-verbs`), found through LD_LIBRARY_PATH.
    ///
    /// Example: `softwarp exec -- rping -s -a 127.0.0.1`. The settings below become
    /// SOFTWARP_* environment variables, which the library reads (see README).
    ///
    /// With --sockets, runs any program with the extended sockets preload library
    /// (libsoftwarp_preload.so) instead, so that its TCP sockets become iWARP streams (both
    /// ends must run this way): `softwarp exec --sockets -- socat ...`.
    Exec(ExecArgs),
    /// Install this executable and the libraries under a lasting prefix, for programs built
    /// against Softwarp: PREFIX/bin/softwarp, PREFIX/lib/softwarp/ (libsoftwarp_verbs.so with
    /// the links libibverbs.so.1, librdmacm.so.1, libibverbs.so, librdmacm.so),
    /// PREFIX/lib/pkgconfig/softwarp-verbs.pc, and PREFIX/lib/libsoftwarp_preload.so when it
    /// was built.
    ///
    /// Example: `softwarp install --prefix ~/.local`, then `cc app.c $(PKG_CONFIG_PATH=
    /// ~/.local/lib/pkgconfig pkg-config --cflags --libs softwarp-verbs)`.
    Install(InstallArgs),
}

#[derive(Debug, clap::Args)]
struct InstallArgs {
    /// Where to install (made if missing), e.g. /usr/local or ~/.local.
    #[arg(long)]
    prefix: PathBuf,
    /// The C library to install (default: as `softwarp exec` finds it).
    #[arg(long)]
    lib: Option<PathBuf>,
    /// The sockets preload library to install (default: as `softwarp exec --sockets` finds
    /// it; skipped with a note when it was not built).
    #[arg(long)]
    preload: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct ExecArgs {
    /// The library (default: $SOFTWARP_VERBS_LIB, else libsoftwarp_verbs.so beside this
    /// executable).
    #[arg(long)]
    lib: Option<PathBuf>,
    /// CRC32c: off, preferred, required (SOFTWARP_CRC).
    #[arg(long, value_parser = ["off", "preferred", "required"])]
    crc: Option<String>,
    /// MPA revision: 1 or 2 (SOFTWARP_MPA_REV).
    #[arg(long, value_parser = ["1", "2"])]
    mpa_rev: Option<String>,
    /// MPA markers: off, accept, request (SOFTWARP_MARKERS).
    #[arg(long, value_parser = ["off", "accept", "request"])]
    markers: Option<String>,
    /// Start from Linux siw's settings (SOFTWARP_SIW=1).
    #[arg(long)]
    siw: bool,
    /// No RFC 6581 peer-to-peer mode as initiator (SOFTWARP_P2P=0).
    #[arg(long)]
    no_p2p: bool,
    /// Show the device where rdma-core tools and middleware look for it: the program runs in
    /// a mount namespace of its own whose /sys/class has infiniband/softwarp0 (port, GID,
    /// device/net/IFNAME) beside the host's classes. Needs root or unprivileged user
    /// namespaces; the host's /sys is not touched.
    #[arg(long)]
    sysfs: bool,
    /// The network interface the view names in device/net (default: the interface the
    /// device's GUID comes from, else lo).
    #[arg(long, value_name = "IFNAME", requires = "sysfs")]
    sysfs_netdev: Option<String>,
    /// Turn on the RAS services in the program (SOFTWARP_RAS=on), for `softwarp resources`.
    #[arg(long)]
    ras: bool,
    /// Busy-poll the CQs made without a completion channel (SOFTWARP_BUSY_POLL=1): the
    /// polling thread moves the bytes, for programs that poll their CQs in a loop
    /// (ib_send_bw, ib_send_lat). A QP whose program stops polling with bytes waiting is
    /// served by the progress thread after 10-20 ms, so nothing hangs.
    #[arg(long)]
    busy_poll: bool,
    /// Print shell assignments (for `eval`) that put the library directory on
    /// LD_LIBRARY_PATH and its pkg-config file (softwarp-verbs.pc) on PKG_CONFIG_PATH, and
    /// run nothing: `cc app.c $(pkg-config --cflags --libs softwarp-verbs)` then builds a
    /// program that runs on Softwarp without LD_LIBRARY_PATH.
    #[arg(long, conflicts_with = "sockets")]
    print_env: bool,
    /// Preload the extended sockets library instead (its options below).
    #[arg(long)]
    sockets: bool,
    #[command(flatten)]
    sockets_args: exec_sockets::SocketsArgs,
    /// The program and its arguments.
    #[arg(
        required_unless_present = "print_env",
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    command: Vec<std::ffi::OsString>,
}

/// `softwarp install`: copies this executable and the libraries under `--prefix`.
fn install(args: &InstallArgs) -> anyhow::Result<ExitCode> {
    let exe = std::env::current_exe().context("locating the softwarp executable")?;
    let verbs = softwarp_cli::exec::find_library(args.lib.as_deref())?;
    let preload = match (
        &args.preload,
        exec_sockets::find_library(args.preload.as_deref()),
    ) {
        (_, Ok(p)) => Some(p),
        (Some(_), Err(e)) => return Err(e),
        (None, Err(e)) => {
            eprintln!("softwarp install: no sockets preload library ({e:#})");
            None
        }
    };
    let from = softwarp_cli::install::Sources {
        exe,
        verbs,
        preload,
    };
    for line in softwarp_cli::install::install(&from, &args.prefix)? {
        println!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

/// `softwarp exec`: replaces this process with the program (returns only on failure).
fn exec(args: &ExecArgs) -> anyhow::Result<ExitCode> {
    use std::os::unix::process::CommandExt;
    if args.sockets {
        return Err(exec_sockets::run(&args.sockets_args, &args.command));
    }
    if args.sockets_args.any() {
        anyhow::bail!(
            "--opt-in, --ports, --deny-ports, --stats and --library go with --sockets \
             (`softwarp exec --sockets -- PROGRAM`)"
        );
    }
    let lib = softwarp_cli::exec::find_library(args.lib.as_deref())?;
    let dir = softwarp_cli::exec::library_dir(&lib)?;
    if args.print_env {
        if !args.command.is_empty() {
            anyhow::bail!("--print-env runs no program");
        }
        print!("{}", softwarp_cli::exec::print_env(&dir));
        return Ok(ExitCode::SUCCESS);
    }
    let Some((program, rest)) = args.command.split_first() else {
        anyhow::bail!("no program given");
    };
    let mut cmd = std::process::Command::new(program);
    cmd.args(rest)
        .env("LD_LIBRARY_PATH", softwarp_cli::exec::library_path(&dir));
    for (var, value) in [
        ("SOFTWARP_CRC", args.crc.clone()),
        ("SOFTWARP_MPA_REV", args.mpa_rev.clone()),
        ("SOFTWARP_MARKERS", args.markers.clone()),
        ("SOFTWARP_SIW", args.siw.then(|| "1".to_string())),
        ("SOFTWARP_P2P", args.no_p2p.then(|| "0".to_string())),
        ("SOFTWARP_RAS", args.ras.then(|| "on".to_string())),
        (
            "SOFTWARP_BUSY_POLL",
            args.busy_poll.then(|| "1".to_string()),
        ),
    ] {
        if let Some(v) = value {
            cmd.env(var, v);
        }
    }
    if args.sysfs {
        let view = softwarp_cli::sysfs_view::DeviceView::current(args.sysfs_netdev.as_deref())?;
        softwarp_cli::sysfs_view::enter(&view).context("softwarp exec --sysfs")?;
    }
    let err = cmd.exec();
    Err(err).with_context(|| format!("running {}", Path::new(program).display()))
}

fn print_output(out: &mut impl Write, output: &Output, json: bool) -> io::Result<()> {
    if json {
        writeln!(out, "{}", output_to_json(output))
    } else {
        writeln!(out, "{output}")
    }
}

/// `softwarp decode` of a component dump: exit status 0 when it is whole, 2 when it is
/// truncated or damaged (what could be read is printed, then what is wrong).
fn decode_dump(file: &Path, bytes: &[u8], json: bool) -> anyhow::Result<ExitCode> {
    let parsed = softwarp_ras::dump::parse(bytes)
        .with_context(|| format!("{} is not a dump softwarp can read", file.display()))?;
    let mut out = BufWriter::new(io::stdout().lock());
    let written = if json {
        writeln!(out, "{}", softwarp_cli::decode::dump::to_json(&parsed))
    } else {
        softwarp_cli::decode::dump::write_text(&parsed, &mut out)
    }
    .and_then(|()| out.flush());
    match written {
        Err(e) if e.kind() != io::ErrorKind::BrokenPipe => {
            return Err(e).context("writing to standard output")
        }
        _ => {}
    }
    if let Some(e) = &parsed.error {
        eprintln!("softwarp: {}: {e}", file.display());
        return Ok(ExitCode::from(2));
    }
    Ok(ExitCode::SUCCESS)
}

fn decode(file: &PathBuf, json: bool, summary: bool) -> anyhow::Result<ExitCode> {
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    if softwarp_ras::dump::looks_like_dump(&bytes) {
        return decode_dump(file, &bytes, json);
    }
    let stdout = io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    let mut write_error = None;
    let result = decode_capture(&bytes, &mut |output| {
        if write_error.is_none() {
            if let Err(e) = print_output(&mut out, &output, json) {
                write_error = Some(e);
            }
        }
    })
    .with_context(|| format!("{} is not a capture softwarp can read", file.display()))?;
    if let Some(e) = write_error {
        if e.kind() == io::ErrorKind::BrokenPipe {
            return Ok(ExitCode::SUCCESS);
        }
        return Err(e).context("writing to standard output");
    }
    if let Err(e) = out.flush() {
        if e.kind() != io::ErrorKind::BrokenPipe {
            return Err(e).context("writing to standard output");
        }
    }
    if summary {
        eprintln!(
            "{}: {} frames, {} TCP connections ({} iWARP), {} MPA frames, {} FPDUs, \
             {} bad CRCs, {} bad segments, {} errors",
            file.display(),
            result.frames,
            result.connections,
            result.iwarp_connections,
            result.mpa_frames,
            result.fpdus,
            result.bad_crcs,
            result.bad_segments,
            result.errors
        );
    }
    Ok(if result.is_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    })
}

/// Runs an operator command on standard output and error; a closed standard output (a pipe
/// into `head`) ends it quietly.
fn admin_run(
    f: impl FnOnce(&mut dyn Write, &mut dyn Write) -> anyhow::Result<u8>,
) -> anyhow::Result<ExitCode> {
    let mut out = io::stdout().lock();
    let mut err = io::stderr().lock();
    match f(&mut out, &mut err) {
        Ok(code) => Ok(ExitCode::from(code)),
        Err(e)
            if e.downcast_ref::<io::Error>()
                .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe) =>
        {
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => Err(e),
    }
}

/// The commands that open devices (`demo`, `bench`) are Softwarp applications that want to
/// be seen by the operator: they opt in to the RAS services as the environment configures
/// them (control socket, host registry entry, error log, metrics), and install Softwarp's
/// console + flight recorder subscriber unless `SOFTWARP_TRACE_CONSOLE=0`. The library does
/// neither by itself.
fn opt_in_ras() {
    let console_off = std::env::var("SOFTWARP_TRACE_CONSOLE")
        .is_ok_and(|v| matches!(v.trim(), "0" | "off" | "no" | "false"));
    if !console_off {
        // Fails only if a subscriber is installed already, which this program does not do.
        let _ = softwarp::install_ras_subscriber();
    }
    let _ = softwarp::enable_ras(&softwarp::RasConfig::from_env());
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Demo(_) | Command::Bench(_)) {
        opt_in_ras();
    }
    let result = match &cli.command {
        Command::Decode {
            file,
            json,
            summary,
        } => decode(file, *json, *summary),
        Command::Demo(args) => demo::run(args).map(|()| ExitCode::SUCCESS),
        Command::Bench(args) => softwarp_bench::run(args).map(|()| ExitCode::SUCCESS),
        Command::Resources(args) => admin_run(|o, e| admin::resources::run(args, o, e)),
        Command::Stat(args) => admin_run(|o, e| admin::stat::run(args, o, e)),
        Command::Trace(args) => admin_run(|o, e| admin::trace::run(args, o, e)),
        Command::Snapshots(args) => admin_run(|o, e| admin::snapshots::run(args, o, e)),
        Command::Dump(args) => admin_run(|o, e| admin::dump::run(args, o, e)),
        Command::Fault(cmd) => admin_run(|o, e| admin::fault::run(cmd, o, e)),
        Command::Doctor(args) => admin_run(|o, _| admin::doctor::run(args, o)),
        Command::Exec(args) => exec(args),
        Command::Install(args) => install(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("softwarp: {e:#}");
            ExitCode::from(1)
        }
    }
}
