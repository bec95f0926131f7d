//! What the checks share, derived once from a history.
//! Grants with the server's promises, holds with the workers' checks, faults, and the run's
//! parameters — and the records the checks cannot use (a grant, guard or access without its
//! token or owner), which fail the checks that would otherwise pass over them.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use super::Violation;
use crate::history::{Event, Expiry, History, Kind, Phase};

/// The parameters of a run, recorded as the `value` of the runner's `start` event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RunInfo {
    /// The backend's name.
    pub backend: String,
    /// The scenario's name.
    pub scenario: String,
    /// The seed.
    pub seed: u64,
    /// The lease asked for, µs.
    pub ttl_us: u64,
    /// The lock-delay, µs (0: none).
    pub lock_delay_us: u64,
    /// How long after its holder vanished a waiter must have the lock, in µs.
    /// That is beyond the lease and the lock-delay.
    pub recovery_slack_us: u64,
    /// `counter` or `set`.
    pub workload: String,
    /// `enforce` or `observe`.
    pub mode: String,
    /// Copies of each lock the backend keeps (Redlock: one per node).
    /// A holder's release may remove its own stale copies after it was superseded.
    pub copies: u32,
    /// How far from the real time the workers' wall clocks started, µs (0: not skewed).
    /// The checks do not read the workers' wall clocks; `leasehold audit` does.
    pub clock_skew_us: u64,
}

impl Default for RunInfo {
    fn default() -> Self {
        Self {
            backend: String::new(),
            scenario: String::new(),
            seed: 0,
            ttl_us: 1_000_000,
            lock_delay_us: 0,
            recovery_slack_us: 1_500_000,
            workload: "counter".into(),
            mode: "enforce".into(),
            copies: 1,
            clock_skew_us: 0,
        }
    }
}

/// One server-side grant: an owner that the backend answered "granted" for.
#[derive(Debug, Clone, PartialEq)]
pub struct Grant {
    /// The lock.
    pub lock: String,
    /// The owner id.
    pub owner: String,
    /// The process that asked.
    pub process: String,
    /// The token of its first grant.
    pub token: u64,
    /// When the acquire that first granted it was invoked.
    pub invoked: u64,
    /// When that acquire's answer came.
    pub granted: u64,
    /// Whether it expires without renewal (`After`), never, or with a session.
    pub expiry: Expiry,
    /// The session it is bound to (session backends).
    pub session: Option<String>,
    /// Every answer that extended it: (invoked, answered, promised until).
    /// A grant or renewal of lease `d` invoked at `i` was applied at `i` or later, so the
    /// server promised to keep it until at least `i + d`.
    pub extensions: Vec<(u64, u64, u64)>,
    /// The earliest moment it may have been given up by its holder.
    /// That is a release invoked (answered released, or not answered), or, for grants that
    /// never expire, the holding process killed.
    pub cut: u64,
    /// When the server answered that the owner held nothing.
    /// A renewal answered lost, or a release answered not held.
    pub denials: Vec<u64>,
    /// For a grant bound to a session: the server's own bounds on it, as they became known.
    /// Each is (when, until): the session ttl past the last keep-alive the server
    /// acknowledged (`None` where the backend does not say).
    pub server_bounds: Vec<(u64, Option<u64>)>,
}

impl Grant {
    /// The furthest promise the server made.
    pub fn promise(&self) -> u64 {
        self.extensions.iter().map(|e| e.2).max().unwrap_or(0)
    }

    /// The furthest promise made by answers invoked before `t`.
    pub fn promise_before(&self, t: u64) -> u64 {
        self.extensions
            .iter()
            .filter(|e| e.0 < t)
            .map(|e| e.2)
            .max()
            .unwrap_or(0)
    }

    /// The latest the server may keep the grant by what it had shown before `t`.
    /// That is the promise of a lease counted from its request's send; for a session, the
    /// server's own bound (not the client's deadline, which is the very thing C9 holds to
    /// it). `None` for a session whose backend did not say.
    pub fn server_promise_before(&self, t: u64) -> Option<u64> {
        if !matches!(self.expiry, Expiry::Session { .. }) {
            return Some(self.promise_before(t));
        }
        let known: Vec<Option<u64>> = self
            .server_bounds
            .iter()
            .filter(|(at, _)| *at < t)
            .map(|(_, until)| *until)
            .collect();
        if known.iter().any(Option::is_none) {
            return None;
        }
        Some(known.into_iter().flatten().max().unwrap_or(0))
    }

