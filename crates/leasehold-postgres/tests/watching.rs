//! Change feeds (watching locks) on a real PostgreSQL.
//! A feed's session and row live as long as the feed, a change nobody watches sends
//! nothing, and advisory holders whose session ended are told.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::time::Duration;

use futures_util::StreamExt;
use leasehold_core::backend::Backend;
use leasehold_core::{Change, Changes, Client, LockChange, LockName, LockWatch, NamePrefix};
use leasehold_postgres::PostgresBackend;
use leasehold_postgres::tokio_postgres::{self, AsyncMessage, NoTls};
use leasehold_testkit::Postgres;
use tokio::sync::mpsc;

mod common;
use common::{database, old_schema, until};

/// A connection listening on `channel`: the payloads of its messages, in commit order.
async fn listener(
    url: &str,
    channel: &str,
) -> (tokio_postgres::Client, mpsc::UnboundedReceiver<String>) {
    let (client, mut connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
    let (heard, payloads) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let AsyncMessage::Notification(note) = message {
                let _ = heard.send(note.payload().to_owned());
            }
        }
    });
    client
        .batch_execute(&format!("LISTEN \"{channel}\""))
        .await
        .unwrap();
    (client, payloads)
}

/// What `payloads` heard before the mark that `db` sends now on `channel`.
/// Messages leave in commit order, so everything sent before the mark has arrived with it.
async fn heard_before_mark(
    db: &tokio_postgres::Client,
    channel: &str,
    payloads: &mut mpsc::UnboundedReceiver<String>,
) -> Vec<String> {
    db.batch_execute(&format!("NOTIFY \"{channel}\", 'mark'"))
        .await
        .unwrap();
    let mut heard = Vec::new();
    loop {
        let payload = tokio::time::timeout(Duration::from_secs(30), payloads.recv())
            .await
            .expect("the mark never arrived")
            .unwrap();
        if payload == "mark" {
            return heard;
        }
        heard.push(payload);
    }
}

/// The next notice of `feed`, within a bounded time.
async fn next_notice(feed: &mut Changes) -> Change {
    tokio::time::timeout(Duration::from_secs(30), feed.next())
        .await
        .expect("no notice")
        .expect("the feed ended")
}

/// Reads `feed` until a notice names `name`, within a bounded time.
async fn until_named(feed: &mut Changes, name: &str) {
    let named =
        async { while next_notice(feed).await != Change::Lock(LockName::new(name).unwrap()) {} };
    tokio::time::timeout(Duration::from_secs(30), named)
        .await
        .unwrap_or_else(|_| panic!("{name} was never named"));
}

