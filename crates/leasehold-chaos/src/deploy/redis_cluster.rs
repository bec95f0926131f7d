//! A Redis Cluster of three masters, each with a replica (no persistence).
//!
//! Workers learn the nodes' addresses from the cluster and connect to them directly, so no
//! fault proxy of the checker's is on that path: the scenarios that need one per worker do
//! not apply. A node is seen failing after 5 s without an answer (2 s where a scenario
//! fails a master over), and a replica of a failed master takes its place.

use std::time::Duration;

use super::{BackendSpec, Home, Traits};

/// The registry entry. Its endpoints are every node.
pub static SPEC: BackendSpec = BackendSpec {
    name: "redis-cluster",
    scheme: "redis+cluster",
    traits: Traits {
        network: false,
        ..super::redis::TRAITS
    },
    ttl: Duration::from_millis(1000),
    home: Home::Servers,
    url: |eps, _| format!("redis+cluster://{}", eps.join(",")),
};
