//! The checks C1–C10 of `safety.md`: each a function over a history, each with a named verdict.
//!
//! A check finds violations (with when and who, for the report's timeline) and maybe a
//! measure; a scenario says per check whether it must hold, must be violated (the fault
//! is a documented weakness of the backend, and the checker must see it), or may go either
//! way. [`judge`] turns the two into a [`Status`].

mod facts;
mod fence;
mod grants;
mod linear;
mod timing;

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::history::History;

pub use facts::{Facts, Grant, Record, RunInfo};
pub use linear::{LeaseMutex, LockCall, LockOp};

/// One of the checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Check {
    /// C1: the tokens the resource accepted never go backwards, and one token means one owner.
    C1,
    /// C2: no stale access acknowledged.
    /// None is accepted after an access with a higher token had been acknowledged.
    C2,
    /// C3: grants' tokens are unique and increase in real time.
    C3,
    /// C4: no acknowledged write lost.
    C4,
    /// C5: no overlapping server-side grants.
    C5,
    /// C6: no two workers believed they held the lock at the same time (measured).
    C6,
    /// C7: the lock history is linearizable against a fenced lease mutex.
    C7,
    /// C8: no release removed another's lock.
    C8,
    /// C9: loss noticed before the server could re-grant; recovery within TTL + lock-delay.
    C9,
    /// C10: nothing left behind.
    C10,
}

impl Check {
    /// Every check, in order.
    pub const ALL: [Check; 10] = [
        Check::C1,
        Check::C2,
        Check::C3,
        Check::C4,
        Check::C5,
        Check::C6,
        Check::C7,
        Check::C8,
        Check::C9,
        Check::C10,
    ];

    /// A short name.
    pub fn name(self) -> &'static str {
        match self {
            Check::C1 => "fence-order",
            Check::C2 => "stale-access",
            Check::C3 => "token-order",
            Check::C4 => "lost-writes",
            Check::C5 => "double-grant",
            Check::C6 => "perceived-overlap",
            Check::C7 => "linearizable",
            Check::C8 => "release-safety",
            Check::C9 => "loss-timing",
            Check::C10 => "nothing-left",
        }
    }

    /// What it checks, in a sentence.
    pub fn describe(self) -> &'static str {
        match self {
            Check::C1 => "tokens accepted by the resource never go backwards; one token, one owner",
            Check::C2 => "no access acknowledged after one with a higher token was",
            Check::C3 => "grants' tokens are unique and increase in real time",
            Check::C4 => "every acknowledged write is in the final state",
            Check::C5 => "no two owners held the lock at once by the server's own promises",
            Check::C6 => "no two workers believed they held the lock at once",
            Check::C7 => "the backend's answers are linearizable against a fenced lease mutex",
            Check::C8 => "no release removed another owner's lock",
            Check::C9 => {
                "loss noticed before the server could re-grant; recovery within TTL + lock-delay"
            }
            Check::C10 => "unknown outcomes resolved; no holder or waiter left after the run",
        }
    }

    /// Parses `C5` or `double-grant`.
    pub fn parse(text: &str) -> Option<Check> {
        Check::ALL
            .into_iter()
            .find(|c| c.to_string().eq_ignore_ascii_case(text) || c.name() == text)
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

/// One violation: when, who, what.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    /// When (collector time, µs).
    pub t: u64,
    /// Until when, for violations that last (an overlap).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<u64>,
    /// The processes involved.
    pub processes: Vec<String>,
    /// What happened.
    pub message: String,
}

impl Violation {
    fn at(t: u64, processes: &[&str], message: impl Into<String>) -> Self {
        Self {
            t,
            until: None,
            processes: processes.iter().map(|p| (*p).to_owned()).collect(),
            message: message.into(),
        }
    }

    fn during(t: u64, until: u64, processes: &[&str], message: impl Into<String>) -> Self {
        Self {
            until: Some(until),
            ..Self::at(t, processes, message)
        }
    }
}

