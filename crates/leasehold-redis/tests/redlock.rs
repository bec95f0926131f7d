//! What only Redlock promises (and what it cannot), against real redis-servers.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::join_all;
use leasehold_core::backend::{Acquire, Backend, Mode, Release, Request};
use leasehold_core::{Client, Error, Fence, LockName, LockOptions, OwnerId, RecordKey};
use leasehold_redis::{RedisBackend, RedlockBackend, RedlockOptions};
use leasehold_testkit::faulty::{Faulty, Op};
use leasehold_testkit::probe::Resp;
use leasehold_testkit::{Direction, FaultProxy, Redis, redis_servers};

fn urls(servers: &[Redis]) -> Vec<String> {
    servers.iter().map(Redis::url).collect()
}

/// Nodes that grant at once after their start, and wait a second for a node's answer.
/// On a loaded test machine a loopback answer can take longer than the 50 ms default, which
/// is meant for a quiet network. Tests of the node timeout set their own.
fn no_quarantine() -> RedlockOptions {
    RedlockOptions::default()
        .quarantine(Duration::ZERO)
        .node_timeout(Duration::from_secs(1))
        .unwrap()
}

async fn client(urls: &[String], options: RedlockOptions, ttl: Duration) -> Client {
    Client::builder(RedlockBackend::connect_nodes(urls, options).await.unwrap())
        .options(
            LockOptions::builder()
                .ttl(ttl)
                .request_timeout(Duration::from_secs(2))
                .build()
                .unwrap(),
        )
        .build()
}

/// Whether a node has the lock key of `name`.
async fn holds(server: &Redis, name: &str) -> bool {
    server
        .command(&["EXISTS", &format!("leasehold:{{{name}}}:lock")])
        .await
        .unwrap()
        == Resp::Integer(1)
}

#[tokio::test]
async fn bad_topologies_are_refused() {
    let servers = redis_servers(2).await.unwrap();
    let err = RedlockBackend::connect_nodes(&[], no_quarantine())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let same = vec![servers[0].url(), servers[0].url()];
    let err = RedlockBackend::connect_nodes(&same, no_quarantine())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let alias = vec![
        servers[0].url(),
        format!("redis://localhost:{}", servers[0].port()),
    ];
    let err = RedlockBackend::connect_nodes(&alias, no_quarantine())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("independent"), "{err}");
    // The same server behind another address (a proxy): caught by its run id.
    let proxy = FaultProxy::start(servers[0].addr()).await.unwrap();
    let hidden = vec![
        servers[0].url(),
        format!("redis://127.0.0.1:{}", proxy.port()),
    ];
    let err = RedlockBackend::connect_nodes(&hidden, no_quarantine())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("same redis server"), "{err}");
    // An even number is allowed, with a warning.
    let even = RedlockBackend::connect_nodes(&urls(&servers), no_quarantine())
        .await
        .unwrap();
    assert_eq!(even.quorum(), 2);
    assert!(even.warnings().iter().any(|w| w.contains("even")));
}

