//! The engine, watchdog and deadline rules, on the in-memory backend and a manual clock.
//! Every instant below is exact, and nothing waits on real time except request timeouts.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::time::Duration;

use leasehold_core::backend::{Acquire, Backend, Eviction, Mode, Request};
use leasehold_core::clock::{Clock, ManualClock};
use leasehold_core::memory::InMemory;
use leasehold_core::{Client, Error, Guard, LockName, LockOptions, LossReason, Owner, OwnerId};
use leasehold_testkit::faulty::{Faulty, Op};

const MS: Duration = Duration::from_millis(1);
const SEC: Duration = Duration::from_secs(1);

/// A server and two clients on one manual clock.
/// `client` reaches the server through `faults`; `other` reaches it directly.
struct Rig {
    clock: ManualClock,
    server: InMemory,
    faults: Faulty,
    client: Client,
    other: Client,
}

/// A 9 s lease: renewed every 3 s; the holder counts on 9 s - (90 ms + 2 ms) = 8.908 s.
fn rig() -> Rig {
    rig_with(LockOptions::builder())
}

fn rig_with(options: leasehold_core::LockOptionsBuilder) -> Rig {
    let options = options
        .ttl(9 * SEC)
        .request_timeout(200 * MS)
        .build()
        .unwrap();
    let clock = ManualClock::new();
    let server = InMemory::with_clock(clock.clone());
    let faults = Faulty::new(server.clone());
    let client = Client::builder(faults.clone())
        .clock(clock.clone())
        .options(options.clone())
        .build();
    let other = Client::builder(server.clone())
        .clock(clock.clone())
        .options(options)
        .build();
    Rig {
        clock,
        server,
        faults,
        client,
        other,
    }
}

impl Rig {
    async fn lock(&self) -> Guard {
        self.client.mutex("m").unwrap().lock().await.unwrap()
    }

    async fn other_try(&self) -> Option<Guard> {
        self.other.mutex("m").unwrap().try_lock().await.unwrap()
    }

    async fn holders(&self) -> Vec<String> {
        let state = self.other.inspect("m").await.unwrap();
        state.holders.iter().map(|h| h.owner.to_string()).collect()
    }
}

#[tokio::test]
async fn the_watchdog_keeps_a_lock_far_past_its_ttl() {
    let r = rig();
    let guard = r.lock().await;
    for n in 1..=10 {
        r.clock.advance(3 * SEC);
        r.faults.until_calls(Op::Renew, n).await;
    }
    // 30 s in, on a 9 s lease.
    assert!(guard.is_held());
    assert!(r.other_try().await.is_none());
    guard.release().await.unwrap();
    assert!(r.other_try().await.is_some());
}

/// Leases due together are renewed in one backend call.
/// A batch that fails as a whole is tried again as one after a pause, and a grant the
/// batch finds gone ends that lease only.
#[tokio::test]
async fn leases_due_together_are_renewed_in_one_call() {
    let r = rig();
    let mut guards = Vec::new();
    for name in ["a", "b", "c"] {
        guards.push(r.client.mutex(name).unwrap().lock().await.unwrap());
    }
    r.clock.advance(3 * SEC);
    r.faults.until_calls(Op::Renew, 3).await;
    assert_eq!(r.faults.calls(Op::RenewMany), 1);

    r.faults
        .fail_next(Op::RenewMany, Error::unavailable("connection reset"));
    r.clock.advance(3 * SEC);
    r.faults.until_calls(Op::RenewMany, 2).await;
    // The batch failed before any renewal went out; after a pause (renew_every / 4) the
    // three try again together, not each on its own.
    r.clock.advance(750 * MS);
    let retried = r.faults.until_calls(Op::RenewMany, 3);
    tokio::time::timeout(30 * SEC, retried)
        .await
        .expect("the batch was not tried again as one");
    r.faults.until_calls(Op::Renew, 6).await;
    assert_eq!(r.faults.calls(Op::RenewMany), 3);
    // Past the deadline the first renewal gave (3 s + 8.908 s): held by the retried batch.
    r.clock.advance(5_250 * MS);
    for guard in &guards {
        assert!(guard.is_held(), "{} lost", guard.name());
    }

    // An operator removes b's grant on the server: the next batch ends b alone.
    let request = Request::new(
        LockName::new("b").unwrap(),
        guards[1].owner().clone(),
        Mode::Exclusive,
        9 * SEC,
    );
    r.server.release(&request).await.unwrap();
    let renewed = r.faults.calls(Op::RenewMany);
    r.clock.advance(3 * SEC);
    assert_eq!(guards[1].lost().await, LossReason::NotOwner);
    assert!(r.faults.calls(Op::RenewMany) > renewed);
    assert!(guards[0].is_held() && guards[2].is_held());
}

