//! Redlock's majority arithmetic, as pure functions.

use std::time::Duration;

/// How many of `nodes` must agree: a strict majority, `nodes / 2 + 1`.
pub(crate) fn quorum(nodes: usize) -> usize {
    nodes / 2 + 1
}

/// What is left of a lease of `ttl` once `elapsed` has passed since the requests were sent.
/// `ttl` is as every node granted it; `None` if nothing is left.
///
/// The engine counts the result from the send time and subtracts its drift allowance
/// (`ttl × drift_factor + drift_margin`), so the holder's deadline is
/// `sent + ttl − elapsed − drift`: the validity of the Redlock algorithm.
pub(crate) fn validity(ttl: Duration, elapsed: Duration) -> Option<Duration> {
    ttl.checked_sub(elapsed).filter(|left| !left.is_zero())
}

/// Whether `refused` of `nodes` saying no leaves too few for a majority ever to say yes.
pub(crate) fn out_of_reach(nodes: usize, refused: usize) -> bool {
    refused > nodes - quorum(nodes).min(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quorum_is_a_strict_majority() {
        assert_eq!(
            (1..=7).map(quorum).collect::<Vec<_>>(),
            [1, 2, 2, 3, 3, 4, 4]
        );
        for n in 1..=9 {
            // Two quorums always share a node, and a quorum survives n - quorum failures.
            assert!(2 * quorum(n) > n, "{n}");
            assert!(!out_of_reach(n, n - quorum(n)));
            assert!(out_of_reach(n, n - quorum(n) + 1));
        }
    }

    #[test]
    fn validity_is_what_is_left_of_the_lease() {
        let ms = Duration::from_millis;
        assert_eq!(validity(ms(1000), ms(150)), Some(ms(850)));
        assert_eq!(validity(ms(1000), ms(1000)), None);
        assert_eq!(validity(ms(1000), ms(1500)), None);
        assert_eq!(validity(ms(1000), Duration::ZERO), Some(ms(1000)));
    }
}
