//! One run, from starting the servers to checking the history.
//! Start the servers (or take the user's), the collector, the fenced resource and the
//! workers; play the scenario's seeded faults; stop everything; check the history.

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};

use crate::checks::{self, Check, Expect, RunInfo, Verdict};
use crate::collector::Collector;
use crate::deploy::{BackendSpec, Deployment};
use crate::harness::Harness;
use crate::history::{Event, History, Kind, Phase};
use crate::nemesis::{Ctx, Schedule, Spawner, WorkerProcess};
use crate::resource::{FenceMode, ResourceConfig, StillOwnerCheck, Workload};
use crate::scenario::{Plan, Scenario, Setup};
use crate::worker::WorkerConfig;

/// How to start the checker's own processes (workers, the resource).
/// A program and the arguments before `worker …` / `resource …`.
#[derive(Debug, Clone)]
pub struct Launcher {
    /// The program.
    pub program: PathBuf,
    /// Arguments that come first (`["chaos"]` for the `leasehold` command).
    pub args: Vec<OsString>,
}

impl Launcher {
    /// This very program, with `args` first.
    ///
    /// # Errors
    ///
    /// If the program's path cannot be found.
    pub fn this_program(args: &[&str]) -> io::Result<Self> {
        Ok(Self {
            program: std::env::current_exe()?,
            args: args.iter().map(OsString::from).collect(),
        })
    }

    fn command(&self, role: &str, config: &impl Serialize) -> io::Result<Command> {
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .arg(role)
            .arg("--config")
            .arg(serde_json::to_string(config)?)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(if std::env::var_os("LEASEHOLD_CHAOS_DEBUG").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .kill_on_drop(true);
        Ok(command)
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct RunSpec {
    /// The backend.
    pub backend: &'static BackendSpec,
    /// The scenario.
    pub scenario: &'static Scenario,
    /// The seed of the fault schedule and of the workers' choices.
    pub seed: u64,
    /// Whether the resource refuses stale tokens.
    pub mode: FenceMode,
    /// What the workers do.
    pub workload: Workload,
    /// The user's servers, instead of starting them.
    pub url: Option<String>,
    /// What starts servers and links in-process workers (the `leasehold-chaos` program's).
    pub harness: Option<&'static Harness>,
    /// A planted bug (the checker's own tests).
    pub bug: Option<String>,
    /// Where to keep the history (JSON lines), if anywhere.
    pub history_dir: Option<PathBuf>,
    /// Where the workers write their lock events (`leasehold audit`'s input), if anywhere.
    /// They go in `<backend>-<scenario>-<seed>/` below it, one file per worker process.
    pub events_dir: Option<PathBuf>,
    /// How far from the real time the worker processes' wall clocks start, if at all.
    /// See [`skewed_offset_ms`]: hosts whose clocks differ by up to twice this, for the whole
    /// run (libfaketime), as hosts an NTP estimate puts within this of the real time.
    pub clock_skew: Option<Duration>,
    /// The lease, instead of the scenario's or the backend's; the schedule scales with it.
    pub ttl: Option<Duration>,
}

/// How a run ended.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// It ran; the checks' verdicts.
    Ran {
        /// One per check.
        verdicts: Vec<Verdict>,
    },
    /// The scenario does not apply.
    Skipped {
        /// Why.
        reason: String,
    },
    /// It could not run to the end (a server did not start, nobody made progress).
    Error {
        /// What happened.
        message: String,
        /// The checks' verdicts on what was recorded, if anything was.
        #[serde(default)]
        verdicts: Vec<Verdict>,
    },
}

/// Figures of a run.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Stats {
    /// Faults injected.
    pub faults: usize,
    /// Grants the servers made.
    pub grants: usize,
    /// Accesses the resource accepted.
    pub accepted: usize,
    /// Accesses the resource refused (stale tokens).
    pub refused: usize,
    /// Stale accesses acknowledged (C2's violations).
    pub stale_accepted: usize,
    /// Acknowledged writes lost (C4's violations).
    pub lost_writes: usize,
    /// Overlapping server-side grants (C5's violations).
    pub double_grants: usize,
    /// Events in the history.
    pub events: usize,
}

/// The report of one run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunReport {
    /// The backend.
    pub backend: String,
    /// The scenario.
    pub scenario: String,
    /// Its number in `safety.md`.
    pub scenario_id: u8,
    /// The seed.
    pub seed: u64,
    /// `enforce` or `observe`.
    pub mode: String,
    /// `counter` or `set`.
    pub workload: String,
    /// A planted bug, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bug: Option<String>,
    /// How it went.
    #[serde(flatten)]
    pub outcome: Outcome,
    /// Its figures.
    pub stats: Stats,
    /// Where its history was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history_file: Option<PathBuf>,
    /// How long it took, ms.
    pub elapsed_ms: u64,
    /// The command that replays it.
    pub replay: String,
    /// The history (for the HTML report; not serialized).
    #[serde(skip)]
    pub history: Option<History>,
}