    /// Until when the grant was certainly held by the server's own promises.
    /// That is the promise, or the cut if earlier.
    pub fn end(&self) -> u64 {
        self.promise().min(self.cut)
    }
}

/// A read or write by a holder, with the outcome of its check of `Guard::is_held`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Access {
    /// When it was invoked (the guard was checked after this).
    pub invoked: u64,
    /// When it completed (the check had happened by then); `u64::MAX` if it did not.
    pub completed: u64,
    /// Whether the guard was held when checked.
    pub held: bool,
}

/// One guard, as its worker saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Hold {
    /// The lock.
    pub lock: String,
    /// The worker.
    pub process: String,
    /// The guard's owner id.
    pub owner: String,
    /// Its token.
    pub token: u64,
    /// When the worker had the guard (its lock call's answer).
    pub start: u64,
    /// When the loss signal fired, if it did.
    pub lost: Option<u64>,
    /// Reads and writes under it.
    pub accesses: Vec<Access>,
}

impl Hold {
    /// The last moment the worker certainly believed it held.
    /// That is the invoke of its last access that found the guard held (or the start).
    pub fn believed_until(&self) -> u64 {
        self.accesses
            .iter()
            .filter(|a| a.held)
            .map(|a| a.invoked)
            .max()
            .unwrap_or(self.start)
            .max(self.start)
    }
}

/// A fault, from the nemesis's events.
#[derive(Debug, Clone, PartialEq)]
pub struct Fault {
    /// What (`pause`, `kill`, `cut`, …).
    pub action: String,
    /// Whom.
    pub target: String,
    /// When it began.
    pub start: u64,
    /// When it ended (`u64::MAX` if it did not).
    pub end: u64,
}

/// What a record without its token or owner was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// A server-side grant (an acquire answered "granted").
    Grant,
    /// A worker's guard (a lock call that succeeded).
    Hold,
    /// A read or write under a guard.
    Access,
}

/// Everything the checks derive from a history.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    /// The run's parameters.
    pub info: RunInfo,
    /// Whether anything ran: the runner started the run, or a worker took part.
    pub ran: bool,
    /// The workers that took part.
    /// Every process but the runner, the resource, the nemesis and the observer.
    pub workers: BTreeSet<String>,
    /// Records the checks cannot use.
    /// A grant without a token, an owner or an expiry, a guard without a token or an owner,
    /// an access under an owner no guard had.
    pub incomplete: Vec<(Record, Violation)>,
    /// Grants, in the order they were first answered.
    pub grants: Vec<Grant>,
    /// Which process acquired each owner id (its first acquire).
    pub owner_process: HashMap<String, String>,
    /// Guards, in the order workers had them.
    pub holds: Vec<Hold>,
    /// Faults.
    pub faults: Vec<Fault>,
}

/// The processes of a run that are not workers.
const NOT_WORKERS: [&str; 4] = ["runner", "resource", "nemesis", "observer"];

impl Facts {
    /// Derives the facts of `history`.
    pub fn new(history: &History) -> Self {
        let start = history
            .events()
            .iter()
            .find(|e| e.process == "runner" && e.kind == Some(Kind::Start));
        let workers: BTreeSet<String> = history
            .events()
            .iter()
            .map(|e| e.process.as_str())
            .filter(|p| !NOT_WORKERS.contains(p))
            .map(str::to_owned)
            .collect();
        let mut facts = Facts {
            info: start
                .and_then(|e| e.value.clone())
                .and_then(|v| serde_json::from_value(v).ok())
                .unwrap_or_default(),
            ran: start.is_some() || !workers.is_empty(),
            workers,
            ..Facts::default()
        };
        facts.faults = faults(history);
        facts.collect_grants(history);
        facts.collect_holds(history);
        facts
    }

