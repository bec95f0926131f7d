//! Replies decoded into typed values.
//! A reply of the wrong shape is an error, never a default.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use leasehold_core::backend::{
    Eviction, Holder, ListCursor, Listing, LockState, Mode, WaitHint, Waiter,
};
use leasehold_core::{FencingToken, LockName, OwnerId, Result};
use tokio_postgres::Row;
use tokio_postgres::types::FromSql;

use crate::error::undecodable;

/// Column `i` of `row` as a `T`.
fn column<'a, T: FromSql<'a>>(row: &'a Row, i: usize, doing: &str) -> Result<T> {
    row.try_get(i)
        .map_err(|e| undecodable(doing, format!("column {i}: {e}")))
}

/// A token as the server stores it (a positive bigint).
pub(crate) fn token(value: i64, doing: &str) -> Result<FencingToken> {
    u64::try_from(value)
        .ok()
        .filter(|t| *t > 0)
        .map(FencingToken::new)
        .ok_or_else(|| undecodable(doing, format!("token {value}")))
}

/// A non-negative number of milliseconds.
fn millis(value: i64, doing: &str) -> Result<Duration> {
    u64::try_from(value)
        .map(Duration::from_millis)
        .map_err(|_| undecodable(doing, format!("{value} ms")))
}

/// The answer of a lease-mode acquire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Acquired {
    Granted(FencingToken),
    Busy {
        /// The state may change without a message after this long.
        retry: Option<Duration>,
        /// How long this owner has been waiting (waiting requests only).
        waited: Option<Duration>,
        /// An expired grant stays until the fenced write holding it ends, which sends no message.
        blocked: bool,
    },
}

pub(crate) fn acquired(row: &Row) -> Result<Acquired> {
    let doing = "acquire";
    let granted: Option<i64> = column(row, 0, doing)?;
    if let Some(granted) = granted {
        return Ok(Acquired::Granted(token(granted, doing)?));
    }
    let retry: Option<i64> = column(row, 1, doing)?;
    let waited: Option<i64> = column(row, 2, doing)?;
    Ok(Acquired::Busy {
        retry: retry.map(|ms| millis(ms, doing)).transpose()?,
        waited: waited.map(|ms| millis(ms, doing)).transpose()?,
        blocked: column(row, 3, doing)?,
    })
}

/// The first column of a one-column reply as a `T`.
pub(crate) fn single<T: for<'a> FromSql<'a>>(row: &Row, doing: &str) -> Result<T> {
    column(row, 0, doing)
}

/// The value of a record read by `Stmt::GetRecord`: no row, or one.
pub(crate) fn record(rows: &[Row]) -> Result<Option<Vec<u8>>> {
    let doing = "reading a record";
    match rows {
        [] => Ok(None),
        [row] => column(row, 0, doing).map(Some),
        _ => Err(undecodable(doing, format!("{} rows", rows.len()))),
    }
}

/// A mode as stored (`x`, `s`, `p`, with the permit limit for `p`).
fn mode(code: &str, limit: Option<i32>, doing: &str) -> Result<Mode> {
    match code {
        "x" => Ok(Mode::Exclusive),
        "s" => Ok(Mode::Shared),
        "p" => limit
            .and_then(|l| u32::try_from(l).ok())
            .and_then(NonZeroU32::new)
            .map(|limit| Mode::Permit { limit })
            .ok_or_else(|| undecodable(doing, format!("a permit with limit {limit:?}"))),
        other => Err(undecodable(doing, format!("mode {other:?}"))),
    }
}

fn owner(text: &str, doing: &str) -> Result<OwnerId> {
    OwnerId::parse(text).map_err(|_| undecodable(doing, format!("owner {text:?}")))
}

/// One row of an inspect or a listing: a holder, a waiter or an eviction of a name.
#[derive(Debug)]
pub(crate) enum Entry {
    Holder(Holder),
    Waiter(Waiter),
    Eviction(Eviction),
}

impl Entry {
    /// Adds it to `state`, after those of its kind already there.
    fn add_to(self, state: &mut LockState) {
        match self {
            Entry::Holder(holder) => state.holders.push(holder),
            Entry::Waiter(waiter) => state.waiters.push(waiter),
            Entry::Eviction(eviction) => state.evictions.push(eviction),
        }
    }
}

/// Decodes one row of an inspect or a listing; `None`: a row to leave out.
type Decode = fn(&Row, &str) -> Result<Option<Entry>>;

/// A lease-mode row (see `lease_state!` in `statements.rs`).
fn lease_entry(row: &Row, doing: &str) -> Result<Option<Entry>> {
    let is_holder: bool = column(row, 0, doing)?;
    let who = owner(column(row, 1, doing)?, doing)?;
    if !is_holder && column(row, 10, doing)? {
        let at: i64 = column(row, 13, doing)?;
        let mut eviction = Eviction::new(
            who,
            token(column(row, 4, doing)?, doing)?,
            column(row, 11, doing)?,
            column(row, 12, doing)?,
        );
        eviction.at_ms =
            u64::try_from(at).map_err(|_| undecodable(doing, format!("eviction at {at} ms")))?;
        return Ok(Some(Entry::Eviction(eviction)));
    }
    let mode = mode(column(row, 2, doing)?, column(row, 3, doing)?, doing)?;
    if !is_holder {
        return Ok(Some(Entry::Waiter(Waiter::new(who, mode))));
    }
    let value: Option<Vec<u8>> = column(row, 6, doing)?;
    let granted = token(column(row, 4, doing)?, doing)?;
    Ok(Some(Entry::Holder(
        Holder::new(who, mode, granted)
            .with_remaining(Some(millis(column(row, 5, doing)?, doing)?))
            .with_value(value.map(Arc::from)),
    )))
}

