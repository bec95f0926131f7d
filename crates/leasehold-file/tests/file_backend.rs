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

/// The file names in the lock directory `dir`, or in a name's notes directory.
fn files_in(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Records beside a lock are not locks, and they leave after their expiry.
/// Listing and inspection do not show them; they outlive the grant that wrote them until
/// their expiry, and then they and their directory are swept.
#[tokio::test]
async fn records_are_not_locks_and_leave_after_their_expiry() {
    use leasehold_core::backend::Backend;
    use leasehold_core::{LockName, NamePrefix, RecordKey};

    let dir = tempfile::tempdir().unwrap();
    let c = client(dir.path());
    let name = LockName::new("jobs:nightly").unwrap();
    let (kept, expired) = (
        RecordKey::new("window:2").unwrap(),
        RecordKey::new("window:1").unwrap(),
    );
    let guard = c.mutex("jobs:nightly").unwrap().lock().await.unwrap();
    let keep = Duration::from_secs(600);
    // Kept for no time: expired as soon as it is written.
    assert!(
        guard
            .put_record(&expired, b"one", Duration::ZERO)
            .await
            .unwrap()
    );
    assert!(guard.put_record(&kept, b"two", keep).await.unwrap());
    // Writing the second swept the first.
    let notes = dir.path().join("jobs:nightly#notes");
    assert_eq!(files_in(&notes), ["window:2"]);
    guard.release().await.unwrap();

    let backend = c.backend();
    let jobs = NamePrefix::new("jobs").unwrap();
    let listing = backend.list(&jobs, None, 10).await.unwrap();
    assert!(listing.locks.is_empty(), "{:?}", listing.locks);
    let state = backend.inspect(&name).await.unwrap();
    assert!(state.holders.is_empty() && state.waiters.is_empty());
    assert_eq!(
        backend.get_record(&name, &kept).await.unwrap().as_deref(),
        Some(&b"two"[..])
    );
    assert_eq!(backend.get_record(&name, &expired).await.unwrap(), None);
    // The lock's files are gone; the record within its keep is not.
    assert_eq!(files_in(dir.path()), ["#tokens", "jobs:nightly#notes"]);

    // Replaced by one that expires at once: the next listing sweeps it and its directory.
    let guard = c.mutex("jobs:nightly").unwrap().lock().await.unwrap();
    assert!(
        guard
            .put_record(&kept, b"three", Duration::ZERO)
            .await
            .unwrap()
    );
    guard.release().await.unwrap();
    assert_eq!(backend.get_record(&name, &kept).await.unwrap(), None);
    let listing = backend.list(&jobs, None, 10).await.unwrap();
    assert!(listing.locks.is_empty(), "{:?}", listing.locks);
    assert_eq!(files_in(dir.path()), ["#tokens"]);
}

/// A record is written only through a grant this process holds in the request's mode.
/// A refused write leaves no directory behind.
#[tokio::test]
async fn a_record_needs_the_writers_grant_in_its_mode() {
    use leasehold_core::backend::{Acquire, Backend, Mode, Request};
    use leasehold_core::{LockName, OwnerId, RecordKey};

    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::open(dir.path()).unwrap();
    let name = LockName::new("report").unwrap();
    let key = RecordKey::new("done").unwrap();
    let keep = Duration::from_secs(60);
    let owner = OwnerId::generate();
    let shared = Request::new(name.clone(), owner.clone(), Mode::Shared, keep);
    let exclusive = Request::new(name.clone(), owner, Mode::Exclusive, keep);
    assert!(matches!(
        backend.acquire(&shared).await.unwrap(),
        Acquire::Granted(_)
    ));
    assert!(
        !backend
            .put_record(&exclusive, &key, b"x", keep)
            .await
            .unwrap()
    );
    let other_name = Request::new(
        LockName::new("other").unwrap(),
        shared.owner.clone(),
        Mode::Shared,
        keep,
    );
    assert!(
        !backend
            .put_record(&other_name, &key, b"x", keep)
            .await
            .unwrap()
    );
    assert_eq!(backend.get_record(&name, &key).await.unwrap(), None);
    assert!(!dir.path().join("report#notes").exists());
    assert!(!dir.path().join("other#notes").exists());
    assert!(backend.put_record(&shared, &key, b"x", keep).await.unwrap());
    backend.release(&shared).await.unwrap();
    assert!(!backend.put_record(&shared, &key, b"y", keep).await.unwrap());
    assert_eq!(
        backend.get_record(&name, &key).await.unwrap().as_deref(),
        Some(&b"x"[..])
    );
}

/// A lock name and a record key of the longest lengths still make a record.
#[tokio::test]
async fn a_record_of_the_longest_name_and_key_is_written() {
    use leasehold_core::{LockName, RecordKey};

    let dir = tempfile::tempdir().unwrap();
    let c = client(dir.path());
    let long = "n".repeat(LockName::MAX_LEN);
    let key = RecordKey::new(&"k".repeat(RecordKey::MAX_LEN)).unwrap();
    let value = vec![b'\n'; leasehold_core::backend::MAX_RECORD_LEN];
    let guard = c.mutex(&long).unwrap().lock().await.unwrap();
    assert!(
        guard
            .put_record(&key, &value, Duration::from_secs(60))
            .await
            .unwrap()
    );
    guard.release().await.unwrap();
    let read = c
        .backend()
        .get_record(&LockName::new(&long).unwrap(), &key)
        .await
        .unwrap();
    assert_eq!(read, Some(value));
}

/// A file under a record's name that is not a record is an error, never a value.
/// It is left alone; a temporary file left by a writer that died is swept by the next
/// writer.
#[tokio::test]
async fn a_foreign_file_under_a_records_name_is_reported() {
    use leasehold_core::{LockName, RecordKey};

    let dir = tempfile::tempdir().unwrap();
    let c = client(dir.path());
    let notes = dir.path().join("job#notes");
    std::fs::create_dir(&notes).unwrap();
    std::fs::write(notes.join("window:1"), b"not a record").unwrap();
    std::fs::write(notes.join("window:2#tmp"), b"expires_ms=9").unwrap();
    let (name, key) = (
        LockName::new("job").unwrap(),
        RecordKey::new("window:1").unwrap(),
    );
    let err = c.backend().get_record(&name, &key).await.unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err}");
    assert!(err.to_string().contains("not a record"), "{err}");
    let guard = c.mutex("job").unwrap().lock().await.unwrap();
    let other = RecordKey::new("window:3").unwrap();
    assert!(
        guard
            .put_record(&other, b"ok", Duration::from_secs(60))
            .await
            .unwrap()
    );
    guard.release().await.unwrap();
    assert_eq!(files_in(&notes), ["window:1", "window:3"]);
}

