//! Listing the locks under a prefix.
//! 100 000 held locks, every one listed, one bounded statement per page; and a collation
//! that scatters a prefix over the name index.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures_util::{StreamExt, stream};
use leasehold_core::backend::{Acquire, Backend, Release, Renewal, Request};
use leasehold_core::{
    Client, FencingToken, LockName, LockState, LossReason, Mode, NamePrefix, OwnerId,
};
use leasehold_postgres::PostgresBackend;
use leasehold_testkit::Postgres;

mod common;
use common::{counting_server, database};

const LOCKS: usize = 100_000;
const PAGE: usize = 1000;
const POOL: usize = 4;

/// Takes `name` for a new owner with the backend's own acquire statement, on `lane`.
async fn hold(backend: &PostgresBackend, name: &str, lane: u32) -> (OwnerId, FencingToken) {
    let owner = OwnerId::generate();
    let mut req = Request::new(
        LockName::new(name).unwrap(),
        owner.clone(),
        Mode::Exclusive,
        Duration::from_secs(600),
    );
    req.lane = lane;
    match backend.acquire(&req).await.unwrap() {
        Acquire::Granted(grant) => (owner, grant.token),
        Acquire::Busy(_) => panic!("{name} is busy"),
    }
}

/// Every page of `Backend::list` under `prefix`, `page` names at a time.
async fn pages(backend: &PostgresBackend, prefix: &str, page: usize) -> Vec<Vec<String>> {
    let prefix = NamePrefix::new(prefix).unwrap();
    let mut pages = Vec::new();
    let mut cursor = None;
    loop {
        let listed = backend.list(&prefix, cursor.as_ref(), page).await.unwrap();
        pages.push(listed.locks.iter().map(|(n, _)| n.to_string()).collect());
        match listed.next {
            Some(next) => cursor = Some(next),
            None => return pages,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_held_locks_are_all_listed_one_bounded_statement_per_page() {
    let (server, db) = counting_server().await;
    let url = format!("{}?pool_size={POOL}", server.url());
    let backend = Arc::new(PostgresBackend::connect(&url).await.unwrap());

    // Each lock taken by the acquire statement a client sends, 256 at a time spread over
    // the pool's connections (a guard apiece would only add 10⁵ watchdogs to the test).
    let held: HashMap<String, (OwnerId, FencingToken)> = stream::iter(0..LOCKS)
        .map(|i| {
            let backend = backend.clone();
            async move {
                let name = format!("bulk:{i}");
                let lane = u32::try_from(i % POOL).unwrap();
                let holder = hold(&backend, &name, lane).await;
                (name, holder)
            }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    assert_eq!(held.len(), LOCKS);
    // Just outside the prefix, on both sides of its range.
    for name in ["bulk", "bulj:9", "bulk=", "bulk-0", "bulkz"] {
        hold(&backend, name, 0).await;
    }

    let client = Client::builder_from_arc(backend.clone()).build();
    let listed = client.locks("bulk:").await.unwrap();
    assert_eq!(
        listed.len(),
        LOCKS,
        "every held lock under the prefix, once"
    );
    for (name, state) in &listed {
        let (owner, token) = &held[name.as_str()];
        let [holder] = state.holders.as_slice() else {
            panic!("{name}: {:?}", state.holders);
        };
        assert_eq!((&holder.owner, holder.token), (owner, *token), "{name}");
        assert_eq!(holder.mode, Mode::Exclusive);
        assert!(
            holder
                .remaining
                .is_some_and(|r| r <= Duration::from_secs(600))
        );
        assert!(state.waiters.is_empty(), "{name}");
    }

    // Page by page: each one statement that looks at no more than a page of names.
    db.batch_execute("SELECT pg_stat_statements_reset()")
        .await
        .unwrap();
    let pages = pages(&backend, "bulk:", PAGE).await;
    assert_eq!(
        pages.len(),
        LOCKS / PAGE + 1,
        "full pages, then an empty last one"
    );
    assert!(pages.iter().all(|page| page.len() <= PAGE));
    let names: BTreeSet<&String> = pages.iter().flatten().collect();
    assert_eq!(names.len(), LOCKS);
    assert!(names.iter().all(|name| held.contains_key(*name)));
    let row = db
        .query_one(
            "SELECT coalesce(sum(calls), 0)::bigint, coalesce(sum(rows), 0)::bigint \
             FROM pg_stat_statements WHERE query LIKE 'WITH page AS%'",
            &[],
        )
        .await
        .unwrap();
    let (calls, rows): (i64, i64) = (row.get(0), row.get(1));
    assert_eq!(
        calls,
        i64::try_from(pages.len()).unwrap(),
        "one statement per page"
    );
    // Under the test server's C collation a page reads the prefix's range of the index
    // only: one row per held name, none for the names around it.
    assert_eq!(rows, i64::try_from(LOCKS).unwrap(), "rows answered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_linguistic_collation_lists_every_lock_under_the_prefix() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    // ICU's root collation puts `:` before the digits, so "a9…" is not in the code point
    // range ["a9", "a:"), and weighs letters before case: "A9b" sorts among "a9…".
    db.batch_execute("CREATE DATABASE icu TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'und'")
        .await
        .unwrap();
    let url = format!("postgres://postgres@127.0.0.1:{}/icu", server.port());
    for mode in ["lease", "advisory"] {
        let backend = PostgresBackend::connect(&format!("{url}?mode={mode}"))
            .await
            .unwrap();
        let under = ["a9", "a9x", "a91", "a9_", "a9:z"];
        let mut holders = Vec::new();
        for name in under.iter().chain(&["A9b", "a:", "a8", "b9", "a-9", "a"]) {
            let client = Client::new(backend.clone());
            holders.push(client.mutex(name).unwrap().lock().await.unwrap());
        }
        let mut want: Vec<String> = under.iter().map(|n| n.to_string()).collect();
        want.sort_unstable();
        for page in [1, 2, 1000] {
            let mut got: Vec<String> = pages(&backend, "a9", page).await.concat();
            got.sort_unstable();
            assert_eq!(got, want, "{mode}, pages of {page}");
        }
        let client = Client::new(backend.clone());
        let listed: Vec<String> = client
            .locks("a9")
            .await
            .unwrap()
            .into_iter()
            .map(|(n, _)| n.to_string())
            .collect();
        assert_eq!(listed, want, "{mode}");
        for guard in holders {
            guard.release().await.unwrap();
        }
        assert!(client.locks("").await.unwrap().is_empty(), "{mode}");
    }
}

/// A name's evictions come with its inspect and its listing: the last 10, newest first.
/// Twelve readers are evicted; a queued writer keeps the name listed. An evicted owner's
/// renewal answers that it was evicted while its record is kept, and one released by its
/// holder that it is not the owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evictions_are_inspected_and_listed_newest_first_the_last_ten() {
    let server = Postgres::start().await.unwrap();
    let backend = PostgresBackend::connect(&server.url()).await.unwrap();
    let name = LockName::new("ev:1").unwrap();
    let request = |mode| {
        Request::new(
            name.clone(),
            OwnerId::generate(),
            mode,
            Duration::from_secs(600),
        )
    };
    let mut readers = Vec::new();
    for _ in 0..13 {
        let req = request(Mode::Shared);
        let Acquire::Granted(grant) = backend.acquire(&req).await.unwrap() else {
            panic!("a reader was refused");
        };
        readers.push((req, grant.token));
    }
    // One reader goes the ordinary way.
    let (released, _) = readers.pop().unwrap();
    assert_eq!(backend.release(&released).await.unwrap(), Release::Released);
    let mut writer = request(Mode::Exclusive);
    writer.waiting = true;
    assert!(matches!(
        backend.acquire(&writer).await.unwrap(),
        Acquire::Busy(_)
    ));

    let client = Client::new(backend.clone());
    let evicted = client
        .evict("ev:1", None, "ops@host", "drain")
        .await
        .unwrap();
    assert_eq!(evicted.len(), 12);
    // Evicted in token order: the newest record is the last reader's.
    let want: Vec<(OwnerId, FencingToken)> = readers
        .iter()
        .rev()
        .take(10)
        .map(|(req, token)| (req.owner.clone(), *token))
        .collect();
    let records = |state: &LockState| -> Vec<(OwnerId, FencingToken)> {
        state
            .evictions
            .iter()
            .map(|e| (e.owner.clone(), e.token))
            .collect()
    };
    let state = client.inspect("ev:1").await.unwrap();
    assert!(state.holders.is_empty(), "{:?}", state.holders);
    assert_eq!(state.waiters.len(), 1);
    assert_eq!(records(&state), want);
    assert!(
        state
            .evictions
            .iter()
            .all(|e| e.by == "ops@host" && e.reason == "drain")
    );

    let listed = client.locks("ev:").await.unwrap();
    let [(listed_name, listed_state)] = listed.as_slice() else {
        panic!("{listed:?}");
    };
    assert_eq!(listed_name, &name);
    assert_eq!(records(listed_state), want);
    assert_eq!(listed_state.waiters.len(), 1);

    let (newest, _) = readers.last().unwrap();
    let (oldest, _) = readers.first().unwrap();
    assert_eq!(
        backend.renew(newest).await.unwrap(),
        Renewal::Lost(LossReason::Evicted)
    );
    // Its record is no longer kept: an ordinary loss.
    assert_eq!(
        backend.renew(oldest).await.unwrap(),
        Renewal::Lost(LossReason::NotOwner)
    );
    assert_eq!(
        backend.renew(&released).await.unwrap(),
        Renewal::Lost(LossReason::NotOwner)
    );
    assert_eq!(backend.release(&writer).await.unwrap(), Release::Released);
}
