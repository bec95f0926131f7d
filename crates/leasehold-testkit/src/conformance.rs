//! The conformance suite: one set of behaviour cases every backend must pass.
//!
//! A backend's test file implements [`Deployment`] (how to open another independent
//! connection to the deployment under test, and how one client loses its liveness) and
//! expands every case into a test of the case's name with
//! [`conformance_suite!`](crate::conformance_suite):
//!
//! ```ignore
//! leasehold_testkit::conformance_suite!(async { MyDeployment::start().await });
//! ```
//!
//! - Every case runs on every backend. A case skips only what the backend's
//!   [`Capabilities`] say it does not do (shared mode,
//!   permits, fairness, lock-delay, expiring grants), with a message naming the case.
//!   Any other skip — a deployment that cannot cut a client's liveness although the
//!   backend's grants expire — fails the test when the environment variable
//!   [`ALL_CASES_VAR`] is set (`./scripts/test` sets it).
//! - Each case locks names of its own: its function name, or names starting with it.
//! - The cases are listed once, in [`CASES`]; a case function missing from the list is
//!   dead code, which the lints refuse.
//!
//! Every case asserts behaviour that a broken lock fails.

// These are test bodies: a failed step must fail the test, with the panic's location.
#![allow(clippy::unwrap_used)]

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use crate::faulty::{Faulty, Op};
use async_trait::async_trait;
use leasehold_core::backend::{Backend, Mode, Release, Request};
use leasehold_core::{
    Capabilities, Claim, Client, Error, Eviction, Fence, FencingToken, LockName, LockOptions,
    LossReason, MultiLock, Outcome, Owner, OwnerId, Part, RecordKey, Window,
};

use crate::proxy::{Direction, FaultProxy};

/// A deployment under test.
/// Something that hands out independent connections to one lock service (a server, a
/// cluster, a directory).
#[async_trait]
pub trait Deployment: Send + Sync {
    /// A new connection, as a separate client process would open it.
    async fn connect(&self) -> Arc<dyn Backend>;

    /// A new connection whose liveness a case can cut and restore.
    /// It is cut the way this backend loses a client: `None` when its grants never expire
    /// (nothing to cut).
    ///
    /// The default serves backends that renew each grant: renewals are held by a
    /// [`Faulty`] wrapper ([`RenewalSwitch`]). Backends whose grants live by a session
    /// override it, typically with the connection through a [`FaultProxy`]
    /// ([`ProxySwitch`]): the session's keep-alive is cut as a partition would cut it.
    async fn connect_cuttable(&self) -> Option<Cuttable> {
        let backend = self.connect().await;
        let caps = backend.capabilities();
        if !caps.expiring_leases || caps.has_sessions() {
            return None;
        }
        let faulty = Faulty::wrap(backend);
        Some(Cuttable::new(
            Arc::new(faulty.clone()),
            Arc::new(RenewalSwitch::new(faulty)),
        ))
    }
}

/// A connection and the switch that cuts its liveness.
#[non_exhaustive]
pub struct Cuttable {
    /// The connection.
    pub backend: Arc<dyn Backend>,
    /// Cuts and restores the connection's liveness.
    pub switch: Arc<dyn LivenessSwitch>,
}

impl Cuttable {
    /// `backend`, whose liveness `switch` cuts.
    pub fn new(backend: Arc<dyn Backend>, switch: Arc<dyn LivenessSwitch>) -> Self {
        Self { backend, switch }
    }
}

impl std::fmt::Debug for Cuttable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuttable")
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}

/// Cuts one client's liveness and gives it back.
/// After [`cut`](LivenessSwitch::cut) its grants are no longer kept alive, so each is lost
/// at its deadline and the server frees it at its lease's end; after
/// [`restore`](LivenessSwitch::restore) the client works again.
#[async_trait]
pub trait LivenessSwitch: Send + Sync {
    /// Stops keeping the client's grants alive.
    async fn cut(&self);
    /// Lets the client work again.
    async fn restore(&self);
}

/// The liveness switch of a backend that renews each grant.
/// Renewals are held before they reach the server.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RenewalSwitch(pub Faulty);

impl RenewalSwitch {
    /// Holds the renewals that pass through `faulty`.
    pub fn new(faulty: Faulty) -> Self {
        Self(faulty)
    }
}

#[async_trait]
impl LivenessSwitch for RenewalSwitch {
    async fn cut(&self) {
        self.0.hold_requests(Op::Renew);
    }
    async fn restore(&self) {
        self.0.resume(Op::Renew);
    }
}

/// The liveness switch of a connection through a [`FaultProxy`].
/// A cut is a partition (both directions held, on open and new connections alike), a
/// restore heals it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ProxySwitch(pub Arc<FaultProxy>);

impl ProxySwitch {
    /// Cuts the connections through `proxy`.
    pub fn new(proxy: Arc<FaultProxy>) -> Self {
        Self(proxy)
    }
}

#[async_trait]
impl LivenessSwitch for ProxySwitch {
    async fn cut(&self) {
        self.0.cut(Direction::Both);
    }
    async fn restore(&self) {
        self.0.heal();
    }
}

/// When set (to anything), a case that cannot be tested fails instead of being skipped.
/// That is a case that cannot be tested on a deployment. Skips for what a backend does not
/// claim to do stay skips.
pub const ALL_CASES_VAR: &str = "LEASEHOLD_CONFORMANCE_ALL";

/// The one list of cases.
/// It defines [`CASES`], the dispatcher and the exported
/// [`conformance_suite!`](crate::conformance_suite) macro from the same names, so a case
/// cannot be left out of one of them.
macro_rules! cases {
    ($d:tt $($case:ident),* $(,)?) => {
        /// The name of every case, in the order they are listed.
        pub const CASES: &[&str] = &[$(stringify!($case)),*];

        /// Runs the case called `name` against `deployment`.
        ///
        /// # Panics
        ///
        /// If the case fails, or no case has that name.
        pub async fn run(name: &str, deployment: &dyn Deployment) {
            match name {
                $(stringify!($case) => $case(&Case { name: stringify!($case), deployment }).await,)*
                other => panic!("no conformance case is called {other:?}"),
            }
        }

        /// Expands every conformance case into a `#[tokio::test]` of the case's name.
        /// `$setup` is an expression evaluating to a future of a [`Deployment`]; it runs
        /// once per test.
        #[macro_export]
        macro_rules! conformance_suite {
            ($d setup:expr) => {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $case() {
                        let deployment = $d setup.await;
                        $d crate::conformance::run(stringify!($case), &deployment).await;
                    }
                )*
            };
        }
    };
}

cases!($
    exclusive_under_contention_with_a_fenced_counter,
    try_lock_is_none_while_held,
    a_wait_timeout_gives_none_and_leaves_nothing,
    a_cancelled_waiter_leaves_nothing_behind,
    a_cancelled_try_lock_leaves_nothing_behind,
    a_cancelled_release_still_frees_the_lock,
    an_unconfirmed_release_does_not_outlive_its_lease,
    a_stale_release_deletes_nothing,
    a_stale_guard_cannot_release_the_next_holders_lock,
    loss_is_signalled_before_the_server_expires_the_lock,
    a_scoped_run_is_cancelled_on_loss,
    a_dropped_guard_frees_the_lock,
    tokens_strictly_increase_in_grant_order,
    waiters_are_served_in_arrival_order,
    a_semaphore_never_exceeds_its_permits,
    permits_of_mixed_limits_are_granted_in_queue_order,
    read_write_semantics_and_no_writer_starvation,
    one_leader_at_a_time_and_observers_see_changes,
    reentrant_holds_are_counted,
    inspect_reports_holders_and_waiters,
    a_listing_finds_held_and_queued_locks_by_prefix,
    a_watch_sees_locks_change_hands_by_push,
    a_force_release_evicts_the_holder_and_fences_it_out,
    an_eviction_with_an_old_token_spares_the_newer_grant,
    a_record_is_written_only_while_the_writers_grant_holds,
    a_kept_grant_outlives_its_holder,
    a_job_runs_once_per_window_and_a_lost_run_leaves_it_open,
    lock_delay_keeps_an_expired_lock_closed,
    renewals_keep_every_kind_of_grant,
    names_are_independent,
    a_multi_lock_takes_all_or_none,
    multi_locks_in_opposite_orders_never_deadlock,
    a_cancelled_multi_lock_leaves_nothing_behind,
    a_multi_lock_is_lost_with_any_of_its_parts,
    bad_input_is_rejected_with_typed_errors,
);

/// One case run: its name (also the lock name it uses) and the deployment.
struct Case<'a> {
    name: &'static str,
    deployment: &'a dyn Deployment,
}

