//! The session, one per backend, and the task that tells its guards how far to trust it.
//! One ZooKeeper session serves every lock, permit and candidacy of the backend.
//!
//! - **Alive**: a probe goes out every tenth of the negotiated session timeout (it also
//!   keeps the session alive: the client library pings only an idle connection). The probe
//!   is a `sync`, which a follower forwards to the leader, and answers only once the
//!   leader has answered it: only the leader expires sessions, and a follower cut off from
//!   it would go on answering local reads (an `exists`) for up to `syncLimit × tickTime`
//!   after the leader could have expired the session. Each acknowledged probe moves the
//!   session's local deadline to the time the leader is known to have heard from the
//!   session (see [`Heard`]), plus the negotiated timeout, minus a drift allowance. The
//!   leader expires a session no earlier than its timeout after it last heard from it: the
//!   guards give up first.
//! - **Suspended** (jeopardy): the connection is lost, or a probe goes unanswered for a
//!   tenth of the timeout. The deadline stays where the last acknowledged probe put it.
//! - **Resumed**: a probe is acknowledged again before the deadline (the client library
//!   reconnected within the session's life).
//! - **Ended**: the deadline passes first, or the server says the session expired, or it
//!   is closed. An acknowledgement arriving after the deadline ends it too: the loss was
//!   signalled, so the session is closed rather than believed again, and its nodes go.
//!   A new session is opened for later acquisitions.
//!
//! A session also owns the *lock-delay sessions*: one more session per band of lock-delays
//! in use, whose ephemeral markers outlive the main session's nodes by the delay (see
//! [`DelaySession`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::Duration;

use leasehold_core::backend::{Liveness, ServerView, SessionKeeper, SessionLiveness};
use leasehold_core::clock::{Clock, Instant, SystemClock};
use leasehold_core::{Error, OwnerId, Result};
use tokio::sync::Mutex as AsyncMutex;
use tokio::task::JoinHandle;
use zookeeper_client as zk;

use crate::error::{ends_session, map};
use crate::layout;
use crate::options::{Target, ZooKeeperOptions};

/// The drift allowance subtracted from the session timeout: 1 % + 2 ms, as for the engine.
fn validity(timeout: Duration) -> Duration {
    timeout.saturating_sub(timeout / 100 + Duration::from_millis(2))
}

/// How often the session is probed, and how long a probe may go unanswered.
/// After that the session counts as suspended.
fn cadence(timeout: Duration) -> Duration {
    (timeout / 10).max(Duration::from_millis(10))
}

/// How far behind the probes the leader's knowledge of the session may be, in an ensemble.
///
/// A follower passes on the sessions it heard from to the leader when it answers the
/// leader's ping, which comes every half tick (`tickTime / 2`); the answer to a `sync`
/// proves that the follower could reach the leader, not that a ping went through since the
/// probe touched the session. The negotiated timeout is at least two ticks (the server's
/// default `minSessionTimeout`), so half a tick is at most a quarter of it; a twentieth
/// more covers the ping's way from the leader and the probe's way to the follower. A
/// standalone server hears the probe directly: no lag.
fn leader_lag(timeout: Duration, ensemble: bool) -> Duration {
    if ensemble {
        timeout * 3 / 10
    } else {
        Duration::ZERO
    }
}

/// What the acknowledged probes prove about when the leader last heard from the session.
///
/// Without lag (a standalone server) a probe proves its own send time. In an ensemble, a
/// probe sent at `s` was passed on to the leader by the time a probe sent at `s + lag` or
/// later is acknowledged: that one was forwarded to the leader after at least one of the
/// leader's pings came through the same follower (pings come every `lag` at the most), and
/// the follower answers a ping with every session it heard from before. A reconnection to
/// another server revalidates the session with the leader, which counts as hearing from
/// it, after every probe acknowledged before.
#[derive(Debug)]
struct Heard {
    lag: Duration,
    /// The leader heard from the session at or after this instant.
    proven: Instant,
    /// Send times of acknowledged probes not proven yet, oldest first.
    pending: VecDeque<Instant>,
}

