//! The auditor: lock events in, findings out, in bounded memory.
//!
//! Events arrive per host in the order the host wrote them. The auditor keeps, per host,
//! the latest time it has seen; the **watermark** is the earliest of these over the hosts
//! that are still writing, so every event stamped before it has arrived. What the checks
//! need of the past is kept only while an event still to come could need it:
//! - a hold (one grant's entitlement) until it has ended more than the clock slack before
//!   both the watermark and the start of every hold of its name still open that could
//!   conflict with it (any, for an exclusive hold; an exclusive one, for a shared hold);
//!   the end of a hold that was lost is its promise, unless its holder's release gave it
//!   up sooner, and a pair of holds whose promises overlapped is kept until it is judged
//!   (past the lost promise, when the release that could give it up has arrived);
//! - each grant and fence access until it has been checked and lies more than the slack
//!   before the watermark; after that only the highest token survives, per name;
//! - a name or resource with nothing else kept for `forget_ms` of event time is forgotten;
//! - per host, each acquire that went unanswered until its resolution is read, it is
//!   reported, or the record shows a gap or that its process is gone (silent while the
//!   record went on for `forget_ms`).
//!
//! A host from which nothing has arrived for `idle_ms` (of this process's time, not of
//! event time, so that one host's clock running ahead cannot silence the others) stops
//! holding the watermark back: it crashed, or it has nothing to say. Its holds end at their
//! promises (one that promised nothing at its last event, once it has been silent for
//! `forget_ms`). Its events that arrive after that are checked against what is still kept
//! and counted as late.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::Finding;
use super::timeline::{Mark, Timelines};

/// One grant's entitlement, as its host's events show it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Hold {
    id: u64,
    host: usize,
    owner: String,
    token: u64,
    exclusive: bool,
    from_ms: u64,
    /// The latest end its promises allow; `None`: promised nothing (it ends with its host).
    promised_ms: Option<u64>,
    /// Its end, once known (released, lost, or its promise ran out).
    until_ms: Option<u64>,
    /// It ended in a loss: the server may have let it go before its promise ran out.
    #[serde(default)]
    lost: bool,
    /// After its loss, when its holder's release gave the promise up.
    /// That is its `released` event, unless the server answered that it held nothing any
    /// more (`not_held`).
    #[serde(default)]
    given_up_ms: Option<u64>,
}

impl Hold {
    /// Until when the server had promised to keep it, once ended.
    /// A release gives the promise up; a loss does not, and a server that grants the name
    /// again before the promise runs out has broken it, unless the holder's release came
    /// first.
    fn promised_until(&self) -> Option<u64> {
        let until = self.until_ms?;
        Some(match (self.lost, self.promised_ms) {
            (true, Some(promise)) => promise.min(self.given_up_ms.unwrap_or(u64::MAX)).max(until),
            _ => until,
        })
    }

    /// [`Hold::promised_until`] before any release gave the promise up.
    /// The hold is kept, and looked at, by this until the release's answer is known.
    fn promise_end(&self) -> Option<u64> {
        let until = self.until_ms?;
        Some(match (self.lost, self.promised_ms) {
            (true, Some(promise)) => promise.max(until),
            _ => until,
        })
    }
}

/// How long after a lost grant's release (event time) its answer may still come.
/// A client records the answer to a release's first attempt only, which comes within its
/// request timeout (5 s by default).
const ANSWER_WINDOW_MS: u64 = 10_000;

/// How long after an acquire request was sent its client resolves its outcome at most.
/// That is for an `unanswered` event that does not say (`resolved_within_ms`).
const RESOLVE_WINDOW_MS: u64 = 60_000;
/// How much longer than the client's bound a process runs on before it is reported.
/// That is with a resolution not read (see [`Unanswered`]); it is also the most one step
/// between two of its events counts for.
const RESOLVE_GRACE_MS: u64 = 5_000;

/// An acquire request that went unanswered, its resolution not read yet.
/// It is judged by the later events of its own process (owner ids of leasehold's clients
/// begin with their process: `<pid>-<8 hex digits drawn at its start>…`), so that another
/// process writing to the same record, or one that took over after it stopped (with the
/// same pid, even), cannot make it look overdue. Past
/// `due_ms` the process's events count how long it ran, each step between two of them for
/// at most [`RESOLVE_GRACE_MS`]: a process paused or suspended (twice, even) may write other
/// events first and resolve it only as its own timers catch up, within the client's bound.
/// It is overdue once that count passes the bound and the grace.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Unanswered {
    name: String,
    at_ms: u64,
    due_ms: u64,
    within_ms: u64,
    /// The latest event of its process read.
    last_ms: u64,
    /// How long its process has run past `due_ms`, as its events count it.
    ran_ms: u64,
}

/// The process an owner id belongs to: `<pid>-` and the 8 hex digits that follow.
/// leasehold draws those once per process ([`leasehold::OwnerId::generate`]), so a later
/// process with the same pid is another. An owner id of another writer without them is its
/// own process.
fn process_of(owner: &str) -> &str {
    let Some((pid, rest)) = owner.split_once('-') else {
        return owner;
    };
    match rest.get(..8) {
        Some(nonce) if nonce.bytes().all(|b| b.is_ascii_hexdigit()) => &owner[..pid.len() + 1 + 8],
        _ => owner,
    }
}

/// Two holds whose promises overlapped while no two holders believed they held at once.
/// It is judged once every event that could give the lost promise up has been read: past
/// `ready_ms` (the end of that promise, plus the slack) on its holder's record, and past
/// the window for the answer to its release (see `Auditor::advance_at`).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Suspect {
    first: u64,
    second: u64,
    ready_ms: u64,
}

