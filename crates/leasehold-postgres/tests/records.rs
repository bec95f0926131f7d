//! Records beside a lock, and the schema version that brought them.
//! A schema at version 2 is brought to 3 once, by clients starting together; an expired
//! record is not read and is dropped by the next write of its name or by the sweep;
//! records never show as locks; a writer whose lease ran out or whose advisory session
//! ended writes nothing.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::time::Duration;

use leasehold_core::backend::{Acquire, Backend, Mode, Release, Request};
use leasehold_core::{Error, LockName, NamePrefix, OwnerId, RecordKey};
use leasehold_postgres::PostgresBackend;
use leasehold_postgres::tokio_postgres;
use leasehold_testkit::Postgres;

mod common;
use common::{database, old_schema, until};

const KEEP: Duration = Duration::from_secs(600);

async fn count(db: &tokio_postgres::Client, sql: &str) -> i64 {
    db.query_one(sql, &[]).await.unwrap().get(0)
}

fn request(name: &str, ttl: Duration) -> Request {
    Request::new(
        LockName::new(name).unwrap(),
        OwnerId::generate(),
        Mode::Exclusive,
        ttl,
    )
}

async fn granted(backend: &PostgresBackend, req: &Request) {
    let answer = backend.acquire(req).await.unwrap();
    assert!(matches!(answer, Acquire::Granted(_)), "{answer:?}");
}

fn key(key: &str) -> RecordKey {
    RecordKey::new(key).unwrap()
}

/// The schema's version 3 (records) comes once, over a version 2 schema with a holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_2_schema_is_brought_to_version_3_once() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    old_schema(&db, 2).await;
    db.batch_execute(
        "SELECT old.acquire('held', 'someone', 'x', NULL, 600000, false, false, 0, NULL)",
    )
    .await
    .unwrap();

    let url = format!("{}?schema=old", server.url());
    let clients =
        futures_util::future::join_all((0..4).map(|_| PostgresBackend::connect(&url))).await;
    let backend = clients.into_iter().next().unwrap().unwrap();
    assert_eq!(
        count(&db, "SELECT max(version)::bigint FROM old.version").await,
        5,
        "brought to the latest version"
    );
    assert_eq!(count(&db, "SELECT count(*) FROM old.version").await, 1);
    // The holder of version 2 still holds, and a new one can write a record.
    let held = backend
        .inspect(&LockName::new("held").unwrap())
        .await
        .unwrap();
    assert_eq!(held.holders.len(), 1);
    let req = request("job", Duration::from_secs(30));
    granted(&backend, &req).await;
    assert!(
        backend
            .put_record(&req, &key("done"), b"yes", KEEP)
            .await
            .unwrap()
    );
    assert_eq!(count(&db, "SELECT count(*) FROM old.records").await, 1);
    // Connecting again finds it up to date.
    PostgresBackend::connect(&url).await.unwrap();
    assert_eq!(count(&db, "SELECT count(*) FROM old.version").await, 1);
}

/// An expired record is not read, and goes with the next write of its name or a sweep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_records_are_not_read_and_are_swept() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    let backend = PostgresBackend::connect(&server.url()).await.unwrap();
    let job = request("job", Duration::from_secs(30));
    granted(&backend, &job).await;
    assert!(
        backend
            .put_record(&job, &key("short"), b"1", Duration::from_millis(1))
            .await
            .unwrap()
    );
    let other = request("other", Duration::from_secs(30));
    granted(&backend, &other).await;
    assert!(
        backend
            .put_record(&other, &key("short"), b"1", Duration::from_millis(1))
            .await
            .unwrap()
    );
    until(
        &db,
        "SELECT count(*) = 2 FROM leasehold.records WHERE expires_at <= clock_timestamp()",
    )
    .await;
    assert_eq!(
        backend.get_record(&job.name, &key("short")).await.unwrap(),
        None
    );

    // A write of the name drops its expired records (not the other name's).
    assert!(
        backend
            .put_record(&job, &key("long"), b"2", KEEP)
            .await
            .unwrap()
    );
    let left = "SELECT count(*) FROM leasehold.records r WHERE r.key = 'short'";
    assert_eq!(count(&db, left).await, 1);
    // Rewriting an expired record under its own key replaces it.
    assert!(
        backend
            .put_record(&other, &key("short"), b"3", KEEP)
            .await
            .unwrap()
    );
    assert_eq!(
        backend
            .get_record(&other.name, &key("short"))
            .await
            .unwrap()
            .as_deref(),
        Some(&b"3"[..])
    );
    assert!(
        backend
            .put_record(&other, &key("short"), b"4", Duration::from_millis(1))
            .await
            .unwrap()
    );
    until(
        &db,
        "SELECT bool_and(expires_at <= clock_timestamp()) FROM leasehold.records \
         WHERE key = 'short'",
    )
    .await;
    backend.sweep().await.unwrap();
    assert_eq!(count(&db, left).await, 0);
    assert_eq!(
        count(&db, "SELECT count(*) FROM leasehold.records").await,
        1
    );

    // A keep the server cannot date is refused, and nothing is written.
    let refused = backend
        .put_record(&job, &key("forever"), b"5", Duration::MAX)
        .await;
    assert!(
        matches!(refused, Err(Error::InvalidArgument { .. })),
        "{refused:?}"
    );
}

