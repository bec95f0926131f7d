//! leasehold's Redis backend: `SET key owner NX PX ttl` done right.
//!
//! - **One round trip per uncontended grant**: one Lua script increments the lock's fencing
//!   counter and sets the lock key if absent (the owner id and token, with a PX expiry),
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
//! - **Fencing tokens** per name, seeded from the server's clock (microseconds) when the
//!   counter is created, so an empty restart never makes them go backwards; this client also
//!   refuses to use a token lower than one it has already seen, and repairs the counter.
//! - **Replica safety**: optionally `WAIT` for replicas to acknowledge each grant; a
//!   warning when `maxmemory-policy` can evict lock keys.
//! - **Cluster-ready keys**: all keys of one lock share the hash tag `{name}`.
//!
//! URL: `redis://[user:password@]host:port[/db][?prefix=P&replicas=N&replica_timeout=D&replicas_required=true]`;
//! `rediss://…[&tls_ca=PATH&tls_cert=PATH&tls_key=PATH]` for TLS.
//! See `docs/backends/redis.md` for what this backend guarantees and what it does not.

pub mod fence;
pub mod redlock;
mod wakeups;

pub use redlock::{RedlockBackend, RedlockOptions};

/// The Redis client crate leasehold uses, for writing to the protected data with a
/// [`fence::RedisFence`].
pub use redis;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use leasehold_core::backend::{
    Acquire, Backend, Capabilities, Expiry, Grant, Holder, LockState, Mode, Release, Renewal,
    Request, TokenDurability, WaitHint, Waiter,
};
use leasehold_core::{
    Error, FencingToken, LockName, LossReason, OwnerId, Result, TlsFiles, parse_duration,
    redact_url,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{FromRedisValue, IntoConnectionInfo, ProtocolVersion, RedisError, Script, Value};

use crate::wakeups::{Router, Seen, Ticket, Wakeups};

/// A script: the operation's fast path, then — at its `-- @prologue`, `-- @head` and
/// `-- @common` markers — the token helpers, the names of keys and arguments, and the
/// helpers of the slower paths, then its slow path. A fast path runs before anything it
/// does not use is even defined.
fn script(body: &str) -> Script {
    let body = body
        .replacen("-- @prologue", include_str!("../lua/prologue.lua"), 1)
        .replacen("-- @head", include_str!("../lua/head.lua"), 1)
        .replacen("-- @common", include_str!("../lua/common.lua"), 1);
    Script::new(&body)
}

#[derive(Debug)]
struct Scripts {
    acquire: Script,
    renew: Script,
    release: Script,
    inspect: Script,
    raise: Script,
}

impl Scripts {
    fn all(&self) -> [&Script; 5] {
        [
            &self.acquire,
            &self.renew,
            &self.release,
            &self.inspect,
            &self.raise,
        ]
    }

    fn new() -> Self {
        Self {
            acquire: script(include_str!("../lua/acquire.lua")),
            renew: script(include_str!("../lua/renew.lua")),
            release: script(include_str!("../lua/release.lua")),
            inspect: script(include_str!("../lua/inspect.lua")),
            raise: script(include_str!("../lua/raise.lua")),
        }
    }
}

/// Waiting for replicas to acknowledge each grant (`WAIT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplicaAck {
    /// How many replicas must acknowledge.
    pub replicas: u32,
    /// How long to wait for them.
    pub timeout: Duration,
    /// `true`: a grant not acknowledged in time is released and the acquire fails with a
    /// retryable error. `false`: it is kept and a warning is logged.
    pub required: bool,
}

impl ReplicaAck {
    /// `replicas` must acknowledge each grant within `timeout`; `required` says whether a
    /// grant that is not acknowledged in time is given back (see the fields).
    pub fn new(replicas: u32, timeout: Duration, required: bool) -> Self {
        Self {
            replicas,
            timeout,
            required,
        }
    }
}

/// Options of the Redis backend (also settable as URL query parameters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisOptions {
    prefix: String,
    replicas: Option<ReplicaAck>,
    connect_timeout: Duration,
    tls: TlsFiles,
}

impl Default for RedisOptions {
    /// Prefix `leasehold`, no replica acknowledgement, 5 s connect timeout, the system's
    /// CA certificates for `rediss://`.
    fn default() -> Self {
        Self {
            prefix: "leasehold".into(),
            replicas: None,
            connect_timeout: Duration::from_secs(5),
            tls: TlsFiles::default(),
        }
    }
}

impl RedisOptions {
    /// The key prefix: keys are `<prefix>:{<name>}:<part>`. 1–64 of `A-Z a-z 0-9 _ - . :`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for other prefixes.
    pub fn prefix(mut self, prefix: &str) -> Result<Self> {
        leasehold_core::check_key_prefix(prefix)?;
        self.prefix = prefix.into();
        Ok(self)
    }

