//! Push wake-ups: the release script names whom it wakes, and only those waiters wake.
//! It publishes them on the lock's channel (the owners at the head of the queue, or `*` for
//! everyone); the connection's RESP3 push messages land on the backend's wake-up board
//! (`support::wakeups`), which wakes exactly those waiters of this process.
//!
//! A lock is known here by its wake-up channel, `<prefix>:{<name>}:wake`, the name the
//! scripts are passed to publish on. A channel has state on the board exactly while it is
//! subscribed (or about to be unsubscribed).
//!
//! A release that hands an exclusive lock straight to the waiter at the head of the queue
//! publishes `<owner>!<token>` (`lua/release.lua`): that waiter is woken, and its hint
//! tells the grant ([`Hint::handed`]), so that taking it costs no request.
//!
//! A waiter takes its ticket *before* its acquire is sent, so a message that arrives
//! between the script and the wait is never missed. A name is subscribed the first time
//! one of its waiters is busy (the first wait subscribes and returns at once, so the
//! acquire is retried with the subscription in place).
//!
//! State is kept per name only while something needs it: a channel is in use while a
//! ticket of it lives (a waiter's or an observer's hint). A channel that nobody has used
//! for [`LINGER`] is dropped and unsubscribed by a background sweep (see
//! [`Wakeups::sweep`]), so a client that locks millions of names holds state only for
//! those in use. The linger keeps a name that is contended again soon from paying a new
//! `SUBSCRIBE` round trip each time. Uncontended locks never touch any of this.
//!
//! `SUBSCRIBE` and `UNSUBSCRIBE` of one connection are sent one at a time (an async mutex),
//! so that the server applies them in the order this state changed: a name dropped and then
//! needed again is unsubscribed before it is subscribed anew, never after. Channels asked
//! for while one is under way go together in the next `SUBSCRIBE`. When the connection is
//! replaced, the channels in use are subscribed on the new one; those dropped meanwhile
//! are unsubscribed there by the next sweep.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use leasehold_core::support::wakeups::{Board, EVERYONE, Ticket};
use leasehold_core::{Error, Result};
use redis::aio::{AsyncPushSender, SendError};
use redis::{PushInfo, PushKind, Value};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::connection::Connection;
use crate::link::Link;

/// How long a channel nobody uses stays subscribed.
pub(crate) const LINGER: Duration = Duration::from_secs(1);

/// Most channels one `UNSUBSCRIBE` names.
const UNSUBSCRIBE_BATCH: usize = 1000;

/// The wake-up channels of one connection: who waits on them, and what is subscribed.
#[derive(Debug)]
pub(crate) struct Wakeups {
    /// The subscribed channels and their waiters.
    board: Board,
    state: Mutex<State>,
    /// Held while a `SUBSCRIBE` or `UNSUBSCRIBE` is under way.
    order: tokio::sync::Mutex<()>,
    /// Wakes the sweep when there are strays.
    strayed: Notify,
    /// Whether a connection was lost since it was last taken.
    /// redis-rs reconnects by itself, as another client of the server (see
    /// [`take_disconnected`](Wakeups::take_disconnected)).
    disconnected: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    /// Channels waiting for a `SUBSCRIBE`: whoever sends the next one names them all.
    pending: Vec<Arc<str>>,
    /// Channels the server may have us subscribed to although they have no state.
    /// They come from a `SUBSCRIBE` whose answer never came, or an `UNSUBSCRIBE` that
    /// failed. The sweep unsubscribes them.
    strays: Vec<Arc<str>>,
    /// Bumped when the connection is replaced.
    /// A `SUBSCRIBE` sent before is not on the new connection.
    generation: u64,
    /// Channels with state whose subscription a Cluster node dropped.
    /// The node gave their slot away; no ticket is taken on them until they are subscribed
    /// again.
    dropped: HashSet<Arc<str>>,
}

/// What a busy request or an inspect hands to [`Wakeups::wait`].
#[derive(Debug)]
pub(crate) struct Hint {
    /// The lock's channel.
    channel: String,
    /// The waiter's ticket; `None` while the channel is not subscribed.
    ticket: Option<Ticket>,
    /// When the server said the state may change on its own (an expiry).
    retry: Option<Duration>,
    /// The fencing counter when the server answered busy, to a waiter it may hand the lock to.
    /// A token handed since is above it.
    counter: Option<u64>,
}

impl Hint {
    /// What `ticket` (taken on `channel` before the request) hands to the wait.
    pub(crate) fn new(channel: &str, ticket: Option<Ticket>, retry: Option<Duration>) -> Self {
        Self {
            channel: channel.to_owned(),
            ticket,
            retry,
            counter: None,
        }
    }

    /// The same hint, of a waiter that a release may hand the lock to.
    /// The server answered busy when its fencing counter stood at `counter`.
    pub(crate) fn may_be_handed(mut self, counter: u64) -> Self {
        self.counter = Some(counter);
        self
    }

