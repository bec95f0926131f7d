//! A linearizability checker: Wing and Gong's search with Lowe's memoisation.
//!
//! A history of operations (each with the time it was called and, if an answer came, the
//! time it returned) is linearizable against a sequential model if the operations can be
//! put in one order that respects real time (an operation that returned before another was
//! called comes first) and in which the model, stepping through them, gives every answer
//! that was observed. Operations without an answer may take effect at any point after
//! their call, or not at all; the model's step decides what an unknown answer allows.
//!
//! The search (as in Lowe, "Testing for linearizability", 2017, and the Porcupine checker)
//! walks the calls in time order, tentatively linearizes the first call it can, and
//! backtracks when it meets a return whose call could not be placed. It remembers every
//! (set of linearized operations, model state) pair it has explored, so no configuration
//! is searched twice. Models may be nondeterministic: a step returns every state it may
//! lead to, and the search tracks the set of them (the power-set construction).
//!
//! Independent objects are checked one by one (P-compositionality): [`check_partitioned`].

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;

/// A sequential specification.
pub trait Model {
    /// The object's state. Ordered so that sets of states have one representation.
    type State: Clone + Ord + Hash + Debug;
    /// What an operation asked and answered.
    type Op: Debug;

    /// The state before any operation.
    fn init(&self) -> Self::State;

    /// Every state `op` may lead to from `state` (`op` knows its answer, or that none came).
    /// Empty: the answer is impossible from `state`.
    fn step(&self, state: &Self::State, op: &Call<Self::Op>) -> Vec<Self::State>;
}

/// One operation of a history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call<O> {
    /// When it was called.
    pub call: u64,
    /// When it returned; `None` if no answer came.
    pub ret: Option<u64>,
    /// What it asked and, if known, answered.
    pub op: O,
}

/// Why a history is not linearizable (or could not be decided).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// An order was found.
    Linearizable,
    /// No order exists.
    /// `stuck` is the operation (an index into the input) that no order could place;
    /// `prefix` the longest sequence of operations that could be placed.
    NotLinearizable {
        /// The operation that could not be placed after the longest prefix.
        stuck: usize,
        /// The longest linearizable prefix found, in order (indexes into the input).
        prefix: Vec<usize>,
    },
    /// The search gave up after this many steps.
    GaveUp(u64),
}

const NONE: usize = usize::MAX;

