//! leasehold's ZooKeeper backend side by side with Apache Curator's `InterProcessMutex`
//! (5.x, a Java process driven by the testkit) and kazoo's `Lock` (Python, when `kazoo` is
//! installed), on one ZooKeeper server, in one run.
//!
//! Every side measures itself the same way, in its own process: `clients` workers (tasks
//! or threads) share one ZooKeeper session and run acquire + release cycles for
//! `duration`, timing each acquire; in the contended scenario all work on one name, and a
//! worker that got the lock after the previous holder started its release records the
//! hand-off (release started → next holds). The sides take turns, round after round (the
//! first side of each round rotates), and each figure is the median over rounds.
//!
//! ```sh
//! cargo run --release -p leasehold-bench --bin zookeeper-compare             # starts its own ZooKeeper
//! cargo run --release -p leasehold-bench --bin zookeeper-compare -- --url zk://127.0.0.1:2181 --duration 5s --rounds 5 --json
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: failures should be loud

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use leasehold_testkit::{Curator, ZooKeeper};
use serde_json::json as j;

#[allow(dead_code)] // the rounds table of the other comparisons is not used here
mod common;
use common::Args;

const ROUNDS: usize = 3;
const KAZOO: &str = include_str!("kazoo_bench.py");

/// What one side measured in one scenario.
#[derive(Debug, Clone, Default)]
struct Measure {
    cycles: u64,
    elapsed: Duration,
    per_client: Vec<u64>,
    acquire: Vec<Duration>,
    handoff: Vec<Duration>,
}

impl Measure {
    fn rate(&self) -> f64 {
        self.cycles as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The busiest worker's cycles over the idlest's (1.0: perfectly even).
    fn spread(&self) -> f64 {
        let max = self.per_client.iter().copied().max().unwrap_or(0);
        let min = self.per_client.iter().copied().min().unwrap_or(0);
        max as f64 / (min.max(1)) as f64
    }

    /// Parses a driver's `bench <cycles> <counts> <acquire ns,...> <hand-off ns,...>`.
    fn parse(line: &str, elapsed: Duration) -> Measure {
        let words: Vec<&str> = line.split(' ').collect();
        assert_eq!(
            words.len(),
            5,
            "a bench line: {}",
            &line[..line.len().min(200)]
        );
        let numbers = |w: &str| -> Vec<u64> {
            if w == "-" {
                return Vec::new();
            }
            w.split(',').map(|n| n.parse().unwrap()).collect()
        };
        let mut acquire: Vec<Duration> = numbers(words[3])
            .into_iter()
            .map(Duration::from_nanos)
            .collect();
        let mut handoff: Vec<Duration> = numbers(words[4])
            .into_iter()
            .map(Duration::from_nanos)
            .collect();
        acquire.sort();
        handoff.sort();
        Measure {
            cycles: words[1].parse().unwrap(),
            elapsed,
            per_client: numbers(words[2]),
            acquire,
            handoff,
        }
    }
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let at = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[at.min(sorted.len() - 1)]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Solo,
    Many,
    Contended,
}

impl Scenario {
    const ALL: [Scenario; 3] = [Scenario::Solo, Scenario::Many, Scenario::Contended];

    fn clients(self, n: usize) -> usize {
        if self == Scenario::Solo { 1 } else { n }
    }

    fn contended(self) -> bool {
        self == Scenario::Contended
    }

    fn label(self, n: usize) -> String {
        match self {
            Scenario::Solo => "uncontended, 1 client".into(),
            Scenario::Many => format!("uncontended, {n} clients on {n} names"),
            Scenario::Contended => format!("contended, {n} clients on 1 name"),
        }
    }

    fn slug(self) -> &'static str {
        match self {
            Scenario::Solo => "solo",
            Scenario::Many => "many",
            Scenario::Contended => "one",
        }
    }
}