/// A token seen at a time: a grant, or an access a fence let through.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Seen {
    at_ms: u64,
    token: u64,
    /// The host, and for a grant its owner.
    who: String,
    host: String,
    checked: bool,
}

/// The tokens of one name (grants) or one resource (accesses) still needed.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct Tokens {
    recent: Vec<Seen>,
    /// The highest token of those folded away: all far enough back for every check to come.
    settled: Option<Seen>,
}

#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct NameState {
    holds: Vec<Hold>,
    grants: Tokens,
    last_ms: u64,
    /// Possible broken promises, to be judged (their holds are kept until then).
    #[serde(default)]
    suspects: Vec<Suspect>,
}

#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct Host {
    name: String,
    latest_ms: u64,
    /// Its steady clock less its wall clock, as of its latest event that had both.
    shift_ms: Option<i64>,
    /// When its latest event arrived (this process's clock).
    #[serde(skip)]
    heard: Option<std::time::Instant>,
    /// Its record has ended (a file read to its end): it holds nothing back.
    done: bool,
    /// By owner: the name and hold id of each hold not yet ended.
    open: HashMap<String, (String, u64)>,
    /// By owner: the name and hold id of each hold that ended in a loss and is still kept.
    /// Its holder's release, and the server's answer to it, may follow.
    #[serde(default)]
    lost: HashMap<String, (String, u64)>,
    /// By owner: each acquire request that went unanswered, its resolution not read yet.
    #[serde(default)]
    unanswered: HashMap<String, Unanswered>,
    /// Its latest `dropped` line: events stamped before it may be missing.
    #[serde(default)]
    gap_ms: u64,
}

/// Counts of what an auditor read and found.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Counts {
    /// Events read, by kind.
    pub events: BTreeMap<String, u64>,
    /// Lines that were not events (bad JSON, missing fields).
    pub unreadable: u64,
    /// Events the hosts' sinks dropped (their `dropped` lines): the record has gaps.
    pub dropped: u64,
    /// Accesses fences refused.
    pub refused: u64,
    /// Events that arrived after the watermark had passed them.
    /// That is a host that fell idle and came back; they are checked against what was
    /// still kept, which may be less than they needed.
    pub late: u64,
    /// Findings, by check.
    pub findings: BTreeMap<String, u64>,
    /// The overlaps of double grants beyond the clock slack, summed, in ms.
    pub overlap_ms: u64,
    /// Steps of a host's wall clock, the first hundred.
    /// A step is the gap between its wall and steady clocks changing by more than the
    /// uncertainty. Each is: host, when (steady clock), by how much (ms). Times follow the
    /// steady clock, so a step moves nothing.
    pub clock_steps: Vec<(String, u64, i64)>,
}

/// The engine of `leasehold audit`.
/// Feed it each host's events in order, and take its findings as they are made.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Auditor {
    uncertainty_ms: u64,
    idle_ms: u64,
    forget_ms: u64,
    hosts: Vec<Host>,
    names: HashMap<String, NameState>,
    resources: HashMap<String, (Tokens, u64)>,
    /// Names and resources with something that a later watermark settles.
    busy: HashSet<String>,
    busy_resources: HashSet<String>,
    watermark_ms: u64,
    swept_ms: u64,
    next_id: u64,
    counts: Counts,
    /// Findings made and not yet taken, with their hosts.
    #[serde(skip)]
    made: Vec<(Finding, Vec<String>)>,
    #[serde(skip)]
    new_findings: Vec<Finding>,
    #[serde(skip)]
    timelines: Option<Timelines>,
}

impl Auditor {
    /// An auditor of `hosts`, whose clocks agree to within `uncertainty_ms`.
    ///
    /// A host from which nothing arrived for `idle_ms` (this process's time) no longer holds
    /// the watermark back; a name idle for `forget_ms` of event time is forgotten (its
    /// highest token with it).
    pub fn new(hosts: &[String], uncertainty_ms: u64, idle_ms: u64, forget_ms: u64) -> Self {
        Self {
            uncertainty_ms,
            idle_ms,
            forget_ms: forget_ms.max(idle_ms),
            hosts: hosts
                .iter()
                .map(|name| Host {
                    name: name.clone(),
                    ..Host::default()
                })
                .collect(),
            names: HashMap::new(),
            resources: HashMap::new(),
            busy: HashSet::new(),
            busy_resources: HashSet::new(),
            watermark_ms: 0,
            swept_ms: 0,
            next_id: 0,
            counts: Counts::default(),
            made: Vec::new(),
            new_findings: Vec::new(),
            timelines: None,
        }
    }

    /// Draws each finding with `window_ms` before and after it.
    /// It keeps what happened on each name and resource in the last `window_ms` (see [`Auditor::timelines`]).
    #[must_use]
    pub fn with_timelines(mut self, window_ms: u64) -> Self {
        self.timelines = Some(Timelines::new(window_ms));
        self
    }

    /// The timelines of the findings drawn so far, and how many findings were not drawn.
    /// They are in the chaos report's shape ([`crate::report::page`] makes the page).
    pub fn timelines(&self) -> (&[Value], u64) {
        self.timelines
            .as_ref()
            .map_or((&[], 0), |t| (t.drawn(), t.left_out))
    }

    fn mark(&mut self, subject: &str, mark: Mark) {
        if let Some(timelines) = &mut self.timelines {
            timelines.mark(subject, mark);
        }
    }

