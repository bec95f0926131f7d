//! The registry: by owner, the node each acquisition has placed or is placing.
//! A release needs it to delete exactly its own node. An entry lives from the acquisition's
//! first create to the answer of its release (or the end of its session), so the registry
//! holds the client's current acquisitions and nothing else.

use std::collections::HashMap;

use leasehold_core::OwnerId;
use zookeeper_client as zk;

use crate::markers::Marker;

/// The placed entries, by owner.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    by_owner: HashMap<OwnerId, Placed>,
}

/// One acquisition's entry.
#[derive(Debug, Clone)]
pub(crate) struct Placed {
    /// The session it was created under.
    pub(crate) session: i64,
    /// Its directory.
    pub(crate) dir: String,
    pub(crate) state: State,
}

/// Whether an acquisition's node is known.
#[derive(Debug, Clone)]
pub(crate) enum State {
    /// Its create went out and no answer came: a node named after its owner may exist.
    Creating,
    /// Its node exists (the create was answered, or the node found by its name).
    Created(Node),
}

/// What the acquisition of an existing node has come to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    /// In the queue, and never answered busy.
    Queued,
    /// Answered busy at least once.
    Waiting,
    /// Waiting, and holding now that the one node in its way was deleted.
    /// Nothing else was able to get in its way (see `reply::sole_blocker`), so it holds
    /// without listing the directory again.
    Woken,
    /// Granted.
    Granted,
}

/// An acquisition's node, as a create or a lookup answered.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    /// Its name in the directory.
    pub(crate) name: String,
    /// Its czxid: the grant's token.
    pub(crate) czxid: i64,
    /// Its data version.
    pub(crate) version: i32,
    pub(crate) stage: Stage,
    /// Its grant's lock-delay marker, recorded before the marker's create goes out.
    /// From then on it may exist until a release deletes it.
    pub(crate) marker: Option<Marker>,
}

impl Node {
    pub(crate) fn new(name: String, stat: &zk::Stat) -> Self {
        Self {
            name,
            czxid: stat.czxid,
            version: stat.version,
            stage: Stage::Queued,
            marker: None,
        }
    }
}

impl Placed {
    /// Its node, once known.
    pub(crate) fn node(&self) -> Option<&Node> {
        match &self.state {
            State::Creating => None,
            State::Created(node) => Some(node),
        }
    }

    /// Its node with the node's path, once known.
    pub(crate) fn node_path(&self) -> Option<(&Node, String)> {
        self.node()
            .map(|node| (node, format!("{}/{}", self.dir, node.name)))
    }
}

impl Registry {
    /// The owner's entry.
    pub(crate) fn get(&self, owner: &OwnerId) -> Option<Placed> {
        self.by_owner.get(owner).cloned()
    }

    /// Records that the owner's create is about to go out in `dir` under `session`.
    /// If the future is dropped or the answer is lost, a release still finds the node by
    /// its name.
    pub(crate) fn creating(&mut self, owner: &OwnerId, session: i64, dir: &str) {
        let dir = dir.to_owned();
        let state = State::Creating;
        self.by_owner.insert(
            owner.clone(),
            Placed {
                session,
                dir,
                state,
            },
        );
    }

    /// Records the owner's node, unless the entry was forgotten meanwhile.
    /// The node's create was answered, or the node was found.
    pub(crate) fn created(&mut self, owner: &OwnerId, node: Node) {
        if let Some(placed) = self.by_owner.get_mut(owner) {
            placed.state = State::Created(node);
        }
    }

    /// Changes the owner's node, if known.
    pub(crate) fn update(&mut self, owner: &OwnerId, change: impl FnOnce(&mut Node)) {
        if let Some(State::Created(node)) = self.by_owner.get_mut(owner).map(|p| &mut p.state) {
            change(node);
        }
    }

    /// Forgets the owner's entry.
    pub(crate) fn forget(&mut self, owner: &OwnerId) -> Option<Placed> {
        self.by_owner.remove(owner)
    }

    /// Forgets every entry placed under the session `id`; returns their lock-delay markers.
    pub(crate) fn forget_session(&mut self, id: i64) -> Vec<Marker> {
        let forgotten = self.by_owner.extract_if(|_, placed| placed.session == id);
        forgotten
            .filter_map(|(_, placed)| placed.node().and_then(|n| n.marker.clone()))
            .collect()
    }
}
