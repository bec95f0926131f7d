//! ZooKeeper-specific behaviour against real servers.
//! Lost create replies, jeopardy versus loss, a leader outage in an ensemble, a follower
//! that lost its leader, FIFO hand-offs that wake one waiter each, token order within each
//! set, close, a killed client, lock-delay markers and sessions, credentials and chroots, a
//! wiped epoch, records beside locks.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use leasehold_core::backend::{Backend, Mode, Request};
use leasehold_core::{
    Client, Error, Fence, LockName, LockOptions, LossReason, NamePrefix, RecordKey,
};
use leasehold_testkit::faulty::{Faulty, Op};
use leasehold_testkit::{Direction, FaultProxy, ZooKeeper};
use leasehold_zookeeper::ZooKeeperBackend;
use zookeeper_client as zk;

/// A client on `backend` whose locks take the session's timeout, with 2 s requests.
fn client_on(backend: ZooKeeperBackend) -> Client {
    Client::builder(backend).options(options()).build()
}

fn options() -> LockOptions {
    LockOptions::builder()
        .request_timeout(Duration::from_secs(2))
        .build()
        .unwrap()
}

async fn backend(url: &str) -> ZooKeeperBackend {
    ZooKeeperBackend::connect(url).await.unwrap()
}

/// A plain ZooKeeper client, for looking at the server's state.
async fn raw(zookeeper: &ZooKeeper) -> zk::Client {
    zk::Client::connect(&zookeeper.connect_string())
        .await
        .unwrap()
}

async fn children(raw: &zk::Client, dir: &str) -> Vec<String> {
    match raw.list_children(dir).await {
        Ok(children) => children,
        Err(zk::Error::NoNode) => Vec::new(),
        Err(e) => panic!("listing {dir}: {e}"),
    }
}

