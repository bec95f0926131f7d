//! Options of the Redis backend, and the URL parameters that set them.

use std::time::Duration;

use leasehold_core::support::TlsFiles;
use leasehold_core::support::url::{ParsedUrl, UrlParam, url_params};
use leasehold_core::{Error, Result};

use crate::cluster::CLUSTER_SCHEMES;
use crate::sentinel::SENTINEL_SCHEME;

url_params! {
    /// The URL parameters of every Redis URL (plain, TLS, Sentinel, Cluster).
    /// Each sets the option it names.
    /// `replicas`, `replica_timeout` and `replicas_required` set a [`ReplicaAck`].
    pub(crate) enum Param {
        Prefix = "prefix",
        Replicas = "replicas",
        ReplicaTimeout = "replica_timeout",
        ReplicasRequired = "replicas_required",
        ConnectTimeout = "connect_timeout",
        TlsCa = "tls_ca",
        TlsCert = "tls_cert",
        TlsKey = "tls_key",
    }
}

/// Waiting for replicas to acknowledge each grant (`WAIT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplicaAck {
    /// How many replicas must acknowledge.
    pub replicas: u32,
    /// How long to wait for them.
    pub timeout: Duration,
    /// Whether a grant not acknowledged in time is given back.
    /// `true`: it is released and the acquire fails with a retryable error. `false`: it is
    /// kept and a warning is logged.
    pub required: bool,
}

impl ReplicaAck {
    /// `replicas` must acknowledge each grant within `timeout`.
    /// `required` says whether a grant that is not acknowledged in time is given back (see
    /// the fields).
    pub fn new(replicas: u32, timeout: Duration, required: bool) -> Self {
        Self {
            replicas,
            timeout,
            required,
        }
    }
}

/// Options of the Redis backend (also settable as URL query parameters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisOptions {
    prefix: String,
    replicas: Option<ReplicaAck>,
    connect_timeout: Duration,
    tls: TlsFiles,
}

impl Default for RedisOptions {
    /// Prefix `leasehold`, no replica acknowledgement, 5 s connect timeout.
    /// For `rediss://`, the system's CA certificates.
    fn default() -> Self {
        Self {
            prefix: "leasehold".into(),
            replicas: None,
            connect_timeout: Duration::from_secs(5),
            tls: TlsFiles::default(),
        }
    }
}

impl RedisOptions {
    /// The key prefix: keys are `<prefix>:{<name>}:<part>`. 1–64 of `A-Z a-z 0-9 _ - . :`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for other prefixes.
    pub fn prefix(mut self, prefix: &str) -> Result<Self> {
        leasehold_core::support::check_key_prefix(prefix)?;
        self.prefix = prefix.into();
        Ok(self)
    }

    /// `WAIT` for replicas after every grant.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for zero replicas or a zero or over-long timeout.
    pub fn replicas(mut self, ack: ReplicaAck) -> Result<Self> {
        if ack.replicas == 0 {
            return Err(Error::invalid(
                "replicas",
                "at least one replica must acknowledge",
            ));
        }
        if ack.timeout.is_zero() || ack.timeout > Duration::from_secs(3600) {
            return Err(Error::invalid(
                "replica timeout",
                format!("{:?} is not between 1 ms and 1 h", ack.timeout),
            ));
        }
        self.replicas = Some(ack);
        Ok(self)
    }

    /// How long connecting may take, all of it together.
    /// Connecting opens the connection, loads the scripts and reads the server's
    /// configuration.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// For `rediss://`: trust the CA certificates in `pem` instead of the system's.
    pub fn tls_ca(mut self, pem: Vec<u8>) -> Self {
        self.tls.ca = Some(pem);
        self
    }

    /// For `rediss://`: a client certificate (PEM) and key (PEM) for servers that ask.
    /// Servers ask for one with `tls-auth-clients yes`.
    pub fn tls_client(mut self, certificate: Vec<u8>, key: Vec<u8>) -> Self {
        self.tls.client = Some((certificate, key));
        self
    }

    pub(crate) fn key_prefix(&self) -> &str {
        &self.prefix
    }

    pub(crate) fn replica_ack(&self) -> Option<ReplicaAck> {
        self.replicas
    }

    pub(crate) fn connect_limit(&self) -> Duration {
        self.connect_timeout
    }

    pub(crate) fn tls_files(&self) -> &TlsFiles {
        &self.tls
    }

    /// Reads the TLS file of `param` (one of the `tls_*` parameters).
    pub(crate) fn read_tls_param(&mut self, param: &str, path: &str) -> Result<()> {
        self.tls.read_param(param, path).map(|_| ())
    }

    /// Checks the TLS settings against the scheme of `url`; whether it is TLS.
    pub(crate) fn check_tls(&self, url: &str) -> Result<bool> {
        let tls = url.to_ascii_lowercase().starts_with("rediss://");
        self.tls.check(tls, "rediss")?;
        Ok(tls)
    }
}

