//! Fenced writes: the caller's own statement changes data only while the guard holds.
//! It runs in its own transaction, and a later grant waits for that transaction; a token
//! column refuses writes older than the newest the row accepted.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use leasehold_core::{Client, LockOptions, LossReason};
use leasehold_postgres::fence::{TokenFence, token_param};
use leasehold_postgres::tokio_postgres;
use leasehold_postgres::{PostgresBackend, StillOwner, still_owner};
use leasehold_testkit::conformance::{LivenessSwitch, ProxySwitch};
use leasehold_testkit::faulty::{Faulty, Op};
use leasehold_testkit::{FaultProxy, Postgres};
use tokio::sync::watch;

mod common;
use common::{database, old_schema, until};

async fn stock(db: &tokio_postgres::Client) {
    db.batch_execute(
        "CREATE TABLE stock (item text PRIMARY KEY, left_ integer NOT NULL);
         INSERT INTO stock VALUES ('tea', 10);",
    )
    .await
    .unwrap();
}

/// Takes one tea if `fence` still holds: the rows changed.
async fn take_one(db: &impl tokio_postgres::GenericClient, fence: &StillOwner) -> u64 {
    let sql = format!(
        "UPDATE stock SET left_ = left_ - 1 WHERE item = 'tea' AND left_ > 0 AND {}",
        fence.condition(1)
    );
    db.execute(&sql, &[&fence.name(), &fence.token(), &fence.owner()])
        .await
        .unwrap()
}

/// Polls the server until `sql` (one boolean) is true: the state a step waits for lives there.
fn short_lease() -> LockOptions {
    LockOptions::builder()
        .ttl(Duration::from_secs(1))
        .build()
        .unwrap()
}

/// A lease-mode holder's write goes in while it holds.
/// After it stalled past its lease and another took the lock, the same write changes
/// nothing, and the new holder's does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_is_refused_after_the_lease_ran_out_and_the_lock_moved_on() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    stock(&db).await;
    let faults = Faulty::wrap(Arc::new(
        PostgresBackend::connect(&server.url()).await.unwrap(),
    ));
    let a = Client::builder_from_arc(Arc::new(faults.clone()))
        .options(short_lease())
        .build();
    let b = Client::new(PostgresBackend::connect(&server.url()).await.unwrap());

    let stale = a.mutex("stock").unwrap().lock().await.unwrap();
    assert_eq!(take_one(&db, &still_owner(&stale)).await, 1);
    // The holder stalls: no renewal reaches the server.
    faults.hold_requests(Op::Renew);
    stale.lost().await;
    let next = b
        .mutex("stock")
        .unwrap()
        .lock_timeout(Duration::from_secs(20))
        .await
        .unwrap()
        .expect("granted once the stale lease ran out");
    assert!(next.token() > stale.token());
    assert_eq!(
        take_one(&db, &still_owner(&stale)).await,
        0,
        "a stale write got in"
    );
    assert_eq!(take_one(&db, &still_owner(&next)).await, 1);
    let left: i32 = db
        .query_one("SELECT left_ FROM stock", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 8);
    faults.resume(Op::Renew);
    next.release().await.unwrap();
}

