//! The watch of this client's grants: an `exists` watch on each granted node.
//!
//! A grant is an ephemeral node of the session: its holder renews nothing, so it has no
//! renewal at which to learn that its node was deleted by someone else — by an operator's
//! eviction ([`Backend::evict`](leasehold_core::Backend::evict)). So each grant's node
//! gets a one-shot `exists` watch in the session, set right after the grant, and one task
//! per backend awaits them all (it ends with the last grant). One-shot watches, unlike
//! persistent ones, are set again by the client after a reconnection, and the server then
//! reports a deletion it missed; a watch whose request was lost with its connection, or
//! that fired for anything but a deletion, is set again by the task. A release stops
//! watching its node before it deletes it (the watch is removed from the server); any
//! other deletion revokes the grant: as [`LossReason::Evicted`] if the name's eviction
//! record names it (the eviction writes the record in the `multi` that deletes the node),
//! else as [`LossReason::NotOwner`] while its session is alive — a session that ended
//! reports its own loss.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::{AbortHandle, Abortable, BoxFuture};
use futures_util::stream::FuturesUnordered;
use leasehold_core::backend::{Liveness, Revoker, SessionLiveness};
use leasehold_core::clock::{Clock, SystemClock};
use leasehold_core::support::evictions;
use leasehold_core::{FencingToken, LockName, LossReason, OwnerId};
use tokio::sync::mpsc;
use zookeeper_client as zk;

use crate::connection::{Inner, ZooKeeperBackend};

/// The first wait before setting a failed watch again; it doubles each time.
const RETRY_FIRST: Duration = Duration::from_millis(100);

/// The longest wait between two attempts to set a watch.
const RETRY_MOST: Duration = Duration::from_secs(2);

/// How long the eviction record of a deleted node is waited for, the grant still held.
const JUDGE_WITHIN: Duration = Duration::from_secs(2);

/// The watches of a backend's grants.
#[derive(Debug, Default)]
pub(crate) struct GrantWatch {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The last watch id handed out.
    last_id: u64,
    /// The watched grants, by owner.
    by_owner: HashMap<OwnerId, Watched>,
    /// The watches for the task to await, while it runs.
    task: Option<mpsc::UnboundedSender<Watching>>,
}

/// One watched grant.
#[derive(Debug)]
struct Watched {
    id: u64,
    name: LockName,
    /// The node's czxid: the grant's token.
    czxid: i64,
    /// The grant's session, without the grant's own signal.
    session: SessionLiveness,
    revoker: Revoker,
    /// Stops its watch (and removes it from the server).
    stop: AbortHandle,
}

/// What became of a watched node.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    /// Deleted, or another node by now.
    Gone,
    /// The session ended or was replaced: the session's liveness says the rest.
    Nothing,
}

/// One watch for the task: the owner and id of its grant, and the wait for its node.
type Watching = (OwnerId, u64, Abortable<BoxFuture<'static, Seen>>);

impl GrantWatch {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops watching the grant of `owner` (before its own release deletes its node).
    pub(crate) fn unwatch(&self, owner: &OwnerId) {
        if let Some(watched) = self.state().by_owner.remove(owner) {
            watched.stop.abort();
        }
    }
}

impl ZooKeeperBackend {
    /// Watches the node at `path`, created at `czxid` in `client`'s session: `owner`'s grant.
    /// Returns `session` made revocable by the watch. The same grant watched again (an
    /// acquire answered twice) shares its watch; another grant of the owner replaces it.
    pub(crate) fn watch_grant(
        &self,
        owner: &OwnerId,
        name: &LockName,
        client: &zk::Client,
        path: String,
        czxid: i64,
        session: SessionLiveness,
    ) -> SessionLiveness {
        let grants = &self.inner.grants;
        let mut state = grants.state();
        if let Some(watched) = state.by_owner.get(owner)
            && watched.czxid == czxid
        {
            return session.revocable_by(&watched.revoker);
        }
        if let Some(old) = state.by_owner.remove(owner) {
            old.stop.abort();
        }
        state.last_id += 1;
        let id = state.last_id;
        // The task sets the watch and awaits its event. A deletion before the watch is set
        // shows as a node that is gone (or another one), which it reports the same way.
        let wait: BoxFuture<'static, Seen> = Box::pin(watch_node(
            Arc::downgrade(&self.inner),
            (owner.clone(), id),
            client.session_id().0,
            path,
            czxid,
        ));
        let (stop, registration) = AbortHandle::new_pair();
        let watched = Watched {
            id,
            name: name.clone(),
            czxid,
            session: session.clone(),
            revoker: Revoker::new(),
            stop,
        };
        let revocable = session.revocable_by(&watched.revoker);
        state.by_owner.insert(owner.clone(), watched);
        let watching = (owner.clone(), id, Abortable::new(wait, registration));
        let watching = match &state.task {
            Some(task) => match task.send(watching) {
                Ok(()) => return revocable,
                Err(mpsc::error::SendError(watching)) => watching,
            },
            None => watching,
        };
        let (sender, watches) = mpsc::unbounded_channel();
        let _ = sender.send(watching);
        state.task = Some(sender);
        tokio::spawn(serve(Arc::downgrade(&self.inner), watches));
        revocable
    }
}

