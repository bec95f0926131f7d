//! The scripts' replies, decoded.
//! A reply that does not have the expected form is an error ([`unexpected`]), never a
//! default value.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use leasehold_core::backend::{Holder, LockState, Mode, Waiter};
use leasehold_core::{FencingToken, OwnerId, Result};
use redis::Value;

use crate::error::unexpected;
use crate::eviction;

/// What an acquire answered (the encoding is `lua/acquire.lua`'s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Acquired {
    /// Granted with this token; to a waiter after a release, this long after it.
    Granted(u64, Option<Duration>),
    /// The fast path did not apply: make the full call.
    NotFast,
    /// Busy; the state may change on its own after this long (an expiry).
    /// To a waiter a release may hand the lock to, the fencing counter as it was then: a
    /// token handed to it later is above it.
    Busy(Option<Duration>, Option<u64>),
}

pub(crate) fn acquired(answer: &Value) -> Result<Acquired> {
    const WHAT: &str = "acquire";
    match answer {
        Value::Int(answer) => Ok(match *answer {
            token if token > 0 => Acquired::Granted(token.unsigned_abs(), None),
            0 => Acquired::NotFast,
            busy => Acquired::Busy(retry(busy), None),
        }),
        Value::Array(parts) => match parts.as_slice() {
            [Value::Int(token), Value::Int(micros)] if *token > 0 && *micros >= 0 => {
                Ok(Acquired::Granted(
                    token.unsigned_abs(),
                    Some(Duration::from_micros(micros.unsigned_abs())),
                ))
            }
            [Value::Int(busy), Value::Int(counter)] if *busy < 0 && *counter >= 0 => {
                Ok(Acquired::Busy(retry(*busy), Some(counter.unsigned_abs())))
            }
            _ => Err(unexpected(WHAT, answer)),
        },
        other => Err(unexpected(WHAT, other)),
    }
}

/// When a busy answer (< 0) says the state may change on its own.
/// -1: not without a wake-up; -(ms + 2): in ms (no overflow for any i64).
fn retry(busy: i64) -> Option<Duration> {
    (busy != -1).then(|| Duration::from_millis((-(busy + 2)).unsigned_abs()))
}

/// A 1 (yes) or 0 (no) answer of `what`.
pub(crate) fn yes_or_no(answer: i64, what: &str) -> Result<bool> {
    match answer {
        1 => Ok(true),
        0 => Ok(false),
        other => Err(unexpected(what, other)),
    }
}

fn text(value: &Value, what: &str) -> Result<String> {
    match value {
        Value::BulkString(bytes) => {
            String::from_utf8(bytes.clone()).map_err(|_| unexpected(what, value))
        }
        Value::SimpleString(s) => Ok(s.clone()),
        other => Err(unexpected(what, other)),
    }
}

fn int(value: &Value, what: &str) -> Result<i64> {
    match value {
        Value::Int(i) => Ok(*i),
        other => Err(unexpected(what, other)),
    }
}

fn token(text: &str, what: &str) -> Result<FencingToken> {
    text.parse()
        .map(FencingToken::new)
        .map_err(|_| unexpected(what, text))
}

/// What the server stores with a shared or permit holder.
#[derive(Debug)]
pub(crate) struct HolderInfo {
    pub(crate) token: FencingToken,
    /// A permit's limit.
    /// `None` for a shared holder, or a permit granted before limits were stored.
    pub(crate) limit: Option<NonZeroU32>,
    pub(crate) value: Option<Arc<[u8]>>,
}

/// A shared holder's info `token|value`, or a permit holder's `token/limit|value`.
pub(crate) fn holder_info(info: &str) -> Result<HolderInfo> {
    const WHAT: &str = "a holder's info";
    let (number, value) = info.split_once('|').ok_or_else(|| unexpected(WHAT, info))?;
    let (number, limit) = match number.split_once('/') {
        Some((number, limit)) => (
            number,
            Some(limit.parse().map_err(|_| unexpected(WHAT, info))?),
        ),
        None => (number, None),
    };
    Ok(HolderInfo {
        token: token(number, "a holder's token")?,
        limit,
        value: (!value.is_empty()).then(|| Arc::from(value.as_bytes())),
    })
}

