//! Change feeds (`Backend::changes`): the server's own invalidations of lock keys.
//!
//! A feed opens a connection of its own to each server that holds the locks (the server,
//! the Sentinel master, every Cluster master, every Redlock node) and turns on client-side
//! caching invalidations in broadcasting mode there:
//! `CLIENT TRACKING ON BCAST PREFIX <key prefix>:{<name prefix>` (Redis 6 or later). The
//! server then pushes (RESP3) on that connection the name of every key under that prefix
//! that is written, deleted, expired or evicted, batched per event-loop turn. A key of a
//! lock is turned back into the lock's name ([`Keys::name_in`]); any other key is left
//! out. Nothing is added to the lock path: no script publishes more, no keyspace
//! notification is configured, and the server does this work only while a feed's
//! connection is there.
//!
//! A feed's connection is checked with a `PING` every [`HEARTBEAT`]. One that is lost, that
//! stops answering or (through Sentinel) whose server the backend left for another master
//! is replaced, with a pause that doubles up to [`MAX_PAUSE`] between failed attempts; each
//! connection made after the first is followed by a [`Change::Resync`], as is a flush of
//! the server's tracking state (a `null` invalidation: `FLUSHALL`, `FLUSHDB`). In a
//! Cluster the masters are asked for every [`TOPOLOGY`]: a new master gets a connection
//! (then a resync), one that is no longer a master loses its own. Redlock merges the
//! feeds of its nodes ([`track_node`]); a node that joins later, or comes back, joins with
//! a resync. Dropping the feed ends its tasks, which close their connections.
//!
//! [`Change::Resync`]: leasehold_core::backend::Change::Resync

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::sync::{Arc, Weak};
use std::time::Duration;

use leasehold_core::backend::{ChangeSender, Changes};
use leasehold_core::support::redact_url;
use leasehold_core::{Error, LockName, NamePrefix, Result};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, PushInfo, PushKind, RedisError, Value};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;

use crate::cluster::ClusterNodes;
use crate::connection::{self, Connection};
use crate::error::{is_link_error, map_error, unexpected};
use crate::link::Address;
use crate::listing;
use crate::options::RedisOptions;
use crate::script::{Key, Keys};

/// How long a feed's connection may be quiet before it is asked for a `PING`.
const HEARTBEAT: Duration = Duration::from_secs(5);

/// How often a Cluster's feed asks which nodes are its masters.
const TOPOLOGY: Duration = Duration::from_secs(5);

/// The first pause after a failed connection attempt, doubled up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(100);
const MAX_PAUSE: Duration = Duration::from_secs(5);

/// What one feed follows, how it connects, and where its notices go.
#[derive(Debug, Clone)]
pub(crate) struct Feed {
    /// The backend's name, for [`Error::Unsupported`].
    backend: &'static str,
    options: RedisOptions,
    names: NamePrefix,
    sender: ChangeSender,
}

impl Feed {
    /// A feed of the locks under `names`, for `backend` with `options`, and its receiving end.
    pub(crate) fn new(
        backend: &'static str,
        options: &RedisOptions,
        names: &NamePrefix,
    ) -> (Feed, Changes) {
        let (sender, changes) = Changes::channel();
        let feed = Feed {
            backend,
            options: options.clone(),
            names: names.clone(),
            sender,
        };
        (feed, changes)
    }

    /// The prefix of the keys the server tracks: `<key prefix>:{<name prefix>`.
    fn tracked_prefix(&self) -> String {
        format!("{}:{{{}", self.options.key_prefix(), self.names.as_str())
    }

    /// The lock whose key `key` is, if it is a key of a lock under the feed's prefix.
    fn lock_of(&self, key: &[u8]) -> Option<LockName> {
        Keys::name_in(self.options.key_prefix(), key, &Key::INSPECTED)
            .filter(|name| self.names.matches(name))
    }

