//! `leasehold audit`: the lock events of many hosts, checked for what must never happen.
//!
//! Input: one JSON-lines file of lock events per host (`run --events`,
//! [`leasehold::events::JsonLines`]); output: findings, each naming the hosts, owners,
//! tokens and times involved. Each host's times are its own wall clock, trusted only to
//! within `uncertainty` of the others: every check widens what it compares by that much
//! in the holder's favour, so a finding is certain whatever the clocks did within it, and
//! an overlap shorter than the uncertainty is not reported.
//!
//! The checks (those of `leasehold chaos` that need no global clock):
//! - **double grant** (C5): two owners' entitlements to an exclusive hold of one name
//!   overlapped. An entitlement runs from the grant's arrival to the earliest of the
//!   holder's release, its loss, and the end of the server's last promise (`sent_ms +
//!   lease_ms` of its latest grant or renewal); a grant on a session runs to its release,
//!   loss, or the session deadline it was granted with.
//! - **token order** (C1): a grant whose token is not above every token granted earlier
//!   on the name.
//! - **stale access** (C2/C3): a fence accepted a token below one it had accepted before.
//! - **unresolved** (C10): an acquire that went unanswered (`unanswered`) with no
//!   resolution (`unknown`: adopted, not granted or released) by the time its client said
//!   it would come, while its process ran on (see [`Auditor`]).
//!
//! [`Auditor`] is the engine: it takes each host's events in order and keeps only what a
//! check still to come can need, so it runs on live streams in bounded memory. [`audit`]
//! reads whole files through it; [`follow`] tails files as they grow and resumes after a
//! restart.

mod auditor;
pub mod follow;
pub mod listen;
mod timeline;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::fmt::Write as _;
use std::io::BufRead as _;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

pub use auditor::{Auditor, Counts};

/// How long (ms of the auditor's time) a silent host holds the watermark back, by default.
pub const IDLE_MS: u64 = 60_000;
/// How long (ms of event time) an idle name's highest token is kept, by default.
pub const FORGET_MS: u64 = 3_600_000;

/// Something that must never happen, found in the events.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    /// `double_grant`, `broken_promise`, `token_order`, `stale_access` or `unresolved`.
    pub check: &'static str,
    /// The lock's name, or the fenced resource.
    pub subject: String,
    /// When it happened (ms since the epoch, the first host's clock).
    pub at_ms: u64,
    /// How long it lasted beyond the clock slack, in ms.
    /// For a double grant, the holds' overlap; for a broken promise, the promises'.
    pub overlap_ms: u64,
    /// What was involved, for people.
    pub detail: String,
}

impl Finding {
    /// One line for people.
    pub fn line(&self) -> String {
        format!(
            "{} {} at {}: {}",
            self.check,
            self.subject,
            utc(self.at_ms),
            self.detail
        )
    }

    /// The finding as JSON.
    pub fn json(&self) -> Value {
        json!({
            "check": self.check,
            "subject": self.subject,
            "at_ms": self.at_ms,
            "overlap_ms": self.overlap_ms,
            "detail": self.detail,
        })
    }
}

/// A time in ms since the epoch as `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub fn utc(ms: u64) -> String {
    let days = ms / 86_400_000;
    let of_day = ms % 86_400_000;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm, proleptic Gregorian).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        of_day / 3_600_000,
        of_day / 60_000 % 60,
        of_day / 1_000 % 60,
        of_day % 1_000
    )
}

/// What to audit, and how.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Spec {
    /// The event files, one per host (the host is the file's name).
    /// Following, also directories of them.
    pub files: Vec<PathBuf>,
    /// How far apart the hosts' clocks may be, in ms.
    pub uncertainty_ms: u64,
    /// How long (the auditor's time) a silent host holds the others back, in ms.
    pub idle_ms: u64,
    /// How long (event time) an idle name's highest token is kept, in ms.
    pub forget_ms: u64,
    /// Draw each finding with this much (ms) before and after it.
    pub timeline_ms: Option<u64>,
    /// Where to write the page of timelines (following: rewritten as they are drawn).
    pub html: Option<PathBuf>,
    /// Following: where to keep the state that a restart resumes from.
    pub state: Option<PathBuf>,
    /// Following: also take hosts' events streamed to this address (see [`listen`]).
    pub listen: Option<std::net::SocketAddr>,
}

impl Spec {
    /// Audit `files` with clocks `uncertainty_ms` apart and the default horizons.
    pub fn new(files: Vec<PathBuf>, uncertainty_ms: u64) -> Self {
        Self {
            files,
            uncertainty_ms,
            idle_ms: IDLE_MS,
            forget_ms: FORGET_MS,
            timeline_ms: None,
            html: None,
            state: None,
            listen: None,
        }
    }

    /// A fresh auditor of `files`, one host each.
    pub fn auditor_of(&self, files: &[PathBuf]) -> Auditor {
        let hosts: Vec<String> = files.iter().map(|f| host_of(f)).collect();
        let auditor = Auditor::new(&hosts, self.uncertainty_ms, self.idle_ms, self.forget_ms);
        match self.timeline_ms {
            Some(window) => auditor.with_timelines(window),
            None => auditor,
        }
    }
}

