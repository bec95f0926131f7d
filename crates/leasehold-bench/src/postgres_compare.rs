//! leasehold's PostgreSQL backend side by side with its own floor, on one server, in one run.
//! The sides are:
//!
//! - **leasehold** (lease mode) and **leasehold advisory** (`mode=advisory`), through the
//!   public API;
//! - the **statement floor**: the same grant and release statements leasehold's lease mode
//!   sends (`leasehold.acquire(…)`, `leasehold.release(…)`), prepared and sent raw with
//!   tokio-postgres on a connection per client — what a cycle costs without leasehold's
//!   client around it;
//! - the **advisory statement floor**: advisory mode's grant and release statements
//!   (`leasehold.advisory_acquire(…)`, `leasehold.advisory_release(…)`) sent raw on the
//!   client's own session;
//! - **bare advisory locks**: `pg_try_advisory_lock` / `pg_advisory_unlock` sent raw (no
//!   token, no waiting, no liveness).
//!
//! The *server-cpu* side runs uncontended cycles of each advisory side and of lease mode and
//! its floor once more, reading the CPU time of the server's processes (the postmaster and
//! every session below it) around each: the server's cost per cycle, which a rate alone
//! hides while the clients are the bound.
//!
//! Every round also has *interleaved* rows: each client runs a leasehold cycle and a floor
//! cycle by turns, so that whatever else the machine runs falls on both alike. Round trips
//! of an uncontended cycle are counted by the server (`pg_stat_statements`) when the binary
//! starts its own.
//!
//! ```sh
//! cargo run --release -p leasehold-bench --bin postgres-compare            # starts its own PostgreSQL
//! cargo run --release -p leasehold-bench --bin postgres-compare -- --url postgres://me@127.0.0.1/db --duration 5s --json
//! cargo run --release -p leasehold-bench --bin postgres-compare -- --only floor   # or leasehold, advisory, advisory-floor, bare-advisory, server-cpu
//! # the server on core 0, the clients on core 1; prints the server's CPU time per cycle
//! LEASEHOLD_SERVER_CPUS=0 taskset -c 1 cargo run --release -p leasehold-bench --bin postgres-compare
//! # the same while a change feed of every lock is open (its notices drained), or a watch
//! # of every lock follows them (each lock named read back)
//! LEASEHOLD_BENCH_WATCH=feed cargo run --release -p leasehold-bench --bin postgres-compare -- --only server-cpu
//! LEASEHOLD_BENCH_WATCH=watch cargo run --release -p leasehold-bench --bin postgres-compare -- --only server-cpu
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: failures should be loud

use std::time::{Duration, Instant};

use leasehold::postgres::tokio_postgres::{self, NoTls, Statement};
use leasehold_cli::bench::{BenchSpec, Row, Stats, cycles, json, table};
use serde_json::json as j;

mod common;
use common::{
    Args, CpuSide, Cycle, Rounds, interleaved, leasehold_cycle, pin_servers, print_server_cpu,
    process_tree, tree_cpu_time, uncontended,
};

const ROUNDS: usize = 3;
const TTL_MS: i64 = 30_000;

/// A raw tokio-postgres connection with the floor's statements prepared.
#[derive(Clone)]
struct Raw {
    client: std::sync::Arc<tokio_postgres::Client>,
    acquire: Statement,
    release: Statement,
    try_advisory: Statement,
    advisory_unlock: Statement,
    advisory_acquire: Statement,
    advisory_release: Statement,
}

