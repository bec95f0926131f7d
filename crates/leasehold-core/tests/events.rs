//! Lock events: what a client with a sink records.
//! On the in-memory backend and a manual clock.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold_core::backend::{Backend, Mode, Request};
use leasehold_core::clock::ManualClock;
use leasehold_core::events::{AccessEvent, EventKind, EventSink, LockEvent};
use leasehold_core::memory::InMemory;
use leasehold_core::{Client, LockName, LockOptions, LossReason};
use leasehold_core::{Fence, FencingToken};
use leasehold_testkit::faulty::{Faulty, Op};

const SEC: Duration = Duration::from_secs(1);

/// Keeps every event, and wakes whoever waits for the next.
#[derive(Debug, Default, Clone)]
struct Kept(
    Arc<(Mutex<Vec<LockEvent>>, tokio::sync::Notify)>,
    Arc<Mutex<Vec<AccessEvent>>>,
);

impl EventSink for Kept {
    fn record(&self, event: &LockEvent) {
        self.0.0.lock().unwrap().push(event.clone());
        self.0.1.notify_waiters();
    }

    fn record_access(&self, event: &AccessEvent) {
        self.1.lock().unwrap().push(event.clone());
    }
}

impl Kept {
    fn kinds(&self) -> Vec<EventKind> {
        self.0.0.lock().unwrap().iter().map(|e| e.kind).collect()
    }

    fn all(&self) -> Vec<LockEvent> {
        self.0.0.lock().unwrap().clone()
    }

    /// Waits until `n` events were recorded.
    async fn until(&self, n: usize) {
        loop {
            let notified = self.0.1.notified();
            if self.0.0.lock().unwrap().len() >= n {
                return;
            }
            notified.await;
        }
    }
}

/// A client of `faults` on `clock` with a 9 s ttl, recording its events in `kept`.
fn recording(faults: &Faulty, clock: &ManualClock, kept: &Kept) -> Client {
    let options = LockOptions::builder().ttl(9 * SEC).build().unwrap();
    Client::builder(faults.clone())
        .clock(clock.clone())
        .options(options)
        .events(kept.clone())
        .build()
}

