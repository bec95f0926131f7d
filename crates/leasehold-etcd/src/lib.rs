//! leasehold's etcd backend: every grant committed by a Raft majority.
//!
//! - **One session per backend**: one lease, kept alive by a keep-alive stream, shared by
//!   every lock, permit and candidacy; guards follow the session and are lost when it ends
//!   (see [`session`](crate::session)). [`EtcdBackend::close`] revokes it,
//!   [`EtcdBackend::orphan`] stops renewing it.
//! - **Grant in one transaction**: into an empty queue, my key
//!   (`<prefix>/<name>/<set>/<lease>.<slot>`) is put bound to the session lease, with the
//!   owner in its value, and holds at the transaction's revision. Otherwise the same
//!   transaction puts it and reads the queue (the keys of the set, oldest first); if the
//!   put of an unanswered attempt already landed, the put again keeps the key's create
//!   revision, its place in the queue. A session reuses the slot numbers it freed: every new
//!   key would leave a deleted one behind that each queue read steps over until etcd
//!   compacts its history. The holder is the key with the lowest create revision (for
//!   shared keys: no exclusive key before it; for permits: fewer than N keys before it).
//!   The fencing token is the create revision of the holder's key, increasing cluster-wide.
//! - **Waiting**: watch only the deletion of the key that stands in my way (the one just
//!   before mine; for a reader the nearest writer before it), from the current revision — a
//!   watch from an older revision goes through etcd's catch-up loop and is delivered up to
//!   100 ms late — then look that key up once, for what happened before the watch was in
//!   place. After waking, the transaction confirms my key still exists under my live
//!   session before anything is granted; a waiter whose session ended while it waited is
//!   refused (never granted on a dead lease).
//! - **Release** deletes my key, and no newer one: a key is this session's and this slot's,
//!   only this process writes it, and a slot goes to a new acquisition only after the one
//!   delete sent for its previous key was answered; a slot whose delete failed, timed out or
//!   had to be sent again is retired for the rest of the session. A late or retried delete
//!   can never reach a newer key, so the delete needs no compare — which matters on etcd
//!   3.4, where any transaction costs the member more than a plain delete.
//! - **Lock-delay**: a grant with a lock-delay also puts a marker bound to a lease that
//!   outlives the session's by the delay; a marker whose holder's key is gone closes the
//!   queue until it expires; release deletes it with the key (see [`MARKER`]).
//!
//! URL: `etcd://[user:password@]host:port[,host:port...][?prefix=P&session_ttl=D&connect_timeout=D]`;
//! `etcds://…[&tls_ca=PATH&tls_cert=PATH&tls_key=PATH]` for TLS (each member's
//! certificate checked against its own host name; without `tls_ca`, the system's CA
//! certificates). See `docs/backends/etcd.md`.

mod session;
mod transport;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, KeyValue, KvClient, PutOptions,
    SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse, WatchFilterType, WatchOptions,
};
use leasehold_core::backend::{
    Acquire, Backend, Capabilities, Expiry, Grant, Holder, LockState, Mode, Release, Renewal,
    Request, TokenDurability, WaitHint, Waiter,
};
use leasehold_core::{
    Error, FencingToken, Guard, LockName, LossReason, OwnerId, Result, TlsFiles, parse_duration,
    redact_url,
};
use tokio::sync::Mutex as AsyncMutex;

use crate::session::Session;

/// Options of the etcd backend (also settable as URL query parameters).
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdOptions {
    prefix: String,
    session_ttl: Duration,
    connect_timeout: Duration,
    user: Option<(String, String)>,
    tls: TlsFiles,
}

impl std::fmt::Debug for EtcdOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        f.debug_struct("EtcdOptions")
            .field("prefix", &self.prefix)
            .field("session_ttl", &self.session_ttl)
            .field("connect_timeout", &self.connect_timeout)
            .field("user", &self.user.as_ref().map(|(user, _)| user))
            .field("tls", &self.tls)
            .finish()
    }
}

impl Default for EtcdOptions {
    /// Prefix `leasehold`, a 10 s session, 5 s to connect, the system's CA certificates
    /// for TLS.
    fn default() -> Self {
        Self {
            prefix: "leasehold".into(),
            session_ttl: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            user: None,
            tls: TlsFiles::default(),
        }
    }
}

impl EtcdOptions {
    /// The key prefix: keys are `<prefix>/<name>/<set>/<lease>.<slot>`. 1–64 of
    /// `A-Z a-z 0-9 _ - . :` (no `/`, so that names cannot reach into other prefixes).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for other prefixes.
    pub fn prefix(mut self, prefix: &str) -> Result<Self> {
        leasehold_core::check_key_prefix(prefix)?;
        self.prefix = prefix.into();
        Ok(self)
    }

    /// The session lease's ttl: how long after the client stops keeping it alive (it
    /// crashed, it is partitioned) its locks are freed, and how soon a guard learns that
    /// the session is gone. etcd leases are whole seconds: a fraction is rounded up, and
    /// etcd may grant more than asked (its minimum); the granted ttl is used.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for less than 1 s or more than a day.
    pub fn session_ttl(mut self, ttl: Duration) -> Result<Self> {
        if ttl < Duration::from_secs(1) || ttl > Duration::from_secs(86_400) {
            return Err(Error::invalid(
                "session ttl",
                format!("{ttl:?} is not between 1 s and 1 day (etcd leases are whole seconds)"),
            ));
        }
        self.session_ttl = ttl;
        Ok(self)
    }

    /// How long connecting may take.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Authenticate as `user`.
    pub fn user(mut self, user: &str, password: &str) -> Self {
        self.user = Some((user.into(), password.into()));
        self
    }

