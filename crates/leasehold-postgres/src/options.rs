//! Options of the PostgreSQL backend and the URL that sets them.
//!
//! `postgres://[user[:password]@]host[:port][,host[:port]…][/dbname][?param=value&…]`
//! (also `postgresql://`). Every query parameter is one [`Param`]; an unknown one is an
//! error that lists the known ones.

use std::fmt;
use std::time::Duration;

use leasehold_core::support::{TlsFiles, redact_url};
use leasehold_core::{Error, Result, parse_duration};

/// How locks are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LockMode {
    /// A row per grant in a lease table, with an expiry on the server's clock (the default).
    #[default]
    Lease,
    /// A session-level advisory lock on a connection of its own per held lock.
    Advisory,
}

/// What sits between the client and the server, as far as session state goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pooling {
    /// Find out when connecting (see `docs/backends/postgres.md`).
    #[default]
    Auto,
    /// Nothing that hands a connection's session to another client: the server itself, a
    /// TCP proxy, or a pooler in session mode.
    Session,
    /// A pooler in transaction (or statement) mode, such as PgBouncer's
    /// `pool_mode = transaction`: no session state survives a transaction, so no LISTEN, no
    /// named prepared statements and no session advisory locks.
    Transaction,
}

/// `sslmode`, as libpq reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    /// Plain TCP.
    Disable,
    /// TLS if the server offers it, plain TCP otherwise; the certificate is not checked
    /// (libpq's default).
    #[default]
    Prefer,
    /// TLS; the certificate is not checked.
    Require,
    /// TLS; the certificate must be signed by a trusted CA.
    VerifyCa,
    /// TLS; the certificate must be signed by a trusted CA and name the host.
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Result<Self> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(Error::invalid(
                    "sslmode",
                    format!(
                        "{other:?} is not one of disable, prefer, require, verify-ca, verify-full"
                    ),
                ));
            }
        })
    }

    /// Whether the server's certificate is checked against the trusted CAs.
    pub(crate) fn verifies(self) -> bool {
        matches!(self, SslMode::VerifyCa | SslMode::VerifyFull)
    }
}

/// Every query parameter of a `postgres://` URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Param {
    Schema,
    Mode,
    Pooling,
    PoolSize,
    SessionTtl,
    ConnectTimeout,
    ApplicationName,
    TargetSessionAttrs,
    SslMode,
    TlsCa,
    TlsCert,
    TlsKey,
}

impl Param {
    const ALL: [Param; 12] = [
        Param::Schema,
        Param::Mode,
        Param::Pooling,
        Param::PoolSize,
        Param::SessionTtl,
        Param::ConnectTimeout,
        Param::ApplicationName,
        Param::TargetSessionAttrs,
        Param::SslMode,
        Param::TlsCa,
        Param::TlsCert,
        Param::TlsKey,
    ];

    fn key(self) -> &'static str {
        match self {
            Param::Schema => "schema",
            Param::Mode => "mode",
            Param::Pooling => "pooling",
            Param::PoolSize => "pool_size",
            Param::SessionTtl => "session_ttl",
            Param::ConnectTimeout => "connect_timeout",
            Param::ApplicationName => "application_name",
            Param::TargetSessionAttrs => "target_session_attrs",
            Param::SslMode => "sslmode",
            Param::TlsCa => "tls_ca",
            Param::TlsCert => "tls_cert",
            Param::TlsKey => "tls_key",
        }
    }

    fn parse(key: &str) -> Option<Param> {
        Param::ALL.into_iter().find(|p| p.key() == key)
    }

    /// "schema, mode, …": every known key, for the unknown-parameter message.
    fn known() -> String {
        Param::ALL.map(Param::key).join(", ")
    }
}

