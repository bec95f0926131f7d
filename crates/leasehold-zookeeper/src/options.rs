//! Options and the URL: `zk://[user:pass@]h1:p1[,h2:p2…][/chroot][?param=value&…]`.

use std::time::Duration;

use leasehold_core::support::url::{ParsedUrl, UrlParam, url_params};
use leasehold_core::support::{Secret, check_key_prefix};
use leasehold_core::{ConnectOptions, Error, Result};

/// Options of the ZooKeeper backend (also settable as URL query parameters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZooKeeperOptions {
    pub(crate) prefix: String,
    pub(crate) session_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) digest: Option<(String, Secret)>,
}

impl Default for ZooKeeperOptions {
    /// Prefix `leasehold`, a 10 s session timeout, 5 s to connect, no credentials.
    fn default() -> Self {
        Self {
            prefix: "leasehold".into(),
            session_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            digest: None,
        }
    }
}

/// The shortest and longest session timeout asked for.
/// The server narrows it further to its own bounds (2 to 20 ticks by default); the
/// negotiated timeout is the one used.
const SESSION_TIMEOUT_RANGE: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(3_600));

impl ZooKeeperOptions {
    /// The directory of the locks under the chroot: 1–64 of `A-Z a-z 0-9 _ - . :`.
    /// A lock's nodes are children of `/<prefix>/<name>` (see the crate docs).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for other prefixes.
    pub fn prefix(mut self, prefix: &str) -> Result<Self> {
        check_key_prefix(prefix)?;
        if prefix == "." || prefix == ".." || prefix == "zookeeper" {
            return Err(Error::invalid(
                "key prefix",
                format!("{prefix:?} is reserved in ZooKeeper paths"),
            ));
        }
        self.prefix = prefix.into();
        Ok(self)
    }

    /// The session timeout to ask the server for, and so every lock's lease length.
    /// It is how long after this client goes silent (crashed, partitioned, paused) the
    /// server ends its session and frees its locks. The server may narrow it to its own
    /// bounds; the negotiated timeout is used (see [`ZooKeeperBackend::session_timeout`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] outside 100 ms to 1 h.
    ///
    /// [`ZooKeeperBackend::session_timeout`]: crate::ZooKeeperBackend::session_timeout
    pub fn session_timeout(mut self, timeout: Duration) -> Result<Self> {
        let (min, max) = SESSION_TIMEOUT_RANGE;
        if timeout < min || timeout > max {
            return Err(Error::invalid(
                "session timeout",
                format!("{timeout:?} is not between {min:?} and {max:?}"),
            ));
        }
        self.session_timeout = timeout;
        Ok(self)
    }

    /// How long establishing a session may take.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for zero.
    pub fn connect_timeout(mut self, timeout: Duration) -> Result<Self> {
        if timeout.is_zero() {
            return Err(Error::invalid("connect timeout", "zero"));
        }
        self.connect_timeout = timeout;
        Ok(self)
    }

    /// Authenticate with ZooKeeper's `digest` scheme as `user`.
    /// The nodes this client creates are then readable and writable by that identity only
    /// (ZooKeeper's `CREATOR_ALL_ACL`), and it can use lock directories protected for it.
    pub fn digest(mut self, user: &str, password: &str) -> Self {
        self.digest = Some((user.into(), Secret::new(password)));
        self
    }
}

url_params! {
    /// The URL parameters of `zk://`, each setting the option of its name.
    enum Param {
        SessionTimeout = "session_timeout",
        ConnectTimeout = "connect_timeout",
        Prefix = "prefix",
    }
}

/// Where to connect: `host:port` of each server, and the chroot (`/a/b`) if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    pub(crate) hosts: Vec<String>,
    pub(crate) chroot: Option<String>,
}

impl Target {
    /// The connect string of the servers, without the chroot.
    /// The chroot is created if missing and entered after connecting.
    pub(crate) fn connect_string(&self) -> String {
        self.hosts.join(",")
    }
}

/// Splits a `zk://` or `zookeeper://` URL into the servers, the chroot and the options.
/// The URL is `zk://[user:pass@]h1:p1[,h2:p2…][/chroot][?params]`; the options take the
/// session timeout `connect` asks for. Every message hides the password.
pub(crate) fn parse_url(url: &str, connect: &ConnectOptions) -> Result<(Target, ZooKeeperOptions)> {
    let url = ParsedUrl::parse(
        url,
        &["zk", "zookeeper"],
        "zk://host:port[,host:port...][/chroot][?params]",
    )?;
    let mut options = ZooKeeperOptions::default();
    match (url.user.as_deref(), url.password.as_deref()) {
        (None, _) => {}
        (Some(_), None) => {
            return Err(url.invalid("credentials are user:password (ZooKeeper's digest scheme)"));
        }
        (Some(""), Some(_)) => return Err(url.invalid("the user name is empty")),
        (Some(user), Some(password)) => options = options.digest(user, password),
    }
    let mut hosts = Vec::new();
    for host in url.hosts(1..)? {
        if host.port.is_none() {
            return Err(url.invalid(format!("{:?} is not host:port", host.to_string())));
        }
        hosts.push(host.to_string());
    }
    let chroot = match url.path()?.trim_end_matches('/') {
        "" => None,
        chroot => Some(check_chroot(chroot).map_err(|reason| url.invalid(reason))?),
    };
    let mut session_timeout = None;
    for (param, value) in url.params::<Param>()? {
        match param {
            Param::SessionTimeout => session_timeout = Some(value.duration()?),
            Param::ConnectTimeout => options = options.connect_timeout(value.duration()?)?,
            Param::Prefix => options = options.prefix(value.as_str())?,
        }
    }
    if let Some(timeout) = connect.session_ttl_for(Param::SessionTimeout.name(), session_timeout)? {
        options = options.session_timeout(timeout)?;
    }
    Ok((Target { hosts, chroot }, options))
}

