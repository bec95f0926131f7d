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
//!
//! State is kept per name only while something needs it: a channel is in use while a
//! waiter of this process is registered on it or an observer waits on it. A channel that
//! nobody has used for [`LINGER`] is dropped and unsubscribed by a background sweep (see
//! [`Wakeups::sweep`]), so a client that locks millions of names holds state only for
//! those in use. The linger keeps a name that is contended again soon from paying a new
//! `SUBSCRIBE` round trip each time. Uncontended locks never touch any of this.
//!
//! `SUBSCRIBE` and `UNSUBSCRIBE` of one connection are sent one at a time (an async mutex),
//! so that the server applies them in the order this state changed: a name dropped and then
//! needed again is unsubscribed before it is subscribed anew, never after. Channels asked
//! for while one is under way go together in the next `SUBSCRIBE`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use leasehold_core::{Error, Result};
use redis::aio::{AsyncPushSender, ConnectionManager, SendError};
use redis::{PushInfo, PushKind, Value};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::connection::Connection;

/// How long a channel nobody uses stays subscribed.
pub(crate) const LINGER: Duration = Duration::from_secs(1);

/// Most channels one `UNSUBSCRIBE` names.
const UNSUBSCRIBE_BATCH: usize = 1000;

/// Per-lock wake-up state of this process, by the lock's channel.
#[derive(Debug, Default)]
pub(crate) struct Wakeups {
    state: Mutex<State>,
    /// Held while a `SUBSCRIBE` or `UNSUBSCRIBE` is under way.
    order: tokio::sync::Mutex<()>,
    /// Wakes the sweep when a channel goes unused (only while the sweep has nothing to do).
    idle: Notify,
    /// The backend is gone: the sweep ends.
    closed: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    channels: HashMap<Arc<str>, Channel>,
    /// Channels waiting for a `SUBSCRIBE`: whoever sends the next one names them all.
    pending: Vec<Arc<str>>,
    /// Channels the server may have us subscribed to although they are not in `channels`:
    /// a `SUBSCRIBE` whose answer never came, an `UNSUBSCRIBE` that failed. The sweep
    /// unsubscribes them.
    strays: Vec<Arc<str>>,
    /// The sweep is parked until a channel goes unused.
    sweep_parked: bool,
    /// Bumped when the connection is replaced: a `SUBSCRIBE` sent before is not on the
    /// new one.
    generation: u64,
    /// Stamps channels, so that a ticket of a dropped channel is not mistaken for one of a
    /// channel made again under the same name (0: never subscribed).
    epochs: u64,
}

#[derive(Debug)]
struct Channel {
    epoch: u64,
    /// Bumped by `*` messages, and on reconnection.
    everyone: watch::Sender<u64>,
    /// Bumped by messages naming the owner: the waiters of this process registered here.
    owners: HashMap<String, watch::Sender<u64>>,
    /// Observers (no owner) waiting now.
    watchers: usize,
    /// Since when nobody uses the channel.
    unused_since: Option<Instant>,
}

impl Channel {
    fn in_use(&self) -> bool {
        !self.owners.is_empty() || self.watchers > 0
    }
}

/// The versions a waiter read before its request was sent (see [`Wakeups::seen`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Seen {
    everyone: u64,
    mine: u64,
    /// The channel's epoch; 0 if it is not subscribed.
    epoch: u64,
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
            epoch: self.epoch,
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
    epoch: u64,
    /// When the server said the state may change on its own (an expiry).
    pub(crate) retry: Option<Duration>,
}

impl Ticket {
    /// Whether the channel was subscribed when the ticket was taken.
    pub(crate) fn subscribed(&self) -> bool {
        self.epoch != 0
    }
}

impl State {
    /// Marks `channel` unused if nobody uses it now; whether the sweep must be woken.
    fn maybe_unused(&mut self, channel: &str) -> bool {
        let Some(entry) = self.channels.get_mut(channel) else {
            return false;
        };
        if entry.in_use() || entry.unused_since.is_some() {
            return false;
        }
        entry.unused_since = Some(Instant::now());
        std::mem::take(&mut self.sweep_parked)
    }
}