    /// The token a release handed the waiter since the busy answer.
    /// A hand told before the answer (a token not above the counter then) is not this
    /// request's: the answer proves the grant was gone by then.
    pub(crate) fn handed(&self) -> Option<u64> {
        let counter = self.counter?;
        let token = self.ticket.as_ref()?.handed()?;
        (token > counter).then_some(token)
    }

    /// The lock's channel.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }

    /// Whether the channel was subscribed when the hint was taken.
    pub(crate) fn subscribed(&self) -> bool {
        self.ticket.is_some()
    }
}

impl Wakeups {
    pub(crate) fn new() -> Self {
        Self {
            board: Board::lingering(LINGER),
            state: Mutex::default(),
            order: tokio::sync::Mutex::default(),
            strayed: Notify::new(),
            disconnected: AtomicBool::new(false),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `owner` (or an observer, `None`) as waiting on `channel`.
    /// Call it before the request is sent. Messages arrive only on a subscribed channel:
    /// only there is a ticket taken. An unsubscribed channel costs nothing here; the first
    /// wait subscribes and has the request retried.
    pub(crate) fn ticket(&self, channel: &str, owner: Option<&str>) -> Option<Ticket> {
        if self.state().dropped.contains(channel) {
            return None;
        }
        self.board.ticket_if_present(channel, owner)
    }

    /// Whether `channel` is subscribed (it has state, and no node dropped it).
    fn subscribed(&self, state: &State, channel: &str) -> bool {
        self.board.contains(channel) && !state.dropped.contains(channel)
    }

    /// Subscribes to `channel` unless that is done already.
    /// The channels others asked for meanwhile go in the same `SUBSCRIBE`. Until it is
    /// subscribed, a channel has no state here: messages on it are dropped and its waiters
    /// are not registered.
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
            if self.subscribed(&state, channel) {
                return Ok(());
            }
            state.pending.push(Arc::from(channel));
        }
        let _order = self.order.lock().await;
        let (batch, generation) = {
            let mut state = self.state();
            if self.subscribed(&state, channel) {
                // Subscribed by the SUBSCRIBE of someone who asked at the same time.
                return Ok(());
            }
            let mut batch = std::mem::take(&mut state.pending);
            batch.sort_unstable();
            batch.dedup();
            batch.retain(|name| !self.subscribed(&state, name));
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
        send_subscribe(&mut conn, &strays.channels, "").await?;
        let mut state = self.state();
        if state.generation != generation {
            // The connection was replaced meanwhile: whether they are subscribed on the new
            // one is not known, so they are strays; the caller looks again.
            drop(state);
            return Ok(());
        }
        for name in &strays.channels {
            state.dropped.remove(name);
        }
        // Unused until the acquire that asked for it is retried.
        self.board.insert(std::mem::take(&mut strays.channels));
        Ok(())
    }

    /// Returns when a message for the hint's owner or everyone arrived, or after `max`.
    /// Only a message since the hint was taken counts; the hint's retry cuts `max` short
    /// if it is sooner.
    pub(crate) async fn wait(&self, hint: &Hint, max: Duration) {
        if let Some(ticket) = &hint.ticket {
            ticket
                .wait(hint.retry.map_or(max, |retry| retry.min(max)))
                .await;
        }
    }

    /// Drops the channels unused for [`LINGER`], and unsubscribes them on `connection`.
    /// The strays are unsubscribed too, each `UNSUBSCRIBE` bounded by `limit`. Channels
    /// whose `UNSUBSCRIBE` failed are tried again by the next sweep.
    pub(crate) async fn sweep(&self, connection: &Connection, limit: Duration) {
        let _order = self.order.lock().await;
        let (names, mut conn) = {
            let mut state = self.state();
            // Names asked for by subscribers that were cancelled before their SUBSCRIBE
            // (one still waiting finds its name gone and asks again).
            state.pending.clear();
            let mut names = std::mem::take(&mut state.strays);
            names.retain(|name| !self.board.contains(name));
            names.extend(self.board.sweep());
            for name in &names {
                state.dropped.remove(name);
            }
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
                    let rest = names[i * UNSUBSCRIBE_BATCH..]
                        .iter()
                        .filter(|name| !self.board.contains(name))
                        .cloned();
                    self.state().strays.extend(rest);
                    return;
                }
            }
        }
    }

    /// When the next sweep has something to do; `None` once [`close`](Wakeups::close)d.
    /// If no channel is unused and there are no strays, it waits until there is one.
    pub(crate) async fn next_sweep(&self) -> Option<Instant> {
        loop {
            let strayed = self.strayed.notified();
            if !self.state().strays.is_empty() {
                // Not at once: an UNSUBSCRIBE that just failed is not tried again in a
                // loop while the server is away.
                return Some(Instant::now() + LINGER);
            }
            tokio::select! {
                due = self.board.next_sweep() => return due,
                () = strayed => {}
            }
        }
    }

    /// The backend is gone: the sweep ends.
    pub(crate) fn close(&self) {
        self.board.close();
    }

    /// How many channels this process keeps state for.
    pub(crate) fn channels(&self) -> usize {
        self.board.len()
    }

    /// Subscribes every channel in use on `conn`, a new connection to replace the old one.
    /// Returns the channels subscribed: pass them to [`replaced`](Wakeups::replaced) when
    /// `conn` takes the old one's place.
    ///
    /// It does not wait for [`order`](Wakeups::order): nothing else is sent on `conn` yet,
    /// and a `SUBSCRIBE` or `UNSUBSCRIBE` stuck on the connection being replaced holds it.
    /// A channel subscribed there after this took the list is not on `conn`: its waiters
    /// come back to the server on their own (every third of the lease), as after any lost
    /// message.
    ///
    /// # Cancel safety
    ///
    /// Dropped, the new connection is not used (its subscriptions go with it).
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] if the `SUBSCRIBE` fails.
    pub(crate) async fn subscribe_all(&self, conn: &mut Link) -> Result<Vec<Arc<str>>> {
        let names = self.board.names();
        if names.is_empty() {
            return Ok(names);
        }
        send_subscribe(conn, &names, " on a new connection").await?;
        Ok(names)
    }

    /// Puts the new connection in place (`swap`); its stale channels go to the sweep.
    /// [`subscribe_all`] subscribed `subscribed` on it: those dropped since are strays
    /// there, for the sweep to unsubscribe.
    ///
    /// [`subscribe_all`]: Wakeups::subscribe_all
    pub(crate) fn replaced(&self, subscribed: Vec<Arc<str>>, swap: impl FnOnce()) {
        let mut state = self.state();
        swap();
        state.generation += 1;
        for name in &subscribed {
            state.dropped.remove(name);
        }
        let before = state.strays.len();
        let dropped = subscribed
            .into_iter()
            .filter(|name| !self.board.contains(name));
        state.strays.extend(dropped);
        if state.strays.len() > before {
            self.strayed.notify_one();
        }
    }

    /// After a reconnection messages may have been lost: everyone re-checks.
    pub(crate) fn wake_all(&self) {
        self.board.wake_all();
    }

    /// Whether a connection was lost since the last call.
    pub(crate) fn take_disconnected(&self) -> bool {
        self.disconnected.swap(false, Ordering::AcqRel)
    }
}