    /// `WAIT` for replicas after every grant.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for zero replicas or a zero or over-long timeout.
    pub fn replicas(mut self, ack: ReplicaAck) -> Result<Self> {
        if ack.replicas == 0 {
            return Err(Error::invalid(
                "replicas",
                "at least one replica must acknowledge",
            ));
        }
        if ack.timeout.is_zero() || ack.timeout > Duration::from_secs(3600) {
            return Err(Error::invalid(
                "replica timeout",
                format!("{:?} is not between 1 ms and 1 h", ack.timeout),
            ));
        }
        self.replicas = Some(ack);
        Ok(self)
    }

    /// How long connecting may take.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// For `rediss://`: trust the CA certificates in `pem` instead of the system's.
    pub fn tls_ca(mut self, pem: Vec<u8>) -> Self {
        self.tls.ca = Some(pem);
        self
    }

    /// For `rediss://`: show this client certificate (PEM) and key (PEM) to servers that ask
    /// for one (`tls-auth-clients yes`).
    pub fn tls_client(mut self, certificate: Vec<u8>, key: Vec<u8>) -> Self {
        self.tls.client = Some((certificate, key));
        self
    }

    /// Checks the TLS settings against the scheme of `url`; whether it is TLS.
    fn check_tls(&self, url: &str) -> Result<bool> {
        let tls = url.to_ascii_lowercase().starts_with("rediss://");
        self.tls.check(tls, "rediss")?;
        Ok(tls)
    }
}

/// Most names whose highest seen token this client remembers; past it the memory starts
/// over (protection against a regressing counter then restarts from the next grant).
const MAX_FLOORS: usize = 100_000;

/// A Redis server holding locks. Clones share one multiplexed connection.
#[derive(Debug, Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    conn: ConnectionManager,
    options: RedisOptions,
    scripts: Scripts,
    wakeups: Arc<Wakeups>,
    /// Per name: the highest token this client saw, and whose it was.
    floors: Mutex<HashMap<LockName, (u64, OwnerId)>>,
    warnings: Vec<String>,
}

/// The keys of one lock name, `<prefix>:{<name>}:<part>` with the parts in the order of
/// `lua/head.lua`. Only the base they share is kept: a call writes the keys it passes
/// straight into its command.
struct Keys {
    base: String,
}

/// The parts of one name's keys, in the order of `lua/head.lua`.
const PARTS: [&str; 11] = [
    "lock", "queue", "qexp", "delay", "xinfo", "token", "readers", "rinfo", "permits", "pinfo",
    "pdelay",
];

/// The part of the lock's wake-up channel (`lua/common.lua` derives it from the lock key).
const WAKE: &str = "wake";

/// Every key of a name, by part (a call that is not an exclusive fast path passes them all).
const ALL_KEYS: [usize; 11] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10];

/// What one script call passes: the keys of `parts` (in that order), and its arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Call {
    parts: &'static [usize],
    args: Args,
}

/// The arguments of a script call (see `lua/head.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Args {
    /// Owner, flags, ttl, then — unless all are defaults — permit limit, lock-delay and
    /// value (then a Redlock quarantine).
    Full,
    /// Owner and ttl (then a Redlock quarantine): the acquire fast path.
    OwnerTtl,
    /// The owner alone: an exclusive release without lock-delay or value.
    Owner,
}

impl Call {
    /// Every key and every argument.
    const ALL: Call = Call::first(ALL_KEYS.len());

    /// The acquire fast path's own keys (see `lua/acquire.lua`): lock and token.
    const ACQUIRE_FAST: Call = Call {
        parts: &[0, 5],
        args: Args::OwnerTtl,
    };

    /// The first `n` keys with every argument.
    const fn first(n: usize) -> Call {
        Call {
            parts: ALL_KEYS.split_at(n).0,
            args: Args::Full,
        }
    }
}

impl Keys {
    fn new(prefix: &str, name: &LockName) -> Self {
        let name = name.as_str();
        let mut base = String::with_capacity(prefix.len() + name.len() + 4);
        base.push_str(prefix);
        base.push_str(":{");
        base.push_str(name);
        base.push_str("}:");
        Keys { base }
    }

    /// What every key of the name starts with; it also names the lock's wake-ups here.
    fn base(&self) -> &str {
        &self.base
    }

    /// Writes the key of `part` as the command's next argument.
    fn write(&self, cmd: &mut redis::Cmd, part: usize) {
        use redis::RedisWrite;
        use std::io::Write;
        let mut arg = cmd.writer_for_next_arg();
        // Writing into the command's buffer cannot fail.
        let _ = arg.write_all(self.base.as_bytes());
        let _ = arg.write_all(PARTS[part].as_bytes());
    }
}

/// The wake-up channel of the name whose keys start with `base`.
fn channel_of(base: &str) -> String {
    format!("{base}{WAKE}")
}

fn mode_code(mode: Mode) -> u8 {
    match mode {
        Mode::Exclusive => b'x',
        Mode::Shared => b's',
        Mode::Permit { .. } => b'p',
    }
}