    /// Moves the findings just made to those to take, starting their timelines.
    fn publish(&mut self) {
        for (finding, lanes) in std::mem::take(&mut self.made) {
            if let Some(timelines) = &mut self.timelines {
                timelines.found(&finding, lanes);
            }
            self.new_findings.push(finding);
        }
    }

    /// Adds a host (a new process's events), and returns its index.
    /// It counts as heard from now: until it writes or falls silent for `idle_ms`, it holds
    /// the watermark back, so that its first events (a process waits for its first grant
    /// before it writes) are not late.
    pub fn add_host(&mut self, name: String) -> usize {
        self.hosts.push(Host {
            name,
            heard: Some(std::time::Instant::now()),
            ..Host::default()
        });
        self.hosts.len() - 1
    }

    /// The index of the host named `name`, added if there is none.
    pub fn host_named(&mut self, name: String) -> usize {
        match self.hosts.iter().position(|h| h.name == name) {
            Some(index) => index,
            None => self.add_host(name),
        }
    }

    /// Counts a line that could not be read.
    pub fn unreadable(&mut self) {
        self.counts.unreadable += 1;
    }

    /// The clock uncertainty it allows, in ms.
    pub fn uncertainty_ms(&self) -> u64 {
        self.uncertainty_ms
    }

    /// The hosts, in the order given to [`Auditor::new`].
    pub fn hosts(&self) -> Vec<String> {
        self.hosts.iter().map(|h| h.name.clone()).collect()
    }

    /// What it has read and found so far.
    pub fn counts(&self) -> &Counts {
        &self.counts
    }

    /// Every event stamped before this time (ms) has been read.
    pub fn watermark_ms(&self) -> u64 {
        self.watermark_ms
    }

    /// Holds, grants, accesses and unanswered acquires kept: what its memory grows with.
    pub fn kept(&self) -> usize {
        self.hosts.iter().map(|h| h.unanswered.len()).sum::<usize>()
            + self
                .names
                .values()
                .map(|n| n.holds.len() + n.grants.recent.len() + 1)
                .sum::<usize>()
            + self
                .resources
                .values()
                .map(|(t, _)| t.recent.len() + 1)
                .sum::<usize>()
    }

    /// The findings made since the last call.
    pub fn take_findings(&mut self) -> Vec<Finding> {
        std::mem::take(&mut self.new_findings)
    }

    fn slack(&self) -> u64 {
        self.uncertainty_ms.saturating_mul(2)
    }

    /// Reads one line of `host`'s events (an index into the hosts given to `new`).
    pub fn line(&mut self, host: usize, line: &str) {
        self.line_at(host, line, std::time::Instant::now());
    }

    /// Reads one line of `host`'s events, which arrived at `arrived`.
    pub fn line_at(&mut self, host: usize, line: &str, arrived: std::time::Instant) {
        if line.trim().is_empty() {
            return;
        }
        match serde_json::from_str::<Value>(line) {
            Ok(event) => self.event_at(host, &event, arrived),
            Err(_) => self.counts.unreadable += 1,
        }
    }

    /// Every host still writing counts as heard from at `now`.
    /// After a restart, silence is then measured from it.
    pub fn heard_all_at(&mut self, now: std::time::Instant) {
        for host in self.hosts.iter_mut().filter(|h| !h.done) {
            host.heard = Some(now);
        }
    }

    /// `host` connected again after a break in its stream.
    /// What it sent in the break may be lost, so each hold it had open ends at its last
    /// event (the least it lasted) rather than run on to a release that may never come.
    pub fn reconnected(&mut self, host: usize) {
        let Some(state) = self.hosts.get(host) else {
            return;
        };
        let last = state.latest_ms;
        let owners: Vec<String> = state.open.keys().cloned().collect();
        for owner in owners {
            self.end(host, &owner, last, "expired");
        }
        self.releases_unseen(host);
        self.hosts[host].unanswered.clear();
    }

    /// Events of `host` may be missing: the release of each grant it lost may be among them.
    /// Each lost promise not yet given up is taken as given up at the loss.
    fn releases_unseen(&mut self, host: usize) {
        let lost: Vec<(String, u64)> = self.hosts[host].lost.values().cloned().collect();
        for (name, id) in lost {
            if let Some(hold) = (self.names.get_mut(&name))
                .and_then(|state| state.holds.iter_mut().find(|h| h.id == id))
                && hold.given_up_ms.is_none()
            {
                hold.given_up_ms = hold.until_ms;
            }
        }
    }

    /// `host` has no more events (its file was read to its end).
    pub fn done(&mut self, host: usize) {
        if let Some(host) = self.hosts.get_mut(host) {
            host.done = true;
        }
    }

    /// When `event` of `host` happened on the host's steady clock, as the auditor takes it.
    /// Several records read side by side are merged in that order.
    pub fn steady_at(&self, host: usize, event: &Value) -> Option<u64> {
        let wall = event["at_ms"].as_u64()?;
        Some(match event["steady_ms"].as_u64() {
            Some(steady) => steady,
            None => {
                let shift = self.hosts.get(host).and_then(|h| h.shift_ms).unwrap_or(0);
                wall.saturating_add_signed(shift)
            }
        })
    }

    /// Reads one event of `host`.
    pub fn event(&mut self, host: usize, event: &Value) {
        self.event_at(host, event, std::time::Instant::now());
    }