impl Raw {
    async fn connect(url: &str) -> Raw {
        let (client, connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
        tokio::spawn(connection);
        let acquire = client
            .prepare(
                "SELECT o_token, o_retry_ms, o_waited_ms \
                 FROM leasehold.acquire($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            )
            .await
            .unwrap();
        let release = client
            .prepare("SELECT leasehold.release($1, $2)")
            .await
            .unwrap();
        let try_advisory = client
            .prepare("SELECT pg_try_advisory_lock($1)")
            .await
            .unwrap();
        let advisory_unlock = client
            .prepare("SELECT pg_advisory_unlock($1)")
            .await
            .unwrap();
        let advisory_acquire = client
            .prepare("SELECT leasehold.advisory_acquire($1, $2, false, false, $3, NULL)")
            .await
            .unwrap();
        let advisory_release = client
            .prepare("SELECT leasehold.advisory_release($1, false)")
            .await
            .unwrap();
        Raw {
            client: std::sync::Arc::new(client),
            acquire,
            release,
            try_advisory,
            advisory_unlock,
            advisory_acquire,
            advisory_release,
        }
    }
}

/// One floor cycle on `name`: the grant statement until it grants, then the release statement.
/// Uncontended (`waiting`), it is the request leasehold's lock sends (fair, waiting);
/// contended, a try that leaves no queue entry, sent again at once.
fn floor_cycle(raw: Raw, name: String, waiting: bool) -> impl FnMut() -> Cycle + Send + 'static {
    let mut n = 0u64;
    move || {
        let raw = raw.clone();
        let name = name.clone();
        n += 1;
        let owner = format!("floor-{}-{n}", std::process::id());
        Box::pin(async move {
            let started = Instant::now();
            loop {
                let row = raw
                    .client
                    .query_one(
                        &raw.acquire,
                        &[
                            &name,
                            &owner,
                            &(b'x' as i8),
                            &None::<i32>,
                            &TTL_MS,
                            &true,
                            &waiting,
                            &0_i64,
                            &None::<Vec<u8>>,
                        ],
                    )
                    .await
                    .unwrap();
                if row.get::<_, Option<i64>>(0).is_some() {
                    break;
                }
            }
            let took = started.elapsed();
            raw.client
                .query_one(&raw.release, &[&name, &owner])
                .await
                .unwrap();
            took
        })
    }
}

/// One bare advisory cycle on key `key`.
/// `pg_try_advisory_lock` until it takes, then `pg_advisory_unlock`.
fn bare_advisory_cycle(raw: Raw, key: i64) -> impl FnMut() -> Cycle + Send + 'static {
    move || {
        let raw = raw.clone();
        Box::pin(async move {
            let started = Instant::now();
            while !raw
                .client
                .query_one(&raw.try_advisory, &[&key])
                .await
                .unwrap()
                .get::<_, bool>(0)
            {}
            let took = started.elapsed();
            raw.client
                .query_one(&raw.advisory_unlock, &[&key])
                .await
                .unwrap();
            took
        })
    }
}

/// One advisory floor cycle on `name`.
/// Advisory mode's grant statement until it grants, then its release statement, on the
/// client's session.
fn advisory_floor_cycle(raw: Raw, name: String) -> impl FnMut() -> Cycle + Send + 'static {
    let mut n = 0u64;
    move || {
        let raw = raw.clone();
        let name = name.clone();
        n += 1;
        let owner = format!("advisory-floor-{}-{n}", std::process::id());
        Box::pin(async move {
            let started = Instant::now();
            while raw
                .client
                .query_one(&raw.advisory_acquire, &[&name, &owner, &TTL_MS])
                .await
                .unwrap()
                .get::<_, Option<i64>>(0)
                .is_none()
            {}
            let took = started.elapsed();
            raw.client
                .query_one(&raw.advisory_release, &[&name])
                .await
                .unwrap();
            took
        })
    }
}

/// A number for a name, for the bare advisory side.
fn key(name: &str) -> i64 {
    name.bytes()
        .fold(17_i64, |h, b| h.wrapping_mul(31).wrapping_add(i64::from(b)))
}

/// Statements of leasehold's schema the server has run, from `pg_stat_statements`.
/// Top-level ones, so one per round trip; `None` without the extension.
async fn statements(admin: &tokio_postgres::Client) -> Option<i64> {
    admin
        .query_one(
            "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
             WHERE query LIKE '%leasehold.%' AND query NOT LIKE '%pg_stat_statements%'",
            &[],
        )
        .await
        .ok()
        .map(|row| row.get(0))
}

