//! The conformance suite against a real redis-server (one per test).

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::Arc;

use async_trait::async_trait;
use leasehold_core::backend::Backend;
use leasehold_redis::RedisBackend;
use leasehold_testkit::{Deployment, Redis};

struct RedisDeployment {
    server: Redis,
}

#[async_trait]
impl Deployment for RedisDeployment {
    async fn connect(&self) -> Arc<dyn Backend> {
        Arc::new(RedisBackend::connect(&self.server.url()).await.unwrap())
    }
}

leasehold_testkit::conformance_suite!(async {
    RedisDeployment {
        server: Redis::start().await.expect("redis-server"),
    }
});
