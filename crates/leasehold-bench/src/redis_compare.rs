//! leasehold's Redis backend side by side with three other locks on one redis-server.
//! They are a bare redis-rs lock (SET NX PX + an EVALSHA compare-and-delete, no fencing, no
//! waiting, no renewal), the least script a fenced grant can run (SET NX PX + INCR in one
//! EVALSHA), and the rslock crate, all in one run.
//!
//! ```sh
//! cargo run --release -p leasehold-bench --bin redis-compare              # starts its own redis-server
//! cargo run --release -p leasehold-bench --bin redis-compare -- --url redis://127.0.0.1:6379 --duration 5s --json
//! cargo run --release -p leasehold-bench --bin redis-compare -- --only leasehold   # or bare, fenced, rslock, server-cpu
//! # the server on core 0, the clients on core 1; prints the server's CPU time per cycle
//! LEASEHOLD_SERVER_CPUS=0 taskset -c 1 cargo run --release -p leasehold-bench --bin redis-compare
//! ```
//!
//! The *server-cpu* side runs uncontended cycles of every side once more, reading the
//! redis-server's CPU time around each: what a cycle costs the server.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: failures should be loud

use std::sync::Arc;
use std::time::Instant;

use leasehold_cli::bench::{BenchSpec, Row, Stats, handoffs, json, table};
use redis::aio::ConnectionManager;
use serde_json::json as j;

mod bare;
mod common;
use bare::{BareGrant, FENCED_GRANT, TTL, bare_cycle};
use common::{
    Args, CpuSide, Rounds, bare_connection, cpu_time, leasehold_cycle, pin_servers,
    print_server_cpu, rslock_cycle, server_cpu as server_cpu_of, uncontended,
};