impl Wakeups {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the versions `owner` (or an observer, `None`) waits from, before its request is
    /// sent. Messages arrive only on a subscribed channel: there the owner gets an entry now,
    /// so that a message naming it after the request cannot be missed. An unsubscribed
    /// channel costs nothing here; the first wait subscribes and has the request retried.
    pub(crate) fn seen(&self, channel: &str, owner: Option<&str>) -> Seen {
        let mut state = self.state();
        let Some(entry) = state.channels.get_mut(channel) else {
            return Seen::default();
        };
        let mut seen = Seen {
            everyone: *entry.everyone.borrow(),
            epoch: entry.epoch,
            ..Seen::default()
        };
        if let Some(owner) = owner {
            seen.registered = true;
            match entry.owners.get(owner) {
                Some(version) => {
                    seen.waited = true;
                    seen.mine = *version.borrow();
                }
                None => {
                    entry.owners.insert(owner.to_owned(), watch::Sender::new(0));
                    entry.unused_since = None;
                }
            }
        }
        seen
    }

    /// The waiter `owner` is done (granted or gone).
    pub(crate) fn forget(&self, channel: &str, owner: &str) {
        let mut state = self.state();
        let Some(entry) = state.channels.get_mut(channel) else {
            return;
        };
        if entry.owners.remove(owner).is_some() && state.maybe_unused(channel) {
            drop(state);
            self.idle.notify_one();
        }
    }

    /// Whether the channel's state may have changed since `ticket` was taken (its channel
    /// was dropped, or dropped and made again): then the caller must look again.
    fn gone(state: &State, ticket: &Ticket) -> bool {
        state
            .channels
            .get(ticket.channel.as_str())
            .is_none_or(|entry| entry.epoch != ticket.epoch)
    }

    /// Subscribes to `channel` (unless that is done already), together with the channels
    /// others asked for meanwhile. Until it is subscribed, a channel has no state here:
    /// messages on it are dropped and its waiters are not registered.
    ///
    /// The connection is taken once it is this call's turn; if it was replaced meanwhile,
    /// the channels are strays and the caller looks again (and subscribes on the new one).
    ///
    /// # Cancel safety
    ///
    /// If the future is dropped after the `SUBSCRIBE` went out, its channels are
    /// unsubscribed by a later sweep (unless needed again meanwhile); if before, the channel
    /// goes with the next `SUBSCRIBE`, and is swept once unused.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] if the `SUBSCRIBE` fails, or a stalled connection cannot be
    /// replaced.
    pub(crate) async fn subscribe(&self, connection: &Connection, channel: &str) -> Result<()> {
        {
            let mut state = self.state();
            if state.channels.contains_key(channel) {
                return Ok(());
            }
            state.pending.push(Arc::from(channel));
        }
        let _order = self.order.lock().await;
        let (batch, generation) = {
            let mut state = self.state();
            if state.channels.contains_key(channel) {
                // Subscribed by the SUBSCRIBE of someone who asked at the same time.
                return Ok(());
            }
            let mut batch = std::mem::take(&mut state.pending);
            batch.sort_unstable();
            batch.dedup();
            batch.retain(|name| !state.channels.contains_key(name));
            if !batch.iter().any(|name| &**name == channel) {
                // Taken by a SUBSCRIBE that failed: ask again.
                batch.push(Arc::from(channel));
            }
            (batch, state.generation)
        };
        let mut conn = connection.for_request().await?;
        // Strays unless the subscription is confirmed.
        let mut strays = Strays {
            wakeups: self,
            channels: batch,
        };
        let names: Vec<&str> = strays.channels.iter().map(|name| &**name).collect();
        conn.subscribe(&names)
            .await
            .map_err(|e| Error::Unavailable {
                message: format!("redis: subscribing to wake-ups failed: {e}"),
                source: Some(Arc::new(e)),
            })?;
        let mut state = self.state();
        if state.generation != generation {
            // The connection was replaced meanwhile: whether they are subscribed on the new
            // one is not known, so they are strays; the caller looks again.
            drop(state);
            return Ok(());
        }
        let batch = std::mem::take(&mut strays.channels);
        let now = Instant::now();
        for name in batch {
            state.epochs += 1;
            let epoch = state.epochs;
            state.channels.insert(
                name,
                Channel {
                    epoch,
                    everyone: watch::Sender::new(0),
                    owners: HashMap::new(),
                    watchers: 0,
                    // Unused until the acquire that asked for it is retried.
                    unused_since: Some(now),
                },
            );
        }
        if std::mem::take(&mut state.sweep_parked) {
            drop(state);
            self.idle.notify_one();
        }
        Ok(())
    }