/// The page of `auditor`'s timelines: one self-contained HTML file.
pub fn page(auditor: &Auditor) -> String {
    let (drawn, left_out) = auditor.timelines();
    let skipped: Vec<Value> = if left_out > 0 {
        vec![
            json!({"backend": "audit", "scenario": format!("{left_out} more findings"),
            "reason": "not drawn (a page draws at most 100)"}),
        ]
    } else {
        Vec::new()
    };
    crate::report::page("leasehold audit", drawn, &skipped)
}

/// What an audit read and found.
#[derive(Debug, Default)]
pub struct Audit {
    /// Events read, by kind.
    pub events: BTreeMap<String, u64>,
    /// Lines that were not events (bad JSON, missing fields).
    pub unreadable: u64,
    /// Events the hosts' sinks dropped (their `dropped` lines): the record has gaps.
    pub dropped: u64,
    /// Accesses fences refused.
    pub refused: u64,
    /// What must never happen.
    pub findings: Vec<Finding>,
    /// The clock uncertainty allowed between hosts, in ms.
    pub uncertainty_ms: u64,
    /// The hosts (files) read.
    pub hosts: Vec<String>,
    /// Events that came after the watermark had passed them (see [`Counts::late`]).
    pub late: u64,
    /// Steps of the hosts' wall clocks (see [`Counts::clock_steps`]).
    pub clock_steps: Vec<(String, u64, i64)>,
    /// The most holds, grants and accesses the auditor kept at once.
    pub kept_at_most: usize,
}

impl Audit {
    /// The report of what `auditor` read, with the findings it made.
    pub fn of(auditor: &Auditor, findings: Vec<Finding>, kept_at_most: usize) -> Self {
        let counts = auditor.counts();
        Self {
            events: counts.events.clone(),
            unreadable: counts.unreadable,
            dropped: counts.dropped,
            refused: counts.refused,
            late: counts.late,
            clock_steps: counts.clock_steps.clone(),
            findings,
            uncertainty_ms: auditor.uncertainty_ms(),
            hosts: auditor.hosts(),
            kept_at_most,
        }
    }
}

