//! The conformance suite against a real PostgreSQL (one per test), in both modes.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::Arc;

use async_trait::async_trait;
use leasehold_core::backend::Backend;
use leasehold_postgres::PostgresBackend;
use leasehold_testkit::{Deployment, Postgres};

/// Lease mode: the default cut (renewals held) applies.
struct LeaseDeployment {
    server: Postgres,
}

#[async_trait]
impl Deployment for LeaseDeployment {
    async fn connect(&self) -> Arc<dyn Backend> {
        Arc::new(PostgresBackend::connect(&self.server.url()).await.unwrap())
    }
}

mod lease {
    use super::*;

    leasehold_testkit::conformance_suite!(async {
        LeaseDeployment {
            server: Postgres::start().await.expect("postgres"),
        }
    });
}