/// A grant, a renewal, a release and a loss are each recorded.
/// With the holder, its token and the server's promise; a client without a sink records
/// nothing.
#[tokio::test]
async fn every_grant_renewal_release_and_loss_is_recorded() {
    let clock = ManualClock::new();
    let server = InMemory::with_clock(clock.clone());
    let faults = Faulty::new(server.clone());
    let kept = Kept::default();
    let client = recording(&faults, &clock, &kept);

    let guard = client.mutex("audited").unwrap().lock().await.unwrap();
    clock.advance(3 * SEC);
    faults.until_calls(Op::Renew, 1).await;
    kept.until(2).await;
    let (owner, token) = (guard.owner().clone(), guard.token());
    guard.release().await.unwrap();

    let lost = client.mutex("lost").unwrap().lock().await.unwrap();
    let request = Request::new(
        LockName::new("lost").unwrap(),
        lost.owner().clone(),
        Mode::Exclusive,
        9 * SEC,
    );
    server.release(&request).await.unwrap();
    clock.advance(3 * SEC);
    assert_eq!(lost.lost().await, LossReason::NotOwner);

    assert_eq!(
        kept.kinds(),
        [
            EventKind::Granted,
            EventKind::Renewed,
            EventKind::Released,
            EventKind::Granted,
            EventKind::Lost(LossReason::NotOwner),
        ]
    );
    let events = kept.all();
    for event in &events[..3] {
        assert_eq!(event.name.as_str(), "audited");
        assert_eq!(event.owner, owner);
        assert_eq!(event.token, Some(token));
        assert_eq!(event.backend, "memory");
        assert_eq!(event.mode, Mode::Exclusive);
    }
    // The promise: a 9 s lease from the send of the grant's request and of the renewal's.
    for event in &events[..2] {
        assert_eq!(event.lease_ms, Some(9_000));
        let sent = event.sent_ms.unwrap();
        assert!(sent <= event.at_ms, "{event:?}");
    }
    // The steady clock never goes back, whatever the wall clock does.
    assert!(
        events.windows(2).all(|w| w[0].steady_ms <= w[1].steady_ms),
        "{events:?}"
    );
    assert_eq!(events[3].token, Some(lost.token()));
    let line = events[4].to_json();
    assert!(line.starts_with(r#"{"kind":"lost","#), "{line}");
    assert!(line.contains(r#""reason":"NotOwner""#), "{line}");

    // Without a sink nothing is made.
    let quiet = Client::builder(server.clone()).clock(clock.clone()).build();
    quiet
        .mutex("quiet")
        .unwrap()
        .lock()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    assert_eq!(kept.all().len(), 5);
}

/// A lost lease's release is recorded after the loss.
/// A server that had let the grant go answers "not held", and that is recorded too; one
/// that still kept it (the lease was lost here, at its deadline) releases it, with nothing
/// more to record.
// Tokio's time is paused: a request timeout passes as soon as nothing else can run.
#[tokio::test(start_paused = true)]
async fn a_lost_leases_release_is_recorded_with_a_not_held_answer() {
    let clock = ManualClock::new();
    let server = InMemory::with_clock(clock.clone());
    let faults = Faulty::new(server.clone());
    let kept = Kept::default();
    let client = recording(&faults, &clock, &kept);
    let of = |name: &str| -> Vec<EventKind> {
        (kept.all().iter())
            .filter(|e| e.name.as_str() == name)
            .map(|e| e.kind)
            .collect()
    };

    // Ended by the server, then released: the server had nothing left.
    let ended = client.mutex("ended").unwrap().lock().await.unwrap();
    let request = Request::new(
        LockName::new("ended").unwrap(),
        ended.owner().clone(),
        Mode::Exclusive,
        9 * SEC,
    );
    server.release(&request).await.unwrap();
    clock.advance(3 * SEC);
    assert_eq!(ended.lost().await, LossReason::NotOwner);
    let token = ended.token();
    assert!(ended.release().await.is_err());
    assert_eq!(
        of("ended"),
        [
            EventKind::Granted,
            EventKind::Lost(LossReason::NotOwner),
            EventKind::Released,
            EventKind::NotHeld,
        ]
    );
    let events = kept.all();
    assert!(events.iter().all(|e| e.token == Some(token)), "{events:?}");
    let line = events[3].to_json();
    assert!(line.starts_with(r#"{"kind":"not_held","#), "{line}");

    // Lost here at its deadline, its renewals unanswered, while the server keeps it to
    // the end of its lease: the release takes it.
    faults.hold_requests(Op::Renew);
    let late = client.mutex("late").unwrap().lock().await.unwrap();
    clock.advance(Duration::from_millis(8_950));
    assert_eq!(late.lost().await, LossReason::Expired);
    assert!(late.release().await.is_err());
    let late = of("late");
    assert_eq!(late.first(), Some(&EventKind::Granted));
    assert_eq!(
        late[late.len() - 2..],
        [EventKind::Lost(LossReason::Expired), EventKind::Released]
    );
    assert!(!late.contains(&EventKind::NotHeld), "{late:?}");
    assert!(
        server
            .inspect(&LockName::new("late").unwrap())
            .await
            .unwrap()
            .holders
            .is_empty()
    );

    // A first attempt applied, its reply lost: the retry is answered "not held", which
    // says nothing of the grant then, and is not recorded.
    let applied = client.mutex("applied").unwrap().lock().await.unwrap();
    clock.advance(Duration::from_millis(8_950));
    assert_eq!(applied.lost().await, LossReason::Expired);
    faults.lose_next_reply(Op::Release);
    let released = tokio::spawn(applied.release());
    faults.until_calls(Op::Release, 3).await;
    assert!(released.await.unwrap().is_err());
    assert_eq!(faults.calls(Op::Release), 4, "the release was not retried");
    let applied = of("applied");
    assert_eq!(
        applied[applied.len() - 2..],
        [EventKind::Lost(LossReason::Expired), EventKind::Released]
    );
}

/// An acquire request that went unanswered is recorded, and then how it was resolved.
/// A retry adopts the grant; a try-lock gives up and releases it; an acquisition dropped
/// while its outcome is unknown releases it in the background, and records that too.
// Tokio's time is paused: a request timeout passes as soon as nothing else can run.
#[tokio::test(start_paused = true)]
async fn an_unanswered_acquire_is_recorded_with_how_it_was_resolved() {
    let clock = ManualClock::new();
    let server = InMemory::with_clock(clock.clone());
    let faults = Faulty::new(server.clone());
    let kept = Kept::default();
    let client = recording(&faults, &clock, &kept);
    let of = |name: &str| -> Vec<LockEvent> {
        (kept.all().into_iter())
            .filter(|e| e.name.as_str() == name)
            .collect()
    };
    let kinds = |name: &str| -> Vec<EventKind> { of(name).iter().map(|e| e.kind).collect() };
    let holders = async |name: &str| {
        let name = LockName::new(name).unwrap();
        server.inspect(&name).await.unwrap().holders.len()
    };

    // Resolved within three request timeouts (5 s by default) and the longest retry pause.
    let unanswered = EventKind::Unanswered {
        resolved_within: 16 * SEC,
    };
    faults.lose_next_reply(Op::Acquire);
    let adopted = client.mutex("adopted").unwrap().lock().await.unwrap();
    assert_eq!(
        kinds("adopted"),
        [
            unanswered,
            EventKind::Unknown("adopted"),
            EventKind::Granted
        ]
    );
    let events = of("adopted");
    assert!(
        events[0]
            .sent_ms
            .is_some_and(|sent| sent <= events[0].at_ms)
    );
    assert_eq!(events[0].token, None);
    assert_eq!(events[1].token, Some(adopted.token()));
    assert!(events.iter().all(|e| &e.owner == adopted.owner()));
    let line = events[0].to_json();
    assert!(line.starts_with(r#"{"kind":"unanswered","#), "{line}");
    assert!(line.ends_with(r#","resolved_within_ms":16000}"#), "{line}");

    faults.lose_next_reply(Op::Acquire);
    assert!(client.mutex("tried").unwrap().try_lock().await.is_err());
    assert_eq!(kinds("tried"), [unanswered, EventKind::Unknown("released")]);
    assert_eq!(holders("tried").await, 0);

    // The server grants, and its replies are held: the acquisition is dropped while it
    // retries.
    faults.hold_replies(Op::Acquire);
    let dropped = client.mutex("dropped").unwrap();
    let waiting = tokio::spawn(async move { dropped.lock().await.map(|_| ()) });
    let before = kept.all().len();
    kept.until(before + 1).await;
    assert_eq!(kinds("dropped"), [unanswered]);
    assert_eq!(holders("dropped").await, 1);
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    client.settle().await;
    assert_eq!(
        kinds("dropped"),
        [unanswered, EventKind::Unknown("released")]
    );
    assert_eq!(holders("dropped").await, 0);
    faults.resume(Op::Acquire);
}

/// A fence that reports says which accesses it let through and which it refused.
#[test]
fn a_reporting_fence_records_each_access() {
    let kept = Kept::default();
    let fence = Fence::new().reporting_to(Arc::new(kept.clone()), "stock");
    let mut count = 0;
    fence.apply(FencingToken::new(7), || count += 1).unwrap();
    assert!(fence.apply(FencingToken::new(6), || count += 1).is_err());
    let accesses = kept.1.lock().unwrap().clone();
    let seen: Vec<(u64, bool, Option<u64>)> = accesses
        .iter()
        .map(|a| (a.token.get(), a.accepted, a.highest.map(FencingToken::get)))
        .collect();
    assert_eq!(seen, [(7, true, None), (6, false, Some(7))]);
    assert!(
        accesses
            .iter()
            .all(|a| a.resource == "stock" && a.fence == "fence")
    );
    assert_eq!(
        accesses[1].to_json(),
        format!(
            r#"{{"kind":"access","at_ms":{},"steady_ms":{},"fence":"fence","resource":"stock","token":6,"accepted":false,"highest":7}}"#,
            accesses[1].at_ms, accesses[1].steady_ms
        )
    );
    assert_eq!(count, 1);
}
