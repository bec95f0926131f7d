//! Listing locks over the nodes: where each node's scan stands, and what a majority holds.
//!
//! A page scans every node still scanning (each its own keyspace, with its own `SCAN`
//! cursor), then reads every name any of them found on every node that answers, so that
//! each holder is counted on every node that has it. A node that fails to answer is left
//! out for the rest of the listing; once more are left out than a majority can spare, the
//! listing fails rather than miss locks.

use std::collections::HashMap;
use std::fmt;

use leasehold_core::backend::{Holder, ListCursor, LockState, Waiter};
use leasehold_core::{Error, OwnerId, Result};

use super::quorum::Majority;
use crate::eviction;

/// Where one node's part of a listing stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Place {
    /// Scanning, from this `SCAN` cursor.
    At(u64),
    /// Scanned through.
    Done,
    /// Left out: it did not answer.
    Gone,
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Place::At(scan) => write!(f, "{scan}"),
            Place::Done => f.write_str("done"),
            Place::Gone => f.write_str("gone"),
        }
    }
}

/// The places of the `nodes` nodes that `cursor` names.
/// A cursor is their places in node order, separated by `,`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a cursor not of that form (not made by this backend, or
/// for another number of nodes).
pub(super) fn places(cursor: &str, nodes: usize) -> Result<Vec<Place>> {
    let invalid = || {
        Error::invalid(
            "list cursor",
            format!("{cursor:?} is not a cursor of this redlock backend"),
        )
    };
    let places = cursor
        .split(',')
        .map(|place| match place {
            "done" => Ok(Place::Done),
            "gone" => Ok(Place::Gone),
            scan => scan.parse().map(Place::At).map_err(|_| invalid()),
        })
        .collect::<Result<Vec<_>>>()?;
    if places.len() != nodes {
        return Err(invalid());
    }
    Ok(places)
}

/// The cursor of `places`; `None` when no node is left to scan.
pub(super) fn cursor(places: &[Place]) -> Option<ListCursor> {
    places.iter().any(|p| matches!(p, Place::At(_))).then(|| {
        let places: Vec<String> = places.iter().map(Place::to_string).collect();
        ListCursor::new(places.join(","))
    })
}

/// What a majority of the nodes holds of one name, from the states the nodes reported.
/// Its hint is [`WaitHint::none`](leasehold_core::backend::WaitHint::none).
///
/// A holder counts if a majority of all nodes reports it. Its time left and its token are
/// those a majority reaches (the grant wrote its token back to at least a majority; a node
/// that granted late may hold a token of its own). Waiters are those any node reports.
/// Evictions are those any node records (an audit trail: an eviction that reached only
/// some nodes shows too), newest first by their time, the latest [`eviction::KEPT`].
pub(super) fn merged(majority: Majority, states: impl IntoIterator<Item = LockState>) -> LockState {
    let mut holders: HashMap<(OwnerId, String), Vec<Holder>> = HashMap::new();
    let mut state = LockState::default();
    for reported in states {
        for eviction in reported.evictions {
            if !state.evictions.contains(&eviction) {
                state.evictions.push(eviction);
            }
        }
        for holder in reported.holders {
            holders
                .entry((holder.owner.clone(), holder.mode.to_string()))
                .or_default()
                .push(holder);
        }
        for waiter in reported.waiters {
            if !state
                .waiters
                .iter()
                .any(|w: &Waiter| w.owner == waiter.owner)
            {
                state.waiters.push(waiter);
            }
        }
    }
    for (_, copies) in holders {
        let (Some(remaining), Some(token)) = (
            majority.held_by_majority(copies.iter().map(|h| h.remaining)),
            majority.held_by_majority(copies.iter().map(|h| h.token)),
        ) else {
            continue;
        };
        if let Some(mut longest) = copies
            .into_iter()
            .min_by_key(|h| std::cmp::Reverse(h.remaining))
        {
            longest.remaining = remaining;
            longest.token = token;
            state.holders.push(longest);
        }
    }
    state.holders.sort_by_key(|h| h.token);
    state
        .evictions
        .sort_by_key(|e| std::cmp::Reverse((e.at_ms, e.token)));
    state.evictions.truncate(eviction::KEPT);
    state
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use leasehold_core::FencingToken;
    use leasehold_core::backend::{Eviction, Mode};

    use super::*;

    #[test]
    fn a_cursor_keeps_each_nodes_place() {
        let all = [Place::At(17), Place::Done, Place::Gone];
        let cursor = cursor(&all).unwrap();
        assert_eq!(cursor.as_str(), "17,done,gone");
        assert_eq!(places(cursor.as_str(), 3).unwrap(), all);
        // Nothing left to scan: the last page.
        assert_eq!(super::cursor(&[Place::Done, Place::Gone]), None);
        for (bad, nodes) in [("17,done", 3), ("17,x,done", 3), ("", 1), ("-1", 1)] {
            assert!(
                matches!(places(bad, nodes), Err(Error::InvalidArgument { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_holder_counts_where_a_majority_reports_it() {
        let owner = |o: &str| OwnerId::parse(o).unwrap();
        let holder = |o: &str, token: u64, ms: u64| {
            Holder::new(owner(o), Mode::Exclusive, FencingToken::new(token))
                .with_remaining(Some(Duration::from_millis(ms)))
        };
        let state = |holders: Vec<Holder>| {
            let mut state = LockState::default();
            state.holders = holders;
            state
        };
        let three = Majority::of(3);
        // o1 on two of three nodes (one granted late with a token of its own); o2 on one.
        let merged = merged(
            three,
            [
                state(vec![holder("o1", 9, 400)]),
                state(vec![holder("o1", 11, 500), holder("o2", 12, 900)]),
                state(vec![]),
            ],
        );
        assert_eq!(merged.holders.len(), 1);
        let o1 = &merged.holders[0];
        assert_eq!(o1.owner, owner("o1"));
        assert_eq!(o1.token, FencingToken::new(9));
        assert_eq!(o1.remaining, Some(Duration::from_millis(400)));
    }

    #[test]
    fn evictions_any_node_records_are_merged_newest_first() {
        let eviction = |token: u64, at_ms: u64| {
            let mut e = Eviction::new(
                OwnerId::parse("o1").unwrap(),
                FencingToken::new(token),
                "ops@host".into(),
                "why".into(),
            );
            e.at_ms = at_ms;
            e
        };
        let state = |evictions: Vec<Eviction>| {
            let mut state = LockState::default();
            state.evictions = evictions;
            state
        };
        // Two nodes recorded both evictions, one only the first; one node has many old ones.
        let old: Vec<Eviction> = (0..20).map(|i| eviction(i, i)).rev().collect();
        let merged = merged(
            Majority::of(3),
            [
                state(vec![eviction(30, 2_000), eviction(20, 1_000)]),
                state(vec![eviction(20, 1_000)]),
                state(old),
            ],
        );
        let seen: Vec<(u64, u64)> = merged
            .evictions
            .iter()
            .map(|e| (e.token.get(), e.at_ms))
            .collect();
        assert_eq!(seen.len(), eviction::KEPT);
        assert_eq!(&seen[..3], [(30, 2_000), (20, 1_000), (19, 19)]);
    }
}
