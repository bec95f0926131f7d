//! Runs of the checker from its tests.
//! The `leasehold-chaos` program of this build is the worker and the resource, and the
//! harness starts the servers.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use leasehold_chaos::deploy;
use leasehold_chaos::resource::{FenceMode, Workload};
use leasehold_chaos::runner::{self, Launcher, RunReport, RunSpec};
use leasehold_chaos::scenario::{self, SCENARIOS};

pub fn launcher() -> Launcher {
    Launcher {
        program: PathBuf::from(env!("CARGO_BIN_EXE_leasehold-chaos")),
        args: Vec::new(),
    }
}

pub fn spec(backend: &str, scenario: &str, seed: u64) -> RunSpec {
    RunSpec {
        backend: deploy::backend(backend).expect("backend"),
        scenario: scenario::scenario(scenario).expect("scenario"),
        seed,
        mode: FenceMode::Enforce,
        workload: Workload::Counter,
        url: None,
        harness: Some(&leasehold_chaos_harness::HARNESS),
        bug: None,
        history_dir: history_dir(),
        events_dir: None,
        clock_skew: None,
        ttl: None,
    }
}

/// Where every run keeps its history.
/// `LEASEHOLD_CHAOS_HISTORY` if set (otherwise only failing runs keep theirs, in
/// [`failures_dir`]).
pub fn history_dir() -> Option<PathBuf> {
    std::env::var_os("LEASEHOLD_CHAOS_HISTORY").map(PathBuf::from)
}

/// Where a failing run keeps its history.
/// `LEASEHOLD_CHAOS_HISTORY` if set, else `chaos-failures` in Cargo's directory for
/// integration tests' files (`target/tmp`), which outlives the test.
pub fn failures_dir() -> PathBuf {
    history_dir()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("chaos-failures"))
}

/// Keeps the history of `report`, a run that made a test fail, and says where.
/// It says it with the command that replays the run (printed at once too, in case the test
/// goes on).
pub fn kept(report: &mut RunReport) -> String {
    let line = match report.keep_history(&failures_dir()) {
        Ok(path) => format!(
            "{} {} seed {}: replay: {}\n    history: {} (check it again: leasehold chaos check {})",
            report.backend,
            report.scenario,
            report.seed,
            report.replay,
            path.display(),
            path.display()
        ),
        Err(e) => format!(
            "{} {} seed {}: replay: {}\n    history not kept: {e}",
            report.backend, report.scenario, report.seed, report.replay
        ),
    };
    eprintln!("{line}");
    line
}

/// Fails the test with the table of `runs`, keeping each run's history (see [`kept`]).
pub fn fail(what: &str, runs: &mut [RunReport]) -> ! {
    let table = leasehold_chaos::report::table(runs);
    let kept: Vec<String> = runs.iter_mut().map(kept).collect();
    panic!("{what}\n{table}\n{}", kept.join("\n"));
}

/// Fails the test unless every run of `reports` came out as its scenario expects.
/// The histories of those that did not are kept (see [`kept`]).
pub fn assert_good(what: &str, reports: &mut [RunReport]) {
    if reports.iter().all(RunReport::is_good) {
        return;
    }
    let table = leasehold_chaos::report::table(reports);
    let kept: Vec<String> = reports
        .iter_mut()
        .filter(|r| !r.is_good())
        .map(kept)
        .collect();
    panic!("{what}\n{table}\n{}", kept.join("\n"));
}

pub fn run(spec: &RunSpec) -> RunReport {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(runner::run(spec, &launcher()))
}

/// Every scenario once on `backend` (seed 1), two at a time (runs mostly wait).
/// Each must come out as it expects.
pub fn sample(backend: &str) {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut reports: Vec<RunReport> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    while let Some(s) =
                        SCENARIOS.get(next.fetch_add(1, std::sync::atomic::Ordering::SeqCst))
                    {
                        mine.push(run(&spec(backend, s.name, 1)));
                    }
                    mine
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    reports.sort_by_key(|r| r.scenario_id);
    println!("{}", leasehold_chaos::report::table(&reports));
    assert_good(
        &format!("{backend}: some scenarios did not come out as expected"),
        &mut reports,
    );
    assert!(
        reports
            .iter()
            .any(|r| matches!(r.outcome, runner::Outcome::Ran { .. })),
        "{backend}: nothing ran"
    );
}

/// Runs headless Debian `chromium` (120 s at most) with a fresh profile in `profile`.
pub fn chromium(profile: &Path, args: &[&str]) -> std::process::Output {
    let program = ["chromium", "/usr/bin/chromium"]
        .into_iter()
        .find(|p| Command::new(p).arg("--version").output().is_ok())
        .expect("chromium is not installed; ./scripts/test installs it");
    Command::new("timeout")
        .arg("120")
        .arg(program)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .output()
        .expect("chromium runs")
}

/// The DOM of the page at `path` once its scripts ran, from headless `chromium`.
pub fn chromium_dom(path: &Path) -> String {
    let profile = tempfile::tempdir().unwrap();
    let url = format!("file://{}", path.display());
    let dom = chromium(profile.path(), &["--dump-dom", &url]);
    String::from_utf8_lossy(&dom.stdout).into_owned()
}
