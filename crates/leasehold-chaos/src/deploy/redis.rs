//! One redis-server (no persistence), a primary with a replica, or one that evicts.
//! The replica is asynchronous; the evicting one evicts keys with a TTL under memory
//! pressure.

use std::time::Duration;

use super::{BackendSpec, Home, ServerClock, Traits};

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
    home: Home::Servers,
    url: |eps, _| format!("redis://{}", eps.first().map_or("", String::as_str)),
};
