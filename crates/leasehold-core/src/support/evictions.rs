//! Eviction records as backends store them: one string per [`Eviction`].
//!
//! A record is `v1 <token> <at_ms> <owner> <by length> <by><reason>`: owner ids have no
//! spaces, and `by` is counted in bytes, so `by` and `reason` may hold any text. Every
//! backend that keeps its records as strings (Redis, etcd, ZooKeeper) writes this form, so
//! one reader reads them all. A backend keeps the last [`KEPT`] of a name, for
//! [`KEPT_FOR`] after the latest: an audit trail, long past any lease they could end.

use std::time::Duration;

use crate::backend::Eviction;
use crate::fencing::FencingToken;
use crate::name::OwnerId;

/// How many evictions of a name a backend keeps.
pub const KEPT: usize = 10;

/// How long a backend keeps the records of a name after its latest eviction.
pub const KEPT_FOR: Duration = Duration::from_secs(7 * 24 * 3600);

/// The mark of this form of record.
const VERSION: &str = "v1";

/// The record of `eviction`.
pub fn encode(eviction: &Eviction) -> String {
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
pub fn decode(record: &[u8]) -> Option<Eviction> {
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
pub fn decode_all<'a>(records: impl IntoIterator<Item = &'a [u8]>) -> Vec<Eviction> {
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
