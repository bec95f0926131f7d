//! The resource side of fencing, in Redis.
//! Writes that Redis itself refuses when they carry a token older than the highest it has
//! accepted.

use std::fmt;
use std::sync::Arc;

use leasehold_core::events::{AccessEvent, EventSink};
use leasehold_core::{Error, FencingToken, Result, StaleToken};
use redis::aio::ConnectionLike;
use redis::{FromRedisValue, Script, ToRedisArgs, Value};

use crate::error::map_error;

/// A fence kept in one Redis key.
/// Every operation through it states its fencing token, and one whose token is lower than
/// the highest accepted so far is refused, atomically with the check (a Lua script). Equal
/// tokens are accepted (one holder, many operations).
///
/// Read through the fence as well as write: a new holder's first read registers its token,
/// so that a superseded holder — one that read before and writes after — is refused. That
/// makes a read-modify-write under the lock safe even when the lock's lease ran out in the
/// middle of it.
///
/// On Redis Cluster the fence key and the keys written must share a hash tag, e.g.
/// `{stock}:fence` and `{stock}:count`.
///
/// ```no_run
/// # async fn demo(conn: &mut redis::aio::ConnectionManager, guard: leasehold_core::Guard) -> leasehold_core::Result<()> {
/// use leasehold_redis::fence::RedisFence;
///
/// let fence = RedisFence::new("{stock}:fence");
/// match fence.set(conn, guard.token(), "{stock}:count", 41).await? {
///     Ok(()) => println!("written"),
///     Err(stale) => println!("refused: {stale}"), // a newer holder already wrote
/// }
/// # Ok(()) }
/// ```
pub struct RedisFence {
    key: String,
    script: Script,
    /// Where each access is reported ([`RedisFence::reporting_to`]).
    events: Option<Arc<dyn EventSink>>,
}

impl fmt::Debug for RedisFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisFence")
            .field("key", &self.key)
            .finish()
    }
}

impl RedisFence {
    /// A fence stored under `key`.
    pub fn new(key: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            script: Script::new(include_str!("../lua/fence.lua")),
            events: None,
        }
    }

    /// This fence, reporting every access it judges to `sink`.
    /// Each is an [`AccessEvent`] whose resource is the fence's key.
    pub fn reporting_to(mut self, sink: Arc<dyn EventSink>) -> Self {
        self.events = Some(sink);
        self
    }

    /// Reports an access, if the fence reports.
    fn report(&self, token: FencingToken, accepted: bool, highest: Option<FencingToken>) {
        if let Some(sink) = &self.events {
            sink.record_access(&AccessEvent::new(
                "redis", &self.key, token, accepted, highest,
            ));
        }
    }

    async fn apply<C: ConnectionLike + Send, T: FromRedisValue>(
        &self,
        conn: &mut C,
        token: FencingToken,
        key: &str,
        op: &str,
        operand: impl ToRedisArgs + Send + Sync,
    ) -> Result<std::result::Result<T, StaleToken>> {
        let (applied, value): (i64, Value) = self
            .script
            .key(&self.key)
            .key(key)
            .arg(token.get())
            .arg(op)
            .arg(operand)
            .invoke_async(conn)
            .await
            .map_err(|e| map_error(e, &self.key))?;
        match applied {
            1 => {
                self.report(token, true, None);
                let value = T::from_redis_value(value)
                    .map_err(|e| Error::backend(format!("redis fence on {key}: {e}"), false))?;
                Ok(Ok(value))
            }
            0 => {
                let highest = u64::from_redis_value(value.clone())
                    .map_err(|_| crate::error::unexpected("a fence's highest token", &value))?;
                leasehold_core::telemetry::fence_refused("redis");
                let highest = FencingToken::new(highest);
                self.report(token, false, Some(highest));
                Ok(Err(StaleToken::new(token, highest)))
            }
            other => Err(crate::error::unexpected("a fenced write", other)),
        }
    }

    /// `GET key`, registering `token`: later operations with older tokens are refused.
    ///
    /// # Cancel safety
    ///
    /// The script is one atomic step: if the future is dropped it either ran whole or not.
    ///
    /// # Errors
    ///
    /// Redis errors, a value that is not a `T`; a stale token is the inner `Err`.
    pub async fn get<C: ConnectionLike + Send, T: FromRedisValue>(
        &self,
        conn: &mut C,
        token: FencingToken,
        key: &str,
    ) -> Result<std::result::Result<T, StaleToken>> {
        self.apply(conn, token, key, "get", "").await
    }

    /// `SET key value`, if `token` is not stale.
    ///
    /// # Cancel safety
    ///
    /// The script is one atomic step: if the future is dropped it either ran whole or not.
    ///
    /// # Errors
    ///
    /// Redis errors; a stale token is the inner `Err`.
    pub async fn set<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        token: FencingToken,
        key: &str,
        value: impl ToRedisArgs + Send + Sync,
    ) -> Result<std::result::Result<(), StaleToken>> {
        let applied: std::result::Result<Value, StaleToken> =
            self.apply(conn, token, key, "set", value).await?;
        Ok(applied.map(|_| ()))
    }

    /// `INCRBY key delta`, if `token` is not stale; the new value.
    ///
    /// # Cancel safety
    ///
    /// As for [`set`](RedisFence::set).
    ///
    /// # Errors
    ///
    /// Redis errors; a stale token is the inner `Err`.
    pub async fn incr_by<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        token: FencingToken,
        key: &str,
        delta: i64,
    ) -> Result<std::result::Result<i64, StaleToken>> {
        self.apply(conn, token, key, "incrby", delta).await
    }
}
