//! The backend: the trait's operations as ZooKeeper requests.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::{join_all, select_all};
use leasehold_core::backend::{
    Acquire, Backend, Capabilities, Expiry, Grant, Holder, LockState, Mode, Release, Renewal,
    Request, SessionLiveness, TokenDurability, WaitHint, Waiter,
};
use leasehold_core::{ConnectOptions, Error, FencingToken, LockName, LossReason, OwnerId, Result};
use tokio::sync::Mutex as AsyncMutex;
use zookeeper_client as zk;

use crate::error::map;
use crate::layout::{self, Contender, Layout};
use crate::options::{Target, ZooKeeperOptions, parse_url};
use crate::session::{Session, acls};

/// A client's connection to a ZooKeeper ensemble: one session for all its locks.
/// Clones share the session.
#[derive(Debug, Clone)]
pub struct ZooKeeperBackend {
    inner: Arc<Inner>,
}

struct Inner {
    target: Arc<Target>,
    options: Arc<ZooKeeperOptions>,
    layout: Layout,
    /// The session in use.
    session: Mutex<Option<Arc<Session>>>,
    /// Held while a session is being opened.
    opening: AsyncMutex<()>,
    /// The node of each acquisition in progress or held.
    owners: Mutex<HashMap<OwnerId, Placed>>,
    /// The epoch the first session found.
    /// A later session finding another one means the ensemble lost its data.
    epoch: Mutex<Option<String>>,
    wiped: AtomicBool,
    /// The negotiated session timeout, in milliseconds.
    timeout_ms: AtomicU64,
    /// Node events that woke a waiter.
    watch_events: AtomicU64,
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

/// One acquisition's node.
#[derive(Debug, Clone)]
struct Placed {
    /// The session it was created under.
    session: i64,
    /// Its directory.
    dir: String,
    /// Its name in the directory, once a create was answered (or the node found).
    node: Option<String>,
    /// Its czxid: the grant's token.
    czxid: i64,
    /// Its data version.
    version: i32,
    /// A create went out whose answer never came: a node named after the owner may exist.
    unsure: bool,
    /// It was answered busy at least once.
    waited: bool,
    /// Its lock-delay marker, recorded before its create goes out.
    /// From then on it may exist until a release deletes it.
    marker: Option<Marker>,
    /// The one node in its way was deleted, and nothing else can be (see `layout::sole_blocker`).
    /// It holds, without listing the directory again.
    woken: bool,
}

/// A grant's lock-delay marker.
#[derive(Debug, Clone)]
struct Marker {
    /// Its path.
    path: String,
    /// The lock-delay whose session owns it.
    delay: Duration,
    /// That session's id.
    session: i64,
    /// Its create was answered (or found it there).
    created: bool,
}

impl Placed {
    fn path(&self) -> Option<String> {
        self.node
            .as_ref()
            .map(|node| format!("{}/{node}", self.dir))
    }
}

/// What a busy acquisition (or an inspect) hands to `wait`.
#[derive(Debug)]
struct Hint {
    /// The session whose watches these are.
    session: i64,
    /// The waiting acquisition whose only blocker is the one node watched.
    /// See `layout::sole_blocker`: its deletion grants it.
    sole: Option<OwnerId>,
    /// Nodes whose deletion (or change) may matter.
    nodes: Vec<Watched>,
    /// A directory whose children may matter (an observer of a lock without holders).
    children: Option<String>,
}

/// A node a waiter watches.
#[derive(Debug)]
struct Watched {
    path: String,
    /// The node was a permit waiter of ours when the directory was listed.
    /// So its data version was 0 then: it is touched (its version moves) once it is
    /// granted, which may happen before the watch is set.
    untouched: bool,
}

impl Watched {
    fn deletion(path: String) -> Self {
        Self {
            path,
            untouched: false,
        }
    }
}

/// How many times a create is retried when its directory vanishes before it.
/// The directory vanishes between the mkdir and the create when ZooKeeper deletes an empty
/// container node.
const CREATE_ATTEMPTS: usize = 5;

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

    /// Connects to the ensemble at `url`, asking for the session timeout `connect` sets as
    /// its session ttl (a URL that sets another is refused).
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