    /// For TLS (`https://` endpoints): the CA certificates to trust instead of the
    /// system's, and a client certificate for members that ask for one
    /// (`--client-cert-auth`).
    pub fn tls(mut self, files: TlsFiles) -> Self {
        self.tls = files;
        self
    }
}

/// A client's connection to an etcd cluster. Clones share the connection and the session.
#[derive(Debug, Clone)]
pub struct EtcdBackend {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    options: EtcdOptions,
    session: AsyncMutex<Option<Arc<Session>>>,
    keys: Mutex<Keys>,
}

/// The keys this backend has placed or is placing, by owner.
#[derive(Debug, Default)]
struct Keys {
    by_owner: HashMap<OwnerId, Placed>,
    /// Slots taken, per session lease and queue directory.
    taken: HashMap<(i64, String), std::collections::BTreeSet<u32>>,
}

/// One owner's key.
#[derive(Debug, Clone)]
struct Placed {
    dir: String,
    slot: u32,
    lease: i64,
    /// Its create revision, once an answer showed it (unknown after a lost reply).
    revision: Option<i64>,
    /// A delete was sent for it (it may still be in flight).
    deleting: bool,
}

impl Placed {
    fn key(&self) -> String {
        format!("{}{:x}.{}", self.dir, self.lease, self.slot)
    }

    /// The lock-delay marker of this key (see [`MARKER`]).
    fn marker(&self) -> String {
        format!("{}.d", self.key())
    }
}

/// The value of a lock-delay marker starts with this, then the owner. A marker is put
/// beside a grant of a request with a lock-delay, bound to the session's delay lease
/// (which outlives the session's own by the delay), and deleted with the key on release;
/// a marker whose owner has no key left in the queue means its holder vanished without
/// releasing, and closes the queue until it expires.
const MARKER: &[u8] = b"d ";

/// How often an idle connection is pinged, and how long a ping may go unanswered before
/// the connection is given up for the next member.
const KEEP_ALIVE: Duration = Duration::from_secs(2);

impl Keys {
    /// The owner's key, placing it in the lowest free slot of `dir` if it has none.
    fn place(&mut self, owner: &OwnerId, dir: &str, lease: i64) -> Placed {
        if let Some(placed) = self.by_owner.get(owner) {
            return placed.clone();
        }
        let taken = self.taken.entry((lease, dir.to_owned())).or_default();
        let slot = (0..).find(|n| !taken.contains(n)).unwrap_or(u32::MAX);
        taken.insert(slot);
        let placed = Placed {
            dir: dir.to_owned(),
            slot,
            lease,
            revision: None,
            deleting: false,
        };
        self.by_owner.insert(owner.clone(), placed.clone());
        placed
    }

    /// Marks the owner's key as being deleted; returns it, and whether this is the first
    /// delete sent for it.
    ///
    /// Why deletes of our keys carry no compare: etcd 3.4 runs every transaction — even one
    /// of a single delete — through a slower path than a plain delete (measured with 16
    /// clients: about 50 µs more of the member's CPU per lock cycle, 10–15 % of the
    /// throughput). What the compare of a create revision would guarantee — a delete never
    /// removes a newer key — the slot rule guarantees instead (see
    /// [`finish_delete`](Keys::finish_delete)).
    fn start_delete(&mut self, owner: &OwnerId) -> Option<(Placed, bool)> {
        let placed = self.by_owner.get_mut(owner)?;
        let first = !placed.deleting;
        placed.deleting = true;
        Some((placed.clone(), first))
    }

    /// The delete of the owner's key was answered: forgets the key. Its slot is free for a
    /// new key only if this delete was the one sent for it (no other may still be in
    /// flight) and the key's creation was answered (no put may still land there).
    fn finish_delete(&mut self, owner: &OwnerId, first: bool) {
        let retire = !first
            || self
                .by_owner
                .get(owner)
                .is_none_or(|placed| placed.revision.is_none());
        self.forget(owner, retire);
    }

    fn record(&mut self, owner: &OwnerId, revision: i64) {
        if let Some(placed) = self.by_owner.get_mut(owner) {
            placed.revision = Some(revision);
        }
    }

    /// Forgets the owner's key; its slot is free again unless `retire` (a put of unknown
    /// outcome may still land there).
    fn forget(&mut self, owner: &OwnerId, retire: bool) -> Option<Placed> {
        let placed = self.by_owner.remove(owner)?;
        if !retire {
            let at = (placed.lease, placed.dir.clone());
            if let Some(taken) = self.taken.get_mut(&at) {
                taken.remove(&placed.slot);
                if taken.is_empty() {
                    self.taken.remove(&at);
                }
            }
        }
        Some(placed)
    }
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// What a busy request hands to `wait`: what to watch, and what it looked like when read.
#[derive(Debug)]
struct Hint {
    key: Vec<u8>,
    /// Watch every key under `key`.
    prefix: bool,
    /// Only deletions matter (a queued entry: nothing put later gets ahead of it).
    deletes_only: bool,
    /// The watched key's create revision, for a single key.
    created: Option<i64>,
    /// The revision after the read: a change at or after it may matter.
    from: i64,
}

/// One holder or waiter, from a queue read.
#[derive(Debug)]
struct Entry {
    owner: OwnerId,
    mode: Mode,
    value: Option<Arc<[u8]>>,
    revision: i64,
    lease: i64,
    key: Vec<u8>,
}

fn set_of(mode: Mode) -> &'static str {
    if mode.is_permit() { "permit" } else { "lock" }
}