/// Waits until `cond` holds (it reads server or guard state), up to `limit`.
async fn until(what: &str, limit: Duration, mut cond: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !cond().await {
        assert!(started.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A backend whose link to the (standalone) server goes through a fault proxy.
async fn through_proxy(zookeeper: &ZooKeeper, params: &str) -> (ZooKeeperBackend, FaultProxy) {
    let proxy = FaultProxy::start(zookeeper.addrs()[0]).await.unwrap();
    let url = format!("zk://127.0.0.1:{}?{params}", proxy.port());
    (backend(&url).await, proxy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_create_reply_is_adopted_and_a_given_up_one_deleted() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let raw = raw(&zookeeper).await;
    // A long session: the client must not give up the connection on its own while the
    // replies are held (it does after 2/5 of the timeout without a byte from the server).
    let (cut, proxy) = through_proxy(&zookeeper, "session_timeout=10s").await;
    let a = client_on(cut);
    let dir = "/leasehold/lost-reply";
    // The directory exists: the first create's answer is the one lost, not its NONODE.
    raw.create(
        dir,
        &[],
        &zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()),
    )
    .await
    .unwrap();

    // The create reaches the server; its reply (and everything after it) never comes back.
    proxy.cut(Direction::ToClient);
    let mutex = a.mutex("lost-reply").unwrap();
    let locking = tokio::spawn(async move { mutex.lock().await });
    until("the create applied", Duration::from_secs(10), async || {
        children(&raw, dir).await.len() == 1
    })
    .await;
    let orphan = children(&raw, dir).await.remove(0);
    proxy.reset();
    proxy.heal();
    let guard = locking.await.unwrap().unwrap();
    // Adopted: the node the lost create made holds, and no second one was made.
    let (_, stat) = raw.get_data(&format!("{dir}/{orphan}")).await.unwrap();
    assert_eq!(guard.token().get(), u64::try_from(stat.czxid).unwrap());
    assert_eq!(children(&raw, dir).await, std::slice::from_ref(&orphan));

    // The client reconnects after the reset; it sends nothing until the new connection is
    // established (its first ping answered), so wait for an answer before cutting again.
    a.inspect("lost-reply").await.unwrap();

    // A try that finds the lock held, whose create reply is lost: its outcome is unknown,
    // and what it may have left is deleted by its owner id.
    proxy.cut(Direction::ToClient);
    let mutex = a.mutex("lost-reply").unwrap();
    let trying = tokio::spawn(async move { mutex.try_lock().await });
    until(
        "the second create applied",
        Duration::from_secs(10),
        async || children(&raw, dir).await.len() == 2,
    )
    .await;
    proxy.reset();
    proxy.heal();
    match trying.await.unwrap() {
        Err(error) => assert!(error.is_unknown_outcome(), "{error}"),
        Ok(got) => assert!(got.is_none()),
    }
    a.settle().await;
    assert_eq!(children(&raw, dir).await, [orphan], "a stray node was left");
    guard.release().await.unwrap();
    assert!(children(&raw, dir).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_cut_suspends_the_guard_and_resumes_it() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let timeout = Duration::from_secs(4);
    let (cut, proxy) = through_proxy(&zookeeper, "session_timeout=4s").await;
    let a = client_on(cut);
    let b = client_on(backend(&zookeeper.url()).await);
    let raw = raw(&zookeeper).await;
    let guard = a.mutex("short-cut").unwrap().lock().await.unwrap();
    let mutex = b.mutex("short-cut").unwrap();
    let waiting = tokio::spawn(async move { mutex.lock().await });
    until("b queued", Duration::from_secs(10), async || {
        children(&raw, "/leasehold/short-cut").await.len() == 2
    })
    .await;
    assert!(!guard.is_suspended());

    proxy.cut(Direction::Both);
    let cut_at = Instant::now();
    until("suspended", timeout * 3 / 10, async || guard.is_suspended()).await;
    assert!(guard.is_held(), "held while suspended");
    // The link stays down for 0.3 of the session timeout.
    tokio::time::sleep((timeout * 3 / 10).saturating_sub(cut_at.elapsed())).await;
    proxy.heal();
    until("resumed", timeout, async || !guard.is_suspended()).await;
    assert!(guard.is_held());
    assert!(!waiting.is_finished(), "granted to b while a held it");
    let state = b.inspect("short-cut").await.unwrap();
    assert_eq!(state.holders.len(), 1);
    assert_eq!(&state.holders[0].owner, guard.owner());

    let token = guard.token();
    guard.release().await.unwrap();
    let next = waiting.await.unwrap().unwrap();
    assert!(next.token() > token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_cut_loses_the_guard_at_its_deadline_before_anyone_else_gets_it() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let (cut, proxy) = through_proxy(&zookeeper, "session_timeout=2s").await;
    let a = client_on(cut);
    let b = client_on(backend(&zookeeper.url()).await);
    let raw = raw(&zookeeper).await;
    let guard = a.mutex("long-cut").unwrap().lock().await.unwrap();
    let mutex = b.mutex("long-cut").unwrap();
    let waiting = tokio::spawn(async move {
        let guard = mutex.lock().await;
        (Instant::now(), guard)
    });
    until("b queued", Duration::from_secs(10), async || {
        children(&raw, "/leasehold/long-cut").await.len() == 2
    })
    .await;

    let held_token = guard.token();
    proxy.cut(Direction::Both);
    let lost = guard.lost();
    let reason = lost.await;
    let lost_at = Instant::now();
    assert_eq!(reason, LossReason::Disconnected);
    assert!(!guard.is_held());
    let (granted_at, next) = waiting.await.unwrap();
    let next = next.unwrap();
    assert!(
        lost_at <= granted_at,
        "b got the lock {:?} before a's guard was lost",
        lost_at - granted_at
    );
    assert!(next.token() > held_token);
    // A late reply revives nothing: the link heals, the guard stays lost.
    proxy.heal();
    assert!(matches!(
        guard.release().await,
        Err(Error::Lost(LossReason::Disconnected))
    ));
    next.release().await.unwrap();
}

/// A link cut for half the session while a guard is dropped and an acquisition is given up.
/// The cut lasts 15 s of 30 s, and the acquisition's outcome is unknown: the releases go on
/// until the link is back and then complete, and the session's other guard lives on through
/// it, its node too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_outage_ends_only_what_was_let_go_during_it() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let session = Duration::from_secs(30);
    let (cut, proxy) = through_proxy(&zookeeper, "session_timeout=30s").await;
    let a = client_on(cut);
    let b = client_on(backend(&zookeeper.url()).await);
    let raw = raw(&zookeeper).await;
    let kept = a.mutex("outage:kept").unwrap().lock().await.unwrap();
    let dropped = a.mutex("outage:dropped").unwrap().lock().await.unwrap();
    let kept_node = children(&raw, "/leasehold/outage:kept").await;
    assert_eq!(kept_node.len(), 1);

    proxy.cut(Direction::Both);
    let cut_at = Instant::now();
    drop(dropped);
    // Its create goes out (or is queued for the reconnection) and no answer comes: the
    // acquisition gives up with an unknown outcome, and its release goes on behind it.
    let tried = a.mutex("outage:tried").unwrap().try_lock().await;
    assert!(
        matches!(tried, Err(ref e) if e.is_unknown_outcome()),
        "{tried:?}"
    );
    assert!(kept.is_held(), "the outage ended the session");
    until("suspended", session / 2, async || kept.is_suspended()).await;
    assert!(
        cut_at.elapsed() < session / 2,
        "the outage outlasted the scenario"
    );
    tokio::time::sleep((session / 2).saturating_sub(cut_at.elapsed())).await;
    assert!(kept.is_held(), "the outage ended the session");
    proxy.heal();

    // The releases complete once the link is back, long before the session could expire.
    a.settle().await;
    // Resumed at the reconnection, which the releases needed; waited for all the same, as
    // the etcd test must (its session resumes at the next keep-alive answered).
    until("resumed", kept.remaining(), async || !kept.is_suspended()).await;
    assert!(kept.is_held(), "the other guard did not survive the outage");
    assert_eq!(children(&raw, "/leasehold/outage:kept").await, kept_node);
    for name in ["outage:dropped", "outage:tried"] {
        let left = children(&raw, &format!("/leasehold/{name}")).await;
        assert!(left.is_empty(), "{name}: {left:?}");
        let next = b.mutex(name).unwrap().try_lock().await.unwrap();
        assert!(next.is_some(), "{name} is still held");
    }
    assert!(
        b.mutex("outage:kept")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none()
    );
    kept.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_outage_never_lets_two_in_and_locking_resumes_after_the_election() {
    let mut ensemble = ZooKeeper::ensemble(3).await.unwrap();
    let url = format!("{}?session_timeout=6s", ensemble.url());
    let inside = Arc::new(AtomicBool::new(false));
    let granted = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let fence = Arc::new(Fence::new());
    let mut workers = Vec::new();
    for _ in 0..3 {
        let client = client_on(backend(&url).await);
        let (inside, granted, stop, fence) =
            (inside.clone(), granted.clone(), stop.clone(), fence.clone());
        workers.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let mutex = client.mutex("outage").unwrap();
                let guard = match mutex.lock_timeout(Duration::from_secs(5)).await {
                    Ok(Some(guard)) => guard,
                    // The ensemble is electing: try again.
                    Ok(None) | Err(_) => continue,
                };
                assert!(!inside.swap(true, Ordering::SeqCst), "two holders at once");
                let write = fence.apply(guard.token(), || {});
                tokio::task::yield_now().await;
                inside.store(false, Ordering::SeqCst);
                if guard.is_held() {
                    write.expect("a current holder's write was fenced out");
                }
                granted.fetch_add(1, Ordering::SeqCst);
                let _ = guard.release().await;
            }
        }));
    }
    let progress = |n: u64| {
        let granted = granted.clone();
        async move {
            let from = granted.load(Ordering::SeqCst);
            until("progress", Duration::from_secs(60), async || {
                granted.load(Ordering::SeqCst) >= from + n
            })
            .await;
        }
    };
    progress(10).await;
    let mut leader = None;
    for (i, server) in ensemble.servers().iter().enumerate() {
        if server.mode().await.as_deref() == Some("leader") {
            leader = Some(i);
        }
    }
    let leader = leader.expect("a leader");
    ensemble.servers()[leader].process().pause();
    let others: Vec<_> = (0..3).filter(|i| *i != leader).collect();
    let addrs = ensemble.addrs();
    // Elected once one of the others says so; if that never happens, the failure shows
    // what each said last (the servers' logs follow it).
    let started = Instant::now();
    loop {
        let mut said = Vec::new();
        for i in &others {
            said.push(leasehold_testkit::probe::zookeeper_word(addrs[*i], "srvr").await);
        }
        if said.iter().flatten().any(|w| w.contains("Mode: leader")) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no new leader within 60 s after pausing server {}; the others said {said:?}",
            leader + 1
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    ensemble.servers()[leader].process().kill();
    progress(10).await;
    stop.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.await.unwrap();
    }
    let accepted = fence.accepted();
    assert!(accepted.windows(2).all(|w| w[0] < w[1]), "{accepted:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_waiters_are_served_in_order_and_each_release_wakes_one() {
    const WAITERS: usize = 100;
    let zookeeper = ZooKeeper::start().await.unwrap();
    let url = format!("{}?session_timeout=30s", zookeeper.url());
    let holder = client_on(backend(&url).await);
    let first = holder.mutex("hundred").unwrap().lock().await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut backends = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..WAITERS {
        let zookeeper = backend(&url).await;
        backends.push(zookeeper.clone());
        let faults = Faulty::new(zookeeper);
        let client = Client::builder(faults.clone()).options(options()).build();
        let order = order.clone();
        tasks.push(tokio::spawn(async move {
            let guard = client.mutex("hundred").unwrap().lock().await.unwrap();
            order.lock().unwrap().push(i);
            guard.release().await.unwrap();
        }));
        // Queued before the next one arrives.
        faults.until_calls(Op::Wait, 1).await;
    }
    first.release().await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), (0..WAITERS).collect::<Vec<_>>());
    // Every release woke exactly the next waiter, and nobody else.
    let events: Vec<u64> = backends
        .iter()
        .map(ZooKeeperBackend::watch_events)
        .collect();
    assert!(events.iter().all(|e| *e == 1), "{events:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_deletes_the_sessions_nodes_at_once() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let raw = raw(&zookeeper).await;
    let zk_backend = backend(&zookeeper.url()).await;
    let a = client_on(zk_backend.clone());
    let delayed = LockOptions::builder()
        .lock_delay(Duration::from_secs(30))
        .build()
        .unwrap();
    let held = [
        a.mutex("close:x").unwrap().lock().await.unwrap(),
        a.rwlock("close:r").unwrap().read().await.unwrap(),
        a.semaphore("close:p", 2).unwrap().acquire().await.unwrap(),
        a.mutex("close:d")
            .unwrap()
            .with_options(delayed)
            .lock()
            .await
            .unwrap(),
    ];
    // The holder's node and its lock-delay marker.
    assert_eq!(children(&raw, "/leasehold/close:d").await.len(), 2);
    zk_backend.close().await.unwrap();
    for dir in [
        "close:x",
        "close:r",
        "close:p#permits",
        "close:d",
        "close:d#delay",
    ] {
        let left = children(&raw, &format!("/leasehold/{dir}")).await;
        assert!(left.is_empty(), "{dir}: {left:?}");
    }
    for guard in &held {
        assert_eq!(guard.lost().await, LossReason::SessionEnded);
    }
    // A close is a release: no lock-delay follows it.
    let b = client_on(backend(&zookeeper.url()).await);
    assert!(
        b.mutex("close:d")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
    // The backend opens a new session for later locks.
    assert!(
        a.mutex("close:x")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
}

/// A guard dropped sends its delete from the drop.
/// It goes ahead of the client's next request on the one session: the lock taken again at
/// once is free, with nothing to wait for.
#[tokio::test]
async fn a_dropped_guard_is_gone_before_the_clients_next_request() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let raw = raw(&zookeeper).await;
    let client = client_on(backend(&zookeeper.url()).await);
    let mutex = client.mutex("dropped").unwrap();
    for _ in 0..20 {
        drop(mutex.lock().await.unwrap());
        // One thread: the background task could not have run since the drop.
        let again = mutex.try_lock().await.unwrap();
        assert!(again.is_some(), "the dropped guard's node was still there");
    }
    client.settle().await;
    assert!(children(&raw, "/leasehold/dropped").await.is_empty());
}

/// The environment variable that makes [`a_holder_process`] hold a lock: `url|name|delay ms`.
const HOLDER: &str = "LEASEHOLD_ZK_TEST_HOLDER";

/// Not a test of its own: the process that the killed-client tests start and SIGKILL.
#[tokio::test]
#[ignore = "run by a_killed_client_frees_its_lock_within_a_session_timeout"]
async fn a_holder_process() {
    let Ok(spec) = std::env::var(HOLDER) else {
        return;
    };
    let [url, name, delay]: [&str; 3] = spec.split('|').collect::<Vec<_>>().try_into().unwrap();
    let client = client_on(backend(url).await);
    let mut mutex = client.mutex(name).unwrap();
    let delay: u64 = delay.parse().unwrap();
    if delay > 0 {
        let options = LockOptions::builder()
            .lock_delay(Duration::from_millis(delay))
            .build()
            .unwrap();
        mutex = mutex.with_options(options);
    }
    let guard = mutex.lock().await.unwrap();
    println!("held {}", guard.token());
    std::future::pending::<()>().await;
}

/// Starts a process holding `name` and kills it with SIGKILL once it holds.
/// Returns how long after the kill another client got the lock.
async fn freed_after_kill(
    zookeeper: &ZooKeeper,
    url: &str,
    name: &str,
    delay: Duration,
) -> Duration {
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "a_holder_process", "--ignored", "--nocapture"])
        .env(HOLDER, format!("{url}|{name}|{}", delay.as_millis()))
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        let line = lines.next_line().await.unwrap().expect("the holder exited");
        if line.starts_with("held ") {
            break;
        }
    }
    let other = client_on(backend(&zookeeper.url()).await);
    assert!(
        other
            .mutex(name)
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none()
    );
    child.start_kill().unwrap();
    let killed = Instant::now();
    child.wait().await.unwrap();
    let guard = other
        .mutex(name)
        .unwrap()
        .lock_timeout(Duration::from_secs(60))
        .await
        .unwrap()
        .expect("the lock was freed");
    let freed = killed.elapsed();
    guard.release().await.unwrap();
    freed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_client_frees_its_lock_within_a_session_timeout() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let timeout = Duration::from_secs(2);
    let url = format!("{}?session_timeout=2s", zookeeper.url());
    // ZooKeeper expires a session between its timeout and one tick (200 ms here) later.
    let slack = Duration::from_millis(800);
    let freed = freed_after_kill(&zookeeper, &url, "killed", Duration::ZERO).await;
    assert!(freed <= timeout + slack, "freed {freed:?} after the kill");
    // With a lock-delay, the lock stays closed for the delay after the session is gone.
    let delay = Duration::from_secs(1);
    let freed = freed_after_kill(&zookeeper, &url, "killed:delay", delay).await;
    assert!(
        freed >= delay,
        "freed {freed:?} after the kill, lock-delay {delay:?}"
    );
    assert!(
        freed <= (timeout + delay).mul_f64(1.06) + slack,
        "freed {freed:?} after the kill"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn digest_credentials_protect_the_nodes_and_a_chroot_is_created() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let servers = zookeeper.connect_string();
    let alice = client_on(backend(&format!("zk://alice:s3cret@{servers}/apps/one")).await);
    let guard = alice.mutex("guarded").unwrap().lock().await.unwrap();
    let raw = zk::Client::connector()
        .with_auth("digest", b"alice:s3cret")
        .connect(&servers)
        .await
        .unwrap();
    assert_eq!(children(&raw, "/apps/one/leasehold/guarded").await.len(), 1);
    // Another identity may not even read alice's prefix: refused at connect.
    match ZooKeeperBackend::connect(&format!("zk://mallory:x@{servers}/apps/one")).await {
        Err(error @ Error::Backend { .. }) => {
            assert!(!error.is_retryable());
            assert!(error.to_string().contains("not authorized"), "{error}");
        }
        other => panic!("mallory got {other:?}"),
    }
    // Alice elsewhere is alice.
    let again = client_on(backend(&format!("zk://alice:s3cret@{servers}/apps/one")).await);
    assert!(
        again
            .mutex("guarded")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none()
    );
    guard.release().await.unwrap();
    assert!(
        again
            .mutex("guarded")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
    // A bad URL never shows the password.
    let bad = ZooKeeperBackend::connect(&format!("zk://alice:s3cret@{servers}?nosuch=1"))
        .await
        .unwrap_err();
    assert!(!bad.to_string().contains("s3cret"), "{bad}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_epoch_is_detected_and_refused() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let zk_backend = backend(&zookeeper.url()).await;
    let a = client_on(zk_backend.clone());
    a.mutex("epoch")
        .unwrap()
        .lock()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    // What a wiped data directory looks like to a client: the epoch node is gone (and
    // made again by someone else), and its session with it.
    zk_backend.close().await.unwrap();
    let raw = raw(&zookeeper).await;
    for child in children(&raw, "/leasehold").await {
        let _ = raw.delete(&format!("/leasehold/{child}"), None).await;
    }
    raw.delete("/leasehold", None).await.unwrap();
    let other = client_on(backend(&zookeeper.url()).await);
    other
        .mutex("epoch")
        .unwrap()
        .lock()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    match a.mutex("epoch").unwrap().try_lock().await {
        Err(error @ Error::Backend { .. }) => {
            assert!(error.to_string().contains("lost its data"), "{error}");
        }
        other => panic!("granted on a wiped ensemble: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_create_costs_nothing_else() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let admin = zk::Client::connector()
        .with_auth("digest", b"admin:pw")
        .connect(&zookeeper.connect_string())
        .await
        .unwrap();
    let open = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    let _ = admin.create("/leasehold", &[], &open).await;
    let private = zk::CreateMode::Persistent.with_acls(zk::Acls::creator_all());
    admin
        .create("/leasehold/private", &[], &private)
        .await
        .unwrap();
    let a = client_on(backend(&zookeeper.url()).await);
    let held = a.mutex("public").unwrap().lock().await.unwrap();
    // A create the ACL refuses was not applied: there is nothing to release, and the
    // session (with the other lock on it) is not given up for it.
    match a.mutex("private").unwrap().try_lock().await {
        Err(error @ Error::Backend { .. }) => assert!(!error.is_retryable(), "{error}"),
        other => panic!("got {other:?}"),
    }
    a.settle().await;
    assert!(
        held.is_held(),
        "the session was given up for a refused create"
    );
    held.release().await.unwrap();
}

/// Finds the leader of an ensemble and one follower.
async fn leader_and_follower(ensemble: &mut ZooKeeper) -> (usize, usize) {
    let (mut leader, mut follower) = (None, None);
    for (i, server) in ensemble.servers().iter().enumerate() {
        match server.mode().await.as_deref() {
            Some("leader") => leader = Some(i),
            Some("follower") => follower = Some(i),
            _ => {}
        }
    }
    (leader.expect("a leader"), follower.expect("a follower"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_lost_its_leader_does_not_keep_the_guard_alive() {
    let mut ensemble = ZooKeeper::ensemble(3).await.unwrap();
    let (leader, follower) = leader_and_follower(&mut ensemble).await;
    let timeout = Duration::from_secs(4);
    // Only the follower: the client cannot move to another server.
    let url = format!("zk://{}?session_timeout=4s", ensemble.addrs()[follower]);
    let zk_backend = backend(&url).await;
    assert_eq!(zk_backend.session_timeout(), timeout);
    let a = client_on(zk_backend);
    let guard = a.mutex("cut-off").unwrap().lock().await.unwrap();

    // From now on the leader hears nothing from the session: had it only been cut off from
    // the follower, it would expire the session a timeout later at the latest, and give
    // the lock to another client. The follower keeps answering local reads until it gives
    // up on the leader (syncLimit × tickTime = 2 s here).
    let paused = Instant::now();
    ensemble.servers()[leader].process().pause();
    while paused.elapsed() < Duration::from_millis(1500) && guard.is_held() {
        let before = Instant::now();
        let until = before + guard.remaining();
        assert!(
            until <= paused + timeout,
            "the guard counts on the session until {:?} after the leader stopped",
            until - paused
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        guard.is_suspended() || !guard.is_held(),
        "not suspended although nothing reaches the leader"
    );
    ensemble.servers()[leader].process().resume();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_delayed_grant_leaves_no_marker_behind() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let raw = raw(&zookeeper).await;
    let (cut, proxy) = through_proxy(&zookeeper, "session_timeout=10s").await;
    let delayed = LockOptions::builder()
        .request_timeout(Duration::from_secs(10))
        .lock_delay(Duration::from_secs(1))
        .build()
        .unwrap();
    let a = Client::builder(cut).options(delayed).build();
    let dir = "/leasehold/marker";
    // Opens the lock-delay session.
    let mutex = a.mutex("marker").unwrap();
    mutex.lock().await.unwrap().release().await.unwrap();
    assert!(children(&raw, dir).await.is_empty());

    // Every answer is late: the marker is on the server well before its create's answer
    // comes back, and the acquisition is dropped in between.
    proxy.set_delay(Direction::ToClient, Duration::from_secs(2));
    let locking = tokio::spawn(async move { mutex.lock().await });
    until("the marker created", Duration::from_secs(20), async || {
        children(&raw, dir)
            .await
            .iter()
            .any(|c| c.contains("-m-lock-"))
    })
    .await;
    locking.abort();
    assert!(locking.await.unwrap_err().is_cancelled());
    proxy.heal();
    a.settle().await;
    let left = children(&raw, dir).await;
    assert!(left.is_empty(), "left behind: {left:?}");
    let b = client_on(backend(&zookeeper.url()).await);
    assert!(
        b.mutex("marker")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_listing_after_a_create_leaves_no_node_behind() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let raw = raw(&zookeeper).await;
    let open = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    let _ = raw.create("/leasehold", &[], &open).await;
    // Anyone may create and delete children; nobody may list them.
    let acl = [zk::Acl::new(
        zk::Permission::CREATE
            | zk::Permission::DELETE
            | zk::Permission::WRITE
            | zk::Permission::ADMIN,
        zk::AuthId::anyone(),
    )];
    raw.create(
        "/leasehold/nolist",
        &[],
        &zk::CreateMode::Persistent.with_acls(zk::Acls::new(&acl)),
    )
    .await
    .unwrap();
    let a = client_on(backend(&zookeeper.url()).await);
    match a.mutex("nolist").unwrap().try_lock().await {
        Err(error @ Error::Backend { .. }) => assert!(!error.is_retryable(), "{error}"),
        other => panic!("got {other:?}"),
    }
    a.settle().await;
    raw.set_acl("/leasehold/nolist", &zk::Acls::anyone_all(), None)
        .await
        .unwrap();
    let left = children(&raw, "/leasehold/nolist").await;
    assert!(left.is_empty(), "left under a live session: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_in_grant_order_within_each_set() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let url = format!("{}?session_timeout=30s", zookeeper.url());
    let raw = raw(&zookeeper).await;

    // The lock set: writers and readers waiting in turn, each granted by the release of
    // the one before it.
    let holder = client_on(backend(&url).await);
    let first = holder.rwlock("order").unwrap().write().await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(vec![first.token()]));
    let mut tasks = Vec::new();
    for writer in [false, true, false, true, false] {
        let faults = Faulty::new(backend(&url).await);
        let client = Client::builder(faults.clone()).options(options()).build();
        let order = order.clone();
        tasks.push(tokio::spawn(async move {
            let rwlock = client.rwlock("order").unwrap();
            if writer {
                let guard = rwlock.write().await.unwrap();
                order.lock().unwrap().push(guard.token());
                guard.release().await.unwrap();
            } else {
                let guard = rwlock.read().await.unwrap();
                order.lock().unwrap().push(guard.token());
                guard.release().await.unwrap();
            }
        }));
        faults.until_calls(Op::Wait, 1).await;
    }
    first.release().await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }
    let tokens = order.lock().unwrap().clone();
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");

    // The permit set, with requests of different limits: a grant made possible by later
    // releases never gets a lower token than one made before them.
    let phase = Arc::new(AtomicU64::new(0));
    let granted = Arc::new(std::sync::Mutex::new(Vec::new()));
    let a = client_on(backend(&url).await);
    let held = [
        a.semaphore("order", 2).unwrap().acquire().await.unwrap(),
        a.semaphore("order", 2).unwrap().acquire().await.unwrap(),
    ];
    for permit in &held {
        granted.lock().unwrap().push((0, permit.token()));
    }
    let dir = "/leasehold/order#permits";
    let mut tasks = Vec::new();
    for (limit, queued) in [(1, 3), (4, 4)] {
        let client = client_on(backend(&url).await);
        let (phase, granted) = (phase.clone(), granted.clone());
        tasks.push(tokio::spawn(async move {
            let permit = client
                .semaphore("order", limit)
                .unwrap()
                .acquire()
                .await
                .unwrap();
            granted
                .lock()
                .unwrap()
                .push((phase.load(Ordering::SeqCst), permit.token()));
            permit
        }));
        until("queued", Duration::from_secs(10), async || {
            children(&raw, dir).await.len() == queued
        })
        .await;
    }
    // The limit-1 request can only hold once both holders are gone.
    phase.store(1, Ordering::SeqCst);
    for permit in held {
        permit.release().await.unwrap();
    }
    for task in tasks {
        task.await.unwrap().release().await.unwrap();
    }
    let granted = granted.lock().unwrap().clone();
    for (i, (phase, token)) in granted.iter().enumerate() {
        for (earlier, before) in &granted[..i] {
            if earlier < phase {
                assert!(before < token, "{granted:?}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_waiter_wakes_when_the_waiter_before_it_was_granted_first() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let raw = raw(&zookeeper).await;
    // A missed wake-up shows as a wait until the end of the engine's wait slice (a third
    // of the lock's ttl: 10 s).
    let url = zookeeper.url();
    let h = client_on(backend(&url).await);
    let g0 = h.semaphore("perm", 2).unwrap().acquire().await.unwrap();
    let g1 = h.semaphore("perm", 2).unwrap().acquire().await.unwrap();

    let f1 = Faulty::new(backend(&url).await);
    let w1 = client_on_faulty(&f1);
    let s1 = w1.semaphore("perm", 2).unwrap();
    let t1 = tokio::spawn(async move { s1.acquire().await });
    f1.until_calls(Op::Wait, 1).await;

    // The second waiter lists the directory, but its watch is not set yet...
    let f2 = Faulty::new(backend(&url).await);
    f2.hold_requests(Op::Wait);
    let w2 = client_on_faulty(&f2);
    let s2 = w2.semaphore("perm", 2).unwrap();
    let t2 = tokio::spawn(async move { s2.acquire().await });
    f2.until_calls(Op::Wait, 1).await;
    assert_eq!(children(&raw, "/leasehold/perm#permits").await.len(), 4);

    // ... when the first waiter is granted (and touches its node).
    g0.release().await.unwrap();
    let gw1 = t1.await.unwrap().unwrap();
    f2.resume(Op::Wait);
    let released = Instant::now();
    g1.release().await.unwrap();
    let gw2 = t2.await.unwrap().unwrap();
    let late = released.elapsed();
    assert!(
        late < Duration::from_secs(5),
        "granted {late:?} after the release"
    );
    gw1.release().await.unwrap();
    gw2.release().await.unwrap();
}

fn client_on_faulty(faults: &Faulty) -> Client {
    Client::builder(faults.clone()).options(options()).build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_woken_by_its_one_writer_honours_a_vanished_readers_lock_delay() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let raw = raw(&zookeeper).await;
    let dir = "/leasehold/vanished";
    let (cut, proxy) = through_proxy(&zookeeper, "session_timeout=2s").await;
    let delayed = LockOptions::builder()
        .request_timeout(Duration::from_secs(2))
        .lock_delay(Duration::from_secs(2))
        .build()
        .unwrap();
    let r0 = Client::builder(cut).options(delayed).build();
    let reading = r0.rwlock("vanished").unwrap().read().await.unwrap();

    let faults = Faulty::new(backend(&zookeeper.url()).await);
    let w1 = client_on_faulty(&faults);
    let writing = tokio::spawn(async move { w1.rwlock("vanished").unwrap().write().await });
    faults.until_calls(Op::Wait, 1).await;
    let faults = Faulty::new(backend(&zookeeper.url()).await);
    let r3 = client_on_faulty(&faults);
    let waiting = tokio::spawn(async move { r3.rwlock("vanished").unwrap().read().await });
    faults.until_calls(Op::Wait, 1).await;

    // The first reader vanishes: its session expires, its lock-delay marker stays.
    proxy.cut(Direction::Both);
    until(
        "the reader's node gone",
        Duration::from_secs(20),
        async || {
            !children(&raw, dir)
                .await
                .iter()
                .any(|c| c.contains("-sd-lock-"))
        },
    )
    .await;
    assert!(
        children(&raw, dir)
            .await
            .iter()
            .any(|c| c.contains("-m-lock-"))
    );
    // The writer between them gives up: the reader is woken by its going.
    writing.abort();
    let _ = writing.await;
    let guard = waiting.await.unwrap().unwrap();
    let left = children(&raw, dir).await;
    assert!(
        !left.iter().any(|c| c.contains("-m-lock-")),
        "granted during a vanished holder's lock-delay: {left:?}"
    );
    guard.release().await.unwrap();
    drop(reading);
}

/// The number of client connections the server has open.
async fn connections(zookeeper: &ZooKeeper) -> usize {
    let word = leasehold_testkit::probe::zookeeper_word(zookeeper.addrs()[0], "mntr")
        .await
        .unwrap();
    word.lines()
        .find_map(|l| l.strip_prefix("zk_num_alive_connections"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_delays_share_a_few_sessions_dropped_when_unused() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let a = client_on(backend(&format!("{}?session_timeout=2s", zookeeper.url())).await);
    let before = connections(&zookeeper).await;
    let mut held = Vec::new();
    for i in 0..10 {
        let delayed = LockOptions::builder()
            .lock_delay(Duration::from_millis(1000 + i))
            .build()
            .unwrap();
        let mutex = a
            .mutex(&format!("delays:{i}"))
            .unwrap()
            .with_options(delayed);
        held.push(mutex.lock().await.unwrap());
    }
    let opened = connections(&zookeeper).await - before;
    assert!(opened <= 1, "{opened} lock-delay sessions");
    for guard in held {
        guard.release().await.unwrap();
    }
    until(
        "the lock-delay session dropped",
        Duration::from_secs(20),
        async || connections(&zookeeper).await == before,
    )
    .await;
}

/// Two thousand locks, some with a permit set too, are listed exactly, a page at a time.
/// Directories of freed names among them are not listed. The client's listing reads a
/// thousand names a page; the backend's, asked for a hundred, takes many pages and lists
/// each name once with all of its holders, each with how long it has held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_locks_are_listed_exactly_a_page_at_a_time() {
    const NAMES: usize = 2_000;
    const WORKERS: usize = 32;
    let zookeeper = ZooKeeper::start().await.unwrap();
    let locks = backend(&zookeeper.url()).await;
    let client = client_on(locks.clone());
    // A mutex of each name, a permit of every fourth, and a freed name every tenth.
    let workers: Vec<_> = (0..WORKERS)
        .map(|worker| {
            let client = client.clone();
            tokio::spawn(async move {
                let mut guards = Vec::new();
                for i in (worker..NAMES).step_by(WORKERS) {
                    let name = format!("bulk:{i}");
                    guards.push(client.mutex(&name).unwrap().lock().await.unwrap());
                    if i % 4 == 0 {
                        let permits = client.semaphore(&name, 2).unwrap();
                        guards.push(permits.acquire().await.unwrap());
                    }
                    if i % 10 == 0 {
                        let freed = client.mutex(&format!("bulk:freed{i}")).unwrap();
                        freed.lock().await.unwrap().release().await.unwrap();
                    }
                }
                guards
            })
        })
        .collect();
    let mut guards = Vec::new();
    for worker in workers {
        guards.extend(worker.await.unwrap());
    }
    let mut expected: BTreeMap<String, Vec<_>> = BTreeMap::new();
    for guard in &guards {
        let holder = (guard.owner().clone(), guard.token(), guard.mode());
        expected
            .entry(guard.name().to_string())
            .or_default()
            .push(holder);
    }
    assert_eq!(expected.len(), NAMES);
    let outside = client.mutex("bulk").unwrap().lock().await.unwrap();
    let holders_of = |state: &leasehold_core::LockState| {
        let mut holders: Vec<_> = state
            .holders
            .iter()
            .map(|h| (h.owner.clone(), h.token, h.mode))
            .collect();
        // The lock set's holder, then the permit set's.
        holders.sort_by_key(|h| h.2.is_permit());
        holders
    };

    let listed = client.locks("bulk:").await.unwrap();
    assert_eq!(listed.len(), NAMES, "names listed");
    for (name, state) in &listed {
        assert_eq!(
            Some(&holders_of(state)),
            expected.get(name.as_str()),
            "holders of {name}"
        );
    }

    let prefix = NamePrefix::new("bulk:").unwrap();
    let (mut cursor, mut pages) = (None, 0);
    loop {
        let page = locks.list(&prefix, cursor.as_ref(), 100).await.unwrap();
        pages += 1;
        for (name, state) in &page.locks {
            let holders = expected.remove(name.as_str());
            assert!(holders.is_some(), "{name} listed twice, or not held");
            assert_eq!(Some(holders_of(state)), holders, "holders of {name}");
        }
        match page.next {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    assert!(expected.is_empty(), "{} names not listed", expected.len());
    // 2 000 names and 200 freed ones (unless reaped already), a hundred a page.
    assert!(pages >= NAMES / 100, "{pages} pages");
    drop((guards, outside));
}

/// Records beside a lock are nodes apart from its queue, and old ones are swept.
/// Neither the lock directory's listing, nor `inspect`, nor a listing of the root sees
/// them, even under keys that look like contenders. A writer whose node is gone on the server writes nothing; a node that is no
/// leasehold record is reported. Records past their keep are swept by later writes — the
/// writer's name's, and other names' in turn, with their emptied directories.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_live_apart_from_locks_and_old_ones_are_swept() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let raw = raw(&zookeeper).await;
    let zk_backend = backend(&zookeeper.url()).await;
    let client = client_on(zk_backend.clone());
    let long = Duration::from_secs(600);
    let key = |k: &str| RecordKey::new(k).unwrap();
    let read = async |name: &str, k: &str| {
        let name = LockName::new(name).unwrap();
        zk_backend.get_record(&name, &key(k)).await.unwrap()
    };

    // A record under a key shaped like a contender's node, while the lock is held.
    let guard = client.mutex("rec:held").unwrap().lock().await.unwrap();
    assert!(
        guard
            .put_record(&key("w-lock-0000000042"), b"done", long)
            .await
            .unwrap()
    );
    assert_eq!(children(&raw, "/leasehold/rec:held").await.len(), 1);
    let state = client.inspect("rec:held").await.unwrap();
    assert_eq!((state.holders.len(), state.waiters.len()), (1, 0));
    guard.release().await.unwrap();
    assert!(
        client.locks("").await.unwrap().is_empty(),
        "a record listed"
    );
    assert!(client.inspect("rec:held").await.unwrap().holders.is_empty());
    assert_eq!(
        read("rec:held", "w-lock-0000000042").await.as_deref(),
        Some(&b"done"[..])
    );

    // The grant's node deleted under its holder, who has not noticed: the server's check
    // refuses the write, over a record or not.
    let guard = client.mutex("rec:held").unwrap().lock().await.unwrap();
    let held = Request::new(
        LockName::new("rec:held").unwrap(),
        guard.owner().clone(),
        Mode::Exclusive,
        Duration::from_secs(5),
    );
    assert!(
        zk_backend
            .put_record(&held, &key("fresh"), b"held", long)
            .await
            .unwrap()
    );
    let node = children(&raw, "/leasehold/rec:held").await.remove(0);
    raw.delete(&format!("/leasehold/rec:held/{node}"), None)
        .await
        .unwrap();
    for k in ["w-lock-0000000042", "fresh", "new"] {
        let written = zk_backend.put_record(&held, &key(k), b"stale", long).await;
        assert!(!written.unwrap(), "{k}");
    }
    assert_eq!(
        read("rec:held", "w-lock-0000000042").await.as_deref(),
        Some(&b"done"[..])
    );
    assert_eq!(
        read("rec:held", "fresh").await.as_deref(),
        Some(&b"held"[..])
    );
    assert_eq!(read("rec:held", "new").await, None);
    drop(guard);

    // A node under a record's path that leasehold did not write is reported.
    let path = "/leasehold/#records/rec:held/w-lock-0000000042";
    raw.set_data(path, b"junk", None).await.unwrap();
    let name = LockName::new("rec:held").unwrap();
    let foreign = zk_backend
        .get_record(&name, &key("w-lock-0000000042"))
        .await;
    assert!(matches!(foreign, Err(Error::Backend { .. })), "{foreign:?}");
    raw.delete(path, None).await.unwrap();

    // Records kept for no time are swept by later writes: of the same name, and of
    // another name, whose emptied directory goes with them.
    let old = client.mutex("rec:old").unwrap().lock().await.unwrap();
    assert!(
        old.put_record(&key("gone"), b"x", Duration::ZERO)
            .await
            .unwrap()
    );
    old.release().await.unwrap();
    let writer = client.mutex("rec:new").unwrap().lock().await.unwrap();
    assert!(
        writer
            .put_record(&key("old"), b"x", Duration::ZERO)
            .await
            .unwrap()
    );
    assert!(writer.put_record(&key("kept"), b"x", long).await.unwrap());
    let mut n = 0;
    until("old records swept", Duration::from_secs(10), async || {
        n += 1;
        let written = key(&format!("w{n}"));
        assert!(writer.put_record(&written, b"x", long).await.unwrap());
        let new = children(&raw, "/leasehold/#records/rec:new").await;
        let names = children(&raw, "/leasehold/#records").await;
        !new.contains(&"old".to_owned()) && !names.contains(&"rec:old".to_owned())
    })
    .await;
    assert_eq!(read("rec:new", "kept").await.as_deref(), Some(&b"x"[..]));
    assert!(
        children(&raw, "/leasehold/#records")
            .await
            .contains(&"rec:new".to_owned())
    );
    writer.release().await.unwrap();
}

/// The number of watches the (standalone) server holds, all sessions together.
async fn watch_count(zookeeper: &ZooKeeper) -> usize {
    let word = leasehold_testkit::probe::zookeeper_word(zookeeper.addrs()[0], "mntr")
        .await
        .unwrap();
    word.lines()
        .find_map(|l| l.strip_prefix("zk_watch_count"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Reads `feed` until a notice that `want` accepts, up to `limit`.
async fn until_notice(
    feed: &mut leasehold_core::Changes,
    what: &str,
    limit: Duration,
    want: impl Fn(&leasehold_core::Change) -> bool,
) {
    let seen = async {
        loop {
            let notice = feed.next().await.expect("the feed ended");
            if want(&notice) {
                return;
            }
        }
    };
    tokio::time::timeout(limit, seen)
        .await
        .unwrap_or_else(|_| panic!("{what}: no such notice within {limit:?}"));
}

fn names(name: &LockName) -> impl Fn(&leasehold_core::Change) -> bool {
    let name = name.clone();
    move |notice| *notice == leasehold_core::Change::Lock(name.clone())
}

fn resync(notice: &leasehold_core::Change) -> bool {
    *notice == leasehold_core::Change::Resync
}

/// A change feed's watch is on the server once the feed is returned, gone once it is dropped.
/// Two feeds of one session share the server's watch of the root: the first one dropped
/// leaves it to the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_feed_takes_its_watch_off_the_server() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let watching = backend(&zookeeper.url()).await;
    let a = client_on(backend(&zookeeper.url()).await);
    let name = LockName::new("feeds:x").unwrap();
    let prefix = NamePrefix::new("feeds:").unwrap();
    let before = watch_count(&zookeeper).await;
    let first = watching.changes(&prefix).await.unwrap();
    // ZooKeeper 3.8 counts a persistent recursive watch once for data, once for children.
    let with = watch_count(&zookeeper).await;
    assert!(with > before, "no watch on the server");
    let mut second = watching.changes(&prefix).await.unwrap();
    assert_eq!(watch_count(&zookeeper).await, with);

    drop(first);
    for _ in 0..2 {
        let guard = a.mutex(name.as_str()).unwrap().lock().await.unwrap();
        until_notice(
            &mut second,
            "the grant",
            Duration::from_secs(10),
            names(&name),
        )
        .await;
        guard.release().await.unwrap();
        until_notice(
            &mut second,
            "the release",
            Duration::from_secs(10),
            names(&name),
        )
        .await;
    }
    // Each grant's own watch of its node went with its release.
    until(
        "the grants' watches gone",
        Duration::from_secs(10),
        async || watch_count(&zookeeper).await == with,
    )
    .await;

    drop(second);
    until(
        "the watch taken off the server",
        Duration::from_secs(10),
        async || watch_count(&zookeeper).await == before,
    )
    .await;
    // The session lives on, without the feed's watch: only the grant's own watch of its node.
    let guard = a.mutex(name.as_str()).unwrap().lock().await.unwrap();
    until(
        "the grant's own watch",
        Duration::from_secs(10),
        async || watch_count(&zookeeper).await == before + 1,
    )
    .await;
    guard.release().await.unwrap();
    assert!(watching.session_id().is_some());
}

/// A feed names the lock of a holder whose session the server expired.
/// The holder's link is cut: its session expires on the server, which deletes its node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feed_names_the_lock_of_a_holder_whose_session_expired() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let watching = backend(&format!("{}?session_timeout=2s", zookeeper.url())).await;
    let (cut, proxy) = through_proxy(&zookeeper, "session_timeout=2s").await;
    let holder = client_on(cut);
    let name = LockName::new("expiry:x").unwrap();
    let guard = holder.mutex(name.as_str()).unwrap().lock().await.unwrap();
    let mut feed = watching
        .changes(&NamePrefix::new("expiry:").unwrap())
        .await
        .unwrap();
    assert!(feed.try_next().is_none());

    // Nothing else touches the lock: the server expires the session (its close cannot get
    // through) and deletes the holder's node.
    proxy.cut(Direction::Both);
    until_notice(
        &mut feed,
        "the expired holder's node deleted",
        Duration::from_secs(30),
        names(&name),
    )
    .await;
    let state = watching.inspect(&name).await.unwrap();
    assert!(state.holders.is_empty(), "{state:?}");
    assert_eq!(guard.lost().await, LossReason::Disconnected);
    proxy.heal();
}

/// A feed whose own session ends watches again in the backend's next session.
/// It says so with a resync: what happened meanwhile was not pushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feed_whose_session_ended_resyncs_and_watches_in_the_next_one() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let (cut, proxy) = through_proxy(&zookeeper, "session_timeout=2s").await;
    let other = client_on(backend(&zookeeper.url()).await);
    let name = LockName::new("again:x").unwrap();
    let mut feed = cut
        .changes(&NamePrefix::new("again:").unwrap())
        .await
        .unwrap();
    let first = cut.session_id().unwrap();

    proxy.cut(Direction::Both);
    until(
        "the session given up",
        Duration::from_secs(10),
        async || cut.session_id().is_none(),
    )
    .await;
    // Changed while the feed could not hear of it.
    let guard = other.mutex(name.as_str()).unwrap().lock().await.unwrap();
    proxy.heal();
    // The one after the watch is set in another session (others may come before it).
    until_notice(&mut feed, "a resync", Duration::from_secs(30), |notice| {
        resync(notice) && cut.session_id().is_some_and(|id| id != first)
    })
    .await;

    guard.release().await.unwrap();
    until_notice(
        &mut feed,
        "the release after the resync",
        Duration::from_secs(10),
        names(&name),
    )
    .await;
}

/// A feed whose link breaks and comes back within the session resyncs and watches on in it.
/// ZooKeeper does not replay a persistent watch's events of a disconnection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feed_resyncs_after_a_reconnection_and_watches_on() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let (cut, proxy) = through_proxy(&zookeeper, "session_timeout=10s").await;
    let other = client_on(backend(&zookeeper.url()).await);
    let name = LockName::new("reconnect:x").unwrap();
    let mut feed = cut
        .changes(&NamePrefix::new("reconnect:").unwrap())
        .await
        .unwrap();
    let session = cut.session_id().unwrap();

    // The open connection goes dead; the client's next one gets through.
    proxy.cut_open(Direction::Both);
    let guard = other.mutex(name.as_str()).unwrap().lock().await.unwrap();
    until_notice(&mut feed, "a resync", Duration::from_secs(30), resync).await;
    assert_eq!(
        cut.session_id(),
        Some(session),
        "reconnected in the same session"
    );

    guard.release().await.unwrap();
    until_notice(
        &mut feed,
        "the release after the resync",
        Duration::from_secs(10),
        names(&name),
    )
    .await;
    proxy.heal();
}

/// An evicted holder hears of it by push, and every write of it after the eviction is refused.
/// Its session lives on (its other lock stays held): only the push can tell it. The lock
/// stays closed meanwhile (for the holder's session timeout), and the next grant, after
/// it, fences the holder out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_holder_is_told_by_push_and_fenced_out() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let url = format!("zk://{}?session_timeout=2s", zookeeper.connect_string());
    let holder = client_on(backend(&url).await);
    let operator = client_on(backend(&zookeeper.url()).await);
    leasehold_testkit::eviction::an_evicted_holder_is_told_and_fenced_out(&holder, &operator).await;
}

/// A grant's watch of its node lives only while the grant does.
/// Released, dropped or evicted, it leaves no watch on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_leaves_no_watch_behind() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let holder = client_on(backend(&zookeeper.url()).await);
    let operator = client_on(backend(&zookeeper.url()).await);
    let before = watch_count(&zookeeper).await;
    let count_is = |want: usize| {
        let zookeeper = &zookeeper;
        async move {
            until("the watch count", Duration::from_secs(10), async || {
                watch_count(zookeeper).await == want
            })
            .await;
        }
    };
    let a = holder.mutex("a").unwrap().lock().await.unwrap();
    let b = holder.mutex("b").unwrap().lock().await.unwrap();
    count_is(before + 2).await;
    a.release().await.unwrap();
    count_is(before + 1).await;
    drop(b);
    count_is(before).await;
    // An evicted grant's watch fires with the eviction, and is gone.
    let c = holder.mutex("c").unwrap().lock().await.unwrap();
    count_is(before + 1).await;
    operator
        .evict("c", None, "ops@host", "leak check")
        .await
        .unwrap();
    assert_eq!(c.lost().await, LossReason::Evicted);
    count_is(before).await;
    let _ = c.release().await;
}

/// A grant whose link broke hears of its eviction once its session reconnects.
/// The client sets its one-shot watch again on the new connection, and the server reports
/// the deletion it missed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_link_broke_hears_of_its_eviction_on_reconnecting() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    // A session that outlasts the break by far: only the eviction can end the guard.
    let (holder, proxy) = through_proxy(&zookeeper, "session_timeout=30s").await;
    let holder = client_on(holder);
    let operator = client_on(backend(&zookeeper.url()).await);
    let before = watch_count(&zookeeper).await;
    let guard = holder.mutex("job").unwrap().lock().await.unwrap();
    until("the grant's watch", Duration::from_secs(10), async || {
        watch_count(&zookeeper).await == before + 1
    })
    .await;

    // The holder's connection is reset and none may open while it is evicted.
    proxy.refuse_new(true);
    proxy.reset();
    let evicted = operator
        .evict("job", None, "ops@host", "while cut off")
        .await
        .unwrap();
    assert_eq!(evicted.len(), 1, "{evicted:?}");
    proxy.refuse_new(false);
    assert_eq!(guard.lost().await, LossReason::Evicted);
    until("the watch gone", Duration::from_secs(10), async || {
        watch_count(&zookeeper).await == before
    })
    .await;
    let _ = guard.release().await;
}

/// Awaits `guard`'s loss, which must be its eviction: one never heard fails the test.
async fn told_evicted(guard: &leasehold_core::Guard) {
    let lost = tokio::time::timeout(Duration::from_secs(60), guard.lost()).await;
    assert_eq!(
        lost.ok(),
        Some(LossReason::Evicted),
        "the eviction went unheard"
    );
}

/// A grant whose watch request was lost with its connection sets it again, and hears of its eviction.
/// Every reply is late, so the request is still unanswered when the connection is reset:
/// the client fails it (the session lives on) and sets nothing again by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_watch_request_was_lost_sets_it_again() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let (holder, proxy) = through_proxy(&zookeeper, "session_timeout=30s").await;
    let options = LockOptions::builder()
        .request_timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let holder = Client::builder(holder).options(options).build();
    let operator = client_on(backend(&zookeeper.url()).await);
    proxy.set_delay(Direction::ToClient, Duration::from_secs(1));
    let guard = holder.mutex("job").unwrap().lock().await.unwrap();
    // The grant's watch request went out as the grant was answered; its reply is late.
    proxy.refuse_new(true);
    proxy.reset();
    proxy.set_delay(Direction::ToClient, Duration::ZERO);
    let evicted = operator
        .evict("job", None, "ops@host", "watch request lost")
        .await
        .unwrap();
    assert_eq!(evicted.len(), 1, "{evicted:?}");
    proxy.refuse_new(false);
    told_evicted(&guard).await;
    let _ = guard.release().await;
}

/// A grant whose node's data changed watches it again, and hears of its eviction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_node_changed_watches_it_again() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let raw = raw(&zookeeper).await;
    let holder = client_on(backend(&zookeeper.url()).await);
    let operator = client_on(backend(&zookeeper.url()).await);
    let before = watch_count(&zookeeper).await;
    let guard = holder.mutex("job").unwrap().lock().await.unwrap();
    let watched = || async { watch_count(&zookeeper).await == before + 1 };
    until("the grant's watch", Duration::from_secs(10), async || {
        watched().await
    })
    .await;
    let dir = "/leasehold/job";
    let node = children(&raw, dir).await;
    assert_eq!(node.len(), 1, "{node:?}");
    // The change fires the one-shot watch (the server drops it before it answers the
    // change); the grant sets it again.
    raw.set_data(&format!("{dir}/{}", node[0]), b"changed", None)
        .await
        .unwrap();
    until("the watch set again", Duration::from_secs(10), async || {
        watched().await
    })
    .await;
    operator
        .evict("job", None, "ops@host", "after a change")
        .await
        .unwrap();
    told_evicted(&guard).await;
    let _ = guard.release().await;
}

/// A grant whose node was deleted is revoked without waiting long for the eviction record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_grant_is_revoked_without_waiting_long_for_its_record() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let (holder, proxy) = through_proxy(&zookeeper, "session_timeout=30s").await;
    let operator = client_on(backend(&zookeeper.url()).await);
    leasehold_testkit::eviction::a_deleted_grant_is_revoked_without_waiting_long_for_its_record(
        &client_on(holder),
        &operator,
        &proxy,
    )
    .await;
}

/// An eviction asked again after it was applied (its answer lost, say) answers `true`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_asked_again_after_it_was_applied_answers_true() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let holder = client_on(backend(&zookeeper.url()).await);
    let locks = backend(&zookeeper.url()).await;
    leasehold_testkit::eviction::an_eviction_asked_again_after_it_was_applied_answers_true(
        &holder, &locks,
    )
    .await;
}