    /// Reads one event of `host`, which arrived at `arrived`.
    pub fn event_at(&mut self, host: usize, event: &Value, arrived: std::time::Instant) {
        let (Some(kind), Some(wall)) = (event["kind"].as_str(), event["at_ms"].as_u64()) else {
            self.counts.unreadable += 1;
            return;
        };
        if host >= self.hosts.len() {
            self.counts.unreadable += 1;
            return;
        }
        // Every time of the event, moved onto the host's steady clock.
        let shift = self.steady_shift(host, wall, event["steady_ms"].as_u64());
        let steady = |ms: u64| ms.saturating_add_signed(shift);
        let at = steady(wall);
        *self.counts.events.entry(kind.to_owned()).or_default() += 1;
        metrics::counter!("leasehold_audit_events_total", "kind" => kind.to_owned()).increment(1);
        if at < self.watermark_ms {
            self.counts.late += 1;
        }
        let host_state = &mut self.hosts[host];
        // A `dropped` line is written after older lines still queued: it says nothing of
        // how far the host's record has come.
        if kind != "dropped" {
            host_state.latest_ms = host_state.latest_ms.max(at);
        }
        host_state.heard = Some(arrived);
        host_state.done = false;
        let name = event["name"].as_str().unwrap_or_default();
        let owner = event["owner"].as_str().unwrap_or_default();
        // A resolution read first: a paused process may write it past its due time.
        if kind == "unknown" {
            self.hosts[host].unanswered.remove(owner);
        }
        if !owner.is_empty() {
            self.unresolved(host, process_of(owner), at);
        }
        let promise = match (event["sent_ms"].as_u64(), event["lease_ms"].as_u64()) {
            (Some(sent), Some(lease)) => Some(steady(sent).saturating_add(lease)),
            _ => event["session_until_ms"].as_u64().map(steady),
        };
        // The deadline a live session had reached when the hold ended: its keep-alives
        // moved the promise since the grant.
        if matches!(kind, "released" | "lost")
            && self.is_open(host, owner, name, event["token"].as_u64())
        {
            self.promised(host, owner, promise);
        }
        match kind {
            "granted" => {
                let Some(token) = event["token"].as_u64() else {
                    self.counts.unreadable += 1;
                    return;
                };
                let exclusive = event["mode"].as_str() == Some("exclusive");
                self.granted(host, name, owner, token, exclusive, at, promise);
            }
            "renewed" => self.promised(host, owner, promise),
            // Its resolution may be in a gap the sink's `dropped` line (written later)
            // stands for.
            "unanswered" if at <= self.hosts[host].gap_ms => {}
            "unanswered" => {
                let within = event["resolved_within_ms"].as_u64();
                let sent = event["sent_ms"].as_u64().map_or(at, steady);
                let within_ms = within.unwrap_or(RESOLVE_WINDOW_MS);
                let entry = self.hosts[host].unanswered.entry(owner.to_owned());
                entry.or_insert_with(|| Unanswered {
                    name: name.to_owned(),
                    at_ms: at,
                    due_ms: sent.saturating_add(within_ms),
                    within_ms,
                    last_ms: at,
                    ran_ms: 0,
                });
            }
            "released" if !self.hosts[host].open.contains_key(owner) => {
                // The release of a lost grant: the promise is given up from here.
                if let Some(hold) = self.lost_hold(host, owner) {
                    hold.given_up_ms = Some(at);
                }
            }
            "released" => self.end(host, owner, at, "released"),
            // Of several copies (Redlock), "not held" is what a majority of nodes said; the
            // others may have released.
            "not_held" if event["backend"].as_str() == Some("redlock") => {}
            "not_held" => {
                // The server had let the lost grant go before that release came.
                if let Some(hold) = self.lost_hold(host, owner) {
                    hold.given_up_ms = None;
                }
                self.hosts[host].lost.remove(owner);
            }
            // A loss ends the hold it names (a record from another writer may not).
            "lost" if !self.is_open(host, owner, name, event["token"].as_u64()) => {}
            "lost" => {
                let mark = Mark::Loss {
                    lane: self.hosts[host].name.clone(),
                    at,
                    reason: event["reason"].as_str().unwrap_or_default().to_owned(),
                    token: event["token"].as_u64(),
                };
                self.mark(name, mark);
                // An operator's eviction gives the promise up, as a release does.
                let how = if event["reason"].as_str() == Some("Evicted") {
                    "evicted"
                } else {
                    "lost"
                };
                self.end(host, owner, at, how);
            }
            "access" => {
                let resource = event["resource"].as_str().unwrap_or_default();
                let accepted = event["accepted"].as_bool() == Some(true);
                let lane = self.hosts[host].name.clone();
                self.mark(
                    resource,
                    Mark::Access {
                        lane: lane.clone(),
                        at,
                        accepted,
                        token: event["token"].as_u64(),
                    },
                );
                if accepted {
                    if let Some(token) = event["token"].as_u64() {
                        let entry = self.resources.entry(resource.to_owned()).or_default();
                        entry.0.recent.push(Seen {
                            at_ms: at,
                            token,
                            who: lane.clone(),
                            host: lane,
                            checked: false,
                        });
                        entry.1 = entry.1.max(at);
                        self.busy_resources.insert(resource.to_owned());
                    }
                } else {
                    self.counts.refused += 1;
                    metrics::counter!("leasehold_audit_fence_refusals_total").increment(1);
                }
            }
            "dropped" => {
                self.releases_unseen(host);
                let state = &mut self.hosts[host];
                state.unanswered.clear();
                state.gap_ms = state.gap_ms.max(at);
                let count = event["count"].as_u64().unwrap_or(0);
                self.counts.dropped += count;
                metrics::counter!("leasehold_audit_dropped_events_total").increment(count);
            }
            _ => {}
        }
    }

