//! leasehold-chaos: the fault-injection checker behind `leasehold chaos`.
//!
//! Worker processes lock through the real toolkit against real servers and do guarded
//! work on a fenced resource (a process of its own); a nemesis injects seeded faults;
//! every process reports to one collector, whose history the checks C1–C10 of
//! `safety.md` judge. See `docs/guarantees.md` for what it measured on each backend.
//!
//! This crate is linked into the `leasehold` command, and so depends on no test crate:
//! servers started for a run, and the in-memory backend's simulated links, come from a
//! [`harness::Harness`] (the `leasehold-chaos-harness` crate's, in its `leasehold-chaos`
//! program). Without one it runs against the servers given with `--url`.

// An unpublished tool: its data types (events, verdicts, reports, configurations) are made
// and read by the checker and its own tests, and change with it.
#![allow(clippy::exhaustive_structs)]

pub mod audit;
#[cfg(feature = "planted-bugs")]
pub mod bugs;
pub mod checks;
pub mod cli;
pub mod collector;
pub mod deploy;
pub mod harness;
pub mod history;
pub mod nemesis;
pub mod recorder;
pub mod report;
pub mod resource;
pub mod runner;
pub mod scenario;
pub mod vip;
pub mod wgl;
pub mod wire;
pub mod worker;
