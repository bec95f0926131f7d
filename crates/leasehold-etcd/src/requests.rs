//! The requests the backend sends: each a transaction (or a plain delete), shaped here.

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp};

use crate::keys::{MARKER, Placed};

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
    /// Woken from waiting: the key must still be there (and so its lease alive); never
    /// re-queue. Reads the queue.
    Woken,
    /// A try for the exclusive lock: put only if the queue is empty; one round trip either
    /// way.
    Try,
    /// Take an empty queue with a bare put (nothing to read back); otherwise join the
    /// queue and read it. If the put of an unanswered attempt already landed, putting the
    /// key again keeps its create revision (its place in the queue), and its watchers
    /// ignore puts.
    Join,
}

/// The acquire transaction of the key `key` in `dir`, written with `value` bound to the
/// session lease `lease`. Succeeds (for `Try` and `Join`) when the queue was empty and the
/// key was put; otherwise it reads the queue.
pub(crate) fn acquire(shape: AcquireShape, key: &str, dir: &str, value: &[u8], lease: i64) -> Txn {
    let read = TxnOp::get(dir, Some(sorted(dir)));
    let put = || {
        TxnOp::put(
            key,
            value.to_vec(),
            Some(PutOptions::new().with_lease(lease)),
        )
    };
    // Nothing under the queue's directory: no holder, waiter or lock-delay marker.
    let empty = || Compare::create_revision(dir, CompareOp::Equal, 0).with_range(prefix_end(dir));
    match shape {
        AcquireShape::Woken => Txn::new()
            .when([Compare::create_revision(key, CompareOp::NotEqual, 0)])
            .and_then([read]),
        AcquireShape::Try => Txn::new().when([empty()]).and_then([put()]).or_else([read]),
        AcquireShape::Join => Txn::new()
            .when([empty()])
            .and_then([put()])
            .or_else([put(), read]),
    }
}

/// Deletes `placed`'s key and its lock-delay marker together.
pub(crate) fn delete_with_marker(placed: &Placed) -> Txn {
    Txn::new().and_then([
        TxnOp::delete(placed.key(), None),
        TxnOp::delete(placed.marker(), None),
    ])
}

/// Puts the lock-delay marker of `placed` for `owner`, bound to the delay lease `lease`,
/// if its key is still the one created at `revision`.
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
