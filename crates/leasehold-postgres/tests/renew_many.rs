//! Renewals falling due together: one statement per pooled connection in lease mode.
//! Each grant is answered as its own renewal answers it (renewed, taken by another owner,
//! released, evicted, expired), a statement that fails answers its error for each of its
//! grants and only theirs, and advisory mode renews each lock by itself.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::num::NonZeroU32;
use std::time::Duration;

use leasehold_core::backend::{
    Acquire, Backend, Eviction, Expiry, Mode, Release, Renewal, Request,
};
use leasehold_core::{FencingToken, LockName, LossReason, OwnerId};
use leasehold_postgres::{DEFAULT_SCHEMA, PostgresBackend, tokio_postgres};
use leasehold_testkit::Postgres;

mod common;
use common::counting_server;

/// The lease a grant is taken with: long enough never to run out during the test.
const HELD: Duration = Duration::from_secs(60);
/// The lease a renewal asks for: longer, so that an extended grant shows on the server.
const RENEWED: Duration = Duration::from_secs(120);

/// A server counting its statements, a plain connection, and a backend with `params`.
async fn connected(params: &str) -> (Postgres, tokio_postgres::Client, PostgresBackend) {
    let (server, db) = counting_server().await;
    let url = format!("{}?{params}", server.url());
    let backend = PostgresBackend::connect(&url).await.unwrap();
    (server, db, backend)
}

/// Forgets the statements counted so far.
async fn reset(db: &tokio_postgres::Client) {
    db.batch_execute("SELECT pg_stat_statements_reset()")
        .await
        .unwrap();
}

/// How many times statements beginning with `start` ran since the last reset.
async fn calls(db: &tokio_postgres::Client, start: &str) -> i64 {
    let pattern = format!("{}%", start.replace('@', DEFAULT_SCHEMA));
    db.query_one(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements WHERE query LIKE $1",
        &[&pattern],
    )
    .await
    .unwrap()
    .get(0)
}

/// The batch statement (one per pooled connection used).
const BATCH: &str = "UPDATE @.grants g SET expires = clock_timestamp() + r.ttl";
/// A renewal's own statement.
const SINGLE: &str = "UPDATE @.grants SET expires";
/// The look for an eviction after a renewal found no grant.
/// Its constant may be shown as a parameter.
const EVICTED: &str = "SELECT EXISTS (SELECT % FROM @.evictions";

fn request(name: &str, mode: Mode, lane: u32) -> Request {
    let mut req = Request::new(
        LockName::new(name).unwrap(),
        OwnerId::generate(),
        mode,
        HELD,
    );
    req.lane = lane;
    req
}

/// The renewals of `reqs`, each asking for a lease of [`RENEWED`].
fn renewals(reqs: &[Request]) -> Vec<Request> {
    reqs.iter()
        .map(|req| {
            let mut renewal = req.clone();
            renewal.ttl = RENEWED;
            renewal
        })
        .collect()
}

/// Takes `req`'s lock; its token.
async fn grant(backend: &PostgresBackend, req: &Request) -> FencingToken {
    match backend.acquire(req).await.unwrap() {
        Acquire::Granted(grant) => grant.token,
        busy => panic!("{}: {busy:?}", req.name),
    }
}

/// Ends the lease of `name`'s grants on the server, as time would.
async fn expire(db: &tokio_postgres::Client, name: &str) {
    let sql = format!(
        "UPDATE {DEFAULT_SCHEMA}.grants SET expires = clock_timestamp() - interval '1 second' \
         WHERE name = $1"
    );
    assert_eq!(db.execute(&sql, &[&name]).await.unwrap(), 1, "{name}");
}

/// The milliseconds left of `owner`'s lease of `name` on the server's clock.
async fn remaining(db: &tokio_postgres::Client, name: &str, owner: &OwnerId) -> i64 {
    let sql = format!(
        "SELECT (extract(epoch FROM expires - clock_timestamp()) * 1000)::bigint \
         FROM {DEFAULT_SCHEMA}.grants WHERE name = $1 AND owner = $2"
    );
    db.query_one(&sql, &[&name, &owner.as_str()])
        .await
        .unwrap()
        .get(0)
}

