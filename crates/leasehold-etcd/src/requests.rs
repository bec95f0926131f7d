//! The requests the backend sends: each a transaction (or a plain delete), shaped here.

use crate::layout::MARKER;
use crate::registry::Placed;
use crate::rpc::{
    Compare, CompareResult, DeleteRangeRequest, PutRequest, RangeRequest, RequestOp, SortOrder,
    SortTarget, TargetUnion, TxnRequest, compare,
};

/// The end of the range of keys starting with `prefix`.
pub(crate) fn prefix_end(prefix: impl AsRef<[u8]>) -> Vec<u8> {
    let mut end = prefix.as_ref().to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    end
}

/// A read of the queue in `dir`, oldest create revision first.
pub(crate) fn sorted(dir: &str) -> RangeRequest {
    RangeRequest {
        key: dir.into(),
        range_end: prefix_end(dir),
        sort_order: SortOrder::Ascend.into(),
        sort_target: SortTarget::Create.into(),
        ..RangeRequest::default()
    }
}

/// A read of at most `limit` keys of `[from, end)`, in key order.
pub(crate) fn page(from: Vec<u8>, end: Vec<u8>, limit: usize) -> RangeRequest {
    RangeRequest {
        key: from,
        range_end: end,
        limit: i64::try_from(limit).unwrap_or(i64::MAX),
        ..RangeRequest::default()
    }
}

/// A read of the one key `key`.
pub(crate) fn get(key: impl Into<Vec<u8>>) -> RangeRequest {
    RangeRequest {
        key: key.into(),
        ..RangeRequest::default()
    }
}

/// A transaction that runs `success` if every one of `compare` holds, else `failure`.
fn txn(
    compare: impl Into<Vec<Compare>>,
    success: impl IntoIterator<Item = RequestOp>,
    failure: impl IntoIterator<Item = RequestOp>,
) -> TxnRequest {
    TxnRequest {
        compare: compare.into(),
        success: success.into_iter().collect(),
        failure: failure.into_iter().collect(),
    }
}

/// A put of `key` bound to `lease` (none: 0).
pub(crate) fn put(key: impl Into<Vec<u8>>, value: Vec<u8>, lease: i64) -> RequestOp {
    PutRequest {
        key: key.into(),
        value,
        lease,
        ..PutRequest::default()
    }
    .into()
}

/// A delete of the one key `key`.
pub(crate) fn delete(key: impl Into<Vec<u8>>) -> RequestOp {
    DeleteRangeRequest {
        key: key.into(),
        range_end: Vec::new(),
    }
    .into()
}

/// Whether `key` exists (`Equal` to 0: it does not).
fn created(key: impl Into<Vec<u8>>, result: CompareResult, revision: i64) -> Compare {
    compare(key, result, TargetUnion::CreateRevision(revision))
}

/// `write`, only if `key` was created at `revision`: a write fenced by the grant of that key.
pub(crate) fn fenced(key: Vec<u8>, revision: i64, write: RequestOp) -> TxnRequest {
    txn([created(key, CompareResult::Equal, revision)], [write], [])
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
        compare(
            self.key,
            CompareResult::Equal,
            TargetUnion::ModRevision(self.revision),
        )
    }

    fn read(self) -> RequestOp {
        get(self.key).into()
    }
}

