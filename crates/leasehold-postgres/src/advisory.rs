//! Advisory mode: a session-level advisory lock on a connection of its own per acquisition.
//!
//! - **Grant**: `pg_try_advisory_lock` (or `_shared`) and a token from the schema's sequence
//!   in one statement; the session records who holds with which token (see
//!   `advisory_acquire` in `sql/v4.sql`). A session-level lock outlives the rollback of the
//!   statement that took it: after a failed or unanswered attempt the session is asked what
//!   it holds (`pg_locks`, not the row), and a hold without its grant is given up before
//!   the next attempt; a waiting statement that failed closes its connection.
//! - **Waiting** happens in the server's lock queue: a busy waiting request leaves a blocking
//!   `pg_advisory_lock` running on its connection. The server grants in arrival order and
//!   does not let a reader overtake a waiting writer; the hand-off needs no message.
//!   Giving up cancels the statement (a cancel request to the server) and unlocks if it was
//!   granted meanwhile.
//! - **Liveness** is the session. The connection is pinged every third of the session ttl;
//!   the guard counts on it until the last answered ping's send time plus the ttl (minus a
//!   drift allowance), and is lost at once when the connection breaks (the server ended the
//!   session: `pg_terminate_backend`, a restart). The server ends a session that has been
//!   silent for the ttl (`idle_session_timeout`), which frees its lock: a client that died,
//!   was cut off or is paused loses the lock after one ttl, as with a lease.
//! - **Records** beside a lock are written on the connection whose session holds it, by a
//!   statement that checks the session still holds it. Keeping a lock after its holder
//!   lets go is not offered: the lock lives by its session (capabilities say so).
//! - **Release** unlocks and hands the connection back to a small idle set for the next
//!   acquisition; a release that cannot be confirmed closes the connection, which frees
//!   everything the session held.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold_core::backend::{
    Acquire, Expiry, Grant, Listing, Liveness, LockState, Mode, Release, Renewal, Request,
    SessionKeeper, WaitHint,
};
use leasehold_core::clock::{Clock, Instant, SystemClock};
use leasehold_core::{Error, FencingToken, LockName, LossReason, OwnerId, RecordKey, Result};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::connection::{Conn, Connector, Pool};
use crate::error::undecodable;
use crate::lease::millis;
use crate::listing::Page;
use crate::reply;
use crate::statements::Stmt;
use crate::wakeups::{Ticket, Wakeups};

/// How many connections wait for the next acquisition once their lock was released.
const IDLE_CONNECTIONS: usize = 8;
/// How often an observer (inspect) polls when no message can come.
const OBSERVER_POLL: Duration = Duration::from_millis(100);

/// The part of a session ttl the client counts on: 10 % + 2 ms less.
/// The server ends a silent session exactly one ttl after it went idle
/// (`idle_session_timeout`), so unlike a lease whose expiry the server only applies when
/// someone next asks, nothing else gives the client a head start; the 10 % is for the loss
/// signal to reach the holder (a busy machine) before the server frees the lock.
fn validity(ttl: Duration) -> Duration {
    ttl.saturating_sub(ttl / 10 + Duration::from_millis(2))
}

/// The advisory-mode backend.
#[derive(Debug)]
pub(crate) struct Advisory {
    connector: Arc<Connector>,
    /// For inspect.
    shared: Pool,
    idle: Mutex<Vec<Dedicated>>,
    owners: Mutex<HashMap<OwnerId, Arc<Slot>>>,
    wakeups: Arc<Wakeups>,
    listener: JoinHandle<()>,
    session_ttl: Duration,
}

/// A connection of its own, and its server process.
#[derive(Debug)]
struct Dedicated {
    conn: Arc<Conn>,
    pid: i32,
}

/// One acquisition: its connection and where it stands.
#[derive(Debug)]
struct Slot {
    conn: Arc<Conn>,
    pid: i32,
    shared: bool,
    state: watch::Sender<State>,
    /// The blocking statement of a waiting request, then the pings of a held lock.
    task: Mutex<Option<JoinHandle<()>>>,
}