impl Heard {
    /// The record of a session created after `opened`.
    /// The leader created it, and from then on counts on it for a whole timeout.
    fn new(opened: Instant, lag: Duration) -> Self {
        Self {
            lag,
            proven: opened,
            pending: VecDeque::new(),
        }
    }

    /// Records that a probe sent at `sent` was acknowledged.
    /// Returns the instant the leader is known to have heard from the session at or after.
    fn acknowledged(&mut self, sent: Instant) -> Instant {
        if self.lag.is_zero() {
            self.proven = self.proven.max(sent);
            return self.proven;
        }
        if let Some(horizon) = sent.checked_sub(self.lag) {
            while let Some(&oldest) = self.pending.front()
                && oldest <= horizon
            {
                self.proven = self.proven.max(oldest);
                self.pending.pop_front();
            }
        }
        self.pending.push_back(sent);
        self.proven
    }
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
    /// The epoch found in (or written to) the epoch node when it was opened.
    pub(crate) epoch: String,
    keeper: Arc<SessionKeeper>,
    task: JoinHandle<()>,
    /// Lock-delay sessions, by band (see [`delay_band`]).
    delays: Delays,
    /// Held while a lock-delay session is being opened.
    delay_opening: AsyncMutex<()>,
    target: Arc<Target>,
    options: Arc<ZooKeeperOptions>,
}

