//! The in-memory backend: one server inside the worker process, shared by every worker.
//! The workers of the run are tasks of that one process, with a link of the harness's each.

use std::time::Duration;

use super::{BackendSpec, Home, ServerClock, Traits};

/// The registry entry.
pub static SPEC: BackendSpec = BackendSpec {
    name: "memory",
    scheme: "memory",
    traits: Traits {
        servers: false,
        network: false,
        processes: false,
        expiring: true,
        sessions: false,
        server_clock: ServerClock::None,
        restart_loses_locks: true,
    },
    ttl: Duration::from_millis(1000),
    home: Home::InProcess,
    url: |_, _| "memory:".into(),
};
