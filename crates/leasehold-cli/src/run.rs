//! `leasehold run`: hold a lock while a command runs.

use std::ffi::OsString;
use std::future::Future;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::ExitStatus;
use std::time::Duration;

use leasehold::{Client, Error, Guard, LockOptions, LossReason};
use rustix::process::{Pid, Signal, kill_process_group};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
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
    /// The `leasehold` binary, started as the command's supervisor (see
    /// [`supervise`](crate::supervise)).
    pub supervisor: PathBuf,
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

    // On the file backend the command holds the lock itself, through a descriptor it
    // inherits: the lock is then freed exactly when the command's group is gone.
    let inherited = if client.capabilities().backend == "file" {
        leasehold::file::held_descriptor(guard.owner())
    } else {
        None
    };
    let started = match inherited.transpose() {
        Ok(inherited) => Supervisor::start(spec, &guard, inherited.as_ref()).await,
        Err(error) => Err(Started::Failed(error)),
    };
    let mut supervisor = match started {
        Ok(supervisor) => supervisor,
        // The supervisor could not start the command; it said why.
        Err(Started::Exited(code)) => {
            release(guard).await;
            return code;
        }
        Err(Started::Failed(error)) => {
            eprintln!(
                "leasehold: cannot run {}: {error}",
                program.to_string_lossy()
            );
            release(guard).await;
            return exit::BACKEND;
        }
    };

    let code = tokio::select! {
        biased;
        reason = guard.lost() => {
            eprintln!(
                "leasehold: lost the lock on {} ({reason}); stopping the command",
                spec.name
            );
            supervisor.stop(Signal::TERM, spec.grace).await;
            exit::LOST
        }
        signal = &mut interrupted => {
            let forwarded = Signal::from_named_raw(signal).unwrap_or(Signal::TERM);
            supervisor.stop(forwarded, spec.grace).await;
            exit::signal(signal)
        }
        code = supervisor.wait() => code,
    };
    release(guard).await;
    code
}

/// Why the supervisor is not running the command.
enum Started {
    /// It exited at once with this code (the command could not be started; it said why).
    Exited(u8),
    /// It could not be started.
    Failed(std::io::Error),
}

impl From<std::io::Error> for Started {
    fn from(error: std::io::Error) -> Self {
        Started::Failed(error)
    }
}

impl From<rustix::io::Errno> for Started {
    fn from(error: rustix::io::Errno) -> Self {
        Started::Failed(error.into())
    }
}

/// `leasehold run`'s side of the supervisor (see [`supervise`](crate::supervise)).
struct Supervisor {
    process: Child,
    channel: UnixStream,
    /// The command's process group.
    group: Pid,
}

impl Supervisor {
    /// Starts the supervisor, which starts the command (`Err(Exited)`: it could not).
    async fn start(
        spec: &RunSpec,
        guard: &Guard,
        inherited: Option<&OwnedFd>,
    ) -> Result<Self, Started> {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
        // Without close-on-exec, so that the supervisor (and the command) inherit them; no
        // other process is started meanwhile.
        let theirs = {
            let inheritable = rustix::io::dup(&theirs)?;
            // Ours closed, so that the supervisor's exit is seen as the end of the socket.
            drop(theirs);
            inheritable
        };
        let lock = inherited.map(rustix::io::dup).transpose()?;
        let orphan_grace = if lock.is_some() {
            spec.grace
        } else {
            Duration::ZERO
        };
        let mut command = Command::new(&spec.supervisor);
        command
            .arg("__supervise")
            .arg("--channel")
            .arg(theirs.as_raw_fd().to_string())
            .arg("--grace")
            .arg(millis(spec.grace))
            .arg("--orphan-grace")
            .arg(millis(orphan_grace))
            .arg("--")
            .args(&spec.command)
            .env("LEASEHOLD_LOCK", &spec.name)
            .env("LEASEHOLD_TOKEN", guard.token().to_string())
            .env("LEASEHOLD_OWNER", guard.owner().as_str());
        let mut process = command.spawn()?;
        drop((theirs, lock));
        ours.set_nonblocking(true)?;
        let mut channel = UnixStream::from_std(ours)?;
        let mut pid = [0u8; 4];
        if channel.read_exact(&mut pid).await.is_err() {
            let status = process.wait().await?;
            return Err(Started::Exited(code_of(status)));
        }
        let group = Pid::from_raw(i32::from_le_bytes(pid))
            .ok_or_else(|| std::io::Error::other("the supervisor sent no command pid"))?;
        Ok(Self {
            process,
            channel,
            group,
        })
    }

    /// Waits for the command's group to end; the command's exit code.
    async fn wait(&mut self) -> u8 {
        match self.process.wait().await {
            Ok(status) => {
                if status.signal().is_some() {
                    // The supervisor itself was killed: stop the group here.
                    eprintln!(
                        "leasehold: the command's supervisor was killed; killing the command"
                    );
                    let _ = kill_process_group(self.group, Signal::KILL);
                }
                code_of(status)
            }
            Err(error) => {
                eprintln!("leasehold: waiting for the command failed: {error}");
                let _ = kill_process_group(self.group, Signal::KILL);
                exit::BACKEND
            }
        }
    }

    /// Has the supervisor stop the command's group: `signal`, then SIGKILL after `grace`.
    async fn stop(&mut self, signal: Signal, grace: Duration) {
        let order = u8::try_from(signal.as_raw()).unwrap_or(Signal::TERM.as_raw() as u8);
        let _ = self.channel.write_all(&[order]).await;
        // The supervisor keeps the grace period; this is only in case it cannot.
        let margin = grace + Duration::from_secs(5);
        if tokio::time::timeout(margin, self.wait()).await.is_err() {
            eprintln!("leasehold: the command did not stop within {grace:?}; killing it");
            let _ = kill_process_group(self.group, Signal::KILL);
            let _ = self.process.kill().await;
        }
    }
}

fn millis(duration: Duration) -> String {
    format!("{}ms", duration.as_millis())
}

async fn acquire(client: &Client, spec: &RunSpec) -> leasehold::Result<Option<Guard>> {
    let name = spec.name.as_str();
    let options = if client.capabilities().has_sessions() {
        // The session's ttl is the lock's: `leasehold run` set it from --ttl when connecting
        // (see `session`).
        spec.options.to_builder().default_ttl().build()?
    } else {
        spec.options.clone()
    };
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

fn code_of(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(signal)) => exit::signal(signal),
        (None, None) => exit::BACKEND,
    }
}
