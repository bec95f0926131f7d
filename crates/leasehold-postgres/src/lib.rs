//! leasehold's PostgreSQL backend: locks that live next to the data they protect.
//!
//! The crate, one concern per file:
//!
//! - `lib.rs`: this map, the exports, [`PostgresBackend`] choosing lease or advisory mode.
//! - `options.rs`: [`PostgresOptions`], and the URL that sets them.
//! - `connection.rs`: opening connections, their prepared statements, the small pool.
//! - `tls.rs`: TLS for the `sslmode`s, with rustls.
//! - `schema.rs`: the schema's tables and functions, made and migrated on first use.
//! - `statements.rs`: every statement the backend sends, defined once.
//! - `reply.rs`: replies decoded into typed values.
//! - `lease.rs`: lease mode: a row per grant, its expiry on the server's clock.
//! - `advisory.rs`: advisory mode: a session-level advisory lock per acquisition.
//! - `listing.rs`: listings of the locks under a prefix, a page of names per statement.
//! - `wakeups.rs`: push wake-ups by LISTEN/NOTIFY.
//! - `changes.rs`: change feeds (watching locks), a listening session of their own each.
//! - `fence.rs`: fenced writes in the caller's own transaction.
//! - `error.rs`: tokio-postgres errors as leasehold errors.
//!
//! The design:
//!
//! - **Lease mode** (the default): a row per grant in `<schema>.grants`, with its expiry
//!   computed on the server's clock (`clock_timestamp()` + ttl) while the client keeps its
//!   own, earlier, deadline from the moment it sent the request. A grant is one statement
//!   (one round trip) that locks the name's row, drops expired grants and takes the lock or
//!   a place in the FIFO queue; its token comes from a sequence drawn while the name's row is
//!   locked, so tokens of a name increase in grant order and survive restarts. Renewal and
//!   release are owner-checked single statements; the renewals falling due together are
//!   one statement per pooled connection (`UPDATE … FROM unnest(…)`). Exclusive, shared, permits, FIFO waiters,
//!   lock-delay — every primitive of the core engine. A force-release (evict) removes one
//!   grant, closes its set until the grant's lease would have ended, and keeps a record
//!   (the last 10 per name) that the evicted holder's renewal finds; advisory mode cannot
//!   evict.
//! - **Advisory mode** (`mode=advisory`): a session-level `pg_advisory_lock` on a
//!   connection of its own per held lock; waiting happens in the server's own lock queue
//!   (FIFO, writers not overtaken by readers). The lock lives as long as its session: the
//!   client pings it, and the server ends a session silent for the session ttl
//!   (`idle_session_timeout`), which frees the lock.
//! - **Records beside a lock** (scheduled jobs), both modes: rows of `<schema>.records`,
//!   each kept until its own expiry on the server's clock, written by one statement that
//!   checks the writer's grant (its live lease, or its session's advisory lock) and read
//!   by any connection. Lease mode keeps a grant after its holder lets go as a renewal
//!   with the time to keep it; advisory mode cannot (the lock lives by its session).
//! - **Wake-ups** by LISTEN/NOTIFY on one connection per backend; the message is sent in the
//!   releasing statement's transaction and names whom it lets in. Through a
//!   transaction-pooling proxy (PgBouncer `pool_mode = transaction`), where LISTEN cannot
//!   work, waiters poll with backoff instead, and advisory mode is refused.
//! - **Change feeds** (watching locks), both modes: a session per feed LISTENs on the
//!   schema's feed channel and has a row in `<schema>.watchers`; the grant, release, queue
//!   and eviction functions send the name of the lock they changed there only while a
//!   watcher's prefix begins it, so a lock cycle nobody watches sends nothing.
//! - **Fenced writes in the caller's own transaction**: [`still_owner`] gives the SQL
//!   condition that is true only while the guard holds its lock and keeps the next grant
//!   waiting until the caller's (`READ COMMITTED`) transaction ends; [`fence::TokenFence`]
//!   refuses writes with
//!   tokens lower than the highest a row has accepted.
//!
//! URL: `postgres://[user[:password]@]host[:port][,host[:port]…][/dbname][?params]` (also
//! `postgresql://`), with `schema`, `mode=lease|advisory`, `pooling=auto|session|transaction`,
//! `pool_size`, `session_ttl`, `connect_timeout`, `application_name`,
//! `target_session_attrs=any|read-write`, `sslmode=disable|prefer|require|verify-ca|verify-full`,
//! `tls_ca`, `tls_cert`, `tls_key`. See `docs/backends/postgres.md`.