/// Why a case does not run.
enum Skip {
    /// The backend does not claim the feature (its capabilities say so).
    NotClaimed(&'static str),
    /// The deployment cannot exercise it: a gap in the test set-up.
    NotTestable(&'static str),
}

impl Case<'_> {
    /// Returns `true` after reporting the skip.
    /// It panics instead for an untestable case when every case must run.
    fn skip(&self, caps: &Capabilities, why: Skip) -> bool {
        let (why, gap) = match why {
            Skip::NotClaimed(feature) => (format!("the backend does not claim {feature}"), false),
            Skip::NotTestable(why) => (why.to_owned(), true),
        };
        assert!(
            !(gap && std::env::var_os(ALL_CASES_VAR).is_some()),
            "conformance case {} cannot run on the {} backend ({why}), and {ALL_CASES_VAR} \
             says every case must run",
            self.name,
            caps.backend
        );
        eprintln!(
            "conformance case {} skipped on the {} backend: {why}",
            self.name, caps.backend
        );
        true
    }

    /// A client with 5 s leases.
    async fn client(&self) -> Client {
        self.client_with(options(Duration::from_secs(5))).await
    }

    async fn client_with(&self, options: LockOptions) -> Client {
        client_on(self.deployment.connect().await, options)
    }

    /// A client whose requests pass through a fault injector.
    async fn faulty_client(&self, options: LockOptions) -> (Client, Faulty) {
        let faults = Faulty::wrap(self.deployment.connect().await);
        (client_on(Arc::new(faults.clone()), options), faults)
    }

    /// A client whose liveness can be cut.
    /// It has a fault injector in front of it (for counting calls); `None` after a skip
    /// when there is no such client. On a session backend the options' ttl is left to the
    /// session.
    async fn cuttable_client(
        &self,
        caps: &Capabilities,
        options: LockOptions,
    ) -> Option<(Client, Faulty, Arc<dyn LivenessSwitch>)> {
        if !caps.expiring_leases {
            self.skip(caps, Skip::NotClaimed("grants that expire"));
            return None;
        }
        let Some(cuttable) = self.deployment.connect_cuttable().await else {
            self.skip(
                caps,
                Skip::NotTestable("the deployment offers no way to cut a client's liveness"),
            );
            return None;
        };
        let faults = Faulty::wrap(cuttable.backend);
        let client = client_on(Arc::new(faults.clone()), options);
        Some((client, faults, cuttable.switch))
    }
}

/// A client on `backend`.
/// On a backend whose grants live by a session, the options' lease length is left to the
/// session (a lock may not ask for another).
fn client_on(backend: Arc<dyn Backend>, options: LockOptions) -> Client {
    let options = if backend.capabilities().has_sessions() {
        options
            .to_builder()
            .default_ttl()
            .build()
            .expect("valid options")
    } else {
        options
    };
    Client::builder_from_arc(backend).options(options).build()
}

/// Options with a lease of `ttl` and 2 s request timeouts.
fn options(ttl: Duration) -> LockOptions {
    lease(ttl).build().expect("valid options")
}

/// A builder with a lease of `ttl` and 2 s request timeouts.
fn lease(ttl: Duration) -> leasehold_core::LockOptionsBuilder {
    LockOptions::builder()
        .ttl(ttl)
        .request_timeout(Duration::from_secs(2))
}

/// The lease length that really applies to a grant asked for with `ttl`.
/// The session's on a session backend, `ttl` rounded up to the backend's granularity
/// elsewhere.
fn effective_ttl(caps: &Capabilities, ttl: Duration) -> Duration {
    caps.session_ttl.unwrap_or(ttl.max(caps.ttl_granularity))
}

fn request(name: &str, owner: &leasehold_core::OwnerId, mode: Mode) -> Request {
    Request::new(
        LockName::new(name).expect("valid name"),
        owner.clone(),
        mode,
        Duration::from_secs(5),
    )
}

/// `try_lock` of a mutex `name` by `client`, which must not fail.
async fn try_lock(client: &Client, name: &str) -> Option<leasehold_core::Guard> {
    client.mutex(name).unwrap().try_lock().await.unwrap()
}

/// Waits (on the backend's wake-ups) until the server shows a holder of `name`.
async fn until_held(client: &Client, name: &str) {
    loop {
        let state = client.inspect(name).await.unwrap();
        if !state.holders.is_empty() {
            return;
        }
        let name = LockName::new(name).unwrap();
        let max = Duration::from_secs(1);
        client
            .backend()
            .wait(&name, &state.hint, max)
            .await
            .unwrap();
    }
}

async fn holders(client: &Client, name: &str) -> Vec<String> {
    let state = client.inspect(name).await.expect("inspect");
    state.holders.iter().map(|h| h.owner.to_string()).collect()
}

/// Many clients increment a counter under the lock, each write through a fence.
/// The count is exact, nobody is ever inside together, and the tokens the resource accepted
/// strictly increase.
async fn exclusive_under_contention_with_a_fenced_counter(case: &Case<'_>) {
    const CLIENTS: usize = 4;
    const ROUNDS: u64 = 20;
    let fence = Arc::new(Fence::new());
    let counter = Arc::new(AtomicU64::new(0));
    let inside = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let mutex = case.client().await.mutex(case.name).expect("name");
        let (fence, counter, inside) = (fence.clone(), counter.clone(), inside.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let guard = mutex.lock().await.expect("lock");
                assert!(!inside.swap(true, Ordering::SeqCst), "two holders at once");
                let seen = counter.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                fence
                    .apply(guard.token(), || counter.store(seen + 1, Ordering::SeqCst))
                    .expect("a current holder's write was fenced out");
                inside.store(false, Ordering::SeqCst);
                guard.release().await.expect("release");
            }
        }));
    }
    for task in tasks {
        task.await.expect("client task");
    }
    assert_eq!(counter.load(Ordering::SeqCst), CLIENTS as u64 * ROUNDS);
    let accepted = fence.accepted();
    assert_eq!(accepted.len(), CLIENTS * ROUNDS as usize);
    assert!(
        accepted.windows(2).all(|w| w[0] < w[1]),
        "tokens did not strictly increase: {accepted:?}"
    );
    assert_eq!(fence.rejected(), 0);
}

/// `try_lock` on a held lock is `Ok(None)`.
/// That holds for another client and for another acquisition in the same client.
async fn try_lock_is_none_while_held(case: &Case<'_>) {
    let a = case.client().await;
    let b = case.client().await;
    let guard = a.mutex(case.name).unwrap().lock().await.unwrap();
    assert!(try_lock(&b, case.name).await.is_none());
    assert!(try_lock(&a, case.name).await.is_none());
    guard.release().await.unwrap();
    assert!(try_lock(&b, case.name).await.is_some());
}

/// A wait that runs out is `Ok(None)`, leaves no queue entry, and the holder keeps its lock.
async fn a_wait_timeout_gives_none_and_leaves_nothing(case: &Case<'_>) {
    let a = case.client().await;
    let b = case.client().await;
    let guard = a.mutex(case.name).unwrap().lock().await.unwrap();
    let waited = b
        .mutex(case.name)
        .unwrap()
        .lock_timeout(Duration::from_millis(300))
        .await
        .unwrap();
    assert!(waited.is_none());
    let state = b.inspect(case.name).await.unwrap();
    assert!(state.waiters.is_empty(), "left behind: {:?}", state.waiters);
    assert_eq!(
        holders(&b, case.name).await,
        vec![guard.owner().to_string()]
    );
    guard.release().await.unwrap();
    assert!(try_lock(&b, case.name).await.is_some());
}

/// Cancelling a waiting `lock()` removes its queue entry.
/// Nobody is left waiting, and the next request after a release is not stuck behind a
/// ghost.
async fn a_cancelled_waiter_leaves_nothing_behind(case: &Case<'_>) {
    let a = case.client().await;
    let (b, faults) = case.faulty_client(options(Duration::from_secs(5))).await;
    let c = case.client().await;
    let caps = a.capabilities().clone();
    let guard = a.mutex(case.name).unwrap().lock().await.unwrap();
    let mutex = b.mutex(case.name).unwrap();
    let waiter = tokio::spawn(async move { mutex.lock().await });
    faults.until_calls(Op::Wait, 1).await;
    if caps.fair {
        assert_eq!(c.inspect(case.name).await.unwrap().waiters.len(), 1);
    }
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    b.settle().await;
    let state = c.inspect(case.name).await.unwrap();
    assert!(state.waiters.is_empty(), "left behind: {:?}", state.waiters);
    guard.release().await.unwrap();
    assert!(try_lock(&c, case.name).await.is_some());
}

