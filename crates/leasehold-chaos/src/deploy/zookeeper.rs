//! ZooKeeper: one server, or an ensemble of three; the session timeout is the run's ttl.

use std::time::Duration;

use super::{BackendSpec, Home, ServerClock, Traits};

/// The registry entry.
pub static SPEC: BackendSpec = BackendSpec {
    name: "zookeeper",
    scheme: "zk",
    traits: Traits {
        servers: true,
        network: true,
        processes: true,
        expiring: true,
        sessions: true,
        server_clock: ServerClock::None,
        restart_loses_locks: false,
    },
    // Within the test servers' bounds (2 to 20 ticks of 200 ms).
    ttl: Duration::from_millis(1000),
    home: Home::Servers,
    url: |eps, ttl| {
        format!(
            "zk://{}?session_timeout={}ms",
            eps.join(","),
            ttl.as_millis()
        )
    },
};