/// What a check found.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Finding {
    /// Violations found.
    pub violations: Vec<Violation>,
    /// Why the run cannot pass this check whatever the scenario expects.
    /// Nothing to check although workers ran (no grant, no guard, no access, no release, no
    /// final look), or records it needs without a token or an owner. A check never passes
    /// by having looked at nothing.
    pub broken: Vec<Violation>,
    /// A figure (`longest overlap 312 ms`, `3 stale writes refused`).
    pub measure: Option<String>,
    /// Why the check does not apply to this history, if it does not.
    pub not_applicable: Option<String>,
    /// The check could not decide (the linearizability search ran out of budget).
    pub undecided: Option<String>,
}

impl Finding {
    fn measured(violations: Vec<Violation>, measure: impl Into<String>) -> Self {
        Self {
            violations,
            measure: Some(measure.into()),
            ..Self::default()
        }
    }

    fn not_applicable(reason: impl Into<String>) -> Self {
        Self {
            not_applicable: Some(reason.into()),
            ..Self::default()
        }
    }

    /// Nothing to check: a failure if anything ran, not applicable if nothing did.
    /// `what` is missing from a run; a history in which nothing ran has nothing to check.
    fn nothing(facts: &Facts, what: &str) -> Self {
        if !facts.ran {
            return Self::not_applicable("nothing ran");
        }
        let workers = facts.workers.len();
        Self {
            broken: vec![Violation::at(
                0,
                &[],
                format!("{what} although {workers} worker(s) took part: nothing to check"),
            )],
            ..Self::default()
        }
    }

    /// Broken as [`Finding::nothing`] says if `empty`, otherwise as it is.
    /// `empty`: `what` is missing from a run in which workers took part.
    fn unless_empty(self, facts: &Facts, empty: bool, what: &str) -> Self {
        if !empty || !(facts.ran || self.violations.is_empty()) {
            return self;
        }
        let nothing = Self::nothing(facts, what);
        Self {
            not_applicable: nothing.not_applicable,
            ..self
        }
        .breaking(nothing.broken)
    }

    /// With `broken` added.
    fn breaking(mut self, broken: impl IntoIterator<Item = Violation>) -> Self {
        self.broken.extend(broken);
        self
    }
}

/// What a scenario expects of a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Expect {
    /// Must hold.
    Hold,
    /// Must be violated, and the checker must see it (a documented weakness).
    Violate,
    /// May go either way (a documented weakness that the fault need not always trigger).
    Either,
}

/// A check's verdict on one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Held, as it must (or as it may).
    Pass,
    /// Violated though it must hold: a bug.
    Fail,
    /// Violated as expected, and detected.
    Detected,
    /// Expected to be violated, but no violation was seen.
    /// The scenario or the checker failed to show the weakness.
    Missed,
    /// Violated where the scenario allows it.
    Tolerated,
    /// Does not apply to this backend or history.
    Skipped,
    /// Could not be decided.
    Undecided,
}

impl Status {
    /// Whether the run is good on this check.
    pub fn is_good(self) -> bool {
        matches!(
            self,
            Status::Pass | Status::Detected | Status::Tolerated | Status::Skipped
        )
    }

    /// The table's symbol.
    pub fn symbol(self) -> &'static str {
        match self {
            Status::Pass => "✔",
            Status::Fail => "✘",
            Status::Detected => "⚑",
            Status::Missed => "✘?",
            Status::Tolerated => "~",
            Status::Skipped => "·",
            Status::Undecided => "?",
        }
    }
}

/// A check's verdict, with its evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// Which check.
    pub check: Check,
    /// The verdict.
    pub status: Status,
    /// What the scenario expected.
    pub expected: Expect,
    /// One line: the measure, the first violation, or why it was skipped.
    pub summary: String,
    /// Every violation found.
    pub violations: Vec<Violation>,
}