/// Checks `history` against `model`, giving up after `budget` search steps.
pub fn check<M: Model>(model: &M, history: &[Call<M::Op>], budget: u64) -> Outcome {
    let n = history.len();
    if n == 0 {
        return Outcome::Linearizable;
    }
    // Entries: a call and a return per operation, in time order; calls first on equal
    // times (operations that touch at an instant count as concurrent: the lenient reading).
    // Node 0 is the head of the list.
    let mut entries: Vec<(u64, u8, usize)> = Vec::with_capacity(2 * n);
    for (i, c) in history.iter().enumerate() {
        entries.push((c.call, 0, i));
        entries.push((c.ret.unwrap_or(u64::MAX), 1, i));
    }
    entries.sort_unstable();
    let len = 2 * n + 1;
    let mut is_call = vec![false; len];
    let mut id = vec![0usize; len];
    let mut matching = vec![NONE; len];
    let mut call_node = vec![0usize; n];
    for (k, &(_, kind, i)) in entries.iter().enumerate() {
        let node = k + 1;
        is_call[node] = kind == 0;
        id[node] = i;
        if kind == 0 {
            call_node[i] = node;
        } else {
            matching[call_node[i]] = node;
        }
    }
    let mut next: Vec<usize> = (0..len)
        .map(|k| if k + 1 < len { k + 1 } else { NONE })
        .collect();
    let mut prev: Vec<usize> = (0..len)
        .map(|k| if k == 0 { NONE } else { k - 1 })
        .collect();

    let lift = |next: &mut Vec<usize>, prev: &mut Vec<usize>, node: usize, ret: usize| {
        for x in [node, ret] {
            let (p, q) = (prev[x], next[x]);
            next[p] = q;
            if q != NONE {
                prev[q] = p;
            }
        }
    };
    let unlift = |next: &mut Vec<usize>, prev: &mut Vec<usize>, node: usize, ret: usize| {
        for x in [ret, node] {
            let (p, q) = (prev[x], next[x]);
            next[p] = x;
            if q != NONE {
                prev[q] = x;
            }
        }
    };

    let words = n.div_ceil(64);
    let mut linearized = vec![0u64; words];
    let mut cache: HashMap<Vec<u64>, Vec<Vec<M::State>>> = HashMap::new();
    let mut stack: Vec<(usize, Vec<M::State>)> = Vec::new();
    let mut states = vec![model.init()];
    let mut best: (Vec<usize>, usize) = (Vec::new(), NONE);
    let mut steps = 0u64;
    let mut node = next[0];
    while next[0] != NONE {
        steps += 1;
        if steps > budget {
            return Outcome::GaveUp(budget);
        }
        if node == NONE {
            // Cannot happen: an unplaced call is always followed by its return.
            break;
        }
        if is_call[node] {
            let i = id[node];
            let mut after: Vec<M::State> = states
                .iter()
                .flat_map(|s| model.step(s, &history[i]))
                .collect();
            after.sort();
            after.dedup();
            if !after.is_empty() {
                let mut with = linearized.clone();
                with[i / 64] |= 1 << (i % 64);
                let seen = cache.entry(with.clone()).or_default();
                if !seen.contains(&after) {
                    seen.push(after.clone());
                    stack.push((node, std::mem::replace(&mut states, after)));
                    linearized = with;
                    lift(&mut next, &mut prev, node, matching[node]);
                    node = next[0];
                    continue;
                }
            }
            node = next[node];
        } else {
            // A return whose call is not placed: nothing later can be placed first.
            if best.1 == NONE || stack.len() > best.0.len() {
                best = (stack.iter().map(|(c, _)| id[*c]).collect(), id[node]);
            }
            let Some((call, before)) = stack.pop() else {
                return Outcome::NotLinearizable {
                    stuck: best.1,
                    prefix: best.0,
                };
            };
            states = before;
            let i = id[call];
            linearized[i / 64] &= !(1 << (i % 64));
            unlift(&mut next, &mut prev, call, matching[call]);
            node = next[call];
        }
    }
    Outcome::Linearizable
}

/// A partition's key and its calls.
pub type Part<K, O> = (K, Vec<Call<O>>);

