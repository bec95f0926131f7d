//! Redis Sentinel: where the master is, and word when it moves.
//!
//! A `redis+sentinel://s1:p,s2:p,s3:p/master[/db]` URL names sentinels, not a server. The
//! master is a server a sentinel names (`SENTINEL GET-MASTER-ADDR-BY-NAME`) that says it
//! is one (`ROLE`): the sentinels are asked in turn until one names such a server, since
//! one may be behind a failover or cut off from the others. The connection asks again when
//! its server stops being the master (`READONLY`, `MASTERDOWN`, a connection lost or
//! refused), and moves when a sentinel names another master (a `+switch-master`
//! announcement, or its answer to a periodic question; see [`watch_failovers`]) that says
//! it is one. Credentials and the db of the URL are the master's; the sentinels are asked
//! without them.

use std::fmt::Write as _;
use std::time::Duration;

use futures_util::StreamExt;
use leasehold_core::support::url::ParsedUrl;
use leasehold_core::{Error, Result};
use redis::AsyncConnectionConfig;
use tokio::time::Instant;

use crate::connection::{Connected, Connection, Opener};
use crate::link::Link;

/// The port of a sentinel given without one.
const SENTINEL_PORT: u16 = 26379;

/// How often the failover watcher asks its sentinel where the master is.
/// That is after this long without an announcement: it checks that the sentinel answers,
/// and that it names the master the connection uses.
const PROBE: Duration = Duration::from_secs(5);

/// The scheme of a Sentinel URL.
pub(crate) const SENTINEL_SCHEME: &str = "redis+sentinel";

/// The sentinels of one master.
#[derive(Debug, Clone)]
pub(crate) struct Sentinels {
    /// The URL as given.
    url: String,
    /// `host:port` of each sentinel, in the order given.
    addresses: Vec<String>,
    /// The master's name, as the sentinels know it.
    master: String,
    /// `/db` of the master, or empty.
    db: String,
    /// The URL with the master's credentials, to put its address in.
    parsed: std::sync::Arc<ParsedUrl>,
}

impl Sentinels {
    /// The sentinels of the base URL `url` (see `options::parse_url`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a URL without a valid master name.
    pub(crate) fn parse(url: &str) -> Result<Sentinels> {
        let parsed = ParsedUrl::parse(
            url,
            &[SENTINEL_SCHEME],
            "redis+sentinel://host:port,host:port,…/master[/db]",
        )?;
        let addresses = (parsed.hosts(1..)?.iter())
            .map(|host| match host.port {
                Some(_) => host.to_string(),
                None => format!("{host}:{SENTINEL_PORT}"),
            })
            .collect();
        let path = parsed.path()?;
        let mut parts = path.trim_start_matches('/').splitn(2, '/');
        let master = parts.next().unwrap_or_default().to_owned();
        let valid = |c: char| c.is_ascii_alphanumeric() || "._-".contains(c);
        if master.is_empty() || !master.chars().all(valid) {
            return Err(parsed.invalid(format!(
                "{master:?} is not a master name (1 or more of A-Z a-z 0-9 . _ -)"
            )));
        }
        let db = match parts.next() {
            Some(db) if db.parse::<u32>().is_ok() => format!("/{db}"),
            Some(db) => return Err(parsed.invalid(format!("{db:?} is not a db number"))),
            None => String::new(),
        };
        Ok(Sentinels {
            url: url.to_owned(),
            addresses,
            master,
            db,
            parsed: std::sync::Arc::new(parsed),
        })
    }

