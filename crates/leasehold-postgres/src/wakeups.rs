//! Push wake-ups by LISTEN/NOTIFY, on one listening connection per backend.
//! That connection listens on the schema's channel. The statements that release a lock (or
//! let a group of waiters in, or change an election's leader) notify
//! `<name> <owner> <owner>…` — whom they let in — or `<name> *`, in their own transaction,
//! so the message leaves when the change commits.
//!
//! A waiter takes a [`Ticket`] on the backend's wake-up board (`support::wakeups`) *before*
//! its request is sent: a message that arrives between the server's answer and the wait is
//! not missed. Per-name state lives only while a ticket for the name does.
//!
//! Where LISTEN is impossible (a transaction-pooling proxy) or the listening connection is
//! down, waits fall back to polling: soon at first, less often the longer the owner waits.

use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use leasehold_core::support::wakeups::Board;
pub(crate) use leasehold_core::support::wakeups::Ticket;
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
    board: Board,
    /// Whether the listening connection listens.
    listening: watch::Sender<bool>,
}

impl Wakeups {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            board: Board::new(),
            listening: watch::Sender::new(false),
        })
    }

    /// Completes when the listening connection listens.
    pub(crate) async fn until_listening(&self) {
        let mut listening = self.listening.subscribe();
        let _ = listening.wait_for(|l| *l).await;
    }

    /// Registers `owner` (or an observer: `None`) as waiting for `name`.
    /// Call it before the request is sent.
    pub(crate) fn ticket(&self, name: &str, owner: Option<&str>) -> Ticket {
        self.board.ticket(name, owner)
    }

    /// A message from the channel: `<name> *` or `<name> <owner>…`.
    fn deliver(&self, payload: &str) {
        let mut parts = payload.split(' ');
        if let Some(name) = parts.next() {
            self.board.wake(name, parts);
        }
    }

    /// The listening connection started or stopped: every waiter looks again.
    /// Messages sent meanwhile may be lost; without the connection, waiters poll.
    fn set_listening(&self, listening: bool) {
        self.listening.send_replace(listening);
        self.board.wake_all();
    }

    /// Returns when the ticket's owner may look again, or when `limit` passed.
    /// The owner looks again when a message for it (or for everyone) arrived after the
    /// ticket was taken, or the listening connection restarted. Without a listening
    /// connection, `limit` is at most `poll`.
    pub(crate) async fn wait(&self, ticket: &Ticket, limit: Duration, poll: Duration) {
        let limit = if *self.listening.borrow() {
            limit
        } else {
            limit.min(poll)
        };
        ticket.wait(limit).await;
    }
}

/// The pause before the next poll of an owner that has been waiting `waited`.
pub(crate) fn poll_pause(waited: Option<Duration>) -> Duration {
    waited.map_or(FIRST_POLL, |w| (w / 4).clamp(FIRST_POLL, LONGEST_POLL))
}

/// Starts the listening connection, which connects, listens on `channel` and delivers.
/// On any failure it starts over after a pause. It ends when the backend is gone.
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
        assert!(wakeups.board.is_empty(), "state left after the tickets");
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
