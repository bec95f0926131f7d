//! Who holds in a FIFO queue of contenders: the one rule of the backend contract.
//!
//! A set of a name (its lock set, or its permit set) is a queue in arrival order. A
//! contender holds when every contender before it holds and it fits beside them:
//!
//! - exclusive: it is first;
//! - shared: no exclusive contender is before it;
//! - a permit of limit `L`: fewer than `L` contenders are before it (each request counts
//!   with its own limit).
//!
//! So the holders are always a prefix of the queue and nobody overtakes a contender that
//! arrived before it: not a reader a waiting writer (writers do not starve), not a permit of
//! a larger limit one of a smaller limit (which would otherwise wait until the set is empty
//! while larger requests keep coming). Contenders become holders in arrival order, so a
//! backend whose token is the queue position (etcd's create revision, ZooKeeper's czxid)
//! hands out tokens in grant order.
//!
//! A backend that keeps its holders apart from its waiting queue and grants a waiter only
//! when it comes back to ask (memory, Redis, PostgreSQL) has waiters that would hold but
//! have not claimed their place yet. A request behind them may be granted first only if
//! each of them still holds behind it ([`may_hold`]): otherwise a permit of a larger limit
//! granted ahead of a waiting one of a smaller limit would push that one out of its place.

use crate::backend::Mode;

/// A member of a queue: anything with a [`Mode`].
pub trait Contender {
    /// How it wants to hold.
    fn mode(&self) -> Mode;
}

impl Contender for Mode {
    fn mode(&self) -> Mode {
        *self
    }
}

/// Which contenders of `queue` (in arrival order) hold, by the rule above.
pub fn holding<C: Contender>(queue: &[C]) -> Vec<bool> {
    let mut exclusive_before = false;
    let mut all_before_hold = true;
    queue
        .iter()
        .enumerate()
        .map(|(before, contender)| {
            let mode = contender.mode();
            let fits = match mode {
                Mode::Exclusive => before == 0,
                Mode::Shared => !exclusive_before,
                Mode::Permit { limit } => before < limit.get() as usize,
            };
            let holds = all_before_hold && fits;
            exclusive_before |= mode == Mode::Exclusive;
            all_before_hold = holds;
            holds
        })
        .collect()
}

/// The one contender whose going may let the waiting one at `me` hold.
/// The waiter watches only that one, so that a release wakes one waiter, not all. An
/// exclusive contender waits for the one just before it, a shared one for the nearest
/// exclusive one before it; `None` when nothing before it is in its way. A permit may hold
/// once any contender before it goes (each counts against its limit): `None` too, meaning
/// every contender before it — a backend may narrow that (ZooKeeper watches the waiter just
/// before it, which marks its node when it is granted).
pub fn blocker<C: Contender>(queue: &[C], me: usize) -> Option<usize> {
    let before = queue.get(..me)?;
    match queue[me].mode() {
        Mode::Exclusive => me.checked_sub(1),
        Mode::Shared => before.iter().rposition(|c| c.mode() == Mode::Exclusive),
        Mode::Permit { .. } => None,
    }
}

/// Whether the last contender of `queue` holds (`false` for an empty queue).
pub fn last_holds<C: Contender>(queue: &[C]) -> bool {
    holding(queue).last().copied().unwrap_or(false)
}

