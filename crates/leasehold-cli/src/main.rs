//! `leasehold`: run a command under a distributed lock, or inspect locks.

use std::ffi::OsString;
use std::io::IsTerminal as _;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::{Args, Parser, Subcommand};
use leasehold::{
    Client, ConnectOptions, DEFAULT_TTL, Error, LockOptions, OwnerId, Window, parse_duration,
};
use leasehold_cli::run::{Hold, JobSpec, RunSpec, WaitFor};
use leasehold_cli::{exit, inspect};
use rustix::process::Signal;
use tokio::signal::unix::{SignalKind, signal};

/// Distributed locks that stay correct when networks, processes and clocks misbehave.
///
/// Without --url (or LEASEHOLD_URL) locks are local to this host: OS file locks in a
/// per-user directory.
#[derive(Debug, Parser)]
#[command(name = "leasehold", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Hold a lock while a command runs; stop the command if the lock is lost.
    ///
    /// Exit codes: the command's own; 64 usage error; 69 backend unreachable or failed;
    /// 75 not acquired (busy with --no-wait, or --wait ran out); 80 lock lost while the
    /// command ran (it was stopped) or before it started (it was not); 126/127 command not
    /// executable / not found;
    /// 128+N stopped by signal N.
    ///
    /// Several names are taken all or none. The command sees LEASEHOLD_LOCK,
    /// LEASEHOLD_TOKEN (the fencing token, decimal) and LEASEHOLD_OWNER in its environment
    /// (several names: each a space-separated list, in the order the names were given), and
    /// runs in its own process group.
    Run(RunArgs),
    /// Run a command while this process leads an election; or watch who leads.
    ///
    /// `leasehold elect NAME VALUE -- COMMAND` campaigns with VALUE (an address, an id) and
    /// runs the command while leading, exactly as `run` holds a lock (same options, exit
    /// codes and stopping on loss); LEASEHOLD_TOKEN is the term, a fencing token greater
    /// than every earlier term. `leasehold elect --observe NAME` prints the leader (VALUE,
    /// term, owner) and then each new one as it changes, pushed by the backend, until
    /// interrupted; `no leader` while nobody leads.
    Elect(ElectArgs),
    /// Show holders, modes, tokens, remaining TTLs and waiters of locks.
    Inspect(InspectArgs),
    /// Force-release a lock: evict its holder, recording who did it and why.
    ///
    /// Only the grant seen is evicted (checked by owner and token), never a newer one. The
    /// lock stays closed until the evicted lease would have ended, so the evicted holder
    /// learns of it first (its next renewal answers "evicted"); every later grant's token
    /// is greater. The record (when, who — user@host —, why, owner and token) is kept on
    /// the backend and shown by `inspect` and `locks`. Exit codes: 0 evicted; 75 nobody
    /// held it (or not that owner); 64 usage, or a backend that cannot evict; 69 backend
    /// failure.
    Release(ReleaseArgs),
    /// List every lock a backend holds or queues, without knowing the names.
    /// Holders, tokens, time held, TTL left and waiters. The backend is read a page at a
    /// time (SCAN, ranged reads, paged queries), so a large listing never blocks the server.
    Locks(LocksArgs),
    /// Measure throughput and latency of the backend.
    /// Uncontended and contended acquire+release cycles, acquire latency, and hand-off from
    /// a release to the next holder.
    Bench(BenchArgs),
    /// Check the lock events of many hosts for what must never happen.
    /// Double grants, broken promises, tokens out of order, stale accesses, unknown outcomes
    /// left unresolved.
    /// Each FILE is one host's `--events` record. Exit codes: 0 nothing found; 1 findings
    /// (printed); 64 a file that cannot be read.
    Audit(AuditArgs),
    /// Run fault scenarios against a backend and check what every process saw.
    Chaos(leasehold_cli::chaos::ChaosArgs),
    /// Internal: the supervisor `run` starts between itself and the command.
    #[command(name = "__supervise", hide = true)]
    Supervise(SuperviseArgs),
}