/// A key's value: the mode (`x`, `s`, `p<limit>`), a space, the owner, a newline, the
/// stored value.
fn encode(mode: Mode, owner: &OwnerId, value: Option<&[u8]>) -> Vec<u8> {
    let mode = match mode {
        Mode::Exclusive => "x".to_owned(),
        Mode::Shared => "s".to_owned(),
        Mode::Permit { limit } => format!("p{limit}"),
    };
    let mut out = format!("{mode} {owner}\n").into_bytes();
    if let Some(value) = value {
        out.extend_from_slice(value);
    }
    out
}

fn decode(kv: &KeyValue) -> Option<Entry> {
    let (mode, owner, value) = decode_value(kv.value())?;
    Some(Entry {
        owner,
        mode,
        value,
        revision: kv.create_revision(),
        lease: kv.lease(),
        key: kv.key().to_vec(),
    })
}

/// What a key's value says: its mode, its owner, the value stored with it.
type Decoded = (Mode, OwnerId, Option<Arc<[u8]>>);

/// Parses a key's value (see [`encode`]).
fn decode_value(value: &[u8]) -> Option<Decoded> {
    let newline = value.iter().position(|b| *b == b'\n')?;
    let (head, rest) = value.split_at(newline);
    let (mode, owner) = std::str::from_utf8(head).ok()?.split_once(' ')?;
    let mode = match mode.as_bytes() {
        b"x" => Mode::Exclusive,
        b"s" => Mode::Shared,
        [b'p', limit @ ..] => Mode::Permit {
            limit: std::str::from_utf8(limit).ok()?.parse().ok()?,
        },
        _ => return None,
    };
    let stored = &rest[1..];
    Some((
        mode,
        OwnerId::parse(owner).ok()?,
        (!stored.is_empty()).then(|| Arc::from(stored)),
    ))
}

/// Which entries of a queue (oldest first) hold: exclusive — the first only; shared — those
/// with no exclusive entry before them; permits — the first `limit`.
fn holding(queue: &[Entry]) -> Vec<bool> {
    let mut seen_exclusive = false;
    queue
        .iter()
        .enumerate()
        .map(|(i, entry)| {
            let holds = match entry.mode {
                Mode::Exclusive => i == 0,
                Mode::Shared => !seen_exclusive,
                Mode::Permit { limit } => i < limit.get() as usize,
            };
            seen_exclusive |= entry.mode == Mode::Exclusive;
            holds
        })
        .collect()
}

/// The key whose change may let the entry at `me` hold: the one just before it (for a
/// reader, the nearest writer before it); permits watch the whole queue.
fn in_the_way(queue: &[Entry], me: usize) -> Option<&Entry> {
    match queue[me].mode {
        Mode::Exclusive => me.checked_sub(1).map(|i| &queue[i]),
        Mode::Shared => queue[..me].iter().rev().find(|e| e.mode == Mode::Exclusive),
        Mode::Permit { .. } => None,
    }
}

/// Maps an etcd-client error, without credentials.
fn map_error(error: etcd_client::Error, doing: &str) -> Error {
    use etcd_client::Error as E;
    match &error {
        E::GRpcStatus(status) => {
            let code = status.code();
            let message = format!("etcd: {doing}: {}", status.message());
            match code {
                tonic_code::Unavailable | tonic_code::Cancelled | tonic_code::Unknown => {
                    Error::Unavailable {
                        message,
                        source: Some(Arc::new(error)),
                    }
                }
                tonic_code::DeadlineExceeded => Error::Timeout(Duration::ZERO),
                _ => Error::Backend {
                    message,
                    retryable: matches!(code, tonic_code::ResourceExhausted | tonic_code::Aborted),
                    source: Some(Arc::new(error)),
                },
            }
        }
        E::TransportError(_) | E::IoError(_) => Error::Unavailable {
            message: format!("etcd: {doing}: {error}"),
            source: Some(Arc::new(error)),
        },
        _ => Error::Backend {
            message: format!("etcd: {doing}: {error}"),
            retryable: false,
            source: Some(Arc::new(error)),
        },
    }
}

/// gRPC status codes, as etcd-client reports them.
mod tonic_code {
    pub(crate) use tonic::Code::*;
}

/// Splits `etcd://[user:pass@]h1:p1,h2:p2[?params]` into endpoints and options.
fn parse_url(url: &str) -> Result<(Vec<String>, EtcdOptions)> {
    let shown = redact_url(url);
    let invalid = |reason: String| Error::invalid("url", format!("{shown}: {reason}"));
    let (rest, scheme) = match url.split_once("://") {
        Some((etcd, rest)) if etcd.eq_ignore_ascii_case("etcd") => (rest, "http"),
        Some((etcds, rest)) if etcds.eq_ignore_ascii_case("etcds") => (rest, "https"),
        _ => {
            return Err(invalid(
                "expected etcd://host:port[,host:port...] or etcds://… (TLS)".into(),
            ));
        }
    };
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let rest = rest.trim_end_matches('/');
    if rest.contains('/') {
        return Err(invalid(
            "a path is not used; give the prefix as ?prefix=P".into(),
        ));
    }
    let mut options = EtcdOptions::default();
    let hosts = match rest.rsplit_once('@') {
        Some((auth, hosts)) => {
            let (user, password) = auth.split_once(':').unwrap_or((auth, ""));
            options = options.user(user, password);
            hosts
        }
        None => rest,
    };
    let endpoints: Vec<String> = hosts
        .split(',')
        .filter(|h| !h.trim().is_empty())
        .map(|h| format!("{scheme}://{}", h.trim()))
        .collect();
    if endpoints.is_empty() {
        return Err(invalid("no endpoints".into()));
    }
    for param in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = param.split_once('=').unwrap_or((param, ""));
        match key {
            "prefix" => options = options.prefix(value)?,
            "session_ttl" => options = options.session_ttl(parse_duration(value)?)?,
            "connect_timeout" => options = options.connect_timeout(parse_duration(value)?),
            tls if options.tls.read_param(tls, value)? => {}
            other => {
                return Err(invalid(format!(
                    "unknown parameter {other:?}; known: prefix, session_ttl, connect_timeout, {}",
                    TlsFiles::PARAMS
                )));
            }
        }
    }
    options.tls.check(scheme == "https", "etcds")?;
    Ok((endpoints, options))
}

