//! redis-server: single servers, Redlock sets, a replicated pair, a Sentinel set-up.
//! A Cluster is in `redis_cluster.rs`.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use tempfile::TempDir;

use super::{ClientAuth, READY_LIMIT, loopback, os, with_retries, write_test_certificates};
use crate::probe::{Resp, redis_command, redis_commands};
use crate::process::{ServerProcess, find_program, free_port, wait_ready};

/// A redis-server on a free loopback port, without persistence unless configured.
#[derive(Debug)]
pub struct Redis {
    process: ServerProcess,
    port: u16,
    /// The TLS port, for a server built with [`RedisBuilder::tls`].
    tls_port: Option<u16>,
    dir: TempDir,
}

/// Options for a [`Redis`] server.
#[derive(Debug, Clone, Default)]
pub struct RedisBuilder {
    config: Vec<(String, String)>,
    tls: Option<ClientAuth>,
    /// A directory whose test CA and certificates TLS uses, instead of new ones.
    tls_from: Option<PathBuf>,
}

impl RedisBuilder {
    /// Adds `--name value` to the command line (e.g. `maxmemory-policy`, `appendonly`).
    pub fn config(mut self, name: &str, value: &str) -> Self {
        self.config.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Also serves TLS on a second port.
    /// It has a certificate of a test CA generated for this server (see
    /// [`Redis::tls_url`]); the plain port stays for administration.
    pub fn tls(mut self, clients: ClientAuth) -> Self {
        self.tls = Some(clients);
        self
    }

    /// Serves TLS with the test CA and certificates of another TLS server.
    /// As [`tls`](RedisBuilder::tls) otherwise. Servers that talk to each other over TLS (a Cluster's bus, replication) need one CA.
    pub fn tls_like(mut self, clients: ClientAuth, other: &Redis) -> Self {
        self.tls = Some(clients);
        self.tls_from = Some(other.dir().to_owned());
        self
    }

    /// Starts the server and waits until it answers PING.
    ///
    /// # Errors
    ///
    /// If redis-server is not installed or does not become ready.
    pub async fn start(self) -> io::Result<Redis> {
        let program = find_program("redis-server", &[])?;
        with_retries(async || {
            let dir = tempfile::tempdir()?;
            let port = free_port();
            let mut args = vec![
                "--port".to_owned(),
                port.to_string(),
                "--bind".into(),
                "127.0.0.1".into(),
                "--dir".into(),
                dir.path().display().to_string(),
                "--save".into(),
                String::new(),
                "--appendonly".into(),
                "no".into(),
                "--daemonize".into(),
                "no".into(),
                "--protected-mode".into(),
                "no".into(),
                "--repl-diskless-sync-delay".into(),
                "0".into(),
                "--logfile".into(),
                String::new(),
            ];
            let tls_port = match self.tls {
                Some(clients) => {
                    match &self.tls_from {
                        Some(from) => {
                            for entry in std::fs::read_dir(from)? {
                                let path = entry?.path();
                                if path.extension().is_some_and(|e| e == "crt" || e == "key")
                                    && let Some(name) = path.file_name()
                                {
                                    std::fs::copy(&path, dir.path().join(name))?;
                                }
                            }
                        }
                        None => write_test_certificates(dir.path())?,
                    }
                    let tls_port = free_port();
                    let file = |name: &str| dir.path().join(name).display().to_string();
                    let auth = match clients {
                        ClientAuth::Optional => "optional",
                        ClientAuth::Required => "yes",
                    };
                    args.extend([
                        "--tls-port".to_owned(),
                        tls_port.to_string(),
                        "--tls-cert-file".into(),
                        file("server.crt"),
                        "--tls-key-file".into(),
                        file("server.key"),
                        "--tls-ca-cert-file".into(),
                        file("ca.crt"),
                        "--tls-auth-clients".into(),
                        auth.into(),
                    ]);
                    Some(tls_port)
                }
                None => None,
            };
            for (name, value) in &self.config {
                args.push(format!("--{name}"));
                args.push(value.clone());
            }
            let process = ServerProcess::start(
                "redis-server",
                &program,
                os(&args),
                dir.path().join("redis.log"),
            )?;
            let mut redis = Redis {
                process,
                port,
                tls_port,
                dir,
            };
            redis.wait_ready().await?;
            Ok(redis)
        })
        .await
    }
}

impl Redis {
    /// A server with the defaults: no persistence, `noeviction`.
    ///
    /// # Errors
    ///
    /// As for [`RedisBuilder::start`].
    pub async fn start() -> io::Result<Redis> {
        Self::builder().start().await
    }

