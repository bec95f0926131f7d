//! Watching locks change hands: [`Client::watch`](crate::Client::watch).
//!
//! A [`LockWatch`] holds the backend's change feed ([`Backend::changes`](crate::Backend::changes)) and reads a lock
//! again only when the feed names it, or when a holder's lease runs out (where a backend
//! frees leases by time alone, nothing is pushed then). It reports a [`LockChange`] each
//! time what it reads differs from what it read before: a grant, a release, a hand-off, a
//! waiter queued or gone, an eviction. It never polls.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use crate::Client;
use crate::backend::{Change, Changes, Holder, LockState};
use crate::error::{Error, Result};
use crate::name::{LockName, NamePrefix};

/// How long after a holder's lease end a watcher reads its lock again.
/// The server frees it at that end; this covers a server clock read in whole milliseconds.
const AFTER_LEASE_END: Duration = Duration::from_millis(20);

/// One lock whose state changed, as a [`LockWatch`] saw it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LockChange {
    /// The lock.
    pub name: LockName,
    /// What the watch had read before (empty: free, or not read yet).
    pub before: LockState,
    /// What it reads now (empty: free).
    pub after: LockState,
    /// Read when the watch started.
    /// `before` is empty because the watch had not read the lock yet, not because it was
    /// free.
    pub first: bool,
}

impl LockChange {
    /// The holder that replaced another in one change, with the one it replaced.
    /// A hand-off from `before`'s exclusive holder to `after`'s; `None` when the change was
    /// not a hand-off.
    pub fn hand_off(&self) -> Option<(&Holder, &Holder)> {
        match (exclusive(&self.before), exclusive(&self.after)) {
            (Some(from), Some(to)) if from.token != to.token => Some((from, to)),
            _ => None,
        }
    }
}

/// Which locks a [`LockWatch`] follows.
#[derive(Debug)]
enum Scope {
    /// Every lock whose name begins with the prefix.
    Prefix(NamePrefix),
    /// These names, free or not.
    Names(BTreeSet<LockName>),
}

/// Reports the locks of a prefix, or a set of names, as they change.
/// Made by [`Client::watch`] and [`Client::watch_names`]; dropping it ends the backend's
/// change feed.
#[derive(Debug)]
pub struct LockWatch {
    client: Client,
    scope: Scope,
    feed: Changes,
    /// The last state read of each lock that had a holder, a waiter or an eviction.
    /// And of every name of a [`Scope::Names`]; a lock freed is forgotten.
    known: HashMap<LockName, LockState>,
    /// When to read each lock again because a holder's lease ends then.
    /// `lease_end_of` is the same by lock. Only where leases end by time: a session's end
    /// is pushed by the feed.
    lease_ends: BTreeSet<(Instant, LockName)>,
    lease_end_of: HashMap<LockName, Instant>,
    /// Leases end by time on this backend: they are read again at their end.
    timed_leases: bool,
    /// Locks to read again: named by a notice or at a lease end, and not read yet.
    to_read: BTreeSet<LockName>,
    /// Every lock is to be read again (at the start, and after a [`Change::Resync`]).
    to_read_all: bool,
    /// Changes found and not returned yet.
    found: VecDeque<LockChange>,
    /// The first reads are not done yet.
    starting: bool,
}

impl LockWatch {
    pub(crate) async fn prefix(client: Client, prefix: NamePrefix) -> Result<Self> {
        let feed = client.backend().changes(&prefix).await?;
        Ok(Self::new(client, Scope::Prefix(prefix), feed))
    }

    pub(crate) async fn names(client: Client, names: BTreeSet<LockName>) -> Result<Self> {
        let feed = client.backend().changes(&common_prefix(&names)).await?;
        Ok(Self::new(client, Scope::Names(names), feed))
    }

    fn new(client: Client, scope: Scope, feed: Changes) -> Self {
        Self {
            timed_leases: {
                let caps = client.capabilities();
                caps.expiring_leases && !caps.has_sessions()
            },
            client,
            scope,
            feed,
            known: HashMap::new(),
            lease_ends: BTreeSet::new(),
            lease_end_of: HashMap::new(),
            to_read: BTreeSet::new(),
            to_read_all: true,
            found: VecDeque::new(),
            starting: true,
        }
    }

    /// The next change.
    /// The first calls return the locks as they are (for a prefix: each held or queued
    /// lock; for names: every name, free or not), later ones each change as it happens.
    /// Changes that come and go between two reads of a lock may be missed; a lock's last
    /// state is always reported.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a change is taken off only when it is returned, and a lock is taken
    /// off the ones to read only once it has been read.
    ///
    /// # Errors
    ///
    /// Backend errors; [`Error::Backend`] when the backend ends its change feed.
    pub async fn next(&mut self) -> Result<LockChange> {
        loop {
            if let Some(change) = self.found.pop_front() {
                return Ok(change);
            }
            if self.to_read_all {
                self.read_all().await?;
                self.to_read_all = false;
                continue;
            }
            if let Some(name) = self.to_read.first().cloned() {
                let state = self.client.inspect(name.as_str()).await?;
                self.to_read.remove(&name);
                self.saw(name, state);
                continue;
            }
            self.starting = false;
            let due = self.lease_ends.first().map(|(at, _)| *at);
            tokio::select! {
                notice = self.feed.next() => self.take(notice)?,
                () = sleep_until(due) => {
                    let now = Instant::now();
                    while let Some((at, name)) = self.lease_ends.pop_first() {
                        if at > now {
                            self.lease_ends.insert((at, name));
                            break;
                        }
                        self.lease_end_of.remove(&name);
                        self.to_read.insert(name);
                    }
                }
            }
            // The rest of a burst: one read per lock.
            while let Some(notice) = self.feed.try_next() {
                self.take(Some(notice))?;
            }
        }
    }