#[tokio::test]
async fn loss_is_signalled_at_the_local_deadline_before_the_server_expires_the_lock() {
    let r = rig();
    r.faults.hold_requests(Op::Renew);
    let guard = r.lock().await;
    let lost = guard.lost();
    r.clock.advance(3 * SEC);
    r.faults.until_calls(Op::Renew, 1).await;
    r.clock.advance(5_907 * MS);
    assert!(guard.is_held(), "lost before its deadline");
    r.clock.advance(MS);
    assert!(!guard.is_held(), "held at its deadline");
    assert_eq!(lost.await, LossReason::Expired);
    assert_eq!(guard.remaining(), Duration::ZERO);

    // The server still holds it for another 92 ms: the holder gave up first.
    assert!(r.other_try().await.is_none());
    r.clock.advance(92 * MS);
    let next = r
        .other_try()
        .await
        .expect("free once the server's lease ran out");
    assert!(next.token() > guard.token());

    // The stale guard's release reports the loss and leaves the new holder alone.
    let stale_owner = guard.owner().clone();
    assert!(matches!(
        guard.release().await,
        Err(Error::Lost(LossReason::Expired))
    ));
    assert_eq!(r.holders().await, vec![next.owner().to_string()]);
    assert_ne!(next.owner(), &stale_owner);
    // The renewal that was held back now reaches the server: it finds another owner.
    r.faults.resume(Op::Renew);
    assert!(next.is_held());
}

#[tokio::test]
async fn not_owner_ends_the_guard_at_once() {
    let r = rig();
    let guard = r.lock().await;
    // An operator removes the grant on the server.
    let request = Request::new(
        LockName::new("m").unwrap(),
        guard.owner().clone(),
        Mode::Exclusive,
        9 * SEC,
    );
    r.server.release(&request).await.unwrap();
    r.clock.advance(3 * SEC);
    // Lost at the first renewal, 5.9 s before its deadline.
    assert_eq!(guard.lost().await, LossReason::NotOwner);
    assert!(!guard.is_held());
    assert!(matches!(
        guard.release().await,
        Err(Error::Lost(LossReason::NotOwner))
    ));
}

#[tokio::test]
async fn failed_renewals_are_retried_until_one_succeeds() {
    let r = rig();
    let guard = r.lock().await;
    for _ in 0..2 {
        r.faults
            .fail_next(Op::Renew, Error::unavailable("connection reset"));
    }
    r.clock.advance(3 * SEC);
    r.faults.until_calls(Op::Renew, 1).await;
    // Retries come every renew_every / 4 = 750 ms.
    r.clock.advance(750 * MS);
    r.faults.until_calls(Op::Renew, 2).await;
    r.clock.advance(750 * MS);
    r.faults.until_calls(Op::Renew, 3).await;
    // The fourth renewal is due 3 s after the successful third one (sent at 4.5 s); the
    // lock survives past the first lease's deadline (8.908 s).
    r.clock.advance(3 * SEC);
    r.faults.until_calls(Op::Renew, 4).await;
    r.clock.advance(2 * SEC);
    assert!(guard.is_held());
    assert!(r.other_try().await.is_none());
}

#[tokio::test]
async fn a_release_that_fails_to_reach_the_server_is_retried() {
    let r = rig();
    let guard = r.lock().await;
    for _ in 0..2 {
        r.faults
            .fail_next(Op::Release, Error::unavailable("connection refused"));
    }
    guard.release().await.unwrap();
    assert_eq!(r.faults.calls(Op::Release), 3);
    assert!(r.holders().await.is_empty());
    assert!(r.other_try().await.is_some());
}

/// A release whose first attempt was applied but whose answer was lost is not "not held".
/// The retry finds nothing: the first attempt released it, nothing was lost unnoticed.
// Tokio's time is paused: the request timeout passes as soon as nothing else can run.
#[tokio::test(start_paused = true)]
async fn a_release_whose_answer_was_lost_is_reported_done() {
    let r = rig();
    let guard = r.lock().await;
    r.faults.lose_next_reply(Op::Release);
    guard.release().await.unwrap();
    assert_eq!(r.faults.calls(Op::Release), 2);
    assert!(r.holders().await.is_empty());
}

