//! The CI sample: every scenario once on every backend, with its short schedule.
//! Each must come out as the scenario states: no violation where the backend promises
//! safety, the violation detected where it does not (and fencing still refusing stale
//! writes).
//!
//! The long run (≥ 1,000 seeded runs per backend) is documented in `docs/guarantees.md`.

mod common;

#[test]
fn sample_memory() {
    common::sample("memory");
}

#[test]
fn sample_file() {
    common::sample("file");
}

#[test]
fn sample_redis() {
    common::sample("redis");
}

#[test]
fn sample_redis_sentinel() {
    common::sample("redis-sentinel");
}

#[test]
fn sample_redis_cluster() {
    common::sample("redis-cluster");
}

#[test]
fn sample_redlock() {
    common::sample("redlock");
}

#[test]
fn sample_etcd() {
    common::sample("etcd");
}

#[test]
fn sample_zookeeper() {
    common::sample("zookeeper");
}

#[test]
fn sample_postgres() {
    common::sample("postgres");
}

/// Against the user's servers (`--url`), without a harness as in the `leasehold` command.
/// What needs no control of the servers runs, through fault proxies in front of them; the
/// rest is skipped, saying why.
#[test]
fn against_a_users_server_only_faults_that_need_no_control_run() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let redis = runtime.block_on(leasehold_testkit::Redis::start()).unwrap();
    let mut runs = Vec::new();
    for scenario in ["full-partition", "restart-empty"] {
        let mut spec = common::spec("redis", scenario, 1);
        spec.url = Some(redis.url());
        spec.harness = None;
        runs.push(common::run(&spec));
    }
    common::assert_good("full-partition against a user's server", &mut runs[..1]);
    assert!(
        matches!(
            runs[0].outcome,
            leasehold_chaos::runner::Outcome::Ran { .. }
        ),
        "{}",
        leasehold_chaos::report::table(&runs)
    );
    assert!(runs[0].stats.faults > 0);
    match &runs[1].outcome {
        leasehold_chaos::runner::Outcome::Skipped { reason } => {
            assert!(reason.contains("--url"), "{reason}");
        }
        other => panic!("restart-empty against a user's server: {other:?}"),
    }
}

/// In observe mode the resource accepts what fencing would refuse.
/// Under a double grant the stale holder's accesses get through (C1, C2), where in enforce
/// mode they were refused.
#[test]
fn observe_mode_shows_what_fencing_prevents() {
    use leasehold_chaos::checks::Check;
    use leasehold_chaos::resource::{FenceMode, Workload};
    let mut seen = Vec::new();
    let mut runs = Vec::new();
    for seed in 1..=3 {
        let mut spec = common::spec("redis", "server-clock-jump", seed);
        spec.mode = FenceMode::Observe;
        let mut observed = common::run(&spec);
        common::assert_good(
            "server-clock-jump in observe mode",
            std::slice::from_mut(&mut observed),
        );
        seen.extend(observed.caught());
        runs.push(observed);
        if seen.contains(&Check::C2) {
            break;
        }
    }
    if !(seen.contains(&Check::C5) && seen.contains(&Check::C2)) {
        common::fail(
            &format!("no double grant, or no stale access got through: {seen:?}"),
            &mut runs,
        );
    }
    // The set workload, fenced, under a paused holder: nothing acknowledged is lost.
    let mut spec = common::spec("redis", "pause-holder", 1);
    spec.workload = Workload::Set;
    let mut set = common::run(&spec);
    common::assert_good(
        "pause-holder with the set workload",
        std::slice::from_mut(&mut set),
    );
    assert!(
        set.verdict(Check::C4)
            .unwrap()
            .summary
            .contains("acknowledged appends")
    );
}