fn header_revision(responses: &[TxnOpResponse], fallback: i64) -> i64 {
    responses
        .iter()
        .find_map(|r| match r {
            TxnOpResponse::Get(get) => get.header().map(|h| h.revision()),
            _ => None,
        })
        .unwrap_or(fallback)
}

impl EtcdBackend {
    /// Connects to the cluster at `url` (see the crate docs).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the connection attempt; no session exists yet.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a malformed URL (credentials redacted) or TLS files
    /// that cannot be read or hold no usable certificate or key; [`Error::Unavailable`] if
    /// no endpoint answers.
    pub async fn connect(url: &str) -> Result<Self> {
        let (endpoints, options) = parse_url(url)?;
        Self::connect_with(&endpoints, options).await
    }

    /// Connects to `endpoints` (`http://host:port` each, or `https://host:port` each for
    /// TLS): one connection, to the first member, moving on to the next whenever it must
    /// connect again (the member went away or left a keep-alive ping unanswered for 2 s).
    ///
    /// # Cancel safety
    ///
    /// As for [`connect`](EtcdBackend::connect).
    ///
    /// # Errors
    ///
    /// As for [`connect`](EtcdBackend::connect).
    pub async fn connect_with(endpoints: &[String], options: EtcdOptions) -> Result<Self> {
        let mut connect = ConnectOptions::new();
        if let Some((user, password)) = &options.user {
            connect = connect.with_user(user, password);
        }
        let channel =
            transport::channel(endpoints, &options.tls, options.connect_timeout, KEEP_ALIVE)?;
        // The channel connects on first use: a status request makes the first use here, so
        // that an unreachable cluster or a refused certificate is reported by `connect`.
        let client = tokio::time::timeout(options.connect_timeout, async {
            let mut client =
                Client::from_channel(etcd_client::Channel::Tonic(channel), Some(connect)).await?;
            client.status().await?;
            Ok(client)
        })
        .await
        .map_err(|_| {
            Error::unavailable(format!(
                "connecting to etcd at {} timed out",
                endpoints.join(",")
            ))
        })?
        .map_err(|e| map_error(e, "connecting"))?;
        Ok(Self {
            inner: Arc::new(Inner {
                client,
                options,
                session: AsyncMutex::new(None),
                keys: Mutex::new(Keys::default()),
            }),
        })
    }

    fn client(&self) -> Client {
        self.inner.client.clone()
    }

    /// The key-value service alone: cheaper to clone per request than the whole client.
    fn kv(&self) -> KvClient {
        self.inner.client.kv_client()
    }

    fn dir(&self, name: &LockName, mode: Mode) -> String {
        format!("{}/{name}/{}/", self.inner.options.prefix, set_of(mode))
    }

    /// The live session, started now if there is none or the last one ended.
    async fn session(&self) -> Result<Arc<Session>> {
        let mut current = self.inner.session.lock().await;
        if let Some(session) = current.as_ref()
            && session.is_alive()
        {
            return Ok(session.clone());
        }
        let session =
            Arc::new(Session::start(&self.inner.client, self.inner.options.session_ttl).await?);
        *current = Some(session.clone());
        Ok(session)
    }

    /// The session in use, if any (without starting one).
    async fn current_session(&self) -> Option<Arc<Session>> {
        self.inner.session.lock().await.clone()
    }

    /// Ends this client's session and revokes its lease: every lock it holds is freed at
    /// once, and its guards are lost. A later acquisition starts a new session.
    ///
    /// # Cancel safety
    ///
    /// The session ends locally at once; if the future is dropped the revocation may not
    /// reach etcd, and the lease then runs out.
    ///
    /// # Errors
    ///
    /// If etcd cannot be reached (the lease then runs out by itself).
    pub async fn close(&self) -> Result<()> {
        let session = self.inner.session.lock().await.take();
        match session {
            Some(session) => session.close(&self.inner.client).await,
            None => Ok(()),
        }
    }

    /// The ttl etcd granted the current session (whole seconds, at least the configured
    /// one), if a session has started.
    pub async fn session_ttl(&self) -> Option<Duration> {
        self.current_session().await.map(|s| s.ttl)
    }

    /// Stops keeping this client's session alive without revoking it: its locks stay held
    /// until the lease runs out (and its guards are lost then).
    pub async fn orphan(&self) {
        if let Some(session) = self.inner.session.lock().await.take() {
            session.orphan().await;
        }
    }

    /// A comparison that holds while `guard`'s lock is still held: its key exists with the
    /// revision the grant created. Put it in your own etcd transaction so that a write
    /// happens only while the lock is held.
    pub fn still_owner(&self, guard: &Guard) -> Compare {
        // A released guard compares its queue directory, a key that never exists.
        let key = self
            .keys()
            .by_owner
            .get(guard.owner())
            .map_or_else(|| self.dir(guard.name(), guard.mode()), Placed::key);
        let revision = i64::try_from(guard.token().get()).unwrap_or(i64::MAX);
        Compare::create_revision(key, CompareOp::Equal, revision)
    }

