//! Redlock over five redis-servers side by side with leasehold on one redis-server: the
//! cost of the parallel fan-out, with and without the fencing write-back round.
//!
//! ```sh
//! cargo run --release -p leasehold-bench --bin redlock-compare [-- --duration 3s --json]
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: failures should be loud

use leasehold_cli::bench::{BenchSpec, json, table};
use serde_json::json as j;

mod common;
use common::{Args, Best};

const ROUNDS: usize = 2;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let single = leasehold_testkit::Redis::start()
        .await
        .expect("redis-server");
    let nodes = leasehold_testkit::redis_servers(5)
        .await
        .expect("redis-servers");
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
    let mut best = Best::default();
    for _ in 0..ROUNDS {
        for (label, url) in &targets {
            let rows = leasehold_cli::bench::leasehold(&spec, || leasehold::connect(url))
                .await
                .expect("benchmark");
            best.keep(
                rows.into_iter()
                    .map(|mut row| {
                        row.name = row.name.replacen("leasehold", label, 1);
                        row
                    })
                    .collect(),
            );
        }
    }
    let best = best.0;
    let p50 = |label: &str| {
        best.iter()
            .find(|r| r.name == format!("{label} uncontended, 1 client"))
            .map(|r| r.stats.quantile(0.5).as_secs_f64())
            .unwrap_or(f64::NAN)
    };
    let summary = j!({
        "redlock_no_fencing_vs_single_p50": p50(targets[1].0) / p50(targets[0].0),
        "redlock_fencing_vs_single_p50": p50(targets[2].0) / p50(targets[0].0),
    });
    if args.json {
        let mut out = json(&best);
        out["summary"] = summary;
        println!("{out}");
    } else {
        print!("{}", table(&best));
        println!(
            "\nacquire p50, redlock / single: {:.2} without the fencing round, {:.2} with it",
            summary["redlock_no_fencing_vs_single_p50"]
                .as_f64()
                .unwrap_or(0.0),
            summary["redlock_fencing_vs_single_p50"]
                .as_f64()
                .unwrap_or(0.0)
        );
    }
}
