//! leasehold on a Redis Cluster side by side with one Redis server, per unit of server CPU.
//!
//! The binary starts both: one master with a replica, and a Cluster of three masters with
//! a replica each (every master replicates on both sides). Two cores cannot show a
//! Cluster's scale-out, so the comparison is per unit of master CPU: uncontended acquire +
//! release cycles (N clients on N names, spread over the Cluster's slots), the sides taking
//! turns, with the masters' CPU time read around each run from /proc; then hand-offs (a
//! waiter already blocked, the holder releases) on each side. A bare lock (`SET NX PX` +
//! an `EVALSHA` compare-and-delete, redis-rs) runs the same cycles on both, for what the
//! Cluster costs any client.
//!
//! ```sh
//! # the client on core 1, every server it starts on core 0
//! LEASEHOLD_SERVER_CPUS=0 taskset -c 1 cargo run --release -p leasehold-bench --bin cluster-compare
//! cargo run --release -p leasehold-bench --bin cluster-compare -- --duration 5s --rounds 5 --json
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: failures should be loud

use std::time::{Duration, Instant};

use leasehold::Client;
use leasehold_cli::bench::{Stats, handoffs};
use leasehold_testkit::{RedisCluster, RedisReplicated};
use serde_json::json as j;

mod bare;
mod common;
use bare::{BareGrant, bare_cycle};
use common::{Args, Run, bare_connection, measured, median, pin_servers, run};

const ROUNDS: usize = 5;