mod advisory;
mod changes;
mod connection;
mod error;
pub mod fence;
mod lease;
mod listing;
mod options;
mod reply;
mod schema;
mod statements;
mod tls;
mod wakeups;

pub use fence::{StillOwner, TokenFence, still_owner};
pub use options::{DEFAULT_SCHEMA, LockMode, Pooling, PostgresOptions, SslMode};
/// The PostgreSQL client crate leasehold uses, for the caller's own fenced transactions.
pub use tokio_postgres;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use leasehold_core::backend::{
    Acquire, Backend, Capabilities, Changes, Eviction, ListCursor, Listing, LockState, Mode,
    Release, Renewal, Request, TokenDurability, WaitHint,
};
use leasehold_core::{ConnectOptions, Error, LockName, NamePrefix, RecordKey, Result};

use crate::advisory::Advisory;
use crate::connection::{Connector, Pool, notifications_arrive, transaction_pooled};
use crate::lease::Lease;
use crate::statements::Stmt;
use crate::wakeups::{Wakeups, spawn_listener};

/// How long a notification may take to arrive, when looking for a transaction pool.
/// That finds out whether a transaction pool is in between (see
/// [`connection::notifications_arrive`]).
const PROBE_LIMIT: Duration = Duration::from_secs(2);

/// How often a backend drops what vanished holders left behind (see [`PostgresBackend::sweep`]).
const SWEEP_EVERY: Duration = Duration::from_secs(60);
/// The most names one sweep drops.
const SWEEP_LIMIT: i32 = 1000;

/// A client's connection to a PostgreSQL server holding locks. Clones share everything.
#[derive(Debug, Clone)]
pub struct PostgresBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    options: PostgresOptions,
    capabilities: Capabilities,
    /// A transaction-pooling proxy is in between.
    pooled: bool,
    kind: Kind,
    sweeper: std::sync::OnceLock<tokio::task::JoinHandle<()>>,
    /// Whether the name columns sort by code point, once a listing asked.
    code_point_order: std::sync::OnceLock<bool>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(sweeper) = self.sweeper.get() {
            sweeper.abort();
        }
    }
}

impl Kind {
    fn pool(&self) -> &Pool {
        match self {
            Kind::Lease(lease) => lease.pool(),
            Kind::Advisory(advisory) => advisory.pool(),
        }
    }
}

#[derive(Debug)]
enum Kind {
    Lease(Lease),
    Advisory(Advisory),
}

