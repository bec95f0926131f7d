//! One redis-server (no persistence), or a primary with an asynchronous replica, or one
//! that evicts keys with a TTL under memory pressure.

use std::io;
use std::time::{Duration, Instant};

use leasehold_testkit::{FaultProxy, Redis};

use super::{BackendSpec, Replicated, ServerClock, Servers, Topology, Traits};

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
                Topology::Replicated => Servers::Replicated(Box::new(replicated().await?)),
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

/// A primary and a replica that replicates through a fault proxy, so that replication can
/// be held back (bytes held in the proxy, then dropped), which pausing the replica cannot
/// do: what the primary sent waits in the replica's socket and is applied on resume.
async fn replicated() -> io::Result<Replicated> {
    let primary = Redis::start().await?;
    let link = FaultProxy::start(primary.addr()).await?;
    let replica = Redis::builder()
        .config("replicaof", &format!("127.0.0.1 {}", link.port()))
        .start()
        .await?;
    let started = Instant::now();
    loop {
        let info = replica.command(&["INFO", "replication"]).await?;
        if info
            .text()
            .is_some_and(|t| t.contains("master_link_status:up"))
        {
            break;
        }
        if started.elapsed() > Duration::from_secs(30) {
            return Err(io::Error::other(
                "the replica did not connect to its primary",
            ));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    Ok(Replicated {
        primary,
        replica,
        link,
    })
}
