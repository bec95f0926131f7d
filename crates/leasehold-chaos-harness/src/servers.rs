//! Each backend's servers, started by the testkit for a topology, as the nemesis acts on them.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use leasehold_chaos::deploy::{BackendSpec, BoxFuture, Topology};
use leasehold_chaos::harness::{Servers, SlotMove};
use leasehold_faultproxy::FaultProxy;
use leasehold_testkit::{
    Etcd, Postgres, Redis, RedisCluster, RedisSentinel, ServerProcess, ZooKeeper, redis_servers,
};

/// Starts `spec`'s servers for `topology`, each in a directory of its own.
pub(crate) fn start(
    spec: &'static BackendSpec,
    topology: Topology,
) -> BoxFuture<'static, io::Result<Box<dyn Servers>>> {
    Box::pin(async move {
        let started = match (spec.name, topology) {
            // No persistence: a restart loses the locks.
            ("redis", Topology::Replicated) => Started::Replicated(Box::new(replicated().await?)),
            ("redis", Topology::Evicting) => Started::Redis(vec![
                Redis::builder()
                    .config("maxmemory-policy", "volatile-lru")
                    .config("maxmemory-samples", "10")
                    .start()
                    .await?,
            ]),
            ("redis", _) => Started::Redis(vec![Redis::start().await?]),
            ("redlock", _) => Started::Redis(redis_servers(3).await?),
            ("redis-sentinel", _) => {
                let sentinel = RedisSentinel::start(2, 3).await?;
                // Until they know each other, no majority agrees that a master is down.
                sentinel.until_sentinels_know_each_other().await?;
                Started::Sentinel(Box::new(sentinel))
            }
            // A short node timeout where a master is failed over: the failover must come
            // within the lease. Elsewhere a loaded machine must not fail nodes over.
            ("redis-cluster", Topology::Replicated) => Started::Cluster(Box::new(Cluster::new(
                RedisCluster::with_node_timeout(3, 1, Duration::from_secs(2)).await?,
            ))),
            ("redis-cluster", _) => {
                Started::Cluster(Box::new(Cluster::new(RedisCluster::start(3, 1).await?)))
            }
            ("etcd", Topology::Cluster) => Started::Etcd(Etcd::cluster(3).await?),
            ("etcd", _) => Started::Etcd(Etcd::start().await?),
            ("zookeeper", Topology::Cluster) => Started::ZooKeeper(ZooKeeper::ensemble(3).await?),
            ("zookeeper", _) => Started::ZooKeeper(ZooKeeper::start().await?),
            ("postgres", _) => postgres().await?,
            (name, _) => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("the harness starts no servers for {name}"),
                ));
            }
        };
        Ok(Box::new(started) as Box<dyn Servers>)
    })
}

/// Server processes of a run.
#[derive(Debug)]
enum Started {
    /// Independent redis-servers (one, or Redlock's nodes).
    Redis(Vec<Redis>),
    /// A primary (0) and its replica (1).
    Replicated(Box<Replicated>),
    /// A master and replicas (server 0 first), watched by sentinels.
    Sentinel(Box<RedisSentinel>),
    /// A Redis Cluster: masters, then their replicas.
    Cluster(Box<Cluster>),
    /// An etcd cluster.
    Etcd(Etcd),
    /// A ZooKeeper ensemble.
    ZooKeeper(ZooKeeper),
    /// A PostgreSQL server, and its wall clock where libfaketime is installed.
    Postgres(Postgres, Option<ServerWallClock>),
}

impl Started {
    /// Server `i`'s process.
    fn process(&mut self, i: usize) -> Option<&mut ServerProcess> {
        match self {
            Started::Redis(nodes) => nodes.get_mut(i).map(Redis::process),
            Started::Replicated(pair) => match i {
                0 => Some(pair.primary.process()),
                1 => Some(pair.replica.process()),
                _ => None,
            },
            Started::Sentinel(sentinel) => sentinel.servers().get_mut(i).map(Redis::process),
            Started::Cluster(cluster) => cluster.nodes.servers().get_mut(i).map(Redis::process),
            Started::Etcd(etcd) => etcd.members().get_mut(i).map(|m| m.process()),
            Started::ZooKeeper(zk) => zk.servers().get_mut(i).map(|s| s.process()),
            Started::Postgres(pg, _) if i == 0 => Some(pg.process()),
            Started::Postgres(..) => None,
        }
    }

    /// Server `i`, if it is a redis-server.
    fn redis_server(&self, i: usize) -> Option<&Redis> {
        match self {
            Started::Redis(nodes) => nodes.get(i),
            Started::Replicated(pair) => match i {
                0 => Some(&pair.primary),
                1 => Some(&pair.replica),
                _ => None,
            },
            Started::Sentinel(sentinel) => sentinel.server(i),
            Started::Cluster(cluster) => (i < cluster.count).then(|| cluster.nodes.server(i)),
            _ => None,
        }
    }
}

