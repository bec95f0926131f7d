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
    /// The cycles of each concurrent task ([`cycles`]; empty for [`handoffs`]).
    pub per_task: Vec<u64>,
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

    /// The busiest task's cycles over the idlest's (1.0: even; one task, or none: 1.0).
    pub fn spread(&self) -> f64 {
        let most = self.per_task.iter().copied().max().unwrap_or(0);
        let least = self.per_task.iter().copied().min().unwrap_or(0);
        if most == 0 {
            return 1.0;
        }
        most as f64 / least.max(1) as f64
    }

    fn merge(mut self, other: Stats) -> Stats {
        self.cycles += other.cycles;
        self.per_task.push(other.cycles);
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
            "spread": (row.stats.per_task.len() > 1).then(|| row.stats.spread()),
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

/// What `leasehold bench --hold N` measures: one client holding many locks at once.
#[derive(Debug, Clone)]
pub struct HoldSpec {
    /// How many locks to hold (distinct names).
    pub locks: usize,
    /// Their lease length; they are renewed every third of it.
    pub ttl: Duration,
    /// How long to hold them all, measuring; a few renewal periods give a fair figure.
    pub window: Duration,
    /// Local processes (a server) whose CPU time over the window is reported too.
    /// Every process below them counts (a forking server's sessions: PostgreSQL).
    pub servers: Vec<u32>,
}

/// What holding the locks cost this process.
#[derive(Debug, Clone)]
pub struct HoldReport {
    /// Locks held through the window.
    pub locks: usize,
    /// How long taking them all took.
    pub acquired_in: Duration,
    /// The measured window (they were all held throughout).
    pub window: Duration,
    /// CPU time (user and system) the process spent in the window: renewals, timers.
    pub cpu: Duration,
    /// CPU time the [`HoldSpec::servers`] spent in the window, if any were named.
    pub server_cpu: Option<Duration>,
    /// Resident memory before the first lock and while all were held, in bytes.
    pub rss_before: u64,
    /// See `rss_before`.
    pub rss_held: u64,
}

impl HoldReport {
    /// The share of one core the process used while holding (0.01 is 1 %).
    pub fn core_share(&self) -> f64 {
        self.cpu.as_secs_f64() / self.window.as_secs_f64().max(f64::EPSILON)
    }

    /// Resident memory added per held lock, in bytes.
    pub fn bytes_per_lock(&self) -> f64 {
        self.rss_held.saturating_sub(self.rss_before) as f64 / self.locks.max(1) as f64
    }

    /// The report for people.
    pub fn table(&self) -> String {
        let server = self.server_cpu.map_or(String::new(), |cpu| {
            format!(
                "server cpu: {:.2} % of a core\n",
                cpu.as_secs_f64() * 100.0 / self.window.as_secs_f64().max(f64::EPSILON)
            )
        });
        server
            + &format!(
                "held {} locks (taken in {:.1} s) for {:.1} s\n\
             cpu: {:.2} % of a core ({:.3} µs per lock per second)\n\
             memory: {:.0} bytes per lock ({} MiB resident while held)\n",
                self.locks,
                self.acquired_in.as_secs_f64(),
                self.window.as_secs_f64(),
                self.core_share() * 100.0,
                self.cpu.as_secs_f64() * 1e6
                    / self.window.as_secs_f64().max(f64::EPSILON)
                    / self.locks.max(1) as f64,
                self.bytes_per_lock(),
                self.rss_held >> 20,
            )
    }

    /// The report as JSON.
    pub fn json(&self) -> Value {
        json!({
            "locks": self.locks,
            "acquired_seconds": self.acquired_in.as_secs_f64(),
            "window_seconds": self.window.as_secs_f64(),
            "cpu_seconds": self.cpu.as_secs_f64(),
            "server_cpu_seconds": self.server_cpu.map(|cpu| cpu.as_secs_f64()),
            "core_share": self.core_share(),
            "rss_before_bytes": self.rss_before,
            "rss_held_bytes": self.rss_held,
            "bytes_per_lock": self.bytes_per_lock(),
        })
    }
}

/// Locks taken at once while filling the set (each in flight is one request).
const HOLD_IN_FLIGHT: usize = 256;

/// Holds `spec.locks` locks of `client` for `spec.window`, then releases them all.
/// The names are `bench-hold-<i>`. It reports the process's CPU time and resident memory.
///
/// # Errors
///
/// If a lock cannot be taken at once (another holder) or a lock operation fails; a lock
/// lost during the window is an error too, since the figure would then not be of all.
pub async fn hold(spec: &HoldSpec, client: &Client) -> leasehold::Result<HoldReport> {
    // One copy for all the handles, as an application holding many locks would share it.
    let options = Arc::new(LockOptions::builder().ttl(spec.ttl).build()?);
    let rss_before = resident_bytes();
    let started = Instant::now();
    let mut takers = tokio::task::JoinSet::new();
    let in_flight = HOLD_IN_FLIGHT.min(spec.locks.max(1));
    for first in 0..in_flight {
        let client = client.clone();
        let options = options.clone();
        let locks = spec.locks;
        takers.spawn(async move {
            // The guards taken so far come back with the error, to be released too.
            let mut held = Vec::with_capacity(locks / in_flight + 1);
            for i in (first..locks).step_by(in_flight) {
                let taken = match client.mutex(&format!("bench-hold-{i}")) {
                    Ok(mutex) => mutex.with_options(options.clone()).try_lock().await,
                    Err(error) => Err(error),
                };
                match taken {
                    Ok(Some(guard)) => held.push(guard),
                    Ok(None) => {
                        let busy = format!("bench-hold-{i} is held by another owner");
                        return (held, Some(leasehold::Error::unavailable(busy)));
                    }
                    Err(error) => return (held, Some(error)),
                }
            }
            (held, None)
        });
    }
    let mut guards = Vec::with_capacity(spec.locks);
    let mut failed = None;
    while let Some(taken) = takers.join_next().await {
        let (held, error) = taken.expect("a taker does not panic");
        guards.extend(held);
        failed = failed.or(error);
    }
    let acquired_in = started.elapsed();
    let outcome = match failed {
        Some(error) => Err(error),
        None => {
            let servers_cpu = || spec.servers.iter().map(|pid| tree_cpu_time(*pid)).sum();
            let (cpu_before, server_before) = (process_cpu(), servers_cpu());
            let window_start = Instant::now();
            tokio::time::sleep(spec.window).await;
            let server_cpu: Duration = servers_cpu();
            let report = HoldReport {
                locks: guards.len(),
                acquired_in,
                window: window_start.elapsed(),
                cpu: process_cpu().saturating_sub(cpu_before),
                server_cpu: (!spec.servers.is_empty())
                    .then(|| server_cpu.saturating_sub(server_before)),
                rss_before,
                rss_held: resident_bytes(),
            };
            match guards.iter().find(|guard| !guard.is_held()) {
                Some(lost) => Err(leasehold::Error::unavailable(format!(
                    "{} was lost while held",
                    lost.name()
                ))),
                None => Ok(report),
            }
        }
    };
    release_all(guards).await;
    outcome
}

/// Releases `guards`, [`HOLD_IN_FLIGHT`] at a time.
async fn release_all(guards: Vec<leasehold::MutexGuard>) {
    let mut releases = tokio::task::JoinSet::new();
    for guard in guards {
        if releases.len() >= HOLD_IN_FLIGHT {
            releases.join_next().await;
        }
        releases.spawn(async move {
            let _ = guard.release().await;
        });
    }
    while releases.join_next().await.is_some() {}
}

/// CPU time (user and system) this process has used so far.
fn process_cpu() -> Duration {
    let spent = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(
        u64::try_from(spent.tv_sec).unwrap_or(0),
        u32::try_from(spent.tv_nsec).unwrap_or(0),
    )
}

/// User + system CPU time of the local process `pid` so far (`None` if it cannot be read).
/// From `/proc/<pid>/stat`, in ticks of 10 ms.
pub fn cpu_time_of(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name (which is in parentheses): utime is the 14th field
    // of the line, stime the 15th.
    let after = stat.get(stat.rfind(')')? + 2..)?;
    let mut fields = after.split(' ').skip(11);
    let user: u64 = fields.next()?.parse().ok()?;
    let system: u64 = fields.next()?.parse().ok()?;
    Some(Duration::from_millis((user + system) * 10))
}

/// The process `root` and every process below it, as they are now.
/// From the parent ids in `/proc/<pid>/stat`.
pub fn process_tree(root: u32) -> Vec<u32> {
    let mut parents = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(after) = stat.rfind(')').map(|at| &stat[at + 2..]) else {
            continue;
        };
        if let Some(ppid) = after.split(' ').nth(1).and_then(|p| p.parse::<u32>().ok()) {
            parents.push((pid, ppid));
        }
    }
    let mut tree = vec![root];
    let mut at = 0;
    while at < tree.len() {
        let parent = tree[at];
        tree.extend(
            parents
                .iter()
                .filter(|(_, p)| *p == parent)
                .map(|(c, _)| *c),
        );
        at += 1;
    }
    tree
}

/// User + system CPU time of the process `root` and of every process below it.
/// Live or ended (a forking server's sessions: PostgreSQL); ended children count once
/// their parent has waited for them.
pub fn tree_cpu_time(root: u32) -> Duration {
    let ticks = |pid: u32, fields: std::ops::Range<usize>| -> u64 {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            return 0; // ended meanwhile
        };
        let after = &stat[stat.rfind(')').map_or(0, |at| at + 2)..];
        let values: Vec<&str> = after.split(' ').collect();
        fields
            .filter_map(|i| values.get(i)?.parse::<u64>().ok())
            .sum()
    };
    // utime and stime are the 14th and 15th fields of the line, cutime and cstime the next two.
    let own: u64 = process_tree(root)
        .into_iter()
        .map(|pid| ticks(pid, 11..13))
        .sum();
    Duration::from_millis((own + ticks(root, 13..15)) * 10)
}

/// This process's resident memory, in bytes (`VmRSS`; 0 where `/proc` does not say).
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|kb| kb.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
