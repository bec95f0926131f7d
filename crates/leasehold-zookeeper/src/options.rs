//! Options and the URL: `zk://[user:pass@]h1:p1[,h2:p2…][/chroot][?param=value&…]`.

use std::fmt;
use std::time::Duration;

use leasehold_core::support::{check_key_prefix, redact_url};
use leasehold_core::{Error, Result, parse_duration};

/// Options of the ZooKeeper backend (also settable as URL query parameters).
#[derive(Clone, PartialEq, Eq)]
pub struct ZooKeeperOptions {
    pub(crate) prefix: String,
    pub(crate) session_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) digest: Option<(String, String)>,
}

impl fmt::Debug for ZooKeeperOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the password.
        f.debug_struct("ZooKeeperOptions")
            .field("prefix", &self.prefix)
            .field("session_timeout", &self.session_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("digest_user", &self.digest.as_ref().map(|(user, _)| user))
            .finish()
    }
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

/// The shortest and longest session timeout asked for. The server narrows it further to
/// its own bounds (2 to 20 ticks by default); the negotiated timeout is the one used.
const SESSION_TIMEOUT_RANGE: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(3_600));

impl ZooKeeperOptions {
    /// The directory of the locks under the chroot: a lock's nodes are children of
    /// `/<prefix>/<name>` (see the crate docs). 1–64 of `A-Z a-z 0-9 _ - . :`.
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

    /// The session timeout to ask the server for: how long after this client goes silent
    /// (crashed, partitioned, paused) the server ends its session and frees its locks, and
    /// so every lock's lease length. The server may narrow it to its own bounds; the
    /// negotiated timeout is used (see [`ZooKeeperBackend::session_timeout`]).
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

    /// Authenticate with ZooKeeper's `digest` scheme as `user`: the nodes this client
    /// creates are then readable and writable by that identity only (ZooKeeper's
    /// `CREATOR_ALL_ACL`), and it can use lock directories protected for it.
    pub fn digest(mut self, user: &str, password: &str) -> Self {
        self.digest = Some((user.into(), password.into()));
        self
    }
}

/// The URL's query parameters: one list, which the parser matches and the "unknown
/// parameter" message enumerates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Param {
    SessionTimeout,
    ConnectTimeout,
    Prefix,
}

impl Param {
    const ALL: [Param; 3] = [Param::SessionTimeout, Param::ConnectTimeout, Param::Prefix];

    fn key(self) -> &'static str {
        match self {
            Param::SessionTimeout => "session_timeout",
            Param::ConnectTimeout => "connect_timeout",
            Param::Prefix => "prefix",
        }
    }

    fn parse(key: &str) -> Option<Param> {
        Self::ALL.into_iter().find(|p| p.key() == key)
    }

    fn known() -> String {
        Self::ALL.map(Param::key).join(", ")
    }

    fn apply(self, options: ZooKeeperOptions, value: &str) -> Result<ZooKeeperOptions> {
        match self {
            Param::SessionTimeout => options.session_timeout(parse_duration(value)?),
            Param::ConnectTimeout => options.connect_timeout(parse_duration(value)?),
            Param::Prefix => options.prefix(value),
        }
    }
}

/// Where to connect: `host:port` of each server, and the chroot (`/a/b`) if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    pub(crate) hosts: Vec<String>,
    pub(crate) chroot: Option<String>,
}

impl Target {
    /// The connect string of the servers, without the chroot (the chroot is created if
    /// missing and entered after connecting).
    pub(crate) fn connect_string(&self) -> String {
        self.hosts.join(",")
    }
}

/// Splits `zk://[user:pass@]h1:p1[,h2:p2…][/chroot][?params]` (or `zookeeper://…`) into
/// the servers, the chroot and the options. Every message hides the password.
pub(crate) fn parse_url(url: &str) -> Result<(Target, ZooKeeperOptions)> {
    let shown = redact_url(url);
    let invalid = |reason: String| Error::invalid("url", format!("{shown}: {reason}"));
    let rest = match url.split_once("://") {
        Some((scheme, rest))
            if scheme.eq_ignore_ascii_case("zk") || scheme.eq_ignore_ascii_case("zookeeper") =>
        {
            rest
        }
        _ => {
            return Err(invalid(
                "expected zk://host:port[,host:port...][/chroot][?params]".into(),
            ));
        }
    };
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (authority, path) = match rest.find('/') {
        Some(slash) => rest.split_at(slash),
        None => (rest, ""),
    };
    let mut options = ZooKeeperOptions::default();
    let hosts = match authority.rsplit_once('@') {
        Some((auth, hosts)) => {
            let Some((user, password)) = auth.split_once(':') else {
                return Err(invalid(
                    "credentials are user:password (ZooKeeper's digest scheme)".into(),
                ));
            };
            if user.is_empty() {
                return Err(invalid("the user name is empty".into()));
            }
            options = options.digest(user, password);
            hosts
        }
        None => authority,
    };
    let mut servers = Vec::new();
    for host in hosts.split(',').map(str::trim).filter(|h| !h.is_empty()) {
        let port = host
            .rsplit_once(':')
            .filter(|(name, _)| !name.is_empty())
            .and_then(|(_, port)| port.parse::<u16>().ok())
            .filter(|port| *port != 0);
        if port.is_none() {
            return Err(invalid(format!("{host:?} is not host:port")));
        }
        servers.push(host.to_owned());
    }
    if servers.is_empty() {
        return Err(invalid("no servers".into()));
    }
    let chroot = match path.trim_end_matches('/') {
        "" => None,
        chroot => Some(check_chroot(chroot).map_err(invalid)?),
    };
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
    Ok((
        Target {
            hosts: servers,
            chroot,
        },
        options,
    ))
}

/// A chroot as ZooKeeper accepts it: `/` then components that are not empty, `.` or `..`,
/// of printable ASCII, not under the reserved `/zookeeper`.
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
        assert_eq!(options.digest, Some(("app".into(), "pw".into())));
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
}