#[async_trait(?Send)]
impl Servers for Started {
    fn endpoints(&mut self) -> Vec<SocketAddr> {
        match self {
            Started::Redis(nodes) => nodes.iter().map(Redis::addr).collect(),
            Started::Replicated(pair) => vec![pair.primary.addr(), pair.replica.addr()],
            // The clients' way in: the sentinels, which name the master.
            Started::Sentinel(sentinel) => sentinel.sentinel_addrs(),
            Started::Cluster(cluster) => cluster.nodes.servers().iter().map(Redis::addr).collect(),
            Started::Etcd(etcd) => etcd.members().iter().map(|m| m.addr()).collect(),
            Started::ZooKeeper(zk) => zk.servers().iter().map(|s| s.addr()).collect(),
            Started::Postgres(pg, _) => vec![SocketAddr::from(([127, 0, 0, 1], pg.port()))],
        }
    }

    fn count(&mut self) -> usize {
        match self {
            Started::Sentinel(sentinel) => sentinel.servers().len(),
            _ => self.endpoints().len(),
        }
    }

    fn pause(&mut self, i: usize) {
        if let Some(p) = self.process(i) {
            p.pause();
        }
    }

    fn resume(&mut self, i: usize) {
        if let Some(p) = self.process(i) {
            p.resume();
        }
    }

    fn kill(&mut self, i: usize) {
        if let Some(p) = self.process(i) {
            p.kill();
        }
    }

    async fn restart(&mut self, i: usize) -> io::Result<()> {
        match self {
            Started::Redis(nodes) => match nodes.get_mut(i) {
                Some(n) => n.restart().await,
                None => Ok(()),
            },
            Started::Replicated(pair) => match i {
                0 => pair.primary.restart().await,
                _ => pair.replica.restart().await,
            },
            Started::Sentinel(sentinel) => match sentinel.servers().get_mut(i) {
                Some(n) => n.restart().await,
                None => Ok(()),
            },
            Started::Cluster(cluster) => match cluster.nodes.servers().get_mut(i) {
                Some(n) => n.restart().await,
                None => Ok(()),
            },
            Started::Etcd(etcd) => match etcd.members().get_mut(i) {
                Some(m) => m.restart().await,
                None => Ok(()),
            },
            Started::ZooKeeper(zk) => match zk.servers().get_mut(i) {
                Some(s) => s.restart().await,
                None => Ok(()),
            },
            Started::Postgres(pg, _) => pg.restart().await,
        }
    }

    async fn leader(&mut self) -> usize {
        match self {
            Started::Etcd(etcd) => etcd.leader().await.unwrap_or(0),
            Started::ZooKeeper(zk) => {
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

    async fn serving(&mut self, key: &str) -> io::Result<usize> {
        match self {
            Started::Sentinel(sentinel) => sentinel.master().await,
            Started::Cluster(cluster) => {
                let slot = cluster.nodes.slot_of(key).await?;
                cluster.nodes.master_of(slot).await
            }
            _ => Ok(self.leader().await),
        }
    }

    async fn failed_over(&mut self, key: &str, old: usize) -> io::Result<usize> {
        match self {
            Started::Sentinel(sentinel) => sentinel.master_other_than(Some(old)).await,
            Started::Cluster(cluster) => {
                let slot = cluster.nodes.slot_of(key).await?;
                cluster.nodes.master_other_than(slot, old).await
            }
            _ => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("no replica takes over from server {old} on its own"),
            )),
        }
    }

    async fn move_slot(&mut self, key: &str, step: SlotMove) -> io::Result<String> {
        match self {
            Started::Cluster(cluster) => cluster.move_slot(key, step).await,
            _ => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "the servers have no slots to move",
            )),
        }
    }

    async fn redis(&self, i: usize, args: &[&str]) -> io::Result<Option<String>> {
        let server = self
            .redis_server(i)
            .ok_or_else(|| io::Error::other(format!("server {i} is not a redis-server")))?;
        Ok(server.command(args).await?.text())
    }

    fn set_wall_clock(&self, i: usize, seconds: i64) -> io::Result<()> {
        match self {
            Started::Postgres(_, Some(clock)) if i == 0 => clock.set_offset(seconds),
            _ => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("server {i}'s clock cannot be moved: is libfaketime installed?"),
            )),
        }
    }

    fn replication(&self) -> Option<&FaultProxy> {
        match self {
            Started::Replicated(pair) => Some(&pair.link),
            _ => None,
        }
    }
}

/// A Redis Cluster, and the move of a slot under way.
#[derive(Debug)]
struct Cluster {
    nodes: RedisCluster,
    /// How many nodes.
    count: usize,
    /// The slot being moved, from which master to which.
    moving: Option<(u16, usize, usize)>,
}

