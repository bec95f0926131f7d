//! The conformance suite against a real standalone ZooKeeper (one per test), every case included.
//! A client's liveness is cut by partitioning its session's link through a fault proxy.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::Arc;

use async_trait::async_trait;
use leasehold_core::backend::Backend;
use leasehold_testkit::conformance::{Cuttable, ProxySwitch};
use leasehold_testkit::{Deployment, FaultProxy, ZooKeeper};
use leasehold_zookeeper::ZooKeeperBackend;

/// A 2 s session: the cases that cut a client's link wait for it to run out.
const SESSION: &str = "session_timeout=2s";

struct ZooKeeperDeployment {
    zookeeper: ZooKeeper,
}

#[async_trait]
impl Deployment for ZooKeeperDeployment {
    async fn connect(&self) -> Arc<dyn Backend> {
        let url = format!("{}?{SESSION}", self.zookeeper.url());
        Arc::new(ZooKeeperBackend::connect(&url).await.unwrap())
    }

    async fn connect_cuttable(&self) -> Option<Cuttable> {
        let proxy = Arc::new(FaultProxy::start(self.zookeeper.addrs()[0]).await.unwrap());
        let url = format!("zk://127.0.0.1:{}?{SESSION}", proxy.port());
        let backend = ZooKeeperBackend::connect(&url).await.unwrap();
        Some(Cuttable::new(
            Arc::new(backend),
            Arc::new(ProxySwitch::new(proxy)),
        ))
    }
}

leasehold_testkit::conformance_suite!(async {
    ZooKeeperDeployment {
        zookeeper: ZooKeeper::start().await.expect("zookeeper"),
    }
});
