//! The conformance suite against Redlock over 5 and over 3 real redis-servers.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use leasehold_core::backend::Backend;
use leasehold_redis::{RedlockBackend, RedlockOptions};
use leasehold_testkit::{Deployment, Redis, redis_servers};

struct RedlockDeployment {
    servers: Vec<Redis>,
}

impl RedlockDeployment {
    async fn start(n: usize) -> Self {
        Self {
            servers: redis_servers(n).await.expect("redis-servers"),
        }
    }
}

#[async_trait]
impl Deployment for RedlockDeployment {
    async fn connect(&self) -> Arc<dyn Backend> {
        let urls: Vec<String> = self.servers.iter().map(Redis::url).collect();
        // The servers were just started: without this, every node would refuse grants for
        // a quarantine after its start (tested on its own in redlock.rs). A node's answer
        // may take longer than the 50 ms default on a loaded test machine.
        let options = RedlockOptions::default()
            .quarantine(Duration::ZERO)
            .node_timeout(Duration::from_secs(1))
            .unwrap();
        Arc::new(RedlockBackend::connect_nodes(&urls, options).await.unwrap())
    }
}

mod five_nodes {
    use super::RedlockDeployment;
    leasehold_testkit::conformance_suite!(RedlockDeployment::start(5));
}

mod three_nodes {
    use super::RedlockDeployment;
    leasehold_testkit::conformance_suite!(RedlockDeployment::start(3));
}