/// A retry's "not held" after an error that says nothing was applied is a loss.
/// A replica refusing the write (a retryable error with an answer) released nothing: the
/// grant was gone already, here evicted unnoticed, and the release says so.
#[tokio::test]
async fn a_release_refused_then_not_held_reports_the_loss() {
    let r = rig();
    let guard = r.lock().await;
    let eviction = Eviction::new(
        guard.owner().clone(),
        guard.token(),
        "ops@host".into(),
        "test".into(),
    );
    assert!(
        r.server
            .evict(guard.name(), Mode::Exclusive, &eviction)
            .await
            .unwrap()
    );
    r.faults.fail_next(
        Op::Release,
        Error::backend(
            "READONLY You can't write against a read only replica.",
            true,
        ),
    );
    assert!(matches!(guard.release().await, Err(Error::NotHeld)));
    assert_eq!(r.faults.calls(Op::Release), 2);
}

#[tokio::test]
async fn a_dropped_guard_is_released_and_no_longer_renewed() {
    let r = rig();
    let guard = r.lock().await;
    drop(guard);
    r.client.settle().await;
    assert_eq!(r.faults.calls(Op::Release), 1);
    assert!(r.holders().await.is_empty());
    r.clock.advance(60 * SEC);
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        r.faults.calls(Op::Renew),
        0,
        "an abandoned lease was renewed"
    );
}

#[tokio::test]
async fn a_dropped_guard_sends_its_release_before_the_drop_returns() {
    let r = rig();
    let guard = r.lock().await;
    drop(guard);
    // One thread, and nothing has yielded to it since the drop: the drop itself sent the
    // release (the in-memory server answers at once), so a request after it finds the
    // lock free.
    assert_eq!(r.faults.calls(Op::Release), 1);
    assert!(r.holders().await.is_empty());
    assert!(r.other_try().await.is_some());
}

#[test]
fn a_guard_dropped_after_its_runtime_is_gone_does_not_panic() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (r, guard) = runtime.block_on(async {
        let r = rig();
        let guard = r.lock().await;
        (r, guard)
    });
    drop(runtime);
    // A failed first attempt would wait on the runtime's timers, which are gone: the
    // release must be dropped with the runtime's tasks, quietly.
    r.faults
        .fail_next(Op::Release, Error::unavailable("connection refused"));
    drop(guard);
    drop(r);
}

#[tokio::test]
async fn a_guard_dropped_outside_the_runtime_is_still_released() {
    let r = rig();
    let guard = r.lock().await;
    std::thread::spawn(move || drop(guard)).join().unwrap();
    r.client.settle().await;
    assert!(r.other_try().await.is_some());
}

#[tokio::test]
async fn the_hold_cap_stops_renewal_and_the_lease_runs_out() {
    // A 9 s lease renewed every 3 s, capped at 7 s: renewals at 3 s and 6 s; the next one
    // (9 s) would pass the cap, so the lease ends at 6 s + 8.908 s.
    let r = rig_with(LockOptions::builder().max_hold(7 * SEC));
    let guard = r.lock().await;
    let lost = guard.lost();
    for n in 1..=2 {
        r.clock.advance(3 * SEC);
        r.faults.until_calls(Op::Renew, n).await;
    }
    r.clock.advance(8_907 * MS);
    assert!(guard.is_held());
    r.clock.advance(MS);
    assert_eq!(lost.await, LossReason::MaxHoldReached);
    assert_eq!(r.faults.calls(Op::Renew), 2);
}

#[tokio::test]
async fn an_acquire_whose_reply_was_lost_is_adopted_not_orphaned() {
    let r = rig();
    r.faults.lose_next_reply(Op::Acquire);
    // The manual clock does not move: a retry that is not adopted would wait forever, so
    // bound it in real time.
    let mutex = r.client.mutex("m").unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(10), mutex.lock_timeout(30 * SEC))
        .await
        .expect("the retry was refused: the lost grant was orphaned")
        .unwrap()
        .expect("granted on retry");
    // The retry carried the same owner id and got the grant the lost reply announced.
    assert_eq!(r.faults.calls(Op::Acquire), 2);
    assert_eq!(guard.token().get(), 1);
    assert_eq!(r.holders().await, vec![guard.owner().to_string()]);
}

#[tokio::test]
async fn a_try_lock_without_an_answer_releases_whatever_it_may_have_taken() {
    let r = rig();
    r.faults.lose_next_reply(Op::Acquire);
    let answer = r.client.mutex("m").unwrap().try_lock().await;
    assert!(matches!(answer, Err(Error::Timeout(_))), "{answer:?}");
    // The grant made on the server was released by owner before returning.
    assert!(r.holders().await.is_empty());
    assert!(r.other_try().await.is_some());
}

