//! leasehold through Redis Sentinel side by side with a direct connection to its master.
//! One set-up the binary starts: a master, a replica and three sentinels. Each side runs uncontended acquire + release cycles (N clients on N
//! names), the sides take turns, and the master's CPU time is read around each run from
//! /proc: the claim is that after connecting, Sentinel costs a grant nothing.
//!
//! ```sh
//! # the client on core 1, every server it starts on core 0
//! LEASEHOLD_SERVER_CPUS=0 taskset -c 1 cargo run --release -p leasehold-bench --bin sentinel-compare
//! cargo run --release -p leasehold-bench --bin sentinel-compare -- --duration 5s --rounds 5 --json
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: failures should be loud

use std::time::Duration;

use leasehold::Client;
use leasehold_testkit::RedisSentinel;
use serde_json::json as j;

mod common;
use common::{Args, Run, median, pin_servers, run};

const ROUNDS: usize = 5;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let mut set = RedisSentinel::start(1, 3).await.expect("redis sentinel");
    let master = set.master().await.expect("a master");
    let direct_url = set.servers()[master].url();
    let master_pid = set.servers()[master]
        .process()
        .pid()
        .expect("the master runs");
    let mut pids: Vec<u32> = set.sentinels().filter_map(|s| s.pid()).collect();
    pids.extend(set.servers().iter_mut().filter_map(|s| s.process().pid()));
    pin_servers(&pids);
    let sides = [("direct", direct_url), ("sentinel", set.url())];
    let mut clients: Vec<Vec<Client>> = Vec::new();
    for (_, url) in &sides {
        let mut side = Vec::new();
        for _ in 0..args.clients {
            side.push(leasehold::connect(url).await.expect("connect"));
        }
        clients.push(side);
    }
    // A first cycle on every connection (scripts, subscriptions).
    for (side, (slug, _)) in sides.iter().enumerate() {
        run(
            &clients[side],
            slug,
            Duration::from_millis(200),
            &[master_pid],
        )
        .await;
    }

    let rounds = args.rounds.unwrap_or(ROUNDS);
    let mut runs: [Vec<Run>; 2] = [Vec::new(), Vec::new()];
    for round in 0..rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let slug = sides[side].0;
            runs[side].push(run(&clients[side], slug, args.duration, &[master_pid]).await);
        }
    }
    let rate_ratio = median(
        (0..rounds)
            .map(|r| runs[1][r].stats.rate() / runs[0][r].stats.rate())
            .collect(),
    );
    let cpu_ratio = median(
        (0..rounds)
            .map(|r| {
                runs[1][r].server_cpu_per_cycle.as_secs_f64()
                    / runs[0][r].server_cpu_per_cycle.as_secs_f64()
            })
            .collect(),
    );
    let best = |side: usize| {
        runs[side]
            .iter()
            .map(|r| r.stats.rate())
            .fold(0.0, f64::max)
    };
    let cpu = |side: usize| {
        median(
            runs[side]
                .iter()
                .map(|r| r.server_cpu_per_cycle.as_secs_f64() * 1e6)
                .collect(),
        )
    };
    if args.json {
        println!(
            "{}",
            j!({
                "clients": args.clients,
                "rounds": rounds,
                "direct": {"best_cycles_per_s": best(0), "master_cpu_us_per_cycle": cpu(0)},
                "sentinel": {"best_cycles_per_s": best(1), "master_cpu_us_per_cycle": cpu(1)},
                "sentinel_over_direct": {"rate": rate_ratio, "master_cpu_per_cycle": cpu_ratio},
            })
        );
        return;
    }
    println!(
        "{} clients on {} names, {rounds} rounds of {:?} per side",
        args.clients, args.clients, args.duration
    );
    println!(
        "{:<10} {:>16} {:>26}",
        "side", "best cycles/s", "master CPU µs/cycle (med)"
    );
    for (side, (slug, _)) in sides.iter().enumerate() {
        println!("{slug:<10} {:>16.0} {:>26.1}", best(side), cpu(side));
    }
    println!(
        "sentinel / direct, median of rounds: rate {rate_ratio:.3}, master CPU per cycle {cpu_ratio:.3}"
    );
}
