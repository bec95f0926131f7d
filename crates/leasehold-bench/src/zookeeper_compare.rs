//! leasehold's ZooKeeper backend side by side with Curator and kazoo, on one server.
//! They are Apache Curator's `InterProcessMutex` (5.x, a Java process driven by the
//! testkit) and kazoo's `Lock` (Python, when `kazoo` is installed), all in one run.
//!
//! Every side measures itself the same way, in its own process: `clients` workers (tasks
//! or threads) share one ZooKeeper session and run acquire + release cycles for one slice
//! (`--duration`), timing each acquire; in the contended scenarios all work on one name,
//! and a worker that got the lock after the previous holder started its release records
//! the hand-off (release started → next holds). Each round runs every scenario on every
//! side, the sides taking turns (who goes first rotates), so that a slow phase of the
//! server or of the machine falls on all of them alike; rates are medians over rounds, and
//! the ratios are medians of leasehold's rate over the other side's in the same round. A
//! first round warms up (the JVM compiles, parent nodes exist) and is not counted.
//!
//! leasehold runs as two sides: `leasehold` ends each cycle with `guard.release().await`
//! (confirmed by the server, as Curator's `release()` is), `leasehold-drop` by dropping the
//! guard (its delete goes out in the drop, ahead of the worker's next request on the
//! session, and is confirmed in the background).
//!
//! ```sh
//! cargo run --release -p leasehold-bench --bin zookeeper-compare -- --duration 500ms --rounds 20
//! cargo run --release -p leasehold-bench --bin zookeeper-compare -- --url zk://127.0.0.1:2181 --json
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: failures should be loud

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use leasehold_testkit::{Curator, ZooKeeper};
use serde_json::json as j;

#[allow(dead_code)] // the rounds table of the other comparisons is not used here
mod common;
use common::{Args, median, pin_servers};

const ROUNDS: usize = 10;
/// How long each grant is held in the hand-off scenario.
/// Long enough for the waiter to be asleep on its watch when the holder releases.
const PAIR_HOLD: Duration = Duration::from_millis(2);
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
    /// Two clients on one name, each holding for [`PAIR_HOLD`].
    /// Every release hands the lock to a waiter asleep on its watch.
    Pair,
}

impl Scenario {
    const ALL: [Scenario; 4] = [
        Scenario::Solo,
        Scenario::Many,
        Scenario::Contended,
        Scenario::Pair,
    ];

    fn clients(self, n: usize) -> usize {
        match self {
            Scenario::Solo => 1,
            Scenario::Pair => 2,
            Scenario::Many | Scenario::Contended => n,
        }
    }

    fn contended(self) -> bool {
        matches!(self, Scenario::Contended | Scenario::Pair)
    }

    fn label(self, n: usize) -> String {
        match self {
            Scenario::Solo => "uncontended, 1 client".into(),
            Scenario::Many => format!("uncontended, {n} clients on {n} names"),
            Scenario::Contended => format!("contended, {n} clients on 1 name"),
            Scenario::Pair => "hand-off, 2 clients holding 2 ms".into(),
        }
    }

    /// How long each grant is held before its release.
    fn hold(self) -> Duration {
        if self == Scenario::Pair {
            PAIR_HOLD
        } else {
            Duration::ZERO
        }
    }

    fn slug(self) -> &'static str {
        match self {
            Scenario::Solo => "solo",
            Scenario::Many => "many",
            Scenario::Contended => "one",
            Scenario::Pair => "pair",
        }
    }
}

/// How the leasehold side lets go of a guard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Letting {
    /// `guard.release().await`: returns once the server confirmed the delete.
    /// So does Curator's `release()`.
    Release,
    /// `drop(guard)`, what a guard going out of scope does.
    /// The delete is sent by the drop, ahead of the worker's next request on the session,
    /// and confirmed in the background.
    Drop,
}