    /// Reports each unanswered acquire of `process` on `host` not resolved in time.
    /// That is as of the process's event at `at`; see [`Unanswered`]. A process that stops
    /// writing before then (it stopped: its grant ends with its lease or session) is not
    /// reported.
    fn unresolved(&mut self, host: usize, process: &str, at: u64) {
        let state = &mut self.hosts[host];
        let mut overdue: Vec<(String, Unanswered)> = Vec::new();
        for (owner, u) in &mut state.unanswered {
            if process_of(owner) != process || at <= u.last_ms {
                continue;
            }
            let from = u.last_ms.max(u.due_ms);
            u.ran_ms += at.saturating_sub(from).min(RESOLVE_GRACE_MS);
            u.last_ms = at;
            if u.ran_ms > u.within_ms + RESOLVE_GRACE_MS {
                overdue.push((owner.clone(), u.clone()));
            }
        }
        let lane = state.name.clone();
        for (owner, u) in overdue {
            self.hosts[host].unanswered.remove(&owner);
            let detail = format!(
                "{lane}'s acquire (owner {owner}) went unanswered; its resolution was due \
                 {} ms later, and its process ran on for {} ms past that without saying \
                 whether the grant it may have made was adopted, refused or released",
                u.due_ms.saturating_sub(u.at_ms),
                u.ran_ms
            );
            let finding = Finding {
                check: "unresolved",
                subject: u.name,
                at_ms: u.at_ms,
                overlap_ms: 0,
                detail,
            };
            found(
                &mut self.counts,
                &mut self.made,
                finding,
                vec![lane.clone()],
            );
        }
    }

    /// How far `host`'s steady clock is from its wall clock (`steady - wall`, ms).
    /// It comes from this event's two readings or, for an event with only the wall clock's,
    /// is the last known.
    /// A change beyond the uncertainty is a step of the wall clock, and is noted.
    fn steady_shift(&mut self, host: usize, wall: u64, steady: Option<u64>) -> i64 {
        let state = &mut self.hosts[host];
        let Some(steady) = steady else {
            return state.shift_ms.unwrap_or(0);
        };
        let shift = i64::try_from(i128::from(steady) - i128::from(wall)).unwrap_or(0);
        if let Some(before) = state.shift_ms
            && before.abs_diff(shift) > self.uncertainty_ms.max(100)
        {
            metrics::counter!("leasehold_audit_clock_steps_total").increment(1);
            if self.counts.clock_steps.len() < 100 {
                self.counts
                    .clock_steps
                    .push((state.name.clone(), steady, before - shift));
            }
        }
        state.shift_ms = Some(shift);
        shift
    }

    #[allow(clippy::too_many_arguments)] // one grant event's fields
    fn granted(
        &mut self,
        host: usize,
        name: &str,
        owner: &str,
        token: u64,
        exclusive: bool,
        at: u64,
        promise: Option<u64>,
    ) {
        // A second grant to one owner ends the first (a re-acquisition under one id).
        self.end(host, owner, at, "released");
        let id = self.next_id;
        self.next_id += 1;
        let who = format!("{} {owner}", self.hosts[host].name);
        let state = self.names.entry(name.to_owned()).or_default();
        state.last_ms = state.last_ms.max(at);
        state.grants.recent.push(Seen {
            at_ms: at,
            token,
            who,
            host: self.hosts[host].name.clone(),
            checked: false,
        });
        state.holds.push(Hold {
            id,
            host,
            owner: owner.to_owned(),
            token,
            exclusive,
            from_ms: at,
            promised_ms: promise,
            until_ms: None,
            lost: false,
            given_up_ms: None,
        });
        self.busy.insert(name.to_owned());
        self.hosts[host]
            .open
            .insert(owner.to_owned(), (name.to_owned(), id));
    }

    fn open_hold(&mut self, host: usize, owner: &str) -> Option<&mut Hold> {
        let (name, id) = self.hosts[host].open.get(owner)?;
        self.names
            .get_mut(name)?
            .holds
            .iter_mut()
            .find(|h| h.id == *id)
    }

    /// Extends the promise of the hold `owner` has open on `host` to `promise`.
    fn promised(&mut self, host: usize, owner: &str, promise: Option<u64>) {
        if let (Some(hold), Some(promise)) = (self.open_hold(host, owner), promise) {
            hold.promised_ms = Some(hold.promised_ms.map_or(promise, |p| p.max(promise)));
        }
    }

    /// Whether `owner` has a hold of `name` open on `host` (with `token`, if given).
    fn is_open(&mut self, host: usize, owner: &str, name: &str, token: Option<u64>) -> bool {
        let named = self.hosts[host]
            .open
            .get(owner)
            .is_some_and(|(n, _)| n == name);
        named
            && self
                .open_hold(host, owner)
                .is_some_and(|h| token.is_none_or(|t| t == h.token))
    }

    /// The hold of `owner` on `host` that ended in a loss, if it is still kept.
    fn lost_hold(&mut self, host: usize, owner: &str) -> Option<&mut Hold> {
        let (name, id) = self.hosts[host].lost.get(owner)?;
        self.names
            .get_mut(name)?
            .holds
            .iter_mut()
            .find(|h| h.id == *id)
    }

