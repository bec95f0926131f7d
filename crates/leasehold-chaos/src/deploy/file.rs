//! The file backend: OS file locks in a directory; every worker a process of its own.

use std::time::Duration;

use super::{BackendSpec, Home, ServerClock, Traits};

/// The registry entry.
pub static SPEC: BackendSpec = BackendSpec {
    name: "file",
    scheme: "file",
    traits: Traits {
        servers: false,
        network: false,
        processes: true,
        expiring: false,
        sessions: false,
        server_clock: ServerClock::None,
        restart_loses_locks: false,
    },
    ttl: Duration::from_millis(1000),
    home: Home::Directory,
    url: |dir, _| format!("file://{}", dir.first().map_or("", String::as_str)),
};
