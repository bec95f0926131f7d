//! The backend's options, and the URL that sets them.

use std::time::Duration;

use leasehold_core::support::{TlsFiles, check_key_prefix, redact_url};
use leasehold_core::{Error, Result, parse_duration};

/// Options of the etcd backend (also settable as URL query parameters).
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdOptions {
    pub(crate) prefix: String,
    pub(crate) session_ttl: Duration,
    pub(crate) drift_margin: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) user: Option<(String, String)>,
    pub(crate) tls: TlsFiles,
}

impl std::fmt::Debug for EtcdOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        f.debug_struct("EtcdOptions")
            .field("prefix", &self.prefix)
            .field("session_ttl", &self.session_ttl)
            .field("drift_margin", &self.drift_margin)
            .field("connect_timeout", &self.connect_timeout)
            .field("user", &self.user.as_ref().map(|(user, _)| user))
            .field("tls", &self.tls)
            .finish()
    }
}

impl Default for EtcdOptions {
    /// No prefix (lock `N` is etcd's lock `N`), a 10 s session with a drift allowance of
    /// 1 % + 2 ms, 5 s to connect, the system's CA certificates for TLS.
    fn default() -> Self {
        Self {
            prefix: String::new(),
            session_ttl: Duration::from_secs(10),
            drift_margin: Duration::from_millis(2),
            connect_timeout: Duration::from_secs(5),
            user: None,
            tls: TlsFiles::default(),
        }
    }
}

impl EtcdOptions {
    /// The key prefix: the keys of lock `N` live under `<prefix>/N/` (and `<prefix>/N#…`),
    /// so leasehold's lock `N` is etcd's lock `<prefix>/N` (`etcdctl lock <prefix>/N`, a Go
    /// `concurrency.NewMutex(session, "<prefix>/N")`). Without a prefix (the default) it is
    /// etcd's lock `N`. One or more segments of 1–64 of `A-Z a-z 0-9 _ - . :`, separated by
    /// `/`, with an optional leading `/` (as in `/locks`): at most 200 bytes.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for other prefixes (an empty one, an empty segment, a
    /// trailing `/`).
    pub fn prefix(mut self, prefix: &str) -> Result<Self> {
        let segments = prefix.strip_prefix('/').unwrap_or(prefix);
        if prefix.len() > 200 {
            return Err(Error::invalid(
                "key prefix",
                format!("{} bytes; the limit is 200", prefix.len()),
            ));
        }
        for segment in segments.split('/') {
            check_key_prefix(segment).map_err(|_| {
                Error::invalid(
                    "key prefix",
                    format!(
                        "{prefix:?}: every segment between '/' is 1-64 of A-Z a-z 0-9 _ - . : \
                         (leave the prefix out for none)"
                    ),
                )
            })?;
        }
        self.prefix = prefix.into();
        Ok(self)
    }

    /// The session lease's ttl: how long after the client stops keeping it alive (it
    /// crashed, it is partitioned) its locks are freed, and how soon a guard learns that
    /// the session is gone. It is every grant's lease: a lock cannot ask for another ttl.
    /// etcd leases are whole seconds: a fraction is rounded up. A cluster whose minimum
    /// lease ttl is longer refuses to start the session (the first acquisition fails with
    /// [`Error::InvalidArgument`]) rather than silently holding locks longer.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for less than 1 s or more than a day.
    pub fn session_ttl(mut self, ttl: Duration) -> Result<Self> {
        if ttl < Duration::from_secs(1) || ttl > Duration::from_secs(86_400) {
            return Err(Error::invalid(
                "session ttl",
                format!("{ttl:?} is not between 1 s and 1 day (etcd leases are whole seconds)"),
            ));
        }
        self.session_ttl = ttl;
        Ok(self)
    }

    /// The fixed part of the session's drift allowance: a guard counts on its session until
    /// the last acknowledged keep-alive's send time + ttl − (1 % of the ttl + this margin),
    /// and is lost then, before etcd can expire the lease (which it does no earlier than
    /// the ttl after receiving that keep-alive). The default, 2 ms, suits a client whose
    /// clock runs true; give more for a client that may be descheduled for a while right
    /// when its loss is due. At most half the session ttl (checked on connecting).
    pub fn drift_margin(mut self, margin: Duration) -> Self {
        self.drift_margin = margin;
        self
    }

