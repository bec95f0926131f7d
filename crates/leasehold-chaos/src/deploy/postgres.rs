//! PostgreSQL (lease mode): one server, under libfaketime where it is installed.
//! So scenario 10 can move the server's wall clock (the one its leases are counted on).

use std::time::Duration;

use super::{BackendSpec, Home, ServerClock, Traits};

/// The registry entry.
pub static SPEC: BackendSpec = BackendSpec {
    name: "postgres",
    scheme: "postgres",
    traits: Traits {
        servers: true,
        network: true,
        processes: true,
        expiring: true,
        sessions: false,
        server_clock: ServerClock::Faketime,
        restart_loses_locks: false,
    },
    ttl: Duration::from_millis(1000),
    home: Home::Servers,
    url: |eps, _| {
        format!(
            "postgres://postgres@{}/postgres",
            eps.first().map_or("", String::as_str)
        )
    },
};