#[derive(Debug, Clone)]
enum State {
    /// A statement may have run whose answer never came (the request was cancelled).
    /// Ask the session before anything else.
    Unknown,
    /// Waiting in the server's lock queue.
    Waiting,
    /// Held, with its token and its session.
    Held(FencingToken, Arc<SessionKeeper>),
    /// The waiting statement failed; the connection is given up.
    Failed(Error),
}

/// What `wait` is handed.
#[derive(Debug)]
enum Hint {
    /// A waiting request: its state changes when the server grants (or fails).
    Queued(watch::Receiver<State>),
    /// An observer (inspect): messages of the name.
    Observer(Ticket),
}

impl Slot {
    fn state(&self) -> State {
        self.state.borrow().clone()
    }

    fn set(&self, state: State) {
        self.state.send_replace(state);
    }

    /// Records the slot's task.
    /// A task replacing itself detaches; nothing else runs one at the time.
    fn set_task(&self, task: JoinHandle<()>) {
        *self.task.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
    }

    fn take_task(&self) -> Option<JoinHandle<()>> {
        self.task.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// The lock is held with `token`: starts the pings, and returns the grant for the engine.
    /// It is counted on from `sent`, when the last statement of the session was sent.
    fn held(self: &Arc<Self>, token: FencingToken, sent: Instant, ttl: Duration) -> Grant {
        let keeper = Arc::new(SessionKeeper::new(sent.saturating_add(validity(ttl))));
        self.set(State::Held(token, keeper.clone()));
        self.set_task(tokio::spawn(keep_alive(
            self.conn.clone(),
            self.pid,
            keeper.clone(),
            ttl,
        )));
        Grant::new(token, Expiry::Session(keeper.liveness()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(task) = self.take_task() {
            task.abort();
        }
        if let State::Held(_, keeper) = self.state() {
            keeper.end();
        }
    }
}

/// Pings the session every third of `ttl`.
/// Each answer moves the session's deadline to the ping's send time plus the ttl (less the
/// drift allowance). The session ends when the connection breaks, when an answer comes
/// after the deadline (the server may have ended the session meanwhile), or when another
/// server process answers (a transaction pool, which has given the lock's session to
/// someone else).
async fn keep_alive(conn: Arc<Conn>, pid: i32, keeper: Arc<SessionKeeper>, ttl: Duration) {
    let every = (ttl / 3).max(Duration::from_millis(1));
    loop {
        tokio::select! {
            () = conn.closed() => break,
            () = tokio::time::sleep(every) => {}
        }
        let Liveness::Alive { until } = keeper.current() else {
            return;
        };
        let sent = SystemClock.now();
        let left = until.saturating_duration_since(sent);
        let answer = tokio::time::timeout(left, conn.query_one(Stmt::Ping, &[], "ping")).await;
        match answer {
            Ok(Ok(row)) => {
                let answered: i32 = match reply::single(&row, "ping") {
                    Ok(pid) => pid,
                    Err(error) => {
                        tracing::warn!(%error, "advisory session ping");
                        break;
                    }
                };
                if answered != pid {
                    tracing::warn!(
                        "the advisory lock's session moved to another server process (a \
                         transaction pool in between?): the lock is no longer held"
                    );
                    break;
                }
                if SystemClock.now() >= until {
                    break;
                }
                keeper.alive_until(sent.saturating_add(validity(ttl)));
            }
            Ok(Err(_)) if conn.is_closed() => break,
            Ok(Err(error)) => tracing::debug!(%error, "advisory session ping failed"),
            // The deadline passed without an answer.
            Err(_) => break,
        }
    }
    keeper.end();
}

impl Advisory {
    pub(crate) fn new(
        connector: Arc<Connector>,
        shared: Pool,
        wakeups: Arc<Wakeups>,
        listener: JoinHandle<()>,
        session_ttl: Duration,
    ) -> Self {
        Self {
            connector,
            shared,
            idle: Mutex::default(),
            owners: Mutex::default(),
            wakeups,
            listener,
            session_ttl,
        }
    }

    fn owners(&self) -> std::sync::MutexGuard<'_, HashMap<OwnerId, Arc<Slot>>> {
        self.owners.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A connection for a new acquisition: an idle one, or a new one.
    async fn checkout(&self) -> Result<Dedicated> {
        loop {
            let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            match idle {
                Some(dedicated) if !dedicated.conn.is_closed() => return Ok(dedicated),
                Some(_) => continue,
                None => break,
            }
        }
        let conn = Arc::new(self.connector.connect().await?);
        // A waiter whose client went away leaves the server's queue within a third of the
        // ttl, rather than being granted the lock first (the setting counts from the start
        // of each statement, so it is made before any).
        let check = (millis(self.session_ttl) / 3).max(1);
        conn.client()
            .batch_execute(&format!(
                "SET client_connection_check_interval = '{check}ms'"
            ))
            .await
            .map_err(|e| crate::error::map(e, "setting up a lock's connection"))?;
        let row = conn.query_one(Stmt::Ping, &[], "ping").await?;
        let pid = reply::single(&row, "ping")?;
        Ok(Dedicated { conn, pid })
    }

    /// Keeps a connection whose session holds nothing for the next acquisition.
    fn checkin(&self, slot: &Slot) {
        if slot.conn.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < IDLE_CONNECTIONS {
            idle.push(Dedicated {
                conn: slot.conn.clone(),
                pid: slot.pid,
            });
        }
    }

    /// Forgets the owner's slot if it is still `slot`.
    fn forget(&self, owner: &OwnerId, slot: &Arc<Slot>) {
        let mut owners = self.owners();
        if owners.get(owner).is_some_and(|s| Arc::ptr_eq(s, slot)) {
            owners.remove(owner);
        }
    }

    /// The connection shared by inspects (and sweeps).
    pub(crate) fn pool(&self) -> &Pool {
        &self.shared
    }

    /// A slot on a connection of its own for `owner`'s acquisition.
    async fn new_slot(&self, owner: &OwnerId, shared: bool) -> Result<Arc<Slot>> {
        let dedicated = self.checkout().await?;
        let slot = Arc::new(Slot {
            conn: dedicated.conn,
            pid: dedicated.pid,
            shared,
            state: watch::Sender::new(State::Unknown),
            task: Mutex::new(None),
        });
        self.owners().insert(owner.clone(), slot.clone());
        Ok(slot)
    }

    pub(crate) async fn acquire(&self, req: &Request) -> Result<Acquire> {
        let shared = match req.mode {
            Mode::Exclusive => false,
            Mode::Shared => true,
            Mode::Permit { .. } => {
                return Err(Error::Unsupported {
                    backend: "postgres",
                    feature: "semaphore permits in advisory mode",
                });
            }
        };
        let existing = self.owners().get(&req.owner).cloned();
        let slot = match existing {
            Some(slot) => match slot.state() {
                State::Held(token, keeper) => {
                    return Ok(Acquire::Granted(Grant::new(
                        token,
                        Expiry::Session(keeper.liveness()),
                    )));
                }
                State::Waiting => {
                    return Ok(Acquire::Busy(WaitHint::new(Hint::Queued(
                        slot.state.subscribe(),
                    ))));
                }
                State::Failed(error) => {
                    self.forget(&req.owner, &slot);
                    return Err(error);
                }
                State::Unknown if slot.conn.is_closed() => {
                    // The session ended, and whatever it held with it: start afresh.
                    self.forget(&req.owner, &slot);
                    self.new_slot(&req.owner, shared).await?
                }
                State::Unknown => {
                    // An earlier try's answer was lost, or it failed after taking the lock:
                    // the session knows, and gives up a hold without a grant.
                    let sent = SystemClock.now();
                    let row = slot
                        .conn
                        .query_one(Stmt::AdvisoryHeld, &[&req.name.as_str()], "acquire")
                        .await?;
                    if let Some(token) = reply::single::<Option<i64>>(&row, "acquire")? {
                        let token = reply::token(token, "acquire")?;
                        return Ok(Acquire::Granted(slot.held(token, sent, self.session_ttl)));
                    }
                    slot
                }
            },
            None => self.new_slot(&req.owner, shared).await?,
        };
        let ttl = millis(self.session_ttl);
        let value = req.value.as_deref();
        let sent = SystemClock.now();
        let row = slot
            .conn
            .query_one(
                Stmt::AdvisoryAcquire,
                &[
                    &req.name.as_str(),
                    &req.owner.as_str(),
                    &shared,
                    &false,
                    &ttl,
                    &value,
                ],
                "acquire",
            )
            .await;
        let row = match row {
            Ok(row) => row,
            Err(error) => {
                if slot.conn.is_closed() {
                    // The session is gone, and whatever it held with it.
                    self.forget(&req.owner, &slot);
                }
                return Err(error);
            }
        };
        if let Some(token) = reply::single::<Option<i64>>(&row, "acquire")? {
            let token = reply::token(token, "acquire")?;
            return Ok(Acquire::Granted(slot.held(token, sent, self.session_ttl)));
        }
        if !req.waiting {
            self.forget(&req.owner, &slot);
            self.checkin(&slot);
            return Ok(Acquire::Busy(WaitHint::none()));
        }
        // Busy: wait in the server's queue, on this connection, in the background.
        slot.set(State::Waiting);
        let hint = WaitHint::new(Hint::Queued(slot.state.subscribe()));
        let waiting = Arc::downgrade(&slot);
        let (name, owner) = (req.name.clone(), req.owner.clone());
        let session_ttl = self.session_ttl;
        let value = req.value.clone();
        let conn = slot.conn.clone();
        slot.set_task(tokio::spawn(async move {
            let value = value.as_deref();
            let answer = conn
                .query_one(
                    Stmt::AdvisoryAcquire,
                    &[
                        &name.as_str(),
                        &owner.as_str(),
                        &shared,
                        &true,
                        &ttl,
                        &value,
                    ],
                    "acquire",
                )
                .await;
            // The server's idle timer started when it answered: a ping sent now is a send
            // time to count the session from.
            let sent = SystemClock.now();
            let granted = match answer {
                Ok(row) => match reply::single::<Option<i64>>(&row, "acquire") {
                    Ok(Some(token)) => reply::token(token, "acquire"),
                    Ok(None) => Err(undecodable("acquire", "no token after waiting")),
                    Err(error) => Err(error),
                },
                Err(error) => Err(error),
            };
            let pinged = match granted {
                Ok(token) => conn.query_one(Stmt::Ping, &[], "ping").await.map(|_| token),
                Err(error) => Err(error),
            };
            if pinged.is_err() {
                // It may have failed after the lock was granted (a statement timeout, a
                // cancel), which the rollback leaves held: the session goes, and its hold.
                conn.close();
            }
            let Some(slot) = waiting.upgrade() else {
                return;
            };
            match pinged {
                Ok(token) => {
                    // The pings take this task's place; the engine's next acquire hands
                    // out the grant.
                    let _ = slot.held(token, sent, session_ttl);
                }
                Err(error) => slot.set(State::Failed(error)),
            }
        }));
        // Busy only once the server has queued the request (or granted it meanwhile): a
        // request arriving after this answer comes after it in the queue.
        self.until_queued(&slot, &req.name)
            .await
            .map(|granted| match granted {
                Some(grant) => Acquire::Granted(grant),
                None => Acquire::Busy(hint),
            })
    }

    /// Returns once the slot's blocking statement waits in the server's queue, or is done.
    /// It returns `None` while it waits, the grant if it was granted, the error if it
    /// failed. The statement that finds it queued tells the watchers of `name`.
    async fn until_queued(&self, slot: &Slot, name: &LockName) -> Result<Option<Grant>> {
        let mut state = slot.state.subscribe();
        loop {
            match state.borrow_and_update().clone() {
                State::Waiting => {}
                State::Held(token, keeper) => {
                    return Ok(Some(Grant::new(token, Expiry::Session(keeper.liveness()))));
                }
                State::Failed(error) => return Err(error),
                State::Unknown => return Err(undecodable("acquire", "a wait of unknown state")),
            }
            let conn = self.shared.get().await?;
            let row = conn
                .query_one(
                    Stmt::AdvisoryQueued,
                    &[&slot.pid, &name.as_str()],
                    "acquire",
                )
                .await?;
            if reply::single::<bool>(&row, "acquire")? {
                return Ok(None);
            }
        }
    }

    pub(crate) async fn renew(&self, req: &Request) -> Result<Renewal> {
        let slot = self.owners().get(&req.owner).cloned();
        Ok(match slot.map(|s| s.state()) {
            Some(State::Held(_, keeper)) if matches!(keeper.current(), Liveness::Alive { .. }) => {
                Renewal::Renewed(Expiry::Session(keeper.liveness()))
            }
            _ => Renewal::Lost(LossReason::SessionEnded),
        })
    }

    /// Writes a record beside `req.name` if `req`'s lock is still held, in one statement.
    /// The statement (`Stmt::AdvisoryPutRecord`) runs on the connection whose session holds
    /// the lock, and writes only if that session holds it now (`pg_locks`) under the
    /// owner's row in `req.mode`: no one else can take the lock while the statement runs
    /// on its holder's session, and a session ended meanwhile rolls it back. `keep` is in
    /// milliseconds. `false`: this client holds no such lock, its connection is gone, or
    /// the server says the session does not hold it; nothing was written.
    ///
    /// # Cancel safety
    ///
    /// One statement in one transaction: dropped before it completed, the server either
    /// wrote the record or did not.
    ///
    /// # Errors
    ///
    /// Backend errors; [`Error::Unavailable`] if the connection broke while the statement
    /// was on its way (whether it was written is then unknown).
    pub(crate) async fn put_record(
        &self,
        req: &Request,
        key: &RecordKey,
        value: &[u8],
        keep: i64,
    ) -> Result<bool> {
        let code = match req.mode {
            Mode::Exclusive => b'x' as i8,
            Mode::Shared => b's' as i8,
            // Never granted in advisory mode.
            Mode::Permit { .. } => return Ok(false),
        };
        let Some(slot) = self.owners().get(&req.owner).cloned() else {
            return Ok(false);
        };
        // Only a held lock: a waiting slot's connection runs its blocking statement, and
        // anything sent after it would wait for the grant.
        if !matches!(slot.state(), State::Held(..)) || slot.conn.is_closed() {
            return Ok(false);
        }
        let row = slot
            .conn
            .query_one(
                Stmt::AdvisoryPutRecord,
                &[
                    &req.name.as_str(),
                    &req.owner.as_str(),
                    &code,
                    &key.as_str(),
                    &value,
                    &keep,
                ],
                "writing a record",
            )
            .await?;
        reply::single(&row, "writing a record")
    }

    pub(crate) async fn release(&self, req: &Request) -> Result<Release> {
        let Some(slot) = self.owners().remove(&req.owner) else {
            return Ok(Release::NotHeld);
        };
        // Dropped before the end, the slot closes its connection, which frees its lock.
        let waited = matches!(slot.state(), State::Waiting);
        if waited {
            self.cancel_wait(&slot).await?;
        }
        if let Some(task) = slot.take_task() {
            task.abort();
        }
        if let State::Failed(_) = slot.state() {
            // Nothing is held on a connection whose wait failed: it was closed.
            if waited {
                // A waiter left the queue, which no statement of the schema says.
                self.tell_watchers(&req.name).await;
            }
            return Ok(Release::Released);
        }
        let row = slot
            .conn
            .query_one(
                Stmt::AdvisoryRelease,
                &[&req.name.as_str(), &slot.shared],
                "release",
            )
            .await?;
        let held = reply::single::<bool>(&row, "release")?;
        if let State::Held(_, keeper) = slot.state() {
            keeper.end();
        }
        slot.set(State::Unknown);
        self.checkin(&slot);
        Ok(if held {
            Release::Released
        } else {
            Release::NotHeld
        })
    }

    /// Cancels the slot's blocking statement and waits for its outcome.
    /// It was granted meanwhile, or cancelled.
    async fn cancel_wait(&self, slot: &Slot) -> Result<()> {
        slot.conn
            .client()
            .cancel_token()
            .cancel_query(self.connector.tls())
            .await
            .map_err(|e| crate::error::map(e, "cancelling a wait"))?;
        let mut state = slot.state.subscribe();
        let _ = state.wait_for(|s| !matches!(s, State::Waiting)).await;
        Ok(())
    }

    pub(crate) async fn abandon(&self, req: &Request) -> Result<()> {
        // Closing the session's connection frees what it held, but only as the server's
        // process for it exits, after this returns. So the release is sent once more on
        // that connection, if it still answers (bounded by a third of the session ttl);
        // not done, its slot is dropped, which closes the connection.
        let bound = self.session_ttl / 3;
        match tokio::time::timeout(bound, self.release(req)).await {
            Ok(released) => released.map(|_| ()),
            Err(_) => Err(Error::Timeout(bound)),
        }
    }

    /// Tells the watchers of `name` that it changed, if any follows it; failures only logged.
    /// It is for a waiter that left the server's queue: a cancelled wait commits nothing
    /// that could tell them. A watcher that misses it reads the name again at its
    /// next change.
    async fn tell_watchers(&self, name: &LockName) {
        let told = async {
            let conn = self.shared.get().await?;
            conn.query(
                Stmt::TellWatchers,
                &[&name.as_str()],
                "telling the watchers",
            )
            .await
        };
        if let Err(error) = told.await {
            tracing::debug!(%error, "telling the watchers of a waiter that left failed");
        }
    }

    pub(crate) async fn wait(&self, hint: &WaitHint, max: Duration) -> Result<()> {
        match hint.get::<Hint>() {
            Some(Hint::Queued(state)) => {
                let mut state = state.clone();
                let _ = tokio::time::timeout(max, state.wait_for(|s| !matches!(s, State::Waiting)))
                    .await;
            }
            Some(Hint::Observer(ticket)) => {
                self.wakeups.wait(ticket, max, OBSERVER_POLL).await;
            }
            None => {}
        }
        Ok(())
    }

    pub(crate) async fn inspect(&self, name: &LockName) -> Result<LockState> {
        let ticket = self.wakeups.ticket(name.as_str(), None);
        let conn = self.shared.get().await?;
        let rows = conn
            .query(Stmt::AdvisoryInspect, &[&name.as_str()], "inspect")
            .await?;
        let (holders, waiters) = reply::advisory_state(&rows)?;
        let mut state = LockState::new(WaitHint::new(Hint::Observer(ticket)));
        state.holders = holders;
        state.waiters = waiters;
        Ok(state)
    }

    /// One page of the names under a prefix with a holder, with holders and waiters.
    /// Each with what [`inspect`](Advisory::inspect) would answer (no grant time: the
    /// schema keeps none). The names are those of the `advisory` table (by its name index),
    /// which has rows of holders only: a name's waiters are listed with its holders, and a
    /// name whose lock is held outside leasehold is not listed. One statement reads the
    /// page's names and, once, the server's lock table.
    ///
    /// # Cancel safety
    ///
    /// Read-only: dropped, it leaves nothing behind on the server.
    pub(crate) async fn list(&self, page: &Page) -> Result<Listing> {
        let rows = page.query(&self.shared, Stmt::AdvisoryList).await?;
        reply::advisory_listing(&rows, page.limit())
    }
}

impl Drop for Advisory {
    fn drop(&mut self) {
        self.listener.abort();
    }
}
