//! Backends under test: the registry, the servers a run starts (or the user's), and the
//! per-worker fault proxies in front of them.
//!
//! A backend is one [`BackendSpec`]: its name, what it is made of (server processes, a
//! network, leases or sessions), how to start its servers for a topology and how to build
//! a URL from the endpoints a worker must go through. Adding a backend is one file here
//! and one line in [`REGISTRY`].

pub mod etcd;
pub mod file;
pub mod memory;
pub mod postgres;
pub mod redis;
pub mod redlock;
pub mod zookeeper;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use leasehold_testkit::{Etcd, FaultProxy, Postgres, Redis, ServerProcess, ZooKeeper};

use crate::vip::Vip;

/// The backends `leasehold chaos` knows.
pub static REGISTRY: &[&BackendSpec] = &[
    &memory::SPEC,
    &file::SPEC,
    &redis::SPEC,
    &redlock::SPEC,
    &etcd::SPEC,
    &zookeeper::SPEC,
    &postgres::SPEC,
];

/// Finds a backend by name.
pub fn backend(name: &str) -> Option<&'static BackendSpec> {
    REGISTRY.iter().copied().find(|b| b.name == name)
}

/// Whether this build of leasehold can connect to `spec`'s URLs (etcd needs the facade's
/// `etcd` feature).
pub fn available(spec: &BackendSpec) -> bool {
    leasehold::supported_schemes().contains(&spec.scheme)
}

/// A boxed future (not `Send`: the testkit's server start-ups are not).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// What a backend is made of; scenarios read it to decide whether they apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Traits {
    /// Server processes the nemesis can pause, kill and restart.
    pub servers: bool,
    /// TCP links between workers and servers (fault proxies go there).
    pub network: bool,
    /// Every worker is a process of its own (pausable, killable, clock-skewable).
    pub processes: bool,
    /// Grants expire unless renewed (leases or sessions).
    pub expiring: bool,
    /// Grants live with the client's session (etcd, ZooKeeper).
    pub sessions: bool,
    /// The kind of server clock jump the nemesis can make.
    pub server_clock: ServerClock,
    /// A server restart loses the locks (no persistence).
    pub restart_loses_locks: bool,
}

/// How a server's clock jump is injected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerClock {
    /// Not at all.
    None,
    /// Emulated by expiring the lock's key early (redis-server hangs under libfaketime).
    ExpireEarly,
    /// libfaketime on the server process.
    Faketime,
}

/// The servers a scenario wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Topology {
    /// The backend's usual deployment (one Redis, three Redlock nodes, one etcd member).
    Single,
    /// Three members (etcd, ZooKeeper); Redlock's three nodes.
    Cluster,
    /// A Redis primary and an asynchronous replica behind a movable address.
    Replicated,
    /// A Redis that evicts keys with a TTL under memory pressure (`volatile-lru`).
    Evicting,
}

/// One entry of the registry.
#[derive(Debug)]
pub struct BackendSpec {
    /// The name on the command line.
    pub name: &'static str,
    /// The URL scheme.
    pub scheme: &'static str,
    /// What it is made of.
    pub traits: Traits,
    /// The lease (or session) a run asks for.
    pub ttl: Duration,
    /// Starts the servers of a topology (in a directory of their own).
    pub start: fn(Topology) -> BoxFuture<'static, io::Result<Servers>>,
    /// The URL of the backend through `endpoints` (`host:port`, one per server), with the
    /// lease `ttl` where the URL carries it.
    pub url: fn(&[String], Duration) -> String,
}

/// Server processes of a run.
#[derive(Debug)]
#[non_exhaustive]
pub enum Servers {
    /// Nothing to run: the in-memory backend lives in the worker process.
    None,
    /// A directory (the file backend).
    Dir(tempfile::TempDir),
    /// Independent redis-servers (one, or Redlock's nodes).
    Redis(Vec<Redis>),
    /// A primary (0) and its replica (1).
    Replicated(Box<Replicated>),
    /// An etcd cluster.
    Etcd(Etcd),
    /// A ZooKeeper ensemble.
    ZooKeeper(ZooKeeper),
    /// A PostgreSQL server, and its wall clock where libfaketime is installed.
    Postgres(Postgres, Option<postgres::ServerWallClock>),
}

impl Servers {
    /// The client addresses, one per server.
    pub fn endpoints(&mut self) -> Vec<SocketAddr> {
        match self {
            Servers::None | Servers::Dir(_) => Vec::new(),
            Servers::Redis(nodes) => nodes.iter().map(Redis::addr).collect(),
            Servers::Replicated(pair) => vec![pair.primary.addr(), pair.replica.addr()],
            Servers::Etcd(etcd) => etcd.members().iter().map(|m| m.addr()).collect(),
            Servers::ZooKeeper(zk) => zk.servers().iter().map(|s| s.addr()).collect(),
            Servers::Postgres(pg, _) => {
                vec![std::net::SocketAddr::from(([127, 0, 0, 1], pg.port()))]
            }
        }
    }

