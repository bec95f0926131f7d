//! The command line of `leasehold chaos` (and of the `leasehold-chaos` program).

use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};

use crate::deploy::{self, REGISTRY};
use crate::harness::Harness;
use crate::history::History;
use crate::report;
use crate::resource::{FenceMode, ResourceConfig, Workload};
use crate::runner::{self, Launcher, RunReport, RunSpec};
use crate::scenario::{self, Plan, SCENARIOS};
use crate::worker::WorkerConfig;

/// Exit codes.
pub mod exit {
    /// Every check as expected.
    pub const OK: u8 = 0;
    /// A check failed, an expected violation was missed, or a run could not finish.
    pub const FAILED: u8 = 1;
    /// Bad usage.
    pub const USAGE: u8 = 64;
}

/// Run fault scenarios against a backend and check what every process saw.
///
/// Each run uses the backend's servers given with --url (the checker's own program,
/// leasehold-chaos, can also start them), a fenced resource and worker processes that lock
/// and write under the lock, injects the scenario's seeded faults, and checks the history
/// (C1–C10 of the safety model). Exit code 0 when every check came out as the scenario
/// expects, 1 otherwise, 64 on bad usage.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct ChaosArgs {
    #[command(subcommand)]
    command: Option<ChaosCommand>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum ChaosCommand {
    /// List the backends and scenarios (with where each applies).
    List,
    /// Check a recorded history (JSON lines) again.
    Check {
        /// The history file.
        history: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// A worker process (started by the checker).
    #[command(hide = true)]
    Worker {
        #[arg(long)]
        config: String,
    },
    /// The fenced resource (started by the checker).
    #[command(hide = true)]
    Resource {
        #[arg(long)]
        config: String,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ModeArg {
    Enforce,
    Observe,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum WorkloadArg {
    Counter,
    Set,
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Backend(s), comma-separated, or `all` (those this program can run).
    /// They are memory, file, redis, redlock, etcd, zookeeper and postgres.
    #[arg(long, default_value = "all")]
    backend: String,
    /// Scenario(s) by name or number, comma-separated, or `all`.
    #[arg(long, default_value = "all")]
    scenario: String,
    /// The first seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Runs per backend and scenario, with seeds seed, seed+1, and so on.
    #[arg(long, default_value_t = 1)]
    runs: u64,
    /// Runs at once (each with servers and processes of its own).
    #[arg(long, default_value_t = 1)]
    jobs: usize,
    /// The servers to use.
    /// Faults that need control of the servers are skipped; the report says which.
    #[arg(long, env = "LEASEHOLD_URL", hide_env_values = true)]
    url: Option<String>,
    /// Whether the resource refuses stale tokens (enforce) or accepts and records them.
    #[arg(long, value_enum, default_value = "enforce")]
    mode: ModeArg,
    /// What the workers do under the lock.
    #[arg(long, value_enum, default_value = "counter")]
    workload: WorkloadArg,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// Write an HTML report with a timeline per run.
    #[arg(long, value_name = "FILE")]
    html: Option<PathBuf>,
    /// Keep every run's history (JSON lines) in this directory.
    #[arg(long, value_name = "DIR")]
    history: Option<PathBuf>,
    /// Have the workers write their lock events below this directory.
    /// One directory per run (`<backend>-<scenario>-<seed>`), one file per worker process
    /// in it (`w1.0.jsonl`, …), as `run --events` writes them: `leasehold audit
    /// DIR/redis-pause-holder-1/*.jsonl` checks a run.
    #[arg(long, value_name = "DIR")]
    events: Option<PathBuf>,
    /// Start the worker processes' wall clocks this far from the real time (libfaketime).
    /// They go behind, ahead and on time in turn, so two differ by up to twice it: hosts
    /// NTP keeps within this of the real time (`leasehold audit --clock-uncertainty`).
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    clock_skew: Option<std::time::Duration>,
    /// The lease, instead of the scenario's or the backend's (1 s); faults scale with it.
    /// It overrides the lease a scenario chose for itself too.
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    ttl: Option<std::time::Duration>,
    /// A planted bug (the checker's own tests; needs a build with `planted-bugs`).
    #[arg(long, hide = true)]
    bug: Option<String>,
}

/// Runs the command; returns the exit code.
///
/// `launcher` starts this program again as a worker or the resource; a `harness` (the
/// leasehold-chaos program's) starts servers and links in-process workers.
pub fn main(
    args: ChaosArgs,
    launcher: std::io::Result<Launcher>,
    harness: Option<&'static Harness>,
) -> u8 {
    match args.command {
        Some(ChaosCommand::Worker { config }) => {
            let config: WorkerConfig = match serde_json::from_str(&config) {
                Ok(c) => c,
                Err(e) => return usage(&format!("bad worker configuration: {e}")),
            };
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            let link = harness.map(|h| h.link);
            match runtime.map(|rt| rt.block_on(crate::worker::run(config, link))) {
                Ok(Ok(())) => exit::OK,
                Ok(Err(e)) | Err(e) => {
                    eprintln!("leasehold chaos worker: {e}");
                    exit::FAILED
                }
            }
        }
        Some(ChaosCommand::Resource { config }) => {
            let config: ResourceConfig = match serde_json::from_str(&config) {
                Ok(c) => c,
                Err(e) => return usage(&format!("bad resource configuration: {e}")),
            };
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            match runtime.map(|rt| rt.block_on(crate::resource::serve(config))) {
                Ok(Ok(())) => exit::OK,
                Ok(Err(e)) | Err(e) => {
                    eprintln!("leasehold chaos resource: {e}");
                    exit::FAILED
                }
            }
        }
        Some(ChaosCommand::List) => {
            print!("{}", list(harness));
            exit::OK
        }
        Some(ChaosCommand::Check { history, json }) => check(&history, json),
        None => match launcher {
            Ok(launcher) => run(args.run, &launcher, harness),
            Err(e) => {
                eprintln!("leasehold chaos: cannot find this program to start workers: {e}");
                exit::FAILED
            }
        },
    }
}

/// A duration argument (`1s`, `1500ms`).
fn duration(text: &str) -> Result<std::time::Duration, String> {
    leasehold::parse_duration(text).map_err(|e| e.to_string())
}

fn usage(message: &str) -> u8 {
    eprintln!("leasehold chaos: {message}");
    exit::USAGE
}

fn list(harness: Option<&Harness>) -> String {
    let mut out = String::from("Backends:\n");
    for b in REGISTRY {
        let note = if !deploy::available(b) {
            " (not in this build)"
        } else if deploy::unavailable(b, false, harness).is_none() {
            ""
        } else if deploy::unavailable(b, true, harness).is_none() {
            " (with --url)"
        } else {
            " (leasehold-chaos only)"
        };
        out.push_str(&format!("  {:<14} {}://{note}\n", b.name, b.scheme));
    }
    out.push_str("\nScenarios (where they run):\n");
    for s in SCENARIOS {
        let runs: Vec<&str> = REGISTRY
            .iter()
            .filter(|b| matches!((s.plan)(b), Plan::Run(_)))
            .map(|b| b.name)
            .collect();
        out.push_str(&format!(
            "  {:>2} {:<24} {}\n     on: {}\n",
            s.id,
            s.name,
            s.title,
            if runs.is_empty() {
                "-".to_owned()
            } else {
                runs.join(", ")
            }
        ));
    }
    out
}

fn check(path: &std::path::Path, json: bool) -> u8 {
    let history = match History::read(path) {
        Ok(h) => h,
        Err(e) => return usage(&e.to_string()),
    };
    let facts = crate::checks::Facts::new(&history);
    let expect = |c| match (
        deploy::backend(&facts.info.backend),
        scenario::scenario(&facts.info.scenario),
    ) {
        (Some(b), Some(s)) => match (s.plan)(b) {
            Plan::Run(setup) => {
                let mode = if facts.info.mode == "observe" {
                    FenceMode::Observe
                } else {
                    FenceMode::Enforce
                };
                runner::expectation(&setup, mode, c)
            }
            Plan::Skip(_) => crate::checks::Expect::Hold,
        },
        _ => crate::checks::Expect::Hold,
    };
    let verdicts = crate::checks::run_all(&history, expect);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&verdicts).unwrap_or_default()
        );
    } else {
        for v in &verdicts {
            println!(
                "{} {:<4} {:<18} {}",
                v.status.symbol(),
                v.check.to_string(),
                v.check.name(),
                v.summary
            );
        }
    }
    if verdicts.iter().all(|v| v.status.is_good()) {
        exit::OK
    } else {
        exit::FAILED
    }
}

fn pick<T: Copy>(
    text: &str,
    all: &[T],
    find: impl Fn(&str) -> Option<T>,
    what: &str,
) -> Result<Vec<T>, String> {
    if text == "all" {
        return Ok(all.to_vec());
    }
    text.split(',')
        .map(|name| find(name.trim()).ok_or_else(|| format!("unknown {what} {name:?}")))
        .collect()
}

fn run(args: RunArgs, launcher: &Launcher, harness: Option<&'static Harness>) -> u8 {
    let url = args.url.is_some();
    let runnable: Vec<&'static deploy::BackendSpec> = REGISTRY
        .iter()
        .copied()
        .filter(|b| deploy::unavailable(b, url, harness).is_none())
        .collect();
    let backends = match pick(&args.backend, &runnable, deploy::backend, "backend") {
        Ok(b) => b,
        Err(e) => return usage(&format!("{e}; see `leasehold chaos list`")),
    };
    if let Some(why) = backends
        .iter()
        .find_map(|b| deploy::unavailable(b, url, harness))
    {
        return usage(&why);
    }
    if args.backend == "all" && runnable.len() < REGISTRY.len() {
        let left: Vec<&str> = REGISTRY
            .iter()
            .filter(|b| !runnable.iter().any(|r| r.name == b.name))
            .map(|b| b.name)
            .collect();
        eprintln!(
            "leasehold chaos: not run here: {} (see `leasehold chaos list`)",
            left.join(", ")
        );
    }
    let all: Vec<&'static scenario::Scenario> = SCENARIOS.iter().collect();
    let scenarios = match pick(&args.scenario, &all, scenario::scenario, "scenario") {
        Ok(s) => s,
        Err(e) => return usage(&format!("{e}; see `leasehold chaos list`")),
    };
    if args.runs == 0 {
        return usage("--runs must be at least 1");
    }
    if let Some(dir) = &args.history
        && let Err(e) = std::fs::create_dir_all(dir)
    {
        return usage(&format!("--history {}: {e}", dir.display()));
    }
    if let Some(url) = &args.url {
        let scheme = url.split(':').next().unwrap_or("").to_ascii_lowercase();
        let fits = |b: &deploy::BackendSpec| {
            scheme == b.scheme
                || scheme == format!("{}s", b.scheme)
                || (b.name == "zookeeper" && scheme == "zookeeper")
        };
        if backends.len() != 1 || !fits(backends[0]) {
            return usage(&format!(
                "--url needs --backend naming that URL's backend ({})",
                leasehold::support::redact_url(url)
            ));
        }
    }
    let mut specs = Vec::new();
    for backend in &backends {
        for s in &scenarios {
            for seed in args.seed..args.seed + args.runs {
                specs.push(RunSpec {
                    backend,
                    scenario: s,
                    seed,
                    mode: match args.mode {
                        ModeArg::Enforce => FenceMode::Enforce,
                        ModeArg::Observe => FenceMode::Observe,
                    },
                    workload: match args.workload {
                        WorkloadArg::Counter => Workload::Counter,
                        WorkloadArg::Set => Workload::Set,
                    },
                    url: args.url.clone(),
                    harness,
                    bug: args.bug.clone(),
                    history_dir: args.history.clone(),
                    events_dir: args.events.clone(),
                    clock_skew: args.clock_skew,
                    ttl: args.ttl,
                });
            }
        }
    }
    if args.jobs == 0 {
        return usage("--jobs must be at least 1");
    }
    if args
        .ttl
        .is_some_and(|ttl| ttl < std::time::Duration::from_millis(100))
    {
        return usage("--ttl must be at least 100ms");
    }
    let skews = std::time::Duration::from_millis(1)..=std::time::Duration::from_secs(3600);
    if args.clock_skew.is_some_and(|skew| !skews.contains(&skew)) {
        return usage("--clock-skew must be from 1ms to 1h");
    }
    let mut progress = report::Progress::new(specs.len());
    let mut slots: Vec<Option<RunReport>> = specs.iter().map(|_| None).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let (done_tx, done_rx) = std::sync::mpsc::channel::<(usize, RunReport)>();
    let failed_to_start = std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for _ in 0..args.jobs.min(specs.len()) {
            let done_tx = done_tx.clone();
            let (specs, next) = (&specs, &next);
            handles.push(scope.spawn(move || -> std::io::Result<()> {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()?;
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let Some(spec) = specs.get(i) else {
                        return Ok(());
                    };
                    let report = runtime.block_on(runner::run(spec, launcher));
                    if done_tx.send((i, report)).is_err() {
                        return Ok(());
                    }
                }
            }));
        }
        drop(done_tx);
        for (i, mut r) in done_rx {
            progress.step(&r);
            // Keep histories only for the runs the HTML report draws: every failure, and
            // the first run of each backend and scenario.
            let drawn = slots
                .iter()
                .flatten()
                .any(|o| o.backend == r.backend && o.scenario == r.scenario && o.history.is_some());
            if args.html.is_none() || (r.is_good() && drawn) {
                r.history = None;
            }
            slots[i] = Some(r);
        }
        handles
            .into_iter()
            .filter_map(|h| h.join().ok())
            .find_map(Result::err)
    });
    if let Some(e) = failed_to_start {
        eprintln!("leasehold chaos: cannot start: {e}");
        return exit::FAILED;
    }
    let reports: Vec<RunReport> = slots.into_iter().flatten().collect();
    if let Some(path) = &args.html
        && let Err(e) = std::fs::write(path, report::html(&reports))
    {
        eprintln!("leasehold chaos: writing {}: {e}", path.display());
    }
    if args.json {
        println!("{}", report::to_json(&reports));
    } else {
        print!("{}", report::table(&reports));
    }
    if reports.iter().all(RunReport::is_good) {
        exit::OK
    } else {
        exit::FAILED
    }
}