/// Options of the PostgreSQL backend (also settable as URL query parameters).
#[derive(Clone, PartialEq, Eq)]
pub struct PostgresOptions {
    pub(crate) hosts: Vec<(String, u16)>,
    pub(crate) user: String,
    pub(crate) password: Option<String>,
    pub(crate) dbname: String,
    pub(crate) schema: String,
    pub(crate) mode: LockMode,
    pub(crate) pooling: Pooling,
    pub(crate) pool_size: usize,
    pub(crate) session_ttl: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) application_name: String,
    pub(crate) read_write: bool,
    pub(crate) sslmode: SslMode,
    pub(crate) tls: TlsFiles,
}

impl fmt::Debug for PostgresOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the password.
        f.debug_struct("PostgresOptions")
            .field("hosts", &self.hosts)
            .field("user", &self.user)
            .field("dbname", &self.dbname)
            .field("schema", &self.schema)
            .field("mode", &self.mode)
            .field("pooling", &self.pooling)
            .field("pool_size", &self.pool_size)
            .field("session_ttl", &self.session_ttl)
            .field("connect_timeout", &self.connect_timeout)
            .field("application_name", &self.application_name)
            .field("read_write", &self.read_write)
            .field("sslmode", &self.sslmode)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

/// The default schema of the lock tables and functions.
pub const DEFAULT_SCHEMA: &str = "leasehold";

/// The longest schema name: its wake-up channel `<schema>.wake` must fit in an identifier.
const MAX_SCHEMA_LEN: usize = 58;

impl PostgresOptions {
    /// Options for `user` on `host:port`, database `dbname`, with the defaults: schema
    /// `leasehold`, lease mode, pooling found out on connect, 2 pooled connections, a 10 s
    /// session ttl (advisory mode), 5 s to connect, `sslmode=prefer`.
    pub fn new(host: &str, port: u16, user: &str, dbname: &str) -> Self {
        Self {
            hosts: vec![(host.to_owned(), port)],
            user: user.to_owned(),
            password: None,
            dbname: dbname.to_owned(),
            schema: DEFAULT_SCHEMA.to_owned(),
            mode: LockMode::Lease,
            pooling: Pooling::Auto,
            pool_size: 2,
            session_ttl: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            application_name: "leasehold".to_owned(),
            read_write: false,
            sslmode: SslMode::Prefer,
            tls: TlsFiles::default(),
        }
    }

    /// Parses a `postgres://` or `postgresql://` URL (see the crate documentation).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a malformed URL, an unknown parameter or a bad value,
    /// with credentials redacted.
    pub fn from_url(url: &str) -> Result<Self> {
        parse_url(url)
    }

    /// Another host to try, in order, when the ones before it cannot be reached (or, with
    /// [`read_write`](Self::read_write), are read-only standbys).
    pub fn add_host(mut self, host: &str, port: u16) -> Self {
        self.hosts.push((host.to_owned(), port));
        self
    }

    /// The password.
    pub fn password(mut self, password: &str) -> Self {
        self.password = Some(password.to_owned());
        self
    }

    /// The schema holding the lock tables and functions: 1–58 of `a-z 0-9 _`, not starting
    /// with a digit. Locks of different schemas are independent.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for other names.
    pub fn schema(mut self, schema: &str) -> Result<Self> {
        check_identifier("schema", schema)?;
        if schema.len() > MAX_SCHEMA_LEN {
            return Err(Error::invalid(
                "schema",
                format!(
                    "{schema:?} is longer than {MAX_SCHEMA_LEN} bytes (its wake-up channel, \
                     <schema>.wake, must fit PostgreSQL's 63)"
                ),
            ));
        }
        self.schema = schema.to_owned();
        Ok(self)
    }

    /// Lease table (the default) or advisory locks.
    pub fn mode(mut self, mode: LockMode) -> Self {
        self.mode = mode;
        self
    }

    /// What sits between the client and the server (found out on connect by default).
    pub fn pooling(mut self, pooling: Pooling) -> Self {
        self.pooling = pooling;
        self
    }

    /// How many connections lease-mode requests share (they are pipelined on each).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] outside 1–64.
    pub fn pool_size(mut self, size: usize) -> Result<Self> {
        if !(1..=64).contains(&size) {
            return Err(Error::invalid(
                "pool size",
                format!("{size} is not between 1 and 64"),
            ));
        }
        self.pool_size = size;
        Ok(self)
    }

