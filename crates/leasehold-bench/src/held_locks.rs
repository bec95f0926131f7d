//! One client holding many locks at once: what keeping them costs the client and the server.
//! On Redis and PostgreSQL (lease mode), batched renewals (as leasehold does) and one call
//! per renewal (as a watchdog renewing each lock by itself does, Redisson's among them)
//! side by side; on the other backends leasehold alone.
//!
//! The binary starts the server (pinned to `LEASEHOLD_SERVER_CPUS`), then runs itself as a
//! child per side, the sides one after the other: a child takes N locks (names
//! `bench-hold-<i>`, ttl 30 s: renewed every 10 s where grants are leases), holds them
//! through the window, and reports its own CPU time, the server's over the same window
//! (with every process below it), and its resident memory per held lock (`leasehold bench
//! --hold`, which this reuses).
//!
//! ```sh
//! LEASEHOLD_SERVER_CPUS=0 taskset -c 1 cargo run --release -p leasehold-bench --bin held-locks -- --locks 1000000
//! cargo run --release -p leasehold-bench --bin held-locks -- --backend postgres --locks 100000
//! # --backend redis (the default), postgres (lease mode), advisory, etcd, zookeeper;
//! # --only batched|one-by-one (Redis, postgres), --window D (default: the ttl), --json
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: failures should be loud

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use leasehold::backend::{
    Acquire, Backend, Capabilities, Grant, LockState, Release, Renewal, Request, WaitHint,
};
use leasehold::{Client, LockName, Result};
use leasehold_cli::bench::{HoldSpec, hold};
use leasehold_testkit::Redis;

#[allow(dead_code)] // of the comparisons' helpers, only the pinning
mod common;

/// Set in a child: the side it measures, and the server's URL and pid.
const SIDE: &str = "LEASEHOLD_HELD_SIDE";
const URL: &str = "LEASEHOLD_HELD_URL";
const SERVER: &str = "LEASEHOLD_HELD_SERVER";

/// The sides of the backends that batch renewals (Redis, PostgreSQL's lease mode).
/// Every other backend has one, `leasehold`.
const BATCHING_SIDES: [&str; 2] = ["batched", "one-by-one"];

/// A backend that renews each lease with a call of its own.
/// Every method but `renew_many` is the inner backend's, and `renew_many` is the trait's
/// default (one `renew` per lease, all at once).
#[derive(Debug)]
struct OneByOne(Arc<dyn Backend>);

#[async_trait]
impl Backend for OneByOne {
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }
    async fn acquire(&self, req: &Request) -> Result<Acquire> {
        self.0.acquire(req).await
    }
    async fn renew(&self, req: &Request) -> Result<Renewal> {
        self.0.renew(req).await
    }
    async fn release(&self, req: &Request) -> Result<Release> {
        self.0.release(req).await
    }
    async fn wait(&self, name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        self.0.wait(name, hint, max).await
    }
    async fn handed(&self, req: &Request, hint: &WaitHint) -> Option<Grant> {
        self.0.handed(req, hint).await
    }
    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        self.0.inspect(name).await
    }
}

struct Settings {
    backend: String,
    locks: usize,
    ttl: Duration,
    window: Option<Duration>,
    only: Option<String>,
    json: bool,
}

fn settings() -> Settings {
    let mut settings = Settings {
        backend: "redis".into(),
        locks: 1_000_000,
        ttl: Duration::from_secs(30),
        window: None,
        only: None,
        json: false,
    };
    let mut args = std::env::args().skip(1);
    let duration = |d: Option<String>| leasehold::parse_duration(&d.expect("a duration")).unwrap();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--backend" => settings.backend = args.next().expect("--backend NAME"),
            "--locks" => {
                settings.locks = args.next().and_then(|n| n.parse().ok()).expect("--locks N")
            }
            "--ttl" => settings.ttl = duration(args.next()),
            "--window" => settings.window = Some(duration(args.next())),
            "--only" => settings.only = args.next(),
            "--json" => settings.json = true,
            other => {
                eprintln!(
                    "usage: [--backend redis|postgres|advisory|etcd|zookeeper] [--locks N] [--ttl D] \
                     [--window D] [--only batched|one-by-one] [--json]; not {other:?}"
                );
                std::process::exit(2);
            }
        }
    }
    settings
}

/// Keeps a started server running.
enum Server {
    Redis(Redis),
    Postgres(leasehold_testkit::Postgres),
    Etcd(leasehold_testkit::Etcd),
    ZooKeeper(leasehold_testkit::ZooKeeper),
}

