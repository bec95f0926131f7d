//! The watch of this client's grants: one watch stream, one watch per granted key.
//!
//! A grant lives by the session's lease: its holder renews nothing, so it has no renewal
//! at which to learn that its key was deleted by someone else — by an operator's eviction
//! ([`Backend::evict`](leasehold_core::Backend::evict)). So the key of each grant is
//! watched for its deletion, on one stream per backend that carries one watch per key
//! (each with an id this client chose) and that ends with the last grant. A release stops
//! watching its key before it deletes it; any other deletion revokes the grant: as
//! [`LossReason::Evicted`] if the name's eviction record names it (the eviction writes the
//! record in the transaction that deletes the key), else as [`LossReason::NotOwner`] while
//! its session is alive — a session that ended or ran out reports its own loss.
//!
//! A stream that breaks is opened again with every watch still wanted, each from the
//! revision after its grant, so no deletion in between is missed. A watch that etcd
//! cancels (its history compacted) looks its key up instead, and is watched again from
//! that read.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold_core::backend::{Liveness, Revoker, SessionLiveness};
use leasehold_core::clock::{Clock, SystemClock};
use leasehold_core::support::evictions;
use leasehold_core::{FencingToken, LockName, LossReason, OwnerId};
use tokio::sync::mpsc;

use crate::layout::Layout;
use crate::requests;
use crate::rpc::{FilterType, Rpc, WatchCreateRequest, WatchResponse};

/// The first wait before opening the stream again after a failure; it doubles each time.
const RETRY_FIRST: Duration = Duration::from_millis(100);

/// The longest wait between two attempts to open the stream.
const RETRY_MOST: Duration = Duration::from_secs(5);

/// How long the eviction record of a deleted key is waited for, the grant still held.
const JUDGE_WITHIN: Duration = Duration::from_secs(2);

/// The watches of this backend's grants. Clones share them.
#[derive(Debug, Clone)]
pub(crate) struct GrantWatch {
    rpc: Rpc,
    layout: Layout,
    state: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    /// The last watch id handed out.
    last_id: i64,
    /// The watched grants, by owner.
    by_owner: HashMap<OwnerId, Watched>,
    /// The commands to the task serving the stream, while it runs.
    task: Option<mpsc::UnboundedSender<Command>>,
}

/// One watched grant.
#[derive(Debug)]
struct Watched {
    id: i64,
    owner: OwnerId,
    name: LockName,
    key: Vec<u8>,
    /// The key's create revision: the grant's token.
    revision: i64,
    /// The first revision the watch asks for.
    from: i64,
    /// The grant's session, without the grant's own signal.
    session: SessionLiveness,
    revoker: Revoker,
}

impl Watched {
    fn create(&self) -> WatchCreateRequest {
        WatchCreateRequest {
            key: self.key.clone(),
            start_revision: self.from,
            filters: vec![FilterType::Noput.into()],
            watch_id: self.id,
            ..WatchCreateRequest::default()
        }
    }
}

/// What the task serving the stream is asked to do.
#[derive(Debug)]
enum Command {
    Watch(WatchCreateRequest),
    Cancel(i64),
}

impl State {
    /// Sends `command` to the task, starting one if none runs.
    /// A task started here opens the stream with every watch wanted, `command`'s included.
    fn send(&mut self, command: Command, watch: &GrantWatch) {
        if let Some(task) = &self.task
            && task.send(command).is_ok()
        {
            return;
        }
        let (sender, commands) = mpsc::unbounded_channel();
        self.task = Some(sender);
        tokio::spawn(watch.clone().run(commands));
    }

    /// Stops watching the grant of `owner`, if it is watched; returns it.
    fn remove(&mut self, owner: &OwnerId) -> Option<Watched> {
        let watched = self.by_owner.remove(owner)?;
        if let Some(task) = &self.task {
            let _ = task.send(Command::Cancel(watched.id));
        }
        Some(watched)
    }
}

