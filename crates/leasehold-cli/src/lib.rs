//! The `leasehold` command, as a library so that its run loop can be tested against any backend.

// The command's own parts, shared with its tests and the benches: not an API for users.
#![allow(clippy::exhaustive_structs)]

pub mod bench;
pub mod chaos;
pub mod inspect;
pub mod run;
pub mod supervise;

/// Exit codes of `leasehold`. Stable; documented in `docs/cli.md`.
///
/// A command that ran exits with its own code (128 + signal if it was killed by one), so a
/// command's own 64, 69, 75, 79 or 80 cannot be told apart from leasehold's; when that matters,
/// read leasehold's message on stderr.
pub mod exit {
    use leasehold::Error;

    /// Bad usage: unknown flag, bad duration, bad name, bad URL, unsupported option.
    pub const USAGE: u8 = 64;
    /// The backend was unreachable or failed.
    pub const BACKEND: u8 = 69;
    /// Not acquired: busy with `--no-wait`, or `--wait` ran out.
    pub const NOT_ACQUIRED: u8 = 75;
    /// The lock was lost, or not renewed by `--grace` before its deadline.
    /// If that happened while the command ran, the command was stopped; before it could
    /// start, it was not started.
    pub const LOST: u8 = 80;
    /// A scheduled job's window is closed: the job already ran in it.
    /// (`--once-per`, `--window-id`.) The command was not started.
    pub const ALREADY_RAN: u8 = 79;
    /// The command exists but could not be started.
    pub const CANNOT_EXECUTE: u8 = 126;
    /// The command was not found.
    pub const NOT_FOUND: u8 = 127;

    /// 128 + the signal number: leasehold (or the command) was stopped by that signal.
    pub fn signal(signal: i32) -> u8 {
        (128 + signal.clamp(0, 127)) as u8
    }

    /// The exit code for an error before the command started.
    pub fn for_error(error: &Error) -> u8 {
        match error {
            Error::InvalidArgument { .. } | Error::Unsupported { .. } => USAGE,
            _ => BACKEND,
        }
    }
}