/// An advisory-mode row (see `advisory_state!` in `statements.rs`).
/// A waiter that is not leasehold's (a session taking the same key by hand) is left out.
fn advisory_entry(row: &Row, doing: &str) -> Result<Option<Entry>> {
    let granted: bool = column(row, 0, doing)?;
    let who: Option<&str> = column(row, 1, doing)?;
    let mode = mode(column(row, 2, doing)?, None, doing)?;
    if !granted {
        return Ok(who
            .and_then(|who| OwnerId::parse(who).ok())
            .map(|who| Entry::Waiter(Waiter::new(who, mode))));
    }
    let who = who.ok_or_else(|| undecodable(doing, "a holder without an owner"))?;
    let value: Option<Vec<u8>> = column(row, 5, doing)?;
    Ok(Some(Entry::Holder(
        Holder::new(
            owner(who, doing)?,
            mode,
            token(column(row, 3, doing)?, doing)?,
        )
        .with_remaining(Some(millis(column(row, 4, doing)?, doing)?))
        .with_value(value.map(Arc::from)),
    )))
}

/// Holders, waiters and evictions of the rows, in their order, without a wait hint.
fn state(rows: &[Row], decode: Decode, doing: &str) -> Result<LockState> {
    let mut state = LockState::new(WaitHint::none());
    for row in rows {
        if let Some(entry) = decode(row, doing)? {
            entry.add_to(&mut state);
        }
    }
    Ok(state)
}

/// Holders, waiters and evictions (newest first) of a lease-mode inspect, without a hint.
pub(crate) fn lease_state(rows: &[Row]) -> Result<LockState> {
    state(rows, lease_entry, "inspect")
}

/// Holders and waiters of an advisory-mode inspect, holders first.
/// Waiters that are not leasehold's (a session taking the same key by hand) are left out.
pub(crate) fn advisory_state(rows: &[Row]) -> Result<(Vec<Holder>, Vec<Waiter>)> {
    let state = state(rows, advisory_entry, "inspect")?;
    Ok((state.holders, state.waiters))
}

/// A page of a lease-mode listing that looked at up to `limit` names.
pub(crate) fn lease_listing(rows: &[Row], limit: usize) -> Result<Listing> {
    listing(rows, limit, lease_entry)
}

/// A page of an advisory-mode listing that looked at up to `limit` names.
pub(crate) fn advisory_listing(rows: &[Row], limit: usize) -> Result<Listing> {
    listing(rows, limit, advisory_entry)
}

/// A page of a listing that looked at up to `limit` names.
/// The rows come in name order, the name in the last column. Every name looked at has at
/// least one row: a row whose first column is NULL stands for nothing under the name (or a
/// name outside the prefix). Names with neither holder nor waiter are left out; the page
/// goes on after its last name when it looked at `limit` of them. A name's evictions come
/// with it, but do not make it listed.
fn listing(rows: &[Row], limit: usize, decode: Decode) -> Result<Listing> {
    let doing = "listing locks";
    let mut locks: Vec<(LockName, LockState)> = Vec::new();
    let mut looked = 0;
    let mut last: Option<&str> = None;
    for row in rows {
        let name: &str = column(row, row.len().saturating_sub(1), doing)?;
        if last != Some(name) {
            looked += 1;
            last = Some(name);
            let name = LockName::new(name)
                .map_err(|_| undecodable(doing, format!("lock name {name:?}")))?;
            locks.push((name, LockState::new(WaitHint::none())));
        }
        if column::<Option<bool>>(row, 0, doing)?.is_none() {
            continue;
        }
        let Some((_, state)) = locks.last_mut() else {
            continue;
        };
        if let Some(entry) = decode(row, doing)? {
            entry.add_to(state);
        }
    }
    locks.retain(|(_, state)| !state.holders.is_empty() || !state.waiters.is_empty());
    let next = last.filter(|_| looked >= limit).map(ListCursor::new);
    Ok(Listing::new(locks, next))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_and_modes_decode_or_fail() {
        assert_eq!(token(7, "t").unwrap(), FencingToken::new(7));
        assert!(token(0, "t").is_err());
        assert!(token(-3, "t").is_err());
        assert_eq!(mode("x", None, "m").unwrap(), Mode::Exclusive);
        assert_eq!(mode("s", None, "m").unwrap(), Mode::Shared);
        assert_eq!(
            mode("p", Some(3), "m").unwrap(),
            Mode::Permit {
                limit: NonZeroU32::new(3).unwrap()
            }
        );
        assert!(mode("p", None, "m").is_err());
        assert!(mode("p", Some(0), "m").is_err());
        assert!(mode("q", None, "m").is_err());
        assert!(millis(-1, "m").is_err());
    }
}