/// A transaction that checked `still_owner` keeps the next grant waiting until it ends.
/// It does so even when the lease runs out on the server meanwhile: the write is ordered
/// before it. The next request does not wait on the server for it (see
/// `a_paused_fenced_writer_stalls_no_other_lock`): it queues, and is granted after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_grant_waits_for_the_fenced_transaction() {
    let server = Postgres::start().await.unwrap();
    let mut db = database(&server.url()).await;
    let observer = database(&server.url()).await;
    stock(&db).await;
    let faults = Faulty::wrap(Arc::new(
        PostgresBackend::connect(&server.url()).await.unwrap(),
    ));
    let a = Client::builder_from_arc(Arc::new(faults.clone()))
        .options(short_lease())
        .build();
    let b = Client::new(PostgresBackend::connect(&server.url()).await.unwrap());

    let holder = a.mutex("stock").unwrap().lock().await.unwrap();
    let tx = db.transaction().await.unwrap();
    assert_eq!(take_one(&tx, &still_owner(&holder)).await, 1);
    faults.hold_requests(Op::Renew);
    holder.lost().await;
    until(
        &observer,
        "SELECT count(*) = 1 FROM leasehold.grants WHERE name = 'stock' \
         AND expires <= clock_timestamp()",
    )
    .await;
    let mutex = b.mutex("stock").unwrap();
    let next = tokio::spawn(async move { mutex.lock().await });
    // The next request found the old grant kept by the transaction, and queued.
    until(
        &observer,
        "SELECT count(*) = 1 FROM leasehold.waiters WHERE name = 'stock'",
    )
    .await;
    assert!(
        !next.is_finished(),
        "granted while the fenced transaction was open"
    );
    tx.commit().await.unwrap();
    let next = next.await.unwrap().unwrap();
    assert!(next.token() > holder.token());
    let left: i32 = db
        .query_one("SELECT left_ FROM stock", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 9);
    faults.resume(Op::Renew);
    next.release().await.unwrap();
}

/// `verify`: the check as a statement of its own in the caller's transaction.
/// While it holds, the next grant waits for the transaction, as with the condition in the
/// caller's statement. Once the lock moved on it answers false, and each refusal counts in
/// `leasehold_fence_refusals_total{fence="postgres"}`, as do the ones counted by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_fences_the_transaction_and_counts_its_refusals() {
    let refusals = |fence: &str| {
        let label = format!("fence=\"{fence}\"");
        let text = leasehold_testkit::recorded_metrics();
        leasehold_testkit::metric_value(&text, "leasehold_fence_refusals_total", &[&label])
            .unwrap_or(0.0)
    };
    // Only this test of the file counts refusals (the others' conditions count nothing).
    let (postgres, token) = (refusals("postgres"), refusals("postgres_token"));
    let server = Postgres::start().await.unwrap();
    let mut db = database(&server.url()).await;
    let observer = database(&server.url()).await;
    stock(&db).await;
    let a = Client::new(PostgresBackend::connect(&server.url()).await.unwrap());
    let b = Client::new(PostgresBackend::connect(&server.url()).await.unwrap());

    let holder = a.mutex("stock").unwrap().lock().await.unwrap();
    let fence = still_owner(&holder);
    let tx = db.transaction().await.unwrap();
    assert!(fence.verify(&tx).await.unwrap());
    holder.release().await.unwrap();
    let mutex = b.mutex("stock").unwrap();
    let next = tokio::spawn(async move { mutex.lock().await });
    until(
        &observer,
        "SELECT count(*) = 1 FROM leasehold.waiters WHERE name = 'stock'",
    )
    .await;
    assert!(
        !next.is_finished(),
        "granted while the verified transaction was open"
    );
    assert_eq!(refusals("postgres"), postgres);
    tx.commit().await.unwrap();
    let next = next.await.unwrap().unwrap();

    assert!(!fence.verify(&db).await.unwrap(), "a released grant passed");
    assert!(still_owner(&next).verify(&db).await.unwrap());
    assert_eq!(refusals("postgres"), postgres + 1.0);
    fence.count_refusal();
    TokenFence::default().count_refusal();
    assert_eq!(refusals("postgres"), postgres + 2.0);
    assert_eq!(refusals("postgres_token"), token + 1.0);
    next.release().await.unwrap();
}

/// An advisory-mode backend with 1 s sessions, through `port`.
async fn advisory(port: u16) -> PostgresBackend {
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres?mode=advisory&session_ttl=1s");
    PostgresBackend::connect(&url).await.unwrap()
}

