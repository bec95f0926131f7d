//! The conformance suite against a real PostgreSQL (one per test), in both modes.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::Arc;

use async_trait::async_trait;
use leasehold_core::backend::Backend;
use leasehold_postgres::PostgresBackend;
use leasehold_testkit::conformance::{Cuttable, ProxySwitch};
use leasehold_testkit::{Deployment, FaultProxy, Postgres};

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

/// Advisory mode with 2 s sessions.
/// A client's liveness is cut by holding its connections' traffic in a fault proxy.
struct AdvisoryDeployment {
    server: Postgres,
}

impl AdvisoryDeployment {
    fn url(&self, port: u16) -> String {
        format!("postgres://postgres@127.0.0.1:{port}/postgres?mode=advisory&session_ttl=2s")
    }
}

#[async_trait]
impl Deployment for AdvisoryDeployment {
    async fn connect(&self) -> Arc<dyn Backend> {
        let url = self.url(self.server.port());
        Arc::new(PostgresBackend::connect(&url).await.unwrap())
    }

    async fn connect_cuttable(&self) -> Option<Cuttable> {
        let target = format!("127.0.0.1:{}", self.server.port()).parse().unwrap();
        let proxy = Arc::new(FaultProxy::start(target).await.unwrap());
        let backend = PostgresBackend::connect(&self.url(proxy.port()))
            .await
            .unwrap();
        Some(Cuttable::new(
            Arc::new(backend),
            Arc::new(ProxySwitch::new(proxy)),
        ))
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

mod advisory {
    use super::*;

    leasehold_testkit::conformance_suite!(async {
        AdvisoryDeployment {
            server: Postgres::start().await.expect("postgres"),
        }
    });
}
