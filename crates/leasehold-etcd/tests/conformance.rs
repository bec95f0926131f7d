//! The conformance suite against a real single-member etcd (one per test), every case included.
//! A client loses its liveness the way an etcd client does, by a partition between it and
//! the member (its connection goes through a fault proxy).

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::Arc;

use async_trait::async_trait;
use leasehold_core::backend::Backend;
use leasehold_etcd::EtcdBackend;
use leasehold_testkit::conformance::{Cuttable, ProxySwitch};
use leasehold_testkit::{Deployment, Etcd, FaultProxy};

/// Every client's session: 2 s (so that the cases that outlast a session ttl stay short).
const SESSION: &str = "session_ttl=2s";

/// The drift allowance of a client whose liveness is cut.
/// Its loss is due 0.62 s before etcd can expire its lease, enough for the case that
/// checks, right after the loss signal, that the member still holds the lock — on a loaded
/// two-core machine too.
const MARGIN: &str = "drift_margin=600ms";

struct EtcdDeployment {
    etcd: Etcd,
}

#[async_trait]
impl Deployment for EtcdDeployment {
    async fn connect(&self) -> Arc<dyn Backend> {
        let url = format!("{}?{SESSION}", self.etcd.url());
        Arc::new(EtcdBackend::connect(&url).await.unwrap())
    }

    /// A client whose only way to the member is a fault proxy.
    /// A cut is a partition: its session's keep-alives stop reaching etcd.
    async fn connect_cuttable(&self) -> Option<Cuttable> {
        let member = self.etcd.endpoints()[0].parse().unwrap();
        let proxy = FaultProxy::start(member).await.unwrap();
        let url = format!("etcd://{}?{SESSION}&{MARGIN}", proxy.addr());
        let backend = EtcdBackend::connect(&url).await.unwrap();
        Some(Cuttable::new(
            Arc::new(backend),
            Arc::new(ProxySwitch::new(Arc::new(proxy))),
        ))
    }
}

leasehold_testkit::conformance_suite!(async {
    EtcdDeployment {
        etcd: Etcd::start().await.expect("etcd"),
    }
});
