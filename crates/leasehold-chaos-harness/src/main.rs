//! `leasehold-chaos`: the checker with its harness, which starts servers of its own.
//!
//! `leasehold chaos` runs the same checker against servers given with `--url`.

use std::process::ExitCode;

use clap::Parser;
use leasehold_chaos::cli::ChaosArgs;
use leasehold_chaos::runner::Launcher;
use leasehold_chaos_harness::HARNESS;

/// The fault-injection checker of leasehold.
#[derive(Debug, Parser)]
#[command(name = "leasehold-chaos", version)]
struct Cli {
    #[command(flatten)]
    args: ChaosArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    ExitCode::from(leasehold_chaos::cli::main(
        cli.args,
        Launcher::this_program(&[]),
        Some(&HARNESS),
    ))
}