impl PostgresBackend {
    /// Connects to the server at `url` (see the crate documentation).
    /// It makes the schema's tables on first use.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the connection attempt; no lock is taken by connecting
    /// (a schema migration in progress is rolled back by the server with its transaction).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a malformed URL (credentials redacted) or unusable
    /// TLS files; [`Error::Unavailable`] if the server cannot be reached;
    /// [`Error::Backend`] if the schema cannot be made (privileges);
    /// [`Error::Unsupported`] for advisory mode through a transaction-pooling proxy.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(PostgresOptions::from_url(url)?).await
    }

    /// Connects to the server at `url`.
    /// In advisory mode the session ttl is the one `connect` asks for (a URL that sets
    /// another is refused).
    ///
    /// # Cancel safety
    ///
    /// As for [`connect`](PostgresBackend::connect).
    ///
    /// # Errors
    ///
    /// As for [`connect`](PostgresBackend::connect).
    pub async fn connect_url(url: &str, connect: &ConnectOptions) -> Result<Self> {
        Self::connect_with(options::parse_url(url, connect)?).await
    }

    /// Connects with `options`.
    ///
    /// # Cancel safety
    ///
    /// As for [`connect`](PostgresBackend::connect).
    ///
    /// # Errors
    ///
    /// As for [`connect`](PostgresBackend::connect).
    pub async fn connect_with(options: PostgresOptions) -> Result<Self> {
        let mut connector = Connector::new(&options)?;
        let (client, driver) = connector.open().await?;
        let mut first = connection::Conn::start(client, driver, &connector);
        schema::migrate(first.client(), &options.schema).await?;
        // A second connection: the pool's next place, or only for finding out about pooling.
        let mut second = None;
        let pooled = match options.pooling {
            Pooling::Session => false,
            Pooling::Transaction => true,
            Pooling::Auto => {
                let (client, driver) = connector.open().await?;
                let other = connection::Conn::start(client, driver, &connector);
                // The first test is quick and says "pooled" for certain when it sees it; a
                // busy pool can hide it, so "not pooled" is confirmed by the second.
                let pooled = transaction_pooled(first.client(), other.client()).await?
                    || !notifications_arrive(&connector, first.client(), PROBE_LIMIT).await?;
                second = Some(other);
                pooled
            }
        };
        if pooled && options.mode == LockMode::Advisory {
            return Err(Error::Unsupported {
                backend: "postgres",
                feature: "advisory locks (mode=advisory) through a transaction-pooling proxy \
                          such as PgBouncer's pool_mode=transaction, which hands the session \
                          holding a lock to other clients; use mode=lease, or connect to the \
                          server or a session pool",
            });
        }
        if pooled {
            connector.without_prepared_statements();
        }
        first.prepare(&connector).await?;
        if let Some(second) = &mut second {
            second.prepare(&connector).await?;
        }
        let connector = Arc::new(connector);
        let wakeups = Wakeups::new();
        let listener = (!pooled).then(|| {
            spawn_listener(
                &wakeups,
                connector.clone(),
                schema::channel(&options.schema),
            )
        });
        if listener.is_some() {
            wait_listening(&wakeups, options.connect_timeout, connector.shown()).await?;
        }
        let mut capabilities = Capabilities::new("postgres", TokenDurability::Durable);
        capabilities.expiring_leases = true;
        capabilities.fair = true;
        capabilities.shared = true;
        capabilities.push_wakeups = !pooled;
        let kind = match (options.mode, listener) {
            (LockMode::Advisory, Some(listener)) => {
                capabilities.session_ttl = Some(options.session_ttl);
                // Inspect shares the first connection; every lock has a connection of its own.
                let shared = Pool::new(connector.clone(), 1, vec![first]);
                Kind::Advisory(Advisory::new(
                    connector,
                    shared,
                    wakeups,
                    listener,
                    options.session_ttl,
                ))
            }
            (_, listener) => {
                capabilities.permits = true;
                capabilities.lock_delay = true;
                let mut initial = vec![first];
                initial.extend(second.filter(|_| options.pool_size > 1));
                let pool = Pool::new(connector, options.pool_size, initial);
                Kind::Lease(Lease::new(pool, wakeups, listener))
            }
        };
        let backend = Self {
            inner: Arc::new(Inner {
                options,
                capabilities,
                pooled,
                kind,
                sweeper: std::sync::OnceLock::new(),
                code_point_order: std::sync::OnceLock::new(),
            }),
        };
        let weak = Arc::downgrade(&backend.inner);
        let _ = backend.inner.sweeper.set(tokio::spawn(async move {
            loop {
                tokio::time::sleep(SWEEP_EVERY).await;
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                if let Err(error) = (PostgresBackend { inner }).sweep().await {
                    tracing::debug!(%error, "sweeping the lock tables failed");
                }
            }
        }));
        Ok(backend)
    }

    /// Drops what vanished holders left behind.
    /// That is the rows of names whose grants and queue entries have all expired (and whose
    /// lock-delay has ended) and nobody has touched since, advisory-mode rows of sessions
    /// that are gone (telling the watchers of their names), the rows of change feeds whose
    /// sessions are gone (where this role may call `<schema>.watch`), and expired records.
    /// Every backend does this once a minute on its own, up to 1 000 names and 1 000
    /// records at a time; rows another transaction holds are left for the next sweep.
    /// Returns how many names were dropped.
    ///
    /// # Cancel safety
    ///
    /// One statement: dropped before it completed, the server finishes or rolls it back.
    ///
    /// # Errors
    ///
    /// Backend errors.
    pub async fn sweep(&self) -> Result<u64> {
        let conn = self.inner.kind.pool().get().await?;
        let row = conn
            .query_one(Stmt::Sweep, &[&SWEEP_LIMIT], "sweep")
            .await?;
        let swept: i32 = reply::single(&row, "sweep")?;
        u64::try_from(swept).map_err(|_| error::undecodable("sweep", swept))
    }

    /// The options in use.
    pub fn options(&self) -> &PostgresOptions {
        &self.inner.options
    }

    /// Whether a transaction-pooling proxy was found (or declared) between client and server.
    /// Then waiters poll instead of being woken.
    pub fn transaction_pooled(&self) -> bool {
        self.inner.pooled
    }

    /// The condition for the caller's statements that holds only while `guard` holds its lock.
    /// That is in this backend's schema (see [`still_owner`]).
    pub fn still_owner(&self, guard: &leasehold_core::Guard) -> StillOwner {
        StillOwner::new(&self.inner.options.schema, guard)
    }
}

