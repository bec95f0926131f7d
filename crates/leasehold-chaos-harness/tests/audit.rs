//! `leasehold audit` on the checker's own runs.
//! The workers write their lock events (as `run --events` does on a host), the audit reads
//! them, and its findings are held against the checker's verdicts: the double grant a
//! planted bug causes is found, a stale access the resource let through is found, and runs
//! that keep every promise raise no alarm.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use leasehold_chaos::audit::follow::follow;
use leasehold_chaos::audit::{Audit, Spec};
use leasehold_chaos::bugs::Bug;
use leasehold_chaos::checks::{Check, Status, Verdict};
use leasehold_chaos::resource::FenceMode;
use leasehold_chaos::runner::{Outcome, skewed_offset_ms};

/// Runs `scenario` on Redis with `seed` (and `bug`, if any) under a live audit.
/// Its workers and its resource write events while `leasehold audit --follow` reads them
/// from the run's directory (a host per process, as they appear). It returns the checker's
/// failed checks and the audit (clocks of one host: ±1 ms), the run's page of timelines
/// written to `html`.
fn run_and_audit(scenario: &str, seed: u64, bug: Option<Bug>, html: &Path) -> (Vec<Check>, Audit) {
    let audited = Case::new(scenario, seed, bug).audit(html);
    let failed = audited
        .verdicts
        .iter()
        .filter(|v| matches!(v.status, Status::Fail))
        .map(|v| v.check)
        .collect();
    (failed, audited.found)
}

/// One chaos run on Redis to audit live (see [`run_and_audit`]).
struct Case<'a> {
    scenario: &'a str,
    seed: u64,
    bug: Option<Bug>,
    /// The resource's fence.
    mode: FenceMode,
    /// How far from the real time the workers' clocks start.
    /// It is the audit's clock uncertainty too (else 1 ms: one host's clocks).
    clock_skew: Option<Duration>,
    /// The lease, instead of the backend's.
    ttl: Option<Duration>,
}

/// What a [`Case`] gave: every verdict of the checker, the live audit, and the events.
struct Audited {
    verdicts: Vec<Verdict>,
    found: Audit,
    /// The run's event files (kept until this is dropped).
    files: Vec<PathBuf>,
    _events: tempfile::TempDir,
}

impl<'a> Case<'a> {
    fn new(scenario: &'a str, seed: u64, bug: Option<Bug>) -> Self {
        Case {
            scenario,
            seed,
            bug,
            mode: FenceMode::Enforce,
            clock_skew: None,
            ttl: None,
        }
    }

    /// Runs it under a live audit; the audit's page of timelines is written to `html`.
    fn audit(&self, html: &Path) -> Audited {
        let (scenario, seed) = (self.scenario, self.seed);
        let dir = tempfile::tempdir().unwrap();
        let mut spec = common::spec("redis", scenario, seed);
        spec.mode = self.mode;
        spec.bug = self.bug.map(|bug| bug.name().to_owned());
        spec.events_dir = Some(dir.path().to_path_buf());
        spec.clock_skew = self.clock_skew;
        spec.ttl = self.ttl;
        let run_dir = dir.path().join(format!("redis-{scenario}-{seed}"));
        std::fs::create_dir_all(&run_dir).unwrap();
        let uncertainty_ms = self.clock_skew.map_or(1, |skew| skew.as_millis() as u64);
        let mut audit_spec = Spec::new(vec![run_dir.clone()], uncertainty_ms);
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
        let mut files: Vec<PathBuf> = std::fs::read_dir(&run_dir)
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .collect();
        files.sort();
        Audited {
            verdicts: report.verdicts().to_vec(),
            found,
            files,
            _events: dir,
        }
    }
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
    let mut unanswered = 0;
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
        unanswered += found.events.get("unanswered").copied().unwrap_or(0);
        assert!(
            found.findings.is_empty(),
            "{scenario}: false alarms {:?}",
            found.findings
        );
    }
    // Acquires went unanswered, and each was resolved: no `unresolved` among the findings.
    // Whether a request is in flight when a fault hits depends on timing (a waiter between
    // two attempts has none), so this counts them over all the runs, where replies were
    // held past the request timeout, delayed by up to a lease, or reset.
    assert!(unanswered > 0, "no acquire went unanswered in any run");
}