    fn keys(&self) -> std::sync::MutexGuard<'_, Keys> {
        self.inner.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The queue of `dir`, oldest first, and the oldest lock-delay marker that keeps it
    /// closed (one whose owner has no key in the queue).
    fn queue_of(responses: &[TxnOpResponse]) -> (Vec<Entry>, Option<(Vec<u8>, i64)>) {
        let kvs = responses
            .iter()
            .rev()
            .find_map(|r| match r {
                TxnOpResponse::Get(get) => Some(get.kvs()),
                _ => None,
            })
            .unwrap_or_default();
        let queue: Vec<Entry> = kvs.iter().filter_map(decode).collect();
        let closed_by = kvs
            .iter()
            .find(|kv| {
                kv.value()
                    .strip_prefix(MARKER)
                    .and_then(|owner| std::str::from_utf8(owner).ok())
                    .is_some_and(|owner| {
                        !queue.iter().any(|e| e.owner.as_str() == owner.trim_end())
                    })
            })
            .map(|kv| (kv.key().to_vec(), kv.create_revision()));
        (queue, closed_by)
    }

    fn sorted(dir: &str) -> GetOptions {
        GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_range(prefix_end(dir))
    }

    /// Whether what `hint` watches may have changed since it was read, now that a watch
    /// created at revision `now` is in place: a single key is looked up (gone or created
    /// again); a range counts as changed if anything was written since the read.
    async fn moved(&self, hint: &Hint, now: i64) -> Result<bool> {
        let Some(created) = hint.created else {
            return Ok(now >= hint.from);
        };
        let now = self
            .kv()
            .get(hint.key.clone(), Some(GetOptions::new().with_keys_only()))
            .await
            .map_err(|e| map_error(e, "watching"))?;
        Ok(now
            .kvs()
            .first()
            .is_none_or(|kv| kv.create_revision() != created))
    }

    fn forget(&self, owner: &OwnerId) {
        self.keys().forget(owner, false);
    }

    /// Deletes the owner's key (with its lock-delay marker, if `marker`) and forgets it;
    /// `None` if the owner has no key, else whether a key was deleted. See
    /// [`Keys::start_delete`] for why no compare is needed.
    async fn delete(&self, owner: &OwnerId, marker: bool, doing: &str) -> Result<Option<bool>> {
        let Some((placed, first)) = self.keys().start_delete(owner) else {
            return Ok(None);
        };
        let key = placed.key();
        let deleted = if marker {
            // A release is not a vanishing: the lock opens at once.
            let both = Txn::new().and_then([
                TxnOp::delete(key.as_str(), None),
                TxnOp::delete(placed.marker(), None),
            ]);
            let answer = self.kv().txn(both).await.map_err(|e| map_error(e, doing))?;
            matches!(answer.op_responses().first(), Some(TxnOpResponse::Delete(d)) if d.deleted() > 0)
        } else {
            let answer = self
                .kv()
                .delete(key, None)
                .await
                .map_err(|e| map_error(e, doing))?;
            answer.deleted() > 0
        };
        self.keys().finish_delete(owner, first);
        Ok(Some(deleted))
    }

    /// The grant of `placed`, whose key holds at create revision `revision`: recorded, with
    /// its lock-delay marker put first if the request has a lock-delay.
    async fn granted(
        &self,
        session: &Session,
        placed: &Placed,
        req: &Request,
        revision: i64,
    ) -> Result<Acquire> {
        self.keys().record(&req.owner, revision);
        if let Some(delay) = req.lock_delay {
            self.put_marker(session, placed, &req.owner, revision, delay)
                .await?;
        }
        Ok(Acquire::Granted(Grant::new(
            FencingToken::new(u64::try_from(revision).unwrap_or(0)),
            Expiry::Session(session.liveness()),
        )))
    }

