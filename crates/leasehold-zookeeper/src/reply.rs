//! What a directory listing says, and a holder's token.
//! A listing gives its contenders in queue order, who holds, and whom each waiter watches.
//!
//! A child whose name is not one this backend writes (Curator's `_c_<uuid>-lock-`, kazoo's
//! `<uuid>__lock__`) is a foreign contender: an exclusive holder or waiter like any other,
//! ordered by its sequence number. A child without a sequence number is no contender.

use leasehold_core::backend::Mode;
use leasehold_core::{Error, FencingToken, OwnerId, Result};
use zookeeper_client as zk;

use crate::error::map;
use crate::layout;

/// One child of a lock directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Contender {
    /// Its name in the directory.
    pub(crate) node: String,
    /// The sequence number ZooKeeper gave it.
    pub(crate) seq: i64,
    /// Whose: `None` for a foreign contender (Curator, another recipe).
    pub(crate) owner: Option<OwnerId>,
    /// How it holds; foreign contenders count as exclusive.
    pub(crate) mode: Mode,
    /// Its grant has a lock-delay marker (ours only).
    pub(crate) delayed: bool,
}

impl leasehold_core::support::queue::Contender for Contender {
    fn mode(&self) -> Mode {
        self.mode
    }
}

impl Contender {
    /// Reads a child's name; `None` for a child without a sequence number.
    /// Such a child is not a contender of any queue recipe.
    pub(crate) fn parse(node: &str) -> Option<Contender> {
        let digits = node.len() - node.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        // ZooKeeper writes at least ten digits.
        if digits < 10 {
            return None;
        }
        let (head, seq) = node.split_at(node.len() - digits);
        let seq: i64 = seq.parse().ok()?;
        let (owner, mode, delayed) = match layout::parse_node_prefix(head) {
            Some((owner, mode, delayed)) => (Some(owner), mode, delayed),
            None => (None, Mode::Exclusive, false),
        };
        Some(Contender {
            node: node.to_owned(),
            seq,
            owner,
            mode,
            delayed,
        })
    }

    /// The owner to show for it: ours, or a foreign one's name without its sequence number.
    /// A foreign name is, for example, Curator's `_c_<uuid>-lock-`.
    pub(crate) fn shown_owner(&self) -> OwnerId {
        if let Some(owner) = &self.owner {
            return owner.clone();
        }
        let head = self.node.trim_end_matches(|c: char| c.is_ascii_digit());
        OwnerId::parse(head)
            .or_else(|_| OwnerId::parse("foreign"))
            .expect("\"foreign\" is a valid owner id")
    }
}

/// The contenders of a directory, in queue order (by sequence number).
/// Its lock-delay markers are left out.
pub(crate) fn queue(children: &[String]) -> Vec<Contender> {
    let mut queue: Vec<Contender> = children
        .iter()
        .filter(|c| layout::marker_owner(c).is_none())
        .filter_map(|c| Contender::parse(c))
        .collect();
    queue.sort_by_key(|c| c.seq);
    queue
}

/// Which contenders of a queue hold, by the contract's one rule.
/// By that rule ([`leasehold_core::support::queue`]) the holders are a prefix of the
/// queue, each permit counting with its own limit, so contenders become holders in queue
/// order, the order of their nodes' czxids, their tokens. `set` is the mode of a request to
/// the set: in a permit set, a foreign contender counts as a permit with that request's
/// limit.
pub(crate) fn holding(queue: &[Contender], set: Mode) -> Vec<bool> {
    let modes: Vec<Mode> = queue
        .iter()
        .map(|c| match (c.mode, set) {
            (Mode::Permit { .. }, _) | (_, Mode::Exclusive | Mode::Shared) => c.mode,
            (_, Mode::Permit { .. }) => set,
        })
        .collect();
    leasehold_core::support::queue::holding(&modes)
}

