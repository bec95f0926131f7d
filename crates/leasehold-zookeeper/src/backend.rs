//! The [`Backend`] implementation: acquire, renew, release, wait, inspect, list, records, abandon.
//! Each is sent as ZooKeeper requests, and this module says what their answers mean.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::{join_all, select_all};
use leasehold_core::backend::{
    Acquire, Backend, Capabilities, Changes, Eviction, Expiry, Grant, Holder, ListCursor, Listing,
    LockState, Mode, Release, Renewal, Request, SessionLiveness, TokenDurability, WaitHint, Waiter,
};
use leasehold_core::support::evictions;
use leasehold_core::{Error, LockName, LossReason, NamePrefix, OwnerId, RecordKey, Result};
use zookeeper_client as zk;

use crate::connection::ZooKeeperBackend;
use crate::error::map;
use crate::layout;
use crate::markers;
use crate::registry::{Placed, Stage, State};
use crate::reply::{self, or_empty};
use crate::session::Session;

/// What a busy acquisition (or an inspect) hands to `wait`.
#[derive(Debug)]
struct Hint {
    /// The session whose watches these are.
    session: i64,
    /// The waiting acquisition whose one blocker is the node watched, if any.
    /// The node's deletion grants it (see `reply::sole_blocker`).
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
    /// The node was a permit waiter of ours, at data version 0, when it was listed.
    /// It is touched (its version moves) once it is granted, which may happen before the
    /// watch is set.
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

impl ZooKeeperBackend {
    /// The grant of my node, after its lock-delay marker is in place.
    /// `behind` says whether each contender after it holds.
    async fn granted(&self, session: &Session, req: &Request, behind: &[bool]) -> Result<Acquire> {
        // Forgotten meanwhile: its session was closed.
        let lost = || Error::Lost(LossReason::SessionEnded);
        let placed = self.registry().get(&req.owner).ok_or_else(lost)?;
        let (node, path) = placed.node_path().ok_or_else(lost)?;
        if let Some(delay) = req.lock_delay
            && !node.marker.as_ref().is_some_and(|m| m.created)
        {
            self.put_marker(session, req, &placed, delay).await?;
        }
        // A permit granted after waiting touches its node: the waiter behind it watches
        // it, and is now the first to wait, so it must watch the holders instead.
        if matches!(node.stage, Stage::Waiting | Stage::Woken)
            && req.mode.is_permit()
            && behind.iter().any(|holds| !holds)
        {
            let data = req.value.as_deref().unwrap_or_default();
            let stat = session
                .client
                .set_data(&path, data, Some(node.version))
                .await
                .map_err(|e| map(e, "passing the turn on"))?;
            self.registry()
                .update(&req.owner, |n| n.version = stat.version);
        }
        let token = reply::token(node.czxid)?;
        self.registry()
            .update(&req.owner, |n| n.stage = Stage::Granted);
        // Its deletion by anyone but its release is pushed to the grant (see `grants`).
        let liveness = self.watch_grant(
            &req.owner,
            &req.name,
            &session.client,
            path,
            node.czxid,
            session.liveness(),
        );
        Ok(Acquire::Granted(Grant::new(
            token,
            Expiry::Session(liveness),
        )))
    }

    /// Holders and waiters of `name` as `session` reads them, with its lock set's holders' nodes.
    /// The directories of the sets `sets` says (the lock set's, the permit set's) are
    /// listed, a missing one as empty, and each holder's node is read: its data is the
    /// grant's value, its czxid the token. Time held is not known: a node's ctime is when
    /// it joined the queue, not when it was granted.
    async fn read_state(
        &self,
        session: &Session,
        name: &LockName,
        sets: [bool; 2],
    ) -> Result<(LockState, Vec<String>)> {
        let client = &session.client;
        let layout = &self.inner.layout;
        // A foreign contender in the permit set takes one permit.
        let limit = NonZeroU32::MIN;
        let sets: Vec<(String, Mode)> = [Mode::Exclusive, Mode::Permit { limit }]
            .into_iter()
            .zip(sets)
            .filter(|(_, read)| *read)
            .map(|(mode, _)| (layout.dir(name, mode), mode))
            .collect();
        let listings = join_all(sets.iter().map(|(dir, _)| client.list_children(dir))).await;
        let mut state = LockState::default();
        let mut watched = Vec::new();
        for ((dir, mode), listed) in sets.iter().zip(listings) {
            let queue = reply::queue(&or_empty(listed, dir)?);
            let holds = reply::holding(&queue, *mode);
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
                if !mode.is_permit() {
                    watched.push(format!("{dir}/{}", contender.node));
                }
                let token = reply::token(stat.czxid)?;
                // This session's nodes last until its local deadline; another's until at
                // most a session timeout after its owner goes silent.
                let remaining = if stat.ephemeral_owner == session.id {
                    session.remaining()
                } else {
                    session.timeout
                };
                state.holders.push(
                    Holder::new(contender.shown_owner(), contender.mode, token)
                        .with_remaining(Some(remaining))
                        .with_value((!data.is_empty()).then(|| Arc::from(data))),
                );
            }
        }
        state.evictions = self.read_evictions(client, name).await?;
        Ok((state, watched))
    }