/// Combines a finding with what was expected.
/// A broken finding (see [`Finding::broken`]) fails whatever was expected: an expected
/// violation is not "detected" by a check that had nothing to look at.
pub fn judge(check: Check, finding: Finding, expected: Expect) -> Verdict {
    if let Some(first) = finding.broken.first() {
        let summary = format!(
            "cannot pass: {}{}",
            first.message,
            match finding.broken.len() {
                1 => String::new(),
                n => format!(" (and {} more)", n - 1),
            }
        );
        let mut violations = finding.broken;
        violations.extend(finding.violations);
        return Verdict {
            check,
            status: Status::Fail,
            expected,
            summary,
            violations,
        };
    }
    let found = !finding.violations.is_empty();
    let status = if finding.not_applicable.is_some() {
        Status::Skipped
    } else if finding.undecided.is_some() && !found {
        Status::Undecided
    } else {
        match (expected, found) {
            (Expect::Hold, false) | (Expect::Either, false) => Status::Pass,
            (Expect::Hold, true) => Status::Fail,
            (Expect::Violate, true) => Status::Detected,
            (Expect::Violate, false) => Status::Missed,
            (Expect::Either, true) => Status::Tolerated,
        }
    };
    let count = finding.violations.len();
    let summary = if let Some(reason) = &finding.not_applicable {
        reason.clone()
    } else if let Some(why) = finding.undecided.as_ref().filter(|_| !found) {
        why.clone()
    } else {
        let first = finding
            .violations
            .first()
            .map(|v| format!("{count} violation(s); first: {}", v.message));
        match (first, finding.measure) {
            (Some(first), Some(measure)) => format!("{first} ({measure})"),
            (Some(first), None) => first,
            (None, Some(measure)) => measure,
            (None, None) => "ok".into(),
        }
    };
    Verdict {
        check,
        status,
        expected,
        summary,
        violations: finding.violations,
    }
}

/// Runs one check over `history`.
pub fn run(check: Check, history: &History, facts: &Facts) -> Finding {
    match check {
        Check::C1 => fence::c1_fence_order(history, facts),
        Check::C2 => fence::c2_stale_access(history, facts),
        Check::C3 => grants::c3_token_order(facts),
        Check::C4 => fence::c4_lost_writes(history, facts),
        Check::C5 => grants::c5_double_grant(history, facts),
        Check::C6 => timing::c6_perceived_overlap(facts),
        Check::C7 => linear::c7_linearizable(history, facts),
        Check::C8 => grants::c8_release_safety(history, facts),
        Check::C9 => timing::c9_loss_timing(history, facts),
        Check::C10 => grants::c10_nothing_left(history, facts),
    }
}

/// Runs every check; `expect` says what the scenario expects of each.
pub fn run_all(history: &History, expect: impl Fn(Check) -> Expect) -> Vec<Verdict> {
    let facts = Facts::new(history);
    Check::ALL
        .into_iter()
        .map(|check| judge(check, run(check, history, &facts), expect(check)))
        .collect()
}

