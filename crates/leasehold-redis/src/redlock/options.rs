//! Options of the Redlock backend, and the URL parameters that set them.

use std::time::Duration;

use leasehold_core::support::redact_url;
use leasehold_core::{Error, Result, parse_duration};

use crate::options::{RedisOptions, url_params};

url_params! {
    /// The URL parameters of `redlock://`.
    pub(crate) enum Param {
        /// [`RedisOptions::prefix`].
        Prefix = "prefix",
        /// [`RedisOptions::connect_timeout`].
        ConnectTimeout = "connect_timeout",
        /// [`RedlockOptions::node_timeout`].
        NodeTimeout = "node_timeout",
        /// [`RedlockOptions::quarantine`].
        Quarantine = "quarantine",
        /// [`RedlockOptions::fencing`].
        Fencing = "fencing",
        /// `true`: every node as `rediss://`.
        Tls = "tls",
        /// As for `rediss://`.
        TlsCa = "tls_ca",
        /// As for `rediss://`.
        TlsCert = "tls_cert",
        /// As for `rediss://`.
        TlsKey = "tls_key",
    }
}

/// Options of a [`RedlockBackend`](crate::RedlockBackend) (also settable as URL query
/// parameters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedlockOptions {
    pub(super) redis: RedisOptions,
    pub(super) node_timeout: Duration,
    pub(super) fencing: bool,
    pub(super) quarantine: Option<Duration>,
}

impl Default for RedlockOptions {
    /// 50 ms per node, fencing write-back on, quarantine = each request's ttl, key prefix
    /// `leasehold`.
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

    /// `true` (the default): unless a majority already stands at the grant's token, write
    /// it back to a majority before the grant is used, so tokens strictly increase.
    /// `false`: never a second round, but tokens taken from different majorities may go
    /// backwards; do not fence with them.
    pub fn fencing(mut self, fencing: bool) -> Self {
        self.fencing = fencing;
        self
    }

    /// How long a node refuses grants after it (re)started: it may have lost locks (an
    /// empty restart, or a snapshot older than the last grants). Must be at least the
    /// longest lease any client uses on these nodes; by default each request's own ttl.
    /// Zero turns the check off (then restart nodes only after the longest lease, or run
    /// them with `appendfsync always`).
    pub fn quarantine(mut self, quarantine: Duration) -> Self {
        self.quarantine = Some(quarantine);
        self
    }
}

/// Splits `redlock://[auth@]h1:p1,h2:p2[/db][?params]` into node URLs and options.
pub(crate) fn parse_url(url: &str) -> Result<(Vec<String>, RedlockOptions)> {
    let shown = redact_url(url);
    let invalid = |reason: String| Error::invalid("url", format!("{shown}: {reason}"));
    let Some(rest) = url.strip_prefix("redlock://") else {
        return Err(invalid("expected redlock://host:port,host:port,...".into()));
    };
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let (auth, hosts) = match authority.rsplit_once('@') {
        Some((auth, hosts)) => (format!("{auth}@"), hosts),
        None => (String::new(), authority),
    };
    let mut options = RedlockOptions::default();
    let mut scheme = "redis";
    let boolean = |name: &str, value: &str| {
        value
            .parse::<bool>()
            .map_err(|_| invalid(format!("{name}={value:?} is not true or false")))
    };
    for param in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = param.split_once('=').unwrap_or((param, ""));
        let Some(param) = Param::parse(key) else {
            return Err(Param::unknown(url, key));
        };
        match param {
            Param::Tls => {
                scheme = if boolean(key, value)? {
                    "rediss"
                } else {
                    "redis"
                }
            }
            Param::TlsCa | Param::TlsCert | Param::TlsKey => {
                options.redis.read_tls_param(param.name(), value)?;
            }
            Param::Prefix => options.redis = options.redis.prefix(value)?,
            Param::ConnectTimeout => {
                options.redis = options.redis.connect_timeout(parse_duration(value)?);
            }
            Param::NodeTimeout => options = options.node_timeout(parse_duration(value)?)?,
            Param::Quarantine => options = options.quarantine(parse_duration(value)?),
            Param::Fencing => options.fencing = boolean(key, value)?,
        }
    }
    let nodes: Vec<String> = hosts
        .split(',')
        .filter(|h| !h.trim().is_empty())
        .map(|h| format!("{scheme}://{auth}{}{path}", h.trim()))
        .collect();
    if nodes.is_empty() {
        return Err(invalid(
            "no nodes; list them as host:port,host:port,...".into(),
        ));
    }
    Ok((nodes, options))
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
}
