//! Redlock over five redis-servers, beside leasehold on one and rslock's Redlock on the five.
//! It shows the cost of the parallel fan-out, with and without the fencing write-back
//! round, and the floor under it on this machine (a bare PING to all five nodes at once).
//! Contended rows (every client on one name) also give the spread: the busiest client's
//! cycles over the idlest's. Last, the five servers' CPU time per uncontended cycle of
//! leasehold's Redlock (with and without the fencing round) and of rslock's, at 1 and at
//! N clients (`--only server-cpu` runs only that).
//!
//! ```sh
//! cargo run --release -p leasehold-bench --bin redlock-compare [-- --duration 3s --json]
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: failures should be loud

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use leasehold_cli::bench::{BenchSpec, Row, cycles, json, table};
use redis::aio::ConnectionManager;
use serde_json::json as j;

mod common;
use common::{
    Args, CpuSide, Cycle, Rounds, bare_connection, cpu_time, leasehold_cycle, pin_servers,
    print_server_cpu, rslock_cycle, server_cpu, uncontended,
};

const ROUNDS: usize = 2;
/// The lease of rslock's locks (leasehold's bench locks have 30 s too).
const TTL: Duration = Duration::from_secs(30);

/// The floor under any Redlock on this machine.
/// A PING to every node at once, answered by all (no script, no lock), with plain redis-rs
/// connections.
fn ping_all(nodes: Vec<ConnectionManager>) -> impl FnMut() -> Cycle + Send + 'static {
    move || {
        let nodes = nodes.clone();
        Box::pin(async move {
            let started = Instant::now();
            join_all(nodes.into_iter().map(|mut node| async move {
                let _: String = redis::cmd("PING").query_async(&mut node).await.unwrap();
            }))
            .await;
            started.elapsed()
        })
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let mut single = leasehold_testkit::Redis::start()
        .await
        .expect("redis-server");
    let mut nodes = leasehold_testkit::redis_servers(5)
        .await
        .expect("redis-servers");
    let pids: Vec<u32> = std::iter::once(&mut single)
        .chain(nodes.iter_mut())
        .filter_map(|server| server.process().pid())
        .collect();
    let node_pids: Vec<u32> = nodes
        .iter_mut()
        .filter_map(|server| server.process().pid())
        .collect();
    pin_servers(&pids);
    let hosts: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port()))
        .collect();
    // The servers were just started: skip the restart quarantine.
    let redlock = format!("redlock://{}?quarantine=0s", hosts.join(","));
    let targets = [
        ("single redis", single.url()),
        (
            "redlock N=5, no fencing round",
            format!("{redlock}&fencing=false"),
        ),
        ("redlock N=5, fencing", redlock.clone()),
    ];
    let spec = BenchSpec {
        duration: args.duration,
        clients: args.clients,
        handoffs: args.handoffs,
    };
    let one = vec![bare_connection(&single.url()).await];
    let mut five = Vec::new();
    for node in &nodes {
        five.push(bare_connection(&node.url()).await);
    }
    let node_urls: Vec<String> = nodes.iter().map(|n| n.url()).collect();
    let rslocks: Vec<Arc<rslock::LockManager>> = (0..args.clients)
        .map(|_| Arc::new(rslock::LockManager::new(node_urls.clone())))
        .collect();
    let mut rounds = Rounds::default();
    // `--only server-cpu` runs none of the rates' rounds.
    let rates_rounds = match args.only.as_deref() {
        Some("server-cpu") => 0,
        _ => args.rounds.unwrap_or(ROUNDS),
    };
    for _ in 0..rates_rounds {
        rounds.next();
        rounds.keep(vec![
            Row {
                name: "bare PING, 1 node".into(),
                stats: cycles(1, spec.duration, |_| ping_all(one.clone())).await,
                handoff: false,
            },
            Row {
                name: "bare PING, 5 nodes at once".into(),
                stats: cycles(1, spec.duration, |_| ping_all(five.clone())).await,
                handoff: false,
            },
        ]);
        let rs = |i: usize, key: String| rslock_cycle(rslocks[i].clone(), key, TTL);
        let mut rows = uncontended(
            "rslock N=5 uncontended",
            "rslock",
            args.clients,
            spec.duration,
            rs,
        )
        .await;
        rows.push(Row {
            name: format!("rslock N=5 contended, {} clients on 1 name", args.clients),
            stats: cycles(args.clients, spec.duration, |i| {
                rs(i, "rslock-shared".to_owned())
            })
            .await,
            handoff: false,
        });
        rounds.keep(rows);
        for (label, url) in &targets {
            let rows = leasehold_cli::bench::leasehold(&spec, || leasehold::connect(url))
                .await
                .expect("benchmark");
            rounds.keep(
                rows.into_iter()
                    .map(|mut row| {
                        row.name = row.name.replacen("leasehold", label, 1);
                        row
                    })
                    .collect(),
            );
        }
    }
    // The five servers' CPU time per uncontended cycle of each side.
    let mut found = Vec::new();
    if args.runs("server-cpu") {
        let mut fenced = Vec::new();
        let mut unfenced = Vec::new();
        for i in 0..args.clients {
            let client = leasehold::connect(&targets[2].1).await.expect("connect");
            fenced.push(client.mutex(&format!("cpu-fenced-{i}")).unwrap());
            let client = leasehold::connect(&targets[1].1).await.expect("connect");
            unfenced.push(client.mutex(&format!("cpu-unfenced-{i}")).unwrap());
        }
        let sides: [CpuSide; 3] = [
            (
                targets[2].0,
                Box::new(|i| Box::new(leasehold_cycle(fenced[i].clone()))),
            ),
            (
                targets[1].0,
                Box::new(|i| Box::new(leasehold_cycle(unfenced[i].clone()))),
            ),
            (
                "rslock N=5",
                Box::new(|i| {
                    Box::new(rslock_cycle(
                        rslocks[i].clone(),
                        format!("cpu-rslock-{i}"),
                        TTL,
                    ))
                }),
            ),
        ];
        let spent = || node_pids.iter().map(|&pid| cpu_time(pid)).sum();
        found = server_cpu(&sides, args.clients, spec.duration, spent).await;
    }
    let best = rounds.best();
    let p50_of = |row: &str| {
        best.iter()
            .find(|r| r.name == row)
            .map(|r| r.stats.quantile(0.5).as_secs_f64())
            .unwrap_or(f64::NAN)
    };
    let p50 = |label: &str| p50_of(&format!("{label} uncontended, 1 client"));
    let summary = j!({
        "redlock_no_fencing_vs_single_p50": p50(targets[1].0) / p50(targets[0].0),
        "redlock_fencing_vs_single_p50": p50(targets[2].0) / p50(targets[0].0),
        "ping_5_nodes_vs_single_acquire_p50": p50_of("bare PING, 5 nodes at once") / p50(targets[0].0),
    });
    if args.json {
        let mut out = json(&best);
        out["summary"] = summary;
        out["server_cpu"] = j!(found);
        println!("{out}");
    } else {
        print_server_cpu(&found);
        print!("{}", table(&best));
        println!();
        for row in best.iter().filter(|r| r.name.contains(" contended,")) {
            println!(
                "{}: spread {:.2} (busiest client's cycles over the idlest's)",
                row.name,
                row.stats.spread()
            );
        }
        println!(
            "\nacquire p50, redlock / single: {:.2} without the fencing round, {:.2} with it",
            summary["redlock_no_fencing_vs_single_p50"]
                .as_f64()
                .unwrap_or(0.0),
            summary["redlock_fencing_vs_single_p50"]
                .as_f64()
                .unwrap_or(0.0)
        );
        println!(
            "the floor: a bare PING to all five nodes at once takes {:.2}x the single acquire",
            summary["ping_5_nodes_vs_single_acquire_p50"]
                .as_f64()
                .unwrap_or(0.0)
        );
    }
}
