//! The connection to one Redis server: RESP3, multiplexed, reconnecting.
//! It uses TLS for `rediss://` and routes push messages to the wake-ups; connecting loads
//! the scripts and checks the eviction policy; it is replaced when it stops answering
//! without closing.
//!
//! redis-rs reconnects a connection that fails or closes, but not one that stays open and
//! silent (a partition that drops packets, a peer gone without a reset). [`Connection`]
//! counts the requests given up on while nothing came back (`support::health`) and, after
//! a few in a row, opens a new connection — with the wake-up channels in use subscribed
//! on it before it serves anything — and wakes every waiter, as after a reconnection. A
//! server that is only slow looks the same from here, so after one replacement the next
//! waits at least a connect timeout. A Redlock node's requests are dropped on purpose once
//! a majority has answered: there only the node timeouts Redlock reports count.
//!
//! Through Sentinel the connection is replaced as well when its server stops being the
//! master (an answer `READONLY` or `MASTERDOWN`, a connection lost or refused), or when a
//! sentinel names another master. The sentinels say where the master is (`sentinel.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures_util::future::join_all;
use leasehold_core::support::health::{Health, Silence};
use leasehold_core::support::redact_url;
use leasehold_core::{Error, OwnerId, Result};
use redis::aio::ConnectionManagerConfig;
use redis::{ConnectionInfo, IntoConnectionInfo, ProtocolVersion, RedisError, TlsCertificates};

use crate::error::{is_link_error, map_error};
use crate::link::{Address, Link};
use crate::options::RedisOptions;
use crate::reply;
use crate::script::{Call, Calls, RENEW_MANY_CODE};
use crate::sentinel::Sentinels;
use crate::wakeups::{Router, Wakeups};

/// A connection made and checked.
#[derive(Debug)]
pub(crate) struct Connected {
    pub(crate) conn: Link,
    /// The server: `host:port` through Sentinel, else the URL.
    pub(crate) server: String,
    /// Configuration problems found (see [`RedisBackend::warnings`](crate::RedisBackend::warnings)).
    pub(crate) warnings: Vec<String>,
    /// The server's run id, if asked for.
    pub(crate) run_id: Option<String>,
    /// The connection as its server knows it; none in a Cluster or if `CLIENT` is refused.
    pub(crate) client: Option<ServerClient>,
}

/// One connection as its server knows it: its `CLIENT ID` and the random name given it.
#[derive(Debug, Clone)]
pub(crate) struct ServerClient {
    id: i64,
    name: String,
}

/// The connection a backend sends its requests on, replaced when it stalls.
#[derive(Debug)]
pub(crate) struct Connection {
    /// Itself, for a replacement to run in a task of its own.
    me: std::sync::Weak<Connection>,
    current: RwLock<Link>,
    address: Address,
    /// The server connected to (see [`Connected::server`]).
    serving: RwLock<String>,
    /// The connection as the server knows it (see [`Connected::client`]).
    client: RwLock<Option<ServerClient>>,
    /// Through Sentinel: the server may no longer be the master (see the module docs).
    moved: AtomicBool,
    options: RedisOptions,
    wakeups: Arc<Wakeups>,
    health: Health,
    /// Whether a request dropped unanswered counts as given up on (not on a Redlock node).
    drops_count: bool,
    /// When the connection was last replaced; held while it is replaced (one at a time).
    replaced: tokio::sync::Mutex<Option<std::time::Instant>>,
    /// Counts the replacements: a change feed that follows the server moves with it.
    moves: tokio::sync::watch::Sender<u64>,
}

