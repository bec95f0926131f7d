//! The in-memory backend: the reference semantics of the [`Backend`] contract, in one process.
//!
//! It implements everything — expiring leases on its own [`Clock`], FIFO queues with
//! expiring entries, shared mode, permits, lock-delay, push wake-ups — exactly as the
//! contract describes, so doctests and unit tests exercise the real engine against a real
//! backend. Give it a `ManualClock` (feature `test-util`) to move its time by hand.
//!
//! Tokens live in the process: they start at 1 for every new `InMemory`. The state of a
//! name (its token counter) is kept for the life of the backend.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;

use crate::backend::{
    Acquire, Backend, Capabilities, ChangeSender, Changes, Eviction, Expiry, Grant, Holder,
    ListCursor, Listing, LockState, Mode, Release, Renewal, Request, TokenDurability, WaitHint,
    Waiter,
};
use crate::clock::{Clock, Instant, SystemClock};
use crate::error::{Error, LossReason, Result};
use crate::fencing::FencingToken;
use crate::name::{LockName, NamePrefix, OwnerId, RecordKey};
use crate::support::queue;

/// An in-process lock server. Clones share the same locks.
///
/// ```
/// use std::time::Duration;
/// use leasehold_core::{Client, LockOptions, clock::ManualClock, memory::InMemory};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold_core::Result<()> {
/// let clock = ManualClock::new();
/// let server = InMemory::with_clock(clock.clone());
/// let options = LockOptions::builder().ttl(Duration::from_secs(10)).build()?;
/// let a = Client::builder(server.clone()).clock(clock.clone()).options(options.clone()).build();
/// let b = Client::builder(server).clock(clock.clone()).options(options).build();
///
/// let guard = a.mutex("job")?.lock().await?;
/// // The holder counts on 10 s minus the drift allowance (1 % + 2 ms), from the send time.
/// assert_eq!(guard.remaining(), Duration::from_millis(9_898));
/// assert!(b.mutex("job")?.try_lock().await?.is_none());
/// guard.release().await?;
/// let next = b.mutex("job")?.try_lock().await?.expect("free after the release");
/// assert_eq!(next.token().get(), 2);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct InMemory {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    clock: Arc<dyn Clock>,
    names: Mutex<HashMap<LockName, Entry>>,
    /// Change feeds (see [`Backend::changes`]).
    /// One whose watcher has gone is dropped at the next change.
    feeds: Mutex<Vec<(NamePrefix, ChangeSender)>>,
}

/// How many evictions of a name are kept.
const EVICTIONS_KEPT: usize = 10;

/// Everything about one name.
#[derive(Debug)]
struct Entry {
    /// `[lock set, permit set]`.
    sets: [Set; 2],
    last_token: u64,
    /// The latest evictions, newest first (at most [`EVICTIONS_KEPT`]).
    evictions: Vec<Eviction>,
    /// Records written by holders (see [`Backend::put_record`]), and until when each is kept.
    records: HashMap<RecordKey, (Vec<u8>, Instant)>,
    /// Bumped on every change; waiters watch it.
    version: watch::Sender<u64>,
}

#[derive(Debug, Default)]
struct Set {
    holders: Vec<Held>,
    queue: VecDeque<Queued>,
    /// Lock-delay: closed to new grants until then.
    closed_until: Option<Instant>,
    /// When the last holder released, leaving the set free.
    /// The next grant, if it goes to a waiting request, reports the hand-off from it.
    released: Option<Instant>,
}

#[derive(Debug)]
struct Held {
    owner: OwnerId,
    mode: Mode,
    token: FencingToken,
    granted: Instant,
    expires: Instant,
    lock_delay: Option<Duration>,
    value: Option<Arc<[u8]>>,
}

#[derive(Debug)]
struct Queued {
    owner: OwnerId,
    mode: Mode,
    expires: Instant,
}

impl Entry {
    fn new() -> Self {
        Self {
            sets: Default::default(),
            last_token: 0,
            evictions: Vec::new(),
            records: HashMap::new(),
            version: watch::Sender::new(0),
        }
    }

    fn set(&mut self, mode: Mode) -> &mut Set {
        &mut self.sets[usize::from(mode.is_permit())]
    }

    fn bump(&self) {
        bump(&self.version);
    }

