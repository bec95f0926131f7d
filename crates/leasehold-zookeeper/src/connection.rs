//! The backend value: the connection to the ensemble, and the session in use.
//! A session is opened when there is none or the last one ended, and its epoch is checked.
//! The value also keeps the entries it has placed. Its
//! [`Backend`](leasehold_core::Backend) methods are in `backend.rs`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use leasehold_core::{ConnectOptions, Error, Result};
use tokio::sync::Mutex as AsyncMutex;

use crate::grants::GrantWatch;
use crate::layout::Layout;
use crate::markers::{self, Marker};
use crate::options::{Target, ZooKeeperOptions, parse_url};
use crate::registry::Registry;
use crate::session::Session;

/// A client's connection to a ZooKeeper ensemble: one session for all its locks.
/// Clones share the session.
#[derive(Debug, Clone)]
pub struct ZooKeeperBackend {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    target: Arc<Target>,
    pub(crate) options: Arc<ZooKeeperOptions>,
    pub(crate) layout: Layout,
    /// The session in use.
    session: Mutex<Option<Arc<Session>>>,
    /// Held while a session is being opened.
    opening: AsyncMutex<()>,
    /// Held while a change feed adds or drops its watch (see `changes`).
    pub(crate) watching: AsyncMutex<()>,
    /// The node of each acquisition in progress or held.
    registry: Mutex<Registry>,
    /// The epoch the first session found.
    /// A later session finding another one means the ensemble lost its data.
    epoch: OnceLock<String>,
    /// The negotiated session timeout, in milliseconds.
    timeout_ms: AtomicU64,
    /// Node events that woke a waiter.
    pub(crate) watch_events: AtomicU64,
    /// The last name whose records a write swept besides its own (see `records`).
    pub(crate) swept: Mutex<Option<String>>,
    /// The watches of this client's grants (see `grants`).
    pub(crate) grants: GrantWatch,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZooKeeperBackend")
            .field("servers", &self.target.hosts)
            .field("chroot", &self.target.chroot)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl ZooKeeperBackend {
    /// Connects to the ensemble at `url` and opens the session (see the crate docs).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the connection attempt; a session opened meanwhile is
    /// closed.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a malformed URL (the password redacted);
    /// [`Error::Unavailable`] if no server answers within the connect timeout;
    /// [`Error::Backend`] if the chroot or the prefix node cannot be created (an ACL).
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_url(url, &ConnectOptions::default()).await
    }

    /// Connects to the ensemble at `url`, with the session ttl `connect` asks for.
    /// That ttl is the session timeout asked of the server; a URL that sets another is
    /// refused.
    ///
    /// # Cancel safety
    ///
    /// As for [`connect`](ZooKeeperBackend::connect).
    ///
    /// # Errors
    ///
    /// As for [`connect`](ZooKeeperBackend::connect).
    pub async fn connect_url(url: &str, connect: &ConnectOptions) -> Result<Self> {
        let (target, options) = parse_url(url, connect)?;
        Self::open(target, options).await
    }

    /// Connects to `servers` (`host:port` each) with `options`, under `chroot` if given.
    /// The chroot is created if missing.
    ///
    /// # Cancel safety
    ///
    /// As for [`connect`](ZooKeeperBackend::connect).
    ///
    /// # Errors
    ///
    /// As for [`connect`](ZooKeeperBackend::connect).
    pub async fn connect_with(
        servers: &[&str],
        chroot: Option<&str>,
        options: ZooKeeperOptions,
    ) -> Result<Self> {
        let mut url = format!("zk://{}", servers.join(","));
        if let Some(chroot) = chroot {
            url.push_str(chroot);
        }
        let (target, _) = parse_url(&url, &ConnectOptions::default())?;
        Self::open(target, options).await
    }

    async fn open(target: Target, options: ZooKeeperOptions) -> Result<Self> {
        let layout = Layout::new(&options.prefix);
        let backend = Self {
            inner: Arc::new(Inner {
                target: Arc::new(target),
                options: Arc::new(options),
                layout,
                session: Mutex::new(None),
                opening: AsyncMutex::new(()),
                watching: AsyncMutex::new(()),
                registry: Mutex::new(Registry::default()),
                epoch: OnceLock::new(),
                timeout_ms: AtomicU64::new(0),
                watch_events: AtomicU64::new(0),
                swept: Mutex::new(None),
                grants: GrantWatch::default(),
            }),
        };
        backend.session().await?;
        Ok(backend)
    }

    /// The negotiated session timeout, which is every grant's lease length.
    /// The server may narrow the one asked for to its own bounds.
    pub fn session_timeout(&self) -> Duration {
        let negotiated = self.inner.timeout_ms.load(Ordering::Relaxed);
        if negotiated == 0 {
            self.inner.options.session_timeout
        } else {
            Duration::from_millis(negotiated)
        }
    }

    /// ZooKeeper's id of the current session (the `ephemeralOwner` of its nodes), if one is open.
    pub fn session_id(&self) -> Option<i64> {
        self.current().map(|s| s.id)
    }