    /// The URL as given.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// Connects to the master with `opener`, within `limit` in all.
    /// Each sentinel in turn is asked where the master is, and the server it names is
    /// tried unless it was tried already; each sentinel gets an even share of what is left.
    /// The connection's server is the master's `host:port`.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] if no server could be opened, with what each sentinel
    /// answered and why each server it named was refused.
    pub(crate) async fn connect_master(
        &self,
        limit: Duration,
        opener: &Opener<'_>,
    ) -> Result<Connected> {
        let deadline = Instant::now() + limit;
        let mut left = self.addresses.len();
        let mut share = || {
            let count = u32::try_from(left.max(1)).unwrap_or(u32::MAX);
            left = left.saturating_sub(1);
            deadline.saturating_duration_since(Instant::now()) / count
        };
        let mut report = String::new();
        let mut tried: Vec<String> = Vec::new();
        for sentinel in &self.addresses {
            let until = Instant::now() + share();
            let asked = tokio::time::timeout_at(until, self.ask(sentinel, until)).await;
            let address = match asked {
                Ok(Ok(Some(address))) => address,
                Ok(Ok(None)) => {
                    let _ = write!(report, "; {sentinel}: does not know {}", self.master);
                    continue;
                }
                Ok(Err(e)) => {
                    let _ = write!(report, "; {sentinel}: {e}");
                    continue;
                }
                Err(_) => {
                    let _ = write!(report, "; {sentinel}: no answer in time");
                    continue;
                }
            };
            if tried.contains(&address) {
                let _ = write!(report, "; {sentinel}: {address} (refused above)");
                continue;
            }
            match self.try_open(&address, until, opener).await {
                Ok(connected) => return Ok(connected),
                Err(why) => {
                    let _ = write!(report, "; {sentinel}: {address}: {why}");
                }
            }
            tried.push(address);
        }
        Err(Error::unavailable(format!(
            "redis sentinel: no master {} could be reached{report}",
            self.master
        )))
    }

    /// Connects with `opener` to the server at `address` (`host:port`) only.
    /// It is the new master a failover announcement or a sentinel named; within `limit`.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] saying why it could not be opened.
    pub(crate) async fn connect_announced(
        &self,
        address: String,
        limit: Duration,
        opener: &Opener<'_>,
    ) -> Result<Connected> {
        let until = Instant::now() + limit;
        match self.try_open(&address, until, opener).await {
            Ok(connected) => Ok(connected),
            Err(why) => Err(Error::unavailable(format!(
                "redis sentinel: the server named as master {}, {address}: {why}",
                self.master
            ))),
        }
    }

    /// The URL of the server at `address` (`host:port`) as the master: credentials and db.
    pub(crate) fn master_url(&self, address: &str) -> String {
        self.parsed.with_address("redis", address, &self.db)
    }

    /// A connection to the master at `address` (`host:port`), made until `until`.
    /// Its server is `address`; an error says why not, as text.
    async fn try_open(
        &self,
        address: &str,
        until: Instant,
        opener: &Opener<'_>,
    ) -> std::result::Result<Connected, String> {
        let url = self.master_url(address);
        let limit = until.saturating_duration_since(Instant::now());
        match tokio::time::timeout_at(until, opener.open(&url, limit, Some(self))).await {
            Ok(Ok(mut connected)) => {
                connected.server = address.to_owned();
                Ok(connected)
            }
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("no answer in time".into()),
        }
    }

    /// `host:port` of the master as `sentinel` knows it, asked until `until`.
    async fn ask(&self, sentinel: &str, until: Instant) -> redis::RedisResult<Option<String>> {
        let limit = Some(until.saturating_duration_since(Instant::now()));
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(limit)
            .set_response_timeout(limit);
        let client = redis::Client::open(format!("redis://{sentinel}"))?;
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        let master: Option<(String, String)> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(&self.master)
            .query_async(&mut conn)
            .await?;
        Ok(master.map(|(host, port)| address(&host, &port)))
    }

    /// Fails unless the server on `conn` says it is a master.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] naming the role it has, for a sentinel that is behind.
    pub(crate) async fn check_master(&self, conn: &mut Link, url: &str) -> Result<()> {
        let role: Vec<redis::Value> = redis::cmd("ROLE")
            .query_async(conn)
            .await
            .map_err(|e| crate::error::map_error(e, "(ROLE)"))?;
        let role = role
            .first()
            .and_then(|r| redis::from_redis_value_ref::<String>(r).ok())
            .unwrap_or_default();
        if role == "master" {
            return Ok(());
        }
        Err(Error::unavailable(format!(
            "redis sentinel: the sentinels gave {} for master {}, which says it is a {role:?}",
            leasehold_core::support::redact_url(url),
            self.master
        )))
    }