    fn hint(&self) -> WaitHint {
        hint(&self.version)
    }

    /// Drops expired holders and queue entries of both sets; returns whether anything changed.
    fn purge(&mut self, now: Instant) -> bool {
        let mut changed = false;
        for set in &mut self.sets {
            let before = (set.holders.len(), set.queue.len());
            for held in set.holders.iter().filter(|h| h.expires <= now) {
                if let Some(delay) = held.lock_delay {
                    let until = held.expires.saturating_add(delay);
                    set.closed_until = Some(set.closed_until.map_or(until, |c| c.max(until)));
                }
            }
            set.holders.retain(|h| h.expires > now);
            set.queue.retain(|q| q.expires > now);
            if set.closed_until.is_some_and(|until| until <= now) {
                set.closed_until = None;
            }
            changed |= before != (set.holders.len(), set.queue.len());
        }
        self.records.retain(|_, (_, until)| *until > now);
        if changed {
            self.bump();
        }
        changed
    }

    /// Holders (lock set first) and waiters at `now`, without a hint.
    fn state(&self, now: Instant) -> LockState {
        let mut state = LockState {
            evictions: self.evictions.clone(),
            ..LockState::default()
        };
        for set in &self.sets {
            state.holders.extend(set.holders.iter().map(|h| {
                Holder::new(h.owner.clone(), h.mode, h.token)
                    .with_remaining(Some(h.expires.saturating_duration_since(now)))
                    .with_value(h.value.clone())
                    .with_held(Some(now.saturating_duration_since(h.granted)))
            }));
            state.waiters.extend(
                set.queue
                    .iter()
                    .map(|q| Waiter::new(q.owner.clone(), q.mode)),
            );
        }
        state
    }

    /// The next instant at which purging would change something.
    fn next_expiry(&self) -> Option<Instant> {
        self.sets
            .iter()
            .flat_map(|set| {
                set.holders
                    .iter()
                    .map(|h| h.expires)
                    .chain(set.queue.iter().map(|q| q.expires))
                    .chain(set.closed_until)
            })
            .min()
    }
}

fn bump(version: &watch::Sender<u64>) {
    version.send_modify(|v| *v += 1);
}

fn hint(version: &watch::Sender<u64>) -> WaitHint {
    WaitHint::new(*version.borrow())
}

/// Whether a request in `mode` may be granted beside `holders`, before the queued `ahead`.
/// `holders` are in grant order, and `ahead` have not claimed their places yet; the rule is
/// the contract's one rule ([`support::queue`](crate::support::queue)).
fn compatible(holders: &[Held], ahead: &[Queued], mode: Mode) -> bool {
    let holders: Vec<Mode> = holders.iter().map(|h| h.mode).collect();
    let ahead: Vec<Mode> = ahead.iter().map(|q| q.mode).collect();
    queue::may_hold(&holders, &ahead, &mode)
}

impl InMemory {
    /// A server on the system clock.
    pub fn new() -> Self {
        Self::with_clock(SystemClock)
    }

    /// A server whose leases expire by `clock`.
    pub fn with_clock(clock: impl Clock) -> Self {
        Self {
            inner: Arc::new(Inner {
                clock: Arc::new(clock),
                names: Mutex::new(HashMap::new()),
                feeds: Mutex::new(Vec::new()),
            }),
        }
    }

    fn with_entry<T>(&self, name: &LockName, f: impl FnOnce(&mut Entry, Instant) -> T) -> T {
        let now = self.inner.clock.now();
        let mut names = self.inner.names.lock().unwrap_or_else(|e| e.into_inner());
        let entry = names.entry(name.clone()).or_insert_with(Entry::new);
        let before = *entry.version.borrow();
        entry.purge(now);
        let out = f(entry, now);
        let changed = *entry.version.borrow() != before;
        drop(names);
        if changed {
            self.tell_feeds(name);
        }
        out
    }

    /// Sends a notice of `name` to every feed whose prefix it has.
    fn tell_feeds(&self, name: &LockName) {
        let mut feeds = self.inner.feeds.lock().unwrap_or_else(|e| e.into_inner());
        feeds.retain(|(_, feed)| !feed.is_closed());
        for (prefix, feed) in feeds.iter() {
            if prefix.matches(name) {
                feed.changed(name.clone());
            }
        }
    }
}

