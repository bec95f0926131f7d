//! The registry: by owner, the key each acquisition has placed or is placing.
//! A release needs it to remove exactly its own key. An entry lives from the acquisition's
//! first request to the answer of its release (or the end of its session, for an abandoned
//! one), so the registry holds the client's current acquisitions and nothing else — and
//! the slots of kept keys (see [`Registry::keep`]) until a read shows them gone.

use std::collections::{BTreeSet, HashMap};

use leasehold_core::OwnerId;
use leasehold_core::clock::Instant;

use crate::layout::Set;

/// The placed entries, by owner.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    by_owner: HashMap<OwnerId, Placed>,
    /// Slots taken, per session lease and queue directory.
    taken: HashMap<(i64, String), BTreeSet<u32>>,
    /// Keys kept past their acquisition, whose slots stay taken while they may exist.
    kept: Vec<Kept>,
}

/// A key kept past its acquisition (see [`Registry::keep`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Kept {
    lease: i64,
    dir: String,
    slot: u32,
    /// When its lease should have run out: from then on, a read may free the slot.
    pub(crate) until: Instant,
}

impl Kept {
    pub(crate) fn key(&self) -> String {
        format!("{}{:x}.{}", self.dir, self.lease, self.slot)
    }
}

/// One owner's key.
#[derive(Debug, Clone)]
pub(crate) struct Placed {
    pub(crate) set: Set,
    pub(crate) slot: u32,
    pub(crate) lease: i64,
    /// Its create revision, once an answer showed it (unknown after a lost reply).
    pub(crate) revision: Option<i64>,
    /// Granted: the key held when last read (a holder holds until its key is gone).
    pub(crate) granted: bool,
    /// Puts of this key sent and not (yet) answered.
    /// While any is, one may still land, and removing the key must bump the session's fence
    /// (see [`Layout::anchor`](crate::layout::Layout::anchor)).
    pub(crate) unanswered_puts: u32,
}

impl Placed {
    fn name(&self) -> String {
        format!("{:x}.{}", self.lease, self.slot)
    }

    pub(crate) fn key(&self) -> String {
        format!("{}{}", self.set.dir, self.name())
    }

    /// The lock-delay marker of this key (see [`MARKER`](crate::layout::MARKER)).
    pub(crate) fn marker(&self) -> String {
        format!("{}{}", self.set.markers, self.name())
    }
}

impl Registry {
    /// The owner's entry.
    pub(crate) fn get(&self, owner: &OwnerId) -> Option<Placed> {
        self.by_owner.get(owner).cloned()
    }

    /// The owner's key, placing it in the lowest free slot of `set` if it has none.
    pub(crate) fn place(&mut self, owner: &OwnerId, set: &Set, lease: i64) -> Placed {
        if let Some(placed) = self.by_owner.get(owner) {
            return placed.clone();
        }
        let taken = self.taken.entry((lease, set.dir.clone())).or_default();
        let slot = (0..).find(|n| !taken.contains(n)).unwrap_or(u32::MAX);
        taken.insert(slot);
        let placed = Placed {
            set: set.clone(),
            slot,
            lease,
            revision: None,
            granted: false,
            unanswered_puts: 0,
        };
        self.by_owner.insert(owner.clone(), placed.clone());
        placed
    }

    /// A put of the owner's key is being sent.
    pub(crate) fn put_sent(&mut self, owner: &OwnerId) {
        if let Some(placed) = self.by_owner.get_mut(owner) {
            placed.unanswered_puts += 1;
        }
    }

    /// A put of the owner's key was answered (applied or refused: it cannot land later).
    pub(crate) fn put_answered(&mut self, owner: &OwnerId) {
        if let Some(placed) = self.by_owner.get_mut(owner) {
            placed.unanswered_puts = placed.unanswered_puts.saturating_sub(1);
        }
    }

    pub(crate) fn record(&mut self, owner: &OwnerId, revision: i64) {
        if let Some(placed) = self.by_owner.get_mut(owner) {
            placed.revision = Some(revision);
        }
    }

    /// The owner's key, created at `revision`, holds.
    pub(crate) fn grant(&mut self, owner: &OwnerId, revision: i64) {
        if let Some(placed) = self.by_owner.get_mut(owner) {
            placed.revision = Some(revision);
            placed.granted = true;
        }
    }

    /// Forgets the owner's key; its slot is free again.
    /// That is safe whatever is still in flight: a late delete compares the key's create
    /// revision (a new key in the slot has another), and a late put the session's fence
    /// (bumped when it was given up).
    pub(crate) fn forget(&mut self, owner: &OwnerId) -> Option<Placed> {
        let placed = self.by_owner.remove(owner)?;
        self.free(placed.lease, &placed.set.dir, placed.slot);
        Some(placed)
    }

    /// The slot `slot` of `dir` under `lease` is free again.
    fn free(&mut self, lease: i64, dir: &str, slot: u32) {
        let at = (lease, dir.to_owned());
        if let Some(taken) = self.taken.get_mut(&at) {
            taken.remove(&slot);
            if taken.is_empty() {
                self.taken.remove(&at);
            }
        }
    }

    /// Forgets the owner's acquisition, whose key now outlives it on a lease of its own.
    /// That lease should run out at `until`.
    /// The slot stays taken until [`kept_gone`](Registry::kept_gone): putting a new key of
    /// this session in it would overwrite the kept one, and grant it at once. etcd may keep
    /// the lease past `until` (a new leader renews every lease), so only a read that finds
    /// the key gone frees the slot.
    pub(crate) fn keep(&mut self, owner: &OwnerId, until: Instant) {
        if let Some(placed) = self.by_owner.remove(owner) {
            self.kept.push(Kept {
                lease: placed.lease,
                dir: placed.set.dir,
                slot: placed.slot,
                until,
            });
        }
    }