/// What a release of `req` passes (keys in the order of `lua/head.lua`): an exclusive one
/// the lock and the queue's two (the release wakes the next waiter) with the owner alone,
/// or every argument and also the lock-delay entries with a lock-delay, the stored value
/// with a value; others all.
fn release_call(req: &Request) -> Call {
    match req.mode {
        Mode::Exclusive if req.value.is_some() => Call::first(5),
        Mode::Exclusive if req.lock_delay.is_some() => Call::first(4),
        Mode::Exclusive => Call {
            parts: ALL_KEYS.split_at(3).0,
            args: Args::Owner,
        },
        _ => Call::ALL,
    }
}

/// What a renewal of `req` passes: an exclusive one the lock alone, or with its stored
/// value and lock-delay entries; others all.
fn renew_call(req: &Request) -> Call {
    match req.mode {
        Mode::Exclusive if req.value.is_some() || req.lock_delay.is_some() => Call::first(5),
        Mode::Exclusive => Call::first(1),
        _ => Call::ALL,
    }
}

/// Whole milliseconds, rounded up (Redis expiries are in ms; never grant less than asked).
fn millis_up(d: Duration) -> u64 {
    let ms = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    u64::try_from(ms).unwrap_or(u64::MAX).max(1)
}

/// One EVALSHA of `script` for `req` as `call` says. Full arguments (see `lua/head.lua`):
/// owner, flags (mode, fair, waiting, has value), ttl ms, then — unless all are defaults
/// and there is no `quarantine` — permit limit, lock-delay ms and `value` (the stored value,
/// or the counter floor for `raise`), then the Redlock quarantine ms.
fn script_cmd(
    script: &Script,
    keys: &Keys,
    call: Call,
    req: &Request,
    value: &[u8],
    quarantine: Option<u64>,
) -> redis::Cmd {
    let parts = call.parts;
    let limit = match req.mode {
        Mode::Permit { limit } => limit.get(),
        _ => 0,
    };
    let delay = req.lock_delay.map_or(0, millis_up);
    let flags = [
        mode_code(req.mode),
        flag(req.fair),
        flag(req.waiting),
        flag(req.value.is_some()),
    ];
    // Sized up front: the command is written once, without growing.
    let mut cmd = redis::Cmd::with_capacity(
        parts.len() + 10,
        96 + parts.len() * (keys.base.len() + 8) + req.owner.as_str().len() + value.len(),
    );
    cmd.arg("EVALSHA").arg(script.get_hash()).arg(parts.len());
    for &part in parts {
        keys.write(&mut cmd, part);
    }
    cmd.arg(req.owner.as_str());
    match call.args {
        Args::Owner => return cmd,
        Args::OwnerTtl => {
            cmd.arg(millis_up(req.ttl));
        }
        Args::Full => {
            cmd.arg(&flags[..]).arg(millis_up(req.ttl));
            if limit != 0 || delay != 0 || !value.is_empty() || quarantine.is_some() {
                cmd.arg(limit).arg(delay).arg(value);
            }
        }
    }
    if let Some(quarantine) = quarantine {
        cmd.arg(quarantine);
    }
    cmd
}