const ROUNDS: usize = 3;
/// EVALSHA calls the server has served (nested script commands are not counted).
async fn commands(conn: &mut ConnectionManager) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let mut server;
    let mut server_pid = None;
    let url = match &args.url {
        Some(url) => url.clone(),
        None => {
            server = leasehold_testkit::Redis::start()
                .await
                .expect("redis-server");
            let pid = server.process().pid().expect("a running server");
            pin_servers(&[pid]);
            server_pid = Some(pid);
            server.url()
        }
    };
    let spec = BenchSpec {
        duration: args.duration,
        clients: args.clients,
        handoffs: args.handoffs,
    };
    let mut admin = bare_connection(&url).await;
    // The fenced side sends EVALSHA directly: load its script first.
    let _: String = FENCED_GRANT.load_async(&mut admin).await.unwrap();
    let mut bare = Vec::new();
    for _ in 0..args.clients {
        bare.push(bare_connection(&url).await);
    }
    let managers: Vec<_> = (0..args.clients)
        .map(|_| Arc::new(rslock::LockManager::new(vec![url.clone()])))
        .collect();

    // The three implementations take turns, ROUNDS times, and each row keeps its best round.
    let mut rounds = Rounds::default();
    for round in 0..args.rounds.unwrap_or(ROUNDS) {
        rounds.next();
        if args.runs("leasehold") {
            let rows = leasehold_cli::bench::leasehold(&spec, || leasehold::connect(&url))
                .await
                .expect("leasehold benchmark");
            rounds.keep(rows);
        }

        for grant in [BareGrant::SetNx, BareGrant::FencedScript] {
            let (label, slug) = grant.label();
            if args.runs(slug) {
                let rows = uncontended(label, slug, args.clients, spec.duration, |i, key| {
                    bare_cycle(grant, bare[i].clone(), key)
                })
                .await;
                rounds.keep(rows);
            }
        }
        if !args.runs("rslock") {
            continue;
        }

        let mut rows = uncontended("rslock", "rslock", args.clients, spec.duration, |i, key| {
            rslock_cycle(managers[i].clone(), key, TTL)
        })
        .await;
        if round == 0 {
            let (holder, waiter) = (managers[0].clone(), managers[1].clone());
            rows.push(Row {
                name: "rslock hand-off (release -> next holds)".into(),
                stats: handoffs(
                    args.handoffs.min(20),
                    || {
                        let holder = holder.clone();
                        async move {
                            holder
                                .acquire_no_guard(&b"rslock-handoff"[..], TTL)
                                .await
                                .unwrap()
                        }
                    },
                    || {
                        let waiter = waiter.clone();
                        async move {
                            let lock = waiter
                                .acquire_no_guard(&b"rslock-handoff"[..], TTL)
                                .await
                                .unwrap();
                            let at = Instant::now();
                            waiter.unlock(&lock).await;
                            at
                        }
                    },
                    |lock| {
                        let holder = holder.clone();
                        async move { holder.unlock(&lock).await }
                    },
                )
                .await,
                handoff: true,
            });
        }
        rounds.keep(rows);
    }
    // The server's CPU time per uncontended cycle of each side.
    let mut server_cpu = Vec::new();
    if let (Some(pid), true) = (server_pid, args.runs("server-cpu")) {
        let mut mutexes = Vec::new();
        for i in 0..args.clients {
            let client = leasehold::connect(&url).await.expect("connect");
            mutexes.push(client.mutex(&format!("cpu-leasehold-{i}")).unwrap());
        }
        let sides: [CpuSide; 4] = [
            (
                "leasehold",
                Box::new(|i| Box::new(leasehold_cycle(mutexes[i].clone()))),
            ),
            (
                BareGrant::SetNx.label().0,
                Box::new(|i| {
                    Box::new(bare_cycle(
                        BareGrant::SetNx,
                        bare[i].clone(),
                        format!("cpu-bare-{i}"),
                    ))
                }),
            ),
            (
                BareGrant::FencedScript.label().0,
                Box::new(|i| {
                    Box::new(bare_cycle(
                        BareGrant::FencedScript,
                        bare[i].clone(),
                        format!("cpu-fenced-{i}"),
                    ))
                }),
            ),
            (
                "rslock",
                Box::new(|i| {
                    Box::new(rslock_cycle(
                        managers[i].clone(),
                        format!("cpu-rslock-{i}"),
                        TTL,
                    ))
                }),
            ),
        ];
        server_cpu = server_cpu_of(&sides, args.clients, spec.duration, || cpu_time(pid)).await;
    } else if args.url.is_some() && args.runs("server-cpu") {
        eprintln!("server CPU per cycle: measured only on a server this binary starts");
    }

    let rows = rounds.best();

    let rate = |name: &str| -> Stats {
        rows.iter()
            .find(|r| r.name.starts_with(name))
            .map(|r| r.stats.clone())
            .unwrap_or_default()
    };
    let ours_1 = rate("leasehold uncontended, 1 client");
    let ours_n = rate("leasehold uncontended, 16");
    let bare_1 = rate("bare SET NX PX + EVALSHA, 1 client");
    let bare_n = rate("bare SET NX PX + EVALSHA, 16");
    let rs_1 = rate("rslock, 1 client");
    let rs_n = rate("rslock, 16");
    // Round trips of an uncontended cycle: every leasehold request is one EVALSHA, so count
    // the server's EVALSHA calls around a run of plain lock + release cycles.
    let client = leasehold::connect(&url).await.expect("connect");
    let mutex = client.mutex("round-trips").expect("name");
    mutex
        .lock()
        .await
        .expect("lock")
        .release()
        .await
        .expect("release");
    let before = commands(&mut admin).await;
    let counted = 1000u32;
    for _ in 0..counted {
        mutex
            .lock()
            .await
            .expect("lock")
            .release()
            .await
            .expect("release");
    }
    let after = commands(&mut admin).await;
    let per_cycle = (after - before) as f64 / f64::from(counted);
    let (ours_one, ours_many) = (
        "leasehold uncontended, 1 client",
        "leasehold uncontended, 16",
    );
    let (bare_one, bare_many) = (
        "bare SET NX PX + EVALSHA, 1 client",
        "bare SET NX PX + EVALSHA, 16",
    );
    let summary = j!({
        "leasehold_vs_bare_1_client": ours_1.rate() / bare_1.rate(),
        "leasehold_vs_bare_16_clients": ours_n.rate() / bare_n.rate(),
        "leasehold_vs_rslock_1_client": ours_1.rate() / rs_1.rate(),
        "leasehold_vs_rslock_16_clients": ours_n.rate() / rs_n.rate(),
        "paired_rounds": {
            "leasehold_vs_bare_1_client": rounds.paired(ours_one, bare_one),
            "leasehold_vs_bare_16_clients": rounds.paired(ours_many, bare_many),
            "leasehold_vs_rslock_1_client": rounds.paired(ours_one, "rslock, 1 client"),
            "leasehold_vs_rslock_16_clients": rounds.paired(ours_many, "rslock, 16"),
        },
        "round_trips_per_leasehold_cycle": per_cycle,
        "server_cpu": server_cpu,
    });
    if args.json {
        let mut out = json(&rows);
        out["summary"] = summary;
        println!("{out}");
    } else {
        print!("{}", table(&rows));
        println!();
        println!(
            "leasehold / bare:   {:.2} (1 client), {:.2} ({} clients)",
            summary["leasehold_vs_bare_1_client"]
                .as_f64()
                .unwrap_or(0.0),
            summary["leasehold_vs_bare_16_clients"]
                .as_f64()
                .unwrap_or(0.0),
            args.clients
        );
        println!(
            "leasehold / rslock: {:.2} (1 client), {:.2} ({} clients)",
            summary["leasehold_vs_rslock_1_client"]
                .as_f64()
                .unwrap_or(0.0),
            summary["leasehold_vs_rslock_16_clients"]
                .as_f64()
                .unwrap_or(0.0),
            args.clients
        );
        let paired = &summary["paired_rounds"];
        let f = |key: &str| paired[key].as_f64().unwrap_or(f64::NAN);
        println!(
            "median of the rounds' own ratios: {:.2} / {:.2} to bare, {:.2} / {:.2} to rslock (1 / {} clients)",
            f("leasehold_vs_bare_1_client"),
            f("leasehold_vs_bare_16_clients"),
            f("leasehold_vs_rslock_1_client"),
            f("leasehold_vs_rslock_16_clients"),
            args.clients
        );
        println!("round trips per uncontended leasehold cycle (acquire + release): {per_cycle:.2}");
        print_server_cpu(&server_cpu);
    }
}
