//! The session: one ZooKeeper session per backend, serving every lock, permit and
//! candidacy of that backend, and the task that tells its guards how far it can be trusted.
//!
//! - **Alive**: a probe (an `exists` of the chroot) goes out every tenth of the negotiated
//!   session timeout (it also keeps the session alive: the client library pings only an
//!   idle connection). Each acknowledged probe moves the session's local deadline to the
//!   time the probe was *sent*, plus the negotiated timeout, minus a drift allowance. The
//!   server expires a session no earlier than its timeout after it last heard from the
//!   client, and it heard the probe after it was sent: the guards give up first.
//! - **Suspended** (jeopardy): the connection is lost, or a probe goes unanswered for a
//!   tenth of the timeout. The deadline stays where the last acknowledged probe put it.
//! - **Resumed**: a probe is acknowledged again before the deadline (the client library
//!   reconnected within the session's life).
//! - **Ended**: the deadline passes first, or the server says the session expired, or it
//!   is closed. An acknowledgement arriving after the deadline ends it too: the loss was
//!   signalled, so the session is closed rather than believed again, and its nodes go.
//!   A new session is opened for later acquisitions.
//!
//! A session also owns the *lock-delay sessions*: one more session per lock-delay, whose
//! ephemeral markers outlive the main session's nodes by the delay (see [`DelaySession`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use leasehold_core::backend::{Liveness, SessionKeeper, SessionLiveness};
#[cfg(test)]
use leasehold_core::clock::Instant;
use leasehold_core::clock::{Clock, SystemClock};
use leasehold_core::{Error, OwnerId, Result};
use tokio::sync::Mutex as AsyncMutex;
use tokio::task::JoinHandle;
use zookeeper_client as zk;

use crate::error::{ends_session, map};
use crate::options::{Target, ZooKeeperOptions};

/// The drift allowance subtracted from the session timeout: 1 % + 2 ms, as for the engine.
fn validity(timeout: Duration) -> Duration {
    timeout.saturating_sub(timeout / 100 + Duration::from_millis(2))
}

/// How often the session is probed, and how long a probe may go unanswered before the
/// session counts as suspended.
fn cadence(timeout: Duration) -> Duration {
    (timeout / 10).max(Duration::from_millis(10))
}

/// The data of the epoch node starts with this, then a random id.
const EPOCH: &str = "leasehold-epoch ";

/// How this client's nodes are protected.
pub(crate) fn acls(private: bool) -> zk::Acls<'static> {
    if private {
        zk::Acls::creator_all()
    } else {
        zk::Acls::anyone_all()
    }
}

/// One ZooKeeper session and the task following it.
#[derive(Debug)]
pub(crate) struct Session {
    /// The client, rooted at the chroot.
    pub(crate) client: zk::Client,
    /// ZooKeeper's id of the session (the `ephemeralOwner` of its nodes).
    pub(crate) id: i64,
    /// The negotiated session timeout.
    pub(crate) timeout: Duration,
    keeper: Arc<SessionKeeper>,
    task: JoinHandle<()>,
    /// Lock-delay sessions, by delay.
    delays: std::sync::Mutex<HashMap<Duration, DelaySession>>,
    /// Held while a lock-delay session is being opened.
    delay_opening: AsyncMutex<()>,
    target: Arc<Target>,
    options: Arc<ZooKeeperOptions>,
}

