//! `leasehold bench`: throughput and latency of a backend, measured through the public API.
//!
//! The drivers ([`cycles`], [`handoffs`]) take any acquire/release pair, so that other
//! lock implementations can be measured side by side in the same run (see the
//! `leasehold-bench` crate).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::{Client, LockOptions};
use serde_json::{Value, json};

/// Latency percentiles and throughput of one measurement.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// Completed acquire+release cycles.
    pub cycles: u64,
    /// Over this long.
    pub elapsed: Duration,
    /// Sorted samples (acquire latency, or hand-off time).
    pub samples: Vec<Duration>,
}

impl Stats {
    /// Cycles per second.
    pub fn rate(&self) -> f64 {
        self.cycles as f64 / self.elapsed.as_secs_f64().max(f64::EPSILON)
    }

    /// The `q` quantile (0.0..=1.0) of the samples.
    pub fn quantile(&self, q: f64) -> Duration {
        if self.samples.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.samples.len() - 1) as f64 * q).round() as usize;
        self.samples[i.min(self.samples.len() - 1)]
    }

    fn merge(mut self, other: Stats) -> Stats {
        self.cycles += other.cycles;
        self.elapsed = self.elapsed.max(other.elapsed);
        self.samples.extend(other.samples);
        self
    }
}

/// Runs `tasks` concurrent loops for `duration`.
/// Each iteration calls the task's `cycle`, which acquires, releases, and returns how long
/// the acquire took.
pub async fn cycles<C, F, Fut>(tasks: usize, duration: Duration, mut make: C) -> Stats
where
    C: FnMut(usize) -> F,
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = Duration> + Send,
{
    let mut handles = Vec::with_capacity(tasks);
    let start = Instant::now();
    for task in 0..tasks {
        let mut cycle = make(task);
        handles.push(tokio::spawn(async move {
            let mut stats = Stats::default();
            while start.elapsed() < duration {
                stats.samples.push(cycle().await);
                stats.cycles += 1;
            }
            stats.elapsed = start.elapsed();
            stats
        }));
    }
    let mut total = Stats::default();
    for handle in handles {
        if let Ok(stats) = handle.await {
            total = total.merge(stats);
        }
    }
    total.samples.sort();
    total
}

/// Measures hand-off `rounds` times.
/// `hold` takes the lock; a waiter starts `wait_for_it`; once it waits, `let_go` releases;
/// the sample is the time from the release call to the waiter holding the lock.
/// `wait_for_it` releases before returning its instant.
pub async fn handoffs<H, HF, G, W, WF, L, LF>(
    rounds: usize,
    mut hold: H,
    mut wait_for_it: W,
    mut let_go: L,
) -> Stats
where
    H: FnMut() -> HF,
    HF: Future<Output = G>,
    W: FnMut() -> WF,
    WF: Future<Output = Instant> + Send + 'static,
    L: FnMut(G) -> LF,
    LF: Future<Output = ()>,
{
    let mut stats = Stats::default();
    let start = Instant::now();
    for _ in 0..rounds {
        let held = hold().await;
        let waiter = tokio::spawn(wait_for_it());
        // Long enough for the waiter to be queued and asleep.
        tokio::time::sleep(Duration::from_millis(5)).await;
        let released_at = Instant::now();
        let_go(held).await;
        if let Ok(holds_at) = waiter.await {
            stats
                .samples
                .push(holds_at.saturating_duration_since(released_at));
            stats.cycles += 1;
        }
    }
    stats.elapsed = start.elapsed();
    stats.samples.sort();
    stats
}

