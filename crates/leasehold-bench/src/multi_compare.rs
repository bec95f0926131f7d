//! A multi-lock of N names against N locks taken one after the other.
//! On Redis and PostgreSQL (lease and advisory mode).
//!
//! `cargo run --release -p leasehold-bench --bin multi-compare -- [--duration 4s]
//! [--clients 1] [--rounds 3]`: starts a redis-server and a PostgreSQL of its own, pinned
//! to `LEASEHOLD_SERVER_CPUS` (run the binary under `taskset -c` for the clients). One
//! cycle takes the set and releases it; the two sides take turns within each client
//! (`interleaved`), so a slow phase of a server falls on both. `--only redis|postgres|advisory`
//! runs one backend. Printed per backend: cycles/s and the acquire's median and p99 for a
//! multi-lock of 4 names and for 4 mutexes locked in turn.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: failures should be loud

mod common;

use std::time::Instant;

use common::{Args, Cycle, interleaved, pin_servers, process_tree};

/// How many names a set has.
const NAMES: usize = 4;

/// One cycle of a multi-lock of `names`: `lock` (timed), then `release`.
fn multi_cycle(client: leasehold::Client, names: Vec<String>) -> impl FnMut() -> Cycle + Send {
    move || {
        let parts: Vec<leasehold::Part> = (names.iter())
            .map(|n| leasehold::Part::from(client.mutex(n).unwrap()))
            .collect();
        let set = client.multi(parts).unwrap();
        Box::pin(async move {
            let started = Instant::now();
            let guards = set.lock().await.unwrap();
            let took = started.elapsed();
            guards.release().await.unwrap();
            took
        })
    }
}

/// One cycle of `names` locked one after the other (timed), then released in reverse.
fn sequential_cycle(client: leasehold::Client, names: Vec<String>) -> impl FnMut() -> Cycle + Send {
    move || {
        let mutexes: Vec<leasehold::Mutex> =
            names.iter().map(|n| client.mutex(n).unwrap()).collect();
        Box::pin(async move {
            let started = Instant::now();
            let mut guards = Vec::with_capacity(mutexes.len());
            for mutex in &mutexes {
                guards.push(mutex.lock().await.unwrap());
            }
            let took = started.elapsed();
            while let Some(guard) = guards.pop() {
                guard.release().await.unwrap();
            }
            took
        })
    }
}

/// The names of client `i`'s set on `side`.
fn names(side: &str, i: usize) -> Vec<String> {
    (0..NAMES)
        .map(|n| format!("multi-{side}-{i}-{n}"))
        .collect()
}

/// Both sides on `url`, `rounds` times; prints a row per side and round.
async fn compare(label: &str, url: &str, args: &Args, rounds: usize) {
    let mut clients = Vec::new();
    for _ in 0..args.clients {
        clients.push(leasehold::connect(url).await.expect("connect"));
    }
    for round in 1..=rounds {
        let (multi, sequential) = interleaved(args.clients, args.duration, |i| {
            (
                multi_cycle(clients[i].clone(), names("multi", i)),
                sequential_cycle(clients[i].clone(), names("seq", i)),
            )
        })
        .await;
        for (side, stats) in [("multi-lock", &multi), ("one by one", &sequential)] {
            println!(
                "{label:<10} round {round}  {NAMES} names, {side:<10}  {:>8.0} cycles/s  \
                 acquire p50 {:>7.3} ms  p99 {:>7.3} ms",
                stats.rate(),
                stats.quantile(0.5).as_secs_f64() * 1e3,
                stats.quantile(0.99).as_secs_f64() * 1e3,
            );
        }
        println!(
            "{label:<10} round {round}  multi-lock / one by one: rate {:.2}, acquire p50 {:.2}",
            multi.rate() / sequential.rate().max(f64::EPSILON),
            multi.quantile(0.5).as_secs_f64() / sequential.quantile(0.5).as_secs_f64().max(1e-9),
        );
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut args = Args::parse();
    if !std::env::args().any(|a| a == "--clients") {
        args.clients = 1;
    }
    let rounds = args.rounds.unwrap_or(3);
    if args.runs("redis") {
        let mut server = leasehold_testkit::Redis::start()
            .await
            .expect("redis-server");
        pin_servers(&[server.process().pid().expect("a running server")]);
        compare("redis", &server.url(), &args, rounds).await;
    }
    if args.runs("postgres") || args.runs("advisory") {
        let mut server = leasehold_testkit::Postgres::builder()
            .start()
            .await
            .expect("PostgreSQL");
        pin_servers(&process_tree(
            server.process().pid().expect("a running server"),
        ));
        let url = server.url();
        if args.runs("postgres") {
            compare("postgres", &url, &args, rounds).await;
        }
        if args.runs("advisory") {
            let sep = if url.contains('?') { '&' } else { '?' };
            let advisory = format!("{url}{sep}mode=advisory&session_ttl=30s");
            compare("advisory", &advisory, &args, rounds).await;
        }
    }
}