    /// Advisory mode: how long a held lock's connection may stay silent. The server ends a
    /// session idle that long (`idle_session_timeout`), which frees its locks, and the
    /// client counts the lock as lost when its connection has not answered for that long.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] outside 500 ms – 1 day.
    pub fn session_ttl(mut self, ttl: Duration) -> Result<Self> {
        if ttl < Duration::from_millis(500) || ttl > Duration::from_secs(86_400) {
            return Err(Error::invalid(
                "session ttl",
                format!("{ttl:?} is not between 500 ms and 1 day"),
            ));
        }
        self.session_ttl = ttl;
        Ok(self)
    }

    /// How long connecting may take.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Connect only to a server that accepts writes (skipping standbys among the hosts).
    pub fn read_write(mut self, read_write: bool) -> Self {
        self.read_write = read_write;
        self
    }

    /// TLS: `sslmode` and the files of `tls_ca`, `tls_cert`, `tls_key`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for TLS files with `sslmode=disable`, or a certificate
    /// without its key.
    pub fn tls(mut self, sslmode: SslMode, files: TlsFiles) -> Result<Self> {
        if sslmode == SslMode::Disable && !files.is_empty() {
            return Err(Error::invalid(
                "url",
                format!(
                    "{} need TLS: sslmode=require, verify-ca or verify-full",
                    TlsFiles::PARAMS
                ),
            ));
        }
        files.check(true, "postgres")?;
        self.sslmode = sslmode;
        self.tls = files;
        Ok(self)
    }

    /// The schema.
    pub fn schema_name(&self) -> &str {
        &self.schema
    }

    /// The lock mode.
    pub fn lock_mode(&self) -> LockMode {
        self.mode
    }
}

/// Checks an SQL identifier we write into statements unquoted.
pub(crate) fn check_identifier(what: &'static str, name: &str) -> Result<()> {
    let valid = !name.is_empty()
        && name.len() <= 63
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if valid {
        Ok(())
    } else {
        Err(Error::invalid(
            what,
            format!("{name:?} is not 1-63 of a-z 0-9 _ (not starting with a digit)"),
        ))
    }
}

/// Decodes `%XX` escapes.
fn percent_decode(part: &str) -> Result<String> {
    let bytes = part.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = part
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            let Some(byte) = hex else {
                return Err(Error::invalid("url", "a % not followed by two hex digits"));
            };
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| Error::invalid("url", "percent-escapes that are not UTF-8"))
}