    /// The new master's `host:port`, if a `+switch-master` message is about this master.
    /// The message is `name old-ip old-port new-ip new-port`.
    fn announced(&self, message: &str) -> Option<String> {
        match message.split(' ').collect::<Vec<_>>()[..] {
            [name, _, _, host, port] if name == self.master => Some(address(host, port)),
            _ => None,
        }
    }
}

/// `host:port`, with brackets around an IPv6 host.
fn address(host: &str, port: &str) -> String {
    match host.contains(':') {
        true => format!("[{host}]:{port}"),
        false => format!("{host}:{port}"),
    }
}

/// Tells `connection` of every server a sentinel names as the master.
/// It runs until `gone` says the backend was dropped.
/// It listens to one sentinel at a time for `+switch-master`, and after every [`PROBE`]
/// without a message asks that sentinel where the master is (which also covers an
/// announcement missed while it was not listening). A sentinel that does not answer within
/// `limit` is left for the next one.
///
/// # Cancel safety
///
/// Dropped, it closes its subscription.
pub(crate) async fn watch_failovers(
    sentinels: Sentinels,
    limit: Duration,
    mut gone: tokio::sync::watch::Receiver<()>,
    connection: std::sync::Weak<Connection>,
) {
    let watching = async {
        for sentinel in sentinels.addresses.iter().cycle() {
            let subscribed = tokio::time::timeout(limit, async {
                let client = redis::Client::open(format!("redis://{sentinel}"))?;
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe("+switch-master").await?;
                redis::RedisResult::Ok(pubsub)
            })
            .await;
            if let Ok(Ok(pubsub)) = subscribed {
                let mut messages = pubsub.into_on_message();
                loop {
                    let address = match tokio::time::timeout(PROBE, messages.next()).await {
                        Ok(Some(message)) => {
                            let text: String = message.get_payload().unwrap_or_default();
                            sentinels.announced(&text)
                        }
                        Ok(None) => break,
                        Err(_) => match sentinels.ask(sentinel, Instant::now() + limit).await {
                            Ok(address) => address,
                            Err(_) => break,
                        },
                    };
                    let Some(connection) = connection.upgrade() else {
                        return;
                    };
                    if let Some(address) = address {
                        connection.master_named(address).await;
                    }
                }
            }
            // Gone, or not there: the next one, after a pause that keeps a dead set quiet.
            tokio::time::sleep(limit.min(Duration::from_secs(1))).await;
        }
    };
    tokio::select! {
        _ = gone.changed() => {}
        () = watching => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::Address;

    #[test]
    fn sentinel_urls_name_the_sentinels_the_master_and_its_db() {
        let Address::Sentinel(s) = Address::of("redis+sentinel://u:pw@h1:1,h2:2/main/3").unwrap()
        else {
            panic!("not a sentinel address");
        };
        assert_eq!(s.addresses, ["h1:1", "h2:2"]);
        assert_eq!((s.master.as_str(), s.db.as_str()), ("main", "/3"));
        assert_eq!(
            s.master_url("10.0.0.1:6379"),
            "redis://u:pw@10.0.0.1:6379/3"
        );
        assert_eq!(
            s.announced("main 10.0.0.1 6379 10.0.0.2 6380").as_deref(),
            Some("10.0.0.2:6380")
        );
        assert_eq!(s.announced("mainly 10.0.0.1 6379 10.0.0.2 6380"), None);
        assert_eq!(s.announced("main 10.0.0.1"), None);
        let Address::Sentinel(s) = Address::of("redis+sentinel://h1,[::1]/main").unwrap() else {
            panic!("not a sentinel address");
        };
        assert_eq!(s.addresses, ["h1:26379", "[::1]:26379"]);
        for bad in [
            "redis+sentinel://h:1",
            "redis+sentinel://h:1/",
            "redis+sentinel://h:1/a b",
            "redis+sentinel://h:1/m/x",
            "redis+sentinel:///m",
        ] {
            assert!(
                matches!(Address::of(bad), Err(Error::InvalidArgument { .. })),
                "{bad}"
            );
        }
        assert!(matches!(
            Address::of("redis://h:1").unwrap(),
            Address::Fixed(url) if url == "redis://h:1"
        ));
    }
}
