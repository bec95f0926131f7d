//! The history of a run: one JSON object per line, stamped by the collector.
//!
//! Every process of a run (workers, the fenced resource, the nemesis, the observer) sends
//! its events to the collector, which stamps each with its own monotonic clock on arrival
//! ([`Event::t`], microseconds since the run began) and its arrival order ([`Event::seq`]).
//! An operation is an `invoke` event and, later, one completion (`ok`, `fail` or
//! `unknown`) with the same [`Event::process`] and [`Event::op`].
//!
//! Invokes are acknowledged before the process goes on, so an invoke's stamp is never
//! later than the start of what it announces; completions are stamped on arrival, so never
//! earlier than what they report. Every interval of the history therefore contains the
//! real one — the checks can only be too lenient, never raise a false alarm, because of
//! where the stamps fall.

use std::collections::HashMap;
use std::io::{self, BufRead, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

/// What an event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A backend acquire call, as the server answered it (recorded below the engine).
    Acquire,
    /// A backend renewal call.
    Renew,
    /// A backend release call.
    Release,
    /// A backend session's new deadline (etcd, ZooKeeper): info events.
    Session,
    /// The worker's lock call (`Mutex::lock_timeout`): the guard the user sees.
    Lock,
    /// The worker's `Guard::release`.
    Unlock,
    /// The guard's loss signal fired (info).
    Lost,
    /// A fenced read of the resource (read-modify-write workloads read under the token).
    Read,
    /// A fenced write to the resource.
    Write,
    /// The resource applied (or refused) a read or write: its own log (info).
    Apply,
    /// A fault injected by the nemesis: invoke when it starts, ok when it ends.
    Fault,
    /// The server's view of a lock (`Client::inspect`), from the observer.
    Inspect,
    /// The resource's final state (info).
    Final,
    /// A process started (info; `value` has its pid).
    Start,
}

/// Where an operation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// It begins.
    Invoke,
    /// It completed and did what it asked.
    Ok,
    /// It completed and did not (busy, refused, not held, an error that says nothing was applied).
    Fail,
    /// It ended without an answer: it may or may not have been applied.
    Unknown,
    /// A single event, not part of an operation.
    Info,
}

/// How long the server keeps a grant, as the backend answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Expiry {
    /// This many microseconds after the server applied the request.
    After {
        /// The lease, in microseconds.
        us: u64,
    },
    /// Until released or the holding process dies.
    Never,
    /// While the client's session lives: until at least `until` (collector time, µs).
    Session {
        /// The session's deadline as the client counts it, on the collector's timeline.
        until: u64,
        /// The server's own bound, where the backend says.
        /// That is the session ttl the server granted past the last moment it certainly
        /// heard from the session (the send time of the last keep-alive it acknowledged).
        /// The server may end the session (and free its locks) from then on; `until` is
        /// earlier by the client's drift allowance.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        server_until: Option<u64>,
    },
}

impl Expiry {
    /// The end of the lease the server promised for a request of this expiry invoked at `invoked`.
    /// It is a lease counted from the invoke (the server applied the request later), the
    /// session's deadline — or the server's bound if that is earlier: a backend that counts
    /// on its session past the server's bound is promised nothing beyond it —, or never
    /// (`u64::MAX`).
    ///
    /// A session is not counted to the server's bound alone: a client may close its
    /// session once its own deadline has passed (ZooKeeper's does), freeing its locks
    /// before that bound, and the history does not show the close.
    pub fn promise(self, invoked: u64) -> u64 {
        match self {
            Expiry::After { us } => invoked.saturating_add(us),
            Expiry::Session {
                until,
                server_until,
            } => until.min(server_until.unwrap_or(until)),
            Expiry::Never => u64::MAX,
        }
    }
}

