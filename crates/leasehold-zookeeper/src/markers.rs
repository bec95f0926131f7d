//! Lock-delay markers: one beside the node of each grant with a lock-delay.
//! The marker is ephemeral, owned by a lock-delay session whose timeout is longer by the
//! delay (see `session.rs`). A marker whose owner has no node left closes the lock until
//! that session expires; a release deletes it with the node.

use std::time::Duration;

use futures_util::future::join_all;
use leasehold_core::Result;
use leasehold_core::backend::Request;
use zookeeper_client as zk;

use crate::connection::ZooKeeperBackend;
use crate::error::map;
use crate::layout;
use crate::registry::Placed;
use crate::reply::Contender;
use crate::session::Session;

/// A grant's lock-delay marker.
#[derive(Debug, Clone)]
pub(crate) struct Marker {
    /// Its path.
    pub(crate) path: String,
    /// The lock-delay whose session owns it.
    pub(crate) delay: Duration,
    /// That session's id.
    pub(crate) session: i64,
    /// Its create was answered (or found it there).
    pub(crate) created: bool,
}

impl ZooKeeperBackend {
    /// Creates the lock-delay marker of `placed`'s grant, owned by the session of `delay`.
    /// The marker is created beside the granted node (which keeps the directory from
    /// vanishing), and recorded before its create goes out: a release deletes it whatever
    /// became of the create (dropped, unanswered).
    pub(crate) async fn put_marker(
        &self,
        session: &Session,
        req: &Request,
        placed: &Placed,
        delay: Duration,
    ) -> Result<()> {
        // A marker recorded under a lock-delay session that expired since went with it:
        // this one is counted under the new session.
        let counted = placed
            .node()
            .and_then(|n| n.marker.as_ref())
            .map(|m| m.session);
        let client = session.delay_client(delay, counted).await?;
        let path = format!("{}/{}", placed.dir, layout::marker_name(&req.owner));
        self.registry().update(&req.owner, |node| {
            node.marker = Some(Marker {
                path: path.clone(),
                delay,
                session: client.session_id().0,
                created: false,
            });
        });
        let options = self.create_options(zk::CreateMode::Ephemeral);
        match client.create(&path, &[], &options).await {
            Ok(_) | Err(zk::Error::NodeExists) => {
                self.registry().update(&req.owner, |node| {
                    if let Some(marker) = &mut node.marker {
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
/// This is best effort: one that stays goes when its session expires.
pub(crate) async fn delete(session: &Session, markers: Vec<Marker>) {
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

/// The paths of the lock-delay markers of holders that vanished without releasing.
/// They are the markers among `children` of `dir` whose owner has no node in `queue`.
pub(crate) fn orphans(children: &[String], queue: &[Contender], dir: &str) -> Vec<String> {
    children
        .iter()
        .filter_map(|child| {
            let owner = layout::marker_owner(child)?;
            let present = queue.iter().any(|c| c.owner.as_ref() == Some(&owner));
            (!present).then(|| format!("{dir}/{child}"))
        })
        .collect()
}