/// The grants of one setup, under names beginning with `prefix`, and the renewals of them.
/// Lane 0 (the first pooled connection): a plain grant, a shared one, one taken by
/// another owner after it expired, a released one, an evicted one, an expired one; lane 1
/// (the second connection): a plain grant and a permit. Each renewal asks for
/// [`RENEWED`]. Also the owner that took the lock "taken", and its request.
async fn setup(
    backend: &PostgresBackend,
    db: &tokio_postgres::Client,
    prefix: &str,
) -> (Vec<Request>, Request) {
    let name = |what: &str| format!("{prefix}-{what}");
    let permit = Mode::Permit {
        limit: NonZeroU32::new(3).unwrap(),
    };
    let reqs = vec![
        request(&name("plain"), Mode::Exclusive, 0),
        request(&name("shared"), Mode::Shared, 0),
        request(&name("taken"), Mode::Exclusive, 0),
        request(&name("released"), Mode::Exclusive, 0),
        request(&name("evicted"), Mode::Exclusive, 0),
        request(&name("expired"), Mode::Exclusive, 0),
        request(&name("other-lane"), Mode::Exclusive, 1),
        request(&name("permit"), permit, 1),
    ];
    let mut tokens = Vec::new();
    for req in &reqs {
        tokens.push(grant(backend, req).await);
    }
    // Taken: its lease ran out, and another owner was granted the lock.
    expire(db, reqs[2].name.as_str()).await;
    let taker = request(&name("taken"), Mode::Exclusive, 0);
    grant(backend, &taker).await;
    assert!(matches!(
        backend.release(&reqs[3]).await.unwrap(),
        Release::Released
    ));
    let eviction = Eviction::new(
        reqs[4].owner.clone(),
        tokens[4],
        "ops@host".into(),
        "stuck".into(),
    );
    assert!(
        backend
            .evict(&reqs[4].name, Mode::Exclusive, &eviction)
            .await
            .unwrap()
    );
    expire(db, reqs[5].name.as_str()).await;
    (renewals(&reqs), taker)
}

/// What the renewals of a setup are answered, in its order.
fn expected() -> Vec<Renewal> {
    let renewed = Renewal::Renewed(Expiry::After(RENEWED));
    let not_owner = Renewal::Lost(LossReason::NotOwner);
    vec![
        renewed.clone(),
        renewed.clone(),
        not_owner.clone(),
        not_owner.clone(),
        Renewal::Lost(LossReason::Evicted),
        not_owner,
        renewed.clone(),
        renewed,
    ]
}

/// The grants a setup's renewals extended have the lease they asked for.
/// The others are gone, or untouched.
async fn check_leases(db: &tokio_postgres::Client, renewals: &[Request], taker: &Request) {
    let extended = (RENEWED.as_millis() - 30_000) as i64;
    for i in [0, 1, 6, 7] {
        let req = &renewals[i];
        let left = remaining(db, req.name.as_str(), &req.owner).await;
        assert!(left > extended, "{}: not extended ({left} ms)", req.name);
    }
    // The new owner's grant keeps its own lease; the expired one stays expired.
    let left = remaining(db, taker.name.as_str(), &taker.owner).await;
    assert!(
        left <= HELD.as_millis() as i64,
        "the taker's lease: {left} ms"
    );
    let left = remaining(db, renewals[5].name.as_str(), &renewals[5].owner).await;
    assert!(left < 0, "an expired grant was renewed ({left} ms)");
}

/// A batch answers each grant exactly as its own renewal does, on identical setups.
/// It sends one statement per pooled connection and no single renewal; only the grants
/// found gone are looked up again (was it evicted?).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_answers_each_grant_as_its_own_renewal_in_one_statement_per_connection() {
    let (_server, db, backend) = connected("pool_size=2").await;
    let (batched, batch_taker) = setup(&backend, &db, "batch").await;
    let (single, single_taker) = setup(&backend, &db, "single").await;

    reset(&db).await;
    let answers: Vec<Renewal> = backend
        .renew_many(&batched.iter().collect::<Vec<_>>())
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(calls(&db, BATCH).await, 2, "one statement per connection");
    assert_eq!(calls(&db, SINGLE).await, 0, "a renewal sent by itself");
    assert_eq!(calls(&db, EVICTED).await, 4, "a look for each grant gone");

    let mut one_by_one = Vec::new();
    for req in &single {
        one_by_one.push(backend.renew(req).await.unwrap());
    }
    assert_eq!(calls(&db, SINGLE).await, 8);
    assert_eq!(answers, one_by_one, "the batch's answers and the renewals'");
    assert_eq!(answers, expected());
    check_leases(&db, &batched, &batch_taker).await;
    check_leases(&db, &single, &single_taker).await;

    // The grants renewed are still their owners': renewed again, together.
    let again: Vec<&Request> = [0, 1, 6, 7].iter().map(|&i| &batched[i]).collect();
    let answers = backend.renew_many(&again).await;
    assert!(
        answers.iter().all(|a| matches!(a, Ok(Renewal::Renewed(_)))),
        "{answers:?}"
    );
    assert_eq!(
        calls(&db, BATCH).await,
        4,
        "one statement per connection again"
    );
}