impl RunReport {
    /// Whether every check's verdict is good (and the run did not fail).
    pub fn is_good(&self) -> bool {
        match &self.outcome {
            Outcome::Ran { verdicts } => verdicts.iter().all(|v| v.status.is_good()),
            Outcome::Skipped { .. } => true,
            Outcome::Error { .. } => false,
        }
    }

    /// The verdicts, if it ran.
    pub fn verdicts(&self) -> &[Verdict] {
        match &self.outcome {
            Outcome::Ran { verdicts } | Outcome::Error { verdicts, .. } => verdicts,
            Outcome::Skipped { .. } => &[],
        }
    }

    /// The verdict of `check`.
    pub fn verdict(&self, check: Check) -> Option<&Verdict> {
        self.verdicts().iter().find(|v| v.check == check)
    }

    /// The name of its history file.
    /// It is made of backend, scenario, seed, and what else sets the run apart (a planted
    /// bug, observe mode, the set workload).
    pub fn history_name(&self) -> String {
        let mut name = format!("{}-{}-{}", self.backend, self.scenario, self.seed);
        for part in [
            self.bug.as_deref(),
            (self.mode != "enforce").then_some(self.mode.as_str()),
            (self.workload != "counter").then_some(self.workload.as_str()),
        ]
        .into_iter()
        .flatten()
        {
            name.push('-');
            name.push_str(part);
        }
        name.push_str(".jsonl");
        name
    }

    /// Writes its history (JSON lines) into `dir` (created if missing), unless it is kept already.
    /// Returns the file. A run that recorded nothing has no history to keep.
    ///
    /// # Errors
    ///
    /// I/O errors; `NotFound` if the run recorded nothing.
    pub fn keep_history(&mut self, dir: &Path) -> io::Result<PathBuf> {
        if let Some(path) = &self.history_file {
            return Ok(path.clone());
        }
        let history = self
            .history
            .as_ref()
            .filter(|h| !h.events().is_empty())
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "the run recorded nothing"))?;
        std::fs::create_dir_all(dir)?;
        let path = dir.join(self.history_name());
        history.write(&path)?;
        self.history_file = Some(path.clone());
        Ok(path)
    }

    /// Whether any check found a violation (expected or not).
    pub fn caught(&self) -> Vec<Check> {
        self.verdicts()
            .iter()
            .filter(|v| !v.violations.is_empty())
            .map(|v| v.check)
            .collect()
    }
}

/// What `check` must show in a run of `setup` in `mode`.
/// In observe mode the resource accepts what fencing would refuse, so where double grants
/// are expected the resource's checks may fail too.
pub fn expectation(setup: &Setup, mode: FenceMode, check: Check) -> Expect {
    let weak = setup.expect(Check::C5) != Expect::Hold;
    match check {
        Check::C1 | Check::C2 | Check::C4 if mode == FenceMode::Observe && weak => Expect::Either,
        _ => setup.expect(check),
    }
}