    /// The latest evictions of `name`, newest (highest token) first.
    async fn read_evictions(&self, client: &zk::Client, name: &LockName) -> Result<Vec<Eviction>> {
        let dir = self.inner.layout.evictions(name);
        let mut records = or_empty(client.list_children(&dir).await, &dir)?;
        records.sort_unstable_by(|a, b| b.cmp(a));
        records.truncate(evictions::KEPT);
        let reads = records
            .iter()
            .map(|r| client.get_data(&format!("{dir}/{r}")));
        let mut read = Vec::with_capacity(records.len());
        for answer in join_all(reads).await {
            match answer {
                Ok((data, _)) => read.push(data),
                // Deleted by a later eviction since the listing.
                Err(zk::Error::NoNode) => {}
                Err(e) => return Err(map(e, "reading eviction records")),
            }
        }
        Ok(evictions::decode_all(read.iter().map(Vec::as_slice)))
    }

    /// The one node in the way of `hint`'s sole waiter is gone: it holds.
    fn wake(&self, hint: &Hint) {
        if let Some(owner) = &hint.sole {
            self.registry().update(owner, |node| {
                if node.stage == Stage::Waiting {
                    node.stage = Stage::Woken;
                }
            });
        }
    }
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

        let mut placed = self.registry().get(&req.owner);
        if let Some(old) = placed.take_if(|p| p.session != session.id) {
            // Placed under a session that has ended: the node goes with it (at once if the
            // server still has it); wait again in this session.
            self.registry().forget(&req.owner);
            if let Err(error) = self.delete_node(&session, &req.owner, &old).await {
                tracing::debug!(%error, "zookeeper: could not delete a node of an ended session");
            }
        }
        if placed
            .as_ref()
            .and_then(Placed::node)
            .is_some_and(|n| n.stage == Stage::Woken)
        {
            // The one node in the way is gone and nothing else can be: mine holds (once:
            // after a failure, the next attempt lists again).
            self.registry()
                .update(&req.owner, |n| n.stage = Stage::Waiting);
            return self.granted(&session, req, &[]).await;
        }
        if placed
            .as_ref()
            .is_some_and(|p| matches!(p.state, State::Creating))
        {
            // A create went unanswered: if it was applied, its node is named after us.
            // Adopt it rather than create another.
            placed = self
                .adopt(client, &req.owner, &dir, &prefix)
                .await?
                .or(placed);
        }
        let (node, children) = match placed.as_ref().and_then(Placed::node) {
            Some(node) => {
                let listed = client.list_children(&dir).await;
                (node.name.clone(), or_empty(listed, &dir)?)
            }
            None => {
                self.registry().creating(&req.owner, session.id, &dir);
                match self.create_and_list(client, req, &dir).await {
                    Ok(created) => created,
                    Err(error) => {
                        // The create refused (an ACL, a bad path): nothing was created, so
                        // there is nothing for a release to look for. A created node (the
                        // listing failed) or an unanswered create stays for the release.
                        let mut registry = self.registry();
                        let created = registry.get(&req.owner).is_some_and(|p| p.node().is_some());
                        if !created && !error.is_unknown_outcome() {
                            registry.forget(&req.owner);
                        }
                        return Err(error);
                    }
                }
            }
        };

