//! leasehold: distributed locks that stay correct when networks, processes and clocks misbehave.
//!
//! One async API over every backend, a fencing token on every grant, and a loss signal
//! that fires no later than the server could give the lock to someone else.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold::Result<()> {
//! # let dir = tempfile::tempdir().unwrap();
//! # let url = format!("file://{}", dir.path().display());
//! let client = leasehold::connect(&url).await?; // or "redis://…", "etcd://…", "zk://…"
//! let guard = client.mutex("nightly-report")?.lock().await?;
//! // Pass the token with every write; the store refuses tokens older than one it has seen.
//! println!("holding with token {}", guard.token());
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! See `docs/safety.md` for what a lease-based lock can and cannot promise, and one page
//! per backend under `docs/backends/`.

use std::sync::Arc;

pub use leasehold_core::*;
#[cfg(feature = "etcd")]
pub use leasehold_etcd as etcd;
#[cfg(feature = "file")]
pub use leasehold_file as file;
#[cfg(feature = "postgres")]
pub use leasehold_postgres as postgres;
#[cfg(feature = "redis")]
pub use leasehold_redis as redis;
#[cfg(feature = "zookeeper")]
pub use leasehold_zookeeper as zookeeper;

/// Connects to the lock service at `url`, with default options.
///
/// | URL | backend |
/// |---|---|
/// | `file:///var/lib/app/locks` | [`file`](mod@file) — OS file locks in that directory (one host) |
/// | `memory:` | [`memory::InMemory`] — this process only (tests, examples) |
/// | `redis://[user:pass@]host:port[/db][?prefix=…&replicas=N…]`, `rediss://…[?tls_ca=…]` | [`redis`] — one Redis server (`rediss`: TLS) |
/// | `redis+sentinel://[user:pass@]s1:p1,s2:p2,s3:p3/master[/db][?…]` | [`redis`] — the master Redis Sentinel manages, followed across failovers |
/// | `redis+cluster://[user:pass@]h1:p1[,h2:p2…][?…]`, `rediss+cluster://…[?tls_ca=…]` | [`redis`] — a Redis Cluster: each lock on its slot's master, `MOVED`/`ASK` followed (`rediss`: TLS) |
/// | `redlock://[user:pass@]h1:p1,h2:p2,h3:p3[?node_timeout=…]` | [`redis::RedlockBackend`] — Redlock over independent Redis masters |
/// | `etcd://[user:pass@]h1:p1[,h2:p2…][?session_ttl=…]`, `etcds://…[?tls_ca=…]` | `etcd::EtcdBackend` — an etcd cluster (feature `etcd`; `etcds`: TLS) |
/// | `zk://[user:pass@]h1:p1[,h2:p2…][/chroot][?session_timeout=…]` | `zookeeper::ZooKeeperBackend` — a ZooKeeper ensemble (feature `zookeeper`, on by default) |
/// | `postgres://[user:pass@]host:port[/db][?schema=…&mode=lease\|advisory…]`, `postgresql://…` | `postgres::PostgresBackend` — a PostgreSQL server: a lease table, or advisory locks (feature `postgres`) |
///
/// Every backend reads its URL with [`support::url`]: percent-escapes are decoded, and an
/// unknown parameter or one given twice is refused.
///
/// # Cancel safety
///
/// Dropping the future abandons the connection attempt; no lock is taken by connecting.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an unknown scheme or a malformed URL (credentials
/// redacted in the message); [`Error::Unavailable`] if the service cannot be reached.
pub async fn connect(url: &str) -> Result<Client> {
    connect_with(url, ConnectOptions::default()).await
}

/// Connects to the lock service at `url` (see [`connect`]) with `options` not in the URL.
/// `options` hold the session ttl of etcd, ZooKeeper (its session timeout) and PostgreSQL
/// advisory locks. The ttl granted is the client's
/// [`capabilities().session_ttl`](Capabilities::session_ttl).
///
/// # Cancel safety
///
/// As for [`connect`].
///
/// # Errors
///
/// As for [`connect`]; also [`Error::InvalidArgument`] if the URL sets a session ttl other
/// than the one `options` ask for, or the backend cannot have that one.
pub async fn connect_with(url: &str, options: ConnectOptions) -> Result<Client> {
    Ok(Client::builder_from_arc(open(url, &options).await?).build())
}

