//! Connecting to the nodes.
//! It refuses configurations that break the quorum (one server counted twice), and reaches
//! a majority without waiting for the rest.
//!
//! Every node is connected by a task of its own that keeps trying (with backoff) until it
//! succeeds or the backend is dropped; each attempt is bounded by the connect timeout. A
//! node is used only once connected and its run id checked against the others'. Connecting
//! returns when a majority is connected (and the others had `node_timeout` more to
//! join), so one stalled node does not hold it up.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use leasehold_core::support::redact_url;
use leasehold_core::support::url::ParsedUrl;
use leasehold_core::{Error, Result};
use tokio::sync::mpsc;

use super::options::RedlockOptions;
use super::quorum::Majority;
use crate::node::Node;

/// The first pause between connection attempts of a node, doubled up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(100);
const MAX_PAUSE: Duration = Duration::from_secs(5);

/// The nodes of one Redlock backend, each usable once connected and checked.
#[derive(Debug)]
pub(super) struct Nodes {
    urls: Vec<String>,
    slots: Vec<OnceLock<Node>>,
    /// Serialises the run-id check of nodes connecting at the same time.
    checking: Mutex<()>,
}

impl Nodes {
    /// How many nodes there are (connected or not).
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    /// The URL of every node, in order.
    pub(super) fn urls(&self) -> &[String] {
        &self.urls
    }

    /// Node `i`, if it is connected.
    pub(super) fn get(&self, i: usize) -> Option<&Node> {
        self.slots.get(i)?.get()
    }

    /// The connected nodes.
    pub(super) fn connected(&self) -> impl Iterator<Item = &Node> {
        self.slots.iter().filter_map(OnceLock::get)
    }

    /// Makes `node` usable as node `i`, unless it is a server that another node is already.
    fn accept(&self, i: usize, node: Node) -> Result<()> {
        let _checking = self.checking.lock().unwrap_or_else(|e| e.into_inner());
        for (j, other) in self.slots.iter().enumerate() {
            if let Some(other) = other.get()
                && other.run_id() == node.run_id()
            {
                return Err(same_server(&self.urls[j], &self.urls[i]));
            }
        }
        let _ = self.slots[i].set(node);
        Ok(())
    }
}

/// What became of a node's connection attempt.
type Report = (usize, Result<()>);

/// The nodes at `urls` once a majority is connected, and the warnings to show.
pub(super) async fn connect(
    urls: &[String],
    options: &RedlockOptions,
) -> Result<(Arc<Nodes>, Vec<String>)> {
    if urls.is_empty() {
        return Err(Error::invalid(
            "redlock nodes",
            "at least one node is needed",
        ));
    }
    refuse_same_address(urls).await?;
    let n = urls.len();
    let majority = Majority::of(n);
    let quorum = majority.quorum();
    let mut warnings = Vec::new();
    if n.is_multiple_of(2) {
        warnings.push(format!(
            "{n} nodes: an even number tolerates no more failures than {} nodes and needs a \
             larger majority ({quorum}); use an odd number",
            n - 1
        ));
    }
    let nodes = Arc::new(Nodes {
        urls: urls.to_vec(),
        slots: (0..n).map(|_| OnceLock::new()).collect(),
        checking: Mutex::new(()),
    });
    let (report, mut reports) = mpsc::unbounded_channel::<Report>();
    for (i, url) in urls.iter().enumerate() {
        tokio::spawn(keep_connecting(
            Arc::downgrade(&nodes),
            i,
            url.clone(),
            options.clone(),
            report.clone(),
        ));
    }
    drop(report);
    // Per node: None while its first attempt runs, then whether it is connected.
    let mut outcome: Vec<Option<bool>> = vec![None; n];
    let mut errors: Vec<Option<Error>> = vec![None; n];
    let connected = |outcome: &[Option<bool>]| outcome.iter().filter(|o| **o == Some(true)).count();
    let failed = |outcome: &[Option<bool>]| outcome.iter().filter(|o| **o == Some(false)).count();
    let mut handle = |(i, result): Report, outcome: &mut Vec<Option<bool>>| -> Result<()> {
        match result {
            Ok(()) => outcome[i] = Some(true),
            // One server twice: refused.
            Err(error @ Error::InvalidArgument { .. }) => return Err(error),
            Err(error) => {
                if outcome[i].is_none() {
                    outcome[i] = Some(false);
                }
                errors[i] = Some(error);
            }
        }
        Ok(())
    };
    while !majority.reached(connected(&outcome)) {
        if majority.out_of_reach(failed(&outcome)) {
            return Err(Error::unavailable(format!(
                "only {} of {n} redis nodes are reachable; a majority ({quorum}) is needed",
                connected(&outcome)
            )));
        }
        let Some(next) = reports.recv().await else {
            break;
        };
        handle(next, &mut outcome)?;
    }
    // The others get a moment more, so that a healthy deployment is checked whole here.
    let grace = tokio::time::sleep(options.node_timeout);
    tokio::pin!(grace);
    while connected(&outcome) < n {
        tokio::select! {
            next = reports.recv() => match next {
                Some(next) => handle(next, &mut outcome)?,
                None => break,
            },
            () = &mut grace => break,
        }
    }
    for (i, connected) in outcome.iter().enumerate() {
        if *connected != Some(true) {
            let why = match &errors[i] {
                Some(error) => format!(": {error}"),
                None => String::new(),
            };
            warnings.push(format!(
                "{} is not connected yet; it is tried again in the background{why}",
                redact_url(&urls[i])
            ));
        }
    }
    Ok((nodes, warnings))
}