/// The contenders whose change may let the one at `me` hold: the only ones it watches.
/// A writer or a reader watches the one in its way
/// ([`blocker`](leasehold_core::support::queue::blocker)); a permit the one just before it
/// while that one waits too (it touches its node when it is granted, see
/// `Backend::acquire`), or every holder when it is the first to wait.
///
/// Each with whether it holds.
pub(crate) fn in_the_way<'q>(
    queue: &'q [Contender],
    holds: &[bool],
    me: usize,
) -> Vec<(&'q Contender, bool)> {
    match queue[me].mode {
        Mode::Permit { .. } => match me.checked_sub(1) {
            Some(before) if !holds[before] => vec![(&queue[before], false)],
            _ => queue[..me]
                .iter()
                .zip(holds[..me].iter().copied())
                .filter(|(_, holds)| *holds)
                .collect(),
        },
        _ => leasehold_core::support::queue::blocker(queue, me)
            .map(|i| (&queue[i], holds[i]))
            .into_iter()
            .collect(),
    }
}

/// Whether the contender at `me` holds, with nothing to check, once its watched node goes.
/// It does for a writer second in line, or a reader behind exactly one writer, when no node
/// ahead of it has a lock-delay marker (the going of such a node, the blocker or a reader
/// holding beside it, may close the lock). Nodes created later come after `me`, so nothing
/// else can get in the way.
pub(crate) fn sole_blocker(queue: &[Contender], me: usize) -> bool {
    let ahead = &queue[..me];
    if ahead.iter().any(|c| c.delayed) {
        return false;
    }
    let blockers = match queue[me].mode {
        Mode::Exclusive => ahead.len(),
        Mode::Shared => ahead.iter().filter(|c| c.mode == Mode::Exclusive).count(),
        Mode::Permit { .. } => return false,
    };
    blockers == 1
}

/// A listing, with a missing directory read as empty.
pub(crate) fn or_empty(
    listed: std::result::Result<Vec<String>, zk::Error>,
    dir: &str,
) -> Result<Vec<String>> {
    match listed {
        Ok(children) => Ok(children),
        Err(zk::Error::NoNode) => Ok(Vec::new()),
        Err(e) => Err(map(e, &format!("listing {dir}"))),
    }
}

