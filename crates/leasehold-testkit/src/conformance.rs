//! The conformance suite: one set of behaviour cases every backend must pass.
//!
//! A backend's test file implements [`Deployment`] (how to open another independent
//! connection to the deployment under test) and expands every case into a named test with
//! [`conformance_suite!`](crate::conformance_suite):
//!
//! ```ignore
//! leasehold_testkit::conformance_suite!(async { MyDeployment::start().await });
//! ```
//!
//! Cases read the backend's [`Capabilities`](leasehold_core::Capabilities) and skip, with a
//! message, what it does not claim (shared mode, permits, expiring leases, fairness,
//! lock-delay). Every case asserts behaviour that a broken lock fails.

// These are test bodies: a failed step must fail the test, with the panic's location.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use async_trait::async_trait;
use leasehold_core::backend::{Backend, Mode, Release, Request};
use leasehold_core::faulty::{Faulty, Op};
use leasehold_core::{
    Capabilities, Client, Error, Fence, FencingToken, LockName, LockOptions, Owner,
};

/// A deployment under test: something that hands out independent connections to one lock
/// service (a server, a cluster, a directory).
#[async_trait]
pub trait Deployment: Send + Sync {
    /// A new connection, as a separate client process would open it.
    async fn connect(&self) -> Arc<dyn Backend>;
}

/// Expands every conformance case into a `#[tokio::test]` of the same name. `$setup` is an
/// expression evaluating to a future of a [`Deployment`]; it runs once per test.
#[macro_export]
macro_rules! conformance_suite {
    ($setup:expr) => {
        $crate::conformance_suite!(@cases $setup;
            exclusive_under_contention_with_a_fenced_counter,
            try_lock_is_none_while_held,
            a_wait_timeout_gives_none_and_leaves_nothing,
            a_cancelled_waiter_leaves_nothing_behind,
            a_stale_release_deletes_nothing,
            a_stale_guard_cannot_release_the_next_holders_lock,
            loss_is_signalled_before_the_server_expires_the_lock,
            a_scoped_run_is_cancelled_on_loss,
            a_dropped_guard_frees_the_lock,
            tokens_strictly_increase_in_grant_order,
            waiters_are_served_in_arrival_order,
            a_semaphore_never_exceeds_its_permits,
            read_write_semantics_and_no_writer_starvation,
            one_leader_at_a_time_and_observers_see_changes,
            reentrant_holds_are_counted,
            inspect_reports_holders_and_waiters,
            lock_delay_keeps_an_expired_lock_closed,
            renewals_keep_every_kind_of_grant,
            names_are_independent,
            bad_input_is_rejected_with_typed_errors,
        );
    };
    (@cases $setup:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let deployment = $setup.await;
                $crate::conformance::$case(&deployment).await;
            }
        )*
    };
}

const NAME: &str = "conformance";

fn options(ttl: Duration) -> LockOptions {
    LockOptions::builder()
        .ttl(ttl)
        .request_timeout(Duration::from_secs(2))
        .build()
        .expect("valid options")
}

/// A client with 5 s leases.
async fn client(d: &dyn Deployment) -> Client {
    client_with(d, options(Duration::from_secs(5))).await
}

async fn client_with(d: &dyn Deployment, options: LockOptions) -> Client {
    Client::builder_from_arc(d.connect().await)
        .options(options)
        .build()
}

/// A client whose requests pass through a fault injector.
async fn faulty_client(d: &dyn Deployment, options: LockOptions) -> (Client, Faulty) {
    let faults = Faulty::wrap(d.connect().await);
    let client = Client::builder(faults.clone()).options(options).build();
    (client, faults)
}

/// Whether a case that stops renewals (through [`Faulty`]) can run: the backend's grants
/// must expire and be renewed one by one, not by a session of the backend's own.
fn renewals_can_be_cut(case: &str, caps: &Capabilities) -> bool {
    if !caps.expiring_leases {
        return !skip(case, caps, "grants do not expire");
    }
    if caps.sessions {
        return !skip(
            case,
            caps,
            "renewal belongs to the backend's session; the backend's own tests cut it",
        );
    }
    true
}