/// Starts `backend`'s server, pinned: the server, the URL to lock on, its (root) pid.
/// A session backend's session lasts `ttl`.
async fn start(backend: &str, ttl: Duration) -> (Server, String, u32) {
    let session = format!("{}ms", ttl.as_millis());
    let (mut server, url) = match backend {
        "redis" => {
            let redis = Redis::start().await.expect("redis");
            let url = redis.url();
            (Server::Redis(redis), url)
        }
        "postgres" | "advisory" => {
            let postgres = leasehold_testkit::Postgres::builder()
                .config("max_connections", "400")
                .start()
                .await
                .expect("PostgreSQL");
            let url = postgres.url();
            let url = if backend == "advisory" {
                let join = if url.contains('?') { '&' } else { '?' };
                format!("{url}{join}mode=advisory&session_ttl={session}")
            } else {
                url
            };
            (Server::Postgres(postgres), url)
        }
        "etcd" => {
            let etcd = leasehold_testkit::Etcd::start().await.expect("etcd");
            let url = format!("{}?session_ttl={session}", etcd.url());
            (Server::Etcd(etcd), url)
        }
        "zookeeper" => {
            let zk = leasehold_testkit::ZooKeeper::start()
                .await
                .expect("zookeeper");
            let url = format!("{}?session_timeout={session}", zk.url());
            (Server::ZooKeeper(zk), url)
        }
        other => panic!("no backend {other:?}: redis, postgres, advisory, etcd, zookeeper"),
    };
    let pid = match &mut server {
        Server::Redis(redis) => redis.process().pid(),
        Server::Postgres(postgres) => postgres.process().pid(),
        Server::Etcd(etcd) => etcd.members().first_mut().and_then(|m| m.process().pid()),
        Server::ZooKeeper(zk) => zk.servers().first_mut().and_then(|s| s.process().pid()),
    }
    .expect("the server runs");
    common::pin_servers(&common::process_tree(pid));
    (server, url, pid)
}

/// A child: holds the locks on one side and prints its report as JSON.
async fn child(side: &str, url: &str, server: u32, settings: &Settings) {
    let backend: Arc<dyn Backend> = leasehold::connect_backend(url).await.unwrap();
    let backend: Arc<dyn Backend> = match side {
        "one-by-one" => Arc::new(OneByOne(backend)),
        _ => backend,
    };
    let client = Client::builder_from_arc(backend).build();
    let spec = HoldSpec {
        locks: settings.locks,
        ttl: settings.ttl,
        window: settings.window.unwrap_or(settings.ttl),
        servers: vec![server],
    };
    let report = hold(&spec, &client).await.expect("held");
    println!("{}", report.json());
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let settings = settings();
    if let (Ok(side), Ok(url), Ok(server)) = (
        std::env::var(SIDE),
        std::env::var(URL),
        std::env::var(SERVER),
    ) {
        child(&side, &url, server.parse().unwrap(), &settings).await;
        return;
    }
    let (_server, url, pid) = start(&settings.backend, settings.ttl).await;
    let sides: &[&str] = if ["redis", "postgres"].contains(&settings.backend.as_str()) {
        &BATCHING_SIDES
    } else {
        &["leasehold"]
    };
    let mut rows = Vec::new();
    for &side in sides {
        if settings.only.as_deref().is_some_and(|only| only != side) {
            continue;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(std::env::args().skip(1))
            .env(SIDE, side)
            .env(URL, &url)
            .env(SERVER, pid.to_string())
            .output()
            .expect("the child");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("its report");
        rows.push((side, report));
    }
    if settings.json {
        let all: serde_json::Map<String, serde_json::Value> = rows
            .into_iter()
            .map(|(side, report)| (side.to_owned(), report))
            .collect();
        println!("{}", serde_json::Value::Object(all));
        return;
    }
    println!(
        "{:<12} {:>9} {:>14} {:>16} {:>16} {:>14}",
        "side", "locks", "client cpu", "µs/renewal", "server cpu", "bytes/lock"
    );
    let renewals_per_sec = settings.locks as f64 * 3.0 / settings.ttl.as_secs_f64();
    for (side, r) in rows {
        let window = r["window_seconds"].as_f64().unwrap();
        let cpu = r["cpu_seconds"].as_f64().unwrap() / window;
        let server_cpu = r["server_cpu_seconds"].as_f64().unwrap_or(0.0) / window;
        println!(
            "{:<12} {:>9} {:>13.2}% {:>16.3} {:>15.2}% {:>14.0}",
            side,
            r["locks"],
            cpu * 100.0,
            cpu * 1e6 / renewals_per_sec,
            server_cpu * 100.0,
            r["bytes_per_lock"].as_f64().unwrap(),
        );
    }
}
