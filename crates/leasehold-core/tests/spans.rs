//! Every acquisition is a `tracing` span, with its lock, backend, mode and outcome.
//! A cancelled one too.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};

use leasehold_core::Client;
use leasehold_core::memory::InMemory;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::{Layer, Registry};

/// The fields of every `leasehold.acquire` span, in the order they began.
/// Span ids are reused once a span closes: each open one is mapped to its entry.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Collected>>);

#[derive(Default)]
struct Collected {
    spans: Vec<BTreeMap<String, String>>,
    open: BTreeMap<u64, usize>,
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: tracing::Subscriber> Layer<S> for Spans {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        if attrs.metadata().name() == "leasehold.acquire" {
            let mut collected = self.0.lock().unwrap();
            let mut fields = BTreeMap::new();
            attrs.record(&mut Fields(&mut fields));
            collected.spans.push(fields);
            let entry = collected.spans.len() - 1;
            collected.open.insert(id.into_u64(), entry);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        let mut collected = self.0.lock().unwrap();
        if let Some(&entry) = collected.open.get(&id.into_u64()) {
            values.record(&mut Fields(&mut collected.spans[entry]));
        }
    }

    fn on_close(&self, id: Id, _: Context<'_, S>) {
        self.0.lock().unwrap().open.remove(&id.into_u64());
    }
}

#[tokio::test(flavor = "current_thread")]
async fn each_acquisition_is_a_span_with_its_outcome() {
    let spans = Spans::default();
    let _default = tracing::subscriber::set_default(Registry::default().with(spans.clone()));
    let client = Client::new(InMemory::new());
    let guard = client.mutex("audit").unwrap().lock().await.unwrap();
    assert!(
        client
            .mutex("audit")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none()
    );
    let mutex = client.mutex("audit").unwrap();
    let dropped = tokio::time::timeout(std::time::Duration::from_millis(50), mutex.lock());
    assert!(dropped.await.is_err(), "the wait was not cut short");
    guard.release().await.unwrap();

    let collected = spans.0.lock().unwrap();
    let spans = &collected.spans;
    let seen: Vec<(&str, &str, &str)> = spans
        .iter()
        .map(|f| {
            (
                f["lock"].as_str(),
                f["backend"].as_str(),
                f["outcome"].as_str(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("audit", "memory", "granted"),
            ("audit", "memory", "busy"),
            ("audit", "memory", "cancelled")
        ],
        "{spans:?}"
    );
}
