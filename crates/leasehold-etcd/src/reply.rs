//! What keys say: the value a key is written with, and the queue a read returns.

use std::sync::Arc;

use etcd_client::{KeyValue, TxnOpResponse};
use leasehold_core::OwnerId;
use leasehold_core::backend::Mode;

use crate::keys::MARKER;

/// One holder or waiter, from a queue read.
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) owner: OwnerId,
    pub(crate) mode: Mode,
    pub(crate) value: Option<Arc<[u8]>>,
    pub(crate) revision: i64,
    pub(crate) lease: i64,
    pub(crate) key: Vec<u8>,
}

/// A key's value: the mode (`x`, `s`, `p<limit>`), a space, the owner, a newline, the
/// stored value.
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

pub(crate) fn decode(kv: &KeyValue) -> Option<Entry> {
    let (mode, owner, value) = decode_value(kv.value())?;
    Some(Entry {
        owner,
        mode,
        value,
        revision: kv.create_revision(),
        lease: kv.lease(),
        key: kv.key().to_vec(),
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

/// Which entries of a queue (oldest first) hold: exclusive — the first only; shared — those
/// with no exclusive entry before them; permits — the first `limit`.
pub(crate) fn holding(queue: &[Entry]) -> Vec<bool> {
    let mut seen_exclusive = false;
    queue
        .iter()
        .enumerate()
        .map(|(i, entry)| {
            let holds = match entry.mode {
                Mode::Exclusive => i == 0,
                Mode::Shared => !seen_exclusive,
                Mode::Permit { limit } => i < limit.get() as usize,
            };
            seen_exclusive |= entry.mode == Mode::Exclusive;
            holds
        })
        .collect()
}

/// [`holding`] of a raw key list.
pub(crate) fn holding_owned(kvs: &[KeyValue]) -> Vec<bool> {
    let queue: Vec<Entry> = kvs.iter().filter_map(decode).collect();
    holding(&queue)
}

/// The key whose change may let the entry at `me` hold: the one just before it (for a
/// reader, the nearest writer before it); permits watch the whole queue.
pub(crate) fn in_the_way(queue: &[Entry], me: usize) -> Option<&Entry> {
    match queue[me].mode {
        Mode::Exclusive => me.checked_sub(1).map(|i| &queue[i]),
        Mode::Shared => queue[..me].iter().rev().find(|e| e.mode == Mode::Exclusive),
        Mode::Permit { .. } => None,
    }
}

/// The queue of a directory read (the last read of `responses`), oldest first, and the
/// oldest lock-delay marker that keeps it closed (one whose owner has no key in the queue).
pub(crate) fn queue_of(responses: &[TxnOpResponse]) -> (Vec<Entry>, Option<(Vec<u8>, i64)>) {
    let kvs = responses
        .iter()
        .rev()
        .find_map(|r| match r {
            TxnOpResponse::Get(get) => Some(get.kvs()),
            _ => None,
        })
        .unwrap_or_default();
    let queue: Vec<Entry> = kvs.iter().filter_map(decode).collect();
    let closed_by = kvs
        .iter()
        .find(|kv| {
            kv.value()
                .strip_prefix(MARKER)
                .and_then(|owner| std::str::from_utf8(owner).ok())
                .is_some_and(|owner| !queue.iter().any(|e| e.owner.as_str() == owner.trim_end()))
        })
        .map(|kv| (kv.key().to_vec(), kv.create_revision()));
    (queue, closed_by)
}

/// The revision a read of `responses` was served at, or `fallback`.
pub(crate) fn header_revision(responses: &[TxnOpResponse], fallback: i64) -> i64 {
    responses
        .iter()
        .find_map(|r| match r {
            TxnOpResponse::Get(get) => get.header().map(|h| h.revision()),
            _ => None,
        })
        .unwrap_or(fallback)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(mode: Mode, n: i64) -> Entry {
        Entry {
            owner: OwnerId::parse(&format!("o{n}")).unwrap(),
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
        let q = [entry(s, 1), entry(s, 2), entry(x, 3), entry(s, 4)];
        assert_eq!(holding(&q), [true, true, false, false]);
        // The writer waits for the reader before it; the late reader for the writer.
        assert_eq!(in_the_way(&q, 2).unwrap().key, b"k2");
        assert_eq!(in_the_way(&q, 3).unwrap().key, b"k3");
        assert!(in_the_way(&q, 0).is_none());
        let p = Mode::Permit {
            limit: std::num::NonZeroU32::new(2).unwrap(),
        };
        assert_eq!(
            holding(&[entry(p, 1), entry(p, 2), entry(p, 3)]),
            [true, true, false]
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
}