    fn collect_grants(&mut self, history: &History) {
        // An owner id may be granted more than once: a grant whose reply came too late is
        // given back and the acquisition goes on under the same id; a later grant with a
        // new token is a new grant. A grant with the same token again is an adoption.
        let mut by_key: HashMap<(String, String), Vec<usize>> = HashMap::new();
        let key = |e: &Event| {
            (
                e.lock.clone().unwrap_or_default(),
                e.owner.clone().unwrap_or_default(),
            )
        };
        let mut acquires = history.ops(Kind::Acquire);
        acquires.sort_by_key(|op| op.end().unwrap_or(u64::MAX));
        for op in &acquires {
            let owner = op.invoke.owner.clone().unwrap_or_default();
            self.owner_process
                .entry(owner)
                .or_insert_with(|| op.process().to_owned());
        }
        for op in acquires {
            if !op.answered("granted") {
                continue;
            }
            let done = op.done.unwrap_or(op.invoke);
            let expiry = done.expiry.unwrap_or(Expiry::Never);
            let promise = expiry.promise(op.start());
            let missing = if op.invoke.owner.is_none() {
                Some("an owner")
            } else if op.token().is_none() {
                Some("a token")
            } else if done.expiry.is_none() {
                Some("an expiry")
            } else {
                None
            };
            if let Some(missing) = missing {
                self.incomplete.push((
                    Record::Grant,
                    Violation::at(
                        done.t,
                        &[op.process()],
                        format!(
                            "{}'s acquire was answered granted without {missing}",
                            op.process()
                        ),
                    ),
                ));
                continue;
            }
            let token = op.token().unwrap_or(0);
            let server_bound = match expiry {
                Expiry::Session { server_until, .. } => vec![(done.t, server_until)],
                _ => Vec::new(),
            };
            let k = key(op.invoke);
            let grants = by_key.entry(k.clone()).or_default();
            match grants.last() {
                Some(&i) if self.grants[i].token == token => {
                    let g = &mut self.grants[i];
                    g.extensions.push((op.start(), done.t, promise));
                    g.server_bounds.extend(server_bound);
                }
                _ => {
                    grants.push(self.grants.len());
                    self.grants.push(Grant {
                        lock: k.0,
                        owner: k.1,
                        process: op.process().to_owned(),
                        token,
                        invoked: op.start(),
                        granted: done.t,
                        expiry,
                        session: session_of(done),
                        extensions: vec![(op.start(), done.t, promise)],
                        cut: u64::MAX,
                        denials: Vec::new(),
                        server_bounds: server_bound,
                    });
                }
            }
        }
        // The grant an owner's call at `t` is about: its latest one answered before.
        let at = |grants: &[Grant], k: &(String, String), t: u64| {
            by_key
                .get(k)?
                .iter()
                .copied()
                .rfind(|i| grants[*i].granted <= t)
        };
        for op in history.ops(Kind::Renew) {
            let Some(i) = at(&self.grants, &key(op.invoke), op.start()) else {
                continue;
            };
            if op.answered("renewed") {
                let done = op.done.unwrap_or(op.invoke);
                let promise = done.expiry.unwrap_or(Expiry::Never).promise(op.start());
                self.grants[i]
                    .extensions
                    .push((op.start(), done.t, promise));
            } else if op.answered("lost")
                && let Some(t) = op.end()
            {
                self.grants[i].denials.push(t);
            }
        }
        let mut releases = history.ops(Kind::Release);
        releases.sort_by_key(|op| op.start());
        for op in releases {
            let Some(i) = at(&self.grants, &key(op.invoke), op.start()) else {
                continue;
            };
            // Only the holder's own release gives the grant up; one sent by another
            // process under this owner id is C8's business.
            if self.grants[i].process != op.process() {
                continue;
            }
            // With several copies of a lock (Redlock), "not held" is what the nodes that
            // answered said; the others may have released.
            if op.answered("not_held") && self.info.copies == 1 {
                if let Some(t) = op.end() {
                    self.grants[i].denials.push(t);
                }
            } else if op.grant_cut() || op.answered("not_held") {
                let g = &mut self.grants[i];
                g.cut = g.cut.min(op.start());
            }
        }
        // Session keep-alives extend every grant bound to their session.
        for event in history.of(Kind::Session) {
            let Some(expiry @ Expiry::Session { server_until, .. }) = event.expiry else {
                continue;
            };
            // An ended session promises nothing more.
            if event.answer.as_deref() == Some("ended") {
                continue;
            }
            let session = session_of(event);
            for g in &mut self.grants {
                if g.process == event.process
                    && g.session.is_some()
                    && g.session == session
                    && event.t >= g.invoked
                {
                    g.extensions
                        .push((event.t, event.t, expiry.promise(event.t)));
                    g.server_bounds.push((event.t, server_until));
                }
            }
        }
        // A killed process's grants that never expire are given up by the OS at the kill.
        for fault in self.faults.iter().filter(|f| f.action == "kill") {
            for g in &mut self.grants {
                if g.process == fault.target && g.expiry == Expiry::Never && g.invoked < fault.start
                {
                    g.cut = g.cut.min(fault.start);
                }
            }
        }
    }