/// Reads `spec.files` (one per host) to their ends and checks them.
/// It writes the page of timelines if `spec.html` says where.
///
/// The files are read side by side in time order, so memory stays bounded by what the
/// checks need (as when following), not by the files' length.
///
/// # Errors
///
/// A file that cannot be read or written, with its path.
pub fn audit(spec: &Spec) -> Result<Audit, String> {
    let files = &spec.files;
    let mut auditor = spec.auditor_of(files);
    // One instant for the whole read: whether a host is silent depends on the record, not
    // on how fast this machine reads it (a host's file that ends is `done`).
    let now = std::time::Instant::now();
    let mut readers = Vec::with_capacity(files.len());
    for file in files {
        let opened = std::fs::File::open(file).map_err(|e| format!("{}: {e}", file.display()))?;
        readers.push((file, std::io::BufReader::new(opened).lines()));
    }
    // The next event of each host, by time: the earliest goes in first.
    let mut next = BinaryHeap::new();
    let mut pending: Vec<Option<Value>> = vec![None; files.len()];
    let mut read_next = |host: usize,
                         auditor: &mut Auditor,
                         pending: &mut Vec<Option<Value>>,
                         next: &mut BinaryHeap<Reverse<(u64, usize)>>|
     -> Result<(), String> {
        let (file, lines) = &mut readers[host];
        for line in lines.by_ref() {
            let line = line.map_err(|e| format!("{}: {e}", file.display()))?;
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<Value>(&line) {
                Ok(event) if event["at_ms"].as_u64().is_some() => {
                    let at = auditor.steady_at(host, &event).unwrap_or(0);
                    next.push(Reverse((at, host)));
                    pending[host] = Some(event);
                    return Ok(());
                }
                _ => auditor.line_at(host, &line, now),
            }
        }
        auditor.done(host);
        Ok(())
    };
    for host in 0..files.len() {
        read_next(host, &mut auditor, &mut pending, &mut next)?;
    }
    let mut findings = Vec::new();
    let mut kept_at_most = 0;
    let mut since_advance = 0_u32;
    while let Some(Reverse((_, host))) = next.pop() {
        if let Some(event) = pending[host].take() {
            auditor.event_at(host, &event, now);
        }
        read_next(host, &mut auditor, &mut pending, &mut next)?;
        since_advance += 1;
        if since_advance >= 1_024 {
            since_advance = 0;
            auditor.advance_at(now);
            kept_at_most = kept_at_most.max(auditor.kept());
            findings.extend(auditor.take_findings());
        }
    }
    kept_at_most = kept_at_most.max(auditor.kept());
    auditor.finish();
    findings.extend(auditor.take_findings());
    findings.sort_by_key(|f| f.at_ms);
    if let Some(path) = &spec.html {
        std::fs::write(path, page(&auditor)).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(Audit::of(&auditor, findings, kept_at_most))
}

/// The host a file records: its name without the extension.
pub fn host_of(file: &Path) -> String {
    file.file_stem().map_or_else(
        || file.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    )
}

impl Audit {
    /// The report for people.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{} hosts, {} events ({}), clock uncertainty ±{} ms",
            self.hosts.len(),
            self.events.values().sum::<u64>(),
            self.events
                .iter()
                .map(|(kind, n)| format!("{kind} {n}"))
                .collect::<Vec<_>>()
                .join(", "),
            self.uncertainty_ms
        );
        if self.dropped > 0 || self.unreadable > 0 || self.late > 0 {
            let _ = writeln!(
                out,
                "gaps: {} events dropped by the hosts, {} lines unreadable, {} events late",
                self.dropped, self.unreadable, self.late
            );
        }
        for (host, at, by) in &self.clock_steps {
            let _ = writeln!(
                out,
                "clock step: {host}'s wall clock moved by {by} ms at {} (its steady clock was followed)",
                utc(*at)
            );
        }
        let _ = writeln!(out, "fence refusals: {}", self.refused);
        if self.findings.is_empty() {
            out.push_str("no findings\n");
        }
        for f in &self.findings {
            let _ = writeln!(out, "{}", f.line());
        }
        out
    }

    /// The report as JSON.
    pub fn json(&self) -> Value {
        json!({
            "hosts": self.hosts,
            "events": self.events,
            "unreadable": self.unreadable,
            "dropped": self.dropped,
            "fence_refusals": self.refused,
            "clock_uncertainty_ms": self.uncertainty_ms,
            "late": self.late,
            "clock_steps": self.clock_steps.iter().map(|(host, at, by)| json!({
                "host": host, "at_ms": at, "by_ms": by,
            })).collect::<Vec<_>>(),
            "kept_at_most": self.kept_at_most,
            "findings": self.findings.iter().map(Finding::json).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(dir: &Path, name: &str, lines: &[String]) -> PathBuf {
        let path = dir.join(format!("{name}.jsonl"));
        std::fs::write(&path, lines.join("\n")).unwrap();
        path
    }

    fn granted(owner: &str, token: u64, at: u64, lease: u64) -> String {
        format!(
            r#"{{"kind":"granted","at_ms":{at},"backend":"redis","name":"n","mode":"exclusive","owner":"{owner}","token":{token},"sent_ms":{},"lease_ms":{lease}}}"#,
            at - 1
        )
    }

    fn ended(kind: &str, owner: &str, token: u64, at: u64) -> String {
        format!(
            r#"{{"kind":"{kind}","at_ms":{at},"backend":"redis","name":"n","mode":"exclusive","owner":"{owner}","token":{token}}}"#
        )
    }

    #[test]
    fn holds_one_after_the_other_are_clean_and_an_overlap_is_found() {
        let dir = tempfile::tempdir().unwrap();
        // a holds 1000..2000 on one host; b from 2030 on another: clean within ±20 ms.
        let a = host(
            dir.path(),
            "a",
            &[
                granted("a1", 1, 1_000, 30_000),
                ended("released", "a1", 1, 2_000),
            ],
        );
        let b = host(
            dir.path(),
            "b",
            &[
                granted("b1", 2, 2_030, 30_000),
                ended("released", "b1", 2, 3_000),
            ],
        );
        let clean = audit(&Spec::new(vec![a.clone(), b], 20)).unwrap();
        assert!(clean.findings.is_empty(), "{:?}", clean.findings);
        // c is granted at 1500 while a holds until 2000: 500 ms together, 460 beyond ±20.
        let c = host(
            dir.path(),
            "c",
            &[
                granted("c1", 3, 1_500, 30_000),
                ended("released", "c1", 3, 2_500),
            ],
        );
        let found = audit(&Spec::new(vec![a.clone(), c.clone()], 20)).unwrap();
        assert_eq!(found.findings.len(), 1, "{:?}", found.findings);
        assert_eq!(found.findings[0].check, "double_grant");
        assert_eq!(found.findings[0].overlap_ms, 460);
        assert!(
            found.findings[0].detail.contains("a token 1")
                && found.findings[0].detail.contains("c token 3")
        );
        // With clocks trusted only to ±300 ms, 500 ms is not beyond doubt.
        assert!(
            audit(&Spec::new(vec![a, c], 300))
                .unwrap()
                .findings
                .is_empty()
        );
    }

    #[test]
    fn an_acquire_left_unresolved_is_found_once_its_process_runs_on() {
        let dir = tempfile::tempdir().unwrap();
        // Process 1's request, sent at 500 and due by 11 500.
        let unanswered = r#"{"kind":"unanswered","at_ms":1000,"backend":"redis","name":"n","mode":"exclusive","owner":"1-0000000aa","sent_ms":500,"resolved_within_ms":11000}"#.to_owned();
        let unknown = |how: &str, at: u64| {
            format!(
                r#"{{"kind":"unknown","at_ms":{at},"backend":"redis","name":"n","mode":"exclusive","owner":"1-0000000aa","resolved":"{how}"}}"#
            )
        };
        // Holds of other names by `process`, one every 2 s from `from` ms to `to`. The
        // process is told by the pid and 8 hex digits after it: process 1 is `1-0000000a`.
        let holds = |process: &'static str, from: u64, to: u64| {
            (from / 2_000..to / 2_000).flat_map(move |i| {
                let owner = format!("{process}{i}");
                let line = |kind: &str, at: u64| {
                    format!(
                        r#"{{"kind":"{kind}","at_ms":{at},"backend":"redis","name":"other{i}","mode":"exclusive","owner":"{owner}","token":1,"sent_ms":{at},"lease_ms":1000}}"#
                    )
                };
                [line("granted", i * 2_000), line("released", i * 2_000 + 500)]
            })
        };
        let audited = |record: &[String]| {
            let a = host(dir.path(), "a", record);
            let report = audit(&Spec::new(vec![a], 20)).unwrap();
            (report.findings.iter())
                .map(|f| (f.check, f.subject.clone(), f.at_ms))
                .collect::<Vec<_>>()
        };
        let of = |parts: Vec<Vec<String>>| parts.concat();
        let head = vec![unanswered.clone()];
        for how in ["adopted", "not_granted", "released"] {
            let record = of(vec![
                head.clone(),
                vec![unknown(how, 1_500)],
                holds("1-0000000a", 2_000, 60_000).collect(),
            ]);
            assert_eq!(audited(&record), [], "{how}");
        }
        // Nothing says what became of it while its process runs on: reported once the
        // process has run for the client's bound and the grace past the due time (27.5 s).
        let unresolved = of(vec![
            head.clone(),
            holds("1-0000000a", 2_000, 60_000).collect(),
        ]);
        assert_eq!(
            audited(&unresolved),
            [("unresolved", "n".to_owned(), 1_000)]
        );
        let short = of(vec![
            head.clone(),
            holds("1-0000000a", 2_000, 26_000).collect(),
        ]);
        assert_eq!(audited(&short), []);
        // Process 1 stopped; another writes on to the same record, beside it or after: one
        // with another pid, or a later one with the same pid.
        for process in ["2-0000000a", "1-0000000b"] {
            let other = of(vec![head.clone(), holds(process, 2_000, 60_000).collect()]);
            assert_eq!(audited(&other), [], "{process}");
        }
        // Process 1 paused past the due time twice, writing other events in between, then
        // resolves it.
        let paused = of(vec![
            head.clone(),
            holds("1-0000000a", 40_000, 44_000).collect(),
            holds("1-0000000a", 90_000, 94_000).collect(),
            vec![unknown("released", 94_500)],
            holds("1-0000000a", 96_000, 150_000).collect(),
        ]);
        assert_eq!(audited(&paused), []);
        // Events were dropped, the line saying so written after some older ones: the
        // resolution may have been among them.
        let dropped = r#"{"kind":"dropped","at_ms":1200,"count":3}"#.to_owned();
        for gap in [
            vec![unanswered.clone(), dropped.clone()],
            vec![dropped.clone(), unanswered.clone()],
        ] {
            assert_eq!(
                audited(&of(vec![gap, holds("1-0000000a", 2_000, 60_000).collect()])),
                []
            );
        }
    }

    #[test]
    fn a_grant_inside_the_promise_of_a_holder_that_lost_it_is_a_broken_promise() {
        let dir = tempfile::tempdir().unwrap();
        let audited = |first: &[String], second: &[String]| {
            let a = host(dir.path(), "a", first);
            let b = host(dir.path(), "b", second);
            audit(&Spec::new(vec![a, b], 20)).unwrap().findings
        };
        // Each finding's check and overlap beyond the slack.
        let measured = |first: &[String], second: &[String]| -> Vec<(&str, u64)> {
            (audited(first, second).iter())
                .map(|f| (f.check, f.overlap_ms))
                .collect()
        };
        let b_after = [
            granted("b1", 2, 1_600, 30_000),
            ended("released", "b1", 2, 2_000),
        ];
        // a was promised 999 + 30 000 and lost it at 1 500; b was granted at 1 600: the
        // promises overlapped 400 ms, 360 beyond the slack, though no two believed at once.
        let a_lost = [
            granted("a1", 1, 1_000, 30_000),
            ended("lost", "a1", 1, 1_500),
        ];
        let found = audited(&a_lost, &b_after);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].check, "broken_promise");
        assert_eq!((found[0].at_ms, found[0].overlap_ms), (1_600, 360));
        assert!(
            found[0]
                .detail
                .contains("a token 1 (a1) had 29399 ms to run")
                && found[0].detail.contains("loss 100 ms before")
                && found[0].detail.contains("overlapped 400 ms"),
            "{}",
            found[0].detail
        );
        // Its holder then sent the release of the lost grant: given up at 1 550, before
        // b's grant, had the server still kept it. Clean.
        let mut a_gave_up = a_lost.to_vec();
        a_gave_up.push(ended("released", "a1", 1, 1_550));
        assert!(audited(&a_gave_up, &b_after).is_empty());
        // ... unless the server answered that it held nothing any more: it had let the
        // grant go before the release came.
        let mut a_not_held = a_gave_up.clone();
        a_not_held.push(ended("not_held", "a1", 1, 1_551));
        assert_eq!(measured(&a_not_held, &b_after), [("broken_promise", 360)]);
        // A release sent only after b's grant gave up nothing before it: 100 ms promised
        // to both, 60 beyond the slack.
        let mut a_late = a_lost.to_vec();
        a_late.push(ended("released", "a1", 1, 1_700));
        assert_eq!(measured(&a_late, &b_after), [("broken_promise", 60)]);
        // Released instead, the promise was given up: clean.
        let a_released = [
            granted("a1", 1, 1_000, 30_000),
            ended("released", "a1", 1, 1_500),
        ];
        assert!(audited(&a_released, &b_after).is_empty());
        // Lost, with its promise (999 + 550) run out before b's grant: clean.
        let a_short = [granted("a1", 1, 1_000, 550), ended("lost", "a1", 1, 1_500)];
        assert!(audited(&a_short, &b_after).is_empty());
        // The one granted second lost it 10 ms after its grant, inside the slack, while a
        // held on until 3 000: the promises overlapped from 1 600 to 3 000.
        let a_held = [
            granted("a1", 1, 1_000, 30_000),
            ended("released", "a1", 1, 3_000),
        ];
        let b_lost = [
            granted("b1", 2, 1_600, 30_000),
            ended("lost", "b1", 2, 1_610),
        ];
        assert_eq!(measured(&a_held, &b_lost), [("broken_promise", 1_360)]);
        // An operator evicted a: the promise was given up, as by a release.
        let a_evicted = [
            granted("a1", 1, 1_000, 30_000),
            ended("lost", "a1", 1, 1_500)
                .replace(r#""token":1"#, r#""token":1,"reason":"Evicted""#),
        ];
        assert!(audited(&a_evicted, &b_after).is_empty());
        // On a session: a was promised the session's deadline as of its grant (1 500), but
        // the session lived on; when the server took the grant away at 1 550, the deadline
        // the keep-alives had reached (2 400) was still ahead: b's grant at 1 600 broke it.
        let session = |kind: &str, at: u64, until: u64| {
            format!(
                r#"{{"kind":"{kind}","at_ms":{at},"backend":"etcd","name":"n","mode":"exclusive","owner":"a1","token":1,"session_until_ms":{until}}}"#
            )
        };
        let a_session = [
            session("granted", 1_000, 1_500),
            session("lost", 1_550, 2_400),
        ];
        assert_eq!(measured(&a_session, &b_after), [("broken_promise", 360)]);
        // Redlock's "not held" is what a majority of nodes said: the release stands.
        let redlock = |line: String| line.replace(r#""backend":"redis""#, r#""backend":"redlock""#);
        let a_redlock: Vec<String> = a_not_held.iter().cloned().map(redlock).collect();
        assert!(audited(&a_redlock, &b_after).is_empty());
    }

    #[test]
    fn a_broken_promise_waits_for_the_release_that_could_give_it_up() {
        // An auditor of hosts a and b (±20 ms) that has read `lines` (host, line) in turn,
        // advancing after each `None`.
        let read = |lines: &[Option<(usize, String)>]| {
            let mut auditor = Auditor::new(&["a".into(), "b".into()], 20, 60_000, 600_000);
            for line in lines {
                match line {
                    Some((host, line)) => auditor.line(*host, line),
                    None => auditor.advance(),
                }
            }
            auditor
        };
        let checks = |auditor: &mut Auditor| -> Vec<(&str, u64, u64)> {
            (auditor.take_findings().iter())
                .map(|f| (f.check, f.at_ms, f.overlap_ms))
                .collect()
        };
        let (a, b) = (|line| Some((0, line)), |line| Some((1, line)));
        // a lost its grant (promised to 999 + 5 000) at 1 500; b held from 1 600 to 2 000.
        let lost_then_b = [
            a(granted("a1", 1, 1_000, 5_000)),
            a(ended("lost", "a1", 1, 1_500)),
            b(granted("b1", 2, 1_600, 5_000)),
            b(ended("released", "b1", 2, 2_000)),
        ];
        // Both hosts past a's promise, and past the window for the answer to a release at
        // 1 550.
        let past_all = [
            a(granted("a2", 3, 12_000, 5_000)),
            b(granted("b2", 4, 12_000, 5_000)),
            None,
        ];

        // a's release, sent before b's grant, arrives after b's whole hold: judged at once,
        // the promise would look broken.
        let mut auditor = read(&[lost_then_b.as_slice(), &[None]].concat());
        assert!(checks(&mut auditor).is_empty());
        auditor.line(0, &ended("released", "a1", 1, 1_550));
        for line in past_all.iter().flatten() {
            auditor.line(line.0, &line.1);
        }
        auditor.advance();
        assert!(checks(&mut auditor).is_empty());
        assert!(auditor.kept() < 10, "kept {}", auditor.kept());

        // The server answered that it had let the grant go: found, once a's promise has run
        // out on both records, not before.
        let answered = [
            a(ended("released", "a1", 1, 1_550)),
            a(ended("not_held", "a1", 1, 1_551)),
            a(granted("a2", 3, 3_000, 5_000)),
            b(granted("b2", 4, 3_000, 5_000)),
            None,
        ];
        let mut auditor = read(&[lost_then_b.as_slice(), &answered].concat());
        assert!(checks(&mut auditor).is_empty(), "judged too soon");
        auditor.line(0, &granted("a3", 5, 7_000, 5_000));
        auditor.line(1, &granted("b3", 6, 7_000, 5_000));
        auditor.advance();
        assert_eq!(checks(&mut auditor), [("broken_promise", 1_600, 360)]);

        // a's release read before b's hold, its "not held" only after: the pair is still
        // looked at, and found once the window for that answer has passed.
        let early_release = [
            a(granted("a1", 1, 1_000, 5_000)),
            a(ended("lost", "a1", 1, 1_500)),
            a(ended("released", "a1", 1, 1_550)),
            b(granted("b1", 2, 1_600, 5_000)),
            b(ended("released", "b1", 2, 2_000)),
            None,
        ];
        let late_answer = [a(ended("not_held", "a1", 1, 1_551))];
        let mut auditor = read(&[early_release.as_slice(), &late_answer, &past_all].concat());
        assert_eq!(checks(&mut auditor), [("broken_promise", 1_600, 360)]);
        // Without the answer the release gave the promise up: nothing, and the pair is let
        // go once the window has passed.
        let mut auditor = read(&[early_release.as_slice(), &past_all].concat());
        assert!(checks(&mut auditor).is_empty());
        assert!(auditor.kept() < 10, "kept {}", auditor.kept());
    }

    #[test]
    fn a_lease_that_ran_out_ends_the_hold_and_a_lower_token_later_is_found() {
        let dir = tempfile::tempdir().unwrap();
        // a's promise ends at 999 + 500; it never said it let go (a crash). b at 2000: clean.
        let a = host(dir.path(), "a", &[granted("a1", 5, 1_000, 500)]);
        let b = host(
            dir.path(),
            "b",
            &[granted("b1", 4, 2_000, 500), ended("lost", "b1", 4, 2_400)],
        );
        let found = audit(&Spec::new(vec![a, b], 10)).unwrap();
        let checks: Vec<&str> = found.findings.iter().map(|f| f.check).collect();
        assert_eq!(checks, ["token_order"], "{:?}", found.findings);
    }

    #[test]
    fn a_long_record_is_checked_in_bounded_memory_and_an_overlap_in_it_is_still_found() {
        let dir = tempfile::tempdir().unwrap();
        // Two hosts take turns on 10 names for 20 000 grants each, each hold 40 ms, the
        // other host's next hold on the name 10 ms after it ends.
        let mut lines = [Vec::new(), Vec::new()];
        let mut token = 0;
        for round in 0..20_000_u64 {
            for (side, lines) in lines.iter_mut().enumerate() {
                token += 1;
                let name = format!("n{}", round % 10);
                let at = 1_000_000 + round * 100 + side as u64 * 50;
                let owner = format!("o{token}");
                lines.push(format!(
                    r#"{{"kind":"granted","at_ms":{at},"backend":"redis","name":"{name}","mode":"exclusive","owner":"{owner}","token":{token},"sent_ms":{},"lease_ms":30000}}"#,
                    at - 1
                ));
                // Round 12 345 on host a: released 30 ms late, over b's grant.
                let end = if round == 12_345 && side == 0 {
                    at + 70
                } else {
                    at + 40
                };
                lines.push(format!(
                    r#"{{"kind":"released","at_ms":{end},"backend":"redis","name":"{name}","mode":"exclusive","owner":"{owner}","token":{token}}}"#
                ));
            }
        }
        let a = host(dir.path(), "a", &lines[0]);
        let b = host(dir.path(), "b", &lines[1]);
        let found = audit(&Spec::new(vec![a, b], 5)).unwrap();
        assert_eq!(found.events["granted"], 40_000);
        let checks: Vec<(&str, u64)> = found
            .findings
            .iter()
            .map(|f| (f.check, f.overlap_ms))
            .collect();
        assert_eq!(checks, [("double_grant", 10)], "{:?}", found.findings);
        // What is kept does not grow with the record: a few holds per name, not 40 000.
        assert!(found.kept_at_most < 400, "kept {}", found.kept_at_most);
    }

    #[test]
    fn a_silent_host_stops_holding_the_audit_back_and_its_hold_ends_at_its_promise() {
        // Silence is judged by arrivals, not by event times: a host whose clock runs ahead
        // cannot silence the others (see the next test).
        use std::time::{Duration, Instant};
        let mut auditor = Auditor::new(&["a".into(), "b".into()], 5, 1_000, 10_000);
        // Arrivals on this process's clock: b is heard from once, a for 4 s on.
        let start = Instant::now();
        let arrived = |ms: u64| start + Duration::from_millis(ms);
        // b takes n with a 500 ms promise and is never heard from again (a crash).
        auditor.line_at(1, &granted("b1", 1, 1_000, 500), arrived(0));
        // a keeps writing; its grant at 1 600 comes after b's promise ran out.
        auditor.line_at(0, &granted("a1", 2, 1_600, 500), arrived(0));
        auditor.line_at(0, &ended("released", "a1", 2, 1_700), arrived(0));
        for at in (2_000..6_000).step_by(100) {
            auditor.line_at(
                0,
                &format!(r#"{{"kind":"access","at_ms":{at},"fence":"fence","resource":"r","token":2,"accepted":true}}"#),
                arrived(at - 2_000),
            );
            auditor.advance_at(arrived(at - 2_000));
        }
        assert!(auditor.watermark_ms() > 4_000, "{}", auditor.watermark_ms());
        assert!(auditor.take_findings().is_empty());
        // Only the resource's latest accesses are still kept.
        assert!(auditor.kept() < 10, "kept {}", auditor.kept());
        // b comes back with a grant the watermark has passed: counted late, and checked
        // against what is kept. a's hold is gone (no double grant can be seen any more),
        // but the name's highest token is not: the token going back is found.
        auditor.line_at(1, &granted("b2", 1, 1_650, 500), arrived(4_000));
        auditor.line_at(1, &ended("released", "b2", 1, 1_690), arrived(4_000));
        auditor.advance_at(arrived(4_000));
        assert_eq!(auditor.counts().late, 2);
        let checks: Vec<&str> = auditor.take_findings().iter().map(|f| f.check).collect();
        assert_eq!(checks, ["token_order"]);
    }

    #[test]
    fn a_host_added_holds_the_audit_back_until_its_first_event() {
        // A process writes nothing until its first grant: b's file is found while b waits,
        // and its first event, a grant over a's hold, comes after a has written on.
        let mut auditor = Auditor::new(&["a".into()], 5, 60_000, 600_000);
        auditor.line(0, &granted("a1", 1, 1_000, 500));
        auditor.advance();
        let b = auditor.add_host("b".into());
        auditor.line(0, &ended("released", "a1", 1, 1_200));
        for at in (1_300..5_000).step_by(100) {
            auditor.line(0, &granted(&format!("a{at}"), at, at, 50));
            auditor.line(0, &ended("released", &format!("a{at}"), at, at + 10));
            auditor.advance();
        }
        // b, silent since it was added, held the watermark back: a's first hold is kept.
        assert_eq!(auditor.watermark_ms(), 1_000);
        auditor.line(b, &granted("b1", 2, 1_100, 500));
        auditor.line(b, &ended("released", "b1", 2, 1_150));
        auditor.advance();
        assert_eq!(auditor.counts().late, 0);
        let checks: Vec<&str> = auditor.take_findings().iter().map(|f| f.check).collect();
        assert!(checks.contains(&"double_grant"), "{checks:?}");
    }

    #[test]
    fn a_wall_clock_step_moves_nothing_and_is_noted() {
        let dir = tempfile::tempdir().unwrap();
        let line = |kind: &str, owner: &str, token: u64, wall: u64, steady: Option<u64>| {
            let steady = steady
                .map(|s| format!(r#","steady_ms":{s}"#))
                .unwrap_or_default();
            format!(
                r#"{{"kind":"{kind}","at_ms":{wall}{steady},"backend":"redis","name":"n","mode":"exclusive","owner":"{owner}","token":{token},"sent_ms":{},"lease_ms":1000}}"#,
                wall - 1
            )
        };
        let hour = 3_600_000;
        // a is granted at 1 000 and renews at 1 500 by its steady clock, while its wall
        // clock is an hour ahead; then it crashes, so its hold ends with that promise, at
        // 2 499. The wall clock is back by a fence access at 1 900. c holds 2 600..2 700.
        let a_events = |steady: bool| {
            let s = |ms: u64| steady.then_some(ms);
            vec![
                line("granted", "a1", 1, 1_000, s(1_000)),
                line("renewed", "a1", 1, 1_500 + hour, s(1_500)),
                format!(
                    r#"{{"kind":"access","at_ms":1900{},"fence":"fence","resource":"r","token":1,"accepted":true}}"#,
                    s(1_900)
                        .map(|s| format!(r#","steady_ms":{s}"#))
                        .unwrap_or_default()
                ),
            ]
        };
        let c = host(
            dir.path(),
            "c",
            &[
                line("granted", "c1", 2, 2_600, Some(2_600)),
                line("released", "c1", 2, 2_700, Some(2_700)),
            ],
        );
        let a = host(dir.path(), "a", &a_events(true));
        let found = audit(&Spec::new(vec![a, c.clone()], 5)).unwrap();
        assert!(found.findings.is_empty(), "{:?}", found.findings);
        let steps: Vec<i64> = found.clock_steps.iter().map(|s| s.2).collect();
        assert_eq!(steps, [hour as i64, -(hour as i64)]);
        // Read by its wall clock alone, a's renewal promised it the name an hour on: c's
        // hold would be a double grant.
        let a = host(dir.path(), "a", &a_events(false));
        let found = audit(&Spec::new(vec![a, c], 5)).unwrap();
        let checks: Vec<&str> = found.findings.iter().map(|f| f.check).collect();
        assert_eq!(checks, ["double_grant"]);
    }

    /// One event line with both clocks: `wall` as the host read it, `steady` its steady clock.
    fn stamped(kind: &str, name: &str, owner: &str, token: u64, wall: u64, steady: u64) -> String {
        format!(
            r#"{{"kind":"{kind}","at_ms":{wall},"steady_ms":{steady},"backend":"redis","name":"{name}","mode":"exclusive","owner":"{owner}","token":{token},"sent_ms":{},"lease_ms":30000}}"#,
            wall - 1
        )
    }

    #[test]
    fn a_host_whose_clock_runs_ahead_or_steps_silences_no_one() {
        use std::time::{Duration, Instant};
        let base = 1_795_000_000_000_u64;
        let hour = 3_600_000;
        let mut auditor = Auditor::new(&["x".into(), "b".into(), "c".into()], 5, 60_000, 600_000);
        let start = Instant::now();
        // 40 s of traffic, arriving as it happens. x works alone on its own names; its clock
        // is two minutes ahead, and its wall clock steps back an hour half-way. b and c take
        // turns on m every 100 ms; at 20 s, c comes in 50 ms early.
        for i in 0..400_u64 {
            let arrived = start + Duration::from_millis(i * 100);
            let steady = base + 120_000 + i * 100;
            let wall = if i < 200 { steady } else { steady - hour };
            let name = format!("x{}", i % 7);
            let owner = format!("x{i}");
            for line in [
                stamped("granted", &name, &owner, i + 1, wall, steady),
                stamped("released", &name, &owner, i + 1, wall + 5, steady + 5),
            ] {
                auditor.line_at(0, &line, arrived);
            }
            let from = base + i * 100 - if i == 200 { 50 } else { 0 };
            let until = base + i * 100 + 90;
            let (host, owner) = if i % 2 == 0 { (1, "b") } else { (2, "c") };
            let owner = format!("{owner}{i}");
            auditor.line_at(
                host,
                &stamped("granted", "m", &owner, i + 1, from, from),
                arrived,
            );
            auditor.line_at(
                host,
                &stamped("released", "m", &owner, i + 1, until, until),
                arrived,
            );
            auditor.advance_at(arrived);
        }
        let checks: Vec<(&str, String)> = auditor
            .take_findings()
            .into_iter()
            .map(|f| (f.check, f.subject))
            .collect();
        assert_eq!(checks, [("double_grant", "m".to_owned())]);
        // Nobody was taken for silent: nothing came late. (x's holds are kept until the
        // others' clocks reach them: memory grows with a clock's lead, not the record.)
        assert_eq!(auditor.counts().late, 0);
        assert_eq!(auditor.counts().clock_steps.len(), 1);
    }

    #[test]
    fn a_hold_without_a_promise_lasts_at_least_to_its_hosts_last_word() {
        let dir = tempfile::tempdir().unwrap();
        // The file backend promises nothing: b's hold from 1 500 is still on at its host's
        // last event, 1 900, while a held until 2 000.
        let a = host(
            dir.path(),
            "a",
            &[
                granted("a1", 1, 1_000, 30_000),
                ended("released", "a1", 1, 2_000),
            ],
        );
        let b = host(
            dir.path(),
            "b",
            &[
                r#"{"kind":"granted","at_ms":1500,"backend":"file","name":"n","mode":"exclusive","owner":"b1","token":2}"#.to_owned(),
                r#"{"kind":"access","at_ms":1900,"fence":"fence","resource":"r","token":2,"accepted":true}"#.to_owned(),
            ],
        );
        let found = audit(&Spec::new(vec![a, b], 5)).unwrap();
        let overlaps: Vec<u64> = found.findings.iter().map(|f| f.overlap_ms).collect();
        assert_eq!(overlaps, [400 - 10], "{:?}", found.findings);
    }

    #[test]
    fn a_stream_that_broke_ends_its_holds_at_its_last_event() {
        let mut auditor = Auditor::new(&["x".into(), "b".into()], 5, 60_000, 600_000);
        // x's stream breaks while it holds n; its release is lost with the break.
        auditor.line(0, &granted("x1", 1, 4_000, 30_000));
        auditor.reconnected(0);
        // b holds n later; x's hold is not run on to its promise over it.
        auditor.line(1, &granted("b1", 2, 5_000, 30_000));
        auditor.line(1, &ended("released", "b1", 2, 5_100));
        auditor.finish();
        assert!(auditor.take_findings().is_empty());
        // Without the break, the same record is a double grant (x held to its promise).
        let mut auditor = Auditor::new(&["x".into(), "b".into()], 5, 60_000, 600_000);
        auditor.line(0, &granted("x1", 1, 4_000, 30_000));
        auditor.line(1, &granted("b1", 2, 5_000, 30_000));
        auditor.line(1, &ended("released", "b1", 2, 5_100));
        auditor.finish();
        assert_eq!(auditor.take_findings().len(), 1);
    }

    #[test]
    fn times_are_shown_as_utc_dates() {
        assert_eq!(utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(utc(1_795_000_000_999), "2026-11-18T11:06:40.999Z");
    }

    #[test]
    fn a_fence_that_accepted_an_older_token_is_found_and_refusals_counted() {
        let dir = tempfile::tempdir().unwrap();
        let access = |token: u64, at: u64, accepted: bool| {
            format!(
                r#"{{"kind":"access","at_ms":{at},"fence":"fence","resource":"stock","token":{token},"accepted":{accepted}}}"#
            )
        };
        let a = host(
            dir.path(),
            "a",
            &[
                access(7, 1_000, true),
                access(6, 1_100, false),
                access(6, 1_200, true),
                "not json".into(),
            ],
        );
        let found = audit(&Spec::new(vec![a], 10)).unwrap();
        assert_eq!(found.refused, 1);
        assert_eq!(found.unreadable, 1);
        let checks: Vec<&str> = found.findings.iter().map(|f| f.check).collect();
        assert_eq!(checks, ["stale_access"]);
    }
}
