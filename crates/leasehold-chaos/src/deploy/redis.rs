//! One redis-server (no persistence), or a primary with an asynchronous replica, or one
//! that evicts keys with a TTL under memory pressure.

use std::time::Duration;

use leasehold_testkit::{Redis, RedisReplicated};

use super::{BackendSpec, ServerClock, Servers, Topology, Traits};

/// The registry entry.
pub static SPEC: BackendSpec = BackendSpec {
    name: "redis",
    scheme: "redis",
    traits: Traits {
        servers: true,
        network: true,
        processes: true,
        expiring: true,
        sessions: false,
        server_clock: ServerClock::ExpireEarly,
        restart_loses_locks: true,
    },
    ttl: Duration::from_millis(1000),
    start: |topology| {
        Box::pin(async move {
            Ok(match topology {
                Topology::Replicated => {
                    Servers::Replicated(Box::new(RedisReplicated::start().await?))
                }
                Topology::Evicting => Servers::Redis(vec![
                    Redis::builder()
                        .config("maxmemory-policy", "volatile-lru")
                        .config("maxmemory-samples", "10")
                        .start()
                        .await?,
                ]),
                _ => Servers::Redis(vec![Redis::start().await?]),
            })
        })
    },
    url: |eps, _| format!("redis://{}", eps.first().map_or("", String::as_str)),
};