/// Advisory mode: a holder cut off from the server loses its session and its writes.
/// The server ends its session after the session ttl, the lock moves on, and the holder's
/// write is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_advisory_holder_cut_off_cannot_write_after_the_lock_moved_on() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    stock(&db).await;
    let target = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let proxy = Arc::new(FaultProxy::start(target).await.unwrap());
    let a = Client::new(advisory(proxy.port()).await);
    let b = Client::new(advisory(server.port()).await);

    let stale = a.mutex("stock").unwrap().lock().await.unwrap();
    assert_eq!(take_one(&db, &still_owner(&stale)).await, 1);
    let switch = ProxySwitch::new(proxy);
    switch.cut().await;
    stale.lost().await;
    let next = b
        .mutex("stock")
        .unwrap()
        .lock_timeout(Duration::from_secs(20))
        .await
        .unwrap()
        .expect("granted once the server ended the silent session");
    assert!(next.token() > stale.token());
    assert_eq!(
        take_one(&db, &still_owner(&stale)).await,
        0,
        "a stale write got in"
    );
    assert_eq!(take_one(&db, &still_owner(&next)).await, 1);
    switch.restore().await;
    next.release().await.unwrap();
}

/// Advisory mode: when the holder's session ends, the next grant waits for its fenced transaction.
/// That is when the session ends while a fenced transaction is open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_advisory_grant_waits_for_the_fenced_transaction() {
    let server = Postgres::start().await.unwrap();
    let mut db = database(&server.url()).await;
    let observer = database(&server.url()).await;
    stock(&db).await;
    let a = Client::new(advisory(server.port()).await);
    let b = Client::new(advisory(server.port()).await);

    let holder = a.mutex("stock").unwrap().lock().await.unwrap();
    let tx = db.transaction().await.unwrap();
    assert_eq!(take_one(&tx, &still_owner(&holder)).await, 1);
    observer
        .execute(
            "SELECT pg_terminate_backend(pid) FROM leasehold.advisory WHERE name = 'stock'",
            &[],
        )
        .await
        .unwrap();
    holder.lost().await;
    let mutex = b.mutex("stock").unwrap();
    let next = tokio::spawn(async move { mutex.lock().await });
    until(
        &observer,
        "SELECT count(*) = 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
    )
    .await;
    assert!(
        !next.is_finished(),
        "granted while the fenced transaction was open"
    );
    tx.commit().await.unwrap();
    let next = next.await.unwrap().unwrap();
    assert!(next.token() > holder.token());
    next.release().await.unwrap();
}

/// Version 4 of the schema keeps an advisory holder of version 3 holding, fenced and released once.
/// The holder's write still passes, the next grant has to wait for its release, and its
/// release answers that it held. A session records its own start whatever its DateStyle,
/// and again after its settings were reset (a pooler's RESET ALL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_advisory_holder_of_version_3_keeps_its_lock_across_version_4() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    old_schema(&db, 3).await;
    stock(&db).await;
    let holder = database(&server.url()).await;
    let token: i64 = holder
        .query_one(
            "SELECT old.advisory_acquire('stock', 'old-holder', false, false, 600000, NULL)",
            &[],
        )
        .await
        .unwrap()
        .get(0);

    let url = format!("{}?schema=old&mode=advisory&session_ttl=30s", server.url());
    let client = Client::new(PostgresBackend::connect(&url).await.unwrap());
    let version: i32 = db
        .query_one("SELECT max(version) FROM old.version", &[])
        .await
        .unwrap()
        .get(0);
    // Through version 4 to the latest (5, which keeps what 4 promised: see watching.rs).
    assert_eq!(version, 5);
    let fenced = "UPDATE stock SET left_ = left_ - 1 WHERE item = 'tea' AND old.holds($1, $2, $3)";
    let write = async |token: i64, owner: &str| -> u64 {
        db.execute(fenced, &[&"stock", &token, &owner])
            .await
            .unwrap()
    };
    assert_eq!(
        write(token, "old-holder").await,
        1,
        "the holder's write was refused"
    );
    let mutex = client.mutex("stock").unwrap();
    assert!(mutex.try_lock().await.unwrap().is_none(), "granted twice");

    let released = async |session: &tokio_postgres::Client| -> bool {
        session
            .query_one("SELECT old.advisory_release('stock', false)", &[])
            .await
            .unwrap()
            .get(0)
    };
    assert!(released(&holder).await);
    assert!(!released(&holder).await, "released twice");
    assert_eq!(
        write(token, "old-holder").await,
        0,
        "a released holder wrote"
    );
    let next = mutex
        .try_lock()
        .await
        .unwrap()
        .expect("free after the release");
    assert!(u64::from(next.token()) > token as u64);
    next.release().await.unwrap();

    // The holder's session under version 4, in a DateStyle and time zone whose output does
    // not read back the same: its row names its own start, which it keeps in a setting until
    // its settings are reset (a pooler's RESET ALL), and then reads again.
    let cached = "SELECT current_setting('leasehold.session_start', true)";
    let own_start = "SELECT a.started = s.backend_start FROM old.advisory a \
                     JOIN pg_stat_activity s ON s.pid = a.pid WHERE a.pid = pg_backend_pid()";
    for round in ["first", "after RESET ALL"] {
        holder
            .batch_execute("SET DateStyle = 'SQL, DMY'; SET TimeZone = 'Asia/Kolkata'")
            .await
            .unwrap();
        let token: i64 = holder
            .query_one(
                "SELECT old.advisory_acquire('stock', 'again', false, false, 600000, NULL)",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        let own: bool = holder.query_one(own_start, &[]).await.unwrap().get(0);
        assert!(own, "{round}: the row names another session's start");
        let kept: Option<String> = holder.query_one(cached, &[]).await.unwrap().get(0);
        assert!(kept.is_some_and(|k| !k.is_empty()), "{round}: not kept");
        assert_eq!(
            write(token, "again").await,
            1,
            "{round}: the write was refused"
        );
        assert!(released(&holder).await);
        holder.batch_execute("RESET ALL").await.unwrap();
        let kept: Option<String> = holder.query_one(cached, &[]).await.unwrap().get(0);
        assert!(kept.is_none_or(|k| k.is_empty()), "kept across RESET ALL");
    }
}

