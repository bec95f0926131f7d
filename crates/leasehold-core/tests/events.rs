//! Lock events: what a client with a sink records.
//! On the in-memory backend and a manual clock.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold_core::backend::{Backend, Mode, Request};
use leasehold_core::clock::ManualClock;
use leasehold_core::events::{EventKind, EventSink, LockEvent};
use leasehold_core::memory::InMemory;
use leasehold_core::{Client, LockName, LockOptions, LossReason};
use leasehold_testkit::faulty::{Faulty, Op};

const SEC: Duration = Duration::from_secs(1);

/// Keeps every event, and wakes whoever waits for the next.
#[derive(Debug, Default, Clone)]
struct Kept(Arc<(Mutex<Vec<LockEvent>>, tokio::sync::Notify)>);

impl EventSink for Kept {
    fn record(&self, event: &LockEvent) {
        self.0.0.lock().unwrap().push(event.clone());
        self.0.1.notify_waiters();
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

/// A grant, a renewal, a release and a loss are each recorded.
/// With the holder, its token and the server's promise; a client without a sink records
/// nothing.
#[tokio::test]
async fn every_grant_renewal_release_and_loss_is_recorded() {
    let clock = ManualClock::new();
    let server = InMemory::with_clock(clock.clone());
    let faults = Faulty::new(server.clone());
    let kept = Kept::default();
    let options = LockOptions::builder().ttl(9 * SEC).build().unwrap();
    let client = Client::builder(faults.clone())
        .clock(clock.clone())
        .options(options)
        .events(kept.clone())
        .build();

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