#[derive(Debug, Args)]
struct SuperviseArgs {
    #[arg(long)]
    channel: i32,
    #[arg(long, value_parser = duration)]
    grace: Duration,
    #[arg(long, value_parser = duration)]
    orphan_grace: Duration,
    #[arg(last = true, required = true)]
    command: Vec<OsString>,
}

#[derive(Debug, Args)]
struct BenchArgs {
    #[command(flatten)]
    connection: Connection,
    /// How long each throughput run lasts (default 3s).
    /// With `--hold`, how long the locks are held while measuring (default: one ttl, three
    /// renewal periods).
    #[arg(long, value_parser = duration)]
    duration: Option<Duration>,
    /// Instead of throughput: hold this many locks at once with one client.
    /// It prints the CPU and memory the process spends per held lock (renewals included).
    #[arg(long, value_name = "N")]
    hold: Option<usize>,
    /// The lease length of the held locks (`--hold`).
    #[arg(long, default_value = "30s", value_parser = duration, requires = "hold")]
    ttl: Duration,
    /// With `--hold` and a server on this machine: its process id, to report its CPU too.
    #[arg(long, value_name = "PID", requires = "hold")]
    server_pid: Vec<u32>,
    /// Clients (each with its own connection) of the concurrent runs.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Hand-off rounds.
    #[arg(long, default_value_t = 200)]
    handoffs: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct Connection {
    /// Where the locks live: file:///dir, redis://host:port and so on (default: local file locks).
    #[arg(long, env = "LEASEHOLD_URL", hide_env_values = true)]
    url: Option<String>,
}

#[derive(Debug, Args)]
struct RunArgs {
    #[command(flatten)]
    connection: Connection,
    /// Lease length (default 30s); renewed every third of it while the command runs.
    /// Where locks live by a session (etcd, ZooKeeper, PostgreSQL with mode=advisory) it is
    /// the session's ttl (the URL's session_ttl or session_timeout, which must agree if
    /// given).
    #[arg(long, value_parser = duration)]
    ttl: Option<Duration>,
    /// Wait at most this long for the lock (default: as long as it takes).
    #[arg(long, value_parser = duration, conflicts_with = "no_wait")]
    wait: Option<Duration>,
    /// Append a record of every grant, renewal, loss and release to this file.
    /// One JSON object per line (lock events; see docs/cli.md).
    #[arg(long, value_name = "FILE")]
    events: Option<std::path::PathBuf>,
    /// Do not wait: exit 75 at once if the lock is held.
    #[arg(long)]
    no_wait: bool,
    /// Hold a shared (read) lock: other --shared holders may run at the same time.
    #[arg(long, conflicts_with = "permits")]
    shared: bool,
    /// Hold one of N permits of a semaphore: up to N commands run at once.
    #[arg(long, value_name = "N")]
    permits: Option<u32>,
    /// How long before the unrenewed lease runs out the command gets SIGTERM.
    /// SIGKILL follows when it runs out; it is also how long the command has after SIGTERM
    /// when leasehold is interrupted. Must be shorter than the lease left after its first
    /// renewal is due [default: 10s, or a third of a --ttl under 30s]
    #[arg(long, value_parser = duration)]
    grace: Option<Duration>,
    /// Run as a scheduled job, at most once per window of PERIOD across every host.
    /// Windows are aligned on the Unix epoch, UTC (1h: every hour on the hour). A run that
    /// ends closes its window with a record on the backend, written only while the lock
    /// is held; exits 79 without running if the job already ran in this window.
    #[arg(long, value_parser = duration, value_name = "PERIOD")]
    once_per: Option<Duration>,
    /// Run as a scheduled job at most once per window named ID (a cron fire's timestamp).
    /// The window's record is kept for a week, or two --once-per periods if given.
    #[arg(long, value_name = "ID")]
    window_id: Option<String>,
    /// How far apart hosts' clocks may be, for --once-per.
    /// A clock reading up to this much before a window's start counts for that window
    /// [default: a tenth of the period, at most 1m]
    #[arg(long, value_parser = duration, requires = "once_per", conflicts_with = "window_id")]
    skew: Option<Duration>,
    /// A scheduled job's window whose run failed stays open, for the next run to retry.
    #[arg(long)]
    retry_failed: bool,
    /// Keep the lock at least this long after the command started.
    /// Even if the command ends sooner, the lock stays held on the backend, unrenewed,
    /// after leasehold exits (not on the file backend, ZooKeeper, or PostgreSQL's
    /// advisory mode).
    #[arg(long, value_parser = duration)]
    at_least: Option<Duration>,
    /// Hold the lock at most this long.
    /// The command gets SIGTERM --grace before, SIGKILL at it, and the lock is let go.
    #[arg(long, value_parser = duration)]
    at_most: Option<Duration>,
    /// The lock's name (ASCII letters, digits, and _ - . : @ + =).
    /// Several names are taken all or none, in one canonical order.
    #[arg(required = true, num_args = 1.., value_name = "NAME")]
    names: Vec<String>,
    /// The command to run, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

#[derive(Debug, Args)]
struct ElectArgs {
    #[command(flatten)]
    connection: Connection,
    /// Print each leader as it changes instead of campaigning (the current one first).
    #[arg(long, conflicts_with_all = ["ttl", "wait", "no_wait", "grace", "value", "command"])]
    observe: bool,
    /// With --observe: one JSON object per line.
    #[arg(long, requires = "observe")]
    json: bool,
    /// Lease length, as for `run`.
    #[arg(long, value_parser = duration)]
    ttl: Option<Duration>,
    /// Wait at most this long to be elected (default: as long as it takes).
    #[arg(long, value_parser = duration, conflicts_with = "no_wait")]
    wait: Option<Duration>,
    /// Append a record of every grant, renewal, loss and release (each term) to this file.
    /// One JSON object per line, as `run --events` does.
    #[arg(long, value_name = "FILE", conflicts_with = "observe")]
    events: Option<std::path::PathBuf>,
    /// Do not wait: exit 75 at once if someone else leads.
    #[arg(long)]
    no_wait: bool,
    /// As for `run`.
    #[arg(long, value_parser = duration)]
    grace: Option<Duration>,
    /// The election's name (a lock name).
    #[arg(value_name = "NAME")]
    name: String,
    /// The value to lead with, shown to observers.
    #[arg(required_unless_present = "observe", value_name = "VALUE")]
    value: Option<String>,
    /// The command to run while leading, after `--`.
    #[arg(
        last = true,
        required_unless_present = "observe",
        value_name = "COMMAND"
    )]
    command: Vec<OsString>,
}

