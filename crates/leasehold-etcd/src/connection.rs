//! The backend value: one connection to the cluster, and the session it owns.
//! It also keeps the entries it has placed. Its [`Backend`](leasehold_core::Backend)
//! methods are in `backend.rs`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold_core::backend::Mode;
use leasehold_core::{Error, Guard, LockName, Result};
use tokio::sync::Mutex as AsyncMutex;

use crate::error::map_error;
use crate::grants::GrantWatch;
use crate::layout::{Layout, Set};
use crate::options::{EtcdOptions, parse_url};
use crate::registry::Registry;
use crate::requests;
use crate::rpc::{RequestOp, Rpc};
use crate::session::Session;
use crate::transport::{self, KeepAlive};

/// The HTTP/2 pings that tell a paused member from a quiet one.
/// How often a connection with open streams is pinged, and how long a ping may go
/// unanswered before the connection is given up for the next member.
///
/// etcd counts a ping less than 5 s after the previous one as abuse (its
/// `--grpc-keepalive-min-time`), and after three it closes the connection with
/// `too_many_pings` — every session on it suspended, every watch broken. So pings go every
/// 6 s, and only while streams are open (without one, etcd counts every ping).
pub(crate) const KEEP_ALIVE: KeepAlive = KeepAlive {
    every: Duration::from_secs(6),
    timeout: Duration::from_secs(2),
};

/// The condition of a write fenced by a guard: `key` exists, created at `create_revision`.
/// See [`EtcdBackend::still_owner`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StillOwner {
    /// The lock's key.
    pub key: Vec<u8>,
    /// The revision that created it: the guard's fencing token.
    pub create_revision: i64,
}

impl StillOwner {
    /// Counts one refusal of this condition in `leasehold_fence_refusals_total{fence="etcd"}`.
    /// For a transaction of the caller's that carried the comparison and failed on it.
    pub fn count_refusal(&self) {
        leasehold_core::telemetry::fence_refused("etcd");
    }
}