/// Milliseconds, for messages.
pub(crate) fn ms(us: u64) -> String {
    if us == u64::MAX {
        "∞".into()
    } else {
        format!("{:.1} ms", us as f64 / 1000.0)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::history::{Event, Expiry, Kind, Phase};

    fn judged(events: Vec<Event>, expect: impl Fn(Check) -> Expect) -> Vec<Verdict> {
        run_all(&History::from_events(events), expect)
    }

    fn started() -> Vec<Event> {
        let mut h = vec![
            Event::new("runner", Kind::Start, Phase::Info)
                .value(json!({"backend": "redis", "scenario": "pause-holder", "seed": 1})),
        ];
        for w in ["w1", "w2", "w3"] {
            h.push(Event::new(w, Kind::Start, Phase::Info).at(10));
        }
        h
    }

    /// An acquire by `w` for `owner`, answered granted with `token` (either may be missing).
    fn granted(w: &str, op: u64, owner: Option<&str>, t: u64, token: Option<u64>) -> [Event; 2] {
        let mut invoke = Event::new(w, Kind::Acquire, Phase::Invoke)
            .op(op)
            .lock("l")
            .at(t);
        invoke.owner = owner.map(str::to_owned);
        let mut done = Event::new(w, Kind::Acquire, Phase::Ok)
            .op(op)
            .answer("granted")
            .expiry(Expiry::After { us: 1_000_000 })
            .at(t + 10);
        done.token = token;
        [invoke, done]
    }

    fn status(verdicts: &[Verdict], check: Check) -> (Status, &str) {
        let v = verdicts.iter().find(|v| v.check == check).unwrap();
        (v.status, &v.summary)
    }

    #[test]
    fn a_run_in_which_nothing_was_granted_fails_every_check() {
        // Three workers asked, and the server never granted: every check has nothing to
        // look at. C5 was expected to see a double grant: not seeing one is no detection.
        let mut h = started();
        for w in ["w1", "w2", "w3"] {
            h.push(
                Event::new(w, Kind::Lock, Phase::Invoke)
                    .op(1)
                    .lock("l")
                    .at(20),
            );
            h.push(
                Event::new(w, Kind::Lock, Phase::Fail)
                    .op(1)
                    .answer("busy")
                    .at(30),
            );
        }
        let verdicts = judged(h, |c| {
            if c == Check::C5 {
                Expect::Violate
            } else {
                Expect::Hold
            }
        });
        for v in &verdicts {
            assert_eq!(v.status, Status::Fail, "{}: {}", v.check, v.summary);
            assert!(
                v.summary.contains("nothing to check"),
                "{}: {}",
                v.check,
                v.summary
            );
        }
    }

    #[test]
    fn records_without_a_token_or_an_owner_fail_the_checks_that_need_them() {
        // A real double grant (C5 expected to see it), and a grant answered without a
        // token: the run is broken, not a detection.
        let mut h = started();
        h.extend(granted("w1", 1, Some("a"), 0, Some(5)));
        h.extend(granted("w2", 1, Some("b"), 100, Some(6)));
        h.extend(granted("w3", 1, Some("c"), 200, None));
        let expect = |c| {
            if c == Check::C5 {
                Expect::Violate
            } else {
                Expect::Hold
            }
        };
        let verdicts = judged(h, expect);
        for c in [Check::C3, Check::C5] {
            let (s, summary) = status(&verdicts, c);
            assert_eq!(s, Status::Fail, "{c}: {summary}");
            assert!(summary.contains("without a token"), "{c}: {summary}");
        }
        // A grant without an owner.
        let mut ownerless = started();
        ownerless.extend(granted("w1", 1, None, 0, Some(5)));
        let verdicts = judged(ownerless, expect);
        let (s, summary) = status(&verdicts, Check::C3);
        assert_eq!(s, Status::Fail, "{summary}");
        assert!(summary.contains("without an owner"), "{summary}");
        // A grant without an expiry: C9 could not tell when it ended.
        let mut timeless = started();
        let mut grant = granted("w1", 1, Some("a"), 0, Some(5));
        grant[1].expiry = None;
        timeless.extend(grant);
        let verdicts = judged(timeless, expect);
        let (s, summary) = status(&verdicts, Check::C5);
        assert_eq!(s, Status::Fail, "{summary}");
        assert!(summary.contains("without an expiry"), "{summary}");
        // A guard without a token; a write accepted without a token, under an owner no
        // guard had.
        let mut guards = started();
        guards.extend(granted("w1", 1, Some("a"), 0, Some(5)));
        guards.push(
            Event::new("w1", Kind::Lock, Phase::Invoke)
                .op(2)
                .lock("l")
                .at(0),
        );
        guards.push(
            Event::new("w1", Kind::Lock, Phase::Ok)
                .op(2)
                .owner("a")
                .at(11),
        );
        guards.push(
            Event::new("w2", Kind::Write, Phase::Invoke)
                .op(3)
                .owner("z")
                .at(50),
        );
        guards.push(
            Event::new("w2", Kind::Write, Phase::Ok)
                .op(3)
                .answer("accepted")
                .at(60),
        );
        let verdicts = judged(guards, |_| Expect::Hold);
        for (c, says) in [
            (Check::C2, "accepted without a token"),
            (Check::C6, "guard without a token"),
            (Check::C9, "guard without a token"),
        ] {
            let (s, summary) = status(&verdicts, c);
            assert_eq!(s, Status::Fail, "{c}: {summary}");
            assert!(summary.contains(says), "{c}: {summary}");
        }
        let c6 = verdicts.iter().find(|v| v.check == Check::C6).unwrap();
        assert!(
            c6.violations
                .iter()
                .any(|v| v.message.contains("owner z, which no guard had")),
            "{:?}",
            c6.violations
        );
    }

    #[test]
    fn a_history_in_which_nothing_ran_is_not_applicable_rather_than_passed() {
        for v in judged(Vec::new(), |_| Expect::Hold) {
            assert_eq!(v.status, Status::Skipped, "{}: {}", v.check, v.summary);
        }
    }
}