#[tokio::test]
async fn a_grant_whose_reply_arrives_after_its_deadline_is_given_back() {
    let r = rig();
    r.faults.hold_replies(Op::Acquire);
    let client = r.client.clone();
    let attempt = tokio::spawn(async move { client.mutex("m").unwrap().try_lock().await });
    r.faults.until_calls(Op::Acquire, 1).await;
    // The server granted at once; the reply arrives 8.95 s later, past the holder's
    // deadline (8.908 s) but before the server's expiry (9 s).
    r.clock.advance(8_950 * MS);
    r.faults.resume(Op::Acquire);
    assert!(attempt.await.unwrap().unwrap().is_none());
    assert!(r.holders().await.is_empty(), "the late grant was kept");
    assert_eq!(r.other_try().await.unwrap().token().get(), 2);
}

#[tokio::test]
async fn a_cancelled_waiter_leaves_its_queue_entry_behind_for_nobody() {
    let r = rig();
    let holder = r.lock().await;
    let client = r.client.clone();
    let waiter = tokio::spawn(async move { client.mutex("m").unwrap().lock().await });
    r.faults.until_calls(Op::Wait, 1).await;
    assert_eq!(r.other.inspect("m").await.unwrap().waiters.len(), 1);
    waiter.abort();
    let _ = waiter.await;
    r.client.settle().await;
    assert!(r.other.inspect("m").await.unwrap().waiters.is_empty());
    holder.release().await.unwrap();
    // With a stale queue entry ahead, this fair try_lock would be refused.
    assert!(r.other_try().await.is_some());
}

#[tokio::test]
async fn a_scoped_run_is_cancelled_when_the_lock_is_lost() {
    let r = rig();
    r.faults.hold_requests(Op::Renew);
    let guard = r.lock().await;
    let mut run = std::pin::pin!(guard.run(std::future::pending::<()>()));
    assert!(futures_util::poll!(&mut run).is_pending());
    r.clock.advance(8_908 * MS);
    assert!(matches!(run.await, Err(Error::Lost(LossReason::Expired))));
    // And a run that starts after the loss does not start at all.
    let mut started = false;
    assert!(guard.run(async { started = true }).await.is_err());
    assert!(!started);
}

#[tokio::test]
async fn lock_delay_keeps_an_expired_lock_closed_but_not_a_released_one() {
    let r = rig_with(LockOptions::builder().lock_delay(5 * SEC));
    r.faults.hold_requests(Op::Renew);
    let crashed = r.lock().await;
    r.clock.advance(9 * SEC);
    assert!(!crashed.is_held());
    assert!(r.other_try().await.is_none(), "open during the lock-delay");
    r.clock.advance(4_999 * MS);
    assert!(r.other_try().await.is_none(), "open during the lock-delay");
    r.clock.advance(MS);
    let next = r.other_try().await.expect("open after the lock-delay");
    drop(crashed);
    // A normal release opens the lock at once.
    next.release().await.unwrap();
    r.faults.resume(Op::Renew);
    let released = r.lock().await;
    released.release().await.unwrap();
    assert!(r.other_try().await.is_some());
}

#[tokio::test]
async fn reentrancy_is_counted_per_owner_not_per_task() {
    let r = rig();
    let owner = Owner::new();
    let rw = r.client.rwlock("m").unwrap().owned_by(&owner);
    let write = rw.write().await.unwrap();
    // Another task, same owner: re-entered without asking the server.
    let rw2 = rw.clone();
    let read = tokio::spawn(async move { rw2.read().await.unwrap() })
        .await
        .unwrap();
    assert_eq!(read.token(), write.token());
    assert_eq!(write.hold_count(), 2);
    assert_eq!(r.faults.calls(Op::Acquire), 1);
    read.release().await.unwrap();
    assert!(write.is_held());
    assert!(r.other_try().await.is_none());
    write.release().await.unwrap();
    assert!(r.holders().await.is_empty());

    // Another owner does not re-enter.
    let mutex = r.client.mutex("m").unwrap().owned_by(&owner);
    let held = mutex.lock().await.unwrap();
    let stranger = r.client.mutex("m").unwrap().owned_by(&Owner::new());
    assert!(stranger.try_lock().await.unwrap().is_none());
    drop(held);

    // A read-to-write upgrade would wait for itself: refused.
    r.client.settle().await;
    let read = rw.read().await.unwrap();
    assert!(matches!(
        rw.try_write().await,
        Err(Error::InvalidArgument {
            what: "lock upgrade",
            ..
        })
    ));
    drop(read);
}