#[derive(Debug, Args)]
struct ReleaseArgs {
    #[command(flatten)]
    connection: Connection,
    /// Evict the holder (the only kind of release from outside: a holder releases its own).
    #[arg(long, required = true)]
    force: bool,
    /// Why, for the record (shown by inspect and locks).
    #[arg(long, required = true)]
    reason: String,
    /// Evict only this owner's grant (as inspect shows it); default: every holder.
    #[arg(long)]
    owner: Option<String>,
    /// Print JSON instead of text (also for errors).
    #[arg(long)]
    json: bool,
    /// The lock's name.
    name: String,
}

#[derive(Debug, Args)]
struct AuditArgs {
    /// How far apart the hosts' clocks may be (NTP's estimate): nothing shorter is reported.
    #[arg(long, default_value = "50ms", value_parser = duration)]
    clock_uncertainty: Duration,
    /// Print JSON instead of text (with --follow: one object per finding and line).
    #[arg(long)]
    json: bool,
    /// Keep reading the files as they grow, reporting each finding as it is made.
    /// It goes on until interrupted (SIGINT, SIGTERM, SIGHUP); a FILE may be a directory.
    #[arg(long)]
    follow: bool,
    /// With --follow: keep the auditor's state and each file's position here.
    /// A restart resumes from it.
    #[arg(long, requires = "follow")]
    state: Option<std::path::PathBuf>,
    /// A host from which nothing arrived for this long no longer holds the audit back.
    #[arg(long, default_value = "60s", value_parser = duration)]
    host_idle: Duration,
    /// Write a self-contained HTML page drawing the minutes around each finding.
    /// With --follow it is rewritten as each is drawn.
    #[arg(long)]
    html: Option<std::path::PathBuf>,
    /// With --html: how much before and after each finding to draw.
    #[arg(long, default_value = "60s", value_parser = duration)]
    html_window: Duration,
    /// With --follow: also take events that hosts stream to this address over TCP.
    /// One host per connection, one JSON line per event; a first line `{"host":"NAME"}`
    /// names it.
    #[arg(long, requires = "follow")]
    listen: Option<std::net::SocketAddr>,
    /// Serve the audit's counters for Prometheus at this address (`/metrics`).
    #[arg(long, requires = "follow")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// The event files, one per host (the host is the file's name).
    #[arg(required_unless_present = "listen")]
    files: Vec<std::path::PathBuf>,
}

