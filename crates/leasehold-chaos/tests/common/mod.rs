//! Runs of the checker from its tests: the `leasehold-chaos` program of this build is the
//! worker and the resource.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::path::PathBuf;

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
        bug: None,
        history_dir: history_dir(),
    }
}

/// Where failing runs keep their histories: `LEASEHOLD_CHAOS_HISTORY` if set.
pub fn history_dir() -> Option<PathBuf> {
    std::env::var_os("LEASEHOLD_CHAOS_HISTORY").map(PathBuf::from)
}

pub fn run(spec: &RunSpec) -> RunReport {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(runner::run(spec, &launcher()))
}

/// Every scenario once on `backend` (seed 1), two at a time (runs mostly wait): each must
/// come out as it expects.
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
    let table = leasehold_chaos::report::table(&reports);
    println!("{table}");
    assert!(
        reports.iter().all(RunReport::is_good),
        "{backend}: some scenarios did not come out as expected\n{table}"
    );
    assert!(
        reports
            .iter()
            .any(|r| matches!(r.outcome, runner::Outcome::Ran { .. })),
        "{backend}: nothing ran"
    );
}
