//! Options of the PostgreSQL backend and the URL that sets them.
//!
//! `postgres://[user[:password]@]host[:port][,host[:port]…][/dbname][?param=value&…]`
//! (also `postgresql://`). Every query parameter is one `Param`; an unknown one is an
//! error that lists the known ones.

use std::time::Duration;

use leasehold_core::support::url::{ParsedUrl, UrlParam, url_params};
use leasehold_core::support::{Secret, TlsFiles};
use leasehold_core::{ConnectOptions, Error, Result};

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
    /// Nothing hands a connection's session to another client.
    /// The client talks to the server itself, a TCP proxy, or a pooler in session mode.
    Session,
    /// A pooler in transaction or statement mode: no session state survives a transaction.
    /// So none of LISTEN, named prepared statements or session advisory locks can be used.
    /// PgBouncer's `pool_mode = transaction` is one.
    Transaction,
}

/// `sslmode`, as libpq reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    /// Plain TCP.
    Disable,
    /// TLS if the server offers it, plain TCP otherwise; the certificate is not checked.
    /// This is libpq's default.
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
    /// Whether the server's certificate is checked against the trusted CAs.
    pub(crate) fn verifies(self) -> bool {
        matches!(self, SslMode::VerifyCa | SslMode::VerifyFull)
    }
}

url_params! {
    /// The URL parameters of `postgres://` and `postgresql://`.
    /// Each sets the option of its name; `target_session_attrs` sets `read_write`.
    enum Param {
        Schema = "schema",
        Mode = "mode",
        Pooling = "pooling",
        PoolSize = "pool_size",
        SessionTtl = "session_ttl",
        ConnectTimeout = "connect_timeout",
        ApplicationName = "application_name",
        TargetSessionAttrs = "target_session_attrs",
        SslMode = "sslmode",
        TlsCa = "tls_ca",
        TlsCert = "tls_cert",
        TlsKey = "tls_key",
    }
}

/// Options of the PostgreSQL backend (also settable as URL query parameters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostgresOptions {
    pub(crate) hosts: Vec<(String, u16)>,
    pub(crate) user: String,
    pub(crate) password: Option<Secret>,
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

/// The default schema of the lock tables and functions.
pub const DEFAULT_SCHEMA: &str = "leasehold";

/// The longest schema name: its wake-up channel `<schema>.wake` must fit in an identifier.
const MAX_SCHEMA_LEN: usize = 58;

impl PostgresOptions {
    /// Options for `user` on `host:port`, database `dbname`, with the defaults.
    /// The defaults: schema `leasehold`, lease mode, pooling found out on connect, 2 pooled
    /// connections, a 10 s session ttl (advisory mode), 5 s to connect, `sslmode=prefer`.
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
        parse_url(url, &ConnectOptions::default())
    }

    /// Another host to try, in order, when the ones before it cannot be reached.
    /// With [`read_write`](Self::read_write), also when they are read-only standbys.
    pub fn add_host(mut self, host: &str, port: u16) -> Self {
        self.hosts.push((host.to_owned(), port));
        self
    }

    /// The password.
    pub fn password(mut self, password: &str) -> Self {
        self.password = Some(Secret::new(password));
        self
    }

    /// The schema holding the lock tables and functions.
    /// Its name is 1–58 of `a-z 0-9 _`, not starting with a digit. Locks of different
    /// schemas are independent.
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

    /// Advisory mode: how long a held lock's connection may stay silent.
    /// The server ends a session idle that long (`idle_session_timeout`), which frees its
    /// locks, and the client counts the lock as lost when its connection has not answered
    /// for that long.
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

