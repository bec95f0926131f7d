//! The node requests the backend sends: create and list, search, and owner-checked delete.
//! The create of an acquisition's node goes with the listing of its directory; the search
//! finds the node of a create whose answer was lost; the delete of a node is owner-checked
//! (and takes its lock-delay marker with it).

use futures_util::future::join_all;
use leasehold_core::backend::{Release, Request};
use leasehold_core::{Error, OwnerId, Result};
use zookeeper_client as zk;

use crate::connection::ZooKeeperBackend;
use crate::error::map;
use crate::layout;
use crate::registry::{Node, Placed};
use crate::reply::{self, or_empty};
use crate::session::{Session, acls};

/// How many times a create is retried when its directory vanishes after the mkdir.
/// ZooKeeper deletes empty container nodes, so that can happen before the create.
const CREATE_ATTEMPTS: usize = 5;

impl ZooKeeperBackend {
    /// How this client's nodes of `mode` are created.
    pub(crate) fn create_options(&self, mode: zk::CreateMode) -> zk::CreateOptions<'static> {
        mode.with_acls(acls(self.inner.options.digest.is_some()))
    }

    /// Creates my node in `dir` and lists `dir`, back to back.
    /// Returns the node's name and the listing; the node is recorded as the owner's as soon
    /// as the create is answered (even if the listing is refused).
    pub(crate) async fn create_and_list(
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
                    let name = format!("{prefix}{seq}");
                    self.registry()
                        .created(&req.owner, Node::new(name.clone(), &stat));
                    let listed = listed.map_err(|e| map(e, &format!("listing {dir}")))?;
                    return Ok((name, listed));
                }
                // The directory (a container node: the server deletes it once empty), and
                // any missing parent, is created when a create needs it.
                Err(zk::Error::NoNode) => client
                    .mkdir(dir, &self.create_options(zk::CreateMode::Container))
                    .await
                    .map_err(|e| map(e, &format!("creating {dir}")))?,
                Err(e) => return Err(map(e, &format!("creating a node in {dir}"))),
            }
        }
        Err(Error::backend(
            format!("zookeeper: {dir} keeps vanishing before a node can be created in it"),
            true,
        ))
    }

    /// Lists `dir` as the leader has it, after a `sync`.
    /// A follower answers the `sync` once it has applied everything the leader committed
    /// before (a session's requests are answered in order, so the listing waits for it).
    /// For searching for the node of a create whose answer was lost, which another server
    /// may not have applied yet.
    async fn list_synced(&self, client: &zk::Client, dir: &str) -> Result<Vec<String>> {
        let (synced, listed) = tokio::join!(client.sync(dir), client.list_children(dir));
        synced.map_err(|e| map(e, &format!("syncing {dir}")))?;
        or_empty(listed, dir)
    }

    /// Deletes every node of `dir` named after `prefix` except `keep`; returns how many.
    pub(crate) async fn sweep(
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
    /// Returns whether a node was there to delete. An owner whose create went unanswered
    /// has the directory swept for nodes named after it. `session` is the current session.
    pub(crate) async fn delete_node(
        &self,
        session: &Session,
        owner: &OwnerId,
        placed: &Placed,
    ) -> Result<Release> {
        let client = &session.client;
        let Some((node, path)) = placed.node_path() else {
            let children = self.list_synced(client, &placed.dir).await?;
            let mode_prefix = format!("{owner}-");
            let swept = self.sweep(client, &placed.dir, &children, &mode_prefix, None);
            return Ok(if swept.await? > 0 {
                Release::Released
            } else {
                Release::NotHeld
            });
        };
        // The marker is deleted on the session that creates it, so that the delete is
        // ordered after a create still on its way. Only the placed session's lock-delay
        // sessions can be open: an ended session's were left to expire with its markers.
        let mut marker = node.marker.as_ref().and_then(|marker| {
            let delay_client = (session.id == placed.session)
                .then(|| session.open_delay_client(marker.delay, marker.session))
                .flatten()?;
            Some((marker, delay_client))
        });
        let mut version = node.version;
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
                Ok(()) => return Ok(Release::Released),
                Err(zk::Error::NoNode) => return Ok(Release::NotHeld),
                Err(zk::Error::BadVersion) => {
                    // Our node (the path names our owner id) at a version we lost track of.
                    match client.check_stat(&path).await {
                        Ok(Some(stat)) => version = stat.version,
                        Ok(None) => return Ok(Release::NotHeld),
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
    /// If there are several, it takes the lowest (the others are swept later).
    pub(crate) async fn adopt(
        &self,
        client: &zk::Client,
        owner: &OwnerId,
        dir: &str,
        prefix: &str,
    ) -> Result<Option<Placed>> {
        let children = self.list_synced(client, dir).await?;
        let Some(found) = reply::queue(&children)
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
        let mut registry = self.registry();
        registry.created(owner, Node::new(found.node, &stat));
        Ok(registry.get(owner))
    }
}
