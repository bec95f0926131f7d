//! The per-name wake-up board of a backend with push wake-ups.
//! It knows who in this process waits on which lock name, and wakes them by name and owner,
//! or everyone at once.
//!
//! A backend whose server announces changes (a Redis channel, PostgreSQL `NOTIFY`, an
//! inotify event) keeps one [`Board`]. A waiter takes a [`Ticket`] for its name *before*
//! its request is sent, so that an announcement made between the server's answer and the
//! wait is not missed; it then [waits](Ticket::wait) on the ticket until the name is
//! [woken](Board::wake) for it (by its owner id, or for [`EVERYONE`]), or for a while.
//!
//! A server that hands a released lock straight to its next waiter says so with a
//! [hand](Board::hand): the waiter is woken as for its owner id, and its ticket tells the
//! grant it was [handed](Ticket::handed).
//!
//! State is kept per name only while a ticket of it lives, and per owner only while a
//! ticket of that owner does: dropping the last one (a waiter granted, gone or cancelled)
//! frees it, so a process that locks millions of names keeps state only for those waited
//! on now. A [lingering](Board::lingering) board keeps a name that nobody waits on any more
//! for a while instead (where making the state costs a round trip, as a subscription does),
//! until a [sweep](Board::sweep) drops it.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

/// The word of a wake-up that wakes every waiter of the name, owner or not.
pub const EVERYONE: &str = "*";

/// Who in this process waits on which name; cheap to clone (clones share the board).
#[derive(Clone, Default)]
pub struct Board {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    names: Mutex<HashMap<Arc<str>, Entry>>,
    /// How long a name nobody waits on is kept (`None`: not at all).
    linger: Option<Duration>,
    /// Wakes [`Board::next_sweep`]: a name went unused, or the board was closed.
    idle: Notify,
    closed: AtomicBool,
}

/// One name's waiters.
struct Entry {
    /// Bumped for everyone.
    everyone: watch::Sender<()>,
    /// Bumped for one owner; an owner is here while a ticket of it lives.
    owners: HashMap<Arc<str>, Owner>,
    tickets: usize,
    /// Since when no ticket of the name lives (a lingering board only).
    unused_since: Option<Instant>,
}

struct Owner {
    /// Bumped for the owner: with the grant handed to it, or `None` for a plain wake-up.
    woken: watch::Sender<Option<u64>>,
    tickets: usize,
}

impl Entry {
    fn new(unused_since: Option<Instant>) -> Self {
        Self {
            everyone: watch::Sender::new(()),
            owners: HashMap::new(),
            tickets: 0,
            unused_since,
        }
    }
}

/// A waiter's place on the board: what it has seen of its name, and its registration.
/// The registration ends when the ticket is dropped.
pub struct Ticket {
    shared: Arc<Shared>,
    name: Arc<str>,
    owner: Option<Arc<str>>,
    everyone: watch::Receiver<()>,
    mine: Option<watch::Receiver<Option<u64>>>,
}

impl Board {
    /// A board that frees a name's state with its last ticket.
    pub fn new() -> Self {
        Self::default()
    }

    /// A board that keeps a name nobody waits on for `linger`, until a [`sweep`](Board::sweep).
    pub fn lingering(linger: Duration) -> Self {
        Self {
            shared: Arc::new(Shared {
                linger: Some(linger),
                ..Shared::default()
            }),
        }
    }

    /// Registers `owner` as waiting on `name` from now on.
    /// `None` is an observer, woken only for everyone. Take the ticket before the request
    /// whose answer it waits on is sent.
    pub fn ticket(&self, name: &str, owner: Option<&str>) -> Ticket {
        let mut names = self.shared.names();
        let name = names
            .get_key_value(name)
            .map_or_else(|| Arc::from(name), |(key, _)| key.clone());
        self.shared.register(&mut names, name, owner)
    }