/// Reads a URL, with the session ttl `connect` asks for in advisory mode.
pub(crate) fn parse_url(url: &str, connect: &ConnectOptions) -> Result<PostgresOptions> {
    let url = ParsedUrl::parse(
        url,
        &["postgres", "postgresql"],
        "postgres://[user[:password]@]host[:port][/dbname][?params]",
    )?;
    let user = match url.user.as_deref().filter(|u| !u.is_empty()) {
        Some(user) => user.to_owned(),
        None => std::env::var("USER")
            .ok()
            .filter(|u| !u.is_empty())
            .ok_or_else(|| url.invalid("no user in the URL, and $USER is not set"))?,
    };
    let path = url.path()?;
    let path = path
        .strip_prefix('/')
        .unwrap_or(&path)
        .trim_end_matches('/');
    if path.contains('/') {
        return Err(
            url.invalid("the path is the database name alone; give the schema as ?schema=S")
        );
    }
    let dbname = if path.is_empty() { &user } else { path };
    let mut options = PostgresOptions::new("", 0, &user, dbname);
    options.hosts = (url.hosts(1..)?.iter())
        .map(|host| (host.name.clone(), host.port.unwrap_or(5432)))
        .collect();
    options.password = url.password.as_deref().map(Secret::new);
    let mut sslmode = SslMode::Prefer;
    let mut tls = TlsFiles::default();
    let mut session_ttl = None;
    for (param, value) in url.params::<Param>()? {
        match param {
            Param::Schema => options = options.schema(value.as_str())?,
            Param::Mode => {
                options.mode = value
                    .one_of(&[("lease", LockMode::Lease), ("advisory", LockMode::Advisory)])?;
            }
            Param::Pooling => {
                options.pooling = value.one_of(&[
                    ("auto", Pooling::Auto),
                    ("session", Pooling::Session),
                    ("none", Pooling::Session),
                    ("transaction", Pooling::Transaction),
                    ("statement", Pooling::Transaction),
                ])?;
            }
            Param::PoolSize => options = options.pool_size(value.number()?)?,
            Param::SessionTtl => {
                let ttl = value.duration()?;
                options = options.session_ttl(ttl)?;
                session_ttl = Some(ttl);
            }
            Param::ConnectTimeout => {
                let timeout = value.duration()?;
                if timeout.is_zero() {
                    return Err(url.invalid("connect_timeout must be longer than zero"));
                }
                options = options.connect_timeout(timeout);
            }
            Param::ApplicationName => options.application_name = value.as_str().to_owned(),
            Param::TargetSessionAttrs => {
                options.read_write = value.one_of(&[("any", false), ("read-write", true)])?;
            }
            Param::SslMode => {
                sslmode = value.one_of(&[
                    ("disable", SslMode::Disable),
                    ("prefer", SslMode::Prefer),
                    ("require", SslMode::Require),
                    ("verify-ca", SslMode::VerifyCa),
                    ("verify-full", SslMode::VerifyFull),
                ])?;
            }
            Param::TlsCa | Param::TlsCert | Param::TlsKey => {
                tls.read_param(param.name(), value.as_str())?;
            }
        }
    }
    // Only advisory locks live by a session.
    if options.mode == LockMode::Advisory
        && let Some(ttl) = connect.session_ttl_for(Param::SessionTtl.name(), session_ttl)?
    {
        options = options.session_ttl(ttl)?;
    }
    options.tls(sslmode, tls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn advisory_ttl(url: &str, connect: ConnectOptions) -> Result<Duration> {
        parse_url(url, &connect).map(|o| o.session_ttl)
    }

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
        assert_eq!(o.password, Some(Secret::new("p@ss")));
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
        assert!(reason("postgres://u@h/db?mode=table").contains("one of lease, advisory"));
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

    #[test]
    fn a_parameter_given_twice_is_refused() {
        let r = reason("postgres://u:hunter2@h/db?mode=advisory&session_ttl=5s&session_ttl=60s");
        assert!(r.contains("session_ttl") && r.contains("twice"), "{r}");
        assert!(!r.contains("hunter2"), "{r}");
    }

    #[test]
    fn the_session_ttl_asked_for_when_connecting_applies_to_advisory_locks() {
        let secs = Duration::from_secs;
        let asked = |ttl| ConnectOptions::default().session_ttl(ttl).unwrap();
        let default = |ttl| ConnectOptions::default().default_session_ttl(ttl).unwrap();
        let advisory = "postgres://u@h/db?mode=advisory";
        assert_eq!(advisory_ttl(advisory, asked(secs(60))).unwrap(), secs(60));
        assert_eq!(advisory_ttl(advisory, default(secs(30))).unwrap(), secs(30));
        let url = "postgres://u@h/db?session_ttl=5s&mode=advisory";
        assert_eq!(advisory_ttl(url, default(secs(30))).unwrap(), secs(5));
        assert_eq!(advisory_ttl(url, asked(secs(5))).unwrap(), secs(5));
        let err = advisory_ttl(url, asked(secs(60))).unwrap_err();
        assert!(err.to_string().contains("disagree"), "{err}");
        assert!(advisory_ttl(advisory, asked(Duration::from_millis(10))).is_err());
        // Lease mode has no session: what is asked for does not apply.
        for lease in [
            "postgres://u@h/db",
            "postgres://u@h/db?mode=lease&session_ttl=5s",
        ] {
            let default_ttl = PostgresOptions::from_url(lease).unwrap().session_ttl;
            assert_eq!(advisory_ttl(lease, asked(secs(60))).unwrap(), default_ttl);
        }
    }
}