/// Connects node `i` at `url`, again and again until that succeeds or the nodes are gone.
/// It reports each outcome.
async fn keep_connecting(
    nodes: Weak<Nodes>,
    i: usize,
    url: String,
    options: RedlockOptions,
    report: mpsc::UnboundedSender<Report>,
) {
    let mut pause = FIRST_PAUSE;
    loop {
        let attempt = Node::connect(&url, &options.redis).await;
        let Some(nodes) = nodes.upgrade() else {
            return;
        };
        match attempt.and_then(|node| nodes.accept(i, node)) {
            Ok(()) => {
                let _ = report.send((i, Ok(())));
                return;
            }
            Err(error @ Error::InvalidArgument { .. }) => {
                // Unusable as configured (another node's server, a bad URL): trying again
                // would not change that.
                tracing::error!("redlock: {error}; this node is left out");
                let _ = report.send((i, Err(error)));
                return;
            }
            Err(error) => {
                tracing::debug!(url = %redact_url(&url), %error, "redlock: connecting to a node failed; trying again");
                let _ = report.send((i, Err(error)));
            }
        }
        drop(nodes);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_PAUSE);
    }
}

fn same_server(first: &str, second: &str) -> Error {
    Error::invalid(
        "redlock nodes",
        format!(
            "{} and {} are the same redis server; every node must be independent",
            redact_url(first),
            redact_url(second)
        ),
    )
}

/// Refuses two URLs that resolve to a common address.
pub(super) async fn refuse_same_address(urls: &[String]) -> Result<()> {
    let mut owners: HashMap<SocketAddr, &String> = HashMap::new();
    for url in urls {
        // Unparsable or unresolvable now: the connection attempt will say so.
        let Ok(parsed) = ParsedUrl::parse(url, &["redis", "rediss"], "redis://host:port") else {
            continue;
        };
        let Some(host) = parsed.hosts(1..=1).ok().and_then(|hosts| hosts.first()) else {
            continue;
        };
        let Ok(addrs) = tokio::net::lookup_host((&*host.name, host.port.unwrap_or(6379))).await
        else {
            continue;
        };
        let addrs: HashSet<SocketAddr> = addrs.collect();
        for addr in addrs {
            if let Some(first) = owners.insert(addr, url)
                && first != url
            {
                return Err(Error::invalid(
                    "redlock nodes",
                    format!(
                        "{} and {} both reach {addr}; every node must be independent",
                        redact_url(first),
                        redact_url(url)
                    ),
                ));
            }
        }
    }
    let unique: HashSet<&String> = urls.iter().collect();
    if unique.len() != urls.len() {
        return Err(Error::invalid(
            "redlock nodes",
            "a node is listed twice; every node must be independent",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_same_address_twice_is_refused() {
        for urls in [
            vec![
                "redis://127.0.0.1:7001".to_owned(),
                "redis://127.0.0.1:7001".to_owned(),
            ],
            vec![
                "redis://localhost:7001".to_owned(),
                "redis://127.0.0.1:7001".to_owned(),
            ],
        ] {
            let err = refuse_same_address(&urls).await.unwrap_err();
            assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        }
        refuse_same_address(&[
            "redis://127.0.0.1:7001".to_owned(),
            "redis://127.0.0.1:7002".to_owned(),
        ])
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn aliases_without_a_port_are_refused_at_the_default_port() {
        let urls = [
            "redis://localhost".to_owned(),
            "redis://127.0.0.1/0".to_owned(),
        ];
        let err = refuse_same_address(&urls).await.unwrap_err();
        assert!(err.to_string().contains("127.0.0.1:6379"), "{err}");
    }
}
