//! Redlock's majority arithmetic, as pure functions.
//! Every count of nodes that Redlock compares with a majority is compared here, and nowhere
//! else.

use std::time::Duration;

use leasehold_core::FencingToken;

/// The nodes of one Redlock deployment, as far as counting them goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Majority {
    nodes: usize,
}

impl Majority {
    /// The majority of `nodes` nodes.
    pub(crate) fn of(nodes: usize) -> Self {
        Self { nodes }
    }

    /// How many nodes must agree: a strict majority, `nodes / 2 + 1`.
    pub(crate) fn quorum(self) -> usize {
        self.nodes / 2 + 1
    }

    /// Whether `agreeing` nodes are enough.
    pub(crate) fn reached(self, agreeing: usize) -> bool {
        agreeing >= self.quorum()
    }

    /// Whether `refused` nodes leave too few for a majority ever to say yes.
    /// A node refuses by saying no, or by being gone.
    pub(crate) fn out_of_reach(self, refused: usize) -> bool {
        refused > self.nodes - self.quorum().min(self.nodes)
    }

    /// The token of an attempt granted by a majority, and whether to write it back first.
    /// `tokens` are the answers of the nodes that granted; `None` unless they are a
    /// majority. The token is the highest of them; it must be written back to a majority
    /// first when fewer than a majority stand at it already.
    pub(crate) fn granted(self, tokens: &[FencingToken]) -> Option<(FencingToken, bool)> {
        let highest = *tokens.iter().max()?;
        let at_highest = tokens.iter().filter(|&&t| t == highest).count();
        self.reached(tokens.len())
            .then_some((highest, !self.reached(at_highest)))
    }

    /// Whether an attempt that was not granted gives back on every node.
    /// Otherwise it gives back only where a grant exists or may exist. Of its nodes,
    /// `answered` answered and `granted` granted; it gives back everywhere after an outage
    /// (too few answered) and after a majority granted too late or could not be written
    /// back.
    pub(crate) fn release_everywhere(self, answered: usize, granted: usize) -> bool {
        !self.reached(answered) || self.reached(granted)
    }

    /// What a majority of the nodes reach at least: the `quorum`-th highest of `values`.
    /// `values` holds one value per node that reports it; `None` if fewer than a majority
    /// report one.
    pub(crate) fn held_by_majority<T: Ord>(self, values: impl IntoIterator<Item = T>) -> Option<T> {
        let mut values: Vec<T> = values.into_iter().collect();
        values.sort_unstable_by(|a, b| b.cmp(a));
        values.into_iter().nth(self.quorum() - 1)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quorum_is_a_strict_majority() {
        let quorum = |n| Majority::of(n).quorum();
        assert_eq!(
            (1..=7).map(quorum).collect::<Vec<_>>(),
            [1, 2, 2, 3, 3, 4, 4]
        );
        for n in 1..=9 {
            let majority = Majority::of(n);
            let q = majority.quorum();
            // Two quorums always share a node, and a quorum survives n - quorum failures.
            assert!(2 * q > n, "{n}");
            assert!(majority.reached(q) && !majority.reached(q - 1), "{n}");
            assert!(!majority.out_of_reach(n - q));
            assert!(majority.out_of_reach(n - q + 1));
        }
    }

    #[test]
    fn a_grant_takes_the_highest_token_and_writes_it_back_unless_a_majority_has_it() {
        let t = |tokens: &[u64]| {
            tokens
                .iter()
                .map(|&t| FencingToken::new(t))
                .collect::<Vec<_>>()
        };
        let five = Majority::of(5);
        assert_eq!(five.granted(&t(&[])), None);
        assert_eq!(five.granted(&t(&[9, 9])), None, "two of five");
        assert_eq!(
            five.granted(&t(&[7, 9, 9])),
            Some((FencingToken::new(9), true)),
            "only two of five stand at 9"
        );
        assert_eq!(
            five.granted(&t(&[9, 7, 9, 9])),
            Some((FencingToken::new(9), false))
        );
        assert_eq!(
            Majority::of(1).granted(&t(&[4])),
            Some((FencingToken::new(4), false))
        );
    }

    #[test]
    fn a_failed_attempt_gives_back_everywhere_after_an_outage_or_a_majority() {
        let three = Majority::of(3);
        // Contention: the one node that granted (or did not answer) is released alone.
        assert!(!three.release_everywhere(3, 1));
        assert!(!three.release_everywhere(2, 0));
        // Too few answered: an outage.
        assert!(three.release_everywhere(1, 1));
        // A majority granted, but too late or without its write-back.
        assert!(three.release_everywhere(3, 2));
    }

    #[test]
    fn a_majority_holds_what_its_quorum_th_highest_reports() {
        let three = Majority::of(3);
        assert_eq!(three.held_by_majority([5]), None);
        assert_eq!(three.held_by_majority([5, 9]), Some(5));
        assert_eq!(three.held_by_majority([9, 5, 7]), Some(7));
        // `None` (no time reported) counts lowest.
        assert_eq!(three.held_by_majority([None, Some(3)]), Some(None));
        assert_eq!(
            three.held_by_majority([Some(3), None, Some(8)]),
            Some(Some(3))
        );
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