    /// Passes on a push message of one of the feed's connections; `lost` is told of its end.
    fn pushed(&self, info: &PushInfo, lost: &Notify) {
        match info.kind {
            PushKind::Invalidate => match info.data.first() {
                Some(Value::Array(keys)) => {
                    for key in keys {
                        let key = match key {
                            Value::BulkString(key) => key.as_slice(),
                            Value::SimpleString(key) => key.as_bytes(),
                            // Not a key as Redis sends them: what it was is unknown.
                            _ => {
                                self.sender.resync();
                                continue;
                            }
                        };
                        if let Some(name) = self.lock_of(key) {
                            self.sender.changed(name);
                        }
                    }
                }
                // `null`: the server flushed its tracking state; every key may have changed.
                _ => self.sender.resync(),
            },
            PushKind::Disconnection => lost.notify_one(),
            _ => {}
        }
    }
}

/// A connection on which the server pushes a feed's invalidations.
struct Tracking {
    conn: MultiplexedConnection,
    /// Told when the connection is lost.
    lost: Arc<Notify>,
}

/// Opens a connection to `url` and turns on the tracking of `feed`'s keys, within the options' connect timeout.
/// It returns once the server has answered `CLIENT TRACKING`, so that every later write of
/// a tracked key is pushed.
///
/// # Errors
///
/// See [`refused`]; [`Error::Unavailable`] also when it takes too long.
async fn open(feed: &Feed, url: &str) -> Result<Tracking> {
    let limit = feed.options.connect_limit();
    let shown = redact_url(url);
    let client = connection::client(url, &feed.options)?;
    let lost = Arc::new(Notify::new());
    let push = {
        let (feed, lost) = (feed.clone(), lost.clone());
        move |info: PushInfo| -> std::result::Result<(), Infallible> {
            feed.pushed(&info, &lost);
            Ok(())
        }
    };
    let config = AsyncConnectionConfig::new()
        .set_push_sender(push)
        .set_connection_timeout(Some(limit))
        .set_response_timeout(Some(limit));
    let opening = async {
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|e| refused(feed.backend, &shown, e))?;
        redis::cmd("CLIENT")
            .arg("TRACKING")
            .arg("ON")
            .arg("BCAST")
            .arg("PREFIX")
            .arg(feed.tracked_prefix())
            .query_async::<()>(&mut conn)
            .await
            .map_err(|e| refused(feed.backend, &shown, e))?;
        Ok(Tracking { conn, lost })
    };
    tokio::time::timeout(limit, opening).await.map_err(|_| {
        Error::unavailable(format!(
            "redis: opening a change feed's connection to {shown} timed out after {limit:?}"
        ))
    })?
}

/// Why a feed's connection to `shown` could not be opened, as a leasehold error.
/// A server without `CLIENT TRACKING` (before Redis 6, or with `CLIENT` renamed away) is
/// [`Error::Unsupported`]; a user that may not run it an [`Error::Backend`] naming the
/// command; a link that fails [`Error::Unavailable`].
fn refused(backend: &'static str, shown: &str, error: RedisError) -> Error {
    if is_link_error(&error) {
        return Error::Unavailable {
            message: format!("redis: cannot open a change feed's connection to {shown}: {error}"),
            source: Some(Arc::new(error)),
        };
    }
    if error.code() == Some("NOPERM") {
        return Error::Backend {
            message: format!(
                "redis: the user at {shown} may not run CLIENT TRACKING, which watching locks \
                 needs (ACL: +client|tracking)"
            ),
            retryable: false,
            source: Some(Arc::new(error)),
        };
    }
    if is_missing_command(&error) {
        return Error::Unsupported {
            backend,
            feature: "a change feed (watching locks): the server has no CLIENT TRACKING \
                      (Redis 6 or later, RESP3)",
        };
    }
    map_error(error, "(CLIENT TRACKING)")
}

/// Whether `error` says the server does not know a command or subcommand.
/// That is `CLIENT TRACKING`, or `HELLO` (RESP3), on a server older than Redis 6.
fn is_missing_command(error: &RedisError) -> bool {
    let text = error.to_string().to_ascii_lowercase();
    text.contains("unknown command") || text.contains("unknown subcommand")
}