impl RedisBackend {
    /// Connects to the server at `url` (see the crate docs for the URL form).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the connection attempt.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a malformed URL or unknown parameter (credentials
    /// redacted); [`Error::Unavailable`] if the server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self> {
        let (base, options) = parse_url(url)?;
        Self::connect_with(&base, options).await
    }

    /// Connects to `url` (without query parameters) with explicit options.
    ///
    /// # Cancel safety
    ///
    /// As for [`connect`](RedisBackend::connect).
    ///
    /// # Errors
    ///
    /// As for [`connect`](RedisBackend::connect).
    pub async fn connect_with(url: &str, options: RedisOptions) -> Result<Self> {
        Self::open(url, options, false).await
    }

    /// Connects to `url`; with `lazy`, without reaching the server now (it is tried on the
    /// first request).
    pub(crate) async fn open(url: &str, options: RedisOptions, lazy: bool) -> Result<Self> {
        let shown = redact_url(url);
        let info = url.into_connection_info().map_err(|e| {
            Error::invalid(
                "url",
                format!("{shown}: {}", e.detail().unwrap_or("not a redis URL")),
            )
        })?;
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let info = info.set_redis_settings(settings);
        if options.check_tls(url)? {
            install_crypto_provider();
        }
        let client = if options.tls.is_empty() {
            redis::Client::open(info)
        } else {
            redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: options.tls.client.clone().map(|(client_cert, client_key)| {
                        redis::ClientTlsConfig {
                            client_cert,
                            client_key,
                        }
                    }),
                    root_cert: options.tls.ca.clone(),
                },
            )
        }
        .map_err(|e| Error::invalid("url", format!("{shown}: {e}")))?;
        let wakeups = Arc::new(Wakeups::default());
        let config = ConnectionManagerConfig::new()
            .set_push_sender(Router(wakeups.clone()))
            .set_automatic_resubscription()
            .set_connection_timeout(Some(options.connect_timeout))
            // A refused connection fails fast; later reconnects are retried per request.
            .set_number_of_retries(2)
            // Every request is bounded by the engine's request timeout instead.
            .set_response_timeout(None);
        let scripts = Scripts::new();
        let unavailable = |e: RedisError| Error::Unavailable {
            message: format!("cannot connect to redis at {shown}: {e}"),
            source: Some(Arc::new(e)),
        };
        let (conn, warnings) = if lazy {
            let conn =
                ConnectionManager::new_lazy_with_config(client, config).map_err(unavailable)?;
            (conn, Vec::new())
        } else {
            let mut conn = tokio::time::timeout(
                options.connect_timeout,
                client.get_connection_manager_with_config(config),
            )
            .await
            .map_err(|_| Error::unavailable(format!("connecting to {shown} timed out")))?
            .map_err(unavailable)?;
            // Loaded up front, so that even the first grant is one round trip. After a
            // server restart EVALSHA falls back to loading them again.
            for script in scripts.all() {
                script
                    .load_async(&mut conn)
                    .await
                    .map_err(|e| map_error(e, "(loading scripts)"))?;
            }
            let warnings = eviction_warnings(&mut conn).await;
            for warning in &warnings {
                tracing::warn!(url = %shown, "{warning}");
            }
            (conn, warnings)
        };
        Ok(Self {
            inner: Arc::new(Inner {
                conn,
                options,
                scripts,
                wakeups,
                floors: Mutex::new(HashMap::new()),
                warnings,
            }),
        })
    }

    /// The server's run id (`INFO server`): tells two addresses of one server apart.
    pub(crate) async fn run_id(&self) -> Result<String> {
        let mut conn = self.inner.conn.clone();
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut conn)
            .await
            .map_err(|e| map_error(e, "(INFO)"))?;
        info.lines()
            .find_map(|l| l.strip_prefix("run_id:"))
            .map(|id| id.trim().to_owned())
            .ok_or_else(|| Error::backend("redis: INFO server has no run_id", false))
    }

    /// Configuration problems found on connecting (an eviction policy that can delete lock
    /// keys).
    pub fn warnings(&self) -> &[String] {
        &self.inner.warnings
    }

    fn keys(&self, name: &LockName) -> Keys {
        Keys::new(&self.inner.options.prefix, name)
    }

    /// Runs `script` for `req` as `call` says (see [`script_cmd`]).
    async fn run<T: FromRedisValue>(
        &self,
        script: &Script,
        req: &Request,
        (keys, call): (&Keys, Call),
        value: &[u8],
    ) -> Result<T> {
        self.run_quarantined(script, req, (keys, call), value, None)
            .await
    }

    /// [`run`](RedisBackend::run), for a Redlock node with a restart quarantine.
    async fn run_quarantined<T: FromRedisValue>(
        &self,
        script: &Script,
        req: &Request,
        (keys, call): (&Keys, Call),
        value: &[u8],
        quarantine_ms: Option<u64>,
    ) -> Result<T> {
        let cmd = script_cmd(script, keys, call, req, value, quarantine_ms);
        self.query(script, &cmd, &req.name).await
    }

    /// Sends an EVALSHA of `script`, loading the script if the server lost it.
    async fn query<T: FromRedisValue>(
        &self,
        script: &Script,
        cmd: &redis::Cmd,
        name: &LockName,
    ) -> Result<T> {
        let mut conn = self.inner.conn.clone();
        match cmd.query_async(&mut conn).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                script
                    .load_async(&mut conn)
                    .await
                    .map_err(|e| map_error(e, name))?;
                cmd.query_async(&mut conn).await
            }
            answer => answer,
        }
        .map_err(|e| map_error(e, name))
    }

    /// An acquire as one Redlock node: a node that restarted less than `quarantine_ms`
    /// ago refuses (0: no quarantine).
    pub(crate) async fn acquire_node(&self, req: &Request, quarantine_ms: u64) -> Result<Acquire> {
        let keys = self.keys(&req.name);
        let quarantine = (quarantine_ms > 0).then_some(quarantine_ms);
        self.acquire_once(req, &keys, quarantine).await
    }

    /// Raises the name's fencing counter to at least `floor` (Redlock's write-back).
    pub(crate) async fn raise_node(&self, req: &Request, floor: u64) -> Result<()> {
        let keys = self.keys(&req.name);
        let _: i64 = self
            .run(
                &self.inner.scripts.raise,
                req,
                (&keys, Call::ALL),
                floor.to_string().as_bytes(),
            )
            .await?;
        Ok(())
    }

    /// Runs the release script for `req`: 1 if it removed something, 0 if not.
    async fn release_script(&self, req: &Request, keys: &Keys) -> Result<i64> {
        let keys = (keys, release_call(req));
        self.run(&self.inner.scripts.release, req, keys, b"").await
    }

    /// Remembers `token` as the highest seen for the name, or returns the higher token
    /// seen before (the server handed out one that is not new: it lost data).
    fn check_floor(&self, req: &Request, token: u64) -> Option<u64> {
        let mut floors = self.inner.floors.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((floor, owner)) = floors.get_mut(&req.name) {
            if token < *floor || (token == *floor && *owner != req.owner) {
                return Some(*floor);
            }
            (*floor, *owner) = (token, req.owner.clone());
            return None;
        }
        if floors.len() >= MAX_FLOORS {
            floors.clear();
        }
        floors.insert(req.name.clone(), (token, req.owner.clone()));
        None
    }

    /// One acquire round trip (two when the fast path does not apply). For a Redlock node,
    /// `quarantine_ms` is how long after a restart the node refuses grants.
    async fn acquire_once(
        &self,
        req: &Request,
        keys: &Keys,
        quarantine_ms: Option<u64>,
    ) -> Result<Acquire> {
        // Read the wake-up versions before the request leaves, so that a release published
        // after the script ran cannot be missed. Only a request that will wait records
        // anything (no state per name for try_lock).
        let owner = req.owner.as_str();
        let seen = if req.waiting {
            self.inner.wakeups.seen(keys.base(), Some(owner))
        } else {
            Seen::default()
        };
        let busy_before = seen.waited;
        let value = req.value.as_deref().unwrap_or_default();
        // An exclusive request that has not been busy yet tries the fast path first, with
        // only the keys it touches; if the name is not simply free, the script says so and
        // the full call follows.
        let fast = req.mode == Mode::Exclusive
            && req.lock_delay.is_none()
            && req.value.is_none()
            && !busy_before;
        // See lua/acquire.lua for the answer's encoding.
        let script = &self.inner.scripts.acquire;
        let mut answer: i64 = 0;
        if fast {
            answer = self
                .run_quarantined(
                    script,
                    req,
                    (keys, Call::ACQUIRE_FAST),
                    value,
                    quarantine_ms,
                )
                .await?;
        }
        // 0: the fast path did not apply (or was not tried); the full call follows.
        if answer == 0 {
            answer = self
                .run_quarantined(script, req, (keys, Call::ALL), value, quarantine_ms)
                .await?;
        }
        if answer > 0 {
            if seen.registered {
                self.inner.wakeups.forget(keys.base(), owner);
            }
            return Ok(Acquire::Granted(Grant::new(
                FencingToken::new(answer.unsigned_abs()),
                Expiry::After(Duration::from_millis(millis_up(req.ttl))),
            )));
        }
        if !req.waiting {
            return Ok(Acquire::Busy(WaitHint::none()));
        }
        let mut ticket = seen.ticket(keys.base(), Some(owner));
        ticket.retry = u64::try_from(-answer - 2).ok().map(Duration::from_millis);
        Ok(Acquire::Busy(WaitHint::new(ticket)))
    }

    async fn wait_for_replicas(&self, req: &Request, ack: ReplicaAck) -> Result<()> {
        let mut conn = self.inner.conn.clone();
        let acked: i64 = redis::cmd("WAIT")
            .arg(ack.replicas)
            .arg(millis_up(ack.timeout))
            .query_async(&mut conn)
            .await
            .map_err(|e| map_error(e, &req.name))?;
        if acked >= i64::from(ack.replicas) {
            return Ok(());
        }
        let problem = format!(
            "only {acked} of {} replicas acknowledged the grant of {} within {:?}",
            ack.replicas, req.name, ack.timeout
        );
        if !ack.required {
            tracing::warn!("{problem}; keeping it");
            return Ok(());
        }
        let keys = self.keys(&req.name);
        let _: i64 = self.release_script(req, &keys).await?;
        Err(Error::backend(format!("{problem}; released it"), true))
    }
}