/// Follows every lock while the server's CPU is read, as `LEASEHOLD_BENCH_WATCH` asks.
/// `feed`: a change feed whose notices are drained; `watch`: a watch that reads each lock
/// named. Unset: nothing follows them.
async fn watcher(url: &str) -> Option<tokio::task::JoinHandle<()>> {
    let how = std::env::var("LEASEHOLD_BENCH_WATCH").ok()?;
    let client = leasehold::connect(url).await.expect("connect");
    eprintln!("server CPU per cycle with a {how} of every lock");
    Some(match how.as_str() {
        "feed" => {
            let mut feed = (client.backend())
                .changes(&leasehold::NamePrefix::default())
                .await
                .expect("a change feed");
            tokio::spawn(async move { while feed.next().await.is_some() {} })
        }
        "watch" => {
            let mut watch = client.watch("").await.expect("a watch");
            tokio::spawn(async move { while watch.next().await.is_ok() {} })
        }
        other => panic!("LEASEHOLD_BENCH_WATCH={other}: feed or watch"),
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let mut server;
    let mut postmaster = None;
    let url = match &args.url {
        Some(url) => url.clone(),
        None => {
            server = leasehold_testkit::Postgres::builder()
                .config("max_connections", "400")
                .config("shared_preload_libraries", "pg_stat_statements")
                .start()
                .await
                .expect("PostgreSQL");
            // The postmaster and the processes it runs now; later sessions inherit its CPUs.
            let pid = server.process().pid().expect("a running server");
            pin_servers(&process_tree(pid));
            postmaster = Some(pid);
            server.url()
        }
    };
    let advisory_url = format!(
        "{url}{}mode=advisory&session_ttl=30s",
        if url.contains('?') { '&' } else { '?' }
    );
    let spec = BenchSpec {
        duration: args.duration,
        clients: args.clients,
        handoffs: args.handoffs,
    };
    let n = args.clients;
    // Makes the schema the floor's statements call.
    let probe = leasehold::connect(&url).await.expect("connect");
    let (admin, connection) = tokio_postgres::connect(&url, NoTls).await.unwrap();
    tokio::spawn(connection);
    let _ = admin
        .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await;
    let mut raw = Vec::new();
    for _ in 0..n.max(2) {
        raw.push(Raw::connect(&url).await);
    }
    // For the interleaved rows: a leasehold client per raw client, on names of its own.
    let options = leasehold::LockOptions::builder()
        .ttl(Duration::from_millis(TTL_MS as u64))
        .build()
        .unwrap();
    let mut ours = Vec::new();
    for i in 0..n.max(2) {
        let client = leasehold::connect(&url).await.expect("connect");
        let mutex = client
            .mutex(&format!("interleaved-{i}"))
            .unwrap()
            .with_options(options.clone());
        mutex.lock().await.unwrap().release().await.unwrap();
        ours.push(mutex);
    }

    let mut rounds = Rounds::default();
    for _ in 0..args.rounds.unwrap_or(ROUNDS) {
        rounds.next();
        if args.runs("leasehold") {
            let rows = leasehold_cli::bench::leasehold(&spec, || leasehold::connect(&url))
                .await
                .expect("leasehold benchmark");
            rounds.keep(rows);
        }
        if args.runs("floor") {
            let mut rows = uncontended("statement floor", "floor", n, spec.duration, |i, name| {
                floor_cycle(raw[i].clone(), name, true)
            })
            .await;
            rows.push(Row {
                name: format!("statement floor, {n} clients on 1 name (spinning)"),
                stats: cycles(n, spec.duration, |i| {
                    floor_cycle(raw[i].clone(), "floor-shared".into(), false)
                })
                .await,
                handoff: false,
            });
            rounds.keep(rows);
        }
        if args.runs("advisory") {
            let rows = leasehold_cli::bench::leasehold(&spec, || leasehold::connect(&advisory_url))
                .await
                .expect("leasehold advisory benchmark");
            rounds.keep(
                rows.into_iter()
                    .map(|mut row| {
                        row.name = row.name.replacen("leasehold", "leasehold advisory", 1);
                        row
                    })
                    .collect(),
            );
        }
        if args.runs("advisory-floor") {
            let rows = uncontended(
                "advisory statement floor",
                "advisory-floor",
                n,
                spec.duration,
                |i, name| advisory_floor_cycle(raw[i].clone(), name),
            )
            .await;
            rounds.keep(rows);
        }
        if args.runs("bare-advisory") {
            let mut rows = uncontended(
                "bare pg_try_advisory_lock",
                "bare-advisory",
                n,
                spec.duration,
                |i, name| bare_advisory_cycle(raw[i].clone(), key(&name)),
            )
            .await;
            rows.push(Row {
                name: format!("bare pg_try_advisory_lock, {n} clients on 1 name (spinning)"),
                stats: cycles(n, spec.duration, |i| {
                    bare_advisory_cycle(raw[i].clone(), key("bare-advisory-shared"))
                })
                .await,
                handoff: false,
            });
            rounds.keep(rows);
        }
        if args.runs("interleaved") || (args.runs("leasehold") && args.runs("floor")) {
            for clients in [1, n] {
                let (ours_stats, floor_stats) = interleaved(clients, spec.duration, |i| {
                    (
                        leasehold_cycle(ours[i].clone()),
                        floor_cycle(raw[i].clone(), format!("floor-interleaved-{i}"), true),
                    )
                })
                .await;
                let on = if clients == 1 {
                    "1 client".to_owned()
                } else {
                    format!("{clients} clients on {clients} names")
                };
                rounds.keep(vec![
                    Row {
                        name: format!("leasehold interleaved, {on}"),
                        stats: ours_stats,
                        handoff: false,
                    },
                    Row {
                        name: format!("statement floor interleaved, {on}"),
                        stats: floor_stats,
                        handoff: false,
                    },
                ]);
            }
        }
    }
    // The server's CPU time per uncontended cycle of each advisory side and lease mode, at 1
    // and at n clients: what a cycle costs the server, which a rate alone hides when the
    // clients, not the server, are the bound.
    let mut server_cpu = Vec::new();
    if let (Some(postmaster), true) = (postmaster, args.runs("server-cpu")) {
        let watcher = watcher(&url).await;
        let mut advisory_mutexes = Vec::new();
        for i in 0..n {
            let client = leasehold::connect(&advisory_url).await.expect("connect");
            advisory_mutexes.push(client.mutex(&format!("cpu-advisory-{i}")).unwrap());
        }
        let sides: [CpuSide; 5] = [
            (
                "leasehold advisory",
                Box::new(|i| Box::new(leasehold_cycle(advisory_mutexes[i].clone()))),
            ),
            (
                "advisory statement floor",
                Box::new(|i| {
                    Box::new(advisory_floor_cycle(
                        raw[i].clone(),
                        format!("cpu-floor-{i}"),
                    ))
                }),
            ),
            (
                "bare pg_try_advisory_lock",
                Box::new(|i| {
                    Box::new(bare_advisory_cycle(
                        raw[i].clone(),
                        key(&format!("cpu-bare-{i}")),
                    ))
                }),
            ),
            (
                "leasehold",
                Box::new(|i| Box::new(leasehold_cycle(ours[i].clone()))),
            ),
            (
                "statement floor",
                Box::new(|i| Box::new(floor_cycle(raw[i].clone(), format!("cpu-lease-{i}"), true))),
            ),
        ];
        server_cpu =
            common::server_cpu(&sides, n, spec.duration, || tree_cpu_time(postmaster)).await;
        if let Some(watcher) = watcher {
            watcher.abort();
        }
    } else if args.url.is_some() && args.runs("server-cpu") {
        eprintln!("server CPU per cycle: measured only on a server this binary starts");
    }
    let rows = rounds.best();
    let row = |name: &str| -> Stats {
        rows.iter()
            .find(|r| r.name == name)
            .map(|r| r.stats.clone())
            .unwrap_or_default()
    };
    let ratio = |ours: &str, theirs: &str| row(ours).rate() / row(theirs).rate();
    let p = |name: &str, q: f64| row(name).quantile(q).as_secs_f64() * 1000.0;

    // Round trips of an uncontended leasehold cycle, counted by the server.
    let mutex = probe.mutex("round-trips").expect("name");
    let cycle = async || mutex.lock().await.unwrap().release().await.unwrap();
    cycle().await;
    let counted = 1000_i32;
    let before = statements(&admin).await;
    for _ in 0..counted {
        cycle().await;
    }
    let after = statements(&admin).await;
    let per_cycle = match (before, after) {
        (Some(before), Some(after)) => Some((after - before) as f64 / f64::from(counted)),
        _ => None,
    };

    let one = "1 client";
    let many = format!("{n} clients on {n} names");
    let summary = j!({
        "leasehold_vs_floor_1_client": ratio(&format!("leasehold uncontended, {one}"), &format!("statement floor, {one}")),
        "leasehold_vs_floor_n_clients": ratio(&format!("leasehold uncontended, {many}"), &format!("statement floor, {many}")),
        "interleaved_rounds": {
            "leasehold_vs_floor_1_client": rounds.ratios(&format!("leasehold interleaved, {one}"), &format!("statement floor interleaved, {one}")),
            "leasehold_vs_floor_n_clients": rounds.ratios(&format!("leasehold interleaved, {many}"), &format!("statement floor interleaved, {many}")),
        },
        "advisory_vs_floor_1_client": ratio(&format!("leasehold advisory uncontended, {one}"), &format!("advisory statement floor, {one}")),
        "advisory_vs_floor_n_clients": ratio(&format!("leasehold advisory uncontended, {many}"), &format!("advisory statement floor, {many}")),
        "advisory_vs_bare_advisory_1_client": ratio(&format!("leasehold advisory uncontended, {one}"), &format!("bare pg_try_advisory_lock, {one}")),
        "advisory_vs_bare_advisory_n_clients": ratio(&format!("leasehold advisory uncontended, {many}"), &format!("bare pg_try_advisory_lock, {many}")),
        "leasehold_handoff_p50_ms": p("leasehold hand-off (release -> next holds)", 0.5),
        "leasehold_handoff_p99_ms": p("leasehold hand-off (release -> next holds)", 0.99),
        "advisory_handoff_p50_ms": p("leasehold advisory hand-off (release -> next holds)", 0.5),
        "advisory_handoff_p99_ms": p("leasehold advisory hand-off (release -> next holds)", 0.99),
        "round_trips_per_leasehold_cycle": per_cycle,
        "server_cpu": server_cpu,
    });
    if args.json {
        let mut out = json(&rows);
        out["summary"] = summary;
        println!("{out}");
        return;
    }
    print!("{}", table(&rows));
    let f = |key: &str| summary[key].as_f64().unwrap_or(f64::NAN);
    println!();
    println!(
        "leasehold / statement floor: {:.2} (1 client), {:.2} ({n} clients)",
        f("leasehold_vs_floor_1_client"),
        f("leasehold_vs_floor_n_clients"),
    );
    let spread = |key: &str| {
        summary["interleaved_rounds"][key]
            .as_array()
            .map(|r| {
                r.iter()
                    .filter_map(|x| x.as_f64())
                    .map(|x| format!("{x:.3}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default()
    };
    println!(
        "interleaved, each round's ratio (smallest first): [{}] (1 client), [{}] ({n} clients)",
        spread("leasehold_vs_floor_1_client"),
        spread("leasehold_vs_floor_n_clients"),
    );
    println!(
        "leasehold advisory / advisory statement floor: {:.2} (1 client), {:.2} ({n} clients)",
        f("advisory_vs_floor_1_client"),
        f("advisory_vs_floor_n_clients"),
    );
    println!(
        "leasehold advisory / bare pg_try_advisory_lock: {:.2} (1 client), {:.2} ({n} clients)",
        f("advisory_vs_bare_advisory_1_client"),
        f("advisory_vs_bare_advisory_n_clients"),
    );
    println!(
        "hand-off p50 / p99: lease mode {:.2} / {:.2} ms, advisory mode {:.2} / {:.2} ms",
        f("leasehold_handoff_p50_ms"),
        f("leasehold_handoff_p99_ms"),
        f("advisory_handoff_p50_ms"),
        f("advisory_handoff_p99_ms"),
    );
    match per_cycle {
        Some(per_cycle) => println!(
            "round trips per uncontended leasehold cycle (acquire + release): {per_cycle:.2}"
        ),
        None => println!("round trips per cycle: pg_stat_statements is not loaded on this server"),
    }
    print_server_cpu(&server_cpu);
}
