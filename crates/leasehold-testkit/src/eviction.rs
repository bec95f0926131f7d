//! Force release as the tests of backends whose grants live by a session check it.
//!
//! The conformance case covers the contract on every backend; this adds what only a
//! session backend must show: the evicted guard is told by push while its session, and
//! its client's other guards, live on.

// A test body: a failed step must fail the test, with the panic's location.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use leasehold_core::backend::{Backend, Eviction, Mode};
use leasehold_core::{Client, Fence, LockName, LossReason, NamePrefix};

use crate::{Direction, FaultProxy};

/// `operator` evicts `holder`'s lock `job` while `holder` also holds `other`.
/// The holder goes on writing through a fence that the operator moves past its token:
/// every write after the eviction is refused. Its guard is told (`Evicted`) while its
/// session lives on (`other` stays held); the lock stays closed until then, the next
/// grant's token is greater, and `inspect` and a listing show the record. The evicted
/// guard's release removes nothing of the next holder's.
pub async fn an_evicted_holder_is_told_and_fenced_out(holder: &Client, operator: &Client) {
    let guard = holder.mutex("job").unwrap().lock().await.unwrap();
    let other = holder.mutex("other").unwrap().lock().await.unwrap();
    let fence = Fence::new();
    let token = guard.token();
    let write = || fence.apply(token, || ()).is_ok();
    assert!(
        write(),
        "the holder's write before the eviction was refused"
    );

    let evicted = operator
        .evict("job", None, "ops@host", "stuck job")
        .await
        .unwrap();
    assert_eq!(evicted.len(), 1, "{evicted:?}");
    assert_eq!(
        (&evicted[0].owner, evicted[0].token),
        (guard.owner(), token)
    );
    fence.exclude(token);
    // The holder goes on writing, unaware until the push arrives: refused all the same.
    assert!(!write(), "a write after the eviction was accepted");
    // Held before the try, the guard was held all through it (a lost guard is never held
    // again): the try must fail.
    let held = guard.is_held();
    let try_job = operator.mutex("job").unwrap().try_lock().await.unwrap();
    assert!(
        !held || try_job.is_none(),
        "granted again while the evicted guard was held"
    );
    drop(try_job);
    assert_eq!(guard.lost().await, LossReason::Evicted);
    assert!(!write(), "a write after the loss was accepted");
    assert!(
        other.is_held(),
        "the session was lost with the evicted grant"
    );

    let next = (operator.mutex("job").unwrap())
        .lock_timeout(Duration::from_secs(60))
        .await
        .unwrap()
        .expect("job granted again once the evicted lease would have ended");
    assert!(next.token() > token);
    assert!(fence.apply(next.token(), || ()).is_ok());
    assert!(!write(), "a write after the next grant was accepted");
    let all = NamePrefix::new("").unwrap();
    let page = operator.backend().list(&all, None, 100).await.unwrap();
    let listed = page.locks.iter().find(|(name, _)| name.as_str() == "job");
    let inspected = operator.inspect("job").await.unwrap().evictions;
    for record in [inspected, listed.unwrap().1.evictions.clone()] {
        assert_eq!(record.len(), 1, "{record:?}");
        assert_eq!(
            (record[0].reason.as_str(), &record[0].owner, record[0].token),
            ("stuck job", guard.owner(), token)
        );
    }
    let _ = guard.release().await;
    assert!(next.is_held());
    assert_eq!(operator.inspect("job").await.unwrap().holders.len(), 1);
    next.release().await.unwrap();
    other.release().await.unwrap();
}

/// `operator` evicts `holder`'s lock `job` while every reply to `holder` through `slow` is 5 s late.
/// The grant waits for the eviction record less long than that: it is revoked as no longer
/// its owner's, not left held until the record comes.
pub async fn a_deleted_grant_is_revoked_without_waiting_long_for_its_record(
    holder: &Client,
    operator: &Client,
    slow: &FaultProxy,
) {
    let guard = holder.mutex("job").unwrap().lock().await.unwrap();
    slow.set_delay(Direction::ToClient, Duration::from_secs(5));
    let evicted = operator
        .evict("job", None, "ops@host", "slow link")
        .await
        .unwrap();
    assert_eq!(evicted.len(), 1, "{evicted:?}");
    assert_eq!(guard.lost().await, LossReason::NotOwner);
    slow.heal();
    let _ = guard.release().await;
}

/// An eviction asked again of `backend` after it was applied (its answer lost) answers `true`.
/// Its record names that very eviction; another eviction of the same grant answers `false`.
pub async fn an_eviction_asked_again_after_it_was_applied_answers_true(
    holder: &Client,
    backend: &impl Backend,
) {
    let guard = holder.mutex("job").unwrap().lock().await.unwrap();
    let name = LockName::new("job").unwrap();
    let of = |reason: &str| {
        let (owner, token) = (guard.owner().clone(), guard.token());
        Eviction::new(owner, token, "ops@host".into(), reason.into())
    };
    let eviction = of("retried");
    for attempt in ["first", "again"] {
        let evicted = backend.evict(&name, Mode::Exclusive, &eviction).await;
        assert!(evicted.unwrap(), "the {attempt} attempt answered false");
    }
    let another = of("someone else");
    let evicted = backend.evict(&name, Mode::Exclusive, &another).await;
    assert!(!evicted.unwrap(), "another eviction answered true");
    let _ = guard.release().await;
}