/// A `try_lock` dropped while its request was on the server leaves no grant behind.
/// The grant was applied and the reply not yet read: it is released by owner in the
/// background.
async fn a_cancelled_try_lock_leaves_nothing_behind(case: &Case<'_>) {
    let (a, faults) = case.faulty_client(options(Duration::from_secs(30))).await;
    let b = case.client().await;
    faults.hold_replies(Op::Acquire);
    let mutex = a.mutex(case.name).unwrap();
    let attempt = tokio::spawn(async move { mutex.try_lock().await });
    // The request is applied on the server; its reply is held.
    until_held(&b, case.name).await;
    attempt.abort();
    assert!(attempt.await.unwrap_err().is_cancelled());
    faults.resume(Op::Acquire);
    a.settle().await;
    let state = b.inspect(case.name).await.unwrap();
    assert!(state.holders.is_empty(), "left behind: {:?}", state.holders);
    assert!(try_lock(&b, case.name).await.is_some());
}

/// A release whose future is dropped before the server answered still frees the lock.
/// Dropped by a `select!`, a timeout or an aborted task: what was not confirmed released is
/// released in the background, and another client gets the lock long before the lease would
/// run out.
async fn a_cancelled_release_still_frees_the_lock(case: &Case<'_>) {
    let (a, faults) = case.faulty_client(options(Duration::from_secs(30))).await;
    let b = case.client().await;
    let guard = a.mutex(case.name).unwrap().lock().await.unwrap();
    faults.hold_requests(Op::Release);
    let release = tokio::spawn(guard.release());
    faults.until_calls(Op::Release, 1).await;
    release.abort();
    assert!(release.await.unwrap_err().is_cancelled());
    faults.resume(Op::Release);
    a.settle().await;
    let state = b.inspect(case.name).await.unwrap();
    assert!(state.holders.is_empty(), "left behind: {:?}", state.holders);
    assert!(try_lock(&b, case.name).await.is_some());
}

/// A release the server never receives is retried until the grant's lease has surely ended.
/// It is retried in the background, and a backend whose grants live by a session does not
/// keep an unreleased grant alive under it: once the background release gave up, the lock
/// is free.
async fn an_unconfirmed_release_does_not_outlive_its_lease(case: &Case<'_>) {
    let probe = case.client().await;
    let caps = probe.capabilities().clone();
    if !caps.expiring_leases && case.skip(&caps, Skip::NotClaimed("grants that expire")) {
        return;
    }
    let (a, faults) = case.faulty_client(options(Duration::from_secs(1))).await;
    let guard = a.mutex(case.name).unwrap().lock().await.unwrap();
    faults.hold_requests(Op::Release);
    let released = guard.release().await;
    assert!(
        matches!(released, Err(ref e) if e.is_unknown_outcome()),
        "{released:?}"
    );
    a.settle().await;
    assert!(
        try_lock(&probe, case.name).await.is_some(),
        "the unreleased grant outlived the background release"
    );
    faults.resume(Op::Release);
}

/// A release by an owner that no longer holds the lock deletes nothing of the next holder's.
/// That is a retried or duplicated release.
async fn a_stale_release_deletes_nothing(case: &Case<'_>) {
    let a = case.client().await;
    let b = case.client().await;
    let first = a.mutex(case.name).unwrap().lock().await.unwrap();
    let stale_owner = first.owner().clone();
    first.release().await.unwrap();
    let second = b.mutex(case.name).unwrap().lock().await.unwrap();
    let stale = request(case.name, &stale_owner, Mode::Exclusive);
    assert_eq!(a.backend().release(&stale).await.unwrap(), Release::NotHeld);
    assert_eq!(
        holders(&a, case.name).await,
        vec![second.owner().to_string()]
    );
    assert!(try_lock(&a, case.name).await.is_none());
    second.release().await.unwrap();
}

/// A holder whose liveness was cut cannot release the new holder's lock.
/// Its lock went to another: its release reports the loss and changes nothing.
async fn a_stale_guard_cannot_release_the_next_holders_lock(case: &Case<'_>) {
    let probe = case.client().await;
    let caps = probe.capabilities().clone();
    let Some((a, _, switch)) = case
        .cuttable_client(&caps, options(Duration::from_secs(1)))
        .await
    else {
        return;
    };
    let b = case.client().await;
    let stale = a.mutex(case.name).unwrap().lock().await.unwrap();
    switch.cut().await;
    stale.lost().await;
    let next = b
        .mutex(case.name)
        .unwrap()
        .lock_timeout(Duration::from_secs(20))
        .await
        .unwrap()
        .expect("granted after the stale lease expired");
    assert!(next.token() > stale.token());
    assert!(matches!(stale.release().await, Err(Error::Lost(_))));
    assert_eq!(holders(&b, case.name).await, vec![next.owner().to_string()]);
    assert!(try_lock(&probe, case.name).await.is_none());
    switch.restore().await;
    // The stale guard's release, retried once its client is back, still changes nothing.
    a.settle().await;
    assert_eq!(holders(&b, case.name).await, vec![next.owner().to_string()]);
    next.release().await.unwrap();
}

/// With its liveness cut, the holder's loss signal fires while the server still holds the lock.
/// The holder stops trusting its lock before anyone else can get it.
async fn loss_is_signalled_before_the_server_expires_the_lock(case: &Case<'_>) {
    let probe = case.client().await;
    let caps = probe.capabilities().clone();
    // A 2 s lease with a 600 ms margin: the holder gives up at 1.38 s after sending, the
    // server expires it no earlier than 2 s after. (A session backend's margin is its own.)
    let options = lease(Duration::from_secs(2).max(caps.ttl_granularity))
        .drift_margin(Duration::from_millis(600))
        .build()
        .unwrap();
    let Some((a, _, switch)) = case.cuttable_client(&caps, options).await else {
        return;
    };
    let guard = a.mutex(case.name).unwrap().lock().await.unwrap();
    switch.cut().await;
    guard.lost().await;
    assert!(!guard.is_held());
    assert!(
        try_lock(&probe, case.name).await.is_none(),
        "the server had already given up the lock when the holder noticed"
    );
    let next = probe
        .mutex(case.name)
        .unwrap()
        .lock_timeout(Duration::from_secs(20))
        .await
        .unwrap();
    assert!(next.is_some(), "the server never expired the lock");
    switch.restore().await;
}

/// The names `<case>-a`, `<case>-b`, … of a case's multi-lock parts.
fn parts_of(case: &Case<'_>, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("{}-{}", case.name, char::from(b'a' + i as u8)))
        .collect()
}

/// A multi-lock of the mutexes `names` of `client`, given in that order.
fn multi_of(client: &Client, names: &[String]) -> MultiLock {
    let parts = names.iter().map(|n| Part::from(client.mutex(n).unwrap()));
    client.multi(parts).unwrap()
}

/// Nobody holds or waits for any of `names`.
async fn all_free(client: &Client, names: &[String]) {
    for name in names {
        let state = client.inspect(name).await.unwrap();
        assert!(
            state.holders.is_empty() && state.waiters.is_empty(),
            "{name}: left behind: {state:?}"
        );
    }
}

/// A multi-lock takes every part or none.
/// With one part held elsewhere, `try_lock` takes nothing (the others stay free); once it
/// is free, `lock` takes all, each part with its own token, and the release frees all.
async fn a_multi_lock_takes_all_or_none(case: &Case<'_>) {
    let a = case.client().await;
    let b = case.client().await;
    let names = parts_of(case, 3);
    let set = multi_of(&b, &[names[2].clone(), names[0].clone(), names[1].clone()]);
    let held = a.mutex(&names[1]).unwrap().lock().await.unwrap();
    assert!(set.try_lock().await.unwrap().is_none());
    assert!(
        set.lock_timeout(Duration::from_millis(300))
            .await
            .unwrap()
            .is_none()
    );
    b.settle().await;
    all_free(&a, &[names[0].clone(), names[2].clone()]).await;
    held.release().await.unwrap();
    let guards = set.lock().await.unwrap();
    assert!(guards.is_held());
    let taken: Vec<&str> = guards.guards().iter().map(|g| g.name().as_str()).collect();
    assert_eq!(taken, names, "not taken in the canonical order");
    for name in &names {
        assert!(guards.token(name).is_some(), "{name} has no token");
        assert!(try_lock(&a, name).await.is_none(), "{name} was not held");
    }
    guards.release().await.unwrap();
    all_free(&a, &names).await;
}