/// A token column on any table.
/// A write with a lower token than the row's is refused; the same token and newer ones go
/// in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_column_refuses_older_tokens() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    db.batch_execute(
        "CREATE SCHEMA shop; CREATE TABLE shop.accounts (id integer PRIMARY KEY, balance bigint);
         INSERT INTO shop.accounts VALUES (7, 0);",
    )
    .await
    .unwrap();
    let fence = TokenFence::default();
    fence.add_column(&db, "shop.accounts").await.unwrap();
    fence.add_column(&db, "shop.accounts").await.unwrap();
    assert!(fence.add_column(&db, "shop.accounts; DROP").await.is_err());
    let sql = format!(
        "UPDATE shop.accounts SET balance = $1, {} WHERE id = 7 AND {}",
        fence.assignment(2),
        fence.condition(2)
    );
    let write = async |balance: i64, token: u64| {
        db.execute(
            &sql,
            &[
                &balance,
                &token_param(leasehold_core::FencingToken::new(token)),
            ],
        )
        .await
        .unwrap()
    };
    assert_eq!(write(10, 5).await, 1);
    assert_eq!(write(11, 5).await, 1, "the same holder writes again");
    assert_eq!(write(99, 4).await, 0, "an older token got in");
    assert_eq!(write(12, 6).await, 1);
    let row = db
        .query_one("SELECT balance, fence_token FROM shop.accounts", &[])
        .await
        .unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (12, 6));
}

/// After an asynchronous failover the sequence may hand a token out again.
/// The grant that gets it does not let the earlier holder of the same token write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_handed_out_again_does_not_pass_for_the_other_grant() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    stock(&db).await;
    let faults = Faulty::wrap(Arc::new(
        PostgresBackend::connect(&server.url()).await.unwrap(),
    ));
    let a = Client::builder_from_arc(Arc::new(faults.clone()))
        .options(short_lease())
        .build();
    let b = Client::new(PostgresBackend::connect(&server.url()).await.unwrap());
    let stale = a.mutex("stock").unwrap().lock().await.unwrap();
    faults.hold_requests(Op::Renew);
    stale.lost().await;
    // The sequence goes back, as on a standby that had not received its last values.
    db.batch_execute(&format!(
        "ALTER SEQUENCE leasehold.tokens RESTART WITH {}",
        stale.token()
    ))
    .await
    .unwrap();
    let next = b
        .mutex("stock")
        .unwrap()
        .lock_timeout(Duration::from_secs(20))
        .await
        .unwrap()
        .expect("granted once the stale lease ran out");
    assert_eq!(next.token(), stale.token());
    assert_eq!(
        take_one(&db, &still_owner(&stale)).await,
        0,
        "a stale write got in"
    );
    assert_eq!(take_one(&db, &still_owner(&next)).await, 1);
    faults.resume(Op::Renew);
    next.release().await.unwrap();
}