/// Whether `me` may be granted now, behind `holders` and before the waiters `ahead`.
/// That is on a backend that keeps its `holders` (in grant order) apart from the fair
/// waiters queued `ahead` of it: it holds behind them all, and each of them would still
/// hold were it granted after `me`.
pub fn may_hold<C: Contender>(holders: &[C], ahead: &[C], me: &C) -> bool {
    let line: Vec<Mode> = holders
        .iter()
        .chain(ahead)
        .chain([me])
        .map(C::mode)
        .collect();
    // Each waiter ahead, granted last of all: in its worst place.
    let waiters = holders.len()..line.len() - 1;
    last_holds(&line)
        && waiters.into_iter().all(|waiter| {
            let mut moved = line.clone();
            let mode = moved.remove(waiter);
            moved.push(mode);
            last_holds(&moved)
        })
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;

    const X: Mode = Mode::Exclusive;
    const S: Mode = Mode::Shared;

    fn p(limit: u32) -> Mode {
        Mode::Permit {
            limit: NonZeroU32::new(limit).unwrap(),
        }
    }

    #[test]
    fn an_exclusive_contender_holds_only_first() {
        assert_eq!(holding(&[X, X]), [true, false]);
        assert_eq!(holding(&[S, X]), [true, false]);
        assert_eq!(holding(&[X]), [true]);
        assert!(holding::<Mode>(&[]).is_empty());
    }

    #[test]
    fn readers_hold_together_until_a_writer_and_none_overtakes_it() {
        assert_eq!(holding(&[S, S, S]), [true, true, true]);
        assert_eq!(holding(&[S, X, S]), [true, false, false]);
        assert_eq!(holding(&[X, S, S]), [true, false, false]);
    }

    #[test]
    fn each_permit_counts_with_its_own_limit_in_arrival_order() {
        assert_eq!(holding(&[p(2), p(2), p(2)]), [true, true, false]);
        // A limit of 1 waits for the set to be empty; a limit of 3 behind it does not
        // overtake it, although it would fit.
        assert_eq!(holding(&[p(2), p(1), p(3)]), [true, false, false]);
        // Behind a holder of a smaller limit, a larger one fits.
        assert_eq!(holding(&[p(1), p(3), p(3)]), [true, true, true]);
        assert_eq!(holding(&[p(3), p(3), p(2)]), [true, true, false]);
    }

    #[test]
    fn a_waiter_watches_only_who_is_in_its_way() {
        let q = [S, S, X, S, X];
        assert_eq!(blocker(&q, 0), None);
        // A writer waits for the one just before it; a reader for the nearest writer.
        assert_eq!(blocker(&q, 2), Some(1));
        assert_eq!(blocker(&q, 3), Some(2));
        assert_eq!(blocker(&q, 4), Some(3));
        assert_eq!(blocker(&[p(2), p(2), p(2)], 2), None);
        assert_eq!(blocker(&q, 9), None);
    }

    #[test]
    fn a_request_goes_before_unclaimed_waiters_only_if_they_still_fit() {
        // Readers and equal permits: any order works.
        assert!(may_hold(&[S], &[S], &S));
        assert!(may_hold(&[p(3)], &[p(3)], &p(3)));
        assert!(!may_hold(&[p(3), p(3)], &[p(3)], &p(3)));
        // Nothing overtakes a writer; a writer waits for everyone.
        assert!(!may_hold(&[S], &[X], &S));
        assert!(!may_hold::<Mode>(&[], &[S], &X));
        // A limit of 1 at the head would hold; a limit of 3 granted first would push it
        // out (it fits only while nothing is held): wait for it to claim its place.
        assert!(!may_hold::<Mode>(&[], &[p(1)], &p(3)));
        assert!(may_hold(&[p(1)], &[], &p(3)));
        // Both fit in any order.
        assert!(may_hold::<Mode>(&[], &[p(2)], &p(3)));
    }

    #[test]
    fn holders_are_a_prefix_of_the_queue() {
        let modes = [X, S, p(1), p(2), p(3)];
        // Every queue of up to four contenders drawn from the modes.
        let mut queues: Vec<Vec<Mode>> = vec![vec![]];
        for _ in 0..4 {
            queues = queues
                .iter()
                .flat_map(|q| {
                    modes.iter().map(move |m| {
                        let mut q = q.clone();
                        q.push(*m);
                        q
                    })
                })
                .collect();
            for q in &queues {
                let holds = holding(q);
                let prefix = holds.iter().take_while(|h| **h).count();
                assert!(holds[prefix..].iter().all(|h| !h), "{q:?}: {holds:?}");
                assert_eq!(last_holds(q), holds.last().copied().unwrap_or(false));
            }
        }
    }
}
