//! `softwarp-bench`: the benchmark of `softwarp bench` as a program of its own, with the
//! counting global allocator installed. It takes the same arguments; it is the only program
//! that runs `qp_mem` (heap bytes per QP), so that no other command (`softwarp decode`,
//! `doctor`, ...) runs on a wrapped allocator.

use std::process::ExitCode;

use clap::Parser;

/// Counts heap bytes for `qp_mem` (switched off, and nearly free, otherwise).
#[global_allocator]
static ALLOC: softwarp_bench::CountingAlloc = softwarp_bench::CountingAlloc;

/// Benchmark Softwarp with perftest's shapes and flags, each next to a raw TCP baseline.
#[derive(Debug, Parser)]
#[command(name = "softwarp-bench", version)]
struct Cli {
    #[command(flatten)]
    args: softwarp_bench::BenchArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match softwarp_bench::run(&cli.args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("softwarp-bench: {e:#}");
            ExitCode::from(1)
        }
    }
}
