//! Redlock over five redis-servers side by side with leasehold on one redis-server: the
//! cost of the parallel fan-out, with and without the fencing write-back round.
//!
//! ```sh
//! cargo run --release -p leasehold-bench --bin redlock-compare [-- --duration 3s --json]
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: failures should be loud

use std::time::Duration;

use leasehold_cli::bench::{BenchSpec, Row, json, table};
use serde_json::json as j;

const ROUNDS: usize = 2;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut duration = Duration::from_secs(3);
    let mut as_json = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--duration" => {
                duration = leasehold::parse_duration(&args.next().expect("--duration D"))
                    .expect("a duration such as 3s")
            }
            "--json" => as_json = true,
            other => panic!("unknown argument {other}"),
        }
    }
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
        duration,
        clients: 16,
        handoffs: 100,
    };
    let mut best: Vec<Row> = Vec::new();
    for _ in 0..ROUNDS {
        for (label, url) in &targets {
            let rows = leasehold_cli::bench::leasehold(&spec, || leasehold::connect(url))
                .await
                .expect("benchmark");
            for mut row in rows {
                row.name = row.name.replacen("leasehold", label, 1);
                match best.iter_mut().find(|b| b.name == row.name) {
                    Some(b) if row.handoff && row.stats.quantile(0.5) < b.stats.quantile(0.5) => {
                        *b = row
                    }
                    Some(b) if !row.handoff && row.stats.rate() > b.stats.rate() => *b = row,
                    Some(_) => {}
                    None => best.push(row),
                }
            }
        }
    }
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
    if as_json {
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
