//! What the comparison binaries share: their command line and the best-of-rounds table.

use std::pin::Pin;
use std::time::{Duration, Instant};

use leasehold_cli::bench::{Row, Stats, cycles};

/// One acquire + release of a compared implementation; resolves to the acquire's latency.
pub(crate) type Cycle = Pin<Box<dyn Future<Output = Duration> + Send>>;

/// The two uncontended rows of one side.
/// `<label>, 1 client` on the name `<slug>-solo`, and `<label>, N clients on N names`,
/// client `i` on `<slug>-name-<i>`. `cycle(i, name)` makes client `i`'s cycles on `name`.
#[allow(dead_code)] // not every comparison has sides of its own
pub(crate) async fn uncontended<C>(
    label: &str,
    slug: &str,
    clients: usize,
    duration: Duration,
    cycle: impl Fn(usize, String) -> C,
) -> Vec<Row>
where
    C: FnMut() -> Cycle + Send + 'static,
{
    vec![
        Row {
            name: format!("{label}, 1 client"),
            stats: cycles(1, duration, |_| cycle(0, format!("{slug}-solo"))).await,
            handoff: false,
        },
        Row {
            name: format!("{label}, {clients} clients on {clients} names"),
            stats: cycles(clients, duration, |i| cycle(i, format!("{slug}-name-{i}"))).await,
            handoff: false,
        },
    ]
}

/// Two sides measured under the same load.
/// `clients` tasks for `duration`, each running one cycle of side A then one of side B,
/// then B then A, and so on. Each side's [`Stats`] hold its acquire latencies, and a rate
/// of `cycles / (time spent in its cycles / clients)`: what the side would run at alone
/// under that load. Slow phases of the server (an fsync stall, a compaction) fall on both
/// sides alike, which rows measured one after the other cannot promise.
#[allow(dead_code)] // not every comparison interleaves
pub(crate) async fn interleaved<A, B>(
    clients: usize,
    duration: Duration,
    mut make: impl FnMut(usize) -> (A, B),
) -> (Stats, Stats)
where
    A: FnMut() -> Cycle + Send + 'static,
    B: FnMut() -> Cycle + Send + 'static,
{
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(clients);
    for i in 0..clients {
        let (mut a, mut b) = make(i);
        tasks.push(tokio::spawn(async move {
            let mut sides = [Stats::default(), Stats::default()];
            let mut spent = [Duration::ZERO; 2];
            let mut a_first = true;
            while start.elapsed() < duration {
                for side in if a_first { [0, 1] } else { [1, 0] } {
                    let began = Instant::now();
                    let acquire = if side == 0 { a().await } else { b().await };
                    spent[side] += began.elapsed();
                    sides[side].samples.push(acquire);
                    sides[side].cycles += 1;
                }
                a_first = !a_first;
            }
            (sides, spent)
        }));
    }
    let mut totals = [Stats::default(), Stats::default()];
    let mut spent = [Duration::ZERO; 2];
    for task in tasks {
        let (sides, time) = task.await.expect("an interleaved client");
        for side in 0..2 {
            totals[side].cycles += sides[side].cycles;
            totals[side].samples.extend_from_slice(&sides[side].samples);
            spent[side] += time[side];
        }
    }
    let [mut a, mut b] = totals;
    for (stats, spent) in [(&mut a, spent[0]), (&mut b, spent[1])] {
        stats.samples.sort();
        stats.elapsed = spent / u32::try_from(clients.max(1)).unwrap_or(u32::MAX);
    }
    (a, b)
}

/// A plain redis-rs connection (multiplexed, reconnecting) for the bare comparison sides.
#[allow(dead_code)] // not every comparison talks to Redis
pub(crate) async fn bare_connection(url: &str) -> redis::aio::ConnectionManager {
    redis::Client::open(url)
        .unwrap()
        .get_connection_manager()
        .await
        .unwrap()
}

