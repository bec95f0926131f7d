//! One redis-server (no persistence), a primary with a replica, or one that evicts.
//! The replica is asynchronous; the evicting one evicts keys with a TTL under memory
//! pressure.

use std::time::Duration;

use super::{BackendSpec, Home, ServerClock, Traits};

/// What redis-servers without persistence are, reached through the checker's proxies.
pub(crate) const TRAITS: Traits = Traits {
    servers: true,
    network: true,
    processes: true,
    expiring: true,
    sessions: false,
    server_clock: ServerClock::ExpireEarly,
    restart_loses_locks: true,
};

/// The registry entry.
pub static SPEC: BackendSpec = BackendSpec {
    name: "redis",
    scheme: "redis",
    traits: TRAITS,
    ttl: Duration::from_millis(1000),
    home: Home::Servers,
    url: |eps, _| format!("redis://{}", eps.first().map_or("", String::as_str)),
};