/// Where one of a feed's connections goes.
#[derive(Debug, Clone)]
enum Target {
    /// The server at this URL: a server, a Cluster master, a Redlock node.
    Fixed(String),
    /// The master a backend's connection goes to now (through Sentinel).
    Master(Weak<Connection>),
}

impl Target {
    /// The URL to connect to now; `None` once the backend followed is gone.
    fn url(&self) -> Option<String> {
        match self {
            Target::Fixed(url) => Some(url.clone()),
            Target::Master(connection) => {
                let connection = connection.upgrade()?;
                Some(match connection.address() {
                    Address::Sentinel(sentinels) => sentinels.master_url(&connection.serving()),
                    other => other.url().to_owned(),
                })
            }
        }
    }
}

/// Keeps a connection to `target` tracking for `feed` until the watcher drops the feed.
/// `first` is a connection opened already, if any; each one opened here is followed by a
/// resync. With `moves` (through Sentinel), a move of the backend's connection is followed.
async fn keep_tracking(
    feed: Feed,
    target: Target,
    first: Option<Tracking>,
    mut moves: Option<watch::Receiver<u64>>,
) {
    let mut current = first;
    let mut pause = FIRST_PAUSE;
    loop {
        let tracking = match current.take() {
            Some(tracking) => tracking,
            None => {
                let Some(url) = target.url() else {
                    return;
                };
                let attempt = tokio::select! {
                    () = feed.sender.closed() => return,
                    attempt = open(&feed, &url) => attempt,
                };
                match attempt {
                    Ok(tracking) => {
                        feed.sender.resync();
                        pause = FIRST_PAUSE;
                        tracking
                    }
                    Err(error) => {
                        let url = redact_url(&url);
                        if error.is_retryable() {
                            tracing::debug!(%url, %error, "redis: a change feed's connection failed; trying again");
                        } else {
                            tracing::warn!(%url, %error, "redis: a change feed's connection was refused; trying again");
                        }
                        tokio::select! {
                            () = feed.sender.closed() => return,
                            () = tokio::time::sleep(pause) => {}
                            () = moved(&mut moves) => {}
                        }
                        pause = (pause * 2).min(MAX_PAUSE);
                        continue;
                    }
                }
            }
        };
        if !serve(&feed, &tracking, &mut moves).await {
            return;
        }
        tracing::debug!("redis: a change feed's connection is replaced");
    }
}

/// Watches over `tracking` until it is lost, stops answering or is left for another master.
/// `false` once the watcher has dropped the feed.
async fn serve(feed: &Feed, tracking: &Tracking, moves: &mut Option<watch::Receiver<u64>>) -> bool {
    let limit = feed.options.connect_limit();
    let mut heartbeat = tokio::time::interval_at(Instant::now() + HEARTBEAT, HEARTBEAT);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = feed.sender.closed() => return false,
            () = tracking.lost.notified() => return true,
            () = moved(moves) => return true,
            _ = heartbeat.tick() => {
                let mut conn = tracking.conn.clone();
                let ping = redis::cmd("PING");
                let ping = ping.query_async::<()>(&mut conn);
                if !matches!(tokio::time::timeout(limit, ping).await, Ok(Ok(()))) {
                    return true;
                }
            }
        }
    }
}