    /// How many node events have woken a waiter of this backend so far.
    /// Each is the deletion or change of the one node a waiter watched: a diagnostic of
    /// hand-offs.
    pub fn watch_events(&self) -> u64 {
        self.inner.watch_events.load(Ordering::Relaxed)
    }

    /// Closes this client's session, freeing every lock, permit and candidacy it holds.
    /// They are freed at once (no lock-delay follows a close), its waiters give up their
    /// places, and its guards are lost
    /// ([`LossReason::SessionEnded`](leasehold_core::LossReason::SessionEnded)). A later
    /// acquisition opens a new session.
    ///
    /// # Cancel safety
    ///
    /// The session ends here at once; if the future is dropped the close may not reach the
    /// server, and the session then expires after its timeout.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] if the server did not confirm the close in time (the session
    /// then expires on its own).
    pub async fn close(&self) -> Result<()> {
        let _opening = self.inner.opening.lock().await;
        let Some(session) = self.slot().take() else {
            return Ok(());
        };
        let markers = self.registry().forget_session(session.id);
        // A close is a release: the lock-delay markers go too.
        markers::delete(&session, markers).await;
        session.close().await
    }

    /// Ends the session `id` if it is still in use, and closes it.
    /// Every guard on it is lost, and its nodes go. A release that could not be confirmed
    /// is still a release: no lock-delay follows it (`marker`, the lock-delay marker of an
    /// acquisition forgotten already), nor the others closed with it (as for `close`).
    /// Markers that cannot be deleted now go when their sessions expire: no later than
    /// after a crash.
    ///
    /// It returns once the server has closed the session (its nodes are gone), or after
    /// the session's timeout, when the server has expired it anyway.
    ///
    /// # Cancel safety
    ///
    /// The close runs in a task of its own: dropping the future does not stop it.
    pub(crate) async fn end_session(&self, id: i64, marker: Option<Marker>) {
        let (taken, markers) = {
            let _opening = self.inner.opening.lock().await;
            let Some(taken) = self.slot().take_if(|s| s.id == id) else {
                return;
            };
            let mut markers = self.registry().forget_session(taken.id);
            markers.extend(marker);
            (taken, markers)
        };
        let timeout = taken.timeout;
        let closing = tokio::spawn(async move {
            markers::delete(&taken, markers).await;
            if let Err(error) = taken.close().await {
                tracing::warn!(%error, "zookeeper: closing an abandoned session");
            }
        });
        // Whoever waits for the abandoned release (a settle) finds the lock free after.
        let _ = tokio::time::timeout(timeout, closing).await;
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Arc<Session>>> {
        self.inner.session.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The entries this backend has placed.
    pub(crate) fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.inner
            .registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The session in use, if any (without opening one).
    pub(crate) fn current(&self) -> Option<Arc<Session>> {
        self.slot().clone()
    }

    /// The live session, opened now if there is none or the last one ended.
    pub(crate) async fn session(&self) -> Result<Arc<Session>> {
        let live = || self.current().filter(|s| s.is_alive());
        if let Some(session) = live() {
            return self.unwiped(session);
        }
        let _opening = self.inner.opening.lock().await;
        if let Some(session) = live() {
            return self.unwiped(session);
        }
        if let Some(old) = self.slot().take() {
            // Ended here: closed when its last user lets go (its nodes go at once), unless
            // the server expired it already. Its lock-delay sessions expire on their own.
            old.end();
        }
        let inner = Arc::downgrade(&self.inner);
        let on_end = move |id: i64| {
            // Let go of the ended session: it closes once its last user is done.
            if let Some(inner) = inner.upgrade() {
                let taken = inner
                    .session
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take_if(|s| s.id == id);
                drop(taken);
            }
        };
        let session = Session::open(
            self.inner.target.clone(),
            self.inner.options.clone(),
            self.inner.layout.root(),
            on_end,
        )
        .await?;
        let session = Arc::new(session);
        let first = self.inner.epoch.get_or_init(|| session.epoch.clone());
        if *first != session.epoch {
            tracing::error!(before = %first, now = %session.epoch, "zookeeper: the epoch node changed: the ensemble lost its data");
        }
        let ms = u64::try_from(session.timeout.as_millis()).unwrap_or(u64::MAX);
        self.inner.timeout_ms.store(ms, Ordering::Relaxed);
        *self.slot() = Some(session.clone());
        self.unwiped(session)
    }

    /// `session`, unless the epoch it found is not the first session's.
    fn unwiped(&self, session: Arc<Session>) -> Result<Arc<Session>> {
        if self
            .inner
            .epoch
            .get()
            .is_some_and(|first| *first != session.epoch)
        {
            return Err(Error::backend(
                format!(
                    "zookeeper: {} was created anew since this client connected: the ensemble \
                     lost its data, and fencing tokens (czxids) started again from lower \
                     values; refusing to grant (a new client accepts the new epoch)",
                    self.inner.layout.root()
                ),
                false,
            ));
        }
        Ok(session)
    }
}
