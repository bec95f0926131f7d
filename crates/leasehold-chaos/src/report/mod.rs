//! Reports: a terminal table, JSON, a progress line, and an HTML page.
//! The table is backend × scenario × check; the page has a timeline per run.

mod html;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{IsTerminal, Write};

use serde_json::json;

use crate::checks::{Check, Status};
use crate::runner::{Outcome, RunReport};

pub use html::{html, page, timeline};

/// One cell of the table: the verdicts of one check over every run of a row.
fn aggregate(statuses: &[Status]) -> (Status, usize) {
    let order = [
        Status::Fail,
        Status::Missed,
        Status::Undecided,
        Status::Detected,
        Status::Tolerated,
        Status::Pass,
        Status::Skipped,
    ];
    for status in order {
        let n = statuses.iter().filter(|s| **s == status).count();
        if n > 0 && !(status == Status::Pass && statuses.iter().all(|s| *s == Status::Skipped)) {
            return (status, n);
        }
    }
    (Status::Skipped, 0)
}

/// The terminal table: one row per backend and scenario, one column per check.
///
/// ✔ held · ✘ violated (a bug) · ⚑ expected violation, detected · ✘? expected violation
/// missed · ~ allowed violation seen · ? undecided · blank: skipped.
pub fn table(reports: &[RunReport]) -> String {
    let mut rows: BTreeMap<(String, u8, String), Vec<&RunReport>> = BTreeMap::new();
    for r in reports {
        rows.entry((r.backend.clone(), r.scenario_id, r.scenario.clone()))
            .or_default()
            .push(r);
    }
    let mut out = String::new();
    let _ = write!(out, "{:<14} {:<26} {:>4}", "backend", "scenario", "runs");
    for c in Check::ALL {
        let _ = write!(out, " {:>4}", c.to_string());
    }
    out.push_str("  result\n");
    for ((backend, id, scenario), runs) in &rows {
        let _ = write!(
            out,
            "{backend:<14} {:<26} {:>4}",
            format!("{id:>2} {scenario}"),
            runs.len()
        );
        if let Some(reason) = runs.iter().find_map(|r| match &r.outcome {
            Outcome::Skipped { reason } => Some(reason.clone()),
            _ => None,
        }) {
            let _ = writeln!(out, "  skipped: {reason}");
            continue;
        }
        for c in Check::ALL {
            let statuses: Vec<Status> = runs
                .iter()
                .filter_map(|r| r.verdict(c).map(|v| v.status))
                .collect();
            let (status, n) = aggregate(&statuses);
            let cell = match status {
                Status::Skipped => "·".to_owned(),
                Status::Detected if runs.len() > 1 => format!("⚑{n}"),
                Status::Fail | Status::Missed if runs.len() > 1 => {
                    format!("{}{n}", status.symbol())
                }
                s => s.symbol().to_owned(),
            };
            let _ = write!(out, " {cell:>4}");
        }
        let errors = runs
            .iter()
            .filter(|r| matches!(r.outcome, Outcome::Error { .. }))
            .count();
        let good = runs.iter().all(|r| r.is_good());
        let result = match (good, errors) {
            (true, _) => "ok".to_owned(),
            (false, 0) => "FAIL".to_owned(),
            (false, n) => format!("FAIL ({n} errors)"),
        };
        let _ = writeln!(out, "  {result}");
    }
    out.push_str(
        "\n✔ held  ⚑ expected violation detected  ✘ violated  ✘? expected violation missed  \
         ~ allowed violation seen  · not applicable\n",
    );
    let bad: Vec<&RunReport> = reports.iter().filter(|r| !r.is_good()).collect();
    if !bad.is_empty() {
        out.push_str("\nFailures:\n");
        for r in bad.iter().take(20) {
            let _ = writeln!(
                out,
                "  {} {} seed {}: {}",
                r.backend, r.scenario, r.seed, r.replay
            );
            if let Some(path) = &r.history_file {
                let _ = writeln!(out, "    history: {}", path.display());
            }
            if let Outcome::Error { message, .. } = &r.outcome {
                let _ = writeln!(out, "    error: {message}");
            }
            for v in r.verdicts().iter().filter(|v| !v.status.is_good()) {
                let _ = writeln!(
                    out,
                    "    {} {} {:?}: {}",
                    v.check,
                    v.check.name(),
                    v.status,
                    v.summary
                );
            }
        }
        if bad.len() > 20 {
            let _ = writeln!(out, "  … and {} more", bad.len() - 20);
        }
    }
    out
}

/// Totals over many runs, per backend and scenario (the long run's figures).
pub fn totals(reports: &[RunReport]) -> serde_json::Value {
    let mut per: BTreeMap<String, serde_json::Value> = BTreeMap::new();
    for r in reports {
        let key = format!("{}/{}", r.backend, r.scenario);
        let entry = per.entry(key).or_insert_with(|| {
            json!({"runs": 0, "skipped": 0, "errors": 0, "faults": 0, "grants": 0,
                   "stale_accepted": 0, "lost_writes": 0, "double_grants": 0,
                   "runs_with_double_grant": 0, "failed": 0})
        });
        let add = |e: &mut serde_json::Value, k: &str, n: usize| {
            e[k] = json!(e[k].as_u64().unwrap_or(0) + n as u64);
        };
        add(entry, "runs", 1);
        match &r.outcome {
            Outcome::Skipped { .. } => add(entry, "skipped", 1),
            Outcome::Error { .. } => add(entry, "errors", 1),
            Outcome::Ran { .. } => {}
        }
        add(entry, "faults", r.stats.faults);
        add(entry, "grants", r.stats.grants);
        add(entry, "stale_accepted", r.stats.stale_accepted);
        add(entry, "lost_writes", r.stats.lost_writes);
        add(entry, "double_grants", r.stats.double_grants);
        add(
            entry,
            "runs_with_double_grant",
            usize::from(r.stats.double_grants > 0),
        );
        add(entry, "failed", usize::from(!r.is_good()));
    }
    json!(per)
}

/// Everything as JSON.
pub fn to_json(reports: &[RunReport]) -> serde_json::Value {
    json!({
        "runs": reports,
        "good": reports.iter().all(RunReport::is_good),
        "totals": totals(reports),
    })
}

/// A progress line on stderr (only when it is a terminal).
#[derive(Debug)]
pub struct Progress {
    total: usize,
    done: usize,
    tty: bool,
}

impl Progress {
    /// For `total` runs.
    pub fn new(total: usize) -> Self {
        Self {
            total,
            done: 0,
            tty: std::io::stderr().is_terminal(),
        }
    }

    /// One more run finished.
    pub fn step(&mut self, report: &RunReport) {
        self.done += 1;
        if !self.tty {
            return;
        }
        let width = 30;
        let filled = width * self.done / self.total.max(1);
        let mark = if report.is_good() { "" } else { "  (FAIL)" };
        let mut err = std::io::stderr();
        let _ = write!(
            err,
            "\r[{}{}] {}/{} {} {} seed {}{mark}\x1b[K",
            "=".repeat(filled),
            " ".repeat(width - filled),
            self.done,
            self.total,
            report.backend,
            report.scenario,
            report.seed
        );
        if self.done == self.total {
            let _ = writeln!(err);
        }
        let _ = err.flush();
    }
}