/// The longest keep of a record accepted, well inside the server's dates (to 294276 AD).
const MAX_KEEP: Duration = Duration::from_secs(10_000 * 366 * 24 * 3600);

/// How long to keep a record, in whole milliseconds (rounded up: never shorter).
fn keep_millis(keep: Duration) -> Result<i64> {
    if keep > MAX_KEEP {
        return Err(Error::invalid(
            "keep",
            format!("{keep:?} is longer than a record can be kept (10 000 years)"),
        ));
    }
    Ok(lease::millis(keep))
}

/// Waits until the wake-up connection listens.
async fn wait_listening(wakeups: &Wakeups, limit: Duration, shown: &str) -> Result<()> {
    tokio::time::timeout(limit, wakeups.until_listening())
        .await.map_err(|_| {
        Error::unavailable(format!(
            "postgres: the wake-up connection to {shown} did not start listening within {limit:?}"
        ))
    })
}

#[async_trait]
impl Backend for PostgresBackend {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities.clone()
    }

    async fn acquire(&self, req: &Request) -> Result<Acquire> {
        match &self.inner.kind {
            Kind::Lease(lease) => lease.acquire(req).await,
            Kind::Advisory(advisory) => advisory.acquire(req).await,
        }
    }

    async fn renew(&self, req: &Request) -> Result<Renewal> {
        match &self.inner.kind {
            Kind::Lease(lease) => lease.renew(req).await,
            Kind::Advisory(advisory) => advisory.renew(req).await,
        }
    }

    /// Renews each grant of `reqs` as [`renew`](Backend::renew) does.
    /// In lease mode, the grants on one pooled connection are renewed by one statement
    /// (`UPDATE … FROM unnest(…)`), those of all connections at the same time; advisory
    /// mode, whose locks each have a session of their own, renews each by itself.
    ///
    /// # Cancel safety
    ///
    /// As `renew`'s: dropped before its answers, any of the grants may have been extended.
    async fn renew_many(&self, reqs: &[&Request]) -> Vec<Result<Renewal>> {
        match &self.inner.kind {
            Kind::Lease(lease) => lease.renew_many(reqs).await,
            Kind::Advisory(advisory) => {
                futures_util::future::join_all(reqs.iter().map(|req| advisory.renew(req))).await
            }
        }
    }

    async fn release(&self, req: &Request) -> Result<Release> {
        match &self.inner.kind {
            Kind::Lease(lease) => lease.release(req).await,
            Kind::Advisory(advisory) => advisory.release(req).await,
        }
    }

    async fn wait(&self, _name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        match &self.inner.kind {
            Kind::Lease(lease) => lease.wait(hint, max).await,
            Kind::Advisory(advisory) => advisory.wait(hint, max).await,
        }
    }

    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        match &self.inner.kind {
            Kind::Lease(lease) => lease.inspect(name).await,
            Kind::Advisory(advisory) => advisory.inspect(name).await,
        }
    }

    async fn list(
        &self,
        prefix: &NamePrefix,
        cursor: Option<&ListCursor>,
        page: usize,
    ) -> Result<Listing> {
        let inner = &self.inner;
        let ordered = listing::code_point_order(&inner.code_point_order, inner.kind.pool()).await?;
        let page = listing::Page::new(prefix, cursor, page, ordered);
        match &inner.kind {
            Kind::Lease(lease) => lease.list(&page).await,
            Kind::Advisory(advisory) => advisory.list(&page).await,
        }
    }

    /// A feed of the changes of the locks under `prefix` (see [`Backend::changes`]).
    /// It comes from a session of its own that listens on the schema's feed channel and is
    /// a watcher of the prefix (a row of `<schema>.watchers`), in both modes. A grant,
    /// release, queued or departed waiter, eviction or kept grant sends the lock's name in
    /// its own transaction, while a watcher follows it. A lease that runs out sends nothing
    /// (lease mode frees it by time); in advisory mode a holder's session that ended without
    /// a release is told by the next grant of the name, or by the next sweep (any client's,
    /// once a minute), whichever comes first. Through a transaction-pooling proxy, where
    /// LISTEN cannot work, [`Error::Unsupported`].
    ///
    /// # Cancel safety
    ///
    /// Dropped before it returned, the session closes: its transaction is rolled back, or
    /// its row is a gone session's, dropped by the next watcher's start or a sweep.
    async fn changes(&self, prefix: &NamePrefix) -> Result<Changes> {
        if self.inner.pooled {
            return Err(Error::Unsupported {
                backend: "postgres",
                feature: "a change feed (watching locks) through a transaction-pooling proxy \
                          such as PgBouncer's pool_mode=transaction, where LISTEN cannot work",
            });
        }
        let connector = self.inner.kind.pool().connector().clone();
        changes::start(connector, &self.inner.options.schema, prefix).await
    }

    /// Force-releases one grant (see [`Backend::evict`]), in lease mode only.
    /// Advisory mode answers [`Error::Unsupported`]: an advisory lock belongs to its
    /// database session, and the only way to take it from the session is to end it
    /// (`pg_terminate_backend`). That frees at once everything the session holds, the
    /// server hands the lock to the next in its queue with nothing to keep it closed, and
    /// the evicted guards may meanwhile still think they hold.
    ///
    /// # Cancel safety
    ///
    /// Lease mode sends one statement: the eviction and its record happen together or not
    /// at all.
    async fn evict(&self, name: &LockName, mode: Mode, eviction: &Eviction) -> Result<bool> {
        match &self.inner.kind {
            Kind::Lease(lease) => lease.evict(name, mode, eviction).await,
            Kind::Advisory(_) => Err(Error::Unsupported {
                backend: "postgres",
                feature: "force-release in advisory mode (mode=advisory): an advisory lock \
                          is its session's, and ending the session frees all it holds at once",
            }),
        }
    }

    /// Writes a record beside the lock while `req`'s grant holds (see [`Backend::put_record`]).
    /// Lease mode checks the live lease and upserts in one statement on the acquisition's
    /// connection; advisory mode does so on the connection whose session holds the lock.
    /// The record is kept until `keep` after the write by the server's clock; the write
    /// drops the name's expired records, and [`sweep`](PostgresBackend::sweep) the others.
    ///
    /// # Cancel safety
    ///
    /// One statement: dropped before it completed, the server wrote the record or did not.
    /// In lease mode, the lease's end moves to `hold` from now and the name's waiters are
    /// woken; advisory locks end with their session and cannot be kept.
    ///
    /// # Cancel safety
    ///
    /// One statement: dropped, the grant ends at its last lease's end or at `hold`.
    async fn keep(&self, req: &Request, hold: Duration) -> Result<bool> {
        match &self.inner.kind {
            Kind::Lease(lease) => {
                keep_millis(hold)?;
                lease.keep(req, hold).await
            }
            Kind::Advisory(_) => Err(Error::Unsupported {
                backend: "postgres",
                feature: "holding a lock after its holder lets go (--at-least: an advisory \
                          lock ends with its database session)",
            }),
        }
    }

    async fn put_record(
        &self,
        req: &Request,
        key: &RecordKey,
        value: &[u8],
        keep: Duration,
    ) -> Result<bool> {
        let keep = keep_millis(keep)?;
        match &self.inner.kind {
            Kind::Lease(lease) => lease.put_record(req, key, value, keep).await,
            Kind::Advisory(advisory) => advisory.put_record(req, key, value, keep).await,
        }
    }

    /// Reads a record beside the lock, one statement on any pooled connection.
    /// An expired record (by the server's clock) is not read.
    ///
    /// # Cancel safety
    ///
    /// Read-only: dropped, it leaves nothing behind on the server.
    async fn get_record(&self, name: &LockName, key: &RecordKey) -> Result<Option<Vec<u8>>> {
        let conn = self.inner.kind.pool().get().await?;
        let rows = conn
            .query(
                Stmt::GetRecord,
                &[&name.as_str(), &key.as_str()],
                "reading a record",
            )
            .await?;
        reply::record(&rows)
    }

    async fn abandon(&self, req: &Request) -> Result<()> {
        match &self.inner.kind {
            // A lease runs out by itself; the engine retries its release until then.
            Kind::Lease(_) => Ok(()),
            Kind::Advisory(advisory) => advisory.abandon(req).await,
        }
    }
}