#[derive(Debug, Args)]
struct InspectArgs {
    #[command(flatten)]
    connection: Connection,
    /// Print JSON instead of a table (also for errors).
    #[arg(long)]
    json: bool,
    /// Keep watching: print each change as the backend pushes it, until interrupted.
    /// With --json, one object per change and line.
    #[arg(long)]
    watch: bool,
    /// Lock names.
    #[arg(required = true)]
    names: Vec<String>,
}

#[derive(Debug, Args)]
struct LocksArgs {
    #[command(flatten)]
    connection: Connection,
    /// Only names that begin with this.
    #[arg(long, default_value = "")]
    prefix: String,
    /// Only locks with a holder that has held at least this long.
    /// Locks whose grant time the backend does not record are left out, and counted on
    /// stderr.
    #[arg(long, value_parser = duration, conflicts_with = "watch")]
    older_than: Option<Duration>,
    /// Print JSON instead of a table (also for errors).
    #[arg(long)]
    json: bool,
    /// Keep watching: print each change as the backend pushes it, until interrupted.
    /// With --json, one object per change and line.
    #[arg(long)]
    watch: bool,
}

fn duration(text: &str) -> Result<Duration, String> {
    parse_duration(text).map_err(|e| match e {
        Error::InvalidArgument { reason, .. } => reason,
        other => other.to_string(),
    })
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            let _ = error.print();
            return ExitCode::from(if error.use_stderr() { exit::USAGE } else { 0 });
        }
    };
    // `leasehold chaos` starts runtimes and processes of its own.
    let command = match cli.command {
        Command::Chaos(args) => return ExitCode::from(leasehold_cli::chaos::main(args)),
        command => command,
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LEASEHOLD_LOG")
                .unwrap_or_else(|_| "error".into()),
        )
        .init();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("leasehold: cannot start: {error}");
            return ExitCode::from(exit::BACKEND);
        }
    };
    let code = runtime.block_on(async {
        match command {
            Command::Run(args) => run(args, None).await,
            Command::Elect(args) if args.observe => observe(args).await,
            Command::Elect(args) => {
                let campaign = args.value.unwrap_or_default().into_bytes();
                let args = RunArgs {
                    connection: args.connection,
                    ttl: args.ttl,
                    wait: args.wait,
                    events: args.events,
                    no_wait: args.no_wait,
                    shared: false,
                    permits: None,
                    grace: args.grace,
                    once_per: None,
                    window_id: None,
                    skew: None,
                    retry_failed: false,
                    at_least: None,
                    at_most: None,
                    names: vec![args.name],
                    command: args.command,
                };
                run(args, Some(campaign)).await
            }
            Command::Inspect(args) => inspect(args).await,
            Command::Locks(args) => locks(args).await,
            Command::Release(args) => release(args).await,
            Command::Bench(args) => bench(args).await,
            Command::Audit(args) if args.follow => audit_follow(&args).await,
            Command::Audit(args) => audit(&args),
            Command::Chaos(_) => exit::USAGE,
            Command::Supervise(args) => {
                leasehold_cli::supervise::supervise(leasehold_cli::supervise::Supervision {
                    channel: args.channel,
                    grace: args.grace,
                    orphan_grace: args.orphan_grace,
                    command: args.command,
                })
                .await
            }
        }
    });
    ExitCode::from(code)
}

async fn connect(connection: &Connection) -> Result<Client, Error> {
    let url = connection
        .url
        .clone()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(leasehold::default_url);
    leasehold::connect(&url).await
}

