//! The file backend's change feed: its inotify descriptor lives exactly as long as the feed.
//! A test binary of its own: it counts the process's inotify descriptors.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use leasehold_core::backend::Backend;
use leasehold_core::{Change, Client, NamePrefix};
use leasehold_file::FileBackend;

fn inotify_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().contains("inotify"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_feed_closes_its_inotify_descriptor() {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::open(dir.path()).unwrap();
    let client = Client::new(backend.clone());
    // The backend's own wake-up descriptor, opened by its first wait hint.
    drop(client.inspect("warm-up").await.unwrap());
    let before = inotify_descriptors();

    let mut feed = backend
        .changes(&NamePrefix::new("jobs:").unwrap())
        .await
        .unwrap();
    assert_eq!(inotify_descriptors(), before + 1, "the feed's descriptor");
    // It works: a grant under the prefix is named; one outside it is not.
    client
        .mutex("other")
        .unwrap()
        .lock()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let guard = client.mutex("jobs:a").unwrap().lock().await.unwrap();
    loop {
        match feed.next().await.unwrap() {
            Change::Lock(name) => {
                assert!(name.as_str().starts_with("jobs:"), "{name}");
                if name.as_str() == "jobs:a" {
                    break;
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    guard.release().await.unwrap();

    drop(feed);
    // The feed's task ends when it sees the watcher gone, and closes the descriptor; it
    // has no event to await from here, so the count is read again every 10 ms.
    let closed = async {
        while inotify_descriptors() > before {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(30), closed)
        .await
        .expect("the feed's descriptor is still open");
    assert_eq!(inotify_descriptors(), before);
}
