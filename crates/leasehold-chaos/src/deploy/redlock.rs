//! Redlock over three independent redis-servers (no persistence).

use std::time::Duration;

use super::{BackendSpec, Home, ServerClock, Traits};

/// The registry entry.
pub static SPEC: BackendSpec = BackendSpec {
    name: "redlock",
    scheme: "redlock",
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
    url: |eps, _| format!("redlock://{}", eps.join(",")),
};
