//! PostgreSQL (lease mode): one server.
//!
//! Ready for the registry once the facade connects to `postgres://` URLs (add
//! `&postgres::SPEC` to [`REGISTRY`](super::REGISTRY)).

use std::time::Duration;

use leasehold_testkit::Postgres;

use super::{BackendSpec, ServerClock, Servers, Traits};

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
    start: |_| Box::pin(async { Ok(Servers::Postgres(Postgres::start().await?)) }),
    url: |eps, _| {
        format!(
            "postgres://postgres@{}/postgres",
            eps.first().map_or("", String::as_str)
        )
    },
};
