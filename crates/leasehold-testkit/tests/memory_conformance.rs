//! The conformance suite against the in-memory backend.

leasehold_testkit::conformance_suite!(async { leasehold_testkit::MemoryDeployment::new() });