/// A fenced writer paused with its transaction open for three leases (safety.md scenario 28).
/// Another client holding ten other names loses none of them; its try for the blocked name
/// answers busy, its sweep returns, and its waiting acquisition is granted once the
/// transaction has ended, with a later token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_fenced_writer_stalls_no_other_lock() {
    let server = Postgres::start().await.unwrap();
    let mut db = database(&server.url()).await;
    let observer = database(&server.url()).await;
    stock(&db).await;
    let faults = Faulty::wrap(Arc::new(
        PostgresBackend::connect(&server.url()).await.unwrap(),
    ));
    let a = Client::builder_from_arc(Arc::new(faults.clone()))
        .options(short_lease())
        .build();
    let ttl = Duration::from_secs(2);
    let backend = PostgresBackend::connect(&server.url()).await.unwrap();
    let b = Client::builder(backend.clone())
        .options(LockOptions::builder().ttl(ttl).build().unwrap())
        .build();
    let mut others = Vec::new();
    for i in 0..10 {
        let mutex = b.mutex(&format!("other-{i}")).unwrap();
        others.push(mutex.lock().await.unwrap());
    }

    let holder = a.mutex("stock").unwrap().lock().await.unwrap();
    let tx = db.transaction().await.unwrap();
    assert_eq!(take_one(&tx, &still_owner(&holder)).await, 1);
    // The writer stops (no renewal reaches the server) with its transaction open.
    faults.hold_requests(Op::Renew);
    holder.lost().await;
    until(
        &observer,
        "SELECT count(*) = 1 FROM leasehold.grants WHERE name = 'stock' \
         AND expires <= clock_timestamp()",
    )
    .await;
    let swept = tokio::time::timeout(ttl, backend.sweep()).await;
    assert!(
        matches!(swept, Ok(Ok(_))),
        "the sweep waited for the fenced transaction: {swept:?}"
    );
    let tried = b.mutex("stock").unwrap().try_lock().await;
    assert!(matches!(tried, Ok(None)), "{tried:?}");
    let mutex = b.mutex("stock").unwrap();
    let next = tokio::spawn(async move { mutex.lock().await });

    let any_lost = futures_util::future::select_all(others.iter().map(|g| Box::pin(g.lost())));
    let lost = tokio::time::timeout(ttl * 3, any_lost).await;
    assert!(
        lost.is_err(),
        "another lock was lost while the fenced writer was paused: {:?}",
        lost.map(|(reason, i, _)| (i, reason))
    );
    assert!(
        !next.is_finished(),
        "granted while the fenced transaction was open"
    );

    tx.commit().await.unwrap();
    let next = next.await.unwrap().unwrap();
    assert!(next.token() > holder.token());
    assert!(others.iter().all(|g| g.is_held()));
    faults.resume(Op::Renew);
    next.release().await.unwrap();
    for guard in others {
        guard.release().await.unwrap();
    }
}