/// The first change `want` accepts, from `watch`, within a bounded time.
async fn until_seen(
    watch: &mut LockWatch,
    what: &str,
    want: impl Fn(&LockChange) -> bool,
) -> LockChange {
    let seen = async {
        loop {
            let change = watch.next().await.unwrap();
            if want(&change) {
                return change;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), seen)
        .await
        .unwrap_or_else(|_| panic!("the watch never saw {what}"))
}

async fn is_true(db: &tokio_postgres::Client, sql: &str) -> bool {
    db.query_one(sql, &[]).await.unwrap().get(0)
}

/// A feed's session is a watcher while the feed lives, and is gone with it.
/// Its row names the prefix and the watchers are counted; a grant under the prefix is told;
/// once the feed is dropped the row is deleted, the count is back to 0 and the session
/// (which listened) has ended. A feed whose session is ended comes back listening, says
/// that notices may have been missed, and its old row is dropped by the new session's
/// start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_feed_leaves_no_watcher_row_and_no_listening_session() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    let backend = PostgresBackend::connect(&server.url()).await.unwrap();
    let client = Client::new(backend.clone());
    let mut feed = backend
        .changes(&NamePrefix::new("jobs:").unwrap())
        .await
        .unwrap();
    let watcher = async || -> (i32, String) {
        let row = db
            .query_one("SELECT pid, prefix FROM leasehold.watchers", &[])
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    let (pid, prefix) = watcher().await;
    assert_eq!(prefix, "jobs:");
    let counted = "SELECT pg_sequence_last_value('leasehold.watcher_rows')";
    let count: i64 = db.query_one(counted, &[]).await.unwrap().get(0);
    assert_eq!(count, 1);
    let alive =
        |pid: i32| format!("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = {pid})");
    assert!(is_true(&db, &alive(pid)).await);

    let name = LockName::new("jobs:a").unwrap();
    let guard = client.mutex("jobs:a").unwrap().lock().await.unwrap();
    assert_eq!(next_notice(&mut feed).await, Change::Lock(name.clone()));

    // The session ended under the feed: it listens again, and says so.
    assert!(is_true(&db, &format!("SELECT pg_terminate_backend({pid})")).await);
    assert_eq!(next_notice(&mut feed).await, Change::Resync);
    let (again, _) = watcher().await;
    assert_ne!(again, pid, "the gone session's row was kept");
    guard.release().await.unwrap();
    assert_eq!(next_notice(&mut feed).await, Change::Lock(name));

    drop(feed);
    until(
        &db,
        &format!(
            "SELECT NOT EXISTS (SELECT 1 FROM leasehold.watchers) \
             AND pg_sequence_last_value('leasehold.watcher_rows') = 0 \
             AND NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = {again})"
        ),
    )
    .await;
}

/// While no watcher follows a name, its changes send nothing on the feed channel.
/// That holds for grants, releases, queued and departed waiters and evictions, in both
/// modes. A watcher of other names
/// changes nothing; one of the name makes the same cycle send its name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_nobody_watches_send_nothing_on_the_feed_channel() {
    let server = Postgres::start().await.unwrap();
    let url = server.url();
    let db = database(&url).await;
    let channel = "leasehold.feed";
    let (_listening, mut payloads) = listener(&url, channel).await;
    let advisory_url = format!("{url}?mode=advisory&session_ttl=60s");
    let lease = PostgresBackend::connect(&url).await.unwrap();
    let advisory = PostgresBackend::connect(&advisory_url).await.unwrap();
    let clients = [
        (
            Client::new(lease.clone()),
            PostgresBackend::connect(&url).await.unwrap(),
        ),
        (
            Client::new(advisory.clone()),
            PostgresBackend::connect(&advisory_url).await.unwrap(),
        ),
    ];
    // Every kind of change, in each mode: a grant, a waiter queued and gone, a release; an
    // eviction where there is one (lease mode), of a name of its own each time (it stays
    // closed until the evicted lease would have ended).
    let cycle = async |round: u32| {
        for (client, other) in &clients {
            let other = Client::new(other.clone());
            let guard = client.mutex("jobs:x").unwrap().lock().await.unwrap();
            let waited = other
                .mutex("jobs:x")
                .unwrap()
                .lock_timeout(Duration::from_millis(300))
                .await
                .unwrap();
            assert!(waited.is_none(), "granted twice");
            guard.release().await.unwrap();
        }
        let (client, _) = &clients[0];
        let name = format!("jobs:evicted-{round}");
        let evicted = client.mutex(&name).unwrap().lock().await.unwrap();
        let gone = client
            .evict(&name, None, "test@here", "a test")
            .await
            .unwrap();
        assert_eq!(gone.len(), 1);
        drop(evicted);
    };

    cycle(1).await;
    let heard = heard_before_mark(&db, channel, &mut payloads).await;
    assert!(heard.is_empty(), "sent with no watcher: {heard:?}");

    let other_names = lease
        .changes(&NamePrefix::new("other:").unwrap())
        .await
        .unwrap();
    cycle(2).await;
    let heard = heard_before_mark(&db, channel, &mut payloads).await;
    assert!(
        heard.is_empty(),
        "sent with a watcher of other names: {heard:?}"
    );
    drop(other_names);
    until(&db, "SELECT NOT EXISTS (SELECT 1 FROM leasehold.watchers)").await;

    // The same cycles with a watcher of the name: told.
    let _watching = advisory
        .changes(&NamePrefix::new("jobs:").unwrap())
        .await
        .unwrap();
    cycle(3).await;
    let heard = heard_before_mark(&db, channel, &mut payloads).await;
    let told = |name: &str| heard.iter().filter(|n| *n == name).count();
    // Each mode's grant, waiter, departure and release; the grant and the eviction.
    assert_eq!(told("jobs:x"), 8, "{heard:?}");
    assert_eq!(told("jobs:evicted-3"), 2, "{heard:?}");
    assert_eq!(heard.len(), 10, "{heard:?}");
}

