//! The `softwarp` command.

use clap::{Parser, Subcommand};

mod demo;

/// Softwarp: a user-space software iWARP stack.
#[derive(Debug, Parser)]
#[command(name = "softwarp", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a server and a client on loopback and exercise every iWARP operation.
    Demo(demo::DemoArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Demo(args) => demo::run(&args),
    }
}