/// One line of the report.
#[derive(Debug, Clone)]
pub struct Row {
    /// What was measured.
    pub name: String,
    /// The measurement.
    pub stats: Stats,
    /// Whether the samples are hand-off times rather than acquire latencies.
    pub handoff: bool,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The rows as a table for people.
pub fn table(rows: &[Row]) -> String {
    let mut out = format!(
        "{:<44} {:>11} {:>10} {:>10}\n",
        "benchmark", "cycles/s", "p50 ms", "p99 ms"
    );
    for row in rows {
        let rate = if row.handoff {
            "-".to_owned()
        } else {
            format!("{:.0}", row.stats.rate())
        };
        out.push_str(&format!(
            "{:<44} {:>11} {:>10.3} {:>10.3}\n",
            row.name,
            rate,
            ms(row.stats.quantile(0.5)),
            ms(row.stats.quantile(0.99)),
        ));
    }
    out
}

/// The rows as JSON.
pub fn json(rows: &[Row]) -> Value {
    json!({
        "benchmarks": rows.iter().map(|row| json!({
            "name": row.name,
            "kind": if row.handoff { "handoff" } else { "cycles" },
            "cycles": row.stats.cycles,
            "seconds": row.stats.elapsed.as_secs_f64(),
            "cycles_per_second": (!row.handoff).then(|| row.stats.rate()),
            "p50_ms": ms(row.stats.quantile(0.5)),
            "p99_ms": ms(row.stats.quantile(0.99)),
        })).collect::<Vec<_>>()
    })
}

/// What `leasehold bench` measures.
#[derive(Debug, Clone)]
pub struct BenchSpec {
    /// How long each throughput run lasts.
    pub duration: Duration,
    /// Clients of the concurrent runs.
    pub clients: usize,
    /// Hand-off rounds.
    pub handoffs: usize,
}

/// Measures leasehold on the backend behind `connect` (each call a new connection).
/// It measures uncontended with one client, uncontended with N clients on N names,
/// contended with N clients on one name, and hand-off.
///
/// # Errors
///
/// If connecting or a lock operation fails.
pub async fn leasehold<C, CF>(spec: &BenchSpec, mut connect: C) -> leasehold::Result<Vec<Row>>
where
    C: FnMut() -> CF,
    CF: Future<Output = leasehold::Result<Client>>,
{
    let options = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .build()?;
    let mut clients = Vec::with_capacity(spec.clients);
    for _ in 0..spec.clients.max(2) {
        clients.push(Arc::new(connect().await?));
    }
    let mutex = |client: &Client, name: &str| -> leasehold::Result<leasehold::Mutex> {
        Ok(client.mutex(name)?.with_options(options.clone()))
    };
    // A first cycle on each connection: loads scripts, opens connections.
    for (i, client) in clients.iter().enumerate() {
        mutex(client, &format!("bench-warm-{i}"))?
            .lock()
            .await?
            .release()
            .await?;
    }
    let cycle = |m: leasehold::Mutex| {
        move || {
            let m = m.clone();
            async move {
                let started = Instant::now();
                let Ok(guard) = m.lock().await else {
                    return Duration::ZERO;
                };
                let took = started.elapsed();
                let _ = guard.release().await;
                took
            }
        }
    };
    let mut rows = Vec::new();
    let one = mutex(&clients[0], "bench-solo")?;
    rows.push(Row {
        name: "leasehold uncontended, 1 client".into(),
        stats: cycles(1, spec.duration, |_| cycle(one.clone())).await,
        handoff: false,
    });
    let many: Vec<_> = (0..spec.clients)
        .map(|i| mutex(&clients[i], &format!("bench-name-{i}")))
        .collect::<leasehold::Result<_>>()?;
    rows.push(Row {
        name: format!(
            "leasehold uncontended, {} clients on {} names",
            spec.clients, spec.clients
        ),
        stats: cycles(spec.clients, spec.duration, |i| cycle(many[i].clone())).await,
        handoff: false,
    });
    let shared: Vec<_> = (0..spec.clients)
        .map(|i| mutex(&clients[i], "bench-shared"))
        .collect::<leasehold::Result<_>>()?;
    rows.push(Row {
        name: format!("leasehold contended, {} clients on 1 name", spec.clients),
        stats: cycles(spec.clients, spec.duration, |i| cycle(shared[i].clone())).await,
        handoff: false,
    });
    let holder = mutex(&clients[0], "bench-handoff")?;
    let waiter = mutex(&clients[1], "bench-handoff")?;
    rows.push(Row {
        name: "leasehold hand-off (release -> next holds)".into(),
        stats: handoffs(
            spec.handoffs,
            || {
                let holder = holder.clone();
                async move { holder.lock().await.ok() }
            },
            || {
                let waiter = waiter.clone();
                async move {
                    let guard = waiter.lock().await;
                    let at = Instant::now();
                    if let Ok(guard) = guard {
                        let _ = guard.release().await;
                    }
                    at
                }
            },
            |held| async move {
                if let Some(guard) = held {
                    let _ = guard.release().await;
                }
            },
        )
        .await,
        handoff: true,
    });
    Ok(rows)
}