    /// The kept keys of the session with lease `lease` that should be gone at `now`.
    /// Those of other sessions are forgotten, their slots freed: no key is placed under
    /// another lease than the current session's.
    pub(crate) fn kept_due(&mut self, lease: i64, now: Instant) -> Vec<Kept> {
        let (others, ours): (Vec<Kept>, Vec<Kept>) = std::mem::take(&mut self.kept)
            .into_iter()
            .partition(|k| k.lease != lease);
        self.kept = ours;
        for kept in others {
            self.free(kept.lease, &kept.dir, kept.slot);
        }
        self.kept
            .iter()
            .filter(|k| k.until <= now)
            .cloned()
            .collect()
    }

    /// The kept key `kept` was read and is gone: its slot is free.
    pub(crate) fn kept_gone(&mut self, kept: &Kept) {
        let before = self.kept.len();
        self.kept.retain(|k| k != kept);
        if self.kept.len() < before {
            self.free(kept.lease, &kept.dir, kept.slot);
        }
    }

    /// The kept key `kept` was read and is still there: look again from `until`.
    pub(crate) fn kept_until(&mut self, kept: &Kept, until: Instant) {
        if let Some(k) = self.kept.iter_mut().find(|k| *k == kept) {
            k.until = until;
        }
    }

    /// Forgets the owner's key if nothing of it can be on the server.
    /// Nothing can be when no answer showed it and no put of it is unanswered.
    pub(crate) fn forget_if_unseen(&mut self, owner: &OwnerId) {
        if self
            .by_owner
            .get(owner)
            .is_some_and(|p| p.revision.is_none() && p.unanswered_puts == 0)
        {
            self.forget(owner);
        }
    }

    /// How many keys and slots are remembered (for tests of the bound).
    #[cfg(test)]
    fn size(&self) -> (usize, usize) {
        (
            self.by_owner.len() + self.kept.len(),
            self.taken.values().map(BTreeSet::len).sum(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(dir: &str) -> Set {
        Set {
            dir: dir.into(),
            markers: format!("{dir}#delay/"),
        }
    }

    #[test]
    fn slots_are_reused_once_their_key_is_forgotten() {
        let mut registry = Registry::default();
        let [a, b, c, d] = ["a", "b", "c", "d"].map(|o| OwnerId::parse(o).unwrap());
        let lock = set("p/n/");
        assert_eq!(registry.place(&a, &lock, 7).key(), "p/n/7.0");
        assert_eq!(registry.place(&a, &lock, 7).marker(), "p/n/#delay/7.0");
        assert_eq!(registry.place(&b, &lock, 7).slot, 1);
        // Placing again is idempotent; other sessions and directories count apart.
        assert_eq!(registry.place(&a, &lock, 7).slot, 0);
        assert_eq!(registry.place(&c, &lock, 8).slot, 0);
        assert_eq!(registry.place(&d, &set("p/m/"), 7).slot, 0);
        registry.forget(&a);
        assert_eq!(registry.place(&a, &lock, 7).slot, 0);
        for owner in [&a, &b, &c, &d] {
            registry.forget(owner);
        }
        assert_eq!(registry.size(), (0, 0));
    }

    #[test]
    fn a_kept_keys_slot_is_reused_only_once_it_is_seen_gone() {
        let mut registry = Registry::default();
        let [a, b, c] = ["a", "b", "c"].map(|o| OwnerId::parse(o).unwrap());
        let lock = set("n/");
        let at = |s| Instant::from_origin(std::time::Duration::from_secs(s));
        assert_eq!(registry.place(&a, &lock, 7).slot, 0);
        registry.keep(&a, at(10));
        assert!(registry.get(&a).is_none());
        assert_eq!(registry.place(&b, &lock, 7).slot, 1, "the kept key's slot");
        assert!(registry.kept_due(7, at(9)).is_empty());
        let due = registry.kept_due(7, at(10));
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].key(), "n/7.0");
        // Still there at its deadline (a new leader renewed its lease): look again later.
        registry.kept_until(&due[0], at(11));
        assert!(registry.kept_due(7, at(10)).is_empty());
        registry.forget(&b);
        assert_eq!(registry.place(&c, &lock, 7).slot, 1);
        let due = registry.kept_due(7, at(11));
        registry.kept_gone(&due[0]);
        registry.forget(&c);
        assert_eq!(registry.size(), (0, 0));
        // Kept keys of a session that ended are forgotten with it.
        registry.place(&a, &lock, 7);
        registry.keep(&a, at(20));
        assert!(registry.kept_due(8, at(0)).is_empty());
        assert_eq!(registry.size(), (0, 0));
    }

    #[test]
    fn unanswered_requests_leave_nothing_behind_once_released() {
        let mut registry = Registry::default();
        let lock = set("p/n/");
        for i in 0..10_000i64 {
            let owner = OwnerId::parse(&format!("o{i}")).unwrap();
            let placed = registry.place(&owner, &lock, 7);
            assert_eq!(placed.slot, 0, "a slot is never retired");
            registry.put_sent(&owner);
            if i % 2 == 0 {
                registry.put_answered(&owner);
                registry.record(&owner, i);
            }
            registry.put_sent(&owner);
            registry.put_answered(&owner);
            let unanswered = registry.by_owner[&owner].unanswered_puts;
            assert_eq!(unanswered, u32::from(i % 2 == 1));
            registry.forget(&owner);
        }
        assert_eq!(registry.size(), (0, 0));
    }
}
