//! The seam where the checker's test harness plugs in: servers it starts, links it fakes.
//!
//! The checker is a product feature: `leasehold chaos --url …` runs every scenario that
//! needs no control of the servers against a user's own servers, through a fault proxy per
//! worker. Starting servers (redis-server, etcd, … from the testkit) and the in-memory
//! backend's simulated links (core's `Faulty`, a test double) are test infrastructure, which
//! the product must not link. They come from the `leasehold-chaos-harness` crate, whose
//! `leasehold-chaos` program passes a [`Harness`] to [`cli::main`](crate::cli::main); the
//! `leasehold` command passes none.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use leasehold::backend::Backend;
use leasehold_faultproxy::FaultProxy;

use crate::deploy::{BackendSpec, BoxFuture, Topology};

/// What the harness adds to the checker.
#[derive(Debug, Clone, Copy)]
pub struct Harness {
    /// Starts the servers of a backend whose locks live on servers, for a topology.
    pub start: StartServers,
    /// Puts a simulated link between an in-process worker and the in-memory server.
    pub link: LinkWorker,
}

/// Starts `backend`'s servers for a topology.
pub type StartServers =
    fn(&'static BackendSpec, Topology) -> BoxFuture<'static, io::Result<Box<dyn Servers>>>;

/// Links an in-process worker to its server (the backend given).
pub type LinkWorker = fn(Arc<dyn Backend>) -> Arc<dyn Link>;

/// Servers of a run, as the nemesis acts on them.
///
/// The defaults are those of a run without server processes of its own: nothing to pause,
/// kill or restart, no administration. Servers given with `--url` are the user's:
/// [`NoServers`].
#[async_trait(?Send)]
pub trait Servers: fmt::Debug {
    /// The client addresses, one per server.
    fn endpoints(&mut self) -> Vec<SocketAddr> {
        Vec::new()
    }

    /// How many server processes.
    fn count(&mut self) -> usize {
        self.endpoints().len()
    }

    /// Stops server `i` (SIGSTOP) until [`resume`](Servers::resume).
    fn pause(&mut self, _i: usize) {}

    /// Lets a paused server `i` go on (SIGCONT).
    fn resume(&mut self, _i: usize) {}

    /// Kills server `i` (SIGKILL).
    fn kill(&mut self, _i: usize) {}

    /// Kills server `i` if it runs, starts it again and waits until it serves.
    ///
    /// A redis-server without persistence comes back empty.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave the server killed or starting.
    ///
    /// # Errors
    ///
    /// If it does not come back.
    async fn restart(&mut self, _i: usize) -> io::Result<()> {
        Ok(())
    }

    /// The index of the member that leads (etcd, ZooKeeper); 0 otherwise.
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    async fn leader(&mut self) -> usize {
        0
    }

    /// The server that serves `key` now.
    /// The master the sentinels name, the master of `key`'s slot in a Redis Cluster, else
    /// the [`leader`](Servers::leader).
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    ///
    /// # Errors
    ///
    /// If the servers cannot tell.
    async fn serving(&mut self, _key: &str) -> io::Result<usize> {
        Ok(self.leader().await)
    }

    /// Waits until a server other than `old` serves `key` as a master, and returns it.
    /// That is a failover done by the servers themselves: the sentinels, or the cluster,
    /// promoting a replica of `old`.
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    ///
    /// # Errors
    ///
    /// If these servers do not fail over on their own, or not in time.
    async fn failed_over(&mut self, _key: &str, old: usize) -> io::Result<usize> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("no replica takes over from server {old} on its own"),
        ))
    }

    /// Takes one step of moving `key`'s slot to another master (Redis Cluster).
    /// What it did, for the history.
    ///
    /// # Cancel safety
    ///
    /// A step already sent is applied; dropping the future may leave the slot between
    /// two masters.
    ///
    /// # Errors
    ///
    /// If the servers are not a Redis Cluster, or a node refuses the step.
    async fn move_slot(&mut self, _key: &str, _step: SlotMove) -> io::Result<String> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the servers have no slots to move",
        ))
    }

    /// Runs a command on redis-server `i`, as an administrator would; its reply as text.
    ///
    /// An error reply is its message; an array or a null is `None`.
    ///
    /// # Cancel safety
    ///
    /// A command already sent is applied.
    ///
    /// # Errors
    ///
    /// If server `i` is not a redis-server or does not answer.
    async fn redis(&self, i: usize, _args: &[&str]) -> io::Result<Option<String>> {
        Err(io::Error::other(format!(
            "server {i} is not a redis-server"
        )))
    }

    /// Moves server `i`'s wall clock `seconds` away from the real one.
    ///
    /// # Errors
    ///
    /// If its clock cannot be moved.
    fn set_wall_clock(&self, i: usize, _seconds: i64) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("server {i}'s clock cannot be moved"),
        ))
    }

    /// The link a replica (server 1) replicates from its primary (server 0) through.
    fn replication(&self) -> Option<&FaultProxy> {
        None
    }

    /// The directory the file backend's locks live in.
    fn dir(&self) -> Option<&Path> {
        None
    }
}

/// A step of moving a slot from one Redis Cluster master to another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotMove {
    /// The target imports the slot and its master migrates it.
    /// Keys the master no longer has are asked for at the target (`CLUSTER SETSLOT …
    /// IMPORTING`, `… MIGRATING`).
    Begin,
    /// The slot's keys are moved to the target (`MIGRATE`).
    Keys,
    /// Every master is told the target serves the slot (`CLUSTER SETSLOT … NODE`).
    End,
}

/// No servers of the run's own: the user's (`--url`), or the in-memory backend's.
#[derive(Debug)]
pub struct NoServers;

impl Servers for NoServers {}

/// The file backend's locks: a directory of the run's own, removed when dropped.
#[derive(Debug)]
pub struct Directory(pub tempfile::TempDir);

impl Servers for Directory {
    fn dir(&self) -> Option<&Path> {
        Some(self.0.path())
    }
}

/// A simulated link between an in-process worker and the server it shares a process with.
pub trait Link: Send + Sync + fmt::Debug {
    /// The worker's backend: the server, through the link.
    fn backend(&self) -> Arc<dyn Backend>;

    /// Applies a link fault the nemesis sent ([`Command::Link`](crate::wire::Command)).
    ///
    /// `action` is one of `cut_to_server`, `cut_to_client`, `cut_both`, `delay` (every
    /// reply by `delay_ms`), `reset` (the next call of each kind fails as a reset
    /// connection would), `lose_reply` (of the next acquire, applied) and `heal`.
    fn apply(&self, action: &str, delay_ms: u64);
}
