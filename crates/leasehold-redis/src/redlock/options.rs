//! Options of the Redlock backend, and the URL parameters that set them.

use std::time::Duration;

use leasehold_core::support::url::{ParsedUrl, UrlParam, url_params};
use leasehold_core::{Error, Result};

use crate::options::RedisOptions;

url_params! {
    /// The URL parameters of `redlock://`, each setting the option of its name.
    /// `tls=true` makes every node `rediss://`, and the `tls_*` files are as for
    /// `rediss://`.
    pub(crate) enum Param {
        Prefix = "prefix",
        ConnectTimeout = "connect_timeout",
        NodeTimeout = "node_timeout",
        Quarantine = "quarantine",
        Fencing = "fencing",
        Tls = "tls",
        TlsCa = "tls_ca",
        TlsCert = "tls_cert",
        TlsKey = "tls_key",
    }
}

/// Options of a [`RedlockBackend`](crate::RedlockBackend) (also settable as URL query parameters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedlockOptions {
    pub(super) redis: RedisOptions,
    pub(super) node_timeout: Duration,
    pub(super) fencing: bool,
    pub(super) quarantine: Option<Duration>,
}

impl Default for RedlockOptions {
    /// 50 ms per node, fencing write-back on, quarantine = each request's ttl.
    /// The key prefix is `leasehold`.
    fn default() -> Self {
        Self {
            redis: RedisOptions::default(),
            node_timeout: Duration::from_millis(50),
            fencing: true,
            quarantine: None,
        }
    }
}

impl RedlockOptions {
    /// Key prefix and connect timeout, as for a single server.
    pub fn redis(mut self, redis: RedisOptions) -> Self {
        self.redis = redis;
        self
    }

    /// How long one node may take to answer; keep it small next to the lease.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for zero or more than 10 s.
    pub fn node_timeout(mut self, timeout: Duration) -> Result<Self> {
        if timeout.is_zero() || timeout > Duration::from_secs(10) {
            return Err(Error::invalid(
                "node timeout",
                format!("{timeout:?} is not between 1 ms and 10 s"),
            ));
        }
        self.node_timeout = timeout;
        Ok(self)
    }

    /// Whether to write a grant's token back to a majority, so tokens strictly increase.
    /// `true` (the default): unless a majority already stands at the grant's token, write
    /// it back to a majority before the grant is used. `false`: never a second round, but
    /// tokens taken from different majorities may go backwards; do not fence with them.
    pub fn fencing(mut self, fencing: bool) -> Self {
        self.fencing = fencing;
        self
    }

    /// How long a node refuses grants after it (re)started, as it may have lost locks.
    /// It may have restarted empty, or from a snapshot older than the last grants. Must be
    /// at least the longest lease any client uses on these nodes; by default each request's
    /// own ttl. Zero turns the check off (then restart nodes only after the longest lease,
    /// or run them with `appendfsync always`).
    pub fn quarantine(mut self, quarantine: Duration) -> Self {
        self.quarantine = Some(quarantine);
        self
    }
}

/// Splits `redlock://[auth@]h1:p1,h2:p2[/db][?params]` into node URLs and options.
pub(crate) fn parse_url(url: &str) -> Result<(Vec<String>, RedlockOptions)> {
    let url = ParsedUrl::parse(url, &["redlock"], "redlock://host:port,host:port,...")?;
    let mut options = RedlockOptions::default();
    let mut scheme = "redis";
    for (param, value) in url.params::<Param>()? {
        match param {
            Param::Tls => scheme = if value.boolean()? { "rediss" } else { "redis" },
            Param::TlsCa | Param::TlsCert | Param::TlsKey => {
                options.redis.read_tls_param(param.name(), value.as_str())?;
            }
            Param::Prefix => options.redis = options.redis.prefix(value.as_str())?,
            Param::ConnectTimeout => {
                options.redis = options.redis.connect_timeout(value.duration()?);
            }
            Param::NodeTimeout => options = options.node_timeout(value.duration()?)?,
            Param::Quarantine => options = options.quarantine(value.duration()?),
            Param::Fencing => options.fencing = value.boolean()?,
        }
    }
    let nodes = url.hosts(1..)?.iter();
    Ok((
        nodes.map(|host| url.with_host(scheme, host)).collect(),
        options,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_become_node_urls_with_shared_credentials() {
        let (nodes, options) =
            parse_url("redlock://u:pw@h1:1,h2:2,h3:3/2?node_timeout=20ms&fencing=false").unwrap();
        assert_eq!(
            nodes,
            [
                "redis://u:pw@h1:1/2",
                "redis://u:pw@h2:2/2",
                "redis://u:pw@h3:3/2"
            ]
        );
        assert_eq!(options.node_timeout, Duration::from_millis(20));
        assert!(!options.fencing);
        for bad in [
            "redlock://",
            "redlock://h:1?nosuch=1",
            "redlock://h:1?node_timeout=0ms",
            "redlock://h:1?fencing=maybe",
            "redis://h:1",
        ] {
            assert!(
                matches!(parse_url(bad), Err(Error::InvalidArgument { .. })),
                "{bad}"
            );
        }
        let err = parse_url("redlock://u:hunter2@h:1?nosuch=1").unwrap_err();
        assert!(!err.to_string().contains("hunter2"));
        let known = err.to_string();
        for param in Param::ALL {
            assert!(
                known.contains(param.name()),
                "{known} does not list {param:?}"
            );
        }
        let (nodes, _) = parse_url("redlock://h1:1,h2:2?tls=true").unwrap();
        assert!(nodes.iter().all(|n| n.starts_with("rediss://")));
    }

    #[test]
    fn a_parameter_given_twice_is_refused() {
        let err = parse_url("redlock://h:1,h:2,h:3?fencing=true&fencing=false").unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
    }
}
