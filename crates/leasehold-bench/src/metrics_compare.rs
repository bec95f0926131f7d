//! leasehold with a Prometheus recorder installed side by side with none, on one Redis.
//!
//! A process has one recorder for good, so each side runs in a process of its own: the
//! binary starts a redis-server, then runs itself as a child per side and round, the sides
//! taking turns. A child connects N clients and runs uncontended acquire + release cycles
//! (N clients on N names) for the duration, reading its own CPU time around them; the
//! parent reads the server's around each child. With the recorder, the child renders the metrics at the end (so
//! they were recorded, not optimised away) and reports how many cycles they counted.
//!
//! ```sh
//! # the clients on core 1, the server on core 0
//! LEASEHOLD_SERVER_CPUS=0 taskset -c 1 cargo run --release -p leasehold-bench --bin metrics-compare
//! cargo run --release -p leasehold-bench --bin metrics-compare -- --duration 5s --rounds 5 --json
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: failures should be loud

use std::time::Duration;

use leasehold_testkit::Redis;
use serde_json::json as j;

mod common;
use common::{Args, cpu_time, median, pin_servers, run};

const ROUNDS: usize = 5;
/// Set in a child: `on` (with a recorder) or `off`, and the server's URL.
const SIDE: &str = "LEASEHOLD_METRICS_SIDE";

/// One side's round, as its child reported it.
struct Round {
    rate: f64,
    cycles: u64,
    /// The child's own CPU time per cycle (its clients, and the recorder if any).
    client_cpu_us: f64,
}

/// A child: N clients' cycles on `url`, with a recorder or without; prints its figures.
async fn child(side: &str, url: &str, args: &Args) {
    let recorder = (side == "on").then(|| {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .expect("a recorder")
    });
    let mut clients = Vec::new();
    for _ in 0..args.clients {
        clients.push(leasehold::connect(url).await.expect("connect"));
    }
    // A first cycle on every connection (scripts, subscriptions), then the measured run.
    run(&clients, side, Duration::from_millis(200), &[]).await;
    let measured = run(&clients, side, args.duration, &[std::process::id()]).await;
    let counted = recorder.map(|handle| {
        let text = handle.render();
        (text.lines())
            .find(|l| l.starts_with("leasehold_acquire_seconds_count{") && l.contains("granted"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    });
    println!(
        "{}",
        j!({
            "rate": measured.stats.rate(),
            "cycles": measured.stats.cycles,
            "client_cpu_us_per_cycle": measured.server_cpu_per_cycle.as_secs_f64() * 1e6,
            "counted": counted,
        })
    );
}

/// Runs this binary as the child of `side`, and reads its figures and the server's CPU.
fn side_round(side: &str, url: &str, args: &[String], server: u32) -> (Round, Duration, u64) {
    let before = cpu_time(server);
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(args)
        .env(SIDE, side)
        .env("LEASEHOLD_METRICS_URL", url)
        .output()
        .expect("the child");
    let spent = cpu_time(server).saturating_sub(before);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let figures: serde_json::Value = serde_json::from_slice(&out.stdout).expect("its figures");
    let round = Round {
        rate: figures["rate"].as_f64().unwrap(),
        cycles: figures["cycles"].as_u64().unwrap(),
        client_cpu_us: figures["client_cpu_us_per_cycle"].as_f64().unwrap(),
    };
    let counted = figures["counted"].as_u64().unwrap_or(0);
    (round, spent, counted)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    if let (Ok(side), Ok(url)) = (std::env::var(SIDE), std::env::var("LEASEHOLD_METRICS_URL")) {
        child(&side, &url, &args).await;
        return;
    }
    let mut server = Redis::start().await.expect("redis");
    let pid = server.process().pid().expect("the server runs");
    pin_servers(&[pid]);
    let passed: Vec<String> = std::env::args().skip(1).filter(|a| a != "--json").collect();
    let rounds = args.rounds.unwrap_or(ROUNDS);
    let mut sides: [Vec<(Round, Duration)>; 2] = [Vec::new(), Vec::new()];
    let mut counted = 0;
    for round in 0..rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let name = ["off", "on"][side];
            let (figures, spent, count) = side_round(name, &server.url(), &passed, pid);
            counted = counted.max(count);
            sides[side].push((figures, spent));
        }
    }
    let cpu_us = |side: usize, r: usize| {
        let (round, spent) = &sides[side][r];
        spent.as_secs_f64() * 1e6 / round.cycles.max(1) as f64
    };
    let rate_ratio = median(
        (0..rounds)
            .map(|r| sides[1][r].0.rate / sides[0][r].0.rate)
            .collect(),
    );
    let cpu_ratio = median((0..rounds).map(|r| cpu_us(1, r) / cpu_us(0, r)).collect());
    let client_ratio = median(
        (0..rounds)
            .map(|r| sides[1][r].0.client_cpu_us / sides[0][r].0.client_cpu_us)
            .collect(),
    );
    let client = |side: usize| median(sides[side].iter().map(|(r, _)| r.client_cpu_us).collect());
    let rate = |side: usize| median(sides[side].iter().map(|(r, _)| r.rate).collect());
    let cpu = |side: usize| median((0..rounds).map(|r| cpu_us(side, r)).collect());
    if args.json {
        println!(
            "{}",
            j!({
                "clients": args.clients,
                "rounds": rounds,
                "off": {
                    "median_cycles_per_s": rate(0),
                    "server_cpu_us_per_cycle": cpu(0),
                    "client_cpu_us_per_cycle": client(0),
                },
                "on": {
                    "median_cycles_per_s": rate(1),
                    "server_cpu_us_per_cycle": cpu(1),
                    "client_cpu_us_per_cycle": client(1),
                },
                "on_over_off": {
                    "rate": rate_ratio,
                    "server_cpu_per_cycle": cpu_ratio,
                    "client_cpu_per_cycle": client_ratio,
                },
                "grants_counted_by_the_recorder": counted,
            })
        );
        return;
    }
    println!(
        "{} clients on {} names, {rounds} rounds of {:?} per side",
        args.clients, args.clients, args.duration
    );
    println!(
        "{:<14} {:>18} {:>22} {:>22}",
        "recorder", "cycles/s (median)", "server CPU µs/cycle", "client CPU µs/cycle"
    );
    for (side, name) in ["none", "prometheus"].iter().enumerate() {
        println!(
            "{name:<14} {:>18.0} {:>22.1} {:>22.1}",
            rate(side),
            cpu(side),
            client(side)
        );
    }
    println!(
        "prometheus / none, median of rounds: rate {rate_ratio:.3}, server CPU per cycle \
         {cpu_ratio:.3}, client CPU per cycle {client_ratio:.3} (the recorder counted \
         {counted} grants in a round)"
    );
}