    /// How many server processes.
    pub fn count(&mut self) -> usize {
        self.endpoints().len()
    }

    /// Server `i`'s process.
    pub fn process(&mut self, i: usize) -> Option<&mut ServerProcess> {
        match self {
            Servers::Redis(nodes) => nodes.get_mut(i).map(Redis::process),
            Servers::Replicated(pair) => match i {
                0 => Some(pair.primary.process()),
                1 => Some(pair.replica.process()),
                _ => None,
            },
            Servers::Etcd(etcd) => etcd.members().get_mut(i).map(|m| m.process()),
            Servers::ZooKeeper(zk) => zk.servers().get_mut(i).map(|s| s.process()),
            Servers::Postgres(pg, _) if i == 0 => Some(pg.process()),
            _ => None,
        }
    }

    /// Server `i`, if it is a redis-server.
    pub fn redis(&self, i: usize) -> Option<&Redis> {
        match self {
            Servers::Redis(nodes) => nodes.get(i),
            Servers::Replicated(pair) => match i {
                0 => Some(&pair.primary),
                1 => Some(&pair.replica),
                _ => None,
            },
            _ => None,
        }
    }

    /// Kills server `i` if it runs and starts it again (a redis-server without
    /// persistence comes back empty); waits until it serves.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave the server killed or starting.
    ///
    /// # Errors
    ///
    /// If it does not come back.
    pub async fn restart(&mut self, i: usize) -> io::Result<()> {
        match self {
            Servers::Redis(nodes) => match nodes.get_mut(i) {
                Some(n) => n.restart().await,
                None => Ok(()),
            },
            Servers::Replicated(pair) => match i {
                0 => pair.primary.restart().await,
                _ => pair.replica.restart().await,
            },
            Servers::Etcd(etcd) => match etcd.members().get_mut(i) {
                Some(m) => m.restart().await,
                None => Ok(()),
            },
            Servers::ZooKeeper(zk) => match zk.servers().get_mut(i) {
                Some(s) => s.restart().await,
                None => Ok(()),
            },
            Servers::Postgres(pg, _) => pg.restart().await,
            _ => Ok(()),
        }
    }

    /// The index of the member that leads (etcd, ZooKeeper); 0 otherwise.
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    pub async fn leader(&mut self) -> usize {
        match self {
            Servers::Etcd(etcd) => etcd.leader().await.unwrap_or(0),
            Servers::ZooKeeper(zk) => {
                for (i, s) in zk.servers().iter().enumerate() {
                    if s.mode().await.as_deref() == Some("leader") {
                        return i;
                    }
                }
                0
            }
            _ => 0,
        }
    }

    /// Server `i`'s wall clock, where libfaketime can move it.
    pub fn wall_clock(&self, i: usize) -> Option<&postgres::ServerWallClock> {
        match self {
            Servers::Postgres(_, clock) if i == 0 => clock.as_ref(),
            _ => None,
        }
    }

    /// The file backend's directory.
    pub fn dir(&self) -> Option<&std::path::Path> {
        match self {
            Servers::Dir(dir) => Some(dir.path()),
            _ => None,
        }
    }
}

/// A Redis primary and its asynchronous replica, replicating through a fault proxy.
#[derive(Debug)]
pub struct Replicated {
    /// The primary.
    pub primary: Redis,
    /// The replica.
    pub replica: Redis,
    /// The replication link (the replica connects to the primary through it).
    pub link: FaultProxy,
}

/// Builds a URL from the endpoints a worker goes through.
type UrlFrom = Box<dyn Fn(&[String]) -> String + Send>;

/// A run's backend: its servers (or the user's), and one fault proxy per worker and
/// server in front of them.
#[derive(Debug)]
pub struct Deployment {
    /// The backend.
    pub spec: &'static BackendSpec,
    /// Its servers (`None` against the user's).
    pub servers: Servers,
    /// The movable address in front of a replicated pair.
    pub vip: Option<Vip>,
    /// Per worker, one proxy per endpoint (empty without a network).
    pub proxies: Vec<Vec<FaultProxy>>,
    /// The URL workers use, per worker.
    pub worker_urls: Vec<String>,
    /// The URL the observer uses (no proxy).
    pub observer_url: String,
    /// The user's URL, when the run is against their servers.
    pub external: Option<String>,
}