    /// As [`ticket`](Board::ticket), but `None` unless `name` has state already.
    /// On a lingering board, a name has state if it was [inserted](Board::insert) and not
    /// swept since.
    pub fn ticket_if_present(&self, name: &str, owner: Option<&str>) -> Option<Ticket> {
        let mut names = self.shared.names();
        let name = names.get_key_value(name)?.0.clone();
        Some(self.shared.register(&mut names, name, owner))
    }

    /// Makes state for `names` that nobody waits on yet; names that have state keep it.
    /// It is for a lingering board, where the new state lingers until swept.
    pub fn insert(&self, names: impl IntoIterator<Item = Arc<str>>) {
        let now = Instant::now();
        let mut map = self.shared.names();
        for name in names {
            map.entry(name).or_insert_with(|| Entry::new(Some(now)));
        }
        drop(map);
        self.shared.idle.notify_one();
    }

    /// Whether `name` has state.
    pub fn contains(&self, name: &str) -> bool {
        self.shared.names().contains_key(name)
    }

    /// Wakes the waiters of `name` that `whom` names: owner ids, or [`EVERYONE`].
    /// Those not registered here are not woken (nothing is kept for them).
    pub fn wake<'a>(&self, name: &str, whom: impl IntoIterator<Item = &'a str>) {
        let names = self.shared.names();
        let Some(entry) = names.get(name) else {
            return;
        };
        for who in whom {
            if who == EVERYONE {
                entry.everyone.send_replace(());
            } else if let Some(owner) = entry.owners.get(who) {
                owner.woken.send_replace(None);
            }
        }
    }

    /// Wakes `owner`'s waiters of `name`: the server handed it the grant `grant` (a token).
    /// Its tickets taken before then tell it ([`Ticket::handed`]) until a later wake-up.
    pub fn hand(&self, name: &str, owner: &str, grant: u64) {
        let names = self.shared.names();
        if let Some(registered) = names.get(name).and_then(|entry| entry.owners.get(owner)) {
            registered.woken.send_replace(Some(grant));
        }
    }

    /// Wakes every waiter of every name (announcements may have been lost).
    /// A grant handed before is no longer told: the server it came from may have lost it.
    pub fn wake_all(&self) {
        for entry in self.shared.names().values() {
            entry.everyone.send_replace(());
            for owner in entry.owners.values() {
                owner.woken.send_replace(None);
            }
        }
    }

    /// The names with state now.
    pub fn names(&self) -> Vec<Arc<str>> {
        self.shared.names().keys().cloned().collect()
    }

    /// How many names have state now.
    pub fn len(&self) -> usize {
        self.shared.names().len()
    }

    /// Whether no name has state.
    pub fn is_empty(&self) -> bool {
        self.shared.names().is_empty()
    }

    /// Drops the names nobody has waited on for the linger, and returns them.
    pub fn sweep(&self) -> Vec<Arc<str>> {
        let Some(linger) = self.shared.linger else {
            return Vec::new();
        };
        let now = Instant::now();
        let mut swept = Vec::new();
        self.shared.names().retain(|name, entry| {
            let stale = entry
                .unused_since
                .is_some_and(|since| now.duration_since(since) >= linger);
            if stale {
                swept.push(name.clone());
            }
            !stale
        });
        swept
    }

    /// When the next [`sweep`](Board::sweep) has a name to drop.
    /// If no name is unused, it waits until one goes unused. It returns `None` once the
    /// board is [closed](Board::close), or at once on a board that does not linger.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future changes nothing.
    ///
    /// # Errors
    ///
    /// None.
    pub async fn next_sweep(&self) -> Option<Instant> {
        let linger = self.shared.linger?;
        loop {
            let idle = self.shared.idle.notified();
            if self.shared.closed.load(Ordering::Acquire) {
                return None;
            }
            let oldest = self
                .shared
                .names()
                .values()
                .filter_map(|entry| entry.unused_since)
                .min();
            if let Some(oldest) = oldest {
                return Some(oldest + linger);
            }
            idle.await;
        }
    }

    /// Ends [`next_sweep`](Board::next_sweep): the backend is gone.
    pub fn close(&self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.idle.notify_one();
    }
}

