//! The requests the backend sends: each a transaction (or a plain delete), shaped here.

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp};

use crate::layout::MARKER;
use crate::registry::Placed;

/// The end of the range of keys starting with `prefix`.
pub(crate) fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    end
}

/// A read of the queue in `dir`, oldest create revision first.
pub(crate) fn sorted(dir: &str) -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_range(prefix_end(dir))
}

/// Which acquire transaction to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AcquireShape {
    /// Woken from waiting: the key must still be there (and so its lease alive); never re-queue.
    /// Reads the queue.
    Woken,
    /// A try for the exclusive lock: put only if the queue is empty.
    /// It takes one round trip either way (a busy try writes nothing).
    Try,
    /// Take an empty queue with a bare put; otherwise join the queue and read it.
    /// The bare put reads nothing back. If the put of an unanswered attempt already landed,
    /// putting the key again keeps its create revision (its place in the queue), and its
    /// watchers ignore puts.
    Join,
}

/// A session's fence: its key, and the mod revision a put requires.
/// See [`Layout::anchor`](crate::layout::Layout::anchor).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fence<'a> {
    pub(crate) key: &'a str,
    pub(crate) revision: i64,
}

impl Fence<'_> {
    fn holds(self) -> Compare {
        Compare::mod_revision(self.key, CompareOp::Equal, self.revision)
    }

    fn read(self) -> TxnOp {
        TxnOp::get(self.key, None)
    }
}

/// Nothing under `dir`.
fn empty(dir: &str) -> Compare {
    Compare::create_revision(dir, CompareOp::Equal, 0).with_range(prefix_end(dir))
}

/// The acquire transaction of `placed`'s key, which writes only while `fence` holds.
/// The key's value is `value`, bound to its session's lease. Its answers:
///
/// - succeeded (`Try`, `Join`): the queue was empty, the key was put and holds;
/// - succeeded (`Woken`): the key is there; reads `[contenders, markers]`;
/// - failed (`Try`): nothing written; reads `[contenders, markers, fence]`;
/// - failed (`Join`): one nested transaction, which succeeded — the key was put; reads
///   `[put, contenders, markers]` — or failed — nothing written; reads `[fence]`;
/// - failed (`Woken`): the key is gone.
///
/// A put whose fence moved writes nothing: the fence read says where it is now (or that
/// the session's lease is gone).
pub(crate) fn acquire(shape: AcquireShape, placed: &Placed, value: &[u8], fence: Fence<'_>) -> Txn {
    let (key, set) = (placed.key(), &placed.set);
    let reads = || {
        [
            TxnOp::get(set.dir.as_str(), Some(sorted(&set.dir))),
            TxnOp::get(set.markers.as_str(), Some(sorted(&set.markers))),
        ]
    };
    let put = || {
        TxnOp::put(
            key.as_str(),
            value.to_vec(),
            Some(PutOptions::new().with_lease(placed.lease)),
        )
    };
    // The fence holds, and nothing is under the queue's directories: no holder, waiter or
    // lock-delay marker.
    let free = || [fence.holds(), empty(&set.dir), empty(&set.markers)];
    match shape {
        AcquireShape::Woken => Txn::new()
            .when([Compare::create_revision(
                key.as_str(),
                CompareOp::NotEqual,
                0,
            )])
            .and_then(reads()),
        AcquireShape::Try => {
            let [contenders, markers] = reads();
            Txn::new()
                .when(free())
                .and_then([put()])
                .or_else([contenders, markers, fence.read()])
        }
        AcquireShape::Join => {
            let [contenders, markers] = reads();
            let join = Txn::new()
                .when([fence.holds()])
                .and_then([put(), contenders, markers])
                .or_else([fence.read()]);
            Txn::new()
                .when(free())
                .and_then([put()])
                .or_else([TxnOp::txn(join)])
        }
    }
}

/// Removes `placed`'s key if it is still the one this acquisition wrote.
/// Its lock-delay marker goes too, if `marker`. The key is recognised by its create
/// revision when an answer showed it, else by its value (which names the acquisition's
/// owner). Succeeds, with the delete's answer first, when it removed the key. With `bump`,
/// the fence of the key's session is moved too, whatever else happens, so that no put of
/// this acquisition can land afterwards.
pub(crate) fn remove(placed: &Placed, value: &[u8], marker: bool, bump: Option<&str>) -> Txn {
    let key = placed.key();
    let ours = match placed.revision {
        Some(revision) => Compare::create_revision(key.as_str(), CompareOp::Equal, revision),
        None => Compare::value(key.as_str(), CompareOp::Equal, value.to_vec()),
    };
    let mut then = vec![TxnOp::delete(key.as_str(), None)];
    if marker {
        then.push(TxnOp::delete(placed.marker(), None));
    }
    let mut otherwise = Vec::new();
    if let Some(anchor) = bump {
        // The fence key keeps its value and lease; only its mod revision moves. A session
        // whose lease is gone has no fence left to move (and no put of it can land).
        let moved = Txn::new()
            .when([Compare::create_revision(anchor, CompareOp::NotEqual, 0)])
            .and_then([TxnOp::put(
                anchor,
                Vec::new(),
                Some(PutOptions::new().with_ignore_value().with_ignore_lease()),
            )]);
        then.push(TxnOp::txn(moved.clone()));
        otherwise.push(TxnOp::txn(moved));
    }
    Txn::new().when([ours]).and_then(then).or_else(otherwise)
}

/// Puts the lock-delay marker of `placed` for `owner`, bound to the delay lease `lease`.
/// The put happens only if the key is still the one created at `revision`.
pub(crate) fn put_marker(placed: &Placed, owner: &str, revision: i64, lease: i64) -> Txn {
    let mut value = MARKER.to_vec();
    value.extend_from_slice(owner.as_bytes());
    Txn::new()
        .when([Compare::create_revision(
            placed.key(),
            CompareOp::Equal,
            revision,
        )])
        .and_then([TxnOp::put(
            placed.marker(),
            value,
            Some(PutOptions::new().with_lease(lease)),
        )])
}

/// Reads every queue in `dirs` in one transaction.
pub(crate) fn read_all(dirs: &[String]) -> Txn {
    Txn::new().and_then(
        dirs.iter()
            .map(|dir| TxnOp::get(dir.as_str(), Some(sorted(dir))))
            .collect::<Vec<_>>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_where_its_last_byte_is_one_more() {
        assert_eq!(prefix_end("a/b/"), b"a/b0".to_vec());
    }
}
