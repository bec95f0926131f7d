//! The key layout, and the keys this client has placed.
//!
//! With no prefix, the keys of lock name `N` are (with a prefix `P`, each starts with
//! `P/`):
//!
//! | key | what |
//! |---|---|
//! | `N/<lease>.<slot>` | an exclusive or shared contender: etcd's own lock recipe (`concurrency.Mutex`, `etcdctl lock N`, the Lock RPC) puts its contenders in the same directory, so both exclude each other |
//! | `N#delay/<lease>.<slot>` | the lock-delay marker of the contender of the same name |
//! | `N#permits/<lease>.<slot>` | a semaphore permit holder or waiter |
//! | `N#permits#delay/<lease>.<slot>` | a permit's lock-delay marker |
//! | `#sessions/<lease>` | a session's fence (see [`Layout::anchor`]) |
//!
//! `<lease>` is the session's lease id in hex, `<slot>` a number the session reuses once
//! the key is gone. Names cannot contain `#` or `/`, so no name's keys fall into another
//! name's directories, and no contender directory holds a marker, a permit or a fence.

use std::collections::{BTreeSet, HashMap};

use leasehold_core::backend::Mode;
use leasehold_core::{LockName, OwnerId};

/// The value of a lock-delay marker starts with this, then the owner.
/// A marker is put beside a grant of a request with a lock-delay, bound to the session's
/// delay lease (which outlives the session's own by the delay), and deleted with the key on
/// release; a marker whose owner has no key left in the queue means its holder vanished
/// without releasing, and closes the queue until it expires.
pub(crate) const MARKER: &[u8] = b"d ";

/// Where keys live: the prefix as given (none, or `P`, which puts every key under `P/`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    root: String,
}

impl Layout {
    pub(crate) fn new(prefix: &str) -> Self {
        let root = if prefix.is_empty() {
            String::new()
        } else {
            format!("{prefix}/")
        };
        Self { root }
    }

    /// The directories of `name`'s set for `mode`.
    pub(crate) fn set(&self, name: &LockName, mode: Mode) -> Set {
        let root = &self.root;
        if mode.is_permit() {
            Set {
                dir: format!("{root}{name}#permits/"),
                markers: format!("{root}{name}#permits#delay/"),
            }
        } else {
            Set {
                dir: format!("{root}{name}/"),
                markers: format!("{root}{name}#delay/"),
            }
        }
    }

    /// The prefixes under which every key of `name` lives.
    /// They are its contender directory and `<name>#` (permits and markers).
    pub(crate) fn all_of(&self, name: &LockName) -> [String; 2] {
        let root = &self.root;
        [format!("{root}{name}/"), format!("{root}{name}#")]
    }

    /// The fence key of the session with lease `lease`.
    ///
    /// # The fence
    ///
    /// Every put of a contender key compares the fence key's mod revision with the one the
    /// session last saw. An acquisition that sent a put whose answer never came bumps the
    /// fence (a put that changes nothing else) in the same transaction that removes its
    /// key, so that put — held up in a paused member, say — can no longer land after its
    /// acquisition gave up: it would leave a holder or waiter nobody deletes for the
    /// session's life. The fence key is bound to the session lease and goes with it.
    pub(crate) fn anchor(&self, lease: i64) -> String {
        format!("{}#sessions/{lease:x}", self.root)
    }
}

/// The two directories of one set of a name.
/// Contenders (holders and waiters) and their lock-delay markers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Set {
    pub(crate) dir: String,
    pub(crate) markers: String,
}

/// The keys this backend has placed or is placing, by owner.
/// A release needs it to remove exactly its own key. An entry lives from the acquisition's
/// first request to the answer of its release (or the end of its session, for an abandoned
/// one), so the table holds the client's current acquisitions and nothing else.
#[derive(Debug, Default)]
pub(crate) struct Keys {
    pub(crate) by_owner: HashMap<OwnerId, Placed>,
    /// Slots taken, per session lease and queue directory.
    taken: HashMap<(i64, String), BTreeSet<u32>>,
}

/// One owner's key.
#[derive(Debug, Clone)]
pub(crate) struct Placed {
    pub(crate) set: Set,
    pub(crate) slot: u32,
    pub(crate) lease: i64,
    /// Its create revision, once an answer showed it (unknown after a lost reply).
    pub(crate) revision: Option<i64>,
    /// Puts of this key sent and not (yet) answered.
    /// While any is, one may still land, and removing the key must bump the session's fence
    /// (see [`Layout::anchor`]).
    pub(crate) unanswered_puts: u32,
}

impl Placed {
    fn name(&self) -> String {
        format!("{:x}.{}", self.lease, self.slot)
    }

    pub(crate) fn key(&self) -> String {
        format!("{}{}", self.set.dir, self.name())
    }