/// Runs `spec`: failures to start or finish are in the report, not errors.
///
/// # Cancel safety
///
/// Dropping the future kills the run's processes and servers (they die with their
/// handles), and the report is lost.
pub async fn run(spec: &RunSpec, launcher: &Launcher) -> RunReport {
    let started = Instant::now();
    let mut report = RunReport {
        backend: spec.backend.name.into(),
        scenario: spec.scenario.name.into(),
        scenario_id: spec.scenario.id,
        seed: spec.seed,
        mode: spec.mode.as_str().into(),
        workload: spec.workload.as_str().into(),
        bug: spec.bug.clone(),
        outcome: Outcome::Skipped {
            reason: String::new(),
        },
        stats: Stats::default(),
        history_file: None,
        elapsed_ms: 0,
        replay: replay_command(spec),
        history: None,
    };
    let setup = match (spec.scenario.plan)(spec.backend) {
        Plan::Skip(reason) => {
            report.outcome = Outcome::Skipped { reason };
            return report;
        }
        Plan::Run(setup) => setup,
    };
    if spec.url.is_some() && setup.needs_servers {
        report.outcome = Outcome::Skipped {
            reason: "needs control of the servers (pause, kill, restart, administration); \
                     not done to servers given with --url"
                .into(),
        };
        return report;
    }
    if spec.clock_skew.is_some() && !spec.backend.traits.processes {
        report.outcome = Outcome::Skipped {
            reason: "a clock skew needs workers in processes of their own".into(),
        };
        return report;
    }
    if (setup.faketime || spec.clock_skew.is_some()) && faketime_library().is_none() {
        report.outcome = Outcome::Skipped {
            reason: "libfaketime is not installed (Debian: faketime libfaketime)".into(),
        };
        return report;
    }
    let mut recorded = None;
    let result = execute(spec, &setup, launcher, &mut report, &mut recorded).await;
    let history = recorded.unwrap_or_default();
    let verdicts = if history.events().is_empty() {
        Vec::new()
    } else {
        checks::run_all(&history, |c| expectation(&setup, spec.mode, c))
    };
    report.stats = stats(&history, &verdicts, report.stats.faults);
    report.outcome = match result {
        Ok(()) => Outcome::Ran { verdicts },
        Err(e) => Outcome::Error {
            message: e.to_string(),
            verdicts,
        },
    };
    report.history = Some(history);
    if let Some(dir) = &spec.history_dir {
        // A history that cannot be written is simply not kept (the report says where a
        // kept one is).
        let _ = report.keep_history(dir);
    }
    report.elapsed_ms = started.elapsed().as_millis() as u64;
    report
}

/// The command line that replays `spec`.
/// It is `leasehold chaos`, or the checker's own program where the run needs its harness.
fn replay_command(spec: &RunSpec) -> String {
    let mut args = format!(
        "--backend {} --scenario {} --seed {}",
        spec.backend.name, spec.scenario.name, spec.seed
    );
    if spec.mode == FenceMode::Observe {
        args.push_str(" --mode observe");
    }
    if spec.workload == Workload::Set {
        args.push_str(" --workload set");
    }
    if let Some(url) = &spec.url {
        args.push_str(&format!(" --url {}", leasehold::support::redact_url(url)));
    }
    match &spec.bug {
        // Planted bugs exist only in a build with the feature.
        Some(bug) => format!(
            "cargo run -p leasehold-chaos-harness --features planted-bugs -- {args} --bug {bug}"
        ),
        None if spec.backend.needs_harness(spec.url.is_some()) => {
            format!("leasehold-chaos {args}")
        }
        None => format!("leasehold chaos {args}"),
    }
}

fn stats(history: &History, verdicts: &[Verdict], faults: usize) -> Stats {
    let count = |c: Check| {
        verdicts
            .iter()
            .find(|v| v.check == c)
            .map_or(0, |v| v.violations.len())
    };
    let applied = |answer: &str| {
        history
            .of(Kind::Apply)
            .filter(|e| e.answer.as_deref() == Some(answer))
            .count()
    };
    Stats {
        faults,
        grants: checks::Facts::new(history).grants.len(),
        accepted: applied("accepted"),
        refused: applied("refused"),
        stale_accepted: count(Check::C2),
        lost_writes: count(Check::C4),
        double_grants: count(Check::C5),
        events: history.events().len(),
    }
}

/// The wall-clock offset of worker process `i` under a clock skew of `skew`, in ms.
/// Processes go behind, ahead and on time in turn: two of them differ by up to `2 × skew`.
pub fn skewed_offset_ms(i: usize, skew: Duration) -> i64 {
    let ms = i64::try_from(skew.as_millis()).unwrap_or(i64::MAX);
    match i % 3 {
        0 => -ms,
        1 => ms,
        _ => 0,
    }
}

/// Sets the libfaketime offset in `file` to `ms` milliseconds from the real time.
/// The file is replaced whole: libfaketime reads it at every clock call, and must never
/// see it half written.
pub(crate) fn set_clock(file: &Path, ms: i64) -> io::Result<()> {
    let sign = if ms < 0 { '-' } else { '+' };
    let ms = ms.unsigned_abs();
    let next = file.with_extension("next");
    std::fs::write(&next, format!("{sign}{}.{:03}", ms / 1000, ms % 1000))?;
    std::fs::rename(&next, file)
}

/// Where libfaketime is, if installed.
pub fn faketime_library() -> Option<PathBuf> {
    let dirs = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib",
    ];
    dirs.iter()
        .map(|d| Path::new(d).join("faketime/libfaketime.so.1"))
        .find(|p| p.is_file())
}

