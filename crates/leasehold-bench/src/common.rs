//! What the comparison binaries share: their command line and the best-of-rounds table.

use std::pin::Pin;
use std::time::Duration;

use leasehold_cli::bench::{Row, cycles};

/// One acquire + release of a compared implementation; resolves to the acquire's latency.
pub(crate) type Cycle = Pin<Box<dyn Future<Output = Duration> + Send>>;

/// The two uncontended rows of one side: `<label>, 1 client` on the name `<slug>-solo`, and
/// `<label>, N clients on N names`, client `i` on `<slug>-name-<i>`. `cycle(i, name)` makes
/// client `i`'s cycles on `name`.
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

/// A plain redis-rs connection (multiplexed, reconnecting) for the bare comparison sides.
#[allow(dead_code)] // not every comparison talks to Redis
pub(crate) async fn bare_connection(url: &str) -> redis::aio::ConnectionManager {
    redis::Client::open(url)
        .unwrap()
        .get_connection_manager()
        .await
        .unwrap()
}

/// `[--url URL] [--duration D] [--clients N] [--handoffs N] [--json] [--only SIDE]`.
pub(crate) struct Args {
    /// The server to use; without it the binary starts its own.
    pub(crate) url: Option<String>,
    pub(crate) duration: Duration,
    pub(crate) clients: usize,
    pub(crate) handoffs: usize,
    pub(crate) json: bool,
    /// Run only one side of the comparison, to profile it.
    pub(crate) only: Option<String>,
}

impl Args {
    pub(crate) fn parse() -> Args {
        let mut args = Args {
            url: None,
            duration: Duration::from_secs(3),
            clients: 16,
            handoffs: 100,
            json: false,
            only: None,
        };
        let mut it = std::env::args().skip(1);
        let number = |it: &mut std::iter::Skip<std::env::Args>, flag: &str| -> usize {
            it.next()
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{flag} N"))
        };
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--url" => args.url = it.next(),
                "--duration" => {
                    args.duration = leasehold::parse_duration(&it.next().expect("--duration D"))
                        .expect("a duration such as 3s")
                }
                "--clients" => args.clients = number(&mut it, "--clients"),
                "--handoffs" => args.handoffs = number(&mut it, "--handoffs"),
                "--json" => args.json = true,
                "--only" => args.only = it.next(),
                other => panic!("unknown argument {other}; see the source's header"),
            }
        }
        args
    }

    /// Whether `side` of the comparison runs.
    #[allow(dead_code)] // not every comparison has sides to choose from
    pub(crate) fn runs(&self, side: &str) -> bool {
        self.only.as_deref().is_none_or(|only| only == side)
    }
}

/// The best round of each row: the highest rate, or for hand-offs the lowest median. On a
/// small machine whatever else runs (the servers themselves) moves single rounds.
#[derive(Default)]
pub(crate) struct Best(pub(crate) Vec<Row>);

impl Best {
    pub(crate) fn keep(&mut self, rows: Vec<Row>) {
        for row in rows {
            match self.0.iter_mut().find(|b| b.name == row.name) {
                Some(b) if row.handoff && row.stats.quantile(0.5) < b.stats.quantile(0.5) => {
                    *b = row
                }
                Some(b) if !row.handoff && row.stats.rate() > b.stats.rate() => *b = row,
                Some(_) => {}
                None => self.0.push(row),
            }
        }
    }
}