/// The scheduled job `args` ask for, if any: its window is found now, at the fire.
fn job_spec(args: &RunArgs) -> leasehold::Result<Option<JobSpec>> {
    let window = match (args.once_per, &args.window_id) {
        (None, None) if args.retry_failed => {
            return Err(Error::invalid(
                "--retry-failed",
                "it is for scheduled jobs: give --once-per or --window-id",
            ));
        }
        (None, None) => return Ok(None),
        (period, Some(id)) => {
            let window = Window::named(id)?;
            match period {
                Some(period) => window.keep(
                    period
                        .saturating_mul(2)
                        .saturating_add(Duration::from_secs(60)),
                ),
                None => window,
            }
        }
        (Some(period), None) => {
            let skew = (args.skew).unwrap_or_else(|| (period / 10).min(Duration::from_secs(60)));
            Window::aligned(period, skew, SystemTime::now())?
        }
    };
    Ok(Some(JobSpec {
        window,
        retry_failed: args.retry_failed,
        by: leasehold_cli::inspect::operator(),
    }))
}

/// `leasehold run`, or with `campaign` `leasehold elect`.
async fn run(args: RunArgs, campaign: Option<Vec<u8>>) -> u8 {
    let job = match job_spec(&args) {
        Ok(job) => job,
        Err(error) => {
            eprintln!("leasehold: {error}");
            return exit::USAGE;
        }
    };
    let url = args
        .connection
        .url
        .clone()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(leasehold::default_url);
    // On a session backend the session's ttl is the lock's: --ttl sets it, or the URL does,
    // or the default does; the backend refuses a URL that disagrees with --ttl.
    let asked = args.ttl.unwrap_or(DEFAULT_TTL);
    let lock_options = |ttl| LockOptions::builder().ttl(ttl).build();
    let connect_options = lock_options(asked).and_then(|_| match args.ttl {
        Some(ttl) => ConnectOptions::default().session_ttl(ttl),
        None => ConnectOptions::default().default_session_ttl(DEFAULT_TTL),
    });
    let connect_options = match connect_options {
        Ok(options) => options,
        Err(error) => {
            eprintln!("leasehold: {error}");
            return exit::USAGE;
        }
    };
    let supervisor = match std::env::current_exe() {
        Ok(path) => path,
        Err(error) => {
            eprintln!("leasehold: cannot find its own binary: {error}");
            return exit::BACKEND;
        }
    };
    // Listen before connecting, so that a signal at any point is handled.
    let interrupted = match interrupts() {
        Ok(interrupted) => interrupted,
        Err(error) => {
            eprintln!("leasehold: cannot handle signals: {error}");
            return exit::BACKEND;
        }
    };
    let mut interrupted = std::pin::pin!(interrupted);
    let events = match args
        .events
        .as_ref()
        .map(leasehold::events::JsonLines::create)
    {
        Some(Err(error)) => {
            eprintln!("leasehold: {error}");
            return exit::USAGE;
        }
        Some(Ok(events)) => Some(events),
        None => None,
    };
    let client = tokio::select! {
        backend = leasehold::connect_backend_with(&url, connect_options) => match backend {
            Ok(backend) => {
                let client = leasehold::Client::builder_from_arc(backend);
                match events {
                    Some(events) => client.events(events).build(),
                    None => client.build(),
                }
            }
            Err(error) => {
                eprintln!("leasehold: {error}");
                return exit::for_error(&error);
            }
        },
        signal = &mut interrupted => return exit::signal(signal),
    };
    // The session's ttl as the backend granted it (etcd: whole seconds; ZooKeeper: within
    // the server's bounds).
    let ttl = client.capabilities().session_ttl.unwrap_or(asked);
    let options = match lock_options(ttl) {
        Ok(options) => options,
        Err(error) => {
            eprintln!("leasehold: {error}");
            return exit::USAGE;
        }
    };
    let spec = RunSpec {
        names: args.names,
        campaign,
        hold: match (args.shared, args.permits) {
            (true, _) => Hold::Shared,
            (false, Some(n)) => Hold::Permits(n),
            (false, None) => Hold::Exclusive,
        },
        wait: match (args.no_wait, args.wait) {
            (true, _) => WaitFor::No,
            (false, Some(d)) => WaitFor::UpTo(d),
            (false, None) => WaitFor::Forever,
        },
        job,
        at_least: args.at_least,
        at_most: args.at_most,
        options,
        grace: args
            .grace
            .unwrap_or_else(|| leasehold_cli::run::default_grace(ttl)),
        command: args.command,
        supervisor,
    };
    let code = leasehold_cli::run::run(&client, &spec, interrupted).await;
    client.settle().await;
    code
}

