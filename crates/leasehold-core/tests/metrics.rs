//! The metrics every lock reports, scraped from a real Prometheus exporter over HTTP.
//! One test: a process has one recorder.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::Arc;
use std::time::Duration;

use leasehold_core::memory::InMemory;
use leasehold_core::{Client, Fence, FencingToken, LockOptions, LossReason};
use leasehold_testkit::faulty::{Faulty, Op};
use leasehold_testkit::metric_value as value;
use metrics_exporter_prometheus::PrometheusBuilder;

fn options(ttl: Duration) -> LockOptions {
    LockOptions::builder().ttl(ttl).build().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_sequence_is_counted_as_it_happened() {
    // A free port may be taken before the exporter binds it: then another.
    let mut tries = (0..5).map(|_| {
        let port = leasehold_testkit::free_port();
        let exporter = PrometheusBuilder::new().with_http_listener(([127, 0, 0, 1], port));
        exporter.install().map(|()| port)
    });
    let port = tries
        .by_ref()
        .find_map(Result::ok)
        .expect("no exporter could listen (each try's port was taken)");
    let backend = Arc::new(InMemory::new());
    let a = Client::builder_from_arc(backend.clone())
        .options(options(Duration::from_secs(30)))
        .build();
    let b = Client::builder_from_arc(backend.clone())
        .options(options(Duration::from_secs(30)))
        .build();

    // Three grants released; one busy try; one wait that runs out.
    for _ in 0..3 {
        a.mutex("jobs")
            .unwrap()
            .lock()
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
    // A hand-off: b waits for jobs, a releases it.
    let first = a.mutex("jobs").unwrap().lock().await.unwrap();
    let waiter = b.mutex("jobs").unwrap();
    let handed = tokio::spawn(async move { waiter.lock().await });
    while b.inspect("jobs").await.unwrap().waiters.is_empty() {
        // The in-memory backend shows the queued waiter; nothing else to await.
        tokio::task::yield_now().await;
    }
    first.release().await.unwrap();
    handed.await.unwrap().unwrap().release().await.unwrap();

    let held = a.mutex("jobs").unwrap().lock().await.unwrap();
    assert!(b.mutex("jobs").unwrap().try_lock().await.unwrap().is_none());
    let waiting = b.mutex("jobs").unwrap();
    let waited = waiting.lock_timeout(Duration::from_millis(50));
    assert!(waited.await.unwrap().is_none());

    // Renewals: a short lease renewed twice.
    let short = Client::builder_from_arc(backend.clone())
        .options(options(Duration::from_millis(1500)))
        .build();
    let renewed = short.mutex("renewed").unwrap().lock().await.unwrap();
    let mut seen = renewed.deadline().unwrap();
    for _ in 0..2 {
        seen = renewed.deadline_changed(seen).await.unwrap();
    }
    renewed.release().await.unwrap();

    // A loss: renewals go unanswered until the deadline.
    let faults = Faulty::wrap(backend.clone());
    let cut = Client::builder_from_arc(Arc::new(faults.clone()))
        .options(options(Duration::from_millis(600)))
        .build();
    let doomed = cut.mutex("doomed").unwrap().lock().await.unwrap();
    faults.hold_replies(Op::Renew);
    assert_eq!(doomed.lost().await, LossReason::Expired);

    // An acquire whose reply is lost: its retry adopts the grant.
    let lossy = Faulty::wrap(backend.clone());
    let quick = options(Duration::from_secs(30))
        .to_builder()
        .request_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let retrying = Client::builder_from_arc(Arc::new(lossy.clone()))
        .options(quick)
        .build();
    lossy.lose_next_reply(Op::Acquire);
    let adopted = retrying.mutex("adopted").unwrap().lock().await.unwrap();
    adopted.release().await.unwrap();

    // A fence refusal, and a lock whose name is a label.
    let fence = Fence::new();
    fence.apply(FencingToken::new(5), || ()).unwrap();
    assert!(fence.apply(FencingToken::new(3), || ()).is_err());
    let named = options(Duration::from_secs(30))
        .to_builder()
        .metric_name(true)
        .build()
        .unwrap();
    let mutex = a.mutex("named").unwrap().with_options(named);
    mutex.lock().await.unwrap().release().await.unwrap();

    let text = leasehold_testkit::scrape_metrics(port).await;
    let memory = "backend=\"memory\"";
    let count = |outcome: &str| {
        let outcome = format!("outcome=\"{outcome}\"");
        value(
            &text,
            "leasehold_acquire_seconds_count",
            &[memory, &outcome],
        )
    };
    // jobs ×6, renewed, doomed, adopted (and named, a series of its own).
    assert_eq!(count("granted"), Some(9.0), "{text}");
    assert_eq!(count("busy"), Some(1.0), "{text}");
    assert_eq!(count("timeout"), Some(1.0), "{text}");
    assert_eq!(
        value(&text, "leasehold_waiting", &[memory]),
        Some(0.0),
        "{text}"
    );
    // `jobs` is still held; `doomed` was lost.
    assert_eq!(
        value(&text, "leasehold_held", &[memory]),
        Some(1.0),
        "{text}"
    );
    let lost = value(
        &text,
        "leasehold_losses_total",
        &[memory, "reason=\"expired\""],
    );
    assert_eq!(lost, Some(1.0), "{text}");
    let released = value(
        &text,
        "leasehold_hold_seconds_count",
        &[memory, "end=\"released\""],
    );
    assert_eq!(released, Some(7.0), "{text}");
    let handoffs = value(&text, "leasehold_handoff_seconds_count", &[memory]);
    assert_eq!(handoffs, Some(1.0), "{text}");
    let adopted = value(
        &text,
        "leasehold_unknown_outcomes_total",
        &[memory, "resolved=\"adopted\""],
    );
    assert_eq!(adopted, Some(1.0), "{text}");
    let renewals = value(
        &text,
        "leasehold_renewals_total",
        &[memory, "result=\"renewed\""],
    );
    assert!(renewals.is_some_and(|n| n >= 2.0), "{text}");
    let margins = value(&text, "leasehold_renewal_margin_seconds_count", &[memory]);
    assert!(margins.is_some_and(|n| n >= 2.0), "{text}");
    let refused = value(
        &text,
        "leasehold_fence_refusals_total",
        &["fence=\"fence\""],
    );
    assert_eq!(refused, Some(1.0), "{text}");
    assert!(
        value(
            &text,
            "leasehold_acquire_seconds_count",
            &["name=\"named\""]
        )
        .is_some(),
        "{text}"
    );
    assert!(
        !text.contains("name=\"jobs\""),
        "a name became a label unasked: {text}"
    );
    held.release().await.unwrap();
}