/// Records never show as locks: not listed, not inspected, in either mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_not_locks() {
    let server = Postgres::start().await.unwrap();
    for url in [
        server.url(),
        format!("{}?mode=advisory&session_ttl=5s", server.url()),
    ] {
        let backend = PostgresBackend::connect(&url).await.unwrap();
        let req = request("jobs.nightly", Duration::from_secs(30));
        granted(&backend, &req).await;
        assert!(
            backend
                .put_record(&req, &key("window:1"), b"done", KEEP)
                .await
                .unwrap()
        );
        assert_eq!(backend.release(&req).await.unwrap(), Release::Released);
        let listed = backend
            .list(&NamePrefix::new("jobs.").unwrap(), None, 100)
            .await
            .unwrap();
        assert!(listed.locks.is_empty(), "{url}: {:?}", listed.locks);
        let state = backend.inspect(&req.name).await.unwrap();
        assert!(
            state.holders.is_empty() && state.waiters.is_empty(),
            "{url}"
        );
        assert_eq!(
            backend
                .get_record(&req.name, &key("window:1"))
                .await
                .unwrap()
                .as_deref(),
            Some(&b"done"[..]),
            "{url}"
        );
    }
}

/// A lease that ran out on the server's clock writes nothing, though no one else holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_writes_nothing() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    let backend = PostgresBackend::connect(&server.url()).await.unwrap();
    let req = request("job", Duration::from_millis(50));
    granted(&backend, &req).await;
    until(
        &db,
        "SELECT bool_and(expires <= clock_timestamp()) FROM leasehold.grants",
    )
    .await;
    assert!(
        !backend
            .put_record(&req, &key("done"), b"late", KEEP)
            .await
            .unwrap()
    );
    assert_eq!(
        backend.get_record(&req.name, &key("done")).await.unwrap(),
        None
    );
}

/// Advisory mode: once the session holding the lock has ended, its holder writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_advisory_session_writes_nothing() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    let url = format!("{}?mode=advisory&session_ttl=5s", server.url());
    let backend = PostgresBackend::connect(&url).await.unwrap();
    let req = request("job", Duration::from_secs(5));
    granted(&backend, &req).await;
    assert!(
        backend
            .put_record(&req, &key("first"), b"1", KEEP)
            .await
            .unwrap()
    );
    db.batch_execute(
        "SELECT pg_terminate_backend(a.pid) FROM leasehold.advisory a WHERE a.name = 'job'",
    )
    .await
    .unwrap();
    // Until the client has seen its connection close, the write fails as the session
    // ends; it never succeeds.
    let answer = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match backend.put_record(&req, &key("second"), b"2", KEEP).await {
                Ok(written) => return written,
                Err(Error::Unavailable { .. }) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(other) => panic!("{other:?}"),
            }
        }
    })
    .await
    .unwrap();
    assert!(!answer, "a record was written after the session ended");
    assert_eq!(
        backend.get_record(&req.name, &key("second")).await.unwrap(),
        None
    );
    // Another holder of the lock now writes.
    let next = request("job", Duration::from_secs(5));
    granted(&backend, &next).await;
    assert!(
        backend
            .put_record(&next, &key("second"), b"3", KEEP)
            .await
            .unwrap()
    );
    // The first holder's owner id still writes nothing.
    assert!(
        !backend
            .put_record(&req, &key("second"), b"4", KEEP)
            .await
            .unwrap()
    );
}

