//! `leasehold chaos`: the fault-injection checker (crate `leasehold-chaos`), without its harness.
//!
//! Its workers and its fenced resource are this very program, started again as
//! `leasehold chaos worker …` and `leasehold chaos resource …`. It starts no servers: it
//! runs against those given with `--url` (and file locks in a directory of its own); the
//! checker's own program, `leasehold-chaos`, starts servers too.

pub use leasehold_chaos::cli::ChaosArgs;
use leasehold_chaos::runner::Launcher;

/// Runs `leasehold chaos`; returns the exit code.
///
/// Starts runtimes of its own: call it outside of any.
pub fn main(args: ChaosArgs) -> u8 {
    leasehold_chaos::cli::main(args, Launcher::this_program(&["chaos"]), None)
}