#[tokio::test]
async fn two_of_five_down_still_grant_three_down_fail_and_leave_nothing() {
    let mut servers = redis_servers(5).await.unwrap();
    let c = client(&urls(&servers), no_quarantine(), Duration::from_secs(5)).await;
    servers[3].kill();
    servers[4].kill();
    let guard = c
        .mutex("job")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .expect("3 of 5");
    guard.release().await.unwrap();

    servers[2].kill();
    let attempt = c
        .mutex("job")
        .unwrap()
        .lock_timeout(Duration::from_secs(3))
        .await;
    match attempt {
        Err(Error::Unavailable { message, .. }) => {
            assert!(message.contains("majority"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    c.settle().await;
    for survivor in &servers[..2] {
        assert!(!holds(survivor, "job").await);
        assert_eq!(
            survivor
                .command(&["EXISTS", "leasehold:{job}:qexp", "leasehold:{job}:queue"])
                .await
                .unwrap(),
            Resp::Integer(0),
            "a waiter entry was left behind"
        );
    }
}

#[tokio::test]
async fn a_node_slower_than_its_timeout_does_not_hold_up_a_grant() {
    let servers = redis_servers(5).await.unwrap();
    let slow = FaultProxy::start(servers[4].addr()).await.unwrap();
    let mut nodes = urls(&servers[..4]);
    nodes.push(format!("redis://127.0.0.1:{}", slow.port()));
    let options = no_quarantine()
        .node_timeout(Duration::from_millis(200))
        .unwrap();
    let c = client(&nodes, options, Duration::from_secs(5)).await;
    slow.set_delay(Direction::ToClient, Duration::from_secs(3));
    let guard = c
        .mutex("job")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .expect("4 of 5");
    guard.release().await.unwrap();
}

#[tokio::test]
async fn the_time_a_majority_took_is_taken_off_the_lease() {
    // Three nodes, two of them slow: the majority needs one slow node.
    let servers = redis_servers(3).await.unwrap();
    let mut nodes = vec![servers[0].url()];
    let mut proxies = Vec::new();
    for server in &servers[1..] {
        let proxy = FaultProxy::start(server.addr()).await.unwrap();
        nodes.push(format!("redis://127.0.0.1:{}", proxy.port()));
        proxy.set_delay(Direction::ToClient, Duration::from_millis(150));
        proxies.push(proxy);
    }
    let ttl = Duration::from_secs(2);
    let options = no_quarantine()
        .node_timeout(Duration::from_secs(1))
        .unwrap();
    let c = client(&nodes, options, ttl).await;
    let guard = c
        .mutex("job")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .expect("2 of 3");
    assert!(
        guard.remaining() <= ttl - Duration::from_millis(150),
        "{:?} left of a {ttl:?} lease that took 150 ms to win",
        guard.remaining()
    );
    guard.release().await.unwrap();
}

#[tokio::test]
async fn when_the_majority_answers_too_late_the_grant_is_refused_and_given_back() {
    let servers = redis_servers(5).await.unwrap();
    let mut proxies = Vec::new();
    let mut nodes = Vec::new();
    for server in &servers {
        let proxy = FaultProxy::start(server.addr()).await.unwrap();
        nodes.push(format!("redis://127.0.0.1:{}", proxy.port()));
        proxies.push(proxy);
    }
    let options = no_quarantine()
        .node_timeout(Duration::from_secs(2))
        .unwrap();
    let c = client(&nodes, options, Duration::from_millis(300)).await;
    // Three nodes answer after the whole lease is gone.
    for proxy in &proxies[..3] {
        proxy.set_delay(Direction::ToClient, Duration::from_millis(400));
    }
    let attempt = c.mutex("job").unwrap().try_lock().await.unwrap();
    assert!(attempt.is_none(), "a grant with no validity left was used");
    c.settle().await;
    for server in &servers {
        assert!(!holds(server, "job").await, "a grant was left behind");
    }
}

/// One section of the server's `INFO`.
async fn info(server: &Redis, section: &str) -> String {
    server
        .command(&["INFO", section])
        .await
        .unwrap()
        .text()
        .unwrap()
}

/// Seconds the server has been up, as it reports.
async fn uptime(server: &Redis) -> u64 {
    info(server, "server")
        .await
        .lines()
        .find_map(|l| l.strip_prefix("uptime_in_seconds:"))
        .and_then(|s| s.trim().parse().ok())
        .unwrap()
}

#[tokio::test]
async fn a_node_that_just_restarted_refuses_grants_for_the_quarantine() {
    let mut servers = redis_servers(3).await.unwrap();
    // Fresh servers: with the default quarantine (the request's ttl) nobody grants yet.
    let fresh = client(
        &urls(&servers),
        RedlockOptions::default(),
        Duration::from_secs(30),
    )
    .await;
    assert!(
        fresh
            .mutex("job")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none()
    );

    // Let the servers age past a 2 s quarantine, then restart one. The uptime is counted in
    // truncated seconds: a reading of 3 is more than 2 s.
    let quarantine = RedlockOptions::default().quarantine(Duration::from_secs(2));
    for server in &servers {
        while uptime(server).await < 3 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    servers[0].restart().await.unwrap();
    let c = client(&urls(&servers), quarantine, Duration::from_secs(5)).await;
    let guard = c
        .mutex("job")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .expect("2 of 3");
    // The restarted node refused its part; the two older ones granted.
    assert!(!holds(&servers[0], "job").await, "a restarted node granted");
    assert!(holds(&servers[1], "job").await && holds(&servers[2], "job").await);
    guard.release().await.unwrap();
}

/// A restarted node refuses grants for the whole quarantine, whenever the second ticks over.
/// Found by the chaos sample (restart-empty, under load): `uptime_in_seconds` reads 1 as soon
/// as the wall-clock second ticks over after a start, so nodes restarted about 300 ms earlier
/// ended a 1 s quarantine and a second majority formed while the first holder still held.
#[tokio::test]
async fn the_quarantine_is_not_cut_short_by_the_wall_clock_second_ticking_over() {
    let mut servers = redis_servers(3).await.unwrap();
    let quarantine = Duration::from_secs(1);
    // A node timeout for a loaded machine (see no_quarantine).
    let options = RedlockOptions::default()
        .quarantine(quarantine)
        .node_timeout(Duration::from_secs(1))
        .unwrap();
    let mut judged = 0;
    for _ in 0..10 {
        // Two of three restart: a majority needs both of them.
        let spawned = std::time::Instant::now();
        servers[0].restart().await.unwrap();
        servers[1].restart().await.unwrap();
        // The moment both report an uptime of 1, which can be any time in their first second.
        while uptime(&servers[0]).await < 1 || uptime(&servers[1]).await < 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let c = client(&urls(&servers), options.clone(), Duration::from_secs(5)).await;
        let guard = c.mutex("job").unwrap().try_lock().await.unwrap();
        // Answered within the quarantine of the spawn, so within it of the servers' start.
        if spawned.elapsed() < quarantine {
            assert!(
                guard.is_none(),
                "granted by nodes up for less than {:?}",
                spawned.elapsed()
            );
            judged += 1;
        }
        if let Some(guard) = guard {
            guard.release().await.unwrap();
        }
    }
    // Each round is judged unless its second ticked over at the very end of the quarantine.
    assert!(judged > 0, "no round answered within the quarantine");
    // Past the quarantine the nodes grant again.
    let c = client(&urls(&servers), options, Duration::from_secs(5)).await;
    let mutex = c.mutex("job").unwrap();
    let guard = mutex.lock_timeout(Duration::from_secs(10)).await.unwrap();
    assert!(guard.is_some(), "the quarantine never ended");
}

#[tokio::test]
async fn a_key_expiring_early_on_one_node_makes_two_holders_and_fencing_refuses_the_stale_one() {
    // Five nodes; A reaches 1-3, B reaches 3-5 (each through proxies that cut the rest).
    let servers = redis_servers(5).await.unwrap();
    let mut nodes_a = Vec::new();
    let mut nodes_b = Vec::new();
    let mut proxies = Vec::new();
    for (i, server) in servers.iter().enumerate() {
        let to_a = FaultProxy::start(server.addr()).await.unwrap();
        let to_b = FaultProxy::start(server.addr()).await.unwrap();
        nodes_a.push(format!("redis://127.0.0.1:{}", to_a.port()));
        nodes_b.push(format!("redis://127.0.0.1:{}", to_b.port()));
        if i >= 3 {
            to_a.cut(Direction::Both);
        }
        if i < 2 {
            to_b.cut(Direction::Both);
        }
        proxies.push((to_a, to_b));
    }
    let ttl = Duration::from_secs(10);
    // Connecting to the cut nodes gives up after 1 s; they are reached lazily.
    let options = no_quarantine()
        .redis(leasehold_redis::RedisOptions::default().connect_timeout(Duration::from_secs(1)));
    let a = client(&nodes_a, options.clone(), ttl).await;
    let b = client(&nodes_b, options, ttl).await;
    let first = a
        .mutex("stock")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .expect("1-3");
    // Node 3's clock jumps forward (redis-server cannot run under libfaketime here): its
    // copy of the lock expires early.
    servers[2]
        .command(&["PEXPIRE", "leasehold:{stock}:lock", "0"])
        .await
        .unwrap();
    let second = b
        .mutex("stock")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .expect("3-5");
    // Two holders, each with a majority it believes in: what the checker must flag.
    assert!(
        first.is_held() && second.is_held(),
        "expected the double grant"
    );
    assert!(
        second.token() > first.token(),
        "the write-back must order the tokens"
    );
    let fence = Fence::new();
    let writes = Arc::new(Mutex::new(Vec::new()));
    fence
        .apply(second.token(), || writes.lock().unwrap().push("b"))
        .expect("the newer holder writes");
    let stale = fence.apply(first.token(), || writes.lock().unwrap().push("a"));
    assert!(stale.is_err(), "the stale holder's write was accepted");
    assert_eq!(*writes.lock().unwrap(), vec!["b"]);
    drop(proxies);
}

/// The fencing counter of `name` on a node.
async fn counter(server: &Redis, name: &str) -> u64 {
    match server
        .command(&["GET", &format!("leasehold:{{{name}}}:token")])
        .await
        .unwrap()
    {
        Resp::Bulk(Some(n)) => String::from_utf8(n).unwrap().parse().unwrap(),
        other => panic!("no counter: {other:?}"),
    }
}

#[tokio::test]
async fn the_write_back_round_runs_only_when_the_majoritys_counters_disagree() {
    let servers = redis_servers(3).await.unwrap();
    // A node timeout no busy test machine reaches: the counts below assume no retries.
    let options = no_quarantine()
        .node_timeout(Duration::from_secs(1))
        .unwrap();
    let c = client(&urls(&servers), options, Duration::from_secs(30)).await;
    let mutex = c.mutex("fenced").unwrap();
    let counter_key = "leasehold:{fenced}:token";
    for server in &servers {
        server.command(&["SET", counter_key, "100"]).await.unwrap();
        server.command(&["CONFIG", "RESETSTAT"]).await.unwrap();
    }
    // Counters agree: every node's grant says 101, and the grant is done in one round.
    let guard = mutex.try_lock().await.unwrap().expect("free");
    assert_eq!(guard.token().get(), 101);
    guard.release().await.unwrap();
    for server in &servers {
        // One acquire and one release each: no write-back.
        assert_eq!(server.scripts_run().await.unwrap(), 2);
        assert_eq!(counter(server, "fenced").await, 101);
    }

    // Counters apart (after split votes, say): whichever two nodes answer first, they
    // disagree, so the grant writes its token back; a majority then stands at it and the
    // next grant goes above it.
    for (server, at) in servers.iter().zip(["500", "300", "100"]) {
        server.command(&["SET", counter_key, at]).await.unwrap();
        server.command(&["CONFIG", "RESETSTAT"]).await.unwrap();
    }
    let guard = mutex.try_lock().await.unwrap().expect("free");
    let token = guard.token().get();
    assert!(token == 501 || token == 301, "token {token}");
    guard.release().await.unwrap();
    let mut raised = 0;
    let mut scripts = 0;
    for server in &servers {
        if counter(server, "fenced").await >= token {
            raised += 1;
        }
        scripts += server.scripts_run().await.unwrap();
    }
    assert!(raised >= 2, "only {raised} nodes stand at {token}");
    // An acquire and a release on each node, and the write-back on at least a majority.
    assert!(
        scripts >= 3 * 2 + 2,
        "{scripts} scripts: no write-back round"
    );
    let next = mutex.try_lock().await.unwrap().expect("free");
    assert!(
        next.token().get() > token,
        "{:?} is not above {token}",
        next.token()
    );
    next.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_over_a_thousand_contended_grants_with_nodes_restarting() {
    let mut servers = redis_servers(5).await.unwrap();
    let nodes = urls(&servers);
    // A restarted node sits out the quarantine (the 1 s ttl) while the others carry on.
    let clients = [
        client(&nodes, RedlockOptions::default(), Duration::from_secs(1)).await,
        client(&nodes, RedlockOptions::default(), Duration::from_secs(1)).await,
    ];
    // Let the fresh servers age past the quarantine once, with a first grant.
    let first = clients[0]
        .mutex("counter")
        .unwrap()
        .lock_timeout(Duration::from_secs(10))
        .await
        .unwrap()
        .expect("granted after the start-up quarantine");
    first.release().await.unwrap();

    // Each grant is recorded while it is held, so the record's order is the grants' order.
    // A record made by a holder whose lease ran out first (its task stalled for about the
    // 1 s lease on a loaded machine) is in no particular order: it is marked, not ordered.
    let tokens = Arc::new(Mutex::new(Vec::new()));
    for round in 0..10 {
        let mut tasks = Vec::new();
        for c in &clients {
            let mutex = c.mutex("counter").unwrap();
            let tokens = tokens.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..50 {
                    let guard = mutex.lock().await.unwrap();
                    let at = {
                        let mut tokens = tokens.lock().unwrap();
                        tokens.push((guard.token(), true));
                        tokens.len() - 1
                    };
                    // A lost guard is never held again: held now means held when recorded.
                    if !guard.is_held() {
                        tokens.lock().unwrap()[at].1 = false;
                    }
                    guard.release().await.unwrap();
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        // Between rounds, one node restarts empty.
        servers[round % 5].restart().await.unwrap();
    }
    let records = tokens.lock().unwrap();
    assert_eq!(records.len(), 1000);
    let held: Vec<_> = records.iter().filter(|r| r.1).map(|r| r.0).collect();
    assert!(
        held.len() >= 990,
        "{} of 1000 holders lost their lease before recording their token",
        1000 - held.len()
    );
    if let Some(i) = held.windows(2).position(|w| w[0] >= w[1]) {
        panic!(
            "tokens went backwards in the order the grants were made: {:?}",
            &held[i.saturating_sub(2)..(i + 3).min(held.len())]
        );
    }
}

/// How many lock channels a node has subscribers for.
async fn lock_channels(server: &Redis) -> usize {
    match server
        .command(&["PUBSUB", "CHANNELS", "leasehold:*"])
        .await
        .unwrap()
    {
        Resp::Array(Some(channels)) => channels.len(),
        other => panic!("{other:?}"),
    }
}

/// As for a single server, wake-up state is kept only while something needs it.
/// After observers of 100,000 distinct names and waiters on 300 more are done, no node has
/// a subscription of ours left, and the client no wake-up state (it kept one per name and
/// node before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_name_wakeup_state_returns_to_its_baseline_on_every_node() {
    const OBSERVED: usize = 100_000;
    const WAITED: usize = 300;
    let servers = redis_servers(3).await.unwrap();
    let backend = RedlockBackend::connect_nodes(&urls(&servers), no_quarantine())
        .await
        .unwrap();
    futures_util::stream::iter(0..OBSERVED)
        .for_each_concurrent(256, |i| {
            let backend = backend.clone();
            async move {
                let name = LockName::new(&format!("order-{i}")).unwrap();
                let state = backend.inspect(&name).await.unwrap();
                backend
                    .wait(&name, &state.hint, Duration::from_secs(1))
                    .await
                    .unwrap();
            }
        })
        .await;
    for server in &servers {
        assert!(lock_channels(server).await > 0, "no subscription was made");
    }
    let holder = client(&urls(&servers), no_quarantine(), Duration::from_secs(30)).await;
    futures_util::stream::iter(0..WAITED)
        .for_each_concurrent(32, |i| {
            let (holder, backend) = (&holder, &backend);
            async move {
                let name = format!("job-{i}");
                let held = holder.mutex(&name).unwrap().lock().await.unwrap();
                let faults = Faulty::wrap(Arc::new(backend.clone()));
                let mutex = Client::builder(faults.clone())
                    .options(
                        LockOptions::builder()
                            .ttl(Duration::from_secs(30))
                            .request_timeout(Duration::from_secs(2))
                            .build()
                            .unwrap(),
                    )
                    .build()
                    .mutex(&name)
                    .unwrap();
                let waiting = tokio::spawn(async move { mutex.lock().await.unwrap() });
                // Subscribed (the first wait) and asleep (the second): woken by the push.
                faults.until_calls(Op::Wait, 2).await;
                held.release().await.unwrap();
                waiting.await.unwrap().release().await.unwrap();
            }
        })
        .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    for server in &servers {
        loop {
            let left = lock_channels(server).await;
            if left == 0 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{left} lock channels are still subscribed on a node"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    assert_eq!(backend.wakeup_channels(), 0);
}

/// One stalled node (SIGSTOP) does not hold up connecting while a majority answers.
/// It is connected in the background once it answers again. (Its connect timeout is a
/// minute: connecting that waited for it would not end within the test's bound.)
#[tokio::test]
async fn a_paused_node_does_not_hold_up_connecting() {
    let servers = redis_servers(3).await.unwrap();
    servers[2].pause();
    let options = no_quarantine()
        .redis(leasehold_redis::RedisOptions::default().connect_timeout(Duration::from_secs(60)));
    let backend = tokio::time::timeout(
        Duration::from_secs(20),
        RedlockBackend::connect_nodes(&urls(&servers), options),
    )
    .await
    .expect("connecting waited for the paused node")
    .unwrap();
    let c = Client::builder(backend)
        .options(
            LockOptions::builder()
                .ttl(Duration::from_secs(5))
                .request_timeout(Duration::from_secs(2))
                .build()
                .unwrap(),
        )
        .build();
    let guard = c
        .mutex("job")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .expect("2 of 3");
    guard.release().await.unwrap();
    servers[2].resume();
    // The paused node is reached in the background: grants come to include it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let guard = c.mutex("job").unwrap().lock().await.unwrap();
        let included = holds(&servers[2], "job").await;
        guard.release().await.unwrap();
        if included {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the resumed node was never used"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An exclusive request on `name` by a new owner.
fn exclusive(name: &str, ttl: Duration) -> Request {
    Request::new(
        LockName::new(name).unwrap(),
        OwnerId::generate(),
        Mode::Exclusive,
        ttl,
    )
}

/// The value of `name`'s lock key on a node, if any.
async fn lock_value(server: &Redis, name: &str) -> Option<String> {
    match server
        .command(&["GET", &format!("leasehold:{{{name}}}:lock")])
        .await
        .unwrap()
    {
        Resp::Bulk(value) => value.map(|v| String::from_utf8(v).unwrap()),
        other => panic!("{other:?}"),
    }
}

/// Closes every connection through `link`, dropping the bytes it held, then heals it.
/// New connections are refused meanwhile: the client reconnects at once.
async fn reset_and_heal(link: &FaultProxy) {
    link.refuse_new(true);
    link.reset();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while link.connections() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "connections stay open"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    link.heal();
}

/// Polls a node until `done` holds for the lock key of "job" (server-side state).
async fn until_lock(server: &Redis, done: impl Fn(Option<&str>) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done(lock_value(server, "job").await.as_deref()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lock key never changed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A retry that adopts a grant an earlier attempt left on a node gets a newer token.
/// Its token is above every grant made meanwhile. Two link faults: O's first attempt
/// reaches node A but its answer is lost; P then wins B and C with token 51, but its
/// write-back to B is lost, so B's counter stays low. O's retry wins A (where its old grant
/// holds token 6) and B (12): answering with the stored 6 made O's token 12, below P's 51,
/// though O was granted after P.
#[tokio::test]
async fn a_retry_that_adopts_an_earlier_grant_gets_a_token_above_grants_made_since() {
    let servers = redis_servers(3).await.unwrap();
    for (server, at) in servers.iter().zip(["5", "10", "50"]) {
        server
            .command(&["SET", "leasehold:{job}:token", at])
            .await
            .unwrap();
    }
    let mut o_links = Vec::new();
    let mut p_links = Vec::new();
    for server in &servers {
        o_links.push(FaultProxy::start(server.addr()).await.unwrap());
        p_links.push(FaultProxy::start(server.addr()).await.unwrap());
    }
    let via = |links: &[FaultProxy]| -> Vec<String> {
        links
            .iter()
            .map(|l| format!("redis://127.0.0.1:{}", l.port()))
            .collect()
    };
    let o = RedlockBackend::connect_nodes(
        &via(&o_links),
        no_quarantine()
            .node_timeout(Duration::from_secs(1))
            .unwrap(),
    )
    .await
    .unwrap();
    let p = RedlockBackend::connect_nodes(
        &via(&p_links),
        no_quarantine()
            .node_timeout(Duration::from_secs(3))
            .unwrap(),
    )
    .await
    .unwrap();
    let (a, b, c) = (&servers[0], &servers[1], &servers[2]);

    // O's first attempt: granted on A, the answer lost; B and C never see it.
    let o_req = exclusive("job", Duration::from_secs(30));
    o_links[0].cut(Direction::ToClient);
    o_links[1].cut(Direction::Both);
    o_links[2].cut(Direction::Both);
    let first = tokio::spawn({
        let (o, o_req) = (o.clone(), o_req.clone());
        async move { o.acquire(&o_req).await }
    });
    let owner = format!("{} ", o_req.owner);
    until_lock(a, |v| v.is_some_and(|v| v.starts_with(&owner))).await;
    // Its clean-up release does not get through either; the link then drops what it held.
    o_links[0].cut(Direction::ToServer);
    assert!(first.await.unwrap().is_err(), "no node answered O");
    for link in &o_links {
        reset_and_heal(link).await;
    }
    assert_eq!(lock_value(a, "job").await, Some(format!("{owner}6")));

    // P wins B (11) and C (51): token 51. Its write-back reaches A and C, not B.
    let p_req = exclusive("job", Duration::from_secs(3));
    p_links[1].set_delay(Direction::ToClient, Duration::from_millis(1500));
    let granted = tokio::spawn({
        let (p, p_req) = (p.clone(), p_req.clone());
        async move { p.acquire(&p_req).await }
    });
    let p_owner = format!("{} ", p_req.owner);
    until_lock(b, |v| v.is_some_and(|v| v.starts_with(&p_owner))).await;
    p_links[1].cut(Direction::ToServer);
    let Acquire::Granted(p_grant) = granted.await.unwrap().unwrap() else {
        panic!("P was not granted by B and C");
    };
    assert_eq!(p_grant.token.get(), 51);
    assert!(matches!(
        p.release(&p_req).await.unwrap(),
        Release::Released
    ));
    reset_and_heal(&p_links[1]).await;
    // P's grant on B runs out (its release was lost with the link).
    until_lock(b, |v| v.is_none()).await;
    assert!(lock_value(c, "job").await.is_none());

    // O tries again with the same owner; A and B answer first.
    o_links[2].set_delay(Direction::ToClient, Duration::from_millis(500));
    let Acquire::Granted(o_grant) = o.acquire(&o_req).await.unwrap() else {
        panic!("O was not granted by A and B");
    };
    assert!(
        o_grant.token > p_grant.token,
        "O was granted after P with token {} below P's {}",
        o_grant.token,
        p_grant.token
    );
}

/// A record a majority did not take is taken back; a record on any node is read.
/// A job must not run twice: the value on the most nodes is read, none only where no node
/// has one; a read needs a majority of answers.
#[tokio::test]
async fn a_record_stands_with_a_majority_and_is_read_from_any_node() {
    let mut servers = redis_servers(5).await.unwrap();
    let redlock = RedlockBackend::connect_nodes(&urls(&servers), no_quarantine())
        .await
        .unwrap();
    let req = exclusive("job", Duration::from_secs(60));
    assert!(matches!(
        redlock.acquire(&req).await.unwrap(),
        Acquire::Granted(_)
    ));
    let (name, key) = (req.name.clone(), RecordKey::new("window:1").unwrap());
    let record = "leasehold:{job}:rec:window:1";
    let keep = Duration::from_secs(600);
    // The grant is gone from three nodes: two write, three refuse, and the two take it back.
    for server in &servers[..3] {
        server
            .command(&["DEL", "leasehold:{job}:lock"])
            .await
            .unwrap();
    }
    assert!(!redlock.put_record(&req, &key, b"one", keep).await.unwrap());
    for server in &servers {
        let left = server.command(&["EXISTS", record]).await.unwrap();
        assert_eq!(left, Resp::Integer(0), "a record a majority did not take");
    }
    assert_eq!(redlock.get_record(&name, &key).await.unwrap(), None);

    // Any copy is read; of several values, the one on the most nodes.
    servers[4].command(&["SET", record, "v"]).await.unwrap();
    let read = redlock.get_record(&name, &key).await.unwrap();
    assert_eq!(read.as_deref(), Some(&b"v"[..]));
    for server in &servers[..2] {
        server.command(&["SET", record, "w"]).await.unwrap();
    }
    let read = redlock.get_record(&name, &key).await.unwrap();
    assert_eq!(read.as_deref(), Some(&b"w"[..]));

    for server in &mut servers[..3] {
        server.kill();
    }
    let read = redlock.get_record(&name, &key).await;
    assert!(matches!(read, Err(Error::Unavailable { .. })), "{read:?}");
}

/// The waiters queued on a node for `name`, head first, with their places.
async fn queue(server: &Redis, name: &str) -> Vec<(String, u64)> {
    let key = format!("leasehold:{{{name}}}:queue");
    let reply = server
        .command(&["ZRANGE", &key, "0", "-1", "WITHSCORES"])
        .await
        .unwrap();
    let Resp::Array(Some(items)) = reply else {
        panic!("ZRANGE {key}: {reply:?}");
    };
    let texts: Vec<String> = items.iter().map(|i| i.text().unwrap()).collect();
    texts
        .chunks(2)
        .map(|pair| (pair[0].clone(), pair[1].parse().unwrap()))
        .collect()
}

/// The script calls (`EVALSHA`) a node has served.
async fn script_calls(server: &Redis) -> u64 {
    info(server, "commandstats")
        .await
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

/// Waiters are granted in the order their acquisitions began, one try each, with no herd.
/// They queue on every node in that order, and each release wakes only the next. A herd (every waiter trying again at each release) would take 8 + 7 + … + 1 = 36
/// acquire calls on a node for the eight hand-offs, not eight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_granted_in_the_order_they_began_one_wake_up_each() {
    const WAITERS: usize = 8;
    let servers = redis_servers(3).await.unwrap();
    let nodes = urls(&servers);
    let ttl = Duration::from_secs(30);
    let holder = client(&nodes, no_quarantine(), ttl).await;
    let held = holder.mutex("line").unwrap().lock().await.unwrap();
    let granted = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..WAITERS {
        let waiter = client(&nodes, no_quarantine(), ttl).await;
        let granted = granted.clone();
        tasks.push(tokio::spawn(async move {
            let guard = waiter.mutex("line").unwrap().lock().await.unwrap();
            granted.lock().unwrap().push(i);
            guard.release().await.unwrap();
        }));
        // Queued on every node before the next begins, and the clock past its place (places
        // are milliseconds: two acquisitions begun within one are ordered by owner id).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let queues = join_all(servers.iter().map(|s| queue(s, "line"))).await;
            let place = queues[0].last().map(|q| q.1);
            if queues.iter().all(|q| q.len() == i + 1)
                && place.is_some_and(|p| leasehold_core::events::steady_ms_now() > p)
            {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "{queues:?}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    // Every node queues them in one order.
    let queues = join_all(servers.iter().map(|s| queue(s, "line"))).await;
    assert!(queues.iter().all(|q| q == &queues[0]), "{queues:?}");

    let calls_before = join_all(servers.iter().map(script_calls)).await;
    held.release().await.unwrap();
    let all_served = async {
        for task in tasks {
            task.await.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(60), all_served)
        .await
        .expect("every waiter is served within a minute");
    assert_eq!(*granted.lock().unwrap(), (0..WAITERS).collect::<Vec<_>>());
    // Per node: the holder's release, then each waiter's acquire and release (2 × 8 + 1),
    // and perhaps a waiter's try right after it subscribed, not counted before (8 more). A
    // waiter woken by one node well before the others (a loaded machine) may split the
    // vote: a few calls more for each time. A herd makes 45 at least.
    let calls_after = join_all(servers.iter().map(script_calls)).await;
    for (before, after) in calls_before.iter().zip(&calls_after) {
        let calls = after - before;
        assert!(
            calls <= 5 * WAITERS as u64,
            "{calls} script calls for {WAITERS} hand-offs"
        );
    }
    for server in &servers {
        assert!(queue(server, "line").await.is_empty());
    }
}

/// Another owner's grant of `name` on each of `servers`, each by a single-server client.
/// The request and the clients, to release it with.
async fn held_by_another(servers: &[Redis], name: &str) -> (Request, Vec<RedisBackend>) {
    let other = exclusive(name, Duration::from_secs(30));
    let mut singles = Vec::new();
    for server in servers {
        let single = RedisBackend::connect(&server.url()).await.unwrap();
        assert!(matches!(
            single.acquire(&other).await.unwrap(),
            Acquire::Granted(_)
        ));
        singles.push(single);
    }
    (other, singles)
}

/// A waiting exclusive request on `name` by a new owner whose acquisition began at `began_ms`.
fn waiting(name: &str, began_ms: u64) -> Request {
    let mut req = exclusive(name, Duration::from_secs(30));
    req.waiting = true;
    req.began_ms = began_ms;
    req
}

/// Every node queues waiters by when their acquisitions began, whatever order they arrive in.
/// The one that began first is at the head everywhere, also where it arrived last.
#[tokio::test]
async fn the_nodes_queue_waiters_in_one_order_whatever_order_they_arrive_in() {
    let servers = redis_servers(3).await.unwrap();
    let redlock = RedlockBackend::connect_nodes(&urls(&servers), no_quarantine())
        .await
        .unwrap();
    let holder = exclusive("order", Duration::from_secs(30));
    assert!(matches!(
        redlock.acquire(&holder).await.unwrap(),
        Acquire::Granted(_)
    ));
    let now = leasehold_core::events::steady_ms_now();
    let (early, late) = (waiting("order", now - 5), waiting("order", now));
    // The later one asks first.
    for req in [&late, &early] {
        assert!(matches!(
            redlock.acquire(req).await.unwrap(),
            Acquire::Busy(_)
        ));
    }
    let expected = vec![
        (format!("x{}", early.owner), now - 5),
        (format!("x{}", late.owner), now),
    ];
    for server in &servers {
        assert_eq!(queue(server, "order").await, expected);
    }
    for req in [&holder, &early, &late] {
        redlock.release(req).await.unwrap();
    }
    for server in &servers {
        assert!(queue(server, "order").await.is_empty());
    }
}

/// A waiter's grant that made no majority goes back to the queue at its place.
/// Another waiter behind it is not let in there: the nodes still agree on who goes next.
/// Here another owner holds nodes 2 and 3, so W's grant on node 1 alone is given back.
#[tokio::test]
async fn a_grant_given_back_after_a_split_vote_keeps_its_place() {
    let servers = redis_servers(3).await.unwrap();
    let redlock = RedlockBackend::connect_nodes(&urls(&servers), no_quarantine())
        .await
        .unwrap();
    let (other, singles) = held_by_another(&servers[1..], "split").await;
    let now = leasehold_core::events::steady_ms_now();
    let w = waiting("split", now - 5);
    assert!(matches!(
        redlock.acquire(&w).await.unwrap(),
        Acquire::Busy(_)
    ));
    let first = &servers[0];
    // Not held on node 1 any more, but W is still first in line there.
    let value = lock_value(first, "split").await.unwrap();
    assert!(value.starts_with("* w0 "), "{value}");
    assert_eq!(
        queue(first, "split").await,
        [(format!("x{}", w.owner), now - 5)]
    );
    // V, who began later, finds node 1 taken by W's place: it is not granted there.
    let v = waiting("split", now);
    assert!(matches!(
        redlock.acquire(&v).await.unwrap(),
        Acquire::Busy(_)
    ));
    assert!(
        lock_value(first, "split")
            .await
            .unwrap()
            .starts_with("* w0 ")
    );
    assert_eq!(
        queue(first, "split").await,
        [
            (format!("x{}", w.owner), now - 5),
            (format!("x{}", v.owner), now)
        ]
    );
    // Once the other owner has let go, W is granted everywhere, ahead of V.
    for single in &singles {
        single.release(&other).await.unwrap();
    }
    assert!(matches!(
        redlock.acquire(&v).await.unwrap(),
        Acquire::Busy(_)
    ));
    assert!(matches!(
        redlock.acquire(&w).await.unwrap(),
        Acquire::Granted(_)
    ));
    for req in [&w, &v] {
        redlock.release(req).await.unwrap();
    }
    for server in &servers {
        assert!(queue(server, "split").await.is_empty());
    }
}

/// A release is "not held" only when a majority of nodes says so.
/// Nodes that never held the grant answering while those that hold it are silent (paused)
/// is an outage (an error the engine retries), not a grant lost unnoticed.
#[tokio::test]
async fn a_release_is_not_held_only_on_a_majoritys_word() {
    let servers = redis_servers(5).await.unwrap();
    let redlock = RedlockBackend::connect_nodes(&urls(&servers), no_quarantine())
        .await
        .unwrap();
    // Another owner holds nodes 4 and 5: the grant is on nodes 1 to 3 only.
    let _other = held_by_another(&servers[3..], "job").await;
    let req = exclusive("job", Duration::from_secs(30));
    assert!(matches!(
        redlock.acquire(&req).await.unwrap(),
        Acquire::Granted(_)
    ));
    for server in &servers[..3] {
        server.pause();
    }
    let answer = redlock.release(&req).await;
    for server in &servers[..3] {
        server.resume();
    }
    assert!(
        matches!(answer, Err(Error::Unavailable { .. })),
        "{answer:?}"
    );
    // The paused nodes ran the release once resumed; asked again, a majority says "not
    // held" (the engine takes that, after an unanswered attempt, as released).
    assert!(matches!(
        redlock.release(&req).await.unwrap(),
        Release::NotHeld
    ));
    for server in &servers[..3] {
        assert!(!holds(server, "job").await);
    }
}
