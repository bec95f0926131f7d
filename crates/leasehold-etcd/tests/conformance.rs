//! The conformance suite against a real single-member etcd (one per test).

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::Arc;

use async_trait::async_trait;
use leasehold_core::backend::Backend;
use leasehold_etcd::EtcdBackend;
use leasehold_testkit::{Deployment, Etcd};

struct EtcdDeployment {
    etcd: Etcd,
}

#[async_trait]
impl Deployment for EtcdDeployment {
    async fn connect(&self) -> Arc<dyn Backend> {
        Arc::new(EtcdBackend::connect(&self.etcd.url()).await.unwrap())
    }
}

leasehold_testkit::conformance_suite!(async {
    EtcdDeployment {
        etcd: Etcd::start().await.expect("etcd"),
    }
});
