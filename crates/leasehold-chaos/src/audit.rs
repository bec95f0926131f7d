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
//! - **unknown outcome** (C10): reported by kind; `released` and `not_granted` are fine,
//!   counted only.
//!
//! This first version reads files once, after the fact; it is not yet the continuous
//! auditor issue #29 asks for (streams, bounded memory, restart, HTML timeline).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// One grant's entitlement, as the events of its host show it.
#[derive(Debug, Clone)]
struct Hold {
    host: String,
    owner: String,
    token: u64,
    exclusive: bool,
    from_ms: u64,
    /// The end of the entitlement; `None`: open (neither released, lost nor promised).
    until_ms: Option<u64>,
}

/// Something that must never happen, found in the events.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    /// `double_grant`, `token_order` or `stale_access`.
    pub check: &'static str,
    /// The lock's name, or the fenced resource.
    pub subject: String,
    /// When it happened (ms since the epoch, the first host's clock).
    pub at_ms: u64,
    /// How long it lasted beyond the clock uncertainty (double grants), in ms.
    pub overlap_ms: u64,
    /// What was involved, for people.
    pub detail: String,
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
}

/// Reads `files` (one per host) and checks them, allowing `uncertainty_ms` between clocks.
///
/// # Errors
///
/// A file that cannot be read, with its path.
pub fn audit(files: &[PathBuf], uncertainty_ms: u64) -> Result<Audit, String> {
    let mut found = Audit {
        uncertainty_ms,
        ..Audit::default()
    };
    let mut holds: BTreeMap<String, Vec<Hold>> = BTreeMap::new();
    let mut grants: BTreeMap<String, Vec<(u64, u64, String)>> = BTreeMap::new();
    let mut accesses: BTreeMap<String, Vec<(u64, u64, String)>> = BTreeMap::new();
    for file in files {
        let host = host_of(file);
        found.hosts.push(host.clone());
        let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
        // By owner: the hold being built from its events.
        let mut open: BTreeMap<String, (String, Hold)> = BTreeMap::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let Ok(event) = serde_json::from_str::<Value>(line) else {
                found.unreadable += 1;
                continue;
            };
            let (Some(kind), Some(at)) = (event["kind"].as_str(), event["at_ms"].as_u64()) else {
                found.unreadable += 1;
                continue;
            };
            *found.events.entry(kind.to_owned()).or_default() += 1;
            let name = event["name"].as_str().unwrap_or_default().to_owned();
            let owner = event["owner"].as_str().unwrap_or_default().to_owned();
            let token = event["token"].as_u64();
            let promise = match (event["sent_ms"].as_u64(), event["lease_ms"].as_u64()) {
                (Some(sent), Some(lease)) => Some(sent.saturating_add(lease)),
                _ => event["session_until_ms"].as_u64(),
            };
            match kind {
                "granted" => {
                    let Some(token) = token else {
                        found.unreadable += 1;
                        continue;
                    };
                    grants.entry(name.clone()).or_default().push((
                        at,
                        token,
                        format!("{host} {owner}"),
                    ));
                    let hold = Hold {
                        host: host.clone(),
                        owner: owner.clone(),
                        token,
                        exclusive: event["mode"].as_str() == Some("exclusive"),
                        from_ms: at,
                        until_ms: promise,
                    };
                    if let Some((name, hold)) = open.insert(owner, (name, hold)) {
                        holds.entry(name).or_default().push(hold);
                    }
                }
                "renewed" => {
                    if let (Some((_, hold)), Some(promise)) = (open.get_mut(&owner), promise) {
                        hold.until_ms = Some(hold.until_ms.map_or(promise, |u| u.max(promise)));
                    }
                }
                "released" | "lost" => {
                    if let Some((name, mut hold)) = open.remove(&owner) {
                        hold.until_ms = Some(hold.until_ms.map_or(at, |u| u.min(at)));
                        holds.entry(name).or_default().push(hold);
                    }
                }
                "access" => {
                    let resource = event["resource"].as_str().unwrap_or_default().to_owned();
                    if event["accepted"].as_bool() == Some(true) {
                        if let Some(token) = token {
                            accesses
                                .entry(resource)
                                .or_default()
                                .push((at, token, host.clone()));
                        }
                    } else {
                        found.refused += 1;
                    }
                }
                "dropped" => found.dropped += event["count"].as_u64().unwrap_or(0),
                _ => {}
            }
        }
        for (_, (name, hold)) in open {
            holds.entry(name).or_default().push(hold);
        }
    }
    let slack = uncertainty_ms.saturating_mul(2);
    for (name, holds) in &mut holds {
        double_grants(name, holds, slack, &mut found.findings);
    }
    for (name, grants) in &mut grants {
        grants.sort();
        out_of_order(
            name,
            grants,
            slack,
            "token_order",
            "granted",
            &mut found.findings,
        );
    }
    for (resource, accesses) in &mut accesses {
        accesses.sort();
        out_of_order(
            resource,
            accesses,
            slack,
            "stale_access",
            "accepted",
            &mut found.findings,
        );
    }
    found.findings.sort_by_key(|f| f.at_ms);
    Ok(found)
}