/// leasehold: `clients` tasks on one backend (one session).
async fn leasehold_side(
    client: &leasehold::Client,
    name: &str,
    clients: usize,
    duration: Duration,
    contended: bool,
    hold: Duration,
    letting: Letting,
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
                if !hold.is_zero() {
                    tokio::time::sleep(hold).await;
                }
                last_release.store(nanos(), Ordering::SeqCst);
                match letting {
                    Letting::Release => guard.release().await.unwrap(),
                    Letting::Drop => drop(guard),
                }
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
/// It is driven over stdin/stdout like the Curator driver.
struct Kazoo {
    _child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    stdout: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl Kazoo {
    async fn start(hosts: &str) -> Kazoo {
        use tokio::io::AsyncBufReadExt;
        let mut child = tokio::process::Command::new("python3")
            .args(["-c", KAZOO, hosts])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        assert_eq!(stdout.next_line().await.unwrap().as_deref(), Some("ready"));
        Kazoo {
            _child: child,
            stdin,
            stdout,
        }
    }

    async fn command(&mut self, line: &str) -> String {
        use tokio::io::AsyncWriteExt;
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        let answer = self.stdout.next_line().await.unwrap().unwrap();
        assert!(answer.starts_with("bench "), "kazoo: {answer}");
        answer
    }
}

fn has_kazoo() -> bool {
    std::process::Command::new("python3")
        .args(["-c", "import kazoo"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// One side's figures in one scenario, over every round.
#[derive(Debug, Default)]
struct Totals {
    rates: Vec<f64>,
    per_client: Vec<u64>,
    acquire: Vec<Duration>,
    handoff: Vec<Duration>,
}

impl Totals {
    fn add(&mut self, m: Measure) {
        self.rates.push(m.rate());
        if self.per_client.len() < m.per_client.len() {
            self.per_client.resize(m.per_client.len(), 0);
        }
        for (total, n) in self.per_client.iter_mut().zip(&m.per_client) {
            *total += n;
        }
        self.acquire.extend(m.acquire);
        self.handoff.extend(m.handoff);
    }

    fn finish(&mut self) {
        self.acquire.sort();
        self.handoff.sort();
    }

    /// The busiest worker's cycles over the idlest's, over every round.
    fn spread(&self) -> f64 {
        Measure {
            per_client: self.per_client.clone(),
            ..Measure::default()
        }
        .spread()
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let mut server;
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
            let pids: Vec<u32> = (server.servers().iter_mut())
                .filter_map(|s| s.process().pid())
                .collect();
            pin_servers(&pids);
            (server.url(), server.connect_string())
        }
    };
    let clients = args.clients;
    let duration = args.duration;
    let mut sides: Vec<&str> = vec!["leasehold", "leasehold-drop", "curator"];
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
    let mut kazoo = if sides.contains(&"kazoo") {
        Some(Kazoo::start(&hosts).await)
    } else {
        None
    };

    let rounds = args.rounds.unwrap_or(ROUNDS);
    // totals[side][scenario]; round 0 warms up (the JVM compiles, parents exist) and is
    // not counted.
    let mut totals: Vec<Vec<Totals>> = (0..sides.len())
        .map(|_| Scenario::ALL.iter().map(|_| Totals::default()).collect())
        .collect();
    for round in 0..=rounds {
        for (k, scenario) in Scenario::ALL.into_iter().enumerate() {
            for turn in 0..sides.len() {
                let s = (turn + round) % sides.len();
                let n = scenario.clients(clients);
                let name = format!("{}-{}-r{round}", sides[s], scenario.slug());
                let path = format!("/leasehold/{name}");
                let command = format!(
                    "bench {path} {n} {} {} {}",
                    duration.as_millis(),
                    u8::from(scenario.contended()),
                    scenario.hold().as_micros()
                );
                let measure = match sides[s] {
                    ours_side @ ("leasehold" | "leasehold-drop") => {
                        let letting = if ours_side == "leasehold" {
                            Letting::Release
                        } else {
                            Letting::Drop
                        };
                        let measure = leasehold_side(
                            &ours,
                            &name,
                            n,
                            duration,
                            scenario.contended(),
                            scenario.hold(),
                            letting,
                        )
                        .await;
                        // The last deletes of dropped guards are not the next side's work.
                        ours.settle().await;
                        measure
                    }
                    "curator" => {
                        let line = curator.as_mut().unwrap().command(&command).await.unwrap();
                        Measure::parse(&line, duration)
                    }
                    _ => Measure::parse(&kazoo.as_mut().unwrap().command(&command).await, duration),
                };
                if round > 0 {
                    totals[s][k].add(measure);
                }
            }
        }
        if round > 0 {
            eprintln!("round {round} of {rounds} done");
        }
    }

    for side in &mut totals {
        for t in side.iter_mut() {
            t.finish();
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let index = |side: &str| sides.iter().position(|s| *s == side);
    let paired = |a: usize, b: usize, k: usize| {
        median(
            totals[a][k]
                .rates
                .iter()
                .zip(&totals[b][k].rates)
                .map(|(x, y)| x / y)
                .collect(),
        )
    };
    let mut rows = Vec::new();
    for (s, side) in sides.iter().enumerate() {
        for (k, scenario) in Scenario::ALL.into_iter().enumerate() {
            let t = &totals[s][k];
            let contended = scenario.contended();
            let vs = |other: &str| match index(other) {
                Some(theirs) if side.starts_with("leasehold") => j!(paired(s, theirs, k)),
                _ => j!(null),
            };
            rows.push(j!({
                "side": side,
                "scenario": scenario.label(scenario.clients(clients)),
                "cycles_per_s": median(t.rates.clone()),
                "acquire_p50_ms": ms(quantile(&t.acquire, 0.5)),
                "acquire_p99_ms": ms(quantile(&t.acquire, 0.99)),
                "handoff_p50_ms": if contended { j!(ms(quantile(&t.handoff, 0.5))) } else { j!(null) },
                "handoff_p99_ms": if contended { j!(ms(quantile(&t.handoff, 0.99))) } else { j!(null) },
                "fairness_spread": if contended { j!(t.spread()) } else { j!(null) },
                "vs_curator": vs("curator"),
                "vs_kazoo": vs("kazoo"),
                "rates_by_round": t.rates,
            }));
        }
    }
    if args.json {
        println!(
            "{}",
            j!({ "rounds": rounds, "slice_s": duration.as_secs_f64(), "clients": clients, "rows": rows })
        );
        return;
    }
    println!(
        "{:<14} {:<34} {:>9} {:>8} {:>8} {:>8} {:>8} {:>6} {:>7} {:>7}",
        "side",
        "scenario",
        "cycles/s",
        "acq p50",
        "acq p99",
        "hnd p50",
        "hnd p99",
        "spread",
        "/Curator",
        "/kazoo"
    );
    let num = |v: &serde_json::Value, digits: usize| {
        v.as_f64()
            .map_or_else(|| "-".to_owned(), |x| format!("{x:.digits$}"))
    };
    for row in &rows {
        println!(
            "{:<14} {:<34} {:>9} {:>8} {:>8} {:>8} {:>8} {:>6} {:>7} {:>7}",
            row["side"].as_str().unwrap_or_default(),
            row["scenario"].as_str().unwrap_or_default(),
            num(&row["cycles_per_s"], 0),
            num(&row["acquire_p50_ms"], 3),
            num(&row["acquire_p99_ms"], 3),
            num(&row["handoff_p50_ms"], 3),
            num(&row["handoff_p99_ms"], 3),
            num(&row["fairness_spread"], 2),
            num(&row["vs_curator"], 2),
            num(&row["vs_kazoo"], 2),
        );
    }
    println!(
        "(cycles/s: median over {rounds} rounds of {duration:?} per side and scenario, sides \
         taking turns; /Curator, /kazoo: median of leasehold's rate over theirs in the same \
         round; latencies in ms over every round; spread: busiest worker over idlest, over \
         every round)"
    );
}
