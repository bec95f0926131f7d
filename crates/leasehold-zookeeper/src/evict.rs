//! Force release: one `multi` deletes a grant's node and writes its marker and record.
//!
//! - **The grant** is found by listing its set's directory: the owner's node, holding, in
//!   the mode asked; its czxid must be the token. The `multi` deletes it at the version
//!   read, so nothing newer is ever evicted.
//! - **The set stays closed** by a lock-delay marker of the evicted owner (its own, if its
//!   grant had a lock-delay, is deleted in the same `multi`: its session is the holder's,
//!   kept alive). The new marker is an ephemeral node of a session opened for it alone,
//!   of the holder's session timeout and a twentieth more: every session says its
//!   negotiated timeout in `#sessions/<id>` (see `session.rs`); where that is missing, the
//!   marker's session asks for a day, and the server grants its longest
//!   (`maxSessionTimeout`), which no holder's session exceeds. The session sends one more
//!   request once the `multi` is applied, and is then let go of without closing, so the
//!   server expires it — and deletes the marker — a whole timeout after the eviction,
//!   whatever the evicting process does: by then the evicted holder, even one cut off
//!   from the ensemble, has passed its session deadline. Waiters watch the marker's
//!   deletion, as they do a vanished holder's.
//! - **The record** is a persistent node `#evictions/<name>/<token>` in the same `multi`;
//!   the last [`KEPT`](leasehold_core::support::evictions::KEPT) of a name stay, older ones
//!   are deleted by the next eviction. The evicted holder's client hears of the deletion by
//!   its watch (see `grants`) and reads the record.

use std::time::Duration;

use leasehold_core::backend::{Eviction, Mode};
use leasehold_core::support::evictions;
use leasehold_core::{Error, LockName, Result};
use zookeeper_client as zk;

use crate::connection::ZooKeeperBackend;
use crate::error::map;
use crate::layout;
use crate::reply::{self, or_empty};

/// How often the `multi` is sent when the record's directory went meanwhile.
const ATTEMPTS: usize = 3;

