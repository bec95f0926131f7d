//! `leasehold run`: hold a lock while a command runs.

use std::ffi::OsString;
use std::future::Future;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::ExitStatus;
use std::time::Duration;

use leasehold::clock::Instant;
use leasehold::{Capabilities, Client, Error, Guard, LockOptions, LossReason, MultiGuard, Part};
use rustix::process::{Pid, Signal, kill_process_group};
use tokio::net::UnixStream;
use tokio::process::{Child, Command};

use crate::exit;
use crate::supervise::{Channel, Frame};

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
    /// The locks' names: one, or several.
    /// Several are taken all or none (see [`MultiLock`](leasehold::MultiLock)).
    pub names: Vec<String>,
    /// How to hold them.
    pub hold: Hold,
    /// The value to campaign with, for `leasehold elect`.
    /// `Some(value)`: campaign in the election of the one name with `value`, and run the
    /// command while leading; the term is the token.
    pub campaign: Option<Vec<u8>>,
    /// How long to wait for it.
    pub wait: WaitFor,
    /// Lease options (ttl).
    pub options: LockOptions,
    /// How long before the lease's deadline the command gets SIGTERM.
    /// SIGKILL follows at the deadline. When leasehold is interrupted, it is the time
    /// between SIGTERM and SIGKILL. Must fit in the lease (see [`check_grace`]).
    pub grace: Duration,
    /// The command and its arguments.
    pub command: Vec<OsString>,
    /// The `leasehold` binary, started as the command's supervisor.
    /// See [`supervise`](crate::supervise).
    pub supervisor: PathBuf,
}

impl RunSpec {
    /// The names, as the messages and the command's environment give them.
    pub fn label(&self) -> String {
        self.names.join(" ")
    }
}

/// The grace period when `--grace` is not given: 10 s, or a third of a shorter ttl.
pub fn default_grace(ttl: Duration) -> Duration {
    (ttl / 3).min(Duration::from_secs(10))
}

/// Checks that `grace` fits in the lease `options` ask for.
/// The command gets SIGTERM `grace` before the lease's deadline, so the lease must be
/// renewed before then, and its first renewal is due a third of the way in. A backend whose
/// `capabilities` say its grants do not expire (the file backend) has no deadline to fit
/// into.
///
/// # Errors
///
/// [`Error::InvalidArgument`] if `grace` is not shorter than the part of the lease left
/// when its first renewal is due (less the drift allowance) — so never as long as the ttl.
pub fn check_grace(
    capabilities: &Capabilities,
    options: &LockOptions,
    grace: Duration,
) -> leasehold::Result<()> {
    if !capabilities.expiring_leases {
        return Ok(());
    }
    let ttl = options.ttl();
    let every = options.renew_every();
    let room = options
        .validity(ttl)
        .unwrap_or_default()
        .saturating_sub(every);
    if grace < room {
        return Ok(());
    }
    Err(Error::invalid(
        "--grace",
        format!(
            "{grace:?} does not fit in a {ttl:?} lease: the command gets SIGTERM that long \
             before the lease's deadline, and the lease must be renewed before then (the \
             first renewal is due after {every:?}); give a --grace under {room:?}, or a \
             longer --ttl"
        ),
    ))
}