impl Connection {
    /// `connected`, to `address` with `options`, its push messages routed to `wakeups`.
    /// A request dropped unanswered counts as given up on if `drops_count`.
    pub(crate) fn new(
        connected: Connected,
        address: Address,
        options: RedisOptions,
        wakeups: Arc<Wakeups>,
        drops_count: bool,
    ) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            me: me.clone(),
            current: RwLock::new(connected.conn),
            address,
            serving: RwLock::new(connected.server),
            client: RwLock::new(connected.client),
            moved: AtomicBool::new(false),
            options,
            wakeups,
            health: Health::new(),
            drops_count,
            replaced: tokio::sync::Mutex::new(None),
            moves: tokio::sync::watch::Sender::new(0),
        })
    }

    /// Where it connects.
    pub(crate) fn address(&self) -> &Address {
        &self.address
    }

    /// Changes each time the connection is replaced (through Sentinel: maybe by another server's).
    pub(crate) fn moves(&self) -> tokio::sync::watch::Receiver<u64> {
        self.moves.subscribe()
    }

    /// The options it was made with.
    pub(crate) fn options(&self) -> &RedisOptions {
        &self.options
    }

    /// The script calls for its server: `SPUBLISH` in a Cluster, else `PUBLISH`.
    pub(crate) fn calls(&self) -> &'static Calls {
        self.address.calls()
    }

    /// The connection as it is now.
    pub(crate) fn current(&self) -> Link {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The connection to send a request on, replaced first if it has to be.
    /// That is if it stalled, or through Sentinel if its server may no longer be the master.
    /// The request reports to the connection's health through
    /// [`query`](Connection::query).
    ///
    /// # Cancel safety
    ///
    /// The replacement runs in a task of its own: a request that gives up (its timeout)
    /// does not cut it short, and the requests after it find the new connection.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] if the connection cannot be replaced.
    pub(crate) async fn for_request(&self) -> Result<Link> {
        if (self.health.is_stalled() || self.moved.load(Ordering::SeqCst))
            && let Some(me) = self.me.upgrade()
        {
            tokio::spawn(async move { me.replace(None).await })
                .await
                .map_err(|e| {
                    Error::unavailable(format!("redis: replacing the connection: {e}"))
                })??;
        }
        if self.wakeups.take_disconnected()
            && !self.is_cluster()
            && let Some(me) = self.me.upgrade()
        {
            tokio::spawn(async move { me.rename().await });
        }
        Ok(self.current())
    }

    /// Names the connection again, after redis-rs reconnected it by itself.
    /// The server then knows it under another id, without a name; a replacement could not
    /// end it (see [`end_client`]). Done between replacements, within the connect timeout.
    async fn rename(&self) {
        let _replacing = self.replaced.lock().await;
        let mut link = self.current();
        let limit = self.options.connect_limit();
        if let Ok(Some(client)) = tokio::time::timeout(limit, name_client(&mut link)).await {
            *self.client.write().unwrap_or_else(|e| e.into_inner()) = Some(client);
        }
    }

    /// A sentinel named `address` (`host:port`) as the master: the connection moves there.
    /// It does so now if that is another server and it says it is the master; otherwise it
    /// stays (a sentinel may be behind). A server that stops being the master is left
    /// anyway at the next request.
    ///
    /// # Cancel safety
    ///
    /// Dropped, the connection stays where it was.
    pub(crate) async fn master_named(&self, address: String) {
        if let Err(e) = self.replace(Some(address)).await {
            tracing::debug!("redis sentinel: not moving to the server a sentinel named: {e}");
        }
    }

    /// Sends `cmd` on the connection, noting whether an answer came.
    pub(crate) async fn query<T: redis::FromRedisValue>(
        &self,
        conn: &mut Link,
        cmd: &redis::Cmd,
    ) -> redis::RedisResult<T> {
        self.noted(cmd.query_async(conn)).await
    }

    /// Sends `cmd`, which has no key, to the server that holds `key`.
    /// That is the master of its slot in a Cluster (see [`Link::query_at`]); whether an
    /// answer came is noted as by [`query`](Connection::query).
    pub(crate) async fn query_at<T: redis::FromRedisValue>(
        &self,
        conn: &mut Link,
        key: &str,
        cmd: &redis::Cmd,
    ) -> redis::RedisResult<T> {
        self.noted(conn.query_at(key, cmd)).await
    }

    /// Sends `cmd` to the server that holds `slot` (see [`Link::query_in`]).
    /// Whether an answer came is noted as by [`query`](Connection::query).
    pub(crate) async fn query_in<T: redis::FromRedisValue>(
        &self,
        conn: &mut Link,
        slot: u16,
        cmd: &redis::Cmd,
    ) -> redis::RedisResult<T> {
        self.noted(conn.query_in(slot, cmd)).await
    }

    /// Sends `pipeline` to the server that holds `slot` (see [`Link::pipeline_in`]).
    /// Whether an answer came is noted as by [`query`](Connection::query).
    pub(crate) async fn pipeline_in(
        &self,
        conn: &mut Link,
        slot: u16,
        pipeline: &redis::Pipeline,
    ) -> redis::RedisResult<Vec<redis::Value>> {
        self.noted(conn.pipeline_in(slot, pipeline)).await
    }

    /// Whether the server is a Redis Cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self.address, Address::Cluster(_))
    }

    /// Runs `request`, noting in the connection's health whether an answer came.
    /// Through Sentinel, an answer that says the server may no longer be the master moves it.
    async fn noted<T>(
        &self,
        request: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> redis::RedisResult<T> {
        let mut in_flight = self.health.request();
        if !self.drops_count {
            in_flight = in_flight.uncounted();
        }
        let answer = request.await;
        in_flight.answered();
        if let (Err(e), Address::Sentinel(_)) = (&answer, &self.address)
            && (matches!(e.code(), Some("READONLY" | "MASTERDOWN")) || is_link_error(e))
        {
            self.moved.store(true, Ordering::SeqCst);
        }
        answer
    }

    /// What the connection has answered so far, for [`given_up`](Connection::given_up).
    pub(crate) fn silence(&self) -> Silence {
        self.health.silence()
    }

    /// A request sent at `since` timed out: counts as given up on if nothing was answered since.
    pub(crate) fn given_up(&self, since: Silence) {
        self.health.given_up(since);
    }

    /// Puts a new connection in place of the stalled one, and wakes every waiter.
    /// Through Sentinel also when the server may no longer be the master, or when
    /// `announced` (a failover announcement's new master, `host:port`) is another server:
    /// then only that one is tried. The new connection is opened and the wake-up channels
    /// in use are subscribed on it first, within twice the connect timeout; waiters are
    /// woken because messages may have been lost. On the same server the old connection is
    /// ended first, within another connect timeout (see [`end_client`]); if that fails
    /// the new connection is used all the same, and the failure logged.
    async fn replace(&self, announced: Option<String>) -> Result<()> {
        let mut replaced = self.replaced.lock().await;
        let limit = self.options.connect_limit();
        let url = redact_url(self.address.url());
        let moved = match &announced {
            Some(address) if *address == self.serving() => return Ok(()),
            Some(address) => {
                tracing::info!(%url, %address, "redis sentinel: a sentinel named another master");
                false
            }
            None => {
                // Taken now: a signal that comes while this replacement runs asks for another.
                let moved = self.moved.swap(false, Ordering::SeqCst);
                let recently = replaced.is_some_and(|at| at.elapsed() < limit);
                if moved {
                    tracing::info!(%url, "redis sentinel: finding the master");
                } else if !self.health.is_stalled() || recently {
                    // Replaced by someone else meanwhile, or lately: wait for an answer or the time.
                    return Ok(());
                } else {
                    tracing::warn!(%url, "redis: the connection stopped answering; opening a new one");
                }
                moved
            }
        };
        let opening = async {
            let push = Router(self.wakeups.clone());
            let mut fresh = connect(&self.address, &self.options, push, false, announced).await?;
            let subscribed =
                tokio::time::timeout(limit, self.wakeups.subscribe_all(&mut fresh.conn))
                    .await
                    .map_err(|_| {
                        Error::unavailable(format!(
                            "redis: subscribing on a new connection to {url} timed out"
                        ))
                    })??;
            Ok((fresh, subscribed))
        };
        let (mut fresh, subscribed) = match opening.await {
            Ok(opened) => opened,
            Err(e) => {
                if moved {
                    self.moved.store(true, Ordering::SeqCst);
                }
                return Err(e);
            }
        };
        let old = self
            .client
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(old) = old.filter(|_| fresh.server == self.serving()) {
            // Before any request goes on the new connection: what the old one holds must
            // not run after them.
            match tokio::time::timeout(limit, end_client(&mut fresh.conn, &old)).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    tracing::warn!(%url, %error, "redis: the old connection could not be ended");
                }
                Err(_) => tracing::warn!(%url, "redis: ending the old connection timed out"),
            }
        }
        self.wakeups.replaced(subscribed, || {
            *self.current.write().unwrap_or_else(|e| e.into_inner()) = fresh.conn;
        });
        *self.serving.write().unwrap_or_else(|e| e.into_inner()) = fresh.server;
        *self.client.write().unwrap_or_else(|e| e.into_inner()) = fresh.client;
        self.moves.send_modify(|moves| *moves += 1);
        *replaced = Some(std::time::Instant::now());
        self.health.reset();
        self.wakeups.wake_all();
        Ok(())
    }

    /// The server the connection goes to: `host:port` through Sentinel, else the URL.
    pub(crate) fn serving(&self) -> String {
        self.serving
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Connects to the server at `address` within the options' connect timeout, or fails.
/// Within that time it also loads every script, reads the eviction policy and, with
/// `run_id`, the server's run id. Through Sentinel the server is a master the sentinels
/// name, which must say it is one; with `announced` (`host:port`) only that server is tried.
/// A Cluster has no one run id: `run_id` (a Redlock node) is refused there.
pub(crate) async fn connect(
    address: &Address,
    options: &RedisOptions,
    push: Router,
    run_id: bool,
    announced: Option<String>,
) -> Result<Connected> {
    let limit = options.connect_limit();
    let opener = Opener {
        options,
        push,
        run_id,
        calls: address.calls(),
    };
    match (address, announced) {
        (Address::Fixed(url), _) => opener.open(url, limit, None).await,
        (Address::Sentinel(sentinels), Some(address)) => {
            sentinels.connect_announced(address, limit, &opener).await
        }
        (Address::Sentinel(sentinels), None) => sentinels.connect_master(limit, &opener).await,
        (Address::Cluster(nodes), _) if run_id => Err(Error::invalid(
            "url",
            format!(
                "{}: a Redlock node is one server, not a Redis Cluster",
                redact_url(nodes.url())
            ),
        )),
        (Address::Cluster(nodes), _) => nodes.connect(options, opener.push, address.calls()).await,
    }
}

/// What connecting to one server needs, besides where and how long.
pub(crate) struct Opener<'a> {
    options: &'a RedisOptions,
    push: Router,
    run_id: bool,
    calls: &'static Calls,
}

