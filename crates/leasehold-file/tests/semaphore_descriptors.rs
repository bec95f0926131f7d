//! A semaphore of 100,000 permits with 100 waiters, under a low descriptor limit.
//! A test binary of its own: it lowers `RLIMIT_NOFILE` for the whole process.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use leasehold_core::{Client, LockName};
use leasehold_file::FileBackend;
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

const PERMITS: u32 = 100_000;
const WAITERS: usize = 100;
const DESCRIPTORS: u64 = 256;

fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_000_permit_semaphore_with_100_waiters_under_a_low_descriptor_limit() {
    let limit = getrlimit(Resource::Nofile);
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(DESCRIPTORS),
            maximum: limit.maximum,
        },
    )
    .unwrap();
    // On a memory file system where there is one: 100,000 grants fsync the counter.
    let dir = match Path::new("/dev/shm") {
        shm if shm.is_dir() => tempfile::tempdir_in(shm).unwrap(),
        _ => tempfile::tempdir().unwrap(),
    };
    // Separate instances exclude each other through the kernel, as processes do.
    let filler = Client::new(FileBackend::open(dir.path()).unwrap());
    let waiters = Client::new(FileBackend::open(dir.path()).unwrap());
    let latecomer = Client::new(FileBackend::open(dir.path()).unwrap());
    let descriptors = open_descriptors();

    // Fill the semaphore from one client.
    let semaphore = filler.semaphore("pool", PERMITS).unwrap();
    let mut held = Vec::with_capacity(PERMITS as usize);
    for _ in 0..PERMITS {
        held.push(semaphore.acquire().await.unwrap());
    }
    assert!(
        open_descriptors() <= descriptors + 4,
        "descriptors per permit"
    );
    let filler_holds = Arc::new(AtomicUsize::new(held.len()));
    let waiter_holds = Arc::new(AtomicUsize::new(0));

    // 100 waiters on another client; each checks, when granted, that no more than PERMITS
    // permits are held.
    let mut tasks = Vec::new();
    for _ in 0..WAITERS {
        let semaphore = waiters.semaphore("pool", PERMITS).unwrap();
        let (filler_holds, waiter_holds) = (filler_holds.clone(), waiter_holds.clone());
        tasks.push(tokio::spawn(async move {
            let permit = semaphore.acquire().await.unwrap();
            let holders = waiter_holds.fetch_add(1, Ordering::SeqCst)
                + 1
                + filler_holds.load(Ordering::SeqCst);
            assert!(holders <= PERMITS as usize, "{holders} permits held");
            permit
        }));
    }
    // All 100 are queued (their waiter records are written) before any permit is freed.
    let name = LockName::new("pool").unwrap();
    loop {
        let state = latecomer.backend().inspect(&name).await.unwrap();
        assert!(state.holders.len() <= PERMITS as usize);
        if state.waiters.len() == WAITERS {
            break;
        }
        latecomer
            .backend()
            .wait(&name, &state.hint, Duration::from_secs(1))
            .await
            .unwrap();
    }
    let latecomers_pool = latecomer.semaphore("pool", PERMITS).unwrap();
    assert!(latecomers_pool.try_acquire().await.unwrap().is_none());
    assert!(
        open_descriptors() <= descriptors + 8,
        "descriptors per waiter"
    );

    // Free 100 permits; each goes to one waiter.
    for permit in held.drain(..WAITERS) {
        // Counted out before the release, so a grant that overtook it would show.
        filler_holds.fetch_sub(1, Ordering::SeqCst);
        permit.release().await.unwrap();
    }
    let mut granted = Vec::new();
    for task in tasks {
        granted.push(task.await.unwrap());
    }
    assert_eq!(waiter_holds.load(Ordering::SeqCst), WAITERS);
    assert!(
        latecomers_pool.try_acquire().await.unwrap().is_none(),
        "a permit more than the limit"
    );

    // Everything released: no file but the fencing counter left, descriptors as before.
    for permit in held.into_iter().chain(granted) {
        permit.release().await.unwrap();
    }
    filler.settle().await;
    waiters.settle().await;
    latecomer.settle().await;
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        left.len() <= 1,
        "{} files left behind, e.g. {:?}",
        left.len(),
        &left[..left.len().min(5)]
    );
    assert_eq!(open_descriptors(), descriptors);
}