/// Connects a client to `target`'s servers with a session of `timeout`, enters the chroot
/// (creating it if missing).
async fn connect(
    target: &Target,
    options: &ZooKeeperOptions,
    timeout: Duration,
    detached: bool,
) -> Result<zk::Client> {
    let mut connector = zk::Client::connector().with_session_timeout(timeout);
    if let Some((user, password)) = &options.digest {
        connector = connector.with_auth("digest", format!("{user}:{password}").as_bytes());
    }
    if detached {
        connector = connector.with_detached();
    }
    let servers = target.connect_string();
    let client = tokio::time::timeout(options.connect_timeout, connector.connect(&servers))
        .await
        .map_err(|_| {
            Error::unavailable(format!(
                "zookeeper: no session established with {servers} within {:?}",
                options.connect_timeout
            ))
        })?
        .map_err(|e| map(e, &format!("connecting to {servers}")))?;
    let Some(chroot) = &target.chroot else {
        return Ok(client);
    };
    let exists = client
        .check_stat(chroot)
        .await
        .map_err(|e| map(e, &format!("looking up the chroot {chroot}")))?;
    if exists.is_none() {
        client
            .mkdir(
                chroot,
                &zk::CreateMode::Persistent.with_acls(acls(options.digest.is_some())),
            )
            .await
            .map_err(|e| map(e, &format!("creating the chroot {chroot}")))?;
    }
    client.chroot(chroot.as_str()).map_err(|_| {
        Error::invalid(
            "url",
            format!("the chroot {chroot:?} is not a ZooKeeper path"),
        )
    })
}

impl Session {
    /// Opens a session and makes sure `root` (the epoch node) exists; returns the session
    /// and the epoch found in (or written to) `root`.
    ///
    /// `on_end` is called with the session's id when it ends by itself (deadline, expiry):
    /// the owner lets go of it then, so that it closes and its nodes go.
    pub(crate) async fn open(
        target: Arc<Target>,
        options: Arc<ZooKeeperOptions>,
        root: &str,
        on_end: impl FnOnce(i64) + Send + 'static,
    ) -> Result<(Session, String)> {
        let client = connect(&target, &options, options.session_timeout, false).await?;
        let timeout = client.session_timeout();
        let sent = SystemClock.now();
        let epoch = ensure_epoch(&client, root, options.digest.is_some()).await?;
        let keeper = Arc::new(SessionKeeper::new(sent.saturating_add(validity(timeout))));
        let task = tokio::spawn(follow(client.clone(), timeout, keeper.clone(), on_end));
        let id = client.session_id().0;
        tracing::debug!(session = %format_args!("{id:x}"), ?timeout, "zookeeper session opened");
        Ok((
            Session {
                client,
                id,
                timeout,
                keeper,
                task,
                delays: std::sync::Mutex::new(HashMap::new()),
                delay_opening: AsyncMutex::new(()),
                target,
                options,
            },
            epoch,
        ))
    }

    /// Whether the session can still be counted on.
    pub(crate) fn is_alive(&self) -> bool {
        match self.keeper.current() {
            Liveness::Alive { until } => SystemClock.now() < until,
            Liveness::Ended => false,
        }
    }

    /// Time left until the local deadline (zero once ended).
    pub(crate) fn remaining(&self) -> Duration {
        match self.keeper.current() {
            Liveness::Alive { until } => until.saturating_duration_since(SystemClock.now()),
            Liveness::Ended => Duration::ZERO,
        }
    }

    /// A view for grants bound to this session.
    pub(crate) fn liveness(&self) -> SessionLiveness {
        self.keeper.liveness()
    }

    /// Ends the session here: its guards are lost. The session itself closes (its nodes go
    /// at once) when the last user of this value drops it; the lock-delay sessions are left
    /// to expire, so that their markers keep the delay.
    pub(crate) fn end(&self) {
        // A session past its deadline keeps it: its guards say why they were lost.
        if self.is_alive() {
            self.keeper.end();
        }
        self.task.abort();
        // No longer probed: each expires one (longer) timeout from now.
        self.delay_sessions().clear();
    }

    /// The client of the lock-delay session for `delay` (see [`DelaySession`]).
    pub(crate) async fn delay_client(&self, delay: Duration) -> Result<zk::Client> {
        let _opening = self.delay_opening.lock().await;
        if let Some(open) = self.delay_sessions().get(&delay)
            && !open.client.state().is_terminated()
        {
            return Ok(open.client.clone());
        }
        if !self.is_alive() {
            return Err(Error::Lost(leasehold_core::LossReason::SessionEnded));
        }
        let opened = DelaySession::open(&self.target, &self.options, self.timeout, delay).await?;
        let client = opened.client.clone();
        self.delay_sessions().insert(delay, opened);
        Ok(client)
    }

