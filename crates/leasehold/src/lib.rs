//! leasehold: distributed locks that stay correct when networks, processes and clocks
//! misbehave.
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
/// | `redlock://[user:pass@]h1:p1,h2:p2,h3:p3[?node_timeout=…]` | [`redis::RedlockBackend`] — Redlock over independent Redis masters |
/// | `etcd://[user:pass@]h1:p1[,h2:p2…][?session_ttl=…]`, `etcds://…[?tls_ca=…]` | `etcd::EtcdBackend` — an etcd cluster (feature `etcd`; `etcds`: TLS) |
/// | `zk://[user:pass@]h1:p1[,h2:p2…][/chroot][?session_timeout=…]` | `zookeeper::ZooKeeperBackend` — a ZooKeeper ensemble (feature `zookeeper`, on by default) |
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
    Ok(Client::builder_from_arc(connect_backend(url).await?).build())
}

/// The backend behind `url`, for use with [`Client::builder_from_arc`] (to choose the
/// clock or default options).
///
/// # Cancel safety
///
/// As for [`connect`].
///
/// # Errors
///
/// As for [`connect`].
pub async fn connect_backend(url: &str) -> Result<Arc<dyn Backend>> {
    let invalid =
        |reason: String| Error::invalid("url", format!("{}: {reason}", support::redact_url(url)));
    let scheme = url
        .split_once(':')
        .map(|(scheme, _)| scheme.to_ascii_lowercase())
        .filter(|s| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
        })
        .ok_or_else(|| invalid("not a URL; expected e.g. file:///path/to/dir".into()))?;
    match scheme.as_str() {
        "memory" => Ok(Arc::new(memory::InMemory::new())),
        #[cfg(feature = "file")]
        "file" => {
            let parsed = url::Url::parse(url).map_err(|e| invalid(e.to_string()))?;
            if !matches!(parsed.host_str(), None | Some("") | Some("localhost")) {
                return Err(invalid(
                    "file locks only work on this host; use file:///absolute/path".into(),
                ));
            }
            // `file:relative` would be read as `/relative`: insist on the absolute form.
            if !url[scheme.len()..].starts_with("://") {
                return Err(invalid(
                    "expected an absolute path, as in file:///var/lock/app".into(),
                ));
            }
            let dir = parsed.to_file_path().map_err(|()| {
                invalid("expected an absolute path, as in file:///var/lock/app".into())
            })?;
            Ok(Arc::new(file::FileBackend::open(dir)?))
        }
        #[cfg(feature = "redis")]
        "redis" | "rediss" => Ok(Arc::new(redis::RedisBackend::connect(url).await?)),
        #[cfg(feature = "redis")]
        "redlock" => Ok(Arc::new(redis::RedlockBackend::connect(url).await?)),
        #[cfg(feature = "etcd")]
        "etcd" | "etcds" => Ok(Arc::new(etcd::EtcdBackend::connect(url).await?)),
        #[cfg(feature = "zookeeper")]
        "zk" | "zookeeper" => Ok(Arc::new(zookeeper::ZooKeeperBackend::connect(url).await?)),
        other => {
            let feature = match other {
                "file" => Some("file"),
                "redis" | "rediss" | "redlock" => Some("redis"),
                "etcd" | "etcds" => Some("etcd"),
                "zk" | "zookeeper" => Some("zookeeper"),
                _ => None,
            };
            Err(invalid(match feature {
                Some(feature) => format!(
                    "{other}:// needs leasehold built with the `{feature}` cargo feature; \
                     this build supports {}",
                    supported_schemes().join(", ")
                ),
                None => format!(
                    "unknown scheme {other:?}; this build supports {}",
                    supported_schemes().join(", ")
                ),
            }))
        }
    }
}

/// The URL schemes this build of leasehold can connect to.
pub fn supported_schemes() -> Vec<&'static str> {
    let mut schemes = vec!["memory"];
    if cfg!(feature = "file") {
        schemes.push("file");
    }
    if cfg!(feature = "redis") {
        schemes.push("redis");
        schemes.push("redlock");
    }
    if cfg!(feature = "etcd") {
        schemes.push("etcd");
    }
    if cfg!(feature = "zookeeper") {
        schemes.push("zk");
    }
    schemes
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
}