impl ZooKeeperBackend {
    /// Force-releases the grant `eviction` names (see the module docs).
    /// A grant that is gone, but whose record names this very eviction, was evicted by it
    /// (an attempt whose answer was lost): `true`.
    pub(crate) async fn evict_node(
        &self,
        name: &LockName,
        mode: Mode,
        eviction: &Eviction,
    ) -> Result<bool> {
        let session = self.session().await?;
        let client = &session.client;
        let layout = &self.inner.layout;
        let dir = layout.dir(name, mode);
        let children = or_empty(client.list_children(&dir).await, &dir)?;
        let queue = reply::queue(&children);
        let holds = reply::holding(&queue, mode);
        let found = queue.iter().zip(holds).find(|(c, holds)| {
            *holds && c.mode == mode && c.owner.as_ref() == Some(&eviction.owner)
        });
        let Some((contender, _)) = found else {
            return self.evicted_by(client, name, eviction).await;
        };
        let path = format!("{dir}/{}", contender.node);
        let stat = match client.check_stat(&path).await {
            Ok(Some(stat)) => stat,
            Ok(None) => return self.evicted_by(client, name, eviction).await,
            Err(e) => return Err(map(e, "evicting")),
        };
        if u64::try_from(stat.czxid).ok() != Some(eviction.token.get()) {
            return Ok(false);
        }
        let marker = format!("{dir}/{}", layout::marker_name(&eviction.owner));
        // The grant's own lock-delay marker, deleted in the multi (its session lives on).
        let mut own_marker = children.contains(&layout::marker_name(&eviction.owner));
        let records = layout.evictions(name);
        let record = layout.eviction(name, stat.czxid);
        let data = evictions::encode(eviction).into_bytes();
        // The marker's session, as long as the holder's: its client is dropped unclosed, and
        // the server expires it.
        let said = layout::session_node(layout.root(), stat.ephemeral_owner);
        let holders = match client.get_data(&said).await {
            Ok((data, _)) => std::str::from_utf8(&data)
                .ok()
                .and_then(|ms| ms.parse().ok()),
            Err(_) => None,
        };
        let closer = session
            .open_unclosed(holders.map(Duration::from_millis))
            .await?;
        for _ in 0..ATTEMPTS {
            let older = match client.list_children(&records).await {
                Ok(mut older) => {
                    older.sort_unstable_by(|a, b| b.cmp(a));
                    older.split_off((evictions::KEPT - 1).min(older.len()))
                }
                Err(zk::Error::NoNode) => Vec::new(),
                Err(e) => return Err(map(e, "reading eviction records")),
            };
            let mut multi = closer.new_multi_writer();
            let ephemeral = self.create_options(zk::CreateMode::Ephemeral);
            let persistent = self.create_options(zk::CreateMode::Persistent);
            let mut add = || -> std::result::Result<(), zk::Error> {
                multi.add_delete(&path, Some(stat.version))?;
                if own_marker {
                    multi.add_delete(&marker, None)?;
                }
                multi.add_create(&marker, &[], &ephemeral)?;
                multi.add_create(&record, &data, &persistent)?;
                for old in &older {
                    multi.add_delete(&format!("{records}/{old}"), None)?;
                }
                Ok(())
            };
            add().map_err(|e| map(e, "evicting"))?;
            // Where the marker's create and the record's are in the multi.
            let marker_at = 1 + usize::from(own_marker);
            let record_at = marker_at + 1;
            match multi.commit().await {
                Ok(_) => {
                    heard_after(&closer, &marker).await;
                    return Ok(true);
                }
                // The grant's node is gone or changed: not that grant any more.
                Err(zk::MultiWriteError::OperationFailed { index: 0, .. }) => return Ok(false),
                Err(zk::MultiWriteError::OperationFailed { index, source }) => match source {
                    // The own marker went, or came, since the listing.
                    zk::Error::NoNode if own_marker && index == 1 => own_marker = false,
                    zk::Error::NodeExists if index == marker_at => own_marker = true,
                    // The records' directory is missing (a container: gone once empty).
                    zk::Error::NoNode if index == record_at => {
                        client
                            .mkdir(&records, &self.create_options(zk::CreateMode::Container))
                            .await
                            .map_err(|e| map(e, &format!("creating {records}")))?;
                    }
                    // An old record went meanwhile: read them again.
                    zk::Error::NoNode if index > record_at => {}
                    source => return Err(map(source, "evicting")),
                },
                Err(zk::MultiWriteError::RequestFailed { source }) => {
                    return Err(map(source, "evicting"));
                }
            }
        }
        Err(Error::backend(
            format!("zookeeper: {records} keeps coming and going; cannot evict"),
            true,
        ))
    }
}

impl ZooKeeperBackend {
    /// Whether the record of `eviction`'s token names `eviction` itself: it was applied.
    async fn evicted_by(
        &self,
        client: &zk::Client,
        name: &LockName,
        eviction: &Eviction,
    ) -> Result<bool> {
        let Ok(czxid) = i64::try_from(eviction.token.get()) else {
            return Ok(false);
        };
        let path = self.inner.layout.eviction(name, czxid);
        match client.get_data(&path).await {
            Ok((data, _)) => Ok(evictions::decode(&data).is_some_and(|e| e == *eviction)),
            Err(zk::Error::NoNode) => Ok(false),
            Err(e) => Err(map(e, "reading an eviction record")),
        }
    }
}

/// Sends one more request on the marker's session `closer`, after its `multi` was applied.
/// The server counts a session's timeout from the last request it heard, and it heard
/// the `multi` before applying it: from now on, the marker outlasts the holder's session
/// deadline counted from before the eviction by the whole timeout. Best effort: the
/// twentieth more covers the `multi`'s own time where this fails.
async fn heard_after(closer: &zk::Client, marker: &str) {
    if let Err(e) = closer.check_stat(marker).await {
        tracing::debug!("zookeeper: touching an eviction's marker session: {e}");
    }
}