/// A request alone on its connection, or given twice, is renewed by its own statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_alone_on_its_connection_or_given_twice_is_renewed_by_itself() {
    let (_server, db, backend) = connected("pool_size=2").await;
    let a = request("a", Mode::Exclusive, 0);
    let b = request("b", Mode::Exclusive, 0);
    let c = request("c", Mode::Exclusive, 1);
    for req in [&a, &b, &c] {
        grant(&backend, req).await;
    }
    reset(&db).await;
    let answers = backend.renew_many(&[&a, &b, &c, &a]).await;
    let held = Renewal::Renewed(Expiry::After(HELD));
    for answer in answers {
        assert_eq!(answer.unwrap(), held);
    }
    // a and b together; c alone on the second connection, and a's second renewal alone.
    assert_eq!(calls(&db, BATCH).await, 1);
    assert_eq!(calls(&db, SINGLE).await, 2);
}

/// Where statements are not prepared (a transaction pool), the batch is sent with its text.
/// Its parameters' types go with it, and it answers as the prepared one does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unprepared_the_batch_is_sent_with_its_text_and_answers_alike() {
    let (_server, db, backend) = connected("pool_size=1&pooling=transaction").await;
    let held = request("held", Mode::Exclusive, 0);
    let released = request("released", Mode::Exclusive, 0);
    for req in [&held, &released] {
        grant(&backend, req).await;
    }
    backend.release(&released).await.unwrap();
    reset(&db).await;
    let answers: Vec<Renewal> = backend
        .renew_many(&[&held, &released])
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(
        answers,
        [
            Renewal::Renewed(Expiry::After(HELD)),
            Renewal::Lost(LossReason::NotOwner)
        ]
    );
    assert_eq!(calls(&db, BATCH).await, 1);
}

/// A batch statement that fails answers its error for each grant in it.
/// The grants of the other connection's statement are renewed all the same; the failed
/// statement extended none of its grants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_statement_answers_its_error_for_each_of_its_grants() {
    let (_server, db, backend) = connected("pool_size=2").await;
    let reqs = [
        request("fail-a", Mode::Exclusive, 0),
        request("ok-b", Mode::Exclusive, 0),
        request("ok-c", Mode::Exclusive, 1),
        request("ok-d", Mode::Exclusive, 1),
    ];
    for req in &reqs {
        grant(&backend, req).await;
    }
    // Any renewal of "fail-a" fails on the server.
    db.batch_execute(&format!(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$; \
         CREATE TRIGGER refuse BEFORE UPDATE ON {DEFAULT_SCHEMA}.grants FOR EACH ROW \
         WHEN (NEW.name = 'fail-a') EXECUTE FUNCTION refuse()"
    ))
    .await
    .unwrap();
    let renewals = renewals(&reqs);
    let answers = backend
        .renew_many(&renewals.iter().collect::<Vec<_>>())
        .await;
    let alone = backend.renew(&renewals[0]).await.unwrap_err();
    assert!(alone.to_string().contains("refused by the test"), "{alone}");
    for answer in &answers[..2] {
        let error = answer.as_ref().unwrap_err();
        assert_eq!(error.to_string(), alone.to_string());
    }
    let renewed = Renewal::Renewed(Expiry::After(RENEWED));
    assert_eq!(answers[2].as_ref().unwrap(), &renewed);
    assert_eq!(answers[3].as_ref().unwrap(), &renewed);
    let left = remaining(&db, "ok-b", &renewals[1].owner).await;
    assert!(
        left <= HELD.as_millis() as i64,
        "extended by a failed batch"
    );
}

/// Advisory mode renews each lock by itself, as its own renewal does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_mode_renews_each_lock_by_itself() {
    let (_server, _db, backend) = connected("mode=advisory").await;
    let a = request("a", Mode::Exclusive, 0);
    let b = request("b", Mode::Exclusive, 0);
    for req in [&a, &b] {
        grant(&backend, req).await;
    }
    let stranger = request("a", Mode::Exclusive, 0);
    let answers = backend.renew_many(&[&a, &b, &stranger]).await;
    // Renewed by the session (its liveness), or lost: the loss's reason, if lost.
    let lost = |renewal: Renewal| match renewal {
        Renewal::Renewed(Expiry::Session(_)) => None,
        Renewal::Lost(reason) => Some(reason),
        other => panic!("{other:?}"),
    };
    let together: Vec<_> = answers.into_iter().map(|a| lost(a.unwrap())).collect();
    let mut alone = Vec::new();
    for req in [&a, &b, &stranger] {
        alone.push(lost(backend.renew(req).await.unwrap()));
    }
    assert_eq!(together, alone);
    assert_eq!(together, [None, None, Some(LossReason::SessionEnded)]);
}