/// leasehold: `clients` tasks on one backend (one session).
async fn leasehold_side(
    client: &leasehold::Client,
    name: &str,
    clients: usize,
    duration: Duration,
    contended: bool,
) -> Measure {
    let base = Instant::now();
    let nanos = move || u64::try_from(base.elapsed().as_nanos()).unwrap();
    let last_release = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + duration;
    let mut tasks = Vec::new();
    for i in 0..clients {
        let name = if contended {
            name.to_owned()
        } else {
            format!("{name}-{i}")
        };
        let mutex = client.mutex(&name).unwrap();
        let last_release = last_release.clone();
        tasks.push(tokio::spawn(async move {
            let mut measure = Measure::default();
            while Instant::now() < end {
                let asked = nanos();
                let guard = mutex.lock().await.unwrap();
                let got = nanos();
                measure.acquire.push(Duration::from_nanos(got - asked));
                let released = last_release.load(Ordering::SeqCst);
                if contended && released > asked {
                    measure.handoff.push(Duration::from_nanos(got - released));
                }
                measure.cycles += 1;
                last_release.store(nanos(), Ordering::SeqCst);
                guard.release().await.unwrap();
            }
            measure
        }));
    }
    // Every side counts the cycles its workers began before the end, over the nominal
    // duration.
    let mut total = Measure::default();
    for task in tasks {
        let m = task.await.unwrap();
        total.cycles += m.cycles;
        total.per_client.push(m.cycles);
        total.acquire.extend(m.acquire);
        total.handoff.extend(m.handoff);
    }
    total.elapsed = duration;
    total.acquire.sort();
    total.handoff.sort();
    total
}

/// kazoo: a Python process with `clients` threads on one `KazooClient`.
async fn kazoo_side(
    hosts: &str,
    path: &str,
    clients: usize,
    duration: Duration,
    contended: bool,
) -> Measure {
    let out = tokio::process::Command::new("python3")
        .args(["-c", KAZOO, hosts, path])
        .arg(clients.to_string())
        .arg(duration.as_millis().to_string())
        .arg(if contended { "1" } else { "0" })
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "kazoo: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let line = text.lines().find(|l| l.starts_with("bench ")).unwrap();
    Measure::parse(line, duration)
}