    /// A builder to add configuration.
    pub fn builder() -> RedisBuilder {
        RedisBuilder::default()
    }

    async fn wait_ready(&mut self) -> io::Result<()> {
        let addr = self.addr();
        wait_ready(&mut self.process, self.port, READY_LIMIT, async || {
            redis_command(addr, &["PING"]).await.ok() == Some(Resp::Simple("PONG".into()))
        })
        .await
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:port`.
    pub fn addr(&self) -> SocketAddr {
        loopback(self.port)
    }

    /// `redis://127.0.0.1:port`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The TLS port of a server built with [`RedisBuilder::tls`].
    pub fn tls_port(&self) -> Option<u16> {
        self.tls_port
    }

    /// `rediss://127.0.0.1:tls-port?tls_ca=…` for a server built with [`RedisBuilder::tls`].
    /// The TLS port, trusting the test CA.
    pub fn tls_url(&self) -> Option<String> {
        let ca = self.tls_file("ca.crt")?;
        Some(format!(
            "rediss://127.0.0.1:{}?tls_ca={}",
            self.tls_port?,
            ca.display()
        ))
    }

    /// A file of the test CA of a TLS server: `ca.crt`, `client.crt`, `client.key`, ….
    pub fn tls_file(&self, name: &str) -> Option<PathBuf> {
        self.tls_port.map(|_| self.dir.path().join(name))
    }

    /// The server's data directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Runs one command (for administration from a test).
    ///
    /// # Errors
    ///
    /// I/O errors and timeouts; an error reply is `Ok(Resp::Error(..))`.
    pub async fn command(&self, args: &[&str]) -> io::Result<Resp> {
        redis_command(self.addr(), args).await
    }

    /// Runs commands one after another on one connection; every reply.
    ///
    /// # Errors
    ///
    /// As for [`command`](Redis::command).
    pub async fn commands(&self, commands: &[&[&str]]) -> io::Result<Vec<Resp>> {
        redis_commands(self.addr(), commands).await
    }

    /// How many scripts (`EVALSHA`) the server has run since its statistics were reset.
    ///
    /// # Errors
    ///
    /// As for [`command`](Redis::command), and `InvalidData` for an `INFO` reply that is
    /// not text.
    pub async fn scripts_run(&self) -> io::Result<u64> {
        let Resp::Bulk(Some(info)) = self.command(&["INFO", "commandstats"]).await? else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "INFO gave no text",
            ));
        };
        Ok(String::from_utf8_lossy(&info)
            .lines()
            .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0))
    }

    /// The process (pause, resume, kill, log).
    pub fn process(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    /// SIGSTOP.
    pub fn pause(&self) {
        self.process.pause();
    }

    /// SIGCONT.
    pub fn resume(&self) {
        self.process.resume();
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// Kills the server if it runs and starts it again on the same port.
    /// Without persistence it comes back empty.
    ///
    /// # Errors
    ///
    /// If it does not come back.
    pub async fn restart(&mut self) -> io::Result<()> {
        self.process.restart()?;
        self.wait_ready().await
    }
}

/// `n` independent redis-servers (for Redlock).
///
/// # Errors
///
/// As for [`Redis::start`].
pub async fn redis_servers(n: usize) -> io::Result<Vec<Redis>> {
    let mut servers = Vec::with_capacity(n);
    for _ in 0..n {
        servers.push(Redis::start().await?);
    }
    Ok(servers)
}

/// A primary and a replica, replicating (asynchronously, as Redis does).
#[derive(Debug)]
#[non_exhaustive]
pub struct RedisReplicated {
    /// The primary.
    pub primary: Redis,
    /// The replica (read-only).
    pub replica: Redis,
}

impl RedisReplicated {
    /// Starts both and waits until the replica's link to the primary is up.
    ///
    /// # Errors
    ///
    /// If either does not start or the link does not come up.
    pub async fn start() -> io::Result<Self> {
        let primary = Redis::start().await?;
        let replica = Redis::replica_of(primary.port()).await?;
        Ok(Self { primary, replica })
    }
}

impl Redis {
    /// A replica of the server on `primary_port`, once its link to it is up.
    async fn replica_of(primary_port: u16) -> io::Result<Redis> {
        let mut replica = Redis::builder()
            .config("replicaof", &format!("127.0.0.1 {primary_port}"))
            .start()
            .await?;
        let addr = replica.addr();
        let port = replica.port;
        wait_ready(&mut replica.process, port, READY_LIMIT, async || {
            redis_command(addr, &["INFO", "replication"])
                .await
                .ok()
                .and_then(|r| r.text())
                .is_some_and(|info| info.contains("master_link_status:up"))
        })
        .await?;
        Ok(replica)
    }
}

/// The name the sentinels of a [`RedisSentinel`] know their master by.
pub const SENTINEL_MASTER: &str = "leasehold-master";

/// A master, its replicas and the sentinels that watch it (Redis Sentinel), on loopback.
/// Server 0 starts as the master. The sentinels see the master down after 1 s without an
/// answer and need a majority of them to agree.
#[derive(Debug)]
pub struct RedisSentinel {
    servers: Vec<Redis>,
    sentinels: Vec<(ServerProcess, u16)>,
    _dir: TempDir,
}

impl RedisSentinel {
    /// A master with `replicas` replicas, watched by `sentinels` sentinels.
    /// It is ready when the replicas' links are up and every sentinel knows them.
    ///
    /// # Errors
    ///
    /// If a server or sentinel does not start, or the sentinels do not learn the set-up
    /// in time.
    pub async fn start(replicas: usize, sentinels: usize) -> io::Result<Self> {
        let master = Redis::start().await?;
        let master_port = master.port();
        let mut servers = vec![master];
        for _ in 0..replicas {
            servers.push(Redis::replica_of(master_port).await?);
        }
        let dir = tempfile::tempdir()?;
        let quorum = sentinels / 2 + 1;
        let mut watching = Vec::with_capacity(sentinels);
        for i in 0..sentinels {
            let known = async |addr| {
                let known = redis_command(addr, &["SENTINEL", "REPLICAS", SENTINEL_MASTER]);
                matches!(known.await, Ok(Resp::Array(Some(r))) if r.len() == replicas)
            };
            watching.push(
                start_sentinel(dir.path(), &format!("{i}"), master_port, quorum, known).await?,
            );
        }
        Ok(Self {
            servers,
            sentinels: watching,
            _dir: dir,
        })
    }

    /// A sentinel of its own that names server `server` as the master, with its port.
    /// Whatever that server is: a sentinel that is behind, for the clients to see through.
    /// Alone and with a quorum of 2 it never fails anything over.
    ///
    /// # Errors
    ///
    /// If it does not start.
    pub async fn stray_sentinel(&mut self, server: usize) -> io::Result<(ServerProcess, u16)> {
        let port = self.servers[server].port();
        let names = async |addr| {
            let named = redis_command(
                addr,
                &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_MASTER],
            );
            matches!(named.await, Ok(Resp::Array(Some(_))))
        };
        start_sentinel(self._dir.path(), "stray", port, 2, names).await
    }

    /// `redis+sentinel://127.0.0.1:p1,127.0.0.1:p2,…/leasehold-master`.
    pub fn url(&self) -> String {
        let sentinels: Vec<String> = self
            .sentinels
            .iter()
            .map(|(_, port)| format!("127.0.0.1:{port}"))
            .collect();
        format!("redis+sentinel://{}/{SENTINEL_MASTER}", sentinels.join(","))
    }

    /// The servers: master and replicas (which is which changes with failovers).
    pub fn servers(&mut self) -> &mut [Redis] {
        &mut self.servers
    }

    /// Server `i`, if there is one (see [`servers`](RedisSentinel::servers)).
    pub fn server(&self, i: usize) -> Option<&Redis> {
        self.servers.get(i)
    }

    /// The sentinels' addresses.
    pub fn sentinel_addrs(&self) -> Vec<SocketAddr> {
        self.sentinels
            .iter()
            .map(|(_, port)| loopback(*port))
            .collect()
    }

    /// The sentinels' processes.
    pub fn sentinels(&mut self) -> impl Iterator<Item = &mut ServerProcess> {
        self.sentinels.iter_mut().map(|(process, _)| process)
    }

    /// Waits until every sentinel knows every other one.
    /// Sentinels find each other through the master (a hello every 2 s); until they do, a
    /// master that fails is not failed over (no majority agrees it is down).
    ///
    /// # Errors
    ///
    /// If that does not happen within the start-up limit.
    pub async fn until_sentinels_know_each_other(&self) -> io::Result<()> {
        let started = std::time::Instant::now();
        let others = self.sentinels.len() - 1;
        'poll: loop {
            for (_, port) in &self.sentinels {
                let known =
                    redis_command(loopback(*port), &["SENTINEL", "SENTINELS", SENTINEL_MASTER]);
                if !matches!(known.await, Ok(Resp::Array(Some(s))) if s.len() == others) {
                    if started.elapsed() > READY_LIMIT {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("the sentinels did not find each other within {READY_LIMIT:?}"),
                        ));
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue 'poll;
                }
            }
            return Ok(());
        }
    }

    /// How many connections are subscribed to something on the sentinels (`CLIENT LIST`).
    /// Sentinels subscribe to each other's hellos on the servers, not on one another, so
    /// these are clients' connections.
    ///
    /// # Errors
    ///
    /// If a sentinel does not answer.
    pub async fn subscribers(&self) -> io::Result<usize> {
        let mut count = 0;
        for (_, port) in &self.sentinels {
            let clients = redis_command(loopback(*port), &["CLIENT", "LIST"])
                .await?
                .text()
                .unwrap_or_default();
            count += clients
                .lines()
                .filter(|client| !client.contains(" sub=0 ") || !client.contains(" psub=0 "))
                .count();
        }
        Ok(count)
    }

    /// The server every sentinel of the set names as the master.
    /// It is returned once that server says it is one.
    ///
    /// # Errors
    ///
    /// If that does not happen within the start-up limit.
    pub async fn master(&self) -> io::Result<usize> {
        self.master_other_than(None).await
    }

    /// Makes the first sentinel fail the master over to a replica (`SENTINEL FAILOVER`).
    /// It waits until the sentinels name the new master and it says it is one.
    /// Its index among [`servers`](RedisSentinel::servers).
    ///
    /// # Errors
    ///
    /// If the sentinel refuses, or the new master is not in place within the start-up limit.
    pub async fn failover(&self) -> io::Result<usize> {
        let old = self.master().await?;
        let answer = redis_command(
            loopback(self.sentinels[0].1),
            &["SENTINEL", "FAILOVER", SENTINEL_MASTER],
        )
        .await?;
        if let Resp::Error(e) = answer {
            return Err(io::Error::other(format!("SENTINEL FAILOVER: {e}")));
        }
        self.master_other_than(Some(old)).await
    }

    /// Waits until every sentinel names one server other than `old` as the master.
    /// And until that server says it is one.
    ///
    /// # Errors
    ///
    /// If that does not happen within the start-up limit.
    pub async fn master_other_than(&self, old: Option<usize>) -> io::Result<usize> {
        let started = std::time::Instant::now();
        loop {
            if let Some(master) = self.agreed_master().await
                && Some(master) != old
                && redis_command(self.servers[master].addr(), &["ROLE"])
                    .await
                    .ok()
                    .is_some_and(|role| matches!(role, Resp::Array(Some(r)) if r.first().and_then(Resp::text).as_deref() == Some("master")))
            {
                return Ok(master);
            }
            if started.elapsed() > READY_LIMIT {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the sentinels named no new master within {READY_LIMIT:?}"),
                ));
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// The server every sentinel names as the master, if they agree.
    async fn agreed_master(&self) -> Option<usize> {
        let mut named = None;
        for (_, port) in &self.sentinels {
            let answer = redis_command(
                loopback(*port),
                &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_MASTER],
            )
            .await
            .ok()?;
            let Resp::Array(Some(address)) = answer else {
                return None;
            };
            let port: u16 = address.get(1)?.text()?.parse().ok()?;
            let index = self.servers.iter().position(|s| s.port() == port)?;
            if named.is_some_and(|n| n != index) {
                return None;
            }
            named = Some(index);
        }
        named
    }
}