/// The host a file records: its name without the extension.
fn host_of(file: &Path) -> String {
    file.file_stem().map_or_else(
        || file.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    )
}

/// Pairs of holds of `name` that overlap by more than `slack`.
/// Only holds by different owners, one of them exclusive, count.
fn double_grants(name: &str, holds: &mut [Hold], slack: u64, findings: &mut Vec<Finding>) {
    holds.sort_by_key(|h| h.from_ms);
    for (i, first) in holds.iter().enumerate() {
        // An open hold (a crash, a session never seen to end) proves nothing past its start.
        let Some(first_until) = first.until_ms else {
            continue;
        };
        for second in &holds[i + 1..] {
            if second.from_ms >= first_until {
                break;
            }
            if second.owner == first.owner || !(first.exclusive || second.exclusive) {
                continue;
            }
            let end = second.until_ms.map_or(first_until, |u| u.min(first_until));
            let overlap = end.saturating_sub(second.from_ms);
            if overlap > slack {
                findings.push(Finding {
                    check: "double_grant",
                    subject: name.to_owned(),
                    at_ms: second.from_ms,
                    overlap_ms: overlap - slack,
                    detail: format!(
                        "{} token {} ({}) and {} token {} ({}) held it together for {} ms",
                        first.host,
                        first.token,
                        first.owner,
                        second.host,
                        second.token,
                        second.owner,
                        overlap
                    ),
                });
            }
        }
    }
}

/// Tokens (sorted by time) that are not above a token seen more than `slack` earlier.
fn out_of_order(
    subject: &str,
    seen: &[(u64, u64, String)],
    slack: u64,
    check: &'static str,
    verb: &str,
    findings: &mut Vec<Finding>,
) {
    for (i, (at, token, who)) in seen.iter().enumerate() {
        let earlier = seen[..i]
            .iter()
            .filter(|(then, _, _)| then.saturating_add(slack) < *at)
            .max_by_key(|(_, token, _)| *token);
        if let Some((then, highest, by)) = earlier {
            let stale = if check == "token_order" {
                token <= highest
            } else {
                token < highest
            };
            if stale {
                findings.push(Finding {
                    check,
                    subject: subject.to_owned(),
                    at_ms: *at,
                    overlap_ms: 0,
                    detail: format!(
                        "token {token} {verb} ({who}) after token {highest} ({by}, {} ms before)",
                        at - then
                    ),
                });
            }
        }
    }
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
        if self.dropped > 0 || self.unreadable > 0 {
            let _ = writeln!(
                out,
                "gaps: {} events dropped by the hosts, {} lines unreadable",
                self.dropped, self.unreadable
            );
        }
        let _ = writeln!(out, "fence refusals: {}", self.refused);
        if self.findings.is_empty() {
            out.push_str("no findings\n");
        }
        for f in &self.findings {
            let _ = writeln!(
                out,
                "{} {} at {} ms: {}",
                f.check, f.subject, f.at_ms, f.detail
            );
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
            "findings": self.findings.iter().map(|f| json!({
                "check": f.check,
                "subject": f.subject,
                "at_ms": f.at_ms,
                "overlap_ms": f.overlap_ms,
                "detail": f.detail,
            })).collect::<Vec<_>>(),
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
        let clean = audit(&[a.clone(), b], 20).unwrap();
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
        let found = audit(&[a.clone(), c.clone()], 20).unwrap();
        assert_eq!(found.findings.len(), 1, "{:?}", found.findings);
        assert_eq!(found.findings[0].check, "double_grant");
        assert_eq!(found.findings[0].overlap_ms, 460);
        assert!(
            found.findings[0].detail.contains("a token 1")
                && found.findings[0].detail.contains("c token 3")
        );
        // With clocks trusted only to ±300 ms, 500 ms is not beyond doubt.
        assert!(audit(&[a, c], 300).unwrap().findings.is_empty());
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
        let found = audit(&[a, b], 10).unwrap();
        let checks: Vec<&str> = found.findings.iter().map(|f| f.check).collect();
        assert_eq!(checks, ["token_order"], "{:?}", found.findings);
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
        let found = audit(&[a], 10).unwrap();
        assert_eq!(found.refused, 1);
        assert_eq!(found.unreadable, 1);
        let checks: Vec<&str> = found.findings.iter().map(|f| f.check).collect();
        assert_eq!(checks, ["stale_access"]);
    }
}