    /// The hold `owner` has open on `host`, if any, ended at `at` (or its promise, if sooner).
    /// `how` it ended: `released`, `lost`, `evicted` or `expired`.
    fn end(&mut self, host: usize, owner: &str, at: u64, how: &'static str) {
        let Some((name, id)) = self.hosts[host].open.remove(owner) else {
            return;
        };
        if how == "lost" {
            self.hosts[host]
                .lost
                .insert(owner.to_owned(), (name.clone(), id));
        }
        self.close(&name, id, at, how);
        self.publish();
    }

    /// Sets the end of hold `id` of `name` and checks it against every ended hold kept.
    fn close(&mut self, name: &str, id: u64, at: u64, how: &'static str) {
        let slack = self.slack();
        let Some(state) = self.names.get_mut(name) else {
            return;
        };
        let Some(index) = state.holds.iter().position(|h| h.id == id) else {
            return;
        };
        let until = state.holds[index].promised_ms.map_or(at, |p| p.min(at));
        state.holds[index].until_ms = Some(until);
        state.holds[index].lost = how == "lost";
        state.last_ms = state.last_ms.max(at);
        let ended = &state.holds[index];
        if let Some(timelines) = &mut self.timelines {
            let lane = &self.hosts[ended.host].name;
            timelines.mark(
                name,
                Mark::Hold {
                    lane: lane.clone(),
                    from: ended.from_ms,
                    to: until,
                    token: ended.token,
                    how,
                },
            );
            timelines.mark(
                name,
                Mark::Promise {
                    lane: lane.clone(),
                    from: ended.from_ms,
                    to: ended.promised_ms.unwrap_or(until),
                    token: ended.token,
                },
            );
        }
        let mut suspects = Vec::new();
        for other in &state.holds {
            let Some(other_until) = other.until_ms else {
                continue;
            };
            if other.id == ended.id
                || other.owner == ended.owner
                || !(other.exclusive || ended.exclusive)
            {
                continue;
            }
            let (first, second) = if other.from_ms <= ended.from_ms {
                (other, ended)
            } else {
                (ended, other)
            };
            let from = second.from_ms;
            let overlap = other_until.min(until).saturating_sub(from);
            if overlap > slack {
                let lanes = vec![
                    self.hosts[first.host].name.clone(),
                    self.hosts[second.host].name.clone(),
                ];
                let finding = Finding {
                    check: "double_grant",
                    subject: name.to_owned(),
                    at_ms: from,
                    overlap_ms: overlap - slack,
                    detail: format!(
                        "{} and {} held it together for {overlap} ms",
                        holder(&self.hosts, first),
                        holder(&self.hosts, second)
                    ),
                };
                self.counts.overlap_ms += finding.overlap_ms;
                metrics::counter!("leasehold_audit_overlap_milliseconds_total")
                    .increment(finding.overlap_ms);
                found(&mut self.counts, &mut self.made, finding, lanes);
                continue;
            }
            // No two holders believed at once; the promise of one that lost it may still
            // have run past the other's grant. Judged once its holder's release (which
            // gives the promise up) can no longer be on its way.
            if let Some(ready_ms) = promises_overlap(first, second, slack) {
                let (first, second) = (first.id, second.id);
                suspects.push(Suspect {
                    first,
                    second,
                    ready_ms,
                });
            }
        }
        if let Some(state) = self.names.get_mut(name) {
            state.suspects.append(&mut suspects);
        }
    }

    /// Moves the watermark up to what every active host has reached.
    /// Then it settles what the watermark passed: holds whose promises ran out end, grants
    /// and accesses are checked, and what no event to come can need is dropped.
    pub fn advance(&mut self) {
        self.advance_at(std::time::Instant::now());
    }

    /// Whether `host` holds the watermark back at `now`.
    /// It does while it has events to come and has been heard from within `idle_ms`.
    fn active(&self, host: &Host, now: std::time::Instant) -> bool {
        let idle = std::time::Duration::from_millis(self.idle_ms);
        !host.done
            && host
                .heard
                .is_some_and(|t| now.saturating_duration_since(t) < idle)
    }

