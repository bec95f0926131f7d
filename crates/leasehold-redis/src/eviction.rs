//! Eviction records: how a force release is written beside its lock, and read back.
//!
//! `lua/evict.lua` pushes each record onto the name's list `<prefix>:{<name>}:evicted`,
//! newest first, and trims it to the last [`KEPT`]. The records are an audit trail, not
//! part of the lock: the list expires [`KEPT_FOR`] after the name's latest eviction, and
//! nothing else reads or waits on it. A renewal that finds its grant gone looks there to
//! tell an eviction from an expiry (`backend.rs`).
//!
//! A record is one string, `v1 <token> <at_ms> <owner> <by length> <by><reason>`: owner
//! ids have no spaces, and `by` is counted in bytes, so `by` and `reason` may hold any
//! text. Both directions live here; the scripts only store and return the strings.

use std::time::Duration;

use leasehold_core::backend::Eviction;
use leasehold_core::{FencingToken, OwnerId};

/// How many evictions of a name are kept.
pub(crate) const KEPT: usize = 10;

/// How long the records of a name are kept after its latest eviction.
pub(crate) const KEPT_FOR: Duration = Duration::from_secs(7 * 24 * 3600);

/// The mark of this form of record.
const VERSION: &str = "v1";

/// The record of `eviction`.
pub(crate) fn encode(eviction: &Eviction) -> String {
    format!(
        "{VERSION} {} {} {} {} {}{}",
        eviction.token.get(),
        eviction.at_ms,
        eviction.owner.as_str(),
        eviction.by.len(),
        eviction.by,
        eviction.reason
    )
}

/// The eviction a record describes; `None` if it is not a record of this form.
pub(crate) fn decode(record: &[u8]) -> Option<Eviction> {
    let record = std::str::from_utf8(record).ok()?;
    let mut fields = record.splitn(6, ' ');
    if fields.next()? != VERSION {
        return None;
    }
    let token = FencingToken::new(fields.next()?.parse().ok()?);
    let at_ms = fields.next()?.parse().ok()?;
    let owner = OwnerId::parse(fields.next()?).ok()?;
    let by_len: usize = fields.next()?.parse().ok()?;
    let (by, reason) = fields.next()?.split_at_checked(by_len)?;
    let mut eviction = Eviction::new(owner, token, by.to_owned(), reason.to_owned());
    eviction.at_ms = at_ms;
    Some(eviction)
}

/// The records of `records` that decode, in their order.
/// Others (not written by leasehold) are logged and left out.
pub(crate) fn decode_all<'a>(records: impl IntoIterator<Item = &'a [u8]>) -> Vec<Eviction> {
    records
        .into_iter()
        .filter_map(|record| {
            let eviction = decode(record);
            if eviction.is_none() {
                tracing::debug!(
                    record = %String::from_utf8_lossy(record),
                    "an eviction record not in leasehold's form: left out"
                );
            }
            eviction
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eviction(by: &str, reason: &str) -> Eviction {
        let mut eviction = Eviction::new(
            OwnerId::parse("1f-abc").unwrap(),
            FencingToken::new(1_763_794_800_123_456),
            by.to_owned(),
            reason.to_owned(),
        );
        eviction.at_ms = 1_763_794_800_123;
        eviction
    }

    #[test]
    fn records_round_trip_whatever_the_text() {
        for (by, reason) in [
            ("ops@host", "stuck job"),
            ("", ""),
            ("a b@c d", " spaced  reason "),
            ("ünï@cödé", "line\nbreak 7 v1"),
        ] {
            let eviction = eviction(by, reason);
            let record = encode(&eviction);
            assert_eq!(decode(record.as_bytes()), Some(eviction), "{record:?}");
        }
        assert_eq!(
            encode(&eviction("ops@host", "stuck job")),
            "v1 1763794800123456 1763794800123 1f-abc 8 ops@hoststuck job"
        );
    }

    #[test]
    fn foreign_records_are_left_out() {
        let good = encode(&eviction("ops@host", "why"));
        for bad in [
            "",
            "v2 1 2 o 0 ",
            "v1 x 2 o 0 ",
            "v1 1 2 o*o 0 ",
            "v1 1 2 o 9 short",
            "v1 1 2 o 1 \u{e9}",
            "v1 1 2",
        ] {
            assert_eq!(decode(bad.as_bytes()), None, "{bad:?}");
        }
        assert_eq!(decode(&[0xff, 0xfe]), None);
        let decoded = decode_all([b"junk".as_slice(), good.as_bytes()]);
        assert_eq!(decoded, [eviction("ops@host", "why")]);
    }
}
