//! What keys say: the value a key is written with, and the queue a read returns.
//!
//! A key in a contender directory whose name or value is not this backend's (etcd's own
//! lock recipe writes an empty value under `<name>/<lease>`) is a foreign contender: an
//! exclusive holder or waiter like any other, ordered by its create revision — never an
//! error, never skipped.

use std::sync::Arc;

use leasehold_core::backend::Mode;
use leasehold_core::support::queue::Contender;
use leasehold_core::{Error, FencingToken, OwnerId, Result};

use crate::layout::{MARKER, is_ours};
use crate::rpc::{KeyValue, OpAnswer, RangeResponse, ResponseOp};

/// One holder or waiter, from a queue read.
#[derive(Debug)]
pub(crate) struct Entry {
    /// Who: ours, or a label for a foreign contender (see [`foreign_owner`]).
    pub(crate) owner: OwnerId,
    /// Written by another library (etcd's lock recipe); it counts as exclusive.
    pub(crate) foreign: bool,
    pub(crate) mode: Mode,
    pub(crate) value: Option<Arc<[u8]>>,
    pub(crate) revision: i64,
    pub(crate) lease: i64,
    pub(crate) key: Vec<u8>,
}

impl Contender for Entry {
    fn mode(&self) -> Mode {
        self.mode
    }
}

/// A key's value: the mode (`x`, `s`, `p<limit>`), a space, the owner, a newline, the stored value.
pub(crate) fn encode(mode: Mode, owner: &OwnerId, value: Option<&[u8]>) -> Vec<u8> {
    let mode = match mode {
        Mode::Exclusive => "x".to_owned(),
        Mode::Shared => "s".to_owned(),
        Mode::Permit { limit } => format!("p{limit}"),
    };
    let mut out = format!("{mode} {owner}\n").into_bytes();
    if let Some(value) = value {
        out.extend_from_slice(value);
    }
    out
}

/// The entry of a key read from the contender directory `dir`.
pub(crate) fn decode(dir: &str, kv: &KeyValue) -> Entry {
    entry(dir, &kv.key, &kv.value, kv.lease, kv.create_revision)
}

/// The entry of the key `key` in `dir` with `value`, bound to `lease`, created at `revision`.
fn entry(dir: &str, key: &[u8], value: &[u8], lease: i64, revision: i64) -> Entry {
    let ours = is_ours(dir, key).then(|| decode_value(value)).flatten();
    let (mode, owner, value, foreign) = match ours {
        Some((mode, owner, value)) => (mode, owner, value, false),
        None => (Mode::Exclusive, foreign_owner(lease, revision), None, true),
    };
    Entry {
        owner,
        foreign,
        mode,
        value,
        revision,
        lease,
        key: key.to_vec(),
    }
}

/// The owner shown for a foreign contender, which names its lease or create revision.
/// It is `foreign:<lease>` (the lease id in hex, as etcd's lock recipe names its key), or
/// `foreign:r<create revision>` for a key without a lease. Owner ids this backend writes
/// never look like that.
fn foreign_owner(lease: i64, revision: i64) -> OwnerId {
    let label = if lease != 0 {
        format!("foreign:{lease:x}")
    } else {
        format!("foreign:r{revision}")
    };
    OwnerId::parse(&label).unwrap_or_else(|_| unreachable!("hex digits and a colon"))
}

/// A grant's fencing token: its key's create revision.
///
/// # Errors
///
/// [`Error::Backend`] for a revision that is not positive: the reply did not decode.
pub(crate) fn token(revision: i64) -> Result<FencingToken> {
    u64::try_from(revision)
        .ok()
        .filter(|r| *r > 0)
        .map(FencingToken::new)
        .ok_or_else(|| {
            Error::backend(
                format!("etcd: a key with create revision {revision}"),
                false,
            )
        })
}

/// What a key's value says: its mode, its owner, the value stored with it.
type Decoded = (Mode, OwnerId, Option<Arc<[u8]>>);

/// Parses a key's value (see [`encode`]).
fn decode_value(value: &[u8]) -> Option<Decoded> {
    let newline = value.iter().position(|b| *b == b'\n')?;
    let (head, rest) = value.split_at(newline);
    let (mode, owner) = std::str::from_utf8(head).ok()?.split_once(' ')?;
    let mode = match mode.as_bytes() {
        b"x" => Mode::Exclusive,
        b"s" => Mode::Shared,
        [b'p', limit @ ..] => Mode::Permit {
            limit: std::str::from_utf8(limit).ok()?.parse().ok()?,
        },
        _ => return None,
    };
    let stored = &rest[1..];
    Some((
        mode,
        OwnerId::parse(owner).ok()?,
        (!stored.is_empty()).then(|| Arc::from(stored)),
    ))
}