/// The backend behind `url`, for use with [`Client::builder_from_arc`].
/// A client built that way can choose its clock or default options.
///
/// # Cancel safety
///
/// As for [`connect`].
///
/// # Errors
///
/// As for [`connect`].
pub async fn connect_backend(url: &str) -> Result<Arc<dyn Backend>> {
    open(url, &ConnectOptions::default()).await
}

/// The backend behind `url`, with `options` not in the URL (see [`connect_with`]).
/// For use with [`Client::builder_from_arc`].
///
/// # Cancel safety
///
/// As for [`connect`].
///
/// # Errors
///
/// As for [`connect_with`].
pub async fn connect_backend_with(url: &str, options: ConnectOptions) -> Result<Arc<dyn Backend>> {
    open(url, &options).await
}

/// The one table of URL schemes, which [`connect`] and [`supported_schemes`] follow.
/// Each row has a backend's schemes, the cargo feature that builds the backend in, and
/// whether this build has it; the table in [`connect`]'s docs follows it too. The first
/// scheme of a row is the one listed.
const SCHEMES: &[(&[&str], &str, bool)] = &[
    (&["memory"], "", true),
    (&["file"], "file", cfg!(feature = "file")),
    (&["redis", "rediss"], "redis", cfg!(feature = "redis")),
    (&["redis+sentinel"], "redis", cfg!(feature = "redis")),
    (
        &["redis+cluster", "rediss+cluster"],
        "redis",
        cfg!(feature = "redis"),
    ),
    (&["redlock"], "redis", cfg!(feature = "redis")),
    (&["etcd", "etcds"], "etcd", cfg!(feature = "etcd")),
    (
        &["zk", "zookeeper"],
        "zookeeper",
        cfg!(feature = "zookeeper"),
    ),
    (
        &["postgres", "postgresql"],
        "postgres",
        cfg!(feature = "postgres"),
    ),
];

/// Opens the backend of `url`'s scheme (see [`SCHEMES`]).
async fn open(url: &str, options: &ConnectOptions) -> Result<Arc<dyn Backend>> {
    let _ = options; // unused in a build without a session backend
    let invalid =
        |why: String| Error::invalid("url", format!("{}: {why}", support::redact_url(url)));
    let supported = supported_schemes().join(", ");
    let scheme = support::url::scheme(url)
        .ok_or_else(|| invalid("not a URL; expected e.g. file:///path/to/dir".into()))?;
    let row = SCHEMES
        .iter()
        .find(|(names, ..)| names.contains(&scheme.as_str()));
    let Some((names, feature, _)) = row else {
        return Err(invalid(format!(
            "unknown scheme {scheme:?}; this build supports {supported}"
        )));
    };
    Ok(match names.first().copied().unwrap_or_default() {
        "memory" => Arc::new(memory::InMemory::new()),
        #[cfg(feature = "file")]
        "file" => Arc::new(file::FileBackend::open(file_path(url)?)?),
        #[cfg(feature = "redis")]
        "redis" | "redis+sentinel" | "redis+cluster" => {
            Arc::new(redis::RedisBackend::connect(url).await?)
        }
        #[cfg(feature = "redis")]
        "redlock" => Arc::new(redis::RedlockBackend::connect(url).await?),
        #[cfg(feature = "etcd")]
        "etcd" => Arc::new(etcd::EtcdBackend::connect_url(url, options).await?),
        #[cfg(feature = "zookeeper")]
        "zk" => Arc::new(zookeeper::ZooKeeperBackend::connect_url(url, options).await?),
        #[cfg(feature = "postgres")]
        "postgres" => Arc::new(postgres::PostgresBackend::connect_url(url, options).await?),
        _ => {
            let build = format!("leasehold built with the `{feature}` cargo feature");
            return Err(invalid(format!(
                "{scheme}:// needs {build}; this build supports {supported}"
            )));
        }
    })
}

/// The directory of a `file:///absolute/path` URL (or `file://localhost/…`).
#[cfg(feature = "file")]
fn file_path(url: &str) -> Result<std::path::PathBuf> {
    use std::os::unix::ffi::OsStringExt;
    let absolute = "an absolute path, as in file:///var/lock/app";
    let url = support::url::ParsedUrl::parse(url, &["file"], absolute)?;
    let localhost = |host: &support::url::Host| host.to_string().eq_ignore_ascii_case("localhost");
    if !url.hosts(0..=1)?.iter().all(localhost) || url.user.is_some() {
        return Err(url.invalid("file locks only work on this host; use file:///absolute/path"));
    }
    match url.path_bytes()? {
        path if path.is_empty() => Err(url.invalid(format!("expected {absolute}"))),
        path => Ok(std::ffi::OsString::from_vec(path).into()),
    }
}

