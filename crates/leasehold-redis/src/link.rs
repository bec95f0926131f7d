//! Where Redis is ([`Address`]) and the link requests go over ([`Link`]).
//!
//! A link is one server's connection, or a Redis Cluster's: redis-rs's cluster connection
//! routes each request to the master of its key's slot, follows `MOVED` and `ASK`, and
//! refreshes the slot map on its own. What differs between the two is said here once:
//! wake-up channels are subscribed with `SSUBSCRIBE` in a Cluster (sharded pub/sub: a
//! release publishes on its own shard, not to every node), one channel per command since
//! they lie in different slots, on a cluster connection of their own; and `WAIT` goes to
//! the master of the lock's slot.

use futures_util::future::join_all;
use leasehold_core::Result;
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

use crate::cluster::{CLUSTER_SCHEMES, ClusterNodes};
use crate::script::{CALLS, Calls, SHARDED_CALLS};
use crate::sentinel::{SENTINEL_SCHEME, Sentinels};

/// Where the server is.
#[derive(Debug, Clone)]
pub(crate) enum Address {
    /// `redis://…` or `rediss://…`.
    Fixed(String),
    /// `redis+sentinel://…`: wherever the sentinels say the master is.
    Sentinel(Sentinels),
    /// `redis+cluster://…` or `rediss+cluster://…`: the masters of a Redis Cluster.
    Cluster(ClusterNodes),
}

impl Address {
    /// The address of the base URL `url` (no parameters; see `options::parse_url`).
    ///
    /// # Errors
    ///
    /// [`leasehold_core::Error::InvalidArgument`] for a Sentinel URL without a valid
    /// master name, or a Cluster URL with a path.
    pub(crate) fn of(url: &str) -> Result<Address> {
        match leasehold_core::support::url::scheme(url).as_deref() {
            Some(SENTINEL_SCHEME) => Sentinels::parse(url).map(Address::Sentinel),
            Some(scheme) if CLUSTER_SCHEMES.contains(&scheme) => {
                ClusterNodes::parse(url).map(Address::Cluster)
            }
            _ => Ok(Address::Fixed(url.to_owned())),
        }
    }

    /// The URL given, for messages (credentials are redacted where it is shown).
    pub(crate) fn url(&self) -> &str {
        match self {
            Address::Fixed(url) => url,
            Address::Sentinel(sentinels) => sentinels.url(),
            Address::Cluster(nodes) => nodes.url(),
        }
    }

    /// The script calls for it: a Cluster's publish wake-ups with `SPUBLISH`.
    pub(crate) fn calls(&self) -> &'static Calls {
        match self {
            Address::Cluster(_) => &SHARDED_CALLS,
            Address::Fixed(_) | Address::Sentinel(_) => &CALLS,
        }
    }
}

/// The link requests go over: one server's connection, or a Cluster's.
/// Clones share the link.
#[derive(Clone)]
pub(crate) enum Link {
    Server(ConnectionManager),
    /// A Cluster's links: one for requests, one for sharded subscriptions.
    /// A node that gives a slot away sends an unasked `sunsubscribe`, which redis-rs takes
    /// for the answer to the oldest request on that connection. On the subscriptions' own
    /// connection it can only answer a subscription.
    Cluster {
        commands: ClusterConnection,
        subscriptions: ClusterConnection,
    },
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Link::Server(conn) => conn.fmt(f),
            Link::Cluster { .. } => f.write_str("ClusterConnection"),
        }
    }
}

impl Link {
    /// Subscribes to the wake-up `channels` (`SUBSCRIBE`; `SSUBSCRIBE` in a Cluster).
    ///
    /// # Cancel safety
    ///
    /// Dropped, some of the channels may be subscribed and others not.
    pub(crate) async fn subscribe(&mut self, channels: &[&str]) -> RedisResult<()> {
        match self {
            Link::Server(conn) => conn.subscribe(channels).await,
            Link::Cluster { subscriptions, .. } => {
                let each = channels.iter().map(|channel| {
                    let mut conn = subscriptions.clone();
                    async move { conn.ssubscribe(channel).await }
                });
                join_all(each).await.into_iter().collect()
            }
        }
    }

    /// Unsubscribes from the wake-up `channels`, as [`subscribe`](Link::subscribe) subscribed.
    ///
    /// # Cancel safety
    ///
    /// Dropped, some of the channels may stay subscribed.
    pub(crate) async fn unsubscribe(&mut self, channels: &[&str]) -> RedisResult<()> {
        match self {
            Link::Server(conn) => conn.unsubscribe(channels).await,
            Link::Cluster { subscriptions, .. } => {
                let each = channels.iter().map(|channel| {
                    let mut conn = subscriptions.clone();
                    async move { conn.sunsubscribe(channel).await }
                });
                join_all(each).await.into_iter().collect()
            }
        }
    }

    /// Sends `cmd` to the server that holds `key`: in a Cluster the master of its slot.
    /// For a command without keys that must reach that server (`WAIT`).
    pub(crate) async fn query_at<T: redis::FromRedisValue>(
        &mut self,
        key: &str,
        cmd: &Cmd,
    ) -> RedisResult<T> {
        self.query_on(Route::with_key(key, SlotAddr::Master), cmd)
            .await
    }

    /// Sends `cmd` to the server that holds `slot`: in a Cluster the master of the slot.
    /// For a command about one master's keys (`SCAN`).
    pub(crate) async fn query_in<T: redis::FromRedisValue>(
        &mut self,
        slot: u16,
        cmd: &Cmd,
    ) -> RedisResult<T> {
        self.query_on(Route::new(slot, SlotAddr::Master), cmd).await
    }

    /// Sends `cmd` along `route` in a Cluster; on one server, to it.
    async fn query_on<T: redis::FromRedisValue>(
        &mut self,
        route: Route,
        cmd: &Cmd,
    ) -> RedisResult<T> {
        match self {
            Link::Server(conn) => cmd.query_async(conn).await,
            Link::Cluster { commands, .. } => {
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route));
                let value = commands.route_command(cmd.clone(), routing).await?;
                T::from_redis_value(value).map_err(Into::into)
            }
        }
    }

    /// Sends `pipeline` to the server that holds `slot`, as [`query_in`](Link::query_in) does.
    /// Every command's reply comes back, an error as [`Value::ServerError`]; the keys of
    /// its commands must all be on that server.
    pub(crate) async fn pipeline_in(
        &mut self,
        slot: u16,
        pipeline: &Pipeline,
    ) -> RedisResult<Vec<Value>> {
        match self {
            Link::Server(conn) => conn.req_packed_commands(pipeline, 0, pipeline.len()).await,
            Link::Cluster { commands, .. } => {
                let route = SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master));
                (commands.route_pipeline(pipeline.clone(), 0, pipeline.len(), route)).await
            }
        }
    }
}

impl ConnectionLike for Link {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Link::Server(conn) => conn.req_packed_command(cmd),
            Link::Cluster { commands, .. } => commands.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Link::Server(conn) => conn.req_packed_commands(pipeline, offset, count),
            Link::Cluster { commands, .. } => commands.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Link::Server(conn) => conn.get_db(),
            Link::Cluster { commands, .. } => commands.get_db(),
        }
    }
}
