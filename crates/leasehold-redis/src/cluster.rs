//! Redis Cluster: the nodes a `redis+cluster://` URL names, and the link to them.
//!
//! The URL names some nodes (`redis+cluster://h1:p,h2:p,…`; `rediss+cluster://` for TLS);
//! the link learns the rest from them (`CLUSTER SLOTS`). Every key of one lock shares the
//! hash tag `{name}`, so a lock lives in one slot and each script runs on that slot's
//! master. The link (redis-rs's cluster connection) follows `MOVED` and `ASK` and refreshes
//! its slot map. Sharded subscriptions go on a second cluster connection (see
//! [`Link`]). Connecting loads the scripts on every node, replicas included, so a promoted
//! replica has them.

use leasehold_core::support::url::ParsedUrl;
use leasehold_core::{Error, Result};
use redis::ProtocolVersion;
use redis::cluster::ClusterClientBuilder;

use crate::connection::{Connected, connection_info, load_scripts, tls_certificates};
use crate::link::Link;
use crate::options::RedisOptions;
use crate::script::Calls;
use crate::wakeups::Router;

/// The schemes of a Cluster URL: plain, and TLS.
pub(crate) const CLUSTER_SCHEMES: [&str; 2] = ["redis+cluster", "rediss+cluster"];

/// The nodes a Cluster URL names.
#[derive(Debug, Clone)]
pub(crate) struct ClusterNodes {
    /// The URL as given.
    url: String,
    /// A `redis://` (or `rediss://`) URL per node, with the URL's credentials.
    nodes: Vec<String>,
    /// The URL, to put another node's address in.
    parsed: std::sync::Arc<ParsedUrl>,
    /// The scheme of a node's URL: `redis` or `rediss`.
    scheme: &'static str,
}

impl ClusterNodes {
    /// The nodes of the base URL `url` (see `options::parse_url`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a URL without a node, or with a path (a Cluster has
    /// only db 0).
    pub(crate) fn parse(url: &str) -> Result<ClusterNodes> {
        let parsed = ParsedUrl::parse(
            url,
            &CLUSTER_SCHEMES,
            "redis+cluster://host:port,host:port,… or rediss+cluster://…",
        )?;
        let path = parsed.path()?;
        if !path.trim_start_matches('/').is_empty() {
            return Err(parsed.invalid(format!(
                "{path:?}: a Redis Cluster has no db to choose (only db 0)"
            )));
        }
        let scheme = match parsed.scheme.as_str() {
            "rediss+cluster" => "rediss",
            _ => "redis",
        };
        let nodes = (parsed.hosts(1..)?.iter())
            .map(|host| parsed.with_address(scheme, &host.to_string(), ""))
            .collect();
        Ok(ClusterNodes {
            url: url.to_owned(),
            nodes,
            parsed: std::sync::Arc::new(parsed),
            scheme,
        })
    }

    /// The URL of the node at `address` (`host:port`), with the URL's credentials.
    pub(crate) fn node_url(&self, address: &str) -> String {
        self.parsed.with_address(self.scheme, address, "")
    }

    /// The URL as given.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// Connects to the Cluster, within the options' connect timeout, or fails.
    /// The link's push messages go to `push`; the scripts are loaded on every node.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] if no node named answers with the slot map, or a node
    /// refuses the scripts.
    pub(crate) async fn connect(
        &self,
        options: &RedisOptions,
        push: Router,
        calls: &Calls,
    ) -> Result<Connected> {
        let limit = options.connect_limit();
        let shown = leasehold_core::support::redact_url(&self.url);
        let infos = self
            .nodes
            .iter()
            .map(|node| connection_info(node, options))
            .collect::<Result<Vec<_>>>()?;
        // Requests that meet a moving slot (`TRYAGAIN`) or a failover (`CLUSTERDOWN`) are
        // retried after a random wait below 20 ms, 40 ms, … up to 500 ms, not redis-rs's
        // 1.28 s or more: a slot move or a failover ends within a request timeout, which
        // bounds every request anyway. Each node gets half the connect timeout, so that one
        // silent node named in the URL does not use it all.
        let mut builder = ClusterClientBuilder::new(infos)
            .use_protocol(ProtocolVersion::RESP3)
            .push_sender(push)
            .connection_timeout(limit / 2)
            .min_retry_wait(10)
            .max_retry_wait(500);
        if let Some(certificates) = tls_certificates(options) {
            builder = builder.certs(certificates);
        }
        let client = builder
            .build()
            .map_err(|e| Error::invalid("url", format!("{shown}: {e}")))?;
        let connecting = async {
            let (commands, subscriptions) =
                tokio::try_join!(client.get_async_connection(), client.get_async_connection())
                    .map_err(|e| Error::Unavailable {
                        message: format!("cannot connect to the redis cluster at {shown}: {e}"),
                        source: Some(std::sync::Arc::new(e)),
                    })?;
            let mut link = Link::Cluster {
                commands,
                subscriptions,
            };
            load_scripts(&mut link, calls).await?;
            Ok(Connected {
                conn: link,
                server: self.url.clone(),
                warnings: Vec::new(),
                run_id: None,
                client: None,
            })
        };
        tokio::time::timeout(limit, connecting).await.map_err(|_| {
            Error::unavailable(format!(
                "connecting to the redis cluster at {shown} timed out after {limit:?}"
            ))
        })?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls_name_their_nodes() {
        let nodes = ClusterNodes::parse("redis+cluster://u:pw@h1:1,h2:2").unwrap();
        assert_eq!(nodes.nodes, ["redis://u:pw@h1:1", "redis://u:pw@h2:2"]);
        assert_eq!(
            nodes.node_url("10.0.0.3:7002"),
            "redis://u:pw@10.0.0.3:7002"
        );
        let nodes = ClusterNodes::parse("rediss+cluster://h1:1/").unwrap();
        assert_eq!(nodes.nodes, ["rediss://h1:1"]);
        for bad in [
            "redis+cluster://h1:1/3",
            "redis+cluster:///",
            "redis+cluster://h1:x",
        ] {
            assert!(
                matches!(ClusterNodes::parse(bad), Err(Error::InvalidArgument { .. })),
                "{bad}"
            );
        }
    }
}