/// Time left of a lease the server reported in ms (negative: none).
fn remaining(ms: i64) -> Option<Duration> {
    Some(Duration::from_millis(u64::try_from(ms).unwrap_or(0)))
}

/// The inspect script's reply (see `lua/inspect.lua`).
/// The state, and when it may change on its own (the earliest expiry of a holder).
pub(crate) fn inspected(reply: &Value) -> Result<(LockState, Option<Duration>)> {
    const WHAT: &str = "inspect";
    let Value::Array(parts) = reply else {
        return Err(unexpected(WHAT, reply));
    };
    let [lock, ttl, xinfo, readers, permits, queue, evictions] = parts.as_slice() else {
        return Err(unexpected(WHAT, reply));
    };
    let mut state = LockState::default();
    let mut earliest: Option<i64> = None;
    let lock = text(lock, WHAT)?;
    if !lock.is_empty() {
        let (owner, number) = lock
            .split_once(' ')
            .ok_or_else(|| unexpected(WHAT, &lock))?;
        let left = int(ttl, WHAT)?;
        earliest = Some(left);
        let value = text(xinfo, WHAT)?;
        state.holders.push(
            Holder::new(
                OwnerId::parse(owner)?,
                Mode::Exclusive,
                token(number, WHAT)?,
            )
            .with_remaining(remaining(left))
            .with_value((!value.is_empty()).then(|| Arc::from(value.as_bytes()))),
        );
    }
    // Shared holders (`permits: None`), or permit holders with the number held, the limit
    // of a permit whose limit is not stored.
    let mut add = |members: &Value, permits: Option<NonZeroU32>| -> Result<usize> {
        let Value::Array(flat) = members else {
            return Err(unexpected(WHAT, members));
        };
        if flat.len() % 3 != 0 {
            return Err(unexpected(WHAT, members));
        }
        for chunk in flat.chunks(3) {
            let [owner, left, info] = chunk else {
                return Err(unexpected(WHAT, members));
            };
            let HolderInfo {
                token,
                limit,
                value,
            } = holder_info(&text(info, WHAT)?)?;
            let mode = match (permits, limit) {
                (None, None) => Mode::Shared,
                (Some(held), limit) => Mode::Permit {
                    limit: limit.unwrap_or(held),
                },
                (None, Some(_)) => return Err(unexpected(WHAT, info)),
            };
            let left = int(left, WHAT)?;
            earliest = Some(earliest.map_or(left, |e| e.min(left)));
            state.holders.push(
                Holder::new(OwnerId::parse(&text(owner, WHAT)?)?, mode, token)
                    .with_remaining(remaining(left))
                    .with_value(value),
            );
        }
        Ok(flat.len() / 3)
    };
    add(readers, None)?;
    let held = match permits {
        Value::Array(flat) => u32::try_from(flat.len() / 3).unwrap_or(u32::MAX),
        other => return Err(unexpected(WHAT, other)),
    };
    add(
        permits,
        Some(NonZeroU32::new(held).unwrap_or(NonZeroU32::MIN)),
    )?;
    let Value::Array(members) = queue else {
        return Err(unexpected(WHAT, queue));
    };
    for member in members {
        let member = text(member, WHAT)?;
        let (mode, owner) = match member.split_at_checked(1) {
            Some(("x" | "h", owner)) => (Mode::Exclusive, owner),
            Some(("s", owner)) => (Mode::Shared, owner),
            Some(("p", rest)) => {
                let (owner, limit) = rest
                    .rsplit_once('/')
                    .and_then(|(owner, limit)| Some((owner, limit.parse().ok()?)))
                    .ok_or_else(|| unexpected(WHAT, &member))?;
                (Mode::Permit { limit }, owner)
            }
            _ => return Err(unexpected(WHAT, &member)),
        };
        state
            .waiters
            .push(Waiter::new(OwnerId::parse(owner)?, mode));
    }
    let Value::Array(records) = evictions else {
        return Err(unexpected(WHAT, evictions));
    };
    // An audit trail: a record not in leasehold's form is left out, not an error.
    state.evictions = eviction::decode_all(records.iter().filter_map(|record| match record {
        Value::BulkString(bytes) => Some(bytes.as_slice()),
        _ => None,
    }));
    let retry = earliest
        .and_then(|ms| u64::try_from(ms).ok())
        .map(Duration::from_millis);
    Ok((state, retry))
}

