//! A multi-lock asks for every part at once.
//! A free set takes one round trip, not one per part.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::Arc;
use std::time::Duration;

use leasehold_core::memory::InMemory;
use leasehold_core::{Client, Part};
use leasehold_testkit::faulty::{Faulty, Op};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_part_of_a_free_set_is_asked_for_before_any_answer() {
    let server = InMemory::new();
    let faults = Faulty::wrap(Arc::new(server.clone()));
    let client = Client::new(faults.clone());
    let names = ["d", "a", "c", "b"];
    let parts: Vec<Part> = (names.iter())
        .map(|n| Part::from(client.mutex(n).unwrap()))
        .collect();
    let set = client.multi(parts).unwrap();
    // No answer comes back until every request is out: taken one by one, the set would
    // stop at its first part.
    faults.hold_requests(Op::Acquire);
    let taking = tokio::spawn(async move { set.lock().await });
    tokio::time::timeout(Duration::from_secs(30), faults.until_calls(Op::Acquire, 4))
        .await
        .expect("the parts were not asked for at once");
    faults.resume(Op::Acquire);
    let guards = taking.await.unwrap().unwrap();
    assert_eq!(faults.calls(Op::Acquire), 4, "one request per part");
    let taken: Vec<&str> = guards.guards().iter().map(|g| g.name().as_str()).collect();
    assert_eq!(taken, ["a", "b", "c", "d"]);

    // A busy part: what was granted goes back, and a try answers busy.
    let other = Client::new(server.clone());
    guards.release().await.unwrap();
    let held = other.mutex("c").unwrap().lock().await.unwrap();
    let parts: Vec<Part> = (names.iter())
        .map(|n| Part::from(client.mutex(n).unwrap()))
        .collect();
    assert!(
        client
            .multi(parts)
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none()
    );
    client.settle().await;
    for name in ["a", "b", "d"] {
        let state = other.inspect(name).await.unwrap();
        assert!(state.holders.is_empty(), "{name} was left held");
    }
    held.release().await.unwrap();
}