fn flag(on: bool) -> u8 {
    if on { b'1' } else { b'0' }
}

/// Describes a configuration in which the server may evict lock keys.
async fn eviction_warnings(conn: &mut ConnectionManager) -> Vec<String> {
    let config: std::result::Result<HashMap<String, String>, RedisError> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory*")
        .query_async(conn)
        .await;
    let Ok(config) = config else {
        // CONFIG may be disabled or not permitted; nothing to say then.
        return Vec::new();
    };
    let limit = config.get("maxmemory").map(String::as_str).unwrap_or("0");
    let policy = config
        .get("maxmemory-policy")
        .map(String::as_str)
        .unwrap_or("noeviction");
    if limit != "0" && policy != "noeviction" {
        vec![format!(
            "maxmemory-policy is {policy} with maxmemory {limit}: the server may evict lock keys \
             (a holder then loses its lock at its next renewal, and another may be granted \
             meanwhile); use noeviction"
        )]
    } else {
        Vec::new()
    }
}

/// Maps a Redis error to a leasehold error, without credentials.
fn map_error(error: RedisError, name: impl std::fmt::Display) -> Error {
    if error.is_connection_refusal() || error.is_io_error() || error.is_connection_dropped() {
        return Error::Unavailable {
            message: format!("redis: {error}"),
            source: Some(Arc::new(error)),
        };
    }
    let code = error.code().unwrap_or("");
    let retryable = matches!(
        code,
        "READONLY" | "LOADING" | "BUSY" | "TRYAGAIN" | "MASTERDOWN" | "CLUSTERDOWN"
    );
    let message = match code {
        "READONLY" => "the server is a read-only replica; point leasehold at the primary".into(),
        "LOADING" => "the server is still loading its dataset".into(),
        "BUSY" => "the server is busy running a script".into(),
        "OOM" => "the server is out of memory and refuses writes".into(),
        "NOAUTH" | "WRONGPASS" => "authentication failed".into(),
        "NOPERM" => {
            "this user may not run leasehold's commands (EVALSHA, PUBLISH, SUBSCRIBE, WAIT)".into()
        }
        "WRONGTYPE" => format!(
            "a key of lock {name} holds data of another type; it was not written by leasehold"
        ),
        "LEASEHOLD_FOREIGN" => error
            .detail()
            .unwrap_or("foreign value under a lock key")
            .into(),
        "MOVED" | "ASK" | "CROSSSLOT" => {
            "cluster redirection: connect to the node that serves the lock's slot".into()
        }
        _ => error.to_string(),
    };
    Error::Backend {
        message: format!("redis: {message}"),
        retryable,
        source: Some(Arc::new(error)),
    }
}