/// An advisory holder whose session was ended on the server is seen gone by a watcher.
/// The next sweep tells it (any client sweeps once a minute), or the next grant of the
/// name, whichever comes first. Sessions last a minute, so the watch's own read at the
/// holder's session end cannot come first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_advisory_holder_whose_session_ended_is_told_by_the_sweep_or_the_next_grant() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    let url = format!("{}?mode=advisory&session_ttl=60s", server.url());
    let connect = async || PostgresBackend::connect(&url).await.unwrap();
    let watching = connect().await;
    let mut watch = Client::new(watching.clone()).watch("jobs:").await.unwrap();
    let name = "jobs:x";
    let holder_pid = format!("SELECT pid FROM leasehold.advisory WHERE name = '{name}'");
    let end_holders_session = async || {
        let pid: i32 = db.query_one(&holder_pid, &[]).await.unwrap().get(0);
        assert!(is_true(&db, &format!("SELECT pg_terminate_backend({pid})")).await);
        until(
            &db,
            &format!("SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = {pid})"),
        )
        .await;
    };

    // Told by the sweep.
    let first = Client::new(connect().await);
    let held = first.mutex(name).unwrap().lock().await.unwrap();
    until_seen(&mut watch, "the first grant", |c| {
        c.name.as_str() == name && c.after.holders.len() == 1
    })
    .await;
    end_holders_session().await;
    assert!(watching.sweep().await.is_ok());
    until_seen(&mut watch, "the ended session", |c| {
        c.name.as_str() == name && c.after.holders.is_empty()
    })
    .await;
    drop(held);

    // Told by the next grant: the hand-off from the gone holder to the next.
    let second = Client::new(connect().await);
    let gone = second.mutex(name).unwrap().lock().await.unwrap();
    until_seen(&mut watch, "the second grant", |c| {
        c.name.as_str() == name && c.after.holders.len() == 1
    })
    .await;
    end_holders_session().await;
    let third = Client::new(connect().await);
    let next = third.mutex(name).unwrap().lock().await.unwrap();
    let seen = until_seen(&mut watch, "the next grant", |c| {
        c.name.as_str() == name && c.after.holders.iter().any(|h| h.token == next.token())
    })
    .await;
    assert_eq!(
        seen.hand_off().map(|(from, _)| from.token),
        Some(gone.token()),
        "the ended session's grant was not the one before"
    );
    next.release().await.unwrap();
    drop(gone);
}

/// A waiter that gives up is seen leaving the queue, in both modes.
/// In advisory mode no statement of the schema ends a cancelled wait: the client tells the
/// watchers itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_sees_a_waiter_come_and_give_up() {
    let server = Postgres::start().await.unwrap();
    for url in [
        server.url(),
        format!("{}?mode=advisory&session_ttl=60s", server.url()),
    ] {
        let holder = Client::new(PostgresBackend::connect(&url).await.unwrap());
        let waiter = Client::new(PostgresBackend::connect(&url).await.unwrap());
        let mut watch = holder.watch("jobs:").await.unwrap();
        let guard = holder.mutex("jobs:w").unwrap().lock().await.unwrap();
        let mutex = waiter.mutex("jobs:w").unwrap();
        let waiting = tokio::spawn(async move { mutex.lock_timeout(Duration::from_secs(3)).await });
        until_seen(&mut watch, "the waiter", |c| c.after.waiters.len() == 1).await;
        assert!(waiting.await.unwrap().unwrap().is_none(), "granted twice");
        let seen = until_seen(&mut watch, "the waiter leave", |c| {
            c.after.waiters.is_empty()
        })
        .await;
        assert_eq!(seen.after.holders[0].token, guard.token(), "{url}");
        guard.release().await.unwrap();
    }
}