impl Shared {
    fn names(&self) -> MutexGuard<'_, HashMap<Arc<str>, Entry>> {
        self.names.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a ticket of `owner` on `name`, making the name's state if it has none.
    fn register(
        self: &Arc<Self>,
        names: &mut HashMap<Arc<str>, Entry>,
        name: Arc<str>,
        owner: Option<&str>,
    ) -> Ticket {
        let entry = names
            .entry(name.clone())
            .or_insert_with(|| Entry::new(None));
        entry.tickets += 1;
        entry.unused_since = None;
        let owner: Option<Arc<str>> = owner.map(Arc::from);
        let mine = owner.as_ref().map(|owner| {
            let registered = entry.owners.entry(owner.clone()).or_insert_with(|| Owner {
                woken: watch::Sender::new(None),
                tickets: 0,
            });
            registered.tickets += 1;
            registered.woken.subscribe()
        });
        Ticket {
            shared: self.clone(),
            everyone: entry.everyone.subscribe(),
            name,
            owner,
            mine,
        }
    }
}

impl Ticket {
    /// The grant [handed](Board::hand) to the ticket's owner since the ticket was taken.
    /// `None` if there was none, or a plain wake-up for the owner came after it.
    pub fn handed(&self) -> Option<u64> {
        let mine = self.mine.as_ref()?;
        if !mine.has_changed().unwrap_or(false) {
            return None;
        }
        *mine.borrow()
    }