/// A child that is stopped when dropped.
struct Resource {
    child: Child,
    addr: std::net::SocketAddr,
}

async fn start_resource(launcher: &Launcher, config: &ResourceConfig) -> io::Result<Resource> {
    let mut command = launcher.command("resource", config)?;
    command.stdin(Stdio::piped()).stdout(Stdio::piped());
    let mut child = command.spawn()?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| io::Error::other("no stdout from the resource"))?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .map_err(|_| io::Error::other("the resource did not start in time"))??
        .ok_or_else(|| io::Error::other("the resource exited at start"))?;
    let addr = line
        .strip_prefix("listening ")
        .and_then(|a| a.trim().parse().ok())
        .ok_or_else(|| io::Error::other(format!("the resource said {line:?}")))?;
    Ok(Resource { child, addr })
}

async fn execute(
    spec: &RunSpec,
    setup: &Setup,
    launcher: &Launcher,
    report: &mut RunReport,
    recorded: &mut Option<History>,
) -> io::Result<()> {
    let ttl = spec.ttl.or(setup.ttl).unwrap_or(spec.backend.ttl);
    let request_timeout = ttl
        .mul_f64(setup.request_timeout)
        .max(Duration::from_millis(500));
    let lock = format!("chaos-{}-{}", spec.scenario.name, spec.seed);
    let mut deployment = Deployment::start(
        spec.backend,
        setup.topology,
        setup.workers,
        spec.url.as_deref(),
        spec.harness,
        ttl,
    )
    .await?;
    let collector = Collector::start().await?;
    let result = drive(
        spec,
        setup,
        launcher,
        &collector,
        &mut deployment,
        ttl,
        request_timeout,
        &lock,
        report,
    )
    .await;
    *recorded = Some(collector.history());
    result
}