/// Acquires as `spec` says and runs the command while the lock is held.
/// Returns the exit code to leave with (see [`exit`]).
///
/// `client` must keep its deadlines on [`SystemClock`](leasehold::clock::SystemClock) (as
/// [`leasehold::connect`] does): the command's supervisor compares them with its own
/// reading of that clock.
///
/// `interrupted` completes with a signal number when leasehold itself is asked to stop
/// (SIGINT, SIGTERM, SIGHUP): while waiting, the attempt is abandoned and cleaned up; while
/// running, the signal is passed to the command's process group, and after the grace
/// period (or at the lease's deadline, if that comes first) the group is killed.
///
/// # Cancel safety
///
/// Dropping the future drops the guard, which releases the lock in the background, and
/// this end of the supervisor's socket, which has the supervisor stop the command's group
/// as if `leasehold run` had died (see [`supervise`](crate::supervise)).
pub async fn run(
    client: &Client,
    spec: &RunSpec,
    mut interrupted: Pin<&mut (dyn Future<Output = i32> + Send)>,
) -> u8 {
    if spec.command.is_empty() {
        eprintln!("leasehold: no command given");
        return exit::USAGE;
    }
    if let Err(error) = check_grace(client.capabilities(), &spec.options, spec.grace) {
        eprintln!("leasehold: {error}");
        return exit::USAGE;
    }
    let acquired = tokio::select! {
        acquired = acquire(client, spec) => acquired,
        signal = &mut interrupted => {
            // Dropping the attempt released whatever it had taken; wait for that.
            client.settle().await;
            eprintln!("leasehold: interrupted while waiting for {}", spec.label());
            return exit::signal(signal);
        }
    };
    let guard = match acquired {
        Ok(Some(guard)) => guard,
        Ok(None) => {
            eprintln!("leasehold: {} is held by someone else", spec.label());
            return exit::NOT_ACQUIRED;
        }
        Err(error) => {
            eprintln!("leasehold: {error}");
            return exit::for_error(&error);
        }
    };
    hold(client, spec, guard, interrupted).await
}