/// Version 5 keeps the holders of version 4 holding, and tells the watchers of their release.
/// A lease-mode grant and an advisory lock taken by a client of version 4 (its statements
/// sent raw) are still held, fenced and released once after a client of version 5
/// migrated the schema; their releases, by the version 4 statements, are watched. The
/// advisory functions keep version 4's settings, and a session still records its own start.
/// A role other than the owner, with the rights it needed under version 4, still locks in
/// both modes, watched or not; to watch, it needs EXECUTE on `watch`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holders_of_version_4_keep_their_locks_across_version_5() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    old_schema(&db, 4).await;
    db.batch_execute(
        "CREATE ROLE locker LOGIN; GRANT USAGE ON SCHEMA old TO locker; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA old TO locker; \
         GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA old TO locker",
    )
    .await
    .unwrap();
    let lease_holder = database(&server.url()).await;
    let lease_token: i64 = lease_holder
        .query_one(
            "SELECT o_token FROM old.acquire('leased', 'old-lease', 'x', NULL, 600000, \
             true, false, 0, NULL)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let advisory_holder = database(&server.url()).await;
    let advisory_token: i64 = advisory_holder
        .query_one(
            "SELECT old.advisory_acquire('advised', 'old-advisory', false, false, 600000, NULL)",
            &[],
        )
        .await
        .unwrap()
        .get(0);

    let lease = PostgresBackend::connect(&format!("{}?schema=old", server.url()))
        .await
        .unwrap();
    let advisory = PostgresBackend::connect(&format!(
        "{}?schema=old&mode=advisory&session_ttl=30s",
        server.url()
    ))
    .await
    .unwrap();
    let version: i32 = db
        .query_one("SELECT max(version) FROM old.version", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(version, 5);
    let settings = async |function: &str| -> Vec<String> {
        db.query_one(
            "SELECT coalesce(proconfig, '{}') FROM pg_proc \
             WHERE pronamespace = 'old'::regnamespace AND proname = $1",
            &[&function],
        )
        .await
        .unwrap()
        .get(0)
    };
    assert_eq!(
        settings("advisory_acquire").await,
        ["enable_bitmapscan=off"]
    );
    assert_eq!(
        settings("advisory_release").await,
        ["enable_bitmapscan=off", "client_min_messages=error"]
    );

    let holds = async |name: &str, token: i64, owner: &str| -> bool {
        db.query_one("SELECT old.holds($1, $2, $3)", &[&name, &token, &owner])
            .await
            .unwrap()
            .get(0)
    };
    assert!(holds("leased", lease_token, "old-lease").await);
    assert!(holds("advised", advisory_token, "old-advisory").await);
    let lease = Client::new(lease);
    let advisory = Client::new(advisory);
    let leased = lease.mutex("leased").unwrap();
    let advised = advisory.mutex("advised").unwrap();
    assert!(leased.try_lock().await.unwrap().is_none(), "granted twice");
    assert!(advised.try_lock().await.unwrap().is_none(), "granted twice");

    let mut feed = lease
        .backend()
        .changes(&NamePrefix::default())
        .await
        .unwrap();
    let released = async |session: &tokio_postgres::Client, sql: &str| -> bool {
        session.query_one(sql, &[]).await.unwrap().get(0)
    };
    let release_lease = "SELECT old.release('leased', 'old-lease')";
    assert!(released(&lease_holder, release_lease).await);
    assert!(
        !released(&lease_holder, release_lease).await,
        "released twice"
    );
    assert_eq!(
        next_notice(&mut feed).await,
        Change::Lock(LockName::new("leased").unwrap())
    );
    let release_advisory = "SELECT old.advisory_release('advised', false)";
    assert!(released(&advisory_holder, release_advisory).await);
    assert!(
        !released(&advisory_holder, release_advisory).await,
        "released twice"
    );
    assert_eq!(
        next_notice(&mut feed).await,
        Change::Lock(LockName::new("advised").unwrap())
    );
    assert!(!holds("leased", lease_token, "old-lease").await);
    assert!(!holds("advised", advisory_token, "old-advisory").await);

    let next = leased
        .try_lock()
        .await
        .unwrap()
        .expect("free after the release");
    assert!(u64::from(next.token()) > lease_token as u64);
    next.release().await.unwrap();
    let next = advised
        .try_lock()
        .await
        .unwrap()
        .expect("free after the release");
    assert!(u64::from(next.token()) > advisory_token as u64);
    next.release().await.unwrap();

    // The version 4 session under version 5: its row names its own start.
    advisory_holder
        .query_one(
            "SELECT old.advisory_acquire('advised', 'again', false, false, 600000, NULL)",
            &[],
        )
        .await
        .unwrap();
    let own_start = "SELECT a.started = s.backend_start FROM old.advisory a \
                     JOIN pg_stat_activity s ON s.pid = a.pid WHERE a.pid = pg_backend_pid()";
    assert!(is_true(&advisory_holder, own_start).await);
    assert!(released(&advisory_holder, release_advisory).await);

    // Another role: locks, watched (the feed above) or not.
    let as_locker = server.url().replace("postgres@", "locker@");
    let lock_once = async |mode: &str| -> PostgresBackend {
        let url = format!("{as_locker}?schema=old&mode={mode}");
        let backend = PostgresBackend::connect(&url).await.unwrap();
        let client = Client::new(backend.clone());
        let guard = client.mutex("by-locker").unwrap().lock().await.unwrap();
        guard.release().await.unwrap();
        backend
    };
    for mode in ["lease", "advisory"] {
        lock_once(mode).await;
        until_named(&mut feed, "by-locker").await;
    }
    drop(feed);
    until(&db, "SELECT NOT EXISTS (SELECT 1 FROM old.watchers)").await;
    for mode in ["lease", "advisory"] {
        let backend = lock_once(mode).await;
        let refused = backend.changes(&NamePrefix::default()).await.unwrap_err();
        assert!(
            refused.to_string().contains("permission denied"),
            "{refused}"
        );
    }
    db.batch_execute("GRANT EXECUTE ON FUNCTION old.watch(text) TO locker")
        .await
        .unwrap();
    let backend = PostgresBackend::connect(&format!("{as_locker}?schema=old"))
        .await
        .unwrap();
    let mut feed = backend.changes(&NamePrefix::default()).await.unwrap();
    let guard = Client::new(backend)
        .mutex("by-locker")
        .unwrap()
        .lock()
        .await
        .unwrap();
    until_named(&mut feed, "by-locker").await;
    guard.release().await.unwrap();
}

/// Another role watches through a schema whose owner is no superuser.
/// `watch` runs as that owner, who cannot read other roles' sessions, so the watcher's
/// session start must come from the watcher itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_watches_a_schema_its_plain_owner_made() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    db.batch_execute(
        "CREATE ROLE plain_owner LOGIN; CREATE ROLE onlooker LOGIN; \
         GRANT CREATE ON DATABASE postgres TO plain_owner",
    )
    .await
    .unwrap();
    let as_owner = server.url().replace("postgres@", "plain_owner@");
    let owner = PostgresBackend::connect(&format!("{as_owner}?schema=owned"))
        .await
        .unwrap();
    let owners = database(&as_owner).await;
    owners
        .batch_execute(
            "GRANT USAGE ON SCHEMA owned TO onlooker; \
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA owned TO onlooker; \
             GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA owned TO onlooker; \
             GRANT EXECUTE ON FUNCTION owned.watch(text) TO onlooker",
        )
        .await
        .unwrap();
    let as_onlooker = server.url().replace("postgres@", "onlooker@");
    let onlooker = PostgresBackend::connect(&format!("{as_onlooker}?schema=owned"))
        .await
        .unwrap();
    let mut feed = onlooker
        .changes(&NamePrefix::new("seen:").unwrap())
        .await
        .unwrap();
    let guard = Client::new(owner)
        .mutex("seen:a")
        .unwrap()
        .lock()
        .await
        .unwrap();
    until_named(&mut feed, "seen:a").await;
    guard.release().await.unwrap();
}