/// Completes when the backend's connection moves (never without `moves`).
async fn moved(moves: &mut Option<watch::Receiver<u64>>) {
    if let Some(moves) = moves
        && moves.changed().await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

/// A task of a feed, ended when this is dropped.
struct Task(tokio::task::AbortHandle);

impl Task {
    fn spawn(task: impl Future<Output = ()> + Send + 'static) -> Task {
        Task(tokio::spawn(task).abort_handle())
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The change feed of the locks under `names`, from the server(s) `connection` goes to.
/// It returns once they track the prefix for it (in a Cluster: every master).
///
/// # Errors
///
/// As [`open`] on any of them; in a Cluster also the errors of asking for its masters.
pub(crate) async fn server_feed(
    connection: &Arc<Connection>,
    names: &NamePrefix,
) -> Result<Changes> {
    let (feed, changes) = Feed::new("redis", connection.options(), names);
    match connection.address() {
        Address::Fixed(url) => {
            let tracking = open(&feed, url).await?;
            let target = Target::Fixed(url.clone());
            tokio::spawn(keep_tracking(feed, target, Some(tracking), None));
        }
        Address::Sentinel(sentinels) => {
            // Taken first: a move from here on is followed.
            let moves = connection.moves();
            let url = sentinels.master_url(&connection.serving());
            let tracking = open(&feed, &url).await?;
            let target = Target::Master(Arc::downgrade(connection));
            tokio::spawn(keep_tracking(feed, target, Some(tracking), Some(moves)));
        }
        Address::Cluster(nodes) => {
            let masters = masters(connection, nodes).await?;
            let opened =
                futures_util::future::join_all(masters.iter().map(|url| open(&feed, url))).await;
            let opened = opened.into_iter().collect::<Result<Vec<_>>>()?;
            let tasks = masters
                .into_iter()
                .zip(opened)
                .map(|(url, tracking)| {
                    let target = Target::Fixed(url.clone());
                    let task = keep_tracking(feed.clone(), target, Some(tracking), None);
                    (url, Task::spawn(task))
                })
                .collect();
            let (connection, nodes) = (Arc::downgrade(connection), nodes.clone());
            tokio::spawn(follow_masters(connection, nodes, feed, tasks));
        }
    }
    Ok(changes)
}

/// The URL of each master of the Cluster `connection` goes to.
///
/// # Errors
///
/// Those of `CLUSTER SLOTS`, or of a master whose endpoint the Cluster does not say.
async fn masters(connection: &Connection, nodes: &ClusterNodes) -> Result<BTreeSet<String>> {
    let mut link = connection.for_request().await?;
    let slots: Value = connection
        .query(&mut link, redis::cmd("CLUSTER").arg("SLOTS"))
        .await
        .map_err(|e| map_error(e, "(CLUSTER SLOTS)"))?;
    listing::masters(&slots)?
        .into_keys()
        .map(|(host, port)| {
            let host = String::from_utf8(host).map_err(|e| unexpected("CLUSTER SLOTS", e))?;
            if host.is_empty() {
                return Err(Error::backend(
                    "redis: the Cluster does not say where one of its masters is (an unknown \
                     endpoint); a change feed cannot reach it",
                    false,
                ));
            }
            Ok(nodes.node_url(&match host.contains(':') {
                true => format!("[{host}]:{port}"),
                false => format!("{host}:{port}"),
            }))
        })
        .collect()
}

/// Keeps a Cluster's feed on its masters: `tasks` track each of them, by URL.
/// It ends with the feed, or with the backend.
async fn follow_masters(
    connection: Weak<Connection>,
    nodes: ClusterNodes,
    feed: Feed,
    mut tasks: BTreeMap<String, Task>,
) {
    let limit = feed.options.connect_limit();
    loop {
        tokio::select! {
            () = feed.sender.closed() => return,
            () = tokio::time::sleep(TOPOLOGY) => {}
        }
        let Some(conn) = connection.upgrade() else {
            return;
        };
        let asked = tokio::time::timeout(limit, masters(&conn, &nodes)).await;
        drop(conn);
        let now = match asked {
            Ok(Ok(now)) => now,
            Ok(Err(error)) => {
                tracing::debug!(%error, "redis: a change feed could not ask for the Cluster's masters");
                continue;
            }
            Err(_) => continue,
        };
        if now.iter().eq(tasks.keys()) {
            continue;
        }
        tracing::info!(
            masters = now.len(),
            "redis: the Cluster's masters changed; the change feed follows them"
        );
        tasks.retain(|url, _| now.contains(url));
        for url in now {
            tasks.entry(url).or_insert_with_key(|url| {
                let target = Target::Fixed(url.clone());
                Task::spawn(keep_tracking(feed.clone(), target, None, None))
            });
        }
        feed.sender.resync();
    }
}

/// Tracks for `feed` on the Redlock node at `url` until the watcher drops the feed.
/// The outcome of the first attempt goes to `first`; after a failed one it goes on trying
/// in the background, and joins with a resync, as it does when its connection comes back.
pub(crate) async fn track_node(feed: Feed, url: String, first: mpsc::UnboundedSender<Result<()>>) {
    let opened = tokio::select! {
        () = feed.sender.closed() => return,
        opened = open(&feed, &url) => opened,
    };
    let _ = first.send(opened.as_ref().map(|_| ()).map_err(Clone::clone));
    drop(first);
    keep_tracking(feed, Target::Fixed(url), opened.ok(), None).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(key_prefix: &str, names: &str) -> (Feed, Changes) {
        let options = RedisOptions::default().prefix(key_prefix).unwrap();
        Feed::new("redis", &options, &NamePrefix::new(names).unwrap())
    }

    fn invalidated(keys: &[&str]) -> PushInfo {
        let keys = keys
            .iter()
            .map(|k| Value::BulkString(k.as_bytes().to_vec()));
        PushInfo {
            kind: PushKind::Invalidate,
            data: vec![Value::Array(keys.collect())],
        }
    }

    fn drain(changes: &mut Changes) -> Vec<leasehold_core::backend::Change> {
        std::iter::from_fn(|| changes.try_next()).collect()
    }

    #[test]
    fn the_tracked_prefix_is_the_keys_of_the_names_under_the_prefix() {
        assert_eq!(
            feed("leasehold", "jobs:").0.tracked_prefix(),
            "leasehold:{jobs:"
        );
        assert_eq!(feed("app:locks", "").0.tracked_prefix(), "app:locks:{");
    }

    #[test]
    fn invalidated_lock_keys_name_their_lock_and_nothing_else_is_named() {
        use leasehold_core::backend::Change;
        let (feed, mut changes) = feed("leasehold", "jobs:");
        let lost = Notify::new();
        feed.pushed(
            &invalidated(&[
                "leasehold:{jobs:a}:lock",
                "leasehold:{jobs:b}:queue",
                "leasehold:{jobs:c}:evicted",
                // A record beside a lock, a foreign key, another key prefix, another name.
                "leasehold:{jobs:d}:rec:window:1",
                "leasehold:{jobs:e}:other",
                "leaseholder:{jobs:f}:lock",
                "leasehold:{jobsx}:lock",
            ]),
            &lost,
        );
        let name = |n: &str| Change::Lock(LockName::new(n).unwrap());
        assert_eq!(
            drain(&mut changes),
            [name("jobs:a"), name("jobs:b"), name("jobs:c")]
        );
        // A flush of the server's tracking state.
        let flushed = PushInfo {
            kind: PushKind::Invalidate,
            data: vec![Value::Nil],
        };
        feed.pushed(&flushed, &lost);
        assert_eq!(drain(&mut changes), [Change::Resync]);
    }

    #[test]
    fn a_server_without_client_tracking_is_unsupported() {
        // An error reply as the server sends it.
        let error = |text: &str| {
            redis::parse_redis_value(format!("-{text}\r\n").as_bytes())
                .and_then(Value::extract_error)
                .unwrap_err()
        };
        for old in [
            "ERR Unknown subcommand or wrong number of arguments for 'TRACKING'. Try CLIENT HELP",
            "ERR unknown command 'CLIENT', with args beginning with: 'TRACKING'",
            "ERR unknown command 'HELLO'",
        ] {
            assert!(
                matches!(
                    refused("redis", "redis://h:1", error(old)),
                    Error::Unsupported {
                        backend: "redis",
                        ..
                    }
                ),
                "{old}"
            );
        }
        let denied = refused(
            "redis",
            "redis://h:1",
            error("NOPERM this user has no permissions to run the 'client|tracking' command"),
        );
        assert!(
            matches!(&denied, Error::Backend { message, retryable: false, .. }
                if message.contains("CLIENT TRACKING")),
            "{denied:?}"
        );
    }
}
