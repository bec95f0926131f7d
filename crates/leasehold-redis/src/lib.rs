//! leasehold's Redis backend: `SET key owner NX PX ttl` done right.
//!
//! The crate, one concern per file:
//!
//! - `lib.rs`: this map, the design in brief, the exports.
//! - `options.rs`: the backend's options and the URL parameters that set them.
//! - `connection.rs`: connecting (RESP3, TLS), loading the scripts, replacing a dead link.
//! - `link.rs`: where Redis is (server, Sentinel, Cluster), and the link to it.
//! - `sentinel.rs`: a master found through Redis Sentinel, and followed across failovers.
//! - `cluster.rs`: the nodes of a Redis Cluster, and connecting to them.
//! - `script.rs`: the keys and arguments of every script call, named once (Lua in `lua/`).
//! - `listing.rs`: which keys a listing scans for, and its cursor (a master's in a Cluster).
//! - `reply.rs`: the scripts' replies, decoded.
//! - `eviction.rs`: force-release records, as stored beside a lock; how long they are kept.
//! - `error.rs`: Redis errors as leasehold errors.
//! - `wakeups.rs`: push wake-ups from the lock's channel to this process's waiters.
//! - `changes.rs`: change feeds (watching locks) from the servers' key invalidations.
//! - `floors.rs`: the highest token seen granted per name, against servers that lost data.
//! - `backend.rs`: [`RedisBackend`], the `Backend` of one server.
//! - `node.rs`: one server as a Redlock node.
//! - `redlock/mod.rs`: [`RedlockBackend`], one lock over N servers held by a majority.
//! - `redlock/options.rs`: Redlock's options and URL parameters.
//! - `redlock/connect.rs`: connecting to the nodes; refusing a server counted twice.
//! - `redlock/quorum.rs`: the majority arithmetic, as pure functions.
//! - `redlock/listing.rs`: listing over the nodes; what a majority of them holds.
//! - `fence.rs`: the resource side of fencing, in Redis.
//!
//! The design:
//!
//! - **One round trip per uncontended grant**: one Lua script draws the lock's fencing
//!   token and sets the lock key if absent (the owner id and token, with a PX expiry),
//!   returning the token. The lock key is also the gate: it stays up while anyone reads,
//!   waits or is delayed, so `SET NX` alone decides an uncontended grant.
//! - **Owner-checked everything**: renewal is compare-and-`PEXPIRE`, release is
//!   compare-and-`DEL`, both in Lua. Never GET-then-DEL, never a bare DEL. A renewal that
//!   finds another owner, or no key, ends the guard at once.
//! - **Push wake-ups, no herd**: waiters queue in a Redis sorted set (FIFO, entries expire
//!   when their owner stops refreshing them); a release publishes the owners at the head of
//!   the queue on the lock's channel, and only they try again. A holder's expiry wakes the
//!   waiters at the expiry time the server reported.
//! - **Every primitive**: exclusive, shared (read-write lock; readers queue behind a waiting
//!   writer), permits (semaphores; each permit its own lease), lock-delay.
//! - **Fencing tokens** per name, strictly increasing and never below the server's clock
//!   (milliseconds × 1 000), so neither an empty restart nor a failover to a lagging replica makes
//!   them go backwards (while the servers' clocks do not); this client also refuses a token
//!   not above one it saw granted before asking, and repairs the counter.
//! - **Bounded per-name state**: wake-up state and subscriptions live only while a waiter or
//!   observer needs them; every request, connecting included, has a deadline.
//! - **Replica safety**: optionally `WAIT` for replicas to acknowledge each grant; a
//!   warning when `maxmemory-policy` can evict lock keys.
//! - **Records beside a lock** (scheduled jobs): one script checks the writer's grant as a
//!   renewal does and sets `<prefix>:{name}:rec:<key>` with `PX` its keep (the lock's
//!   slot, no key a listing looks for); a read is a `GET` on the master. A kept grant is a
//!   renewal to the hold that also wakes the waiters.
//! - **Redis Cluster**: all keys of one lock share the hash tag `{name}`, so each lock
//!   lives in one slot and its scripts run on that slot's master; wake-ups use sharded
//!   pub/sub (`SPUBLISH`/`SSUBSCRIBE`), so a release reaches only its own shard.
//! - **Watching locks at no cost to locking**: a change feed is the server's client-side
//!   caching invalidations of the prefix's keys (`CLIENT TRACKING … BCAST`), pushed on a
//!   connection of the feed's own; the lock path is the same whether anyone watches or not.
//!
//! URL: `redis://[user:password@]host:port[/db][?prefix=P&replicas=N&replica_timeout=D&replicas_required=true]`;
//! `rediss://…[&tls_ca=PATH&tls_cert=PATH&tls_key=PATH]` for TLS;
//! `redis+sentinel://[user:password@]sentinel:port,…/master[/db][?…]` for a master that
//! Redis Sentinel manages (the credentials and db are the master's);
//! `redis+cluster://[user:password@]node:port,…[?…]` (`rediss+cluster://` for TLS) for a
//! Redis Cluster, of which it needs one node or more to learn the rest.
//! See `docs/backends/redis.md` for what this backend guarantees and what it does not.

mod backend;
mod changes;
mod cluster;
mod connection;
mod error;
mod eviction;
pub mod fence;
mod floors;
mod link;
mod listing;
mod node;
mod options;
pub mod redlock;
mod reply;
mod script;
mod sentinel;
mod wakeups;

pub use backend::RedisBackend;
pub use options::{RedisOptions, ReplicaAck};
pub use redlock::{RedlockBackend, RedlockOptions};

/// The Redis client crate leasehold uses, for writing to the protected data.
/// Write with a [`fence::RedisFence`].
pub use redis;