fn parse_url(url: &str) -> Result<PostgresOptions> {
    let shown = redact_url(url);
    let invalid = |reason: String| Error::invalid("url", format!("{shown}: {reason}"));
    let rest = match url.split_once("://") {
        Some((scheme, rest))
            if scheme.eq_ignore_ascii_case("postgres")
                || scheme.eq_ignore_ascii_case("postgresql") =>
        {
            rest
        }
        _ => {
            return Err(invalid(
                "expected postgres://[user[:password]@]host[:port][/dbname][?params]".into(),
            ));
        }
    };
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (Some(userinfo), hosts),
        None => (None, authority),
    };
    let (user, password) = match userinfo {
        Some(info) => {
            let (user, password) = match info.split_once(':') {
                Some((user, password)) => (user, Some(percent_decode(password)?)),
                None => (info, None),
            };
            (Some(percent_decode(user)?), password)
        }
        None => (None, None),
    };
    let user = match user.filter(|u| !u.is_empty()) {
        Some(user) => user,
        None => std::env::var("USER")
            .ok()
            .filter(|u| !u.is_empty())
            .ok_or_else(|| invalid("no user in the URL, and $USER is not set".into()))?,
    };
    let mut parsed_hosts = Vec::new();
    for host in hosts.split(',') {
        let host = host.trim();
        if host.is_empty() {
            continue;
        }
        let port_of = |port: &str| {
            port.parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| invalid(format!("{port:?} is not a port")))
        };
        let (name, port) = match host.strip_prefix('[') {
            // An IPv6 address: [addr] or [addr]:port.
            Some(rest) => {
                let (addr, after) = rest
                    .split_once(']')
                    .ok_or_else(|| invalid(format!("{host:?} has no closing ]")))?;
                let port = match after.strip_prefix(':') {
                    Some(port) => port_of(port)?,
                    None if after.is_empty() => 5432,
                    None => return Err(invalid(format!("{host:?} is not [address]:port"))),
                };
                (addr, port)
            }
            None => match host.rsplit_once(':') {
                Some((name, port)) => (name, port_of(port)?),
                None => (host, 5432),
            },
        };
        if name.is_empty() {
            return Err(invalid(format!("{host:?} has no host name")));
        }
        parsed_hosts.push((percent_decode(name)?, port));
    }
    if parsed_hosts.is_empty() {
        return Err(invalid("no host".into()));
    }
    let path = path.trim_end_matches('/');
    if path.contains('/') {
        return Err(invalid(
            "the path is the database name alone; give the schema as ?schema=S".into(),
        ));
    }
    let dbname = if path.is_empty() {
        user.clone()
    } else {
        percent_decode(path)?
    };
    let (first, more) = parsed_hosts.split_first().expect("at least one host");
    let mut options = PostgresOptions::new(&first.0, first.1, &user, &dbname);
    for (host, port) in more {
        options = options.add_host(host, *port);
    }
    options.password = password;
    let mut sslmode = SslMode::Prefer;
    let mut tls = TlsFiles::default();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(value)?;
        let Some(param) = Param::parse(key) else {
            return Err(invalid(format!(
                "unknown parameter {key:?}; known: {}",
                Param::known()
            )));
        };
        match param {
            Param::Schema => options = options.schema(&value)?,
            Param::Mode => {
                options.mode = match value.as_str() {
                    "lease" => LockMode::Lease,
                    "advisory" => LockMode::Advisory,
                    other => {
                        return Err(invalid(format!(
                            "mode={other:?}; expected lease or advisory"
                        )));
                    }
                }
            }
            Param::Pooling => {
                options.pooling = match value.as_str() {
                    "auto" => Pooling::Auto,
                    "session" | "none" => Pooling::Session,
                    "transaction" | "statement" => Pooling::Transaction,
                    other => {
                        return Err(invalid(format!(
                            "pooling={other:?}; expected auto, session (or none) or \
                             transaction (or statement)"
                        )));
                    }
                }
            }
            Param::PoolSize => {
                let size = value
                    .parse()
                    .map_err(|_| invalid(format!("pool_size={value:?} is not a number")))?;
                options = options.pool_size(size)?;
            }
            Param::SessionTtl => options = options.session_ttl(parse_duration(&value)?)?,
            Param::ConnectTimeout => {
                let timeout = parse_duration(&value)?;
                if timeout.is_zero() {
                    return Err(invalid("connect_timeout must be longer than zero".into()));
                }
                options = options.connect_timeout(timeout);
            }
            Param::ApplicationName => options.application_name = value,
            Param::TargetSessionAttrs => {
                options.read_write = match value.as_str() {
                    "any" => false,
                    "read-write" => true,
                    other => {
                        return Err(invalid(format!(
                            "target_session_attrs={other:?}; expected any or read-write"
                        )));
                    }
                }
            }
            Param::SslMode => sslmode = SslMode::parse(&value)?,
            Param::TlsCa | Param::TlsCert | Param::TlsKey => {
                tls.read_param(param.key(), &value)?;
            }
        }
    }
    options.tls(sslmode, tls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(url: &str) -> String {
        match PostgresOptions::from_url(url) {
            Err(Error::InvalidArgument { reason, .. }) => reason,
            other => panic!("{url} gave {other:?}"),
        }
    }

    #[test]
    fn a_full_url_is_read() {
        let o = PostgresOptions::from_url(
            "postgresql://app:p%40ss@db1:6000,db2/orders?schema=locks&mode=advisory\
             &pooling=transaction&pool_size=4&session_ttl=3s&connect_timeout=2s\
             &target_session_attrs=read-write&sslmode=require&application_name=svc",
        )
        .unwrap();
        assert_eq!(
            o.hosts,
            vec![("db1".to_owned(), 6000), ("db2".to_owned(), 5432)]
        );
        assert_eq!(o.user, "app");
        assert_eq!(o.password.as_deref(), Some("p@ss"));
        assert_eq!(o.dbname, "orders");
        assert_eq!(o.schema, "locks");
        assert_eq!(o.mode, LockMode::Advisory);
        assert_eq!(o.pooling, Pooling::Transaction);
        assert_eq!(o.pool_size, 4);
        assert_eq!(o.session_ttl, Duration::from_secs(3));
        assert_eq!(o.connect_timeout, Duration::from_secs(2));
        assert!(o.read_write);
        assert_eq!(o.sslmode, SslMode::Require);
        assert_eq!(o.application_name, "svc");
        assert!(!format!("{o:?}").contains("p@ss"));
    }

    #[test]
    fn ipv6_hosts_take_brackets() {
        let o = PostgresOptions::from_url("postgres://u@[::1],[fe80::2]:6000/db").unwrap();
        assert_eq!(
            o.hosts,
            vec![("::1".to_owned(), 5432), ("fe80::2".to_owned(), 6000)]
        );
    }

    #[test]
    fn defaults_follow_libpq() {
        let o = PostgresOptions::from_url("postgres://me@localhost").unwrap();
        assert_eq!(o.hosts, vec![("localhost".to_owned(), 5432)]);
        assert_eq!(o.dbname, "me");
        assert_eq!(o.schema, DEFAULT_SCHEMA);
        assert_eq!(o.mode, LockMode::Lease);
        assert_eq!(o.pooling, Pooling::Auto);
        assert_eq!(o.sslmode, SslMode::Prefer);
    }

    #[test]
    fn bad_urls_are_typed_errors_without_credentials() {
        let r = reason("postgres://u:hunter2@h/db?nosuch=1");
        assert!(r.contains("unknown parameter \"nosuch\""), "{r}");
        assert!(r.contains("schema, mode, pooling"), "{r}");
        assert!(!r.contains("hunter2"), "{r}");
        assert!(reason("redis://h").contains("expected postgres://"));
        assert!(reason("postgres://u@/db").contains("no host"));
        assert!(reason("postgres://u@h:0/db").contains("not a port"));
        assert!(reason("postgres://u@h:x/db").contains("not a port"));
        assert!(reason("postgres://u@h/db/x").contains("database name alone"));
        assert!(reason("postgres://u@h/db?mode=table").contains("lease or advisory"));
        assert!(reason("postgres://u@h/db?pooling=maybe").contains("transaction"));
        assert!(reason("postgres://u@h/db?schema=Bad-Name").contains("a-z 0-9 _"));
        assert!(reason("postgres://u@h/db?schema=1x").contains("a-z 0-9 _"));
        assert!(reason("postgres://u@h/db?pool_size=0").contains("between 1 and 64"));
        assert!(reason("postgres://u@h/db?session_ttl=10ms").contains("500 ms"));
        assert!(reason("postgres://u@h/db?session_ttl=10").contains("unit"));
        assert!(reason("postgres://u@h/db?sslmode=maybe").contains("verify-full"));
        assert!(reason("postgres://u@h/db?sslmode=require&tls_ca=/x").contains("cannot be read"));
        assert!(reason("postgres://u@h/db?target_session_attrs=primary").contains("read-write"));
        assert!(reason("postgres://u@h/d%zz").contains("hex"));
        assert!(reason(&format!("postgres://u@h/db?schema={}", "s".repeat(59))).contains("58"));
        assert!(reason("postgres://u@[::1/db").contains("closing ]"));
        assert!(reason("postgres://u@[::1]x/db").contains("[address]:port"));
    }
}
