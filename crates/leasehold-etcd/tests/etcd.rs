//! What only the etcd backend promises, against real etcd members.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold_core::backend::{Backend, Mode, Request};
use leasehold_core::{
    Client, Error, FencingToken, Guard, LockName, LockOptions, LockState, LossReason, NamePrefix,
    OwnerId, RecordKey,
};
use leasehold_etcd::{EtcdBackend, EtcdOptions};
use leasehold_testkit::{Direction, Etcd, FaultProxy};

/// Three members whose election timeout is etcd's default, 1 s, for the tests that pause one.
/// With one member paused the other two must hear each other within it, or they elect a
/// leader again — and every new leader renews every lease, so a lease that should run out
/// lives on through a series of elections. The testkit's 200 ms is too short for that on a
/// loaded two-core machine.
async fn cluster() -> Etcd {
    Etcd::cluster_with_election_timeout(3, Duration::from_secs(1))
        .await
        .unwrap()
}

/// Lock options with 2 s request timeouts; the lease is the session's.
fn options() -> LockOptions {
    LockOptions::builder()
        .request_timeout(Duration::from_secs(2))
        .build()
        .unwrap()
}

async fn backend(endpoints: &[String], session_ttl: Duration) -> EtcdBackend {
    let endpoints: Vec<String> = endpoints.iter().map(|e| format!("http://{e}")).collect();
    let options = EtcdOptions::default().session_ttl(session_ttl).unwrap();
    EtcdBackend::connect_with(&endpoints, options)
        .await
        .unwrap()
}

async fn client(endpoints: &[String], session_ttl: Duration) -> Client {
    Client::builder(backend(endpoints, session_ttl).await)
        .options(options())
        .build()
}

/// The lock "job" for `client` within `within`; fails the test with `why` if not granted.
async fn job_within(client: &Client, within: Duration, why: &str) -> Guard {
    client
        .mutex("job")
        .unwrap()
        .lock_timeout(within)
        .await
        .unwrap()
        .expect(why)
}

