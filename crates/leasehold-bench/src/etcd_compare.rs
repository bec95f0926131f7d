//! leasehold's etcd backend side by side with etcd's own lock service, on one member.
//! The service is the `v3lock` API, driven through etcd-client's `lock` / `unlock` with one
//! lease per client granted up front; both sides run in one run.
//!
//! Besides the rows each side runs on its own, every round has *interleaved* rows: each
//! client runs a leasehold cycle and a lock-service cycle by turns, so that a slow phase of
//! the member (an fsync stall, a backend commit) falls on both sides alike. On a small
//! machine these ratios move by about 1 % from round to round, the separate rows' by 20 %.
//!
//! ```sh
//! cargo run --release -p leasehold-bench --features etcd-client --bin etcd-compare             # starts its own etcd
//! cargo run --release -p leasehold-bench --features etcd-client --bin etcd-compare -- --url etcd://127.0.0.1:2379 --duration 5s --json
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: failures should be loud

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use etcd_client::{Client, LockOptions};
use leasehold_cli::bench::{BenchSpec, Row, Stats, cycles, handoffs, json, table};
use serde_json::json as j;

mod common;
use common::{Args, Cycle, Rounds, interleaved, leasehold_cycle, pin_servers, uncontended};

const ROUNDS: usize = 3;
/// Long enough for the whole run, so the stock clients need no keep-alive stream.
const LEASE_SECONDS: i64 = 3600;

/// An etcd-client connection with its own lease, as a user of the lock service would hold one.
/// Without a lease, every `lock` call makes the server grant a fresh one.
#[derive(Clone)]
struct Stock {
    client: Client,
    lease: i64,
}

impl Stock {
    async fn connect(endpoints: &[String]) -> Stock {
        let mut client = Client::connect(endpoints, None).await.unwrap();
        let lease = client.lease_grant(LEASE_SECONDS, None).await.unwrap().id();
        Stock { client, lease }
    }

    async fn lock(&mut self, name: &str) -> Vec<u8> {
        let options = LockOptions::new().with_lease(self.lease);
        let locked = self.client.lock(name, Some(options)).await.unwrap();
        locked.key().to_vec()
    }

    async fn unlock(&mut self, key: Vec<u8>) {
        self.client.unlock(key).await.unwrap();
    }
}

/// One stock cycle: `lock` (timed), then `unlock`.
fn stock_cycle(stock: Stock, name: String) -> impl FnMut() -> Cycle + Send + 'static {
    move || {
        let mut stock = stock.clone();
        let name = name.clone();
        Box::pin(async move {
            let started = Instant::now();
            let key = stock.lock(&name).await;
            let took = started.elapsed();
            stock.unlock(key).await;
            took
        })
    }
}

/// The interleaved rows (see [`interleaved`]) for `clients` clients, each on names of its own.
async fn interleaved_rows(
    clients: usize,
    duration: Duration,
    ours: &[leasehold::Mutex],
    stock: &[Stock],
) -> Vec<Row> {
    let (ours_stats, stock_stats) = interleaved(clients, duration, |i| {
        (
            leasehold_cycle(ours[i].clone()),
            stock_cycle(stock[i].clone(), format!("stock-interleaved-{i}")),
        )
    })
    .await;
    let on = if clients == 1 {
        "1 client".to_owned()
    } else {
        format!("{clients} clients on {clients} names")
    };
    vec![
        Row {
            name: format!("leasehold interleaved, {on}"),
            stats: ours_stats,
            handoff: false,
        },
        Row {
            name: format!("etcd lock service interleaved, {on}"),
            stats: stock_stats,
            handoff: false,
        },
    ]
}