/// A client's connection to an etcd cluster. Clones share the connection and the session.
#[derive(Debug, Clone)]
pub struct EtcdBackend {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) rpc: Rpc,
    pub(crate) options: EtcdOptions,
    pub(crate) layout: Layout,
    session: AsyncMutex<Option<Arc<Session>>>,
    registry: Mutex<Registry>,
    /// The watches of this client's grants (see `grants.rs`).
    pub(crate) grants: GrantWatch,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
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
        Self::connect_url(url, &leasehold_core::ConnectOptions::default()).await
    }

    /// Connects to the cluster at `url`, with the session ttl `connect` asks for.
    /// A URL that sets another is refused.
    ///
    /// # Cancel safety
    ///
    /// As for [`connect`](EtcdBackend::connect).
    ///
    /// # Errors
    ///
    /// As for [`connect`](EtcdBackend::connect).
    pub async fn connect_url(url: &str, connect: &leasehold_core::ConnectOptions) -> Result<Self> {
        let (endpoints, options) = parse_url(url, connect)?;
        Self::connect_with(&endpoints, options).await
    }

    /// Connects to `endpoints`, each `http://host:port` (or `https://host:port` for TLS).
    /// There is one connection at a time: to the first member, then to the next whenever it
    /// must connect again (the member went away or left a keep-alive ping unanswered for
    /// 2 s; pings go every 6 s while requests, watches or a session are open).
    ///
    /// # Cancel safety
    ///
    /// As for [`connect`](EtcdBackend::connect).
    ///
    /// # Errors
    ///
    /// As for [`connect`](EtcdBackend::connect).
    pub async fn connect_with(endpoints: &[String], options: EtcdOptions) -> Result<Self> {
        options.check()?;
        let channel =
            transport::channel(endpoints, &options.tls, options.connect_timeout, KEEP_ALIVE)?;
        // The channel connects on first use: a status request makes the first use here, so
        // that an unreachable cluster or a refused certificate is reported by `connect`.
        let user = options
            .user
            .as_ref()
            .map(|(user, password)| (user.as_str(), password.expose()));
        let rpc = tokio::time::timeout(options.connect_timeout, async {
            let rpc = Rpc::connect(channel, user).await?;
            rpc.status().await?;
            Ok(rpc)
        })
        .await
        .map_err(|_| {
            Error::unavailable(format!(
                "connecting to etcd at {} timed out",
                endpoints.join(",")
            ))
        })?
        .map_err(|e| map_error(e, "connecting"))?;
        let layout = Layout::new(&options.prefix);
        Ok(Self {
            inner: Arc::new(Inner {
                grants: GrantWatch::new(rpc.clone(), layout.clone()),
                rpc,
                layout,
                options,
                session: AsyncMutex::new(None),
                registry: Mutex::new(Registry::default()),
            }),
        })
    }

    /// The connection, for one request.
    pub(crate) fn rpc(&self) -> &Rpc {
        &self.inner.rpc
    }

    /// The directories of `name`'s set for `mode`.
    pub(crate) fn set(&self, name: &LockName, mode: Mode) -> Set {
        self.inner.layout.set(name, mode)
    }

    /// The live session, started now if there is none or the last one ended.
    pub(crate) async fn session(&self) -> Result<Arc<Session>> {
        let mut current = self.inner.session.lock().await;
        if let Some(session) = current.as_ref()
            && session.is_alive()
        {
            return Ok(session.clone());
        }
        let options = &self.inner.options;
        let session = Session::start(
            &self.inner.rpc,
            options.session_ttl,
            options.drift_margin,
            &self.inner.layout,
        )
        .await?;
        let session = Arc::new(session);
        *current = Some(session.clone());
        Ok(session)
    }

    /// The session in use, if any (without starting one).
    pub(crate) async fn current_session(&self) -> Option<Arc<Session>> {
        self.inner.session.lock().await.clone()
    }

    /// Ends this client's session and revokes its lease, freeing all its locks at once.
    /// Its guards are lost. A later acquisition starts a new session. Grants kept after
    /// their holder let go ([`Guard::keep_for`]) live on a lease of their own, and stay
    /// until it runs out.
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
            Some(session) => session.close(&self.inner.rpc).await,
            None => Ok(()),
        }
    }

    /// Ends and revokes the session with lease `lease`, if it is current and still alive.
    /// Its guards are lost. One that has ended already is left to run out, so that its
    /// lock-delay markers keep their delay.
    ///
    /// # Errors
    ///
    /// If the revocation does not reach etcd: the lease is no longer kept alive, and
    /// expires within one session ttl.
    pub(crate) async fn end_session(&self, lease: i64) -> Result<()> {
        let session = {
            let mut current = self.inner.session.lock().await;
            if current
                .as_ref()
                .is_some_and(|s| s.id == lease && s.is_alive())
            {
                current.take()
            } else {
                None
            }
        };
        match session {
            Some(session) => {
                let revoked = tokio::time::timeout(
                    self.inner.options.connect_timeout,
                    session.close(&self.inner.rpc),
                )
                .await;
                match revoked {
                    Ok(revoked) => revoked,
                    Err(_) => Err(Error::unavailable(
                        "etcd: revoking an abandoned session timed out; its lease runs out \
                         within one session ttl",
                    )),
                }
            }
            None => Ok(()),
        }
    }

    /// The ttl of the current session as etcd granted it, if a session has started.
    /// That is the configured one rounded up to whole seconds.
    ///
    /// # Cancel safety
    ///
    /// Sends nothing to etcd.
    ///
    /// # Errors
    ///
    /// None: it reads what the session was granted.
    pub async fn session_ttl(&self) -> Option<Duration> {
        self.current_session().await.map(|s| s.ttl)
    }

    /// Stops keeping this client's session alive, without revoking it.
    /// Its locks stay held until the lease runs out (and its guards are lost then).
    ///
    /// # Cancel safety
    ///
    /// Sends nothing to etcd; dropped before it ran, the session is kept alive as before.
    ///
    /// # Errors
    ///
    /// None.
    pub async fn orphan(&self) {
        if let Some(session) = self.inner.session.lock().await.take() {
            session.orphan().await;
        }
    }

    /// The comparison that holds while `guard`'s lock is still held.
    /// Put it in your own etcd transaction so that a write happens only while the lock is
    /// held: the lock's key must exist with the create revision of the grant. With the
    /// etcd-client crate that is
    /// `Compare::create_revision(c.key, CompareOp::Equal, c.create_revision)`; with
    /// `etcdctl txn`, `create("<key>") = "<create_revision>"`.
    pub fn still_owner(&self, guard: &Guard) -> StillOwner {
        // A released guard compares its queue directory, a key that never exists.
        let key = self
            .registry()
            .get(guard.owner())
            .map_or_else(|| self.set(guard.name(), guard.mode()).dir, |p| p.key());
        StillOwner {
            key: key.into_bytes(),
            create_revision: i64::try_from(guard.token().get()).unwrap_or(i64::MAX),
        }
    }

    /// Puts `key` = `value`, only while `guard` holds its lock: one transaction.
    /// `Ok(true)`: written. `Ok(false)`: refused, the lock's key gone or created by a later
    /// grant; counted in `leasehold_fence_refusals_total{fence="etcd"}`. A transaction of
    /// your own with [`still_owner`](Self::still_owner)'s comparison counts nothing by
    /// itself (count its refusals with [`StillOwner::count_refusal`]).
    ///
    /// # Cancel safety
    ///
    /// One transaction: dropped, it was applied whole or not at all, and which is unknown.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a key among the lock's own (`<name>/…`, `<name>#…`,
    /// under the prefix: etcd would count it as a contender, and the lock would stay busy)
    /// or leasehold's (`#…` under the prefix). A key that falls into another lock's
    /// directory is not refused; keep data apart with a prefix for the locks. An answer
    /// that did not arrive (`Unavailable`, `Timeout`) leaves whether it was written unknown.
    /// Backend errors; [`Error::Unavailable`] while no member answers. It has no timeout of
    /// its own beyond the connection's pings: wrap it in one for a deadline.
    pub async fn put_if_owner(
        &self,
        guard: &Guard,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
    ) -> Result<bool> {
        let key = key.into();
        self.outside_the_lock(guard, &key)?;
        self.write_if_owner(guard, requests::put(key, value.into(), 0))
            .await
    }

    /// Deletes `key`, only while `guard` holds its lock.
    /// It answers as [`put_if_owner`](Self::put_if_owner) does.
    ///
    /// # Cancel safety
    ///
    /// One transaction: dropped, it was applied whole or not at all, and which is unknown.
    ///
    /// # Errors
    ///
    /// As [`put_if_owner`](Self::put_if_owner).
    pub async fn delete_if_owner(&self, guard: &Guard, key: impl Into<Vec<u8>>) -> Result<bool> {
        let key = key.into();
        self.outside_the_lock(guard, &key)?;
        self.write_if_owner(guard, requests::delete(key)).await
    }

    /// Refuses `key` if it is one of `guard`'s own lock's keys or one of leasehold's own.
    /// The lock's are `N/…` and `N#…`; leasehold's are sessions, records and evictions under
    /// `#`. A key in the lock's directory counts as a contender there, as in etcd's own lock
    /// recipe: it would keep the lock from everyone until deleted.
    fn outside_the_lock(&self, guard: &Guard, key: &[u8]) -> Result<()> {
        let dir = self.set(guard.name(), Mode::Exclusive).dir;
        let own = dir.strip_suffix('/').unwrap_or(&dir);
        let root = &own[..own.len() - guard.name().as_str().len()];
        let in_lock = key
            .strip_prefix(own.as_bytes())
            .is_some_and(|rest| rest.first().is_some_and(|c| *c == b'/' || *c == b'#'));
        let reserved = key
            .strip_prefix(root.as_bytes())
            .is_some_and(|rest| rest.first() == Some(&b'#'));
        if in_lock || reserved {
            return Err(Error::invalid(
                "key",
                format!(
                    "{:?} is one of leasehold's keys (under {root:?}#) or of the lock {:?} \
                     (its directory {dir:?}, where a key counts as a contender and keeps the \
                     lock from everyone)",
                    String::from_utf8_lossy(key),
                    guard.name().as_str()
                ),
            ));
        }
        Ok(())
    }

    /// `write` in a transaction that runs it only if `guard`'s lock key is its grant's.
    async fn write_if_owner(&self, guard: &Guard, write: RequestOp) -> Result<bool> {
        let fence = self.still_owner(guard);
        let txn = requests::fenced(fence.key.clone(), fence.create_revision, write);
        let answer = self
            .rpc()
            .txn(txn)
            .await
            .map_err(|e| map_error(e, "a fenced write"))?;
        if !answer.succeeded {
            fence.count_refusal();
        }
        Ok(answer.succeeded)
    }

    /// The entries this backend has placed.
    pub(crate) fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.inner
            .registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}