impl Opener<'_> {
    /// Connects to the server at `url` within `limit`, as [`connect`] says.
    /// Through Sentinel, `sentinels` checks that it is the master.
    pub(crate) async fn open(
        &self,
        url: &str,
        limit: Duration,
        sentinels: Option<&Sentinels>,
    ) -> Result<Connected> {
        connect_url(url, self, limit, sentinels).await
    }
}

/// What [`Opener::open`] does.
async fn connect_url(
    url: &str,
    opener: &Opener<'_>,
    limit: Duration,
    sentinels: Option<&Sentinels>,
) -> Result<Connected> {
    let shown = redact_url(url);
    let client = client(url, opener.options)?;
    let config = ConnectionManagerConfig::new()
        .set_push_sender(opener.push.clone())
        .set_automatic_resubscription()
        .set_connection_timeout(Some(limit))
        // A refused connection fails fast; later reconnects are retried per request.
        .set_number_of_retries(2)
        // Every request is bounded by the engine's request timeout instead.
        .set_response_timeout(None);
    let connecting = async {
        let mut conn = Link::Server(
            client
                .get_connection_manager_with_config(config)
                .await
                .map_err(|e| Error::Unavailable {
                    message: format!("cannot connect to redis at {shown}: {e}"),
                    source: Some(Arc::new(e)),
                })?,
        );
        // One round trip: the requests share the connection. The scripts are loaded up
        // front, so that even the first grant is one round trip (after a server restart
        // EVALSHA falls back to loading them again).
        let (mut config_conn, mut info_conn) = (conn.clone(), conn.clone());
        let mut client_conn = conn.clone();
        let (loaded, warning, id, client) = tokio::join!(
            load_scripts(&mut conn, opener.calls),
            eviction_warning(&mut config_conn),
            async {
                match opener.run_id {
                    true => Some(server_run_id(&mut info_conn).await),
                    false => None,
                }
            },
            name_client(&mut client_conn)
        );
        loaded?;
        if let Some(sentinels) = sentinels {
            sentinels.check_master(&mut conn, url).await?;
        }
        Ok(Connected {
            conn,
            server: url.to_owned(),
            warnings: warning?.into_iter().collect(),
            run_id: id.transpose()?,
            client,
        })
    };
    let connected = tokio::time::timeout(limit, connecting)
        .await
        .map_err(|_| {
            Error::unavailable(format!("connecting to {shown} timed out after {limit:?}"))
        })??;
    for warning in &connected.warnings {
        tracing::warn!(url = %shown, "{warning}");
    }
    Ok(connected)
}

