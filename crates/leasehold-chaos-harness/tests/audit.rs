//! `leasehold audit` on the checker's own runs.
//! The workers write their lock events (as `run --events` does on a host), the audit reads
//! them, and its findings are held against the checker's verdicts: the double grant a
//! planted bug causes is found, a stale access the resource let through is found, and runs
//! that keep every promise raise no alarm.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use std::path::Path;

use leasehold_chaos::audit::follow::follow;
use leasehold_chaos::audit::{Audit, Spec};
use leasehold_chaos::bugs::Bug;
use leasehold_chaos::checks::{Check, Status, Verdict};
use leasehold_chaos::resource::FenceMode;

/// Runs `scenario` on Redis with `seed` (and `bug`, if any) under a live audit.
/// Its workers and its resource write events while `leasehold audit --follow` reads them
/// from the run's directory (a host per process, as they appear). It returns the checker's
/// failed checks and the audit (clocks of one host: ±1 ms), the run's page of timelines
/// written to `html`.
fn run_and_audit(scenario: &str, seed: u64, bug: Option<Bug>, html: &Path) -> (Vec<Check>, Audit) {
    let (verdicts, found) = run_and_audit_in(FenceMode::Enforce, scenario, seed, bug, html);
    let failed = verdicts
        .iter()
        .filter(|v| matches!(v.status, Status::Fail))
        .map(|v| v.check)
        .collect();
    (failed, found)
}

/// [`run_and_audit`] with the resource's fence in `mode`; every verdict of the checker.
fn run_and_audit_in(
    mode: FenceMode,
    scenario: &str,
    seed: u64,
    bug: Option<Bug>,
    html: &Path,
) -> (Vec<Verdict>, Audit) {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = common::spec("redis", scenario, seed);
    spec.mode = mode;
    spec.bug = bug.map(|bug| bug.name().to_owned());
    spec.events_dir = Some(dir.path().to_path_buf());
    let run_dir = dir.path().join(format!("redis-{scenario}-{seed}"));
    std::fs::create_dir_all(&run_dir).unwrap();
    let mut audit_spec = Spec::new(vec![run_dir], 1);
    audit_spec.timeline_ms = Some(10_000);
    audit_spec.html = Some(html.to_path_buf());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let live = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(follow(
            &audit_spec,
            async {
                let _ = stopped.await;
            },
            |_| {},
        ))
    });
    let report = common::run(&spec);
    stop.send(()).unwrap();
    let found = live.join().unwrap().unwrap();
    assert!(
        found.hosts.len() >= 2,
        "{scenario}: the audit saw {:?}",
        found.hosts
    );
    (report.verdicts().to_vec(), found)
}

#[test]
fn the_audit_finds_the_double_grant_of_a_release_without_owner_check() {
    // A release that deletes whoever holds lets a second holder in beside the first.
    let pages = tempfile::tempdir().unwrap();
    for seed in 1..=3 {
        let html = pages.path().join(format!("audit-{seed}.html"));
        let (failed, found) =
            run_and_audit("non-owner-release", seed, Some(Bug::ReleaseAny), &html);
        if failed.is_empty() {
            continue;
        }
        let checks: Vec<&str> = found.findings.iter().map(|f| f.check).collect();
        assert!(
            checks.contains(&"double_grant"),
            "the checker failed {failed:?}; the audit found {:?}",
            found.findings
        );
        // The page draws each finding's timeline in a real browser: lanes, the finding.
        let dom = common::chromium_dom(&html);
        assert!(!dom.contains("data-error"), "a script error:\n{dom}");
        let drawn = found.findings.len().min(100);
        assert_eq!(dom.matches("class=\"violation\"").count(), drawn, "{dom}");
        assert!(dom.matches("class=\"hold\"").count() >= 2, "{dom}");
        return;
    }
    panic!("the planted bug was not caught by the checker in 3 seeds");
}

#[test]
fn the_audit_raises_no_alarm_where_every_promise_was_kept() {
    for scenario in [
        "pause-holder",
        "latency-jitter",
        "holder-crash",
        "unknown-outcome",
        "delayed-grant-reply",
        "lost-grant-reply",
    ] {
        let html = tempfile::NamedTempFile::new().unwrap();
        let (failed, found) = run_and_audit(scenario, 1, None, html.path());
        assert!(
            failed.is_empty(),
            "{scenario}: the checker failed {failed:?}"
        );
        assert!(
            found.events.get("granted").copied().unwrap_or(0) > 0,
            "{scenario}: nothing was granted: {:?}",
            found.events
        );
        assert!(
            found.events.get("access").copied().unwrap_or(0) > 0,
            "{scenario}: the resource's accesses were not seen: {:?}",
            found.events
        );
        assert!(
            found.findings.is_empty(),
            "{scenario}: false alarms {:?}",
            found.findings
        );
    }
}

#[test]
fn the_audit_finds_a_stale_access_the_resource_let_through() {
    // A renewal that extends whoever holds keeps a holder whose lease the server's clock
    // jump ended; it writes with its old token after the next holder's writes, and a fence
    // that only observes accepts it. The resource's access events show it.
    for seed in 1..=3 {
        let html = tempfile::NamedTempFile::new().unwrap();
        let (verdicts, found) = run_and_audit_in(
            FenceMode::Observe,
            "server-clock-jump",
            seed,
            Some(Bug::RenewAny),
            html.path(),
        );
        let stale = |v: &Verdict| v.check == Check::C2 && !v.violations.is_empty();
        let Some(c2) = verdicts.iter().find(|v| stale(v)) else {
            continue;
        };
        let checks: Vec<&str> = found.findings.iter().map(|f| f.check).collect();
        assert!(
            checks.contains(&"stale_access"),
            "the checker found {}; the audit found {:?}",
            c2.summary,
            found.findings
        );
        return;
    }
    panic!("the checker found no stale access in 3 seeds behind an observing fence");
}

#[test]
fn the_audit_follows_steady_clocks_through_wall_clock_jumps() {
    // The workers' wall clocks jump an hour back and forth (libfaketime); their steady
    // clocks do not. Read by the wall clock, holds would stretch over hours and overlap.
    let html = tempfile::NamedTempFile::new().unwrap();
    let (failed, found) = run_and_audit("client-clock-jump", 1, None, html.path());
    assert!(failed.is_empty(), "the checker failed {failed:?}");
    assert!(
        found.events.get("granted").copied().unwrap_or(0) > 0,
        "nothing was granted: {:?}",
        found.events
    );
    assert!(
        !found.clock_steps.is_empty(),
        "no step of a wall clock was seen: {found:?}"
    );
    assert!(
        found.findings.is_empty(),
        "false alarms {:?}",
        found.findings
    );
}
