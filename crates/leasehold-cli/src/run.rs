//! `leasehold run`: hold a lock while a command runs.

use std::ffi::OsString;
use std::future::Future;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::ExitStatus;
use std::time::Duration;

use leasehold::clock::{Clock, Instant, SystemClock};
use leasehold::{
    Capabilities, Claim, Client, Completion, Error, Guard, JobTicket, LockOptions, LossReason,
    MultiGuard, Outcome, Part, Window,
};
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
    /// Run as a scheduled job, at most once per window (`--once-per`, `--window-id`).
    pub job: Option<JobSpec>,
    /// `--at-least`: the lock stays held this long after the command started.
    /// Even if the command ended sooner (see [`Guard::keep_for`]).
    pub at_least: Option<Duration>,
    /// `--at-most`: the command is stopped once it has held the lock this long.
    /// SIGTERM `grace` before, SIGKILL at the limit; the lock is then let go.
    pub at_most: Option<Duration>,
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

/// A scheduled job's part of [`RunSpec`]: which window a run counts for, and its rules.
#[derive(Debug, Clone)]
pub struct JobSpec {
    /// The window this run counts for.
    pub window: Window,
    /// A window whose run failed stays open (`--retry-failed`).
    pub retry_failed: bool,
    /// Who runs it, `user@host`, for the completion record.
    pub by: String,
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
/// `client` must keep its deadlines on [`SystemClock`] (as
/// [`leasehold::connect`] does): the command's supervisor compares them with its own
/// reading of that clock.
///
/// `interrupted` completes with a signal number when leasehold itself is asked to stop
/// (SIGINT, SIGTERM, SIGHUP): while waiting, the attempt is abandoned and cleaned up; while
/// running, the signal is passed to the command's process group, and after the grace
/// period (or at the lease's deadline, if that comes first) the group is killed.
///
/// As a scheduled job (`spec.job`), the command runs only if its window is open, and a run
/// that ends by itself — or is stopped at `--at-most` — closes the window with a completion
/// record written fenced by the lock (a failed run closes it too, unless failures are
/// retried). With `--at-least`, a command that ended by itself leaves the lock held until
/// that long after it started.
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
    let checked = check_grace(client.capabilities(), &spec.options, spec.grace)
        .and_then(|()| check_schedule(client.capabilities(), spec));
    if let Err(error) = checked {
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
    let (guard, ticket) = match acquired {
        Ok(Acquired::Held(guard, ticket)) => (guard, ticket),
        Ok(Acquired::Busy) if spec.job.is_some() => {
            eprintln!(
                "leasehold: {} is running elsewhere (its lock is held)",
                spec.label()
            );
            return exit::NOT_ACQUIRED;
        }
        Ok(Acquired::Busy) => {
            eprintln!("leasehold: {} is held by someone else", spec.label());
            return exit::NOT_ACQUIRED;
        }
        Ok(Acquired::Done(done)) => {
            eprintln!(
                "leasehold: {} already ran in window {}: {}",
                spec.label(),
                done.window,
                describe(&done)
            );
            return exit::ALREADY_RAN;
        }
        Err(error) => {
            eprintln!("leasehold: {error}");
            return exit::for_error(&error);
        }
    };
    let ended = command_run(client, spec, &guard, interrupted).await;
    finish(spec, guard, ticket, ended).await
}

/// Runs the command while `guard` holds the locks, lets go of them, and returns the exit code.
/// They are released, or kept with `--at-least`.
/// `guard` was acquired from `client` as `spec` says (a single [`Guard`] converts into
/// one); the rest is as for [`run`], without a scheduled job's window.
///
/// # Cancel safety
///
/// As for [`run`].
pub async fn hold(
    client: &Client,
    spec: &RunSpec,
    guard: MultiGuard,
    interrupted: Pin<&mut (dyn Future<Output = i32> + Send)>,
) -> u8 {
    let ended = command_run(client, spec, &guard, interrupted).await;
    finish(spec, guard, None, ended).await
}

/// Checks the scheduling options of `spec` against each other and the backend.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a job that is not one exclusive lock, an `--at-most`
/// not longer than the grace, and [`Error::Unsupported`] for `--at-least` on a backend
/// that cannot keep a grant after its holder lets go.
pub fn check_schedule(capabilities: &Capabilities, spec: &RunSpec) -> leasehold::Result<()> {
    let single_exclusive =
        spec.names.len() == 1 && spec.hold == Hold::Exclusive && spec.campaign.is_none();
    if spec.job.is_some() && !single_exclusive {
        return Err(Error::invalid(
            "--once-per",
            "a scheduled job is one exclusive lock: give one name, without --shared or \
             --permits",
        ));
    }
    if let Some(at_most) = spec.at_most
        && at_most <= spec.grace
    {
        return Err(Error::invalid(
            "--at-most",
            format!(
                "{at_most:?} is not longer than --grace ({:?}): the command gets SIGTERM \
                 that long before the limit",
                spec.grace
            ),
        ));
    }
    if let (Some(at_least), Some(at_most)) = (spec.at_least, spec.at_most)
        && at_least > at_most
    {
        return Err(Error::invalid(
            "--at-least",
            format!("{at_least:?} is longer than --at-most ({at_most:?})"),
        ));
    }
    if spec.at_least.is_some() && !capabilities.can_keep() {
        return Err(Error::Unsupported {
            backend: capabilities.backend,
            feature: "--at-least (keeping a lock after its holder exits)",
        });
    }
    Ok(())
}

/// What acquiring found.
enum Acquired {
    /// Held: run the command (as a job's run, with its ticket).
    Held(MultiGuard, Option<JobTicket>),
    /// Held by someone else, and not waited for.
    Busy,
    /// The job's window is closed: it ran.
    Done(Completion),
}

/// How the command's run ended.
enum Ended {
    /// It was not started; leave with this code.
    NotStarted(u8),
    /// It ended by itself, or was stopped at `--at-most`, with this code.
    Exited {
        /// Its exit code.
        code: u8,
        /// When it was started.
        started: std::time::Instant,
    },
    /// It was stopped: the lock was lost or leasehold interrupted; leave with this code.
    Stopped(u8),
}

/// Runs the command while `guard` holds the locks, and says how that ended.
/// `client` and `interrupted` are as for [`run`]. With several locks, the deadline
/// is the earliest of theirs and the loss of any is the loss of all.
///
/// The command starts only if the lock is still held, with more than the grace left, right
/// before it starts. From then on its supervisor has the lease's deadline, and every later
/// one (or the `--at-most` limit, if that comes first): if the deadline comes within the
/// grace without a renewal, the command gets SIGTERM, then SIGKILL at the deadline, even
/// while this process is frozen; a loss the lease signals at the deadline or the server
/// reports kills it at once.
///
/// # Cancel safety
///
/// As for [`run`].
async fn command_run(
    client: &Client,
    spec: &RunSpec,
    guard: &MultiGuard,
    mut interrupted: Pin<&mut (dyn Future<Output = i32> + Send)>,
) -> Ended {
    let Some(program) = spec.command.first() else {
        eprintln!("leasehold: no command given");
        return Ended::NotStarted(exit::USAGE);
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
    let started_at = std::time::Instant::now();
    let limit = spec.at_most.map(|d| SystemClock.now().saturating_add(d));
    let started = match inherited {
        Ok(inherited) => Supervisor::start(spec, guard, &inherited, limit).await,
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
            return Ended::NotStarted(exit::LOST);
        }
        // The supervisor could not start the command; it said why.
        Err(Started::Exited(code)) => return Ended::NotStarted(code),
        Err(Started::Failed(error)) => {
            eprintln!(
                "leasehold: cannot run {}: {error}",
                program.to_string_lossy()
            );
            return Ended::NotStarted(exit::BACKEND);
        }
    };

    let mut lost = std::pin::pin!(guard.lost());
    // The lease's deadline as last seen, and the one the supervisor knows (capped at the
    // limit); every move is passed on.
    let mut seen = supervisor.deadline;
    let mut told = capped(seen, limit);
    let mut watching = true;
    // The supervisor is stopping the command: for want of a renewal, or at the limit.
    let mut stopping = None;
    loop {
        tokio::select! {
            biased;
            (name, reason) = &mut lost => {
                eprintln!("leasehold: lost the lock on {name} ({reason}); stopping the command");
                // Its grace was before the deadline: nothing is left of it now.
                supervisor.stop(Signal::KILL, Duration::ZERO).await;
                if reason == LossReason::Evicted {
                    tell_eviction(client, guard, &name).await;
                }
                return Ended::Stopped(exit::LOST);
            }
            signal = &mut interrupted => {
                let forwarded = Signal::from_named_raw(signal).unwrap_or(Signal::TERM);
                supervisor.stop(forwarded, spec.grace).await;
                return Ended::Stopped(exit::signal(signal));
            }
            event = supervisor.next() => match event {
                Event::Stopping => {
                    let at_limit = limit.is_some() && told == limit;
                    stopping = Some(at_limit);
                    if at_limit {
                        eprintln!(
                            "leasehold: {} has held the lock for --at-most ({:?}) less \
                             --grace; stopping the command (SIGTERM now, SIGKILL at the limit)",
                            spec.label(),
                            spec.at_most.unwrap_or_default()
                        );
                    } else {
                        eprintln!(
                            "leasehold: the lock on {} was not renewed by --grace ({:?}) \
                             before its deadline; stopping the command (SIGTERM now, SIGKILL \
                             at the deadline)",
                            spec.label(),
                            spec.grace
                        );
                    }
                }
                Event::Exited(code) => {
                    return match stopping {
                        Some(false) => Ended::Stopped(exit::LOST),
                        Some(true) | None => Ended::Exited { code, started: started_at },
                    };
                }
            },
            moved = guard.deadline_changed(seen), if watching && stopping.is_none() => match moved {
                Ok(deadline) => {
                    seen = deadline;
                    let deadline = capped(deadline, limit);
                    if deadline != told {
                        told = deadline;
                        supervisor.channel.send(Frame::Deadline(deadline));
                    }
                }
                // The loss is `lost`'s to report.
                Err(_) => watching = false,
            },
        }
    }
}

/// The earlier of a lease's `deadline` (`None`: it does not expire) and `limit`.
fn capped(deadline: Option<Instant>, limit: Option<Instant>) -> Option<Instant> {
    match (deadline, limit) {
        (Some(d), Some(l)) => Some(d.min(l)),
        (d, l) => d.or(l),
    }
}

/// Lets go of the locks after the run, and returns the exit code to leave with.
/// A job's run that ended by itself closes its window (fenced by the lock); with
/// `--at-least`, such a run keeps the locks until that long after the command started.
async fn finish(spec: &RunSpec, guard: MultiGuard, ticket: Option<JobTicket>, ended: Ended) -> u8 {
    let (code, started) = match ended {
        Ended::NotStarted(code) | Ended::Stopped(code) => {
            release(guard).await;
            return code;
        }
        Ended::Exited { code, started } => (code, started),
    };
    let at_least = spec.at_least.unwrap_or_default();
    let Some(ticket) = ticket else {
        keep(guard, at_least.saturating_sub(started.elapsed())).await;
        return code;
    };
    let window = ticket.window().id().to_owned();
    let Some(part) = guard.into_guards().pop() else {
        return code;
    };
    let name = part.name().clone();
    let outcome = match code {
        0 => Outcome::Succeeded,
        code => Outcome::Failed(Some(code.into())),
    };
    // The ticket counts `at_least` from the claim, right before the command started.
    match ticket.finish(part, outcome, at_least).await {
        Ok(_) if code == 0 => code,
        Ok(_) => {
            let retry = spec.job.as_ref().is_some_and(|j| j.retry_failed);
            let state = if retry { "stays open" } else { "is closed" };
            eprintln!("leasehold: {name} failed (exit code {code}); window {window} {state}");
            code
        }
        Err(Error::Lost(reason)) => {
            eprintln!(
                "leasehold: the lock on {name} was lost ({reason}) before window {window} could \
                 be marked done; the window stays open for the next holder"
            );
            exit::LOST
        }
        Err(error) => {
            eprintln!("leasehold: marking window {window} of {name} done: {error}");
            exit::BACKEND
        }
    }
}

/// Keeps each lock for `hold` more (see [`Guard::keep_for`]), or releases them.
async fn keep(guard: MultiGuard, hold: Duration) {
    if hold.is_zero() {
        return release(guard).await;
    }
    for guard in guard.into_guards().into_iter().rev() {
        let name = guard.name().clone();
        if let Err(error) = guard.keep_for(hold).await {
            eprintln!("leasehold: warning: keeping {name} for --at-least: {error}");
        }
    }
}

/// A completion, in words: who ran the job, when, and how it went.
fn describe(done: &Completion) -> String {
    let ms = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis()
    };
    let outcome = match done.outcome {
        Outcome::Succeeded => "succeeded".to_owned(),
        Outcome::Failed(Some(code)) => format!("failed with exit code {code}"),
        Outcome::Failed(None) => "failed".to_owned(),
    };
    format!(
        "run by {} (token {}), {outcome} after {} ms",
        if done.by.is_empty() { "?" } else { &done.by },
        done.token,
        ms(done.ended).saturating_sub(ms(done.started))
    )
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
    /// The lease's deadline when the command was started.
    /// Its supervisor got it capped at the `--at-most` limit.
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
        limit: Option<Instant>,
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
        if let Some(job) = &spec.job {
            command.env("LEASEHOLD_WINDOW", job.window.id());
        }
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
        channel.send(Frame::Start(capped(deadline, limit)));
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

async fn acquire(client: &Client, spec: &RunSpec) -> leasehold::Result<Acquired> {
    if let (Some(job), [name]) = (&spec.job, &spec.names[..]) {
        let window = &job.window;
        let job = (client.job(name)?)
            .with_options(options(client, spec)?)
            .retry_failed(job.retry_failed)
            .run_by(job.by.clone());
        let claim = match spec.wait {
            WaitFor::Forever => job.claim(window).await?,
            WaitFor::No => job.try_claim(window).await?,
            WaitFor::UpTo(d) => job.claim_timeout(window, d).await?,
        };
        return Ok(match claim {
            Claim::Run(run) => {
                let (guard, ticket) = run.into_parts();
                Acquired::Held(MultiGuard::from(guard), Some(ticket))
            }
            Claim::Done(done) => Acquired::Done(done),
            Claim::Busy => Acquired::Busy,
        });
    }
    let held = acquire_locks(client, spec).await?;
    Ok(held.map_or(Acquired::Busy, |guard| Acquired::Held(guard, None)))
}

/// Acquires the locks of `spec` (or campaigns in its election); `None` if not acquired.
async fn acquire_locks(client: &Client, spec: &RunSpec) -> leasehold::Result<Option<MultiGuard>> {
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
