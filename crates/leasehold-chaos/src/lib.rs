//! leasehold-chaos: the fault-injection checker behind `leasehold chaos`.
//!
//! Worker processes lock through the real toolkit against real servers and do guarded
//! work on a fenced resource (a process of its own); a nemesis injects seeded faults;
//! every process reports to one collector, whose history the checks C1–C10 of
//! `safety.md` judge. See `docs/guarantees.md` for what it measured on each backend.

pub mod checks;
pub mod history;
pub mod wgl;
