//! The backend's options, and the URL that sets them.

use std::time::Duration;

use leasehold_core::support::url::{ParsedUrl, UrlParam, url_params};
use leasehold_core::support::{Secret, TlsFiles, check_key_prefix};
use leasehold_core::{ConnectOptions, Error, Result};

/// Options of the etcd backend (also settable as URL query parameters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdOptions {
    pub(crate) prefix: String,
    pub(crate) session_ttl: Duration,
    pub(crate) drift_margin: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) user: Option<(String, Secret)>,
    pub(crate) tls: TlsFiles,
}

impl Default for EtcdOptions {
    /// No prefix, a 10 s session, 5 s to connect, the system's CA certificates for TLS.
    /// Without a prefix, lock `N` is etcd's lock `N`; the session's drift allowance is
    /// 1 % + 2 ms.
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
    /// The key prefix: leasehold's lock `N` is then etcd's lock `<prefix>/N`.
    /// That is the lock of `etcdctl lock <prefix>/N` and of a Go
    /// `concurrency.NewMutex(session, "<prefix>/N")`, since the keys of lock `N` live under
    /// `<prefix>/N/` (and `<prefix>/N#…`). Without a prefix (the default) it is etcd's lock
    /// `N`. One or more segments of 1–64 of `A-Z a-z 0-9 _ - . :`, separated by `/`, with
    /// an optional leading `/` (as in `/locks`): at most 200 bytes.
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

    /// The session lease's ttl, every grant's lease (a lock cannot ask for another ttl).
    /// It says how long after the client stops keeping the lease alive (it crashed, it is
    /// partitioned) its locks are freed, and how soon a guard learns that the session is
    /// gone. etcd leases are whole seconds: a fraction is rounded up. A cluster whose
    /// minimum lease ttl is longer refuses to start the session (the first acquisition
    /// fails with [`Error::InvalidArgument`]) rather than silently holding locks longer.
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

    /// The fixed part of the session's drift allowance, on top of 1 % of the ttl.
    /// A guard counts on its session until the last acknowledged keep-alive's send time +
    /// ttl − (1 % of the ttl + this margin), and is lost then, before etcd can expire the
    /// lease (which it does no earlier than the ttl after receiving that keep-alive). The
    /// default, 2 ms, suits a client whose clock runs true; give more for a client that may
    /// be descheduled for a while right when its loss is due. At most half the session ttl
    /// (checked on connecting).
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
        self.user = Some((user.into(), Secret::new(password)));
        self
    }

    /// The CA certificates and client certificate for TLS (`https://` endpoints).
    /// The CA certificates are trusted instead of the system's; the client certificate is
    /// shown to members that ask for one (`--client-cert-auth`).
    pub fn tls(mut self, files: TlsFiles) -> Self {
        self.tls = files;
        self
    }
}

url_params! {
    /// The URL parameters of `etcd://` and `etcds://`, each setting the option of its name.
    enum Param {
        Prefix = "prefix",
        SessionTtl = "session_ttl",
        DriftMargin = "drift_margin",
        ConnectTimeout = "connect_timeout",
        TlsCa = "tls_ca",
        TlsCert = "tls_cert",
        TlsKey = "tls_key",
    }
}