/// A grant's fencing token: its node's czxid.
///
/// # Errors
///
/// [`Error::Backend`] for a czxid that is no zxid: the reply did not decode.
pub(crate) fn token(czxid: i64) -> Result<FencingToken> {
    u64::try_from(czxid)
        .map(FencingToken::new)
        .map_err(|_| Error::backend(format!("zookeeper: a node has czxid {czxid}"), false))
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use crate::layout::node_prefix;

    fn name(owner: &str, mode: Mode, seq: i64) -> String {
        format!(
            "{}{seq:010}",
            node_prefix(&OwnerId::parse(owner).unwrap(), mode, false)
        )
    }

    #[test]
    fn listings_parse_and_foreign_children_are_exclusive() {
        let limit = NonZeroU32::new(3).unwrap();
        for mode in [Mode::Exclusive, Mode::Shared, Mode::Permit { limit }] {
            let node = name("1a2b-00ff", mode, 42);
            let parsed = Contender::parse(&node).unwrap();
            assert_eq!(parsed.seq, 42);
            assert_eq!(parsed.mode, mode);
            assert_eq!(parsed.owner.unwrap().as_str(), "1a2b-00ff");
        }
        // Curator's InterProcessMutex, kazoo's Lock: exclusive, ordered by sequence.
        let curator =
            Contender::parse("_c_0f8f5e4a-1b2c-4d5e-8f90-123456789abc-lock-0000000007").unwrap();
        assert_eq!(
            (curator.seq, curator.mode, curator.owner.clone()),
            (7, Mode::Exclusive, None)
        );
        assert_eq!(
            curator.shown_owner().as_str(),
            "_c_0f8f5e4a-1b2c-4d5e-8f90-123456789abc-lock-"
        );
        let kazoo = Contender::parse("4c5d__lock__0000000003").unwrap();
        assert_eq!((kazoo.seq, kazoo.owner.is_none()), (3, true));
        // Past i32: ZooKeeper writes 19 digits.
        assert_eq!(
            Contender::parse(&format!("o-x-lock-{:019}", 1_i64 << 40))
                .unwrap()
                .seq,
            1 << 40
        );
        let delayed = format!(
            "{}0000000005",
            node_prefix(&OwnerId::parse("o").unwrap(), Mode::Shared, true)
        );
        let parsed = Contender::parse(&delayed).unwrap();
        assert_eq!((parsed.mode, parsed.delayed), (Mode::Shared, true));
        // Lock-delay markers are not contenders.
        let marker = layout::marker_name(&OwnerId::parse("1a2b-00ff").unwrap());
        assert!(queue(std::slice::from_ref(&marker)).is_empty());
        // Not contenders: no sequence number.
        assert!(Contender::parse("config").is_none());
        assert!(Contender::parse("o-x-lock-123").is_none());
        // Not ours: a mode token we never write.
        for odd in [
            "o-p0-lock-0000000001",
            "o-p03-lock-0000000001",
            "o-q-lock-0000000001",
        ] {
            assert!(Contender::parse(odd).unwrap().owner.is_none(), "{odd}");
        }
        assert!(token(-1).is_err());
        assert_eq!(token(42).unwrap(), FencingToken::new(42));
    }

    fn q(modes: &[Mode]) -> Vec<Contender> {
        let children: Vec<String> = modes
            .iter()
            .enumerate()
            .map(|(i, m)| name(&format!("o{i}"), *m, i as i64 + 1))
            .collect();
        queue(&children)
    }

    #[test]
    fn who_holds_and_what_each_waiter_watches() {
        let (x, s) = (Mode::Exclusive, Mode::Shared);
        // Sorted by sequence whatever the listing order.
        let children = vec![name("b", x, 9), name("a", x, 3), "junk".into()];
        let sorted = queue(&children);
        assert_eq!(sorted.iter().map(|c| c.seq).collect::<Vec<_>>(), [3, 9]);

        let lock = q(&[s, s, x, s, x]);
        let holds = holding(&lock, x);
        assert_eq!(holds, [true, true, false, false, false]);
        let watched = |me| -> Vec<i64> {
            in_the_way(&lock, &holds, me)
                .iter()
                .map(|(c, _)| c.seq)
                .collect()
        };
        // The writer waits for the reader just before it; the late reader for the writer;
        // the second writer for the reader just before it.
        assert_eq!(watched(2), [2]);
        assert_eq!(watched(3), [3]);
        assert_eq!(watched(4), [4]);
        assert!(watched(0).is_empty());

        let p = Mode::Permit {
            limit: NonZeroU32::new(2).unwrap(),
        };
        let permits = q(&[p, p, p, p]);
        let holds = holding(&permits, p);
        assert_eq!(holds, [true, true, false, false]);
        // The first waiter watches every holder; the next one the waiter before it.
        let seqs = |v: Vec<(&Contender, bool)>| v.iter().map(|(c, _)| c.seq).collect::<Vec<_>>();
        assert_eq!(
            seqs(in_the_way(&permits, &holds, 2)),
            [permits[0].seq, permits[1].seq]
        );
        assert_eq!(seqs(in_the_way(&permits, &holds, 3)), [permits[2].seq]);
        // Woken by the one node in its way, with nothing else to check.
        assert!(sole_blocker(&q(&[x, x]), 1));
        assert!(!sole_blocker(&q(&[x, x, x]), 2), "two ahead");
        assert!(
            sole_blocker(&q(&[s, x, s, s]), 3),
            "one writer ahead of a reader"
        );
        assert!(
            !sole_blocker(&q(&[x, s, x, s]), 3),
            "two writers ahead of a reader"
        );
        let mut delayed = q(&[x, x]);
        delayed[0].delayed = true;
        assert!(!sole_blocker(&delayed, 1), "its going may close the lock");
        let mut delayed = q(&[s, x, s]);
        delayed[0].delayed = true;
        assert!(
            !sole_blocker(&delayed, 2),
            "a reader ahead may vanish and close the lock"
        );
        assert!(!sole_blocker(&permits, 2));
        // A foreign child in a permit set takes one permit.
        let foreign = queue(&[
            "_c_u-lock-0000000001".into(),
            name("o", p, 2),
            name("o2", p, 3),
        ]);
        assert_eq!(holding(&foreign, p), [true, true, false]);
        // A permit never overtakes a waiting one, whatever the limits: holders are a prefix.
        let limit = |n| Mode::Permit {
            limit: NonZeroU32::new(n).unwrap(),
        };
        let mixed = q(&[limit(2), limit(2), limit(1), limit(4)]);
        assert_eq!(holding(&mixed, limit(4)), [true, true, false, false]);
        let mixed = q(&[limit(1), limit(4)]);
        assert_eq!(holding(&mixed, limit(4)), [true, true]);
    }
}