/// Makes ring rustls's crypto provider for this process, unless one is set already.
fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Splits leasehold's query parameters off a redis URL.
fn parse_url(url: &str) -> Result<(String, RedisOptions)> {
    let shown = redact_url(url);
    let invalid = |reason: String| Error::invalid("url", format!("{shown}: {reason}"));
    let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    match scheme.as_deref() {
        Some("redis" | "rediss") => {}
        _ => {
            return Err(invalid(
                "expected redis://host:port or rediss://host:port".into(),
            ));
        }
    }
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut options = RedisOptions::default();
    let mut ack = ReplicaAck::new(0, Duration::from_millis(100), true);
    for param in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = param.split_once('=').unwrap_or((param, ""));
        match key {
            "prefix" => options = options.prefix(value)?,
            "replicas" => {
                ack.replicas = value
                    .parse()
                    .map_err(|_| invalid(format!("replicas={value:?} is not a number")))?;
            }
            "replica_timeout" => ack.timeout = parse_duration(value)?,
            "replicas_required" => {
                ack.required = value.parse().map_err(|_| {
                    invalid(format!("replicas_required={value:?} is not true or false"))
                })?;
            }
            "connect_timeout" => options = options.connect_timeout(parse_duration(value)?),
            tls if options.tls.read_param(tls, value)? => {}
            other => {
                return Err(invalid(format!(
                    "unknown parameter {other:?}; known: prefix, replicas, replica_timeout, \
                     replicas_required, connect_timeout, tls_ca, tls_cert, tls_key"
                )));
            }
        }
    }
    if ack.replicas > 0 {
        options = options.replicas(ack)?;
    }
    Ok((base.to_owned(), options))
}

fn text(value: &Value) -> String {
    match value {
        Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        _ => String::new(),
    }
}

fn int(value: &Value) -> i64 {
    match value {
        Value::Int(i) => *i,
        other => text(other).parse().unwrap_or(0),
    }
}

/// A shared or permit holder's info: `token|value`.
fn parse_info(info: &str) -> (FencingToken, Option<Arc<[u8]>>) {
    let (token, value) = info.split_once('|').unwrap_or((info, ""));
    let value = (!value.is_empty()).then(|| Arc::from(value.as_bytes()));
    (FencingToken::new(token.parse().unwrap_or(0)), value)
}

fn remaining(ms: i64) -> Option<Duration> {
    Some(Duration::from_millis(u64::try_from(ms).unwrap_or(0)))
}