impl Default for InMemory {
    fn default() -> Self {
        Self::new()
    }
}

fn expiry_after(now: Instant, ttl: Duration) -> Result<Instant> {
    now.checked_add(ttl)
        .ok_or_else(|| Error::invalid("ttl", format!("{ttl:?} overflows the clock")))
}

#[async_trait]
impl Backend for InMemory {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            expiring_leases: true,
            fair: true,
            push_wakeups: true,
            shared: true,
            permits: true,
            lock_delay: true,
            ..Capabilities::new("memory", TokenDurability::Process)
        }
    }

    async fn acquire(&self, req: &Request) -> Result<Acquire> {
        self.with_entry(&req.name, |entry, now| {
            let expires = expiry_after(now, req.ttl)?;
            let next_token = entry.last_token + 1;
            let Entry {
                sets,
                version,
                last_token,
                ..
            } = entry;
            let set = &mut sets[usize::from(req.mode.is_permit())];
            if let Some(held) = set.holders.iter_mut().find(|h| h.owner == req.owner) {
                held.expires = expires;
                return Ok(Acquire::Granted(Grant::new(
                    held.token,
                    Expiry::After(req.ttl),
                )));
            }
            let mut changed = false;
            let mut position = set.queue.iter().position(|q| q.owner == req.owner);
            if req.fair && req.waiting {
                match position {
                    Some(p) => set.queue[p].expires = expires,
                    None => {
                        set.queue.push_back(Queued {
                            owner: req.owner.clone(),
                            mode: req.mode,
                            expires,
                        });
                        position = Some(set.queue.len() - 1);
                        changed = true;
                    }
                }
            }
            let ahead = match (req.fair, position) {
                (false, _) => 0,
                (true, Some(p)) => p,
                (true, None) => set.queue.len(),
            };
            let closed = set.closed_until.is_some_and(|until| now < until);
            let queue = set.queue.make_contiguous();
            if closed || !compatible(&set.holders, &queue[..ahead], req.mode) {
                if changed {
                    bump(version);
                }
                return Ok(Acquire::Busy(hint(version)));
            }
            if let Some(p) = position {
                set.queue.remove(p);
            }
            set.holders.push(Held {
                owner: req.owner.clone(),
                mode: req.mode,
                token: FencingToken::new(next_token),
                granted: now,
                expires,
                lock_delay: req.lock_delay,
                value: req.value.clone(),
            });
            *last_token = next_token;
            bump(version);
            let handoff = set.released.take().filter(|_| req.waiting);
            Ok(Acquire::Granted(
                Grant::new(FencingToken::new(next_token), Expiry::After(req.ttl))
                    .with_handoff(handoff.map(|at| now.saturating_duration_since(at))),
            ))
        })
    }

    async fn renew(&self, req: &Request) -> Result<Renewal> {
        self.with_entry(&req.name, |entry, now| {
            let expires = expiry_after(now, req.ttl)?;
            let Entry {
                sets, evictions, ..
            } = entry;
            let set = &mut sets[usize::from(req.mode.is_permit())];
            Ok(
                match set.holders.iter_mut().find(|h| h.owner == req.owner) {
                    Some(held) => {
                        held.expires = expires;
                        Renewal::Renewed(Expiry::After(req.ttl))
                    }
                    None if evictions.iter().any(|e| e.owner == req.owner) => {
                        Renewal::Lost(LossReason::Evicted)
                    }
                    None => Renewal::Lost(LossReason::NotOwner),
                },
            )
        })
    }

    async fn release(&self, req: &Request) -> Result<Release> {
        Ok(self.with_entry(&req.name, |entry, now| {
            let set = entry.set(req.mode);
            let before = (set.holders.len(), set.queue.len());
            set.holders.retain(|h| h.owner != req.owner);
            set.queue.retain(|q| q.owner != req.owner);
            if before == (set.holders.len(), set.queue.len()) {
                return Release::NotHeld;
            }
            if set.holders.is_empty() && before.0 > 0 {
                set.released = Some(now);
            }
            entry.bump();
            Release::Released
        }))
    }

    async fn wait(&self, name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        let clock = self.inner.clock.clone();
        let (mut version, next_expiry, now) = self.with_entry(name, |entry, now| {
            (entry.version.subscribe(), entry.next_expiry(), now)
        });
        if hint.get::<u64>() != Some(&*version.borrow_and_update()) {
            return Ok(());
        }
        let until = now.saturating_add(max);
        let until = next_expiry.map_or(until, |expiry| expiry.min(until));
        tokio::select! {
            _ = version.changed() => {}
            () = clock.sleep_until(until) => {}
        }
        Ok(())
    }

    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        Ok(self.with_entry(name, |entry, now| LockState {
            hint: entry.hint(),
            ..entry.state(now)
        }))
    }

    async fn keep(&self, req: &Request, hold: Duration) -> Result<bool> {
        self.with_entry(&req.name, |entry, now| {
            let expires = expiry_after(now, hold)?;
            let set = entry.set(req.mode);
            let Some(held) = set.holders.iter_mut().find(|h| h.owner == req.owner) else {
                return Ok(false);
            };
            held.expires = expires;
            // Waiters were told the old end; the new one may be sooner.
            entry.bump();
            Ok(true)
        })
    }

    async fn put_record(
        &self,
        req: &Request,
        key: &RecordKey,
        value: &[u8],
        keep: Duration,
    ) -> Result<bool> {
        self.with_entry(&req.name, |entry, now| {
            let until = expiry_after(now, keep)?;
            if !entry
                .set(req.mode)
                .holders
                .iter()
                .any(|h| h.owner == req.owner)
            {
                return Ok(false);
            }
            entry.records.insert(key.clone(), (value.to_vec(), until));
            Ok(true)
        })
    }

    async fn get_record(&self, name: &LockName, key: &RecordKey) -> Result<Option<Vec<u8>>> {
        Ok(self.with_entry(name, |entry, _| {
            entry.records.get(key).map(|(value, _)| value.clone())
        }))
    }

    async fn evict(&self, name: &LockName, mode: Mode, eviction: &Eviction) -> Result<bool> {
        Ok(self.with_entry(name, |entry, _| {
            let set = entry.set(mode);
            let evicted = (set.holders.iter())
                .position(|h| h.owner == eviction.owner && h.token == eviction.token);
            let Some(evicted) = evicted else {
                return false;
            };
            let held = set.holders.remove(evicted);
            // Closed until the evicted lease would have ended (its holder finds out first),
            // and for its lock-delay after that, as if it had expired.
            let until = held
                .expires
                .saturating_add(held.lock_delay.unwrap_or_default());
            set.closed_until = Some(set.closed_until.map_or(until, |c| c.max(until)));
            entry.evictions.insert(0, eviction.clone());
            entry.evictions.truncate(EVICTIONS_KEPT);
            entry.bump();
            true
        }))
    }

    async fn changes(&self, prefix: &NamePrefix) -> Result<Changes> {
        let (feed, changes) = Changes::channel();
        let mut feeds = self.inner.feeds.lock().unwrap_or_else(|e| e.into_inner());
        feeds.retain(|(_, feed)| !feed.is_closed());
        feeds.push((prefix.clone(), feed));
        Ok(changes)
    }

    async fn list(
        &self,
        prefix: &NamePrefix,
        cursor: Option<&ListCursor>,
        page: usize,
    ) -> Result<Listing> {
        let now = self.inner.clock.now();
        let mut names = self.inner.names.lock().unwrap_or_else(|e| e.into_inner());
        let after = cursor.map(ListCursor::as_str);
        let mut matching: Vec<&LockName> = names
            .keys()
            .filter(|name| prefix.matches(name) && after.is_none_or(|a| name.as_str() > a))
            .collect();
        matching.sort_unstable();
        matching.truncate(page.max(1));
        let next = (matching.len() == page.max(1))
            .then(|| matching.last().map(|last| ListCursor::new(last.as_str())))
            .flatten();
        let matching: Vec<LockName> = matching.into_iter().cloned().collect();
        let mut locks = Vec::new();
        let mut purged = Vec::new();
        for name in matching {
            let Some(entry) = names.get_mut(&name) else {
                continue;
            };
            if entry.purge(now) {
                purged.push(name.clone());
            }
            let state = entry.state(now);
            if !state.holders.is_empty() || !state.waiters.is_empty() {
                locks.push((name, state));
            }
        }
        drop(names);
        for name in &purged {
            self.tell_feeds(name);
        }
        Ok(Listing::new(locks, next))
    }
}