    /// Connects to `servers` (`host:port` each), under `chroot` if given (created if missing).
    /// It uses `options`.
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
                owners: Mutex::new(HashMap::new()),
                epoch: Mutex::new(None),
                wiped: AtomicBool::new(false),
                timeout_ms: AtomicU64::new(0),
                watch_events: AtomicU64::new(0),
            }),
        };
        backend.session().await?;
        Ok(backend)
    }

    /// The negotiated session timeout: every grant's lease length.
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

    /// How many node events have woken a waiter of this backend so far: a diagnostic of hand-offs.
    /// Each is the deletion or change of the one node a waiter watched.
    pub fn watch_events(&self) -> u64 {
        self.inner.watch_events.load(Ordering::Relaxed)
    }

    /// Closes this client's session.
    /// Every lock, permit and candidacy it holds is freed at once (no lock-delay follows a
    /// close), its waiters give up their places, and its guards are lost
    /// ([`LossReason::SessionEnded`]). A later acquisition opens a new session.
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
        let markers = self.forget_session(session.id);
        // A close is a release: the lock-delay markers go too.
        delete_markers(&session, markers).await;
        session.close().await
    }

    /// Forgets every acquisition placed under the session `id`; returns their lock-delay markers.
    fn forget_session(&self, id: i64) -> Vec<Marker> {
        let mut owners = self.owners();
        let markers = owners
            .values()
            .filter(|p| p.session == id)
            .filter_map(|p| p.marker.clone())
            .collect();
        owners.retain(|_, p| p.session != id);
        markers
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Arc<Session>>> {
        self.inner.session.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn owners(&self) -> std::sync::MutexGuard<'_, HashMap<OwnerId, Placed>> {
        self.inner.owners.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn current(&self) -> Option<Arc<Session>> {
        self.slot().clone()
    }

    /// The live session, opened now if there is none or the last one ended.
    async fn session(&self) -> Result<Arc<Session>> {
        if let Some(session) = self.current()
            && session.is_alive()
        {
            return self.unwiped(session);
        }
        let _opening = self.inner.opening.lock().await;
        if let Some(session) = self.current()
            && session.is_alive()
        {
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
        let (session, epoch) = Session::open(
            self.inner.target.clone(),
            self.inner.options.clone(),
            self.inner.layout.root(),
            on_end,
        )
        .await?;
        let session = Arc::new(session);
        {
            let mut known = self.inner.epoch.lock().unwrap_or_else(|e| e.into_inner());
            match known.as_deref() {
                None => *known = Some(epoch),
                Some(before) if before == epoch => {}
                Some(before) => {
                    tracing::error!(before, now = %epoch, "zookeeper: the epoch node changed: the ensemble lost its data");
                    self.inner.wiped.store(true, Ordering::SeqCst);
                }
            }
        }
        let ms = u64::try_from(session.timeout.as_millis()).unwrap_or(u64::MAX);
        self.inner.timeout_ms.store(ms, Ordering::Relaxed);
        *self.slot() = Some(session.clone());
        self.unwiped(session)
    }

    fn unwiped(&self, session: Arc<Session>) -> Result<Arc<Session>> {
        if self.inner.wiped.load(Ordering::SeqCst) {
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

    fn create_options(&self, mode: zk::CreateMode) -> zk::CreateOptions<'static> {
        mode.with_acls(acls(self.inner.options.digest.is_some()))
    }

    /// Creates the directory `dir` and any missing parent.
    /// It is a container node: the server deletes it once empty.
    async fn make_dir(&self, client: &zk::Client, dir: &str) -> Result<()> {
        client
            .mkdir(dir, &self.create_options(zk::CreateMode::Container))
            .await
            .map_err(|e| map(e, &format!("creating {dir}")))
    }

    /// Creates my node in `dir` and lists `dir`, back to back.
    /// It records the node as the owner's as soon as the create is answered (even if the
    /// listing is refused), and returns its name and the listing.
    async fn create_and_list(
        &self,
        client: &zk::Client,
        req: &Request,
        dir: &str,
    ) -> Result<(String, Vec<String>)> {
        let prefix = layout::node_prefix(&req.owner, req.mode, req.lock_delay.is_some());
        let path = format!("{dir}/{prefix}");
        let data = req.value.as_deref().unwrap_or_default();
        let options = self.create_options(zk::CreateMode::EphemeralSequential);
        for _ in 0..CREATE_ATTEMPTS {
            let created = client.create(&path, data, &options);
            let listed = client.list_children(dir);
            let (created, listed) = tokio::join!(created, listed);
            match created {
                Ok((stat, seq)) => {
                    let node = format!("{prefix}{seq}");
                    self.update(&req.owner, |p| {
                        p.node = Some(node.clone());
                        p.czxid = stat.czxid;
                        p.version = stat.version;
                        p.unsure = false;
                    });
                    let listed = listed.map_err(|e| map(e, &format!("listing {dir}")))?;
                    return Ok((node, listed));
                }
                Err(zk::Error::NoNode) => self.make_dir(client, dir).await?,
                Err(e) => return Err(map(e, &format!("creating a node in {dir}"))),
            }
        }
        Err(Error::backend(
            format!("zookeeper: {dir} keeps vanishing before a node can be created in it"),
            true,
        ))
    }

    /// Lists `dir` (empty if it does not exist).
    async fn list(&self, client: &zk::Client, dir: &str) -> Result<Vec<String>> {
        or_empty(client.list_children(dir).await, dir)
    }

    /// Lists `dir` as the leader has it.
    /// It lists after a `sync`, which a follower answers once it has applied everything the
    /// leader committed before (a session's requests are answered in order, so the listing
    /// waits for it). For searching for the node of a create whose answer was lost, which
    /// another server may not have applied yet.
    async fn list_synced(&self, client: &zk::Client, dir: &str) -> Result<Vec<String>> {
        let (synced, listed) = tokio::join!(client.sync(dir), client.list_children(dir));
        synced.map_err(|e| map(e, &format!("syncing {dir}")))?;
        or_empty(listed, dir)
    }

    /// Deletes every node of `dir` named after `prefix` except `keep`; returns how many.
    async fn sweep(
        &self,
        client: &zk::Client,
        dir: &str,
        children: &[String],
        prefix: &str,
        keep: Option<&str>,
    ) -> Result<usize> {
        let strays: Vec<String> = children
            .iter()
            .filter(|c| c.starts_with(prefix) && Some(c.as_str()) != keep)
            .map(|c| format!("{dir}/{c}"))
            .collect();
        let deletes: Vec<_> = strays.iter().map(|p| client.delete(p, None)).collect();
        let mut deleted = 0;
        for answer in join_all(deletes).await {
            match answer {
                Ok(()) => deleted += 1,
                Err(zk::Error::NoNode) => {}
                Err(e) => return Err(map(e, "deleting a stray node")),
            }
        }
        if deleted > 0 {
            tracing::debug!(
                dir,
                deleted,
                "zookeeper: deleted stray nodes of a lost create"
            );
        }
        Ok(deleted)
    }

    /// Deletes the owner's node (and its lock-delay marker) by path and version.
    /// Returns whether a node was there. An owner whose create went unanswered has the
    /// directory swept for nodes named after it. `session` is the current session.
    async fn delete_node(
        &self,
        session: &Session,
        owner: &OwnerId,
        placed: &Placed,
    ) -> Result<bool> {
        let client = &session.client;
        let Some(path) = placed.path() else {
            if !placed.unsure {
                return Ok(false);
            }
            let children = self.list_synced(client, &placed.dir).await?;
            let mode_prefix = format!("{owner}-");
            return Ok(self
                .sweep(client, &placed.dir, &children, &mode_prefix, None)
                .await?
                > 0);
        };
        // The marker is deleted on the session that creates it, so that the delete is
        // ordered after a create still on its way. Only the placed session's lock-delay
        // sessions can be open: an ended session's were left to expire with its markers.
        let mut marker = placed.marker.as_ref().and_then(|marker| {
            let delay_client = (session.id == placed.session)
                .then(|| session.open_delay_client(marker.delay, marker.session))
                .flatten()?;
            Some((marker, delay_client))
        });
        let mut version = placed.version;
        for _ in 0..3 {
            let answer = match &marker {
                Some((gone, delay_client)) => {
                    let mut multi = delay_client.new_multi_writer();
                    multi
                        .add_delete(&path, Some(version))
                        .and_then(|()| multi.add_delete(&gone.path, None))
                        .map_err(|e| map(e, "releasing"))?;
                    match multi.commit().await {
                        Ok(_) => {
                            session.marker_deleted(gone.delay, gone.session);
                            Ok(())
                        }
                        // One of the two is not there (the node or the marker went with its
                        // session, or the marker's create never landed): each on its own.
                        Err(zk::MultiWriteError::OperationFailed {
                            source: zk::Error::NoNode,
                            ..
                        }) => match delay_client.delete(&gone.path, None).await {
                            Ok(()) | Err(zk::Error::NoNode) => {
                                session.marker_deleted(gone.delay, gone.session);
                                marker = None;
                                client.delete(&path, Some(version)).await
                            }
                            Err(e) => Err(e),
                        },
                        Err(e) => Err(zk::Error::from(e)),
                    }
                }
                None => client.delete(&path, Some(version)).await,
            };
            match answer {
                Ok(()) => return Ok(true),
                Err(zk::Error::NoNode) => return Ok(false),
                Err(zk::Error::BadVersion) => {
                    // Our node (the path names our owner id) at a version we lost track of.
                    match client.check_stat(&path).await {
                        Ok(Some(stat)) => version = stat.version,
                        Ok(None) => return Ok(false),
                        Err(e) => return Err(map(e, "releasing")),
                    }
                }
                Err(e) => return Err(map(e, "releasing")),
            }
        }
        Err(Error::backend(
            format!("zookeeper: {path} keeps changing; cannot release it"),
            true,
        ))
    }

    /// Finds the node of an unanswered create by its name and records it as the owner's.
    /// It takes the lowest such node, if several (the others are swept later).
    async fn adopt(
        &self,
        client: &zk::Client,
        owner: &OwnerId,
        dir: &str,
        prefix: &str,
    ) -> Result<Option<Placed>> {
        let children = self.list_synced(client, dir).await?;
        let Some(found) = layout::queue(&children)
            .into_iter()
            .find(|c| c.node.starts_with(prefix))
        else {
            return Ok(None);
        };
        let path = format!("{dir}/{}", found.node);
        let Some(stat) = client
            .check_stat(&path)
            .await
            .map_err(|e| map(e, "adopting a node"))?
        else {
            return Ok(None);
        };
        tracing::debug!(node = %path, "zookeeper: adopted the node of an unanswered create");
        self.update(owner, |p| {
            p.node = Some(found.node.clone());
            p.czxid = stat.czxid;
            p.version = stat.version;
            p.unsure = false;
        });
        Ok(self.owners().get(owner).cloned())
    }

    fn forget(&self, owner: &OwnerId) -> Option<Placed> {
        self.owners().remove(owner)
    }

    fn update(&self, owner: &OwnerId, change: impl FnOnce(&mut Placed)) {
        if let Some(placed) = self.owners().get_mut(owner) {
            change(placed);
        }
    }

    /// The grant of my node, after its lock-delay marker is in place.
    async fn granted(
        &self,
        session: &Session,
        req: &Request,
        placed: &Placed,
        behind: &[bool],
    ) -> Result<Acquire> {
        if let Some(delay) = req.lock_delay
            && !placed.marker.as_ref().is_some_and(|m| m.created)
        {
            self.put_marker(session, req, placed, delay).await?;
        }
        // A permit granted after waiting touches its node: the waiter behind it watches
        // it, and is now the first to wait, so it must watch the holders instead.
        if placed.waited
            && req.mode.is_permit()
            && behind.iter().any(|holds| !holds)
            && let Some(path) = placed.path()
        {
            let data = req.value.as_deref().unwrap_or_default();
            let stat = session
                .client
                .set_data(&path, data, Some(placed.version))
                .await
                .map_err(|e| map(e, "passing the turn on"))?;
            self.update(&req.owner, |p| p.version = stat.version);
        }
        let token = u64::try_from(placed.czxid).map_err(|_| bad_czxid(placed.czxid))?;
        Ok(Acquire::Granted(Grant::new(
            FencingToken::new(token),
            Expiry::Session(session.liveness()),
        )))
    }

    /// Creates the lock-delay marker of `placed`'s grant, owned by the session of `delay`.
    /// It goes beside the granted node (which keeps the directory from vanishing). The
    /// marker is recorded before its create goes out: a release deletes it whatever became
    /// of the create (dropped, unanswered).
    async fn put_marker(
        &self,
        session: &Session,
        req: &Request,
        placed: &Placed,
        delay: Duration,
    ) -> Result<()> {
        // A marker recorded under a lock-delay session that expired since went with it:
        // this one is counted under the new session.
        let counted = placed.marker.as_ref().map(|m| m.session);
        let client = session.delay_client(delay, counted).await?;
        let path = format!("{}/{}", placed.dir, layout::marker_name(&req.owner));
        self.update(&req.owner, |p| {
            p.marker = Some(Marker {
                path: path.clone(),
                delay,
                session: client.session_id().0,
                created: false,
            });
        });
        let options = self.create_options(zk::CreateMode::Ephemeral);
        match client.create(&path, &[], &options).await {
            Ok(_) | Err(zk::Error::NodeExists) => {
                self.update(&req.owner, |p| {
                    if let Some(marker) = &mut p.marker {
                        marker.created = true;
                    }
                });
                Ok(())
            }
            Err(e) => Err(map(e, "creating a lock-delay marker")),
        }
    }
}

/// Deletes lock-delay markers on the lock-delay sessions that created them.
/// It is best effort: one that stays goes when its session expires.
async fn delete_markers(session: &Session, markers: Vec<Marker>) {
    let deletes = markers.into_iter().filter_map(|marker| {
        let client = session.open_delay_client(marker.delay, marker.session)?;
        Some(async move {
            match client.delete(&marker.path, None).await {
                Ok(()) | Err(zk::Error::NoNode) => {
                    session.marker_deleted(marker.delay, marker.session);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "zookeeper: a lock-delay marker could not be deleted; it goes with its session");
                }
            }
        })
    });
    join_all(deletes).await;
}

/// A listing, with a missing directory read as empty.
fn or_empty(listed: std::result::Result<Vec<String>, zk::Error>, dir: &str) -> Result<Vec<String>> {
    match listed {
        Ok(children) => Ok(children),
        Err(zk::Error::NoNode) => Ok(Vec::new()),
        Err(e) => Err(map(e, &format!("listing {dir}"))),
    }
}

/// A node's czxid that is no zxid (a reply that does not decode).
fn bad_czxid(czxid: i64) -> Error {
    Error::backend(format!("zookeeper: a node has czxid {czxid}"), false)
}

/// The permit limit a foreign contender of `mode`'s set counts with.
fn default_limit(mode: Mode) -> Option<NonZeroU32> {
    match mode {
        Mode::Permit { limit } => Some(limit),
        Mode::Exclusive | Mode::Shared => None,
    }
}

/// The paths of the lock-delay markers among `children` of `dir` whose owner has no node.
/// No node in `queue`: a holder that vanished without releasing.
fn orphan_markers(children: &[String], queue: &[Contender], dir: &str) -> Vec<String> {
    children
        .iter()
        .filter_map(|child| {
            let owner = layout::marker_owner(child)?;
            let present = queue.iter().any(|c| c.owner.as_ref() == Some(&owner));
            (!present).then(|| format!("{dir}/{child}"))
        })
        .collect()
}

#[async_trait]
impl Backend for ZooKeeperBackend {
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new("zookeeper", TokenDurability::Consensus);
        caps.expiring_leases = true;
        caps.fair = true;
        caps.push_wakeups = true;
        caps.shared = true;
        caps.permits = true;
        caps.lock_delay = true;
        caps.session_ttl = Some(self.session_timeout());
        caps
    }

    async fn acquire(&self, req: &Request) -> Result<Acquire> {
        let session = self.session().await?;
        let client = &session.client;
        let layout = &self.inner.layout;
        let dir = layout.dir(&req.name, req.mode);
        let prefix = layout::node_prefix(&req.owner, req.mode, req.lock_delay.is_some());

        let mut placed = self.owners().get(&req.owner).cloned();
        if let Some(old) = placed.take_if(|p| p.session != session.id) {
            // Placed under a session that has ended: the node goes with it (at once if the
            // server still has it); wait again in this session.
            self.forget(&req.owner);
            if let Err(error) = self.delete_node(&session, &req.owner, &old).await {
                tracing::debug!(%error, "zookeeper: could not delete a node of an ended session");
            }
        }
        if let Some(woken) = placed.take_if(|p| p.woken && p.node.is_some()) {
            // The one node in the way is gone and nothing else can be: mine holds.
            self.update(&req.owner, |p| p.woken = false);
            return self.granted(&session, req, &woken, &[]).await;
        }
        if placed
            .as_ref()
            .is_some_and(|p| p.node.is_none() && p.unsure)
        {
            // A create went unanswered: if it was applied, its node is named after us.
            // Adopt it rather than create another.
            placed = self
                .adopt(client, &req.owner, &dir, &prefix)
                .await?
                .or(placed);
        }
        let (node, children) = match placed.and_then(|p| p.node) {
            Some(node) => (node, self.list(client, &dir).await?),
            None => {
                // Recorded before the create goes out: if this future is dropped or the
                // answer is lost, the release still finds the node by its name.
                self.owners().insert(
                    req.owner.clone(),
                    Placed {
                        session: session.id,
                        dir: dir.clone(),
                        node: None,
                        czxid: 0,
                        version: 0,
                        unsure: true,
                        waited: false,
                        marker: None,
                        woken: false,
                    },
                );
                match self.create_and_list(client, req, &dir).await {
                    Ok(created) => created,
                    Err(error) => {
                        // The create refused (an ACL, a bad path): nothing was created, so
                        // there is nothing for a release to look for. A created node (the
                        // listing failed) or an unanswered create stays for the release.
                        let created = self
                            .owners()
                            .get(&req.owner)
                            .is_some_and(|p| p.node.is_some());
                        if !created && !error.is_unknown_outcome() {
                            self.forget(&req.owner);
                        }
                        return Err(error);
                    }
                }
            }
        };

        let mut queue = layout::queue(&children);
        // Nodes named after us but not ours: an earlier create whose answer was lost.
        if queue
            .iter()
            .any(|c| c.node != node && c.node.starts_with(&prefix))
        {
            self.sweep(client, &dir, &children, &prefix, Some(&node))
                .await?;
            queue.retain(|c| c.node == node || !c.node.starts_with(&prefix));
        }
        let Some(me) = queue.iter().position(|c| c.node == node) else {
            // Deleted under us (the session expired meanwhile, or an operator).
            self.forget(&req.owner);
            return Err(Error::unavailable(format!(
                "zookeeper: the node of this acquisition in {dir} is gone"
            )));
        };
        let holds = layout::holding(&queue, default_limit(req.mode));
        let orphans = orphan_markers(&children, &queue, &dir);
        if holds[me] && orphans.is_empty() {
            let placed = self
                .owners()
                .get(&req.owner)
                .cloned()
                .ok_or(Error::Lost(LossReason::SessionEnded))?;
            return self.granted(&session, req, &placed, &holds[me + 1..]).await;
        }
        if !req.waiting {
            // A try that did not get it: take the node out of the queue again.
            let placed = self.owners().get(&req.owner).cloned();
            if let Some(placed) = placed {
                self.delete_node(&session, &req.owner, &placed).await?;
            }
            self.forget(&req.owner);
            return Ok(Acquire::Busy(WaitHint::none()));
        }
        self.update(&req.owner, |p| p.waited = true);
        let sole =
            (orphans.is_empty() && layout::sole_blocker(&queue, me)).then(|| req.owner.clone());
        let nodes: Vec<Watched> = if holds[me] {
            // First in line, but a vanished holder's lock-delay is not over.
            orphans.into_iter().map(Watched::deletion).collect()
        } else {
            layout::in_the_way(&queue, &holds, me)
                .into_iter()
                .map(|(c, holds)| Watched {
                    path: format!("{dir}/{}", c.node),
                    untouched: c.mode.is_permit() && c.owner.is_some() && !holds,
                })
                .collect()
        };
        let children = nodes.is_empty().then_some(dir);
        Ok(Acquire::Busy(WaitHint::new(Hint {
            session: session.id,
            sole,
            nodes,
            children,
        })))
    }

    async fn renew(&self, req: &Request) -> Result<Renewal> {
        // Grants live by the session; this only says whether the node is still ours.
        let Some(placed) = self.owners().get(&req.owner).cloned() else {
            return Ok(Renewal::Lost(LossReason::NotOwner));
        };
        let Some(session) = self
            .current()
            .filter(|s| s.id == placed.session && s.is_alive())
        else {
            return Ok(Renewal::Lost(LossReason::SessionEnded));
        };
        let Some(path) = placed.path() else {
            return Ok(Renewal::Lost(LossReason::NotOwner));
        };
        match session.client.check_stat(&path).await {
            Ok(Some(stat)) if stat.czxid == placed.czxid && stat.ephemeral_owner == session.id => {
                Ok(Renewal::Renewed(Expiry::Session(session.liveness())))
            }
            Ok(_) => Ok(Renewal::Lost(LossReason::NotOwner)),
            Err(e) => Err(map(e, "checking a node")),
        }
    }

    async fn release(&self, req: &Request) -> Result<Release> {
        let Some(placed) = self.owners().get(&req.owner).cloned() else {
            return Ok(Release::NotHeld);
        };
        // Any session may delete a node; the path names only this owner's.
        let session = self.session().await?;
        let deleted = self.delete_node(&session, &req.owner, &placed).await?;
        self.forget(&req.owner);
        Ok(if deleted {
            Release::Released
        } else {
            Release::NotHeld
        })
    }

    async fn wait(&self, _name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        let Some(hint) = hint.get::<Hint>() else {
            return Ok(());
        };
        let Some(session) = self
            .current()
            .filter(|s| s.id == hint.session && s.is_alive())
        else {
            // The session changed: acquire again at once.
            return Ok(());
        };
        let client = &session.client;
        let nodes: Vec<_> = hint
            .nodes
            .iter()
            .map(|node| client.check_and_watch_stat(&node.path))
            .collect();
        let mut watchers = Vec::with_capacity(nodes.len() + 1);
        for (answer, node) in join_all(nodes).await.into_iter().zip(&hint.nodes) {
            match answer {
                // Touched since the listing (granted before the watch was set): the change
                // this waiter waits for happened already.
                Ok((Some(stat), _)) if node.untouched && stat.version != 0 => return Ok(()),
                // Gone already: no need to wait.
                Ok((None, _)) => {
                    if let Some(owner) = &hint.sole {
                        self.update(owner, |p| p.woken = p.session == hint.session);
                    }
                    return Ok(());
                }
                Ok((Some(_), watcher)) => watchers.push(watcher),
                Err(e) => return Err(map(e, "watching")),
            }
        }
        if let Some(dir) = &hint.children {
            match client.list_and_watch_children(dir).await {
                Ok((_, watcher)) => watchers.push(watcher),
                Err(zk::Error::NoNode) => match client.check_and_watch_stat(dir).await {
                    Ok((Some(_), _)) => return Ok(()),
                    Ok((None, watcher)) => watchers.push(watcher),
                    Err(e) => return Err(map(e, "watching")),
                },
                Err(e) => return Err(map(e, "watching")),
            }
        }
        // The watches are in place; the session is not kept open by a waiter.
        drop(session);
        if watchers.is_empty() {
            return Ok(());
        }
        let any = select_all(watchers.into_iter().map(|w| Box::pin(w.changed())));
        if let Ok((event, _, _)) = tokio::time::timeout(max, any).await
            && event.event_type != zk::EventType::Session
        {
            self.inner.watch_events.fetch_add(1, Ordering::Relaxed);
            if let Some(owner) = &hint.sole
                && event.event_type == zk::EventType::NodeDeleted
            {
                self.update(owner, |p| p.woken = p.session == hint.session);
            }
        }
        Ok(())
    }

    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        let session = self.session().await?;
        let client = &session.client;
        let layout = &self.inner.layout;
        let permit = Mode::Permit {
            limit: NonZeroU32::MIN,
        };
        let (lock_dir, permit_dir) = (layout.dir(name, Mode::Exclusive), layout.dir(name, permit));
        let (locks, permits) = tokio::join!(
            client.list_children(&lock_dir),
            client.list_children(&permit_dir)
        );
        let sets = [
            (lock_dir.clone(), or_empty(locks, &lock_dir)?, None),
            (
                permit_dir.clone(),
                or_empty(permits, &permit_dir)?,
                Some(NonZeroU32::MIN),
            ),
        ];
        let mut state = LockState::default();
        let mut watched = Vec::new();
        for (dir, children, limit) in sets {
            let queue = layout::queue(&children);
            let holds = layout::holding(&queue, limit);
            let paths: Vec<String> = queue
                .iter()
                .zip(&holds)
                .filter(|(_, holds)| **holds)
                .map(|(c, _)| format!("{dir}/{}", c.node))
                .collect();
            let reads: Vec<_> = paths.iter().map(|p| client.get_data(p)).collect();
            let mut read = join_all(reads).await.into_iter();
            for (contender, holds) in queue.iter().zip(&holds) {
                if !holds {
                    state
                        .waiters
                        .push(Waiter::new(contender.shown_owner(), contender.mode));
                    continue;
                }
                let (data, stat) = match read.next() {
                    Some(Ok(found)) => found,
                    // Released since the listing.
                    Some(Err(zk::Error::NoNode)) | None => continue,
                    Some(Err(e)) => return Err(map(e, "reading a holder")),
                };
                if limit.is_none() {
                    watched.push(format!("{dir}/{}", contender.node));
                }
                let token = u64::try_from(stat.czxid).map_err(|_| bad_czxid(stat.czxid))?;
                // This session's nodes last until its local deadline; another's until at
                // most a session timeout after its owner goes silent.
                let remaining = if stat.ephemeral_owner == session.id {
                    session.remaining()
                } else {
                    session.timeout
                };
                state.holders.push(
                    Holder::new(
                        contender.shown_owner(),
                        contender.mode,
                        FencingToken::new(token),
                    )
                    .with_remaining(Some(remaining))
                    .with_value((!data.is_empty()).then(|| Arc::from(data))),
                );
            }
        }
        let children = watched.is_empty().then_some(lock_dir);
        state.hint = WaitHint::new(Hint {
            session: session.id,
            sole: None,
            nodes: watched.into_iter().map(Watched::deletion).collect(),
            children,
        });
        Ok(state)
    }

    async fn session_liveness(&self) -> Option<SessionLiveness> {
        self.current().map(|session| session.liveness())
    }

    async fn abandon(&self, req: &Request) -> Result<()> {
        let Some(placed) = self.forget(&req.owner) else {
            return Ok(());
        };
        // A session that has ended (its deadline passed) is let go of by its own task,
        // its lock-delay markers left to keep their delay: only a live one is closed here.
        let current = self
            .current()
            .filter(|s| s.id == placed.session && s.is_alive());
        if let Some(session) = current {
            // The node may still exist under the live session, which would keep it for its
            // whole life: end the session (every guard on it is lost) and close it.
            tracing::warn!(lock = %req.name, owner = %req.owner, "zookeeper: a release could not be confirmed; closing the session so that its node goes");
            let _opening = self.inner.opening.lock().await;
            let taken = {
                let mut slot = self.slot();
                slot.take_if(|s| s.id == session.id)
            };
            drop(session);
            if let Some(taken) = taken {
                // A release that could not be confirmed is still a release: no lock-delay
                // follows it, nor the others closed with it (as for `close`). Markers
                // that cannot be deleted now go when their sessions expire: no later than
                // after a crash.
                let mut markers = self.forget_session(taken.id);
                markers.extend(placed.marker);
                tokio::spawn(async move {
                    delete_markers(&taken, markers).await;
                    if let Err(error) = taken.close().await {
                        tracing::warn!(%error, "zookeeper: closing an abandoned session");
                    }
                });
            }
        }
        Ok(())
    }
}