/// Checks each partition of `history` (by `key`) on its own.
/// A history of independent objects is linearizable if and only if each object's is.
/// Returns the first failure and the partition it was found in.
pub fn check_partitioned<M: Model, K: Ord + Clone>(
    model: &M,
    history: Vec<(K, Call<M::Op>)>,
    budget: u64,
) -> (Outcome, Option<Part<K, M::Op>>) {
    let mut parts: std::collections::BTreeMap<K, Vec<Call<M::Op>>> = Default::default();
    for (key, call) in history {
        parts.entry(key).or_default().push(call);
    }
    for (key, calls) in parts {
        match check(model, &calls, budget) {
            Outcome::Linearizable => {}
            other => return (other, Some((key, calls))),
        }
    }
    (Outcome::Linearizable, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read/write register; reads without an answer may read anything.
    struct Register;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum RegOp {
        Write(u32),
        Read(Option<u32>),
    }

    impl Model for Register {
        type State = u32;
        type Op = RegOp;
        fn init(&self) -> u32 {
            0
        }
        fn step(&self, state: &u32, c: &Call<RegOp>) -> Vec<u32> {
            match c.op {
                // A write without an answer may or may not have happened.
                RegOp::Write(v) if c.ret.is_none() => vec![*state, v],
                RegOp::Write(v) => vec![v],
                RegOp::Read(Some(v)) if v == *state => vec![*state],
                RegOp::Read(Some(_)) => vec![],
                RegOp::Read(None) => vec![*state],
            }
        }
    }

    fn c(call: u64, ret: Option<u64>, op: RegOp) -> Call<RegOp> {
        Call { call, ret, op }
    }

    use RegOp::{Read, Write};

    #[test]
    fn sequential_histories_are_checked_against_the_model() {
        let good = [c(0, Some(1), Write(1)), c(2, Some(3), Read(Some(1)))];
        assert_eq!(check(&Register, &good, 1000), Outcome::Linearizable);
        let bad = [c(0, Some(1), Write(1)), c(2, Some(3), Read(Some(2)))];
        assert!(matches!(
            check(&Register, &bad, 1000),
            Outcome::NotLinearizable { stuck: 1, .. }
        ));
    }

    #[test]
    fn concurrent_operations_may_take_effect_in_either_order() {
        // The read overlaps the write: both 0 and 1 are fine.
        for read in [0, 1] {
            let h = [c(0, Some(10), Write(1)), c(5, Some(6), Read(Some(read)))];
            assert_eq!(
                check(&Register, &h, 1000),
                Outcome::Linearizable,
                "read {read}"
            );
        }
        // Two reads after the write completed: a stale read after a fresh one is not
        // linearizable (the classic new-old inversion).
        let h = [
            c(0, Some(10), Write(1)),
            c(1, Some(2), Read(Some(1))),
            c(3, Some(4), Read(Some(0))),
        ];
        assert!(matches!(
            check(&Register, &h, 1000),
            Outcome::NotLinearizable { stuck: 2, .. }
        ));
    }

    #[test]
    fn an_unanswered_write_may_have_happened_or_not() {
        for read in [0, 7] {
            let h = [c(0, None, Write(7)), c(5, Some(6), Read(Some(read)))];
            assert_eq!(check(&Register, &h, 1000), Outcome::Linearizable);
        }
        let h = [
            c(0, None, Write(7)),
            c(5, Some(6), Read(Some(7))),
            c(7, Some(8), Read(Some(0))),
        ];
        assert!(matches!(
            check(&Register, &h, 1000),
            Outcome::NotLinearizable { .. }
        ));
    }

    #[test]
    fn memoisation_keeps_a_highly_concurrent_history_tractable() {
        // 12 concurrent writers, then a read of one value: 12! orders, but only
        // 12 * 2^11 distinct (placed set, state) pairs, each explored once.
        let mut h: Vec<_> = (1..=12).map(|v| c(0, Some(1000), Write(v))).collect();
        h.push(c(2000, Some(2001), Read(Some(9))));
        assert_eq!(check(&Register, &h, 5_000_000), Outcome::Linearizable);
        h.push(c(3000, Some(3001), Read(Some(0))));
        assert!(matches!(
            check(&Register, &h, 5_000_000),
            Outcome::NotLinearizable { .. }
        ));
    }

    #[test]
    fn the_budget_bounds_the_search() {
        let h: Vec<_> = (1..=50).map(|v| c(0, Some(1000), Write(v))).collect();
        assert_eq!(check(&Register, &h, 3), Outcome::GaveUp(3));
    }

    #[test]
    fn partitions_are_checked_independently() {
        let h = vec![
            ("a", c(0, Some(1), Write(1))),
            ("b", c(2, Some(3), Read(Some(0)))),
            ("a", c(4, Some(5), Read(Some(1)))),
        ];
        assert_eq!(
            check_partitioned(&Register, h, 1000).0,
            Outcome::Linearizable
        );
        let h = vec![
            ("a", c(0, Some(1), Write(1))),
            ("b", c(2, Some(3), Read(Some(1)))),
        ];
        let (outcome, part) = check_partitioned(&Register, h, 1000);
        assert!(matches!(outcome, Outcome::NotLinearizable { .. }));
        assert_eq!(part.unwrap().0, "b");
    }
}
