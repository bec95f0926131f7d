//! Backends under test.
//! The registry, a run's servers (or the user's), and the fault proxies in front of them.
//!
//! A backend is one [`BackendSpec`]: its name, what it is made of (server processes, a
//! network, leases or sessions), where its locks live in a run the checker sets up itself,
//! and how to build a URL from the endpoints a worker must go through. Adding a backend is
//! one file here, one line in [`REGISTRY`] and, if it has servers, their start in the
//! harness (`leasehold-chaos-harness`).

pub mod etcd;
pub mod file;
pub mod memory;
pub mod postgres;
pub mod redis;
pub mod redis_cluster;
pub mod redis_sentinel;
pub mod redlock;
pub mod zookeeper;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use leasehold_faultproxy::FaultProxy;

use crate::harness::{Directory, Harness, NoServers, Servers};
use crate::vip::Vip;

/// The backends `leasehold chaos` knows.
pub static REGISTRY: &[&BackendSpec] = &[
    &memory::SPEC,
    &file::SPEC,
    &redis::SPEC,
    &redis_sentinel::SPEC,
    &redis_cluster::SPEC,
    &redlock::SPEC,
    &etcd::SPEC,
    &zookeeper::SPEC,
    &postgres::SPEC,
];

/// Finds a backend by name.
pub fn backend(name: &str) -> Option<&'static BackendSpec> {
    REGISTRY.iter().copied().find(|b| b.name == name)
}

/// Whether this build of leasehold can connect to `spec`'s URLs.
///
/// Every backend is in the facade's default build; one built without a backend's feature
/// cannot.
pub fn available(spec: &BackendSpec) -> bool {
    leasehold::supported_schemes().contains(&spec.scheme)
}

/// Why this program cannot run `spec`, if it cannot.
///
/// `url`: the user gives the servers. Without a harness, a backend on servers needs them
/// given, and the in-memory backend cannot run.
pub fn unavailable(spec: &BackendSpec, url: bool, harness: Option<&Harness>) -> Option<String> {
    if !available(spec) {
        return Some(format!(
            "{}:// needs leasehold built with the `{}` feature",
            spec.scheme, spec.name
        ));
    }
    if harness.is_some() || !spec.needs_harness(url) {
        return None;
    }
    Some(match spec.home {
        Home::InProcess => format!(
            "{}: its workers share one process over simulated links, which only the \
             checker's own program (leasehold-chaos) has",
            spec.name
        ),
        _ => format!(
            "{}: this program starts no servers; give yours with --url (or run the \
             checker's own program, leasehold-chaos, which starts its own)",
            spec.name
        ),
    })
}

/// A boxed future (not `Send`: the testkit's server start-ups are not).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// What a backend is made of; scenarios read it to decide whether they apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Traits {
    /// Server processes the nemesis can pause, kill and restart.
    pub servers: bool,
    /// TCP links between workers and servers that fault proxies can be put on.
    /// Not where the servers tell the workers where to connect (Sentinel, Cluster).
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

/// Where a backend's locks live in a run the checker sets up itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Home {
    /// In the worker process, whose workers reach it through the harness's links.
    InProcess,
    /// A directory of the run's own.
    Directory,
    /// Server processes the harness starts.
    Servers,
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
    /// Where its locks live when the checker sets the run up.
    pub home: Home,
    /// The lease (or session) a run asks for.
    pub ttl: Duration,
    /// The URL of the backend through `endpoints` (`host:port`, one per server).
    /// It carries the lease `ttl` where the URL has one.
    pub url: fn(&[String], Duration) -> String,
}

impl BackendSpec {
    /// Whether a run needs the harness: to start its servers, or to link in-process workers.
    /// `url`: the user gives the servers.
    pub fn needs_harness(&self, url: bool) -> bool {
        match self.home {
            Home::InProcess => true,
            Home::Directory => false,
            Home::Servers => !url,
        }
    }
}

/// Builds a URL from the endpoints a worker goes through.
type UrlFrom = Box<dyn Fn(&[String]) -> String + Send>;

/// A run's backend: its servers (or the user's), and the fault proxies in front of them.
/// There is one proxy per worker and server.
#[derive(Debug)]
pub struct Deployment {
    /// The backend.
    pub spec: &'static BackendSpec,
    /// Its servers ([`NoServers`] against the user's).
    pub servers: Box<dyn Servers>,
    /// The movable address in front of a replicated pair.
    pub vip: Option<Vip>,
    /// Per worker, one proxy per endpoint (none without a network).
    pub proxies: Vec<Vec<FaultProxy>>,
    /// The URL workers use, per worker.
    pub worker_urls: Vec<String>,
    /// The URL the observer uses (no proxy).
    pub observer_url: String,
    /// The user's URL, when the run is against their servers.
    pub external: Option<String>,
}

impl Deployment {
    /// Sets up where `spec`'s locks live for `topology`, and proxies for `workers` workers.
    /// With an `external` URL, the user's servers are used.
    ///
    /// Servers are started by the `harness`.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops (kills) what it had started.
    ///
    /// # Errors
    ///
    /// If a server or a proxy does not start, the URL has no endpoints to proxy, or servers
    /// are needed and there is no harness to start them.
    pub async fn start(
        spec: &'static BackendSpec,
        topology: Topology,
        workers: usize,
        external: Option<&str>,
        harness: Option<&Harness>,
        ttl: Duration,
    ) -> io::Result<Deployment> {
        let (servers, base, build): (Box<dyn Servers>, Vec<SocketAddr>, UrlFrom) = match external {
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
                    Box::new(NoServers),
                    addrs,
                    Box::new(move |eps: &[String]| format!("{prefix}{}{suffix}", eps.join(","))),
                )
            }
            None => {
                let mut servers: Box<dyn Servers> = match (spec.home, harness) {
                    (Home::InProcess, _) => Box::new(NoServers),
                    (Home::Directory, _) => Box::new(Directory(tempfile::tempdir()?)),
                    (Home::Servers, Some(harness)) => (harness.start)(spec, topology).await?,
                    (Home::Servers, None) => {
                        return Err(io::Error::new(
                            io::ErrorKind::Unsupported,
                            unavailable(spec, false, None).unwrap_or_default(),
                        ));
                    }
                };
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
        // A replicated pair is reached through a movable address, at the primary (0).
        let (vip, reach) = match (servers.replication(), base.first()) {
            (Some(_), Some(primary)) => {
                let vip = Vip::start(*primary).await?;
                let addr = vip.addr();
                (Some(vip), vec![addr])
            }
            _ => (None, base),
        };
        let observer_url = build(&reach.iter().map(ToString::to_string).collect::<Vec<_>>());
        let (proxies, worker_urls) = if spec.traits.network {
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
            (proxies, worker_urls)
        } else {
            (Vec::new(), vec![observer_url.clone(); workers])
        };
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

/// Splits `scheme://[user@]h1:p1,h2:p2[/path][?query]` around its hosts.
/// The parts are what comes before the hosts, the hosts, and what comes after them. A URL
/// without hosts (`memory:`, `file:///…`) has none.
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
    fn a_backend_has_servers_exactly_where_the_harness_starts_them() {
        for spec in REGISTRY {
            assert_eq!(
                spec.traits.servers,
                spec.home == Home::Servers,
                "{}",
                spec.name
            );
        }
    }

    #[test]
    fn every_backend_is_found_by_name() {
        for spec in REGISTRY {
            assert_eq!(backend(spec.name).map(|b| b.name), Some(spec.name));
        }
        assert!(backend("nosuch").is_none());
    }
}
