//! A Redis master with two replicas, watched by three sentinels (no persistence).
//!
//! Workers find the master through the sentinels and connect to it where the sentinels say
//! it is, so no fault proxy of the checker's is on that path: the scenarios that need one
//! per worker do not apply. The sentinels see a silent master down after 1 s and promote a
//! replica.

use std::time::Duration;

use super::{BackendSpec, Home, Traits};

/// The name the harness's sentinels know their master by.
pub const MASTER: &str = "leasehold-master";

/// The registry entry. Its endpoints are the sentinels.
pub static SPEC: BackendSpec = BackendSpec {
    name: "redis-sentinel",
    scheme: "redis+sentinel",
    traits: Traits {
        network: false,
        ..super::redis::TRAITS
    },
    ttl: Duration::from_millis(1000),
    home: Home::Servers,
    url: |eps, _| format!("redis+sentinel://{}/{MASTER}", eps.join(",")),
};