/// Splits `etcd://[user:pass@]h1:p1,h2:p2[?params]` into endpoints and options.
/// The options take the session ttl `connect` asks for.
pub(crate) fn parse_url(url: &str, connect: &ConnectOptions) -> Result<(Vec<String>, EtcdOptions)> {
    let url = ParsedUrl::parse(
        url,
        &["etcd", "etcds"],
        "etcd://host:port[,host:port...] or etcds://… (TLS)",
    )?;
    let tls = url.scheme == "etcds";
    let scheme = if tls { "https" } else { "http" };
    let endpoints = url
        .hosts(1..)?
        .iter()
        .map(|host| format!("{scheme}://{host}"));
    if !url.path()?.trim_end_matches('/').is_empty() {
        return Err(url.invalid("a path is not used; give the prefix as ?prefix=P"));
    }
    let mut options = EtcdOptions::default();
    if let Some(user) = url.user.as_deref() {
        options = options.user(user, url.password.as_deref().unwrap_or(""));
    }
    let mut session_ttl = None;
    for (param, value) in url.params::<Param>()? {
        match param {
            Param::Prefix => options = options.prefix(value.as_str())?,
            Param::SessionTtl => {
                let ttl = value.duration()?;
                options = options.session_ttl(ttl)?;
                session_ttl = Some(ttl);
            }
            Param::DriftMargin => options = options.drift_margin(value.duration()?),
            Param::ConnectTimeout => options = options.connect_timeout(value.duration()?),
            Param::TlsCa | Param::TlsCert | Param::TlsKey => {
                options.tls.read_param(param.name(), value.as_str())?;
            }
        }
    }
    if let Some(ttl) = connect.session_ttl_for(Param::SessionTtl.name(), session_ttl)? {
        // Asked for when connecting, less than a second is rounded up like any fraction.
        options = options.session_ttl(ttl.max(Duration::from_secs(1)))?;
    }
    options.tls.check(tls, "etcds")?;
    options.check()?;
    Ok((endpoints.collect(), options))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_url(url: &str) -> Result<(Vec<String>, EtcdOptions)> {
        super::parse_url(url, &ConnectOptions::default())
    }

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
        assert_eq!(options.user, Some(("u".into(), Secret::new("pw"))));
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
            assert!(message.contains(param.name()), "{message}");
            assert_eq!(Param::from_name(param.name()), Some(*param));
        }
        // The TLS parameters are the ones the shared TLS reader knows.
        let tls: Vec<&str> = TlsFiles::PARAMS.split(", ").collect();
        assert_eq!(tls, ["tls_ca", "tls_cert", "tls_key"]);
        assert!(tls.iter().all(|p| Param::from_name(p).is_some()));
    }

    #[test]
    fn credentials_and_values_are_percent_decoded() {
        let (_, options) = parse_url("etcd://app:p%40ss%2Fw@h:1?prefix=a%3Ab").unwrap();
        assert_eq!(options.user, Some(("app".into(), Secret::new("p@ss/w"))));
        assert_eq!(options.prefix, "a:b");
    }

    #[test]
    fn a_parameter_given_twice_is_refused() {
        let err = parse_url("etcd://h:1?session_ttl=2s&session_ttl=5s").unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
    }

    #[test]
    fn the_session_ttl_asked_for_when_connecting_is_the_urls_or_refused() {
        let secs = Duration::from_secs;
        let ttl = |url: &str, connect: ConnectOptions| {
            super::parse_url(url, &connect).map(|(_, o)| o.granted_ttl())
        };
        let asked = |ttl| ConnectOptions::default().session_ttl(ttl).unwrap();
        let default = |ttl| ConnectOptions::default().default_session_ttl(ttl).unwrap();
        assert_eq!(ttl("etcd://h:1", asked(secs(3))).unwrap(), secs(3));
        assert_eq!(
            ttl("etcd://h:1?session_ttl=3s", asked(secs(3))).unwrap(),
            secs(3)
        );
        let err = ttl("etcd://h:1?session_ttl=5s", asked(secs(3))).unwrap_err();
        assert!(
            err.to_string().contains("session_ttl=5s and the 3s"),
            "{err}"
        );
        assert_eq!(
            ttl("etcd://h:1?session_ttl=5s", default(secs(30))).unwrap(),
            secs(5)
        );
        assert_eq!(ttl("etcd://h:1", default(secs(30))).unwrap(), secs(30));
        assert_eq!(
            ttl("etcd://h:1", ConnectOptions::default()).unwrap(),
            secs(10)
        );
        // etcd leases are whole seconds: what is asked for is rounded up.
        assert_eq!(
            ttl("etcd://h:1", asked(Duration::from_millis(1500))).unwrap(),
            secs(2)
        );
        assert_eq!(
            ttl("etcd://h:1", asked(Duration::from_millis(500))).unwrap(),
            secs(1)
        );
        assert!(ttl("etcd://h:1", asked(secs(2 * 86_400))).is_err());
    }
}
