//! Token floors: the highest fencing token this client has seen granted per name.
//! They catch a server that hands out a token that is not new (it lost data: an empty
//! restart, a failover to a lagging replica).
//!
//! A grant is compared only with the floor as it was when its request was *sent*: grants
//! that finished after that may come from requests the server ran later (concurrent shared
//! and permit grants finish in any order on a multi-thread runtime), so a lower token than
//! theirs is no sign of lost data.
//!
//! The memory is bounded: two generations of at most [`GENERATION`] names each. When the
//! newer one is full it becomes the older one and the oldest is forgotten, so a name
//! locked recently keeps its floor, and one not locked for a long time loses it (the
//! server's clock-seeded counter still protects it).

use std::collections::HashMap;

use leasehold_core::{LockName, OwnerId};

/// Most names per generation.
const GENERATION: usize = 50_000;

/// The highest token seen granted for a name, and to whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Floor {
    pub(crate) token: u64,
    owner: OwnerId,
}

impl Floor {
    /// The floor `token` granted to `owner` breaks, if any.
    /// A lower token, or the same token for someone else (the same owner gets its own token
    /// again when it adopts a grant).
    pub(crate) fn broken_by(seen: Option<&Floor>, token: u64, owner: &OwnerId) -> Option<u64> {
        let seen = seen?;
        (token < seen.token || (token == seen.token && *owner != seen.owner)).then_some(seen.token)
    }
}

/// The floors of the names this client granted recently.
#[derive(Debug)]
pub(crate) struct Floors {
    newer: HashMap<LockName, Floor>,
    older: HashMap<LockName, Floor>,
    generation: usize,
}

impl Default for Floors {
    fn default() -> Self {
        Self::with_generation(GENERATION)
    }
}

impl Floors {
    fn with_generation(generation: usize) -> Self {
        Self {
            newer: HashMap::new(),
            older: HashMap::new(),
            generation: generation.max(1),
        }
    }

    /// The floor of `name` now (read before a request is sent).
    pub(crate) fn get(&self, name: &LockName) -> Option<Floor> {
        self.newer
            .get(name)
            .or_else(|| self.older.get(name))
            .cloned()
    }

    /// Records that `token` was granted to `owner`: the floor rises to it if it is higher.
    pub(crate) fn record(&mut self, name: &LockName, token: u64, owner: &OwnerId) {
        let floor = Floor {
            token,
            owner: owner.clone(),
        };
        if let Some(current) = self.newer.get_mut(name) {
            if token > current.token {
                *current = floor;
            }
            return;
        }
        let floor = match self.older.get(name) {
            Some(older) if older.token >= token => older.clone(),
            _ => floor,
        };
        if self.newer.len() >= self.generation {
            self.older = std::mem::take(&mut self.newer);
        }
        self.newer.insert(name.clone(), floor);
    }

    /// How many names have a floor.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.newer.len() + self.older.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(i: usize) -> LockName {
        LockName::new(&format!("n{i}")).unwrap()
    }

    #[test]
    fn a_grant_breaks_only_a_floor_seen_before_it_was_sent() {
        let (a, b) = (OwnerId::generate(), OwnerId::generate());
        let mut floors = Floors::default();
        let seen_by_both = floors.get(&name(0));
        // Sent together; b's reply (token 11) is handled before a's (token 10).
        floors.record(&name(0), 11, &b);
        assert_eq!(Floor::broken_by(seen_by_both.as_ref(), 10, &a), None);
        floors.record(&name(0), 10, &a);
        assert_eq!(
            floors.get(&name(0)).unwrap().token,
            11,
            "the floor never falls"
        );
        // Sent after both finished: 11 again, or anything lower, is lost data.
        let seen = floors.get(&name(0));
        assert_eq!(Floor::broken_by(seen.as_ref(), 11, &a), Some(11));
        assert_eq!(Floor::broken_by(seen.as_ref(), 5, &a), Some(11));
        assert_eq!(
            Floor::broken_by(seen.as_ref(), 11, &b),
            None,
            "b adopts its own grant"
        );
        assert_eq!(Floor::broken_by(seen.as_ref(), 12, &a), None);
    }

    #[test]
    fn memory_is_bounded_and_recent_names_keep_their_floor() {
        let owner = OwnerId::generate();
        let mut floors = Floors::with_generation(100);
        for i in 0..10_000 {
            floors.record(&name(i), 7, &owner);
            assert!(floors.len() <= 200, "{} floors", floors.len());
        }
        // The last generation's worth is remembered, whatever came before.
        for i in 9_900..10_000 {
            assert_eq!(floors.get(&name(i)).map(|f| f.token), Some(7), "n{i}");
        }
        // A name granted again moves to the newer generation, keeping its higher floor, and
        // outlives the names of its old generation.
        for i in 10_000..10_050 {
            floors.record(&name(i), 1, &owner);
        }
        floors.record(&name(9_950), 3, &owner);
        for i in 10_050..10_110 {
            floors.record(&name(i), 1, &owner);
        }
        assert_eq!(floors.get(&name(9_950)).map(|f| f.token), Some(7));
        assert_eq!(floors.get(&name(9_949)), None);
    }
}