    /// Returns when a message for the ticket's owner (or for everyone) arrived after the
    /// ticket was taken, or after `max`; at once if the channel was dropped since.
    pub(crate) async fn wait(&self, ticket: &Ticket, max: Duration) {
        let (mut everyone, mut mine, _watching) = {
            let mut state = self.state();
            if Self::gone(&state, ticket) {
                return;
            }
            let Some(entry) = state.channels.get_mut(ticket.channel.as_str()) else {
                return;
            };
            entry.unused_since = None;
            let (mine, watching) = match &ticket.owner {
                Some(owner) => {
                    let version = entry
                        .owners
                        .entry(owner.clone())
                        .or_insert_with(|| watch::Sender::new(0));
                    (Some(version.subscribe()), None)
                }
                None => {
                    entry.watchers += 1;
                    let watching = Watching {
                        wakeups: self,
                        ticket,
                    };
                    (None, Some(watching))
                }
            };
            (entry.everyone.subscribe(), mine, watching)
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

    /// Drops the channels unused for [`LINGER`] and unsubscribes them (and the strays) on
    /// `connection`, each `UNSUBSCRIBE` bounded by `limit`. Channels whose `UNSUBSCRIBE`
    /// failed are tried again by the next sweep.
    pub(crate) async fn sweep(&self, connection: &Connection, limit: Duration) {
        let _order = self.order.lock().await;
        let now = Instant::now();
        let (names, mut conn) = {
            let mut state = self.state();
            let state = &mut *state;
            // Names asked for by subscribers that were cancelled before their SUBSCRIBE
            // (one still waiting finds its name gone and asks again).
            state.pending.clear();
            let mut names = std::mem::take(&mut state.strays);
            names.retain(|name| !state.channels.contains_key(name));
            state.channels.retain(|name, entry| {
                let drop = !entry.in_use()
                    && entry
                        .unused_since
                        .is_some_and(|since| now.duration_since(since) >= LINGER);
                if drop {
                    names.push(name.clone());
                }
                !drop
            });
            // Taken with the names: a replacement either came before, and subscribed them
            // on this connection, or comes after and finds them gone (see `replaced`).
            (names, connection.current())
        };
        for (i, batch) in names.chunks(UNSUBSCRIBE_BATCH).enumerate() {
            let batch: Vec<&str> = batch.iter().map(|name| &**name).collect();
            match tokio::time::timeout(limit, conn.unsubscribe(&batch)).await {
                Ok(Ok(())) => {}
                failed => {
                    tracing::debug!(
                        ?failed,
                        "redis: unsubscribing unused wake-up channels failed; trying again later"
                    );
                    let mut state = self.state();
                    let state = &mut *state;
                    let rest = names[i * UNSUBSCRIBE_BATCH..]
                        .iter()
                        .filter(|name| !state.channels.contains_key(*name))
                        .cloned();
                    state.strays.extend(rest);
                    return;
                }
            }
        }
    }

    /// When the next sweep has something to do, waiting until a channel goes unused if
    /// none is; `None` once [`close`](Wakeups::close)d.
    pub(crate) async fn next_sweep(&self) -> Option<Instant> {
        loop {
            if self.closed.load(Ordering::Acquire) {
                return None;
            }
            {
                let mut state = self.state();
                let oldest = state
                    .channels
                    .values()
                    .filter(|entry| !entry.in_use())
                    .filter_map(|entry| entry.unused_since)
                    .min();
                if !state.strays.is_empty() {
                    // Not at once: an UNSUBSCRIBE that just failed is not tried again in a
                    // loop while the server is away.
                    return Some(Instant::now() + LINGER);
                }
                if let Some(oldest) = oldest {
                    return Some(oldest + LINGER);
                }
                state.sweep_parked = true;
            }
            self.idle.notified().await;
        }
    }

    /// The backend is gone: the sweep ends.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.idle.notify_one();
    }

    /// How many channels this process keeps state for.
    pub(crate) fn channels(&self) -> usize {
        self.state().channels.len()
    }

    fn deliver(&self, channel: &str, payload: &str) {
        let state = self.state();
        let Some(entry) = state.channels.get(channel) else {
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

    /// Subscribes every channel in use on `conn`, a new connection that replaces the one
    /// they were subscribed on. Without waiting for [`order`](Wakeups::order): nothing else
    /// is sent on `conn` yet, and a `SUBSCRIBE` or `UNSUBSCRIBE` stuck on the connection
    /// being replaced holds it. A channel subscribed there after this took the list is
    /// not on `conn`: its waiters come back to the server on their own (every third of
    /// the lease), as after any lost message.
    ///
    /// # Cancel safety
    ///
    /// Dropped, the new connection is not used (its subscriptions go with it).
    ///
    /// Returns the channels subscribed: pass them to [`replaced`](Wakeups::replaced) when
    /// `conn` takes the old one's place.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] if the `SUBSCRIBE` fails.
    pub(crate) async fn subscribe_all(
        &self,
        conn: &mut ConnectionManager,
    ) -> Result<Vec<Arc<str>>> {
        let names: Vec<Arc<str>> = self.state().channels.keys().cloned().collect();
        if names.is_empty() {
            return Ok(names);
        }
        let listed: Vec<&str> = names.iter().map(|name| &**name).collect();
        conn.subscribe(&listed)
            .await
            .map_err(|e| Error::Unavailable {
                message: format!("redis: subscribing to wake-ups on a new connection failed: {e}"),
                source: Some(Arc::new(e)),
            })?;
        Ok(names)
    }

    /// Puts the new connection in place (`swap`), on which [`subscribe_all`] subscribed
    /// `subscribed`: those dropped since are strays there, for the sweep to unsubscribe.
    ///
    /// [`subscribe_all`]: Wakeups::subscribe_all
    pub(crate) fn replaced(&self, subscribed: Vec<Arc<str>>, swap: impl FnOnce()) {
        let mut state = self.state();
        swap();
        state.generation += 1;
        let before = state.strays.len();
        let dropped: Vec<Arc<str>> = subscribed
            .into_iter()
            .filter(|name| !state.channels.contains_key(name))
            .collect();
        state.strays.extend(dropped);
        if state.strays.len() > before && std::mem::take(&mut state.sweep_parked) {
            drop(state);
            self.idle.notify_one();
        }
    }

    /// After a reconnection messages may have been lost: everyone re-checks.
    pub(crate) fn wake_all(&self) {
        for entry in self.state().channels.values() {
            entry.everyone.send_modify(|v| *v += 1);
        }
    }
}

/// An observer's wait on a channel: counted while it lasts, also if it is cancelled.
struct Watching<'a> {
    wakeups: &'a Wakeups,
    ticket: &'a Ticket,
}

impl Drop for Watching<'_> {
    fn drop(&mut self) {
        let mut state = self.wakeups.state();
        if Wakeups::gone(&state, self.ticket) {
            return;
        }
        let channel = self.ticket.channel.as_str();
        if let Some(entry) = state.channels.get_mut(channel) {
            entry.watchers -= 1;
        }
        if state.maybe_unused(channel) {
            drop(state);
            self.wakeups.idle.notify_one();
        }
    }
}

/// Channels whose subscription is not confirmed (yet): strays if dropped so.
struct Strays<'a> {
    wakeups: &'a Wakeups,
    channels: Vec<Arc<str>>,
}

impl Drop for Strays<'_> {
    fn drop(&mut self) {
        if !self.channels.is_empty() {
            self.wakeups.state().strays.append(&mut self.channels);
            self.wakeups.idle.notify_one();
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
    fn send(&self, info: PushInfo) -> std::result::Result<(), SendError> {
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