    /// [`Auditor::advance`], with `now` as this process's time.
    pub fn advance_at(&mut self, now: std::time::Instant) {
        let newest = self.hosts.iter().map(|h| h.latest_ms).max().unwrap_or(0);
        let active = self
            .hosts
            .iter()
            .filter(|h| self.active(h, now))
            .map(|h| h.latest_ms)
            .min();
        // With no host active, nothing moves until one speaks again.
        let reached = active.unwrap_or(self.watermark_ms);
        self.watermark_ms = self.watermark_ms.max(reached);
        metrics::gauge!("leasehold_audit_lag_seconds")
            .set(newest.saturating_sub(self.watermark_ms) as f64 / 1000.0);
        let slack = self.slack();
        // Holds whose promise ran out before their host (or every host) went past it.
        let mut ran_out = Vec::new();
        for (index, host) in self.hosts.iter().enumerate() {
            for (owner, (name, id)) in &host.open {
                let Some(hold) = self
                    .names
                    .get(name)
                    .and_then(|s| s.holds.iter().find(|h| h.id == *id))
                else {
                    continue;
                };
                // A hold that promised nothing ends with a release; a host silent for as
                // long as a name is remembered has let it go, or is gone.
                let gone = host.heard.is_none_or(|t| {
                    now.saturating_duration_since(t)
                        >= std::time::Duration::from_millis(self.forget_ms)
                });
                match hold.promised_ms {
                    Some(promise) => {
                        let seen = host.latest_ms.max(self.watermark_ms);
                        if promise.saturating_add(slack) < seen {
                            ran_out.push((index, owner.clone(), promise));
                        }
                    }
                    // Held at least until the host's last word; nothing is known after that.
                    None if gone && host.heard.is_some() => {
                        ran_out.push((index, owner.clone(), host.latest_ms));
                    }
                    None => {}
                }
            }
        }
        for (host, owner, promise) in ran_out {
            self.end(host, &owner, promise, "expired");
        }
        let watermark = self.watermark_ms;
        let mut settled = Vec::new();
        for name in &self.busy {
            let Some(state) = self.names.get_mut(name) else {
                settled.push(name.clone());
                continue;
            };
            check_order(
                name,
                &mut state.grants,
                watermark,
                slack,
                true,
                &mut self.counts,
                &mut self.made,
            );
            let holds = &state.holds;
            let hosts = &self.hosts;
            let forget = std::time::Duration::from_millis(self.forget_ms);
            state.suspects.retain(|suspect| {
                let hold = |id: u64| holds.iter().find(|h| h.id == id);
                let (Some(first), Some(second)) = (hold(suspect.first), hold(suspect.second))
                else {
                    return false;
                };
                // Every event of the lost holder's record that could give its promise up
                // has been read: the record is past them (or ended, or silent for good).
                let read_past = |h: &Hold| {
                    let host = &hosts[h.host];
                    let awaited = match h.given_up_ms {
                        Some(at) if host.lost.values().any(|(_, id)| *id == h.id) => {
                            at.saturating_add(ANSWER_WINDOW_MS + slack)
                        }
                        _ => 0,
                    };
                    let past = suspect.ready_ms.max(awaited);
                    let gone = host
                        .heard
                        .is_none_or(|t| now.saturating_duration_since(t) >= forget);
                    !h.lost || (past < watermark && (host.latest_ms > past || host.done || gone))
                };
                if watermark < u64::MAX && !(read_past(first) && read_past(second)) {
                    return true;
                }
                if let Some((finding, lanes)) = broken_promise(hosts, name, first, second, slack) {
                    found(&mut self.counts, &mut self.made, finding, lanes);
                }
                false
            });
            // An ended hold is kept while a hold still open could conflict with it: any open
            // hold for an exclusive one, an open exclusive hold for a shared one.
            let open_from = |exclusive_only: bool| {
                state
                    .holds
                    .iter()
                    .filter(|h| h.until_ms.is_none() && (h.exclusive || !exclusive_only))
                    .map(|h| h.from_ms)
                    .min()
                    .unwrap_or(u64::MAX)
                    .min(watermark)
            };
            let (any_from, exclusive_from) = (open_from(false), open_from(true));
            let suspects = &state.suspects;
            state.holds.retain(|h| {
                if suspects.iter().any(|s| s.first == h.id || s.second == h.id) {
                    return true;
                }
                let from = if h.exclusive {
                    any_from
                } else {
                    exclusive_from
                };
                h.promise_end()
                    .is_none_or(|u| u.saturating_add(slack) >= from)
            });
            if state.holds.is_empty() && state.grants.recent.is_empty() {
                settled.push(name.clone());
            }
        }
        // A lost hold no longer kept has nothing left to give up; a host silent, or a
        // process of it that wrote nothing while its record went on, for as long as a name
        // is remembered will not resolve what it left unanswered.
        let names = &self.names;
        let forget_ms = self.forget_ms;
        let forget = std::time::Duration::from_millis(forget_ms);
        for host in &mut self.hosts {
            host.lost.retain(|_, (name, id)| {
                names
                    .get(name)
                    .is_some_and(|state| state.holds.iter().any(|h| h.id == *id))
            });
            let silent = (host.heard).is_none_or(|t| now.saturating_duration_since(t) >= forget);
            let latest = host.latest_ms;
            (host.unanswered)
                .retain(|_, u| !silent && u.last_ms.saturating_add(forget_ms) >= latest);
        }
        for name in settled {
            self.busy.remove(&name);
        }
        let mut settled = Vec::new();
        for resource in &self.busy_resources {
            if let Some((tokens, _)) = self.resources.get_mut(resource) {
                check_order(
                    resource,
                    tokens,
                    watermark,
                    slack,
                    false,
                    &mut self.counts,
                    &mut self.made,
                );
                if tokens.recent.is_empty() {
                    settled.push(resource.clone());
                }
            } else {
                settled.push(resource.clone());
            }
        }
        for resource in settled {
            self.busy_resources.remove(&resource);
        }
        self.publish();
        if let Some(timelines) = &mut self.timelines {
            timelines.advance(watermark);
        }
        if watermark.saturating_sub(self.swept_ms) >= self.forget_ms / 4 {
            self.swept_ms = watermark;
            let horizon = watermark.saturating_sub(self.forget_ms);
            let busy = &self.busy;
            self.names
                .retain(|name, state| state.last_ms >= horizon || busy.contains(name));
            let busy = &self.busy_resources;
            self.resources
                .retain(|name, (_, last)| *last >= horizon || busy.contains(name));
        }
    }

    /// Ends every hold still open at its promise (the record stops here), and checks all.
    pub fn finish(&mut self) {
        let names = &self.names;
        let open: Vec<(usize, String, u64)> = self
            .hosts
            .iter()
            .enumerate()
            .flat_map(|(index, host)| {
                host.open.iter().filter_map(move |(owner, (name, id))| {
                    let hold = names.get(name)?.holds.iter().find(|h| h.id == *id)?;
                    // A hold that promised nothing: held until its host's last word at least.
                    Some((
                        index,
                        owner.clone(),
                        hold.promised_ms.unwrap_or(host.latest_ms),
                    ))
                })
            })
            .collect();
        for (host, owner, end) in open {
            self.end(host, &owner, end, "expired");
        }
        for host in &mut self.hosts {
            host.latest_ms = u64::MAX;
            host.done = true;
        }
        self.watermark_ms = u64::MAX;
        self.advance();
    }
}

