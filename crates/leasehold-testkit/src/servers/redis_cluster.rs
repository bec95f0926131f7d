//! A Redis Cluster on loopback: masters and their replicas, made with `redis-cli --cluster create`.

use std::io;
use std::time::Duration;

use super::ClientAuth;
use super::redis::Redis;
use super::{READY_LIMIT, with_retries};
use crate::probe::Resp;
use crate::process::{find_program, free_port, wait_ready};

/// A Redis Cluster of real redis-servers with `cluster-enabled yes`, on loopback.
/// Servers `0..masters` start as the masters (the slots split evenly between them), the
/// rest as their replicas. A node is seen failing after the node timeout without an answer
/// (`cluster-node-timeout`, 5 s unless set), after which a replica of a failed master
/// takes its place.
#[derive(Debug)]
pub struct RedisCluster {
    servers: Vec<Redis>,
    /// Whether clients, the cluster bus and replication speak TLS.
    tls: bool,
}

impl RedisCluster {
    /// `masters` masters with `replicas` replicas each, once it is ready.
    /// It is ready when every node agrees that all slots are served and every replica's
    /// link to its master is up.
    ///
    /// # Errors
    ///
    /// If a server does not start, `redis-cli --cluster create` fails, or the cluster does
    /// not become ready in time.
    pub async fn start(masters: usize, replicas: usize) -> io::Result<Self> {
        Self::with_node_timeout(masters, replicas, Duration::from_secs(5)).await
    }

    /// As [`start`](RedisCluster::start), with a node seen failing after `node_timeout`.
    /// A short one makes failovers quick, and a loaded machine may see a node failing.
    ///
    /// # Errors
    ///
    /// As for [`start`](RedisCluster::start).
    pub async fn with_node_timeout(
        masters: usize,
        replicas: usize,
        node_timeout: Duration,
    ) -> io::Result<Self> {
        Self::create(masters, replicas, node_timeout, false).await
    }

    /// As [`start`](RedisCluster::start), over TLS.
    /// Clients, the cluster bus and replication speak TLS. Every node has the same test CA (see [`tls_url`](RedisCluster::tls_url)); each
    /// keeps a plain port for administration, where it names the others' plain ports.
    ///
    /// # Errors
    ///
    /// As for [`start`](RedisCluster::start).
    pub async fn with_tls(masters: usize, replicas: usize) -> io::Result<Self> {
        Self::create(masters, replicas, Duration::from_secs(5), true).await
    }

    async fn create(
        masters: usize,
        replicas: usize,
        node_timeout: Duration,
        tls: bool,
    ) -> io::Result<Self> {
        let node_timeout = node_timeout.as_millis().to_string();
        let mut servers: Vec<Redis> = Vec::with_capacity(masters * (1 + replicas));
        for _ in 0..masters * (1 + replicas) {
            // The cluster bus port is chosen too: Redis's default, the port + 10 000, is
            // past 65 535 for a fifth of the ports Linux hands out (32768-60999).
            let first = servers.first();
            let node = with_retries(async || {
                let mut node = Redis::builder()
                    .config("cluster-enabled", "yes")
                    .config("cluster-config-file", "nodes.conf")
                    .config("cluster-node-timeout", &node_timeout)
                    .config("cluster-port", &free_port().to_string());
                if tls {
                    node = match first {
                        Some(first) => node.tls_like(ClientAuth::Optional, first),
                        None => node.tls(ClientAuth::Optional),
                    }
                    .config("tls-cluster", "yes")
                    .config("tls-replication", "yes");
                }
                node.start().await
            });
            servers.push(node.await?);
        }
        let cli = find_program("redis-cli", &[])?;
        let mut args = Vec::new();
        if let Some(ca) = servers[0].tls_file("ca.crt").filter(|_| tls) {
            args.extend(["--tls".to_owned(), "--cacert".to_owned()]);
            args.push(ca.display().to_string());
        }
        args.extend(["--cluster".to_owned(), "create".to_owned()]);
        args.extend(servers.iter().map(|s| match s.tls_port().filter(|_| tls) {
            Some(port) => format!("127.0.0.1:{port}"),
            None => s.addr().to_string(),
        }));
        args.extend([
            "--cluster-replicas".to_owned(),
            replicas.to_string(),
            "--cluster-yes".to_owned(),
        ]);
        let out = tokio::process::Command::new(&cli)
            .args(&args)
            .output()
            .await?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "redis-cli {}: {}{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let mut cluster = RedisCluster { servers, tls };
        cluster.until_settled().await?;
        Ok(cluster)
    }

