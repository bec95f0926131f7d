//! The conformance suite against the in-memory backend.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

leasehold_testkit::conformance_suite!(async { leasehold_testkit::MemoryDeployment::new() });