    fn delay_sessions(&self) -> std::sync::MutexGuard<'_, HashMap<Duration, DelaySession>> {
        self.delays.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends the session and closes it: its nodes are deleted at once. The lock-delay
    /// sessions are dropped (the caller deletes their markers first: a close is a release,
    /// not a vanishing). Waits up to the connect timeout for the server to confirm.
    pub(crate) async fn close(self: Arc<Self>) -> Result<()> {
        let mut state = self.client.state_watcher();
        self.end();
        let limit = self.options.connect_timeout;
        drop(self);
        let closed = async {
            while !state.state().is_terminated() {
                state.changed().await;
            }
        };
        tokio::time::timeout(limit, closed).await.map_err(|_| {
            Error::unavailable(
                "zookeeper: the session was not confirmed closed in time; its nodes go when \
                 it expires",
            )
        })
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A lock-delay session: the owner of the lock-delay markers of one delay. Its timeout is
/// the main session's plus the delay, plus its probe cadence (a twentieth of it): it is
/// probed that often while the main session lives, so when both go silent (the process
/// died, the link broke) its markers outlive the main session's nodes by the delay, less
/// at most one server tick (ZooKeeper rounds expiries up to its tick). It is detached:
/// dropping it leaves it to expire rather than closing it.
#[derive(Debug)]
struct DelaySession {
    client: zk::Client,
    task: JoinHandle<()>,
}

impl DelaySession {
    async fn open(
        target: &Target,
        options: &ZooKeeperOptions,
        main: Duration,
        delay: Duration,
    ) -> Result<DelaySession> {
        // ZooKeeper counts whole milliseconds: rounded up.
        let total = u64::try_from((main + delay).as_millis()).unwrap_or(u64::MAX / 20);
        let wanted = Duration::from_millis((total * 20).div_ceil(19));
        let client = connect(target, options, wanted, true).await?;
        let granted = client.session_timeout();
        if granted < wanted {
            return Err(Error::invalid(
                "lock delay",
                format!(
                    "a lock-delay of {delay:?} needs a ZooKeeper session of {wanted:?}; the \
                     server granted {granted:?} (raise its maxSessionTimeout, or shorten the \
                     delay or the session timeout)"
                ),
            ));
        }
        let probed = client.clone();
        let every = granted / 20;
        let task = tokio::spawn(async move {
            loop {
                let next = SystemClock.now().saturating_add(every);
                if let Err(error) = probed.check_stat("/").await
                    && ends_session(&error)
                {
                    return;
                }
                SystemClock.sleep_until(next).await;
            }
        });
        Ok(DelaySession { client, task })
    }
}

impl Drop for DelaySession {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Makes sure the epoch node exists and carries an epoch; returns it.
async fn ensure_epoch(client: &zk::Client, root: &str, private: bool) -> Result<String> {
    let fresh = format!("{EPOCH}{}", OwnerId::generate());
    let options = zk::CreateMode::Persistent.with_acls(acls(private));
    for _ in 0..3 {
        let (data, stat) = match client.get_data(root).await {
            Ok(found) => found,
            Err(zk::Error::NoNode) => match client.create(root, fresh.as_bytes(), &options).await {
                Ok(_) => return Ok(fresh),
                Err(zk::Error::NodeExists) => continue,
                Err(e) => return Err(map(e, &format!("creating {root}"))),
            },
            Err(e) => return Err(map(e, &format!("reading {root}"))),
        };
        if !data.is_empty() {
            return Ok(String::from_utf8_lossy(&data).into_owned());
        }
        // Made by another recipe (Curator creates parents empty): give it an epoch.
        match client
            .set_data(root, fresh.as_bytes(), Some(stat.version))
            .await
        {
            Ok(_) => return Ok(fresh),
            Err(zk::Error::BadVersion | zk::Error::NoNode) => {}
            Err(e) => return Err(map(e, &format!("writing {root}"))),
        }
    }
    Err(Error::backend(
        format!("zookeeper: {root} keeps changing; cannot read its epoch"),
        true,
    ))
}

/// Follows the session until it ends, then lets its owner know.
async fn follow(
    client: zk::Client,
    timeout: Duration,
    keeper: Arc<SessionKeeper>,
    on_end: impl FnOnce(i64) + Send + 'static,
) {
    let id = client.session_id().0;
    let ended = watch(&client, timeout, &keeper).await;
    tracing::warn!(session = %format_args!("{id:x}"), "zookeeper session ended: {}", ended.why());
    if let Ended::Gone(_) = ended {
        keeper.end();
    }
    drop(client);
    on_end(id);
}

/// How a session ended.
enum Ended {
    /// Its local deadline passed: its guards are lost at it (as disconnected if it was
    /// suspended), and it is given up.
    Deadline(&'static str),
    /// The server or this client ended it: its guards are lost at once.
    Gone(String),
}

impl Ended {
    fn why(&self) -> &str {
        match self {
            Ended::Deadline(why) => why,
            Ended::Gone(why) => why,
        }
    }
}

/// Probes the session, suspends and resumes it, until it ends.
async fn watch(client: &zk::Client, timeout: Duration, keeper: &SessionKeeper) -> Ended {
    let every = cadence(timeout);
    let mut state = client.state_watcher();
    let missed = || Ended::Deadline("no probe was acknowledged before the deadline");
    loop {
        let Liveness::Alive { until } = keeper.current() else {
            return Ended::Gone("ended by this client".into());
        };
        let sent = SystemClock.now();
        if sent >= until {
            return missed();
        }
        // The request is queued now; while disconnected it goes out on reconnection.
        let mut probe = std::pin::pin!(client.check_stat("/"));
        let mut overdue = std::pin::pin!(SystemClock.sleep_until(sent.saturating_add(every)));
        let mut deadline = std::pin::pin!(SystemClock.sleep_until(until));
        let mut late = false;
        loop {
            tokio::select! {
                biased;
                answer = &mut probe => {
                    match answer {
                        Ok(_) => {
                            if SystemClock.now() >= until {
                                return Ended::Deadline(
                                    "a probe was acknowledged after the deadline",
                                );
                            }
                            keeper.alive_until(sent.saturating_add(validity(timeout)));
                        }
                        Err(error) if ends_session(&error) => {
                            return Ended::Gone(error.to_string());
                        }
                        Err(_) => keeper.suspend(),
                    }
                    break;
                }
                changed = state.changed() => match changed {
                    zk::SessionState::Disconnected => keeper.suspend(),
                    s if s.is_terminated() => return Ended::Gone(format!("the session is {s}")),
                    _ => {}
                },
                () = &mut overdue, if !late => {
                    late = true;
                    keeper.suspend();
                }
                () = &mut deadline => return missed(),
            }
        }
        SystemClock.sleep_until(sent.saturating_add(every)).await;
    }
}

/// The deadline of a session whose probe was sent at `sent`, for tests of the arithmetic.
#[cfg(test)]
pub(crate) fn deadline_after(sent: Instant, timeout: Duration) -> Instant {
    sent.saturating_add(validity(timeout))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_counts_on_its_timeout_minus_the_drift_from_the_send_time() {
        let sent = Instant::from_origin(Duration::from_secs(100));
        assert_eq!(
            deadline_after(sent, Duration::from_secs(10)),
            Instant::from_origin(Duration::from_millis(109_898))
        );
        assert_eq!(cadence(Duration::from_secs(10)), Duration::from_secs(1));
        assert_eq!(
            cadence(Duration::from_millis(50)),
            Duration::from_millis(10)
        );
    }
}