#[tokio::test]
async fn unsupported_and_invalid_requests_are_typed_errors_and_send_nothing() {
    let r = rig();
    assert!(matches!(
        r.client.semaphore("s", 0),
        Err(Error::InvalidArgument {
            what: "permits",
            ..
        })
    ));
    assert!(matches!(
        r.client.mutex("bad name"),
        Err(Error::InvalidArgument {
            what: "lock name",
            ..
        })
    ));
    assert!(matches!(
        r.client
            .mutex("m")
            .unwrap()
            .lock_timeout(Duration::MAX)
            .await,
        Err(Error::InvalidArgument { what: "wait", .. })
    ));
    assert_eq!(r.faults.calls(Op::Acquire), 0);
}

#[tokio::test]
async fn tokens_increase_across_grants_of_a_name() {
    let r = rig();
    let mut last = None;
    for _ in 0..5 {
        let guard = r.lock().await;
        assert!(Some(guard.token()) > last);
        last = Some(guard.token());
        guard.release().await.unwrap();
    }
    // Permits of the same name share the counter.
    let permit = r.client.semaphore("m", 3).unwrap().acquire().await.unwrap();
    assert!(Some(permit.token()) > last);
    let _ = r.clock.now();
}

/// The in-memory server measures a hand-off from the release to the waiter's grant.
/// A grant that follows no release, or goes to a request that did not wait, carries none.
#[tokio::test]
async fn a_waiters_grant_carries_the_time_since_the_release_before_it() {
    let r = rig();
    let request = |waiting| {
        let mut req = Request::new(
            LockName::new("m").unwrap(),
            OwnerId::generate(),
            Mode::Exclusive,
            9 * SEC,
        );
        req.fair = true;
        req.waiting = waiting;
        req
    };
    let (a, b, c) = (request(false), request(true), request(false));
    let granted = |answer| match answer {
        Acquire::Granted(grant) => grant,
        other => panic!("not granted: {other:?}"),
    };
    assert_eq!(granted(r.server.acquire(&a).await.unwrap()).handoff, None);
    let busy = r.server.acquire(&b).await.unwrap();
    assert!(matches!(busy, Acquire::Busy(_)));
    r.clock.advance(7 * MS);
    r.server.release(&a).await.unwrap();
    r.clock.advance(3 * MS);
    let handed = granted(r.server.acquire(&b).await.unwrap());
    assert_eq!(handed.handoff, Some(3 * MS));
    // Released with nobody waiting; taken by a request that did not wait.
    r.server.release(&b).await.unwrap();
    r.clock.advance(5 * MS);
    assert_eq!(granted(r.server.acquire(&c).await.unwrap()).handoff, None);
    r.server.release(&c).await.unwrap();

    // One reader of two releases; the other's lease runs out: no release let the writer in.
    let (mut r1, mut r2, w) = (request(false), request(false), request(true));
    r1.mode = Mode::Shared;
    r2.mode = Mode::Shared;
    granted(r.server.acquire(&r1).await.unwrap());
    granted(r.server.acquire(&r2).await.unwrap());
    assert!(matches!(
        r.server.acquire(&w).await.unwrap(),
        Acquire::Busy(_)
    ));
    r.server.release(&r1).await.unwrap();
    r.clock.advance(10 * SEC);
    assert_eq!(granted(r.server.acquire(&w).await.unwrap()).handoff, None);
}

#[test]
fn guards_are_owned_and_futures_are_send() {
    fn owned<T: Send + Sync + 'static>() {}
    fn send<T: Send>(_: &T) {}
    fn send_static<T: Send + 'static>(_: &T) {}
    owned::<Guard>();
    owned::<leasehold_core::Leadership>();
    owned::<Client>();
    owned::<leasehold_core::Mutex>();
    let client = Client::new(InMemory::new());
    let mutex = client.mutex("m").unwrap();
    send(&mutex.lock());
    send(&mutex.try_lock());
    send(&mutex.run(|_| async {}));
    let rw = client.rwlock("r").unwrap();
    send(&rw.read());
    let semaphore = client.semaphore("s", 2).unwrap();
    send(&semaphore.acquire());
    let election = client.election("e").unwrap();
    send(&election.campaign("x"));
    let mut observer = election.observe();
    send(&observer.next());
    send(&client.settle());
    // The loss signal outlives the guard's borrow: it can be moved into a task.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let guard = rt.block_on(mutex.lock()).unwrap();
    send_static(&guard.lost());
    send(&guard.release());
}