/// Keeping a grant after its holder lets go is refused, and the lock is released instead.
#[tokio::test]
async fn keeping_a_grant_is_unsupported_and_releases_it() {
    let dir = tempfile::tempdir().unwrap();
    let c = client(dir.path());
    let guard = c.mutex("job").unwrap().lock().await.unwrap();
    let err = guard.keep_for(Duration::from_secs(5)).await.unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    assert!(err.to_string().contains("file backend"), "{err}");
    c.settle().await;
    assert!(c.mutex("job").unwrap().try_lock().await.unwrap().is_some());
}

/// Sweeps beside writers never take a record within its keep, nor fail a write.
/// A sweep that removes an emptied directory under a writer makes it write anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweeps_beside_writers_keep_what_is_kept() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use leasehold_core::backend::Backend;
    use leasehold_core::{LockName, NamePrefix, RecordKey};

    let dir = tempfile::tempdir().unwrap();
    let writer = client(dir.path());
    let sweeper = FileBackend::open(dir.path()).unwrap();
    let (kept, gone) = (
        LockName::new("jobs:kept").unwrap(),
        LockName::new("jobs:gone").unwrap(),
    );
    let key = RecordKey::new("window").unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let sweeps = tokio::spawn({
        let (done, kept, gone, key) = (done.clone(), kept.clone(), gone.clone(), key.clone());
        async move {
            let jobs = NamePrefix::new("jobs").unwrap();
            let mut seen = false;
            while !done.load(Ordering::Relaxed) {
                sweeper.list(&jobs, None, 10).await.unwrap();
                sweeper.get_record(&gone, &key).await.unwrap();
                let read = sweeper.get_record(&kept, &key).await.unwrap();
                // Once written, the kept record is always there.
                assert!(read.is_some() || !seen, "a kept record was swept");
                seen |= read.is_some();
                tokio::task::yield_now().await;
            }
        }
    });
    for i in 0..300 {
        let value = format!("{i}");
        let guard = writer.mutex(kept.as_str()).unwrap().lock().await.unwrap();
        let keep = Duration::from_secs(600);
        assert!(
            guard
                .put_record(&key, value.as_bytes(), keep)
                .await
                .unwrap()
        );
        guard.release().await.unwrap();
        let guard = writer.mutex(gone.as_str()).unwrap().lock().await.unwrap();
        assert!(guard.put_record(&key, b"x", Duration::ZERO).await.unwrap());
        guard.release().await.unwrap();
    }
    done.store(true, Ordering::Relaxed);
    sweeps.await.unwrap();
    let read = writer.backend().get_record(&kept, &key).await.unwrap();
    assert_eq!(read.as_deref(), Some(&b"299"[..]));
}