#[test]
fn the_audit_finds_a_stale_access_the_resource_let_through() {
    // A renewal that extends whoever holds keeps a holder whose lease the server's clock
    // jump ended; it writes with its old token after the next holder's writes, and a fence
    // that only observes accepts it. The resource's access events show it.
    for seed in 1..=3 {
        let html = tempfile::NamedTempFile::new().unwrap();
        let Audited {
            verdicts, found, ..
        } = Case {
            mode: FenceMode::Observe,
            ..Case::new("server-clock-jump", seed, Some(Bug::RenewAny))
        }
        .audit(html.path());
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
fn the_audit_finds_tokens_that_went_backwards() {
    // Each worker numbers its grants from a counter of its own: the second worker to be
    // granted the lock gets a token the first already had.
    for seed in 1..=3 {
        let html = tempfile::NamedTempFile::new().unwrap();
        let (failed, found) =
            run_and_audit("latency-jitter", seed, Some(Bug::LocalToken), html.path());
        if !failed.contains(&Check::C3) {
            continue;
        }
        let checks: Vec<&str> = found.findings.iter().map(|f| f.check).collect();
        assert!(
            checks.contains(&"token_order"),
            "the checker failed {failed:?}; the audit found {:?}",
            found.findings
        );
        return;
    }
    panic!("the checker found no tokens out of order in 3 seeds of per-client counters");
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

#[test]
fn the_audit_judges_clocks_seconds_apart_within_their_uncertainty() {
    // The workers' wall clocks start a second behind, a second ahead and on time
    // (libfaketime): two hosts differ by up to 2 s, as an NTP estimate of ±1 s allows.
    let skew = Duration::from_secs(1);
    let html = tempfile::NamedTempFile::new().unwrap();
    // Runs with a release of another's lock, and a 10 s lease so that holds last seconds.
    // The overlaps that really were are those of the events with each host's skew taken
    // off, audited as from one exact clock. Nothing else is found: no hand-off is taken
    // for an overlap (read as if the clocks agreed, the same events show some: the skew is
    // real). Each real one is found that, measured on the hosts' own clocks (the same
    // events read as if the clocks agreed), outlasts twice the uncertainty (the audit's
    // slack), up to rounding (5 ms). Measured so, an overlap is shorter than it was by up
    // to how far apart the two holders' clocks are, whichever is ahead (the second's, when
    // the first hold ends first; the first's, when the second lies within the first, as
    // when the first holder was paused). Whether a run has an overlap that long depends on
    // when a rogue release hits the paused holder and on the machine's load: most seeds.
    let ttl = Some(Duration::from_secs(10));
    let mut skew_seen = false;
    for seed in 1..=8 {
        let buggy = Case {
            clock_skew: Some(skew),
            ttl,
            ..Case::new("non-owner-release", seed, Some(Bug::ReleaseAny))
        }
        .audit(html.path());
        let true_times = tempfile::tempdir().unwrap();
        let unskewed = buggy
            .files
            .iter()
            .map(|file| unskew(file, skew, true_times.path()))
            .collect();
        let real = leasehold_chaos::audit::audit(&Spec::new(unskewed, 0)).unwrap();
        let double_grants = |audit: &Audit| -> Vec<(Vec<(String, u64)>, u64)> {
            (audit.findings.iter())
                .filter(|f| f.check == "double_grant")
                .map(|f| (holders_in(&f.detail), f.overlap_ms))
                .collect()
        };
        let tokens = |holders: &[(String, u64)]| holders.iter().map(|h| h.1).collect::<Vec<_>>();
        let may: BTreeSet<Vec<u64>> = (double_grants(&real).iter())
            .map(|(holders, _)| tokens(holders))
            .collect();
        let found: BTreeSet<Vec<u64>> = (double_grants(&buggy.found).iter())
            .map(|(holders, _)| tokens(holders))
            .collect();
        // With 1 ms of uncertainty the reported overlap is the measured one less 2 ms.
        let misread = leasehold_chaos::audit::audit(&Spec::new(buggy.files.clone(), 1)).unwrap();
        let must: BTreeSet<Vec<u64>> = double_grants(&misread)
            .into_iter()
            .filter(|(_, overlap_ms)| overlap_ms + 2 > 2 * 1_000 + 5)
            .map(|(holders, _)| tokens(&holders))
            .filter(|pair| may.contains(pair))
            .collect();
        skew_seen |=
            (double_grants(&misread).iter()).any(|(holders, _)| !may.contains(&tokens(holders)));
        assert!(
            found.is_subset(&may),
            "invented: {:?} (real: {may:?})",
            found.difference(&may).collect::<Vec<_>>()
        );
        if must.is_empty() {
            continue;
        }
        assert!(
            must.is_subset(&found),
            "missed: {:?} (found: {found:?}; {} events read late, hosts {:?}; real: {:?})",
            must.difference(&found).collect::<Vec<_>>(),
            buggy.found.late,
            buggy.found.hosts,
            real.findings
        );
        assert!(
            skew_seen,
            "read as if the clocks agreed, no hand-off looked like an overlap"
        );
        return;
    }
    panic!("no overlap long enough to be certain in 8 seeds of a release without owner check");
}

/// A copy of the events `file` in `dir`, its times moved back by its host's clock skew.
/// Worker process `wN`'s clock started [`skewed_offset_ms`]`(N - 1, skew)` from the real time;
/// the resource's is real.
fn unskew(file: &Path, skew: Duration, dir: &Path) -> PathBuf {
    let name = file.file_name().unwrap().to_str().unwrap();
    let offset_ms = host_offset_ms(name.trim_end_matches(".jsonl"), skew);
    // A line cut short (a worker killed while writing) is left out, as the audit skips it.
    let lines: Vec<String> = std::fs::read_to_string(file)
        .unwrap()
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .map(|mut event| {
            for key in ["at_ms", "steady_ms", "sent_ms", "session_until_ms"] {
                if let Some(ms) = event[key].as_i64() {
                    event[key] = (ms - offset_ms).into();
                }
            }
            event.to_string()
        })
        .collect();
    let copy = dir.join(name);
    std::fs::write(&copy, lines.join("\n")).unwrap();
    copy
}

/// How far host `host`'s clock was from the real time, in ms (see [`unskew`]).
/// A worker process's host is `wN.<incarnation>`; the resource's clock is real.
fn host_offset_ms(host: &str, skew: Duration) -> i64 {
    match host
        .strip_prefix('w')
        .and_then(|rest| rest.split('.').next())
    {
        Some(n) => skewed_offset_ms(n.parse::<usize>().unwrap() - 1, skew),
        None => 0,
    }
}

/// The holders a double-grant finding names (host and token), by token.
/// Its detail reads `HOST token N (OWNER) and HOST token N (OWNER) held it together …`.
fn holders_in(detail: &str) -> Vec<(String, u64)> {
    let mut holders: Vec<(String, u64)> = detail
        .split(" and ")
        .filter_map(|part| {
            let mut words = part.split(' ');
            let host = words.next()?.to_owned();
            (words.next()? == "token").then_some(())?;
            Some((host, words.next()?.parse().ok()?))
        })
        .collect();
    holders.sort_by_key(|h| h.1);
    holders
}

#[test]
fn a_run_into_an_events_directory_with_an_earlier_runs_events_is_refused() {
    // Appended to, one record would hold two runs' tokens: an audit of nothing that
    // happened.
    let dir = tempfile::tempdir().unwrap();
    let mut spec = common::spec("redis", "pause-holder", 1);
    spec.events_dir = Some(dir.path().to_path_buf());
    let run_dir = dir.path().join("redis-pause-holder-1");
    std::fs::create_dir_all(&run_dir).unwrap();
    std::fs::write(run_dir.join("w1.0.jsonl"), "{}\n").unwrap();
    let report = common::run(&spec);
    match &report.outcome {
        Outcome::Error { message, .. } => {
            assert!(message.contains("events of an earlier run"), "{message}");
        }
        other => panic!("the run was made: {other:?}"),
    }
    let left = std::fs::read_to_string(run_dir.join("w1.0.jsonl")).unwrap();
    assert_eq!(left, "{}\n", "the earlier record was written to");
}