    fn collect_holds(&mut self, history: &History) {
        let mut by_owner: HashMap<String, usize> = HashMap::new();
        for op in history.ops(Kind::Lock) {
            if op.outcome() != Phase::Ok {
                continue;
            }
            let done = op.done.unwrap_or(op.invoke);
            let (Some(owner), Some(token)) = (done.owner.clone(), done.token) else {
                self.incomplete.push((
                    Record::Hold,
                    Violation::at(
                        done.t,
                        &[op.process()],
                        format!(
                            "{} had a guard without {}",
                            op.process(),
                            if done.owner.is_none() {
                                "an owner"
                            } else {
                                "a token"
                            }
                        ),
                    ),
                ));
                continue;
            };
            by_owner.insert(owner.clone(), self.holds.len());
            self.holds.push(Hold {
                lock: op
                    .invoke
                    .lock
                    .clone()
                    .or_else(|| done.lock.clone())
                    .unwrap_or_default(),
                process: op.process().to_owned(),
                owner,
                token,
                start: done.t,
                lost: None,
                accesses: Vec::new(),
            });
        }
        for event in history.of(Kind::Lost) {
            if let Some(&i) = event.owner.as_ref().and_then(|o| by_owner.get(o)) {
                self.holds[i].lost.get_or_insert(event.t);
            }
        }
        let mut accesses = history.ops(Kind::Read);
        accesses.extend(history.ops(Kind::Write));
        for op in accesses {
            let Some(&i) = op.owner().and_then(|o| by_owner.get(o)) else {
                self.incomplete.push((
                    Record::Access,
                    Violation::at(
                        op.start(),
                        &[op.process()],
                        format!(
                            "{} accessed the resource under {}",
                            op.process(),
                            op.owner().map_or("no owner".into(), |o| format!(
                                "owner {o}, which no guard had"
                            ))
                        ),
                    ),
                ));
                continue;
            };
            self.holds[i].accesses.push(Access {
                invoked: op.start(),
                completed: op.done.map_or(u64::MAX, |d| d.t),
                held: op.done.and_then(|d| d.held).unwrap_or(false),
            });
        }
        for hold in &mut self.holds {
            hold.accesses.sort_by_key(|a| a.invoked);
        }
    }

    /// The records of `kind` the checks cannot use.
    pub fn incomplete(&self, kind: Record) -> Vec<Violation> {
        self.incomplete
            .iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// The grants of one lock, grouped.
    pub fn grants_by_lock(&self) -> BTreeMap<&str, Vec<&Grant>> {
        let mut map: BTreeMap<&str, Vec<&Grant>> = BTreeMap::new();
        for g in &self.grants {
            map.entry(g.lock.as_str()).or_default().push(g);
        }
        map
    }

    /// The grant of `owner` on `lock` with `token`.
    pub fn grant(&self, lock: &str, owner: &str, token: u64) -> Option<&Grant> {
        self.grants
            .iter()
            .find(|g| g.lock == lock && g.owner == owner && g.token == token)
    }

    /// The latest grant of `owner` on `lock` answered before `t`.
    pub fn grant_at(&self, lock: &str, owner: &str, t: u64) -> Option<&Grant> {
        self.grants
            .iter()
            .filter(|g| g.lock == lock && g.owner == owner && g.granted <= t)
            .max_by_key(|g| g.granted)
    }

    /// Faults that stop or kill `process`.
    pub fn vanished(&self, process: &str) -> impl Iterator<Item = &Fault> {
        self.faults
            .iter()
            .filter(move |f| f.target == process && matches!(f.action.as_str(), "kill" | "pause"))
    }
}

impl crate::history::Op<'_> {
    /// Whether a release may have removed the grant: answered released, or unanswered.
    fn grant_cut(&self) -> bool {
        self.answered("released") || self.outcome() == Phase::Unknown
    }
}

/// The session id an event names (`value.session`).
fn session_of(event: &Event) -> Option<String> {
    event
        .value
        .as_ref()
        .and_then(|v| v.get("session"))
        .and_then(|s| s.as_str())
        .map(str::to_owned)
}

fn faults(history: &History) -> Vec<Fault> {
    history
        .ops(Kind::Fault)
        .into_iter()
        .map(|op| Fault {
            action: op.invoke.fault.clone().unwrap_or_default(),
            target: op.invoke.target.clone().unwrap_or_default(),
            start: op.start(),
            end: op.done.map_or(u64::MAX, |d| d.t),
        })
        .collect()
}