/// A chroot as ZooKeeper accepts it, not under the reserved `/zookeeper`.
/// It is `/` followed by components that are not empty, `.` or `..`, of printable ASCII.
fn check_chroot(chroot: &str) -> std::result::Result<String, String> {
    let components: Vec<&str> = chroot.split('/').skip(1).collect();
    let bad = components.iter().find(|c| {
        c.is_empty()
            || **c == "."
            || **c == ".."
            || !c.chars().all(|ch| ch.is_ascii_graphic() && ch != '?')
    });
    if let Some(bad) = bad {
        return Err(format!(
            "the chroot {chroot:?} has an invalid component {bad:?}"
        ));
    }
    if components.first() == Some(&"zookeeper") {
        return Err(format!(
            "the chroot {chroot:?} is under the reserved /zookeeper"
        ));
    }
    Ok(chroot.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_url(url: &str) -> Result<(Target, ZooKeeperOptions)> {
        super::parse_url(url, &ConnectOptions::default())
    }

    #[test]
    fn urls_give_servers_chroot_and_options() {
        let (target, options) = parse_url(
            "zk://app:pw@h1:2181,h2:2182/apps/locks?session_timeout=1500ms&prefix=lh&connect_timeout=2s",
        )
        .unwrap();
        assert_eq!(target.hosts, ["h1:2181", "h2:2182"]);
        assert_eq!(target.connect_string(), "h1:2181,h2:2182");
        assert_eq!(target.chroot.as_deref(), Some("/apps/locks"));
        assert_eq!(options.session_timeout, Duration::from_millis(1500));
        assert_eq!(options.connect_timeout, Duration::from_secs(2));
        assert_eq!(options.prefix, "lh");
        assert_eq!(options.digest, Some(("app".into(), Secret::new("pw"))));
        let (target, options) = parse_url("zookeeper://127.0.0.1:2181/").unwrap();
        assert_eq!(target.chroot, None);
        assert_eq!(options, ZooKeeperOptions::default());
    }

    #[test]
    fn bad_urls_are_typed_errors_without_the_password() {
        for bad in [
            "zk://",
            "zk://h",
            "zk://h:0",
            "zk://h:port",
            "zk://:2181",
            "zk://h:1?nosuch=1",
            "zk://h:1?session_timeout=10",
            "zk://h:1?session_timeout=2h",
            "zk://h:1?connect_timeout=0s",
            "zk://h:1?prefix=a/b",
            "zk://h:1?prefix=zookeeper",
            "zk://h:1/a//b",
            "zk://h:1/a/../b",
            "zk://h:1/zookeeper/x",
            "zk://user@h:1",
            "etcd://h:1",
        ] {
            assert!(
                matches!(
                    parse_url(bad),
                    Err(Error::InvalidArgument { what: "url", .. })
                        | Err(Error::InvalidArgument { .. })
                ),
                "{bad}"
            );
        }
        let message = parse_url("zk://u:hunter2@h:1?x=1").unwrap_err().to_string();
        assert!(!message.contains("hunter2"), "{message}");
        assert!(
            message.contains("known: session_timeout, connect_timeout, prefix"),
            "{message}"
        );
        let (_, options) = parse_url("zk://u:hunter2@h:1").unwrap();
        assert!(!format!("{options:?}").contains("hunter2"));
    }

    #[test]
    fn credentials_are_percent_decoded_and_parameters_given_once() {
        let (_, options) = parse_url("zk://app:p%40ss@h:1").unwrap();
        assert_eq!(options.digest, Some(("app".into(), Secret::new("p@ss"))));
        let err = parse_url("zk://h:1?prefix=a&prefix=b").unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
    }

    #[test]
    fn the_session_timeout_asked_for_when_connecting_is_the_urls_or_refused() {
        let ms = Duration::from_millis;
        let timeout = |url: &str, connect: ConnectOptions| {
            super::parse_url(url, &connect).map(|(_, o)| o.session_timeout)
        };
        let asked = |ttl| ConnectOptions::default().session_ttl(ttl).unwrap();
        let default = |ttl| ConnectOptions::default().default_session_ttl(ttl).unwrap();
        assert_eq!(timeout("zk://h:1", asked(ms(2500))).unwrap(), ms(2500));
        let url = "zk://h:1?session_timeout=5s";
        assert_eq!(timeout(url, asked(ms(5000))).unwrap(), ms(5000));
        let err = timeout(url, asked(ms(2500))).unwrap_err();
        assert!(
            err.to_string().contains("session_timeout=5s and the 2.5s"),
            "{err}"
        );
        assert_eq!(timeout(url, default(ms(30_000))).unwrap(), ms(5000));
        assert_eq!(
            timeout("zk://h:1", default(ms(30_000))).unwrap(),
            ms(30_000)
        );
        assert!(
            timeout("zk://h:1", asked(ms(50))).is_err(),
            "below the 100 ms floor"
        );
    }
}