    /// Waits until the cluster has settled.
    /// Every node serving says the cluster is ok with every slot assigned and all nodes
    /// known, and every replica's link to its master is up.
    ///
    /// # Errors
    ///
    /// If that does not happen in time.
    pub async fn until_settled(&mut self) -> io::Result<()> {
        let addrs: Vec<_> = self.servers.iter().map(Redis::addr).collect();
        let total = addrs.len();
        let Some(live) = (self.servers.iter_mut()).position(|s| !s.process().exited()) else {
            return Err(io::Error::other("every node of the cluster is down"));
        };
        let port = self.servers[live].port();
        wait_ready(
            self.servers[live].process(),
            port,
            READY_LIMIT,
            async || {
                for addr in &addrs {
                    let Ok(replies) = crate::probe::redis_commands(
                        *addr,
                        &[&["CLUSTER", "INFO"], &["INFO", "replication"]],
                    )
                    .await
                    else {
                        continue; // A node killed by the test.
                    };
                    let (info, replication) = match &replies[..] {
                        [info, replication] => (
                            info.text().unwrap_or_default(),
                            replication.text().unwrap_or_default(),
                        ),
                        _ => return false,
                    };
                    let settled = info.contains("cluster_state:ok")
                        && info.contains("cluster_slots_assigned:16384")
                        && info.contains(&format!("cluster_known_nodes:{total}"));
                    let linked = !replication.contains("role:slave")
                        || replication.contains("master_link_status:up");
                    if !settled || !linked {
                        return false;
                    }
                }
                true
            },
        )
        .await
    }