/// `[--url URL] [--duration D] [--clients N] [--handoffs N] [--rounds N] [--json] [--only SIDE]`.
pub(crate) struct Args {
    /// The server to use; without it the binary starts its own.
    pub(crate) url: Option<String>,
    pub(crate) duration: Duration,
    pub(crate) clients: usize,
    pub(crate) handoffs: usize,
    /// Rounds of the whole comparison (each binary has its default).
    pub(crate) rounds: Option<usize>,
    pub(crate) json: bool,
    /// Run only one side of the comparison, to profile it.
    pub(crate) only: Option<String>,
}

impl Args {
    pub(crate) fn parse() -> Args {
        match Self::parse_from(std::env::args().skip(1)) {
            Ok(args) => args,
            Err(message) => {
                let usage = "usage: [--url URL] [--duration D] [--clients N] [--handoffs N] \
                             [--rounds N] [--json] [--only SIDE] (see the source's header)";
                if message.is_empty() {
                    println!("{usage}");
                    std::process::exit(0);
                }
                eprintln!("{message}\n{usage}");
                std::process::exit(2);
            }
        }
    }

    /// The arguments, or what is wrong with them (empty: help was asked for).
    fn parse_from(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
        let mut args = Args {
            url: None,
            duration: Duration::from_secs(3),
            clients: 16,
            handoffs: 100,
            rounds: None,
            json: false,
            only: None,
        };
        fn value(it: &mut impl Iterator<Item = String>, flag: &str) -> Result<String, String> {
            it.next().ok_or_else(|| format!("{flag} needs a value"))
        }
        fn number(it: &mut impl Iterator<Item = String>, flag: &str) -> Result<usize, String> {
            let n = value(it, flag)?;
            n.parse()
                .map_err(|_| format!("{flag} {n:?}: expected a whole number"))
        }
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--url" => args.url = Some(value(&mut it, "--url")?),
                "--duration" => {
                    let d = value(&mut it, "--duration")?;
                    args.duration = leasehold::parse_duration(&d)
                        .map_err(|e| format!("--duration {d:?}: {e}"))?;
                }
                "--clients" => args.clients = number(&mut it, "--clients")?.max(1),
                "--handoffs" => args.handoffs = number(&mut it, "--handoffs")?,
                "--rounds" => args.rounds = Some(number(&mut it, "--rounds")?.max(1)),
                "--json" => args.json = true,
                "--only" => args.only = Some(value(&mut it, "--only")?),
                "-h" | "--help" => return Err(String::new()),
                other => return Err(format!("unknown argument {other:?}")),
            }
        }
        Ok(args)
    }

    /// Whether `side` of the comparison runs.
    #[allow(dead_code)] // not every comparison has sides to choose from
    pub(crate) fn runs(&self, side: &str) -> bool {
        self.only.as_deref().is_none_or(|only| only == side)
    }
}

/// Every round's rows.
/// The table shows each row at its best round (the highest rate, or for hand-offs the
/// lowest median): on a small machine whatever else runs (the servers themselves) moves
/// single rounds. A comparison of two rows is also given as the median, over rounds, of
/// their ratio within one round, where both ran back to back.
#[derive(Default)]
pub(crate) struct Rounds(Vec<Vec<Row>>);

#[allow(dead_code)] // sentinel-compare keeps rounds of its own, with the server's CPU time
impl Rounds {
    /// Starts a round.
    pub(crate) fn next(&mut self) {
        self.0.push(Vec::new());
    }

    /// Adds rows to the current round.
    pub(crate) fn keep(&mut self, rows: Vec<Row>) {
        if self.0.is_empty() {
            self.next();
        }
        if let Some(round) = self.0.last_mut() {
            round.extend(rows);
        }
    }

    /// Each row at its best round, in the order rows first appeared.
    pub(crate) fn best(&self) -> Vec<Row> {
        let mut best: Vec<Row> = Vec::new();
        for row in self.0.iter().flatten() {
            match best.iter_mut().find(|b| b.name == row.name) {
                Some(b) if row.handoff && row.stats.quantile(0.5) < b.stats.quantile(0.5) => {
                    *b = row.clone()
                }
                Some(b) if !row.handoff && row.stats.rate() > b.stats.rate() => *b = row.clone(),
                Some(_) => {}
                None => best.push(row.clone()),
            }
        }
        best
    }