#[allow(clippy::too_many_arguments)]
async fn drive(
    spec: &RunSpec,
    setup: &Setup,
    launcher: &Launcher,
    collector: &Collector,
    deployment: &mut Deployment,
    ttl: Duration,
    request_timeout: Duration,
    lock: &str,
    report: &mut RunReport,
) -> io::Result<()> {
    let info = RunInfo {
        backend: spec.backend.name.into(),
        scenario: spec.scenario.name.into(),
        seed: spec.seed,
        ttl_us: ttl.as_micros() as u64,
        lock_delay_us: setup
            .lock_delay
            .map_or(0, |f| ttl.mul_f64(f).as_micros() as u64),
        recovery_slack_us: (ttl.max(Duration::from_millis(1500))).as_micros() as u64,
        workload: spec.workload.as_str().into(),
        mode: spec.mode.as_str().into(),
        copies: if spec.backend.name == "redlock" {
            deployment.servers.count().max(1) as u32
        } else {
            1
        },
        clock_skew_us: spec.clock_skew.map_or(0, |skew| skew.as_micros() as u64),
    };
    collector.record(
        Event::new("runner", Kind::Start, Phase::Info)
            .value(serde_json::to_value(&info).unwrap_or(Value::Null)),
    );
    // Each run's events in a directory of its own: a run's servers start afresh, and so
    // do its tokens.
    let events_dir = match &spec.events_dir {
        Some(dir) => {
            let run = dir.join(format!(
                "{}-{}-{}",
                spec.backend.name, spec.scenario.name, spec.seed
            ));
            std::fs::create_dir_all(&run)?;
            // Files there would be appended to: two runs' tokens in one record are an audit
            // of nothing that happened.
            if std::fs::read_dir(&run)?.next().is_some() {
                return Err(io::Error::other(format!(
                    "{} has events of an earlier run; give another --events directory",
                    run.display()
                )));
            }
            Some(run)
        }
        None => None,
    };
    let resource = start_resource(
        launcher,
        &ResourceConfig {
            collector: collector.addr(),
            mode: spec.mode,
            workload: spec.workload,
            still_owner: setup.still_owner.then(|| StillOwnerCheck {
                url: deployment.observer_url.clone(),
                lock: lock.to_owned(),
            }),
            events: events_dir.as_ref().map(|dir| dir.join("resource.jsonl")),
        },
    )
    .await?;
    let names: Vec<String> = (1..=setup.workers).map(|i| format!("w{i}")).collect();
    let base = WorkerConfig {
        processes: Vec::new(),
        incarnation: 0,
        url: String::new(),
        lock: lock.to_owned(),
        collector: collector.addr(),
        resource: resource.addr,
        ttl_ms: ttl.as_millis() as u64,
        request_timeout_ms: request_timeout.as_millis() as u64,
        lock_delay_ms: setup.lock_delay.map(|f| ttl.mul_f64(f).as_millis() as u64),
        events_dir,
        wait_ms: (ttl * 3).as_millis() as u64,
        rounds: setup.rounds,
        pause_ms: (ttl / 10).as_millis() as u64,
        think_ms: (ttl / 4).as_millis() as u64,
        workload: spec.workload,
        spin: names.iter().rev().take(setup.spin).cloned().collect(),
        rogue: if setup.rogue {
            names.clone()
        } else {
            Vec::new()
        },
        bug: spec.bug.clone(),
        seed: spec.seed,
        side_locks: setup.side_locks,
        still_owner: setup.still_owner,
    };
    let clocks = tempfile::tempdir()?;
    let faked = setup.faketime || spec.clock_skew.is_some();
    let faketime = if faked { faketime_library() } else { None };
    let launcher_for_workers = launcher.clone();
    let spawner: Spawner = Box::new(move |config: &WorkerConfig, clock: Option<&PathBuf>| {
        let mut command = launcher_for_workers.command("worker", config)?;
        if let (Some(library), Some(clock)) = (&faketime, clock) {
            command
                .env("LD_PRELOAD", library)
                .env("FAKETIME_TIMESTAMP_FILE", clock)
                .env("FAKETIME_NO_CACHE", "1")
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        }
        command.spawn()
    });
    let mut workers = Vec::new();
    let groups: Vec<Vec<String>> = if spec.backend.traits.processes {
        names.iter().map(|n| vec![n.clone()]).collect()
    } else {
        vec![names.clone()]
    };
    for (i, group) in groups.into_iter().enumerate() {
        let mut config = base.clone();
        config.url = deployment.worker_urls.get(i).cloned().unwrap_or_else(|| {
            deployment
                .worker_urls
                .first()
                .cloned()
                .unwrap_or_else(|| deployment.observer_url.clone())
        });
        config.seed = spec.seed.wrapping_mul(31).wrapping_add(i as u64);
        config.processes = group;
        let clock_base_ms = spec.clock_skew.map_or(0, |skew| skewed_offset_ms(i, skew));
        let clock = if faked {
            let file = clocks.path().join(format!("clock-{i}"));
            set_clock(&file, clock_base_ms)?;
            Some(file)
        } else {
            None
        };
        let child = spawner(&config, clock.as_ref())?;
        workers.push(WorkerProcess {
            names: config.processes.clone(),
            child: Some(child),
            config,
            faketime: clock,
            clock_base_ms,
        });
    }
    // Every worker connected.
    let mut view = collector.view();
    let all = names.clone();
    tokio::time::timeout(
        Duration::from_secs(30),
        view.wait_for(|v| all.iter().all(|n| v.connected.contains_key(n))),
    )
    .await
    .map_err(|_| io::Error::other("the workers did not connect in time"))?
    .map_err(|_| io::Error::other("the collector stopped"))?;

    // Workers that share one process with their server (memory) report its final state
    // themselves: an observer here would look at a server of its own.
    let observer = if spec.backend.traits.processes {
        Some(Observer::start(
            collector,
            &deployment.observer_url,
            lock,
            ttl,
        ))
    } else {
        None
    };

    let mut ctx = Ctx::new(
        Schedule {
            rng: StdRng::seed_from_u64(spec.seed),
            ttl,
            request_timeout,
            lock: lock.to_owned(),
        },
        collector,
        deployment,
        &mut workers,
        &spawner,
    );
    let script = (spec.scenario.script)(&mut ctx);
    // Schedules are counted in leases: a longer lease (`--ttl`) gives the script longer.
    let limit = Duration::from_secs(120).max(ttl.saturating_mul(120));
    let played = match tokio::time::timeout(limit, script).await {
        Ok(result) => result,
        Err(_) => Err(io::Error::other(format!(
            "the scenario did not finish in {} s",
            limit.as_secs()
        ))),
    };
    ctx.cleanup().await;
    report.stats.faults = ctx.injected;
    let killed = ctx.killed;
    drop(ctx);

    // Stop the workers: each finishes its hold and releases.
    for w in &workers {
        for name in &w.names {
            collector.command(name, crate::wire::Command::Stop);
        }
    }
    let grace = ttl * 3 + request_timeout * 3 + Duration::from_secs(5);
    for w in &mut workers {
        if let Some(child) = &mut w.child
            && tokio::time::timeout(grace, child.wait()).await.is_err()
        {
            let mut e = Event::new("nemesis", Kind::Fault, Phase::Invoke).op(u64::MAX);
            e.fault = Some("kill".into());
            e.target = w.names.first().cloned();
            e.error = Some("did not stop when told to".into());
            collector.record(e);
            let _ = child.kill().await;
        }
    }
    // Leases of killed workers lapse before the final look.
    if killed {
        tokio::time::sleep(ttl.max(Duration::from_secs(1)) + Duration::from_millis(500)).await;
    }
    if let Some(observer) = observer {
        observer.finish(collector).await;
    }
    resource_final(collector, resource).await;
    played
}