/// The URL schemes this build of leasehold can connect to.
pub fn supported_schemes() -> Vec<&'static str> {
    let built = SCHEMES.iter().filter(|(_, _, built)| *built);
    built
        .filter_map(|(names, ..)| names.first().copied())
        .collect()
}

/// The URL used when none is given: the file backend in its default directory.
#[cfg(feature = "file")]
pub fn default_url() -> String {
    url::Url::from_directory_path(file::default_dir())
        .map(String::from)
        .unwrap_or_else(|()| format!("file://{}", file::default_dir().display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn invalid(url: &str) -> String {
        match connect(url).await {
            Err(Error::InvalidArgument {
                what: "url",
                reason,
            }) => reason,
            other => panic!("{url} gave {other:?}"),
        }
    }

    #[tokio::test]
    async fn bad_urls_are_typed_errors_without_credentials() {
        let reason = invalid("nosuch://user:hunter2@host:1").await;
        assert!(reason.contains("unknown scheme \"nosuch\""), "{reason}");
        assert!(!reason.contains("hunter2"), "{reason}");
        assert!(invalid("").await.contains("not a URL"));
        assert!(invalid("localhost").await.contains("not a URL"));
        assert!(
            invalid("file://otherhost/tmp/x")
                .await
                .contains("this host")
        );
        assert!(invalid("file:relative/dir").await.contains("absolute"));
        #[cfg(feature = "zookeeper")]
        {
            let reason = invalid("zk://u:hunter2@h:1?nosuch=1").await;
            assert!(reason.contains("unknown parameter"), "{reason}");
            assert!(!reason.contains("hunter2"), "{reason}");
        }
    }

    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn bad_postgres_urls_are_typed_errors_without_credentials() {
        let reason = invalid("postgresql://app:hunter2@db/orders?nosuch=1").await;
        assert!(reason.contains("unknown parameter \"nosuch\""), "{reason}");
        assert!(!reason.contains("hunter2"), "{reason}");
    }

    #[tokio::test]
    async fn connects_to_file_and_memory() {
        let dir = tempfile::tempdir().unwrap();
        let url = url::Url::from_directory_path(dir.path()).unwrap();
        let client = connect(url.as_str()).await.unwrap();
        assert_eq!(client.capabilities().backend, "file");
        let client = connect("memory:").await.unwrap();
        assert_eq!(client.capabilities().backend, "memory");
        assert!(default_url().starts_with("file:///"));
    }

    #[tokio::test]
    async fn a_backend_without_sessions_ignores_the_session_ttl() {
        let options = ConnectOptions::default().session_ttl(std::time::Duration::from_secs(60));
        let client = connect_with("memory:", options.unwrap()).await.unwrap();
        assert_eq!(client.capabilities().session_ttl, None);
    }

    #[tokio::test]
    async fn every_scheme_of_the_table_reaches_its_backend() {
        for (names, ..) in SCHEMES.iter().filter(|(_, _, built)| *built) {
            for name in *names {
                // Without a host or path, every backend refuses the URL itself.
                match connect(&format!("{name}://")).await {
                    Ok(client) => assert_eq!(client.capabilities().backend, "memory"),
                    Err(error) => {
                        let reason = error.to_string();
                        assert!(!reason.contains("cargo feature"), "{name}: {reason}");
                        assert!(
                            matches!(error, Error::InvalidArgument { .. }),
                            "{name}: {error}"
                        );
                    }
                }
            }
        }
    }

    #[tokio::test]
    async fn file_urls_are_percent_decoded_and_may_name_localhost() {
        let dir = tempfile::tempdir().unwrap();
        let spaced = dir.path().join("a dir#1");
        let url = url::Url::from_directory_path(&spaced).unwrap();
        assert!(url.as_str().contains("a%20dir%231"), "{url}");
        connect(url.as_str()).await.unwrap();
        assert!(spaced.is_dir());
        let local = format!("file://LOCALHOST{}", dir.path().join("b").display());
        connect(&local).await.unwrap();
        assert!(dir.path().join("b").is_dir());
        assert!(invalid("file://").await.contains("absolute"));
        let reason = invalid("file://u:hunter2@/tmp/x").await;
        assert!(
            reason.contains("this host") && !reason.contains("hunter2"),
            "{reason}"
        );
    }
}
