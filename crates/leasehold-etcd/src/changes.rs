//! The change feed of a name prefix: one etcd watch over the keys of its names.
//!
//! [`Backend::changes`](leasehold_core::Backend::changes) opens a watch stream with one
//! watch on the key range of the prefix (see [`Layout::names_range`]) and returns once etcd
//! has answered that the watch is created. The watch starts at the store's revision then,
//! so every write after `changes` returns — a contender put or deleted, a lease that runs
//! out and takes its keys with it — reaches the feed. A task of its own reads the stream
//! and names the lock of each event's key; when the stream breaks (the connection dropped,
//! the member left for the next one, etcd canceled the watch) it watches again from the
//! current revision and sends [`Change::Resync`](leasehold_core::Change::Resync), since
//! what happened in between is unknown. It ends, and drops the stream, when the watcher
//! drops the feed: the stream is reset and etcd cancels the watch.

use std::collections::BTreeSet;
use std::time::Duration;

use leasehold_core::backend::{ChangeSender, Changes};
use leasehold_core::{Error, NamePrefix, Result};
use tokio::time::Instant;

use crate::error::map_error;
use crate::layout::Layout;
use crate::rpc::{Rpc, WatchCreateRequest, WatchResponse, Watching};

/// The first wait before watching again after a failure; it doubles with each failure.
const RETRY_FIRST: Duration = Duration::from_millis(100);

/// The longest wait between two attempts to watch again.
const RETRY_MOST: Duration = Duration::from_secs(5);

/// A watch that served this long before it broke is watched again at once.
/// One that broke sooner waits first, so that a member that cancels every watch is not
/// asked again and again without a pause.
const STEADY: Duration = Duration::from_secs(10);

/// What a feed watches, and how.
struct Feed {
    rpc: Rpc,
    layout: Layout,
    prefix: NamePrefix,
    /// How long creating the watch may take.
    within: Duration,
}

/// A feed of the changes of the locks under `prefix`, whose watch is created.
///
/// # Errors
///
/// If etcd cannot be reached within `within`, or refuses the watch (permissions).
pub(crate) async fn start(
    rpc: Rpc,
    layout: Layout,
    prefix: NamePrefix,
    within: Duration,
) -> Result<Changes> {
    let feed = Feed {
        rpc,
        layout,
        prefix,
        within,
    };
    let stream = feed.watch().await?;
    let (sender, changes) = Changes::channel();
    tokio::spawn(feed.run(stream, sender));
    Ok(changes)
}

impl Feed {
    /// A watch stream whose one watch, from the current revision, etcd has created.
    async fn watch(&self) -> Result<Watching> {
        let (key, range_end) = self.layout.names_range(&self.prefix);
        let request = WatchCreateRequest {
            key,
            range_end,
            ..WatchCreateRequest::default()
        };
        let created = async {
            let mut stream = self
                .rpc
                .watch(vec![request])
                .await
                .map_err(|e| map_error(e, "watching locks"))?;
            loop {
                let answer = stream
                    .answers
                    .message()
                    .await
                    .map_err(|e| map_error(e, "watching locks"))?;
                match answer {
                    // etcd answers a watch it refuses as created and canceled at once.
                    Some(answer) if answer.canceled => {
                        return Err(Error::backend(
                            format!("etcd: watching locks: {}", cancel_reason(&answer)),
                            false,
                        ));
                    }
                    Some(answer) if answer.created => return Ok(stream),
                    Some(_) => {}
                    None => {
                        return Err(Error::unavailable(
                            "etcd: watching locks: the stream ended before the watch was created",
                        ));
                    }
                }
            }
        };
        tokio::time::timeout(self.within, created)
            .await
            .map_err(|_| {
                Error::unavailable(format!(
                    "etcd: watching locks: no watch created within {:?}",
                    self.within
                ))
            })?
    }

    /// Forwards what `stream` reports until the watcher drops its feed.
    /// A stream that breaks is replaced by a new watch, and a resync sent once it is created.
    async fn run(self, mut stream: Watching, sender: ChangeSender) {
        let mut retry = RETRY_FIRST;
        loop {
            let since = Instant::now();
            let broken = tokio::select! {
                () = sender.closed() => return,
                broken = self.forward(&mut stream, &sender) => broken,
            };
            drop(stream);
            let prefix = self.prefix.as_str();
            tracing::debug!(prefix, "etcd: the watch of a change feed broke: {broken}");
            if since.elapsed() >= STEADY {
                retry = RETRY_FIRST;
            } else if !pause(&sender, &mut retry).await {
                return;
            }
            stream = loop {
                let watched = tokio::select! {
                    () = sender.closed() => return,
                    watched = self.watch() => watched,
                };
                match watched {
                    Ok(stream) => break stream,
                    Err(e) => {
                        let prefix = self.prefix.as_str();
                        tracing::warn!(prefix, "etcd: watching locks again: {e}");
                        if !pause(&sender, &mut retry).await {
                            return;
                        }
                    }
                }
            };
            // What changed while no watch was in place is unknown.
            sender.resync();
        }
    }

    /// Names the lock of every event `stream` brings, until it breaks; says why it did.
    async fn forward(&self, stream: &mut Watching, sender: &ChangeSender) -> String {
        loop {
            let answer = match stream.answers.message().await {
                Ok(Some(answer)) => answer,
                Ok(None) => return "the stream ended".into(),
                Err(status) => return format!("{}: {}", status.code(), status.message()),
            };
            // A transaction's events come in one answer: each lock is named once.
            let names: BTreeSet<_> = (answer.events.iter())
                .filter_map(|event| event.kv.as_ref())
                .filter_map(|kv| self.layout.lock_of(&kv.key))
                .filter(|name| self.prefix.matches(name))
                .collect();
            for name in names {
                sender.changed(name);
            }
            if answer.canceled {
                return format!("etcd canceled the watch: {}", cancel_reason(&answer));
            }
        }
    }
}

/// Waits `retry`, then doubles it (up to [`RETRY_MOST`]).
/// Returns `false` if the watcher dropped its feed meanwhile.
async fn pause(sender: &ChangeSender, retry: &mut Duration) -> bool {
    let wait = *retry;
    *retry = (wait * 2).min(RETRY_MOST);
    tokio::select! {
        () = sender.closed() => false,
        () = tokio::time::sleep(wait) => true,
    }
}

/// Why etcd canceled a watch, as it says.
fn cancel_reason(answer: &WatchResponse) -> String {
    match (answer.compact_revision, answer.cancel_reason.as_str()) {
        (compacted, _) if compacted > 0 => {
            format!("its start revision was compacted (compacted up to {compacted})")
        }
        (_, "") => "no reason given".into(),
        (_, reason) => reason.to_owned(),
    }
}
