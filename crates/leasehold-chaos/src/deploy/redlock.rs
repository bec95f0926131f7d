//! Redlock over three independent redis-servers (no persistence).

use std::time::Duration;

use super::{BackendSpec, Home};

/// The registry entry.
pub static SPEC: BackendSpec = BackendSpec {
    name: "redlock",
    scheme: "redlock",
    traits: super::redis::TRAITS,
    ttl: Duration::from_millis(1000),
    home: Home::Servers,
    url: |eps, _| format!("redlock://{}", eps.join(",")),
};
