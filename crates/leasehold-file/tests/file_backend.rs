//! What only the file backend promises.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::time::Duration;

use leasehold_core::{Client, Error, LockOptions};
use leasehold_file::FileBackend;

fn client(dir: &std::path::Path) -> Client {
    Client::new(FileBackend::open(dir).unwrap())
}

#[tokio::test]
async fn tokens_continue_from_disk_in_a_new_backend() {
    let dir = tempfile::tempdir().unwrap();
    let first = {
        let c = client(dir.path());
        let g = c.mutex("job").unwrap().lock().await.unwrap();
        let t = g.token();
        g.release().await.unwrap();
        t
    };
    // As a restarted process would: a fresh backend on the same directory.
    let c = client(dir.path());
    let g = c.mutex("job").unwrap().lock().await.unwrap();
    assert!(g.token() > first);
}

#[tokio::test]
async fn a_corrupt_counter_is_an_error_not_a_guess() {
    let dir = tempfile::tempdir().unwrap();
    let c = client(dir.path());
    c.mutex("job")
        .unwrap()
        .lock()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let counters = dir.path().join("#tokens");
    let good = std::fs::read(&counters).unwrap();
    std::fs::write(&counters, &good[..good.len() - 3]).unwrap();
    let err = c.mutex("job").unwrap().try_lock().await.unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err}");
    assert!(err.to_string().contains("refusing to guess"), "{err}");
    // And the lock was not left taken by the failed attempt.
    std::fs::write(&counters, &good).unwrap();
    assert!(c.mutex("job").unwrap().try_lock().await.unwrap().is_some());
}

#[tokio::test]
async fn tokens_continue_above_the_per_name_counters_of_earlier_versions() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("job#token"), 41u64.to_le_bytes()).unwrap();
    std::fs::write(dir.path().join("other#token"), 7u64.to_le_bytes()).unwrap();
    let c = client(dir.path());
    let g = c.mutex("job").unwrap().lock().await.unwrap();
    assert!(g.token().get() > 41, "{}", g.token());
    g.release().await.unwrap();
    assert!(!dir.path().join("job#token").exists());
    std::fs::write(dir.path().join("bad#token"), b"garbage").unwrap();
    std::fs::remove_file(dir.path().join("#tokens")).unwrap();
    let err = c.mutex("bad").unwrap().try_lock().await.unwrap_err();
    assert!(err.to_string().contains("refusing to guess"), "{err}");
}

#[tokio::test]
async fn a_waiter_is_woken_by_the_release_not_by_its_poll_interval() {
    let dir = tempfile::tempdir().unwrap();
    // A waiter re-checks on its own only every ttl / 3 = 100 s; only a push wake-up can
    // get it the lock within 5 s.
    let options = LockOptions::builder()
        .ttl(Duration::from_secs(300))
        .build()
        .unwrap();
    let holder = client(dir.path());
    let waiter = Client::builder(FileBackend::open(dir.path()).unwrap())
        .options(options)
        .build();
    let guard = holder.mutex("job").unwrap().lock().await.unwrap();
    let mutex = waiter.mutex("job").unwrap();
    let waiting =
        tokio::spawn(
            async move { tokio::time::timeout(Duration::from_secs(5), mutex.lock()).await },
        );
    // Give the waiter its first busy answer before releasing, through the holder record it
    // writes while it waits.
    let mut observed = holder.inspect("job").await.unwrap();
    while observed.waiters.is_empty() {
        holder
            .backend()
            .wait(
                &leasehold_core::LockName::new("job").unwrap(),
                &observed.hint,
                Duration::from_secs(5),
            )
            .await
            .unwrap();
        observed = holder.inspect("job").await.unwrap();
    }
    guard.release().await.unwrap();
    let got = waiting.await.unwrap();
    assert!(got.is_ok(), "the waiter was not woken by the release");
}

#[tokio::test]
async fn a_directory_that_is_a_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, b"").unwrap();
    assert!(matches!(
        FileBackend::open(&file),
        Err(Error::Unavailable { .. } | Error::Backend { .. })
    ));
}

/// An inspection while a waiter tries again leaves the waiter's record alone.
/// It must not take the waiter for the leftover of a gone acquisition: later inspections
/// still list it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspecting_while_a_waiter_tries_again_keeps_its_record() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use leasehold_core::backend::{Acquire, Backend, Mode, Request};
    use leasehold_core::{LockName, OwnerId};

    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::open(dir.path()).unwrap();
    let name = LockName::new("job").unwrap();
    let request = |waiting| {
        let ttl = Duration::from_secs(30);
        let mut req = Request::new(name.clone(), OwnerId::generate(), Mode::Exclusive, ttl);
        req.waiting = waiting;
        req
    };
    let holder = request(false);
    let waiter = request(true);
    assert!(matches!(
        backend.acquire(&holder).await.unwrap(),
        Acquire::Granted(_)
    ));
    assert!(matches!(
        backend.acquire(&waiter).await.unwrap(),
        Acquire::Busy(_)
    ));
    // Inspections on a worker thread while this thread's waiter tries again and again.
    let inspections = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let inspector = tokio::spawn({
        let (backend, name) = (backend.clone(), name.clone());
        let (inspections, done) = (inspections.clone(), done.clone());
        async move {
            while !done.load(Ordering::Relaxed) {
                backend.inspect(&name).await.unwrap();
                inspections.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    while inspections.load(Ordering::Relaxed) < 1000 {
        assert!(matches!(
            backend.acquire(&waiter).await.unwrap(),
            Acquire::Busy(_)
        ));
    }
    done.store(true, Ordering::Relaxed);
    inspector.await.unwrap();
    let state = backend.inspect(&name).await.unwrap();
    assert_eq!(state.holders.len(), 1);
    assert_eq!(state.waiters.len(), 1, "the waiter's record was deleted");
    backend.release(&waiter).await.unwrap();
    backend.release(&holder).await.unwrap();
}