    /// Returns when the name is woken for the ticket's owner or everyone, or after `limit`.
    /// Only a wake-up since the ticket was taken counts.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future changes nothing: the ticket stays registered until dropped.
    ///
    /// # Errors
    ///
    /// None.
    pub async fn wait(&self, limit: Duration) {
        let mut everyone = self.everyone.clone();
        let mut mine = self.mine.clone();
        let mine = async {
            match &mut mine {
                Some(mine) => {
                    let _ = mine.changed().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = everyone.changed() => {}
            () = mine => {}
            () = tokio::time::sleep(limit) => {}
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut names = self.shared.names();
        let Some(entry) = names.get_mut(&self.name) else {
            return;
        };
        if let Some(owner) = &self.owner
            && let Some(registered) = entry.owners.get_mut(owner)
        {
            registered.tickets -= 1;
            if registered.tickets == 0 {
                entry.owners.remove(owner);
            }
        }
        entry.tickets -= 1;
        if entry.tickets > 0 {
            return;
        }
        if self.shared.linger.is_some() {
            entry.unused_since = Some(Instant::now());
            drop(names);
            self.shared.idle.notify_one();
        } else {
            names.remove(&self.name);
        }
    }
}

impl fmt::Debug for Board {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Board")
            .field("names", &self.len())
            .field("linger", &self.shared.linger)
            .finish()
    }
}

impl fmt::Debug for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ticket")
            .field("name", &self.name)
            .field("owner", &self.owner)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LONG: Duration = Duration::from_secs(3600);

    /// Whether `ticket`'s wait returns before `LONG`.
    /// On paused time, without a timer firing first, it returns at once or never.
    async fn woken(ticket: &Ticket) -> bool {
        let started = Instant::now();
        ticket.wait(LONG).await;
        started.elapsed() < LONG
    }

    #[tokio::test(start_paused = true)]
    async fn a_wake_after_the_ticket_is_not_missed_and_names_its_owner() {
        let board = Board::new();
        let a = board.ticket("n", Some("a"));
        let b = board.ticket("n", Some("b"));
        let other = board.ticket("m", Some("a"));
        // Before anyone waits, as an answer that arrives before the wait.
        board.wake("n", ["a", "stranger"]);
        assert!(woken(&a).await);
        assert!(!woken(&b).await, "b was woken for a");
        assert!(!woken(&other).await, "another name was woken");
        board.wake("n", [EVERYONE]);
        assert!(woken(&b).await);
        // A ticket taken after a wake-up waits for the next one.
        let late = board.ticket("n", Some("a"));
        assert!(!woken(&late).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_hand_wakes_its_owner_and_tells_only_tickets_taken_before_it() {
        let board = Board::new();
        let a = board.ticket("n", Some("a"));
        let b = board.ticket("n", Some("b"));
        assert_eq!(a.handed(), None);
        board.hand("n", "a", 7);
        assert!(woken(&a).await);
        assert!(!woken(&b).await, "b was woken by a's hand");
        assert_eq!((a.handed(), b.handed()), (Some(7), None));
        // A ticket taken after the hand was not handed anything.
        let later = board.ticket("n", Some("a"));
        assert_eq!(later.handed(), None);
        // A plain wake-up after the hand: nothing is known to be handed any more.
        board.wake("n", ["a"]);
        assert_eq!((a.handed(), later.handed()), (None, None));
        board.hand("n", "a", 9);
        assert_eq!((a.handed(), later.handed()), (Some(9), Some(9)));
        // Announcements may have been lost (a reconnection): neither are hands.
        board.wake_all();
        assert_eq!(a.handed(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn an_observer_is_woken_for_everyone_only() {
        let board = Board::new();
        let observer = board.ticket("n", None);
        board.wake("n", ["a"]);
        assert!(!woken(&observer).await);
        board.wake_all();
        assert!(woken(&observer).await);
    }

    #[tokio::test(start_paused = true)]
    async fn state_lives_as_long_as_its_tickets() {
        let board = Board::new();
        let a = board.ticket("n", Some("a"));
        let again = board.ticket("n", Some("a"));
        assert!(board.ticket_if_present("m", None).is_none());
        let observer = board.ticket_if_present("n", None).unwrap();
        drop(a);
        // The owner's other ticket keeps it registered.
        board.wake("n", ["a"]);
        assert!(woken(&again).await);
        drop((again, observer));
        assert!(board.is_empty(), "state left after the last ticket");
        assert_eq!(board.sweep(), Vec::<Arc<str>>::new());
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_wait_keeps_the_ticket_and_a_dropped_ticket_leaves() {
        let board = Board::new();
        let ticket = board.ticket("n", Some("a"));
        drop(ticket.wait(LONG));
        board.wake("n", ["a"]);
        assert!(
            woken(&ticket).await,
            "the wake-up was lost with the cancelled wait"
        );
        drop(ticket);
        // A waiter cancelled while it waits (its task aborted) leaves nothing either.
        let waiter = {
            let board = board.clone();
            tokio::spawn(async move { board.ticket("m", Some("b")).wait(LONG).await })
        };
        while !board.contains("m") {
            tokio::task::yield_now().await;
        }
        waiter.abort();
        assert!(waiter.await.unwrap_err().is_cancelled());
        assert!(board.is_empty(), "state left after the tickets");
    }

    #[tokio::test(start_paused = true)]
    async fn a_lingering_board_keeps_an_unused_name_until_swept() {
        let linger = Duration::from_secs(1);
        let board = Board::lingering(linger);
        board.insert([Arc::from("n")]);
        let due = board.next_sweep().await.unwrap();
        assert_eq!(due, Instant::now() + linger);
        let ticket = board.ticket_if_present("n", Some("a")).unwrap();
        tokio::time::advance(2 * linger).await;
        assert!(board.sweep().is_empty(), "a name in use was swept");
        drop(ticket);
        assert!(board.contains("n"));
        // Due a linger after it went unused.
        assert_eq!(board.next_sweep().await, Some(Instant::now() + linger));
        tokio::time::advance(linger).await;
        assert_eq!(board.sweep(), [Arc::from("n")]);
        assert!(board.is_empty());
        // Nothing unused: the sweeper waits, until the board is closed.
        let sweeper = {
            let board = board.clone();
            tokio::spawn(async move { board.next_sweep().await })
        };
        tokio::task::yield_now().await;
        assert!(!sweeper.is_finished());
        board.close();
        assert_eq!(sweeper.await.unwrap(), None);
    }
}