    /// Puts the lock-delay marker of a grant, if its key is still the one granted; the
    /// grant is reported only after this, so no holder ever works without its marker.
    async fn put_marker(
        &self,
        session: &Session,
        placed: &Placed,
        owner: &OwnerId,
        revision: i64,
        delay: Duration,
    ) -> Result<()> {
        let lease = session.delay_lease(&self.inner.client, delay).await?;
        let mut value = MARKER.to_vec();
        value.extend_from_slice(owner.as_str().as_bytes());
        let put = Txn::new()
            .when([Compare::create_revision(
                placed.key(),
                CompareOp::Equal,
                revision,
            )])
            .and_then([TxnOp::put(
                placed.marker(),
                value,
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let answer = self
            .kv()
            .txn(put)
            .await
            .map_err(|e| map_error(e, "marking a grant for lock-delay"))?;
        if answer.succeeded() {
            Ok(())
        } else {
            // The key is gone: the session's lease ran out since the grant.
            self.forget(owner);
            Err(Error::Lost(LossReason::SessionEnded))
        }
    }
}

/// The end of the range of keys starting with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    end
}

#[async_trait]
impl Backend for EtcdBackend {
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new("etcd", TokenDurability::Consensus);
        caps.expiring_leases = true;
        caps.ttl_granularity = Duration::from_secs(1);
        caps.fair = true;
        caps.push_wakeups = true;
        caps.shared = true;
        caps.permits = true;
        // etcd grants whole seconds, rounded up (it may grant more: its minimum ttl).
        let asked = self.inner.options.session_ttl;
        caps.session_ttl = Some(Duration::from_secs(
            asked.as_secs() + u64::from(asked.subsec_nanos() > 0),
        ));
        // Markers bound to a lease that outlives the session's by the delay.
        caps.lock_delay = true;
        caps
    }

    async fn acquire(&self, req: &Request) -> Result<Acquire> {
        let session = self.session().await?;
        let dir = self.dir(&req.name, req.mode);
        let placed = self.keys().place(&req.owner, &dir, session.id);
        if placed.lease != session.id {
            // Queued under a session that has ended: the key went with it.
            self.forget(&req.owner);
            return Err(Error::Lost(LossReason::SessionEnded));
        }
        let key = placed.key();
        let queued = placed.revision.is_some();
        let read = TxnOp::get(dir.as_str(), Some(Self::sorted(&dir)));
        let put = || {
            TxnOp::put(
                key.as_str(),
                encode(req.mode, &req.owner, req.value.as_deref()),
                Some(PutOptions::new().with_lease(session.id)),
            )
        };
        // Nothing under the queue's directory: no holder, waiter or lock-delay marker.
        let empty = || {
            Compare::create_revision(dir.as_str(), CompareOp::Equal, 0).with_range(prefix_end(&dir))
        };
        let txn = if queued {
            // Woken: the key must still be there (and so its lease alive); never re-queue.
            Txn::new()
                .when([Compare::create_revision(
                    key.as_str(),
                    CompareOp::NotEqual,
                    0,
                )])
                .and_then([read])
        } else if !req.waiting && req.mode == Mode::Exclusive {
            // A try for the exclusive lock: put only if the queue is empty; one round trip
            // either way.
            Txn::new().when([empty()]).and_then([put()]).or_else([read])
        } else {
            // An empty queue is taken with a bare put (nothing to read back); otherwise the
            // key joins the queue and the queue is read. If the put of an unanswered
            // attempt already landed, putting the key again keeps its create revision
            // (its place in the queue), and its watchers ignore puts.
            Txn::new()
                .when([empty()])
                .and_then([put()])
                .or_else([put(), read])
        };
        let answer = self
            .kv()
            .txn(txn)
            .await
            .map_err(|e| map_error(e, "acquiring"))?;
        let revision = answer.header().map_or(0, |h| h.revision());
        if queued && !answer.succeeded() {
            // The key is gone: its lease expired (or someone deleted it) while we waited.
            self.forget(&req.owner);
            return Err(Error::Lost(LossReason::SessionEnded));
        }
        if !queued && answer.succeeded() {
            // The queue was empty and the transaction's one write put the key: it holds, and
            // was created at the transaction's revision.
            if revision <= 0 {
                // Retryable: the retry reads the queue and adopts the key put here.
                return Err(Error::backend(
                    "etcd: a granting transaction was answered without its revision",
                    true,
                ));
            }
            return self.granted(&session, &placed, req, revision).await;
        }
        let responses = answer.op_responses();
        let (queue, closed_by) = Self::queue_of(&responses);
        let from = header_revision(&responses, revision) + 1;
        let Some(me) = queue.iter().position(|e| e.owner == req.owner) else {
            // A try that found the queue occupied: nothing was written.
            self.forget(&req.owner);
            return Ok(Acquire::Busy(WaitHint::new(Hint {
                key: dir.into_bytes(),
                prefix: true,
                deletes_only: true,
                created: None,
                from,
            })));
        };
        let mine = &queue[me];
        if mine.lease != session.id || mine.key != key.as_bytes() {
            return Err(Error::backend(
                format!(
                    "etcd: the key of {} is not where this session put it",
                    req.name
                ),
                false,
            ));
        }
        let granted = holding(&queue)[me];
        if granted && closed_by.is_none() {
            return self.granted(&session, &placed, req, mine.revision).await;
        }
        if !req.waiting {
            // Not granted and not waiting: take the key out of the queue again.
            self.keys().record(&req.owner, mine.revision);
            self.delete(&req.owner, false, "withdrawing").await?;
            return Ok(Acquire::Busy(WaitHint::none()));
        }
        self.keys().record(&req.owner, mine.revision);
        let hint = match (in_the_way(&queue, me), closed_by) {
            // First in line, but a vanished holder's lock-delay is not over.
            (_, Some((marker, created))) if granted => Hint {
                key: marker,
                prefix: false,
                deletes_only: true,
                created: Some(created),
                from,
            },
            (Some(before), _) => Hint {
                key: before.key.clone(),
                prefix: false,
                deletes_only: true,
                created: Some(before.revision),
                from,
            },
            (None, _) => Hint {
                key: dir.into_bytes(),
                prefix: true,
                deletes_only: true,
                created: None,
                from,
            },
        };
        Ok(Acquire::Busy(WaitHint::new(hint)))
    }

    async fn renew(&self, req: &Request) -> Result<Renewal> {
        // Grants live by the session; this only says whether the key is still ours.
        let Some(placed) = self.keys().by_owner.get(&req.owner).cloned() else {
            return Ok(Renewal::Lost(LossReason::NotOwner));
        };
        let found = self
            .kv()
            .get(placed.key(), None)
            .await
            .map_err(|e| map_error(e, "checking a key"))?;
        let session = self.current_session().await;
        match (found.kvs().first(), session) {
            (Some(kv), Some(session))
                if kv.lease() == session.id
                    && session.is_alive()
                    && placed.revision == Some(kv.create_revision()) =>
            {
                Ok(Renewal::Renewed(Expiry::Session(session.liveness())))
            }
            _ => Ok(Renewal::Lost(LossReason::NotOwner)),
        }
    }

    async fn release(&self, req: &Request) -> Result<Release> {
        let deleted = self
            .delete(&req.owner, req.lock_delay.is_some(), "releasing")
            .await?;
        Ok(if deleted == Some(true) {
            Release::Released
        } else {
            Release::NotHeld
        })
    }

    async fn wait(&self, _name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        let Some(hint) = hint.get::<Hint>() else {
            return Ok(());
        };
        // The watch starts at the current revision, not at `hint.from`: etcd serves a watch
        // that starts in the past from a catch-up loop that runs every 100 ms, one that
        // starts now at once. What changed before the watch was in place is looked up once
        // it is: etcd fixes a new watch's start revision before it registers it, and a
        // write in between also leaves it to the catch-up loop.
        let mut options = WatchOptions::new();
        if hint.prefix {
            options = options.with_prefix();
        }
        if hint.deletes_only {
            options = options.with_filters([WatchFilterType::NoPut]);
        }
        let watched = async {
            let mut stream = self
                .client()
                .watch(hint.key.clone(), Some(options))
                .await
                .map_err(|e| map_error(e, "watching"))?;
            loop {
                match stream
                    .message()
                    .await
                    .map_err(|e| map_error(e, "watching"))?
                {
                    Some(answer) if answer.created() => {
                        let now = answer.header().map_or(i64::MAX, |h| h.revision());
                        if self.moved(hint, now).await? {
                            return Ok(());
                        }
                    }
                    Some(answer) if !answer.events().is_empty() || answer.canceled() => {
                        return Ok(());
                    }
                    Some(_) => {}
                    None => return Ok(()),
                }
            }
        };
        match tokio::time::timeout(max, watched).await {
            Ok(result) => result,
            Err(_) => Ok(()),
        }
    }

    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        let sets = [
            self.dir(name, Mode::Exclusive),
            self.dir(
                name,
                Mode::Permit {
                    limit: std::num::NonZeroU32::MIN,
                },
            ),
        ];
        let answer = self
            .kv()
            .txn(
                Txn::new().and_then(
                    sets.iter()
                        .map(|dir| TxnOp::get(dir.as_str(), Some(Self::sorted(dir))))
                        .collect::<Vec<_>>(),
                ),
            )
            .await
            .map_err(|e| map_error(e, "inspecting"))?;
        let revision = answer.header().map_or(0, |h| h.revision());
        let mut state = LockState::new(WaitHint::new(Hint {
            key: format!("{}/{name}/", self.inner.options.prefix).into_bytes(),
            prefix: true,
            deletes_only: false,
            created: None,
            from: revision + 1,
        }));
        let mut ttls: HashMap<i64, Option<Duration>> = HashMap::new();
        for response in answer.op_responses() {
            let TxnOpResponse::Get(get) = response else {
                continue;
            };
            let queue: Vec<Entry> = get.kvs().iter().filter_map(decode).collect();
            for (entry, holds) in queue.into_iter().zip(holding_owned(get.kvs())) {
                if holds {
                    if let std::collections::hash_map::Entry::Vacant(slot) = ttls.entry(entry.lease)
                    {
                        let left = self
                            .client()
                            .lease_time_to_live(entry.lease, None)
                            .await
                            .ok()
                            .and_then(|t| u64::try_from(t.ttl()).ok())
                            .map(Duration::from_secs);
                        slot.insert(left);
                    }
                    state.holders.push(
                        Holder::new(
                            entry.owner,
                            entry.mode,
                            FencingToken::new(u64::try_from(entry.revision).unwrap_or(0)),
                        )
                        .with_remaining(ttls.get(&entry.lease).copied().flatten())
                        .with_value(entry.value),
                    );
                } else {
                    state.waiters.push(Waiter::new(entry.owner, entry.mode));
                }
            }
        }
        Ok(state)
    }
}