/// One event of a history. Fields that do not apply to an event's kind are absent.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Event {
    /// Microseconds since the run began, on the collector's monotonic clock.
    #[serde(default)]
    pub t: u64,
    /// Arrival order at the collector.
    #[serde(default)]
    pub seq: u64,
    /// Who: `w1`… for workers, `resource`, `nemesis`, `observer`.
    pub process: String,
    /// Pairs an invoke with its completion, per process.
    #[serde(default)]
    pub op: u64,
    /// What.
    pub kind: Option<Kind>,
    /// Where it stands.
    pub phase: Option<Phase>,
    /// The lock name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock: Option<String>,
    /// The owner id the request carried (backend calls) or the guard's.
    /// The guard's for lock, unlock, lost, read, write and apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The fencing token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<u64>,
    /// The answer in words.
    /// For example `granted`, `busy`, `renewed`, `lost`, `released`, `not_held`,
    /// `accepted`, `refused`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// The grant's or renewal's expiry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expiry: Option<Expiry>,
    /// The value read or written; an inspect's holders; a fault's parameters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<serde_json::Value>,
    /// The resource's value before an applied write.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prev: Option<serde_json::Value>,
    /// Whether the worker's guard was held when it checked.
    /// Reads and writes are checked after the invoke was stamped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<bool>,
    /// For resource events: the worker whose request it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// For faults: what was done (`pause`, `kill`, `cut`, …); for losses: the reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<String>,
    /// For faults: whom (`w2`, `redis 0`, `link w1`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// An error message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Event {
    /// A new event of `process` (unstamped).
    pub fn new(process: impl Into<String>, kind: Kind, phase: Phase) -> Self {
        Self {
            process: process.into(),
            kind: Some(kind),
            phase: Some(phase),
            ..Self::default()
        }
    }

    /// With the operation id.
    pub fn op(mut self, op: u64) -> Self {
        self.op = op;
        self
    }

    /// With the lock name.
    pub fn lock(mut self, lock: impl Into<String>) -> Self {
        self.lock = Some(lock.into());
        self
    }

    /// With the owner id.
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = Some(owner.into());
        self
    }

    /// With the token.
    pub fn token(mut self, token: u64) -> Self {
        self.token = Some(token);
        self
    }

    /// With the answer.
    pub fn answer(mut self, answer: impl Into<String>) -> Self {
        self.answer = Some(answer.into());
        self
    }

    /// With the expiry.
    pub fn expiry(mut self, expiry: Expiry) -> Self {
        self.expiry = Some(expiry);
        self
    }

    /// With a value.
    pub fn value(mut self, value: serde_json::Value) -> Self {
        self.value = Some(value);
        self
    }

    /// With the error.
    pub fn error(mut self, error: impl Into<String>) -> Self {
        self.error = Some(error.into());
        self
    }

    /// At `t` (for hand-made histories).
    pub fn at(mut self, t: u64) -> Self {
        self.t = t;
        self
    }

    /// The kind (events read from a file always have one; see [`History::read`]).
    pub fn kind(&self) -> Kind {
        self.kind.unwrap_or(Kind::Start)
    }

    /// The phase.
    pub fn phase(&self) -> Phase {
        self.phase.unwrap_or(Phase::Info)
    }

    /// Whether this event is `kind` in `phase`.
    pub fn is(&self, kind: Kind, phase: Phase) -> bool {
        self.kind == Some(kind) && self.phase == Some(phase)
    }
}

/// One operation: its invoke and, if it came, its completion.
#[derive(Debug, Clone, Copy)]
pub struct Op<'a> {
    /// The invoke.
    pub invoke: &'a Event,
    /// The completion; `None` if none came (the process died, or the run ended first).
    pub done: Option<&'a Event>,
}

impl<'a> Op<'a> {
    /// When it was invoked.
    pub fn start(&self) -> u64 {
        self.invoke.t
    }

    /// When it completed; `None` if the outcome is unknown.
    pub fn end(&self) -> Option<u64> {
        self.done
            .filter(|d| d.phase() != Phase::Unknown)
            .map(|d| d.t)
    }

    /// The completion's phase; [`Phase::Unknown`] without one.
    pub fn outcome(&self) -> Phase {
        self.done.map_or(Phase::Unknown, Event::phase)
    }

    /// The answer of the completion.
    pub fn answer(&self) -> Option<&'a str> {
        self.done.and_then(|d| d.answer.as_deref())
    }

    /// The owner: the invoke's, or the completion's.
    pub fn owner(&self) -> Option<&'a str> {
        self.invoke
            .owner
            .as_deref()
            .or_else(|| self.done.and_then(|d| d.owner.as_deref()))
    }

    /// The token: the completion's, or the invoke's.
    pub fn token(&self) -> Option<u64> {
        self.done.and_then(|d| d.token).or(self.invoke.token)
    }

    /// The process.
    pub fn process(&self) -> &'a str {
        &self.invoke.process
    }

    /// Whether it completed with `ok` and answer `answer`.
    pub fn answered(&self, answer: &str) -> bool {
        self.outcome() == Phase::Ok && self.answer() == Some(answer)
    }
}

/// A run's events, in stamp order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct History {
    events: Vec<Event>,
}