fn has_kazoo() -> bool {
    std::process::Command::new("python3")
        .args(["-c", "import kazoo"])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let server;
    let (url, hosts) = match &args.url {
        Some(url) => {
            let hosts = url
                .split_once("://")
                .map_or(url.as_str(), |(_, rest)| rest)
                .split(['/', '?'])
                .next()
                .unwrap_or_default()
                .to_owned();
            (url.clone(), hosts)
        }
        None => {
            server = ZooKeeper::start().await.expect("zookeeper");
            (server.url(), server.connect_string())
        }
    };
    let clients = args.clients;
    let duration = args.duration;
    let mut sides: Vec<&str> = vec!["leasehold", "curator"];
    if has_kazoo() {
        sides.push("kazoo");
    } else {
        eprintln!("kazoo is not installed (pip install kazoo): its side is left out");
    }
    sides.retain(|s| args.runs(s));

    let ours = leasehold::connect(&url).await.expect("connect");
    let mut curator = if sides.contains(&"curator") {
        Some(
            Curator::start(&hosts, Duration::from_secs(10))
                .await
                .expect("curator"),
        )
    } else {
        None
    };
    // Warm-up, not measured: the JVM compiles, connections and parent nodes exist.
    let warm = Duration::from_secs(1);
    for side in &sides {
        match *side {
            "leasehold" => {
                leasehold_side(&ours, "warm", clients, warm, true).await;
            }
            "curator" => {
                let curator = curator.as_mut().unwrap();
                for contended in ["0", "1"] {
                    curator
                        .command(&format!("bench /leasehold/warm {clients} 1000 {contended}"))
                        .await
                        .unwrap();
                }
            }
            _ => {
                kazoo_side(&hosts, "/leasehold/warm-kazoo", 1, warm, false).await;
            }
        }
    }

    let rounds = args.rounds.unwrap_or(ROUNDS);
    // results[side][scenario] = one Measure per round
    let mut results: Vec<Vec<Vec<Measure>>> = vec![vec![Vec::new(); 3]; sides.len()];
    for round in 0..rounds {
        for turn in 0..sides.len() {
            let s = (turn + round) % sides.len();
            for (k, scenario) in Scenario::ALL.into_iter().enumerate() {
                let n = scenario.clients(clients);
                let name = format!("{}-{}-r{round}", sides[s], scenario.slug());
                let path = format!("/leasehold/{name}");
                let measure = match sides[s] {
                    "leasehold" => {
                        leasehold_side(&ours, &name, n, duration, scenario.contended()).await
                    }
                    "curator" => {
                        let line = curator
                            .as_mut()
                            .unwrap()
                            .command(&format!(
                                "bench {path} {n} {} {}",
                                duration.as_millis(),
                                u8::from(scenario.contended())
                            ))
                            .await
                            .unwrap();
                        Measure::parse(&line, duration)
                    }
                    _ => kazoo_side(&hosts, &path, n, duration, scenario.contended()).await,
                };
                eprintln!(
                    "round {round}: {} {}: {:.0}/s",
                    sides[s],
                    scenario.label(n),
                    measure.rate()
                );
                results[s][k].push(measure);
            }
        }
    }

    let median = |mut v: Vec<f64>| -> f64 {
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    };
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut rows = Vec::new();
    for (s, side) in sides.iter().enumerate() {
        for (k, scenario) in Scenario::ALL.into_iter().enumerate() {
            let runs = &results[s][k];
            let pick = |f: &dyn Fn(&Measure) -> f64| median(runs.iter().map(f).collect());
            rows.push(j!({
                "side": side,
                "scenario": scenario.label(scenario.clients(clients)),
                "cycles_per_s": pick(&|m| m.rate()),
                "acquire_p50_ms": pick(&|m| ms(quantile(&m.acquire, 0.5))),
                "acquire_p99_ms": pick(&|m| ms(quantile(&m.acquire, 0.99))),
                "handoff_p50_ms": if scenario.contended() { j!(pick(&|m| ms(quantile(&m.handoff, 0.5)))) } else { j!(null) },
                "handoff_p99_ms": if scenario.contended() { j!(pick(&|m| ms(quantile(&m.handoff, 0.99)))) } else { j!(null) },
                "fairness_spread": if scenario.contended() { j!(pick(&|m| m.spread())) } else { j!(null) },
                "rates_by_round": runs.iter().map(Measure::rate).collect::<Vec<_>>(),
            }));
        }
    }
    if args.json {
        println!(
            "{}",
            j!({ "rounds": rounds, "duration_s": duration.as_secs_f64(), "rows": rows })
        );
        return;
    }
    println!(
        "{:<10} {:<40} {:>10} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "side", "scenario", "cycles/s", "acq p50", "acq p99", "hand p50", "hand p99", "spread"
    );
    let num = |v: &serde_json::Value, digits: usize| {
        v.as_f64()
            .map_or_else(|| "-".to_owned(), |x| format!("{x:.digits$}"))
    };
    for row in &rows {
        println!(
            "{:<10} {:<40} {:>10} {:>9} {:>9} {:>9} {:>9} {:>7}",
            row["side"].as_str().unwrap_or_default(),
            row["scenario"].as_str().unwrap_or_default(),
            num(&row["cycles_per_s"], 0),
            num(&row["acquire_p50_ms"], 3),
            num(&row["acquire_p99_ms"], 3),
            num(&row["handoff_p50_ms"], 3),
            num(&row["handoff_p99_ms"], 3),
            num(&row["fairness_spread"], 2),
        );
    }
    let rate = |side: &str, k: usize| {
        sides
            .iter()
            .position(|s| *s == side)
            .map(|s| median(results[s][k].iter().map(Measure::rate).collect()))
    };
    if let (Some(ours1), Some(theirs1), Some(ours16), Some(theirs16)) = (
        rate("leasehold", 0),
        rate("curator", 0),
        rate("leasehold", 1),
        rate("curator", 1),
    ) {
        println!();
        println!(
            "leasehold / Curator, uncontended: {:.2}x at 1 client, {:.2}x at {clients}",
            ours1 / theirs1,
            ours16 / theirs16
        );
    }
    println!("(medians over {rounds} rounds of {duration:?} each; ms)");
}