/// Runs the command while `guard` holds the locks, releases them, and returns the exit code.
/// `guard` was acquired from `client` as `spec` says (a single [`Guard`] converts into
/// one); the exit code is the one to leave with; `client` and `interrupted` are as for
/// [`run`]. With several locks, the deadline is the earliest of theirs and the loss of any
/// is the loss of all.
///
/// The command starts only if the lock is still held, with more than the grace left, right
/// before it starts. From then on its supervisor has the lease's deadline, and every later
/// one: if the deadline comes within the grace without a renewal, the command gets
/// SIGTERM, then SIGKILL at the deadline, even while this process is frozen; a loss the
/// lease signals at the deadline or the server reports kills it at once.
///
/// # Cancel safety
///
/// As for [`run`].
pub async fn hold(
    client: &Client,
    spec: &RunSpec,
    guard: MultiGuard,
    mut interrupted: Pin<&mut (dyn Future<Output = i32> + Send)>,
) -> u8 {
    let Some(program) = spec.command.first() else {
        eprintln!("leasehold: no command given");
        release(guard).await;
        return exit::USAGE;
    };
    // On the file backend the command holds the locks itself, through descriptors it
    // inherits: each is then freed exactly when the command's group is gone.
    let inherited: std::io::Result<Vec<OwnedFd>> = if client.capabilities().backend == "file" {
        (guard.guards().iter())
            .filter_map(|g| leasehold::file::held_descriptor(g.owner()))
            .collect()
    } else {
        Ok(Vec::new())
    };
    let started = match inherited {
        Ok(inherited) => Supervisor::start(spec, &guard, &inherited).await,
        Err(error) => Err(Started::Failed(error)),
    };
    let mut supervisor = match started {
        Ok(supervisor) => supervisor,
        Err(Started::Lost) => {
            eprintln!(
                "leasehold: the lock on {} was lost, or had less than --grace ({:?}) left, \
                 before the command could start; not starting it",
                spec.label(),
                spec.grace
            );
            release(guard).await;
            return exit::LOST;
        }
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

    let mut lost = std::pin::pin!(guard.lost());
    // The deadline the supervisor knows; every move is passed on.
    let mut told = supervisor.deadline;
    let mut watching = true;
    // The supervisor is stopping the command for want of a renewal.
    let mut stopping = false;
    let code = loop {
        tokio::select! {
            biased;
            (name, reason) = &mut lost => {
                eprintln!("leasehold: lost the lock on {name} ({reason}); stopping the command");
                // Its grace was before the deadline: nothing is left of it now.
                supervisor.stop(Signal::KILL, Duration::ZERO).await;
                if reason == LossReason::Evicted {
                    tell_eviction(client, &guard, &name).await;
                }
                break exit::LOST;
            }
            signal = &mut interrupted => {
                let forwarded = Signal::from_named_raw(signal).unwrap_or(Signal::TERM);
                supervisor.stop(forwarded, spec.grace).await;
                break exit::signal(signal);
            }
            event = supervisor.next() => match event {
                Event::Stopping => {
                    stopping = true;
                    eprintln!(
                        "leasehold: the lock on {} was not renewed by --grace ({:?}) before \
                         its deadline; stopping the command (SIGTERM now, SIGKILL at the \
                         deadline)",
                        spec.label(),
                        spec.grace
                    );
                }
                Event::Exited(code) => break if stopping { exit::LOST } else { code },
            },
            moved = guard.deadline_changed(told), if watching && !stopping => match moved {
                Ok(deadline) => {
                    told = deadline;
                    supervisor.channel.send(Frame::Deadline(deadline));
                }
                // The loss is `lost`'s to report.
                Err(_) => watching = false,
            },
        }
    };
    release(guard).await;
    code
}

/// Prints who evicted this process's grant of `name`, and why, if the record says.
async fn tell_eviction(client: &Client, guard: &MultiGuard, name: &leasehold::LockName) {
    let Some(part) = guard.guards().iter().find(|g| g.name() == name) else {
        return;
    };
    let Ok(state) = client.inspect(name.as_str()).await else {
        return;
    };
    if let Some(e) = state.evictions.iter().find(|e| e.owner == *part.owner()) {
        eprintln!("leasehold: {name} was evicted by {}: {}", e.by, e.reason);
    }
}

/// Why the supervisor is not running the command.
enum Started {
    /// The command was not started: at its start the lock was lost, or about to be.
    /// About to be: its deadline was less than the grace away.
    Lost,
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

/// What the supervisor reports.
enum Event {
    /// The deadline came within the grace without a renewal: the command is being stopped.
    Stopping,
    /// It exited, with the command's exit code.
    Exited(u8),
}

/// `leasehold run`'s side of the supervisor (see [`supervise`](crate::supervise)).
struct Supervisor {
    process: Child,
    channel: Channel,
    /// The command's process group.
    group: Pid,
    /// The lease's deadline the command was started with.
    deadline: Option<Instant>,
}

impl Supervisor {
    /// Starts the supervisor and has it start the command, if the lock is still held.
    /// It must be held with more than the grace left (`Err(Lost)` if not, `Err(Exited)` if
    /// the command could not be started).
    async fn start(
        spec: &RunSpec,
        guard: &MultiGuard,
        inherited: &[OwnedFd],
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
        let lock = (inherited.iter())
            .map(rustix::io::dup)
            .collect::<Result<Vec<_>, _>>()?;
        let orphan_grace = if !lock.is_empty() {
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
            .env("LEASEHOLD_LOCK", spec.label())
            .env(
                "LEASEHOLD_TOKEN",
                each_name(spec, guard, |g| g.token().to_string()),
            )
            .env(
                "LEASEHOLD_OWNER",
                each_name(spec, guard, |g| g.owner().to_string()),
            );
        let mut process = command.spawn()?;
        drop((theirs, lock));
        ours.set_nonblocking(true)?;
        let mut channel = Channel::new(UnixStream::from_std(ours)?);
        // Right before the start, the lock must still be held; the supervisor checks the
        // deadline on the same clock just before it starts the command.
        let Ok(deadline) = guard.deadline() else {
            // Closing the socket before the start ends the supervisor.
            drop(channel);
            process.wait().await?;
            return Err(Started::Lost);
        };
        channel.send(Frame::Start(deadline));
        loop {
            match channel.next().await {
                Some(Frame::Started(group)) => {
                    return Ok(Self {
                        process,
                        channel,
                        group,
                        deadline,
                    });
                }
                Some(_) => {}
                None => {
                    let code = code_of(process.wait().await?);
                    return Err(if code == exit::LOST {
                        Started::Lost
                    } else {
                        Started::Exited(code)
                    });
                }
            }
        }
    }

    /// What the supervisor reports next: frames first, then its exit.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe (see [`Channel::next`]; waiting for a process is too).
    async fn next(&mut self) -> Event {
        loop {
            tokio::select! {
                biased;
                frame = self.channel.next(), if self.channel.is_open() => {
                    if let Some(Frame::Stopping(_)) = frame {
                        return Event::Stopping;
                    }
                }
                status = self.process.wait() => return Event::Exited(self.exited(status)),
            }
        }
    }

    /// The command's exit code, from how the supervisor exited.
    fn exited(&self, status: std::io::Result<ExitStatus>) -> u8 {
        match status {
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
    /// SIGKILL comes at the lease's deadline instead, if that comes first.
    async fn stop(&mut self, signal: Signal, grace: Duration) {
        self.channel.send(Frame::Stop(signal.as_raw()));
        // The supervisor keeps the grace period; this is only in case it cannot.
        let margin = grace + Duration::from_secs(5);
        let exited = tokio::time::timeout(margin, async {
            while let Event::Stopping = self.next().await {}
        });
        if exited.await.is_err() {
            eprintln!("leasehold: the command did not stop within {grace:?}; killing it");
            let _ = kill_process_group(self.group, Signal::KILL);
            let _ = self.process.kill().await;
        }
    }
}

/// `what` of each lock's guard, space-separated in the order of the names given.
fn each_name(spec: &RunSpec, guard: &MultiGuard, what: impl Fn(&Guard) -> String) -> String {
    let of = |name: &String| (guard.guards().iter()).find(|g| g.name().as_str() == name.as_str());
    let values: Vec<String> = spec.names.iter().filter_map(of).map(what).collect();
    values.join(" ")
}

fn millis(duration: Duration) -> String {
    format!("{}ms", duration.as_millis())
}

async fn acquire(client: &Client, spec: &RunSpec) -> leasehold::Result<Option<MultiGuard>> {
    if let (Some(value), [name]) = (&spec.campaign, &spec.names[..]) {
        let election = client.election(name)?.with_options(options(client, spec)?);
        let leadership = match spec.wait {
            WaitFor::Forever => Some(election.campaign(value.clone()).await?),
            WaitFor::No => election.try_campaign(value.clone()).await?,
            WaitFor::UpTo(d) => election.campaign_timeout(value.clone(), d).await?,
        };
        return Ok(leadership.map(|l| MultiGuard::from(l.into_guard())));
    }
    if let [name] = &spec.names[..] {
        return Ok(acquire_one(client, spec, name).await?.map(MultiGuard::from));
    }
    let options = options(client, spec)?;
    let mut parts = Vec::with_capacity(spec.names.len());
    for name in &spec.names {
        parts.push(match spec.hold {
            Hold::Exclusive => Part::from(client.mutex(name)?.with_options(options.clone())),
            Hold::Shared => Part::read(&client.rwlock(name)?.with_options(options.clone())),
            Hold::Permits(_) => {
                return Err(Error::invalid(
                    "--permits",
                    "a semaphore is one name: give one lock name with --permits",
                ));
            }
        });
    }
    let set = client.multi(parts)?;
    match spec.wait {
        WaitFor::Forever => set.lock().await.map(Some),
        WaitFor::No => set.try_lock().await,
        WaitFor::UpTo(d) => set.lock_timeout(d).await,
    }
}

/// The options of the locks: on a session backend, the session's ttl is theirs.
fn options(client: &Client, spec: &RunSpec) -> leasehold::Result<LockOptions> {
    if client.capabilities().has_sessions() {
        // The session's ttl is the lock's: `leasehold run` set it from --ttl when connecting.
        spec.options.to_builder().default_ttl().build()
    } else {
        Ok(spec.options.clone())
    }
}

/// Acquires the one lock `name` as `spec` says (a read lock, a permit, …).
async fn acquire_one(
    client: &Client,
    spec: &RunSpec,
    name: &str,
) -> leasehold::Result<Option<Guard>> {
    let options = options(client, spec)?;
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

/// Releases the locks, last taken first, reporting what a user should know.
/// That is a loss noticed only now, or a server that had lost the grant.
async fn release(guard: MultiGuard) {
    for guard in guard.into_guards().into_iter().rev() {
        let name = guard.name().clone();
        match guard.release().await {
            Ok(()) => {}
            Err(Error::Lost(LossReason::Expired)) => {
                eprintln!(
                    "leasehold: warning: the lease on {name} had run out by the time it was \
                     released"
                );
            }
            Err(error) => eprintln!("leasehold: warning: releasing {name}: {error}"),
        }
    }
}

fn code_of(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(signal)) => exit::signal(signal),
        (None, None) => exit::BACKEND,
    }
}
