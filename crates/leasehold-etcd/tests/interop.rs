//! One name, one lock: leasehold's and etcd's own exclude each other.
//! leasehold's exclusive lock on a name and etcd's own lock on the same name
//! (`concurrency.Mutex`, as `etcdctl lock` and the server's Lock RPC use it) exclude each
//! other, in both directions, against the real `etcdctl` (Debian's `etcd-client`).

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::process::Stdio;
use std::time::Duration;

use leasehold_core::backend::Backend;
use leasehold_core::{Client, FencingToken, LockName, LockOptions, LockState};
use leasehold_etcd::EtcdBackend;
use leasehold_testkit::Etcd;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, Command};

/// The name both sides lock.
const NAME: &str = "interop";

async fn client(etcd: &Etcd) -> Client {
    let options = LockOptions::builder()
        .request_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    Client::builder(EtcdBackend::connect(&etcd.url()).await.unwrap())
        .options(options)
        .build()
}

/// `etcdctl lock NAME [-- command…]` against `etcd`, its output piped.
fn etcdctl_lock(etcd: &Etcd, command: &[&str]) -> Child {
    let mut etcdctl = Command::new("etcdctl");
    etcdctl
        .arg(format!("--endpoints={}", etcd.endpoints()[0]))
        .args(["lock", NAME]);
    if !command.is_empty() {
        etcdctl.arg("--").args(command);
    }
    etcdctl
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("etcdctl (Debian package etcd-client) runs")
}

/// Waits, without polling, until `check` holds for the state of `NAME` as `observer` sees it.
/// It fails the test with `what` after 30 s.
async fn until(observer: &Client, what: &str, check: impl Fn(&LockState) -> bool) -> LockState {
    let lock = LockName::new(NAME).unwrap();
    let wait = async {
        loop {
            let state = observer.inspect(NAME).await.unwrap();
            if check(&state) {
                return state;
            }
            observer
                .backend()
                .wait(&lock, &state.hint, Duration::from_secs(5))
                .await
                .unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(30), wait)
        .await
        .unwrap_or_else(|_| panic!("never: {what}"))
}

fn foreign(owner: &leasehold_core::OwnerId) -> bool {
    owner.as_str().starts_with("foreign:")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leasehold_waits_for_etcdctl_lock_and_gets_a_higher_token() {
    let etcd = Etcd::start().await.unwrap();
    let c = client(&etcd).await;
    let mut etcdctl = etcdctl_lock(&etcd, &[]);
    // Without a command, etcdctl prints its key once it holds the lock, and holds it until
    // interrupted.
    let mut out = BufReader::new(etcdctl.stdout.take().unwrap()).lines();
    let key = out.next_line().await.unwrap().expect("etcdctl's lock key");
    assert!(key.starts_with("interop/"), "{key}");
    // leasehold sees etcdctl's key as the holder and does not get in.
    let state = c.inspect(NAME).await.unwrap();
    assert_eq!(state.holders.len(), 1, "{state:?}");
    assert!(foreign(&state.holders[0].owner), "{state:?}");
    let etcdctl_token = state.holders[0].token;
    assert!(c.mutex(NAME).unwrap().try_lock().await.unwrap().is_none());
    // A waiting lock queues behind it.
    let mutex = c.mutex(NAME).unwrap();
    let waiter = tokio::spawn(async move { mutex.lock().await });
    until(&c, "leasehold queued behind etcdctl", |s| {
        s.waiters.len() == 1
    })
    .await;
    assert!(!waiter.is_finished());
    // etcdctl lets go (as a user's Ctrl-C would): leasehold is woken and holds.
    let pid = rustix::process::Pid::from_raw(etcdctl.id().unwrap().try_into().unwrap()).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::INT).unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("leasehold never got the lock after etcdctl let go")
        .unwrap()
        .unwrap();
    assert!(guard.token() > etcdctl_token);
    assert!(etcdctl.wait().await.unwrap().success());
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcdctl_lock_waits_for_leasehold() {
    let etcd = Etcd::start().await.unwrap();
    let c = client(&etcd).await;
    let guard = c.mutex(NAME).unwrap().lock().await.unwrap();
    // etcdctl runs its command only once it holds the lock.
    let mut etcdctl = etcdctl_lock(&etcd, &["sh", "-c", "echo \"$ETCD_LOCK_REV\""]);
    let state = until(&c, "etcdctl queued behind leasehold", |s| {
        s.waiters.iter().any(|w| foreign(&w.owner))
    })
    .await;
    assert_eq!(&state.holders[0].owner, guard.owner(), "{state:?}");
    assert!(
        etcdctl.try_wait().unwrap().is_none(),
        "etcdctl ran its command while leasehold held the lock"
    );
    // A newcomer queues behind etcdctl: leasehold serves etcd's contenders in order too.
    assert!(c.mutex(NAME).unwrap().try_lock().await.unwrap().is_none());
    let token = guard.token();
    guard.release().await.unwrap();
    let mut out = String::new();
    let mut stdout = etcdctl.stdout.take().unwrap();
    tokio::time::timeout(Duration::from_secs(20), stdout.read_to_string(&mut out))
        .await
        .expect("etcdctl never got the lock after leasehold released it")
        .unwrap();
    assert!(etcdctl.wait().await.unwrap().success());
    let revision: u64 = out.trim().parse().unwrap();
    assert!(FencingToken::new(revision) > token, "{out}");
    // Once etcdctl is done, the lock is free again.
    assert!(c.mutex(NAME).unwrap().try_lock().await.unwrap().is_some());
}