/// Unary gRPC requests the member has started: each is one client round trip.
/// Streams such as keep-alive and watch are not counted.
async fn unary_requests(member: SocketAddr) -> f64 {
    let metrics = leasehold_testkit::probe::http_get(member, "/metrics")
        .await
        .unwrap();
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("grpc_server_started_total{") && l.contains("grpc_type=\"unary\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let mut server;
    let url = match &args.url {
        Some(url) => url.clone(),
        None => {
            server = leasehold_testkit::Etcd::start().await.expect("etcd");
            let pids: Vec<u32> = (server.members().iter_mut())
                .filter_map(|m| m.process().pid())
                .collect();
            pin_servers(&pids);
            server.url()
        }
    };
    let endpoints: Vec<String> = url
        .trim_start_matches("etcd://")
        .split(['/', '?'])
        .next()
        .unwrap_or_default()
        .split(',')
        .map(str::to_owned)
        .collect();
    // leasehold's clients hold locks with the benchmark's 30 s ttl, which on etcd is the
    // session's (a lock cannot ask for another).
    let ours_url = if url.contains("session_ttl=") {
        url.clone()
    } else {
        let joint = if url.contains('?') { '&' } else { '?' };
        format!("{url}{joint}session_ttl=30s")
    };
    let spec = BenchSpec {
        duration: args.duration,
        clients: args.clients,
        handoffs: args.handoffs,
    };
    let mut stock = Vec::new();
    for _ in 0..args.clients.max(2) {
        stock.push(Stock::connect(&endpoints).await);
    }

    // For the interleaved rows: a leasehold client per stock client, each on a name of its
    // own.
    let options = leasehold::LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut ours = Vec::new();
    for i in 0..args.clients.max(2) {
        let client = leasehold::connect(&ours_url).await.expect("connect");
        let mutex = client
            .mutex(&format!("interleaved-{i}"))
            .unwrap()
            .with_options(options.clone());
        mutex.lock().await.unwrap().release().await.unwrap();
        ours.push(mutex);
    }

    // The two implementations take turns, ROUNDS times, and each row keeps its best round.
    let mut rounds = Rounds::default();
    for round in 0..args.rounds.unwrap_or(ROUNDS) {
        rounds.next();
        if args.runs("leasehold") {
            let rows = leasehold_cli::bench::leasehold(&spec, || leasehold::connect(&ours_url))
                .await
                .expect("leasehold benchmark");
            rounds.keep(rows);
        }
        if !args.runs("stock") {
            continue;
        }

        let mut rows = uncontended(
            "etcd lock service",
            "stock",
            args.clients,
            spec.duration,
            |i, name| stock_cycle(stock[i].clone(), name),
        )
        .await;
        rows.push(Row {
            name: format!("etcd lock service, {} clients on 1 name", args.clients),
            stats: cycles(args.clients, spec.duration, |i| {
                stock_cycle(stock[i].clone(), "stock-shared".into())
            })
            .await,
            handoff: false,
        });
        // Its hand-off takes tens of milliseconds: one round of samples is enough.
        if round == 0 {
            let (holder, waiter) = (stock[0].clone(), stock[1].clone());
            rows.push(Row {
                name: "etcd lock service hand-off".into(),
                stats: handoffs(
                    args.handoffs.min(30),
                    || {
                        let mut holder = holder.clone();
                        async move { holder.lock("stock-handoff").await }
                    },
                    || {
                        let mut waiter = waiter.clone();
                        async move {
                            let key = waiter.lock("stock-handoff").await;
                            let at = Instant::now();
                            waiter.unlock(key).await;
                            at
                        }
                    },
                    |key| {
                        let mut holder = holder.clone();
                        async move { holder.unlock(key).await }
                    },
                )
                .await,
                handoff: true,
            });
        }
        rounds.keep(rows);
        if args.runs("leasehold") {
            for clients in [1, args.clients] {
                rounds.keep(interleaved_rows(clients, spec.duration, &ours, &stock).await);
            }
        }
    }
    let rows = rounds.best();
    let row = |name: &str| -> Stats {
        rows.iter()
            .find(|r| r.name == name)
            .map(|r| r.stats.clone())
            .unwrap_or_default()
    };
    let n = args.clients;
    let ratio = |ours: &str, theirs: &str| row(ours).rate() / row(theirs).rate();
    let p50_ms = |name: &str| row(name).quantile(0.5).as_secs_f64() * 1000.0;

    // Round trips of an uncontended cycle, counted by the member around plain cycles.
    let member: SocketAddr = endpoints[0].parse().expect("an ip:port endpoint");
    let client = leasehold::connect(&ours_url).await.expect("connect");
    let mutex = client.mutex("round-trips").expect("name");
    let cycle = async || mutex.lock().await.unwrap().release().await.unwrap();
    cycle().await;
    let counted = 500u32;
    let before = unary_requests(member).await;
    for _ in 0..counted {
        cycle().await;
    }
    let ours_per_cycle = (unary_requests(member).await - before) / f64::from(counted);
    let mut solo = stock[0].clone();
    let before = unary_requests(member).await;
    for _ in 0..counted {
        let key = solo.lock("round-trips-stock").await;
        solo.unlock(key).await;
    }
    let stock_per_cycle = (unary_requests(member).await - before) / f64::from(counted);

    let summary = j!({
        "leasehold_vs_stock_1_client": ratio("leasehold uncontended, 1 client", "etcd lock service, 1 client"),
        "leasehold_vs_stock_n_clients": ratio(
            &format!("leasehold uncontended, {n} clients on {n} names"),
            &format!("etcd lock service, {n} clients on {n} names"),
        ),
        "leasehold_vs_stock_contended": ratio(
            &format!("leasehold contended, {n} clients on 1 name"),
            &format!("etcd lock service, {n} clients on 1 name"),
        ),
        "paired_rounds": {
            "leasehold_vs_stock_1_client": rounds.paired("leasehold uncontended, 1 client", "etcd lock service, 1 client"),
            "leasehold_vs_stock_n_clients": rounds.paired(
                &format!("leasehold uncontended, {n} clients on {n} names"),
                &format!("etcd lock service, {n} clients on {n} names"),
            ),
            "leasehold_vs_stock_contended": rounds.paired(
                &format!("leasehold contended, {n} clients on 1 name"),
                &format!("etcd lock service, {n} clients on 1 name"),
            ),
        },
        "interleaved_rounds": {
            "leasehold_vs_stock_1_client": rounds.ratios("leasehold interleaved, 1 client", "etcd lock service interleaved, 1 client"),
            "leasehold_vs_stock_n_clients": rounds.ratios(
                &format!("leasehold interleaved, {n} clients on {n} names"),
                &format!("etcd lock service interleaved, {n} clients on {n} names"),
            ),
        },
        "leasehold_handoff_p50_ms": p50_ms("leasehold hand-off (release -> next holds)"),
        "stock_handoff_p50_ms": p50_ms("etcd lock service hand-off"),
        "round_trips_per_leasehold_cycle": ours_per_cycle,
        "round_trips_per_stock_cycle": stock_per_cycle,
    });
    if args.json {
        let mut out = json(&rows);
        out["summary"] = summary;
        println!("{out}");
    } else {
        print!("{}", table(&rows));
        let f = |key: &str| summary[key].as_f64().unwrap_or(f64::NAN);
        println!();
        println!(
            "leasehold / etcd lock service: {:.2} (1 client), {:.2} ({n} clients), {:.2} (contended)",
            f("leasehold_vs_stock_1_client"),
            f("leasehold_vs_stock_n_clients"),
            f("leasehold_vs_stock_contended"),
        );
        let paired = |key: &str| summary["paired_rounds"][key].as_f64().unwrap_or(f64::NAN);
        println!(
            "median of the rounds' own ratios: {:.2} (1 client), {:.2} ({n} clients), {:.2} (contended)",
            paired("leasehold_vs_stock_1_client"),
            paired("leasehold_vs_stock_n_clients"),
            paired("leasehold_vs_stock_contended"),
        );
        let spread = |key: &str| {
            let ratios: Vec<String> = summary["interleaved_rounds"][key]
                .as_array()
                .map(|r| {
                    r.iter()
                        .filter_map(|x| x.as_f64())
                        .map(|x| format!("{x:.3}"))
                        .collect()
                })
                .unwrap_or_default();
            ratios.join(" ")
        };
        println!(
            "interleaved, each round's ratio (smallest first): [{}] (1 client), [{}] ({n} clients)",
            spread("leasehold_vs_stock_1_client"),
            spread("leasehold_vs_stock_n_clients"),
        );
        println!(
            "hand-off p50: leasehold {:.2} ms, etcd lock service {:.2} ms",
            f("leasehold_handoff_p50_ms"),
            f("stock_handoff_p50_ms"),
        );
        println!(
            "round trips per uncontended cycle (acquire + release): leasehold {:.2}, etcd lock service {:.2}",
            ours_per_cycle, stock_per_cycle
        );
    }
}