/// Waits, without polling, until `check` holds for the state of `name` as `observer` sees it.
async fn until(observer: &Client, name: &str, check: impl Fn(&leasehold_core::LockState) -> bool) {
    let lock = LockName::new(name).unwrap();
    loop {
        let state = observer.inspect(name).await.unwrap();
        if check(&state) {
            return;
        }
        observer
            .backend()
            .wait(&lock, &state.hint, Duration::from_secs(5))
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn a_waiter_whose_session_expires_while_queued_is_never_granted() {
    let mut etcd = Etcd::start().await.unwrap();
    let proxy = FaultProxy::start(etcd.members()[0].addr()).await.unwrap();
    let holder = client(&etcd.endpoints(), Duration::from_secs(2)).await;
    let waiter = client(
        &[format!("127.0.0.1:{}", proxy.port())],
        Duration::from_secs(2),
    )
    .await;
    let held = holder.mutex("job").unwrap().lock().await.unwrap();
    let mutex = waiter.mutex("job").unwrap();
    let waiting = tokio::spawn(async move { mutex.lock().await });
    until(&holder, "job", |s| s.waiters.len() == 1).await;
    // The waiter's keep-alives stop reaching etcd: its lease, and its queue entry, expire.
    proxy.cut(Direction::Both);
    until(&holder, "job", |s| s.waiters.is_empty()).await;
    held.release().await.unwrap();
    proxy.heal();
    let answer = tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("the waiter never answered")
        .unwrap();
    assert!(
        matches!(answer, Err(Error::Lost(LossReason::SessionEnded))),
        "a waiter was granted on a dead session: {answer:?}"
    );
    assert!(
        holder
            .mutex("job")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
}

#[tokio::test]
async fn a_paused_leader_never_lets_two_guards_be_held_at_once() {
    let mut etcd = cluster().await;
    let endpoints = etcd.endpoints();
    let a = client(&endpoints, Duration::from_secs(3)).await;
    let b = client(&endpoints, Duration::from_secs(3)).await;
    let first = a.mutex("job").unwrap().lock().await.unwrap();
    let leader = etcd.leader().await.unwrap();
    etcd.members()[leader].process().pause();
    // The others elect a new leader; A keeps its session alive through them or loses it.
    let second = b
        .mutex("job")
        .unwrap()
        .lock_timeout(Duration::from_secs(8))
        .await
        .unwrap_or(None);
    if let Some(second) = &second {
        assert!(!first.is_held(), "two guards held at once");
        assert!(second.token() > first.token());
    }
    // Neither outcome of the pause is required (A may keep its lease through the new
    // leader, or lose it while B's requests still sit on the paused member), but once the
    // member is back the lock must be grantable again, and never to two at once.
    etcd.members()[leader].process().resume();
    if second.is_none() {
        let first_token = first.token();
        // Held or lost by now; either way giving it back must not fail the lock for B.
        let _ = first.release().await;
        let next = job_within(
            &b,
            Duration::from_secs(20),
            "the lock stayed closed after the member came back",
        )
        .await;
        assert!(next.token() > first_token);
    }
}

#[tokio::test]
async fn the_member_the_client_talks_to_paused_costs_it_the_lock_at_its_deadline() {
    let mut etcd = cluster().await;
    let endpoints = etcd.endpoints();
    let only_first = client(&endpoints[..1], Duration::from_secs(2)).await;
    let others = client(&endpoints[1..], Duration::from_secs(2)).await;
    let guard = only_first.mutex("job").unwrap().lock().await.unwrap();
    etcd.members()[0].process().pause();
    tokio::time::timeout(Duration::from_secs(10), guard.lost())
        .await
        .expect("the guard outlived its unreachable session");
    let next = job_within(
        &others,
        Duration::from_secs(15),
        "granted once the lease expired",
    )
    .await;
    assert!(next.token() > guard.token());
    etcd.members()[0].process().resume();
}

#[tokio::test]
async fn a_client_moves_on_to_the_next_member_when_its_member_pauses() {
    let mut etcd = cluster().await;
    let endpoints = etcd.endpoints();
    // A client connects to the first member it is given.
    let client = client(&endpoints, Duration::from_secs(2)).await;
    let guard = job_within(&client, Duration::from_secs(5), "the lock was free").await;
    etcd.members()[0].process().pause();
    let paused = Instant::now();
    // The session's keep-alives sit on the paused member longer than its lease lasts.
    tokio::time::timeout(Duration::from_secs(10), guard.lost())
        .await
        .expect("the guard outlived its unreachable session");
    // The same client, with a new session on another member, gets the lock once the
    // lease of the old one has run out on the others. Requests already on the paused
    // member fail (unavailable) when its connection is given up; they are tried again.
    let give_up = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut attempts = Vec::new();
    let next = loop {
        let left = give_up.saturating_duration_since(tokio::time::Instant::now());
        assert!(
            !left.is_zero(),
            "the client did not move on from the paused member; its attempts:\n{}",
            attempts.join("\n")
        );
        let started = paused.elapsed();
        let attempt = client.mutex("job").unwrap().lock_timeout(left).await;
        attempts.push(format!(
            "{started:?} + {:?}: {:?}",
            paused.elapsed() - started,
            attempt.as_ref().map(|g| g.as_ref().map(Guard::token))
        ));
        match attempt {
            Ok(Some(next)) => break next,
            Ok(None) => {}
            Err(error) => assert!(error.is_retryable(), "{error}"),
        }
    };
    assert!(next.token() > guard.token());
    etcd.members()[0].process().resume();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_over_a_thousand_grants_with_a_member_restarting() {
    // The testkit's short election timeout: a killed leader is replaced within a session
    // ttl even on a loaded machine (a waiter whose session ends is told, and this test
    // counts every grant).
    let mut etcd = Etcd::cluster(3).await.unwrap();
    let endpoints = etcd.endpoints();
    let clients = [
        client(&endpoints, Duration::from_secs(5)).await,
        client(&endpoints, Duration::from_secs(5)).await,
    ];
    let tokens = Arc::new(Mutex::new(Vec::new()));
    for round in 0..10 {
        let mut tasks = Vec::new();
        for c in &clients {
            let mutex = c.mutex("counter").unwrap();
            let tokens = tokens.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..50 {
                    let guard = mutex.lock().await.unwrap();
                    tokens.lock().unwrap().push(guard.token());
                    guard.release().await.unwrap();
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let member = &mut etcd.members()[round % 3];
        member.process().kill();
        member.restart().await.unwrap();
    }
    let tokens = tokens.lock().unwrap();
    assert_eq!(tokens.len(), 1000);
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens went backwards"
    );
}

#[tokio::test]
async fn the_owner_predicate_guards_writes_in_the_callers_own_transactions() {
    let etcd = Etcd::start().await.unwrap();
    let locks = backend(&etcd.endpoints(), Duration::from_secs(5)).await;
    let c = Client::builder(locks.clone()).options(options()).build();
    let guard = c.mutex("ledger").unwrap().lock().await.unwrap();
    // etcdctl's transaction: the comparison, a blank line, the writes, a blank line.
    let condition = locks.still_owner(&guard);
    let write = |value: &str| {
        format!(
            "create(\"{}\") = \"{}\"\n\nput books/balance {value}\n\n\n",
            String::from_utf8(condition.key.clone()).unwrap(),
            condition.create_revision
        )
    };
    let txn = async |input: String| etcd.etcdctl(&["txn"], &input).await.unwrap();
    assert!(txn(write("100")).await.starts_with("SUCCESS"));
    guard.release().await.unwrap();
    assert!(
        txn(write("42")).await.starts_with("FAILURE"),
        "a write after the release"
    );
    let balance = etcd
        .etcdctl(&["get", "--print-value-only", "books/balance"], "")
        .await
        .unwrap();
    assert_eq!(balance.trim_end(), "100");
}

/// `put_if_owner` and `delete_if_owner`: the fenced write as one call.
/// They write while the guard holds; after it was evicted and the lock moved on they change
/// nothing, and each refusal counts in `leasehold_fence_refusals_total{fence="etcd"}`, as do
/// the ones of the caller's own transactions counted by hand. A key among the lock's own,
/// which etcd would count as a contender, is refused.
#[tokio::test]
async fn a_fenced_put_or_delete_writes_only_while_held_and_counts_its_refusals() {
    let refusals = || {
        let text = leasehold_testkit::recorded_metrics();
        let label = ["fence=\"etcd\""];
        leasehold_testkit::metric_value(&text, "leasehold_fence_refusals_total", &label)
            .unwrap_or(0.0)
    };
    // Only this test of the file counts refusals.
    let before = refusals();
    let etcd = Etcd::start().await.unwrap();
    let locks = backend(&etcd.endpoints(), Duration::from_secs(2)).await;
    let c = Client::builder(locks.clone()).options(options()).build();
    let operating = backend(&etcd.endpoints(), Duration::from_secs(2)).await;
    let operator = Client::builder(operating.clone())
        .options(options())
        .build();
    let get = async |key: &str| {
        let value = etcd.etcdctl(&["get", "--print-value-only", key], "").await;
        value.unwrap().trim_end().to_owned()
    };

    let stale = c.mutex("ledger").unwrap().lock().await.unwrap();
    assert!(
        locks
            .put_if_owner(&stale, "books/balance", "100")
            .await
            .unwrap()
    );
    assert!(locks.put_if_owner(&stale, "books/note", "x").await.unwrap());
    assert!(locks.delete_if_owner(&stale, "books/note").await.unwrap());
    for inside in [
        "ledger/balance",
        "ledger#delay/x",
        "#sessions/1",
        "#evictions/ledger/3",
    ] {
        let refused = locks.put_if_owner(&stale, inside, "1").await;
        assert!(
            matches!(refused, Err(Error::InvalidArgument { .. })),
            "{refused:?}"
        );
    }
    assert!(locks.put_if_owner(&stale, "ledgers", "1").await.unwrap());
    assert_eq!(refusals(), before);
    // Evicted: the guard is still there, and the lock moves on to another client.
    operator
        .evict("ledger", None, "ops@host", "stuck")
        .await
        .unwrap();
    assert_eq!(stale.lost().await, LossReason::Evicted);
    let next = operator.mutex("ledger").unwrap().lock().await.unwrap();
    assert!(
        !locks
            .put_if_owner(&stale, "books/balance", "42")
            .await
            .unwrap()
    );
    assert!(
        !locks
            .delete_if_owner(&stale, "books/balance")
            .await
            .unwrap()
    );
    assert_eq!(get("books/balance").await, "100");
    assert!(
        operating
            .put_if_owner(&next, "books/balance", "7")
            .await
            .unwrap()
    );
    assert_eq!(get("books/balance").await, "7");
    assert_eq!(refusals(), before + 2.0);
    locks.still_owner(&stale).count_refusal();
    assert_eq!(refusals(), before + 3.0);
    next.release().await.unwrap();
    drop(stale);
}

/// The keys under `prefix`, as etcd has them.
async fn keys_under(etcd: &Etcd, prefix: &str) -> Vec<String> {
    let found = etcd
        .etcdctl(&["get", "--prefix", "--keys-only", prefix], "")
        .await
        .unwrap();
    found
        .lines()
        .filter(|line| !line.is_empty())
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn the_session_ttl_is_what_etcd_grants_and_what_inspect_shows() {
    let etcd = Etcd::start().await.unwrap();
    let locks = backend(&etcd.endpoints(), Duration::from_millis(1500)).await;
    assert_eq!(
        locks.capabilities().session_ttl,
        Some(Duration::from_secs(2)),
        "rounded up to whole seconds before any session exists"
    );
    let c = Client::new(locks.clone());
    let guard = c.mutex("job").unwrap().lock().await.unwrap();
    assert_eq!(locks.session_ttl().await, Some(Duration::from_secs(2)));
    assert!(guard.remaining() <= Duration::from_secs(2));
    // inspect shows the time left on the session's lease.
    let state = c.inspect("job").await.unwrap();
    let left = state.holders[0].remaining.expect("a lease");
    assert!(
        left > Duration::ZERO && left <= Duration::from_secs(2),
        "{left:?}"
    );
    // A lock cannot ask for another ttl than its session's.
    let other_ttl = LockOptions::builder()
        .ttl(Duration::from_secs(3))
        .build()
        .unwrap();
    assert!(matches!(
        c.mutex("job2")
            .unwrap()
            .with_options(other_ttl)
            .try_lock()
            .await,
        Err(Error::InvalidArgument { what: "ttl", .. })
    ));
    assert!(matches!(
        EtcdOptions::default().session_ttl(Duration::from_millis(500)),
        Err(Error::InvalidArgument { .. })
    ));
    guard.release().await.unwrap();
}

#[tokio::test]
async fn a_session_ttl_below_etcds_minimum_is_refused_not_lengthened() {
    // Election timeout 3 s: etcd's minimum lease ttl is 1.5 election timeouts, 5 s.
    let etcd = Etcd::start_with_election_timeout(Duration::from_secs(3))
        .await
        .unwrap();
    let locks = backend(&etcd.endpoints(), Duration::from_secs(2)).await;
    let c = Client::new(locks.clone());
    let refused = c.mutex("job").unwrap().try_lock().await.unwrap_err();
    assert!(
        matches!(
            refused,
            Error::InvalidArgument {
                what: "session ttl",
                ..
            }
        ),
        "{refused:?}"
    );
    assert_eq!(locks.session_ttl().await, None, "no session was started");
    let leases = etcd.etcdctl(&["lease", "list"], "").await.unwrap();
    assert!(
        leases.starts_with("found 0 leases"),
        "the lease granted was revoked: {leases}"
    );
    // What etcd does grant works.
    let locks = backend(&etcd.endpoints(), Duration::from_secs(5)).await;
    let c = Client::new(locks);
    assert!(c.mutex("job").unwrap().try_lock().await.unwrap().is_some());
}

#[tokio::test]
async fn closing_the_session_frees_every_lock_at_once() {
    let etcd = Etcd::start().await.unwrap();
    let locks = backend(&etcd.endpoints(), Duration::from_secs(30)).await;
    // A close is not a vanishing: a lock with a lock-delay opens at once too.
    let with_delay = options()
        .to_builder()
        .lock_delay(Duration::from_secs(30))
        .build()
        .unwrap();
    let c = Client::builder(locks.clone()).options(with_delay).build();
    let other = client(&etcd.endpoints(), Duration::from_secs(30)).await;
    let a = c.mutex("a").unwrap().lock().await.unwrap();
    let b = c.semaphore("b", 1).unwrap().acquire().await.unwrap();
    locks.close().await.unwrap();
    assert_eq!(a.lost().await, LossReason::SessionEnded);
    assert_eq!(b.lost().await, LossReason::SessionEnded);
    // No waiting for the 30 s lease, nor the lock-delay: revoked.
    assert!(
        other
            .mutex("a")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        other
            .semaphore("b", 1)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_some()
    );
    // A later acquisition starts a new session.
    drop(a);
    assert!(c.mutex("c").unwrap().try_lock().await.unwrap().is_some());
}

#[tokio::test]
async fn a_busy_name_reuses_its_keys_instead_of_piling_up_deleted_ones() {
    let etcd = Etcd::start().await.unwrap();
    let c = client(&etcd.endpoints(), Duration::from_secs(5)).await;
    let mut keys = std::collections::BTreeSet::new();
    let semaphore = c.semaphore("pool", 2).unwrap();
    for _ in 0..10 {
        let a = semaphore.acquire().await.unwrap();
        let b = semaphore.acquire().await.unwrap();
        let now = keys_under(&etcd, "pool#permits/").await;
        assert_eq!(now.len(), 2, "{now:?}");
        keys.extend(now);
        a.release().await.unwrap();
        b.release().await.unwrap();
    }
    assert!(keys_under(&etcd, "pool").await.is_empty());
    assert_eq!(keys.len(), 2, "keys used: {keys:?}");
}

/// A request of the exclusive lock `name` by `owner`, as the engine makes it.
fn request(name: &str, owner: &leasehold_core::OwnerId) -> Request {
    let mut request = Request::new(
        LockName::new(name).unwrap(),
        owner.clone(),
        Mode::Exclusive,
        Duration::from_secs(2),
    );
    request.fair = true;
    request.waiting = true;
    request
}

#[tokio::test]
async fn abandoning_an_unreleased_grant_ends_its_session() {
    let etcd = Etcd::start().await.unwrap();
    let locks = backend(&etcd.endpoints(), Duration::from_secs(30)).await;
    let a = Client::builder(locks.clone()).options(options()).build();
    let other = client(&etcd.endpoints(), Duration::from_secs(30)).await;
    let stuck = a.mutex("stuck").unwrap().lock().await.unwrap();
    let beside = a.mutex("beside").unwrap().lock().await.unwrap();
    // The engine could not confirm the release of `stuck`: its key must not live on for
    // the session's 30 s (or the process's life).
    locks
        .abandon(&request("stuck", stuck.owner()))
        .await
        .unwrap();
    // Every guard of the session is lost, and says so; the locks are free at once.
    for guard in [&stuck, &beside] {
        let lost = tokio::time::timeout(Duration::from_secs(10), guard.lost()).await;
        assert_eq!(lost, Ok(LossReason::SessionEnded), "the session lives on");
    }
    for name in ["stuck", "beside"] {
        assert!(
            other
                .mutex(name)
                .unwrap()
                .try_lock()
                .await
                .unwrap()
                .is_some(),
            "{name} outlived the abandoned session"
        );
    }
    // Later grants get a new session.
    assert!(
        a.mutex("later")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
    // An owner with nothing on the server ends nothing.
    let unknown = leasehold_core::OwnerId::generate();
    locks.abandon(&request("later", &unknown)).await.unwrap();
    assert!(locks.session_ttl().await.is_some());
}

#[tokio::test]
async fn an_abandoned_session_that_cannot_be_revoked_runs_out() {
    let etcd = Etcd::start().await.unwrap();
    let proxy = FaultProxy::start(etcd.endpoints()[0].parse().unwrap())
        .await
        .unwrap();
    let url = format!("etcd://{}?session_ttl=2s&connect_timeout=1s", proxy.addr());
    let locks = EtcdBackend::connect(&url).await.unwrap();
    let a = Client::builder(locks.clone()).options(options()).build();
    let other = client(&etcd.endpoints(), Duration::from_secs(2)).await;
    let stuck = a.mutex("stuck").unwrap().lock().await.unwrap();
    proxy.cut(Direction::Both);
    let abandoned = locks.abandon(&request("stuck", stuck.owner())).await;
    assert!(
        matches!(abandoned, Err(ref e) if e.is_unknown_outcome()),
        "{abandoned:?}"
    );
    let lost = tokio::time::timeout(Duration::from_secs(10), stuck.lost()).await;
    assert_eq!(lost, Ok(LossReason::SessionEnded), "the session lives on");
    // Nobody keeps the lease alive: etcd expires it, and the lock is free.
    let next = job_within_named(&other, "stuck", Duration::from_secs(20)).await;
    assert!(next.token() > stuck.token());
    proxy.heal();
}

/// Polls `cond` (guard state) until it holds, up to `limit`.
async fn until_true(what: &str, limit: Duration, cond: impl Fn() -> bool) {
    let started = Instant::now();
    while !cond() {
        assert!(started.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A session kept alive for a while stays on its one connection.
/// etcd closes a connection pinged less than 5 s apart three times (`too_many_pings`); HTTP/2
/// pings every 2 s once made it do so every 8 s, suspending every session on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_kept_alive_keeps_its_one_connection() {
    let etcd = Etcd::start().await.unwrap();
    let proxy = FaultProxy::start(etcd.endpoints()[0].parse().unwrap())
        .await
        .unwrap();
    let a = client_through(&proxy, "30s").await;
    let guard = a.mutex("job").unwrap().lock().await.unwrap();
    // Two keep-alives answered, one every 10 s: well past the third ping of a 2 s interval.
    let mut seen = guard.deadline().unwrap();
    for _ in 0..2 {
        seen = guard.deadline_changed(seen).await.unwrap();
        assert!(!guard.is_suspended());
    }
    assert_eq!(
        proxy.accepted(),
        1,
        "the connection was closed and made again"
    );
    guard.release().await.unwrap();
}

/// A client with a session of `session_ttl` whose only link to etcd goes through `proxy`.
async fn client_through(proxy: &FaultProxy, session_ttl: &str) -> Client {
    let url = format!("etcd://{}?session_ttl={session_ttl}", proxy.addr());
    Client::builder(EtcdBackend::connect(&url).await.unwrap())
        .options(options())
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_keep_alive_suspends_the_session_and_the_next_answer_resumes_it() {
    let etcd = Etcd::start().await.unwrap();
    let ttl = Duration::from_secs(20);
    let proxy = FaultProxy::start(etcd.endpoints()[0].parse().unwrap())
        .await
        .unwrap();
    let a = client_through(&proxy, "20s").await;
    let guard = a.mutex("job").unwrap().lock().await.unwrap();
    assert!(!guard.is_suspended());
    proxy.cut(Direction::Both);
    // A keep-alive goes out every third of the ttl, and is overdue a tenth of it later.
    until_true("suspended", ttl / 2, || guard.is_suspended()).await;
    assert!(guard.is_held(), "held while suspended");
    proxy.heal();
    // Resumed before the deadline, or lost at it (then no longer suspended either).
    until_true("resumed", guard.remaining(), || !guard.is_suspended()).await;
    assert!(guard.is_held(), "lost although the link came back in time");
    guard.release().await.unwrap();
}

/// A link cut for half the session while a guard is dropped and an acquisition is given up.
/// The cut lasts 15 s of 30 s, and the acquisition's outcome is unknown: the releases go on
/// until the link is back and then complete, and the session's other guard lives on through
/// it, its key too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_outage_ends_only_what_was_let_go_during_it() {
    let etcd = Etcd::start().await.unwrap();
    let session = Duration::from_secs(30);
    let proxy = FaultProxy::start(etcd.endpoints()[0].parse().unwrap())
        .await
        .unwrap();
    let a = client_through(&proxy, "30s").await;
    let b = client(&etcd.endpoints(), session).await;
    let kept = a.mutex("kept").unwrap().lock().await.unwrap();
    let dropped = a.mutex("dropped").unwrap().lock().await.unwrap();
    let kept_key = keys_under(&etcd, "kept/").await;
    assert_eq!(kept_key.len(), 1);

    proxy.cut(Direction::Both);
    let cut_at = Instant::now();
    drop(dropped);
    // Its put goes out and no answer comes: the acquisition gives up with an unknown
    // outcome, and its release goes on behind it.
    let tried = a.mutex("tried").unwrap().try_lock().await;
    assert!(
        matches!(tried, Err(ref e) if e.is_unknown_outcome()),
        "{tried:?}"
    );
    assert!(kept.is_held(), "the outage ended the session");
    until_true("suspended", session / 2, || kept.is_suspended()).await;
    assert!(
        cut_at.elapsed() < session / 2,
        "the outage outlasted the scenario"
    );
    tokio::time::sleep((session / 2).saturating_sub(cut_at.elapsed())).await;
    assert!(kept.is_held(), "the outage ended the session");
    proxy.heal();

    // The releases complete once the link is back, long before the session could expire.
    a.settle().await;
    // The session resumes at the first keep-alive answered after the heal, which need not
    // have come back by the time the releases have (on a loaded machine it had not).
    until_true("resumed", kept.remaining(), || !kept.is_suspended()).await;
    assert!(kept.is_held(), "the other guard did not survive the outage");
    assert_eq!(keys_under(&etcd, "kept/").await, kept_key);
    for name in ["dropped", "tried"] {
        let left = keys_under(&etcd, &format!("{name}/")).await;
        assert!(left.is_empty(), "{name}: {left:?}");
        let next = b.mutex(name).unwrap().try_lock().await.unwrap();
        assert!(next.is_some(), "{name} is still held");
    }
    assert!(b.mutex("kept").unwrap().try_lock().await.unwrap().is_none());
    kept.release().await.unwrap();
}

/// The engine abandons the grant of a dropped guard whose session has ended.
/// Its deadline passed while the link was down: that session is left to run out, not
/// revoked, so the lock-delay of a holder that vanished still holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoning_a_grant_of_an_ended_session_keeps_its_lock_delay() {
    let etcd = Etcd::start().await.unwrap();
    let proxy = FaultProxy::start(etcd.endpoints()[0].parse().unwrap())
        .await
        .unwrap();
    let url = format!("etcd://{}?session_ttl=2s", proxy.addr());
    let locks = EtcdBackend::connect(&url).await.unwrap();
    let a = Client::builder(locks.clone()).options(options()).build();
    let delayed = LockOptions::builder()
        .request_timeout(Duration::from_secs(2))
        .lock_delay(Duration::from_secs(30))
        .build()
        .unwrap();
    let guard = a
        .mutex("delayed")
        .unwrap()
        .with_options(delayed)
        .lock()
        .await
        .unwrap();
    assert_eq!(keys_under(&etcd, "delayed#delay/").await.len(), 1);
    proxy.cut(Direction::Both);
    assert_eq!(guard.lost().await, LossReason::Disconnected);
    proxy.heal();
    locks
        .abandon(&request("delayed", guard.owner()))
        .await
        .unwrap();
    assert_eq!(
        keys_under(&etcd, "delayed#delay/").await.len(),
        1,
        "the lock-delay marker went with an abandoned session that had ended"
    );
}

async fn job_within_named(client: &Client, name: &str, within: Duration) -> Guard {
    client
        .mutex(name)
        .unwrap()
        .lock_timeout(within)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{name} was not granted within {within:?}"))
}

/// How late the member sees what comes through the slow path.
/// It is far longer than the client takes to leave that path (its pings go unanswered for 2
/// s) and finish its request through the other one.
const LATE: Duration = Duration::from_secs(10);

/// A client of `etcd` with two ways to its one member.
/// The first goes through `slow` (a proxy that can delay what reaches the member, as a
/// paused member would see it late), the second is direct. It uses the first until that
/// connection fails.
async fn two_paths(etcd: &Etcd, slow: &FaultProxy) -> (EtcdBackend, Client) {
    let endpoints = [slow.addr().to_string(), etcd.endpoints()[0].clone()];
    let locks = backend(&endpoints, Duration::from_secs(20)).await;
    let options = LockOptions::builder()
        .request_timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let client = Client::builder(locks.clone()).options(options).build();
    (locks, client)
}

/// Waits until everything the slow path held has reached the member.
/// The member has closed that connection after it: the late requests have been served.
async fn until_delivered(slow: &FaultProxy) {
    let give_up = std::time::Instant::now() + LATE * 6;
    while slow.connections() > 0 {
        assert!(
            std::time::Instant::now() < give_up,
            "the slow path never delivered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_that_lands_after_its_acquisition_gave_up_leaves_nothing() {
    let etcd = Etcd::start().await.unwrap();
    let slow = FaultProxy::start(etcd.endpoints()[0].parse().unwrap())
        .await
        .unwrap();
    let (_, a) = two_paths(&etcd, &slow).await;
    let holder = client(&etcd.endpoints(), Duration::from_secs(20)).await;
    let held = holder.mutex("late").unwrap().lock().await.unwrap();
    // A's session starts through the slow path, before it is slow.
    let warm = a.mutex("warm").unwrap().lock().await.unwrap();
    warm.release().await.unwrap();
    slow.set_delay(Direction::ToServer, LATE);
    let slowed_at = std::time::Instant::now();
    let mutex = a.mutex("late").unwrap();
    let waiter = tokio::spawn(async move { mutex.lock().await });
    // A's first request sits in the slow path; once A left that path, a retry queued it.
    until(&holder, "late", |s| s.waiters.len() == 1).await;
    // A gives up (its acquisition is cancelled): the waiter is removed, answered.
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    a.settle().await;
    assert!(holder.inspect("late").await.unwrap().waiters.is_empty());
    assert!(
        slowed_at.elapsed() < LATE,
        "the test came too late: the give-up must be answered before the late put lands"
    );
    // Then the first put reaches the member.
    until_delivered(&slow).await;
    let left = keys_under(&etcd, "late/").await;
    let state = holder.inspect("late").await.unwrap();
    assert!(
        state.waiters.is_empty(),
        "the late put left a waiter nobody deletes: {:?} ({left:?})",
        state.waiters
    );
    held.release().await.unwrap();
    assert!(
        holder
            .mutex("late")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some(),
        "the lock stays closed by a key nobody owns"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_delete_removes_nothing_of_the_next_key_in_its_slot() {
    let etcd = Etcd::start().await.unwrap();
    let slow = FaultProxy::start(etcd.endpoints()[0].parse().unwrap())
        .await
        .unwrap();
    let (_, a) = two_paths(&etcd, &slow).await;
    let first = a.mutex("slot").unwrap().lock().await.unwrap();
    let first_key = keys_under(&etcd, "slot/").await;
    assert_eq!(first_key.len(), 1, "{first_key:?}");
    slow.set_delay(Direction::ToServer, LATE);
    let slowed_at = std::time::Instant::now();
    // The delete sits in the slow path; the release is retried through the other one and
    // answered there.
    first.release().await.unwrap();
    // The next acquisition of the session takes the same slot: a session does not retire
    // the slots of unanswered deletes (they would pile up for the session's life).
    let second = a.mutex("slot").unwrap().lock().await.unwrap();
    assert_eq!(
        keys_under(&etcd, "slot/").await,
        first_key,
        "the slot was not reused"
    );
    assert!(
        slowed_at.elapsed() < LATE,
        "the test came too late: the slot must be reused before the late delete lands"
    );
    // The first delete reaches the member: it compares the key's create revision, and the
    // key in the slot now is another.
    until_delivered(&slow).await;
    assert_eq!(keys_under(&etcd, "slot/").await, first_key);
    assert_eq!(
        a.inspect("slot").await.unwrap().holders[0].owner,
        *second.owner()
    );
    assert!(second.is_held());
    second.release().await.unwrap();
}

/// The holders of a listed lock, in token order.
fn holders_of(state: &LockState) -> Vec<(OwnerId, FencingToken, Mode)> {
    let mut holders: Vec<_> = state
        .holders
        .iter()
        .map(|h| (h.owner.clone(), h.token, h.mode))
        .collect();
    holders.sort_by_key(|h| h.1);
    holders
}

/// Ten thousand grants on 8 581 names are listed exactly, each name once, a page at a time.
/// A group of names puts keys of others between its own: `bulk:7#permits/…`, `bulk:7-y/…`,
/// `bulk:7.x/…`, `bulk:7/…`. The client's listing reads a thousand keys a page; the
/// backend's, asked for a hundred, takes a hundred pages and still lists every name on one
/// of them with all of its holders, wherever a page ends in a group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_grants_are_listed_exactly_a_page_at_a_time() {
    const GROUPS: usize = 2_860;
    const WORKERS: usize = 32;
    let etcd = Etcd::start().await.unwrap();
    let locks = backend(&etcd.endpoints(), Duration::from_secs(10)).await;
    let client = Client::builder(locks.clone()).options(options()).build();
    // Three or four grants a group, so that pages end anywhere in one: a mutex of
    // `bulk:<g>` (and a permit of it in every other group), a mutex of `bulk:<g>.x` and one
    // of `bulk:<g>-y`.
    let workers: Vec<_> = (0..WORKERS)
        .map(|worker| {
            let client = client.clone();
            tokio::spawn(async move {
                let mut guards = Vec::new();
                for group in (worker..GROUPS).step_by(WORKERS) {
                    let name = format!("bulk:{group}");
                    guards.push(client.mutex(&name).unwrap().lock().await.unwrap());
                    if group % 2 == 0 {
                        let permits = client.semaphore(&name, 1).unwrap();
                        guards.push(permits.acquire().await.unwrap());
                    }
                    for suffix in [".x", "-y"] {
                        let mutex = client.mutex(&format!("{name}{suffix}")).unwrap();
                        guards.push(mutex.lock().await.unwrap());
                    }
                }
                guards
            })
        })
        .collect();
    // The name that is the prefix, and its keys before every other.
    let mut guards = vec![client.mutex("bulk:").unwrap().lock().await.unwrap()];
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
    for holders in expected.values_mut() {
        holders.sort_by_key(|h| h.1);
    }
    let names = GROUPS * 3 + 1;
    assert_eq!((guards.len(), expected.len()), (10_011, names));
    // Outside the prefix: its keys are `bulk/…`.
    let outside = client.mutex("bulk").unwrap().lock().await.unwrap();

    let listed = client.locks("bulk:").await.unwrap();
    assert_eq!(listed.len(), expected.len(), "names listed");
    for (name, state) in &listed {
        assert_eq!(
            Some(&holders_of(state)),
            expected.get(name.as_str()),
            "holders of {name}"
        );
    }

    let prefix = NamePrefix::new("bulk:").unwrap();
    let (mut cursor, mut pages, mut paged) = (None, 0, 0);
    loop {
        let page = locks.list(&prefix, cursor.as_ref(), 100).await.unwrap();
        pages += 1;
        for (name, state) in &page.locks {
            let holders = expected.remove(name.as_str());
            assert!(holders.is_some(), "{name} listed twice, or not held");
            assert_eq!(Some(holders_of(state)), holders, "holders of {name}");
            paged += 1;
        }
        match page.next {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    assert!(expected.is_empty(), "{} names not listed", expected.len());
    assert_eq!(paged, names);
    // Ten thousand keys, a hundred a page.
    assert!(pages >= 100, "{pages} pages");
    drop((guards, outside));
}

/// The lease `key` is bound to, as etcd has it.
async fn lease_of(etcd: &Etcd, key: &str) -> i64 {
    let json = etcd.etcdctl(&["get", key, "-w", "json"], "").await.unwrap();
    let at = json.find("\"lease\":").unwrap_or_else(|| panic!("{json}")) + "\"lease\":".len();
    let digits: String = json[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().unwrap()
}

/// What etcd says of `lease`: `lease <id> granted with TTL(<n>s), remaining(<m>s)`.
async fn lease_ttl(etcd: &Etcd, lease: i64) -> String {
    etcd.etcdctl(&["lease", "timetolive", &format!("{lease:x}")], "")
        .await
        .unwrap()
}

/// The key of `guard`, as etcd names it.
fn key_of(locks: &EtcdBackend, guard: &Guard) -> String {
    String::from_utf8(locks.still_owner(guard).key).unwrap()
}

/// A kept grant moves off the session onto a lease of its own, and keeps its key.
/// Its token and its place stand, a waiter queued behind it (and one of the client that kept
/// it) sleeps on until that lease runs out, its lock-delay marker does not close the lock
/// after it, and the client's keys take its slot again only once it is gone.
#[tokio::test]
async fn a_kept_grant_keeps_its_key_until_its_own_lease_runs_out() {
    let etcd = Etcd::start().await.unwrap();
    let locks = backend(&etcd.endpoints(), Duration::from_secs(30)).await;
    let with_delay = options()
        .to_builder()
        .lock_delay(Duration::from_secs(30))
        .build()
        .unwrap();
    let c = Client::builder(locks.clone()).options(with_delay).build();
    let other = client(&etcd.endpoints(), Duration::from_secs(30)).await;
    let guard = c.mutex("job").unwrap().lock().await.unwrap();
    let (token, owner) = (guard.token(), guard.owner().clone());
    let key = key_of(&locks, &guard);
    let session_lease = lease_of(&etcd, &key).await;
    let waiter = {
        let other = other.clone();
        tokio::spawn(async move { job_within(&other, Duration::from_secs(20), "the waiter").await })
    };
    until(&c, "job", |s| s.waiters.len() == 1).await;

    guard.keep_for(Duration::from_secs(2)).await.unwrap();
    let kept_lease = lease_of(&etcd, &key).await;
    assert_ne!(kept_lease, session_lease);
    let ttl = lease_ttl(&etcd, kept_lease).await;
    assert!(ttl.contains("granted with TTL(2s)"), "{ttl}");
    assert!(keys_under(&etcd, "job#delay/").await.is_empty());
    // The client that kept it queues behind it, in another slot: its key must not land
    // on the kept one, which would hand it the lock at once.
    let second = {
        let c = c.clone();
        tokio::spawn(async move { job_within(&c, Duration::from_secs(20), "the second").await })
    };
    // Bounded: a second key put over the kept one would be granted, and never queue.
    let queued = until(&other, "job", |s| s.waiters.len() == 2);
    tokio::time::timeout(Duration::from_secs(10), queued)
        .await
        .expect("the second acquisition never queued");
    let state = other.inspect("job").await.unwrap();
    assert_eq!(state.holders.len(), 1);
    assert_eq!(
        (&state.holders[0].owner, state.holders[0].token),
        (&owner, token)
    );
    assert!(
        state.holders[0]
            .remaining
            .is_some_and(|left| left <= Duration::from_secs(2)),
        "{:?}",
        state.holders[0].remaining
    );

    let next = waiter.await.unwrap();
    let next_token = next.token();
    assert!(next_token > token);
    next.release().await.unwrap();
    let last = second.await.unwrap();
    assert!(last.token() > next_token);
    assert_ne!(key_of(&locks, &last), key, "the kept key's slot was reused");
    last.release().await.unwrap();
    // The kept key is gone: its slot is free again.
    let again = c.mutex("job").unwrap().try_lock().await.unwrap().unwrap();
    assert_eq!(key_of(&locks, &again), key);
}

/// A kept grant outlives the session it was granted under.
/// Closed (as a process that exits ends it, later), the session's other grants go at once
/// and the kept one stays held until its own lease runs out.
#[tokio::test]
async fn a_kept_grant_outlives_the_session_it_was_granted_under() {
    let etcd = Etcd::start().await.unwrap();
    let locks = backend(&etcd.endpoints(), Duration::from_secs(30)).await;
    let c = Client::builder(locks.clone()).options(options()).build();
    let other = client(&etcd.endpoints(), Duration::from_secs(30)).await;
    let kept = c.mutex("kept").unwrap().lock().await.unwrap();
    let token = kept.token();
    let plain = c.mutex("plain").unwrap().lock().await.unwrap();
    kept.keep_for(Duration::from_secs(3)).await.unwrap();
    locks.close().await.unwrap();
    assert_eq!(plain.lost().await, LossReason::SessionEnded);
    assert!(
        other
            .mutex("plain")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
    let state = other.inspect("kept").await.unwrap();
    assert_eq!(state.holders.len(), 1);
    assert_eq!(state.holders[0].token, token);
    assert!(
        other
            .mutex("kept")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none()
    );
    let next = job_within_named(&other, "kept", Duration::from_secs(20)).await;
    assert!(next.token() > token);
}

/// Records live apart from the locks, on leases of their own of the time asked.
/// They are outside every queue, listing and inspection, and not deleted with their
/// writer's grant or session.
#[tokio::test]
async fn records_live_beside_the_locks_on_leases_of_their_own() {
    let etcd = Etcd::start().await.unwrap();
    let locks = backend(&etcd.endpoints(), Duration::from_secs(30)).await;
    let c = Client::builder(locks.clone()).options(options()).build();
    let other = client(&etcd.endpoints(), Duration::from_secs(30)).await;
    let guard = c.mutex("job").unwrap().lock().await.unwrap();
    let key = RecordKey::new("window:1").unwrap();
    let keep = Duration::from_secs(600);
    assert!(guard.put_record(&key, b"done", keep).await.unwrap());
    assert_eq!(
        keys_under(&etcd, "#records/").await,
        ["#records/job/window:1"]
    );
    let lease = lease_of(&etcd, "#records/job/window:1").await;
    let ttl = lease_ttl(&etcd, lease).await;
    assert!(ttl.contains("granted with TTL(600s)"), "{ttl}");
    // Not a lock, nor part of one.
    let listed = other.locks("").await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].0.as_str(), "job");
    assert_eq!(
        (listed[0].1.holders.len(), listed[0].1.waiters.len()),
        (1, 0)
    );
    let state = other.inspect("job").await.unwrap();
    assert_eq!((state.holders.len(), state.waiters.len()), (1, 0));
    // Too long a keep for etcd is refused before anything is written.
    let too_long = Duration::from_secs(10_000_000_000);
    let refused = guard.put_record(&key, b"again", too_long).await;
    assert!(
        matches!(refused, Err(Error::InvalidArgument { .. })),
        "{refused:?}"
    );

    guard.release().await.unwrap();
    locks.close().await.unwrap();
    let name = LockName::new("job").unwrap();
    let read = other.backend().get_record(&name, &key).await.unwrap();
    assert_eq!(read.as_deref(), Some(&b"done"[..]));
    assert!(other.locks("").await.unwrap().is_empty());
    let missing = RecordKey::new("window:2").unwrap();
    assert_eq!(
        other.backend().get_record(&name, &missing).await.unwrap(),
        None
    );
}

/// The value of the gauge `metric` on the member whose metrics are served at `addr`.
async fn gauge(addr: std::net::SocketAddr, metric: &str) -> f64 {
    let metrics = leasehold_testkit::probe::http_get(addr, "/metrics")
        .await
        .unwrap();
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(metric)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("the member reports no {metric}"))
}

/// Reads the gauge `metric` until it is `want`, for at most 10 s.
async fn until_gauge(addr: std::net::SocketAddr, metric: &str, want: f64) {
    let limit = Duration::from_secs(10);
    let started = Instant::now();
    loop {
        let now = gauge(addr, metric).await;
        if now == want {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "{metric} is {now}, not {want}, after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The next notice of `feed`, within `within`; fails the test with `what` if none comes.
async fn next_notice(
    feed: &mut leasehold_core::Changes,
    within: Duration,
    what: &str,
) -> leasehold_core::Change {
    tokio::time::timeout(within, feed.next())
        .await
        .unwrap_or_else(|_| panic!("no notice of {what} within {within:?}"))
        .expect("the feed ended")
}

const WATCH_STREAMS: &str = "etcd_debugging_mvcc_watch_stream_total";
const WATCHERS: &str = "etcd_debugging_mvcc_watcher_total";

/// A change feed is one watch on the server, and dropping the feed cancels it there.
#[tokio::test]
async fn dropping_a_change_feed_cancels_its_watch_on_the_server() {
    let mut etcd = Etcd::start().await.unwrap();
    let metrics = etcd.members()[0].metrics_addr();
    let locks = backend(&etcd.endpoints(), Duration::from_secs(30)).await;
    let (streams, watchers) = (
        gauge(metrics, WATCH_STREAMS).await,
        gauge(metrics, WATCHERS).await,
    );
    let prefix = NamePrefix::new("jobs:").unwrap();
    let mut feed = locks.changes(&prefix).await.unwrap();
    // Created before `changes` returned.
    assert_eq!(gauge(metrics, WATCH_STREAMS).await, streams + 1.0);
    assert_eq!(gauge(metrics, WATCHERS).await, watchers + 1.0);
    let c = Client::builder(locks.clone()).options(options()).build();
    let guard = c.mutex("jobs:a").unwrap().lock().await.unwrap();
    let named = next_notice(&mut feed, Duration::from_secs(10), "the grant").await;
    assert_eq!(
        named,
        leasehold_core::Change::Lock(LockName::new("jobs:a").unwrap())
    );
    guard.release().await.unwrap();

    drop(feed);
    until_gauge(metrics, WATCHERS, watchers).await;
    until_gauge(metrics, WATCH_STREAMS, streams).await;
}

/// A session lease that etcd expires (its client cut off) is a notice of each of its locks.
#[tokio::test]
async fn a_session_lease_expiring_on_the_server_is_noticed() {
    let etcd = Etcd::start().await.unwrap();
    let proxy = FaultProxy::start(etcd.endpoints()[0].parse().unwrap())
        .await
        .unwrap();
    let holder = client_through(&proxy, "2s").await;
    let watcher = client(&etcd.endpoints(), Duration::from_secs(30)).await;
    let held = holder.mutex("job").unwrap().lock().await.unwrap();
    let mut feed = watcher
        .backend()
        .changes(&NamePrefix::new("").unwrap())
        .await
        .unwrap();
    assert_eq!(watcher.inspect("job").await.unwrap().holders.len(), 1);
    // The holder's keep-alives stop reaching etcd, which expires its lease and its key.
    proxy.cut(Direction::Both);
    let job = LockName::new("job").unwrap();
    let freed = async {
        loop {
            let notice = next_notice(&mut feed, Duration::from_secs(30), "the expiry").await;
            assert_eq!(notice, leasehold_core::Change::Lock(job.clone()));
            if watcher.inspect("job").await.unwrap().holders.is_empty() {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), freed)
        .await
        .expect("the lock was never noticed free");
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(10), held.lost()).await,
        Ok(LossReason::SessionEnded)
    );
    proxy.heal();
}

/// A feed whose watch stream breaks watches again, and then tells the watcher to resync.
#[tokio::test]
async fn a_change_feed_whose_stream_breaks_watches_again_and_resyncs() {
    let etcd = Etcd::start().await.unwrap();
    let proxy = FaultProxy::start(etcd.endpoints()[0].parse().unwrap())
        .await
        .unwrap();
    let url = format!("etcd://{}?session_ttl=30s", proxy.addr());
    let watcher = EtcdBackend::connect(&url).await.unwrap();
    let mut feed = watcher
        .changes(&NamePrefix::new("jobs:").unwrap())
        .await
        .unwrap();
    let other = client(&etcd.endpoints(), Duration::from_secs(30)).await;
    // The connection is reset: the watch is gone with it.
    proxy.reset();
    let notice = next_notice(&mut feed, Duration::from_secs(20), "the broken stream").await;
    assert_eq!(notice, leasehold_core::Change::Resync);
    // The new watch is in place before the resync: what changes after it is named.
    let guard = other.mutex("jobs:a").unwrap().lock().await.unwrap();
    // Outside the prefix: never named.
    let elsewhere = other.mutex("elsewhere").unwrap().lock().await.unwrap();
    elsewhere.release().await.unwrap();
    let notice = next_notice(&mut feed, Duration::from_secs(10), "the grant").await;
    assert_eq!(
        notice,
        leasehold_core::Change::Lock(LockName::new("jobs:a").unwrap())
    );
    guard.release().await.unwrap();
    let notice = next_notice(&mut feed, Duration::from_secs(10), "the release").await;
    assert_eq!(
        notice,
        leasehold_core::Change::Lock(LockName::new("jobs:a").unwrap())
    );
}

/// An evicted holder hears of it by push, and every write of it after the eviction is refused.
/// Its session lives on (its other lock stays held): only the push can tell it, and the
/// next grant, after the lock stayed closed for the holder's session ttl, fences it out.
#[tokio::test]
async fn an_evicted_holder_is_told_by_push_and_fenced_out() {
    let etcd = Etcd::start().await.unwrap();
    let holder = client(&etcd.endpoints(), Duration::from_secs(2)).await;
    let operator = client(&etcd.endpoints(), Duration::from_secs(2)).await;
    leasehold_testkit::eviction::an_evicted_holder_is_told_and_fenced_out(&holder, &operator).await;
}

/// A grant's watch of its key lives only while the grant does.
/// Released, dropped or evicted, it leaves no watch and no watch stream on the server.
#[tokio::test]
async fn a_grant_leaves_no_watch_behind() {
    let mut etcd = Etcd::start().await.unwrap();
    let metrics = etcd.members()[0].metrics_addr();
    let holder = client(&etcd.endpoints(), Duration::from_secs(2)).await;
    let operator = client(&etcd.endpoints(), Duration::from_secs(2)).await;
    let (streams, watchers) = (
        gauge(metrics, WATCH_STREAMS).await,
        gauge(metrics, WATCHERS).await,
    );
    // Two grants share one stream, a watch each.
    let a = holder.mutex("a").unwrap().lock().await.unwrap();
    let b = holder.mutex("b").unwrap().lock().await.unwrap();
    until_gauge(metrics, WATCHERS, watchers + 2.0).await;
    until_gauge(metrics, WATCH_STREAMS, streams + 1.0).await;
    a.release().await.unwrap();
    until_gauge(metrics, WATCHERS, watchers + 1.0).await;
    drop(b);
    until_gauge(metrics, WATCHERS, watchers).await;
    until_gauge(metrics, WATCH_STREAMS, streams).await;
    // An evicted grant's watch goes when the eviction reaches it.
    let c = holder.mutex("c").unwrap().lock().await.unwrap();
    until_gauge(metrics, WATCHERS, watchers + 1.0).await;
    operator
        .evict("c", None, "ops@host", "leak check")
        .await
        .unwrap();
    assert_eq!(c.lost().await, LossReason::Evicted);
    until_gauge(metrics, WATCHERS, watchers).await;
    until_gauge(metrics, WATCH_STREAMS, streams).await;
    let _ = c.release().await;
}

/// A grant whose watch broke hears of its eviction all the same, once the link is back.
/// The watch is opened again from its grant's revision; etcd compacted that history
/// meanwhile and cancels it, so the key is looked up, found gone, and the record read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_watch_broke_hears_of_its_eviction_past_a_compaction() {
    let mut etcd = Etcd::start().await.unwrap();
    let metrics = etcd.members()[0].metrics_addr();
    let proxy = FaultProxy::start(etcd.members()[0].addr()).await.unwrap();
    let (streams, watchers) = (
        gauge(metrics, WATCH_STREAMS).await,
        gauge(metrics, WATCHERS).await,
    );
    // A session that outlasts the break by far: only the eviction can end the guard.
    let holder = client(
        &[format!("127.0.0.1:{}", proxy.port())],
        Duration::from_secs(30),
    )
    .await;
    let operator = client(&etcd.endpoints(), Duration::from_secs(2)).await;
    let guard = job_within(&holder, Duration::from_secs(10), "job is free").await;
    until_gauge(metrics, WATCHERS, watchers + 1.0).await;

    // The holder's connections are reset and none may open: its watch is broken.
    proxy.refuse_new(true);
    proxy.reset();
    until_gauge(metrics, WATCHERS, watchers).await;
    let evicted = operator
        .evict("job", None, "ops@host", "while cut off")
        .await
        .unwrap();
    assert_eq!(evicted.len(), 1, "{evicted:?}");
    let put = etcd
        .etcdctl(&["put", "compact-here", "x", "-w", "json"], "")
        .await
        .unwrap();
    // `{"header":{…,"revision":N,…}}`: the first revision in it is the header's.
    let revision: String = put
        .split("\"revision\":")
        .nth(1)
        .unwrap()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    etcd.etcdctl(&["compact", &revision], "").await.unwrap();

    proxy.refuse_new(false);
    assert_eq!(guard.lost().await, LossReason::Evicted);
    // Neither the canceled watch nor its stream stays on the server.
    until_gauge(metrics, WATCHERS, watchers).await;
    until_gauge(metrics, WATCH_STREAMS, streams).await;
    let _ = guard.release().await;
}

/// An eviction's marker outlasts the holder's session ttl counted from the eviction on.
/// etcd counts what is left of a lease in whole seconds, rounded down: the marker's end is
/// no earlier than when its lease was read + what is left of it.
#[tokio::test]
async fn an_evictions_marker_lasts_the_holders_session_ttl_past_the_eviction() {
    let etcd = Etcd::start().await.unwrap();
    let ttl = Duration::from_secs(5);
    let holder = client(&etcd.endpoints(), ttl).await;
    let operator = client(&etcd.endpoints(), Duration::from_secs(30)).await;
    let guard = job_within(&holder, Duration::from_secs(10), "job is free").await;
    let evicted = operator
        .evict("job", None, "ops@host", "marker check")
        .await
        .unwrap();
    let done = Instant::now();
    assert_eq!(evicted.len(), 1, "{evicted:?}");
    let markers = keys_under(&etcd, "job#delay/").await;
    assert_eq!(markers.len(), 1, "{markers:?}");
    let lease = lease_of(&etcd, &markers[0]).await;
    let read = Instant::now();
    let said = lease_ttl(&etcd, lease).await;
    let left: u64 = said
        .split("remaining(")
        .nth(1)
        .and_then(|rest| rest.split('s').next())
        .and_then(|secs| secs.parse().ok())
        .unwrap_or_else(|| panic!("{said}"));
    assert!(
        Duration::from_secs(left) + (read - done) >= ttl,
        "the marker ends before the holder's session ttl has passed since the eviction: {said}"
    );
    let _ = guard.release().await;
}

/// Evicting a kept grant leaves the lock open at once.
/// A kept key lives by a hold lease, not by a session: no holder can still think it holds.
#[tokio::test]
async fn evicting_a_kept_grant_leaves_the_lock_open() {
    let etcd = Etcd::start().await.unwrap();
    let holder = client(&etcd.endpoints(), Duration::from_secs(30)).await;
    let operator = client(&etcd.endpoints(), Duration::from_secs(30)).await;
    let guard = job_within(&holder, Duration::from_secs(10), "job is free").await;
    guard.keep_for(Duration::from_secs(3600)).await.unwrap();
    let evicted = operator
        .evict("job", None, "ops@host", "kept too long")
        .await
        .unwrap();
    assert_eq!(evicted.len(), 1, "{evicted:?}");
    let next = operator.mutex("job").unwrap().try_lock().await.unwrap();
    assert!(
        next.is_some(),
        "the evicted kept grant still closes the lock"
    );
    next.unwrap().release().await.unwrap();
}

/// An eviction asked again after it was applied (its answer lost, say) answers `true`.
#[tokio::test]
async fn an_eviction_asked_again_after_it_was_applied_answers_true() {
    let etcd = Etcd::start().await.unwrap();
    let holder = client(&etcd.endpoints(), Duration::from_secs(30)).await;
    let locks = backend(&etcd.endpoints(), Duration::from_secs(30)).await;
    leasehold_testkit::eviction::an_eviction_asked_again_after_it_was_applied_answers_true(
        &holder, &locks,
    )
    .await;
}

/// A grant whose key was deleted is revoked without waiting long for the eviction record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_grant_is_revoked_without_waiting_long_for_its_record() {
    let mut etcd = Etcd::start().await.unwrap();
    let proxy = FaultProxy::start(etcd.members()[0].addr()).await.unwrap();
    let through = [format!("127.0.0.1:{}", proxy.port())];
    let holder = client(&through, Duration::from_secs(30)).await;
    let operator = client(&etcd.endpoints(), Duration::from_secs(30)).await;
    leasehold_testkit::eviction::a_deleted_grant_is_revoked_without_waiting_long_for_its_record(
        &holder, &operator, &proxy,
    )
    .await;
}

/// Keeps the lock events a client records.
#[derive(Debug, Default, Clone)]
struct Kept(Arc<Mutex<Vec<leasehold_core::events::LockEvent>>>);

impl leasehold_core::events::EventSink for Kept {
    fn record(&self, event: &leasehold_core::events::LockEvent) {
        self.0.lock().unwrap().push(event.clone());
    }
}

#[tokio::test]
async fn the_release_of_a_session_grant_records_the_deadline_its_keep_alives_reached() {
    // The grant's event holds the session's deadline then; keep-alives move it later, and
    // an auditor takes the server's promise from the release's event.
    let etcd = Etcd::start().await.unwrap();
    let kept = Kept::default();
    let client = Client::builder(backend(&etcd.endpoints(), Duration::from_secs(2)).await)
        .options(options())
        .events(kept.clone())
        .build();
    let guard = job_within(&client, Duration::from_secs(10), "a free lock").await;
    let first = guard.deadline().unwrap();
    let moved = guard.deadline_changed(first).await.unwrap();
    assert!(moved > first, "{moved:?} after {first:?}");
    guard.release().await.unwrap();
    let events = kept.0.lock().unwrap().clone();
    let until = |kind: &str| {
        let event = events.iter().find(|e| e.kind.as_str() == kind).unwrap();
        event
            .session_until_ms
            .unwrap_or_else(|| panic!("{event:?}"))
    };
    assert!(
        until("released") > until("granted"),
        "granted {}, released {}",
        until("granted"),
        until("released")
    );
}