/// Advisory mode: a new grant waits for a fenced transaction holding a holder it excludes.
/// A new grant replaces the rows of the holders it excludes, so it waits, even when the old
/// holder's server process id was given again to the new holder's session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_pid_does_not_let_the_next_advisory_grant_skip_a_fenced_transaction() {
    let server = Postgres::start().await.unwrap();
    let mut db = database(&server.url()).await;
    let observer = database(&server.url()).await;
    stock(&db).await;
    let a = Client::new(advisory(server.port()).await);
    let b = Client::new(advisory(server.port()).await);
    // B's next acquisition goes on the session of this one, back in B's idle set.
    let warm = b.mutex("warm").unwrap().lock().await.unwrap();
    let reused: i32 = observer
        .query_one(
            "SELECT pid FROM leasehold.advisory WHERE name = 'warm'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    warm.release().await.unwrap();

    let stale = a.mutex("stock").unwrap().lock().await.unwrap();
    let old: i32 = observer
        .query_one(
            "SELECT pid FROM leasehold.advisory WHERE name = 'stock'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    observer
        .execute("SELECT pg_terminate_backend($1)", &[&old])
        .await
        .unwrap();
    stale.lost().await;
    until(
        &observer,
        &format!("SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = {old})"),
    )
    .await;
    // The ended session's row, as if its process id had been B's: the operating system
    // hands ids out again.
    observer
        .execute(
            "UPDATE leasehold.advisory SET pid = $1 WHERE name = 'stock'",
            &[&reused],
        )
        .await
        .unwrap();
    // A fenced write of the old holder still open: the lock `holds` took on its row.
    let tx = db.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM leasehold.advisory WHERE name = 'stock' FOR KEY SHARE",
        &[],
    )
    .await
    .unwrap();

    let mutex = b.mutex("stock").unwrap();
    let mut next = tokio::spawn(async move { mutex.lock().await });
    let waiting = until(
        &observer,
        "SELECT count(*) = 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
    );
    tokio::select! {
        () = waiting => {}
        granted = &mut next => panic!("granted while the fenced transaction was open: {granted:?}"),
    }
    tx.commit().await.unwrap();
    let next = next.await.unwrap().unwrap();
    assert!(next.token() > stale.token());
    next.release().await.unwrap();
}