/// Lease mode: a write racing a release waits for it, then writes nothing.
/// The release, and the next holder's write, are being committed when it starts: it never
/// overwrites the next holder's record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_racing_a_release_waits_for_it_and_writes_nothing() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    let mut other = database(&server.url()).await;
    let backend = PostgresBackend::connect(&format!("{}?application_name=writer", server.url()))
        .await
        .unwrap();
    let req = request("job", Duration::from_secs(30));
    granted(&backend, &req).await;

    // The grant goes and the next holder writes, in a transaction not yet committed.
    let tx = other.transaction().await.unwrap();
    tx.execute(
        "DELETE FROM leasehold.grants WHERE name = 'job' AND owner = $1",
        &[&req.owner.as_str()],
    )
    .await
    .unwrap();
    tx.batch_execute(
        "INSERT INTO leasehold.records VALUES \
         ('job', 'done', 'next'::bytea, clock_timestamp() + interval '1 hour')",
    )
    .await
    .unwrap();
    let write = tokio::spawn({
        let (backend, req) = (backend.clone(), req.clone());
        async move { backend.put_record(&req, &key("done"), b"stale", KEEP).await }
    });
    until(
        &db,
        "SELECT count(*) = 1 FROM pg_stat_activity \
         WHERE application_name = 'writer' AND wait_event_type = 'Lock'",
    )
    .await;
    tx.commit().await.unwrap();
    assert!(
        !write.await.unwrap().unwrap(),
        "the stale write was applied"
    );
    assert_eq!(
        backend
            .get_record(&req.name, &key("done"))
            .await
            .unwrap()
            .as_deref(),
        Some(&b"next"[..])
    );
}

/// A kept grant wakes the name's waiters.
/// They were told the old, later end of its lease, and would otherwise look again only
/// then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_grant_wakes_its_waiters() {
    let server = Postgres::start().await.unwrap();
    let options = leasehold_core::LockOptions::builder()
        .ttl(Duration::from_secs(90))
        .build()
        .unwrap();
    let connect = || async {
        let backend = PostgresBackend::connect(&server.url()).await.unwrap();
        leasehold_core::Client::builder(backend)
            .options(options.clone())
            .build()
    };
    let (a, b) = (connect().await, connect().await);
    let held = a.mutex("kept").unwrap().lock().await.unwrap();
    let waiting = tokio::spawn(async move {
        let mutex = b.mutex("kept").unwrap();
        let next = mutex.lock_timeout(Duration::from_secs(60)).await.unwrap();
        (next, std::time::Instant::now())
    });
    until_waiting(&a, "kept").await;
    let kept = std::time::Instant::now();
    held.keep_for(Duration::from_millis(300)).await.unwrap();
    let (next, granted) = waiting.await.unwrap();
    let next = next.expect("granted once the kept grant ended");
    // Without the wake-up the waiter looks again only when the lease it was told of ends
    // (30 s here); woken, it is granted as the 300 ms hold ends (a loaded machine adds
    // seconds).
    let waited = granted.duration_since(kept);
    assert!(
        waited < Duration::from_secs(10),
        "granted {waited:?} after the keep"
    );
    next.release().await.unwrap();
}

/// Waits until `name` has a waiter.
async fn until_waiting(client: &leasehold_core::Client, name: &str) {
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        while client.inspect(name).await.unwrap().waiters.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "nobody waited for {name}");
}

/// The sweep drops evictions over a week old, and keeps newer ones.
/// Their age is from the time they were recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_drops_evictions_over_a_week_old() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    let backend = PostgresBackend::connect(&server.url()).await.unwrap();
    let now_ms = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint";
    let week_ms = 7 * 24 * 3600 * 1000;
    db.batch_execute(&format!(
        "INSERT INTO leasehold.evictions (name, owner, token, evicted_by, reason, at_ms) VALUES \
         ('old', 'o1', 1, 'ops@host', 'stuck', {now_ms} - {week_ms} - 1000), \
         ('recent', 'o2', 2, 'ops@host', 'stuck', {now_ms} - {week_ms} + 60000)"
    ))
    .await
    .unwrap();
    backend.sweep().await.unwrap();
    let left = "SELECT string_agg(name, ',') FROM leasehold.evictions";
    let names: String = db.query_one(left, &[]).await.unwrap().get(0);
    assert_eq!(names, "recent");
}
