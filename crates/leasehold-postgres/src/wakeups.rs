//! Push wake-ups by LISTEN/NOTIFY: one connection per backend listens on the schema's
//! channel; the statements that release a lock (or let a group of waiters in, or change an
//! election's leader) notify `<name> <owner> <owner>…` — whom they let in — or `<name> *`,
//! in their own transaction, so the message leaves when the change commits.
//!
//! A waiter registers (takes a [`Ticket`]) *before* its request is sent: a message that
//! arrives between the server's answer and the wait is not missed. Per-name state lives only
//! while a ticket for the name does.
//!
//! Where LISTEN is impossible (a transaction-pooling proxy) or the listening connection is
//! down, waits fall back to polling: soon at first, less often the longer the owner waits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_postgres::AsyncMessage;

use crate::connection::Connector;

/// The shortest and longest pause between two polls.
const FIRST_POLL: Duration = Duration::from_millis(5);
const LONGEST_POLL: Duration = Duration::from_millis(200);
/// The longest pause between two attempts to connect the listening connection.
const LONGEST_RECONNECT_PAUSE: Duration = Duration::from_secs(2);

/// The wake-up state of one backend.
#[derive(Debug)]
pub(crate) struct Wakeups {
    names: Mutex<HashMap<Arc<str>, Entry>>,
    /// Whether the listening connection listens, and how many times it has started to.
    listener: watch::Sender<Listener>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Listener {
    listening: bool,
    /// Bumped on every (re)start: messages sent meanwhile may be lost, so every waiter
    /// looks again.
    generation: u64,
}

/// One name's messages so far.
#[derive(Debug)]
struct Entry {
    tickets: usize,
    versions: watch::Sender<Versions>,
}

#[derive(Debug, Clone, Default)]
struct Versions {
    /// Bumped by `*` messages.
    everyone: u64,
    /// Bumped by messages naming the owner; an owner is here while it has a ticket.
    owners: HashMap<Arc<str>, (u64, usize)>,
}

/// What a waiter knew before its request was sent. Dropping it forgets the registration.
#[derive(Debug)]
pub(crate) struct Ticket {
    wakeups: Arc<Wakeups>,
    name: Arc<str>,
    owner: Option<Arc<str>>,
    everyone: u64,
    mine: u64,
    generation: u64,
}

impl Wakeups {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            names: Mutex::default(),
            listener: watch::Sender::new(Listener::default()),
        })
    }

    fn names(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, Entry>> {
        self.names.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Completes when the listening connection listens.
    pub(crate) async fn until_listening(&self) {
        let mut listener = self.listener.subscribe();
        let _ = listener.wait_for(|l| l.listening).await;
    }

    /// Registers `owner` (or an observer: `None`) as waiting for `name`; call before the
    /// request is sent.
    pub(crate) fn ticket(self: &Arc<Self>, name: &str, owner: Option<&str>) -> Ticket {
        let generation = self.listener.borrow().generation;
        let key: Arc<str> = Arc::from(name);
        let mut names = self.names();
        let entry = names.entry(key.clone()).or_insert_with(|| Entry {
            tickets: 0,
            versions: watch::Sender::new(Versions::default()),
        });
        entry.tickets += 1;
        let owner: Option<Arc<str>> = owner.map(Arc::from);
        let mut mine = 0;
        entry.versions.send_modify(|v| {
            if let Some(owner) = &owner {
                let (version, tickets) = v.owners.entry(owner.clone()).or_insert((0, 0));
                *tickets += 1;
                mine = *version;
            }
        });
        let everyone = entry.versions.borrow().everyone;
        Ticket {
            wakeups: self.clone(),
            name: key,
            owner,
            everyone,
            mine,
            generation,
        }
    }

    fn forget(&self, ticket: &Ticket) {
        let mut names = self.names();
        let Some(entry) = names.get_mut(&ticket.name) else {
            return;
        };
        if let Some(owner) = &ticket.owner {
            entry.versions.send_if_modified(|v| {
                if let Some((_, tickets)) = v.owners.get_mut(owner) {
                    *tickets -= 1;
                    if *tickets == 0 {
                        v.owners.remove(owner);
                    }
                }
                false
            });
        }
        entry.tickets -= 1;
        if entry.tickets == 0 {
            names.remove(&ticket.name);
        }
    }

    /// A message from the channel: `<name> *` or `<name> <owner>…`.
    fn deliver(&self, payload: &str) {
        let mut parts = payload.split(' ');
        let Some(name) = parts.next() else {
            return;
        };
        let names = self.names();
        let Some(entry) = names.get(name) else {
            return;
        };
        entry.versions.send_if_modified(|v| {
            let mut changed = false;
            for owner in parts {
                if owner == "*" {
                    v.everyone += 1;
                    changed = true;
                } else if let Some((version, _)) = v.owners.get_mut(owner) {
                    *version += 1;
                    changed = true;
                }
            }
            changed
        });
    }

    fn set_listening(&self, listening: bool) {
        self.listener.send_modify(|l| {
            l.listening = listening;
            if listening {
                l.generation += 1;
            }
        });
    }

    /// Returns when a message for the ticket's owner (or for everyone) arrived after the
    /// ticket was taken, the listening connection restarted, or `limit` passed. Without a
    /// listening connection, `limit` is at most `poll`.
    pub(crate) async fn wait(&self, ticket: &Ticket, limit: Duration, poll: Duration) {
        let mut listener = self.listener.subscribe();
        let current = *listener.borrow_and_update();
        if current.generation != ticket.generation {
            return;
        }
        let limit = if current.listening {
            limit
        } else {
            limit.min(poll)
        };
        let Some(mut versions) = self
            .names()
            .get(&ticket.name)
            .map(|e| e.versions.subscribe())
        else {
            return;
        };
        let woken = versions.wait_for(|v| {
            v.everyone != ticket.everyone
                || ticket
                    .owner
                    .as_ref()
                    .is_some_and(|o| v.owners.get(o).is_some_and(|(n, _)| *n != ticket.mine))
        });
        tokio::select! {
            _ = woken => {}
            _ = listener.changed() => {}
            () = tokio::time::sleep(limit) => {}
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.wakeups.forget(self);
    }
}

/// The pause before the next poll of an owner that has been waiting `waited`.
pub(crate) fn poll_pause(waited: Option<Duration>) -> Duration {
    waited.map_or(FIRST_POLL, |w| (w / 4).clamp(FIRST_POLL, LONGEST_POLL))
}

/// The listening connection: connects, listens on `channel`, delivers messages; on any
/// failure starts over after a pause. Ends when the backend is gone.
pub(crate) fn spawn_listener(
    wakeups: &Arc<Wakeups>,
    connector: Arc<Connector>,
    channel: String,
) -> JoinHandle<()> {
    let wakeups = Arc::downgrade(wakeups);
    tokio::spawn(async move {
        let mut pause = Duration::from_millis(50);
        loop {
            listen_once(&wakeups, &connector, &channel).await;
            let Some(live) = wakeups.upgrade() else {
                return;
            };
            live.set_listening(false);
            drop(live);
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(LONGEST_RECONNECT_PAUSE);
        }
    })
}

async fn listen_once(wakeups: &Weak<Wakeups>, connector: &Connector, channel: &str) {
    let (client, mut driver) = match connector.open().await {
        Ok(opened) => opened,
        Err(error) => {
            tracing::debug!(%error, "the wake-up connection could not connect");
            return;
        }
    };
    let mut messages = futures_util::stream::poll_fn(move |cx| driver.poll_message(cx)).boxed();
    let statement = format!("LISTEN \"{channel}\"");
    let listen = client.batch_execute(&statement);
    tokio::pin!(listen);
    // Drive the connection until LISTEN is answered.
    loop {
        tokio::select! {
            listened = &mut listen => match listened {
                Ok(()) => break,
                Err(error) => {
                    tracing::debug!(%error, "LISTEN failed");
                    return;
                }
            },
            message = messages.next() => match message {
                Some(Ok(message)) => deliver(wakeups, message),
                _ => return,
            },
        }
    }
    match wakeups.upgrade() {
        Some(live) => live.set_listening(true),
        None => return,
    }
    while let Some(Ok(message)) = messages.next().await {
        deliver(wakeups, message);
    }
    tracing::debug!("the wake-up connection ended");
}

fn deliver(wakeups: &Weak<Wakeups>, message: AsyncMessage) {
    if let AsyncMessage::Notification(note) = message
        && let Some(live) = wakeups.upgrade()
    {
        live.deliver(note.payload());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_message_after_the_ticket_wakes_its_owner_only() {
        let wakeups = Wakeups::new();
        wakeups.set_listening(true);
        let a = wakeups.ticket("n", Some("a"));
        let b = wakeups.ticket("n", Some("b"));
        wakeups.deliver("n a");
        let long = Duration::from_secs(30);
        tokio::time::timeout(Duration::from_secs(5), wakeups.wait(&a, long, long))
            .await
            .expect("a was woken");
        assert!(
            tokio::time::timeout(Duration::from_millis(50), wakeups.wait(&b, long, long))
                .await
                .is_err(),
            "b was woken by a message for a"
        );
        wakeups.deliver("n *");
        tokio::time::timeout(Duration::from_secs(5), wakeups.wait(&b, long, long))
            .await
            .expect("b was woken by *");
        drop((a, b));
        assert!(wakeups.names().is_empty(), "state left after the tickets");
    }

    #[tokio::test]
    async fn without_a_listener_waits_poll_and_a_restart_wakes_everyone() {
        let wakeups = Wakeups::new();
        let ticket = wakeups.ticket("n", None);
        let long = Duration::from_secs(30);
        tokio::time::timeout(
            Duration::from_secs(5),
            wakeups.wait(&ticket, long, Duration::from_millis(10)),
        )
        .await
        .expect("polled");
        // Taken before the listener started: messages may have been missed since.
        wakeups.set_listening(true);
        tokio::time::timeout(Duration::from_secs(5), wakeups.wait(&ticket, long, long))
            .await
            .expect("woken by the restart");
        assert_eq!(poll_pause(None), FIRST_POLL);
        assert_eq!(poll_pause(Some(Duration::from_secs(60))), LONGEST_POLL);
    }
}