/// Nothing under `dir`.
fn empty(dir: &str) -> Compare {
    Compare {
        range_end: prefix_end(dir),
        ..created(dir, CompareResult::Equal, 0)
    }
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
pub(crate) fn acquire(
    shape: AcquireShape,
    placed: &Placed,
    value: &[u8],
    fence: Fence<'_>,
) -> TxnRequest {
    let (key, set) = (placed.key(), &placed.set);
    let reads = || -> [RequestOp; 2] { [sorted(&set.dir).into(), sorted(&set.markers).into()] };
    let put_key = || put(key.as_str(), value.to_vec(), placed.lease);
    // The fence holds, and nothing is under the queue's directories: no holder, waiter or
    // lock-delay marker.
    let free = || [fence.holds(), empty(&set.dir), empty(&set.markers)];
    match shape {
        AcquireShape::Woken => txn(
            [created(key.as_str(), CompareResult::NotEqual, 0)],
            reads(),
            [],
        ),
        AcquireShape::Try => {
            let [contenders, markers] = reads();
            txn(free(), [put_key()], [contenders, markers, fence.read()])
        }
        AcquireShape::Join => {
            let [contenders, markers] = reads();
            let join = txn(
                [fence.holds()],
                [put_key(), contenders, markers],
                [fence.read()],
            );
            txn(free(), [put_key()], [join.into()])
        }
    }
}

/// Removes `placed`'s key if it is still the one this acquisition wrote.
/// Its lock-delay marker goes too, if `marker`. The key is recognised by its create
/// revision when an answer showed it, else by its value (which names the acquisition's
/// owner). Succeeds, with the delete's answer first, when it removed the key. With `bump`,
/// the fence of the key's session is moved too, whatever else happens, so that no put of
/// this acquisition can land afterwards.
pub(crate) fn remove(
    placed: &Placed,
    value: &[u8],
    marker: bool,
    bump: Option<&str>,
) -> TxnRequest {
    let key = placed.key();
    let ours = match placed.revision {
        Some(revision) => created(key.as_str(), CompareResult::Equal, revision),
        None => compare(
            key.as_str(),
            CompareResult::Equal,
            TargetUnion::Value(value.to_vec()),
        ),
    };
    let mut then = vec![delete(key.as_str())];
    if marker {
        then.push(delete(placed.marker()));
    }
    let mut otherwise = Vec::new();
    if let Some(anchor) = bump {
        // The fence key keeps its value and lease; only its mod revision moves. A session
        // whose lease is gone has no fence left to move (and no put of it can land).
        let touch = PutRequest {
            key: anchor.into(),
            ignore_value: true,
            ignore_lease: true,
            ..PutRequest::default()
        };
        let moved = txn(
            [created(anchor, CompareResult::NotEqual, 0)],
            [touch.into()],
            [],
        );
        then.push(moved.clone().into());
        otherwise.push(moved.into());
    }
    txn([ours], then, otherwise)
}

/// Puts the lock-delay marker of `placed` for `owner`, bound to the delay lease `lease`.
/// The put happens only if the key is still the one created at `revision`.
pub(crate) fn put_marker(placed: &Placed, owner: &str, revision: i64, lease: i64) -> TxnRequest {
    let mut value = MARKER.to_vec();
    value.extend_from_slice(owner.as_bytes());
    txn(
        [created(placed.key(), CompareResult::Equal, revision)],
        [put(placed.marker(), value, lease)],
        [],
    )
}

/// Puts the record `value` under `record`, bound to `lease`, while `placed`'s grant holds.
/// The grant holds while its key is there with the create revision `revision` it was
/// granted with (a holder holds until its key is deleted). Succeeds when it wrote.
pub(crate) fn put_record(
    placed: &Placed,
    revision: i64,
    record: String,
    value: Vec<u8>,
    lease: i64,
) -> TxnRequest {
    txn(
        [created(placed.key(), CompareResult::Equal, revision)],
        [put(record, value, lease)],
        [],
    )
}

/// Binds `placed`'s key to `lease` instead of its session's, while it is the one granted.
/// The grant is recognised as in [`put_record`]. The put keeps the key's value and its
/// create revision — its place in the queue, its fencing token — and waiters watch only
/// deletions, so none wakes; the key is deleted when `lease` runs out, not with the
/// session. Its lock-delay marker is deleted too, if `marker`: the grant ends as planned,
/// its holder did not vanish. Succeeds when it moved the key.
pub(crate) fn keep(placed: &Placed, revision: i64, lease: i64, marker: bool) -> TxnRequest {
    let key = placed.key();
    let rebind = PutRequest {
        key: key.clone().into(),
        ignore_value: true,
        lease,
        ..PutRequest::default()
    };
    let mut then = vec![rebind.into()];
    if marker {
        then.push(delete(placed.marker()));
    }
    txn([created(key, CompareResult::Equal, revision)], then, [])
}

/// A read of the latest `limit` eviction records in `dir`, newest (highest token) first.
pub(crate) fn evictions(dir: &str, limit: usize) -> RangeRequest {
    RangeRequest {
        key: dir.into(),
        range_end: prefix_end(dir),
        limit: i64::try_from(limit).unwrap_or(i64::MAX),
        sort_order: SortOrder::Descend.into(),
        sort_target: SortTarget::Key.into(),
        ..RangeRequest::default()
    }
}

/// What an eviction writes beside the key it deletes.
#[derive(Debug)]
pub(crate) struct EvictionWrites {
    /// The marker that keeps the set closed, its value and its lease (none: not closed).
    pub(crate) marker: Option<(String, Vec<u8>, i64)>,
    /// The eviction record, its value and its lease.
    pub(crate) record: (String, Vec<u8>, i64),
    /// Keys to delete with it: the grant's own lock-delay marker, records past the last kept.
    pub(crate) deletes: Vec<Vec<u8>>,
}

/// Deletes `key` if it is the one created at `revision`, and makes `writes`.
/// Succeeds when it deleted the key; writes nothing otherwise.
pub(crate) fn evict(key: &[u8], revision: i64, writes: EvictionWrites) -> TxnRequest {
    let EvictionWrites {
        marker,
        record: (record, record_value, record_lease),
        deletes,
    } = writes;
    let mut then = vec![delete(key)];
    then.extend(deletes.into_iter().map(delete));
    then.extend(marker.map(|(key, value, lease)| put(key, value, lease)));
    then.push(put(record, record_value, record_lease));
    txn([created(key, CompareResult::Equal, revision)], then, [])
}

/// Reads every queue in `dirs` in one transaction.
pub(crate) fn read_all(dirs: &[String]) -> TxnRequest {
    read_ops(dirs.iter().map(|dir| sorted(dir).into()))
}

/// Runs every read of `reads` in one transaction.
pub(crate) fn read_ops(reads: impl IntoIterator<Item = RequestOp>) -> TxnRequest {
    txn([], reads, [])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_where_its_last_byte_is_one_more() {
        assert_eq!(prefix_end("a/b/"), b"a/b0".to_vec());
    }
}
