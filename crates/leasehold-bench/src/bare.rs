//! The bare Redis lock the comparisons measure leasehold against, over any connection.
//! `SET NX PX` (or the least fenced script), then an `EVALSHA` compare-and-delete: no
//! fencing, no waiting, no renewal.

#![allow(dead_code)] // not every comparison uses every grant

use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use redis::aio::ConnectionLike;

use crate::common::Cycle;

/// The lease of a bare grant.
pub(crate) const TTL: Duration = Duration::from_secs(30);
const UNLOCK: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";

/// The least a one-round-trip fenced grant can cost with a script.
/// SET NX PX, then INCR of the counter, in one EVALSHA (no waiters, no lock-delay, no token
/// in the value). Not a lock to use: the ceiling for any script-based fenced grant.
pub(crate) static FENCED_GRANT: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return redis.call('INCR', KEYS[2]) end return 0",
    )
});

/// How a bare lock grants: the plain `SET NX PX`, or the least fenced script.
#[derive(Clone, Copy)]
pub(crate) enum BareGrant {
    /// `SET NX PX`.
    SetNx,
    /// The least fenced script.
    FencedScript,
}

impl BareGrant {
    /// The side's label and its slug for `--only` and the names it locks.
    pub(crate) fn label(self) -> (&'static str, &'static str) {
        match self {
            BareGrant::SetNx => ("bare SET NX PX + EVALSHA", "bare"),
            BareGrant::FencedScript => ("least fenced script (SET NX + INCR)", "fenced"),
        }
    }

    /// One grant attempt; a nil or 0 answer means the key was taken.
    pub(crate) fn attempt(self, key: &str, owner: &str) -> redis::Cmd {
        let ttl = TTL.as_millis() as u64;
        match self {
            BareGrant::SetNx => {
                let mut cmd = redis::cmd("SET");
                cmd.arg(key).arg(owner).arg("NX").arg("PX").arg(ttl);
                cmd
            }
            BareGrant::FencedScript => {
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(FENCED_GRANT.get_hash())
                    .arg(2)
                    .arg(key)
                    .arg(format!("{key}:token"))
                    .arg(owner)
                    .arg(ttl);
                cmd
            }
        }
    }
}

/// One bare cycle: the grant (retried until it takes), then an EVALSHA compare-and-delete.
pub(crate) fn bare_cycle<C>(
    grant: BareGrant,
    conn: C,
    key: String,
) -> impl FnMut() -> Cycle + Send + 'static
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let unlock = Arc::new(redis::Script::new(UNLOCK));
    let mut n = 0u64;
    move || {
        let mut conn = conn.clone();
        let key = key.clone();
        let unlock = unlock.clone();
        n += 1;
        let owner = format!("bare-{n}-{}", std::process::id());
        let attempt = grant.attempt(&key, &owner);
        Box::pin(async move {
            let started = Instant::now();
            loop {
                let answer: redis::Value = attempt.query_async(&mut conn).await.unwrap();
                if !matches!(answer, redis::Value::Nil | redis::Value::Int(0)) {
                    break;
                }
            }
            let took = started.elapsed();
            let _: i64 = unlock
                .key(&key)
                .arg(&owner)
                .invoke_async(&mut conn)
                .await
                .unwrap();
            took
        })
    }
}
