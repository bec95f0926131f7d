//! Change feeds (watching locks), a listening session of their own each.
//!
//! A feed's session LISTENs on `<schema>.feed` and, in the same transaction, makes itself a
//! watcher of its prefix (`watch` in `sql/v5.sql`: a row of `<schema>.watchers`, counted in
//! `<schema>.watcher_rows`, which the lock functions read). From that commit on, every
//! grant, release, queue change and eviction of a name under the prefix sends the name on
//! the channel in its own transaction; while nobody watches, a change sends nothing.
//! Messages for names outside the feed's prefix (another feed's) are dropped here.
//!
//! The feed ends when its watcher drops it: the session ends its watching (its row goes,
//! the count with it) and stops listening, and its connection closes. A connection that
//! breaks is opened again, with a [`Change::Resync`](leasehold_core::Change::Resync) once
//! it listens (messages sent meanwhile were lost); the broken session's row is dropped by
//! the next watcher's start or end, or by a sweep.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use leasehold_core::backend::{ChangeSender, Changes};
use leasehold_core::{LockName, NamePrefix, Result};
use tokio::task::JoinHandle;
use tokio_postgres::{AsyncMessage, Client};

use crate::connection::Connector;
use crate::error::map;
use crate::schema::feed_channel;

/// The first and the longest pause before opening a broken feed's session again.
const FIRST_RECONNECT_PAUSE: Duration = Duration::from_millis(50);
const LONGEST_RECONNECT_PAUSE: Duration = Duration::from_secs(2);
/// How long the session's end (its row deleted, UNLISTEN) may take before it is just closed.
const END_LIMIT: Duration = Duration::from_secs(2);
/// How long a watcher's start may take beyond connecting.
/// That covers its wait for the lock transactions already past their look at the watchers
/// (`lock_timeout` of `watch` in `sql/v5.sql`), and its answer.
const START_LIMIT: Duration = Duration::from_secs(3);

/// Starts a feed of the changes of the names under `prefix`.
/// It returns once the session listens and is a watcher.
///
/// # Errors
///
/// [`Error::Unavailable`](leasehold_core::Error::Unavailable) if the server cannot be
/// reached; backend errors from the watcher's start (a role without rights on the table).
pub(crate) async fn start(
    connector: Arc<Connector>,
    schema: &str,
    prefix: &NamePrefix,
) -> Result<Changes> {
    let (sender, changes) = Changes::channel();
    let feed = Feed {
        connector,
        schema: schema.to_owned(),
        prefix: prefix.clone(),
        sender,
    };
    let session = feed.open().await?;
    tokio::spawn(feed.serve(session));
    Ok(changes)
}

/// One feed: what it follows and where its notices go.
struct Feed {
    connector: Arc<Connector>,
    schema: String,
    prefix: NamePrefix,
    sender: ChangeSender,
}

/// A watching session: its client, and the task that drives its connection.
/// The task forwards the messages; dropping the client closes the connection, and the task
/// ends.
struct Session {
    client: Client,
    driver: JoinHandle<()>,
}

impl Feed {
    /// Opens a session that listens and is a watcher of the prefix.
    async fn open(&self) -> Result<Session> {
        let doing = "starting a change feed";
        let (client, mut driver) = self.connector.open().await?;
        let sender = self.sender.clone();
        let prefix = self.prefix.clone();
        let driver = tokio::spawn(async move {
            let mut messages =
                futures_util::stream::poll_fn(move |cx| driver.poll_message(cx)).boxed();
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(note)) => {
                        deliver(&sender, &prefix, note.payload());
                    }
                    Ok(_) => {}
                    Err(error) => {
                        tracing::debug!(%error, "the change feed's connection failed");
                        break;
                    }
                }
            }
        });
        let session = Session { client, driver };
        // One simple query, so the server commits right after `watch` (which locks the
        // counter every grant reads) without waiting for this client. The session's start
        // is read first, as this role (a `SECURITY DEFINER` function reads as the owner,
        // who may not see other roles' sessions), and kept in the session's setting, where
        // `watch` finds it. Names hold no quote (see `LockName`); doubled all the same.
        let start = format!(
            "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT {schema}.advisory_session(); \
             LISTEN \"{channel}\"; SELECT {schema}.watch('{prefix}'); COMMIT",
            schema = self.schema,
            channel = feed_channel(&self.schema),
            prefix = self.prefix.as_str().replace('\'', "''"),
        );
        let started = session.client.batch_execute(&start);
        // Dropped unfinished, the session closes and its transaction is rolled back.
        match tokio::time::timeout(self.connector.timeout() + START_LIMIT, started).await {
            Ok(Ok(())) => Ok(session),
            Ok(Err(error)) => Err(map(error, doing)),
            Err(_) => Err(leasehold_core::Error::unavailable(format!(
                "postgres: {doing}: no answer from {}",
                self.connector.shown()
            ))),
        }
    }

    /// Keeps the feed's session until the watcher drops the feed, then ends it.
    /// A session whose connection broke is opened again.
    async fn serve(self, mut session: Session) {
        loop {
            tokio::select! {
                () = self.sender.closed() => {
                    self.end(session).await;
                    return;
                }
                _ = &mut session.driver => {}
            }
            drop(session);
            let mut pause = FIRST_RECONNECT_PAUSE;
            session = loop {
                let opened = tokio::select! {
                    () = self.sender.closed() => return,
                    opened = async {
                        tokio::time::sleep(pause).await;
                        self.open().await
                    } => opened,
                };
                match opened {
                    Ok(session) => break session,
                    Err(error) => {
                        tracing::debug!(%error, "the change feed could not start again");
                        pause = (pause * 2).min(LONGEST_RECONNECT_PAUSE);
                    }
                }
            };
            // Changes while it was down sent messages nobody received.
            self.sender.resync();
        }
    }

    /// Ends the session's watching (its row and count), stops listening, and closes.
    /// A session that cannot do so in time is closed all the same: its row is then a gone
    /// session's, dropped by the next watcher's start or a sweep.
    async fn end(&self, session: Session) {
        let Session { client, mut driver } = session;
        let sql = format!("SELECT {}.watch(NULL); UNLISTEN *", self.schema);
        match tokio::time::timeout(END_LIMIT, client.batch_execute(&sql)).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::debug!(%error, "ending the change feed's session"),
            Err(_) => tracing::debug!("ending the change feed's session: no answer"),
        }
        // Without a client the connection says goodbye to the server and ends.
        drop(client);
        if tokio::time::timeout(END_LIMIT, &mut driver).await.is_err() {
            driver.abort();
        }
    }
}

/// Passes on a message of the channel: the name of a lock that changed.
/// Names under another feed's prefix are not this feed's; a message that is no lock name
/// was not sent by the schema's functions, and is left out.
fn deliver(sender: &ChangeSender, prefix: &NamePrefix, payload: &str) {
    match LockName::new(payload) {
        Ok(name) if prefix.matches(&name) => sender.changed(name),
        Ok(_) => {}
        Err(error) => tracing::debug!(%error, "a change feed message that names no lock"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_names_under_the_prefix_are_passed_on() {
        let (sender, mut changes) = Changes::channel();
        let prefix = NamePrefix::new("jobs:").unwrap();
        for payload in ["jobs:a", "other", "jobs", "not a name", "jobs:b"] {
            deliver(&sender, &prefix, payload);
        }
        let mut named = Vec::new();
        while let Some(change) = changes.try_next() {
            match change {
                leasehold_core::Change::Lock(name) => named.push(name.as_str().to_owned()),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(named, ["jobs:a", "jobs:b"]);
    }
}