/// Watches the node at `path`, created at `czxid` in session `session`, until it goes.
/// A watch that fails short of the session's end (a connection lost with the request in
/// flight), or that fires for anything but the node's deletion, is set again, with
/// backoff, while the grant's watch is still `watch` (owner and id) and the session the
/// backend's. A node gone (or another node by now) is [`Seen::Gone`]; a session that
/// ended or was replaced, or a backend that went, is [`Seen::Nothing`].
async fn watch_node(
    inner: Weak<Inner>,
    watch: (OwnerId, u64),
    session: i64,
    path: String,
    czxid: i64,
) -> Seen {
    let mut retry = RETRY_FIRST;
    loop {
        // The client is held for one request only: a grant's watch keeps no session open.
        let client = {
            let Some(inner) = inner.upgrade() else {
                return Seen::Nothing;
            };
            let ours =
                (inner.grants.state().by_owner.get(&watch.0)).is_some_and(|w| w.id == watch.1);
            let backend = ZooKeeperBackend { inner };
            match backend.current() {
                Some(current) if ours && current.id == session => current.client.clone(),
                _ => return Seen::Nothing,
            }
        };
        let answer = client.check_and_watch_stat(&path).await;
        drop(client);
        match answer {
            Ok((Some(stat), watcher)) if stat.czxid == czxid => {
                let event = watcher.changed().await;
                match event.event_type {
                    zk::EventType::NodeDeleted => return Seen::Gone,
                    zk::EventType::Session if event.session_state.is_terminated() => {
                        return Seen::Nothing;
                    }
                    // Its data changed, say: the node is still there, watched again.
                    other => {
                        tracing::debug!(?other, "zookeeper: a grant's watch fired; set again");
                        retry = RETRY_FIRST;
                        continue;
                    }
                }
            }
            Ok(_) => return Seen::Gone,
            Err(
                zk::Error::SessionExpired
                | zk::Error::ClientClosed
                | zk::Error::AuthFailed
                | zk::Error::NoHosts,
            ) => return Seen::Nothing,
            Err(e) => tracing::debug!("zookeeper: watching a grant's node: {e}; again"),
        }
        tokio::time::sleep(retry).await;
        retry = (retry * 2).min(RETRY_MOST);
    }
}

/// Awaits every watch sent on `watches` until no grant is watched.
async fn serve(inner: Weak<Inner>, mut watches: mpsc::UnboundedReceiver<Watching>) {
    let mut waiting = FuturesUnordered::new();
    loop {
        tokio::select! {
            watch = watches.recv() => match watch {
                Some((owner, id, wait)) => {
                    waiting.push(async move { (owner, id, wait.await) });
                }
                None => return,
            },
            Some((owner, id, seen)) = waiting.next(), if !waiting.is_empty() => {
                let Some(inner) = inner.upgrade() else { return };
                let backend = ZooKeeperBackend { inner };
                let ended = {
                    let mut state = backend.inner.grants.state();
                    let ours = state.by_owner.get(&owner).is_some_and(|w| w.id == id);
                    // A watch that ended without news leaves the rest to the session.
                    ours.then(|| state.by_owner.remove(&owner)).flatten()
                };
                if let (Some(watched), Ok(Seen::Gone)) = (ended, seen) {
                    tokio::spawn(judge(backend, owner, watched));
                }
            }
        }
        let Some(inner) = inner.upgrade() else { return };
        let mut state = inner.grants.state();
        if waiting.is_empty() && state.by_owner.is_empty() {
            state.task = None;
            return;
        }
    }
}

/// Revokes `owner`'s grant, whose node was deleted other than by its own release.
/// Evicted if the name's eviction record of its token names it, read within
/// [`JUDGE_WITHIN`]; otherwise not the owner's any more, unless its session has ended
/// (which says so itself). The read decides only the reason: the grant is revoked either
/// way once it is answered or has taken too long.
async fn judge(backend: ZooKeeperBackend, owner: OwnerId, watched: Watched) {
    let path = backend.inner.layout.eviction(&watched.name, watched.czxid);
    let token = FencingToken::new(watched.czxid.unsigned_abs());
    let client = backend.current().map(|session| session.client.clone());
    drop(backend);
    let record = match client {
        Some(client) => match tokio::time::timeout(JUDGE_WITHIN, client.get_data(&path)).await {
            Ok(read) => read.ok(),
            Err(_) => {
                tracing::debug!("zookeeper: an eviction record not read within {JUDGE_WITHIN:?}");
                None
            }
        },
        None => None,
    };
    let evicted = record
        .and_then(|(data, _)| evictions::decode(&data))
        .is_some_and(|e| e.owner == owner && e.token == token);
    let alive = match watched.session.current() {
        Liveness::Alive { until } => SystemClock.now() < until,
        Liveness::Ended => false,
    };
    let reason = match (evicted, alive) {
        (true, _) => LossReason::Evicted,
        (false, true) => LossReason::NotOwner,
        (false, false) => return,
    };
    tracing::warn!(lock = %watched.name, %owner, ?reason, "zookeeper: a grant's node was deleted");
    watched.revoker.revoke(reason);
}
