//! The checker is itself tested: each deliberately broken lock variant must be caught.
//! Each (see `leasehold_chaos::bugs`) must be caught by a check within a few seeds, under
//! the scenario that exposes it, on a real Redis — and the session bugs on a real ZooKeeper
//! and a real etcd.

mod common;

use leasehold_chaos::bugs::Bug;
use leasehold_chaos::checks::{Check, Status};
use leasehold_chaos::resource::FenceMode;
use leasehold_chaos::runner::RunReport;

/// Runs `scenario` on Redis with `bug` planted until a check fails that must hold.
/// It tries seeds 1..=`seeds` and returns the checks that caught the bug; a check fails
/// that the scenario says must hold.
fn caught(bug: Bug, scenario: &str, seeds: u64) -> Vec<Check> {
    caught_in(bug, scenario, seeds, FenceMode::Enforce)
}

/// As [`caught`], with the resource in `mode`.
/// In observe mode a stale holder's writes are accepted, so it goes on holding (and
/// renewing) where a refused write would have ended its hold.
fn caught_in(bug: Bug, scenario: &str, seeds: u64, mode: FenceMode) -> Vec<Check> {
    caught_on("redis", bug, scenario, seeds, mode)
}

/// As [`caught_in`], on `backend`.
fn caught_on(backend: &str, bug: Bug, scenario: &str, seeds: u64, mode: FenceMode) -> Vec<Check> {
    let mut missed: Vec<RunReport> = Vec::new();
    for seed in 1..=seeds {
        let mut spec = common::spec(backend, scenario, seed);
        spec.bug = Some(bug.name().to_owned());
        spec.mode = mode;
        let report = common::run(&spec);
        let failed: Vec<Check> = report
            .verdicts()
            .iter()
            .filter(|v| matches!(v.status, Status::Fail))
            .map(|v| v.check)
            .collect();
        if !failed.is_empty() {
            return failed;
        }
        missed.push(report);
    }
    common::fail(
        &format!(
            "planted bug {} was not caught in {seeds} seeds of {scenario} on {backend}",
            bug.name()
        ),
        &mut missed,
    );
}

#[test]
fn a_release_without_owner_check_is_caught() {
    // Releases under foreign owner ids delete the holder's key.
    let checks = caught(Bug::ReleaseAny, "non-owner-release", 3);
    assert!(checks.contains(&Check::C8), "{checks:?}");
}

#[test]
fn a_renewal_without_compare_is_caught() {
    // The server forgets the holder (its key expires early); the holder's renewal is
    // told "renewed" and it goes on as if it held.
    let checks = caught_in(Bug::RenewAny, "server-clock-jump", 3, FenceMode::Observe);
    assert!(checks.contains(&Check::C9), "{checks:?}");
}

#[test]
fn deadlines_on_the_wall_clock_are_caught() {
    // The holder's wall clock jumps back an hour: its deadline moves with it.
    let checks = caught(Bug::WallClock, "client-clock-jump", 3);
    assert!(checks.contains(&Check::C9), "{checks:?}");
}

#[test]
fn validity_counted_from_the_reply_is_caught() {
    // A grant whose round trip exceeds the lease is trusted for a whole lease after it
    // arrives.
    let checks = caught(Bug::ValidityFromReply, "delayed-grant-reply", 3);
    assert!(checks.contains(&Check::C9), "{checks:?}");
}

#[test]
fn a_new_owner_id_on_retry_is_caught() {
    // The grant whose reply was lost is never adopted nor released.
    let checks = caught(Bug::NewOwnerOnRetry, "lost-grant-reply", 3);
    assert!(checks.contains(&Check::C10), "{checks:?}");
}

#[test]
fn a_watchdog_ignoring_not_owner_is_caught() {
    // The server forgot the holder; "not owner" is retried as if the link had failed.
    let checks = caught_in(
        Bug::IgnoreNotOwner,
        "server-clock-jump",
        3,
        FenceMode::Observe,
    );
    assert!(checks.contains(&Check::C9), "{checks:?}");
}

#[test]
fn tokens_from_a_counter_in_each_client_are_caught() {
    // Two workers hand out the same tokens, and a later grant has a lower one.
    let checks = caught(Bug::LocalToken, "latency-jitter", 3);
    assert!(checks.contains(&Check::C3), "{checks:?}");
}

// The session bugs are planted in the backend, below the recorder: the history records the
// session deadline the buggy backend counts on, so only the server's own bound (which the
// backend reports beside it) can show that a guard outlived its session. The scenario
// slows the holder's link, then cuts it past the session timeout while the holder is at
// work.

#[test]
fn a_session_deadline_counted_from_the_reply_is_caught_on_zookeeper() {
    // The last keep-alive answered before the cut came back a quarter of the session
    // timeout after it was sent: counted from the answer, the session outlives the
    // server's bound by that much.
    let checks = caught_on(
        "zookeeper",
        Bug::SessionDeadlineFromReply,
        "session-disconnect",
        3,
        FenceMode::Enforce,
    );
    assert!(checks.contains(&Check::C9), "{checks:?}");
}

#[test]
fn a_session_deadline_counted_from_the_reply_is_caught_on_etcd() {
    let checks = caught_on(
        "etcd",
        Bug::SessionDeadlineFromReply,
        "session-disconnect",
        3,
        FenceMode::Enforce,
    );
    assert!(checks.contains(&Check::C9), "{checks:?}");
}

#[test]
fn a_session_that_ignores_a_missed_keep_alive_is_caught_on_zookeeper() {
    // Cut off past the session timeout, the holder's keep-alives go unanswered; counted
    // as answered, its session never ends.
    let checks = caught_on(
        "zookeeper",
        Bug::IgnoreMissedKeepAlive,
        "session-disconnect",
        3,
        FenceMode::Enforce,
    );
    assert!(checks.contains(&Check::C9), "{checks:?}");
}

#[test]
fn a_session_that_ignores_a_missed_keep_alive_is_caught_on_etcd() {
    let checks = caught_on(
        "etcd",
        Bug::IgnoreMissedKeepAlive,
        "session-disconnect",
        3,
        FenceMode::Enforce,
    );
    assert!(checks.contains(&Check::C9), "{checks:?}");
}