impl Deployment {
    /// Starts `spec`'s servers for `topology` (or takes the user's `external` URL), and
    /// proxies for `workers` workers.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops (kills) what it had started.
    ///
    /// # Errors
    ///
    /// If a server or a proxy does not start, or the URL has no endpoints to proxy.
    pub async fn start(
        spec: &'static BackendSpec,
        topology: Topology,
        workers: usize,
        external: Option<&str>,
        ttl: Duration,
    ) -> io::Result<Deployment> {
        let (mut servers, base, build): (Servers, Vec<SocketAddr>, UrlFrom) = match external {
            Some(url) => {
                let (prefix, hosts, suffix) = split_endpoints(url);
                let mut addrs = Vec::new();
                for host in &hosts {
                    let addr = tokio::net::lookup_host(host.as_str())
                        .await?
                        .next()
                        .ok_or_else(|| io::Error::other(format!("{host} does not resolve")))?;
                    addrs.push(addr);
                }
                (
                    Servers::None,
                    addrs,
                    Box::new(move |eps: &[String]| format!("{prefix}{}{suffix}", eps.join(","))),
                )
            }
            None => {
                let mut servers = (spec.start)(topology).await?;
                let url = spec.url;
                let endpoints = servers.endpoints();
                let dir = servers.dir().map(|d| d.display().to_string());
                let build: UrlFrom = match dir {
                    Some(dir) => Box::new(move |_: &[String]| url(std::slice::from_ref(&dir), ttl)),
                    None => Box::new(move |eps: &[String]| url(eps, ttl)),
                };
                (servers, endpoints, build)
            }
        };
        // A replicated pair is reached through a movable address, at the primary.
        let (vip, reach) = match &mut servers {
            Servers::Replicated(pair) => {
                let vip = Vip::start(pair.primary.addr()).await?;
                let addr = vip.addr();
                (Some(vip), vec![addr])
            }
            _ => (None, base),
        };
        let observer_url = build(&reach.iter().map(ToString::to_string).collect::<Vec<_>>());
        let mut proxies = Vec::new();
        let mut worker_urls = Vec::new();
        for _ in 0..workers {
            let mut mine = Vec::new();
            for addr in &reach {
                mine.push(FaultProxy::start(*addr).await?);
            }
            let eps: Vec<String> = mine.iter().map(|p| p.addr().to_string()).collect();
            worker_urls.push(build(&eps));
            proxies.push(mine);
        }
        Ok(Deployment {
            spec,
            servers,
            vip,
            proxies,
            worker_urls,
            observer_url,
            external: external.map(str::to_owned),
        })
    }
}

/// Splits `scheme://[user@]h1:p1,h2:p2[/path][?query]` into the part before the hosts,
/// the hosts, and the part after them. A URL without hosts (`memory:`, `file:///…`) has
/// none.
pub fn split_endpoints(url: &str) -> (String, Vec<String>, String) {
    let Some((scheme, rest)) = url.split_once("://") else {
        return (url.to_owned(), Vec::new(), String::new());
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, suffix) = rest.split_at(end);
    let (user, hosts) = match authority.rsplit_once('@') {
        Some((user, hosts)) => (format!("{user}@"), hosts),
        None => (String::new(), authority),
    };
    let hosts: Vec<String> = hosts
        .split(',')
        .filter(|h| !h.is_empty())
        .map(str::to_owned)
        .collect();
    (format!("{scheme}://{user}"), hosts, suffix.to_owned())
}

/// Whole seconds, at least one (etcd leases and session ttls are whole seconds).
pub(crate) fn whole_seconds(d: Duration) -> u64 {
    d.as_millis().div_ceil(1000).max(1) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_split_out_of_urls() {
        let (p, h, s) = split_endpoints("redlock://u:pw@a:1,b:2,c:3?node_timeout=50ms");
        assert_eq!(p, "redlock://u:pw@");
        assert_eq!(h, ["a:1", "b:2", "c:3"]);
        assert_eq!(s, "?node_timeout=50ms");
        let (p, h, s) = split_endpoints("postgres://postgres@127.0.0.1:5432/postgres");
        assert_eq!(
            (p.as_str(), h.len(), s.as_str()),
            ("postgres://postgres@", 1, "/postgres")
        );
        assert!(split_endpoints("file:///tmp/x").1.is_empty());
        assert!(split_endpoints("memory:").1.is_empty());
    }

    #[test]
    fn every_backend_is_found_by_name() {
        for spec in REGISTRY {
            assert_eq!(backend(spec.name).map(|b| b.name), Some(spec.name));
        }
        assert!(backend("nosuch").is_none());
    }
}