fn skip(case: &str, caps: &Capabilities, why: &str) -> bool {
    eprintln!(
        "conformance case {case} skipped on the {} backend: {why}",
        caps.backend
    );
    true
}

fn request(name: &str, owner: &leasehold_core::OwnerId, mode: Mode) -> Request {
    Request {
        name: LockName::new(name).expect("valid name"),
        owner: owner.clone(),
        mode,
        ttl: Duration::from_secs(5),
        fair: false,
        waiting: false,
        lock_delay: None,
        value: None,
    }
}

async fn holders(client: &Client, name: &str) -> Vec<String> {
    let state = client.inspect(name).await.expect("inspect");
    state.holders.iter().map(|h| h.owner.to_string()).collect()
}

/// Many clients increment a counter under the lock, each write through a fence: the count
/// is exact, nobody is ever inside together, and the tokens the resource accepted strictly
/// increase.
pub async fn exclusive_under_contention_with_a_fenced_counter(d: &dyn Deployment) {
    const CLIENTS: usize = 4;
    const ROUNDS: u64 = 20;
    let fence = Arc::new(Fence::new());
    let counter = Arc::new(AtomicU64::new(0));
    let inside = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let mutex = client(d).await.mutex(NAME).expect("name");
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

/// `try_lock` on a held lock is `Ok(None)`, for another client and for another acquisition
/// in the same client.
pub async fn try_lock_is_none_while_held(d: &dyn Deployment) {
    let a = client(d).await;
    let b = client(d).await;
    let guard = a.mutex(NAME).unwrap().lock().await.unwrap();
    assert!(b.mutex(NAME).unwrap().try_lock().await.unwrap().is_none());
    assert!(a.mutex(NAME).unwrap().try_lock().await.unwrap().is_none());
    guard.release().await.unwrap();
    assert!(b.mutex(NAME).unwrap().try_lock().await.unwrap().is_some());
}

/// A wait that runs out is `Ok(None)`, leaves no queue entry, and the holder keeps its lock.
pub async fn a_wait_timeout_gives_none_and_leaves_nothing(d: &dyn Deployment) {
    let a = client(d).await;
    let b = client(d).await;
    let guard = a.mutex(NAME).unwrap().lock().await.unwrap();
    let waited = b
        .mutex(NAME)
        .unwrap()
        .lock_timeout(Duration::from_millis(300))
        .await
        .unwrap();
    assert!(waited.is_none());
    let state = b.inspect(NAME).await.unwrap();
    assert!(state.waiters.is_empty(), "left behind: {:?}", state.waiters);
    assert_eq!(holders(&b, NAME).await, vec![guard.owner().to_string()]);
    guard.release().await.unwrap();
    assert!(b.mutex(NAME).unwrap().try_lock().await.unwrap().is_some());
}

/// Cancelling a waiting `lock()` removes its queue entry: nobody is left waiting, and the
/// next request after a release is not stuck behind a ghost.
pub async fn a_cancelled_waiter_leaves_nothing_behind(d: &dyn Deployment) {
    let a = client(d).await;
    let (b, faults) = faulty_client(d, options(Duration::from_secs(5))).await;
    let c = client(d).await;
    let caps = a.capabilities().clone();
    let guard = a.mutex(NAME).unwrap().lock().await.unwrap();
    let mutex = b.mutex(NAME).unwrap();
    let waiter = tokio::spawn(async move { mutex.lock().await });
    faults.until_calls(Op::Wait, 1).await;
    if caps.fair {
        assert_eq!(c.inspect(NAME).await.unwrap().waiters.len(), 1);
    }
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    b.settle().await;
    let state = c.inspect(NAME).await.unwrap();
    assert!(state.waiters.is_empty(), "left behind: {:?}", state.waiters);
    guard.release().await.unwrap();
    assert!(c.mutex(NAME).unwrap().try_lock().await.unwrap().is_some());
}

/// A release by an owner that no longer holds the lock (a retried or duplicated release)
/// deletes nothing of the next holder's.
pub async fn a_stale_release_deletes_nothing(d: &dyn Deployment) {
    let a = client(d).await;
    let b = client(d).await;
    let first = a.mutex(NAME).unwrap().lock().await.unwrap();
    let stale_owner = first.owner().clone();
    first.release().await.unwrap();
    let second = b.mutex(NAME).unwrap().lock().await.unwrap();
    let stale = request(NAME, &stale_owner, Mode::Exclusive);
    assert_eq!(a.backend().release(&stale).await.unwrap(), Release::NotHeld);
    assert_eq!(holders(&a, NAME).await, vec![second.owner().to_string()]);
    assert!(a.mutex(NAME).unwrap().try_lock().await.unwrap().is_none());
    second.release().await.unwrap();
}

/// A holder whose lease ran out (renewals cut off) and whose lock went to another cannot
/// release the new holder's lock: its release reports the loss and changes nothing.
pub async fn a_stale_guard_cannot_release_the_next_holders_lock(d: &dyn Deployment) {
    let probe = client(d).await;
    let caps = probe.capabilities().clone();
    if !renewals_can_be_cut("a_stale_guard_cannot_release_the_next_holders_lock", &caps) {
        return;
    }
    let (a, faults) = faulty_client(d, options(Duration::from_secs(1))).await;
    let b = client(d).await;
    faults.hold_requests(Op::Renew);
    let stale = a.mutex(NAME).unwrap().lock().await.unwrap();
    stale.lost().await;
    let next = b
        .mutex(NAME)
        .unwrap()
        .lock_timeout(Duration::from_secs(10))
        .await
        .unwrap()
        .expect("granted after the stale lease expired");
    assert!(next.token() > stale.token());
    assert!(matches!(stale.release().await, Err(Error::Lost(_))));
    assert_eq!(holders(&b, NAME).await, vec![next.owner().to_string()]);
    assert!(
        probe
            .mutex(NAME)
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none()
    );
    faults.resume(Op::Renew);
    next.release().await.unwrap();
}

/// With renewals cut off, the holder's loss signal fires while the server still holds the
/// lock: the holder stops trusting its lock before anyone else can get it.
pub async fn loss_is_signalled_before_the_server_expires_the_lock(d: &dyn Deployment) {
    let probe = client(d).await;
    let caps = probe.capabilities().clone();
    if !renewals_can_be_cut(
        "loss_is_signalled_before_the_server_expires_the_lock",
        &caps,
    ) {
        return;
    }
    // A 2 s lease with a 600 ms margin: the holder gives up at 1.38 s after sending, the
    // server expires it no earlier than 2 s after.
    let ttl = Duration::from_secs(2).max(caps.ttl_granularity);
    let options = LockOptions::builder()
        .ttl(ttl)
        .drift_margin(Duration::from_millis(600))
        .request_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let (a, faults) = faulty_client(d, options).await;
    faults.hold_requests(Op::Renew);
    let guard = a.mutex(NAME).unwrap().lock().await.unwrap();
    guard.lost().await;
    assert!(!guard.is_held());
    assert!(
        probe
            .mutex(NAME)
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none(),
        "the server had already given up the lock when the holder noticed"
    );
    let next = probe
        .mutex(NAME)
        .unwrap()
        .lock_timeout(Duration::from_secs(10))
        .await
        .unwrap();
    assert!(next.is_some(), "the server never expired the lock");
    faults.resume(Op::Renew);
}

/// Work run under a guard is cancelled when the lease is lost.
pub async fn a_scoped_run_is_cancelled_on_loss(d: &dyn Deployment) {
    let probe = client(d).await;
    let caps = probe.capabilities().clone();
    if !renewals_can_be_cut("a_scoped_run_is_cancelled_on_loss", &caps) {
        return;
    }
    let (a, faults) = faulty_client(d, options(Duration::from_secs(1))).await;
    faults.hold_requests(Op::Renew);
    let guard = a.mutex(NAME).unwrap().lock().await.unwrap();
    let ran = guard.run(std::future::pending::<()>()).await;
    assert!(matches!(ran, Err(Error::Lost(_))), "{ran:?}");
    faults.resume(Op::Renew);
}

/// Dropping a guard releases the lock (in the background; `settle` waits for it).
pub async fn a_dropped_guard_frees_the_lock(d: &dyn Deployment) {
    let a = client(d).await;
    let b = client(d).await;
    let guard = a.mutex(NAME).unwrap().lock().await.unwrap();
    drop(guard);
    a.settle().await;
    assert!(b.mutex(NAME).unwrap().try_lock().await.unwrap().is_some());
}

/// Grants that follow each other get strictly increasing tokens, across clients and modes.
pub async fn tokens_strictly_increase_in_grant_order(d: &dyn Deployment) {
    let clients = [client(d).await, client(d).await];
    let caps = clients[0].capabilities().clone();
    let mut last: Option<FencingToken> = None;
    for round in 0..12 {
        let c = &clients[round % 2];
        let guard = match round % 3 {
            1 if caps.shared => c.rwlock(NAME).unwrap().read().await.unwrap(),
            2 if caps.permits => c.semaphore(NAME, 2).unwrap().acquire().await.unwrap(),
            _ => c.mutex(NAME).unwrap().lock().await.unwrap(),
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
pub async fn waiters_are_served_in_arrival_order(d: &dyn Deployment) {
    const WAITERS: usize = 8;
    let holder = client(d).await;
    let caps = holder.capabilities().clone();
    if !caps.fair
        && skip(
            "waiters_are_served_in_arrival_order",
            &caps,
            "no FIFO queue",
        )
    {
        return;
    }
    let guard = holder.mutex(NAME).unwrap().lock().await.unwrap();
    let order = Arc::new(StdMutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..WAITERS {
        let (c, faults) = faulty_client(d, options(Duration::from_secs(5))).await;
        let order = order.clone();
        tasks.push(tokio::spawn(async move {
            let guard = c.mutex(NAME).unwrap().lock().await.unwrap();
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
pub async fn a_semaphore_never_exceeds_its_permits(d: &dyn Deployment) {
    const PERMITS: u32 = 3;
    let probe = client(d).await;
    let caps = probe.capabilities().clone();
    if !caps.permits && skip("a_semaphore_never_exceeds_its_permits", &caps, "no permits") {
        return;
    }
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let semaphore = client(d).await.semaphore(NAME, PERMITS).unwrap();
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
    let semaphore = probe.semaphore(NAME, PERMITS).unwrap();
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

/// Readers share; a writer excludes readers and writers; a reader arriving while a writer
/// waits queues behind it.
pub async fn read_write_semantics_and_no_writer_starvation(d: &dyn Deployment) {
    let a = client(d).await;
    let caps = a.capabilities().clone();
    if !caps.shared
        && skip(
            "read_write_semantics_and_no_writer_starvation",
            &caps,
            "no shared mode",
        )
    {
        return;
    }
    let b = client(d).await;
    let (w, faults) = faulty_client(d, options(Duration::from_secs(5))).await;
    let r1 = a.rwlock(NAME).unwrap().read().await.unwrap();
    let r2 = b
        .rwlock(NAME)
        .unwrap()
        .try_read()
        .await
        .unwrap()
        .expect("readers share");
    assert!(b.rwlock(NAME).unwrap().try_write().await.unwrap().is_none());
    assert!(b.mutex(NAME).unwrap().try_lock().await.unwrap().is_none());

    let lock = w.rwlock(NAME).unwrap();
    let writer = tokio::spawn(async move { lock.write().await });
    faults.until_calls(Op::Wait, 1).await;
    assert!(
        b.rwlock(NAME).unwrap().try_read().await.unwrap().is_none(),
        "a new reader overtook a waiting writer"
    );
    let read_token = r2.token();
    r1.release().await.unwrap();
    r2.release().await.unwrap();
    let write = writer.await.unwrap().unwrap();
    assert!(write.token() > read_token);
    assert!(a.rwlock(NAME).unwrap().try_read().await.unwrap().is_none());
    write.release().await.unwrap();
    assert!(a.rwlock(NAME).unwrap().try_read().await.unwrap().is_some());
}

/// One leader at a time; observers see each change; terms increase.
pub async fn one_leader_at_a_time_and_observers_see_changes(d: &dyn Deployment) {
    let a = client(d).await;
    let (b, faults) = faulty_client(d, options(Duration::from_secs(5))).await;
    let observer_client = client(d).await;
    let election = observer_client.election(NAME).unwrap();
    let mut observer = election.observe();
    assert!(observer.next().await.unwrap().is_none());

    let first = a.election(NAME).unwrap().campaign("node-a").await.unwrap();
    let seen = observer.next().await.unwrap().expect("a leader");
    assert_eq!(seen.value, b"node-a");
    assert_eq!(seen.term, first.term());

    let candidate = b.election(NAME).unwrap();
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
pub async fn reentrant_holds_are_counted(d: &dyn Deployment) {
    let a = client(d).await;
    let b = client(d).await;
    let owner = Owner::new();
    let mutex = a.mutex(NAME).unwrap().owned_by(&owner);
    let outer = mutex.lock().await.unwrap();
    let inner = mutex.try_lock().await.unwrap().expect("re-entered");
    assert_eq!(inner.token(), outer.token());
    assert_eq!(outer.hold_count(), 2);
    inner.release().await.unwrap();
    assert!(b.mutex(NAME).unwrap().try_lock().await.unwrap().is_none());
    outer.release().await.unwrap();
    assert!(b.mutex(NAME).unwrap().try_lock().await.unwrap().is_some());
}

/// inspect shows the holder with its token and mode, and a fair backend's waiters.
pub async fn inspect_reports_holders_and_waiters(d: &dyn Deployment) {
    let a = client(d).await;
    let caps = a.capabilities().clone();
    let guard = a.mutex(NAME).unwrap().lock().await.unwrap();
    let state = a.inspect(NAME).await.unwrap();
    assert_eq!(state.holders.len(), 1);
    let holder = &state.holders[0];
    assert_eq!(&holder.owner, guard.owner());
    assert_eq!(holder.token, guard.token());
    assert_eq!(holder.mode, Mode::Exclusive);
    if caps.expiring_leases {
        let left = holder.remaining.expect("an expiring lease");
        assert!(left > Duration::ZERO);
        // A session backend reports its session's time left, not the lock's ttl.
        if !caps.sessions {
            assert!(left <= Duration::from_secs(5).max(caps.ttl_granularity));
        }
    } else {
        assert_eq!(holder.remaining, None);
    }
    assert!(a.inspect("other").await.unwrap().holders.is_empty());
    guard.release().await.unwrap();
    assert!(a.inspect(NAME).await.unwrap().holders.is_empty());
}

/// After a holder's lease expires without a release, the lock stays closed for the
/// lock-delay; a normal release opens it at once.
pub async fn lock_delay_keeps_an_expired_lock_closed(d: &dyn Deployment) {
    let probe = client(d).await;
    let caps = probe.capabilities().clone();
    if !caps.lock_delay
        && skip(
            "lock_delay_keeps_an_expired_lock_closed",
            &caps,
            "no lock-delay",
        )
    {
        return;
    }
    if !renewals_can_be_cut("lock_delay_keeps_an_expired_lock_closed", &caps) {
        return;
    }
    let ttl = Duration::from_secs(1).max(caps.ttl_granularity);
    let delay = Duration::from_secs(1);
    let with_delay = LockOptions::builder()
        .ttl(ttl)
        .lock_delay(delay)
        .request_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let (a, faults) = faulty_client(d, with_delay.clone()).await;
    faults.hold_requests(Op::Renew);
    let started = std::time::Instant::now();
    let crashed = a.mutex(NAME).unwrap().lock().await.unwrap();
    crashed.lost().await;
    // Closed after the lease too: every fresh try by a client without a lock-delay (the
    // first attempt of an uncontended acquire, which may take a backend's fast path) is
    // refused, up to half-way through the delay.
    while started.elapsed() < ttl + delay / 2 {
        let attempt = probe.mutex(NAME).unwrap().try_lock().await.unwrap();
        assert!(
            attempt.is_none() || started.elapsed() >= ttl + delay,
            "a fresh try got in {:?} after the crashed holder's grant; ttl + delay is {:?}",
            started.elapsed(),
            ttl + delay
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let next = probe
        .mutex(NAME)
        .unwrap()
        .lock_timeout(Duration::from_secs(10))
        .await
        .unwrap()
        .expect("open after ttl + lock-delay");
    assert!(
        started.elapsed() >= ttl + delay,
        "granted {:?} after the crashed holder's grant; ttl + delay is {:?}",
        started.elapsed(),
        ttl + delay
    );
    drop(crashed);
    next.release().await.unwrap();
    // A normal release does not close the lock.
    let c = client_with(d, with_delay).await;
    let released = c.mutex(NAME).unwrap().lock().await.unwrap();
    released.release().await.unwrap();
    assert!(
        probe
            .mutex(NAME)
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
    faults.resume(Op::Renew);
}

/// Every kind of grant — plain, with a lock-delay, with a stored value (a leader), shared,
/// a permit — stays held through several renewals, well past its first lease, with its
/// token (and value) unchanged on the server and nobody else let in.
pub async fn renewals_keep_every_kind_of_grant(d: &dyn Deployment) {
    let probe = client(d).await;
    let caps = probe.capabilities().clone();
    if !renewals_can_be_cut("renewals_keep_every_kind_of_grant", &caps) {
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
    let probe = &probe;
    let cases = kinds.into_iter().map(|(kind, options)| async move {
        let name = format!("renewed-{kind}");
        let (a, faults) = faulty_client(d, options).await;
        let started = std::time::Instant::now();
        let held = match kind {
            "leader" => Held::Leader(a.election(&name).unwrap().campaign("node-a").await.unwrap()),
            "reader" => Held::Guard(a.rwlock(&name).unwrap().read().await.unwrap()),
            "permit" => Held::Guard(a.semaphore(&name, 1).unwrap().acquire().await.unwrap()),
            _ => Held::Guard(a.mutex(&name).unwrap().lock().await.unwrap()),
        };
        let guard = held.guard();
        // Renewals of one lease run one after another: once the fourth has started, three
        // succeeded, and the first lease ran out long ago.
        tokio::select! {
            () = faults.until_calls(Op::Renew, 4) => {}
            reason = guard.lost() => panic!("{kind}: lost while renewing: {reason:?}"),
        }
        assert!(started.elapsed() > ttl, "{kind}");
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
            _ => probe.mutex(&name).unwrap().try_lock().await.unwrap(),
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
pub async fn names_are_independent(d: &dyn Deployment) {
    let a = client(d).await;
    let x = a.mutex("x").unwrap().lock().await.unwrap();
    let y = a.mutex("y").unwrap().try_lock().await.unwrap();
    assert!(y.is_some());
    assert!(a.mutex("x").unwrap().try_lock().await.unwrap().is_none());
    x.release().await.unwrap();
}

/// Bad names, durations, permits and waits are typed errors, and nothing is sent.
pub async fn bad_input_is_rejected_with_typed_errors(d: &dyn Deployment) {
    let (a, faults) = faulty_client(d, options(Duration::from_secs(5))).await;
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
        a.semaphore(NAME, 0),
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
        a.mutex(NAME).unwrap().lock_timeout(Duration::MAX).await,
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
