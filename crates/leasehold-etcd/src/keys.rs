//! The key layout, and the keys this client has placed.

use std::collections::{BTreeSet, HashMap};

use leasehold_core::backend::Mode;
use leasehold_core::{LockName, OwnerId};

/// The value of a lock-delay marker starts with this, then the owner. A marker is put
/// beside a grant of a request with a lock-delay, bound to the session's delay lease
/// (which outlives the session's own by the delay), and deleted with the key on release;
/// a marker whose owner has no key left in the queue means its holder vanished without
/// releasing, and closes the queue until it expires.
pub(crate) const MARKER: &[u8] = b"d ";

/// The queue directory of `name`'s set for `mode`: `<prefix>/<name>/<set>/`.
pub(crate) fn dir(prefix: &str, name: &LockName, mode: Mode) -> String {
    let set = if mode.is_permit() { "permit" } else { "lock" };
    format!("{prefix}/{name}/{set}/")
}

/// The keys this backend has placed or is placing, by owner.
#[derive(Debug, Default)]
pub(crate) struct Keys {
    pub(crate) by_owner: HashMap<OwnerId, Placed>,
    /// Slots taken, per session lease and queue directory.
    taken: HashMap<(i64, String), BTreeSet<u32>>,
}

/// One owner's key.
#[derive(Debug, Clone)]
pub(crate) struct Placed {
    pub(crate) dir: String,
    pub(crate) slot: u32,
    pub(crate) lease: i64,
    /// Its create revision, once an answer showed it (unknown after a lost reply).
    pub(crate) revision: Option<i64>,
    /// A delete was sent for it (it may still be in flight).
    deleting: bool,
}

impl Placed {
    pub(crate) fn key(&self) -> String {
        format!("{}{:x}.{}", self.dir, self.lease, self.slot)
    }

    /// The lock-delay marker of this key (see [`MARKER`]).
    pub(crate) fn marker(&self) -> String {
        format!("{}.d", self.key())
    }
}

impl Keys {
    /// The owner's key, placing it in the lowest free slot of `dir` if it has none.
    pub(crate) fn place(&mut self, owner: &OwnerId, dir: &str, lease: i64) -> Placed {
        if let Some(placed) = self.by_owner.get(owner) {
            return placed.clone();
        }
        let taken = self.taken.entry((lease, dir.to_owned())).or_default();
        let slot = (0..).find(|n| !taken.contains(n)).unwrap_or(u32::MAX);
        taken.insert(slot);
        let placed = Placed {
            dir: dir.to_owned(),
            slot,
            lease,
            revision: None,
            deleting: false,
        };
        self.by_owner.insert(owner.clone(), placed.clone());
        placed
    }

    /// Marks the owner's key as being deleted; returns it, and whether this is the first
    /// delete sent for it.
    ///
    /// Why deletes of our keys carry no compare: etcd 3.4 runs every transaction — even one
    /// of a single delete — through a slower path than a plain delete (measured with 16
    /// clients: about 50 µs more of the member's CPU per lock cycle, 10–15 % of the
    /// throughput). What the compare of a create revision would guarantee — a delete never
    /// removes a newer key — the slot rule guarantees instead (see
    /// [`finish_delete`](Keys::finish_delete)).
    pub(crate) fn start_delete(&mut self, owner: &OwnerId) -> Option<(Placed, bool)> {
        let placed = self.by_owner.get_mut(owner)?;
        let first = !placed.deleting;
        placed.deleting = true;
        Some((placed.clone(), first))
    }

    /// The delete of the owner's key was answered: forgets the key. Its slot is free for a
    /// new key only if this delete was the one sent for it (no other may still be in
    /// flight) and the key's creation was answered (no put may still land there).
    pub(crate) fn finish_delete(&mut self, owner: &OwnerId, first: bool) {
        let retire = !first
            || self
                .by_owner
                .get(owner)
                .is_none_or(|placed| placed.revision.is_none());
        self.forget(owner, retire);
    }

    pub(crate) fn record(&mut self, owner: &OwnerId, revision: i64) {
        if let Some(placed) = self.by_owner.get_mut(owner) {
            placed.revision = Some(revision);
        }
    }

    /// Forgets the owner's key; its slot is free again unless `retire` (a put of unknown
    /// outcome may still land there).
    pub(crate) fn forget(&mut self, owner: &OwnerId, retire: bool) -> Option<Placed> {
        let placed = self.by_owner.remove(owner)?;
        if !retire {
            let at = (placed.lease, placed.dir.clone());
            if let Some(taken) = self.taken.get_mut(&at) {
                taken.remove(&placed.slot);
                if taken.is_empty() {
                    self.taken.remove(&at);
                }
            }
        }
        Some(placed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_reused_unless_retired() {
        let mut keys = Keys::default();
        let [a, b, c, d] = ["a", "b", "c", "d"].map(|o| OwnerId::parse(o).unwrap());
        assert_eq!(keys.place(&a, "p/n/lock/", 7).key(), "p/n/lock/7.0");
        assert_eq!(keys.place(&b, "p/n/lock/", 7).slot, 1);
        // Placing again is idempotent; other sessions and directories count apart.
        assert_eq!(keys.place(&a, "p/n/lock/", 7).slot, 0);
        assert_eq!(keys.place(&c, "p/n/lock/", 8).slot, 0);
        keys.forget(&a, false);
        assert_eq!(keys.place(&d, "p/n/lock/", 7).slot, 0);
        keys.forget(&b, true);
        keys.forget(&d, false);
        assert_eq!(keys.place(&a, "p/n/lock/", 7).slot, 0);
        assert_eq!(keys.place(&d, "p/n/lock/", 7).slot, 2);
    }

    #[test]
    fn a_slot_is_reused_only_after_the_one_delete_of_its_key_was_answered() {
        let mut keys = Keys::default();
        let [a, b, c, d] = ["a", "b", "c", "d"].map(|o| OwnerId::parse(o).unwrap());
        let dir = "p/n/lock/";
        assert_eq!(keys.place(&a, dir, 7).slot, 0);
        keys.record(&a, 10);
        let (_, first) = keys.start_delete(&a).unwrap();
        assert!(first);
        keys.finish_delete(&a, first);
        assert!(keys.start_delete(&a).is_none(), "forgotten");
        // Answered at the first try: the slot is free again.
        assert_eq!(keys.place(&b, dir, 7).slot, 0);
        keys.record(&b, 11);
        // b's first delete went unanswered (failed, timed out, dropped): a second one is
        // sent and answered, but the first may still land later — slot 0 is retired.
        assert!(keys.start_delete(&b).unwrap().1);
        let (_, first) = keys.start_delete(&b).unwrap();
        assert!(!first);
        keys.finish_delete(&b, first);
        assert_eq!(keys.place(&c, dir, 7).slot, 1);
        // A key whose creation went unanswered: a put may still land in its slot.
        let (_, first) = keys.start_delete(&c).unwrap();
        keys.finish_delete(&c, first);
        assert_eq!(keys.place(&d, dir, 7).slot, 2);
    }
}
