//! Listing locks: which keys a `SCAN` looks for, and where a listing goes on.
//!
//! Every name with a holder or a waiter has a lock key or a permits key (see
//! `lua/head.lua`: the lock key is up while anyone holds the lock set or waits for a place
//! in the queue; permits do not keep it up, their zset lives as long as its last lease).
//! Other keys of a name, such as its eviction records, are not looked for: a name with
//! nothing else is not a lock. A
//! page is one `SCAN … MATCH <those keys of the prefix> COUNT <page>`, then the inspect
//! script for every name found, in one pipeline. In a Cluster each master is scanned in
//! turn, in the order of the lowest slot it serves; the cursor names the master by that
//! slot.

use std::collections::BTreeMap;
use std::fmt;

use leasehold_core::{Error, Result};
use redis::Value;

use crate::error::unexpected;
use crate::script::Key;

/// The kinds of key a listing looks for: one of them exists for every held or queued name.
pub(crate) const LISTED: [Key; 2] = [Key::Lock, Key::Permits];

/// Where a listing goes on: a `SCAN` cursor, in a Cluster that of one master.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Position {
    /// In a Cluster, the lowest slot of the master scanned; `None` on one server.
    pub(crate) master: Option<u16>,
    /// The server's (or master's) `SCAN` cursor.
    pub(crate) scan: u64,
}

impl Position {
    /// The first page: in a Cluster, of the master of slot 0 (no master serves a lower one).
    pub(crate) fn start(cluster: bool) -> Self {
        Self {
            master: cluster.then_some(0),
            scan: 0,
        }
    }

    /// The position a cursor of [`Position`]'s `Display` names.
    /// It is `<scan>` on one server, `<slot>:<scan>` in a Cluster.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a cursor not of that form (not made by this backend).
    pub(crate) fn parse(cursor: &str, cluster: bool) -> Result<Self> {
        let invalid = || {
            Error::invalid(
                "list cursor",
                format!("{cursor:?} is not a cursor of this redis backend"),
            )
        };
        let (master, scan) = match (cluster, cursor.split_once(':')) {
            (true, Some((slot, scan))) => (Some(slot.parse().map_err(|_| invalid())?), scan),
            (false, None) => (None, cursor),
            _ => return Err(invalid()),
        };
        if master.is_some_and(|slot| slot >= SLOTS) {
            return Err(invalid());
        }
        let scan = scan.parse().map_err(|_| invalid())?;
        Ok(Self { master, scan })
    }

    /// The slot whose master serves the position: any on one server.
    pub(crate) fn slot(self) -> u16 {
        self.master.unwrap_or(0)
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.master {
            Some(slot) => write!(f, "{slot}:{}", self.scan),
            None => write!(f, "{}", self.scan),
        }
    }
}

/// The number of slots of a Redis Cluster.
const SLOTS: u16 = 16_384;

/// The master to scan after the one whose lowest slot is `after`, from a `CLUSTER SLOTS` reply.
/// It is given by its lowest slot; `None` after the last.
///
/// # Errors
///
/// An unexpected reply if `slots` is not of the form `CLUSTER SLOTS` answers.
pub(crate) fn next_master(slots: &Value, after: u16) -> Result<Option<u16>> {
    Ok(masters(slots)?
        .into_values()
        .filter(|&slot| slot > after)
        .min())
}

/// The masters of a `CLUSTER SLOTS` reply, by host and port, each with its lowest slot.
/// A host is empty where the node's endpoint is not known.
///
/// # Errors
///
/// An unexpected reply if `slots` is not of the form `CLUSTER SLOTS` answers.
pub(crate) fn masters(slots: &Value) -> Result<BTreeMap<(Vec<u8>, i64), u16>> {
    const WHAT: &str = "CLUSTER SLOTS";
    let Value::Array(ranges) = slots else {
        return Err(unexpected(WHAT, slots));
    };
    // The lowest slot of each master, by its address.
    let mut lowest: BTreeMap<(Vec<u8>, i64), u16> = BTreeMap::new();
    for range in ranges {
        let (start, host, port) = match range {
            Value::Array(parts) => match parts.as_slice() {
                [Value::Int(start), _, Value::Array(master), ..] => match master.as_slice() {
                    // The host is null or empty where the node's endpoint is not known.
                    [Value::BulkString(host), Value::Int(port), ..] => (start, host.clone(), port),
                    [Value::Nil, Value::Int(port), ..] => (start, Vec::new(), port),
                    _ => return Err(unexpected(WHAT, range)),
                },
                _ => return Err(unexpected(WHAT, range)),
            },
            other => return Err(unexpected(WHAT, other)),
        };
        let start = u16::try_from(*start)
            .ok()
            .filter(|&s| s < SLOTS)
            .ok_or_else(|| unexpected(WHAT, range))?;
        lowest
            .entry((host, *port))
            .and_modify(|slot| *slot = (*slot).min(start))
            .or_insert(start);
    }
    Ok(lowest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_name_a_scan_position_and_in_a_cluster_its_master() {
        for (cluster, position) in [
            (false, Position::start(false)),
            (
                false,
                Position {
                    master: None,
                    scan: u64::MAX,
                },
            ),
            (true, Position::start(true)),
            (
                true,
                Position {
                    master: Some(10_923),
                    scan: 17,
                },
            ),
        ] {
            let cursor = position.to_string();
            assert_eq!(
                Position::parse(&cursor, cluster).unwrap(),
                position,
                "{cursor}"
            );
        }
        assert_eq!(
            Position {
                master: Some(5461),
                scan: 9
            }
            .to_string(),
            "5461:9"
        );
        for (cluster, bad) in [
            (false, "5461:9"),
            (true, "9"),
            (false, ""),
            (false, "-1"),
            (true, "16384:0"),
            (true, "x:0"),
            (true, "1:2:3"),
        ] {
            assert!(
                matches!(
                    Position::parse(bad, cluster),
                    Err(Error::InvalidArgument { .. })
                ),
                "{bad:?}"
            );
        }
    }

    fn range(start: i64, end: i64, host: &str, port: i64) -> Value {
        let node = Value::Array(vec![
            Value::BulkString(host.as_bytes().to_vec()),
            Value::Int(port),
            Value::BulkString(b"id".to_vec()),
        ]);
        Value::Array(vec![Value::Int(start), Value::Int(end), node])
    }

    #[test]
    fn masters_are_scanned_in_the_order_of_their_lowest_slot() {
        // Three masters; the second serves two ranges, reported out of order.
        let slots = Value::Array(vec![
            range(10_923, 16_383, "10.0.0.3", 7002),
            range(0, 5_000, "10.0.0.1", 7000),
            range(5_461, 10_922, "10.0.0.2", 7001),
            range(5_001, 5_460, "10.0.0.2", 7001),
        ]);
        assert_eq!(next_master(&slots, 0).unwrap(), Some(5_001));
        assert_eq!(next_master(&slots, 5_001).unwrap(), Some(10_923));
        assert_eq!(next_master(&slots, 10_923).unwrap(), None);
        assert!(next_master(&Value::Int(1), 0).is_err());
        assert!(next_master(&Value::Array(vec![Value::Int(1)]), 0).is_err());
        assert!(next_master(&Value::Array(vec![range(16_384, 0, "h", 1)]), 0).is_err());
    }
}
