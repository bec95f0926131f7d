//! `leasehold run`: hold a lock while a command runs.

use std::ffi::OsString;
use std::future::Future;
use std::pin::Pin;
use std::process::ExitStatus;
use std::time::Duration;

use leasehold::{Client, Error, Guard, LockOptions, LossReason};
use rustix::process::{Pid, Signal, kill_process_group};
use tokio::process::{Child, Command};

use crate::exit;

/// How to hold the lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Alone (the default).
    Exclusive,
    /// With other `--shared` holders (a read lock).
    Shared,
    /// As one of N (a semaphore permit).
    Permits(u32),
}

/// How long to wait for a busy lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitFor {
    /// `--no-wait`.
    No,
    /// `--wait D`.
    UpTo(Duration),
    /// No flag: as long as it takes.
    Forever,
}

/// Everything `leasehold run` was asked to do.
#[derive(Debug, Clone)]
pub struct RunSpec {
    /// The lock's name.
    pub name: String,
    /// How to hold it.
    pub hold: Hold,
    /// How long to wait for it.
    pub wait: WaitFor,
    /// Lease options (ttl).
    pub options: LockOptions,
    /// Between SIGTERM and SIGKILL when the command must stop.
    pub grace: Duration,
    /// The command and its arguments.
    pub command: Vec<OsString>,
}

/// Acquires as `spec` says, runs the command while the lock is held, and returns the exit
/// code to leave with (see [`exit`]).
///
/// `interrupted` completes with a signal number when leasehold itself is asked to stop
/// (SIGINT, SIGTERM, SIGHUP): while waiting, the attempt is abandoned and cleaned up; while
/// running, the signal is passed to the command's process group, and after the grace
/// period the group is killed.
pub async fn run(
    client: &Client,
    spec: &RunSpec,
    mut interrupted: Pin<&mut (dyn Future<Output = i32> + Send)>,
) -> u8 {
    let Some(program) = spec.command.first() else {
        eprintln!("leasehold: no command given");
        return exit::USAGE;
    };
    let acquired = tokio::select! {
        acquired = acquire(client, spec) => acquired,
        signal = &mut interrupted => {
            // Dropping the attempt released whatever it had taken; wait for that.
            client.settle().await;
            eprintln!("leasehold: interrupted while waiting for {}", spec.name);
            return exit::signal(signal);
        }
    };
    let guard = match acquired {
        Ok(Some(guard)) => guard,
        Ok(None) => {
            eprintln!("leasehold: {} is held by someone else", spec.name);
            return exit::NOT_ACQUIRED;
        }
        Err(error) => {
            eprintln!("leasehold: {error}");
            return exit::for_error(&error);
        }
    };

    let mut command = Command::new(program);
    command
        .args(&spec.command[1..])
        .env("LEASEHOLD_LOCK", &spec.name)
        .env("LEASEHOLD_TOKEN", guard.token().to_string())
        .env("LEASEHOLD_OWNER", guard.owner().as_str())
        .process_group(0);
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(error) => {
            eprintln!(
                "leasehold: cannot run {}: {error}",
                program.to_string_lossy()
            );
            release(guard).await;
            return if error.kind() == std::io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::CANNOT_EXECUTE
            };
        }
    };
    let Some(group) = child.id().and_then(|id| Pid::from_raw(id as i32)) else {
        eprintln!("leasehold: the command exited before it could be watched");
        release(guard).await;
        return exit::CANNOT_EXECUTE;
    };

    tokio::select! {
        biased;
        reason = guard.lost() => {
            eprintln!(
                "leasehold: lost the lock on {} ({reason}); stopping the command",
                spec.name
            );
            stop(group, &mut child, Signal::TERM, spec.grace).await;
            release(guard).await;
            exit::LOST
        }
        signal = &mut interrupted => {
            let forwarded = Signal::from_named_raw(signal).unwrap_or(Signal::TERM);
            stop(group, &mut child, forwarded, spec.grace).await;
            release(guard).await;
            exit::signal(signal)
        }
        status = child.wait() => {
            let code = match status {
                Ok(status) => code_of(status),
                Err(error) => {
                    eprintln!("leasehold: waiting for the command failed: {error}");
                    exit::BACKEND
                }
            };
            release(guard).await;
            code
        }
    }
}

async fn acquire(client: &Client, spec: &RunSpec) -> leasehold::Result<Option<Guard>> {
    let name = spec.name.as_str();
    let options = spec.options.clone();
    match (spec.hold, spec.wait) {
        (Hold::Exclusive, WaitFor::Forever) => client
            .mutex(name)?
            .with_options(options)
            .lock()
            .await
            .map(Some),
        (Hold::Exclusive, WaitFor::No) => {
            client.mutex(name)?.with_options(options).try_lock().await
        }
        (Hold::Exclusive, WaitFor::UpTo(d)) => {
            client
                .mutex(name)?
                .with_options(options)
                .lock_timeout(d)
                .await
        }
        (Hold::Shared, WaitFor::Forever) => client
            .rwlock(name)?
            .with_options(options)
            .read()
            .await
            .map(Some),
        (Hold::Shared, WaitFor::No) => client.rwlock(name)?.with_options(options).try_read().await,
        (Hold::Shared, WaitFor::UpTo(d)) => {
            client
                .rwlock(name)?
                .with_options(options)
                .read_timeout(d)
                .await
        }
        (Hold::Permits(n), wait) => {
            let semaphore = client.semaphore(name, n)?.with_options(options);
            match wait {
                WaitFor::Forever => semaphore.acquire().await.map(Some),
                WaitFor::No => semaphore.try_acquire().await,
                WaitFor::UpTo(d) => semaphore.acquire_timeout(d).await,
            }
        }
    }
}

/// Releases, reporting what a user should know: a loss noticed only now, or a server that
/// had lost the grant.
async fn release(guard: Guard) {
    let name = guard.name().clone();
    match guard.release().await {
        Ok(()) => {}
        Err(Error::Lost(LossReason::Expired)) => {
            eprintln!(
                "leasehold: warning: the lease on {name} had run out by the time it was released"
            );
        }
        Err(error) => eprintln!("leasehold: warning: releasing {name}: {error}"),
    }
}

/// Sends `signal` to the whole process group, waits up to `grace` for the command to exit,
/// then kills whatever is left of the group.
async fn stop(group: Pid, child: &mut Child, signal: Signal, grace: Duration) {
    let _ = kill_process_group(group, signal);
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        eprintln!("leasehold: the command did not stop within {grace:?}; killing it");
    }
    // Also reaches members of the group that outlived the command itself.
    let _ = kill_process_group(group, Signal::KILL);
    let _ = child.wait().await;
}

fn code_of(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(signal)) => exit::signal(signal),
        (None, None) => exit::BACKEND,
    }
}