/// Sends one `SUBSCRIBE` of `names` on `conn` (`place` says where, in an error).
async fn send_subscribe(conn: &mut Link, names: &[Arc<str>], place: &str) -> Result<()> {
    let names: Vec<&str> = names.iter().map(|name| &**name).collect();
    conn.subscribe(&names)
        .await
        .map_err(|e| Error::Unavailable {
            message: format!("redis: subscribing to wake-ups{place} failed: {e}"),
            source: Some(Arc::new(e)),
        })
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
            self.wakeups.strayed.notify_one();
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
            PushKind::Message | PushKind::SMessage => {
                if let [channel, payload, ..] = info.data.as_slice()
                    && let (Some(channel), Some(payload)) = (text(channel), text(payload))
                {
                    // A hand-off, or the owners to wake ('!' is not allowed in owner ids).
                    match payload.rsplit_once('!') {
                        Some((owner, token)) => match token.parse() {
                            Ok(token) => self.0.board.hand(&channel, owner, token),
                            Err(_) => {
                                tracing::warn!(%channel, %payload, "redis: a wake-up that is not one")
                            }
                        },
                        None => self.0.board.wake(&channel, payload.split(' ')),
                    }
                }
            }
            // A Cluster node drops the sharded subscriptions of a slot it gives away. A
            // channel still in use is marked dropped and its waiters ask again at once:
            // their next wait subscribes it anew, on the slot's new master. (The sweep's own
            // unsubscriptions are of channels without state.)
            PushKind::SUnsubscribe => {
                if let Some(channel) = info.data.first().and_then(text)
                    && self.0.board.contains(&channel)
                {
                    self.0.state().dropped.insert(Arc::from(channel.as_str()));
                    self.0.board.wake(&channel, [EVERYONE]);
                }
            }
            PushKind::Disconnection => {
                self.0.disconnected.store(true, Ordering::Release);
                self.0.wake_all();
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use leasehold_core::support::wakeups::Board;

    use super::Hint;

    #[test]
    fn only_a_token_handed_after_the_busy_answer_is_taken() {
        let board = Board::new();
        // Tickets are taken before the requests are sent; the answers saw counters 4 and 5.
        let hint = |counter| {
            Hint::new("c", Some(board.ticket("c", Some("o"))), None).may_be_handed(counter)
        };
        let (before, after) = (hint(4), hint(5));
        let not_queued = Hint::new("c", Some(board.ticket("c", Some("o"))), None);
        board.hand("c", "o", 5);
        assert_eq!(before.handed(), Some(5));
        assert_eq!(
            after.handed(),
            None,
            "a hand told before the answer was taken"
        );
        assert_eq!(not_queued.handed(), None);
        // A plain wake-up after it: nothing is known to be handed any more.
        board.wake("c", ["o"]);
        assert_eq!(before.handed(), None);
    }
}