    /// The session ttl rounded up to whole seconds, as etcd grants it.
    pub(crate) fn granted_ttl(&self) -> Duration {
        let asked = self.session_ttl;
        Duration::from_secs(asked.as_secs() + u64::from(asked.subsec_nanos() > 0))
    }

    /// Checks what the options say together.
    pub(crate) fn check(&self) -> Result<()> {
        let ttl = self.granted_ttl();
        if crate::session::validity(ttl, self.drift_margin) < ttl / 2 {
            return Err(Error::invalid(
                "drift margin",
                format!(
                    "{:?} leaves less than half of the {ttl:?} session ttl",
                    self.drift_margin
                ),
            ));
        }
        Ok(())
    }

    /// How long connecting may take.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Authenticate as `user`.
    pub fn user(mut self, user: &str, password: &str) -> Self {
        self.user = Some((user.into(), password.into()));
        self
    }

    /// For TLS (`https://` endpoints): the CA certificates to trust instead of the
    /// system's, and a client certificate for members that ask for one
    /// (`--client-cert-auth`).
    pub fn tls(mut self, files: TlsFiles) -> Self {
        self.tls = files;
        self
    }
}

/// A URL query parameter: every one the URL accepts, so that parsing, the list in the
/// "unknown parameter" message and the docs come from this one list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Param {
    Prefix,
    SessionTtl,
    DriftMargin,
    ConnectTimeout,
    TlsCa,
    TlsCert,
    TlsKey,
}

impl Param {
    const ALL: [Param; 7] = [
        Param::Prefix,
        Param::SessionTtl,
        Param::DriftMargin,
        Param::ConnectTimeout,
        Param::TlsCa,
        Param::TlsCert,
        Param::TlsKey,
    ];

    /// The parameter's name in a URL.
    fn as_str(self) -> &'static str {
        match self {
            Param::Prefix => "prefix",
            Param::SessionTtl => "session_ttl",
            Param::DriftMargin => "drift_margin",
            Param::ConnectTimeout => "connect_timeout",
            Param::TlsCa => "tls_ca",
            Param::TlsCert => "tls_cert",
            Param::TlsKey => "tls_key",
        }
    }

    fn parse(name: &str) -> Option<Param> {
        Self::ALL.into_iter().find(|p| p.as_str() == name)
    }

    /// "prefix, session_ttl, …": every name, for messages.
    fn known() -> String {
        Self::ALL.map(Param::as_str).join(", ")
    }

    /// Sets the parameter's option from its URL value.
    fn apply(self, options: EtcdOptions, value: &str) -> Result<EtcdOptions> {
        Ok(match self {
            Param::Prefix => options.prefix(value)?,
            Param::SessionTtl => options.session_ttl(parse_duration(value)?)?,
            Param::DriftMargin => options.drift_margin(parse_duration(value)?),
            Param::ConnectTimeout => options.connect_timeout(parse_duration(value)?),
            Param::TlsCa | Param::TlsCert | Param::TlsKey => {
                let mut options = options;
                options.tls.read_param(self.as_str(), value)?;
                options
            }
        })
    }
}