#[async_trait]
impl Backend for RedisBackend {
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new("redis", TokenDurability::WhileServerKeepsData);
        caps.expiring_leases = true;
        caps.fair = true;
        caps.push_wakeups = true;
        caps.shared = true;
        caps.permits = true;
        caps.lock_delay = true;
        caps
    }

    async fn acquire(&self, req: &Request) -> Result<Acquire> {
        let keys = self.keys(&req.name);
        let mut answer = self.acquire_once(req, &keys, None).await?;
        if let Acquire::Granted(grant) = &answer
            && let Some(floor) = self.check_floor(req, grant.token.get())
        {
            tracing::warn!(lock = %req.name, token = grant.token.get(), seen = floor,
                "redis handed out a fencing token not above one already seen (it lost data: \
                 failover or restart); raising its counter and granting again");
            let _: i64 = self.release_script(req, &keys).await?;
            self.raise_node(req, floor).await?;
            answer = self.acquire_once(req, &keys, None).await?;
            if let Acquire::Granted(grant) = &answer
                && self.check_floor(req, grant.token.get()).is_some()
            {
                let _: i64 = self.release_script(req, &keys).await?;
                return Err(Error::backend(
                    format!(
                        "redis keeps handing out stale fencing tokens for {}",
                        req.name
                    ),
                    false,
                ));
            }
        }
        if matches!(answer, Acquire::Granted(_))
            && let Some(ack) = self.inner.options.replicas
        {
            self.wait_for_replicas(req, ack).await?;
        }
        Ok(answer)
    }

    async fn renew(&self, req: &Request) -> Result<Renewal> {
        let keys = self.keys(&req.name);
        let renewed: i64 = self
            .run(
                &self.inner.scripts.renew,
                req,
                (&keys, renew_call(req)),
                b"",
            )
            .await?;
        Ok(if renewed == 1 {
            Renewal::Renewed(Expiry::After(Duration::from_millis(millis_up(req.ttl))))
        } else {
            Renewal::Lost(LossReason::NotOwner)
        })
    }

    async fn release(&self, req: &Request) -> Result<Release> {
        let keys = self.keys(&req.name);
        self.inner.wakeups.forget(keys.base(), req.owner.as_str());
        let released: i64 = self.release_script(req, &keys).await?;
        Ok(if released == 1 {
            Release::Released
        } else {
            Release::NotHeld
        })
    }

    async fn wait(&self, _name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        let Some(ticket) = hint.get::<Ticket>() else {
            return Ok(());
        };
        if !ticket.subscribed {
            // Subscribe, then let the caller try again with the subscription in place.
            let mut conn = self.inner.conn.clone();
            conn.subscribe(channel_of(&ticket.lock))
                .await
                .map_err(|e| Error::Unavailable {
                    message: format!("redis: subscribing to wake-ups failed: {e}"),
                    source: Some(Arc::new(e)),
                })?;
            self.inner.wakeups.mark_subscribed(&ticket.lock);
            return Ok(());
        }
        self.inner.wakeups.wait(ticket, max).await;
        Ok(())
    }

    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        let keys = self.keys(name);
        let mut ticket = self
            .inner
            .wakeups
            .seen(keys.base(), None)
            .ticket(keys.base(), None);
        let probe = Request::new(
            name.clone(),
            OwnerId::parse("inspect").unwrap_or_else(|_| OwnerId::generate()),
            Mode::Exclusive,
            Duration::from_millis(1),
        );
        let reply: Vec<Value> = self
            .run(&self.inner.scripts.inspect, &probe, (&keys, Call::ALL), b"")
            .await?;
        let [lock, ttl, xinfo, readers, permits, queue] = reply.as_slice() else {
            return Err(Error::backend("redis: unexpected inspect reply", false));
        };
        let mut state = LockState::default();
        let lock = text(lock);
        let mut earliest: Option<i64> = None;
        if let Some((owner, token)) = lock.split_once(' ') {
            let left = int(ttl);
            earliest = Some(left);
            let value = text(xinfo);
            state.holders.push(
                Holder::new(
                    OwnerId::parse(owner)?,
                    Mode::Exclusive,
                    FencingToken::new(token.parse().unwrap_or(0)),
                )
                .with_remaining(remaining(left))
                .with_value((!value.is_empty()).then(|| Arc::from(value.as_bytes()))),
            );
        }
        let mut add = |members: &Value, mode: Mode| -> Result<()> {
            if let Value::Array(flat) = members {
                for chunk in flat.chunks(3) {
                    if let [owner, left, info] = chunk {
                        let (token, value) = parse_info(&text(info));
                        let left = int(left);
                        earliest = Some(earliest.map_or(left, |e| e.min(left)));
                        state.holders.push(
                            Holder::new(OwnerId::parse(&text(owner))?, mode, token)
                                .with_remaining(remaining(left))
                                .with_value(value),
                        );
                    }
                }
            }
            Ok(())
        };
        add(readers, Mode::Shared)?;
        // The permit limit is not stored: report the count held.
        let limit = match permits {
            Value::Array(flat) => u32::try_from((flat.len() / 3).max(1)).unwrap_or(1),
            _ => 1,
        };
        add(
            permits,
            Mode::Permit {
                limit: std::num::NonZeroU32::new(limit).unwrap_or(std::num::NonZeroU32::MIN),
            },
        )?;
        if let Value::Array(members) = queue {
            for member in members {
                let member = text(member);
                let (kind, owner) = member.split_at(member.len().min(1));
                let mode = match kind {
                    "x" => Mode::Exclusive,
                    "s" => Mode::Shared,
                    _ => Mode::Permit {
                        limit: std::num::NonZeroU32::MIN,
                    },
                };
                state
                    .waiters
                    .push(Waiter::new(OwnerId::parse(owner)?, mode));
            }
        }
        ticket.retry = earliest
            .and_then(|ms| u64::try_from(ms).ok())
            .map(Duration::from_millis);
        state.hint = WaitHint::new(ticket);
        Ok(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_one_hash_tag() {
        let keys = Keys::new("leasehold", &LockName::new("orders:42").unwrap());
        let mut req = Request::new(
            LockName::new("orders:42").unwrap(),
            OwnerId::parse("o1").unwrap(),
            Mode::Exclusive,
            Duration::from_micros(1_500_500),
        );
        req.fair = true;
        let script = Script::new("return 1");
        // EVALSHA, the hash, the key count, the keys in order, then the arguments.
        let args = |call: Call, quarantine: Option<u64>| -> Vec<String> {
            let cmd = script_cmd(&script, &keys, call, &req, b"", quarantine);
            let packed = String::from_utf8(cmd.get_packed_command()).unwrap();
            let args: Vec<String> = packed
                .split("\r\n")
                .skip(2)
                .step_by(2)
                .map(str::to_owned)
                .collect();
            assert_eq!(args[0], "EVALSHA");
            assert_eq!(args[2], call.parts.len().to_string());
            args[3..].to_vec()
        };
        let key = |part: &str| format!("leasehold:{{orders:42}}:{part}");
        let all = args(Call::ALL, None);
        assert_eq!(all[..11], PARTS.map(key));
        // Owner, flags (exclusive, fair, not waiting, no value), ttl rounded up.
        assert_eq!(all[11..], ["o1", "x100", "1501"]);
        // The fast path: lock, token; owner, ttl (and a Redlock quarantine).
        assert_eq!(
            args(Call::ACQUIRE_FAST, None),
            [
                key("lock"),
                key("token"),
                "o1".to_owned(),
                "1501".to_owned()
            ]
        );
        assert_eq!(
            args(Call::ACQUIRE_FAST, Some(250))[2..],
            ["o1", "1501", "250"]
        );
        // An exclusive release: lock, queue, waiter expiries and the owner alone.
        assert_eq!(
            args(release_call(&req), None),
            [key("lock"), key("queue"), key("qexp"), "o1".to_owned()]
        );
        // With a lock-delay: the delay entries and every argument.
        let mut delayed = req.clone();
        delayed.lock_delay = Some(Duration::from_millis(40));
        assert_eq!(release_call(&delayed), Call::first(4));
        assert_eq!(renew_call(&delayed), Call::first(5));
        assert_eq!(channel_of(keys.base()), "leasehold:{orders:42}:wake");
    }

    #[test]
    fn ttls_round_up_to_whole_milliseconds() {
        assert_eq!(millis_up(Duration::from_micros(1500)), 2);
        assert_eq!(millis_up(Duration::from_millis(3)), 3);
        assert_eq!(millis_up(Duration::from_nanos(1)), 1);
    }

    #[test]
    fn url_parameters_are_parsed_and_checked() {
        let (base, options) =
            parse_url("redis://u:pw@h:1/2?prefix=app&replicas=1&replica_timeout=50ms").unwrap();
        assert_eq!(base, "redis://u:pw@h:1/2");
        assert_eq!(options.prefix, "app");
        assert_eq!(
            options.replicas,
            Some(ReplicaAck::new(1, Duration::from_millis(50), true))
        );
        for bad in [
            "redis://h:1?nosuch=1",
            "redis://h:1?prefix=a{b}",
            "redis://h:1?replicas=x",
            "redis://h:1?replica_timeout=5",
            "http://h:1",
        ] {
            let err = parse_url(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument { .. }), "{bad}: {err}");
        }
        let err = parse_url("redis://u:hunter2@h:1?nosuch=1").unwrap_err();
        assert!(!err.to_string().contains("hunter2"));
        // TLS files are read while parsing (see `TlsFiles`), and only go with rediss://.
        let (base, options) = parse_url("rediss://h:1").unwrap();
        assert_eq!(
            (base.as_str(), options.tls.is_empty()),
            ("rediss://h:1", true)
        );
        let err = parse_url("rediss://h:1?tls_ca=/no/such/ca.pem").unwrap_err();
        assert!(err.to_string().contains("/no/such/ca.pem"), "{err}");
        let ca = std::env::temp_dir().join(format!("leasehold-redis-ca-{}", std::process::id()));
        std::fs::write(&ca, "CA").unwrap();
        let (_, options) = parse_url(&format!("rediss://h:1?tls_ca={}", ca.display())).unwrap();
        assert_eq!(options.tls.ca.as_deref(), Some(&b"CA"[..]));
        assert!(options.check_tls("rediss://h:1").unwrap());
        assert!(
            options.check_tls("redis://h:1").is_err(),
            "TLS files on a plain URL"
        );
        std::fs::remove_file(&ca).unwrap();
    }

    #[test]
    fn holder_info_round_trips() {
        let (token, value) = parse_info("1763794800123456|10.0.0.7:80|x");
        assert_eq!(token.get(), 1_763_794_800_123_456);
        assert_eq!(value.as_deref(), Some(&b"10.0.0.7:80|x"[..]));
        assert_eq!(parse_info("5|").1, None);
    }
}