/// The server's run id from an `INFO server` reply.
pub(crate) fn run_id(info: &str) -> Result<String> {
    info.lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .map(|id| id.trim().to_owned())
        .ok_or_else(|| unexpected("INFO server (no run_id)", info.len()))
}

/// Whether a `CLIENT LIST` reply lists a client named `name`.
pub(crate) fn lists_client_named(list: &str, name: &str) -> bool {
    list.lines().any(|line| {
        line.split(' ')
            .any(|field| field.strip_prefix("name=") == Some(name))
    })
}

/// A warning if the `maxmemory*` configuration lets the server evict lock keys.
pub(crate) fn eviction_warning(config: &HashMap<String, String>) -> Option<String> {
    let limit = config.get("maxmemory").map(String::as_str).unwrap_or("0");
    let policy = config
        .get("maxmemory-policy")
        .map(String::as_str)
        .unwrap_or("noeviction");
    (limit != "0" && policy != "noeviction").then(|| {
        format!(
            "maxmemory-policy is {policy} with maxmemory {limit}: the server may evict lock keys \
             (a holder then loses its lock at its next renewal, and another may be granted \
             meanwhile); use noeviction"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_is_found_by_its_whole_name_only() {
        let list =
            "id=7 addr=127.0.0.1:5 laddr=127.0.0.1:6379 fd=8 name=leasehold-ab age=3 cmd=evalsha\n";
        assert!(lists_client_named(list, "leasehold-ab"));
        assert!(!lists_client_named(list, "leasehold-a"));
        assert!(!lists_client_named("", "leasehold-ab"));
        assert!(!lists_client_named("id=7 name= age=3\n", "leasehold-ab"));
    }

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn holder_info_round_trips() {
        let info = holder_info("1763794800123456|10.0.0.7:80|x").unwrap();
        assert_eq!(info.token.get(), 1_763_794_800_123_456);
        assert_eq!(info.limit, None);
        assert_eq!(info.value.as_deref(), Some(&b"10.0.0.7:80|x"[..]));
        assert_eq!(holder_info("5|").unwrap().value, None);
        let info = holder_info("5/3|a/b").unwrap();
        assert_eq!(
            (info.token.get(), info.limit.map(NonZeroU32::get)),
            (5, Some(3))
        );
        assert_eq!(info.value.as_deref(), Some(&b"a/b"[..]));
        for bad in ["5", "x|v", "5/|v", "5/0|v", "5/x|v"] {
            assert!(holder_info(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn acquire_answers_decode() {
        let int = |i| acquired(&Value::Int(i)).unwrap();
        assert_eq!(int(42), Acquired::Granted(42, None));
        assert_eq!(int(0), Acquired::NotFast);
        assert_eq!(int(-1), Acquired::Busy(None, None));
        assert_eq!(
            int(-502),
            Acquired::Busy(Some(Duration::from_millis(500)), None)
        );
        assert!(matches!(int(i64::MIN), Acquired::Busy(Some(_), None)));
        let pair = |a, b| acquired(&Value::Array(vec![Value::Int(a), Value::Int(b)]));
        assert_eq!(
            pair(42, 310).unwrap(),
            Acquired::Granted(42, Some(Duration::from_micros(310)))
        );
        // Busy to a waiter a release may hand the lock to: with the counter.
        assert_eq!(pair(-1, 310).unwrap(), Acquired::Busy(None, Some(310)));
        assert_eq!(
            pair(-502, 0).unwrap(),
            Acquired::Busy(Some(Duration::from_millis(500)), Some(0))
        );
        for (a, b) in [(0, 310), (42, -1), (-1, -1)] {
            assert!(pair(a, b).is_err(), "{a} {b}");
        }
        assert!(acquired(&Value::Array(vec![Value::Int(42)])).is_err());
        assert!(acquired(&Value::Nil).is_err());
        assert!(yes_or_no(2, "renew").is_err());
    }

    #[test]
    fn permit_holders_report_their_own_limit() {
        let permits = Value::Array(vec![
            bulk("p1"),
            Value::Int(400),
            bulk("8/3|"),
            bulk("p2"),
            Value::Int(500),
            // Granted before limits were stored: the number held stands in for it.
            bulk("9|"),
        ]);
        let reply = Value::Array(vec![
            bulk(""),
            Value::Int(-2),
            bulk(""),
            Value::Array(vec![]),
            permits,
            Value::Array(vec![]),
            Value::Array(vec![]),
        ]);
        let (state, _) = inspected(&reply).unwrap();
        let limits: Vec<Mode> = state.holders.iter().map(|h| h.mode).collect();
        let limit = |n| Mode::Permit {
            limit: NonZeroU32::new(n).unwrap(),
        };
        assert_eq!(limits, [limit(3), limit(2)]);
        // A reader's info has no limit.
        let reader = Value::Array(vec![bulk("r1"), Value::Int(400), bulk("8/3|")]);
        let Value::Array(mut parts) = reply else {
            unreachable!()
        };
        parts[3] = reader;
        assert!(inspected(&Value::Array(parts)).is_err());
    }

    #[test]
    fn an_inspect_reply_decodes_or_is_an_error() {
        let reply = Value::Array(vec![
            bulk("o1 7"),
            Value::Int(900),
            bulk(""),
            Value::Array(vec![bulk("r1"), Value::Int(400), bulk("8|v")]),
            Value::Array(vec![]),
            Value::Array(vec![bulk("xw1"), bulk("sw2")]),
            Value::Array(vec![
                bulk("v1 7 1700000000000 o0 8 ops@hoststuck"),
                bulk("not a record"),
                Value::Int(3),
            ]),
        ]);
        let (state, retry) = inspected(&reply).unwrap();
        assert_eq!(state.holders.len(), 2);
        assert_eq!(state.holders[0].token.get(), 7);
        assert_eq!(state.holders[1].mode, Mode::Shared);
        assert_eq!(state.waiters.len(), 2);
        assert_eq!(retry, Some(Duration::from_millis(400)));
        // Records not in leasehold's form are left out.
        assert_eq!(state.evictions.len(), 1);
        assert_eq!(
            (
                state.evictions[0].token.get(),
                state.evictions[0].reason.as_str()
            ),
            (7, "stuck")
        );
        // Not leasehold's form: a typed error, not zeros.
        let Value::Array(parts) = &reply else {
            unreachable!()
        };
        for (i, bad) in [
            bulk("o1 seven"),
            bulk("x"),
            Value::Nil,
            Value::Array(vec![bulk("r1"), Value::Int(1)]),
            Value::Int(3),
            Value::Array(vec![bulk("qw1")]),
            Value::Int(4),
        ]
        .into_iter()
        .enumerate()
        {
            let mut parts = parts.clone();
            parts[i] = bad;
            assert!(
                inspected(&Value::Array(parts.clone())).is_err(),
                "{parts:?}"
            );
        }
        assert!(inspected(&Value::Int(1)).is_err());
    }
}