/// Completes with the number of the first SIGINT, SIGTERM or SIGHUP received.
fn interrupts() -> std::io::Result<impl Future<Output = i32> + Send> {
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    let mut hup = signal(SignalKind::hangup())?;
    Ok(async move {
        tokio::select! {
            _ = int.recv() => Signal::INT.as_raw(),
            _ = term.recv() => Signal::TERM.as_raw(),
            _ = hup.recv() => Signal::HUP.as_raw(),
        }
    })
}

async fn inspect(args: InspectArgs) -> u8 {
    if args.watch {
        let names: Vec<&str> = args.names.iter().map(String::as_str).collect();
        return watch(&args.connection, args.json, true, |client| async move {
            client.watch_names(&names).await
        })
        .await;
    }
    let result = match connect(&args.connection).await {
        Ok(client) => inspect::collect(&client, &args.names).await,
        Err(error) => Err(error),
    };
    match (result, args.json) {
        (Ok(locks), true) => {
            println!("{}", inspect::to_json(&locks));
            0
        }
        (Ok(locks), false) => {
            print!("{}", inspect::to_table(&locks, inspect::colour()));
            0
        }
        (Err(error), json) => report(&error, json),
    }
}

async fn locks(args: LocksArgs) -> u8 {
    if args.watch {
        let prefix = args.prefix.as_str();
        return watch(&args.connection, args.json, false, |client| async move {
            client.watch(prefix).await
        })
        .await;
    }
    let result = match connect(&args.connection).await {
        Ok(client) => inspect::list(&client, &args.prefix, args.older_than).await,
        Err(error) => Err(error),
    };
    match result {
        Ok((locks, unknown)) => {
            if unknown > 0 {
                eprintln!(
                    "leasehold: {unknown} held lock(s) left out: the backend does not record \
                     when their grants were made"
                );
            }
            if args.json {
                println!("{}", inspect::to_json(&locks));
            } else {
                print!("{}", inspect::to_table(&locks, inspect::colour()));
            }
            0
        }
        Err(error) => report(&error, args.json),
    }
}

async fn release(args: ReleaseArgs) -> u8 {
    let owner = match args.owner.as_deref().map(OwnerId::parse).transpose() {
        Ok(owner) => owner,
        Err(error) => return report(&error, args.json),
    };
    let by = inspect::operator();
    let result = match connect(&args.connection).await {
        Ok(client) => {
            client
                .evict(&args.name, owner.as_ref(), &by, &args.reason)
                .await
        }
        Err(error) => Err(error),
    };
    let evicted = match result {
        Ok(evicted) => evicted,
        Err(error) => return report(&error, args.json),
    };
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "evicted": inspect::evictions_json(&evicted) })
        );
    } else {
        for e in &evicted {
            println!("evicted {} (token {}) from {}", e.owner, e.token, args.name);
        }
    }
    if evicted.is_empty() {
        match &args.owner {
            Some(owner) => eprintln!(
                "leasehold: {owner} held no grant of {}; nothing was evicted",
                args.name
            ),
            None => eprintln!("leasehold: nobody held {}; nothing was evicted", args.name),
        }
        return exit::NOT_ACQUIRED;
    }
    0
}

/// `leasehold elect --observe`: each leader as it changes, until interrupted.
async fn observe(args: ElectArgs) -> u8 {
    let interrupted = match interrupts() {
        Ok(interrupted) => interrupted,
        Err(error) => {
            eprintln!("leasehold: cannot handle signals: {error}");
            return exit::BACKEND;
        }
    };
    let mut interrupted = std::pin::pin!(interrupted);
    tokio::select! {
        Err(error) = print_leaders(&args) => report(&error, args.json),
        signal = &mut interrupted => exit::signal(signal),
    }
}

