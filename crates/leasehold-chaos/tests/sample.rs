//! The CI sample: every scenario once on every backend, with its short schedule. Each
//! must come out as the scenario states: no violation where the backend promises safety,
//! the violation detected where it does not (and fencing still refusing stale writes).
//!
//! The long run (≥ 1,000 seeded runs per backend) is documented in `docs/guarantees.md`.

mod common;

#[test]
fn sample_memory() {
    common::sample("memory");
}

#[test]
fn sample_file() {
    common::sample("file");
}

#[test]
fn sample_redis() {
    common::sample("redis");
}

#[test]
fn sample_redlock() {
    common::sample("redlock");
}

#[test]
fn sample_etcd() {
    common::sample("etcd");
}