/// A sentinel watching the master on `master_port` under [`SENTINEL_MASTER`].
/// Its files are in `dir`, named after `name`; it is started once `ready` says so of its
/// address.
async fn start_sentinel(
    dir: &Path,
    name: &str,
    master_port: u16,
    quorum: usize,
    mut ready: impl AsyncFnMut(SocketAddr) -> bool,
) -> io::Result<(ServerProcess, u16)> {
    let program = find_program("redis-server", &[])?;
    with_retries(async || {
        let port = free_port();
        let config = dir.join(format!("sentinel-{name}.conf"));
        std::fs::write(
            &config,
            format!(
                "port {port}\nbind 127.0.0.1\nprotected-mode no\ndaemonize no\n\
                 dir {dir}\nlogfile \"\"\n\
                 sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {master_port} {quorum}\n\
                 sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n\
                 sentinel failover-timeout {SENTINEL_MASTER} 5000\n\
                 sentinel parallel-syncs {SENTINEL_MASTER} 1\n",
                dir = dir.display()
            ),
        )?;
        let mut process = ServerProcess::start(
            &format!("redis-sentinel {name}"),
            &program,
            vec![config.into_os_string(), "--sentinel".into()],
            dir.join(format!("sentinel-{name}.log")),
        )?;
        let addr = loopback(port);
        wait_ready(&mut process, port, READY_LIMIT, async || ready(addr).await).await?;
        Ok((process, port))
    })
    .await
}