impl GrantWatch {
    pub(crate) fn new(rpc: Rpc, layout: Layout) -> Self {
        Self {
            rpc,
            layout,
            state: Arc::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Watches `key`, created at `revision`, the grant of `owner` on `name`.
    /// Returns `session` made revocable by the watch. The same grant watched again (an
    /// acquire answered twice) shares its watch; another grant of the owner replaces it.
    pub(crate) fn watch(
        &self,
        owner: &OwnerId,
        name: &LockName,
        key: String,
        revision: i64,
        session: SessionLiveness,
    ) -> SessionLiveness {
        let key = key.into_bytes();
        let mut state = self.state();
        if let Some(watched) = state.by_owner.get(owner)
            && watched.key == key
            && watched.revision == revision
        {
            return session.revocable_by(&watched.revoker);
        }
        state.remove(owner);
        state.last_id += 1;
        let watched = Watched {
            id: state.last_id,
            owner: owner.clone(),
            name: name.clone(),
            key,
            revision,
            from: revision + 1,
            session: session.clone(),
            revoker: Revoker::new(),
        };
        let revocable = session.revocable_by(&watched.revoker);
        let create = watched.create();
        state.by_owner.insert(owner.clone(), watched);
        state.send(Command::Watch(create), self);
        revocable
    }

    /// Stops watching the grant of `owner` (before its own release deletes its key).
    pub(crate) fn unwatch(&self, owner: &OwnerId) {
        self.state().remove(owner);
    }

    /// Serves the stream until no grant is watched.
    async fn run(self, mut commands: mpsc::UnboundedReceiver<Command>) {
        let mut retry = RETRY_FIRST;
        loop {
            // Every watch wanted now; commands sent before are covered by it.
            let wanted: Vec<WatchCreateRequest> = {
                let mut state = self.state();
                while commands.try_recv().is_ok() {}
                if state.by_owner.is_empty() {
                    state.task = None;
                    return;
                }
                state.by_owner.values().map(Watched::create).collect()
            };
            let mut stream = match self.rpc.watch(wanted).await {
                Ok(stream) => stream,
                Err(e) => {
                    tracing::debug!("etcd: watching grants: {e}");
                    tokio::time::sleep(retry).await;
                    retry = (retry * 2).min(RETRY_MOST);
                    continue;
                }
            };
            loop {
                let open = tokio::select! {
                    command = commands.recv() => match command {
                        Some(Command::Watch(create)) => stream.create(create),
                        Some(Command::Cancel(id)) => stream.cancel(id),
                        None => return,
                    },
                    answer = stream.answers.message() => match answer {
                        Ok(Some(answer)) => {
                            retry = RETRY_FIRST;
                            for id in self.answered(&answer) {
                                stream.cancel(id);
                            }
                            true
                        }
                        Ok(None) => false,
                        Err(status) => {
                            tracing::debug!("etcd: the watch of grants broke: {status}");
                            false
                        }
                    },
                };
                let mut state = self.state();
                if state.by_owner.is_empty() {
                    // Dropping the stream cancels whatever it still carries.
                    state.task = None;
                    return;
                }
                if !open {
                    break;
                }
            }
            tokio::time::sleep(retry).await;
            retry = (retry * 2).min(RETRY_MOST);
        }
    }

    /// What `answer` says of the grants; returns the watches to cancel.
    fn answered(&self, answer: &WatchResponse) -> Vec<i64> {
        let id = answer.watch_id;
        let deleted = !answer.events.is_empty();
        if !deleted && !answer.canceled {
            return Vec::new();
        }
        let mut state = self.state();
        let Some(owner) = (state.by_owner.values())
            .find(|w| w.id == id)
            .map(|w| w.owner.clone())
        else {
            return Vec::new();
        };
        if deleted {
            // The key is gone: the watch has nothing more to say.
            let watched = state.by_owner.remove(&owner);
            drop(state);
            if let Some(watched) = watched {
                tokio::spawn(self.clone().judge(watched));
            }
            return vec![id];
        }
        // Canceled by etcd (its history compacted, say): look the key up instead. etcd
        // counts a compacted watch until the client cancels it too.
        tracing::debug!(watch = id, reason = %answer.cancel_reason, "etcd: a grant's watch was canceled");
        drop(state);
        tokio::spawn(self.clone().look_up(owner, id));
        vec![id]
    }

    /// Looks up the key of the grant of `owner` watched as `id`, whose watch was canceled.
    /// A key still there is watched again from the read; one that is gone is judged.
    async fn look_up(self, owner: OwnerId, id: i64) {
        let Some(key) = (self.state().by_owner.get(&owner))
            .filter(|w| w.id == id)
            .map(|w| w.key.clone())
        else {
            return;
        };
        tokio::time::sleep(RETRY_FIRST).await;
        let read = self.rpc.range(requests::get(key)).await;
        let gone = {
            let mut state = self.state();
            // Watched again under a new id: a create of the old one still on its way (a
            // stream opened again meanwhile) cannot clash with it.
            let new_id = state.last_id + 1;
            let Some(watched) = state.by_owner.get_mut(&owner).filter(|w| w.id == id) else {
                return;
            };
            match read {
                Ok(read)
                    if read.kvs.first().map(|kv| kv.create_revision) != Some(watched.revision) =>
                {
                    // The task hears of it, and ends if it was the last grant.
                    state.remove(&owner)
                }
                read => {
                    match read {
                        Ok(read) => {
                            watched.from = read.header.map_or(watched.from, |h| h.revision + 1);
                        }
                        Err(e) => tracing::debug!("etcd: looking up a grant's key: {e}"),
                    }
                    watched.id = new_id;
                    let create = watched.create();
                    state.last_id = new_id;
                    state.send(Command::Watch(create), &self);
                    None
                }
            }
        };
        if let Some(watched) = gone {
            self.judge(watched).await;
        }
    }

    /// Revokes the grant whose key was deleted, other than by its own release.
    /// Evicted if the name's eviction record of its token names it, read within
    /// [`JUDGE_WITHIN`]; otherwise not the owner's any more, unless its session has ended
    /// or run out (which says so itself). The read decides only the reason: the grant is
    /// revoked either way once it is answered or has taken too long.
    async fn judge(self, watched: Watched) {
        let record = self.layout.eviction(&watched.name, watched.revision);
        let token = FencingToken::new(watched.revision.unsigned_abs());
        let read = tokio::time::timeout(JUDGE_WITHIN, self.rpc.range(requests::get(record)));
        let evicted = match read.await {
            Ok(Ok(read)) => read
                .kvs
                .first()
                .and_then(|kv| evictions::decode(&kv.value))
                .is_some_and(|e| e.owner == watched.owner && e.token == token),
            Ok(Err(e)) => {
                tracing::debug!("etcd: reading an eviction record: {e}");
                false
            }
            Err(_) => {
                tracing::debug!("etcd: an eviction record not read within {JUDGE_WITHIN:?}");
                false
            }
        };
        let alive = match watched.session.current() {
            Liveness::Alive { until } => SystemClock.now() < until,
            Liveness::Ended => false,
        };
        let reason = match (evicted, alive) {
            (true, _) => LossReason::Evicted,
            (false, true) => LossReason::NotOwner,
            (false, false) => return,
        };
        tracing::warn!(lock = %watched.name, owner = %watched.owner, ?reason,
            "etcd: a grant's key was deleted");
        watched.revoker.revoke(reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grants_watch_asks_for_deletions_of_its_key_from_after_its_grant() {
        let watched = Watched {
            id: 7,
            owner: OwnerId::generate(),
            name: LockName::new("job").unwrap(),
            key: b"job/2a.0".to_vec(),
            revision: 41,
            from: 42,
            session: leasehold_core::backend::SessionKeeper::new(SystemClock.now()).liveness(),
            revoker: Revoker::new(),
        };
        let create = watched.create();
        assert_eq!(
            (create.watch_id, create.start_revision, create.filters),
            (7, 42, vec![FilterType::Noput.into()])
        );
        assert!(create.range_end.is_empty());
    }
}