/// `still_owner` refuses REPEATABLE READ and SERIALIZABLE transactions.
/// In one it would judge the lease by the snapshot, which hides the renewals committed
/// after it: a current holder's write would be refused. It goes in, or the condition
/// refuses the isolation level with 0A000 saying why; never a silent refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn still_owner_under_snapshot_isolation_is_not_a_silent_refusal() {
    use tokio_postgres::IsolationLevel;
    let server = Postgres::start().await.unwrap();
    let mut db = database(&server.url()).await;
    let observer = database(&server.url()).await;
    stock(&db).await;
    let b = Client::builder(PostgresBackend::connect(&server.url()).await.unwrap())
        .options(short_lease())
        .build();
    let guard = b.mutex("stock").unwrap().lock().await.unwrap();
    let fence = still_owner(&guard);
    for level in [IsolationLevel::RepeatableRead, IsolationLevel::Serializable] {
        let tx = db
            .build_transaction()
            .isolation_level(level)
            .start()
            .await
            .unwrap();
        // The snapshot is taken here.
        let seen: std::time::SystemTime = tx
            .query_one(
                "SELECT expires FROM leasehold.grants WHERE name = 'stock'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        // The lease as the snapshot shows it runs out; renewals keep the real one going.
        tokio::time::timeout(Duration::from_secs(30), async {
            while !observer
                .query_one("SELECT clock_timestamp() > $1", &[&seen])
                .await
                .unwrap()
                .get::<_, bool>(0)
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .unwrap();
        assert!(guard.is_held());
        let sql = format!(
            "UPDATE stock SET left_ = left_ - 1 WHERE item = 'tea' AND {}",
            fence.condition(1)
        );
        match tx
            .execute(&sql, &[&fence.name(), &fence.token(), &fence.owner()])
            .await
        {
            Ok(changed) => assert_eq!(changed, 1, "{level:?}: the holder's write was refused"),
            Err(e) => {
                let db_error = e.as_db_error().expect("a server error");
                assert_eq!(db_error.code().code(), "0A000", "{level:?}: {e}");
                assert!(db_error.message().contains("READ COMMITTED"), "{e}");
            }
        }
        tx.rollback().await.unwrap();
        // The check on its own: an error, never a refusal.
        let tx = db
            .build_transaction()
            .isolation_level(level)
            .start()
            .await
            .unwrap();
        match fence.verify(&tx).await {
            Err(leasehold_core::Error::Backend { message, .. }) if message.contains("0A000") => {}
            other => panic!("{level:?}: verify answered {other:?}"),
        }
        tx.rollback().await.unwrap();
    }
    guard.release().await.unwrap();
}

/// A table of one row that counts the writes it accepted, with a token column.
async fn ledger(db: &tokio_postgres::Client) -> TokenFence {
    db.batch_execute(
        "CREATE TABLE ledger (id integer PRIMARY KEY, writes integer NOT NULL);
         INSERT INTO ledger VALUES (1, 0);",
    )
    .await
    .unwrap();
    let fence = TokenFence::default();
    fence.add_column(db, "ledger").await.unwrap();
    fence
}

/// Counts one write if `owner` still holds and no newer token wrote the row: rows changed.
/// Both fences at once: `still_owner` and the token column.
async fn fenced_write(
    db: &impl tokio_postgres::GenericClient,
    column: &TokenFence,
    owner: &StillOwner,
) -> u64 {
    let sql = format!(
        "UPDATE ledger SET writes = writes + 1, {} WHERE id = 1 AND {} AND {}",
        column.assignment(4),
        column.condition(4),
        owner.condition(1)
    );
    db.execute(
        &sql,
        &[
            &owner.name(),
            &owner.token(),
            &owner.owner(),
            &owner.token(),
        ],
    )
    .await
    .unwrap()
}

/// Counts one write with only the token column's check.
async fn token_only_write(db: &tokio_postgres::Client, column: &TokenFence, token: i64) -> u64 {
    let sql = format!(
        "UPDATE ledger SET writes = writes + 1, {} WHERE id = 1 AND {}",
        column.assignment(1),
        column.condition(1)
    );
    db.execute(&sql, &[&token]).await.unwrap()
}

fn lease_of(ttl: Duration) -> LockOptions {
    LockOptions::builder().ttl(ttl).build().unwrap()
}

/// A holder evicted while it keeps writing has every write begun after the eviction refused.
/// It writes through `still_owner` and the token column; its guard then reports
/// `LossReason::Evicted`, and the next holder, with a greater token, writes. The evicted
/// token alone is refused by the token column only once the next holder has written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_holder_that_keeps_writing_has_every_later_write_refused() {
    let server = Postgres::start().await.unwrap();
    let db = Arc::new(database(&server.url()).await);
    let column = ledger(&db).await;
    let a = Client::builder(PostgresBackend::connect(&server.url()).await.unwrap())
        .options(lease_of(Duration::from_secs(3)))
        .build();
    let operator = Client::new(PostgresBackend::connect(&server.url()).await.unwrap());
    let guard = a.mutex("ledger").unwrap().lock().await.unwrap();

    let evicted = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    // (write began after the eviction had returned, rows it changed), in order.
    let (written, mut seen) = watch::channel(Vec::<(bool, u64)>::new());
    let writer = {
        let (db, column, owner) = (db.clone(), column.clone(), still_owner(&guard));
        let (evicted, stop) = (evicted.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let after = evicted.load(Ordering::SeqCst);
                let changed = fenced_write(&*db, &column, &owner).await;
                written.send_modify(|w| w.push((after, changed)));
            }
        })
    };
    // The holder's writes go in while it holds.
    seen.wait_for(|w| w.iter().any(|(_, changed)| *changed == 1))
        .await
        .unwrap();

    let records = operator
        .evict("ledger", None, "ops@host", "stuck writer")
        .await
        .unwrap();
    evicted.store(true, Ordering::SeqCst);
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(
        (&records[0].owner, records[0].token),
        (guard.owner(), guard.token())
    );
    assert_eq!(guard.lost().await, LossReason::Evicted);
    assert!(!guard.is_held());
    // Writes that began after the eviction, some of them after the guard knew.
    seen.wait_for(|w| w.iter().filter(|(after, _)| *after).count() >= 20)
        .await
        .unwrap();
    stop.store(true, Ordering::SeqCst);
    writer.await.unwrap();
    let writes = seen.borrow().clone();
    let refused_after: Vec<u64> = writes
        .iter()
        .filter(|(after, _)| *after)
        .map(|(_, changed)| *changed)
        .collect();
    assert!(
        refused_after.iter().all(|changed| *changed == 0),
        "a write after the eviction got in: {refused_after:?}"
    );
    let accepted: u64 = writes.iter().map(|(_, changed)| changed).sum();
    let count = |db: Arc<tokio_postgres::Client>| async move {
        let row = db
            .query_one("SELECT writes, fence_token FROM ledger", &[])
            .await
            .unwrap();
        (row.get::<_, i32>(0), row.get::<_, i64>(1))
    };
    assert_eq!(
        count(db.clone()).await,
        (i32::try_from(accepted).unwrap(), token_param(guard.token()))
    );

    // Granted once the evicted lease would have ended; a greater token, which writes.
    let next = operator.mutex("ledger").unwrap().lock().await.unwrap();
    assert!(next.token() > guard.token());
    assert_eq!(fenced_write(&*db, &column, &still_owner(&next)).await, 1);
    assert_eq!(
        fenced_write(&*db, &column, &still_owner(&guard)).await,
        0,
        "the evicted holder wrote next to the new one"
    );
    assert_eq!(
        token_only_write(&db, &column, token_param(guard.token())).await,
        0,
        "the token column let the evicted token in after a newer one"
    );
    assert_eq!(
        count(db.clone()).await,
        (
            i32::try_from(accepted + 1).unwrap(),
            token_param(next.token())
        )
    );
    // The evicted guard's release removes nothing of the new holder's.
    let _ = guard.release().await;
    assert!(next.is_held());
    next.release().await.unwrap();
}

