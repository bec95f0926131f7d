//! Connecting to the nodes: refusing configurations that break the quorum (one server
//! counted twice), and reaching a majority.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;

use futures_util::future::join_all;
use leasehold_core::{Error, Result, redact_url};

use super::options::RedlockOptions;
use super::quorum::quorum;
use crate::node::Node;

/// The nodes at `urls` once a majority is reached, and the warnings to show (nodes not
/// reached yet are reached lazily later).
pub(super) async fn connect(
    urls: &[String],
    options: &RedlockOptions,
) -> Result<(Vec<Node>, Vec<String>)> {
    if urls.is_empty() {
        return Err(Error::invalid(
            "redlock nodes",
            "at least one node is needed",
        ));
    }
    refuse_same_address(urls).await?;
    let quorum = quorum(urls.len());
    let mut warnings = Vec::new();
    if urls.len() % 2 == 0 {
        warnings.push(format!(
            "{} nodes: an even number tolerates no more failures than {} nodes and needs a \
             larger majority ({quorum}); use an odd number",
            urls.len(),
            urls.len() - 1
        ));
    }
    // Connect to all at once; nodes that are down now are reached lazily later.
    let eager = join_all(
        urls.iter()
            .map(|url| Node::open(url, &options.redis, false)),
    )
    .await;
    let mut nodes = Vec::with_capacity(urls.len());
    let mut reached = Vec::new();
    for (url, node) in urls.iter().zip(eager) {
        match node {
            Ok(node) => {
                reached.push((url, node.clone()));
                nodes.push(node);
            }
            Err(error) => {
                warnings.push(format!("{} is not reachable yet: {error}", redact_url(url)));
                nodes.push(Node::open(url, &options.redis, true).await?);
            }
        }
    }
    if reached.len() < quorum {
        return Err(Error::unavailable(format!(
            "only {} of {} redis nodes are reachable; a majority ({quorum}) is needed",
            reached.len(),
            urls.len()
        )));
    }
    // The same server behind two addresses (an alias, NAT) would count twice.
    let mut seen: HashMap<String, &String> = HashMap::new();
    for (url, node) in &reached {
        let id = node.run_id().await?;
        if let Some(first) = seen.insert(id, url) {
            return Err(same_server(first, url));
        }
    }
    Ok((nodes, warnings))
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
        let authority = url
            .split_once("://")
            .map_or(url.as_str(), |(_, rest)| rest)
            .split(['/', '?'])
            .next()
            .unwrap_or_default();
        let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        let Ok(addrs) = tokio::net::lookup_host(hostport).await else {
            continue; // unresolvable now: the connection attempt will say so
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
}
