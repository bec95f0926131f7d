//! Test infrastructure for leasehold: the conformance suite, real servers, fault injection.
//! The conformance suite is the one every backend must pass, the servers are real lock
//! servers started on free loopback ports, [`faulty::Faulty`] injects faults between the
//! engine and any backend, and the TCP fault proxy is re-exported.
//!
//! Nothing here mocks a server. The in-memory backend is a real backend; Redis, etcd,
//! ZooKeeper and PostgreSQL are the real programs from Debian's packages, started by
//! [`servers`] in temporary directories and stopped (by pid) when their handle drops.

pub mod conformance;
pub mod eviction;
pub mod faulty;
mod metrics;
pub mod probe;
mod process;
pub mod servers;

/// The TCP fault proxy (the `leasehold-faultproxy` crate, which `leasehold chaos` uses too).
pub use leasehold_faultproxy as proxy;
pub use metrics::{metric_value, recorded_metrics, scrape_metrics};
pub use process::{ServerProcess, free_port};
pub use proxy::{Direction, FaultProxy};
pub use servers::{
    ClientAuth, Curator, Etcd, PgBouncer, Postgres, Redis, RedisCluster, RedisReplicated,
    RedisSentinel, SENTINEL_MASTER, ZooKeeper, libfaketime, redis_servers,
};

use std::sync::Arc;

use async_trait::async_trait;
use leasehold_core::backend::Backend;
use leasehold_core::memory::InMemory;

pub use conformance::Deployment;

/// The in-memory backend as a deployment: every connection shares one server.
#[derive(Debug, Clone, Default)]
pub struct MemoryDeployment {
    server: InMemory,
}

impl MemoryDeployment {
    /// A fresh in-memory server.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl Deployment for MemoryDeployment {
    async fn connect(&self) -> Arc<dyn Backend> {
        Arc::new(self.server.clone())
    }
}