        let mut queue = reply::queue(&children);
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
            self.registry().forget(&req.owner);
            return Err(Error::unavailable(format!(
                "zookeeper: the node of this acquisition in {dir} is gone"
            )));
        };
        let holds = reply::holding(&queue, req.mode);
        let orphans = markers::orphans(&children, &queue, &dir);
        if holds[me] && orphans.is_empty() {
            return self.granted(&session, req, &holds[me + 1..]).await;
        }
        if !req.waiting {
            // A try that did not get it: take the node out of the queue again.
            let placed = self.registry().get(&req.owner);
            if let Some(placed) = placed {
                self.delete_node(&session, &req.owner, &placed).await?;
            }
            self.registry().forget(&req.owner);
            return Ok(Acquire::Busy(WaitHint::none()));
        }
        self.registry()
            .update(&req.owner, |n| n.stage = Stage::Waiting);
        let sole =
            (orphans.is_empty() && reply::sole_blocker(&queue, me)).then(|| req.owner.clone());
        let nodes: Vec<Watched> = if holds[me] {
            // First in line, but a vanished holder's lock-delay is not over.
            orphans.into_iter().map(Watched::deletion).collect()
        } else {
            reply::in_the_way(&queue, &holds, me)
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
        let Some(placed) = self.registry().get(&req.owner) else {
            return Ok(Renewal::Lost(LossReason::NotOwner));
        };
        let Some(session) = self
            .current()
            .filter(|s| s.id == placed.session && s.is_alive())
        else {
            return Ok(Renewal::Lost(LossReason::SessionEnded));
        };
        let Some((node, path)) = placed.node_path() else {
            return Ok(Renewal::Lost(LossReason::NotOwner));
        };
        match session.client.check_stat(&path).await {
            Ok(Some(stat)) if stat.czxid == node.czxid && stat.ephemeral_owner == session.id => {
                Ok(Renewal::Renewed(Expiry::Session(session.liveness())))
            }
            Ok(_) => Ok(Renewal::Lost(LossReason::NotOwner)),
            Err(e) => Err(map(e, "checking a node")),
        }
    }

    async fn release(&self, req: &Request) -> Result<Release> {
        // Its own deletion is no news to the grant.
        self.inner.grants.unwatch(&req.owner);
        let Some(placed) = self.registry().get(&req.owner) else {
            return Ok(Release::NotHeld);
        };
        // Any session may delete a node; the path names only this owner's.
        let session = self.session().await?;
        let released = self.delete_node(&session, &req.owner, &placed).await?;
        self.registry().forget(&req.owner);
        Ok(released)
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
                    self.wake(hint);
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
            if event.event_type == zk::EventType::NodeDeleted {
                self.wake(hint);
            }
        }
        Ok(())
    }

    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        let session = self.session().await?;
        let (mut state, watched) = self.read_state(&session, name, [true, true]).await?;
        let children = watched
            .is_empty()
            .then(|| self.inner.layout.dir(name, Mode::Exclusive));
        state.hint = WaitHint::new(Hint {
            session: session.id,
            sole: None,
            nodes: watched.into_iter().map(Watched::deletion).collect(),
            children,
        });
        Ok(state)
    }

    /// One page of the locks under `prefix`: `page` names after the cursor, in name order.
    ///
    /// The root's children (each lock's directories, `<name>` and `<name>#permits`) are
    /// listed, those of names under `prefix` after the cursor sorted, and the first `page`
    /// names read as [`inspect`](Backend::inspect) reads one, all at once (the client
    /// pipelines the requests); names whose directories are empty (freed, their container
    /// nodes not yet reaped) are left out. The cursor is the last name of the page.
    ///
    /// ZooKeeper 3.8 cannot list a directory a page at a time: every page lists the whole
    /// root, so its reply must fit a client's packet limit (`jute.maxbuffer`, 1 MiB by
    /// default) — about 1 MiB of names, directories of freed names included.
    ///
    /// # Cancel safety
    ///
    /// Read-only; dropping the future changes nothing on the server.
    ///
    /// # Errors
    ///
    /// Backend errors, as for [`inspect`](Backend::inspect).
    async fn list(
        &self,
        prefix: &NamePrefix,
        cursor: Option<&ListCursor>,
        page: usize,
    ) -> Result<Listing> {
        let session = self.session().await?;
        let root = self.inner.layout.root();
        let children = or_empty(session.client.list_children(root).await, root)?;
        let after = cursor.map(ListCursor::as_str);
        // Each name, with which of its sets' directories exist.
        let mut names: BTreeMap<LockName, [bool; 2]> = BTreeMap::new();
        for child in &children {
            let Some((name, permit)) = layout::lock_of(child) else {
                continue;
            };
            if prefix.matches(&name) && after.is_none_or(|after| name.as_str() > after) {
                names.entry(name).or_default()[usize::from(permit)] = true;
            }
        }
        let more = names.len() > page.max(1);
        let names: Vec<(LockName, [bool; 2])> = names.into_iter().take(page.max(1)).collect();
        let next = more
            .then(|| names.last().map(|(name, _)| ListCursor::new(name.as_str())))
            .flatten();
        let states = join_all(
            names
                .iter()
                .map(|(name, sets)| self.read_state(&session, name, *sets)),
        )
        .await;
        let mut locks = Vec::with_capacity(names.len());
        for ((name, _), state) in names.into_iter().zip(states) {
            let (state, _) = state?;
            if !state.holders.is_empty() || !state.waiters.is_empty() {
                locks.push((name, state));
            }
        }
        Ok(Listing::new(locks, next))
    }

    /// A feed of the locks under `prefix` that change: a persistent recursive watch on the root.
    ///
    /// It is set (ZooKeeper's `addWatch`, PERSISTENT_RECURSIVE) on `/<prefix>` in the
    /// backend's session before this returns, and each node event below it names its lock:
    /// grants, releases, waiters queued or gone, nodes deleted with an expired session.
    /// After a reconnection, or when the session ends and the watch is set again in the
    /// next one, a [`Change::Resync`](leasehold_core::Change::Resync) follows. See the
    /// `changes` module.
    ///
    /// # Cancel safety
    ///
    /// Dropped before it returns, the watch set meanwhile is removed again.
    ///
    /// # Errors
    ///
    /// Backend errors: no session can be opened, or the server refuses the watch (a server
    /// older than 3.6 does not know `addWatch`).
    async fn changes(&self, prefix: &NamePrefix) -> Result<Changes> {
        self.open_changes(prefix).await
    }

    /// Writes a record beside the lock in one `multi` with the check of the grant's node.
    /// See the `records` module: the record is a persistent node apart from the lock's
    /// directory, kept at least `keep` by the leader's clock and swept by later writes.
    ///
    /// # Cancel safety
    ///
    /// Dropped after the request went out, the record may or may not be written (only
    /// while the grant held); writing it again is harmless.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a value over the limit; backend errors.
    async fn put_record(
        &self,
        req: &Request,
        key: &RecordKey,
        value: &[u8],
        keep: Duration,
    ) -> Result<bool> {
        self.put_record_node(req, key, value, keep).await
    }

    /// Reads a record on the session in use (no `sync`: see the `records` module).
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] for a node that holds no leasehold record; backend errors.
    async fn get_record(&self, name: &LockName, key: &RecordKey) -> Result<Option<Vec<u8>>> {
        self.get_record_node(name, key).await
    }

    /// Refused: a grant is an ephemeral node of the holder's session, gone with it.
    /// A grant kept past its holder would have to be a TTL node, which ZooKeeper creates
    /// only when the server runs with `zookeeper.extendedTypesEnabled`.
    async fn keep(&self, _req: &Request, _hold: Duration) -> Result<bool> {
        Err(Error::Unsupported {
            backend: "zookeeper",
            feature: "holding a lock after its holder lets go (--at-least: a ZooKeeper grant \
                      is an ephemeral node of the holder's session and goes with it; keeping \
                      it would take TTL nodes, which servers create only with \
                      zookeeper.extendedTypesEnabled)",
        })
    }

    /// Force-releases the grant `eviction` names, in one `multi` (see the `evict` module).
    ///
    /// The node is deleted at the version read; the evicted owner's lock-delay marker,
    /// put on a session that the server expires after the holder's session timeout, keeps
    /// the set closed until the holder's session deadline has passed; the record goes
    /// under `#evictions/<name>/<token>`. The holder's client hears of it by its watch of
    /// its node. `Ok(false)` if that grant is not held, unless its record names this very
    /// eviction (an attempt whose answer was lost).
    ///
    /// # Cancel safety
    ///
    /// The `multi` is applied whole or not at all: dropped before its answer, the grant
    /// may be evicted or not, and evicting again answers whether it was. A marker
    /// session opened for a `multi` that never ran expires with nothing on it.
    ///
    /// # Errors
    ///
    /// Backend errors, after which the grant may be evicted or not.
    async fn evict(&self, name: &LockName, mode: Mode, eviction: &Eviction) -> Result<bool> {
        self.evict_node(name, mode, eviction).await
    }

    async fn session_liveness(&self) -> Option<SessionLiveness> {
        self.current().map(|session| session.liveness())
    }

    async fn abandon(&self, req: &Request) -> Result<()> {
        self.inner.grants.unwatch(&req.owner);
        let Some(placed) = self.registry().forget(&req.owner) else {
            return Ok(());
        };
        // A session that has ended (its deadline passed) is let go of by its own task,
        // its lock-delay markers left to keep their delay: only a live one is closed here.
        if self
            .current()
            .is_some_and(|s| s.id == placed.session && s.is_alive())
        {
            // The node may still exist under the live session, which would keep it for its
            // whole life: end the session (every guard on it is lost) and close it.
            tracing::warn!(lock = %req.name, owner = %req.owner, "zookeeper: a release could not be confirmed; closing the session so that its node goes");
            let marker = placed.node().and_then(|n| n.marker.clone());
            self.end_session(placed.session, marker).await;
        }
        Ok(())
    }
}