/// Prints the leader of `args.name`, then each new one; returns only with an error.
async fn print_leaders(args: &ElectArgs) -> Result<std::convert::Infallible, Error> {
    let client = connect(&args.connection).await?;
    let mut observer = client.election(&args.name)?.observe();
    loop {
        let leader = observer.next().await?;
        println!("{}", inspect::leader_line(leader.as_ref(), args.json));
    }
}

/// `inspect --watch` and `locks --watch`: each change as it is pushed, until interrupted.
async fn watch<F>(
    connection: &Connection,
    json: bool,
    names: bool,
    start: impl FnOnce(leasehold::Client) -> F,
) -> u8
where
    F: std::future::Future<Output = Result<leasehold::LockWatch, Error>>,
{
    let interrupted = match interrupts() {
        Ok(interrupted) => interrupted,
        Err(error) => {
            eprintln!("leasehold: cannot handle signals: {error}");
            return exit::BACKEND;
        }
    };
    let mut interrupted = std::pin::pin!(interrupted);
    let printed = async {
        let client = connect(connection).await?;
        let watch = start(client).await?;
        print_changes(watch, json, names).await
    };
    tokio::select! {
        printed = printed => match printed {
            Ok(()) => 0,
            Err(error) => report(&error, json),
        },
        signal = &mut interrupted => exit::signal(signal),
    }
}

/// Prints each change of `watch`.
/// Returns with an error, or `Ok` when stdout is closed (`| head`). With `names`
/// (`inspect --watch`) the table keeps free names. On a terminal (without --json) the
/// screen is redrawn: the locks as `inspect` shows them, then the latest events.
/// Otherwise one line per event (or per change with --json).
async fn print_changes(
    mut watch: leasehold::LockWatch,
    json: bool,
    names: bool,
) -> Result<(), Error> {
    use std::io::Write as _;
    const EVENTS_SHOWN: usize = 12;
    let screen = !json && std::io::stdout().is_terminal();
    let mut locks: std::collections::BTreeMap<String, leasehold::LockState> =
        std::collections::BTreeMap::new();
    let mut recent: std::collections::VecDeque<String> = std::collections::VecDeque::new();
    loop {
        let change = watch.next().await?;
        let at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let mut out = String::new();
        if json {
            out = format!("{}\n", inspect::change_json(&change, at_ms));
        } else {
            let time = inspect::clock_time(at_ms);
            let lines = inspect::events(&change)
                .into_iter()
                .map(|event| format!("{time} {event}"));
            if screen {
                locks.insert(change.name.to_string(), change.after);
                recent.extend(lines);
                while recent.len() > EVENTS_SHOWN {
                    recent.pop_front();
                }
                let shown: Vec<(String, leasehold::LockState)> =
                    locks.iter().map(|(n, s)| (n.clone(), s.clone())).collect();
                // Home, clear, the table, the events.
                out = format!(
                    "\x1b[H\x1b[2J{}\n",
                    inspect::to_table(&shown, inspect::colour())
                );
                for line in &recent {
                    out.push_str(line);
                    out.push('\n');
                }
                // Freed locks of a prefix leave the table after they have been shown free.
                locks.retain(|_, s| names || !s.holders.is_empty() || !s.waiters.is_empty());
            } else {
                for line in lines {
                    out.push_str(&line);
                    out.push('\n');
                }
            }
        }
        let mut stdout = std::io::stdout().lock();
        match stdout
            .write_all(out.as_bytes())
            .and_then(|()| stdout.flush())
        {
            Ok(()) => {}
            // Whoever read the output has gone: done.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
            Err(e) => return Err(Error::backend(format!("writing to stdout: {e}"), false)),
        }
    }
}

/// Prints `error` (as JSON on stdout with `--json`) and returns its exit code.
fn report(error: &Error, json: bool) -> u8 {
    if json {
        println!(
            "{}",
            serde_json::json!({ "error": { "kind": kind(error), "message": error.to_string() } })
        );
    } else {
        eprintln!("leasehold: {error}");
    }
    exit::for_error(error)
}