    /// The lock-delay marker of this key (see [`MARKER`]).
    pub(crate) fn marker(&self) -> String {
        format!("{}{}", self.set.markers, self.name())
    }
}

/// Whether `key` in `dir` is named as this backend names its keys (`<lease>.<slot>`).
pub(crate) fn is_ours(dir: &str, key: &[u8]) -> bool {
    let Some(name) = key.strip_prefix(dir.as_bytes()) else {
        return false;
    };
    let Some(dot) = name.iter().position(|b| *b == b'.') else {
        return false;
    };
    let (lease, slot) = (&name[..dot], &name[dot + 1..]);
    !lease.is_empty()
        && !slot.is_empty()
        && lease.iter().all(u8::is_ascii_hexdigit)
        && slot.iter().all(u8::is_ascii_digit)
}

impl Keys {
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

    /// Forgets the owner's key; its slot is free again.
    /// That is safe whatever is still in flight: a late delete compares the key's create
    /// revision (a new key in the slot has another), and a late put the session's fence
    /// (bumped when it was given up).
    pub(crate) fn forget(&mut self, owner: &OwnerId) -> Option<Placed> {
        let placed = self.by_owner.remove(owner)?;
        let at = (placed.lease, placed.set.dir.clone());
        if let Some(taken) = self.taken.get_mut(&at) {
            taken.remove(&placed.slot);
            if taken.is_empty() {
                self.taken.remove(&at);
            }
        }
        Some(placed)
    }

    /// Forgets the owner's key if nothing of it can be on the server.
    /// That is if no answer showed it and no put of it is unanswered.
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
            self.by_owner.len(),
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
    fn names_map_to_etcds_lock_directories() {
        let name = LockName::new("job").unwrap();
        let plain = Layout::new("");
        assert_eq!(plain.set(&name, Mode::Exclusive).dir, "job/");
        assert_eq!(plain.set(&name, Mode::Shared).markers, "job#delay/");
        let limit = std::num::NonZeroU32::MIN;
        assert_eq!(plain.set(&name, Mode::Permit { limit }).dir, "job#permits/");
        assert_eq!(plain.anchor(0x2a), "#sessions/2a");
        let prefixed = Layout::new("/locks");
        assert_eq!(prefixed.set(&name, Mode::Exclusive).dir, "/locks/job/");
        assert_eq!(prefixed.all_of(&name), ["/locks/job/", "/locks/job#"]);
        // Only keys named <hex>.<digits> are this backend's; etcd's Mutex names its key
        // after the lease alone.
        assert!(is_ours("job/", b"job/694d7a8e5c0d4b04.3"));
        for foreign in [
            &b"job/694d7a8e5c0d4b04"[..],
            b"job/x.1",
            b"job/.1",
            b"other/1.2",
        ] {
            assert!(!is_ours("job/", foreign), "{foreign:?}");
        }
    }

    #[test]
    fn slots_are_reused_once_their_key_is_forgotten() {
        let mut keys = Keys::default();
        let [a, b, c, d] = ["a", "b", "c", "d"].map(|o| OwnerId::parse(o).unwrap());
        let lock = set("p/n/");
        assert_eq!(keys.place(&a, &lock, 7).key(), "p/n/7.0");
        assert_eq!(keys.place(&a, &lock, 7).marker(), "p/n/#delay/7.0");
        assert_eq!(keys.place(&b, &lock, 7).slot, 1);
        // Placing again is idempotent; other sessions and directories count apart.
        assert_eq!(keys.place(&a, &lock, 7).slot, 0);
        assert_eq!(keys.place(&c, &lock, 8).slot, 0);
        assert_eq!(keys.place(&d, &set("p/m/"), 7).slot, 0);
        keys.forget(&a);
        assert_eq!(keys.place(&a, &lock, 7).slot, 0);
        for owner in [&a, &b, &c, &d] {
            keys.forget(owner);
        }
        assert_eq!(keys.size(), (0, 0));
    }

    #[test]
    fn unanswered_requests_leave_nothing_behind_once_released() {
        let mut keys = Keys::default();
        let lock = set("p/n/");
        for i in 0..10_000i64 {
            let owner = OwnerId::parse(&format!("o{i}")).unwrap();
            let placed = keys.place(&owner, &lock, 7);
            assert_eq!(placed.slot, 0, "a slot is never retired");
            keys.put_sent(&owner);
            if i % 2 == 0 {
                keys.put_answered(&owner);
                keys.record(&owner, i);
            }
            keys.put_sent(&owner);
            keys.put_answered(&owner);
            let unanswered = keys.by_owner[&owner].unanswered_puts;
            assert_eq!(unanswered, u32::from(i % 2 == 1));
            keys.forget(&owner);
        }
        assert_eq!(keys.size(), (0, 0));
    }
}
