//! The conformance suite against the file backend.
//! Every client is a separate `FileBackend` instance on one temporary directory.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::Arc;

use async_trait::async_trait;
use leasehold_core::backend::Backend;
use leasehold_file::FileBackend;
use leasehold_testkit::Deployment;

struct FileDeployment {
    dir: tempfile::TempDir,
}

#[async_trait]
impl Deployment for FileDeployment {
    async fn connect(&self) -> Arc<dyn Backend> {
        Arc::new(FileBackend::open(self.dir.path()).expect("lock directory"))
    }
}

leasehold_testkit::conformance_suite!(async {
    FileDeployment {
        dir: tempfile::tempdir().expect("temporary directory"),
    }
});