/// An eviction does not wait for a fenced transaction that holds the grant's row.
/// It cuts the lease short: the open transaction's next write and any other are refused,
/// the write it made before commits, the name stays closed while the evicted guard may
/// still think it holds, and the guard learns it was evicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_cuts_short_a_grant_an_open_fenced_transaction_holds() {
    let server = Postgres::start().await.unwrap();
    let mut db = database(&server.url()).await;
    let other = database(&server.url()).await;
    let column = ledger(&db).await;
    let a = Client::builder(PostgresBackend::connect(&server.url()).await.unwrap())
        .options(lease_of(Duration::from_secs(3)))
        .build();
    let operator = Client::new(PostgresBackend::connect(&server.url()).await.unwrap());
    let guard = a.mutex("ledger").unwrap().lock().await.unwrap();
    let owner = still_owner(&guard);

    let tx = db.transaction().await.unwrap();
    assert_eq!(fenced_write(&tx, &column, &owner).await, 1);
    let evict = operator.evict("ledger", None, "ops@host", "stuck in a transaction");
    let records = tokio::time::timeout(Duration::from_secs(20), evict).await;
    let records = records
        .expect("the eviction waited for the fenced transaction")
        .unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    // The row the transaction holds is kept, its lease ended.
    let cut: bool = other
        .query_one(
            "SELECT count(*) = 1 FROM leasehold.grants WHERE name = 'ledger' \
             AND expires <= clock_timestamp()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        cut,
        "the evicted grant's row is not the one kept, cut short"
    );
    assert_eq!(fenced_write(&tx, &column, &owner).await, 0);
    assert_eq!(fenced_write(&other, &column, &owner).await, 0);
    tx.commit().await.unwrap();
    assert!(try_lock(&operator).await.is_none() || !guard.is_held());

    assert_eq!(guard.lost().await, LossReason::Evicted);
    let next = operator.mutex("ledger").unwrap().lock().await.unwrap();
    assert!(next.token() > guard.token());
    assert_eq!(fenced_write(&other, &column, &still_owner(&next)).await, 1);
    let writes: i32 = other
        .query_one("SELECT writes FROM ledger", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        writes, 2,
        "the write before the eviction, then the next holder's"
    );
    let state = operator.inspect("ledger").await.unwrap();
    assert_eq!(state.evictions.len(), 1, "{:?}", state.evictions);
    assert_eq!(state.evictions[0].reason, "stuck in a transaction");
    next.release().await.unwrap();
}

async fn try_lock(client: &Client) -> Option<leasehold_core::Guard> {
    client.mutex("ledger").unwrap().try_lock().await.unwrap()
}