impl Cluster {
    fn new(mut nodes: RedisCluster) -> Self {
        let count = nodes.servers().len();
        Cluster {
            nodes,
            count,
            moving: None,
        }
    }

    /// Takes `step` of moving `key`'s slot from its master to the next master.
    async fn move_slot(&mut self, key: &str, step: SlotMove) -> io::Result<String> {
        let (slot, from, to) = match (step, self.moving) {
            (SlotMove::Begin, _) => {
                let slot = self.nodes.slot_of(key).await?;
                let from = self.nodes.master_of(slot).await?;
                let mut masters = Vec::new();
                for i in 0..self.count {
                    if i != from && self.nodes.replicas_of(i).await.is_ok_and(|r| !r.is_empty()) {
                        masters.push(i);
                    }
                }
                let to = *masters.first().ok_or_else(|| {
                    io::Error::other(format!("no master other than server {from}"))
                })?;
                self.moving = Some((slot, from, to));
                (slot, from, to)
            }
            (_, Some(moving)) => moving,
            (_, None) => return Err(io::Error::other("no slot move was begun")),
        };
        match step {
            SlotMove::Begin => {
                self.nodes.begin_migration(slot, from, to).await?;
                Ok(format!(
                    "slot {slot}: server {from} migrates it to server {to}"
                ))
            }
            SlotMove::Keys => {
                let moved = self.nodes.migrate_keys(slot, from, to).await?;
                Ok(format!("slot {slot}: {moved} keys moved to server {to}"))
            }
            SlotMove::End => {
                self.nodes.end_migration(slot, to).await?;
                self.moving = None;
                Ok(format!("slot {slot}: served by server {to}"))
            }
        }
    }
}

/// A Redis primary and its asynchronous replica, replicating through a fault proxy.
#[derive(Debug)]
struct Replicated {
    primary: Redis,
    replica: Redis,
    /// The replication link (the replica connects to the primary through it).
    link: FaultProxy,
}

/// Starts a primary and a replica that replicates through a fault proxy.
///
/// Replication can then be held back (bytes held in the proxy, then dropped), which
/// pausing the replica cannot do: what the primary sent waits in the replica's socket and
/// is applied on resume.
async fn replicated() -> io::Result<Replicated> {
    let primary = Redis::start().await?;
    let link = FaultProxy::start(primary.addr()).await?;
    let replica = Redis::builder()
        .config("replicaof", &format!("127.0.0.1 {}", link.port()))
        .start()
        .await?;
    let started = Instant::now();
    loop {
        let info = replica.command(&["INFO", "replication"]).await?;
        if info
            .text()
            .is_some_and(|t| t.contains("master_link_status:up"))
        {
            break;
        }
        if started.elapsed() > Duration::from_secs(30) {
            return Err(io::Error::other(
                "the replica did not connect to its primary",
            ));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    Ok(Replicated {
        primary,
        replica,
        link,
    })
}

/// A server's wall clock, moved through libfaketime's control file.
#[derive(Debug)]
struct ServerWallClock {
    dir: tempfile::TempDir,
}

impl ServerWallClock {
    fn new() -> io::Result<Self> {
        let dir = tempfile::tempdir()?;
        // The server may run as the `postgres` user.
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )?;
        let clock = ServerWallClock { dir };
        clock.set_offset(0)?;
        Ok(clock)
    }

    fn control(&self) -> PathBuf {
        self.dir.path().join("faketime")
    }

    /// Moves the server's wall clock to the real one plus `seconds`.
    /// Every server process sees it at its next clock reading.
    fn set_offset(&self, seconds: i64) -> io::Result<()> {
        std::fs::write(self.control(), format!("{seconds:+}\n"))
    }
}

/// PostgreSQL (lease mode), under libfaketime where it is installed.
/// So scenario 10 can move the server's wall clock (the one its leases are counted on).
async fn postgres() -> io::Result<Started> {
    let clock = ServerWallClock::new()?;
    match Postgres::builder().faketime(&clock.control()).start().await {
        Ok(pg) => Ok(Started::Postgres(pg, Some(clock))),
        // Without libfaketime every scenario but the server clock jump still runs.
        Err(e) if e.kind() == io::ErrorKind::NotFound && e.to_string().contains("libfaketime") => {
            Ok(Started::Postgres(Postgres::start().await?, None))
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_sentinel_urls_name_the_master_the_sentinels_know() {
        let spec = &leasehold_chaos::deploy::redis_sentinel::SPEC;
        let url = (spec.url)(&["127.0.0.1:1".into()], std::time::Duration::ZERO);
        assert!(
            url.ends_with(&format!("/{}", leasehold_testkit::SENTINEL_MASTER)),
            "{url}"
        );
    }
}
