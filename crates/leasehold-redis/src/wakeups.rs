//! Push wake-ups: the release script publishes on the lock's channel whom it wakes (the
//! owners at the head of the queue, or `*` for everyone); the connection's RESP3 push
//! messages land here and wake exactly those waiters of this process.
//!
//! A lock is known here by its wake-up channel, `<prefix>:{<name>}:wake`, the name the
//! scripts are passed to publish on.
//!
//! A waiter reads its versions *before* its acquire is sent, so a message that arrives
//! between the script and the wait is never missed. A name is subscribed the first time
//! one of its waiters is busy (the first wait subscribes and returns at once, so the
//! acquire is retried with the subscription in place).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{AsyncPushSender, SendError};
use redis::{PushInfo, PushKind, Value};
use tokio::sync::watch;

/// Per-lock wake-up state of this process, by the lock's channel.
#[derive(Debug, Default)]
pub(crate) struct Wakeups {
    locks: Mutex<HashMap<String, Channel>>,
}

#[derive(Debug)]
struct Channel {
    /// Bumped by `*` messages, and on reconnection.
    everyone: watch::Sender<u64>,
    /// Bumped by messages naming the owner.
    owners: HashMap<String, watch::Sender<u64>>,
    subscribed: bool,
}

impl Channel {
    fn new() -> Self {
        Self {
            everyone: watch::Sender::new(0),
            owners: HashMap::new(),
            subscribed: false,
        }
    }
}

/// The versions a waiter read before its request was sent (see [`Wakeups::seen`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Seen {
    everyone: u64,
    mine: u64,
    subscribed: bool,
    /// The owner had an entry already: it has been busy before.
    pub(crate) waited: bool,
    /// The owner has an entry now (to forget once granted).
    pub(crate) registered: bool,
}

impl Seen {
    /// What a busy request hands to [`Wakeups::wait`].
    pub(crate) fn ticket(self, channel: &str, owner: Option<&str>) -> Ticket {
        Ticket {
            channel: channel.to_owned(),
            owner: owner.map(str::to_owned),
            everyone: self.everyone,
            mine: self.mine,
            subscribed: self.subscribed,
            retry: None,
        }
    }
}

/// What a waiter knew before its request: pass it back to [`Wakeups::wait`].
#[derive(Debug, Clone)]
pub(crate) struct Ticket {
    /// The lock's channel.
    pub(crate) channel: String,
    owner: Option<String>,
    everyone: u64,
    mine: u64,
    pub(crate) subscribed: bool,
    /// When the server said the state may change on its own (an expiry).
    pub(crate) retry: Option<Duration>,
}

impl Wakeups {
    fn locks(&self) -> std::sync::MutexGuard<'_, HashMap<String, Channel>> {
        self.locks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the versions `owner` (or an observer, `None`) waits from, before its request is
    /// sent. Messages arrive only on a subscribed channel: there the owner gets an entry now,
    /// so that a message naming it after the request cannot be missed. An unsubscribed
    /// channel costs nothing here; the first wait subscribes and has the request retried.
    pub(crate) fn seen(&self, channel: &str, owner: Option<&str>) -> Seen {
        let mut locks = self.locks();
        let Some(entry) = locks.get_mut(channel) else {
            return Seen::default();
        };
        let waited = owner.is_some_and(|owner| entry.owners.contains_key(owner));
        let mine = owner.and_then(|owner| match entry.owners.get(owner) {
            Some(version) => Some(*version.borrow()),
            None if entry.subscribed => {
                let version = watch::Sender::new(0);
                entry.owners.insert(owner.to_owned(), version);
                Some(0)
            }
            None => None,
        });
        Seen {
            everyone: *entry.everyone.borrow(),
            mine: mine.unwrap_or(0),
            subscribed: entry.subscribed,
            waited,
            registered: mine.is_some(),
        }
    }

    /// The waiter `owner` is done (granted or gone).
    pub(crate) fn forget(&self, channel: &str, owner: &str) {
        if let Some(entry) = self.locks().get_mut(channel) {
            entry.owners.remove(owner);
        }
    }

    pub(crate) fn mark_subscribed(&self, channel: &str) {
        self.locks()
            .entry(channel.to_owned())
            .or_insert_with(Channel::new)
            .subscribed = true;
    }

    /// Returns when a message for the ticket's owner (or for everyone) arrived after the
    /// ticket was taken, or after `max`.
    pub(crate) async fn wait(&self, ticket: &Ticket, max: Duration) {
        let (mut everyone, mut mine) = {
            let mut locks = self.locks();
            let entry = locks
                .entry(ticket.channel.clone())
                .or_insert_with(Channel::new);
            let mine = ticket.owner.as_ref().map(|owner| {
                entry
                    .owners
                    .entry(owner.clone())
                    .or_insert_with(|| watch::Sender::new(0))
                    .subscribe()
            });
            (entry.everyone.subscribe(), mine)
        };
        if *everyone.borrow_and_update() != ticket.everyone
            || mine
                .as_mut()
                .is_some_and(|m| *m.borrow_and_update() != ticket.mine)
        {
            return;
        }
        let mine_changed = async {
            match &mut mine {
                Some(m) => {
                    let _ = m.changed().await;
                }
                None => std::future::pending().await,
            }
        };
        let limit = ticket.retry.map_or(max, |retry| retry.min(max));
        tokio::select! {
            _ = everyone.changed() => {}
            () = mine_changed => {}
            () = tokio::time::sleep(limit) => {}
        }
    }

    fn deliver(&self, channel: &str, payload: &str) {
        let locks = self.locks();
        let Some(entry) = locks.get(channel) else {
            return;
        };
        if payload == "*" {
            entry.everyone.send_modify(|v| *v += 1);
            return;
        }
        for owner in payload.split(' ') {
            if let Some(version) = entry.owners.get(owner) {
                version.send_modify(|v| *v += 1);
            }
        }
    }

    /// After a reconnection messages may have been lost: everyone re-checks.
    fn wake_all(&self) {
        for entry in self.locks().values() {
            entry.everyone.send_modify(|v| *v += 1);
        }
    }
}

/// Routes the connection's push messages into [`Wakeups`].
#[derive(Debug, Clone)]
pub(crate) struct Router(pub(crate) Arc<Wakeups>);

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

impl AsyncPushSender for Router {
    fn send(&self, info: PushInfo) -> Result<(), SendError> {
        match info.kind {
            PushKind::Message => {
                if let [channel, payload, ..] = info.data.as_slice()
                    && let (Some(channel), Some(payload)) = (text(channel), text(payload))
                {
                    self.0.deliver(&channel, &payload);
                }
            }
            PushKind::Disconnection => self.0.wake_all(),
            _ => {}
        }
        Ok(())
    }
}