/// The redis-rs client for `url`: RESP3 (push messages), TLS with the options' files.
pub(crate) fn client(url: &str, options: &RedisOptions) -> Result<redis::Client> {
    let info = connection_info(url, options)?;
    match tls_certificates(options) {
        None => redis::Client::open(info),
        Some(certificates) => redis::Client::build_with_tls(info, certificates),
    }
    .map_err(|e| Error::invalid("url", format!("{}: {e}", redact_url(url))))
}

/// Where and how to connect for `url`: RESP3 (push messages); TLS checked against the options.
pub(crate) fn connection_info(url: &str, options: &RedisOptions) -> Result<ConnectionInfo> {
    let info = url.into_connection_info().map_err(|e| {
        Error::invalid(
            "url",
            format!(
                "{}: {}",
                redact_url(url),
                e.detail().unwrap_or("not a redis URL")
            ),
        )
    })?;
    let settings = info
        .redis_settings()
        .clone()
        .set_protocol(ProtocolVersion::RESP3);
    if options.check_tls(url)? {
        install_crypto_provider();
    }
    Ok(info.set_redis_settings(settings))
}

/// The options' TLS files as redis-rs takes them, if any are given.
pub(crate) fn tls_certificates(options: &RedisOptions) -> Option<TlsCertificates> {
    let tls = options.tls_files();
    (!tls.is_empty()).then(|| TlsCertificates {
        client_tls: tls
            .client
            .clone()
            .map(|(client_cert, client_key)| redis::ClientTlsConfig {
                client_cert,
                client_key,
            }),
        root_cert: tls.ca.clone(),
    })
}

