//! One name, one lock, across languages.
//! leasehold's exclusive lock and a real Apache Curator process's `InterProcessMutex` on
//! the same path exclude each other, in one FIFO queue, in both directions.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::time::{Duration, Instant};

use leasehold_core::{Client, LockOptions};
use leasehold_testkit::{Curator, ZooKeeper};
use leasehold_zookeeper::ZooKeeperBackend;
use zookeeper_client as zk;

async fn client(zookeeper: &ZooKeeper) -> Client {
    let backend = ZooKeeperBackend::connect(&zookeeper.url()).await.unwrap();
    let options = LockOptions::builder()
        .request_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    Client::builder(backend).options(options).build()
}

async fn queued(raw: &zk::Client, dir: &str, n: usize) {
    let started = Instant::now();
    loop {
        let children = match raw.list_children(dir).await {
            Ok(children) => children,
            Err(zk::Error::NoNode) => Vec::new(),
            Err(e) => panic!("listing {dir}: {e}"),
        };
        if children.len() == n {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "{children:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leasehold_and_curator_share_one_queue_in_both_directions() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let raw = zk::Client::connect(&zookeeper.connect_string())
        .await
        .unwrap();
    let mut curator = Curator::start(&zookeeper.connect_string(), Duration::from_secs(10))
        .await
        .unwrap();
    let (a, b) = (client(&zookeeper).await, client(&zookeeper).await);
    let path = "/leasehold/interop";

    // leasehold holds: Curator is refused, then queues; a leasehold waiter queues behind it.
    let first = a.mutex("interop").unwrap().lock().await.unwrap();
    assert!(
        !curator
            .try_lock(path, Duration::from_millis(300))
            .await
            .unwrap()
    );
    queued(&raw, path, 1).await;
    let curator_waits = tokio::spawn(async move {
        curator.lock(path).await.unwrap();
        curator
    });
    queued(&raw, path, 2).await;
    let mutex = b.mutex("interop").unwrap();
    let b_waits = tokio::spawn(async move { mutex.lock().await });
    queued(&raw, path, 3).await;

    // Released: Curator, queued before b, gets it; b and a fresh try do not.
    let first_token = first.token();
    first.release().await.unwrap();
    let mut curator = curator_waits.await.unwrap();
    assert!(
        !b_waits.is_finished(),
        "b got the lock while Curator held it"
    );
    assert!(
        a.mutex("interop")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none()
    );
    let state = a.inspect("interop").await.unwrap();
    assert_eq!(state.holders.len(), 1);
    assert!(
        state.holders[0].owner.as_str().starts_with("_c_"),
        "{:?}",
        state.holders[0]
    );
    assert_eq!(state.waiters.len(), 1);

    // Curator releases: b, woken by the deletion of Curator's node, gets it.
    curator.unlock(path).await.unwrap();
    let second = b_waits.await.unwrap().unwrap();
    assert!(second.token() > first_token);

    // b holds: Curator waits for it, and gets it on b's release.
    assert!(
        !curator
            .try_lock(path, Duration::from_millis(300))
            .await
            .unwrap()
    );
    let curator_waits = tokio::spawn(async move {
        curator.lock(path).await.unwrap();
        curator
    });
    queued(&raw, path, 2).await;
    assert!(!curator_waits.is_finished());
    second.release().await.unwrap();
    let mut curator = curator_waits.await.unwrap();
    assert!(
        a.mutex("interop")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none()
    );
    curator.unlock(path).await.unwrap();
    assert!(
        a.mutex("interop")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
}