/// Splits `etcd://[user:pass@]h1:p1,h2:p2[?params]` into endpoints and options.
pub(crate) fn parse_url(url: &str) -> Result<(Vec<String>, EtcdOptions)> {
    let shown = redact_url(url);
    let invalid = |reason: String| Error::invalid("url", format!("{shown}: {reason}"));
    let (rest, scheme) = match url.split_once("://") {
        Some((etcd, rest)) if etcd.eq_ignore_ascii_case("etcd") => (rest, "http"),
        Some((etcds, rest)) if etcds.eq_ignore_ascii_case("etcds") => (rest, "https"),
        _ => {
            return Err(invalid(
                "expected etcd://host:port[,host:port...] or etcds://… (TLS)".into(),
            ));
        }
    };
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let rest = rest.trim_end_matches('/');
    if rest.contains('/') {
        return Err(invalid(
            "a path is not used; give the prefix as ?prefix=P".into(),
        ));
    }
    let mut options = EtcdOptions::default();
    let hosts = match rest.rsplit_once('@') {
        Some((auth, hosts)) => {
            let (user, password) = auth.split_once(':').unwrap_or((auth, ""));
            options = options.user(user, password);
            hosts
        }
        None => rest,
    };
    let endpoints: Vec<String> = hosts
        .split(',')
        .filter(|h| !h.trim().is_empty())
        .map(|h| format!("{scheme}://{}", h.trim()))
        .collect();
    if endpoints.is_empty() {
        return Err(invalid("no endpoints".into()));
    }
    for param in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = param.split_once('=').unwrap_or((param, ""));
        let Some(param) = Param::parse(key) else {
            return Err(invalid(format!(
                "unknown parameter {key:?}; known: {}",
                Param::known()
            )));
        };
        options = param.apply(options, value)?;
    }
    options.tls.check(scheme == "https", "etcds")?;
    options.check()?;
    Ok((endpoints, options))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_give_endpoints_and_options() {
        let (endpoints, options) = parse_url(
            "etcd://u:pw@h1:2379,h2:2379?prefix=app&session_ttl=1500ms&drift_margin=0.5s",
        )
        .unwrap();
        assert_eq!(endpoints, ["http://h1:2379", "http://h2:2379"]);
        assert_eq!(options.prefix, "app");
        assert_eq!(options.session_ttl, Duration::from_millis(1500));
        assert_eq!(options.granted_ttl(), Duration::from_secs(2));
        assert_eq!(options.drift_margin, Duration::from_millis(500));
        assert_eq!(
            parse_url("etcd://h:1").unwrap().1.prefix,
            "",
            "no prefix by default"
        );
        for prefix in ["/locks", "team.a/locks:v2", "a"] {
            let url = format!("etcd://h:1?prefix={prefix}");
            assert_eq!(parse_url(&url).unwrap().1.prefix, prefix);
        }
        assert_eq!(options.user, Some(("u".into(), "pw".into())));
        for bad in [
            "etcd://",
            "etcd://h:1?nosuch=1",
            "etcd://h:1?session_ttl=500ms",
            "etcd://h:1?prefix=",
            "etcd://h:1?prefix=a/",
            "etcd://h:1?prefix=a//b",
            "etcd://h:1?prefix=a#b",
            "etcd://h:1?session_ttl=2s&drift_margin=1s",
            "etcd://h:1/path",
            "http://h:1",
        ] {
            assert!(
                matches!(parse_url(bad), Err(Error::InvalidArgument { .. })),
                "{bad}"
            );
        }
        assert!(
            !parse_url("etcd://u:hunter2@h:1?x=1")
                .unwrap_err()
                .to_string()
                .contains("hunter2")
        );
        assert!(!format!("{options:?}").contains("pw"), "{options:?}");
        let (endpoints, options) = parse_url("etcds://h1:2379,h2:2379").unwrap();
        assert_eq!(endpoints, ["https://h1:2379", "https://h2:2379"]);
        assert!(options.tls.is_empty(), "the system's CA certificates");
        let ca = std::env::temp_dir().join(format!("leasehold-etcd-ca-{}", std::process::id()));
        std::fs::write(&ca, "CA").unwrap();
        let (_, options) = parse_url(&format!("etcds://h:1?tls_ca={}", ca.display())).unwrap();
        assert_eq!(options.tls.ca.as_deref(), Some(&b"CA"[..]));
        let plain = parse_url(&format!("etcd://h:1?tls_ca={}", ca.display())).unwrap_err();
        assert!(plain.to_string().contains("etcds://"), "{plain}");
        std::fs::remove_file(&ca).unwrap();
    }

    #[test]
    fn the_unknown_parameter_message_lists_every_parameter() {
        let message = parse_url("etcd://h:1?nosuch=1").unwrap_err().to_string();
        for param in Param::ALL {
            assert!(message.contains(param.as_str()), "{message}");
            assert_eq!(Param::parse(param.as_str()), Some(param));
        }
        // The TLS parameters are the ones the shared TLS reader knows.
        let tls: Vec<&str> = TlsFiles::PARAMS.split(", ").collect();
        assert_eq!(tls, ["tls_ca", "tls_cert", "tls_key"]);
        assert!(tls.iter().all(|p| Param::parse(p).is_some()));
    }
}