    /// Notes what a notice asks to read.
    fn take(&mut self, notice: Option<Change>) -> Result<()> {
        match notice {
            None => return Err(Error::backend("the backend ended its change feed", false)),
            Some(Change::Resync) => self.to_read_all = true,
            Some(Change::Lock(name)) => {
                let follows = match &self.scope {
                    Scope::Prefix(prefix) => prefix.matches(&name),
                    Scope::Names(names) => names.contains(&name),
                };
                if follows {
                    self.to_read.insert(name);
                }
            }
        }
        Ok(())
    }

    /// Reads every followed lock.
    /// The names one by one later, or a listing of the prefix now (the locks known and no
    /// longer listed are read again: they are free, or nearly).
    async fn read_all(&mut self) -> Result<()> {
        match &self.scope {
            Scope::Names(names) => self.to_read.extend(names.iter().cloned()),
            Scope::Prefix(prefix) => {
                // Every lock noticed so far is read by the listing (or below, if gone).
                self.to_read.clear();
                let listed: BTreeMap<LockName, LockState> = (self.client)
                    .locks(prefix.as_str())
                    .await?
                    .into_iter()
                    .collect();
                let gone: Vec<LockName> = (self.known.keys())
                    .filter(|name| !listed.contains_key(*name))
                    .cloned()
                    .collect();
                self.to_read.extend(gone);
                for (name, state) in listed {
                    self.saw(name, state);
                }
            }
        }
        Ok(())
    }

    /// Takes `state` as `name`'s latest.
    /// Notes a change (and the first read of a followed name) and when to read it again.
    fn saw(&mut self, name: LockName, state: LockState) {
        if let Some(at) = self.lease_end_of.remove(&name) {
            self.lease_ends.remove(&(at, name.clone()));
        }
        let end = state.holders.iter().filter_map(|h| h.remaining).min();
        // A time left too far off for the clock (a server's answer) is not waited for.
        let at = end
            .filter(|_| self.timed_leases)
            .and_then(|end| Instant::now().checked_add(end.saturating_add(AFTER_LEASE_END)));
        if let Some(at) = at {
            self.lease_ends.insert((at, name.clone()));
            self.lease_end_of.insert(name.clone(), at);
        }
        let empty = is_empty(&state);
        let before = match (&self.scope, empty) {
            // A freed lock of a prefix is forgotten (memory stays flat).
            (Scope::Prefix(_), true) => self.known.remove(&name),
            _ => self.known.insert(name.clone(), state.clone()),
        };
        let changed = match &before {
            Some(before) => !same(before, &state),
            // First seen: held, or one of the names followed.
            None => !empty || matches!(self.scope, Scope::Names(_)),
        };
        if changed {
            self.found.push_back(LockChange {
                name,
                before: before.unwrap_or_default(),
                after: state,
                first: self.starting,
            });
        }
    }
}

fn exclusive(state: &LockState) -> Option<&Holder> {
    (state.holders.iter()).find(|h| h.mode == crate::backend::Mode::Exclusive)
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Nobody holds or waits.
/// A lock's evictions alone do not keep it followed: backends keep them for days.
fn is_empty(state: &LockState) -> bool {
    state.holders.is_empty() && state.waiters.is_empty()
}

/// Whether two reads show the same holders, waiters and evictions.
/// Times left aside, and `kept` (an inspect labels it, a listing does not).
fn same(a: &LockState, b: &LockState) -> bool {
    let holders = |s: &LockState| {
        (s.holders.iter())
            .map(|h| (h.owner.clone(), h.mode, h.token, h.value.clone()))
            .collect::<Vec<_>>()
    };
    holders(a) == holders(b) && a.waiters == b.waiters && a.evictions == b.evictions
}

/// The longest prefix every name begins with that is itself a valid prefix.
fn common_prefix(names: &BTreeSet<LockName>) -> NamePrefix {
    let (Some(first), Some(last)) = (names.first(), names.last()) else {
        return NamePrefix::default();
    };
    // Sorted: what the first and last names share, every name shares.
    let shared: String = (first.as_str().chars())
        .zip(last.as_str().chars())
        .take_while(|(a, b)| a == b)
        .map(|(a, _)| a)
        .collect();
    NamePrefix::new(&shared).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_share_the_prefix_of_their_first_and_last() {
        let names = |list: &[&str]| -> BTreeSet<LockName> {
            list.iter().map(|n| LockName::new(n).unwrap()).collect()
        };
        assert_eq!(
            common_prefix(&names(&["jobs:b", "jobs:a", "jobs:ab"])).as_str(),
            "jobs:"
        );
        assert_eq!(common_prefix(&names(&["a", "b"])).as_str(), "");
        assert_eq!(common_prefix(&names(&["solo"])).as_str(), "solo");
        assert_eq!(common_prefix(&BTreeSet::new()).as_str(), "");
    }
}