/// Loads every script of `calls`, and the batch renewal.
/// On a server's connection they go together, in one round trip; in a Cluster to every
/// node (where `SCRIPT LOAD` goes to all of them).
pub(crate) async fn load_scripts(conn: &mut Link, calls: &Calls) -> Result<()> {
    let codes = calls.all().map(Call::script_code);
    let each = codes.into_iter().chain([RENEW_MANY_CODE]).map(|code| {
        let mut conn = conn.clone();
        async move {
            redis::cmd("SCRIPT")
                .arg("LOAD")
                .arg(code)
                .query_async::<redis::Value>(&mut conn)
                .await
        }
    });
    for loaded in join_all(each).await {
        loaded.map_err(|e| map_error(e, "(loading scripts)"))?;
    }
    Ok(())
}

/// Describes a configuration in which the server may evict lock keys.
async fn eviction_warning(conn: &mut Link) -> Result<Option<String>> {
    let config: std::result::Result<HashMap<String, String>, RedisError> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory*")
        .query_async(conn)
        .await;
    match config {
        Ok(config) => Ok(reply::eviction_warning(&config)),
        // CONFIG may be renamed away or not permitted: then there is nothing to say.
        Err(e)
            if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError)
                || e.code()
                    .is_some_and(|code| code == "NOPERM" || code == "ERR") =>
        {
            Ok(None)
        }
        Err(e) => Err(map_error(e, "(CONFIG GET)")),
    }
}

/// Names the connection with a random name and reads its id (`CLIENT SETNAME`, `CLIENT ID`).
/// That lets a replacement end it on the server ([`end_client`]). None where the server
/// refuses either (`CLIENT` not permitted to the user): that connection is replaced
/// without being ended.
async fn name_client(conn: &mut Link) -> Option<ServerClient> {
    let name = format!("leasehold-{}", OwnerId::generate());
    let mut naming = redis::pipe();
    naming.cmd("CLIENT").arg("SETNAME").arg(&name).ignore();
    naming.cmd("CLIENT").arg("ID");
    match naming.query_async::<(i64,)>(conn).await {
        Ok((id,)) => Some(ServerClient { id, name }),
        Err(error) => {
            tracing::debug!(%error, "redis: the connection cannot be named; it will not be ended when replaced");
            None
        }
    }
}

/// Ends the server's side of the connection `old`, through `conn` to the same server.
/// What `old` still carries is then never run: a request held in the network on a link
/// given up as silent would otherwise run when the link heals, after the requests sent
/// since on `conn` (an acquire after its own release, granting the lock to an owner that
/// has gone until its lease ends). The client of `old`'s id is ended only if it has
/// `old`'s name still: ids start over when a server restarts.
async fn end_client(conn: &mut Link, old: &ServerClient) -> Result<()> {
    let what = "(ending a replaced connection)";
    let listed: String = redis::cmd("CLIENT")
        .arg("LIST")
        .arg("ID")
        .arg(old.id)
        .query_async(conn)
        .await
        .map_err(|e| map_error(e, what))?;
    if !reply::lists_client_named(&listed, &old.name) {
        tracing::info!(
            id = old.id,
            "redis: the replaced connection is gone from the server, or is not the one named"
        );
        return Ok(());
    }
    let _ended: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(old.id)
        .query_async(conn)
        .await
        .map_err(|e| map_error(e, what))?;
    Ok(())
}

/// The server's run id (`INFO server`): tells two addresses of one server apart.
async fn server_run_id(conn: &mut Link) -> Result<String> {
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(conn)
        .await
        .map_err(|e| map_error(e, "(INFO)"))?;
    reply::run_id(&info)
}

/// Makes ring rustls's crypto provider for this process, unless one is set already.
fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
