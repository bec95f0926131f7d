//! Lock events on against off, side by side.
//! What recording every grant, renewal and release to a JSON-lines file costs an
//! uncontended Redis cycle.
//!
//! One redis-server (pinned to `LEASEHOLD_SERVER_CPUS`); N clients with events to a file
//! and N without, on names of their own. Each of N tasks runs a cycle of one side, then of
//! the other, then the other way round (see `common::interleaved`), so both sides share
//! the same load; each side's rate is its cycles over the time spent in them. Every round
//! prints both rates and their ratio; the file's lines are counted at the end (so the
//! events were written, not lost).
//!
//! ```sh
//! LEASEHOLD_SERVER_CPUS=0 taskset -c 1 cargo run --release -p leasehold-bench --bin events-compare
//! cargo run --release -p leasehold-bench --bin events-compare -- --clients 16 --duration 4s --rounds 3
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: failures should be loud

use std::sync::Arc;

use leasehold::events::JsonLines;
use leasehold::{Client, LockOptions};
use leasehold_testkit::Redis;

#[allow(dead_code)] // of the comparisons' helpers, the interleaving and the pinning
mod common;
use common::{Args, interleaved, leasehold_cycle, median};

const ROUNDS: usize = 3;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let mut server = Redis::start().await.expect("redis");
    common::pin_servers(&[server.process().pid().expect("the server runs")]);
    let dir = std::env::temp_dir().join(format!("leasehold-events-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("events.jsonl");
    let options = LockOptions::builder()
        .ttl(std::time::Duration::from_secs(30))
        .build()
        .unwrap();
    let mut on = Vec::new();
    let mut off = Vec::new();
    let sink = Arc::new(JsonLines::create(&file).unwrap());
    for _ in 0..args.clients {
        let backend = leasehold::connect_backend(&server.url()).await.unwrap();
        on.push(
            Client::builder_from_arc(backend)
                .options(options.clone())
                .events(sink.clone())
                .build(),
        );
        off.push(
            Client::builder_from_arc(leasehold::connect_backend(&server.url()).await.unwrap())
                .options(options.clone())
                .build(),
        );
    }
    let rounds = args.rounds.unwrap_or(ROUNDS);
    let mut ratios = Vec::new();
    println!(
        "{:<8} {:>14} {:>14} {:>8}",
        "round", "events on /s", "events off /s", "ratio"
    );
    for round in 0..=rounds {
        let (a, b) = interleaved(args.clients, args.duration, |i| {
            (
                leasehold_cycle(on[i].mutex(&format!("on-{i}")).unwrap()),
                leasehold_cycle(off[i].mutex(&format!("off-{i}")).unwrap()),
            )
        })
        .await;
        if round == 0 {
            continue; // warm-up: scripts loaded, connections open
        }
        let ratio = a.rate() / b.rate();
        ratios.push(ratio);
        println!(
            "{round:<8} {:>14.0} {:>14.0} {:>8.3}",
            a.rate(),
            b.rate(),
            ratio
        );
    }
    drop(on);
    drop(sink);
    let lines = std::fs::read_to_string(&file).unwrap().lines().count();
    println!(
        "median ratio {:.3} over {rounds} rounds of {} clients; {lines} events written",
        median(ratios),
        args.clients
    );
    let _ = std::fs::remove_dir_all(&dir);
}