/// Splits leasehold's query parameters off a redis URL.
/// The base is the URL without parameters: `redis://…`, `rediss://…`,
/// `redis+sentinel://…`, `redis+cluster://…` or `rediss+cluster://…` (see
/// [`Address`](crate::link::Address)).
pub(crate) fn parse_url(url: &str) -> Result<(String, RedisOptions)> {
    let url = ParsedUrl::parse(
        url,
        &[
            "redis",
            "rediss",
            SENTINEL_SCHEME,
            CLUSTER_SCHEMES[0],
            CLUSTER_SCHEMES[1],
        ],
        "redis://host:port, rediss://host:port, redis+sentinel://host:port,…/master \
         or redis+cluster://host:port,…",
    )?;
    let many = url.scheme == SENTINEL_SCHEME || CLUSTER_SCHEMES.contains(&url.scheme.as_str());
    let base = if many {
        let hosts: Vec<String> = url.hosts(1..)?.iter().map(ToString::to_string).collect();
        url.with_address(&url.scheme, &hosts.join(","), &url.path()?)
    } else {
        url.with_host(&url.scheme, &url.hosts(1..=1)?[0])
    };
    let mut options = RedisOptions::default();
    let mut ack = ReplicaAck::new(0, Duration::from_millis(100), true);
    for (param, value) in url.params::<Param>()? {
        match param {
            Param::Prefix => options = options.prefix(value.as_str())?,
            Param::Replicas => ack.replicas = value.number()?,
            Param::ReplicaTimeout => ack.timeout = value.duration()?,
            Param::ReplicasRequired => ack.required = value.boolean()?,
            Param::ConnectTimeout => options = options.connect_timeout(value.duration()?),
            Param::TlsCa | Param::TlsCert | Param::TlsKey => {
                options.read_tls_param(param.name(), value.as_str())?;
            }
        }
    }
    if ack.replicas > 0 {
        options = options.replicas(ack)?;
    }
    if url.scheme == SENTINEL_SCHEME && !options.tls.is_empty() {
        return Err(url.invalid("TLS through Sentinel is not supported yet"));
    }
    Ok((base, options))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_parameters_are_parsed_and_checked() {
        let (base, options) =
            parse_url("redis://u:pw@h:1/2?prefix=app&replicas=1&replica_timeout=50ms").unwrap();
        assert_eq!(base, "redis://u:pw@h:1/2");
        assert_eq!(options.prefix, "app");
        assert_eq!(
            options.replicas,
            Some(ReplicaAck::new(1, Duration::from_millis(50), true))
        );
        for bad in [
            "redis://h:1?nosuch=1",
            "redis://h:1?prefix=a{b}",
            "redis://h:1?replicas=x",
            "redis://h:1?replica_timeout=5",
            "http://h:1",
        ] {
            let err = parse_url(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument { .. }), "{bad}: {err}");
        }
        let (base, options) =
            parse_url("redis+sentinel://u:pw@h1:1,h2:2/main/3?prefix=app&replicas=1").unwrap();
        assert_eq!(base, "redis+sentinel://u:pw@h1:1,h2:2/main/3");
        assert_eq!(options.prefix, "app");
        assert_eq!(options.replicas.map(|ack| ack.replicas), Some(1));
        let err = parse_url("redis+sentinel://h:1/m?tls_ca=/dev/null").unwrap_err();
        assert!(err.to_string().contains("TLS through Sentinel"), "{err}");
        let err = parse_url("redis://u:hunter2@h:1?nosuch=1").unwrap_err();
        assert!(!err.to_string().contains("hunter2"));
        // TLS files are read while parsing (see `TlsFiles`), and only go with rediss://.
        let (base, options) = parse_url("rediss://h:1").unwrap();
        assert_eq!(
            (base.as_str(), options.tls.is_empty()),
            ("rediss://h:1", true)
        );
        let err = parse_url("rediss://h:1?tls_ca=/no/such/ca.pem").unwrap_err();
        assert!(err.to_string().contains("/no/such/ca.pem"), "{err}");
        let ca = std::env::temp_dir().join(format!("leasehold-redis-ca-{}", std::process::id()));
        std::fs::write(&ca, "CA").unwrap();
        let (_, options) = parse_url(&format!("rediss://h:1?tls_ca={}", ca.display())).unwrap();
        assert_eq!(options.tls.ca.as_deref(), Some(&b"CA"[..]));
        assert!(options.check_tls("rediss://h:1").unwrap());
        assert!(
            options.check_tls("redis://h:1").is_err(),
            "TLS files on a plain URL"
        );
        std::fs::remove_file(&ca).unwrap();
    }

    #[test]
    fn the_unknown_parameter_message_lists_every_parameter() {
        let err = parse_url("redis://h:1?nosuch=1").unwrap_err().to_string();
        assert!(err.contains("unknown parameter \"nosuch\""), "{err}");
        for param in Param::ALL {
            assert_eq!(Param::from_name(param.name()), Some(*param));
            assert!(err.contains(param.name()), "{err} does not list {param:?}");
        }
        // Every parameter is read: none is listed but refused.
        for param in Param::ALL {
            let value = match param {
                Param::Prefix => "p",
                Param::Replicas => "1",
                Param::ReplicaTimeout | Param::ConnectTimeout => "1s",
                Param::ReplicasRequired => "false",
                // Files: a missing one names itself.
                Param::TlsCa | Param::TlsCert | Param::TlsKey => "/no/such/file",
            };
            let url = format!("rediss://h:1?{}={value}", param.name());
            match parse_url(&url) {
                Ok(_) => {}
                Err(err) => assert!(err.to_string().contains("/no/such/file"), "{url}: {err}"),
            }
        }
    }

    #[test]
    fn a_parameter_given_twice_is_refused() {
        let err = parse_url("redis://h:1?prefix=a&prefix=b").unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
    }
}