    /// The median over rounds of one row's rate divided by another's in the same round.
    /// The rows are those whose names start with `ours` and `theirs`; NaN if no round has
    /// both.
    #[allow(dead_code)] // not every comparison compares rates
    pub(crate) fn paired(&self, ours: &str, theirs: &str) -> f64 {
        median(self.ratios(ours, theirs))
    }

    /// The ratios behind [`paired`](Rounds::paired), one per round that has both rows.
    /// Smallest first.
    #[allow(dead_code)] // not every comparison compares rates
    pub(crate) fn ratios(&self, ours: &str, theirs: &str) -> Vec<f64> {
        let rate = |round: &[Row], name: &str| {
            round
                .iter()
                .find(|r| r.name.starts_with(name))
                .map(|r| r.stats.rate())
        };
        let mut ratios: Vec<f64> = self
            .0
            .iter()
            .filter_map(|round| Some(rate(round, ours)? / rate(round, theirs)?))
            .collect();
        ratios.sort_by(f64::total_cmp);
        ratios
    }
}

/// The median of `values` (NaN if there are none).
pub(crate) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// One leasehold cycle on `mutex`: `lock` (timed), then `release`.
#[allow(dead_code)] // not every comparison runs leasehold cycles of its own
pub(crate) fn leasehold_cycle(mutex: leasehold::Mutex) -> impl FnMut() -> Cycle + Send + 'static {
    move || {
        let mutex = mutex.clone();
        Box::pin(async move {
            let started = Instant::now();
            let guard = mutex.lock().await.unwrap();
            let took = started.elapsed();
            guard.release().await.unwrap();
            took
        })
    }
}

/// One rslock cycle on `key`: `acquire_no_guard` (timed), then `unlock`.
/// `acquire_no_guard` retries until it holds. With several servers in `manager`, that is
/// rslock's Redlock.
#[allow(dead_code)] // only the comparisons with rslock
pub(crate) fn rslock_cycle(
    manager: std::sync::Arc<rslock::LockManager>,
    key: String,
    ttl: Duration,
) -> impl FnMut() -> Cycle + Send + 'static {
    move || {
        let manager = manager.clone();
        let key = key.clone();
        Box::pin(async move {
            let started = Instant::now();
            let lock = manager.acquire_no_guard(key.as_bytes(), ttl).await.unwrap();
            let took = started.elapsed();
            manager.unlock(&lock).await;
            took
        })
    }
}

/// User + system CPU time of process `pid` so far.
#[allow(dead_code)] // only the comparisons that read the servers' CPU time
pub(crate) fn cpu_time(pid: u32) -> Duration {
    leasehold_cli::bench::cpu_time_of(pid).expect("the server's stat")
}

/// Pins the processes `pids` to the CPUs in `LEASEHOLD_SERVER_CPUS`, if it is set.
/// The servers a comparison starts then run apart from its clients (`taskset -c` on the
/// binary), so that their CPU time is theirs alone.
#[allow(dead_code)] // only the comparisons that start servers of their own
pub(crate) fn pin_servers(pids: &[u32]) {
    let Ok(cpus) = std::env::var("LEASEHOLD_SERVER_CPUS") else {
        return;
    };
    for pid in pids {
        let pinned = std::process::Command::new("taskset")
            .args(["-pc", &cpus, &pid.to_string()])
            .output()
            .expect("taskset");
        let gone = !std::path::Path::new(&format!("/proc/{pid}")).exists();
        assert!(pinned.status.success() || gone, "taskset -pc {cpus} {pid}");
    }
}

/// The process `root` and every process below it, as they are now.
#[allow(dead_code)] // only the comparisons whose servers fork (PostgreSQL)
pub(crate) fn process_tree(root: u32) -> Vec<u32> {
    leasehold_cli::bench::process_tree(root)
}

