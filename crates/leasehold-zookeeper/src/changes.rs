//! The change feed: one persistent recursive watch on the root, on the backend's session.
//! It serves [`Backend::changes`](leasehold_core::Backend::changes).
//!
//! - **The watch** (`addWatch` in PERSISTENT_RECURSIVE mode, ZooKeeper 3.6 or later) is set
//!   on `/<prefix>` before the feed is returned. Every create, delete and data change below
//!   it comes back as an event whose path names a lock: a contender's node (granted,
//!   queued, released, given up, deleted with its expired session, touched when a permit
//!   waiter is granted), a lock-delay marker, a lock's directory. Those of names under the
//!   feed's prefix become notices; the others (other names, the records) are dropped.
//! - **On the backend's session**, not a session of its own: ZooKeeper delivers a watch
//!   event to a session before the answer to any later read of that session, so a read of
//!   the lock after a notice (the backend's `inspect`, on the same session) sees the change,
//!   even where the servers of an ensemble lag one another. Its events travel with the
//!   session's requests. The feed holds no client between events: it never keeps an ended
//!   session open.
//! - **Missed events**: ZooKeeper does not replay a persistent watch's events of a
//!   disconnection (ZOOKEEPER-4698), and zookeeper-client 0.11 does not even register a
//!   persistent watch again on a reconnection (its `SetWatches` leaves them out). So after a
//!   reconnection the feed adds the watch again in the session, and when the session ends
//!   (expired, closed, given up by the backend) in the backend's next one (opened then if
//!   there is none); once it is set, a [`Change::Resync`](leasehold_core::Change) follows.
//! - **Dropped**: the feed's task drops its watcher, and the client removes the watch from
//!   the server (`removeWatches` on the root) unless another feed of the session still
//!   watches it. Feeds add and drop their watches one at a time (see
//!   `Inner::watching`): the client decides on a removal when it handles the drop, so a
//!   removal must never be decided while another feed's watch is being added.

use std::sync::{Arc, Weak};
use std::time::Duration;

use leasehold_core::backend::{ChangeSender, Changes};
use leasehold_core::{Error, NamePrefix, Result};
use tokio::sync::oneshot;
use zookeeper_client as zk;

use crate::connection::{Inner, ZooKeeperBackend};
use crate::error::map;
use crate::layout::Layout;

/// The first pause before setting a lost watch again after a failed attempt.
/// Each failure doubles it, up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(100);

/// The longest pause between two attempts at setting a lost watch again.
const RETRY_MAX: Duration = Duration::from_secs(2);

/// A feed's watch: the watcher of its events, which does not keep its session open.
type Watch = zk::PersistentWatcher;

impl ZooKeeperBackend {
    /// A change feed of the locks under `prefix`, its watch set before it is returned.
    ///
    /// The watch is set by the feed's task: dropping this future before it completes
    /// still leaves the task to add the watch and then drop it (the feed is gone), so a
    /// watch is never left behind and never dropped while another feed adds one.
    pub(crate) async fn open_changes(&self, prefix: &NamePrefix) -> Result<Changes> {
        let (sender, changes) = Changes::channel();
        let (ready, set) = oneshot::channel();
        let backend = self.clone();
        let prefix = prefix.clone();
        tokio::spawn(async move {
            let watch = match backend.add_watch().await {
                Ok(watch) => watch,
                Err(error) => {
                    let _ = ready.send(Err(error));
                    return;
                }
            };
            let _ = ready.send(Ok(()));
            let feed = Feed {
                backend: Arc::downgrade(&backend.inner),
                layout: backend.inner.layout.clone(),
                prefix,
                sender,
            };
            drop(backend);
            feed.run(watch).await;
        });
        set.await
            .map_err(|_| Error::backend("zookeeper: the change feed's task ended", false))??;
        Ok(changes)
    }

    /// Sets the watch on the root in the live session (opened now if there is none).
    async fn add_watch(&self) -> Result<Watch> {
        let session = self.session().await?;
        let root = self.inner.layout.root();
        let _watching = self.inner.watching.lock().await;
        session
            .client
            .watch(root, zk::AddWatchMode::PersistentRecursive)
            .await
            .map_err(|e| map(e, &format!("watching {root}")))
    }
}

/// A feed's task: what it watches and where its notices go.
struct Feed {
    /// The backend, not kept by the feed.
    backend: Weak<Inner>,
    /// Where the locks' nodes are; the root is the path watched.
    layout: Layout,
    prefix: NamePrefix,
    sender: ChangeSender,
}

impl Feed {
    /// Passes the watch's events on as notices until the feed is dropped.
    async fn run(self, mut watch: Watch) {
        // The session was disconnected since the watch was last set.
        let mut disconnected = false;
        loop {
            let event = tokio::select! {
                () = self.sender.closed() => break,
                event = watch.changed() => event,
            };
            if event.event_type != zk::EventType::Session {
                self.node_event(&event.path);
                continue;
            }
            let lost = match event.session_state {
                zk::SessionState::Disconnected => {
                    disconnected = true;
                    false
                }
                // Back in the session: events of the disconnection are lost, and the watch
                // may be too (see the module docs).
                zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly => {
                    disconnected
                }
                // Expired, closed or refused: the watch went with the session, and its
                // watcher must not be read again.
                _ => true,
            };
            if !lost {
                continue;
            }
            tracing::debug!(state = %event.session_state, "zookeeper: a change feed watches again");
            let Some(again) = self.watch_again().await else {
                break;
            };
            self.replace(&mut watch, again).await;
            disconnected = false;
            self.sender.resync();
        }
        // The drop sends the removal: one drop or add at a time (see the module docs).
        match self.backend.upgrade() {
            Some(inner) => {
                let _watching = inner.watching.lock().await;
                drop(watch);
            }
            None => drop(watch),
        }
    }

    /// Puts `again` in the place of `watch`, whose watcher is dropped.
    /// On the same session the server's watch stays (`again` watches the root too); on
    /// another, the old session's watch is removed if that session is still open.
    async fn replace(&self, watch: &mut Watch, again: Watch) {
        let old = std::mem::replace(watch, again);
        match self.backend.upgrade() {
            Some(inner) => {
                let _watching = inner.watching.lock().await;
                drop(old);
            }
            None => drop(old),
        }
    }

    /// Passes on the event of the node at `path`, if it is a lock's under the prefix.
    fn node_event(&self, path: &str) {
        if let Some(name) = self.layout.lock_at(path)
            && self.prefix.matches(&name)
        {
            self.sender.changed(name);
        }
    }

    /// The watch set again on the backend's live session (the same one after a reconnection).
    /// It is tried until it is set, with pauses. `None` when the feed is dropped, the
    /// backend is gone, or the backend refuses for good (the feed then ends, and the
    /// watcher hears of it).
    async fn watch_again(&self) -> Option<Watch> {
        let mut pause = RETRY_FIRST;
        loop {
            let backend = ZooKeeperBackend {
                inner: self.backend.upgrade()?,
            };
            // Not cancelled when the feed is dropped: a watch added is dropped in turn (see
            // the module docs), by the caller.
            let attempt = backend.add_watch().await;
            drop(backend);
            match attempt {
                Ok(watch) => return Some(watch),
                Err(error) if error.is_retryable() => {
                    tracing::debug!(%error, "zookeeper: a change feed cannot watch again yet");
                }
                Err(error) => {
                    tracing::warn!(%error, "zookeeper: a change feed ends: it cannot watch again");
                    return None;
                }
            }
            tokio::select! {
                () = self.sender.closed() => return None,
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(RETRY_MAX);
        }
    }
}