/// Connects a client to `target`'s servers with a session of `timeout`.
/// It enters the chroot, creating it if missing.
async fn connect(
    target: &Target,
    options: &ZooKeeperOptions,
    timeout: Duration,
    detached: bool,
) -> Result<zk::Client> {
    let mut connector = zk::Client::connector().with_session_timeout(timeout);
    if let Some((user, password)) = &options.digest {
        let auth = format!("{user}:{}", password.expose());
        connector = connector.with_auth("digest", auth.as_bytes());
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

/// The session timeout asked for a session that must last the server's longest: a day.
/// The server grants its `maxSessionTimeout` instead.
const LONGEST_ASKED: Duration = Duration::from_secs(24 * 3600);

impl Session {
    /// A client of a new session that is never closed, of at least `outlast`'s timeout.
    /// It asks for `outlast`'s timeout and a twentieth more (as a lock-delay session
    /// does), or, without one, for the server's longest. Dropped, the client leaves its
    /// session to the server, which expires it a whole timeout later, with its ephemeral
    /// nodes.
    pub(crate) async fn open_unclosed(&self, outlast: Option<Duration>) -> Result<zk::Client> {
        let timeout = outlast.map_or(LONGEST_ASKED, |t| {
            Duration::from_millis(u64::try_from(t.as_millis() * 20 / 19 + 1).unwrap_or(u64::MAX))
        });
        connect(&self.target, &self.options, timeout, true).await
    }

    /// Opens a session and makes sure `root` (the epoch node) exists.
    ///
    /// `on_end` is called with the session's id when it ends by itself (deadline, expiry):
    /// the owner lets go of it then, so that it closes and its nodes go.
    pub(crate) async fn open(
        target: Arc<Target>,
        options: Arc<ZooKeeperOptions>,
        root: &str,
        on_end: impl FnOnce(i64) + Send + 'static,
    ) -> Result<Session> {
        // The leader creates the session after this instant, and counts on it for a
        // whole timeout from then.
        let opened = SystemClock.now();
        let client = connect(&target, &options, options.session_timeout, false).await?;
        let timeout = client.session_timeout();
        let (config, epoch) = tokio::join!(
            client.get_config(),
            ensure_epoch(&client, root, options.digest.is_some())
        );
        let epoch = epoch?;
        let id = client.session_id().0;
        let private = options.digest.is_some();
        publish_timeout(&client, &layout::session_node(root, id), timeout, private).await;
        // Members are listed in an ensemble's configuration, not in a standalone server's;
        // anything else counts as an ensemble (the safe side).
        let ensemble = !config.is_ok_and(|(data, _)| data.is_empty());
        let heard = Heard::new(opened, leader_lag(timeout, ensemble));
        let until = opened.saturating_add(validity(timeout));
        let keeper = Arc::new(SessionKeeper::new(until));
        keeper.kept_alive(until, ServerView::new(opened, timeout));
        let task = tokio::spawn(follow(
            client.clone(),
            timeout,
            keeper.clone(),
            heard,
            on_end,
        ));
        tracing::debug!(session = %format_args!("{id:x}"), ?timeout, ensemble, "zookeeper session opened");
        Ok(Session {
            client,
            id,
            timeout,
            epoch,
            keeper,
            task,
            delays: Arc::new(std::sync::Mutex::new(HashMap::new())),
            delay_opening: AsyncMutex::new(()),
            target,
            options,
        })
    }

    /// Whether the session can still be counted on: its local deadline is ahead.
    pub(crate) fn is_alive(&self) -> bool {
        !self.remaining().is_zero()
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

    /// Ends the session here: its guards are lost.
    /// The session itself closes (its nodes go at once) when the last user of this value
    /// drops it; the lock-delay sessions are left to expire, so that their markers keep the
    /// delay.
    pub(crate) fn end(&self) {
        // A session past its deadline keeps it: its guards say why they were lost.
        if self.is_alive() {
            self.keeper.end();
        }
        self.task.abort();
        // No longer probed: each expires one (longer) timeout from now.
        self.delay_sessions().clear();
    }

    /// The client of the lock-delay session for `delay`, for creating a marker under it.
    /// The session (see [`DelaySession`]) is opened now if there is none. The marker is
    /// counted (until [`marker_deleted`](Session::marker_deleted)) unless it was already,
    /// under the session `counted`.
    pub(crate) async fn delay_client(
        &self,
        delay: Duration,
        counted: Option<i64>,
    ) -> Result<zk::Client> {
        let band = delay_band(delay);
        let _opening = self.delay_opening.lock().await;
        {
            let mut delays = self.delay_sessions();
            if let Some(open) = delays.get_mut(&band)
                && !open.client.state().is_terminated()
            {
                if counted != Some(open.client.session_id().0) {
                    open.markers += 1;
                }
                return Ok(open.client.clone());
            }
            // Expired: its markers went with it.
            delays.remove(&band);
        }
        if !self.is_alive() {
            return Err(Error::Lost(leasehold_core::LossReason::SessionEnded));
        }
        let mut opened = DelaySession::open(
            &self.target,
            &self.options,
            self.timeout,
            band,
            Arc::downgrade(&self.delays),
        )
        .await?;
        opened.markers = 1;
        let client = opened.client.clone();
        self.delay_sessions().insert(band, opened);
        Ok(client)
    }

    /// The client of the lock-delay session `id` (for `delay`), if it is still open.
    /// Else its markers are gone, or go when it expires.
    pub(crate) fn open_delay_client(&self, delay: Duration, id: i64) -> Option<zk::Client> {
        self.delay_sessions()
            .get(&delay_band(delay))
            .filter(|open| open.client.session_id().0 == id)
            .map(|open| open.client.clone())
    }

    /// A marker created under the lock-delay session `id` (for `delay`) is known to be gone.
    pub(crate) fn marker_deleted(&self, delay: Duration, id: i64) {
        if let Some(open) = self
            .delay_sessions()
            .get_mut(&delay_band(delay))
            .filter(|open| open.client.session_id().0 == id)
        {
            open.markers = open.markers.saturating_sub(1);
            if open.markers == 0 {
                open.unused_since = SystemClock.now();
            }
        }
    }

    fn delay_sessions(&self) -> std::sync::MutexGuard<'_, HashMap<Duration, DelaySession>> {
        lock_delays(&self.delays)
    }

    /// Ends the session and closes it: its nodes are deleted at once.
    /// The lock-delay sessions are dropped (the caller deletes their markers first: a close
    /// is a release, not a vanishing). Waits up to the connect timeout for the server to
    /// confirm.
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

/// The lock-delay sessions of a main session, by band.
type Delays = Arc<std::sync::Mutex<HashMap<Duration, DelaySession>>>;

fn lock_delays(
    delays: &std::sync::Mutex<HashMap<Duration, DelaySession>>,
) -> std::sync::MutexGuard<'_, HashMap<Duration, DelaySession>> {
    delays.lock().unwrap_or_else(|e| e.into_inner())
}

/// The lock-delay a marker keeps for `delay`, rounded up to one of a few steps.
/// It is rounded up to whole milliseconds and then to one of four steps per doubling (4, 5,
/// 6 or 7 × a power of two milliseconds: at most a quarter longer), so that the delays in
/// use share a few lock-delay sessions.
pub(crate) fn delay_band(delay: Duration) -> Duration {
    let mut ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
    if !delay.subsec_nanos().is_multiple_of(1_000_000) {
        ms = ms.saturating_add(1);
    }
    if ms <= 8 {
        return Duration::from_millis(ms);
    }
    // Keep the three highest bits, rounding up.
    let step = 1_u64 << (u64::BITS - ms.leading_zeros() - 3);
    Duration::from_millis(ms.div_ceil(step).saturating_mul(step))
}

/// A lock-delay session: the owner of the lock-delay markers of one band of delays.
/// Bands come from [`delay_band`]. Its timeout is the main session's plus the delay, plus
/// its probe cadence (a twentieth of it): it is probed that often while the main session
/// lives, so when both go silent (the process died, the link broke) its markers outlive the
/// main session's nodes by the delay, less at most one server tick (ZooKeeper rounds
/// expiries up to its tick). It is detached: dropping it leaves it to expire rather than
/// closing it. Once none of this client's markers is under it for a main session timeout,
/// it is dropped (it holds nothing: its expiry changes nothing).
#[derive(Debug)]
struct DelaySession {
    client: zk::Client,
    task: JoinHandle<()>,
    /// This client's markers that may exist under it.
    markers: usize,
    /// When the last of them was deleted.
    unused_since: Instant,
}

impl DelaySession {
    async fn open(
        target: &Target,
        options: &ZooKeeperOptions,
        main: Duration,
        delay: Duration,
        delays: Weak<std::sync::Mutex<HashMap<Duration, DelaySession>>>,
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
        let id = client.session_id();
        let task = tokio::spawn(async move {
            loop {
                let next = SystemClock.now().saturating_add(every);
                if let Err(error) = probed.check_stat("/").await
                    && ends_session(&error)
                {
                    return;
                }
                SystemClock.sleep_until(next).await;
                let Some(delays) = delays.upgrade() else {
                    return;
                };
                let mut delays = lock_delays(&delays);
                if let Some(open) = delays.get(&delay)
                    && open.client.session_id() == id
                    && open.markers == 0
                    && SystemClock
                        .now()
                        .saturating_duration_since(open.unused_since)
                        >= main
                {
                    tracing::debug!(?delay, "zookeeper: dropping an unused lock-delay session");
                    delays.remove(&delay);
                    return;
                }
            }
        });
        Ok(DelaySession {
            client,
            task,
            markers: 0,
            unused_since: SystemClock.now(),
        })
    }
}

impl Drop for DelaySession {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Says the session's negotiated `timeout` (in ms) in the ephemeral node at `path`.
/// An eviction of one of its grants keeps the lock closed that long (see `evict`); where
/// the node is missing it takes the server's longest. Best effort: a failure is logged.
async fn publish_timeout(client: &zk::Client, path: &str, timeout: Duration, private: bool) {
    let data = timeout.as_millis().to_string();
    let node = zk::CreateMode::Ephemeral.with_acls(acls(private));
    for _ in 0..2 {
        match client.create(path, data.as_bytes(), &node).await {
            Ok(_) | Err(zk::Error::NodeExists) => return,
            Err(zk::Error::NoNode) => {
                let parent = path.rsplit_once('/').map_or(path, |(parent, _)| parent);
                let dir = zk::CreateMode::Persistent.with_acls(acls(private));
                if let Err(e) = client.mkdir(parent, &dir).await {
                    tracing::debug!("zookeeper: creating {parent}: {e}");
                }
            }
            Err(e) => {
                tracing::debug!("zookeeper: saying the session's timeout at {path}: {e}");
                return;
            }
        }
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
    mut heard: Heard,
    on_end: impl FnOnce(i64) + Send + 'static,
) {
    let id = client.session_id().0;
    let ended = watch(&client, timeout, &keeper, &mut heard).await;
    tracing::warn!(session = %format_args!("{id:x}"), "zookeeper session ended: {}", ended.why());
    if let Ended::Gone(_) = ended {
        keeper.end();
    }
    drop(client);
    on_end(id);
}

/// How a session ended.
enum Ended {
    /// Its local deadline passed: its guards are lost at it, and it is given up.
    /// They are lost as disconnected if it was suspended.
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
async fn watch(
    client: &zk::Client,
    timeout: Duration,
    keeper: &SessionKeeper,
    heard: &mut Heard,
) -> Ended {
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
        // The request is queued now; while disconnected it goes out on reconnection. A
        // follower answers it once the leader did.
        let mut probe = std::pin::pin!(client.sync("/"));
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
                            let proven = heard.acknowledged(sent);
                            keeper.kept_alive(
                                proven.saturating_add(validity(timeout)),
                                ServerView::new(proven, timeout),
                            );
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

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_origin(Duration::from_millis(ms))
    }

    #[test]
    fn a_session_counts_on_its_timeout_minus_the_drift_from_the_send_time() {
        assert_eq!(
            at(100_000).saturating_add(validity(Duration::from_secs(10))),
            at(109_898)
        );
        assert_eq!(cadence(Duration::from_secs(10)), Duration::from_secs(1));
        assert_eq!(
            cadence(Duration::from_millis(50)),
            Duration::from_millis(10)
        );
    }

    #[test]
    fn a_standalone_server_proves_each_probe_at_once() {
        let timeout = Duration::from_secs(10);
        let mut heard = Heard::new(at(1_000), leader_lag(timeout, false));
        assert_eq!(heard.acknowledged(at(2_000)), at(2_000));
        assert_eq!(heard.acknowledged(at(3_000)), at(3_000));
    }

    #[test]
    fn in_an_ensemble_a_probe_counts_once_a_later_one_proves_it_reached_the_leader() {
        let timeout = Duration::from_secs(10);
        // A quarter of the timeout (half a tick at most) and a twentieth.
        assert_eq!(leader_lag(timeout, true), Duration::from_secs(3));
        let mut heard = Heard::new(at(1_000), leader_lag(timeout, true));
        // Probes every second: each one proves the one sent three seconds before it.
        for sent in (2_000..=4_000).step_by(1_000) {
            assert_eq!(heard.acknowledged(at(sent)), at(1_000), "{sent}");
        }
        assert_eq!(heard.acknowledged(at(5_000)), at(2_000));
        assert_eq!(heard.acknowledged(at(6_000)), at(3_000));
        // After a gap, the newest old enough is proven, and nothing later.
        assert_eq!(heard.acknowledged(at(9_500)), at(6_000));
        assert_eq!(heard.acknowledged(at(9_600)), at(6_000));
        assert_eq!(heard.acknowledged(at(12_500)), at(9_500));
        // A deadline is never set from a probe the leader may not have seen yet.
        let deadline = heard
            .acknowledged(at(13_000))
            .saturating_add(validity(timeout));
        assert!(deadline <= at(13_000 - 3_000).saturating_add(timeout));
    }

    #[test]
    fn lock_delays_share_a_few_bands() {
        let band = |ms: u64| delay_band(Duration::from_millis(ms)).as_millis();
        assert_eq!(band(0), 0);
        assert_eq!(band(7), 7);
        assert_eq!(band(9), 10);
        assert_eq!(band(1_000), 1_024);
        assert_eq!(band(1_009), 1_024);
        assert_eq!(band(1_025), 1_280);
        assert_eq!(band(1_280), 1_280);
        assert_eq!(band(30_000), 32_768);
        assert_eq!(
            delay_band(Duration::from_micros(1_500)),
            Duration::from_millis(2)
        );
        for ms in 1..20_000 {
            let banded = band(ms);
            assert!(
                banded >= u128::from(ms) && banded * 4 <= u128::from(ms) * 5 + 4,
                "{ms}"
            );
        }
        // Four bands per doubling.
        let bands: std::collections::BTreeSet<_> = (1_025..=2_048).map(band).collect();
        assert_eq!(bands.len(), 4);
    }
}
