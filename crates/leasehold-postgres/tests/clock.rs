//! Lease mode counts leases on the server's wall clock.
//! What a jump of that clock does, with the server under libfaketime:
//!
//! - forward past a lease: the server takes the lease for expired and grants the lock to
//!   another client while the holder's own (monotonic) deadline has not come. This is the
//!   documented unsafe case of lease mode; the holder's next renewal reports the loss, its
//!   fenced writes are refused, and tokens still increase.
//! - backward: leases last longer on the server than the holder counted on; a holder that
//!   died keeps its lock from others for the length of the jump (never less safe).

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use leasehold_core::{Client, LockOptions, LossReason};
use leasehold_postgres::tokio_postgres;
use leasehold_postgres::{PostgresBackend, still_owner};
use leasehold_testkit::Postgres;
use leasehold_testkit::faulty::{Faulty, Op};

mod common;
use common::database;

/// Moves the server's wall clock `offset` seconds from the real one.
/// It waits until the server reads it.
async fn set_clock(control: &Path, db: &tokio_postgres::Client, offset: i64) {
    std::fs::write(control, format!("{offset:+}\n")).unwrap();
    let arrived = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let server: f64 = db
                .query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[])
                .await
                .unwrap()
                .get(0);
            let real = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_secs_f64();
            if (server - real - offset as f64).abs() < 5.0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        arrived.is_ok(),
        "the server's clock did not move by {offset} s"
    );
}

fn lease(ttl: Duration) -> LockOptions {
    LockOptions::builder().ttl(ttl).build().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_clock_jump_forward_ends_leases_early_and_fencing_catches_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let control = dir.path().join("faketime");
    std::fs::write(&control, "+0\n").unwrap();
    let server = Postgres::builder()
        .faketime(&control)
        .start()
        .await
        .unwrap();
    let db = database(&server.url()).await;
    db.batch_execute("CREATE TABLE data (v integer); INSERT INTO data VALUES (0)")
        .await
        .unwrap();
    let a = Client::builder(PostgresBackend::connect(&server.url()).await.unwrap())
        .options(lease(Duration::from_secs(6)))
        .build();
    let b = Client::new(PostgresBackend::connect(&server.url()).await.unwrap());
    let holder = a.mutex("job").unwrap().lock().await.unwrap();

    set_clock(&control, &db, 120).await;
    // The holder still counts on its lease; the server gives the lock away.
    assert!(holder.is_held());
    let other = b
        .mutex("job")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .expect("the server took the lease for expired");
    assert!(other.token() > holder.token());
    // Fencing keeps the overlap out of the data.
    let fence = still_owner(&holder);
    let write = format!("UPDATE data SET v = v + 1 WHERE {}", fence.condition(1));
    let changed = db
        .execute(&write, &[&fence.name(), &fence.token(), &fence.owner()])
        .await
        .unwrap();
    assert_eq!(changed, 0, "the superseded holder's write got in");
    // Its next renewal tells the holder.
    assert_eq!(holder.lost().await, LossReason::NotOwner);
    other.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_clock_jump_backward_keeps_a_dead_holders_lock_longer() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let control = dir.path().join("faketime");
    std::fs::write(&control, "+0\n").unwrap();
    let server = Postgres::builder()
        .faketime(&control)
        .start()
        .await
        .unwrap();
    let db = database(&server.url()).await;
    let faults = Faulty::wrap(Arc::new(
        PostgresBackend::connect(&server.url()).await.unwrap(),
    ));
    let a = Client::builder_from_arc(Arc::new(faults.clone()))
        .options(lease(Duration::from_secs(1)))
        .build();
    let b = Client::new(PostgresBackend::connect(&server.url()).await.unwrap());
    let dead = a.mutex("job").unwrap().lock().await.unwrap();
    // The holder dies (renews no more), and the server's clock goes back two minutes.
    faults.hold_requests(Op::Renew);
    set_clock(&control, &db, -120).await;
    dead.lost().await;
    // Its 1 s lease has long run out by the holder's count, not by the server's.
    assert!(b.mutex("job").unwrap().try_lock().await.unwrap().is_none());
    let left: f64 = db
        .query_one(
            "SELECT extract(epoch FROM expires - clock_timestamp())::float8 \
             FROM leasehold.grants WHERE name = 'job'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(left > 60.0, "{left} s left on the server");
    faults.resume(Op::Renew);
}