impl History {
    /// A history of `events`, sorted by stamp (then arrival).
    pub fn new(mut events: Vec<Event>) -> Self {
        events.sort_by_key(|e| (e.t, e.seq));
        Self { events }
    }

    /// A history made by hand (tests).
    /// Events are stamped 0, 1, 2, … in the order given unless they carry a stamp already.
    pub fn from_events(events: impl IntoIterator<Item = Event>) -> Self {
        let events = events
            .into_iter()
            .enumerate()
            .map(|(i, mut e)| {
                e.seq = i as u64;
                e
            })
            .collect();
        Self::new(events)
    }

    /// The events.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// Events of `kind`.
    pub fn of(&self, kind: Kind) -> impl DoubleEndedIterator<Item = &Event> {
        self.events.iter().filter(move |e| e.kind == Some(kind))
    }

    /// The operations of `kind`, in invoke order: each invoke with its completion.
    pub fn ops(&self, kind: Kind) -> Vec<Op<'_>> {
        let mut open: HashMap<(&str, u64), usize> = HashMap::new();
        let mut ops: Vec<Op<'_>> = Vec::new();
        for event in self.of(kind) {
            match event.phase() {
                Phase::Invoke => {
                    open.insert((&event.process, event.op), ops.len());
                    ops.push(Op {
                        invoke: event,
                        done: None,
                    });
                }
                Phase::Info => {}
                _ => {
                    if let Some(i) = open.remove(&(event.process.as_str(), event.op)) {
                        ops[i].done = Some(event);
                    }
                }
            }
        }
        ops
    }

    /// The last stamp.
    pub fn end(&self) -> u64 {
        self.events.last().map_or(0, |e| e.t)
    }

    /// Reads a JSON-lines history.
    ///
    /// # Errors
    ///
    /// I/O errors; `InvalidData` for a line that is not an event (with its number).
    pub fn read(path: &Path) -> io::Result<Self> {
        let file = io::BufReader::new(std::fs::File::open(path)?);
        let mut events = Vec::new();
        for (n, line) in file.lines().enumerate() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            let event: Event = serde_json::from_str(&line).map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}:{}: not an event: {e}", path.display(), n + 1),
                )
            })?;
            if event.kind.is_none() || event.phase.is_none() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{}:{}: an event needs a kind and a phase",
                        path.display(),
                        n + 1
                    ),
                ));
            }
            events.push(event);
        }
        Ok(Self::new(events))
    }

    /// Writes the history as JSON lines.
    ///
    /// # Errors
    ///
    /// I/O errors.
    pub fn write(&self, path: &Path) -> io::Result<()> {
        let mut out = io::BufWriter::new(std::fs::File::create(path)?);
        for event in &self.events {
            serde_json::to_writer(&mut out, event)?;
            out.write_all(b"\n")?;
        }
        out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_pair_invokes_with_completions_per_process() {
        let h = History::from_events([
            Event::new("w1", Kind::Lock, Phase::Invoke).op(1).at(1),
            Event::new("w2", Kind::Lock, Phase::Invoke).op(1).at(2),
            Event::new("w2", Kind::Lock, Phase::Ok).op(1).token(5).at(3),
            Event::new("w1", Kind::Lock, Phase::Unknown).op(1).at(4),
            Event::new("w1", Kind::Lock, Phase::Invoke).op(2).at(5),
        ]);
        let ops = h.ops(Kind::Lock);
        assert_eq!(ops.len(), 3);
        assert_eq!(ops[0].process(), "w1");
        assert_eq!(ops[0].outcome(), Phase::Unknown);
        assert_eq!(ops[0].end(), None);
        assert_eq!(ops[1].token(), Some(5));
        assert_eq!(ops[1].end(), Some(3));
        assert!(ops[2].done.is_none());
    }

    #[test]
    fn a_history_survives_a_round_trip_through_json_lines() {
        let h = History::from_events([
            Event::new("w1", Kind::Acquire, Phase::Invoke)
                .op(7)
                .owner("o")
                .lock("l")
                .at(10),
            Event::new("w1", Kind::Acquire, Phase::Ok)
                .op(7)
                .token(3)
                .answer("granted")
                .expiry(Expiry::After { us: 1000 })
                .at(12),
        ]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.jsonl");
        h.write(&path).unwrap();
        assert_eq!(History::read(&path).unwrap(), h);
        std::fs::write(&path, "{\"process\":\"w1\"}\n").unwrap();
        assert!(History::read(&path).is_err());
    }
}
