//! etcd: one member, or a cluster of three; the session lease is the run's ttl.

use std::time::Duration;

use leasehold_testkit::Etcd;

use super::{BackendSpec, ServerClock, Servers, Topology, Traits, whole_seconds};

/// The registry entry.
pub static SPEC: BackendSpec = BackendSpec {
    name: "etcd",
    scheme: "etcd",
    traits: Traits {
        servers: true,
        network: true,
        processes: true,
        expiring: true,
        sessions: true,
        // libfaketime cannot reach a Go binary, and etcd's leases run on its monotonic
        // clock anyway.
        server_clock: ServerClock::None,
        restart_loses_locks: false,
    },
    ttl: Duration::from_millis(1000),
    start: |topology| {
        Box::pin(async move {
            Ok(Servers::Etcd(match topology {
                Topology::Cluster => Etcd::cluster(3).await?,
                _ => Etcd::start().await?,
            }))
        })
    },
    url: |eps, ttl| {
        format!(
            "etcd://{}?session_ttl={}s",
            eps.join(","),
            whole_seconds(ttl)
        )
    },
};