/// Hand-offs on one side: `a` holds, `b` waits, `a` releases.
async fn handed_off(a: &Client, b: &Client, name: &str, rounds: usize) -> Stats {
    let (holder, waiter) = (a.mutex(name).unwrap(), b.mutex(name).unwrap());
    handoffs(
        rounds,
        || {
            let holder = holder.clone();
            async move { holder.lock().await.unwrap() }
        },
        || {
            let waiter = waiter.clone();
            async move {
                let guard = waiter.lock().await.unwrap();
                let at = Instant::now();
                guard.release().await.unwrap();
                at
            }
        },
        |guard| async move { guard.release().await.unwrap() },
    )
    .await
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let mut single = RedisReplicated::start().await.expect("redis and a replica");
    let mut cluster = RedisCluster::start(3, 1).await.expect("redis cluster");
    let mut pids: Vec<u32> = [&mut single.primary, &mut single.replica]
        .into_iter()
        .filter_map(|s| s.process().pid())
        .collect();
    pids.extend(
        cluster
            .servers()
            .iter_mut()
            .filter_map(|s| s.process().pid()),
    );
    pin_servers(&pids);
    let single_master = vec![single.primary.process().pid().expect("the master runs")];
    // Servers 0..3 start as the Cluster's masters.
    let cluster_masters: Vec<u32> = cluster.servers()[..3]
        .iter_mut()
        .filter_map(|s| s.process().pid())
        .collect();
    let sides = [
        ("single", single.primary.url(), single_master),
        ("cluster", cluster.url(), cluster_masters),
    ];
    let mut clients: Vec<Vec<Client>> = Vec::new();
    for (_, url, _) in &sides {
        let mut side = Vec::new();
        for _ in 0..args.clients.max(2) {
            side.push(leasehold::connect(url).await.expect("connect"));
        }
        clients.push(side);
    }
    // A first cycle on every connection (scripts, subscriptions).
    for (side, (slug, _, masters)) in sides.iter().enumerate() {
        run(&clients[side], slug, Duration::from_millis(200), masters).await;
    }

    // The bare lock: one connection per client, as leasehold's clients have.
    let mut bare_single = Vec::new();
    let mut bare_cluster = Vec::new();
    for _ in 0..args.clients {
        bare_single.push(bare_connection(&single.primary.url()).await);
        let nodes: Vec<String> = (cluster.servers().iter())
            .map(|s| format!("redis://{}", s.addr()))
            .collect();
        let client = redis::cluster::ClusterClient::new(nodes).unwrap();
        bare_cluster.push(client.get_async_connection().await.unwrap());
    }

    let rounds = args.rounds.unwrap_or(ROUNDS);
    let mut runs: [Vec<Run>; 2] = [Vec::new(), Vec::new()];
    let mut bare: [Vec<Run>; 2] = [Vec::new(), Vec::new()];
    let mut hands: [Vec<Stats>; 2] = [Vec::new(), Vec::new()];
    for round in 0..rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let (slug, _, masters) = &sides[side];
            let clients = &clients[side][..args.clients];
            runs[side].push(run(clients, slug, args.duration, masters).await);
            let key = |i: usize| format!("bare-{slug}-{i}");
            let (n, d) = (args.clients, args.duration);
            bare[side].push(if side == 0 {
                measured(n, d, masters, |i| {
                    bare_cycle(BareGrant::SetNx, bare_single[i].clone(), key(i))
                })
                .await
            } else {
                measured(n, d, masters, |i| {
                    bare_cycle(BareGrant::SetNx, bare_cluster[i].clone(), key(i))
                })
                .await
            });
        }
        for side in order {
            let (a, b) = (&clients[side][0], &clients[side][1]);
            let name = format!("{}-handoff", sides[side].0);
            hands[side].push(handed_off(a, b, &name, args.handoffs).await);
        }
    }
    let cpu_us =
        |side: usize, round: usize| runs[side][round].server_cpu_per_cycle.as_secs_f64() * 1e6;
    let p50_us = |side: usize, round: usize| hands[side][round].quantile(0.5).as_secs_f64() * 1e6;
    // Cycles per master CPU-second, Cluster over single: the single server's CPU per
    // cycle over the Cluster's.
    let per_cpu_ratio = median((0..rounds).map(|r| cpu_us(0, r) / cpu_us(1, r)).collect());
    let bare_us =
        |side: usize, round: usize| bare[side][round].server_cpu_per_cycle.as_secs_f64() * 1e6;
    let bare_ratio = median((0..rounds).map(|r| bare_us(0, r) / bare_us(1, r)).collect());
    let bare_cpu = |side: usize| median((0..rounds).map(|r| bare_us(side, r)).collect());
    let handoff_ratio = median((0..rounds).map(|r| p50_us(1, r) / p50_us(0, r)).collect());
    let best = |side: usize| {
        runs[side]
            .iter()
            .map(|r| r.stats.rate())
            .fold(0.0, f64::max)
    };
    let cpu = |side: usize| median((0..rounds).map(|r| cpu_us(side, r)).collect());
    let p50 = |side: usize| median((0..rounds).map(|r| p50_us(side, r)).collect());
    if args.json {
        let side = |s: usize| {
            j!({
                "best_cycles_per_s": best(s),
                "master_cpu_us_per_cycle": cpu(s),
                "cycles_per_master_cpu_s": 1e6 / cpu(s),
                "handoff_p50_us": p50(s),
                "bare_master_cpu_us_per_cycle": bare_cpu(s),
            })
        };
        println!(
            "{}",
            j!({
                "clients": args.clients,
                "rounds": rounds,
                "handoffs_per_round": args.handoffs,
                "single": side(0),
                "cluster": side(1),
                "cluster_over_single": {
                    "cycles_per_master_cpu_s": per_cpu_ratio,
                    "handoff_p50": handoff_ratio,
                    "bare_cycles_per_master_cpu_s": bare_ratio,
                },
            })
        );
        return;
    }
    println!(
        "{} clients on {} names, {rounds} rounds of {:?} per side, {} hand-offs per round",
        args.clients, args.clients, args.duration, args.handoffs
    );
    println!(
        "{:<8} {:>14} {:>22} {:>20} {:>16} {:>18}",
        "side",
        "best cycles/s",
        "master CPU µs/cycle",
        "cycles/master CPU-s",
        "hand-off p50 µs",
        "bare: CPU µs/cycle"
    );
    for (side, (slug, _, _)) in sides.iter().enumerate() {
        println!(
            "{slug:<8} {:>14.0} {:>22.1} {:>20.0} {:>16.0} {:>18.1}",
            best(side),
            cpu(side),
            1e6 / cpu(side),
            p50(side),
            bare_cpu(side)
        );
    }
    println!(
        "cluster / single, median of rounds: cycles per master CPU-second {per_cpu_ratio:.3} \
         (bare lock: {bare_ratio:.3}), hand-off p50 {handoff_ratio:.3}"
    );
}
