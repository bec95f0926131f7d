//! `leasehold-chaos`: the checker as a program of its own (`leasehold chaos` runs the
//! same code).

use std::process::ExitCode;

use clap::Parser;
use leasehold_chaos::cli::ChaosArgs;
use leasehold_chaos::runner::Launcher;

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
    ))
}