/// Checks the tokens `tokens` holds that the watermark has passed.
/// Each must be above (`strict`) or not below every token seen more than `slack` before it. Then folds what
/// no later check can need into the settled highest.
fn check_order(
    subject: &str,
    tokens: &mut Tokens,
    watermark: u64,
    slack: u64,
    strict: bool,
    counts: &mut Counts,
    findings: &mut Vec<(Finding, Vec<String>)>,
) {
    let (check, verb) = if strict {
        ("token_order", "granted")
    } else {
        ("stale_access", "accepted")
    };
    for i in 0..tokens.recent.len() {
        let seen = &tokens.recent[i];
        if seen.checked || seen.at_ms >= watermark {
            continue;
        }
        // The settled highest is from far enough back for every in-order event; a late one
        // may be older than it, and is held only to what came well before it.
        let earlier = tokens
            .recent
            .iter()
            .chain(tokens.settled.iter())
            .filter(|e| e.at_ms.saturating_add(slack) < seen.at_ms)
            .max_by_key(|e| e.token);
        if let Some(highest) = earlier {
            let stale = if strict {
                seen.token <= highest.token
            } else {
                seen.token < highest.token
            };
            if stale {
                let finding = Finding {
                    check,
                    subject: subject.to_owned(),
                    at_ms: seen.at_ms,
                    overlap_ms: 0,
                    detail: format!(
                        "token {} {verb} ({}) after token {} ({}, {} ms before)",
                        seen.token,
                        seen.who,
                        highest.token,
                        highest.who,
                        seen.at_ms.saturating_sub(highest.at_ms)
                    ),
                };
                let lanes = vec![highest.host.clone(), seen.host.clone()];
                found(counts, findings, finding, lanes);
            }
        }
        tokens.recent[i].checked = true;
    }
    let mut kept = Vec::with_capacity(tokens.recent.len());
    for seen in tokens.recent.drain(..) {
        if seen.checked && seen.at_ms.saturating_add(slack) < watermark {
            if tokens.settled.as_ref().is_none_or(|s| seen.token > s.token) {
                tokens.settled = Some(seen);
            }
        } else {
            kept.push(seen);
        }
    }
    tokens.recent = kept;
}

/// A hold's host, token and owner, for people.
fn holder(hosts: &[Host], hold: &Hold) -> String {
    format!(
        "{} token {} ({})",
        hosts[hold.host].name, hold.token, hold.owner
    )
}

/// When to judge two ended holds for a broken promise, if their promises overlapped.
/// `None` if they did not beyond `slack`; else a time past the promise of each that was
/// lost, when its holder's release (which would give the promise up) is known. `first`
/// was granted first.
fn promises_overlap(first: &Hold, second: &Hold, slack: u64) -> Option<u64> {
    let overlap = first
        .promise_end()?
        .min(second.promise_end()?)
        .saturating_sub(second.from_ms);
    if overlap <= slack {
        return None;
    }
    let promise = |h: &Hold| h.promised_ms.or(h.until_ms).unwrap_or(0);
    let ready = [first, second]
        .into_iter()
        .filter(|h| h.lost)
        .map(promise)
        .max()?;
    Some(ready.saturating_add(slack))
}

/// The broken promise two ended holds show, if they still do (see [`promises_overlap`]).
/// `first` was granted first.
fn broken_promise(
    hosts: &[Host],
    name: &str,
    first: &Hold,
    second: &Hold,
    slack: u64,
) -> Option<(Finding, Vec<String>)> {
    let from = second.from_ms;
    let promised = (first.promised_until()?)
        .min(second.promised_until()?)
        .saturating_sub(from);
    if promised <= slack {
        return None;
    }
    let detail = if first.lost {
        format!(
            "{} was granted it while the promise to {} had {} ms to run; that holder \
             learned of its loss {} that grant; the promises overlapped {promised} ms",
            holder(hosts, second),
            holder(hosts, first),
            first.promised_until()?.saturating_sub(from),
            apart(first.until_ms?, from)
        )
    } else {
        format!(
            "{} was granted it while {} held it, and learned of its loss {} ms later; \
             the promises overlapped {promised} ms",
            holder(hosts, second),
            holder(hosts, first),
            second.until_ms?.saturating_sub(from)
        )
    };
    let finding = Finding {
        check: "broken_promise",
        subject: name.to_owned(),
        at_ms: from,
        overlap_ms: promised - slack,
        detail,
    };
    let lanes = vec![
        hosts[first.host].name.clone(),
        hosts[second.host].name.clone(),
    ];
    Some((finding, lanes))
}

/// How `at` stands to `then`: "N ms before" or "N ms after".
fn apart(at: u64, then: u64) -> String {
    if at <= then {
        format!("{} ms before", then - at)
    } else {
        format!("{} ms after", at - then)
    }
}

/// Counts `finding` (by `lanes`, its hosts) and adds it to `findings`.
fn found(
    counts: &mut Counts,
    findings: &mut Vec<(Finding, Vec<String>)>,
    finding: Finding,
    mut lanes: Vec<String>,
) {
    *counts.findings.entry(finding.check.to_owned()).or_default() += 1;
    metrics::counter!("leasehold_audit_findings_total", "check" => finding.check).increment(1);
    lanes.dedup();
    findings.push((finding, lanes));
}
