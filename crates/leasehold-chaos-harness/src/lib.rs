//! The checker's test harness: it starts the servers a run needs and fakes in-process links.
//!
//! The checker (`leasehold-chaos`) is a product feature, linked into the `leasehold`
//! command, which runs it against a user's own servers. What it needs only to test itself
//! lives here, out of the product binary: servers started on free loopback ports by the
//! testkit and controlled by the nemesis (paused, killed, restarted, administered, clocks
//! moved), and core's `Faulty` decorator standing in for the network between the in-memory
//! backend's workers and their server. The `leasehold-chaos` program is the checker with
//! this harness; the checker's sample runs, planted bugs and HTML report are tested here.
//!
//! - `lib.rs`: [`HARNESS`], what the harness hands the checker.
//! - `servers.rs`: each backend's servers started for a topology, as the nemesis acts on them.
//! - `link.rs`: the in-memory backend's links, over `Faulty`.
//! - `main.rs`: the `leasehold-chaos` program.

mod link;
mod servers;

use leasehold_chaos::harness::Harness;

/// The harness: starts servers through the testkit, links in-process workers over `Faulty`.
pub static HARNESS: Harness = Harness {
    start: servers::start,
    link: link::link,
};