/// The queue of `dir`, oldest first, and the lock-delay marker keeping it closed, if any.
/// The queue is the contender read `contenders`; the marker is the oldest in `markers`
/// whose owner has no key in the queue (anything in the marker directory that is not a
/// marker of a queued owner counts).
pub(crate) fn queue_of(
    dir: &str,
    contenders: &RangeResponse,
    markers: &RangeResponse,
) -> (Vec<Entry>, Option<(Vec<u8>, i64)>) {
    let queue: Vec<Entry> = contenders.kvs.iter().map(|kv| decode(dir, kv)).collect();
    let closed_by = markers
        .kvs
        .iter()
        .find(|kv| {
            let owner = kv
                .value
                .strip_prefix(MARKER)
                .and_then(|owner| std::str::from_utf8(owner).ok());
            owner.is_none_or(|owner| {
                !queue
                    .iter()
                    .any(|e| !e.foreign && e.owner.as_str() == owner.trim_end())
            })
        })
        .map(|kv| (kv.key.clone(), kv.create_revision));
    (queue, closed_by)
}

/// The range reads among `responses`, in order.
pub(crate) fn ranges(responses: &[ResponseOp]) -> Vec<&RangeResponse> {
    responses
        .iter()
        .filter_map(|r| match &r.response {
            Some(OpAnswer::ResponseRange(read)) => Some(read),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use leasehold_core::support::queue::{blocker, holding};

    use super::*;

    fn queued(mode: Mode, n: i64) -> Entry {
        Entry {
            owner: OwnerId::parse(&format!("o{n}")).unwrap(),
            foreign: false,
            mode,
            value: None,
            revision: n,
            lease: 1,
            key: format!("k{n}").into_bytes(),
        }
    }

    #[test]
    fn who_holds_a_queue() {
        let x = Mode::Exclusive;
        let s = Mode::Shared;
        let q = [queued(s, 1), queued(s, 2), queued(x, 3), queued(s, 4)];
        assert_eq!(holding(&q), [true, true, false, false]);
        // The writer waits for the reader before it; the late reader for the writer.
        assert_eq!(q[blocker(&q, 2).unwrap()].key, b"k2");
        assert_eq!(q[blocker(&q, 3).unwrap()].key, b"k3");
        assert!(blocker(&q, 0).is_none());
        let p = Mode::Permit {
            limit: std::num::NonZeroU32::new(2).unwrap(),
        };
        assert_eq!(
            holding(&[queued(p, 1), queued(p, 2), queued(p, 3)]),
            [true, true, false]
        );
        // A permit of a larger limit does not overtake one of a smaller limit that waits:
        // its key's revision, its token, is later.
        let one = Mode::Permit {
            limit: std::num::NonZeroU32::MIN,
        };
        let three = Mode::Permit {
            limit: std::num::NonZeroU32::new(3).unwrap(),
        };
        assert_eq!(
            holding(&[queued(p, 1), queued(one, 2), queued(three, 3)]),
            [true, false, false]
        );
    }

    #[test]
    fn values_round_trip() {
        let owner = OwnerId::parse("o1").unwrap();
        let limit = std::num::NonZeroU32::new(3).unwrap();
        for (mode, value) in [
            (Mode::Exclusive, Some(&b"10.0.0.7:80\nmore"[..])),
            (Mode::Shared, None),
            (Mode::Permit { limit }, Some(&b"v"[..])),
        ] {
            let (m, o, v) = decode_value(&encode(mode, &owner, value)).unwrap();
            assert_eq!((m, &o, v.as_deref()), (mode, &owner, value));
        }
        assert!(decode_value(b"q o1\n").is_none());
        assert!(decode_value(b"x o1").is_none());
    }

    #[test]
    fn keys_that_are_not_ours_are_foreign_exclusive_contenders() {
        let owner = OwnerId::parse("o1").unwrap();
        let ours = encode(Mode::Shared, &owner, None);
        let mine = entry("job/", b"job/2a.0", &ours, 0x2a, 7);
        assert!(!mine.foreign);
        assert_eq!((mine.mode, mine.owner.as_str()), (Mode::Shared, "o1"));
        // etcd's Mutex: the key is <name>/<lease>, the value empty.
        let mutex = entry(
            "job/",
            b"job/694d7a8e5c0d4b04",
            b"",
            0x694d_7a8e_5c0d_4b04,
            8,
        );
        assert!(mutex.foreign);
        assert_eq!(mutex.mode, Mode::Exclusive);
        assert_eq!(mutex.owner.as_str(), "foreign:694d7a8e5c0d4b04");
        // Our value under a name that is not ours, or our name with a value that is not.
        assert!(entry("job/", b"job/x", &ours, 0, 9).foreign);
        assert_eq!(
            entry("job/", b"job/x", &ours, 0, 9).owner.as_str(),
            "foreign:r9"
        );
        assert!(entry("job/", b"job/2a.1", b"garbage", 0x2a, 10).foreign);
        let q = [mine, mutex];
        assert_eq!(holding(&q), [true, false]);
        assert_eq!(q[blocker(&q, 1).unwrap()].key, b"job/2a.0");
    }

    #[test]
    fn tokens_are_positive_revisions() {
        assert_eq!(token(7).unwrap(), FencingToken::new(7));
        for bad in [0, -1] {
            assert!(matches!(token(bad), Err(Error::Backend { .. })));
        }
    }
}