/// [`holding`] of a raw key list.
fn holding_owned(kvs: &[KeyValue]) -> Vec<bool> {
    let queue: Vec<Entry> = kvs.iter().filter_map(decode).collect();
    holding(&queue)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_give_endpoints_and_options() {
        let (endpoints, options) =
            parse_url("etcd://u:pw@h1:2379,h2:2379?prefix=app&session_ttl=1500ms").unwrap();
        assert_eq!(endpoints, ["http://h1:2379", "http://h2:2379"]);
        assert_eq!(options.prefix, "app");
        assert_eq!(options.session_ttl, Duration::from_millis(1500));
        assert_eq!(options.user, Some(("u".into(), "pw".into())));
        for bad in [
            "etcd://",
            "etcd://h:1?nosuch=1",
            "etcd://h:1?session_ttl=500ms",
            "etcd://h:1?prefix=a/b",
            "etcd://h:1/path",
            "http://h:1",
        ] {
            assert!(
                matches!(parse_url(bad), Err(Error::InvalidArgument { .. })),
                "{bad}"
            );
        }
        assert!(
            !parse_url("etcd://u:hunter2@h:1?x=1")
                .unwrap_err()
                .to_string()
                .contains("hunter2")
        );
        assert!(!format!("{options:?}").contains("pw"), "{options:?}");
        let (endpoints, options) = parse_url("etcds://h1:2379,h2:2379").unwrap();
        assert_eq!(endpoints, ["https://h1:2379", "https://h2:2379"]);
        assert!(options.tls.is_empty(), "the system's CA certificates");
        let ca = std::env::temp_dir().join(format!("leasehold-etcd-ca-{}", std::process::id()));
        std::fs::write(&ca, "CA").unwrap();
        let (_, options) = parse_url(&format!("etcds://h:1?tls_ca={}", ca.display())).unwrap();
        assert_eq!(options.tls.ca.as_deref(), Some(&b"CA"[..]));
        let plain = parse_url(&format!("etcd://h:1?tls_ca={}", ca.display())).unwrap_err();
        assert!(plain.to_string().contains("etcds://"), "{plain}");
        std::fs::remove_file(&ca).unwrap();
    }

    #[tokio::test]
    async fn endpoints_and_tls_files_are_checked_before_connecting() {
        let channel = |endpoints: &[&str], tls: &TlsFiles| {
            let endpoints: Vec<String> = endpoints.iter().map(|e| (*e).to_owned()).collect();
            transport::channel(&endpoints, tls, Duration::from_secs(1), KEEP_ALIVE)
        };
        let none = TlsFiles::default();
        assert!(channel(&["http://h:1", "http://h:2"], &none).is_ok());
        assert!(channel(&["https://h:1", "https://[::1]:2"], &none).is_ok());
        for bad in [
            &["http://h:1", "https://h:2"][..],
            &["http://h"],
            &["https://h:port"],
            &["ftp://h:1"],
            &[],
        ] {
            assert!(
                matches!(channel(bad, &none), Err(Error::InvalidArgument { .. })),
                "{bad:?}"
            );
        }
        let ca = |pem: &str| {
            let mut files = TlsFiles::default();
            files.ca = Some(pem.as_bytes().to_vec());
            files
        };
        for pem in ["not a certificate", ""] {
            match channel(&["https://h:1"], &ca(pem)) {
                Err(Error::InvalidArgument { what, .. }) => assert_eq!(what, "tls_ca"),
                other => panic!("{pem:?}: {other:?}"),
            }
        }
        assert!(
            matches!(
                channel(&["http://h:1"], &ca("x")),
                Err(Error::InvalidArgument { .. })
            ),
            "TLS files for plain endpoints"
        );
    }

    fn entry(mode: Mode, n: i64) -> Entry {
        Entry {
            owner: OwnerId::parse(&format!("o{n}")).unwrap(),
            mode,
            value: None,
            revision: n,
            lease: 1,
            key: format!("k{n}").into_bytes(),
        }
    }

    #[test]
    fn who_holds_a_queue() {
        let x = Mode::Exclusive;
        let s = Mode::Shared;
        let q = [entry(s, 1), entry(s, 2), entry(x, 3), entry(s, 4)];
        assert_eq!(holding(&q), [true, true, false, false]);
        // The writer waits for the reader before it; the late reader for the writer.
        assert_eq!(in_the_way(&q, 2).unwrap().key, b"k2");
        assert_eq!(in_the_way(&q, 3).unwrap().key, b"k3");
        assert!(in_the_way(&q, 0).is_none());
        let p = Mode::Permit {
            limit: std::num::NonZeroU32::new(2).unwrap(),
        };
        assert_eq!(
            holding(&[entry(p, 1), entry(p, 2), entry(p, 3)]),
            [true, true, false]
        );
    }

    #[test]
    fn values_round_trip() {
        let owner = OwnerId::parse("o1").unwrap();
        let limit = std::num::NonZeroU32::new(3).unwrap();
        for (mode, value) in [
            (Mode::Exclusive, Some(&b"10.0.0.7:80\nmore"[..])),
            (Mode::Shared, None),
            (Mode::Permit { limit }, Some(&b"v"[..])),
        ] {
            let (m, o, v) = decode_value(&encode(mode, &owner, value)).unwrap();
            assert_eq!((m, &o, v.as_deref()), (mode, &owner, value));
        }
        assert!(decode_value(b"q o1\n").is_none());
        assert!(decode_value(b"x o1").is_none());
        assert_eq!(prefix_end("a/b/"), b"a/b0".to_vec());
    }

    #[test]
    fn slots_are_reused_unless_retired() {
        let mut keys = Keys::default();
        let [a, b, c, d] = ["a", "b", "c", "d"].map(|o| OwnerId::parse(o).unwrap());
        assert_eq!(keys.place(&a, "p/n/lock/", 7).key(), "p/n/lock/7.0");
        assert_eq!(keys.place(&b, "p/n/lock/", 7).slot, 1);
        // Placing again is idempotent; other sessions and directories count apart.
        assert_eq!(keys.place(&a, "p/n/lock/", 7).slot, 0);
        assert_eq!(keys.place(&c, "p/n/lock/", 8).slot, 0);
        keys.forget(&a, false);
        assert_eq!(keys.place(&d, "p/n/lock/", 7).slot, 0);
        keys.forget(&b, true);
        keys.forget(&d, false);
        assert_eq!(keys.place(&a, "p/n/lock/", 7).slot, 0);
        assert_eq!(keys.place(&d, "p/n/lock/", 7).slot, 2);
    }

    #[test]
    fn a_slot_is_reused_only_after_the_one_delete_of_its_key_was_answered() {
        let mut keys = Keys::default();
        let [a, b, c, d] = ["a", "b", "c", "d"].map(|o| OwnerId::parse(o).unwrap());
        let dir = "p/n/lock/";
        assert_eq!(keys.place(&a, dir, 7).slot, 0);
        keys.record(&a, 10);
        let (_, first) = keys.start_delete(&a).unwrap();
        assert!(first);
        keys.finish_delete(&a, first);
        assert!(keys.start_delete(&a).is_none(), "forgotten");
        // Answered at the first try: the slot is free again.
        assert_eq!(keys.place(&b, dir, 7).slot, 0);
        keys.record(&b, 11);
        // b's first delete went unanswered (failed, timed out, dropped): a second one is
        // sent and answered, but the first may still land later — slot 0 is retired.
        assert!(keys.start_delete(&b).unwrap().1);
        let (_, first) = keys.start_delete(&b).unwrap();
        assert!(!first);
        keys.finish_delete(&b, first);
        assert_eq!(keys.place(&c, dir, 7).slot, 1);
        // A key whose creation went unanswered: a put may still land in its slot.
        let (_, first) = keys.start_delete(&c).unwrap();
        keys.finish_delete(&c, first);
        assert_eq!(keys.place(&d, dir, 7).slot, 2);
    }
}
