//! The supervisor: a small process between `leasehold run` and the command, so that the
//! command never outlives the lock, even when `leasehold run` itself is killed.
//!
//! `leasehold run` holds the lock and starts the supervisor (its own binary, hidden
//! subcommand `__supervise`), handing it one end of a socket pair. The supervisor starts the
//! command in a process group of its own, reports the command's pid over the socket, and
//! then watches three things:
//!
//! - the command and the rest of its process group: when the command exits, members of the
//!   group it left behind are stopped too (SIGTERM, `--grace`, SIGKILL), and the supervisor
//!   exits with the command's code once the group is empty;
//! - a byte from `leasehold run` (a signal number): stop the group with that signal, then
//!   SIGKILL after `--grace`;
//! - the end of the socket: `leasehold run` is gone, however it died (the kernel closes its
//!   end), so nobody holds or renews the lock for the command any more. The group is stopped
//!   at once with SIGKILL — or, when the command holds the lock itself through an inherited
//!   descriptor (the file backend), with SIGTERM and `--orphan-grace` first, since the lock
//!   then lasts exactly as long as the group.
//!
//! The end of a socket is used rather than `PR_SET_PDEATHSIG`: it fires however and
//! whenever the parent dies (also before the supervisor got to set anything up), does not
//! depend on which of the parent's threads started it, and carries the parent's orders
//! too. The supervisor is a child subreaper on Linux, so the group's processes whose parents
//! die are reaped here, and the group's end is seen without polling.
//!
//! The supervisor ignores SIGINT, SIGTERM and SIGHUP (they reach it from the terminal with
//! `leasehold run`, which passes them on through the socket); the command starts with the
//! default dispositions.

use std::ffi::OsString;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::time::Duration;

use rustix::process::{Pid, Signal, WaitOptions, kill_process_group, test_kill_process_group};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::signal::unix::{SignalKind, signal};
use tokio::time::Instant;

use crate::exit;

/// What the supervisor was started with.
#[derive(Debug, Clone)]
pub struct Supervision {
    /// The supervisor's end of the socket pair (a descriptor number it inherited).
    pub channel: RawFd,
    /// Between SIGTERM and SIGKILL when ordered to stop, or when the command left members
    /// of its group behind.
    pub grace: Duration,
    /// Between SIGTERM and SIGKILL when `leasehold run` is gone; zero: SIGKILL at once.
    pub orphan_grace: Duration,
    /// The command and its arguments.
    pub command: Vec<OsString>,
}

/// Runs the supervisor; returns the exit code to leave with (the command's own, 128 + N if
/// it was killed by signal N, 126/127 if it could not be started).
pub async fn supervise(spec: Supervision) -> u8 {
    // Taken first, so that an early return still closes it.
    let channel = match take_channel(spec.channel) {
        Ok(channel) => channel,
        Err(error) => {
            eprintln!("leasehold: supervisor: {error}");
            return exit::BACKEND;
        }
    };
    let mut channel = channel;
    // Registered before anything else: from now on these only raise a flag here.
    let (Ok(_int), Ok(_term), Ok(_hup), Ok(mut children)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
        signal(SignalKind::child()),
    ) else {
        eprintln!("leasehold: supervisor: cannot handle signals");
        return exit::BACKEND;
    };
    #[cfg(target_os = "linux")]
    let _ = rustix::process::set_child_subreaper(Some(rustix::process::getpid()));

    let Some(program) = spec.command.first() else {
        return exit::USAGE;
    };
    // std, not tokio: the supervisor reaps every child itself (see `reap`).
    let spawned = std::process::Command::new(program)
        .args(&spec.command[1..])
        .process_group(0)
        .spawn();
    let child = match spawned {
        Ok(child) => child,
        Err(error) => {
            eprintln!(
                "leasehold: cannot run {}: {error}",
                program.to_string_lossy()
            );
            return if error.kind() == std::io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::CANNOT_EXECUTE
            };
        }
    };
    let Some(group) = Pid::from_raw(child.id() as i32) else {
        return exit::BACKEND;
    };
    drop(child);
    // If `leasehold run` is already gone the write fails; the read below sees it.
    let _ = channel
        .write_all(&(group.as_raw_nonzero().get()).to_le_bytes())
        .await;

    let mut status: Option<u8> = None;
    // Set once the group is being stopped: SIGKILL at this instant.
    let mut kill_at: Option<Instant> = None;
    let mut killed = false;
    let mut orders = [0u8; 1];
    let mut listening = true;
    loop {
        reap(group, &mut status);
        let alive = test_kill_process_group(group).is_ok();
        if status.is_some() && !alive {
            break;
        }
        if status.is_some() && kill_at.is_none() {
            // The command is done; what it left behind in its group is stopped too.
            kill_at = Some(stop(group, Signal::TERM, spec.grace));
        }
        // While the group is being stopped: SIGKILL when its time comes, and look again now
        // and then (a member whose parent left the group dies unseen here).
        let wake = kill_at.map(|at| {
            let soon = Instant::now() + Duration::from_millis(100);
            if killed { soon } else { at.min(soon) }
        });
        tokio::select! {
            _ = children.recv() => {}
            read = channel.read(&mut orders), if listening => {
                listening = false;
                let (signal, grace) = match read {
                    Ok(1) => (
                        Signal::from_named_raw(i32::from(orders[0])).unwrap_or(Signal::TERM),
                        spec.grace,
                    ),
                    // `leasehold run` is gone: nobody holds or renews the lock for us.
                    _ if spec.orphan_grace.is_zero() => (Signal::KILL, Duration::ZERO),
                    _ => (Signal::TERM, spec.orphan_grace),
                };
                kill_at = Some(stop(group, signal, grace));
            }
            _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => {}
        }
        if !killed && kill_at.is_some_and(|at| at <= Instant::now()) {
            let _ = kill_process_group(group, Signal::KILL);
            killed = true;
        }
    }
    status.unwrap_or(exit::BACKEND)
}

/// Takes ownership of the inherited socket and keeps it from the command.
fn take_channel(fd: RawFd) -> std::io::Result<UnixStream> {
    if fd < 3 {
        return Err(std::io::Error::other(format!(
            "{fd} is not a channel descriptor"
        )));
    }
    // SAFETY: `leasehold run` started this process with `fd` open, for this process to own,
    // and nothing else here uses that number.
    #[allow(unsafe_code)]
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC)?;
    let stream = std::os::unix::net::UnixStream::from(fd);
    stream.set_nonblocking(true)?;
    UnixStream::from_std(stream)
}

/// Reaps every child that has exited (the command, and as a subreaper the orphans of its
/// group), noting the command's exit code.
fn reap(command: Pid, status: &mut Option<u8>) {
    while let Ok(Some((pid, exited))) = rustix::process::wait(WaitOptions::NOHANG) {
        if pid == command {
            *status = Some(match (exited.exit_status(), exited.terminating_signal()) {
                (Some(code), _) => code as u8,
                (None, Some(signal)) => exit::signal(signal),
                (None, None) => exit::BACKEND,
            });
        }
    }
}

/// Sends `signal` to the group; returns when to follow with SIGKILL.
fn stop(group: Pid, signal: Signal, grace: Duration) -> Instant {
    let _ = kill_process_group(group, signal);
    Instant::now() + grace
}