/// User + system CPU time of the process `root` and of every process below it.
#[allow(dead_code)] // only the comparisons whose servers fork (PostgreSQL)
pub(crate) fn tree_cpu_time(root: u32) -> Duration {
    leasehold_cli::bench::tree_cpu_time(root)
}

/// A side of a server-CPU comparison: its name, and client `i`'s cycles.
#[allow(dead_code)] // only the comparisons that report the server's CPU per cycle
pub(crate) type CpuSide<'a> = (
    &'a str,
    Box<dyn Fn(usize) -> Box<dyn FnMut() -> Cycle + Send> + 'a>,
);

/// The server's CPU time per uncontended cycle of each side, at 1 and at `clients` clients.
/// `spent` reads the server's CPU time so far; it is read around each side's run and shared
/// out over its cycles: what a cycle costs the server, which a rate alone hides while the
/// clients are the bound. One JSON object per side and client count.
#[allow(dead_code)] // only the comparisons that report the server's CPU per cycle
pub(crate) async fn server_cpu(
    sides: &[CpuSide<'_>],
    clients: usize,
    duration: Duration,
    spent: impl Fn() -> Duration,
) -> Vec<serde_json::Value> {
    let mut found = Vec::new();
    for n in [1, clients] {
        for (side, make) in sides {
            let before = spent();
            let stats = cycles(n, duration, make).await;
            let cpu = spent().saturating_sub(before);
            found.push(serde_json::json!({
                "side": side,
                "clients": n,
                "cycles_per_s": stats.rate(),
                "server_cpu_us_per_cycle": cpu.as_secs_f64() * 1e6 / stats.cycles.max(1) as f64,
            }));
        }
    }
    found
}

/// Prints what [`server_cpu`] found, a line per side and client count.
#[allow(dead_code)] // only the comparisons that report the server's CPU per cycle
pub(crate) fn print_server_cpu(found: &[serde_json::Value]) {
    for row in found {
        println!(
            "server CPU per uncontended cycle, {}, {} client(s): {:.1} µs ({:.0} cycles/s)",
            row["side"].as_str().unwrap_or("?"),
            row["clients"],
            row["server_cpu_us_per_cycle"].as_f64().unwrap_or(f64::NAN),
            row["cycles_per_s"].as_f64().unwrap_or(f64::NAN),
        );
    }
}

/// One side's run: its rate, and the servers' CPU time per cycle.
#[allow(dead_code)] // only the comparisons that read the servers' CPU time
pub(crate) struct Run {
    pub(crate) stats: Stats,
    pub(crate) server_cpu_per_cycle: Duration,
}

/// Uncontended acquire + release cycles of leasehold `clients`, client `i` on `<slug>-<i>`.
/// The CPU time the processes `servers` spent meanwhile is shared out over the cycles.
#[allow(dead_code)] // only the comparisons that read the servers' CPU time
pub(crate) async fn run(
    clients: &[leasehold::Client],
    slug: &str,
    duration: Duration,
    servers: &[u32],
) -> Run {
    measured(clients.len(), duration, servers, |i| {
        leasehold_cycle(clients[i].mutex(&format!("{slug}-{i}")).unwrap())
    })
    .await
}

/// `clients` tasks running `cycle(i)`'s cycles for `duration`.
/// The CPU time the processes `servers` spent meanwhile is shared out over the cycles.
#[allow(dead_code)] // only the comparisons that read the servers' CPU time
pub(crate) async fn measured<C>(
    clients: usize,
    duration: Duration,
    servers: &[u32],
    cycle: impl FnMut(usize) -> C,
) -> Run
where
    C: FnMut() -> Cycle + Send + 'static,
{
    let spent = || servers.iter().map(|pid| cpu_time(*pid)).sum::<Duration>();
    let before = spent();
    let stats = cycles(clients, duration, cycle).await;
    let spent = spent().saturating_sub(before);
    let cycles = u32::try_from(stats.cycles.max(1)).unwrap_or(u32::MAX);
    Run {
        server_cpu_per_cycle: spent / cycles,
        stats,
    }
}