async fn bench(args: BenchArgs) -> u8 {
    if args.clients == 0 || args.handoffs == 0 || args.hold == Some(0) {
        eprintln!("leasehold: --clients, --handoffs and --hold must be at least 1");
        return exit::USAGE;
    }
    if let Some(locks) = args.hold {
        return bench_hold(&args, locks).await;
    }
    let spec = leasehold_cli::bench::BenchSpec {
        duration: args.duration.unwrap_or(Duration::from_secs(3)),
        clients: args.clients,
        handoffs: args.handoffs,
    };
    let connection = args.connection;
    match leasehold_cli::bench::leasehold(&spec, || connect(&connection)).await {
        Ok(rows) if args.json => {
            println!("{}", leasehold_cli::bench::json(&rows));
            0
        }
        Ok(rows) => {
            print!("{}", leasehold_cli::bench::table(&rows));
            0
        }
        Err(error) => report(&error, args.json),
    }
}

/// What `leasehold audit` was asked to do.
fn audit_spec(args: &AuditArgs) -> leasehold_chaos::audit::Spec {
    let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let mut spec =
        leasehold_chaos::audit::Spec::new(args.files.clone(), millis(args.clock_uncertainty));
    spec.idle_ms = millis(args.host_idle);
    spec.state.clone_from(&args.state);
    spec.html.clone_from(&args.html);
    spec.listen = args.listen;
    spec.timeline_ms = args.html.as_ref().map(|_| millis(args.html_window));
    spec
}

/// `leasehold audit FILE…`.
fn audit(args: &AuditArgs) -> u8 {
    match leasehold_chaos::audit::audit(&audit_spec(args)) {
        Ok(found) => {
            if args.json {
                println!("{}", found.json());
            } else {
                print!("{}", found.table());
            }
            u8::from(!found.findings.is_empty())
        }
        Err(error) => {
            eprintln!("leasehold: {error}");
            exit::USAGE
        }
    }
}

/// `leasehold audit --follow FILE…`.
async fn audit_follow(args: &AuditArgs) -> u8 {
    let spec = audit_spec(args);
    if let Some(address) = args.metrics_listen {
        let installed = metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(address)
            .install();
        if let Err(error) = installed {
            eprintln!("leasehold: cannot serve metrics on {address}: {error}");
            return exit::USAGE;
        }
    }
    let stop = match interrupts() {
        Ok(stop) => stop,
        Err(error) => {
            eprintln!("leasehold: cannot catch signals: {error}");
            return exit::USAGE;
        }
    };
    let json = args.json;
    let report = leasehold_chaos::audit::follow::follow(
        &spec,
        async {
            stop.await;
        },
        |finding| {
            if json {
                println!("{}", finding.json());
            } else {
                println!("{}", finding.line());
            }
        },
    )
    .await;
    match report {
        Ok(report) => {
            // The summary, for people, also with --json (stdout had the findings).
            eprint!("{}", report.table());
            u8::from(!report.findings.is_empty())
        }
        Err(error) => {
            eprintln!("leasehold: {error}");
            exit::USAGE
        }
    }
}

/// `leasehold bench --hold N`.
async fn bench_hold(args: &BenchArgs, locks: usize) -> u8 {
    let spec = leasehold_cli::bench::HoldSpec {
        locks,
        ttl: args.ttl,
        window: args.duration.unwrap_or(args.ttl),
        servers: args.server_pid.clone(),
    };
    let held = match connect(&args.connection).await {
        Ok(client) => leasehold_cli::bench::hold(&spec, &client).await,
        Err(error) => Err(error),
    };
    match held {
        Ok(report) if args.json => {
            println!("{}", report.json());
            0
        }
        Ok(report) => {
            print!("{}", report.table());
            0
        }
        Err(error) => report(&error, args.json),
    }
}

fn kind(error: &Error) -> &'static str {
    match error {
        Error::InvalidArgument { .. } => "invalid_argument",
        Error::Unsupported { .. } => "unsupported",
        Error::Timeout(_) => "timeout",
        Error::Unavailable { .. } => "unavailable",
        _ => "backend",
    }
}