    /// `redis+cluster://127.0.0.1:p1,127.0.0.1:p2,…`: every node.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self.servers.iter().map(|s| s.addr().to_string()).collect();
        format!("redis+cluster://{}", nodes.join(","))
    }

    /// `rediss+cluster://127.0.0.1:t1,…?tls_ca=…`: every node's TLS port.
    /// It trusts the test CA; `None` unless started [`with_tls`](RedisCluster::with_tls).
    pub fn tls_url(&self) -> Option<String> {
        if !self.tls {
            return None;
        }
        let ca = self.servers.first()?.tls_file("ca.crt")?;
        let nodes: Vec<String> = (self.servers.iter())
            .filter_map(|s| s.tls_port().map(|port| format!("127.0.0.1:{port}")))
            .collect();
        Some(format!(
            "rediss+cluster://{}?tls_ca={}",
            nodes.join(","),
            ca.display()
        ))
    }

    /// The servers, masters first as started.
    /// See [`master_of`](RedisCluster::master_of) for who serves a slot now.
    pub fn servers(&mut self) -> &mut [Redis] {
        &mut self.servers
    }

    /// The server `i`.
    pub fn server(&self, i: usize) -> &Redis {
        &self.servers[i]
    }

    /// The slot of `key` (`CLUSTER KEYSLOT`).
    ///
    /// # Errors
    ///
    /// If no node answers it.
    pub async fn slot_of(&self, key: &str) -> io::Result<u16> {
        for server in &self.servers {
            if let Ok(Resp::Integer(slot)) = server.command(&["CLUSTER", "KEYSLOT", key]).await {
                return u16::try_from(slot).map_err(io::Error::other);
            }
        }
        Err(io::Error::other("no cluster node answers CLUSTER KEYSLOT"))
    }

    /// The node id of server `i` (`CLUSTER MYID`).
    ///
    /// # Errors
    ///
    /// If it does not answer.
    pub async fn id_of(&self, i: usize) -> io::Result<String> {
        self.servers[i]
            .command(&["CLUSTER", "MYID"])
            .await?
            .text()
            .ok_or_else(|| io::Error::other("CLUSTER MYID gave no id"))
    }

    /// The server that serves `slot` as its master now, as the first node answering says.
    ///
    /// # Errors
    ///
    /// If no node answers, or the master it names is not one of these servers.
    pub async fn master_of(&self, slot: u16) -> io::Result<usize> {
        for server in &self.servers {
            let Ok(Resp::Array(Some(ranges))) = server.command(&["CLUSTER", "SLOTS"]).await else {
                continue;
            };
            for range in ranges {
                let Resp::Array(Some(parts)) = range else {
                    continue;
                };
                let bound = |i: usize| match parts.get(i) {
                    Some(Resp::Integer(n)) => *n,
                    _ => -1,
                };
                if !(bound(0)..=bound(1)).contains(&i64::from(slot)) {
                    continue;
                }
                let port = match parts.get(2) {
                    Some(Resp::Array(Some(master))) => match master.get(1) {
                        Some(Resp::Integer(port)) => *port,
                        _ => -1,
                    },
                    _ => -1,
                };
                return self
                    .servers
                    .iter()
                    .position(|s| i64::from(s.port()) == port)
                    .ok_or_else(|| io::Error::other(format!("slot {slot}: no server on {port}")));
            }
        }
        Err(io::Error::other(format!(
            "no node says who serves slot {slot}"
        )))
    }

    /// The servers that replicate server `master` now, as each server's `ROLE` says.
    /// A master learns of its replicas by gossip, later.
    ///
    /// # Errors
    ///
    /// If a live server does not answer `ROLE`.
    pub async fn replicas_of(&self, master: usize) -> io::Result<Vec<usize>> {
        let port = i64::from(self.servers[master].port());
        let mut replicas = Vec::new();
        for (i, server) in self.servers.iter().enumerate() {
            let Ok(role) = server.command(&["ROLE"]).await else {
                continue; // A server killed by the test.
            };
            // A replica: `slave <master ip> <master port> <state> <offset>`.
            if let Resp::Array(Some(parts)) = &role
                && parts.first().and_then(Resp::text).as_deref() == Some("slave")
                && parts.get(2) == Some(&Resp::Integer(port))
            {
                replicas.push(i);
            }
        }
        Ok(replicas)
    }

    /// Has a replica of the master of `slot` take its place, and returns it.
    /// It is `CLUSTER FAILOVER`, which first lets the replica catch up; the new master is
    /// returned once the cluster has settled.
    /// A manual failover that does not finish within Redis's 5 s is dropped by Redis (on
    /// a loaded machine it can be): it is asked for again, a few times.
    ///
    /// # Errors
    ///
    /// If the master has no replica, or the failover does not happen in time.
    pub async fn failover(&mut self, slot: u16) -> io::Result<usize> {
        let old = self.master_of(slot).await?;
        let Some(&replica) = self.replicas_of(old).await?.first() else {
            return Err(io::Error::other(format!("server {old} has no replica")));
        };
        for _ in 0..5 {
            expect_ok(
                self.servers[replica]
                    .command(&["CLUSTER", "FAILOVER"])
                    .await?,
            )?;
            let give_up = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while std::time::Instant::now() < give_up {
                let role = self.servers[replica].command(&["ROLE"]).await?;
                if matches!(&role, Resp::Array(Some(parts))
                    if parts.first().and_then(Resp::text).as_deref() == Some("master"))
                {
                    self.until_settled().await?;
                    return Ok(replica);
                }
                // No event to await from outside the server: asked again shortly.
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("server {replica} did not take over from server {old}"),
        ))
    }

    /// Waits until a server other than `old` serves `slot` as master, and returns it.
    /// The cluster has settled by then (for example after `old` was killed).
    ///
    /// # Errors
    ///
    /// If that does not happen in time.
    pub async fn master_other_than(&mut self, slot: u16, old: usize) -> io::Result<usize> {
        let give_up = std::time::Instant::now() + READY_LIMIT;
        loop {
            match self.master_of(slot).await {
                Ok(new) if new != old => {
                    self.until_settled().await?;
                    return Ok(new);
                }
                _ if std::time::Instant::now() > give_up => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("slot {slot} stayed with server {old}"),
                    ));
                }
                // No event to await from outside the servers: asked again shortly.
                _ => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            }
        }
    }

    /// Starts moving `slot` from server `from` to server `to` (both masters).
    /// `to` imports it and `from` migrates it (`CLUSTER SETSLOT … IMPORTING/MIGRATING`).
    /// From now on `from` answers `ASK` for the slot's keys it no longer has.
    ///
    /// # Errors
    ///
    /// If a node refuses.
    pub async fn begin_migration(&self, slot: u16, from: usize, to: usize) -> io::Result<()> {
        let slot = slot.to_string();
        let (from_id, to_id) = (self.id_of(from).await?, self.id_of(to).await?);
        expect_ok(
            self.servers[to]
                .command(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id])
                .await?,
        )?;
        expect_ok(
            self.servers[from]
                .command(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id])
                .await?,
        )
    }

    /// Moves every key of `slot` still on `from` to `to`, and says how many.
    /// It is `MIGRATE`, a batch at a time.
    ///
    /// # Errors
    ///
    /// If a node refuses.
    pub async fn migrate_keys(&self, slot: u16, from: usize, to: usize) -> io::Result<usize> {
        let slot = slot.to_string();
        let port = self.servers[to].port().to_string();
        let mut moved = 0;
        loop {
            let keys = match self.servers[from]
                .command(&["CLUSTER", "GETKEYSINSLOT", &slot, "100"])
                .await?
            {
                Resp::Array(Some(keys)) => keys.iter().filter_map(Resp::text).collect::<Vec<_>>(),
                other => return Err(io::Error::other(format!("GETKEYSINSLOT: {other:?}"))),
            };
            if keys.is_empty() {
                return Ok(moved);
            }
            let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
            args.extend(keys.iter().map(String::as_str));
            expect_ok(self.servers[from].command(&args).await?)?;
            moved += keys.len();
        }
    }

    /// Ends the move of `slot` to server `to`.
    /// Every master is told `to` serves the slot now (`CLUSTER SETSLOT … NODE`), `to` first.
    ///
    /// # Errors
    ///
    /// If a node refuses.
    pub async fn end_migration(&self, slot: u16, to: usize) -> io::Result<()> {
        let slot = slot.to_string();
        let to_id = self.id_of(to).await?;
        let mut order: Vec<usize> = vec![to];
        order.extend((0..self.servers.len()).filter(|&i| i != to));
        for i in order {
            let reply = self.servers[i]
                .command(&["CLUSTER", "SETSLOT", &slot, "NODE", &to_id])
                .await;
            // Replicas refuse SETSLOT ("only with masters"); they learn it from their
            // masters. A killed server does not answer.
            if let Ok(Resp::Error(e)) = &reply
                && !e.contains("only with masters")
            {
                return Err(io::Error::other(format!("SETSLOT NODE on server {i}: {e}")));
            }
        }
        Ok(())
    }
}

fn expect_ok(reply: Resp) -> io::Result<()> {
    match reply {
        Resp::Simple(s) if s == "OK" => Ok(()),
        Resp::Simple(s) if s == "NOKEY" => Ok(()),
        other => Err(io::Error::other(format!("expected OK, got {other:?}"))),
    }
}