/// Two clients taking overlapping sets given in opposite orders both make progress.
/// Each takes its set repeatedly; neither ever waits for the other in a circle, and they
/// never hold a shared name at once.
async fn multi_locks_in_opposite_orders_never_deadlock(case: &Case<'_>) {
    let names = parts_of(case, 3);
    let reversed: Vec<String> = names.iter().rev().cloned().collect();
    let inside = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for order in [names.clone(), reversed] {
        let client = case.client().await;
        let inside = inside.clone();
        tasks.push(tokio::spawn(async move {
            let set = multi_of(&client, &order);
            for _ in 0..5 {
                let guards = set
                    .lock_timeout(Duration::from_secs(30))
                    .await
                    .unwrap()
                    .expect("the sets waited for each other: a deadlock");
                assert!(
                    !inside.swap(true, Ordering::SeqCst),
                    "both sets held at once"
                );
                tokio::task::yield_now().await;
                inside.store(false, Ordering::SeqCst);
                guards.release().await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    all_free(&case.client().await, &names).await;
}

/// A multi-lock dropped while it waits for its last part leaves nothing behind.
/// The parts it had taken are released, and its wait for the last one is given up.
async fn a_cancelled_multi_lock_leaves_nothing_behind(case: &Case<'_>) {
    let a = case.client().await;
    let (b, faults) = case.faulty_client(options(Duration::from_secs(5))).await;
    let names = parts_of(case, 3);
    let held = a.mutex(&names[2]).unwrap().lock().await.unwrap();
    let set = multi_of(&b, &names);
    let waiting = tokio::spawn(async move { set.lock().await });
    // It waits for the last part once it has the first two.
    faults.until_calls(Op::Wait, 1).await;
    assert!(try_lock(&a, &names[0]).await.is_none());
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    b.settle().await;
    all_free(&a, &names[..2]).await;
    let state = a.inspect(&names[2]).await.unwrap();
    assert!(state.waiters.is_empty(), "left behind: {:?}", state.waiters);
    assert_eq!(state.holders.len(), 1);
    held.release().await.unwrap();
    let again = multi_of(&a, &names).try_lock().await.unwrap();
    assert!(again.is_some(), "a part was left held");
}

/// A set is lost when any part is: `lost` names it, and `is_held` is false from then on.
async fn a_multi_lock_is_lost_with_any_of_its_parts(case: &Case<'_>) {
    let probe = case.client().await;
    let caps = probe.capabilities().clone();
    let Some((a, _, switch)) = case
        .cuttable_client(&caps, options(Duration::from_secs(1)))
        .await
    else {
        return;
    };
    let names = parts_of(case, 2);
    let guards = multi_of(&a, &names).lock().await.unwrap();
    let lost = guards.lost();
    switch.cut().await;
    let (name, _) = lost.await;
    assert!(names.contains(&name.as_str().to_owned()), "{name}");
    assert!(!guards.is_held());
    let ran = guards.run(std::future::pending::<()>()).await;
    assert!(matches!(ran, Err(Error::Lost(_))), "{ran:?}");
    switch.restore().await;
}

/// Work run under a guard is cancelled when the lease is lost.
async fn a_scoped_run_is_cancelled_on_loss(case: &Case<'_>) {
    let probe = case.client().await;
    let caps = probe.capabilities().clone();
    let Some((a, _, switch)) = case
        .cuttable_client(&caps, options(Duration::from_secs(1)))
        .await
    else {
        return;
    };
    let guard = a.mutex(case.name).unwrap().lock().await.unwrap();
    switch.cut().await;
    let ran = guard.run(std::future::pending::<()>()).await;
    assert!(matches!(ran, Err(Error::Lost(_))), "{ran:?}");
    switch.restore().await;
}

/// Dropping a guard releases the lock (in the background; `settle` waits for it).
async fn a_dropped_guard_frees_the_lock(case: &Case<'_>) {
    let a = case.client().await;
    let b = case.client().await;
    let guard = a.mutex(case.name).unwrap().lock().await.unwrap();
    drop(guard);
    a.settle().await;
    assert!(try_lock(&b, case.name).await.is_some());
}

/// Grants that follow each other get strictly increasing tokens, across clients and modes.
async fn tokens_strictly_increase_in_grant_order(case: &Case<'_>) {
    let clients = [case.client().await, case.client().await];
    let caps = clients[0].capabilities().clone();
    let mut last: Option<FencingToken> = None;
    for round in 0..12 {
        let c = &clients[round % 2];
        let guard = match round % 3 {
            1 if caps.shared => c.rwlock(case.name).unwrap().read().await.unwrap(),
            2 if caps.permits => c.semaphore(case.name, 2).unwrap().acquire().await.unwrap(),
            _ => c.mutex(case.name).unwrap().lock().await.unwrap(),
        };
        assert!(
            Some(guard.token()) > last,
            "token {} after {last:?}",
            guard.token()
        );
        last = Some(guard.token());
        guard.release().await.unwrap();
    }
}

/// On a fair backend, waiters get the lock in the order they started waiting.
async fn waiters_are_served_in_arrival_order(case: &Case<'_>) {
    const WAITERS: usize = 8;
    let holder = case.client().await;
    let caps = holder.capabilities().clone();
    if !caps.fair && case.skip(&caps, Skip::NotClaimed("a FIFO queue")) {
        return;
    }
    let guard = holder.mutex(case.name).unwrap().lock().await.unwrap();
    let order = Arc::new(StdMutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..WAITERS {
        let (c, faults) = case.faulty_client(options(Duration::from_secs(5))).await;
        let (order, mutex) = (order.clone(), c.mutex(case.name).unwrap());
        tasks.push(tokio::spawn(async move {
            let guard = mutex.lock().await.unwrap();
            order.lock().unwrap().push(i);
            guard.release().await.unwrap();
        }));
        // Queued before the next one starts.
        faults.until_calls(Op::Wait, 1).await;
    }
    guard.release().await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), (0..WAITERS).collect::<Vec<_>>());
}

/// However many compete, never more than N permits are held at once.
async fn a_semaphore_never_exceeds_its_permits(case: &Case<'_>) {
    const PERMITS: u32 = 3;
    let probe = case.client().await;
    let caps = probe.capabilities().clone();
    if !caps.permits && case.skip(&caps, Skip::NotClaimed("semaphore permits")) {
        return;
    }
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let semaphore = case.client().await.semaphore(case.name, PERMITS).unwrap();
        let (inside, most) = (inside.clone(), most.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..8 {
                let permit = semaphore.acquire().await.unwrap();
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::task::yield_now().await;
                inside.fetch_sub(1, Ordering::SeqCst);
                permit.release().await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert!(most.load(Ordering::SeqCst) <= PERMITS as usize);
    // With all permits out, one more is refused.
    let semaphore = probe.semaphore(case.name, PERMITS).unwrap();
    let mut held = Vec::new();
    for _ in 0..PERMITS {
        held.push(
            semaphore
                .try_acquire()
                .await
                .unwrap()
                .expect("a free permit"),
        );
    }
    assert!(semaphore.try_acquire().await.unwrap().is_none());
    let tokens: Vec<_> = held.iter().map(|p| p.token()).collect();
    assert!(tokens.windows(2).all(|w| w[0] < w[1]));
}

/// Permits of different limits on one name.
/// Each request counts with its own limit, and on a fair backend none overtakes a request
/// queued before it, so grants and their tokens follow the queue (the contract's rule,
/// `leasehold_core::support::queue`).
async fn permits_of_mixed_limits_are_granted_in_queue_order(case: &Case<'_>) {
    let holder = case.client().await;
    let caps = holder.capabilities().clone();
    if !caps.permits && case.skip(&caps, Skip::NotClaimed("semaphore permits")) {
        return;
    }
    let first = holder
        .semaphore(case.name, 2)
        .unwrap()
        .acquire()
        .await
        .unwrap();
    // A limit of 1 does not fit beside a held permit, whatever the holder's limit.
    let one = case.client().await.semaphore(case.name, 1).unwrap();
    assert!(one.try_acquire().await.unwrap().is_none());
    if !caps.fair {
        // No queue to respect: a larger limit fits beside the holder.
        let three = case.client().await.semaphore(case.name, 3).unwrap();
        let second = three
            .try_acquire()
            .await
            .unwrap()
            .expect("a permit of 3 fits");
        assert!(second.token() > first.token());
        second.release().await.unwrap();
        first.release().await.unwrap();
        return;
    }
    let (client, faults) = case.faulty_client(options(Duration::from_secs(5))).await;
    let one = client.semaphore(case.name, 1).unwrap();
    let waiting_one = tokio::spawn(async move { one.acquire().await.unwrap() });
    faults.until_calls(Op::Wait, 1).await;
    // A limit of 3 would fit beside the holder, but the limit-1 request queued first.
    let (client, faults) = case.faulty_client(options(Duration::from_secs(5))).await;
    let three = client.semaphore(case.name, 3).unwrap();
    assert!(
        three.try_acquire().await.unwrap().is_none(),
        "a permit of limit 3 overtook a waiting permit of limit 1"
    );
    let waiting_three = tokio::spawn(async move { three.acquire().await.unwrap() });
    faults.until_calls(Op::Wait, 1).await;
    let first_token = first.token();
    first.release().await.unwrap();
    // Granted in either order (the limit-3 one only if the limit-1 one still fits after
    // it): a grant that pushed the limit-1 request out of its place would keep it waiting
    // for the limit-3 permit's release, which never comes. Waiters ask again every third
    // of their 5 s lease: three leases are plenty.
    let both = async { (waiting_one.await.unwrap(), waiting_three.await.unwrap()) };
    let (one, three) = tokio::time::timeout(Duration::from_secs(15), both)
        .await
        .expect("a permit granted out of turn keeps a waiter before it out");
    assert!(
        first_token < one.token() && one.token() < three.token(),
        "tokens {first_token}, {}, {} do not follow the queue",
        one.token(),
        three.token()
    );
    one.release().await.unwrap();
    three.release().await.unwrap();
}

/// Readers share; a writer excludes readers and writers.
/// A reader arriving while a writer waits queues behind it.
async fn read_write_semantics_and_no_writer_starvation(case: &Case<'_>) {
    let a = case.client().await;
    let caps = a.capabilities().clone();
    if !caps.shared && case.skip(&caps, Skip::NotClaimed("shared (read) mode")) {
        return;
    }
    let b = case.client().await;
    let (w, faults) = case.faulty_client(options(Duration::from_secs(5))).await;
    let r1 = a.rwlock(case.name).unwrap().read().await.unwrap();
    let r2 = b
        .rwlock(case.name)
        .unwrap()
        .try_read()
        .await
        .unwrap()
        .expect("readers share");
    assert!(
        b.rwlock(case.name)
            .unwrap()
            .try_write()
            .await
            .unwrap()
            .is_none()
    );
    assert!(try_lock(&b, case.name).await.is_none());

    let lock = w.rwlock(case.name).unwrap();
    let writer = tokio::spawn(async move { lock.write().await });
    faults.until_calls(Op::Wait, 1).await;
    assert!(
        b.rwlock(case.name)
            .unwrap()
            .try_read()
            .await
            .unwrap()
            .is_none(),
        "a new reader overtook a waiting writer"
    );
    let read_token = r2.token();
    r1.release().await.unwrap();
    r2.release().await.unwrap();
    let write = writer.await.unwrap().unwrap();
    assert!(write.token() > read_token);
    assert!(
        a.rwlock(case.name)
            .unwrap()
            .try_read()
            .await
            .unwrap()
            .is_none()
    );
    write.release().await.unwrap();
    assert!(
        a.rwlock(case.name)
            .unwrap()
            .try_read()
            .await
            .unwrap()
            .is_some()
    );
}

/// One leader at a time; observers see each change; terms increase.
async fn one_leader_at_a_time_and_observers_see_changes(case: &Case<'_>) {
    let a = case.client().await;
    let (b, faults) = case.faulty_client(options(Duration::from_secs(5))).await;
    let observer_client = case.client().await;
    let election = observer_client.election(case.name).unwrap();
    let mut observer = election.observe();
    assert!(observer.next().await.unwrap().is_none());

    let first = a
        .election(case.name)
        .unwrap()
        .campaign("node-a")
        .await
        .unwrap();
    let seen = observer.next().await.unwrap().expect("a leader");
    assert_eq!(seen.value, b"node-a");
    assert_eq!(seen.term, first.term());

    let candidate = b.election(case.name).unwrap();
    let second = tokio::spawn(async move { candidate.campaign("node-b").await });
    faults.until_calls(Op::Wait, 1).await;
    let leader = election.leader().await.unwrap().expect("a leader");
    assert_eq!(leader.value, b"node-a", "two leaders");

    first.resign().await.unwrap();
    let second = second.await.unwrap().unwrap();
    assert!(second.term() > seen.term);
    // The observer may see the gap between the two leaders; it must arrive at node-b.
    let mut next = observer.next().await.unwrap();
    if next.is_none() {
        next = observer.next().await.unwrap();
    }
    let next = next.expect("the second leader");
    assert_eq!(next.value, b"node-b");
    assert_eq!(next.term, second.term());
    second.resign().await.unwrap();
    assert!(observer.next().await.unwrap().is_none());
}

/// An owner re-entering counts holds; the lock is released on the last one.
async fn reentrant_holds_are_counted(case: &Case<'_>) {
    let a = case.client().await;
    let b = case.client().await;
    let owner = Owner::new();
    let mutex = a.mutex(case.name).unwrap().owned_by(&owner);
    let outer = mutex.lock().await.unwrap();
    let inner = mutex.try_lock().await.unwrap().expect("re-entered");
    assert_eq!(inner.token(), outer.token());
    assert_eq!(outer.hold_count(), 2);
    inner.release().await.unwrap();
    assert!(try_lock(&b, case.name).await.is_none());
    outer.release().await.unwrap();
    assert!(try_lock(&b, case.name).await.is_some());
}

/// inspect shows the holder with its token and mode, and a fair backend's waiters.
async fn inspect_reports_holders_and_waiters(case: &Case<'_>) {
    let a = case.client().await;
    let caps = a.capabilities().clone();
    let guard = a.mutex(case.name).unwrap().lock().await.unwrap();
    let state = a.inspect(case.name).await.unwrap();
    assert_eq!(state.holders.len(), 1);
    let holder = &state.holders[0];
    assert_eq!(&holder.owner, guard.owner());
    assert_eq!(holder.token, guard.token());
    assert_eq!(holder.mode, Mode::Exclusive);
    if caps.expiring_leases {
        let left = holder.remaining.expect("an expiring lease");
        assert!(left > Duration::ZERO);
        // A session backend reports its session's time left, not the lock's ttl.
        if !caps.has_sessions() {
            assert!(left <= Duration::from_secs(5).max(caps.ttl_granularity));
        }
    } else {
        assert_eq!(holder.remaining, None);
    }
    assert!(
        a.inspect(&format!("{}:other", case.name))
            .await
            .unwrap()
            .holders
            .is_empty()
    );
    guard.release().await.unwrap();
    assert!(a.inspect(case.name).await.unwrap().holders.is_empty());
}

/// A holder as a case compares it: owner, token, mode.
type HolderSeen = (leasehold_core::OwnerId, FencingToken, Mode);

/// Listing finds every held or queued lock under a prefix without knowing its name.
/// Holders come with owners, modes and tokens, a fair backend's waiters with theirs; freed
/// names and names outside the prefix are not listed; paged a few names at a time, every
/// lock is listed.
async fn a_listing_finds_held_and_queued_locks_by_prefix(case: &Case<'_>) {
    let started = std::time::Instant::now();
    let a = case.client().await;
    let (b, faults) = case.faulty_client(options(Duration::from_secs(5))).await;
    let caps = a.capabilities().clone();
    let prefix = format!("{}:", case.name);
    let name = |suffix: &str| format!("{prefix}{suffix}");
    let mut expected: Vec<(String, Vec<HolderSeen>)> = Vec::new();
    let mut guards = Vec::new();
    for i in 0..5 {
        let guard = a
            .mutex(&name(&format!("m{i}")))
            .unwrap()
            .lock()
            .await
            .unwrap();
        expected.push((
            guard.name().to_string(),
            vec![(guard.owner().clone(), guard.token(), Mode::Exclusive)],
        ));
        guards.push(guard);
    }
    if caps.shared {
        let rw = a.rwlock(&name("rw")).unwrap();
        let (r1, r2) = (rw.read().await.unwrap(), rw.read().await.unwrap());
        let readers = [&r1, &r2].map(|r| (r.owner().clone(), r.token(), Mode::Shared));
        expected.push((name("rw"), readers.into()));
        guards.extend([r1, r2]);
    }
    if caps.permits {
        let permit = a
            .semaphore(&name("sem"), 3)
            .unwrap()
            .acquire()
            .await
            .unwrap();
        let mode = Mode::Permit {
            limit: std::num::NonZeroU32::new(3).unwrap(),
        };
        expected.push((
            name("sem"),
            vec![(permit.owner().clone(), permit.token(), mode)],
        ));
        guards.push(permit);
    }
    // Freed, and outside the prefix: neither is listed.
    let freed = a.mutex(&name("freed")).unwrap().lock().await.unwrap();
    freed.release().await.unwrap();
    let outside = a
        .mutex(&format!("{}-outside", case.name))
        .unwrap()
        .lock()
        .await
        .unwrap();
    // A waiter on the first name (queued where the backend keeps a queue).
    let mutex = b.mutex(&name("m0")).unwrap();
    let waiter = tokio::spawn(async move { mutex.lock().await });
    faults.until_calls(Op::Wait, 1).await;

    let listed = a.locks(&prefix).await.unwrap();
    let names: Vec<&str> = listed.iter().map(|(n, _)| n.as_str()).collect();
    let mut want: Vec<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
    want.sort_unstable();
    assert_eq!(names, want, "listed names");
    for ((listed_name, state), (name, holders)) in listed.iter().zip({
        let mut sorted = expected.clone();
        sorted.sort_by(|x, y| x.0.cmp(&y.0));
        sorted
    }) {
        assert_eq!(listed_name.as_str(), name);
        let mut got: Vec<_> = state
            .holders
            .iter()
            .map(|h| (h.owner.clone(), h.token, h.mode))
            .collect();
        got.sort_by_key(|h| h.1);
        assert_eq!(got, holders, "holders of {name}");
        for holder in &state.holders {
            if let Some(held) = holder.held {
                // Measured by the server from the grant: never longer than this case ran
                // (a second of slack for a server clock read in whole milliseconds).
                assert!(
                    held <= started.elapsed() + Duration::from_secs(1),
                    "{held:?}"
                );
            }
        }
        if caps.fair && name.ends_with(":m0") {
            assert_eq!(state.waiters.len(), 1, "the queued waiter of {name}");
        }
    }

    // A page at a time: every lock, whatever the page size.
    let backend = case.deployment.connect().await;
    let prefix = leasehold_core::NamePrefix::new(&prefix).unwrap();
    let mut paged = std::collections::BTreeSet::new();
    let mut cursor = None;
    loop {
        let page = backend.list(&prefix, cursor.as_ref(), 2).await.unwrap();
        paged.extend(page.locks.into_iter().map(|(n, _)| n.to_string()));
        match page.next {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    assert_eq!(paged.iter().map(String::as_str).collect::<Vec<_>>(), want);

    waiter.abort();
    let _ = waiter.await;
    for guard in guards {
        guard.release().await.unwrap();
    }
    outside.release().await.unwrap();
    b.settle().await;
    assert!(
        a.locks(prefix.as_str()).await.unwrap().is_empty(),
        "released locks listed"
    );
    assert!(matches!(
        a.locks("bad*prefix").await,
        Err(Error::InvalidArgument { .. })
    ));
}

/// A watch of a prefix sees a lock granted, queued for, handed over and freed.
/// Each as it happens, pushed by the backend's change feed (queued: on fair backends).
/// Leases are a minute long, so nothing but the feed's notices can make it read the lock
/// again in time. The feed names no lock outside its prefix.
async fn a_watch_sees_locks_change_hands_by_push(case: &Case<'_>) {
    let ttl = Duration::from_secs(60);
    let a = case.client_with(options(ttl)).await;
    let (b, faults) = case.faulty_client(options(ttl)).await;
    let caps = a.capabilities().clone();
    let prefix = format!("{}:", case.name);
    let name = format!("{prefix}x");
    let mut watch = match a.watch(&prefix).await {
        Err(Error::Unsupported { .. }) => {
            case.skip(&caps, Skip::NotClaimed("a change feed"));
            return;
        }
        watch => watch.unwrap(),
    };
    let feed_prefix = leasehold_core::NamePrefix::new(&prefix).unwrap();
    let mut feed = a.backend().changes(&feed_prefix).await.unwrap();
    // A lock outside the prefix, taken and freed first: never named.
    let outside = format!("{}-outside", case.name);
    a.mutex(&outside)
        .unwrap()
        .lock()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();

    // Once the watch has shown this lock, it has read the prefix (its first reads list
    // it): the grant after that can only be shown by a notice.
    let other = a
        .mutex(&format!("{prefix}y"))
        .unwrap()
        .lock()
        .await
        .unwrap();
    until_seen(&mut watch, "the first lock", |c| c.name == *other.name()).await;
    let first = a.mutex(&name).unwrap().lock().await.unwrap();
    let seen = until_seen(&mut watch, "the grant", |c| {
        c.name.as_str() == name && tokens(&c.after) == [first.token()]
    })
    .await;
    assert_eq!(seen.after.holders[0].owner, *first.owner());

    let mutex = b.mutex(&name).unwrap();
    let waiter = tokio::spawn(async move { mutex.lock().await });
    faults.until_calls(Op::Wait, 1).await;
    if caps.fair {
        until_seen(&mut watch, "the queued waiter", |c| {
            c.name.as_str() == name && c.after.waiters.len() == 1
        })
        .await;
    }
    first.release().await.unwrap();
    let second = waiter.await.unwrap().unwrap();
    until_seen(&mut watch, "the hand-off", |c| {
        c.name.as_str() == name && tokens(&c.after) == [second.token()]
    })
    .await;
    second.release().await.unwrap();
    until_seen(&mut watch, "the release", |c| {
        c.name.as_str() == name && c.after.holders.is_empty() && c.after.waiters.is_empty()
    })
    .await;
    drop(watch);
    other.release().await.unwrap();

    // The raw feed (a subscription of its own) names the lock too, and nothing outside
    // its prefix first (the lock outside was taken and freed before everything else).
    let named = async {
        loop {
            if let Some(leasehold_core::Change::Lock(lock)) = feed.next().await {
                assert!(
                    feed_prefix.matches(&lock),
                    "the feed of {feed_prefix:?} named {lock}"
                );
                if lock.as_str() == name {
                    return;
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(50), named)
        .await
        .unwrap_or_else(|_| panic!("the feed never named {name}"));
}

fn tokens(state: &leasehold_core::LockState) -> Vec<FencingToken> {
    state.holders.iter().map(|h| h.token).collect()
}

/// The first change `want` accepts, from a watch.
/// A minute without it fails the case (a feed that missed the change leaves the watch
/// waiting for a lease end a minute away).
async fn until_seen(
    watch: &mut leasehold_core::LockWatch,
    what: &str,
    want: impl Fn(&leasehold_core::LockChange) -> bool,
) -> leasehold_core::LockChange {
    let seen = async {
        loop {
            let change = watch.next().await.unwrap();
            if want(&change) {
                return change;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(50), seen)
        .await
        .unwrap_or_else(|_| panic!("the watch never saw {what}"))
}

/// A record beside a lock is written only while the writer's grant holds on the server.
/// It replaces the one under its key, and is seen by the next holder.
async fn a_record_is_written_only_while_the_writers_grant_holds(case: &Case<'_>) {
    let a = case.client().await;
    let b = case.client().await;
    let caps = a.capabilities().clone();
    let key = RecordKey::new("window:1").unwrap();
    let other = RecordKey::new("window:2").unwrap();
    let keep = Duration::from_secs(600);
    let guard = a.mutex(case.name).unwrap().lock().await.unwrap();
    let owner = guard.owner().clone();
    match guard.put_record(&key, b"one", keep).await {
        Err(Error::Unsupported { .. }) => {
            case.skip(&caps, Skip::NotClaimed("records"));
            return;
        }
        written => assert!(written.unwrap(), "the holder's record was refused"),
    }
    let too_long = vec![b'x'; leasehold_core::backend::MAX_RECORD_LEN + 1];
    let refused = guard.put_record(&key, &too_long, keep).await;
    assert!(
        matches!(refused, Err(Error::InvalidArgument { .. })),
        "{refused:?}"
    );
    let name = LockName::new(case.name).unwrap();
    let read = |client: &Client, key: &RecordKey| {
        let (backend, name, key) = (client.backend().clone(), name.clone(), key.clone());
        async move { backend.get_record(&name, &key).await.unwrap() }
    };
    assert_eq!(read(&b, &key).await.as_deref(), Some(&b"one"[..]));
    assert_eq!(read(&b, &other).await, None);
    guard.release().await.unwrap();

    // The next holder sees it, and replaces it.
    let next = b.mutex(case.name).unwrap().lock().await.unwrap();
    assert_eq!(read(&b, &key).await.as_deref(), Some(&b"one"[..]));
    assert!(next.put_record(&key, b"two", keep).await.unwrap());
    // A writer whose grant is gone writes nothing: not over the holder's record, not a
    // new one.
    let stale = Request::new(name.clone(), owner, Mode::Exclusive, Duration::from_secs(5));
    let backend = a.backend();
    assert!(
        !backend
            .put_record(&stale, &key, b"stale", keep)
            .await
            .unwrap()
    );
    assert!(
        !backend
            .put_record(&stale, &other, b"stale", keep)
            .await
            .unwrap()
    );
    assert_eq!(read(&a, &key).await.as_deref(), Some(&b"two"[..]));
    assert_eq!(read(&a, &other).await, None);
    next.release().await.unwrap();
    // Nor once the name is free.
    assert!(
        !backend
            .put_record(&stale, &other, b"stale", keep)
            .await
            .unwrap()
    );
    assert_eq!(read(&a, &other).await, None);
}

/// A grant kept for a while after its holder lets go stays held on the server until then.
/// It is unrenewed (ShedLock's lock-at-least), and then frees the lock for the next holder.
async fn a_kept_grant_outlives_its_holder(case: &Case<'_>) {
    // A long lease, so that the kept grant's shorter end is the keep's doing.
    let a = case.client_with(options(Duration::from_secs(60))).await;
    let b = case.client().await;
    let caps = a.capabilities().clone();
    let hold = Duration::from_secs(3);
    let guard = a.mutex(case.name).unwrap().lock().await.unwrap();
    let (owner, token) = (guard.owner().clone(), guard.token());
    match guard.keep_for(hold).await {
        Err(Error::Unsupported { .. }) => {
            case.skip(
                &caps,
                Skip::NotClaimed("keeping a grant after its holder lets go"),
            );
            // It was released instead.
            assert!(try_lock(&b, case.name).await.is_some());
            return;
        }
        kept => kept.unwrap(),
    }
    a.settle().await;
    let state = b.inspect(case.name).await.unwrap();
    let holder = (state.holders.iter())
        .find(|h| h.owner == owner)
        .expect("the kept grant is still held");
    assert!(
        holder.kept,
        "inspect does not say the grant is kept: {holder:?}"
    );
    if let Some(left) = holder.remaining {
        assert!(
            left <= hold + caps.ttl_granularity,
            "{left:?} left of a grant kept for {hold:?}"
        );
    }
    let next = b.mutex(case.name).unwrap().lock().await.unwrap();
    assert!(next.token() > token);
    next.release().await.unwrap();
}

/// A job runs at most once per window.
/// A finished run closes its window for every later claim; a run that lost its lock
/// cannot close it, and the next holder runs with a higher token; a failed run closes it
/// unless failures are retried.
async fn a_job_runs_once_per_window_and_a_lost_run_leaves_it_open(case: &Case<'_>) {
    let a = case.client().await;
    let b = case.client().await;
    let caps = a.capabilities().clone();
    let (job_a, job_b) = (a.job(case.name).unwrap(), b.job(case.name).unwrap());
    let job_a = job_a.run_by("a@host");
    let first = Window::named("first").unwrap();
    let run = match job_a.try_claim(&first).await {
        Err(Error::Unsupported { .. }) => {
            case.skip(&caps, Skip::NotClaimed("records"));
            return;
        }
        claimed => match claimed.unwrap() {
            Claim::Run(run) => run,
            other => panic!("a fresh window was {other:?}"),
        },
    };
    assert!(matches!(
        job_b.try_claim(&first).await.unwrap(),
        Claim::Busy
    ));
    let token = run.guard().token();
    let done = run.finish(Outcome::Succeeded).await.unwrap();
    assert_eq!((done.token, done.by.as_str()), (token, "a@host"));
    match job_b.claim(&first).await.unwrap() {
        Claim::Done(seen) => assert_eq!(seen, done),
        other => panic!("a closed window was {other:?}"),
    }

    // A run whose grant is gone on the server cannot close its window.
    let second = Window::named("second").unwrap();
    let Claim::Run(lost) = job_a.try_claim(&second).await.unwrap() else {
        panic!("a fresh window was not claimed");
    };
    let name = LockName::new(case.name).unwrap();
    let grant = Request::new(
        name,
        lost.guard().owner().clone(),
        Mode::Exclusive,
        Duration::from_secs(5),
    );
    a.backend().release(&grant).await.unwrap();
    let lost_token = lost.guard().token();
    let refused = lost.finish(Outcome::Succeeded).await;
    assert!(matches!(refused, Err(Error::Lost(_))), "{refused:?}");
    let Claim::Run(retry) = job_b.claim(&second).await.unwrap() else {
        panic!("a window whose run lost its lock was closed");
    };
    assert!(retry.guard().token() > lost_token);
    retry.finish(Outcome::Failed(Some(3))).await.unwrap();

    // A failed run closes its window, unless failures are retried.
    match job_a.try_claim(&second).await.unwrap() {
        Claim::Done(failed) => assert_eq!(failed.outcome, Outcome::Failed(Some(3))),
        other => panic!("a failed window was {other:?}"),
    }
    let Claim::Run(again) = job_a.retry_failed(true).try_claim(&second).await.unwrap() else {
        panic!("a failed window was not retried");
    };
    again.finish(Outcome::Succeeded).await.unwrap();
    let Claim::Done(last) = job_b.retry_failed(true).try_claim(&second).await.unwrap() else {
        panic!("a window that succeeded on retry was open");
    };
    assert_eq!(last.outcome, Outcome::Succeeded);
}

/// A force release evicts the holder, records who and why, and fences the holder out.
/// The evicted guard's writes through a fence moved past its token are refused at once;
/// the guard learns of the eviction (at its next renewal, or pushed where grants live by a
/// session) before anyone else holds the lock, and the next grant's token is greater.
async fn a_force_release_evicts_the_holder_and_fences_it_out(case: &Case<'_>) {
    let a = case.client().await;
    let operator = case.client().await;
    let caps = a.capabilities().clone();
    let fence = Fence::new();
    let guard = a.mutex(case.name).unwrap().lock().await.unwrap();
    assert!(fence.apply(guard.token(), || ()).is_ok());
    // A reason that would garble the record is refused before anything is sent.
    let garbled = operator
        .evict(case.name, None, "ops@host", "stuck\u{1b}[2J")
        .await;
    assert!(
        matches!(garbled, Err(Error::InvalidArgument { .. })),
        "{garbled:?}"
    );
    let evicted = match operator
        .evict(case.name, None, "ops@host", "stuck job")
        .await
    {
        Err(Error::Unsupported { .. }) => {
            case.skip(&caps, Skip::NotClaimed("force-release"));
            guard.release().await.unwrap();
            return;
        }
        evicted => evicted.unwrap(),
    };
    assert_eq!(evicted.len(), 1, "{evicted:?}");
    assert_eq!(&evicted[0].owner, guard.owner());
    assert_eq!(evicted[0].token, guard.token());
    // The operator moves the fence: the evicted holder's writes are refused from now on.
    fence.exclude(evicted[0].token);
    assert!(fence.apply(guard.token(), || ()).is_err());

    let state = operator.inspect(case.name).await.unwrap();
    assert!(state.holders.is_empty(), "{:?}", state.holders);
    let record = state.evictions.first().expect("the eviction is recorded");
    assert_eq!(
        (
            record.by.as_str(),
            record.reason.as_str(),
            &record.owner,
            record.token
        ),
        ("ops@host", "stuck job", guard.owner(), guard.token())
    );
    // Closed while the evicted holder may still think it holds: held before the try, the
    // guard was held all through it (a lost guard is never held again).
    let held = guard.is_held();
    let tried = try_lock(&operator, case.name).await;
    assert!(
        !held || tried.is_none(),
        "granted again while the evicted guard was held"
    );
    drop(tried);

    // Told at its next renewal, or pushed where grants live by a session.
    let reason = guard.lost().await;
    if caps.expiring_leases {
        assert_eq!(reason, LossReason::Evicted);
    }
    let next = operator.mutex(case.name).unwrap().lock().await.unwrap();
    assert!(
        !guard.is_held(),
        "granted again while the evicted guard was held"
    );
    assert!(next.token() > evicted[0].token);
    assert!(fence.apply(next.token(), || ()).is_ok());
    // Evicting a lock whose holder has gone evicts nothing; the evicted guard's release
    // is not an error that hurts anyone.
    let _ = guard.release().await;
    next.release().await.unwrap();
    assert!(
        operator
            .evict(case.name, None, "ops@host", "again")
            .await
            .unwrap()
            .is_empty()
    );
}

/// An eviction names one grant by owner, token and set: an older token spares a newer grant.
/// The grant itself is evicted once, and its holder told.
async fn an_eviction_with_an_old_token_spares_the_newer_grant(case: &Case<'_>) {
    let holder = case.client().await;
    let operator = case.client().await;
    let caps = holder.capabilities().clone();
    let name = LockName::new(case.name).unwrap();
    let first = holder.mutex(case.name).unwrap().lock().await.unwrap();
    let (old_owner, old_token) = (first.owner().clone(), first.token());
    first.release().await.unwrap();
    let newer = holder.mutex(case.name).unwrap().lock().await.unwrap();
    assert!(newer.token() > old_token);
    let evict = |owner: &OwnerId, token: FencingToken, mode: Mode| {
        let eviction = Eviction::new(owner.clone(), token, "ops@host".into(), "stale".into());
        let (operator, name) = (operator.backend().clone(), name.clone());
        async move { operator.evict(&name, mode, &eviction).await }
    };
    // The released grant's owner and token.
    match evict(&old_owner, old_token, Mode::Exclusive).await {
        Err(Error::Unsupported { .. }) => {
            case.skip(&caps, Skip::NotClaimed("force-release"));
            newer.release().await.unwrap();
            return;
        }
        evicted => assert!(!evicted.unwrap(), "a released grant was evicted"),
    }
    // The newer owner with the old token; the newer owner and token in the other set.
    let permit = Mode::Permit {
        limit: NonZeroU32::MIN,
    };
    for (token, mode) in [(old_token, Mode::Exclusive), (newer.token(), permit)] {
        let evicted = evict(newer.owner(), token, mode).await.unwrap();
        assert!(!evicted, "evicted the newer grant as {token} in {mode}");
    }
    assert!(newer.is_held());
    let state = operator.inspect(case.name).await.unwrap();
    assert_eq!(state.holders.len(), 1, "{:?}", state.holders);
    assert!(state.evictions.is_empty(), "{:?}", state.evictions);
    // The newer grant itself is evicted, once.
    assert!(
        evict(newer.owner(), newer.token(), Mode::Exclusive)
            .await
            .unwrap()
    );
    assert!(
        !evict(newer.owner(), newer.token(), Mode::Exclusive)
            .await
            .unwrap()
    );
    let reason = newer.lost().await;
    if caps.expiring_leases {
        assert_eq!(reason, LossReason::Evicted);
    }
    let _ = newer.release().await;
}

/// After a holder's lease expires without a release, the lock stays closed for the lock-delay.
/// A normal release opens it at once.
async fn lock_delay_keeps_an_expired_lock_closed(case: &Case<'_>) {
    let probe = case.client().await;
    let caps = probe.capabilities().clone();
    if !caps.lock_delay && case.skip(&caps, Skip::NotClaimed("lock-delay")) {
        return;
    }
    let delay = Duration::from_secs(1);
    let with_delay = lease(Duration::from_secs(1).max(caps.ttl_granularity))
        .lock_delay(delay)
        .build()
        .unwrap();
    let Some((a, _, switch)) = case.cuttable_client(&caps, with_delay.clone()).await else {
        return;
    };
    let crashed = a.mutex(case.name).unwrap().lock().await.unwrap();
    switch.cut().await;
    // No renewal gets through the cut: the deadline now is the last one.
    let deadline = crashed.deadline().ok().flatten();
    crashed.lost().await;
    // The server frees the lock no earlier than the holder's loss; the delay runs from
    // then on. The loss is dated at the holder's deadline where it has one (on its clock):
    // `lost` may be seen later on a loaded machine.
    let clock = a.clock().clone();
    let seen = clock.now();
    let lost_at = deadline.map_or(seen, |deadline| deadline.min(seen));
    let since_loss = || clock.now().saturating_duration_since(lost_at);
    // Closed after the lease too: every fresh try by a client without a lock-delay (the
    // first attempt of an uncontended acquire, which may take a backend's fast path) is
    // refused, up to half-way through the delay.
    while since_loss() < delay / 2 {
        let attempt = try_lock(&probe, case.name).await;
        assert!(
            attempt.is_none(),
            "a fresh try got in {:?} after the crashed holder's loss; the delay is {delay:?}",
            since_loss(),
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let next = probe
        .mutex(case.name)
        .unwrap()
        .lock_timeout(Duration::from_secs(20))
        .await
        .unwrap()
        .expect("open after the lease and the lock-delay");
    assert!(
        since_loss() >= delay,
        "granted {:?} after the crashed holder's loss; the delay is {delay:?}",
        since_loss(),
    );
    drop(crashed);
    next.release().await.unwrap();
    switch.restore().await;
    // A normal release does not close the lock.
    let c = case.client_with(with_delay).await;
    let released = c.mutex(case.name).unwrap().lock().await.unwrap();
    released.release().await.unwrap();
    assert!(try_lock(&probe, case.name).await.is_some());
}

/// Every kind of grant stays held through several renewals, well past its first lease.
/// Plain, with a lock-delay, with a stored value (a leader), shared, a permit — each keeps
/// its token (and value) unchanged on the server, and nobody else is let in.
async fn renewals_keep_every_kind_of_grant(case: &Case<'_>) {
    let probe = case.client().await;
    let caps = probe.capabilities().clone();
    if !caps.expiring_leases && case.skip(&caps, Skip::NotClaimed("grants that expire")) {
        return;
    }
    let ttl = Duration::from_millis(1200).max(caps.ttl_granularity);
    let plain = options(ttl);
    let mut kinds = vec![("plain", plain.clone())];
    if caps.lock_delay {
        let delayed = plain
            .to_builder()
            .lock_delay(Duration::from_millis(100))
            .build()
            .unwrap();
        kinds.push(("lock-delay", delayed));
    }
    kinds.push(("leader", plain.clone()));
    if caps.shared {
        kinds.push(("reader", plain.clone()));
    }
    if caps.permits {
        kinds.push(("permit", plain.clone()));
    }
    let (probe, caps) = (&probe, &caps);
    let cases = kinds.into_iter().map(|(kind, options)| async move {
        let name = format!("{}:{kind}", case.name);
        let (a, faults) = case.faulty_client(options).await;
        let started = std::time::Instant::now();
        let held = match kind {
            "leader" => Held::Leader(a.election(&name).unwrap().campaign("node-a").await.unwrap()),
            "reader" => Held::Guard(a.rwlock(&name).unwrap().read().await.unwrap()),
            "permit" => Held::Guard(a.semaphore(&name, 1).unwrap().acquire().await.unwrap()),
            _ => Held::Guard(a.mutex(&name).unwrap().lock().await.unwrap()),
        };
        let guard = held.guard();
        let renewed = async {
            if caps.has_sessions() {
                // The session is kept alive for all grants at once: there is no renewal
                // of this grant to count, so hold it well past one session ttl.
                tokio::time::sleep(effective_ttl(caps, ttl) * 3 / 2).await;
            } else {
                // Renewals of one lease run one after another: once the fourth has started,
                // three succeeded, and the first lease ran out long ago.
                faults.until_calls(Op::Renew, 4).await;
            }
        };
        tokio::select! {
            () = renewed => {}
            reason = guard.lost() => panic!("{kind}: lost while renewing: {reason:?}"),
        }
        assert!(started.elapsed() > effective_ttl(caps, ttl), "{kind}");
        assert!(guard.is_held(), "{kind}");
        let state = probe.inspect(&name).await.unwrap();
        let holder = state
            .holders
            .iter()
            .find(|h| &h.owner == guard.owner())
            .unwrap_or_else(|| panic!("{kind}: the server forgot the holder"));
        assert_eq!(holder.token, guard.token(), "{kind}");
        if kind == "leader" {
            assert_eq!(holder.value.as_deref(), Some(&b"node-a"[..]), "{kind}");
        }
        let other = match kind {
            "reader" => probe.rwlock(&name).unwrap().try_write().await.unwrap(),
            "permit" => probe
                .semaphore(&name, 1)
                .unwrap()
                .try_acquire()
                .await
                .unwrap(),
            // A leader holds the exclusive side of its name.
            _ => try_lock(probe, &name).await,
        };
        assert!(other.is_none(), "{kind}: let another in while held");
        match held {
            Held::Guard(guard) => guard.release().await.unwrap(),
            Held::Leader(leadership) => leadership.resign().await.unwrap(),
        }
    });
    futures_util::future::join_all(cases).await;
}

/// A guard, or a leadership (which owns its guard).
enum Held {
    Guard(leasehold_core::Guard),
    Leader(leasehold_core::Leadership),
}

impl Held {
    fn guard(&self) -> &leasehold_core::Guard {
        match self {
            Held::Guard(guard) => guard,
            Held::Leader(leadership) => leadership.guard(),
        }
    }
}

/// Locks of different names do not interact.
async fn names_are_independent(case: &Case<'_>) {
    let a = case.client().await;
    let (x, y) = (format!("{}:x", case.name), format!("{}:y", case.name));
    let held = a.mutex(&x).unwrap().lock().await.unwrap();
    assert!(try_lock(&a, &y).await.is_some());
    assert!(try_lock(&a, &x).await.is_none());
    held.release().await.unwrap();
}

/// Bad names, durations, permits and waits are typed errors, and nothing is sent.
async fn bad_input_is_rejected_with_typed_errors(case: &Case<'_>) {
    let (a, faults) = case.faulty_client(options(Duration::from_secs(5))).await;
    let huge = "n".repeat(1 << 20);
    for name in [
        "",
        " ",
        "a b",
        "a\0b",
        "a/b",
        "{tag}",
        "a*",
        "a#lock",
        "..",
        huge.as_str(),
    ] {
        assert!(
            matches!(
                a.mutex(name),
                Err(Error::InvalidArgument {
                    what: "lock name",
                    ..
                })
            ),
            "{:?} accepted",
            name.get(..20)
        );
    }
    assert!(matches!(
        a.semaphore(case.name, 0),
        Err(Error::InvalidArgument {
            what: "permits",
            ..
        })
    ));
    for bad in [
        LockOptions::builder().ttl(Duration::ZERO).build(),
        LockOptions::builder().ttl(Duration::MAX).build(),
        LockOptions::builder()
            .ttl(Duration::from_secs(1))
            .renew_every(Duration::from_secs(1))
            .build(),
        LockOptions::builder()
            .request_timeout(Duration::ZERO)
            .build(),
    ] {
        assert!(matches!(bad, Err(Error::InvalidArgument { .. })), "{bad:?}");
    }
    assert!(matches!(
        a.mutex(case.name)
            .unwrap()
            .lock_timeout(Duration::MAX)
            .await,
        Err(Error::InvalidArgument { what: "wait", .. })
    ));
    assert!(matches!(
        leasehold_core::parse_duration("10"),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(
        faults.calls(Op::Acquire),
        0,
        "a bad request reached the backend"
    );
}