/// The observer: the server's view of the lock, now and then, bypassing every fault.
/// It looks through a connection of its own, made again until it works (a loaded server may
/// take longer to accept one than a connect timeout).
struct Observer {
    url: String,
    lock: String,
    task: tokio::task::JoinHandle<()>,
}

/// How long the observer gives a connection to the server.
const OBSERVER_CONNECT: Duration = Duration::from_secs(10);

/// A connection to `url` within [`OBSERVER_CONNECT`], if one can be made.
async fn observer_client(url: &str) -> Option<leasehold::Client> {
    tokio::time::timeout(OBSERVER_CONNECT, leasehold::connect(url))
        .await
        .ok()?
        .ok()
}

/// An inspection's holders and waiters, as recorded (`last`: the final one, for C10).
pub(crate) fn holders_value(state: &leasehold::LockState, last: bool) -> Value {
    let holders: Vec<Value> = state
        .holders
        .iter()
        .map(|h| {
            json!({
                "owner": h.owner.to_string(),
                "token": h.token.get(),
                "mode": match h.mode { leasehold::Mode::Exclusive => "exclusive", leasehold::Mode::Shared => "shared", _ => "permit" },
            })
        })
        .collect();
    json!({"holders": holders, "waiters": state.waiters.len(), "final": last})
}

impl Observer {
    fn start(collector: &Collector, url: &str, lock: &str, ttl: Duration) -> Observer {
        let every = (ttl / 4).max(Duration::from_millis(100));
        let record = collector.handle();
        let (url, name) = (url.to_owned(), lock.to_owned());
        let task = tokio::spawn({
            let url = url.clone();
            let name = name.clone();
            async move {
                let mut client = None;
                loop {
                    if client.is_none() {
                        client = observer_client(&url).await;
                    }
                    if let Some(probe) = &client
                        && let Ok(Ok(state)) =
                            tokio::time::timeout(Duration::from_secs(1), probe.inspect(&name)).await
                    {
                        record.record(
                            Event::new("observer", Kind::Inspect, Phase::Info)
                                .lock(name.clone())
                                .value(holders_value(&state, false)),
                        );
                    }
                    tokio::time::sleep(every).await;
                }
            }
        });
        Observer {
            url,
            lock: name,
            task,
        }
    }

    /// The final look, through a connection made now.
    async fn finish(self, collector: &Collector) {
        self.task.abort();
        for _ in 0..5 {
            let looked = match observer_client(&self.url).await {
                Some(client) => {
                    tokio::time::timeout(Duration::from_secs(2), client.inspect(&self.lock)).await
                }
                None => continue,
            };
            if let Ok(Ok(state)) = looked {
                collector.record(
                    Event::new("observer", Kind::Inspect, Phase::Info)
                        .lock(self.lock.clone())
                        .value(holders_value(&state, true)),
                );
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

async fn resource_final(collector: &Collector, mut resource: Resource) {
    let client = crate::resource::ResourceClient::new(resource.addr, Duration::from_secs(5));
    let request = crate::wire::ResourceRequest {
        op: "final".into(),
        id: 0,
        worker: String::new(),
        owner: String::new(),
        token: 0,
        value: Value::Null,
    };
    let _ = client.call(&request).await;
    // The final event travels on the resource's own connection: wait for it (a resource
    // that died sends none).
    collector
        .until_recorded(Kind::Final, Duration::from_secs(10))
        .await;
    // Its stdin closing ends it, its access events written out; else it is killed.
    drop(resource.child.stdin.take());
    if tokio::time::timeout(Duration::from_secs(5), resource.child.wait())
        .await
        .is_err()
    {
        let _ = resource.child.kill().await;
    }
}
